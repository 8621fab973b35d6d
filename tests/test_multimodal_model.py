"""The actor-critic's encoded layout (learner/model.py, learner/encoders.py): shapes, distributions, encoders and running statistics.

Real torch throughout; every check compares real numbers (hand computations, numpy, or the same model
along another path), so a broken encoder or normaliser fails here.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch import nn

from learner import spec as model_spec
from learner.encoders import NORM_INITIAL_COUNT, ImageEncoder, PointCloudEncoder, TextEncoder, VectorEncoder
from learner.model import POLICY_HEAD_STD, VALUE_HEAD_STD, ActorCritic, ModalityInput, PolicySpec
from pipeline import contract

B = 6


def five_modality_spec(action_kind: str = "discrete", action_dim: int = 5) -> PolicySpec:
    return PolicySpec(
        modalities=(
            ModalityInput("camera", "image", (16, 16, 3), "uint8", scale=255.0),
            ModalityInput("mission", "text", (8,), "int64", vocab_size=20),
            ModalityInput("lidar", "pointcloud", (32, 3), "float32"),
            ModalityInput("mic", "audio", (7, 33), "float32"),
            ModalityInput("state", "vector", (4,), "float32", normalize=True),
        ),
        action_kind=action_kind,
        action_dim=action_dim,
    )


def minigrid_spec() -> PolicySpec:
    return PolicySpec(
        modalities=(
            ModalityInput("image", "image", (7, 7, 3), "uint8", scale=10.0),
            ModalityInput("mission", "text", (8,), "int64", vocab_size=30),
            ModalityInput("direction", "vector", (4,), "float32", normalize=True),
        ),
        action_kind="discrete",
        action_dim=7,
    )


def random_obs(spec: PolicySpec, batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    obs = {}
    for m in spec.modalities:
        if m.kind == "image":
            obs[m.name] = torch.randint(0, 256 if m.scale == 255.0 else 11, (batch, *m.shape), generator=g,
                                        dtype=torch.uint8)
        elif m.kind == "text":
            ids = torch.randint(2, m.vocab_size, (batch, *m.shape), generator=g)
            ids[:, m.shape[0] // 2:] = 0  # missions shorter than max_tokens: trailing padding
            obs[m.name] = ids
        elif m.name == "direction":
            obs[m.name] = nn.functional.one_hot(torch.randint(0, 4, (batch,), generator=g), 4).float()
        else:
            obs[m.name] = torch.randn((batch, *m.shape), generator=g)
    return obs


@pytest.fixture(scope="module")
def model5() -> ActorCritic:
    torch.manual_seed(0)
    return ActorCritic(five_modality_spec())


# --------------------------------------------------------------------------- interface


@pytest.mark.parametrize("spec_fn", [five_modality_spec, minigrid_spec])
def test_output_shapes_and_act_logp_matches_evaluate(spec_fn):
    torch.manual_seed(1)
    spec = spec_fn()
    model = ActorCritic(spec)
    obs = random_obs(spec, B)
    action, logp, value = model.act(obs, generator=torch.Generator().manual_seed(3))
    assert action.shape == (B,) and action.dtype == torch.int64
    assert logp.shape == (B,) and value.shape == (B,)
    assert ((action >= 0) & (action < spec.action_dim)).all()
    assert model.value(obs).shape == (B,)
    # act's outputs are inference tensors; the real path stores them in numpy fragments first.
    e_logp, entropy, e_value = model.evaluate(obs, action.clone())
    assert e_logp.shape == entropy.shape == e_value.shape == (B,)
    # Same weights, same observations: the sampler's log-prob is the learner's.
    torch.testing.assert_close(e_logp, logp, rtol=0, atol=1e-6)
    torch.testing.assert_close(e_value, value, rtol=0, atol=1e-6)
    torch.testing.assert_close(model.value(obs), value, rtol=0, atol=1e-6)


def test_initial_entropy_is_near_uniform():
    torch.manual_seed(2)
    spec = minigrid_spec()
    model = ActorCritic(spec)
    obs = random_obs(spec, 32)
    _, entropy, _ = model.evaluate(obs, torch.zeros(32, dtype=torch.int64))
    # Policy head gain 0.01: logits are ~1e-2, so the policy is uniform to within ~1e-4 nats.
    assert torch.all((math.log(7) - entropy).abs() < 1e-3)
    assert torch.all(entropy <= math.log(7) + 1e-6)


def test_gumbel_sampling_follows_the_policy():
    # A policy that strongly prefers action 2: Gumbel-max must sample it at its probability.
    torch.manual_seed(4)
    spec = minigrid_spec()
    model = ActorCritic(spec)
    with torch.no_grad():
        model.policy_head.weight.zero_()
        model.policy_head.bias.copy_(torch.tensor([0.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0]))
    n = 4000
    obs = random_obs(spec, n, seed=5)
    action, _, _ = model.act(obs, generator=torch.Generator().manual_seed(6))
    p2 = math.exp(2) / (math.exp(2) + 6)
    freq = (action == 2).float().mean().item()
    assert abs(freq - p2) < 4 * math.sqrt(p2 * (1 - p2) / n)


def test_continuous_actions():
    torch.manual_seed(7)
    spec = five_modality_spec("continuous", 3)
    model = ActorCritic(spec)
    with torch.no_grad():
        model.actor_logstd.copy_(torch.tensor([-1.0, 0.0, 0.5]))
    obs = random_obs(spec, B)
    action, logp, value = model.act(obs, generator=torch.Generator().manual_seed(8))
    assert action.shape == (B, 3) and logp.shape == (B,) and value.shape == (B,)
    e_logp, entropy, _ = model.evaluate(obs, action.clone())
    torch.testing.assert_close(e_logp, logp, rtol=0, atol=1e-5)
    # Diagonal Gaussian entropy: sum(0.5 + 0.5 log 2pi + logstd), the same for every state.
    expected = 3 * (0.5 + 0.5 * math.log(2 * math.pi)) + (-1.0 + 0.0 + 0.5)
    torch.testing.assert_close(entropy, torch.full((B,), expected), rtol=0, atol=1e-5)


def test_missing_key_names_modality_and_extra_keys_ignored(model5):
    obs = random_obs(model5.spec, B)
    with_extra = dict(obs, unrelated=torch.zeros(B, 99))
    torch.testing.assert_close(model5.value(with_extra), model5.value(obs))
    del obs["lidar"]
    with pytest.raises(KeyError, match="lidar"):
        model5.value(obs)


def test_wrong_shape_is_rejected(model5):
    obs = random_obs(model5.spec, B)
    obs["camera"] = obs["camera"][:, :8]
    with pytest.raises(ValueError, match="camera"):
        model5.value(obs)


def test_kinds_dtypes_and_settings_come_from_the_contract():
    assert model_spec.KINDS is contract.KINDS and model_spec.KIND_DTYPES is contract.KIND_DTYPES
    # ModalityInput: what preprocessing made of a key, then the contract's MODEL_SETTINGS with the spec's defaults.
    fields = {f.name: f for f in dataclasses.fields(ModalityInput)}
    assert list(fields)[:4] == ["name", "kind", "shape", "dtype"] and set(contract.MODEL_SETTINGS) <= set(fields)
    for name in contract.MODEL_SETTINGS:
        if name != "kind":
            assert fields[name].default == getattr(contract.ModalitySpec(), name), name


def test_spec_validation():
    with pytest.raises(ValueError, match="dtype"):
        ModalityInput("camera", "image", (16, 16, 3), "float32")
    with pytest.raises(ValueError, match="kind"):
        ModalityInput("x", "video", (4,), "float32")
    with pytest.raises(ValueError, match="duplicate"):
        m = ModalityInput("s", "vector", (4,), "float32")
        PolicySpec((m, m), "discrete", 2)


# --------------------------------------------------------------------------- gradients and init


def test_gradient_reaches_every_encoder(model5):
    model5.zero_grad(set_to_none=True)
    obs = random_obs(model5.spec, B)
    actions = torch.arange(B) % model5.spec.action_dim
    logp, entropy, value = model5.evaluate(obs, actions)
    (-(logp.mean()) - 0.01 * entropy.mean() + (value - 1.0).square().mean()).backward()
    for name, encoder in model5.encoders.items():
        params = list(encoder.parameters())
        assert params, name
        for p in params:
            assert p.grad is not None, name
        total = sum(p.grad.abs().sum().item() for p in params)
        assert total > 0, f"no gradient reached encoder {name!r}"
    for p in [*model5.trunk.parameters(), *model5.policy_head.parameters(), *model5.value_head.parameters()]:
        assert p.grad is not None and p.grad.abs().sum() > 0
    model5.zero_grad(set_to_none=True)


def test_orthogonal_init(model5):
    def gram(w):
        w = w.reshape(w.shape[0], -1).double()
        return w @ w.T

    trunk_linear = model5.trunk[0]
    assert trunk_linear.out_features <= trunk_linear.in_features  # 128 <= 288 fused
    out = trunk_linear.out_features
    torch.testing.assert_close(gram(trunk_linear.weight), 2.0 * torch.eye(out, dtype=torch.float64),
                               rtol=0, atol=1e-4)
    n = model5.spec.action_dim
    torch.testing.assert_close(gram(model5.policy_head.weight),
                               POLICY_HEAD_STD**2 * torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-8)
    torch.testing.assert_close(gram(model5.value_head.weight), torch.full((1, 1), VALUE_HEAD_STD**2,
                               dtype=torch.float64), rtol=0, atol=1e-5)
    # A conv with out <= fan-in (32 out, 16*3*3 in) is orthogonal over its flattened fan-in.
    conv = [m for m in model5.encoders["camera"].convs if isinstance(m, nn.Conv2d)][1]
    torch.testing.assert_close(gram(conv.weight), 2.0 * torch.eye(conv.out_channels, dtype=torch.float64),
                               rtol=0, atol=1e-4)
    for module in model5.modules():
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)):
            assert torch.count_nonzero(module.bias) == 0


# --------------------------------------------------------------------------- encoders


def test_image_uint8_equals_manual_float_scale():
    torch.manual_seed(9)
    for mod in (ModalityInput("camera", "image", (16, 16, 3), "uint8", scale=255.0),
                ModalityInput("image", "image", (7, 7, 3), "uint8", scale=10.0)):
        enc = ImageEncoder(mod)
        x = torch.randint(0, 256, (B, *mod.shape), dtype=torch.uint8)
        manual = x.double().permute(0, 3, 1, 2).float() / mod.scale
        expected = enc.head(enc.convs(manual))
        torch.testing.assert_close(enc(x), expected, rtol=0, atol=1e-6)
        # The scale is really applied: the same encoder on undivided values gives something else.
        assert not torch.allclose(enc.head(enc.convs(manual * mod.scale)), expected, atol=1e-3)


def test_image_architecture_by_size():
    small = ImageEncoder(ModalityInput("image", "image", (7, 7, 3), "uint8", scale=10.0))
    small_convs = [m for m in small.convs if isinstance(m, nn.Conv2d)]
    assert [c.kernel_size for c in small_convs] == [(2, 2)] * 3
    assert [c.out_channels for c in small_convs] == [16, 32, 64]
    assert small.head[1].in_features == 64 * 4 * 4  # 7 -> 6 -> 5 -> 4
    large = ImageEncoder(ModalityInput("camera", "image", (64, 48, 3), "uint8"))
    large_convs = [m for m in large.convs if isinstance(m, nn.Conv2d)]
    assert all(c.stride == (2, 2) for c in large_convs)
    # 48 -> 24 -> 12 -> 6 -> 3 on the short side; 64 -> 32 -> 16 -> 8 -> 4 on the long one.
    assert len(large_convs) == 4 and large.head[1].in_features == 32 * 4 * 3
    assert large(torch.zeros(2, 64, 48, 3, dtype=torch.uint8)).shape == (2, 64)


def test_pointcloud_is_order_invariant():
    torch.manual_seed(10)
    enc = PointCloudEncoder(ModalityInput("lidar", "pointcloud", (32, 3), "float32"))
    x = torch.randn(B, 32, 3)
    perm = torch.randperm(32)
    torch.testing.assert_close(enc(x[:, perm]), enc(x), rtol=0, atol=0)
    # Not trivially constant: a different cloud encodes differently.
    assert not torch.allclose(enc(x + 1.0), enc(x))


def test_text_ignores_padding():
    torch.manual_seed(11)
    enc = TextEncoder(ModalityInput("mission", "text", (8,), "int64", vocab_size=20))
    short = torch.tensor([[5, 7, 9, 0, 0, 0, 0, 0]])
    shorter_pad = torch.tensor([[5, 7, 9, 0, 0]])  # the same mission, padded to another length
    torch.testing.assert_close(enc(short), enc(shorter_pad), rtol=0, atol=1e-6)
    # Masked mean by hand: the mean of the three word embeddings, not divided by 8.
    manual = enc.head(enc.embedding.weight[[5, 7, 9]].mean(0, keepdim=True))
    torch.testing.assert_close(enc(short), manual, rtol=0, atol=1e-6)
    # Word identity matters; all-padding does not divide by zero.
    assert not torch.allclose(enc(short), enc(torch.tensor([[5, 7, 8, 0, 0, 0, 0, 0]])))
    assert torch.isfinite(enc(torch.zeros(1, 8, dtype=torch.int64))).all()


# --------------------------------------------------------------------------- vector normalisation


def test_vector_normalizer_matches_numpy_and_travels_in_state_dict():
    spec = five_modality_spec()
    torch.manual_seed(12)
    model = ActorCritic(spec)
    rng = np.random.default_rng(0)
    batches = [rng.normal(loc=[1.0, -2.0, 5.0, 0.0], scale=[0.5, 3.0, 1.0, 2.0], size=(n, 4)).astype(np.float32)
               for n in (10, 37, 3)]
    for i, b in enumerate(batches):
        obs = random_obs(spec, len(b), seed=i)
        obs["state"] = torch.from_numpy(b)
        model.update_normalizers(obs)

    enc = model.encoders["state"]
    allx = np.concatenate(batches).astype(np.float64)
    n, eps = len(allx), NORM_INITIAL_COUNT
    # Exact merge with the prior pseudo-sample (count eps, mean 0, var 1), by hand:
    mean = allx.sum(0) / (n + eps)
    m2 = eps * 1.0 + n * allx.var(0) + allx.mean(0) ** 2 * eps * n / (n + eps)
    np.testing.assert_allclose(enc.running_mean.numpy(), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(enc.running_var.numpy(), m2 / (n + eps), rtol=1e-5)
    np.testing.assert_allclose(enc.running_count.item(), n + eps, rtol=1e-6)
    # ... which is numpy's mean/var of the concatenated batches up to the 1e-4 prior.
    np.testing.assert_allclose(enc.running_mean.numpy(), allx.mean(0), rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(enc.running_var.numpy(), allx.var(0), rtol=1e-3)

    x = torch.tensor([[1.0, -2.0, 5.0, 100.0]])
    expected = np.clip((x.numpy() - enc.running_mean.numpy()) / np.sqrt(enc.running_var.numpy() + 1e-8), -10, 10)
    np.testing.assert_allclose(enc.normalized(x).numpy(), expected, rtol=1e-6)
    assert enc.normalized(x)[0, 3].item() == 10.0  # clipped

    state = model.state_dict()
    for buf in ("running_mean", "running_var", "running_count"):
        assert f"encoders.state.{buf}" in state
    fresh = ActorCritic(spec)
    assert not torch.equal(fresh.encoders["state"].running_mean, enc.running_mean)
    fresh.load_state_dict(state)
    for buf in ("running_mean", "running_var", "running_count"):
        assert torch.equal(getattr(fresh.encoders["state"], buf), getattr(enc, buf))
    obs = random_obs(spec, B)
    torch.testing.assert_close(fresh.value(obs), model.value(obs), rtol=0, atol=0)


def test_categorical_ids_become_one_hot_blocks_per_channel():
    """categories [11, 6, 3] (minigrid's object, colour, state): each cell's three ids become one block of 20 with
    three ones, by hand; one count for every channel works the same; the ids are never normalised."""
    mod = ModalityInput("image", "vector", (2, 1, 3), "float32", categories=(11, 6, 3))
    enc = VectorEncoder(mod, features=0)
    assert enc.out_dim == 2 * 20 and dict(enc.named_buffers(remove_duplicate=False)).keys() == {"id_offsets"}
    ids = torch.tensor([[[[5, 1, 0]], [[6, 1, 2]]]], dtype=torch.float32)  # a green key, then a green ball (open)
    expected = np.zeros((1, 40), np.float32)
    for cell, (obj, colour, state) in enumerate([(5, 1, 0), (6, 1, 2)]):
        expected[0, cell * 20 + obj] = expected[0, cell * 20 + 11 + colour] = expected[0, cell * 20 + 17 + state] = 1
    np.testing.assert_array_equal(enc.normalized(ids).numpy(), expected)
    enc.update(ids)  # no statistics for ids
    same_count = VectorEncoder(ModalityInput("cells", "vector", (3,), "float32", categories=(4,)), features=0)
    np.testing.assert_array_equal(same_count.normalized(torch.tensor([[3.0, 0.0, 1.0]])).numpy(),
                                  [np.concatenate([np.eye(4)[3], np.eye(4)[0], np.eye(4)[1]])])
    with pytest.raises(ValueError, match="categories has 2 entries"):
        ModalityInput("image", "vector", (2, 1, 3), "float32", categories=(11, 6))
    # In a model: the state-only MLPs read the one-hot blocks.
    spec = PolicySpec(modalities=(mod,), action_kind="discrete", action_dim=3, hidden_sizes=(16,))
    model = ActorCritic(spec)
    assert model.fused_dim == 40 and model.critic[0].in_features == 40
    assert model.value({"image": ids.to(torch.uint8)}).shape == (1,)


def test_normalizer_off_has_no_buffers():
    enc = VectorEncoder(ModalityInput("state", "vector", (2, 3), "float32", normalize=False))
    assert dict(enc.named_buffers()) == {}
    x = torch.randn(B, 2, 3) * 50
    enc.update(x)  # a no-op, not an error
    torch.testing.assert_close(enc.normalized(x), x.reshape(B, 6))
    assert enc(x).shape == (B, 64)
