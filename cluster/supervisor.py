"""Supervision of the actor graph: health checks, replacements, live scaling.

A rollout actor that fails in any way is replaced (same id; its node if that
node is still there, else any node with room) and training goes on: its loop
raised (an env's ``reset`` or ``step``, a bad observation: ``env_failures``),
its process died (``rollout_restarts`` counts every replacement), it made no env
step or did not answer its health call for one ticket lease
(``rollout.fragment_timeout_s``: ``rollout_hangs``; a SIGSTOPped process is a
hung one), or it passed ``rollout.memory_limit_mb`` (``rollout_memory_kills``).
The supply board is told, so exactly the fragments it had not delivered are
made again. Two rules keep a real bug from looping: ``rollout.max_env_failures``
faults per run, and ``REPEAT_LIMIT`` fresh actors in a row failing the same way
before their first fragment; either ends the run with one line.

A replay shard that dies or hangs is replaced the same way. The rollout actor
count follows the control board (``python -m cluster.control``); actors that
do not fit the free resources are refused with one line, and the run goes on.
A learner that dies takes the whole learner group down with it (the others
would hang in the all-reduce); the group is restarted from the newest
checkpoint, up to ``run.max_learner_restarts`` times in a row without an update completed in between.

Every wait here has a deadline, and the driver's calls do not grow with the
rollout actor count: the actors' stats arrive with their board polls (one
board call reads them all), a death or a failed loop shows in each actor's
``until_done`` call (looked at without a call), and only an actor silent for
``SILENT_S`` gets a health call, at most ``HEALTH_CALLS_PER_S`` over all
actors; one never answered for a ticket lease is a hung one.
"""

from __future__ import annotations

import collections
import time
from typing import Callable

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from cluster import placement
from cluster.autoscale import RolloutAutoscaler
from cluster.config import Config
from cluster.graph import ActorGraph, reward_scaler_for
from cluster.records import RunState
from pipeline import runtime

#: Fresh rollout actors failing with the same error before their first fragment, this many times in a row, end the
#: run: a replacement would fail the same way (an env that cannot run on this host, a bug hit at the first step).
REPEAT_LIMIT = 3
#: An actor whose stats have not come with a board poll for this long gets a health call of its own (a healthy one
#: polls at least every rollout.TICKET_WAIT_S, while parked, or once per block of about a second of fragments), so a
#: stopped one is found within SILENT_S + one ticket lease.
SILENT_S = 3.0
#: Most health calls per second over all rollout actors (the silent ones only): the driver's calls stay bounded at
#: any actor count.
HEALTH_CALLS_PER_S = 20.0
#: Deadline of a driver call to the supply board or the control board (small, serial actors).
BOARD_CALL_S = 30.0
#: Deadline of a learner's health call (answered on a thread of its own within milliseconds when alive).
LEARNER_PING_S = 5.0

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


