"""End-of-run report from ``metrics.jsonl``: a plain-text summary table and one PNG.

    python -m cluster.report RUN_DIR        # prints the table, writes RUN_DIR/report.png

Steady-state figures are medians over the second half of the iterations, so start-up,
warm-up and compilation do not colour them. Values the driver could not compute are
written to JSONL as null (JSON has no NaN); they are skipped here, and a figure with no
value at all reads "n/a".

The file is streamed, never held: ``write_report`` reads it three times, one record at a
time (which records a resume replaced; how many are left and the episode window; then
every figure), and keeps only what the table and the plot show. So its memory is bounded
whatever the file's length: the medians are exact over up to ``MAX_MEDIAN_SAMPLES``
records of the second half and taken over an even sample of that many beyond, the return
curve goes through at most ``MAX_PLOT_POINTS`` records, and the time breakdown is at most
``BAR_BLOCKS`` bars. (``metrics.jsonl`` itself is bounded too: ``cluster/metrics.py``.)
"""

from __future__ import annotations

import functools
import json
import math
import numbers
import sys
import textwrap
import warnings
from array import array
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from cluster import host_time
from cluster.checkpoint import RunFiles
from cluster.metrics import si
from pipeline import metric_keys as M

__all__ = ["iter_records", "load_records", "summary_table", "plot_run", "write_report", "main"]

#: Records of the second half a median is taken over: all of them up to this many, else an even sample of this many
#: (a few MB of floats for the dozen medians, whatever the run's length).
MAX_MEDIAN_SAMPLES = 50_000
#: Records the return curve is drawn through: all of them up to this many, else an even sample of this many plus the
#: first with a full episode window and the last (a curve of more points than the plot's pixels draws the same).
MAX_PLOT_POINTS = 10_000
#: Bars of the learner-time breakdown: longer runs are averaged into this many blocks of consecutive iterations.
BAR_BLOCKS = 200
#: The verdict on what bounds the learner is wrapped to this many characters: no wider than the table's rows.
VERDICT_WIDTH = 96


# ---------------------------------------------------------------------- loading
def _read_lines(path: Path, bad: list) -> Iterator[dict]:
    """The JSON objects of ``path``, one line at a time; lines that are not JSON are counted in ``bad[0]``."""
    with open(path, "rb") as f:  # a line cut mid-character (a killed write) is one line that is not JSON, not an error
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                bad[0] += 1
                continue
            if isinstance(rec, dict):
                yield rec


def _jsonl_path(path) -> Path:
    path = Path(path)
    return path / "metrics.jsonl" if path.is_dir() else path


class _Records:
    """The records a report is made of, read as often as it needs (each read a fresh pass over them): a list in
    memory, or ``metrics.jsonl`` streamed from disk one record at a time. With ``last_run``, the records a later
    session replaced are left out (``iter_records``). Lines that are not JSON are skipped, with one warning after
    the first whole pass."""

    def __init__(self, read: Callable[[list], Iterable[dict]], last_run: bool = False, path: Path | None = None):
        self._read, self.path, self._bad, self._warned = read, path, [0], False
        self._drops = self._replaced() if last_run else None

    @classmethod
    def of(cls, records) -> "_Records":
        """Records given by the caller, taken as they are (a one-shot iterator is kept in memory: it is read twice)."""
        if isinstance(records, _Records):
            return records
        if iter(records) is records:
            records = list(records)
        return cls(lambda bad: records)

    @classmethod
    def from_file(cls, path, last_run: bool = True) -> "_Records":
        path = _jsonl_path(path)
        return cls(lambda bad: _read_lines(path, bad), last_run, path)

    def _pass(self) -> Iterator[dict]:
        self._bad[0] = 0
        yield from self._read(self._bad)
        if self._bad[0] and not self._warned:
            self._warned = True
            warnings.warn(f"{self.path}: skipped {self._bad[0]} line(s) that are not JSON", stacklevel=4)

    def _replaced(self) -> tuple[list[int], list[float]]:
        """Where the iteration counter goes back (a fresh run in a reused directory, a resume from an earlier
        checkpoint), the earlier records from that iteration on were replaced: a record is dropped when a later one
        has an iteration at or below its own. Such a later record is always a "step back" (at or below the highest
        iteration before it), so one pass keeps only the step backs' positions and, for each, the lowest iteration
        of it and every later one: memory follows the number of sessions, not of records. A record without an
        iteration goes with the last iteration before it."""
        positions, lowest, top = [], [], -math.inf
        for pos, rec in enumerate(self._pass()):
            it = _num(rec.get(M.ITERATION))
            if math.isnan(it):
                continue
            if it <= top:
                positions.append(pos)
                lowest.append(it)
            top = max(top, it)
        for k in range(len(lowest) - 2, -1, -1):
            lowest[k] = min(lowest[k], lowest[k + 1])
        return positions, lowest

    def __iter__(self) -> Iterator[dict]:
        if self._drops is None:
            yield from self._pass()
            return
        positions, lowest = self._drops
        k, it = 0, math.nan
        for pos, rec in enumerate(self._pass()):
            while k < len(positions) and positions[k] <= pos:
                k += 1
            own = _num(rec.get(M.ITERATION))
            it = own if not math.isnan(own) else it
            if k < len(positions) and not math.isnan(it) and lowest[k] <= it:
                continue  # a later record steps back to this iteration or below: replaced
            yield rec


