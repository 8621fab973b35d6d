"""Environment construction and description: one vector env and one description for Box and Dict observations.

A Box env is described as a Dict env with one modality (``box_modality``): ``image`` when it is H x W x C uint8
(kept uint8 up to the learner device, CNN encoder), ``vector`` otherwise. So the rollout, the feed and the model
see the same kind of observation, ``{modality: array}``, for every env.
"""

from __future__ import annotations

import threading
from typing import Mapping, Sequence

import gymnasium as gym
import numpy as np

from pipeline.actions import ActionCodec
from pipeline.contract import KIND_DTYPES, MODEL_SETTINGS, ModalitySpec, specs_from  # standard library only
from pipeline.errors import ConfigError, install_hint  # standard library only
from actors.env_factory import ModuleFailed, import_module, make_env  # noqa: F401 - this module's API too
from actors.env_factory import (SANDBOX_SINGLE_AGENT, _import_env_module, _pettingzoo, empty_batch, stacked_layout,
                                step_buffers)


def changed_multiagent_key(ma: Mapping) -> str | None:
    """The first multiagent setting ``ma`` moves off its default (only a PettingZoo env uses one), else None."""
    from actors.multiagent import DEFAULTS  # gymnasium and numpy only

    return next((k for k in DEFAULTS if k in ma and ma[k] != DEFAULTS[k]), None)


def refuse_multiagent_in_sandbox(env_id: str, multiagent: Mapping | None) -> None:
    """Under env.isolation: process, a multiagent setting off its default (which only a PettingZoo env uses) is a
    ValueError (one line), decided from the config without importing anything of the env's. A PettingZoo env with
    the default settings is refused by its sandboxed child, the one process that imports its module
    (``actors.env_factory.make_env``), in the same words (``describe_env`` passes them on as they are)."""
    from actors.multiagent import DEFAULTS  # gymnasium and numpy only

    ma = dict(multiagent or {})
    key = changed_multiagent_key(ma)
    if key is not None:
        raise ValueError(f"{SANDBOX_SINGLE_AGENT}, and multiagent.{key}: {ma[key]!r} is set (a PettingZoo env's "
                         f"setting); allowed: env.isolation: none for a multi-agent env, or the default "
                         f"{DEFAULTS[key]!r}")


def make_vector_env(env_id: str, num_envs: int, max_episode_steps: int | None = None, env_kwargs: dict | None = None,
                    wrappers: Sequence[Mapping] = (), multiagent: Mapping | None = None, backend: str = "gymnasium",
                    isolation: Mapping | None = None):
    """The rollouts' envs: a ``VectorEnv`` of ``num_envs`` envs, or for a parallel PettingZoo env
    ``num_envs / K`` games of K agents, one slot each (``actors.multiagent.AgentSlotVectorEnv``), or with
    ``backend`` envpool one EnvPool pool of ``num_envs`` (``actors.envpool_env.EnvPoolVectorEnv``, the same
    interface and autoreset). ``isolation``: ``EnvConfig.isolation_args()`` under env.isolation: process, each env
    in a sandboxed child (``actors.sandbox.SandboxVectorEnv``, the same interface)."""
    if isolation is not None:
        refuse_multiagent_in_sandbox(env_id, multiagent)  # decided without importing the env's module
        from actors.sandbox import SandboxVectorEnv

        return SandboxVectorEnv(env_id, num_envs, max_episode_steps, env_kwargs, wrappers, multiagent,
                                limits=isolation.get("limits"),
                                envs_per_child=isolation.get("envs_per_child", 1))
    if backend == "envpool":
        from actors.envpool_env import EnvPoolVectorEnv

        return EnvPoolVectorEnv(env_id, num_envs, max_episode_steps, env_kwargs)
    module = _pettingzoo(env_id)
    if module is not None:
        from actors.multiagent import AgentSlotVectorEnv, MultiAgentError, resolve_api

        ma = dict(multiagent or {})
        if resolve_api(env_id, module, ma.get("api", "auto")) == "parallel":
            if wrappers:
                raise MultiAgentError(f"env.wrappers: gymnasium wrappers apply to single-agent envs, and {env_id!r} "
                                      f"is a parallel multi-agent env; allowed: none (or multiagent.api: aec)")
            return AgentSlotVectorEnv(env_id, module, num_envs, max_episode_steps, env_kwargs,
                                      agent_index=bool(ma.get("agent_index", False)),
                                      policies=ma.get("policies", ()), mapping=ma.get("mapping"))
        if not wrappers:  # turn-based: the other seats' moves of all games go through the policy together
            from actors.multiagent import seat_vector_env

            return seat_vector_env(VectorEnv, env_id, module, num_envs, max_episode_steps, env_kwargs,
                                   ma.get("opponent", "latest"))
    return VectorEnv(env_id, num_envs, max_episode_steps, env_kwargs, wrappers, multiagent)


