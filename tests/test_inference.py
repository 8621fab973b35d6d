"""Batched rollout inference (rollout.inference: remote, actors/inference.py): exact against the local copy, per
version, batched, and never a dependency (a stopped or killed server leaves the actors on their local copies)."""

import asyncio
import functools
import json
import os
import signal
import threading
import time

import numpy as np
import pytest
import ray as _ray
import torch

from actors.inference import InferenceServer, RemoteInferenceServer
from actors.sampler import RolloutSampler, SamplerSettings
from cluster import config as config_mod
from cluster.config import ConfigError
from learner.model import ActorCritic, state_dict_numpy
from pipeline import fragment as F
from tests.conftest import ROOT, build_and_run_striking, env_spec

FETCH = "minigrid:MiniGrid-Fetch-5x5-N2-v0"


def weights(spec, seed: int) -> dict:
    """Weights far enough from the initial near-uniform policy that a wrong row or version shows in every action."""
    torch.manual_seed(seed)
    model = ActorCritic(spec)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return state_dict_numpy(model)


def make_sampler(env_id, spec, server=None, modalities=None, seed=3) -> RolloutSampler:
    return RolloutSampler(SamplerSettings(env_id=env_id, num_envs=4, fragment_length=16, gamma=0.99, gae_lambda=0.95,
                                          seed=seed, max_episode_steps=20, modalities=modalities),
                          functools.partial(ActorCritic, spec), inference=server)


def fragments(env_id, spec, state, server=None, modalities=None, n=2, seed=3) -> list[F.Fragment]:
    sampler = make_sampler(env_id, spec, server, modalities, seed)
    try:
        sampler.load_weights(5, state)
        out = [sampler.collect() for _ in range(n)]
    finally:
        sampler.close()
    if server is not None:
        stats = sampler.inference_stats()
        assert stats["inference_fallbacks"] == 0 and stats["inference_calls"] == n * 17, stats  # T steps + last value
    return out


def assert_same(local: list[F.Fragment], remote: list[F.Fragment]) -> None:
    for a, b in zip(local, remote):
        assert np.array_equal(a.arrays[F.ACTIONS], b.arrays[F.ACTIONS])
        for key in (F.LOGP, F.VALUES, F.ADVANTAGES, F.RETURNS):
            np.testing.assert_allclose(a.arrays[key], b.arrays[key], atol=1e-5, rtol=0)


def server_handle(spec, max_versions=2):
    """A started server (its process start and torch import take longer than a step's deadline)."""
    server = RemoteInferenceServer.remote(functools.partial(ActorCritic, spec), max_versions=max_versions)
    _ray.get(server.stats.remote(), timeout=60)
    return server


@pytest.mark.parametrize("env", ["cartpole", "fetch"])
def test_remote_inference_makes_the_local_copys_fragments(ray_local, env):
    """Same seed, same weights: the same actions, and log-probs and values to 1e-5 (the server's batch of several
    actors' rows may round differently from a batch of one actor's). CartPole: the state-only MLP pair; MiniGrid
    Fetch: a Dict observation (image + mission text) through the encoders, FiLM and the shared trunk."""
    if env == "cartpole":
        env_id, modalities, max_steps = "CartPole-v1", None, None
    else:
        env_id = FETCH
        modalities = config_mod.load(str(ROOT / "configs/minigrid_fetch.yaml"), []).env.modalities
        max_steps = 20
    spec = env_spec(env_id, max_steps, hidden_sizes=(64,), modalities=modalities)
    state = weights(spec, 1)
    server = server_handle(spec)
    try:
        local = fragments(env_id, spec, state, modalities=modalities)
        # Two actors at once on one server, so that its batches hold several actors' rows.
        other: list = []
        beside = threading.Thread(target=lambda: other.extend(fragments(env_id, spec, state, server, modalities,
                                                                        2, 4)))
        beside.start()
        remote = fragments(env_id, spec, state, server, modalities)
        beside.join(timeout=60)
        stats = _ray.get(server.stats.remote(), timeout=10)
    finally:
        _ray.kill(server)
    assert_same(local, remote)
    assert len(other) == 2
    assert_same(fragments(env_id, spec, state, modalities=modalities, seed=4), other)
    assert stats["loads"] == 1 and stats["versions"] == [5] and stats["rows"] >= 2 * 2 * 17 * 4, stats
    assert any(f.episode_returns.size for f in local)  # episodes ended inside: the final-value path ran too


def run(coro):
    return asyncio.run(coro)


