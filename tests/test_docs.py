"""The README and docs/ hold together: links, anchors, `make` targets and quoted paths all resolve.

Fast (no Ray, no training): it reads README.md and docs/*.md as text. Links are checked as GitHub renders them:
a relative path must name an existing file, and a `#anchor` must be the slug of a heading in the target file
(lowercase, spaces to '-', punctuation other than '-' and '_' dropped, duplicates numbered -1, -2, ...).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_MAKE = re.compile(r"(?:^|[\s;&|(])make\s+((?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*)([A-Za-z0-9][\w.-]*)")
_PATHS = re.compile(r"(?<![\w./-])((?:bench/[\w./-]+\.(?:py|sh))|(?:configs/[\w./-]+\.yaml))")
_TARGET = re.compile(r"^([A-Za-z0-9][\w.-]*(?:[ \t]+[A-Za-z0-9][\w.-]*)*)[ \t]*:(?!=)", re.M)


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md, every markdown page under docs/, and tests/README.md (the table of test files)."""
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    return pages + [p for p in [root / "tests" / "README.md"] if p.exists()]


def split_code(text: str) -> tuple[str, list[str]]:
    """(the prose with fenced blocks blanked out, the lines inside fenced code blocks)."""
    prose, code, fence = [], [], None
    for line in text.split("\n"):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            prose.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            else:
                code.append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), code


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link in a heading: its text
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file (numbered as GitHub numbers repeated headings)."""
    prose, _ = split_code(path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for line in prose.split("\n"):
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    out |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", prose))
    return out


def links(path: Path) -> list[str]:
    """Every link target in the file's prose (not in code blocks or code spans)."""
    prose, _ = split_code(path.read_text())
    prose = _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), prose)
    return _LINK.findall(prose)