def iter_records(path, last_run: bool = True) -> Iterator[dict]:
    """The records of ``metrics.jsonl`` (``path`` may also be the run directory), streamed: one in memory at a
    time. Lines that are not JSON (a run killed mid-write) are skipped with a warning.

    The driver appends, so one file can hold several sessions. With ``last_run``, where the iteration counter goes
    back to k the earlier records from k on are dropped: a fresh run in a reused directory (k = 1) replaces
    everything; a resume from a checkpoint at k-1 keeps the history up to it. (This reads the file once more first,
    to find where it goes back.)
    """
    return iter(_Records.from_file(path, last_run))


def load_records(path, last_run: bool = True) -> list[dict]:
    """``iter_records`` as a list, in memory: for small files and tests; the report itself streams."""
    return list(_Records.from_file(path, last_run))


# ---------------------------------------------------------------------- numbers
def _num(v) -> float:
    """A finite float, or NaN for None / strings / NaN / inf."""
    if isinstance(v, numbers.Real) and not isinstance(v, bool):
        v = float(v)
        return v if math.isfinite(v) else math.nan
    return math.nan


def _finite(xs) -> list[float]:
    return [x for x in xs if not math.isnan(x)]


def _nan_reduce(fn, xs) -> float:
    """``fn`` (a numpy nan-reduction) of ``xs`` as a float; NaN when no value is left, without
    numpy's all-NaN warning (or nanmax's ValueError on an empty list)."""
    a = np.asarray(xs, dtype=float)
    return math.nan if np.isnan(a).all() else float(fn(a))  # all() of an empty array is True


_median, _mean = (functools.partial(_nan_reduce, fn) for fn in (np.nanmedian, np.nanmean))


def _other_s(r) -> float:
    """Part of a learner iteration that is neither waiting for data nor the update."""
    it, w, u = _num(r.get(M.LEARNER_ITER_S)), _num(r.get(M.LEARNER_WAIT_S)), _num(r.get(M.LEARNER_UPDATE_S))
    return max(it - w - u, 0.0) if not math.isnan(it + w + u) else math.nan


def _f(x, spec: str, scale: float = 1.0) -> str:
    return "n/a" if x is None or math.isnan(x) else format(x * scale, spec)


