"""Earliest-deadline-first scheduler for preprocessing jobs of multi-rate modalities.

Observations arrive at two very different rates. Per-step ("fast") modalities,
such as the camera frames of every env, sit on the action's critical path: the
policy cannot act until they are decoded. Low-rate ("slow") modalities, such as a
high-resolution frame every few steps or a point cloud once per episode, are
heavier but can arrive a little late. One scheduler serves both with a single
pool of worker threads:

* two bounded queues (``fast`` and ``slow``), each a heap ordered by deadline
  (enqueue time + the job's budget). A free worker compares the two heads and
  runs the one with the earlier deadline (EDF);
* jobs are not preempted, so a long slow job that starts just before a fast one
  arrives would delay it by a whole service time. To prevent that a worker only
  takes a slow job while fewer than ``max_slow_workers`` workers are busy with
  slow jobs (default ``num_workers - 1``): with two or more workers one of them
  is always free for fast work;
* slow work still never starves: its deadline does not move, fast jobs that
  arrive later eventually have later deadlines, and whenever the slow head is
  the earliest deadline and a slow slot is free it runs;
* ``submit`` blocks while the target queue is full, so a producer that outruns
  the workers gets backpressure instead of unbounded memory; the time it spent
  blocked is counted per queue;
* nothing waits on the workers without a deadline: a job that runs for
  ``hung_job_s`` is a hung one, so ``submit`` on a queue that stayed full that
  long and ``close`` with a worker still inside a job after it raise
  ``TimeoutError`` naming the jobs running (the worker threads are daemons:
  a hung one is left behind, not waited for).

With ``num_workers == 0`` the scheduler runs each job in the caller during
``submit`` (the unpipelined baseline), measured the same way.

Timestamps on ``Job`` (``enqueued_at``, ``deadline``, ``started_at``,
``finished_at``) are ``time.perf_counter()`` seconds. The work itself should
release the GIL (cv2, numpy, torch kernels) for threads to run in parallel.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque

import numpy as np

from pipeline.timing import Stopwatch

SAMPLE_WINDOW = 4096  # per-queue latency samples kept for percentiles (bounded memory on long runs)
#: A job running this long is a hung one (a decoder stuck in native code, a remote worker gone quiet): the same bound
#: as a rollout's wait for one job's result (pipeline.observations.PREPROCESS_TIMEOUT_S). A full queue gets room as
#: soon as a worker takes its next job, so a producer blocked this long, or a close() still waiting this long for a
#: worker, waits on a hung job.
HUNG_JOB_S = 60.0


class Job:
    """One submitted call: its timing, and a handle to wait for its result."""

    def __init__(self, fn, args: tuple, fast: bool, budget_s: float, tag: str, enqueued_at: float):
        self.fast = fast
        self.tag = tag
        self.budget_s = budget_s
        self.enqueued_at = enqueued_at
        self.deadline = enqueued_at + budget_s
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self._fn = fn
        self._args = args
        self._value = None
        self._error: BaseException | None = None
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None):
        """The function's return value; re-raises its exception here, in the caller's thread."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"job {self.tag!r} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"job {self.tag!r} did not finish within {timeout} s")
        return self._error

    def _run(self) -> None:
        self.started_at = time.perf_counter()
        try:
            self._value = self._fn(*self._args)
        except BaseException as e:  # noqa: BLE001 - any failure belongs to the caller, never to the worker
            self._error = e
        self.finished_at = time.perf_counter()
        # The inputs are often large arrays (encoded frames); a finished job that the caller keeps around
        # should not keep them alive too.
        self._fn = self._args = None

    def _cancel(self, error: BaseException) -> None:
        self._error = error
        self._fn = self._args = None


class _QueueStats:
    """Counters and bounded sample windows of one queue. Guarded by the scheduler's lock."""

    def __init__(self, window: int):
        self.wait_s: deque[float] = deque(maxlen=window)
        self.service_s: deque[float] = deque(maxlen=window)
        self.latency_s: deque[float] = deque(maxlen=window)
        self.reset(depth=0)

    def reset(self, depth: int) -> None:
        self.wait_s.clear()
        self.service_s.clear()
        self.latency_s.clear()
        self.max_depth = depth
        self.deadline_misses = 0
        self.completed = 0
        self.errors = 0
        self.cancelled = 0
        self.blocked_s = 0.0

    def record(self, job: Job) -> None:
        self.wait_s.append(job.started_at - job.enqueued_at)
        self.service_s.append(job.finished_at - job.started_at)
        self.latency_s.append(job.finished_at - job.enqueued_at)
        self.completed += 1
        self.errors += job._error is not None
        self.deadline_misses += job.finished_at > job.deadline


def _percentile_ms(samples: list[float], q: float) -> float:
    # 0.0 with no samples rather than NaN/None: callers format these numbers, and `completed` says whether
    # there was anything to measure.
    return float(np.percentile(samples, q) * 1e3) if samples else 0.0


