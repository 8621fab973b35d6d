"""Metrics sinks: JSONL (one record per iteration) and the live progress line."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path


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


def _si(x: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


class ProgressLine:
    """One status line, redrawn in place on a terminal, appended every interval otherwise."""

    def __init__(self, interval_s: float, total_env_steps: int, stream=None):
        self.interval_s = interval_s
        self.total = total_env_steps
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last = 0.0

    def update(self, r: dict, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.interval_s:
            return
        self._last = now
        ret = r.get("episode_return_mean")
        ret_s = "   n/a" if ret is None or not math.isfinite(ret) else f"{ret:6.1f}"
        eta = ""
        if r["env_steps_per_s"] > 0 and self.total > r["env_steps"]:
            eta = f" | eta {(self.total - r['env_steps']) / r['env_steps_per_s']:.0f}s"
        line = (f"[{r['time_s']:6.1f}s] steps {r['env_steps']:>9,} ({_si(r['env_steps_per_s'])}/s) | "
                f"return {ret_s} (n={r['episodes_in_window']}) | learner {_si(r['learner_samples_per_s'])} samples/s | "
                f"host-bound {100 * r['host_bound_fraction']:4.1f}% | lag {r['policy_lag_mean']:.2f}/{r['policy_lag_max']}"
                f" | v{r['policy_version']}{eta}")
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
