"""An env whose step() blocks for good after a number of steps: a rollout actor that stops producing without
dying, the one failure nothing but a deadline can catch (``tests.hanging_env:AscentRLTest/HangAfter-v0``)."""

import threading

import gymnasium as gym

HANG_ID = "AscentRLTest/HangAfter-v0"


class HangAfter(gym.Wrapper):
    def __init__(self, env: gym.Env, hang_after_steps: int = 2000):
        super().__init__(env)
        self.remaining = hang_after_steps

    def step(self, action):
        self.remaining -= 1
        if self.remaining < 0:
            threading.Event().wait()  # forever: the actor process stays alive and answers stats()
        return self.env.step(action)


def make(hang_after_steps: int = 2000, **kwargs) -> gym.Env:
    return HangAfter(gym.make("CartPole-v1", **kwargs), hang_after_steps)


if HANG_ID not in gym.registry:
    gym.register(HANG_ID, entry_point=make, max_episode_steps=500)