class VectorEnv:
    """N envs stepped in turn with SAME_STEP autoreset: ``step`` returns the first observation of the next episode
    for an env whose episode ended, and that episode's final observation separately (``finals``), so every
    transition in a fragment is a real one and a truncated episode can bootstrap from its final observation.

    Box observations come stacked, as one (N, ...) array of the space's dtype; Dict observations as a list of raw
    per-env dicts, which the observation pipeline preprocesses per env and per modality (encoded image bytes or
    mission strings gain nothing from being batched into arrays first). Not gymnasium's SyncVectorEnv, which
    also merges every env's info dict on every step: CartPole's sampler ran at 51k env steps/s on it against 58k
    on this loop, with the same trajectories (16 envs, one process). The env also tracks,
    per env, the episode step of the current observation (which slow modalities are due) and an episode number
    (so the aligner never hands one episode another episode's values).
    """

    #: Slots whose last step was a filler step (``actors.multiagent.AgentSlotVectorEnv``); single-agent envs have none.
    dead = None

    def __init__(self, env_id: str, num_envs: int, max_episode_steps: int | None = None,
                 env_kwargs: dict | None = None, wrappers: Sequence[Mapping] = (), multiagent: Mapping | None = None):
        self.envs = [make_env(env_id, max_episode_steps, env_kwargs, wrappers, multiagent) for _ in range(num_envs)]
        self._setup()

    def _setup(self) -> None:
        num_envs = self.num_envs = len(self.envs)
        self.single_observation_space = self.envs[0].observation_space
        self.single_action_space = self.envs[0].action_space
        self.episode_step = np.zeros(num_envs, dtype=np.int64)
        self.episode = np.zeros(num_envs, dtype=np.int64)
        space = self.single_observation_space
        self._stacked = stacked_layout(space)

    def _batch(self, n: int):
        return empty_batch(self._stacked, n)

    def reset(self, seed: int):
        """Env i is seeded ``seed + i`` (as gymnasium's vector envs do)."""
        self.episode_step[:] = 0
        observations = self._batch(self.num_envs)
        for i, obs in self._reset_envs(range(self.num_envs), seed).items():
            observations[i] = obs
        return observations

    # How the envs are stepped and reset; the bookkeeping around it is shared (actors.multiagent's turn-based
    # games step all their envs together).
    def _step_envs(self, actions) -> list[tuple]:
        """-> (observation, reward, terminated, truncated) per env."""
        return [env.step(actions[i])[:4] for i, env in enumerate(self.envs)]

    def _reset_envs(self, indices, seed: int | None = None) -> dict:
        """-> {env: its new episode's first observation}; env i seeded ``seed + i`` when a seed is given."""
        return {i: self.envs[i].reset(seed=None if seed is None else seed + i)[0] for i in indices}

    def reset_one(self, i: int) -> dict:
        """Abandon env ``i``'s episode and start a new one."""
        self.episode[i] += 1
        self.episode_step[i] = 0
        return self.envs[i].reset()[0]

    def step(self, actions: np.ndarray):
        """-> (observations, rewards, terminated, truncated, final observations {env: raw} of ended episodes)."""
        observations, rewards, terminated, truncated, finals = step_buffers(self._stacked, self.num_envs)
        for i, (obs, rew, term, trunc) in enumerate(self._step_envs(actions)):
            rewards[i], terminated[i], truncated[i] = rew, term, trunc
            observations[i] = obs
            if term or trunc:
                finals[i] = obs
                self.episode[i] += 1
                self.episode_step[i] = 0
            else:
                self.episode_step[i] += 1
        for i, obs in self._reset_envs(list(finals)).items():
            observations[i] = obs
        return observations, rewards, terminated, truncated, finals

    def close(self) -> None:
        for env in self.envs:
            env.close()


