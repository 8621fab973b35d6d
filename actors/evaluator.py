"""Evaluator: plays whole episodes with a given policy version through the rollouts' own sampler.

Plain class plus a thin Ray shell. Each evaluation builds a fresh sampler with the same seed, so every version
is scored on the same reset states, with exactly the observation handling the rollouts use (a Dict env's
preprocessing and alignment included), deterministic actions by default and unscaled rewards.
"""

from __future__ import annotations

import math

import numpy as np
import ray
import torch

from actors.sampler import RolloutSampler

#: Envs stepped side by side (episodes are split evenly over them, so short episodes are not over-counted).
MAX_ENVS = 8


class Evaluator:
    def __init__(self, *, sampler_kwargs: dict, episodes: int, deterministic: bool = True,
                 max_env_steps: int = 10_000_000):
        self.kwargs = dict(sampler_kwargs, num_envs=min(episodes, MAX_ENVS), deterministic=deterministic,
                           normalize_reward=False)
        self.episodes = episodes
        self.max_env_steps = max_env_steps

    def run(self, version: int, weights: dict) -> dict:
        """Statistics of ``episodes`` episodes of policy ``version``: the first ``ceil(episodes / envs)`` episodes
        of every env, taken env by env."""
        sampler = RolloutSampler(**self.kwargs)
        sampler.load_weights(version, weights)
        sampler.episode_log = log = []
        n_envs = sampler.num_envs
        per_env = math.ceil(self.episodes / n_envs)
        try:
            while True:
                counts = np.bincount([env for env, _, _ in log], minlength=n_envs)
                if counts.min() >= per_env or sampler.env_steps >= self.max_env_steps:
                    break
                sampler.collect()
        finally:
            sampler.close()
        by_env = [[(ret, length) for env, ret, length in log if env == i][:per_env] for i in range(n_envs)]
        episodes = [ep for round_ in zip(*by_env) for ep in round_][:self.episodes]  # round-robin over envs
        if not episodes:  # max_env_steps ran out before every env finished an episode
            return {"version": version, "episodes": 0, "return_mean": math.nan, "return_std": math.nan,
                    "success_rate": math.nan, "length_mean": math.nan}
        returns = np.array([r for r, _ in episodes], dtype=np.float64)
        return {"version": version, "episodes": len(episodes), "return_mean": float(returns.mean()),
                "return_std": float(returns.std()), "success_rate": float((returns > 0).mean()),
                "length_mean": float(np.mean([n for _, n in episodes]))}


@ray.remote(num_cpus=0)
class RemoteEvaluator:
    """No CPU reserved: it must always be placeable, and it runs one evaluation at a time on a CPU host."""

    def __init__(self, torch_threads: int = 1, **kwargs):
        torch.set_num_threads(torch_threads)
        self.evaluator = Evaluator(**kwargs)

    def run(self, version: int, weights: dict) -> dict:
        return self.evaluator.run(version, weights)
