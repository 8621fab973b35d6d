"""Vector environment construction."""

from __future__ import annotations

from typing import Mapping

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from pipeline.contract import MODEL_SETTINGS, specs_from  # standard library only


def make_vector_env(env_id: str, num_envs: int, max_episode_steps: int | None = None, env_kwargs: dict | None = None):
    """A synchronous vector env with SAME_STEP autoreset.

    SAME_STEP returns the first observation of the next episode in the same
    ``step`` call and puts the true final observation in ``info["final_obs"]``,
    so every transition in a fragment is a real one (no masked dummy steps)
    and truncated episodes can bootstrap from their final observation.
    """
    kwargs = dict(env_kwargs or {})
    if max_episode_steps is not None:
        kwargs["max_episode_steps"] = max_episode_steps
    return gym.make_vec(
        env_id,
        num_envs=num_envs,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP},
        **kwargs,
    )


def _make(env_id: str, max_episode_steps: int | None, env_kwargs: dict | None):
    kwargs = dict(env_kwargs or {})
    if max_episode_steps is not None:
        kwargs["max_episode_steps"] = max_episode_steps
    return gym.make(env_id, **kwargs)


class ModalVectorEnv:
    """N Dict-observation envs stepped in turn, with SAME_STEP autoreset, handing out raw per-env observations.

    Not gymnasium's SyncVectorEnv: the pipeline preprocesses per env and per modality anyway, and raw values
    such as encoded image bytes or mission strings have nothing to gain from being batched into arrays first.
    It also tracks, per env, the episode step of the current observation (which slow modalities are due) and
    an episode number (so the aligner never hands one episode another episode's values).
    """

    def __init__(self, env_id: str, num_envs: int, max_episode_steps: int | None = None,
                 env_kwargs: dict | None = None):
        self.envs = [_make(env_id, max_episode_steps, env_kwargs) for _ in range(num_envs)]
        self.num_envs = num_envs
        self.single_observation_space = self.envs[0].observation_space
        self.single_action_space = self.envs[0].action_space
        self.episode_step = np.zeros(num_envs, dtype=np.int64)
        self.episode = np.zeros(num_envs, dtype=np.int64)

    def reset(self, seed: int) -> list[dict]:
        self.episode_step[:] = 0
        return [env.reset(seed=seed + i)[0] for i, env in enumerate(self.envs)]

    def reset_one(self, i: int) -> dict:
        """Abandon env ``i``'s episode and start a new one."""
        self.episode[i] += 1
        self.episode_step[i] = 0
        return self.envs[i].reset()[0]

    def step(self, actions: np.ndarray):
        """-> (observations, rewards, terminated, truncated, final observations {env: raw} of ended episodes)."""
        n = self.num_envs
        observations: list[dict] = [None] * n  # type: ignore[list-item]
        rewards = np.empty(n, dtype=np.float32)
        terminated = np.empty(n, dtype=bool)
        truncated = np.empty(n, dtype=bool)
        finals: dict[int, dict] = {}
        for i, env in enumerate(self.envs):
            obs, rew, term, trunc, _ = env.step(actions[i])
            rewards[i], terminated[i], truncated[i] = rew, term, trunc
            if term or trunc:
                finals[i] = obs
                obs, _ = env.reset()
                self.episode[i] += 1
                self.episode_step[i] = 0
            else:
                self.episode_step[i] += 1
            observations[i] = obs
        return observations, rewards, terminated, truncated, finals

    def close(self) -> None:
        for env in self.envs:
            env.close()


def _action_facts(env_id: str, act_space) -> tuple[str, int]:
    if isinstance(act_space, gym.spaces.Discrete):
        return "discrete", int(act_space.n)
    if isinstance(act_space, gym.spaces.Box) and len(act_space.shape) == 1:
        return "continuous", int(act_space.shape[0])
    raise ValueError(f"env.id: {env_id!r} has action space {act_space}; allowed are Discrete and 1-D Box")


