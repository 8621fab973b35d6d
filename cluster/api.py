"""The Python API: train a config, load what it trained, act with it.

    from cluster.api import load_policy, train

    result = train("configs/cartpole.yaml", **{"run.seed": 3})
    policy = load_policy(result.run_dir)
    env = policy.make_env()
    obs, _ = env.reset(seed=0)
    action = policy.act(obs, deterministic=True)

Everything else in the packages is internal. ``python -m cluster.evaluate`` is built on ``load_policy``.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from cluster import checkpoint, trust
from cluster import config as config_mod
from cluster.config import Config, ConfigError

__all__ = ["Policy", "TrainResult", "load_policy", "train"]


@dataclass
class TrainResult:
    run_dir: Path
    checkpoint: Path | None  # checkpoints/final.pt
    reason: str  # why the run stopped: target_reached, total_env_steps, time_budget, interrupted, failed, diverged
    reached_target: bool
    env_steps: int
    metrics: dict  # the last metrics record (metric names: pipeline.metric_keys)


def _config(config: str | Path | Mapping | Config, overrides: Mapping[str, Any]) -> Config:
    """A Config from a path, a Config or plain data, plus ``{"learner.lr": 1e-3}`` / ``learner__lr=1e-3``."""
    sets = [f"{key.replace('__', '.')}={json.dumps(value)}" for key, value in overrides.items()]
    if isinstance(config, Config):
        data = config.to_dict()
    elif isinstance(config, Mapping):
        data = dict(config)
    else:
        return config_mod.load(str(config), sets)
    for text in sets:
        config_mod.apply_override(data, *config_mod.parse_override(text))
    return config_mod.from_dict(data)


def train(config: str | Path | Mapping | Config = "configs/cartpole.yaml", *, run_dir: str | Path | None = None,
          **overrides) -> TrainResult:
    """Train one config to its stop rule; ``overrides`` as ``--set`` (dots, or ``__`` in keyword names).

    Uses the Ray this process is connected to, else starts one as the CLI does and shuts it down after;
    ``ray__address="inprocess"`` runs it in this process without Ray (one learner).
    """
    import ray

    from cluster import placement
    from cluster.driver import Trainer

    cfg = _config(config, overrides)
    files = checkpoint.RunFiles.resolve(cfg, run_dir)  # the one place the run directory is decided
    started = placement.start_ray(cfg, None) if not ray.is_initialized() else False
    trainer = Trainer(cfg, files, quiet=True)
    try:
        trainer.build()
        result = trainer.run()
    finally:
        trainer.shutdown()
        if started:
            placement.stop_ray()
    with open(files.metrics) as f:
        last = json.loads(collections.deque(f, maxlen=1)[0])  # the last record, without holding the others
    return TrainResult(files.root, result.checkpoint_path and Path(result.checkpoint_path), result.reason,
                       result.reached_target, result.env_steps, last)


class Policy:
    """A trained policy: raw env observations in, env-ready actions out.

    ``act`` applies the rollouts' observation handling: a Box env's array as it is (uint8 stays uint8; the
    model's own running statistics normalise vectors), a Dict env's keys through the same processors
    (``pipeline.modality``) with the config's settings, and a Dict observation's action mask
    (``env.action_mask_key``) applied as in the rollouts. Actions come in the env's own type, as the rollouts hand
    them over (``pipeline.actions.ActionCodec``): an int for a Discrete, Box actions clipped to the space and in its
    shape, tuples and dicts for composite spaces; a batch gives an array, or a list for composite spaces.

    A recurrent policy (``learner.rnn``) keeps its state here, one per env of the batch it is called with, and
    carries it from one ``act`` to the next: call ``reset()`` when episodes begin (all envs, or ``reset([i, ...])``
    for some of a batch), as the rollouts zero the state at every episode start. ``state`` holds it (None before
    the first call); a call with a different batch size starts from zeros.

    Slow modalities are processed from whatever the observation holds: the rollouts process them only when due
    and hold the value, which is the same for envs that hold their slow values between emissions (the multi-rate
    env does).
    """

    def __init__(self, model, cfg: Config, observation_space, action_space, seed: int = 0, agents: dict | None = None):
        """``agents``: a PettingZoo env's agents (``actors.multiagent.describe_agents``), None for a gymnasium env."""
        import gymnasium as gym
        import torch

        from pipeline.actions import ActionCodec

        self.model, self.config = model, cfg
        self.spec = model.spec
        self.observation_space, self.action_space = observation_space, action_space
        self.agents = agents
        self.actions = ActionCodec(action_space, where=f"env.id: {cfg.env.id!r}")
        self.generator = torch.Generator().manual_seed(seed)
        self.state = None  # a recurrent policy's state going into the next act: (envs, state_size)
        self.pad_observations = False  # one policy of several (load_policy(..., policy=)): pad narrower agents
        self._box = not isinstance(observation_space, gym.spaces.Dict)
        self.processors = {}
        if not self._box:
            from pipeline.contract import specs_from
            from pipeline.modality import make_processor

            self.processors = {s.name: make_processor(s, observation_space[s.name])
                               for s in specs_from(cfg.env.modalities)}

    def make_env(self, **make_kwargs):
        """One env as the run made them (env.id, env.kwargs, env.wrappers, max_episode_steps). Under env.isolation:
        process it lives in a sandboxed child (``actors.envs.SandboxedEnv``: the same reset/step/close and spaces;
        nothing of the env's runs in this process, and it does not render)."""
        isolation = self.config.env.isolation_args()
        if isolation is not None:
            from actors.envs import SandboxedEnv

            return SandboxedEnv(self.config.env.id, isolation, **self.config.env_args(), **make_kwargs)
        from actors.envs import make_env

        return make_env(self.config.env.id, **self.config.env_args(), **make_kwargs)

    def _inputs(self, obs) -> tuple[dict, bool]:
        """({modality: batch tensor}, whether ``obs`` was one observation)."""
        import torch

        if self._box:
            (mod,) = self.spec.modalities
            x = np.asarray(obs, dtype=mod.dtype)
            if self.pad_observations and x.ndim and x.shape[-1] < mod.shape[-1]:
                # One policy of several: an agent narrower than the widest reads zeros after its own columns.
                x = np.concatenate([x, np.zeros(x.shape[:-1] + (mod.shape[-1] - x.shape[-1],), x.dtype)], axis=-1)
            single = x.shape == mod.shape
            return {mod.name: torch.from_numpy(x[None] if single else x)}, single
        single = isinstance(obs, Mapping)
        raws = [obs] if single else list(obs)
        inputs = {name: torch.from_numpy(proc.batch([raw[name] for raw in raws]))
                  for name, proc in self.processors.items()}
        key = self.spec.action_mask
        if key is not None:
            from pipeline.actions import read_masks

            mask = read_masks([raw[key] for raw in raws], self.spec.action_parts,
                              f"Policy.act: observation {key!r}",
                              lambda i: f"env.id {self.config.env.id!r}, observation {i} given to Policy.act")
            inputs[key] = torch.from_numpy(mask)
        return inputs, single

    def reset(self, envs=None) -> None:
        """New episodes: a recurrent policy's state back to zeros, for every env or for the ``envs`` indices of a
        batch. A no-op for a memoryless policy."""
        if self.state is None:
            return
        if envs is None:
            self.state = None
        else:
            self.state[list(envs)] = 0.0

    def act(self, obs, deterministic: bool = False):
        """One observation (-> one action) or a batch (a stacked array, or a list of Dict observations)."""
        inputs, single = self._inputs(obs)
        if self.model.recurrent:
            batch = next(iter(inputs.values())).shape[0]
            if self.state is None or self.state.shape[0] != batch:
                self.state = self.model.initial_state(batch)
            action, _, _, self.state = self.model.act(inputs, generator=self.generator, deterministic=deterministic,
                                                      state=self.state)
            self.state = self.state.clone()  # out of inference mode's tensors: reset() writes rows of it
        else:
            action, _, _ = self.model.act(inputs, generator=self.generator, deterministic=deterministic)
        env_actions = self.actions.to_env(action.cpu().numpy())
        if single:
            return int(env_actions[0]) if self.actions.kind == "discrete" else env_actions[0]
        return env_actions


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint file as given, or a run directory's newest (``checkpoint.latest``: the most trained)."""
    path = Path(path)
    if path.is_file():
        return path
    found = checkpoint.latest(path) if path.is_dir() else None
    if found is None:
        raise ConfigError(f"{str(path)!r} is not a checkpoint file or a run directory with one (looked for "
                          f"checkpoints/final.pt and checkpoints/ckpt-*.pt)")
    return found


#: The largest seed load_policy and cluster.evaluate take: run.seed's (an int32, which every consumer takes).
MAX_SEED = 2**31 - 1


def torch_device(device: str):
    """``device`` as a torch device this process can use, or a ConfigError naming it (a name torch does not know, an
    index past the devices here, a kind this torch was built without)."""
    import torch

    try:
        where = torch.device(device)
        torch.empty(0).to(where)  # what the model's weights will do: fails where the device is not here
    except Exception as e:  # noqa: BLE001 - RuntimeError, AssertionError (no CUDA build), AttributeError (no torch.npu)
        reason = " ".join(str(e).split())[:80] or type(e).__name__
        raise ConfigError(f"device: {device!r} cannot be used here ({type(e).__name__}: {reason}); allowed: cpu, or "
                          f"a device this machine has (cuda, cuda:N, npu:N)") from None
    return where


def load_policy(run_dir_or_checkpoint: str | Path, device: str = "cpu", seed: int = 0,
                config: str | Path | Mapping | Config | None = None, trust_code: bool = False,
                policy: str | None = None) -> Policy:
    """The policy of a run directory (its newest checkpoint) or of one checkpoint file, on ``device``.

    ``config``: run it under another config than the one saved with it (e.g. other env kwargs); weights that do
    not fit the model that config describes (another env, other layer sizes) are a ConfigError naming the first
    mismatch.

    ``policy``: one policy of a run with several (``multiagent.policies``) by name; it takes an agent's
    observation (a narrower agent's is padded with zeros to the widest) and acts as that policy. Without it, such a
    run's policy takes whole slot observations, each ending in the index of the policy that acts for it.

    ``trust_code``: without ``config``, the env is made from the config stored in the checkpoint, and a checkpoint
    is often someone else's file. An env id with a ``module:`` prefix or an env.wrappers entry there would import
    and run whatever module it names, so that is a ConfigError unless ``trust_code=True``; registered gymnasium ids
    need neither.
    """
    import torch

    from actors.envs import slot_spaces
    from cluster.graph import describe_env
    from learner.model import build_model

    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"seed: {seed!r} is out of range; allowed: an integer from 0 to {MAX_SEED} (as run.seed)")
    where = torch_device(device)
    path = find_checkpoint(run_dir_or_checkpoint)
    payload = checkpoint.load(path)  # weights_only: unpickling it runs nothing
    if config is None:
        cfg = config_mod.from_dict(checkpoint.config_of(path, payload))
        if not trust_code:
            trust.refuse_untrusted(cfg, f"{path}: the config stored in this checkpoint",
                                   "trust_code=True (cluster.evaluate: --trust-code) if you trust the checkpoint, or "
                                   "your own config (config=... / --config)")
    else:
        cfg = _config(config, {})
    model = build_model(describe_env(cfg))
    names = list(getattr(model, "names", ()))
    if policy is not None and policy not in names:
        raise ConfigError(f"policy: {policy!r} is not a policy of {path} ({cfg.env.id!r}); allowed: "
                          f"{', '.join(names) if names else 'none (the run has one shared policy: leave it out)'}")
    state = payload["learner"]["model"]
    mine = model.state_dict()
    for key in sorted(set(mine) | set(state), key=str):
        if key not in state or key not in mine or tuple(getattr(state[key], "shape", ())) != tuple(mine[key].shape):
            raise ConfigError(
                f"{path}: checkpoint does not fit the model of its config ({cfg.env.id!r}): {key!r} is "
                f"{tuple(getattr(state[key], 'shape', ())) if key in state else 'missing'} in the checkpoint, "
                f"{tuple(mine[key].shape) if key in mine else 'absent'} in the model")
    model.load_state_dict(state)
    model.to(where).eval()
    # One slot's spaces: one env's, or one agent's of a parallel multi-agent game (which make_env cannot make); under
    # env.isolation: process from a sandboxed child, as the run had them.
    observation_space, action_space, agents = slot_spaces(cfg.env.id, isolation=cfg.env.isolation_args(),
                                                          **cfg.env_args())
    if policy is None:  # several policies: every observation ends in the index of the policy that acts for it
        return Policy(model, cfg, observation_space, action_space, seed=seed, agents=agents)
    import gymnasium as gym

    # One policy of several: an agent's observation as its slot shows it, without the policy-index column.
    width = observation_space.shape[0] - 1
    one = Policy(model.policies[policy], cfg, gym.spaces.Box(-np.inf, np.inf, (width,), np.float32), action_space,
                 seed=seed, agents=agents)
    one.pad_observations = True
    return one

