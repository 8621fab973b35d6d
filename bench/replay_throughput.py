"""Replay shard throughput on the ticketed path: samples in and out per second, 1 and K shards, against a direct path.

Two payloads: CartPole-size vector fragments (obs float32 (T=64, N=16, 4), ~47 KB)
and image fragments (obs uint8 (T=32, N=8, 84, 84, 3), ~5.4 MB). For each, P
producer actors build one fragment once and send it over and over with the
protocol of ``RolloutActor``: one ``board.poll`` of the supply board for a
ticket, then ``shard.add(ticket, ...)``, one add in flight each; the shard
confirms every fragment with the board (``board.stored``) before acknowledging
it. The driver is the consumer, as a learner's ``DeviceFeed``: it claims stored
fragments from the board (one ``claim`` in flight, up to ``--max-items`` each),
sends a ``take`` to every shard named in the claim at once, and ``ray.get``s
every fragment it takes (zero-copy from the object store). The board has
``per_update`` 10**9 and ``max_policy_lag`` 0, with policy version 0 published
once: tickets never run out, so nothing waits on a learner and this is the
data plane's ceiling. The ticket protocol costs about two board round trips
per fragment plus one per claim; the bench counts them (board calls per
fragment) and the board's CPU. The same fragments are then moved without a
shard or a board: the driver calls ``producer.make()`` (one call in flight per
producer) and ``ray.get``s the returned fragment.

All figures come from one run, cells side by side: the script prints rates and
ratios (K shards / 1 shard, shard path / direct path), never absolute targets
except the issue's >= 1M samples/s for CartPole-size fragments, which it
reports as met or not. CPU% per process group (from /proc; "other" = processes
that are not this bench) and CPU-ms per fragment show where the time went.

    .venv/bin/python bench/replay_throughput.py [--seconds 2] [--rounds 2] [--producers 4] [--shards 2]
        [--capacity 8] [--cartpole-tn 64 16] [--payloads cartpole image]
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import ray  # noqa: E402
from ray.exceptions import GetTimeoutError  # noqa: E402

from bench._common import CpuMeter, actor_pids, local_ray, parser, ray_core_pids, run_main, table  # noqa: E402
from bench._supply import make_fragment, supply  # noqa: E402
from pipeline import fragment as F  # noqa: E402

UNLIMITED = 10**9  # the board's per_update: tickets are created lazily, so this costs nothing

CARTPOLE_TARGET_SAMPLES_PER_S = 1_000_000
PAYLOADS = {
    "cartpole": dict(T=64, N=16, modality="vector", obs_shape=(4,), obs_dtype=np.float32),
    "image": dict(T=32, N=8, modality="image", obs_shape=(84, 84, 3), obs_dtype=np.uint8),
}


@ray.remote(num_cpus=1, max_restarts=0)
class Producer:
    """Holds one prebuilt fragment; feeds it to a shard against the board's tickets, or returns it on request."""

    def __init__(self, actor_id: int):
        self.actor_id = actor_id
        self.fragment: F.Fragment | None = None
        self.meta: F.FragmentMeta | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self.acked = 0
        self.polls = 0  # board.poll calls (one per fragment while tickets are plentiful)
        self.incarnation = -1  # a fresh one per cell: every cell has its own board

    def pid(self) -> int:
        return os.getpid()

    def build(self, kind: dict) -> int:
        self.fragment = make_fragment(kind, 0, np.random.default_rng(self.actor_id), self.actor_id)
        self.meta = F.FragmentMeta.of(self.fragment)
        return self.fragment.nbytes

    def make(self) -> F.Fragment:
        """The direct path: the fragment as this method's return value."""
        return self.fragment

    def start_feeding(self, board, shard, shard_index: int) -> None:
        self._stop.clear()
        self.acked = self.polls = 0
        self.incarnation += 1
        self._error = None
        self._thread = threading.Thread(target=self._feed, args=(board, shard, shard_index), daemon=True)
        self._thread.start()

    def counters(self) -> dict:
        return {"acked": self.acked, "polls": self.polls}

    def _poll(self, board, shard_index: int, wait_s: float):
        ticket, _, _ = ray.get(board.poll.remote(self.actor_id, self.incarnation, 0, shard_index, 0, [], wait_s))
        self.polls += 1
        return ticket

    def _feed(self, board, shard, shard_index: int) -> None:
        pending = None
        try:
            while not self._stop.is_set():
                ticket = self._poll(board, shard_index, 0.0)  # as RolloutActor: the ticket before the fragment
                while ticket is None and not self._stop.is_set():
                    ticket = self._poll(board, shard_index, 0.2)
                if ticket is None:
                    return
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
                pending = shard.add.remote(ticket, self.meta, self.fragment)
        except Exception as e:  # reported by stop_feeding()
            self._error = f"{type(e).__name__}: {e}"

    def stop_feeding(self) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return {"acked": self.acked, "polls": self.polls, "error": self._error,
                "stuck": bool(self._thread and self._thread.is_alive())}


