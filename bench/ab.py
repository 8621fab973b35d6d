"""Old code against new code in one run: the same config and seeds trained by a git ref's tree and by this one.

The ref is checked out into a temporary worktree. Each round trains every seed with one tree, then with the
other, in alternating order (old first in odd rounds), each in its own process on its own embedded Ray, so
neither side always runs first on a warm or a cold machine. Per seed: seconds and env steps to the config's
target (``run.target_return``, else ``run.target_success_rate``) and env steps/s in the training loop. Prints
both sides and new / old for each figure.

    .venv/bin/python bench/ab.py --ref HEAD~3 [--config configs/cartpole.yaml] [--seeds 0 1 2] [--rounds 2]
                                 [--set key=value ...]

Only the trees' ``bench/_train.py`` (``embedded_ray``, ``train``, ``first_at``) and ``cluster.config.load`` are
used, so any ref that has those can be compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ("seconds", "env_steps", "env_steps_per_s")


def worker(config: str, seeds: list[int], overrides: list[str], out: str) -> None:
    """Runs inside one tree (its root first on sys.path): train each seed, write the rows as JSON."""
    from bench._train import embedded_ray, first_at, train
    from cluster import config as config_mod

    base = ["run.progress_interval_s=1000", "run.require_target=false", *overrides]
    rows = []
    with embedded_ray(config_mod.load(config, base)), tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            cfg = config_mod.load(config, base + [f"run.seed={seed}"])
            trained = train(cfg, Path(tmp) / f"seed{seed}")
            run, records = cfg.run, trained.records
            if run.target_return is not None:
                hit = first_at(records, run.target_window, run.target_return)
            else:
                hit = first_at(records, run.target_window, run.target_success_rate, "episode_success_rate")
            last = hit or records[-1]
            rows.append({"seed": seed, "reached": hit is not None, "seconds": last["time_s"],
                         "env_steps": last["env_steps"],
                         "env_steps_per_s": last["env_steps"] / max(last["train_time_s"], 1e-9)})
    Path(out).write_text(json.dumps(rows))


def run_side(tree: Path, args, out: Path) -> list[dict]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--config", args.config, "--out", str(out),
           "--seeds", *map(str, args.seeds)] + [f"--set={o}" for o in args.overrides]
    env = dict(os.environ, PYTHONPATH=str(tree))  # Ray's workers import the tree's packages too
    subprocess.run(cmd, cwd=tree, env=env, check=True, timeout=3600)
    return json.loads(out.read_text())


def mean(xs) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def main() -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ref", help="the old code: any git ref of this repository")
    p.add_argument("--config", default="configs/cartpole.yaml")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        sys.path.insert(0, os.getcwd())
        worker(args.config, args.seeds, args.overrides, args.out)
        return 0
    if not args.ref:
        p.error("--ref is required")

    with tempfile.TemporaryDirectory(prefix="ab-") as tmp:
        old_tree = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(old_tree), args.ref],
                       check=True)
        try:
            sides: dict[str, list[dict]] = {"old": [], "new": []}
            for r in range(args.rounds):
                order = ("old", "new") if r % 2 == 0 else ("new", "old")
                for side in order:
                    tree = old_tree if side == "old" else ROOT
                    rows = run_side(tree, args, Path(tmp) / f"{side}{r}.json")
                    sides[side] += rows
                    for row in rows:
                        print(f"round {r} {side}: seed {row['seed']} {'reached' if row['reached'] else 'MISSED'} in "
                              f"{row['seconds']:.1f} s, {row['env_steps']:,} env steps, "
                              f"{row['env_steps_per_s']:,.0f} env steps/s", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old_tree)], check=False)

    print(f"\n{args.config}, seeds {args.seeds}, {args.rounds} rounds: old = {args.ref}, new = working tree")
    print(f"{'':<18}{'old':>12}{'new':>12}{'new / old':>12}")
    for fig in FIGURES:
        old, new = mean([r[fig] for r in sides["old"]]), mean([r[fig] for r in sides["new"]])
        print(f"{fig:<18}{old:>12,.1f}{new:>12,.1f}{new / old:>12.3f}")
    reached = {s: sum(r["reached"] for r in rows) for s, rows in sides.items()}
    print(f"reached the target: old {reached['old']}/{len(sides['old'])}, new {reached['new']}/{len(sides['new'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
