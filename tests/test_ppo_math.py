"""PPO loss terms, model init/distributions and the Learner update, against hand-computed numbers."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from learner.fused_update import FlatAdam, FusedMLPStep
from learner.learner import Learner, Minibatch, row_minibatches, LearnerSettings
from learner.model import POLICY_HEAD_STD, VALUE_HEAD_STD, ActorCritic, gaussian_logp, layer_init
from learner.ppo import (
    LossCoefs,
    approx_kl,
    clip_fraction,
    clipped_surrogate,
    explained_variance,
    linear_lr,
    normalize_advantages,
    normalize_advantages_by_group,
    policies_loss,
    ppo_loss,
    value_loss,
)
from pipeline import fragment as F
from tests.conftest import vector_spec

OBS = F.obs_key("vector")


def t64(*xs):
    return torch.tensor(xs, dtype=torch.float64)


# --------------------------------------------------------------------------- loss terms


def test_clipped_surrogate_hand_computed():
    # clip_coef = 0.2  ->  ratio range [0.8, 1.2]
    ratio = t64(1.5, 0.5, 1.1, 1.5)
    adv = t64(2.0, -1.0, 3.0, -1.0)
    # r=1.5, A=+2 (above 1+eps, A>0): max(-3.0, -2*1.2 = -2.4) = -2.4   (clipped)
    # r=0.5, A=-1 (below 1-eps, A<0): max( 0.5,  1*0.8 =  0.8) =  0.8   (clipped)
    # r=1.1, A=+3 (inside):           max(-3.3, -3.3)           = -3.3
    # r=1.5, A=-1 (above, A<0):       max( 1.5,  1.2)           =  1.5   (pessimistic, unclipped)
    expected = (-2.4 + 0.8 - 3.3 + 1.5) / 4  # = -0.85
    got = clipped_surrogate(ratio.log(), adv, 0.2)
    assert got.item() == pytest.approx(expected, abs=1e-9)
    assert got.item() == pytest.approx(-0.85, abs=1e-9)


def test_clipped_surrogate_elementwise_terms():
    # One element at a time, so a wrong clip on any single case shows up on its own.
    cases = [(1.5, 2.0, -2.4), (0.5, -1.0, 0.8), (1.1, 3.0, -3.3), (1.5, -1.0, 1.5), (0.5, 1.0, -0.5)]
    for r, a, want in cases:
        got = clipped_surrogate(t64(r).log(), t64(a), 0.2).item()
        assert got == pytest.approx(want, abs=1e-9), (r, a)


def test_value_loss_unclipped_hand_computed():
    new = t64(1.0, 2.0, 3.0)
    old = t64(0.0, 2.0, 2.5)
    ret = t64(2.0, 0.0, 3.0)
    # squared errors: (1-2)^2 = 1, (2-0)^2 = 4, (3-3)^2 = 0  ->  0.5 * 5/3
    assert value_loss(new, old, ret, 0.2, clip=False).item() == pytest.approx(0.5 * 5.0 / 3.0, abs=1e-9)


def test_value_loss_clipped_hand_computed():
    new = t64(1.0, 2.0, 3.0)
    old = t64(0.0, 2.0, 2.5)
    ret = t64(2.0, 0.0, 3.0)
    # v_clipped = old + clamp(new - old, -0.2, 0.2) = [0.2, 2.0, 2.7]
    # clipped sq. err:   (0.2-2)^2 = 3.24, (2-0)^2 = 4, (2.7-3)^2 = 0.09
    # unclipped sq. err: 1,                4,            0
    # elementwise max:   3.24,             4,            0.09  -> 0.5 * 7.33 / 3
    expected = 0.5 * (3.24 + 4.0 + 0.09) / 3.0
    assert value_loss(new, old, ret, 0.2, clip=True).item() == pytest.approx(expected, abs=1e-9)


def test_approx_kl_is_k3_estimator():
    logratio = t64(math.log(2.0), 0.0, math.log(0.5))
    # (r-1) - log r:  (2-1) - ln2,  0,  (0.5-1) + ln2   ->  sum = 0.5, mean = 1/6
    assert approx_kl(logratio).item() == pytest.approx(1.0 / 6.0, abs=1e-12)
    # k1 (-mean logratio) would be 0 here, k2 (0.5 mean logratio^2) would be ln2^2/3 ~ 0.1602.


def test_approx_kl_zero_at_ratio_one_and_nonnegative():
    assert approx_kl(torch.zeros(4)).item() == 0.0
    assert approx_kl(t64(-3.0, -0.1, 0.1, 3.0)).item() > 0.0


def test_clip_fraction_hand_computed():
    ratio = t64(1.5, 0.5, 1.1, 0.7)
    # |r-1| = 0.5, 0.5, 0.1, 0.3 ; > 0.2 for three of four
    assert clip_fraction(ratio.log(), 0.2).item() == pytest.approx(0.75, abs=1e-7)
    # with clip 0.4 only the first two count
    assert clip_fraction(ratio.log(), 0.4).item() == pytest.approx(0.5, abs=1e-7)


def test_normalize_advantages_uses_unbiased_std():
    adv = t64(1.0, 2.0, 3.0, 6.0)
    # mean 3, deviations [-2, -1, 0, 3], sum of squares 14, unbiased var 14/3
    std = math.sqrt(14.0 / 3.0)
    expected = t64(-2.0 / std, -1.0 / std, 0.0, 3.0 / std)
    torch.testing.assert_close(normalize_advantages(adv), expected, rtol=0, atol=1e-8)
    # biased std would be sqrt(3.5): make sure that is not what we got
    assert normalize_advantages(adv)[3].item() != pytest.approx(3.0 / math.sqrt(3.5), abs=1e-3)


def test_normalize_advantages_eps_is_1e_8():
    adv = t64(0.0, 2e-8)
    # mean 1e-8, unbiased std = sqrt(2 * 1e-16 / 1) = sqrt(2) * 1e-8
    # (2e-8 - 1e-8) / (sqrt(2)*1e-8 + 1e-8) = 1 / (sqrt(2) + 1)
    got = normalize_advantages(adv)
    assert got[1].item() == pytest.approx(1.0 / (math.sqrt(2.0) + 1.0), rel=1e-9)
    assert got[0].item() == pytest.approx(-1.0 / (math.sqrt(2.0) + 1.0), rel=1e-9)
    # constant advantages: finite zeros, not NaN
    const = normalize_advantages(t64(5.0, 5.0, 5.0))
    assert torch.equal(const, torch.zeros(3, dtype=torch.float64))


def test_ppo_loss_total_and_entropy_bonus_sign():
    coefs = LossCoefs(clip_coef=0.2, clip_vloss=True, vf_coef=0.5, ent_coef=0.1, norm_adv=False)
    old_logp = t64(-1.0, -2.0)
    new_logp = old_logp.clone()  # ratio 1
    entropy = t64(1.0, 3.0).requires_grad_(True)  # mean 2
    new_values = t64(1.0, 2.0)
    old_values = t64(1.0, 2.0)
    adv = t64(2.0, 4.0)
    ret = t64(3.0, 2.0)
    loss, stats = ppo_loss(new_logp, entropy, new_values, old_logp, old_values, adv, ret, coefs)
    # pg = mean(-2*1, -4*1) = -3 ; v_loss = 0.5 * mean((1-3)^2, 0) = 1 ; entropy mean = 2
    # loss = pg - ent_coef*entropy + vf_coef*v = -3 - 0.1*2 + 0.5*1 = -2.7
    assert loss.item() == pytest.approx(-2.7, abs=1e-9)
    assert stats["policy_loss"].item() == pytest.approx(-3.0, abs=1e-9)
    assert stats["value_loss"].item() == pytest.approx(1.0, abs=1e-9)
    assert stats["entropy"].item() == pytest.approx(2.0, abs=1e-9)
    assert stats["approx_kl"].item() == pytest.approx(0.0, abs=1e-12)
    assert stats["clip_fraction"].item() == 0.0
    loss.backward()
    # d loss / d entropy_i = -ent_coef / n = -0.05: minimising the loss raises entropy.
    torch.testing.assert_close(entropy.grad, t64(-0.05, -0.05))
    for v in stats.values():
        assert not v.requires_grad


def test_ppo_loss_normalizes_advantages_when_enabled():
    coefs = LossCoefs(clip_coef=0.2, clip_vloss=False, vf_coef=0.0, ent_coef=0.0, norm_adv=True)
    old_logp = t64(0.0, 0.0)
    new_logp = t64(0.0, math.log(1.1))  # ratios 1.0, 1.1 (both inside the clip range)
    adv = t64(1.0, 3.0)  # normalised: mean 2, unbiased std sqrt(2) -> [-1/sqrt2, +1/sqrt2]
    z = t64(0.0, 0.0)
    loss, stats = ppo_loss(new_logp, z, z, old_logp, z, adv, z, coefs)
    # pg = mean(-(-1/sqrt2)*1.0, -(1/sqrt2)*1.1) = (1 - 1.1) / (2 sqrt2)
    expected = (1.0 - 1.1) / (2.0 * math.sqrt(2.0))
    assert stats["policy_loss"].item() == pytest.approx(expected, abs=1e-7)
    assert loss.item() == pytest.approx(expected, abs=1e-7)


def test_ppo_loss_one_sample_minibatch_is_finite_with_norm_adv():
    """A 1-sample minibatch (learner.minibatch_size == num_learners) has no unbiased std: the advantage is only
    zero-centred (to 0), so the loss is finite and its gradients too, instead of NaN."""
    assert torch.equal(normalize_advantages(t64(3.5)), t64(0.0))
    coefs = LossCoefs(clip_coef=0.2, clip_vloss=True, vf_coef=0.5, ent_coef=0.01, norm_adv=True)
    new_logp = t64(math.log(1.1)).requires_grad_(True)
    entropy = t64(0.7)
    new_values = t64(1.0)
    loss, stats = ppo_loss(new_logp, entropy, new_values, t64(0.0), t64(1.0), t64(2.0), t64(3.0), coefs)
    assert torch.isfinite(loss), loss
    assert all(torch.isfinite(v) for v in stats.values()), stats
    # adv 0 -> policy loss 0; v_loss = 0.5 * (1 - 3)^2 = 2; loss = 0 - 0.01*0.7 + 0.5*2
    assert stats["policy_loss"].item() == 0.0
    assert loss.item() == pytest.approx(1.0 - 0.007, abs=1e-12)
    loss.backward()
    assert torch.isfinite(new_logp.grad)


def test_normalize_advantages_by_group_hand_computed():
    """Each group's own mean and unbiased std; a group of one row is only zero-centred (its advantage becomes 0)."""
    adv = torch.tensor([1.0, 3.0, 10.0, 4.0, 8.0])
    groups = torch.tensor([0, 0, 1, 2, 2])
    rows = torch.tensor([2.0, 1.0, 2.0])
    r = 1 / math.sqrt(2)  # (x - mean) / std with std = |x - mean| * sqrt(2) for two rows
    want = torch.tensor([-r, r, 0.0, -r, r])
    assert torch.allclose(normalize_advantages_by_group(adv, groups, rows), want, atol=1e-6)


