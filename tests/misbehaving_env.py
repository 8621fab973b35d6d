"""The real multi-rate sensor env, made to misbehave at known steps (for the bad-input tests).

Also a CartPole with uint8 Box observations (``UINT8_CARTPOLE_ID``), for the uint8 observation path.

A module of its own so Ray workers can import it by env id
(``tests.misbehaving_env:AscentRLTest/BadProprio-v0``).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from actors.multirate_env import MultiRateSensorEnv


class MisbehavingSensorEnv(MultiRateSensorEnv):
    """Corrupts the camera bytes (every ``corrupt_every``-th observation, the observations numbered in
    ``corrupt_calls`` (1 = the first reset's) and every observation at episode step ``corrupt_at_episode_step``)
    or hands out a wrong-shaped proprioception vector (the ``bad_proprio_at``-th observation)."""

    def __init__(self, corrupt_every: int = 0, bad_proprio_at: int = -1, corrupt_calls: tuple = (),
                 corrupt_at_episode_step: int = -1, **kwargs):
        super().__init__(**kwargs)
        self.corrupt_every, self.bad_proprio_at = corrupt_every, bad_proprio_at
        self.corrupt_calls, self.corrupt_at_episode_step = tuple(corrupt_calls), corrupt_at_episode_step
        self.calls = 0

    def _spoil(self, obs):
        self.calls += 1
        obs = dict(obs)
        if ((self.corrupt_every and self.calls % self.corrupt_every == 0) or self.calls in self.corrupt_calls
                or self.episode_step == self.corrupt_at_episode_step):
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


class UInt8CartPole(gym.ObservationWrapper):
    """CartPole with a uint8 Box observation of shape (2, 4), the way an image env hands out pixels: row 0 is the
    state quantised to 0..255 around 128, row 1 its complement."""

    SCALE = 32.0

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.observation_space = gym.spaces.Box(0, 255, (2, 4), np.uint8)

    def observation(self, obs):
        q = np.clip(np.rint(np.asarray(obs, dtype=np.float64) * self.SCALE + 128.0), 0, 255).astype(np.uint8)
        return np.stack([q, 255 - q])


def make_uint8_cartpole(**kwargs) -> gym.Env:
    from gymnasium.envs.classic_control import CartPoleEnv

    return UInt8CartPole(CartPoleEnv(**kwargs))


MISBEHAVING_ID = "AscentRLTest/MisbehavingSensor-v0"
BAD_PROPRIO_ID = "AscentRLTest/BadProprio-v0"
for _id, _kwargs in ((MISBEHAVING_ID, {}), (BAD_PROPRIO_ID, {"bad_proprio_at": 300})):
    if _id not in gym.registry:
        gym.register(_id, entry_point=MisbehavingSensorEnv, max_episode_steps=20, kwargs=_kwargs)

UINT8_CARTPOLE_ID = "AscentRLTest/UInt8CartPole-v0"
if UINT8_CARTPOLE_ID not in gym.registry:
    gym.register(UINT8_CARTPOLE_ID, entry_point=make_uint8_cartpole, max_episode_steps=500)
