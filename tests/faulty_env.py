"""CartPole that fails once, or always, in a chosen way: the env faults a long run meets
(``tests.faulty_env:AscentRLTest/Faulty-v0``, kwargs ``fault``, ``at_step``, ``token``).

``token``: a file path. The first env, in any process, that creates it is the one that misbehaves (once per
run: a transient simulator crash or hang); every other env, the replacements included, is healthy. With no
token, every env misbehaves (a real bug: fresh actors fail the same way).

``fault="on_request"``: ``token`` is a directory; every ``at_step`` steps each env looks in it, and the first env
to take a file named ``raise-*`` or ``hang-*`` (by renaming it away) raises or hangs. That is how
``bench/chaos.py`` injects env faults into a running job at the moments it draws.

A module of its own so Ray workers can import it by env id.
"""

from __future__ import annotations

import os
import threading

import gymnasium as gym

FAULTY_ID = "AscentRLTest/Faulty-v0"


class Faulty(gym.Wrapper):
    def __init__(self, env: gym.Env, fault: str = "raise", at_step: int = 100, token: str | None = None,
                 leak_mb_per_step: float = 1.0):
        super().__init__(env)
        self.fault, self.at_step, self.leak_mb = fault, at_step, leak_mb_per_step
        self.token = token
        self.steps = 0
        self._hoard: list[bytearray] = []

    def _chosen(self) -> bool:
        if self.token is None:
            return True
        try:
            os.close(os.open(self.token, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True

    def _requested(self) -> str | None:
        try:
            names = sorted(os.listdir(self.token))
        except OSError:
            return None
        for name in names:
            kind = name.partition("-")[0]
            if kind in ("raise", "hang"):
                try:  # atomic: of all the envs that saw the request, exactly one takes it
                    os.rename(os.path.join(self.token, name), os.path.join(self.token, f"taken.{name}"))
                except OSError:
                    continue
                return kind
        return None

    def step(self, action):
        self.steps += 1
        if self.fault == "on_request":
            kind = self._requested() if self.steps % self.at_step == 0 else None
            if kind == "raise":
                raise RuntimeError(f"simulated simulator crash (requested) at step {self.steps}")
            if kind == "hang":
                threading.Event().wait()
        elif self.fault == "leak":
            self._hoard.append(bytearray(os.urandom(16)) * int(self.leak_mb * 2**20 // 16))  # resident, not lazy
        elif self.steps == self.at_step and self._chosen():
            if self.fault == "raise":
                raise RuntimeError(f"simulated simulator crash at step {self.steps}")
            if self.fault == "hang":
                threading.Event().wait()  # for good; the process stays alive and answers stats()
            if self.fault == "exit":
                os._exit(7)  # the process ends at once: no exception, no atexit, no word of its own
        return self.env.step(action)


def make(fault: str = "raise", at_step: int = 100, token: str | None = None, leak_mb_per_step: float = 1.0,
         **kwargs) -> gym.Env:
    return Faulty(gym.make("CartPole-v1", **kwargs), fault, at_step, token, leak_mb_per_step)


if FAULTY_ID not in gym.registry:
    gym.register(FAULTY_ID, entry_point=make, max_episode_steps=500)