OUR_GROUPS = ("consumer", "producers", "shards", "board", "ray_core")


@dataclass
class Tally:
    """Raw counts over measuring windows; rates are computed from the pooled totals."""

    seconds: float = 0.0
    samples_in: int = 0
    samples_out: int = 0
    bytes_out: int = 0
    fragments: int = 0
    consumer_calls: int = 0  # take() calls (shard path) or make() calls (direct path)
    board_polls: int = 0  # producers asking for a ticket
    board_stored: int = 0  # shards confirming a fragment
    board_claims: int = 0  # the consumer claiming stored fragments
    zero_copy: bool = True
    cpu_s: collections.Counter = field(default_factory=collections.Counter)

    def add(self, o: "Tally") -> None:
        for f in fields(self):
            if f.name not in ("zero_copy", "cpu_s"):  # the counts
                setattr(self, f.name, getattr(self, f.name) + getattr(o, f.name))
        self.zero_copy &= o.zero_copy
        self.cpu_s.update(o.cpu_s)

    @property
    def in_sps(self) -> float:
        return self.samples_in / self.seconds

    @property
    def out_sps(self) -> float:
        return self.samples_out / self.seconds

    @property
    def mbps(self) -> float:
        return self.bytes_out / self.seconds / 1e6

    @property
    def frags_per_s(self) -> float:
        return self.fragments / self.seconds

    def cpu_pct(self) -> dict[str, float]:
        pct = {k: 100.0 * v / self.seconds for k, v in self.cpu_s.items()}
        ours = sum(pct.get(k, 0.0) for k in OUR_GROUPS)
        pct["other"] = max(pct.get("machine", 0.0) - ours, 0.0)  # everything else on the machine
        return pct

    @property
    def board_calls(self) -> int:
        return self.board_polls + self.board_stored + self.board_claims

    def board_calls_per_fragment(self) -> float:
        return self.board_calls / max(self.fragments, 1)

    def cpu_ms_per_fragment(self) -> float:
        """CPU of this bench's processes (incl. raylet/GCS) per fragment moved: a load-independent cost."""
        ours = sum(self.cpu_s.get(k, 0.0) for k in OUR_GROUPS)
        return 1e3 * ours / max(self.fragments, 1)


def _cpu_delta(a: dict, b: dict) -> collections.Counter:
    return collections.Counter({k: v for k, v in CpuMeter.delta(a, b).items() if not np.isnan(v)})


def _check(frag: F.Fragment) -> bool:
    (obs,) = (frag.arrays[k] for k in F.obs_keys(frag.arrays))
    _ = obs.flat[-1]  # touch the data
    return not obs.flags.writeable  # read-only: a view of Ray's buffer, not a private copy


