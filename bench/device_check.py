"""Device check's measurement sections: one accelerator host measured in under 10 minutes, into one JSON results file.

``bench/device_check.sh --sections`` runs them; the wrapper's default is the host's checklist table
(bench/_device_checklist.py).

Its sections, what each measures and the targets the next accelerator run is judged by are described in
docs/cluster.md ("Checking an accelerator host"). Each section calls the benches' own functions: the update
bench/update_cost.py's learner and timed update, the feed bench/feed.py's ``compare``, training bench/_train.py's
``train`` (as bench/cartpole.py and bench/multirate.py train), the fixed-time runs bench/autoscale.py's ``summary``,
rollout scaling, the end-to-end run's rollouts alone and local against remote inference bench/rollout_scaling.py's
``run``. Every section has its own time limit: one that fails or runs out of time records why,
with what it had measured so far, and the rest still run. ``update`` runs in a process of its own; the others share
one process and one embedded Ray (its start-up paid once, sized for the largest layout among them), each under its
own alarm. Every process runs in a session of its own and is killed, with whatever it started, at its limit.

``--quick`` runs tiny sizes (one to two minutes on 2 quiet CPU cores; what tests/test_device_check.py runs) under
limits wide enough for a loaded machine: the training runs are a few iterations (``"targets_expected": false``).
``--time-budget`` scales every section's limit to a whole-run budget other than the default. Exit status 0 when
every section produced its numbers, 1 when any failed, timed out or was skipped, 2 when the device cannot be used.

    bench/device_check.sh --sections [--device auto|cuda|npu|cpu] [--quick] [--time-budget SECONDS]
                          [--out device_check_results.json]
    .venv/bin/python bench/device_check.py [same options] [--only update feed training ...]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench._common import ROOT, options, write_json  # noqa: E402  (numpy only: the orchestrator stays light)

DEVICES = ("auto", "cuda", "npu", "cpu")
MODES = ("full", "quick")
#: Whole-run budgets (seconds): the .sh wrapper's hard limit is 560 s, so one call with its kill grace ends inside
#: the 10 minutes one call on a lent accelerator host may take. Quick mode's limits only stop a section that hangs:
#: a loaded 2-core machine takes 2-3x a quiet one's time for every part, and a limit it can miss would fail the CPU
#: test at random.
TOTAL_BUDGET_S = {"full": 530.0, "quick": 480.0}
KILL_GRACE_S = {"full": 10.0, "quick": 4.0}
#: fp32: the default path (the fused step for state-only models, learner.graphs: auto); no_graphs: the same with
#: learner.graphs off (the graphs' gain is no_graphs / fp32); autograd: learner.fused_update off, the reference.
VARIANTS = ("fp32", "no_graphs", "autograd", "bf16", "fp16", "compile")
#: What the next accelerator run is judged by, each against the NVIDIA H200 host's figure (docs/results.md, "the
#: first run on an accelerator"): ``path`` locates this run's figure, ``most`` / ``least`` bound it, in ``unit``.
TARGETS = {
    "update_ms_with_graphs": dict(
        path=("update", "batches", "cartpole", "results", "fp32", "ms"), most=38.7 / 5, baseline=38.7, unit="ms",
        what="CartPole update (1024 x 8 epochs / 256), fp32 with learner.graphs: auto, ms: at most a fifth of the "
             "38.7 ms the fused step took there"),
    "multirate_host_bound_auto": dict(
        path=("rollout_breakdown", "runs", "auto", "host_bound_fraction"), most=0.10, baseline=0.543, unit="fraction",
        what="configs/multirate.yaml's host-bound fraction under rollout.num_actors: auto (median of the second "
             "half): at most 10%, from 54.3% at its fixed count there"),
    "end_to_end_env_steps_per_s": dict(
        path=("end_to_end", "env_steps_per_s_second_half"), least=10 * 18_700.0, baseline=18_700.0, unit="env steps/s",
        what="end-to-end CartPole env steps/s with a rollout actor per core (second half): at least 10x the 18.7k "
             "trained there, on the way to 1M"),
}


@dataclass(frozen=True)
class Section:
    key: str  # where it goes in results["sections"] (training.<name>: one sub-record of "training")
    title: str
    cap_s: dict  # per mode: the most this section may take
    min_s: dict  # per mode: less than this left and it is skipped (reserved for it while earlier sections run)
    ray: bool  # shares one process and one embedded Ray with the other such sections (else a process of its own)


def _section(key: str, title: str, cap: tuple, least: tuple, ray: bool = True) -> Section:
    return Section(key, title, dict(zip(MODES, cap)), dict(zip(MODES, least)), ray)


#: In running order; (full, quick) seconds. Each mode's caps and the shared Ray's start-up fit its whole budget,
#: so no section is squeezed by slow ones before it: full mode's are the H200 host's times (docs/results.md)
#: with a margin, the fixed-time sections sized by their runs. The sections the next accelerator run is for (the
#: breakdown, end to end) come before those measured there already: a short budget leaves out what is known.
SECTIONS = (
    _section("update", "learner update on the device", (75, 95), (30, 8), ray=False),
    _section("feed", "host-bound fraction: inline vs pipelined feed", (30, 45), (15, 4)),
    _section("training.cartpole", "CartPole-v1 to 475", (45, 45), (25, 5)),
    _section("training.multirate", "multi-rate sensor env to success 0.9", (75, 45), (40, 7)),
    _section("rollout_breakdown", "multi-rate config: rollout stages and host-bound, fixed actors vs auto",
             (130, 68), (60, 12)),
    _section("end_to_end", "CartPole trained with a rollout actor per core, against the rollouts alone",
             (55, 55), (30, 8)),
    _section("rollout_scaling", "rollout env steps/s per actor count", (45, 27), (25, 7)),
    _section("inference", "multi-rate config's rollouts: local against remote inference", (45, 40), (25, 7)),
)
#: Seconds the shared process of the Ray sections has for its imports and Ray's start-up.
RAY_START_S = {"full": 25.0, "quick": 30.0}


# ============================================================================================== small helpers
def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


class Partial(dict):
    """A section's results, written to its file after every measurement, so a section killed at its time limit
    still hands back what it had. ``sub(key)``: a section's own record inside a file shared by several."""

    def __init__(self, path: Path | None, root: Partial | None = None):
        super().__init__()
        self.path, self.root = path, root

    def sub(self, key: str) -> Partial:
        child = self[key] = Partial(None, self.root or self)
        return child

    def flush(self) -> None:
        if self.root is not None:
            self.root.flush()
        else:
            write_json(self.path, dict(self))

    def run_dir(self, name: str) -> Path:
        """A run's directory next to the partial results: in the orchestrator's temporary directory, removed with
        it even when this process is killed."""
        return (self.root or self).path.parent / name


#: Set in a section process when the orchestrator stops it (SIGTERM): a trainer takes the KeyboardInterrupt as
#: "interrupted" and returns normally, so the process checks this before calling a section done or starting another.
STOPPING = threading.Event()


def _on_term(signum, frame):
    """A section process's SIGTERM (the orchestrator's time limit): unwind, so Ray and trainers shut down."""
    STOPPING.set()
    raise KeyboardInterrupt


class SectionTimeout(BaseException):
    """A section's alarm went off (BaseException: no ``except Exception`` on the way swallows it)."""


@contextlib.contextmanager
def alarm(seconds: float):
    """Raise SectionTimeout in the main thread after ``seconds`` (Ray's waits wake up for it). Yields an event set
    when it fired: raised inside a C call, the timeout may surface as another error (a SystemError)."""
    fired = threading.Event()

    def fire(signum, frame):
        fired.set()
        raise SectionTimeout

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(0.1, seconds))
    try:
        yield fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Budget:
    def __init__(self, seconds: float):
        self.t0, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)


