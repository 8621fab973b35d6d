"""Learner-side device feed: pull -> collate into pinned memory -> async copy.

A background thread prepares batch k+1 while the learner trains on batch k:

1. pull: claim stored fragments of the update being prepared from the supply
   board (``pipeline/supply.py``), wherever they are, and take them from
   their shards in parallel; ``take`` returns the fragments themselves (large
   arrays arrive as zero-copy views of the object store);
2. collate: copy them into a host buffer from a pool that is allocated once,
   pinned on accelerators (pinning per batch is slow, and ``non_blocking``
   copies are only asynchronous from pinned memory);
3. copy: ``non_blocking`` host-to-device copies on a dedicated copy stream,
   recording an event the update waits on.

The pool has ``prefetch_batches + 1`` slots (host + device buffers each); a
slot goes back to the pool when the learner releases the batch, so a buffer
is never overwritten while it is being read. On CPU the same structure runs
without step 3: the batch tensors are the host buffers.

With several learners the group claims as one (``group_claims``): rank 0's
feed claims every rank's fragments of an update in one supply-board call
(``SupplyBoard.claim``), keeps its own part and sends each other rank its part
(the learner actor's ``take_assignment`` puts it in that rank's
``ClaimInbox``); every rank takes its part from the shards itself. The board
then answers one claim per update, not one per learner (at 64 learners the
claims were half its calls). A rank whose take fails (its shard died or hung)
claims the replacements of those fragments itself, handing the failed ones
back in that claim: what rank 0 owes it never changes, so the ranks' claims
never add up to more than the batch. On each board (the first, and every
replacement) rank 0 first tells the other ranks from which update it leads
there: a rank still preparing an earlier update when the board was replaced
(rank 0 may be one ahead) claims that update's batch itself, since rank 0
will not come back to it.

The device is injected (anything with the learner device layer's interface),
so this module does not import ``learner``.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from pipeline import fragment as F
from pipeline import runtime
from pipeline.protocol import (BOARD_SLICE_S, BOARDS_KEPT, CLAIM_WAIT_S, FEED_JOIN_S, FEED_SLICE_S, TAKE_TIMEOUT_S,
                               Assignment, Claim, Part)
from pipeline.timing import Stopwatch


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor]
    policy_versions: np.ndarray  # one per fragment
    num_samples: int
    slot: int
    ready_event: object = None  # device event the update waits on (None on CPU)
    copy_start: object = None
    pull_s: float = 0.0
    collate_s: float = 0.0
    h2d_bytes: int = 0
    ticket_ids: tuple = ()  # which fragments (tests check that ranks train on different ones)

    def h2d_ms(self) -> float:
        """Host-to-device copy time, from device events (0 on CPU). Call after the update."""
        if self.ready_event is None:
            return 0.0
        return float(self.copy_start.elapsed_time(self.ready_event))


class _Slot:
    def __init__(self, specs: dict[str, tuple[tuple, np.dtype]], device, pin: bool):
        self.host: dict[str, torch.Tensor] = {}
        self.host_np: dict[str, np.ndarray] = {}
        self.dev: dict[str, torch.Tensor] = {}
        for key, (shape, dtype) in specs.items():
            t = torch.empty(shape, dtype=_torch_dtype(dtype), pin_memory=pin)
            self.host[key] = t
            self.host_np[key] = t.numpy()
            if device is not None and device.is_accelerator:
                # Same dtype as the host side: uint8 stays uint8 across the link.
                self.dev[key] = torch.empty(shape, dtype=t.dtype, device=device.torch_device())


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=dtype)).dtype


def board_key(board) -> str:
    """Names a supply board across processes: a rank must not take parts that rank 0 claimed from a board the
    driver has since replaced (their fragments are void there)."""
    actor_id = getattr(board, "_actor_id", None)
    return actor_id.hex() if actor_id is not None else f"local-{id(board)}"


def ticket_count(claims: dict) -> int:
    return sum(len(tickets) for _, tickets in claims.values())


class ShardBook:
    """The shard handles a feed takes from: the board's directory (``SupplyBoard.shard_directory``) as of its
    version, asked for again only when a claim names a newer directory version (a shard was replaced) or comes from
    another board. Claims carry the directory version, not the handles (``Part``): the handles cross once per
    replacement, not once per update."""

    def __init__(self):
        self.board_key: str | None = None
        self.directory_version = -1
        self.handles: list = []

    def holds(self, board, directory_version: int) -> bool:
        return self.board_key == board_key(board) and self.directory_version >= directory_version

    def keep(self, board, directory) -> None:
        self.board_key, self.directory_version = board_key(board), directory.directory_version
        self.handles = [change.handle for change in directory.shards]


def split_claims(claims: dict, owed: dict[int, int]) -> dict[int, dict]:
    """A group claim's {shard: Part(directory_version, [tickets])} cut into each rank's part, {rank: {shard: Part}}:
    ranks in order, each given up to what it is ``owed``, the shards in order (so a rank's part comes from as few
    shards as the claim allows). ``owed`` is decreased by what each rank gets."""
    pieces: dict[int, dict] = {}
    ranks = [r for r in sorted(owed) if owed[r] > 0]
    for shard, (directory_version, tickets) in claims.items():
        i = 0
        while i < len(tickets) and ranks:
            rank = ranks[0]
            n = min(owed[rank], len(tickets) - i)
            part = pieces.setdefault(rank, {}).setdefault(shard, Part(directory_version, []))
            part[1].extend(tickets[i:i + n])
            owed[rank] -= n
            i += n
            if owed[rank] == 0:
                ranks.pop(0)
        if i < len(tickets):  # the board never gives more than asked: a bug, not a fault to ride out
            raise RuntimeError(f"group claim gave {ticket_count(claims)} fragments, more than the ranks are owed")
    return pieces


class ClaimInbox:
    """A rank's parts of group claims, as rank 0 sends them: (board key, update) -> [part], until the feed takes
    them, and from which update rank 0 leads on each board. Parts of updates the feed has passed are dropped; what
    is kept is at most the few updates rank 0 can be ahead (its own feed waits for its learner like this one's)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._parts: dict[tuple[str, int], list[dict]] = {}
        # board key -> the first update rank 0 claims for the group there, for the newest BOARDS_KEPT boards (oldest
        # first): one entry per board replacement would otherwise outlive the boards themselves.
        self._lead_from: dict[str, int] = {}
        self._floor = 0  # the update the feed prepares: parts for older ones are void

    def put(self, key: str, update: int, part: dict | None) -> None:
        """A part of ``update``'s group claim on board ``key``; None: rank 0 leads on that board from ``update``."""
        with self._cond:
            if part is None:
                self._lead_from.pop(key, None)
                self._lead_from[key] = update
                while len(self._lead_from) > BOARDS_KEPT:
                    del self._lead_from[next(iter(self._lead_from))]
                self._cond.notify_all()
            elif update >= self._floor:
                self._parts.setdefault((key, update), []).append(part)
                self._cond.notify_all()

    def lead_from(self, key: str) -> int | None:
        with self._cond:
            return self._lead_from.get(key)

    def get(self, key: str, update: int, timeout_s: float) -> dict | None:
        """The oldest part for (key, update), waiting at most ``timeout_s``; None if none came."""
        with self._cond:
            if update > self._floor:
                self._floor = update
                for k in [k for k in self._parts if k[1] < update]:
                    del self._parts[k]
            self._cond.wait_for(lambda: self._parts.get((key, update)), timeout_s)
            parts = self._parts.get((key, update))
            if not parts:
                return None
            part = parts.pop(0)
            if not parts:
                del self._parts[(key, update)]
            return part

    def waiting_tickets(self) -> list:
        """The tickets of every part not taken yet (what a test or a stall report looks at)."""
        with self._cond:
            return [t for parts in self._parts.values() for part in parts for _, tickets in part.values()
                    for t in tickets]


class StallError(TimeoutError):
    """No batch within the stall deadline; the message says what the feed waits for."""


class DeviceFeed:
    def __init__(
        self,
        board,
        rank: int,
        fragments_per_batch: int,
        device,
        *,
        prefetch_batches: int = 1,
        start_version: int = 0,
        claim_wait_s: float = CLAIM_WAIT_S,
        generation: int = 0,
        world_size: int = 1,
        peers: list | None = None,
        inbox: ClaimInbox | None = None,
    ):
        """``world_size`` > 1 with ``inbox``: the group claims as one (module docstring); rank 0 needs ``peers``,
        every rank's learner actor by rank (their ``take_assignment`` fills their inbox). Without an inbox each
        rank claims its own fragments."""
        if world_size > 1 and inbox is not None and rank == 0 and (peers is None or len(peers) != world_size):
            raise ValueError(f"rank 0 of a group of {world_size} that claims as one needs its {world_size} peers")
        self.board = board
        self.world_size = world_size
        self.peers = peers
        self.inbox = inbox
        self.group_parts_sent = 0  # rank 0: parts of group claims sent to the other ranks
        self._leading_on = None  # rank 0: the board it last told the other ranks it leads on
        self.replacement_claims = 0  # claims a rank made itself for fragments whose take failed
        self.generation = generation  # of the learner group: the board ignores claims of a replaced one
        self.rank = rank
        self.fragments_per_batch = fragments_per_batch
        self.device = device
        self.claim_wait_s = claim_wait_s
        self._next_version = start_version  # learner update (policy version) the next prepared batch is for
        self.have = 0  # fragments of the batch being prepared (what a stall report shows)
        self._ready: queue.Queue[Batch] = queue.Queue(maxsize=prefetch_batches)
        self._free: queue.Queue[int] = queue.Queue()
        self._num_slots = prefetch_batches + 1
        self._slots: list[_Slot] | None = None
        self._copy_stream = device.new_stream() if device is not None and device.is_accelerator else None
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="device-feed", daemon=True)
        self.keys: list[str] | None = None
        self.shards = ShardBook()
        self.take_failures = 0  # fragments claimed from a shard that died or hung before handing them over
        self.voided = 0  # fragments taken for an update from a supply board that then died (the update starts over)

    # ----------------------------------------------------------- consumer side
    def start(self) -> "DeviceFeed":
        self._thread.start()
        return self

    def next(self, timeout_s: float) -> Batch:
        """The next prepared batch; blocks (this wait is the host-bound time) at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._raise_error()
            try:
                return self._ready.get(timeout=FEED_SLICE_S)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise StallError(self.waiting_for()) from None
                if not self._thread.is_alive() and self._ready.empty():
                    # The thread most often fails while this waits in the get above: its error is looked at again
                    # here, or the run's one line would say "stopped" and hide the cause.
                    self._raise_error()
                    raise RuntimeError("device feed stopped")

    def _raise_error(self) -> None:
        """The feed thread's failure, named in the message (the run's one line shows the message, not its cause)."""
        if self._error is not None:
            e = self._error
            raise RuntimeError(f"device feed thread failed: {type(e).__name__}: {e}") from e

    def waiting_for(self) -> tuple[int, int, int]:
        """(update being prepared, fragments it has, fragments it needs)."""
        return self._next_version, self.have, self.fragments_per_batch

    def release(self, batch: Batch) -> None:
        self._free.put(batch.slot)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=FEED_JOIN_S)  # a thread blocked on a claim or a take is left to the actor's kill

    # ----------------------------------------------------------- producer side
    def _run(self) -> None:
        try:
            if self.device is not None and hasattr(self.device, "bind_thread"):
                self.device.bind_thread()  # a new thread starts on device 0: allocate and copy on the learner's
            while not self._stop.is_set():
                batch = self._prepare()
                if batch is None:
                    return
                while not self._stop.is_set():
                    try:
                        self._ready.put(batch, timeout=FEED_SLICE_S)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # surfaced to the learner by next()
            self._error = e

    def _pull(self, update: int) -> tuple[list[F.Fragment], list[int]] | None:
        """Exactly ``fragments_per_batch`` fragments ticketed for ``update``, from whichever shards hold them."""
        if self.world_size > 1 and self.inbox is not None:
            return self._pull_lead(update) if self.rank == 0 else self._pull_part(update)
        fragments: list = []
        ids: list = []
        failed: list = []  # claimed but not handed over: the board refunds them with the next claim
        self.have = 0
        while len(fragments) < self.fragments_per_batch:
            if self._stop.is_set():
                return None
            board = self.board
            claims = self._claim(board, update, self.fragments_per_batch - len(fragments), failed)
            if claims is None:
                # The board was replaced: what this update got from the old one is void (its new ledger makes the
                # whole batch again), so start the update over. Nothing is trained twice, nothing half.
                fragments, ids, failed = self._start_over(fragments)
                continue
            failed = []
            self._take(board, claims, fragments, ids, failed)
        return fragments, ids

    def _start_over(self, fragments: list) -> tuple[list, list, list]:
        """The board was replaced: what the update being prepared got from the old one is void. Fresh (fragments,
        ids, failed)."""
        self.voided += len(fragments)
        self.have = 0
        return [], [], []

    def _take(self, board, claims: dict, fragments: list, ids: list, failed: list) -> None:
        """Take the fragments ``board`` gave in ``claims`` from their shards (all asked at once) into ``fragments``
        and ``ids``; the tickets a shard did not hand over go to ``failed`` (the next claim hands them back)."""
        if not claims:
            # The board answers a claim with nothing when none of the update was stored within the claim's waits
            # (CLAIM_WAIT_S, then CLAIM_PART_WAITS more: 10 s): a hung or stopped actor holds the update's last
            # tickets until their lease runs out (at least 10 s) or it is replaced. Nothing to take and no
            # directory version to read: the caller claims again, and the learner's stall deadline (next()) bounds
            # how long.
            return
        directory_version = max(part.directory_version for part in claims.values())
        if not self.shards.holds(board, directory_version):
            directory = self._ask(board, board.shard_directory.remote())
            if directory is None:  # the board was replaced: these claims are void there (the update starts over)
                failed.extend(t for part in claims.values() for t in part.tickets)
                return
            self.shards.keep(board, directory)
        # Values, not refs: once returned they are ours (zero-copy reads), whatever happens to the shard.
        takes = [(self.shards.handles[shard].take.remote(part.tickets), part.tickets)
                 for shard, part in claims.items()]
        for ref, tickets in takes:
            try:
                taken = runtime.get(ref, timeout=TAKE_TIMEOUT_S)
            except (RayActorError, GetTimeoutError):
                failed.extend(tickets)  # the driver replaces a dead shard; its fragments are made again
                self.take_failures += len(tickets)
                continue
            items, missing = taken.items, taken.missing
            failed.extend(missing)
            ids.extend(t.id for t in tickets if t not in missing)
            fragments.extend(frag for _, frag in items)
        self.have = len(fragments)

    def _pull_lead(self, update: int) -> tuple[list[F.Fragment], list[int]] | None:
        """Rank 0 of a group that claims as one: claim what every rank is still owed of ``update`` in one call,
        send each other rank its part, take its own; until its own batch is whole and every rank has its part."""
        per = self.fragments_per_batch
        board = self.board
        key = board_key(board)
        fragments, ids, failed = [], [], []
        owed = {r: per for r in range(self.world_size)}
        self.have = 0
        while len(fragments) < per or any(owed.values()):
            if self._stop.is_set():
                return None
            if self._leading_on is not board:  # a new board: say from which update the group's claims come
                for peer in self.peers[1:]:
                    peer.take_assignment.remote(Assignment(key, update, None))
                self._leading_on = board
            # len(fragments) + owed[0] == per throughout (a failed take of its own is owed again), so while the loop
            # runs something is owed.
            claims = self._claim(board, update, sum(owed.values()), failed)
            if claims is None:  # the board was replaced: the whole update starts over on the new one, every rank
                fragments, ids, failed = self._start_over(fragments)  # (each drops what it had of the old one)
                board, key = self.board, board_key(self.board)
                owed = {r: per for r in range(self.world_size)}
                continue
            failed = []
            for rank, part in split_claims(claims, owed).items():
                if rank == 0:
                    self._take(board, part, fragments, ids, failed)
                    owed[0] += len(failed)  # handed back with the next claim, and claimed again for this rank
                else:
                    # Not waited for: a dead or stopped peer is the driver's to find (the group restarts, and
                    # with it every claim of the old group is refunded).
                    self.peers[rank].take_assignment.remote(Assignment(key, update, part))
                    self.group_parts_sent += 1
        return fragments, ids

    def _pull_part(self, update: int) -> tuple[list[F.Fragment], list[int]] | None:
        """A rank other than 0 in a group that claims as one: take the parts rank 0 sends; claim the replacements
        of fragments whose take failed itself (rank 0 owes this rank exactly its batch, failed or not)."""
        per = self.fragments_per_batch
        board = self.board
        key = board_key(board)
        fragments, ids, failed = [], [], []
        short = 0  # fragments whose take failed and whose replacements this rank has not claimed yet
        self.have = 0
        while len(fragments) < per:
            if self._stop.is_set():
                return None
            if self.board is not board:  # replaced: what came from the old board is void (rank 0 starts over too)
                fragments, ids, failed = self._start_over(fragments)
                board, key, short = self.board, board_key(self.board), 0
                continue
            if short:
                claims = self._claim(board, update, short, failed)
                if claims is None:
                    continue  # the board was replaced (seen above)
                self.replacement_claims += 1
                failed = []
                short -= ticket_count(claims)
            else:
                claims = self.inbox.get(key, update, timeout_s=BOARD_SLICE_S)
                if claims is None:
                    lead = self.inbox.lead_from(key)
                    if lead is not None and lead > update:
                        # The board was replaced while this rank was an update behind rank 0, which leads on the
                        # new board from a later one: this update's batch is this rank's to claim.
                        short = per - len(fragments)
                    continue
            before = len(failed)
            self._take(board, claims, fragments, ids, failed)
            short += len(failed) - before
        return fragments, ids

    def _claim(self, board, update: int, max_items: int, failed: list) -> dict | None:
        """The board's claim, waited for in short slices; None once the driver has replaced a board that died or
        stopped answering (``attach_board``)."""
        # The whole rest of the batch at once when it is there within the wait (one claim per update, usually);
        # what is stored when the wait ends otherwise, so a slow producer's part does not hold the rest back.
        asked = time.monotonic()
        claims = self._ask(board, board.claim.remote(
            Claim(self.rank, update, max_items, self.claim_wait_s, failed, self.generation, min_items=max_items)))
        if claims == {}:
            # Nothing, and sooner than the claim's own wait: the board is not waiting for this feed (a group it has
            # replaced, whose learners the driver is about to stop). At most one claim per claim_wait_s then, or
            # the feed would ask again at once, without end, and take the board's and the host's CPU meanwhile.
            self._stop.wait(max(0.0, self.claim_wait_s - (time.monotonic() - asked)))
        return claims

    def _ask(self, board, ref):
        """The answer of ``board``'s call ``ref``, waited for in short slices; None once the driver has replaced a
        board that died or stopped answering (``attach_board``)."""
        while True:
            # No deadline of its own: the learner's stall deadline (next()) bounds every wait of the feed, and the
            # driver replaces a silent board well inside it (a shorter one here ended runs whose driver was busy
            # replacing a stopped shard and then a stopped board).
            try:
                return runtime.get(ref, timeout=BOARD_SLICE_S)
            except GetTimeoutError:
                if self.board is not board:
                    return None
                if self._stop.is_set():
                    raise
            except RayActorError:
                while self.board is board:  # its stall deadline (next()) bounds this wait
                    if self._stop.is_set():
                        raise
                    time.sleep(FEED_SLICE_S)
                return None

    def attach_board(self, board) -> None:
        self.board = board

    def _prepare(self) -> Batch | None:
        with Stopwatch() as pull:
            pulled = self._pull(self._next_version)
        if pulled is None:
            return None
        with Stopwatch() as collate:  # collate into a free slot and issue the copy
            batch = self._collate(*pulled)
        if batch is None:
            return None
        batch.pull_s, batch.collate_s = pull.s, collate.s
        self._next_version += 1
        return batch

    def _collate(self, fragments: list[F.Fragment], ticket_ids: list[int]) -> Batch | None:
        if self._slots is None:
            self._allocate(fragments[0])
        slot_id = None
        while slot_id is None:
            if self._stop.is_set():
                return None
            try:
                slot_id = self._free.get(timeout=FEED_SLICE_S)
            except queue.Empty:
                continue
        slot = self._slots[slot_id]
        offset = 0
        for frag in fragments:
            n = frag.num_samples
            for key in self.keys:
                np.copyto(slot.host_np[key][offset:offset + n], frag.flat(key))
            offset += n
        batch = Batch(
            tensors=slot.host,
            policy_versions=np.array([f.policy_version for f in fragments]),
            num_samples=offset,
            slot=slot_id,
            ticket_ids=tuple(ticket_ids),
        )
        if self._copy_stream is not None:
            mod = self.device.module
            batch.copy_start = mod.Event(enable_timing=True)
            batch.ready_event = mod.Event(enable_timing=True)
            with self.device.stream_context(self._copy_stream):
                batch.copy_start.record(self._copy_stream)
                for key in self.keys:
                    slot.dev[key].copy_(slot.host[key], non_blocking=True)
                batch.ready_event.record(self._copy_stream)
            batch.tensors = slot.dev
            batch.h2d_bytes = sum(t.numel() * t.element_size() for t in slot.host.values())
        return batch

    def _allocate(self, frag: F.Fragment) -> None:
        self.keys = F.train_keys(frag.arrays)
        n = self.fragments_per_batch * frag.num_samples
        specs = {k: ((n,) + frag.arrays[k].shape[2:], frag.arrays[k].dtype) for k in self.keys}
        pin = self.device is not None and self.device.is_accelerator
        self._slots = [_Slot(specs, self.device, pin) for _ in range(self._num_slots)]
        for i in range(self._num_slots):
            self._free.put(i)
