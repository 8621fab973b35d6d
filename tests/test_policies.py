"""Several policies in one run (``multiagent.policies``): the model that routes rows by their policy column, the
learner that trains each policy on its own rows only, the env that maps agents to policies, and a real run."""

import contextlib
import copy
import io

import numpy as np
import pytest
import torch

from learner.learner import Learner, LearnerSettings
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


def learner_for(model, minibatch, lr=1e-3, epochs=1, fused_update=False, clip_around="behaviour"):
    return Learner(model, LearnerSettings(lr=lr, adam_eps=1e-5, anneal_lr=False, total_updates=10,
                                          update_epochs=epochs, minibatch_size=minibatch, max_grad_norm=0.5,
                                          coefs=LossCoefs(ent_coef=0.01, clip_around=clip_around), seed=0,
                                          fused_update=fused_update),
                   torch.device("cpu"))


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


@pytest.mark.parametrize("clip_around", ["behaviour", "update_start"])
def test_each_policy_trains_on_its_own_rows_as_if_alone(clip_around):
    """One update of the two-policy model equals, for each policy, an update of that policy alone on its rows:
    its own advantage normalisation, its own loss mean, its own gradient clip, its own Adam state. Red when the
    loss is taken over the mixed minibatch (the advantage scales differ by policy) or the clip is global. Under
    update_start, also each row's start log-prob and importance weight from its own policy."""
    torch.manual_seed(0)
    model = PolicySet(two_policy_spec(lr_b=3e-3))
    alone = {name: copy.deepcopy(model.policies[name]) for name in "ab"}
    ids = np.array([0, 1] * 24 + [1] * 16)
    batch = batch_of(ids)
    stats = learner_for(model, minibatch=len(ids), clip_around=clip_around).update(batch)
    for p, name in enumerate("ab"):
        mask = torch.as_tensor(ids == p)
        lr = 3e-3 if name == "b" else 1e-3
        own = learner_for(alone[name], minibatch=int(mask.sum()), lr=lr,
                          clip_around=clip_around).update(rows(batch, mask))
        for (key, mine), theirs in zip(model.policies[name].state_dict().items(), alone[name].state_dict().values()):
            assert torch.allclose(mine, theirs, atol=1e-6), f"policy {name}: {key} differs from its update alone"
        assert stats[M.policy_key(name, M.POLICY_LOSS)] == pytest.approx(own[M.POLICY_LOSS], abs=1e-6)
        assert stats[M.policy_key(name, M.GRAD_NORM)] == pytest.approx(own[M.GRAD_NORM], rel=1e-5)
        assert stats[M.policy_key(name, M.POLICY_SAMPLES)] == int(mask.sum())
        assert stats[M.policy_key(name, M.LR)] == pytest.approx(lr)


@pytest.mark.parametrize("clip_around", ["behaviour", "update_start"])
def test_a_frozen_policy_never_changes_and_has_no_optimizer_group(clip_around):
    """A frozen policy's rows reach nothing: here their stored log-probs are NaN (under update_start, so is their
    importance weight), and policy a still trains to finite weights."""
    torch.manual_seed(0)
    model = PolicySet(two_policy_spec(frozen_b=True))
    before = copy.deepcopy(model.policies["b"].state_dict())
    a_before = copy.deepcopy(model.policies["a"].state_dict())
    learner = learner_for(model, minibatch=32, epochs=2, fused_update=True, clip_around=clip_around)
    assert [g["policy"] for g in learner.optimizer.param_groups] == ["a"]
    assert learner.update_path.startswith("autograd (several policies")
    ids = np.array([0, 1] * 32)
    batch = batch_of(ids)
    batch[F.LOGP][torch.as_tensor(ids == 1)] = float("nan")
    stats = learner.update(batch)
    assert stats["nonfinite"] is None and all(torch.isfinite(v).all() for v in model.state_dict().values())
    for key, value in model.policies["b"].state_dict().items():
        assert torch.equal(value, before[key])
    assert any(not torch.equal(v, a_before[k]) for k, v in model.policies["a"].state_dict().items())
    assert M.policy_key("b", M.POLICY_LOSS) not in stats and stats[M.policy_key("b", M.POLICY_SAMPLES)] == 32


def test_build_model_picks_by_the_spec():
    assert isinstance(build_model(vector_spec((4,))), ActorCritic)
    assert isinstance(build_model(two_policy_spec()), PolicySet)


# ---------------------------------------------------------------------------------------------- the env side
SEATS = "actors.probe_envs:name_your_seat"
TAG = "mpe2:simple_tag_v3"
TAG_POLICIES = {"policies": {"predator": {}, "prey": {}}, "mapping": {"adversary_*": "predator", "agent_*": "prey"}}


