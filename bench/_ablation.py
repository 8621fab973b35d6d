"""Shared by the multimodal learning benches: train config variants side by side on one embedded Ray.

A variant is the same config with some modalities removed (an ablation); each
trains for the same env-step budget, and the success rate over the last
``run.target_window`` episodes is what is compared. A uniform-random policy,
stepped in the real env, gives the floor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gymnasium as gym
import yaml

from bench._common import cli, parser
from bench._train import at_target, train_all
from cluster import config as config_mod


@dataclass
class VariantResult:
    name: str
    modalities: list[str]
    env_steps: int
    seconds: float
    success_rate: float
    return_mean: float
    curve: list[tuple[int, float]]  # (env steps, success rate) per iteration
    env_steps_per_s: float


def variant_config(path: str, drop: list[str], overrides: list[str]) -> config_mod.Config:
    data = yaml.load(Path(path).read_text(), Loader=config_mod._Loader)  # noqa: S506 - a SafeLoader
    for name in drop:
        del data["env"]["modalities"][name]
    for text in overrides:
        keys, value = config_mod.parse_override(text)
        config_mod.apply_override(data, keys, value)
    return config_mod.from_dict(data)


def train_variants(path: str, variants: dict[str, list[str]], overrides: list[str]) -> list[VariantResult]:
    """``variants``: name -> modalities to drop. Trains each in turn; returns their results."""
    # The config's target stays: a variant that reaches it stops there (its success is read at that record),
    # one that cannot runs the whole budget.
    base = ["run.progress_interval_s=10", "run.require_target=false"] + overrides
    out = []
    runs = [(name, variant_config(path, drop, base)) for name, drop in variants.items()]
    for name, cfg, (result, records, _) in train_all(runs, variant_config(path, [], base)):
        at = at_target(cfg, records, "episode_success_rate")  # where the target was first met, else the end
        row = VariantResult(
            name=name, modalities=sorted(cfg.env.modalities), env_steps=int(at["env_steps"]),
            seconds=float(at["seconds"]), success_rate=float(at["episode_success_rate"]),
            return_mean=float(result.episode_return_mean),
            curve=[(int(r["env_steps"]), float(r["episode_success_rate"])) for r in records],
            env_steps_per_s=float(at["env_steps_per_s"]))
        out.append(row)
        print(f"  {name:<16} modalities {','.join(row.modalities):<40} success {row.success_rate:.3f} "
              f"after {row.env_steps:,} env steps ({row.seconds:.0f} s, {row.env_steps_per_s:,.0f} env "
              f"steps/s)", flush=True)
    return out


def random_policy_success(env_id: str, episodes: int, seed: int = 0) -> float:
    """Success rate (return > 0) of uniformly random actions in the real env."""
    env = gym.make(env_id)
    env.action_space.seed(seed)
    wins = 0
    try:
        for k in range(episodes):
            env.reset(seed=seed + k)
            total, done = 0.0, False
            while not done:
                _, r, term, trunc, _ = env.step(env.action_space.sample())
                total += float(r)
                done = term or trunc
            wins += total > 0
    finally:
        env.close()
    return wins / episodes


def compare(*, title: str, config: str, env_id: str, ablation: tuple[str, list[str]], target: float,
            ablation_limit: float, default_steps: int, random_episodes: int = 1000) -> None:
    """The whole bench, run as a script: random floor, full model and one ablation, verdict."""
    def make_parser():
        p = parser(title, overrides=True, out="write the variants' results and curves as JSON here")
        p.add_argument("--steps", type=int, default=default_steps,
                       help="env steps budget per variant (also the lr annealing horizon); a variant that reaches "
                            "the config's target_success_rate stops there")
        return p

    def run(args) -> tuple[dict, bool]:
        name, dropped = ablation
        print(f"{title}: {args.steps:,} env steps per variant; full must reach {target}, {name} stay <= "
              f"{ablation_limit}")
        random_rate = random_policy_success(env_id, random_episodes)
        print(f"  {'random policy':<16} success {random_rate:.3f} ({random_episodes} episodes)")
        rows = train_variants(config, {"full": [], name: dropped},
                              [f"run.total_env_steps={args.steps}"] + args.overrides)
        full, ablated = rows
        print(f"\nsuccess over 200 episodes (where the target was first met, else at the end): full "
              f"{full.success_rate:.3f} | {name} {ablated.success_rate:.3f} | random {random_rate:.3f}")
        hit = next((steps for steps, rate in full.curve if rate >= target), None)
        print(f"full model first at >= {target}: " + (f"{hit:,} env steps" if hit else "never"))
        ok = full.success_rate >= target and ablated.success_rate <= ablation_limit
        print(("PASS" if ok else "FAIL") + f": full >= {target} and {name} <= {ablation_limit}")
        return {"variants": [r.__dict__ for r in rows], "random": random_rate, "target": target}, ok

    cli(make_parser, run)
