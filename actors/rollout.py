"""RolloutActor: the thin Ray shell that runs a ``RolloutSampler`` in a loop.

The loop runs on a background thread so the actor still answers ``stats`` and
``stop`` calls. Ray traffic is per fragment, never per step:

* one ``poll`` of the supply board (``pipeline/supply.py``) returns a block of
  tickets (each the right to make one fragment, naming the learner update that
  will train on it), newer weights if there are any, and a replacement shard if
  the actor's shard was replaced (``Poll`` and ``PollAnswer``; the clocks are
  ``pipeline/protocol.py``'s). A block is about ``BLOCK_S`` of fragments (at
  most ``TICKETS_PER_POLL``, or one full add), and never more than a fair share
  of what is free; weights load between polls, so every fragment comes from
  exactly one policy version, and the board sees one call per block;
* each fragment is sent to the replay shard on this node as soon as it is made
  if the previous ``add`` is acknowledged; while that add is still out, the
  next fragments wait and go together in one ``add_many`` (at most
  ``rollout.fragments_per_add``, then it waits for the ack, with a deadline).
  At most one add is in flight; adds grow only under load, so batching costs
  no latency while the shard keeps up.

Rate limit: no ticket, no fragment. The board issues tickets for update ``u``
only once policy ``u - max_policy_lag`` exists, ``per_update`` of them in all,
so production follows what the learners consume, whatever the number of
actors. Lag 1 gives full overlap (version v data is sampled while update v
runs and trained on by update v+1); at lag 0 the fragments of version v are
exactly update v's batch (rollouts wait while the learners update).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import ray
import torch

from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError

from actors import exit_guard
from actors.sampler import RolloutSampler, SamplerSettings
from pipeline import metric_keys as M
from pipeline import runtime
from pipeline.fragment import FragmentMeta
from pipeline.protocol import (ACTOR_RELAY_RETRY_S, BOARD_SLICE_S, RELAY_DEADLINE_S, SHUTDOWN_STOP_S, TICKET_WAIT_S,
                               TICKETS_PER_POLL, WATCH_SLICE_S, WATCH_START_S, Entry, Poll, WeightsWait,
                               block_size)
from pipeline.relay import RelayUnavailable

# TICKETS_PER_POLL is not used here (block_size applies it): the benches read it from this module.


class BoardReplaced(Exception):
    """The supply board this call went to is gone and the driver has attached a new one: tickets of the old one are
    void, so the loop starts its poll again."""


class Stopping(Exception):
    """stop() was called while the loop waited on the board: the answer is not waited for (tickets it may bring
    are given back by the driver's actor_gone)."""


class MemoryLimitExceeded(RuntimeError):
    """The actor's process passed rollout.memory_limit_mb (the supervisor replaces it)."""


class RolloutActor:
    def __init__(self, *, actor_id: int, shard, shard_index: int, board, sampler_settings: SamplerSettings,
                 policy_factory: Callable[[], torch.nn.Module], remote_preprocess=None, inference=None,
                 incarnation: int = 0, torch_threads: int = 1, stall_timeout_s: float = 120.0,
                 fragments_per_add: int = 1, ticket_blocks: bool = True, memory_limit_mb: int | None = None,
                 reward_scaler_state: dict | None = None, relay=None):
        torch.set_num_threads(torch_threads)
        exit_guard.install()  # an env's os._exit says so before the process ends (actors/exit_guard.py)
        self.actor_id = actor_id
        self.incarnation = incarnation
        self.shard = shard
        self.shard_index = shard_index
        self.shard_incarnation = 0
        self.board = board
        # This node's ticket relay (pipeline/relay.py), if the run has them: polls go there, and to the board itself
        # once the relay fails (it is never waited for past RELAY_DEADLINE_S beyond the poll's own wait).
        self.relay = self._relay_home = relay
        self._relay_retry_at: float | None = None  # when to try the relay again after it lost its board
        self.relay_fallbacks = 0
        self.relay_error: str | None = None  # why the relay was left
        self.stall_timeout_s = stall_timeout_s
        self.fragments_per_add = fragments_per_add
        self.ticket_blocks = ticket_blocks  # false: one ticket a poll (rollout.ticket_blocks)
        # The settings are plain values; the preprocess worker and the inference server are this actor's handles.
        self.sampler = RolloutSampler(sampler_settings, policy_factory, actor_id=actor_id,
                                      remote_preprocess=remote_preprocess, inference=inference)
        if reward_scaler_state is not None and self.sampler.reward_scaler is not None:
            self.sampler.reward_scaler.load(reward_scaler_state)  # a predecessor's, or the resumed run's
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._lock = threading.Lock()
        self._episodes: list[tuple] = []  # (return, length), with the policy index when there are several
        self.fragments_sent = 0
        self.weight_updates = 0
        # Where the loop's time goes, one Timings with the sampler's stages (actors/sampler.py), so that the names
        # partition the loop (pipeline/timing.py: a nested block counts for itself only): the sampler's env_step,
        # preprocess, forward and fragment; add (handing fragments to the shard), weights (fetching and loading
        # them), rate_limited (waiting for a ticket), backpressure (waiting for the previous add's ack). What is left
        # of the loop's wall time is its own book-keeping (``stats``: ``stage_s`` and ``wall_s``).
        self.timings = self.sampler.timings
        self._t_loop: float | None = None  # perf_counter() when the loop started
        self._t_loop_end: float | None = None
        self.fragments_lost = 0  # adds that failed with their shard (the board has them made again)
        self._failed: list = []  # tickets of failed adds, reported with the next poll
        # (shard incarnation, ticket) of every fragment sent whose update is not done: a shard acknowledges an add
        # once it holds it and confirms it with the board later, so if the shard dies first, these are the failed
        # adds (the board refunds the ones it never heard of, exactly once; those it had go back with the shard).
        self._sent: list[tuple] = []
        self._shard_dead = False  # an add failed with the shard we hold; waiting for the driver's replacement
        # Progress, for the supervisor's hang check: while a fragment is being made, when the env last stepped.
        self._making = False
        self._step_mark = (-1, time.monotonic())  # (sampler step index, when it was last seen to change)
        self.memory_limit_mb = memory_limit_mb
        self.board_changes = 0  # supply boards replaced under this actor
        self._fragment_s: float | None = None  # smoothed time to make one fragment (sizes the ticket blocks)

    def _apply(self, news) -> bool:
        """Load newer weights; False if they could not be read (their owner, learner rank 0, died with its group:
        the new group publishes others soon)."""
        if news is None:
            return True
        with self.timings.time("weights"):
            version, (weights_or_ref, *pool) = news
            try:
                weights = runtime.resolve(weights_or_ref, timeout=self.stall_timeout_s)
                if pool:  # self-play: the pool of past versions (learner rank 0's); fetch the snapshots not held
                    opponents = self.sampler.opponents
                    new = [(v, r) for v, r in pool[0] if v not in opponents.versions()] if opponents else []
                    states = runtime.get([r for _, r in new], timeout=self.stall_timeout_s) if new else []
            except ObjectLostError:  # OwnerDiedError and its kin
                return False
            # Rank 0's pool first: loading the weights into a pool that is not yet central would snapshot them
            # into it, a pool of the newest weights alone that anyone reading it meanwhile would see.
            if pool and self.sampler.opponents is not None:
                self.sampler.opponents.sync_pool([v for v, _ in pool[0]], {v: st for (v, _), st in zip(new, states)})
            self.sampler.load_weights(version, weights)
            self.weight_updates += 1
        return True

    def _apply_shard(self, change) -> None:
        if change is not None:
            self._shard_lost(self.shard_incarnation)  # replaced: the old one died (maybe with adds unconfirmed)
            self.shard_incarnation, self.shard = change
            self._shard_dead = False

    def _shard_lost(self, incarnation: int) -> None:
        """The shard of ``incarnation`` died: what was sent to it and its update is not done goes back as failed
        adds."""
        self._failed.extend(t for i, t in self._sent if i == incarnation)
        self._sent = [(i, t) for i, t in self._sent if i != incarnation]

    def attach_board(self, board) -> None:
        """The driver replaced the supply board (the loop notices at its next board call); the node's relay, which
        the driver attached to it too, gets another chance."""
        self.board = board
        self.relay = self._relay_home

    def _board_get(self, call, timeout_s: float):
        """``call(board)``'s result, waited for in short slices so that a board that died or stopped answering is
        left as soon as the driver attaches its replacement (BoardReplaced). Past ``timeout_s`` with no answer and
        no replacement, a one-line error."""
        board = self.board
        ref = call(board)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return runtime.get(ref, timeout=max(0.0, min(BOARD_SLICE_S, deadline - time.monotonic())))
            except GetTimeoutError:
                if self.board is not board:
                    raise BoardReplaced() from None
                if self._stop.is_set():
                    raise Stopping() from None
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"the supply board did not answer within run.stall_timeout_s = "
                                       f"{self.stall_timeout_s:.0f} s") from None
            except RayActorError:  # dead: wait for the driver's replacement, then start over with it
                while self.board is board:
                    if time.monotonic() >= deadline:
                        raise RuntimeError(f"the supply board died and no replacement came within "
                                           f"run.stall_timeout_s = {self.stall_timeout_s:.0f} s") from None
                    time.sleep(BOARD_SLICE_S / 5)
                raise BoardReplaced() from None

    def _poll(self, wait_s: float):
        failed, self._failed = self._failed, []
        # After an add failed with its shard, make nothing until the board names the replacement: every fragment
        # sent to the dead shard would be lost (and refunded) again.
        # The actor's stats travel with the poll (episodes drained into them): the driver reads every actor's from
        # the board in one call instead of calling each actor.
        report = self.stats()
        poll = Poll(self.actor_id, self.incarnation, self.sampler.policy_version, self.shard_index,
                    self.shard_incarnation, failed, wait_s, want_ticket=not self._shard_dead,
                    max_tickets=self._block_size(), report=report)
        if self.relay is None and self._relay_retry_at is not None and time.monotonic() >= self._relay_retry_at:
            self.relay, self._relay_retry_at = self._relay_home, None
        answer = self._relay_poll(poll) if self.relay is not None else None
        if answer is None:
            answer = self._board_get(lambda board: board.poll.remote(poll), wait_s + self.stall_timeout_s)
        self._apply_shard(answer.shard_change)
        if not self._apply(answer.news):
            # The tickets were issued for the version those weights carry: an older policy must not fill them.
            # They go back with the next poll.
            self._failed.extend(answer.tickets)
            return []
        return answer.tickets

    def _relay_poll(self, poll: Poll):
        """The poll through this node's relay, or None when it failed: the caller then polls the board itself with
        the same failed adds and report. A relay that lost its board is tried again after ACTOR_RELAY_RETRY_S (the
        driver attaches the replacement board to it); a dead or silent one only when the board is replaced."""
        relay = self.relay
        ref = relay.poll.remote(poll)
        deadline = time.monotonic() + poll.wait_s + RELAY_DEADLINE_S
        while True:
            try:
                return runtime.get(ref, timeout=max(0.0, min(BOARD_SLICE_S, deadline - time.monotonic())))
            except GetTimeoutError as e:
                if self._stop.is_set():
                    raise Stopping() from None
                if time.monotonic() < deadline:
                    continue
                error = e
            except Exception as e:  # noqa: BLE001 - dead, or cut off from its board: the board itself serves
                error = e
            if isinstance(error, RelayUnavailable):
                self._relay_retry_at = time.monotonic() + ACTOR_RELAY_RETRY_S
            self.relay = None
            self.relay_fallbacks += 1
            self.relay_error = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
            return None

    def _block_size(self) -> int:
        return block_size(self._fragment_s, self.fragments_per_add) if self.ticket_blocks else 1

    def _await_add(self, pending) -> None:
        """Wait for the previous add; if its shard died, the board makes those fragments again elsewhere."""
        ref, tickets, shard_incarnation = pending
        try:
            runtime.get(ref, timeout=self.stall_timeout_s)  # held there: the shard confirms it with the board
        except RayActorError:
            self.fragments_lost += len(tickets)
            self._shard_lost(shard_incarnation)  # this add's tickets and every unconfirmed one before it
            self._shard_dead = shard_incarnation == self.shard_incarnation  # not replaced yet
        except GetTimeoutError:
            raise RuntimeError(f"replay shard {self.shard_index} did not acknowledge a fragment within "
                               f"run.stall_timeout_s = {self.stall_timeout_s:.0f} s") from None

    def _first_weights(self) -> None:
        deadline = time.monotonic() + self.stall_timeout_s
        while self.sampler.policy_version < 0 and not self._stop.is_set():
            if time.monotonic() > deadline:
                raise RuntimeError(f"no policy weights on the supply board within run.stall_timeout_s = "
                                   f"{self.stall_timeout_s:.0f} s (learner rank 0 publishes them at set-up)")
            try:
                self._apply(self._board_get(lambda board: board.wait_newer.remote(WeightsWait(-1, TICKET_WAIT_S)),
                                            TICKET_WAIT_S + self.stall_timeout_s))
            except BoardReplaced:
                continue
            except Stopping:
                return

    def _loop(self) -> None:
        pending_add = None  # (ref, tickets, shard incarnation) of the add in flight: at most one
        made: list = []  # (ticket, fragment) made while that add was out, not sent yet
        self._t_loop = time.perf_counter()
        try:
            with self.timings.time("weights"):
                self._first_weights()
            while not self._stop.is_set():
                # Before asking for more: what was made goes now (the learners may be waiting for exactly these),
                # and the add in flight is settled, so a failed one is reported with this poll and the poll can park
                # (one poll per block: an ack takes milliseconds, a block about a second).
                if made:
                    pending_add, made = self._send(made, pending_add), []
                if pending_add is not None:
                    with self.timings.time("backpressure"):
                        self._await_add(pending_add)
                    pending_add = None
                tickets: list = []
                with self.timings.time("rate_limited"):
                    while not tickets and not self._stop.is_set():
                        # Answered at once when a ticket is free; otherwise the board parks the call until one is
                        # (the learners are behind) or TICKET_WAIT_S passes, so waiting costs no calls.
                        try:
                            tickets = self._poll(wait_s=TICKET_WAIT_S)
                        except Stopping:
                            break
                        except BoardReplaced:
                            # Every ticket of the dead board is void, failed adds' included: the new board's ledger
                            # starts from the learners' policy version with tickets of its own.
                            self._failed, self._sent, self._shard_dead, tickets = [], [], False, []
                            self.board_changes += 1
                if not tickets:
                    break
                # The block, one fragment at a time. A fragment goes at once if the previous add is acknowledged;
                # while it is out, the next ones wait and go together (at most fragments_per_add, then this waits
                # for the ack): one fragment per add while the shard keeps up, more only under load, so batching
                # costs no latency. A stop leaves the rest unmade (actor_gone refunds them).
                for k, ticket in enumerate(tickets):
                    if self._stop.is_set() or self._shard_dead:
                        # Its shard died under the block: the rest go back with the next poll, which waits for the
                        # replacement (everything sent to the dead shard would be lost again).
                        self._failed.extend(tickets[k:])
                        break
                    self._check_memory()
                    made.append((ticket, self._make_fragment()))
                    if (len(made) >= self.fragments_per_add or pending_add is None
                            or runtime.wait([pending_add[0]], timeout=0)[0]):
                        pending_add, made = self._send(made, pending_add), []
            if made:  # a graceful stop (scale-down) delivers what it made: it leaves no ticket to refund
                pending_add = self._send(made, pending_add)
            if pending_add is not None:
                with self.timings.time("backpressure"):
                    self._await_add(pending_add)
        except Exception as e:  # reported through stats(); the driver decides what to do
            self._error = f"{type(e).__name__}: {e}"
        finally:
            self._t_loop_end = time.perf_counter()

    def _make_fragment(self):
        self._making = True
        t0 = time.monotonic()
        fragment = self.sampler.collect()
        took = time.monotonic() - t0
        self._making = False
        # The newest fragments' time, smoothed: what the next block's size follows.
        self._fragment_s = took if self._fragment_s is None else 0.8 * self._fragment_s + 0.2 * took
        with self._lock:
            if len(fragment.episode_policies):  # several policies: (return, length, policy index)
                self._episodes.extend(zip(fragment.episode_returns.tolist(), fragment.episode_lengths.tolist(),
                                          fragment.episode_policies.tolist()))
            else:
                self._episodes.extend(zip(fragment.episode_returns.tolist(), fragment.episode_lengths.tolist()))
        return fragment

    def _send(self, made: list, pending_add):
        """Settle the previous add (at most one is out), then send ``made`` [(ticket, fragment)] in one add."""
        with self.timings.time("add"):
            with self.timings.time("backpressure"):
                if pending_add is not None:
                    self._await_add(pending_add)
            entries = [Entry(ticket, FragmentMeta.of(fragment), fragment) for ticket, fragment in made]
            self.fragments_sent += len(entries)
            done_below = self.sampler.policy_version  # updates below the newest policy are trained: forgotten
            self._sent = [(i, t) for i, t in self._sent if t.update >= done_below]
            self._sent.extend((self.shard_incarnation, t) for t, _ in made)
            ref = self.shard.add_many.remote(entries, producer=self.actor_id, ack="held")
        return ref, [t for t, _ in made], self.shard_incarnation

    def rss_mb(self) -> float:
        """This process's resident memory (Linux /proc; 0 where there is none)."""
        return runtime.process_rss_mb()

    def _check_memory(self) -> None:
        # Checked here before each fragment, and by the supervisor on every stats answer (rss_mb): a leaking env is
        # stopped while its host still has room, and the actor replaced as a crashed one is.
        if self.memory_limit_mb is not None and (rss := self.rss_mb()) > self.memory_limit_mb:
            raise MemoryLimitExceeded(f"rollout actor {self.actor_id} uses {rss:.0f} MiB, over "
                                      f"rollout.memory_limit_mb = {self.memory_limit_mb}")

    def no_progress_s(self) -> float:
        """Seconds since the env last stepped while a fragment is being made (0 while waiting for a ticket or an
        add: those waits have deadlines of their own)."""
        now = time.monotonic()
        step = self.sampler.step_index
        if step != self._step_mark[0] or not self._making:
            self._step_mark = (step, now)
        return now - self._step_mark[1] if self._making else 0.0

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"rollout-{self.actor_id}", daemon=True)
            self._thread.start()

    def opponent_pool(self) -> list[int] | None:
        """The policy versions of the self-play pool this actor's other seats are drawn from (None: no pool)."""
        opponents = self.sampler.opponents
        return None if opponents is None or not opponents.self_play else [s.version for s in opponents.pool]

    def loop_time(self) -> tuple[float, dict[str, float]]:
        """(seconds the loop has run, seconds of each stage in them: ``metric_keys.ROLLOUT_STAGES``), read together so
        that a wait still in progress counts in both."""
        now = time.perf_counter()
        timed = self.timings.snapshot(now)
        if self._t_loop is None:
            return 0.0, {}
        return (self._t_loop_end or now) - self._t_loop, {stage: timed.get(stage, 0.0)
                                                          for stage, _, _ in M.ROLLOUT_STAGES if stage != "other"}

    def stats(self) -> dict:
        """Counters, plus the episodes finished since the previous call (drained)."""
        with self._lock:
            episodes, self._episodes = self._episodes, []
        wall_s, stage_s = self.loop_time()
        return {
            "actor_id": self.actor_id,
            "incarnation": self.incarnation,
            "wall_s": wall_s,
            "stage_s": stage_s,
            "env_steps": self.sampler.env_steps,
            "sample_s": self.sampler.sample_seconds,
            "fragments_sent": self.fragments_sent,
            "policy_version": self.sampler.policy_version,
            "weight_updates": self.weight_updates,
            "backpressure_s": stage_s.get("backpressure", 0.0),
            "rate_limited_s": stage_s.get("rate_limited", 0.0),
            "fragments_lost": self.fragments_lost,
            "episodes": episodes,
            "pipeline": self.sampler.pipeline_stats(),
            "error": self._error,
            # Sandboxed env children replaced, cumulative (the board keeps only an actor's newest report), and the last.
            **dict(zip(("env_faults", "env_fault_last"), self.sampler.env_faults())),
            "running": self._thread is not None and self._thread.is_alive(),
            "no_progress_s": self.no_progress_s(),
            "reward_scaler": None if self.sampler.reward_scaler is None else self.sampler.reward_scaler.state(),
            "rss_mb": self.rss_mb(),
            "board_changes": self.board_changes,
            "relay_fallbacks": self.relay_fallbacks,
            "relay_error": self.relay_error,
            # rollout.inference: remote: steps the node's inference server answered, and those the local copy
            # served because it failed or was late (inference_fallbacks), with the last failure.
            **self.sampler.inference_stats(),
        }

    @ray.method(concurrency_group="watch")
    def until_done(self) -> dict:
        """Returns (its final stats, with the error that ended it, if any) when the loop ends; fails with
        RayActorError when the process dies. The driver keeps one of these out per actor and looks at it without a
        call: a death or a failed loop is seen at the next look, whatever the actor count."""
        while self._thread is None or self._thread.is_alive():
            if self._thread is None:
                time.sleep(WATCH_START_S)  # not started yet
            else:
                self._thread.join(timeout=WATCH_SLICE_S)
        return self.stats()

    def stop(self, timeout_s: float = SHUTDOWN_STOP_S) -> None:
        """Stop after the fragment in hand is delivered (within ``timeout_s``); the driver kills the actor after
        this returns, so a loop blocked in its env or on a shard is not waited for longer."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        if self._thread is None or not self._thread.is_alive():
            self.sampler.close()


# No GCS task records for the health calls (see pipeline/replay.py). "watch": until_done waits beside the calls of the
# default group (start, stats, stop), each group one thread.
RemoteRolloutActor = ray.remote(max_restarts=0, enable_task_events=False,
                                concurrency_groups={"watch": 1})(RolloutActor)
