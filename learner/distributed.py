"""Data-parallel gradient averaging over torch.distributed.

One flat buffer per step: a single collective instead of one per parameter.
SUM then divide, because HCCL on Ascend 910B has no ReduceOp.AVG; the same
code is correct for NCCL and gloo.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import re
import socket
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from learner.device import DeviceSpec, IntervalClock


#: HCCL_EXEC_TIMEOUT (CANN's environment variable reference, "HCCL_EXEC_TIMEOUT"; hiascend.com, maintenref/envvar,
#: envref_07_0078) depends on the chip family. The Atlas training series (Ascend 910, "A1") takes (0, 17340] s and
#: applies the value rounded down to a multiple of 68 (68 at least). Atlas A2 (910B) and A3 (910_93) take
#: [0, 2**31 - 1] s as given, 0 meaning never; under HCCL_OP_EXPANSION_MODE=AIV they take at most 1091 s (0 or more
#: becomes 1091). A multiple of 68 within A1's range means the same on every family, which is why the learners pick one.
HCCL_EXEC_STEP_S = 68
HCCL_EXEC_MAX_S = {"A1": 17340, "A2": 2**31 - 1, "A3": 2**31 - 1}
HCCL_EXEC_AIV_MAX_S = 1091
#: HCCL_CONNECT_TIMEOUT: [120, 7200] s on every family (the same reference, envref_07_0077).
HCCL_CONNECT_TIMEOUT_RANGE_S = (120, 7200)
#: torch_npu's watchdog (the process group's timeout) must fire after HCCL's own execution timeout: HCCL's timeout
#: is the one that writes its report (plog) naming the stuck collective, and torch_npu warns at start-up when the
#: group's timeout is at most HCCL_EXEC_TIMEOUT (Ascend/pytorch, torch_npu/csrc/distributed/ProcessGroupHCCL.cpp).
#: This is the lead HCCL gets; torch_npu's own default gives it 1800 s, which would only delay the abort here.
WATCHDOG_AFTER_EXEC_S = 60
#: What a collective may wait beyond the run's own deadlines before the backend's watchdog aborts the rank: the
#: driver ends an iteration at run.stall_timeout_s + 30 s (cluster/driver.py, ITERATION_GRACE_S), and a rank's peer
#: may wait one stall deadline for its batch and then a board replacement (up to max(30 s, stall)) before it joins
#: the all-reduce. The driver, which writes final.pt and says why, must always decide first.
COLLECTIVE_MARGIN_S = 120.0


def collective_timeout_s(stall_timeout_s: float) -> float:
    """The shortest wait a collective must be allowed: the process group's timeout (which NCCL's and HCCL's
    watchdogs apply to every collective) and HCCL's execution timeout are both at least this."""
    return 2.0 * stall_timeout_s + COLLECTIVE_MARGIN_S


def chip_family(soc: str | None) -> str | None:
    """"A1", "A2" or "A3" for a torch_npu SoC name (``torch.npu.get_device_name()``: Ascend910B3, Ascend910_9391,
    Ascend910ProB, ...), None for another or an unknown chip. The names are torch_npu's (NpuVariables.cpp): a bare
    "Ascend910B" sorts before Ascend910B1 there and is treated as the older family."""
    soc = (soc or "").strip()
    if re.fullmatch(r"Ascend910B\d.*", soc):
        return "A2"
    if soc.startswith("Ascend910_93"):
        return "A3"
    if re.fullmatch(r"Ascend910(Premium|Pro)?[AB]?", soc):
        return "A1"
    return None


