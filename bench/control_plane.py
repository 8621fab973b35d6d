"""The control plane at scale: hundreds of simulated rollout actors and up to 64 simulated learners against the real
supply board and real replay shards, through real Ray calls.

A "swarm" actor (a few processes) runs many rollout actors as coroutines with ``RolloutActor``'s protocol (a poll
for a block of tickets with its stats report, then one add in flight, carrying what was made while the previous one
was out, each acknowledged once its shard holds it); "making" a fragment is a sleep of ``--fragment-s``. A learner
swarm runs L learners as coroutines with ``DeviceFeed``'s protocol: the group claims as one by default
(``learner.group_claims``), or (``--claims rank``) each learner its own batch; when every learner has its batch,
"rank 0" publishes the next version. Fragments are tiny: the board's work is per call and per fragment, not per
byte. ``--relays N`` runs each cell again with N node relays (``pipeline/relay.py``): actor a polls relay a % N and
shard i confirms through relay i % N, as on N nodes (on few cores the relays' processes take CPU from the simulated
actors: compare the board's calls per stored fragment there, not the fragment rates).

Printed per cell (actors x learners x relays): fragments/s through the board, the board's CPU (from /proc) per
fragment and in all, its calls per fragment and per second (its own counts), p50/p99 latency of a poll and of a
claim as the callers see it, and one board's projected ceiling (fragments/s at a full core, in samples/s for
CartPole-size 2,048-sample and Atari-size 1,024-frame fragments).

``--rates R ...`` also runs the board at a set fragment rate, which 2 cores cannot reach with a thousand simulated
actors (the cells above reach ~700 fragments a second): each node's actors and shards are a few coroutines
(``_Node``: ACTORS_PER_NODE actors asking their node's real relay for large blocks at the node's share of the rate,
shards confirming through it on ``ReplayShard``'s clocks) and learners claim and publish without taking. One node
per relay (``--relays``, 0 counted as 1), its shards i % nodes; ``--rates-only`` skips the cells above. Each relay is
a process: on 2 cores 4 nodes fit, 16 do not.

The last table: the driver's calls about rollout actors per iteration in a real in-process CartPole run at each
``--driver-actors`` count (the board call that reads every actor's stats, health calls, until_done calls).

    .venv/bin/python bench/control_plane.py [--actors 10 100 1000] [--learners 1 8 64] [--seconds 5]
        [--fragment-s 0.2] [--shards 4] [--swarms 4] [--relays 0 4] [--claims group rank] [--driver-actors 1 8 64]
        [--rates 5000 [--rate-block 256] [--rates-only] [--relay-calls-per-s 100 inf]]
"""

from __future__ import annotations

import asyncio
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
from pipeline.protocol import Claim, Poll, Publish, Stored  # noqa: E402
from pipeline.supply import CLAIM_WAIT_S, RELAY_CALLS_PER_S  # noqa: E402

