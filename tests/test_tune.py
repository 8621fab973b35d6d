"""Sweeps on Ray Tune: a 2 x 2 grid on short budgets, with a trial that fails and is reported."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest

from cluster.tune import parse_grid, trial_overrides
from tests.conftest import ROOT


def test_grid_is_every_combination():
    grid = parse_grid(["learner.lr=1e-3,3e-4", "ppo.update_epochs=4,8"])
    assert trial_overrides(grid) == [
        ["learner.lr=1e-3", "ppo.update_epochs=4"], ["learner.lr=1e-3", "ppo.update_epochs=8"],
        ["learner.lr=3e-4", "ppo.update_epochs=4"], ["learner.lr=3e-4", "ppo.update_epochs=8"]]


def sweep(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "cluster.tune", "--config", "configs/cartpole.yaml",
                           "--out", str(tmp_path / "sweep"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)


def test_a_2x2_sweep_reports_every_trial_and_a_failed_one_is_not_fatal(tmp_path):
    pytest.importorskip("ray.tune")
    # A 2 x 2 grid on short budgets: 20k env steps and a target of 60 (a uniform policy averages ~22), which the
    # shipped settings (lr 1.5e-3, 8 epochs) reach within them.
    proc = sweep(tmp_path, "--grid", "learner.lr=1.5e-3,3e-4", "--grid", "ppo.update_epochs=8,2", "--seeds", "1",
                 "--max-concurrent", "2", "--set", "run.total_env_steps=20480", "--set", "run.target_return=60",
                 "--set", "run.target_window=20")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "sweep" / "results.csv")))
    assert [r["settings"] for r in rows] == [
        "learner.lr=1.5e-3 ppo.update_epochs=8", "learner.lr=1.5e-3 ppo.update_epochs=2",
        "learner.lr=3e-4 ppo.update_epochs=8", "learner.lr=3e-4 ppo.update_epochs=2"]
    assert all(r["error"] == "" and r["reason"] in ("target_reached", "total_env_steps") for r in rows), rows
    shipped = rows[0]
    assert shipped["reached"] == "True" and 0 < int(shipped["env_steps_to_target"]) <= 20480, shipped
    assert float(shipped["seconds_to_target"]) > 0
    lines = proc.stdout.strip().splitlines()  # Tune's own report comes first; ours is the last 6 lines
    header = next(i for i, line in enumerate(lines) if line.split()[:4] == ["trial", "settings", "seed", "reason"])
    assert len(lines) - header == 1 + 4 + 1 and lines[-1].startswith("results: "), lines[header:]
    print("\n".join(lines[header:]))  # the table, for the record


def test_a_trial_that_fails_is_a_row_with_its_error(tmp_path):
    pytest.importorskip("ray.tune")
    # Both configs load; the second trial's env cannot be made, which its driver finds at start.
    proc = sweep(tmp_path, "--grid", "env.id=CartPole-v1,NoSuchEnv-v9", "--seeds", "0",
                 "--set", "run.total_env_steps=2048", "--set", "run.require_target=false")
    rows = list(csv.DictReader(open(tmp_path / "sweep" / "results.csv")))
    assert len(rows) == 2
    assert rows[0]["error"] == "" and rows[0]["reason"] == "total_env_steps", rows[0]
    assert rows[1]["reason"] == "error" and "NoSuchEnv-v9" in rows[1]["error"], rows[1]
    assert proc.returncode == 1 and "NoSuchEnv-v9" in proc.stdout, proc.stdout[-2000:]
