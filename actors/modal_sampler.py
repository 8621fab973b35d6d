"""MultiModalSampler: Dict-observation envs through the observation pipeline, one fragment out per call.

Same interface as ``RolloutSampler`` (``load_weights``, ``collect``, ``close``,
counters); the difference is where observations come from. Each step:

    submit(t + 1) for the raw observations the env just returned
        -> fast jobs (this step's camera, proprioception) and slow jobs (whatever is due)
    gather(t + 1) -> fast results + the aligner's slow values (usually already processed)
    act on them, step the envs, ...

Fragments carry ``obs/<modality>`` for every modality and ``obs_src/<modality>``
(the env step each slow value was emitted at), so the learner trains on exactly
what the actor saw and tests can check the alignment after the fact.

Corrupt encoded input under ``on_corrupt: drop_episode``: the env's episode is
abandoned before any action uses the bad observation; the transition that led
to it is cut as a truncation bootstrapped with V of the last good observation
(the only value estimate there is), the episode's return is not reported, and
``episodes_dropped`` counts it. A corrupt final observation of a time-limit
truncation is handled the same way (its bootstrap is V of the last good one).
"""

from __future__ import annotations

import time
from typing import Callable, Mapping

import numpy as np
import torch

from actors.envs import ModalVectorEnv, action_bounds_of
from actors.sampler import assemble_fragment
from pipeline import fragment as F
from pipeline.contract import ModalitySpec, specs_from
from pipeline.modality import CorruptObservation
from pipeline.observations import Gathered, ObservationPipeline
from pipeline.scheduler import EDFScheduler

#: Fresh resets tried when an abandoned episode's new first observation is corrupt too.
MAX_RESET_ATTEMPTS = 5


def _tensors(obs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in obs.items()}


