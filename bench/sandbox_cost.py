"""env.isolation: none against process, side by side: env steps/s of the rollouts' vector env, and the code env's
learning curve against a random policy.

The cost: for CartPole-v1, the multi-rate env (``actors.multirate_env:AscentRL/MultiRateSensor-v0``: Dict
observations with a text key, through the shared block like any other) and the code env
(``actors.code_env:AscentRL/Code-v0``), at 1 and several envs per actor, both isolations in one run with the rounds
interleaved (none, process with one env per child, process with every env in one child): the bare vector env the
rollouts step (``actors.envs.make_vector_env``, random actions, no policy), steps/s over ``--seconds``. The code env runs with ``hazards: false`` on every side
(its loop, grow, fork and write instructions compile to ``pass``: under ``none`` the bombs would take the host),
so both sides run the same programs and the ratio is the isolation's price alone; ``code+hazards`` runs the
hazardous programs under ``process`` only, beside the same ``none`` column, for what the programs that loop until
their time limit cost on top.

``--train``: the same comparison while training: configs/cartpole.yaml in process (``ray.address: inprocess``, 32
envs, a fixed number of env steps), none against process with one env per child and with every env in one child,
rounds interleaved; the runs' wall time and env steps/s.

``--learn``: configs/code.yaml trained in process (``ray.address: inprocess``), its 100-episode mean return per
iteration beside a random policy's mean over the same number of episodes.

    .venv/bin/python bench/sandbox_cost.py [--envs 1 8] [--seconds 3] [--rounds 2] [--tasks cartpole multirate code]
    .venv/bin/python bench/sandbox_cost.py --train [--rounds 2] [--set run.total_env_steps=100000]
    .venv/bin/python bench/sandbox_cost.py --learn [--set run.total_env_steps=100000]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import ROOT, cli, parser, table  # noqa: E402

CODE = "actors.code_env:AscentRL/Code-v0"
# task -> (env id, env kwargs under none, env kwargs under process)
TASKS = {
    "cartpole": ("CartPole-v1", {}, {}),
    "multirate": ("actors.multirate_env:AscentRL/MultiRateSensor-v0", {}, {}),
    "code": (CODE, {"hazards": False}, {"hazards": False}),
    "code+hazards": (CODE, {"hazards": False}, {}),
}
#: The limits of the process column: configs/code.yaml's (the defaults but memory, which the code env's programs
#: are capped at within).
LIMITS = {"memory_mb": 512, "cpu_s": 60, "processes": 16, "open_files": 64, "file_mb": 64, "step_timeout_s": 5.0}


def vector_rate(env_id: str, num_envs: int, kwargs: dict, isolation: dict | None, seconds: float) -> float:
    """Env steps/s of the rollouts' vector env alone, random actions (start-up not counted)."""
    import numpy as np

    from actors.envs import make_vector_env

    env = make_vector_env(env_id, num_envs, env_kwargs=kwargs, isolation=isolation)
    try:
        env.reset(0)
        space = env.single_action_space
        space.seed(0)
        steps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            env.step(np.stack([space.sample() for _ in range(num_envs)]))
            steps += num_envs
        return steps / (time.perf_counter() - t0)
    finally:
        env.close()


def random_code_return(episodes: int, kwargs: dict) -> float:
    """A uniform random policy's mean return on the code env over ``episodes`` (in a sandbox: its programs are
    the hazardous ones)."""
    import numpy as np

    from actors.envs import make_vector_env

    env = make_vector_env(CODE, 4, env_kwargs=kwargs, isolation={"limits": LIMITS})
    returns, ret = [], np.zeros(4)
    try:
        env.reset(0)
        rng = np.random.default_rng(0)
        while len(returns) < episodes:
            _, rew, term, trunc, _ = env.step(rng.integers(0, env.single_action_space.n, 4))
            ret += rew
            for i in np.flatnonzero(term | trunc):
                returns.append(float(ret[i]))
                ret[i] = 0.0
        return float(np.mean(returns[:episodes]))
    finally:
        env.close()


