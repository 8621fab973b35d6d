"""Making one env as the config describes it (``make_env``): a gymnasium id, a ``module:Id`` of the user's, a
PettingZoo game as a seat, or an EnvPool env, then ``env.wrappers``; and importing the code a config names, with
whatever it raises while it loads reported as its setting's error.

Its own module, below both ``actors.envs`` (the vector envs) and ``actors.sandbox`` (whose child process makes its
env with it): each imports it, neither imports the other's module at load.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Mapping, Sequence

import gymnasium as gym
import numpy as np


#: The start of the one-line refusal of a multi-agent env under env.isolation: process (``actors.envs``
#: ``refuse_multiagent_in_sandbox`` decides it from the config; a sandboxed child, below, for a module of the user's).
SANDBOX_SINGLE_AGENT = "env.isolation: process runs single-agent gymnasium envs"


class ModuleFailed(ImportError):
    """A module of the config's (a ``module:Id`` env, a wrapper) raised or called sys.exit while it was imported."""


def import_module(name: str):
    """``importlib.import_module`` for code the config names: whatever the module raises while it loads, or a
    ``sys.exit`` in it, is a ModuleFailed naming it (an ImportError, which every caller already reports as the
    setting's error), never a traceback or a silent exit of the run."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise
    except (Exception, SystemExit) as e:  # noqa: BLE001 - user code: anything it raises is its error
        what = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"raised {type(e).__name__}: {e}"
        raise ModuleFailed(f"importing {name!r} {what}") from None


def _import_env_module(env_id: str) -> None:
    """Import the module a ``module:Id`` env id names, and the submodule ``module.Id`` where there is one (a
    PettingZoo env module), so that code failing as it loads is reported here, whoever would import it next
    (gymnasium's registry, ``actors.multiagent``); a module that is not there is left to them to report."""
    if ":" not in env_id:
        return
    module, _, name = env_id.partition(":")
    try:
        import_module(module)
    except ModuleFailed:
        raise
    except ImportError:
        return
    try:
        found = importlib.util.find_spec(f"{module}.{name}")
    except (ImportError, ValueError):  # not a package, or a name that is no module name (a gymnasium id)
        return
    if found is not None:
        import_module(f"{module}.{name}")


def _import(path: str):
    module, _, name = path.partition(":")
    obj = import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def make_env(env_id: str, max_episode_steps: int | None = None, env_kwargs: dict | None = None,
             wrappers: Sequence[Mapping] = (), multiagent: Mapping | None = None, backend: str = "gymnasium",
             **make_kwargs):
    """One env as the config describes it: ``gym.make(env.id, **env.kwargs)``, then ``env.wrappers`` in order
    (plain data: ``{"path": "module:Callable", "kwargs": {...}}``). ``make_kwargs`` go to gym.make too
    (``render_mode`` for videos).

    A PettingZoo turn-based game (``actors.multiagent``) is one learning seat's view of it, a ``SeatEnv``, with the
    other seats played by ``multiagent["opponent"]``; ``multiagent``: the config's multiagent settings that shape
    an env (``MultiAgentConfig.env_args``).

    ``backend`` envpool: one env of an EnvPool pool (``actors.envpool_env.EnvPoolEnv``; no wrappers, no render).

    A kwarg the env rejects or a wrapper that does not import or apply is a ValueError naming its config key.
    """
    if backend == "envpool":
        from actors.envpool_env import EnvPoolEnv

        if make_kwargs:
            raise ValueError(f"env.backend: envpool envs take no {sorted(make_kwargs)} (EnvPool does not render: "
                             f"videos need env.backend: gymnasium)")
        return EnvPoolEnv(env_id, max_episode_steps, env_kwargs)
    kwargs = dict(env_kwargs or {}, **make_kwargs)
    module = _pettingzoo(env_id)
    if module is not None and os.environ.get("ASCENT_SANDBOX"):
        # A sandboxed child (actors.sandbox), the only process that imports the env's module under env.isolation:
        # process: its parent cannot tell a PettingZoo module of the user's without importing it.
        from actors.multiagent import MultiAgentError

        raise MultiAgentError(f"{SANDBOX_SINGLE_AGENT}, and {env_id!r} is a PettingZoo env; allowed: "
                              f"env.isolation: none")
    try:
        if module is not None:
            from actors.multiagent import make_multiagent_env, resolve_api

            ma = dict(multiagent or {})
            env = make_multiagent_env(env_id, module, resolve_api(env_id, module, ma.get("api", "auto")), kwargs,
                                      max_episode_steps, ma.get("opponent", "latest"))
        else:
            if max_episode_steps is not None:
                kwargs["max_episode_steps"] = max_episode_steps
            env = gym.make(env_id, **kwargs)
    except TypeError as e:  # an unexpected or missing constructor argument
        raise ValueError(f"env.kwargs: {dict(env_kwargs or {})!r} rejected by {env_id!r} ({e})") from None
    for i, wrapper in enumerate(wrappers):
        path = wrapper["path"]
        try:
            fn = _import(path)
        except (ImportError, AttributeError) as e:
            env.close()
            raise ValueError(f"env.wrappers[{i}]: {path!r} cannot be imported ({type(e).__name__}: {e})") from None
        try:
            env = fn(env, **wrapper.get("kwargs", {}))
        except Exception as e:  # noqa: BLE001 - any failure of user code while wrapping is a setup error
            env.close()
            raise ValueError(f"env.wrappers[{i}]: {path!r} failed on the env ({type(e).__name__}: {e})") from None
    return env


def _pettingzoo(env_id: str):
    """The PettingZoo env module ``env_id`` names, or None (plain gymnasium ids never import actors.multiagent)."""
    if ":" not in env_id:
        return None
    from actors.multiagent import pettingzoo_module

    return pettingzoo_module(env_id)


def stacked_layout(space) -> tuple | None:
    """(shape, dtype) of one observation when a vector env stacks its envs' observations into one array (a Box
    space), else None (Dict observations stay one object per env)."""
    return (space.shape, space.dtype) if isinstance(space, gym.spaces.Box) else None


def empty_batch(layout: tuple | None, n: int):
    """Room for ``n`` envs' observations: one array for a ``stacked_layout``, else a list."""
    if layout is None:
        return [None] * n
    shape, dtype = layout
    return np.empty((n,) + shape, dtype=dtype)


def step_buffers(layout: tuple | None, n: int):
    """A vector step's results for ``n`` envs before any is in: (observations, rewards, terminated, truncated,
    finals {env: final observation}). Zeroed, not empty: an env whose sandboxed child failed gets no reward and
    is not terminated (``actors.sandbox``)."""
    return (empty_batch(layout, n), np.zeros(n, dtype=np.float32), np.zeros(n, dtype=bool),
            np.zeros(n, dtype=bool), {})
