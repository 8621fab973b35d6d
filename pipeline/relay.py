"""Node relays: the rollout actors of one node take their tickets from one relay, which takes them from the supply
board in blocks for the whole node.

Why: at hundreds of rollout actors the board's work is its calls, not its bookkeeping (profiled at 1,000 simulated
actors: the ledger and the waits are ~5% of the board's CPU, Ray's per-call machinery the rest), and 90% of its
calls are the actors' ticket polls: with two updates' tickets spread over 1,000 actors each poll brings 2-4 tickets,
and an actor with none re-polls every ``TICKET_WAIT_S``. A relay asks the board in one call for the blocks of all
its actors that are waiting (the board's fair share for all its active actors), hands the tickets out locally, and
carries its actors' stats reports and failed adds up in the same call. The board's poll calls then grow with nodes,
not actors.

What stays exact is the board's ledger, which still holds every ticket: to it a relay is one more holder (a relay
id, above every rollout actor id). A relay's actor fills a ticket like any other, its shard reports ``stored``
to the board with the ticket as issued, and a late or void copy is refused there as before. A relay keeps only
who it lent what to, so that the tickets of a gone actor go back to the board as failed adds (the board refunds
those still unstored, exactly once); the board tells the relays which actors are gone (``actor_gone`` is still the
driver's one call).

The replay shards of a node confirm what they hold through its relay too (``NodeRelay.stored``): the relay
gathers its shards' confirmations for ``CONFIRM_GATHER_S`` (``STORED_GATHER_S`` once one of them is urgent: an
update's tail, a producer waiting for the answer, an add waiting for room) and carries them up in the call it makes
for tickets anyway (``relay_poll``); only while that call waits at the board for tickets do they go up on their own
(``SupplyBoard.stored_many``). The board's confirmation calls then grow with nodes, not shards, and under load a
node costs the board one call a pace, not a ticket call and a confirmation call.

The board holds the relays' calls together to a budget (``rollout.relay_calls_per_s``, ``SupplyBoard._relay_interval``):
each answer says how long this relay waits before its next call, the relays it hears from over the budget, so the
board's calls follow the budget, not the node count. A relay's clocks still decide when it calls; the interval only
holds a call back (an update's last confirmations and the next tickets wait up to it at the relay), and a longer
interval makes the relay ask for that much more of its actors' demand ahead.

Failure: a relay is an optimisation, never a dependency. A rollout actor whose relay dies or stops answering polls
the board directly until the board is replaced; one whose relay lost its board does so for ``ACTOR_RELAY_RETRY_S``
and tries the relay again (``RolloutActor._relay_poll``). The tickets a dead or stopped relay held
come back through their leases, as a dead actor's would. A replaced board is attached to every relay by the
driver, and a relay drops everything it held from the old one.

``TicketRelay`` is the plain state; ``NodeRelay`` the async Ray actor around it. Its clocks, its messages and the
fair share it hands tickets out by are ``pipeline/protocol.py``'s.
"""

from __future__ import annotations

import asyncio
import collections
import time

import ray

from pipeline.protocol import (ACTIVE_WINDOW_S, BOARD_WAIT_S, CONFIRM_GATHER_S, DEMAND_WINDOW_S, LEASE_FLOOR_S,
                               RELAY_ANSWER_SLACK_S, RELAY_ID_BASE, RELAY_PACE_S, REPORT_EVERY_S, STORED_GATHER_S,
                               ActiveWindow, Poll, PollAnswer, RelayAnswer, RelayPoll, ShardChange, Stored, fair_share,
                               message)
from pipeline.supply import RecentSum, Waiters, keep_report

# RELAY_ID_BASE is not used here: the driver's graph reads it from this module.


class RelayUnavailable(RuntimeError):
    """The relay cannot reach its board (dead, replaced or silent): the actor polls the board itself."""


