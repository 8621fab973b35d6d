"""Vector environment construction."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode


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


def describe_spaces(env_id: str, max_episode_steps: int | None = None, env_kwargs: dict | None = None) -> dict:
    """Observation/action space facts, read from one throwaway env."""
    kwargs = dict(env_kwargs or {})
    if max_episode_steps is not None:
        kwargs["max_episode_steps"] = max_episode_steps
    env = gym.make(env_id, **kwargs)
    try:
        obs_space, act_space = env.observation_space, env.action_space
        if not isinstance(obs_space, gym.spaces.Box):
            raise ValueError(
                f"env.id: {env_id!r} has observation space {obs_space}; only Box observations are supported"
            )
        if isinstance(act_space, gym.spaces.Discrete):
            action_kind, action_dim = "discrete", int(act_space.n)
        elif isinstance(act_space, gym.spaces.Box) and len(act_space.shape) == 1:
            action_kind, action_dim = "continuous", int(act_space.shape[0])
        else:
            raise ValueError(
                f"env.id: {env_id!r} has action space {act_space}; allowed are Discrete and 1-D Box"
            )
        return {
            "obs_shape": tuple(int(d) for d in obs_space.shape),
            "action_kind": action_kind,
            "action_dim": action_dim,
        }
    finally:
        env.close()


def action_bounds(env) -> tuple[np.ndarray, np.ndarray] | None:
    space = env.single_action_space
    if isinstance(space, gym.spaces.Box):
        return space.low.astype(np.float32), space.high.astype(np.float32)
    return None
