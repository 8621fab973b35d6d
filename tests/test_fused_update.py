"""The fused PPO step (learner/fused_update.py) against autograd: same gradients, same updates, same checkpoints.

The autograd path is the reference: ``learner/ppo.py``'s loss differentiated by torch, clipped by
``clip_grad_norm_``, stepped by ``torch.optim.Adam``. Every PPO detail the fused step writes out by hand (the clipped
surrogate and its tie-breaking, the clipped value loss, the entropy bonus, the policy-head derivatives, the tanh
backward, the global-norm clip, Adam's bias corrections) is compared here on batches built so that each branch is
taken: ratios inside and outside the clip range, value changes inside and outside the value clip.
"""

from __future__ import annotations

import copy
import logging
import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from learner import fused_update
from learner.learner import Learner, LearnerSettings
from learner.model import ActorCritic
from learner.ppo import LossCoefs, linear_lr, ppo_loss
from learner.spec import ModalityInput, PolicySpec
from pipeline import fragment as F
from tests.conftest import vector_spec


def _spec(kind="discrete", action_dim=3, hidden=(16, 16), normalize=False, obs_dim=5):
    mod = ModalityInput("vector", "vector", (obs_dim,), "float32", normalize=normalize)
    return PolicySpec((mod,), kind, action_dim, hidden_sizes=hidden)


def _batch(model: ActorCritic, n: int, seed: int, spread: float = 0.6) -> dict[str, torch.Tensor]:
    """Stored log-probs and values offset from the model's own, so ratios and value changes land on both sides
    of the clip range (spread 0.6 against clip 0.2)."""
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(n, model.spec.modalities[0].shape[0], generator=g) * 2 + 1
    if model.spec.action_kind == "discrete":
        actions = torch.randint(0, model.spec.action_dim, (n,), generator=g)
    else:
        actions = torch.randn(n, model.spec.action_dim, generator=g)
    with torch.no_grad():
        logp, _, values = model.evaluate({"vector": obs}, actions)
    adv = torch.randn(n, generator=g)
    return {"obs/vector": obs, F.ACTIONS: actions,
            F.LOGP: logp + spread * torch.randn(n, generator=g),
            F.VALUES: values + spread * torch.randn(n, generator=g),
            F.ADVANTAGES: adv, F.RETURNS: values + adv}


def _pair(spec, coefs, **kw):
    """Two learners on identical models, one per path."""
    args = dict(lr=3e-3, adam_eps=1e-5, anneal_lr=True, total_updates=6, update_epochs=3, minibatch_size=64,
                max_grad_norm=0.5, coefs=coefs, seed=7)
    args.update(kw)
    torch.manual_seed(0)
    model = ActorCritic(spec)
    ref = Learner(copy.deepcopy(model), LearnerSettings(fused_update=False, **args), torch.device("cpu"))
    fused = Learner(model, LearnerSettings(fused_update=True, **args), torch.device("cpu"))
    assert fused.update_path.startswith("fused") and ref.update_path.startswith("autograd")
    return ref, fused


CASES = [
    # (action kind, action dim, hidden sizes, LossCoefs, normalised observations)
    ("discrete", 2, (64, 64), LossCoefs(ent_coef=0.0), False),
    ("discrete", 3, (16, 16), LossCoefs(ent_coef=0.05), False),
    ("discrete", 4, (8,), LossCoefs(ent_coef=0.01, clip_vloss=False), True),
    ("discrete", 2, (8, 8, 8), LossCoefs(ent_coef=0.01, norm_adv=False, vf_coef=1.0), False),
    ("continuous", 1, (64, 64), LossCoefs(ent_coef=0.0), True),
    ("continuous", 3, (16, 16), LossCoefs(ent_coef=0.02, clip_coef=0.1), False),
    ("continuous", 2, (16,), LossCoefs(ent_coef=0.0, clip_vloss=False, norm_adv=False), True),
    # ppo.clip_around: update_start (the batches' stored log-probs and values are noisy: weights away from 1; the
    # clip range narrow enough that the steps inside the update reach it)
    ("discrete", 3, (16, 16), LossCoefs(ent_coef=0.05, clip_coef=0.01, clip_around="update_start"), True),
    ("continuous", 2, (16,), LossCoefs(ent_coef=0.0, clip_coef=0.01, clip_around="update_start"), False),
]


