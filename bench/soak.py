"""Soak bench: the default job for a given time, each process's memory and the run directory's size over time.

Trains ``configs/cartpole.yaml`` (its own layout: one rollout actor, one shard, one learner) with no stop on the
target for ``--minutes``; every ``--every`` seconds it samples the resident memory (RSS, from /proc) of each of the
run's processes by role (the driver, the supply board, the learner(s), the rollout actor(s), the replay shard(s),
the control actor, Ray's own processes) and the size of the run directory (``metrics.jsonl``, the TensorBoard
events, checkpoints). At the end, per role, the least-squares slope after the warm-up (``--warmup-minutes``) in MB
an hour, with its standard error, and in bytes an iteration (over the run's mean rate: runs at different speeds
compare): a leak is a slope that stays above zero as the run gets longer, noise one whose standard error covers it.
``--chaos-every S`` kills (SIGKILL) a random rollout actor, shard, learner or the supply board (``--chaos-targets``)
every S seconds, so the slopes also cover the replacements (a role's RSS is the sum over its processes of the
moment, with no sample while one of them is dead and not yet replaced; a replaced process starts afresh, so leave a
role out of the targets to read its slope over one life).

Pass rule: after the warm-up, the supply board's and the learner's slopes are at most ``--max-slope-mb-h`` (or
within two standard errors of zero). The run directory's slope is printed beside them: it levels off once
``metrics.jsonl`` and the TensorBoard events reach their bound (``cluster/metrics.py``). A run with fewer than four
samples after the warm-up says so and judges nothing.

    .venv/bin/python bench/soak.py [--minutes 120] [--every 30] [--warmup-minutes 5] [--chaos-every 0]
                                   [--chaos-targets rollout shard learner board]
"""

from __future__ import annotations

import math
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import ROOT, actor_pids, cli, parser, ray_core_pids  # noqa: E402

MB = 1024 * 1024
#: The roles whose slopes the pass rule judges: the processes that live as long as the run does and see every
#: iteration (the others are listed for the record).
JUDGED = ("board", "learner")
ROLES = ("driver", "board", "learner", "rollout", "shard", "control", "ray_core")
CHAOS_TARGETS = ("rollout", "shard", "learner", "board")


def rss_mb(pid: int) -> float:
    """VmRSS of ``pid`` in MB; 0 once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024 / MB
    except OSError:
        pass
    return 0.0


def role_rss_mb(pids) -> float | None:
    """The summed RSS of a role's processes; None while one of them is gone and not yet replaced (chaos): a dead
    process's 0 is no sample of the role's memory."""
    sizes = [rss_mb(pid) for pid in pids]
    return None if not sizes or 0.0 in sizes else sum(sizes)


def dir_mb(path: Path) -> float:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass  # a checkpoint pruned or a temporary renamed under the walk
    return total / MB


def slope(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope of (t_s, value) in value per hour, and its standard error (NaN with under 3 points)."""
    n = len(points)
    if n < 2:
        return math.nan, math.nan
    ts = [t / 3600 for t, _ in points]
    vs = [v for _, v in points]
    mt, mv = sum(ts) / n, sum(vs) / n
    sxx = sum((t - mt) ** 2 for t in ts)
    if sxx == 0:
        return math.nan, math.nan
    b = sum((t - mt) * (v - mv) for t, v in zip(ts, vs)) / sxx
    if n < 3:
        return b, math.nan
    resid = sum((v - (mv + b * (t - mt))) ** 2 for t, v in zip(ts, vs))
    return b, math.sqrt(resid / (n - 2) / sxx)


