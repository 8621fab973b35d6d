"""Harness shared by every bench: command line, a private Ray, CPU accounting from /proc, timing, tables.

Light on purpose (no Ray or torch at import): the scheduler bench uses it without Ray. Training runs are in
``bench/_train.py``, the synthetic data plane (fragments, producers, the supply board) in ``bench/_supply.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ command line
def parser(doc: str, *, config: str | None = None, overrides: bool | str = False,
           out: str | None = None) -> argparse.ArgumentParser:
    """A bench's parser, described by the first line of its docstring, with the options benches share:
    ``--config`` (its default), ``--set key=value`` into ``args.overrides`` (True, or the help text) and ``--out``
    (its help text)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    if config is not None:
        p.add_argument("--config", default=config)
    if overrides:
        p.add_argument("--set", dest="overrides", action="append", default=[],
                       help=overrides if isinstance(overrides, str) else None)
    if out is not None:
        p.add_argument("--out", help=out)
    return p


def write_out(path: str | None, obj) -> None:
    """``--out``: ``obj`` as indented JSON, when a path was given."""
    if path:
        Path(path).write_text(json.dumps(obj, indent=2))


def run_main(main) -> None:
    """``sys.exit(main())``; Ctrl-C exits 130 with one line instead of a traceback (main's ``finally`` has run)."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


# ------------------------------------------------------------------ Ray
@contextlib.contextmanager
def local_ray(num_cpus: int):
    """A private Ray for the block: address="local", never a cluster someone else `ray start`ed on this machine."""
    import ray

    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def actor_pids(actors: list, timeout: float | None = None) -> list[int]:
    """The process id of each actor."""
    import ray

    return ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in actors], timeout=timeout)


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
