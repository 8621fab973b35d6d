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

**Graphs** (``GraphStep``, ``learner.graphs: auto``): the same step over static buffers, captured once into a device
graph and replayed per minibatch, so an accelerator pays one launch per step instead of one per kernel; Adam's
state and its per-step factors stay on the device, and nothing in the step reads the device from the host. On
CPU it runs the static-buffer step without capture, which the tests compare with the plain step to 1e-6.

Not covered, so the learner keeps autograd for them: encoded models (images, text, point clouds, audio), bf16 /
fp16 (autocast and the gradient scaler), ``learner.compile``, and an MLP with no hidden layer.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from learner import device as devices
from learner import ppo

log = logging.getLogger(__name__)


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

    @torch.no_grad()
    def step_on_device(self, grad: torch.Tensor, neg_step_size: torch.Tensor,
                       bias_correction2_sqrt: torch.Tensor) -> None:
        """``step``'s update with its step-dependent factors as device scalars (``-lr / bias_correction1`` and
        ``sqrt(bias_correction2)``, computed on the host as ``step`` computes them), and no host counter: what a
        captured graph replays (``GraphStep``, which counts ``steps``)."""
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        self.exp_avg.lerp_(grad, 1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (self.exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(group["eps"])
        self.flat.addcdiv_(self.exp_avg * neg_step_size, denom)

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
            h_in = torch.baddbmm(b, h_in, w.transpose(1, 2), out=out).tanh_()  # torch.tanh, as model.mlp
        value = torch.addmm(self.bv, h_in[0], self.wv.t()).squeeze(-1)
        head = torch.addmm(self.bp, h_in[1], self.wp.t())
        return value, head

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def step(self, x, actions, old_logp, old_values, advantages, returns, coefs: ppo.LossCoefs,
             max_grad_norm: float, grad_sync=None, importance=None) -> torch.Tensor:
        """Train on one minibatch (``x``: the model's encoded input, (B, D)); returns the stats as one tensor in
        the autograd loop's order, ``pipeline.metric_keys.MINIBATCH_STATS`` then the grad norm (no host sync).
        ``importance``: each row's importance weight (``ppo.ppo_loss``'s), else None."""
        stats = self.gradients(x, actions, old_logp, old_values, advantages, returns, coefs,
                               LossScalars.of(coefs, x.shape[0]), importance)
        if grad_sync is not None:  # the data-parallel average, over the model's .grad (views of this buffer)
            grad_sync(self.model)
        grad_norm = self.clip_gradient(max_grad_norm)
        self.optimizer.step(self.grad)
        return torch.stack(stats + [grad_norm])

    def gradients(self, x, actions, old_logp, old_values, advantages, returns, coefs: ppo.LossCoefs,
                  s: "LossScalars", importance=None) -> list[torch.Tensor]:
        """Forward, the loss's gradient and both MLPs' backward into ``self.grad``; returns the minibatch's
        ``MINIBATCH_STATS``. ``coefs`` decides the loss's shape (advantage normalisation, value clipping, whether
        there is an entropy bonus; ``vf_coef``), ``s`` holds the coefficients that change between updates: Python
        numbers (eager) or device scalars that a captured graph reads at replay (``GraphStep``)."""
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
        adv = ppo.weighted_advantages(advantages, coefs.norm_adv, importance)
        clipped_ratio = torch.clamp(ratio, s.ratio_low, s.ratio_high)
        pg1, pg2 = -adv * ratio, -adv * clipped_ratio
        pg_loss = torch.max(pg1, pg2).mean()
        # d pg_loss / d logp: -A r / n where the unclipped term is the max, or the ratio is inside the clip range
        # (there the two terms are equal: autograd's max gives each half and the clamp passes its half on).
        inside = (ratio >= s.ratio_low) & (ratio <= s.ratio_high)
        g_logp = torch.where(inside | (pg1 > pg2), pg1, 0.0).mul_(1.0 / n)
        # Value loss and d/dV.
        err = value - returns
        if coefs.clip_vloss:
            delta = value - old_values
            v_clipped = old_values + torch.clamp(delta, s.neg_clip, s.clip)
            err_clipped = v_clipped - returns
            sq, sq_clipped = err.square(), err_clipped.square()
            v_loss = 0.5 * torch.max(sq, sq_clipped).mean()
            # max's tie-split weight for the unclipped term (1, 1/2 or 0); the clipped term's gradient passes the
            # clamp only inside [-eps, eps].
            w_unclipped = torch.sign(sq - sq_clipped).mul_(0.5).add_(0.5)
            v_inside = (delta >= s.neg_clip) & (delta <= s.clip)
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
                _add_scaled_product(g_head, probs, logp_all + entropy.unsqueeze(-1), s.ent_coef_per_sample)
        else:
            # d logp / d mean = (a - mean) / var; d logp / d logstd = (a - mean)^2 / var - 1; d entropy / d logstd = 1.
            scaled = diff * inv_var
            g_head = scaled * g_logp.unsqueeze(-1)
            torch.sum(torch.addcmul(g_logp.unsqueeze(-1).neg(), scaled * diff, g_logp.unsqueeze(-1)), 0,
                      out=self.dlogstd)
            self.dlogstd.sub_(s.ent_coef)
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
        # ppo.approx_kl and ppo.clip_fraction, with the ratio's exp already taken.
        ratio_minus_one = ratio - 1
        approx_kl = (ratio_minus_one - logratio).mean()
        clip_fraction = (ratio_minus_one.abs() > s.clip).float().mean()
        return [pg_loss, v_loss, entropy_mean, approx_kl, clip_fraction]

    def clip_gradient(self, max_grad_norm: float) -> torch.Tensor:
        """Scale the (already averaged) gradient to a global norm of at most ``max_grad_norm`` (clip_grad_norm_'s
        formula, no host read); returns the norm before clipping."""
        grad_norm = torch.linalg.vector_norm(self.grad)
        self.grad.mul_(torch.clamp(max_grad_norm / (grad_norm + 1e-6), max=1.0))
        return grad_norm


class LossScalars(NamedTuple):
    """The loss coefficients that change between updates (``ppo.clip_coef`` and ``ppo.ent_coef`` anneal), in the
    forms the step reads them. Eager: Python numbers computed as the loss writes them (``1 - clip_coef``, ...).
    ``GraphStep``: 0-d views of one device buffer, rewritten before each update, so a captured graph reads the
    current values at replay instead of the ones it was captured with."""
    ratio_low: float | torch.Tensor  # 1 - clip_coef
    ratio_high: float | torch.Tensor  # 1 + clip_coef
    clip: float | torch.Tensor  # clip_coef
    neg_clip: float | torch.Tensor  # -clip_coef
    ent_coef: float | torch.Tensor
    ent_coef_per_sample: float | torch.Tensor  # ent_coef / minibatch size

    @classmethod
    def of(cls, coefs: ppo.LossCoefs, n: int) -> "LossScalars":
        c = coefs.clip_coef
        return cls(1 - c, 1 + c, c, -c, coefs.ent_coef, coefs.ent_coef / n)


def _add_scaled_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale) -> torch.Tensor:
    """``out += scale * a * b``. ``addcmul_``'s ``value`` takes a Python number only: a device scalar scales ``b``
    (a temporary) first."""
    if isinstance(scale, torch.Tensor):
        return out.addcmul_(a, b.mul_(scale))
    return out.addcmul_(a, b, value=scale)


#: ``learner.graphs``: ``auto`` runs the step over static buffers and captures it where the device can (elsewhere
#: the plain fused step, which is faster uncaptured: the static buffers cost a copy per minibatch); ``off`` is the
#: plain fused step. ``static`` (not a config value): the static-buffer step even where nothing is captured, which
#: is how a CPU-only test holds it to the plain step's numbers.
GRAPH_MODES = ("auto", "off")
#: ``capture`` (not a config value either): try to capture whatever the device says it can do. On a device without
#: graphs (the CPU) the attempt raises for real, which is how a CPU-only test reaches the path a failed capture on an
#: accelerator takes (e.g. torch_npu under TASK_QUEUE_ENABLE=2, where beginning a capture can raise).
LEARNER_GRAPH_MODES = GRAPH_MODES + ("static", "capture")


@contextlib.contextmanager
def _capturing(graph):
    """Capture what the block launches into ``graph``; a block that raises still ends the capture, so the stream can
    be used again (that second error only echoes the first, which is the one raised)."""
    graph.capture_begin()
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            graph.capture_end()
        raise
    graph.capture_end()


@dataclass
class _Slot:
    """The static state of one minibatch shape: its input buffers, and once captured, its graphs and the outputs
    they write on every replay."""
    inputs: list[torch.Tensor]
    warmed: bool = False
    graphs: list | None = None
    partial: torch.Tensor | None = None  # the first graph's statistics, read by the second (several learners)
    out: torch.Tensor | None = None


class GraphStep:
    """``FusedMLPStep.step`` over static buffers, captured into a device graph where the device has one.

    A captured graph replays the kernels it recorded, on the memory it recorded them on, with every Python number
    baked in. So: the minibatch is copied (``copy_``) into input buffers that live as long as the graph; what
    changes between updates lives in one device buffer rewritten before each update (``begin_update``): the loss
    coefficients that anneal (``LossScalars``) and, per step of the update, Adam's ``-lr / bias_correction1`` and
    ``sqrt(bias_correction2)``, computed on the host in double as ``FlatAdam.step`` computes them and read in the
    graph through a step index on the device, which the graph advances. Adam's moments, the weights and the gradient
    are the fused step's own flat buffers: the whole optimizer step is in the graph, and nothing in it reads the
    device from the host. What else the graph bakes in (the minibatch's shape and dtypes, the loss's branches,
    vf_coef, max_grad_norm, Adam's betas and eps) is the key of a slot: a new key is a new capture.

    Per shape, the first step runs eagerly over the static buffers on the side stream the capture will use (the
    warm-up a capture needs, and a real step of training, not a throwaway); the second captures, which runs nothing,
    then replays; every later one copies and replays.
    With a ``grad_sync`` (several learners) the step is two graphs around the all-reduce, which stays outside: a
    collective inside a capture is backend-specific (gloo has none), and both graphs share one memory pool.

    On CPU there is nothing to capture: the same static-buffer step runs eagerly every time (the path the tests
    exercise). A capture that fails on an accelerator leaves the plain eager ``FusedMLPStep.step`` for the rest of
    the run, its reason in ``note`` (the learner's ``update_path``); the host-side step count (``FlatAdam.steps``)
    stays exact across that switch, so the switch changes no number.
    """

    def __init__(self, fused: FusedMLPStep, force_capture: bool = False):
        self.fused = fused
        device = fused.flat.device
        self.spec = devices.spec_for(device.type).on(device.index or 0)
        reason = None if force_capture else self.spec.graph_unavailable()
        self.capture = reason is None
        self.failed = False
        self.note = "graphs" if self.capture else f"graphs: {reason}"
        self._slots: dict[tuple, _Slot] = {}
        self._side = None
        self._buffer: torch.Tensor | None = None  # LossScalars, then the (steps, 2) Adam table
        self._loss: LossScalars | None = None
        self._adam: torch.Tensor | None = None
        self._index = torch.zeros((), dtype=torch.long, device=device)  # this update's step, advanced in the graph
        self._planned = self._taken = 0

    def begin_update(self, coefs: ppo.LossCoefs, minibatch: int, steps: int) -> None:
        """Before an update of at most ``steps`` minibatch steps of ``minibatch`` rows: write its coefficients and
        its steps' Adam factors (from the optimizer's lr and step count) to the device, in one copy."""
        opt = self.fused.optimizer
        group = opt.param_groups[0]
        beta1, beta2 = group["betas"]
        values = list(LossScalars.of(coefs, minibatch))
        for t in range(opt.steps + 1, opt.steps + steps + 1):
            values += [-group["lr"] / (1 - beta1 ** t), math.sqrt(1 - beta2 ** t)]
        flat = self.fused.flat
        host = torch.tensor(values, dtype=flat.dtype)
        if self._buffer is None or self._buffer.numel() < host.numel():
            # Captured graphs read the buffer they were captured with: a larger one means capturing again.
            self._buffer = torch.zeros(host.numel(), dtype=flat.dtype, device=flat.device)
            self._loss = LossScalars(*self._buffer[:len(LossScalars._fields)].unbind())
            self._adam = self._buffer[len(LossScalars._fields):].view(-1, 2)
            self._slots.clear()
        if self.spec.is_accelerator:
            # Pinned, so the copy is asynchronous (a pageable one waits for the stream); torch's pinned-memory cache
            # keeps the block until the copy has read it.
            self._buffer[:host.numel()].copy_(host.pin_memory(), non_blocking=True)
        else:
            self._buffer[:host.numel()].copy_(host)
        self._index.zero_()
        self._planned, self._taken = steps, 0

    @torch.no_grad()
    def step(self, x, actions, old_logp, old_values, advantages, returns, coefs: ppo.LossCoefs,
             max_grad_norm: float, grad_sync=None, importance=None) -> torch.Tensor:
        """``FusedMLPStep.step``'s signature and result; the result is the graph's output buffer, overwritten by the
        next step: add it to a sum (on the same stream) before then."""
        # (the importance weights, where there are, ride as a seventh input: a slot of their own shapes)
        minibatch = (x, actions, old_logp, old_values, advantages, returns) + (() if importance is None
                                                                                 else (importance,))
        if self.failed:
            return self.fused.step(*minibatch[:6], coefs, max_grad_norm, grad_sync, importance)
        if self._taken >= self._planned:
            raise RuntimeError(f"GraphStep: step {self._taken + 1} of an update that begin_update planned with "
                               f"{self._planned}")
        slot = self._slot(minibatch, coefs, max_grad_norm, grad_sync)
        for buf, t in zip(slot.inputs, minibatch):
            buf.copy_(t)
        if slot.graphs is None and self.capture and slot.warmed:
            self._capture(slot, coefs, max_grad_norm, grad_sync)
            if self.failed:
                return self.fused.step(*minibatch[:6], coefs, max_grad_norm, grad_sync, importance)
        if slot.graphs is not None:
            try:
                slot.graphs[0].replay()
            except Exception as e:  # noqa: BLE001 - nothing of this step was applied: all of it, eagerly
                self._fail("replay failed", e)
                return self.fused.step(*minibatch[:6], coefs, max_grad_norm, grad_sync, importance)
            if grad_sync is not None:
                grad_sync(self.fused.model)
                try:
                    slot.graphs[1].replay()
                except Exception as e:  # noqa: BLE001 - the gradient is all-reduced already: the rest, eagerly
                    self._fail("replay failed", e)
                    # (no second all-reduce: every rank makes exactly one per step, or the ranks fall out of step)
                    grad_norm = self.fused.clip_gradient(max_grad_norm)
                    self.fused.optimizer.step(self.fused.grad)
                    self._taken += 1
                    return torch.cat([slot.partial, grad_norm.reshape(1)])
            out = slot.out
        elif self.capture:
            out = self._warm_up(slot, coefs, max_grad_norm, grad_sync)
        else:
            out = self._run(slot, coefs, max_grad_norm, grad_sync)
        self._taken += 1
        self.fused.optimizer.steps += 1
        return out

    def _slot(self, minibatch, coefs: ppo.LossCoefs, max_grad_norm: float, grad_sync) -> _Slot:
        group = self.fused.optimizer.param_groups[0]
        key = (tuple((t.shape, t.dtype) for t in minibatch), coefs.norm_adv, coefs.clip_vloss, bool(coefs.ent_coef),
               coefs.vf_coef, float(max_grad_norm), tuple(group["betas"]), group["eps"], grad_sync is not None)
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot([torch.empty_like(t) for t in minibatch])
        return slot

    def _first_half(self, slot: _Slot, coefs: ppo.LossCoefs) -> torch.Tensor:
        """Forward, loss gradient, backward: the minibatch statistics, the gradient in ``fused.grad``."""
        importance = slot.inputs[6] if len(slot.inputs) > 6 else None
        return torch.stack(self.fused.gradients(*slot.inputs[:6], coefs, self._loss, importance))

    def _second_half(self, partial: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
        """Clip and the Adam step with this step's factors (the table's row at the device-side index)."""
        grad_norm = self.fused.clip_gradient(max_grad_norm)
        row = self._adam.index_select(0, self._index)[0]
        self._index.add_(1)
        self.fused.optimizer.step_on_device(self.fused.grad, row[0], row[1])
        return torch.cat([partial, grad_norm.reshape(1)])

    def _run(self, slot: _Slot, coefs, max_grad_norm, grad_sync) -> torch.Tensor:
        partial = self._first_half(slot, coefs)
        if grad_sync is not None:
            grad_sync(self.fused.model)
        return self._second_half(partial, max_grad_norm)

    def _side_stream(self):
        if self._side is None:
            self._side = self.spec.new_stream()
        return self._side

    def _warm_up(self, slot: _Slot, coefs, max_grad_norm, grad_sync) -> torch.Tensor:
        """The shape's first step, eagerly on the side stream the capture will use (libraries set up their
        per-stream state there, outside the capture), ordered after and before the current stream's work (a device
        without streams, under ``force_capture``: on the one order there is)."""
        current, side = self.spec.current_stream(), self._side_stream()
        if side is not None:
            side.wait_stream(current)
        with self.spec.stream_context(side):
            out = self._run(slot, coefs, max_grad_norm, grad_sync)
        if side is not None:
            current.wait_stream(side)
        slot.warmed = True
        return out

    def _fail(self, what: str, e: BaseException) -> None:
        """From now on the plain eager step, said once in one warning line and in ``note`` (the update path)."""
        self.failed, self.capture = True, False
        self.note = f"graphs: {what}, eager: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
        self._slots.clear()
        log.warning("learner.graphs: %s", self.note)

    def _capture(self, slot: _Slot, coefs, max_grad_norm, grad_sync) -> None:
        """Record the step (two graphs around ``grad_sync`` when there is one); nothing runs while recording. On
        failure: ``failed``, and the reason in ``note``."""
        spec = self.spec
        try:
            spec.synchronize()  # once per capture: the warm-up and this step's input copies are done
            graphs = [spec.new_graph()]
            with spec.stream_context(self._side_stream()):
                with _capturing(graphs[0]):
                    partial = self._first_half(slot, coefs)
                    out = None if grad_sync is not None else self._second_half(partial, max_grad_norm)
                if grad_sync is not None:
                    graphs.append(spec.new_graph(pool=graphs[0].pool()))
                    with _capturing(graphs[1]):
                        out = self._second_half(partial, max_grad_norm)
        except Exception as e:  # noqa: BLE001 - an op the backend cannot capture, a driver without graphs
            self._fail("capture failed", e)
            return
        slot.graphs, slot.partial, slot.out = graphs, partial, out


def ppo_gaussian_logp(diff: torch.Tensor, inv_var: torch.Tensor, logstd: torch.Tensor) -> torch.Tensor:
    """``learner.model.gaussian_logp`` from (a - mean) and 1 / var, which the backward reuses."""
    return (-(diff * diff) * inv_var / 2 - logstd - 0.5 * math.log(2 * math.pi)).sum(-1)
