"""Ray start-up, node roles, explicit placement, and resource checks before anything starts.

Node roles come from resources. A node that offers the learners' placement
resource (``NPU`` or ``GPU``) is an accelerator host; every other node is a CPU
host. Learners are reserved as one placement group (bundles of CPU + one
accelerator each, packed so the all-reduce stays as local as it can);
rollout actors are pinned, round-robin, to CPU hosts with hard node
affinity, and each replay shard sits on the node of its first producer so
``add`` never crosses the network. When there are no CPU-only hosts (a single
machine), rollout actors go wherever Ray puts them.

Every check runs before the first actor is created, and a shortfall is one
line naming the resource, how much is needed and how much there is, instead
of actors that wait forever for resources that will never come.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
from dataclasses import dataclass, field

import ray
from ray._private import ray_constants
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from cluster.config import LOOPBACK, Config, ConfigError, check_address
from learner import device as devices  # the device table only: importing it does not import torch
# Its clocks are the protocol's (pipeline/protocol.py, LIMITS: each with the invariant it protects).
from pipeline.protocol import CONNECT_S, MONITOR_KILL_S, PLACEMENT_GROUP_TIMEOUT_S, RAYLET_CONNECT_MS
from pipeline.runtime import INPROCESS


class ResourceError(RuntimeError):
    """The cluster cannot satisfy the config; the message names the resource and how much."""


def required_cpus(cfg: Config) -> float:
    preprocess = cfg.preprocess.remote_actors if cfg.env.modalities else 0  # one CPU each (second tier)
    return (cfg.rollout_actors_at_start * cfg.rollout.num_cpus_per_actor + cfg.learner.num_learners * cfg.learner.num_cpus
            + preprocess)


def start_ray(cfg: Config, address: str | None) -> bool:
    """Join a cluster, or start an embedded one. Returns True if this process started Ray. ``inprocess`` (the
    argument, or ``ray.address``) starts nothing: the run's actors are threads of this process
    (``pipeline/runtime.py``); the argument is written into ``cfg.ray.address`` so the graph sees it too.

    The address comes from the argument (``--address``), else ``ray.address``, else RAY_ADDRESS; joining a cluster
    prints one line naming it. The embedded Ray starts only with token authentication unless
    ``ray.allow_unauthenticated`` says otherwise (``_unauthenticated_start``). A bad address or a refused start is
    a ConfigError naming where it came from."""
    source, address = next(((key, value) for key, value in (("--address", address), ("ray.address", cfg.ray.address),
                                                             ("RAY_ADDRESS", os.environ.get("RAY_ADDRESS"))) if value),
                           (None, None))
    if address == INPROCESS:
        cfg.ray.address = INPROCESS
        from cluster.config import validate

        validate(cfg)  # what the mode cannot do (several learners) is a config error, as for the key itself
        return False
    if address:
        check_address(address, source)
        # Something must listen there within CONNECT_S (a ConfigError line, not Ray's retries for minutes), and the
        # join itself must end within run.startup_timeout_s (a cluster that accepts and never answers: a stopped
        # GCS, a port that is not Ray's).
        join(reachable(address, source), deadline_s=cfg.run.startup_timeout_s, namespace="ascent_rl",
             log_to_driver=True)
        print(_attached_line(source, address), file=sys.stderr, flush=True)
        return False
    open_why = _unauthenticated_start(cfg)  # refuses, or says why it may start open
    num_cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, math.ceil(required_cpus(cfg)))
    listen = cfg.ray.listen_address
    node = {} if listen == "0.0.0.0" else {"_node_ip_address": listen}  # 0.0.0.0: the address Ray picks
    with _skip_local_extras(api_server=not cfg.ray.include_dashboard), _loopback_stays_loopback(listen == LOOPBACK):
        ray.init(
            # "local": always a new embedded instance, never whatever cluster /tmp/ray last registered.
            address="local",
            num_cpus=num_cpus,
            include_dashboard=cfg.ray.include_dashboard,
            dashboard_host="127.0.0.1",  # never exposed beyond this machine in local mode
            namespace="ascent_rl",
            log_to_driver=True,
            _system_config=LOCAL_RAY_SYSTEM_CONFIG,
            **node,
        )
    if open_why is None and not _token_auth_on():  # however Ray came to start it open: the same rule, once it has
        stop_ray()
        raise ConfigError(f"ray.allow_unauthenticated: false, and the embedded Ray started without token "
                          f"authentication (stopped again); {_OPEN_RISK}; allowed: a Ray with token authentication "
                          f"(RAY_AUTH_MODE unset or token), or ray.allow_unauthenticated: true")
    return True


@contextlib.contextmanager
def _loopback_stays_loopback(on: bool = True):
    """While ``ray.init`` runs (only then), 127.0.0.1 stays 127.0.0.1. Ray 2.60 keeps every port of a node on
    loopback (GCS, raylet, object manager, each worker's, the agents') exactly when the node's address is
    127.0.0.1; but ``ray.init`` turns 127.0.0.1, localhost and ::1, given as the node's address or as the address
    to join, into this machine's routable address first, unless Ray clusters are off (its switch for macOS and
    Windows, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``), in which case it keeps 127.0.0.1. So the switch is off while
    this process starts (or joins) a loopback Ray, and back on afterwards for anything else it starts. Measured on
    Ray 2.60 (``ss -ltnp``): without it, the GCS, raylet, worker and agent ports listen on every interface."""
    if not on:
        yield
        return
    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def _loopback(address: str) -> bool:
    """Whether a Ray address to join is a loopback GCS on this machine (``auto``: the one Ray would find)."""
    if address.startswith("ray://"):  # Ray Client: a connection to that host, nothing of this process's resolved
        return False
    if address == "auto":
        try:
            from ray._private import services

            address = services.get_ray_address_from_environment("auto", None) or ""
        except Exception:  # noqa: BLE001 - nothing found: ray.init says so itself
            return False
    host = address.rpartition(":")[0].strip("[]")
    return host in (LOOPBACK, "localhost", "::1")


def reachable(address: str, key: str = "--address") -> str:
    """Where to join: ``address`` (``auto`` resolved to the local cluster Ray finds: its address file, its running
    processes), with something listening there within CONNECT_S; else a ConfigError, one line naming ``key``."""
    import socket

    if address == "auto":
        from ray._private import services

        try:
            address = services.get_ray_address_from_environment("auto", None)
        except ConnectionError:
            raise ConfigError(f"{key}: auto finds no Ray cluster on this machine; allowed: the address of the cluster "
                              f"the run is on (--address host:port, or RAY_ADDRESS)") from None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_S).close()
    except (OSError, ValueError) as e:
        reason = "timed out" if isinstance(e, socket.timeout) else f"{type(e).__name__}: {getattr(e, 'strerror', 0) or e}"
        raise ConfigError(f"{key}: no Ray cluster answers at {address} ({reason}, within {CONNECT_S:g} s); allowed: "
                          f"the address of a running cluster (ray status on its head prints it)") from None
    return address


def join(address: str, deadline_s: float | None = None, deadline_key: str = "run.startup_timeout_s",
         **kwargs) -> None:
    """``ray.init(address=address, **kwargs)``, joining an existing cluster; a loopback one
    (``ray.listen_address: 127.0.0.1``, what a local run starts) at 127.0.0.1, where it listens, not at this
    machine's routable address, which Ray would try instead (and where nothing listens).

    ``deadline_s`` (the setting ``deadline_key``): a join still going after it ends the process, one line and exit 2. ``ray.init`` waits inside
    Ray's core (for the GCS's cluster id, retried without end) where nothing in Python can interrupt it, and a
    command that never ends is worse than one that ends without cleaning up: nothing of this process's own has
    started yet."""
    timer = None
    if deadline_s is not None:
        timer = threading.Timer(deadline_s, _join_too_late, args=(address, deadline_s, deadline_key))
        timer.daemon = True
        timer.start()
    try:
        with _loopback_stays_loopback(_loopback(address)):
            ray.init(address=address, **kwargs)
    finally:
        if timer is not None:
            timer.cancel()


def _join_too_late(address: str, deadline_s: float, deadline_key: str) -> None:
    from cluster import exits

    print(f"config error: the Ray cluster at {address} accepted a connection but did not let this process join "
          f"within {deadline_s:g} s ({deadline_key}): its GCS is stopped or overloaded, or the port is not a "
          f"Ray cluster's; allowed: the address of a running cluster (ray status on its head prints it)",
          file=sys.stderr, flush=True)
    os._exit(exits.BAD_INPUT.code)


#: What an embedded Ray without token authentication means, in the refusal and in the warning.
_OPEN_RISK = "anyone who reaches its ports can run code on this machine as this user"


def _unauthenticated_start(cfg: Config) -> str | None:
    """Whether the embedded Ray about to start runs without token authentication: None if it will have it. Ray
    decides from RAY_AUTH_MODE alone (ray._private.authentication.authentication_token_setup): unset, a new local
    Ray turns token authentication on (making ~/.ray/auth_token if there is none); set, only `token` (any case)
    turns it on. Without ray.allow_unauthenticated that start is refused here, before anything listens; with it,
    every start warns."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if not _ray_has_token_auth():
        why = f"Ray {ray.__version__} has no token authentication"
    elif mode is not None and mode.strip().lower() != "token":
        why = f"RAY_AUTH_MODE={mode!r} in the environment turns Ray's token authentication off"
    else:
        return None
    if not cfg.ray.allow_unauthenticated:
        raise ConfigError(f"ray.allow_unauthenticated: false, and the embedded Ray would start without token "
                          f"authentication ({why}; {_OPEN_RISK}); allowed: unset RAY_AUTH_MODE (or set it to token), "
                          f"or ray.allow_unauthenticated: true")
    print(f"warning: the embedded Ray starts without token authentication ({why}; ray.allow_unauthenticated: "
          f"true): {_OPEN_RISK}", file=sys.stderr, flush=True)
    return why