def test_policies_loss_is_the_sum_of_each_trained_policys_own_ppo_loss():
    """Per-row weights (1 / the policy's rows; 0 for a frozen policy) make one loss equal to the sum of each trained
    policy's ppo_loss over its own rows, in value and in gradient; each policy's statistics are its own ppo_loss's,
    the overall ones their row-weighted mean; a frozen policy's rows (here non-finite) reach nothing."""
    g = torch.Generator().manual_seed(0)
    n = 23
    groups = torch.tensor([0, 1, 2] * 7 + [2, 0])
    trains = torch.tensor([True, False, True])
    new_logp = (-torch.rand(n, generator=g)).requires_grad_(True)
    new_values = torch.randn(n, generator=g).requires_grad_(True)
    entropy = (torch.rand(n, generator=g) + 0.5).requires_grad_(True)
    old_logp = new_logp.detach() + 0.5 * torch.randn(n, generator=g)
    old_logp[groups == 1] = float("nan")  # the frozen policy's rows: anything they hold must not reach the loss
    old_values = new_values.detach() + 0.5 * torch.randn(n, generator=g)
    adv = torch.randn(n, generator=g) * 3 + groups * 10.0  # scales differ by policy
    returns = torch.randn(n, generator=g)
    coefs = LossCoefs(ent_coef=0.05)
    loss, stats, per_policy, rows = policies_loss(new_logp, entropy, new_values, old_logp, old_values, adv, returns,
                                                  coefs, groups, trains)
    assert rows.tolist() == [8, 7, 8]
    loss.backward()
    got = [t.grad.clone() for t in (new_logp, entropy, new_values)]
    for t in (new_logp, entropy, new_values):
        t.grad = None
    want_loss, weighted = 0.0, 0.0
    for p in (0, 2):
        own = groups == p
        own_loss, own_stats = ppo_loss(new_logp[own], entropy[own], new_values[own], old_logp[own], old_values[own],
                                       adv[own], returns[own], coefs)
        want_loss = want_loss + own_loss
        own_vec = torch.stack([own_stats[k] for k in ("policy_loss", "value_loss", "entropy", "approx_kl",
                                                      "clip_fraction")])
        assert torch.allclose(per_policy[p], own_vec, atol=1e-6), p
        weighted = weighted + own_vec * int(own.sum())
    assert torch.allclose(loss, want_loss.detach(), atol=1e-6)
    assert torch.allclose(torch.stack(stats), weighted / 16, atol=1e-6)
    assert torch.isfinite(per_policy).all() and (per_policy[1] == 0).all()
    want_loss.backward()
    for mine, theirs in zip(got, (new_logp.grad, entropy.grad, new_values.grad)):
        assert torch.isfinite(mine).all()
        assert torch.allclose(mine, theirs, atol=1e-7)
        assert (mine[groups == 1] == 0).all()


