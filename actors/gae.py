"""Generalised advantage estimation over one fragment (pure numpy).

Truncation (a time limit) is not a terminal state: the episode would have gone
on, so its last transition bootstraps from the value of the final observation.
Termination bootstraps from zero. In both cases nothing flows across the
episode boundary into the previous step's advantage.
"""

from __future__ import annotations

import numpy as np


def compute_gae(
    rewards: np.ndarray,
    values: np.ndarray,
    terminated: np.ndarray,
    truncated: np.ndarray,
    final_values: np.ndarray,
    last_values: np.ndarray,
    gamma: float,
    gae_lambda: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Advantages and returns, both ``(T, N)`` float32.

    rewards, values, terminated, truncated: ``(T, N)``; ``values[t]`` is V(s_t).
    final_values: ``(T, N)``, V(final observation) where ``truncated`` (ignored elsewhere).
    last_values: ``(N,)``, V(s_T), the observation after the fragment's last step.
    """
    # Boolean flags are required: ``~`` on integer flags would be bitwise (~1 == -2).
    terminated = np.asarray(terminated, dtype=bool)
    truncated = np.asarray(truncated, dtype=bool)
    T = rewards.shape[0]
    advantages = np.zeros(rewards.shape, dtype=np.float32)
    last_gae = np.zeros(rewards.shape[1:], dtype=np.float32)
    for t in reversed(range(T)):
        next_values = last_values if t == T - 1 else values[t + 1]
        done = terminated[t] | truncated[t]
        # Value of what follows s_t: 0 if terminated, V(final obs) if truncated, else V(s_{t+1}).
        bootstrap = np.where(terminated[t], 0.0, np.where(truncated[t], final_values[t], next_values))
        delta = rewards[t] + gamma * bootstrap - values[t]
        last_gae = delta + gamma * gae_lambda * (~done) * last_gae
        advantages[t] = last_gae
    returns = advantages + values.astype(np.float32)
    return advantages, returns
