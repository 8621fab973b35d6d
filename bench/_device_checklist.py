"""The device host's checklist: one table of what a first run on an accelerator host relies on and the seed's targets.

Run by ``bench/device_check.sh`` (its default; ``--sections`` runs bench/device_check.py's measurement sections
instead). Each step is a process of its own, in a session of its own, under its own time limit, so one that hangs
is stopped with everything it started and the rest still run; a step that fails or runs out of time is a row saying
so. In order:

1. ``doctor``: ``cluster.doctor``'s findings (errors, warnings, the first error).
2. ``run``: ``python -m cluster.train`` of configs/cartpole.yaml with two learners and the device's collective
   (gloo on a CPU); one learner where the host has one device (a learner takes a whole device: cluster/placement.py).
3. ``graphs``: the learner's update with ``learner.graphs: auto`` against ``off`` (bench/update_cost.py's learner,
   one process); n/a where the device captures no graphs (the CPU).
4. ``cpu_head``: the run's checkpoint loaded by ``cluster.api.load_policy`` in a process that sees no device
   (CUDA_VISIBLE_DEVICES, ASCEND_RT_VISIBLE_DEVICES empty, torch_npu not loaded), acting once in a fresh env.
5. ``resume``: ``python -m cluster.train --resume RUN_DIR`` with more env steps, to exit 0.
6. ``replay``: bench/replay_throughput.py's CartPole-size fragments through the replay shards, samples/s out.

The table's rows (check, figure, target, verdict): the six steps, plus from the run's records the host-bound
fraction with the rollout stage that bounds it, the device's busy share and the collective's share of update time
(the lead learner's ``collective_share``, which every multi-learner run records: pipeline/metric_keys.py). No
separate two-rank measurement of the collective is made: the run's own figure times every collective of the real
update in the real layout, and the table reads it from metrics.jsonl as any run's reader would. Verdicts: ``ok``,
``miss`` or ``n/a``, each with why where it is not ok. Exit status 0 when every required row is ok or n/a: on an
accelerator every row; on a CPU the target rows are measured on the CPU and shown, but only the steps themselves are
required (the targets are the device host's). ``--quick``: tiny sizes (tests/test_device_check.py, under a minute
on 2 cores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import ROOT, options, write_json  # noqa: E402
from learner import device as devices  # noqa: E402 - the device table only: no torch imported here
from pipeline import metric_keys as M  # noqa: E402

#: The seed's checklist. Busy share: an iteration's time the learner spends in its update (1 - device_idle_fraction):
#: above it the learner is the bound, not the data. Collective: the all-reduce's part of an update, past which more
#: learners buy little. Replay: CartPole-size samples/s out of the replay shards, the data plane's ceiling.
BUSY_SHARE_MIN = 0.85
COLLECTIVE_SHARE_MAX = 0.30
REPLAY_SAMPLES_PER_S_MIN = 1_000_000
#: The host-bound fraction (the learner's wait for data, median of the run's second half) the multi-rate target in
#: bench/device_check.py holds too: at most a tenth of an iteration lost to the host.
HOST_BOUND_MAX = 0.10
#: Learners in the run: the smallest data-parallel layout, the one the collective and the checkpoint's rank-0 state
#: first meet in.
LEARNERS = 2
#: The run's CartPole shape per learner: configs/cartpole.yaml's 1024-sample update of 4 minibatches of 256, so two
#: learners each update what one learner does there.
SAMPLES_PER_LEARNER, MINIBATCH_PER_LEARNER = 1024, 256


@dataclass(frozen=True)
class Step:
    key: str
    cap_s: dict  # per mode: the most this step may take (its process is stopped there)
    min_s: dict  # per mode: less than this left of the whole budget and it is not started


def _step(key: str, full: float, quick: float, least: tuple[float, float]) -> Step:
    return Step(key, {"full": full, "quick": quick}, {"full": least[0], "quick": least[1]})


#: In running order; (full, quick) seconds. Full mode's caps sum to 420 s, inside the whole run's 530 s (the .sh
#: wrapper's hard limit is 560 s, and one call on a lent host may take 10 minutes); quick mode's are wide, for a
#: loaded 2-core machine: they only stop a step that hangs. The doctor runs npu-smi and hccn_tool per NPU (10 s
#: each at most); a run and its resume are an embedded Ray's start-up, the learners' build and their updates.
STEPS = (
    _step("doctor", 60, 60, (10, 5)),
    _step("run", 130, 90, (40, 10)),
    _step("graphs", 50, 45, (15, 5)),
    _step("cpu_head", 40, 45, (10, 5)),
    _step("resume", 90, 90, (30, 10)),
    _step("replay", 50, 45, (15, 5)),
)
TOTAL_BUDGET_S = {"full": 530.0, "quick": 400.0}
#: Training seconds of the full run (run.time_budget_s) and of its resume: past the learners' first updates (a
#: graph capture, an HCCL communicator) into a second half of steady iterations the medians come from.
RUN_TRAIN_S, RESUME_TRAIN_S = 60.0, 30.0
VERDICTS = ("ok", "miss", "n/a")


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:600]


def first_line(text: str | None, n: int = 160) -> str:
    lines = [ln.strip() for ln in str(text or "").splitlines() if ln.strip()]
    return lines[0][:n] if lines else ""


def last_lines(text: str, n: int = 2) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[:300]


def device_count(kind: str) -> int:
    import torch

    if kind == "cuda":
        return torch.cuda.device_count()
    if kind == "npu":
        return torch.npu.device_count()
    return 0


# ============================================================================================== steps in a child
def step_doctor(args) -> dict:
    """cluster.doctor's own facts and findings, as ``python -m cluster.doctor --json`` prints them."""
    from cluster import doctor

    facts = doctor.collect()
    findings = facts["findings"]
    errors = [f for f in findings if f.startswith(doctor.ERROR)]
    warnings = [f for f in findings if f.startswith(doctor.WARNING)]
    return {"errors": len(errors), "warnings": len(warnings), "first_error": first_line(errors[0], 300) if errors else
            None, "findings": findings, "detected": facts["devices"]["detected"],
            "backend": facts["devices"]["backend"], "exit_code": doctor.exit_code(findings)}


