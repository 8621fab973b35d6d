"""Placement, multi-node layouts and node loss on one real multi-node Ray (``ray.cluster_utils.Cluster``): 3 CPU
hosts of 3 CPU and one host declaring ``NPU: 4``. No real NPU exists, so learners compute on CPU (gloo) while being
placed by the NPU resource (``learner.placement_resource: NPU``).

One cluster for the module (each start is four raylets and their agents: over 10 s of a loaded 2-core machine),
started once by each pytest-xdist worker that runs any of these tests. They are one ``xdist_group`` (``make test``
runs ``--dist loadgroup``), which keeps them on one worker (tests/conftest.py ``_group_for_xdist``: under pytest 9,
xdist 3.8's own grouping is lost). Nothing here depends on which tests ran before all the same: the node-loss tests
put a node like the one they removed back when they end.
"""

import json
import os
import re
import threading
import time

import pytest
import ray as _ray

from cluster import checkpoint
from cluster import config as config_mod
from cluster import placement
from cluster.driver import Trainer
from tests.conftest import ROOT, alive_actor_names

pytestmark = pytest.mark.xdist_group("multinode")


@pytest.fixture(scope="module")
def cluster_nodes():
    from ray.cluster_utils import Cluster

    if _ray.is_initialized():
        _ray.shutdown()  # the shared local Ray; ray_local starts it again for later tests
    cluster = Cluster()
    cpu = [cluster.add_node(num_cpus=3) for _ in range(3)]  # the first node added is the head
    npu = cluster.add_node(num_cpus=4, resources={"NPU": 4})
    _ray.init(address=cluster.address, namespace="ascent_rl_multinode", log_to_driver=False)
    cluster.wait_for_nodes()
    shape = {"cluster": cluster, "cpu": cpu, "npu": npu}
    try:
        yield shape
    finally:
        _ray.shutdown()
        cluster.shutdown()


def put_back(shape: dict, removed) -> None:
    """A node like ``removed`` (a CPU host, or the accelerator host) added in its place, so the next test finds the
    cluster's full shape."""
    cluster = shape["cluster"]
    if removed is shape["npu"]:
        shape["npu"] = cluster.add_node(num_cpus=4, resources={"NPU": 4})
    else:
        shape["cpu"] = [n for n in shape["cpu"] if n is not removed] + [cluster.add_node(num_cpus=3)]
    cluster.wait_for_nodes()


@pytest.fixture
def nodes(cluster_nodes):
    """The shared cluster, once the previous test's actors have let go of their resources (and, after the test,
    checked gone: every test's graph shuts down clean)."""
    def wait_gone():
        deadline = time.monotonic() + 15
        while alive_actor_names(_ray) and time.monotonic() < deadline:
            time.sleep(0.2)
        return alive_actor_names(_ray)

    wait_gone()
    shape = cluster_nodes
    yield shape["cluster"], list(shape["cpu"]), shape["npu"]
    assert wait_gone() == []


def cartpole(*extra):
    return config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "learner.device=cpu", "learner.placement_resource=NPU", "rollout.envs_per_actor=8",
        "run.target_return=null", "run.require_target=false", "run.checkpoint_interval_s=null", *extra])


