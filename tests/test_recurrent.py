"""Recurrent policies (learner.rnn): the state the rollouts carry and store, truncated BPTT in the update, and a
memory task that a memoryless policy cannot learn. Real envs (actors/probe_envs.py), real torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import actors.probe_envs  # noqa: F401  (registers the probe envs)
from actors.envs import describe_env
from actors.sampler import RolloutSampler, SamplerSettings
from cluster import config as C
from learner.learner import Learner, LearnerSettings
from learner.model import ActorCritic
from learner.ppo import LossCoefs
from learner.spec import spec_from_description
from pipeline import fragment as F

CUE = "actors.probe_envs:AscentRL/CueRecall-v0"
T, N = 10, 3  # delay 3: episodes of 4 steps, so episodes end inside every fragment


def cue_spec(rnn: str, hidden: int = 8):
    return spec_from_description(describe_env(CUE, env_kwargs={"delay": 3}), (16,), rnn=rnn, rnn_hidden_size=hidden)


def sampler_for(spec, seed: int = 0) -> RolloutSampler:
    torch.manual_seed(seed)
    model = ActorCritic(spec)
    sampler = RolloutSampler(SamplerSettings(env_id=CUE, num_envs=N, fragment_length=T, gamma=0.99, gae_lambda=0.95,
                                             seed=seed, env_kwargs={"delay": 3}), lambda: ActorCritic(spec))
    sampler.load_weights(0, {k: v.numpy() for k, v in model.state_dict().items()})
    return sampler


def unroll(model: ActorCritic, obs: np.ndarray, state0: np.ndarray, starts: np.ndarray):
    """Step by step, one env at a time, from ``state0`` (N, S), zeroing the state where an episode starts:
    (states going into each step (T, N, S), log-probs of ``actions``...). The reference every chunked or batched
    path is compared with."""
    states = np.zeros((obs.shape[0], obs.shape[1], state0.shape[1]), dtype=np.float32)
    with torch.no_grad():
        for n in range(obs.shape[1]):
            state = torch.from_numpy(state0[n:n + 1])
            for t in range(obs.shape[0]):
                if starts[t, n]:
                    state = torch.zeros_like(state)
                states[t, n] = state.numpy()[0]
                _, state = model._core_step(model.trunk(model.encode({"vector": torch.from_numpy(obs[t, n:n + 1])})),
                                            state)
    return states


@pytest.mark.parametrize("rnn", ["gru", "lstm"])
def test_rollouts_store_the_behaviour_state_and_reset_it_at_every_episode_start(rnn):
    sampler = sampler_for(cue_spec(rnn))
    for fragment in (sampler.collect(), sampler.collect()):  # the second starts mid-episode, from a carried state
        states, starts = fragment.arrays[F.RNN_STATE], fragment.arrays[F.EPISODE_START]
        assert states.shape == (T, N, sampler.policy.spec.state_size)
        done = fragment.arrays[F.TERMINATED] | fragment.arrays[F.TRUNCATED]
        assert (starts[1:] == done[:-1]).all()  # an episode starts right after one ends, autoresets included
        assert starts.any() and (~starts).any()
        assert (states[starts] == 0).all()  # nothing leaks across an episode boundary
        assert (np.abs(states[~starts]).sum(-1) > 0).all()
        # Every stored state is the one the policy reached by stepping through the fragment's own observations.
        expected = unroll(sampler.policy, fragment.arrays[F.obs_key("vector")], states[0], starts)
        np.testing.assert_allclose(states, expected, atol=1e-5)


def make_learner(spec, seq_len: int, *, minibatch: int, precision: str = "fp32", lr: float = 1e-3,
                 epochs: int = 2, coefs: LossCoefs = LossCoefs()) -> Learner:
    torch.manual_seed(0)
    return Learner(ActorCritic(spec), LearnerSettings(lr=lr, adam_eps=1e-5, anneal_lr=False, total_updates=10,
                                                      update_epochs=epochs, minibatch_size=minibatch,
                                                      max_grad_norm=0.5, coefs=coefs, precision=precision,
                                                      sequence_layout=(T, N), seq_len=seq_len), torch.device("cpu"))


def batch_of(fragments) -> dict[str, torch.Tensor]:
    keys = F.train_keys(fragments[0].arrays)
    return {k: torch.from_numpy(np.concatenate([f.flat(k) for f in fragments])) for k in keys}


@pytest.mark.parametrize("rnn, seq_len", [("gru", 10), ("gru", 5), ("lstm", 5), ("lstm", 2)])
def test_the_update_sees_the_behaviour_log_probs_before_it_steps(rnn, seq_len):
    """Chunked into sequences from the stored states, the learner's log-probs equal the behaviour log-probs on
    every step (ratio 1, KL 0) when the weights are the acting ones: a wrong stored state, a sequence cut across
    fragments or envs, or a padded step would each move some ratio away from 1."""
    spec = cue_spec(rnn)
    sampler = sampler_for(spec)
    fragments = [sampler.collect() for _ in range(2)]
    learner = make_learner(spec, seq_len, minibatch=10, lr=1e-9, epochs=1)
    learner.model.load_state_dict(sampler.policy.state_dict())
    stats = learner.update(batch_of(fragments))
    assert stats["approx_kl"] < 1e-9 and stats["clip_fraction"] == 0.0, stats
    assert learner.update_path.startswith(f"autograd (learner.rnn is {rnn}")
    assert stats["minibatch_steps"] == 2 * T * N // 10


@pytest.mark.parametrize("rnn, seq_len", [("gru", 5), ("lstm", 2)])
def test_update_start_reads_the_start_log_probs_through_the_same_sequences(rnn, seq_len):
    """ppo.clip_around update_start with a stale behaviour (stored log-probs moved by noise): the update's own
    forward of the cut sequences gives the start's log-probs, so the first step's ratio is 1 on every step (a start
    forward that cut, ordered or reset the sequences differently from the step would move some ratio), while the
    same batch clipped around the behaviour is clipped."""
    spec = cue_spec(rnn)
    sampler = sampler_for(spec)
    batch = batch_of([sampler.collect() for _ in range(2)])
    batch[F.LOGP] = batch[F.LOGP] + 0.5 * torch.randn(batch[F.LOGP].shape, generator=torch.Generator().manual_seed(0))
    for clip_around in ("update_start", "behaviour"):
        learner = make_learner(spec, seq_len, minibatch=10, lr=1e-9, epochs=1,
                               coefs=LossCoefs(clip_around=clip_around))
        learner.model.load_state_dict(sampler.policy.state_dict())
        stats = learner.update(batch)
        if clip_around == "update_start":
            assert stats["approx_kl"] < 1e-9 and stats["clip_fraction"] == 0.0, stats
        else:
            assert stats["clip_fraction"] > 0.3, stats


def test_a_perturbed_past_does_not_reach_across_an_episode_start():
    spec = cue_spec("lstm")
    model = ActorCritic(spec)
    L, B = 6, 2
    obs = torch.rand(L, B, 3)
    actions = torch.randint(0, 2, (L, B))
    state0 = torch.randn(B, spec.state_size)
    starts = torch.zeros(L, B, dtype=torch.bool)
    starts[3, 0] = True  # env 0 begins an episode at step 3
    with torch.no_grad():
        base = model.evaluate_sequences({"vector": obs}, actions, state0, starts)[0].reshape(L, B)
        changed = obs.clone()
        changed[:3] += 1.0
        after = model.evaluate_sequences({"vector": changed}, actions, state0 * 3, starts)[0].reshape(L, B)
    assert torch.equal(base[3:, 0], after[3:, 0])  # env 0 after its episode start: untouched by what came before
    assert not torch.allclose(base[3:, 1], after[3:, 1])  # env 1, same episode throughout: its past matters


@pytest.mark.parametrize("rnn", ["gru", "lstm"])
def test_chunked_bptt_gradients_equal_a_step_by_step_unroll(rnn):
    """The gradient of a loss over sequences chunked from stored states, against a plain per-env, per-step loop
    that starts each chunk from the same (detached) stored state: equal to 1e-5 for every parameter."""
    spec = cue_spec(rnn, hidden=6)
    sampler = sampler_for(spec, seed=3)
    frag = sampler.collect()
    model = sampler.policy
    model.train()
    L = 5
    obs = torch.from_numpy(frag.arrays[F.obs_key("vector")])
    actions = torch.from_numpy(frag.arrays[F.ACTIONS])
    states = torch.from_numpy(frag.arrays[F.RNN_STATE])
    starts = torch.from_numpy(frag.arrays[F.EPISODE_START])

    def loss_of(logp, value):
        return (logp * torch.linspace(0.5, 1.5, logp.numel()).reshape(logp.shape)).sum() + (value ** 2).sum()

    # Chunked: (T, N) -> chunks of L, as the learner cuts them.
    chunks = [(slice(c, c + L)) for c in range(0, T, L)]
    model.zero_grad()
    logps, values = [], []
    for c in chunks:
        logp, _, value = model.evaluate_sequences({"vector": obs[c]}, actions[c], states[c][0], starts[c])
        logps.append(logp.reshape(L, N))
        values.append(value.reshape(L, N))
    loss_of(torch.cat(logps), torch.cat(values)).backward()
    chunked = {k: p.grad.clone() for k, p in model.named_parameters()}

    model.zero_grad()
    rows_logp, rows_value = [[None] * N for _ in range(T)], [[None] * N for _ in range(T)]
    for n in range(N):
        for c in chunks:
            state = states[c.start, n:n + 1]
            for t in range(c.start, c.stop):
                if starts[t, n]:
                    state = torch.zeros_like(state)
                h, state = model._core_step(model.trunk(model.encode({"vector": obs[t, n:n + 1]})), state)
                logits = model.policy_head(h)
                rows_logp[t][n] = torch.log_softmax(logits, -1)[0, actions[t, n]]
                rows_value[t][n] = model.value_head(h)[0, 0]
    logp_ref = torch.stack([torch.stack(r) for r in rows_logp])
    value_ref = torch.stack([torch.stack(r) for r in rows_value])
    loss_of(logp_ref, value_ref).backward()
    for k, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, k
        torch.testing.assert_close(chunked[k], p.grad, atol=1e-5, rtol=1e-5, msg=k)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_recurrent_updates_in_reduced_precision(precision):
    spec = cue_spec("lstm")
    sampler = sampler_for(spec)
    batch = batch_of([sampler.collect() for _ in range(2)])
    learner = make_learner(spec, 5, minibatch=10, precision=precision)
    before = learner.flat_params()
    stats = learner.update(batch)
    assert all(np.isfinite(v) for v in stats.values() if isinstance(v, float)), stats
    assert not np.allclose(before, learner.flat_params())


def test_recurrent_config_errors_name_the_key():
    base = {"env": {"id": CUE}, "learner": {"rnn": "gru", "batch_size": 512, "minibatch_size": 128},
            "rollout": {"fragment_length": 32, "envs_per_actor": 16}}
    with pytest.raises(C.ConfigError, match=r"learner.rnn_seq_len: 12 does not divide rollout.fragment_length \(32\)"):
        C.from_dict({**base, "learner": {**base["learner"], "rnn_seq_len": 12}})
    with pytest.raises(C.ConfigError, match=r"learner.rnn_seq_len: 32 does not divide the per-learner minibatch"):
        C.from_dict({**base, "learner": {**base["learner"], "minibatch_size": 48, "batch_size": 1536}})
    with pytest.raises(C.ConfigError, match=r"learner.rnn"):
        C.from_dict({**base, "learner": {**base["learner"], "rnn": "transformer"}})
    assert C.from_dict(base).seq_len == 32


@pytest.mark.long  # learning run to a threshold (`make test-long`; CI runs it)
def test_a_recurrent_policy_learns_to_recall_the_cue(tmp_path):
    """The memory task in make test: a GRU reaches a 100-episode mean of 0.9 (of 1; a memoryless policy's
    expectation is 0) in process, and the saved policy, carrying its state through Policy.act, answers right."""
    from cluster.api import load_policy, train

    result = train("configs/cartpole.yaml", run_dir=tmp_path / "run", env__id=CUE, env__kwargs={"delay": 12},
                   ray__address="inprocess", run__target_return=0.9, run__total_env_steps=100_000,
                   run__require_target=False, rollout__envs_per_actor=16, rollout__fragment_length=26,
                   learner__batch_size=416, learner__minibatch_size=104, learner__lr=1e-3, learner__rnn="gru",
                   learner__rnn_hidden_size=32, ppo__ent_coef=0.01, ppo__gamma=0.99, ppo__gae_lambda=0.95)
    assert result.reached_target, (result.reason, result.env_steps, result.metrics.get("episode_return_mean"))
    policy = load_policy(tmp_path / "run", trust_code=True)
    env = policy.make_env()

    def episode_return(seed: int, reset_every_step: bool) -> float:
        obs, _ = env.reset(seed=seed)
        policy.reset()
        total, done = 0.0, False
        while not done:
            if reset_every_step:
                policy.reset()  # forget: the memoryless view
            obs, reward, done, _, _ = env.step(policy.act(obs, deterministic=True))
            total += reward
        return total

    with_memory = [episode_return(s, False) for s in range(40)]
    assert np.mean(with_memory) >= 0.9
    forgetting = [episode_return(s, True) for s in range(40)]
    assert np.mean(forgetting) < 0.6  # the same weights without the carried state: about chance (0)
    from cluster.evaluate import evaluate

    assert evaluate(policy, 40, deterministic=True)["return_mean"] >= 0.9  # it resets the state per episode
    # Periodic evaluation's own path (actors/evaluator.py: a fresh sampler, 8 envs side by side) on these weights.
    from actors.evaluator import Evaluator
    from learner.model import state_dict_numpy

    evaluator = Evaluator(SamplerSettings(env_id=CUE, env_kwargs={"delay": 12}, num_envs=8, fragment_length=26,
                                          gamma=0.99, gae_lambda=0.95, seed=7),
                          lambda: ActorCritic(policy.spec), episodes=40)
    assert evaluator.run(1, state_dict_numpy(policy.model))["return_mean"] >= 0.9


@pytest.mark.long  # a larger layout of the in-process recurrent runs (`make test-long`; CI runs it)
def test_recurrent_training_on_ray_with_two_learners_at_lag_0(ray_local, tmp_path):
    """The Ray path: 2 rollout actors, 2 learners all-reducing an LSTM's gradients, replay.max_policy_lag 0 and
    periodic evaluation (its own sampler, carrying the state), for 24 updates. That the recurrent policy learns is
    the in-process test's (above): learning to the target here cost 30 s more of a loaded 2-core machine's suite,
    for the same update code."""
    from bench._train import read_records
    from cluster.api import train

    result = train("configs/cue_recall.yaml", run_dir=tmp_path / "run", learner__rnn="lstm", learner__num_learners=2,
                   rollout__num_actors=2, rollout__envs_per_actor=8, replay__num_shards=2, replay__max_policy_lag=0,
                   eval__interval_iterations=4, eval__episodes=20, run__total_env_steps=24 * 416,
                   run__target_return=None, run__require_target=False)
    assert result.reason == "total_env_steps", result.reason
    records = read_records(tmp_path / "run")
    assert records[-1]["policy_version"] >= 16 and records[-1]["learner_restarts"] == 0
    assert {r["policy_lag_max"] for r in records} == {0}
    assert records[0]["update_path"].startswith("autograd (learner.rnn is lstm")  # (in the first record)
    # Periodic evaluation ran on Ray (its scores are checked on the in-process run's final weights: here the
    # versions it happened to evaluate depend on timing).
    assert [r["eval_return_mean"] for r in records if r.get("eval_return_mean") is not None]
