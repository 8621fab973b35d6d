"""End-of-run report from ``metrics.jsonl``: a plain-text summary table and one PNG.

    python -m cluster.report RUN_DIR        # prints the table, writes RUN_DIR/report.png

Steady-state figures are medians over the second half of the iterations, so start-up,
warm-up and compilation do not colour them. Values the driver could not compute are
written to JSONL as null (JSON has no NaN); they are skipped here, and a figure with no
value at all reads "n/a".
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import numbers
import sys
import warnings
from pathlib import Path

import numpy as np

from cluster.metrics import si
from pipeline import metric_keys as M

__all__ = ["load_records", "summary_table", "plot_run", "write_report", "main"]


# ---------------------------------------------------------------------- loading
def load_records(path, last_run: bool = True) -> list[dict]:
    """The records of ``metrics.jsonl`` (``path`` may also be the run directory); lines that are
    not JSON (a run killed mid-write) are skipped with a warning.

    The driver appends, so one file can hold several sessions. With ``last_run``, where the
    iteration counter goes back to k the earlier records from k on are dropped: a fresh run in
    a reused directory (k = 1) replaces everything; a resume from a checkpoint at k-1 keeps the
    history up to it.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    records: list[dict] = []
    bad = 0
    with open(path) as f:
        for line in filter(None, map(str.strip, f)):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if isinstance(rec, dict):
                records.append(rec)
    if bad:
        warnings.warn(f"{path}: skipped {bad} line(s) that are not JSON", stacklevel=2)
    if not last_run:
        return records
    kept: list[dict] = []
    for rec in records:
        it = _num(rec.get(M.ITERATION))
        if kept and it <= _num(kept[-1].get(M.ITERATION)):  # False when either is NaN
            while kept and not _num(kept[-1].get(M.ITERATION)) < it:
                kept.pop()
        kept.append(rec)
    return kept


def _sessions(records) -> int:
    """Driver processes the records span: ``time_s`` (time since the process started) restarts on resume."""
    ts = _finite(_series(records, M.TIME_S))
    return 1 + sum(1 for a, b in zip(ts, ts[1:]) if b < a) if ts else 0


# ---------------------------------------------------------------------- numbers
def _num(v) -> float:
    """A finite float, or NaN for None / strings / NaN / inf."""
    if isinstance(v, numbers.Real) and not isinstance(v, bool):
        v = float(v)
        return v if math.isfinite(v) else math.nan
    return math.nan


def _series(records, key) -> list[float]:
    return [_num(r.get(key)) for r in records]


def _finite(xs) -> list[float]:
    return [x for x in xs if not math.isnan(x)]


def _nan_reduce(fn, xs) -> float:
    """``fn`` (a numpy nan-reduction) of ``xs`` as a float; NaN when no value is left, without
    numpy's all-NaN warning (or nanmax's ValueError on an empty list)."""
    a = np.asarray(xs, dtype=float)
    return math.nan if np.isnan(a).all() else float(fn(a))  # all() of an empty array is True


_median, _mean, _max = (functools.partial(_nan_reduce, fn) for fn in (np.nanmedian, np.nanmean, np.nanmax))


def _last(xs) -> float:
    """The last non-NaN value of ``xs``, or NaN."""
    return next((x for x in reversed(xs) if not math.isnan(x)), math.nan)


def _has(records, key) -> bool:
    return any(key in r for r in records)


def _per_iteration(records, key) -> float:
    """Rate per iteration of a cumulative counter: its growth over the iterations it spans.

    Counted between consecutive records only, so a counter that restarts (a resumed run's
    fresh learner) does not distort it. One record: the counter over its iteration number.
    """
    grown = spanned = 0.0
    for a, b in zip(records, records[1:]):
        va, vb = _num(a.get(key)), _num(b.get(key))
        ia, ib = _num(a.get(M.ITERATION)), _num(b.get(M.ITERATION))
        if not math.isnan(va + vb + ia + ib) and ib > ia and vb >= va:
            grown += vb - va
            spanned += ib - ia
    if spanned:
        return grown / spanned
    if len(records) == 1:
        v, i = _num(records[0].get(key)), _num(records[0].get(M.ITERATION))
        return v / i if not math.isnan(v + i) and i > 0 else math.nan
    return math.nan


