"""Every common action space and action masking: parts, hand-computed log-probs and entropies, env-typed actions,
masks that are never violated, and runs that learn (in-process, real envs from actors/probe_envs.py)."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
import torch

import actors.probe_envs as probe
from actors.envs import describe_env
from actors.sampler import RolloutSampler, SamplerSettings
from cluster.config import ConfigError
from learner.model import (MASKED_LOGIT, ActorCritic, action_logp_entropy, apply_mask, parts_logp_entropy,
                           parts_mode, parts_sample)
from learner.spec import ModalityInput, PolicySpec
from pipeline import fragment as F
from pipeline.actions import ActionCodec, ActionPart, check_mask

HYBRID = gym.spaces.Dict({"move": gym.spaces.Discrete(3), "grip": gym.spaces.MultiBinary(2),
                          "force": gym.spaces.Box(-1, 1, (2,), np.float32)})


def spec_for(space, mask: str | None = None, obs_dim: int = 4) -> PolicySpec:
    codec = ActionCodec(space)
    mod = ModalityInput(name="vector", kind="vector", shape=(obs_dim,), dtype="float32")
    return PolicySpec((mod,), codec.kind, codec.action_dim, action_parts=[(p.kind, p.size) for p in codec.parts],
                      action_mask=mask)


# ---------------------------------------------------------------- the codec: parts and the env's own types

@pytest.mark.parametrize("space, kind, parts, width", [
    (gym.spaces.Discrete(5), "discrete", [("categorical", 5)], 1),
    (gym.spaces.MultiDiscrete([3, 4]), "composite", [("categorical", 3), ("categorical", 4)], 2),
    (gym.spaces.MultiDiscrete([[2, 3], [4, 5]]), "composite",
     [("categorical", 2), ("categorical", 3), ("categorical", 4), ("categorical", 5)], 4),
    (gym.spaces.MultiBinary(3), "composite", [("bernoulli", 3)], 3),
    (gym.spaces.MultiBinary([2, 2]), "composite", [("bernoulli", 4)], 4),
    (gym.spaces.Box(-1, 1, (2, 3), np.float32), "continuous", [("gaussian", 6)], 6),
    (gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Box(-1, 1, (1,)))), "composite",
     [("categorical", 2), ("gaussian", 1)], 2),
    (HYBRID, "composite", [("gaussian", 2), ("bernoulli", 2), ("categorical", 3)], 5),  # Dict keys sorted
])
def test_spaces_become_parts(space, kind, parts, width):
    codec = ActionCodec(space)
    assert codec.kind == kind
    assert [(p.kind, p.size) for p in codec.parts] == parts
    assert codec.width == width


@pytest.mark.parametrize("space", [
    gym.spaces.Discrete(3, start=-1), gym.spaces.MultiDiscrete([3, 4], start=[1, 10]), gym.spaces.MultiBinary([2, 2]),
    gym.spaces.Box(-1, 1, (2, 3), np.float32), HYBRID,
    gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Dict({"a": gym.spaces.MultiDiscrete([2, 2]),
                                                               "b": gym.spaces.Box(0, 5, (1,), np.float64)}))),
])
def test_sampled_actions_reach_the_env_in_its_own_type(space):
    model = ActorCritic(spec_for(space))
    with torch.no_grad():
        model.actor[-1].weight.mul_(300)  # spread the policy so every part's extremes get sampled
    actions, _, _ = model.act({"vector": torch.randn(64, 4) * 3}, generator=torch.Generator().manual_seed(0))
    env_actions = ActionCodec(space).to_env(actions.numpy())
    assert len(env_actions) == 64
    for a in env_actions:
        assert space.contains(a), (space, a)  # dtype, shape, bounds and start all as the space says


def test_starts_and_bounds_are_applied():
    codec = ActionCodec(gym.spaces.Dict({"d": gym.spaces.Discrete(3, start=5),
                                         "m": gym.spaces.MultiDiscrete([3, 3], start=[-1, 2]),
                                         "x": gym.spaces.Box(-1, 1, (2,), np.float32)}))
    (out,) = codec.to_env(np.array([[2, 0, 2, 7.5, -0.25]], dtype=np.float32))
    assert out["d"] == 7 and list(out["m"]) == [-1, 4] and list(out["x"]) == [1.0, -0.25]
    assert ActionCodec(gym.spaces.Discrete(3, start=5)).to_env(np.array([0, 2])).tolist() == [5, 7]


@pytest.mark.parametrize("space, named", [
    (gym.spaces.Text(5), "Text"), (gym.spaces.Box(0, 3, (2,), np.int64), "int64"),
    (gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Text(3))), "Text"),
])
def test_unsupported_spaces_are_named_with_what_is_allowed(space, named):
    with pytest.raises(ValueError, match=named) as e:
        ActionCodec(space, where="env.id: 'x'")
    assert "env.id: 'x'" in str(e.value) and "allowed: Discrete, MultiDiscrete, MultiBinary" in str(e.value)


# ---------------------------------------------------------------- log-probs and entropies by hand

def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    return x - np.log(np.exp(x - x.max()).sum()) - x.max()


def test_composite_logp_and_entropy_against_hand_computed_numbers():
    # Parts (Dict keys sorted): force gaussian 2, grip bernoulli 2, move categorical 3.
    parts = ActionCodec(HYBRID).parts
    head = torch.tensor([[0.5, -1.0, 2.0, -0.5, 0.1, 0.7, -0.3]])  # means 2, grip logits 2, move logits 3
    logstd = torch.tensor([-0.2, 0.3])
    action = torch.tensor([[0.9, -0.4, 1.0, 0.0, 2.0]])  # force, grip bits, move index
    logp, entropy = parts_logp_entropy(parts, head, action, logstd)

    mean, std = np.array([0.5, -1.0]), np.exp([-0.2, 0.3])
    x = np.array([0.9, -0.4])
    lp_force = np.sum(-0.5 * ((x - mean) / std) ** 2 - np.log(std) - 0.5 * np.log(2 * np.pi))
    ent_force = np.sum(0.5 + 0.5 * np.log(2 * np.pi) + np.log(std))
    p_on = 1 / (1 + np.exp(-np.array([2.0, -0.5])))
    lp_grip = np.log(p_on[0]) + np.log(1 - p_on[1])  # bits 1, 0
    ent_grip = -np.sum(p_on * np.log(p_on) + (1 - p_on) * np.log(1 - p_on))
    lsm = log_softmax([0.1, 0.7, -0.3])
    lp_move, ent_move = lsm[2], -np.sum(np.exp(lsm) * lsm)

    assert logp.item() == pytest.approx(lp_force + lp_grip + lp_move, abs=1e-5)
    assert entropy.item() == pytest.approx(ent_force + ent_grip + ent_move, abs=1e-5)


def test_multidiscrete_logp_is_the_sum_over_elements():
    parts = ActionCodec(gym.spaces.MultiDiscrete([2, 3])).parts
    head = torch.tensor([[1.0, -1.0, 0.0, 0.5, 2.0]])
    logp, entropy = parts_logp_entropy(parts, head, torch.tensor([[0.0, 2.0]]), None)
    a, b = log_softmax([1.0, -1.0]), log_softmax([0.0, 0.5, 2.0])
    assert logp.item() == pytest.approx(a[0] + b[2], abs=1e-6)
    assert entropy.item() == pytest.approx(-(np.exp(a) * a).sum() - (np.exp(b) * b).sum(), abs=1e-6)


def test_samples_follow_each_part_distribution():
    parts = ActionCodec(gym.spaces.Tuple((gym.spaces.Discrete(3), gym.spaces.MultiBinary(1),
                                          gym.spaces.Box(-9, 9, (1,))))).parts
    n = 40_000
    head = torch.tensor([[math.log(0.2), math.log(0.3), math.log(0.5), math.log(0.25 / 0.75), 1.5]]).repeat(n, 1)
    actions = parts_sample(parts, head, torch.tensor([math.log(0.5)]), torch.Generator().manual_seed(1))
    freq = np.bincount(actions[:, 0].long().numpy(), minlength=3) / n
    assert freq == pytest.approx([0.2, 0.3, 0.5], abs=0.01)
    assert actions[:, 1].mean().item() == pytest.approx(0.25, abs=0.01)
    assert actions[:, 2].mean().item() == pytest.approx(1.5, abs=0.01)
    assert actions[:, 2].std().item() == pytest.approx(0.5, abs=0.01)
    mode = parts_mode(parts, head[:1])
    assert mode.tolist() == [[2.0, 0.0, 1.5]]


# ---------------------------------------------------------------- masking

def test_masked_actions_are_never_sampled_over_random_masks():
    """Property test: 300 random masks over Discrete(7) and MultiDiscrete([4, 5]), logits of any sign and size
    (illegal ones made the largest), 200 samples each: no illegal action, ever; log-probs finite."""
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    for space in (gym.spaces.Discrete(7), gym.spaces.MultiDiscrete([4, 5])):
        parts = ActionCodec(space).parts
        widths = [p.size for p in parts]
        for _ in range(150):
            mask = np.concatenate([rng.random(w) < rng.uniform(0.05, 0.95) for w in widths])
            offset = 0
            for w in widths:  # at least one legal choice per part
                if not mask[offset:offset + w].any():
                    mask[offset + rng.integers(w)] = True
                offset += w
            logits = rng.normal(0, rng.uniform(0.1, 30), sum(widths)).astype(np.float32)
            logits[~mask] += 60.0  # the illegal choices are the policy's favourites
            out = apply_mask(parts, torch.from_numpy(logits).repeat(200, 1), torch.from_numpy(mask).repeat(200, 1))
            if len(parts) == 1:
                from learner.model import sample_action
                actions, logp = sample_action("discrete", out, None, gen)
                chosen = [actions.numpy()]
            else:
                actions = parts_sample(parts, out, None, gen)
                logp, _ = parts_logp_entropy(parts, out, actions, None)
                chosen = [actions[:, i].long().numpy() for i in range(len(parts))]
            offset = 0
            for w, c in zip(widths, chosen):
                assert mask[offset:offset + w][c].all(), (mask, logits)
                offset += w
            assert torch.isfinite(logp).all()


def test_masked_logp_and_entropy_are_over_the_legal_actions_only():
    logits = torch.tensor([[2.0, 0.5, -1.0, 3.0]])
    mask = torch.tensor([[True, False, True, False]])
    out = apply_mask((ActionPart("categorical", 4),), logits, mask)
    logp, entropy = action_logp_entropy("discrete", out, torch.tensor([2]), None)
    legal = log_softmax([2.0, -1.0])  # the legal choices renormalised
    assert logp.item() == pytest.approx(legal[1], abs=1e-6)
    assert entropy.item() == pytest.approx(-(np.exp(legal) * legal).sum(), abs=1e-6)
    assert torch.isfinite(out).all() and (out[0, [1, 3]] == MASKED_LOGIT).all()
    # Under autocast, too (bf16 head outputs): finite, and the same legal distribution to bf16 precision.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out16 = apply_mask((ActionPart("categorical", 4),), logits.bfloat16(), mask)
        logp16, ent16 = action_logp_entropy("discrete", out16, torch.tensor([2]), None)
    assert torch.isfinite(logp16).all() and torch.isfinite(ent16).all()
    assert logp16.item() == pytest.approx(legal[1], abs=2e-2)


def test_masked_gradients_do_not_reach_illegal_logits():
    logits = torch.tensor([[2.0, 0.5, -1.0, 3.0]], requires_grad=True)
    out = apply_mask((ActionPart("categorical", 4),), logits, torch.tensor([[True, False, True, False]]))
    logp, entropy = action_logp_entropy("discrete", out, torch.tensor([0]), None)
    (logp + entropy).sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 1] == 0 and logits.grad[0, 3] == 0 and logits.grad[0, 0] != 0


def test_an_all_zero_mask_is_an_error_naming_the_env_and_step():
    parts = ActionCodec(gym.spaces.MultiDiscrete([2, 3])).parts
    mask = np.array([[1, 0, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=bool)
    with pytest.raises(ValueError, match=r"all zero \(action part 1\): env 1 at step 9"):
        check_mask(mask, parts, lambda i: f"env {i} at step 9")
    sampler = make_sampler("AscentRL/MaskedChoice-v0", env_kwargs={"empty_mask_at": 3})
    with pytest.raises(ValueError, match=r"action mask is all zero: env.id .*MaskedChoice-v0.*episode step 3"):
        sampler.collect()


def make_sampler(env_id: str, **kwargs) -> RolloutSampler:
    desc = describe_env(f"actors.probe_envs:{env_id}", {"observation": {"kind": "vector"}}
                        if "Masked" in env_id else None, env_kwargs=kwargs.get("env_kwargs"))
    from learner.spec import spec_from_description

    spec = spec_from_description(desc, (16,))
    modalities = {"observation": {"kind": "vector"}} if "Masked" in env_id else None
    sampler = RolloutSampler(SamplerSettings(env_id=f"actors.probe_envs:{env_id}", num_envs=4, fragment_length=8,
                                             gamma=0.99, gae_lambda=0.95, seed=0, modalities=modalities,
                                             preprocess_workers=0, action_mask_key=spec.action_mask, **kwargs),
                             lambda: ActorCritic(spec))
    sampler.load_weights(0, {k: v.numpy() for k, v in ActorCritic(spec).state_dict().items()})
    return sampler


def test_rollouts_store_the_mask_and_only_legal_actions():
    sampler = make_sampler("AscentRL/MaskedChoice-v0")
    fragment = sampler.collect()
    mask = fragment.arrays[F.obs_key("action_mask")]
    actions = fragment.arrays[F.ACTIONS]
    assert mask.shape == (8, 4, probe.MaskedChoice.N) and mask.dtype == bool
    assert mask.sum(-1).tolist() == [[probe.MaskedChoice.LEGAL] * 4] * 8
    assert np.take_along_axis(mask, actions[..., None], -1).all()  # each stored action legal under its mask
    # The stored mask is the one the env showed with the observation the action answered.
    assert (fragment.arrays[F.obs_key("observation")] == mask).all()
    assert sum(env.unwrapped.illegal for env in sampler.env.envs) == 0
    # The behaviour log-prob is over the legal actions: recomputed from the stored mask, it matches.
    model = sampler.policy
    obs = {"observation": torch.from_numpy(fragment.flat(F.obs_key("observation"))),
           "action_mask": torch.from_numpy(fragment.flat(F.obs_key("action_mask")))}
    with torch.no_grad():
        logp, _, _ = model.evaluate(obs, torch.from_numpy(fragment.flat(F.ACTIONS)))
    assert np.allclose(logp.numpy(), fragment.flat(F.LOGP), atol=1e-5)
    obs["action_mask"] = torch.ones_like(obs["action_mask"])  # without the mask, the log-probs differ
    with torch.no_grad():
        unmasked, _, _ = model.evaluate(obs, torch.from_numpy(fragment.flat(F.ACTIONS)))
    assert not np.allclose(unmasked.numpy(), fragment.flat(F.LOGP), atol=1e-3)


def test_composite_actions_are_stored_as_sampled():
    sampler = make_sampler("AscentRL/Match-Hybrid-v0")
    fragment = sampler.collect()
    actions = fragment.arrays[F.ACTIONS]
    assert actions.shape == (8, 4, 2) and actions.dtype == np.float32  # amount (gaussian), then choice
    assert set(np.unique(actions[..., 1])) <= {0.0, 1.0, 2.0}
    # Stored as sampled (before the env's clip): their log-probs under the acting policy are the stored ones.
    obs = {"vector": torch.from_numpy(fragment.flat(F.obs_key("vector")))}
    with torch.no_grad():
        logp, _, _ = sampler.policy.evaluate(obs, torch.from_numpy(fragment.flat(F.ACTIONS)))
    assert np.allclose(logp.numpy(), fragment.flat(F.LOGP), atol=1e-5)


def test_mask_config_errors_name_the_key():
    masked = "actors.probe_envs:AscentRL/MaskedChoice-v0"
    with pytest.raises(ConfigError, match=r"env.modalities.action_mask: 'action_mask' is the action mask"):
        describe_env(masked, {"observation": {"kind": "vector"}, "action_mask": {"kind": "vector"}})
    desc = describe_env(masked, {"observation": {"kind": "vector"}})
    assert desc["action_mask"] == "action_mask" and desc["action_parts"] == [("categorical", 20)]
    assert describe_env(masked, {"observation": {"kind": "vector"}}, action_mask_key=None)["action_mask"] is None
    # An empty env.modalities names the keys to choose from, not the mask.
    with pytest.raises(ConfigError, match=r"Dict observations \(observation\)"):
        describe_env(masked, {})


# ---------------------------------------------------------------- learning, in process

@pytest.mark.slow
@pytest.mark.parametrize("env_id, target, masked", [
    ("AscentRL/Match-Hybrid-v0", 12.0, None),  # Discrete + Box in one Dict action
    ("AscentRL/MaskedChoice-v0", 11.5, True),  # 0.91 of the optimum, 12.6
])
@pytest.mark.long  # learning run to a threshold (`make test-long`; CI runs it)
def test_learns_structured_and_masked_actions(tmp_path, env_id, target, masked):
    from cluster.api import load_policy, train

    mods = {"observation": {"kind": "vector"}} if masked else {}
    result = train("configs/cartpole.yaml", run_dir=tmp_path / "run", env__id=f"actors.probe_envs:{env_id}",
                   env__modalities=mods, ray__address="inprocess", run__target_return=target,
                   run__total_env_steps=150_000, run__require_target=False, rollout__envs_per_actor=16,
                   rollout__fragment_length=32, learner__batch_size=512, learner__minibatch_size=128,
                   learner__lr=1e-3, run__target_window=50, preprocess__workers=0)
    assert result.reached_target, (result.reason, result.env_steps, result.metrics.get("episode_return_mean"))
    policy = load_policy(tmp_path / "run", trust_code=True)
    env = policy.make_env()
    obs, _ = env.reset(seed=5)
    total = 0.0
    for _ in range(probe.EPISODE_STEPS):
        action = policy.act(obs, deterministic=True)
        assert env.action_space.contains(action), action  # the env's own type, from Policy.act
        obs, reward, *_ = env.step(action)
        total += reward
    assert total >= target - 2.0
    if masked:
        assert env.unwrapped.illegal == 0
