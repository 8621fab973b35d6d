"""Losing a node mid-run, on a real multi-node Ray (``ray.cluster_utils.Cluster``: 3 CPU hosts and one host with
``NPU: 2`` whose learner computes on the CPU, over gloo)."""

import json
import threading
import time

import pytest
import ray as _ray

from cluster import checkpoint
from cluster import config as config_mod
from cluster.driver import Trainer
from tests.conftest import ROOT


def records_of(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def four_nodes():
    """One cluster for the module: the first test removes a CPU node, the second the accelerator node."""
    from ray.cluster_utils import Cluster

    if _ray.is_initialized():
        _ray.shutdown()  # the shared local Ray; ray_local starts it again for later tests
    cluster = Cluster()
    cpu = [cluster.add_node(num_cpus=2) for _ in range(3)]
    npu = cluster.add_node(num_cpus=2, resources={"NPU": 2})
    _ray.init(address=cluster.address, namespace="ascent_rl_node_loss", log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        yield cluster, cpu, npu
    finally:
        _ray.shutdown()
        cluster.shutdown()


def cfg_for(*extra):
    return config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "learner.device=cpu", "learner.placement_resource=NPU", "rollout.num_actors=3", "replay.num_shards=3",
        "rollout.envs_per_actor=8", "run.target_return=null", "run.require_target=false",
        "run.total_env_steps=40960", "run.time_budget_s=150", "run.stall_timeout_s=30", *extra])


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


def test_a_lost_cpu_node_s_actors_and_shard_come_back_elsewhere_and_the_run_goes_on(four_nodes, tmp_path):
    cluster, cpu, npu = four_nodes
    run_dir = tmp_path / "run"
    trainer = Trainer(cfg_for(), run_dir, quiet=True)
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
    assert removed, "the test never removed the node"
    assert result.reason == "total_env_steps", trainer.failure
    last = records_of(run_dir)[-1]
    assert last["rollout_restarts"] >= 1 and last["shard_restarts"] >= 1
    assert last["rollout_actors"] == 3
    assert set(after["rollouts"] + after["shards"]) <= survivors
    assert last["fragments_dropped_stale"] == 0


def test_losing_the_only_accelerator_host_ends_the_run_in_one_line_with_a_final_checkpoint(four_nodes, tmp_path):
    cluster, cpu, npu = four_nodes
    run_dir = tmp_path / "run"
    # No live node has NPU left: the restart says so at once, not at run.startup_timeout_s (180 s here, past the
    # test's limit below).
    trainer = Trainer(cfg_for("run.checkpoint_interval_s=0.5"), run_dir, quiet=True)
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
    assert removed
    assert result.reason == "failed"
    assert trainer.failure.startswith("the learner group died") and "could not be restarted" in trainer.failure
    assert "the Ray cluster has 0 NPU on its live nodes but learner.num_learners = " in trainer.failure
    assert "\n" not in trainer.failure
    assert result.checkpoint_path is not None and result.checkpoint_path.name == "final.pt"
    assert checkpoint.load(result.checkpoint_path)["stop_reason"] == "failed"
    assert took < 120
