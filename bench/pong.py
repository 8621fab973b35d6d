"""Atari Pong side by side: ours (in process and on the embedded Ray) against Stable-Baselines3 and Sample Factory.

Two parts, both in one run:
  stages   in this process, alternating (A, B, A, B...) so the machine's load hits both sides alike: the emulator
           alone (8 envs, random actions), the rollout forward per env step (a batch of 8) and its uint8 -> float
           share, and one update of the config's batch (its epochs and minibatches) per env step: fp32 eager, then
           the config's learner.precision, then that with learner.compile where the config has it; the action
           probabilities of fp32 and the config's precision compared on real frames (PROB_TOLERANCE).
  whole    rounds of whole processes, each timed from outside from spawn to exit, the order rotating by round:
           ours  ``python -m cluster.train --config configs/atari_pong.yaml`` on its embedded Ray ("ray") and with
                 ``--address inprocess`` ("inprocess"), run.total_env_steps = --steps;
           SB3   ``--sb3-child``: ``PPO("CnnPolicy")`` with rl-baselines3-zoo's Atari settings (ZOO_ATARI) on
                 ``PongNoFrameskip-v4`` through SB3's AtariWrapper and a 4-frame VecFrameStack, --steps env steps,
                 torch's default thread count (both cores: SB3 steps and updates in turn in one process);
           SF    Sample Factory's APPO with its own Atari settings (``sf_examples.atari.train_atari``, atari_pong,
                 --steps env steps, on the CPU) from its own environment (--sf-python: Sample Factory 2.1 pins
                 gymnasium < 1.0, which ours cannot import), left out with its error where it cannot run.
Printed: per round and system the whole-process seconds, env steps and time per env step, the env steps/s while
learning (ours: its own clock from the first iteration; SB3: learn(); SF: its collection rate), ours' rollout stage
shares and update seconds per sample from its metrics; then the ratios of time per env step, ours/SB3 and ours/SF,
median and range over rounds, against the goal (<= 0.5 against SB3, < 1 against SF), and the load average at the
start and end. Exit 0 whatever the ratios; 1 when a run of ours or SB3 crashed. A process past --max-seconds is
stopped, left out of the ratios, and keeps its return curve so far (--curves).

    .venv-bench/bin/python bench/pong.py [--rounds 2] [--steps 18432] [--systems inprocess ray sb3 sf]
                                         [--variant LABEL:MODE:key=value,...] [--curves] [--no-stages]
                                         [--set key=value ...] [--out FILE] [--jobs N (with --curves)]
    .venv-bench/bin/python bench/pong.py --curves-from FILE      (an earlier --out FILE's return curves)

Matched with SB3 and SF: 8 envs, 128-step fragments (SB3's n_steps, SF's rollout), 4 epochs of 4 minibatches of
256, lr 2.5e-4 falling linearly to 0, clip 0.1 (SB3's falls to 0 with the lr, ours stays, as CleanRL's), entropy
0.01, gamma 0.99, GAE lambda 0.95, grad-norm clip 0.5, Nature-DQN frames (84x84 grey, frame skip 4, 4 stacked).
Each side keeps its own network: SB3 and SF the Nature CNN (3 convs, 512 units), ours the config's
(learner/encoders.py's ImageEncoder and a 512-unit trunk).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench._common import ROOT, parser, rotated, run_main, table, versions, write_out  # noqa: E402
from bench.vs_sb3 import _tail, linear, stop_all, timed_process  # noqa: E402

#: rl-baselines3-zoo hyperparams/ppo.yml, "atari" (lin_ entries: linear to 0 over n_timesteps, here --steps).
ZOO_ATARI = {"n_envs": 8, "n_steps": 128, "n_epochs": 4, "batch_size": 256, "learning_rate": "lin_2.5e-4",
             "clip_range": "lin_0.1", "vf_coef": 0.5, "ent_coef": 0.01, "frame_stack": 4}
#: The issue's goals: ours/SB3 time per env step at most this; ours/SF below 1 (ahead of it).
SB3_RATIO_GOAL, SF_RATIO_GOAL = 0.5, 1.0
#: Largest difference of an action probability between the fp32 forward and the config's precision that counts as
#: the same policy: bf16 keeps 8 mantissa bits (relative 2^-8 = 0.4% per op), and a probability moved by less than
#: 0.01 changes the sampled action of at most 1 step in 100.
PROB_TOLERANCE = 0.01
SYSTEMS = ("inprocess", "ray", "sb3", "sf")
#: Episodes in a return curve's mean: ours' run.target_window default, so both curves average alike.
CURVE_WINDOW = 100
#: Env steps between the points where --curves compares the return curves.
CURVE_EVERY = 100_000
#: Sample Factory's Atari frame skip: its env_steps are frames, this many to one env step of ours or SB3's.
SF_FRAME_SKIP = 4
SF_PYTHON = ROOT / ".venv-bench-sf" / "bin" / "python"


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _versions() -> str:
    return versions("torch", "ray", "gymnasium", "ale-py", "stable-baselines3")


# ------------------------------------------------------------------ stages (this process)
def stages(cfg, reps: int) -> dict:
    """Where one env step's time goes, each figure measured here, the compared sides alternating."""
    import gymnasium as gym
    import torch

    import actors.wrapped_envs  # noqa: F401  (registers AscentRL/Atari-*)
    from bench.update_cost import make_learner, synthetic_batch
    from cluster.graph import describe_env, learner_settings

    torch.set_num_threads(cfg.learner.torch_threads)
    n_envs = cfg.rollout.envs_per_actor
    envs = gym.vector.SyncVectorEnv([lambda: gym.make(cfg.env.id) for _ in range(n_envs)])
    obs, _ = envs.reset(seed=0)
    frames = []
    t = time.perf_counter()
    steps = 300
    for i in range(steps):
        obs, *_ = envs.step(envs.action_space.sample())
        if i % 30 == 0:
            frames.append(obs.copy())
    env_s = (time.perf_counter() - t) / steps
    envs.close()
    frames = np.concatenate(frames)  # real frames, for the precision check

    spec, settings = describe_env(cfg), learner_settings(cfg)
    # The update in fp32 eager, then each of the config's changes added in turn (its precision, then compile), the
    # same weights (the config's seed) in each.
    sides = {"fp32": dict(precision="fp32", compile=False)}
    sides[cfg.learner.precision] = dict(precision=cfg.learner.precision, compile=False)
    if cfg.learner.compile:
        sides[f"{cfg.learner.precision}+compile"] = dict(precision=cfg.learner.precision, compile=True)
    learners = {k: make_learner(spec, settings, torch.device("cpu"), cfg.run.seed, **v) for k, v in sides.items()}
    fp32, chosen = learners["fp32"], learners[cfg.learner.precision]
    model = fp32.model
    name = spec.modalities[0].name
    batch8 = {name: torch.from_numpy(frames[:n_envs])}
    g = torch.Generator().manual_seed(0)

    def clock(f, n):
        f()
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        return (time.perf_counter() - t0) / n

    enc = model.encoders[name]
    fwd = [clock(lambda: model.act(batch8, generator=g), 50) for _ in range(reps)]
    to_float = [clock(lambda: enc.to_float(batch8[name]), 200) for _ in range(reps)]


    batch = synthetic_batch(spec, cfg.learner.batch_size, model=copy.deepcopy(model))
    t0 = time.perf_counter()
    for learner in learners.values():
        learner.update(batch)  # warm-up: a compiled learner compiles here
    warm_s = time.perf_counter() - t0
    times = {k: [] for k in learners}
    for r in range(reps):
        for k in rotated(list(learners), r):
            t0 = time.perf_counter()
            learners[k].update(batch)
            times[k].append(time.perf_counter() - t0)
    per_sample = {k: float(np.median(v)) / cfg.learner.batch_size for k, v in times.items()}
    # Action probabilities on real frames, the same weights (the fp32 learner's, moved by the updates above off
    # their near-uniform start) through the fp32 forward and under the config precision's autocast.
    with torch.no_grad():
        x = {name: torch.from_numpy(frames)}
        p32 = torch.softmax(model._heads(x)[0], -1)
        with torch.autocast("cpu", dtype=chosen.amp_dtype or torch.float32, enabled=chosen.amp_dtype is not None):
            plow = torch.softmax(model._heads(x)[0].float(), -1)
    prob_diff = float((p32 - plow).abs().max())
    out = {"env_step_ms": 1000 * env_s / n_envs, "n_envs": n_envs,
           "forward_ms_per_env_step": 1000 * float(np.median(fwd)) / n_envs,
           "to_float_ms_per_env_step": 1000 * float(np.median(to_float)) / n_envs,
           # One env step is one sample of the batch, trained over every epoch: its update cost, then one pass's.
           "update_ms_per_env_step": {k: 1000 * v for k, v in per_sample.items()},
           "update_ms_per_sample_pass": {k: 1000 * v / cfg.ppo.update_epochs for k, v in per_sample.items()},
           "epochs": cfg.ppo.update_epochs, "precision": cfg.learner.precision,
           "max_action_prob_diff": prob_diff, "prob_tolerance": PROB_TOLERANCE, "warm_up_s": warm_s,
           "update_paths": {k: f"{x.update_path}, compile {x.compile_note}" for k, x in learners.items()},
           "torch_threads": torch.get_num_threads()}
    print(f"stages ({torch.get_num_threads()} torch thread(s), alternating, median of {reps}): "
          f"emulator + preprocessing {out['env_step_ms']:.3f} ms/env step ({1000 / out['env_step_ms']:,.0f} env "
          f"steps/s, {n_envs} envs) | rollout forward {out['forward_ms_per_env_step']:.3f} ms/env step (uint8 -> "
          f"float {out['to_float_ms_per_env_step']:.4f}) | update of {cfg.learner.batch_size} samples x "
          f"{cfg.ppo.update_epochs} epochs (warm-up, compiling included, {warm_s:.0f} s): "
          + ", ".join(f"{k} {v:.3f} ms/env step ({out['update_ms_per_sample_pass'][k]:.3f} ms a sample a pass)"
                      for k, v in out["update_ms_per_env_step"].items())
          + f" | action probabilities fp32 vs {cfg.learner.precision}: max diff {prob_diff:.2e} "
            f"(tolerance {PROB_TOLERANCE:g}: {'ok' if prob_diff <= PROB_TOLERANCE else 'EXCEEDED'})", flush=True)
    return out


