"""What a config would import and run, and the rule that a stored config runs no code unless the user trusts it.

A run directory and a checkpoint are files people copy between machines and colleagues; the config stored with
them (``config.yaml``, a checkpoint's ``config``) may name modules. Making its env imports them: a ``module:Id`` env
id (gymnasium imports the module) and every ``env.wrappers`` entry (imported and called). So wherever a stored
config makes an env (``--resume`` without ``--config``, ``load_policy``, ``cluster.evaluate``, ``cluster.export``),
those names are refused unless the user said to trust them (``--trust-code`` / ``trust_code=True``). A config the
user passes in is theirs, and runs as written. Registered gymnasium ids import nothing and need no trust, and
this project's own modules (``actors.probe_envs:...``) are the code that runs anyway.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from cluster.config import Config, ConfigError

PROJECT_ROOT = Path(__file__).resolve().parent.parent
PROJECT_PACKAGES = ("actors", "cluster", "learner", "pipeline")


def own_module(name: str) -> bool:
    """``name`` is in one of this project's packages as installed here (the probe envs, the multi-rate env): code
    that runs with every run anyway. Found without importing anything: a same-named folder elsewhere on sys.path
    (a copied run directory's) does not count."""
    top = name.split(".")[0]
    if top not in PROJECT_PACKAGES:
        return False
    spec = importlib.util.find_spec(top)  # a top-level name: found, not executed
    origin = spec.origin if spec is not None else None
    return origin is not None and Path(origin).resolve().parent.parent == PROJECT_ROOT


def code_to_import(cfg: Config) -> list[str]:
    """What making ``cfg``'s env imports beyond registered gymnasium ids and this project's own modules, one phrase
    each."""
    module = cfg.env.id.partition(":")[0]
    found = [f"env.id {cfg.env.id!r} imports module {module!r}"] if ":" in cfg.env.id and not own_module(module) else []
    return found + [f"env.wrappers[{i}] imports and calls {w.path!r}" for i, w in enumerate(cfg.env.wrappers)
                    if not own_module(w.path.partition(":")[0])]


def refuse_untrusted(cfg: Config, stored: str, allowed: str) -> None:
    """ConfigError (one line) naming what ``cfg`` would import, unless it imports nothing. ``stored``: where the
    config came from, as the line's subject ("<path>: the config stored in this checkpoint")."""
    imports = code_to_import(cfg)
    if imports:
        raise ConfigError(f"{stored} would run code to make its env ({'; '.join(imports)}); allowed: {allowed}")