class EDFScheduler:
    """Two bounded EDF queues (fast, slow) served by one pool of worker threads."""

    def __init__(self, num_workers: int = 2, fast_capacity: int = 64, slow_capacity: int = 64,
                 max_slow_workers: int | None = None, name: str = "preprocess", sample_window: int = SAMPLE_WINDOW,
                 hung_job_s: float = HUNG_JOB_S):
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if fast_capacity < 1 or slow_capacity < 1:
            raise ValueError(f"queue capacities must be >= 1, got fast={fast_capacity} slow={slow_capacity}")
        if max_slow_workers is None:
            max_slow_workers = max(1, num_workers - 1)
        if max_slow_workers < 1:
            # Zero would leave slow jobs queued forever.
            raise ValueError(f"max_slow_workers must be >= 1, got {max_slow_workers}")
        if not hung_job_s > 0:
            raise ValueError(f"hung_job_s must be > 0, got {hung_job_s}")
        self.name = name
        self.hung_job_s = hung_job_s
        self.num_workers = num_workers
        self.max_slow_workers = max_slow_workers
        self._capacity = {True: fast_capacity, False: slow_capacity}
        self._lock = threading.Lock()
        # Workers wait on `_work`; producers wait on their queue's `_space`. One lock keeps the queues, the
        # slow-slot count and the stats consistent with each other.
        self._work = threading.Condition(self._lock)
        self._space = {True: threading.Condition(self._lock), False: threading.Condition(self._lock)}
        self._heaps: dict[bool, list] = {True: [], False: []}
        self._running = {True: 0, False: 0}
        self._in_service: set[Job] = set()  # the jobs the workers run now (what a timeout names)
        self._stats = {True: _QueueStats(sample_window), False: _QueueStats(sample_window)}
        self._seq = itertools.count()  # tie-break for equal deadlines: submission order
        self._closed = False
        self._threads = [threading.Thread(target=self._worker_loop, name=f"{name}-{i}", daemon=True)
                         for i in range(num_workers)]
        for t in self._threads:
            t.start()

    # -- producer side -------------------------------------------------------------------------------------

    def submit(self, fn, *args, fast: bool, budget_s: float, tag: str = "") -> Job:
        """Queue ``fn(*args)`` with deadline now + ``budget_s``; blocks while that queue is full, for at most
        ``hung_job_s`` (then ``TimeoutError``: the workers are stuck in hung jobs)."""
        if budget_s < 0:
            raise ValueError(f"budget_s must be >= 0, got {budget_s}")
        fast = bool(fast)
        stats = self._stats[fast]
        if self.num_workers == 0:
            with self._lock:
                if self._closed:
                    raise RuntimeError("scheduler closed")
            job = Job(fn, args, fast, budget_s, tag, time.perf_counter())
            job._run()
            with self._lock:
                stats.record(job)
            job._done.set()
            return job
        heap = self._heaps[fast]
        with self._lock:
            if self._closed:
                raise RuntimeError("scheduler closed")
            if len(heap) >= self._capacity[fast]:
                with Stopwatch() as sw:
                    give_up = time.monotonic() + self.hung_job_s
                    while len(heap) >= self._capacity[fast] and not self._closed:
                        left = give_up - time.monotonic()
                        if left <= 0:
                            break
                        self._space[fast].wait(left)
                stats.blocked_s += sw.s
                if self._closed:
                    raise RuntimeError("scheduler closed")
                if len(heap) >= self._capacity[fast]:
                    raise TimeoutError(f"{self.name}: the {'fast' if fast else 'slow'} queue stayed full "
                                       f"({self._capacity[fast]} jobs) for {self.hung_job_s:g} s: no worker took a "
                                       f"job; running: {self._running_locked()}")
            # The deadline starts when the job enters the queue, not when submit was called: time spent
            # blocked is the producer's backpressure (blocked_s), not queueing delay the workers caused.
            job = Job(fn, args, fast, budget_s, tag, time.perf_counter())
            heapq.heappush(heap, (job.deadline, next(self._seq), job))
            stats.max_depth = max(stats.max_depth, len(heap))
            self._work.notify()
        return job

    # -- worker side ---------------------------------------------------------------------------------------

    def _eligible_head(self, fast: bool):
        heap = self._heaps[fast]
        if not heap:
            return None
        if not fast and self._running[False] >= self.max_slow_workers:
            return None
        return heap[0]

    def _take_locked(self) -> Job | None:
        fast_head, slow_head = self._eligible_head(True), self._eligible_head(False)
        if fast_head is None and slow_head is None:
            return None
        # (deadline, seq) comparison: earlier deadline wins, equal deadlines go in submission order.
        fast = slow_head is None or (fast_head is not None and fast_head[:2] < slow_head[:2])
        _, _, job = heapq.heappop(self._heaps[fast])
        self._running[fast] += 1
        self._in_service.add(job)
        self._space[fast].notify()
        if self._eligible_head(True) is not None or self._eligible_head(False) is not None:
            # More runnable work: make sure another idle worker looks at it (notify wakes only one per submit,
            # and that one may have taken a different job than the one it was woken for).
            self._work.notify()
        return job

    def _worker_loop(self) -> None:
        while True:
            with self._lock:
                job = None if self._closed else self._take_locked()
                while job is None:
                    if self._closed:
                        return
                    self._work.wait()
                    job = None if self._closed else self._take_locked()
            job._run()
            with self._lock:
                self._running[job.fast] -= 1
                self._in_service.discard(job)
                self._stats[job.fast].record(job)
                if not job.fast:
                    self._work.notify()  # a slow slot opened: an idle worker may now take a queued slow job
            # Stats first, then wake the waiter: a caller that reads metrics() right after result() sees its job.
            job._done.set()

    def _running_locked(self) -> str:
        """The jobs in service, in words (oldest first), for a timeout's one line."""
        now = time.perf_counter()
        jobs = sorted(self._in_service, key=lambda j: j.started_at or now)
        return ", ".join(f"{j.tag or 'untagged'!r} ({'fast' if j.fast else 'slow'}) for "
                         f"{now - (j.started_at or now):.1f} s" for j in jobs) or "none"

    # -- metrics and lifecycle -----------------------------------------------------------------------------

    def metrics(self) -> dict:
        """Per queue ("fast", "slow"): depth now, max_depth, running, wait/service percentiles (enqueue -> start,
        start -> finish), latency_p99_ms (enqueue -> finish), deadline_misses (finished after the deadline),
        completed (including jobs whose function raised), errors, cancelled (failed by close), blocked_s
        (time submit spent waiting for room). Percentiles cover the last ``sample_window`` jobs; 0.0 if none."""
        with self._lock:
            snap = {}
            for fast, key in ((True, "fast"), (False, "slow")):
                s = self._stats[fast]
                snap[key] = (len(self._heaps[fast]), self._running[fast], list(s.wait_s), list(s.service_s),
                             list(s.latency_s), s.max_depth, s.deadline_misses, s.completed, s.errors,
                             s.cancelled, s.blocked_s)
        out = {}
        for key, (depth, running, wait, service, latency, max_depth, misses, completed, errors, cancelled,
                  blocked) in snap.items():
            out[key] = {
                "depth": depth,
                "max_depth": max_depth,
                "running": running,
                "wait_p50_ms": _percentile_ms(wait, 50),
                "wait_p99_ms": _percentile_ms(wait, 99),
                "service_p50_ms": _percentile_ms(service, 50),
                "service_p99_ms": _percentile_ms(service, 99),
                "latency_p99_ms": _percentile_ms(latency, 99),
                "deadline_misses": misses,
                "completed": completed,
                "errors": errors,
                "cancelled": cancelled,
                "blocked_s": blocked,
            }
        return out

    def reset_metrics(self) -> None:
        """Start a fresh measurement window (e.g. after warm-up); max_depth restarts from the current depth."""
        with self._lock:
            for fast in (True, False):
                self._stats[fast].reset(depth=len(self._heaps[fast]))

    def close(self, timeout: float | None = None) -> None:
        """Stop the workers and fail every still-queued job with RuntimeError("scheduler closed").

        Jobs already running finish normally (they cannot be preempted); producers blocked in submit get
        the same RuntimeError. Idempotent. ``timeout`` (default ``hung_job_s``) bounds the wait for the workers to
        finish their jobs, all together; a worker still inside its job then is left behind (a daemon) and
        ``TimeoutError`` names the jobs running.
        """
        timeout = self.hung_job_s if timeout is None else timeout
        with self._lock:
            self._closed = True
            pending = [job for fast in (True, False) for _, _, job in self._heaps[fast]]
            for fast in (True, False):
                self._stats[fast].cancelled += sum(job.fast == fast for job in pending)
                self._heaps[fast].clear()
                self._space[fast].notify_all()
            self._work.notify_all()
        for job in pending:
            job._cancel(RuntimeError("scheduler closed"))
            job._done.set()
        me = threading.current_thread()
        give_up = time.monotonic() + timeout
        for t in self._threads:
            if t is not me:  # close() called from inside a job must not join its own thread
                t.join(max(0.0, give_up - time.monotonic()))
        with self._lock:
            # A worker still alive with no job in service is only on its way out; one inside a job is hung.
            running = self._running_locked() if self._in_service else None
        if running is not None and any(t.is_alive() for t in self._threads if t is not me):
            raise TimeoutError(f"{self.name}: closed, but a worker was still inside its job after {timeout:g} s "
                               f"(left behind); running: {running}")

    def __enter__(self) -> EDFScheduler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
