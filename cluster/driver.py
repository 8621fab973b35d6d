"""The driver: builds the actor graph from the config, watches it, stops it.

It is on the control path only. Data flows rollout actor -> replay shard ->
learner feed through the object store; the driver sees small stats dicts.
Learner iterations are submitted two deep so a learner never waits for the
driver between updates.

Routing and the rate limit are not the driver's: the supply board's ticket
ledger (``pipeline/supply.py``) decides who makes which fragment and which
learner takes it, for any number of actors, shards and learners. The driver
only tells the board what it saw die or change.

Failures it handles: a rollout actor or a replay shard that dies is replaced
(same id, same place) and training goes on; the board has exactly the lost
fragments made again, and the metrics count it (``rollout_restarts``,
``shard_restarts``, ``fragments_lost``). The driver never waits on the learners
without a deadline: it checks the other actors every second, ends the run at
``run.time_budget_s`` or Ctrl-C even while a learner is stuck, and a learner
that gets no batch for ``run.stall_timeout_s`` stops the run with a one-line
report of what it waits for. A learner that dies takes the whole learner group
down with it (the others would hang in the all-reduce); the group is restarted
from the newest checkpoint, up to ``run.max_learner_restarts`` times in a row without an update in between.
Checkpoints (periodic and final) also let ``--resume`` continue a stopped run.

The jobs are split: ``cluster/graph.py`` makes the actors (``ActorGraph``),
``cluster/supervisor.py`` watches and replaces them (``Supervisor``),
``cluster/records.py`` holds the counters and makes the metrics records
(``RunState``, ``Records``); this module is the loop, its deadlines and the
checkpoints.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import yaml
from ray.exceptions import RayActorError, RayTaskError

from cluster import checkpoint, report
from cluster.checkpoint import RunFiles
from cluster.config import Config
from cluster.evaluation import PeriodicEvaluation
from cluster.graph import ActorGraph, describe_env, with_env_class_defaults
from cluster.metrics import ProgressLine, close_sinks, make_sinks
from cluster.records import PPO_STATS, Records, RunState, pipeline_metrics
from cluster.supervisor import RolloutFailed, Supervisor
from learner.actor import LearnerStalled
from learner.learner import NONFINITE
from pipeline import metric_keys as M
from pipeline import runtime
# Its clocks are the protocol's (pipeline/protocol.py, LIMITS: each with the invariant it protects), read by name here
# (tests change REPORT_DEADLINE_S on this module).
from pipeline.protocol import (HEALTH_CHECK_S, ITERATION_GRACE_S, LEARNER_HEALTH_AFTER_S, LEARNER_STATE_S,
                               REPORT_DEADLINE_S, STOP_DRAIN_S)

__all__ = ["Trainer", "RunResult", "RunState", "RolloutFailed", "RunStalled", "LearnerGroupDied", "LearnerFailed",
           "RunDiverged",
           "pipeline_metrics", "PPO_STATS", "INFLIGHT_ITERATIONS", "HEALTH_CHECK_S", "ITERATION_GRACE_S"]

#: Learner iterations kept queued: the next update's call is out while one trains (a count, not a clock).
INFLIGHT_ITERATIONS = 2
# STOP_DRAIN_S: an iteration in flight that takes longer (a stuck learner) is not waited for, and final.pt is then
# the newest state whose counters are known (``_save_final_checkpoint``).


class RunStalled(RuntimeError):
    """A learner got no batch within run.stall_timeout_s, or an iteration outlived every deadline."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank  # the stalled learner: it is between updates, so its state is a consistent checkpoint


class _BudgetSpent(Exception):
    """run.time_budget_s passed while the driver waited on the learners."""


class LearnerGroupDied(RuntimeError):
    pass


class LearnerFailed(RuntimeError):
    """A learner's iteration raised without its process dying (a device out of memory, a bug in the update): a
    restart would fail the same way, so the run ends with its final checkpoint and this one line. ``group_gone``:
    no learner is left to ask for that checkpoint (the group died and could not be restarted)."""

    def __init__(self, message: str, group_gone: bool = False):
        super().__init__(message)
        self.group_gone = group_gone