# ------------------------------------------------------------------ SB3 (child process)
def sb3_child(seed: int, steps: int, threads: int) -> int:
    """SB3's PPO with the zoo's Atari settings for ``steps`` env steps. Out, one JSON line each: a point of its return
    curve after each rollout, {"point": (env steps, mean of the last CURVE_WINDOW episodes' returns, Monitor's
    unclipped score)}, printed as it comes so that a run stopped at --max-seconds keeps its curve so far; at the end
    its env steps and learn() seconds."""
    import torch
    import gymnasium as gym
    import ale_py
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_atari_env
    from stable_baselines3.common.vec_env import VecFrameStack

    gym.register_envs(ale_py)
    if threads > 0:
        torch.set_num_threads(threads)
    z = ZOO_ATARI
    env = VecFrameStack(make_atari_env("PongNoFrameskip-v4", n_envs=z["n_envs"], seed=seed), n_stack=z["frame_stack"])
    model = PPO("CnnPolicy", env, n_steps=z["n_steps"], n_epochs=z["n_epochs"], batch_size=z["batch_size"],
                learning_rate=linear(2.5e-4), clip_range=linear(0.1), vf_coef=z["vf_coef"], ent_coef=z["ent_coef"],
                seed=seed, device="cpu", verbose=0)
    from stable_baselines3.common.callbacks import BaseCallback

    class Curve(BaseCallback):
        def __init__(self):
            super().__init__()
            self.returns: list[float] = []

        def _on_step(self) -> bool:
            self.returns += [float(i["episode"]["r"]) for i in self.locals["infos"] if "episode" in i]
            return True

        def _on_rollout_end(self) -> None:
            if self.returns:
                point = (int(self.num_timesteps), float(np.mean(self.returns[-CURVE_WINDOW:])))
                print(json.dumps({"point": point}), flush=True)

    curve = Curve()
    t = time.perf_counter()
    model.learn(total_timesteps=steps, callback=curve)
    learn_s = time.perf_counter() - t
    env.close()
    print(json.dumps({"env_steps": int(model.num_timesteps), "learn_s": learn_s,
                      "torch_threads": torch.get_num_threads()}), flush=True)
    return 0


