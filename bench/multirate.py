"""Multi-rate sensor env: the full five-modality model against a camera-only ablation and a random policy.

The task (actors/multirate_env.py): walk to the beacon whose colour the
instruction names. The instruction says which colour, the camera says where
each colour is; either alone cannot do better than picking one of the three
beacons (1/3), and a uniform-random policy succeeds when its walk happens to
touch the goal first (~0.22). The threshold is a success rate of 0.9 over 200
episodes: far above anything a single modality can reach (1/3) and four times
random, so passing it means the model fuses two modalities.

    .venv/bin/python bench/multirate.py [--steps 400000] [--set key=value ...] [--out results.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._ablation import first_reaching, random_policy_success, summary_json, train_variants  # noqa: E402

CONFIG = "configs/multirate.yaml"
ENV_ID = "actors.multirate_env:AscentRL/MultiRateSensor-v0"
THRESHOLD = 0.9  # = run.target_success_rate in configs/multirate.yaml
SINGLE_MODALITY_CEILING = 1 / 3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400_000,
                   help="env steps budget per variant (also the lr annealing horizon); a variant that reaches "
                        "the config's target_success_rate stops there")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--out")
    args = p.parse_args()
    print(f"multi-rate sensor env, {args.steps:,} env steps per variant; threshold: success >= {THRESHOLD}")
    random_rate = random_policy_success(ENV_ID, 2000)
    print(f"  {'random policy':<16} success {random_rate:.3f} (2000 episodes)")
    rows = train_variants(CONFIG, {
        "full": [],
        "camera only": ["proprio", "audio", "lidar", "instruction"],
    }, [f"run.total_env_steps={args.steps}"] + args.overrides)
    full, camera = rows
    print(f"\nsuccess rate over 200 episodes (where the target was first met, else at the end): full {full.success_rate:.3f} | camera only "
          f"{camera.success_rate:.3f} | random {random_rate:.3f}")
    hit = first_reaching(full.curve, THRESHOLD)
    print(f"full model first at >= {THRESHOLD}: " + (f"{hit:,} env steps" if hit else "never"))
    ok = full.success_rate >= THRESHOLD and camera.success_rate <= SINGLE_MODALITY_CEILING + 0.1
    print(("PASS" if ok else "FAIL") + f": full >= {THRESHOLD} and camera only <= {SINGLE_MODALITY_CEILING + 0.1:.2f}")
    if args.out:
        Path(args.out).write_text(summary_json(rows, {"random": random_rate, "threshold": THRESHOLD}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