# ============================================================================================== section: update
def _update_cases(quick: bool) -> list[dict]:
    """The update section's batches: the model each config's run builds with that config's learner settings and
    update shape (bench/update_cost.py's), and a plain 64x64x3 image model."""
    from cluster import config as config_mod
    from cluster.graph import describe_env, learner_settings
    from learner.learner import LearnerSettings
    from learner.ppo import LossCoefs
    from learner.spec import ModalityInput, PolicySpec

    cases = []
    for name in ("cartpole", "multirate"):
        cfg = config_mod.load(str(ROOT / "configs" / f"{name}.yaml"))
        cases.append(dict(name=name, spec=describe_env(cfg), samples=cfg.learner.batch_size,
                          settings=learner_settings(cfg), source=f"configs/{name}.yaml",
                          variants=VARIANTS if (name == "cartpole" or not quick) else ("fp32",)))
    if not quick:
        spec = PolicySpec((ModalityInput("image", "image", (64, 64, 3), "uint8"),), "discrete", 6,
                          hidden_sizes=(256,))
        settings = LearnerSettings(lr=2.5e-4, adam_eps=1e-5, anneal_lr=False, total_updates=10**6, update_epochs=8,
                                   minibatch_size=512, max_grad_norm=0.5, coefs=LossCoefs())
        cases.append(dict(name="image64", spec=spec, samples=1024, settings=settings,
                          source="64x64x3 uint8 image, 6 actions, CNN encoder + 256 trunk", variants=VARIANTS))
    return cases


def _measure_update(case: dict, batch: dict, dev, variant: str, quick: bool, max_s: float,
                    budget: Budget) -> dict:
    """ms per ``Learner.update`` on ``batch``: one untimed first update (compilation, allocation), warm-up, then
    timed updates (the device synchronised before each clock read) for about ``max_s``: at least 3 (quick) or 5,
    fewer only where the section's budget would not hold them (``"truncated"``)."""
    from bench.update_cost import make_learner, timed_update

    precision = "fp32" if variant in ("compile", "autograd", "no_graphs") else variant
    # No lr schedule (every timed update the same), seed 0; the variant over the case's settings.
    learner = make_learner(case["spec"], case["settings"], dev.torch_device(), 0, anneal_lr=False,
                           total_updates=10**6, precision=precision, compile=variant == "compile",
                           fused_update=variant != "autograd", graphs="off" if variant == "no_graphs" else "auto")
    mod = dev.module
    with contextlib.suppress(Exception):
        mod.reset_peak_memory_stats()
    first_s, _ = timed_update(learner, batch, dev.synchronize)  # compiles, allocates, warms the autotuners

    def fits(seconds: float) -> bool:  # the section keeps a few seconds for the rest
        return budget.left() - seconds > 3.0

    for _ in range(0 if quick else 2):  # more warm-up (fp16's scaler, allocator) before the clock
        if not fits(first_s):
            break
        learner.update(batch)
    min_reps, max_reps = (3, 5) if quick else (5, 50)
    syncs0, times, stats = learner.host_syncs, [], {}
    window_end = time.perf_counter() + max_s
    while len(times) < max_reps and not (len(times) >= min_reps and time.perf_counter() >= window_end):
        if times and not fits(max(times)):
            break
        seconds, stats = timed_update(learner, batch, dev.synchronize)
        times.append(seconds)
    ms = 1e3 * float(np.median(times))
    out = {"precision": precision, "compile_requested": variant == "compile", "ms": ms,
           "ms_min": 1e3 * min(times), "ms_max": 1e3 * max(times), "reps": len(times),
           "truncated": len(times) < min_reps, "first_update_ms": 1e3 * first_s,
           "ms_per_minibatch_step": ms / max(1, stats.get("minibatch_steps", 1)),
           "samples_per_s": case["samples"] / (ms / 1e3),
           "host_syncs_per_update": (learner.host_syncs - syncs0) / len(times),
           "stats_finite": all(math.isfinite(v) for v in stats.values() if isinstance(v, (int, float))),
           "compile_note": learner.compile_note, "compiled": bool(learner.compiled),
           "update_path": learner.update_path}
    if learner.scaler is not None:
        out["fp16_loss_scale"] = float(learner.scaler.get_scale())
    with contextlib.suppress(Exception):
        out["peak_memory_mb"] = mod.max_memory_allocated() / 2**20
    return out


def _device_name(dev) -> dict:
    import torch

    if dev.kind in ("cuda", "npu"):
        try:
            mod = getattr(torch, dev.kind)
            return {"device_name": mod.get_device_name(0), "device_count": mod.device_count()}
        except Exception as e:
            return {"device_name": f"{dev.kind} ({error_text(e)})"}
    return {"device_name": platform.processor() or platform.machine()}


def section_update(args, out: Partial, budget: Budget) -> None:
    import torch

    from bench.update_cost import synthetic_batch
    from learner import device as devices

    dev = devices.resolve(args.device)
    torch.set_num_threads(1)  # learner.torch_threads' default: what a learner actor runs with
    out.update(device=dev.kind, torch=torch.__version__, torch_threads=1, batches={}, **_device_name(dev))
    out.flush()
    compile_allowance = 8.0 if dev.kind == "cpu" else 30.0  # a first torch.compile of these small models
    cases, batches, last_ms = _update_cases(args.quick), {}, {}
    for case in cases:
        out["batches"][case["name"]] = {
            "source": case["source"], "samples": case["samples"], "update_epochs": case["settings"].update_epochs,
            "minibatch_size": case["settings"].minibatch_size,
            "modalities": {m.name: {"kind": m.kind, "shape": list(m.shape), "dtype": m.dtype}
                           for m in case["spec"].modalities},
            "action_dim": case["spec"].action_dim, "hidden_sizes": list(case["spec"].hidden_sizes), "results": {}}
    # CartPole's variants first (the figures every host reports), then the other batches' eager precisions, then
    # their compiles (the slow part): what a short budget leaves out is the least informative.
    order = [(cases[0], v) for v in cases[0]["variants"]]
    order += [(c, v) for c in cases[1:] for v in c["variants"] if v != "compile"]
    order += [(c, "compile") for c in cases[1:] if "compile" in c["variants"]]
    for case, variant in order:
        rec, name = out["batches"][case["name"]], case["name"]
        if name not in batches:
            try:
                batches[name] = {k: v.to(dev.torch_device()) for k, v in
                                 synthetic_batch(case["spec"], case["samples"]).items()}
            except Exception as e:
                batches[name], rec["error"] = None, error_text(e)
        if batches[name] is None:
            continue
        # Skip what would not fit: (first update + warm-up + reps) at the last rate and the timed window, plus a
        # compile. The CartPole batch always runs: it is the one every host reports.
        max_s = 0.5 if args.quick else min(2.0, max(0.5, budget.left() / 30))
        need = 1.5 * ((1 + (3 if args.quick else 7)) * 1e-3 * last_ms.get(name, 500.0) + max_s)
        need += compile_allowance if variant == "compile" else 0.0
        fused = str(rec["results"].get("fp32", {}).get("update_path", "fused")).startswith("fused")
        if budget.left() < need and name != "cartpole":
            rec["results"][variant] = {"skipped": f"section budget: {budget.left():.0f} s left, ~{need:.0f} s needed"}
        elif variant == "no_graphs" and not fused:  # graphs are the fused step's: the same update as fp32 here
            rec["results"][variant] = {"skipped": "not the fused step: learner.graphs does not apply"}
        else:
            try:
                r = rec["results"][variant] = _measure_update(case, batches[name], dev, variant, args.quick, max_s,
                                                              budget)
                last_ms[name] = max(last_ms.get(name, 0.0), r["ms"])
            except Exception as e:  # e.g. a precision the device does not support
                rec["results"][variant] = {"error": error_text(e), "supported": False,
                                           "traceback": traceback.format_exc(limit=4)[-1500:]}
            fp32 = rec["results"].get("fp32", {}).get("ms")
            if fp32:
                rec["speedup_vs_fp32"] = {v: fp32 / r["ms"] for v, r in rec["results"].items() if r.get("ms")}
                eager = rec["results"].get("no_graphs", {}).get("ms")
                if eager:  # > 1: graphs made the update faster (on CPU: what the static buffers' copies cost)
                    rec["graphs_speedup"] = eager / fp32
        out.flush()


