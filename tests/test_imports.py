"""The packages import in one direction: ``cluster`` on top of ``actors`` and ``learner``, ``pipeline`` at the
bottom, and no two modules importing each other (at module level or inside a function: a lazy import is still a
dependency that a later move turns into a circular import at load time). Read from the source with ``ast``."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("actors", "learner", "pipeline", "cluster")
#: What each package may import of the others: cluster is the top (the config, driver, supervisor, CLI).
BELOW_CLUSTER = ("actors", "learner", "pipeline")


def module_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).glob("*.py")):
            files[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return files


def imported(name: str, source: str, package_init: bool = False) -> set[str]:
    """Every module name module ``name`` (its ``source``) imports anywhere in its body, with ``from X import y``
    giving both X and X.y (y may be a module); relative imports resolved against the module's package."""
    package = name if package_init else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def graph() -> dict[str, set[str]]:
    """Module -> the project's modules (and names in them) it imports."""
    return {name: {m for m in imported(name, path.read_text(), path.stem == "__init__")
                   if m.split(".")[0] in PACKAGES and m != name}
            for name, path in module_files().items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each one import circle."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_nothing_below_cluster_imports_cluster():
    upward = sorted(f"{src} imports {dst}" for src, dsts in graph().items() if src.split(".")[0] in BELOW_CLUSTER
                    for dst in dsts if dst.split(".")[0] == "cluster")
    assert not upward, upward


def test_no_import_cycle():
    assert not cycles(graph())


def test_the_scan_sees_lazy_relative_and_upward_imports():
    """The scan itself: an import inside a function, a relative one and a plain ``import cluster.x`` all count, and
    a two-module circle is found."""
    src = "def f():\n    from cluster.config import ConfigError\n    from . import envs\n    import cluster.driver\n"
    names = imported("actors.probe", src)
    assert {"cluster.config", "cluster.config.ConfigError", "actors.envs", "cluster.driver"} <= names
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_config_error_is_one_class_everywhere():
    """``cluster.config.ConfigError`` is the class the envs raise: ``except ConfigError`` catches both."""
    from actors.envs import describe_env
    from cluster.config import ConfigError

    with pytest.raises(ConfigError, match="env.id"):
        describe_env("NoSuchEnv-v0")