@pytest.mark.parametrize("kind,action_dim,hidden,coefs,normalize", CASES)
def test_whole_updates_match_autograd(kind, action_dim, hidden, coefs, normalize):
    """Four updates (12 minibatch steps each, Adam state and lr annealing carried over) give the same
    parameters, running statistics and reported statistics as the autograd path, to 1e-5."""
    spec = _spec(kind, action_dim, hidden, normalize)
    ref, fused = _pair(spec, coefs)
    for u in range(4):
        batch = _batch(ref.model, 256, seed=u)
        s_ref, s_fused = ref.update(batch), fused.update(batch)
        for key in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "grad_norm",
                    "explained_variance", "lr"):
            assert s_fused[key] == pytest.approx(s_ref[key], rel=1e-5, abs=1e-5), (u, key)
        assert s_fused["minibatch_steps"] == s_ref["minibatch_steps"] == 12
    # Both branches of the clips were exercised (otherwise the test would not cover them).
    assert 0.05 < s_ref["clip_fraction"] < 0.95
    np.testing.assert_allclose(fused.flat_params(), ref.flat_params(), rtol=0, atol=1e-5)
    for (k, a), (_, b) in zip(ref.model.state_dict().items(), fused.model.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5, msg=k)
    assert np.abs(fused.flat_params() - _initial_params(spec)).max() > 1e-2  # and training moved the weights


def _initial_params(spec):
    torch.manual_seed(0)
    return torch.cat([p.detach().reshape(-1) for p in ActorCritic(spec).parameters()]).numpy()


@pytest.mark.parametrize("kind", ["discrete", "continuous"])
def test_one_step_gradient_equals_autograd_gradient(kind):
    """The gradient buffer after one step (clip off: a huge max norm) against ``ppo_loss``'s autograd gradient,
    parameter by parameter."""
    coefs = LossCoefs(ent_coef=0.03)
    spec = _spec(kind, 3, (16, 16))
    torch.manual_seed(0)
    model = ActorCritic(spec)
    ref = copy.deepcopy(model)
    batch = _batch(ref, 128, seed=4)
    obs = {"vector": batch["obs/vector"]}
    logp, ent, v = ref.evaluate(obs, batch[F.ACTIONS])
    loss, _ = ppo_loss(logp, ent, v, batch[F.LOGP], batch[F.VALUES], batch[F.ADVANTAGES], batch[F.RETURNS], coefs)
    loss.backward()
    step = fused_update.FusedMLPStep(model, lr=0.0, adam_eps=1e-5)  # lr 0: the weights stay, the gradient stays
    stats = step.step(batch["obs/vector"], batch[F.ACTIONS], batch[F.LOGP], batch[F.VALUES], batch[F.ADVANTAGES],
                      batch[F.RETURNS], coefs, max_grad_norm=1e9)
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-6, msg=name)
    ref_norm = nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    assert stats[-1].item() == pytest.approx(ref_norm.item(), rel=1e-5)


