"""Uneven layouts, live rescaling with several learners and stalls, on a real local Ray (multi-node layouts are
test_multinode's)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from cluster import checkpoint
from cluster import config as config_mod
from cluster.driver import Trainer
from tests.conftest import ROOT, assert_session_ends, train_to_end, train_while_rescaling, wait_for_records


def cartpole(*extra):
    return config_mod.load(str(ROOT / "configs/cartpole.yaml"),
                           ["run.require_target=false", "run.checkpoint_interval_s=null", *extra])


def records_of(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def test_three_actors_three_shards_two_learners_train_every_update(ray_local, tmp_path):
    """The layout that hung before tickets: learner 1 read shard 1 only, which got 2 of the 3 fragments it
    needed per version. Here every one of 6 updates of a 6144-sample batch (6 fragments, 3 per learner) is trained
    in full by both learners, and nothing is lost or made twice; that hang stops the run at the stall deadline
    instead (30 s here, not the default 120 s) and fails the first assertion.

    Fixed updates, not a run to 475 (it was, ~258k env steps and 13-30 s): what this layout can get wrong is the data
    path, which every update goes through; two learners learning to a target is the rescale test's below."""
    updates = 6
    cfg = cartpole("rollout.num_actors=3", "replay.num_shards=3", "learner.num_learners=2",
                   "learner.batch_size=6144", f"run.total_env_steps={updates * 6144}", "run.target_return=null",
                   "run.stall_timeout_s=30",
                   # 3 minibatches per learner per epoch, not 12: each step is a gloo all-reduce, and what this test
                   # is about is the layout, not the minibatch shape.
                   "learner.minibatch_size=2048")
    result = train_to_end(cfg, tmp_path / "run")
    assert result.reason == "total_env_steps", result
    rec = records_of(tmp_path / "run")
    assert len(rec) == result.iterations >= updates
    assert [r["policy_version"] for r in rec] == list(range(1, len(rec) + 1))
    last = rec[-1]
    assert last["learner_samples"] == len(rec) * cfg.learner.batch_size  # each update: its whole batch, both ranks
    assert last["fragments_dropped_stale"] <= 0.01 * last["fragments_produced"]
    assert last["fragments_lost"] == 0
    # Production followed consumption: at most the in-flight bound beyond what was trained.
    trained = last["learner_samples"] // cfg.fragment_samples
    assert trained <= last["fragments_produced"] <= trained + cfg.replay_bound


@pytest.mark.long  # a larger layout of test_faults.py's rescale test (`make test-long`; CI runs it)
def test_rescale_one_three_two_rollout_actors_with_two_learners(ray_local, tmp_path):
    """1 -> 3 -> 2 actors under two learners, for 16 updates (two learners learning to a target across restarts is
    test_faults' learner test)."""
    run_dir = tmp_path / "scaled"
    cfg = cartpole("rollout.num_actors=1", "replay.num_shards=1", "learner.num_learners=2",
                   "learner.batch_size=2048", "rollout.envs_per_actor=8", "run.target_return=null",
                   f"run.total_env_steps={16 * 2048}", "run.time_budget_s=240")
    result, calls = train_while_rescaling(cfg, run_dir, [(2, 3), (6, 2)])
    assert calls == [0, 0]
    rec = records_of(run_dir)
    counts = [r["rollout_actors"] for r in rec]
    assert counts[0] == 1 and 3 in counts and counts[-1] == 2, counts
    assert result.reason == "total_env_steps"
    assert [r["policy_version"] for r in rec] == list(range(1, len(rec) + 1))
    assert rec[-1]["fragments_dropped_stale"] <= 0.01 * rec[-1]["fragments_produced"]
    # A removed actor's unfinished ticket is made by another one: refunded, never lost.
    assert rec[-1]["fragments_lost"] <= 1


# The stuck runs below: the only rollout actor's 8 envs hang for good at their 301st step, after 2,400 env steps (9
# fragments of 256, 4 updates of 512): a few records, then a learner stuck waiting within about a second of training
# (the env's default, 2,000 steps each, made 16,000 env steps and 31 updates of waiting for it first).
HANG_AFTER = 300
STUCK = ["env.id=tests.hanging_env:AscentRLTest/HangAfter-v0", f"env.kwargs={{hang_after_steps: {HANG_AFTER}}}",
         "rollout.envs_per_actor=8", "learner.batch_size=512", "learner.minibatch_size=256"]


def stuck_cli(config_sets: list[str]) -> list[str]:
    return [arg for s in STUCK + config_sets for arg in ("--set", s)]


