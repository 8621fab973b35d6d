"""EDF scheduler: results, ordering, the fast-worker reservation, starvation freedom, backpressure, close().

Timing-robust on a loaded 2-core machine: order and blocking are checked through gates (Events) and logical
properties (which job ran before which), and time bounds are generous.
"""

from __future__ import annotations

import threading
import time

import pytest

from pipeline.scheduler import EDFScheduler

TIMEOUT = 10.0  # seconds; only reached when something hangs


def wait_until(pred, timeout: float = TIMEOUT) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.002)


class Gate:
    """A job that occupies a worker until released; `started` says when a worker picked it up."""

    def __init__(self):
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, value=None):
        self.started.set()
        assert self.release.wait(TIMEOUT), "gate never released"
        return value


def test_results_and_exceptions_reach_the_caller_and_workers_survive():
    with EDFScheduler(num_workers=2) as sched:
        jobs = [sched.submit(pow, i, 2, fast=i % 2 == 0, budget_s=1.0, tag=f"j{i}") for i in range(10)]
        assert [j.result(TIMEOUT) for j in jobs] == [i * i for i in range(10)]
        assert all(j.done() for j in jobs)

        def boom(msg):
            raise ValueError(msg)

        bad = [sched.submit(boom, f"bad{i}", fast=i == 0, budget_s=1.0) for i in range(2)]
        for i, job in enumerate(bad):
            with pytest.raises(ValueError, match=f"bad{i}"):
                job.result(TIMEOUT)
            assert isinstance(job.exception(TIMEOUT), ValueError)
        # Both workers are still alive and serving after the failures.
        assert sched.submit(len, "abc", fast=True, budget_s=1.0).result(TIMEOUT) == 3
        assert all(t.is_alive() for t in sched._threads)
        m = sched.metrics()
        assert (m["fast"]["errors"], m["slow"]["errors"]) == (1, 1)


def test_result_timeout_raises_timeout_error():
    gate = Gate()
    with EDFScheduler(num_workers=1) as sched:
        job = sched.submit(gate, fast=True, budget_s=1.0, tag="held")
        with pytest.raises(TimeoutError, match="held"):
            job.result(timeout=0.05)
        assert not job.done()
        gate.release.set()
        job.result(TIMEOUT)


def test_jobs_run_in_deadline_order_across_both_queues():
    gate = Gate()
    ran: list[str] = []
    with EDFScheduler(num_workers=1, max_slow_workers=1) as sched:
        held = sched.submit(gate, fast=True, budget_s=0.0)
        assert gate.started.wait(TIMEOUT)
        # Budgets 0.1 s apart: enqueue-time differences (microseconds) cannot reorder them.
        budgets = {"a": 0.5, "b": 0.1, "c": 0.3, "d": 0.2, "e": 0.4, "f": 0.6}
        jobs = [sched.submit(ran.append, tag, fast=i % 2 == 0, budget_s=b, tag=tag)
                for i, (tag, b) in enumerate(budgets.items())]
        gate.release.set()
        for job in jobs:
            job.result(TIMEOUT)
        held.result(TIMEOUT)
    assert ran == ["b", "d", "c", "e", "a", "f"]
    assert ran == [j.tag for j in sorted(jobs, key=lambda j: j.deadline)]
    starts = [j.started_at for j in sorted(jobs, key=lambda j: j.deadline)]
    assert starts == sorted(starts)


def test_fast_jobs_run_while_the_slow_slots_are_busy():
    slow_gate = Gate()
    with EDFScheduler(num_workers=2) as sched:  # max_slow_workers defaults to 1
        assert sched.max_slow_workers == 1
        slow1 = sched.submit(slow_gate, "s1", fast=False, budget_s=0.0)
        assert slow_gate.started.wait(TIMEOUT)
        # slow2 has the earliest deadline of everything queued, but the only slow slot is taken: the free
        # worker must leave it queued and keep serving fast jobs.
        slow2 = sched.submit(str.upper, "s2", fast=False, budget_s=0.0)
        fast = [sched.submit(str.upper, f"f{i}", fast=True, budget_s=1.0) for i in range(5)]
        assert [f.result(TIMEOUT) for f in fast] == [f"F{i}" for i in range(5)]
        assert slow2.started_at is None and sched.metrics()["slow"]["depth"] == 1
        slow_gate.release.set()
        assert slow1.result(TIMEOUT) == "s1"
        assert slow2.result(TIMEOUT) == "S2"