def _ray_has_token_auth() -> bool:
    try:
        from ray._private.authentication import authentication_utils  # noqa: F401 - Ray's token authentication
    except ImportError:
        return False
    return True


def _token_auth_on() -> bool:
    """Whether this process's Ray runs with token authentication (what Ray itself read from RAY_AUTH_MODE)."""
    if not _ray_has_token_auth():
        return False
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    return is_token_auth_enabled()


def _attached_line(source: str, address: str) -> str:
    """One line naming the cluster a run joined instead of starting its own: a RAY_ADDRESS left in a shell must not
    send a run elsewhere unseen."""
    where = address
    with contextlib.suppress(Exception):  # a Ray Client connection may not answer these; the address still says
        where = ray.get_runtime_context().gcs_address
    nodes = ""
    with contextlib.suppress(Exception):
        nodes = f", {sum(1 for n in ray.nodes() if n.get('Alive'))} live node(s)"
    auth = "on" if _token_auth_on() else "off"
    return (f"ray: attached to the existing cluster at {where} ({source}={address}{nodes}, token authentication "
            f"{auth}); it is not this run's to stop")


#: The embedded Ray's start-up, less a second spent waiting. The raylet's first connection to its own object store
#: fails (the store is not listening yet) and the retry waits the connect timeout, 1,000 ms by default: a 1.0 s gap
#: in every raylet.out, between the store's start and the object manager's. Retrying every RAYLET_CONNECT_MS
#: (50 ms), 200 times, keeps Ray's 10 s before giving up.
LOCAL_RAY_SYSTEM_CONFIG = {"raylet_client_connect_timeout_milliseconds": RAYLET_CONNECT_MS,
                           "raylet_client_num_connect_attempts": 200}