def run_sb3(args, seed: int, tmp: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--sb3-child", "--seed", str(seed),
           "--steps", str(args.steps), "--sb3-threads", str(args.sb3_threads)]
    p = timed_process(cmd, tmp / f"sb3-{seed}", args.max_seconds)
    lines = _json_lines(p["stdout"])
    child = next((d for d in reversed(lines) if "env_steps" in d), {})  # its last line, absent when stopped
    crashed = not p["timed_out"] and (p["rc"] != 0 or not child)
    return {"system": "sb3", "seconds": p["wall_s"], "stopped": p["timed_out"], "env_steps": child.get("env_steps"),
            "curve": [d["point"] for d in lines if "point" in d],
            "learning_steps_per_s": child["env_steps"] / child["learn_s"] if "env_steps" in child else None,
            "crashed": crashed, "error": _tail(p["stderr"]) if crashed else None}


# ------------------------------------------------------------------ Sample Factory (child process, its own venv)
#: Imported by every Python process of Sample Factory's run (its rollout workers are spawned, so a registration in
#: the parent alone is lost): gymnasium < 1.0 does not load ale-py 0.12's envs by itself.
SF_SITECUSTOMIZE = """
try:
    import ale_py.registration as _r
    _r.register_v0_v4_envs()
    _r.register_v5_envs()
except Exception:
    pass
"""