def _cartpole_case(quick: bool):
    from cluster import config as config_mod
    from cluster.graph import describe_env, learner_settings

    cfg = config_mod.load(str(ROOT / "configs" / "cartpole.yaml"))
    return describe_env(cfg), learner_settings(cfg)


def step_graphs(args) -> dict:
    """ms per CartPole update (1024 samples, 8 epochs of 256) with learner.graphs auto and off, timed as
    bench/device_check.py's update section times it (the device synchronised before each clock read)."""
    import torch

    from bench.device_check import Budget, _measure_update
    from bench.update_cost import synthetic_batch
    from learner import device as devices

    dev = devices.resolve(args.device)
    torch.set_num_threads(1)  # learner.torch_threads' default: what a learner actor runs with
    spec, settings = _cartpole_case(args.quick)
    case = dict(name="cartpole", spec=spec, samples=SAMPLES_PER_LEARNER, settings=settings)
    batch = {k: v.to(dev.torch_device()) for k, v in synthetic_batch(spec, SAMPLES_PER_LEARNER).items()}
    out = {}
    for variant in ("fp32", "no_graphs"):  # fp32: learner.graphs auto (the default path); no_graphs: off
        r = _measure_update(case, batch, dev, variant, args.quick, 0.5 if args.quick else 2.0, Budget(60.0))
        out[variant] = {k: r[k] for k in ("ms", "reps", "update_path", "first_update_ms")}
    return out


def step_cpu_head(args) -> dict:
    """In a process that sees no device: the run's newest checkpoint, loaded and acting once in a fresh env."""
    import torch

    from cluster import api

    seen = {"cuda": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "torch_npu_loaded": "torch_npu" in sys.modules}
    policy = api.load_policy(args.run_dir, device="cpu")
    env = policy.make_env()
    try:
        obs, _ = env.reset(seed=0)
        action = policy.act(obs, deterministic=True)
        env.step(action)
    finally:
        env.close()
    path = api.find_checkpoint(args.run_dir)
    return {"checkpoint": str(path), "action": str(action), "devices_seen": seen,
            "checkpoint_bytes": path.stat().st_size}


def replay_options(quick: bool, cores: int, producers: int | None = None) -> dict:
    """bench/replay_throughput.py's options here: one round of CartPole-size fragments, 8 an add (what
    rollout.fragments_per_add reaches under load), producers on the host's cores less the consumer's and Ray's."""
    producers = producers if producers is not None else max(1, min(8, cores - 2))
    return dict(payloads=["cartpole"], fragments_per_add=[8], rounds=1, producers=producers,
                runtime="inprocess" if quick else "ray",
                **(dict(seconds=0.5, warmup=0.1) if quick else dict(seconds=2.0, warmup=0.5)))