def test_slots_are_padded_to_the_widest_agent_and_end_in_their_policy_index():
    from actors.envs import make_vector_env

    env = make_vector_env(TAG, 8, env_kwargs={"max_cycles": 25},
                          multiagent={"api": "parallel", **TAG_POLICIES, "policies": ["predator", "prey"]})
    obs = env.reset(seed=0)
    assert obs.shape == (8, 17) and env.single_observation_space.shape == (17,)
    assert env.slot_policy.tolist() == [0, 0, 0, 1] * 2
    assert obs[:, -1].tolist() == [0, 0, 0, 1] * 2
    prey = obs[3]
    assert np.all(prey[14:16] == 0) and np.any(prey[:14] != 0), "the prey's 14 numbers, then zeros to 16"
    env.close()


def _cfg(data):
    from cluster import config as config_mod

    return config_mod.from_dict(data)


@pytest.mark.parametrize("data, message", [
    ({"env": {"id": TAG}, "multiagent": {"policies": {"a": {}}, "mapping": {"adversary_*": "b"}}},
     r"multiagent.mapping.adversary_\*: 'b' is not a policy of multiagent.policies; allowed: a"),
    ({"env": {"id": TAG}, "multiagent": {"policies": {"predator": {}}, "mapping": {"adversary_*": "predator"}}},
     r"multiagent.mapping: no pattern matches agent 'agent_0' of 'mpe2:simple_tag_v3'"),
    ({"env": {"id": TAG}, "multiagent": {"policies": {"all": {}}, "mapping": {"*": "all"}}},
     r"agents 'adversary_0' and 'agent_0' of 'mpe2:simple_tag_v3' map to policy 'all' but observe"),
    ({"env": {"id": TAG}, "multiagent": {"policies": {"a": {}}}}, r"multiagent.mapping: empty, but"),
    ({"env": {"id": TAG}, "multiagent": {"mapping": {"*": "a"}}}, r"multiagent.mapping: .* is set, but "
                                                                   r"multiagent.policies is empty"),
    ({"env": {"id": TAG}, "multiagent": {"policies": {"a": {"frozen": True}}, "mapping": {"*": "a"}}},
     r"multiagent.policies: every policy is frozen"),
    ({"env": {"id": "pettingzoo.classic:connect_four_v3",
              "modalities": {"observation": {"kind": "vector", "normalize": False}}},
      "multiagent": {"policies": {"a": {}}, "mapping": {"*": "a"}}}, r"multiagent.policies: set, and .* runs "
                                                                      r"turn-based"),
    ({"env": {"id": SEATS}, "multiagent": {"policies": {"a": {}}, "mapping": {"*": "a"}},
      "learner": {"rnn": "gru"}}, r"learner.rnn: 'gru' with multiagent.policies"),
    ({"multiagent": {"policies": {"a": {}}, "mapping": {"*": "a"}}},
     r"multiagent.policies: \['a'\] is set, but env.id 'CartPole-v1' is a single-agent gymnasium env"),
])
def test_bad_policy_settings_are_one_line_naming_the_key(data, message):
    from cluster.config import ConfigError
    from cluster.graph import describe_env as describe

    with pytest.raises(ConfigError, match=message) as e:
        describe(_cfg(data))
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- runs
def _records(run_dir):
    import json

    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def test_each_policy_learns_its_own_seat_and_a_frozen_one_stays_at_chance(tmp_path):
    """NameYourSeat with a policy per agent and no agent index: p0 and p1 learn to name their own seat (8 a game),
    p2 is frozen and stays at chance (its agent leaves after 4 steps: 4/3 in expectation). Every update's batch
    holds exactly a third of each policy's rows (the fragments hold 8 slots of each), and load_policy(policy=)
    gives one policy that acts on its agent's own observation."""
    from actors.probe_envs import NameYourSeat
    from cluster.api import load_policy
    from tests.conftest import train_to_end

    cfg = _cfg({"env": {"id": SEATS},
                "multiagent": {"policies": {"p0": {}, "p1": {"lr": 5e-3}, "p2": {"frozen": True}},
                               "mapping": {"agent_0": "p0", "agent_1": "p1", "agent_2": "p2"}},
                "rollout": {"envs_per_actor": 24, "fragment_length": 16},
                "learner": {"batch_size": 384, "minibatch_size": 96, "lr": 3e-3},
                "ppo": {"ent_coef": 0.0},
                "run": {"total_env_steps": 15000, "target_window": 96, "checkpoint_interval_s": None},
                "ray": {"address": "inprocess"}})
    train_to_end(cfg, tmp_path / "run")
    records = _records(tmp_path / "run")
    for r in records:
        assert [r[M.policy_key(p, M.POLICY_SAMPLES)] for p in ("p0", "p1", "p2")] == [128, 128, 128]
        assert M.policy_key("p2", M.POLICY_LOSS) not in r
    last = records[-1]
    assert last[M.policy_key("p0", M.EPISODE_RETURN_MEAN)] > 0.9 * NameYourSeat.STEPS
    assert last[M.policy_key("p1", M.EPISODE_RETURN_MEAN)] > 0.9 * NameYourSeat.STEPS
    assert last[M.policy_key("p2", M.EPISODE_RETURN_MEAN)] < NameYourSeat.LEAVES_AT / 3 + 1.0
    assert records[0][M.policy_key("p1", M.LR)] == pytest.approx(5e-3, rel=0.2)  # its own lr, annealed

    one = load_policy(tmp_path / "run", policy="p1", trust_code=True)
    assert one.observation_space.shape == (2,)  # NameYourSeat's 2 numbers, without the policy column
    assert all(one.act(np.array([1.0, bit], np.float32), deterministic=True) == 1 for bit in (0.0, 1.0))
    from cluster.config import ConfigError

    with pytest.raises(ConfigError, match=r"policy: 'p9' is not a policy of .*; allowed: p0, p1, p2"):
        load_policy(tmp_path / "run", policy="p9", trust_code=True)

    # cluster.evaluate plays whole games (each agent by its own policy) and reports one policy's agents.
    from cluster import evaluate

    def evaluate_line(*extra):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = evaluate.main([str(tmp_path / "run"), "--episodes", "4", "--deterministic", "--trust-code",
                                  *extra])
        return code, out.getvalue()

    code, line = evaluate_line("--policy", "p1")
    assert code == 0 and "4 episodes (deterministic) | return 8.00 ± 0.00 | length 8.0" in line, line
    code, line = evaluate_line()
    assert code == 0 and "12 episodes" in line and "length 6.7" in line, line  # agent_2 leaves after 4 steps
    assert evaluate_line("--policy", "p9")[0] == 2

    # Export: one policy at a time (its graph takes the agent's observation), the whole set is one line, exit 2.
    from cluster import export

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert export.main([str(tmp_path / "run"), "--out", str(tmp_path / "all.pt2"), "--trust-code"]) == 2
    assert "several policies (p0, p1, p2), exported one at a time; allowed: --policy NAME" in err.getvalue()
    with contextlib.redirect_stdout(io.StringIO()):
        assert export.main([str(tmp_path / "run"), "--out", str(tmp_path / "p1.pt2"), "--trust-code",
                            "--policy", "p1"]) == 0
    program = torch.export.load(str(tmp_path / "p1.pt2")).module()
    action = program(torch.tensor([[1.0, 0.0], [1.0, 1.0]]))[0]
    assert action.tolist() == [1, 1]


