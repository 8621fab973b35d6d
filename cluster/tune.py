"""Sweeps on Ray Tune: ``python -m cluster.tune --config C --grid learner.lr=1e-3,3e-4 --seeds 0,1,2``.

Every combination of the ``--grid`` values, times every seed, is one Tune trial that trains the config on the same
Ray cluster (local, or the cluster a `ray job submit` runs on) with its own run directory under ``--out``. Trials
run up to ``--max-concurrent`` at a time; each trial's own actors ask the cluster for their resources as a run
does. A trial that fails is reported in the table with its error, and the sweep goes on. At the end: a table of
every trial (settings, seed, stop reason, seconds and env steps to the config's target) on stdout and as
``<out>/results.csv``. Needs the ``tune`` extra (``pip install -e '.[tune]'``). With ``--set ray.address=inprocess``
each trial runs in its Tune worker's own process (``pipeline/runtime.py``): no actors to start per trial.

``--scheduler pbt`` is population-based training instead of a grid: ``--population N`` trials start from values
drawn in the ``--mutate KEY=LO:HI`` ranges (any float setting: ``learner.lr``, ``ppo.ent_coef``, ``ppo.clip_coef``,
...; log-uniform where LO > 0 and HI >= 10 LO) and train in segments of ``--interval-steps`` env steps. After each
segment a trial reports its score (the config's target metric: ``episode_return_mean``, or ``episode_success_rate``
with ``run.target_success_rate``) and its checkpoint; one in the bottom quarter of the population takes a top-quarter
trial's checkpoint (weights, optimizer, observation and reward statistics, counters: the ``--resume`` path) and that
trial's values, perturbed (x0.8 or x1.2, or drawn again with probability 0.25; kept inside the range). The table
then has each trial's final values, its score and how often it exploited another.
"""

from __future__ import annotations

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
PBT_COLUMNS = ("trial", "settings", "seed", "score", "exploits", "env_steps", "reason", "error")
PBT_QUANTILE = 0.25  # bottom quarter exploits top quarter (Tune's default, and Jaderberg et al.'s truncation)
PBT_RESAMPLE = 0.25
CHECKPOINT_FILE = "final.pt"
LINEAGE_FILE = "lineage.json"  # which trial wrote a PBT checkpoint, so a restore from another trial is an exploit
#: PBT checkpoints Tune keeps per trial (its newest), at least: a donor's checkpoint must outlive the exploit that took
#: it. The exploiting trial restores it when it next runs, and a paused trial waits at most one round of the others'
#: segments for a slot (population / max_concurrent of them), in which the donor reports one checkpoint a segment;
#: Ray warns that 2 or fewer can be deleted before they are restored. So ``pbt_checkpoints_kept`` keeps that round
#: plus two, and never fewer than this.
PBT_MIN_CHECKPOINTS_KEPT = 4


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
    from cluster.report import iter_records

    cfg = config_mod.load(params["config"], params["base"] + params["overrides"] + [f"run.seed={params['seed']}"])
    result = train(cfg, run_dir=Path(params["out"]) / params["name"])  # on the trial worker's Ray
    hit = to_target(iter_records(result.run_dir, last_run=False), cfg)  # streamed: the first record at the target
    return {"reason": result.reason, "reached": hit is not None, "env_steps": result.env_steps,
            "seconds_to_target": hit["time_s"] if hit else None, "env_steps_to_target": hit["env_steps"] if hit else None}


