"""Population-based training against the defaults on Acrobot, side by side in one run, per seed.

    python bench/pbt.py [--seeds 0 1] [--steps 200000] [--population 4]

For each seed: one run on the schema defaults (a config naming only ``env.id: Acrobot-v1``), and a PBT population
(``python -m cluster.tune --scheduler pbt``) over ``learner.lr`` and ``ppo.ent_coef`` whose trials each train the same
env steps. Everything runs in process (``ray.address: inprocess``, one learner per run), so the figures are the
algorithm's. Score: the 100-episode mean return at the end (Acrobot: -500 is never solved, CleanRL's PPO about -86).
The population uses ``--population`` times the env steps of the single run: the table says both.
"""

from __future__ import annotations

import csv
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import ROOT, cli, parser, table  # noqa: E402
from bench._train import train  # noqa: E402
from cluster import config as config_mod  # noqa: E402

MUTATE = ["learner.lr=5e-5:3e-3", "ppo.ent_coef=0:0.02"]


def make_parser():
    p = parser(__doc__, out="write the figures as JSON here")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=200_000, help="env steps per run, and per PBT trial")
    p.add_argument("--population", type=int, default=4)
    p.add_argument("--max-concurrent", type=int, default=2)
    return p


def run(args):
    rows, figures = [], []
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "acrobot.yaml"
        config.write_text("env:\n  id: Acrobot-v1\n")
        common = [f"run.total_env_steps={args.steps}", "run.target_return=null", "ray.address=inprocess",
                  "run.checkpoint_interval_s=null", "run.progress_interval_s=1000"]
        for seed in args.seeds:
            cfg = config_mod.load(str(config), common + [f"run.seed={seed}"])
            default = train(cfg, Path(tmp) / f"default-{seed}").records[-1]["episode_return_mean"]
            out = Path(tmp) / f"pbt-{seed}"
            cmd = [sys.executable, "-m", "cluster.tune", "--config", str(config), "--scheduler", "pbt",
                   "--population", str(args.population), "--max-concurrent", str(args.max_concurrent),
                   "--interval-steps", str(args.steps // 10), "--seeds", str(seed), "--out", str(out)]
            for m in MUTATE:
                cmd += ["--mutate", m]
            for s in common:
                cmd += ["--set", s]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
                return figures, False
            trials = list(csv.DictReader(open(out / "results.csv")))
            best = max(trials, key=lambda r: float(r["score"]))
            exploits = sum(int(r["exploits"]) for r in trials)
            rows.append([seed, default, float(best["score"]), best["settings"], exploits])
            figures.append({"seed": seed, "default": default, "pbt_best": float(best["score"]),
                            "pbt_best_settings": best["settings"], "exploits": exploits,
                            "trials": [{k: r[k] for k in ("trial", "settings", "score", "exploits")} for r in trials]})
    print(f"Acrobot-v1, {args.steps:,} env steps per run; PBT: {args.population} trials of that many "
          f"({args.population * args.steps:,} in all), explore/exploit every {args.steps // 10:,}")
    table([("seed", ">4"), ("defaults", ">9.1f"), ("PBT best", ">9.1f"), ("best's values at the end", "<40"),
           ("exploits", ">8")], rows)
    gains = [r[2] - r[1] for r in rows]
    print(f"PBT best - defaults: {min(gains):+.1f} to {max(gains):+.1f} over {len(rows)} seed(s)")
    return figures, None


if __name__ == "__main__":
    cli(make_parser, run)
