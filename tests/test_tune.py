"""Sweeps on Ray Tune: a 2 x 2 grid on short budgets, with a trial that fails and is reported."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from cluster import config as config_mod
from cluster.tune import parse_grid, trial_overrides
from learner.learner import linear_lr
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


@pytest.mark.long  # an end-to-end run through another tool (Tune) (`make test-long`; CI runs it)
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



@pytest.mark.long  # an end-to-end run through another tool (Tune) (`make test-long`; CI runs it)
def test_pbt_population_of_4_exploits_through_the_resume_path_and_keeps_values_in_range(tmp_path):
    """A CartPole population of 4 (in process inside each Tune worker: no actor graph per segment) over learner.lr
    in a range wide enough that the trials' scores differ. Every 2 updates the bottom quarter takes the top
    quarter's checkpoint and its values, perturbed."""
    pytest.importorskip("ray.tune")
    lo, hi = 1e-6, 3e-3  # log-uniform: most trials draw an lr too small to learn in the budget, one or two do not
    interval, total = 2048, 16384  # 8 decisions a trial: an exploit is all but certain, not left to chance
    proc = sweep(tmp_path, "--scheduler", "pbt", "--population", "4", "--max-concurrent", "4",
                 "--mutate", f"learner.lr={lo}:{hi}", "--interval-steps", str(interval),
                 "--set", f"run.total_env_steps={total}", "--set", "run.target_return=null",
                 "--set", "run.require_target=false",
                 "--set", "ray.address=inprocess", "--set", "run.checkpoint_interval_s=null")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [f"run.total_env_steps={total}"])
    assert cfg.learner.anneal_lr
    out = tmp_path / "sweep"
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert sorted(r["trial"] for r in rows) == ["trial000", "trial001", "trial002", "trial003"], rows
    for r in rows:
        # The budget is the trial's, however many exploits it took (a run resumed past it trains no more). The
        # margin: a stop lets the iterations in flight finish and counts what the rollouts made meanwhile (2-3
        # batches on a loaded machine); each resume past the budget used to add 3 updates more.
        assert r["error"] == "" and total <= int(r["env_steps"]) < total + 2 * interval and float(r["score"]) > 0, r
        assert lo <= float(r["settings"].split("=")[1]) <= hi, r
    assert sum(int(r["exploits"]) for r in rows) >= 1, rows
    # An exploit, as the exploiting trial saw it: another trial's checkpoint, its counters carried on (the resume
    # path: the records continue from the donor's env steps and iteration), and the perturbed lr in force at once
    # (the restored optimizer state does not bring the donor's lr back).
    exploits = []
    for run_dir in sorted(out.glob("trial*")):
        if (run_dir / "pbt.jsonl").exists():
            exploits += [(run_dir, json.loads(line)) for line in (run_dir / "pbt.jsonl").read_text().splitlines()
                         if json.loads(line)["restored_from"] != run_dir.name]
    assert exploits, "no trial restored another trial's checkpoint"
    trained_after = [(run_dir, event) for run_dir, event in exploits if event["env_steps"] < total]
    assert trained_after, exploits
    for run_dir, event in trained_after:
        assert event["env_steps"] >= interval, event  # restored at a segment's end, not from scratch
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        after = records[event["records_before"]]  # the restored run's first record
        assert after["iteration"] == event["iteration"] + 1 and after["env_steps"] > event["env_steps"], after
        # The lr anneals over the trial's whole budget (run.total_env_steps), not over a segment: what the next
        # update used is the perturbed value on that schedule.
        expected = linear_lr(event["values"]["learner.lr"], after["iteration"] - 1, cfg.total_updates)
        assert after["lr"] == pytest.approx(expected), (after["lr"], expected, event)
        assert lo <= event["values"]["learner.lr"] <= hi
    lines = proc.stdout.strip().splitlines()
    assert lines[-2].startswith("best: trial") and lines[-1].startswith("results: "), lines[-8:]
    print("\n".join(lines[-8:]))


@pytest.mark.parametrize("args, message", [
    (["--mutate", "learner.lr=1e-3"], "--mutate 'learner.lr=1e-3': expected KEY.PATH=LO:HI"),
    (["--mutate", "learner.lr=3e-3:1e-3"], "expected KEY.PATH=LO:HI with numbers LO < HI"),
    (["--mutate", "ppo.update_epochs=1:8"], "--mutate ppo.update_epochs: a int setting; allowed: float settings"),
    (["--mutate", "learner.lrr=1e-4:1e-3"], "learner.lrr: unknown key (did you mean 'learner.lr'?)"),
    (["--mutate", "ppo.clip_coef=0.1:50"], "--mutate 'ppo.clip_coef=0.1:50': ppo.clip_coef: 50.0 is out of range"),
    ([], "--scheduler pbt needs at least one --mutate"),
    (["--mutate", "learner.lr=1e-4:1e-3", "--population", "1"], "--population: 1; allowed: >= 2"),
])
def test_bad_pbt_input_is_one_line_and_exit_2(tmp_path, args, message):
    proc = sweep(tmp_path, "--scheduler", "pbt", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: ") and message in lines[0], lines


def test_a_trials_metrics_are_read_on_from_where_the_last_report_left_them(tmp_path):
    """PBT reports a trial's settings in force (its newest record) after every segment: each read takes only what
    the segment appended, not the whole file again; a compacted (replaced) file is read from its start once."""
    from cluster.metrics import JsonlWriter
    from cluster.tune import MetricsTail

    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.update().lines == 0 and tail.last is None  # no file yet
    writer = JsonlWriter(path)
    for segment in range(20):
        for i in range(50):
            writer.write({"iteration": 50 * segment + i + 1, "lr": 1e-3 / (segment + 1)})
        writer._f.flush()
        tail.update()
        assert tail.lines == 50 * (segment + 1)
        assert tail.last == {"iteration": 50 * segment + 50, "lr": 1e-3 / (segment + 1)}
    writer.close()
    first = path.stat().st_size
    assert tail.bytes_read == first  # every byte once: 20 reports, one file's worth
    JsonlWriter(path, max_bytes=first // 2).compact()  # replaced by a shorter file
    assert tail.update().lines == len(path.read_text().splitlines()) < 1000 and tail.last["iteration"] == 1000
    assert tail.bytes_read == first + path.stat().st_size  # the new file read once, from its start


def test_pbt_keeps_a_few_checkpoints_per_trial_and_enough_for_every_exploit():
    from cluster.tune import PBT_MIN_CHECKPOINTS_KEPT, pbt_checkpoints_kept

    assert PBT_MIN_CHECKPOINTS_KEPT > 2  # Ray: 2 or fewer can be deleted before an exploiting trial restores one
    assert pbt_checkpoints_kept(4, 4) == PBT_MIN_CHECKPOINTS_KEPT
    assert pbt_checkpoints_kept(16, 2) == 16 // 2 + 2  # a paused trial waits a round of the others' segments
