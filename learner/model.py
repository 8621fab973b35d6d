"""The actor-critic policy: one encoder per observation modality, then a policy head and a value head.

One model family for every env (a Box env is a Dict env with one modality). Two layouts, picked by the spec:

* **state-only** (every modality a vector, e.g. CartPole's one ``vector``): the (normalised) vectors are
  concatenated and CleanRL's separate actor and critic MLPs read them. There is nothing expensive to share, and this
  is the layout the PPO implementation details are tested against.
* **encoded** (any image, text, point cloud or audio): the encoders run once per call and feed one shared tanh
  trunk with both heads on it; encoding a camera frame or a point cloud is the expensive part. When there is text,
  each image's conv features are FiLM-conditioned on it.

The same class runs in two places: a CPU copy inside every rollout actor (``act``: sample an action, its log-prob
and the value, in one pass and without ``torch.distributions`` overhead) and the trained copy in each learner
(``evaluate``: log-prob, entropy and value of stored actions). Observations are ``{modality: (B, *shape)}``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from learner.encoders import ENCODERS, VectorEncoder, layer_init
from learner.spec import ModalityInput, PolicySpec, spec_from_description

__all__ = ["ActorCritic", "ModalityInput", "PolicySet", "PolicySpec", "build_model", "spec_from_description",
           "state_dict_numpy"]


def mlp(in_dim: int, hidden: tuple[int, ...], out_dim: int | None = None, head_std: float = 1.0) -> nn.Sequential:
    """tanh hidden layers, then (``out_dim``) a linear head with gain ``head_std``.

    The tanh is ``torch.tanh`` on every device and host (the fused step's in-place ``Tensor.tanh_`` too), so the
    rollouts' copy, the learner and the fused step compute the same function bit for bit on any CPU.
    ``2 sigmoid(2x) - 1`` is the same function to a few float32 ulps and faster with some CPUs' kernels; choosing
    between them by a timing in each process would make the trained numbers depend on the host."""
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [layer_init(nn.Linear(in_dim, h)), nn.Tanh()]
        in_dim = h
    if out_dim is not None:
        layers.append(layer_init(nn.Linear(in_dim, out_dim), std=head_std))
    return nn.Sequential(*layers)


#: Policy head gain 0.01 keeps the initial policy near uniform; value head gain 1.
POLICY_HEAD_STD = 0.01
VALUE_HEAD_STD = 1.0


class ActorCritic(nn.Module):
    def __init__(self, spec: PolicySpec):
        super().__init__()
        self.spec = spec
        # CleanRL's separate actor and critic MLPs for state-only observations without memory; a recurrent core
        # sits between one shared trunk and the heads, so a recurrent model always takes the trunk layout.
        self.recurrent = spec.rnn is not None
        self.state_only = spec.state_only and not self.recurrent
        self.modality_names = tuple(m.name for m in spec.modalities)
        self.modality_shapes = {m.name: m.shape for m in spec.modalities}
        self.modality_kinds = {m.name: m.kind for m in spec.modalities}
        self.encoders = nn.ModuleDict()
        for mod in spec.modalities:
            try:
                self.encoders[mod.name] = (VectorEncoder(mod, features=0) if spec.state_only
                                           else ENCODERS[mod.kind](mod))
            except KeyError as e:  # ModuleDict refuses names that shadow its own attributes ("keys", ...)
                raise ValueError(f"modality name {mod.name!r} cannot be used as a module key: {e}") from e
        self.fused_dim = sum(enc.out_dim for enc in self.encoders.values())
        self.parts = spec.action_parts
        self.mask_key = spec.action_mask
        if self.state_only:
            # Critic first, then actor: the order CleanRL creates them in (and so the same initial weights).
            self.critic = mlp(self.fused_dim, spec.hidden_sizes, 1, VALUE_HEAD_STD)
            self.actor = mlp(self.fused_dim, spec.hidden_sizes, spec.head_width, POLICY_HEAD_STD)
        else:
            self._build_film(spec)
            # tanh, like the minigrid PPO baselines' layers: the heads see bounded features whatever the encoders'
            # (ReLU, unbounded) scale, which keeps the initial policy near uniform through the 0.01-gain head and
            # the early value targets from being dominated by one large modality.
            self.trunk = mlp(self.fused_dim, spec.hidden_sizes)
            width = spec.hidden_sizes[-1] if spec.hidden_sizes else self.fused_dim
            if self.recurrent:
                self.core = _make_core(spec.rnn, width, spec.rnn_hidden_size)
                width = spec.rnn_hidden_size
            self.policy_head = layer_init(nn.Linear(width, spec.head_width), std=POLICY_HEAD_STD)
            self.value_head = layer_init(nn.Linear(width, 1), std=VALUE_HEAD_STD)
        if spec.gaussian_dims:
            # State-independent log std, as in CleanRL's continuous PPO (one per Gaussian dim of every part).
            self.actor_logstd = nn.Parameter(torch.zeros(spec.gaussian_dims))

    def _build_film(self, spec: PolicySpec) -> None:
        """Instruction conditioning (FiLM, as in the BabyAI baselines).

        When there is text, each image encoder's conv feature map is scaled and shifted per channel by functions of
        the text features. A plain concat leaves the trunk to learn "the colour the text names, at the place the
        camera shows it" as an XOR-like product of two inputs, which PPO learns slowly; FiLM makes the product one
        layer deep. Zero-initialised, so the model starts as the plain concat.
        """
        self.text_names = tuple(m.name for m in spec.modalities if m.kind == "text")
        self.film = nn.ModuleDict()
        if self.text_names:
            text_dim = sum(self.encoders[n].out_dim for n in self.text_names)
            for mod in spec.modalities:
                if mod.kind == "image":
                    film = nn.Linear(text_dim, 2 * self.encoders[mod.name].conv_channels)
                    nn.init.zeros_(film.weight)
                    nn.init.zeros_(film.bias)
                    self.film[mod.name] = film

    @property
    def _logstd(self) -> torch.Tensor | None:
        return getattr(self, "actor_logstd", None)

    @property
    def device(self) -> torch.device:
        return (self.critic[-1] if self.state_only else self.value_head).weight.device

    # ---- inputs

    def _input(self, obs: dict, name: str) -> torch.Tensor:
        """The modality's batch on the model's device, in its pipeline dtype (no cast before the copy)."""
        try:
            x = obs[name]
        except KeyError:
            raise KeyError(f"observation dict lacks modality {name!r} ({self.modality_kinds[name]}); "
                           f"got keys {sorted(obs)}") from None
        if not isinstance(x, torch.Tensor):
            x = torch.as_tensor(x)
        if x.shape[1:] != self.modality_shapes[name]:
            # Shapes are host metadata, so this check costs no device sync.
            raise ValueError(f"modality {name!r} ({self.modality_kinds[name]}): expected "
                             f"(B, *{self.modality_shapes[name]}), received {tuple(x.shape)}")
        # A no-op when already on the device; otherwise the raw (uint8 for images) batch is
        # what crosses the link, and the float conversion happens in the encoder, on the device.
        return x.to(self.device, non_blocking=True)

    def encode(self, obs: dict) -> torch.Tensor:
        """Fused features (B, fused_dim): every encoder's output, concatenated in spec order."""
        if self.state_only:
            parts = [self.encoders[n].normalized(self._input(obs, n)) for n in self.modality_names]
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        feats = {name: self.encoders[name](self._input(obs, name)) for name in self.text_names}
        text = torch.cat([feats[n] for n in self.text_names], dim=-1) if self.text_names else None
        for name in self.modality_names:
            if name in feats:
                continue
            encoder, x = self.encoders[name], self._input(obs, name)
            if name in self.film:
                maps = encoder.convs(encoder.to_float(x))
                gamma, beta = self.film[name](text).chunk(2, dim=-1)
                maps = maps * (1 + gamma[:, :, None, None]) + beta[:, :, None, None]
                feats[name] = encoder.head(maps)
            else:
                feats[name] = encoder(x)
        return torch.cat([feats[name] for name in self.modality_names], dim=-1)

    def _heads(self, obs: dict, state: torch.Tensor | None = None):
        """(policy head output, V(obs)), and the next recurrent state for a recurrent model (``state``: the
        state going into this step, (B, state_size)). With an action mask, illegal logits are MASKED_LOGIT."""
        x = self.encode(obs)
        if self.state_only:
            out, value = self.actor(x), self.critic(x).squeeze(-1)
        else:
            h = self.trunk(x)
            if self.recurrent:
                h, state = self._core_step(h, self._state(state, x.shape[0]))
            out, value = self.policy_head(h), self.value_head(h).squeeze(-1)
        if self.mask_key is not None:
            out = apply_mask(self.parts, out, self._mask(obs))
        return (out, value, state) if self.recurrent else (out, value)

    # ---- the recurrent core

    def initial_state(self, batch: int) -> torch.Tensor:
        """Zeros: the state at an episode's first step."""
        return torch.zeros(batch, self.spec.state_size, device=self.device)

    def _state(self, state, batch: int) -> torch.Tensor:
        if state is None:
            raise ValueError(f"learner.rnn is {self.spec.rnn}: the model needs the recurrent state going into this "
                             f"step (initial_state(batch) at an episode's first step)")
        state = torch.as_tensor(state)
        if tuple(state.shape) != (batch, self.spec.state_size):
            raise ValueError(f"recurrent state: expected ({batch}, {self.spec.state_size}), received "
                             f"{tuple(state.shape)}")
        return state.to(self.device, non_blocking=True)

    def _core_step(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of the core: (features for the heads, next state). An LSTM's state is [h, c]."""
        if self.spec.rnn == "gru":
            h = self.core(x, state.to(x.dtype))
            return h, h
        h, c = self.core(x, tuple(part.to(x.dtype) for part in state.chunk(2, dim=-1)))
        return h, torch.cat([h, c], dim=-1)

    def evaluate_sequences(self, obs: dict, actions: torch.Tensor, state: torch.Tensor, starts: torch.Tensor):
        """Truncated BPTT over whole sequences: ``obs`` {modality: (L, B, ...)}, ``actions`` (L, B, ...), ``state``
        (B, state_size) the stored state going into each sequence's first step, ``starts`` (L, B) where an episode
        begins (the state is zeroed there, so nothing crosses an episode boundary). Returns log-prob, entropy and
        value, each (L * B,) in time-major order (row t * B + b)."""
        L, B = starts.shape
        flat = {k: v.reshape((L * B,) + tuple(v.shape[2:])) for k, v in obs.items()}
        x = self.trunk(self.encode(flat))
        x = x.reshape(L, B, x.shape[-1])
        keep = (~starts.bool()).unsqueeze(-1)
        state = state.to(x.dtype)
        features = []
        for t in range(L):
            h, state = self._core_step(x[t], state * keep[t])
            features.append(h)
        h = torch.stack(features).reshape(L * B, -1)
        out = self.policy_head(h)
        if self.mask_key is not None:
            out = apply_mask(self.parts, out, self._mask(flat))
        flat_actions = actions.reshape((L * B,) + tuple(actions.shape[2:]))
        logp, entropy = self._logp_entropy(out, flat_actions)
        return logp, entropy, self.value_head(h).squeeze(-1)

    def _logp_entropy(self, out: torch.Tensor, actions: torch.Tensor):
        if self.spec.action_kind == "composite":
            return parts_logp_entropy(self.parts, out, actions, self._logstd)
        return action_logp_entropy(self.spec.action_kind, out, actions, self._logstd)

    def _mask(self, obs: dict) -> torch.Tensor:
        try:
            mask = obs[self.mask_key]
        except KeyError:
            raise KeyError(f"observation dict lacks the action mask {self.mask_key!r}; got keys {sorted(obs)}") from None
        mask = torch.as_tensor(mask)
        if mask.shape[1:] != (self.spec.mask_width,):
            raise ValueError(f"action mask {self.mask_key!r}: expected (B, {self.spec.mask_width}), received "
                             f"{tuple(mask.shape)}")
        return mask.to(self.device, non_blocking=True)

    def value(self, obs: dict, state: torch.Tensor | None = None) -> torch.Tensor:
        """V(obs); a recurrent model needs the state going into this observation's step."""
        x = self.encode(obs)
        if self.state_only:
            return self.critic(x).squeeze(-1)
        h = self.trunk(x)
        if self.recurrent:
            h, _ = self._core_step(h, self._state(state, x.shape[0]))
        return self.value_head(h).squeeze(-1)

    @torch.inference_mode()
    def act(self, obs: dict, generator: torch.Generator | None = None, deterministic: bool = False,
            state: torch.Tensor | None = None):
        """Sample actions (``deterministic``: the mode: argmax, or the Gaussian's mean). Returns (action, logp,
        value), all detached, on the model's device; a recurrent model takes the ``state`` going into this step
        and returns the next one as a fourth value."""
        if self.recurrent:
            out, value, next_state = self._heads(obs, state)
            return (*self._act_from(out, generator, deterministic), value, next_state)
        out, value = self._heads(obs)
        action, logp = self._act_from(out, generator, deterministic)
        return action, logp, value

    def _act_from(self, out: torch.Tensor, generator, deterministic: bool):
        kind = self.spec.action_kind
        if kind == "composite":
            action = (parts_mode(self.parts, out) if deterministic
                      else parts_sample(self.parts, out, self._logstd, generator))
            logp, _ = parts_logp_entropy(self.parts, out.float(), action, self._logstd)
            return action, logp
        if deterministic:
            action = out.argmax(dim=-1) if kind == "discrete" else out.float()
            logp, _ = action_logp_entropy(kind, out.float(), action, self._logstd)
            return action, logp
        return sample_action(kind, out, self._logstd, generator)

    def evaluate(self, obs: dict, actions: torch.Tensor):
        """Log-prob and entropy of ``actions`` under the current policy, and V(obs) (memoryless models; a
        recurrent one trains through ``evaluate_sequences``)."""
        if self.recurrent:
            raise ValueError("a recurrent model evaluates whole sequences: evaluate_sequences(obs, actions, state, "
                             "starts)")
        out, value = self._heads(obs)
        logp, entropy = self._logp_entropy(out, actions)
        return logp, entropy, value

    def update_normalizers(self, obs: dict) -> None:
        """Fold a batch's vector statistics into the running buffers of every normalising vector encoder."""
        for name in self.modality_names:
            encoder = self.encoders[name]
            if isinstance(encoder, VectorEncoder) and encoder.normalize:
                encoder.update(self._input(obs, name))


def sample_action(action_kind: str, out: torch.Tensor, logstd: torch.Tensor | None,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample from the policy head's output; (action, its log-prob).

    Discrete: Gumbel-max, an exact Categorical sample without building a distribution object. Continuous: a
    diagonal Gaussian with state-independent ``logstd``. Noise is drawn where the generator lives (a seeded CPU
    generator for an accelerator model is allowed) and moved: an async copy, not a sync.
    """
    noise_device = generator.device if generator is not None else out.device
    if action_kind == "discrete":
        logp_all = torch.log_softmax(out.float(), dim=-1)
        u = torch.rand(out.shape, generator=generator, device=noise_device).to(out.device).clamp_(1e-20, 1.0)
        action = torch.argmax(logp_all - torch.log(-torch.log(u)), dim=-1)
        return action, logp_all.gather(-1, action.unsqueeze(-1)).squeeze(-1)
    mean = out.float()
    eps = torch.randn(out.shape, generator=generator, device=noise_device).to(out.device)
    action = mean + logstd.exp() * eps
    return action, gaussian_logp(action, mean, logstd)


def action_logp_entropy(action_kind: str, out: torch.Tensor, actions: torch.Tensor,
                        logstd: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of stored ``actions`` and the policy's entropy, from the policy head's output."""
    if action_kind == "discrete":
        logp_all = torch.log_softmax(out, dim=-1)
        logp = logp_all.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
        return logp, -(logp_all.exp() * logp_all).sum(-1)
    logstd = logstd.expand_as(out)
    return gaussian_logp(actions, out, logstd), (0.5 + 0.5 * math.log(2 * math.pi) + logstd).sum(-1)


def _make_core(kind: str, in_dim: int, hidden: int) -> nn.Module:
    """An LSTM or GRU cell with orthogonal weights and zero biases (CleanRL's ppo_atari_lstm init), except an
    LSTM's forget gate bias of 1 (Jozefowicz et al. 2015; Keras' unit_forget_bias): at 0 the gate starts at 0.5 and
    a cue fades to 0.5**12 in 12 steps. On the cue task (configs/cue_recall.yaml with 2 actors x 8 envs) an LSTM
    stayed at chance for 150k env steps with it at 0 (lags 0 and 1), and reached the target in 10-12k with 1."""
    core = (nn.LSTMCell if kind == "lstm" else nn.GRUCell)(in_dim, hidden)
    for name, param in core.named_parameters():
        if name.startswith("weight"):
            nn.init.orthogonal_(param, 1.0)
        else:
            nn.init.zeros_(param)
    if kind == "lstm":
        with torch.no_grad():
            core.bias_ih[hidden:2 * hidden] = 1.0  # gates in torch's order: input, forget, cell, output
    return core


#: The logit of an illegal action: finite (so softmax, log-probs and entropy stay free of NaN and inf) and far
#: below any real logit (Gumbel noise is at most ~17 in float32), so an illegal action is never sampled and its
#: probability is exactly 0 in float32.
MASKED_LOGIT = -1e9


def apply_mask(parts, out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The policy head's output (float32) with every illegal choice of the categorical parts at MASKED_LOGIT.

    ``mask``: (B, mask_width) flags, one per choice of every categorical part in part order."""
    out = out.float()
    if len(parts) == 1:  # one Discrete: the mask is the head's width
        return out.masked_fill(~mask.bool(), MASKED_LOGIT)
    legal = torch.ones_like(out, dtype=torch.bool)
    head = flag = 0
    for part in parts:
        if part.kind == "categorical":
            legal[:, head:head + part.size] = mask[:, flag:flag + part.size].bool()
            flag += part.size
        head += part.size
    return out.masked_fill(~legal, MASKED_LOGIT)


def _part_slices(parts, out: torch.Tensor, logstd: torch.Tensor | None):
    """(part, its head outputs, its log std or None, its stored column(s)) for every part, in order."""
    head = column = gauss = 0
    for part in parts:
        std = None
        if part.kind == "gaussian":
            std = None if logstd is None else logstd[gauss:gauss + part.size]  # (the mode needs no std)
            gauss += part.size
        yield part, out[:, head:head + part.size], std, slice(column, column + part.stored_width)
        head += part.size
        column += part.stored_width


def parts_sample(parts, out: torch.Tensor, logstd: torch.Tensor | None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """A composite action, (B, stored width) float32: each categorical part's choice index (Gumbel-max), each
    Gaussian part's sample, each Bernoulli part's 0/1 draws. Noise is drawn where the generator lives."""
    noise_device = generator.device if generator is not None else out.device
    out = out.float()
    columns = []
    for part, head, std, _ in _part_slices(parts, out, logstd):
        noise = torch.rand(head.shape, generator=generator, device=noise_device).to(out.device)
        if part.kind == "categorical":
            gumbel = -torch.log(-torch.log(noise.clamp_(1e-20, 1.0)))
            columns.append(torch.argmax(torch.log_softmax(head, dim=-1) + gumbel, dim=-1, keepdim=True).float())
        elif part.kind == "bernoulli":
            columns.append((noise < torch.sigmoid(head)).float())
        else:
            eps = torch.randn(head.shape, generator=generator, device=noise_device).to(out.device)
            columns.append(head + std.exp() * eps)
    return torch.cat(columns, dim=-1)


def parts_mode(parts, out: torch.Tensor) -> torch.Tensor:
    """The most likely composite action: argmax choices, Gaussian means, Bernoulli logits > 0."""
    out = out.float()
    columns = []
    for part, head, _, _ in _part_slices(parts, out, None):
        if part.kind == "categorical":
            columns.append(head.argmax(dim=-1, keepdim=True).float())
        elif part.kind == "bernoulli":
            columns.append((head > 0).float())
        else:
            columns.append(head)
    return torch.cat(columns, dim=-1)


def parts_logp_entropy(parts, out: torch.Tensor, actions: torch.Tensor,
                       logstd: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of stored composite ``actions`` and the entropy: sums over the parts (they are independent given
    the observation). A masked categorical part's entropy is over its legal choices (illegal ones have
    probability 0, and 0 * MASKED_LOGIT is 0)."""
    logp = torch.zeros(out.shape[0], device=out.device, dtype=torch.float32)
    entropy = torch.zeros_like(logp)
    for part, head, std, column in _part_slices(parts, out, logstd):
        taken = actions[:, column]
        if part.kind == "categorical":
            logp_all = torch.log_softmax(head.float(), dim=-1)
            logp = logp + logp_all.gather(-1, taken.long()).squeeze(-1)
            entropy = entropy - (logp_all.exp() * logp_all).sum(-1)
        elif part.kind == "bernoulli":
            head = head.float()
            log_on, log_off = torch.nn.functional.logsigmoid(head), torch.nn.functional.logsigmoid(-head)
            logp = logp + (taken * log_on + (1 - taken) * log_off).sum(-1)
            entropy = entropy - (torch.sigmoid(head) * log_on + torch.sigmoid(-head) * log_off).sum(-1)
        else:
            std = std.expand_as(head)
            logp = logp + gaussian_logp(taken, head.float(), std)
            entropy = entropy + (0.5 + 0.5 * math.log(2 * math.pi) + std).sum(-1)
    return logp, entropy


def gaussian_logp(x: torch.Tensor, mean: torch.Tensor, logstd: torch.Tensor) -> torch.Tensor:
    var = torch.exp(2 * logstd)
    return (-((x - mean) ** 2) / (2 * var) - logstd - 0.5 * math.log(2 * math.pi)).sum(-1)


def state_dict_numpy(model: nn.Module) -> dict[str, np.ndarray]:
    """Weights as numpy (what goes through the object store to rollout actors)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


class PolicySet(nn.Module):
    """Several policies in one module (``multiagent.policies``): each an ``ActorCritic`` of its own, with its own
    weights, optimizer state (``learner.learner.Learner`` gives each its own parameter group) and statistics.

    Every observation row ends in the index of the policy that acts for it (``PolicySpec.policies`` order; the
    env appends it: ``actors.multiagent.AgentSlotVectorEnv``), so the rollouts' batch of slots, a stored batch's
    minibatch and ``Policy.act`` are all routed by the same column, and the data plane (fragments, tickets, shards)
    stays that of one policy: every fragment holds each policy's slots in the same numbers, so each policy's share
    of every update is exact. Each policy reads the columns before the index.
    """

    recurrent = False
    state_only = False  # the learner's fused step is for one state-only MLP pair

    def __init__(self, spec: PolicySpec):
        super().__init__()
        if not spec.policies:
            raise ValueError("PolicySet needs PolicySpec.policies")
        self.spec = spec
        self.entries = spec.policies
        self.names = tuple(p.name for p in spec.policies)
        self.policies = nn.ModuleDict({p.name: ActorCritic(spec.policy_spec(p)) for p in spec.policies})
        self.input_name = spec.modalities[0].name
        for entry in self.entries:
            if entry.frozen:
                self.policies[entry.name].requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def policy_ids(self, obs: dict) -> torch.Tensor:
        """(B,) int64: the policy index each row carries in its last column."""
        return obs[self.input_name][:, -1].round().long()

    def _routes(self, obs: dict):
        """(policy name, its rows, its observation) for every policy with rows in ``obs``."""
        x, ids = obs[self.input_name], self.policy_ids(obs)
        for p, name in enumerate(self.names):
            rows = (ids == p).nonzero().squeeze(1)
            if rows.numel():
                yield name, rows, {self.input_name: x[rows, :-1]}

    def _merge(self, n: int, parts) -> tuple:
        """Per-policy output tuples (rows, tensors) back into ``n`` rows in the input's order."""
        out = None
        for rows, tensors in parts:
            if out is None:
                out = [t.new_empty((n,) + tuple(t.shape[1:])) for t in tensors]
            for o, t in zip(out, tensors):
                o[rows] = t
        if out is None:
            raise ValueError("PolicySet: an empty batch")
        return tuple(out)

    @torch.inference_mode()
    def act(self, obs: dict, generator: torch.Generator | None = None, deterministic: bool = False,
            state: torch.Tensor | None = None):
        n = obs[self.input_name].shape[0]
        return self._merge(n, ((rows, self.policies[name].act(sub, generator, deterministic))
                               for name, rows, sub in self._routes(obs)))

    def value(self, obs: dict, state: torch.Tensor | None = None) -> torch.Tensor:
        n = obs[self.input_name].shape[0]
        return self._merge(n, ((rows, (self.policies[name].value(sub),)) for name, rows, sub in self._routes(obs)))[0]

    def evaluate(self, obs: dict, actions: torch.Tensor):
        n = obs[self.input_name].shape[0]
        return self._merge(n, ((rows, self.policies[name].evaluate(sub, actions[rows]))
                               for name, rows, sub in self._routes(obs)))

    def update_normalizers(self, obs: dict) -> None:
        for name, _, sub in self._routes(obs):
            if name not in self.frozen_names:
                self.policies[name].update_normalizers(sub)

    @property
    def frozen_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.entries if p.frozen)


def build_model(spec: PolicySpec) -> nn.Module:
    """The model a spec describes: one ``ActorCritic``, or a ``PolicySet`` of several (``spec.policies``)."""
    return PolicySet(spec) if spec.policies else ActorCritic(spec)
