"""Every action-space kind learned to a target, and action masking on and off side by side, in one run.

The envs are actors/probe_envs.py's: each step shows a fresh target and pays for how well the action answers it
(episodes of 16 steps), so each has a known optimum. Each run trains in process (``ray.address: inprocess``) on
configs/cartpole.yaml with 16 envs x 32 steps, batches of 512, minibatches of 128, lr 1e-3, a 50-episode window:

  MultiDiscrete  Match-MultiDiscrete-v0 (3 x Discrete(4))        target 14 of 16
  MultiBinary    Match-MultiBinary-v0 (4 bits)                    target 14 of 16
  Box 2x2        Match-Box2D-v0 (Box(-1, 1, (2, 2)))              target 9 of 16 (random play: about 4)
  Dict hybrid    Match-Hybrid-v0 (Discrete(3) + Box(1))           target 12 of 16
  masked         MaskedChoice-v0 with its action mask applied     target 11.5 (optimum 12.6)
  unmasked       the same env, the mask only in the observation   target 11.5

For the masked pair the bench also counts the illegal actions played during training (each costs -1; the env
counts them): the masked policy plays none. Printed per run: reached, env steps to target, seconds of the run,
illegal actions; then per kind the median and range over seeds, and unmasked / masked env steps.

    .venv/bin/python bench/action_spaces.py [--seeds 0 1 2] [--kinds ...] [--max-steps 300000] [--out FILE]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import ROOT, cli, parser, spread, table  # noqa: E402

KINDS = {  # kind: (env id, target, env.modalities, env.action_mask_key)
    "MultiDiscrete": ("AscentRL/Match-MultiDiscrete-v0", 14.0, {}, "action_mask"),
    "MultiBinary": ("AscentRL/Match-MultiBinary-v0", 14.0, {}, "action_mask"),
    "Box 2x2": ("AscentRL/Match-Box2D-v0", 9.0, {}, "action_mask"),
    "Dict hybrid": ("AscentRL/Match-Hybrid-v0", 12.0, {}, "action_mask"),
    "masked": ("AscentRL/MaskedChoice-v0", 11.5, {"observation": {"kind": "vector"}}, "action_mask"),
    "unmasked": ("AscentRL/MaskedChoice-v0", 11.5, {"observation": {"kind": "vector"}}, None),
}


def run_one(kind: str, seed: int, max_steps: int, tmp: Path) -> dict:
    import actors.probe_envs as probe
    from bench._train import first_at, read_records
    from cluster.api import train

    env_id, target, modalities, mask_key = KINDS[kind]
    before = probe.MaskedChoice.illegal_total
    t0 = time.perf_counter()
    result = train(str(ROOT / "configs/cartpole.yaml"), run_dir=tmp / f"{kind}-{seed}".replace(" ", "_"),
                   env__id=f"actors.probe_envs:{env_id}", env__modalities=modalities, env__action_mask_key=mask_key,
                   ray__address="inprocess", run__seed=seed, run__target_return=target, run__target_window=50,
                   run__total_env_steps=max_steps, run__require_target=False, rollout__envs_per_actor=16,
                   rollout__fragment_length=32, learner__batch_size=512, learner__minibatch_size=128,
                   learner__lr=1e-3, preprocess__workers=0)
    seconds = time.perf_counter() - t0
    hit = first_at(read_records(result.run_dir), 50, target)
    return {"kind": kind, "seed": seed, "reached": hit is not None, "seconds": seconds,
            "env_steps": hit["env_steps"] if hit else result.env_steps,
            "illegal": probe.MaskedChoice.illegal_total - before if "masked" in kind else None}


def make_parser():
    p = parser(__doc__, out="write the rows as JSON", seeds=[0, 1, 2])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--max-steps", type=int, default=300_000)
    return p


def run(args) -> tuple[list, None]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="action-spaces-") as tmp:
        for seed in args.seeds:
            for kind in args.kinds:
                row = run_one(kind, seed, args.max_steps, Path(tmp))
                rows.append(row)
                illegal = f"  illegal actions {row['illegal']:,}" if row["illegal"] is not None else ""
                print(f"{kind:<13} seed {seed}: {'reached' if row['reached'] else 'not reached':<11} "
                      f"{row['env_steps']:>8,} env steps {row['seconds']:>6.1f} s{illegal}", flush=True)
    print()
    summary = []
    for kind in args.kinds:
        done = [r for r in rows if r["kind"] == kind]
        illegal = [r["illegal"] for r in done if r["illegal"] is not None]
        summary.append((kind, f"{sum(r['reached'] for r in done)}/{len(done)}",
                        *spread([r["env_steps"] for r in done]), spread([r["seconds"] for r in done], ".1f")[0],
                        spread(illegal)[0] if illegal else "-"))
    table([("kind", "<13"), ("reached", ">7"), ("env steps", ">10"), ("range", ">17"), ("seconds", ">8"),
           ("illegal", ">9")], summary, rule=True)
    pairs = [(r["env_steps"], m["env_steps"]) for r in rows if r["kind"] == "unmasked"
             for m in rows if m["kind"] == "masked" and m["seed"] == r["seed"] and m["reached"] and r["reached"]]
    if pairs:
        print(f"\nunmasked / masked env steps to target: median %s, range %s over {len(pairs)} seeds"
              % spread([u / m for u, m in pairs], ".2f"))
    return rows, None


if __name__ == "__main__":
    cli(make_parser, run)
