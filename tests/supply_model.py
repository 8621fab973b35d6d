"""A scale model of the data plane: the real ticket ledger and shard stores, with actors, learners, the network
and failures simulated as plain Python (no Ray), one random event at a time.

What is real: ``pipeline.supply.Supply`` (ledger, weights version, shard directory) and
``pipeline.replay.FragmentStore``. What is modelled: the actors' loop (poll -> collect -> add), adds in flight
(delivered later, possibly after their actor died or their shard was replaced), learners claiming and taking
(a take can hit a shard that died after the claim), the lockstep learner group (an update happens when every rank
has its batch for it; rank 0 then publishes), and the driver (it notices deaths some events later).

Time is the event count: the ledger's clock is the model's, so leases expire in it. A hung actor (an env stuck in
``step``, a SIGSTOPped process) keeps its tickets and makes nothing until its leases give them to the others; it may
wake and deliver a late copy (refused), or the driver kills it when it has made no progress for
``HANG_NOTICE_LEASES`` leases. A slow actor finishes a fragment a tenth as often as the others. An add carries up to
``fragments_per_add`` fragments, confirmed by one ``stored`` call (a shard confirms what reached it in one call).

With ``Layout.relays`` a node relay asks for the blocks of all its node's idle actors in one call; with
``coalesce_stored`` a shard confirms every add that reached it since its last ``stored`` in one call; with
``claim_parts`` a claim waits for its whole remaining batch or that part of it (the real board's rules; without a
clock how much a call gathers follows the event mix, not a cluster's rates). With ``Layout.rate`` the model has a
clock: the cluster makes that many fragments a second, and shards, relays and claims act on the system's clocks
(see ``Layout``), so its calls a second, and the board's share of a core (``Report.board_core_fraction``), are the
system's at that rate. With ``group_claims`` the learner group claims as one (``learner.group_claims``): rank 0
claims what every rank is still owed of the update it leads (at most ``prefetch`` updates ahead of the group's), the
claim is cut into the ranks' parts (``pipeline.feed.split_claims``), and a rank whose take fails claims the
replacements itself, as ``DeviceFeed._pull_part`` does; a part for an update its rank has not reached waits, as in
its inbox.

The board's calls are counted per kind (``Report.board_calls``): the model's calls per fragment, times a call's
measured cost (``MS_PER_BOARD_CALL``), is the board's CPU per fragment; and the calls the board holds open at once
(parked polls of idle actors, claims, stored) never exceed ``board_concurrency``, the ``max_concurrency`` the real
board is given.

``run(...)`` returns a ``Report``; it raises ``AssertionError`` the moment an update gets a wrong batch or a
ticket would be trained twice, and reports a deadlock when nothing can move while updates are still owed.
"""

from __future__ import annotations

import collections
import random
from dataclasses import dataclass, field, replace

from pipeline.fragment import FragmentMeta
from pipeline.protocol import (CLAIM_WAIT_S, CONFIRM_GATHER_S, RELAY_CALLS_PER_S, RELAY_INTERVAL_MAX_S, RELAY_PACE_S,
                               STORED_GATHER_S, STORED_PACE_S, TAIL_PACES)
from pipeline.replay import FragmentStore
from pipeline.supply import RecentSum, Supply, board_concurrency, tail_size

#: A ticket's lease, in healthy fragment times of a whole block (an actor makes its block one fragment at a time, and
#: one fragment of a given actor takes about EVENTS_PER_CHOICE x actors events): the real board's automatic lease is
#: 4 medians of the issue-to-store time, so only hung (and sometimes slow) actors outlive it.
LEASE_BLOCKS, EVENTS_PER_CHOICE = 4, 6
#: The driver kills a hung actor after this many leases without progress (its health deadline), as it does a
#: rollout actor whose loop stopped (``rollout_hangs``).
HANG_NOTICE_LEASES = 3
#: The supply board's CPU per call, everything included (Ray's per-call work, (de)serialisation, the ledger, its
#: garbage collection), as bench/control_plane.py measured it at 1,000 actors x 64 learners with 4 relays: 0.17 ms
#: of CPU per trained fragment at 0.20 calls per fragment (2026-12-04). Calls per fragment times this is the
#: model's board CPU per fragment.
MS_PER_BOARD_CALL = 0.85
#: ... and what a call's contents add to it, per ticket: issued (a relay_poll handing out 64 tickets cost 1.45-1.65
#: ms against 0.85-0.95 for an empty call), confirmed (a stored of 64: 1.10-1.15 ms) and claimed (a claim of 64:
#: 1.10-1.20 ms), a real board measured alone on a quiet machine (docs/results.md, "The supply board at scale").
MS_PER_ISSUED, MS_PER_CONFIRMED, MS_PER_CLAIMED = 0.010, 0.004, 0.005
#: How much less often a slow actor finishes a fragment than the others.
SLOW_FACTOR = 10


