"""Replay shards: bounded FIFO stores of fragments, served through Ray's object store.

``FragmentStore`` is the plain bookkeeping (bounds, staleness, counters);
``ReplayShard`` is the async Ray actor around it.

Ownership: a fragment the shard has accepted belongs to the shard, not to the
rollout actor that produced it, so a crashed rollout actor does not take its
delivered fragments with it. (Ray 2.56 removed ``ray.put(_owner=...)``.) The
shard keeps accepted fragments in its own memory; large arguments arrive as
read-only views of an object the *producer* owns, so those are copied once.
``take`` returns the fragments as values: Ray puts large return values into
the object store with the *learner* as owner, and the learner reads them
zero-copy. Compared with the shard ``ray.put``-ing each fragment and handing
out refs, this saves one object-store write per fragment, which is most of the
per-fragment cost for small (CartPole-size) fragments, and a shard that dies
after a ``take`` cannot take the taken data with it.

Backpressure: ``add`` does not return while the shard is full, and a rollout
actor waits for its previous ``add`` before sending the next fragment, so a
slow learner slows producers instead of losing data. The only drop is for
staleness (older than ``max_policy_lag``), and every drop is counted.
"""

from __future__ import annotations

import asyncio
import collections
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
    dropped_stale: int = 0
    dropped_stale_samples: int = 0
    bytes_in: int = 0


class FragmentStore:
    """Bounded FIFO of (meta, item) with staleness filtering on the way out."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: collections.deque[tuple[FragmentMeta, Any]] = collections.deque()
        self.stats = StoreStats()

    def __len__(self) -> int:
        return len(self._items)

    def has_room(self) -> bool:
        return len(self._items) < self.capacity

    def add(self, meta: FragmentMeta, item: Any) -> None:
        if not self.has_room():
            raise RuntimeError("FragmentStore.add on a full store (callers must wait for has_room)")
        self._items.append((meta, item))
        self.stats.added += 1
        self.stats.bytes_in += meta.nbytes

    def drop_stale(self, min_version: int) -> int:
        """Drop every fragment older than ``min_version``; returns how many."""
        kept = collections.deque(x for x in self._items if x[0].policy_version >= min_version)
        dropped = len(self._items) - len(kept)
        if dropped:
            for meta, _ in self._items:
                if meta.policy_version < min_version:
                    self.stats.dropped_stale_samples += meta.num_samples
            self._items = kept
            self.stats.dropped_stale += dropped
        return dropped

    def take(self, max_items: int, min_version: int) -> list[tuple[FragmentMeta, Any]]:
        """Oldest acceptable fragments first, at most ``max_items``."""
        self.drop_stale(min_version)
        out = []
        while self._items and len(out) < max_items:
            out.append(self._items.popleft())
        self.stats.taken += len(out)
        return out

    def snapshot(self) -> dict:
        self.stats.depth = len(self._items)
        self.stats.depth_samples = sum(m.num_samples for m, _ in self._items)
        return dict(self.stats.__dict__)


# enable_task_events=False on every hot-path actor: each call otherwise leaves a task record in the GCS,
# and at hundreds of calls a second that was the one thing growing in a 20-minute soak (bench/soak.py).
@ray.remote(num_cpus=0, max_restarts=0, enable_task_events=False)
class ReplayShard:
    """Async actor: ``add`` waits for room, ``take`` waits (bounded) for data."""

    def __init__(self, shard_id: int, capacity: int):
        self.shard_id = shard_id
        self.store = FragmentStore(capacity)
        self._changed = asyncio.Condition()

    async def add(self, meta: FragmentMeta, fragment) -> int:
        async with self._changed:
            await self._changed.wait_for(self.store.has_room)
            self.store.add(meta, _owned(fragment))
            self._changed.notify_all()
            return len(self.store)

    async def take(self, max_items: int, min_version: int, timeout_s: float) -> tuple[list, int]:
        """Up to ``max_items`` (meta, fragment) pairs, waiting at most ``timeout_s`` for the first.

        Returns the pairs and how many fragments were dropped as stale by this call.
        """
        async with self._changed:
            before = self.store.stats.dropped_stale
            self.store.drop_stale(min_version)
            if not len(self.store):
                try:
                    await asyncio.wait_for(self._changed.wait_for(lambda: len(self.store) > 0), timeout_s)
                except asyncio.TimeoutError:
                    pass
            items = self.store.take(max_items, min_version)
            self._changed.notify_all()
            dropped = self.store.stats.dropped_stale - before
            return items, dropped

    async def stats(self) -> dict:
        return {"shard_id": self.shard_id, **self.store.snapshot()}


def _owned(fragment: Fragment) -> Fragment:
    """The fragment with arrays this process owns: zero-copy views into the producer's object are copied."""
    for key, arr in fragment.arrays.items():
        if not arr.flags.writeable:  # a view of an object-store buffer the producer owns
            fragment.arrays[key] = np.array(arr)
    return fragment
