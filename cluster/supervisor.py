"""Supervision of the actor graph: health checks, replacements, live scaling (``docs/failures.md``: every fault,
what happens and what is counted).

A rollout actor that fails in any way (its loop raised, its process died, it made no env step or left its health
call unanswered for one ticket lease, it passed ``rollout.memory_limit_mb``) is replaced at the same id, on its node
if that node is still there, and the supply board is told, so exactly the fragments it had not delivered are made
again. Two rules keep a real bug from looping: ``rollout.max_env_failures`` faults per run, and ``REPEAT_LIMIT``
fresh actors in a row failing the same way before their first fragment; either ends the run with one line. A
replay shard that dies or hangs is replaced the same way. A learner that dies takes its whole group down (the
others would hang in the all-reduce); the group restarts from the newest checkpoint, up to
``run.max_learner_restarts`` times in a row without an update in between. The rollout actor count follows the
control actor (``python -m cluster.control``); actors that do not fit the free resources are refused in one line.

Every wait here has a deadline, and the driver's calls do not grow with the rollout actor count: the actors' stats
come with their board polls (one board call reads them all), a death shows in each actor's ``until_done`` call
(looked at without a call), and only an actor silent for ``SILENT_S`` gets a health call, at most
``HEALTH_CALLS_PER_S`` over all actors. A rollout actor's record is its ``cluster.graph.RolloutSlot``, a replay
shard's a ``Member`` kept here with the same health fields: one watch pass (``Supervisor._watch_pass``) serves both
kinds through the hooks of ``_Kind``. The supply board and the control actor are watched by the driver's calls to
them, each with its own deadline (BOARD_CALL_S, CONTROL_CALL_S); a new supply board is wired to the survivors by
``ActorGraph.replace_board``.
"""

from __future__ import annotations

import collections
import functools
import time
import types
from dataclasses import dataclass
from typing import Callable, Mapping

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from cluster import placement
from cluster.autoscale import RolloutAutoscaler
from cluster.config import Config
from cluster.graph import ActorGraph, RolloutSlot, free_resources, kill_quietly, reward_scaler_for
from cluster.records import RunState
from pipeline import runtime
# Its clocks are the protocol's (pipeline/protocol.py, LIMITS: each with the invariant it protects), read by name here.
from pipeline.protocol import (BOARD_CALL_S, CONTROL_CALL_S, HEALTH_CALLS_PER_S, LEARNER_ALIVE_S, LEARNER_PING_S,
                               SCALE_DOWN_STOP_S, SCALE_DOWN_WAIT_S, SILENT_S, ActorGone)

#: Fresh rollout actors failing with the same error before their first fragment, this many times in a row, end the
#: run: a replacement would fail the same way (an env that cannot run on this host, a bug hit at the first step).
REPEAT_LIMIT = 3

_UNPLACEABLE = tuple(e for e in (getattr(ray.exceptions, "ActorUnschedulableError", None),) if e is not None)


class CallPacer:
    """At most ``per_s`` calls a second, with a burst of one second's worth (a token bucket)."""

    def __init__(self, per_s: float):
        self.per_s = per_s
        self._tokens, self._clock = float(per_s), time.monotonic()

    def take(self, now: float) -> bool:
        """True (and one call spent) if a call may be made now."""
        self._tokens = min(self.per_s, self._tokens + self.per_s * (now - self._clock))
        self._clock = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


class RolloutFailed(RuntimeError):
    """The run ends because of its rollout actors: the fault budget is spent, or fresh actors keep failing the same
    way, or a replacement cannot be placed. The message is the one line the CLI prints."""


class BoardReplacementFailed(RolloutFailed):
    """The supply board was lost and its replacement could not be wired up: a shard or a learner (dead, stopped,
    its host unreachable) or the new board itself did not answer in time. The message names each that did not."""


