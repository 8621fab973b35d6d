"""Audit defects of the sampler (Box and Dict envs), each pinned by a test on real envs and real torch models.

(a) ``on_corrupt: drop_episode`` for Dict envs: a corrupt final frame of a truncated episode and a corrupt
    first reset observation.
(e) Truncation bootstrap with a critic that depends on the observation, for Box and Dict envs: the truncated step's
    advantage must use V(final obs), not V(the next episode's reset obs).
(i) uint8 Box observations stay uint8 in ``RolloutSampler``'s fragments, and the learner trains on them.
"""

from __future__ import annotations

import functools

import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.multirate_env import ENV_ID, MODALITIES
from actors.sampler import RolloutSampler, SamplerSettings
from learner.learner import Learner, LearnerSettings
from learner.model import ActorCritic, PolicySpec, state_dict_numpy
from learner.ppo import LossCoefs
from pipeline import fragment as F
from pipeline.modality import CorruptObservation

from misbehaving_env import MISBEHAVING_ID, UINT8_CARTPOLE_ID
from tests.conftest import env_spec

OBS = F.obs_key("vector")

GAMMA, LAM = 0.9, 0.8


# --------------------------------------------------------------------------------------------------------------
# helpers


def modal_spec(camera_policy: str = "fail"):
    modalities = {name: dict(d) for name, d in MODALITIES.items()}
    modalities["camera"]["on_corrupt"] = camera_policy
    return modalities, env_spec(ENV_ID, hidden_sizes=(64,), modalities=modalities)


def make_modal_sampler(env_id=MISBEHAVING_ID, env_kwargs=None, camera_policy="fail", num_envs=3, T=16,
                       max_episode_steps=None, state=None, seed=1):
    modalities, spec = modal_spec(camera_policy)
    sampler = RolloutSampler(SamplerSettings(env_id=env_id, env_kwargs=env_kwargs, num_envs=num_envs, fragment_length=T,
                                             gamma=GAMMA, gae_lambda=LAM, seed=seed, modalities=modalities,
                                             preprocess_workers=1, max_episode_steps=max_episode_steps),
                             lambda: ActorCritic(spec))
    if state is None:
        torch.manual_seed(0)
        state = state_dict_numpy(ActorCritic(spec))
    sampler.load_weights(0, state)
    return sampler


def camera_frames_are_real(frag) -> bool:
    """Every image an action was taken on shows the agent's white pixels (a zeroed corrupt frame does not)."""
    camera = frag.arrays[F.obs_key("camera")]
    return bool((camera.reshape(camera.shape[0] * camera.shape[1], -1).max(axis=1) == 255).all())


# --------------------------------------------------------------------------------------------------------------
# (a) drop_episode


def test_corrupt_final_frame_of_a_truncated_episode_is_dropped_and_bootstraps_from_the_last_good_value():
    """Every time-limit end (step 3) has a corrupt final camera frame; no action ever sees it, only the bootstrap."""
    sampler = make_modal_sampler(env_kwargs={"corrupt_at_episode_step": 3}, camera_policy="drop_episode",
                                 max_episode_steps=3, T=24)
    try:
        frag = sampler.collect()
        dropped = sampler.episodes_dropped
    finally:
        sampler.close()
    term, trunc = frag.arrays[F.TERMINATED], frag.arrays[F.TRUNCATED]
    cut = trunc & ~term
    assert cut.sum() >= 5, "the test needs time-limit ends"
    assert dropped == int(cut.sum())
    # Dropped episodes are not reported; the terminated ones are.
    assert len(frag.episode_returns) == int(term.sum())
    # Bootstrap = V of the last good observation (the one acted on at the truncated step).
    adv, ret = frag.arrays[F.ADVANTAGES], frag.arrays[F.RETURNS]
    rew, val = frag.arrays[F.REWARDS], frag.arrays[F.VALUES]
    np.testing.assert_allclose(adv[cut], rew[cut] + GAMMA * val[cut] - val[cut], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret[cut], adv[cut] + val[cut], rtol=1e-5, atol=1e-5)
    assert camera_frames_are_real(frag)


def test_corrupt_final_frame_of_a_truncated_episode_under_fail_raises_naming_the_modality():
    sampler = make_modal_sampler(env_kwargs={"corrupt_at_episode_step": 3}, camera_policy="fail",
                                 max_episode_steps=3, T=24)
    try:
        with pytest.raises(CorruptObservation, match="'camera'"):
            sampler.collect()
    finally:
        sampler.close()