@pytest.mark.long  # a second model of test_faults.py's killed-actor test (`make test-long`; CI runs it)
def test_a_killed_rollout_actor_of_a_two_policy_run_keeps_each_policys_batch_exact(ray_local, tmp_path):
    """Predator and prey on Ray, 2 rollout actors and 2 shards: one actor is SIGKILLed mid-run; it is replaced,
    every update trains exactly its fragments (none twice), and so exactly 3/4 predator and 1/4 prey rows."""
    from tests.test_env_faults import multiagent_run_with_a_killed_actor

    records = multiagent_run_with_a_killed_actor(
        {"env": {"id": TAG, "kwargs": {"max_cycles": 25, "continuous_actions": False}}, "multiagent": TAG_POLICIES},
        tmp_path / "run")
    for r in records:
        assert (r[M.policy_key("predator", M.POLICY_SAMPLES)], r[M.policy_key("prey", M.POLICY_SAMPLES)]) == (384, 128)


def test_a_policy_without_rows_in_a_minibatch_takes_no_step():
    """Adam would move a policy's weights on momentum from a zero gradient; trained alone it would take no step,
    so in a minibatch without its rows (here: the second update's batch has none of b's) it takes none."""
    torch.manual_seed(0)
    model = PolicySet(two_policy_spec())
    learner = learner_for(model, minibatch=32)
    learner.update(batch_of(np.array([0, 1] * 16)))  # b trains once: its Adam state has momentum now
    before = copy.deepcopy(model.policies["b"].state_dict())
    stats = learner.update(batch_of(np.array([0] * 32), seed=1))
    for key, value in model.policies["b"].state_dict().items():
        assert torch.equal(value, before[key]), f"b moved without rows: {key}"
    assert stats[M.policy_key("b", M.POLICY_SAMPLES)] == 0 and M.policy_key("b", M.POLICY_LOSS) not in stats


def test_dry_run_prints_each_agent_and_the_policy_it_maps_to():
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = subprocess.run([sys.executable, "-m", "cluster.train", "--config", str(ROOT / "configs/predator_prey.yaml"),
                          "--dry-run"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("# agent ")]
    assert [ln.rsplit("-> ", 1)[1] for ln in lines] == ["policy 'predator' (one env slot each)"] * 3 + [
        "policy 'prey' (one env slot each)"]
    assert "Box(-inf, inf, (14,), float32)" in lines[3]  # the prey's own 14 numbers (its slot pads them to 16)
