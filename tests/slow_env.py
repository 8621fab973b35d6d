"""CartPole whose step() takes ``step_s`` seconds of sleep (``tests.slow_env:AscentRLTest/Slow-v0``): a simulator
that costs wall time but no CPU, so rollout throughput grows with the actor count even on 2 cores (what the
``rollout.num_actors: auto`` test needs to see the learners wait for data, and more actors fix it)."""

import time

import gymnasium as gym

SLOW_ID = "AscentRLTest/Slow-v0"


class Slow(gym.Wrapper):
    def __init__(self, env: gym.Env, step_s: float = 0.002):
        super().__init__(env)
        self.step_s = step_s

    def step(self, action):
        time.sleep(self.step_s)
        return self.env.step(action)


def make(step_s: float = 0.002, **kwargs) -> gym.Env:
    return Slow(gym.make("CartPole-v1", **kwargs), step_s)


if SLOW_ID not in gym.registry:
    gym.register(SLOW_ID, entry_point=make, max_episode_steps=500)