def applied_exec_timeout_s(value: int, family: str | None, aiv: bool = False) -> float:
    """The HCCL_EXEC_TIMEOUT HCCL applies for a set ``value`` (inf: never). Unknown family: the longest reading."""
    if family in ("A2", "A3", None) and aiv:
        return HCCL_EXEC_AIV_MAX_S if value <= 0 or value > HCCL_EXEC_AIV_MAX_S else value
    if family == "A1":
        return max(HCCL_EXEC_STEP_S, min(value, HCCL_EXEC_MAX_S["A1"]) // HCCL_EXEC_STEP_S * HCCL_EXEC_STEP_S)
    return math.inf if value == 0 else value


def exec_timeout_for(needed_s: float, family: str | None, aiv: bool = False) -> int:
    """The smallest HCCL_EXEC_TIMEOUT that HCCL applies as at least ``needed_s`` on ``family``: a multiple of 68 (what
    A1 applies as given, and A2/A3 too), up to the family's maximum (A1's where the family is unknown: valid on all);
    never 0, which A2 and A3 read as no timeout at all."""
    value = max(HCCL_EXEC_STEP_S, math.ceil(needed_s / HCCL_EXEC_STEP_S) * HCCL_EXEC_STEP_S)
    top = HCCL_EXEC_MAX_S.get(family or "A1", HCCL_EXEC_MAX_S["A1"])
    if aiv and family != "A1":
        top = min(top, HCCL_EXEC_AIV_MAX_S)
    return int(min(value, top))


def hccl_settings(collective_s: float, environ=os.environ, family: str | None = None) -> tuple[dict[str, str], float]:
    """(HCCL_EXEC_TIMEOUT and HCCL_CONNECT_TIMEOUT, the process group's timeout) for collectives that must be allowed
    ``collective_s``. A value the user set is kept (the doctor checks it). The group's timeout is at least
    ``collective_s`` and at least WATCHDOG_AFTER_EXEC_S beyond the execution timeout HCCL applies, so HCCL's own
    timeout reports first; with HCCL_EXEC_TIMEOUT=0 (never, on A2/A3) the watchdog alone bounds a collective."""
    aiv = environ.get("HCCL_OP_EXPANSION_MODE", "").strip().upper() == "AIV"
    exec_value = environ.get("HCCL_EXEC_TIMEOUT") or str(exec_timeout_for(collective_s, family, aiv))
    lo, hi = HCCL_CONNECT_TIMEOUT_RANGE_S
    env = {"HCCL_EXEC_TIMEOUT": exec_value,
           "HCCL_CONNECT_TIMEOUT": environ.get("HCCL_CONNECT_TIMEOUT") or str(int(min(max(collective_s, lo), hi)))}
    try:
        applied = applied_exec_timeout_s(int(float(exec_value)), family, aiv)
    except ValueError:  # not a number: HCCL's own parse decides; the doctor names it
        applied = math.inf
    group_s = collective_s if math.isinf(applied) else max(collective_s, applied + WATCHDOG_AFTER_EXEC_S)
    return env, float(group_s)


def npu_chip_family() -> str | None:
    """This process's NPU family from torch_npu (None where it cannot tell: the settings then hold on every family)."""
    try:
        import torch

        return chip_family(torch.npu.get_device_name())
    except Exception:  # noqa: BLE001 - an older torch_npu, no device yet: the family-independent choice
        return None


#: Connections the rendezvous socket queues before accepting: one per other rank at once is what a group asks of it.
RENDEZVOUS_BACKLOG = 128


def rendezvous_socket(host: str) -> socket.socket:
    """Rank 0's listening socket for the group's store, bound to ``host`` (its node's Ray address: 127.0.0.1 for the
    embedded Ray) and not to every interface: a torch TCPStore opened by port alone listens on all of them, where
    anyone who reaches the host could set the group's keys (the ranks' addresses among them) while it meets. Held
    from the moment its port is handed out, so no other process can take the port in between."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, 0))
        s.listen(RENDEZVOUS_BACKLOG)
    except BaseException:
        s.close()
        raise
    return s


def init_process_group(backend: str, master_addr: str, master_port: int, rank: int, world_size: int,
                       timeout_s: float = COLLECTIVE_MARGIN_S, listening: socket.socket | None = None) -> None:
    """``timeout_s`` bounds the rendezvous and, under NCCL and HCCL, every collective (``collective_timeout_s``).
    Under HCCL the group's timeout grows past HCCL's execution timeout (``hccl_settings``). ``listening``: rank 0's
    ``rendezvous_socket`` at ``master_addr:master_port``, which its store serves on (and owns from here on);
    without it, rank 0's store opens the port on every interface."""
    if backend == "hccl":  # read by HCCL when the group's communicator is made, in this process
        env, timeout_s = hccl_settings(timeout_s, os.environ, npu_chip_family())
        os.environ.update(env)
    timeout = datetime.timedelta(seconds=timeout_s)
    serve = rank == 0 and listening is not None
    store = dist.TCPStore(master_addr, master_port, world_size, rank == 0, timeout, wait_for_workers=False,
                          master_listen_fd=listening.detach() if serve else None)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


class _Untimed:
    """The clock of a collective made without one (tests, bench scripts): it marks nothing."""

    @staticmethod
    def interval():
        return contextlib.nullcontext()


_UNTIMED = _Untimed()


class GradAllReduce:
    """Every rank must hand the collective a buffer of the same length and layout, or gloo raises and NCCL and HCCL
    hang or mix up parameters. So the buffer holds every trainable parameter, in the model's order, whether or not
    this rank's backward reached it (several policies: a rank whose minibatch had no rows of one leaves its
    gradients None): a missing gradient is zeros, and comes back as the ranks' mean."""

    def __init__(self, world_size: int, clock: IntervalClock | None = None):
        self.world_size = world_size
        self.calls = 0
        self.clock = clock if clock is not None else _UNTIMED

    def __call__(self, model: nn.Module) -> None:
        # Timed whole: packing the gradients, the collective (with its wait for the slowest rank) and unpacking are
        # what data parallelism adds to a step.
        with self.clock.interval():
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

    def __init__(self, world_size: int, clock: IntervalClock | None = None):
        self.world_size = world_size
        self.clock = clock if clock is not None else _UNTIMED

    def __call__(self, value: torch.Tensor) -> torch.Tensor:
        with self.clock.interval():
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

    def __init__(self, world_size: int, clock: IntervalClock | None = None):
        self.world_size = world_size
        self.clock = clock if clock is not None else _UNTIMED

    def __call__(self, model: nn.Module) -> None:
        groups = [m for m in model.modules() if hasattr(m, "running_mean") and hasattr(m, "running_count")]
        if not groups:
            return
        with self.clock.interval():  # the gather and the host's pooling: the ranks' statistics made one
            self._pool(groups)

    def _pool(self, groups: list[nn.Module]) -> None:
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


class LearnerCollectives(NamedTuple):
    """Every collective an update makes over the learner group, all marking one clock, so the update's collective
    seconds (``Learner``'s ``collective_clock``, read once per update) hold each of them: the gradient all-reduce of
    every minibatch step, the normaliser statistics' gather, and the ranks' mean of target_kl's epoch KL and of the
    non-finite flag."""
    grad: GradAllReduce
    stats: RunningStatsAllReduce
    mean: MeanAllReduce
    clock: IntervalClock


def learner_collectives(world_size: int, spec: DeviceSpec) -> LearnerCollectives | None:
    """The collectives of one learner of ``world_size`` on ``spec``'s device, timed on the device's clock
    (``DeviceSpec.interval_clock``); None with one learner, which makes none."""
    if world_size <= 1:
        return None
    clock = spec.interval_clock()
    return LearnerCollectives(GradAllReduce(world_size, clock), RunningStatsAllReduce(world_size, clock),
                              MeanAllReduce(world_size, clock), clock)