# ============================================================================================== Ray sections
def section_feed(args, out: Partial, budget: Budget) -> None:
    """bench/feed.py's ``compare`` on the shared Ray (its producers, board and shard take no CPU resource)."""
    import torch

    from bench._supply import KINDS
    from bench.feed import compare
    from learner import device as devices

    torch.set_num_threads(1)  # as bench/feed.py
    dev = devices.resolve(args.device)
    iterations, warmup, lag = (4, 1, 3) if args.quick else (20, 2, 3)
    kinds = ["vector"] if args.quick else ["vector", "image"]
    out.update(device=dev.kind, iterations=iterations, warmup=warmup, max_policy_lag=lag,
               update="2 epochs of 256-sample minibatches (bench/feed.py's learner)", kinds={})
    for name in kinds:
        t_kind, kind = time.perf_counter(), KINDS[name]
        rec = out["kinds"][name] = {"fragment": f"{kind['T']} steps x {kind['N']} envs x {kind['obs_shape']} "
                                                f"{np.dtype(kind['obs_dtype']).name}",
                                    "fragments_per_update": kind["fragments"]}
        compare(name, dev, iterations, warmup, lag, into=rec)  # each mode's figures and their ratios into rec
        rec["seconds"] = time.perf_counter() - t_kind
        out.flush()
        if name != kinds[-1] and budget.left() < 2.0 * rec["seconds"]:
            out["kinds"][kinds[-1]] = {"skipped": f"section budget: {budget.left():.0f} s left"}
            break


TRAIN = {  # config, the record key the target is on, quick mode's env steps (a few updates)
    "cartpole": dict(config="configs/cartpole.yaml", key="episode_return_mean", quick_steps=3 * 1024),
    "multirate": dict(config="configs/multirate.yaml", key="episode_success_rate", quick_steps=2 * 1024),
}


def training_overrides(name: str, device: str, quick: bool, time_budget_s: float) -> list[str]:
    """What bench/cartpole.py passes (no exit on a miss, rare progress lines) plus the device, the cap and JSONL
    only; quick mode: a few updates (the config's total_env_steps otherwise, so its lr schedule stays)."""
    return [f"learner.device={device}", "run.require_target=false", "run.progress_interval_s=30",
            "run.loggers=[jsonl]", "run.checkpoint_interval_s=null", f"run.time_budget_s={time_budget_s:.0f}",
            *([f"run.total_env_steps={TRAIN[name]['quick_steps']}"] if quick else [])]


def section_training(args, out: Partial, budget: Budget, name: str) -> None:
    """One config trained on the shared Ray, as bench/cartpole.py trains a seed (bench/_train.py's ``train``)."""
    from bench._train import at_target, steady_state, target_key, train
    from cluster import config as config_mod

    spec = TRAIN[name]
    # The cap on training itself (run.time_budget_s); the graph build and shutdown come on top of it.
    time_budget = max(3.0, budget.left() - (5.0 if args.quick else 20.0))
    overrides = training_overrides(name, args.device, args.quick, time_budget)
    cfg = config_mod.load(str(ROOT / spec["config"]), overrides)
    out.update(config=spec["config"], overrides=overrides, device=args.device, seed=cfg.run.seed,
               target={"metric": spec["key"], "value": target_key(cfg)[1], "window_episodes": cfg.run.target_window},
               time_budget_s=round(time_budget), total_env_steps=cfg.run.total_env_steps,
               target_expected=not args.quick)
    out.flush()
    result, records, build_s = train(cfg, out.run_dir(f"run_{name}"))
    at = at_target(cfg, records, spec["key"])
    reached, last = at["reached"], records[-1] if records else {}
    out.update(reached=reached, stop_reason=result.reason, build_s=build_s, env_steps=result.env_steps,
               # from the graph build (Ray's start-up excluded)
               seconds_to_target=at["seconds"] if reached else None,
               train_seconds_to_target=at["train_seconds"] if reached else None,
               env_steps_to_target=at["env_steps"] if reached else None,
               iterations=result.iterations, run_wall_s=result.wall_s, final_value=last.get(spec["key"]),
               env_steps_per_s=at["env_steps_per_s"],
               **{k: steady_state(records, k) if records else None
                  for k in ("learner_samples_per_s", "host_bound_fraction", "learner_update_s")})
    if last.get("compile") is not None:  # the learner's compile note, where the records carry it
        out["compile"] = last["compile"]


def second_half(records: list[dict]) -> dict:
    """Where the rollout actors' time went over the second half of a run's records, as the end-of-run report sums
    it (cluster/report.py): each stage's seconds summed over those records over the actors' wall seconds summed
    the same way (an iteration weighs by its length; one no actor reported in weighs nothing), each stage's
    microseconds an env step, the learners' host-bound median and the report's verdict (cluster/host_time.py)."""
    from bench._train import steady_state
    from cluster import host_time
    from pipeline import metric_keys as M

    half_from = len(records) // 2
    half = records[half_from:]
    host_bound = steady_state(records, M.HOST_BOUND_FRACTION) if records else math.nan
    wall = sum(float(r.get(M.ROLLOUT_WALL_S) or 0.0) for r in half)
    seconds = {stage: sum(float(r.get(key) or 0.0) for r in half) for stage, key, _ in M.ROLLOUT_STAGES}
    steps = (half[-1][M.ENV_STEPS] - (records[half_from - 1][M.ENV_STEPS] if half_from else 0)) if half else 0
    out = {"host_bound_fraction": host_bound, "records_in_second_half": len(half), "rollout_wall_s": wall,
           "rollout_share": None, "rollout_us_per_env_step": None, "largest_stage": None, "verdict": None}
    if wall > 0:
        shares = host_time.shares(seconds, wall)
        top = host_time.largest(shares)
        out.update(rollout_share={stage: round(v, host_time.SHARE_DECIMALS) for stage, v in shares.items()},
                   largest_stage=top[0] if top else None, verdict=host_time.verdict(host_bound, shares))
        if steps > 0:  # to a hundredth of a microsecond: a timed block itself costs about a microsecond
            out["rollout_us_per_env_step"] = {stage: round(1e6 * sec / steps, 2) for stage, sec in seconds.items()}
    return out


def run_figures(records: list[dict]) -> dict:
    """One fixed-time run's figures: bench/autoscale.py's ``summary`` (env steps/s over the run and its second
    half, actors at the end, the autoscaler's changes) with the learner's and the second half's breakdown."""
    from bench._train import steady_state
    from bench.autoscale import summary as autoscale_summary
    from pipeline import metric_keys as M

    out = autoscale_summary(records)
    out.pop("host_bound_second_half", None)  # second_half's host_bound_fraction: the same median
    out["learner_samples_per_s"] = steady_state(records, M.LEARNER_SAMPLES_PER_S) if records else None
    out["learner_update_s"] = steady_state(records, M.LEARNER_UPDATE_S) if records else None
    out["update_path"] = next((r[M.UPDATE_PATH] for r in reversed(records) if r.get(M.UPDATE_PATH)), None)
    return {**out, **second_half(records)}


