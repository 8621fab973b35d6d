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

    def __init__(self, board, learners: int, per_learner: int, group: bool = True):
        self.board, self.learners, self.per_learner, self.group = board, learners, per_learner, group
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
                items, _ = await handle.take.remote(tickets)
                have += len(items)
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
                                                                   args.claims):
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
    if args.driver_actors:
        print("\ndriver calls about rollout actors per iteration (real in-process runs)")
        drows = [driver_calls(n) for n in args.driver_actors]
        table([("actors", ">6"), ("iterations", ">10"), ("board reads/it", ">14.2f"), ("health calls/it", ">15.2f"),
               ("until_done (once each)", ">22")],
              [(d["actors"], d["iterations"], d["reports"], d["health"], d["until_done"]) for d in drows], rule=True)
    return 0


if __name__ == "__main__":
    run_main(main)
