"""Memory, side by side: our recurrent PPO, our memoryless model, a 4-frame stack and sb3-contrib's RecurrentPPO.

The task is actors/probe_envs.py's CueRecall (delay 12): a cue on the first step, to be named 12 steps later;
+1 right, -1 wrong. A memoryless policy's expectation is exactly 0, the optimum 1; the target is a 100-episode
mean of 0.9. Each system runs as a whole process per seed, timed from outside (spawn to exit: interpreter,
imports, the final checkpoint), in an order that rotates by seed:

  gru        python -m cluster.train --config configs/cue_recall.yaml --address inprocess --set run.seed=S
  lstm       the same with --set learner.rnn=lstm
  memoryless the same with --set learner.rnn=null (the budget is --memoryless-steps env steps)
  stack4     memoryless, with gymnasium's FrameStackObservation(4) wrapper (sees 4 of the 13 steps)
  rppo       this file with --rppo-child: sb3_contrib.RecurrentPPO("MlpLstmPolicy") with rl-baselines3-zoo's tuned
             settings for its memory task (RPPO_KWARGS: 8 envs x 32 steps, 20 epochs, LSTM 64 for each of actor
             and critic, lr and clip falling linearly to 0 over --rppo-steps), stopped by a callback at the same
             rule (a full 100-episode window with mean >= 0.9).

Env steps to target are the first metrics record at the target (ours) and num_timesteps when the callback
stops (RecurrentPPO). Printed: a row per run, then per system the median and range over seeds, and the
ours/RecurrentPPO ratio of env steps for gru (the acceptance bound is <= 1.5). Exit 0 whatever the figures; 1
only when a run crashed.

    .venv/bin/python bench/memory.py [--task cue|minigrid] [--seeds 0 1 2] [--systems gru lstm memoryless ...]
                                     [--max-steps 200000] [--memoryless-steps 300000] [--rppo-steps 100000]
                                     [--out FILE]

RecurrentPPO is an optional extra (pip install -e '.[sb3]'); without it the rppo rows say so and the rest runs.

``--task minigrid``: MiniGrid-MemoryS7-v0 (configs/minigrid_memory.yaml: image + direction, a GRU over sequences
of 32 steps) against the memoryless model of the same config (--set learner.rnn=null), to a 0.9 success rate
over 200 episodes (a memoryless policy can only guess which object: about 0.5), --max-steps for both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import ROOT, parser, run_main, table, write_out  # noqa: E402

TARGET, WINDOW = 0.9, 100
ENV_ID = "actors.probe_envs:AscentRL/CueRecall-v0"
SYSTEMS = ("gru", "lstm", "memoryless", "stack4", "rppo")
#: task: (config, metric the target is on, its window, the systems that run it)
TASKS = {
    "cue": ("configs/cue_recall.yaml", "episode_return_mean", WINDOW, SYSTEMS),
    # MiniGrid-MemoryS7: success rate over 200 episodes, ours only (RecurrentPPO's CnnLstm on minigrid's 7x7x3
    # symbolic view needs a custom feature extractor; not run here).
    "minigrid": ("configs/minigrid_memory.yaml", "episode_success_rate", 200, ("gru", "memoryless")),
}
#: RecurrentPPO with rl-baselines3-zoo's tuned settings for its memory task (hyperparams/ppo_lstm.yml,
#: CartPoleNoVel-v1; learning_rate and clip_range there are linear schedules, lin_0.001 / lin_0.2, over its
#: n_timesteps 1e5: built as such below), without its VecNormalize (the cue env's observations are 0/1 already).
RPPO_ENVS = 8
RPPO_TIMESTEPS = 100_000
RPPO_KWARGS = dict(n_steps=32, batch_size=256, gae_lambda=0.98, gamma=0.999, n_epochs=20, ent_coef=0.0)


def ours(system: str, seed: int, max_steps: int, run_dir: Path, config: str) -> list[str]:
    sets = [f"run.seed={seed}", f"run.total_env_steps={max_steps}", "run.require_target=false"]
    if system == "lstm":
        sets.append("learner.rnn=lstm")
    if system in ("memoryless", "stack4"):
        sets.append("learner.rnn=null")
    if system == "stack4":
        sets.append('env.wrappers=[{path: "gymnasium.wrappers:FrameStackObservation", kwargs: {stack_size: 4}}]')
    cmd = [sys.executable, "-m", "cluster.train", "--config", str(ROOT / config),
           "--address", "inprocess", "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def ours_result(run_dir: Path, key: str, window: int) -> dict:
    from bench._train import first_at, read_records

    records = read_records(run_dir)
    hit = first_at(records, window, TARGET, key=key)
    return {"env_steps": hit["env_steps"] if hit else records[-1]["env_steps"], "reached": hit is not None,
            # The cost of one update (416 samples, 4 epochs of 4 minibatches): the model's price, median of the run.
            "update_ms": 1000 * float(np.median([r["learner_update_s"] for r in records])),
            "best": max((r[key] for r in records if r.get(key) is not None), default=float("nan"))}


def rppo_child(seed: int, max_steps: int) -> None:
    """Train RecurrentPPO to the target (or the budget); print one JSON line."""
    import gymnasium as gym
    import torch
    from sb3_contrib import RecurrentPPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    import actors.probe_envs  # noqa: F401

    torch.set_num_threads(1)  # as our actors and learner
    returns: list[float] = []

    class StopAtTarget(BaseCallback):
        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                if "episode" in info:
                    returns.append(float(info["episode"]["r"]))
            window = returns[-WINDOW:]
            return not (len(window) == WINDOW and np.mean(window) >= TARGET)

    env = make_vec_env(lambda: gym.make(ENV_ID.split(":")[1], delay=12), n_envs=RPPO_ENVS, seed=seed)
    horizon = max(max_steps, 1)

    def linear(start: float):
        return lambda progress_remaining: start * progress_remaining  # SB3 passes 1 -> 0 over learn()

    policy_kwargs = dict(ortho_init=False, activation_fn=torch.nn.ReLU, lstm_hidden_size=64, enable_critic_lstm=True,
                         net_arch=dict(pi=[64], vf=[64]))
    model = RecurrentPPO("MlpLstmPolicy", env, seed=seed, device="cpu", verbose=0, learning_rate=linear(1e-3),
                         clip_range=linear(0.2), policy_kwargs=policy_kwargs, **RPPO_KWARGS)
    model.learn(total_timesteps=horizon, callback=StopAtTarget())
    window = returns[-WINDOW:]
    print(json.dumps({"env_steps": int(model.num_timesteps), "reached": len(window) == WINDOW and
                      float(np.mean(window)) >= TARGET, "best": float(np.mean(window)) if window else float("nan")}))


def run_one(system: str, seed: int, args, tmp: Path) -> dict:
    config, key, window, _ = TASKS[args.task]
    run_dir = tmp / f"{system}-{seed}"
    if system == "rppo":
        try:
            import sb3_contrib  # noqa: F401
        except ImportError:
            return {"system": system, "seed": seed, "error": "sb3-contrib not installed (pip install -e '.[sb3]')"}
        cmd = [sys.executable, __file__, "--rppo-child", "--seeds", str(seed), "--max-steps", str(args.rppo_steps)]
    else:
        steps = (args.memoryless_steps if system in ("memoryless", "stack4") and args.task == "cue"
                 else args.max_steps)
        cmd = ours(system, seed, steps, run_dir, config)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.max_seconds)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"system": system, "seed": seed, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}
    result = (json.loads(proc.stdout.strip().splitlines()[-1]) if system == "rppo"
              else ours_result(run_dir, key, window))
    return {"system": system, "seed": seed, "seconds": seconds, **result}


def main() -> int:
    p = parser(__doc__, out="write the rows as JSON")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--task", default="cue", choices=list(TASKS))
    p.add_argument("--systems", nargs="+", default=None, choices=SYSTEMS, help="default: every system of the task")
    p.add_argument("--max-steps", type=int, default=200_000)
    p.add_argument("--memoryless-steps", type=int, default=300_000)
    p.add_argument("--rppo-steps", type=int, default=RPPO_TIMESTEPS, help="RecurrentPPO's learn() horizon (its "
                   "schedules run over it)")
    p.add_argument("--max-seconds", type=float, default=900)
    p.add_argument("--rppo-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rppo_child:
        rppo_child(args.seeds[0], args.max_steps)
        return 0
    args.systems = args.systems or list(TASKS[args.task][3])
    rows = []
    with tempfile.TemporaryDirectory(prefix="memory-bench-") as tmp:
        for i, seed in enumerate(args.seeds):
            order = args.systems[i % len(args.systems):] + args.systems[:i % len(args.systems)]
            for system in order:
                row = run_one(system, seed, args, Path(tmp))
                rows.append(row)
                if "error" in row:
                    print(f"{system} seed {seed}: {row['error']}", flush=True)
                else:
                    update = f"  update {row['update_ms']:.1f} ms" if "update_ms" in row else ""
                    print(f"{system:<10} seed {seed}: {'reached' if row['reached'] else 'not reached':<11} "
                          f"{row['env_steps']:>8,} env steps {row['seconds']:>7.1f} s  best mean {row['best']:.2f}"
                          f"{update}", flush=True)
    print()
    summary = []
    for system in args.systems:
        done = [r for r in rows if r["system"] == system and "error" not in r]
        if not done:
            continue
        steps = [r["env_steps"] for r in done]
        secs = [r["seconds"] for r in done]
        summary.append((system, f"{sum(r['reached'] for r in done)}/{len(done)}", f"{np.median(steps):,.0f}",
                        f"{min(steps):,}-{max(steps):,}", f"{np.median(secs):.1f}", f"{min(secs):.1f}-{max(secs):.1f}",
                        f"{np.median([r['best'] for r in done]):.2f}",
                        f"{np.median([r['update_ms'] for r in done]):.1f}" if "update_ms" in done[0] else "-"))
    table([("system", "<10"), ("reached", ">7"), ("env steps", ">10"), ("range", ">17"), ("seconds", ">8"),
           ("range", ">12"), ("best mean", ">9"), ("update ms", ">9")], summary, rule=True)
    by = {(r["system"], r["seed"]): r for r in rows if "error" not in r}
    ratios = [by["gru", s]["env_steps"] / by["rppo", s]["env_steps"] for s in args.seeds
              if ("gru", s) in by and ("rppo", s) in by and by["gru", s]["reached"] and by["rppo", s]["reached"]]
    if ratios:
        print(f"\ngru / RecurrentPPO env steps to {TARGET}: median {np.median(ratios):.2f}, range "
              f"{min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} seeds (bound: <= 1.5)")
    write_out(args.out, rows)
    return 1 if any("error" in r and "not installed" not in r["error"] for r in rows) else 0


if __name__ == "__main__":
    run_main(main)
