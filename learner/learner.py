"""Learner: PPO updates on one device for one data-parallel rank (plain class).

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
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch
from torch import nn

from learner import device as devices
from learner import fused_update as fused_mlp
from learner.ppo import LossCoefs, explained_variance, linear_lr, ppo_loss
from pipeline import fragment as F
from pipeline import metric_keys as M

#: Where approx-KL sits in an update's minibatch statistics (``sums``): what ppo.target_kl reads.
KL_INDEX = M.MINIBATCH_STATS.index(M.APPROX_KL)
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
log = logging.getLogger(__name__)


def observations(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's input, {modality: tensor}, from a batch's ``obs/<modality>`` keys."""
    return {k[len(F.OBS_PREFIX):]: v for k, v in batch.items() if k.startswith(F.OBS_PREFIX)}


class _CompiledBackwardFailed(Exception):
    """A compiled model's backward raised (its cause); the minibatch is retried eagerly (``_autograd_epochs``)."""


class Learner:
    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float,
        adam_eps: float,
        anneal_lr: bool,
        total_updates: int,
        update_epochs: int,
        minibatch_size: int,
        max_grad_norm: float,
        coefs: LossCoefs,
        device: torch.device,
        seed: int = 0,
        grad_sync=None,
        stats_sync=None,
        precision: str = "fp32",
        fp16_init_scale: float = 2.0**16,
        fp16_growth_factor: float = 2.0,
        compile: bool = False,
        fused_adam: bool | None = None,
        fused_update: bool = True,
        graphs: str = "auto",
        sequence_layout: tuple[int, int] | None = None,
        seq_len: int | None = None,
        target_kl: float | None = None,
        kl_sync=None,
        ent_coef_end: float | None = None,
        clip_coef_end: float | None = None,
    ):
        """``sequence_layout`` (fragment_length T, envs_per_actor N) and ``seq_len`` (L): a recurrent model's batch
        is whole fragments of T x N rows, time-major; it trains on sequences of L consecutive steps of one env.

        ``target_kl``: stop an update's epochs once an epoch's mean approx-KL passes it (CleanRL's check, after
        each epoch); ``kl_sync(tensor) -> tensor``, the mean over ranks, so every learner stops at the same epoch
        (their all-reduce calls must stay in step). ``ent_coef_end`` / ``clip_coef_end``: anneal ``coefs``'
        ent_coef / clip_coef linearly to these over ``total_updates``, as ``anneal_lr`` does the LR."""
        self.model = model.to(device)
        self.device = device
        self.base_lr = lr
        self.anneal_lr = anneal_lr
        self.total_updates = total_updates
        # Adam eps 1e-5 (PPO detail), not torch's default 1e-8.
        # fused=True: one kernel for all parameters instead of a loop of small ops per tensor (~10% of a CartPole
        # update on CPU); the device layer knows which device types have it (CPU, CUDA; NPU takes the default).
        # fused_adam=None picks that by device; True/False forces it (tests select the NPU path on CPU).
        if fused_adam is None:
            fused_adam = devices.supports_fused_adam(device.type)
        # The fused step (learner/fused_update.py) when the model and settings allow it, else autograd. Either way
        # ``self.optimizer`` has torch.optim.Adam's param_groups and state_dict format.
        self.recurrent = bool(getattr(self.model, "recurrent", False))
        if self.recurrent:
            if sequence_layout is None:
                raise ValueError("a recurrent model needs sequence_layout=(fragment_length, envs_per_actor)")
            self.sequence_layout, self.seq_len = tuple(sequence_layout), int(seq_len or sequence_layout[0])
            if self.sequence_layout[0] % self.seq_len or minibatch_size % self.seq_len:
                raise ValueError(f"seq_len {self.seq_len} must divide the fragment length {self.sequence_layout[0]} "
                                 f"and the minibatch ({minibatch_size})")
        reason = fused_mlp.supports(self.model, precision, compile) if fused_update else "learner.fused_update is off"
        self.fused = None if reason else fused_mlp.FusedMLPStep(self.model, lr=lr, adam_eps=adam_eps)
        self.update_path = "fused" if self.fused else f"autograd ({reason})"
        # learner.graphs: the fused step over static buffers, captured into a device graph where the device can
        # (fused_update.GraphStep); update_path says whether capture is in use, or why not.
        if graphs not in fused_mlp.LEARNER_GRAPH_MODES:
            raise ValueError(f"learner.graphs: {graphs!r} is not one of {', '.join(fused_mlp.GRAPH_MODES)}")
        no_capture = devices.spec_for(self.device.type).graph_unavailable() if self.fused is not None else None
        static = graphs == "static" or (graphs == "auto" and no_capture is None)
        self.graphed = fused_mlp.GraphStep(self.fused) if self.fused is not None and static else None
        if self.graphed is not None:
            self.update_path = f"fused ({self.graphed.note})"
        elif self.fused is not None and graphs == "auto":
            self.update_path = f"fused (graphs: {no_capture})"
        # Several policies (learner.model.PolicySet): one parameter group per trained policy, at its own lr; a
        # frozen policy has none. Every group remembers its un-annealed lr (``base_lr``).
        self.policy_names = getattr(self.model, "names", None)
        if self.fused is not None:
            self.optimizer = self.fused.optimizer
        elif self.policy_names is not None:
            groups = [{"params": list(self.model.policies[p.name].parameters()), "lr": p.lr or lr, "base_lr": p.lr or lr,
                       "policy": p.name} for p in self.model.entries if not p.frozen]
            if not groups:
                raise ValueError("multiagent.policies: every policy is frozen, so nothing would train; allowed: at "
                                 "least one with frozen: false")
            self.optimizer = torch.optim.Adam(groups, lr=lr, eps=adam_eps, fused=True if fused_adam else None)
        else:
            self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr, eps=adam_eps,
                                              fused=True if fused_adam else None)
        self.update_epochs = update_epochs
        self.minibatch_size = minibatch_size
        self.max_grad_norm = max_grad_norm
        self.coefs = self.base_coefs = coefs
        self.target_kl, self.kl_sync = target_kl, kl_sync
        self.ent_coef_end, self.clip_coef_end = ent_coef_end, clip_coef_end
        self.grad_sync = grad_sync
        self.stats_sync = stats_sync
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.updates_done = 0
        self.host_syncs = 0
        if precision not in PRECISIONS:
            raise ValueError(f"learner.precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
        self.precision = precision
        self.amp_dtype = PRECISIONS[precision]
        self.scaler = (devices.grad_scaler(device.type, init_scale=fp16_init_scale, growth_factor=fp16_growth_factor)
                       if precision == "fp16" else None)
        self._evaluate = self.model.evaluate
        self.compiled = False
        self.compile_note = "off"
        if compile and self.recurrent:
            self.compile_note = "eager (learner.compile: the recurrent core's step loop is not compiled)"
        elif compile:  # (compile always selects the autograd path: fused_update.supports)
            self._try_compile()

    def _try_compile(self) -> None:
        try:
            self._evaluate = torch.compile(self.model.evaluate, dynamic=False)
            self.compiled = True
            self.compile_note = "torch.compile"
        except Exception as e:  # e.g. no C++ compiler, unsupported backend
            self._evaluate = self.model.evaluate
            self.compile_note = f"eager (torch.compile unavailable: {type(e).__name__}: {e})"
            log.warning("learner.compile: %s", self.compile_note)

    def _forward(self, obs, actions):
        with torch.autocast(device_type=self.device.type, dtype=self.amp_dtype or torch.float32,
                            enabled=self.amp_dtype is not None):
            try:
                out = self._evaluate(obs, actions)
            except Exception as e:
                if not self.compiled:
                    raise
                # Compilation errors surface on the first call: fall back to eager once, and say so.
                self._compile_failed("", e)
                out = self._evaluate(obs, actions)
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
        """PPO epochs over one batch (already on ``self.device``)."""
        lr = self.current_lr()
        for group in self.optimizer.param_groups:  # a policy's own lr on the same schedule
            group["lr"] = group.get("base_lr", self.base_lr) * (lr / self.base_lr)
        self._policy_sums = None
        self.coefs = self.current_coefs()
        self.epochs_run = 0
        obs = observations(batch)
        actions, old_logp = batch[F.ACTIONS], batch[F.LOGP]
        old_values, adv, returns = batch[F.VALUES], batch[F.ADVANTAGES], batch[F.RETURNS]
        n = actions.shape[0]
        if n % self.minibatch_size:
            raise ValueError(f"batch of {n} samples is not a multiple of minibatch_size {self.minibatch_size}")
        sums = torch.zeros(len(M.MINIBATCH_STATS) + 1, device=self.device)
        self.model.train()
        if self.recurrent:
            steps = self._recurrent_epochs(obs, actions, old_logp, old_values, adv, returns, sums,
                                           batch[F.RNN_STATE], batch[F.EPISODE_START])
        else:
            epochs = self._fused_epochs if self.fused is not None else self._autograd_epochs
            steps = epochs(obs, actions, old_logp, old_values, adv, returns, sums)
        with torch.no_grad():
            ev = explained_variance(old_values.float(), returns.float())
            # After the epochs: this update trained with the statistics the actors acted with; the new ones ship
            # with the new weights (one policy version = weights + statistics). A no-op without normalised vectors.
            self.model.update_normalizers(obs)
            if self.stats_sync is not None:
                self.stats_sync(self.model)
        host = torch.cat([sums / steps, ev.reshape(1)]).cpu().numpy()  # the one host sync per update
        self.host_syncs += 1
        self.updates_done += 1
        out = {k: float(v) for k, v in zip(M.MINIBATCH_STATS + (M.GRAD_NORM,), host[:-1])}
        out[M.EXPLAINED_VARIANCE] = float(host[-1])
        out[M.LR] = lr
        out["minibatch_steps"] = steps
        out[M.UPDATE_EPOCHS_RUN] = self.epochs_run
        out[M.ENT_COEF], out[M.CLIP_COEF] = self.coefs.ent_coef, self.coefs.clip_coef
        if self.policy_names is not None:
            out.update(self._policy_metrics(obs))
        return out

    def _policy_metrics(self, obs) -> dict[str, float]:
        """Several policies: each one's loss statistics (means over the minibatches it had rows in), its share of
        this update's batch and its lr, as ``policy/<name>/<key>``."""
        ids = self.model.policy_ids(obs)
        out = {}
        for p, entry in enumerate(self.model.entries):
            prefix = M.policy_key(entry.name, "")
            out[prefix + M.POLICY_SAMPLES] = int((ids == p).sum())
            if entry.frozen:
                continue
            sums = self._policy_sums.get(entry.name) if self._policy_sums else None
            if sums is not None:
                host = (sums[:-1] / sums[-1].clamp(min=1)).cpu().numpy()
                out.update({prefix + k: float(v) for k, v in zip(M.MINIBATCH_STATS + (M.GRAD_NORM,), host)})
            group = next(g for g in self.optimizer.param_groups if g.get("policy") == entry.name)
            out[prefix + M.LR] = group["lr"]
        return out

    def _autograd_epochs(self, obs, actions, old_logp, old_values, adv, returns, sums: torch.Tensor) -> int:
        """The epochs through autograd: ``learner/ppo.py``'s loss, backward, all-reduce, clip, the optimizer."""
        n, steps = actions.shape[0], 0
        for _ in range(self.update_epochs):
            before, epoch_start = sums.clone(), steps
            perm = torch.randperm(n, generator=self.generator).to(self.device)
            for start in range(0, n, self.minibatch_size):
                idx = perm[start:start + self.minibatch_size]
                mb_obs = {k: v[idx] for k, v in obs.items()} if isinstance(obs, dict) else obs[idx]
                new_logp, entropy, new_values = self._forward(mb_obs, actions[idx])
                ids = self.model.policy_ids(mb_obs) if self.policy_names is not None else None
                # The loss adds each policy's statistics before its backward: kept to undo a failed compiled one.
                saved = ({k: v.clone() for k, v in (self._policy_sums or {}).items()}
                         if self.compiled and ids is not None else None)
                try:
                    self._gradient_step(new_logp, entropy, new_values, old_logp[idx], old_values[idx], adv[idx],
                                        returns[idx], sums, ids)
                except _CompiledBackwardFailed as failure:
                    # AOTAutograd compiles the backward at its first call, so its errors surface here, not in the
                    # forward. Nothing has been all-reduced or stepped yet: this minibatch again, eagerly.
                    self._compile_failed(" in the backward", failure.__cause__)
                    if saved is not None:
                        self._policy_sums = saved
                    new_logp, entropy, new_values = self._forward(mb_obs, actions[idx])
                    self._gradient_step(new_logp, entropy, new_values, old_logp[idx], old_values[idx], adv[idx],
                                        returns[idx], sums, ids)
                steps += 1
            self.epochs_run += 1
            if self.target_kl is not None and self._kl_passed(sums, before, steps - epoch_start):
                break
        return steps

    def _recurrent_epochs(self, obs, actions, old_logp, old_values, adv, returns, sums: torch.Tensor,
                          states: torch.Tensor, starts: torch.Tensor) -> int:
        """Truncated BPTT: the batch cut into sequences of L consecutive steps of one env (every step a real one:
        an episode that ends inside a sequence resets the state there, so nothing is padded), shuffled as whole
        sequences into minibatches of minibatch_size / L, each started from its stored behaviour state."""
        T, N = self.sequence_layout
        L = self.seq_len
        n = actions.shape[0]
        K = n // (T * N)  # fragments in the batch

        def sequences(x: torch.Tensor) -> torch.Tensor:
            """(K*T*N, ...) rows (fragment, step, env) -> (L, K * T/L * N, ...): step in sequence, sequence."""
            rest = tuple(x.shape[1:])
            x = x.reshape((K, T // L, L, N) + rest).movedim(2, 0)
            return x.reshape((L, K * (T // L) * N) + rest)

        seq_obs = {k: sequences(v) for k, v in obs.items()}
        seq = [sequences(t) for t in (actions, old_logp, old_values, adv, returns, starts)]
        state0 = sequences(states)[0]  # the stored state going into each sequence's first step
        count, per_minibatch, steps = seq[0].shape[1], self.minibatch_size // L, 0
        for _ in range(self.update_epochs):
            before, epoch_start = sums.clone(), steps
            perm = torch.randperm(count, generator=self.generator).to(self.device)
            for begin in range(0, count, per_minibatch):
                idx = perm[begin:begin + per_minibatch]
                mb_actions, mb_logp, mb_values, mb_adv, mb_returns, mb_starts = (t[:, idx] for t in seq)
                with torch.autocast(device_type=self.device.type, dtype=self.amp_dtype or torch.float32,
                                    enabled=self.amp_dtype is not None):
                    out = self.model.evaluate_sequences({k: v[:, idx] for k, v in seq_obs.items()}, mb_actions,
                                                        state0[idx], mb_starts)
                new_logp, entropy, new_values = (t.float() for t in out)
                # (L, B) -> (L * B,): the time-major order evaluate_sequences returns its outputs in.
                self._gradient_step(new_logp, entropy, new_values, mb_logp.reshape(-1), mb_values.reshape(-1),
                                    mb_adv.reshape(-1), mb_returns.reshape(-1), sums)
                steps += 1
            self.epochs_run += 1
            if self.target_kl is not None and self._kl_passed(sums, before, steps - epoch_start):
                break
        return steps

    def _gradient_step(self, new_logp, entropy, new_values, old_logp, old_values, adv, returns,
                       sums: torch.Tensor, ids: torch.Tensor | None = None) -> None:
        """The PPO loss on one minibatch, backward, all-reduce, global-norm clip, the optimizer step; adds the
        minibatch's statistics to ``sums``. ``ids``: each row's policy (several policies: each trains on its own
        rows as if alone, ``_policy_losses``)."""
        if ids is None:
            loss, stats = ppo_loss(new_logp, entropy, new_values, old_logp, old_values, adv, returns, self.coefs)
        else:
            loss, stats = self._policy_losses(ids, new_logp, entropy, new_values, old_logp, old_values, adv, returns)
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
        if ids is None:
            grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        else:
            norms = []
            for group in self.optimizer.param_groups:
                norm = nn.utils.clip_grad_norm_(group["params"], self.max_grad_norm)
                norms.append(norm)
                if not norm:
                    # No rank had a row of this policy in this minibatch (the gradients are all-reduced, so every
                    # rank sees the same zero norm): no step for it, as it would take none training alone (Adam
                    # would otherwise move its weights on momentum). One host read per policy and minibatch.
                    for p in group["params"]:
                        p.grad = None
                if group["policy"] in self._step_policies:
                    self._policy_sums[group["policy"]][-2] += norm.detach()
            grad_norm = torch.linalg.vector_norm(torch.stack(norms))
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
        sums += torch.stack([stats[k] for k in M.MINIBATCH_STATS] + [grad_norm.detach()])

    def _policy_losses(self, ids, new_logp, entropy, new_values, old_logp, old_values, adv, returns):
        """Several policies: the sum of each trained policy's PPO loss over its own rows of the minibatch (its own
        advantage normalisation and means), so its gradient is the one it would get training on those rows alone,
        and the rows of the others (and of frozen policies) reach none of its weights. Returns (loss, statistics
        averaged over the rows that trained); each policy's statistics go to ``self._policy_sums``."""
        if self._policy_sums is None:
            self._policy_sums = {}
        total, weighted, count = 0.0, None, 0
        self._step_policies = set()
        for p, entry in enumerate(self.model.entries):
            rows = (ids == p).nonzero().squeeze(1)
            n = rows.numel()
            if entry.frozen or n == 0:
                continue
            loss, stats = ppo_loss(new_logp[rows], entropy[rows], new_values[rows], old_logp[rows],
                                   old_values[rows], adv[rows], returns[rows], self.coefs)
            total = total + loss
            vec = torch.stack([stats[k] for k in M.MINIBATCH_STATS]).detach()
            sums = self._policy_sums.setdefault(entry.name, torch.zeros(len(M.MINIBATCH_STATS) + 2,
                                                                        device=self.device))
            sums[:len(M.MINIBATCH_STATS)] += vec
            sums[-1] += 1  # minibatches it trained in (the grad norm goes in sums[-2] after the backward)
            self._step_policies.add(entry.name)
            weighted = vec * n if weighted is None else weighted + vec * n
            count += n
        if weighted is None:  # (rare) only frozen policies' rows: a zero gradient, so every rank still steps
            zero = sum(p.sum() for g in self.optimizer.param_groups for p in g["params"]) * 0.0
            return zero, {k: zero.detach() for k in M.MINIBATCH_STATS}
        mean = weighted / count
        return total, {k: mean[i] for i, k in enumerate(M.MINIBATCH_STATS)}

    def _fused_epochs(self, obs, actions, old_logp, old_values, adv, returns, sums: torch.Tensor) -> int:
        """The epochs through the fused step; the same minibatches (same permutations) as the autograd loop."""
        with torch.no_grad():
            x = self.model.encode(obs)  # the (normalised) concatenated vectors: what the MLPs read
        n, steps = x.shape[0], 0
        step = self.fused.step
        if self.graphed is not None:  # the same signature, over static buffers (captured where the device can)
            self.graphed.begin_update(self.coefs, self.minibatch_size, self.update_epochs * (n // self.minibatch_size))
            step = self.graphed.step
        for _ in range(self.update_epochs):
            before, epoch_start = sums.clone(), steps
            perm = torch.randperm(n, generator=self.generator).to(self.device)
            # One gather per tensor per epoch; the minibatches are then contiguous slices of it.
            tensors = [t[perm] for t in (x, actions, old_logp, old_values, adv, returns)]
            for start in range(0, n, self.minibatch_size):
                mb = [t[start:start + self.minibatch_size] for t in tensors]
                sums += step(*mb, self.coefs, self.max_grad_norm, self.grad_sync)
                steps += 1
            self.epochs_run += 1
            if self.target_kl is not None and self._kl_passed(sums, before, steps - epoch_start):
                break
        if self.graphed is not None:  # a capture that failed during the update says so from now on
            self.update_path = f"fused ({self.graphed.note})"
        return steps

    def flat_params(self) -> np.ndarray:
        return torch.cat([p.detach().reshape(-1).cpu() for p in self.model.parameters()]).numpy()
