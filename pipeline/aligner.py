"""Temporal alignment of slow modalities to the env step they are used at.

The observation for step ``t`` of one env is that step's fast items plus, for
each slow modality, the newest *processed* value that

* was emitted at or before ``t`` (values are registered when they are
  submitted, at their own step, so nothing from after ``t`` can be here; the
  check is kept anyway and the property tests hammer it),
* belongs to the env's current episode (an episode never sees the previous
  episode's instruction or point cloud), and
* is at most ``bound`` steps old (``t - source_step <= bound``).

When the newest processed value breaks one of these, the aligner waits for
the newest *emitted* one (its preprocessing job is in flight), and counts the
wait: that time is the slow queue showing up on the action's critical path.
Reset-only modalities (a mission text) have no age bound, only the episode
rule.

Jobs complete out of order under EDF with several workers; a value that
finishes after a newer one of the same env and modality is discarded.

Plain class, single consumer (the rollout thread); job completion is polled
(``job.done()``), so no callbacks cross threads.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pipeline.timing import Stopwatch


class AlignmentError(RuntimeError):
    """A slow value could not be provided within the bound (its job failed or never finished)."""


@dataclass
class _Value:
    step: int
    episode: int
    value: np.ndarray


@dataclass
class _Lane:
    """One (env, slow modality): newest processed value and the emissions still in flight, oldest first."""

    latest: _Value | None = None
    pending: deque = field(default_factory=deque)  # (step, episode, job, index)


@dataclass
class AlignerStats:
    waits: int = 0
    wait_s: float = 0.0
    max_staleness: int = 0
    discarded_out_of_order: int = 0


class Aligner:
    def __init__(self, num_envs: int, bounds: dict[str, int | None], wait_timeout_s: float = 60.0):
        """``bounds``: slow modality name -> max staleness in steps (None: reset-only, episode rule only)."""
        self.num_envs = num_envs
        self.bounds = dict(bounds)
        self.wait_timeout_s = wait_timeout_s
        self._lanes = {name: [_Lane() for _ in range(num_envs)] for name in self.bounds}
        self.stats = {name: AlignerStats() for name in self.bounds}

    def emitted(self, name: str, env: int, step: int, episode: int, job, index: int) -> None:
        """A value of ``name`` for ``env`` was emitted at ``step`` and submitted as row ``index`` of ``job``."""
        self._lanes[name][env].pending.append((step, episode, job, index))

    def provide(self, name: str, env: int, step: int, episode: int, value: np.ndarray) -> None:
        """A value processed synchronously (e.g. right after an abandoned episode's reset)."""
        lane = self._lanes[name][env]
        lane.pending.clear()  # anything in flight belongs to an older episode or step
        lane.latest = _Value(step, episode, value)

    def _drain(self, name: str, lane: _Lane, block_on_newest: bool) -> None:
        """Move the newest finished emission into ``latest``; emissions before it are superseded.

        With ``block_on_newest``, first wait for the newest emission. A preprocessing error of an emission
        that is consumed here is raised here (the rollout applies the modality's corrupt-input policy).
        """
        if block_on_newest and lane.pending:
            job = lane.pending[-1][2]
            try:
                job.result(timeout=self.wait_timeout_s)
            except TimeoutError:
                raise AlignmentError(f"slow modality {name!r}: preprocessing did not finish within "
                                     f"{self.wait_timeout_s} s") from None
            except Exception:
                pass  # raised below by result(), where the emission is consumed
        newest_done = -1
        for k, item in enumerate(lane.pending):
            if item[2].done():
                newest_done = k
        stats = self.stats[name]
        for _ in range(newest_done + 1):
            step, episode, job, index = lane.pending.popleft()
            if not job.done():  # superseded by a newer value before it finished (EDF may reorder)
                stats.discarded_out_of_order += 1
                continue
            value = job.result()[index]
            if lane.latest is not None and (episode, step) <= (lane.latest.episode, lane.latest.step):
                stats.discarded_out_of_order += 1
                continue
            lane.latest = _Value(step, episode, value)

    def _usable(self, name: str, lane: _Lane, t: int, episode: int) -> bool:
        v = lane.latest
        if v is None or v.episode != episode or v.step > t:
            return False
        bound = self.bounds[name]
        return bound is None or t - v.step <= bound

    def observe(self, t: int, episodes: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Slow values for step ``t`` of every env: ({name: (N, ...)}, {name: (N,) source steps})."""
        values: dict[str, np.ndarray] = {}
        sources: dict[str, np.ndarray] = {}
        for name, lanes in self._lanes.items():
            rows = []
            src = np.empty(self.num_envs, dtype=np.int64)
            stats = self.stats[name]
            for env, lane in enumerate(lanes):
                episode = int(episodes[env])
                self._drain(name, lane, block_on_newest=False)
                if not self._usable(name, lane, t, episode):
                    if not lane.pending:
                        raise AlignmentError(f"slow modality {name!r}, env {env}: no value for step {t} of episode "
                                             f"{episode} was emitted (was the modality due at reset?)")
                    with Stopwatch() as sw:
                        self._drain(name, lane, block_on_newest=True)
                    stats.waits += 1
                    stats.wait_s += sw.s
                    if not self._usable(name, lane, t, episode):
                        raise AlignmentError(f"slow modality {name!r}, env {env}: newest value (step "
                                             f"{lane.latest.step if lane.latest else None}) cannot serve step {t}")
                v = lane.latest
                rows.append(v.value)
                src[env] = v.step
                stats.max_staleness = max(stats.max_staleness, t - v.step)
            values[name] = np.stack(rows)
            sources[name] = src
        return values, sources

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, s in self.stats.items():
            out[f"align/{name}/waits"] = s.waits
            out[f"align/{name}/wait_s"] = s.wait_s
            out[f"align/{name}/max_staleness"] = s.max_staleness
            out[f"align/{name}/discarded_out_of_order"] = s.discarded_out_of_order
        return out
