"""The whole actor graph on a real local Ray: driver, rollouts, shards, learners."""

import json
import subprocess
import sys

import numpy as np
import ray as _ray

from cluster import checkpoint
from cluster import config as config_mod
from cluster.driver import Trainer
from tests.conftest import ROOT, alive_actor_names, train_to_end

REQUIRED_METRICS = {
    "iteration", "time_s", "env_steps", "env_steps_per_s", "learner_samples_per_s", "host_bound_fraction",
    "h2d_ms", "h2d_bytes", "host_syncs", "policy_lag_mean", "policy_lag_max", "fragments_dropped_stale",
    "replay_depth", "policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "explained_variance",
    "episode_return_mean", "policy_version", "lr",
}


def small_config(*extra: str) -> config_mod.Config:
    return config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "rollout.envs_per_actor=8", "rollout.fragment_length=32", "learner.batch_size=512",
        "learner.minibatch_size=128", "run.total_env_steps=12288", "run.target_return=null",
        "run.require_target=false", *extra,
    ])


def test_full_graph_runs_writes_metrics_and_checkpoint_and_leaves_no_actor(ray_local, tmp_path):
    cfg = small_config("rollout.num_actors=2", "replay.num_shards=2")
    result = train_to_end(cfg, tmp_path / "run")
    assert result.reason == "total_env_steps"
    assert result.env_steps >= cfg.run.total_env_steps

    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(records) == result.iterations >= cfg.run.total_env_steps // cfg.learner.batch_size - 2
    for r in records:
        assert REQUIRED_METRICS <= r.keys()
        assert 0.0 <= r["host_bound_fraction"] <= 1.0
        assert r["policy_lag_max"] <= cfg.replay.max_policy_lag
    assert [r["iteration"] for r in records] == list(range(1, len(records) + 1))
    steps = [r["env_steps"] for r in records]
    assert steps == sorted(steps)
    # Every iteration trained exactly one batch; the rate limit keeps rollouts from outrunning the learner.
    assert records[-1]["learner_samples"] == len(records) * cfg.learner.batch_size
    assert records[-1]["fragments_dropped_stale"] == 0
    # Learning statistics are real numbers from real updates.
    assert all(np.isfinite(r["policy_loss"]) and r["entropy"] > 0 for r in records)
    assert records[-1]["policy_version"] == len(records)

    ckpt = checkpoint.load(result.checkpoint_path)
    assert ckpt["learner"]["version"] >= len(records) and ckpt["run_state"]["env_steps"] == result.env_steps
    assert ckpt["run_state"]["iteration"] == len(records) and ckpt["stop_reason"] == "total_env_steps"
    assert ckpt["config"]["learner"]["batch_size"] == 512
    assert {"torch", "ray", "gymnasium"} <= ckpt["versions"].keys()
    _wait_no_actors()


def _wait_no_actors(timeout=10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive_actor_names(_ray):
            return True
        time.sleep(0.2)
    raise AssertionError(f"actors left behind: {alive_actor_names(_ray)}")


def test_two_learners_keep_identical_parameters_after_every_update(ray_local, tmp_path):
    # Under ppo.clip_around update_start (each rank's own forward of its batch before the epochs, no collective in
    # it); the behaviour objective's two learners: tests/test_multimodal_pipeline.py.
    cfg = small_config("learner.num_learners=2", "rollout.num_actors=2", "replay.num_shards=2",
                       "ppo.clip_around=update_start")
    trainer = Trainer(cfg, tmp_path / "run2", quiet=True)
    try:
        trainer.build()
        l0, l1 = trainer.learners
        p0, p1 = _ray.get([l0.flat_params.remote(), l1.flat_params.remote()])
        np.testing.assert_array_equal(p0, p1)
        initial = p0
        for _ in range(6):
            s0, s1 = _ray.get([l0.train_iteration.remote(), l1.train_iteration.remote()])
            assert s0["samples"] == s1["samples"] == cfg.local_batch_size
            # Each rank trained on its own fragments (the board split the update's tickets between them) ...
            assert len(s0["ticket_ids"]) == len(s1["ticket_ids"]) == cfg.fragments_per_learner
            assert not set(s0["ticket_ids"]) & set(s1["ticket_ids"])
            # ... so their local losses differ, although the averaged gradients keep the weights identical.
            assert s0["value_loss"] != s1["value_loss"]
            p0, p1 = _ray.get([l0.flat_params.remote(), l1.flat_params.remote()])
            np.testing.assert_array_equal(p0, p1)  # bit-identical: same averaged gradients, same Adam
        assert not np.array_equal(p0, initial), "parameters never changed"
        assert s0["allreduce_calls"] == s1["allreduce_calls"] == 6 * cfg.ppo.update_epochs * (
            cfg.learner.batch_size // cfg.learner.minibatch_size)
    finally:
        trainer.shutdown()
    _wait_no_actors()


# The CLI end to end on an embedded Ray (exit 0, "done:", final.pt, config.yaml, records) is checked on the run of
# tests/test_user_env.py, which is that same entry point on an embedded Ray with a user's env module.


def test_require_target_exit_code_when_missed(tmp_path):
    # The exit-code rule is the CLI's, the same in both modes; in process it costs no Ray start-up.
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.train", "--config", "configs/cartpole.yaml", "--address", "inprocess",
         "--set", "run.total_env_steps=4096", "--set", "run.target_return=10000", "--run-dir", str(tmp_path / "x")],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "target not reached" in proc.stderr


def test_the_embedded_ray_starts_only_what_a_local_run_needs():
    """cluster.train's embedded Ray (placement.start_ray): no autoscaler monitor, no API server without the dashboard,
    and the raylet retries its object-store connection every 50 ms (not 1,000); token authentication stays on; an
    actor runs on it; and Ray's own ways of starting those two are back once it has started (any other Ray this
    process starts, a test's multi-node cluster or a head with the dashboard, gets them). A fresh process: start_ray
    is ray.init."""
    code = """
import json, ray
from ray._private.node import Node
from cluster import config as config_mod, placement
before = (Node.start_monitor, Node.start_api_server)
cfg = config_mod.load("configs/cartpole.yaml", [])
assert placement.start_ray(cfg, None)
assert (Node.start_monitor, Node.start_api_server) == before, "Ray's Node methods left replaced"
node = ray._private.worker._global_node
from ray._private import ray_constants as rc
@ray.remote(num_cpus=0)
def one():
    return 1
out = {"kinds": sorted(node.all_processes), "config": json.loads(node._config) if isinstance(node._config, str)
       else dict(node._config), "one": ray.get(one.remote(), timeout=60),
       "monitor": rc.PROCESS_TYPE_MONITOR, "dashboard": rc.PROCESS_TYPE_DASHBOARD}
placement.stop_ray()
print(json.dumps(out))
"""
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["one"] == 1
    assert out["monitor"] not in out["kinds"] and out["dashboard"] not in out["kinds"], out["kinds"]
    assert out["config"]["raylet_client_connect_timeout_milliseconds"] == 50, out["config"]
    assert "Token authentication is enabled" in proc.stderr  # Ray 2.60's default, kept