def test_corrupt_first_reset_observation_is_dropped_in_the_constructor():
    """The first observation of every env is corrupt: each env starts a fresh episode, counted, before any action."""
    sampler = make_modal_sampler(env_kwargs={"corrupt_calls": (1,)}, camera_policy="drop_episode")
    try:
        assert sampler.episodes_dropped == 3
        assert sampler.pipeline_stats()["corrupt_inputs"] == 3
        assert (sampler.env.episode == 1).all()
        frag = sampler.collect()
    finally:
        sampler.close()
    assert camera_frames_are_real(frag)
    assert np.isfinite(frag.arrays[F.ADVANTAGES]).all()


def test_corrupt_first_reset_observation_under_fail_raises():
    modalities, spec = modal_spec("fail")
    with pytest.raises(CorruptObservation, match="'camera'"):
        RolloutSampler(SamplerSettings(env_id=MISBEHAVING_ID, env_kwargs={"corrupt_calls": (1,)}, num_envs=2,
                                       fragment_length=4, gamma=GAMMA, gae_lambda=LAM, seed=1, modalities=modalities,
                                       preprocess_workers=1), lambda: ActorCritic(spec))


# --------------------------------------------------------------------------------------------------------------
# (e) truncation bootstrap with an observation-dependent critic


def velocity_critic(spec: PolicySpec) -> dict:
    """ActorCritic weights whose critic is V(s) = 20 tanh(tanh(0.5 (cart velocity + pole angular velocity))).

    CartPole resets draw every state component from U(-0.05, 0.05), so |V(reset obs)| < 1.1, while a few random
    steps later the velocities are of order one and V several units away.
    """
    torch.manual_seed(0)
    model = ActorCritic(spec)
    first, second, head = model.critic[0], model.critic[2], model.critic[4]
    with torch.no_grad():
        for layer in (first, second, head):
            layer.weight.zero_()
            layer.bias.zero_()
        first.weight[0, 1] = first.weight[0, 3] = 0.5
        second.weight[0, 0] = 1.0
        head.weight[0, 0] = 20.0
    return state_dict_numpy(model)


def check_truncated_steps(frag, final_values: dict, reset_values: dict):
    """Stored advantages/returns of every time-limit step against hand-computed GAE with V(final obs)."""
    term, trunc = frag.arrays[F.TERMINATED], frag.arrays[F.TRUNCATED]
    adv, ret = frag.arrays[F.ADVANTAGES], frag.arrays[F.RETURNS]
    rew, val = frag.arrays[F.REWARDS], frag.arrays[F.VALUES]
    cut = list(zip(*np.nonzero(trunc & ~term)))
    assert len(cut) >= 3 and set(cut) == set(final_values)
    # The test can only see the bug if V(final obs) and V(reset obs) differ clearly.
    gaps = [abs(final_values[k] - reset_values[k]) for k in reset_values]
    assert gaps and max(gaps) > 1.0, gaps
    for (t, i), v_final in final_values.items():
        # Done at t: nothing flows in from t + 1.
        expected = rew[t, i] + GAMMA * v_final - val[t, i]
        assert adv[t, i] == pytest.approx(expected, abs=1e-4), (t, i)
        assert ret[t, i] == pytest.approx(expected + val[t, i], abs=1e-4), (t, i)
        if t > 0 and not (term[t - 1, i] or trunc[t - 1, i]):
            # One step further back, the truncated step's advantage is discounted in.
            prev = rew[t - 1, i] + GAMMA * val[t, i] - val[t - 1, i] + GAMMA * LAM * expected
            assert adv[t - 1, i] == pytest.approx(prev, abs=1e-4), (t - 1, i)


def test_box_sampler_truncation_bootstraps_from_the_final_obs_not_the_reset_obs():
    K, N, T, seed = 8, 4, 40, 3
    spec = env_spec("CartPole-v1", K)
    sampler = RolloutSampler(SamplerSettings(env_id="CartPole-v1", num_envs=N, fragment_length=T, gamma=GAMMA,
                                             gae_lambda=LAM, seed=seed, max_episode_steps=K),
                             functools.partial(ActorCritic, spec))
    state = velocity_critic(spec)
    sampler.load_weights(0, state)
    try:
        frag = sampler.collect()
    finally:
        sampler.close()
    critic = ActorCritic(spec)
    critic.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})

    def value(obs) -> float:
        with torch.no_grad():
            return float(critic.value({"vector": torch.as_tensor(np.asarray(obs, dtype=np.float32))[None]})[0])

    obs_buf = frag.arrays[OBS]
    final_values, reset_values = replay_values(
        "CartPole-v1", frag, K, N, T, seed, value,
        same_obs=lambda t, i, obs: np.testing.assert_allclose(obs_buf[t, i], obs, rtol=1e-6), abs_tol=1e-5)
    check_truncated_steps(frag, final_values, reset_values)