@dataclass
class Layout:
    actors: int
    shards: int
    learners: int
    fragments_per_learner: int  # F: per_update = learners * F
    lag: int
    prefetch: int = 1  # batches a learner's feed may prepare ahead of the group's update
    block: int = 1  # tickets an actor asks for per poll (RolloutActor's block; the board gives a fair share)
    fragments_per_add: int = 1  # fragments one add carries at most (rollout.fragments_per_add)
    # The control plane's batching, each off by default so the other tests see one call per move:
    relays: int = 0  # node relays: actor a is on node a % relays, whose idle actors get their blocks in one call
    coalesce_stored: bool = False  # a shard confirms every add that reached it since its last stored, in one call
    claim_parts: int = 0  # a claim waits for its whole remaining batch or 1/claim_parts of it (the board's rule)
    group_claims: bool = False  # rank 0 claims for the whole learner group (learner.group_claims)
    # A clock: the cluster makes ``rate`` fragments a second (each made fragment moves the model's time on by
    # 1/rate), and the calls that follow clocks in the real system follow them here (coalesce_stored and claim_parts
    # are then the board's rules, on its clocks): a shard confirms STORED_PACE_S after the first add it holds
    # (STORED_GATHER_S once one is of an update at its tail, the board's rule, ``tail_size``); with relays, it
    # confirms through its node's relay, which carries the confirmations up CONFIRM_GATHER_S after the first (the
    # short clock when urgent) in the call it makes for tickets (a pace apart while its actors wait), never sooner
    # than the board's interval for it (RELAY_CALLS_PER_S over the relays); a claim waits for its whole batch, and
    # after CLAIM_WAIT_S takes parts. 0: no clock (one event, one move).
    rate: float = 0.0
    relay_calls_per_s: float = RELAY_CALLS_PER_S  # the board's budget for the relays' calls (with a clock)
    pace: bool = True  # (with a clock) an add nobody waits for is confirmed on STORED_PACE_S; False: the short clock
    hurry: bool = True  # (with a clock) an update at its tail is confirmed on the short clock; False: on the pace


#: Each mechanism of the protocol that exists for scale only (pipeline.protocol.SCALE_MECHANISMS), turned off in a
#: layout: the model's counterpart of its switch.
SWITCHED_OFF = {
    "blocks": lambda lay: replace(lay, block=1),
    "multi_fragment_adds": lambda lay: replace(lay, fragments_per_add=1),
    "pacing": lambda lay: replace(lay, pace=False),
    "hurry": lambda lay: replace(lay, hurry=False),
    "relays": lambda lay: replace(lay, relays=0),
    "group_claims": lambda lay: replace(lay, group_claims=False),
    "call_budget": lambda lay: replace(lay, relay_calls_per_s=float("inf")),
}


@dataclass
class Faults:
    actor_deaths: int = 0
    shard_deaths: int = 0
    actors_added: int = 0
    actors_removed: int = 0
    learner_restarts: int = 0
    actor_hangs: int = 0  # an actor stops (and may wake again, or is killed by the driver's health deadline)
    slow_actors: int = 0  # actors that are SLOW_FACTOR times slower than the rest, from the start
    # A shard's coalesced confirmation that its node's relay carried up and then failed to answer: the shard sends
    # it to the board again itself (pipeline/replay.py, ReplayShard._via_relay), which takes it as the same
    # confirmation (TicketLedger.stored): nothing counted twice, nothing dropped.
    relay_resends: int = 0


@dataclass
class Report:
    updates: int
    produced: int  # fragments a shard accepted
    trained: int
    stale: int  # accepted, then not trained (updates skipped by a learner-group restart)
    refunded: int
    rejected: int
    events: int
    per_learner_per_update: dict = field(default_factory=dict)  # (rank, update) -> fragments
    lease_expired: int = 0  # tickets a hung or slow actor held past their lease, given to another actor
    hung_killed: int = 0  # hung actors the driver killed and replaced
    board_calls: dict = field(default_factory=dict)  # kind -> calls the board received
    max_open_calls: int = 0  # most calls the board held at once (parked polls and claims, stored in flight)
    concurrency: int = 0  # board_concurrency for the layout: max_open_calls must stay under it
    made_by_slow: int = 0  # fragments slow actors made (they lose tickets to their leases, not hold updates)
    resent: int = 0  # fragments confirmed twice (Faults.relay_resends)
    seconds: float = 0.0  # the model's time (Layout.rate), 0 without a clock
    issued: int = 0  # tickets the board issued (reissues of refunded ones too)
    confirmed: int = 0  # tickets in the shards' confirmations
    claimed: int = 0  # tickets the learners claimed

    @property
    def board_calls_per_fragment(self) -> float:
        return sum(self.board_calls.values()) / max(self.produced, 1)

    def board_cpu_ms_per_fragment(self, ms_per_call: float = MS_PER_BOARD_CALL) -> float:
        return self.board_calls_per_fragment * ms_per_call

    def board_core_fraction(self) -> float:
        """The board's CPU over the model's time (Layout.rate): its calls at MS_PER_BOARD_CALL, and per ticket
        issued, confirmed and claimed."""
        ms = (sum(self.board_calls.values()) * MS_PER_BOARD_CALL + self.issued * MS_PER_ISSUED
              + self.confirmed * MS_PER_CONFIRMED + self.claimed * MS_PER_CLAIMED)
        return ms / 1e3 / self.seconds

    @property
    def stale_fraction(self) -> float:
        return self.stale / max(self.produced, 1)


