"""CartPole benchmark: seeds 0, 1, 2 of the default config on one embedded Ray.

Prints per seed: seconds and env steps to a 100-episode mean return of 475,
env steps/s, learner samples/s and the host-bound fraction (time the learners
waited for data / iteration time), then whether every seed made it within the
env-step budget. Ray starts once; each seed's clock starts when its actor
graph is being built, so the figures exclude Ray's own start-up.

    .venv/bin/python bench/cartpole.py [--seeds 0 1 2] [--max-steps 300000] [--set key=value ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench._common import cli, parser  # noqa: E402
from bench._train import at_target, steady_state, train_all  # noqa: E402
from cluster import config as config_mod  # noqa: E402


def make_parser():
    p = parser(__doc__, config="configs/cartpole.yaml", overrides=True, out="write per-seed results as JSON here",
               seeds=[0, 1, 2])
    p.add_argument("--max-steps", type=int, default=300_000, help="env steps within which 475 must be reached")
    return p


def run(args) -> tuple[list, bool]:
    # The config's own total_env_steps (and so its lr schedule) is kept: a seed counts as a miss if it
    # needs more than --max-steps, not because the run was cut short with a different schedule.
    base = ["run.progress_interval_s=5", "run.require_target=false"] + args.overrides
    rows = []
    for seed, cfg, (result, records, _) in train_all(
            (seed, config_mod.load(args.config, base + [f"run.seed={seed}"])) for seed in args.seeds):
        row = {"seed": seed, **at_target(cfg, records)}
        row.update(reached=result.reached_target and row["env_steps"] <= args.max_steps,
                   learner_samples_per_s=steady_state(records, "learner_samples_per_s"),
                   host_bound_fraction=steady_state(records, "host_bound_fraction"),
                   return_mean=result.episode_return_mean, dropped_stale=records[-1]["fragments_dropped_stale"])
        rows.append(row)
        print(f"seed {seed}: {'reached 475' if row['reached'] else 'MISSED 475'} in {row['seconds']:.1f} s, "
              f"{row['env_steps']:,} env steps | {row['env_steps_per_s']:,.0f} env steps/s | learner "
              f"{row['learner_samples_per_s']:,.0f} samples/s | host-bound {100 * row['host_bound_fraction']:.1f}% "
              f"| final mean {row['return_mean']:.1f} | stale drops {row['dropped_stale']}", flush=True)
    print(f"summary: {sum(r['reached'] for r in rows)}/{len(rows)} seeds reached 475 within {args.max_steps:,} env steps;"
          f" mean {np.mean([r['seconds'] for r in rows]):.1f} s, mean {np.mean([r['env_steps'] for r in rows]):,.0f} steps")
    return rows, all(r["reached"] for r in rows)


if __name__ == "__main__":
    cli(make_parser, run)
