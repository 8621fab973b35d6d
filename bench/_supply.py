"""The data plane without training, shared by the data-plane benches: synthetic fragments, a ticketed producer,
the supply board and its shards wired as a run wires them."""

from __future__ import annotations

import contextlib
import itertools
import os
import time

import numpy as np
import ray

from bench._common import machine_busy_s, proc_cpu_s
from pipeline import fragment as F
from pipeline.protocol import Claim, Poll

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


class TicketedProducer:
    """``RolloutActor``'s protocol without the sampling: one ``board.poll`` for a ticket per fragment, then
    ``shard.add``, one add in flight, so the board's ``max_policy_lag`` bounds how far ahead it runs. Weights are not
    loaded; fragments are stamped with the newest policy version the board has announced. A subclass's ``make()``
    makes each fragment (timed: while the previous add is under way)."""

    def __init__(self, board, shard, shard_index: int = 0, actor_id: int = 0):
        self.board, self.shard, self.shard_index, self.actor_id = board, shard, shard_index, actor_id
        self.shard_incarnation = 0
        self.version = -1
        self.stats = {"fragments": 0, "prep_wall_s": 0.0, "prep_cpu_s": 0.0, "add_wait_s": 0.0, "ticket_wait_s": 0.0}

    def _poll(self, wait_s: float):
        tickets, news, change = ray.get(self.board.poll.remote(Poll(self.actor_id, 0, self.version, self.shard_index,
                                                                    self.shard_incarnation, [], wait_s)))
        if news is not None:
            self.version = news[0]
        if change is not None:
            self.shard_incarnation, self.shard = change
        return tickets[0] if tickets else None

    def run(self, seconds: float) -> dict:
        """Fragments for ``seconds``, or until the bench tears the board or shard down: where the time went."""
        pending, deadline, st = None, time.monotonic() + seconds, self.stats
        try:
            while time.monotonic() < deadline:
                t = time.perf_counter()
                ticket = self._poll(0.0)
                while ticket is None and time.monotonic() < deadline:
                    ticket = self._poll(0.5)  # the learners are behind: wait for the next update's tickets
                st["ticket_wait_s"] += time.perf_counter() - t
                if ticket is None:
                    break
                w0, c0 = time.perf_counter(), time.process_time()  # process_time: this process, all its threads
                frag = self.make()
                st["prep_wall_s"] += time.perf_counter() - w0
                st["prep_cpu_s"] += time.process_time() - c0
                if pending is not None:
                    t = time.perf_counter()
                    ray.get(pending)
                    st["add_wait_s"] += time.perf_counter() - t
                pending = self.shard.add.remote(ticket, F.FragmentMeta.of(frag), frag)
                st["fragments"] += 1
        except ray.exceptions.RayActorError:
            pass  # the bench tore the board or the shard down: this producer is done
        return dict(st)


@ray.remote(num_cpus=0)
class Producer(TicketedProducer):
    """Fills the supply board's tickets with copies of one pre-built fragment of ``kind``."""

    def __init__(self, board, shard, shard_index: int, kind: dict, actor_id: int = 0):
        super().__init__(board, shard, shard_index, actor_id)
        self.fragment = make_fragment(kind, 0, np.random.default_rng(0))

    def make(self) -> F.Fragment:
        self.fragment.policy_version = self.version
        return self.fragment


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
    for items, gone in ray.get([handle.take.remote(tickets) for handle, tickets in claims.values()]):
        frags += [frag for _, frag in items]
        missing += gone
    return frags, missing


def next_batch(feed, device, timeout_s: float) -> tuple:
    """A ``DeviceFeed``'s next batch, made ready for the device's current stream, and the seconds spent getting it
    (what a learner waits for its data)."""
    t = time.perf_counter()
    batch = feed.next(timeout_s=timeout_s)
    if batch.ready_event is not None:
        device.module.current_stream().wait_event(batch.ready_event)
    return batch, time.perf_counter() - t


def pipelined_step(feed, learner, board, weights, device):
    """One learner iteration as ``LearnerActor`` runs it, for ``timed``: the feed's next batch, the update, the batch
    released, then the next policy version published (not awaited: it creates the tickets producers fill next)."""
    versions = itertools.count(1)

    def step():
        batch, wait_s = next_batch(feed, device, 120)
        learner.update(batch.tensors)
        feed.release(batch)
        board.publish.remote(next(versions), weights)
        return batch.num_samples, wait_s, 0.0

    return step


def timed(step, *, warmup: int = 0, iterations: int | None = None, seconds: float | None = None,
          producer_pids=()) -> dict:
    """``step()`` -> (samples, data_s, prep_s): ``warmup`` untimed calls (allocator, autograd graph, caches), then
    ``iterations`` calls or as many as ``seconds`` hold. The sums, updates, wall time, host-bound fraction (data_s /
    wall) and samples/s, and the CPU seconds this process, ``producer_pids`` and the whole machine used."""
    for _ in range(warmup):
        step()
    pid = os.getpid()
    out = {"prep_s": 0.0, "data_s": 0.0, "samples": 0, "updates": 0}
    cpu0, busy0, pcpu0 = proc_cpu_s(pid), machine_busy_s(), [proc_cpu_s(p) for p in producer_pids]
    t_start = time.perf_counter()
    while out["updates"] < iterations if iterations is not None else time.perf_counter() - t_start < seconds:
        samples, data_s, prep_s = step()
        out["samples"] += samples
        out["data_s"] += data_s
        out["prep_s"] += prep_s
        out["updates"] += 1
    out["wall"] = wall = time.perf_counter() - t_start
    out.update(learner_cpu=proc_cpu_s(pid) - cpu0, machine_cpu=machine_busy_s() - busy0,
               producer_cpu=sum(proc_cpu_s(p) - c for p, c in zip(producer_pids, pcpu0)),
               host_bound=out["data_s"] / wall, samples_per_s=out["samples"] / wall)
    return out
