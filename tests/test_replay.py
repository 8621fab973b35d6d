"""Replay shards and the device feed against a real local Ray."""

import time

import numpy as np
import pytest
import ray as _ray
import torch

from learner.device import resolve
from pipeline import fragment as F
from pipeline.feed import DeviceFeed
from pipeline.replay import FragmentStore, ReplayShard
from pipeline.fragment import FragmentMeta


def make_fragment(version: int, T: int = 4, N: int = 2, fill: float = 0.0, actor_id: int = 0) -> F.Fragment:
    arrays = {
        F.OBS_STATE: np.full((T, N, 3), fill, np.float32),
        F.ACTIONS: np.full((T, N), int(fill), np.int64),
        F.LOGP: np.full((T, N), fill, np.float32),
        F.VALUES: np.full((T, N), fill, np.float32),
        F.REWARDS: np.ones((T, N), np.float32),
        F.TERMINATED: np.zeros((T, N), bool),
        F.TRUNCATED: np.zeros((T, N), bool),
        F.ADVANTAGES: np.full((T, N), fill, np.float32),
        F.RETURNS: np.full((T, N), fill, np.float32),
    }
    return F.Fragment(arrays, policy_version=version, actor_id=actor_id)


def test_store_is_bounded_and_counts_stale_drops():
    store = FragmentStore(capacity=3)
    for v in (0, 1, 2):
        store.add(FragmentMeta.of(make_fragment(v)), f"item{v}")
    assert not store.has_room()
    with pytest.raises(RuntimeError):
        store.add(FragmentMeta.of(make_fragment(3)), "overflow")
    got = store.take(max_items=5, min_version=1)
    assert [item for _, item in got] == ["item1", "item2"]
    snap = store.snapshot()
    assert snap["dropped_stale"] == 1 and snap["dropped_stale_samples"] == 8
    assert snap["taken"] == 2 and snap["depth"] == 0


def test_shard_backpressure_blocks_producer_until_a_take(ray_local):
    shard = ReplayShard.remote(0, 2)
    frag = make_fragment(0)
    meta = FragmentMeta.of(frag)
    assert _ray.get(shard.add.remote(meta, frag)) == 1
    assert _ray.get(shard.add.remote(meta, frag)) == 2
    blocked = shard.add.remote(meta, frag)
    ready, _ = _ray.wait([blocked], timeout=0.5)
    assert ready == [], "add on a full shard must wait, not drop"
    items, dropped = _ray.get(shard.take.remote(1, 0, 0.1))
    assert len(items) == 1 and dropped == 0
    assert _ray.get(blocked, timeout=5) == 2
    stats = _ray.get(shard.stats.remote())
    assert stats["added"] == 3 and stats["taken"] == 1 and stats["dropped_stale"] == 0
    _ray.kill(shard)


def test_shard_take_returns_fragments_zero_copy_and_drops_stale(ray_local):
    shard = ReplayShard.remote(0, 8)
    for v in (0, 0, 1, 2):
        frag = make_fragment(v, T=64, N=16, fill=float(v))
        _ray.get(shard.add.remote(FragmentMeta.of(frag), frag))
    items, dropped = _ray.get(shard.take.remote(10, 1, 0.1))
    assert dropped == 2
    versions = [meta.policy_version for meta, _ in items]
    assert versions == [1, 2]
    frags = [frag for _, frag in items]
    assert frags[1].arrays[F.OBS_STATE][0, 0, 0] == 2.0
    # Arrays come back as read-only views of the received buffer (zero-copy), not copies.
    assert not frags[0].arrays[F.OBS_STATE].flags.writeable
    # An empty shard answers after the timeout instead of hanging.
    t = time.perf_counter()
    items, _ = _ray.get(shard.take.remote(1, 0, 0.2))
    assert items == [] and time.perf_counter() - t >= 0.15
    _ray.kill(shard)


def test_device_feed_collates_in_order_reuses_buffers_and_prefetches(ray_local):
    shard = ReplayShard.remote(0, 16)
    fills = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    for i, fill in enumerate(fills):
        frag = make_fragment(version=0, fill=fill)
        _ray.get(shard.add.remote(FragmentMeta.of(frag), frag))
    feed = DeviceFeed([shard], fragments_per_batch=2, max_policy_lag=5, device=resolve("cpu"),
                      prefetch_batches=1).start()
    try:
        b0 = feed.next(timeout_s=10)
        obs0 = b0.tensors[F.OBS_STATE]
        # Two fragments of 4x2 samples, flattened time-major and concatenated in FIFO order.
        assert obs0.shape == (16, 3)
        assert torch.all(obs0[:8] == 1.0) and torch.all(obs0[8:] == 2.0)
        assert b0.num_samples == 16 and list(b0.policy_versions) == [0, 0]
        # While b0 is held, the feed prepares b1 into the other slot (double buffering).
        deadline = time.monotonic() + 5
        while feed._ready.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not feed._ready.empty(), "the next batch was not prepared while the current one was in use"
        ptr0 = obs0.data_ptr()
        feed.release(b0)
        b1 = feed.next(timeout_s=10)
        assert torch.all(b1.tensors[F.OBS_STATE][:8] == 3.0)
        assert b1.tensors[F.OBS_STATE].data_ptr() != ptr0
        feed.release(b1)
        b2 = feed.next(timeout_s=10)
        # Pool of prefetch+1 = 2 slots allocated once: the third batch reuses the first buffer.
        assert b2.tensors[F.OBS_STATE].data_ptr() == ptr0
        assert torch.all(b2.tensors[F.OBS_STATE][8:] == 6.0)
        assert b2.h2d_bytes == 0  # CPU: no copy
        feed.release(b2)
    finally:
        feed.stop()
        _ray.kill(shard)


def test_device_feed_applies_policy_lag_per_batch(ray_local):
    shard = ReplayShard.remote(0, 16)
    # Batch 0 trains at version 0, batch 1 at version 1, ... ; lag 0 accepts only the current version.
    for v in (0, 0, 1, 2):
        frag = make_fragment(v, fill=float(v))
        _ray.get(shard.add.remote(FragmentMeta.of(frag), frag))
    feed = DeviceFeed([shard], fragments_per_batch=1, max_policy_lag=0, device=resolve("cpu")).start()
    try:
        seen = []
        dropped = 0
        for _ in range(3):
            b = feed.next(timeout_s=10)
            seen.append(int(b.policy_versions[0]))
            dropped += b.dropped_stale
            feed.release(b)
        assert seen == [0, 1, 2]
        assert dropped == 1  # the second version-0 fragment was too old for batch 1
    finally:
        feed.stop()
        _ray.kill(shard)
