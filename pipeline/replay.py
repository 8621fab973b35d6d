"""Replay shards: bounded FIFO stores of fragments in Ray's object store.

``FragmentStore`` is the plain bookkeeping (bounds, staleness, counters);
``ReplayShard`` is the async Ray actor around it. The shard ``ray.put``s every
fragment it accepts, so the shard, not the rollout actor that produced it,
owns the object: a crashed rollout actor does not take its already-delivered
fragments with it.

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

import ray

from pipeline.fragment import FragmentMeta


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


@ray.remote(num_cpus=0, max_restarts=0)
class ReplayShard:
    """Async actor: ``add`` waits for room, ``take`` waits (bounded) for data."""

    def __init__(self, shard_id: int, capacity: int):
        self.shard_id = shard_id
        self.store = FragmentStore(capacity)
        self._changed = asyncio.Condition()

    async def add(self, meta: FragmentMeta, fragment) -> int:
        async with self._changed:
            await self._changed.wait_for(self.store.has_room)
            # The shard owns the copy it puts, so the data outlives the producer.
            self.store.add(meta, ray.put(fragment))
            self._changed.notify_all()
            return len(self.store)

    async def take(self, max_items: int, min_version: int, timeout_s: float) -> tuple[list, int]:
        """Up to ``max_items`` (meta, [ref]) pairs, waiting at most ``timeout_s`` for the first.

        Returns the pairs and how many fragments were dropped as stale by this call.
        Refs are wrapped in a list so Ray hands the caller the ref, not the value.
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
            return [(meta, [ref]) for meta, ref in items], dropped

    async def stats(self) -> dict:
        return {"shard_id": self.shard_id, **self.store.snapshot()}