#: The rollout_breakdown section's config and its two runs: the config's own actor count, then
#: rollout.num_actors: auto between 1 and autoscale_max(cores) (bench/autoscale.py's range).
BREAKDOWN = dict(config="configs/multirate.yaml", runs=("fixed", "auto"))
#: Fixed-time runs' training seconds in full mode: long enough that the autoscaler (a decision per
#: rollout.autoscale_window iterations, ~0.3 s each on the H200 host) has settled before the second half starts.
BREAKDOWN_RUN_S = 50.0
#: Seconds a fixed-time run needs beyond its training (the actor graph built and shut down: 5-9 s on the H200 host,
#: 25-30 s on a loaded 2-core machine): what each run keeps free for the others when the section splits its time.
RUN_OVERHEAD_S = {"full": 15.0, "quick": 5.0}
#: Quick mode's fixed-time runs: a few updates each (the time budget then only caps a slow machine).
QUICK_UPDATES = 3


def autoscale_max(cores: int) -> int:
    """rollout.max_actors of the auto run: bench/autoscale.py's cores minus two (the learner and the data plane keep
    a core each), and at least 2 so the count has somewhere to go on a small host."""
    return max(2, cores - 2)


def fixed_time_overrides(device: str, quick: bool, time_budget_s: float, batch_size: int) -> list[str]:
    """A run that trains for ``time_budget_s`` (quick: QUICK_UPDATES updates) whatever its return: no target to stop
    at, JSONL only, no checkpoints."""
    steps = QUICK_UPDATES * batch_size if quick else 10**9
    return [f"learner.device={device}", "run.require_target=false", "run.target_return=null",
            "run.target_success_rate=null", "run.progress_interval_s=30", "run.loggers=[jsonl]",
            "run.checkpoint_interval_s=null", f"run.time_budget_s={time_budget_s:.0f}", f"run.total_env_steps={steps}"]


def breakdown_overrides(run: str, device: str, quick: bool, time_budget_s: float, cores: int) -> list[str]:
    """The rollout_breakdown section's ``run`` ("fixed": the config's actor count; "auto") of BREAKDOWN's config."""
    from cluster import config as config_mod

    batch = config_mod.load(str(ROOT / BREAKDOWN["config"])).learner.batch_size
    auto = ["rollout.num_actors=auto", "rollout.min_actors=1", f"rollout.max_actors={autoscale_max(cores)}"]
    return fixed_time_overrides(device, quick, time_budget_s, batch) + (auto if run == "auto" else [])


def section_rollout_breakdown(args, out: Partial, budget: Budget) -> None:
    """BREAKDOWN's config trained for a fixed time at its own actor count, then under rollout.num_actors: auto, on
    the shared Ray (sized for the largest layout: the auto run's free CPUs are there)."""
    from bench._train import train
    from cluster import config as config_mod

    mode, cores, runs = "quick" if args.quick else "full", os.cpu_count() or 1, BREAKDOWN["runs"]
    out.update(config=BREAKDOWN["config"], device=args.device, cores=cores, runs={})
    for i, name in enumerate(runs):
        # An equal part of what the section has left after each run's overhead, at most BREAKDOWN_RUN_S.
        left = len(runs) - i
        seconds = max(3.0, min(BREAKDOWN_RUN_S, (budget.left() - RUN_OVERHEAD_S[mode] * left) / left))
        overrides = breakdown_overrides(name, args.device, args.quick, seconds, cores)
        cfg = config_mod.load(str(ROOT / BREAKDOWN["config"]), overrides)
        rec = out["runs"][name] = {
            "overrides": overrides, "time_budget_s": round(seconds),
            "actors": (f"auto {cfg.rollout.min_actors}-{cfg.rollout.max_actors}" if cfg.autoscale_rollouts
                       else cfg.rollout.num_actors),
            "envs_per_actor": cfg.rollout.envs_per_actor, "fragment_length": cfg.rollout.fragment_length,
            "batch_size": cfg.learner.batch_size}
        out.flush()
        result, records, build_s = train(cfg, out.run_dir(f"run_breakdown_{name}"))
        rec.update(stop_reason=result.reason, build_s=build_s, run_wall_s=result.wall_s, **run_figures(records))
        out.flush()


#: Rollout actors a replay shard serves in the end_to_end layout: 4 CartPole actors make ~200k env steps/s at the
#: rates the H200 host measured (~50k an actor), under one shard's ~300k samples/s on the ticketed path
#: (docs/results.md, bench/replay_throughput.py), so the shards are never what the run waits on.
ACTORS_PER_SHARD = 4
#: Full mode's end-to-end training seconds: past the actors' start-up and the first updates, with a second half of
#: steady iterations (an update of a 16-actor batch takes a fraction of a second on a device).
END_TO_END_RUN_S = 30.0
#: Seconds of the end_to_end section kept for the rollouts-alone measurement after the run (the actors' start-up,
#: the first fragment from each, the window); less than this left and it is skipped, with the reason.
ALONE_S = {"full": 12.0, "quick": 8.0}


def end_to_end_layout(cores: int) -> dict:
    """configs/cartpole.yaml's layout grown to ``cores`` rollout actors: a shard per ACTORS_PER_SHARD actors, the
    batch one fragment from each actor an update (so every actor holds a ticket at replay.max_policy_lag 1), and
    the config's minibatches per epoch (its update shape, with each minibatch grown with the batch)."""
    from cluster import config as config_mod

    cfg = config_mod.load(str(ROOT / TRAIN["cartpole"]["config"]))
    actors = max(1, cores)
    batch = actors * cfg.fragment_samples
    return dict(actors=actors, shards=math.ceil(actors / ACTORS_PER_SHARD), batch_size=batch,
                minibatch_size=batch // (cfg.learner.batch_size // cfg.learner.minibatch_size),
                envs_per_actor=cfg.rollout.envs_per_actor, fragment_length=cfg.rollout.fragment_length)


def end_to_end_overrides(device: str, quick: bool, time_budget_s: float, cores: int) -> list[str]:
    lay = end_to_end_layout(cores)
    return fixed_time_overrides(device, quick, time_budget_s, lay["batch_size"]) + [
        f"rollout.num_actors={lay['actors']}", f"replay.num_shards={lay['shards']}",
        f"learner.batch_size={lay['batch_size']}", f"learner.minibatch_size={lay['minibatch_size']}"]


def alone_options(quick: bool, layout: dict) -> dict:
    """bench/rollout_scaling.py's options for the end_to_end actors alone: the run's count and fragment shape."""
    timing = dict(seconds=0.5, warmup=0.0) if quick else dict(seconds=3.0, warmup=1.0)
    return dict(actors=[layout["actors"]], envs=[layout["envs_per_actor"]], fragment_length=layout["fragment_length"],
                **timing)


