"""bench/ holds benches whose figures the docs quote: every bench script is named by README.md or a page under
docs/ (``bench/<name>.py``), so a bench that no document quotes is noticed and removed rather than kept. The
harness modules (``bench/_*.py``) are the benches' shared code and are quoted through them. Fast: text only."""

from __future__ import annotations

import re

from tests.test_docs import ROOT, _PATHS, doc_files


def bench_scripts(root=ROOT) -> list[str]:
    return sorted(f"bench/{p.name}" for p in (root / "bench").glob("*.py") if not p.name.startswith("_"))


def unquoted(scripts: list[str], pages) -> list[str]:
    quoted = {q for page in pages for q in _PATHS.findall(page.read_text())}
    return [s for s in scripts if s not in quoted]


def test_every_bench_is_quoted_by_a_document():
    assert unquoted(bench_scripts(), doc_files()) == []


def test_an_unquoted_bench_is_found(tmp_path):
    page = tmp_path / "results.md"
    page.write_text("`.venv/bin/python bench/cartpole.py` gives 475 at 71,680 env steps (see bench/)\n")
    assert unquoted(["bench/cartpole.py", "bench/layouts.py", "bench/cartpole_old.py"], [page]) == [
        "bench/layouts.py", "bench/cartpole_old.py"]
    assert re.fullmatch(r"bench/\w+\.py", bench_scripts()[0])
