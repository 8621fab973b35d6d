"""Soak bench: 20 minutes of CartPole, printing memory over time.

Every 60 s it records the resident memory (RSS) of the driver and of every
Ray worker process of this run, and the object store's use. After a warm-up
(the first 5 minutes) growth must stay within 5%: a leak shows up as a
steady climb.

    .venv/bin/python bench/soak.py [--minutes 20] [--every 60] [--warmup-minutes 5]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray  # noqa: E402

from bench._common import cli, parser  # noqa: E402
from bench._train import long_run  # noqa: E402
from cluster.placement import _descendants  # noqa: E402

MB = 1024 * 1024


def _rss_bytes(pid: int) -> int:
    """VmRSS of ``pid``; 0 once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def ray_rss_mb() -> tuple[float, float]:
    """(driver RSS, summed RSS of every process the embedded Ray started) in MB, from /proc."""
    me = os.getpid()  # the embedded Ray's raylet, GCS and workers are all below this process
    return _rss_bytes(me) / MB, sum(_rss_bytes(pid) for pid in _descendants([me])) / MB


def object_store_used_mb() -> float:
    total = ray.cluster_resources().get("object_store_memory", 0)
    free = ray.available_resources().get("object_store_memory", 0)
    return (total - free) / MB


def make_parser():
    p = parser(__doc__)
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--every", type=float, default=60.0)
    p.add_argument("--warmup-minutes", type=float, default=5.0)
    return p


def run(args):
    samples: list[tuple[float, float, float, float]] = []

    def sampler(trainer, stop):
        t0 = time.monotonic()
        while True:
            s = (time.monotonic() - t0, *ray_rss_mb(), object_store_used_mb())
            samples.append(s)
            print(f"\nsoak: t={s[0]:6.0f} s | driver RSS {s[1]:7.1f} MB | Ray processes RSS {s[2]:8.1f} MB | "
                  f"object store {s[3]:7.1f} MB", file=sys.stderr, flush=True)
            if stop.wait(args.every):
                return

    with tempfile.TemporaryDirectory() as tmp:
        _, result = long_run(args.minutes, Path(tmp) / "soak", sampler)
    warm = [s for s in samples if s[0] >= args.warmup_minutes * 60]
    print(f"soak: {len(samples)} samples over {args.minutes:g} min; run ended '{result.reason}' after "
          f"{result.env_steps:,} env steps")
    if len(warm) < 2:
        print("soak: not enough samples after the warm-up to judge growth")
        return {"samples": samples}, False
    ok = True
    for i, name in ((1, "driver RSS"), (2, "Ray processes RSS"), (3, "object store")):
        first, last = warm[0][i], warm[-1][i]
        growth = (last - first) / first if first > 0 else 0.0
        ok &= growth <= 0.05 or (last - first) < 5.0  # a few MB of noise on a tiny base is not a leak
        print(f"soak: {name}: {first:.1f} MB after warm-up -> {last:.1f} MB at the end ({100 * growth:+.1f}%)")
    print("soak: PASS (growth after warm-up within 5%)" if ok else "soak: FAIL (growth after warm-up over 5%)")
    return {"samples": samples, "columns": ["t_s", "driver_rss_mb", "ray_rss_mb", "object_store_mb"]}, ok


if __name__ == "__main__":
    cli(make_parser, run)