class SandboxedEnv(gym.Env):
    """One env under env.isolation: process as a plain gymnasium env (``reset(seed=...)`` -> (obs, info),
    ``step(action)`` -> (obs, reward, terminated, truncated, info), ``close``, the two spaces): a
    ``SandboxVectorEnv`` of one env, so the env's module is imported, and its code run, in the sandboxed child only
    (``cluster.api.Policy.make_env`` and ``cluster.evaluate`` under process).

    The child resets an ended episode in the same step (the vector env's autoreset); ``step`` returns the ended
    episode's final observation, and the next ``reset`` starts the episode the caller asks for. A child that breaks
    a limit or dies is replaced, and its episode ends truncated at its last good observation with
    ``info["env_failure"]`` naming the limit. Frames do not cross the sandbox: a ``render_mode`` is a ConfigError,
    and ``metadata["render_modes"]`` is empty. ``make_kwargs`` other than ``render_mode`` go to the env's
    constructor with env.kwargs (as ``make_env`` passes them to gym.make)."""

    metadata = {"render_modes": []}

    def __init__(self, env_id: str, isolation: Mapping, max_episode_steps: int | None = None,
                 env_kwargs: dict | None = None, wrappers: Sequence[Mapping] = (), multiagent: Mapping | None = None,
                 backend: str = "gymnasium", **make_kwargs):
        render_mode = make_kwargs.pop("render_mode", None)
        if render_mode is not None:
            raise ConfigError(f"env.isolation: process keeps {env_id!r} in a sandboxed child, and its frames do not "
                              f"cross the sandbox, so it cannot render (render_mode {render_mode!r}); allowed: "
                              f"env.isolation: none to render it (a config of your own, if you trust the env)")
        self._vec = make_vector_env(env_id, 1, max_episode_steps, dict(env_kwargs or {}, **make_kwargs), wrappers,
                                    multiagent, backend, isolation)
        self.observation_space = self._vec.single_observation_space
        self.action_space = self._vec.single_action_space
        self._composite = isinstance(self.action_space, (gym.spaces.Tuple, gym.spaces.Dict))

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if options:
            raise ValueError(f"reset options {sorted(options)} do not reach an env under env.isolation: process; "
                             f"allowed: none")
        return self._vec.reset(seed)[0], {}

    def step(self, action):
        actions = [action] if self._composite else np.asarray([action])  # as the rollouts hand a batch over
        obs, rewards, terminated, truncated, finals = self._vec.step(actions)
        info = {"env_failure": self._vec.last_fault} if 0 in self._vec.failed else {}
        ended = bool(terminated[0] or truncated[0])
        return (finals[0] if ended else obs[0]), float(rewards[0]), bool(terminated[0]), bool(truncated[0]), info

    def close(self) -> None:
        vec, self._vec = getattr(self, "_vec", None), None
        if vec is not None:
            vec.close()


