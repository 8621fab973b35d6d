"""Replay shard throughput on the ticketed path: samples in and out per second, 1 and K shards, against a direct path.

P producer actors send one prebuilt fragment (CartPole-size vector, ~47 KB, or 84x84x3 uint8 images, ~5.4 MB) over
and over with ``RolloutActor``'s protocol (``board.poll`` for a block of max(16, x) tickets, then adds of x fragments,
one in flight, which the shard confirms with ``board.stored`` calls, one out at a time, each for every add that came
in meanwhile; x = each ``--fragments-per-add`` value, the most per add that ``rollout.fragments_per_add`` allows in a
run, reached there under load: a made-up fragment takes no time, so here it always is; every x measured in the same
run); the driver consumes as a ``DeviceFeed`` does (one ``board.claim`` for up to --max-items, a ``take`` to every
shard named, zero-copy ``ray.get``). Tickets never run out (per_update
10**9, max_policy_lag 0): this is the data plane's ceiling. The direct path moves the same fragments without shard
or board (``producer.make()``). Printed: rates and ratios within one run, board round trips and CPU per fragment
(from /proc; "other" = processes that are not this bench); the only absolute target is the issue's >= 1M samples/s
for CartPole-size fragments, reported as met or not.

``--runtime inprocess`` runs the same producers, board and shards as ``ray.address: inprocess`` runs a job: as
threads of this process (``pipeline/runtime.py``), each call a hand-over between threads, nothing serialized; the
"fragments" then arrive as the producer's own objects, and all CPU is this process's.

    .venv/bin/python bench/replay_throughput.py [--seconds 2] [--rounds 2] [--producers 4] [--shards 2]
        [--capacity 32] [--fragments-per-add 1 8] [--cartpole-tn 64 16] [--payloads cartpole image]
        [--runtime ray|inprocess]
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import ray  # noqa: E402

from bench._common import (CpuMeter, actor_pids, cli, local_ray, parser, ray_core_pids, require, rotated,  # noqa: E402
                           table)
from bench._supply import KINDS, data_plane, make_fragment  # noqa: E402
from pipeline import fragment as F  # noqa: E402
from actors.rollout import TICKETS_PER_POLL  # noqa: E402
from pipeline import runtime  # noqa: E402
from pipeline.protocol import Claim, Poll  # noqa: E402

UNLIMITED = 10**9  # the board's per_update: tickets are created lazily, so this costs nothing

CARTPOLE_TARGET_SAMPLES_PER_S = 1_000_000
PAYLOADS = {"cartpole": dict(KINDS["vector"]), "image": dict(KINDS["image"], obs_shape=(84, 84, 3))}  # RGB frames


@ray.remote(num_cpus=1, max_restarts=0)
class Producer:
    """Holds one prebuilt fragment; feeds it to a shard against the board's tickets, or returns it on request."""

    def __init__(self, actor_id: int):
        self.actor_id = actor_id
        self.fragment: F.Fragment | None = None
        self.copies: list[F.Fragment] = []  # distinct objects for one add of several (each is serialized)
        self.meta: F.FragmentMeta | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self.polls = 0  # board.poll calls (one per fragment while tickets are plentiful)
        self.incarnation = -1  # a fresh one per cell: every cell has its own board

    def build(self, kind: dict, copies: int = 1) -> int:
        self.fragment = make_fragment(kind, 0, np.random.default_rng(self.actor_id), self.actor_id)
        self.copies = [self.fragment] + [F.Fragment({k: a.copy() for k, a in self.fragment.arrays.items()},
                                                    policy_version=0, actor_id=self.actor_id)
                                         for _ in range(copies - 1)]
        self.meta = F.FragmentMeta.of(self.fragment)
        return self.fragment.nbytes

    def make(self) -> F.Fragment:
        """The direct path: the fragment as this method's return value."""
        return self.fragment

    def start_feeding(self, board, shard, shard_index: int, per_add: int = 1) -> None:
        self._stop.clear()
        self.polls = 0
        self.incarnation += 1
        self._error = None
        self._thread = threading.Thread(target=self._feed, args=(board, shard, shard_index, per_add), daemon=True)
        self._thread.start()

    def poll_count(self) -> int:
        return self.polls

    def _poll(self, board, shard_index: int, wait_s: float, per_add: int):
        tickets, _, _ = runtime.get(board.poll.remote(Poll(self.actor_id, self.incarnation, 0, shard_index, 0, [], wait_s,
                                                           max_tickets=per_add)))
        self.polls += 1
        return tickets

    def _feed(self, board, shard, shard_index: int, per_add: int) -> None:
        pending = None
        block = max(TICKETS_PER_POLL, per_add)  # a made-up fragment takes no time: RolloutActor's largest block
        try:
            while not self._stop.is_set():
                # As RolloutActor: a block of tickets before the fragments, then one add_many per `per_add` of them.
                tickets = self._poll(board, shard_index, 0.0, block)
                while not tickets and not self._stop.is_set():
                    tickets = self._poll(board, shard_index, 0.2, block)
                if not tickets:
                    return
                for first in range(0, len(tickets), per_add):
                    chunk = tickets[first:first + per_add]
                    if pending is not None:
                        # Wait for the previous add (a full shard blocks us), but keep noticing stop().
                        while True:
                            try:
                                runtime.get(pending, timeout=0.2)
                                break
                            except ray.exceptions.GetTimeoutError:
                                if self._stop.is_set():
                                    return
                    pending = shard.add_many.remote([(t, self.meta, f) for t, f in zip(chunk, self.copies)],
                                                    producer=self.actor_id, ack="held")
        except Exception as e:  # reported by stop_feeding()
            self._error = f"{type(e).__name__}: {e}"

    def stop_feeding(self) -> str | None:
        """Stops the feeding thread; the error that ended it early, if any."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return self._error


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
    board_stored: int = 0  # shards' stored calls (each confirms one add or several)
    board_claims: int = 0  # the consumer claiming stored fragments
    zero_copy: bool = True
    cpu_s: collections.Counter = field(default_factory=collections.Counter)

    def add(self, o: "Tally") -> None:
        for f in fields(self):
            if f.name not in ("zero_copy", "cpu_s"):  # the counts
                setattr(self, f.name, getattr(self, f.name) + getattr(o, f.name))
        self.zero_copy &= o.zero_copy
        self.cpu_s.update(o.cpu_s)

    in_sps = property(lambda self: self.samples_in / self.seconds)
    out_sps = property(lambda self: self.samples_out / self.seconds)
    mbps = property(lambda self: self.bytes_out / self.seconds / 1e6)
    frags_per_s = property(lambda self: self.fragments / self.seconds)
    board_calls = property(lambda self: self.board_polls + self.board_stored + self.board_claims)

    def took(self, frag: F.Fragment, in_window: bool) -> None:
        self.zero_copy &= _check(frag)
        if in_window:
            self.samples_out += frag.num_samples
            self.bytes_out += frag.nbytes
            self.fragments += 1

    def cpu_pct(self) -> dict[str, float]:
        pct = {k: 100.0 * v / self.seconds for k, v in self.cpu_s.items()}
        ours = sum(pct.get(k, 0.0) for k in OUR_GROUPS)
        pct["other"] = max(pct.get("machine", 0.0) - ours, 0.0)  # everything else on the machine
        return pct

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
def window(tally: Tally, meter: CpuMeter, warmup_s: float, seconds: float, edge=lambda: None, edges=None):
    """The consumer loop's clock: yields False for ``warmup_s``, then True for ``seconds``; sets ``tally``'s seconds
    and CPU, and appends ``edge()`` to ``edges`` at the window's start and end."""
    edges = [] if edges is None else edges
    t_start = time.perf_counter() + warmup_s
    while time.perf_counter() < t_start:
        yield False
    edges.append(edge())
    cpu0, t_start = meter.snap(), time.perf_counter()
    while time.perf_counter() < t_start + seconds:
        yield True
    t_stop, cpu1 = time.perf_counter(), meter.snap()
    edges.append(edge())
    tally.seconds, tally.cpu_s = t_stop - t_start, _cpu_delta(cpu0, cpu1)