def section_end_to_end(args, out: Partial, budget: Budget) -> None:
    """configs/cartpole.yaml trained for a fixed time with a rollout actor per core, then those actors alone."""
    from bench import rollout_scaling
    from bench._train import train
    from cluster import config as config_mod

    mode, cores = "quick" if args.quick else "full", os.cpu_count() or 1
    layout = end_to_end_layout(cores)
    seconds = max(3.0, min(END_TO_END_RUN_S, budget.left() - RUN_OVERHEAD_S[mode] - ALONE_S[mode]))
    overrides = end_to_end_overrides(args.device, args.quick, seconds, cores)
    cfg = config_mod.load(str(ROOT / TRAIN["cartpole"]["config"]), overrides)
    out.update(config=TRAIN["cartpole"]["config"], device=args.device, cores=cores, layout=layout,
               overrides=overrides, time_budget_s=round(seconds))
    out.flush()
    result, records, build_s = train(cfg, out.run_dir("run_end_to_end"))
    out.update(stop_reason=result.reason, build_s=build_s, run_wall_s=result.wall_s, **run_figures(records))
    share = out.get("rollout_share") or {}
    busy = 1.0 - share.get("rate_limited", math.nan) - share.get("backpressure", math.nan)
    rate = out.get("env_steps_per_s_second_half")
    # What the same actors would make if they never waited for a ticket or their shard, from the run's own shares:
    # the rollouts' ceiling under training's load (the learner on the same host), beside the measured one below.
    out["rollout_ceiling_env_steps_per_s"] = rate / busy if rate and busy > 0 else None
    out.flush()
    if budget.left() < ALONE_S[mode]:
        out["rollouts_alone"] = {"skipped": f"section budget: {budget.left():.0f} s left, needs {ALONE_S[mode]:.0f} s"}
        return
    opts = alone_options(args.quick, layout)
    alone = out["rollouts_alone"] = {"options": opts}
    out.flush()
    cell = rollout_scaling.run(options(rollout_scaling.make_parser, **opts))[0]["cells"][0]
    alone.update({k: cell[k] for k in ("env_steps_per_s", "machine_cpu_pct", "machine_cpu_pct_max")})
    # Training's share of what the same actors make alone; when either figure is missing, the reason instead. A
    # quick run's second half is two or three records that can carry the same step count (0 env steps/s): a ratio 0.
    out["training_over_alone"] = rate / cell["env_steps_per_s"] if rate is not None and cell["env_steps_per_s"] else None
    if out["training_over_alone"] is None:
        out["training_over_alone_missing"] = (
            f"no second-half rate over {out.get('iterations')} iterations" if rate is None
            else f"rollouts alone made {cell['env_steps_per_s']} env steps/s")


def rollout_options(quick: bool, cores: int) -> dict:
    """bench/rollout_scaling.py's options here: up to the host's cores minus two actors (quick: one, 16 envs)."""
    top = max(1, cores - 2)
    counts = sorted({c for c in (1, 2, 4, 8, 16, 32, 64, 128) if c < top} | {top})
    # Full: up to 5 counts x 2 env sizes, ~2 s a cell plus the actors' start-up per size: well inside its limit.
    return (dict(actors=counts[:1], envs=[16], seconds=0.5, warmup=0.0) if quick
            else dict(actors=counts, envs=[32, 128], seconds=1.5, warmup=0.5))


def section_rollout_scaling(args, out: Partial, budget: Budget) -> None:
    """bench/rollout_scaling.py's ``run``; every cell into ``out`` as it is measured."""
    from bench import rollout_scaling

    out["options"] = opts = rollout_options(args.quick, os.cpu_count() or 1)
    rollout_scaling.run(options(rollout_scaling.make_parser, **opts),
                        on_cell=lambda figures: (out.update(figures), out.flush()))


def inference_options(quick: bool, cores: int) -> dict:
    """bench/rollout_scaling.py's options for the inference section: the multi-rate config (its policy forward is
    its rollouts' largest working stage) with one server for up to four actors (quick: one), local then remote."""
    return dict(config=str(ROOT / "configs" / "multirate.yaml"), inference=["local", "remote"], envs=[16],
                actors=[1] if quick else [min(4, max(1, cores - 2))], seconds=0.5 if quick else 2.0,
                warmup=0.0 if quick else 0.5)


def section_inference(args, out: Partial, budget: Budget) -> None:
    """bench/rollout_scaling.py's ``run`` with ``--inference local remote``: env steps/s and remote over local."""
    from bench import rollout_scaling

    out["options"] = opts = inference_options(args.quick, os.cpu_count() or 1)
    rollout_scaling.run(options(rollout_scaling.make_parser, **opts),
                        on_cell=lambda figures: (out.update(figures), out.flush()))


RUN = {"update": section_update, "feed": section_feed, "rollout_breakdown": section_rollout_breakdown,
       "end_to_end": section_end_to_end, "rollout_scaling": section_rollout_scaling, "inference": section_inference}


def run_section(key: str, args, rec: Partial, budget: Budget) -> None:
    group, _, name = key.partition(".")
    section_training(args, rec, budget, name) if group == "training" else RUN[key](args, rec, budget)


# ============================================================================================== a step's process
def ray_config(args, keys: set[str]):
    """The config the shared Ray is started for: of the configs the sections ``keys`` train, the one that reserves
    the most CPUs (placement.required_cpus), so that every section's layout fits the one Ray."""
    from cluster import config as config_mod
    from cluster import placement

    cfgs = [config_mod.load(str(ROOT / "configs" / "multirate.yaml"), [f"learner.device={args.device}"])]
    if "end_to_end" in keys:
        cfgs.append(config_mod.load(str(ROOT / TRAIN["cartpole"]["config"]),
                                    end_to_end_overrides(args.device, args.quick, 60.0, os.cpu_count() or 1)))
    return max(cfgs, key=placement.required_cpus)


def _run_member(key: str, limit: float, args, rec: Partial) -> None:
    """One section under its alarm; its status, seconds and limit into ``rec`` whatever happens."""
    t0 = time.perf_counter()
    fired = None
    try:
        with alarm(limit) as fired:
            run_section(key, args, rec, Budget(limit))
        if STOPPING.is_set():
            raise KeyboardInterrupt
        rec["status"] = "ok"
    except (KeyboardInterrupt, SystemExit):
        STOPPING.set()
        rec.update(status="timeout", error="stopped at the shared process's limit (partial results kept)")
    except SectionTimeout:
        rec.update(status="timeout", error=f"timed out after {limit:.0f} s (stopped; partial results kept)")
    except Exception as e:  # noqa: BLE001 - recorded; the next section still runs
        if fired is not None and fired.is_set():
            rec.update(status="timeout", error=f"timed out after {limit:.0f} s (surfaced as {type(e).__name__}; "
                                               "stopped; partial results kept)")
        else:
            rec.update(status="error", error=error_text(e), traceback=traceback.format_exc(limit=8)[-3000:])
    rec.update(wall_s=round(time.perf_counter() - t0, 2), timeout_s=round(limit, 1))


def child_main(args) -> int:
    """One step's sections in this process (``--members key=cap:min,...``), on one embedded Ray started as a run
    starts it when they need one, each under its own alarm: results into --partial as they come."""
    out = Partial(Path(args.partial).resolve())
    os.chdir(ROOT)  # Ray workers import bench.* by reference: from the repository root, as the benches run
    signal.signal(signal.SIGTERM, _on_term)
    # key=cap:min,...: each section's limit is decided when it starts, from what the step has left then.
    members = [(k, *map(float, v.split(":"))) for k, v in (m.split("=") for m in args.members.split(","))]
    needs_ray = any(s.ray for s in SECTIONS if s.key in {k for k, _, _ in members})
    deadline, failed = time.perf_counter() + args.budget, False
    try:
        if needs_ray:
            import ray

            from cluster import placement

            t = time.perf_counter()
            # Sized as a run sizes it for the largest layout among the sections; the GPU / NPU resource is detected.
            placement.start_ray(ray_config(args, {k for k, _, _ in members}), None)
            signal.signal(signal.SIGTERM, _on_term)  # ray.init put its own (sys.exit) in place of ours
            out.update(ray_start_s=time.perf_counter() - t, ray_resources=ray.cluster_resources())
            out.flush()
        for j, (key, cap, min_s) in enumerate(members):
            limit = min(cap, deadline - time.perf_counter() - sum(m for _, _, m in members[j + 1:]))
            rec = out.sub(key)
            if STOPPING.is_set():
                rec.update(status="error", error="not run: the shared process was stopped at its limit")
            elif limit < min_s:
                rec.update(status="skipped", error=f"skipped: {max(0.0, limit):.0f} s of the shared process's "
                                                   f"budget left for it, needs {min_s:.0f} s")
            else:
                _run_member(key, limit, args, rec)
            failed |= rec["status"] != "ok"
            out.flush()
    except BaseException as e:  # noqa: BLE001 - Ray's start-up: recorded, then reported by the exit status
        out["error"] = "interrupted (time limit)" if isinstance(e, KeyboardInterrupt) else error_text(e)
        out["traceback"] = traceback.format_exc(limit=8)[-3000:]
        failed = True
    finally:
        if needs_ray:
            import ray

            ray.shutdown()
    out.flush()
    return 1 if failed else 0


