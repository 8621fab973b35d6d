"""The schema defaults on a new env, old against new, side by side in one run: only ``env.id`` set.

    python bench/defaults.py [--envs Acrobot-v1 MountainCar-v0] [--seeds 0 1] [--steps 500000]

Each env x seed trains twice in process (``ray.address: inprocess``, one learner): on the schema defaults before
2026-12-02 (``learner.minibatch_size: 512``) and on today's (128: four times the gradient steps per sample, CleanRL's
ratio of one step per 32 samples, with the same 16 envs x 128 steps layout and its throughput). Score: the
100-episode mean return at the end.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench._common import parser, run_main, table, write_out  # noqa: E402
from bench._train import train  # noqa: E402
from cluster import config as config_mod  # noqa: E402

SIDES = {"old": ["learner.minibatch_size=512"], "new": []}


def main() -> int:
    p = parser(__doc__, out="write the figures as JSON here")
    p.add_argument("--envs", nargs="+", default=["Acrobot-v1"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=500_000)
    args = p.parse_args()
    rows, figures = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for env_id in args.envs:
            for seed in args.seeds:
                scores = {}
                for side, sets in SIDES.items():  # interleaved: both sides of a seed back to back
                    cfg = config_mod.load(None, [f"env.id={env_id}", f"run.total_env_steps={args.steps}",
                                                 "ray.address=inprocess", "run.checkpoint_interval_s=null",
                                                 "run.progress_interval_s=1000", f"run.seed={seed}", *sets])
                    trained = train(cfg, Path(tmp) / f"{env_id}-{seed}-{side}")
                    last = trained.records[-1]
                    scores[side] = last["episode_return_mean"]
                    scores[f"{side}_s"] = last["time_s"]
                rows.append([env_id, seed, scores["old"], scores["new"], scores["old_s"], scores["new_s"]])
                figures.append({"env": env_id, "seed": seed, **scores})
    table([("env", "<16"), ("seed", ">4"), ("old", ">9.1f"), ("new", ">9.1f"), ("old s", ">7.1f"),
           ("new s", ">7.1f")], rows)
    for env_id in args.envs:
        d = [r[3] - r[2] for r in rows if r[0] == env_id]
        t = [r[5] / r[4] for r in rows if r[0] == env_id]
        print(f"{env_id}: new - old {min(d):+.1f} to {max(d):+.1f}; time new/old {np.min(t):.2f}-{np.max(t):.2f}x")
    write_out(args.out, figures)
    return 0


if __name__ == "__main__":
    run_main(main)