def _action_facts(env_id: str, obs_space, act_space, mask_key: str | None, specs) -> dict:
    """The action space as plain data, and the action mask's key if the observations carry one."""
    codec = ActionCodec(act_space, where=f"env.id: {env_id!r}")
    facts = {"action_kind": codec.kind, "action_dim": codec.action_dim,
             "action_parts": [(p.kind, p.size) for p in codec.parts], "action_space": str(act_space),
             "action_mask": None}
    if not mask_key or not isinstance(obs_space, gym.spaces.Dict) or mask_key not in obs_space.spaces:
        return facts
    if any(s.name == mask_key for s in specs):
        raise ValueError(f"env.modalities.{mask_key}: {mask_key!r} is the action mask (env.action_mask_key), which "
                         f"is applied to the policy's logits, not encoded; allowed: leave it out of env.modalities")
    mask_space = obs_space[mask_key]
    shape = tuple(getattr(mask_space, "shape", None) or ())
    if not codec.mask_width:
        raise ValueError(f"env.action_mask_key: {env_id!r} has an observation key {mask_key!r}, but its action "
                         f"space {act_space} has no discrete part to mask; allowed: masks for Discrete and "
                         f"MultiDiscrete actions (set env.action_mask_key to null to ignore the key)")
    if shape != (codec.mask_width,):
        raise ValueError(f"env.action_mask_key: {env_id!r} observation {mask_key!r} is {mask_space}; allowed: a "
                         f"flat mask of {codec.mask_width} flags, one per choice of {act_space}")
    facts["action_mask"] = mask_key
    return facts


def continuous_default(setting: bool | None, action_space) -> bool:
    """``env.normalize_obs`` / ``env.normalize_reward``: null means on for continuous actions (CleanRL's continuous
    PPO normalises both), off for discrete ones (its Atari and classic-control PPO do not)."""
    return bool(setting) if setting is not None else isinstance(action_space, gym.spaces.Box)


def box_modality(space: gym.spaces.Box, normalize: bool = False) -> tuple[ModalitySpec, tuple[int, ...], str]:
    """The one modality a Box env is, with its value's shape and dtype: (spec, shape, dtype name).

    H x W x C uint8 is an ``image`` (scale 255, the CNN encoder). Anything else is a ``vector``: float32, or uint8
    when the env's observations are uint8 (4x fewer bytes through fragments, the object store and the host-device
    copy; the encoder casts on the device), with running mean/std normalisation in the model when ``normalize``.
    The sampler hands the env's own values on either way.
    """
    shape = tuple(int(d) for d in space.shape)
    if space.dtype == np.uint8 and len(shape) == 3:
        return ModalitySpec("image", kind="image"), shape, "uint8"
    dtype = "uint8" if space.dtype == np.uint8 else KIND_DTYPES["vector"]
    return ModalitySpec("vector", kind="vector", normalize=normalize), shape, dtype


def _modality(spec: ModalitySpec, shape, dtype, vocab_size: int = 0) -> dict:
    return {"name": spec.name, "shape": tuple(int(d) for d in shape), "dtype": np.dtype(dtype).name,
            "vocab_size": int(vocab_size), **{setting: getattr(spec, setting) for setting in MODEL_SETTINGS}}


def _agents(env_id: str, multiagent: Mapping | None) -> dict | None:
    """A PettingZoo env's agents (``actors.multiagent.describe_agents``), None for a gymnasium env; multiagent
    settings that a gymnasium env cannot use are an error naming them."""
    from actors.multiagent import DEFAULTS, MultiAgentError, describe_agents, resolve_api

    ma = dict(multiagent or {})
    module = _pettingzoo(env_id)
    if module is None:
        key = changed_multiagent_key(ma)
        if key is not None:
            raise MultiAgentError(f"multiagent.{key}: {ma[key]!r} is set, but env.id {env_id!r} is a single-agent "
                                  f"gymnasium env; allowed: a PettingZoo env id (e.g. "
                                  f"pettingzoo.classic:connect_four_v3), or the default {DEFAULTS[key]!r}")
        return None
    api = resolve_api(env_id, module, ma.get("api", "auto"))
    agents = describe_agents(env_id, module, api, ma.get("env_kwargs"), ma.get("policies", ()), ma.get("mapping"))
    if ma.get("self_play") and api == "parallel":
        raise MultiAgentError(f"multiagent.self_play: true needs a turn-based game (the other seats played by past "
                              f"selves), and {env_id!r} runs on its parallel API, where every agent learns; allowed: "
                              f"multiagent.api: aec, or self_play: false")
    if ma.get("self_play") and len(agents["agents"]) < 2:
        raise MultiAgentError(f"multiagent.self_play: true, but {env_id!r} has one agent "
                              f"({agents['agents'][0]}), so there is no seat for a past self; allowed: false")
    if ma.get("agent_index") and api != "parallel":
        raise MultiAgentError(f"multiagent.agent_index: true adds the agent's index to parallel games' slots, and "
                              f"{env_id!r} runs turn-based (one learning seat); allowed: false")
    return agents


