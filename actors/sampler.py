"""RolloutSampler: N envs plus a CPU policy copy that emits fragments, for Box and Dict observations alike.

Plain class, no Ray: the actor shell in ``rollout.py`` drives it, tests drive it directly. Observations are
``{modality: (N, ...) array}`` for every env. Where they come from is the one difference between env kinds:

* a **Box env** is one modality (``actors.envs.box_modality``) whose value is the env's array as it comes (uint8
  stays uint8): nothing to preprocess, so no scheduler and no aligner sit on CartPole's step;
* a **Dict env** goes through the observation pipeline each step::

      submit(t + 1) for the raw observations the env just returned
          -> fast jobs (this step's camera, proprioception) and slow jobs (whatever is due)
      gather(t + 1) -> fast results + the aligner's slow values (usually already processed)

  and the fragment also carries ``obs_src/<modality>`` (the env step each slow value was emitted at), so the
  learner trains on exactly what the actor saw and tests can check the alignment after the fact.

Corrupt encoded input under ``on_corrupt: drop_episode``: the env's episode is abandoned before any action uses
the bad observation; the transition that led to it is cut as a truncation bootstrapped with V of the last good
observation (the only value estimate there is), the episode's return is not reported, and ``episodes_dropped``
counts it. A corrupt final observation of a time-limit truncation is handled the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import gymnasium as gym
import numpy as np
import torch

from actors.envs import box_modality, continuous_default, make_vector_env
from actors.gae import compute_gae
from pipeline import fragment as F
from pipeline.actions import ActionCodec, read_masks
from pipeline.contract import ModalitySpec, specs_from
from pipeline.timing import Stopwatch, Timings

#: Fresh resets tried when an abandoned episode's new first observation is corrupt too.
MAX_RESET_ATTEMPTS = 5


def _tensors(obs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in obs.items()}


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    """What a ``RolloutSampler`` is made from, as plain values: it is pickled to every rollout actor and the
    evaluator, so nothing live (no policy, preprocess worker or inference server) belongs here; those are the
    constructor's other arguments. ``cluster.graph``'s ``ActorGraph.sampler_settings`` derives it from a config.

    * The env: ``env_id``, and how each env is made (``actors.envs.make_vector_env``): ``max_episode_steps``,
      ``env_kwargs``, ``wrappers``, ``backend`` (env.backend), ``isolation`` (env.isolation's settings, None: in
      the actor), ``multiagent`` (the config's env-shaping multiagent settings, ``actors.envs.make_env``).
    * The fragment: ``num_envs`` envs stepped side by side for ``fragment_length`` steps, advantages by GAE with
      ``gamma`` and ``gae_lambda``; ``seed`` fixes the resets and the action sampling (with the actor id).
    * Acting: ``normalize_reward`` (env.normalize_reward; None: on for continuous actions); ``deterministic`` acts
      with the policy's mode (evaluation); ``action_mask_key`` (env.action_mask_key, used when a Dict env's
      observations have the key); ``self_play``: {snapshot_every, pool_size, sampling, random_share} under
      multiagent.self_play (``actors.multiagent.PolicyOpponents``), None without it.
    * A Dict env's preprocessing (a Box env has none): ``modalities`` (env.modalities, spec objects or their plain
      data), the scheduler's ``preprocess_workers``, ``max_slow_workers``, ``fast_queue`` and ``slow_queue``
      (the config's preprocess settings).
    """

    env_id: str
    num_envs: int
    fragment_length: int
    gamma: float
    gae_lambda: float
    seed: int
    max_episode_steps: int | None = None
    env_kwargs: dict | None = None
    wrappers: Sequence[Mapping] = ()
    backend: str = "gymnasium"
    isolation: Mapping | None = None
    multiagent: Mapping | None = None
    normalize_reward: bool | None = None
    deterministic: bool = False
    action_mask_key: str | None = "action_mask"
    self_play: Mapping | None = None
    modalities: Mapping[str, ModalitySpec | dict] | None = None
    preprocess_workers: int = 2
    max_slow_workers: int | None = None
    fast_queue: int = 64
    slow_queue: int = 64


class RolloutSampler:
    def __init__(self, settings: SamplerSettings, policy_factory: Callable[[], torch.nn.Module], *,
                 actor_id: int = 0, remote_preprocess=None, inference=None):
        """``policy_factory()``: a fresh policy (the sampler's copy, and under self-play its opponents').
        ``remote_preprocess``: this actor's preprocess worker (preprocess.remote_actors; a Dict env's slow
        modalities run there). ``inference``: this node's inference server (rollout.inference: remote,
        ``actors.inference``), which then runs the policy forward; the local copy serves when it cannot."""
        self.settings = s = settings
        num_envs, seed, env_id = s.num_envs, s.seed, s.env_id
        self.actor_id = actor_id
        self.num_envs = num_envs
        self.T = s.fragment_length
        self.gamma, self.gae_lambda = s.gamma, s.gae_lambda
        self.env = make_vector_env(env_id, num_envs, s.max_episode_steps, s.env_kwargs, s.wrappers, s.multiagent,
                                   s.backend, s.isolation)
        self.env_id = env_id
        self.actions = ActionCodec(self.env.single_action_space, where=f"env.id: {env_id!r}")
        self.deterministic = s.deterministic
        self.reward_scaler = (ReturnScaler(num_envs, s.gamma)
                              if continuous_default(s.normalize_reward, self.env.single_action_space) else None)
        #: (env, return, length) of every finished episode, in order, when a list (evaluation sets it).
        self.episode_log: list | None = None
        self.policy = policy_factory()
        self.policy.eval()
        # A recurrent policy's state per env, going into the current step, and whether that step begins an
        # episode. Zeroed at every episode start: the autoresets inside a fragment and the abandoned episodes.
        self.recurrent = bool(getattr(self.policy, "recurrent", False))
        if self.recurrent:
            self.rnn_state = np.zeros((num_envs, self.policy.spec.state_size), dtype=np.float32)
            self.episode_start = np.ones(num_envs, dtype=bool)
        self.policy_version = -1  # no weights loaded yet
        self.weights: dict | None = None  # with an inference server: the loaded version's state dict, sent to it
        if inference is not None and (self.recurrent or not hasattr(self.policy, "_act_from")):
            raise ValueError("rollout.inference: remote serves one memoryless policy; allowed: local with "
                             "learner.rnn or multiagent.policies")
        self.inference = None
        if inference is not None:
            from actors.inference import InferenceClient  # Ray's client side: only where a server is used

            self.inference = InferenceClient(inference)
        self.generator = torch.Generator().manual_seed(seed * 7919 + actor_id)
        self.step_index = 0  # global env step of the current observation (the aligner's clock)
        # Counters first: a corrupt first observation is abandoned (and counted) inside the first gather.
        self.ep_return = np.zeros(num_envs, dtype=np.float64)
        self.ep_length = np.zeros(num_envs, dtype=np.int64)
        self.env_steps = 0
        self.sample_seconds = 0.0
        # Where collect()'s time goes, Sample Factory style (a block per stage per step of the vector env, never per
        # env): env_step (the vector env and the book-keeping of what it returned), preprocess (this thread's part of
        # the observation pipeline: submitting, and waiting for what the action needs), forward (the CPU policy
        # copy), fragment (the step's observation into the fragment's buffers, then GAE and the fragment). The
        # rollout actor times the rest of its loop into the same Timings (actors/rollout.py).
        self.timings = Timings()
        self.episodes_dropped = 0
        self.sources: dict[str, np.ndarray] = {}  # slow modality -> (N,) env step its current value was emitted at
        space = self.env.single_observation_space
        # The action mask is read from the raw observations (never preprocessed) and rides in ``self.obs`` under its
        # key, so the policy applies it when acting and the fragment carries it (obs/<key>) to the update.
        self.mask_key = (s.action_mask_key
                         if isinstance(space, gym.spaces.Dict) and s.action_mask_key in space.spaces else None)
        self._reset_raws: dict[int, object] = {}  # env -> the raw observation of a fresh episode _abandon began
        self.opponents = self._policy_opponents(policy_factory)
        raws = self.env.reset(seed=seed * 100_003 + actor_id * num_envs)  # distinct, reproducible per actor
        if isinstance(space, gym.spaces.Dict):
            from pipeline.observations import ObservationPipeline  # cv2 and the scheduler load only for Dict envs
            from pipeline.scheduler import EDFScheduler

            self.scheduler = EDFScheduler(num_workers=s.preprocess_workers, fast_capacity=s.fast_queue,
                                          slow_capacity=s.slow_queue, max_slow_workers=s.max_slow_workers,
                                          name=f"preprocess-{actor_id}")
            self.pipeline = ObservationPipeline(specs_from(s.modalities or {}), space, num_envs, self.scheduler,
                                                seed=seed * 7919 + actor_id, remote=remote_preprocess)
            self.out_spaces = self.pipeline.out_spaces()
            if self.mask_key is not None:
                self.out_spaces[self.mask_key] = ((self.actions.mask_width,), np.dtype(bool))
            self.pipeline.submit(0, raws, self.env.episode_step, self.env.episode)
            self.obs = self._gather(None, None, raws)
        else:
            spec, shape, dtype = box_modality(space)
            self.scheduler = self.pipeline = None
            self.box_name, self.box_dtype = spec.name, np.dtype(dtype)
            self.out_spaces = {spec.name: (shape, self.box_dtype)}
            self.obs = {self.box_name: np.asarray(raws, dtype=self.box_dtype)}

    def _policy_opponents(self, policy_factory):
        """Turn-based PettingZoo games (``actors.multiagent.SeatEnv``): the other seats are played by this policy
        or, under self-play, by snapshots of it; random and heuristic players need nothing from here."""
        from actors.multiagent import PolicyOpponents, SeatEnv

        settings = self.settings
        multiagent, self_play = dict(settings.multiagent or {}), settings.self_play
        seats = [e for e in (getattr(env, "unwrapped", env) for env in self.env.envs) if isinstance(e, SeatEnv)]
        if not seats or (multiagent.get("opponent", "latest") != "latest" and not self_play):
            return None
        if self.recurrent:
            raise ValueError("learner.rnn: a recurrent policy cannot play the other seats of a turn-based game yet "
                             "(their moves carry no state); allowed: null, or multiagent.opponent: random/heuristic")
        space = self.env.single_observation_space
        if isinstance(space, gym.spaces.Dict):
            from pipeline.modality import make_processor

            processors = {s.name: make_processor(s, space[s.name]) for s in specs_from(settings.modalities or {})}
        else:
            processors = None
            box_spec, _, box_dtype = box_modality(space)
        mask_key = self.mask_key

        def inputs(raw) -> dict[str, torch.Tensor]:  # one raw observation -> the model's batch of one
            if processors is None:
                return {box_spec.name: torch.from_numpy(np.asarray(raw, dtype=box_dtype)[None])}
            out = {name: torch.from_numpy(proc.batch([raw[name]])) for name, proc in processors.items()}
            if mask_key is not None:
                out[mask_key] = torch.from_numpy(read_masks([raw[mask_key]], self.actions.parts,
                                                            f"env.id {self.env_id!r} observation {mask_key!r}",
                                                            lambda i: f"env.id {self.env_id!r}, an opponent's move"))
            return out

        opponents = PolicyOpponents(self.policy, policy_factory, inputs, self.actions.to_env,
                                    self_play=bool(self_play), seed=settings.seed * 7919 + self.actor_id + 1,
                                    action_space=self.env.single_action_space, **dict(self_play or {}))
        for env in seats:
            env.opponent = opponents
        return opponents

    def load_weights(self, version: int, state: dict[str, np.ndarray]) -> None:
        # torch.tensor copies: the arrays are read-only views of the object store (and small).
        self.policy.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
        self.policy_version = version
        if self.inference is not None:
            # Kept for the server's first request of this version; not otherwise (the arrays may pin an object).
            self.weights = state
        if self.opponents is not None:
            self.opponents.on_weights(version, state)

    # ------------------------------------------------------------------ observations
    def _observe(self, raws, t: int, steps: dict) -> dict[str, np.ndarray]:
        """The observation after env step ``t`` (``raws``: what the env returned)."""
        if self.pipeline is None:
            return {self.box_name: np.asarray(raws, dtype=self.box_dtype)}
        return self._gather(t, steps, raws)

    def _gather(self, t_prev: int | None, steps: dict | None, raws) -> dict[str, np.ndarray]:
        """This step's preprocessed observation (and action mask); envs with corrupt input get a fresh episode
        first."""
        g = self.pipeline.gather(self.step_index, self.env.episode)
        for i in g.corrupt_envs:
            self._abandon(i, g, t_prev, steps)
        self.sources = g.sources
        if self.mask_key is not None:
            g.obs[self.mask_key] = self._masks(raws)
        return g.obs

    def _masks(self, raws) -> np.ndarray:
        """(N, mask width) bool from the raw observations; an env with no legal action is an error naming it."""
        key = self.mask_key
        return read_masks([self._reset_raws.pop(i, raw)[key] for i, raw in enumerate(raws)], self.actions.parts,
                          f"env.id {self.env_id!r} observation {key!r}", lambda i: (
                              f"env.id {self.env_id!r}, actor {self.actor_id} env {i}, episode step "
                              f"{int(self.env.episode_step[i])} (env step {self.step_index})"))

    def _abandon(self, i: int, g, t_prev: int | None, steps: dict | None) -> None:
        from pipeline.modality import CorruptObservation

        if t_prev is not None and steps is not None:
            if not (steps["terminated"][t_prev, i] or steps["truncated"][t_prev, i]):
                # The episode that produced the bad observation is cut here; bootstrap from the last good one.
                steps["truncated"][t_prev, i] = True
                steps["final_values"][t_prev, i] = steps["values"][t_prev, i]
        self.episodes_dropped += 1
        self.ep_return[i] = 0.0
        self.ep_length[i] = 0
        if self.recurrent:  # a fresh episode: nothing of the abandoned one's memory carries over
            self.rnn_state[i] = 0.0
            self.episode_start[i] = True
        for attempt in range(MAX_RESET_ATTEMPTS):
            raw = self.env.reset_one(i)
            self._reset_raws[i] = raw
            try:
                processed = self.pipeline.process_now(raw)
                break
            except CorruptObservation:
                self.episodes_dropped += 1
                if attempt == MAX_RESET_ATTEMPTS - 1:
                    raise
        for name, value in processed.items():
            g.obs[name][i] = value[0]
            if name in g.sources:
                g.sources[name][i] = self.step_index
        self.pipeline.restart_env(i, self.step_index, int(self.env.episode[i]), processed)

    def _final(self, raw) -> dict[str, np.ndarray] | None:
        """A truncated episode's final observation as a batch of one; None if it is corrupt under drop_episode.

        Dict envs process it per modality, so each modality whose input did not decode applies its own policy:
        any ``on_corrupt: fail`` raises, as it would anywhere else.
        """
        if self.pipeline is None:
            return {self.box_name: np.asarray(raw, dtype=self.box_dtype)[None]}
        from pipeline.modality import CorruptObservation

        out: dict[str, np.ndarray] = {}
        corrupt = False
        for name, proc in self.pipeline.processors.items():
            try:
                out[name] = proc.batch([raw[name]])
            except CorruptObservation:
                if self.pipeline.specs[name].on_corrupt == "fail":
                    raise
                corrupt = True
        return None if corrupt else out

    # ------------------------------------------------------------------ sampling
    def collect(self) -> F.Fragment:
        """Step all envs ``T`` times with the current policy; one fragment out."""
        if self.policy_version < 0:
            raise RuntimeError("RolloutSampler.collect() called before load_weights()")
        with Stopwatch() as sw:
            fragment = self._collect()
        self.sample_seconds += sw.s
        return fragment

    def _collect(self) -> F.Fragment:
        T, N = self.T, self.num_envs
        timings = self.timings
        with timings.time("fragment"):
            obs_buf = {name: np.empty((T, N) + shape, dtype=dtype) for name, (shape, dtype) in self.out_spaces.items()}
            src_buf = {name: np.empty((T, N), dtype=np.int64) for name in self.sources}
            steps = {
                "actions": np.empty((T, N) + self.actions.stored_shape, dtype=self.actions.stored_dtype),
                "logp": np.empty((T, N), dtype=np.float32),
                "values": np.empty((T, N), dtype=np.float32),
                "rewards": np.empty((T, N), dtype=np.float32),
                "terminated": np.empty((T, N), dtype=bool),
                "truncated": np.empty((T, N), dtype=bool),
                "final_values": np.zeros((T, N), dtype=np.float32),  # V(final obs) where a time limit cut an episode
            }
            if self.recurrent:
                steps[F.RNN_STATE] = np.empty((T, N, self.rnn_state.shape[1]), dtype=np.float32)
                steps[F.EPISODE_START] = np.empty((T, N), dtype=bool)
        finished_returns: list[float] = []
        finished_lengths: list[int] = []
        finished_policies: list[int] = []  # several policies: the one that played each finished episode
        slot_policy = getattr(self.env, "slot_policy", None)

        for t in range(T):
            with timings.time("fragment"):
                for name, value in self.obs.items():
                    obs_buf[name][t] = value
                for name, source in self.sources.items():
                    src_buf[name][t] = source
                if self.recurrent:
                    steps[F.RNN_STATE][t], steps[F.EPISODE_START][t] = self.rnn_state, self.episode_start
            with timings.time("forward"):
                if self.recurrent:
                    a, lp, v, next_state = self.policy.act(_tensors(self.obs), generator=self.generator,
                                                           deterministic=self.deterministic,
                                                           state=torch.from_numpy(self.rnn_state))
                    next_state = next_state.numpy()  # a fresh tensor: owning its memory, safe to reset rows of
                else:
                    a, lp, v = self._act(self.obs)
                a = a.numpy()
                steps["actions"][t], steps["logp"][t], steps["values"][t] = a, lp.numpy(), v.numpy()
            with timings.time("env_step"):
                raws, rew, term, trunc, finals = self.env.step(self.actions.to_env(a))
                steps["terminated"][t], steps["truncated"][t] = term, trunc
                steps["rewards"][t] = rew if self.reward_scaler is None else self.reward_scaler(rew, term | trunc)
                self.step_index += 1
                if self.pipeline is not None:
                    # Submit first: this step's preprocessing runs while we book-keep below.
                    with timings.time("preprocess"):
                        self.pipeline.submit(self.step_index, raws, self.env.episode_step, self.env.episode)

                self.ep_return += rew
                self.ep_length += 1
                if self.env.dead is not None:  # a parallel game's filler steps are no part of any episode
                    self.ep_return[self.env.dead] = 0.0
                    self.ep_length[self.env.dead] = 0
                # Envs whose sandboxed child failed this step (actors.sandbox): their episode was cut at its last
                # good observation; bootstrapped from it, not reported, and counted as dropped.
                failed = getattr(self.env, "failed", ())
                for i, final_raw in finals.items():
                    dropped = False
                    if i in failed:
                        steps["final_values"][t, i] = steps["values"][t, i]
                        self.episodes_dropped += 1
                        dropped = True
                    elif trunc[i] and not term[i]:
                        # Time-limit end: bootstrap from V(final observation), processed here (rare, off the rhythm).
                        with timings.time("preprocess"):
                            final = self._final(final_raw)
                        if final is None:
                            # Corrupt under drop_episode: bootstrap from the last good observation; return not
                            # reported.
                            steps["final_values"][t, i] = steps["values"][t, i]
                            self.episodes_dropped += 1
                            dropped = True
                        else:
                            with timings.time("forward"), torch.inference_mode():
                                # A recurrent value reads the final observation with the state its episode reached.
                                # The local copy, with or without an inference server: a batch of one, off the
                                # rhythm, and without the action mask the server's heads would apply.
                                state = torch.from_numpy(next_state[i:i + 1]) if self.recurrent else None
                                steps["final_values"][t, i] = self.policy.value(_tensors(final), state).numpy()[0]
                    if not dropped:
                        finished_returns.append(float(self.ep_return[i]))
                        finished_lengths.append(int(self.ep_length[i]))
                        if slot_policy is not None:
                            finished_policies.append(int(slot_policy[i]))
                        if self.episode_log is not None:
                            self.episode_log.append((i, finished_returns[-1], finished_lengths[-1]))
                    self.ep_return[i] = 0.0
                    self.ep_length[i] = 0
                if self.recurrent:  # before _observe: an episode it abandons zeroes its env's state
                    done = term | trunc
                    next_state[done] = 0.0
                    self.rnn_state, self.episode_start = next_state, done.copy()
            with timings.time("preprocess"):
                self.obs = self._observe(raws, t, steps)

        with timings.time("forward"), torch.inference_mode():
            state = torch.from_numpy(self.rnn_state) if self.recurrent else None
            last_values = self._value(self.obs, state).numpy()
        with timings.time("fragment"):
            observations = {F.obs_key(name): buf for name, buf in obs_buf.items()}
            observations.update({F.obs_source_key(name): buf for name, buf in src_buf.items()})
            self.env_steps += T * N
            fragment = assemble_fragment(observations, steps, last_values, self.gamma, self.gae_lambda,
                                         self.policy_version, self.actor_id, finished_returns, finished_lengths)
            if slot_policy is not None:
                fragment.episode_policies = np.asarray(finished_policies, dtype=np.int64)
        return fragment

    def _act(self, obs: dict[str, np.ndarray]):
        """(action, log-prob, value) of a memoryless policy. With an inference server, the server runs the heads and
        the action is drawn here from their output, with this sampler's generator: the draws are the local copy's."""
        heads = None if self.inference is None else self.inference.heads(self.policy_version, obs, self.weights)
        if heads is None:
            return self.policy.act(_tensors(obs), generator=self.generator, deterministic=self.deterministic)
        out, value = heads
        with torch.inference_mode():
            action, logp = self.policy._act_from(out, self.generator, self.deterministic)
        return action, logp, value

    def _value(self, obs: dict[str, np.ndarray], state: torch.Tensor | None) -> torch.Tensor:
        """V(obs), the fragment's last values: from the inference server when there is one."""
        heads = None if self.inference is None else self.inference.heads(self.policy_version, obs, self.weights)
        return self.policy.value(_tensors(obs), state) if heads is None else heads[1]

    def inference_stats(self) -> dict:
        """Steps the inference server answered and those the local copy served instead (rollout.inference: remote);
        empty without a server."""
        return {} if self.inference is None else self.inference.stats()

    def env_faults(self) -> tuple[int, str]:
        """(sandboxed env children replaced so far, the last one's fault in words); (0, "") under
        env.isolation: none."""
        return getattr(self.env, "fault_count", 0), getattr(self.env, "last_fault", "")

    def pipeline_stats(self) -> dict[str, float]:
        """Preprocessing queues, alignment and corrupt-input counters (empty for a Box env: no pipeline)."""
        if self.pipeline is None:
            return {}
        out = {f"preprocess/{queue}/{k}": v for queue, m in self.scheduler.metrics().items() for k, v in m.items()}
        out.update(self.pipeline.metrics())
        out["episodes_dropped"] = self.episodes_dropped
        return out

    def close(self) -> None:
        try:
            if self.scheduler is not None:
                self.scheduler.close()  # raises TimeoutError when a preprocessing job hangs past its deadline
        finally:
            self.env.close()