def test_parameters_are_views_of_the_buffer():
    """What the rollouts and checkpoints read (the model's parameters / state_dict) is what the step trained, and
    loading a state dict writes into the buffer the step trains."""
    torch.manual_seed(0)
    model = ActorCritic(vector_spec((4,)))
    learner = Learner(model, LearnerSettings(lr=1e-2, adam_eps=1e-5, anneal_lr=False, total_updates=1,
                                             update_epochs=1, minibatch_size=32, max_grad_norm=0.5, coefs=LossCoefs()),
                      torch.device("cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    learner.update(_batch(model, 64, seed=1))
    after = model.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before)
    torch.testing.assert_close(torch.from_numpy(learner.flat_params()).sort().values,
                               learner.fused.flat.sort().values, rtol=0, atol=0)
    model.load_state_dict(before)
    np.testing.assert_array_equal(learner.fused.flat.sort().values.numpy(),
                                  torch.cat([v.reshape(-1) for v in before.values()]).sort().values.numpy())


@pytest.mark.parametrize("first,second", [("fused", "autograd"), ("autograd", "fused")])
def test_optimizer_state_moves_between_paths(first, second):
    """A checkpoint's optimizer state from one path continues identically on the other (FlatAdam writes and reads
    torch.optim.Adam's state_dict format)."""
    spec = _spec("discrete", 2, (16, 16))
    coefs = LossCoefs()
    runs = {}
    for label, switch in (("straight", False), ("switched", True)):
        torch.manual_seed(0)
        model = ActorCritic(spec)
        kw = dict(lr=3e-3, adam_eps=1e-5, anneal_lr=False, total_updates=4, update_epochs=2, minibatch_size=64,
                  max_grad_norm=0.5, coefs=coefs, seed=3)
        a = Learner(model, LearnerSettings(fused_update=first == "fused", **kw), torch.device("cpu"))
        for u in range(2):
            a.update(_batch(a.model, 128, seed=u))
        if switch:
            torch.manual_seed(1)
            b = Learner(ActorCritic(spec), LearnerSettings(fused_update=second == "fused", **kw), torch.device("cpu"))
            b.model.load_state_dict(a.model.state_dict())
            b.optimizer.load_state_dict(a.optimizer.state_dict())
            b.generator.set_state(a.generator.get_state())
            a = b
        for u in range(2, 4):
            a.update(_batch(a.model, 128, seed=u))
        runs[label] = a.flat_params()
    np.testing.assert_allclose(runs["switched"], runs["straight"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("kw,reason", [
    (dict(precision="bf16"), "learner.precision is bf16"),
    (dict(compile=True), "learner.compile is on"),
    (dict(fused_update=False), "learner.fused_update is off"),
])
def test_settings_the_fused_step_does_not_cover_use_autograd_and_say_why(kw, reason, caplog):
    """The step is chosen once, at construction; update_path names it and why, and the learner logs it there."""
    torch.manual_seed(0)
    args = dict(lr=1e-3, adam_eps=1e-5, anneal_lr=False, total_updates=1, update_epochs=1, minibatch_size=8,
                max_grad_norm=0.5, coefs=LossCoefs())
    with caplog.at_level("INFO", logger="learner.learner"):
        learner = Learner(ActorCritic(vector_spec((4,))), LearnerSettings(**{**args, **kw}), torch.device("cpu"))
    assert learner.fused is None
    assert learner.update_path == f"autograd ({reason})"
    assert f"learner: update path autograd ({reason})" in caplog.messages


def test_encoded_models_use_autograd():
    image = ModalityInput("camera", "image", (8, 8, 3), "uint8")
    spec = PolicySpec((image, ModalityInput("state", "vector", (3,), "float32")), "discrete", 2)
    reason = fused_update.supports(ActorCritic(spec), "fp32", False)
    assert reason == "the model has encoders (image/text/point cloud/audio)"
    with pytest.raises(ValueError, match="encoders"):
        fused_update.FusedMLPStep(ActorCritic(spec), lr=1e-3, adam_eps=1e-5)


# ---------------------------------------------------------------------------------------------- learner.graphs
def _graph_pair(spec, coefs, **kw):
    """Two learners on identical models: the static-buffer step (what learner.graphs: auto captures on an
    accelerator; here uncaptured) and off (the plain fused step)."""
    args = dict(lr=3e-3, adam_eps=1e-5, anneal_lr=True, total_updates=6, update_epochs=4, minibatch_size=64,
                max_grad_norm=0.5, coefs=coefs, seed=7, ent_coef_end=0.0, clip_coef_end=0.1)
    args.update(kw)
    torch.manual_seed(0)
    model = ActorCritic(spec)
    off = Learner(copy.deepcopy(model), LearnerSettings(graphs="off", **args), torch.device("cpu"))
    auto = Learner(model, LearnerSettings(graphs="static", **args), torch.device("cpu"))
    return off, auto


@pytest.mark.parametrize("kind,action_dim,hidden,coefs,normalize", CASES)
def test_static_buffer_step_matches_the_plain_fused_step(kind, action_dim, hidden, coefs, normalize):
    """Three whole updates (4 epochs x 4 minibatches each; lr, clip_coef and ent_coef annealed between them, Adam
    state carried over) through the static-buffer step give the plain fused step's weights, statistics and optimizer
    state to 1e-6: the step a graph captures, with the per-update coefficients and Adam's per-step factors read from
    device buffers instead of Python numbers."""
    off, auto = _graph_pair(_spec(kind, action_dim, hidden, normalize), coefs)
    assert auto.update_path == "fused (graphs: no capture on cpu)" and auto.graphed is not None
    for u in range(3):
        batch = _batch(off.model, 256, seed=u)
        s_off, s_auto = off.update(batch), auto.update(batch)
        assert s_auto["minibatch_steps"] == s_off["minibatch_steps"] == 16
        for key in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "grad_norm", "lr",
                    "clip_coef", "ent_coef"):
            assert s_auto[key] == pytest.approx(s_off[key], rel=1e-6, abs=1e-6), (u, key)
    np.testing.assert_allclose(auto.flat_params(), off.flat_params(), rtol=0, atol=1e-6)
    a, b = auto.optimizer.state_dict(), off.optimizer.state_dict()
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i]["step"] == b["state"][i]["step"] == 48
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(a["state"][i][k], b["state"][i][k], rtol=0, atol=1e-6)
    assert np.abs(auto.flat_params() - _initial_params(off.model.spec)).max() > 1e-2  # training moved the weights


def test_static_buffer_step_around_a_gradient_all_reduce_and_an_early_stop():
    """With a ``grad_sync`` (several learners: the step is two graphs around the all-reduce) and ppo.target_kl
    stopping updates after fewer epochs than planned, the static-buffer step still follows the plain one."""
    calls = {"off": 0, "auto": 0}

    def halving(label):
        def sync(model):  # as the mean with a rank whose gradient is zero: the learner must use what it leaves
            calls[label] += 1
            for p in model.parameters():
                p.grad.mul_(0.5)
        return sync

    spec = _spec("discrete", 3, (16, 16))
    torch.manual_seed(0)
    model = ActorCritic(spec)
    args = dict(lr=3e-3, adam_eps=1e-5, anneal_lr=True, total_updates=6, update_epochs=4, minibatch_size=64,
                max_grad_norm=0.5, coefs=LossCoefs(ent_coef=0.01), seed=7, target_kl=0.02)
    off = Learner(copy.deepcopy(model), LearnerSettings(graphs="off", **args), torch.device("cpu"),
                  grad_sync=halving("off"))
    auto = Learner(model, LearnerSettings(graphs="static", **args), torch.device("cpu"), grad_sync=halving("auto"))
    epochs = []
    for u in range(3):
        batch = _batch(off.model, 256, seed=u)
        s_off, s_auto = off.update(batch), auto.update(batch)
        assert s_auto["update_epochs_run"] == s_off["update_epochs_run"]
        epochs.append(s_off["update_epochs_run"])
    assert min(epochs) < 4, epochs  # target_kl cut at least one update short of its planned steps
    assert calls["auto"] == calls["off"] == sum(4 * e for e in epochs)
    np.testing.assert_allclose(auto.flat_params(), off.flat_params(), rtol=0, atol=1e-6)


def test_graphs_off_is_the_plain_fused_step():
    """learner.graphs: off trains through ``FusedMLPStep.step`` itself: bitwise the loop written out here."""
    spec = _spec("continuous", 2, (16, 16), normalize=True)
    coefs = LossCoefs(ent_coef=0.01)
    off, _ = _graph_pair(spec, coefs)
    assert off.graphed is None and off.update_path == "fused"
    torch.manual_seed(0)
    model = ActorCritic(spec)
    step = fused_update.FusedMLPStep(model, lr=3e-3, adam_eps=1e-5)
    generator = torch.Generator().manual_seed(7)
    for u in range(2):
        batch = _batch(off.model, 256, seed=u)
        off.update(batch)
        obs = {"vector": batch["obs/vector"]}
        step.optimizer.param_groups[0]["lr"] = 3e-3 * (linear_lr(3e-3, u, 6) / 3e-3)  # as Learner.update sets it
        step_coefs = _annealed(coefs, u, 6, ent_end=0.0, clip_end=0.1)
        x = model.encode(obs)
        tensors = (x, batch[F.ACTIONS], batch[F.LOGP], batch[F.VALUES], batch[F.ADVANTAGES], batch[F.RETURNS])
        for _ in range(4):
            perm = torch.randperm(256, generator=generator)
            shuffled = [t[perm] for t in tensors]
            for start in range(0, 256, 64):
                step.step(*[t[start:start + 64] for t in shuffled], step_coefs, 0.5)
        model.update_normalizers(obs)
    np.testing.assert_array_equal(off.flat_params(),
                                  torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy())


def _annealed(coefs: LossCoefs, done: int, total: int, *, ent_end: float, clip_end: float) -> LossCoefs:
    frac = done / total
    return dataclasses.replace(coefs, ent_coef=coefs.ent_coef + (ent_end - coefs.ent_coef) * frac,
                               clip_coef=coefs.clip_coef + (clip_end - coefs.clip_coef) * frac)


def test_graphs_setting_is_checked_and_matches_the_config():
    from cluster.config import LearnerConfig

    choices = {f.name: f for f in dataclasses.fields(LearnerConfig)}["graphs"].metadata
    assert tuple(choices["choices"]) == fused_update.GRAPH_MODES
    with pytest.raises(ValueError, match="learner.graphs: 'on' is not one of auto, off"):
        Learner(ActorCritic(vector_spec((4,))), LearnerSettings(lr=1e-3, adam_eps=1e-5, anneal_lr=False,
                                                                total_updates=1, update_epochs=1, minibatch_size=8,
                                                                max_grad_norm=0.5, coefs=LossCoefs(), graphs="on"),
                torch.device("cpu"))
    # The autograd path has no graphs, and says only why it is autograd.
    autograd = Learner(ActorCritic(vector_spec((4,))), LearnerSettings(lr=1e-3, adam_eps=1e-5, anneal_lr=False,
                                                                       total_updates=1, update_epochs=1,
                                                                       minibatch_size=8, max_grad_norm=0.5,
                                                                       coefs=LossCoefs(), precision="bf16"),
                       torch.device("cpu"))
    assert autograd.graphed is None and autograd.update_path == "autograd (learner.precision is bf16)"
    # Where nothing can be captured (CPU), auto is the plain fused step: static buffers would only add copies.
    plain = Learner(ActorCritic(vector_spec((4,))), LearnerSettings(lr=1e-3, adam_eps=1e-5, anneal_lr=False,
                                                                    total_updates=1, update_epochs=1,
                                                                    minibatch_size=8, max_grad_norm=0.5,
                                                                    coefs=LossCoefs()), torch.device("cpu"))
    assert plain.graphed is None and plain.update_path == "fused (graphs: no capture on cpu)"


def test_device_layer_says_where_there_is_no_capture():
    """CPU has nothing to capture; on NPU the graph class is torch_npu's, imported through the device layer, so
    without torch_npu (this machine) the reason names the failed import rather than raising."""
    from learner import device as devices

    assert devices.spec_for("cpu").graph_unavailable() == "no capture on cpu"
    npu = devices.spec_for("npu").graph_unavailable()
    assert npu.startswith("no graph capture on npu: ModuleNotFoundError") and "torch_npu" in npu


def test_what_changes_between_updates_is_read_from_device_buffers():
    """A captured graph keeps every Python number it saw when captured. So the static-buffer step, run twice from
    the same state and the same device buffers but with different Python-side values of what changes between
    updates (clip_coef and ent_coef, the lr, Adam's step count), must do exactly the same: everything that changes
    reaches it through ``begin_update``'s buffer."""
    torch.manual_seed(0)
    spec = _spec("discrete", 3, (16, 16))
    learner = Learner(ActorCritic(spec), LearnerSettings(lr=3e-3, adam_eps=1e-5, anneal_lr=False, total_updates=4,
                                                         update_epochs=2, minibatch_size=64, max_grad_norm=0.5,
                                                         coefs=LossCoefs(ent_coef=0.01), graphs="static"),
                      torch.device("cpu"))
    learner.update(_batch(learner.model, 128, seed=0))  # Adam's moments and step count away from their start
    graph, fused, opt = learner.graphed, learner.fused, learner.optimizer
    batch = _batch(learner.model, 64, seed=1)
    mb = (batch["obs/vector"], batch[F.ACTIONS], batch[F.LOGP], batch[F.VALUES], batch[F.ADVANTAGES],
          batch[F.RETURNS])
    graph.begin_update(LossCoefs(ent_coef=0.01), 64, steps=1)
    state = [t.clone() for t in (fused.flat, opt.exp_avg, opt.exp_avg_sq)]
    steps = opt.steps
    first = graph.step(*mb, LossCoefs(ent_coef=0.01), 0.5).clone()
    after_first = fused.flat.clone()
    for t, saved in zip((fused.flat, opt.exp_avg, opt.exp_avg_sq), state):
        t.copy_(saved)
    graph._index.zero_()
    graph._taken = 0
    opt.steps = steps + 100
    opt.param_groups[0]["lr"] = 1.0
    second = graph.step(*mb, LossCoefs(ent_coef=0.3, clip_coef=0.05), 0.5)
    assert torch.equal(second, first)
    assert torch.equal(fused.flat, after_first)
    assert not torch.equal(after_first, state[0])  # (the step did move the weights)


def test_the_static_step_reads_nothing_back_to_the_host():
    """Nothing inside the step may wait for the device: every op of a static-buffer step, recorded at torch's
    dispatch, and none of them is a read of a value back into Python (``.item()``, ``bool()``, ``float()`` of a
    tensor are ``aten._local_scalar_dense``), which a captured graph could not hold and an eager step would stall
    on."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    for kind in ("discrete", "continuous"):
        learner = Learner(ActorCritic(_spec(kind, 2, (16, 16))), LearnerSettings(lr=3e-3, adam_eps=1e-5,
                                                                                 anneal_lr=False, total_updates=4,
                                                                                 update_epochs=1, minibatch_size=64,
                                                                                 max_grad_norm=0.5,
                                                                                 coefs=LossCoefs(ent_coef=0.01),
                                                                                 graphs="static"),
                          torch.device("cpu"), grad_sync=lambda model: None)
        batch = _batch(learner.model, 64, seed=0)
        mb = (batch["obs/vector"], batch[F.ACTIONS], batch[F.LOGP], batch[F.VALUES], batch[F.ADVANTAGES],
              batch[F.RETURNS])
        learner.graphed.begin_update(LossCoefs(ent_coef=0.01), 64, steps=1)
        with Recorder() as recorder:
            learner.graphed.step(*mb, LossCoefs(ent_coef=0.01), 0.5, grad_sync=lambda model: None)
        assert len(recorder.ops) > 50, recorder.ops  # (it did record the step)
        assert not [op for op in recorder.ops if "_local_scalar_dense" in op], kind


def test_a_failed_capture_falls_back_to_the_eager_step_with_one_warning(caplog):
    """A capture that raises (here a real attempt on the CPU, which has no graphs; on Ascend, e.g. beginning a capture
    under TASK_QUEUE_ENABLE=2) leaves the plain fused step for the rest of the run: one warning line, the reason in
    the update path, and training goes on with the plain step's numbers."""
    kind, action_dim, hidden, coefs, normalize = CASES[0]
    off, auto = _graph_pair(_spec(kind, action_dim, hidden, normalize), coefs)
    torch.manual_seed(0)
    captured = Learner(copy.deepcopy(off.model), dataclasses.replace(off.settings, graphs="capture"),
                       torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="learner.fused_update"):
        for u in range(3):
            batch = _batch(off.model, 256, seed=u)
            s_off, s_cap = off.update(batch), captured.update(batch)
            assert s_cap["minibatch_steps"] == s_off["minibatch_steps"] == 16
            for key in ("policy_loss", "value_loss", "grad_norm", "approx_kl"):
                assert s_cap[key] == pytest.approx(s_off[key], rel=1e-6, abs=1e-6), (u, key)
    warnings = [r for r in caplog.records if r.name == "learner.fused_update" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "capture failed, eager" in warnings[0].getMessage(), warnings
    assert captured.update_path.startswith("fused (graphs: capture failed, eager: RuntimeError"), captured.update_path
    np.testing.assert_allclose(captured.flat_params(), off.flat_params(), rtol=0, atol=1e-6)
    assert captured.optimizer.state_dict()["state"][0]["step"] == 48  # every step counted once, across the switch
