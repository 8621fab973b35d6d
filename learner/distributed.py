"""Data-parallel gradient averaging over torch.distributed.

One flat buffer per step: a single collective instead of one per parameter.
SUM then divide, because HCCL on Ascend 910B has no ReduceOp.AVG; the same
code is correct for NCCL and gloo.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch import nn


def init_process_group(backend: str, master_addr: str, master_port: int, rank: int, world_size: int,
                       timeout_s: float = 120.0) -> None:
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


class GradAllReduce:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.calls = 0

    def __call__(self, model: nn.Module) -> None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= self.world_size
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n
        self.calls += 1


class MeanAllReduce:
    """A tensor's mean over the ranks: ppo.target_kl's epoch KL, so that every rank stops at the same epoch (a
    rank that stopped alone would leave the others waiting in their next gradient all-reduce)."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def __call__(self, value: torch.Tensor) -> torch.Tensor:
        value = value.detach().clone().reshape(1)
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value[0] / self.world_size


def broadcast_params(model: nn.Module, src: int = 0) -> None:
    """Start every rank from rank 0's weights."""
    for p in model.parameters():
        dist.broadcast(p.data, src=src)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class RunningStatsAllReduce:
    """Make every rank's running mean/var buffers identical after each rank folded in its own batch.

    Each rank holds (count, mean, var) = prior merged with its batch. The ranks' summaries are gathered and pooled
    with the parallel-variance combination (Chan et al.): M2 = sum(c_i * var_i) + sum(c_i * (mean_i - mean)^2). That,
    in float64, and not E[x^2] - mean^2 in float32: for a feature at mean 100 with variance 1e-4 the latter cancels to
    0, and the feature is then divided by sqrt(eps). The count is divided by the world size again so the prior's
    weight stays what one rank gave it. Without this, ranks would normalise differently and their gradients would
    no longer average into one model's gradient.
    """

    def __init__(self, world_size: int):
        self.world_size = world_size

    def __call__(self, model: nn.Module) -> None:
        groups = [m for m in model.modules() if hasattr(m, "running_mean") and hasattr(m, "running_count")]
        if not groups:
            return
        parts = []
        for m in groups:
            parts += [m.running_count.reshape(1), m.running_mean.reshape(-1), m.running_var.reshape(-1)]
        flat = torch.cat(parts).double()
        # One collective; the pooling below then runs identically on every rank, so they end bitwise equal.
        gathered = [torch.empty_like(flat) for _ in range(self.world_size)]
        dist.all_gather(gathered, flat)
        per_rank = torch.stack(gathered)  # (world, 1 + 2n per group)
        offset = 0
        for m in groups:
            n = m.running_mean.numel()
            c = per_rank[:, offset:offset + 1]
            mean_i = per_rank[:, offset + 1:offset + 1 + n]
            var_i = per_rank[:, offset + 1 + n:offset + 1 + 2 * n]
            total = c.sum(0)
            mean = (c * mean_i).sum(0) / total
            m2 = (c * var_i).sum(0) + (c * (mean_i - mean).square()).sum(0)
            # copy_ casts back: the buffers keep their dtype and shape.
            m.running_mean.copy_(mean.view_as(m.running_mean))
            m.running_var.copy_((m2 / total).view_as(m.running_var))
            m.running_count.copy_((total / self.world_size).view_as(m.running_count))
            offset += 1 + 2 * n
