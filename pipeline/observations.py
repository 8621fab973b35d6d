"""Per-actor observation pipeline: raw Dict observations -> aligned, preprocessed arrays.

For each env step ``t`` of a vector of ``N`` envs:

1. ``submit(t, raws, ...)``: one job per fast modality (all N envs of the
   step together: per-item queueing would cost more than a small image
   decode), and one job per slow modality covering the envs for which it is
   due at their episode step. Jobs go to the shared ``EDFScheduler``; fast
   jobs carry tight deadlines, slow jobs loose ones.
2. ``gather(t, ...)``: wait for this step's fast jobs (the action needs them),
   and ask the ``Aligner`` for each slow modality's newest usable value,
   which usually was processed while earlier steps ran.

So slow preprocessing overlaps with env stepping and policy inference, and a
burst of slow work never sits in front of the next action's fast work.

Corrupt encoded input (``CorruptObservation``): with ``on_corrupt: fail`` the
error propagates; with ``drop_episode`` ``gather`` returns the envs whose
observation could not be built, and the caller abandons their episodes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from pipeline import runtime
from pipeline.aligner import Aligner
from pipeline.modality import CorruptObservation, ModalitySpec, make_processor
from pipeline.scheduler import EDFScheduler


@dataclass
class Gathered:
    obs: dict[str, np.ndarray]  # modality -> (N, ...) preprocessed
    sources: dict[str, np.ndarray]  # slow modality -> (N,) env step the value was emitted at
    corrupt_envs: list[int] = field(default_factory=list)  # envs whose observation did not decode (drop_episode)


#: Longest one preprocessing job (local or on a remote worker) may take before the rollout actor gives up on it
#: (its loop raises, and the supervisor replaces the actor and, if it is the one gone quiet, the remote worker).
PREPROCESS_TIMEOUT_S = 60.0

class ObservationPipeline:
    def __init__(self, specs: list[ModalitySpec], obs_space, num_envs: int, scheduler: EDFScheduler, seed: int = 0,
                 remote=None):
        """``remote``: a preprocessing actor (``actors.preprocess_worker``) that runs the slow modalities."""
        missing = [s.name for s in specs if s.name not in obs_space.spaces]
        if missing:
            raise ValueError(f"env.modalities: {', '.join(missing)} not in the env's observation keys "
                             f"({', '.join(obs_space.spaces)})")
        self.specs = {s.name: s for s in specs}
        self.processors = {s.name: make_processor(s, obs_space[s.name], seed=seed) for s in specs}
        self.fast = [s for s in specs if s.is_fast]
        self.slow = [s for s in specs if not s.is_fast]
        self.num_envs = num_envs
        self.scheduler = scheduler
        self.remote = remote
        self.aligner = Aligner(num_envs, {s.name: s.staleness_bound for s in self.slow})
        self._fast_jobs: dict[str, object] = {}
        self._lock = threading.Lock()
        self._corrupt: set[tuple[int, int]] = set()  # (env, episode) whose input did not decode
        self.corrupt_inputs = 0

    def out_spaces(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """modality -> (shape of one env's preprocessed value, dtype)."""
        return {name: (p.out_shape, np.dtype(p.out_dtype)) for name, p in self.processors.items()}

    def _job(self, name: str, envs: list[int], episodes: list[int]):
        """The preprocessing function for one job: the batch, salvaged row by row under drop_episode."""
        proc, spec = self.processors[name], self.specs[name]
        if self.remote is not None and not spec.is_fast:
            remote = self.remote

            def batch(column: list) -> np.ndarray:
                # The worker thread blocks here with the GIL released; Ray re-raises a remote
                # CorruptObservation as an instance of it, so the salvage below still applies.
                return runtime.get(remote.process.remote(name, column), timeout=PREPROCESS_TIMEOUT_S)
        else:
            batch = proc.batch

        def run(column: list) -> np.ndarray:
            if spec.on_corrupt == "fail":
                return batch(column)
            try:
                return batch(column)
            except CorruptObservation:
                # Find the bad rows one env at a time; they become zeros, and their episodes are abandoned by the
                # rollout before any action uses them (gather reports them).
                out = np.zeros((len(column),) + tuple(proc.out_shape), dtype=proc.out_dtype)
                for k, raw in enumerate(column):
                    try:
                        out[k] = proc(raw)
                    except CorruptObservation:
                        with self._lock:
                            self._corrupt.add((envs[k], episodes[k]))
                return out
        return run

    def submit(self, t: int, raws: list[dict], episode_steps: np.ndarray, episodes: np.ndarray) -> None:
        all_envs, all_episodes = list(range(self.num_envs)), [int(e) for e in episodes]
        for spec in self.fast:
            self._fast_jobs[spec.name] = self.scheduler.submit(
                self._job(spec.name, all_envs, all_episodes), [raw[spec.name] for raw in raws], fast=True,
                budget_s=spec.budget_ms / 1e3, tag=spec.name)
        for spec in self.slow:
            due = [i for i in range(self.num_envs) if spec.due(int(episode_steps[i]))]
            if not due:
                continue
            job = self.scheduler.submit(self._job(spec.name, due, [all_episodes[i] for i in due]),
                                        [raws[i][spec.name] for i in due], fast=False,
                                        budget_s=spec.budget_ms / 1e3, tag=spec.name)
            for k, i in enumerate(due):
                self.aligner.emitted(spec.name, i, t, all_episodes[i], job, k)

    def gather(self, t: int, episodes: np.ndarray) -> Gathered:
        """This step's observation for every env; raises the first preprocessing error under on_corrupt: fail."""
        obs = {name: job.result(timeout=PREPROCESS_TIMEOUT_S) for name, job in self._fast_jobs.items()}
        self._fast_jobs.clear()
        slow_obs, sources = self.aligner.observe(t, episodes)
        obs.update(slow_obs)
        corrupt: list[int] = []
        with self._lock:
            if self._corrupt:
                for env in range(self.num_envs):
                    if (env, int(episodes[env])) in self._corrupt:
                        corrupt.append(env)
                # Entries of episodes that already ended can never be asked for again.
                self._corrupt = {(e, ep) for e, ep in self._corrupt if ep >= int(episodes[e]) and e not in corrupt}
        self.corrupt_inputs += len(corrupt)
        return Gathered(obs, sources, corrupt)

    def process_now(self, raw: dict) -> dict[str, np.ndarray]:
        """Every modality of one env's raw observation, synchronously, batched as (1, ...).

        For the rare observations off the stepping rhythm: the final observation of a truncated episode (its
        value bootstraps the return) and the first one after an abandoned episode's reset.
        """
        return {name: proc.batch([raw[name]]) for name, proc in self.processors.items()}

    def restart_env(self, env: int, t: int, episode: int, processed: dict[str, np.ndarray]) -> None:
        """Env ``env`` was reset out of rhythm at step ``t``: its slow values are the ones just processed."""
        for spec in self.slow:
            self.aligner.provide(spec.name, env, t, episode, processed[spec.name][0])

    def metrics(self) -> dict[str, float]:
        out = dict(self.aligner.metrics())
        out["corrupt_inputs"] = self.corrupt_inputs
        return out
