"""Owner-process memory per published weights version, plain Ray: who should put, own and drop the weights object.

The system: learner rank 0 ``ray.put``s its weights each update and sends ``[ref]`` to the supply board actor,
which keeps only the newest box; rollout actors get the box from the board and ``ray.get`` the ref. The learner's
RSS was seen to grow ~460 B per version. Here each variant runs three fresh actor processes -- an *owner* (the
learner's part: it publishes), a *holder* (the board: keeps only the newest) and a *reader* (a rollout actor: every
``--read-every`` versions it asks the holder for the newest box and ``ray.get``s it) -- for ``--versions`` versions
(at most ``--cap-s`` seconds), sampling each process's RSS from /proc. Growth is the least-squares slope of RSS on
version over the samples after the first ``--warmup`` fraction, in MB per 10k versions (± its standard error).

Variants (all with a ~20 KB dict of float32 arrays, like CartPole's model, unless named -big):

  ctrl       the owner submits ``holder.publish(v, None)`` and puts nothing: task submission alone
  ctrl-val   ``holder.publish_drop(v, weights)``: the dict by value, dropped by the holder (the cost of sending
             20 KB by value, with no ObjectRef anywhere)
  ctrl-put   (not run by default) ``ray.put`` the dict and drop the ref; ``holder.publish(v, None)``: a put that
             no one else sees
  a          today's: the owner puts, keeps its box until the next version (as the learner's ``_published``
             does) and sends ``[ref]`` to ``holder.publish``; the reader borrows it via the holder
  a-big      (d) as a with a ~400 KB dict: above ``max_direct_call_object_size`` (100 KB), so a plasma object
             rather than one inlined in the owner's in-process memory store
  b          the owner sends the dict by value, ``holder.publish_value(v, weights)``; the holder ``ray.put``s it
             and hands out ``[ref]`` (the holder owns; the reader borrows from the holder)
  b-big      b with the ~400 KB dict
  c-ack      (c) as a, but the owner drops its superseded box only once the holder has acknowledged the next
             version (there is no explicit free in this Ray: ``ray._private.internal_api.free`` and
             ``CoreWorker.free_objects`` are gone, as is ``ray.put(_owner=...)`` since 2.56)
  e-pull     the holder *pulls*: ``holder.pull(v)`` calls ``owner.weights.remote()`` and keeps the returned ref,
             so the holder owns the object (a task's return belongs to its caller) and the owner only executes
             a task -- the replacement for the removed ``ray.put(_owner=holder)``
  a-noread   (not run by default) a without the reader: only the holder borrows
  a-drop     (not run by default) a-noread, but the holder does not keep the box: no borrow outlives its task
  e-value    nothing is put: the holder keeps the dict as a Python value and the reader gets it by value
             (``holder.weights()``), so no ObjectRef crosses a process boundary

    .venv/bin/python bench/ray_owner_memory.py [--versions 30000] [--cap-s 32] [--variants a b ...] [--read-every 4] [--trace]

Prints a table: variant, versions run, rate, MB per 10k versions for owner, holder, reader.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np
import ray

PAGE = os.sysconf("SC_PAGE_SIZE")
SMALL_BYTES = 20_000
BIG_BYTES = 400_000

VARIANTS = ("ctrl", "ctrl-val", "a", "a-big", "b", "b-big", "c-ack", "e-pull", "e-value")
EXTRA = ("ctrl-put", "a-noread", "a-drop")  # not run by default


def rss(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (/proc/<pid>/statm)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE


def make_weights(nbytes: int) -> dict[str, np.ndarray]:
    """A model-like dict: 12 float32 arrays summing to about ``nbytes``."""
    sizes = [4 * 64, 64, 64 * 64, 64, 64 * 2, 2, 4 * 64, 64, 64 * 64, 64, 64, 1]  # CartPole-ish actor + critic
    scale = nbytes / (4 * sum(sizes))
    rng = np.random.default_rng(0)
    return {f"p{i}": rng.standard_normal(max(1, int(s * scale))).astype(np.float32) for i, s in enumerate(sizes)}


@ray.remote(num_cpus=0)
class Holder:
    """The supply board's weights part: keeps only the newest (version, box)."""

    def __init__(self):
        self.version, self.box, self.value = -1, None, None

    def pid(self) -> int:
        return os.getpid()

    def publish(self, version: int, box) -> None:  # a, c-ack, ctrl*: box is [ref] (or None)
        self.version, self.box = version, box

    def publish_drop(self, version: int, box) -> None:  # a-drop (the borrow ends with the task), ctrl-val
        self.version = version

    def publish_value(self, version: int, weights: dict) -> None:  # b: the holder puts, and owns
        self.version, self.box = version, [ray.put(weights)]

    def pull(self, version: int, owner) -> None:  # e-pull: the holder calls the owner; the return is the holder's
        self.version, self.box = version, [owner.weights.remote()]

    def keep_value(self, version: int, weights: dict) -> None:  # e-value
        self.version, self.value = version, weights

    def latest(self):
        return self.version, self.box

    def weights(self):
        return self.version, self.value


@ray.remote(num_cpus=0)
class Reader:
    """A rollout actor's weights part: newest box from the holder, then ``ray.get`` of its ref."""

    def __init__(self, holder):
        self.holder = holder

    def pid(self) -> int:
        return os.getpid()

    def read(self) -> int:
        version, box = ray.get(self.holder.latest.remote())
        if box:
            weights = ray.get(box[0])
            assert len(weights) == 12
        return version

    def read_value(self) -> int:
        version, weights = ray.get(self.holder.weights.remote())
        return version