def run_sf(args, seed: int, tmp: Path) -> dict:
    train_dir = tmp / f"sf-{seed}"
    site = tmp / "sf-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SF_SITECUSTOMIZE)
    cmd = ["env", f"PYTHONPATH={site}", str(args.sf_python), "-m", "sf_examples.atari.train_atari",
           "--env=atari_pong", f"--experiment=pong{seed}",
           f"--train_dir={train_dir}", f"--train_for_env_steps={args.steps * SF_FRAME_SKIP}", f"--seed={seed}",
           "--device=cpu", "--with_wandb=False", "--save_every_sec=100000", "--keep_checkpoints=1",
           f"--num_workers={args.sf_workers}", f"--num_envs_per_worker={8 // args.sf_workers}"]
    p = timed_process(cmd, tmp / f"sf-{seed}", args.max_seconds)
    text = p["stdout"] + p["stderr"]
    # SF counts frames (env steps x its frame skip 4: summaries_use_frameskip, on in its Atari settings) and ends with
    # "Collected {0: FRAMES}, FPS: F" (F: frames over its main loop, start-up left out).
    done = re.findall(r"Collected \{0: (\d+)\}, FPS: ([0-9.]+)", text)
    crashed = p["rc"] != 0 or not done
    steps = int(done[-1][0]) // SF_FRAME_SKIP if done else None
    return {"system": "sf", "seconds": p["wall_s"], "env_steps": steps,
            "learning_steps_per_s": float(done[-1][1]) / SF_FRAME_SKIP if done else None,
            "crashed": crashed, "error": _tail(p["stderr"]) if crashed else None}