def describe_modalities(env_id: str, specs: list, max_episode_steps: int | None = None,
                        env_kwargs: dict | None = None) -> dict:
    """Dict-observation env: per modality what its preprocessed value looks like, plus the action facts.

    Plain data (it travels to learner actors): {"modalities": [{name, shape, dtype, vocab_size, and the spec
    settings the model reads (pipeline.contract.MODEL_SETTINGS)}], "action_kind", "action_dim"}.
    """
    from pipeline.modality import make_processor  # cv2 and friends only load for multimodal runs

    env = _make(env_id, max_episode_steps, env_kwargs)
    try:
        obs_space = env.observation_space
        if not isinstance(obs_space, gym.spaces.Dict):
            raise ValueError(f"env.modalities: set, but env.id {env_id!r} has observation space {obs_space}, not a "
                             f"Dict; allowed: env.modalities only for Dict observations (leave it empty)")
        unknown = [s.name for s in specs if s.name not in obs_space.spaces]
        if unknown:
            raise ValueError(f"env.modalities.{unknown[0]}: {env_id!r} has no observation key {unknown[0]!r}; "
                             f"allowed: {', '.join(obs_space.spaces)}")
        modalities = []
        for spec in specs:
            proc = make_processor(spec, obs_space[spec.name])
            modalities.append({
                "name": spec.name, "shape": tuple(int(d) for d in proc.out_shape),
                "dtype": np.dtype(proc.out_dtype).name, "vocab_size": int(getattr(proc, "vocab_size", 0)),
                **{setting: getattr(spec, setting) for setting in MODEL_SETTINGS},
            })
        action_kind, action_dim = _action_facts(env_id, env.action_space)
        return {"modalities": modalities, "action_kind": action_kind, "action_dim": action_dim}
    finally:
        env.close()


def describe_spaces(env_id: str, max_episode_steps: int | None = None, env_kwargs: dict | None = None) -> dict:
    """Observation/action space facts, read from one throwaway env."""
    env = _make(env_id, max_episode_steps, env_kwargs)
    try:
        obs_space, act_space = env.observation_space, env.action_space
        if isinstance(obs_space, gym.spaces.Dict):
            raise ValueError(
                f"env.modalities: empty, but env.id {env_id!r} has Dict observations ({', '.join(obs_space.spaces)}); "
                f"allowed: one env.modalities entry per key to use (see docs/multimodal.md)")
        if not isinstance(obs_space, gym.spaces.Box):
            raise ValueError(
                f"env.id: {env_id!r} has observation space {obs_space}; only Box observations are supported"
            )
        action_kind, action_dim = _action_facts(env_id, act_space)
        return {
            "obs_shape": tuple(int(d) for d in obs_space.shape),
            "action_kind": action_kind,
            "action_dim": action_dim,
        }
    finally:
        env.close()


def describe_env(env_id: str, modalities: Mapping | None = None,
                 max_episode_steps: int | None = None) -> dict:
    """The config's env checked against one throwaway env: ``describe_modalities`` output when ``modalities``
    (env.modalities: key -> spec object, or its plain data ``{kind: ..., ...}``) is non-empty, else
    ``describe_spaces`` output.

    Every problem is a one-line ``cluster.config.ConfigError``: an env that cannot be made (unknown id, a
    ``module:Id`` whose module does not import, bad kwargs) names env.id and the exception; a space or modality
    mismatch names the key and what is allowed. Needs neither Ray nor torch: the driver (``Trainer.build``) and
    ``python -m cluster.train --dry-run`` both call it.
    """
    from cluster.config import ConfigError  # a cheap import (yaml only); kept local so actors/ loads without it

    try:
        if modalities:
            return describe_modalities(env_id, specs_from(modalities), max_episode_steps)
        return describe_spaces(env_id, max_episode_steps)
    except (gym.error.Error, ImportError) as e:  # unknown id, missing module, bad kwargs
        raise ConfigError(f"env.id: {env_id!r} cannot be made ({type(e).__name__}: {e})") from None
    except ValueError as e:  # space/spec mismatches: the message names the key and what is allowed
        raise ConfigError(str(e)) from None


def action_bounds(env) -> tuple[np.ndarray, np.ndarray] | None:
    return action_bounds_of(env.single_action_space)


def action_bounds_of(space) -> tuple[np.ndarray, np.ndarray] | None:
    if isinstance(space, gym.spaces.Box):
        return space.low.astype(np.float32), space.high.astype(np.float32)
    return None
