"""Temporal alignment of slow modalities: property tests on the aligner, and fragment records end to end.

The aligner is driven by a real ``EDFScheduler`` whose jobs wait on gates that
hypothesis opens in arbitrary orders, so values finish late, early and out of
order. Whatever the schedule: no observation uses a value from after its step,
or from another episode, or older than the bound, and every value is exactly
the one emitted at the source step it reports.
"""

from __future__ import annotations

import threading

import gymnasium as gym
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.sampler import RolloutSampler, SamplerSettings
from actors.multirate_env import ENV_ID, MODALITIES, MultiRateSensorEnv
from learner.model import ActorCritic, state_dict_numpy
from pipeline import fragment as F
from pipeline.aligner import Aligner
from pipeline.modality import ModalitySpec
from pipeline.scheduler import EDFScheduler
from tests.conftest import env_spec


def _emission(env: int, step: int, episode: int) -> np.ndarray:
    """A value that says where it came from."""
    return np.array([env, step, episode], dtype=np.int64)


@st.composite
def schedules(draw):
    num_envs = draw(st.integers(1, 3))
    every = draw(st.integers(1, 4))
    reset_only = draw(st.booleans())
    bound = None if reset_only else every - 1 + draw(st.integers(0, 3))
    steps = draw(st.integers(1, 30))
    # Per step and env: does the episode end here (the next observation is a reset)?
    ends = draw(st.lists(st.lists(st.booleans(), min_size=num_envs, max_size=num_envs), min_size=steps,
                         max_size=steps))
    # Per step: which of the still-closed gates to open before observing (indices into the open list, mod len).
    opens = draw(st.lists(st.lists(st.integers(0, 50), max_size=4), min_size=steps, max_size=steps))
    return num_envs, every, reset_only, bound, ends, opens


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules())
def test_aligned_values_are_never_from_the_future_another_episode_or_too_old(schedule):
    num_envs, every, reset_only, bound, ends, opens = schedule
    aligner = Aligner(num_envs, {"slow": bound}, wait_timeout_s=10.0)
    gates: list[threading.Event] = []

    def process(gate: threading.Event, rows: list) -> np.ndarray:
        gate.wait(10.0)
        return np.stack(rows)

    episode = np.zeros(num_envs, dtype=np.int64)
    episode_step = np.zeros(num_envs, dtype=np.int64)
    with EDFScheduler(num_workers=4, slow_capacity=1024) as scheduler:
        try:
            for t in range(len(ends) + 1):
                due = [i for i in range(num_envs)
                       if (episode_step[i] == 0 if reset_only else episode_step[i] % every == 0)]
                if due:
                    gate = threading.Event()
                    gates.append(gate)
                    job = scheduler.submit(process, gate, [_emission(i, t, episode[i]) for i in due], fast=False,
                                           budget_s=1.0)
                    for k, i in enumerate(due):
                        aligner.emitted("slow", i, t, int(episode[i]), job, k)
                closed = [g for g in gates if not g.is_set()]
                for pick in opens[t] if t < len(opens) else []:
                    if closed:
                        closed.pop(pick % len(closed)).set()
                # A blocked wait must be able to finish: open everything still closed from a helper thread.
                opener = threading.Timer(0.02, lambda: [g.set() for g in list(gates)])
                opener.start()
                values, sources = aligner.observe(t, episode)
                opener.cancel()
                for i in range(num_envs):
                    env_id, src, src_episode = values["slow"][i]
                    assert env_id == i
                    assert src == sources["slow"][i]
                    assert src <= t, "a value from the future"
                    assert src_episode == episode[i], "a value from another episode"
                    if bound is not None:
                        assert t - src <= bound, f"staleness {t - src} > bound {bound}"
                if t < len(ends):
                    for i in range(num_envs):
                        if ends[t][i]:
                            episode[i] += 1
                            episode_step[i] = 0
                        else:
                            episode_step[i] += 1
        finally:
            for g in gates:
                g.set()
    stats = aligner.stats["slow"]
    assert bound is None or stats.max_staleness <= bound


