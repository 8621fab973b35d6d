"""What a config would import, run or reach, and the rule that a stored config does none of it unless the user
trusts it.

A run directory and a checkpoint are files people copy between machines and colleagues; the config stored with
them (``config.yaml``, a checkpoint's ``config``) may name modules. Making its env imports them: a ``module:Id`` env
id (gymnasium imports the module) and every ``env.wrappers`` entry (imported and called). So wherever a stored
config makes an env (``--resume`` without ``--config``, ``load_policy``, ``cluster.evaluate``, ``cluster.export``),
those names are refused unless the user said to trust them (``--trust-code`` / ``trust_code=True``). A config the
user passes in is theirs, and runs as written. Registered gymnasium ids import nothing and need no trust, and
this project's own modules (``actors.probe_envs:...``) are the code that runs anyway.

The same holds for the network. A stored config's ``ray.address`` (host:port, ``ray://host:port`` or ``auto``)
would make a resumed run join that cluster, which gets this machine's Ray token (with token authentication on) and
sends objects the driver unpickles; a ``ray.listen_address`` other than 127.0.0.1 would open the embedded Ray's
ports to other hosts. Where a stored config starts or joins Ray (``--resume`` without ``--config``) both are
refused unless the user trusts the directory or named the address: ``--address`` (it takes the place of
``ray.address`` and of the embedded Ray), ``--set ray.address=...`` or ``--set ray.listen_address=...``. Null and
``inprocess`` reach nothing. RAY_ADDRESS in the environment is the user's too, but a stored ``ray.address`` comes
before it, so it lets none through. The wandb and mlflow sinks (``run.loggers``) send the run's metrics and its
config to a server: which one the user's environment says (WANDB_BASE_URL, MLFLOW_TRACKING_URI), but a stored
config naming them would send there a run the user never asked to publish, so they are refused the same way unless
the user sets ``run.loggers`` (``--set``). ``load_policy``, ``cluster.evaluate`` and ``cluster.export`` start no Ray
and write no metrics.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from cluster.config import LOOPBACK, Config, ConfigError, parse_override

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


#: The settings through which a config reaches other machines: joined (ray.address), let in (ray.listen_address)
#: or sent the run's metrics and config (run.loggers).
NETWORK_KEYS = ("ray.address", "ray.listen_address", "run.loggers")
#: The ``--address`` flag replaces both: with it, no stored Ray setting is used.
RAY_KEYS = frozenset({"ray.address", "ray.listen_address"})
#: The sinks that send what they log to a server, and the server's name in the refusal.
SENDING_SINKS = {"wandb": "the W&B server", "mlflow": "the MLflow tracking server"}


def addresses_to_reach(cfg: Config, own: frozenset[str] = frozenset()) -> list[str]:
    """What starting ``cfg``'s Ray would connect to or open to other hosts, one phrase each, leaving out the keys
    in ``own`` (the user's own settings)."""
    found = []
    if "ray.address" not in own and cfg.ray.address not in (None, "", "inprocess"):
        found.append(f"ray.address {cfg.ray.address!r} (a Ray cluster this run would join: it gets this machine's "
                     f"Ray token where token authentication is on, and this process unpickles what it sends)")
    if "ray.listen_address" not in own and cfg.ray.listen_address != LOOPBACK:
        found.append(f"ray.listen_address {cfg.ray.listen_address!r} (the embedded Ray's ports open to other hosts)")
    if "run.loggers" not in own:
        found += [f"run.loggers {name!r} (this run's metrics and config sent to {server} of this environment)"
                  for name, server in SENDING_SINKS.items() if name in cfg.run.loggers]
    return found


def keys_set_by(overrides) -> frozenset[str]:
    """The network settings ``--set`` overrides name (``ray.address=...``; ``ray={...}`` names both)."""
    own = set()
    for text in overrides:
        path = ".".join(parse_override(text)[0])
        own.update(key for key in NETWORK_KEYS if key == path or key.startswith(path + "."))
    return frozenset(own)


def refuse_unnamed_addresses(cfg: Config, stored: str, allowed: str, *, overrides=(), address: str | None = None
                             ) -> None:
    """ConfigError (one line) naming the addresses ``cfg`` would reach, unless it reaches none the user did not
    name. ``stored``: where the config came from, as the line's subject ("<path>: the config stored in this run
    directory"). ``overrides``: the user's ``--set`` texts (a network key they set is theirs); ``address``: the
    user's ``--address``, which replaces ``ray.address`` and the embedded Ray alike, so with it no stored Ray
    setting is reached (a stored ``run.loggers`` still is)."""
    reached = addresses_to_reach(cfg, keys_set_by(overrides) | (RAY_KEYS if address else frozenset()))
    if reached:
        raise ConfigError(f"{stored} names {'; '.join(reached)}; allowed: {allowed}")
