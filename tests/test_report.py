"""End-of-run report (cluster.report) and the TensorBoard sink (cluster.metrics.TensorBoardWriter).

The synthetic run has 30 iterations whose values are simple functions of the iteration
number, so the expected medians can be worked out by hand: the "second half" is
iterations 16..30 (15 records; the median is the value at iteration 23).
"""

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import report
from cluster.metrics import JsonlWriter

ROOT = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
N = 30


def make_records(n: int = N) -> list[dict]:
    """Records shaped like the driver's (every key it writes), with a few NaNs."""
    nan = float("nan")
    records = []
    for i in range(1, n + 1):
        if i <= 2:
            ret = nan  # no finished episode yet
        elif i == 3:
            ret = 999.0  # a high mean over a partial window: must not count as "best"
        elif i <= 25:
            ret = 10.0 * i  # best full-window value: 250.0 at iteration 25
        else:
            ret = 250.0 - 5.0 * (i - 25)  # final: 225.0
        wait = 0.001 * i
        update = 0.030 + 0.001 * i
        r = {
            "iteration": i,
            "time_s": 3.0 + 0.5 * i,
            "train_time_s": 0.5 * i,
            "env_steps": 2048 * i,
            "env_steps_per_s": 4000.0 + 10.0 * i,
            "learner_samples": 1024 * i,
            "learner_samples_per_s": 2000.0 + 10.0 * i,
            "policy_version": i,
            "episodes": 15 * i,
            "episodes_in_window": min(100, 15 * i),
            "episode_return_mean": ret,
            "host_bound_fraction": nan if i == 18 else 0.01 * i,
            "learner_wait_s": wait,
            "learner_update_s": nan if i == 20 else update,
            "learner_iter_s": wait + update + 0.002,
            "feed_pull_s": 0.004 + 0.0001 * i,
            "feed_collate_s": 0.0005,
            "h2d_ms": 0.0,
            "h2d_bytes": 0,
            "host_syncs": 2 * i,  # cumulative
            "allreduce_calls": 0,
            "policy_lag_mean": 1.0 if i % 2 == 0 else 0.5,
            "policy_lag_max": 3 if i == 12 else 1,
            "fragments_dropped_stale": i // 10,  # cumulative
            "replay_depth": i % 3,
            "replay_added": 2 * i + 1,
            "device_idle_fraction": 0.5,
            "rollout_actors": 2,
            "rollout_restarts": 1 if i >= 10 else 0,
            "shard_restarts": 0,
            "fragments_lost": 2 if i >= 10 else 0,
            "rollout_backpressure_s": 0.001 * i,
            "rollout_rate_limited_s": 0.01 * i,
            "policy_loss": -0.01,
            "value_loss": 5.0 / i,
            "entropy": 0.69 - 0.01 * i,
            "approx_kl": nan if i == 7 else 0.004,
            "clip_fraction": 0.05,
            "explained_variance": 0.03 * i,
            "grad_norm": 1.5,
            "lr": 1e-3 * (1 - i / 100),
        }
        if i == 1:
            r["compile"] = "eager (compile off)"
        if i == 5:
            r["profile_trace"] = "/tmp/run/profile/trace.json"
        records.append(r)
    return records


def write_jsonl(path: Path, records) -> None:
    w = JsonlWriter(path)
    for r in records:
        w.write(r)
    w.close()


def row(table: str, label: str) -> str:
    for line in table.splitlines():
        if line.startswith("  " + label + "  "):
            return " ".join(line[len(label) + 2:].split())
    raise AssertionError(f"no row {label!r} in\n{table}")