class RunDiverged(RuntimeError):
    """run.max_nonfinite_updates updates in a row were not finite (none was applied), or a state the run was to save
    held a NaN or inf: the run stops (reason "diverged", exit 3) with its last finite state in final.pt."""


@dataclass
class RunResult:
    # "target_reached" | "total_env_steps" | "time_budget" | "paused" | "interrupted" | "failed" | "diverged"
    reason: str
    reached_target: bool
    env_steps: int
    iterations: int
    wall_s: float
    episode_return_mean: float
    run_dir: Path
    checkpoint_path: Path | None


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path | RunFiles, t_start: float | None = None, quiet: bool = False,
                 profile_iterations: int = 0, resume: dict | None = None, pause_at_env_steps: int | None = None,
                 run_id: str | None = None):
        """``resume``: a checkpoint payload (``checkpoint.load``) to continue from. ``pause_at_env_steps``: stop
        (reason "paused", with the final checkpoint) once this many env steps are done, without changing what the
        schedules (the lr's, the entropy's, the clip range's) count to: run.total_env_steps. Population-based
        training runs a trial in such segments, each resumed from the last one's checkpoint.

        The learning settings ``cfg`` leaves unset take its env class's defaults here (``env.defaults``), before
        anything reads them: an env that cannot be made, or defaults that do not fit the config's layout, raise
        the one-line ConfigError.

        ``run_id``: the run this one is (``checkpoint``'s run ids): by default the resumed checkpoint's, else a new
        one. ``run_dir`` (its ``RunFiles``, or a path to one) must be empty, or this run's (ConfigError otherwise: one
        directory, one run). Population-based training gives a trial's own id when it continues from another trial's
        checkpoint."""
        self.quiet = quiet
        cfg = self.cfg = with_env_class_defaults(cfg)
        if cfg.class_defaults:
            self._say(f"env.defaults: {cfg.env.defaults}: continuous actions, so the settings the config leaves unset "
                      f"take the continuous defaults: "
                      + ", ".join(f"{key}={value}" for key, value in cfg.class_defaults.items()))
        self.files = RunFiles.of(run_dir)  # every file of the run, written through it or at its paths
        self.run_id = run_id or (resume or {}).get("run_id") or checkpoint.new_run_id()
        self.files.claim(self.run_id, continues_legacy=resume is not None and resume.get("run_id") is None)
        self.t_start = t_start if t_start is not None else time.perf_counter()
        self._report_thread: threading.Thread | None = None
        self.profile_iterations = profile_iterations
        self.resume = resume
        self.pause_at_env_steps = pause_at_env_steps
        self.failure: str | None = None  # why the run stopped with reason "failed", "diverged" or "write_failed"
        self.diverged = False  # it stopped on non-finite updates or a non-finite state (exit 3)
        self.report_failure: str | None = None  # summary.txt or report.png could not be written (exit 4)
        self._nonfinite_in_a_row = 0  # updates in a row that were not finite (none of them applied)
        # The newest periodic checkpoint this run wrote: what a restarted learner group and a final.pt without a
        # learner to ask take. Before the first, the checkpoint the run resumed from (which may be in another run
        # directory, or another PBT trial's); never a file found by scanning a directory.
        self._last_periodic: Path | None = None
        self.finishing = False  # the final checkpoint and report are being written: a first signal must not cut them
        self.critical = False  # an iteration is being counted: a first signal must not cut it either ...
        self.stop_requested = False  # ... and sets this instead, which stops the loop once it is counted
        self._last_checkpoint_t = time.monotonic()
        #: The learners' version (updates applied) as of the last iteration counted: final.pt's weights must be
        #: exactly that many updates in, or its counters would describe other weights.
        self._counted_version = (resume or {}).get("learner", {}).get("version", 0)
        if resume is not None:
            problem = RunState.problem_in(resume.get("run_state"))
            if problem is not None:
                raise checkpoint.CheckpointError(f"resume: the checkpoint cannot be resumed: {problem}")
            self.state = RunState.from_checkpoint(resume["run_state"], cfg.run.target_window,
                                                  resume.get("train_time_s", 0.0))
        else:
            self.state = RunState.fresh(cfg.run.target_window)
        self.graph = ActorGraph(cfg, self.files, self._say, profile_iterations=profile_iterations)
        self.graph.restart_point = self._restart_point
        self.state.live_steps = self.graph.rollout_steps  # each actor's steps are its slot's, read there
        self.supervisor = Supervisor(cfg, self.graph, self.state, self._say)
        self.records = Records(self.state, self.t_start, self._say, self_play=self.cfg.multiagent.self_play)
        self.evaluation = PeriodicEvaluation(cfg, self.graph, self.files, self._say, run_id=self.run_id)

    # The graph's handles, by the names the tests and benches use.
    learners = property(lambda self: self.graph.learners)
    rollouts = property(lambda self: self.graph.rollouts)
    shards = property(lambda self: self.graph.shards)
    board = property(lambda self: self.graph.board)
    relays = property(lambda self: list(self.graph.relays.values()))
    control = property(lambda self: self.graph.control)
    preprocess_workers = property(lambda self: self.graph.preprocess_workers)
    spec = property(lambda self: self.graph.spec)
    plan = property(lambda self: self.graph.plan)

    def build(self) -> None:
        self.graph.build(self.resume, iteration=self.state.iteration)

    def _describe_env(self):
        """The model's spec, from one throwaway env (``graph.describe_env``; what --dry-run checks too)."""
        return describe_env(self.cfg)

    def placement_report(self) -> dict:
        """Node id of every actor, by role (what the placement test checks)."""
        return self.graph.placement_report()

    def shutdown(self) -> None:
        """Stop producers, then consumers, then kill every actor this driver made; then wait for the report."""
        self.state.env_steps_retired += self.graph.rollout_steps()  # the run's count keeps them once the slots go
        self.graph.shutdown()
        if self._report_thread is not None:
            self._report_thread.join(timeout=REPORT_DEADLINE_S)
            if self._report_thread.is_alive():
                self._say(f"the report did not finish within {REPORT_DEADLINE_S:g} s; exiting without it (the "
                          f"metrics are in {self.files.metrics}: python -m cluster.report rebuilds it)")
            self._report_thread = None

    def _say(self, text: str) -> None:
        if not self.quiet:
            print(f"\n{text}", file=sys.stderr)

    # ------------------------------------------------------------------ run
    def run(self) -> RunResult:
        cfg, state = self.cfg, self.state
        self.files.write_config(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        sinks = make_sinks(cfg.run.loggers, self.files, cfg.to_dict())  # same metric names in every sink
        progress = ProgressLine(cfg.run.progress_interval_s, cfg.run.total_env_steps,
                                show_success=cfg.run.target_success_rate is not None)
        inflight: collections.deque = collections.deque()
        reason = None
        record: dict = {}
        stop_return = float("nan")
        stalled_rank = None
        learners_gone = False
        self.records.start(time.perf_counter())
        if self.resume is not None:
            # A run resumed at or past its stop rule (the budget it already spent, a target its restored episode
            # window already meets) ends here, with its checkpoint re-saved: it must not train further updates.
            reason = self._stop_reason(self.records.train_time_s(time.perf_counter()))
            if reason is not None and state.window:
                stop_return = float(np.mean(state.window))
        try:
            for _ in range(INFLIGHT_ITERATIONS if reason is None else 0):
                inflight.append(self._submit_iteration())
            while reason is None:
                try:
                    results = self._await_learners(inflight[0])  # its refs stay in flight until it is counted
                except LearnerGroupDied as died:
                    try:
                        self.supervisor.restart_learners()  # the iterations in flight died with the group
                    except Exception as e:  # noqa: BLE001 - no room for a new group (its node is gone), or too many
                        raise LearnerFailed(f"the learner group died ({died}) and could not be restarted: "
                                            f"{' '.join(str(e).split())[:400]}", group_gone=True) from None
                    inflight = collections.deque(self._submit_iteration() for _ in range(INFLIGHT_ITERATIONS))
                    continue
                except _BudgetSpent:
                    reason = "time_budget"  # a learner is stuck or slow: end now, without the iterations in flight
                    inflight.clear()
                    break
                # Counted whole or not at all: a first Ctrl-C or SIGTERM in here only sets stop_requested (the CLI's
                # GracefulStop), and the loop stops right after, so no finished update goes uncounted.
                self.critical = True
                inflight.popleft()
                inflight.append(self._submit_iteration())
                record = self._account(results, sinks, progress)
                self.critical = False
                if self.stop_requested:
                    raise KeyboardInterrupt
                reason = self._stop_reason(record["train_time_s"])
                stop_return = record["episode_return_mean"]  # what the stop decision saw
            # The iterations still in flight are real updates: let them finish (they need the producers, which
            # are still running) and record them, so iteration, policy version and optimizer steps agree.
            record = self._drain(inflight, sinks, progress) or record
        except KeyboardInterrupt:
            reason = "interrupted"
            self.critical = False
            record = self._drain(inflight, sinks, progress, min(STOP_DRAIN_S, cfg.run.shutdown_grace_s / 4)) or record
        except RolloutFailed as e:
            # Stop with what was learned so far saved (final.pt); the CLI prints the cause in one line.
            reason = "failed"
            self.failure = str(e)
            record = self._salvage(inflight, sinks, progress) or record
        except RunStalled as e:
            reason = "failed"
            self.failure = str(e)
            stalled_rank = e.rank
            record = self._salvage(inflight, sinks, progress) or record
        except LearnerFailed as e:
            reason = "failed"
            self.failure = str(e)
            learners_gone = e.group_gone
            if not learners_gone:
                record = self._salvage(inflight, sinks, progress) or record
        except RunDiverged as e:
            reason = "diverged"
            self.failure = str(e)
            self.diverged = True
        except checkpoint.WriteFailed as e:
            # A checkpoint or a metrics record could not be written (a full disk, a quota, a read-only or failing
            # filesystem): the run stops rather than train on without the files it promises. The checkpoints
            # already written are whole (each is written beside itself and renamed), and none is pruned for a
            # save that failed, so --resume continues from the last good one.
            reason = "write_failed"
            self.failure = str(e)
        finally:
            self.critical = False  # also after an error raised while an iteration was being counted
            closing = close_sinks(sinks)
        if closing is not None and reason != "write_failed":  # the file's tail was lost at close
            reason, self.failure = "write_failed", closing
        if not self.quiet and record:
            progress.update(record, force=True)
            progress.close()
        self.finishing = True
        train_time = self.records.train_time_s(time.perf_counter())
        try:
            ckpt = self._save_final_checkpoint(reason, train_time, prefer_rank=stalled_rank,
                                               ask_learners=not learners_gone)
        except checkpoint.WriteFailed as e:
            ckpt = None
            if reason != "write_failed":
                reason, self.failure = "write_failed", str(e)
        if reason == "write_failed" and ckpt is None:
            ckpt = self.files.latest(self.run_id)  # the last good one, what --resume takes
        if self.diverged:  # (also: the final state itself was not finite, and was refused)
            reason = "diverged"
        result = RunResult(
            reason=reason,
            reached_target=reason == "target_reached",
            env_steps=state.env_steps,
            iterations=state.iteration,
            wall_s=time.perf_counter() - self.t_start,
            episode_return_mean=stop_return,
            run_dir=self.files.root,
            checkpoint_path=ckpt,
        )
        # End-of-run summary table (summary.txt) and learning curve + host-bound breakdown (report.png).
        def write_report() -> None:
            try:
                table, _ = report.write_report(self.files, asdict(result), window=cfg.run.target_window,
                                               target_return=cfg.run.target_return, plot=not self.quiet)
            except checkpoint.WriteFailed as e:  # the CLI reads report_failure once this thread has ended
                self.report_failure = str(e)
                return
            except OSError as e:  # summary.txt or report.png, written by the plotting library itself
                where = getattr(e, "filename", None) or self.files.root
                self.report_failure = checkpoint.describe_write_error(where, e)
                return
            if not self.quiet:
                print("\n" + table, file=sys.stderr)

        if reason == "write_failed":
            pass  # the disk refused a write already: no report now (python -m cluster.report makes it later)
        elif self.quiet:
            write_report()
        else:
            # The plot (~0.65 s, most of it importing matplotlib) is drawn while the actors shut down, which is
            # mostly waiting; shutdown() waits for it.
            # A daemon: shutdown() waits for it up to REPORT_DEADLINE_S, and a stuck one must not hold the exit.
            self._report_thread = threading.Thread(target=write_report, name="report", daemon=True)
            self._report_thread.start()
        return result

    def _drain(self, inflight: collections.deque, sinks: list, progress: ProgressLine,
               within_s: float | None = None) -> dict | None:
        """Finish and count the iterations in flight, oldest first (``within_s``: those done by then); the last
        record, or None if none finished. Stopping anyway: a learner that fails or stalls here ends the drain, and
        the final checkpoint then comes from a learner between updates."""
        give_up_at = None if within_s is None else time.monotonic() + within_s
        record = None
        while inflight:
            try:
                results = self._await_learners(inflight[0], check_budget=False, give_up_at=give_up_at)
            except (LearnerGroupDied, RunStalled, LearnerFailed, _BudgetSpent):
                break
            self.critical = True  # as in the loop: counted whole, a first signal waits for it
            inflight.popleft()
            record = self._account(results, sinks, progress)
            self.critical = False
        return record

    def _salvage(self, inflight: collections.deque, sinks: list, progress: ProgressLine) -> dict | None:
        """After a failure, count the iterations in flight that have finished (within one HEALTH_CHECK_S look):
        their updates are in the learners' weights, and final.pt, taken from a learner, must count them. Whatever
        fails while counting them ends this, as the run is ending anyway."""
        try:
            return self._drain(inflight, sinks, progress, within_s=0.0)
        except Exception:  # noqa: BLE001 - the run already failed; final.pt then comes from the newest state known
            return None

    def _submit_iteration(self) -> list:
        """One iteration on every rank; rank 0 also snapshots its state when a periodic checkpoint is due, so the
        checkpoint holds exactly the update that this iteration's record describes."""
        snapshot = self._checkpoint_due()
        if snapshot:
            self._last_checkpoint_t = time.monotonic()
        return [lr.train_iteration.remote(snapshot=snapshot and r == 0) for r, lr in enumerate(self.learners)]

    def _account(self, results: list[dict], sinks: list, progress: ProgressLine) -> dict:
        """Fold one finished learner iteration into the run state; write and show its record."""
        state, watch = self.state, self.supervisor
        # The learners' own counts first, together: a poll below may raise (a part that cannot be replaced), and
        # final.pt, taken from a learner, must then still count this update (``_counted_version``).
        state.iteration += 1
        state.samples_total += sum(res["samples"] for res in results)
        self._counted_version = results[0].get(M.POLICY_VERSION, self._counted_version)
        watch.iteration_done()
        watch.apply_control()
        watch.poll_rollouts()
        s_stats = watch.poll_shards()
        nonfinite = results[0].get(NONFINITE)  # every rank undid the same update (an all-reduced flag)
        if nonfinite:
            state.updates_skipped_nonfinite += 1
            self._nonfinite_in_a_row += 1
            limit = self.cfg.run.max_nonfinite_updates
            self._say(f"iteration {state.iteration}: update not applied: {nonfinite} (not finite; "
                      f"{self._nonfinite_in_a_row} in a row, the run stops at run.max_nonfinite_updates = {limit})")
        else:
            self._nonfinite_in_a_row = 0
        record = self.records.make(results, list(watch.rollout_stats.values()), s_stats, time.perf_counter(),
                                   rollout_actors=len(self.rollouts))
        if watch.autoscaler is not None:
            record[M.ROLLOUT_AUTOSCALE] = watch.autoscale(record)
        self.evaluation.step(state.iteration)
        record.update(self.evaluation.metrics())
        snapshot = results[0].pop("state", None)
        refused = None
        if snapshot is not None:
            try:
                self._save_checkpoint(snapshot, None, record["train_time_s"])
            except checkpoint.NonFiniteCheckpoint as e:
                refused = str(e)
        for res in results[1:]:
            res.pop("state", None)
        for sink in sinks:
            sink.write(record)
        self.records.mark(time.perf_counter())
        if not self.quiet:
            progress.update(record)
        if refused is not None:
            raise RunDiverged(f"iteration {state.iteration}: {refused}")
        if self._nonfinite_in_a_row >= self.cfg.run.max_nonfinite_updates:
            raise RunDiverged(f"the loss, gradient or weights were not finite in {self._nonfinite_in_a_row} updates "
                              f"in a row, and none of them was applied (iteration {state.iteration}: {nonfinite}; "
                              f"run.max_nonfinite_updates = {self.cfg.run.max_nonfinite_updates})")
        return record

    def _stop_reason(self, train_s: float) -> str | None:
        run, state = self.cfg.run, self.state
        window = state.window
        full = len(window) == window.maxlen
        if run.target_return is not None and full and np.mean(window) >= run.target_return:
            return "target_reached"
        if run.target_success_rate is not None and full and np.mean(np.asarray(window) > 0) >= run.target_success_rate:
            return "target_reached"
        if state.env_steps >= run.total_env_steps:
            return "total_env_steps"
        if self.pause_at_env_steps is not None and state.env_steps >= self.pause_at_env_steps:
            return "paused"
        if run.time_budget_s is not None and train_s >= run.time_budget_s:
            return "time_budget"
        return None

    # ------------------------------------------------------------------ deadlines
    def _await_learners(self, refs: list, check_budget: bool = True, give_up_at: float | None = None) -> list[dict]:
        """Results of one learner iteration, checking rollouts and shards while waiting. Every wait has a
        deadline: a rank that fails is seen at once (the others may be stuck in the all-reduce it left), the time
        budget ends the wait (as does ``give_up_at``, a monotonic time), and an iteration older than the stall
        deadline stops the run with what is missing."""
        t0 = time.monotonic()
        limit = self.cfg.run.stall_timeout_s + ITERATION_GRACE_S
        results: dict[int, dict] = {}  # rank -> its result, each fetched once
        while True:
            pending = [ref for r, ref in enumerate(refs) if r not in results]
            ready, _ = runtime.wait(pending, num_returns=len(pending), timeout=HEALTH_CHECK_S)
            for ref in ready:
                rank = refs.index(ref)
                results[rank] = self._result(ref, rank)
            if len(results) == len(refs):
                return [results[r] for r in range(len(refs))]
            if (check_budget and self._budget_spent()) or (give_up_at is not None and time.monotonic() > give_up_at):
                raise _BudgetSpent()
            if time.monotonic() - t0 > LEARNER_HEALTH_AFTER_S and (why := self.supervisor.unanswering_learner()):
                raise LearnerGroupDied(why)  # a stopped learner is a dead one: its group restarts
            if time.monotonic() - t0 > limit:
                missing = [r for r in range(len(refs)) if r not in results]
                raise RunStalled(f"learner rank(s) {missing} did not finish an iteration within run.stall_timeout_s + "
                                 f"{ITERATION_GRACE_S:.0f} s = {limit:.0f} s; ranks that finished: {sorted(results)}")
            self.supervisor.poll_rollouts()
            self.supervisor.poll_shards()

    def _result(self, ref, rank: int) -> dict:
        """A finished rank's result, or the run-level error its failure means."""
        try:
            return runtime.get(ref, timeout=0)
        except LearnerStalled as e:
            raise RunStalled(str(getattr(e, "cause", e)).strip().splitlines()[-1], rank=rank) from None
        except (RayActorError, RayTaskError) as e:
            # A dead rank shows up as its own RayActorError, or as the survivors' failed all-reduce.
            if isinstance(e, RayActorError) or self.supervisor.a_learner_is_dead():
                raise LearnerGroupDied(str(e).splitlines()[0]) from None
            raise self._learner_failed(rank, getattr(e, "cause", None) or e) from None
        except Exception as e:  # noqa: BLE001 - in process, a method's own exception arrives as it is
            raise self._learner_failed(rank, e) from None

    @staticmethod
    def _learner_failed(rank: int, cause: BaseException) -> "LearnerFailed":
        text = " ".join(str(cause).split())
        return LearnerFailed(f"learner {rank} failed: {type(cause).__name__}: {text[:500]}")

    def _budget_spent(self) -> bool:
        budget = self.cfg.run.time_budget_s
        train_s = self.records.train_time_s(time.perf_counter())
        return budget is not None and train_s >= budget

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_due(self) -> bool:
        every = self.cfg.run.checkpoint_interval_s
        return every is not None and time.monotonic() - self._last_checkpoint_t >= every

    def _save_final_checkpoint(self, reason: str | None, train_time_s: float,
                               prefer_rank: int | None = None, ask_learners: bool = True) -> Path | None:
        """final.pt from a learner between two updates (``state_between_updates`` runs beside a blocked
        iteration). After a stall, the stalled rank first: it is between updates, while the others may be inside
        an update, stuck in the all-reduce the stalled one never joined. Skipped (logged and counted) if no
        rank answers."""
        order = list(range(len(self.learners)))
        if prefer_rank is not None and prefer_rank in order:
            order.remove(prefer_rank)
            order.insert(0, prefer_rank)
        errors = [] if ask_learners else ["the group is gone"]
        for r in order if ask_learners else []:
            try:
                learner_state = runtime.get(self.learners[r].state_between_updates.remote(), timeout=LEARNER_STATE_S)
                ahead = learner_state.get("version", 0) - self._counted_version
                if ahead > 0:  # updates trained but never counted (an iteration in flight that did not finish)
                    errors.append(f"rank {r}'s weights hold {ahead} update(s) past the counters")
                    break
                return self._save_checkpoint(learner_state, reason, train_time_s)
            except checkpoint.NonFiniteCheckpoint as e:
                # The learners' state is not finite (the guard in the update should have made that impossible):
                # it is refused, the run counts as diverged, and final.pt is the newest finite state saved.
                errors.append(f"rank {r}: {e}")
                if not self.diverged:
                    self.diverged, self.failure = True, f"the final state was not finite: {e}"
                reason = "diverged"
                break
            except checkpoint.WriteFailed:
                raise  # the disk, not the learner: asking another rank writes the same bytes to it
            except Exception as e:  # noqa: BLE001 - dead, or stuck inside an update
                errors.append(f"rank {r}: {type(e).__name__}")
        # No learner left (the group died and could not come back): final.pt is the newest state this run saved,
        # whole: its weights with its own counters, so a resume trains the lost updates again instead of skipping
        # them under counters that had moved on.
        label, payload = self._restart_point(whole=True)
        if payload is not None:
            payload = dict(payload, stop_reason=reason, run_id=self.run_id)
            iteration = payload.get("run_state", {}).get("iteration", "?")
            path = self.files.save_final(payload)  # said once it is written
            self._say(f"final checkpoint: no learner state to match the counters ({', '.join(errors)}); final.pt is "
                      f"{label} (iteration "
                      f"{iteration}): the {self.state.iteration - iteration if isinstance(iteration, int) else 'later'}"
                      f" update(s) after it are not in it")
            return path
        self.state.checkpoints_skipped += 1
        self._say(f"final checkpoint skipped: no learner answered between updates ({', '.join(errors)})")
        return None

    def _save_checkpoint(self, learner_state: dict, reason: str | None, train_time_s: float) -> Path:
        """Periodic (``reason`` None) as ckpt-<iteration>.pt, keeping the newest K; final as final.pt."""
        payload = {
            "learner": learner_state,
            "run_state": self.state.to_checkpoint(),
            "train_time_s": train_time_s,
            "stop_reason": reason,
            "config": self.cfg.to_dict(),
            "versions": checkpoint.package_versions(),
            "run_id": self.run_id,
        }
        if reason is None:
            self._last_periodic = self.files.save_periodic(self.state.iteration, payload,
                                                           keep=self.cfg.run.keep_checkpoints)
            return self._last_periodic
        return self.files.save_final(payload)

    def _restart_point(self, whole: bool = False) -> tuple[str | None, dict | None]:
        """(what it is, its learner state, or with ``whole`` its whole payload) of the newest state this run
        saved: its newest periodic checkpoint, else the checkpoint it resumed from; (None, None) before either."""
        if self._last_periodic is not None:
            payload = checkpoint.load(self._last_periodic)
            return str(self._last_periodic), payload if whole else payload["learner"]
        if self.resume is not None:
            return "the checkpoint this run resumed from", self.resume if whole else self.resume["learner"]
        return None, None