# ------------------------------------------------------------------ ours (child process)
def run_ours(args, seed: int, tmp: Path, mode: str, label: str | None = None, extra: tuple = ()) -> dict:
    """``label``/``extra``: a --variant, ours with more overrides beside the plain runs."""
    from bench._train import read_records

    label = label or mode
    run_dir = tmp / f"ours-{label}-{seed}"
    overrides = [*args.overrides, *extra, f"run.seed={seed}", f"run.total_env_steps={args.steps}"]
    cmd = [sys.executable, "-m", "cluster.train", "--config", args.config,
           *(["--address", "inprocess"] if mode == "inprocess" else []),
           *[a for o in overrides for a in ("--set", o)], "--run-dir", str(run_dir)]
    p = timed_process(cmd, tmp / f"ours-{label}-{seed}", args.max_seconds, watch=run_dir / "metrics.jsonl")
    records = read_records(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    crashed = not p["timed_out"] and (p["rc"] != 0 or not records)
    out = {"system": f"ours {label}", "seconds": p["wall_s"], "stopped": p["timed_out"], "crashed": crashed,
           "error": _tail(p["stderr"]) if crashed else None, "env_steps": None, "learning_steps_per_s": None}
    if records:
        last, first = records[-1], records[0]
        span = last["time_s"] - first["time_s"]
        shares = {k.split("/", 1)[1]: float(np.mean([r[k] for r in records[1:] or records]))
                  for k in last if k.startswith("rollout_share/")}
        from cluster import config as config_mod

        # learner_update_s: one learner's update of one iteration, its batch (batch_size / num_learners samples, one
        # per env step) over every epoch.
        per_learner = config_mod.load(args.config, overrides).learner
        batch = per_learner.batch_size // per_learner.num_learners
        upd = [r["learner_update_s"] / batch for r in records[1:] or records if r.get("learner_update_s")]
        out.update(env_steps=last["env_steps"],
                   learning_steps_per_s=(last["env_steps"] - first["env_steps"]) / span if span > 0 else None,
                   rollout_shares=shares, update_ms_per_sample=1000 * float(np.median(upd)) if upd else None,
                   curve=[(r["env_steps"], r["episode_return_mean"]) for r in records
                          if r.get("episode_return_mean") is not None])
    return out


#: Env steps of one iteration (8 envs x 128 steps, both sides): a curve has a point at least this often, so one that
#: ends further than this before a mark was stopped before it and has no return there.
ITERATION_STEPS = ZOO_ATARI["n_envs"] * ZOO_ATARI["n_steps"]


def _at(curve: list, step: int):
    """The curve's return at its last point at or before ``step`` env steps; None before its first episode or where
    the run was stopped short of ``step``."""
    before = [r for s, r in curve if s <= step]
    if not before or curve[-1][0] < step - ITERATION_STEPS:
        return None
    return before[-1]


def curves(rounds: list[dict], systems: list[str], steps: int) -> None:
    """Return against env steps at equal env steps: each system and seed, then ours minus SB3 (mean over seeds)
    beside the seed-to-seed spread of SB3 itself: the noise that a difference is measured against."""
    marks = list(range(CURVE_EVERY, steps + 1, CURVE_EVERY)) or [steps]
    names = [s for s in systems if s != "sf"]
    columns = [("env steps", ">10")] + [(f"{n} seed {i}", ">12") for n in names for i in range(len(rounds))]
    rows = []
    for m in marks:
        rows.append([f"{m:,}"] + [_fmt(_at(res[n].get("curve", []), m)) for n in names for res in rounds])
    print("\nreturn (mean of the last 100 episodes) at equal env steps")
    table(columns, rows, rule=True)
    for n in [s for s in names if s != "sb3"]:
        if "sb3" not in names:
            break
        for m in marks:
            ours = [_at(res[n].get("curve", []), m) for res in rounds]
            sb3 = [_at(res["sb3"].get("curve", []), m) for res in rounds]
            if None in ours or None in sb3:
                continue
            print(f"  {n} - sb3 at {m:,}: {np.mean(ours) - np.mean(sb3):+.1f} (SB3 seeds span "
                  f"{max(sb3) - min(sb3):.1f}, ours {max(ours) - min(ours):.1f})")


def run_line(r: int, res: dict) -> str:
    """One whole process's line: its seconds, env steps and rates, and for ours its rollout shares and update."""
    if res.get("stopped"):
        return (f"  round {r} {res['system']:<14}: stopped at --max-seconds ({res['seconds']:.0f} s), its return "
                f"curve kept to {res['curve'][-1][0] if res.get('curve') else 0:,} env steps")
    line = (f"  round {r} {res['system']:<14}: "
            + ("CRASHED | " + str(res["error"]) if res["crashed"] else
               f"{res['seconds']:.1f} s whole process, {res['env_steps']:,} env steps, "
               f"{res['ms_per_env_step']:.2f} ms/env step, "
               + (f"{res['learning_steps_per_s']:,.0f} env steps/s while learning"
                  if res["learning_steps_per_s"] else "-")))
    if res.get("rollout_shares"):
        shares = ", ".join(f"{k} {v:.0%}" for k, v in res["rollout_shares"].items() if v >= 0.005)
        line += f" | rollout shares {shares}"
        if res["update_ms_per_sample"]:
            line += f" | update {res['update_ms_per_sample']:.3f} ms/env step"
    return line


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def _json_lines(text: str) -> list[dict]:
    """The JSON objects among a child's output lines, in order (its other lines, e.g. warnings, left out)."""
    out = []
    for line in text.splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict):
            out.append(d)
    return out