@dataclass(eq=False)
class Member:
    """What the supervisor knows of one replay shard in its current incarnation (``_watch_pass`` reads the fields it
    shares with a ``RolloutSlot``). A replacement is a fresh record that carries over only what must outlive a
    process."""

    handle: object  # the shard its calls go to (also the graph's handle at its index)
    incarnation: int = 0  # replacements at its index so far
    watch: object = None  # its until_dead call, which resolves when it dies; never waited on
    heard: float | None = None  # when its watch began
    asked: tuple | None = None  # (its unanswered health call, when it was sent): one out at a time
    starting: tuple | None = None  # always None: a shard answers calls as soon as it is made
    stats: dict | None = None  # its newest stats answer


class _Kind:
    """One kind of watched actor for ``Supervisor._watch_pass``: its records (``members``: index -> record), the
    pace of its health calls, and the hooks where the kinds differ. ``watch(handle)``: the call that resolves when
    it ends or dies; ``due(now)``: who may get a health call now, first first; ``hang_after()``: how long one may go
    unanswered; what it means when member ``i``'s watch resolved (``ended``), it answered (``answered``), a call
    failed because it died (``died``) or a health call went unanswered for ``limit`` s (``hung``)."""

    watch_calls: str | None = None  # the ``calls`` key that counts its watch calls (None: not counted)
    health_calls = "health"  # the ``calls`` key that counts its health calls

    def __init__(self, sup: "Supervisor"):
        self.sup = sup
        self.pace = CallPacer(HEALTH_CALLS_PER_S)

    def sent(self, i: int) -> None:
        """A health call went to member ``i``."""


class _RolloutActors(_Kind):
    """Rollout actors: only one silent on the board for SILENT_S gets a health call, the longest silent first; one
    that leaves it unanswered for a ticket lease (stopped, or holding the GIL in native code) is a hung one."""

    watch_calls = "until_done"  # once per actor incarnation

    @property
    def members(self) -> dict[int, RolloutSlot]:
        """The graph's slots themselves: the graph makes, replaces and removes them; the watch writes their health."""
        return self.sup.graph.slots

    def watch(self, handle):
        return handle.until_done.remote()

    def due(self, now: float) -> list[int]:
        # An actor stuck inside its env answers health calls but polls no more: it is asked again on every look
        # until it polls or its lease runs out.
        return [i for _, i in sorted((m.heard, i) for i, m in self.members.items()
                                     if m.heard is not None and now - m.heard > SILENT_S)]

    def hang_after(self) -> float:
        return self.sup.lease_s()

    def ended(self, i: int, ref) -> None:
        st = self.sup._answer(self, i, ref)
        if st is not None and not self.sup._judge(i, st) and not st["running"]:  # only a stop ends a loop cleanly
            self.sup._replace(i, "death", "stopped making fragments (its loop ended)")

    def answered(self, i: int, stats: dict) -> None:
        self.sup._judge(i, stats)

    def died(self, i: int, error: BaseException) -> None:
        self.sup._replace(i, "death", f"died ({type(error).__name__})")

    def hung(self, i: int, limit: float) -> None:
        self.sup._replace(i, "hang", f"did not answer its health call for {limit:.0f} s (rollout.fragment_timeout_s)")


class _ReplayShards(_Kind):
    """Replay shards: health calls go round the shards (their stats are the records' replay depth); one unanswered
    for the board deadline is a hung shard."""

    health_calls = "shard_health"

    def __init__(self, sup: "Supervisor"):
        super().__init__(sup)
        self.members: dict[int, Member] = {}
        self.next = 0  # where the round robin of health calls goes on from

    def watch(self, handle):
        return handle.until_dead.remote()

    def due(self, now: float) -> list[int]:
        k = len(self.members)
        return [(self.next + step) % k for step in range(k)]

    def sent(self, i: int) -> None:
        self.next = (i + 1) % len(self.members)

    def hang_after(self) -> float:
        return self.sup.board_deadline_s()

    def died(self, i: int, _) -> None:
        self.sup._replace_shard(i, "died")

    ended = died  # a shard's watch (until_dead) resolves only when it dies

    def answered(self, i: int, stats: dict) -> None:
        self.members[i].stats = stats

    def hung(self, i: int, limit: float) -> None:
        self.sup._replace_shard(i, f"did not answer for {limit:.0f} s")