def test_slow_job_is_not_starved_by_a_continuous_fast_stream():
    # One worker: the hardest case, every job competes for it. Each fast job re-submits itself when it runs,
    # so the fast queue never empties however the OS schedules threads (no feeder thread to fall behind);
    # a fast-first policy would starve the slow job forever. EDF runs it once its deadline is the earliest.
    stop = threading.Event()
    fast_jobs = []
    with EDFScheduler(num_workers=1, fast_capacity=16) as sched:
        def chained_fast_job():
            time.sleep(0.002)
            if not stop.is_set():
                fast_jobs.append(sched.submit(chained_fast_job, fast=True, budget_s=0.05))

        fast_jobs += [sched.submit(chained_fast_job, fast=True, budget_s=0.05) for _ in range(4)]
        wait_until(lambda: sched.metrics()["fast"]["completed"] >= 5)
        slow = sched.submit(time.sleep, 0.002, fast=False, budget_s=0.2, tag="slow")
        slow.result(TIMEOUT)  # starved -> TimeoutError
        stop.set()
        wait_until(lambda: all(j.done() for j in list(fast_jobs)))
    # The fast jobs waiting when the slow one started (three or four: the chain keeps four alive) ran after it.
    overtaken = [j for j in fast_jobs if j.enqueued_at < slow.started_at and j.started_at is not None
                 and j.started_at >= slow.finished_at]
    assert len(overtaken) >= 3, "the slow job did not overtake the queued fast jobs"
    assert all(j.deadline > slow.deadline for j in overtaken)


def test_full_queue_blocks_submit_and_counts_blocked_time():
    gate = Gate()
    with EDFScheduler(num_workers=1, fast_capacity=2, slow_capacity=2) as sched:
        held = sched.submit(gate, fast=True, budget_s=1.0)
        assert gate.started.wait(TIMEOUT)
        queued = [sched.submit(abs, -i, fast=True, budget_s=1.0) for i in range(2)]
        assert sched.metrics()["fast"]["depth"] == 2
        late: list = []
        called_at: list[float] = []

        def submit_into_full_queue():
            called_at.append(time.perf_counter())
            late.append(sched.submit(abs, -7, fast=True, budget_s=1.0))
            late.append(time.perf_counter())

        submitter = threading.Thread(target=submit_into_full_queue)
        submitter.start()
        wait_until(lambda: called_at)
        submitter.join(0.4)
        assert submitter.is_alive() and not late, "submit returned although the queue was full"
        # The other queue has its own bound: a slow job is still accepted without blocking.
        other = sched.submit(abs, -9, fast=False, budget_s=1.0)
        gate.release.set()
        submitter.join(TIMEOUT)
        assert not submitter.is_alive()
        assert late[0].result(TIMEOUT) == 7 and other.result(TIMEOUT) == 9
        assert [q.result(TIMEOUT) for q in queued] == [0, 1] and held.result(TIMEOUT) is None
        m = sched.metrics()
        # Blocked for the 0.4 s the gate stayed shut after submit was called (less a generous allowance for the
        # thread being descheduled before it reached the lock), and never longer than the call took.
        assert 0.25 <= m["fast"]["blocked_s"] <= late[1] - called_at[0]
        assert m["slow"]["blocked_s"] == 0.0
        assert m["fast"]["max_depth"] == 2


def test_inline_mode_runs_in_the_caller_and_is_measured():
    with EDFScheduler(num_workers=0) as sched:
        threads_before = threading.active_count()
        job = sched.submit(threading.current_thread, fast=True, budget_s=1.0)
        assert job.done() and job.result() is threading.current_thread()
        bad = sched.submit(int, "not a number", fast=False, budget_s=1.0)  # does not raise at submit
        with pytest.raises(ValueError):
            bad.result()
        sched.submit(time.sleep, 0.02, fast=False, budget_s=0.0)
        assert threading.active_count() == threads_before
        m = sched.metrics()
        assert (m["fast"]["completed"], m["slow"]["completed"]) == (1, 2)
        assert m["slow"]["deadline_misses"] == 1 and m["slow"]["errors"] == 1
        assert m["slow"]["service_p99_ms"] >= 15.0
        assert m["fast"]["wait_p99_ms"] < 1.0
    with pytest.raises(RuntimeError, match="scheduler closed"):
        sched.submit(abs, 1, fast=True, budget_s=1.0)


