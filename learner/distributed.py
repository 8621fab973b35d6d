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


def broadcast_params(model: nn.Module, src: int = 0) -> None:
    """Start every rank from rank 0's weights."""
    for p in model.parameters():
        dist.broadcast(p.data, src=src)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class RunningStatsAllReduce:
    """Make every rank's running mean/var buffers identical after each rank folded in its own batch.

    Each rank holds (count, mean, var) = prior merged with its batch. Summing count, count * mean and
    count * (var + mean^2) over ranks and dividing gives the mean and variance of the pooled batches (plus the
    shared prior); the count is divided by the world size again so the prior's weight stays what one rank gave
    it. Without this, ranks would normalise differently and their gradients would no longer average into one
    model's gradient.
    """

    def __init__(self, world_size: int):
        self.world_size = world_size

    def __call__(self, model: nn.Module) -> None:
        groups = [m for m in model.modules() if hasattr(m, "running_mean") and hasattr(m, "running_count")]
        if not groups:
            return
        parts = []
        for m in groups:
            c = m.running_count.reshape(1)
            parts += [c, c * m.running_mean, c * (m.running_var + m.running_mean.square())]
        flat = torch.cat(parts)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for m in groups:
            n = m.running_mean.numel()
            c = flat[offset]
            s1 = flat[offset + 1:offset + 1 + n]
            s2 = flat[offset + 1 + n:offset + 1 + 2 * n]
            mean = s1 / c
            m.running_mean.copy_(mean)
            m.running_var.copy_((s2 / c - mean.square()).clamp_min(0.0))
            m.running_count.copy_(c / self.world_size)
            offset += 1 + 2 * n
