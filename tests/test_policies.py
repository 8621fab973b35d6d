"""Several policies in one run (``multiagent.policies``): the model that routes rows by their policy column, the
learner that trains each policy on its own rows only, the env that maps agents to policies, and a real run."""

import copy

import numpy as np
import pytest
import torch

from learner.learner import Learner
from learner.model import ActorCritic, PolicySet, build_model
from learner.ppo import LossCoefs
from learner.spec import PolicyEntry
from pipeline import fragment as F
from pipeline import metric_keys as M
from tests.conftest import vector_spec

OBS = 6  # columns each policy reads; the rows carry one more, the policy index


def two_policy_spec(frozen_b=False, lr_b=None, hidden_b=None):
    base = vector_spec((OBS + 1,), action_kind="discrete", action_dim=3)
    import dataclasses

    return dataclasses.replace(base, policies=(PolicyEntry("a"), PolicyEntry("b", hidden_sizes=hidden_b, lr=lr_b,
                                                                             frozen=frozen_b)))


def learner_for(model, minibatch, lr=1e-3, epochs=1, fused_update=False):
    return Learner(model, lr=lr, adam_eps=1e-5, anneal_lr=False, total_updates=10, update_epochs=epochs,
                   minibatch_size=minibatch, max_grad_norm=0.5, coefs=LossCoefs(ent_coef=0.01),
                   device=torch.device("cpu"), seed=0, fused_update=fused_update)


def batch_of(ids: np.ndarray, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = len(ids)
    obs = torch.randn(n, OBS, generator=g)
    obs = torch.cat([obs, torch.as_tensor(ids, dtype=torch.float32)[:, None]], dim=1)
    return {F.obs_key("vector"): obs, F.ACTIONS: torch.randint(0, 3, (n,), generator=g),
            F.LOGP: -torch.rand(n, generator=g) - 0.5, F.VALUES: torch.randn(n, generator=g),
            F.ADVANTAGES: torch.randn(n, generator=g) * 3 + (torch.as_tensor(ids) * 5.0),  # scales differ by policy
            F.RETURNS: torch.randn(n, generator=g)}


def rows(batch: dict, mask) -> dict:
    out = {k: v[mask] for k, v in batch.items()}
    out[F.obs_key("vector")] = out[F.obs_key("vector")][:, :-1]
    return out


def test_rows_go_to_their_policy_in_the_input_order():
    torch.manual_seed(0)
    model = PolicySet(two_policy_spec(hidden_b=(16,)))
    ids = np.array([1, 0, 0, 1, 1, 0, 1, 0])
    batch = batch_of(ids)
    obs = {"vector": batch[F.obs_key("vector")]}
    _, _, values = model.act(obs, deterministic=True)
    for p, name in enumerate("ab"):
        mask = torch.as_tensor(ids == p)
        own = model.policies[name].value({"vector": obs["vector"][mask, :-1]})
        assert torch.allclose(values[mask], own)
        logp, ent, v = model.evaluate(obs, batch[F.ACTIONS])
        own_logp, own_ent, own_v = model.policies[name].evaluate({"vector": obs["vector"][mask, :-1]},
                                                                 batch[F.ACTIONS][mask])
        assert torch.allclose(logp[mask], own_logp) and torch.allclose(v[mask], own_v)
    # Each policy reads the columns before the index, with its own hidden layers.
    assert model.policies["b"].spec.hidden_sizes == (16,) and model.policies["a"].spec.hidden_sizes == (64, 64)
    assert model.policies["a"].spec.modalities[0].shape == (OBS,)


def test_each_policy_trains_on_its_own_rows_as_if_alone():
    """One update of the two-policy model equals, for each policy, an update of that policy alone on its rows:
    its own advantage normalisation, its own loss mean, its own gradient clip, its own Adam state. Red when the
    loss is taken over the mixed minibatch (the advantage scales differ by policy) or the clip is global."""
    torch.manual_seed(0)
    model = PolicySet(two_policy_spec(lr_b=3e-3))
    alone = {name: copy.deepcopy(model.policies[name]) for name in "ab"}
    ids = np.array([0, 1] * 24 + [1] * 16)
    batch = batch_of(ids)
    stats = learner_for(model, minibatch=len(ids)).update(batch)
    for p, name in enumerate("ab"):
        mask = torch.as_tensor(ids == p)
        lr = 3e-3 if name == "b" else 1e-3
        own = learner_for(alone[name], minibatch=int(mask.sum()), lr=lr).update(rows(batch, mask))
        for (key, mine), theirs in zip(model.policies[name].state_dict().items(), alone[name].state_dict().values()):
            assert torch.allclose(mine, theirs, atol=1e-6), f"policy {name}: {key} differs from its update alone"
        assert stats[M.policy_key(name, M.POLICY_LOSS)] == pytest.approx(own[M.POLICY_LOSS], abs=1e-6)
        assert stats[M.policy_key(name, M.GRAD_NORM)] == pytest.approx(own[M.GRAD_NORM], rel=1e-5)
        assert stats[M.policy_key(name, M.POLICY_SAMPLES)] == int(mask.sum())
        assert stats[M.policy_key(name, M.LR)] == pytest.approx(lr)


def test_a_frozen_policy_never_changes_and_has_no_optimizer_group():
    torch.manual_seed(0)
    model = PolicySet(two_policy_spec(frozen_b=True))
    before = copy.deepcopy(model.policies["b"].state_dict())
    a_before = copy.deepcopy(model.policies["a"].state_dict())
    learner = learner_for(model, minibatch=32, epochs=2, fused_update=True)
    assert [g["policy"] for g in learner.optimizer.param_groups] == ["a"]
    assert learner.update_path.startswith("autograd (several policies")
    stats = learner.update(batch_of(np.array([0, 1] * 32)))
    for key, value in model.policies["b"].state_dict().items():
        assert torch.equal(value, before[key])
    assert any(not torch.equal(v, a_before[k]) for k, v in model.policies["a"].state_dict().items())
    assert M.policy_key("b", M.POLICY_LOSS) not in stats and stats[M.policy_key("b", M.POLICY_SAMPLES)] == 32


def test_build_model_picks_by_the_spec():
    assert isinstance(build_model(vector_spec((4,))), ActorCritic)
    assert isinstance(build_model(two_policy_spec()), PolicySet)