def step_replay(args) -> dict:
    """bench/replay_throughput.py's CartPole-size payload, 8 fragments an add, through 1 and 2 shards (quick: its
    in-process runtime, the same classes as threads; else Ray actors, what a cluster runs): the best samples/s out."""
    from bench import replay_throughput as rt

    opts = replay_options(args.quick, os.cpu_count() or 1, args.replay_producers)
    figures, _ = rt.run(options(rt.make_parser, **opts))
    cells = {k: v["samples_per_s_out"] for k, v in figures["cartpole"].items()}
    best = max((k for k in cells if k != "direct"), key=cells.get)
    return {"samples_per_s": cells[best], "cell": best, "cells": cells, "options": opts}


CHILD_STEPS = {"doctor": step_doctor, "graphs": step_graphs, "cpu_head": step_cpu_head, "replay": step_replay}


def child_main(args) -> int:
    os.chdir(ROOT)
    result = Path(args.result)
    try:
        write_json(result, {"status": "ok", **CHILD_STEPS[args.step](args)})
        return 0
    except BaseException as e:  # noqa: BLE001 - the orchestrator's row says it
        write_json(result, {"status": "error", "error": error_text(e),
                            "traceback": traceback.format_exc(limit=8)[-2000:]})
        return 1


# ============================================================================================== orchestration
def run_overrides(device: str, learners: int, quick: bool, cores: int, train_s: float) -> list[str]:
    """configs/cartpole.yaml with ``learners`` learners, each updating the config's own shape; rollout actors on the
    host's free cores (a core each for the learners and the data plane), a shard per 4 of them. Quick: three
    updates; else ``train_s`` of training, however many steps that is."""
    actors = max(1, min(8, cores - learners - 2))
    batch = SAMPLES_PER_LEARNER * learners
    return [f"learner.device={device}", f"learner.num_learners={learners}", f"learner.batch_size={batch}",
            f"learner.minibatch_size={MINIBATCH_PER_LEARNER * learners}", f"rollout.num_actors={actors}",
            f"replay.num_shards={math.ceil(actors / 4)}", "run.require_target=false", "run.target_return=null",
            "run.loggers=[jsonl]", "run.progress_interval_s=30", f"run.time_budget_s={train_s:.0f}",
            f"run.total_env_steps={3 * batch if quick else 10**9}"]