def _other_s(r) -> float:
    """Part of a learner iteration that is neither waiting for data nor the update."""
    it, w, u = _num(r.get(M.LEARNER_ITER_S)), _num(r.get(M.LEARNER_WAIT_S)), _num(r.get(M.LEARNER_UPDATE_S))
    return max(it - w - u, 0.0) if not math.isnan(it + w + u) else math.nan


def _f(x, spec: str, scale: float = 1.0) -> str:
    return "n/a" if x is None or math.isnan(x) else format(x * scale, spec)


# ---------------------------------------------------------------------- summary
def _window(records, window) -> int | None:
    if window:
        return int(window)
    w = _max(_series(records, M.EPISODES_IN_WINDOW))
    return None if math.isnan(w) else int(w)


def _best_return(records, window):
    """(value, record) of the highest windowed mean return, counting full windows only when any exist."""
    cands = [(r, v) for r in records if not math.isnan(v := _num(r.get(M.EPISODE_RETURN_MEAN)))]
    if window:
        cands = [(r, v) for r, v in cands if _num(r.get(M.EPISODES_IN_WINDOW)) >= window] or cands
    if not cands:
        return math.nan, None
    r, v = max(cands, key=lambda rv: rv[1])
    return v, r


def summary_table(records: list[dict], result_fields: dict | None = None, *, window: int | None = None) -> str:
    """End-of-run summary as a fixed-width plain-text table.

    ``result_fields``: run-level facts the records lack or the caller knows better, e.g.
    ``dataclasses.asdict(RunResult)`` (``reason``, ``wall_s``, ``env_steps``, ``iterations``,
    ``episode_return_mean``, ``run_dir``, ``checkpoint_path``). ``window`` is ``run.target_window``
    (default: the largest ``episodes_in_window`` seen).
    """
    res = dict(result_fields or {})
    half = records[len(records) // 2:]  # the steady-state slice: the last ceil(n/2) records
    window = _window(records, window)
    col = lambda key: _series(records, key)  # noqa: E731
    hmed = lambda key: _median(_series(half, key))  # noqa: E731
    ms = lambda x: _f(x, ".2f", 1e3)  # noqa: E731

    # run
    sessions = _sessions(records)
    wall = _num(res.get("wall_s"))
    if math.isnan(wall) or sessions > 1:
        # time_s restarts with each session; an earlier session counts to its last record
        ts = col(M.TIME_S)
        ends = [a for a, b in zip(ts, ts[1:]) if not math.isnan(a + b) and b < a]
        wall = sum(ends) + (_last(ts) if math.isnan(wall) else wall)
    train = _last(col(M.TRAIN_TIME_S))  # continues across a resume
    startup = _last([t - tr for t, tr in zip(col(M.TIME_S), col(M.TRAIN_TIME_S))]) if sessions == 1 else math.nan
    wall_note = "" if "wall_s" in res else "to the last record"
    if sessions > 1:
        wall_note = f"{sessions} sessions (resumed), " + (wall_note or "earlier ones to their last record")
    # The caller's figure where it gave one, else the records' (_last picks the last non-NaN).
    steps = _last([_last(col(M.ENV_STEPS)), _num(res.get(M.ENV_STEPS))])
    iters = _last([float(len(records)), _last(col(M.ITERATION)), _num(res.get("iterations"))])
    final = _last([_last(col(M.EPISODE_RETURN_MEAN)), _num(res.get(M.EPISODE_RETURN_MEAN))])
    best, best_rec = _best_return(records, window)
    best_note = "" if best_rec is None else (f"iteration {_f(_num(best_rec.get(M.ITERATION)), '.0f')}, "
                                             f"{_f(_num(best_rec.get(M.ENV_STEPS)), ',.0f')} env steps")
    sps_from_start = steps / wall if wall > 0 else math.nan

    # learner iteration breakdown (medians of the second half)
    wait, upd, it_s = hmed(M.LEARNER_WAIT_S), hmed(M.LEARNER_UPDATE_S), hmed(M.LEARNER_ITER_S)
    other = _median([_other_s(r) for r in half])
    share = lambda x: "" if math.isnan(x) or not it_s > 0 else f"{100 * x / it_s:5.1f} % of iteration"  # noqa: E731

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
            "iteration time outside the update")] if _has(records, M.DEVICE_IDLE_FRACTION) else []),
        ("pipeline",),
        ("policy lag, mean / max",
         f"{_f(_mean(col(M.POLICY_LAG_MEAN)), '.2f')} / {_f(_max(col(M.POLICY_LAG_MAX)), '.0f')}", "versions"),
        ("fragments dropped as stale", _f(_last(col(M.FRAGMENTS_DROPPED_STALE)), ",.0f"), ""),
        ("host syncs per iteration", _f(_per_iteration(records, "host_syncs"), ".2f"), ""),  # cumulative on rank 0
        *([("rollout / shard restarts", f"{_f(_last(col(M.ROLLOUT_RESTARTS)), '.0f')} / "
            f"{_f(_last(col(M.SHARD_RESTARTS)), '.0f')}", "")]
          if _has(records, M.ROLLOUT_RESTARTS) or _has(records, M.SHARD_RESTARTS) else []),
        *([("fragments lost", _f(_last(col(M.FRAGMENTS_LOST)), ",.0f"), "", "in actors or shards that died")]
          if _has(records, M.FRAGMENTS_LOST) else []),
        ("learner iteration, median of 2nd half" + (f" (iterations {_f(_num(half[0].get(M.ITERATION)), '.0f')}-"
                                                    f"{_f(_num(half[-1].get(M.ITERATION)), '.0f')})" if half else ""),),
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
            *([] if records else ["(no metric records)"])]
    rule = "=" * max(len(s) for s in lines + head)
    return "\n".join([*head, rule, *lines, rule])


