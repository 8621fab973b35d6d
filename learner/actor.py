"""LearnerActor: the thin Ray shell around ``Learner`` and its ``DeviceFeed``.

Per iteration: wait for the next prepared batch (timed: this is the
host-bound time), make the device wait on the copy event, run the PPO update
(with all-reduce across ranks), hand the buffer back to the feed, and on rank
0 publish the new weights to the board.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import ray
import torch

from learner import device as devices
from learner import distributed
from learner.learner import Learner, LearnerSettings
from learner.model import PolicySpec, build_model, state_dict_numpy
from learner.profiling import IterationProfiler
from pipeline import runtime
from pipeline.feed import ClaimInbox, DeviceFeed, StallError
from pipeline.protocol import STALL_REPORT_BOARD_S, STALL_REPORT_SHARD_S, Assignment, Publish
from pipeline.supply import describe_line
from pipeline import metric_keys as M
from pipeline.timing import Stopwatch

#: Policy weights of at most this many bytes go to the rollout actors by value (the supply board, or a node's
#: relay, sends each reader a copy), larger ones as one Ray object a version. An object costs its owner ~450 B
#: for every version another process held (Ray 2.60 keeps it for the owner's life: +33 MB an hour at 16 versions
#: a second, docs/results.md, "Memory and disk per process"), so rank 0 could not run for days; a copy per reader
#: costs the board bytes x readers a version instead, which at this size stays under 1 MB a reader-second at 16
#: versions a second. Small MLP policies (CartPole's is 37 KB) go by value; image encoders keep the node-wide
#: object (one transfer per node) and its cost, smaller per hour since their versions are slower.
WEIGHTS_BY_VALUE_MAX_BYTES = 64 * 1024


def host_copy(value):
    """``value`` with every tensor in it (in dicts, lists and tuples, at any depth) copied to the CPU. Always a
    copy, on the CPU too: the optimizer's state (``exp_avg``, ``exp_avg_sq``) and the model's ``state_dict`` are the
    learner's live tensors, on its device, which the next update overwrites in place; a checkpoint holding them
    would fail to load on a CPU-only head, or be written half from one update and half from the next (in process,
    where nothing serializes a return value)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: host_copy(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(host_copy(v) for v in value)
    return value


#: The methods that never read or write a tensor of the learner's: every other public method binds its calling thread
#: to the device first (Ray runs each concurrency group on threads of its own, and a new thread starts on device 0,
#: where torch_npu would allocate, copy or sync on another learner's NPU). tests/test_ascend_path.py holds every
#: method outside this set to that, so a new method has to bind or be named here.
HOST_ONLY_METHODS = frozenset({"address", "take_assignment", "ping", "attach_board", "start_at_version"})


class LearnerStalled(RuntimeError):
    """No batch within run.stall_timeout_s; the message is the one-line report the run stops with."""


class LearnerActor:
    def __init__(self, *, rank: int, world_size: int, device_kind: str, spec: PolicySpec, settings: LearnerSettings,
                 seed: int, torch_threads: int, profile_iterations: int = 0,
                 profile_dir: str = "profile", self_play: dict | None = None):
        """``self_play``: {snapshot_every, pool_size} under multiagent.self_play: rank 0 keeps the pool of past
        weights versions the rollouts' other seats are played by (``_publish``)."""
        torch.set_num_threads(torch_threads)
        self._rendezvous = None  # rank 0's listening socket between address() and setup()
        self.rank, self.world_size = rank, world_size
        # The device Ray assigned this actor, made current before anything (the process group included) touches it.
        self.device = devices.for_this_process(devices.resolve(device_kind))
        torch.manual_seed(seed)  # identical init on every rank; rank 0's weights are broadcast anyway
        model = build_model(spec)
        # The update's collectives, timed on one clock of this device (None with one learner).
        c = distributed.learner_collectives(world_size, self.device)
        self.grad_sync = c.grad if c is not None else None
        # The mean over ranks serves target_kl's epoch KL and each rank's non-finite flag (every rank undoes the same
        # updates, learner.learner._UpdateGuard).
        syncs = (dict(grad_sync=c.grad, stats_sync=c.stats, kl_sync=c.mean, nonfinite_sync=c.mean,
                      collective_clock=c.clock) if c is not None else {})
        # Each rank shuffles its minibatches with a generator of its own.
        self.learner = Learner(model, dataclasses.replace(settings, seed=seed * 1000 + rank),
                               self.device.torch_device(), **syncs)
        self.feed: DeviceFeed | None = None
        self._update_lock = threading.Lock()
        self._publish_lock = threading.Lock()
        self._published: tuple | None = None  # rank 0: (version, [weights ref, ...]) it last published
        self.self_play = self_play
        # Rank 0, self-play: [(version, weights ref)] of the snapshots in the pool, oldest first. Each is the object
        # that version was published as: a snapshot costs no copy, and travels to the actors as weights do.
        self.pool: list[tuple[int, object]] = []
        self.board = None
        self.inbox = ClaimInbox()  # parts of rank 0's group claims, filled before or after the feed starts
        self.stall_timeout_s = 120.0
        self.generation = 0
        self.version = 0
        self._last_iter_end: float | None = None
        self.profiler = IterationProfiler(self.device, profile_iterations, profile_dir, rank)

    # ------------------------------------------------------------------ set-up
    def address(self) -> tuple[str, int]:
        """Rank 0's node IP and the port of the group's rendezvous, listening on that address only and held until
        ``setup`` makes the store on it (``distributed.rendezvous_socket``)."""
        if self._rendezvous is not None:
            self._rendezvous.close()
        ip = ray.util.get_node_ip_address()
        self._rendezvous = distributed.rendezvous_socket(ip)
        return ip, self._rendezvous.getsockname()[1]

    def setup(self, master_addr: str, master_port: int, board, *, fragments_per_batch: int, prefetch_batches: int,
              stall_timeout_s: float, generation: int = 0, group_claims: bool = False,
              peers: list | None = None) -> int:
        """Join the process group, publish the first weights (rank 0), start the feed. The feed claims its
        fragments from the supply board, which knows every shard: no shard list to keep up to date here.
        ``group_claims`` (``learner.group_claims``, several learners): the group claims as one, rank 0 for every
        rank; ``peers``, every learner of the group by rank, goes to rank 0, which sends each rank its part
        (``take_assignment``)."""
        # Ray runs this on one of its own threads, which starts on device 0; here the first weights are read and the
        # feed's pinned pool made, and the group's communicator binds to this thread's current device: bound first,
        # whatever the world size.
        self.device.bind_thread()
        if self.world_size > 1:
            listening, self._rendezvous = self._rendezvous, None
            distributed.init_process_group(self.device.backend, master_addr, master_port, self.rank, self.world_size,
                                           timeout_s=distributed.collective_timeout_s(stall_timeout_s),
                                           listening=listening)
            distributed.broadcast_params(self.learner.model)
        self.board = board
        self.stall_timeout_s = stall_timeout_s
        self.generation = generation  # which learner group this is (the board ignores replaced groups)
        if self.rank == 0:
            self._publish()
        group = group_claims and self.world_size > 1
        self.feed = DeviceFeed(board, self.rank, fragments_per_batch, self.device, prefetch_batches=prefetch_batches,
                               start_version=self.version, generation=generation, world_size=self.world_size,
                               peers=peers, inbox=self.inbox if group else None).start()
        return self.version

    @ray.method(concurrency_group="feed")
    def take_assignment(self, assignment: Assignment) -> None:
        """Rank 0's feed sends this rank its part of a group claim ({shard: Part(directory_version, [tickets])});
        this rank's feed takes it from the shards. In a group of its own: answered while an update or the feed
        waits."""
        self.inbox.put(assignment.board_key, assignment.update, assignment.part)

    def _stall_report(self, waited_s: float) -> str:
        """One line: which learner, what it waits for, where those fragments are, and what each shard holds."""
        update, have, need = self.feed.waiting_for()
        try:
            where = describe_line(runtime.get(self.board.describe.remote(update), timeout=STALL_REPORT_BOARD_S))
            handles = runtime.get(self.board.shard_handles.remote(), timeout=STALL_REPORT_BOARD_S)
            shard_stats = []
            refs = [h.stats.remote() for h in handles]  # asked all at once: one slow shard, not K, bounds the wait
            for i, ref in enumerate(refs):
                try:
                    st = runtime.get(ref, timeout=STALL_REPORT_SHARD_S)
                    held = (f"{st['depth']} fragments, policy versions {st['min_version']}..{st['max_version']}"
                            if st["depth"] else "empty")
                except Exception as e:  # noqa: BLE001 - a report, whatever the shard's state
                    held = f"unreachable ({type(e).__name__})"
                shard_stats.append(f"{i}: {held}")
            shards = "; ".join(shard_stats)
        except Exception as e:  # noqa: BLE001
            where, shards = f"supply board unreachable ({type(e).__name__})", "?"
        return (f"learner {self.rank} got no batch for {waited_s:.0f} s (run.stall_timeout_s): it waits for update "
                f"{update} with {have} of {need} fragments; it reads every shard; {where}; shards: {shards}")

    def _publish(self) -> None:
        weights = state_dict_numpy(self.learner.model)
        by_value = sum(a.nbytes for a in weights.values()) <= WEIGHTS_BY_VALUE_MAX_BYTES
        box = [weights if by_value else runtime.put(weights)]
        if self.self_play is not None:  # a snapshot every snapshot_every versions, the last pool_size kept
            if not self.pool or self.version >= self.pool[-1][0] + self.self_play["snapshot_every"]:
                # One object per snapshot (not per version): the pool's few objects are what every actor holds.
                snapshot = runtime.put(weights) if by_value else box[0]
                self.pool = (self.pool + [(self.version, snapshot)])[-self.self_play["pool_size"]:]
            box.append(list(self.pool))  # the pool rides with every version: a new actor has it at once
        with self._publish_lock:  # ordered with attach_board's republish: versions reach a board increasing
            self._published = (self.version, box)
            self.board.publish.remote(Publish(self.version, box, self.generation))

    # ------------------------------------------------------------------ loop
    def train_iteration(self, snapshot: bool = False) -> dict:
        """One update. ``snapshot``: also return this learner's state right after it (``state``), so a periodic
        checkpoint holds exactly one update's weights, optimizer and counters."""
        t_start = self._last_iter_end or time.perf_counter()
        self.device.bind_thread()  # Ray runs methods on its own threads, each starting on device 0
        self.profiler.before()
        with Stopwatch() as wait:
            try:
                batch = self.feed.next(timeout_s=self.stall_timeout_s)
            except StallError:
                raise LearnerStalled(self._stall_report(wait.s)) from None
        wait_s = wait.s
        if batch.ready_event is not None:
            self.device.module.current_stream().wait_event(batch.ready_event)
        with self._update_lock:  # the model, optimizer and version change only in here
            with Stopwatch() as update:
                stats = self.learner.update(batch.tensors)
            update_s = update.s
            h2d_ms = batch.h2d_ms()
            self.feed.release(batch)
            lag = self.version - batch.policy_versions
            self.version += 1
            if self.rank == 0:
                self._publish()
            state = self.state() if snapshot else None
        self.profiler.after()
        t_end = time.perf_counter()
        iter_s = t_end - t_start
        self._last_iter_end = t_end
        # Under the record's own names (pipeline/metric_keys.py): the driver averages or sums, never renames.
        stats.update({
            M.POLICY_VERSION: self.version,
            M.LEARNER_ITER_S: iter_s,
            M.LEARNER_WAIT_S: wait_s,
            M.LEARNER_UPDATE_S: update_s,
            M.HOST_BOUND_FRACTION: wait_s / iter_s if iter_s > 0 else 0.0,
            # CPU: the update is the device's busy time; accelerators: see h2d_ms / the profiler for kernel time.
            M.DEVICE_IDLE_FRACTION: max(0.0, 1.0 - update_s / iter_s) if iter_s > 0 else 0.0,
            M.FEED_PULL_S: batch.pull_s,
            M.FEED_COLLATE_S: batch.collate_s,
            M.H2D_MS: h2d_ms,
            M.H2D_BYTES: batch.h2d_bytes,
            M.POLICY_LAG_MEAN: float(lag.mean()),
            M.POLICY_LAG_MAX: int(lag.max()),
            M.LEARNER_TAKE_FAILURES: self.feed.take_failures,
            M.HOST_SYNCS: self.learner.host_syncs,
            M.ALLREDUCE_CALLS: self.grad_sync.calls if self.grad_sync else 0,
            # COLLECTIVE_S came with the update's result; its share of this learner's update (pipeline/metric_keys.py)
            M.COLLECTIVE_SHARE: stats[M.COLLECTIVE_S] / update_s if update_s > 0 else 0.0,
            M.COMPILE: self.learner.compile_note,
            M.UPDATE_PATH: self.learner.update_path,
            M.PROFILE_TRACE: self.profiler.trace_path,
            # Not metrics: what the driver needs besides them.
            "samples": batch.num_samples,
            "ticket_ids": batch.ticket_ids,
            "state": state,
        })
        return stats

    # ------------------------------------------------------------------ state
    def flat_params(self) -> np.ndarray:
        self.device.bind_thread()
        return self.learner.flat_params()

    def state(self) -> dict:
        """Everything a checkpoint needs from this learner, as CPU tensors and plain values: copies (``host_copy``),
        so neither a driver without the device nor the next update, which writes the live tensors in place, sees
        the learner's own storage."""
        self.device.bind_thread()  # also called on the control thread (state_between_updates)
        out = {
            "model": self.learner.model.state_dict(),
            "optimizer": self.learner.optimizer.state_dict(),
            "version": self.version,
            "updates_done": self.learner.updates_done,
            "minibatch_rng": self.learner.generator.get_state(),
        }
        if self.learner.scaler is not None:
            out["grad_scaler"] = self.learner.scaler.state_dict()
        if self.pool:  # rank 0 under self-play: the snapshots, so a resumed or restarted run keeps its opponents
            # (this process's own objects: a read of the local object store, bounded all the same)
            snapshots = runtime.get([ref for _, ref in self.pool], timeout=self.stall_timeout_s)
            out["self_play_pool"] = [(version, {k: torch.from_numpy(np.array(v)) for k, v in weights.items()})
                                     for (version, _), weights in zip(self.pool, snapshots)]
        return host_copy(out)

    @ray.method(concurrency_group="control")
    def state_between_updates(self) -> dict:
        """``state()`` beside a ``train_iteration`` that is blocked waiting for data (after a rollout failure,
        no more data will come): taken between two updates, so weights, optimizer and version agree."""
        with self._update_lock:
            return self.state()

    @ray.method(concurrency_group="health")
    def ping(self) -> int:
        """The driver's health call: answered beside anything else (a group of its own, taking no lock), so only a
        stopped or wedged process leaves it unanswered."""
        return self.version

    @ray.method(concurrency_group="control")
    def attach_board(self, board) -> int:
        """The driver replaced the supply board: claim from and publish to ``board`` from now on; rank 0 publishes
        there at once the weights it last published (the new board's ledger starts from that version). Beside a
        ``train_iteration``, and without its update lock: rank 0 may be inside an update's all-reduce, waiting for
        a rank whose batch can only come from the new board's tickets, which need this very publish."""
        with self._publish_lock:
            self.board = board
            if self.feed is not None:
                self.feed.attach_board(board)
            if self.rank == 0 and self._published is not None:
                version, ref_box = self._published
                board.publish.remote(Publish(version, ref_box, self.generation))
            return self._published[0] if self._published is not None else self.version

    def start_at_version(self, version: int) -> None:
        """Number the next weights ``version`` (a restarted group without a checkpoint). Call before ``setup``."""
        self.version = version

    def load_state(self, state: dict, version: int | None = None) -> int:
        """Continue from a checkpoint (every rank loads the same one). Call before ``setup``.

        ``version`` overrides the stored version number: after a learner-group restart the
        weights are the checkpoint's, but version numbers must keep increasing for the board.
        """
        if self.feed is not None:
            raise RuntimeError("load_state must come before setup (the feed numbers batches from the version)")
        self.device.bind_thread()
        self.learner.model.load_state_dict(state["model"])
        self.learner.optimizer.load_state_dict(state["optimizer"])
        self.learner.updates_done = int(state["updates_done"])
        self.learner.generator.set_state(state["minibatch_rng"])
        if self.learner.scaler is not None and "grad_scaler" in state:
            # (written on whichever device type the run had: torch_npu's scaler needs a key torch's never writes)
            self.learner.scaler.load_state_dict(devices.grad_scaler_state(self.learner.device.type,
                                                                          state["grad_scaler"]))
        self.version = int(state["version"] if version is None else version)
        if self.rank == 0 and self.self_play is not None:
            self.pool = [(int(v), runtime.put({k: t.numpy() for k, t in weights.items()}))
                         for v, weights in state.get("self_play_pool", [])]
        return self.version

    @ray.method(concurrency_group="control")
    def stop(self) -> None:
        """Beside a ``train_iteration`` that is blocked waiting for data (a stuck or dead rollout): in the default
        group this call would queue behind it until the driver's shutdown deadline ran out."""
        self.device.bind_thread()  # the control group's thread: destroying the group frees its device resources
        if self.feed is not None:
            self.feed.stop()
        distributed.destroy()


# No GCS task records for the per-iteration calls (see pipeline/replay.py).
RemoteLearner = ray.remote(max_restarts=0, enable_task_events=False,
                           concurrency_groups={"control": 1, "health": 1, "feed": 1})(LearnerActor)