TINY = dict(modality="vector", obs_shape=(1,), obs_dtype=np.float32, T=1, N=1)
CARTPOLE_SAMPLES, ATARI_FRAMES = 2048, 1024  # per fragment: 128 steps x 16 envs; 128 steps x 8 envs
#: The shortest wait of a simulated actor at a set rate (a quarter of the system's shortest clock, STORED_GATHER_S).
CLOCK_TICK_S = 0.005
#: At a set rate, each simulated node has this many actors, asking for large blocks (--rate-block): a relay shares its
#: pool among the actors that poll it, and the board its tickets among all actors, so as many actors as a cluster's
#: would each get a few tickets a poll, and the relays' processes, not the board, would be what 2 cores measure. The
#: board's calls follow the relays' clocks either way.
ACTORS_PER_NODE = 2
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
            tickets, news, _ = await source.poll.remote(Poll(actor_id, 0, version, shard_index, 0, [], TICKET_WAIT_S,
                                                             max_tickets=self.block, report=REPORT))
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
        self.shards: list = []  # the board's shard handles, asked for once by run()
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
            claims = await self.board.claim.remote(Claim(rank, update, self.per_learner - have, CLAIM_WAIT_S, [], 0,
                                                         min_items=self.per_learner - have))
            self.claim_s.append(time.perf_counter() - t0)
            for index, (_, tickets) in claims.items():
                have += len((await self.shards[index].take.remote(tickets))[0]) if self.take else len(tickets)
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
            claims = await self.board.claim.remote(Claim(0, update, want, CLAIM_WAIT_S, [], 0, min_items=want))
            self.claim_s.append(time.perf_counter() - t0)
            parts = split_claims(claims, owed)
            if self.take:
                await asyncio.gather(*(self.shards[index].take.remote(tickets) for part in parts.values()
                                       for index, (_, tickets) in part.items()))
        return True

    async def run(self, seconds: float, first_update: int) -> dict:
        """Whole updates until ``seconds`` have passed; returns what was trained and the time it took."""
        if self.take and not self.shards:  # registered before any learner runs; none is replaced here
            self.shards = await self.board.shard_handles.remote()
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
            await self.board.publish.remote(Publish(update, [None]))
        out = {"claim_s": self.claim_s, "trained": trained, "next_update": update,
               "seconds": time.monotonic() - t0}
        self.claim_s = []
        return out


class _Node:
    """One node's rollout actors and replay shards at a set fragment rate, around the node's real relay
    (``pipeline/relay.py``): ACTORS_PER_NODE actors poll the relay for blocks of tickets as fast as the rate lets
    them and "make" each ticket's fragment in ``fragment_s``; each shard confirms what was made through the relay on
    ``ReplayShard``'s clocks (``STORED_PACE_S`` after the first fragment it holds, ``STORED_GATHER_S`` when one is
    of an update the board said is at its tail; one call at a time). What reaches the board is what the relay
    sends; the actors and shards cost a few coroutines, so 2 cores can drive the board at the rate of a cluster."""

    def __init__(self, relay, node: int, shards: list[int], rate: float,
                 fragment_s: float, block: int, feeder: "NodeFeeder"):
        self.relay, self.shards = relay, shards
        self.first_actor = node * ACTORS_PER_NODE
        self.rate, self.fragment_s, self.block = rate, fragment_s, block
        self.version = -1
        self.owed = 0.0  # tickets the node's actors could have taken by now at the rate, and did not
        self.accrued_at = time.monotonic()
        self.feeder = feeder  # its process: where the board's hurry calls arrive, and the stop
        self.held = {s: [] for s in shards}  # made, not yet confirmed, by shard
        self.arrived = {s: asyncio.Event() for s in shards}
        self.turn = itertools.cycle(shards)  # the shard the next made fragment is added to

    def _accrue(self) -> None:
        now = time.monotonic()
        self.owed = min(self.owed + self.rate * (now - self.accrued_at), self.rate)  # a second's worth at most
        self.accrued_at = now

    async def _actor(self, actor_id: int) -> None:
        from actors.rollout import TICKET_WAIT_S

        while not self.feeder.stopped:
            self._accrue()
            if self.owed < self.block:  # until a block is owed (or a clock tick's worth, when that is more)
                await asyncio.sleep(max(CLOCK_TICK_S, (self.block - self.owed) / self.rate))
                self._accrue()
            n = min(self.block, int(self.owed))
            if n < 1:
                continue
            self.owed -= n  # taken now, given back below if the relay had fewer
            tickets, news, _ = await self.relay.poll.remote(Poll(actor_id, 0, self.version, 0, 0, [],
                                                                 TICKET_WAIT_S, max_tickets=n, report=REPORT))
            self.owed += n - len(tickets)
            if news is not None:
                self.version = news[0]
            if tickets:
                asyncio.get_running_loop().call_later(self.fragment_s, self._made, tickets)

    def _made(self, tickets: list) -> None:
        """Made: added to the node's shards in turn."""
        for t in tickets:
            shard = next(self.turn)
            self.held[shard].append(t)
            self.arrived[shard].set()

    async def _shard(self, shard: int) -> None:
        from pipeline.replay import STORED_GATHER_S
        from pipeline.supply import STORED_PACE_S

        held, arrived = self.held[shard], self.arrived[shard]
        while not self.feeder.stopped:
            await arrived.wait()
            first = time.monotonic()
            while True:  # gathered until its clock says so (the short one once a fragment is of a hurried update)
                arrived.clear()
                urgent = any(t.update <= self.feeder.hurried for t in held)
                left = first + (STORED_GATHER_S if urgent else STORED_PACE_S) - time.monotonic()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(arrived.wait(), min(left, STORED_GATHER_S))  # (a hurry is not an event)
                except asyncio.TimeoutError:
                    pass
            batch = list(held)
            held.clear()
            await self.relay.stored.remote(Stored(batch, shard, urgent))

    async def run(self) -> None:
        tasks = [asyncio.ensure_future(self._actor(self.first_actor + a)) for a in range(ACTORS_PER_NODE)]
        tasks += [asyncio.ensure_future(self._shard(s)) for s in self.shards]
        try:
            while not self.feeder.stopped:
                await asyncio.sleep(0.05)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


