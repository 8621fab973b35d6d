"""Ascent-RL against RLlib's PPO on CartPole, per seed, on one embedded Ray, printed as ratios.

For each seed, in alternating order: (a) Ascent-RL with configs/cartpole.yaml (our Trainer, in this process, as
bench/cartpole.py runs it) and (b) RLlib 2.60's PPO (new API stack) with the same hyperparameters, as far as
RLlib's config allows (everything ``rllib_config`` sets). Both stop at a 100-episode mean return of 475, at
run.total_env_steps (also both lr schedules' horizon), or after --max-seconds of training. Measured per seed:
seconds from the start of the build to the iteration where the target is first seen, env steps by then, env
steps/s; printed as ratios, then means over seeds. Ray starts once, so its start-up is excluded for both; only
the ratios from one run mean anything.

RLlib is a bench-only dependency: `ray[rllib]` pins an older gymnasium, so install the extra's other
requirements instead (measured that way; the import error names them).

    .venv/bin/python bench/rllib_compare.py [--seeds 0 1 2] [--max-seconds 300] [--set key=value ...]

Not matched, or matched another way (RLlib's config has no setting for them):
  - value clipping: ours follows ppo.clip_vloss (V clipped around the behaviour values, PPO2 / CleanRL, eps 0.2;
    off in configs/cartpole.yaml); RLlib's vf_clip_param clips the squared error itself, and is set to inf
    (unclipped MSE).
  - value-loss scale: ours is vf_coef * 0.5 * MSE, RLlib's vf_loss_coeff * MSE, so
    vf_loss_coeff = 0.5 * vf_coef (0.25): the same gradient.
  - Adam eps: RLlib builds torch.optim.Adam with torch's default 1e-8 (ours 1e-5).
  - advantage normalisation: RLlib per train batch (1024), ours per minibatch (512).
  - head init: RLlib's pi/vf output layers keep torch's default init (ours: orthogonal 0.01 / 1.0).
  - overlap: ours samples version v+1's data while update v runs (policy lag 1); RLlib's PPO
    samples, then updates (lag 0).
RLlib's stop criterion is the exact mean of the last 100 completed episodes, from a callback on the env runner:
in RLlib 2.60 `env_runners/episode_return_mean` is the mean over the current iteration's episodes only, whatever
metrics_num_episodes_for_smoothing says (it is printed alongside for reference).
"""

from __future__ import annotations

import collections
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from bench._common import cli, local_ray, parser, require, rotated  # noqa: E402
from bench._train import first_at, train  # noqa: E402
from cluster import config as config_mod  # noqa: E402

try:
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.callbacks.callbacks import RLlibCallback
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
    from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS, EPISODE_RETURN_MEAN, NUM_ENV_STEPS_SAMPLED_LIFETIME
except ImportError as e:  # pragma: no cover - depends on the optional extra
    sys.exit(f"bench/rllib_compare.py needs RLlib's requirements ({e}): .venv/bin/python -m pip install "
             "pandas 'tensorboardX>=1.9' 'pyarrow>=17.0.0' fsspec dm_tree lz4 'ormsgpack>=1.7.0' scipy "
             f"(or 'ray[rllib]=={ray.__version__}', which also pins its own gymnasium)")


class _EpisodeReturns(RLlibCallback):
    """Keeps every completed episode's full return on the env runner, for the driver to collect.

    RLlib cuts episodes into chunks at every sample() call; the earlier chunks of an episode
    arrive here as ``prev_episode_chunks`` (the same sum RLlib's own episode metrics use).
    """

    def on_episode_end(self, *, episode, env_runner=None, prev_episode_chunks=None, **kwargs):
        ret = episode.get_return() + sum(c.get_return() for c in (prev_episode_chunks or ()))
        env_runner.__dict__.setdefault("_bench_returns", []).append(float(ret))


def _pop_returns(env_runner) -> list[float]:
    return env_runner.__dict__.pop("_bench_returns", [])


