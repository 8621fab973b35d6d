"""Metrics sinks and the live progress line.

A sink takes every record (``write(record)``) and is closed at the end (``close()``). ``make_sinks`` builds those
``run.loggers`` names: ``jsonl`` (metrics.jsonl, one record per iteration), ``tensorboard``, ``wandb`` and
``mlflow`` (optional extras). Every sink uses the record's own keys as metric names, so a metric has one name
everywhere; the step is ``env_steps`` (W&B: the iteration, with ``env_steps`` as its charts' x axis).
"""

from __future__ import annotations

import json
import math
import numbers
import sys
import time
from pathlib import Path

from pipeline import metric_keys as M


class JsonlWriter:
    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "a", buffering=1)

    def write(self, record: dict) -> None:
        self._f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def close(self) -> None:
        self._f.close()


def _clean(v):
    # JSON has no NaN; null is what a reader can handle.
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def si(x: float, _pos=None, *, fixed: bool = False) -> str:
    """``x`` with a k / M suffix. ``fixed`` (the progress line, whose width should not jitter): always one decimal
    when scaled, none otherwise. Default (report axes; ``_pos`` makes it a matplotlib FuncFormatter): no trailing
    ".0", and values below 1 keep their digits."""
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            v = x / scale
            return f"{v:.1f}{unit}" if fixed or v != int(v) else f"{v:.0f}{unit}"
    return f"{x:.0f}" if fixed or abs(x) >= 1 or x == 0 else f"{x:g}"


class ProgressLine:
    """One status line, redrawn in place on a terminal, appended every interval otherwise."""

    def __init__(self, interval_s: float, total_env_steps: int, stream=None, show_success: bool = False):
        self.interval_s = interval_s
        self.total = total_env_steps
        self.show_success = show_success  # sparse-reward runs: the success rate says more than the mean return
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last = 0.0

    def update(self, r: dict, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.interval_s:
            return
        self._last = now
        ret = r.get(M.EPISODE_RETURN_MEAN)
        ret_s = "   n/a" if ret is None or not math.isfinite(ret) else f"{ret:6.1f}"
        eta = ""
        sps, steps = r[M.ENV_STEPS_PER_S], r[M.ENV_STEPS]
        if sps > 0 and self.total > steps:
            eta = f" | eta {(self.total - steps) / sps:.0f}s"
        success = r.get(M.EPISODE_SUCCESS_RATE)
        if self.show_success and success is not None and math.isfinite(success):
            ret_s += f", success {success:.2f}"
        evaluated = r.get(M.EVAL_RETURN_MEAN)
        if evaluated is not None and math.isfinite(evaluated):
            ret_s += f", eval {evaluated:.1f} (v{r[M.EVAL_POLICY_VERSION]})"
        env_sps, learner_sps = si(sps, fixed=True), si(r[M.LEARNER_SAMPLES_PER_S], fixed=True)
        line = (f"[{r[M.TIME_S]:6.1f}s] steps {steps:>9,} ({env_sps}/s) | "
                f"return {ret_s} (n={r[M.EPISODES_IN_WINDOW]}) | learner {learner_sps} samples/s | "
                f"host-bound {100 * r[M.HOST_BOUND_FRACTION]:4.1f}% | lag {r[M.POLICY_LAG_MEAN]:.2f}/"
                f"{r[M.POLICY_LAG_MAX]} | v{r[M.POLICY_VERSION]}{eta}")
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


class TensorBoardWriter:
    """TensorBoard sink: every finite numeric value of a record becomes a scalar.

    Scalar names are exactly the JSONL keys (``env_steps_per_s``, ``learner_wait_s``, ...),
    so the console, ``metrics.jsonl`` and TensorBoard speak the same names. The global
    step is ``record["env_steps"]``, so runs with different iteration sizes line up.
    Non-numeric values (strings, dicts, None) and booleans are skipped, as are NaN/inf.

    tensorboard is an optional dependency: it is imported here, not at module import.
    """

    def __init__(self, log_dir, flush_secs: int = 10):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(
                "TensorBoardWriter needs the 'tensorboard' package, which is not installed: "
                "pip install tensorboard"
            ) from e
        self.log_dir = Path(log_dir)
        self._w = SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs)
        self._n = 0
        # One Summary proto per record (one event) instead of one event per key: ~10x less
        # driver time per iteration, through the writer's public ``file_writer`` (a FileWriter, whose
        # add_summary is what add_scalar calls). Falls back to add_scalar if torch's writer changes shape.
        self._summary = self._file_writer = None
        try:
            from tensorboard.compat.proto.summary_pb2 import Summary
        except ImportError:
            return
        file_writer = getattr(self._w, "file_writer", None)
        if hasattr(file_writer, "add_summary"):
            self._summary, self._file_writer = Summary, file_writer

    def write(self, record: dict) -> None:
        if self._w is None:
            raise ValueError("TensorBoardWriter is closed")
        step = record.get(M.ENV_STEPS)
        if not _is_finite_number(step):  # not a driver record: fall back to a record counter
            step = self._n
        self._n += 1
        scalars = [(key, float(value)) for key, value in record.items() if _is_finite_number(value)]
        if self._file_writer is not None:
            values = [self._summary.Value(tag=key, simple_value=value) for key, value in scalars]
            self._file_writer.add_summary(self._summary(value=values), int(step))
        else:
            for key, value in scalars:
                self._w.add_scalar(key, value, global_step=int(step))

    def flush(self) -> None:
        if self._w is not None:
            self._w.flush()

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
            self._w = self._file_writer = None