def test_close_fails_pending_jobs_and_blocked_submitters():
    gate = Gate()
    sched = EDFScheduler(num_workers=1, fast_capacity=2, name="closer")
    held = sched.submit(gate, "held", fast=True, budget_s=1.0)
    assert gate.started.wait(TIMEOUT)
    pending = [sched.submit(abs, -1, fast=True, budget_s=1.0) for _ in range(2)]
    pending.append(sched.submit(abs, -1, fast=False, budget_s=1.0))
    blocked_error: list = []

    def blocked_submit():
        try:
            sched.submit(abs, -1, fast=True, budget_s=1.0)
        except RuntimeError as e:
            blocked_error.append(e)

    submitter = threading.Thread(target=blocked_submit)
    submitter.start()
    submitter.join(0.1)
    assert submitter.is_alive()
    # close() joins the worker, which is still inside the gate job: run it in a thread and check that the
    # queued jobs fail right away, without waiting for the running one.
    closer = threading.Thread(target=sched.close)
    closer.start()
    for job in pending:
        with pytest.raises(RuntimeError, match="scheduler closed"):
            job.result(TIMEOUT)
        assert job.started_at is None
    submitter.join(TIMEOUT)
    assert blocked_error and "scheduler closed" in str(blocked_error[0])
    gate.release.set()
    closer.join(TIMEOUT)
    assert not closer.is_alive()
    assert held.result(TIMEOUT) == "held"  # the running job finished normally
    assert not any(t.is_alive() for t in sched._threads)
    m = sched.metrics()
    assert (m["fast"]["cancelled"], m["slow"]["cancelled"]) == (2, 1)
    sched.close()  # idempotent
    with pytest.raises(RuntimeError, match="scheduler closed"):
        sched.submit(abs, 1, fast=True, budget_s=1.0)


def test_worker_threads_are_named_daemons():
    with EDFScheduler(num_workers=3, name="prep") as sched:
        assert [t.name for t in sched._threads] == ["prep-0", "prep-1", "prep-2"]
        assert all(t.daemon and t.is_alive() for t in sched._threads)
        assert sched.max_slow_workers == 2
    assert not any(t.is_alive() for t in sched._threads)
    assert EDFScheduler(num_workers=1).max_slow_workers == 1


def test_metrics_counts_percentiles_and_deadline_misses():
    with EDFScheduler(num_workers=2) as sched:
        keys = {"depth", "max_depth", "running", "wait_p50_ms", "wait_p99_ms", "service_p50_ms", "service_p99_ms",
                "latency_p99_ms", "deadline_misses", "completed", "errors", "cancelled", "blocked_s"}
        assert set(sched.metrics()) == {"fast", "slow"}
        assert set(sched.metrics()["fast"]) == keys and set(sched.metrics()["slow"]) == keys
        roomy = [sched.submit(abs, -i, fast=True, budget_s=60.0) for i in range(20)]
        # A zero budget cannot be met by a job that sleeps 10 ms: every one is a miss.
        tight = [sched.submit(time.sleep, 0.01, fast=False, budget_s=0.0) for _ in range(6)]
        for job in roomy + tight:
            job.result(TIMEOUT)
        m = sched.metrics()
        assert (m["fast"]["completed"], m["slow"]["completed"]) == (20, 6)
        assert (m["fast"]["deadline_misses"], m["slow"]["deadline_misses"]) == (0, 6)
        slow = m["slow"]
        assert 9.0 <= slow["service_p50_ms"] <= slow["service_p99_ms"]
        assert slow["latency_p99_ms"] >= slow["service_p99_ms"] - 1e-6
        assert 0.0 <= slow["wait_p50_ms"] <= slow["wait_p99_ms"]
        # One slow slot: six queued 10 ms jobs, so the last one waited for (at least) most of the others.
        assert slow["wait_p99_ms"] >= 30.0
        assert m["slow"]["max_depth"] >= 1 and m["fast"]["depth"] == m["slow"]["depth"] == 0
        sched.reset_metrics()
        m = sched.metrics()
        assert m["fast"]["completed"] == m["slow"]["completed"] == 0
        assert m["slow"]["service_p99_ms"] == 0.0 and m["slow"]["max_depth"] == 0


def test_sample_windows_are_bounded():
    with EDFScheduler(num_workers=1, sample_window=4) as sched:
        for job in [sched.submit(time.sleep, 0.1, fast=True, budget_s=1.0) for _ in range(4)]:
            job.result(TIMEOUT)
        assert sched.metrics()["fast"]["service_p50_ms"] >= 95.0
        for job in [sched.submit(abs, 1, fast=True, budget_s=1.0) for _ in range(4)]:
            job.result(TIMEOUT)
        m = sched.metrics()["fast"]
        # The four 100 ms samples have left the window; the counters still cover all eight jobs.
        assert m["service_p99_ms"] < 50.0 and m["completed"] == 8
        assert len(sched._stats[True].service_s) == 4


def test_invalid_arguments_are_rejected():
    with pytest.raises(ValueError):
        EDFScheduler(num_workers=-1)
    with pytest.raises(ValueError):
        EDFScheduler(num_workers=2, fast_capacity=0)
    with pytest.raises(ValueError):
        EDFScheduler(num_workers=2, max_slow_workers=0)
    with EDFScheduler(num_workers=1) as sched:
        with pytest.raises(ValueError):
            sched.submit(abs, 1, fast=True, budget_s=-1.0)
