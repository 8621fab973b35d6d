"""The supply board: weights, fragment tickets and the shard directory, in one small actor.

One rule gives the routing and the rate limit for every layout: a fragment is made only against a ticket, and a
ticket names the update that will train on it. The ticket states, the messages, a fragment's life and every clock
are ``docs/protocol.md``'s (the code: ``pipeline/protocol.py``); why one board serves any layout is
``docs/architecture.md``'s first decision.

Three layers, one job each. ``TicketLedger`` is the accounting: every ticket's state and holder (no Ray, no
waiting: the property-based scale model in tests drives it directly). ``Supply`` is the board's state beside it: the
newest weights, the shard directory and the learner group whose calls count. ``SupplyBoard`` is the actor: it parks
a call until what it waits for may exist, batches and paces the calls, and changes state only through ``Supply``
and its ledger.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from dataclasses import dataclass

import ray

from pipeline import runtime
from pipeline.protocol import (ACTIVE_WINDOW_S, BOARD_SPARE_CALLS, CLAIM_PART_WAITS, CLAIM_PARTS, CLAIM_WAIT_S,
                               CLAIMED, DONE_KEPT, DONE_KEPT_S, DONE_MIN_KEPT, ISSUED, LEASE_CHECK_S, LEASE_FLOOR_S,
                               LEASE_MEDIANS, LEASE_SAMPLES, MAX_GONE_KEPT, MAX_REPORTED_EPISODES, PENDING,
                               RELAY_CALLS_PER_S, RELAY_INTERVAL_MAX_S, STATES, STORED, STORED_PACE_S, TAIL_FRACTION,
                               TAIL_MIN, TAIL_PACES, ActiveWindow, ActorGone, Claim, Gone, Part, Poll, PollAnswer,
                               Publish, RelayAnswer, RelayPoll, ShardChange, ShardDirectory, Stored, Ticket,
                               WeightsNews, WeightsWait, fair_share, message)

# CLAIM_WAIT_S is not used here: the benches read it from this module.


@dataclass
class _Entry:
    update: int
    state: str = PENDING
    holder: tuple = ()  # ISSUED: (actor_id, incarnation); STORED: (shard,); CLAIMED: (learner rank,)
    since: float = 0.0  # when it entered its state (what a stall report shows)
    ticket: Ticket | None = None  # as last issued: a shard keys the copy it holds by it
    shard: int = -1  # where its stored copy is (kept while claimed: a dead learner's claim leaves it there)


@dataclass
class LedgerStats:
    tickets_created: int = 0
    tickets_issued: int = 0  # issuances: a refunded ticket issued again counts again
    fragments_stored: int = 0  # accepted by a shard: what the producers delivered
    fragments_claimed: int = 0
    refunded: int = 0  # tickets given back after their fragment was lost (actor, shard, add or learner failure)
    rejected: int = 0  # late copies of refunded tickets, thrown away by their shard
    voided: int = 0  # tickets of updates the learners skipped (a learner-group restart)
    voided_stored: int = 0  # ... of which a shard already held the fragment (env steps spent for nothing)
    lease_expired: int = 0  # issued tickets not stored within their lease: given to another actor (also refunded)
    confirmed_again: int = 0  # a confirmation sent again (its relay carried it up, then did not answer): counted once


class TicketLedger:
    """The accounting of fragment tickets: every ticket's state and holder, so each fragment is made, stored and
    trained exactly once (``docs/protocol.md``'s states). ``per_update``: fragments one learner update takes over
    all learners. ``lease_s``: how long an issued ticket may go without a stored fragment before it is given to
    another actor (None: derived from the measured fragment times, ``lease``). ``clock``: injectable for tests."""

    def __init__(self, per_update: int, max_policy_lag: int, clock=time.monotonic, lease_s: float | None = None,
                 board_incarnation: int = 0):
        if per_update < 1:
            raise ValueError(f"per_update must be >= 1, got {per_update}")
        if max_policy_lag < 0:
            raise ValueError(f"max_policy_lag must be >= 0, got {max_policy_lag}")
        self.per_update = per_update
        self.lag = max_policy_lag
        self.clock = clock
        self.published = -1  # newest policy version; updates < published are done
        # After a learner-group restart: no ticket may be filled by a policy older than the new group's first one
        # (those came from weights the restored learners never had, whatever their version numbers say).
        self.min_version_floor = -1
        self._created_through = -1  # highest update whose tickets exist
        # A replaced board's ledger numbers its tickets from a range of its own (``board_incarnation``): a late copy
        # made for the dead board's ticket can never be taken for one of the new board's.
        self._next_id = board_incarnation << 40
        self._issues = board_incarnation << 40
        # Only tickets that left "pending" have an entry: memory follows what is in flight, not per_update.
        self._entries: dict[int, _Entry] = {}
        self._fresh: dict[int, int] = {}  # update -> tickets not issued yet (never had an entry)
        self._refunds: dict[int, collections.deque] = {}  # update -> refunded ticket ids, issued before fresh ones
        self._stored: dict[int, dict[int, set]] = {}  # update -> shard -> ids not yet claimed
        self._delivered: dict[int, int] = {}  # update -> fragments stored or claimed (what is left to make: the rest)
        self._by_actor: dict[tuple, set] = collections.defaultdict(set)  # (actor, incarnation) -> issued ids
        self.fixed_lease_s = lease_s
        # Issuances in issue order (issued_at, id, issue serial): the oldest lease is always at the left, so expiring
        # costs one look per expired or finished ticket, not a scan of everything in flight.
        self._leases: collections.deque = collections.deque()
        self._fragment_times: collections.deque = collections.deque(maxlen=LEASE_SAMPLES)
        # Trained tickets of finished updates: id -> (issue, shard, when its update finished), oldest first, kept as
        # DONE_KEPT_S / DONE_MIN_KEPT / DONE_KEPT say. A shard may confirm one again after its update is done
        # (``stored``), and that is not a late copy.
        self._done: collections.OrderedDict = collections.OrderedDict()
        self.stats = LedgerStats()

    # ------------------------------------------------------------------ learner side
    def publish(self, version: int) -> list[tuple[Ticket, int]]:
        """Policy ``version`` exists. Updates below it are finished (their tickets forgotten; after a jump, as by
        a learner-group restart, the unfinished ones are void); tickets up to ``version + lag`` come into being.
        Returns (ticket, shard) of the void tickets whose fragments a shard holds (the shards drop them)."""
        if version <= self.published:
            raise ValueError(f"policy version must increase: got {version} after {self.published}")
        self.published = version
        void_stored = []
        now = self.clock()
        for tid in [t for t, e in self._entries.items() if e.update < version]:
            e = self._entries.pop(tid)
            if e.state == CLAIMED:
                self._done[tid] = (e.ticket.issue, e.shard, now)
            if e.state == STORED:
                self.stats.voided_stored += 1
                void_stored.append((e.ticket, e.shard))
            elif e.state == ISSUED:
                self._by_actor[e.holder].discard(tid)
            if e.state != CLAIMED:  # a claimed ticket's update trained; anything else was skipped
                self.stats.voided += 1
        for table in (self._fresh, self._refunds, self._stored, self._delivered):
            for u in [u for u in table if u < version]:
                if table is self._fresh:
                    self.stats.voided += table[u]
                del table[u]
        self._forget_done(now)
        for u in range(max(self._created_through + 1, version), version + self.lag + 1):
            self._fresh[u] = self.per_update
            self.stats.tickets_created += self.per_update
        self._created_through = max(self._created_through, version + self.lag)
        return void_stored

    def _forget_done(self, now: float) -> None:
        """The finished tickets no confirmation sent again can still name (DONE_KEPT_S, DONE_MIN_KEPT, DONE_KEPT)."""
        done, oldest_kept = self._done, now - DONE_KEPT_S
        while len(done) > DONE_KEPT or (len(done) > DONE_MIN_KEPT and next(iter(done.values()))[2] < oldest_kept):
            done.popitem(last=False)

    def claim(self, rank: int, update: int, max_items: int) -> dict[int, list[Ticket]]:
        """Up to ``max_items`` stored fragments of ``update`` for learner ``rank``: {shard: [tickets]}. A shard
        may hold two copies of a ticket for a moment (a refunded one and its remake); the ticket names which."""
        out: dict[int, list[int]] = {}
        by_shard = self._stored.get(update, {})
        n = 0
        now = self.clock()
        for shard in list(by_shard):
            ids = by_shard[shard]
            while ids and n < max_items:
                tid = ids.pop()
                e = self._entries[tid]
                e.state, e.holder, e.since = CLAIMED, (rank,), now
                out.setdefault(shard, []).append(e.ticket)
                n += 1
            if not ids:
                del by_shard[shard]
            if n >= max_items:
                break
        self.stats.fragments_claimed += n
        return out

    def claim_failed(self, tickets) -> int:
        """The learner could not take these (their shard died first): produce them again."""
        return sum(self._refund(t.id) for t in tickets if self._state(t.id) == CLAIMED)

    def learners_restarted(self, next_version: int) -> list[tuple[Ticket, int]]:
        """A new learner group continues at ``next_version``: what the old one had claimed died with it. Claims
        for later updates are refunded; those for the updates it skips were made for nothing (counted stale).
        Returns (ticket, shard) of every such claim: a copy the dead learner had not taken yet is still in its
        shard, and the shard must drop it."""
        lost, orphans, wasted = [], [], 0
        for tid, e in self._entries.items():
            if e.state == CLAIMED:
                orphans.append((e.ticket, e.shard))
                if e.update >= next_version:
                    lost.append(tid)
                else:
                    wasted += 1
            elif e.state in (ISSUED, STORED) and e.update >= next_version:
                # Made (or being made) with the dead group's newest weights, which the new group restarts from an
                # older checkpoint than: made again with the new group's policy, so a batch's policy lag is true.
                lost.append(tid)
                if e.state == STORED:
                    orphans.append((e.ticket, e.shard))
        self.stats.voided += wasted
        self.stats.voided_stored += wasted
        for tid in lost:
            self._refund(tid)
        self.min_version_floor = max(self.min_version_floor, next_version)
        return orphans

    def min_version(self, update: int) -> int:
        """The oldest policy that may fill a ticket of ``update``."""
        return max(update - self.lag, self.min_version_floor)

    # ------------------------------------------------------------------ producer side
    def request(self, actor_id: int, incarnation: int, version: int) -> Ticket | None:
        """A ticket an actor holding policy ``version`` may fill (lowest update first), or None."""
        got = self._issue(actor_id, incarnation, version, 1)
        return got[0] if got else None

    def _issue(self, actor_id: int, incarnation: int, version: int, n: int) -> list[Ticket]:
        """Up to ``n`` tickets for an actor holding ``version``, lowest update first (refunded ones of an update
        before its fresh ones), in one pass over the open updates: a block is one look at them, not one per
        ticket (per ticket, that look was a third of the board's own CPU at 1,000 actors)."""
        out: list[Ticket] = []
        now = self.clock()
        for u in sorted(set(self._fresh) | set(self._refunds)):
            if len(out) >= n or self.min_version(u) > version:
                break
            min_version = self.min_version(u)
            refunds = self._refunds.get(u)
            while len(out) < n and (refunds or self._fresh.get(u, 0) > 0):
                if refunds:
                    tid = refunds.popleft()
                else:
                    self._fresh[u] -= 1
                    tid = self._next_id
                    self._next_id += 1
                    self._entries[tid] = _Entry(u)
                e = self._entries[tid]
                e.state, e.holder, e.since = ISSUED, (actor_id, incarnation), now
                self._by_actor[e.holder].add(tid)
                self._issues += 1
                self.stats.tickets_issued += 1
                e.ticket = Ticket(tid, u, min_version, actor_id, incarnation, self._issues, now)
                self._leases.append((now, tid, self._issues))
                out.append(e.ticket)
        return out

    def request_block(self, actor_id: int, incarnation: int, version: int, max_n: int, active_actors: int,
                      weight: int = 1) -> list:
        """Up to ``max_n`` tickets in one call, lowest update first, never more than a fair share of ``tickets``
        (``weight``: the actors a node relay asks for). For one actor ``tickets`` is what is free now, so an update's
        last tickets are spread over the actors instead of made one after another by the first to ask (whole-update
        shares made 3-actor runs ~4% slower). For a relay, which shares what it gets again, it is all the tickets of
        the updates with some free: a relay asking for a quarter of the actors took a quarter of what was left each
        time, ~10 calls to drain one update where 1-2 do."""
        free_by_update = self._free_by_update(version)
        free = sum(free_by_update.values())
        tickets = free if weight <= 1 else max(free, self.per_update * len(free_by_update))
        n = min(max_n, free, fair_share(tickets, weight, active_actors))
        return self._issue(actor_id, incarnation, version, n)

    def _free_by_update(self, version: int) -> dict[int, int]:
        """{update: tickets an actor holding ``version`` could be issued now}, only updates with some."""
        out: dict[int, int] = {}
        refunded = ((u, len(ids)) for u, ids in self._refunds.items())
        for u, n in itertools.chain(self._fresh.items(), refunded):
            if n and self.min_version(u) <= version:
                out[u] = out.get(u, 0) + n
        return out

    def free_for(self, version: int) -> int:
        """Tickets an actor holding ``version`` could be issued now."""
        return sum(self._free_by_update(version).values())

    def stored_count(self, update: int) -> int:
        return sum(len(ids) for ids in self._stored.get(update, {}).values())

    def has_ticket_for(self, version: int) -> bool:
        return (any(n and self.min_version(u) <= version for u, n in self._fresh.items())
                or any(ids and self.min_version(u) <= version for u, ids in self._refunds.items()))

    def stored(self, ticket: Ticket, shard: int) -> bool:
        """A shard holds ``ticket``'s fragment. False: the ticket was given back meanwhile (drop this copy)."""
        e = self._entries.get(ticket.id)
        done = self._done.get(ticket.id) if e is None else None
        if done is not None and done[:2] == (ticket.issue, shard) or (
                e is not None and e.state in (STORED, CLAIMED) and e.ticket == ticket and e.shard == shard):
            # The same confirmation again: a shard whose relay carried it up but did not answer sends it itself
            # (pipeline/replay.py), maybe after a learner claimed the fragment or even trained on it. The copy is
            # the one already counted: kept while its update is open, nothing counted twice, nothing refused.
            self.stats.confirmed_again += 1
            return e is not None
        # Refused copies count too: if every fragment outlived its lease, only their times can lengthen it.
        self._fragment_times.append(self.clock() - ticket.issued_at)
        if e is None or e.state != ISSUED or e.ticket != ticket:
            self.stats.rejected += 1
            return False
        self._by_actor[e.holder].discard(ticket.id)
        e.state, e.holder, e.since, e.shard = STORED, (shard,), self.clock(), shard
        self._stored.setdefault(e.update, {}).setdefault(shard, set()).add(ticket.id)
        self._delivered[e.update] = self._delivered.get(e.update, 0) + 1
        self.stats.fragments_stored += 1
        return True

    def created_through(self) -> int:
        """The highest update whose tickets exist."""
        return self._created_through

    def unstored(self, update: int) -> int:
        """Fragments of ``update`` no shard has reported stored yet (pending, issued, or lost and refunded)."""
        return self.per_update - self._delivered.get(update, 0)

    def add_failed(self, ticket: Ticket) -> int:
        """The actor's ``add`` raised (its shard died). If the shard had reported it stored, ``shard_lost``
        gives it back instead; either way exactly once."""
        e = self._entries.get(ticket.id)
        if e is not None and e.state == ISSUED and e.ticket == ticket:
            return self._refund(ticket.id)
        return 0

    def actor_gone(self, actor_id: int, incarnation: int) -> int:
        """An actor died or was removed: its tickets with no stored fragment go to the others."""
        return sum(self._refund(tid) for tid in list(self._by_actor.pop((actor_id, incarnation), ())))

    def shard_lost(self, shard: int) -> int:
        """A shard died: the fragments it held and nobody had claimed are produced again."""
        lost = [tid for by_shard in self._stored.values() for tid in by_shard.pop(shard, ())]
        return sum(self._refund(tid) for tid in lost)

    def lease(self) -> float:
        """Seconds an issued ticket may go unstored: the fixed ``lease_s``, or LEASE_MEDIANS x the median measured
        issue-to-store time (at least LEASE_FLOOR_S). The median, not a high quantile: one actor 10x slower than
        the rest must lose its tickets to them instead of setting everybody's lease."""
        if self.fixed_lease_s is not None:
            return self.fixed_lease_s
        times = sorted(self._fragment_times)
        median = times[len(times) // 2] if times else 0.0
        return max(LEASE_FLOOR_S, LEASE_MEDIANS * median)

    def expire_leases(self) -> int:
        """Give back every issued ticket older than its lease (a hung, stopped or very slow actor holds it): it
        goes to the next actor that asks, and the holder's late copy is refused. Returns how many."""
        limit = self.clock() - self.lease()
        expired = 0
        # Leases of issues stored or refunded since are dropped on the way too, not only once they would have run
        # out: the queue holds the issuances from the oldest lease still held on, never a whole lease's worth of
        # finished ones (an hour of them under a fixed lease of an hour).
        while self._leases:
            since, tid, issue = self._leases[0]
            held = self._lease_held(tid, issue)
            if held and since > limit:
                break
            self._leases.popleft()
            if held:
                expired += self._refund(tid)
        self.stats.lease_expired += expired
        return expired

    def next_expiry(self) -> float | None:
        """The clock time at which the oldest lease still held runs out, or None when no ticket is out: when
        ``expire_leases`` next has work (a model of the board jumps its clock there). Leases of tickets stored or
        refunded since are dropped on the way."""
        while self._leases:
            since, tid, issue = self._leases[0]
            if self._lease_held(tid, issue):
                return since + self.lease()
            self._leases.popleft()
        return None

    def _lease_held(self, tid: int, issue: int) -> bool:
        """Whether a lease queued for ``issue`` of ticket ``tid`` still stands: that issue is still out, neither
        stored nor refunded (a refunded ticket's next issue queues a lease of its own)."""
        e = self._entries.get(tid)
        return e is not None and e.state == ISSUED and e.ticket.issue == issue

    # ------------------------------------------------------------------ inspection
    def _state(self, tid: int) -> str | None:
        e = self._entries.get(tid)
        return None if e is None else e.state

    def _refund(self, tid: int) -> int:
        e = self._entries.get(tid)
        if e is None or e.state == PENDING:
            return 0
        if e.state == ISSUED:
            self._by_actor[e.holder].discard(tid)
        elif e.state == STORED:
            self._stored.get(e.update, {}).get(e.holder[0], set()).discard(tid)
        if e.state in (STORED, CLAIMED) and e.update in self._delivered:
            self._delivered[e.update] -= 1
        e.state, e.holder, e.since = PENDING, (), self.clock()
        self._refunds.setdefault(e.update, collections.deque()).append(tid)
        self.stats.refunded += 1
        return 1

    def in_flight(self) -> int:
        """Tickets issued or stored (not claimed): fragments being made or waiting in shards."""
        return sum(1 for e in self._entries.values() if e.state in (ISSUED, STORED))

    def bound(self) -> int:
        """Most fragments that can be in flight at once: (max_policy_lag + 1) updates' worth."""
        return (self.lag + 1) * self.per_update

    def describe(self, update: int) -> dict:
        """Where update ``update``'s tickets are: counts by state, holders, and the oldest age per state."""
        now = self.clock()
        out: dict = {"update": update, "published": self.published, "per_update": self.per_update}
        for state in STATES:
            entries = [e for e in self._entries.values() if e.update == update and e.state == state]
            holders = collections.Counter(e.holder[0] for e in entries if e.holder)
            out[state] = {"count": len(entries), "holders": dict(sorted(holders.items())),
                          "oldest_s": round(max((now - e.since for e in entries), default=0.0), 1)}
        out[PENDING]["count"] += self._fresh.get(update, 0)
        return out


def describe_line(d: dict) -> str:
    """One line for a stall report: where the tickets of the update a learner waits for are."""
    parts = []
    names = {PENDING: "not yet issued", ISSUED: "issued to rollout actor", STORED: "stored in shard",
             CLAIMED: "claimed by learner"}
    for state in STATES:
        s = d[state]
        if not s["count"]:
            continue
        who = ", ".join(f"{k} x{v}" if v > 1 else f"{k}" for k, v in s["holders"].items())
        parts.append(f"{s['count']} {names[state]}{' ' + who if who else ''} (oldest {s['oldest_s']} s)")
    return (f"tickets of update {d['update']} (of {d['per_update']}; newest policy {d['published']}): "
            + ("; ".join(parts) or "none exist"))


def board_concurrency(max_rollout_actors: int, num_shards: int, num_learners: int) -> int:
    """The board's ``max_concurrency``: every call that can be in flight at once (a ``poll`` per rollout actor, a
    ``stored`` per shard, a ``claim`` per learner and rank 0's ``publish``, the driver's few), with room to spare, so
    a call that makes progress never queues behind parked ones."""
    return max_rollout_actors + num_shards + 2 * num_learners + BOARD_SPARE_CALLS


def tail_size(per_update: int, stored_lately: int) -> int:
    """How many fragments left to store put an update at its tail (TAIL_FRACTION, TAIL_PACES, TAIL_MIN), with
    ``stored_lately`` fragments stored over the last TAIL_PACES x STORED_PACE_S."""
    return max(-(-per_update // int(1 / TAIL_FRACTION)), stored_lately, TAIL_MIN)


def keep_report(reports: dict, actor_id: int, incarnation: int, report: dict) -> None:
    """The newest stats per actor in ``reports`` ({actor id: (incarnation, stats)}); the finished episodes of every
    report since the reader last drained them are kept (bounded: the oldest go first if nobody reads)."""
    old = reports.get(actor_id)
    episodes = report.get("episodes", [])
    if old is not None and old[0] == incarnation:
        episodes = (old[1]["episodes"] + episodes)[-MAX_REPORTED_EPISODES:]
    reports[actor_id] = (incarnation, {**report, "episodes": episodes})


class Waiters:
    """Parked calls, woken only when what each waits for may exist (no wake-up of everyone on every change):
    ``wait`` parks until ``predicate()`` holds when a ``wake`` looks, or ``timeout_s`` passes. A claim's ``cost`` is
    the fragments it asks for, so one stored fragment wakes one claim, not every learner's. A woken call can still
    find nothing left when it runs (another call took it first): it returns empty and its caller asks again."""

    def __init__(self):
        self._parked: collections.deque = collections.deque()  # (future, predicate, cost), oldest first

    def __len__(self) -> int:
        return sum(1 for fut, _, _ in self._parked if not fut.done())

    def maybe_parked(self) -> bool:
        """Whether a call may be parked (a cheap look: timed-out ones are only forgotten by the next ``wake``)."""
        return bool(self._parked)

    async def wait(self, predicate, timeout_s: float, cost: int = 0) -> None:
        if predicate() or timeout_s <= 0:
            return
        fut = asyncio.get_running_loop().create_future()
        self._parked.append((fut, predicate, cost))
        try:
            await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            pass

    def wake(self, n: int | None = None, budget: int | None = None) -> int:
        """Wake, oldest first, up to ``n`` (None: all) parked calls whose predicate holds and whose costs fit in
        ``budget`` (None: no limit); returns how many."""
        woken, keep = 0, collections.deque()
        while self._parked:
            fut, predicate, cost = self._parked.popleft()
            if fut.done():  # timed out or cancelled: forgotten here
                continue
            if (n is None or woken < n) and (budget is None or cost <= budget) and predicate():
                fut.set_result(None)
                woken += 1
                if budget is not None:
                    budget -= cost
                if n is not None and woken >= n:
                    break
            else:
                keep.append((fut, predicate, cost))
        keep.extend(self._parked)
        self._parked = keep
        return woken


class RecentSum:
    """The sum of the counts added over the last ``window_s`` seconds (a rate, times the window)."""

    def __init__(self, window_s: float, clock=time.monotonic):
        self.window_s, self.clock = window_s, clock
        self._log: collections.deque = collections.deque()  # (when, count), oldest first
        self._sum = 0

    def add(self, count: int) -> None:
        if count:
            self._log.append((self.clock(), count))
            self._sum += count

    def total(self) -> int:
        limit = self.clock() - self.window_s
        while self._log and self._log[0][0] < limit:
            self._sum -= self._log.popleft()[1]
        return self._sum


@dataclass
class _ShardSlot:
    handle: object = None
    incarnation: int = 0


def by_shard(pairs) -> dict[int, list[Ticket]]:
    out: dict[int, list[Ticket]] = collections.defaultdict(list)
    for ticket, shard in pairs:
        out[shard].append(ticket)
    return dict(out)


class Supply:
    """The board's state beside the ledger (plain, behind ``SupplyBoard``): the newest weights, the learner group
    whose calls count, and the shard directory, which every producer and reader reads the current shard handles
    from, so the driver tells only the board of a replaced shard."""

    def __init__(self, per_update: int, max_policy_lag: int, num_shards: int, lease_s: float | None = None,
                 board_incarnation: int = 0, generation: int = 0):
        """``board_incarnation``: how many boards this run had before this one; ``generation``: the learner
        group's."""
        self.ledger = TicketLedger(per_update, max_policy_lag, lease_s=lease_s, board_incarnation=board_incarnation)
        self.version = -1
        # [weights or their ObjectRef, (self-play) pool]: a list, so Ray passes a ref in it as the ref, not its value
        self.ref_box: list | None = None
        # Shard incarnations numbered per board too: every actor re-reads its shard's handle from a new board.
        self.shards = [_ShardSlot(incarnation=board_incarnation << 20) for _ in range(num_shards)]
        # Learner groups are numbered: a killed group's rank may still claim or publish for a moment (ray.kill
        # is asynchronous), and its calls must not take the new group's fragments or weights version.
        self.generation = generation

    def learners_restarted(self, next_version: int) -> tuple[int, list[tuple[Ticket, int]]]:
        """A new learner group: its generation, and the dead group's claims to drop from the shards."""
        self.generation += 1
        # The dead group's rank 0 owned the weights object: a reader would get OwnerDiedError. Until the new group
        # publishes, there is no news, and actors keep the weights they have.
        self.ref_box = None
        return self.generation, self.ledger.learners_restarted(next_version)

    def publish(self, version: int, ref_box: list, generation: int = 0) -> dict[int, list[Ticket]] | None:
        """New weights; returns {shard: void tickets it holds} (after a learner-group restart only), or None
        when the caller belongs to a replaced learner group (ignored)."""
        if generation != self.generation:
            return None
        void = self.ledger.publish(version)
        self.version, self.ref_box = version, ref_box
        return by_shard(void)

    def claim(self, rank: int, update: int, max_items: int, failed: list, generation: int) -> dict | None:
        """The ledger's claim for a learner of ``generation``; None for a replaced group (nothing claimed, and
        its failed takes are not refunded: its claims were refunded when it was replaced)."""
        if generation != self.generation:
            return None
        if failed:
            self.ledger.claim_failed(failed)
        return self.ledger.claim(rank, update, max_items)

    def news(self, seen_version: int) -> WeightsNews | None:
        return WeightsNews(self.version, self.ref_box) if self.version > seen_version and self.ref_box is not None \
            else None

    def shard_for(self, index: int, known_incarnation: int):
        """(incarnation, handle) when the actor's shard changed since it last looked, else None."""
        slot = self.shards[index]
        return None if slot.incarnation == known_incarnation else ShardChange(slot.incarnation, slot.handle)

    def register_shard(self, index: int, handle) -> int:
        """The first shard at ``index``, or the driver's replacement of a dead one: then what it held is
        refunded and everyone is pointed at the new one. Returns the number of fragments refunded."""
        slot = self.shards[index]
        if slot.handle is None:
            slot.handle = handle
            return 0
        slot.handle, slot.incarnation = handle, slot.incarnation + 1
        return self.ledger.shard_lost(index)


@ray.remote(num_cpus=0, max_restarts=0, enable_task_events=False)  # called per fragment: no GCS task records
class SupplyBoard:
    """The supply board actor: it parks each call until what it waits for may exist, batches and paces the calls
    (``docs/protocol.md``: the messages, and the mechanisms there for scale only), and changes state only through
    ``Supply`` (every ledger move one short, serial step: no await inside one). A parked call is woken only when
    what it waits for may exist: a freed ticket wakes about as many polls as can take it, a stored fragment the
    claims of its update, new weights the calls waiting for weights. Create it with
    ``max_concurrency=board_concurrency(...)``."""

    def __init__(self, per_update: int, max_policy_lag: int, num_shards: int, lease_s: float | None = None,
                 board_incarnation: int = 0, generation: int = 0, expected_actors: int = 1,
                 relay_calls_per_s: float = RELAY_CALLS_PER_S):
        self.supply = Supply(per_update, max_policy_lag, num_shards, lease_s, board_incarnation, generation)
        self.relay_calls_per_s = relay_calls_per_s
        # The rollout actor count the driver runs: the fair share's denominator is never below it. Counting only
        # the actors (and relays' actors) that polled lately, the first to ask at start-up would share everything
        # free among themselves, and a node relay asking for many actors at once would take it all.
        self.expected_actors = expected_actors
        self._ticket_waiters = Waiters()  # polls waiting for a ticket
        self._claim_waiters: dict[int, Waiters] = collections.defaultdict(Waiters)  # update -> parked claims
        self._weight_waiters = Waiters()  # wait_newer calls
        self._shard_waiters = Waiters()  # polls of actors whose shard died, waiting for its replacement
        self._active = ActiveWindow(ACTIVE_WINDOW_S)  # rollout actors and relays asking, a relay for its actors
        self._gone: collections.deque = collections.deque(maxlen=MAX_GONE_KEPT)  # (seq, actor, incarnation)
        self._gone_seq = 0
        # Bumped by every register_shard: node relays and learner feeds re-read the directory.
        self._directory_version = 0
        self._reports: dict[int, tuple] = {}  # rollout actor id -> (incarnation, its newest stats), until read
        self._lease_watch: asyncio.Task | None = None
        self._relays = ActiveWindow(ACTIVE_WINDOW_S)  # node relays calling (_relay_interval's count)
        self._hurried: set[int] = set()  # updates whose tail the shards were told of (ReplayShard.hurry)
        self._stored_recent = RecentSum(TAIL_PACES * STORED_PACE_S)  # fragments stored lately
        self.calls = collections.Counter()  # by method: what the control-plane bench reads

    def _active_actors(self) -> int:
        """Actors asking for tickets lately; a node relay counts as the local actors it asks for."""
        return max(1, self.expected_actors, self._active.count())

    def _tickets_freed(self, active: int | None = None) -> None:
        """Tickets may have come free (published, refunded, a lease expired): wake about as many parked polls as
        can take a share of them, not every one. ``active``: ``_active_actors()`` when the caller has it."""
        ledger = self.supply.ledger
        free = ledger.free_for(max(self.supply.version, ledger.published))
        if free:
            share = fair_share(free, 1, self._active_actors() if active is None else active)
            self.calls["poll_wakeups"] += self._ticket_waiters.wake(-(-free // share))

    def _stored_changed(self, updates) -> None:
        for u in set(updates):
            waiters = self._claim_waiters.get(u)
            if waiters is not None:  # only the claims that what is stored and unclaimed can serve
                self.calls["claim_wakeups"] += waiters.wake(budget=self.supply.ledger.stored_count(u))

    async def _expire_leases(self) -> None:
        """Expired leases go back to pending; parked polls are woken to take them."""
        if self._lease_watch is None:  # started by the first call: the actor's event loop runs only from there
            self._lease_watch = asyncio.get_running_loop().create_task(self._watch_leases())
        if self.supply.ledger.expire_leases():
            self._tickets_freed()

    async def _watch_leases(self) -> None:
        # Also when nobody calls: an update's last ticket may sit with a hung actor while every other actor is
        # parked in a poll, and a parked poll only wakes on a change.
        while True:
            await asyncio.sleep(LEASE_CHECK_S)
            await self._expire_leases()
            for u in [u for u, w in self._claim_waiters.items() if u < self.supply.ledger.published and not len(w)]:
                del self._claim_waiters[u]  # updates that are done: no claim waits for them any more
            self._hurried = {u for u in self._hurried if u >= self.supply.ledger.published}
            self._relays.members()  # a relay gone quiet (dead, replaced, its node idle) frees its share

    # ------------------------------------------------------------------ paced confirmations
    def _hurry_tails(self) -> None:
        """Tell every shard once about each open update at its tail (a small update is from the start)."""
        ledger = self.supply.ledger
        tail = None
        for update in range(max(ledger.published, 0), ledger.created_through() + 1):
            if update in self._hurried:
                continue
            tail = tail_size(ledger.per_update, self._stored_recent.total()) if tail is None else tail
            if ledger.unstored(update) <= tail:
                self._hurry(update)

    def _hurry(self, update: int) -> None:
        self._hurried.add(update)
        self.calls["hurry"] += 1
        for slot in self.supply.shards:
            if slot.handle is not None:
                slot.handle.hurry.remote(update)

    # ------------------------------------------------------------------ weights (learner rank 0)
    async def publish(self, *given, **loose) -> None:
        """One ``Publish``: learner rank 0's new weights."""
        version, ref_box, generation = message(Publish, given, loose)
        self.calls["publish"] += 1
        if generation == self.supply.generation and version <= self.supply.ledger.published:
            # Ray does not keep an async actor's calls in their caller's order: a newer version that came first
            # superseded this one (its tickets and weights stand), so this one is late, not a protocol error.
            self.calls["publish_superseded"] += 1
            return
        for shard, ids in (self.supply.publish(version, ref_box, generation) or {}).items():
            self.supply.shards[shard].handle.drop.remote(ids)  # fragments of skipped updates
        self._hurry_tails()  # before the tickets go out: a shard hears of a small update before its fragments
        self._weight_waiters.wake()
        self._tickets_freed()

    async def latest(self, seen_version: int):
        return self.supply.news(seen_version)

    async def wait_newer(self, *given, **loose):
        """One ``WeightsWait``: the news past ``seen_version``, as soon as there is some (None after ``wait_s``)."""
        seen_version, wait_s = message(WeightsWait, given, loose)
        self.calls["wait_newer"] += 1
        await self._weight_waiters.wait(lambda: self.supply.news(seen_version) is not None, wait_s)
        return self.supply.news(seen_version)

    # ------------------------------------------------------------------ rollout actors
    async def poll(self, *given, **loose) -> PollAnswer:
        """One ``Poll`` (``docs/protocol.md``'s message table): its failed adds go back, and it gets a block (no
        ticket: an empty list), newer weights and a replaced shard; ``want_ticket=False`` waits for the shard."""
        p = message(Poll, given, loose)
        self.calls["poll"] += 1
        self._active.saw(p.actor_id)
        if p.report is not None:
            keep_report(self._reports, p.actor_id, p.incarnation, p.report)
        await self._settle_failed(p.failed)
        tickets = []
        if p.want_ticket:
            tickets = await self._block(p.actor_id, p.incarnation, p.seen_version, p.max_tickets, p.wait_s)
        else:
            await self._shard_waiters.wait(
                lambda: self.supply.shards[p.shard_index].incarnation != p.shard_incarnation, p.wait_s)
        return PollAnswer(tickets, self.supply.news(p.seen_version),
                          self.supply.shard_for(p.shard_index, p.shard_incarnation))

    async def _settle_failed(self, failed: list) -> None:
        """Leases run out first, then the failed adds go back (each unstored ticket once), waking the polls that
        can take them."""
        await self._expire_leases()
        for t in failed:
            self.supply.ledger.add_failed(t)
        if failed:
            self._tickets_freed()

    async def _block(self, holder: int, incarnation: int, seen_version: int, max_tickets: int, wait_s: float,
                     weight: int = 1) -> list:
        """A block of tickets for an actor (or a relay asking for ``weight`` actors) holding ``seen_version``:
        parked up to ``wait_s`` until one it may fill exists. The tickets are for the version it will hold once it
        loads the weights returned with them."""
        ledger = self.supply.ledger

        def eligible_version():
            return max(seen_version, self.supply.version)

        await self._ticket_waiters.wait(lambda: ledger.has_ticket_for(eligible_version()), wait_s)
        self._active.saw(holder, weight)
        active = self._active_actors()
        block = ledger.request_block(holder, incarnation, eligible_version(), max_tickets, active, weight=weight)
        if block and self._ticket_waiters.maybe_parked():
            # A freed batch wakes about free / share parked polls, but each share is of what is left, so those take
            # less than that: the next parked ones are woken for the rest.
            self._tickets_freed(active)
        return block

    async def actor_reports(self) -> dict:
        """{actor id: (incarnation, its newest stats)} of the actors that polled since the last call, with every
        episode they finished since then (drained): the driver's one call for all rollout actors."""
        out, self._reports = self._reports, {}
        return out

    async def relay_poll(self, msg: RelayPoll) -> RelayAnswer:
        """One ``RelayPoll``, a node relay's call for its actors (``docs/protocol.md``'s message table); its shards'
        confirmations are taken before anything else: a claim may be waiting for them."""
        self.calls["relay_poll"] += 1
        self._relays.saw(msg.relay_id)
        confirmed = []
        if msg.confirms:
            self.calls["relay_confirms"] += 1
            confirmed = self._store_many(msg.confirms)
        for actor_id, (actor_incarnation, report) in msg.reports.items():
            keep_report(self._reports, actor_id, actor_incarnation, report)
        await self._settle_failed(msg.failed)
        tickets = []
        weight = max(1, msg.weight)
        if msg.max_tickets > 0:
            self._active.saw(msg.relay_id, weight)  # asking, while parked too
            tickets = await self._block(msg.relay_id, msg.incarnation, msg.seen_version, msg.max_tickets, msg.wait_s,
                                        weight)
        shards = None if msg.directory_version == self._directory_version else self._directory()
        # The deaths after gone_seen: the newest end of the deque, not a scan of all MAX_GONE_KEPT.
        gone = list(itertools.takewhile(lambda g: g.seq > msg.gone_seen, reversed(self._gone)))[::-1]
        return RelayAnswer(tickets, self.supply.news(msg.seen_version), shards, gone, self.supply.ledger.lease(),
                           confirmed, self._relay_interval())

    def _relay_interval(self) -> float:
        """The least interval between one relay's calls: the relays' calls together stay within RELAY_CALLS_PER_S."""
        return min(len(self._relays) / self.relay_calls_per_s, RELAY_INTERVAL_MAX_S)

    async def expect_actors(self, n: int) -> None:
        """The driver runs ``n`` rollout actors now (started, rescaled)."""
        self.expected_actors = n

    async def actor_gone(self, *given, **loose) -> int:
        """One ``ActorGone`` from the driver: the tickets it held go back (how many), and the relays hear of it."""
        actor_id, incarnation = message(ActorGone, given, loose)
        n = self.supply.ledger.actor_gone(actor_id, incarnation)
        self._active.forget(actor_id)
        # A node relay may have lent it tickets: every relay hears of it with its next call.
        self._gone_seq += 1
        self._gone.append(Gone(self._gone_seq, actor_id, incarnation))
        if n:
            self._tickets_freed()
        return n

    # ------------------------------------------------------------------ shards
    async def stored(self, *given, **loose) -> list[bool]:
        """One ``Stored``: the shard holds these tickets' fragments; False for a ticket refunded meanwhile (the shard
        drops that copy)."""
        self.calls["stored"] += 1
        return self._store_many([message(Stored, given, loose)])[0]

    async def stored_many(self, batches: list) -> list[list[bool]]:
        """``stored`` for several shards at once, [Stored] -> one answer each: a node relay's shards' confirmations
        while its ticket call waits here (they usually come with that call, ``relay_poll``)."""
        self.calls["stored_many"] += 1
        return self._store_many(batches)

    def _store_many(self, batches) -> list[list[bool]]:
        """The ledger's answers to [Stored]; the claims they can serve are woken, and the shards told of the updates
        now at their tail."""
        out = []
        for tickets, shard, _ in batches:
            ok = [self.supply.ledger.stored(t, shard) for t in tickets]
            self._stored_recent.add(sum(ok))
            self._stored_changed(t.update for t, good in zip(tickets, ok) if good)
            out.append(ok)
        self._hurry_tails()
        return out

    async def register_shard(self, index: int, handle) -> int:
        n = self.supply.register_shard(index, handle)
        if self._hurried:  # a replacement hears of the tails the others were told of
            handle.hurry.remote(max(self._hurried))
        self._directory_version += 1
        self._shard_waiters.wake()
        if n:
            self._tickets_freed()
        return n

    # ------------------------------------------------------------------ learners
    async def claim(self, *given, **loose) -> dict[int, Part]:
        """One ``Claim``: {shard index: Part} of up to ``max_items`` stored fragments of ``update``, as soon as
        ``min_items`` are stored; after ``wait_s``, a part (CLAIM_PARTS, CLAIM_PART_WAITS). A parked claim is woken
        only when the unclaimed fragments can serve it: one ``stored`` wakes as many claims as it fills."""
        c = message(Claim, given, loose)
        rank, update, max_items, wait_s, generation = c.rank, c.update, c.max_items, c.wait_s, c.generation
        self.calls["claim"] += 1
        if generation != self.supply.generation:
            return {}  # a replaced learner group's feed, not yet dead: it must not claim the new group's data
        ledger = self.supply.ledger
        if c.failed:  # refunds first (others may be waiting for them), then wait for this update's data
            self.supply.claim(rank, update, 0, c.failed, generation)
            self._tickets_freed()
        need = max(1, min(c.min_items, max_items))
        waiters = self._claim_waiters[update]
        await waiters.wait(lambda: ledger.stored_count(update) >= need, wait_s, cost=need)
        if ledger.stored_count(update) < need:
            # A part, once the whole was not there within wait_s: a quarter of it at least (so a batch comes in a
            # few claims however slowly it is made), or what is there after CLAIM_PART_WAITS more waits.
            part = -(-need // CLAIM_PARTS)
            await waiters.wait(lambda: ledger.stored_count(update) >= part, CLAIM_PART_WAITS * wait_s, cost=part)
        got = self.supply.claim(rank, update, max_items, [], generation) or {}
        return {s: Part(self._directory_version, ids) for s, ids in got.items()}

    async def learners_restarted(self, next_version: int) -> int:
        """The new group's generation (its learners pass it with every claim and publish)."""
        generation, orphans = self.supply.learners_restarted(next_version)
        for shard, tickets in by_shard(orphans).items():
            self.supply.shards[shard].handle.drop.remote(tickets)  # claims the dead learners never took
        self._tickets_freed()
        return generation

    # ------------------------------------------------------------------ inspection
    async def describe(self, update: int) -> dict:
        return self.supply.ledger.describe(update)

    async def stats(self) -> dict:
        ledger = self.supply.ledger
        await self._expire_leases()
        return {**ledger.stats.__dict__, "in_flight": ledger.in_flight(), "published": ledger.published,
                "lease_s": ledger.lease(), "version": self.supply.version, "board_calls": dict(self.calls),
                "parked_polls": len(self._ticket_waiters), "rss_mb": runtime.process_rss_mb()}

    async def shard_handles(self) -> list:
        return [s.handle for s in self.supply.shards]

    async def shard_directory(self) -> ShardDirectory:
        """Every shard's handle as of now: what a feed asks for when a claim names a newer directory version than it
        holds (a shard was replaced), or from a board it has not asked yet."""
        self.calls["shard_directory"] += 1
        return self._directory()

    def _directory(self) -> ShardDirectory:
        return ShardDirectory(self._directory_version,
                              [ShardChange(s.incarnation, s.handle) for s in self.supply.shards])