class ReturnScaler:
    """VecNormalize's reward scaling: each reward divided by the running std of the discounted return (one per
    env, restarted at episode ends), clipped to +-10. Per actor, as VecNormalize is per process; episode returns
    are still reported in the env's own units."""

    CLIP, EPS = 10.0, 1e-8

    def __init__(self, num_envs: int, gamma: float):
        self.gamma = gamma
        self.returns = np.zeros(num_envs, dtype=np.float64)
        self.count, self.mean, self.var = 1e-4, 0.0, 1.0  # gymnasium's RunningMeanStd start

    def __call__(self, rewards: np.ndarray, done: np.ndarray) -> np.ndarray:
        self.returns = self.returns * self.gamma + rewards
        n, batch_mean, batch_var = len(self.returns), self.returns.mean(), self.returns.var()
        total = self.count + n
        delta = batch_mean - self.mean
        self.var = (self.var * self.count + batch_var * n + delta**2 * self.count * n / total) / total
        self.mean += delta * n / total
        self.count = total
        self.returns[done] = 0.0
        return np.clip(rewards / np.sqrt(self.var + self.EPS), -self.CLIP, self.CLIP).astype(np.float32)

    def state(self) -> dict:
        """The running statistics (not the per-env returns, which restart with every episode anyway): what a
        replacement, an added actor or a resumed run continues from instead of variance 1."""
        return {"count": float(self.count), "mean": float(self.mean), "var": float(self.var)}

    def load(self, state: dict) -> None:
        self.count, self.mean, self.var = float(state["count"]), float(state["mean"]), float(state["var"])


