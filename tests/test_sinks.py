"""Tracking sinks: JSONL, TensorBoard, W&B (offline) and MLflow (file store) get the same metric names."""

from __future__ import annotations

import json
import math
import struct

import pytest

from cluster import config as config_mod
from cluster.checkpoint import RunFiles
from tests.conftest import ROOT, train_to_end


def wandb_history(path) -> tuple[set[str], list[int], list[float]]:
    """Metric names, steps and env_steps values of an offline run's ``run-*.wandb`` file.

    wandb 0.31 writes offline runs from its Go core and has no Python reader, so this reads the file format: a
    7-byte header (":W&B", magic, version), then LevelDB-style 32 KiB blocks of chunks (crc32, length, type;
    1 = whole record, 2/3/4 = first/middle/last part), each record a ``wandb_internal_pb2.Record``.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, buf, names, steps, env_steps = 7, 32768, b"", set(), [], []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):  # block trailer / padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.HasField("history"):
                items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
                names |= {k for k in items if not k.startswith("_")}
                steps.append(record.history.step.num)
                env_steps.append(json.loads(items["env_steps"]))
    return names, steps, env_steps


def test_every_sink_gets_the_same_metric_names(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # In process: the sinks are the driver's, fed the same records in either mode; no actor graph to start on Ray.
    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "run.loggers=[jsonl, tensorboard, wandb, mlflow]", "run.total_env_steps=8192", "run.require_target=false",
        "run.target_return=null", "ray.address=inprocess"])
    train_to_end(cfg, tmp_path)

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    numeric = {k for r in records for k, v in r.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    assert {"env_steps", "host_bound_fraction", "policy_loss", "approx_kl"} <= numeric

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == numeric

    (offline,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    logged, steps, env_steps = wandb_history(offline)
    assert logged == numeric, (logged ^ numeric)
    # One row per record, numbered by iteration (W&B merges rows with a repeated step, and env_steps can repeat).
    assert steps == [r["iteration"] for r in records]
    assert env_steps == [r["env_steps"] for r in records]

    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "ascent-rl"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert set(run.data.metrics) == numeric, (set(run.data.metrics) ^ numeric)
    history = client.get_metric_history(run.info.run_id, "env_steps")
    assert [m.step for m in history] == [r["env_steps"] for r in records]
    assert run.data.params["learner.lr"] == str(cfg.learner.lr)


def test_loggers_are_checked_when_the_config_loads():
    with pytest.raises(config_mod.ConfigError, match=r"run.loggers: 'neptune' is not allowed; allowed: jsonl"):
        config_mod.load(str(ROOT / "configs/cartpole.yaml"), ["run.loggers=[jsonl, neptune]"])
    with pytest.raises(config_mod.ConfigError, match=r"run.loggers: \['tensorboard'\] lacks jsonl"):
        config_mod.load(str(ROOT / "configs/cartpole.yaml"), ["run.loggers=[tensorboard]"])


def driver_record(i: int) -> dict:
    """A record shaped like the driver's (iteration first, then the figures), small enough that thousands fit."""
    return {"iteration": i, "time_s": 0.05 * i, "env_steps": 1024 * i, "episodes_in_window": 100,
            "episode_return_mean": min(500.0, 2.0 * i), "learner_wait_s": 0.001, "learner_update_s": 0.03,
            "learner_iter_s": 0.032, "host_bound_fraction": 0.03, "approx_kl": float("nan")}


def test_metrics_jsonl_stays_within_its_bound_with_the_recent_records_whole_and_the_rest_even(tmp_path, monkeypatch):
    """6,000 records into a 64 kB bound (the driver's path: make_sinks): the file never passes it; the newest
    records are all there; the older ones are every stride-th iteration from the start of the run; the report still
    reads it (iterations, final return)."""
    from cluster import metrics
    from cluster.report import write_report

    bound = 64_000
    monkeypatch.setattr(metrics, "METRICS_MAX_BYTES", bound)
    (jsonl,) = metrics.make_sinks(["jsonl"], RunFiles(tmp_path), {})
    path = tmp_path / "metrics.jsonl"
    for i in range(1, 6_001):
        jsonl.write(driver_record(i))
        assert path.stat().st_size <= bound, i
    jsonl.close()
    assert jsonl.compactions >= 10
    its = [json.loads(line)["iteration"] for line in path.read_text().splitlines()]
    assert its == sorted(its) and its[-1] == 6_000
    # The newest quarter of the bound whole (a record is ~250 bytes): the last few hundred iterations, every one.
    newest = bound // 4 // 300
    assert its[-newest:] == list(range(6_001 - newest, 6_001))
    # Before them, an even sample: one power-of-two stride from the run's start, with room for the recent part.
    older = [it for it in its if it < its[-newest]]
    stride = older[1] - older[0]
    assert stride & (stride - 1) == 0 and older[0] == stride, older[:5]
    head = [it for it in older if it < older[-1] - 4 * stride]
    assert all(b - a == stride for a, b in zip(head, head[1:]))
    assert len(older) >= bound // 4 // 300 // 2
    table, _ = write_report(tmp_path, plot=False)
    rows = {ln[2:].split("  ")[0]: ln.split() for ln in table.splitlines() if ln.startswith("  ")}
    assert rows["iterations"][-1] == "6,000" and rows["final"][-1] == "500.0" and rows["env steps"][-1] == "6,144,000"


def test_tensorboard_holds_the_same_records_as_the_compacted_metrics_jsonl(tmp_path, monkeypatch):
    """With metrics.jsonl compacted, the TensorBoard events are rebuilt from it: one event file, the same records
    (steps), within about the same size, however many records the run wrote."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from cluster import metrics

    bound = 64_000
    monkeypatch.setattr(metrics, "METRICS_MAX_BYTES", bound)
    sinks = metrics.make_sinks(["tensorboard", "jsonl"], RunFiles(tmp_path), {})  # jsonl goes first whatever the order
    for i in range(1, 3_001):
        for sink in sinks:
            sink.write(driver_record(i))
    for sink in sinks:
        sink.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) < 1_500
    (events,) = tmp_path.glob("events.out.tfevents.*")
    assert events.stat().st_size <= 2 * bound
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("env_steps")] == [r["env_steps"] for r in records]
    assert [e.value for e in acc.Scalars("iteration")] == [r["iteration"] for r in records]
    assert "approx_kl" not in acc.Tags()["scalars"]  # null in JSONL, never a scalar