def _scalars(record: dict) -> dict[str, float]:
    return {key: float(value) for key, value in record.items() if _is_finite_number(value)}


class WandbSink:
    """Weights & Biases (``pip install -e '.[wandb]'``): one ``wandb.log`` per record, the config as the run's
    config, files under the run directory. ``WANDB_MODE=offline`` (or no login) keeps everything local."""

    def __init__(self, run_dir: Path, config: dict, name: str):
        import wandb

        self._wandb = wandb
        self._run = wandb.init(project=config["run"].get("wandb_project") or "ascent-rl", name=name,
                               dir=str(run_dir), config=config, reinit="finish_previous")
        # W&B's step must strictly increase, and two iterations can end at the same env-step count (the rollouts
        # ran ahead under the policy lag): a repeated step would merge two records into one row. So rows are
        # numbered by iteration, and the charts' x axis is env_steps.
        self._run.define_metric(M.ENV_STEPS)
        self._run.define_metric("*", step_metric=M.ENV_STEPS)

    def write(self, record: dict) -> None:
        self._run.log(_scalars(record), step=int(record[M.ITERATION]))

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    """MLflow (``pip install -e '.[mlflow]'``): ``log_metrics`` per record, the config flattened into params. The
    tracking URI is MLFLOW_TRACKING_URI when set, else a file store in ``<run dir>/mlruns``."""

    def __init__(self, run_dir: Path, config: dict, name: str):
        import os

        import mlflow

        self._mlflow = mlflow
        if "MLFLOW_TRACKING_URI" not in os.environ:
            # MLflow 3 keeps the file store (no database needed, so mlflow-skinny suffices) behind this opt-in.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((Path(run_dir) / "mlruns").resolve().as_uri())
        mlflow.set_experiment(config["run"].get("mlflow_experiment") or "ascent-rl")
        self._run = mlflow.start_run(run_name=name)
        flat = {f"{section}.{k}": v for section, values in config.items() if isinstance(values, dict)
                for k, v in values.items() if not isinstance(v, (dict, list))}
        mlflow.log_params({k: str(v)[:500] for k, v in flat.items()})

    def write(self, record: dict) -> None:
        self._mlflow.log_metrics(_scalars(record), step=int(record.get(M.ENV_STEPS, 0)))

    def close(self) -> None:
        self._mlflow.end_run()


def make_sinks(loggers, run_dir: Path, config: dict) -> list:
    """The sinks ``run.loggers`` names (config error if an extra is missing: checked at start, not at the end)."""
    from cluster.config import ConfigError

    run_dir = Path(run_dir)
    makers = {"jsonl": lambda: JsonlWriter(run_dir / "metrics.jsonl"), "tensorboard": lambda: TensorBoardWriter(run_dir),
              "wandb": lambda: WandbSink(run_dir, config, run_dir.name),
              "mlflow": lambda: MlflowSink(run_dir, config, run_dir.name)}
    sinks = []
    for name in loggers:
        try:
            sinks.append(makers[name]())
        except ImportError as e:
            for sink in sinks:
                sink.close()
            raise ConfigError(f"run.loggers: {name!r} needs its package ({e}); pip install -e '.[{name}]'") from None
    return sinks


def _is_finite_number(v) -> bool:
    # bool is an int subclass but not a metric; numpy scalars (np.float32, np.int64) count.
    return (isinstance(v, numbers.Real) and not isinstance(v, bool) and type(v).__name__ != "bool_"
            and math.isfinite(v))
