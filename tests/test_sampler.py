"""RolloutSampler on real gymnasium envs (no Ray)."""

import functools

import numpy as np
import torch

from actors.sampler import RolloutSampler, SamplerSettings
from learner.model import ActorCritic, PolicySpec, state_dict_numpy
from pipeline import fragment as F
from tests.conftest import env_spec

OBS = F.obs_key("vector")


def constant_value_policy(spec: PolicySpec, c: float) -> dict:
    """Weights whose critic outputs exactly ``c`` everywhere (last layer zero, bias c)."""
    torch.manual_seed(0)
    model = ActorCritic(spec)
    with torch.no_grad():
        model.critic[-1].weight.zero_()
        model.critic[-1].bias.fill_(c)
    return state_dict_numpy(model)


def make_sampler(env_id, num_envs, T, max_episode_steps=None, gamma=0.9, lam=0.5, seed=0):
    spec = env_spec(env_id, max_episode_steps)
    s = RolloutSampler(SamplerSettings(env_id=env_id, num_envs=num_envs, fragment_length=T, gamma=gamma, gae_lambda=lam,
                                       seed=seed, max_episode_steps=max_episode_steps),
                       functools.partial(ActorCritic, spec))
    return s, spec


def test_fragment_shapes_dtypes_and_keys():
    s, spec = make_sampler("CartPole-v1", num_envs=3, T=7)
    torch.manual_seed(0)
    s.load_weights(5, state_dict_numpy(ActorCritic(spec)))
    frag = s.collect()
    assert frag.policy_version == 5 and frag.num_samples == 21
    assert frag.arrays[OBS].shape == (7, 3, 4) and frag.arrays[OBS].dtype == np.float32
    assert frag.arrays[F.ACTIONS].dtype == np.int64
    for k in F.ALL_KEYS:
        assert frag.arrays[k].shape[:2] == (7, 3), k
    np.testing.assert_allclose(frag.arrays[F.RETURNS], frag.arrays[F.ADVANTAGES] + frag.arrays[F.VALUES], rtol=1e-6)
    assert s.env_steps == 21


def test_truncation_bootstraps_and_termination_does_not():
    """With V == c everywhere: a truncated step's advantage is r + gamma*c - c, a terminated one's r - c."""
    c, gamma = 2.0, 0.9
    s, spec = make_sampler("CartPole-v1", num_envs=8, T=40, max_episode_steps=6, gamma=gamma, lam=0.5)
    s.load_weights(0, constant_value_policy(spec, c))
    frag = s.collect()
    term, trunc = frag.arrays[F.TERMINATED], frag.arrays[F.TRUNCATED]
    adv, rew = frag.arrays[F.ADVANTAGES], frag.arrays[F.REWARDS]
    assert trunc.sum() > 0
    assert np.allclose(adv[trunc & ~term], rew[trunc & ~term] + gamma * c - c)
    if term.any():
        assert np.allclose(adv[term], rew[term] - c)
    # Episodes never exceed the time limit and every finished one is reported.
    assert frag.episode_lengths.max() <= 6
    assert len(frag.episode_lengths) == int((term | trunc).sum())


def test_continuous_actions_are_stored_unclipped_with_their_logp():
    s, spec = make_sampler("Pendulum-v1", num_envs=2, T=5)
    torch.manual_seed(0)
    model = ActorCritic(spec)
    with torch.no_grad():
        model.actor_logstd.fill_(1.5)  # wide enough that some samples leave [-2, 2]
    s.load_weights(0, state_dict_numpy(model))
    frag = s.collect()
    a = frag.arrays[F.ACTIONS]
    assert a.shape == (5, 2, 1) and a.dtype == np.float32
    assert np.abs(a).max() > 2.0, "stored actions must be the sampled ones, not the env-clipped ones"
    logp, _, _ = model.evaluate({"vector": torch.from_numpy(frag.flat(OBS))}, torch.from_numpy(frag.flat(F.ACTIONS)))
    np.testing.assert_allclose(logp.detach().numpy(), frag.flat(F.LOGP), rtol=1e-4, atol=1e-5)


def test_collect_before_weights_is_an_error():
    s, _ = make_sampler("CartPole-v1", num_envs=1, T=2)
    try:
        s.collect()
    except RuntimeError as e:
        assert "load_weights" in str(e)
    else:
        raise AssertionError("collect() without weights must fail")