def drain_shards(board, shards, producers, max_items: int, warmup_s: float, seconds: float, meter: CpuMeter,
                 frag_samples: int) -> Tally:
    """Driver as consumer, as a learner's feed: claim from the board (one claim in flight), then take from every
    shard the claim names at once; the take returns the fragments themselves."""
    failed: list = []  # claimed but not in their shard: handed back with the next claim (none in a healthy run)

    def claim():
        return board.claim.remote(Claim(0, 0, max_items, 0.05, failed, min_items=max_items))  # as a feed asks

    def board_counts():
        st = runtime.get(board.stats.remote())
        polls = sum(runtime.get([p.poll_count.remote() for p in producers]))
        # The board's own count of stored calls (each confirms every add a shard got meanwhile).
        return st["fragments_stored"], st["board_calls"].get("stored", 0), polls

    claim_ref, takes, tally, counts = claim(), {}, Tally(), []
    for in_window in window(tally, meter, warmup_s, seconds, board_counts, counts):
        ready, _ = runtime.wait([claim_ref, *takes], num_returns=1)
        ref = ready[0]
        if ref is claim_ref:
            claims = runtime.get(ref)
            failed = []
            for index, (_, tickets) in claims.items():
                takes[shards[index].take.remote(tickets)] = len(tickets)
            claim_ref = claim()
            tally.board_claims += in_window
            continue
        del takes[ref]
        items, missing = runtime.get(ref)
        failed += missing
        tally.consumer_calls += in_window
        got = [frag for _, frag in items]
        for frag in got:
            tally.took(frag, in_window)
        del got, items
    (stored0, confirmed0, polls0), (stored1, confirmed1, polls1) = counts
    tally.samples_in = (stored1 - stored0) * frag_samples
    tally.board_stored = confirmed1 - confirmed0
    tally.board_polls = polls1 - polls0
    return tally


