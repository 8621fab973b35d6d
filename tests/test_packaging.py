"""pyproject.toml against the Makefile and the installed packages: pins that only break on someone else's machine."""

import re
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirement(reqs: list[str], name: str) -> Requirement:
    found = [Requirement(r) for r in reqs if Requirement(r).name.replace("-", "_") == name]
    assert len(found) == 1, f"{name}: {found}"
    return found[0]


def makefile_torch_version() -> str:
    m = re.search(r"^TORCH_VERSION\s*\??=\s*(\S+)\s*$", (ROOT / "Makefile").read_text(), re.M)
    assert m, "Makefile sets no TORCH_VERSION"
    return m.group(1)


def test_npu_extra_pins_torch_npu_to_the_makefiles_torch():
    # torch_npu X.Y.Z (and its X.Y.Z.postN rebuilds) runs on torch X.Y.Z only.
    torch_v = Version(makefile_torch_version())
    spec = requirement(project()["optional-dependencies"]["npu"], "torch_npu").specifier
    major, minor, patch = torch_v.release
    assert spec.contains(str(torch_v)), (str(spec), str(torch_v))
    assert spec.contains(f"{torch_v}.post3"), f"{spec} refuses torch_npu's post-release rebuilds of {torch_v}"
    for other in (f"{major}.{minor}.{patch + 1}", f"{major}.{minor + 1}.0", f"{major}.{minor - 1}.0",
                  f"{major + 1}.0.0"):
        assert not spec.contains(other), f"{spec} admits torch_npu {other}, which needs another torch than {torch_v}"


def test_gymnasium_floor_has_autoreset_mode():
    spec = requirement(project()["dependencies"], "gymnasium").specifier
    assert not spec.contains("1.0.0"), f"gymnasium{spec} admits 1.0, which has no gymnasium.vector.AutoresetMode"
    assert spec.contains("1.1.0")
    installed = version("gymnasium")
    assert spec.contains(installed), (str(spec), installed)
    from gymnasium.vector import AutoresetMode

    assert AutoresetMode.SAME_STEP  # what actors/ build their vector envs with
