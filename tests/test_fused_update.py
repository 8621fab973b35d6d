"""The fused PPO step (learner/fused_update.py) against autograd: same gradients, same updates, same checkpoints.

The autograd path is the reference: ``learner/ppo.py``'s loss differentiated by torch, clipped by
``clip_grad_norm_``, stepped by ``torch.optim.Adam``. Every PPO detail the fused step writes out by hand (the clipped
surrogate and its tie-breaking, the clipped value loss, the entropy bonus, the policy-head derivatives, the tanh
backward, the global-norm clip, Adam's bias corrections) is compared here on batches built so that each branch is
taken: ratios inside and outside the clip range, value changes inside and outside the value clip.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from learner import fused_update
from learner.learner import Learner
from learner.model import ActorCritic
from learner.ppo import LossCoefs, ppo_loss
from learner.spec import ModalityInput, PolicySpec
from pipeline import fragment as F
from tests.conftest import vector_spec


def _spec(kind="discrete", action_dim=3, hidden=(16, 16), normalize=False, obs_dim=5):
    mod = ModalityInput("vector", "vector", (obs_dim,), "float32", normalize=normalize)
    return PolicySpec((mod,), kind, action_dim, hidden_sizes=hidden)


def _batch(model: ActorCritic, n: int, seed: int, spread: float = 0.6) -> dict[str, torch.Tensor]:
    """Stored log-probs and values offset from the model's own, so ratios and value changes land on both sides
    of the clip range (spread 0.6 against clip 0.2)."""
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(n, model.spec.modalities[0].shape[0], generator=g) * 2 + 1
    if model.spec.action_kind == "discrete":
        actions = torch.randint(0, model.spec.action_dim, (n,), generator=g)
    else:
        actions = torch.randn(n, model.spec.action_dim, generator=g)
    with torch.no_grad():
        logp, _, values = model.evaluate({"vector": obs}, actions)
    adv = torch.randn(n, generator=g)
    return {"obs/vector": obs, F.ACTIONS: actions,
            F.LOGP: logp + spread * torch.randn(n, generator=g),
            F.VALUES: values + spread * torch.randn(n, generator=g),
            F.ADVANTAGES: adv, F.RETURNS: values + adv}


def _pair(spec, coefs, **kw):
    """Two learners on identical models, one per path."""
    args = dict(lr=3e-3, adam_eps=1e-5, anneal_lr=True, total_updates=6, update_epochs=3, minibatch_size=64,
                max_grad_norm=0.5, coefs=coefs, device=torch.device("cpu"), seed=7)
    args.update(kw)
    torch.manual_seed(0)
    model = ActorCritic(spec)
    ref = Learner(copy.deepcopy(model), fused_update=False, **args)
    fused = Learner(model, fused_update=True, **args)
    assert fused.update_path == "fused" and ref.update_path.startswith("autograd")
    return ref, fused


CASES = [
    # (action kind, action dim, hidden sizes, LossCoefs, normalised observations)
    ("discrete", 2, (64, 64), LossCoefs(ent_coef=0.0), False),
    ("discrete", 3, (16, 16), LossCoefs(ent_coef=0.05), False),
    ("discrete", 4, (8,), LossCoefs(ent_coef=0.01, clip_vloss=False), True),
    ("discrete", 2, (8, 8, 8), LossCoefs(ent_coef=0.01, norm_adv=False, vf_coef=1.0), False),
    ("continuous", 1, (64, 64), LossCoefs(ent_coef=0.0), True),
    ("continuous", 3, (16, 16), LossCoefs(ent_coef=0.02, clip_coef=0.1), False),
    ("continuous", 2, (16,), LossCoefs(ent_coef=0.0, clip_vloss=False, norm_adv=False), True),
]


@pytest.mark.parametrize("kind,action_dim,hidden,coefs,normalize", CASES)
def test_whole_updates_match_autograd(kind, action_dim, hidden, coefs, normalize):
    """Four updates (12 minibatch steps each, Adam state and lr annealing carried over) give the same
    parameters, running statistics and reported statistics as the autograd path, to 1e-5."""
    spec = _spec(kind, action_dim, hidden, normalize)
    ref, fused = _pair(spec, coefs)
    for u in range(4):
        batch = _batch(ref.model, 256, seed=u)
        s_ref, s_fused = ref.update(batch), fused.update(batch)
        for key in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "grad_norm",
                    "explained_variance", "lr"):
            assert s_fused[key] == pytest.approx(s_ref[key], rel=1e-5, abs=1e-5), (u, key)
        assert s_fused["minibatch_steps"] == s_ref["minibatch_steps"] == 12
    # Both branches of the clips were exercised (otherwise the test would not cover them).
    assert 0.05 < s_ref["clip_fraction"] < 0.95
    np.testing.assert_allclose(fused.flat_params(), ref.flat_params(), rtol=0, atol=1e-5)
    for (k, a), (_, b) in zip(ref.model.state_dict().items(), fused.model.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5, msg=k)
    assert np.abs(fused.flat_params() - _initial_params(spec)).max() > 1e-2  # and training moved the weights


def _initial_params(spec):
    torch.manual_seed(0)
    return torch.cat([p.detach().reshape(-1) for p in ActorCritic(spec).parameters()]).numpy()


@pytest.mark.parametrize("kind", ["discrete", "continuous"])
def test_one_step_gradient_equals_autograd_gradient(kind):
    """The gradient buffer after one step (clip off: a huge max norm) against ``ppo_loss``'s autograd gradient,
    parameter by parameter."""
    coefs = LossCoefs(ent_coef=0.03)
    spec = _spec(kind, 3, (16, 16))
    torch.manual_seed(0)
    model = ActorCritic(spec)
    ref = copy.deepcopy(model)
    batch = _batch(ref, 128, seed=4)
    obs = {"vector": batch["obs/vector"]}
    logp, ent, v = ref.evaluate(obs, batch[F.ACTIONS])
    loss, _ = ppo_loss(logp, ent, v, batch[F.LOGP], batch[F.VALUES], batch[F.ADVANTAGES], batch[F.RETURNS], coefs)
    loss.backward()
    step = fused_update.FusedMLPStep(model, lr=0.0, adam_eps=1e-5)  # lr 0: the weights stay, the gradient stays
    stats = step.step(batch["obs/vector"], batch[F.ACTIONS], batch[F.LOGP], batch[F.VALUES], batch[F.ADVANTAGES],
                      batch[F.RETURNS], coefs, max_grad_norm=1e9)
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-6, msg=name)
    ref_norm = nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    assert stats[-1].item() == pytest.approx(ref_norm.item(), rel=1e-5)


def test_parameters_are_views_of_the_buffer():
    """What the rollouts and checkpoints read (the model's parameters / state_dict) is what the step trained, and
    loading a state dict writes into the buffer the step trains."""
    torch.manual_seed(0)
    model = ActorCritic(vector_spec((4,)))
    learner = Learner(model, lr=1e-2, adam_eps=1e-5, anneal_lr=False, total_updates=1, update_epochs=1,
                      minibatch_size=32, max_grad_norm=0.5, coefs=LossCoefs(), device=torch.device("cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    learner.update(_batch(model, 64, seed=1))
    after = model.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before)
    torch.testing.assert_close(torch.from_numpy(learner.flat_params()).sort().values,
                               learner.fused.flat.sort().values, rtol=0, atol=0)
    model.load_state_dict(before)
    np.testing.assert_array_equal(learner.fused.flat.sort().values.numpy(),
                                  torch.cat([v.reshape(-1) for v in before.values()]).sort().values.numpy())


@pytest.mark.parametrize("first,second", [("fused", "autograd"), ("autograd", "fused")])
def test_optimizer_state_moves_between_paths(first, second):
    """A checkpoint's optimizer state from one path continues identically on the other (FlatAdam writes and reads
    torch.optim.Adam's state_dict format)."""
    spec = _spec("discrete", 2, (16, 16))
    coefs = LossCoefs()
    runs = {}
    for label, switch in (("straight", False), ("switched", True)):
        torch.manual_seed(0)
        model = ActorCritic(spec)
        kw = dict(lr=3e-3, adam_eps=1e-5, anneal_lr=False, total_updates=4, update_epochs=2, minibatch_size=64,
                  max_grad_norm=0.5, coefs=coefs, device=torch.device("cpu"), seed=3)
        a = Learner(model, fused_update=first == "fused", **kw)
        for u in range(2):
            a.update(_batch(a.model, 128, seed=u))
        if switch:
            torch.manual_seed(1)
            b = Learner(ActorCritic(spec), fused_update=second == "fused", **kw)
            b.model.load_state_dict(a.model.state_dict())
            b.optimizer.load_state_dict(a.optimizer.state_dict())
            b.generator.set_state(a.generator.get_state())
            a = b
        for u in range(2, 4):
            a.update(_batch(a.model, 128, seed=u))
        runs[label] = a.flat_params()
    np.testing.assert_allclose(runs["switched"], runs["straight"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("kw,reason", [
    (dict(precision="bf16"), "learner.precision is bf16"),
    (dict(compile=True), "learner.compile is on"),
    (dict(fused_update=False), "learner.fused_update is off"),
])
def test_settings_the_fused_step_does_not_cover_use_autograd_and_say_why(kw, reason):
    torch.manual_seed(0)
    args = dict(lr=1e-3, adam_eps=1e-5, anneal_lr=False, total_updates=1, update_epochs=1, minibatch_size=8,
                max_grad_norm=0.5, coefs=LossCoefs(), device=torch.device("cpu"))
    learner = Learner(ActorCritic(vector_spec((4,))), **{**args, **kw})
    assert learner.fused is None
    assert learner.update_path == f"autograd ({reason})"


def test_encoded_models_use_autograd():
    image = ModalityInput("camera", "image", (8, 8, 3), "uint8")
    spec = PolicySpec((image, ModalityInput("state", "vector", (3,), "float32")), "discrete", 2)
    reason = fused_update.supports(ActorCritic(spec), "fp32", False)
    assert reason == "the model has encoders (image/text/point cloud/audio)"
    with pytest.raises(ValueError, match="encoders"):
        fused_update.FusedMLPStep(ActorCritic(spec), lr=1e-3, adam_eps=1e-5)