def direct(producers, warmup_s: float, seconds: float, meter: CpuMeter) -> Tally:
    """Driver calls producer.make(), one call in flight per producer, and ray.gets the result."""
    inflight = {p.make.remote(): i for i, p in enumerate(producers)}
    tally = Tally()
    for in_window in window(tally, meter, warmup_s, seconds):
        ready, _ = runtime.wait(list(inflight), num_returns=1)
        i = inflight.pop(ready[0])
        frag = runtime.get(ready[0])
        inflight[producers[i].make.remote()] = i
        tally.consumer_calls += in_window
        tally.took(frag, in_window)
        del frag
    runtime.get(list(inflight))  # let the last calls finish before the producers are reused
    tally.samples_in = tally.samples_out
    return tally


def shard_cell(producers, num_shards: int, per_add: int, args, base_groups: dict, frag_samples: int) -> Tally:
    """A fresh board and K shards, wired as the driver wires them; tickets never run out (see the docstring);
    each producer sends ``per_add`` fragments per poll and add."""
    inprocess = args.runtime == "inprocess"
    with data_plane(num_shards, args.capacity, UNLIMITED, 0, inprocess=inprocess) as (board, shards, _):
        # In process everything is this one process: its CPU is the consumer's group.
        meter = CpuMeter(base_groups if inprocess else
                         {**base_groups, "shards": actor_pids(shards), "board": actor_pids([board])})
        # Producer i feeds shard i % K, as the driver wires rollout actors.
        runtime.get([p.start_feeding.remote(board, shards[i % num_shards], i % num_shards, per_add)
                     for i, p in enumerate(producers)])
        try:
            tally = drain_shards(board, shards, producers, args.max_items, args.warmup, args.seconds, meter,
                                 frag_samples)
        finally:
            errors = [e for e in runtime.get([p.stop_feeding.remote() for p in producers], timeout=30) if e]
        if errors:
            raise RuntimeError(f"producer failed: {errors[0]}")
        return tally