class MultiModalSampler:
    def __init__(
        self,
        *,
        env_id: str,
        num_envs: int,
        fragment_length: int,
        policy_factory: Callable[[], torch.nn.Module],
        gamma: float,
        gae_lambda: float,
        seed: int,
        modalities: Mapping[str, ModalitySpec | dict],
        actor_id: int = 0,
        max_episode_steps: int | None = None,
        env_kwargs: dict | None = None,
        preprocess_workers: int = 2,
        max_slow_workers: int | None = None,
        fast_queue: int = 64,
        slow_queue: int = 64,
        remote_preprocess=None,
    ):
        self.actor_id = actor_id
        self.num_envs = num_envs
        self.T = fragment_length
        self.gamma, self.gae_lambda = gamma, gae_lambda
        self.specs = specs_from(modalities)  # env.modalities: spec objects, or their plain data (converted once)
        self.env = ModalVectorEnv(env_id, num_envs, max_episode_steps, env_kwargs)
        self.bounds = action_bounds_of(self.env.single_action_space)
        self.scheduler = EDFScheduler(num_workers=preprocess_workers, fast_capacity=fast_queue,
                                      slow_capacity=slow_queue, max_slow_workers=max_slow_workers,
                                      name=f"preprocess-{actor_id}")
        self.pipeline = ObservationPipeline(self.specs, self.env.single_observation_space, num_envs, self.scheduler,
                                            seed=seed * 7919 + actor_id, remote=remote_preprocess)
        self.out_spaces = self.pipeline.out_spaces()
        self.policy = policy_factory()
        self.policy.eval()
        self.policy_version = -1
        self.generator = torch.Generator().manual_seed(seed * 7919 + actor_id)
        self.step_index = 0  # global env step of the current observation (the aligner's clock)
        # Counters first: a corrupt first observation is abandoned (and counted) inside the first _gather.
        self.ep_return = np.zeros(num_envs, dtype=np.float64)
        self.ep_length = np.zeros(num_envs, dtype=np.int64)
        self.env_steps = 0
        self.sample_seconds = 0.0
        self.episodes_dropped = 0
        raws = self.env.reset(seed=seed * 100_003 + actor_id * num_envs)
        self.pipeline.submit(0, raws, self.env.episode_step, self.env.episode)
        self.current: Gathered = self._gather(None, None)

    def load_weights(self, version: int, state: dict[str, np.ndarray]) -> None:
        self.policy.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
        self.policy_version = version

    # ------------------------------------------------------------------ observations
    def _gather(self, t_prev: int | None, arrays: dict | None) -> Gathered:
        """This step's observation; envs with corrupt input get a fresh episode first."""
        g = self.pipeline.gather(self.step_index, self.env.episode)
        for i in g.corrupt_envs:
            self._abandon(i, g, t_prev, arrays)
        return g

    def _abandon(self, i: int, g: Gathered, t_prev: int | None, arrays: dict | None) -> None:
        if t_prev is not None and arrays is not None:
            ended = arrays["terminated"][t_prev, i] or arrays["truncated"][t_prev, i]
            if not ended:
                # The episode that produced the bad observation is cut here; bootstrap from the last good one.
                arrays["truncated"][t_prev, i] = True
                arrays["final_values"][t_prev, i] = arrays["values"][t_prev, i]
        self.episodes_dropped += 1
        self.ep_return[i] = 0.0
        self.ep_length[i] = 0
        for attempt in range(MAX_RESET_ATTEMPTS):
            raw = self.env.reset_one(i)
            try:
                processed = self.pipeline.process_now(raw)
                break
            except CorruptObservation:
                self.episodes_dropped += 1
                if attempt == MAX_RESET_ATTEMPTS - 1:
                    raise
        for name, value in processed.items():
            g.obs[name][i] = value[0]
            if name in g.sources:
                g.sources[name][i] = self.step_index
        self.pipeline.restart_env(i, self.step_index, int(self.env.episode[i]), processed)

    def _process_final(self, raw: dict) -> dict[str, np.ndarray] | None:
        """A truncated episode's final observation, processed now; None if it is corrupt under drop_episode.

        Per modality (``pipeline.process_now`` one key at a time), so each modality whose input did not decode
        applies its own policy: any ``on_corrupt: fail`` raises, as it would anywhere else.
        """
        out: dict[str, np.ndarray] = {}
        corrupt = False
        for name, proc in self.pipeline.processors.items():
            try:
                out[name] = proc.batch([raw[name]])
            except CorruptObservation:
                if self.pipeline.specs[name].on_corrupt == "fail":
                    raise
                corrupt = True
        return None if corrupt else out

    # ------------------------------------------------------------------ sampling
    def collect(self) -> F.Fragment:
        if self.policy_version < 0:
            raise RuntimeError("MultiModalSampler.collect() called before load_weights()")
        t_start = time.perf_counter()
        T, N = self.T, self.num_envs
        obs_buf = {name: np.empty((T, N) + shape, dtype=dtype) for name, (shape, dtype) in self.out_spaces.items()}
        src_buf = {name: np.empty((T, N), dtype=np.int64) for name in self.current.sources}
        act_space = self.env.single_action_space
        arrays = {
            "actions": np.empty((T, N) + act_space.shape, dtype=np.int64 if self.bounds is None else np.float32),
            "logp": np.empty((T, N), dtype=np.float32),
            "values": np.empty((T, N), dtype=np.float32),
            "rewards": np.empty((T, N), dtype=np.float32),
            "terminated": np.empty((T, N), dtype=bool),
            "truncated": np.empty((T, N), dtype=bool),
            "final_values": np.zeros((T, N), dtype=np.float32),
        }
        finished_returns: list[float] = []
        finished_lengths: list[int] = []

        for t in range(T):
            g = self.current
            for name, value in g.obs.items():
                obs_buf[name][t] = value
            for name, steps in g.sources.items():
                src_buf[name][t] = steps
            a, lp, v = self.policy.act(_tensors(g.obs), generator=self.generator)
            a = a.numpy()
            arrays["actions"][t], arrays["logp"][t], arrays["values"][t] = a, lp.numpy(), v.numpy()
            env_action = a if self.bounds is None else np.clip(a, *self.bounds)
            raws, rew, term, trunc, finals = self.env.step(env_action)
            arrays["rewards"][t], arrays["terminated"][t], arrays["truncated"][t] = rew, term, trunc
            self.step_index += 1
            # Submit first: this step's preprocessing runs while we book-keep below.
            self.pipeline.submit(self.step_index, raws, self.env.episode_step, self.env.episode)

            self.ep_return += rew
            self.ep_length += 1
            for i, final_raw in finals.items():
                dropped = False
                if trunc[i] and not term[i]:
                    # Time-limit end: bootstrap from V(final observation), processed here (rare, off the rhythm).
                    final = self._process_final(final_raw)
                    if final is None:
                        # Corrupt under drop_episode: bootstrap from the last good observation; return not reported.
                        arrays["final_values"][t, i] = arrays["values"][t, i]
                        self.episodes_dropped += 1
                        dropped = True
                    else:
                        with torch.inference_mode():
                            arrays["final_values"][t, i] = self.policy.value(_tensors(final)).numpy()[0]
                if not dropped:
                    finished_returns.append(float(self.ep_return[i]))
                    finished_lengths.append(int(self.ep_length[i]))
                self.ep_return[i] = 0.0
                self.ep_length[i] = 0
            self.current = self._gather(t, arrays)

        with torch.inference_mode():
            last_values = self.policy.value(_tensors(self.current.obs)).numpy()
        observations = {F.obs_key(name): buf for name, buf in obs_buf.items()}
        observations.update({F.obs_source_key(name): buf for name, buf in src_buf.items()})
        fragment = assemble_fragment(observations, arrays, last_values, self.gamma, self.gae_lambda,
                                     self.policy_version, self.actor_id, finished_returns, finished_lengths)
        self.env_steps += T * N
        self.sample_seconds += time.perf_counter() - t_start
        return fragment

    def pipeline_stats(self) -> dict[str, float]:
        out = {f"preprocess/{queue}/{k}": v for queue, m in self.scheduler.metrics().items() for k, v in m.items()}
        out.update(self.pipeline.metrics())
        out["episodes_dropped"] = self.episodes_dropped
        return out

    def close(self) -> None:
        self.scheduler.close()
        self.env.close()
