"""The actor graph: placement and every actor of a run, made from the config.

``ActorGraph`` holds the handles (supply board, replay shards, learners, rollout actors, preprocess workers, control
actor) and the ``make_*`` functions that create one of each, so the supervisor can make a replacement exactly as
the first one was made (same id, same place). Each rollout actor is one ``RolloutSlot`` in ``ActorGraph.slots``:
every fact of the run about that actor is a field of it, and nowhere else. It also holds the wiring: the learner
group's setup and its restart from a checkpoint, and a new supply board's attachment to every survivor
(``replace_board``). It watches nothing and decides nothing: the supervisor (``cluster/supervisor.py``) says what
to replace, and when a step's answers are late enough to end the run.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.evaluator import RemoteEvaluator
from actors.inference import RemoteInferenceServer
from actors.rollout import RemoteRolloutActor
from actors.sampler import SamplerSettings
from cluster import checkpoint, control, placement
from cluster.config import Config, ConfigError, check_agents, class_defaults_pending, with_class_defaults
from learner import device as devices
from learner.actor import RemoteLearner
from learner.learner import LearnerSettings
from learner.model import build_model, spec_from_description
from learner.ppo import LossCoefs
from pipeline import runtime
from pipeline.protocol import PREPROCESS_PING_S, STORED_GATHER_S, STORED_PACE_S
from pipeline.relay import RELAY_ID_BASE, NodeRelay
from pipeline.replay import ReplayShard
from pipeline.supply import SupplyBoard, board_concurrency

#: rollout.node_relays: auto gives a node a ticket relay when it starts with at least this many rollout actors.
RELAY_AUTO_ACTORS = 16


def _description(cfg: Config) -> dict:
    """One throwaway env of the config, as ``actors.envs.describe_env`` describes it."""
    from actors.envs import describe_env as describe  # env errors -> ConfigError; shared with --dry-run (no Ray)

    return describe(cfg.env.id, cfg.env.modalities, normalize_obs=cfg.env.normalize_obs,
                    action_mask_key=cfg.env.action_mask_key, isolation=cfg.env.isolation_args(),
                    make_timeout_s=cfg.run.startup_timeout_s, **cfg.env_args())


def with_env_class_defaults(cfg: Config) -> Config:
    """``cfg`` with its env class's defaults in the learning settings it leaves unset (``env.defaults``,
    ``config.with_class_defaults``); the action space comes from one throwaway env, made only while a setting is
    still open to them."""
    if not class_defaults_pending(cfg):
        return with_class_defaults(cfg, "discrete")  # nothing to fill: records that (class_defaults {})
    return with_class_defaults(cfg, _description(cfg)["action_kind"])


def describe_env(cfg: Config, with_agents: bool = False):
    """The model's spec, from one throwaway env; a mismatch with the config is a one-line ConfigError.
    ``with_agents``: (spec, a PettingZoo env's agents or None: ``actors.multiagent.describe_agents``)."""
    description = _description(cfg)
    check_agents(cfg, description["multiagent"])
    try:
        spec = spec_from_description(description, cfg.learner.hidden_sizes, cfg.learner.rnn,
                                     cfg.learner.rnn_hidden_size, cfg.multiagent.policy_entries())
    except ValueError as e:  # spec mismatches: the message names the key and what is allowed
        raise ConfigError(str(e)) from None
    return (spec, description["multiagent"]) if with_agents else spec


@dataclass(eq=False)
class RolloutSlot:
    """Rollout actor ``index`` in its current incarnation: the one record of what the run knows of it, and where a
    new per-actor fact goes (one field). Owned by ``ActorGraph``, which alone puts an actor at an index
    (``add_rollout``) and takes it out (``remove_rollouts``), so identity, incarnation and handle change together.
    The supervisor's watch writes the health fields below, ``RunState.live_steps`` sums ``steps``. A replacement is
    a fresh slot at the same index (the supervisor carries over what must outlive a process)."""

    index: int  # the actor id: the board's key with the incarnation, and what places, seeds and shards it
    handle: object  # the actor its calls go to
    incarnation: int = 0  # actors made at this index before this one (the board refuses a gone one's calls)
    steps: int = 0  # env steps of this incarnation, from its newest stats (retired into the run's count at its end)
    # Its health, as the supervisor's watch (cluster/supervisor.py) sees it:
    watch: object = None  # its until_done call, which resolves when it ends or dies; never waited on
    heard: float | None = None  # when its stats last came with a board poll, else when its watch began: what
    #                             SILENT_S counts from (a health answer does not reset it)
    asked: tuple | None = None  # (its unanswered health call, when it was sent): one out at a time
    starting: tuple | None = None  # (its start call, when it was made, "added" or "replacement"): not up yet
    stats: dict | None = None  # its newest stats answer
    produced: bool = False  # this incarnation has sent a fragment
    repeats: tuple[str, int] = ("", 0)  # (fault, fresh incarnations in a row failing so before their first fragment)


class ActorGraph:
    """Every actor of one run. ``say``: where start-up warnings go (the driver's stderr line)."""

    def __init__(self, cfg: Config, files: checkpoint.RunFiles | None, say: Callable[[str], None],
                 profile_iterations: int = 0):
        """``files``: the run's files (its name names the placement group and the control actor; the learners'
        profiles go there); None for a graph whose actors are made by hand, never built."""
        self.cfg, self.files, self.say = cfg, files, say
        self.profile_iterations = profile_iterations
        self.plan = None
        self.spec = None
        self.agents = None  # a PettingZoo env's agents (actors.multiagent.describe_agents), else None
        self.learner_pg = None
        self.board = None
        self.shards: list = []
        self.learners: list = []
        self.slots: dict[int, RolloutSlot] = {}  # rollout actor id -> its slot (ids 0..n-1)
        self.preprocess_workers: list = []
        self.control = None
        self.evaluator = None  # eval.interval_iterations set: the periodic evaluator
        self.relays: dict = {}  # node id (None: anywhere) -> its NodeRelay (rollout.node_relays)
        self.inference: dict = {}  # node id (None: anywhere) -> its inference server (rollout.inference: remote)
        # Rollout actor id -> the incarnation of the newest actor made there, its slot gone or not: one added
        # again at a removed index goes on counting, so the board never sees an (id, incarnation) twice.
        self._last_incarnation: dict[int, int] = {}
        self.board_incarnation = 0  # supply boards replaced so far
        self.generation = 0  # learner groups replaced so far (the board ignores the older groups' calls)
        # () -> (what it is, learner state): the state a restarted learner group starts from; (None, None): from
        # scratch. The driver's (it knows which checkpoints this run wrote).
        self.restart_point: Callable[[], tuple] = lambda: (None, None)
        # ray.address: inprocess: every actor is a thread of this process (pipeline/runtime.py), made from the
        # same plain classes, called the same way.
        self.inprocess = cfg.ray.address == runtime.INPROCESS

    def _create(self, actor_class, options: dict, *args, **kwargs):
        return runtime.create(actor_class, options, *args, inprocess=self.inprocess, **kwargs)

    # ------------------------------------------------------------------ build
    def build(self, resume: dict | None, iteration: int) -> None:
        """``resume``: a checkpoint payload for the learners; ``iteration``: the run's (rollout seeds fold it in)."""
        cfg = self.cfg
        # Every check happens here, before any actor exists.
        self.plan = plan = placement.local_plan(cfg) if self.inprocess else placement.plan(cfg)
        self.spec, self.agents = describe_env(cfg, with_agents=True)
        if resume is not None:
            checkpoint.refuse_unfit(resume, self.spec)  # before a learner would fail at loading it

        self.learner_pg = None if self.inprocess else placement.reserve_learners(cfg, plan, self.files.name)
        if cfg.learner.batch_size == "auto":
            self.say(placement.resolve_auto_batch(cfg, plan, self.learner_pg, self.spec))
        # The board and shard i live on the node of rollout actor i (shard i's first producer); a node's relay
        # before its shards, which confirm through it.
        self.board = self.make_board()
        self.relays = self.make_relays()
        self.shards = [self.make_shard(i) for i in range(cfg.replay.num_shards)]
        registered = [self.board.register_shard.remote(i, s) for i, s in enumerate(self.shards)]
        # The second preprocessing tier (preprocess.remote_actors), spread over the rollout hosts.
        n_workers = cfg.preprocess.remote_actors if cfg.env.modalities else 0
        self.preprocess_workers = [self.make_preprocess_worker(i) for i in range(n_workers)]
        # Every actor is created before waiting on anything, the learners and rollout actors (which import torch,
        # about 1.3 CPU-s each) before the driver's control actor and the evaluator: the raylet starts at most
        # min(cores, CPUs) worker processes at once, in creation order, so on 2 cores the control actor started
        # first held the rollout actor's start back by ~0.3 s.
        self.learners = self.make_learners()
        scalers = (resume or {}).get("run_state", {}).get("reward_scalers") or {}
        for i in range(cfg.rollout_actors_at_start):
            self.add_rollout(i, iteration=iteration, reward_scaler_state=reward_scaler_for(scalers, i))
        self.control = self.make_control()
        if cfg.eval.interval_iterations:
            self.evaluator = self.make_evaluator()
        # Only now wait for the board to know its shards (before anything polls or claims), so that no actor's
        # creation waits on another's start-up. (On one 2-core host this measured no faster: the torch imports of
        # the learner and rollout processes are what the build waits for.)
        self._started(registered, f"the supply board and {len(self.shards)} replay shard(s)")
        if resume is not None:
            self._started([lr.load_state.remote(resume["learner"]) for lr in self.learners],
                          f"{len(self.learners)} learner(s) loading the checkpoint")
        self.setup_learners()
        if self.inference:  # started before the actors' first steps, which would otherwise wait it out locally
            self._started([s.stats.remote() for s in self.inference.values()],
                          f"{len(self.inference)} inference server(s)")
        self._started([a.start.remote() for a in self.rollouts], f"{len(self.rollouts)} rollout actor(s)")

    def _started(self, refs, what: str):
        """``ray.get`` of start-up calls, with the run's deadline: an actor Ray cannot place (its CPUs taken by
        another run on a shared cluster) is a one-line ResourceError, not a driver waiting forever."""
        timeout = self.cfg.run.startup_timeout_s
        try:
            return runtime.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            where = ("in this process (ray.address: inprocess)" if self.inprocess
                     else f"Ray has not placed them; free now: {free_resources()}")
            raise placement.ResourceError(f"{what} did not start within {timeout:g} s (run.startup_timeout_s): "
                                          f"{where}") from None

    def make_preprocess_worker(self, i: int):
        from actors.preprocess_worker import RemotePreprocessWorker

        cfg = self.cfg
        # The contract's spec objects travel as they are (pipeline/contract.py): no dict round trip.
        slow = {name: m for name, m in cfg.env.modalities.items() if not m.is_fast}
        node = self._rollout_node(i)
        # Soft affinity: a rollout host with no CPU left (or gone) must not leave the worker pending forever.
        return self._create(RemotePreprocessWorker, dict(
            num_cpus=1, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=True)
            if node else "DEFAULT"), cfg.env.id, slow, seed=cfg.run.seed + i, isolation=cfg.env.isolation_args(),
            **cfg.env_args())

    def ensure_preprocess_worker(self, actor_id: int) -> str | None:
        """Before a rollout actor is replaced: if the remote preprocess worker it uses is dead or does not answer,
        replace that too (its rollout actors fail on it, and their replacements would). Returns what was done."""
        if not self.preprocess_workers:
            return None
        i = actor_id % len(self.preprocess_workers)
        try:
            runtime.get(self.preprocess_workers[i].__ray_call__.remote(lambda self: None),
                        timeout=PREPROCESS_PING_S)
            return None
        except Exception as e:  # noqa: BLE001 - dead (RayActorError) or hung/stopped (GetTimeoutError)
            kill_quietly(self.preprocess_workers[i])
            self.preprocess_workers[i] = self.make_preprocess_worker(i)
            return f"remote preprocess worker {i} {'did not answer' if 'Timeout' in type(e).__name__ else 'died'}"

    def make_control(self, rollout_actors: int | None = None):
        """The control actor, asking for ``rollout_actors`` (default: the config's count)."""
        n = self.cfg.rollout_actors_at_start if rollout_actors is None else rollout_actors
        if self.inprocess:  # no Ray to find it by name: python -m cluster.control cannot reach an in-process run
            return self._create(control.ControlActor, {}, n, self.cfg.replay.num_shards)
        name = control.actor_name(self.files.name)
        try:
            return control.ControlActor.options(name=name, namespace=control.NAMESPACE,
                                                scheduling_strategy="DEFAULT").remote(n, self.cfg.replay.num_shards)
        except ValueError:  # another live run with the same directory name holds it (or a dead one, still named)
            self.say(f"warning: {name!r} is taken by another running job; this run cannot be scaled with "
                     f"python -m cluster.control")
            return control.ControlActor.remote(n, self.cfg.replay.num_shards)

    def make_learners(self) -> list:
        cfg = self.cfg
        settings = learner_settings(cfg)
        return [
            self._create(
                RemoteLearner, {} if self.inprocess else placement.learner_options(self.plan, self.learner_pg, r),
                rank=r, world_size=cfg.learner.num_learners, device_kind=self.plan.device_kind, spec=self.spec,
                settings=settings, seed=cfg.run.seed,
                torch_threads=cfg.learner.torch_threads, profile_iterations=self.profile_iterations,
                profile_dir=str(self.files.profile.resolve()),
                self_play={"snapshot_every": cfg.multiagent.snapshot_every, "pool_size": cfg.multiagent.pool_size}
                if cfg.multiagent.self_play else None)
            for r in range(cfg.learner.num_learners)
        ]

    def setup_learners(self, generation: int = 0) -> None:
        cfg = self.cfg
        if self.inprocess:  # one learner (config-checked): no process group to meet in
            master_addr, master_port = "127.0.0.1", 0
        else:
            master_addr, master_port = self._started(self.learners[0].address.remote(), "learner rank 0")
        group_claims = cfg.learner.group_claims and len(self.learners) > 1
        self._started([
            lr.setup.remote(master_addr, master_port, self.board, fragments_per_batch=cfg.fragments_per_learner,
                            prefetch_batches=cfg.learner.prefetch_batches, stall_timeout_s=cfg.run.stall_timeout_s,
                            generation=generation, group_claims=group_claims,
                            peers=self.learners if rank == 0 and group_claims else None)
            for rank, lr in enumerate(self.learners)
        ], f"{len(self.learners)} learner(s)")

    def restart_learners(self) -> Path | None:
        """Replace the whole learner group, from ``restart_point`` (or from scratch without one); returns what
        it started from (None: scratch)."""
        for lr in self.learners:
            kill_quietly(lr)
        # Versions must keep increasing for the board and the rollout actors' lag accounting, even though
        # the weights go back to the checkpoint's.
        timeout = self.cfg.run.stall_timeout_s
        next_version = runtime.get(self.board.stats.remote(), timeout=timeout)["version"] + 1
        # What the dead group had claimed died with it: the board has it made again, and from here on ignores
        # the old group's ranks (ray.kill is asynchronous: one may still claim or publish for a moment).
        self.generation = generation = runtime.get(self.board.learners_restarted.remote(next_version),
                                                   timeout=timeout)
        if not self.inprocess:  # no live node has the learners' accelerator: say so now, not at a deadline
            placement.check_learner_resource(self.cfg, self.plan.learner_resource, when=" on its live nodes")
        # The run's own newest state (the driver's restart_point: its newest periodic checkpoint, else the one it
        # resumed from), never the newest file in the directory, which may be another run's.
        path, learner_state = self.restart_point()
        self.learners = self.make_learners()
        if learner_state is not None:
            self._started([lr.load_state.remote(learner_state, version=next_version) for lr in self.learners],
                          f"{len(self.learners)} restarted learner(s)")
        else:
            self._started([lr.start_at_version.remote(next_version) for lr in self.learners],
                          f"{len(self.learners)} restarted learner(s)")
        self.setup_learners(generation)
        return path

    def make_board(self, replacement: bool = False):
        """The supply board (``replacement``: the next one after a board died; soft pin, a ticket range and shard
        incarnations of its own, and the current learner group's generation)."""
        cfg = self.cfg
        if replacement:
            self.board_incarnation += 1
        lease = cfg.rollout.fragment_timeout_s
        # Room for every call that can be parked at once (see board_concurrency): progress never queues behind waits.
        options = {**placement.pinned(self.plan.rollout_nodes[0], soft=replacement),
                   "max_concurrency": board_concurrency(control.MAX_ROLLOUT_ACTORS, cfg.replay.num_shards,
                                                        cfg.learner.num_learners)}
        return self._create(SupplyBoard, options,
                            cfg.fragments_per_update, cfg.replay.max_policy_lag, cfg.replay.num_shards,
                            None if lease == "auto" else lease, self.board_incarnation, self.generation,
                            expected_actors=len(self.slots) or cfg.rollout_actors_at_start,
                            relay_calls_per_s=cfg.rollout.relay_calls_per_s)

    def replace_board(self, answers: Callable[[list, list[str], bool], list]) -> tuple[int, int]:
        """Kill the supply board and wire a new one to every survivor; returns (the stored fragments the shards
        emptied, the policy version the new ledger starts from). The order is the protocol's:

        1. each shard attaches to the new board and empties itself: what it held was ticketed by the dead ledger;
        2. the new board registers every shard (before anything polls or claims);
        3. every learner attaches to it, rank 0 publishing its weights: the new tickets start from that version;
        4. the relays, then the rollout actors, attach to it, not waited for: an actor tries its relay again on
           ``attach_board``, and one whose relay fails polls the board itself; a hung actor is the supervisor's.

        ``answers(refs, names, board_starting)``: the answers of one step's calls (one to each of ``names``), or it
        raises; ``board_starting``: the wait includes the new board's process start."""
        kill_quietly(self.board)  # a stopped board must not wake up and hand out its tickets
        self.board = board = self.make_board(replacement=True)
        cleared = answers([s.attach_board.remote(board) for s in self.shards],
                          [f"replay shard {i}" for i in range(len(self.shards))], False)
        answers([board.register_shard.remote(i, s) for i, s in enumerate(self.shards)],
                ["the new supply board"] * len(self.shards), True)
        version = answers([lr.attach_board.remote(board) for lr in self.learners],
                          [f"learner {r}" for r in range(len(self.learners))], False)[0]
        for relay in self.relays.values():
            relay.attach_board.remote(board)
        for actor in self.rollouts:
            actor.attach_board.remote(board)
        return sum(cleared), version

    def _rollout_node(self, actor_id: int):
        return self.plan.rollout_nodes[actor_id % len(self.plan.rollout_nodes)]

    def make_relays(self) -> dict:
        """One NodeRelay per rollout node (rollout.node_relays: always), or, under auto, per node that starts with
        RELAY_AUTO_ACTORS rollout actors or more when the actors span several nodes; none in process. On one node
        a relay only moves the board's per-poll work to another process on the same cores (and adds a hop): the
        board is a shared ceiling only for a cluster."""
        mode = self.cfg.rollout.node_relays
        if self.inprocess or mode == "never":
            return {}
        per_node = collections.Counter(self._rollout_node(i) for i in range(self.cfg.rollout_actors_at_start))
        if mode == "auto" and (len(per_node) < 2 or None in per_node):
            return {}
        nodes = [n for n, k in per_node.items() if mode == "always" or k >= RELAY_AUTO_ACTORS]
        return {node: self.make_relay(node, i) for i, node in enumerate(nodes)}

    def make_relay(self, node, index: int):
        options = {**placement.pinned(node), "max_concurrency": control.MAX_ROLLOUT_ACTORS + 16}
        return self._create(NodeRelay, options, self.board, RELAY_ID_BASE + index)

    def make_shard(self, index: int, replacement: bool = False):
        """``replacement``: its node may be gone, so the pin is soft (any node with room, its own first)."""
        node = self._rollout_node(index)  # shard i is on rollout actor i's node: its adds stay local
        return self._create(ReplayShard, placement.pinned(node, soft=replacement), index, self.cfg.replay_capacity,
                            self.board, add_timeout_s=self.cfg.run.stall_timeout_s,
                            pace_s=STORED_PACE_S if self.cfg.replay.stored_pacing else STORED_GATHER_S,
                            relay=self.relays.get(node))  # it confirms through its node's relay, if there is one

    # ------------------------------------------------------------------ rollout actor slots
    @property
    def rollouts(self) -> list:
        """The rollout actors' handles, by id (read only: a slot changes through ``add_rollout`` and
        ``remove_rollouts``)."""
        return [self.slots[i].handle for i in sorted(self.slots)]

    def rollout_steps(self) -> int:
        """The env steps of the rollout actors' current incarnations (``RunState.env_steps`` adds the retired)."""
        return sum(s.steps for s in self.slots.values())

    def add_rollout(self, actor_id: int, *, iteration: int, replacement: bool = False,
                    reward_scaler_state: dict | None = None) -> RolloutSlot:
        """A new actor at ``actor_id``, the next incarnation there, in a fresh slot that takes the index over (the
        first one, a replacement, or one added); the caller starts it. ``replacement``: a dead or hung actor's
        successor, whose node may be gone: its pin is soft. ``reward_scaler_state``: the reward-normalisation
        statistics to continue from (env.normalize_reward)."""
        cfg = self.cfg
        incarnation = self._last_incarnation[actor_id] = self._last_incarnation.get(actor_id, -1) + 1
        # A replacement (or a resumed run) must not replay the same episodes: fold both into the seed.
        seed = cfg.run.seed + 1_000_003 * (incarnation + iteration) + 7919 * actor_id
        remote = self.preprocess_workers[actor_id % len(self.preprocess_workers)] if self.preprocess_workers else None
        node = self._rollout_node(actor_id)
        # Shard a % K is on this actor's node (placement puts shard i with actor i): ``add`` stays local.
        shard_index = actor_id % len(self.shards)
        handle = self._create(
            RemoteRolloutActor, dict(num_cpus=cfg.rollout.num_cpus_per_actor,
                                     **placement.pinned(node, soft=replacement)),
            actor_id=actor_id, shard=self.shards[shard_index], shard_index=shard_index, board=self.board,
            sampler_settings=self.sampler_settings(seed), policy_factory=self.policy_factory(),
            remote_preprocess=remote, inference=self.inference_server(node), incarnation=incarnation,
            torch_threads=self._rollout_threads(), stall_timeout_s=cfg.run.stall_timeout_s,
            fragments_per_add=cfg.rollout.fragments_per_add, ticket_blocks=cfg.rollout.ticket_blocks,
            # In process every actor shares one process's memory: a per-actor limit has nothing to measure.
            memory_limit_mb=None if self.inprocess else cfg.rollout.memory_limit_mb,
            reward_scaler_state=reward_scaler_state, relay=self.relays.get(node))
        self.slots[actor_id] = slot = RolloutSlot(actor_id, handle, incarnation)
        return slot

    def remove_rollouts(self, first: int) -> list[RolloutSlot]:
        """Take the slots of rollout actors ``first`` and up out of the graph; returns them, by id (the caller
        stops them and settles what they held)."""
        return [self.slots.pop(i) for i in sorted(self.slots) if i >= first]

    def inference_server(self, node):
        """The inference server of ``node`` (made on its first rollout actor, so an actor added on a new node gets
        one too); None under rollout.inference: local. No supervision: Ray restarts a dead one in place, and its
        actors use their local copies meanwhile (actors/inference.py). Soft-pinned: a server whose node is lost
        restarts on another node, and the replacements of its actors, wherever they come up, still call it."""
        if self.cfg.rollout.inference != "remote":
            return None
        if node not in self.inference:
            self.inference[node] = self._create(
                RemoteInferenceServer, placement.pinned(node, soft=True), self.policy_factory(),
                device_factory=functools.partial(devices.for_inference, self.cfg.learner.device),
                max_versions=self.cfg.replay.max_policy_lag + 1, torch_threads=self._rollout_threads())
        return self.inference[node]

    def _rollout_threads(self) -> int:
        """torch's thread count is per process: in process, every actor sets the learner's, so none undoes
        another's."""
        return self.cfg.learner.torch_threads if self.inprocess else self.cfg.rollout.torch_threads

    def policy_factory(self):
        """A fresh policy of the run's model, as a picklable callable (it travels to the actors)."""
        return functools.partial(build_model, self.spec)

    def sampler_settings(self, seed: int) -> SamplerSettings:
        """What every ``RolloutSampler`` of the run is made from (the rollout actors' and the evaluator's), with
        ``seed``; the policy factory and the live handles are passed beside it."""
        cfg = self.cfg
        ma = cfg.multiagent
        pre = cfg.preprocess
        # The preprocessing settings only where a Dict env has modalities to preprocess (a Box env has none).
        preprocess = (dict(modalities=cfg.env.modalities, preprocess_workers=pre.workers,
                           max_slow_workers=pre.max_slow_workers, fast_queue=pre.fast_queue,
                           slow_queue=pre.slow_queue) if cfg.env.modalities else {})
        return SamplerSettings(
            env_id=cfg.env.id, num_envs=cfg.rollout.envs_per_actor, fragment_length=cfg.rollout.fragment_length,
            gamma=cfg.ppo.gamma, gae_lambda=cfg.ppo.gae_lambda, seed=seed, normalize_reward=cfg.env.normalize_reward,
            **cfg.env_args(), isolation=cfg.env.isolation_args(),
            action_mask_key=self.spec.action_mask,  # what the model was built to read (describe_env checked it)
            self_play={"snapshot_every": ma.snapshot_every, "pool_size": ma.pool_size,
                       "sampling": ma.opponent_sampling, "random_share": ma.random_opponent_share}
            if ma.self_play else None,
            **preprocess,
        )

    def make_evaluator(self):
        """The periodic evaluator, on the first rollout node (a CPU host); fixed seeds, so every evaluation
        starts from the same reset states."""
        cfg = self.cfg
        return self._create(
            RemoteEvaluator, placement.pinned(self.plan.rollout_nodes[0]),
            self.sampler_settings(cfg.run.seed + 424_242), self.policy_factory(), episodes=cfg.eval.episodes,
            deterministic=cfg.eval.deterministic, torch_threads=self._rollout_threads(),
            slots_per_game=self.agents["slots_per_game"] if self.agents else 1,
            opponents=cfg.multiagent.eval_opponents if self.agents and self.agents["api"] == "aec" else None)

    def placement_report(self) -> dict:
        """Node id of every actor, by role (what the placement test checks)."""
        def node_of(handles):
            if self.inprocess:
                return [runtime.INPROCESS] * len(handles)
            return runtime.get([h.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
                            for h in handles])
        return {"learners": node_of(self.learners), "rollouts": node_of(self.rollouts),
                "shards": node_of(self.shards), "board": node_of([self.board])[0]}

    # ------------------------------------------------------------------ teardown
    def shutdown(self) -> None:
        """Stop producers, then consumers, then kill every actor of the graph."""
        for group, timeout in ((self.rollouts, 5), (self.learners, 10)):
            refs = [a.stop.remote() for a in group]
            try:
                runtime.get(refs, timeout=timeout)
            except Exception:
                pass  # stuck or dead: killed below either way
        extra = [x for x in (self.board, self.control, self.evaluator, *self.relays.values(), *self.inference.values())
                 if x is not None]
        for a in self.rollouts + self.learners + self.shards + self.preprocess_workers + extra:
            kill_quietly(a)
        self.slots, self.learners, self.shards, self.preprocess_workers = {}, [], [], []
        self.board = self.control = self.evaluator = None
        self.relays, self.inference = {}, {}
        if self.learner_pg is not None:
            try:
                ray.util.remove_placement_group(self.learner_pg)
            except Exception:
                pass
            self.learner_pg = None