def rllib_config(cfg, seed: int):
    """RLlib PPOConfig with our config's hyperparameters (see the module docstring for the gaps)."""
    L = cfg.learner.num_learners
    if cfg.learner.anneal_lr:
        lr = [[0, cfg.learner.lr], [cfg.run.total_env_steps, 0.0]]  # piecewise linear in env steps sampled
    else:
        lr = cfg.learner.lr
    env_config = {} if cfg.env.max_episode_steps is None else {"max_episode_steps": cfg.env.max_episode_steps}
    return (
        PPOConfig()
        .environment(cfg.env.id, env_config=env_config)
        .framework("torch")
        .env_runners(num_env_runners=cfg.rollout.num_actors, num_envs_per_env_runner=cfg.rollout.envs_per_actor,
                     rollout_fragment_length=cfg.rollout.fragment_length,
                     num_cpus_per_env_runner=cfg.rollout.num_cpus_per_actor, batch_mode="truncate_episodes")
        .learners(num_learners=0 if L == 1 else L, num_gpus_per_learner=0)
        .training(
            train_batch_size_per_learner=cfg.learner.batch_size // L, minibatch_size=cfg.learner.minibatch_size // L,
            num_epochs=cfg.ppo.update_epochs, lr=lr, gamma=cfg.ppo.gamma, lambda_=cfg.ppo.gae_lambda,
            clip_param=cfg.ppo.clip_coef,
            vf_loss_coeff=0.5 * cfg.ppo.vf_coef,  # ours: vf_coef * 0.5 * MSE
            vf_clip_param=float("inf"),  # RLlib clips the squared error, not V; no equivalent of ours
            entropy_coeff=cfg.ppo.ent_coef, grad_clip=cfg.ppo.max_grad_norm, grad_clip_by="global_norm",
            use_kl_loss=False, kl_coeff=0.0)
        .rl_module(model_config=DefaultModelConfig(
            fcnet_hiddens=list(cfg.learner.hidden_sizes), fcnet_activation="tanh", vf_share_layers=False,
            fcnet_kernel_initializer="orthogonal_", fcnet_kernel_initializer_kwargs={"gain": math.sqrt(2)},
            fcnet_bias_initializer="zeros_"))
        .callbacks(_EpisodeReturns)
        .reporting(metrics_num_episodes_for_smoothing=cfg.run.target_window)
        .debugging(seed=seed, log_level="ERROR")
    )


def run_ours(cfg, seed: int, tmp: Path) -> dict:
    result, records, build_s = train(cfg, tmp / f"ours-seed{seed}")
    # The clock stops at the first iteration whose record shows the target (a full window at or
    # above it), as for RLlib. result.wall_s and the last record can be later: the driver finishes
    # the iterations still in flight and writes a final checkpoint after it decides to stop.
    at = records[-1] if records else None
    if result.reached_target:
        at = first_at(records, cfg.run.target_window, cfg.run.target_return) or at
    return {"system": "ascent-rl", "seed": seed, "reached": result.reached_target, "stop": result.reason,
            "seconds": at["time_s"] if at else result.wall_s, "build_s": build_s,
            "env_steps": at["env_steps"] if at else result.env_steps,
            "return_mean": at["episode_return_mean"] if at else result.episode_return_mean,
            "iterations": at["iteration"] if at else result.iterations}


def run_rllib(cfg, seed: int, max_seconds: float) -> dict:
    config = rllib_config(cfg, seed)
    window: collections.deque[float] = collections.deque(maxlen=cfg.run.target_window)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.learner.torch_threads)  # the local learner runs in this process
    t0 = time.perf_counter()
    algo = config.build_algo()
    try:
        build_s = time.perf_counter() - t0
        iterations, env_steps, stop, rllib_metric = 0, 0, None, float("nan")
        while stop is None:
            r = algo.train()
            iterations += 1
            for rets in algo.env_runner_group.foreach_env_runner(_pop_returns, local_env_runner=False):
                window.extend(rets)
            env_steps = int(r.get(NUM_ENV_STEPS_SAMPLED_LIFETIME) or r[ENV_RUNNER_RESULTS][NUM_ENV_STEPS_SAMPLED_LIFETIME])
            rllib_metric = float(r[ENV_RUNNER_RESULTS].get(EPISODE_RETURN_MEAN, float("nan")))
            now = time.perf_counter()
            if len(window) == window.maxlen and np.mean(window) >= cfg.run.target_return:
                stop = "target_reached"
            elif env_steps >= cfg.run.total_env_steps:
                stop = "total_env_steps"
            elif now - t0 - build_s >= max_seconds:
                stop = "time_budget"
        seconds = now - t0
    finally:
        algo.stop()
        torch.set_num_threads(threads)
    return {"system": "rllib", "seed": seed, "reached": stop == "target_reached", "stop": stop,
            "seconds": seconds, "build_s": build_s, "env_steps": env_steps,
            "return_mean": float(np.mean(window)) if window else float("nan"), "iterations": iterations,
            "rllib_episode_return_mean": rllib_metric}


def _line(row: dict, target: float) -> str:
    sps = row["env_steps"] / max(row["seconds"], 1e-9)
    loop = row["env_steps"] / max(row["seconds"] - row["build_s"], 1e-9)
    status = f"reached {target:g}" if row["reached"] else f"MISSED {target:g} ({row['stop']})"
    extra = ""
    if "rllib_episode_return_mean" in row:
        extra = f" | RLlib's own episode_return_mean {row['rllib_episode_return_mean']:.1f} (this iteration's episodes)"
    return (f"seed {row['seed']} {row['system']:<9}: {status} | {row['seconds']:6.1f} s (build {row['build_s']:.1f} s) | "
            f"{row['env_steps']:>9,} env steps | {sps:>8,.0f} env steps/s ({loop:,.0f}/s after build) | "
            f"100-episode mean {row['return_mean']:.1f}{extra}")


