"""Replay shards: the fragments of a node's rollout actors, held until a learner takes them.

``FragmentStore`` is the plain bookkeeping; ``ReplayShard`` is the async Ray
actor around it. What a shard holds, and who takes it, is decided by the
supply board's ticket ledger (``pipeline/supply.py``): a shard keeps a
fragment only if the ledger confirms its ticket, and hands out exactly the
ticket ids a learner claimed there. So every shard can serve every learner,
and how many fragments exist at once is bounded by the ledger
(``(max_policy_lag + 1)`` updates' worth), not by any one shard.

Ownership: a fragment the shard has accepted belongs to the shard, not to the
rollout actor that produced it, so a crashed rollout actor does not take its
delivered fragments with it. (Ray 2.56 removed ``ray.put(_owner=...)``.) The
shard keeps accepted fragments in its own memory; large arguments arrive as
read-only views of an object the *producer* owns, so those are copied once.
``take`` returns the fragments as values: Ray puts large return values into
the object store with the *learner* as owner, and the learner reads them
zero-copy. A shard that dies after a ``take`` cannot take the taken data with
it.

``replay.capacity_fragments`` stays as a hard ceiling per shard (an ``add``
waits for room, with a deadline, and fails naming the shard); it is validated
to be at least the ledger's bound, so it never binds in a healthy run.

A shard's confirmations follow the clocks of ``pipeline/protocol.py``: an add
nobody waits for (``ack="held"``, what rollout actors use) is confirmed on the
STORED_PACE_S clock, an urgent one (a producer waits for the answer, an add
waits for room, an update at its tail, ``hurry``) on the STORED_GATHER_S clock,
gathering the adds of the producers active within PRODUCER_ACTIVE_S: so the
board sees at most one ``stored`` call per shard per pace, whatever the number
of producers. Through its node's relay, a shard waits RELAY_CONFIRM_S for the
answer, then confirms with the board itself and leaves the relay alone for
SHARD_RELAY_RETRY_S.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from pipeline.fragment import Fragment, FragmentMeta
from pipeline.protocol import (PRODUCER_ACTIVE_S, RELAY_CONFIRM_S, SHARD_RELAY_RETRY_S, STORED_GATHER_S, STORED_PACE_S,
                               ActiveWindow, Entry, Stored, Taken)


@dataclass
class StoreStats:
    depth: int = 0
    depth_samples: int = 0
    added: int = 0
    taken: int = 0
    rejected: int = 0  # copies the ledger refused (their ticket had been refunded)
    dropped_stale: int = 0  # fragments of updates the learners skipped (learner-group restart)
    bytes_in: int = 0
    min_version: int = -1  # policy versions and ticket updates of what it holds now (-1: empty)
    max_version: int = -1
    min_update: int = -1
    max_update: int = -1


class FragmentStore:
    """Fragments by ticket, with a hard ceiling.

    Keyed by the whole ticket (id and the actor incarnation it was issued to), not the id: a refunded ticket's
    late copy and its remake by another actor may both arrive here, and only the ledger knows which is real."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: dict[Any, tuple[FragmentMeta, Any]] = {}  # ticket -> (meta, fragment)
        self.stats = StoreStats()

    def __len__(self) -> int:
        return len(self._items)

    def has_room(self) -> bool:
        return len(self._items) < self.capacity

    def add(self, ticket, meta: FragmentMeta, item: Any) -> None:
        if not self.has_room():
            raise RuntimeError("FragmentStore.add on a full store (callers must wait for has_room)")
        if ticket in self._items:
            raise RuntimeError(f"ticket {ticket} is already stored here")
        self._items[ticket] = (meta, item)
        self.stats.added += 1
        self.stats.bytes_in += meta.nbytes

    def reject(self, ticket) -> None:
        """The ledger refused it: forget this copy."""
        if self._items.pop(ticket, None) is not None:
            self.stats.rejected += 1

    def drop(self, tickets) -> int:
        """Drop fragments of skipped updates, or that a dead learner claimed; returns how many were here."""
        n = sum(self._items.pop(t, None) is not None for t in tickets)
        self.stats.dropped_stale += n
        return n

    def clear(self) -> int:
        """Drop everything (its tickets belonged to a supply board that is gone); returns how many."""
        return self.drop(list(self._items))

    def take(self, tickets) -> tuple[list[tuple[FragmentMeta, Any]], list]:
        """The fragments of ``tickets`` (in that order) and the tickets this store does not hold."""
        out, missing = [], []
        for t in tickets:
            entry = self._items.pop(t, None)
            if entry is None:
                missing.append(t)
            else:
                out.append(entry)
        self.stats.taken += len(out)
        return out, missing

    def snapshot(self) -> dict:
        st = self.stats
        st.depth = len(self._items)
        st.depth_samples = sum(m.num_samples for m, _ in self._items.values())
        versions = [m.policy_version for m, _ in self._items.values()]
        updates = [t.update for t in self._items]
        st.min_version, st.max_version = (min(versions), max(versions)) if versions else (-1, -1)
        st.min_update, st.max_update = (min(updates), max(updates)) if updates else (-1, -1)
        return dict(st.__dict__)


