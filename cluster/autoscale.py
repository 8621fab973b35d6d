"""``rollout.num_actors: auto``: the rollout actor count follows the run's own host-bound signal.

The system measures every iteration how much of the learner's time went to waiting for data
(``host_bound_fraction``) and how much of the rollout actors' time went to waiting for a ticket
(``rollout_rate_limited_s``: production is ahead of what ``replay.max_policy_lag`` lets the learners take). This
class turns those two into a rollout actor count; the driver hands it to the control board, and the live-rescale
path that ``cluster.control`` uses applies it (``Supervisor.apply_control``), so a decision is a rescale like any
other: counted in the records (``rollout_actors``, ``rollout_autoscale``) and said on stderr.

The rule, over a window of ``rollout.autoscale_window`` iterations with no change in it:
- **up** when the learners waited at least ``rollout.autoscale_host_bound`` of their time: production must grow by
  1 / (1 - host-bound) for the wait to go (rollouts scale about linearly with actors while CPUs are free), so the
  count goes to ceil(n / (1 - host-bound)), capped by ``rollout.max_actors`` and by what the free CPUs hold;
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

#: The rollout actors' busy share a scale-down aims for: a quarter of their time left waiting for tickets is the
#: margin that absorbs a slow episode or a replaced actor without starving the learners.
DOWN_TARGET_BUSY = 0.75
#: Scale down only while the actors wait for tickets at least this share of their time.
DOWN_RATE_LIMITED = 0.5
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
        self._rate_limited: collections.deque = collections.deque(maxlen=window)
        self._last: tuple[float, float, int] | None = None  # (time_s, rollout_rate_limited_s, actors) of the last record
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
        t, limited = float(record["time_s"]), float(record.get("rollout_rate_limited_s", 0.0))
        prev, self._last = self._last, (t, limited, have)
        self._host_bound.append(float(record.get("host_bound_fraction") or 0.0))
        if prev is not None and prev[2] == have and t > prev[0] and have > 0:
            # Cumulative per actor incarnation: a replaced actor's counter restarts, so a negative step is no data.
            self._rate_limited.append(min(1.0, max(0.0, (limited - prev[1]) / ((t - prev[0]) * have))))
        if len(self._host_bound) < self.window or len(self._rate_limited) < self.window - 1:
            return None
        host_bound = sum(self._host_bound) / len(self._host_bound)
        rate_limited = sum(self._rate_limited) / len(self._rate_limited)
        want, why = have, ""
        top = self.max if self._too_many is None else min(self.max, self._too_many[0] - 1)
        bottom = self.min if self._too_few is None else max(self.min, self._too_few[0] + 1)
        if host_bound >= self.up and have < top:
            ideal = min(top, max(have + 1, math.ceil(have / max(1e-6, 1.0 - host_bound) - 1e-9)))
            want = have + room(ideal - have)
            why = (f"learners waited {host_bound:.0%} of their time for data over {self.window} iterations "
                   f"(rollout.autoscale_host_bound {self.up:g})")
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
        self._rate_limited.clear()
        self._last = None
        return Decision(want, why)
