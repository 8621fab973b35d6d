"""Shared pieces of the benches: synthetic fragments and a producer that keeps a shard full."""

from __future__ import annotations

import os
import time

import numpy as np
import ray

from pipeline import fragment as F
from pipeline.fragment import FragmentMeta

KINDS = {
    # CartPole-size: 64 steps x 16 envs x 4 floats.
    "vector": dict(obs_shape=(4,), obs_dtype=np.float32, T=64, N=16, fragments=2),
    # Atari-size frames, kept uint8 until the device: 32 steps x 8 envs x 4x84x84.
    "image": dict(obs_shape=(4, 84, 84), obs_dtype=np.uint8, T=32, N=8, fragments=2),
}


def make_fragment(kind: dict, version: int, rng: np.random.Generator) -> F.Fragment:
    T, N = kind["T"], kind["N"]
    if kind["obs_dtype"] == np.uint8:
        obs = rng.integers(0, 255, (T, N) + kind["obs_shape"], dtype=np.uint8)
    else:
        obs = rng.standard_normal((T, N) + kind["obs_shape"]).astype(np.float32)
    arrays = {
        F.OBS_STATE: obs,
        F.ACTIONS: rng.integers(0, 2, (T, N)),
        F.LOGP: np.full((T, N), -0.69, np.float32),
        F.VALUES: rng.standard_normal((T, N)).astype(np.float32),
        F.REWARDS: np.ones((T, N), np.float32),
        F.TERMINATED: np.zeros((T, N), bool),
        F.TRUNCATED: np.zeros((T, N), bool),
        F.ADVANTAGES: rng.standard_normal((T, N)).astype(np.float32),
        F.RETURNS: rng.standard_normal((T, N)).astype(np.float32),
    }
    return F.Fragment(arrays, policy_version=version, actor_id=0)


@ray.remote(num_cpus=0)
class Producer:
    """Keeps a shard full with copies of one pre-built fragment (version stamped 'current')."""

    def __init__(self, shard, kind: dict):
        self.shard = shard
        self.fragment = make_fragment(kind, 0, np.random.default_rng(0))

    def run(self, seconds: float) -> int:
        n, pending, deadline = 0, None, time.monotonic() + seconds
        while time.monotonic() < deadline:
            if pending is not None:
                try:
                    ray.get(pending)
                except ray.exceptions.RayActorError:
                    return n  # the bench tore the shard down: this producer is done
            self.fragment.policy_version = 10**9  # never stale: this bench is about the feed, not the lag bound
            pending = self.shard.add.remote(FragmentMeta.of(self.fragment), self.fragment)
            n += 1
        return n


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


def ray_core_pids() -> list[int]:
    """raylet / gcs_server / ... of the Ray this driver started (best effort, internal API)."""
    try:
        node = ray._private.worker._global_node
        return [p.process.pid for infos in node.all_processes.values() for p in infos if p.process is not None]
    except Exception:
        return []
