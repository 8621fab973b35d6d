"""RolloutSampler: a vector env plus a CPU policy copy that emits fragments.

Plain class, no Ray: the actor shell in ``rollout.py`` drives it, tests drive
it directly.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from actors.envs import action_bounds, make_vector_env
from actors.gae import compute_gae
from pipeline import fragment as F
from pipeline.timing import Stopwatch


class RolloutSampler:
    def __init__(
        self,
        *,
        env_id: str,
        num_envs: int,
        fragment_length: int,
        policy_factory: Callable[[], torch.nn.Module],
        gamma: float,
        gae_lambda: float,
        seed: int,
        actor_id: int = 0,
        max_episode_steps: int | None = None,
        env_kwargs: dict | None = None,
    ):
        self.actor_id = actor_id
        self.num_envs = num_envs
        self.T = fragment_length
        self.gamma, self.gae_lambda = gamma, gae_lambda
        self.env = make_vector_env(env_id, num_envs, max_episode_steps, env_kwargs)
        self.bounds = action_bounds(self.env)
        self.policy = policy_factory()
        self.policy.eval()
        self.policy_version = -1  # no weights loaded yet
        self.generator = torch.Generator().manual_seed(seed * 7919 + actor_id)
        # uint8 Box observations (images) stay uint8: 4x fewer bytes through the fragment, the object store and the
        # host-device copy; the model converts to float at its input. Every other Box dtype becomes float32.
        uint8_obs = self.env.single_observation_space.dtype == np.uint8
        self.obs_dtype = np.dtype(np.uint8 if uint8_obs else np.float32)
        # Distinct, reproducible env seeds per actor.
        self.obs, _ = self.env.reset(seed=seed * 100_003 + actor_id * num_envs)
        self.obs = np.asarray(self.obs, dtype=self.obs_dtype)
        self.ep_return = np.zeros(num_envs, dtype=np.float64)
        self.ep_length = np.zeros(num_envs, dtype=np.int64)
        self.env_steps = 0
        self.sample_seconds = 0.0

    def load_weights(self, version: int, state: dict[str, np.ndarray]) -> None:
        # torch.tensor copies: the arrays are read-only views of the object store (and small).
        self.policy.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
        self.policy_version = version

    def collect(self) -> F.Fragment:
        """Step all envs ``T`` times with the current policy; one fragment out."""
        if self.policy_version < 0:
            raise RuntimeError("RolloutSampler.collect() called before load_weights()")
        with Stopwatch() as sw:
            fragment = self._collect()
        self.sample_seconds += sw.s
        return fragment

    def _collect(self) -> F.Fragment:
        T, N = self.T, self.num_envs
        obs_buf = np.empty((T, N) + self.obs.shape[1:], dtype=self.obs_dtype)
        act_shape = (T, N) + self.env.single_action_space.shape
        actions = np.empty(act_shape, dtype=np.int64 if self.bounds is None else np.float32)
        logp = np.empty((T, N), dtype=np.float32)
        values = np.empty((T, N), dtype=np.float32)
        rewards = np.empty((T, N), dtype=np.float32)
        terminated = np.empty((T, N), dtype=bool)
        truncated = np.empty((T, N), dtype=bool)
        final_values = np.zeros((T, N), dtype=np.float32)
        finished_returns: list[float] = []
        finished_lengths: list[int] = []

        for t in range(T):
            obs_buf[t] = self.obs
            a, lp, v = self.policy.act(torch.from_numpy(self.obs), generator=self.generator)
            a = a.numpy()
            actions[t], logp[t], values[t] = a, lp.numpy(), v.numpy()
            env_action = a if self.bounds is None else np.clip(a, *self.bounds)
            obs, rew, term, trunc, info = self.env.step(env_action)
            rewards[t], terminated[t], truncated[t] = rew, term, trunc

            self.ep_return += rew
            self.ep_length += 1
            done = term | trunc
            if done.any():
                boot = trunc & ~term
                if boot.any():
                    # Time-limit ends bootstrap from V(final obs); SAME_STEP autoreset keeps it in info.
                    idx = np.flatnonzero(boot)
                    final_obs = np.stack([np.asarray(info["final_obs"][i], dtype=self.obs_dtype) for i in idx])
                    with torch.inference_mode():
                        final_values[t, idx] = self.policy.value(torch.from_numpy(final_obs)).numpy()
                for i in np.flatnonzero(done):
                    finished_returns.append(float(self.ep_return[i]))
                    finished_lengths.append(int(self.ep_length[i]))
                self.ep_return[done] = 0.0
                self.ep_length[done] = 0
            self.obs = np.asarray(obs, dtype=self.obs_dtype)

        with torch.inference_mode():
            last_values = self.policy.value(torch.from_numpy(self.obs)).numpy()
        fragment = assemble_fragment(
            {F.OBS_STATE: obs_buf},
            dict(actions=actions, logp=logp, values=values, rewards=rewards, terminated=terminated,
                 truncated=truncated, final_values=final_values),
            last_values, self.gamma, self.gae_lambda, self.policy_version, self.actor_id,
            finished_returns, finished_lengths)
        self.env_steps += T * N
        return fragment

    def close(self) -> None:
        self.env.close()


def assemble_fragment(observations: dict[str, np.ndarray], steps: dict[str, np.ndarray], last_values: np.ndarray,
                      gamma: float, gae_lambda: float, policy_version: int, actor_id: int,
                      finished_returns: list[float], finished_lengths: list[int]) -> F.Fragment:
    """GAE on the rollout host, then the fragment contract; shared by both samplers.

    ``observations``: fragment keys (``obs/...``, ``obs_src/...``) -> (T, N, ...) arrays. ``steps``: (T, N) arrays
    ``actions``, ``logp``, ``values``, ``rewards``, ``terminated``, ``truncated``, ``final_values`` (V of the
    final observation where a time limit cut an episode).
    """
    advantages, returns = compute_gae(steps["rewards"], steps["values"], steps["terminated"], steps["truncated"],
                                      steps["final_values"], last_values, gamma, gae_lambda)
    arrays = dict(observations)
    arrays.update({
        F.ACTIONS: steps["actions"], F.LOGP: steps["logp"], F.VALUES: steps["values"], F.REWARDS: steps["rewards"],
        F.TERMINATED: steps["terminated"], F.TRUNCATED: steps["truncated"],
        F.ADVANTAGES: advantages, F.RETURNS: returns,
    })
    return F.Fragment(
        arrays=arrays,
        policy_version=policy_version,
        actor_id=actor_id,
        episode_returns=np.asarray(finished_returns, dtype=np.float64),
        episode_lengths=np.asarray(finished_lengths, dtype=np.int64),
    )
