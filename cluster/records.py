"""The run's counters and the metrics record made from them, one per learner iteration.

``RunState`` is what a checkpoint carries so a resumed run continues its
counters; ``Records`` folds one iteration's learner results, rollout stats and
shard stats with it into the record that goes to metrics.jsonl, TensorBoard
and the progress line (the same keys in all three).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from cluster.host_time import RolloutTime
from pipeline import metric_keys as M

PPO_STATS = M.PPO_STATS  # re-exported: cluster.driver's name for it
#: Per-learner figures the record averages over the learners (they arrive under these names).
MEAN_OVER_LEARNERS = (M.HOST_BOUND_FRACTION, M.DEVICE_IDLE_FRACTION, M.LEARNER_WAIT_S, M.LEARNER_UPDATE_S,
                      M.LEARNER_ITER_S, M.FEED_PULL_S, M.FEED_COLLATE_S, M.H2D_MS, M.POLICY_LAG_MEAN)


@dataclass
class RunState:
    """The driver's counters: what a checkpoint carries so a resumed run continues them."""

    window: collections.deque
    iteration: int = 0
    env_steps_retired: int = 0  # steps of actors that are gone (replaced, removed, or before a resume)
    episodes_total: int = 0
    samples_total: int = 0
    dropped_total: int = 0  # these three: counted by supply boards of the runs this one resumes
    fragments_lost: int = 0
    fragments_produced: int = 0
    rollout_restarts: int = 0
    env_failures: int = 0
    rollout_hangs: int = 0
    rollout_memory_kills: int = 0
    last_rollout_fault: str = ""
    shard_restarts: int = 0
    board_restarts: int = 0
    board_memory_replacements: int = 0  # of board_restarts: a board past run.board_memory_limit_mb
    board_voided: int = 0  # fragments stored or in flight when a supply board died (made again under the next)
    control_restarts: int = 0
    preprocess_restarts: int = 0
    learner_restarts: int = 0
    checkpoints_skipped: int = 0
    updates_skipped_nonfinite: int = 0  # updates not applied: their loss, gradient or weights were not finite
    train_time_before_s: float = 0.0  # training time of the runs this one resumes
    board: dict = field(default_factory=dict)  # the supply board's newest counters (this run's part)
    leases_expired_before: int = 0  # these two: counted by supply boards that died (fold_board)
    rejected_before: int = 0
    # The env steps of the rollout actors running now: a fact of each actor, kept in its slot
    # (cluster.graph.RolloutSlot.steps) and read through this (the driver wires ActorGraph.rollout_steps in).
    live_steps: Callable[[], int] = field(default=lambda: 0, repr=False, compare=False)
    # Actor id -> its newest reward statistics (normalize_reward). The run's, not a slot's: they outlive the actor
    # (a checkpoint carries them; an actor added later, or after a resume, starts from them).
    reward_scalers: dict = field(default_factory=dict)
    policy_windows: dict = field(default_factory=dict)  # several policies: name -> its agents' newest returns

    def policy_window(self, name: str) -> collections.deque:
        if name not in self.policy_windows:
            self.policy_windows[name] = collections.deque(maxlen=self.window.maxlen)
        return self.policy_windows[name]

    @property
    def env_steps(self) -> int:
        return self.env_steps_retired + self.live_steps()

    def fold_board(self, board: dict) -> None:
        """A supply board is gone: its cumulative counters become the run's, so the totals keep counting."""
        self.fragments_produced += board.get("fragments_stored", 0)
        self.fragments_lost += board.get("refunded", 0)
        self.dropped_total += board.get("voided_stored", 0)
        self.leases_expired_before += board.get("lease_expired", 0)
        self.rejected_before += board.get("rejected", 0)

    @property
    def dropped(self) -> int:
        """Fragments made and then not trained on (updates skipped by a learner-group restart)."""
        return self.dropped_total + self.board.get("voided_stored", 0)

    @property
    def lost(self) -> int:
        """Fragments given back to be made again (their actor, shard, add or learner died)."""
        return self.fragments_lost + self.board.get("refunded", 0)

    @property
    def produced(self) -> int:
        return self.fragments_produced + self.board.get("fragments_stored", 0)

    def to_checkpoint(self) -> dict:
        return {"window": list(self.window), "iteration": self.iteration, "env_steps": self.env_steps,
                "episodes_total": self.episodes_total, "samples_total": self.samples_total,
                "dropped_total": self.dropped, "rollout_restarts": self.rollout_restarts,
                "env_failures": self.env_failures, "rollout_hangs": self.rollout_hangs,
                "rollout_memory_kills": self.rollout_memory_kills, "board_restarts": self.board_restarts,
                "board_memory_replacements": self.board_memory_replacements, "board_voided": self.board_voided,
                "control_restarts": self.control_restarts,
                "preprocess_restarts": self.preprocess_restarts,
                "reward_scalers": {str(k): dict(v) for k, v in self.reward_scalers.items()},
                "shard_restarts": self.shard_restarts, "learner_restarts": self.learner_restarts,
                "fragments_lost": self.lost, "fragments_produced": self.produced,
                "checkpoints_skipped": self.checkpoints_skipped,
                "updates_skipped_nonfinite": self.updates_skipped_nonfinite}

    @classmethod
    def fresh(cls, window: int) -> "RunState":
        return cls(window=collections.deque(maxlen=window))

    #: The counters a checkpoint's run state must hold (the rest came later and default to 0 when absent).
    REQUIRED = ("iteration", "env_steps", "episodes_total", "samples_total", "dropped_total", "rollout_restarts",
                "shard_restarts", "learner_restarts", "fragments_lost")

    @classmethod
    def problem_in(cls, d) -> str | None:
        """What makes ``d`` (a checkpoint's ``run_state``) unusable to resume from, in a phrase; None if nothing:
        every required counter an integer >= 0, every other one too where present, the window a list of numbers."""
        if not isinstance(d, dict):
            return f"run_state is {type(d).__name__}, not a mapping"
        missing = [k for k in cls.REQUIRED + ("window",) if k not in d]
        if missing:
            return f"run_state lacks {', '.join(missing)}"
        optional = set(cls.fresh(1).to_checkpoint()) - set(cls.REQUIRED) - {"window", "reward_scalers"}
        for key in cls.REQUIRED + tuple(sorted(optional & set(d))):
            value = d[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                return f"run_state.{key} is {value!r}, not an integer >= 0"
        window = d["window"]
        if not isinstance(window, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                   for x in window):
            return "run_state.window is not a list of returns"
        if not isinstance(d.get("reward_scalers", {}), dict):
            return "run_state.reward_scalers is not a mapping"
        return None

    @classmethod
    def from_checkpoint(cls, d: dict, window: int, train_time_s: float) -> "RunState":
        return cls(window=collections.deque(d["window"], maxlen=window), iteration=d["iteration"],
                   env_steps_retired=d["env_steps"], episodes_total=d["episodes_total"],
                   samples_total=d["samples_total"], dropped_total=d["dropped_total"],
                   rollout_restarts=d["rollout_restarts"], shard_restarts=d["shard_restarts"],
                   learner_restarts=d["learner_restarts"], fragments_lost=d["fragments_lost"],
                   fragments_produced=d.get("fragments_produced", 0),
                   checkpoints_skipped=d.get("checkpoints_skipped", 0), train_time_before_s=train_time_s,
                   env_failures=d.get("env_failures", 0), rollout_hangs=d.get("rollout_hangs", 0),
                   rollout_memory_kills=d.get("rollout_memory_kills", 0), board_restarts=d.get("board_restarts", 0),
                   board_memory_replacements=d.get("board_memory_replacements", 0),
                   board_voided=d.get("board_voided", 0), control_restarts=d.get("control_restarts", 0),
                   preprocess_restarts=d.get("preprocess_restarts", 0),
                   updates_skipped_nonfinite=d.get("updates_skipped_nonfinite", 0),
                   reward_scalers={int(k): v for k, v in d.get("reward_scalers", {}).items()})


def first_at(records: list[dict], window: int, target: float | None, key: str = M.EPISODE_RETURN_MEAN) -> dict | None:
    """The first record with a full ``window`` of episodes whose ``key`` is at or above ``target``, else None.

    Where the target was first met: the driver still finishes the iterations in flight after it decides to stop,
    and those are not part of "time to target"."""
    if target is None:
        return None
    return next((r for r in records if r[M.EPISODES_IN_WINDOW] >= window and r.get(key) is not None
                 and r[key] >= target), None)


def pipeline_metrics(per_actor: list[dict]) -> dict:
    """Multimodal pipeline metrics over rollout actors: latencies and staleness as the worst actor's, counts
    summed, queue depths summed (they are per actor)."""
    out: dict[str, float] = {}
    for stats in per_actor:
        for key, value in stats.items():
            worst = key.endswith("_ms") or key.endswith("max_staleness") or key.endswith("max_depth")
            out[key] = max(out.get(key, value), value) if worst else out.get(key, 0) + value
    return out


class Records:
    """Makes the metrics records of one run. Rates are since the previous record (``mark``); times count from
    ``t_start`` (the process) and from ``start`` (training, plus the runs this one resumes)."""

    def __init__(self, state: RunState, t_start: float, say: Callable[[str], None], self_play: bool = False):
        self.state = state
        self.self_play = self_play  # add the learning seat's results against the pool (pool_win_rate, ...)
        self.t_start = t_start
        self.say = say
        self.t_train = None
        self._last = None
        self._profile_reported = False
        self._named: dict[str, object] = {}  # COMPILE and UPDATE_PATH as last written to a record
        self.rollout_time = RolloutTime()  # the rollout actors' stage seconds since the previous record

    def start(self, t_train: float) -> None:
        self.t_train = t_train
        self.mark(t_train)

    def mark(self, now: float) -> None:
        """The point the next record's rates are measured from."""
        self._last = (now, self.state.env_steps, self.state.samples_total)

    def train_time_s(self, now: float) -> float:
        return self.state.train_time_before_s + now - self.t_train

    def make(self, results: list[dict], r_stats: list[dict], s_stats: list[dict], now: float,
             rollout_actors: int) -> dict:
        """One record from an iteration's learner results (rank 0 first), rollout and shard stats."""
        state = self.state
        last_t, last_steps, last_samples = self._last
        dt = max(now - last_t, 1e-9)
        lead = results[0]

        def mean(key):
            return float(np.mean([res[key] for res in results]))

        record = {
            M.ITERATION: state.iteration,
            M.TIME_S: now - self.t_start,
            M.TRAIN_TIME_S: self.train_time_s(now),
            M.ENV_STEPS: state.env_steps,
            M.ENV_STEPS_PER_S: (state.env_steps - last_steps) / dt,
            M.LEARNER_SAMPLES: state.samples_total,
            M.LEARNER_SAMPLES_PER_S: (state.samples_total - last_samples) / dt,
            M.POLICY_VERSION: lead[M.POLICY_VERSION],
            M.EPISODES: state.episodes_total,
            M.EPISODES_IN_WINDOW: len(state.window),
            M.EPISODE_RETURN_MEAN: float(np.mean(state.window)) if state.window else float("nan"),
            # Sparse-reward tasks (minigrid, the multi-rate env) pay > 0 only on success.
            M.EPISODE_SUCCESS_RATE: float(np.mean(np.asarray(state.window) > 0)) if state.window else float("nan"),
            **{k: mean(k) for k in MEAN_OVER_LEARNERS},
            M.H2D_BYTES: int(sum(res[M.H2D_BYTES] for res in results)),
            M.HOST_SYNCS: int(lead[M.HOST_SYNCS]),
            M.ALLREDUCE_CALLS: int(lead[M.ALLREDUCE_CALLS]),
            # The lead learner's, both: its share is over its own update time (pipeline/metric_keys.py).
            M.COLLECTIVE_S: float(lead[M.COLLECTIVE_S]),
            M.COLLECTIVE_SHARE: float(lead[M.COLLECTIVE_SHARE]),
            M.POLICY_LAG_MAX: int(max(res[M.POLICY_LAG_MAX] for res in results)),
            # The data plane's ledger (pipeline/supply.py): cumulative over the run, resumes included.
            M.FRAGMENTS_PRODUCED: state.produced,
            M.FRAGMENTS_DROPPED_STALE: state.dropped,
            M.STALE_FRACTION: state.dropped / max(state.produced, 1),
            M.FRAGMENTS_REJECTED: int(state.rejected_before + state.board.get("rejected", 0)),
            M.TICKETS_IN_FLIGHT: int(state.board.get("in_flight", 0)),
            M.LEARNER_TAKE_FAILURES: int(sum(res[M.LEARNER_TAKE_FAILURES] for res in results)),
            M.REPLAY_DEPTH: int(sum(s["depth"] for s in s_stats)),
            M.REPLAY_ADDED: int(sum(s["added"] for s in s_stats)),
            M.ROLLOUT_ACTORS: rollout_actors,
            M.ROLLOUT_RESTARTS: state.rollout_restarts,
            M.ENV_FAILURES: state.env_failures,
            M.ROLLOUT_HANGS: state.rollout_hangs,
            M.ROLLOUT_MEMORY_KILLS: state.rollout_memory_kills,
            M.LAST_ROLLOUT_FAULT: state.last_rollout_fault,
            M.LEASES_EXPIRED: int(state.leases_expired_before + state.board.get("lease_expired", 0)),
            M.BOARD_RESTARTS: state.board_restarts,
            M.BOARD_MEMORY_REPLACEMENTS: state.board_memory_replacements,
            M.BOARD_RSS_MB: state.board.get("rss_mb"),
            M.BOARD_VOIDED: state.board_voided,
            M.CONTROL_RESTARTS: state.control_restarts,
            M.PREPROCESS_RESTARTS: state.preprocess_restarts,
            M.SHARD_RESTARTS: state.shard_restarts,
            M.LEARNER_RESTARTS: state.learner_restarts,
            M.FRAGMENTS_LOST: state.lost,
            M.CHECKPOINTS_SKIPPED: state.checkpoints_skipped,
            M.UPDATES_SKIPPED_NONFINITE: state.updates_skipped_nonfinite,
            M.ROLLOUT_BACKPRESSURE_S: float(sum(st["backpressure_s"] for st in r_stats)),
            M.ROLLOUT_RATE_LIMITED_S: float(sum(st["rate_limited_s"] for st in r_stats)),
            **{k: lead[k] for k in M.PPO_STATS},
        }
        if any(M.INFERENCE_CALLS in st for st in r_stats):  # rollout.inference: remote
            record[M.INFERENCE_CALLS] = int(sum(st.get(M.INFERENCE_CALLS, 0) for st in r_stats))
            record[M.INFERENCE_FALLBACKS] = int(sum(st.get(M.INFERENCE_FALLBACKS, 0) for st in r_stats))
        record.update(self.rollout_time.fold(r_stats))
        record.update(pipeline_metrics([st.get("pipeline", {}) for st in r_stats]))
        if self.self_play and state.window:
            from cluster.evaluation import elo_against

            returns = np.asarray(state.window)
            win, draw = float(np.mean(returns > 0)), float(np.mean(returns == 0))
            record.update({M.POOL_WIN_RATE: win, M.POOL_DRAW_RATE: draw, M.POOL_LOSS_RATE: float(np.mean(returns < 0)),
                           M.POOL_ELO: elo_against(win, draw)})
        # Several policies: rank 0's per-policy update figures, and each policy's agents' episodes.
        record.update({k: v for k, v in lead.items() if k.startswith(M.POLICY_PREFIX)})
        for name, window in state.policy_windows.items():
            record[M.policy_key(name, M.EPISODE_RETURN_MEAN)] = float(np.mean(window)) if window else float("nan")
            record[M.policy_key(name, M.EPISODES_IN_WINDOW)] = len(window)
        # What ran (the compile outcome, the update step) in this process's first record, a resumed run's too, and
        # again whenever it changes (a graph capture given up mid-run): not repeated in every record.
        for key in (M.COMPILE, M.UPDATE_PATH):
            if key not in self._named or self._named[key] != lead[key]:
                record[key] = self._named[key] = lead[key]
        if lead[M.PROFILE_TRACE] and not self._profile_reported:
            record[M.PROFILE_TRACE] = lead[M.PROFILE_TRACE]
            self._profile_reported = True
            self.say(f"profiler trace written: {lead[M.PROFILE_TRACE]}")
        return record
