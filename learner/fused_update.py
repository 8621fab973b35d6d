"""The PPO minibatch step for state-only models, forward and backward written out: a fixed, small op count.

Why: on CartPole-size models an autograd step is per-op overhead, not arithmetic. The profile of one update
(1024 samples, 8 epochs x 2 minibatches of 512, 64x64 actor and critic) on this project's CPU was ~1.7 ms per
minibatch step, of which the matmuls were ~0.3 ms; the rest was ~250 kernel calls (forward, the loss's
elementwise ops, the autograd engine's backward nodes, gradient accumulation, ``clip_grad_norm_``'s per-tensor
norms) and ``torch.optim.Adam.step``'s Python. Accelerators pay per kernel launch too.

What this does instead, for ``ActorCritic`` with ``state_only`` (CleanRL's separate actor and critic MLPs):

* **One flat buffer** holds every parameter, and one more every gradient: the model's ``Parameter`` objects
  become views into them (so ``state_dict``, publishing, checkpoints and the rollouts see the same tensors).
  Clipping the global gradient norm is one norm and one multiply, and Adam is a handful of elementwise ops on one
  tensor. The data-parallel all-reduce (``grad_sync``) averages the model's ``.grad``, which are views of it.
* **Actor and critic run as one batched matmul chain.** Equal-width layers sit next to each other in the buffer,
  critic first, so a layer's two weights are one ``(2, out, in)`` tensor and one ``baddbmm`` runs both MLPs.
* **The backward is written out**: the PPO loss's gradient with respect to the value and the policy head (the
  clipped surrogate, the clipped value loss, the entropy bonus), then the two MLPs' backward as batched
  matmuls written straight into the gradient buffer.

Everything else is the autograd path's: the same loss definitions (``learner/ppo.py``, whose functions produce
the reported statistics here too), the same tie-breaking as autograd's ``max`` and ``clamp`` (a tie splits the
gradient in half; a clamp passes it on its closed interval), the same Adam and clipping formulas. The tests
compare whole updates against the autograd path to 1e-5 (``tests/test_fused_update.py``).

Not covered, so the learner keeps autograd for them: encoded models (images, text, point clouds, audio), bf16 /
fp16 (autocast and the gradient scaler), ``learner.compile``, and an MLP with no hidden layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from learner import ppo
from learner.model import tanh_


def supports(model: nn.Module, precision: str, compile: bool) -> str | None:
    """Why the fused step cannot train ``model`` (None: it can)."""
    if getattr(model, "names", None) is not None:
        return "several policies (multiagent.policies)"
    if getattr(model, "recurrent", False):
        return f"learner.rnn is {model.spec.rnn} (the fused step is for memoryless MLPs)"
    if not getattr(model, "state_only", False):
        return "the model has encoders (image/text/point cloud/audio)"
    if model.spec.action_kind == "composite":
        return "the action space is composite (several parts)"
    if model.spec.action_mask is not None:
        return "the actions are masked"
    if not model.spec.hidden_sizes:
        return "learner.hidden_sizes is empty"
    if precision != "fp32":
        return f"learner.precision is {precision}"
    if compile:
        return "learner.compile is on"
    return None


class FlatAdam:
    """Adam over one flat parameter tensor, with torch.optim.Adam's update and its ``state_dict`` format.

    The update is ``torch.optim.Adam``'s (no weight decay, no amsgrad): exp_avg lerps toward the gradient,
    exp_avg_sq by ``addcmul``, bias corrections from the step count, ``p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2)
    + eps)``. The state dict lists per-parameter ``step`` / ``exp_avg`` / ``exp_avg_sq`` in ``model.parameters()``
    order, as torch's does, so a checkpoint from either path loads into the other.
    """

    def __init__(self, flat: torch.Tensor, views: list[tuple[int, int, torch.Size]], *, lr: float,
                 betas: tuple[float, float], eps: float):
        self.flat = flat
        self.views = views  # per parameter in model.parameters() order: (offset, numel, shape)
        self.exp_avg = torch.zeros_like(flat)
        self.exp_avg_sq = torch.zeros_like(flat)
        self.steps = 0
        # The learner sets ``param_groups[0]["lr"]`` before each update, as it does for torch.optim.Adam.
        self.param_groups = [{"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": 0, "amsgrad": False,
                              "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
                              "fused": None, "params": list(range(len(views)))}]

    @torch.no_grad()
    def step(self, grad: torch.Tensor) -> None:
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        self.steps += 1
        self.exp_avg.lerp_(grad, 1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** self.steps
        bias_correction2_sqrt = math.sqrt(1 - beta2 ** self.steps)
        denom = (self.exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(group["eps"])
        self.flat.addcdiv_(self.exp_avg, denom, value=-group["lr"] / bias_correction1)

    def state_dict(self) -> dict:
        state = {}
        if self.steps:
            for i, (off, n, shape) in enumerate(self.views):
                state[i] = {"step": torch.tensor(float(self.steps)),
                            "exp_avg": self.exp_avg[off:off + n].view(shape).clone(),
                            "exp_avg_sq": self.exp_avg_sq[off:off + n].view(shape).clone()}
        groups = [dict(g) for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        state = state_dict["state"]
        if len(state_dict["param_groups"]) != 1 or len(state_dict["param_groups"][0]["params"]) != len(self.views):
            raise ValueError("optimizer state does not match this model's parameters")
        for key in ("lr", "betas", "eps"):
            self.param_groups[0][key] = state_dict["param_groups"][0][key]
        self.param_groups[0]["betas"] = tuple(self.param_groups[0]["betas"])
        steps = {int(float(s["step"])) for s in state.values()}
        if len(steps) > 1:
            raise ValueError(f"optimizer state has different step counts per parameter ({sorted(steps)}); "
                             "the flat optimizer needs one")
        self.steps = steps.pop() if steps else 0
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        for i, s in state.items():
            off, n, shape = self.views[int(i)]
            self.exp_avg[off:off + n].copy_(s["exp_avg"].reshape(-1))
            self.exp_avg_sq[off:off + n].copy_(s["exp_avg_sq"].reshape(-1))


class FusedMLPStep:
    """One PPO minibatch step (forward, loss gradient, backward, clip, Adam) for a state-only ``ActorCritic``."""

    def __init__(self, model: nn.Module, *, lr: float, adam_eps: float, betas: tuple[float, float] = (0.9, 0.999)):
        reason = supports(model, "fp32", False)
        if reason:
            raise ValueError(f"the fused update cannot train this model: {reason}")
        self.model = model
        self.discrete = model.spec.action_kind == "discrete"
        critic = [m for m in model.critic if isinstance(m, nn.Linear)]
        actor = [m for m in model.actor if isinstance(m, nn.Linear)]
        self.depth = len(critic) - 1  # hidden layers; the last Linear of each is its head
        # Buffer layout: per hidden layer [critic W, actor W, critic b, actor b] (adjacent, so each pair is one
        # (2, out, in) and one (2, out) view), then critic head W, b, actor head W, b, then the log std.
        order: list[nn.Parameter] = []
        for c, a in zip(critic[:-1], actor[:-1]):
            order += [c.weight, a.weight, c.bias, a.bias]
        order += [critic[-1].weight, critic[-1].bias, actor[-1].weight, actor[-1].bias]
        if not self.discrete:
            order.append(model.actor_logstd)
        params = list(model.parameters())
        if {id(p) for p in order} != {id(p) for p in params} or len(order) != len(params):
            raise ValueError("the fused update found parameters outside the actor and critic MLPs")
        device, dtype = params[0].device, params[0].dtype
        total = sum(p.numel() for p in order)
        self.flat = torch.empty(total, device=device, dtype=dtype)
        self.grad = torch.zeros(total, device=device, dtype=dtype)
        offsets: dict[int, tuple[int, int, torch.Size]] = {}
        off = 0
        with torch.no_grad():
            for p in order:
                n = p.numel()
                self.flat[off:off + n].copy_(p.reshape(-1))
                offsets[id(p)] = (off, n, p.shape)
                off += n
            for p in order:  # the model's parameters now live in the buffer (same Parameter objects)
                o, n, shape = offsets[id(p)]
                p.data = self.flat[o:o + n].view(shape)
                p.grad = self.grad[o:o + n].view(shape)

        def pair(p_critic: nn.Parameter, both_shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
            o, n, _ = offsets[id(p_critic)]
            size = math.prod(both_shape)
            return self.flat[o:o + size].view(both_shape), self.grad[o:o + size].view(both_shape)

        # Hidden layers as (2, out, in) weights and (2, 1, out) biases over both MLPs, with their gradient views.
        self.w, self.dw, self.b, self.db = [], [], [], []
        for c in critic[:-1]:
            w, dw = pair(c.weight, (2, *c.weight.shape))
            b, db = pair(c.bias, (2, 1, c.bias.shape[0]))
            self.w.append(w), self.dw.append(dw), self.b.append(b), self.db.append(db)

        def own(p):
            o, n, shape = offsets[id(p)]
            return self.flat[o:o + n].view(shape), self.grad[o:o + n].view(shape)

        (self.wv, self.dwv), (self.bv, self.dbv) = own(critic[-1].weight), own(critic[-1].bias)
        (self.wp, self.dwp), (self.bp, self.dbp) = own(actor[-1].weight), own(actor[-1].bias)
        self.logstd, self.dlogstd = own(model.actor_logstd) if not self.discrete else (None, None)
        self.optimizer = FlatAdam(self.flat, [offsets[id(p)] for p in params], lr=lr, betas=betas, eps=adam_eps)
        self._bufs: dict[int, dict] = {}

    # ------------------------------------------------------------------ forward
    def _buffers(self, n: int) -> dict:
        """Activation and gradient buffers for minibatches of ``n``, made once and written with ``out=``: a fresh
        (2, n, h) tensor per op, and the memory traffic of more of them, took a CartPole step from 0.67 to 0.84 ms."""
        bufs = self._bufs.get(n)
        if bufs is None:
            widths = [w.shape[1] for w in self.w]
            new = [torch.empty(2, n, h, device=self.flat.device, dtype=self.flat.dtype) for h in widths]
            # Layer k's incoming gradient goes to buffer (width, k % 2): consecutive layers never share one, and
            # equal-width layers reuse two. The backward also overwrites each activation in place once done with it.
            # Fewer buffers: the update's working set stays in the core's L2 cache (2 MB here).
            grad = {}
            for k, t in enumerate(new):
                grad.setdefault((t.shape[-1], k % 2), torch.empty_like(t))
            bufs = {"hidden": new, "grad": [grad[(t.shape[-1], k % 2)] for k, t in enumerate(new)]}
            self._bufs[n] = bufs
        return bufs

    def _forward(self, x: torch.Tensor, hidden: list[torch.Tensor]):
        """Fill ``hidden`` with each layer's activations ((2, B, h): critic, actor); V(x) (B,) and the policy head
        output (B, A)."""
        h_in = x.unsqueeze(0).expand(2, *x.shape)
        for w, b, out in zip(self.w, self.b, hidden):
            h_in = tanh_(torch.baddbmm(b, h_in, w.transpose(1, 2), out=out))
        value = torch.addmm(self.bv, h_in[0], self.wv.t()).squeeze(-1)
        head = torch.addmm(self.bp, h_in[1], self.wp.t())
        return value, head

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def step(self, x, actions, old_logp, old_values, advantages, returns, coefs: ppo.LossCoefs,
             max_grad_norm: float, grad_sync=None) -> torch.Tensor:
        """Train on one minibatch (``x``: the model's encoded input, (B, D)); returns the stats as one tensor in
        the autograd loop's order, ``pipeline.metric_keys.MINIBATCH_STATS`` then the grad norm (no host sync)."""
        n = x.shape[0]
        bufs = self._buffers(n)
        hidden = bufs["hidden"]
        value, head = self._forward(x, hidden)
        # --- the loss's terms (the same functions the autograd path differentiates)
        if self.discrete:
            logp_all = torch.log_softmax(head, dim=-1)
            probs = logp_all.exp()
            actions = actions.long().unsqueeze(-1)
            new_logp = logp_all.gather(-1, actions).squeeze(-1)
            entropy = -(probs * logp_all).sum(-1)
        else:
            logstd = self.logstd.expand_as(head)
            diff = actions - head
            inv_var = torch.exp(-2 * logstd)
            new_logp = ppo_gaussian_logp(diff, inv_var, logstd)
            entropy = (0.5 + 0.5 * math.log(2 * math.pi) + self.logstd).sum().expand(n)
        logratio = new_logp - old_logp
        ratio = logratio.exp()
        adv = ppo.normalize_advantages(advantages) if coefs.norm_adv else advantages
        clipped_ratio = torch.clamp(ratio, 1 - coefs.clip_coef, 1 + coefs.clip_coef)
        pg1, pg2 = -adv * ratio, -adv * clipped_ratio
        pg_loss = torch.max(pg1, pg2).mean()
        # d pg_loss / d logp: -A r / n where the unclipped term is the max, or the ratio is inside the clip range
        # (there the two terms are equal: autograd's max gives each half and the clamp passes its half on).
        inside = (ratio >= 1 - coefs.clip_coef) & (ratio <= 1 + coefs.clip_coef)
        g_logp = torch.where(inside | (pg1 > pg2), pg1, 0.0).mul_(1.0 / n)
        # Value loss and d/dV.
        err = value - returns
        if coefs.clip_vloss:
            delta = value - old_values
            v_clipped = old_values + torch.clamp(delta, -coefs.clip_coef, coefs.clip_coef)
            err_clipped = v_clipped - returns
            sq, sq_clipped = err.square(), err_clipped.square()
            v_loss = 0.5 * torch.max(sq, sq_clipped).mean()
            # max's tie-split weight for the unclipped term (1, 1/2 or 0); the clipped term's gradient passes the
            # clamp only inside [-eps, eps].
            w_unclipped = torch.sign(sq - sq_clipped).mul_(0.5).add_(0.5)
            v_inside = (delta >= -coefs.clip_coef) & (delta <= coefs.clip_coef)
            g_value = torch.addcmul(err_clipped * v_inside * (1 - w_unclipped), err, w_unclipped)
        else:
            v_loss = 0.5 * err.square().mean()
            g_value = err
        g_value.mul_(coefs.vf_coef / n)  # d(vf_coef * 0.5 * mean(e^2)) = vf_coef * e / n
        entropy_mean = entropy.mean()
        # --- the policy head's gradient
        if self.discrete:
            # d logp / d logits = onehot - p; d entropy / d logits = -p (log p + H); the bonus enters as -ent_coef.
            g_head = probs * (-g_logp).unsqueeze(-1)
            g_head.scatter_add_(-1, actions, g_logp.unsqueeze(-1))
            if coefs.ent_coef:
                g_head.addcmul_(probs, logp_all + entropy.unsqueeze(-1), value=coefs.ent_coef / n)
        else:
            # d logp / d mean = (a - mean) / var; d logp / d logstd = (a - mean)^2 / var - 1; d entropy / d logstd = 1.
            scaled = diff * inv_var
            g_head = scaled * g_logp.unsqueeze(-1)
            torch.sum(torch.addcmul(g_logp.unsqueeze(-1).neg(), scaled * diff, g_logp.unsqueeze(-1)), 0,
                      out=self.dlogstd)
            self.dlogstd.sub_(coefs.ent_coef)
        # --- backward through the heads and both MLPs, into the gradient buffer
        h = hidden[-1]
        torch.mm(g_value.unsqueeze(0), h[0], out=self.dwv)
        self.dbv.copy_(g_value.sum().reshape(1))
        torch.mm(g_head.t(), h[1], out=self.dwp)
        torch.sum(g_head, 0, out=self.dbp)
        g_h = bufs["grad"][-1]
        torch.outer(g_value, self.wv[0], out=g_h[0])
        torch.mm(g_head, self.wp, out=g_h[1])
        for k in range(self.depth - 1, -1, -1):
            h = hidden[k]  # not needed after this layer's own backward: overwritten with h^2
            g_z = g_h.addcmul_(g_h, h.square_(), value=-1.0)  # g (1 - tanh^2)
            h_in = hidden[k - 1] if k else x.unsqueeze(0).expand(2, *x.shape)
            torch.bmm(g_z.transpose(1, 2), h_in, out=self.dw[k])
            torch.sum(g_z, 1, keepdim=True, out=self.db[k])
            if k:
                g_h = torch.bmm(g_z, self.w[k], out=bufs["grad"][k - 1])
        if grad_sync is not None:  # the data-parallel average, over the model's .grad (views of this buffer)
            grad_sync(self.model)
        # --- global norm clip (clip_grad_norm_'s formula) and Adam
        grad_norm = torch.linalg.vector_norm(self.grad)
        self.grad.mul_(torch.clamp(max_grad_norm / (grad_norm + 1e-6), max=1.0))
        self.optimizer.step(self.grad)
        # ppo.approx_kl and ppo.clip_fraction, with the ratio's exp already taken.
        ratio_minus_one = ratio - 1
        approx_kl = (ratio_minus_one - logratio).mean()
        clip_fraction = (ratio_minus_one.abs() > coefs.clip_coef).float().mean()
        return torch.stack([pg_loss, v_loss, entropy_mean, approx_kl, clip_fraction, grad_norm])


def ppo_gaussian_logp(diff: torch.Tensor, inv_var: torch.Tensor, logstd: torch.Tensor) -> torch.Tensor:
    """``learner.model.gaussian_logp`` from (a - mean) and 1 / var, which the backward reuses."""
    return (-(diff * diff) * inv_var / 2 - logstd - 0.5 * math.log(2 * math.pi)).sum(-1)