class _Actor:
    def __init__(self, actor_id: int, incarnation: int, shard: int):
        self.id, self.inc, self.shard = actor_id, incarnation, shard
        self.version = -1
        self.tickets: list = []  # its block: issued to it, not made yet
        self.made: list = []  # (ticket, version) made, waiting to go in its next add
        self.alive = True
        self.hung_since: float | None = None  # the clock when it stopped; None: it runs
        self.slow = False
        self.failed: list = []  # adds it saw fail, reported with its next poll (as RolloutActor does)


class Model:
    def __init__(self, layout: Layout, faults: Faults, seed: int):
        self.lay = layout
        self.rng = random.Random(seed)
        self.per_update = layout.learners * layout.fragments_per_learner
        # Without hung or slow actors the lease never matters (a healthy fragment takes far less than 4 medians);
        # the model leaves it off there so that a fault-free run refunds exactly nothing.
        # With a clock (Layout.rate) leases are in its seconds: 4 healthy blocks, and 4 times the longest a fragment
        # may wait for the clocks to confirm it (the real lease's floor, LEASE_FLOOR_S, is far above both).
        leased = faults.actor_hangs or faults.slow_actors
        actors = layout.actors + faults.actors_added
        relay_interval = min(max(1, layout.relays) / layout.relay_calls_per_s, RELAY_INTERVAL_MAX_S)
        if not leased:
            self.lease = float("inf")
        elif layout.rate:
            confirm_s = STORED_PACE_S + CONFIRM_GATHER_S + max(RELAY_PACE_S, relay_interval)
            self.lease = LEASE_BLOCKS * (layout.block * actors / layout.rate + confirm_s)
        else:
            self.lease = LEASE_BLOCKS * layout.block * EVENTS_PER_CHOICE * actors
        self.supply = Supply(self.per_update, layout.lag, layout.shards, lease_s=self.lease)
        self.now = 0.0  # events
        self.t = 0.0  # seconds (Layout.rate)
        self.supply.ledger.clock = self._clock  # leases run on the model's clock
        self.calls: collections.Counter = collections.Counter()
        self.max_open_calls = 0
        self.concurrency = board_concurrency(layout.actors + faults.actors_added, layout.shards, layout.learners)
        self.stores = [FragmentStore(capacity=10**9) for _ in range(layout.shards)]
        for i in range(layout.shards):
            self.supply.register_shard(i, f"shard{i}.0")
        self.shard_inc = [0] * layout.shards
        self.actors: dict[int, _Actor] = {}
        self.next_inc: dict[int, int] = collections.defaultdict(int)
        # Slow from the start, and so are their replacements (the same host, the same env).
        self.slow_ids = set(self.rng.sample(range(layout.actors), min(faults.slow_actors, layout.actors)))
        for a in range(layout.actors):
            self._spawn(a)
        self.faults = faults
        self.made_by_slow = 0
        self.resent = 0  # fragments whose confirmation a relay carried up and the shard then sent again
        self.hung_killed = 0
        self.dead_unnoticed: list[_Actor] = []  # the driver notices deaths a few events later
        self.in_flight: list = []  # adds: (actor, [(ticket, version)], shard index, shard incarnation at send)
        self.unconfirmed: dict[int, list] = collections.defaultdict(list)  # shard -> (actor, made) stored, not told
        self.pending_takes: list = []  # (rank, update, shard, shard incarnation at claim, ids)
        self.version = 0
        self.group_update = 0  # the update the learner group does next
        self.supply.publish(0, ["w0"])
        self.feeds = [self._fresh_feed(0) for _ in range(layout.learners)]
        self._lead(0)
        self.trained_ids: set = set()
        self.trained = 0
        self.per_learner_per_update: dict = {}
        self.events = 0
        # The clock (Layout.rate): seconds, and what follows it.
        if layout.rate and faults.relay_resends:
            raise ValueError("the clocked model does not resend relays' confirmations (Faults.relay_resends)")
        self.stored_lately = RecentSum(TAIL_PACES * STORED_PACE_S, clock=lambda: self.t)
        self.hurried: set = set()  # updates at their tail: their fragments are confirmed on the short clock
        self.held_since: dict[int, float] = {}  # shard -> when the oldest add it has not confirmed came
        nodes = max(1, layout.relays)
        self.relay_queue: dict[int, list] = {n: [] for n in range(nodes)}  # node -> [(shard, adds)] at its relay
        self.relay_queue_since = [0.0] * nodes
        self.relay_last = [-1.0] * nodes  # when each relay last called the board
        self.relay_interval = relay_interval  # the board's budget for each relay
        self.claim_from: dict = {}  # (claimer, update) -> when its claim began to wait
        self.confirmed = 0

    # ------------------------------------------------------------------ helpers
    def _spawn(self, actor_id: int) -> None:
        inc = self.next_inc[actor_id]
        self.next_inc[actor_id] += 1
        self.actors[actor_id] = _Actor(actor_id, inc, actor_id % self.lay.shards)
        self.actors[actor_id].slow = actor_id in self.slow_ids

    def _lead(self, update: int) -> None:
        """group_claims: rank 0 leads ``update``, every rank owed its whole batch of it; nothing to replace."""
        self.lead_update = update
        self.owed = {r: self.lay.fragments_per_learner for r in range(self.lay.learners)}
        self.short = [0] * self.lay.learners  # fragments a rank's failed takes left it to claim itself

    @staticmethod
    def _fresh_feed(update: int) -> dict:
        return {"next": update, "have": [], "ready": collections.deque()}

    def _meta(self, version: int, actor_id: int) -> FragmentMeta:
        return FragmentMeta(version, actor_id, 1, 1)

    # ------------------------------------------------------------------ events
    def _choices(self) -> list:
        c = []
        running = [a for a in self.actors.values() if a.alive and a.hung_since is None]
        idle = [a for a in running if not a.tickets and not a.made]
        busy = [a for a in running if a.tickets or a.made]
        hung = [a for a in self.actors.values() if a.alive and a.hung_since is not None]
        pollers = self._pollers(idle)
        if self.lay.rate and self.lay.relays:
            due = self._due_relays(pollers)
            if due:
                c.append(("relay_call", due))
        elif pollers and self.lay.relays:
            c.append(("relay_poll", pollers))
        elif pollers:
            c.append(("poll", pollers))
        if busy:
            c.append(("finish", busy))
        if hung:
            c.append(("hung", hung))  # time passes for it: it wakes, or the driver's deadline kills it
        if self.in_flight:
            c.append(("deliver", None))
        if self.lay.rate:
            due = self._due_shards()
            if due:
                c.append(("confirm", due))
        elif any(self.unconfirmed.values()):
            c.append(("confirm", None))
        claimers = [r for r, f in enumerate(self.feeds) if len(f["ready"]) < self.lay.prefetch + 1
                    and self._need(r) > 0 and self._claimable(f["next"], self._need(r), r)]
        if claimers:
            c.append(("claim", claimers))
        owed = sum(self.owed.values())
        if self.lay.group_claims and owed and self.lead_update - self.group_update <= self.lay.prefetch \
                and self._claimable(self.lead_update, owed, "group"):
            c.append(("group_claim", None))
        if self._takeable():
            c.append(("take", None))
        if all(f["ready"] and f["ready"][0][0] == self.group_update for f in self.feeds):
            c.append(("update", None))
        if self.dead_unnoticed:
            c.append(("notice", None))
        f = self.faults
        if f.actor_deaths or f.shard_deaths or f.actors_added or f.actors_removed or f.learner_restarts \
                or f.actor_hangs:
            if self.rng.random() < 0.05:
                c.append(("fault", None))
        # Calls the board holds at once: every idle actor's parked poll (or one per relay), every feed's claim, every
        # shard's stored.
        open_calls = min(len(idle), self.lay.relays or len(idle)) + len(self.feeds) + self.lay.shards
        self.max_open_calls = max(self.max_open_calls, open_calls)
        return c

    def _clock(self) -> float:
        """The model's time: seconds with a clock (Layout.rate), else events."""
        return self.t if self.lay.rate else self.now

    def _pollers(self, idle: list) -> list:
        """The idle actors a poll would serve: all of them while a ticket is free, else those with failed adds."""
        return idle if self.supply.ledger.has_ticket_for(self.supply.version) else [a for a in idle if a.failed]

    def step(self) -> bool:
        """One random event; False when none is possible. With a clock, when nothing can happen before a clock comes
        due (every actor waits for its relay's call, a claim for its part wait), the time jumps there."""
        choices = self._choices()
        while not choices and self.lay.rate:
            due = self._next_due()
            if due is None:
                return False
            self.t = max(self.t, due)
            choices = self._choices()
        if not choices:
            return False
        kind, arg = self.rng.choice(choices)
        getattr(self, "_" + kind)(arg)
        self.events += 1
        self.now += 1
        self.supply.ledger.expire_leases()  # the board's lease watch (and every call) looks at the oldest lease
        return True

    def _claimable(self, update: int, need: int, claimer) -> bool:
        stored = self.supply.ledger.stored_count(update)
        if self.lay.rate and self.lay.claim_parts:  # the board's rule on its clock: the whole, or a part later
            if stored >= need:
                return True
            since = self.claim_from.setdefault((claimer, update), self.t)
            return self.t >= since + CLAIM_WAIT_S and stored >= -(-need // self.lay.claim_parts)
        if self.lay.claim_parts:
            return stored >= min(need, -(-need // self.lay.claim_parts))
        return stored > 0

    def _relay_poll(self, idle) -> None:
        """One board call for every idle actor of one node (its relay asks for all their blocks at once)."""
        node = self.rng.choice(idle).id % self.lay.relays
        self.calls["relay_poll"] += 1
        for a in [a for a in idle if a.id % self.lay.relays == node]:
            self._give_block(a)

    def _poll(self, idle) -> None:
        self.calls["poll"] += 1
        self._give_block(self.rng.choice(idle))

    def _give_block(self, a: _Actor, ahead: bool = False) -> None:
        """What one poll does for actor ``a``: its failed adds back, the newest weights, a block of tickets (``ahead``:
        its next block, after the one it is making)."""
        for t in a.failed:
            self.supply.ledger.add_failed(t)
        a.failed = []
        a.version = self.supply.version  # the poll brings the newest weights with the ticket
        polling = sum(1 for b in self.actors.values() if b.alive)
        block = self.supply.ledger.request_block(a.id, a.inc, a.version, self.lay.block, polling)
        a.tickets = a.tickets + block if ahead else block

    def _finish(self, busy) -> None:
        a = self.rng.choice(busy)
        if a.slow and self.rng.random() >= 1 / SLOW_FACTOR:
            return  # still making it
        if a.tickets:
            ticket = a.tickets.pop(0)  # a block is made in order, one fragment at a time
            assert a.version >= ticket.min_version, "fragment made with a policy older than its ticket allows"
            a.made.append((ticket, a.version))
            self.made_by_slow += a.slow
            if self.lay.rate:
                self.t += 1 / self.lay.rate
        # An add goes when it is full or the block is done (RolloutActor sends what was made while the previous
        # add was out, up to fragments_per_add).
        if a.made and (len(a.made) >= self.lay.fragments_per_add or not a.tickets):
            self.in_flight.append((a, a.made, a.shard, self.shard_inc[a.shard]))
            a.made = []

    def _deliver(self, _) -> None:
        a, made, shard, inc = self.in_flight.pop(self.rng.randrange(len(self.in_flight)))
        if self.shard_inc[shard] != inc:  # its shard died meanwhile: the add raises in the actor
            if a.alive:
                a.failed.extend(ticket for ticket, _ in made)  # known to the board only when the actor polls next
            return
        store = self.stores[shard]
        for ticket, version in made:
            store.add(ticket, self._meta(version, a.id), (ticket, version))
        if self.lay.coalesce_stored:
            if not self.unconfirmed[shard]:
                self.held_since[shard] = self.t
            self.unconfirmed[shard].append((a, made))  # told with the shard's next stored call
        else:
            self._stored(shard, [(a, made)])  # one confirmation for the whole add

    def _confirm(self, due) -> None:
        shard = self.rng.choice(due if due is not None else [s for s, adds in self.unconfirmed.items() if adds])
        adds, self.unconfirmed[shard] = self.unconfirmed[shard], []
        if self.lay.rate and self.lay.relays:  # to its node's relay, which carries it up with its next call
            node = shard % self.lay.relays
            if not self.relay_queue[node]:
                self.relay_queue_since[node] = self.t
            self.relay_queue[node].append((shard, adds))
            return
        if self.faults.relay_resends and self.rng.random() < 0.3:
            self.faults.relay_resends -= 1
            self.resent += sum(len(made) for _, made in adds)
            for _, made in adds:  # carried up by the relay, which then never answered
                for ticket, _ in made:
                    self.supply.ledger.stored(ticket, shard)
            # The shard sends them itself once it gives up on the relay (RELAY_CONFIRM_S later): with a later
            # confirmation, so that a learner may have claimed (and taken) them by then.
            self.unconfirmed[shard].extend(adds)
            return
        self._stored(shard, adds)

    def _stored(self, shard: int, adds: list) -> None:
        self.calls["stored"] += 1
        self._store(shard, adds)

    def _store(self, shard: int, adds: list) -> None:
        """The board takes one shard's confirmations (in a stored call, or a relay's)."""
        ok = 0
        for _, made in adds:
            for ticket, _ in made:
                self.confirmed += 1
                if self.supply.ledger.stored(ticket, shard):
                    ok += 1
                else:
                    self.stores[shard].reject(ticket)  # refunded meanwhile (a lease, a death): another makes it
        self.stored_lately.add(ok)
        self._hurry_tails()

    # ------------------------------------------------------------------ the clocks (Layout.rate)
    def _hurry_tails(self) -> None:
        """The board's rule: an update with no more than ``tail_size`` fragments left to store is at its tail."""
        if not self.lay.rate:
            return
        ledger = self.supply.ledger
        if not self.lay.hurry:
            return
        tail = tail_size(self.per_update, self.stored_lately.total())
        for u in range(max(ledger.published, 0), ledger.created_through() + 1):
            if u not in self.hurried and ledger.unstored(u) <= tail:
                self.hurried.add(u)

    def _urgent(self, adds: list) -> bool:
        return any(t.update in self.hurried for _, made in adds for t, _ in made)

    def _shard_due(self, shard: int) -> float:
        adds = self.unconfirmed[shard]
        paced = self.lay.pace and not self._urgent(adds)
        return self.held_since[shard] + (STORED_PACE_S if paced else STORED_GATHER_S)

    def _due_shards(self) -> list[int]:
        return [s for s, adds in self.unconfirmed.items() if adds and self.t >= self._shard_due(s)]

    def _relay_due(self, node: int, wants: bool) -> float | None:
        """When relay ``node`` calls the board next (NodeRelay._due): a pace after its last call while its actors
        want tickets, CONFIRM_GATHER_S (or the short clock) after the first confirmation it holds; never sooner
        than the board's interval after its last call."""
        due = []
        if wants:
            due.append(self.relay_last[node] + max(RELAY_PACE_S, self.relay_interval))
        queue = self.relay_queue[node]
        if queue:
            urgent = any(self._urgent(adds) for _, adds in queue)
            due.append(self.relay_queue_since[node] + (STORED_GATHER_S if urgent else CONFIRM_GATHER_S))
        return max(min(due), self.relay_last[node] + self.relay_interval) if due else None

    def _wanting_nodes(self, pollers) -> set:
        return {a.id % self.lay.relays for a in pollers}

    def _due_relays(self, pollers) -> list:
        wanting = self._wanting_nodes(pollers)
        out = []
        for node in range(self.lay.relays):
            due = self._relay_due(node, node in wanting)
            if due is not None and self.t >= due:
                out.append((node, [a for a in pollers if a.id % self.lay.relays == node]))
        return out

    def _relay_call(self, due) -> None:
        """One relay's call: its shards' confirmations, blocks for its actors that wait, and the next blocks of
        those that will run out before its next call (the real relay asks for a pace of its actors' demand ahead,
        ``TicketRelay.wanted``)."""
        node, pollers = self.rng.choice(due)
        self.calls["relay_poll"] += 1
        self.relay_last[node] = self.t
        queue, self.relay_queue[node] = self.relay_queue[node], []
        for shard, adds in queue:
            self._store(shard, adds)
        for a in pollers:
            self._give_block(a)
        running = sum(1 for a in self.actors.values() if a.alive and a.hung_since is None)
        ahead = self.lay.rate / max(running, 1) * max(RELAY_PACE_S, self.relay_interval)  # made in a pace
        for a in self.actors.values():
            if a.id % self.lay.relays == node and a.alive and a.hung_since is None and a.tickets \
                    and len(a.tickets) <= ahead and self.supply.ledger.has_ticket_for(self.supply.version):
                self._give_block(a, ahead=True)

    def _next_due(self) -> float | None:
        """The earliest clock still to come: a shard's, a relay's, a claim's part wait."""
        running = [a for a in self.actors.values() if a.alive and a.hung_since is None]
        idle = [a for a in running if not a.tickets and not a.made]
        wanting = self._wanting_nodes(self._pollers(idle)) if self.lay.relays else set()
        times = [self._shard_due(s) for s, adds in self.unconfirmed.items() if adds]
        times += [d for n in range(self.lay.relays) if (d := self._relay_due(n, n in wanting)) is not None]
        times += [since + CLAIM_WAIT_S for since in self.claim_from.values()]
        later = [x for x in times if x > self.t]
        return min(later) if later else None

    def _need(self, r: int) -> int:
        """What rank r claims itself: its whole remaining batch, or (group_claims) the replacements of its failed
        takes."""
        if self.lay.group_claims:
            return self.short[r]
        f = self.feeds[r]
        return (self.lay.fragments_per_learner - len(f["have"])
                - sum(len(p[4]) for p in self.pending_takes if p[0] == r))

    def _claim(self, claimers) -> None:
        r = self.rng.choice(claimers)
        f = self.feeds[r]
        self.calls["claim"] += 1
        got = self.supply.ledger.claim(r, f["next"], self._need(r))
        self.claim_from.pop((r, f["next"]), None)  # a next claim for it waits from now
        if self.lay.group_claims:
            self.short[r] -= sum(len(ids) for ids in got.values())
        for shard, ids in got.items():
            self.pending_takes.append((r, f["next"], shard, self.shard_inc[shard], ids))

    def _group_claim(self, _) -> None:
        from pipeline.feed import split_claims

        self.calls["claim"] += 1
        got = self.supply.ledger.claim(0, self.lead_update, sum(self.owed.values()))
        self.claim_from.pop(("group", self.lead_update), None)
        parts = split_claims({shard: (None, ids) for shard, ids in got.items()}, self.owed)
        for r, part in parts.items():
            for shard, (_, ids) in part.items():
                self.pending_takes.append((r, self.lead_update, shard, self.shard_inc[shard], ids))
        self._lead_on()

    def _lead_on(self) -> None:
        """Rank 0 leads the next update once every rank has its part and its own batch is whole."""
        if not any(self.owed.values()) and self.feeds[0]["next"] > self.lead_update:
            self.lead_update += 1
            self.owed = {r: self.lay.fragments_per_learner for r in range(self.lay.learners)}

    def _takeable(self) -> list[int]:
        """Pending takes a feed can make now: a part for an update its rank has not reached waits (in its inbox)."""
        return [i for i, p in enumerate(self.pending_takes) if p[1] <= self.feeds[p[0]]["next"]]

    def _take(self, _) -> None:
        eligible = self._takeable()
        r, update, shard, inc, ids = self.pending_takes.pop(eligible[self.rng.randrange(len(eligible))])
        f = self.feeds[r]
        if f["next"] != update:  # this feed was restarted with its group: the claim died with it
            return
        failed = []
        if self.shard_inc[shard] != inc:
            failed, items = list(ids), []
        else:
            items, failed = self.stores[shard].take(ids)
        if failed:
            self.supply.ledger.claim_failed(failed)
            if self.lay.group_claims and r == 0:
                self.owed[0] += len(failed)  # rank 0 claims them again with its next group claim
            elif self.lay.group_claims:
                self.short[r] += len(failed)
        f["have"].extend(item for _, item in items)
        assert len(f["have"]) <= self.lay.fragments_per_learner, f"learner {r} got more than its batch"
        if len(f["have"]) == self.lay.fragments_per_learner:
            f["ready"].append((update, f["have"]))
            f["have"] = []
            f["next"] += 1
            if self.lay.group_claims and r == 0:
                self._lead_on()

    def _update(self, _) -> None:
        u = self.group_update
        lag = self.lay.lag
        for r, f in enumerate(self.feeds):
            update, batch = f["ready"].popleft()
            assert update == u
            assert len(batch) == self.lay.fragments_per_learner, f"learner {r} update {u}: {len(batch)} fragments"
            for ticket, version in batch:
                assert ticket.update == u, f"ticket for update {ticket.update} trained by update {u}"
                assert version >= u - lag, f"stale fragment (version {version}) trained by update {u}, lag {lag}"
                if lag == 0:
                    assert version == u
                assert ticket.id not in self.trained_ids, f"ticket {ticket.id} trained twice"
                self.trained_ids.add(ticket.id)
            self.per_learner_per_update[(r, u)] = len(batch)
            self.trained += len(batch)
        self.group_update = u + 1
        self.version = u + 1
        self._publish(self.version)

    def _publish(self, version: int) -> None:
        self.calls["publish"] += 1
        for shard, ids in self.supply.publish(version, [f"w{version}"]).items():
            self.stores[shard].drop(ids)
        self._hurry_tails()
        self.claim_from = {k: v for k, v in self.claim_from.items() if k[1] >= self.group_update}

    def _hung(self, hung) -> None:
        """Time passes for a hung actor: mostly nothing; sometimes it wakes (a SIGCONT, a slow step that returned)
        and goes on with the tickets it holds, whose leases may have expired (their copies are then refused); past
        the health deadline the driver kills and replaces it."""
        a = self.rng.choice(hung)
        deadline = a.hung_since + HANG_NOTICE_LEASES * self.lease
        if self._clock() >= deadline:
            a.alive = False
            self.hung_killed += 1
            self.dead_unnoticed.append(a)
            return
        if self.rng.random() < 0.001:
            a.hung_since = None
            return
        stuck = not self.in_flight and not self.pending_takes and not any(
            x.alive and x.hung_since is None and (x.tickets or x.made) for x in self.actors.values())
        if stuck:  # nothing else moves until a lease expires or the deadline comes: the clock jumps there
            expiry = self.supply.ledger.next_expiry()
            expiry = deadline if expiry is None else expiry
            if self.lay.rate:  # (or until a shard's, a relay's or a claim's clock comes due)
                due = self._next_due()
                self.t = max(self.t, min(expiry, deadline, due if due is not None else deadline))
            else:
                self.now = max(self.now, min(expiry, deadline) - 1)

    def _notice(self, _) -> None:
        a = self.dead_unnoticed.pop(0)
        self.supply.ledger.actor_gone(a.id, a.inc)
        if a.id in self.actors and self.actors[a.id] is a:
            self._spawn(a.id)  # replaced, same id, next incarnation

    def _fault(self, _) -> None:
        f = self.faults
        alive = [a for a in self.actors.values() if a.alive]
        kinds = [k for k in ("actor_deaths", "shard_deaths", "actors_added", "actors_removed", "learner_restarts",
                             "actor_hangs")
                 if getattr(f, k) and not (k == "actors_removed" and len(self.actors) <= self.lay.shards)
                 and not (k in ("actor_deaths", "actor_hangs") and not alive)]
        if not kinds:
            return
        kind = self.rng.choice(kinds)
        setattr(f, kind, getattr(f, kind) - 1)
        if kind == "actor_deaths":
            a = self.rng.choice(alive)
            a.alive = False  # its in-flight add may still land; the ledger must refuse it once refunded
            a.tickets, a.made = [], []
            self.dead_unnoticed.append(a)
        elif kind == "actor_hangs":
            a = self.rng.choice(alive)
            if a.hung_since is None:
                a.hung_since = self._clock()  # it keeps its tickets and what it made; nothing moves until it wakes
        elif kind == "shard_deaths":
            s = self.rng.randrange(self.lay.shards)
            # Stored, never confirmed: its actor gives those back (the add raised, or it kept them since it was
            # acknowledged: ReplayShard.add_many(ack="held"), RolloutActor._shard_lost).
            for a, made in self.unconfirmed.pop(s, []):
                if a.alive:
                    a.failed.extend(ticket for ticket, _ in made)
            self.stores[s] = FragmentStore(capacity=10**9)
            self.shard_inc[s] += 1
            self.supply.register_shard(s, f"shard{s}.{self.shard_inc[s]}")
        elif kind == "actors_added":
            self._spawn(max(self.actors) + 1)
        elif kind == "actors_removed":
            a = self.actors.pop(max(self.actors))  # scale-down removes the highest ids
            a.alive = False
            a.tickets, a.made = [], []
            self.supply.ledger.actor_gone(a.id, a.inc)
        elif kind == "learner_restarts":
            # The whole group dies with what it prepared; the new one continues at the next version.
            next_version = self.version + 1
            for ticket, shard in self.supply.ledger.learners_restarted(next_version):
                self.stores[shard].drop([ticket])
            self.feeds = [self._fresh_feed(next_version) for _ in range(self.lay.learners)]
            self._lead(next_version)
            self.pending_takes = []
            self.group_update = self.version = next_version
            self._publish(next_version)


def run(layout: Layout, faults: Faults | None = None, updates: int = 10, seed: int = 0,
        max_events: int = 2_000_000) -> Report:
    m = Model(layout, faults or Faults(), seed)
    while m.group_update < updates:
        if not m.step():
            f = m.feeds
            raise AssertionError(
                f"deadlock at update {m.group_update}: learners wait for "
                f"{[(x['next'], len(x['have'])) for x in f]} (update, have) and nothing can move; tickets: "
                f"{m.supply.ledger.describe(m.group_update)}")
        if m.events > max_events:
            raise AssertionError(f"no end after {max_events} events (update {m.group_update})")
    st = m.supply.ledger.stats
    return Report(updates=m.group_update, produced=st.fragments_stored, trained=m.trained, stale=st.voided_stored,
                  refunded=st.refunded, rejected=st.rejected, events=m.events,
                  per_learner_per_update=m.per_learner_per_update, lease_expired=st.lease_expired,
                  hung_killed=m.hung_killed, board_calls=dict(m.calls), max_open_calls=m.max_open_calls,
                  concurrency=m.concurrency, made_by_slow=m.made_by_slow, resent=m.resent, seconds=m.t,
                  issued=st.tickets_issued, confirmed=m.confirmed, claimed=st.fragments_claimed)