# ============================================================================================== orchestration
class Runner:
    """Runs one step's process in a session of its own, so that it and everything it started (Ray's processes
    included) can be stopped together at its time limit."""

    def __init__(self, mode: str):
        self.proc: subprocess.Popen | None = None
        self.grace = KILL_GRACE_S[mode]

    def stop(self) -> None:
        """SIGTERM to the step's process group (it unwinds: Ray and trainers shut down), SIGKILL after the
        grace; then SIGKILL to whatever is left in the group (a stray Ray worker)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, self.grace), (signal.SIGKILL, 5.0)) if proc.poll() is None else ():
            try:
                os.killpg(proc.pid, sig)  # the step's own process group: its pid (start_new_session)
                proc.wait(wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    def run(self, cmd: list[str], timeout: float, log: Path) -> tuple[int | None, bool, float]:
        """(exit status or None, timed out, seconds)."""
        t = time.perf_counter()
        with open(log, "wb") as f:
            # Without RAY_ADDRESS: every step starts a Ray of its own on this host, never joins a cluster.
            env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
            proc = self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True,
                                                env={**env, "PYTHONUNBUFFERED": "1"})
            try:
                proc.wait(timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            self.stop()  # after a timeout: the whole group; otherwise whatever it left in its group
        return proc.poll(), timed_out, time.perf_counter() - t


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_bytes()[-n:].decode("utf-8", "replace")
    except OSError:
        return ""


def run_step(i: int, step: list[Section], args, mode: str, timeout: float, tmp: Path, runner: Runner,
             results: dict) -> tuple[list[tuple[Section, dict]], bool]:
    """A step's sections in one process, within ``timeout`` for all of them (Ray's start-up included). There each
    section gets an alarm when it starts: its cap, or less so that the sections after it keep their minimum; the
    process itself is stopped at ``timeout`` plus a little, should an alarm not work. Returns each section's record
    and whether the device check itself was interrupted meanwhile."""
    log, partial = tmp / f"step{i}.log", tmp / f"step{i}.json"
    spec = ",".join(f"{s.key}={s.cap_s[mode]}:{s.min_s[mode]}" for s in step)
    cmd = [sys.executable or "python3", str(Path(__file__).resolve()), "--members", spec, "--device", args.device,
           "--partial", str(partial), "--budget", f"{timeout:.1f}"] + (["--quick"] if args.quick else [])
    interrupted, rc, timed_out, seconds = False, None, False, 0.0
    try:
        rc, timed_out, seconds = runner.run(cmd, timeout + KILL_GRACE_S[mode], log)
    except KeyboardInterrupt:
        runner.stop()
        interrupted = True
    try:
        data = json.loads(partial.read_text())
    except (OSError, ValueError) as e:
        data = {"error": f"the step's process wrote no results: {error_text(e)}"}
    if step[0].ray:
        results["shared_ray"] = {"sections": [s.key for s in step], "wall_s": round(seconds, 2),
                                 "timeout_s": round(timeout, 1), "exit_code": rc,
                                 **{k: v for k, v in data.items() if not isinstance(v, dict) or k == "ray_resources"}}
    out = []
    for sec in step:
        rec = {"title": sec.title, **data.get(sec.key, {})}
        if "status" in rec:  # the section finished (ok, error or its own alarm) and said so
            if rec["status"] != "ok":
                rec["output_tail"] = tail(log)
        elif interrupted:
            rec.update(status="error", error="interrupted (device check stopped)")
        else:  # the process ended while it ran, or before it started
            why = data.get("error") or ("the process was stopped at its limit" if timed_out
                                        else f"the process ended (exit status {rc})")
            rec.update(status="timeout" if timed_out else "error", output_tail=tail(log),
                       error=f"{why} {'while' if sec.key in data else 'before'} this section ran")
        out.append((sec, rec))
    return out, interrupted


def host_info(dev_kind: str) -> dict:
    from importlib import metadata

    info = {"hostname": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "load_average_start": list(os.getloadavg())}
    for pkg in ("torch", "ray", "torch_npu"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            info[pkg] = metadata.version(pkg)

    def run(*cmd: str) -> str:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=15).stdout.strip()

    with contextlib.suppress(Exception):
        info["git_commit"] = run("git", "rev-parse", "HEAD") or None
        info["git_dirty"] = bool(run("git", "status", "--porcelain", "--untracked-files=no"))
    if dev_kind == "cuda":
        with contextlib.suppress(Exception):
            info["nvidia_smi"] = run("nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                     "--format=csv,noheader").splitlines()
    return info


def set_path(results: dict, key: str, rec: dict) -> None:
    if "." not in key:
        results["sections"][key] = rec
        return
    group, sub = key.split(".", 1)
    node = results["sections"].setdefault(group, {})
    node[sub] = rec
    subs = {k: v for k, v in node.items() if isinstance(v, dict) and "status" in v}
    node["status"] = "ok" if all(v["status"] == "ok" for v in subs.values()) else "error"
    node["error"] = "; ".join(f"{k}: {v['error']}" for k, v in subs.items() if v.get("error")) or None


# ============================================================================================== summary
def _f(x, spec: str = ".1f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _pct(x) -> str:
    return _f(None if x is None else 100 * x)


def targets(results: dict) -> dict:
    """TARGETS with this run's figure beside each: measured (None where its section did not produce it) and met."""
    out = {}
    for name, t in TARGETS.items():
        node = results["sections"]
        for key in t["path"]:
            node = node.get(key) if isinstance(node, dict) else None
        measured = node if isinstance(node, (int, float)) and not isinstance(node, bool) and node == node else None
        bound = ("most", t["most"]) if "most" in t else ("least", t["least"])
        met = None if measured is None else (measured <= bound[1] if bound[0] == "most" else measured >= bound[1])
        out[name] = {"what": t["what"], "measured": measured, bound[0]: bound[1], "baseline": t["baseline"],
                     "unit": t["unit"], "met": met, "from": ".".join(t["path"])}
    return out


def _run_lines(label: str, r: dict) -> list[str]:
    """A fixed-time run's two lines (and its verdict): rates, host-bound, actors, stage shares."""
    from cluster import host_time

    changes = " ".join(f"it{i}->{n}" for i, n in r.get("autoscale_changes") or []) or "no changes"
    shares = r.get("rollout_share")
    stages = (" ".join(f"{host_time.LABELS[stage]} {100 * v:.0f}%" for stage, v in shares.items()) if shares
              else "no rollout stage figures")
    lines = [f"  {label:<18} {_f(r.get('env_steps_per_s_second_half'), ',.0f')} env steps/s (2nd half) | learner "
             f"{_f(r.get('learner_samples_per_s'), ',.0f')} samples/s | host-bound "
             f"{_pct(r.get('host_bound_fraction'))}% | actors at the end {r.get('rollout_actors_end')}"
             + (f" ({changes})" if str(r.get("actors", "")).startswith("auto") else ""),
             f"  {'':<18} rollout stages: {stages}"]
    return lines + ([f"  {'':<18} -> {r['verdict']}"] if r.get("verdict") else [])