class MetricsTail:
    """A trial's metrics.jsonl, read as it grows: each ``update`` reads only what was appended since the one before
    (from the offset it remembers), and keeps the count of whole lines and the newest record. A file that was
    replaced or shrank (compacted: cluster/metrics.py) is read again from its start."""

    CHUNK = 1 << 20

    def __init__(self, path):
        self.path = Path(path)
        self.lines = 0
        self.last: dict | None = None  # the newest whole line that is a JSON object
        self.bytes_read = 0
        self._offset, self._inode, self._partial = 0, None, b""

    def update(self) -> "MetricsTail":
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return self
        if st.st_ino != self._inode or st.st_size < self._offset:
            self.lines, self.last, self._offset, self._inode, self._partial = 0, None, 0, st.st_ino, b""
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            while chunk := f.read(self.CHUNK):
                self._offset += len(chunk)
                self.bytes_read += len(chunk)
                *whole, self._partial = (self._partial + chunk).split(b"\n")
                self.lines += len(whole)
                for line in reversed(whole):
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue  # a torn line (a session killed mid-write)
                    if isinstance(record, dict):
                        self.last = record
                        break
        return self


def pbt_checkpoints_kept(population: int, max_concurrent: int) -> int:
    """Tune's ``num_to_keep`` for a PBT sweep (PBT_MIN_CHECKPOINTS_KEPT)."""
    return max(PBT_MIN_CHECKPOINTS_KEPT, math.ceil(population / max(1, max_concurrent)) + 2)


def parse_mutations(items: list[str], config: str, base: list[str]) -> dict[str, tuple[float, float]]:
    """``["learner.lr=1e-4:1e-3"]`` -> ``{"learner.lr": (1e-4, 1e-3)}``: each key a float setting, each bound a
    value the setting allows (the config is loaded with it, so the error is the setting's own)."""
    from cluster.config import ConfigError, load, setting_type

    mutations = {}
    for item in items:
        key, sep, bounds = item.partition("=")
        lo_text, colon, hi_text = bounds.partition(":")
        try:
            lo, hi = float(lo_text), float(hi_text)
        except ValueError:
            lo = hi = None
        if not sep or not colon or lo is None or not lo < hi:
            raise ConfigError(f"--mutate {item!r}: expected KEY.PATH=LO:HI with numbers LO < HI, "
                              f"e.g. learner.lr=1e-4:1e-3")
        tp = setting_type(key)  # names the key when there is no such setting
        if tp is not float:
            raise ConfigError(f"--mutate {key}: a {getattr(tp, '__name__', tp)} setting; allowed: float settings "
                              f"(learner.lr, ppo.ent_coef, ppo.clip_coef, ...)")
        for bound in (lo, hi):
            try:
                load(config, base + [f"{key}={bound!r}"])
            except ConfigError as e:
                raise ConfigError(f"--mutate {item!r}: {e}") from None
        mutations[key] = (lo, hi)
    if not mutations:
        raise ConfigError("--scheduler pbt needs at least one --mutate KEY.PATH=LO:HI")
    return mutations


def _log_scale(lo: float, hi: float) -> bool:
    return lo > 0 and hi >= 10 * lo


def _clip_to_ranges(mutations: dict[str, tuple[float, float]]):
    """Tune's PBT multiplies a value by 0.8 or 1.2 and does not know the range: keep every value inside it."""

    def explore(config: dict) -> dict:
        for key, (lo, hi) in mutations.items():
            config["mutate"][key] = min(max(float(config["mutate"][key]), lo), hi)
        return config

    return explore