@contextlib.contextmanager
def _skip_local_extras(api_server: bool):
    """While the embedded Ray starts (only then: Ray's own methods are back afterwards, for any other Ray this process
    starts, such as a test's multi-node cluster or a head with the dashboard), two head processes an embedded
    single-node Ray does not need, and which take CPU from the run's own actors while they start (on 2 cores,
    start-up is CPU-bound):
    - the autoscaler's monitor (~0.3 s of CPU to start): there is nothing to scale on one machine;
    - without the dashboard, the "API server", which would only load the usage-stats module (Ray 2.60 loads the
      job and state modules only with the dashboard), and which ``ray.init`` waits ~0.8 s for.
    (Best effort: should Ray's internals move, Ray starts them as before.)"""
    try:
        from ray._private.node import Node
    except Exception:  # noqa: BLE001 - only a faster path to the same run
        yield
        return
    skipped = ["start_monitor"] + (["start_api_server"] if api_server else [])
    originals = {name: Node.__dict__[name] for name in skipped if name in Node.__dict__}
    for name in originals:
        setattr(Node, name, lambda self, **kwargs: None)
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(Node, name, method)


def kill_ray() -> None:
    """SIGKILL every process of the embedded Ray this process started, at once, for an exit that cannot wait (a
    second signal, the shutdown grace spent). SIGKILL, not SIGTERM: Ray's dashboard and runtime-env agents have
    been seen to ignore SIGTERM. The raylet's own children (those agents, the workers) are not among the processes
    Ray's node kills, and the agents outlived a killed raylet by seconds or more when tried (SIGTERM twice into a
    stuck run): they are collected first and killed with it. Best effort: the process is exiting anyway."""
    try:
        node = ray._private.worker._global_node
        if node is None:
            return
        started = [info.process.pid for infos in node.all_processes.values() for info in infos]
        children = _descendants(started)
        node.kill_all_processes(check_alive=False, allow_graceful=False)
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


