"""Harness shared by every bench: command line, a private Ray, CPU accounting from /proc, timing, tables.

A bench is its docstring (what it compares, its pass rule), ``make_parser()`` (``parser`` gives the shared options:
``--out`` for all, ``--config``, ``--set``, ``--seeds``, ``--device`` where asked), ``run(args) -> (figures, ok)``
(prints its lines and tables, returns what ``--out`` writes and whether its pass rule held, None for a measurement)
and ``cli(make_parser, run)`` as its ``__main__``. Another script calls the same ``run`` with ``options(...)``
(bench/device_check.py does). Light on purpose: no Ray or torch at import (device_check's orchestrator imports it
without them). Training runs (one embedded Ray for many, figures at the target) are in ``bench/_train.py``, the synthetic data
plane (fragments, producers, the supply board, a timed learner loop) in ``bench/_supply.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ command line
def parser(doc: str, *, config: str | None = None, overrides: bool | str = False,
           out: str = "write the figures as JSON here", seeds: list[int] | None = None,
           device: bool = False) -> argparse.ArgumentParser:
    """A bench's parser, described by the first line of its docstring, with the options benches share:
    ``--out`` (every bench: its figures as JSON, written by ``cli``), ``--config`` (its default), ``--set key=value``
    into ``args.overrides`` (True, or the help text), ``--seeds`` (their default) and ``--device``."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", help=out)
    if config is not None:
        p.add_argument("--config", default=config)
    if overrides:
        p.add_argument("--set", dest="overrides", action="append", default=[],
                       help=overrides if isinstance(overrides, str) else None)
    if seeds is not None:
        p.add_argument("--seeds", type=int, nargs="+", default=seeds)
    if device:
        p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "npu"])
    return p


def options(make_parser, argv: list[str] = (), **values) -> argparse.Namespace:
    """A bench's options as its command line would give them (its defaults, checks included), then ``values``:
    how another script (bench/device_check.py) calls a bench's ``run``."""
    args = make_parser().parse_args(list(argv))
    unknown = set(values) - set(vars(args))
    if unknown:  # a flag the bench no longer has: say so here, not as an AttributeError deep in its run
        raise TypeError(f"no such option: {', '.join(sorted(unknown))}")
    vars(args).update(values)
    return args


def clean(obj):
    """JSON-safe: NaN / inf -> None, tuples -> lists, numpy scalars -> Python."""
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):
        try:
            obj = obj.item()
        except Exception:
            return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_json(path: Path, obj) -> None:
    """``obj`` as indented JSON (``clean``; anything else JSON has no type for as its str), atomically: a reader (or
    a kill) never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(clean(obj), indent=2, default=str))
    os.replace(tmp, path)


def write_out(path: str | None, obj) -> None:
    """``--out``: ``obj`` as JSON, when a path was given."""
    if path:
        write_json(Path(path), obj)


class UsageError(ValueError):
    """Options that do not go together: ``cli`` prints the usage and exits 2, as argparse does for a bad flag."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)


def cli(make_parser, run) -> None:
    """A bench's ``__main__``: parse its options, ``run(args)`` -> (figures, ok), figures to ``--out``; exit 0 when
    ok is true or None (a measurement), 1 when its pass rule failed."""
    def main() -> int:
        p = make_parser()
        args = p.parse_args()
        try:
            figures, ok = run(args)
        except UsageError as e:
            p.error(str(e))
        write_out(args.out, figures)
        return 0 if ok is None or ok else 1

    run_main(main)


def run_main(main) -> None:
    """``sys.exit(main())``; Ctrl-C exits 130 with one line instead of a traceback (main's ``finally`` has run)."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def versions(*names: str) -> str:
    """"torch 2.13.0 | ray 2.60.0 | ...": each named distribution's installed version ("missing" where it is not),
    the line a side-by-side bench prints with its figures."""
    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "missing"

    return " | ".join(f"{name} {version(name)}" for name in names)


def rotated(items: list, k: int) -> list:
    """``items`` from its k-th on, then the rest: each round or seed starts with another, so no side always runs
    first on a warm or a cold machine."""
    k %= max(1, len(items))
    return list(items[k:]) + list(items[:k])


# ------------------------------------------------------------------ Ray
@contextlib.contextmanager
def local_ray(num_cpus: int):
    """A private Ray for the block: address="local", never a cluster someone else `ray start`ed on this machine.
    Where this process has a Ray already (bench/device_check.py runs benches on its shared one), that one."""
    import ray

    if ray.is_initialized():
        yield
        return
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def actor_pids(actors: list, timeout: float | None = None) -> list[int]:
    """The process id of each actor."""
    import ray

    return ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in actors], timeout=timeout)


def signal_actor(handle, sig: int, stopped: list[int], timeout: float = 30) -> None:
    """Send ``sig`` to an actor's process (a fault, for the fault benches); a SIGSTOPped one goes into ``stopped``,
    for the bench to SIGKILL once its run is over (tests.conftest.kill_all)."""
    import signal

    (pid,) = actor_pids([handle], timeout=timeout)
    os.kill(pid, sig)
    if sig == signal.SIGSTOP:
        stopped.append(pid)


def ray_core_pids() -> list[int]:
    """raylet / gcs_server / ... of the Ray this driver started (best effort, internal API)."""
    import ray

    try:
        node = ray._private.worker._global_node
        return [p.process.pid for infos in node.all_processes.values() for p in infos if p.process is not None]
    except Exception:
        return []


# ------------------------------------------------------------------ CPU accounting from /proc
CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used; NaN once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime
    except (OSError, IndexError, ValueError):
        return float("nan")


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all but idle and iowait)."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    return (sum(vals[:8]) - vals[3] - vals[4]) / CLK_TCK


class CpuMeter:
    """CPU seconds used by named groups of processes, and by the whole machine ("machine")."""

    def __init__(self, groups: dict[str, list[int]]):
        self.groups = groups

    def snap(self) -> dict[str, float]:
        out = {name: sum(proc_cpu_s(p) for p in pids) for name, pids in self.groups.items()}
        out["machine"] = machine_busy_s()
        return out

    @staticmethod
    def delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
        return {k: b[k] - a[k] for k in a}


# ------------------------------------------------------------------ timing and tables
def median_s(fn, reps: int) -> float:
    """Median seconds of one ``fn()`` over ``reps`` calls, after one untimed call (caches, lazy imports)."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def table(columns: list[tuple[str, str]], rows, sep: str = " ", rule: bool = False) -> None:
    """Print an aligned table. ``columns``: (header, format spec with its alignment, e.g. ">8.1f"); a cell that is
    a string (a header, "-", a pre-formatted figure) gets only the spec's alignment and width."""
    widths = [re.match(r"[<>^]?\d*", spec).group() for _, spec in columns]

    def line(cells) -> str:
        return sep.join(f"{c:{w if isinstance(c, str) else spec}}"
                        for c, w, (_, spec) in zip(cells, widths, columns))

    header = line([h for h, _ in columns])
    print(header)
    if rule:
        print("-" * len(header))
    for row in rows:
        print(line(row))
