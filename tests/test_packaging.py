"""pyproject.toml against the Makefile and the installed packages: pins that only break on someone else's machine."""

import functools
import re
import subprocess
import sys
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


# ------------------------------------------------------------------ the core install against the core's imports
PACKAGES = ("actors", "learner", "pipeline", "cluster")
#: Core dependencies the core imports only inside a function, which the default config still needs (the name
#: imported): run.loggers' default sinks are jsonl and tensorboard, and a run ends with its report.png.
NEEDED_LAZILY = {"tensorboard": "torch.utils.tensorboard", "matplotlib": "matplotlib"}
#: Core modules that load only for an optional feature, never on the default config's path (checked below by
#: importing that path): their imports are the feature's extra, as a lazy import is. Dict observations' processors
#: and the multi-rate sensor env decode and resize images with OpenCV (the multimodal extra).
FEATURE_MODULES = {"pipeline.modality": "multimodal", "actors.multirate_env": "multimodal"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def third_party_imports() -> dict[str, set[str]]:
    """{"module": top-level third-party modules the core imports when its module loads, "lazy": those imported
    only inside a function or a try block, or by a FEATURE_MODULES module (an optional feature), "names": every
    dotted name imported}."""
    import ast
    import sys

    own = set(PACKAGES) | {"__future__"}
    found = {"module": set(), "lazy": set(), "names": set()}
    for package in PACKAGES:
        for path in sorted((ROOT / package).glob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            at_load = set() if f"{package}.{path.stem}" in FEATURE_MODULES else {id(n) for n in tree.body}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in own or top in sys.stdlib_module_names:
                        continue
                    found["names"].add(name)
                    found["module" if id(node) in at_load else "lazy"].add(top)
    found["lazy"] -= found["module"]
    return found


@functools.lru_cache(maxsize=1)
def module_distributions() -> dict:
    from importlib.metadata import packages_distributions

    return packages_distributions()  # reads every installed distribution's file list: once


def distribution(module: str) -> str:
    dists = module_distributions().get(module)
    return norm(dists[0]) if dists else norm(module)


def test_core_dependencies_are_what_the_core_imports():
    """Every package a core module imports as it loads is a core dependency, and every core dependency is imported
    by the core: the install `make train` runs is what training needs, no more."""
    imports = third_party_imports()
    core = {norm(Requirement(r).name) for r in project()["dependencies"]}
    at_load = {distribution(m) for m in imports["module"]}
    assert at_load <= core, f"imported as the core loads but not a core dependency: {sorted(at_load - core)}"
    for dep, name in NEEDED_LAZILY.items():
        imported = any(n == name or n.startswith(f"{name}.") for n in imports["names"])
        assert imported, f"{dep}: the core imports no {name}"
    needed = at_load | set(NEEDED_LAZILY)
    assert core <= needed, f"core dependencies the default config's training does not import: {sorted(core - needed)}"


def test_optional_imports_are_extras_that_the_errors_name():
    """A package the core imports only where a feature needs it is a core dependency or has its extra in
    pipeline.errors.EXTRAS (what the one-line error names), and that extra's requirements install it."""
    from pipeline.errors import EXTRAS

    extras = project()["optional-dependencies"]
    core = {norm(Requirement(r).name) for r in project()["dependencies"]}

    def provides(reqs: list[str], module: str) -> bool:
        parsed = [Requirement(r) for r in reqs]
        return any(norm(r.name) == distribution(module) or module in r.extras for r in parsed)

    for module in sorted(third_party_imports()["lazy"]):
        if distribution(module) not in core:
            assert module in EXTRAS, f"{module}: imported for an optional feature, with no extra in errors.EXTRAS"
    for module, extra in EXTRAS.items():
        assert extra in extras, f"pipeline.errors.EXTRAS[{module!r}]: no extra {extra!r} in pyproject.toml"
        assert provides(extras[extra], module), f"the {extra} extra does not install {module}"


def test_the_test_extra_has_every_extra_the_suite_exercises():
    """`make test` installs the test extra only, so it lists the packages of every extra the tests use."""
    extras = project()["optional-dependencies"]
    test = {norm(Requirement(r).name) for r in extras["test"]}
    for name in ("multimodal", "minigrid", "multiagent", "envpool", "export", "wandb", "mlflow", "video", "tune"):
        missing = {norm(Requirement(r).name) for r in extras[name]} - test
        assert not missing, f"the test extra lacks the {name} extra's {sorted(missing)}"


def test_the_default_path_loads_no_feature_module():
    """What a default run loads (the driver, the CLI, the actors and the data plane) imports no FEATURE_MODULES
    module and none of their packages, so the core install runs it."""
    code = ("import sys\n"
            "import cluster.train, cluster.driver, cluster.api, cluster.report, cluster.metrics, actors.rollout, "
            "actors.sampler, actors.evaluator, learner.actor, pipeline.feed, pipeline.relay, pipeline.replay, "
            "pipeline.supply\n"
            f"print(sorted(m for m in {sorted(FEATURE_MODULES) + ['cv2']!r} if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def makefile_rule(target: str) -> tuple[str, str]:
    """(prerequisites, recipe) of ``target`` in the Makefile."""
    text = (ROOT / "Makefile").read_text()
    m = re.search(rf"^{re.escape(target)}:([^\n]*)\n((?:\t[^\n]*\n)*)", text, re.M)
    assert m, f"Makefile has no rule for {target}"
    return m.group(1), m.group(2)


def test_make_train_installs_the_core_and_make_test_the_test_extra():
    prereqs, _ = makefile_rule("train")
    assert prereqs.split() == ["$(STAMP)"], prereqs
    _, recipe = makefile_rule("$(STAMP)")
    installs = [line for line in recipe.splitlines() if "pip install" in line]
    assert any(line.rstrip().endswith("-e .") for line in installs), recipe
    assert not any("[" in line for line in installs), f"make train installs an extra: {installs}"
    for target in ("test", "test-fast", "test-long"):
        assert "$(TEST_STAMP)" in makefile_rule(target)[0].split(), target
    prereqs, recipe = makefile_rule("$(TEST_STAMP)")
    assert "$(STAMP)" in prereqs.split() and "-e '.[test]'" in recipe, recipe