# ------------------------------------------------------------------ cells
def drain_shards(board, shards, producers, max_items: int, warmup_s: float, seconds: float, meter: CpuMeter,
                 frag_samples: int) -> Tally:
    """Driver as consumer, as a learner's feed: claim from the board (one claim in flight), then take from every
    shard the claim names at once; the take returns the fragments themselves."""
    failed: list = []  # claimed but not in their shard: handed back with the next claim (none in a healthy run)

    def claim():
        return board.claim.remote(0, 0, max_items, 0.05, failed)

    claim_ref, takes = claim(), {}
    t_start = time.perf_counter() + warmup_s
    in_window = False
    tally = Tally()

    def board_counts():
        st = ray.get(board.stats.remote())
        polls = sum(c["polls"] for c in ray.get([p.counters.remote() for p in producers]))
        return st["fragments_stored"], st["fragments_stored"] + st["rejected"], polls

    while True:
        now = time.perf_counter()
        if not in_window and now >= t_start:
            counts0 = board_counts()
            cpu0, t_start = meter.snap(), time.perf_counter()
            in_window = True
        if in_window and now >= t_start + seconds:
            t_stop, cpu1 = time.perf_counter(), meter.snap()
            counts1 = board_counts()
            break
        ready, _ = ray.wait([claim_ref, *takes], num_returns=1)
        ref = ready[0]
        if ref == claim_ref:
            claims = ray.get(ref)
            failed = []
            for handle, tickets in claims.values():
                takes[handle.take.remote(tickets)] = len(tickets)
            claim_ref = claim()
            if in_window:
                tally.board_claims += 1
            continue
        del takes[ref]
        items, missing = ray.get(ref)
        failed += missing
        if in_window:
            tally.consumer_calls += 1
        got = [frag for _, frag in items]
        for frag in got:
            tally.zero_copy &= _check(frag)
            if in_window:
                tally.samples_out += frag.num_samples
                tally.bytes_out += frag.nbytes
                tally.fragments += 1
        del got, items
    tally.seconds = t_stop - t_start
    tally.samples_in = (counts1[0] - counts0[0]) * frag_samples
    tally.board_stored = counts1[1] - counts0[1]
    tally.board_polls = counts1[2] - counts0[2]
    tally.cpu_s = _cpu_delta(cpu0, cpu1)
    return tally


def direct(producers, warmup_s: float, seconds: float, meter: CpuMeter) -> Tally:
    """Driver calls producer.make(), one call in flight per producer, and ray.gets the result."""
    inflight = {p.make.remote(): i for i, p in enumerate(producers)}
    t_start = time.perf_counter() + warmup_s
    in_window = False
    tally = Tally()
    while True:
        now = time.perf_counter()
        if not in_window and now >= t_start:
            cpu0, t_start = meter.snap(), time.perf_counter()
            in_window = True
        if in_window and now >= t_start + seconds:
            t_stop, cpu1 = time.perf_counter(), meter.snap()
            break
        ready, _ = ray.wait(list(inflight), num_returns=1)
        i = inflight.pop(ready[0])
        frag = ray.get(ready[0])
        inflight[producers[i].make.remote()] = i
        tally.zero_copy &= _check(frag)
        if in_window:
            tally.consumer_calls += 1
            tally.samples_out += frag.num_samples
            tally.bytes_out += frag.nbytes
            tally.fragments += 1
        del frag
    ray.get(list(inflight))  # let the last calls finish before the producers are reused
    tally.seconds = t_stop - t_start
    tally.samples_in = tally.samples_out
    tally.cpu_s = _cpu_delta(cpu0, cpu1)
    return tally


def shard_cell(producers, num_shards: int, args, base_groups: dict, frag_samples: int) -> Tally:
    """A fresh board and K shards, wired as the driver wires them; tickets never run out (see the docstring)."""
    board, shards = supply(num_shards, args.capacity, UNLIMITED, 0)
    try:
        meter = CpuMeter({**base_groups, "shards": actor_pids(shards), "board": actor_pids([board])})
        # Producer i feeds shard i % K, as the driver wires rollout actors.
        ray.get([p.start_feeding.remote(board, shards[i % num_shards], i % num_shards)
                 for i, p in enumerate(producers)])
        try:
            tally = drain_shards(board, shards, producers, args.max_items, args.warmup, args.seconds, meter,
                                 frag_samples)
        finally:
            stops = ray.get([p.stop_feeding.remote() for p in producers], timeout=30)
        errors = [s["error"] for s in stops if s["error"]]
        if errors:
            raise RuntimeError(f"producer failed: {errors[0]}")
        return tally
    finally:
        for a in shards + [board]:
            ray.kill(a)


