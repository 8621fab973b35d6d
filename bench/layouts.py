"""Uneven layouts on one embedded Ray: CartPole to 475 with actor, shard and learner counts that do not divide.

Before the ticket ledger (pipeline/supply.py), the first layout hung a learner forever and the third dropped a
third of its fragments as stale. Prints one table: actors, shards, learners, batch, lag, seconds of training to
the target, env steps to it, stale % (fragments made and never trained on / fragments made) and learner wait %
(median over the second half of the iterations of the time a learner waited for its batch / iteration time).

    .venv/bin/python bench/layouts.py [--seed 1] [--budget-s 300] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import ray  # noqa: E402

from cluster import config as config_mod  # noqa: E402
from cluster import placement  # noqa: E402
from cluster.driver import Trainer  # noqa: E402

# (actors, shards, learners, batch, lag): the three, then the first scaling step users take.
LAYOUTS = [(3, 3, 2, 6144, 1), (3, 2, 2, 2048, 1), (3, 1, 1, 4096, 0), (2, 1, 1, 1024, 0), (2, 2, 1, 1024, 1)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/cartpole.yaml")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--budget-s", type=float, default=300.0, help="training-time budget per layout")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args()
    # A 2M-step lr horizon: with the config's 500k, lr anneals to ~0 before a 6144-sample batch has had its updates.
    base = ["run.require_target=false", "run.checkpoint_interval_s=null", f"run.time_budget_s={args.budget_s}",
            "run.total_env_steps=2000000",
            f"run.seed={args.seed}", *args.overrides]
    # Logical CPUs for the largest layout (3 actors + 2 learners); the 2-core machine is oversubscribed anyway.
    placement.start_ray(config_mod.load(args.config, base + ["rollout.num_actors=3", "learner.num_learners=2",
                                                           "learner.batch_size=2048"]), None)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for actors, shards, learners, batch, lag in LAYOUTS:
                cfg = config_mod.load(args.config, base + [
                    f"rollout.num_actors={actors}", f"replay.num_shards={shards}", f"learner.num_learners={learners}",
                    f"learner.batch_size={batch}", f"replay.max_policy_lag={lag}"])
                run_dir = Path(tmp) / f"{actors}-{shards}-{learners}-{batch}-{lag}"
                trainer = Trainer(cfg, run_dir, quiet=True)
                try:
                    trainer.build()
                    result = trainer.run()
                finally:
                    trainer.shutdown()
                rec = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
                half = rec[len(rec) // 2:]
                last = rec[-1]
                rows.append({
                    "actors": actors, "shards": shards, "learners": learners, "batch": batch, "lag": lag,
                    "reached": result.reached_target, "seconds": last["train_time_s"],
                    "env_steps": result.env_steps, "stale_pct": 100 * last["stale_fraction"],
                    "produced": last["fragments_produced"], "dropped": last["fragments_dropped_stale"],
                    "wait_pct": 100 * float(np.median([r["host_bound_fraction"] for r in half])),
                })
                r = rows[-1]
                print(f"  {actors}/{shards}/{learners} batch {batch} lag {lag}: "
                      f"{'reached 475' if r['reached'] else 'MISSED (' + result.reason + ')'} "
                      f"in {r['seconds']:.1f} s", file=sys.stderr)
    finally:
        ray.shutdown()
    print(f"\nCartPole-v1 to a 100-episode mean of 475, seed {args.seed}, one embedded Ray "
          f"(training time; start-up excluded)")
    print(f"{'actors':>6} {'shards':>6} {'learners':>8} {'batch':>6} {'lag':>3} {'target':>7} {'seconds':>8} "
          f"{'env steps':>10} {'stale %':>8} {'learner wait %':>15}")
    for r in rows:
        print(f"{r['actors']:>6} {r['shards']:>6} {r['learners']:>8} {r['batch']:>6} {r['lag']:>3} "
              f"{'yes' if r['reached'] else 'NO':>7} {r['seconds']:>8.1f} {r['env_steps']:>10,} "
              f"{r['stale_pct']:>8.2f} {r['wait_pct']:>15.1f}")
    ok = all(r["reached"] and r["stale_pct"] <= 1.0 for r in rows)
    print("PASS: every layout reached the target with stale <= 1%" if ok else "FAIL")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