def test_a_starved_learner_stops_the_run_with_one_line_exit_1_and_a_final_checkpoint(tmp_path):
    """The only rollout actor's env blocks for good: the learner gets no batch and says what it waits for, in one
    line, exit 1 (through the CLI, in process; the same run on Ray is the next test's)."""
    run_dir = tmp_path / "stalled"
    stall = 6
    cmd = [sys.executable, "-m", "cluster.train", "--config", str(ROOT / "configs/cartpole.yaml"),
           "--address", "inprocess", "--run-dir", str(run_dir), *stuck_cli([f"run.stall_timeout_s={stall}"])]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 5, proc.stderr[-3000:]
    failure = [line for line in proc.stderr.splitlines() if line.startswith("run failed:")]
    assert len(failure) == 1, proc.stderr[-3000:]
    check_starved(failure[0], run_dir, elapsed, stall)


def test_a_starved_learner_on_ray_is_the_same_one_line_failure(ray_local, tmp_path):
    """On Ray (the test process's shared local Ray, not a CLI start of its own: the CLI's exit code and line are the
    test above's), where the learner's wait and its error cross a process boundary."""
    run_dir = tmp_path / "stalled"
    stall = 6
    trainer = Trainer(cartpole(*STUCK, f"run.stall_timeout_s={stall}"), run_dir, quiet=True)
    t0 = time.monotonic()
    try:
        trainer.build()
        result = trainer.run()
    finally:
        trainer.shutdown()
    elapsed = time.monotonic() - t0
    assert result.reason == "failed" and trainer.failure and "\n" not in trainer.failure, trainer.failure
    check_starved(trainer.failure, run_dir, elapsed, stall)


def check_starved(line: str, run_dir, elapsed: float, stall: float) -> None:
    assert "learner 0 got no batch for" in line and "waits for update" in line, line
    assert "issued to rollout actor 0" in line and "shards: 0:" in line, line
    ck = checkpoint.load(run_dir / "checkpoints" / "final.pt")
    assert ck["stop_reason"] == "failed"
    # The stall is noticed within stall_timeout_s + 10 s of the last record (start-up takes the rest: Ray, actors,
    # the first iterations).
    rec = records_of(run_dir)
    assert rec[-1]["env_steps"] <= 8 * HANG_AFTER  # nothing was trained past the hang
    assert elapsed - rec[-1]["time_s"] < stall + 10 + 15


def test_time_budget_ends_the_run_while_a_learner_is_stuck(tmp_path):
    """In process: the budget is the driver's wait loop (runtime.wait with a deadline, the same code on Ray), and
    this saves the actor graph's start on Ray; Ray's side of a stuck run is the starved and Ctrl-C tests' [ray]
    runs. The env hangs within about a second of training (HANG_AFTER), so the 4 s budget ends a stuck wait, not a
    run making progress; the hung env's daemon thread stays behind, blocked, in this test process."""
    budget = 4
    cfg = cartpole(*STUCK, "ray.address=inprocess", "run.stall_timeout_s=600", f"run.time_budget_s={budget}")
    t0 = time.monotonic()
    result = train_to_end(cfg, tmp_path / "run")
    assert result.reason == "time_budget"
    assert time.monotonic() - t0 < budget + 40  # build + budget + final checkpoint and shutdown, not stall_timeout_s
    assert (tmp_path / "run" / "checkpoints" / "final.pt").is_file()
    rec = records_of(tmp_path / "run")
    assert rec and rec[-1]["env_steps"] <= 8 * HANG_AFTER  # it was stuck: nothing trained past the hang


@pytest.mark.parametrize("sig,mode", [(signal.SIGTERM, []), (signal.SIGINT, ["--address", "inprocess"])],
                         ids=["sigterm-ray", "sigint-inprocess"])
def test_a_signal_ends_a_stuck_run_with_a_final_checkpoint_and_nothing_left(tmp_path, sig, mode):
    """SIGTERM (a scheduler, ``ray job stop``) and Ctrl-C take one path (cluster.train's GracefulStop): exit 143 or
    130, final.pt, the report, nothing of Ray left, within run.shutdown_grace_s, even while the driver waits on a
    learner that gets no batch (the case that once ended in an abort with Ray's agents left running). On Ray for
    SIGTERM, in process for SIGINT, where the hung env's thread cannot be killed and must not hold the process."""
    run_dir = tmp_path / "interrupted"
    grace = 20
    hung = tmp_path / "hung"  # created by the env as it hangs
    cmd = [sys.executable, "-m", "cluster.train", "--config", str(ROOT / "configs/cartpole.yaml"), *mode,
           "--run-dir", str(run_dir), *stuck_cli(["run.stall_timeout_s=600", f"run.shutdown_grace_s={grace}",
                                                  f"env.kwargs={{hang_after_steps: {HANG_AFTER}, "
                                                  f"hung_marker: '{hung}'}}"])]
    # A session of its own: whatever the run starts (Ray's processes) is in it, so "nothing left" can be checked.
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.stat().st_size) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metrics.exists(), "the run never got to its first iteration"
        # The env hangs 7 fragments (1,800 env steps) after the first record; then the learner trains what was
        # stored before it and waits: strike once the env has hung and the records have stopped for a second.
        while not hung.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert hung.exists(), "the env never hung"
        size, still_since = metrics.stat().st_size, time.monotonic()
        while time.monotonic() - still_since < 1.0 and time.monotonic() < deadline:
            time.sleep(0.1)
            if metrics.stat().st_size != size:
                size, still_since = metrics.stat().st_size, time.monotonic()
        assert time.monotonic() - still_since >= 1.0, "the run kept writing records after its env hung"
        t = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - t
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == {signal.SIGTERM: 143, signal.SIGINT: 130}[sig], err[-3000:]
    assert took < grace + 5, f"the stop took {took:.1f} s, past run.shutdown_grace_s"
    name = signal.Signals(sig).name
    assert f"{name} received" not in err and "Traceback" not in err, err[-3000:]  # Ray's own handler: a C stack
    assert f"{name}: stopping" in err, err[-3000:]
    assert checkpoint.load(run_dir / "checkpoints" / "final.pt")["stop_reason"] == "interrupted"
    assert records_of(run_dir)[-1]["env_steps"] <= 8 * HANG_AFTER  # nothing was trained past the hang
    assert_session_ends(proc.pid)


