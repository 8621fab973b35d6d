"""CartPole that breaks out, once per process, after ``at_step`` steps: the breaches an env running code nobody
has read may attempt (``tests.breach_env:AscentRLTest/Breach-v0``, kwargs ``breach``, ``at_step``, ``target``).

``breach``:
* ``memory``: allocates 64 MiB blocks, touched, until an allocation fails;
* ``fork``: a fork bomb (every process forks for good);
* ``loop``: spins the CPU for good;
* ``segfault``: reads address 0;
* ``write``: writes ``target`` (a path outside the env's working directory);
* ``network``: connects to ``target`` (``host:port``) and sends a line;
* ``token``: looks for the cluster's token: RAY_* and *TOKEN* variables in its environment, ``~/.ray/auth_token``,
  then its parent's environment (``/proc/<ppid>/environ``); whatever it finds it raises with (the leak made
  visible), and an attempt that is refused raises the refusal.

The replacement of a process that breached starts counting afresh, so a run meets the breach every ``at_step``
steps of each env. A module of its own so a sandboxed child imports it by env id.
"""

from __future__ import annotations

import ctypes
import os
import socket

import gymnasium as gym

BREACH_ID = "AscentRLTest/Breach-v0"


def _memory():
    hoard = []
    while True:
        block = bytearray(64 * 2**20)
        block[::4096] = b"x" * len(block[::4096])  # resident, not only reserved
        hoard.append(block)


def _fork():
    while True:
        os.fork()


def _loop():
    while True:
        pass


def _token():
    found = {k: v for k, v in os.environ.items() if k.startswith("RAY_") or "TOKEN" in k.upper()}
    path = os.path.expanduser("~/.ray/auth_token")
    if os.path.exists(path):
        found[path] = open(path).read().strip()
    if found:
        raise RuntimeError(f"found the cluster's secrets: {found}")
    with open(f"/proc/{os.getppid()}/environ", "rb") as f:
        environ = f.read()
    raise RuntimeError(f"found the parent's environment: {environ[:200]!r}")


class Breach(gym.Wrapper):
    def __init__(self, env: gym.Env, breach: str = "loop", at_step: int = 10, target: str = ""):
        super().__init__(env)
        self.breach, self.at_step, self.target = breach, at_step, target
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps == self.at_step:
            getattr(self, f"_{self.breach}")()
        return self.env.step(action)

    _memory = staticmethod(_memory)
    _fork = staticmethod(_fork)
    _loop = staticmethod(_loop)
    _token = staticmethod(_token)

    @staticmethod
    def _segfault():
        ctypes.string_at(0)

    def _write(self):
        with open(self.target, "w") as f:
            f.write("written from inside an env\n")

    def _network(self):
        host, _, port = self.target.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"hello from inside an env\n")


def make(breach: str = "loop", at_step: int = 10, target: str = "", **kwargs) -> gym.Env:
    return Breach(gym.make("CartPole-v1", **kwargs), breach, at_step, target)


if BREACH_ID not in gym.registry:
    gym.register(BREACH_ID, entry_point=make, max_episode_steps=500)
