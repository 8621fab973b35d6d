"""Data-parallel gradient averaging over torch.distributed.

One flat buffer per step: a single collective instead of one per parameter.
SUM then divide, because HCCL on Ascend 910B has no ReduceOp.AVG; the same
code is correct for NCCL and gloo.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch import nn


#: HCCL's own limits on its timeouts (CANN's environment variable reference): HCCL_EXEC_TIMEOUT is taken in [68,
#: 17340] s (rounded down to a multiple of 68), HCCL_CONNECT_TIMEOUT in [120, 7200] s.
HCCL_EXEC_TIMEOUT_RANGE_S = (68, 17340)
HCCL_CONNECT_TIMEOUT_RANGE_S = (120, 7200)
#: What a collective may wait beyond the run's own deadlines before the backend's watchdog aborts the rank: the
#: driver ends an iteration at run.stall_timeout_s + 30 s (cluster/driver.py, ITERATION_GRACE_S), and a rank's peer
#: may wait one stall deadline for its batch and then a board replacement (up to max(30 s, stall)) before it joins
#: the all-reduce. The driver, which writes final.pt and says why, must always decide first.
COLLECTIVE_MARGIN_S = 120.0


def collective_timeout_s(stall_timeout_s: float) -> float:
    """The process group's timeout, which NCCL's and HCCL's watchdogs also apply to every collective."""
    return 2.0 * stall_timeout_s + COLLECTIVE_MARGIN_S


def hccl_environment(timeout_s: float, environ=os.environ) -> dict[str, str]:
    """HCCL_EXEC_TIMEOUT and HCCL_CONNECT_TIMEOUT for a process group of ``timeout_s``, within HCCL's ranges; a
    value the user set is kept (the doctor names both)."""
    out = {}
    for key, (lo, hi) in (("HCCL_EXEC_TIMEOUT", HCCL_EXEC_TIMEOUT_RANGE_S),
                          ("HCCL_CONNECT_TIMEOUT", HCCL_CONNECT_TIMEOUT_RANGE_S)):
        out[key] = environ.get(key) or str(int(min(max(timeout_s, lo), hi)))
    return out


def init_process_group(backend: str, master_addr: str, master_port: int, rank: int, world_size: int,
                       timeout_s: float = COLLECTIVE_MARGIN_S) -> None:
    """``timeout_s`` bounds the rendezvous and, under NCCL and HCCL, every collective (``collective_timeout_s``)."""
    if backend == "hccl":  # read by HCCL when the group's communicator is made, in this process
        os.environ.update(hccl_environment(timeout_s))
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


class GradAllReduce:
    """Every rank must hand the collective a buffer of the same length and layout, or gloo raises and NCCL and HCCL
    hang or mix up parameters. So the buffer holds every trainable parameter, in the model's order, whether or not
    this rank's backward reached it (several policies: a rank whose minibatch had no rows of one leaves its
    gradients None): a missing gradient is zeros, and comes back as the ranks' mean."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.calls = 0

    def __call__(self, model: nn.Module) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= self.world_size
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            if p.grad is None:
                p.grad = g
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

    The collective moves float32 (the buffers' own type; Ascend supports float64 on the device poorly) and the
    pooling runs in float64 on the host, the same on every rank.
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
        flat = torch.cat(parts).float()
        # One collective; the pooling below then runs identically on every rank, so they end bitwise equal.
        gathered = [torch.empty_like(flat) for _ in range(self.world_size)]
        dist.all_gather(gathered, flat)
        per_rank = torch.stack(gathered).cpu().double()  # (world, 1 + 2n per group)
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
