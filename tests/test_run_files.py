"""The files around a run: trust of a run directory's code, one directory per run, truthful checkpoints.

A run directory is what people copy, share and reuse by name; these tests use real files, the real CLI (as a
subprocess, the way a user runs it) and, where learners die, a real local Ray.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from cluster import checkpoint
from cluster import config as config_mod
from cluster.driver import Trainer
from cluster.evaluation import PeriodicEvaluation
from cluster.records import RunState
from tests.conftest import ROOT, train_to_end, wait_for_records


def run_cli(*args, cwd=None, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "cluster.train", *args], cwd=cwd or ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def one_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def fake_checkpoint(path, iteration: int, run_id: str | None, model: dict | None = None, **extra):
    """A checkpoint as the driver writes it, with a one-tensor model (what latest/claim/load read) unless ``model``
    (what a resume past --dry-run checks against the config's model)."""
    model = model if model is not None else {"w": torch.full((2,), float(iteration))}
    payload = {"learner": {"model": model, "updates_done": iteration},
               "run_state": {**RunState.fresh(100).to_checkpoint(), "iteration": iteration}, **extra}
    if run_id is not None:
        payload["run_id"] = run_id
    return checkpoint.save(path, payload)


def cfg_for(*extra):
    return config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "rollout.envs_per_actor=8", "run.require_target=false", "run.target_return=null",
        "run.checkpoint_interval_s=null", *extra])


def run_killing_learner_0(ray_local, trainer, when) -> object:
    """Build and run ``trainer`` while a thread SIGKILLs its learner 0 once ``when()`` returns; the RunResult."""
    def kill():
        when()
        pid = ray_local.get(trainer.learners[0].__ray_call__.remote(lambda self: os.getpid()))
        os.kill(pid, signal.SIGKILL)

    try:
        trainer.build()
        threading.Thread(target=kill, daemon=True).start()
        return trainer.run()
    finally:
        trainer.shutdown()