def make_parser():
    p = parser(__doc__)
    p.add_argument("--seconds", type=float, default=2.0, help="measuring window per cell and round")
    p.add_argument("--warmup", type=float, default=0.5, help="seconds run before each window")
    p.add_argument("--rounds", type=int, default=2,
                   help="each cell is measured this many times, cells interleaved; rates pool the rounds")
    p.add_argument("--producers", type=int, default=4, help="producer actors (P)")
    p.add_argument("--shards", type=int, default=2, help="K, compared with 1 shard")
    p.add_argument("--capacity", type=int, default=32,
                   help="hard ceiling of fragments per shard (an add waits for room); the board's ticket bound does "
                        "not bind here (per_update 10**9)")
    p.add_argument("--max-items", type=int, default=32, help="fragments asked for per claim (then taken)")
    p.add_argument("--fragments-per-add", type=int, nargs="+", default=[1, 8], metavar="K",
                   help="fragments each producer sends per shard add (rollout.fragments_per_add, reached under load); "
                        "every value is measured with 1 and --shards shards")
    p.add_argument("--runtime", choices=["ray", "inprocess"], default="ray",
                   help="ray: producers, board and shards are Ray actors (what a cluster runs); inprocess: the same "
                        "classes as ray.address: inprocess runs them, threads of this process")
    p.add_argument("--payloads", nargs="+", default=list(PAYLOADS), choices=list(PAYLOADS))
    p.add_argument("--cartpole-tn", type=int, nargs=2, metavar=("T", "N"), default=[64, 16],
                   help="CartPole fragment size (samples per fragment = T x N)")
    return p


