"""Waits that have a deadline: each test stops (SIGSTOP) the real process the wait is on, or hangs the real job, and
checks the wait ends within its deadline in one line; the process is let go (SIGCONT) afterwards, whatever
happened."""

import os
import signal
import threading
import time

import pytest
import ray as _ray
from ray._private import ray_constants

from cluster import config as config_mod
from cluster import placement
from tests.conftest import ROOT

#: Slack over a deadline for the wait to return on a loaded 2-core host (thread hand-over, Ray's own timers).
SLACK_S = 10.0


def returns_within(fn, limit_s: float):
    """``fn()``'s (value, exception, seconds taken), run on a daemon thread; fails if it has not returned within
    ``limit_s`` (the wait has no deadline: the thread is left behind, blocked on what the test stopped)."""
    out: dict = {}

    def run():
        t0 = time.monotonic()
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - the caller asserts on it
            out["error"] = e
        out["s"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"still waiting after {limit_s:g} s: the wait has no deadline"
    return out.get("value"), out.get("error"), out["s"]


def let_go(pids) -> None:
    """SIGCONT each stopped process still there (the run may have killed it already)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def cartpole(*overrides):
    return config_mod.load(str(ROOT / "configs/cartpole.yaml"), list(overrides))


def raylet_pid() -> int:
    """The local node's raylet: every task placed on this (the only, so the learners') host goes through it."""
    node = _ray._private.worker._global_node
    return node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid


def test_the_auto_batch_probe_on_a_stopped_learner_host_is_one_line_within_the_start_deadline(ray_local):
    from cluster.graph import describe_env

    cfg = cartpole("learner.batch_size=auto", "run.startup_timeout_s=3")
    plan = placement.plan(cfg)
    spec = describe_env(cfg)
    pg = placement.reserve_learners(cfg, plan, "deadline-probe")
    raylet = raylet_pid()
    os.kill(raylet, signal.SIGSTOP)  # the learner host stops answering: the probe can be neither placed nor run
    try:
        _, error, took = returns_within(lambda: placement.resolve_auto_batch(cfg, plan, pg, spec), 3 + SLACK_S)
    finally:
        let_go([raylet])
        _ray.util.remove_placement_group(pg)
    assert isinstance(error, placement.ResourceError), error
    text = str(error)
    assert "\n" not in text and "learner.batch_size: auto" in text and "run.startup_timeout_s" in text, text
    assert took >= 3
    assert cfg.learner.batch_size == "auto"  # nothing was decided


def pid_of(handle) -> int:
    return _ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def test_the_control_command_on_a_stopped_control_actor_exits_in_one_line_within_its_timeout(ray_local, capsys):
    """The run's control actor (the same actor, registered under the name a run gives it) is stopped: the command
    gives up after --timeout with one line and exit 1, instead of waiting for it forever."""
    from cluster import control

    run = "deadline-control"
    actor = control.ControlActor.options(name=control.actor_name(run), namespace=control.NAMESPACE).remote(2, 1)
    pid = pid_of(actor)
    os.kill(pid, signal.SIGSTOP)
    try:
        code, error, took = returns_within(
            lambda: control.main(["--run", run, "--rollout-actors", "3", "--timeout", "2"]), 2 + SLACK_S)
    finally:
        let_go([pid])
        _ray.kill(actor)
    assert error is None and code == 1, error
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"error: run {run!r} did not answer within 2 s"), err
    assert took >= 2
    assert control.main(["--run", run, "--rollout-actors", "3", "--timeout", "1e99"]) == 2  # Ray's int64 ms
    assert capsys.readouterr().err.strip() == "error: --timeout: 1e+99 is out of range; allowed: 0 < S <= 86400"


def test_a_hung_preprocessing_job_ends_a_blocked_submit_and_close_within_the_deadline():
    """The scheduler's one worker is inside a job that never returns (a decoder stuck in native code): a producer
    blocked on the full queue, and close() waiting for the worker, each give up after hung_job_s with the job named."""
    from pipeline.scheduler import EDFScheduler

    release = threading.Event()
    started = threading.Event()

    def hung():
        started.set()
        release.wait()

    sched = EDFScheduler(num_workers=1, fast_capacity=1, name="prep-hung", hung_job_s=1.0)
    try:
        sched.submit(hung, fast=True, budget_s=0.01, tag="camera")
        assert started.wait(SLACK_S)
        sched.submit(abs, -1, fast=True, budget_s=0.01, tag="queued")  # the queue (capacity 1) is full now
        _, error, took = returns_within(lambda: sched.submit(abs, -2, fast=True, budget_s=0.01), 1 + SLACK_S)
        assert isinstance(error, TimeoutError), error
        assert str(error).startswith("prep-hung: the fast queue stayed full (1 jobs) for 1 s"), error
        assert "running: 'camera' (fast) for " in str(error), error
        assert took >= 1 and sched.metrics()["fast"]["blocked_s"] >= 1
        _, error, took = returns_within(sched.close, 1 + SLACK_S)
        assert isinstance(error, TimeoutError), error
        assert "still inside its job after 1 s" in str(error) and "'camera' (fast)" in str(error), error
    finally:
        release.set()
    assert sched.metrics()["fast"]["cancelled"] == 1  # the queued job failed at close, as before


def run_cfg(*extra):
    """Two rollout actors and two shards on a real local Ray, a run long enough that only its fault ends it early.
    run.stall_timeout_s = 15: the driver's deadline for a live shard, learner or board is 15 / 3 = 5 s."""
    return cartpole("rollout.num_actors=2", "rollout.envs_per_actor=8", "replay.num_shards=2",
                    "run.require_target=false", "run.target_return=null", "run.checkpoint_interval_s=null",
                    "run.total_env_steps=200000", "run.stall_timeout_s=15", *extra)


