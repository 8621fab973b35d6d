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

    .venv/bin/python bench/memory.py [--task cue|minigrid|minigrid-cue] [--seeds 0 1 2]
                                     [--systems gru lstm memoryless ...]
                                     [--max-steps 200000] [--memoryless-steps 300000] [--rppo-steps 100000]
                                     [--out FILE]

RecurrentPPO is an optional extra (pip install -e '.[sb3]'); without it the rppo rows say so and the rest runs.

``--task minigrid``: MiniGrid-MemoryS7-v0 with a 3x3 view and three actions (configs/minigrid_memory.yaml: the
view + direction, a GRU over 64-step sequences; the LSTM; the memoryless model of the same config, --set
learner.rnn=null) and RecurrentPPO's MlpLstm on the same observations flattened (the ids one-hot as the config's
categories make them; the config's envs, minibatch, lr, epochs, entropy and widths, 128 steps per env: there are no
tuned settings for this task), to a 0.9 success rate over 200 episodes (a
memoryless policy can only guess which object: about 0.5), --max-steps for ours, --rppo-steps for RecurrentPPO.
It first prints what the agent sees from the junction with the default 7x7 view and with 3x3: with 7x7 the cue and
both objects are in one view, so the default task does not need memory.

``--task minigrid-cue``: the same, with the agent always starting where the cue is in view
(actors.wrapped_envs.MemoryCueInView): the remembering half of the task without the walking-back-to-look half.
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

from bench._common import ROOT, cli, parser, rotated, sb3_linear, sb3_stop_at_target, spread, table  # noqa: E402

TARGET, WINDOW = 0.9, 100
ENV_ID = "actors.probe_envs:AscentRL/CueRecall-v0"
SYSTEMS = ("gru", "lstm", "memoryless", "stack4", "rppo")
#: minigrid-cue: MiniGrid-MemoryS7 with the agent always starting with the cue in view (the remembering half), at
#: the entropy it was measured with (0.01: with nothing to explore for, the config's 0.03 is not needed).
CUE_IN_VIEW = ('env.wrappers=[{path: "actors.wrapped_envs:MemoryCueInView"}, '
               '{path: "actors.wrapped_envs:FirstActions", kwargs: {n: 3}}]', "ppo.ent_coef=0.01")
#: task: (config, metric the target is on, its window, the systems that run it, --set overrides of the config)
TASKS = {
    "cue": ("configs/cue_recall.yaml", "episode_return_mean", WINDOW, SYSTEMS, ()),
    # MiniGrid-MemoryS7 (3x3 view): success rate over 200 episodes.
    "minigrid": ("configs/minigrid_memory.yaml", "episode_success_rate", 200, ("gru", "lstm", "memoryless", "rppo"),
                 ()),
    "minigrid-cue": ("configs/minigrid_memory.yaml", "episode_success_rate", 200, ("gru", "memoryless", "rppo"),
                     CUE_IN_VIEW),
}
#: RecurrentPPO with rl-baselines3-zoo's tuned settings for its memory task (hyperparams/ppo_lstm.yml,
#: CartPoleNoVel-v1; learning_rate and clip_range there are linear schedules, lin_0.001 / lin_0.2, over its
#: n_timesteps 1e5: built as such below), without its VecNormalize (the cue env's observations are 0/1 already).
RPPO_ENVS = 8
RPPO_TIMESTEPS = 100_000
RPPO_KWARGS = dict(n_steps=32, batch_size=256, gae_lambda=0.98, gamma=0.999, n_epochs=20, ent_coef=0.0)


def ours(system: str, seed: int, max_steps: int, run_dir: Path, config: str, overrides=()) -> list[str]:
    sets = [f"run.seed={seed}", f"run.total_env_steps={max_steps}", "run.require_target=false", *overrides]
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
            # Over full windows only: the first records' windows hold a handful of episodes (2 of 3 is 0.67).
            "best": max((r[key] for r in records if r.get(key) is not None
                         and r.get("episodes_in_window", window) >= window), default=float("nan")),
            # The run's last window: the best of hundreds of overlapping windows of a coin flip is well above 0.5.
            "last": next((r[key] for r in reversed(records) if r.get(key) is not None), float("nan"))}