class Supervisor:
    """Watches ``graph`` and folds what it sees into ``state``; ``say``: the driver's stderr line."""

    def __init__(self, cfg: Config, graph: ActorGraph, state: RunState, say: Callable[[str], None]):
        self.cfg, self.graph, self.state, self.say = cfg, graph, state, say
        self.rollouts = _RolloutActors(self)  # rollout actor id -> its slot (the graph's)
        self.shards = _ReplayShards(self)  # shard index -> its record
        self.calls: collections.Counter = collections.Counter()  # the driver's calls about actors and shards, by kind
        # rollout.num_actors: auto. Never past replay_bound actors: no more tickets than that exist at once, so an
        # actor beyond it could only wait (at max_policy_lag 0 the learners wait by design, and would ask for more).
        ro = cfg.rollout
        self.autoscaler = (RolloutAutoscaler(ro.min_actors, max(ro.min_actors, min(ro.max_actors, cfg.replay_bound)),
                                             ro.autoscale_host_bound, ro.autoscale_window)
                           if cfg.autoscale_rollouts else None)
        self.learner_restarts_in_a_row = 0  # set back to 0 by every completed update (iteration_done)
        self._board_first_rss_mb: float | None = None  # the current supply board's RSS at its first stats answer
        self._board_limit_warned = False  # a limit under a fresh board's size is said once a run

    @property
    def rollout_stats(self) -> Mapping[int, dict]:
        """Rollout actor id -> the newest stats of its current incarnation (what the records are made from); read
        only: the stats live in the slots, so a write here would be lost, and raises instead."""
        return types.MappingProxyType({i: m.stats for i, m in sorted(self.rollouts.members.items())
                                       if m.stats is not None})

    # ------------------------------------------------------------------ the watch, every kind
    def _watch_pass(self, kind: _Kind, now: float) -> None:
        """One look at every member of ``kind`` (the watch of the module docstring); nothing here waits. Health
        calls are paced over the kind, one out per member; what each sighting means is the kind's hook, which folds
        the answer or replaces the member (a new record at the same index)."""
        members = kind.members
        for i, m in sorted(members.items()):
            if m.watch is None and m.starting is None:
                if kind.watch_calls:
                    self.calls[kind.watch_calls] += 1
                m.watch = kind.watch(m.handle)
                if m.heard is None:
                    m.heard = now
        watching = {i: m for i, m in sorted(members.items()) if m.watch is not None}
        if watching:
            refs = [m.watch for m in watching.values()]
            done = set(runtime.wait(refs, num_returns=len(refs), timeout=0)[0])
            for i, m in watching.items():
                if m.watch in done and members.get(i) is m:
                    ref, m.watch = m.watch, None
                    kind.ended(i, ref)
        limit = kind.hang_after()
        for i in kind.due(now):
            m = members[i]
            if m.asked is not None or m.starting is not None:
                continue
            if not kind.pace.take(now):
                break
            self.calls[kind.health_calls] += 1
            m.asked = (m.handle.stats.remote(), now)
            kind.sent(i)
        for i, m in sorted(((i, m) for i, m in members.items() if m.asked is not None),
                           key=lambda e: (e[1].asked[1], e[0])):  # oldest call first
            if members.get(i) is not m:
                continue  # replaced earlier in this look
            ref, sent = m.asked
            if not runtime.wait([ref], timeout=0)[0]:
                if now - sent > limit:
                    kind.hung(i, limit)
                continue
            m.asked = None
            st = self._answer(kind, i, ref)
            if st is not None:
                kind.answered(i, st)

    def _answer(self, kind: _Kind, i: int, ref) -> dict | None:
        """The stats a finished call of member ``i`` returned; None if the call failed because the member died (it
        is replaced here)."""
        try:
            return runtime.get(ref, timeout=0)
        except (RayActorError, *_UNPLACEABLE) as e:
            kind.died(i, e)
            return None

    # ------------------------------------------------------------------ rollout actors
    def lease_s(self) -> float:
        """The ticket lease in force (the board's: fixed, or derived from the measured fragment times)."""
        fixed = self.cfg.rollout.fragment_timeout_s
        return float(self.state.board.get("lease_s", 10.0)) if fixed == "auto" else float(fixed)

    def poll_rollouts(self) -> None:
        """Fold in every rollout actor's finished episodes and counters (one board call reads every actor's stats,
        then the watch pass); replace the failed, dead and hung."""
        now = time.monotonic()
        self._check_starting(now)
        self.calls["actor_reports"] += 1
        reports = self._tell_board(lambda board: board.actor_reports.remote()) or {}
        for i, (incarnation, st) in reports.items():
            m = self.rollouts.members.get(i)
            if m is not None and incarnation == m.incarnation and m.starting is None:
                m.heard = now
                self._judge(i, st)
        self._watch_pass(self.rollouts, now)

    def _judge(self, i: int, st: dict) -> bool:
        """Fold one stats answer of actor ``i`` and replace it if the answer says it failed, hangs in its env or
        is over its memory limit. Returns whether it was replaced."""
        self._fold(i, st)
        lease, limit = self.lease_s(), self.cfg.rollout.memory_limit_mb
        if st["error"]:
            kind = "memory" if st["error"].startswith("MemoryLimitExceeded") else "env"
            self._replace(i, kind, f"failed: {st['error']}")
        elif st["no_progress_s"] > lease:
            self._replace(i, "hang", f"made no env step for {st['no_progress_s']:.0f} s "
                                     f"(rollout.fragment_timeout_s = {lease:.0f} s)")
        elif limit is not None and not self.graph.inprocess and st["rss_mb"] > limit:
            self._replace(i, "memory", f"uses {st['rss_mb']:.0f} MiB, over rollout.memory_limit_mb = {limit}")
        else:
            return False
        return True

    def _fold(self, i: int, st: dict) -> None:
        state, m = self.state, self.rollouts.members[i]
        m.steps = st["env_steps"]
        state.window.extend(episode[0] for episode in st["episodes"])
        names = list(self.cfg.multiagent.policies)
        for episode in st["episodes"]:
            if len(episode) > 2:  # several policies: (return, length, the index of the policy that played it)
                state.policy_window(names[episode[2]]).append(episode[0])
        state.episodes_total += len(st["episodes"])
        # Sandboxed env children replaced, the actor going on: the count is the incarnation's so far (a replaced
        # actor's record starts without stats).
        new_faults = st.get("env_faults", 0) - (m.stats or {}).get("env_faults", 0)
        if new_faults > 0:
            state.env_failures += new_faults
            state.last_rollout_fault = f"rollout actor {i} {st['env_fault_last']}"
        m.stats = st
        if st.get("reward_scaler") is not None:
            state.reward_scalers[i] = st["reward_scaler"]
        if st["fragments_sent"] > 0:
            m.produced, m.repeats = True, ("", 0)

    def _replace(self, i: int, kind: str, why: str) -> None:
        """Replace rollout actor ``i`` after a fault of ``kind`` (env, death, hang, memory), or end the run when a
        guard says a replacement would only fail again."""
        state, graph, cfg = self.state, self.graph, self.cfg
        # Its slot stays at the index until its successor's takes it over (nothing looks at it meanwhile), so a
        # late answer of its calls is never looked at, and the graph's count of actors does not change.
        old = self.rollouts.members[i]
        state.rollout_restarts += 1
        if kind == "env":
            state.env_failures += 1
        elif kind == "hang":
            state.rollout_hangs += 1
        elif kind == "memory":
            state.rollout_memory_kills += 1
        state.last_rollout_fault = f"rollout actor {i} {why}"
        # The repeat rule compares what went wrong without the details that differ per process (pids, addresses).
        fault = why if kind == "env" else kind
        last, n = old.repeats
        repeats = ("", 0) if old.produced else (fault, n + 1 if last == fault else 1)
        kill_quietly(old.handle)  # a hung or stopped process must not come back with a late fragment
        self._retire(old)
        # Its tickets with no stored fragment go to the others; a late add of it is refused.
        self._tell_board(lambda board: board.actor_gone.remote(ActorGone(i, old.incarnation)))
        faults = state.rollout_restarts
        if repeats[1] >= REPEAT_LIMIT:
            raise RolloutFailed(f"rollout actor {i} {why}; {REPEAT_LIMIT} fresh actors in a row failed so before "
                                f"their first fragment, so a replacement would too")
        if faults > cfg.rollout.max_env_failures:
            raise RolloutFailed(f"rollout actor {i} {why}; that is fault {faults}, over rollout.max_env_failures = "
                                f"{cfg.rollout.max_env_failures}")
        fixed = graph.ensure_preprocess_worker(i)
        if fixed:
            state.preprocess_restarts += 1
            self.say(f"{fixed}; replaced (restart {state.preprocess_restarts})")
        slot = graph.add_rollout(i, iteration=state.iteration, replacement=True,
                                 reward_scaler_state=reward_scaler_for(state.reward_scalers, i))
        slot.repeats = repeats
        slot.starting = (slot.handle.start.remote(), time.monotonic(), "replacement")
        self.say(f"rollout actor {i} {why}; replaced (fault {faults} of at most {cfg.rollout.max_env_failures}: "
                 f"{state.env_failures} env failures, {state.rollout_hangs} hangs, "
                 f"{state.rollout_memory_kills} over memory)")

    def _retire(self, slot: RolloutSlot) -> None:
        """``slot``'s actor is gone: its env steps become the run's retired ones, counted once."""
        self.state.env_steps_retired += slot.steps
        slot.steps = 0

    def _check_starting(self, now: float) -> None:
        """Actors being created: up, or past the start deadline (Ray found no room for them), oldest start first."""
        members = self.rollouts.members
        starting = sorted(((i, m) for i, m in members.items() if m.starting is not None),
                          key=lambda e: (e[1].starting[1], e[0]))
        for i, m in starting:
            if members.get(i) is not m:
                continue  # removed earlier in this pass (_refuse_from takes every added actor from its index on)
            ref, since, why = m.starting
            if runtime.wait([ref], timeout=0)[0]:
                m.starting = None
                try:
                    runtime.get(ref, timeout=0)
                except (RayActorError, *_UNPLACEABLE) as e:
                    # Dead before it started (its __init__ raised: the env cannot be made on that host).
                    self._replace(i, "death", f"died while starting ({str(e).strip().splitlines()[-1][:300]})")
                continue
            if now - since <= self.cfg.run.startup_timeout_s:
                continue
            if why == "replacement":
                raise RolloutFailed(f"a replacement for rollout actor {i} did not start within run.startup_timeout_s "
                                    f"= {self.cfg.run.startup_timeout_s:g} s: Ray has not placed it; free now: "
                                    f"{free_resources()}")
            self._refuse_from(i, f"did not start within run.startup_timeout_s = {self.cfg.run.startup_timeout_s:g} s")

    # ------------------------------------------------------------------ shards and the supply board
    def poll_shards(self) -> list[dict]:
        """Each shard's newest answer (fresh every pass up to ``HEALTH_CALLS_PER_S`` shards); a dead or hung shard is
        replaced, and the board has exactly the fragments it held (and nobody had claimed) made again. Nothing here
        waits but the board's stats call."""
        for i, handle in enumerate(self.graph.shards):  # a record for each shard built with the graph
            self.shards.members.setdefault(i, Member(handle))
        self._watch_pass(self.shards, time.monotonic())
        board = self._tell_board(lambda board: board.stats.remote())
        if board is not None:
            self.state.board = board
            self._check_board_memory(board.get("rss_mb", 0.0))
        members = self.shards.members
        return [members[i].stats if members[i].stats is not None else {"depth": 0, "added": 0}
                for i in range(len(self.graph.shards))]

    def _replace_shard(self, i: int, why: str) -> None:
        """A new shard at index ``i`` (its node if alive, else any with room); the board refunds what it held."""
        state, graph = self.state, self.graph
        state.shard_restarts += 1
        old = self.shards.members.pop(i)
        kill_quietly(old.handle)  # a hung shard is treated as dead
        graph.shards[i] = shard = graph.make_shard(i, replacement=True)
        # The old shard's newest stats stand for its index until the new one answers a health call.
        self.shards.members[i] = Member(shard, old.incarnation + 1, stats=old.stats)
        refunded = self._tell_board(lambda board: board.register_shard.remote(i, graph.shards[i]))
        self.say(f"replay shard {i} {why} holding {refunded if refunded is not None else 'its'} unclaimed "
                 f"fragments; replaced, and those are made again (restart {state.shard_restarts})")

    def _watched_call(self, actor, call, deadline_s: float, replace: Callable[[BaseException], None]):
        """``call(actor)``'s answer (the driver's calls are the watch of the supply board and the control actor), or
        None when ``actor`` is dead or does not answer within ``deadline_s``: then ``replace(error)``."""
        try:
            return runtime.get(call(actor), timeout=deadline_s)
        except (RayActorError, GetTimeoutError, *_UNPLACEABLE) as e:
            replace(e)
            return None

    def _tell_board(self, call):
        """``call(supply board)``'s answer, or None when the board is dead or silent: then it is replaced here, which
        voids every ticket and re-registers every shard, so what the call would have told it no longer matters."""
        return self._watched_call(self.graph.board, call, self.board_deadline_s(), lambda e: self.replace_board(
            f"died ({type(e).__name__})" if not isinstance(e, GetTimeoutError)
            else f"did not answer for {self.board_deadline_s():.0f} s"))

    def board_deadline_s(self) -> float:
        """How long the supply board may take to answer the driver before it is a hung one: well inside the
        learners' stall deadline, so it is replaced before they give up on it."""
        return min(BOARD_CALL_S, self.cfg.run.stall_timeout_s / 3)

    def control_deadline_s(self) -> float:
        """How long the control actor may take to answer the driver, whose loop waits on the call meanwhile: no
        longer than a board call holds it."""
        return min(CONTROL_CALL_S, self.cfg.run.stall_timeout_s / 3)

    def _check_board_memory(self, rss_mb: float) -> None:
        """run.board_memory_limit_mb: a board past it is replaced, one whose growth the limit can bound: a board
        already over it at its first answer would only be replaced again and again, so that gets one warning a run."""
        limit = self.cfg.run.board_memory_limit_mb
        if limit is None or self.graph.inprocess or rss_mb <= 0:
            return
        if self._board_first_rss_mb is None:
            self._board_first_rss_mb = rss_mb
            if rss_mb > limit and not self._board_limit_warned:
                self._board_limit_warned = True
                self.say(f"warning: the supply board uses {rss_mb:.0f} MiB at its start, over run.board_memory_limit_mb"
                         f" = {limit}: not enforced (allowed: above a fresh board's size, or null)")
        elif rss_mb > limit >= self._board_first_rss_mb:
            self.state.board_memory_replacements += 1
            self.replace_board(f"uses {rss_mb:.0f} MiB, over run.board_memory_limit_mb = {limit}")

    def replace_board(self, why: str) -> None:
        """A new supply board from what survives (``ActorGraph.replace_board`` wires it up, in the order the
        protocol needs). The dead board's tickets are all void; its counters are folded into the run's, and what it
        had in flight is counted as voided and made again under the new ledger."""
        state = self.state
        in_flight = int(state.board.get("in_flight", 0))
        state.fold_board(state.board)
        state.board_restarts += 1
        voided, version = self.graph.replace_board(functools.partial(self._answers, why))
        state.board_voided += voided + in_flight
        self.say(f"the supply board {why}; replaced (restart {state.board_restarts}): {voided} stored fragments "
                 f"and ~{in_flight} tickets in flight voided and made again, from policy version {version}")
        state.board = {}
        self._board_first_rss_mb = None

    def _answers(self, why: str, refs: list, names: list[str], board_starting: bool) -> list:
        """The answers of ``refs`` (one call to each of ``names``) within one deadline for all of them, while the
        supply board that ``why`` is replaced. A call unanswered by then (a stopped process, an unreachable host) or
        failed with its actor ends the run: the new board cannot be wired up without every shard and learner."""
        if board_starting:  # the new board's first answers wait for its process to start as well
            timeout = max(BOARD_CALL_S, self.cfg.run.stall_timeout_s)
            timeout_why = f"{timeout:g} s (max({BOARD_CALL_S:g} s, run.stall_timeout_s), its start included)"
        else:  # the shards and learners are up and answer in milliseconds: the driver's deadline for a board call
            timeout = self.board_deadline_s()
            timeout_why = f"{timeout:g} s (min({BOARD_CALL_S:g} s, run.stall_timeout_s / 3))"
        ready = set(runtime.wait(refs, num_returns=len(refs), timeout=timeout)[0])
        faults, out = [], []
        for ref, name in zip(refs, names):
            if ref not in ready:
                faults.append(f"{name} did not answer within {timeout_why}")
                continue
            try:
                out.append(runtime.get(ref, timeout=0))
            except (RayActorError, *_UNPLACEABLE) as e:
                faults.append(f"{name} died ({type(e).__name__})")
            except Exception as e:  # noqa: BLE001 - the call raised: the run still ends in one line, naming it
                faults.append(f"{name} failed ({type(e).__name__}: {' '.join(str(e).split())[:200]})")
        if faults:
            raise BoardReplacementFailed(f"the supply board {why} and could not be replaced: "
                                         f"{'; '.join(dict.fromkeys(faults))}; resume with --resume "
                                         f"{self.graph.files.root}")
        return out

    # ------------------------------------------------------------------ scaling
    def apply_control(self) -> None:
        """Grow or shrink the rollout actor set to what the control actor asks for. Growth takes what fits the
        free resources now; the rest is refused with one line (and the control actor told)."""
        graph, state, cfg = self.graph, self.state, self.cfg
        desired = self._ask_control(lambda actor: actor.desired.remote(), running=len(graph.rollouts))
        if desired is None:
            return
        want = desired["rollout_actors"]
        have = len(graph.rollouts)
        if want == have:
            return
        if want > have:
            pinned = graph.plan.rollout_nodes[0] is not None
            fits = self.room_for(want - have)
            if pinned:  # new actors go to the CPU hosts with the most room, over every CPU host
                nodes = placement.assign_added_rollouts(cfg, graph.plan, graph.plan.rollout_nodes[:have], fits)
                fits = len(nodes)
            if fits < want - have:
                self.say(f"rollout actors: {want} asked, but only {fits} more fit the free resources "
                         f"({cfg.rollout.num_cpus_per_actor:g} CPU each{' on the CPU hosts' if pinned else ''}; "
                         f"free now: {free_resources()}); running {have + fits}")
                want = have + fits
                self._ask_control(lambda actor: actor.applied.remote(want), running=want)
                if fits == 0:
                    return
            if pinned:
                graph.plan.rollout_nodes[have:] = nodes  # the places of actors removed earlier are free again
            for i in range(have, want):
                slot = graph.add_rollout(i, iteration=state.iteration,
                                         reward_scaler_state=reward_scaler_for(state.reward_scalers, i))
                slot.starting = (slot.handle.start.remote(), time.monotonic(), "added")
        else:
            self._remove_from(want)
        self._tell_board(lambda board: board.expect_actors.remote(len(graph.rollouts)))  # the fair share's count
        self.say(f"rollout actors: {have} -> {want}")

    def room_for(self, n: int) -> int:
        """How many of ``n`` new rollout actors the free resources hold (all of them in process)."""
        per = self.cfg.rollout.num_cpus_per_actor
        if self.graph.inprocess or per <= 0:
            return n
        return min(n, int(ray.available_resources().get("CPU", 0.0) // per))

    def autoscale(self, record: dict) -> int | None:
        """rollout.num_actors: auto: fold this iteration's record into the autoscaler; the count it asked the control
        actor for, when its window calls for a change (applied at the next iteration, as a cluster.control request
        is), else None."""
        if self.autoscaler is None:
            return None
        have = len(self.graph.rollouts)
        decision = self.autoscaler.observe(record, have, self.room_for)
        if decision is None:
            return None
        try:
            err = runtime.get(self.graph.control.set_rollout_actors.remote(decision.want),
                              timeout=self.control_deadline_s())
        except (RayActorError, GetTimeoutError, *_UNPLACEABLE):
            return None  # the control actor is replaced at the next apply_control; the next window decides again
        if err:
            self.say(f"rollout actors: autoscale to {decision.want} refused: {err}")
            return None
        self.say(f"rollout actors: autoscale {have} -> {decision.want}: {decision.why}")
        return decision.want

    def _remove_from(self, first: int) -> None:
        """Stop and remove rollout actors ``first`` and up."""
        gone = self.graph.remove_rollouts(first)  # their slots, repeat counts included: a new actor starts afresh
        try:  # each delivers the fragment it is making, so nothing needs to be made again
            runtime.get([s.handle.stop.remote(timeout_s=SCALE_DOWN_STOP_S) for s in gone], timeout=SCALE_DOWN_WAIT_S)
        except Exception:  # noqa: BLE001 - stuck or dead: killed below either way, and its tickets refunded
            pass
        for s in gone:
            runtime.kill(s.handle)
            self._retire(s)
            # Tickets it held without a stored fragment go to the others; a late add of it is refused.
            self._tell_board(lambda board: board.actor_gone.remote(ActorGone(s.index, s.incarnation)))

    def _refuse_from(self, i: int, why: str) -> None:
        """Added actors from ``i`` on never started: remove them, say so, and settle the control actor."""
        have = len(self.graph.rollouts)
        self._remove_from(i)
        self.say(f"rollout actors: {have - i} added actor(s) {why}: Ray has not placed them (free now: "
                 f"{free_resources()}); running {i}")
        self._ask_control(lambda actor: actor.applied.remote(i), running=i)

    def _ask_control(self, call, running: int):
        """``call(control actor)``'s answer, or None when it is dead or does not answer within
        ``control_deadline_s``: then it is replaced by one asking for ``running`` rollout actors (the count the run
        is going on with). It only holds that count, so nothing else is lost with it, and the run never ends for it."""
        def replace(error: BaseException) -> None:
            graph = self.graph
            kill_quietly(graph.control)  # a stopped one must not wake up with an old count, under the name
            graph.control = graph.make_control(rollout_actors=running)
            self.state.control_restarts += 1
            self.say(f"the control actor {'did not answer' if isinstance(error, GetTimeoutError) else 'died'}; "
                     f"replaced, asking for the {running} rollout actors running now")

        return self._watched_call(self.graph.control, call, self.control_deadline_s(), replace)

    # ------------------------------------------------------------------ learners
    def unanswering_learner(self) -> str | None:
        """A learner that does not answer its health call (SIGSTOPped, its host gone quiet, wedged in native
        code), in words; None when all answer. Its group cannot finish an iteration: the caller restarts it."""
        refs = [lr.ping.remote() for lr in self.graph.learners]
        t0 = time.monotonic()
        for rank, ref in enumerate(refs):
            try:
                runtime.get(ref, timeout=max(0.0, t0 + LEARNER_PING_S - time.monotonic()))
            except GetTimeoutError:
                return f"learner {rank} did not answer its health call within {LEARNER_PING_S:g} s"
            except (RayActorError, *_UNPLACEABLE) as e:
                return f"learner {rank} died ({type(e).__name__})"
        return None

    def iteration_done(self) -> None:
        """A learner iteration completed: the group works, whatever died before."""
        self.learner_restarts_in_a_row = 0

    def a_learner_is_dead(self) -> bool:
        for lr in self.graph.learners:
            try:
                runtime.get(lr.__ray_call__.remote(lambda self: None), timeout=LEARNER_ALIVE_S)
            except (RayActorError, GetTimeoutError, *_UNPLACEABLE):
                return True
        return False

    def restart_learners(self) -> None:
        """Replace the whole learner group, from the newest checkpoint (or from scratch without one)."""
        state, cfg = self.state, self.cfg
        state.learner_restarts += 1
        self.learner_restarts_in_a_row += 1
        if self.learner_restarts_in_a_row > cfg.run.max_learner_restarts:
            raise RuntimeError(f"the learner group died {self.learner_restarts_in_a_row} times in a row without "
                               f"completing an update (run.max_learner_restarts = {cfg.run.max_learner_restarts}); "
                               f"resume later with --resume {self.graph.files.root}")
        path = self.graph.restart_learners()
        self.say(f"a learner died; learner group restarted from {path or 'scratch'} (restart {state.learner_restarts}; "
                 f"{self.learner_restarts_in_a_row} in a row of at most {cfg.run.max_learner_restarts})")

