"""Where the rollout host's time goes: the rollout actors' stage times as per-iteration figures, the stage that bounds
a host-bound learner, and what to change for it.

Every rollout actor times the stages of its loop (``actors/rollout.py``: env step, preprocessing, the policy forward,
fragment and GAE, the add to its shard, weight fetches, waiting for a ticket, waiting for the previous add) and sends
the cumulative seconds with its stats. ``RolloutTime`` turns them into each record's ``rollout_time/<stage>_s`` (the
seconds since the previous record, summed over the actors) and ``rollout_share/<stage>`` (of the actors' wall time);
the progress line, the end-of-run report and the autoscaler read those same figures, PufferLib's dashboard for the
rollout side: a learner that waits for data is told which host stage to fix.
"""

from __future__ import annotations

import math

from pipeline import metric_keys as M

#: The learner's wait for data (host-bound fraction) from which the progress line and the report name the rollout
#: stage that bounds it: below it the learner itself is the bound, and a rollout stage is no lead to follow.
HOST_BOUND_NAMED = 0.1
#: Decimals the records keep: seconds to the microsecond (a timed block itself costs about that), shares to a
#: hundredth of a percent. Finer digits say nothing, and every record carries nineteen of these figures.
SECONDS_DECIMALS, SHARE_DECIMALS = 6, 4

#: Each stage as the progress line and the report call it.
LABELS = {
    "env_step": "env step", "preprocess": "preprocess", "forward": "forward", "fragment": "fragment+GAE",
    "add": "add", "weights": "weights", "rate_limited": "ticket wait", "backpressure": "add wait", "other": "other",
}

#: What to change when a stage bounds a host-bound learner: config keys only (cluster/config.py), nothing a config
#: cannot reach.
ADVICE = {
    "env_step": "more rollout actors (rollout.num_actors, or auto where CPUs are free), more envs per actor "
                "(rollout.envs_per_actor), or env.backend: envpool where the env has one",
    "preprocess": "preprocessing on other CPU hosts (preprocess.remote_actors), or more preprocess.workers where the "
                  "actor's host has idle cores",
    "forward": "more rollout actors (rollout.num_actors, or auto), more envs per forward (rollout.envs_per_actor), "
               "more rollout.torch_threads where the actor's host has idle cores, or a smaller policy "
               "(learner.hidden_sizes)",
    "fragment": "more rollout actors (rollout.num_actors, or auto): fragment buffers and GAE cost the same per sample "
                "whatever the layout",
    "add": "more shards (replay.num_shards), or fewer, larger adds (rollout.fragments_per_add)",
    "weights": "fewer, larger actors (rollout.envs_per_actor up, rollout.num_actors down): each actor loads every "
               "version once",
    "rate_limited": "nothing on the host: the actors wait for tickets, so the learner is the bound, not the host "
                    "(at replay.max_policy_lag 0 the learners wait for every batch by design; 1 overlaps them)",
    "backpressure": "more shards (replay.num_shards): the actors wait for their shard's acknowledgement",
}


def shares(seconds: dict[str, float], wall_s: float) -> dict[str, float]:
    """Each stage's share of ``wall_s`` from {stage: seconds}; ``other`` is what no stage holds (never below 0)."""
    out = {stage: seconds.get(stage, 0.0) / wall_s for stage, _, _ in M.ROLLOUT_STAGES if stage != "other"}
    out["other"] = max(0.0, 1.0 - sum(out.values()))
    return out


class RolloutTime:
    """Per-record stage figures from the rollout actors' cumulative stats (``RolloutActor.stats``: ``wall_s`` and
    ``stage_s``). An actor's counters start at zero with each incarnation, so a replaced actor's first report counts
    from zero and never as a negative step; an iteration with no new report adds zero seconds and keeps the newest
    shares."""

    def __init__(self):
        self._seen: dict[int, tuple] = {}  # actor id -> (incarnation, wall_s, stage_s) of its newest report
        self._shares = {share: math.nan for _, _, share in M.ROLLOUT_STAGES}

    def fold(self, per_actor: list[dict]) -> dict[str, float]:
        wall, stages = 0.0, dict.fromkeys((stage for stage, _, _ in M.ROLLOUT_STAGES if stage != "other"), 0.0)
        seen = {}
        for st in per_actor:
            if "stage_s" not in st:
                continue
            key, now = st["actor_id"], (st.get("incarnation", 0), st["wall_s"], st["stage_s"])
            before = self._seen.get(key)
            if before is None or before[0] != now[0] or before[1] > now[1]:
                before = (now[0], 0.0, {})
            wall += now[1] - before[1]
            for stage in stages:
                stages[stage] += max(0.0, now[2].get(stage, 0.0) - before[2].get(stage, 0.0))
            seen[key] = now
        self._seen = seen
        record = {seconds: stages.get(stage, 0.0) for stage, seconds, _ in M.ROLLOUT_STAGES}
        record[M.ROLLOUT_OTHER_S] = max(0.0, wall - sum(stages.values()))
        record[M.ROLLOUT_WALL_S] = wall
        record = {key: round(value, SECONDS_DECIMALS) for key, value in record.items()}
        if wall > 0:
            by_stage = shares(stages, wall)
            self._shares = {key: round(by_stage[stage], SHARE_DECIMALS) for stage, _, key in M.ROLLOUT_STAGES}
        record.update(self._shares)
        return record


def record_shares(record: dict) -> dict[str, float]:
    """{stage: share} of a record (NaN where it has none)."""
    out = {}
    for stage, _, key in M.ROLLOUT_STAGES:
        v = record.get(key)
        out[stage] = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
    return out


def largest(stage_shares: dict[str, float]) -> tuple[str, float] | None:
    """The stage with the largest share, ``other`` left out (it is no stage to change); None without figures."""
    named = [(share, stage) for stage, share in stage_shares.items() if stage != "other" and share == share]
    if not named:
        return None
    share, stage = max(named)
    return stage, share


def progress_note(record: dict) -> str:
    """The progress line's addition to its host-bound figure: " (rollouts: env step 61%)" while the learner waits at
    least HOST_BOUND_NAMED of its time and the record has the actors' shares, else ""."""
    host_bound = record.get(M.HOST_BOUND_FRACTION)
    if not isinstance(host_bound, (int, float)) or not host_bound >= HOST_BOUND_NAMED:
        return ""
    top = largest(record_shares(record))
    return "" if top is None else f" (rollouts: {LABELS[top[0]]} {100 * top[1]:.0f}%)"


def verdict(host_bound: float, stage_shares: dict[str, float]) -> str | None:
    """The report's line on what bounds the learner: the rollout stage and what to change when it is host-bound; None
    without the actors' figures."""
    top = largest(stage_shares)
    if top is None:
        return None
    stage, share = top
    if host_bound != host_bound:  # no learner figure: no claim about what bounds it
        return f"the rollout actors' largest stage is {LABELS[stage]} ({share:.0%} of their time)"
    if host_bound < HOST_BOUND_NAMED:
        return (f"the learner waited {host_bound:.0%} for data (under {HOST_BOUND_NAMED:.0%}): it is the bound, not "
                f"the rollout host; the actors' largest stage is {LABELS[stage]} ({share:.0%})")
    return f"{LABELS[stage]} ({share:.0%} of the rollout actors' time) bounds the learner: {ADVICE[stage]}"
