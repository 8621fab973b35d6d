"""The data plane without training, shared by the data-plane benches: synthetic fragments, a ticketed producer,
the supply board and its shards wired as a run wires them."""

from __future__ import annotations

import contextlib
import itertools
import time

import numpy as np
import ray

from pipeline import fragment as F
from pipeline.protocol import Claim, Poll, Publish

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
    """``RolloutActor``'s protocol without the sampling: one ``board.poll`` for a ticket per fragment, then
    ``shard.add`` of a copy of one pre-built fragment of ``kind``, one add in flight, so the board's
    ``max_policy_lag`` bounds how far ahead it runs. Weights are not loaded; fragments are stamped with the newest
    policy version the board has announced."""

    def __init__(self, board, shard, shard_index: int, kind: dict, actor_id: int = 0):
        self.board, self.shard, self.shard_index, self.actor_id = board, shard, shard_index, actor_id
        self.shard_incarnation, self.version = 0, -1
        self.fragment = make_fragment(kind, 0, np.random.default_rng(0))

    def _poll(self, wait_s: float):
        tickets, news, change = ray.get(self.board.poll.remote(Poll(self.actor_id, 0, self.version, self.shard_index,
                                                                    self.shard_incarnation, [], wait_s)))
        if news is not None:
            self.version = news[0]
        if change is not None:
            self.shard_incarnation, self.shard = change
        return tickets[0] if tickets else None

    def run(self, seconds: float) -> None:
        """Fragments for ``seconds``, or until the bench tears the board or shard down."""
        pending, deadline = None, time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                ticket = self._poll(0.0)
                while ticket is None and time.monotonic() < deadline:
                    ticket = self._poll(0.5)  # the learners are behind: wait for the next update's tickets
                if ticket is None:
                    break
                self.fragment.policy_version = self.version
                if pending is not None:
                    ray.get(pending)
                pending = self.shard.add.remote(ticket, F.FragmentMeta.of(self.fragment), self.fragment)
        except ray.exceptions.RayActorError:
            pass  # the bench tore the board or the shard down: this producer is done


def supply(num_shards: int, capacity: int, per_update: int, max_policy_lag: int, weights=None,
           inprocess: bool = False) -> tuple:
    """(board, shards) wired as ``cluster/driver.py`` wires them: the ``SupplyBoard`` first, then the shards with
    its handle, each registered; then policy version 0 is published, which creates the first tickets. ``weights``:
    what the version-0 ref points at (rollout actors load it; the synthetic producers do not). ``inprocess``: as
    ``ray.address: inprocess`` makes them (``pipeline/runtime.py``)."""
    from pipeline import runtime
    from pipeline.replay import ReplayShard
    from cluster.control import MAX_ROLLOUT_ACTORS
    from pipeline.supply import SupplyBoard, board_concurrency

    board = runtime.create(SupplyBoard, {"max_concurrency": board_concurrency(MAX_ROLLOUT_ACTORS, num_shards, 1)},
                           per_update, max_policy_lag, num_shards, inprocess=inprocess)
    shards = [runtime.create(ReplayShard, {}, i, capacity, board, inprocess=inprocess) for i in range(num_shards)]
    runtime.get([board.register_shard.remote(i, s) for i, s in enumerate(shards)])
    runtime.get(board.publish.remote(Publish(0, [runtime.put(weights)])))
    return board, shards


@contextlib.contextmanager
def data_plane(*args, **kwargs):
    """``supply(*args, **kwargs)`` for a block: (board, shards, actors); the block adds the actors it starts to
    ``actors``, and all of them, the shards and the board are killed at its end."""
    from pipeline import runtime

    board, shards = supply(*args, **kwargs)
    actors: list = []
    try:
        yield board, shards, actors
    finally:
        for a in actors + shards + [board]:
            runtime.kill(a)


def claim_take(board, update: int, n: int, wait_s: float, failed: list) -> tuple[list, list]:
    """What a learner's feed does for a batch: one ``board.claim`` of up to ``n`` stored fragments of ``update``,
    then a take from every shard it names (all sent, then gathered). Returns (fragments, the claimed tickets their
    shard no longer had: ``failed`` of the next claim, which hands them back)."""
    claims = ray.get(board.claim.remote(Claim(0, update, n, wait_s, failed)))
    frags, missing = [], []
    handles = ray.get(board.shard_handles.remote()) if claims else []
    for items, gone in ray.get([handles[index].take.remote(tickets) for index, (_, tickets) in claims.items()]):
        frags += [frag for _, frag in items]
        missing += gone
    return frags, missing


def pipelined_step(feed, learner, board, weights, device):
    """One learner iteration as ``LearnerActor`` runs it, for ``timed``: the feed's next batch (made ready for the
    device's current stream), the update, the batch released, then the next policy version published (not awaited:
    it creates the tickets producers fill next)."""
    versions = itertools.count(1)

    def step():
        t = time.perf_counter()
        batch = feed.next(timeout_s=120)
        if batch.ready_event is not None:
            device.module.current_stream().wait_event(batch.ready_event)
        wait_s = time.perf_counter() - t
        learner.update(batch.tensors)
        feed.release(batch)
        board.publish.remote(Publish(next(versions), weights))
        return batch.num_samples, wait_s

    return step


def timed(step, *, warmup: int = 0, iterations: int) -> dict:
    """``step()`` -> (samples, data_s): ``warmup`` untimed calls (allocator, autograd graph, caches), then
    ``iterations`` calls: the host-bound fraction (data_s / wall) and samples/s."""
    for _ in range(warmup):
        step()
    samples = data_s = 0.0
    t_start = time.perf_counter()
    for _ in range(iterations):
        n, wait_s = step()
        samples, data_s = samples + n, data_s + wait_s
    wall = time.perf_counter() - t_start
    return {"host_bound": data_s / wall, "samples_per_s": samples / wall}