# enable_task_events=False on every hot-path actor: each call otherwise leaves a task record in the GCS,
# and at hundreds of calls a second that was the one thing growing in a 20-minute soak (bench/soak.py).
@ray.remote(num_cpus=0, max_restarts=0, enable_task_events=False)
class ReplayShard:
    """Async actor: ``add`` confirms each fragment with the supply board; ``take`` hands out claimed ids."""

    def __init__(self, shard_id: int, capacity: int, board, add_timeout_s: float = 120.0,
                 gather_s: float = STORED_GATHER_S, pace_s: float = STORED_PACE_S, relay=None):
        """``relay``: its node's ``NodeRelay``, which carries its confirmations up with the node's other shards'
        (None: it confirms with the board itself)."""
        self.shard_id = shard_id
        self.relay = relay
        self._relay_retry_at = 0.0  # the relay failed: confirm with the board itself until then
        self.relayed_calls = 0  # stored calls that went through the relay
        self.gather_s, self.pace_s = gather_s, pace_s
        self.store = FragmentStore(capacity)
        self.board = board
        self.add_timeout_s = add_timeout_s
        self.add_calls = 0  # adds received (each carries one fragment or several: rollout.fragments_per_add)
        self.stored_calls = 0  # board.stored calls made (each confirms every add that came in meanwhile)
        self.largest_add = 0  # most fragments one add carried
        self._room = asyncio.Condition()
        # (tickets of one add, its answer or None when nobody waits for it, its producer), in order
        self._to_confirm: list[tuple] = []
        self._confirming = False  # a board.stored call is out
        self._producers = ActiveWindow(PRODUCER_ACTIVE_S)  # producers adding lately (a gathering call waits for)
        self._arrived = asyncio.Event()  # an add joined the waiting ones, a hurry came, or an add waits for room
        self._hurry_through = -1  # updates up to this one are at their tail: confirmed on the short clock
        self._room_wanted = 0  # adds waiting for room: what is held unconfirmed goes at once (only it frees room)
        self._urgent = False  # a waiting add has a producer waiting for its answer, or a ticket of a hurried update

    async def add(self, ticket, meta: FragmentMeta, fragment) -> bool:
        """Store ``fragment`` for ``ticket``; False if the ledger had refunded the ticket (copy dropped)."""
        return (await self.add_many([Entry(ticket, meta, fragment)]))[0]

    async def add_many(self, entries: list, producer=None, ack: str = "confirmed") -> list[bool]:
        """Store each ``Entry(ticket, meta, fragment)`` and have the board confirm them: one ``stored`` call for all of
        them when there is room for all, else one per run of fragments stored before waiting for room.
        ``producer``: who sends it (a rollout actor's id; each has at most one add out), so that a ``stored`` call
        can gather every active producer's add (``STORED_GATHER_S``); None: confirmed without gathering.

        ``ack="confirmed"``: answered once the board has: False for a copy whose ticket the ledger had refunded
        (dropped). ``ack="held"``: answered once held here, all True, and confirmed on the ``STORED_PACE_S`` clock
        (a refused copy is dropped then, and counted in ``stats``). A producer that uses it keeps the tickets
        until their update is done: if this shard dies first, those it never confirmed are its failed adds."""
        if ack not in ("confirmed", "held"):
            raise ValueError(f"ack must be 'confirmed' or 'held', got {ack!r}")
        self.add_calls += 1
        if producer is not None:
            self._producers.saw(producer)
        self.largest_add = max(self.largest_add, len(entries))
        answers = []
        i = 0
        while i < len(entries):
            batch = []
            async with self._room:
                if not self.store.has_room():
                    # Only a confirmed fragment can be claimed and taken, which is what frees room: what is held
                    # unconfirmed goes now, whatever the clock.
                    self._room_wanted += 1
                    self._arrived.set()
                    try:
                        await asyncio.wait_for(self._room.wait_for(self.store.has_room), self.add_timeout_s)
                    except asyncio.TimeoutError:
                        st = self.store.snapshot()
                        raise RuntimeError(
                            f"replay shard {self.shard_id} stayed full for {self.add_timeout_s:.0f} s ({st['depth']} "
                            f"of {self.store.capacity} fragments, updates {st['min_update']}..{st['max_update']}): "
                            f"no learner took from it") from None
                    finally:
                        self._room_wanted -= 1
                # Stored before they are reported: once the ledger says "stored", a learner may claim them at once.
                while i < len(entries) and self.store.has_room():
                    ticket, meta, fragment = entries[i]
                    self.store.add(ticket, meta, _owned(fragment))
                    batch.append(ticket)
                    i += 1
            answers.append(self._confirm(batch, producer, wait=ack == "confirmed"))
        if ack == "held":
            return [True] * len(entries)
        return [ok for fut in answers for ok in await fut]

    def _confirm(self, tickets: list, producer=None, wait: bool = True):
        """Queue ``tickets`` for the board's confirmation; returns the future of its answer (None when ``wait`` is
        False: nobody waits for it). At most one ``stored`` call is out at a time; the adds that arrive while it is
        out go together in the next one (``_gather``). So the board sees at most one call per shard per gathering or
        pace, not one per fragment."""
        fut = asyncio.get_running_loop().create_future() if wait else None
        self._to_confirm.append((tickets, fut, producer))
        self._urgent = self._urgent or wait or any(t.update <= self._hurry_through for t in tickets)
        self._arrived.set()
        if not self._confirming:
            self._confirming = True
            asyncio.get_running_loop().create_task(self._confirm_waiting())
        return fut

    async def hurry(self, update: int) -> None:
        """The board: ``update`` (and every older one) is at its tail: its fragments go on the short clock from now
        on, so that a batch's last fragments are not held back for a pace."""
        if update > self._hurry_through:
            self._hurry_through = update
            self._urgent = self._urgent or any(t.update <= update for batch, _, _ in self._to_confirm for t in batch)
            self._arrived.set()

    def _must_go_soon(self) -> bool:
        """Whether the waiting adds go on the STORED_GATHER_S clock instead of STORED_PACE_S: a producer waits for
        the answer, an add waits for room, or a ticket is of an update at its tail."""
        return self._room_wanted > 0 or self._urgent

    async def _gather(self) -> None:
        """Until every producer that added within PRODUCER_ACTIVE_S has an add waiting (an add without a producer
        counts as all of them), or ``gather_s`` from now; adds nobody waits for, ``pace_s`` from now unless one must
        go soon. (With several producers that mostly means ``gather_s``: the ones the last call answered are making
        their next fragment.)"""
        start = time.monotonic()
        while True:
            now = time.monotonic()
            if self._must_go_soon():
                deadline = start + self.gather_s
                waiting = {p for _, _, p in self._to_confirm}
                if None in waiting or waiting >= self._producers.members():  # (the quiet or dead: not waited for)
                    return
            else:
                deadline = start + self.pace_s
            if now >= deadline:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), deadline - now)
            except asyncio.TimeoutError:
                return

    async def _confirm_waiting(self) -> None:
        try:
            while self._to_confirm:
                await self._gather()
                urgent = self._urgent
                waiting, self._to_confirm, self._urgent = self._to_confirm, [], False
                tickets = [t for batch, _, _ in waiting for t in batch]
                self.stored_calls += 1
                confirmed = await self._via_relay(tickets, urgent)
                if confirmed is None:
                    try:
                        confirmed = await asyncio.wait_for(
                            _awaitable(self.board.stored.remote(Stored(tickets, self.shard_id))), self.add_timeout_s)
                    except Exception:  # noqa: BLE001 - RayActorError, a timeout: the board died or stopped answering
                        # These copies are void (the driver replaces the board, whose new ledger starts afresh), so
                        # they are dropped, as a refused copy is.
                        confirmed = [False] * len(tickets)
                refused = [t for t, good in zip(tickets, confirmed) if not good]
                for t in refused:
                    self.store.reject(t)
                if refused:
                    await self._notify_room()
                i = 0
                for batch, fut, _ in waiting:
                    if fut is not None and not fut.done():  # not cancelled with its add
                        fut.set_result(list(confirmed[i:i + len(batch)]))
                    i += len(batch)
        finally:
            self._confirming = False

    async def _via_relay(self, tickets: list, urgent: bool) -> list | None:
        """The board's answer through the node's relay; None when there is none to use, or it failed or did not
        answer within RELAY_CONFIRM_S (then the board is asked directly; a ticket the relay did carry up is the
        same confirmation again there, accepted once: ``TicketLedger.stored``)."""
        if self.relay is None or time.monotonic() < self._relay_retry_at:
            return None
        try:
            answer = await asyncio.wait_for(
                _awaitable(self.relay.stored.remote(Stored(tickets, self.shard_id, urgent))), RELAY_CONFIRM_S)
        except Exception:  # noqa: BLE001 - RelayUnavailable, RayActorError, a timeout: the relay is no help now
            self._relay_retry_at = time.monotonic() + SHARD_RELAY_RETRY_S
            return None
        self.relayed_calls += 1
        return answer

    async def _notify_room(self) -> None:
        async with self._room:
            self._room.notify_all()

    async def take(self, tickets: list) -> Taken:
        """(meta, fragment) pairs for the claimed ``tickets`` and the tickets not held here."""
        items, missing = self.store.take(tickets)
        await self._notify_room()
        return Taken(items, missing)

    async def drop(self, tickets: list) -> int:
        n = self.store.drop(tickets)
        await self._notify_room()
        return n

    async def until_dead(self) -> None:
        """Never returns: the driver keeps one of these out per shard, and it fails (RayActorError) when the
        shard's process dies, which the driver sees without a call."""
        await asyncio.get_running_loop().create_future()

    async def stats(self) -> dict:
        return {"shard_id": self.shard_id, "add_calls": self.add_calls, "stored_calls": self.stored_calls,
                "relayed_calls": self.relayed_calls,
                "largest_add": self.largest_add,
                **self.store.snapshot()}

    async def attach_board(self, board) -> int:
        """The supply board was replaced: confirm with ``board`` from now on, and drop everything held (it was
        ticketed by the dead board's ledger, which nobody can claim from). Returns how many were dropped."""
        self.board = board
        n = self.store.clear()
        await self._notify_room()
        return n


def _awaitable(ref):
    """A Ray ObjectRef (or an in-process LocalRef) as something ``asyncio.wait_for`` takes."""
    async def wait():
        return await ref
    return wait()


def _owned(fragment: Fragment) -> Fragment:
    """The fragment with arrays this process owns: zero-copy views into the producer's object are copied."""
    for key, arr in fragment.arrays.items():
        if not arr.flags.writeable:  # a view of an object-store buffer the producer owns
            fragment.arrays[key] = np.array(arr)
    return fragment
