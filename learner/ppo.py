"""PPO loss terms as pure functions over tensors (no I/O, no module state).

Each implementation detail is a separate, named step so that the unit tests
can check it against hand-computed numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossCoefs:
    clip_coef: float = 0.2
    clip_vloss: bool = True
    vf_coef: float = 0.5
    ent_coef: float = 0.01
    norm_adv: bool = True


def normalize_advantages(adv: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Per-minibatch normalisation (CleanRL; uses the unbiased std).

    One sample has no unbiased std (it is NaN): it is only zero-centred, i.e. its advantage becomes 0.
    The branch is on the shape, so it costs no host sync.
    """
    if adv.numel() < 2:
        return adv - adv.mean()
    std, mean = torch.std_mean(adv)  # one pass for both
    return (adv - mean) / (std + eps)


def clipped_surrogate(logratio: torch.Tensor, adv: torch.Tensor, clip_coef: float) -> torch.Tensor:
    """Policy loss: mean of max(-A r, -A clip(r, 1-eps, 1+eps))."""
    ratio = logratio.exp()
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
    return torch.max(pg1, pg2).mean()


def value_loss(new_values, old_values, returns, clip_coef: float, clip: bool) -> torch.Tensor:
    """0.5 * squared error; with ``clip`` the pessimistic max of clipped and unclipped."""
    unclipped = (new_values - returns) ** 2
    if not clip:
        return 0.5 * unclipped.mean()
    v_clipped = old_values + torch.clamp(new_values - old_values, -clip_coef, clip_coef)
    clipped = (v_clipped - returns) ** 2
    return 0.5 * torch.max(unclipped, clipped).mean()


def approx_kl(logratio: torch.Tensor) -> torch.Tensor:
    """The low-variance estimator E[(r - 1) - log r] (Schulman's k3)."""
    return ((logratio.exp() - 1) - logratio).mean()


def clip_fraction(logratio: torch.Tensor, clip_coef: float) -> torch.Tensor:
    return ((logratio.exp() - 1.0).abs() > clip_coef).float().mean()


def ppo_loss(new_logp, entropy, new_values, old_logp, old_values, advantages, returns, coefs: LossCoefs):
    """Total loss and its parts. Stats stay tensors: no host sync in the inner loop."""
    logratio = new_logp - old_logp
    adv = normalize_advantages(advantages) if coefs.norm_adv else advantages
    pg_loss = clipped_surrogate(logratio, adv, coefs.clip_coef)
    v_loss = value_loss(new_values, old_values, returns, coefs.clip_coef, coefs.clip_vloss)
    entropy_mean = entropy.mean()
    # Entropy is a bonus: subtracting it from the loss pushes entropy up.
    loss = pg_loss - coefs.ent_coef * entropy_mean + coefs.vf_coef * v_loss
    with torch.no_grad():
        stats = {
            "policy_loss": pg_loss.detach(),
            "value_loss": v_loss.detach(),
            "entropy": entropy_mean.detach(),
            "approx_kl": approx_kl(logratio),
            "clip_fraction": clip_fraction(logratio, coefs.clip_coef),
        }
    return loss, stats


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> torch.Tensor:
    """1 - Var[returns - values] / Var[returns]; NaN when returns are constant."""
    var_y = returns.var()
    return torch.where(var_y == 0, torch.full_like(var_y, float("nan")), 1 - (returns - values).var() / var_y)


def linear_lr(base_lr: float, update: int, total_updates: int) -> float:
    """Linear annealing from ``base_lr`` to 0 over ``total_updates`` (update counts from 0)."""
    frac = 1.0 - min(update, total_updates) / max(total_updates, 1)
    return base_lr * frac