def records_of(run_dir) -> list[dict]:
    import json

    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.mark.long  # a second case of the lost board (test_env_faults.py's runs in `make test`); CI runs it
def test_a_stopped_shard_during_board_replacement_ends_the_run_in_one_line_with_final_pt(ray_local, tmp_path):
    """Shard 1 is stopped and the supply board killed at once: the replacement board's attach_board to shard 1 is
    never answered. The run ends as failed within the shards' 5 s answer deadline, in one line naming the shard,
    with final.pt from the learner."""
    from cluster.driver import Trainer
    from tests.conftest import kill_all, wait_for_records

    run_dir = tmp_path / "run"
    trainer = Trainer(run_cfg(), run_dir, quiet=True)
    struck: list = []
    stopped: list = []

    def strike():
        wait_for_records(run_dir, 2)
        shard, board = pid_of(trainer.shards[1]), pid_of(trainer.board)
        os.kill(shard, signal.SIGSTOP)
        stopped.append(shard)
        os.kill(board, signal.SIGKILL)
        struck.append(time.monotonic())

    try:
        trainer.build()
        striker = threading.Thread(target=strike, daemon=True)
        striker.start()
        result, error, _ = returns_within(trainer.run, 90)
        ended = time.monotonic()
        striker.join(timeout=30)
    finally:
        let_go(stopped)
        trainer.shutdown()
        kill_all(stopped)
    assert struck, "the test never struck"
    assert error is None, error
    assert ended - struck[0] < 5 + SLACK_S + 10  # the 5 s deadline, the final checkpoint (10 s at most) and slack
    assert result.reason == "failed"
    assert trainer.failure.startswith("the supply board died (") and "\n" not in trainer.failure, trainer.failure
    assert ("and could not be replaced: replay shard 1 did not answer within 5 s (min(30 s, "
            "run.stall_timeout_s / 3))") in trainer.failure, trainer.failure
    assert "replay shard 0" not in trainer.failure and "learner 0" not in trainer.failure, trainer.failure
    assert result.checkpoint_path == run_dir / "checkpoints" / "final.pt" and result.checkpoint_path.is_file()
    from cluster import checkpoint

    assert checkpoint.load(result.checkpoint_path)["stop_reason"] == "failed"


