"""Ray's memory per answer: async actors whose answers carry an int, an ObjectRef or an actor handle, side by side.

Three do-nothing async actors, one per kind of answer, each called at ``--calls-per-s`` by ``--callers`` callers for
``--minutes``; each one's RSS over its calls, least squares after the first third, in bytes per call, and each
kind over the int's. The ref and the handle are the same ones every time, given to the actor once and held by it
(as the supply board holds its shards' handles): what grows is Ray's bookkeeping per answer that carries one, not
the answer. This is why the protocol's per-update answers carry no actor handle (``pipeline.protocol.Part``).

    .venv/bin/python bench/ray_call_memory.py [--minutes 5] [--calls-per-s 100] [--callers 2]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import cli, parser  # noqa: E402

KINDS = ("int", "ref", "handle")


def make_parser():
    p = parser(__doc__)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--calls-per-s", type=float, default=100.0, help="per kind")
    p.add_argument("--callers", type=int, default=2, help="per kind")
    p.add_argument("--every", type=float, default=15.0, help="seconds between samples")
    return p


def run(args):
    import numpy as np
    import ray

    @ray.remote(num_cpus=0, max_concurrency=100, enable_task_events=False)
    class Holder:
        def __init__(self, box):
            self.held, self.calls = box[0], 0  # in a list: Ray passes the ref or handle itself, not its value

        async def call(self):
            self.calls += 1
            return {0: (self.held, [self.calls])}

        def sample(self):
            with open("/proc/self/status") as f:
                return self.calls, next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    @ray.remote(num_cpus=0)
    class Caller:
        def run(self, holder, rate, seconds):
            t0, n = time.monotonic(), 0
            while time.monotonic() - t0 < seconds:
                ray.get(holder.call.remote())
                n += 1
                time.sleep(max(0.0, t0 + n / rate - time.monotonic()))

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        peer = Holder.remote([0])  # the actor whose handle is held
        held = {"int": 7, "ref": ray.put(np.zeros(16)), "handle": peer}
        holders = {k: Holder.remote([held[k]]) for k in KINDS}
        seconds = args.minutes * 60
        running = [c.run.remote(h, args.calls_per_s / args.callers, seconds)
                   for h in holders.values() for c in [Caller.remote() for _ in range(args.callers)]]
        samples = {k: [] for k in KINDS}
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            time.sleep(args.every)
            for k, (calls, rss) in zip(KINDS, ray.get([holders[k].sample.remote() for k in KINDS])):
                samples[k].append((calls, rss))
        ray.get(running)
    finally:
        ray.shutdown()
    per_call = {}
    for k, pts in samples.items():
        pts = pts[len(pts) // 3:]
        per_call[k] = float(np.polyfit([c for c, _ in pts], [r for _, r in pts], 1)[0]) if len(pts) > 1 else float("nan")
    print(f"{'answer carries':<16} {'B per call':>11} {'over int':>9}")
    for k in KINDS:
        print(f"{k:<16} {per_call[k]:>11.0f} {per_call[k] / max(per_call['int'], 1.0):>8.1f}x")
    return {"bytes_per_call": per_call, "calls_per_s": args.calls_per_s, "minutes": args.minutes}, None


if __name__ == "__main__":
    cli(make_parser, run)
