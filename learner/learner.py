"""Learner: PPO updates on one device for one data-parallel rank (plain class).

``Learner.update`` is one loop: epochs, each a pass of minibatches from a sampler, each minibatch one call of a
step function. What varies between models is chosen once, at construction, and named in ``update_path``:

* the step: the reference autograd step (``learner/ppo.py``'s loss, backward, all-reduce, clip, Adam), or the fused
  step (``learner/fused_update.py``: the same step written out for state-only MLPs; the same signature, and a test
  holds it to the autograd step), which ``fused_update.supports`` picks where it covers the model and settings;
* the sampler: shuffled rows, or for a recurrent model shuffled sequences of ``seq_len`` consecutive steps cut
  from the fragments (truncated BPTT);
* several policies (``PolicySet``): one loss whose per-row weights give each policy the gradient of its own rows
  alone (``ppo.policies_loss``).

Gradients are synchronised by an injected ``grad_sync`` (the all-reduce in
``distributed.py``), so tests can drive the update without Ray or a process
group. Statistics stay on the device until the end of the update: one host
sync per update, none in the minibatch loop -- except fp16 with a non-fused
optimizer (the NPU path), where GradScaler.step reads found_inf on the host
once per minibatch step; ``host_syncs`` counts those too.

Precision: ``fp32``, or ``bf16`` / ``fp16`` through ``torch.autocast`` on the
device's type. The loss itself is computed in fp32 from the autocast outputs.
fp16 uses a gradient scaler; the scaled gradients are all-reduced before they
are unscaled, so every rank sees the same inf/nan and skips the same steps.

Non-finite updates: an update whose loss statistics, gradient norm (not under
fp16, where an inf gradient is the scaler's routine and it skips that step
itself), parameters or normaliser statistics come out NaN or inf is not applied.
The weights, the optimizer state and the model's buffers are copied before
every update (``_UpdateGuard``: persistent buffers, one device copy each) and
copied back after such an update, whichever step ran (autograd, fused, graphs).
The decision reads one flag, all-reduced over the learners (``nonfinite_sync``)
and read on the host with the update's statistics: every rank keeps or undoes
the same update, and the check adds no host sync. ``update`` names what was not
finite in its result (``NONFINITE``); the driver counts it and stops the run
after ``run.max_nonfinite_updates`` in a row.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from learner import device as devices
from learner import fused_update as fused_mlp
from learner.ppo import CLIP_AROUND, LossCoefs, explained_variance, linear_lr, policies_loss, ppo_loss
from pipeline import fragment as F
from pipeline import metric_keys as M

#: Where approx-KL sits in an update's minibatch statistics (``sums``): what ppo.target_kl reads.
KL_INDEX = M.MINIBATCH_STATS.index(M.APPROX_KL)
#: The update's result key naming what was not finite ("policy_loss nan", "parameters inf or nan"), or None: the
#: update was applied. Not a metric: the driver counts it (``updates_skipped_nonfinite``).
NONFINITE = "nonfinite"
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
log = logging.getLogger(__name__)


def observations(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's input, {modality: tensor}, from a batch's ``obs/<modality>`` keys."""
    return {k[len(F.OBS_PREFIX):]: v for k, v in batch.items() if k.startswith(F.OBS_PREFIX)}


class Minibatch(NamedTuple):
    """What a step function reads. ``inputs``: the model's input, {modality: rows}; the encoded features (B, D) for
    the fused step; {modality: (L, B, ...)} sequences for a recurrent model, with ``actions`` (L, B, ...) too, the
    stored ``state`` going into each sequence (B, state_size) and the episode ``starts`` (L, B). The targets
    (``old_logp`` .. ``returns``) are one per row, in the order the step's outputs come in (time-major for
    sequences). ``importance``: each row's behaviour -> update-start importance weight under ``ppo.clip_around:
    update_start`` (``old_logp`` and ``old_values`` are then the update start's), else None."""
    inputs: dict[str, torch.Tensor] | torch.Tensor
    actions: torch.Tensor
    old_logp: torch.Tensor
    old_values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    state: torch.Tensor | None = None
    starts: torch.Tensor | None = None
    importance: torch.Tensor | None = None


def _take(x, index, dim: int = 0):
    """``x`` (a tensor, a {name: tensor} dict or None) at ``index`` (a tensor of indices or a slice) along ``dim``."""
    if x is None:
        return None
    if isinstance(x, dict):
        return {k: _take(v, index, dim) for k, v in x.items()}
    if isinstance(index, slice):
        return x[(slice(None),) * dim + (index,)]
    return x.index_select(dim, index)