def slot_spaces(env_id: str, max_episode_steps: int | None = None, env_kwargs: dict | None = None,
                wrappers: Sequence[Mapping] = (), multiagent: Mapping | None = None,
                backend: str = "gymnasium", isolation: Mapping | None = None) -> tuple:
    """(observation space, action space) of one env slot, as the policy sees them: one env's, or one agent's of a
    parallel game (``make_env`` cannot make those: a parallel game is its agents' slots together). Also the
    PettingZoo env's agents (``actors.multiagent.describe_agents``) or None: (obs space, action space, agents).
    Under ``isolation`` the agents are None: finding them would import the env's module in this process, and a
    sandboxed env is a single-agent one (``refuse_multiagent_in_sandbox``)."""
    agents = (None if backend == "envpool" or isolation is not None
              else _agents(env_id, dict(multiagent or {}, env_kwargs=env_kwargs)))
    env = make_vector_env(env_id, agents["slots_per_game"] if agents else 1, max_episode_steps, env_kwargs,
                          wrappers, multiagent, backend, isolation)
    try:
        return env.single_observation_space, env.single_action_space, agents
    finally:
        env.close()


def _describe(env_id: str, specs: list[ModalitySpec], normalize_obs: bool | None, mask_key: str | None,
              multiagent: Mapping | None = None, **make_args) -> dict:
    obs_space, act_space, agents = slot_spaces(env_id, multiagent=multiagent, **make_args)
    if isinstance(obs_space, gym.spaces.Box):
        if specs:
            raise ValueError(f"env.modalities: set, but env.id {env_id!r} has observation space {obs_space}, "
                             f"not a Dict; allowed: env.modalities only for Dict observations (leave it empty)")
        modalities = [_modality(*box_modality(obs_space, continuous_default(normalize_obs, act_space)))]
    elif isinstance(obs_space, gym.spaces.Dict):
        if not specs:
            keys = [k for k in obs_space.spaces if k != mask_key]
            raise ValueError(f"env.modalities: empty, but env.id {env_id!r} has Dict observations "
                             f"({', '.join(keys)}); allowed: one env.modalities entry per key to use "
                             f"(see docs/multimodal.md)")
        unknown = [s.name for s in specs if s.name not in obs_space.spaces]
        if unknown:
            raise ValueError(f"env.modalities.{unknown[0]}: {env_id!r} has no observation key {unknown[0]!r}; "
                             f"allowed: {', '.join(obs_space.spaces)}")
        from pipeline.modality import make_processor  # cv2 and friends only load for Dict observations

        modalities = []
        for spec in specs:
            proc = make_processor(spec, obs_space[spec.name])
            modalities.append(_modality(spec, proc.out_shape, proc.out_dtype, getattr(proc, "vocab_size", 0)))
    else:
        raise ValueError(f"env.id: {env_id!r} has observation space {obs_space}; allowed: Box or Dict")
    return {"modalities": modalities, **_action_facts(env_id, obs_space, act_space, mask_key, specs),
            "multiagent": agents}