def fmt_cpu(t: Tally) -> str:
    pct = t.cpu_pct()
    parts = [f"{k} {pct[k]:.0f}%" for k in (*OUR_GROUPS, "other") if k in pct]
    return ", ".join(parts) + f"; {t.cpu_ms_per_fragment():.2f} cpu-ms/fragment"


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--seconds", type=float, default=2.0, help="measuring window per cell and round")
    p.add_argument("--warmup", type=float, default=0.5, help="seconds run before each window")
    p.add_argument("--rounds", type=int, default=2,
                   help="each cell is measured this many times, cells interleaved; rates pool the rounds")
    p.add_argument("--producers", type=int, default=4, help="producer actors (P)")
    p.add_argument("--shards", type=int, default=2, help="K, compared with 1 shard")
    p.add_argument("--capacity", type=int, default=8,
                   help="hard ceiling of fragments per shard (an add waits for room); the board's ticket bound does "
                        "not bind here (per_update 10**9)")
    p.add_argument("--max-items", type=int, default=32, help="fragments asked for per claim (then taken)")
    p.add_argument("--payloads", nargs="+", default=list(PAYLOADS), choices=list(PAYLOADS))
    p.add_argument("--cartpole-tn", type=int, nargs=2, metavar=("T", "N"), default=[64, 16],
                   help="CartPole fragment size (samples per fragment = T x N)")
    args = p.parse_args()
    if min(args.cartpole_tn) < 1:
        p.error("--cartpole-tn values must be >= 1")
    PAYLOADS["cartpole"].update(T=args.cartpole_tn[0], N=args.cartpole_tn[1])  # before any actor exists
    if args.shards < 2:
        p.error("--shards must be >= 2 (it is compared with 1 shard)")
    if args.seconds <= 0 or args.warmup < 0 or args.rounds < 1 or args.producers < 1:
        p.error("--seconds must be > 0, --warmup >= 0, --rounds >= 1, --producers >= 1")

    P, K = args.producers, args.shards
    labels = ["1 shard", f"{K} shards", "direct"]
    print(f"replay throughput on the ticketed path: {P} producer actors (per fragment one board.poll for a ticket, "
          f"then one add in flight, which the shard confirms with board.stored; producer i feeds shard i % K), "
          f"driver consumer (one board.claim in flight, <= {args.max_items} fragments per claim, then a take to each "
          f"shard it names, returned by value), capacity {args.capacity} fragments/shard, supply board per_update "
          f"10**9 and max_policy_lag 0 (tickets never run out); direct path: driver calls producer.make(), one call "
          f"in flight per producer, no board. {args.rounds} round(s) x ({args.warmup:g} s warm-up + "
          f"{args.seconds:g} s window) per cell, cells interleaved; {os.cpu_count()} cores on this machine.",
          flush=True)
    results: dict[str, dict[str, Tally]] = {}
    with local_ray(P + 2):
        producers = [Producer.remote(i) for i in range(P)]
        prod_pids = ray.get([pr.pid.remote() for pr in producers])
        base_groups = {"consumer": [os.getpid()], "producers": prod_pids, "ray_core": ray_core_pids()}
        for payload in args.payloads:
            kind = PAYLOADS[payload]
            nbytes = ray.get([pr.build.remote(kind) for pr in producers])[0]
            T, N = kind["T"], kind["N"]
            print(f"\n[{payload}] fragment: obs {np.dtype(kind['obs_dtype']).name} {(T, N) + kind['obs_shape']} + "
                  f"8 (T, N) arrays = {T * N} samples, {nbytes / 1e3:,.1f} KB", flush=True)
            cells = {label: Tally() for label in labels}
            for r in range(args.rounds):
                order = labels[r % 3:] + labels[:r % 3]  # rotate so no cell always runs first
                got = {}
                for label in order:
                    k = 0 if label == "direct" else (1 if label == "1 shard" else K)
                    if k:
                        t = shard_cell(producers, k, args, base_groups, T * N)
                    else:
                        t = direct(producers, args.warmup, args.seconds, CpuMeter(base_groups))
                    cells[label].add(t)
                    got[label] = t
                print(f"  round {r + 1}: " + " | ".join(f"{lb} {got[lb].out_sps:,.0f}" for lb in labels)
                      + " samples/s out", flush=True)
            for label in labels:
                t = cells[label]
                print(f"  {label:>9}: in {t.in_sps:>11,.0f} samples/s | out {t.out_sps:>11,.0f} samples/s | "
                      f"{t.mbps:>7,.1f} MB/s | {t.frags_per_s:>6,.0f} fragments/s | "
                      f"{t.fragments / max(t.consumer_calls, 1):.1f} fragments/consumer call | "
                      f"zero-copy get {'yes' if t.zero_copy else 'NO'}", flush=True)
                print(f"  {'':>9}  cpu: {fmt_cpu(t)}", flush=True)
                if label != "direct":
                    n = max(t.fragments, 1)
                    print(f"  {'':>9}  board: {t.board_calls_per_fragment():.2f} round trips/fragment "
                          f"(poll {t.board_polls / n:.2f} + stored {t.board_stored / n:.2f} + claim "
                          f"{t.board_claims / n:.2f}; {t.fragments / max(t.board_claims, 1):.1f} fragments/claim), "
                          f"{t.board_calls / t.seconds:,.0f} board calls/s", flush=True)
            one, many, dr = (cells[lb] for lb in labels)
            print(f"  ratio {K} shards / 1 shard (out): {many.out_sps / one.out_sps:.2f}x", flush=True)
            print(f"  ratio shard path / direct path (out): 1 shard {one.out_sps / dr.out_sps:.2f}x, "
                  f"{K} shards {many.out_sps / dr.out_sps:.2f}x", flush=True)
            if payload == "cartpole":
                best = max(one.out_sps, many.out_sps)
                print(f"  target >= {CARTPOLE_TARGET_SAMPLES_PER_S:,} samples/s through replay shards: "
                      f"{'MET' if best >= CARTPOLE_TARGET_SAMPLES_PER_S else 'NOT MET'} "
                      f"(best {best:,.0f} = {best / CARTPOLE_TARGET_SAMPLES_PER_S:.2f}x target)", flush=True)
            results[payload] = cells

    print("\nsummary (rates pooled over rounds; ratios are within this run)")
    table([("payload", "<9"), ("path", "<9"), ("samples/s in", ">13,.0f"), ("samples/s out", ">14,.0f"),
           ("MB/s", ">8,.1f"), ("cpu-ms/frag", ">11.2f"), ("board calls/frag", ">16.2f"), ("vs 1 shard", ">10"),
           ("vs direct", ">9")],
          [(payload, label, t.in_sps, t.out_sps, t.mbps, t.cpu_ms_per_fragment(),
            "-" if label == "direct" else t.board_calls_per_fragment(),
            f"{t.out_sps / cells['1 shard'].out_sps:.2f}x", f"{t.out_sps / cells['direct'].out_sps:.2f}x")
           for payload, cells in results.items() for label, t in cells.items()], rule=True)
    if "cartpole" in results:
        best = max(t.out_sps for lb, t in results["cartpole"].items() if lb != "direct")
        print(f"cartpole target >= {CARTPOLE_TARGET_SAMPLES_PER_S:,} samples/s via replay shards: "
              f"{'MET' if best >= CARTPOLE_TARGET_SAMPLES_PER_S else 'NOT MET'} ({best:,.0f} samples/s)")
    return 0


if __name__ == "__main__":
    run_main(main)
