"""Training runs for the benches: the embedded Ray of a run, one ``Trainer`` per config, its metrics records."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import ray

from bench._common import ROOT
from cluster import config as config_mod
from cluster import placement
from cluster.driver import Trainer
from cluster.records import first_at  # noqa: F401  (the benches import it from here)


class Trained(NamedTuple):
    result: Any  # cluster.driver.RunResult
    records: list[dict]  # metrics.jsonl, one record per iteration
    build_s: float  # seconds from the clock's start to the actor graph built


@contextlib.contextmanager
def embedded_ray(cfg: config_mod.Config):
    """Ray started as a run starts it (sized for ``cfg``), once for every run in the block."""
    placement.start_ray(cfg, None)
    try:
        yield
    finally:
        ray.shutdown()


def read_records(run_dir: Path) -> list[dict]:
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def train(cfg: config_mod.Config, run_dir: Path, t_start: float | None = None, on_built=None) -> Trained:
    """Build and run a quiet ``Trainer`` into ``run_dir``, always shut down. Its clock (records' ``time_s``)
    starts at ``t_start``, by default now: right before the actor graph is built, so Ray's start-up is not in it.
    ``on_built(trainer)``: called once the graph is built (a bench that needs more of the run than its records)."""
    t0 = time.perf_counter() if t_start is None else t_start
    trainer = Trainer(cfg, run_dir, t_start=t0, quiet=True)
    try:
        trainer.build()
        if on_built is not None:
            on_built(trainer)
        build_s = time.perf_counter() - t0
        result = trainer.run()
    finally:
        trainer.shutdown()
    return Trained(result, read_records(run_dir), build_s)


def steady_state(records: list[dict], key: str) -> float:
    """Median over the second half of the run (start-up excluded)."""
    vals = [r[key] for r in records[len(records) // 2:] if r.get(key) is not None]
    return float(np.median(vals)) if vals else float("nan")


def long_run(minutes: float, run_dir: Path, side, extra: list[str] = ()) -> tuple:
    """One long CartPole run (chaos, soak): train for ``minutes`` (no stop on the target) with progress printed,
    while ``side(trainer, stop_event)`` runs on a thread. Returns (config, RunResult)."""
    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "rollout.num_actors=2", "rollout.envs_per_actor=8", "replay.num_shards=2", "run.target_return=null",
        "run.require_target=false", "run.total_env_steps=1000000000", f"run.time_budget_s={minutes * 60}",
        "run.checkpoint_interval_s=30", "run.progress_interval_s=30", *extra])
    with embedded_ray(cfg):
        trainer = Trainer(cfg, run_dir, quiet=False)
        stop = threading.Event()
        try:
            trainer.build()
            t = threading.Thread(target=side, args=(trainer, stop), daemon=True)
            t.start()
            result = trainer.run()
            stop.set()
            t.join(timeout=60)
        finally:
            stop.set()
            trainer.shutdown()
    return cfg, result