def records_of(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


# ---------------------------------------------------------------------------------------------------- placement
def test_every_actor_lands_where_the_config_says(nodes, tmp_path):
    _, cpu, npu = nodes
    cpu_ids = {n.node_id for n in cpu}
    # Hidden layers of 128: a policy over learner.actor.WEIGHTS_BY_VALUE_MAX_BYTES, published as one object a version.
    cfg = cartpole("learner.num_learners=2", "rollout.num_actors=2", "replay.num_shards=2",
                   "run.total_env_steps=4096", "learner.hidden_sizes=[128,128]")
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    stop = threading.Event()
    try:
        trainer.build()
        where = trainer.placement_report()
        assert where["learners"] == [npu.node_id] * 2
        assert len(set(where["rollouts"])) == 2 and set(where["rollouts"]) <= cpu_ids, \
            "rollout actors must spread over the CPU hosts"
        # Each shard sits with its producer, so adds never cross the network.
        assert where["shards"] == where["rollouts"]
        assert where["board"] in cpu_ids
        # And the placed graph really trains: two gloo learners across the NPU host's bundles, while the weights
        # references the board hands out are held here (so each version's object stays where Ray put it).
        held, stop = {}, threading.Event()

        def take_versions():
            while not stop.is_set():
                news = _ray.get(trainer.graph.board.latest.remote(-1))
                if news is not None:
                    held.setdefault(news[0], news[1][0])
                time.sleep(0.02)

        taker = threading.Thread(target=take_versions, daemon=True)
        taker.start()
        result = trainer.run()
        stop.set()
        taker.join()
        assert result.iterations >= 3
        assert held and all(isinstance(ref, _ray.ObjectRef) for ref in held.values()), held
        # Weights fan out per node: each version is one object of learner rank 0's, and a rollout host reads it
        # through its own object store (one copy per node however many actors it has), not by value per actor.
        # Asked before the shutdown, which takes rank 0 and its objects with it.
        locations = _ray.experimental.get_object_locations(list(held.values()))
        copies = [set(loc["node_ids"]) for loc in locations.values()]
        assert set(where["rollouts"]) <= set().union(*copies), \
            f"no copy of any weights version on a rollout host: {copies}"
    finally:
        stop.set()
        trainer.shutdown()


@pytest.mark.long
def test_autoscale_adds_actors_on_other_cpu_hosts_while_the_learner_starves_and_removes_them_once_rate_limited(
        nodes, tmp_path):
    """``rollout.num_actors: auto`` on the cluster: an env that sleeps 2 ms a step starves the learner with one
    rollout actor, and the autoscaler adds actors up to ``rollout.max_actors`` (5), placed on more than one CPU
    host; once the env is made fast (its flag file removed) the actors wait for tickets while the learner does
    not wait for data, and it removes actors. Each change goes through the live-rescale path and is in the records
    and on stderr. (What the counts do after the first removal is this 2-core machine's noise, not asserted.)"""
    from tests.conftest import records_so_far
    from tests.slow_env import SLOW_ID

    _, cpu, _ = nodes
    flag = tmp_path / "slow"
    flag.touch()
    cfg = cartpole(f"env.id=tests.slow_env:{SLOW_ID}", f"env.kwargs.slow_while={flag}", "rollout.num_actors=auto",
                   "rollout.min_actors=1", "rollout.max_actors=5", "rollout.autoscale_window=2",
                   "replay.num_shards=1", "learner.batch_size=1024", "learner.minibatch_size=512",
                   "ppo.update_epochs=20", "run.total_env_steps=200000")
    run_dir = tmp_path / "run"
    trainer = Trainer(cfg, run_dir, quiet=True)
    said: list = []
    trainer.supervisor.say = said.append
    grown_on: list = []  # the rollout actors' nodes once there were 5
    stop = threading.Event()

    def make_fast_once_grown():
        while not stop.is_set():
            recs = records_so_far(run_dir)
            if recs and recs[-1]["rollout_actors"] == 5:
                for _ in range(10):  # where the 5 are, while the env is still slow (nothing is removed meanwhile)
                    try:
                        grown_on.extend(trainer.placement_report()["rollouts"])
                        break
                    except Exception:  # noqa: BLE001 - an actor mid-replacement: ask again
                        time.sleep(0.5)
                flag.unlink()
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=make_fast_once_grown, daemon=True)
    try:
        trainer.build()
        watcher.start()
        result = trainer.run()
    finally:
        stop.set()
        watcher.join(timeout=30)
        trainer.shutdown()
    assert result.reason == "total_env_steps", said
    counts = [r["rollout_actors"] for r in records_of(run_dir)]
    assert counts[0] == 1 and max(counts) == 5, (counts, said)
    # The first step goes to ceil(1 / (1 - host-bound)): 5 at a wait of 80% or more, 4 at 67-80% (a loaded
    # machine's slower update waits less); either way it is an up-step for want of data, and the count reaches 5.
    first = re.match(r"rollout actors: autoscale 1 -> (\d): learners waited", said[0])
    assert first and int(first.group(1)) >= 2, said
    assert len(grown_on) == 5 and len(set(grown_on)) >= 2 and set(grown_on) <= {n.node_id for n in cpu}, grown_on
    downs = [line for line in said if line.startswith("rollout actors: autoscale 5 -> ")]
    assert downs and "waited" in downs[0] and "for tickets" in downs[0], said
    assert min(counts[counts.index(5):]) < 5, counts


