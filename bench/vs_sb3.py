"""Ascent-RL against Stable-Baselines3's PPO on CartPole-v1, each run as a whole process, per seed, as ratios.

For each seed, one process per system, in an order that rotates by seed, timed from outside from spawn to exit: what
a user waits for (the interpreter, the imports, Ray's start-up and shutdown, the final checkpoint and report.png).
  ours  ``python -m cluster.train --config configs/cartpole.yaml --set ... --set run.seed=S`` on its embedded Ray
        (mode "ray"; RAY_ADDRESS removed) and with ``--address inprocess`` (mode "inprocess": every actor a thread).
        It stops itself at run.target_return over run.target_window episodes; env steps to target: the first
        metrics.jsonl record with a full window at or above it (bench/_train.first_at).
  SB3   ``python bench/vs_sb3.py --sb3-child --seeds S``: stable_baselines3.PPO with rl-baselines3-zoo's tuned
        CartPole-v1 settings (ZOO_CARTPOLE; lr and clip linear to 0 over n_timesteps 1e5, --sb3-timesteps) on 8
        Monitor-wrapped envs, stopped by a callback at the same rule (a full window with mean >= target_return, so
        --set run.target_return moves both); a seed that misses it by n_timesteps is "not reached". One torch thread
        (--sb3-threads: SB3 at its fastest on CPU, as each of our actors and learner); device "cpu".
  floor (--floor, with mode ray) ``--floor-child``: the embedded Ray and the run's actor set (learners and rollout
        actors importing torch, the board, shards and control actor empty), nothing of ours run: the start-up no
        design with these processes can beat here, beside ours' first iteration (spawn to its first metrics record).

Printed per seed: whole-process seconds, env steps, ours/SB3 ratios of both per mode and the reached flags; then
the median and range of each ratio against its target (time <= 0.5, env steps <= 1.3). A ratio where one side
missed is a bound ("<=" when SB3 missed, ">=" when ours did); where both missed it is left out. Exit 0 whatever the
ratios; 1 only when a run crashed; a run past --max-seconds is interrupted and counts as not reached. SB3 is the
sb3 extra (pip install -e '.[sb3]'); without it this stops before running anything, in one line.

    .venv/bin/python bench/vs_sb3.py [--seeds 0 1 2 3 4] [--modes ray inprocess] [--max-seconds 600]
                                     [--set key=value ...] [--sb3-timesteps 100000] [--sb3-threads 1] [--out FILE]

Matched: separate 64x64 tanh policy and value MLPs with SB3's orthogonal init; Adam eps 1e-5; grad-norm clip 0.5;
advantages normalised per minibatch; no entropy bonus; gamma 0.98; truncation bootstrapped; the stop rule. Each
side otherwise runs its own tuned CartPole settings, which is the comparison: SB3 256 samples an update, one
minibatch, 20 epochs, lr 1e-3 and clip 0.2 falling to 0 over 1e5 steps, GAE lambda 0.8, vf_coef 0.5 x MSE, lag 0,
the stop checked every 8 env steps; ours 1024 samples, 4 minibatches of 256, 8 epochs, lr 1.5e-3 annealed over
run.total_env_steps, clip 0.2, lambda 0.9, half SB3's value gradient, lag 1 (version v+1 sampled while update v
runs), the stop checked per 1024-step iteration and the iterations in flight and the final checkpoint finished.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_MODULE = time.perf_counter()  # the child's import time is measured from here

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench._common import ROOT, parser, run_main, table, versions, write_out  # noqa: E402

SB3_MISSING = "bench/vs_sb3.py needs Stable-Baselines3 (the bench's sb3 extra): pip install -e '.[sb3]'"
ZOO_CARTPOLE = {  # rl-baselines3-zoo hyperparams/ppo.yml, CartPole-v1 ("Tuned"); the lin_ entries are in sb3_child
    "n_envs": 8, "n_steps": 32, "batch_size": 256, "gae_lambda": 0.8, "gamma": 0.98, "n_epochs": 20,
    "ent_coef": 0.0, "learning_rate": "lin_1e-3", "clip_range": "lin_0.2", "n_timesteps": 100_000,
}
TIME_RATIO_TARGET, STEPS_RATIO_TARGET = 0.5, 1.3
FIRST_ITERATION_TARGET_S = 3.0


# ------------------------------------------------------------------ Ray's floor (child process)
def floor_child(config: str, overrides: list[str], ready_file: str) -> int:
    """Ray's own share of ours' start-up: the embedded Ray started as ``cluster.train`` starts it, then the actor set
    of the config's run (each learner and rollout actor an actor whose process imports torch, as theirs do; the
    board, each shard and the control actor empty actors), every one answering; then ``ready_file`` is written.
    Nothing of ours runs (no env, model, fragment or update): no design with these processes starts faster."""
    import ray

    from cluster import config as config_mod
    from cluster import placement

    cfg = config_mod.load(config, overrides)
    placement.start_ray(cfg, None)

    @ray.remote(num_cpus=0)
    class TorchActor:
        def __init__(self, with_envs: bool):
            import torch  # noqa: F401
            if with_envs:
                import gymnasium  # noqa: F401

        def ready(self) -> bool:
            return True

    @ray.remote(num_cpus=0)
    class EmptyActor:
        def ready(self) -> bool:
            return True

    actors = ([TorchActor.remote(False) for _ in range(cfg.learner.num_learners)]
              + [TorchActor.remote(True) for _ in range(cfg.rollout_actors_at_start)]
              + [EmptyActor.remote() for _ in range(2 + cfg.replay.num_shards)])  # board, shards, control actor
    ray.get([a.ready.remote() for a in actors], timeout=120)
    Path(ready_file).write_text(f"{len(actors)} actors\n")
    ray.shutdown()
    return 0


def run_floor(args, seed: int, tmp: Path) -> dict:
    ready = tmp / f"floor-seed{seed}.ready"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--floor-child", str(ready), "--config", args.config,
           *[f"--set={o}" for o in args.overrides]]
    p = timed_process(cmd, tmp / f"floor-seed{seed}", args.max_seconds, watch=ready)
    return {"system": "ray floor", "seed": seed, "ready_s": p["first_line_s"], "seconds": p["wall_s"],
            "crashed": p["rc"] != 0 or p["first_line_s"] is None, "error": _tail(p["stderr"]) if p["rc"] else None}


# ------------------------------------------------------------------ the SB3 side (child process)
def stop_at_target(window: int, target: float):
    """A Stable-Baselines3 callback that keeps every completed episode's return (Monitor's info["episode"]["r"]) in
    ``.returns`` and stops ``learn()`` at once (``.reached``) when the last ``window`` are a full window with mean at
    or above ``target``: the stopping rule ours uses (run.target_window)."""
    from stable_baselines3.common.callbacks import BaseCallback

    class StopAtTarget(BaseCallback):
        def __init__(self):
            super().__init__()
            self.returns: list[float] = []
            self.reached = False

        def _on_step(self) -> bool:
            self.returns += [float(info["episode"]["r"]) for info in self.locals["infos"] if "episode" in info]
            last = self.returns[-window:]
            self.reached = len(last) == window and float(np.mean(last)) >= target
            return not self.reached

    return StopAtTarget()


def linear(start: float):
    """rl-baselines3-zoo's lin_<start>: SB3 calls it with progress_remaining, 1 -> 0 over learn()'s timesteps."""
    return lambda progress_remaining: progress_remaining * start


def sb3_child(seed: int, target: float, window: int, timesteps: int, threads: int) -> int:
    """Train SB3's PPO with the zoo's CartPole-v1 settings until the target or ``timesteps``; one JSON line out."""
    try:
        import torch
        from stable_baselines3 import PPO
        from stable_baselines3.common.env_util import make_vec_env
    except ImportError as e:
        print(f"{SB3_MISSING} ({e})", file=sys.stderr)
        return 2
    if threads > 0:
        torch.set_num_threads(threads)
    import_s = time.perf_counter() - T_MODULE

    t0 = time.perf_counter()
    z = ZOO_CARTPOLE
    env = make_vec_env("CartPole-v1", n_envs=z["n_envs"], seed=seed)  # DummyVecEnv of Monitor-wrapped envs
    model = PPO("MlpPolicy", env, n_steps=z["n_steps"], batch_size=z["batch_size"], gae_lambda=z["gae_lambda"],
                gamma=z["gamma"], n_epochs=z["n_epochs"], ent_coef=z["ent_coef"], learning_rate=linear(1e-3),
                clip_range=linear(0.2), seed=seed, device="cpu", verbose=0)
    callback = stop_at_target(window, target)
    t1 = time.perf_counter()
    model.learn(total_timesteps=timesteps, callback=callback)
    t2 = time.perf_counter()
    env.close()
    print(json.dumps({
        "env_steps_to_target": int(model.num_timesteps), "reached": callback.reached,
        "train_s": t2 - t1, "build_s": t1 - t0, "import_s": import_s,
        "return_mean": float(np.mean(callback.returns[-window:])) if callback.returns else None,
        "episodes": len(callback.returns), "updates": int(model._n_updates), "torch_threads": torch.get_num_threads(),
    }), flush=True)
    return 0


# ------------------------------------------------------------------ running a whole process
#: The processes timed_process has started and not yet reaped: bench/pong.py --jobs runs several from threads, and
#: on Ctrl-C its main thread stops them all (stop_all), since only the main thread sees the interrupt.
LIVE: set[subprocess.Popen] = set()


def stop_all() -> None:
    """Stop every process timed_process still runs (SIGINT, then SIGKILL, to its process group)."""
    for proc in list(LIVE):
        _stop(proc)


def timed_process(cmd: list[str], log: Path, max_seconds: float, watch: Path | None = None) -> dict:
    """Run ``cmd`` from the repository root in its own session, stdout / stderr to ``log``.out / .err; seconds from
    spawn to exit, and (``watch``) from spawn to the first complete line in that file, looked for every 10 ms: for
    ours, its first metrics record, written as its first iteration ends. Past ``max_seconds`` (or on Ctrl-C here)
    its process group gets SIGINT, then SIGKILL."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # ours must start its own embedded Ray, as `make train` does
    out, err = log.with_suffix(".out"), log.with_suffix(".err")
    timed_out, first_line_s = False, None
    with open(out, "w") as fo, open(err, "w") as fe:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fo, stderr=fe, start_new_session=True)
        LIVE.add(proc)
        try:
            while first_line_s is None and watch is not None and proc.poll() is None:
                if time.perf_counter() - t > max_seconds:
                    raise subprocess.TimeoutExpired(cmd, max_seconds)
                if watch.exists() and b"\n" in watch.read_bytes()[:1 << 16]:
                    first_line_s = time.perf_counter() - t
                else:
                    time.sleep(0.01)
            rc = proc.wait(timeout=max(0.0, max_seconds - (time.perf_counter() - t)))
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = _stop(proc)
        except KeyboardInterrupt:
            _stop(proc)
            raise
        finally:
            LIVE.discard(proc)
        wall = time.perf_counter() - t
    return {"rc": rc, "wall_s": wall, "timed_out": timed_out, "stdout": out.read_text(), "stderr": err.read_text(),
            "first_line_s": first_line_s}


