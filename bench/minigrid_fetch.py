"""minigrid Fetch: the full model (image + direction + mission text) against the image-only ablation.

(Not named minigrid.py: a script directory comes first on sys.path, and that name would shadow the package.)

MiniGrid-Fetch-5x5-N2-v0 places two objects and asks for one of them by colour
and type ("get a red ball"); picking up the wrong one ends the episode with
no reward. Without the mission text the best a policy can do is pick one of
the two: chance is 0.5. The full model must reach a success rate of 0.9 over
the last 200 episodes; the image-only model, same config with env.modalities.mission
removed, must stay near chance (<= 0.6).

    .venv/bin/python bench/minigrid_fetch.py [--steps 1500000] [--set key=value ...] [--out results.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._ablation import compare  # noqa: E402

CONFIG = "configs/minigrid_fetch.yaml"
ENV_ID = "minigrid:MiniGrid-Fetch-5x5-N2-v0"
TARGET = 0.9  # = run.target_success_rate in configs/minigrid_fetch.yaml
CHANCE = 0.5

if __name__ == "__main__":
    compare(title="minigrid Fetch-5x5-N2", config=CONFIG, env_id=ENV_ID, ablation=("image only", ["mission"]),
            target=TARGET, ablation_limit=CHANCE + 0.1, default_steps=1_500_000)
