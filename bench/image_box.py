"""Image Box envs with no modality config: MiniGrid through ImgObsWrapper to a 0.9 success rate, Atari Pong for
100k frames, and CartPole's vector path, side by side on one embedded Ray.

An H x W x C uint8 Box observation is one ``image`` modality (``actors/envs.py`` ``box_modality``): the CNN
encoder, uint8 up to the learner device. Prints per run: where it stopped, env steps, seconds, env steps/s in the
training loop, and which encoder the model used; then the image paths' env steps/s next to the vector path's.
Atari needs the ``atari`` extra (``pip install -e '.[atari]'``); without ale-py that row is skipped.

    .venv/bin/python bench/image_box.py [--seeds 0 1] [--atari-frames 100000] [--out results.json]
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import cli, parser  # noqa: E402
from bench._train import at_target, target_key, train_all  # noqa: E402
from cluster import config as config_mod  # noqa: E402

FRAME_SKIP = 4  # actors/wrapped_envs.py: one agent step is 4 Atari frames


def encoder_of(cfg) -> str:
    from cluster.graph import describe_env
    from learner.model import ActorCritic

    model = ActorCritic(describe_env(cfg))
    return ", ".join(f"{name}: {type(enc).__name__}" for name, enc in model.encoders.items())


def make_parser():
    p = parser(__doc__, out="write the rows as JSON here", seeds=[0, 1])
    p.add_argument("--atari-frames", type=int, default=100_000)
    p.add_argument("--minigrid-max-steps", type=int, default=300_000, help="env steps within which 0.9 must be met")
    return p


def run(args) -> tuple[list, bool]:
    quiet = ["run.progress_interval_s=1000", "run.require_target=false"]
    runs = [(f"minigrid-image seed {s}", "configs/minigrid_image.yaml",
             [f"run.seed={s}", f"run.total_env_steps={args.minigrid_max_steps}"]) for s in args.seeds]
    runs += [(f"cartpole-vector seed {s}", "configs/cartpole.yaml", [f"run.seed={s}"]) for s in args.seeds]
    if importlib.util.find_spec("ale_py") is not None:
        runs.append(("atari-pong", "configs/atari_pong.yaml",
                     [f"run.total_env_steps={args.atari_frames // FRAME_SKIP}"]))
    else:
        print("atari-pong: skipped (ale-py is not installed: pip install -e '.[atari]')")

    rows = []
    cfgs = [(name, config_mod.load(config, quiet + extra)) for name, config, extra in runs]
    for name, cfg, trained in train_all(cfgs, config_mod.load("configs/minigrid_image.yaml", quiet)):
        key, target = target_key(cfg)
        row = {"run": name, "encoder": encoder_of(cfg), **at_target(cfg, trained.records),
               "stop": trained.result.reason}
        rows.append(row)
        target = "" if target is None else ("reached target | " if row["reached"] else "MISSED target | ")
        print(f"{name}: {target}{row['env_steps']:,} env steps in {row['seconds']:.1f} s | "
              f"{row['env_steps_per_s']:,.0f} env steps/s | {key} {row[key]} | {row['encoder']}", flush=True)

    def rate(prefix: str) -> float:
        vals = [r["env_steps_per_s"] for r in rows if r["run"].startswith(prefix)]
        return sum(vals) / len(vals) if vals else float("nan")

    vector = rate("cartpole-vector")
    print(f"\nenv steps/s: vector path (CartPole) {vector:,.0f} | minigrid image {rate('minigrid-image'):,.0f} "
          f"({rate('minigrid-image') / vector:.2f}x) | atari pong {rate('atari-pong'):,.0f} "
          f"({rate('atari-pong') / vector:.2f}x)")
    minigrid = [r for r in rows if r["run"].startswith("minigrid")]
    ok = all(r["reached"] for r in minigrid)
    print(("PASS" if ok else "FAIL") + f": minigrid-image reached a 0.9 success rate within "
          f"{args.minigrid_max_steps:,} env steps on {sum(r['reached'] for r in minigrid)}/{len(minigrid)} seeds")
    return rows, ok


if __name__ == "__main__":
    cli(make_parser, run)
