"""The real multi-rate sensor env, made to misbehave at known steps (for the bad-input tests).

A module of its own so Ray workers can import it by env id
(``tests.misbehaving_env:AscentRLTest/BadProprio-v0``).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from actors.multirate_env import MultiRateSensorEnv


class MisbehavingSensorEnv(MultiRateSensorEnv):
    """Corrupts the camera bytes (every ``corrupt_every``-th observation) or hands out a wrong-shaped
    proprioception vector (the ``bad_proprio_at``-th observation)."""

    def __init__(self, corrupt_every: int = 0, bad_proprio_at: int = -1, **kwargs):
        super().__init__(**kwargs)
        self.corrupt_every, self.bad_proprio_at = corrupt_every, bad_proprio_at
        self.calls = 0

    def _spoil(self, obs):
        self.calls += 1
        obs = dict(obs)
        if self.corrupt_every and self.calls % self.corrupt_every == 0:
            obs["camera"] = b"\x89PNG\r\n\x1a\n" + b"\x00garbage" * 8  # a PNG signature, then nothing decodable
        if self.calls == self.bad_proprio_at:
            obs["proprio"] = np.zeros(3, dtype=np.float32)
        return obs

    def reset(self, **kwargs):
        obs, info = super().reset(**kwargs)
        return self._spoil(obs), info

    def step(self, action):
        obs, *rest = super().step(action)
        return (self._spoil(obs), *rest)


MISBEHAVING_ID = "AscentRLTest/MisbehavingSensor-v0"
BAD_PROPRIO_ID = "AscentRLTest/BadProprio-v0"
for _id, _kwargs in ((MISBEHAVING_ID, {}), (BAD_PROPRIO_ID, {"bad_proprio_at": 300})):
    if _id not in gym.registry:
        gym.register(_id, entry_point=MisbehavingSensorEnv, max_episode_steps=20, kwargs=_kwargs)
