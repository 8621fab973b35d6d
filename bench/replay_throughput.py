"""Replay shard throughput: samples in and out per second, with 1 and K shards, against a direct path.

Two payloads: CartPole-size vector fragments (obs float32 (T=64, N=16, 4), ~46 KB)
and image fragments (obs uint8 (T=32, N=8, 84, 84, 3), ~5.4 MB). For each, P
producer actors build one fragment once and send it with ``shard.add`` over
and over, one add in flight each (as ``RolloutActor`` does); the driver is the
consumer, with one ``take`` in flight per shard, and ``ray.get``s every
fragment it takes (zero-copy from the object store). The same fragments are
then moved without a shard: the driver calls ``producer.make()`` (one call in
flight per producer) and ``ray.get``s the returned fragment.

All figures come from one run, cells side by side: the script prints rates and
ratios (K shards / 1 shard, shard path / direct path), never absolute targets
except the issue's >= 1M samples/s for CartPole-size fragments, which it
reports as met or not. CPU% per process (from /proc) shows where time went.

    .venv/bin/python bench/replay_throughput.py [--seconds 3] [--producers 4] [--shards 2] [--capacity 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import ray  # noqa: E402
from ray.exceptions import GetTimeoutError  # noqa: E402

from pipeline import fragment as F  # noqa: E402
from pipeline.replay import ReplayShard  # noqa: E402

CARTPOLE_TARGET_SAMPLES_PER_S = 1_000_000
PAYLOADS = {
    # name: (T, N, obs shape, obs dtype)
    "cartpole": (64, 16, (4,), np.float32),
    "image": (32, 8, (84, 84, 3), np.uint8),
}
CLK_TCK = os.sysconf("SC_CLK_TCK")


def make_fragment(payload: str, actor_id: int) -> F.Fragment:
    T, N, obs_shape, obs_dtype = PAYLOADS[payload]
    rng = np.random.default_rng(actor_id)
    if obs_dtype == np.uint8:
        obs = rng.integers(0, 256, size=(T, N) + obs_shape, dtype=np.uint8)
    else:
        obs = rng.standard_normal((T, N) + obs_shape).astype(obs_dtype)
    f32 = lambda: rng.standard_normal((T, N)).astype(np.float32)  # noqa: E731
    arrays = {
        F.OBS_STATE: obs,
        F.ACTIONS: rng.integers(0, 2, size=(T, N), dtype=np.int64),
        F.LOGP: f32(),
        F.VALUES: f32(),
        F.REWARDS: np.ones((T, N), np.float32),
        F.TERMINATED: np.zeros((T, N), bool),
        F.TRUNCATED: np.zeros((T, N), bool),
        F.ADVANTAGES: f32(),
        F.RETURNS: f32(),
    }
    return F.Fragment(arrays=arrays, policy_version=0, actor_id=actor_id)


@ray.remote(num_cpus=1, max_restarts=0)
class Producer:
    """Holds one prebuilt fragment; feeds it to a shard, or returns it on request."""

    def __init__(self, actor_id: int):
        self.actor_id = actor_id
        self.fragment: F.Fragment | None = None
        self.meta: F.FragmentMeta | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self.acked = 0

    def pid(self) -> int:
        return os.getpid()

    def build(self, payload: str) -> int:
        self.fragment = make_fragment(payload, self.actor_id)
        self.meta = F.FragmentMeta.of(self.fragment)
        return self.fragment.nbytes

    def make(self) -> F.Fragment:
        """The direct path: the fragment as this method's return value."""
        return self.fragment

    def start_feeding(self, shard) -> None:
        self._stop.clear()
        self.acked = 0
        self._error = None
        self._thread = threading.Thread(target=self._feed, args=(shard,), daemon=True)
        self._thread.start()

    def _feed(self, shard) -> None:
        pending = None
        try:
            while not self._stop.is_set():
                if pending is not None:
                    # Wait for the previous add (a full shard blocks us), but keep noticing stop().
                    while True:
                        try:
                            ray.get(pending, timeout=0.2)
                            break
                        except GetTimeoutError:
                            if self._stop.is_set():
                                return
                    self.acked += 1
                pending = shard.add.remote(self.meta, self.fragment)
        except Exception as e:  # reported by stop_feeding()
            self._error = f"{type(e).__name__}: {e}"

    def stop_feeding(self) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return {"acked": self.acked, "error": self._error, "stuck": bool(self._thread and self._thread.is_alive())}


# ------------------------------------------------------------------ CPU accounting from /proc
def proc_cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime
    except (OSError, IndexError, ValueError):
        return float("nan")


def machine_busy_s() -> float:
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + vals[4]  # idle + iowait
    return (sum(vals[:8]) - idle) / CLK_TCK


def ray_core_pids() -> list[int]:
    """raylet / gcs_server / plasma of the Ray this driver started (best effort, internal API)."""
    try:
        node = ray._private.worker._global_node
        return [p.process.pid for infos in node.all_processes.values() for p in infos if p.process is not None]
    except Exception:
        return []


CELLS_PLACEHOLDER
