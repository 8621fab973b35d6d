"""The data plane without training, shared by the data-plane benches: synthetic fragments, a ticketed producer,
the supply board and its shards wired as a run wires them."""

from __future__ import annotations

import time

import numpy as np
import ray

from pipeline import fragment as F

KINDS = {
    # CartPole-size: 64 steps x 16 envs x 4 floats.
    "vector": dict(modality="vector", obs_shape=(4,), obs_dtype=np.float32, T=64, N=16, fragments=2),
    # Atari-size frames (4 stacked 84x84 greyscale, channels last), kept uint8 until the device: 32 steps x 8 envs.
    "image": dict(modality="image", obs_shape=(84, 84, 4), obs_dtype=np.uint8, T=32, N=8, fragments=2),
}


def policy_spec(kind: dict):
    """The model spec for ``kind``'s fragments: CartPole's discrete 2 actions, the default (64, 64) layers."""
    from learner.spec import ModalityInput, PolicySpec

    mod = ModalityInput(kind["modality"], kind["modality"], kind["obs_shape"], np.dtype(kind["obs_dtype"]).name)
    return PolicySpec((mod,), "discrete", 2, hidden_sizes=(64, 64))


def make_fragment(kind: dict, version: int, rng: np.random.Generator, actor_id: int = 0) -> F.Fragment:
    """A fragment of ``kind`` (T, N, obs shape and dtype) with random values: only shapes and dtypes matter."""
    T, N = kind["T"], kind["N"]
    if kind["obs_dtype"] == np.uint8:
        obs = rng.integers(0, 255, (T, N) + kind["obs_shape"], dtype=np.uint8)
    else:
        obs = rng.standard_normal((T, N) + kind["obs_shape"]).astype(kind["obs_dtype"])
    arrays = {
        F.obs_key(kind["modality"]): obs,
        F.ACTIONS: rng.integers(0, 2, (T, N)),
        F.LOGP: np.full((T, N), -0.69, np.float32),
        F.VALUES: rng.standard_normal((T, N)).astype(np.float32),
        F.REWARDS: np.ones((T, N), np.float32),
        F.TERMINATED: np.zeros((T, N), bool),
        F.TRUNCATED: np.zeros((T, N), bool),
        F.ADVANTAGES: rng.standard_normal((T, N)).astype(np.float32),
        F.RETURNS: rng.standard_normal((T, N)).astype(np.float32),
    }
    return F.Fragment(arrays, policy_version=version, actor_id=actor_id)


@ray.remote(num_cpus=0)
class Producer:
    """Fills the supply board's tickets with copies of one pre-built fragment: ``RolloutActor``'s protocol without
    the sampling (one ``board.poll`` per fragment, then ``shard.add``, one add in flight), so the board's
    ``max_policy_lag`` bounds how far ahead it runs. Weights are not loaded; fragments are stamped with the newest
    policy version the board has announced."""

    def __init__(self, board, shard, shard_index: int, kind: dict, actor_id: int = 0):
        self.board, self.shard, self.shard_index, self.actor_id = board, shard, shard_index, actor_id
        self.shard_incarnation = 0
        self.version = -1
        self.fragment = make_fragment(kind, 0, np.random.default_rng(0))

    def _poll(self, wait_s: float):
        tickets, news, change = ray.get(self.board.poll.remote(self.actor_id, 0, self.version, self.shard_index,
                                                               self.shard_incarnation, [], wait_s))
        if news is not None:
            self.version = news[0]
        if change is not None:
            self.shard_incarnation, self.shard = change
        return tickets[0] if tickets else None

    def run(self, seconds: float) -> int:
        """Fragments sent within ``seconds``; returns early once the bench tears the board or shard down."""
        n, pending, deadline = 0, None, time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                ticket = self._poll(0.0)
                while ticket is None and time.monotonic() < deadline:
                    ticket = self._poll(0.5)  # the learners are behind: wait for the next update's tickets
                if ticket is None:
                    break
                if pending is not None:
                    ray.get(pending)
                self.fragment.policy_version = self.version
                pending = self.shard.add.remote(ticket, F.FragmentMeta.of(self.fragment), self.fragment)
                n += 1
        except ray.exceptions.RayActorError:
            pass  # the bench tore the board or the shard down: this producer is done
        return n


def supply(num_shards: int, capacity: int, per_update: int, max_policy_lag: int, weights=None,
           publish: bool = True, inprocess: bool = False) -> tuple:
    """(board, shards) wired as ``cluster/driver.py`` wires them: the ``SupplyBoard`` first, then the shards with
    its handle, each registered; then policy version 0 is published, which creates the first tickets.

    ``weights``: what the version-0 ref points at (rollout actors load it; the synthetic producers do not).
    ``publish=False``: leave version 0 to the caller (a real ``LearnerActor`` rank 0 publishes it at set-up).
    ``inprocess``: as ``ray.address: inprocess`` makes them (``pipeline/runtime.py``)."""
    from pipeline import runtime
    from pipeline.replay import ReplayShard
    from cluster.control import MAX_ROLLOUT_ACTORS
    from pipeline.supply import SupplyBoard, board_concurrency

    board = runtime.create(SupplyBoard, {"max_concurrency": board_concurrency(MAX_ROLLOUT_ACTORS, num_shards, 1)},
                           per_update, max_policy_lag, num_shards, inprocess=inprocess)
    shards = [runtime.create(ReplayShard, {}, i, capacity, board, inprocess=inprocess) for i in range(num_shards)]
    runtime.get([board.register_shard.remote(i, s) for i, s in enumerate(shards)])
    if publish:
        runtime.get(board.publish.remote(0, [runtime.put(weights)]))
    return board, shards


def next_batch(feed, device, timeout_s: float) -> tuple:
    """A ``DeviceFeed``'s next batch, made ready for the device's current stream, and the seconds spent getting it
    (what a learner waits for its data)."""
    t = time.perf_counter()
    batch = feed.next(timeout_s=timeout_s)
    if batch.ready_event is not None:
        device.module.current_stream().wait_event(batch.ready_event)
    return batch, time.perf_counter() - t
