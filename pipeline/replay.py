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
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from pipeline.fragment import Fragment, FragmentMeta


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


#: A shard's next ``stored`` call gathers adds: it goes once every producer that added within PRODUCER_ACTIVE_S has
#: an add waiting, or STORED_GATHER_S after the first waiting add, whichever comes first. With one call out at a
#: time alone (self-clocking), a board that answers fast gets one call per add: at 1,000 actors on 16 shards that
#: is one call per fragment. Gathered, a shard makes at most ~1/STORED_GATHER_S calls a second whatever its
#: producers' rate, and a shard with one producer (CartPole's default) is never held back: its add is all there is.
STORED_GATHER_S = 0.02
PRODUCER_ACTIVE_S = 2.0


# enable_task_events=False on every hot-path actor: each call otherwise leaves a task record in the GCS,
# and at hundreds of calls a second that was the one thing growing in a 20-minute soak (bench/soak.py).
@ray.remote(num_cpus=0, max_restarts=0, enable_task_events=False)
class ReplayShard:
    """Async actor: ``add`` confirms each fragment with the supply board; ``take`` hands out claimed ids."""

    def __init__(self, shard_id: int, capacity: int, board, add_timeout_s: float = 120.0,
                 gather_s: float = STORED_GATHER_S):
        self.shard_id = shard_id
        self.gather_s = gather_s
        self.store = FragmentStore(capacity)
        self.board = board
        self.add_timeout_s = add_timeout_s
        self.add_calls = 0  # adds received (each carries one fragment or several: rollout.fragments_per_add)
        self.stored_calls = 0  # board.stored calls made (each confirms every add that came in meanwhile)
        self.largest_add = 0  # most fragments one add carried
        self._room = asyncio.Condition()
        self._to_confirm: list[tuple] = []  # (tickets of one add, its answer, its producer), in order
        self._confirming = False  # a board.stored call is out
        self._producers: dict = {}  # producer -> when it last added (the adds a gathering call waits for)
        self._arrived = asyncio.Event()  # an add joined the waiting ones

    async def add(self, ticket, meta: FragmentMeta, fragment) -> bool:
        """Store ``fragment`` for ``ticket``; False if the ledger had refunded the ticket (copy dropped)."""
        return (await self.add_many([(ticket, meta, fragment)]))[0]

    async def add_many(self, entries: list, producer=None) -> list[bool]:
        """Store each ``(ticket, meta, fragment)`` and confirm them with the board: one ``stored`` call for all
        of them when there is room for all, else one per run of fragments stored before waiting for room (a
        stored fragment is claimable only once confirmed, so waiting with unconfirmed ones could wait for good).
        False for a copy whose ticket the ledger had refunded (dropped). ``producer``: who sends it (a rollout
        actor's id; each has at most one add out), so that a ``stored`` call can gather every active producer's
        add (``STORED_GATHER_S``); None: confirmed without gathering."""
        self.add_calls += 1
        if producer is not None:
            self._producers[producer] = time.monotonic()
        self.largest_add = max(self.largest_add, len(entries))
        ok: list[bool] = []
        i = 0
        while i < len(entries):
            batch = []
            async with self._room:
                if not self.store.has_room():
                    try:
                        await asyncio.wait_for(self._room.wait_for(self.store.has_room), self.add_timeout_s)
                    except asyncio.TimeoutError:
                        st = self.store.snapshot()
                        raise RuntimeError(
                            f"replay shard {self.shard_id} stayed full for {self.add_timeout_s:.0f} s ({st['depth']} "
                            f"of {self.store.capacity} fragments, updates {st['min_update']}..{st['max_update']}): "
                            f"no learner took from it") from None
                # Stored before they are reported: once the ledger says "stored", a learner may claim them at once.
                while i < len(entries) and self.store.has_room():
                    ticket, meta, fragment = entries[i]
                    self.store.add(ticket, meta, _owned(fragment))
                    batch.append(ticket)
                    i += 1
            confirmed = await self._confirm(batch, producer)
            refused = [t for t, good in zip(batch, confirmed) if not good]
            for t in refused:
                self.store.reject(t)
            if refused:
                await self._notify_room()
            ok.extend(confirmed)
        return ok

    async def _confirm(self, tickets: list, producer=None) -> list[bool]:
        """The board's answer for ``tickets``. At most one ``stored`` call is out at a time, and it gathers the
        adds of every active producer (``STORED_GATHER_S``); the adds that arrive while it is out go together in
        the next one. So the board sees at most one call per shard per gathering, not one per fragment, and the
        add of a shard's only producer is confirmed at once."""
        fut = asyncio.get_running_loop().create_future()
        self._to_confirm.append((tickets, fut, producer))
        self._arrived.set()
        if not self._confirming:
            self._confirming = True
            asyncio.get_running_loop().create_task(self._confirm_waiting())
        return await fut

    async def _gather(self) -> None:
        """Until every producer that added within PRODUCER_ACTIVE_S has an add waiting (an add without a producer
        counts as all of them), or ``gather_s`` from now. (With several producers that mostly means ``gather_s``:
        the ones the last call answered are making their next fragment.)"""
        deadline = time.monotonic() + self.gather_s
        while True:
            now = time.monotonic()
            for p in [p for p, t in self._producers.items() if now - t > PRODUCER_ACTIVE_S]:
                del self._producers[p]  # gone quiet (or dead): not waited for
            waiting = {p for _, _, p in self._to_confirm}
            if None in waiting or waiting >= self._producers.keys() or now >= deadline:
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
                waiting, self._to_confirm = self._to_confirm, []
                tickets = [t for batch, _, _ in waiting for t in batch]
                self.stored_calls += 1
                try:
                    confirmed = await asyncio.wait_for(_awaitable(self.board.stored.remote(tickets, self.shard_id)),
                                                       self.add_timeout_s)
                except Exception:  # noqa: BLE001 - RayActorError, a timeout: the board died or stopped answering
                    # These copies are void (the driver replaces the board, whose new ledger starts afresh), so they
                    # are dropped, as a refused copy is.
                    confirmed = [False] * len(tickets)
                i = 0
                for batch, fut, _ in waiting:
                    if not fut.done():  # not cancelled with its add
                        fut.set_result(list(confirmed[i:i + len(batch)]))
                    i += len(batch)
        finally:
            self._confirming = False

    async def _notify_room(self) -> None:
        async with self._room:
            self._room.notify_all()

    async def take(self, tickets: list) -> tuple[list, list]:
        """(meta, fragment) pairs for the claimed ``tickets`` and the tickets not held here."""
        items, missing = self.store.take(tickets)
        await self._notify_room()
        return items, missing

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