def test_missing_npu_capacity_is_one_clear_error_before_anything_starts(nodes, tmp_path):
    cfg = cartpole("learner.num_learners=8", "learner.batch_size=2048", "learner.minibatch_size=256",
                   "rollout.num_actors=2", "replay.num_shards=2")
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    with pytest.raises(placement.ResourceError) as err:
        trainer.build()
    assert str(err.value) == "the Ray cluster has 4 NPU but learner.num_learners = 8 needs 8 NPU"
    assert trainer.learners == [] and trainer.rollouts == []


def test_rollouts_that_do_not_fit_on_cpu_hosts_are_refused(nodes, tmp_path):
    # 13 CPU in the cluster: enough in total, but the CPU hosts have 9.
    cfg = cartpole("rollout.num_actors=10", "replay.num_shards=1", "learner.num_cpus=0.5")
    with pytest.raises(placement.ResourceError, match=r"CPU hosts have 9 CPU in all but rollout.num_actors = 10"):
        placement.plan(cfg)


# ------------------------------------------------------------------------------------------------------ layouts
@pytest.mark.long  # a larger layout of test_every_actor_lands_... (`make test-long`; CI runs it)
def test_six_actors_four_shards_four_learners_across_nodes(nodes, tmp_path):
    """6 rollout actors over the 3 CPU hosts, 4 learners on the NPU host: the graph places, trains every update
    in order and shuts down clean."""
    _, cpu, npu = nodes
    cfg = cartpole("learner.num_learners=4", "rollout.num_actors=6", "replay.num_shards=4",
                   "learner.batch_size=2048", "ppo.update_epochs=2", "run.total_env_steps=12288",
                   "run.time_budget_s=120")
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    try:
        trainer.build()
        where = trainer.placement_report()
        assert where["learners"] == [npu.node_id] * 4
        assert set(where["rollouts"]) == {n.node_id for n in cpu}
        result = trainer.run()
    finally:
        trainer.shutdown()
    assert result.reason == "total_env_steps" and result.iterations >= 6
    rec = records_of(tmp_path / "run")
    assert [r["policy_version"] for r in rec] == list(range(1, len(rec) + 1))
    assert rec[-1]["fragments_dropped_stale"] == 0


# ---------------------------------------------------------------------------------------------------- node loss
def node_loss_cfg(*extra):
    return cartpole("rollout.num_actors=3", "replay.num_shards=3", "run.total_env_steps=40960",
                    "run.time_budget_s=150", "run.stall_timeout_s=30", *extra)


def remove_when(cluster, node, run_dir, after_records: int, removed: list, ready=lambda: True) -> threading.Thread:
    """Remove ``node`` once the run has ``after_records`` records and ``ready()`` holds."""
    def run():
        path = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
                path.exists() and len(path.read_text().splitlines()) >= after_records and ready()):
            time.sleep(0.05)
        cluster.remove_node(node)
        removed.append(node.node_id)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.long
def test_a_lost_cpu_node_s_actors_and_shard_come_back_elsewhere_and_the_run_goes_on(nodes, cluster_nodes,
                                                                                     tmp_path):
    cluster, cpu, npu = nodes
    run_dir = tmp_path / "run"
    trainer = Trainer(node_loss_cfg(), run_dir, quiet=True)
    removed: list = []
    try:
        trainer.build()
        where = trainer.placement_report()
        assert sorted(where["rollouts"]) == sorted(n.node_id for n in cpu)  # one actor and its shard per CPU host
        # Not the head (cpu[0]: the GCS lives there) and not the supply board's host (that case is the
        # board-restart test's).
        lost = next(n for n in cpu[1:] if n.node_id != where["board"])
        survivors = {n.node_id for n in cpu + [npu] if n is not lost}  # any node with room, the NPU host too
        remover = remove_when(cluster, lost, run_dir, 4, removed)
        result = trainer.run()
        remover.join(timeout=30)
        after = trainer.placement_report()
    finally:
        trainer.shutdown()
        if removed:
            put_back(cluster_nodes, lost)
    assert removed, "the test never removed the node"
    assert result.reason == "total_env_steps", trainer.failure
    last = records_of(run_dir)[-1]
    assert last["rollout_restarts"] >= 1 and last["shard_restarts"] >= 1
    assert last["rollout_actors"] == 3
    assert set(after["rollouts"] + after["shards"]) <= survivors
    assert last["fragments_dropped_stale"] == 0


