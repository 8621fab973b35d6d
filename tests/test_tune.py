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
    # 2 x 2 on short budgets (20k env steps, a target of 60 where a uniform policy averages ~22). Both configs load,
    # but NoSuchEnv-v9 cannot be made: its drivers fail at start, and the sweep reports them and goes on. Each env in
    # both modes: the trial's run on Ray actors of its own, and in process inside the trial's Tune worker.
    proc = sweep(tmp_path, "--grid", "env.id=CartPole-v1,NoSuchEnv-v9", "--grid", "ray.address=null,inprocess",
                 "--seeds", "1", "--max-concurrent", "2", "--set", "run.total_env_steps=20480",
                 "--set", "run.target_return=60", "--set", "run.target_window=20")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # 1: some trial failed
    rows = list(csv.DictReader(open(tmp_path / "sweep" / "results.csv")))
    assert [r["settings"] for r in rows] == [
        "env.id=CartPole-v1 ray.address=null", "env.id=CartPole-v1 ray.address=inprocess",
        "env.id=NoSuchEnv-v9 ray.address=null", "env.id=NoSuchEnv-v9 ray.address=inprocess"]
    for good in rows[:2]:  # the shipped config reaches 60 within the budget either way
        assert good["error"] == "" and good["reason"] == "target_reached" and good["reached"] == "True", good
        assert 0 < int(good["env_steps_to_target"]) <= 20480 and float(good["seconds_to_target"]) > 0, good
    for bad in rows[2:]:
        assert bad["reason"] == "error" and "NoSuchEnv-v9" in bad["error"], bad
    saved = {d.name.split("-")[0]: (d / "config.yaml").read_text() for d in (tmp_path / "sweep").iterdir()
             if d.name.startswith("trial") and (d / "config.yaml").exists()}
    assert "address: inprocess" in saved["trial001"] and "address: inprocess" not in saved["trial000"]
    lines = proc.stdout.strip().splitlines()  # Tune's own report comes first; ours is the last 6 lines
    header = next(i for i, line in enumerate(lines) if line.split()[:4] == ["trial", "settings", "seed", "reason"])
    assert len(lines) - header == 1 + 4 + 1 and lines[-1].startswith("results: "), lines[header:]
    print("\n".join(lines[header:]))  # the table, for the record