def minigrid_memory_env(categories: tuple, cue_in_view: bool = False):
    """configs/minigrid_memory.yaml's env for SB3: the 3x3 view, three actions, and the observation our model
    gets: each cell's object, colour and state ids one-hot (``categories``, the config's), then the direction
    one-hot, in one flat vector."""
    import gymnasium as gym
    import minigrid  # noqa: F401  (registers the ids)

    from actors.wrapped_envs import FirstActions, MemoryCueInView

    eyes = [np.eye(n, dtype=np.float32) for n in categories]
    env = gym.make("MiniGrid-MemoryS7-v0", agent_view_size=3)
    env = FirstActions(MemoryCueInView(env) if cue_in_view else env, n=3)
    cells = int(np.prod(env.observation_space["image"].shape[:2]))
    space = gym.spaces.Box(0, 1, (cells * sum(categories) + 4,), np.float32)

    def one_hot(obs):
        view = obs["image"].reshape(cells, len(eyes))
        return np.concatenate([np.concatenate([eye[view[:, c]] for c, eye in enumerate(eyes)], axis=1).ravel(),
                               np.eye(4, dtype=np.float32)[obs["direction"]]])

    return gym.wrappers.TransformObservation(env, one_hot, space)


def rppo_child(seed: int, max_steps: int, task: str) -> None:
    """Train RecurrentPPO to the target (or the budget); print one JSON line."""
    import gymnasium as gym
    import torch
    from sb3_contrib import RecurrentPPO
    from stable_baselines3.common.env_util import make_vec_env

    import actors.probe_envs  # noqa: F401

    torch.set_num_threads(1)  # as our actors and learner
    # The cue task's target is on the mean return, minigrid's on the success rate (a return above 0).
    score, window_n = (np.mean, WINDOW) if task == "cue" else ((lambda w: np.mean(np.asarray(w) > 0)), 200)
    callback = sb3_stop_at_target(window_n, TARGET, score)

    horizon = max(max_steps, 1)
    if task.startswith("minigrid"):  # settings from configs/minigrid_memory.yaml (no tuned ones exist for this task)
        from cluster import config as config_mod

        cfg = config_mod.load(str(ROOT / TASKS[task][0]), list(TASKS[task][4]))  # the task's overrides too
        env = make_vec_env(minigrid_memory_env, n_envs=cfg.rollout.envs_per_actor, seed=seed,
                           env_kwargs={"categories": cfg.env.modalities["image"].categories,
                                       "cue_in_view": task == "minigrid-cue"})
        width = list(cfg.learner.hidden_sizes)
        model = RecurrentPPO("MlpLstmPolicy", env, seed=seed, device="cpu", verbose=0, n_steps=128,
                             batch_size=cfg.learner.minibatch_size, n_epochs=cfg.ppo.update_epochs,
                             learning_rate=cfg.learner.lr, ent_coef=cfg.ppo.ent_coef, gamma=cfg.ppo.gamma,
                             gae_lambda=cfg.ppo.gae_lambda, policy_kwargs=dict(
                                 lstm_hidden_size=cfg.learner.rnn_hidden_size, net_arch=dict(pi=width, vf=width)))
    else:
        env = make_vec_env(lambda: gym.make(ENV_ID.split(":")[1], delay=12), n_envs=RPPO_ENVS, seed=seed)

        policy_kwargs = dict(ortho_init=False, activation_fn=torch.nn.ReLU, lstm_hidden_size=64,
                             enable_critic_lstm=True, net_arch=dict(pi=[64], vf=[64]))
        model = RecurrentPPO("MlpLstmPolicy", env, seed=seed, device="cpu", verbose=0, learning_rate=sb3_linear(1e-3),
                             clip_range=sb3_linear(0.2), policy_kwargs=policy_kwargs, **RPPO_KWARGS)
    model.learn(total_timesteps=horizon, callback=callback)
    returns = callback.returns
    window = returns[-window_n:]
    if task.startswith("minigrid"):  # the best window of the run (every 50 episodes), as ours report it
        best = max((float(score(returns[i - window_n:i])) for i in range(window_n, len(returns) + 1, 50)),
                   default=float("nan"))
    else:  # the last window (the run stops at the target)
        best = float(score(window)) if window else float("nan")
    print(json.dumps({"env_steps": int(model.num_timesteps),
                      "reached": len(window) == window_n and float(score(window)) >= TARGET, "best": best,
                      "last": float(score(window)) if window else float("nan")}))


def minigrid_view_check(view_sizes=(7, 3)) -> list[tuple]:
    """What the agent of MiniGrid-MemoryS7 sees from the junction (5, 3), looking back west, with minigrid's own
    visibility mask: the cue (1, 2) and the two candidate objects (5, 1) and (5, 5). Where all three are visible in
    one view, a memoryless policy can pick the right object from that view, so the task does not need memory."""
    import gymnasium as gym
    import minigrid  # noqa: F401  (registers the ids)

    rows = []
    for view in view_sizes:
        env = gym.make("MiniGrid-MemoryS7-v0", agent_view_size=view)
        env.reset(seed=0)
        u = env.unwrapped
        u.agent_pos, u.agent_dir = np.array((5, 3)), 2  # at the junction, facing west (back down the hallway)
        _, vis = u.gen_obs_grid()

        def seen(x, y):
            vx, vy = u.get_view_coords(x, y)
            return bool(0 <= vx < view and 0 <= vy < view and vis[vx, vy])

        rows.append((view, seen(1, 2), seen(5, 1) and seen(5, 5)))
        env.close()
    return rows


