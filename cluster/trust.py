"""What a config would import and run, and the rule that a stored config runs no code unless the user trusts it.

A run directory and a checkpoint are files people copy between machines and colleagues; the config stored with
them (``config.yaml``, a checkpoint's ``config``) may name modules. Making its env imports them: a ``module:Id`` env
id (gymnasium imports the module) and every ``env.wrappers`` entry (imported and called). So wherever a stored
config makes an env (``--resume`` without ``--config``, ``load_policy``, ``cluster.evaluate``, ``cluster.export``),
those names are refused unless the user said to trust them (``--trust-code`` / ``trust_code=True``). A config the
user passes in is theirs, and runs as written. Registered gymnasium ids import nothing and need no trust.
"""

from __future__ import annotations

from cluster.config import Config, ConfigError


def code_to_import(cfg: Config) -> list[str]:
    """What making ``cfg``'s env imports beyond registered gymnasium ids, one phrase each."""
    found = [f"env.id {cfg.env.id!r} imports module {cfg.env.id.partition(':')[0]!r}"] if ":" in cfg.env.id else []
    return found + [f"env.wrappers[{i}] imports and calls {w.path!r}" for i, w in enumerate(cfg.env.wrappers)]


def refuse_untrusted(cfg: Config, where: str, allowed: str) -> None:
    """ConfigError (one line) naming what ``cfg``, stored at ``where``, would import, unless it imports nothing."""
    imports = code_to_import(cfg)
    if imports:
        raise ConfigError(f"{where}: the config stored there would run code to make its env ({'; '.join(imports)}); "
                          f"allowed: {allowed}")