def _descendants(pids: list[int]) -> list[int]:
    """Every live descendant of ``pids``, from /proc (Linux; elsewhere none)."""
    parent_of = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent_of[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], set(pids)
    while frontier:
        frontier = {pid for pid, parent in parent_of.items() if parent in frontier and pid not in found}
        found.extend(frontier)
    return found


def stop_ray() -> None:
    """``ray.shutdown()`` of the embedded Ray this process started, less the second it would spend on the
    autoscaler's monitor process. Ray stops its processes one after another, each with SIGTERM and up to 1 s before
    SIGKILL, and the monitor always uses up that second (measured: 1.01 of 1.36 s, the raylet 0.03, the GCS 0.02),
    after the GCS it reports to is gone. A local embedded Ray has nothing for an autoscaler to finish, so the
    monitor gets SIGKILL first; everything else keeps Ray's own order. (Best effort: should Ray's internals move,
    this is a plain ``ray.shutdown()``.)"""
    try:
        node = ray._private.worker._global_node
        for info in (node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, []) if node is not None else []):
            info.process.kill()
            info.process.wait(timeout=MONITOR_KILL_S)
    except Exception:  # noqa: BLE001 - only a faster path to the same end
        pass
    ray.shutdown()


def learner_device_kind(cfg: Config) -> str:
    """Explicit config wins; otherwise what the cluster offers: NPU, then GPU, then CPU."""
    if cfg.learner.device != "auto":
        return cfg.learner.device
    return devices.kind_for_resources(ray.cluster_resources())


def learner_resource(cfg: Config, kind: str) -> str | None:
    """The Ray resource that pins a learner to an accelerator host (None: any host)."""
    if cfg.learner.placement_resource == "auto":
        return devices.spec_for(kind).ray_resource
    if cfg.learner.placement_resource == "none":
        return None
    return cfg.learner.placement_resource


@dataclass
class Plan:
    """Where everything goes; built and checked before any actor exists."""

    device_kind: str
    learner_resource: str | None
    learner_bundle: dict
    rollout_nodes: list = field(default_factory=list)  # node id per rollout actor, or None for "anywhere"
    cpu_hosts: list = field(default_factory=list)
    accelerator_hosts: list = field(default_factory=list)


def _alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def plan(cfg: Config) -> Plan:
    kind = learner_device_kind(cfg)
    res = learner_resource(cfg, kind)
    bundle = {"CPU": cfg.learner.num_cpus} if cfg.learner.num_cpus > 0 else {}
    if res is not None:
        bundle[res] = 1
    nodes = _alive_nodes()
    accel = [n for n in nodes if res is not None and n["Resources"].get(res, 0) >= 1]
    cpu_only = [n for n in nodes
                if n not in accel and not any(n["Resources"].get(r, 0) for r in devices.ACCELERATOR_RESOURCES)]
    p = Plan(kind, res, bundle, cpu_hosts=[n["NodeID"] for n in cpu_only],
             accelerator_hosts=[n["NodeID"] for n in accel])
    _check_totals(cfg, res)
    check_learner_resource(cfg, res, nodes)
    if cpu_only and res is not None:
        p.rollout_nodes = _assign_rollouts(cfg, cpu_only)
    else:
        p.rollout_nodes = [None] * cfg.rollout_actors_at_start
    return p


def check_learner_resource(cfg: Config, res: str | None, nodes: list[dict] | None = None,
                           when: str = "") -> None:
    """The learners' accelerator resource exists on the live nodes, num_learners of it. Also asked before a learner
    group restarts: with the only accelerator node gone, waiting out a start-up deadline would change nothing."""
    if res is None:
        return
    have = sum(n["Resources"].get(res, 0) for n in (_alive_nodes() if nodes is None else nodes))
    if have < cfg.learner.num_learners:
        raise ResourceError(f"the Ray cluster has {have:g} {res}{when} but learner.num_learners = "
                            f"{cfg.learner.num_learners} needs {cfg.learner.num_learners:g} {res}")