@pytest.mark.long  # the second node-loss case (`make test-long`; CI runs it)
def test_losing_the_only_accelerator_host_ends_the_run_in_one_line_with_a_final_checkpoint(nodes, cluster_nodes,
                                                                                          tmp_path):
    cluster, cpu, npu = nodes
    run_dir = tmp_path / "run"
    # No live node has NPU left: the restart says so at once, not at run.startup_timeout_s (180 s here, past the
    # test's limit below).
    trainer = Trainer(node_loss_cfg("run.checkpoint_interval_s=0.5"), run_dir, quiet=True)
    removed: list = []
    try:
        trainer.build()
        # After a periodic checkpoint exists, so final.pt has something to hold.
        remover = remove_when(cluster, npu, run_dir, 2, removed,
                              ready=lambda: bool(checkpoint.periodic(run_dir / "checkpoints")))
        t0 = time.monotonic()
        result = trainer.run()
        took = time.monotonic() - t0
        remover.join(timeout=30)
    finally:
        trainer.shutdown()
        if removed:
            put_back(cluster_nodes, npu)
    assert removed
    assert result.reason == "failed"
    assert trainer.failure.startswith("the learner group died") and "could not be restarted" in trainer.failure
    assert "the Ray cluster has 0 NPU on its live nodes but learner.num_learners = " in trainer.failure
    assert "\n" not in trainer.failure
    assert result.checkpoint_path is not None and result.checkpoint_path.name == "final.pt"
    assert checkpoint.load(result.checkpoint_path)["stop_reason"] == "failed"
    assert took < 120


def test_each_learner_takes_the_npu_ray_assigned_it_with_or_without_narrowed_visible_devices(nodes):
    """Ray assigns each NPU actor its own id. By default it narrows ASCEND_RT_VISIBLE_DEVICES to that id (index 0
    of what the actor sees); with RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES=1 every device stays visible,
    and a fixed index 0 would put every learner of the host on NPU 0. The learner's choice (``assigned_index``),
    through Ray's own accelerator ids on the NPU host (no NPU needed to place by the resource)."""
    from learner import device as devices

    @_ray.remote(num_cpus=0, resources={"NPU": 1})
    class Where:
        def index(self):
            ids = _ray.get_runtime_context().get_accelerator_ids()["NPU"]
            return ids, os.environ.get("ASCEND_RT_VISIBLE_DEVICES"), devices.assigned_index(devices.spec_for("npu"))

    noset = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1"}}
    for runtime_env, narrowed in ((None, True), (noset, False)):
        actors = [Where.options(runtime_env=runtime_env).remote() for _ in range(3)]
        try:
            seen = _ray.get([a.index.remote() for a in actors], timeout=60)
        finally:
            for a in actors:
                _ray.kill(a)
        ids = [int(i[0]) for i, _, _ in seen]
        assert len(set(ids)) == 3, seen
        if narrowed:
            assert all(visible == i[0] and index == 0 for i, visible, index in seen), seen
        else:  # every device visible: the device is the assigned one, a different one for each learner
            assert [index for _, _, index in seen] == ids, seen


def test_the_auto_batch_probe_measures_the_learners_own_accelerator(nodes):
    """learner.batch_size: auto measures free memory on the device the learner will have: the probe asks for the
    learner's accelerator resource from its bundle (Ray assigns it an NPU id), where a probe asking for none would
    see every device and measure the first."""
    from ray.util.placement_group import remove_placement_group

    from cluster.graph import describe_env

    cfg = cartpole("learner.batch_size=auto", "learner.batch_size_max=2048")
    plan = placement.plan(cfg)
    pg = placement.reserve_learners(cfg, plan, "probe")
    try:
        said = placement.resolve_auto_batch(cfg, plan, pg, describe_env(cfg))
    finally:
        remove_placement_group(pg)
    assert " on NPU " in said and cfg.learner.batch_size == 2048, said