def assemble_fragment(observations: dict[str, np.ndarray], steps: dict[str, np.ndarray], last_values: np.ndarray,
                      gamma: float, gae_lambda: float, policy_version: int, actor_id: int,
                      finished_returns: list[float], finished_lengths: list[int]) -> F.Fragment:
    """GAE on the rollout host, then the fragment contract.

    ``observations``: fragment keys (``obs/...``, ``obs_src/...``) -> (T, N, ...) arrays. ``steps``: (T, N) arrays
    ``actions``, ``logp``, ``values``, ``rewards``, ``terminated``, ``truncated``, ``final_values`` (V of the
    final observation where a time limit cut an episode).
    """
    advantages, returns = compute_gae(steps["rewards"], steps["values"], steps["terminated"], steps["truncated"],
                                      steps["final_values"], last_values, gamma, gae_lambda)
    arrays = dict(observations)
    arrays.update({
        F.ACTIONS: steps["actions"], F.LOGP: steps["logp"], F.VALUES: steps["values"], F.REWARDS: steps["rewards"],
        F.TERMINATED: steps["terminated"], F.TRUNCATED: steps["truncated"],
        F.ADVANTAGES: advantages, F.RETURNS: returns,
    })
    arrays.update({key: steps[key] for key in F.RECURRENT_KEYS if key in steps})
    return F.Fragment(
        arrays=arrays,
        policy_version=policy_version,
        actor_id=actor_id,
        episode_returns=np.asarray(finished_returns, dtype=np.float64),
        episode_lengths=np.asarray(finished_lengths, dtype=np.int64),
    )