@ray.remote(num_cpus=0)
class NodeFeeder:
    """Several nodes' actors and shards (``_Node``) as coroutines of one process (a process per node would add its
    idle cost to the few cores the board runs on); the handle of their shards in the board's directory (``hurry``,
    ``drop``)."""

    def __init__(self, relays: dict, all_nodes: int, shards: int, rate_per_node: float, fragment_s: float,
                 block: int):
        self.nodes = [_Node(relay, k, [i for i in range(shards) if i % all_nodes == k], rate_per_node, fragment_s,
                            block, self) for k, relay in relays.items()]
        self.hurried = -1  # the newest update the board said is at its tail (it tells every shard alike)
        self.stopped = False

    async def hurry(self, update: int) -> None:
        self.hurried = max(self.hurried, update)

    async def drop(self, tickets) -> None:
        pass

    async def run(self, seconds: float) -> None:
        self.stopped = False
        runs = asyncio.gather(*(n.run() for n in self.nodes))
        deadline = time.monotonic() + seconds
        while not self.stopped and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.stopped = True
        await runs

    async def stop(self) -> None:
        self.stopped = True


def _board_and_relays(actors: int, learners: int, relays: int, args, expected_actors: int,
                      relay_calls_per_s: float = RELAY_CALLS_PER_S):
    """The real board for ``actors`` x ``learners`` (enough tickets that every actor can hold a block: the board's
    work, not the ticket supply, is what is measured) and ``relays`` node relays. Returns (board, relays, fragments
    per learner and update)."""
    from cluster.control import MAX_ROLLOUT_ACTORS
    from pipeline.relay import RELAY_ID_BASE, NodeRelay
    from pipeline.supply import SupplyBoard, board_concurrency

    per_learner = max(1, -(-2 * actors // learners))
    board = SupplyBoard.options(max_concurrency=board_concurrency(MAX_ROLLOUT_ACTORS, args.shards, learners)).remote(
        per_learner * learners, 1, args.shards, expected_actors=expected_actors, relay_calls_per_s=relay_calls_per_s)
    relay_handles = [NodeRelay.options(max_concurrency=MAX_ROLLOUT_ACTORS + 16).remote(board, RELAY_ID_BASE + k)
                     for k in range(relays)]
    return board, relay_handles, per_learner


def _window(board, learn, meter: CpuMeter, args, kinds: tuple) -> tuple:
    """The learner swarm's warm-up, then its measured window: (the window's run, the board's stats before it and
    after, the CPU each group of ``meter`` used, the board's calls of ``kinds`` in it)."""
    warm_out = runtime.get(learn.run.remote(args.warmup, 0))
    st0, cpu0 = runtime.get(board.stats.remote()), meter.snap()
    out = runtime.get(learn.run.remote(args.seconds, warm_out["next_update"]))
    st1, cpu1 = runtime.get(board.stats.remote()), meter.snap()
    calls = {k: st1["board_calls"].get(k, 0) - st0["board_calls"].get(k, 0) for k in kinds}
    return out, (st0, st1), CpuMeter.delta(cpu0, cpu1), calls


def cell(actors: int, learners: int, relays: int, claims: str, args) -> dict:
    from pipeline.replay import ReplayShard

    board, relay_handles, per_learner = _board_and_relays(actors, learners, relays, args, expected_actors=actors)
    # Shard i on "node" i % relays, confirming through that node's relay (as the graph wires them).
    shards = [ReplayShard.remote(i, 4 * per_learner * learners, board,
                                 relay=relay_handles[i % relays] if relays else None) for i in range(args.shards)]
    runtime.get([board.register_shard.remote(i, s) for i, s in enumerate(shards)])
    runtime.get(board.publish.remote(Publish(0, [None])))
    per_swarm = -(-actors // args.swarms)
    swarms = [ActorSwarm.remote(k * per_swarm, min(per_swarm, actors - k * per_swarm), board, shards,
                                args.fragment_s, args.block, args.per_add, relay_handles)
              for k in range(args.swarms) if k * per_swarm < actors]
    learn = LearnerSwarm.remote(board, learners, per_learner, group=claims == "group")
    # Every process up before anything runs: on few cores, a dozen relays' start-up would eat the warm-up.
    runtime.get([h.__ray_ready__.remote() for h in (*relay_handles, *swarms, learn)])
    try:
        meter = CpuMeter({"board": actor_pids([board]), "relays": actor_pids(relay_handles)})
        runs = [s.run.remote(args.warmup + args.seconds + 60.0) for s in swarms]  # stopped after the window
        out, (st0, st1), cpu, calls = _window(board, learn, meter, args, (
            "poll", "relay_poll", "stored", "stored_many", "claim", "publish", "hurry"))
        runtime.get([s.stop.remote() for s in swarms])
        polls = [x for r in runtime.get(runs) for x in r["poll_s"]]
    finally:
        for a in [*swarms, learn, *shards, *relay_handles, board]:
            runtime.kill(a)
    board_cpu, relay_cpu, seconds = cpu["board"], cpu["relays"], out["seconds"]
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


def cell_at_rate(actors: int, learners: int, nodes: int, claims: str, rate: float, args,
                 budget: float = RELAY_CALLS_PER_S) -> dict:
    """The board at ``rate`` fragments a second: ``nodes`` real NodeRelays, each node's actors and shards simulated
    by NodeFeeders (``_Node``), and the learner swarm (claims, publishes; no takes); the relays' calls within
    ``budget`` a second (``rollout.relay_calls_per_s``)."""
    if nodes > args.shards:
        raise ValueError(f"--rates: every node needs a shard of its own: {nodes} nodes, --shards {args.shards}")
    board, relays, per_learner = _board_and_relays(actors, learners, nodes, args,
                                                   expected_actors=nodes * ACTORS_PER_NODE, relay_calls_per_s=budget)
    processes = min(nodes, args.swarms)
    feeders = [NodeFeeder.remote({k: relays[k] for k in range(p, nodes, processes)}, nodes, args.shards,
                                 rate / nodes, args.fragment_s, args.rate_block) for p in range(processes)]
    runtime.get([board.register_shard.remote(i, feeders[(i % nodes) % processes]) for i in range(args.shards)])
    runtime.get(board.publish.remote(Publish(0, [None])))
    learn = LearnerSwarm.remote(board, learners, per_learner, group=claims == "group", take=False)
    runtime.get([h.__ray_ready__.remote() for h in (*relays, *feeders, learn)])
    try:
        meter = CpuMeter({"board": actor_pids([board]), "relays": actor_pids(relays),
                          "harness": actor_pids([*feeders, learn])})
        runs = [f.run.remote(args.warmup + args.seconds + 60.0) for f in feeders]
        out, _, cpu, calls = _window(board, learn, meter, args, (
            "relay_poll", "relay_confirms", "stored_many", "claim", "publish", "hurry"))
        runtime.get([f.stop.remote() for f in feeders])
        runtime.get(runs)
    finally:
        for a in [*feeders, learn, *relays, board]:
            runtime.kill(a)
    seconds, frags = out["seconds"], max(out["trained"], 1)
    # relay_confirms are relay_polls that carried confirmations; hurry counts the board's own calls to the shards.
    n_calls = sum(v for k, v in calls.items() if k not in ("relay_confirms", "hurry"))
    return dict(actors=actors, learners=learners, nodes=nodes, claims=claims, rate=rate, budget=budget,
                frags_per_s=out["trained"] / seconds, board_pct=100 * cpu["board"] / seconds,
                cpu_ms_per_frag=1e3 * cpu["board"] / frags, calls_per_s=n_calls / seconds,
                relay_pct=100 * cpu["relays"] / seconds, harness_pct=100 * cpu["harness"] / seconds,
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
          [(r["actors"], r["learners"], r["relays"], r["claims"], r["frags_per_s"], r["board_pct"],
            r["calls_per_stored"], r["cpu_ms_per_frag"], r["calls_per_frag"],
            r["calls_per_s"], f"{r['poll_p50']:.1f}/{r['poll_p99']:.1f}", f"{r['claim_p50']:.1f}/{r['claim_p99']:.1f}",
            1e3 / r["cpu_ms_per_frag"], 1e3 / r["cpu_ms_per_frag"] * CARTPOLE_SAMPLES / 1e6,
            1e3 / r["cpu_ms_per_frag"] * ATARI_FRAMES / 1e6) for r in rows], rule=True)


def rates(args) -> None:
    """The board at each of ``args.rates`` fragments a second (cell_at_rate), per actors x learners x relays cell."""
    print(f"\nthe board at a set fragment rate: per node its real relay, {ACTORS_PER_NODE} simulated actors asking "
          f"for blocks of {args.rate_block} and its shards ({args.shards} in all); an update's batch as for the "
          f"actor count; learners claim and publish, no takes", flush=True)
    rate_rows = []
    for actors, learners, relays, claims, rate, budget in itertools.product(
            args.actors, args.learners, args.relays, args.claims, args.rates, args.relay_calls_per_s):
        r = cell_at_rate(actors, learners, max(1, relays), claims, rate, args, budget)
        rate_rows.append(r)
        print(f"  {actors:>5} actors x {learners:>2} learners, {r['nodes']} nodes, {claims} claims, relay budget "
              f"{budget:,.0f}/s, {rate:,.0f}/s asked: {r['frags_per_s']:,.0f} fragments/s trained, board "
              f"{r['board_pct']:.0f}% of a core, {r['cpu_ms_per_frag']:.4f} cpu-ms per fragment, "
              f"{r['calls_per_s']:.0f} calls/s ({r['calls']}), relays {r['relay_pct']:.0f}%, harness "
              f"{r['harness_pct']:.0f}% and machine "
              f"{r['machine_pct']:.0f}% of a core", flush=True)
    table([("actors", ">6"), ("learners", ">8"), ("nodes", ">5"), ("claims", ">6"), ("budget/s", ">8,.0f"),
           ("asked/s", ">8,.0f"), ("fragments/s", ">11,.0f"), ("board %core", ">11.1f"), ("cpu-ms/frag", ">11.4f"),
           ("calls/s", ">8,.0f"), ("claim p50/p99 ms", ">16"), ("machine %core", ">13.0f")],
          [(r["actors"], r["learners"], r["nodes"], r["claims"], r["budget"], r["rate"], r["frags_per_s"],
            r["board_pct"],
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
    p.add_argument("--rate-block", type=int, default=256,
                   help="at --rates, tickets a simulated actor asks its relay for per poll (the relay's load, not "
                        "the board's: the relay's board calls follow its clock)")
    p.add_argument("--rates-only", action="store_true", help="only the cells at --rates (no simulated actors)")
    p.add_argument("--relay-calls-per-s", type=float, nargs="+", default=[RELAY_CALLS_PER_S],
                   help="the board's budget for the relays' calls together (rollout.relay_calls_per_s), at --rates; "
                        "several: each cell at each, side by side (inf: none)")
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