def _update_lines(up: dict) -> list[str]:
    lines = ["  ms per update (median; device synchronised)  " + " ".join(f"{v:>9}" for v in VARIANTS)
             + "  compile path"]
    truncated = False
    for name, b in up.get("batches", {}).items():
        res, cells = b.get("results", {}), []
        for v in VARIANTS:
            r = res.get(v)
            cells.append("-" if r is None else _f(r.get("ms"), ".2f") + ("*" if r.get("truncated") else "")
                         if r.get("ms") else ("unsupp." if r.get("error") else "skipped"))
            truncated |= bool(r and r.get("truncated"))
        note = res.get("compile", {}).get("compile_note") or res.get("compile", {}).get("error") or "-"
        shape = f"{name} {b.get('samples')}x{b.get('update_epochs')}ep/{b.get('minibatch_size')}"
        lines.append(f"  {shape:<45} " + " ".join(f"{c:>9}" for c in cells) + f"  {note[:80]}")
        lines += [f"    {name} {v}: {res[v]['error'].splitlines()[0][:200]}"
                  for v in VARIANTS if (res.get(v) or {}).get("error")]
    for name, b in up.get("batches", {}).items():
        res = b.get("results", {})
        if b.get("graphs_speedup"):
            lines.append(f"  {name} graphs: x{b['graphs_speedup']:.2f} ({res['no_graphs']['ms']:.2f} ms eager "
                         f"fused -> {res['fp32']['ms']:.2f} ms; {res['fp32'].get('update_path')})")
    return lines + (["  * fewer timed updates than the minimum: the section's time ran short"] if truncated else [])


def _training_line(r: dict, quick: bool) -> str:
    t = r.get("target", {})
    if r.get("reached"):
        what = (f"reached {t.get('metric')} >= {t.get('value')} in {r['seconds_to_target']:.1f} s "
                f"(from graph build; {r['build_s']:.1f} s build), {r['env_steps_to_target']:,} env steps")
    else:
        what = (f"target {t.get('metric')} >= {t.get('value')} NOT reached"
                + (" (not expected in quick mode)" if quick else "")
                + f": stopped on {r['stop_reason']} after {r['env_steps']:,} env steps, {r['run_wall_s']:.1f} s, "
                  f"final {_f(r.get('final_value'), '.3f')}")
    return (f"  {what} | {_f(r.get('env_steps_per_s'), ',.0f')} env steps/s | learner "
            f"{_f(r.get('learner_samples_per_s'), ',.0f')} samples/s | host-bound {_pct(r.get('host_bound_fraction'))}%")


def _end_to_end_lines(ee: dict) -> list[str]:
    lay, alone = ee.get("layout", {}), ee.get("rollouts_alone") or {}
    lines = _run_lines(f"{lay.get('actors')} actor{'' if lay.get('actors') == 1 else 's'}", ee)
    lines.append(f"  {'':<18} layout: {lay.get('envs_per_actor')} envs x {lay.get('fragment_length')} steps an "
                 f"actor, {lay.get('shards')} shard(s), batch {lay.get('batch_size'):,} / minibatch "
                 f"{lay.get('minibatch_size'):,}; update {_f(ee.get('learner_update_s'), '.3f')} s "
                 f"({ee.get('update_path')})")
    lines.append(f"  {'':<18} the same actors alone: "
                 + (f"{alone['env_steps_per_s']:,.0f} env steps/s; training keeps {_pct(ee.get('training_over_alone'))}%"
                    if alone.get("env_steps_per_s") else alone.get("skipped", "not measured"))
                 + " | their ceiling from the run's own shares "
                 + _f(ee.get("rollout_ceiling_env_steps_per_s"), ",.0f"))
    return lines


def _target_line(name: str, t: dict) -> str:
    def show(x, unit=t["unit"]):
        return ("-" if x is None else f"{100 * x:.1f}%" if unit == "fraction"
                else f"{x:,.2f} ms" if unit == "ms" else f"{x:,.0f} {unit}")

    bound = f"<= {show(t['most'])}" if "most" in t else f">= {show(t['least'])}"
    verdict = "no figure" if t["met"] is None else "met" if t["met"] else "not met"
    return f"  {name}: {show(t['measured'])} (target {bound}; {show(t['baseline'])} there): {verdict}"


def summary(results: dict) -> str:
    S, dev, host, quick = results["sections"], results["device"], results["host"], results["quick"]
    lines = [f"device check: {dev.get('kind')} ({dev.get('name') or '?'}), {host.get('cpus')} CPU cores, "
             f"torch {host.get('torch')}, ray {host.get('ray')}"
             f"{' | QUICK mode: tiny sizes, targets not expected' if quick else ''}"]

    def head(key: str, rec: dict | None) -> bool:
        if rec is None:
            lines.append(f"[{key}] not run")
            return False
        wall = f", {rec['wall_s']:.0f} s" if rec.get("wall_s") is not None else ""
        lines.append(f"[{key}] {rec.get('title', '')}: {rec.get('status')}{wall}"
                     + (f" -- {str(rec['error']).splitlines()[0][:300]}" if rec.get("error") else ""))
        return True

    if head("update", S.get("update")):
        lines += _update_lines(S["update"])
    if head("feed", S.get("feed")):
        for name, k in S["feed"].get("kinds", {}).items():
            if "samples_per_s_ratio" in k:
                lines.append(f"  {name:<7} host-bound inline {100 * k['host_bound_inline']:.1f}% -> pipelined "
                             f"{100 * k['host_bound_pipelined']:.1f}% | learner samples/s "
                             f"{k['inline']['samples_per_s']:,.0f} -> {k['pipelined']['samples_per_s']:,.0f} "
                             f"(x{k['samples_per_s_ratio']:.2f})")
            elif k.get("skipped"):
                lines.append(f"  {name:<7} skipped: {k['skipped']}")
    for name in TRAIN:
        r = S.get("training", {}).get(name)
        if head(f"training.{name}", r) and r.get("stop_reason") is not None:
            lines.append(_training_line(r, quick))
    if head("rollout_breakdown", S.get("rollout_breakdown")):
        for name, r in S["rollout_breakdown"].get("runs", {}).items():
            if r.get("stop_reason") is not None:
                actors = str(r.get("actors", "?")).replace("auto ", "")
                lines += _run_lines(f"{name}, {actors} actor{'' if actors == '1' else 's'}", r)
    if head("end_to_end", S.get("end_to_end")) and S["end_to_end"].get("stop_reason") is not None:
        lines += _end_to_end_lines(S["end_to_end"])
    if head("rollout_scaling", S.get("rollout_scaling")):
        for envs, row in S["rollout_scaling"].get("env_steps_per_s", {}).items():
            lines.append(f"  {envs:>4} envs/actor: " + ", ".join(f"{a} actor{'s' if a != '1' else ''} {v:,.0f}"
                                                                for a, v in row.items()) + " env steps/s")
    if head("inference", S.get("inference")):
        for envs, row in S["inference"].get("remote_over_local", {}).items():
            lines.append(f"  {envs:>4} envs/actor: remote over local inference " + ", ".join(
                f"{a} actor{'s' if a != '1' else ''} x{v:.2f}" for a, v in row.items()))
    if results.get("targets"):
        lines.append("targets (against the NVIDIA H200 host's figures, docs/results.md)"
                     + (": not expected in quick mode" if quick else ""))
        lines += [_target_line(name, t) for name, t in results["targets"].items()]
    lines.append(f"total {results.get('wall_s', 0):.0f} s of a {results['budget_s']:.0f} s budget; "
                 f"{results.get('sections_ok', 0)}/{results.get('sections_total', 0)} sections ok")
    return "\n".join(lines)


