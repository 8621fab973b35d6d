"""``rollout.num_actors: auto``: the rollout actor count follows the run's own host-bound signal.

The system measures every iteration how much of the learner's time went to waiting for data
(``host_bound_fraction``) and where the rollout actors' time went (``rollout_time/<stage>_s``, cluster/host_time.py:
the figures the progress line and the report show), waiting for a ticket among it (production is ahead of what
``replay.max_policy_lag`` lets the learners take). This class turns those into a rollout actor count; the driver
hands it to the control actor, and the live-rescale path that ``cluster.control`` uses applies it
(``Supervisor.apply_control``), so a decision is a rescale like any other: counted in the records
(``rollout_actors``, ``rollout_autoscale``) and said on stderr.

The rule, over a window of ``rollout.autoscale_window`` iterations with no change in it (the actors' stage shares
taken over the window's seconds, so an iteration in which no actor reported weighs nothing):
- **up** when the learners waited at least ``rollout.autoscale_host_bound`` of their time while the actors were busy
  producing (waiting for tickets and for their shard under UP_MAX_WAITING of their time): production must grow by
  1 / (1 - host-bound) for the wait to go (rollouts scale about linearly with actors while CPUs are free), so the
  count goes to ceil(n / (1 - host-bound)), capped by ``rollout.max_actors`` and by what the free CPUs hold. Actors
  that mostly wait are not what the learners wait for, and more of them would wait too;
- **down** when the learners waited less than half that and the actors sat rate-limited at least half their time:
  the count goes to ceil(n x busy / 0.75), the actors' busy share raised to 3/4 and no higher, floored at
  ``rollout.min_actors``;
- hysteresis: between the two thresholds nothing happens, and after a change the window starts over (the new
  count's own measurements decide the next step);
- a bracket: a count it left upwards is "too few" and one it left downwards "too many" for BRACKET_WINDOWS windows,
  and the next moves stay strictly between the two. Where adding an actor takes CPU from the learner (a small host)
  both signals can cross their thresholds at neighbouring counts: on a 2-core cluster the count went 5 -> 3 -> 5 ->
  3 -> 4 -> 5 -> 3 ... for as long as the run lasted (window 4: 34 changes in 395 iterations); with the bracket
  it made 4 (1 -> 5 -> 3 -> 4 -> 5) and held.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass

from cluster import host_time
from pipeline import metric_keys as M

#: The rollout actors' busy share a scale-down aims for: a quarter of their time left waiting for tickets is the
#: margin that absorbs a slow episode or a replaced actor without starving the learners.
DOWN_TARGET_BUSY = 0.75
#: Scale down only while the actors wait for tickets at least this share of their time.
DOWN_RATE_LIMITED = 0.5
#: Scale up only while the actors wait (for tickets, or for their shard's acknowledgement) under this share of their
#: time: past it the learners' wait is not for want of production, so more actors would only wait as well.
UP_MAX_WAITING = 0.5
#: How many windows a count the autoscaler left stays "too few" (left upwards) or "too many" (left downwards): long
#: enough to hold the count between two that each call for the other, short enough to follow a run whose needs
#: change (a bracket older than this is forgotten).
BRACKET_WINDOWS = 50


@dataclass(frozen=True)
class Decision:
    want: int
    why: str


class RolloutAutoscaler:
    def __init__(self, min_actors: int, max_actors: int, host_bound_up: float, window: int):
        self.min, self.max = min_actors, max_actors
        self.up = host_bound_up
        self.window = window
        self._host_bound: collections.deque = collections.deque(maxlen=window)
        self._seconds: collections.deque = collections.deque(maxlen=window)  # per record: (wall, {stage: seconds})
        self._records = 0
        self._too_few: tuple[int, int] | None = None  # (count it left upwards, record then)
        self._too_many: tuple[int, int] | None = None  # (count it left downwards, record then)

    def observe(self, record: dict, have: int, room: Callable[[int], int]) -> Decision | None:
        """Fold one iteration's record in; a new count when the window calls for one. ``have``: actors running;
        ``room(n)``: how many of n more the free resources hold now (asked only when the rule says up)."""
        self._records += 1
        for bracket in ("_too_few", "_too_many"):
            held = getattr(self, bracket)
            if held is not None and self._records - held[1] > BRACKET_WINDOWS * self.window:
                setattr(self, bracket, None)
        self._host_bound.append(float(record.get(M.HOST_BOUND_FRACTION) or 0.0))
        self._seconds.append((float(record.get(M.ROLLOUT_WALL_S) or 0.0),
                              {stage: float(record.get(key) or 0.0) for stage, key, _ in M.ROLLOUT_STAGES}))
        if len(self._host_bound) < self.window:
            return None
        host_bound = sum(self._host_bound) / len(self._host_bound)
        wall = sum(w for w, _ in self._seconds)
        # No actor reported in the whole window (each making one long fragment): they are not waiting.
        shares = host_time.shares({stage: sum(s[stage] for _, s in self._seconds) for stage in self._seconds[0][1]},
                                  wall) if wall > 0 else {}
        rate_limited = shares.get("rate_limited", 0.0)
        waiting = rate_limited + shares.get("backpressure", 0.0)
        want, why = have, ""
        top = self.max if self._too_many is None else min(self.max, self._too_many[0] - 1)
        bottom = self.min if self._too_few is None else max(self.min, self._too_few[0] + 1)
        if host_bound >= self.up and waiting < UP_MAX_WAITING and have < top:
            ideal = min(top, max(have + 1, math.ceil(have / max(1e-6, 1.0 - host_bound) - 1e-9)))
            want = have + room(ideal - have)
            stage = host_time.largest(shares)
            why = (f"learners waited {host_bound:.0%} of their time for data over {self.window} iterations "
                   f"(rollout.autoscale_host_bound {self.up:g})"
                   + (f" while rollout actors were busy {1 - waiting:.0%} of theirs, most in "
                      f"{host_time.LABELS[stage[0]]} ({stage[1]:.0%})" if stage else ""))
        elif host_bound < self.up / 2 and rate_limited >= DOWN_RATE_LIMITED and have > bottom:
            want = max(bottom, min(have - 1, math.ceil(have * (1.0 - rate_limited) / DOWN_TARGET_BUSY - 1e-9)))
            why = (f"rollout actors waited {rate_limited:.0%} of their time for tickets and learners "
                   f"{host_bound:.0%} for data over {self.window} iterations")
        if want == have:
            return None
        if want > have:
            self._too_few = (have, self._records)
        else:
            self._too_many = (have, self._records)
        self._host_bound.clear()  # the new count's own measurements decide the next step
        self._seconds.clear()
        return Decision(want, why)
