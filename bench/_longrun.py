"""Shared set-up for the long benches (chaos, soak): one long CartPole run with a side thread."""

from __future__ import annotations

import threading
from pathlib import Path

import ray

from cluster import config as config_mod
from cluster import placement
from cluster.driver import Trainer

ROOT = Path(__file__).resolve().parent.parent


def long_run(minutes: float, run_dir: Path, side, extra: list[str] = ()) -> tuple:
    """Train for ``minutes`` (no stop on the target) while ``side(trainer, stop_event)`` runs on a thread."""
    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "rollout.num_actors=2", "rollout.envs_per_actor=8", "replay.num_shards=2", "run.target_return=null",
        "run.require_target=false", "run.total_env_steps=1000000000", f"run.time_budget_s={minutes * 60}",
        "run.checkpoint_interval_s=30", "run.progress_interval_s=30", *extra])
    placement.start_ray(cfg, None)
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
        ray.shutdown()
    return cfg, result