class Supervisor:
    """Watches ``graph`` and folds what it sees into ``state``; ``say``: the driver's stderr line."""

    def __init__(self, cfg: Config, graph: ActorGraph, state: RunState, say: Callable[[str], None]):
        self.cfg = cfg
        self.graph = graph
        self.state = state
        self.say = say
        self.rollout_stats: dict[int, dict] = {}  # rollout actor id -> its newest stats
        self._asked: dict[int, tuple] = {}  # actor id -> (its unanswered health call, when it was sent)
        self._watch: dict[int, object] = {}  # actor id -> its until_done call (resolves when it ends or dies)
        self._heard: dict[int, float] = {}  # actor id -> when its stats last arrived (with a poll or a health call)
        self._health_pace = CallPacer(HEALTH_CALLS_PER_S)  # health calls to silent rollout actors
        self.calls: collections.Counter = collections.Counter()  # the driver's calls about actors and shards, by kind
        self.shard_stats: dict[int, dict] = {}  # shard index -> its newest stats answer
        self._shard_watch: dict[int, object] = {}  # shard index -> its until_dead call
        self._shard_asked: dict[int, tuple] = {}  # shard index -> (its unanswered health call, when it was sent)
        self._shard_pace, self._shard_next = CallPacer(HEALTH_CALLS_PER_S), 0  # round robin over the shards
        self._starting: dict[int, tuple] = {}  # actor id -> (its start call, when it was made, why): not yet up
        self._produced: set[int] = set()  # actor ids whose current incarnation has sent a fragment
        self._repeats: dict[int, tuple[str, int]] = {}  # actor id -> (fault, fresh incarnations failing so in a row)
        # rollout.num_actors: auto. Never past replay_bound actors: no more tickets than that exist at once, so an
        # actor beyond it could only wait (at max_policy_lag 0 the learners wait by design, and would ask for more).
        ro = cfg.rollout
        self.autoscaler = (RolloutAutoscaler(ro.min_actors, max(ro.min_actors, min(ro.max_actors, cfg.replay_bound)),
                                             ro.autoscale_host_bound, ro.autoscale_window)
                           if cfg.autoscale_rollouts else None)
        self.learner_restarts_in_a_row = 0  # set back to 0 by every completed update (iteration_done)

    # ------------------------------------------------------------------ rollout actors
    def lease_s(self) -> float:
        """The ticket lease in force (the board's: fixed, or derived from the measured fragment times)."""
        fixed = self.cfg.rollout.fragment_timeout_s
        return float(self.state.board.get("lease_s", 10.0)) if fixed == "auto" else float(fixed)

    def poll_rollouts(self) -> None:
        """Fold in every rollout actor's finished episodes and counters; replace the failed, dead and hung.

        The calls this makes do not grow with the actor count: every actor's stats come with its board polls and
        are read in one board call; a death or an ended loop shows in the actor's ``until_done`` call, which is
        looked at without a call; only an actor that has sent nothing for ``SILENT_S`` gets a health call of its
        own, at most ``HEALTH_CALLS_PER_S`` a second over all actors."""
        graph = self.graph
        now = time.monotonic()
        self._check_starting(now)
        self.calls["actor_reports"] += 1
        reports = self._tell_board(lambda board: board.actor_reports.remote()) or {}
        for i, (incarnation, st) in reports.items():
            if i < len(graph.rollouts) and incarnation == graph.incarnation.get(i) and i not in self._starting:
                self._heard[i] = now
                self._judge(i, st)
        self._look_at_watches(now)
        self._health_calls(now)

    def _look_at_watches(self, now: float) -> None:
        """Deaths and ended loops: each actor's ``until_done`` call, looked at without a call."""
        graph = self.graph
        for i, actor in enumerate(graph.rollouts):
            if i not in self._watch and i not in self._starting:
                self.calls["until_done"] += 1  # once per actor incarnation
                self._watch[i] = actor.until_done.remote()
                self._heard.setdefault(i, now)
        if not self._watch:
            return
        done = set(runtime.wait(list(self._watch.values()), num_returns=len(self._watch), timeout=0)[0])
        for i, ref in [(i, ref) for i, ref in self._watch.items() if ref in done]:
            del self._watch[i]
            st = self._answer(i, ref)
            if st is not None and not self._judge(i, st) and not st["running"]:  # only a stop ends a loop cleanly
                self._replace(i, "death", "stopped making fragments (its loop ended)")

    def _health_calls(self, now: float) -> None:
        """A health call to each actor silent for SILENT_S (stopped, hung, or just slow), paced; one out per actor.
        Unanswered for a ticket lease, the actor is a hung one."""
        graph, lease = self.graph, self.lease_s()
        # Silence counts from the last poll's stats, not from a health answer: an actor stuck inside its env answers
        # health calls but polls no more, and is asked again on every look until it polls or its lease runs out.
        silent = sorted((t, i) for i, t in self._heard.items()
                        if now - t > SILENT_S and i not in self._asked and i not in self._starting
                        and i < len(graph.rollouts))
        for _, i in silent:
            if not self._health_pace.take(now):
                break
            self.calls["health"] += 1
            self._asked[i] = (graph.rollouts[i].stats.remote(), now)
        for i, (ref, sent) in list(self._asked.items()):
            if not runtime.wait([ref], timeout=0)[0]:
                if now - sent > lease:  # stopped (SIGSTOP), or holding the GIL in native code
                    self._replace(i, "hang", f"did not answer its health call for {lease:.0f} s "
                                             f"(rollout.fragment_timeout_s)")
                continue
            del self._asked[i]
            st = self._answer(i, ref)
            if st is not None:
                self._judge(i, st)

    def _answer(self, i: int, ref) -> dict | None:
        """The stats a finished call of actor ``i`` returned; None if the call failed because the actor died (it
        is replaced here)."""
        try:
            return runtime.get(ref, timeout=0)
        except (RayActorError, *_UNPLACEABLE) as e:
            self._replace(i, "death", f"died ({type(e).__name__})")
            return None

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
        state = self.state
        state.actor_steps[i] = st["env_steps"]
        state.window.extend(episode[0] for episode in st["episodes"])
        names = list(self.cfg.multiagent.policies)
        for episode in st["episodes"]:
            if len(episode) > 2:  # several policies: (return, length, the index of the policy that played it)
                state.policy_window(names[episode[2]]).append(episode[0])
        state.episodes_total += len(st["episodes"])
        # Sandboxed env children replaced, the actor going on: the count is the incarnation's so far.
        new_faults = st.get("env_faults", 0) - self.rollout_stats.get(i, {}).get("env_faults", 0)
        if new_faults > 0:
            state.env_failures += new_faults
            state.last_rollout_fault = f"rollout actor {i} {st['env_fault_last']}"
        self.rollout_stats[i] = st
        if st.get("reward_scaler") is not None:
            state.reward_scalers[i] = st["reward_scaler"]
        if st["fragments_sent"] > 0:
            self._produced.add(i)
            self._repeats.pop(i, None)

    def _replace(self, i: int, kind: str, why: str) -> None:
        """Replace rollout actor ``i`` after a fault of ``kind`` (env, death, hang, memory), or end the run when a
        guard says a replacement would only fail again."""
        state, graph, cfg = self.state, self.graph, self.cfg
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
        if i in self._produced:
            self._repeats.pop(i, None)
        else:
            last, n = self._repeats.get(i, ("", 0))
            self._repeats[i] = (fault, n + 1 if last == fault else 1)
        self._forget(i)
        try:
            runtime.kill(graph.rollouts[i])  # a hung or stopped process must not come back with a late fragment
        except Exception:  # noqa: BLE001 - already dead
            pass
        state.retire(i)
        # Its tickets with no stored fragment go to the others; a late add of it is refused.
        self._tell_board(lambda board: board.actor_gone.remote(i, graph.incarnation[i]))
        faults = state.rollout_restarts
        if self._repeats.get(i, ("", 0))[1] >= REPEAT_LIMIT:
            raise RolloutFailed(f"rollout actor {i} {why}; {REPEAT_LIMIT} fresh actors in a row failed so before "
                                f"their first fragment, so a replacement would too")
        if faults > cfg.rollout.max_env_failures:
            raise RolloutFailed(f"rollout actor {i} {why}; that is fault {faults}, over rollout.max_env_failures = "
                                f"{cfg.rollout.max_env_failures}")
        fixed = graph.ensure_preprocess_worker(i)
        if fixed:
            state.preprocess_restarts += 1
            self.say(f"{fixed}; replaced (restart {state.preprocess_restarts})")
        graph.rollouts[i] = graph.make_rollout(i, incarnation=graph.incarnation[i] + 1, iteration=state.iteration,
                                               replacement=True,
                                               reward_scaler_state=reward_scaler_for(state.reward_scalers, i))
        self._starting[i] = (graph.rollouts[i].start.remote(), time.monotonic(), "replacement")
        self.say(f"rollout actor {i} {why}; replaced (fault {faults} of at most {cfg.rollout.max_env_failures}: "
                 f"{state.env_failures} env failures, {state.rollout_hangs} hangs, "
                 f"{state.rollout_memory_kills} over memory)")

    def _forget(self, i: int) -> None:
        self.rollout_stats.pop(i, None)
        self._asked.pop(i, None)
        self._watch.pop(i, None)
        self._heard.pop(i, None)
        self._starting.pop(i, None)
        self._produced.discard(i)

    def _check_starting(self, now: float) -> None:
        """Actors being created: up, or past the start deadline (Ray found no room for them)."""
        for i, (ref, since, why) in list(self._starting.items()):
            if i not in self._starting:
                continue  # removed earlier in this pass (_refuse_from takes every added actor from its index on)
            if runtime.wait([ref], timeout=0)[0]:
                del self._starting[i]
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

    # ------------------------------------------------------------------ shards
    def poll_shards(self) -> list[dict]:
        """Each shard's newest stats; a dead or hung shard is replaced. The board re-points its producers and
        readers and has exactly the fragments it held (and nobody had claimed) made again.

        Nothing here waits, and the calls do not grow with the shard count: a death shows in the shard's
        ``until_dead`` call (looked at without a call), and health calls go round the shards at most
        ``HEALTH_CALLS_PER_S`` a second, one out per shard; one unanswered for the board deadline is a hung shard.
        The stats returned are each shard's newest answer (fresh every pass up to that many shards a second)."""
        state, graph = self.state, self.graph
        now = time.monotonic()
        for i, shard in enumerate(graph.shards):
            if i not in self._shard_watch:
                self._shard_watch[i] = shard.until_dead.remote()
        done = set(runtime.wait(list(self._shard_watch.values()), num_returns=len(self._shard_watch), timeout=0)[0])
        for i in [i for i, ref in self._shard_watch.items() if ref in done]:
            self._replace_shard(i, "died")
        k = len(graph.shards)
        for step in range(k):  # round robin from where the last pass stopped
            i = (self._shard_next + step) % k
            if i in self._shard_asked:
                continue
            if not self._shard_pace.take(now):
                break
            self.calls["shard_health"] += 1
            self._shard_asked[i] = (graph.shards[i].stats.remote(), now)
            self._shard_next = (i + 1) % k
        for i, (ref, sent) in list(self._shard_asked.items()):
            if not runtime.wait([ref], timeout=0)[0]:
                if now - sent > self.board_deadline_s():
                    self._replace_shard(i, f"did not answer for {self.board_deadline_s():.0f} s")
                continue
            del self._shard_asked[i]
            try:
                self.shard_stats[i] = runtime.get(ref, timeout=0)
            except (RayActorError, *_UNPLACEABLE):
                self._replace_shard(i, "died")
        try:
            state.board = runtime.get(graph.board.stats.remote(), timeout=self.board_deadline_s())
        except (RayActorError, GetTimeoutError, *_UNPLACEABLE) as e:
            self.replace_board(f"died ({type(e).__name__})" if not isinstance(e, GetTimeoutError)
                               else f"did not answer for {self.board_deadline_s():.0f} s")
        return [self.shard_stats.get(i, {"depth": 0, "added": 0}) for i in range(k)]

    def _replace_shard(self, i: int, why: str) -> None:
        """A new shard at index ``i`` (its node if alive, else any with room); the board refunds what it held."""
        state, graph = self.state, self.graph
        state.shard_restarts += 1
        self._shard_watch.pop(i, None)
        self._shard_asked.pop(i, None)
        try:
            runtime.kill(graph.shards[i])  # a hung shard is treated as dead
        except Exception:  # noqa: BLE001 - already dead
            pass
        graph.shards[i] = graph.make_shard(i, replacement=True)
        refunded = self._tell_board(lambda board: board.register_shard.remote(i, graph.shards[i]))
        self.say(f"replay shard {i} {why} holding {refunded if refunded is not None else 'its'} unclaimed "
                 f"fragments; replaced, and those are made again (restart {state.shard_restarts})")

    def _tell_board(self, call):
        """``call(board)``'s answer, or None when the board is dead or silent: then it is replaced here, which
        voids every ticket and re-registers every shard, so what the call would have told it no longer matters."""
        try:
            return runtime.get(call(self.graph.board), timeout=self.board_deadline_s())
        except (RayActorError, GetTimeoutError, *_UNPLACEABLE) as e:
            self.replace_board(f"died ({type(e).__name__})" if not isinstance(e, GetTimeoutError)
                               else f"did not answer for {self.board_deadline_s():.0f} s")
            return None

    def board_deadline_s(self) -> float:
        """How long the supply board may take to answer the driver before it is a hung one: well inside the
        learners' stall deadline, so it is replaced before they give up on it."""
        return min(BOARD_CALL_S, self.cfg.run.stall_timeout_s / 3)

    def replace_board(self, why: str) -> None:
        """A new supply board from what survives: the learners' policy version and weights (rank 0 publishes them
        to it), the shards (re-registered, emptied: what they held was ticketed by the dead ledger) and every
        actor's handle. The dead board's tickets are all void; its counters are folded into the run's, and what it
        had in flight is counted as voided and made again under the new ledger."""
        state, graph = self.state, self.graph
        try:
            runtime.kill(graph.board)  # a stopped board must not wake up and hand out its tickets
        except Exception:  # noqa: BLE001 - already dead
            pass
        old = state.board
        in_flight = int(old.get("in_flight", 0))
        state.fold_board(old)
        state.board_restarts += 1
        graph.board = board = graph.make_board(replacement=True)
        # The shards and learners are up and answer the driver in milliseconds: they have the driver's deadline for
        # a board or shard call. The new board's first answers wait for its process to start as well.
        answer_s, start_s = self.board_deadline_s(), max(BOARD_CALL_S, self.cfg.run.stall_timeout_s)
        answer_why = f"{answer_s:g} s (min({BOARD_CALL_S:g} s, run.stall_timeout_s / 3))"
        cleared = self._answers(why, [s.attach_board.remote(board) for s in graph.shards],
                                [f"replay shard {i}" for i in range(len(graph.shards))], answer_s, answer_why)
        self._answers(why, [board.register_shard.remote(i, s) for i, s in enumerate(graph.shards)],
                      ["the new supply board"] * len(graph.shards), start_s,
                      f"{start_s:g} s (max({BOARD_CALL_S:g} s, run.stall_timeout_s), its start included)")
        # Rank 0 publishes its weights to the new board: the ledger's tickets start from that version.
        version = self._answers(why, [lr.attach_board.remote(board) for lr in graph.learners],
                                [f"learner {r}" for r in range(len(graph.learners))], answer_s, answer_why)[0]
        for relay in graph.relays.values():  # before the actors, which try their relay again on attach_board
            relay.attach_board.remote(board)  # not waited for: an actor whose relay fails polls the board itself
        for actor in graph.rollouts:
            actor.attach_board.remote(board)  # not waited for: a hung actor is the health check's business
        voided = sum(cleared)
        state.board_voided += voided + in_flight
        self.say(f"the supply board {why}; replaced (restart {state.board_restarts}): {voided} stored fragments "
                 f"and ~{in_flight} tickets in flight voided and made again, from policy version {version}")
        state.board = {}

    def _answers(self, why: str, refs: list, names: list[str], timeout: float, timeout_why: str) -> list:
        """The answers of ``refs`` (one call to each of ``names``) within one ``timeout`` for all of them, while the
        supply board that ``why`` is replaced. A call unanswered by then (a stopped process, an unreachable host) or
        failed with its actor ends the run: the new board cannot be wired up without every shard and learner."""
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
                                         f"{self.graph.run_dir}")
        return out

    # ------------------------------------------------------------------ scaling
    def apply_control(self) -> None:
        """Grow or shrink the rollout actor set to what the control board asks for. Growth takes what fits the
        free resources now; the rest is refused with one line (and the control board told)."""
        graph, state, cfg = self.graph, self.state, self.cfg
        desired = self._ask_control(lambda board: board.desired.remote(), running=len(graph.rollouts))
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
                self._ask_control(lambda board: board.applied.remote(want), running=want)
                if fits == 0:
                    return
            if pinned:
                graph.plan.rollout_nodes[have:] = nodes  # the places of actors removed earlier are free again
            for i in range(have, want):
                graph.rollouts.append(graph.make_rollout(
                    i, incarnation=graph.incarnation.get(i, -1) + 1, iteration=state.iteration,
                    reward_scaler_state=reward_scaler_for(state.reward_scalers, i)))
                self._starting[i] = (graph.rollouts[i].start.remote(), time.monotonic(), "added")
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
        board for, when its window calls for a change (applied at the next iteration, as a cluster.control request
        is), else None."""
        if self.autoscaler is None:
            return None
        have = len(self.graph.rollouts)
        decision = self.autoscaler.observe(record, have, self.room_for)
        if decision is None:
            return None
        try:
            err = runtime.get(self.graph.control.set_rollout_actors.remote(decision.want), timeout=BOARD_CALL_S)
        except (RayActorError, GetTimeoutError, *_UNPLACEABLE):
            return None  # the control board is replaced at the next apply_control; the next window decides again
        if err:
            self.say(f"rollout actors: autoscale to {decision.want} refused: {err}")
            return None
        self.say(f"rollout actors: autoscale {have} -> {decision.want}: {decision.why}")
        return decision.want

    def _remove_from(self, first: int) -> None:
        """Stop and remove rollout actors ``first`` and up."""
        graph, state = self.graph, self.state
        gone, graph.rollouts = graph.rollouts[first:], graph.rollouts[:first]
        try:  # each delivers the fragment it is making, so nothing needs to be made again
            runtime.get([a.stop.remote(timeout_s=10.0) for a in gone], timeout=15)
        except Exception:  # noqa: BLE001 - stuck or dead: killed below either way, and its tickets refunded
            pass
        for i, a in enumerate(gone, start=first):
            runtime.kill(a)
            state.retire(i)
            self._forget(i)
            self._repeats.pop(i, None)
            # Tickets it held without a stored fragment go to the others; a late add of it is refused.
            self._tell_board(lambda board: board.actor_gone.remote(i, graph.incarnation[i]))

    def _refuse_from(self, i: int, why: str) -> None:
        """Added actors from ``i`` on never started: remove them, say so, and settle the control board."""
        have = len(self.graph.rollouts)
        self._remove_from(i)
        self.say(f"rollout actors: {have - i} added actor(s) {why}: Ray has not placed them (free now: "
                 f"{free_resources()}); running {i}")
        self._ask_control(lambda board: board.applied.remote(i), running=i)

    def _ask_control(self, call, running: int):
        """``call(control board)``'s answer, or None when the board is dead or does not answer within the board
        deadline: then it is replaced by one asking for ``running`` rollout actors (the count the run is going on
        with). It only holds that count, so nothing else is lost with it, and the run never ends for it."""
        graph = self.graph
        try:
            return runtime.get(call(graph.control), timeout=self.board_deadline_s())
        except (RayActorError, GetTimeoutError, *_UNPLACEABLE) as e:
            try:
                runtime.kill(graph.control)  # a stopped board must not wake up with an old count, under the name
            except Exception:  # noqa: BLE001 - already dead
                pass
            graph.control = graph.make_control(rollout_actors=running)
            self.state.control_restarts += 1
            self.say(f"the control board {'did not answer' if isinstance(e, GetTimeoutError) else 'died'}; "
                     f"replaced, asking for the {running} rollout actors running now")
            return None

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
                runtime.get(lr.__ray_call__.remote(lambda self: None), timeout=10)
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
                               f"resume later with --resume {self.graph.run_dir}")
        path = self.graph.restart_learners()
        self.say(f"a learner died; learner group restarted from {path or 'scratch'} (restart {state.learner_restarts}; "
                 f"{self.learner_restarts_in_a_row} in a row of at most {cfg.run.max_learner_restarts})")


def free_resources() -> dict:
    """Ray's free schedulable resources (not its bookkeeping entries), for a one-line refusal."""
    try:
        return {k: v for k, v in ray.available_resources().items()
                if not k.startswith(("node:", "memory", "object_store")) and "_group_" not in k}
    except Exception:  # noqa: BLE001 - in process, or Ray not reachable: nothing to show
        return {}