class _Last:
    """The last finite value seen."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = math.nan

    def see(self, x: float) -> None:
        if not math.isnan(x):
            self.value = x


# ---------------------------------------------------------------------- the digest
#: The figures whose medians over the second half the table shows (``OTHER_S``: iteration time outside the wait and
#: the update, ``_other_s``).
OTHER_S = "_other_s"
HALF_KEYS = (M.ENV_STEPS_PER_S, M.LEARNER_SAMPLES_PER_S, M.HOST_BOUND_FRACTION, M.DEVICE_IDLE_FRACTION,
             M.LEARNER_WAIT_S, M.LEARNER_UPDATE_S, M.LEARNER_ITER_S, M.FEED_PULL_S, M.FEED_COLLATE_S, M.H2D_MS)
#: Keys whose rows the table shows only when some record has them.
OPTIONAL_KEYS = (M.DEVICE_IDLE_FRACTION, M.ROLLOUT_RESTARTS, M.SHARD_RESTARTS, M.FRAGMENTS_LOST)


class _Digest:
    """Everything the table and the plot show, gathered in passes over the records (``_Records``), with memory
    bounded whatever their number (module docstring): counts and last values, running sums and maxima, a sample
    of the second half for the medians, a sample of the return curve, and block sums for the bars."""

    def __init__(self, records, window: int | None = None):
        records = _Records.of(records)
        n, widest = 0, math.nan
        for r in records:
            n += 1
            eiw = _num(r.get(M.EPISODES_IN_WINDOW))
            widest = eiw if math.isnan(widest) or eiw > widest else widest
        self.n = n
        self.window = int(window) if window else (None if math.isnan(widest) else int(widest))
        self.half_from = n // 2  # the steady-state slice: the last ceil(n/2) records
        self.half_every = max(1, math.ceil((n - self.half_from) / MAX_MEDIAN_SAMPLES))
        self.plot_every = max(1, math.ceil(n / MAX_PLOT_POINTS))
        self.block = max(1, math.ceil(n / BAR_BLOCKS))
        self.half = {k: array("d") for k in HALF_KEYS + (OTHER_S,)}
        self.half_first_it = self.half_last_it = math.nan
        self.has = dict.fromkeys(OPTIONAL_KEYS, False)
        # The rollout actors' seconds per stage over the second half, summed (cluster/host_time.py): their shares.
        self.rollout_s = dict.fromkeys((M.ROLLOUT_WALL_S, *(key for _, key, _ in M.ROLLOUT_STAGES)), 0.0)
        self.last = {k: _Last() for k in (M.TIME_S, M.TRAIN_TIME_S, M.ENV_STEPS, M.ITERATION, M.EPISODE_RETURN_MEAN,
                                          M.FRAGMENTS_DROPPED_STALE, M.ROLLOUT_RESTARTS, M.SHARD_RESTARTS,
                                          M.FRAGMENTS_LOST)}
        self.startup = _Last()  # time_s - train_time_s: start-up before the first iteration
        self.sessions, self.ended_s = 0, 0.0  # driver processes (time_s restarts), the earlier ones' last time_s
        self.lag_sum, self.lag_count, self.lag_max = 0.0, 0, math.nan
        self.best = self.best_full = (math.nan, math.nan, math.nan)  # (return, iteration, env steps), first max
        self.first_full = None  # index of the first record with a full episode window
        self.points: list[tuple] = []  # (index, env steps, return, train time, full window) of the return curve
        self.bars = {k: [] for k in ("it", "wait", "upd", "oth", "hb")}  # per block: [sum, count]
        self._host_syncs = (0.0, 0.0)  # (growth, iterations spanned) of the cumulative host_syncs
        self._prev: dict | None = None
        self._prev_ts = self._last_ts = math.nan
        for i, r in enumerate(records):
            self._add(i, r)
        if self.n == 1:
            self._one = self._prev

    def _add(self, i: int, r: dict) -> None:
        num = lambda key: _num(r.get(key))  # noqa: E731
        for key in self.has:
            self.has[key] = self.has[key] or key in r
        for key, last in self.last.items():
            last.see(num(key))
        t, train = num(M.TIME_S), num(M.TRAIN_TIME_S)
        self.startup.see(t - train)
        if not math.isnan(t):  # sessions: time_s goes back when a resumed driver starts again
            if math.isnan(self._last_ts) or t < self._last_ts:
                self.sessions += 1
            self._last_ts = t
        if not math.isnan(t + self._prev_ts) and t < self._prev_ts:
            self.ended_s += self._prev_ts  # an earlier session counts to its last record
        self._prev_ts = t
        lag = num(M.POLICY_LAG_MEAN)
        if not math.isnan(lag):
            self.lag_sum, self.lag_count = self.lag_sum + lag, self.lag_count + 1
        lag_max = num(M.POLICY_LAG_MAX)
        if not math.isnan(lag_max) and (math.isnan(self.lag_max) or lag_max > self.lag_max):
            self.lag_max = lag_max
        ret, steps, eiw, it = num(M.EPISODE_RETURN_MEAN), num(M.ENV_STEPS), num(M.EPISODES_IN_WINDOW), num(M.ITERATION)
        # Only full windows count as "best" when any exist (a high mean over a few episodes is not).
        full_for_best = bool(self.window) and eiw >= self.window
        if not math.isnan(ret):
            if math.isnan(self.best[0]) or ret > self.best[0]:
                self.best = (ret, it, steps)
            if full_for_best and (math.isnan(self.best_full[0]) or ret > self.best_full[0]):
                self.best_full = (ret, it, steps)
        if self._prev is not None:  # a cumulative counter's growth between consecutive records
            va, vb = _num(self._prev.get(M.HOST_SYNCS)), num(M.HOST_SYNCS)
            ia = _num(self._prev.get(M.ITERATION))
            if not math.isnan(va + vb + ia + it) and it > ia and vb >= va:
                self._host_syncs = (self._host_syncs[0] + vb - va, self._host_syncs[1] + it - ia)
        self._prev = {M.HOST_SYNCS: r.get(M.HOST_SYNCS), M.ITERATION: r.get(M.ITERATION)}
        if i >= self.half_from:
            if i == self.half_from:
                self.half_first_it = it
            self.half_last_it = it
            for key in self.rollout_s:
                v = num(key)
                if not math.isnan(v):
                    self.rollout_s[key] += v
            if (i - self.half_from) % self.half_every == 0:
                for key in HALF_KEYS:
                    self.half[key].append(num(key))
                self.half[OTHER_S].append(_other_s(r))
        # The return curve: points whose window is not yet full are drawn faint.
        full = not self.window or math.isnan(eiw) or eiw >= self.window
        first_full = full and self.first_full is None
        if first_full:
            self.first_full = i
        if i % self.plot_every == 0 or first_full or i == self.n - 1:
            self.points.append((i, steps, ret, train, full))
        # The bars: block means of consecutive iterations (NaNs left out; an all-NaN block stays NaN).
        b = i // self.block
        values = {"it": float(i + 1) if math.isnan(it) else it, "wait": num(M.LEARNER_WAIT_S) * 1e3,
                  "upd": num(M.LEARNER_UPDATE_S) * 1e3, "oth": _other_s(r) * 1e3,
                  "hb": num(M.HOST_BOUND_FRACTION) * 100}
        for key, v in values.items():
            sums = self.bars[key]
            if len(sums) <= b:
                sums.append([0.0, 0])
            if not math.isnan(v):
                sums[b][0] += v
                sums[b][1] += 1

    # ---- what the table and the plot read
    def median(self, key: str) -> float:
        return _median(self.half[key])

    def per_iteration_host_syncs(self) -> float:
        """Rate per iteration of the cumulative host_syncs: its growth over the iterations it spans, counted
        between consecutive records only, so a counter that restarts (a resumed run's fresh learner) does not
        distort it. One record: the counter over its iteration number."""
        grown, spanned = self._host_syncs
        if spanned:
            return grown / spanned
        if self.n == 1:
            v, i = _num(self._one.get(M.HOST_SYNCS)), _num(self._one.get(M.ITERATION))
            return v / i if not math.isnan(v + i) and i > 0 else math.nan
        return math.nan

    def best_return(self) -> tuple[float, float, float]:
        """(return, iteration, env steps) of the highest windowed mean return, counting full windows only when any
        exist."""
        return self.best_full if not math.isnan(self.best_full[0]) else self.best

    def bar(self, key: str) -> list[float]:
        return [s / c if c else math.nan for s, c in self.bars[key]]


# ---------------------------------------------------------------------- summary
def summary_table(records, result_fields: dict | None = None, *, window: int | None = None) -> str:
    """End-of-run summary as a fixed-width plain-text table.

    ``records``: a list of records, or what ``write_report`` streams. ``result_fields``: run-level facts the records
    lack or the caller knows better, e.g. ``dataclasses.asdict(RunResult)`` (``reason``, ``wall_s``, ``env_steps``,
    ``iterations``, ``episode_return_mean``, ``run_dir``, ``checkpoint_path``). ``window`` is ``run.target_window``
    (default: the largest ``episodes_in_window`` seen).
    """
    d = records if isinstance(records, _Digest) else _Digest(records, window)
    return _table(d, result_fields)


def _table(d: _Digest, result_fields: dict | None) -> str:
    res = dict(result_fields or {})
    window = d.window
    hmed = d.median
    last = {k: v.value for k, v in d.last.items()}
    ms = lambda x: _f(x, ".2f", 1e3)  # noqa: E731

    # run
    sessions = d.sessions
    wall = _num(res.get("wall_s"))
    if math.isnan(wall) or sessions > 1:
        # time_s restarts with each session; an earlier session counts to its last record
        wall = d.ended_s + (last[M.TIME_S] if math.isnan(wall) else wall)
    train = last[M.TRAIN_TIME_S]  # continues across a resume
    startup = d.startup.value if sessions == 1 else math.nan
    wall_note = "" if "wall_s" in res else "to the last record"
    if sessions > 1:
        wall_note = f"{sessions} sessions (resumed), " + (wall_note or "earlier ones to their last record")
    # The caller's figure where it gave one, else the records'.
    pick = lambda *xs: next((x for x in reversed(xs) if not math.isnan(x)), math.nan)  # noqa: E731
    steps = pick(last[M.ENV_STEPS], _num(res.get(M.ENV_STEPS)))
    iters = pick(float(d.n), last[M.ITERATION], _num(res.get("iterations")))
    final = pick(last[M.EPISODE_RETURN_MEAN], _num(res.get(M.EPISODE_RETURN_MEAN)))
    best, best_it, best_steps = d.best_return()
    best_note = "" if math.isnan(best) else (f"iteration {_f(best_it, '.0f')}, {_f(best_steps, ',.0f')} env steps")
    sps_from_start = steps / wall if wall > 0 else math.nan

    # learner iteration breakdown (medians of the second half)
    wait, upd, it_s = hmed(M.LEARNER_WAIT_S), hmed(M.LEARNER_UPDATE_S), hmed(M.LEARNER_ITER_S)
    other = hmed(OTHER_S)
    share = lambda x: "" if math.isnan(x) or not it_s > 0 else f"{100 * x / it_s:5.1f} % of iteration"  # noqa: E731
    lag_mean = d.lag_sum / d.lag_count if d.lag_count else math.nan

    rows: list[tuple] = [
        ("run",),
        ("wall time, from start", _f(wall, ".1f"), "s", wall_note),
        ("training loop", _f(train, ".1f"), "s"),
        ("start-up (to first iteration)", _f(startup, ".1f"), "s"),
        ("env steps", _f(steps, ",.0f"), ""),
        ("iterations", _f(iters, ",.0f"), ""),
        (f"return, mean of last {window or '?'} episodes",),
        ("final", _f(final, ".1f"), ""),
        ("best", _f(best, ".1f"), "", best_note),
        ("throughput",),
        ("env steps/s, overall", _f(steps / train if train > 0 else math.nan, ",.0f"), "/s",
         "" if math.isnan(sps_from_start) else f"training loop; {sps_from_start:,.0f}/s from start"),
        ("env steps/s, median 2nd half", _f(hmed(M.ENV_STEPS_PER_S), ",.0f"), "/s"),
        ("learner samples/s, median 2nd half", _f(hmed(M.LEARNER_SAMPLES_PER_S), ",.0f"), "/s"),
        ("host-bound fraction, median 2nd half", _f(hmed(M.HOST_BOUND_FRACTION), ".1f", 100), "%",
         "learner waiting for its next batch"),
        *([("device idle fraction, median 2nd half", _f(hmed(M.DEVICE_IDLE_FRACTION), ".1f", 100), "%",
            "iteration time outside the update")] if d.has[M.DEVICE_IDLE_FRACTION] else []),
        ("pipeline",),
        ("policy lag, mean / max", f"{_f(lag_mean, '.2f')} / {_f(d.lag_max, '.0f')}", "versions"),
        ("fragments dropped as stale", _f(last[M.FRAGMENTS_DROPPED_STALE], ",.0f"), ""),
        ("host syncs per iteration", _f(d.per_iteration_host_syncs(), ".2f"), ""),  # cumulative on rank 0
        *([("rollout / shard restarts", f"{_f(last[M.ROLLOUT_RESTARTS], '.0f')} / "
            f"{_f(last[M.SHARD_RESTARTS], '.0f')}", "")]
          if d.has[M.ROLLOUT_RESTARTS] or d.has[M.SHARD_RESTARTS] else []),
        *([("fragments lost", _f(last[M.FRAGMENTS_LOST], ",.0f"), "", "in actors or shards that died")]
          if d.has[M.FRAGMENTS_LOST] else []),
        *_rollout_rows(d, hmed(M.HOST_BOUND_FRACTION)),
        ("learner iteration, median of 2nd half" + (f" (iterations {_f(d.half_first_it, '.0f')}-"
                                                    f"{_f(d.half_last_it, '.0f')})" if d.n else ""),),
        ("wait for batch (host-bound)", ms(wait), "ms", share(wait)),
        ("update", ms(upd), "ms", share(upd)),
        ("other (publish, call overhead)", ms(other), "ms", share(other)),
        ("total", ms(it_s), "ms"),
        ("feed thread, median of 2nd half",),
        ("pull from shards", ms(hmed(M.FEED_PULL_S)), "ms"),
        ("collate", ms(hmed(M.FEED_COLLATE_S)), "ms"),
        ("host-to-device copy", _f(hmed(M.H2D_MS), ".2f"), "ms"),
        *([("checkpoint", "", "", str(res["checkpoint_path"]))] if res.get("checkpoint_path") else []),
    ]

    lab_w, val_w, unit_w = (max(len(r[k]) for r in rows if len(r) > 1) for k in range(3))
    lines = [r[0] if len(r) == 1 else f"  {r[0]:<{lab_w}}  {r[1]:>{val_w}} {r[2]:<{unit_w}}  {(*r, '')[3]}".rstrip()
             for r in rows]
    head = ["Run summary" + (f": {res['run_dir']}" if res.get("run_dir") else ""),
            *([f"stop reason: {res['reason']}"] if res.get("reason") else []),
            *([] if d.n else ["(no metric records)"])]
    rule = "=" * max(len(s) for s in lines + head)
    return "\n".join([*head, rule, *lines, rule])


def _rollout_rows(d: _Digest, host_bound: float) -> list[tuple]:
    """Where the rollout actors' time went in the second half, stage by stage, and what bounds the learner with what
    to change for it (``host_time.verdict``); nothing for records without the actors' stage figures."""
    wall = d.rollout_s[M.ROLLOUT_WALL_S]
    if not wall > 0:
        return []
    shares = host_time.shares({stage: d.rollout_s[key] for stage, key, _ in M.ROLLOUT_STAGES}, wall)
    rows: list[tuple] = [("rollout actors, share of their time in the 2nd half",)]
    rows += [(host_time.LABELS[stage], _f(shares[stage], ".1f", 100), "%",
              f"{d.rollout_s[key]:,.2f} s" + ("" if stage != "other" else ", the loop's book-keeping"))
             for stage, key, _ in M.ROLLOUT_STAGES]
    verdict = host_time.verdict(host_bound, shares)
    if verdict:
        rows += [(line,) for line in textwrap.wrap(verdict, VERDICT_WIDTH, initial_indent="  -> ",
                                                   subsequent_indent="     ")]
    return rows


# ---------------------------------------------------------------------- plot
def _interp(x, xp, fp):
    """np.interp, but extrapolated linearly past both ends (a secondary axis needs an invertible map)."""
    x = np.asarray(x, dtype=float)
    y = np.interp(x, xp, fp)
    lo, hi = (fp[1] - fp[0]) / (xp[1] - xp[0]), (fp[-1] - fp[-2]) / (xp[-1] - xp[-2])
    y = np.where(x < xp[0], fp[0] + (x - xp[0]) * lo, y)
    return np.where(x > xp[-1], fp[-1] + (x - xp[-1]) * hi, y)


def plot_run(records, png_path, title: str | None = None, *,
             target_return: float | None = None, window: int | None = None) -> Path:
    """One PNG, two panels: return vs env steps (with training wall-clock time on a second
    x axis), and the learner iteration time breakdown (stacked bars; runs over BAR_BLOCKS iterations
    are averaged into blocks) with the host-bound fraction.

    Drawn on a bare Agg canvas: pyplot is never imported, so no window can open and no
    global backend is changed.
    """
    d = records if isinstance(records, _Digest) else _Digest(records, window)
    return _plot(d, png_path, title, target_return)


def _plot(d: _Digest, png_path, title: str | None, target_return: float | None) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    window = d.window
    fig = Figure(figsize=(15, 5.6), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax_r, ax_t = fig.subplots(1, 2, width_ratios=[1, 1.15])
    fig.suptitle(title or "Training run", fontsize=14, fontweight="bold")
    grey = dict(ha="center", va="center", color="0.4")

    # ---- left: return vs env steps
    steps = [p[1] for p in d.points]
    ret = [p[2] for p in d.points]
    tim = [p[3] for p in d.points]  # train_time_s: continues across a resume, unlike time_s
    # Points whose window is not yet full (fewer than `window` episodes so far) are drawn faint.
    full = [p[4] for p in d.points]
    first_full = full.index(True) if True in full else len(full)
    marker = "o" if d.n <= 40 else None
    if first_full > 0 and _finite(ret[:first_full]):
        ax_r.plot(steps[:first_full + 1], ret[:first_full + 1], color="tab:blue", alpha=0.35, lw=1.4, ls=":",
                  marker=marker, ms=3, label=f"mean return, fewer than {window} episodes so far")
    ax_r.plot(steps[first_full:], ret[first_full:], color="tab:blue", lw=1.8, marker=marker, ms=3,
              label=f"mean return, last {window or '?'} episodes")
    if target_return is not None and math.isfinite(target_return):
        ax_r.axhline(target_return, color="tab:green", ls="--", lw=1.2, label=f"target {target_return:g}")
    best, best_it, best_steps = d.best_return()
    if not math.isnan(best):
        it_label = int(best_it) if not math.isnan(best_it) else None
        ax_r.plot([best_steps], [best], marker="*", ms=13, color="tab:orange", ls="none",
                  label=f"best {best:.1f} (iteration {it_label})")
    ax_r.set(xlabel="env steps", ylabel="episode return")
    ax_r.set_title("Return vs env steps", loc="left")
    ax_r.xaxis.set_major_formatter(FuncFormatter(si))
    ax_r.grid(alpha=0.3)
    if not d.n or not _finite(ret):
        ax_r.text(0.5, 0.5, "no finished episodes" if d.n else "no records", transform=ax_r.transAxes, **grey)
        ax_r.set_yticks([])
        if not d.n:
            ax_r.set_xticks([])
    else:
        ax_r.legend(loc="best", fontsize=9)
    # Training (wall-clock) time on a second x axis, mapped through the run's own (steps, time) curve.
    xs, ts = [], []
    for s, t in sorted({(s, t) for s, t in zip(steps, tim) if not math.isnan(s + t)}):
        if not xs or (s > xs[-1] and t > ts[-1]):  # strictly increasing in both, as the interpolation needs
            xs.append(s)
            ts.append(t)
    if len(xs) >= 2:
        sec = ax_r.secondary_xaxis(-0.16, functions=(lambda s: _interp(s, xs, ts), lambda t: _interp(t, ts, xs)))
        sec.set_xlabel("training time, wall clock (s)", color="0.35")
        sec.tick_params(colors="0.35")
        sec.spines["bottom"].set_color("0.35")

    # ---- right: learner iteration breakdown, in blocks of d.block iterations
    block = d.block
    it, wait, upd, oth, hb = (d.bar(k) for k in ("it", "wait", "upd", "oth", "hb"))
    handles = []
    if it:
        bottom = [0.0] * len(it)
        for ys, label, color in [(wait, "wait for batch (host-bound)", "#d62728"), (upd, "update", "#1f77b4"),
                                 (oth, "other (publish, call overhead)", "#bbbbbb")]:
            ys = [0.0 if math.isnan(y) else y for y in ys]
            handles.append(ax_t.bar(it, ys, width=(0.85 if len(it) <= 80 else 1.0) * block, bottom=bottom,
                                    color=color, label=label, edgecolor="none", alpha=0.9))
            bottom = [b + y for b, y in zip(bottom, ys)]
        totals = [b for b in bottom if b > 0]
        if totals:
            p95, top = float(np.percentile(totals, 95)), max(totals)
            if top > 2.5 * p95:  # warm-up / compile iterations would flatten everything else
                ax_t.set_ylim(0, 1.6 * p95)
                off = [i for i, b in zip(it, bottom) if b > 1.6 * p95]
                note = (f"{'iteration' if block == 1 else 'bar at iteration'} {off[0]:.0f} off scale: {top:,.0f} ms"
                        if len(off) == 1 else f"{len(off)} iterations off scale, max {top:,.0f} ms")
                ax_t.text(0.99, 0.98, note, transform=ax_t.transAxes, ha="right", va="top", fontsize=8, color="0.3")
            else:
                ax_t.set_ylim(0, 1.15 * top)
    else:
        ax_t.text(0.5, 0.5, "no records", transform=ax_t.transAxes, **grey)
        ax_t.set_xticks([])
        ax_t.set_yticks([])
    ax_t.set(xlabel="iteration" + (f" (mean of {block} per bar)" if block > 1 else ""),
             ylabel="learner iteration time (ms)")
    ax_t.set_title("Learner iteration: where the time goes", loc="left")
    ax_t.grid(axis="y", alpha=0.3)
    ax_t.set_axisbelow(True)
    ax_hb = ax_t.twinx()
    handles += ax_hb.plot(it, hb, color="black", lw=1.3, marker="." if len(it) <= 40 else None,
                          label="host-bound fraction (right axis)")
    ax_hb.set_ylim(0, max([100.0, *(1.05 * h for h in _finite(hb))]))
    ax_hb.set_ylabel("host-bound fraction (%)")
    if it:
        ax_t.set_xlim(min(it) - 0.5 * block, max(it) + 0.5 * block)
    if d.n:
        ax_t.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=9, ncol=4,
                    frameon=False)
    else:
        ax_hb.set_yticks([])
    fig.savefig(png_path, format="png")
    return png_path


# ---------------------------------------------------------------------- run dir
def _read_config(path: Path) -> dict:
    try:
        import yaml

        cfg = yaml.safe_load(path.read_text())
    except Exception:  # no file, unreadable, not YAML, or no yaml module
        return {}
    return cfg if isinstance(cfg, dict) else {}


def write_report(run_dir, result_fields: dict | None = None, *, window: int | None = None,
                 target_return: float | None = None, plot: bool = True, title: str | None = None):
    """Summary of RUN_DIR/metrics.jsonl to RUN_DIR/summary.txt and the plot to RUN_DIR/report.png, the file
    streamed (module docstring: memory bounded whatever its length).

    Returns ``(table, png_path_or_None)``. A plot that cannot be drawn (matplotlib missing,
    anything else) does not fail the call: it warns and returns None for the path.
    """
    files = RunFiles.of(run_dir)
    run_dir, path = files.root, files.metrics
    records = _Records.from_file(path) if path.is_file() else []
    cfg = _read_config(files.config)
    cfg_run = cfg.get("run") or {}
    window = window or cfg_run.get("target_window")
    if target_return is None:
        target_return = cfg_run.get("target_return")
    digest = _Digest(records, window)  # the file streamed: what the table and the plot show, nothing more
    table = _table(digest, {"run_dir": str(run_dir), **(result_fields or {})})
    files.summary.write_text(table + "\n")
    png = None
    if plot:
        if title is None:
            env_id = (cfg.get("env") or {}).get("id")
            title = f"{env_id}: {run_dir.name}" if env_id else run_dir.name
        try:
            png = plot_run(digest, files.report_png, title=title, target_return=target_return)
        except ImportError as e:
            warnings.warn(f"no report.png: {e} (pip install matplotlib)", stacklevel=2)
        except Exception as e:  # a finished run must not fail on its plot
            warnings.warn(f"no report.png: {type(e).__name__}: {e}", stacklevel=2)
    return table, png


def main(argv=None) -> int:
    from cluster.config import ArgumentParser

    p = ArgumentParser(prog="python -m cluster.report",
                                description="Summarise a run: a table on stdout, RUN_DIR/report.png, RUN_DIR/summary.txt.")
    p.add_argument("run_dir", help="run directory (holding metrics.jsonl), or the metrics.jsonl file itself")
    p.add_argument("--no-plot", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    if run_dir.is_file():
        run_dir = run_dir.parent
    files = RunFiles(run_dir)
    path = files.metrics
    if not path.is_file():
        print(f"report: no metrics.jsonl in {run_dir}", file=sys.stderr)
        return 2
    try:
        if not any(True for _ in _read_lines(path, [0])):
            print(f"report: {path} holds no metrics records (no line of it is a JSON object); allowed: the "
                  f"metrics.jsonl a run writes", file=sys.stderr)
            return 2
        with warnings.catch_warnings(record=True) as caught:  # each warning one line, not two with its source
            warnings.simplefilter("always")
            table, png = write_report(files, plot=not args.no_plot)
    except OSError as e:  # unreadable metrics.jsonl; summary.txt or report.png not writable
        where = e.filename or run_dir
        print(f"report: {where} cannot be {'read' if str(where) == str(path) else 'written'} ({type(e).__name__}: "
              f"{e.strerror or e}); allowed: a run directory this process can read and write", file=sys.stderr)
        return 2
    for w in caught:
        print(f"warning: {' '.join(str(w.message).split())}", file=sys.stderr)
    print(table)
    print(f"\nsummary written: {files.summary}")
    if png is not None:
        print(f"plot written:    {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