@pytest.mark.long  # a second case of the SIGTERM test above (`make test-long`; CI runs it)
def test_a_second_sigterm_exits_at_once_and_leaves_nothing_of_ray(tmp_path):
    """SIGTERM, then another 0.3 s later, while the first one's shutdown runs: exit 143 at once, without the final
    checkpoint, and nothing of Ray left (cluster.placement.kill_ray). Before the raylet's children were killed with
    it, Ray's dashboard and runtime-env agents outlived the exit by over a minute in 2 of 3 tries."""
    run_dir = tmp_path / "twice"
    cmd = [sys.executable, "-m", "cluster.train", "--config", str(ROOT / "configs/cartpole.yaml"),
           "--run-dir", str(run_dir), *stuck_cli(["run.stall_timeout_s=600"])]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_for_records(run_dir, 1)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # into the first one's shutdown: what is asked is an exit from wherever it is
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err[-3000:]
    assert "SIGTERM again: exiting now, without the final checkpoint" in err, err[-3000:]
    assert_session_ends(proc.pid)


STOP_RAY_SCRIPT = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from cluster import config, placement
import ray
placement.start_ray(config.load(None, ["ray.num_cpus=2"]), None)
node = ray._private.worker._global_node
procs = {kind: [i.process for i in infos] for kind, infos in node.all_processes.items()}
t = time.monotonic()
placement.stop_ray()
took = time.monotonic() - t
print(json.dumps({"took": took, "ray_initialized": ray.is_initialized(),
                  "running": {k: sum(p.poll() is None for p in ps) for k, ps in procs.items()}}))
"""


def test_stop_ray_ends_every_process_ray_init_started():
    """cluster.placement.stop_ray (how the CLI and cluster.api.train end the embedded Ray they started): when it
    returns, every process ray.init started has exited, and Ray is down. In a process of its own, so that the
    tests' shared Ray is not the one stopped. (start_ray starts no autoscaler monitor: test_integration.py.)"""
    proc = subprocess.run([sys.executable, "-c", STOP_RAY_SCRIPT, str(ROOT)], capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"gcs_server", "raylet", "log_monitor"} <= set(out["running"]), out
    assert not out["ray_initialized"] and not any(out["running"].values()), out


# On Ray: `make test-long` (CI runs it), to keep `make test` within its 8 minutes; the counters are taken by the
# driver the same way in both modes, and the in-process case stays in `make test`.
@pytest.mark.parametrize("mode", [["--address", "inprocess"], pytest.param([], marks=pytest.mark.long)],
                         ids=["inprocess", "ray"])
def test_final_pt_written_on_a_signal_holds_the_counters_of_its_weights(tmp_path, mode):
    """Ctrl-C in the middle of a healthy run, with iterations in flight: final.pt's run state counts exactly the
    updates its weights hold (the learner's version), and the last metrics record is that iteration; a resume
    continues from there, counting on. (It once held weights one or two updates past its counters: the iterations
    in flight at the signal trained on but were never counted.)"""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "cluster.train", "--config", str(ROOT / "configs/cartpole.yaml"), *mode,
           "--run-dir", str(run_dir), "--set", "run.total_env_steps=100000000", "--set", "run.require_target=false",
           "--set", "run.target_return=null", "--set", "run.progress_interval_s=1000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_for_records(run_dir, 5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    final = checkpoint.load(run_dir / "checkpoints" / "final.pt")
    iteration = final["run_state"]["iteration"]
    assert final["learner"]["version"] == iteration, (final["learner"]["version"], iteration, err[-2000:])
    last = records_of(run_dir)[-1]
    assert last["iteration"] == iteration and last["env_steps"] == final["run_state"]["env_steps"], (last, iteration)