def read_records(run_dir: Path) -> list[dict]:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def median_second_half(records: list[dict], key: str) -> float | None:
    vals = [float(r[key]) for r in records[len(records) // 2:] if isinstance(r.get(key), (int, float))]
    return float(sorted(vals)[len(vals) // 2]) if vals else None


def bound_stage(records: list[dict]) -> tuple[str | None, float | None]:
    """The rollout stage with the largest share of the actors' time over the second half (cluster/host_time.py's
    ``largest``, ``other`` left out), as the end-of-run report names it."""
    from cluster import host_time

    half = records[len(records) // 2:]
    wall = sum(float(r.get(M.ROLLOUT_WALL_S) or 0.0) for r in half)
    if wall <= 0:
        return None, None
    seconds = {stage: sum(float(r.get(key) or 0.0) for r in half) for stage, key, _ in M.ROLLOUT_STAGES}
    top = host_time.largest(host_time.shares(seconds, wall))
    return (host_time.LABELS[top[0]], top[1]) if top else (None, None)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("auto", "cuda", "npu", "cpu"), default="auto")
    p.add_argument("--quick", action="store_true", help="tiny sizes (under a minute on 2 CPU cores)")
    p.add_argument("--time-budget", type=float, metavar="SECONDS", help="the whole run's budget: every step's "
                   f"limit scaled to it (default {TOTAL_BUDGET_S['full']:.0f}, quick {TOTAL_BUDGET_S['quick']:.0f})")
    p.add_argument("--out", default="device_check_results.json",
                   help="the results (JSON); the table beside it (.md), and in $OUT/device_check.md where OUT is set")
    p.add_argument("--replay-producers", type=int, metavar="N",
                   help="producer actors of the replay step (default: the host's cores minus 2, 1 to 8)")
    p.add_argument("--step", help=argparse.SUPPRESS)  # internal: run one step in this process
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    return p


class Checklist:
    def __init__(self, args, mode: str, budget_s: float, work: Path):
        from bench.device_check import Runner

        self.args, self.mode, self.work = args, mode, work
        self.t0, self.budget_s = time.perf_counter(), budget_s
        self.scale = budget_s / TOTAL_BUDGET_S[mode]
        self.runner = Runner(mode)
        self.steps: dict[str, dict] = {}

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def limit(self, step: Step) -> float | None:
        """The step's limit: its cap scaled to the budget, or what is left (less the later steps' minimums); None
        when that is under its own minimum (it is not started)."""
        later = STEPS[[s.key for s in STEPS].index(step.key) + 1:]
        limit = min(step.cap_s[self.mode] * self.scale, self.left() - sum(s.min_s[self.mode] for s in later) - 5.0)
        return None if limit < step.min_s[self.mode] else limit

    def run(self, key: str, cmd: list[str], env: dict | None = None) -> dict:
        """``cmd`` as a process of its own under the step's limit: {status, rc, wall_s, limit_s, log}."""
        step = next(s for s in STEPS if s.key == key)
        limit = self.limit(step)
        if limit is None:
            rec = {"status": "skipped", "error": f"not started: {max(0.0, self.left()):.0f} s of the budget left"}
        else:
            print(f"[{key}] limit {limit:.0f} s ...", flush=True)
            log = self.work / f"{key}.log"
            old = os.environ.copy()
            try:
                if env is not None:
                    os.environ.clear()
                    os.environ.update(env)
                rc, timed_out, seconds = self.runner.run(cmd, limit, log)
            finally:
                os.environ.clear()
                os.environ.update(old)
            text = log.read_text(errors="replace") if log.exists() else ""
            rec = {"rc": rc, "wall_s": round(seconds, 1), "limit_s": round(limit), "log": str(log),
                   "status": "timeout" if timed_out else "ok" if rc == 0 else "error"}
            if timed_out:
                rec["error"] = f"timed out after {limit:.0f} s (stopped)"
            elif rc != 0:
                rec["error"] = f"exit {rc}: {last_lines(text)}"
        self.steps[key] = rec
        return rec

    @staticmethod
    def say(key: str, rec: dict) -> None:
        print(f"[{key}] {rec['status']}" + (f" in {rec['wall_s']} s" if "wall_s" in rec else "")
              + (f" -- {first_line(rec['error'], 300)}" if rec.get("error") else ""), flush=True)

    def child(self, key: str, env: dict | None = None, **extra) -> dict:
        """A CHILD_STEPS step in a process of its own; its figures merged into its record."""
        result = self.work / f"{key}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--step", key, "--device", self.args.device,
               "--result", str(result)] + (["--quick"] if self.args.quick else [])
        for k, v in extra.items():
            if v is not None:
                cmd += [f"--{k.replace('_', '-')}", str(v)]
        rec = self.run(key, cmd, env)
        try:
            data = json.loads(result.read_text())
        except (OSError, ValueError):
            data = {}
        if rec["status"] == "error" and data.get("error"):
            rec["error"] = data["error"]
        rec.update({k: v for k, v in data.items() if k not in ("status", "error")})
        if rec["status"] == "ok" and data.get("status") != "ok":
            rec.update(status="error", error=data.get("error") or "the step wrote no results")
        self.say(key, rec)
        return rec


def failed(rec: dict) -> str:
    return {"timeout": "timed out", "skipped": "not run"}.get(rec.get("status"), "failed") + f": {rec.get('error')}"


def build_rows(c: Checklist, kind: str, learners: int, learners_why: str, run_records: list[dict]) -> list[dict]:
    """The table: one row a check, each with its figure, target, verdict and whether the exit status counts it."""
    S, on = c.steps, f"({kind})"
    rows = []

    def row(check: str, figure: str, target: str, verdict: str, required: bool = True) -> None:
        rows.append(dict(check=check, figure=figure, target=target, verdict=verdict, required=required))

    target_rows = kind != "cpu"  # on a CPU the targets are shown, not required: they are the device host's

    d = S["doctor"]
    if d["status"] == "ok":
        row("doctor", f"{d['errors']} errors, {d['warnings']} warnings"
            + (f"; first: {d['first_error']}" if d["first_error"] else ""), "no errors",
            "ok" if d["errors"] == 0 else "miss")
    else:
        row("doctor", failed(d), "no errors", "miss")

    r = S["run"]
    last = run_records[-1] if run_records else {}
    what = f"{learners} learner{'s' if learners > 1 else ''} ({learners_why})"
    if r["status"] == "ok":
        calls = last.get("allreduce_calls", 0)
        ok = bool(run_records) and (learners == 1 or calls > 0)
        row("two-learner run", f"{what}: exit 0, {last.get('iteration')} iterations, "
            f"{last.get('env_steps') or 0:,} env steps, {calls} all-reduces",
            "exit 0" + (", all-reduces > 0" if learners > 1 else ""), "ok" if ok else "miss")
    else:
        row("two-learner run", f"{what}: {failed(r)}", "exit 0", "miss")

    g = S["graphs"]
    if g["status"] == "ok":
        on_ms, off_ms, path = g["fp32"]["ms"], g["no_graphs"]["ms"], g["fp32"]["update_path"]
        fig = f"{on_ms:.2f} ms auto vs {off_ms:.2f} ms off = x{off_ms / on_ms:.2f} {on}; path: {path}"
        if path == "fused (graphs)":
            row("graphs vs eager", fig, "with graphs <= eager", "ok" if on_ms <= off_ms else "miss", target_rows)
        elif "no capture" in path or "no graph capture" in path:  # the device (its torch) has no graphs to use
            why = path.split("graphs: ", 1)[-1].rstrip(")")
            row("graphs vs eager", fig, "with graphs <= eager",
                "n/a (no graphs on cpu)" if kind == "cpu" else f"n/a ({why})", target_rows)
        else:  # the device has graphs, and this update did not run on them (a failed capture: its reason)
            row("graphs vs eager", fig, "with graphs <= eager", "miss", target_rows)
    else:
        row("graphs vs eager", failed(g), "with graphs <= eager", "miss")

    no_run = f"n/a (no run records: the run {S['run']['status']})"
    hb = median_second_half(run_records, "host_bound_fraction")
    stage, share = bound_stage(run_records) if run_records else (None, None)
    if hb is None:
        row("host-bound fraction", "-", f"<= {HOST_BOUND_MAX:.0%}", no_run if r["status"] != "ok" else "miss")
    else:
        fig = (f"{hb:.1%} {on} (median of the 2nd half); largest rollout stage: "
               + (f"{stage} {share:.0%}" if stage else "none reported"))
        row("host-bound fraction", fig, f"<= {HOST_BOUND_MAX:.0%}", _verdict(hb <= HOST_BOUND_MAX, target_rows),
            target_rows)

    h = S["cpu_head"]
    if h["status"] == "ok":
        row("checkpoint on a CPU-only head", f"{Path(h['checkpoint']).name} ({h['checkpoint_bytes']:,} bytes) loaded "
            f"with no device visible (cuda {h['devices_seen']['cuda']}), acted: {h['action']}", "loads and acts", "ok")
    elif h["status"] == "skipped" and r["status"] != "ok":
        row("checkpoint on a CPU-only head", "-", "loads and acts", no_run)
    else:
        row("checkpoint on a CPU-only head", failed(h), "loads and acts", "miss")

    z = S["resume"]
    if z["status"] == "ok":
        ok = z.get("env_steps_after", 0) > z.get("env_steps_before", 0)
        row("resume", f"exit 0, env steps {z.get('env_steps_before') or 0:,} -> {z.get('env_steps_after') or 0:,}",
            "exit 0 with more steps", "ok" if ok else "miss")
    elif z["status"] == "skipped" and r["status"] != "ok":
        row("resume", "-", "exit 0 with more steps", no_run)
    else:
        row("resume", failed(z), "exit 0 with more steps", "miss")

    idle = median_second_half(run_records, "device_idle_fraction")
    if idle is None:
        row("device busy share", "-", f"> {BUSY_SHARE_MIN:.0%}", no_run if r["status"] != "ok" else "miss")
    else:
        busy = 1.0 - idle
        row("device busy share", f"{busy:.1%} {on} (update time over iteration time, median of the 2nd half)",
            f"> {BUSY_SHARE_MIN:.0%}", _verdict(busy > BUSY_SHARE_MIN, target_rows), target_rows)

    share = median_second_half(run_records, M.COLLECTIVE_SHARE)
    seconds = median_second_half(run_records, M.COLLECTIVE_S)
    target = f"<= {COLLECTIVE_SHARE_MAX:.0%}"
    if learners == 1:
        row("collective share of update", "-", target, f"n/a ({learners_why})")
    elif not run_records:
        row("collective share of update", "-", target, no_run if r["status"] != "ok" else "miss")
    elif share is None or seconds is None:
        row("collective share of update", f"the run's records carry no {M.COLLECTIVE_SHARE}", target, "miss")
    else:
        backend = devices.spec_for(kind).backend
        row("collective share of update", f"{share:.1%} {on} ({1e3 * seconds:.1f} ms of collectives an update on the "
            f"lead learner, the run's {M.COLLECTIVE_SHARE}, median of the 2nd half; {learners} ranks, {backend})",
            target, _verdict(share <= COLLECTIVE_SHARE_MAX, target_rows), target_rows)

    p = S["replay"]
    if p["status"] == "ok" and p["options"]["runtime"] == "inprocess":
        row("replay samples/s", f"{p['samples_per_s']:,.0f} (host CPU, in-process runtime, "
            f"{p['options']['producers']} producers, {p['cell']})", f">= {REPLAY_SAMPLES_PER_S_MIN:,}",
            "n/a (quick: the in-process runtime moves no data between processes; the target is the Ray path's)")
    elif p["status"] == "ok":
        row("replay samples/s", f"{p['samples_per_s']:,.0f} (host CPU, {p['options']['runtime']} runtime, "
            f"{p['options']['producers']} producers, {p['cell']})", f">= {REPLAY_SAMPLES_PER_S_MIN:,}",
            _verdict(p["samples_per_s"] >= REPLAY_SAMPLES_PER_S_MIN, target_rows), target_rows)
    else:
        row("replay samples/s", failed(p), f">= {REPLAY_SAMPLES_PER_S_MIN:,}", "miss")
    return rows


def _verdict(met: bool, required: bool) -> str:
    return "ok" if met else "miss" if required else "miss (not required on cpu)"


def table(rows: list[dict]) -> str:
    def cell(s: str) -> str:
        return str(s).replace("|", "/").replace("\n", " ")

    lines = ["| check | figure | target | verdict |", "|---|---|---|---|"]
    lines += [f"| {cell(r['check'])} | {cell(r['figure'])} | {cell(r['target'])} | {cell(r['verdict'])} |"
              for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = make_parser()
    args = p.parse_args(argv)
    if args.step:
        return child_main(args)
    mode = "quick" if args.quick else "full"
    budget_s = args.time_budget or TOTAL_BUDGET_S[mode]
    if budget_s < 60:
        p.error(f"--time-budget: {budget_s:g} s is too short for the checklist; allowed: >= 60")
    out_path = Path(args.out).resolve()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    # Every call a directory of its own: cluster.train refuses a run directory that holds another run.
    work = out_path.parent / f"device_check_{stamp}_{os.getpid()}"
    work.mkdir(parents=True)
    results: dict = {"tool": "bench/device_check.sh", "quick": args.quick, "budget_s": budget_s, "work_dir": str(work),
                     "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    try:
        if args.device == "cpu":
            kind, count = "cpu", 0
        else:
            from learner import device as devices

            kind = devices.resolve(args.device).kind
            count = device_count(kind)
    except Exception as e:  # noqa: BLE001 - the device asked for cannot be used: nothing else can be measured
        results["error"] = f"device {args.device!r} cannot be used: {error_text(e)}"
        write_json(out_path, results)
        print(f"device check: {results['error']}", file=sys.stderr)
        return 2
    args.device = kind
    cores = os.cpu_count() or 1
    if kind == "cpu":
        learners, learners_why = LEARNERS, "gloo on the CPU"
    elif count >= LEARNERS:
        learners, learners_why = LEARNERS, f"{'hccl' if kind == 'npu' else 'nccl'}, a {kind} device each"
    else:
        learners, learners_why = 1, f"one {kind} device: a learner takes a whole device, so one learner, no collective"
    results.update(device={"kind": kind, "count": count}, cores=cores, learners=learners)
    print(f"device check on {kind} ({count} devices, {cores} cores){' (quick)' if args.quick else ''}: at most "
          f"{budget_s:.0f} s; work in {work}", flush=True)
    c = Checklist(args, mode, budget_s, work)

    def on_term(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the clean-up and the table must not be cut short
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)  # the wrapper's `timeout`: stop the running step, keep the table
    base_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # an embedded Ray, never a cluster's
    base_env["PYTHONUNBUFFERED"] = "1"
    run_records: list[dict] = []
    try:
        c.child("doctor", base_env)
        run_dir = work / "run"
        train = [sys.executable, "-m", "cluster.train"]
        train_s = 5.0 if args.quick else RUN_TRAIN_S * c.scale  # quick: its three updates end it first
        overrides = run_overrides(kind, learners, args.quick, cores, train_s)
        c.run("run", train + ["--config", str(ROOT / "configs" / "cartpole.yaml"), "--run-dir", str(run_dir)]
              + [a for o in overrides for a in ("--set", o)], base_env)
        c.say("run", c.steps["run"])
        run_records = read_records(run_dir)
        c.child("graphs", base_env)
        have_ckpt = (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").glob("*.pt"))
        if have_ckpt:
            head_env = {**base_env, "CUDA_VISIBLE_DEVICES": "", "ASCEND_RT_VISIBLE_DEVICES": "",
                        "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}  # a head without torch_npu loaded
            c.child("cpu_head", head_env, run_dir=str(run_dir))
            before = max((r.get("env_steps", 0) for r in run_records), default=0)
            n_before = len(read_records(run_dir))
            more = before + 2 * SAMPLES_PER_LEARNER * learners  # two more updates
            # run.time_budget_s counts the training time of the run it resumes (the driver's train_time_s) too.
            trained = max((float(r.get("train_time_s") or 0.0) for r in run_records), default=0.0)
            budget = math.ceil(trained + (10.0 if args.quick else RESUME_TRAIN_S * c.scale))
            rec = c.run("resume", train + ["--resume", str(run_dir), "--set", f"run.total_env_steps={more}",
                                           "--set", f"run.time_budget_s={budget}"], base_env)
            after = read_records(run_dir)[n_before:]
            rec.update(env_steps_before=before, env_steps_after=max((r.get("env_steps", 0) for r in after),
                                                                    default=before))
            c.say("resume", rec)
        else:
            why = "not started: the run left no checkpoint"
            for key in ("cpu_head", "resume"):
                c.steps[key] = {"status": "skipped", "error": why}
                c.say(key, c.steps[key])
        c.child("replay", base_env, replay_producers=args.replay_producers)
    except KeyboardInterrupt:  # the wrapper's hard limit (SIGTERM): the table of what finished
        c.runner.stop()
        for s in STEPS:
            c.steps.setdefault(s.key, {"status": "skipped", "error": "not run: the device check was stopped"})
    try:
        rows = build_rows(c, kind, learners, learners_why, run_records)
    except Exception as e:  # noqa: BLE001 - a figure this code did not expect: each step's status, still a table
        rows = [dict(check=key, figure=f"{rec.get('status')}: {rec.get('error') or ''}"[:300], target="-",
                     verdict=f"miss (the table could not be built: {error_text(e)[:200]})", required=True)
                for key, rec in c.steps.items()]
    text = table(rows)
    required_missed = [r["check"] for r in rows if r["required"] and r["verdict"].split()[0] == "miss"]
    wall = time.perf_counter() - c.t0
    foot = (f"{kind}{' (quick)' if args.quick else ''}, {cores} cores, {wall:.0f} s of a {budget_s:.0f} s budget; "
            + (f"required checks missed: {', '.join(required_missed)}" if required_missed
               else "every required check ok")
            + ("; on a CPU the target rows are measured on the CPU and not required" if kind == "cpu" else ""))
    results.update(steps=c.steps, rows=rows, table=text, required_missed=required_missed, wall_s=round(wall, 1))
    write_json(out_path, results)
    md = f"# Device check, {results['started']}\n\n{text}\n\n{foot}\n"
    targets = [out_path.with_suffix(".md"), work / "device_check.md"]
    if os.environ.get("OUT"):
        targets.append(Path(os.environ["OUT"]) / "device_check.md")
    for t in targets:
        try:
            t.parent.mkdir(parents=True, exist_ok=True)
            t.write_text(md)
        except OSError as e:
            print(f"device check: could not write {t}: {e}", file=sys.stderr)
    print()
    print(text)
    print(foot)
    print(f"table: {targets[0]}")
    return 0 if not required_missed else 1


if __name__ == "__main__":
    sys.exit(main())