def local_plan(cfg: Config) -> Plan:
    """The plan of an in-process run (``ray.address: inprocess``): one process, so nothing to place; the learner
    device is the config's, or what this machine has."""
    kind = cfg.learner.device if cfg.learner.device != "auto" else devices.detect()
    return Plan(kind, None, {}, rollout_nodes=[None] * cfg.rollout_actors_at_start)


def _check_totals(cfg: Config, res: str | None) -> None:
    total = ray.cluster_resources()
    need = required_cpus(cfg)
    have = total.get("CPU", 0)
    if have + 1e-9 < need:
        actors = "rollout.min_actors (rollout.num_actors is auto)" if cfg.autoscale_rollouts else "rollout.num_actors"
        raise ResourceError(
            f"the Ray cluster has {have:g} CPU but the config needs {need:g} ({actors} x "
            f"rollout.num_cpus_per_actor + learner.num_learners x learner.num_cpus + preprocess.remote_actors)")


def _assign_rollouts(cfg: Config, cpu_nodes: list[dict]) -> list:
    """Round-robin over CPU hosts, never past a host's CPU count."""
    per_actor = cfg.rollout.num_cpus_per_actor
    free = {n["NodeID"]: n["Resources"].get("CPU", 0) for n in cpu_nodes}
    order = [n["NodeID"] for n in cpu_nodes]
    out = []
    i = 0
    n = cfg.rollout_actors_at_start
    key = "rollout.min_actors" if cfg.autoscale_rollouts else "rollout.num_actors"
    for _ in range(n):
        for _ in range(len(order)):
            node = order[i % len(order)]
            i += 1
            if free[node] + 1e-9 >= per_actor:
                free[node] -= per_actor
                out.append(node)
                break
        else:
            total = sum(n["Resources"].get("CPU", 0) for n in cpu_nodes)
            raise ResourceError(
                f"CPU hosts have {total:g} CPU in all but {key} = {n} x "
                f"rollout.num_cpus_per_actor = {per_actor:g} needs {n * per_actor:g} "
                f"(rollout actors run on hosts without NPU/GPU)")
    return out


def assign_added_rollouts(cfg: Config, p: Plan, running_on: list, n: int) -> list:
    """CPU hosts for ``n`` more rollout actors (a rescale, ``rollout.num_actors: auto``), each to the host with the
    most room left (its CPUs over rollout.num_cpus_per_actor, less the rollout actors ``running_on`` it), the plan's
    order breaking ties: added actors spread over every CPU host, not only those the run started on (starting at
    rollout.min_actors = 1, every added actor had gone to that one host, where only its CPUs' worth fit and the rest
    never started). Fewer than ``n`` when the hosts are full."""
    per = cfg.rollout.num_cpus_per_actor
    cpus = {n["NodeID"]: n["Resources"].get("CPU", 0.0) for n in _alive_nodes()}
    hosts = [h for h in p.cpu_hosts if h in cpus]
    load = {h: sum(1 for x in running_on if x == h) * per for h in hosts}
    out = []
    for _ in range(n):
        host = max(hosts, key=lambda h: (cpus[h] - load[h], -hosts.index(h)), default=None)
        if host is None or cpus[host] - load[host] + 1e-9 < per:
            break
        out.append(host)
        load[host] += per
    return out


def reserve_learners(cfg: Config, p: Plan, run_name: str = ""):
    """One placement group for all learners; fails loudly if it cannot be placed in time."""
    pg = placement_group([dict(p.learner_bundle) for _ in range(cfg.learner.num_learners)], strategy="PACK",
                         name=f"ascent_rl_learners:{run_name}")  # per run: runs can share a cluster
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_GROUP_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise ResourceError(f"could not reserve {cfg.learner.num_learners} learner bundle(s) of {p.learner_bundle} "
                            f"within {PLACEMENT_GROUP_TIMEOUT_S:.0f} s (resources exist in total but are taken or "
                            f"split across nodes)")
    return pg


