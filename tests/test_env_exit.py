"""An env that calls ``os._exit`` (a simulator's own exit on a fatal error) says so before its process ends
(``actors/exit_guard.py``): on Ray its rollout actor is replaced and the run reaches its end, the line forwarded to
the driver's stderr; in process it ends the command with exit 5 (run failed) and one line, never the env's own code
(0 would read as a success)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cluster import exits
from tests.conftest import ROOT

ENV = "tests.faulty_env:AscentRLTest/Faulty-v0"


def run(tmp_path, *mode: str, code_env: str = "exit") -> subprocess.CompletedProcess:
    run_dir = tmp_path / "run"
    return subprocess.run(
        [sys.executable, "-m", "cluster.train", "--config", "configs/cartpole.yaml", *mode, "--run-dir", str(run_dir),
         "--set", f"env.id={ENV}", "--set", f"env.kwargs={{fault: {code_env}, at_step: 300, token: '{tmp_path}/tok'}}",
         "--set", "run.total_env_steps=12000", "--set", "run.require_target=false", "--set",
         "run.progress_interval_s=1000"],
        cwd=ROOT, capture_output=True, text=True, timeout=240)


def test_in_process_an_env_os_exit_ends_the_command_with_exit_5_and_one_line_naming_it(tmp_path):
    proc = run(tmp_path, "--address", "inprocess")
    assert proc.returncode == exits.RUN_FAILED.code, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("run failed: an env called os._exit(7) in rollout-0"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.long  # a Ray start and a replacement: make test-long
def test_on_ray_an_env_os_exit_is_named_and_its_actor_replaced(tmp_path):
    proc = run(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "an env called os._exit(7) in this rollout actor's process" in proc.stderr, proc.stderr[-3000:]
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert records[-1]["rollout_restarts"] == 1 and records[-1]["env_steps"] >= 12000


def test_a_process_forked_from_a_guarded_one_exits_with_its_own_code_and_says_nothing():
    """The code env forks each program and ends it with os._exit(0): that is the child ending itself, not an env
    ending the actor's process, even from a rollout thread of a guarded process."""
    script = """
import os, sys, threading
sys.path.insert(0, %r)
from actors import exit_guard
exit_guard.install()
def run():
    pid = os.fork()
    if pid == 0:
        os._exit(3)
    print(os.waitpid(pid, 0)[1] >> 8)
t = threading.Thread(target=run, name="rollout-0")
t.start()
t.join()
""" % str(ROOT)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "3" and proc.stderr == "", (proc.stdout, proc.stderr)
