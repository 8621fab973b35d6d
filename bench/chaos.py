"""Chaos bench: SIGKILL a random rollout actor or replay shard every 30 s for 10 minutes of CartPole.

The run must finish by itself, reach a 100-episode mean of 475 (it is not
stopped there: it trains for the whole time budget), and its metrics must count
every kill (``rollout_restarts`` + ``shard_restarts``) and what was lost
(``fragments_lost``).

    .venv/bin/python bench/chaos.py [--minutes 10] [--every 30] [--seed 0]
"""

from __future__ import annotations

import os
import random
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import actor_pids, parser, run_main  # noqa: E402
from bench._train import first_at, long_run, read_records  # noqa: E402


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--every", type=float, default=30.0, help="seconds between kills")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=475.0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    kills: list[tuple[str, int]] = []

    def killer(trainer, stop):
        while not stop.wait(args.every):
            role = rng.choice(["rollouts", "shards"])
            index = rng.randrange(len(getattr(trainer, role)))
            try:
                (pid,) = actor_pids([getattr(trainer, role)[index]], timeout=10)
                os.kill(pid, signal.SIGKILL)
                kills.append((role, index))
                print(f"\nchaos: killed {role[:-1]} {index} (pid {pid})", file=sys.stderr, flush=True)
            except Exception as e:  # the target may be restarting right now: skip this round
                print(f"\nchaos: could not kill {role[:-1]} {index}: {e}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "chaos"
        _, result = long_run(args.minutes, run_dir, killer)
        records = read_records(run_dir)
    last = records[-1]
    best = max((r["episode_return_mean"] for r in records if r["episodes_in_window"] >= 100
                and r["episode_return_mean"] is not None), default=float("nan"))
    first_hit = first_at(records, 100, args.target)
    n_rollout = sum(1 for role, _ in kills if role == "rollouts")
    n_shard = len(kills) - n_rollout
    counted = (last["rollout_restarts"], last["shard_restarts"])
    print(f"chaos: {len(kills)} kills in {args.minutes:g} min ({n_rollout} rollout actors, {n_shard} replay shards); "
          f"metrics count {counted[0]} rollout restarts and {counted[1]} shard restarts; "
          f"{last['fragments_lost']} fragments lost; {last['fragments_dropped_stale']} dropped as stale")
    print(f"chaos: run ended '{result.reason}' after {result.env_steps:,} env steps; best 100-episode mean {best:.1f}"
          + (f"; {args.target:g} first reached at {first_hit['env_steps']:,} env steps ({first_hit['train_time_s']:.0f} s)"
             if first_hit else f"; {args.target:g} NOT reached"))
    ok = result.reason == "time_budget" and first_hit is not None and counted == (n_rollout, n_shard)
    print("chaos: PASS" if ok else "chaos: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    run_main(main)