def row_minibatches(data: Minibatch, size: int, perm: torch.Tensor, gather_epoch: bool) -> Iterator[Minibatch]:
    """The rows of ``data`` in ``perm`` order, ``size`` at a time. ``gather_epoch``: one gather per tensor for the
    whole epoch, then contiguous slices (fewer kernels: for the fused step's few encoded floats a row); otherwise a
    gather per minibatch, so that at most one minibatch's copy of the observations (images: kilobytes a row) is held
    beside the batch."""
    if gather_epoch:
        data = Minibatch(*(_take(t, perm) for t in data))
        for start in range(0, perm.shape[0], size):
            yield Minibatch(*(_take(t, slice(start, start + size)) for t in data))
        return
    for start in range(0, perm.shape[0], size):
        idx = perm[start:start + size]
        yield Minibatch(*(_take(t, idx) for t in data))


def cut_sequences(data: Minibatch, layout: tuple[int, int], seq_len: int) -> Minibatch:
    """A recurrent model's batch, whole fragments of T x N rows (fragment, step, env), cut into sequences of
    ``seq_len`` consecutive steps of one env: every tensor (L, S, ...) with S = fragments * T/L * N, and ``state``
    the stored state going into each sequence's first step (S, state_size). An episode that ends inside a sequence
    resets the state there (``starts``), so every step is a real one and nothing is padded."""
    T, N = layout
    L = seq_len
    K = data.actions.shape[0] // (T * N)  # fragments in the batch

    def cut(x: torch.Tensor) -> torch.Tensor:
        rest = tuple(x.shape[1:])
        x = x.reshape((K, T // L, L, N) + rest).movedim(2, 0)
        return x.reshape((L, K * (T // L) * N) + rest)

    inputs = {k: cut(v) for k, v in data.inputs.items()}
    return Minibatch(inputs, *(cut(t) for t in data[1:6]), state=cut(data.state)[0], starts=cut(data.starts),
                     importance=None if data.importance is None else cut(data.importance))


def sequence_minibatches(data: Minibatch, size: int, perm: torch.Tensor) -> Iterator[Minibatch]:
    """``cut_sequences``' sequences in ``perm`` order, ``size`` at a time; the targets flattened time-major
    ((L, B) -> (L * B,)), the order ``ActorCritic.evaluate_sequences`` returns its outputs in."""
    for begin in range(0, perm.shape[0], size):
        idx = perm[begin:begin + size]
        inputs, actions, *targets = (_take(t, idx, dim=1) for t in data[:6])
        importance = None if data.importance is None else _take(data.importance, idx, dim=1).reshape(-1)
        yield Minibatch(inputs, actions, *(t.reshape(-1) for t in targets), state=data.state.index_select(0, idx),
                        starts=data.starts.index_select(1, idx), importance=importance)


class _UpdateGuard:
    """The learner's trained state (weights, the optimizer's state, the model's buffers) copied before an update and
    copied back after one that was not finite. The copies are persistent buffers, made again only when the state's
    tensors change (the optimizer's state appears at its first step), so an update costs one device copy of each.
    Tensors are copied in place: the fused step's flat buffers and a captured graph's memory keep their addresses."""

    def __init__(self, learner: "Learner"):
        self.learner = learner
        self._saved: list[torch.Tensor] = []
        self._had_state: set[int] = set()
        self._steps = 0

    def tensors(self) -> list[torch.Tensor]:
        learner = self.learner
        if learner.fused is not None:  # the model's parameters are views of the flat buffer
            opt = learner.fused.optimizer
            out = [learner.fused.flat, opt.exp_avg, opt.exp_avg_sq]
        else:
            out = [p.data for p in learner.model.parameters()]
            for group in learner.optimizer.param_groups:
                for p in group["params"]:
                    out += [v for v in learner.optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        return out + list(learner.model.buffers())

    def save(self) -> None:
        tensors = self.tensors()
        if [(t.shape, t.dtype, t.device) for t in tensors] != [(t.shape, t.dtype, t.device) for t in self._saved]:
            self._saved = [t.detach().clone() for t in tensors]
        else:
            with torch.no_grad():
                for saved, t in zip(self._saved, tensors):
                    saved.copy_(t)
        opt = self.learner.optimizer
        self._had_state = {id(p) for p in getattr(opt, "state", {})}
        self._steps = getattr(opt, "steps", 0)

    @torch.no_grad()
    def restore(self) -> None:
        """Back to the state ``save`` saw. An optimizer state its update created (the first step) is dropped."""
        opt = self.learner.optimizer
        if self.learner.fused is not None:
            opt.steps = self._steps
        else:
            for p in [p for p in opt.state if id(p) not in self._had_state]:
                del opt.state[p]
        for saved, t in zip(self._saved, self.tensors()):
            t.copy_(saved)


class _CompiledBackwardFailed(Exception):
    """A compiled model's backward raised (its cause); the minibatch is retried eagerly (``_autograd_epochs``)."""


@dataclasses.dataclass(frozen=True)
class LearnerSettings:
    """What a ``Learner`` is made from, as plain values: it is pickled to every learner actor, so nothing live (no
    model, device or collective) belongs here; those are the constructor's other arguments. ``cluster.graph``'s
    ``learner_settings`` derives it from a config.

    * The optimizer: Adam at ``lr`` with ``adam_eps``, annealed linearly to 0 over ``total_updates`` under
      ``anneal_lr``; ``fused_adam`` None picks torch's one-kernel Adam where the device has it, True/False forces
      it (tests select the NPU path on CPU).
    * The update: ``update_epochs`` passes of ``minibatch_size`` rows (this rank's), gradients clipped to
      ``max_grad_norm``, the loss's ``coefs``; ``target_kl`` stops the epochs once an epoch's mean approx-KL passes
      it (CleanRL's check, after each epoch); ``ent_coef_end`` / ``clip_coef_end`` anneal ``coefs``' ent_coef /
      clip_coef linearly to these over ``total_updates``, as ``anneal_lr`` does the LR. ``seed``: the minibatch
      shuffle's generator.
    * The step: ``precision`` (``PRECISIONS``) and the fp16 scaler's start (``fp16_init_scale``,
      ``fp16_growth_factor``); ``compile`` (torch.compile of the forward, autograd step only); ``fused_update``
      (the fused step where it covers the model); ``graphs`` (``fused_update.LEARNER_GRAPH_MODES``).
    * A recurrent model: ``sequence_layout`` (fragment_length T, envs_per_actor N): its batch is whole fragments of
      T x N rows, time-major; it trains on sequences of ``seq_len`` (L, default T) consecutive steps of one env.
    """

    lr: float
    adam_eps: float
    anneal_lr: bool
    total_updates: int
    update_epochs: int
    minibatch_size: int
    max_grad_norm: float
    coefs: LossCoefs
    seed: int = 0
    target_kl: float | None = None
    ent_coef_end: float | None = None
    clip_coef_end: float | None = None
    precision: str = "fp32"
    fp16_init_scale: float = 2.0**16
    fp16_growth_factor: float = 2.0
    compile: bool = False
    fused_adam: bool | None = None
    fused_update: bool = True
    graphs: str = "auto"
    sequence_layout: tuple[int, int] | None = None
    seq_len: int | None = None


class Learner:
    def __init__(self, model: nn.Module, settings: LearnerSettings, device: torch.device, *, grad_sync=None,
                 stats_sync=None, kl_sync=None, nonfinite_sync=None, collective_clock=None):
        """The collectives over the learner group, each None with one learner (tests drive the update without
        Ray or a process group): ``grad_sync(model)`` all-reduces the gradients, ``stats_sync`` the normaliser
        statistics; ``kl_sync(tensor) -> tensor``, the mean over ranks of target_kl's epoch KL, so every learner
        stops at the same epoch (their all-reduce calls must stay in step); ``nonfinite_sync(tensor) -> tensor``,
        the mean over ranks of each rank's non-finite flag, so every learner undoes the same updates
        (``_UpdateGuard``). ``collective_clock``: the ``learner.device.IntervalClock`` those collectives mark
        (``distributed.learner_collectives``); each update resets it and reads it once, after its host sync, as
        ``COLLECTIVE_S`` (0.0 without one)."""
        self.settings = s = settings
        self.model = model.to(device)
        self.device = device
        self.base_lr, self.anneal_lr, self.total_updates = s.lr, s.anneal_lr, s.total_updates
        self.recurrent = bool(getattr(self.model, "recurrent", False))
        if self.recurrent:
            if s.sequence_layout is None:
                raise ValueError("a recurrent model needs sequence_layout=(fragment_length, envs_per_actor)")
            self.sequence_layout, self.seq_len = tuple(s.sequence_layout), int(s.seq_len or s.sequence_layout[0])
            if self.sequence_layout[0] % self.seq_len or s.minibatch_size % self.seq_len:
                raise ValueError(f"seq_len {self.seq_len} must divide the fragment length {self.sequence_layout[0]} "
                                 f"and the minibatch ({s.minibatch_size})")
        self._choose_step(s)
        self.policy_names = getattr(self.model, "names", None)
        self.optimizer = self._make_optimizer(s)
        self.update_epochs = s.update_epochs
        self.minibatch_size = s.minibatch_size
        self.max_grad_norm = s.max_grad_norm
        self.coefs = self.base_coefs = s.coefs
        if s.coefs.clip_around not in CLIP_AROUND:
            raise ValueError(f"ppo.clip_around: {s.coefs.clip_around!r} is not one of {', '.join(CLIP_AROUND)}")
        self.target_kl, self.kl_sync = s.target_kl, kl_sync
        self.ent_coef_end, self.clip_coef_end = s.ent_coef_end, s.clip_coef_end
        self.grad_sync = grad_sync
        self.stats_sync = stats_sync
        self.nonfinite_sync = nonfinite_sync
        self.collective_clock = collective_clock
        self.updates_skipped_nonfinite = 0
        self.generator = torch.Generator(device="cpu").manual_seed(s.seed)
        self.updates_done = 0
        self.host_syncs = 0
        if s.precision not in PRECISIONS:
            raise ValueError(f"learner.precision: {s.precision!r} is not one of {', '.join(PRECISIONS)}")
        self.precision = s.precision
        self.amp_dtype = PRECISIONS[s.precision]
        self.scaler = (devices.grad_scaler(device.type, init_scale=s.fp16_init_scale,
                                           growth_factor=s.fp16_growth_factor) if s.precision == "fp16" else None)
        self._evaluate = self.model.evaluate_sequences if self.recurrent else self.model.evaluate
        self.compiled = False
        self.compiler_probe = None  # (a CPU compile: learner.device.probe_cpu_compiler's thread)
        self.compile_note = "off"
        if s.compile and self.recurrent:
            self.compile_note = "eager (learner.compile: the recurrent core's step loop is not compiled)"
        elif s.compile:  # (compile always selects the autograd path: fused_update.supports)
            self._try_compile()
        # The step function, chosen once: the fused step where it covers the model and settings, else the reference
        # autograd step; update_path names it, and why (in the first metrics record, and whenever it changes).
        self._step = self._fused_step if self.fused is not None else self._autograd_step
        self._guard = _UpdateGuard(self)
        log.info("learner: update path %s", self.update_path)

    def _choose_step(self, s: LearnerSettings) -> None:
        """``fused`` and ``graphed``, and ``update_path`` naming them: the fused step (learner/fused_update.py)
        when the model and settings allow it, else autograd (``fused`` None, and why)."""
        reason = (fused_mlp.supports(self.model, s.precision, s.compile) if s.fused_update
                  else "learner.fused_update is off")
        self.fused = None if reason else fused_mlp.FusedMLPStep(self.model, lr=s.lr, adam_eps=s.adam_eps)
        self.update_path = "fused" if self.fused else f"autograd ({reason})"
        # learner.graphs: the fused step over static buffers, captured into a device graph where the device can
        # (fused_update.GraphStep); update_path says whether capture is in use, or why not.
        graphs = s.graphs
        if graphs not in fused_mlp.LEARNER_GRAPH_MODES:
            raise ValueError(f"learner.graphs: {graphs!r} is not one of {', '.join(fused_mlp.GRAPH_MODES)}")
        no_capture = devices.spec_for(self.device.type).graph_unavailable() if self.fused is not None else None
        static = graphs in ("static", "capture") or (graphs == "auto" and no_capture is None)
        self.graphed = (fused_mlp.GraphStep(self.fused, force_capture=graphs == "capture")
                        if self.fused is not None and static else None)
        if self.graphed is not None:
            self.update_path = f"fused ({self.graphed.note})"
        elif self.fused is not None and graphs == "auto":
            self.update_path = f"fused (graphs: {no_capture})"

    def _make_optimizer(self, s: LearnerSettings) -> torch.optim.Optimizer:
        """The fused step's optimizer, else torch's Adam; either way torch.optim.Adam's param_groups and state_dict
        format. Adam eps 1e-5 (PPO detail), not torch's default 1e-8. fused=True: one kernel for all parameters
        instead of a loop of small ops per tensor (~10% of a CartPole update on CPU); the device layer knows which
        device types have it (CPU, CUDA; NPU takes the default)."""
        if self.fused is not None:
            return self.fused.optimizer
        fused_adam = devices.supports_fused_adam(self.device.type) if s.fused_adam is None else s.fused_adam
        fused = True if fused_adam else None
        if self.policy_names is None:
            return torch.optim.Adam(self.model.parameters(), lr=s.lr, eps=s.adam_eps, fused=fused)
        # Several policies (learner.model.PolicySet): one parameter group per trained policy, at its own lr; a
        # frozen policy has none. Every group remembers its un-annealed lr (``base_lr``).
        groups = [{"params": list(self.model.policies[p.name].parameters()), "lr": p.lr or s.lr,
                   "base_lr": p.lr or s.lr, "policy": p.name} for p in self.model.entries if not p.frozen]
        if not groups:
            raise ValueError("multiagent.policies: every policy is frozen, so nothing would train; allowed: at "
                             "least one with frozen: false")
        self._policy_index = {name: p for p, name in enumerate(self.policy_names)}
        self._trains = torch.tensor([not p.frozen for p in self.model.entries], device=self.device)
        return torch.optim.Adam(groups, lr=s.lr, eps=s.adam_eps, fused=fused)

    def _try_compile(self) -> None:
        try:
            self._evaluate = torch.compile(self.model.evaluate, dynamic=False)
            self.compiled = True
            self.compile_note = "torch.compile"
            if self.device.type == "cpu":
                self.compiler_probe = devices.probe_cpu_compiler()  # done by the first batch, not paid in it
        except Exception as e:  # e.g. no C++ compiler, unsupported backend
            self._evaluate = self.model.evaluate
            self.compile_note = f"eager (torch.compile unavailable: {type(e).__name__}: {e})"
            log.warning("learner.compile: %s", self.compile_note)

    def _forward(self, *args):
        """Log-prob, entropy and value (fp32) of a minibatch: ``evaluate(obs, actions)``, or for a recurrent model
        ``evaluate_sequences(obs, actions, state, starts)``, under the precision's autocast."""
        with torch.autocast(device_type=self.device.type, dtype=self.amp_dtype or torch.float32,
                            enabled=self.amp_dtype is not None):
            try:
                out = self._evaluate(*args)
            except Exception as e:
                if not self.compiled:
                    raise
                # Compilation errors surface on the first call: fall back to eager once, and say so.
                self._compile_failed("", e)
                out = self._evaluate(*args)
        return tuple(t.float() for t in out)

    def _compile_failed(self, where: str, e: BaseException) -> None:
        self.compiled = False
        self._evaluate = self.model.evaluate
        self.compile_note = f"eager (torch.compile failed{where}: {type(e).__name__}: {str(e)[:200]})"
        log.warning("learner.compile: %s", self.compile_note)

    def current_lr(self) -> float:
        if not self.anneal_lr:
            return self.base_lr
        return linear_lr(self.base_lr, self.updates_done, self.total_updates)

    def current_coefs(self) -> LossCoefs:
        """The loss coefficients of the next update: ent_coef and clip_coef on their schedules."""
        base, frac = self.base_coefs, min(self.updates_done, self.total_updates) / max(self.total_updates, 1)
        changes = {}
        for name, end in (("ent_coef", self.ent_coef_end), ("clip_coef", self.clip_coef_end)):
            if end is not None:
                start = getattr(base, name)
                changes[name] = start + (end - start) * frac
        return dataclasses.replace(base, **changes) if changes else base

    def _kl_passed(self, sums: torch.Tensor, before: torch.Tensor, steps: int) -> bool:
        """Whether the epoch that just ran (its minibatch statistics: ``sums - before`` over ``steps``) has a mean
        approx-KL past target_kl. One host sync per epoch, only with target_kl set."""
        kl = (sums[KL_INDEX] - before[KL_INDEX]) / max(steps, 1)
        if self.kl_sync is not None:
            kl = self.kl_sync(kl)
        self.host_syncs += 1
        return bool(kl.item() > self.target_kl)

    def update(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """PPO epochs over one batch (already on ``self.device``): one loop over the sampler's minibatches and the
        step function chosen at construction (``update_path``)."""
        lr = self.current_lr()
        for group in self.optimizer.param_groups:  # a policy's own lr on the same schedule
            group["lr"] = group.get("base_lr", self.base_lr) * (lr / self.base_lr)
        self.coefs = self.current_coefs()
        self.epochs_run = 0
        obs = observations(batch)
        n = batch[F.ACTIONS].shape[0]
        if n % self.minibatch_size:
            raise ValueError(f"batch of {n} samples is not a multiple of minibatch_size {self.minibatch_size}")
        self.model.train()
        if self.collective_clock is not None:
            self.collective_clock.reset()  # this update's collectives only
        self._guard.save()
        data = self._prepare(obs, batch)
        units = data.actions.shape[1] if self.recurrent else n  # what an epoch shuffles: sequences or rows
        if self.policy_names is not None:
            # Per policy: MINIBATCH_STATS, the grad norm, and the minibatches it had rows in.
            self._policy_sums = torch.zeros(len(self.model.entries), len(M.MINIBATCH_STATS) + 2, device=self.device)
        if self.graphed is not None:
            self.graphed.begin_update(self.coefs, self.minibatch_size, self.update_epochs * (n // self.minibatch_size))
        sums = torch.zeros(len(M.MINIBATCH_STATS) + 1, device=self.device)
        steps = 0
        for _ in range(self.update_epochs):
            before, epoch_start = sums.clone(), steps
            perm = torch.randperm(units, generator=self.generator).to(self.device)
            for minibatch in self._minibatches(data, perm):
                sums += self._step(minibatch)  # (a graph's output buffer: added before the next step writes it)
                steps += 1
            self.epochs_run += 1
            if self.target_kl is not None and self._kl_passed(sums, before, steps - epoch_start):
                break
        if self.graphed is not None:  # a capture that failed during the update says so from now on
            self.update_path = f"fused ({self.graphed.note})"
        with torch.no_grad():
            ev = explained_variance(batch[F.VALUES].float(), batch[F.RETURNS].float())
            # After the epochs: this update trained with the statistics the actors acted with; the new ones ship
            # with the new weights (one policy version = weights + statistics). A no-op without normalised vectors.
            self.model.update_normalizers(obs)
            if self.stats_sync is not None:
                self.stats_sync(self.model)
            flag = self._nonfinite_flag(sums)
        host = torch.cat([sums / steps, ev.reshape(1), flag.reshape(1)]).cpu().numpy()  # the one host sync per update
        self.host_syncs += 1
        self.updates_done += 1
        out = {k: float(v) for k, v in zip(M.MINIBATCH_STATS + (M.GRAD_NORM,), host[:-2])}
        out[M.EXPLAINED_VARIANCE] = float(host[-2])
        # After that sync the stream has passed every collective's marks: read here, the clock waits for nothing.
        out[M.COLLECTIVE_S] = self.collective_clock.seconds() if self.collective_clock is not None else 0.0
        out[NONFINITE] = None
        if host[-1] > 0:  # some rank's update was not finite: every rank undoes it
            self._guard.restore()
            self.updates_skipped_nonfinite += 1
            out[NONFINITE] = self._what_was_not_finite(out)
            log.info("learner: update %d not applied: %s", self.updates_done, out[NONFINITE])
        out[M.LR] = lr
        out["minibatch_steps"] = steps
        out[M.UPDATE_EPOCHS_RUN] = self.epochs_run
        out[M.ENT_COEF], out[M.CLIP_COEF] = self.coefs.ent_coef, self.coefs.clip_coef
        if self.policy_names is not None:
            out.update(self._policy_metrics(obs))
        return out

    def _nonfinite_flag(self, sums: torch.Tensor) -> torch.Tensor:
        """1.0 (a device scalar, no host read) where this update's statistics, gradient norm, weights or buffers hold
        a NaN or inf, on this rank or (``nonfinite_sync``) on any other; else 0.0. Under fp16 the gradient norm is
        left out: an inf gradient there is the scaler's, and the scaler skipped that step."""
        checked = sums[:len(M.MINIBATCH_STATS)] if self.scaler is not None else sums
        # (the device's tensors: a non-fused Adam's step counters live on the host, and are counts)
        state = [t for t in self._guard.tensors() if t.is_floating_point() and t.device == checked.device]
        finite = torch.stack([torch.isfinite(checked).all()] + [torch.isfinite(t).all() for t in state]).all()
        flag = (~finite).to(torch.float32)
        if self.nonfinite_sync is not None:
            flag = self.nonfinite_sync(flag).reshape(())
        return flag.to(sums.device, sums.dtype)

    def _what_was_not_finite(self, out: dict) -> str:
        """The first of the update's statistics that is not finite, in words ("policy_loss nan"); else the state."""
        keys = M.MINIBATCH_STATS + (() if self.scaler is not None else (M.GRAD_NORM,))
        for key in keys:
            if not np.isfinite(out[key]):
                return f"{key} {out[key]}"
        return "the weights, optimizer state or observation statistics (nan or inf)"

    def _prepare(self, obs, batch) -> Minibatch:
        """The whole batch as the sampler and the step read it: the fused step reads the encoded features (computed
        once per update), a recurrent model sequences cut from the fragments. Under ``ppo.clip_around:
        update_start``, with the update start's log-probs and values (``_from_update_start``)."""
        targets = (batch[F.ACTIONS], batch[F.LOGP], batch[F.VALUES], batch[F.ADVANTAGES], batch[F.RETURNS])
        if self.recurrent:
            data = Minibatch(obs, *targets, state=batch[F.RNN_STATE], starts=batch[F.EPISODE_START])
            data = cut_sequences(data, self.sequence_layout, self.seq_len)
        else:
            data = Minibatch(obs, *targets)
        if self.coefs.clip_around == "update_start":
            data = self._from_update_start(data)
        if self.fused is not None:
            with torch.no_grad():
                data = data._replace(inputs=self.model.encode(obs))  # the (normalised) vectors the MLPs read
        return data

    def _from_update_start(self, data: Minibatch) -> Minibatch:
        """The decoupled objective's targets (``learner.ppo.CLIP_AROUND``): the log-prob and value of every row
        under the weights this update starts from (one forward of the batch without gradients, a minibatch at a
        time, so it holds no more activations than a step), as ``old_logp`` / ``old_values``, and behaviour ->
        start, exp(start log-prob - behaviour log-prob), as each row's importance weight."""
        logp, values = [], []
        with torch.no_grad():
            if self.recurrent:  # sequences (L, S, ...): a minibatch's worth of them at a time
                L, S = data.actions.shape[:2]
                size = max(self.minibatch_size // self.seq_len, 1)
                for begin in range(0, S, size):
                    idx = slice(begin, begin + size)
                    out = self._forward(_take(data.inputs, idx, dim=1), data.actions[:, idx], data.state[idx],
                                        data.starts[:, idx])
                    logp.append(out[0].reshape(L, -1))
                    values.append(out[2].reshape(L, -1))
                logp, values = torch.cat(logp, 1), torch.cat(values, 1)
            else:
                n = data.actions.shape[0]
                for begin in range(0, n, self.minibatch_size):
                    idx = slice(begin, begin + self.minibatch_size)
                    out = self._forward(_take(data.inputs, idx), data.actions[idx])
                    logp.append(out[0])
                    values.append(out[2])
                logp, values = torch.cat(logp), torch.cat(values)
            importance = (logp - data.old_logp).exp()
        return data._replace(old_logp=logp, old_values=values, importance=importance)

    def _minibatches(self, data: Minibatch, perm: torch.Tensor) -> Iterator[Minibatch]:
        if self.recurrent:
            return sequence_minibatches(data, self.minibatch_size // self.seq_len, perm)
        return row_minibatches(data, self.minibatch_size, perm, gather_epoch=self.fused is not None)

    def _policy_metrics(self, obs) -> dict[str, float]:
        """Several policies: each one's loss statistics (means over the minibatches it had rows in), its share of
        this update's batch and its lr, as ``policy/<name>/<key>``."""
        ids = self.model.policy_ids(obs)
        host = self._policy_sums.cpu().numpy()
        out = {}
        for p, entry in enumerate(self.model.entries):
            prefix = M.policy_key(entry.name, "")
            out[prefix + M.POLICY_SAMPLES] = int((ids == p).sum())
            if entry.frozen:
                continue
            if host[p, -1]:
                means = host[p, :-1] / host[p, -1]
                out.update({prefix + k: float(v) for k, v in zip(M.MINIBATCH_STATS + (M.GRAD_NORM,), means)})
            group = next(g for g in self.optimizer.param_groups if g.get("policy") == entry.name)
            out[prefix + M.LR] = group["lr"]
        return out

    # ------------------------------------------------------------------ the step functions: (Minibatch) -> stats
    def _fused_step(self, mb: Minibatch) -> torch.Tensor:
        """The fused step (``learner/fused_update.py``), over static buffers where ``learner.graphs`` says so."""
        step = self.graphed.step if self.graphed is not None else self.fused.step
        return step(*mb[:6], self.coefs, self.max_grad_norm, self.grad_sync, mb.importance)

    def _autograd_step(self, mb: Minibatch) -> torch.Tensor:
        """The reference step: ``learner/ppo.py``'s loss, backward, all-reduce, clip, the optimizer. Returns the
        minibatch's ``MINIBATCH_STATS`` then the grad norm, as one tensor (no host sync)."""
        try:
            return self._gradient_step(mb)
        except _CompiledBackwardFailed as failure:
            # AOTAutograd compiles the backward at its first call, so its errors surface here, not in the forward.
            # Nothing has been all-reduced, stepped or counted yet: this minibatch again, eagerly.
            self._compile_failed(" in the backward", failure.__cause__)
            return self._gradient_step(mb)

    def _gradient_step(self, mb: Minibatch) -> torch.Tensor:
        args = (mb.inputs, mb.actions) if mb.state is None else (mb.inputs, mb.actions, mb.state, mb.starts)
        new_logp, entropy, new_values = self._forward(*args)
        targets = (mb.old_logp, mb.old_values, mb.advantages, mb.returns)
        if self.policy_names is None:
            loss, stats = ppo_loss(new_logp, entropy, new_values, *targets, self.coefs, mb.importance)
            stats = [stats[k] for k in M.MINIBATCH_STATS]
        else:
            ids = self.model.policy_ids(mb.inputs)
            loss, stats, per_policy, rows = policies_loss(new_logp, entropy, new_values, *targets, self.coefs, ids,
                                                          self._trains, mb.importance)
            if not loss.requires_grad:
                # (rare) only frozen policies' rows: a zero gradient, so every rank still steps
                loss = sum(p.sum() for g in self.optimizer.param_groups for p in g["params"]) * 0.0
        self.optimizer.zero_grad(set_to_none=False)
        try:
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
        except Exception as e:
            if not self.compiled:
                raise
            raise _CompiledBackwardFailed() from e
        if self.grad_sync is not None:
            self.grad_sync(self.model)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        # Clip the global norm of the already-averaged gradient, so every rank clips identically; several policies:
        # each policy's own norm (one policy's large gradient must not shrink another's step).
        if self.policy_names is None:
            grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        else:
            grad_norm = self._clip_per_policy(per_policy, rows)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips the step when the gradient has inf/nan
            if not getattr(self.optimizer, "_step_supports_amp_scaling", False):
                # A non-fused optimizer (the NPU path): GradScaler decides whether to step on the host,
                # found_inf.item() once per device per step. Fused Adam skips inside its kernel instead.
                # (Non-fused Adam's own step counters are CPU tensors: reading them is no device sync.)
                self.host_syncs += 1
            self.scaler.update()
        else:
            self.optimizer.step()
        return torch.stack(stats + [grad_norm.detach()])

    def _clip_per_policy(self, per_policy: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Several policies: clip each trained policy's gradient to its own norm, and add each one's statistics
        (``per_policy``, (policies, MINIBATCH_STATS)) and norm to ``_policy_sums`` where it had rows here. Returns
        the norm of the policies' norms."""
        norms = torch.zeros(len(self.model.entries), device=self.device)
        for group in self.optimizer.param_groups:
            norm = nn.utils.clip_grad_norm_(group["params"], self.max_grad_norm)
            norms[self._policy_index[group["policy"]]] = norm.detach()
            if not norm:
                # No rank had a row of this policy in this minibatch (the gradients are all-reduced, so every
                # rank sees the same zero norm): no step for it, as it would take none training alone (Adam
                # would otherwise move its weights on momentum). One host read per policy and minibatch.
                for p in group["params"]:
                    p.grad = None
        had = ((rows > 0) & self._trains).to(per_policy.dtype).unsqueeze(1)  # (policies, 1)
        self._policy_sums += torch.cat([per_policy, norms.unsqueeze(1), torch.ones_like(norms).unsqueeze(1)], 1) * had
        trained = [self._policy_index[g["policy"]] for g in self.optimizer.param_groups]
        return torch.linalg.vector_norm(norms[trained])

    def flat_params(self) -> np.ndarray:
        return torch.cat([p.detach().reshape(-1).cpu() for p in self.model.parameters()]).numpy()
