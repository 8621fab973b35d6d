"""env.backend: gymnasium against envpool, side by side: env steps/s of the rollouts' envs alone and while training.

For each task, both backends in one run, rounds interleaved (A, B, A, B): first the bare vector env the rollouts
step (``actors.envs.VectorEnv`` or ``actors.envpool_env.EnvPoolVectorEnv``, random actions, N envs, no policy),
then a short in-process training run of its config (``ray.address: inprocess``: no Ray start in the figure),
reporting the steady-state env steps/s (the median over the run's second half). The tasks: CartPole-v1
(configs/cartpole.yaml), Pong (configs/atari_pong.yaml: ALE with our wrappers, against EnvPool's Pong-v5 and its
own preprocessing: 84x84 grey, 4 stacked, frame skip 4) and Hopper (configs/hopper.yaml: gymnasium's MuJoCo
Hopper-v5 against EnvPool's). Needs the envpool, atari and mujoco extras.

    .venv/bin/python bench/env_backends.py [--tasks cartpole pong hopper] [--rounds 2] [--train-steps-scale 1.0]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import ROOT, cli, parser, table  # noqa: E402

# task -> (config, gymnasium overrides, envpool overrides, vector env id on each side, training env steps)
TASKS = {
    "cartpole": ("configs/cartpole.yaml", [], ["env.backend=envpool"], ("CartPole-v1", "CartPole-v1"), 60_000),
    "pong": ("configs/atari_pong.yaml", [], ["env.backend=envpool", "env.id=Pong-v5"],
             ("actors.wrapped_envs:AscentRL/Atari-Pong-v0", "Pong-v5"), 8_192),
    "hopper": ("configs/hopper.yaml", [], ["env.backend=envpool", "env.id=Hopper-v5"], ("Hopper-v5", "Hopper-v5"),
               16_384),
}


def vector_rate(env_id: str, backend: str, num_envs: int, seconds: float = 3.0) -> float:
    """Env steps/s of the rollouts' vector env alone, random actions."""
    import numpy as np

    from actors.envs import make_vector_env

    env = make_vector_env(env_id, num_envs, backend=backend)
    try:
        env.reset(0)
        space = env.single_action_space
        actions = np.stack([space.sample() for _ in range(num_envs)])
        steps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            env.step(actions)
            steps += num_envs
        return steps / (time.perf_counter() - t0)
    finally:
        env.close()


def training_rate(config: str, sets: list[str], env_steps: int) -> float:
    from bench._train import steady_state, train
    from cluster import config as config_mod

    cfg = config_mod.load(str(ROOT / config), [*sets, "ray.address=inprocess", f"run.total_env_steps={env_steps}",
                                               "run.target_return=null", "run.target_success_rate=null",
                                               "run.require_target=false", "run.checkpoint_interval_s=null"])
    with tempfile.TemporaryDirectory() as tmp:
        trained = train(cfg, Path(tmp) / "run")
    return steady_state(trained.records, "env_steps_per_s")


def make_parser():
    p = parser(__doc__)
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--train-steps-scale", type=float, default=1.0, help="multiplies each task's training env steps")
    return p


def run(args):
    from cluster import config as config_mod

    rows, figures = [], {}
    for task in args.tasks:
        config, gym_sets, pool_sets, (gym_id, pool_id), steps = TASKS[task]
        num_envs = config_mod.load(str(ROOT / config)).rollout.envs_per_actor
        bare = {"gymnasium": [], "envpool": []}
        trained = {"gymnasium": [], "envpool": []}
        for _ in range(args.rounds):  # interleaved: a drift in the machine's speed hits both sides alike
            for backend, env_id, sets in (("gymnasium", gym_id, gym_sets), ("envpool", pool_id, pool_sets)):
                bare[backend].append(vector_rate(env_id, backend, num_envs))
                trained[backend].append(training_rate(config, sets, int(steps * args.train_steps_scale)))
                print(f"{task} {backend}: vector env {bare[backend][-1]:,.0f} env steps/s, training "
                      f"{trained[backend][-1]:,.0f}", file=sys.stderr, flush=True)
        figures[task] = {"envs": num_envs, "vector env alone": bare, "while training": trained}
        for what, rates in (("vector env alone", bare), ("while training", trained)):
            g, e = rates["gymnasium"], rates["envpool"]
            rows.append((task, what, num_envs, f"{min(g):,.0f}-{max(g):,.0f}", f"{min(e):,.0f}-{max(e):,.0f}",
                         sum(e) / sum(g)))
    print()
    table([("task", "<9"), ("env steps/s", "<17"), ("envs", ">4"), ("gymnasium", ">15"), ("envpool", ">15"),
           ("envpool/gymnasium", ">17.2f")], rows, sep="  ", rule=True)
    print(f"\n{args.rounds} rounds each, interleaved; ranges over the rounds, the ratio of their sums.")
    return figures, None


if __name__ == "__main__":
    cli(make_parser, run)