def learn(args):
    from bench._train import train
    from cluster import config as config_mod

    cfg = config_mod.load(str(ROOT / "configs/code.yaml"),
                          ["ray.address=inprocess", "run.checkpoint_interval_s=null", "run.require_target=false",
                           *args.overrides])
    with tempfile.TemporaryDirectory() as tmp:
        trained = train(cfg, Path(tmp) / "run")
    random_mean = random_code_return(100, dict(cfg.env.kwargs))
    records = trained.records
    rows = [(r["env_steps"], r["time_s"], r.get("episode_return_mean"), random_mean, r["env_failures"])
            for r in records[::max(1, len(records) // 15)] + records[-1:]]
    table([("env steps", ">9d"), ("s", ">7.1f"), ("PPO return", ">10.3f"), ("random", ">7.3f"),
           ("env failures", ">12d")], rows, sep="  ", rule=True)
    result = trained.result
    print(f"\n{'reached' if result.reached_target else 'did not reach'} run.target_return = "
          f"{cfg.run.target_return} ({result.episode_return_mean:.3f}) in {result.env_steps:,} env steps, "
          f"{result.wall_s:.0f} s; a random policy's mean over 100 episodes: {random_mean:.3f}")
    if records[-1]["env_failures"]:
        print(f"last env failure: {records[-1]['last_rollout_fault']}")
    return {"curve": rows, "random": random_mean, "reached": result.reached_target}, result.reached_target


def while_training(args):
    """configs/cartpole.yaml in process under none and process (one env per child, all in one), interleaved."""
    from bench._train import train
    from cluster import config as config_mod

    base = ["ray.address=inprocess", "run.checkpoint_interval_s=null", "run.require_target=false",
            "run.target_return=null", "run.total_env_steps=100000", *args.overrides]
    sides = {"none": [], "process": ["env.isolation=process"],
             "process all/child": ["env.isolation=process", "env.envs_per_child=4096"]}
    walls: dict = {side: [] for side in sides}
    rates: dict = {side: [] for side in sides}
    for _ in range(args.rounds):
        for side, extra in sides.items():
            cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), base + extra)
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                trained = train(cfg, Path(tmp) / "run", t_start=t0)
                walls[side].append(time.perf_counter() - t0)
            rates[side].append(trained.result.env_steps / walls[side][-1])
            print(f"{side}: {walls[side][-1]:.1f} s, {rates[side][-1]:,.0f} env steps/s", file=sys.stderr, flush=True)
    rows = [(side, f"{min(walls[side]):.1f}-{max(walls[side]):.1f}", f"{min(r):,.0f}-{max(r):,.0f}",
             sum(r) / sum(rates["none"])) for side, r in rates.items()]
    print()
    table([("isolation", "<18"), ("wall s", ">10"), ("env steps/s", ">15"), ("/none", ">6.2f")], rows, sep="  ",
          rule=True)
    print(f"\n{args.rounds} rounds, interleaved; env steps/s over each run's wall time (the actor graph's build "
          f"included).")
    return {"walls": walls, "rates": rates}, None


def make_parser():
    p = parser(__doc__, overrides="configs/code.yaml settings for --learn")
    p.add_argument("--tasks", nargs="+", default=["cartpole", "multirate", "code"], choices=list(TASKS))
    p.add_argument("--envs", type=int, nargs="+", default=[1, 8], help="envs per actor")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--learn", action="store_true", help="the code env's learning curve instead of the cost")
    p.add_argument("--train", action="store_true", help="the cost while training CartPole in process")
    return p


def run(args):
    if args.learn:
        return learn(args)
    if args.train:
        return while_training(args)
    rows, figures = [], {}
    for task in args.tasks:
        env_id, none_kwargs, process_kwargs = TASKS[task]
        for n in args.envs:
            sides = {"none": None, "process": {"limits": LIMITS, "envs_per_child": 1}}
            if n > 1:
                sides[f"process {n}/child"] = {"limits": LIMITS, "envs_per_child": n}
            rates = {side: [] for side in sides}
            for _ in range(args.rounds):  # interleaved: a drift in the machine's speed hits every side alike
                for side, isolation in sides.items():
                    kwargs = none_kwargs if isolation is None else process_kwargs
                    rates[side].append(vector_rate(env_id, n, kwargs, isolation, args.seconds))
                print(f"{task} x{n}: " + ", ".join(f"{side} {r[-1]:,.0f}" for side, r in rates.items())
                      + " env steps/s", file=sys.stderr, flush=True)
            figures[f"{task} x{n}"] = rates
            a = rates["none"]
            for side, b in rates.items():
                if side != "none":
                    per = n if "/child" in side else 1
                    rows.append((task, n, per, f"{min(a):,.0f}-{max(a):,.0f}", f"{min(b):,.0f}-{max(b):,.0f}",
                                 sum(b) / sum(a)))
    print()
    table([("env", "<12"), ("envs", ">4"), ("per child", ">9"), ("none steps/s", ">15"),
           ("process steps/s", ">15"), ("process/none", ">12.3f")], rows, sep="  ", rule=True)
    print(f"\n{args.rounds} rounds each, interleaved, {args.seconds:g} s a round; ranges over the rounds, the ratio "
          f"of their sums.")
    return figures, None


if __name__ == "__main__":
    cli(make_parser, run)