def test_each_request_is_answered_with_the_version_it_names_and_versions_are_bounded():
    spec = env_spec("CartPole-v1", hidden_sizes=(16,))
    server = InferenceServer(functools.partial(ActorCritic, spec), max_versions=2)
    states = {v: weights(spec, v) for v in (1, 2, 3)}
    obs = {"vector": np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)}

    def reference(v):
        model = ActorCritic(spec)
        model.load_state_dict({k: torch.tensor(x) for k, x in states[v].items()})
        with torch.inference_mode():
            return [t.numpy() for t in model._heads({k: torch.from_numpy(x) for k, x in obs.items()})]

    assert run(server.infer(1, obs)) is None  # not held, no weights: the caller sends them
    for v in (1, 2):
        run(server.infer(v, obs, states[v]))
    # The older kept version answers with its own weights, not the newest.
    for v in (1, 2):
        out, value = run(server.infer(v, obs))
        np.testing.assert_allclose(out, reference(v)[0], atol=1e-6)
        np.testing.assert_allclose(value, reference(v)[1], atol=1e-6)
    assert not np.allclose(reference(1)[0], reference(2)[0])
    run(server.infer(3, obs, states[3]))  # a third: the oldest goes
    assert server.stats()["versions"] == [2, 3]
    assert run(server.infer(1, obs)) is None
    np.testing.assert_allclose(run(server.infer(2, obs))[0], reference(2)[0], atol=1e-6)


def test_requests_queued_together_go_as_one_batch_and_each_gets_its_own_rows():
    spec = env_spec("CartPole-v1", hidden_sizes=(16,))
    server = InferenceServer(functools.partial(ActorCritic, spec), max_versions=2)
    states = {v: weights(spec, v) for v in (1, 2)}
    rng = np.random.default_rng(1)
    requests = [(1 + i % 2, {"vector": rng.normal(size=(1 + i, 4)).astype(np.float32)}) for i in range(6)]

    async def together():
        return await asyncio.gather(*(server.infer(v, o, states[v]) for v, o in requests))

    answers = run(together())
    assert server.stats()["batches"] == 2  # one forward per version, whatever the number of callers
    for (v, o), (out, value) in zip(requests, answers):
        model = ActorCritic(spec)
        model.load_state_dict({k: torch.tensor(x) for k, x in states[v].items()})
        with torch.inference_mode():
            want_out, want_value = model._heads({"vector": torch.from_numpy(o["vector"])})
        assert out.shape == (len(o["vector"]), 2)
        np.testing.assert_allclose(out, want_out.numpy(), atol=1e-6)
        np.testing.assert_allclose(value, want_value.numpy(), atol=1e-6)