# ---------------------------------------------------------------------- summary table
def test_summary_values_by_hand():
    table = report.summary_table(make_records(), {"reason": "total_env_steps", "wall_s": 20.0, "run_dir": "runs/x"})
    assert table.splitlines()[0] == "Run summary: runs/x"
    assert "stop reason: total_env_steps" in table
    assert row(table, "wall time, from start") == "20.0 s"  # the caller's value wins over time_s
    assert row(table, "training loop") == "15.0 s"
    assert row(table, "start-up (to first iteration)") == "3.0 s"
    assert row(table, "env steps") == "61,440"
    assert row(table, "iterations") == "30"
    assert "return, mean of last 100 episodes" in table
    assert row(table, "final") == "225.0"
    # 999 at iteration 3 had 45 episodes in its window: only full windows count.
    assert row(table, "best") == "250.0 iteration 25, 51,200 env steps"
    # 61,440 steps / 15 s of training loop; / 20 s from start.
    assert row(table, "env steps/s, overall") == "4,096 /s training loop; 3,072/s from start"
    # medians over iterations 16..30 -> the value at 23
    assert row(table, "env steps/s, median 2nd half") == "4,230 /s"
    assert row(table, "learner samples/s, median 2nd half") == "2,230 /s"
    # iteration 18 is NaN: 14 values, median (23 + 24) / 2
    assert row(table, "host-bound fraction, median 2nd half").startswith("23.5 %")
    assert row(table, "policy lag, mean / max") == "0.75 / 3 versions"
    assert row(table, "fragments dropped as stale") == "3"
    assert row(table, "host syncs per iteration") == "2.00"  # cumulative 60 / 30
    assert "learner iteration, median of 2nd half (iterations 16-30)" in table
    assert row(table, "wait for batch (host-bound)").startswith("23.00 ms")
    # update NaN at 20: median (53 + 54) / 2 ms; "other" NaN there too: 2 ms everywhere else.
    assert row(table, "update").startswith("53.50 ms")
    assert row(table, "other (publish, call overhead)").startswith("2.00 ms")
    assert row(table, "total") == "78.00 ms"  # 0.032 + 0.002 * 23
    assert row(table, "update") == "53.50 ms 68.6 % of iteration"
    assert row(table, "pull from shards") == "6.30 ms"
    assert row(table, "collate") == "0.50 ms"
    assert row(table, "host-to-device copy") == "0.00 ms"
    # fault-tolerance / device keys get rows when the driver writes them
    assert row(table, "device idle fraction, median 2nd half").startswith("50.0 %")
    assert row(table, "rollout / shard restarts") == "1 / 0"
    assert row(table, "fragments lost").startswith("2 ")


def test_summary_columns_are_aligned():
    table = report.summary_table(make_records())
    data = [ln for ln in table.splitlines() if ln.startswith("  ")]
    assert len(data) >= 20
    end = data[[i for i, ln in enumerate(data) if "env steps  " in ln and "/s" not in ln][0]].index("61,440") + 6
    for ln in data:
        assert ln[end - 1] != " " and ln[end:end + 1] in ("", " "), f"value column not aligned: {ln!r}"
    rules = [ln for ln in table.splitlines() if set(ln) == {"="}]
    assert len(rules) == 2 and all(len(r) >= max(len(ln) for ln in data) for r in rules)
    # without result fields the wall time is the last record's time_s
    assert row(table, "wall time, from start") == "18.0 s to the last record"