def _pbt_trainable(params: dict) -> None:
    """One PBT trial: segments of ``interval`` env steps, each a run resumed from the previous checkpoint (or, after
    an exploit, from the better trial's), each reported to Tune with its checkpoint."""
    from ray import tune

    from cluster import checkpoint as checkpoint_mod
    from cluster import config as config_mod
    from cluster.driver import Trainer

    trial, values = params["trial"], params["mutate"]
    # trial000, trial001, ...: Tune's trial ids end in the trial's index
    files = checkpoint_mod.RunFiles(
        Path(trial["out"]) / f"trial{int(tune.get_context().get_trial_id().rsplit('_', 1)[-1]):03d}")
    run_dir = files.root
    overrides = trial["base"] + [f"{k}={float(v)!r}" for k, v in values.items()] + [f"run.seed={trial['seed']}"]
    resume, exploits = None, 0
    metrics = MetricsTail(files.metrics)  # read on from where the last segment's report left it
    restored = tune.get_checkpoint()
    if restored is not None:
        with restored.as_directory() as d:
            resume = checkpoint_mod.load(Path(d) / CHECKPOINT_FILE)
            lineage = json.loads((Path(d) / LINEAGE_FILE).read_text())
        exploits = lineage["exploits"] + (lineage["trial"] != run_dir.name)
        # The trial's own account of where its state came from (pbt.jsonl in its run directory): another trial's
        # checkpoint after an exploit, its own after Tune paused and resumed it.
        # records_before: the records already in metrics.jsonl (the restored run's go after them).
        run_dir.mkdir(parents=True, exist_ok=True)
        before = metrics.update().lines
        with open(files.pbt_log, "a") as f:
            f.write(json.dumps({"restored_from": lineage["trial"], "env_steps": resume["run_state"]["env_steps"],
                                "iteration": resume["run_state"]["iteration"], "values": values,
                                "records_before": before}) + "\n")
    while True:
        done = resume["run_state"]["env_steps"] if resume is not None else 0
        if done >= trial["total_env_steps"]:  # restored from a trial that had finished: nothing left to train
            _report(run_dir, trial, resume, checkpoint_path=None, restored=restored, reason="total_env_steps",
                    exploits=exploits, metrics=metrics)
            return
        goal = min(trial["total_env_steps"], done + trial["interval"])
        cfg = config_mod.load(trial["config"], overrides)  # the schedules count to the trial's whole budget
        # The trial's own run id, also after an exploit: its directory stays one run's, continued from another
        # trial's state (which a learner-group restart takes until the trial's own next checkpoint).
        trainer = Trainer(cfg, files, quiet=True, resume=resume, pause_at_env_steps=goal, run_id=files.run_id())
        try:
            trainer.build()
            result = trainer.run()
        finally:
            trainer.shutdown()
        if result.checkpoint_path is None:
            raise RuntimeError(f"trial {run_dir.name} ended ({result.reason}) without a checkpoint")
        resume = checkpoint_mod.load(result.checkpoint_path)
        reason = result.reason
        if reason == "paused" and resume["run_state"]["env_steps"] >= trial["total_env_steps"]:
            # The checkpoint counts what the rollouts made while the pause took effect, which can carry a segment
            # that paused short of the budget past it: the budget ended the trial. (Going round again reported the
            # checkpoint the trial had been given at its start instead, or crashed when it had been given none.)
            reason = "total_env_steps"
        _report(run_dir, trial, resume, checkpoint_path=result.checkpoint_path, restored=None, reason=reason,
                exploits=exploits, metrics=metrics)
        if reason != "paused":  # the budget, the config's target or its time budget ended the trial
            return


def _report(run_dir: Path, trial: dict, state: dict, *, checkpoint_path, restored, reason: str, exploits: int,
            metrics: MetricsTail):
    """One PBT result: the score of the checkpoint's episode window (what the records' moving mean shows), with the
    checkpoint that holds it (``restored``: the one this trial was given, when it had nothing left to train).
    ``metrics``: the trial's metrics.jsonl, read on from the previous report (the settings in force)."""
    import shutil
    import tempfile

    import numpy as np
    from ray import tune

    window = np.asarray(state["run_state"]["window"], dtype=float)
    if not len(window):
        score = float("-inf")
    elif trial["metric"] == "episode_success_rate":
        score = float(np.mean(window > 0))
    else:
        score = float(np.mean(window))
    result = {"trial": run_dir.name, "score": score, "env_steps": int(state["run_state"]["env_steps"]),
              "reason": reason, "exploits": exploits}
    last = metrics.update().last if checkpoint_path is not None else None
    if last is not None:
        result.update({f"in_force/{k}": last.get(k) for k in ("lr", "ent_coef", "clip_coef")})
    with tempfile.TemporaryDirectory() as d:
        if checkpoint_path is not None:
            shutil.copy(checkpoint_path, Path(d) / CHECKPOINT_FILE)
        else:
            with restored.as_directory() as given:
                shutil.copy(Path(given) / CHECKPOINT_FILE, Path(d) / CHECKPOINT_FILE)
        (Path(d) / LINEAGE_FILE).write_text(json.dumps({"trial": run_dir.name, "exploits": exploits}))
        tune.report(result, checkpoint=tune.Checkpoint.from_directory(d))


