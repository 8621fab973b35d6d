"""Training runs for the benches: the embedded Ray of a run, one ``Trainer`` per config, its metrics records."""

from __future__ import annotations

import contextlib
import json
import tempfile
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


def train_all(runs, ray_cfg: config_mod.Config | None = None):
    """Train each (name, config) of ``runs`` in turn, in one temporary directory, on one embedded Ray sized for
    ``ray_cfg`` (default: the first config; none where the configs say ``ray.address: inprocess``), started once
    so that its start-up is in no run's figures. Yields (name, config, Trained) as each finishes."""
    runs = list(runs)
    cfg0 = ray_cfg or runs[0][1]
    ray_ctx = contextlib.nullcontext() if cfg0.ray.address == "inprocess" else embedded_ray(cfg0)
    with ray_ctx, tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        for name, cfg in runs:
            yield name, cfg, train(cfg, Path(tmp) / str(name).replace(" ", "_").replace("/", "-"))


def target_key(cfg: config_mod.Config) -> tuple[str, float | None]:
    """(record key, target) of the config's target: ``run.target_return``, else ``run.target_success_rate``."""
    if cfg.run.target_return is not None or cfg.run.target_success_rate is None:
        return "episode_return_mean", cfg.run.target_return
    return "episode_success_rate", cfg.run.target_success_rate


def at_target(cfg: config_mod.Config, records: list[dict], key: str | None = None) -> dict:
    """A run's figures where its target was first met (else at its last record): reached, seconds (from the graph
    build; train_seconds: in the training loop), env steps, env steps/s in the training loop, and the target's
    metric (``key``: the config's)."""
    metric, target = target_key(cfg)
    key = key or metric
    hit = first_at(records, cfg.run.target_window, target, key) if records else None
    at = hit or (records[-1] if records else {})
    return {"reached": hit is not None, "seconds": at.get("time_s"), "train_seconds": at.get("train_time_s"),
            "env_steps": at.get("env_steps"),
            "env_steps_per_s": at["env_steps"] / max(at["train_time_s"], 1e-9) if at else None, key: at.get(key)}


def steady_state(records: list[dict], key: str) -> float:
    """Median over the second half of the run (start-up excluded)."""
    vals = [r[key] for r in records[len(records) // 2:] if r.get(key) is not None]
    return float(np.median(vals)) if vals else float("nan")


def long_run(minutes: float, run_dir: Path, side, extra: list[str] = (), trainer_cls=Trainer,
             after_shutdown=None) -> tuple:
    """One long CartPole run (chaos, soak): ``trainer_cls`` trains for ``minutes`` (no stop on the target) on a
    thread, progress printed, while ``side(trainer, stop_event)`` runs on this one (chaos' node changes start Ray
    processes, which only the main thread may); the event is set when the run ends. On an embedded Ray, or on the
    Ray this process already has (chaos --nodes: a cluster_utils cluster). ``after_shutdown()``: called after the
    trainer's shutdown, before Ray's. Returns (config, RunResult)."""
    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "rollout.num_actors=2", "rollout.envs_per_actor=8", "replay.num_shards=2", "run.target_return=null",
        "run.require_target=false", "run.total_env_steps=1000000000", f"run.time_budget_s={minutes * 60}",
        "run.checkpoint_interval_s=30", "run.progress_interval_s=30", *extra])
    with contextlib.nullcontext() if ray.is_initialized() else embedded_ray(cfg):
        trainer = trainer_cls(cfg, run_dir, quiet=False)
        stop, outcome = threading.Event(), []

        def drive():
            try:
                outcome.append(trainer.run())
            except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
                outcome.append(e)
            finally:
                stop.set()

        try:
            trainer.build()
            driver = threading.Thread(target=drive, name="driver", daemon=True)
            driver.start()
            side(trainer, stop)
            driver.join()
        finally:
            stop.set()
            trainer.shutdown()
            if after_shutdown is not None:
                after_shutdown()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return cfg, outcome[0]