# ---------------------------------------------------------------- trust
def test_resume_runs_no_code_from_the_run_directory_unless_trusted(tmp_path):
    """``--resume runs/x`` whose config.yaml names a module inside the run directory: refused in one line, and the
    module is never imported (it would write a file); with --trust-code it is imported."""
    run = tmp_path / "runs" / "x"
    marker = tmp_path / "pwned"
    (run / "checkpoints").mkdir(parents=True)
    (run / "payload.py").write_text(textwrap.dedent(f"""
        import pathlib, gymnasium
        pathlib.Path({str(marker)!r}).write_text("ran")
        gymnasium.register("PayloadEnv-v0", entry_point="gymnasium.envs.classic_control:CartPoleEnv")
    """))
    (run / "config.yaml").write_text("env:\n  id: runs.x.payload:PayloadEnv-v0\n")
    from cluster.graph import describe_env
    from learner.model import build_model

    cartpole = build_model(describe_env(cfg_for())).state_dict()  # the payload env is CartPole under another name
    fake_checkpoint(run / "checkpoints" / "final.pt", 3, None, model=cartpole)
    proc = run_cli("--dry-run", "--resume", "runs/x", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc)
    assert "runs.x.payload" in line and "--trust-code" in line, line
    assert not marker.exists(), "the run directory's module was imported"

    proc = run_cli("--dry-run", "--resume", "runs/x", "--trust-code", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert marker.read_text() == "ran"


# ---------------------------------------------------------------- one directory, one run
def test_a_new_run_refuses_a_directory_that_holds_another_run(tmp_path):
    """Another run's directory (with run.json, or from before run ids) is refused in one line, at --dry-run too,
    before anything is written; --resume of it is what the line says to do."""
    owned = tmp_path / "owned"
    fake_checkpoint(owned / "checkpoints" / "ckpt-00000900.pt", 900, "other")
    (owned / checkpoint.RUN_FILE).write_text(json.dumps({"run_id": "other"}))
    legacy = tmp_path / "legacy"
    fake_checkpoint(legacy / "checkpoints" / "final.pt", 900, None)
    for directory in (owned, legacy):
        before = sorted(p.name for p in directory.rglob("*"))
        proc = run_cli("--dry-run", "--run-dir", str(directory), "--address", "inprocess")
        assert proc.returncode == 2, proc.stderr
        line = one_line(proc)
        assert "holds another run" in line and f"--resume {directory}" in line, line
        assert sorted(p.name for p in directory.rglob("*")) == before
    # run.run_name names the same directory: the same refusal, from the driver as well as the CLI.
    cfg = cfg_for(f"run.output_dir={tmp_path}", "run.run_name=owned", "ray.address=inprocess")
    proc = run_cli("--dry-run", "--set", f"run.output_dir={tmp_path}", "--set", "run.run_name=owned")
    assert proc.returncode == 2 and "holds another run" in one_line(proc)
    with pytest.raises(config_mod.ConfigError, match="holds another run"):
        Trainer(cfg, owned, quiet=True)


def test_latest_takes_only_the_directorys_own_run(tmp_path):
    """A directory of run A into which run B's newer checkpoints were copied: latest() (what --resume, load_policy
    and cluster.evaluate take) is A's newest; a temp file a SIGKILL left mid-save is removed when the run starts."""
    directory = tmp_path / "checkpoints"
    (tmp_path / checkpoint.RUN_FILE).write_text(json.dumps({"run_id": "a"}))
    own = fake_checkpoint(directory / "ckpt-00000005.pt", 5, "a")
    fake_checkpoint(directory / "ckpt-00000900.pt", 900, "b")
    fake_checkpoint(directory / "final.pt", 900, "b")
    assert checkpoint.latest(tmp_path) == own
    legacy = fake_checkpoint(directory / "ckpt-00000007.pt", 7, None)  # before run ids, in this directory
    assert checkpoint.latest(tmp_path) == legacy
    assert checkpoint.latest(tmp_path, run_id="b") == directory / "final.pt"
    temp = directory / ".ckpt-00000010.pt.k2j3h4"
    temp.write_bytes(b"half a checkpoint")
    checkpoint.RunFiles(tmp_path).claim("a")
    assert not temp.exists()
    with pytest.raises(config_mod.ConfigError, match="holds another run"):
        checkpoint.RunFiles(tmp_path).claim("b")


@pytest.mark.long  # a second case of the learner-group restart (test_faults.py's runs in `make test`); CI runs it
def test_resume_into_another_directory_restarts_learners_from_the_resumed_state(ray_local, tmp_path):
    """``--resume X --run-dir Y``: a learner that dies before Y has a checkpoint of its own restarts the group from
    X's state (not from freshly initialised weights while the counters go on), and final.pt's weights and counters
    are one update's."""
    first = train_to_end(cfg_for("run.total_env_steps=6144", "ray.address=inprocess"), tmp_path / "x")
    resumed = checkpoint.load(checkpoint.latest(tmp_path / "x"))
    done_before = resumed["learner"]["updates_done"]
    assert done_before == first.iterations >= 6
    run_dir = tmp_path / "y"
    trainer = Trainer(cfg_for("run.total_env_steps=20480"), run_dir, quiet=True, resume=resumed)
    lines: list = []
    trainer.supervisor.say = lines.append
    result = run_killing_learner_0(ray_local, trainer, lambda: wait_for_records(run_dir, 2))
    assert result.reason == "total_env_steps", lines
    assert any("restarted from the checkpoint this run resumed from" in line for line in lines), lines
    final = checkpoint.load(run_dir / "checkpoints" / "final.pt")
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    after_restart = sum(r["learner_restarts"] == 1 for r in records)
    assert after_restart >= 1, records[-1]
    # From scratch, the restarted group would hold only the updates made since the restart.
    assert final["learner"]["updates_done"] == done_before + after_restart, (final["learner"]["updates_done"],
                                                                            after_restart)
    assert final["run_id"] == resumed["run_id"] == checkpoint.RunFiles(run_dir).run_id()


def test_final_checkpoint_without_a_learner_is_the_newest_periodic_one_whole(ray_local, tmp_path):
    """The learner group dies and may not restart (run.max_learner_restarts = 0): no learner can give its state, so
    final.pt is the newest periodic checkpoint with that checkpoint's own counters, not the run's later ones."""
    run_dir = tmp_path / "run"
    cfg = cfg_for("run.total_env_steps=200000", "run.checkpoint_interval_s=5", "run.max_learner_restarts=0")

    def two_updates_after_the_first_periodic_checkpoint():  # well before the next one
        deadline = time.monotonic() + 120
        while not checkpoint.periodic(run_dir / "checkpoints") and time.monotonic() < deadline:
            time.sleep(0.02)
        wait_for_records(run_dir, len(open(run_dir / "metrics.jsonl").readlines()) + 2)

    result = run_killing_learner_0(ray_local, Trainer(cfg, run_dir, quiet=True),
                                   two_updates_after_the_first_periodic_checkpoint)
    assert result.reason == "failed", result
    final = checkpoint.load(run_dir / "checkpoints" / "final.pt")
    assert final["learner"]["updates_done"] == final["run_state"]["iteration"] >= 1
    assert final["stop_reason"] == "failed"
    assert final["run_state"]["iteration"] <= result.iterations


# ---------------------------------------------------------------- labels
def test_best_checkpoint_survives_a_resume_unless_beaten(tmp_path):
    """A resumed run's evaluation starts from its best.pt's score: a worse first evaluation does not replace it.
    Another run's best.pt does not count."""
    cfg = cfg_for("eval.interval_iterations=1")
    best = tmp_path / "checkpoints" / "best.pt"
    checkpoint.save(best, {"learner": {"model": {}}, "eval": {"return_mean": 400.0}, "run_id": "a"})
    files = checkpoint.RunFiles(tmp_path)
    assert PeriodicEvaluation(cfg, None, files, print, run_id="a").best == 400.0
    assert PeriodicEvaluation(cfg, None, files, print, run_id="b").best == -math.inf


def test_a_signal_during_the_final_save_does_not_cut_it(tmp_path):
    """SIGTERM while the driver writes final.pt and the report: recorded (the exit code says it) and the grace timer
    armed, but nothing is raised into the save; before that, the same signal stops the driver loop."""
    from cluster.train import EXIT_TERMINATED, GracefulStop

    class Driver:
        finishing = False

    stopper = GracefulStop(grace_s=3600.0)
    stopper.trainer = Driver()
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        stopper.install()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        stopper.signum = None
        stopper.trainer.finishing = True
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the handler ran (signals are handled between bytecodes) and raised nothing
        assert stopper.signum == signal.SIGTERM and stopper.exit_code == EXIT_TERMINATED
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


# ---------------------------------------------------------------- bad checkpoints
@pytest.mark.parametrize("case", ["corrupt", "name", "pickle", "plain_pickle", "no_run_state"])
def test_resume_of_a_bad_checkpoint_is_one_line(tmp_path, case):
    run = tmp_path / "run"
    directory = run / "checkpoints"
    directory.mkdir(parents=True)
    (run / "config.yaml").write_text("env:\n  id: CartPole-v1\n")
    if case == "corrupt":
        (directory / "final.pt").write_bytes(os.urandom(300))
    elif case == "name":  # not a name the driver writes: not read, so there is nothing to resume
        fake_checkpoint(directory / "ckpt-abc.pt", 3, None)
    elif case == "pickle":  # objects a weights-only load refuses to build
        torch.save({"learner": {}, "run_state": {"iteration": 1}, "hook": threading.Event}, directory / "final.pt")
    elif case == "plain_pickle":  # a pickle made outside torch (protocol 5): torch's loader warns about it too
        (directory / "final.pt").write_bytes(pickle.dumps(os.system, protocol=5))
    else:
        checkpoint.save(directory / "final.pt", {"learner": {"model": {}}})
    proc = run_cli("--resume", str(run), "--address", "inprocess")
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc)
    assert line.startswith("config error: "), line
    assert "weights_only" not in line and len(line) < 400, line


def test_shutdown_does_not_wait_past_the_report_deadline(tmp_path, monkeypatch):
    """A report that never finishes (a stopped file system) holds the exit for REPORT_DEADLINE_S, not for ever."""
    from cluster import driver

    monkeypatch.setattr(driver, "REPORT_DEADLINE_S", 0.5)
    trainer = Trainer(cfg_for("ray.address=inprocess"), tmp_path / "run", quiet=True)
    stuck = threading.Event()
    trainer._report_thread = threading.Thread(target=stuck.wait, daemon=True)
    trainer._report_thread.start()
    t0 = time.monotonic()
    trainer.shutdown()
    assert time.monotonic() - t0 < 5
    stuck.set()
