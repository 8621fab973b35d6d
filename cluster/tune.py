"""Sweeps on Ray Tune: ``python -m cluster.tune --config C --grid learner.lr=1e-3,3e-4 --seeds 0,1,2``.

Every combination of the ``--grid`` values, times every seed, is one Tune trial that trains the config on the same
Ray cluster (local, or the cluster a `ray job submit` runs on) with its own run directory under ``--out``. Trials
run up to ``--max-concurrent`` at a time; each trial's own actors ask the cluster for their resources as a run
does. A trial that fails is reported in the table with its error, and the sweep goes on. At the end: a table of
every trial (settings, seed, stop reason, seconds and env steps to the config's target) on stdout and as
``<out>/results.csv``. Needs the ``tune`` extra (``pip install -e '.[tune]'``). With ``--set ray.address=inprocess``
each trial runs in its Tune worker's own process (``pipeline/runtime.py``): no actors to start per trial.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import sys
from pathlib import Path

EXIT_OK, EXIT_TRIAL_FAILED, EXIT_CONFIG = 0, 1, 2
TRIAL_CPU = 0.01  # the trial's own process; its run's actors reserve their CPUs themselves
INPROCESS = "inprocess"  # pipeline.runtime.INPROCESS
COLUMNS = ("trial", "settings", "seed", "reason", "reached", "seconds_to_target", "env_steps_to_target",
           "env_steps", "error")


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """``["learner.lr=1e-3,3e-4"]`` -> ``{"learner.lr": ["1e-3", "3e-4"]}``."""
    from cluster.config import ConfigError

    grid = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values or any(not v for v in values.split(",")):
            raise ConfigError(f"--grid {item!r}: expected KEY.PATH=V1,V2,..., e.g. learner.lr=1e-3,3e-4")
        grid[key] = values.split(",")
    return grid


def trial_overrides(grid: dict[str, list[str]]) -> list[list[str]]:
    """Every combination of the grid, as ``--set`` lists."""
    keys = list(grid)
    return [[f"{k}={v}" for k, v in zip(keys, combo)] for combo in itertools.product(*(grid[k] for k in keys))]


def to_target(records: list[dict], cfg) -> dict | None:
    """The first record where the config's target was met (full window), else None."""
    from cluster.records import first_at

    run = cfg.run
    key, target = (("episode_return_mean", run.target_return) if run.target_return is not None
                   else ("episode_success_rate", run.target_success_rate))
    return first_at(records, run.target_window, target, key)


def run_trial(params: dict) -> dict:
    """One trial (inside a Tune worker): train, then the figures of the table."""
    from cluster import config as config_mod
    from cluster.api import train

    cfg = config_mod.load(params["config"], params["base"] + params["overrides"] + [f"run.seed={params['seed']}"])
    result = train(cfg, run_dir=Path(params["out"]) / params["name"])  # on the trial worker's Ray
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    hit = to_target(records, cfg)
    return {"reason": result.reason, "reached": hit is not None, "env_steps": result.env_steps,
            "seconds_to_target": hit["time_s"] if hit else None, "env_steps_to_target": hit["env_steps"] if hit else None}


def _trial_resources(space: dict):
    from ray import tune

    return tune.PlacementGroupFactory([{"CPU": space["trial"]["cpu"]}])