def test_aligner_waits_and_counts_when_the_bound_would_break():
    aligner = Aligner(1, {"lidar": 0})
    gate = threading.Event()
    with EDFScheduler(num_workers=2) as scheduler:
        first = scheduler.submit(lambda: np.zeros((1, 2)), fast=False, budget_s=1.0)
        aligner.emitted("lidar", 0, 0, 0, first, 0)
        first.result()  # already processed when observed: no wait
        values, sources = aligner.observe(0, np.array([0]))
        assert sources["lidar"][0] == 0
        late = scheduler.submit(lambda: (gate.wait(5), np.ones((1, 2)))[1], fast=False, budget_s=1.0)
        aligner.emitted("lidar", 0, 1, 0, late, 0)
        threading.Timer(0.05, gate.set).start()
        values, sources = aligner.observe(1, np.array([0]))  # bound 0: must wait for step 1's value
        assert sources["lidar"][0] == 1 and values["lidar"][0].tolist() == [1.0, 1.0]
    assert aligner.stats["lidar"].waits == 1 and aligner.stats["lidar"].wait_s >= 0.03


# --------------------------------------------------------------------------- fragments record what the actor saw


class RecordingSensorEnv(MultiRateSensorEnv):
    """The real multi-rate env, keeping every observation it hands out, in order, tagged reset/step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen: list[tuple[str, dict]] = []

    def reset(self, **kwargs):
        obs, info = super().reset(**kwargs)
        self.seen.append(("reset", obs))
        return obs, info

    def step(self, action):
        out = super().step(action)
        self.seen.append(("step", out[0]))
        return out


RECORDING_ID = "AscentRLTest/RecordingSensor-v0"
if RECORDING_ID not in gym.registry:
    gym.register(RECORDING_ID, entry_point=RecordingSensorEnv, max_episode_steps=20)


def observations_used(env: RecordingSensorEnv) -> list[dict]:
    """Global step -> the observation the sampler acted on: a step's observation, unless the episode ended
    there, in which case the reset observation that follows it (SAME_STEP autoreset)."""
    used = []
    for j, (kind, obs) in enumerate(env.seen):
        ended_here = kind == "step" and j + 1 < len(env.seen) and env.seen[j + 1][0] == "reset"
        if not ended_here:
            used.append(obs)
    return used


@pytest.mark.parametrize("workers", [0, 2])
def test_fragment_records_match_what_the_actor_saw(workers):
    modalities = {name: dict(d) for name, d in MODALITIES.items()}
    specs = {n: ModalitySpec.from_dict(n, d) for n, d in modalities.items()}
    spec = env_spec(ENV_ID, hidden_sizes=(64,), modalities=modalities)
    torch.manual_seed(0)
    T, N, K = 16, 4, 3
    sampler = RolloutSampler(SamplerSettings(env_id=RECORDING_ID, num_envs=N, fragment_length=T, gamma=0.99,
                                             gae_lambda=0.95, seed=3, modalities=modalities,
                                             preprocess_workers=workers), lambda: ActorCritic(spec))
    try:
        sampler.load_weights(0, state_dict_numpy(ActorCritic(spec)))
        fragments = [sampler.collect() for _ in range(K)]
        used = [observations_used(e.unwrapped) for e in sampler.env.envs]
        processors = sampler.pipeline.processors
        staleness = []
        for k, frag in enumerate(fragments):
            for name in ("audio", "lidar", "instruction"):
                src, obs = frag.arrays[F.obs_source_key(name)], frag.arrays[F.obs_key(name)]
                bound = specs[name].staleness_bound
                for t in range(T):
                    now = k * T + t
                    for i in range(N):
                        s = int(src[t, i])
                        assert s <= now, "a value from the future"
                        if bound is not None:
                            assert now - s <= bound
                        staleness.append(now - s)
                        # The value is the preprocessed raw value the env handed out at the source step.
                        np.testing.assert_array_equal(obs[t, i], processors[name](used[i][s][name]))
            for name in ("camera", "proprio"):  # fast modalities: always this step's value
                for t in range(T):
                    for i in range(N):
                        np.testing.assert_array_equal(frag.arrays[F.obs_key(name)][t, i],
                                                      processors[name](used[i][k * T + t][name]))
        assert len(staleness) == K * 3 * T * N
        metrics = sampler.pipeline_stats()
        assert metrics["align/lidar/max_staleness"] <= specs["lidar"].staleness_bound
    finally:
        sampler.close()