def test_row_minibatches_cover_every_row_once_in_perm_order_gathered_either_way():
    """The rows sampler: ``size`` rows at a time in ``perm`` order, every row once an epoch; the whole-epoch gather
    (the fused step's) and the per-minibatch gather (observations) give the same minibatches."""
    n = 12
    data = Minibatch({"vector": torch.arange(n * 2.0).reshape(n, 2)}, *(torch.arange(n) * k for k in range(1, 6)))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(3))
    per_epoch = list(row_minibatches(data, 4, perm, gather_epoch=True))
    per_minibatch = list(row_minibatches(data, 4, perm, gather_epoch=False))
    assert len(per_epoch) == len(per_minibatch) == 3
    for a, b, start in zip(per_epoch, per_minibatch, range(0, n, 4)):
        assert torch.equal(a.actions, perm[start:start + 4]) and torch.equal(a.returns, 5 * perm[start:start + 4])
        assert torch.equal(a.inputs["vector"], data.inputs["vector"][perm[start:start + 4]])
        for x, y in zip(a[1:6], b[1:6]):
            assert torch.equal(x, y)
        assert torch.equal(a.inputs["vector"], b.inputs["vector"]) and a.state is None and b.state is None


def test_explained_variance_hand_computed():
    values = t64(1.0, 2.0, 3.0, 4.0)
    returns = t64(1.0, 3.0, 3.0, 5.0)
    # residual [0, 1, 0, 1]: var 1/3 ; returns var 8/3 ; 1 - (1/3)/(8/3) = 0.875
    assert explained_variance(values, returns).item() == pytest.approx(0.875, abs=1e-12)
    assert explained_variance(returns.clone(), returns).item() == pytest.approx(1.0, abs=1e-12)
    assert explained_variance(torch.zeros(4, dtype=torch.float64), returns).item() == pytest.approx(0.0, abs=1e-12)


def test_explained_variance_nan_for_constant_returns():
    ev = explained_variance(t64(1.0, 2.0, 3.0), t64(2.0, 2.0, 2.0))
    assert torch.isnan(ev).item()


