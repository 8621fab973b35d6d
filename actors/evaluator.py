"""Evaluator: plays whole episodes with a given policy version through the rollouts' own sampler.

Plain class plus a thin Ray shell. Each evaluation builds a fresh sampler with the same seed, so every version
is scored on the same reset states, with exactly the observation handling the rollouts use (a Dict env's
preprocessing and alignment included), deterministic actions by default and unscaled rewards.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np
import ray
import torch

from actors.sampler import RolloutSampler, SamplerSettings

#: Envs stepped side by side (episodes are split evenly over them, so short episodes are not over-counted).
MAX_ENVS = 8


class Evaluator:
    """``slots_per_game``: env slots one game fills (a parallel PettingZoo game's agents; 1 otherwise), so the envs
    stepped side by side are whole games. ``opponents``: a turn-based game's players to score against (``random``,
    ``heuristic``: ``actors.multiagent``); the first one's scores are the headline ``return_mean`` and
    ``success_rate``, each one's win, draw and loss rates are ``win_rate/<player>`` and so on."""

    def __init__(self, settings: SamplerSettings, policy_factory: Callable[[], torch.nn.Module], *, episodes: int,
                 deterministic: bool = True, max_env_steps: int = 10_000_000, slots_per_game: int = 1,
                 opponents: list | None = None):
        envs = -(-min(episodes, MAX_ENVS) // slots_per_game) * slots_per_game
        # Unscaled rewards, and fixed players rather than the self-play pool: the scores compare across versions.
        self.settings = dataclasses.replace(settings, num_envs=envs, deterministic=deterministic,
                                            normalize_reward=False, self_play=None)
        self.policy_factory = policy_factory
        self.episodes = episodes
        self.max_env_steps = max_env_steps
        self.opponents = list(opponents or [])

    def run(self, version: int, weights: dict) -> dict:
        """Statistics of ``episodes`` episodes of policy ``version`` (against each of ``opponents``)."""
        if not self.opponents:
            return self._run(version, weights, self.settings)
        out: dict = {}
        for player in self.opponents:
            multiagent = dict(self.settings.multiagent or {}, opponent=player)
            result = self._run(version, weights, dataclasses.replace(self.settings, multiagent=multiagent))
            out = out or dict(result, opponent=player)
            for outcome, rate in result.get("outcomes", {}).items():
                out[f"{outcome}_rate/{player}"] = rate
        return out

    def _run(self, version: int, weights: dict, settings: SamplerSettings) -> dict:
        """The first ``ceil(episodes / envs)`` episodes of every env, taken env by env."""
        sampler = RolloutSampler(settings, self.policy_factory)
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
                "length_mean": float(np.mean([n for _, n in episodes])),
                # A game's return is its outcome for the learning seat (+ win, 0 draw, - loss).
                "outcomes": {"win": float((returns > 0).mean()), "draw": float((returns == 0).mean()),
                             "loss": float((returns < 0).mean())}}


@ray.remote(num_cpus=0)
class RemoteEvaluator:
    """No CPU reserved: it must always be placeable, and it runs one evaluation at a time on a CPU host."""

    def __init__(self, settings: SamplerSettings, policy_factory: Callable[[], torch.nn.Module], *,
                 torch_threads: int = 1, **kwargs):
        torch.set_num_threads(torch_threads)
        self.evaluator = Evaluator(settings, policy_factory, **kwargs)

    def run(self, version: int, weights: dict) -> dict:
        return self.evaluator.run(version, weights)