@ray.remote(num_cpus=0, max_concurrency=2)  # a second thread for e-pull's owner.weights (the learner has groups)
class Owner:
    """The learner's publishing part; runs one variant's loop and samples the three processes' RSS."""

    def __init__(self, nbytes: int):
        self.w = make_weights(nbytes)

    def pid(self) -> int:
        return os.getpid()

    def weights(self) -> dict:
        return self.w

    def run(self, variant: str, holder, reader, me, n: int, read_every: int, sample_every: int,
            cap_s: float, pids: list[int]) -> list[tuple]:
        pending: collections.deque = collections.deque()
        published = None  # the owner's own copy of the newest box (learner._published)
        samples = [(0, time.perf_counter(), *(rss(p) for p in pids))]
        t0 = time.perf_counter()
        for v in range(1, n + 1):
            self.w["p0"][0] = v  # a new version's weights
            if variant == "ctrl":
                pending.append(holder.publish.remote(v, None))
            elif variant == "ctrl-val":
                pending.append(holder.publish_drop.remote(v, self.w))
            elif variant == "ctrl-put":
                ref = ray.put(self.w)
                del ref
                pending.append(holder.publish.remote(v, None))
            elif variant in ("a", "a-big", "a-noread"):
                published = [ray.put(self.w)]
                pending.append(holder.publish.remote(v, published))
            elif variant == "a-drop":
                published = [ray.put(self.w)]
                pending.append(holder.publish_drop.remote(v, published))
            elif variant == "c-ack":
                box = [ray.put(self.w)]
                ray.get(holder.publish.remote(v, box))  # the holder has v: the previous box is superseded
                published = box  # drops the previous box only now
            elif variant in ("b", "b-big"):
                pending.append(holder.publish_value.remote(v, self.w))
            elif variant == "e-pull":
                pending.append(holder.pull.remote(v, me))
            elif variant == "e-value":
                pending.append(holder.keep_value.remote(v, self.w))
            else:
                raise ValueError(variant)
            if v % read_every == 0 and variant not in ("a-noread", "a-drop"):
                pending.append(reader.read_value.remote() if variant == "e-value" else reader.read.remote())
            while len(pending) > 16:  # bounded in flight: growth is per version, not a queue
                ray.get(pending.popleft())
            if v % sample_every == 0:
                samples.append((v, time.perf_counter(), *(rss(p) for p in pids)))
                if time.perf_counter() - t0 > cap_s:
                    break
        ray.get(list(pending))
        del published
        return samples


def slope(samples: list[tuple], col: int, warmup: float) -> tuple[float, float]:
    """Least-squares RSS growth of column ``col`` in MB per 10k versions after the warm-up, and its std error."""
    rows = samples[int(len(samples) * warmup):]
    x = np.array([r[0] for r in rows], float)
    y = np.array([r[col] for r in rows], float) / 1e6
    if len(x) < 3:
        return float("nan"), float("nan")
    a, b = np.polyfit(x, y, 1)
    resid = y - (a * x + b)
    se = np.sqrt((resid @ resid) / (len(x) - 2) / ((x - x.mean()) @ (x - x.mean())))
    return a * 1e4, se * 1e4


def run_variant(variant: str, args) -> dict:
    nbytes = BIG_BYTES if variant.endswith("-big") else SMALL_BYTES
    holder = Holder.remote()
    reader = Reader.remote(holder)
    owner = Owner.remote(nbytes)
    pids = ray.get([owner.pid.remote(), holder.pid.remote(), reader.pid.remote()])
    samples = ray.get(owner.run.remote(variant, holder, reader, owner, args.versions, args.read_every,
                                       args.sample_every, args.cap_s, pids))
    for a in (reader, holder, owner):
        ray.kill(a)
    n = samples[-1][0]
    secs = samples[-1][1] - samples[0][1]
    if args.trace:
        for v, t, *r in samples:
            print(f"  {variant} v={v:>6} t={t - samples[0][1]:6.1f}s RSS MB " + " ".join(f"{x / 1e6:7.2f}" for x in r))
    out = {"variant": variant, "versions": n, "rate": n / secs, "bytes": nbytes,
           "start_mb": [s / 1e6 for s in samples[0][2:]], "end_mb": [s / 1e6 for s in samples[-1][2:]]}
    for i, who in enumerate(("owner", "holder", "reader")):
        out[who] = slope(samples, 2 + i, args.warmup)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--versions", type=int, default=30_000)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS + EXTRA)
    p.add_argument("--read-every", type=int, default=4)
    p.add_argument("--sample-every", type=int, default=250)
    p.add_argument("--warmup", type=float, default=0.25, help="fraction of samples left out of the fit")
    p.add_argument("--cap-s", type=float, default=32.0, help="at most this long per variant")
    p.add_argument("--trace", action="store_true", help="also print every RSS sample")
    args = p.parse_args(argv)

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        print(f"ray {ray.__version__}; {args.versions} versions per variant (cap {args.cap_s:.0f} s), "
              f"reader every {args.read_every}, fit after {args.warmup:.0%} warm-up; MB/10k versions ± std err",
              flush=True)
        hdr = f"{'variant':<9} {'size':>6} {'versions':>8} {'ver/s':>6} {'owner':>14} {'holder':>14} {'reader':>14}"
        print(hdr, flush=True)
        rows = []
        for variant in args.variants:
            r = run_variant(variant, args)
            rows.append(r)
            cells = " ".join(f"{m:+7.2f}±{s:<5.2f}" for m, s in (r["owner"], r["holder"], r["reader"]))
            print(f"{variant:<9} {r['bytes'] // 1000:>4}KB {r['versions']:>8} {r['rate']:>6.0f} {cells}   "
                  f"(RSS MB start {'/'.join(f'{x:.0f}' for x in r['start_mb'])}, "
                  f"end {'/'.join(f'{x:.0f}' for x in r['end_mb'])})", flush=True)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