class ProcessTable:
    """The run's processes by role, from the driver's actor handles (a replaced actor's new handle is looked up
    once; ``__ray_call__`` answers from the actor's own process)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._pids: dict = {}  # actor id -> pid

    def _pid(self, handle) -> int | None:
        if not hasattr(handle, "_actor_id"):  # an in-process run's actor: a thread of the driver, in its RSS
            return None
        key = handle._actor_id.hex()
        if key not in self._pids:
            try:
                (self._pids[key],) = actor_pids([handle], timeout=10)
            except Exception:  # noqa: BLE001 - being replaced (chaos) or busy past the wait: next sample
                return None
        return self._pids[key]

    def by_role(self) -> dict[str, list[int]]:
        graph = self.trainer.graph
        handles = {"board": [graph.board], "learner": list(graph.learners), "rollout": list(graph.rollouts),
                   "shard": list(graph.shards), "control": [graph.control] if graph.control is not None else []}
        out = {"driver": [os.getpid()], "ray_core": ray_core_pids()}
        for role, hs in handles.items():
            out[role] = [pid for pid in (self._pid(h) for h in hs if h is not None) if pid is not None]
        return out


def make_parser():
    p = parser(__doc__)
    p.add_argument("--minutes", type=float, default=120.0)
    p.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    p.add_argument("--warmup-minutes", type=float, default=5.0, help="samples before this are not in the slopes")
    p.add_argument("--chaos-every", type=float, default=0.0,
                   help="seconds between SIGKILLs of a random rollout actor, shard, learner or the board (0: none)")
    p.add_argument("--seed", type=int, default=0, help="chaos: which process each kill picks")
    p.add_argument("--chaos-targets", nargs="+", choices=CHAOS_TARGETS, default=list(CHAOS_TARGETS),
                   help="chaos: the roles it kills (leave the board out to read its slope over one life)")
    p.add_argument("--max-slope-mb-h", type=float, default=2.0,
                   help="pass rule: the board's and learner's slope after the warm-up, at most (MB an hour)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="config override, KEY.PATH=VALUE")
    return p


def run(args):
    import ray

    from bench._common import signal_actor
    from bench._train import long_run
    from cluster import config as config_mod

    base = config_mod.load(str(ROOT / "configs/cartpole.yaml"))
    # long_run's run (no stop on the target, a time budget) with the default job's own layout.
    layout = [f"rollout.num_actors={base.rollout.num_actors}", f"rollout.envs_per_actor={base.rollout.envs_per_actor}",
              f"replay.num_shards={base.replay.num_shards}", f"learner.num_learners={base.learner.num_learners}"]
    samples: list[dict] = []
    kills: list[tuple[float, str]] = []
    rng = random.Random(args.seed)

    def obj_store_mb() -> float:
        return (ray.cluster_resources().get("object_store_memory", 0)
                - ray.available_resources().get("object_store_memory", 0)) / MB

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "soak"

        def side(trainer, stop):
            table = ProcessTable(trainer)
            t0 = time.monotonic()
            next_sample, next_kill = t0, t0 + args.chaos_every if args.chaos_every > 0 else math.inf
            while not stop.is_set():
                now = time.monotonic()
                if now >= next_kill:
                    next_kill += args.chaos_every
                    what = rng.choice(args.chaos_targets)
                    graph = trainer.graph
                    handle = graph.board if what == "board" else rng.choice(
                        {"rollout": graph.rollouts, "shard": graph.shards, "learner": graph.learners}[what])
                    try:
                        signal_actor(handle, signal.SIGKILL, [], timeout=10)
                        kills.append((now - t0, what))
                        print(f"\nsoak: t={now - t0:6.0f} s | chaos: killed the {what}", file=sys.stderr, flush=True)
                    except Exception as e:  # noqa: BLE001 - being replaced right now: skip this round
                        print(f"\nsoak: chaos skipped a round ({type(e).__name__})", file=sys.stderr, flush=True)
                if now >= next_sample:
                    next_sample += args.every
                    pids = table.by_role()
                    s = {"t_s": now - t0, **{role: role_rss_mb(pids.get(role, ())) for role in ROLES},
                         "run_dir_mb": dir_mb(run_dir), "object_store_mb": obj_store_mb()}
                    samples.append(s)
                    print(f"\nsoak: t={s['t_s']:6.0f} s | RSS MB: "
                          + " ".join(f"{r} {'-' if s[r] is None else format(s[r], '.1f')}" for r in ROLES)
                          + f" | run dir {s['run_dir_mb']:.1f} MB | object store {s['object_store_mb']:.1f} MB",
                          file=sys.stderr, flush=True)
                stop.wait(max(0.05, min(next_sample, next_kill) - time.monotonic()))

        _, result = long_run(args.minutes, run_dir, side, layout + list(args.overrides))
    print(f"soak: {len(samples)} samples over {args.minutes:g} min, {len(kills)} kills; run ended "
          f"'{result.reason}' after {result.env_steps:,} env steps and {result.iterations:,} iterations")
    warm = [s for s in samples if s["t_s"] >= args.warmup_minutes * 60]
    columns = [*ROLES, "run_dir_mb", "object_store_mb"]
    points = {c: [(s["t_s"], s[c]) for s in warm if s[c] is not None] for c in columns}
    slopes = {c: slope(points[c]) for c in columns}
    # Bytes an iteration: the slope over the run's mean rate, so runs at different speeds (a loaded machine) compare.
    per_h = result.iterations / (args.minutes / 60) if result.iterations else math.nan
    print(f"\n{'after the warm-up':<16} {'first MB':>9} {'last MB':>9} {'slope MB/h':>11} {'+-':>7} {'B/iteration':>12}")
    for c in columns:
        first, last = (points[c][0][1], points[c][-1][1]) if points[c] else (math.nan, math.nan)
        b, se = slopes[c]
        print(f"{c:<16} {first:>9.1f} {last:>9.1f} {b:>+11.2f} {se:>7.2f} {b * MB / per_h:>+12.0f}")
    figures = {"samples": samples, "kills": kills, "slopes_mb_per_h": {c: b for c, (b, _) in slopes.items()},
               "slope_stderr_mb_per_h": {c: se for c, (_, se) in slopes.items()},
               "iterations": result.iterations, "env_steps": result.env_steps}
    if len(warm) < 4:
        print("soak: too few samples after the warm-up to judge the slopes")
        return figures, None

    def flat(c: str) -> bool:
        b, se = slopes[c]
        return b <= args.max_slope_mb_h or (math.isfinite(se) and b <= 2 * se)

    ok = all(flat(c) for c in JUDGED)
    print("soak: " + ("PASS" if ok else "FAIL") + f" (board and learner slopes at most {args.max_slope_mb_h:g} MB/h "
          "or within two standard errors of zero)")
    return figures, ok


if __name__ == "__main__":
    cli(make_parser, run)
