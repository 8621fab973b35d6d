"""The control plane at scale: hundreds of simulated rollout actors and up to 64 simulated learners against the real
supply board and real replay shards, through real Ray calls.

A "swarm" actor (a few processes) runs many rollout actors as coroutines, each with ``RolloutActor``'s protocol
(a poll for a block of tickets with its stats report, then one add in flight per actor, adds carrying what was made
while the previous one was out, each acknowledged once its shard holds it); "making" a fragment is a sleep of ``--fragment-s`` (a CartPole-size fragment's time
on a real actor). A learner swarm runs L learners as coroutines with ``DeviceFeed``'s protocol: by default the
group claims as one (``learner.group_claims``: "rank 0" claims what every rank is still owed in one call and each
rank takes its part from the shards named); ``--claims rank`` has each learner claim its own whole remaining batch.
When every learner has its batch, "rank 0" publishes the next version, as a real group would after its update. Fragments are tiny: the board's work is per
call and per fragment, not per byte.

``--relays N`` runs each cell again with N node relays (``pipeline/relay.py``), actor a polling relay a % N as the
actors of N nodes would: the board then sees one ``relay_poll`` per block for a node instead of one ``poll`` per
actor, and shard i, on "node" i % N, confirms through that node's relay (``stored_many``: one call for the node's
shards, not one per shard). On a machine of few cores the relays' processes take CPU from the simulated actors, which a cluster's relays
(one on each node) do not: compare the board's calls per stored fragment there, not the fragment rates.

Printed per cell (actors x learners x relays): fragments/s through the board, the board's CPU (its process, from /proc) per
fragment and in all, board calls per fragment and per second (the board's own counts), p50/p99 latency of a poll
and of a claim (as the callers see it), and the projected ceiling of one board (fragments/s at a full core, in
samples/s for CartPole-size 2,048-sample and Atari-size 1,024-frame fragments).

The second table: the driver's calls about rollout actors per iteration, from a real in-process run
(``ray.address: inprocess``, CartPole with tiny fragments) at each ``--driver-actors`` count: the board call that
reads every actor's stats, health calls, and until_done calls (one per actor incarnation, at start).

    .venv/bin/python bench/control_plane.py [--actors 10 100 1000] [--learners 1 8 64] [--seconds 5]
        [--fragment-s 0.2] [--shards 4] [--swarms 4] [--relays 0 4] [--claims group rank] [--driver-actors 1 8 64]
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import ray  # noqa: E402

from bench._common import CpuMeter, actor_pids, local_ray, parser, run_main, table  # noqa: E402
from actors.rollout import TICKET_WAIT_S  # noqa: E402
from bench._supply import make_fragment  # noqa: E402
from pipeline import fragment as F  # noqa: E402
from pipeline import runtime  # noqa: E402
from pipeline.supply import CLAIM_WAIT_S  # noqa: E402

TINY = dict(modality="vector", obs_shape=(1,), obs_dtype=np.float32, T=1, N=1)
CARTPOLE_SAMPLES, ATARI_FRAMES = 2048, 1024  # per fragment: 128 steps x 16 envs; 128 steps x 8 envs
#: The node feeders' clocks run to this resolution (a quarter of the shortest clock they follow, STORED_GATHER_S).
CLOCK_TICK_S = 0.005
REPORT = {"env_steps": 0, "episodes": [], "error": None, "running": True, "no_progress_s": 0.0}  # a stats report's size


def percentile(xs, q):
    return float(np.percentile(xs, q)) * 1e3 if xs else float("nan")


@ray.remote(num_cpus=0)
class ActorSwarm:
    """Many simulated rollout actors, as coroutines of one process."""

    def __init__(self, first_id: int, count: int, board, shards: list, fragment_s: float, block: int,
                 per_add: int, relays: list = ()):
        self.ids = range(first_id, first_id + count)
        self.board, self.shards, self.relays = board, shards, list(relays)
        self.fragment_s, self.block, self.per_add = fragment_s, block, per_add
        self.fragment = make_fragment(TINY, 0, np.random.default_rng(0))
        self.meta = F.FragmentMeta.of(self.fragment)
        self.poll_s: list[float] = []
        self.made = 0
        self._stop = False

    async def _actor(self, actor_id: int) -> None:
        shard_index = actor_id % len(self.shards)
        shard, version, pending = self.shards[shard_index], -1, None
        made: list = []
        while not self._stop:
            if made:  # as RolloutActor: what was made goes, and the add in flight is settled, before a poll
                if pending is not None:
                    await pending
                pending, made = shard.add_many.remote(made, producer=actor_id, ack="held"), []
            if pending is not None:
                await pending
                pending = None
            t0 = time.perf_counter()
            # Actor a is on "node" a % relays (its relay), or polls the board itself.
            source = self.relays[actor_id % len(self.relays)] if self.relays else self.board
            tickets, news, _ = await source.poll.remote(actor_id, 0, version, shard_index, 0, [], TICKET_WAIT_S,
                                                        max_tickets=self.block, report=REPORT)
            self.poll_s.append(time.perf_counter() - t0)
            if news is not None:
                version = news[0]
            for ticket in tickets:
                await asyncio.sleep(self.fragment_s)  # "making" it
                self.made += 1
                made.append((ticket, self.meta, self.fragment))
                if len(made) >= self.per_add or pending is None or (await _done(pending)):
                    if pending is not None:
                        await pending
                    pending, made = shard.add_many.remote(made, producer=actor_id, ack="held"), []

    async def stop(self) -> None:
        self._stop = True

    async def run(self, seconds: float) -> dict:
        """Until stop() or ``seconds``."""
        self._stop = False
        tasks = [asyncio.ensure_future(self._actor(i)) for i in self.ids]
        deadline = time.monotonic() + seconds
        while not self._stop and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._stop = True
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        out = {"poll_s": self.poll_s, "made": self.made}
        self.poll_s, self.made = [], 0
        return out


async def _done(ref) -> bool:
    done, _ = ray.wait([ref], timeout=0)
    return bool(done)


@ray.remote(num_cpus=0)
class LearnerSwarm:
    """L simulated learners in one process: the group (or each learner) claims every update's batch; all done, the
    next version."""

    def __init__(self, board, learners: int, per_learner: int, group: bool = True, take: bool = True):
        """``take=False``: claimed fragments count as taken (at a set rate the shards are not simulated: a take is
        a call between a learner and a shard, not the board's work)."""
        self.board, self.learners, self.per_learner, self.group = board, learners, per_learner, group
        self.take = take
        self.claim_s: list[float] = []
        self.trained = 0
        # What an update that ran past a run's end still needs, for the next run to go on with (its claimed
        # fragments are taken: claiming them again would find nothing, and the cell would measure a stall).
        self._owed: dict = {}  # update -> {rank: fragments}
        self._have: dict = {}  # (rank, update) -> fragments

    async def _learn(self, rank: int, update: int, give_up: float) -> bool:
        """This learner's batch of ``update``; False if it was not all there by ``give_up`` (never cancelled in a
        claim: a claimed ticket that is never taken would hold the update forever)."""
        have = self._have.pop((rank, update), 0)
        while have < self.per_learner:
            if time.monotonic() > give_up:
                self._have[(rank, update)] = have
                return False
            t0 = time.perf_counter()
            claims = await self.board.claim.remote(rank, update, self.per_learner - have, CLAIM_WAIT_S, [], 0,
                                                   min_items=self.per_learner - have)
            self.claim_s.append(time.perf_counter() - t0)
            for handle, tickets in claims.values():
                have += len((await handle.take.remote(tickets))[0]) if self.take else len(tickets)
        return True

    async def _learn_group(self, update: int, give_up: float) -> bool:
        """The group's batches of ``update`` as ``DeviceFeed._pull_lead`` claims them: one claim for what every
        rank is still owed, cut into the ranks' parts, each part taken from its shards (sending a part to its rank
        is a call between learners, not to the board: not simulated)."""
        from pipeline.feed import split_claims

        owed = self._owed.pop(update, None) or {r: self.per_learner for r in range(self.learners)}
        while any(owed.values()):
            if time.monotonic() > give_up:
                self._owed[update] = owed
                return False
            want = sum(owed.values())
            t0 = time.perf_counter()
            claims = await self.board.claim.remote(0, update, want, CLAIM_WAIT_S, [], 0, min_items=want)
            self.claim_s.append(time.perf_counter() - t0)
            parts = split_claims(claims, owed)
            if self.take:
                await asyncio.gather(*(handle.take.remote(tickets) for part in parts.values()
                                       for handle, tickets in part.values()))
        return True

    async def run(self, seconds: float, first_update: int) -> dict:
        """Whole updates until ``seconds`` have passed; returns what was trained and the time it took."""
        t0 = time.monotonic()
        deadline, update, trained = t0 + seconds, first_update, 0
        while time.monotonic() < deadline:
            if self.group and self.learners > 1:
                done = [await self._learn_group(update, deadline + 10.0)]
            else:
                done = await asyncio.gather(*(self._learn(r, update, deadline + 10.0) for r in range(self.learners)))
            if not all(done):
                break
            trained += self.learners * self.per_learner
            update += 1
            await self.board.publish.remote(update, [None])
        out = {"claim_s": self.claim_s, "trained": trained, "next_update": update,
               "seconds": time.monotonic() - t0}
        self.claim_s = []
        return out


@ray.remote(num_cpus=0)
class NodeFeeder:
    """One node at a set fragment rate, as the board sees it through the node's relay: the relay's ``relay_poll``
    once every ``RELAY_PACE_S`` for the tickets its actors will take (with the stats reports of the actors that
    polled it meanwhile), and its shards' confirmations carried up in one ``stored_many`` on the shards' clock
    (``STORED_PACE_S``; ``STORED_GATHER_S`` for an update the board said is at its tail, ``hurry``). Its actors
    are a delay of ``fragment_s`` per ticket. What the board receives is what a node's real relay and shards send
    it (same calls, same arguments, same clocks); nothing local to the node runs, so 2 cores can drive the board
    at the rate of a cluster. It is also its shards' handle in the board's directory (``hurry``, ``drop``)."""

    def __init__(self, board, node: int, nodes: int, shards: list[int], actors: int, rate: float,
                 fragment_s: float, block: int):
        from pipeline.relay import RELAY_ID_BASE

        self.board, self.relay_id, self.shards = board, RELAY_ID_BASE + node, shards
        self.actor_ids = [a for a in range(actors) if a % nodes == node]
        self.rate, self.fragment_s, self.block = rate, fragment_s, block
        self.version, self.shard_epoch, self.gone_seen = -1, -1, 0
        self.making: collections.deque = collections.deque()  # (done at, ticket), in issue order
        self.hurried = -1  # the newest update the board said is at its tail
        self._reporter = itertools.cycle(self.actor_ids)
        self._stop = False

    async def hurry(self, update: int) -> None:
        self.hurried = max(self.hurried, update)

    async def drop(self, tickets) -> None:
        pass

    async def _pump(self) -> None:
        from pipeline.relay import BOARD_WAIT_S, RELAY_PACE_S

        # Each actor polls its relay once per block it makes: this many reports reach the relay in a pace.
        reports_per_call = max(1, round(self.rate * RELAY_PACE_S / self.block))
        owed, last = 0.0, time.monotonic()  # tickets the node's actors would have taken by now at the rate
        while not self._stop:
            start = time.monotonic()
            owed = min(owed + self.rate * (start - last), self.rate)  # a second's worth at most: no burst after a stall
            last = start
            want = round(owed)
            reports = {a: (0, REPORT) for a in itertools.islice(self._reporter, reports_per_call)}
            tickets, news, shards, gone, _ = await self.board.relay_poll.remote(
                self.relay_id, 0, self.version, [], BOARD_WAIT_S if want else 0.0, want, reports,
                self.shard_epoch, self.gone_seen, len(self.actor_ids))
            if news is not None:
                self.version = news[0]
            if shards is not None:
                self.shard_epoch = shards[0]
            if gone:
                self.gone_seen = gone[-1][0]
            owed -= len(tickets)
            done_at = time.monotonic() + self.fragment_s
            self.making.extend((done_at, t) for t in tickets)
            await asyncio.sleep(max(0.0, start + RELAY_PACE_S - time.monotonic()))

    async def _confirm(self) -> None:
        """The node's shards and relay, on their clocks (``ReplayShard._gather``, ``NodeRelay._confirm_loop``) to
        the nearest CLOCK_TICK_S: a shard sends what reached it STORED_PACE_S after the first of it (STORED_GATHER_S
        when it holds a fragment of an update the board said is at its tail) to the relay, which carries its
        shards' confirmations up CONFIRM_GATHER_S after the first (STORED_GATHER_S when urgent), one call at a
        time."""
        from pipeline.relay import CONFIRM_GATHER_S
        from pipeline.replay import STORED_GATHER_S
        from pipeline.supply import STORED_PACE_S

        held = {s: [] for s in self.shards}
        first = dict.fromkeys(self.shards)  # when the first fragment now held reached the shard
        oldest = dict.fromkeys(self.shards)  # the lowest update a shard holds a fragment of
        turn = itertools.cycle(self.shards)
        queue, queued_at, urgent_queue, out = [], None, False, None
        while not self._stop:
            await asyncio.sleep(CLOCK_TICK_S)
            now = time.monotonic()
            while self.making and self.making[0][0] <= now:
                ticket = self.making.popleft()[1]
                s = next(turn)
                held[s].append(ticket)
                first[s] = first[s] or now
                oldest[s] = ticket.update if oldest[s] is None else min(oldest[s], ticket.update)
            for s in self.shards:
                urgent = held[s] and oldest[s] <= self.hurried
                if held[s] and now - first[s] >= (STORED_GATHER_S if urgent else STORED_PACE_S):
                    queue.append((s, held[s]))
                    queued_at, urgent_queue = queued_at or now, urgent_queue or urgent
                    held[s], first[s], oldest[s] = [], None, None
            if queue and (out is None or (await _done(out))) and \
                    now - queued_at >= (STORED_GATHER_S if urgent_queue else CONFIRM_GATHER_S):
                out = self.board.stored_many.remote(queue)
                queue, queued_at, urgent_queue = [], None, False

    async def run(self, seconds: float) -> None:
        self._stop = False
        tasks = [asyncio.ensure_future(self._pump()), asyncio.ensure_future(self._confirm())]
        deadline = time.monotonic() + seconds
        while not self._stop and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._stop = True
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def stop(self) -> None:
        self._stop = True


def cell(actors: int, learners: int, relays: int, claims: str, args) -> dict:
    from cluster.control import MAX_ROLLOUT_ACTORS
    from pipeline.relay import RELAY_ID_BASE, NodeRelay
    from pipeline.replay import ReplayShard
    from pipeline.supply import SupplyBoard, board_concurrency

    # Enough tickets that every actor can hold a block: the board's work, not the ticket supply, is what is measured.
    per_learner = max(1, -(-2 * actors // learners))
    per_update = per_learner * learners
    board = SupplyBoard.options(max_concurrency=board_concurrency(MAX_ROLLOUT_ACTORS, args.shards, learners)).remote(
        per_update, 1, args.shards, expected_actors=actors)
    relay_handles = [NodeRelay.options(max_concurrency=MAX_ROLLOUT_ACTORS + 16).remote(board, RELAY_ID_BASE + k)
                     for k in range(relays)]
    # Shard i on "node" i % relays, confirming through that node's relay (as the graph wires them).
    shards = [ReplayShard.remote(i, 4 * per_update, board, relay=relay_handles[i % relays] if relays else None)
              for i in range(args.shards)]
    runtime.get([board.register_shard.remote(i, s) for i, s in enumerate(shards)])
    runtime.get(board.publish.remote(0, [None]))
    per_swarm = -(-actors // args.swarms)
    swarms = [ActorSwarm.remote(k * per_swarm, min(per_swarm, actors - k * per_swarm), board, shards,
                                args.fragment_s, args.block, args.per_add, relay_handles)
              for k in range(args.swarms) if k * per_swarm < actors]
    learn = LearnerSwarm.remote(board, learners, per_learner, group=claims == "group")
    # Every process up before anything runs: on few cores, a dozen relays' start-up would eat the warm-up.
    runtime.get([h.__ray_ready__.remote() for h in (*relay_handles, *swarms, learn)])
    try:
        meter = CpuMeter({"board": actor_pids([board]), "relays": actor_pids(relay_handles)})
        total = args.warmup + args.seconds
        runs = [s.run.remote(total + 60.0) for s in swarms]  # stopped once the window's last update is in
        warm = learn.run.remote(args.warmup, 0)
        warm_out = runtime.get(warm)
        st0, cpu0 = runtime.get(board.stats.remote()), meter.snap()
        calls0 = st0["board_calls"]
        out = runtime.get(learn.run.remote(args.seconds, warm_out["next_update"]))
        st1, cpu1 = runtime.get(board.stats.remote()), meter.snap()
        calls1 = st1["board_calls"]
        seconds = out["seconds"]
        runtime.get([s.stop.remote() for s in swarms])
        polls = [x for r in runtime.get(runs) for x in r["poll_s"]]
    finally:
        for a in [*swarms, learn, *shards, *relay_handles, board]:
            runtime.kill(a)
    board_cpu, relay_cpu = (CpuMeter.delta(cpu0, cpu1)[k] for k in ("board", "relays"))
    calls = {k: calls1.get(k, 0) - calls0.get(k, 0)
             for k in ("poll", "relay_poll", "stored", "stored_many", "claim", "publish", "hurry")}
    frags = max(out["trained"], 1)
    stored = max(st1["fragments_stored"] - st0["fragments_stored"], 1)
    return dict(actors=actors, learners=learners, relays=relays, claims=claims, frags_per_s=out["trained"] / seconds,
                board_pct=100 * board_cpu / seconds, cpu_ms_per_frag=1e3 * board_cpu / frags,
                relay_pct=100 * relay_cpu / seconds, stored_per_s=stored / seconds,
                cpu_ms_per_stored=1e3 * board_cpu / stored, calls_per_stored=sum(calls.values()) / stored,
                calls_per_frag=sum(calls.values()) / frags, calls_per_s=sum(calls.values()) / seconds,
                poll_p50=percentile(polls, 50), poll_p99=percentile(polls, 99),
                claim_p50=percentile(out["claim_s"], 50), claim_p99=percentile(out["claim_s"], 99),
                calls=calls)


def cell_at_rate(actors: int, learners: int, nodes: int, claims: str, rate: float, args) -> dict:
    """The board alone at ``rate`` fragments a second: ``nodes`` NodeFeeders (each node's relay and shards, as the
    board sees them) and the learner swarm (claims, publishes; no takes) against the real board."""
    from cluster.control import MAX_ROLLOUT_ACTORS
    from pipeline.supply import SupplyBoard, board_concurrency

    if nodes > args.shards:
        raise ValueError(f"--rates: every node needs a shard of its own: {nodes} nodes, --shards {args.shards}")
    per_learner = max(1, -(-2 * actors // learners))
    per_update = per_learner * learners
    board = SupplyBoard.options(max_concurrency=board_concurrency(MAX_ROLLOUT_ACTORS, args.shards, learners)).remote(
        per_update, 1, args.shards, expected_actors=actors)
    feeders = [NodeFeeder.remote(board, k, nodes, [i for i in range(args.shards) if i % nodes == k], actors,
                                 rate / nodes, args.fragment_s, args.block) for k in range(nodes)]
    runtime.get([board.register_shard.remote(i, feeders[i % nodes]) for i in range(args.shards)])
    runtime.get(board.publish.remote(0, [None]))
    learn = LearnerSwarm.remote(board, learners, per_learner, group=claims == "group", take=False)
    runtime.get([h.__ray_ready__.remote() for h in (*feeders, learn)])
    try:
        meter = CpuMeter({"board": actor_pids([board]), "feeders": actor_pids(feeders), "learners": actor_pids([learn])})
        runs = [f.run.remote(args.warmup + args.seconds + 60.0) for f in feeders]
        warm_out = runtime.get(learn.run.remote(args.warmup, 0))
        st0, cpu0 = runtime.get(board.stats.remote()), meter.snap()
        out = runtime.get(learn.run.remote(args.seconds, warm_out["next_update"]))
        st1, cpu1 = runtime.get(board.stats.remote()), meter.snap()
        runtime.get([f.stop.remote() for f in feeders])
        runtime.get(runs)
    finally:
        for a in [*feeders, learn, board]:
            runtime.kill(a)
    cpu = CpuMeter.delta(cpu0, cpu1)
    seconds, frags = out["seconds"], max(out["trained"], 1)
    calls = {k: st1["board_calls"].get(k, 0) - st0["board_calls"].get(k, 0)
             for k in ("relay_poll", "stored_many", "claim", "publish", "hurry")}
    return dict(actors=actors, learners=learners, nodes=nodes, claims=claims, rate=rate,
                frags_per_s=out["trained"] / seconds, board_pct=100 * cpu["board"] / seconds,
                cpu_ms_per_frag=1e3 * cpu["board"] / frags, calls_per_s=sum(calls.values()) / seconds,
                harness_pct=100 * (cpu["feeders"] + cpu["learners"]) / seconds,
                machine_pct=100 * cpu["machine"] / seconds,
                claim_p50=percentile(out["claim_s"], 50), claim_p99=percentile(out["claim_s"], 99), calls=calls)


def driver_calls(actors: int) -> dict:
    """A real in-process run: the supervisor's calls about rollout actors, per iteration."""
    from cluster import config as config_mod
    from cluster.driver import Trainer

    root = Path(__file__).resolve().parent.parent
    cfg = config_mod.load(str(root / "configs/cartpole.yaml"), [
        "ray.address=inprocess", f"rollout.num_actors={actors}", "rollout.envs_per_actor=1",
        "rollout.fragment_length=32", "replay.num_shards=1", f"learner.batch_size={32 * max(actors, 4)}",
        f"learner.minibatch_size={32 * max(actors, 4)}", "ppo.update_epochs=1",
        f"run.total_env_steps={32 * max(actors, 4) * 12}", "run.require_target=false", "run.target_return=null",
        "run.checkpoint_interval_s=null", "run.progress_interval_s=1000"])
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, Path(tmp) / "run", quiet=True)
        try:
            trainer.build()
            result = trainer.run()
        finally:
            trainer.shutdown()
    c = trainer.supervisor.calls
    it = max(result.iterations, 1)
    return dict(actors=actors, iterations=result.iterations, reports=c["actor_reports"] / it,
                health=c["health"] / it, until_done=c["until_done"])


def summary(rows: list) -> None:
    print("\nsummary (ceiling: one board at a full core, from its measured CPU per fragment)")
    table([("actors", ">6"), ("learners", ">8"), ("relays", ">6"), ("claims", ">6"), ("fragments/s", ">11,.0f"),
           ("board %core", ">11.0f"), ("calls/stored", ">12.3f"),
           ("cpu-ms/frag", ">11.3f"), ("calls/frag", ">10.2f"), ("calls/s", ">8,.0f"), ("poll p50/p99 ms", ">15"),
           ("claim p50/p99 ms", ">16"), ("ceiling frag/s", ">14,.0f"), ("CartPole M samples/s", ">20.1f"),
           ("Atari M frames/s", ">16.1f")],
          [(r["actors"], r["learners"], r["relays"], r["claims"], r["frags_per_s"], r["board_pct"], r["calls_per_stored"],
            r["cpu_ms_per_frag"], r["calls_per_frag"],
            r["calls_per_s"], f"{r['poll_p50']:.1f}/{r['poll_p99']:.1f}", f"{r['claim_p50']:.1f}/{r['claim_p99']:.1f}",
            1e3 / r["cpu_ms_per_frag"], 1e3 / r["cpu_ms_per_frag"] * CARTPOLE_SAMPLES / 1e6,
            1e3 / r["cpu_ms_per_frag"] * ATARI_FRAMES / 1e6) for r in rows], rule=True)


def rates(args) -> None:
    """The board alone at each of ``args.rates`` fragments a second (cell_at_rate), per actors x learners cell."""
    print(f"\nthe board alone at a set fragment rate (node feeders: each node's relay and shards as the board "
          f"sees them; {args.shards} shards)", flush=True)
    rate_rows = []
    for actors, learners, relays, claims, rate in itertools.product(args.actors, args.learners, args.relays,
                                                                     args.claims, args.rates):
        r = cell_at_rate(actors, learners, max(1, relays), claims, rate, args)
        rate_rows.append(r)
        print(f"  {actors:>5} actors x {learners:>2} learners, {r['nodes']} nodes, {claims} claims, "
              f"{rate:,.0f}/s asked: {r['frags_per_s']:,.0f} fragments/s trained, board "
              f"{r['board_pct']:.0f}% of a core, {r['cpu_ms_per_frag']:.4f} cpu-ms per fragment, "
              f"{r['calls_per_s']:.0f} calls/s ({r['calls']}), harness {r['harness_pct']:.0f}% and machine "
              f"{r['machine_pct']:.0f}% of a core", flush=True)
    table([("actors", ">6"), ("learners", ">8"), ("nodes", ">5"), ("claims", ">6"), ("asked/s", ">8,.0f"),
           ("fragments/s", ">11,.0f"), ("board %core", ">11.1f"), ("cpu-ms/frag", ">11.4f"),
           ("calls/s", ">8,.0f"), ("claim p50/p99 ms", ">16"), ("machine %core", ">13.0f")],
          [(r["actors"], r["learners"], r["nodes"], r["claims"], r["rate"], r["frags_per_s"], r["board_pct"],
            r["cpu_ms_per_frag"], r["calls_per_s"], f"{r['claim_p50']:.1f}/{r['claim_p99']:.1f}",
            r["machine_pct"]) for r in rate_rows], rule=True)


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--actors", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--learners", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--seconds", type=float, default=5.0, help="measuring window per cell")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds run before each window")
    p.add_argument("--fragment-s", type=float, default=0.2, help="time a simulated actor takes per fragment")
    p.add_argument("--block", type=int, default=16, help="tickets a simulated actor asks for per poll")
    p.add_argument("--per-add", type=int, default=8, help="most fragments per add (rollout.fragments_per_add)")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--swarms", type=int, default=4, help="processes the simulated actors run in")
    p.add_argument("--relays", type=int, nargs="+", default=[0],
                   help="node relays per cell (0: every actor polls the board itself; N: actor a polls relay a %% N, "
                        "as the actors of N nodes would)")
    p.add_argument("--claims", nargs="+", choices=["group", "rank"], default=["group"],
                   help="group: the learner group claims each update as one (learner.group_claims, the default); "
                        "rank: each learner claims its own; both: each cell with each")
    p.add_argument("--rates", type=float, nargs="*", default=[],
                   help="also run the board alone at these fragment rates: per actors x learners cell, one node "
                        "feeder per relay (--relays, 0 counted as 1) sends the board what that node's relay and "
                        "shards would at the rate; learners claim and publish (no takes)")
    p.add_argument("--rates-only", action="store_true", help="only the cells at --rates (no simulated actors)")
    p.add_argument("--driver-actors", type=int, nargs="*", default=[1, 8, 64],
                   help="rollout actor counts of the in-process runs that count the driver's calls (none: skip)")
    args = p.parse_args()
    if min(args.actors + args.learners) < 1 or args.seconds <= 0 or args.fragment_s < 0 or args.shards < 1:
        p.error("--actors and --learners must be >= 1, --seconds > 0, --fragment-s >= 0, --shards >= 1")
    print(f"control plane: simulated rollout actors ({args.swarms} processes, {args.fragment_s:g} s per fragment, "
          f"blocks of up to {args.block} tickets, adds of up to {args.per_add}) and simulated learners against "
          f"the real SupplyBoard and {args.shards} real ReplayShards; max_policy_lag 1; {args.warmup:g} s warm-up + "
          f"{args.seconds:g} s window per cell; {os.cpu_count()} cores here.", flush=True)
    rows = []
    with local_ray(args.swarms + 4):
        for actors, learners, relays, claims in itertools.product(args.actors, args.learners, args.relays,
                                                                   args.claims) if not args.rates_only else ():
            r = cell(actors, learners, relays, claims, args)
            rows.append(r)
            print(f"  {actors:>5} actors x {learners:>2} learners, {relays:>3} relays, {claims} claims: "
                  f"{r['frags_per_s']:8,.0f} "
                  f"fragments/s trained, {r['stored_per_s']:,.0f} stored; relays {r['relay_pct']:.0f}% of a core; "
                  f"board {r['board_pct']:4.0f}% of a core, {r['calls_per_stored']:.3f} calls per stored fragment, "
                  f"{r['cpu_ms_per_frag']:.3f} cpu-ms and "
                  f"{r['calls_per_frag']:.2f} calls per fragment ({r['calls']}), poll p50/p99 "
                  f"{r['poll_p50']:.1f}/{r['poll_p99']:.1f} ms, claim p50/p99 {r['claim_p50']:.1f}/"
                  f"{r['claim_p99']:.1f} ms", flush=True)
        if rows:
            summary(rows)
        if args.rates:
            rates(args)
    if args.driver_actors:
        print("\ndriver calls about rollout actors per iteration (real in-process runs)")
        drows = [driver_calls(n) for n in args.driver_actors]
        table([("actors", ">6"), ("iterations", ">10"), ("board reads/it", ">14.2f"), ("health calls/it", ">15.2f"),
               ("until_done (once each)", ">22")],
              [(d["actors"], d["iterations"], d["reports"], d["health"], d["until_done"]) for d in drows], rule=True)
    return 0


if __name__ == "__main__":
    run_main(main)
