"""An env that calls ``os._exit`` ends its process at once: no exception for the rollout loop to catch, no atexit
handler, no word. On Ray the actor's death is all the driver sees (Ray's error names no exit code for it); in process
(``--address inprocess``) the env shares the driver's process, and the command would end with the env's exit code,
0 included: a run that stopped half-way reported as a success.

``install`` puts a guard in front of ``os._exit`` that says who called it before the process ends. In a Ray worker
(a rollout actor's process, all of it env code's) every call is said, one line on its stderr, which Ray forwards to
the driver's; in the driver's process only a call from a thread that runs env code (``ENV_THREADS``) is, and the command then ends with exit code 5 (run failed), not the env's.
The driver's own ``os._exit`` (the CLI's exit, the graceful stop's deadline) passes through untouched.
"""

from __future__ import annotations

import os
import sys
import threading

_real_exit = os._exit
#: Threads of the driver's process that run env code: a rollout actor's loop (``rollout-<id>``, actors/rollout.py),
#: the throwaway env made under a deadline (``env-make``, actors/envs.py), and the threads ``pipeline.runtime``
#: names after an in-process actor's class (the evaluator's episodes). A call from one of them is the env's.
ENV_THREADS = ("rollout-", "env-make", "RolloutActor-", "Evaluator-", "RemoteEvaluator-")
RUN_FAILED = 5  # cluster/exits.py's RUN_FAILED; actors/ does not import cluster/


def _in_ray_worker() -> bool:
    worker = sys.modules.get("ray._private.worker")
    if worker is None:
        return False
    try:
        return worker.global_worker.mode == worker.WORKER_MODE
    except AttributeError:
        return False


def _guarded_exit(code: int) -> None:
    if os.getpid() != _guarded_pid:  # a process forked from this one (a code env's program) ending itself
        _real_exit(code)
    thread = threading.current_thread().name
    if _in_ray_worker():
        print(f"an env called os._exit({code}) in this rollout actor's process (thread {thread}); the process ends "
              f"here and the run replaces the actor", file=sys.stderr, flush=True)
        _real_exit(code)
    if thread.startswith(ENV_THREADS):
        print(f"run failed: an env called os._exit({code}) in {thread}; in process (--address inprocess) the env's "
              f"code shares this process, so the run ends here without final.pt (the newest periodic checkpoint "
              f"holds what was learned); env.isolation: process or a Ray run contains it", file=sys.stderr,
              flush=True)
        _real_exit(RUN_FAILED)
    _real_exit(code)


#: The process the guard speaks for: a child forked from it (``actors/code_env.py`` runs each program so) inherits the
#: guard, and its ``os._exit`` ends only that child.
_guarded_pid: int | None = None


def install() -> None:
    """Guard ``os._exit`` in this process (idempotent)."""
    global _guarded_pid
    _guarded_pid = os.getpid()
    os._exit = _guarded_exit