def _within(deadline_s: float, fn, late: str):
    """``fn()`` on a daemon thread, its value or its exception; ConfigError(``late``) if it has not returned within
    ``deadline_s``. Python cannot stop a thread, so one stuck in an env's import or constructor stays, a daemon that
    does not hold the process's exit."""
    done: dict = {}

    def run():
        try:
            done["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised again on the calling thread
            done["error"] = e

    thread = threading.Thread(target=run, name="env-make", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        raise ConfigError(late)
    if "error" in done:
        raise done["error"]
    return done["value"]


def describe_env(env_id: str, modalities: Mapping | None = None, max_episode_steps: int | None = None,
                 env_kwargs: dict | None = None, wrappers: Sequence[Mapping] = (),
                 normalize_obs: bool | None = None, action_mask_key: str | None = "action_mask",
                 multiagent: Mapping | None = None, backend: str = "gymnasium",
                 isolation: Mapping | None = None, make_timeout_s: float | None = None) -> dict:
    """The config's env checked against one throwaway env, as plain data (it travels to learner actors):
    ``{"modalities": [{name, shape, dtype, vocab_size, and the spec settings the model reads
    (pipeline.contract.MODEL_SETTINGS)}], "action_kind", "action_dim", "action_parts", "action_space",
    "action_mask", "multiagent"}`` (the actions as ``pipeline.actions`` reads them; ``action_mask``: the observation
    key of the action mask when a Dict env has ``action_mask_key``, else None; ``multiagent``: a PettingZoo env's
    agents, ``actors.multiagent.describe_agents``, else None). ``multiagent``: the config's multiagent settings.

    ``modalities``: env.modalities (key -> spec object, or its plain data); empty for a Box env, which is one
    modality (``box_modality``). Every problem is a one-line ``pipeline.errors.ConfigError``: an env that cannot be
    made (unknown id, a ``module:Id`` whose module does not import) names env.id and the exception; kwargs the env
    rejects, a wrapper that does not import or apply, and a space or modality mismatch name their key and what is
    allowed. Needs neither Ray nor torch: the driver and
    ``python -m cluster.train --dry-run`` both call it. ``isolation``: as ``make_vector_env`` (the throwaway env is
    made in a sandboxed child too, so an env's code never runs in the driver under env.isolation: process).
    ``make_timeout_s`` (run.startup_timeout_s): in this process (no isolation), importing the env's module and
    making the env must end within it, or the ConfigError says so; the stuck thread is left behind, a daemon. (A
    sandboxed child has its own start deadline and is killed.)
    """
    def describe() -> dict:
        if backend != "envpool" and isolation is None:  # an EnvPool task id names no module; a sandboxed env's
            # module is imported in its child only
            _import_env_module(env_id)
        return _describe(env_id, specs_from(modalities or {}), normalize_obs, action_mask_key, multiagent,
                         max_episode_steps=max_episode_steps,
                         env_kwargs=env_kwargs, wrappers=wrappers, backend=backend, isolation=isolation)

    try:
        if isolation is not None or make_timeout_s is None:
            return describe()
        return _within(make_timeout_s, describe, f"env.id: {env_id!r} cannot be made: importing its module and "
                                                 f"making one env did not finish within {make_timeout_s:g} s "
                                                 f"(run.startup_timeout_s): it hangs in its module or constructor; "
                                                 f"env.isolation: process runs it in a child that is killed")
    except (gym.error.Error, ImportError) as e:  # unknown id, missing module, bad kwargs
        raise ConfigError(f"env.id: {env_id!r} cannot be made ({type(e).__name__}: {e}){install_hint(e)}") from None
    except ValueError as e:  # space/spec mismatches: the message names the key and what is allowed
        raise ConfigError(str(e)) from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the env's own code raised or exited while it was made
        text = " ".join(str(e).split())
        if isolation is not None and SANDBOX_SINGLE_AGENT in text:  # the child found a PettingZoo module
            raise ConfigError(text[text.index(SANDBOX_SINGLE_AGENT):]) from None
        text = text[:300]
        raise ConfigError(f"env.id: {env_id!r} cannot be made: making it raised {type(e).__name__}"
                          + (f": {text}" if text else "")) from None