# ============================================================================================== main
#: The shortest --time-budget: the shared Ray's start-up and the update section's minimum, with the kill grace.
MIN_BUDGET_S = 60.0


def scaled(sec: Section, mode: str, budget_s: float) -> Section:
    """``sec`` with its limit in ``mode`` scaled from TOTAL_BUDGET_S to ``budget_s`` (Ray's start-up is not scaled:
    it takes what it takes), and its minimum no more than that limit."""
    scale = (budget_s - RAY_START_S[mode]) / (TOTAL_BUDGET_S[mode] - RAY_START_S[mode])
    cap = round(sec.cap_s[mode] * scale, 1)
    return dataclasses.replace(sec, cap_s={**sec.cap_s, mode: cap},
                               min_s={**sec.min_s, mode: min(sec.min_s[mode], cap)})


def plan_steps(sections: list[Section]) -> list[list[Section]]:
    """Consecutive Ray sections form one step (one process); every other section is a step of its own."""
    steps: list[list[Section]] = []
    for sec in sections:
        if sec.ray and steps and steps[-1][0].ray:
            steps[-1].append(sec)
        else:
            steps.append([sec])
    return steps


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--quick", action="store_true", help="tiny sizes (one to two minutes on 2 CPU cores; at most 8)")
    p.add_argument("--time-budget", type=float, metavar="SECONDS",
                   help=f"the whole run's budget (default {TOTAL_BUDGET_S['full']:.0f}, quick "
                        f"{TOTAL_BUDGET_S['quick']:.0f}): every section's limit scaled to it")
    p.add_argument("--out", default="device_check_results.json", help="the results file (JSON)")
    p.add_argument("--only", nargs="+", metavar="SECTION",
                   help="run only these sections: " + ", ".join(s.key for s in SECTIONS) + " (or training)")
    p.add_argument("--members", help=argparse.SUPPRESS)  # internal: run these sections in this process
    p.add_argument("--partial", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, default=60.0, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    p = make_parser()
    args = p.parse_args(argv)
    if args.members:
        return child_main(args)
    known = {s.key for s in SECTIONS} | {s.key.split(".")[0] for s in SECTIONS}
    if args.only and set(args.only) - known:
        p.error(f"--only: unknown section(s) {', '.join(sorted(set(args.only) - known))}; known: "
                f"{', '.join(sorted(known))}")
    mode = "quick" if args.quick else "full"
    budget_s = args.time_budget or TOTAL_BUDGET_S[mode]
    if budget_s < MIN_BUDGET_S:
        p.error(f"--time-budget: {budget_s:g} s is too short to run a section; allowed: >= {MIN_BUDGET_S:.0f}")
    t0 = time.perf_counter()
    out_path = Path(args.out).resolve()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "tool": "bench/device_check.py", "quick": args.quick, "targets_expected": not args.quick,
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "budget_s": budget_s, "device": {"requested": args.device}, "sections": {},
    }
    try:
        if args.device == "cpu":
            results["device"]["kind"] = "cpu"  # what resolve("cpu") says, without importing torch here
        else:
            from learner import device as devices

            results["device"]["kind"] = devices.resolve(args.device).kind
    except Exception as e:
        results["device"]["error"] = error_text(e)
        results["host"] = host_info("cpu")
        write_json(out_path, results)
        print(f"device check: device {args.device!r} cannot be used: {error_text(e)}", file=sys.stderr)
        print(f"results: {out_path}")
        return 2
    args.device = results["device"]["kind"]  # every section gets the resolved kind, never "auto"
    results["host"] = host_info(args.device)
    write_json(out_path, results)

    sections = [scaled(s, mode, budget_s) for s in SECTIONS
                if not args.only or s.key in args.only or s.key.split(".")[0] in args.only]
    steps, runner = plan_steps(sections), Runner(mode)

    def on_term(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the clean-up below must not be cut short
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)  # the wrapper's `timeout`: stop the running section, keep the file
    # A process stopped at its limit may take the kill grace (and 5 s more) to go: keep that inside the budget.
    deadline = t0 + budget_s - KILL_GRACE_S[mode] - 5.0
    interrupted = False
    print(f"device check on {args.device}{' (quick)' if args.quick else ''}: {len(sections)} sections, "
          f"at most {budget_s:.0f} s; results -> {out_path}", flush=True)

    def record(sec: Section, rec: dict) -> None:
        set_path(results, sec.key, rec)
        if sec.key == "update" and rec.get("device_name"):
            results["device"]["name"] = rec["device_name"]
        print(f"  {sec.key}: {rec['status']}" + (f" in {rec['wall_s']:.1f} s" if rec.get("wall_s") is not None
                                                 else "")
              + (f" -- {str(rec['error']).splitlines()[0][:200]}" if rec.get("error") else ""), flush=True)
        write_json(out_path, results)

    with tempfile.TemporaryDirectory(prefix="device_check_") as tmp:
        for i, step in enumerate(steps):
            later = [s for st in steps[i + 1:] for s in st]
            reserve = sum(s.min_s[mode] for s in later) + (RAY_START_S[mode] if any(s.ray for s in later) else 0.0)
            start = RAY_START_S[mode] if step[0].ray else 0.0
            timeout = min(start + sum(s.cap_s[mode] for s in step), deadline - time.perf_counter() - reserve)
            if interrupted or timeout < start + step[0].min_s[mode]:
                for sec in step:
                    why = "not run: the device check was interrupted" if interrupted else (
                        f"skipped: {max(0.0, timeout - start):.0f} s of the whole run's budget left for it, needs "
                        f"{sec.min_s[mode]} s")
                    record(sec, {"title": sec.title, "status": "skipped", "error": why})
                continue
            print(f"[{i + 1}/{len(steps)}] {', '.join(s.key for s in step)}: "
                  + (f"one process on one Ray (limit {timeout:.0f} s for all)" if step[0].ray
                     else f"{step[0].title} (limit {timeout:.0f} s)") + " ...", flush=True)
            try:
                recs, stopped = run_step(i, step, args, mode, timeout, Path(tmp), runner, results)
            except Exception as e:  # the orchestration itself: a bug here must not lose the other sections
                runner.stop()
                recs, stopped = [(sec, {"title": sec.title, "status": "error", "error": error_text(e),
                                        "traceback": traceback.format_exc(limit=6)}) for sec in step], False
            interrupted |= stopped
            for sec, rec in recs:
                record(sec, rec)
    flat = [v for k, v in results["sections"].items() if k != "training"]
    flat += [v for v in results["sections"].get("training", {}).values() if isinstance(v, dict)]
    results.update(sections_total=len(flat), sections_ok=sum(1 for v in flat if v.get("status") == "ok"),
                   wall_s=time.perf_counter() - t0)
    results["host"]["load_average_end"] = list(os.getloadavg())
    results["targets"] = targets(results)
    results["summary"] = summary(results)
    write_json(out_path, results)
    print()
    print(results["summary"])
    if interrupted:
        return 130
    return 0 if results["sections_ok"] == results["sections_total"] else 1


if __name__ == "__main__":
    sys.exit(main())
