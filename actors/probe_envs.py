"""Small envs with a known optimum, each probing one capability: action structures, action masking, memory.

Importing this module registers them (``env.id: "actors.probe_envs:AscentRL/Match-MultiDiscrete-v0"``, ...).
Each episode is ``EPISODE_STEPS`` steps; every step shows a fresh random target and pays for how well the action
answers it, so each env's optimum is known and a memoryless policy can reach it:

* ``AscentRL/Match-MultiDiscrete-v0``: 3 targets in {0..3}; action MultiDiscrete([4, 4, 4]); +1/3 per match.
* ``AscentRL/Match-MultiBinary-v0``: 4 target bits; action MultiBinary(4); +1/4 per matching bit.
* ``AscentRL/Match-Box2D-v0``: a 2 x 2 target in [-1, 1]; action Box(-1, 1, (2, 2)); 1 - mean |a - target|.
* ``AscentRL/Match-Hybrid-v0``: a choice in {0, 1, 2} and an amount in [-1, 1]; action Dict(choice: Discrete(3),
  amount: Box(-1, 1, (1,))); +0.5 for the right choice, + 0.5 * (1 - |amount - target|).
* ``AscentRL/MaskedChoice-v0``: Dict observation {observation: the legal set as floats, action_mask: the same
  20 flags}; 3 of 20 actions legal per step; a legal action pays (a + 1) / 20, an illegal one -1. Optimum 12.6
  per episode (``MaskedChoice.OPTIMUM``).
* ``AscentRL/CueRecall-v0``: memory; a cue on the first step, to be named ``delay`` steps later (``CueRecall``).
  Optimum 1, a memoryless policy's expectation exactly 0. Not a per-step target env like the ones above.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

EPISODE_STEPS = 16


class _MatchEnv(gym.Env):
    """One fresh target per step; the reward scores the action against it (``score``, in [0, 1])."""

    def __init__(self):
        self._t = 0
        self._target = None

    def _new_target(self):
        raise NotImplementedError

    def _obs(self):
        return np.asarray(self._target, dtype=np.float32).reshape(-1)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        self._target = self._new_target()
        return self._obs(), {}

    def step(self, action):
        if not self.action_space.contains(action):
            raise ValueError(f"{type(self).__name__}: action {action!r} is not in {self.action_space}")
        reward = float(self.score(action))
        self._t += 1
        self._target = self._new_target()
        return self._obs(), reward, self._t >= EPISODE_STEPS, False, {}


class MatchMultiDiscrete(_MatchEnv):
    def __init__(self):
        super().__init__()
        self.action_space = gym.spaces.MultiDiscrete([4, 4, 4])
        self.observation_space = gym.spaces.Box(0, 1, (12,), np.float32)

    def _new_target(self):
        return self.np_random.integers(0, 4, size=3)

    def _obs(self):
        return np.eye(4, dtype=np.float32)[self._target].reshape(-1)  # one-hot per element

    def score(self, action):
        return np.mean(np.asarray(action) == self._target)


class MatchMultiBinary(_MatchEnv):
    def __init__(self):
        super().__init__()
        self.action_space = gym.spaces.MultiBinary(4)
        self.observation_space = gym.spaces.Box(0, 1, (4,), np.float32)

    def _new_target(self):
        return self.np_random.integers(0, 2, size=4)

    def score(self, action):
        return np.mean(np.asarray(action) == self._target)


class MatchBox2D(_MatchEnv):
    def __init__(self):
        super().__init__()
        self.action_space = gym.spaces.Box(-1, 1, (2, 2), np.float32)
        self.observation_space = gym.spaces.Box(-1, 1, (4,), np.float32)

    def _new_target(self):
        return self.np_random.uniform(-1, 1, size=(2, 2))

    def score(self, action):
        return 1.0 - np.mean(np.abs(np.asarray(action) - self._target))


class MatchHybrid(_MatchEnv):
    def __init__(self):
        super().__init__()
        self.action_space = gym.spaces.Dict({"choice": gym.spaces.Discrete(3),
                                             "amount": gym.spaces.Box(-1, 1, (1,), np.float32)})
        self.observation_space = gym.spaces.Box(-1, 1, (4,), np.float32)

    def _new_target(self):
        return int(self.np_random.integers(0, 3)), float(self.np_random.uniform(-1, 1))

    def _obs(self):
        choice, amount = self._target
        return np.append(np.eye(3, dtype=np.float32)[choice], np.float32(amount))

    def score(self, action):
        choice, amount = self._target
        return 0.5 * (int(action["choice"]) == choice) + 0.5 * (1.0 - abs(float(action["amount"][0]) - amount))


class MaskedChoice(gym.Env):
    """20 actions worth 1/20, 2/20, ..., 1; 3 of them, drawn afresh each step, are legal. An illegal action costs
    -1. The observation shows the legal set (``observation``, as floats) and carries it as ``action_mask``. The best
    play is the most valuable legal action: 3 * 21 / (4 * 20) = 0.7875 per step, 12.6 per episode. With the mask
    applied, "prefer higher actions" is all there is to learn; without it, the policy must first learn which actions
    the observation allows, paying -1 for most of its choices meanwhile (17 in 20 at the start)."""

    N, LEGAL = 20, 3
    #: Per step, E[max of LEGAL distinct draws from 1..N] / N = LEGAL (N + 1) / ((LEGAL + 1) N).
    OPTIMUM = EPISODE_STEPS * LEGAL * (N + 1) / ((LEGAL + 1) * N)

    def __init__(self, empty_mask_at: int | None = None):
        """``empty_mask_at``: an episode step whose mask has no legal action (tests of that error)."""
        self.empty_mask_at = empty_mask_at
        self.action_space = gym.spaces.Discrete(self.N)
        self.observation_space = gym.spaces.Dict({
            "observation": gym.spaces.Box(0, 1, (self.N,), np.float32),
            "action_mask": gym.spaces.Box(0, 1, (self.N,), np.int8),  # PettingZoo classic's mask space
        })
        self._t = 0
        self.illegal = 0  # illegal actions played, this env's lifetime

    def _draw(self):
        self._mask = np.zeros(self.N, dtype=np.int8)
        if self._t != self.empty_mask_at:
            self._mask[self.np_random.choice(self.N, size=self.LEGAL, replace=False)] = 1
        return {"observation": self._mask.astype(np.float32), "action_mask": self._mask.copy()}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        return self._draw(), {}

    def step(self, action):
        action = int(action)
        legal = bool(self._mask[action])
        self.illegal += not legal
        reward = (action + 1) / self.N if legal else -1.0
        self._t += 1
        return self._draw(), reward, self._t >= EPISODE_STEPS, False, {"illegal": not legal}


class CueRecall(gym.Env):
    """Memory: a cue (left or right) is shown on the first step only; ``delay`` blank steps later, on the query step
    (flagged in the observation), the action must name the cue: +1 right, -1 wrong, 0 on every other step.

    Observation Box(3): [cue is left, cue is right, this is the query step]; action Discrete(2). Episodes are
    ``delay + 1`` steps. A memoryless policy sees the same observation on the query step whatever the cue was, so
    its expected return is exactly 0 (chance); a policy that remembers the first step gets 1. A frame stack
    shorter than ``delay + 1`` sees nothing of the cue at the query step either.
    """

    def __init__(self, delay: int = 12):
        if delay < 1:
            raise ValueError(f"CueRecall: delay {delay} must be >= 1")
        self.delay = delay
        self.action_space = gym.spaces.Discrete(2)
        self.observation_space = gym.spaces.Box(0, 1, (3,), np.float32)
        self._t = 0
        self._cue = 0

    def _obs(self):
        obs = np.zeros(3, dtype=np.float32)
        if self._t == 0:
            obs[self._cue] = 1.0
        if self._t == self.delay:
            obs[2] = 1.0
        return obs

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        self._cue = int(self.np_random.integers(2))
        return self._obs(), {}

    def step(self, action):
        query = self._t == self.delay
        reward = (1.0 if int(action) == self._cue else -1.0) if query else 0.0
        self._t += 1
        return self._obs(), reward, query, False, {}


ENVS = {"AscentRL/Match-MultiDiscrete-v0": MatchMultiDiscrete, "AscentRL/Match-MultiBinary-v0": MatchMultiBinary,
        "AscentRL/Match-Box2D-v0": MatchBox2D, "AscentRL/Match-Hybrid-v0": MatchHybrid,
        "AscentRL/MaskedChoice-v0": MaskedChoice, "AscentRL/CueRecall-v0": CueRecall}

for _id, _cls in ENVS.items():
    if _id not in gym.registry:  # re-imports (pytest, Ray workers) must not re-register
        gym.register(id=_id, entry_point=f"{__name__}:{_cls.__name__}")


class NameYourSeat:
    """A parallel multi-agent probe with PettingZoo's parallel API (duck-typed, so it needs no PettingZoo):
    ``env.id: "actors.probe_envs:name_your_seat"``. Three agents see the same observation (a constant 1 and a
    random bit) and each is paid 1 per step for naming its own index (Discrete(3)); ``agent_2`` leaves after
    ``LEAVES_AT`` steps (terminated), the others play ``STEPS``. With one shared policy only the agent's index
    (``multiagent.agent_index``) tells them apart: the optimum is STEPS, STEPS, LEAVES_AT per agent
    (``OPTIMUM`` on average), a policy blind to the index gets at most STEPS / 3 per agent on average.
    """

    STEPS, LEAVES_AT = 8, 4
    OPTIMUM = (2 * STEPS + LEAVES_AT) / 3
    metadata = {"name": "name_your_seat_v0"}

    def __init__(self, **kwargs):
        self.possible_agents = ["agent_0", "agent_1", "agent_2"]
        self.agents: list[str] = []
        self._space = gym.spaces.Box(0.0, 1.0, (2,), np.float32)
        self._actions = gym.spaces.Discrete(3)
        self._rng = np.random.default_rng()
        self._t = 0

    def observation_space(self, agent):
        return self._space

    def action_space(self, agent):
        return self._actions

    def _obs(self):
        return {a: np.array([1.0, float(self._rng.integers(2))], np.float32) for a in self.agents}

    def reset(self, seed=None, options=None):
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self.agents = list(self.possible_agents)
        self._t = 0
        return self._obs(), {a: {} for a in self.agents}

    def step(self, actions):
        self._t += 1
        rewards = {a: float(int(actions[a]) == self.possible_agents.index(a)) for a in self.agents}
        terminated = {a: (a == "agent_2" and self._t >= self.LEAVES_AT) or self._t >= self.STEPS for a in self.agents}
        truncated = {a: False for a in self.agents}
        obs = self._obs()
        self.agents = [a for a in self.agents if not terminated[a]]
        return obs, rewards, terminated, truncated, {a: {} for a in rewards}

    def close(self):
        pass


class name_your_seat:  # noqa: N801 - named like a PettingZoo env module (connect_four_v3, ...)
    parallel_env = NameYourSeat