def run_pbt(args, cfg, base: list[str], out: Path, trial_cpu: float) -> list[dict]:
    """The population on Tune's PopulationBasedTraining; one row per trial."""
    from ray import tune
    from ray.tune.schedulers import PopulationBasedTraining

    mutations = parse_mutations(args.mutate, args.config, base)
    interval = args.interval_steps or 10 * cfg.learner.batch_size
    metric = "episode_success_rate" if cfg.run.target_success_rate is not None else "episode_return_mean"
    spaces = {k: (tune.loguniform if _log_scale(lo, hi) else tune.uniform)(lo, hi) for k, (lo, hi) in mutations.items()}
    trial = {"config": str(Path(args.config).resolve()), "base": base, "out": str(out), "interval": interval,
             "total_env_steps": cfg.run.total_env_steps, "metric": metric, "seed": int(args.seeds.split(",")[0]),
             "cpu": trial_cpu}
    scheduler = PopulationBasedTraining(
        time_attr="env_steps", perturbation_interval=interval, hyperparam_mutations={"mutate": spaces},
        quantile_fraction=PBT_QUANTILE, resample_probability=PBT_RESAMPLE,
        custom_explore_fn=_clip_to_ranges(mutations))
    tuner = tune.Tuner(
        tune.with_resources(_pbt_trainable, _trial_resources),
        param_space={"trial": trial, "mutate": spaces},
        # reuse_actors: an exploit restarts the trial in the process it ran in (the training thread is parked in
        # tune.report, so it stops at once) instead of a fresh one that imports Tune and torch again: a population of
        # 4 over 8 intervals started 19 trial processes without it, about 4 CPU-seconds each.
        tune_config=tune.TuneConfig(scheduler=scheduler, num_samples=args.population, metric="score", mode="max",
                                    max_concurrent_trials=args.max_concurrent, reuse_actors=True),
        run_config=tune.RunConfig(name="pbt", storage_path=str(out / "tune"), verbose=0,
                                  # A trial's newest few (one final.pt a segment), not every one it made
                                  # (PBT_MIN_CHECKPOINTS_KEPT: what an exploit restores is among them).
                                  checkpoint_config=tune.CheckpointConfig(
                                      num_to_keep=pbt_checkpoints_kept(args.population, args.max_concurrent)),
                                  failure_config=tune.FailureConfig(max_failures=0)),
    )
    rows = []
    for result in tuner.fit():
        name = (result.metrics or {}).get("trial", "?")
        values = result.config["mutate"]
        row = {"trial": name, "settings": " ".join(f"{k}={v:.3g}" for k, v in values.items()),
               "seed": trial["seed"], "error": ""}
        if result.error is not None:
            row.update(reason="error", error=str(result.error).strip().splitlines()[-1][:200])
        else:
            row.update({k: result.metrics.get(k) for k in ("score", "exploits", "env_steps", "reason")})
        rows.append(row)
    return sorted(rows, key=lambda r: r["trial"])


def required_trial_cpus(cfg) -> float:
    from cluster.placement import required_cpus

    return required_cpus(cfg) if cfg.ray.address == INPROCESS else TRIAL_CPU


def _trial_resources(space: dict):
    from ray import tune

    return tune.PlacementGroupFactory([{"CPU": space["trial"]["cpu"]}])


