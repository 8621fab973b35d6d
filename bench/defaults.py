"""The schema defaults on a new env, old against new, side by side in one run: only ``env.id`` set.

    python bench/defaults.py [--envs Acrobot-v1 MountainCar-v0] [--seeds 0 1] [--steps 500000]

Each env x seed trains in process (``ray.address: inprocess``, one learner) on the schema defaults before
2026-12-02 (pinned: ``OLD``) and on the schema as it is, and on any ``--side`` to try, back to back. Score: the
100-episode mean return at the end. (One seed run twice on the same settings differed by up to 5 on Acrobot: the
rollout and learner threads interleave differently.)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench._common import cli, parser, table  # noqa: E402
from bench._train import train_all  # noqa: E402
from cluster import config as config_mod  # noqa: E402

# The schema defaults before 2026-12-02, pinned (the discrete ones for every env: env-class defaults came on
# 2026-12-03), against the schema as it is ("new": continuous defaults for a Box action space, env.defaults).
OLD = ["learner.lr=0.00025", "env.defaults=discrete"]


def parse_side(text: str) -> tuple[str, list[str]]:
    """``name:key=v,key=v`` -> (name, ["key=v", "key=v"])."""
    name, _, sets = text.partition(":")
    return name, [x for x in sets.split(",") if x]


def make_parser():
    p = parser(__doc__, seeds=[0, 1])
    p.add_argument("--envs", nargs="+", default=["Acrobot-v1"])
    p.add_argument("--steps", type=int, default=500_000)
    p.add_argument("--side", action="append", default=[], metavar="NAME:KEY=V,KEY=V",
                   help="more sides to try (settings on top of the schema); default: old and new only")
    return p


def run(args) -> tuple[list, None]:
    sides = {"old": OLD, "new": [], **dict(parse_side(t) for t in args.side)}
    runs = [((env_id, seed, side), config_mod.load(None, [
        f"env.id={env_id}", f"run.total_env_steps={args.steps}", "ray.address=inprocess",
        "run.checkpoint_interval_s=null", "run.progress_interval_s=1000", f"run.seed={seed}", *sets]))
        for env_id in args.envs for seed in args.seeds for side, sets in sides.items()]  # every side of a seed in turn
    scores: dict = {}
    for (env_id, seed, side), _, trained in train_all(runs):
        last = trained.records[-1]
        scores.setdefault((env_id, seed), {}).update({side: last["episode_return_mean"], f"{side}_s": last["time_s"]})
    rows = [[env_id, seed, *(sc[n] for n in sides), *(sc[f"{n}_s"] for n in sides)]
            for (env_id, seed), sc in scores.items()]
    table([("env", "<16"), ("seed", ">4"), *((n, ">9.1f") for n in sides), *((f"{n} s", ">7.1f") for n in sides)],
          rows)
    k = len(sides)
    for env_id in args.envs:
        for j, name in enumerate(sides):
            if name == "old":
                continue
            d = [r[2 + j] - r[2] for r in rows if r[0] == env_id]
            t = [r[2 + k + j] / r[2 + k] for r in rows if r[0] == env_id]
            print(f"{env_id}: {name} - old {min(d):+.1f} to {max(d):+.1f}; time {name}/old "
                  f"{np.min(t):.2f}-{np.max(t):.2f}x")
    return [{"env": env_id, "seed": seed, **sc} for (env_id, seed), sc in scores.items()], None


if __name__ == "__main__":
    cli(make_parser, run)
