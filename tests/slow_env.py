"""CartPole whose step() takes ``step_s`` seconds of sleep (``tests.slow_env:AscentRLTest/Slow-v0``): a simulator
that costs wall time but no CPU, so rollout throughput grows with the actor count even on 2 cores (what the
``rollout.num_actors: auto`` test needs to see the learners wait for data, and more actors fix it). With
``slow_while`` (a path), only while that file exists: a test makes the env fast mid-run by removing it."""

import os
import time

import gymnasium as gym

SLOW_ID = "AscentRLTest/Slow-v0"


class Slow(gym.Wrapper):
    def __init__(self, env: gym.Env, step_s: float = 0.002, slow_while: str | None = None):
        super().__init__(env)
        self.step_s, self.slow_while = step_s, slow_while
        self._slow, self._looked = True, 0.0

    def step(self, action):
        if self.slow_while is not None and time.monotonic() - self._looked > 0.1:  # not a stat() every step
            self._slow, self._looked = os.path.exists(self.slow_while), time.monotonic()
        if self._slow:
            time.sleep(self.step_s)
        return self.env.step(action)


def make(step_s: float = 0.002, slow_while: str | None = None, **kwargs) -> gym.Env:
    return Slow(gym.make("CartPole-v1", **kwargs), step_s, slow_while)


if SLOW_ID not in gym.registry:
    gym.register(SLOW_ID, entry_point=make, max_episode_steps=500)
