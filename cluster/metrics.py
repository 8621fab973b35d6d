"""Metrics sinks and the live progress line.

A sink takes every record (``write(record)``) and is closed at the end (``close()``). ``make_sinks`` builds those
``run.loggers`` names: ``jsonl`` (metrics.jsonl, one record per iteration), ``tensorboard``, ``wandb`` and
``mlflow`` (optional extras). Every sink uses the record's own keys as metric names, so a metric has one name
everywhere; the step is ``env_steps`` (W&B: the iteration, with ``env_steps`` as its charts' x axis).

The files a run writes in its directory are bounded whatever its length: ``metrics.jsonl`` by compaction
(``JsonlWriter``: the recent records whole, the older ones thinned evenly, never more than ``METRICS_MAX_BYTES``),
and the TensorBoard events by being rebuilt from the compacted file each time (``TensorBoardWriter.rebuild``), so
they hold the same records. Thinning, not rotation: rotating files away loses the start of the run (the learning
curve's rise) or keeps an unbounded number of files, and writing only every k-th record past a size still grows
with the run's length; a file that keeps every recent record and an even sample of the rest stays the same size
and still shows the whole run. W&B and MLflow keep their own stores.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import sys
import threading
import time
from pathlib import Path

from cluster import host_time
from cluster.checkpoint import WriteFailed, describe_write_error
from pipeline import metric_keys as M

MB = 1 << 20
#: metrics.jsonl's size bound, whatever the run's length: a record that would take the file past it compacts the
#: file to at most half of it first (``JsonlWriter``). At the driver's ~2.3 kB a record the file holds 7,000-14,000
#: records, of which the newest 3,500 at least are whole. The TensorBoard events hold the same records in fewer
#: bytes, so a run directory's metrics stay within twice this.
METRICS_MAX_BYTES = 32 * MB
#: Where the thinning starts: the newest METRICS_RECENT_FRACTION of the bound is kept whole at a compaction, and the
#: older records are thinned until they fit in as much again, so the file is then at most half its bound.
METRICS_RECENT_FRACTION = 0.25
# A record's iteration where the driver writes it, first (cluster/records.py): read without parsing the line.
_ITERATION = re.compile(rb'^\{"iteration": (-?\d+)[,}]')


class JsonlWriter:
    """metrics.jsonl: one JSON line per record, appended, within ``max_bytes`` (default ``METRICS_MAX_BYTES``).

    A record that would take the file past its bound compacts it first (``compact``): the newest quarter of the
    bound is kept whole, and the records before it are thinned to those whose iteration is a multiple of a stride,
    the smallest power of two at which they fit in another quarter and never below the stride before. So every
    recent record stays, the older ones are an even sample of the whole run (every ``stride``-th iteration from its
    start: a record kept at one stride is kept at every smaller one, so a later compaction only thins further), and
    the file goes back to half its bound; the rewrite, at most the whole bound, comes once per half a bound
    appended. The file is rewritten beside itself and renamed over it: a reader sees the old file or the new one,
    and one that counts lines to count iterations (as a short run's tests do) is right until the first compaction.
    ``on_compact``: callables given the path after each compaction (``make_sinks`` rebuilds the TensorBoard events).
    """

    def __init__(self, path: Path, max_bytes: int | None = None, on_compact=()):
        self.path = Path(path)
        self.max_bytes = int(max_bytes or METRICS_MAX_BYTES)
        self.on_compact = list(on_compact)
        self.compactions = 0
        # The stride's power of two, never lowered: records thinned at one stride are not joined by denser ones
        # later, so the older part stays one even sample. (A new session starts at 1 and its first compaction
        # finds the file's stride again: the part thinned before only fits at that stride or a larger one.)
        self._stride_exp = 0
        self._tmp = self.path.with_name(self.path.name + ".compacting")
        self._tmp.unlink(missing_ok=True)  # a compaction's leftover, if a session was killed in one
        self._f = open(self.path, "a", buffering=1)
        self._size = os.path.getsize(self.path)
        if self._size and not self._ends_with_newline():
            self._f.write("\n")  # a session killed mid-line: its torn record stays a line of its own
            self._size += 1

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def write(self, record: dict) -> None:
        line = json.dumps({k: _clean(v) for k, v in record.items()}) + "\n"
        size = len(line.encode())
        try:
            if self._size + size > self.max_bytes and self._size:
                self.compact()
            self._f.write(line)  # line-buffered: a full disk raises here, with this record
        except OSError as e:
            raise WriteFailed(describe_write_error(self.path, e)) from None
        self._size += size

    def compact(self) -> None:
        """Rewrite the file within half its bound (class docstring), then tell ``on_compact``."""
        self._f.close()
        total = self.path.stat().st_size
        with open(self.path, "rb") as f:
            # The newest part, from the first whole line in its last RECENT_FRACTION of the bound, is kept whole.
            f.seek(max(0, total - int(self.max_bytes * METRICS_RECENT_FRACTION)))
            if f.tell():
                f.readline()
            recent_from = f.tell()
            # Bytes kept per stride: a line is kept at stride 2**k for every k up to its iteration's power of two.
            kept_at = [0] * 64
            f.seek(0)
            for level, n in _levels(f, recent_from):
                kept_at[level] += n
            budget, stride_exp = int(self.max_bytes * METRICS_RECENT_FRACTION), self._stride_exp
            while stride_exp < 63 and sum(kept_at[stride_exp:]) > budget:
                stride_exp += 1
            self._stride_exp = stride_exp
            tmp = self._tmp
            with open(tmp, "wb") as out:
                f.seek(0)
                for level, line in _levels(f, recent_from, lines=True):
                    if level >= stride_exp:
                        out.write(line)
                f.seek(recent_from)
                while chunk := f.read(MB):
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, self.path)
        self.compactions += 1
        self._f = open(self.path, "a", buffering=1)
        self._size = os.path.getsize(self.path)
        for hook in self.on_compact:
            hook(self.path)

    def close(self) -> None:
        try:
            self._f.close()
        except OSError as e:  # the buffered tail could not be written; closed all the same
            raise WriteFailed(describe_write_error(self.path, e)) from None


def _levels(f, end: int, lines: bool = False):
    """(level, byte count or the line itself) of each line of ``f`` before offset ``end``: the level is the power of
    two of the record's iteration (the largest k with 2**k dividing it; 63 for 0), so the line is kept at strides up
    to 2**level. A line without an integer iteration (not a driver record) counts by its place among those."""
    other = 0
    while f.tell() < end:
        line = f.readline()
        if not line:
            return
        m = _ITERATION.match(line)
        it = int(m.group(1)) if m else _iteration(line)
        if it is None:
            other += 1
            it = other
        it = abs(it)
        level = 63 if it == 0 else min(63, (it & -it).bit_length() - 1)
        yield level, (line if lines else len(line))


def _iteration(line: bytes) -> int | None:
    try:
        it = json.loads(line).get(M.ITERATION)
    except (ValueError, AttributeError):
        return None
    return it if isinstance(it, int) and not isinstance(it, bool) else None


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
                f"host-bound {100 * r[M.HOST_BOUND_FRACTION]:4.1f}%{host_time.progress_note(r)} | "
                f"lag {r[M.POLICY_LAG_MEAN]:.2f}/"
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


#: OS errors of tensorboard's event-writer threads (``TensorBoardWriter._quiet_writer_thread``), in order.
_EVENT_WRITER_ERRORS: list[OSError] = []


class TensorBoardWriter:
    """TensorBoard sink: every finite numeric value of a record becomes a scalar.

    Scalar names are exactly the JSONL keys (``env_steps_per_s``, ``learner_wait_s``, ...),
    so the console, ``metrics.jsonl`` and TensorBoard speak the same names. The global
    step is ``record["env_steps"]``, so runs with different iteration sizes line up.
    Non-numeric values (strings, dicts, None) and booleans are skipped, as are NaN/inf.

    Its size follows metrics.jsonl's: each time that file is compacted, ``rebuild`` writes the events afresh from
    it (``make_sinks`` ties the two), so they hold the same records within the same kind of bound. A TensorBoard
    that was watching the run shows the thinned history once it reloads the directory.

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
        self.flush_secs = flush_secs
        self._SummaryWriter = SummaryWriter
        self.rebuilds = 0
        self._lock = threading.Lock()  # the live writer, swapped by a rebuild
        self._rebuilding: threading.Thread | None = None
        self._pending: list | None = None  # records written while a rebuild runs: the new file gets them too
        self._quiet_writer_thread()
        self._errors_before = len(_EVENT_WRITER_ERRORS)
        self._w, self._file_writer, self._summary = self._open()
        self._n = 0

    @staticmethod
    def _quiet_writer_thread() -> None:
        """tensorboard's event writer writes in a thread of its own; an OS error there (a full disk) is kept for the
        next ``write`` or ``flush``, which raises it (``WriteFailed`` here, one line), and raised again in the thread,
        where Python prints a traceback. That second telling is not printed; the error is kept in
        ``_EVENT_WRITER_ERRORS``, so a writer closed before another write still says it (``close``)."""
        try:
            from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
        except ImportError:
            return
        previous = threading.excepthook
        if getattr(previous, "quiets_event_writer", False):
            return

        def hook(args):
            if isinstance(args.thread, _AsyncWriterThread) and isinstance(args.exc_value, OSError):
                _EVENT_WRITER_ERRORS.append(args.exc_value)
                return
            previous(args)

        hook.quiets_event_writer = True
        threading.excepthook = hook

    def _open(self) -> tuple:
        """(SummaryWriter, its FileWriter, Summary) of a new event file.

        One Summary proto per record (one event) instead of one event per key: ~10x less driver time per
        iteration, through the writer's public ``file_writer`` (a FileWriter, whose add_summary is what add_scalar
        calls). The FileWriter is None (add_scalar per key) if torch's writer changes shape."""
        w = self._SummaryWriter(log_dir=str(self.log_dir), flush_secs=self.flush_secs)
        try:
            from tensorboard.compat.proto.summary_pb2 import Summary
        except ImportError:
            return w, None, None
        file_writer = getattr(w, "file_writer", None)
        return (w, file_writer, Summary) if hasattr(file_writer, "add_summary") else (w, None, None)

    def write(self, record: dict) -> None:
        with self._lock:
            if self._w is None:
                raise ValueError("TensorBoardWriter is closed")
            try:  # the events are written by a thread of tensorboard's, which hands its error to the next call
                self._n = _add_record(self._w, self._file_writer, self._summary, record, self._n)
            except OSError as e:
                raise WriteFailed(describe_write_error(self.log_dir, e)) from None
            if self._pending is not None:
                self._pending.append(record)

    def rebuild(self, jsonl_path) -> None:
        """Replace every event file in the log directory with one holding exactly the records of ``jsonl_path`` (a
        compacted metrics.jsonl: every session's records it kept, so the earlier sessions' event files go too).

        Written on a thread of its own (~0.3 ms a record: seconds for a full file, which the run's loop must not
        wait for): records written meanwhile go to the old file and, once the replay is done, to the new one, which
        then takes the old one's place."""
        self._finish_rebuild()
        with self._lock:
            if self._w is None:
                raise ValueError("TensorBoardWriter is closed")
            self._pending = []
        old = list(self.log_dir.glob("events.out.tfevents.*"))
        # Opened now, and read to its length now: a later compaction replaces the file (this one's contents stay),
        # and what is appended to it from now on comes through write() (``_pending``).
        source = open(jsonl_path, "rb")
        end = os.fstat(source.fileno()).st_size
        self._rebuilding = threading.Thread(target=self._replay, args=(source, end, old), name="tensorboard-rebuild",
                                            daemon=True)
        self._rebuilding.start()

    def _replay(self, source, end: int, old: list) -> None:
        fresh, n = None, 0
        try:
            fresh, file_writer, summary = self._open()
            with source:
                while source.tell() < end and (line := source.readline()):
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue  # a torn line (a session killed mid-write): the report skips it too
                    if isinstance(record, dict):
                        n = _add_record(fresh, file_writer, summary, record, n)
            with self._lock:
                for record in self._pending:
                    n = _add_record(fresh, file_writer, summary, record, n)
                self._pending = None
                if self._w is None:  # closed meanwhile (close waits for this thread, so only on an error path)
                    fresh.close()
                    return
                stale, (self._w, self._file_writer, self._summary), self._n = self._w, (fresh, file_writer, summary), n
            stale.close()
            fresh.flush()
            for path in old:
                path.unlink(missing_ok=True)
            self.rebuilds += 1
        except Exception as e:  # noqa: BLE001 - the events stay as they were; the run goes on
            with self._lock:
                self._pending = None
            if fresh is not None:
                fresh.close()
            print(f"tensorboard: rebuilding the events from metrics.jsonl failed ({type(e).__name__}: {e}); "
                  f"they keep every record", file=sys.stderr)

    def _finish_rebuild(self) -> None:
        if self._rebuilding is not None:
            self._rebuilding.join()
            self._rebuilding = None

    def flush(self) -> None:
        self._finish_rebuild()
        if self._w is not None:
            self._w.flush()

    def close(self) -> None:
        self._finish_rebuild()
        with self._lock:
            w, self._w, self._file_writer = self._w, None, None
        if w is not None:
            try:
                w.close()
            except OSError as e:
                raise WriteFailed(describe_write_error(self.log_dir, e)) from None
            if len(_EVENT_WRITER_ERRORS) > self._errors_before:  # its thread failed after the last write
                raise WriteFailed(describe_write_error(self.log_dir, _EVENT_WRITER_ERRORS[-1]))


def _add_record(w, file_writer, summary, record: dict, n: int) -> int:
    """One record into a SummaryWriter: its finite numeric values as scalars at its env_steps (``n``, the records
    counted so far, where it has none). Returns the new count."""
    step = record.get(M.ENV_STEPS)
    if not _is_finite_number(step):  # not a driver record: fall back to a record counter
        step = n
    scalars = [(key, float(value)) for key, value in record.items() if _is_finite_number(value)]
    if file_writer is not None:
        values = [summary.Value(tag=key, simple_value=value) for key, value in scalars]
        file_writer.add_summary(summary(value=values), int(step))
    else:
        for key, value in scalars:
            w.add_scalar(key, value, global_step=int(step))
    return n + 1


def _scalars(record: dict) -> dict[str, float]:
    return {key: float(value) for key, value in record.items() if _is_finite_number(value)}


class WandbSink:
    """Weights & Biases (``pip install -e '.[wandb]'``): one ``wandb.log`` per record, the config as the run's
    config, files under ``directory`` (the run's). ``WANDB_MODE=offline`` (or no login) keeps everything local."""

    def __init__(self, directory: Path, config: dict, name: str):
        import wandb

        self._wandb = wandb
        self._run = wandb.init(project=config["run"].get("wandb_project") or "ascent-rl", name=name,
                               dir=str(directory), config=config, reinit="finish_previous")
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
    tracking URI is MLFLOW_TRACKING_URI when set, else a file store in ``store`` (the run's ``mlruns``)."""

    def __init__(self, store: Path, config: dict, name: str):
        import os

        import mlflow

        self._mlflow = mlflow
        if "MLFLOW_TRACKING_URI" not in os.environ:
            # MLflow 3 keeps the file store (no database needed, so mlflow-skinny suffices) behind this opt-in.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri(Path(store).resolve().as_uri())
        mlflow.set_experiment(config["run"].get("mlflow_experiment") or "ascent-rl")
        self._run = mlflow.start_run(run_name=name)
        flat = {f"{section}.{k}": v for section, values in config.items() if isinstance(values, dict)
                for k, v in values.items() if not isinstance(v, (dict, list))}
        mlflow.log_params({k: str(v)[:500] for k, v in flat.items()})

    def write(self, record: dict) -> None:
        self._mlflow.log_metrics(_scalars(record), step=int(record.get(M.ENV_STEPS, 0)))

    def close(self) -> None:
        self._mlflow.end_run()


def close_sinks(sinks) -> str | None:
    """Close every sink, each whatever the others did; the first failure's line (``WriteFailed``), or None."""
    failure = None
    for sink in sinks:
        try:
            sink.close()
        except WriteFailed as e:
            failure = failure or str(e)
    return failure


def make_sinks(loggers, files, config: dict) -> list:
    """The sinks ``run.loggers`` names, at the paths of the run's ``files`` (``cluster.checkpoint.RunFiles``); a
    config error if an extra is missing: checked at start, not at the end."""
    from cluster.config import ConfigError

    makers = {"jsonl": lambda: JsonlWriter(files.metrics), "tensorboard": lambda: TensorBoardWriter(files.events),
              "wandb": lambda: WandbSink(files.root, config, files.name),
              "mlflow": lambda: MlflowSink(files.mlruns, config, files.name)}
    # jsonl first: it compacts before it appends a record, and the TensorBoard events are then rebuilt from the
    # compacted file; written after it, they get that record as metrics.jsonl does.
    loggers = sorted(loggers, key=lambda name: name != "jsonl")
    sinks = []
    for name in loggers:
        try:
            sinks.append(makers[name]())
        except ImportError as e:
            for sink in sinks:
                sink.close()
            raise ConfigError(f"run.loggers: {name!r} needs its package ({e}); pip install -e '.[{name}]'") from None
    jsonl = next((s for s in sinks if isinstance(s, JsonlWriter)), None)
    if jsonl is not None:
        jsonl.on_compact += [s.rebuild for s in sinks if isinstance(s, TensorBoardWriter)]
    return sinks


def _is_finite_number(v) -> bool:
    # bool is an int subclass but not a metric; numpy scalars (np.float32, np.int64) count.
    return (isinstance(v, numbers.Real) and not isinstance(v, bool) and type(v).__name__ != "bool_"
            and math.isfinite(v))
