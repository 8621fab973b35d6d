"""The exit codes are one table (``cluster/exits.py``): ``--help`` prints it, ``docs/failures.md`` holds it, and every
code in it is asserted by a test that ends a real run (or a real refusal) that way."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from cluster import exits, train

ROOT = Path(__file__).resolve().parents[1]

#: Where each code is met through the CLI: the test that asserts it on a real process's exit status.
ASSERTED_BY = {
    exits.OK.code: "tests/test_integration.py",
    exits.TARGET_MISSED.code: "tests/test_integration.py",
    exits.BAD_INPUT.code: "tests/test_bad_input.py",
    exits.DIVERGED.code: "tests/test_nonfinite.py",
    exits.WRITE_FAILED.code: "tests/test_write_failures.py",
    exits.RUN_FAILED.code: "tests/test_layouts.py",
    exits.INTERRUPTED.code: "tests/test_layouts.py",
    exits.TERMINATED.code: "tests/test_layouts.py",
}


def test_help_prints_the_table():
    proc = subprocess.run([sys.executable, "-m", "cluster.train", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for e in exits.TABLE:
        assert f"{e.code} {e.name}: {' '.join(e.meaning.split())}" in text, e


def test_the_docs_hold_the_same_table():
    doc = (ROOT / "docs" / "failures.md").read_text()
    held = doc.split("<!-- exit-codes:start -->\n")[1].split("\n<!-- exit-codes:end -->")[0]
    assert held == exits.markdown(), "docs/failures.md's exit-code table differs from cluster/exits.py: copy it"


def test_the_codes_are_distinct_and_the_cli_uses_the_table():
    codes = [e.code for e in exits.TABLE]
    assert len(set(codes)) == len(codes)
    assert (train.EXIT_OK, train.EXIT_TARGET_MISSED, train.EXIT_CONFIG, train.EXIT_DIVERGED, train.EXIT_WRITE_FAILED,
            train.EXIT_RUN_FAILED, train.EXIT_INTERRUPTED, train.EXIT_TERMINATED) == tuple(codes)


def test_every_code_is_asserted_on_a_real_exit_by_a_test():
    """A code no test ends a process with is a promise nobody checks: each one's test must assert it."""
    assert set(ASSERTED_BY) == {e.code for e in exits.TABLE}
    for code, path in ASSERTED_BY.items():
        text = (ROOT / path).read_text()
        names = [e for e in exits.TABLE if e.code == code]
        by_name = any(f"exits.{n}.code" in text for n in ("OK", "TARGET_MISSED", "BAD_INPUT", "DIVERGED",
                                                          "WRITE_FAILED", "RUN_FAILED", "INTERRUPTED", "TERMINATED")
                      if getattr(exits, n) in names)
        by_number = re.search(rf"returncode == {code}\b|signal\.SIG\w+: {code}[,}}]", text)  # or per signal
        assert by_name or by_number, f"{path} asserts no exit code {code} ({names[0].name})"