def _ratio(num: float, den: float, bound: str = "") -> str:
    return f"{bound}{num / den:.2f}x" if den > 0 else "n/a"


def _ratios(ours: dict, rl: dict) -> tuple[dict, str]:
    """RLlib/ours for seconds and env steps, ours/RLlib for env steps/s; marks bounds when one side missed."""
    # A run that missed the target was stopped early: its seconds and env steps are lower bounds.
    bound = {(True, True): "", (True, False): ">=", (False, True): "<="}.get((ours["reached"], rl["reached"]))
    sps_o = ours["env_steps"] / ours["seconds"]
    sps_r = rl["env_steps"] / rl["seconds"]
    vals = {"seconds_rllib_over_ours": rl["seconds"] / ours["seconds"],
            "env_steps_rllib_over_ours": rl["env_steps"] / ours["env_steps"],
            "env_steps_per_s_ours_over_rllib": sps_o / sps_r,
            "to_target_bound": bound}
    if bound is None:
        to_target = "seconds and env steps to target n/a (neither reached it)"
    else:
        to_target = (f"seconds RLlib/ours {_ratio(rl['seconds'], ours['seconds'], bound)} | "
                     f"env steps RLlib/ours {_ratio(rl['env_steps'], ours['env_steps'], bound)}")
    return vals, f"{to_target} | env steps/s ours/RLlib {_ratio(sps_o, sps_r)}"


def make_parser():
    p = parser(__doc__, config="configs/cartpole.yaml", out="write per-seed results as JSON here",
               overrides="override our config (key=value); RLlib's config is derived from it")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--max-seconds", type=float, default=300.0,
                   help="wall-clock cap on each run's training loop (after its build), both systems")
    return p


def run(args):

    base = ["run.progress_interval_s=5", "run.require_target=false", f"run.time_budget_s={args.max_seconds}"]
    cfg0 = config_mod.load(args.config, base + args.overrides)
    require(cfg0.run.target_return is not None, "the config needs run.target_return")
    target = cfg0.run.target_return
    import gymnasium

    print(f"ray {ray.__version__} | torch {torch.__version__} | gymnasium {gymnasium.__version__} | "
          f"{cfg0.env.id}: target {target:g} over {cfg0.run.target_window} episodes, cap "
          f"{cfg0.run.total_env_steps:,} env steps / {args.max_seconds:g} s of training per run", flush=True)
    # One private Ray for both systems. Token authentication stays at Ray's default (on).
    rows, pairs = [], []
    with local_ray(4), tempfile.TemporaryDirectory() as tmp:
        for i, seed in enumerate(args.seeds):
            cfg = config_mod.load(args.config, base + args.overrides + [f"run.seed={seed}"])
            runners = [lambda: run_ours(cfg, seed, Path(tmp)), lambda: run_rllib(cfg, seed, args.max_seconds)]
            results = [f() for f in rotated(runners, i)]
            ours, rl = sorted(results, key=lambda r: r["system"] != "ascent-rl")
            vals, text = _ratios(ours, rl)
            rows += [ours, rl]
            pairs.append(vals)
            print(_line(ours, target), flush=True)
            print(_line(rl, target), flush=True)
            print(f"seed {seed} ratios   : {text}", flush=True)

    def mean(system: str, key) -> float:
        return float(np.mean([key(r) for r in rows if r["system"] == system]))

    print(f"summary over seeds {args.seeds}:")
    for system in ("ascent-rl", "rllib"):
        n_ok = sum(r["reached"] for r in rows if r["system"] == system)
        print(f"  {system:<9}: {n_ok}/{len(args.seeds)} reached {target:g} | mean {mean(system, lambda r: r['seconds']):.1f} s "
              f"| mean {mean(system, lambda r: r['env_steps']):,.0f} env steps "
              f"| mean {mean(system, lambda r: r['env_steps'] / r['seconds']):,.0f} env steps/s")
    both = [v for v in pairs if v["to_target_bound"] == ""]
    for key, label in (("seconds_rllib_over_ours", "seconds to target, RLlib/ours"),
                       ("env_steps_rllib_over_ours", "env steps to target, RLlib/ours"),
                       ("env_steps_per_s_ours_over_rllib", "env steps/s, ours/RLlib")):
        use = pairs if key == "env_steps_per_s_ours_over_rllib" else both
        if not use:
            print(f"  {label}: n/a (no seed where both reached {target:g})")
            continue
        vals = [v[key] for v in use]
        gmean = float(np.exp(np.mean(np.log(vals))))
        print(f"  {label}: geometric mean {gmean:.2f}x (per seed {', '.join(f'{x:.2f}' for x in vals)}"
              f"{'' if len(use) == len(pairs) else f'; only the {len(use)} seeds where both reached the target'})")
    return {"runs": rows, "ratios": pairs}, None


if __name__ == "__main__":
    cli(make_parser, run)