@pytest.mark.parametrize(
    "update,expected",
    [(0, 1e-3), (1, 0.75e-3), (2, 0.5e-3), (4, 0.0), (5, 0.0), (100, 0.0)],
)
def test_linear_lr(update, expected):
    assert linear_lr(1e-3, update, 4) == pytest.approx(expected, abs=1e-15)
    assert linear_lr(1e-3, update, 4) >= 0.0


def test_linear_lr_middle_of_long_schedule():
    assert linear_lr(2.5e-4, 500, 1000) == pytest.approx(1.25e-4, rel=1e-12)


# --------------------------------------------------------------------------- model


def _linears(seq: nn.Sequential) -> list[nn.Linear]:
    return [m for m in seq if isinstance(m, nn.Linear)]


def _assert_orthogonal(w: torch.Tensor, gain: float):
    w = w.detach().double()
    rows, cols = w.shape
    gram = w @ w.T if rows <= cols else w.T @ w
    eye = torch.eye(min(rows, cols), dtype=torch.float64)
    torch.testing.assert_close(gram, gain**2 * eye, rtol=0, atol=1e-5 * max(gain**2, 1e-4) + 1e-9)


def test_head_constants():
    assert POLICY_HEAD_STD == 0.01
    assert VALUE_HEAD_STD == 1.0


def test_actor_critic_init_discrete():
    torch.manual_seed(0)
    model = ActorCritic(vector_spec((4,), "discrete", 2))
    for seq in (model.actor, model.critic):
        lins = _linears(seq)
        assert len(lins) == 3
        assert [type(m) for m in seq] == [nn.Linear, nn.Tanh, nn.Linear, nn.Tanh, nn.Linear]
        for lin in lins[:-1]:
            _assert_orthogonal(lin.weight, math.sqrt(2.0))
        for lin in lins:
            assert torch.count_nonzero(lin.bias).item() == 0
    assert tuple(model.actor[0].weight.shape) == (64, 4)
    assert tuple(model.actor[4].weight.shape) == (2, 64)
    assert tuple(model.critic[4].weight.shape) == (1, 64)
    _assert_orthogonal(_linears(model.actor)[-1].weight, 0.01)
    _assert_orthogonal(_linears(model.critic)[-1].weight, 1.0)
    # the policy head is really small (gain 0.01 on a 1x... row: norm == gain)
    assert model.actor[4].weight.norm(dim=1).max().item() == pytest.approx(0.01, rel=1e-4)
    assert model.critic[4].weight.norm().item() == pytest.approx(1.0, rel=1e-4)
    assert not hasattr(model, "actor_logstd")


def test_layer_init_orthogonal_and_bias():
    torch.manual_seed(1)
    lin = layer_init(nn.Linear(5, 3), std=2.0, bias_const=0.5)
    _assert_orthogonal(lin.weight, 2.0)
    assert torch.equal(lin.bias, torch.full((3,), 0.5))