def kill_quietly(handle) -> None:
    """Kill an actor that may be dead already: a stopped or hung one must not wake up and act again."""
    try:
        runtime.kill(handle)
    except Exception:  # noqa: BLE001 - already dead
        pass


def free_resources() -> dict:
    """Ray's free schedulable resources (not its bookkeeping entries), for a one-line refusal."""
    try:
        return {k: v for k, v in ray.available_resources().items()
                if not k.startswith(("node:", "memory", "object_store")) and "_group_" not in k}
    except Exception:  # noqa: BLE001 - in process, or Ray not reachable: nothing to show
        return {}


def reward_scaler_for(scalers: dict, actor_id: int) -> dict | None:
    """Actor ``actor_id``'s reward statistics (keys may be strings after a checkpoint), else those with the most
    samples behind them (an actor added, or more actors than the run had), else None (start at variance 1)."""
    if not scalers:
        return None
    own = scalers.get(actor_id, scalers.get(str(actor_id)))
    return own if own is not None else max(scalers.values(), key=lambda st: st["count"])


def learner_settings(cfg) -> LearnerSettings:
    """What every ``Learner`` of a run under ``cfg`` is made from (also what bench/update_cost.py builds its learners
    from). Each learner actor sets its own ``seed``."""
    recurrent = cfg.learner.rnn is not None  # how a batch's rows make sequences: whole fragments of T x N, chunks of L
    return LearnerSettings(
        lr=cfg.learner.lr, adam_eps=cfg.learner.adam_eps, anneal_lr=cfg.learner.anneal_lr,
        total_updates=cfg.total_updates, update_epochs=cfg.ppo.update_epochs,
        minibatch_size=cfg.local_minibatch_size, max_grad_norm=cfg.ppo.max_grad_norm,
        coefs=LossCoefs(clip_coef=cfg.ppo.clip_coef, clip_vloss=cfg.ppo.clip_vloss, vf_coef=cfg.ppo.vf_coef,
                        ent_coef=cfg.ppo.ent_coef, norm_adv=cfg.ppo.norm_adv, clip_around=cfg.ppo.clip_around),
        precision=cfg.learner.precision, fp16_init_scale=cfg.learner.fp16_init_scale,
        fp16_growth_factor=cfg.learner.fp16_growth_factor, compile=cfg.learner.compile,
        fused_update=cfg.learner.fused_update, graphs=cfg.learner.graphs, target_kl=cfg.ppo.target_kl,
        ent_coef_end=cfg.ppo.ent_coef_end, clip_coef_end=cfg.ppo.clip_coef_end,
        sequence_layout=(cfg.rollout.fragment_length, cfg.rollout.envs_per_actor) if recurrent else None,
        seq_len=cfg.seq_len if recurrent else None,
    )