def broken_links(files: list[Path], root: Path = ROOT) -> list[str]:
    """'file: target (why)' for each relative link whose file or heading does not exist."""
    problems = []
    for path in files:
        for target in links(path):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):   # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)}: {target}"
            if not dest.exists():
                problems.append(f"{where} (no file {dest})")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where} (no heading #{anchor} in {dest.name})")
            elif anchor and dest.suffix != ".md":
                problems.append(f"{where} (an anchor into a file that is not markdown)")
    return problems


def code_texts(path: Path) -> list[str]:
    """The text of every code span and every fenced code line: where commands are quoted."""
    prose, code = split_code(path.read_text())
    return [m.group(2) for m in _CODE_SPAN.finditer(prose)] + code


def make_targets(makefile: Path) -> set[str]:
    """Targets a Makefile defines (rules, and .PHONY's names)."""
    text = makefile.read_text()
    targets = set()
    for m in _TARGET.finditer(text):
        targets.update(m.group(1).split())
    for m in re.finditer(r"^\.PHONY\s*:(.*)$", text, re.M):
        targets.update(m.group(1).split())
    return targets


def quoted_make_targets(path: Path) -> set[str]:
    """`make <target>` in a code span or code block (prose such as "make fragments larger" is not a command)."""
    found = set()
    for text in code_texts(path):
        for line in text.split("\n"):
            for m in _MAKE.finditer(line):
                found.add(m.group(2))
    return found


# --------------------------------------------------------------------------- the repository's docs


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(path):
    assert broken_links([path]) == []


def test_readme_links_every_docs_page():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md") if t.startswith("docs/")}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert missing == [], f"docs pages the README's Documentation list does not link: {missing}"


def test_every_quoted_make_target_exists():
    targets = make_targets(ROOT / "Makefile")
    assert {"train", "test", "docs"} <= targets
    missing = {f"{p.relative_to(ROOT)}: make {t}" for p in doc_files() for t in quoted_make_targets(p) - targets}
    assert sorted(missing) == []


#: A removed script quoted where it lives in history: `git show <commit>:bench/<name>.py`.
_REMOVED = re.compile(r"git show ([0-9a-f]{7,40}):(bench/[\w./-]+\.(?:py|sh))")


def _git(*args: str, root: Path = ROOT) -> bool:
    """Whether ``git <args>`` succeeds in ``root``."""
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def missing_scripts(pages, root: Path = ROOT) -> list[str]:
    """'page: path' for each quoted bench script or config that neither exists nor is quoted on its page as
    removed (`git show <commit>:<path>`), and for each such commit that git has but holds no such file (a shallow
    clone without the commit cannot tell, and passes)."""
    out = set()
    for page in pages:
        text = page.read_text()
        removed = dict((path, rev) for rev, path in _REMOVED.findall(text))
        for q in _PATHS.findall(text):
            if (root / q).is_file():
                continue
            rev = removed.get(q)
            if rev is None or (_git("cat-file", "-e", f"{rev}^{{commit}}", root=root)
                               and not _git("cat-file", "-e", f"{rev}:{q}", root=root)):
                out.add(f"{page.name}: {q}")
    return sorted(out)


def test_every_quoted_bench_script_and_config_exists():
    assert missing_scripts(doc_files()) == []


def test_a_removed_script_must_say_where_it_lives_in_history(tmp_path):
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    if not head:
        pytest.skip("not a git checkout")
    page = tmp_path / "p.md"
    page.write_text(f"`bench/cartpole.py`; `bench/gone.py` (removed; `git show {head}:bench/gone.py`); "
                    f"`bench/nowhere.py`; `bench/ab.py` (removed; `git show {head}:bench/ab.py`)\n")
    assert missing_scripts([page]) == ["p.md: bench/gone.py", "p.md: bench/nowhere.py"]


#: The README is the front page: what it is, the two commands, one example, the headline figures, a diagram and
#: links fit in this many lines; details belong in docs/ and tests/README.md.
README_MAX_LINES = 120
#: A line a reader can take in without scrolling sideways (tables included).
README_MAX_LINE_CHARS = 200
#: What a reader cannot open: an issue number, or when in the build a figure was taken.
_HISTORY = re.compile(r"\bissues? #?\d+|\bsessions?\b|\bsittings?\b|^#+ .*\b20\d\d-\d\d-\d\d", re.I | re.M)


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().split("\n")
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    long = [i + 1 for i, line in enumerate(lines) if len(line) > README_MAX_LINE_CHARS]
    assert long == [], f"README.md lines over {README_MAX_LINE_CHARS} characters: {long}"


def test_every_test_file_has_a_row_in_tests_readme():
    text = (ROOT / "tests" / "README.md").read_text()
    rows = set(re.findall(r"^\| `(test_\w+\.py)` \|", text, re.M))
    files = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    assert sorted(files - rows) == [] and sorted(rows - files) == []


def test_docs_speak_of_the_system_not_of_its_history():
    found = [f"{p.relative_to(ROOT)}: {m.group(0)!r}" for p in doc_files()
             for m in _HISTORY.finditer(split_code(p.read_text())[0])]
    assert found == []


# --------------------------------------------------------------------------- the checker itself


def test_slug_follows_github():
    assert slug("Decisions worth knowing (and where they depart from the design notes)") == \
        "decisions-worth-knowing-and-where-they-depart-from-the-design-notes"
    assert slug("PPO details, each visible and tested") == "ppo-details-each-visible-and-tested"
    assert slug("Fast and slow queues (`pipeline/scheduler.py`)") == "fast-and-slow-queues-pipelineschedulerpy"
    assert slug("Multimodal (issue #3)") == "multimodal-issue-3"
    assert slug("snake_case and-dash") == "snake_case-and-dash"


def test_checker_catches_broken_links_and_anchors(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Page A\n\n## Two words\n\n```bash\n# not a heading\n```\n")
    (tmp_path / "README.md").write_text(
        "# Top\n\n"
        "[ok](docs/a.md) [ok](docs/a.md#two-words) [ok](#top) [web](https://example.com/x#y)\n"
        "[no file](docs/b.md) [no heading](docs/a.md#three-words) [code heading](docs/a.md#not-a-heading)\n"
        "[self](#nowhere) `[in code](docs/c.md)`\n"
        "```\n[in a block](docs/d.md)\n```\n")
    (tmp_path / "docs" / "back.md").write_text("[up](../README.md#top) [bad up](../README.md#bottom)\n")
    problems = broken_links(doc_files(tmp_path), tmp_path)
    bad = sorted(p.split(" (")[0] for p in problems)
    assert bad == ["README.md: #nowhere", "README.md: docs/a.md#not-a-heading", "README.md: docs/a.md#three-words",
                   "README.md: docs/b.md", "docs/back.md: ../README.md#bottom"], problems


def test_checker_finds_quoted_make_targets_only_in_code(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("Run `make train`, or `make test PYTEST_WORKERS=0`; make fragments larger.\n\n"
                    "```bash\nmake bench    # every benchmark\n.venv/bin/python x.py && make docs\n```\n")
    assert quoted_make_targets(page) == {"train", "test", "bench", "docs"}
    makefile = tmp_path / "Makefile"
    makefile.write_text(".PHONY: a b\nVAR := 1\nX ?= 2\na: dep\n\techo\nb c: | a\n\techo\n")
    assert make_targets(makefile) == {"a", "b", "c"}
