"""An env whose step() blocks for good after a number of steps: a rollout actor that stops producing without
dying, the one failure nothing but a deadline can catch (``tests.hanging_env:AscentRLTest/HangAfter-v0``)."""

import threading
from pathlib import Path

import gymnasium as gym

HANG_ID = "AscentRLTest/HangAfter-v0"


class HangAfter(gym.Wrapper):
    """``hung_marker``: a file created as the env hangs, so that a test strikes once it has (a condition, not a
    sleep that a slow or a fast machine gets wrong)."""

    def __init__(self, env: gym.Env, hang_after_steps: int = 2000, hung_marker: str | None = None):
        super().__init__(env)
        self.remaining = hang_after_steps
        self.hung_marker = hung_marker

    def step(self, action):
        self.remaining -= 1
        if self.remaining < 0:
            if self.hung_marker:
                Path(self.hung_marker).touch()
            threading.Event().wait()  # forever: the actor process stays alive and answers stats()
        return self.env.step(action)


def make(hang_after_steps: int = 2000, hung_marker: str | None = None, **kwargs) -> gym.Env:
    return HangAfter(gym.make("CartPole-v1", **kwargs), hang_after_steps, hung_marker)


if HANG_ID not in gym.registry:
    gym.register(HANG_ID, entry_point=make, max_episode_steps=500)