def learner_options(p: Plan, pg, rank: int) -> dict:
    opts: dict = {
        "num_cpus": p.learner_bundle.get("CPU", 0),
        "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                placement_group_bundle_index=rank),
    }
    if p.learner_resource == "GPU":
        opts["num_gpus"] = 1
    elif p.learner_resource is not None:
        opts["resources"] = {p.learner_resource: 1}
    return opts


# max_calls=1: the worker exits after the probe, so the device context it opened does not stay in Ray's worker
# pool holding device memory the learner then cannot have.
@ray.remote(num_cpus=0, max_calls=1)
def _free_memory(device_kind: str, resource: str | None) -> tuple[int, str]:
    """Free memory of the device Ray assigned this task (the learner's bundle's ``resource``), and which that is."""
    device = devices.for_this_process(devices.resolve(device_kind))
    ids = ray.get_runtime_context().get_accelerator_ids().get(resource or "", [])
    return device.free_memory_bytes(), (f"{resource} {','.join(ids)} ({device.kind})" if ids else device.kind)


def pick_batch_size(free_bytes: int, sample_bytes: int, copies: int, granule: int, lo: int, hi: int,
                    fraction: float) -> int:
    """The largest multiple of ``granule`` in [lo, hi] whose ``copies`` buffers fit in ``fraction`` of free memory."""
    fits = int(free_bytes * fraction) // (sample_bytes * copies)
    best = min(hi, fits) // granule * granule
    if best < lo:
        raise ResourceError(
            f"learner.batch_size: auto found no batch in [{lo}, {hi}] (multiples of {granule}) that fits: "
            f"{fraction:g} of {free_bytes / 2**20:.0f} MiB free holds {fits} samples of {sample_bytes} bytes x "
            f"{copies} buffers; lower learner.batch_size_min or raise learner.auto_batch_memory_fraction")
    return best


def resolve_auto_batch(cfg: Config, p: Plan, pg, spec) -> str:
    """Replace ``learner.batch_size: auto`` by a number, measured on a learner host (``pg`` None: in this
    process, an in-process run). Returns what it decided."""
    from cluster.config import batch_granule, validate

    if pg is None:
        device = devices.for_this_process(devices.resolve(p.device_kind))
        free, measured = device.free_memory_bytes(), device.kind
    else:
        # The start-up deadline: the probe's worker starts on the learner host (a process, the device library's
        # import) like any actor of the graph, and a stopped or unreachable host must not hang the start.
        timeout = cfg.run.startup_timeout_s
        # The probe asks for the learner's own accelerator from rank 0's bundle, as the learner will: Ray assigns it
        # that device, where a task asking for none would see every device and measure the first.
        probe = learner_options(p, pg, 0)
        probe["num_cpus"] = 0
        try:
            free, measured = ray.get(_free_memory.options(**probe).remote(p.device_kind, p.learner_resource),
                                     timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise ResourceError(f"learner.batch_size: auto: the memory probe on the learner host did not answer within "
                                f"{timeout:g} s (run.startup_timeout_s): the host is stopped, unreachable or out of "
                                f"worker processes; set learner.batch_size to a number to start without it") from None
    sample = spec.sample_nbytes  # each modality at its own dtype (images stay uint8)
    # Feed slots (prefetch + 1) of host buffers, and as many device buffers on an accelerator.
    copies = (cfg.learner.prefetch_batches + 1) * (2 if devices.spec_for(p.device_kind).is_accelerator else 1)
    hi = min(cfg.learner.batch_size_max, cfg.run.total_env_steps)  # never more than the whole run
    chosen = pick_batch_size(free, sample, copies, batch_granule(cfg), cfg.learner.batch_size_min, hi,
                             cfg.learner.auto_batch_memory_fraction)
    cfg.learner.batch_size = chosen
    validate(cfg)
    return (f"learner.batch_size: auto -> {chosen} ({free / 2**20:.0f} MiB free on {measured} of the learner host, "
            f"{sample} bytes/sample x {copies} buffers, bounds [{cfg.learner.batch_size_min}, "
            f"{cfg.learner.batch_size_max}])")


def pinned(node_id: str | None, soft: bool = False) -> dict:
    """Hard node affinity (``soft``: that node if it has room and is alive, else any), or Ray's default placement
    when the plan leaves the choice to Ray.

    "DEFAULT", not nothing: a driver that itself runs inside a placement group (a Tune trial) would otherwise
    put every actor it makes into that group, where they do not fit."""
    if node_id is None:
        return {"scheduling_strategy": "DEFAULT"}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=soft)}
