"""Continuous-control normalisation: env.normalize_obs (model statistics) and env.normalize_reward (return scaling).

Checked against gymnasium's own RunningMeanStd, on real envs through the real sampler.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from gymnasium.wrappers.utils import RunningMeanStd

from actors.envs import describe_env
from actors.sampler import ReturnScaler, RolloutSampler, SamplerSettings
from learner.model import ActorCritic, state_dict_numpy
from pipeline import fragment as F
from tests.conftest import env_spec


def test_normalize_obs_defaults_on_for_continuous_actions_only():
    def normalized(env_id, setting=None):
        (mod,) = describe_env(env_id, normalize_obs=setting)["modalities"]
        return mod["normalize"]

    assert normalized("Pendulum-v1") is True and normalized("Pendulum-v1", False) is False
    assert normalized("CartPole-v1") is False and normalized("CartPole-v1", True) is True
    # The model then carries the statistics as buffers: they travel with the weights to the actors.
    model = ActorCritic(env_spec("Pendulum-v1"))
    assert {"encoders.vector.running_mean", "encoders.vector.running_var"} <= set(model.state_dict())


def test_return_scaler_matches_gymnasiums_running_statistics():
    rng = np.random.default_rng(0)
    gamma, n = 0.9, 3
    scaler, reference, returns = ReturnScaler(n, gamma), RunningMeanStd(shape=()), np.zeros(n)
    for t in range(50):
        rewards = rng.normal(2.0, 3.0, n).astype(np.float32)
        done = rng.random(n) < 0.1
        out = scaler(rewards, done)
        returns = returns * gamma + rewards
        reference.update(returns)
        expected = np.clip(rewards / np.sqrt(reference.var + 1e-8), -10, 10)
        np.testing.assert_allclose(out, expected, rtol=1e-5)
        returns[done] = 0.0


def test_sampler_trains_on_scaled_rewards_and_reports_raw_returns():
    spec = env_spec("Pendulum-v1")
    torch.manual_seed(0)
    weights = state_dict_numpy(ActorCritic(spec))

    def collect(normalize_reward):
        s = RolloutSampler(SamplerSettings(env_id="Pendulum-v1", num_envs=2, fragment_length=250, gamma=0.99,
                                           gae_lambda=0.95, seed=0, normalize_reward=normalize_reward),
                           functools.partial(ActorCritic, spec))
        s.load_weights(0, weights)
        try:
            return s.collect()
        finally:
            s.close()

    raw, scaled = collect(False), collect(True)
    np.testing.assert_array_equal(raw.arrays[F.ACTIONS], scaled.arrays[F.ACTIONS])  # same episodes
    scaler = ReturnScaler(2, 0.99)
    done = raw.arrays[F.TERMINATED] | raw.arrays[F.TRUNCATED]
    expected = np.stack([scaler(r, d) for r, d in zip(raw.arrays[F.REWARDS], done)])
    np.testing.assert_allclose(scaled.arrays[F.REWARDS], expected, rtol=1e-6)
    assert np.abs(scaled.arrays[F.REWARDS]).mean() < 0.5 * np.abs(raw.arrays[F.REWARDS]).mean()
    # Pendulum's 200-step episodes end inside the fragment; their returns are the env's own.
    assert len(raw.episode_returns) == 2
    np.testing.assert_array_equal(raw.episode_returns, scaled.episode_returns)