def run(args) -> tuple[dict, None]:
    require(min(args.cartpole_tn) >= 1, "--cartpole-tn values must be >= 1")
    require(args.shards >= 2, "--shards must be >= 2 (it is compared with 1 shard)")
    require(args.seconds > 0 and args.warmup >= 0 and args.rounds >= 1 and args.producers >= 1,
            "--seconds must be > 0, --warmup >= 0, --rounds >= 1, --producers >= 1")
    require(min(args.fragments_per_add) >= 1, "--fragments-per-add values must be >= 1")
    PAYLOADS["cartpole"].update(T=args.cartpole_tn[0], N=args.cartpole_tn[1])  # before any actor exists
    P, K = args.producers, args.shards
    cell_of = {}  # label -> (shards, fragments per add)
    for k in dict.fromkeys(args.fragments_per_add):
        cell_of[f"1 shard x{k}"] = (1, k)
        cell_of[f"{K} shards x{k}"] = (K, k)
    labels = [*cell_of, "direct"]
    first = labels[0]
    print(f"replay throughput on the ticketed path, {args.runtime} runtime: {P} producer actors (per add of x "
          f"fragments one board.poll for x tickets, then one add in flight, which the shard confirms with one "
          f"board.stored; producer i feeds shard i % K), driver consumer (one board.claim in flight, "
          f"<= {args.max_items} fragments per claim, then a take to each "
          f"shard it names, returned by value), capacity {args.capacity} fragments/shard, supply board per_update "
          f"10**9 and max_policy_lag 0 (tickets never run out); direct path: driver calls producer.make(), one call "
          f"in flight per producer, no board. {args.rounds} round(s) x ({args.warmup:g} s warm-up + "
          f"{args.seconds:g} s window) per cell, cells interleaved; {os.cpu_count()} cores on this machine.",
          flush=True)
    results: dict[str, dict[str, Tally]] = {}
    inprocess = args.runtime == "inprocess"
    with contextlib.nullcontext() if inprocess else local_ray(P + 2):
        producers = [runtime.create(Producer, {}, i, inprocess=inprocess) for i in range(P)]
        base_groups = ({"consumer": [os.getpid()]} if inprocess else
                       {"consumer": [os.getpid()], "producers": actor_pids(producers), "ray_core": ray_core_pids()})
        for payload in args.payloads:
            kind = PAYLOADS[payload]
            nbytes = runtime.get([pr.build.remote(kind, max(args.fragments_per_add)) for pr in producers])[0]
            T, N = kind["T"], kind["N"]
            print(f"\n[{payload}] fragment: obs {np.dtype(kind['obs_dtype']).name} {(T, N) + kind['obs_shape']} + "
                  f"8 (T, N) arrays = {T * N} samples, {nbytes / 1e3:,.1f} KB", flush=True)
            cells = {label: Tally() for label in labels}
            for r in range(args.rounds):
                got = {}
                for label in rotated(labels, r):  # so no cell always runs first
                    t = (direct(producers, args.warmup, args.seconds, CpuMeter(base_groups)) if label == "direct"
                         else shard_cell(producers, *cell_of[label], args, base_groups, T * N))
                    cells[label].add(t)
                    got[label] = t
                print(f"  round {r + 1}: " + " | ".join(f"{lb} {got[lb].out_sps:,.0f}" for lb in labels)
                      + " samples/s out", flush=True)
            for label in labels:
                t = cells[label]
                print(f"  {label:>13}: in {t.in_sps:>11,.0f} samples/s | out {t.out_sps:>11,.0f} samples/s | "
                      f"{t.mbps:>7,.1f} MB/s | {t.frags_per_s:>6,.0f} fragments/s | "
                      f"{t.fragments / max(t.consumer_calls, 1):.1f} fragments/consumer call | "
                      + ("the producer's own object (in process)" if inprocess else
                         f"zero-copy get {'yes' if t.zero_copy else 'NO'}"), flush=True)
                pct = t.cpu_pct()
                print(f"  {'':>13}  cpu: " + ", ".join(f"{k} {pct[k]:.0f}%" for k in (*OUR_GROUPS, "other") if k in pct)
                      + f"; {t.cpu_ms_per_fragment():.2f} cpu-ms/fragment", flush=True)
                if label != "direct":
                    n = max(t.fragments, 1)
                    print(f"  {'':>13}  board: {t.board_calls_per_fragment():.2f} round trips/fragment "
                          f"(poll {t.board_polls / n:.2f} + stored {t.board_stored / n:.2f} + claim "
                          f"{t.board_claims / n:.2f}; {t.fragments / max(t.board_claims, 1):.1f} fragments/claim), "
                          f"{t.board_calls / t.seconds:,.0f} board calls/s", flush=True)
            dr = cells["direct"]
            for k in dict.fromkeys(args.fragments_per_add):
                one, many = cells[f"1 shard x{k}"], cells[f"{K} shards x{k}"]
                print(f"  x{k}: ratio {K} shards / 1 shard (out) {many.out_sps / one.out_sps:.2f}x; shard path / "
                      f"direct path: 1 shard {one.out_sps / dr.out_sps:.2f}x, {K} shards "
                      f"{many.out_sps / dr.out_sps:.2f}x; against x{args.fragments_per_add[0]} with 1 shard "
                      f"{one.out_sps / cells[first].out_sps:.2f}x", flush=True)
            results[payload] = cells

    print("\nsummary (rates pooled over rounds; ratios are within this run)")
    table([("payload", "<9"), ("path", "<13"), ("samples/s in", ">13,.0f"), ("samples/s out", ">14,.0f"),
           ("MB/s", ">8,.1f"), ("cpu-ms/frag", ">11.2f"), ("board calls/frag", ">16.2f"), (f"vs {first}", ">14"),
           ("vs direct", ">9")],
          [(payload, label, t.in_sps, t.out_sps, t.mbps, t.cpu_ms_per_fragment(),
            "-" if label == "direct" else t.board_calls_per_fragment(),
            f"{t.out_sps / cells[first].out_sps:.2f}x", f"{t.out_sps / cells['direct'].out_sps:.2f}x")
           for payload, cells in results.items() for label, t in cells.items()], rule=True)
    if "cartpole" in results:
        best = max(t.out_sps for lb, t in results["cartpole"].items() if lb != "direct")
        print(f"cartpole target >= {CARTPOLE_TARGET_SAMPLES_PER_S:,} samples/s via replay shards: "
              f"{'MET' if best >= CARTPOLE_TARGET_SAMPLES_PER_S else 'NOT MET'} ({best:,.0f} samples/s = "
              f"{best / CARTPOLE_TARGET_SAMPLES_PER_S:.2f}x target)")
    return {payload: {label: {"samples_per_s_in": t.in_sps, "samples_per_s_out": t.out_sps, "mb_per_s": t.mbps,
                              "cpu_ms_per_fragment": t.cpu_ms_per_fragment(), "cpu_pct": t.cpu_pct(),
                              "board_calls_per_fragment": t.board_calls_per_fragment(), "zero_copy": t.zero_copy}
                      for label, t in cells.items()} for payload, cells in results.items()}, None


if __name__ == "__main__":
    cli(make_parser, run)
