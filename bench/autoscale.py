"""Rollout autoscaling: a fixed rollout actor count against ``rollout.num_actors: auto``, side by side, one run each.

Both runs train the same config (default: the schema defaults on MountainCarContinuous-v0, the issue's host-bound
example) for the same wall-clock budget on one embedded Ray, the fixed run first. For each it prints env steps/s
over the run and over its second half, the learners' host-bound fraction (median of the second half), the rollout
actors at the end and every change the autoscaler asked for, then the auto/fixed ratio of second-half env steps/s.
The gain needs free cores: on a 2-core machine a new actor has no core of its own, so run it where the cores exist
(bench/device_check.sh's host, or any many-core machine).

    .venv/bin/python bench/autoscale.py [--env MountainCarContinuous-v0] [--seconds 60] [--fixed 1]
                                        [--max-actors N] [--device auto|cpu|cuda|npu] [--set key=value ...]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import cli, parser, require, table  # noqa: E402
from bench._train import steady_state, train_all  # noqa: E402
from cluster import config as config_mod  # noqa: E402
from pipeline import metric_keys as M  # noqa: E402


def make_parser():
    p = parser(__doc__, overrides="more config overrides for both runs", device=True)
    p.add_argument("--env", default="MountainCarContinuous-v0")
    p.add_argument("--config", default=None, help="a config file (default: the schema defaults with --env)")
    p.add_argument("--seconds", type=float, default=60.0, help="wall-clock budget of each run")
    p.add_argument("--fixed", type=int, default=1, help="rollout actors of the fixed run")
    p.add_argument("--max-actors", type=int, default=None,
                   help="rollout.max_actors of the auto run (default: the host's cores minus two)")
    return p


def summary(records: list[dict]) -> dict:
    last = records[-1] if records else {}
    half = records[len(records) // 2:]
    rate_half = None
    if len(half) >= 2 and half[-1]["train_time_s"] > half[0]["train_time_s"]:
        rate_half = (half[-1]["env_steps"] - half[0]["env_steps"]) / (half[-1]["train_time_s"] - half[0]["train_time_s"])
    changes = [(r["iteration"], r[M.ROLLOUT_AUTOSCALE]) for r in records if r.get(M.ROLLOUT_AUTOSCALE) is not None]
    return {"iterations": len(records), "env_steps": last.get("env_steps"),
            "env_steps_per_s": last["env_steps"] / max(last["train_time_s"], 1e-9) if last else None,
            "env_steps_per_s_second_half": rate_half,
            "host_bound_second_half": steady_state(records, M.HOST_BOUND_FRACTION),
            "rollout_actors_end": last.get(M.ROLLOUT_ACTORS), "autoscale_changes": changes,
            "episode_return_mean_end": last.get("episode_return_mean")}


def run(args) -> tuple[dict, None]:
    cores = os.cpu_count() or 2
    max_actors = args.max_actors or max(1, cores - 2)
    require(max_actors >= args.fixed, f"--max-actors {max_actors} is below --fixed {args.fixed}")
    base = ([f"env.id={args.env}"] if args.config is None else []) + [
        f"run.time_budget_s={args.seconds}", "run.total_env_steps=1000000000", "run.require_target=false",
        "run.progress_interval_s=10", f"learner.device={args.device}"] + args.overrides
    fixed = config_mod.load(args.config, base + [f"rollout.num_actors={args.fixed}"])
    auto = config_mod.load(args.config, base + ["rollout.num_actors=auto", "rollout.min_actors=1",
                                                f"rollout.max_actors={max_actors}"])
    print(f"autoscale: {args.config or args.env}, {args.seconds:.0f} s a run, fixed {args.fixed} actor(s) against "
          f"auto (1..{max_actors}); {cores} cores here", flush=True)
    figures = {"cores": cores, "seconds": args.seconds, "runs": {}}
    for name, _cfg, trained in train_all([(f"fixed {args.fixed}", fixed), ("auto", auto)], ray_cfg=auto):
        figures["runs"][name] = summary(trained.records)
        print(f"  {name}: done, {figures['runs'][name]['iterations']} iterations", flush=True)
    rows = [(name, r["env_steps_per_s"], r["env_steps_per_s_second_half"], 100 * r["host_bound_second_half"],
             r["rollout_actors_end"], " ".join(f"it{i}->{n}" for i, n in r["autoscale_changes"]) or "-")
            for name, r in figures["runs"].items()]
    table([("run", "<8"), ("env steps/s", ">12,.0f"), ("2nd half", ">10,.0f"), ("host-bound %", ">13.1f"),
           ("actors", ">7"), ("changes", "")], rows)
    a, f = (figures["runs"]["auto"]["env_steps_per_s_second_half"],
            figures["runs"][f"fixed {args.fixed}"]["env_steps_per_s_second_half"])
    figures["ratio_second_half"] = a / f if a and f else float("nan")
    print(f"auto / fixed, env steps/s in the second half: x{figures['ratio_second_half']:.2f}")
    return figures, None


if __name__ == "__main__":
    cli(make_parser, run)