def run_one(system: str, seed: int, args, tmp: Path) -> dict:
    config, key, window, _, overrides = TASKS[args.task]
    run_dir = tmp / f"{system}-{seed}"
    if system == "rppo":
        try:
            import sb3_contrib  # noqa: F401
        except ImportError:
            return {"system": system, "seed": seed, "error": "sb3-contrib not installed (pip install -e '.[sb3]')"}
        cmd = [sys.executable, __file__, "--rppo-child", "--seeds", str(seed), "--max-steps", str(args.rppo_steps),
               "--task", args.task]
    else:
        steps = args.memoryless_steps if system in ("memoryless", "stack4") else args.max_steps
        cmd = ours(system, seed, steps, run_dir, config, overrides)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.max_seconds)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"system": system, "seed": seed, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}
    result = (json.loads(proc.stdout.strip().splitlines()[-1]) if system == "rppo"
              else ours_result(run_dir, key, window))
    return {"system": system, "seed": seed, "seconds": seconds, **result}


def make_parser():
    p = parser(__doc__, out="write the rows as JSON", seeds=[0, 1, 2])
    p.add_argument("--task", default="cue", choices=list(TASKS))
    p.add_argument("--systems", nargs="+", default=None, choices=SYSTEMS, help="default: every system of the task")
    p.add_argument("--max-steps", type=int, default=200_000)
    p.add_argument("--memoryless-steps", type=int, default=300_000)
    p.add_argument("--rppo-steps", type=int, default=RPPO_TIMESTEPS, help="RecurrentPPO's learn() horizon (its "
                   "schedules run over it)")
    p.add_argument("--max-seconds", type=float, default=900)
    p.add_argument("--rppo-child", action="store_true", help=argparse.SUPPRESS)
    return p


def run(args) -> tuple[list, bool | None]:
    if args.rppo_child:
        rppo_child(args.seeds[0], args.max_steps, args.task)
        return [], None
    args.systems = args.systems or list(TASKS[args.task][3])
    if args.task.startswith("minigrid"):
        print("MiniGrid-MemoryS7 from the junction, facing back west (minigrid's visibility mask):")
        table([("view", ">4"), ("cue seen", ">9"), ("both objects seen", ">18")],
              [(v, str(c), str(o)) for v, c, o in minigrid_view_check()])
        print()
    rows = []
    with tempfile.TemporaryDirectory(prefix="memory-bench-") as tmp:
        for i, seed in enumerate(args.seeds):
            for system in rotated(args.systems, i):
                row = run_one(system, seed, args, Path(tmp))
                rows.append(row)
                if "error" in row:
                    print(f"{system} seed {seed}: {row['error']}", flush=True)
                else:
                    update = f"  update {row['update_ms']:.1f} ms" if "update_ms" in row else ""
                    print(f"{system:<10} seed {seed}: {'reached' if row['reached'] else 'not reached':<11} "
                          f"{row['env_steps']:>8,} env steps {row['seconds']:>7.1f} s  best mean {row['best']:.2f}"
                          f"  last {row['last']:.2f}{update}", flush=True)
    print()
    summary = []
    for system in args.systems:
        done = [r for r in rows if r["system"] == system and "error" not in r]
        if done:
            summary.append((system, f"{sum(r['reached'] for r in done)}/{len(done)}",
                            *spread([r["env_steps"] for r in done]), *spread([r["seconds"] for r in done], ".1f"),
                            spread([r["best"] for r in done], ".2f")[0], spread([r["last"] for r in done], ".2f")[1],
                            spread([r["update_ms"] for r in done], ".1f")[0] if "update_ms" in done[0] else "-"))
    table([("system", "<10"), ("reached", ">7"), ("env steps", ">10"), ("range", ">17"), ("seconds", ">8"),
           ("range", ">12"), ("best mean", ">9"), ("last", ">11"), ("update ms", ">9")], summary, rule=True)
    by = {(r["system"], r["seed"]): r for r in rows if "error" not in r}
    ratios = [by["gru", s]["env_steps"] / by["rppo", s]["env_steps"] for s in args.seeds
              if ("gru", s) in by and ("rppo", s) in by and by["gru", s]["reached"] and by["rppo", s]["reached"]]
    if ratios:
        print(f"\ngru / RecurrentPPO env steps to {TARGET}: median %s, range %s over {len(ratios)} seeds "
              "(bound: <= 1.5)" % spread(ratios, ".2f"))
    return rows, not any("error" in r and "not installed" not in r["error"] for r in rows)


if __name__ == "__main__":
    cli(make_parser, run)