def _trainable(params: dict) -> None:
    from ray import tune

    tune.report(run_trial(params["trial"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.tune", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--grid", action="append", default=[], metavar="KEY.PATH=V1,V2",
                   help="values to sweep for one setting (repeatable: the grid is every combination)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds, each a trial per grid point")
    p.add_argument("--max-concurrent", type=int, default=1)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="applies to every trial")
    p.add_argument("--out", default="runs/tune", help="trial run directories, results.csv and Tune's state")
    p.add_argument("--address", help="Ray cluster address; default: RAY_ADDRESS, else an embedded local Ray")
    args = p.parse_args(argv)
    from cluster import config as config_mod
    from cluster.placement import required_cpus

    try:
        grid = parse_grid(args.grid)
        seeds = [int(s) for s in args.seeds.split(",")]
        if args.max_concurrent < 1:
            raise config_mod.ConfigError(f"--max-concurrent: {args.max_concurrent}; allowed: >= 1")
        base = list(args.overrides) + ["run.progress_interval_s=1000"]
        combos = trial_overrides(grid)
        cfg = config_mod.load(args.config, base)
        # Every trial's config is valid before anything starts. ray.address: inprocess (for the sweep or as a grid
        # value): the trial runs its whole job inside its own process (no actors of its own, so nothing to start per
        # trial), which therefore reserves what the run's actors would.
        combo_cpus = []
        for overrides in combos:
            trial_cfg = config_mod.load(args.config, base + overrides)
            combo_cpus.append(required_cpus(trial_cfg) if trial_cfg.ray.address == INPROCESS else TRIAL_CPU)
    except ValueError as e:  # ConfigError, or a seed that is not an integer
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        from ray import tune
    except ImportError as e:
        print(f"config error: cluster.tune needs Ray Tune ({e}); pip install -e '.[tune]'", file=sys.stderr)
        return EXIT_CONFIG
    import ray

    from cluster import placement

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    trials = [{"config": str(Path(args.config).resolve()), "base": base, "overrides": o, "seed": s, "out": str(out),
               "cpu": cpu, "name": f"trial{i:03d}-" + "-".join(x.replace("=", "_") for x in o + [f"seed={s}"])}
              for i, ((o, cpu), s) in enumerate(itertools.product(zip(combos, combo_cpus), seeds))]
    if cfg.ray.num_cpus is None:  # an embedded Ray holds --max-concurrent runs at once, each reserving its CPUs
        per_trial = placement.required_cpus(cfg) + TRIAL_CPU
        cfg.ray.num_cpus = max(os.cpu_count() or 1, math.ceil(per_trial * args.max_concurrent))
    if cfg.ray.address == INPROCESS:
        cfg.ray.address = None  # the trials' setting; Tune itself runs on Ray
    started = placement.start_ray(cfg, args.address)
    try:
        tuner = tune.Tuner(
            # A sliver of CPU for the trial's own process (Tune needs a non-empty request); its run's actors
            # reserve what they need themselves, as a run does. An in-process trial reserves its run's CPUs.
            tune.with_resources(_trainable, _trial_resources),
            param_space={"trial": tune.grid_search(trials)},
            tune_config=tune.TuneConfig(max_concurrent_trials=args.max_concurrent),
            run_config=tune.RunConfig(name="sweep", storage_path=str(out / "tune"), verbose=0,
                                      failure_config=tune.FailureConfig(max_failures=0)),
        )
        grid_results = tuner.fit()
    finally:
        if started:
            ray.shutdown()
    rows = []
    for result in grid_results:
        trial = result.config["trial"]
        row = {"trial": trial["name"].split("-")[0], "settings": " ".join(trial["overrides"]) or "-",
               "seed": trial["seed"], "error": ""}
        if result.error is not None:
            row.update(reason="error", reached=False, error=str(result.error).strip().splitlines()[-1][:200])
        else:
            row.update({k: result.metrics.get(k) for k in ("reason", "reached", "seconds_to_target",
                                                           "env_steps_to_target", "env_steps")})
        rows.append(row)
    rows.sort(key=lambda r: r["trial"])
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    print(format_table(rows))
    print(f"results: {out / 'results.csv'}")
    return EXIT_TRIAL_FAILED if any(r["error"] for r in rows) else EXIT_OK


def format_table(rows: list[dict]) -> str:
    def cell(v):
        if v is None:
            return "-"
        return f"{v:,.1f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) \
            else str(v)

    cols = [c for c in COLUMNS if c != "error"] + (["error"] if any(r["error"] for r in rows) else [])
    table = [cols] + [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths)) for line in table)


if __name__ == "__main__":
    sys.exit(main())