# ------------------------------------------------------------------ the parent
def main() -> int:
    p = parser(__doc__, config="configs/atari_pong.yaml", overrides="override our config (key=value)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of whole processes, order rotating by round")
    p.add_argument("--steps", type=int, default=18_432, help="env steps each whole process trains for")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--stages", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the stages in this process")
    p.add_argument("--stage-reps", type=int, default=3)
    p.add_argument("--max-seconds", type=float, default=600.0, help="cap on each whole process (stopped past it)")
    p.add_argument("--sb3-threads", type=int, default=0, help="torch threads for SB3 (0: torch's default)")
    p.add_argument("--sf-python", type=Path, default=SF_PYTHON, help="the Python of Sample Factory's environment")
    p.add_argument("--sf-workers", type=int, default=8,
                   help="SF rollout worker processes, the 8 envs split over them (its Atari setting: 8 of 1 env)")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL:MODE:key=value[,key=value]",
                   help="ours with more overrides as one more system in the rotation (MODE inprocess or ray), e.g. "
                        "bf16x2:inprocess:learner.torch_threads=2; its ratios are printed like the plain runs'")
    p.add_argument("--curves", action="store_true",
                   help="print each system's return (mean of the last 100 episodes) every 100k env steps, per round "
                        "(round r: seed r), and ours minus SB3 beside SB3's seed-to-seed spread")
    p.add_argument("--jobs", type=int, default=1,
                   help="whole processes run at once (with --curves only: processes side by side share the cores, "
                        "so their times are not compared and no ratio is printed; the return at equal env steps "
                        "does not depend on them)")
    p.add_argument("--curves-from", type=Path, metavar="FILE",
                   help="print the return curves of an earlier run's --out FILE and exit (nothing runs)")
    p.add_argument("--sb3-child", action="store_true", help="internal: be the SB3 process")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.sb3_child:
        return sb3_child(args.seed, args.steps, args.sb3_threads)
    if args.curves_from:
        earlier = json.loads(args.curves_from.read_text())
        names = list(dict.fromkeys(n for res in earlier["rounds"] for n in res))
        curves(earlier["rounds"], names, earlier["steps"])
        return 0
    if args.jobs < 1 or (args.jobs > 1 and not args.curves):
        p.error(f"--jobs {args.jobs}: 1, or more than 1 with --curves (processes run side by side are not timed)")

    from cluster import config as config_mod

    cfg = config_mod.load(args.config, args.overrides)
    systems = list(dict.fromkeys(args.systems))
    if "sb3" in systems and importlib.util.find_spec("stable_baselines3") is None:
        print("SB3 left out: not installed here (make bench-pong builds .venv-bench with it)", flush=True)
        systems.remove("sb3")
    if "sf" in systems and not args.sf_python.exists():
        print(f"Sample Factory left out: no {args.sf_python} (make bench-pong builds it)", flush=True)
        systems.remove("sf")
    load0 = _load()
    print(f"{_versions()} | {args.config} {' '.join(args.overrides)} | precision {cfg.learner.precision}, "
          f"learner torch threads {cfg.learner.torch_threads} | {args.steps:,} env steps a process, "
          f"{args.rounds} round(s) | load average {load0}", flush=True)
    figures = {"load_start": load0, "steps": args.steps, "config": args.config, "overrides": args.overrides}
    if args.stages:
        figures["stages"] = stages(cfg, args.stage_reps)

    runners = {"inprocess": lambda s, t: run_ours(args, s, t, "inprocess"),
               "ray": lambda s, t: run_ours(args, s, t, "ray"),
               "sb3": lambda s, t: run_sb3(args, s, t), "sf": lambda s, t: run_sf(args, s, t)}
    ours_systems = [s for s in systems if s in ("inprocess", "ray")]
    for v in args.variant:
        label, mode, sets = v.split(":", 2)
        if mode not in ("inprocess", "ray"):
            p.error(f"--variant {v}: MODE is inprocess or ray")
        runners[label] = (lambda s, t, label=label, mode=mode, extra=tuple(sets.split(",")):
                          run_ours(args, s, t, mode, label, extra))
        systems.append(label)
        ours_systems.append(label)
    rounds = [{} for _ in range(args.rounds)]
    runs = [(r, name) for r in range(args.rounds) for name in rotated(systems, r)]

    def run(r: int, name: str) -> None:
        res = runners[name](r, Path(tmp))
        res["ms_per_env_step"] = (1000 * res["seconds"] / res["env_steps"]) if res["env_steps"] else None
        rounds[r][name] = res
        print(run_line(r, res), flush=True)

    with tempfile.TemporaryDirectory(prefix="pong_") as tmp:
        if args.jobs == 1:
            for r, name in runs:
                run(r, name)
        else:
            with ThreadPoolExecutor(args.jobs) as pool:
                try:
                    for f in [pool.submit(run, r, name) for r, name in runs]:
                        f.result()
                except KeyboardInterrupt:
                    stop_all()  # the worker threads never see Ctrl-C: their processes are stopped from here
                    raise

    print()
    ratios = {}
    for ours in ours_systems if args.jobs == 1 else []:
        for peer, goal in (("sb3", SB3_RATIO_GOAL), ("sf", SF_RATIO_GOAL)):
            if peer not in systems:
                continue
            for key, label in (("ms_per_env_step", "whole process"), ("learning_steps_per_s", "while learning")):
                vals = []
                for res in rounds:
                    a, b = res[ours].get(key), res[peer].get(key)
                    whole = [res[n] for n in (ours, peer)]
                    if a and b and not any(x["crashed"] or x.get("stopped") for x in whole):
                        vals.append(a / b if key == "ms_per_env_step" else b / a)  # both as ours' time / peer's
                if vals:
                    med = float(np.median(vals))
                    ratios[f"{ours}/{peer} {label}"] = {"median": med, "range": [min(vals), max(vals)]}
                    verdict = ("met" if med <= goal else "not met") if key == "ms_per_env_step" else ""
                    print(f"time per env step ours {ours}/{peer} ({label}): {med:.2f} (range {min(vals):.2f}-"
                          f"{max(vals):.2f}, {len(vals)} rounds)"
                          + (f" | goal {'<=' if peer == 'sb3' else '<'} {goal:g}: {verdict}" if verdict else ""))
    if args.curves:
        curves(rounds, systems, args.steps)
    load1 = _load()
    print(f"load average at the start {load0}, at the end {load1}")
    figures.update(rounds=rounds, ratios=ratios, load_end=load1, versions=_versions())
    write_out(args.out, figures)
    crashed = [f"round {i} {n}" for i, res in enumerate(rounds) for n, x in res.items() if x["crashed"] and n != "sf"]
    if crashed:
        print(f"crashed: {', '.join(crashed)}", file=sys.stderr)
    return 1 if crashed else 0


if __name__ == "__main__":
    run_main(main)