class TicketRelay:
    """What a relay holds: a pool of tickets the board issued to it, the tickets lent to each local actor, the
    failed adds and stats reports to carry up, and the board's newest weights and shard directory."""

    def __init__(self, relay_id: int, incarnation: int = 0, pace_s: float = RELAY_PACE_S):
        self.relay_id, self.incarnation, self.pace_s = relay_id, incarnation, pace_s
        self.reset()

    def reset(self) -> None:
        """A new board: everything held from the old one is void."""
        self.pool: collections.deque = collections.deque()  # (ticket, when the relay got it)
        self.lent: dict[tuple, set] = collections.defaultdict(set)  # (actor, incarnation) -> tickets out with it
        self.to_fail: list = []  # tickets whose fragments will not come: the board refunds the unstored ones
        self.reports: dict[int, tuple] = {}  # actor id -> (incarnation, newest stats), until carried up
        self.waiting: dict[int, int] = {}  # actor id -> tickets it asked for, while its poll waits for any
        self.seen = ActiveWindow(ACTIVE_WINDOW_S)  # local actors asking (the actors a fair share is over)
        self.news = None  # (version, ref_box) of the newest weights the board sent
        self.shards: list = []  # [(incarnation, handle)] by shard index
        self.directory_version = -1
        self.gone_seen = 0  # sequence number of the last actor death the board told this relay about
        self.lease_s = LEASE_FLOOR_S  # the board's, from its first answer on
        self.interval_s = 0.0  # the least interval between two board calls, as the board last said (its budget)
        self.dropped = 0  # pooled tickets dropped unmade (older than the lease)
        self.taken = RecentSum(DEMAND_WINDOW_S)  # tickets the local actors took lately

    # ------------------------------------------------------------------ local actors
    def active(self) -> int:
        """Local actors that polled lately: what a fair share is divided over, here and at the board (as the board
        divides over every actor that polls it directly)."""
        return max(1, self.seen.count())

    def version(self, seen_version: int) -> int:
        return max(seen_version, self.news.version if self.news else -1)

    def take(self, actor_id: int, incarnation: int, version: int, max_n: int) -> list:
        """Up to ``max_n`` pooled tickets an actor holding ``version`` may fill, no more than a fair share of the
        pool among the local actors (in the order the board issued them: lowest update first)."""
        self.drop_stale()
        share = fair_share(len(self.pool), 1, self.active())
        out, keep = [], collections.deque()
        for ticket, got in self.pool:
            if len(out) < min(max_n, share) and ticket.min_version <= version:
                out.append(ticket)
            else:
                keep.append((ticket, got))
        self.pool = keep
        self.lent[(actor_id, incarnation)].update(out)
        self.taken.add(len(out))
        return out

    def call_every_s(self) -> float:
        """How long the relay's ticket calls are apart while its actors want tickets: its pace, or the board's
        interval when that is longer (many relays)."""
        return max(self.pace_s, self.interval_s)

    def demand(self, horizon_s: float) -> int:
        """Tickets the local actors will take in the next ``horizon_s``, from what they took over DEMAND_WINDOW_S."""
        return -(-self.taken.total() * horizon_s // DEMAND_WINDOW_S)

    def has_for(self, version: int) -> bool:
        return any(t.min_version <= version for t, _ in self.pool)

    def settled(self, actor_id: int, incarnation: int, failed: list) -> None:
        """An actor polls again: its previous block is settled (every ticket was added, acknowledged or refused, or
        is in ``failed``), so nothing is lent to it any more."""
        self.lent.pop((actor_id, incarnation), None)
        self.to_fail.extend(failed)

    def gone(self, actor_id: int, incarnation: int) -> None:
        """An actor died or was removed: what it held and never settled goes back to the board as failed adds."""
        self.to_fail.extend(self.lent.pop((actor_id, incarnation), ()))
        self.waiting.pop(actor_id, None)
        self.seen.forget(actor_id)

    def drop_stale(self) -> None:
        """Pooled tickets older than the board's lease were given to others by now (their copies would be
        refused): dropped unmade."""
        limit = time.monotonic() - self.lease_s
        while self.pool and self.pool[0][1] < limit:
            self.pool.popleft()
            self.dropped += 1

    def wanted(self) -> int:
        """Tickets to ask the board for: the blocks the local actors waiting now asked for, and what the local
        actors will take before the relay's next call (a pace of their recent demand), less the pool. No more
        ahead than that: a pool filled for actors still busy would hold tickets (the oldest update's among them)
        that idle actors on other nodes could be making. (What the board gives is its fair share for all the
        node's active actors, so what the waiting ones leave in the pool is what their busy neighbours would have
        been given.)"""
        waiting = sum(self.waiting.values())
        ahead = self.demand(self.call_every_s()) if waiting else 0
        return max(0, waiting + ahead - len(self.pool))

    # ------------------------------------------------------------------ the board's answers
    def received(self, answer: RelayAnswer) -> None:
        """The board's answer (its ``confirmed`` are NodeRelay's to hand to its shards)."""
        self.interval_s = answer.interval_s
        now = time.monotonic()
        self.pool.extend((t, now) for t in answer.tickets)
        if answer.news is not None:
            self.news = answer.news
        if answer.shards is not None:
            self.directory_version, self.shards = answer.shards
        for g in answer.gone:
            self.gone(g.actor_id, g.incarnation)
            self.gone_seen = max(self.gone_seen, g.seq)
        self.lease_s = answer.lease_s

    def shard_for(self, index: int, known_incarnation: int):
        if index >= len(self.shards):
            return None
        incarnation, handle = self.shards[index]
        return None if incarnation == known_incarnation else ShardChange(incarnation, handle)


@ray.remote(num_cpus=0, max_restarts=0, enable_task_events=False)  # called per block: no GCS task records
class NodeRelay:
    """Async actor around ``TicketRelay``: ``poll`` is the supply board's, for the actors of this node, and
    ``stored`` its shards'; one board call at a time goes up (``relay_poll``) with the tickets every waiting actor
    will need, the failed adds, the stats reports and the shards' confirmations. Create it with ``max_concurrency``
    above its node's actor and shard count."""

    def __init__(self, board, relay_id: int, incarnation: int = 0, pace_s: float = RELAY_PACE_S):
        self.board = board
        self.state = TicketRelay(relay_id, incarnation, pace_s)
        self._waiters = Waiters()
        self._wake = asyncio.Event()  # something to carry up came, or a local actor waits: the pump looks again
        self._lost: str | None = None  # why the board cannot be reached; local polls then fail fast
        self._pump: asyncio.Task | None = None
        self._parked = False  # the pump's call may wait at the board for tickets (it carries no confirmations)
        # The board had no ticket for the last call that asked: the next ones wait there for tickets (taking them the
        # moment they are freed), so they carry no confirmations, which go up on their own meanwhile.
        self._scarce = False
        self._confirms: list = []  # (Stored, future of the board's answer) waiting to go up
        self._confirms_since = 0.0  # when the first of them came
        self._confirm_urgent = False
        self._confirm_wake = asyncio.Event()
        self._confirm_pump: asyncio.Task | None = None
        self._last_sent = -REPORT_EVERY_S  # when the relay's last board call went (either loop's): the interval's start
        self.calls = collections.Counter()

    def _start_pumps(self) -> None:
        if self._pump is None:  # the actor's event loop runs only from its first call
            loop = asyncio.get_running_loop()
            self._pump = loop.create_task(self._pump_loop())
            self._confirm_pump = loop.create_task(self._confirm_loop())

    async def poll(self, *given, **loose) -> PollAnswer:
        """``SupplyBoard.poll`` for a local actor (one ``Poll``), answered from the relay's pool
        (``RelayUnavailable`` when the board cannot be reached: the actor asks the board itself)."""
        p = message(Poll, given, loose)
        self.calls["poll"] += 1
        self._start_pumps()
        if self._lost:
            raise RelayUnavailable(self._lost)
        st = self.state
        st.settled(p.actor_id, p.incarnation, p.failed)
        if p.report is not None:
            keep_report(st.reports, p.actor_id, p.incarnation, p.report)
        tickets = []
        if p.want_ticket:
            st.seen.saw(p.actor_id)
            if not st.has_for(st.version(p.seen_version)):
                self.calls["poll_waited"] += 1  # the pool had nothing for it: it waits for the next board call
                st.waiting[p.actor_id] = p.max_tickets
                self._wake.set()  # the next board call asks for every waiting actor's block
                try:
                    await self._waiters.wait(lambda: self._lost or st.has_for(st.version(p.seen_version)), p.wait_s)
                finally:
                    st.waiting.pop(p.actor_id, None)
                if self._lost:
                    raise RelayUnavailable(self._lost)
            tickets = st.take(p.actor_id, p.incarnation, st.version(p.seen_version), p.max_tickets)
        else:  # its shard died: wait (parked, as at the board) until the board names the replacement
            self._wake.set()
            await self._waiters.wait(
                lambda: self._lost or st.shard_for(p.shard_index, p.shard_incarnation) is not None, p.wait_s)
        news = st.news if st.news is not None and st.news.version > p.seen_version else None
        return PollAnswer(tickets, news, st.shard_for(p.shard_index, p.shard_incarnation))

    def _due(self, last_call: float) -> float | None:
        """When the next board call is due (None: nothing to carry up): a pace after the last one while local
        actors wait for tickets (at once when ``_scarce``), REPORT_EVERY_S after it for failed adds and stats
        reports alone, and CONFIRM_GATHER_S after the first waiting confirmation (STORED_GATHER_S once one is
        urgent; the pump's only when not ``_scarce``); never sooner than the board's interval after the relay's last
        call, this loop's or ``_confirm_loop``'s (its budget for all relays' calls, ``SupplyBoard._relay_interval``)."""
        st, due = self.state, []
        if st.wanted():  # (once the board had none, at once: the call waits there; the short clock bounds a loop)
            due.append(last_call + (STORED_GATHER_S if self._scarce else st.call_every_s()))
        if st.to_fail or st.reports:
            due.append(last_call + REPORT_EVERY_S)
        if self._confirms and not self._scarce:
            due.append(self._confirms_since + (STORED_GATHER_S if self._confirm_urgent else CONFIRM_GATHER_S))
        return max(min(due), self._last_sent + st.interval_s) if due else None

    async def _pump_loop(self) -> None:
        """One board call at a time (``relay_poll``), when something is due (``_due``), carrying everything there
        is: the tickets the waiting actors will need, the failed adds, the stats reports and the shards'
        confirmations. One call does what were two (a ticket poll and a ``stored_many``) whenever both are wanted
        within a pace, which under load is always. A call with confirmations never waits at the board for tickets
        (a shard sends its next confirmation only once it has the answer to the last, and a claim may be waiting
        for those); once the board had no ticket for a call, the next ones wait there for tickets and carry no
        confirmations (``_scarce``: a relay that only looked once a pace would take freed tickets up to a pace
        late), which go up on their own meanwhile (``_confirm_loop``)."""
        st = self.state
        last_call = -REPORT_EVERY_S
        while True:
            due = self._due(last_call)
            left = REPORT_EVERY_S if due is None else due - time.monotonic()
            if left > 0:
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except asyncio.TimeoutError:
                    pass
                self._wake.clear()
                continue  # due again, with what came meanwhile
            last_call = self._last_sent = time.monotonic()
            board = self.board
            failed, st.to_fail = st.to_fail, []
            reports, st.reports = st.reports, {}
            confirms = []
            if not self._scarce:
                confirms, self._confirms, self._confirm_urgent = self._confirms, [], False
            want = st.wanted()
            self._parked = bool(want) and not confirms
            self.calls["board_calls"] += 1
            self.calls["carried_confirms"] += bool(confirms)
            try:
                answer = await self._ask(board, "relay_poll", RelayPoll(
                    relay_id=st.relay_id, incarnation=st.incarnation, seen_version=st.version(-1), failed=failed,
                    wait_s=BOARD_WAIT_S if self._parked else 0.0, max_tickets=want, reports=reports,
                    directory_version=st.directory_version, gone_seen=st.gone_seen, weight=st.active(),
                    confirms=[c for c, _ in confirms]))
            except RelayUnavailable as error:  # dead, replaced or silent board: actors go to it themselves
                if board is self.board:  # (not a board the driver replaced meanwhile)
                    self._lost = str(error)
                    self._waiters.wake()
                _settle(confirms, error=error)  # each shard confirms with its board itself
                continue
            finally:
                self._parked = False
            self._lost = None
            st.received(answer)
            _settle(confirms, answers=answer.confirmed)
            if want:
                self._scarce = not answer.tickets
                if self._scarce and self._confirms:
                    self._confirm_wake.set()  # the confirmations waiting are no longer the pump's to carry
            # Not asked again at once when it got fewer than it asked for: the board's share is fair per call, and a
            # relay that asked again and again would drain what the other nodes' actors are waiting for (when it got
            # none, the next call waits at the board, which takes nothing from them). A local poll that finds no
            # ticket wakes the next call.
            self._waiters.wake()

    async def stored(self, *given, **loose) -> list[bool]:
        """``SupplyBoard.stored`` for a shard of this node (one ``Stored``): the board's answer, once the
        relay has carried the confirmation up with its next call (``RelayUnavailable`` when the board did not answer
        or was replaced meanwhile: the shard then asks its board itself)."""
        confirm = message(Stored, given, loose)
        self.calls["stored"] += 1
        if self._lost:
            raise RelayUnavailable(self._lost)
        self._start_pumps()
        fut = asyncio.get_running_loop().create_future()
        if not self._confirms:
            self._confirms_since = time.monotonic()
        self._confirms.append((confirm, fut))
        self._confirm_urgent = self._confirm_urgent or confirm.urgent
        self._wake.set()
        self._confirm_wake.set()
        return await fut

    async def _confirm_loop(self) -> None:
        """While the pump's calls wait at the board for tickets (``_parked``, ``_scarce``): the confirmations that
        came meanwhile go up in one ``stored_many``, CONFIRM_GATHER_S after the first (STORED_GATHER_S once one is
        urgent) and the board's interval after the relay's last call, one call at a time. Otherwise the pump carries
        them."""
        while True:
            await self._confirm_wake.wait()
            self._confirm_wake.clear()
            while self._apart() and self._confirms:
                left = max(self._confirms_since + (STORED_GATHER_S if self._confirm_urgent else CONFIRM_GATHER_S),
                           self._last_sent + self.state.interval_s) - time.monotonic()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(self._confirm_wake.wait(), left)
                except asyncio.TimeoutError:
                    pass
                self._confirm_wake.clear()
            if not (self._apart() and self._confirms):
                continue  # the pump's call came back: its next one carries them
            batch, self._confirms, self._confirm_urgent = self._confirms, [], False
            board = self.board
            self._last_sent = time.monotonic()
            self.calls["stored_many"] += 1
            try:
                answers = await self._ask(board, "stored_many", [c for c, _ in batch])
            except RelayUnavailable as error:  # every shard of the batch then confirms with its board itself
                _settle(batch, error=error)
                continue
            _settle(batch, answers=answers)

    async def _ask(self, board, call: str, *args):
        """``board``'s answer to ``call(*args)``, or ``RelayUnavailable`` when the call failed, its answer did not
        come within BOARD_WAIT_S + RELAY_ANSWER_SLACK_S, or came from a board the driver replaced meanwhile
        (void)."""
        try:
            answer = await asyncio.wait_for(_awaitable(getattr(board, call).remote(*args)),
                                            BOARD_WAIT_S + RELAY_ANSWER_SLACK_S)
        except Exception as e:  # noqa: BLE001 - RayActorError, a timeout: dead or silent
            raise RelayUnavailable(f"the relay's supply board did not answer its {call} ({type(e).__name__})") from e
        if board is not self.board:
            raise RelayUnavailable(f"the supply board was replaced while the relay waited for its {call}")
        return answer

    def _apart(self) -> bool:
        """Whether confirmations go up on their own: the pump's calls are waiting at the board for tickets."""
        return self._parked or self._scarce

    async def attach_board(self, board) -> None:
        """The driver replaced the supply board: everything held from the old one is void."""
        self.board = board
        self.state.reset()
        self._lost = None
        self._scarce = False

    async def stats(self) -> dict:
        st = self.state
        return {"pool": len(st.pool), "lent": {a: len(v) for (a, _), v in st.lent.items() if v},
                "calls": dict(self.calls), "lost": self._lost, "waiting": len(st.waiting), "dropped": st.dropped}


def _settle(confirms: list, answers=None, error: Exception | None = None) -> None:
    """Each shard's confirmation gets its answer from the board (or ``error``)."""
    for i, (_, fut) in enumerate(confirms):
        if not fut.done():
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(answers[i])


def _awaitable(ref):
    async def wait():
        return await ref

    return wait()
