"""Actor-critic policy (CleanRL layout: separate actor and critic MLPs).

The same class runs in two places: a CPU copy inside every rollout actor
(``act``: sample an action, its log-prob and the value, in one pass and
without ``torch.distributions`` overhead) and the trained copy in each learner
(``evaluate``: log-prob, entropy and value of stored actions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class PolicySpec:
    """What the model needs to know about the environment's spaces."""

    obs_shape: tuple[int, ...]
    #: "discrete" (Categorical over ``action_dim`` choices) or "continuous"
    #: (diagonal Gaussian over ``action_dim`` dimensions).
    action_kind: str
    action_dim: int
    hidden_sizes: tuple[int, ...] = (64, 64)

    @property
    def obs_dim(self) -> int:
        return int(np.prod(self.obs_shape))


def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    """Orthogonal weights with gain ``std`` and constant bias (PPO detail #2)."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class _SigmoidTanh(torch.autograd.Function):
    """tanh(x) = 2 * sigmoid(2x) - 1, with the backward from the output: 1 - y^2."""

    @staticmethod
    def forward(ctx, x):
        y = torch.sigmoid(x * 2).mul_(2).sub_(1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


class Tanh(nn.Module):
    """tanh, computed through sigmoid on CPU tensors.

    On this project's CPU path ``torch.tanh`` was the largest single cost of a PPO update (22% of the
    profile: 70 us per 512x64 call against 7.6 us for ``torch.sigmoid``). The identity is exact; the result
    differs from ``torch.tanh`` by at most a few float32 ulps (tested). Accelerators keep ``torch.tanh``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cpu:  # device metadata, not a sync
            return _SigmoidTanh.apply(x)
        return torch.tanh(x)


def mlp(in_dim: int, hidden: tuple[int, ...], out_dim: int, head_std: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [layer_init(nn.Linear(in_dim, h)), Tanh()]
        in_dim = h
    # Policy head gain 0.01 keeps the initial policy near uniform; value head gain 1.
    layers.append(layer_init(nn.Linear(in_dim, out_dim), std=head_std))
    return nn.Sequential(*layers)


POLICY_HEAD_STD = 0.01
VALUE_HEAD_STD = 1.0


class ActorCritic(nn.Module):
    def __init__(self, spec: PolicySpec):
        super().__init__()
        self.spec = spec
        self.critic = mlp(spec.obs_dim, spec.hidden_sizes, 1, VALUE_HEAD_STD)
        self.actor = mlp(spec.obs_dim, spec.hidden_sizes, spec.action_dim, POLICY_HEAD_STD)
        if spec.action_kind == "continuous":
            # State-independent log std, as in CleanRL's continuous PPO.
            self.actor_logstd = nn.Parameter(torch.zeros(spec.action_dim))

    def _flat(self, obs: torch.Tensor) -> torch.Tensor:
        return obs.reshape(obs.shape[0], -1).float()

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(self._flat(obs)).squeeze(-1)

    @torch.inference_mode()
    def act(self, obs: torch.Tensor, generator: torch.Generator | None = None):
        """Sample actions. Returns (action, logp, value), all detached."""
        x = self._flat(obs)
        value = self.critic(x).squeeze(-1)
        out = self.actor(x)
        action, logp = sample_action(self.spec.action_kind, out, getattr(self, "actor_logstd", None), generator)
        return action, logp, value

    def evaluate(self, obs: torch.Tensor, actions: torch.Tensor):
        """Log-prob and entropy of ``actions`` under the current policy, and V(obs)."""
        x = self._flat(obs)
        value = self.critic(x).squeeze(-1)
        out = self.actor(x)
        logp, entropy = action_logp_entropy(self.spec.action_kind, out, actions, getattr(self, "actor_logstd", None))
        return logp, entropy, value


def sample_action(action_kind: str, out: torch.Tensor, logstd: torch.Tensor | None,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample from the policy head's output; (action, its log-prob). Shared by both models.

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


def gaussian_logp(x: torch.Tensor, mean: torch.Tensor, logstd: torch.Tensor) -> torch.Tensor:
    var = torch.exp(2 * logstd)
    return (-((x - mean) ** 2) / (2 * var) - logstd - 0.5 * math.log(2 * math.pi)).sum(-1)


def state_dict_numpy(model: nn.Module) -> dict[str, np.ndarray]:
    """Weights as numpy (what goes through the object store to rollout actors)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
