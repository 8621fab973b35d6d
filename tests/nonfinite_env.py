"""CartPole whose reward stops being finite: the diverging runs of ``tests/test_nonfinite.py``
(``tests.nonfinite_env:AscentRLTest/NonFinite-v0``).

``nan_after``: every env's reward is NaN from its step ``nan_after`` on, for good (a simulator that broke: every
update from then on is not finite). ``inf_at``: every env returns +inf once, at its step ``inf_at`` (counted over
its episodes); an actor's envs step together, so with one actor those rewards land in one fragment, and one update
is not finite while the next ones are. Both null: plain CartPole.

A module of its own so Ray workers can import it by env id.
"""

from __future__ import annotations

import math

import gymnasium as gym

NONFINITE_ID = "AscentRLTest/NonFinite-v0"


class NonFiniteReward(gym.Wrapper):
    def __init__(self, env: gym.Env, nan_after: int | None = None, inf_at: int | None = None):
        super().__init__(env)
        self.nan_after = nan_after
        self.inf_at = inf_at
        self.steps = 0

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.steps += 1
        if self.nan_after is not None and self.steps >= self.nan_after:
            reward = math.nan
        if self.inf_at is not None and self.steps == self.inf_at:
            reward = math.inf
        return obs, reward, terminated, truncated, info


def make(nan_after: int | None = None, inf_at: int | None = None, **kwargs) -> gym.Env:
    return NonFiniteReward(gym.make("CartPole-v1", **kwargs), nan_after, inf_at)


if NONFINITE_ID not in gym.registry:
    gym.register(NONFINITE_ID, entry_point=make, max_episode_steps=500)
