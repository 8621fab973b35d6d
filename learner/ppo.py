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
    clip_around: str = "behaviour"  # or "update_start": the Learner's decoupled objective (CLIP_AROUND)


#: What PPO's ratio is clipped around. ``behaviour``: the policy that sampled the rows (PPO as published).
#: ``update_start``: the weights the update starts from, with behaviour -> start as a per-row importance weight
#: (the decoupled objective of Hilton et al. 2022). The two are one objective when rollouts are on-policy; with
#: replay.max_policy_lag > 0 the behaviour policy is updates behind, so its clip range is partly spent before the
#: update starts, and the decoupled one gives each update its whole range.
CLIP_AROUND = ("behaviour", "update_start")


def normalize_advantages(adv: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Per-minibatch normalisation (CleanRL; uses the unbiased std).

    One sample has no unbiased std (it is NaN): it is only zero-centred, i.e. its advantage becomes 0.
    The branch is on the shape, so it costs no host sync.
    """
    if adv.numel() < 2:
        return adv - adv.mean()
    std, mean = torch.std_mean(adv)  # one pass for both
    return (adv - mean) / (std + eps)


def normalize_advantages_by_group(adv: torch.Tensor, groups: torch.Tensor, rows: torch.Tensor,
                                  eps: float = 1e-8) -> torch.Tensor:
    """``normalize_advantages`` within each group of rows (``groups``: each row's group; ``rows``: rows per group):
    each group's own mean and unbiased std; a group of one row is only zero-centred."""
    mean = torch.zeros_like(rows).index_add_(0, groups, adv) / rows.clamp(min=1)
    centred = adv - mean[groups]
    # (rows - 1) at least 1: a lone row's centred advantage is exactly 0, and stays 0 over (0 + eps).
    var = torch.zeros_like(rows).index_add_(0, groups, centred * centred) / (rows - 1).clamp(min=1)
    return centred / (var.sqrt() + eps)[groups]


def surrogate_per_row(logratio: torch.Tensor, adv: torch.Tensor, clip_coef: float) -> torch.Tensor:
    """max(-A r, -A clip(r, 1-eps, 1+eps)), per row."""
    ratio = logratio.exp()
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
    return torch.max(pg1, pg2)


def clipped_surrogate(logratio: torch.Tensor, adv: torch.Tensor, clip_coef: float) -> torch.Tensor:
    """Policy loss: mean of max(-A r, -A clip(r, 1-eps, 1+eps))."""
    return surrogate_per_row(logratio, adv, clip_coef).mean()


def value_loss_per_row(new_values, old_values, returns, clip_coef: float, clip: bool) -> torch.Tensor:
    """Squared error per row (times 0.5 in the loss); with ``clip`` the pessimistic max of clipped and unclipped."""
    unclipped = (new_values - returns) ** 2
    if not clip:
        return unclipped
    v_clipped = old_values + torch.clamp(new_values - old_values, -clip_coef, clip_coef)
    clipped = (v_clipped - returns) ** 2
    return torch.max(unclipped, clipped)


def value_loss(new_values, old_values, returns, clip_coef: float, clip: bool) -> torch.Tensor:
    """0.5 * squared error; with ``clip`` the pessimistic max of clipped and unclipped."""
    return 0.5 * value_loss_per_row(new_values, old_values, returns, clip_coef, clip).mean()


def approx_kl_per_row(logratio: torch.Tensor) -> torch.Tensor:
    return (logratio.exp() - 1) - logratio


def approx_kl(logratio: torch.Tensor) -> torch.Tensor:
    """The low-variance estimator E[(r - 1) - log r] (Schulman's k3)."""
    return approx_kl_per_row(logratio).mean()


def clip_fraction_per_row(logratio: torch.Tensor, clip_coef: float) -> torch.Tensor:
    return ((logratio.exp() - 1.0).abs() > clip_coef).float()


def clip_fraction(logratio: torch.Tensor, clip_coef: float) -> torch.Tensor:
    return clip_fraction_per_row(logratio, clip_coef).mean()


def weighted_advantages(advantages: torch.Tensor, norm_adv: bool, importance: torch.Tensor | None) -> torch.Tensor:
    """The advantages the surrogate reads: normalised per minibatch (``norm_adv``), then times each row's importance
    weight where there is one. A positive weight w on a row scales that row's clipped surrogate by w, which is the
    decoupled objective: w * min(r A, clip(r) A) = min(r (w A), clip(r) (w A)) for w > 0."""
    adv = normalize_advantages(advantages) if norm_adv else advantages
    return adv if importance is None else adv * importance


def ppo_loss(new_logp, entropy, new_values, old_logp, old_values, advantages, returns, coefs: LossCoefs,
             importance: torch.Tensor | None = None):
    """Total loss and its parts. Stats stay tensors: no host sync in the inner loop. ``importance``: each row's
    importance weight (the decoupled objective, ``CLIP_AROUND``), else None."""
    logratio = new_logp - old_logp
    adv = weighted_advantages(advantages, coefs.norm_adv, importance)
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


def policies_loss(new_logp, entropy, new_values, old_logp, old_values, advantages, returns, coefs: LossCoefs,
                  groups: torch.Tensor, trains: torch.Tensor,
                  importance: torch.Tensor | None = None):
    """Several policies' PPO losses as one loss with per-row weights.

    Row i belongs to policy ``groups[i]``; ``trains`` (P,) says which policies train. Each policy's advantages are
    normalised over its own rows, and each row of a trained policy weighs 1 / (that policy's rows) in the loss (a
    frozen policy's rows weigh 0), so the loss is the sum of each trained policy's ``ppo_loss`` over its own rows:
    the gradient that reaches a policy's weights is the one it would get training on those rows alone. Returns the
    loss, the statistics over the trained rows (a list in ``MINIBATCH_STATS`` order), each policy's statistics
    (P, 5) and its rows (P,). ``importance``: as ``ppo_loss``'s, masked like the log-ratio. No host sync."""
    P = trains.shape[0]
    rows = torch.bincount(groups, minlength=P).to(new_logp.dtype)
    weight = torch.where(trains, 1.0 / rows.clamp(min=1), 0.0)[groups]
    # A frozen policy's rows weigh 0, and their log-ratio is masked with where, not only multiplied: a stale or
    # non-finite stored log-prob reaches neither the loss nor (as 0 * NaN) the gradient.
    logratio = torch.where(weight > 0, new_logp - old_logp, 0.0)
    adv = normalize_advantages_by_group(advantages, groups, rows) if coefs.norm_adv else advantages
    if importance is not None:
        adv = adv * torch.where(weight > 0, importance, 0.0)
    pg = surrogate_per_row(logratio, adv, coefs.clip_coef)
    v = 0.5 * value_loss_per_row(new_values, old_values, returns, coefs.clip_coef, coefs.clip_vloss)
    loss = (weight * (pg - coefs.ent_coef * entropy + coefs.vf_coef * v)).sum()
    with torch.no_grad():
        per_row = torch.stack([pg, v, entropy, approx_kl_per_row(logratio),
                               clip_fraction_per_row(logratio, coefs.clip_coef)])
        per_row = torch.where(weight > 0, per_row, 0.0)
        per_policy = torch.zeros(P, per_row.shape[0], dtype=per_row.dtype, device=per_row.device)
        per_policy.index_add_(0, groups, per_row.t())
        per_policy /= rows.clamp(min=1).unsqueeze(1)
        trained_rows = (rows * trains).sum()
        stats = list((per_row.sum(1) / trained_rows.clamp(min=1)).unbind())
    return loss, stats, per_policy, rows


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> torch.Tensor:
    """1 - Var[returns - values] / Var[returns]; NaN when returns are constant."""
    var_y = returns.var()
    return torch.where(var_y == 0, torch.full_like(var_y, float("nan")), 1 - (returns - values).var() / var_y)


def linear_lr(base_lr: float, update: int, total_updates: int) -> float:
    """Linear annealing from ``base_lr`` to 0 over ``total_updates`` (update counts from 0)."""
    frac = 1.0 - min(update, total_updates) / max(total_updates, 1)
    return base_lr * frac