# ---------------------------------------------------------------------- plot
def _interp(x, xp, fp):
    """np.interp, but extrapolated linearly past both ends (a secondary axis needs an invertible map)."""
    x = np.asarray(x, dtype=float)
    y = np.interp(x, xp, fp)
    lo, hi = (fp[1] - fp[0]) / (xp[1] - xp[0]), (fp[-1] - fp[-2]) / (xp[-1] - xp[-2])
    y = np.where(x < xp[0], fp[0] + (x - xp[0]) * lo, y)
    return np.where(x > xp[-1], fp[-1] + (x - xp[-1]) * hi, y)


def plot_run(records: list[dict], png_path, title: str | None = None, *,
             target_return: float | None = None, window: int | None = None) -> Path:
    """One PNG, two panels: return vs env steps (with training wall-clock time on a second
    x axis), and the learner iteration time breakdown (stacked bars; runs over 200 iterations
    are averaged into blocks) with the host-bound fraction.

    Drawn on a bare Agg canvas: pyplot is never imported, so no window can open and no
    global backend is changed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    window = _window(records, window)
    fig = Figure(figsize=(15, 5.6), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax_r, ax_t = fig.subplots(1, 2, width_ratios=[1, 1.15])
    fig.suptitle(title or "Training run", fontsize=14, fontweight="bold")
    grey = dict(ha="center", va="center", color="0.4")

    # ---- left: return vs env steps
    steps, ret = _series(records, M.ENV_STEPS), _series(records, M.EPISODE_RETURN_MEAN)
    tim = _series(records, M.TRAIN_TIME_S)  # continues across a resume, unlike time_s
    # Points whose window is not yet full (fewer than `window` episodes so far) are drawn faint.
    full = [not window or math.isnan(w) or w >= window for w in _series(records, M.EPISODES_IN_WINDOW)]
    first_full = full.index(True) if True in full else len(full)
    marker = "o" if len(records) <= 40 else None
    if first_full > 0 and _finite(ret[:first_full]):
        ax_r.plot(steps[:first_full + 1], ret[:first_full + 1], color="tab:blue", alpha=0.35, lw=1.4, ls=":",
                  marker=marker, ms=3, label=f"mean return, fewer than {window} episodes so far")
    ax_r.plot(steps[first_full:], ret[first_full:], color="tab:blue", lw=1.8, marker=marker, ms=3,
              label=f"mean return, last {window or '?'} episodes")
    if target_return is not None and math.isfinite(target_return):
        ax_r.axhline(target_return, color="tab:green", ls="--", lw=1.2, label=f"target {target_return:g}")
    best, best_rec = _best_return(records, window)
    if best_rec is not None:
        ax_r.plot([_num(best_rec.get(M.ENV_STEPS))], [best], marker="*", ms=13, color="tab:orange", ls="none",
                  label=f"best {best:.1f} (iteration {best_rec.get('iteration')})")
    ax_r.set(xlabel="env steps", ylabel="episode return")
    ax_r.set_title("Return vs env steps", loc="left")
    ax_r.xaxis.set_major_formatter(FuncFormatter(si))
    ax_r.grid(alpha=0.3)
    if not records or not _finite(ret):
        ax_r.text(0.5, 0.5, "no finished episodes" if records else "no records", transform=ax_r.transAxes, **grey)
        ax_r.set_yticks([])
        if not records:
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

    # ---- right: learner iteration breakdown
    it = [float(k + 1) if math.isnan(i) else i for k, i in enumerate(_series(records, M.ITERATION))]
    wait, upd = ([x * 1e3 for x in _series(records, key)] for key in (M.LEARNER_WAIT_S, M.LEARNER_UPDATE_S))
    oth = [_other_s(r) * 1e3 for r in records]
    hb = [x * 100 for x in _series(records, M.HOST_BOUND_FRACTION)]
    block = max(1, math.ceil(len(records) / 200))  # keep it readable on long runs
    if block > 1:  # means of consecutive blocks (NaNs ignored; an all-NaN block stays NaN)
        it, wait, upd, oth, hb = ([_mean(v[i:i + block]) for i in range(0, len(v), block)]
                                  for v in (it, wait, upd, oth, hb))
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
    if records:
        ax_t.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=9, ncol=4,
                    frameon=False)
    else:
        ax_hb.set_yticks([])
    fig.savefig(png_path, format="png")
    return png_path


# ---------------------------------------------------------------------- run dir
def _read_config(run_dir: Path) -> dict:
    try:
        import yaml

        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    except Exception:  # no file, unreadable, not YAML, or no yaml module
        return {}
    return cfg if isinstance(cfg, dict) else {}


def write_report(run_dir, result_fields: dict | None = None, *, window: int | None = None,
                 target_return: float | None = None, plot: bool = True, title: str | None = None):
    """Summary of RUN_DIR/metrics.jsonl to RUN_DIR/summary.txt and the plot to RUN_DIR/report.png.

    Returns ``(table, png_path_or_None)``. A plot that cannot be drawn (matplotlib missing,
    anything else) does not fail the call: it warns and returns None for the path.
    """
    run_dir = Path(run_dir)
    records = load_records(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    cfg = _read_config(run_dir)
    cfg_run = cfg.get("run") or {}
    window = window or cfg_run.get("target_window")
    if target_return is None:
        target_return = cfg_run.get("target_return")
    table = summary_table(records, {"run_dir": str(run_dir), **(result_fields or {})}, window=window)
    (run_dir / "summary.txt").write_text(table + "\n")
    png = None
    if plot:
        if title is None:
            env_id = (cfg.get("env") or {}).get("id")
            title = f"{env_id}: {run_dir.name}" if env_id else run_dir.name
        try:
            png = plot_run(records, run_dir / "report.png", title=title, target_return=target_return, window=window)
        except ImportError as e:
            warnings.warn(f"no report.png: {e} (pip install matplotlib)", stacklevel=2)
        except Exception as e:  # a finished run must not fail on its plot
            warnings.warn(f"no report.png: {type(e).__name__}: {e}", stacklevel=2)
    return table, png


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.report",
                                description="Summarise a run: a table on stdout, RUN_DIR/report.png, RUN_DIR/summary.txt.")
    p.add_argument("run_dir", help="run directory (holding metrics.jsonl), or the metrics.jsonl file itself")
    p.add_argument("--no-plot", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    if run_dir.is_file():
        run_dir = run_dir.parent
    if not (run_dir / "metrics.jsonl").is_file():
        print(f"report: no metrics.jsonl in {run_dir}", file=sys.stderr)
        return 2
    table, png = write_report(run_dir, plot=not args.no_plot)
    print(table)
    print(f"\nsummary written: {run_dir / 'summary.txt'}")
    if png is not None:
        print(f"plot written:    {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
