"""``env.backend: envpool``: EnvPool's C++ vectorised envs behind the rollouts' own env interface.

EnvPool steps a whole batch of envs in one call on its own threads (Atari with its built-in preprocessing, MuJoCo,
classic control), where the gymnasium backend steps N Python envs in turn. Two things differ from what the sampler
expects, and both are made to match here, so fragments, truncation bootstrapping and episode accounting are the
gymnasium path's:

- **Autoreset.** EnvPool resets an env on the step *after* its episode ended (gymnasium's NEXT_STEP: that step
  ignores its action and returns the first observation with reward 0). The sampler's envs reset in the *same* step
  (``actors.envs.VectorEnv``: the next episode's first observation, the final one kept apart), so every transition
  in a fragment is a real one. So after a step in which envs ended, those envs alone are stepped once more at once
  (EnvPool steps a subset by ``env_id``): that is their reset, and its observation is the one returned.
- **Image layout.** EnvPool's Atari frames are channels-first, (stack, 84, 84) uint8; the model's image encoder
  takes H x W x C (``actors.envs.box_modality``), so they are transposed to (84, 84, stack).

Seeding: EnvPool seeds env i with ``seed + i`` when the pool is made, as gymnasium's vector envs do, so the pool is
(re)made by ``reset(seed)``.
"""

from __future__ import annotations

import difflib

import gymnasium as gym
import numpy as np

EXTRA = "envpool"  # pip install -e '.[envpool]'


def _envpool():
    try:
        import envpool
    except ImportError:
        raise ValueError(f"env.backend: envpool needs the envpool package, which is not installed; install the "
                         f"extra: pip install -e '.[{EXTRA}]'") from None
    return envpool


def check_task(env_id: str) -> None:
    """A ValueError naming the closest EnvPool ids when EnvPool has no ``env_id``."""
    envpool = _envpool()
    known = envpool.list_all_envs()
    if env_id not in known:
        close = difflib.get_close_matches(env_id, known, n=3, cutoff=0.5)
        raise ValueError(f"env.id: {env_id!r} is not an EnvPool task (env.backend: envpool); "
                         f"closest: {', '.join(close) if close else 'none'} (envpool.list_all_envs() has them all)")


def _channels_first(space) -> bool:
    """EnvPool's image observations: (C, H, W) uint8 with a few channels (Atari: 4 stacked grey frames)."""
    return (isinstance(space, gym.spaces.Box) and len(space.shape) == 3 and space.dtype == np.uint8
            and space.shape[0] < space.shape[1] and space.shape[0] < space.shape[2])


def _hwc(space: gym.spaces.Box) -> gym.spaces.Box:
    return gym.spaces.Box(low=np.moveaxis(space.low, 0, -1), high=np.moveaxis(space.high, 0, -1), dtype=space.dtype)


class EnvPoolVectorEnv:
    """N envs of one EnvPool pool with the interface and SAME_STEP autoreset of ``actors.envs.VectorEnv``."""

    dead = None  # no filler slots (single-agent)
    envs = ()  # no per-env Python objects (a turn-based game's seats are looked for there)

    def __init__(self, env_id: str, num_envs: int, max_episode_steps: int | None = None,
                 env_kwargs: dict | None = None):
        check_task(env_id)
        self.env_id, self.num_envs = env_id, num_envs
        self.kwargs = dict(env_kwargs or {})
        if max_episode_steps is not None:
            self.kwargs["max_episode_steps"] = max_episode_steps
        self.pool, self.seed = None, 0
        self._make(seed=0)
        space = self.pool.observation_space
        self._transpose = _channels_first(space)
        self.single_observation_space = _hwc(space) if self._transpose else space
        self.single_action_space = self.pool.action_space
        self.episode_step = np.zeros(num_envs, dtype=np.int64)
        self.episode = np.zeros(num_envs, dtype=np.int64)
        self._dummy = np.stack([self.single_action_space.sample() for _ in range(num_envs)])

    def _make(self, seed: int) -> None:
        self.seed = seed
        if self.pool is not None:
            self.pool.close()
        try:
            self.pool = _envpool().make(self.env_id, env_type="gymnasium", num_envs=self.num_envs, seed=seed,
                                        **self.kwargs)
        except (TypeError, ValueError, RuntimeError) as e:  # an option this task does not have, or a bad value
            raise ValueError(f"env.kwargs: {self.kwargs!r} rejected by EnvPool's {self.env_id!r} "
                             f"({type(e).__name__}: {e})") from None

    def _obs(self, obs: np.ndarray) -> np.ndarray:
        """Our own copy (a later call into the pool must not change what a step returned), HWC for images."""
        return np.ascontiguousarray(np.moveaxis(obs, 1, -1)) if self._transpose else np.array(obs)

    def reset(self, seed: int | None = None):
        """Env i seeded ``seed + i`` (EnvPool's rule, and gymnasium's vector envs'): the pool is made again for a
        new seed; without one, its envs start new episodes."""
        if seed is not None and seed != self.seed:
            self._make(seed)
        self.episode_step[:] = 0
        obs, _ = self.pool.reset()
        return self._obs(obs)

    def reset_one(self, i: int):
        """Abandon env ``i``'s episode and start a new one."""
        self.episode[i] += 1
        self.episode_step[i] = 0
        obs, _ = self.pool.reset(np.array([i]))
        return self._obs(obs)[0]

    def step(self, actions):
        """-> (observations, rewards, terminated, truncated, final observations {env: obs} of ended episodes)."""
        obs, rew, term, trunc, info = self.pool.step(np.asarray(actions), np.arange(self.num_envs))
        order = np.asarray(info["env_id"])
        if not np.array_equal(order, np.arange(self.num_envs)):  # sync mode answers in order; say so if not
            raise RuntimeError(f"EnvPool answered envs {order.tolist()} for a step of all {self.num_envs} in order")
        obs = self._obs(obs)
        ended = np.flatnonzero(term | trunc)
        finals = {int(i): obs[i].copy() for i in ended}
        if ended.size:
            # Their reset step, now (EnvPool would make it on the next call, ignoring that call's action).
            first, _, _, _, _ = self.pool.step(self._dummy[ended], ended)
            obs[ended] = self._obs(first)
            self.episode[ended] += 1
            self.episode_step[ended] = 0
        rest = np.ones(self.num_envs, dtype=bool)
        rest[ended] = False
        self.episode_step[rest] += 1
        return obs, np.asarray(rew, dtype=np.float32), np.asarray(term, bool), np.asarray(trunc, bool), finals

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


class EnvPoolEnv(gym.Env):
    """One EnvPool env as a gymnasium ``Env`` (what describing the env, evaluation and ``load_policy`` make): a pool
    of one, stepped and reset by its caller."""

    metadata = {"render_modes": []}

    def __init__(self, env_id: str, max_episode_steps: int | None = None, env_kwargs: dict | None = None):
        self.vec = EnvPoolVectorEnv(env_id, 1, max_episode_steps, env_kwargs)
        self.observation_space = self.vec.single_observation_space
        self.action_space = self.vec.single_action_space

    def reset(self, *, seed: int | None = None, options=None):
        return self.vec.reset(seed)[0], {}

    def step(self, action):
        obs, rew, term, trunc, finals = self.vec.step(np.asarray([action]))
        # The caller resets after an ended episode: hand it the final observation, not the next episode's first.
        return (finals[0] if 0 in finals else obs[0]), float(rew[0]), bool(term[0]), bool(trunc[0]), {}

    def close(self):
        self.vec.close()
