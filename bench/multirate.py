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

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._ablation import compare  # noqa: E402

CONFIG = "configs/multirate.yaml"
ENV_ID = "actors.multirate_env:AscentRL/MultiRateSensor-v0"
THRESHOLD = 0.9  # = run.target_success_rate in configs/multirate.yaml
SINGLE_MODALITY_CEILING = 1 / 3

if __name__ == "__main__":
    compare(title="multi-rate sensor env", config=CONFIG, env_id=ENV_ID,
            ablation=("camera only", ["proprio", "audio", "lidar", "instruction"]), target=THRESHOLD,
            ablation_limit=round(SINGLE_MODALITY_CEILING + 0.1, 2), default_steps=400_000,
            random_episodes=2000)