def replay_values(env_id, frag, K, N, T, seed, value, same_obs, abs_tol):
    """Replay every env on its own (same seeds, same stored actions) to get the true final observations:
    {(t, env): V(final obs)} and {(t, env): V(reset obs)} at each truncated step. ``same_obs`` checks the replay
    is the sampled trajectory; the stored value after a truncation must be V(reset obs)."""
    actions = frag.arrays[F.ACTIONS]
    final_values, reset_values = {}, {}
    for i in range(N):
        env = gym.make(env_id, max_episode_steps=K)
        obs, _ = env.reset(seed=seed * 100_003 + i)
        for t in range(T):
            same_obs(t, i, obs)
            obs, _, term, trunc, _ = env.step(int(actions[t, i]))
            if term or trunc:
                if trunc and not term:
                    final_values[(t, i)] = value(obs)
                obs, _ = env.reset()
                if trunc and not term and t + 1 < T:
                    reset_values[(t, i)] = value(obs)
                    assert frag.arrays[F.VALUES][t + 1, i] == pytest.approx(reset_values[(t, i)], abs=abs_tol)
        env.close()
    return final_values, reset_values


def test_dict_sampler_truncation_bootstraps_from_the_final_obs_not_the_reset_obs():
    K, N, T, seed = 5, 3, 30, 2
    _, spec = modal_spec()
    torch.manual_seed(0)
    model = ActorCritic(spec)
    with torch.no_grad():
        model.value_head.weight.mul_(50.0)  # the trunk is tanh-bounded: spread the values out
    state = state_dict_numpy(model)
    sampler = make_modal_sampler(env_id=ENV_ID, num_envs=N, T=T, max_episode_steps=K, state=state, seed=seed)
    try:
        frag = sampler.collect()
        values, processors = sampler.policy.value, sampler.pipeline.process_now

        def value(raw) -> float:
            with torch.inference_mode():
                return float(values({k: torch.from_numpy(v) for k, v in processors(raw).items()})[0])

        proprio = frag.arrays[F.obs_key("proprio")]
        final_values, reset_values = replay_values(
            ENV_ID, frag, K, N, T, seed, value,
            same_obs=lambda t, i, raw: np.testing.assert_array_equal(proprio[t, i], raw["proprio"]), abs_tol=1e-4)
    finally:
        sampler.close()
    check_truncated_steps(frag, final_values, reset_values)


# --------------------------------------------------------------------------------------------------------------
# (i) uint8 Box observations


def test_uint8_box_observations_stay_uint8_and_train():
    N, T = 4, 16
    spec = env_spec(UINT8_CARTPOLE_ID)
    sampler = RolloutSampler(SamplerSettings(env_id=UINT8_CARTPOLE_ID, num_envs=N, fragment_length=T, gamma=GAMMA,
                                             gae_lambda=LAM, seed=0, max_episode_steps=10),
                             functools.partial(ActorCritic, spec))
    torch.manual_seed(0)
    sampler.load_weights(0, state_dict_numpy(ActorCritic(spec)))
    try:
        frag = sampler.collect()
    finally:
        sampler.close()
    obs = frag.arrays[OBS]
    assert obs.dtype == np.uint8 and obs.shape == (T, N) + spec.modalities[0].shape
    # The bytes are the env's own (no float round trip): the first observations are the seeded resets.
    env = gym.make(UINT8_CARTPOLE_ID)
    for i in range(N):
        np.testing.assert_array_equal(obs[0, i], env.reset(seed=i)[0])
    env.close()
    assert np.isfinite(frag.arrays[F.ADVANTAGES]).all()

    torch.manual_seed(0)
    learner = Learner(ActorCritic(spec), LearnerSettings(lr=1e-3, adam_eps=1e-5, anneal_lr=False, total_updates=1,
                                                         update_epochs=2, minibatch_size=32, max_grad_norm=0.5,
                                                         coefs=LossCoefs()), torch.device("cpu"))
    before = learner.flat_params()
    batch = {k: torch.from_numpy(frag.flat(k)) for k in (OBS,) + F.TRAIN_KEYS}
    assert batch[OBS].dtype == torch.uint8
    stats = learner.update(batch)
    for k in ("policy_loss", "value_loss", "entropy", "approx_kl", "grad_norm"):
        assert np.isfinite(stats[k]), (k, stats)
    assert not np.array_equal(learner.flat_params(), before)


def test_float_box_observations_stay_float32():
    spec = env_spec("CartPole-v1")
    sampler = RolloutSampler(SamplerSettings(env_id="CartPole-v1", num_envs=2, fragment_length=4, gamma=GAMMA,
                                             gae_lambda=LAM, seed=0), functools.partial(ActorCritic, spec))
    torch.manual_seed(0)
    sampler.load_weights(0, state_dict_numpy(ActorCritic(spec)))
    try:
        assert sampler.collect().arrays[OBS].dtype == np.float32
    finally:
        sampler.close()