def test_continuous_logstd_zero_and_evaluate_matches_normal():
    torch.manual_seed(2)
    model = ActorCritic(vector_spec((3,), "continuous", 2))
    assert isinstance(model.actor_logstd, nn.Parameter)
    assert torch.equal(model.actor_logstd.data, torch.zeros(2))
    with torch.no_grad():
        model.actor_logstd.copy_(torch.tensor([-0.5, 0.3]))
    obs = torch.randn(5, 3)
    actions = torch.randn(5, 2) * 2.0
    logp, ent, value = model.evaluate({"vector": obs}, actions)
    with torch.no_grad():
        mean = model.actor(obs)
        dist = torch.distributions.Normal(mean, model.actor_logstd.exp().expand_as(mean))
        torch.testing.assert_close(logp, dist.log_prob(actions).sum(-1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, dist.entropy().sum(-1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(value, model.critic(obs).squeeze(-1))
    assert logp.shape == (5,) and ent.shape == (5,) and value.shape == (5,)
    # and the standalone helper agrees too
    torch.testing.assert_close(
        gaussian_logp(actions, mean, model.actor_logstd.detach()), dist.log_prob(actions).sum(-1),
        rtol=1e-5, atol=1e-5)


def test_continuous_act_logp_matches_sample():
    torch.manual_seed(3)
    model = ActorCritic(vector_spec((3,), "continuous", 2))
    obs = torch.randn(6, 3)
    a, lp, v = model.act({"vector": obs}, generator=torch.Generator().manual_seed(0))
    mean = model.actor(obs).detach()
    want = torch.distributions.Normal(mean, torch.ones_like(mean)).log_prob(a).sum(-1)
    torch.testing.assert_close(lp, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v, model.critic(obs).squeeze(-1).detach())


def _sharpened_discrete(action_dim: int, seed: int) -> ActorCritic:
    torch.manual_seed(seed)
    model = ActorCritic(vector_spec((4,), "discrete", action_dim))
    with torch.no_grad():  # make logits obs-dependent and far from uniform
        model.actor[4].weight.mul_(300.0)
        model.actor[4].bias.copy_(torch.linspace(-1.0, 1.0, action_dim))
    return model


def test_discrete_evaluate_matches_categorical():
    model = _sharpened_discrete(3, seed=4)
    obs = torch.randn(7, 4)
    actions = torch.tensor([0, 1, 2, 2, 1, 0, 1])
    logp, ent, value = model.evaluate({"vector": obs}, actions)
    with torch.no_grad():
        dist = torch.distributions.Categorical(logits=model.actor(obs))
        assert dist.entropy().std() > 1e-3  # the check is not on a uniform policy
        torch.testing.assert_close(logp, dist.log_prob(actions), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ent, dist.entropy(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(value, model.critic(obs).squeeze(-1))


def test_discrete_act_samples_follow_softmax():
    torch.manual_seed(5)
    model = ActorCritic(vector_spec((4,), "discrete", 3))
    probs = torch.tensor([0.1, 0.3, 0.6])
    with torch.no_grad():  # state-independent policy with known probabilities
        model.actor[4].weight.zero_()
        model.actor[4].bias.copy_(probs.log())
    n = 40_000
    obs = torch.randn(n, 4)
    a, lp, _ = model.act({"vector": obs}, generator=torch.Generator().manual_seed(1234))
    assert a.dtype == torch.int64 and a.shape == (n,)
    freq = torch.bincount(a, minlength=3).double() / n
    # binomial std <= sqrt(0.25/40000) = 0.0025; 0.015 is 6 sigma (and the seed is fixed)
    torch.testing.assert_close(freq, probs.double(), rtol=0, atol=0.015)
    torch.testing.assert_close(lp, probs.log()[a], rtol=0, atol=1e-5)


def test_discrete_act_logp_is_log_softmax_at_sample_and_seeded():
    model = _sharpened_discrete(3, seed=6)
    obs = torch.randn(500, 4)
    a1, lp1, v1 = model.act({"vector": obs}, generator=torch.Generator().manual_seed(7))
    a2, _, _ = model.act({"vector": obs}, generator=torch.Generator().manual_seed(7))
    a3, _, _ = model.act({"vector": obs}, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a1, a2)
    assert not torch.equal(a1, a3)
    with torch.no_grad():
        ls = torch.log_softmax(model.actor(obs), dim=-1)
    torch.testing.assert_close(lp1, ls.gather(-1, a1.unsqueeze(-1)).squeeze(-1), rtol=0, atol=1e-6)
    assert len(torch.unique(a1)) > 1
    torch.testing.assert_close(v1, model.critic(obs).squeeze(-1).detach())


# --------------------------------------------------------------------------- learner


def _model(seed=0):
    torch.manual_seed(seed)
    return ActorCritic(vector_spec((4,), "discrete", 2, hidden_sizes=(8, 8)))


def _batch(model: ActorCritic, n: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(n, 4, generator=g)
    actions = torch.randint(0, 2, (n,), generator=g)
    with torch.no_grad():
        logp, _, values = model.evaluate({"vector": obs}, actions)
    adv = torch.randn(n, generator=g)
    return {
        OBS: obs,
        F.ACTIONS: actions,
        F.LOGP: logp.clone(),
        F.VALUES: values.clone(),
        F.ADVANTAGES: adv,
        F.RETURNS: adv + values,
    }


@pytest.fixture(params=["fused", "autograd"])
def path(request):
    """Every Learner test runs on both update paths: the fused step (the default for state-only models) and
    autograd (every other model, and learner.fused_update: false)."""
    return request.param


def _learner(model, path="fused", grad_sync=None, kl_sync=None, **kw):
    args = dict(fused_update=path == "fused", lr=1e-3, adam_eps=1e-5, anneal_lr=True, total_updates=4, update_epochs=2, minibatch_size=8,
                max_grad_norm=0.5, coefs=LossCoefs(), seed=0)
    args.update(kw)
    return Learner(model, LearnerSettings(**args), torch.device("cpu"), grad_sync=grad_sync, kl_sync=kl_sync)


def test_learner_optimizer_is_adam_with_eps(path):
    lrn = _learner(_model(), path, adam_eps=1e-5)
    assert lrn.update_path.startswith(path)
    assert type(lrn.optimizer) is (FlatAdam if path == "fused" else torch.optim.Adam)
    assert len(lrn.optimizer.param_groups) == 1
    assert lrn.optimizer.param_groups[0]["eps"] == 1e-5
    assert lrn.optimizer.param_groups[0]["lr"] == 1e-3
    n_params = sum(1 for _ in lrn.model.parameters())
    assert len(lrn.optimizer.param_groups[0]["params"]) == n_params


def test_learner_lr_annealing_per_update(path):
    model = _model()
    batch = _batch(model)
    lrn = _learner(model, path, lr=1e-3, total_updates=4, anneal_lr=True)
    for k in range(5):
        stats = lrn.update(batch)
        want = linear_lr(1e-3, k, 4)
        assert want == pytest.approx([1e-3, 0.75e-3, 0.5e-3, 0.25e-3, 0.0][k])
        assert lrn.optimizer.param_groups[0]["lr"] == pytest.approx(want, abs=1e-15)
        assert stats["lr"] == pytest.approx(want, abs=1e-15)


def test_learner_no_annealing_keeps_base_lr(path):
    model = _model()
    batch = _batch(model)
    lrn = _learner(model, path, lr=1e-3, total_updates=4, anneal_lr=False)
    for _ in range(3):
        stats = lrn.update(batch)
        assert lrn.optimizer.param_groups[0]["lr"] == 1e-3
        assert stats["lr"] == 1e-3


def test_learner_first_step_size_is_lr(path):
    # One Adam step from fresh state moves each parameter by lr * g / (|g| + eps) <= lr,
    # and by ~lr where the gradient is not tiny: the lr is really the one applied.
    model = _model()
    batch = _batch(model)
    lrn = _learner(model, path, lr=1e-3, update_epochs=1, minibatch_size=16, max_grad_norm=1e9)
    before = lrn.flat_params()
    lrn.update(batch)
    step = np.abs(lrn.flat_params() - before)
    assert step.max() <= 1e-3 * (1 + 1e-5)
    assert step.max() >= 0.9e-3


def test_learner_grad_norm_clip_bounds_step(path):
    # After clipping, every |g_i| <= ||g|| <= max_norm; the first Adam step is then
    # lr * g / (|g| + eps) <= lr * max_norm / eps.
    model = _model()
    batch = _batch(model)
    max_norm, lr, eps = 1e-9, 1e-3, 1e-5
    lrn = _learner(model, path, lr=lr, adam_eps=eps, update_epochs=1, minibatch_size=16, max_grad_norm=max_norm)
    before = lrn.flat_params()
    stats = lrn.update(batch)
    step = np.abs(lrn.flat_params() - before)
    assert stats["grad_norm"] > 1e-3  # the unclipped norm is far above max_norm
    assert step.max() <= lr * max_norm / eps * 1.01  # ~1e-7, vs ~1e-3 unclipped
    assert step.max() > 0.0


def test_learner_clips_global_norm_before_every_step(path):
    model = _model()
    batch = _batch(model)
    max_norm = 0.05
    lrn = _learner(model, path, max_grad_norm=max_norm, update_epochs=2, minibatch_size=4)
    norms = []

    def hooked(real_step):
        def step_hook(*a, **kw):
            g = torch.cat([p.grad.reshape(-1) for p in lrn.model.parameters() if p.grad is not None])
            norms.append(g.norm().item())
            return real_step(*a, **kw)
        return step_hook

    # The optimizer step: ``step``, or FlatAdam's ``step_on_device`` where the fused step runs over static buffers
    # (learner.graphs: auto).
    for name in ("step", "step_on_device"):
        if hasattr(lrn.optimizer, name):
            setattr(lrn.optimizer, name, hooked(getattr(lrn.optimizer, name)))
    stats = lrn.update(batch)
    assert len(norms) == 2 * (16 // 4) == stats["minibatch_steps"]
    assert max(norms) <= max_norm * (1 + 1e-4)
    # the reported grad_norm is the mean pre-clip norm, above the clip threshold here
    assert stats["grad_norm"] > max_norm
    assert min(norms) == pytest.approx(max_norm, rel=1e-3)


def test_learner_stats_match_direct_computation(path):
    model = _model()
    batch = _batch(model, n=16, seed=3)
    ref = copy.deepcopy(model)
    lrn = _learner(model, path, update_epochs=1, minibatch_size=16, max_grad_norm=1e9)
    coefs = lrn.coefs
    # Reference: the same single full-batch minibatch on an untouched copy.
    new_logp, ent, new_v = ref.evaluate({"vector": batch[OBS]}, batch[F.ACTIONS])
    loss, ref_stats = ppo_loss(new_logp, ent, new_v, batch[F.LOGP], batch[F.VALUES], batch[F.ADVANTAGES],
                               batch[F.RETURNS], coefs)
    loss.backward()
    ref_gn = torch.cat([p.grad.reshape(-1) for p in ref.parameters()]).norm().item()
    ref_ev = explained_variance(batch[F.VALUES], batch[F.RETURNS]).item()

    stats = lrn.update(batch)
    for key in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "explained_variance",
                "grad_norm", "lr"):
        assert key in stats, key
        assert isinstance(stats[key], float), key
    for key in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction"):
        assert stats[key] == pytest.approx(ref_stats[key].item(), rel=1e-4, abs=1e-6), key
    assert stats["grad_norm"] == pytest.approx(ref_gn, rel=1e-4)
    assert stats["explained_variance"] == pytest.approx(ref_ev, rel=1e-5, abs=1e-6)
    assert stats["lr"] == 1e-3
    assert stats["minibatch_steps"] == 1
    assert stats["entropy"] > 0.5  # near-uniform two-action policy: ~ln 2


def test_learner_host_syncs_one_per_update_and_grad_sync_called(path):
    model = _model()
    batch = _batch(model)
    calls = []
    lrn = _learner(model, path, update_epochs=2, minibatch_size=8, grad_sync=lambda m: calls.append(m))
    assert lrn.host_syncs == 0 and lrn.updates_done == 0
    for k in range(1, 4):
        stats = lrn.update(batch)
        assert lrn.host_syncs == k
        assert lrn.updates_done == k
        assert stats["minibatch_steps"] == 4
        assert all(np.isfinite(stats[key]) for key in ("policy_loss", "value_loss", "entropy", "grad_norm"))
    assert len(calls) == 3 * 4 and all(c is lrn.model for c in calls)


def test_learner_one_sample_minibatches_stay_finite(path):
    """Learner used directly with minibatch_size=1 and norm_adv on: finite stats and parameters, no NaN."""
    model = _model()
    batch = _batch(model, n=4)
    lrn = _learner(model, path, update_epochs=1, minibatch_size=1, coefs=LossCoefs(norm_adv=True))
    stats = lrn.update(batch)
    assert stats["minibatch_steps"] == 4
    assert all(np.isfinite(stats[key]) for key in ("policy_loss", "value_loss", "entropy", "grad_norm")), stats
    assert np.isfinite(lrn.flat_params()).all()


def test_learner_rejects_non_multiple_batch(path):
    model = _model()
    lrn = _learner(model, path, minibatch_size=5)
    with pytest.raises(ValueError):
        lrn.update(_batch(model, n=16))
    assert lrn.host_syncs == 0


def test_the_hidden_activation_is_torch_tanh_bit_for_bit_in_the_model_and_the_fused_step():
    """The MLPs' tanh is torch.tanh on every host: in the model (what the rollouts and the autograd step run) and in
    the fused step's forward. Another formula (2 sigmoid(2x) - 1 differs by float32 ulps), or one picked per host by
    a timing, shows here as a mismatch."""
    torch.manual_seed(0)
    model = ActorCritic(vector_spec((4,), "discrete", 2))
    x = torch.randn(512, 4) * 3
    with torch.no_grad():
        z = model.critic[0](x)
        assert torch.equal(model.critic[1](z), torch.tanh(z))
        step = FusedMLPStep(model, lr=0.0, adam_eps=1e-5)
        hidden = step._buffers(512)["hidden"]
        step._forward(x, hidden)
        both = torch.baddbmm(step.b[0], x.unsqueeze(0).expand(2, *x.shape), step.w[0].transpose(1, 2))
        assert torch.equal(hidden[0], torch.tanh(both))
        assert both.abs().max() > 1  # past the near-linear part of tanh


def test_learner_uses_fused_adam_on_cpu():
    """The autograd path's Adam is torch's fused kernel on CPU (the fused update has its own flat Adam)."""
    torch.manual_seed(0)
    model = ActorCritic(vector_spec((4,), "discrete", 2))
    learner = Learner(model, LearnerSettings(lr=1e-3, adam_eps=1e-5, anneal_lr=False, total_updates=1,
                                             update_epochs=1, minibatch_size=4, max_grad_norm=0.5, coefs=LossCoefs(),
                                             fused_update=False), torch.device("cpu"))
    assert learner.optimizer.defaults["fused"] is True


def test_target_kl_stops_the_epochs_once_an_epochs_mean_kl_passes_it(path):
    """After each epoch, the mean approx-KL of its minibatches against ppo.target_kl (one host sync each)."""
    batch = _batch(_model(), n=32)
    runs = {}
    for name, target in (("off", None), ("tiny", 1e-12), ("huge", 1e9)):
        lrn = _learner(_model(), path, update_epochs=5, minibatch_size=8, lr=1e-2, anneal_lr=False,
                       target_kl=target)
        stats = lrn.update(batch)
        runs[name] = (stats, lrn.host_syncs)
    assert runs["off"][0]["update_epochs_run"] == 5 and runs["off"][0]["minibatch_steps"] == 20
    assert runs["huge"][0]["update_epochs_run"] == 5 and runs["huge"][0]["minibatch_steps"] == 20
    # The first epoch's later minibatches already moved the policy: its mean KL is > 0, so it stops there.
    assert runs["tiny"][0]["update_epochs_run"] == 1 and runs["tiny"][0]["minibatch_steps"] == 4
    assert runs["tiny"][1] == runs["off"][1] + 1 and runs["huge"][1] == runs["off"][1] + 5  # a sync per epoch
    # Each epoch's own mean KL decides (not the update's running total): the same epochs as one-epoch updates in
    # a row (same permutations, Adam state, old log-probs) give the per-epoch KLs; a target above the second's
    # and below the third's, but below the first two epochs' total too, stops the update after exactly three.
    lrn = _learner(_model(), path, update_epochs=1, minibatch_size=8, lr=1e-2, anneal_lr=False)
    per_epoch = [lrn.update(batch)["approx_kl"] for _ in range(5)]
    target = per_epoch[1] + per_epoch[0] / 2
    assert per_epoch[0] < target and per_epoch[1] < target < per_epoch[2], per_epoch
    lrn = _learner(_model(), path, update_epochs=5, minibatch_size=8, lr=1e-2, anneal_lr=False, target_kl=target)
    assert lrn.update(batch)["update_epochs_run"] == 3, per_epoch


def test_target_kl_decision_is_the_mean_over_learners(path):
    """kl_sync gets each epoch's KL and its answer decides: a rank whose own KL is small still stops when the
    mean over ranks is past the target (so no rank runs an epoch, with its all-reduces, that the others skip)."""
    batch = _batch(_model(), n=32)
    seen = []

    def mean_over_ranks(kl):  # as if another rank's KL were 1.0
        seen.append(float(kl))
        return (kl + 1.0) / 2

    lrn = _learner(_model(), path, update_epochs=5, minibatch_size=8, lr=1e-4, anneal_lr=False, target_kl=0.4,
                   kl_sync=mean_over_ranks)
    stats = lrn.update(batch)
    assert len(seen) == 1 and seen[0] < 0.01  # its own KL is far below the target
    assert stats["update_epochs_run"] == 1
    alone = _learner(_model(), path, update_epochs=5, minibatch_size=8, lr=1e-4, anneal_lr=False, target_kl=0.4)
    assert alone.update(batch)["update_epochs_run"] == 5


def test_entropy_and_clip_coefficients_anneal_linearly_and_reach_the_loss(path):
    batch = _batch(_model(), n=16)
    lrn = _learner(_model(), path, total_updates=4, coefs=LossCoefs(ent_coef=0.2, clip_coef=0.3), ent_coef_end=0.0,
                   clip_coef_end=0.1)
    seen = [(s["ent_coef"], s["clip_coef"]) for s in (lrn.update(batch) for _ in range(4))]
    np.testing.assert_allclose(seen, [(0.2, 0.3), (0.15, 0.25), (0.1, 0.2), (0.05, 0.15)], atol=1e-12)
    # The scheduled value is the one the loss used: an update at step 2 of the schedule gives the same weights as
    # a constant-coefficient learner at those values, and not the ones at the schedule's start.
    def after_one(coefs, updates_done=0, **kw):
        lrn = _learner(_model(), path, total_updates=4, coefs=coefs, lr=1e-2, **kw)
        lrn.updates_done = updates_done
        lrn.update(batch)
        return lrn.flat_params()

    scheduled = after_one(LossCoefs(ent_coef=0.2, clip_coef=0.3), 2, ent_coef_end=0.0, clip_coef_end=0.1)
    np.testing.assert_allclose(scheduled, after_one(LossCoefs(ent_coef=0.1, clip_coef=0.2), 2), rtol=0, atol=1e-6)
    assert np.abs(scheduled - after_one(LossCoefs(ent_coef=0.2, clip_coef=0.3), 2)).max() > 1e-5


# --------------------------------------------------------------------------- ppo.clip_around: update_start


def _stale_batch(n: int = 32, seed: int = 5) -> dict[str, torch.Tensor]:
    """A batch as a behaviour policy some updates behind the learners' weights (``_model()``) left it: its
    stored log-probs and values those of the start moved by noise (the freshly initialised head is near uniform,
    so another initialisation would differ too little)."""
    batch = _batch(_model(), n=n, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    batch[F.LOGP] = batch[F.LOGP] + 0.3 * torch.randn(n, generator=g)
    batch[F.VALUES] = batch[F.VALUES] + 0.5 * torch.randn(n, generator=g)
    return batch


def test_update_start_is_the_decoupled_objective_hand_built(path):
    """One full-batch step under clip_around update_start: the ratio against the weights the update starts from,
    behaviour -> start as each row's importance weight, the value clipped around the start's values. The
    reference is written out here from the model's own forward, not through the loss functions."""
    model = _model()
    batch = _stale_batch()
    ref = copy.deepcopy(model)
    clip = 0.2
    lrn = _learner(model, path, update_epochs=1, minibatch_size=32, max_grad_norm=1e9,
                   coefs=LossCoefs(clip_coef=clip, clip_around="update_start"))
    with torch.no_grad():
        start_logp, _, start_v = ref.evaluate({"vector": batch[OBS]}, batch[F.ACTIONS])
    w = (start_logp - batch[F.LOGP]).exp()
    assert (w - 1).abs().max() > 0.05  # the behaviour really is stale
    new_logp, ent, new_v = ref.evaluate({"vector": batch[OBS]}, batch[F.ACTIONS])
    r = (new_logp - start_logp).exp()
    adv = batch[F.ADVANTAGES]
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    pg = (w * torch.max(-adv * r, -adv * r.clamp(1 - clip, 1 + clip))).mean()
    ret = batch[F.RETURNS]
    v_clipped = start_v + (new_v - start_v).clamp(-clip, clip)
    vl = 0.5 * torch.max((new_v - ret) ** 2, (v_clipped - ret) ** 2).mean()
    (pg - 0.01 * ent.mean() + 0.5 * vl).backward()
    ref_gn = torch.cat([p.grad.reshape(-1) for p in ref.parameters()]).norm().item()

    stats = lrn.update(batch)
    assert stats["policy_loss"] == pytest.approx(pg.item(), rel=1e-4, abs=1e-6)
    assert stats["value_loss"] == pytest.approx(vl.item(), rel=1e-4, abs=1e-6)
    assert stats["grad_norm"] == pytest.approx(ref_gn, rel=1e-4)
    # The step is taken at the start's weights: the ratio is 1 on every row.
    assert stats["approx_kl"] == pytest.approx(0.0, abs=1e-7) and stats["clip_fraction"] == 0.0
    behaviour = _learner(_model(), path, update_epochs=1, minibatch_size=32, max_grad_norm=1e9,
                         coefs=LossCoefs(clip_coef=clip)).update(batch)
    assert behaviour["clip_fraction"] > 0.1  # the same batch clipped around the stale behaviour


def test_update_start_and_behaviour_agree_on_policy(path):
    """At lag 0 the behaviour is the start (importance weights 1): both objectives give the same weights over
    two epochs of two minibatches."""
    batch = _batch(_model(), n=16, seed=2)
    params = []
    for clip_around in ("behaviour", "update_start"):
        lrn = _learner(_model(), path, coefs=LossCoefs(clip_around=clip_around))
        lrn.update(batch)
        params.append(lrn.flat_params())
    np.testing.assert_allclose(params[0], params[1], rtol=0, atol=1e-6)


def test_update_start_takes_every_update_from_its_own_start(path):
    """Three updates of the same stale batch: each recomputes the start from the weights it begins with (a
    start computed once and reused would leave a ratio away from 1 at the next update's first step)."""
    lrn = _learner(_model(), path, update_epochs=1, minibatch_size=32, coefs=LossCoefs(clip_around="update_start"))
    batch = _stale_batch()
    for _ in range(3):
        assert lrn.update(batch)["clip_fraction"] == 0.0


def test_an_unknown_clip_around_is_refused_naming_the_key():
    import dataclasses

    from cluster.config import PPOConfig
    from learner.ppo import CLIP_AROUND

    # The config (no torch import) spells the choices out; they are the learner's.
    field = {f.name: f for f in dataclasses.fields(PPOConfig)}["clip_around"]
    assert tuple(field.metadata["choices"]) == CLIP_AROUND
    with pytest.raises(ValueError, match="ppo.clip_around: 'start' is not one of behaviour, update_start"):
        _learner(_model(), coefs=LossCoefs(clip_around="start"))