def test_summary_from_jsonl_with_nulls(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_jsonl(path, make_records())
    assert "null" in path.read_text()  # NaN went to JSON as null
    records = report.load_records(tmp_path)  # the run dir works too
    assert len(records) == N
    assert records[17]["host_bound_fraction"] is None
    table = report.summary_table(records)
    assert row(table, "host-bound fraction, median 2nd half").startswith("23.5 %")
    assert row(table, "update").startswith("53.50 ms")
    assert row(table, "final") == "225.0"


def test_load_records_last_run_and_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_jsonl(path, make_records())
    write_jsonl(path, make_records(3))  # the driver appends: a second run in a reused dir
    with open(path, "a") as f:
        f.write('{"iteration": 4, "time_s": 5.')  # killed mid-write
    with pytest.warns(UserWarning, match="skipped 1 line"):
        last = report.load_records(path)
    assert [r["iteration"] for r in last] == [1, 2, 3]
    with pytest.warns(UserWarning):
        assert len(report.load_records(path, last_run=False)) == N + 3


def test_load_records_resumed_run(tmp_path):
    """A run resumed from a checkpoint at iteration 20: what was logged after it is replaced."""
    path = tmp_path / "metrics.jsonl"
    write_jsonl(path, make_records())
    resumed = [dict(r, time_s=r["time_s"] - 10.0, host_syncs=r["host_syncs"] - 40, episode_return_mean=300.0)
               for r in make_records()[20:25]]  # iterations 21-25; new process: time_s and host_syncs restart
    write_jsonl(path, resumed)
    records = report.load_records(path)
    assert [r["iteration"] for r in records] == list(range(1, 26))
    assert records[-1]["episode_return_mean"] == 300.0
    table = report.summary_table(records)
    assert row(table, "final") == "300.0"
    assert row(table, "host syncs per iteration") == "2.00"  # the counter restart is not a negative rate
    assert "2 sessions (resumed)" in row(table, "wall time, from start")
    assert row(table, "start-up (to first iteration)") == "n/a s"


def test_summary_empty_and_all_missing():
    table = report.summary_table([])
    assert "(no metric records)" in table
    assert row(table, "iterations") == "0"
    assert row(table, "env steps") == "n/a"
    assert row(table, "update") == "n/a ms"
    assert row(table, "policy lag, mean / max") == "n/a / n/a versions"

    # records with every value missing (None from JSONL, NaN in memory, or absent)
    blank = [{"iteration": i, "env_steps": None, "episode_return_mean": float("nan")} for i in (1, 2, 3)]
    table = report.summary_table(blank, {"reason": "interrupted"})
    assert row(table, "iterations") == "3"
    assert row(table, "final") == "n/a"
    assert row(table, "best") == "n/a"
    assert row(table, "env steps/s, overall") == "n/a /s"
    assert row(table, "host-bound fraction, median 2nd half").startswith("n/a %")
    assert "nan" not in table.lower().replace("n/a", "")
    assert "restarts" not in table and "device idle" not in table  # keys these records do not have


def test_the_report_streams_its_file_in_bounded_memory(tmp_path, monkeypatch):
    """write_report reads metrics.jsonl a record at a time and keeps what the table and plot show: four times the
    records take no more memory. The caps on what it keeps (lowered here so that a short file passes them) make the
    medians a sample's, still within a fraction of a percent, and the curve a sample's."""
    import tracemalloc

    monkeypatch.setattr(report, "MAX_MEDIAN_SAMPLES", 250)
    monkeypatch.setattr(report, "MAX_PLOT_POINTS", 250)
    peaks = {}
    for n in (1_000, 4_000):
        run_dir = tmp_path / str(n)
        run_dir.mkdir()
        write_jsonl(run_dir / "metrics.jsonl", make_records(n))
        tracemalloc.start()
        table, _ = report.write_report(run_dir, plot=False)
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert row(table, "iterations") == f"{n:,}"
        # env_steps_per_s is 4000 + 10 i: over the second half (i = n/2+1 .. n) its median is 4000 + 7.5 n + 5.
        median = float(row(table, "env steps/s, median 2nd half").split()[0].replace(",", ""))
        assert median == pytest.approx(4000 + 7.5 * n + 5, rel=2e-3)
    assert peaks[4_000] < 1.3 * peaks[1_000], peaks
    _, png = report.write_report(tmp_path / "4000")
    assert png.read_bytes()[:8] == PNG_SIGNATURE


# ---------------------------------------------------------------------- plot
def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_run_writes_png_without_a_window(tmp_path):
    """In a fresh interpreter whose default backend is interactive and with no display:
    plot_run must still work, and neither pyplot nor a GUI toolkit may be imported."""
    src = tmp_path / "metrics.jsonl"
    write_jsonl(src, make_records())
    png = tmp_path / "out" / "report.png"
    code = (
        "import sys; from cluster import report\n"
        f"recs = report.load_records({str(src)!r})\n"
        f"p = report.plot_run(recs, {str(png)!r}, title='synthetic', target_return=240.0)\n"
        "bad = [m for m in ('matplotlib.pyplot', 'tkinter', 'PyQt5', 'PyQt6', 'PySide6', 'gi') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print(p)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    env["MPLBACKEND"] = "TkAgg"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(png)
    w, h = _png_size(png)
    assert png.stat().st_size > 10_000
    assert w > h > 300


def test_plot_run_edge_cases(tmp_path):
    # no records, a single record, and a long run (binned bars) all give a valid PNG
    for name, recs in (("empty", []), ("one", make_records(1)), ("long", make_records(260))):
        p = report.plot_run(recs, tmp_path / f"{name}.png")
        assert p.read_bytes()[:8] == PNG_SIGNATURE and p.stat().st_size > 10_000, name


# ---------------------------------------------------------------------- TensorBoard
@pytest.mark.parametrize("path", ["one_event_per_record", "add_scalar_fallback"])
def test_tensorboard_writer_scalars_match_record_keys(tmp_path, path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from cluster.metrics import TensorBoardWriter

    records = make_records()
    records[0]["a_flag"] = True  # bools, dicts and None are not scalars
    records[0]["nested"] = {"x": 1}
    records[1]["missing"] = None
    tb = TensorBoardWriter(tmp_path / "tb")
    if path == "add_scalar_fallback":
        tb._file_writer = None
    for r in records:
        tb.write(r)
    tb.close()
    tb.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        tb.write(records[0])
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))

    ea = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    numeric = {k for k, v in records[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert tags == numeric  # exactly the JSONL key names, nothing renamed or prefixed
    assert not tags & {"compile", "profile_trace", "a_flag", "nested", "missing"}

    steps = [r["env_steps"] for r in records]
    for key in ("env_steps_per_s", "learner_wait_s", "host_syncs", "episodes_in_window"):
        ev = ea.Scalars(key)
        assert [e.step for e in ev] == steps
        assert [e.value for e in ev] == pytest.approx([r[key] for r in records], rel=1e-6)
    # NaN values are skipped, not written: iterations 1-2 have no return, 7 no approx_kl, 20 no update time
    assert [e.step for e in ea.Scalars("episode_return_mean")] == steps[2:]
    assert len(ea.Scalars("approx_kl")) == N - 1
    assert 20 * 2048 not in [e.step for e in ea.Scalars("learner_update_s")]


def test_tensorboard_missing_gives_install_hint(monkeypatch, tmp_path):
    from cluster.metrics import TensorBoardWriter

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install tensorboard"):
        TensorBoardWriter(tmp_path / "tb")


def test_imports_stay_light():
    code = ("import sys, cluster.metrics, cluster.report\n"
            "heavy = [m for m in ('torch', 'tensorboard', 'matplotlib') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_write_report_with_run_result_fields(tmp_path):
    """What the driver calls at the end of a run: dataclasses.asdict(RunResult) as result fields."""
    write_jsonl(tmp_path / "metrics.jsonl", make_records())
    fields = {"reason": "target_reached", "reached_target": True, "env_steps": 61440, "iterations": 30,
              "wall_s": 21.25, "episode_return_mean": 225.0, "run_dir": tmp_path,
              "checkpoint_path": tmp_path / "checkpoints" / "final.pt"}
    table, png = report.write_report(tmp_path, fields, window=100, target_return=200.0, plot=False)
    assert png is None and not (tmp_path / "report.png").exists()
    assert (tmp_path / "summary.txt").read_text() == table + "\n"
    assert "stop reason: target_reached" in table
    assert row(table, "wall time, from start") == "21.2 s"
    assert row(table, "checkpoint") == str(tmp_path / "checkpoints" / "final.pt")


def test_write_report_survives_a_failing_plot(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "metrics.jsonl", make_records(4))

    def broken(*a, **k):
        raise ValueError("boom")

    monkeypatch.setattr(report, "plot_run", broken)
    with pytest.warns(UserWarning, match="no report.png: ValueError: boom"):
        table, png = report.write_report(tmp_path)
    assert png is None and row(table, "iterations") == "4"


# ---------------------------------------------------------------------- CLI
def test_cli_on_a_run_dir(tmp_path):
    run_dir = tmp_path / "CartPole-v1-test"
    run_dir.mkdir()
    write_jsonl(run_dir / "metrics.jsonl", make_records())
    (run_dir / "config.yaml").write_text("env:\n  id: CartPole-v1\nrun:\n  target_return: 240.0\n  target_window: 100\n")
    proc = subprocess.run([sys.executable, "-m", "cluster.report", str(run_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith(f"Run summary: {run_dir}")
    assert row(out, "env steps/s, median 2nd half") == "4,230 /s"
    assert f"plot written:    {run_dir / 'report.png'}" in out
    assert (run_dir / "summary.txt").read_text().startswith("Run summary")
    assert _png_size(run_dir / "report.png")[0] > 1000 and (run_dir / "report.png").stat().st_size > 10_000

    proc = subprocess.run([sys.executable, "-m", "cluster.report", str(tmp_path / "nope")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no metrics.jsonl" in proc.stderr


def test_progress_line_shows_the_success_rate_for_sparse_reward_runs():
    import io

    from cluster.metrics import ProgressLine

    record = {"time_s": 12.0, "env_steps": 4096, "env_steps_per_s": 2000.0, "episode_return_mean": 0.62,
              "episode_success_rate": 0.75, "episodes_in_window": 200, "learner_samples_per_s": 2000.0,
              "host_bound_fraction": 0.01, "policy_lag_mean": 1.0, "policy_lag_max": 1, "policy_version": 4}
    for show, expected in ((True, "success 0.75"), (False, None)):
        out = io.StringIO()
        ProgressLine(1.0, 100_000, stream=out, show_success=show).update(record, force=True)
        line = out.getvalue()
        assert "return    0.6" in line
        assert (expected in line) if expected else ("success" not in line)