def _stop(proc: subprocess.Popen) -> int:
    for sig, grace in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)  # the child's own group (start_new_session): what it started, nothing else
        except ProcessLookupError:
            break
        try:
            return proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


def _tail(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def run_ours(args, seed: int, tmp: Path, mode: str = "ray") -> dict:
    """``mode`` "ray": the default, on an embedded Ray; "inprocess": ``--address inprocess`` (no Ray at all)."""
    from bench._train import first_at, read_records
    from cluster import config as config_mod

    overrides = args.overrides + [f"run.seed={seed}"]
    cfg = config_mod.load(args.config, overrides)
    run_dir = tmp / f"ours-{mode}-seed{seed}"
    cmd = [sys.executable, "-m", "cluster.train", "--config", args.config, *(["--address", "inprocess"]
           if mode == "inprocess" else []), *[a for o in overrides for a in ("--set", o)], "--run-dir", str(run_dir)]
    p = timed_process(cmd, tmp / f"ours-{mode}-seed{seed}", args.max_seconds, watch=run_dir / "metrics.jsonl")
    records = read_records(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    hit = first_at(records, cfg.run.target_window, cfg.run.target_return)
    missed = p["rc"] == 1 and "target not reached" in p["stderr"]  # cluster.train's EXIT_TARGET_MISSED message
    crashed = not p["timed_out"] and (not records or not (p["rc"] == 0 or missed))
    last = hit or (records[-1] if records else None)
    return {"system": f"ours {mode}", "seed": seed, "rc": p["rc"], "crashed": crashed, "timed_out": p["timed_out"],
            "reached": hit is not None, "seconds": p["wall_s"], "first_iteration_s": p["first_line_s"],
            "env_steps": last["env_steps"] if last else None,
            # ours' own clock (cluster.train's main() start) at the record where the target was first seen
            "internal_s": last["time_s"] if last else None,
            "return_mean": last["episode_return_mean"] if last else None,
            "error": _tail(p["stderr"]) if crashed else None}


def run_sb3(args, seed: int, target: float, window: int, tmp: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--sb3-child", "--seeds", str(seed),
           "--sb3-target", repr(float(target)), "--sb3-window", str(window),
           "--sb3-timesteps", str(args.sb3_timesteps), "--sb3-threads", str(args.sb3_threads)]
    p = timed_process(cmd, tmp / f"sb3-seed{seed}", args.max_seconds)
    child = None
    for line in reversed(p["stdout"].strip().splitlines()):
        try:
            child = json.loads(line)
            break
        except ValueError:
            continue
    crashed = not p["timed_out"] and (p["rc"] != 0 or child is None)
    child = child or {}
    return {"system": "sb3", "seed": seed, "rc": p["rc"], "crashed": crashed, "timed_out": p["timed_out"],
            "reached": bool(child.get("reached")), "seconds": p["wall_s"],
            "env_steps": child.get("env_steps_to_target"), "internal_s": child.get("train_s"),
            "import_s": child.get("import_s"), "build_s": child.get("build_s"),
            "return_mean": child.get("return_mean"), "episodes": child.get("episodes"),
            "torch_threads": child.get("torch_threads"),
            "error": _tail(p["stderr"]) if crashed else None}


# ------------------------------------------------------------------ the parent
def _ratio(ours: dict, sb3: dict, key: str) -> float | None:
    """ours/SB3, None where neither reached the target (two caps, not a comparison) or a figure is missing."""
    a, b = ours[key], sb3[key]
    return a / b if (ours["reached"] or sb3["reached"]) and a is not None and b else None


def _bound(ours: dict, sb3: dict) -> str:
    """A ratio where one side missed is a bound: SB3 missed -> its figure is a lower bound -> ours/SB3 '<='."""
    return {(True, True): "", (True, False): "<=", (False, True): ">="}.get((ours["reached"], sb3["reached"]), "")


def _fmt(x, spec: str, bound: str = "") -> str:
    return "-" if x is None else f"{bound}{x:{spec}}"


def _versions() -> str:
    return versions("torch", "ray", "gymnasium", "stable-baselines3")


def main() -> int:
    p = parser(__doc__, config="configs/cartpole.yaml", out="write per-seed results, medians and targets as JSON here",
               overrides="override our config (key=value), passed through to cluster.train; run.target_return and "
                         "run.target_window also set SB3's stop")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--max-seconds", type=float, default=600.0,
                   help="wall-clock cap on each whole process (then interrupted; counts as not reached)")
    p.add_argument("--sb3-timesteps", type=int, default=ZOO_CARTPOLE["n_timesteps"],
                   help="SB3 learn() total_timesteps, also its lr/clip schedules' horizon (zoo: 1e5)")
    p.add_argument("--sb3-threads", type=int, default=1, help="torch threads in the SB3 process (0: torch's default)")
    p.add_argument("--modes", nargs="+", choices=["ray", "inprocess"], default=["ray", "inprocess"],
                   help="ours on an embedded Ray (the default job), and/or with --address inprocess (no Ray)")
    p.add_argument("--floor", action=argparse.BooleanOptionalAction, default=True,
                   help="with mode ray, also time Ray's floor per seed: the embedded Ray and the run's actor set "
                        "started, nothing of ours run (floor_child)")
    p.add_argument("--sb3-child", action="store_true", help="internal: be the SB3 process for the first of --seeds")
    p.add_argument("--floor-child", metavar="READY_FILE", help="internal: be the floor process")
    p.add_argument("--sb3-target", type=float, default=475.0, help="internal (--sb3-child)")
    p.add_argument("--sb3-window", type=int, default=100, help="internal (--sb3-child)")
    args = p.parse_args()
    if args.floor_child:
        return floor_child(args.config, args.overrides, args.floor_child)
    if args.sb3_child:
        return sb3_child(args.seeds[0], args.sb3_target, args.sb3_window, args.sb3_timesteps, args.sb3_threads)

    if importlib.util.find_spec("stable_baselines3") is None:
        print(SB3_MISSING, file=sys.stderr)
        return 2
    from cluster import config as config_mod

    try:
        cfg0 = config_mod.load(args.config, args.overrides)
    except config_mod.ConfigError as e:
        p.error(f"config: {e}")
    if cfg0.env.id != "CartPole-v1":
        p.error(f"SB3's side runs the zoo's CartPole-v1 settings; the config's env.id is {cfg0.env.id!r}")
    if cfg0.run.target_return is None:
        p.error("the config needs run.target_return")
    target, window = cfg0.run.target_return, cfg0.run.target_window
    print(f"{_versions()} | CartPole-v1: target {target:g} over {window} episodes | ours {args.config} "
          f"{' '.join(args.overrides)} (cap {cfg0.run.total_env_steps:,} env steps) | SB3 zoo settings, "
          f"{args.sb3_timesteps:,} steps, {args.sb3_threads or 'default'} torch thread(s) | whole processes, "
          f"cap {args.max_seconds:g} s each", flush=True)

    rows = []
    modes = list(dict.fromkeys(args.modes))
    with tempfile.TemporaryDirectory(prefix="vs_sb3_") as tmp:
        for i, seed in enumerate(args.seeds):
            # Each seed starts with a different system (a rotation), so no side always runs first after a pause.
            runners = [(m, lambda m=m: run_ours(args, seed, Path(tmp), m)) for m in modes]
            runners.append(("sb3", lambda: run_sb3(args, seed, target, window, Path(tmp))))
            if args.floor and "ray" in modes:
                runners.append(("floor", lambda: run_floor(args, seed, Path(tmp))))
            k = i % len(runners)
            order = runners[k:] + runners[:k]
            results = {name: f() for name, f in order}
            sb3, floor = results["sb3"], results.pop("floor", None)
            if floor is not None:
                order = [(name, f) for name, f in order if name != "floor"]
                print(f"  seed {seed} {'ray floor':<14}: "
                      + (f"CRASHED | {floor['error']}" if floor["crashed"] else
                         f"Ray and the run's actors ready {floor['ready_s']:.2f} s from spawn, "
                         f"{floor['seconds']:.1f} s whole process"), flush=True)
            row = {"seed": seed, "order": [name for name, _ in order], "sb3": sb3, "floor": floor,
                   "ours": {m: results[m] for m in modes},
                   "ratios": {m: {"time_ratio": _ratio(results[m], sb3, "seconds"),
                                  "env_steps_ratio": _ratio(results[m], sb3, "env_steps"),
                                  "bound": _bound(results[m], sb3)} for m in modes}}
            rows.append(row)
            for name, _ in order:
                r = results[name]
                state = "CRASHED" if r["crashed"] else "timed out" if r["timed_out"] else (
                    "reached" if r["reached"] else "not reached")
                internal = "-" if r["internal_s"] is None else f"{r['internal_s']:.1f} s"
                first_s = r.get("first_iteration_s")
                first = "" if first_s is None else f", first iteration {first_s:.2f} s"
                print(f"  seed {seed} {r['system']:<14}: {state}, {r['seconds']:.1f} s whole process "
                      f"({'learn()' if name == 'sb3' else 'own clock at target'} {internal}{first}), "
                      f"{_fmt(r['env_steps'], ',')} env steps, 100-episode mean {_fmt(r['return_mean'], '.1f')}"
                      + (f" | {r['error']}" if r["error"] else ""), flush=True)

    print()
    columns = [("seed", ">4"), ("SB3 s", ">7.1f"), ("SB3 env steps", ">13")]
    for m in modes:
        columns += [(f"{m} s", f">{max(7, len(m) + 2)}.1f"), (f"{m}/SB3 time", f">{len(m) + 9}"),
                    (f"{m} env steps", f">{len(m) + 10}"), (f"{m}/SB3 steps", f">{len(m) + 10}")]
    columns += [("reached (SB3, " + ", ".join(modes) + ")", ">22")]

    def cells(r):
        out = [r["seed"], r["sb3"]["seconds"], _fmt(r["sb3"]["env_steps"], ",")]
        for m in modes:
            o, q = r["ours"][m], r["ratios"][m]
            out += [o["seconds"], _fmt(q["time_ratio"], ".2f", q["bound"]), _fmt(o["env_steps"], ","),
                    _fmt(q["env_steps_ratio"], ".2f", q["bound"])]
        return out + [" ".join("y" if x["reached"] else "n" for x in [r["sb3"], *r["ours"].values()])]

    table(columns, [cells(r) for r in rows], rule=True)
    medians = {}
    for m in modes:
        for key, label, goal in (("time_ratio", "time ratio", TIME_RATIO_TARGET),
                                 ("env_steps_ratio", "env-steps ratio", STEPS_RATIO_TARGET)):
            vals = [r["ratios"][m][key] for r in rows if r["ratios"][m][key] is not None]
            n_bounds = sum(1 for r in rows if r["ratios"][m][key] is not None and r["ratios"][m]["bound"])
            med = float(np.median(vals)) if vals else None
            medians[f"{m} {key}"] = med
            verdict = "n/a" if med is None else "met" if med <= goal else "not met"
            spread = f", range {min(vals):.2f}-{max(vals):.2f}" if vals else ""
            print(f"median {label + ' ours ' + m + '/SB3':<36}: {_fmt(med, '.2f'):>5} | target <= {goal:g}: "
                  f"{verdict} ({len(vals)} seeds{spread}{f', {n_bounds} of them bounds' if n_bounds else ''})")
    for r0 in [rows[0]["sb3"], *rows[0]["ours"].values()] if rows else []:
        name = r0["system"]
        runs = [r["sb3"] if name == "sb3" else r["ours"][name.split()[-1]] for r in rows]
        print(f"{name:<14}: {sum(x['reached'] for x in runs)}/{len(rows)} reached {target:g}, median "
              f"{np.median([x['seconds'] for x in runs]):.1f} s whole process")
    for m in modes:  # from spawn to the first metrics record (target: 3 s on the embedded Ray)
        firsts = [r["ours"][m]["first_iteration_s"] for r in rows if r["ours"][m]["first_iteration_s"] is not None]
        if firsts:
            print(f"ours {m:<9} first iteration from spawn: median {np.median(firsts):.2f} s, range "
                  f"{min(firsts):.2f}-{max(firsts):.2f} ({len(firsts)} runs)"
                  + (f" | target <= {FIRST_ITERATION_TARGET_S:g} s: "
                     f"{'met' if np.median(firsts) <= FIRST_ITERATION_TARGET_S else 'not met'}" if m == "ray" else ""))
    floors = [r["floor"]["ready_s"] for r in rows if r.get("floor") and not r["floor"]["crashed"]]
    if floors:
        print(f"Ray's floor (embedded Ray + this run's actor set answering, nothing of ours run): median "
              f"{np.median(floors):.2f} s, range {min(floors):.2f}-{max(floors):.2f} ({len(floors)} runs)")
    crashed = [f"seed {r['seed']} {x['system']}" for r in rows
               for x in [r["sb3"], *r["ours"].values(), *([r["floor"]] if r.get("floor") else [])] if x["crashed"]]
    if crashed:
        print(f"crashed: {', '.join(crashed)}", file=sys.stderr)
    write_out(args.out, {"runs": rows, "medians": medians,
                         "targets": {"time_ratio": TIME_RATIO_TARGET, "env_steps_ratio": STEPS_RATIO_TARGET},
                         "settings": {"config": args.config, "overrides": args.overrides, "target_return": target,
                                      "target_window": window, "sb3_hyperparams": ZOO_CARTPOLE,
                                      "modes": modes, "sb3_timesteps": args.sb3_timesteps,
                                      "sb3_threads": args.sb3_threads,
                                      "versions": _versions()}})
    return 1 if crashed else 0


if __name__ == "__main__":
    run_main(main)