def _trainable(params: dict) -> None:
    from ray import tune

    tune.report(run_trial(params["trial"]))


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``, or a ConfigError naming --seeds."""
    from cluster.config import ConfigError

    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise ConfigError(f"--seeds: {text!r} is not a list of seeds; allowed: integers separated by commas, e.g. "
                          f"0,1,2 (each a run.seed)") from None


def main(argv=None) -> int:
    from cluster.config import ArgumentParser

    p = ArgumentParser(prog="python -m cluster.tune", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--grid", action="append", default=[], metavar="KEY.PATH=V1,V2",
                   help="values to sweep for one setting (repeatable: the grid is every combination)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds, each a trial per grid point")
    p.add_argument("--max-concurrent", type=int, default=1)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="applies to every trial")
    p.add_argument("--out", default="runs/tune", help="trial run directories, results.csv and Tune's state")
    p.add_argument("--address", help="Ray cluster address; default: RAY_ADDRESS, else an embedded local Ray")
    p.add_argument("--scheduler", choices=("grid", "pbt"), default="grid",
                   help="grid: every --grid combination x --seeds; pbt: population-based training over --mutate")
    p.add_argument("--population", type=int, default=4, help="pbt: trials in the population")
    p.add_argument("--mutate", action="append", default=[], metavar="KEY.PATH=LO:HI",
                   help="pbt: a float setting and its range (repeatable)")
    p.add_argument("--interval-steps", type=int, default=None,
                   help="pbt: env steps between exploit/explore decisions (default 10 x learner.batch_size)")
    args = p.parse_args(argv)
    from cluster import config as config_mod
    from cluster.evaluate import writable_directory

    try:
        grid = parse_grid(args.grid)
        seeds = parse_seeds(args.seeds)
        if args.max_concurrent < 1:
            raise config_mod.ConfigError(f"--max-concurrent: {args.max_concurrent}; allowed: >= 1")
        base = list(args.overrides) + ["run.progress_interval_s=1000"]
        if args.scheduler == "pbt":
            if args.grid:
                raise config_mod.ConfigError("--grid is for --scheduler grid; pbt varies --mutate ranges")
            if args.population < 2:
                raise config_mod.ConfigError(f"--population: {args.population}; allowed: >= 2 (a trial exploits "
                                             f"another)")
            if args.interval_steps is not None and args.interval_steps < 1:
                raise config_mod.ConfigError(f"--interval-steps: {args.interval_steps}; allowed: >= 1")
            parse_mutations(args.mutate, args.config, base)
        elif args.mutate:
            raise config_mod.ConfigError("--mutate needs --scheduler pbt")
        combos = trial_overrides(grid)
        cfg = config_mod.load(args.config, base)
        # Every trial's config is valid before anything starts. ray.address: inprocess (for the sweep or as a grid
        # value): the trial runs its whole job inside its own process (no actors of its own, so nothing to start per
        # trial), which therefore reserves what the run's actors would.
        combo_cpus = []
        for overrides in combos:
            trial_cfg = config_mod.load(args.config, base + overrides)
            combo_cpus.append(required_trial_cpus(trial_cfg))
        for seed in seeds:  # each seed a run.seed the trials take
            try:
                config_mod.load(args.config, base + [f"run.seed={seed}"])
            except config_mod.ConfigError as e:
                raise config_mod.ConfigError(f"--seeds {seed}: {e}") from None
        writable_directory(args.out, "--out")
    except ValueError as e:  # ConfigError
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        from ray import tune
    except ImportError as e:
        print(f"config error: cluster.tune needs Ray Tune ({e}); pip install -e '.[tune]'", file=sys.stderr)
        return EXIT_CONFIG

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.scheduler == "pbt":
        return _main_pbt(args, cfg, base, out)
    trials = [{"config": str(Path(args.config).resolve()), "base": base, "overrides": o, "seed": s, "out": str(out),
               "cpu": cpu, "name": f"trial{i:03d}-" + "-".join(x.replace("=", "_") for x in o + [f"seed={s}"])}
              for i, ((o, cpu), s) in enumerate(itertools.product(zip(combos, combo_cpus), seeds))]

    def fit():
        return tune.Tuner(
            # A sliver of CPU for the trial's own process (Tune needs a non-empty request); its run's actors
            # reserve what they need themselves, as a run does. An in-process trial reserves its run's CPUs.
            tune.with_resources(_trainable, _trial_resources),
            param_space={"trial": tune.grid_search(trials)},
            tune_config=tune.TuneConfig(max_concurrent_trials=args.max_concurrent),
            run_config=tune.RunConfig(name="sweep", storage_path=str(out / "tune"), verbose=0,
                                      failure_config=tune.FailureConfig(max_failures=0)),
        ).fit()

    refused, grid_results = _on_tune_ray(cfg, args, fit)
    if refused:
        return EXIT_CONFIG
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
    return _save_and_show(out, rows, COLUMNS)


def _main_pbt(args, cfg, base: list[str], out: Path) -> int:
    trial_cpu = required_trial_cpus(cfg)  # before _start_tune_ray takes an in-process setting off cfg
    refused, rows = _on_tune_ray(cfg, args, lambda: run_pbt(args, cfg, base, out, trial_cpu))
    if refused:
        return EXIT_CONFIG
    scored = [r for r in rows if isinstance(r.get("score"), float)]
    best = max(scored, key=lambda r: r["score"]) if scored else None
    return _save_and_show(out, rows, PBT_COLUMNS, [] if best is None else [
        f"best: {best['trial']} ({best['settings']}), score {best['score']:.1f} at {best['env_steps']:,} env steps"])


def _on_tune_ray(cfg, args, work):
    """-> (refused, work()): ``work`` run on the Ray Tune runs on, which is stopped after if this process started
    it; (True, None) with a config error on stderr where the start is refused (a bad --address or RAY_ADDRESS)."""
    from cluster import placement

    try:
        started = _start_tune_ray(cfg, args)
    except ValueError as e:  # ConfigError
        print(f"config error: {e}", file=sys.stderr)
        return True, None
    try:
        return False, work()
    finally:
        if started:
            placement.stop_ray()


def _start_tune_ray(cfg, args) -> bool:
    """The Ray Tune runs on (``--address``, RAY_ADDRESS, else an embedded one sized for ``--max-concurrent`` runs
    at once, each reserving its CPUs); True if this process started it."""
    from cluster import placement

    if cfg.ray.num_cpus is None:
        per_trial = placement.required_cpus(cfg) + TRIAL_CPU
        cfg.ray.num_cpus = max(os.cpu_count() or 1, math.ceil(per_trial * args.max_concurrent))
    if cfg.ray.address == INPROCESS:
        cfg.ray.address = None  # the trials' setting; Tune itself runs on Ray
    return placement.start_ray(cfg, args.address)


def _save_and_show(out: Path, rows: list[dict], columns: tuple, lines: list[str] = ()) -> int:
    """results.csv, the table and ``lines`` on stdout; exit 1 if a trial failed."""
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
    print(format_table(rows, columns))
    for line in lines:
        print(line)
    print(f"results: {out / 'results.csv'}")
    return EXIT_TRIAL_FAILED if any(r["error"] for r in rows) else EXIT_OK


def format_table(rows: list[dict], columns: tuple = COLUMNS) -> str:
    def cell(v):
        if v is None:
            return "-"
        return f"{v:,.1f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) \
            else str(v)

    cols = [c for c in columns if c != "error"] + (["error"] if any(r["error"] for r in rows) else [])
    table = [cols] + [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths)) for line in table)


if __name__ == "__main__":
    sys.exit(main())