def stopping_setup(spec, state):
    """(server, its pid, a sampler on it whose client waits 0.5 s and retries after 1 s, with version 5 loaded)."""
    server = server_handle(spec)
    pid = _ray.get(server.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
    sampler = make_sampler("CartPole-v1", spec, server)
    sampler.inference.timeout_s, sampler.inference.retry_s = 0.5, 1.0
    sampler.load_weights(5, state)
    return server, pid, sampler


def test_a_stopped_server_leaves_the_actor_on_its_local_copy_until_it_answers_again(ray_local):
    spec = env_spec("CartPole-v1", hidden_sizes=(16,))
    state = weights(spec, 1)
    reference = fragments("CartPole-v1", spec, state, n=3)
    server, pid, sampler = stopping_setup(spec, state)
    client = sampler.inference
    try:
        first = sampler.collect()
        assert client.fallbacks == 0 and client.calls == 17
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            stopped = sampler.collect()  # one wait of timeout_s, then the local copy for every step
            took = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        assert client.fallbacks == 17 and "Timeout" in client.error and took < 4.0, (client.stats(), took)
        time.sleep(client.retry_s)
        third = sampler.collect()  # past the retry interval: the server again
        assert client.calls > 17, client.stats()
    finally:
        sampler.close()
        _ray.kill(server)
    assert_same(reference, [first, stopped, third])  # the steps served locally are the same steps


def test_a_late_answer_is_waited_for_once_while_the_server_works_on_it(ray_local):
    """A server busy for far longer than a step's wait (on an NPU the first call of a shape compiles; here the
    process is stopped for 3 s): the actor waits timeout_s once, then serves locally without asking again until that
    request answers, although its retry interval (0.2 s) passes many times; then the server serves again."""
    spec = env_spec("CartPole-v1", hidden_sizes=(16,))
    state = weights(spec, 1)
    server, pid, sampler = stopping_setup(spec, state)
    client = sampler.inference
    client.retry_s = 0.2
    try:
        sampler.collect()
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 3.0:
                sampler.collect()
        finally:
            os.kill(pid, signal.SIGCONT)
        assert client.late == 1, client.stats()  # before: one wait of timeout_s every retry interval
        calls = client.calls
        deadline = time.monotonic() + 10
        while client.calls == calls and time.monotonic() < deadline:
            sampler.collect()
        assert client.calls > calls, client.stats()
    finally:
        sampler.close()
        _ray.kill(server)


# In `make test-long` (Ray's restart of the process, ~6 s); the stopped server above covers the fallback itself.
@pytest.mark.long
def test_a_killed_server_is_restarted_by_ray_and_loads_the_version_on_its_first_miss(ray_local):
    spec = env_spec("CartPole-v1", hidden_sizes=(16,))
    state = weights(spec, 1)
    server, pid, sampler = stopping_setup(spec, state)
    client = sampler.inference
    try:
        sampler.collect()
        assert client.calls == 17
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30  # Ray's restart: a worker process and torch's import
        while client.calls == 17 and time.monotonic() < deadline:
            last = sampler.collect()
        assert client.calls > 17 and client.fallbacks > 0, client.stats()
        stats = _ray.get(server.stats.remote(), timeout=10)
        assert stats["versions"] == [5] and stats["loads"] == 1, stats  # a new process: loaded once, again
        assert _ray.get(server.__ray_call__.remote(lambda self: os.getpid()), timeout=10) != pid
    finally:
        sampler.close()
        _ray.kill(server)
    assert last.policy_version == 5


def test_remote_inference_is_refused_in_one_line_for_what_it_does_not_serve():
    base = str(ROOT / "configs/cartpole.yaml")
    assert config_mod.load(base, []).rollout.inference == "local"
    with pytest.raises(ConfigError, match=r"^rollout\.inference: remote, and learner\.rnn is 'lstm'.*allowed: "
                                          r"rollout\.inference: local"):
        config_mod.load(base, ["rollout.inference=remote", "learner.rnn=lstm"])
    with pytest.raises(ConfigError, match=r"^rollout\.inference: 'gpu' is not allowed; allowed: local, remote"):
        config_mod.load(base, ["rollout.inference=gpu"])
    with pytest.raises(ConfigError, match=r"rollout\.inference: remote, and multiagent\.policies"):
        config_mod.load(str(ROOT / "configs/predator_prey.yaml"), ["rollout.inference=remote"])


def run_cfg(*extra):
    return config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "rollout.inference=remote", "rollout.num_actors=2", "rollout.envs_per_actor=8", "run.require_target=false",
        "run.target_return=null", "run.checkpoint_interval_s=null", "run.total_env_steps=24576", *extra])


def run_and_read(cfg, run_dir, strike=None):
    """Train (``strike(trainer)`` in a thread meanwhile); (result, the rollout actors' stats, the servers' stats),
    read before the graph is torn down."""
    from cluster.driver import Trainer
    from pipeline import runtime

    trainer = Trainer(cfg, run_dir, quiet=True)
    try:
        result = build_and_run_striking(trainer, strike)
        actors = runtime.get([a.stats.remote() for a in trainer.rollouts], timeout=30)
        servers = list(trainer.graph.inference.values())
    finally:
        trainer.shutdown()
    return result, actors, servers


def records_of(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def test_a_run_with_remote_inference_in_process_trains_through_one_server(tmp_path):
    """In process (ray.address: inprocess) the server is an object on a thread of its own, called as the actors
    are: one for the run, answering every step."""
    result, actors, servers = run_and_read(run_cfg("ray.address=inprocess"), tmp_path / "run")
    assert result.reason == "total_env_steps" and len(servers) == 1
    assert all(a["inference_calls"] > 0 and a["inference_fallbacks"] == 0 for a in actors), actors
    last = records_of(tmp_path / "run")[-1]  # the records carry the actors' sums
    assert 0 < last["inference_calls"] <= sum(a["inference_calls"] for a in actors) and last["inference_fallbacks"] == 0


# In `make test-long` (a whole run, ~25 s): the sampler-level stop and kill test above guards the same fallback.
@pytest.mark.long
def test_a_run_goes_on_through_a_stopped_inference_server(ray_local, tmp_path):
    """SIGSTOP the node's server mid-run: each actor waits out one deadline, serves its steps from its local copy,
    and the run makes its fragments to the end."""
    from tests.conftest import wait_for_records

    stopped = []

    def stop_server(trainer):
        wait_for_records(tmp_path / "run", 2)
        (server,) = trainer.graph.inference.values()
        pid = _ray.get(server.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    try:
        result, actors, _ = run_and_read(run_cfg("run.total_env_steps=40960"), tmp_path / "run", stop_server)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    assert stopped and result.reason == "total_env_steps", (stopped, result.reason)
    assert all(a["inference_calls"] > 0 and a["inference_fallbacks"] > 0 and "Timeout" in a["inference_error"]
               for a in actors), actors
    assert records_of(tmp_path / "run")[-1]["inference_fallbacks"] > 0
