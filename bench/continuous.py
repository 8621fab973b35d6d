"""Continuous control: learning curves of the given configs over seeds, next to CleanRL's continuous PPO.

Trains each config once per seed on one embedded Ray and prints, per config, the mean training-episode return
(``episode_return_mean``: the last ``run.target_window`` finished episodes, in the env's own reward units) at fixed
env-step checkpoints, one column per seed, beside CleanRL's ppo_continuous_action.py figures at the same steps
(``CLEANRL`` below, with their sources). Then per seed: env steps/s, wall time and the deterministic return of the
final policy over ``--eval-episodes`` episodes (``cluster.api.load_policy`` + ``cluster.evaluate``).

    .venv/bin/python bench/continuous.py --configs configs/pendulum.yaml --seeds 0 1
    .venv/bin/python bench/continuous.py --configs configs/hopper.yaml --seeds 0 [--every 50000] [--set k=v] [--out F]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench._common import cli, parser, table  # noqa: E402
from bench._train import train_all  # noqa: E402
from cluster import config as config_mod  # noqa: E402

# CleanRL's published ppo_continuous_action.py results (its defaults: 1 env x 2048 steps, 10 epochs x 32
# minibatches, lr 3e-4 annealed, gamma 0.99, lambda 0.95, obs/reward normalisation). CleanRL logs the return of
# every training episode; its tables are the end-of-training average over seeds, its curves are plots only, so the
# intermediate values below are read off the plotted mean curve ("~", about +-100 for Hopper, +-50 for Pendulum).
CLEANRL = {
    # https://docs.cleanrl.dev/rl-algorithms/rpo/ (tab "Gym(Gymnasium)"; repo docs/rl-algorithms/rpo.md and
    # docs/rl-algorithms/rpo/gym.png): ppo_continuous_action_8M, 8M steps, 10 seeds, "Pendulum-v1 -1141.98 ± 135.55";
    # the plotted curve stays flat at about -1,100 over the whole 8M steps (default PPO does not learn Pendulum).
    "Pendulum-v1": {"source": "docs.cleanrl.dev/rl-algorithms/rpo/ (ppo_continuous_action_8M, 10 seeds)",
                    "final": (8_000_000, "-1141.98 ± 135.55"),
                    "curve": {s: "~-1100" for s in range(50_000, 1_000_001, 50_000)}},
    # https://docs.cleanrl.dev/rl-algorithms/ppo/#ppo_continuous_actionpy (repo docs/benchmark/ppo_continuous_action.md,
    # tag pr-424, 1M steps, 3 seeds): "Hopper-v4 2382.86 ± 271.74". The curve: the same page's v2-vs-v4 plot
    # (repo docs/rl-algorithms/ppo/ppo_continuous_action_v2_vs_v4.png, gymnasium Hopper-v4 line). Hopper-v4 there,
    # v5 here: the same model, observation and reward, except that v5 pays the healthy reward only while healthy
    # (v4 also paid it on the step that terminates the episode), i.e. at most 1 per episode.
    "Hopper-v5": {"source": "docs.cleanrl.dev/rl-algorithms/ppo/#ppo_continuous_actionpy (Hopper-v4, pr-424, 3 seeds)",
                  "final": (1_000_000, "2382.86 ± 271.74"),
                  "curve": {50_000: "~350", 100_000: "~850", 150_000: "~1200", 200_000: "~1300", 250_000: "~1600",
                            300_000: "~1700", 400_000: "~2000", 500_000: "~2000", 600_000: "~2000",
                            800_000: "~2300", 1_000_000: "~2400"}},
}


def at_step(records: list[dict], step: int) -> float | None:
    """``episode_return_mean`` of the first record at or past ``step`` env steps (None if the run stopped before)."""
    for r in records:
        if r["env_steps"] >= step:
            return r["episode_return_mean"]
    return None


def cleanrl_at(env_id: str, step: int) -> str:
    ref = CLEANRL.get(env_id)
    if ref is None:
        return "not published"
    if step == ref["final"][0]:
        return ref["final"][1]
    return ref["curve"].get(step, "-")


def make_parser():
    p = parser(__doc__, overrides="key=value for every config and seed", out="write curves and finals as JSON here",
               seeds=[0, 1])
    p.add_argument("--configs", nargs="+", default=["configs/pendulum.yaml"])
    p.add_argument("--every", type=int, default=50_000, help="env steps between curve checkpoints")
    p.add_argument("--eval-episodes", type=int, default=10, help="deterministic episodes of each final policy")
    return p


def run(args) -> tuple[list, None]:
    base = ["run.progress_interval_s=30", "run.require_target=false"] + args.overrides
    out, runs = [], {path: [] for path in args.configs}
    for (path, seed), cfg, (result, records, _) in train_all(
            ((path, seed), config_mod.load(path, base + [f"run.seed={seed}"]))
            for path in args.configs for seed in args.seeds):
        runs[path].append({"seed": seed, "records": records, "result": result,
                           "eval": final_eval(result.run_dir, args.eval_episodes)})
        print(f"{cfg.env.id} seed {seed}: {result.env_steps:,} env steps in {result.wall_s:.0f} s, "
              f"final mean {result.episode_return_mean:.1f}", flush=True)
        if len(runs[path]) == len(args.seeds):  # the config's last seed: its curves
            out.append(report(path, cfg, runs[path], args.every))
    return out, None


def final_eval(run_dir: Path, episodes: int) -> dict | None:
    if episodes <= 0:
        return None
    from cluster.api import load_policy
    from cluster.evaluate import evaluate

    # A run this bench just trained from its own --configs: its stored config is ours to trust.
    stats = evaluate(load_policy(run_dir, trust_code=True), episodes, deterministic=True)
    return {k: stats[k] for k in ("return_mean", "return_std", "length_mean")}


def report(path: str, cfg, runs: list[dict], every: int) -> dict:
    env_id, total = cfg.env.id, cfg.run.total_env_steps
    steps = list(range(every, total + 1, every))
    print(f"\n{env_id} ({path}): episode_return_mean (last {cfg.run.target_window} training episodes) at env steps")
    columns = [("env steps", ">10")] + [(f"seed {r['seed']}", ">9.1f") for r in runs] + [("CleanRL", ">18")]
    curves = {r["seed"]: [at_step(r["records"], s) for s in steps] for r in runs}
    rows = []
    for i, s in enumerate(steps):
        vals = [curves[r["seed"]][i] for r in runs]
        rows.append([f"{s:,}"] + [("-" if v is None else v) for v in vals] + [cleanrl_at(env_id, s)])
    table(columns, rows)
    ref = CLEANRL.get(env_id)
    if ref is not None:
        print(f"CleanRL at {ref['final'][0]:,} steps: {ref['final'][1]} ({ref['source']}; '~' = read off its plot)")
    finals = []
    for r in runs:
        res, ev = r["result"], r["eval"]
        train_s = r["records"][-1]["train_time_s"] if r["records"] else float("nan")
        finals.append({"seed": r["seed"], "env_steps": res.env_steps, "wall_s": res.wall_s,
                       "env_steps_per_s": res.env_steps / max(train_s, 1e-9),
                       "return_mean": res.episode_return_mean, "eval": ev})
        ev_txt = "" if ev is None else f" | deterministic {ev['return_mean']:.1f} ± {ev['return_std']:.1f}"
        print(f"  seed {r['seed']}: final {res.episode_return_mean:.1f} after {res.env_steps:,} env steps, "
              f"{res.wall_s:.0f} s, {finals[-1]['env_steps_per_s']:,.0f} env steps/s{ev_txt}")
    last = [f["return_mean"] for f in finals]
    print(f"  range over seeds: {min(last):.1f} .. {max(last):.1f} (mean {np.mean(last):.1f})")
    return {"config": path, "env": env_id, "steps": steps, "curves": curves, "finals": finals,
            "cleanrl": {str(s): cleanrl_at(env_id, s) for s in steps}}


if __name__ == "__main__":
    cli(make_parser, run)
