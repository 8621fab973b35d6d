"""The exit codes of ``python -m cluster.train``: one table, printed by ``--help`` and copied into
``docs/failures.md`` (``tests/test_exit_codes.py`` holds both to it and runs each code).

A scheduler, a script or a person reads the code in the morning instead of the log: each code names one outcome,
and the last stderr line says the rest. The other commands (evaluate, export, report, control, doctor, tune) use
0 and 2 in the same sense, and 1 for "asked, but the answer is no" (a failed trial, a silent run, a doctor error).
"""

from __future__ import annotations

from typing import NamedTuple


class ExitCode(NamedTuple):
    code: int
    name: str
    meaning: str


OK = ExitCode(0, "done", "the run ended as configured (its steps, time budget or target reached)")
TARGET_MISSED = ExitCode(1, "target not reached", "run.require_target is set and the target was not reached")
BAD_INPUT = ExitCode(2, "bad input", "a config, flag, checkpoint or run directory was refused before training; "
                                     "one line says which and what is allowed")
DIVERGED = ExitCode(3, "diverged", "run.max_nonfinite_updates updates in a row were not finite; "
                                   "final.pt holds the last finite state")
WRITE_FAILED = ExitCode(4, "write failed", "a file the run promises could not be written (disk full, quota, "
                                           "read-only, I/O error); the last good checkpoint is kept, --resume it")
RUN_FAILED = ExitCode(5, "run failed", "a part could not be replaced (the cluster lost, a learner failing, "
                                       "a bug); final.pt holds what was learned")
INTERRUPTED = ExitCode(130, "interrupted", "Ctrl-C (SIGINT): final checkpoint, report, shutdown")
TERMINATED = ExitCode(143, "terminated", "SIGTERM (a scheduler, ray job stop): final checkpoint, report, shutdown")

TABLE = (OK, TARGET_MISSED, BAD_INPUT, DIVERGED, WRITE_FAILED, RUN_FAILED, INTERRUPTED, TERMINATED)


def help_text() -> str:
    """The table as ``--help``'s epilog."""
    return "exit codes:\n" + "\n".join(f"  {e.code:>3}  {e.name}: {e.meaning}" for e in TABLE)


def markdown() -> str:
    """The table as docs/failures.md holds it."""
    rows = "\n".join(f"| {e.code} | {e.name} | {e.meaning} |" for e in TABLE)
    return "| exit code | outcome | meaning |\n|---|---|---|\n" + rows