@pytest.mark.long  # a second case of the lost control actor (test_env_faults.py's runs in `make test`); CI runs it
def test_a_control_actor_stopped_while_a_rescale_is_refused_is_replaced_and_the_run_goes_on(ray_local, tmp_path):
    """Scaling past the free CPUs: the refusal tells the control actor the count that fits (applied). The actor is
    stopped right then, when the driver says the refusal line: the driver waits its 5 s for it, replaces it asking
    for the actors running, and trains on (the control actor holds only a count: nothing ends for it)."""
    from cluster.driver import Trainer

    @_ray.remote(num_cpus=1)
    class Hog:
        def ping(self):
            return True

    run_dir = tmp_path / "run"
    trainer = Trainer(run_cfg("rollout.num_actors=1", "replay.num_shards=1", "run.total_env_steps=24576"), run_dir,
                      quiet=True)
    lines: list = []
    stopped: list = []

    def say(line):
        lines.append(line)
        if "more fit the free resources" in line and not stopped:
            os.kill(control_pid, signal.SIGSTOP)  # before the driver's applied call reaches it
            stopped.append(control_pid)

    trainer.supervisor.say = say
    hog = None
    try:
        trainer.build()
        control_pid = pid_of(trainer.control)
        free = _ray.available_resources().get("CPU", 0)
        if free > 1:  # leave exactly one CPU free, then ask for 3 more actors
            hog = Hog.options(num_cpus=free - 1).remote()
            _ray.get(hog.ping.remote(), timeout=60)
        _ray.get(trainer.control.set_rollout_actors.remote(4), timeout=30)
        result, error, _ = returns_within(trainer.run, 90)
    finally:
        let_go(stopped)
        trainer.shutdown()
        if hog is not None:
            _ray.kill(hog)
    assert stopped, "the rescale was never refused"
    assert error is None, error
    assert result.reason == "total_env_steps", trainer.failure
    assert any(line == "the control actor did not answer; replaced, asking for the 2 rollout actors running now"
               for line in lines), lines
    assert not any("is taken" in line for line in lines), lines  # the new control actor has the run's name: reachable
    last = records_of(run_dir)[-1]
    assert last["control_restarts"] == 1 and last["rollout_actors"] == 2


class SilentListener:
    """A TCP port that accepts every connection and never says a word: a cluster whose GCS is stopped (SIGSTOP keeps
    its socket accepting in the kernel's backlog) or a port that is not Ray's."""

    def __init__(self):
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.held: list = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                pass

    def close(self):
        self._stop.set()
        for conn in self.held:
            conn.close()
        self.sock.close()


@pytest.mark.parametrize("command", ["train", "control"])
def test_joining_a_cluster_that_accepts_and_never_answers_ends_in_one_line_within_its_deadline(tmp_path, command):
    """``ray.init`` to such an address waits inside Ray's core for good (measured: still waiting after 200 s, Ray
    printing a retry line every 30 s). cluster.train ends it at run.startup_timeout_s, cluster.control at --timeout:
    one line naming the address and the setting, exit 2."""
    import subprocess
    import sys

    listener = SilentListener()
    address = f"127.0.0.1:{listener.port}"
    deadline = 3
    if command == "train":
        argv = ["cluster.train", "--config", "configs/cartpole.yaml", "--address", address, "--run-dir",
                str(tmp_path / "run"), "--set", f"run.startup_timeout_s={deadline}"]
        setting = "run.startup_timeout_s"
    else:
        argv = ["cluster.control", "--run", "x", "--rollout-actors", "2", "--address", address, "--timeout",
                str(deadline)]
        setting = "--timeout"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, env=env,
                              timeout=deadline + 60)
    finally:
        listener.close()
    elapsed = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert f"the Ray cluster at {address} accepted a connection but did not let this process join within " \
           f"{deadline} s ({setting})" in line, proc.stderr[-3000:]
    assert elapsed < deadline + SLACK_S + 10, elapsed  # + the interpreter's and Ray's imports
