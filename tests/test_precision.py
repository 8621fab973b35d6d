"""Learner precision modes and the profiler, on CPU (autocast + GradScaler run here too)."""

import json

import numpy as np
import pytest
import torch

from learner.device import resolve
from learner.learner import Learner, LearnerSettings
from learner.model import ActorCritic
from tests.conftest import vector_spec
from learner.ppo import LossCoefs
from learner.profiling import WARMUP_ITERATIONS, IterationProfiler
from pipeline import fragment as F


def batch(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        F.obs_key("vector"): torch.randn(n, 4, generator=g),
        F.ACTIONS: torch.randint(0, 2, (n,), generator=g),
        F.LOGP: torch.full((n,), -0.69),
        F.VALUES: torch.randn(n, generator=g),
        F.ADVANTAGES: torch.randn(n, generator=g),
        F.RETURNS: torch.randn(n, generator=g),
    }


def make(precision, **kw):
    torch.manual_seed(0)
    kw = {"update_epochs": 2, "minibatch_size": 128, "max_grad_norm": 0.5, **kw}
    settings = LearnerSettings(lr=1e-3, adam_eps=1e-5, anneal_lr=False, total_updates=10, coefs=LossCoefs(),
                               precision=precision, **kw)
    return Learner(ActorCritic(vector_spec((4,))), settings, torch.device("cpu"))


# How far a reduced-precision run's gradient / parameter update may be from fp32 autograd's, relative to the
# latter's norm. Measured at about a quarter of these (bf16 keeps 8 mantissa bits, fp16 11); a wrong gradient (a
# scaled loss, a missing unscale, a skipped step) is off by order 1.
GRAD_TOLERANCE = {"bf16": 3e-2, "fp16": 3e-3}
UPDATE_TOLERANCE = {"bf16": 5e-2, "fp16": 1e-2}


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want.astype(np.float64)))


def grads(learner) -> np.ndarray:
    return torch.cat([p.grad.reshape(-1) for p in learner.model.parameters()]).numpy()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_gradient_matches_fp32(precision):
    """One optimizer step from the same weights (one epoch, one minibatch, no clipping), so ``.grad`` is what the
    optimizer was given, for fp16 after unscaling. Checked on the gradient itself: Adam divides each step by the
    gradient's own running magnitude, so a gradient off by a constant factor moves the weights almost as fp32's."""
    one_step = dict(update_epochs=1, minibatch_size=256, max_grad_norm=1e9)
    ref, low = make("fp32", fused_update=False, **one_step), make(precision, **one_step)
    ref.update(batch())
    low.update(batch())
    g_ref, g_low = grads(ref), grads(low)
    assert g_low.dtype == np.float32 and np.isfinite(g_low).all()
    assert relative_error(g_low, g_ref) < GRAD_TOLERANCE[precision]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_tracks_fp32(precision):
    """A whole update (2 epochs x 2 minibatches): the same losses, and the same parameter update, weight by weight,
    relative to its size (the weights themselves barely move in four steps at lr 1e-3: comparing those hides
    everything)."""
    start = make("fp32").flat_params()
    ref, low = make("fp32", fused_update=False), make(precision)
    s_ref, s_low = ref.update(batch()), low.update(batch())
    for k in ("policy_loss", "value_loss", "entropy"):
        assert np.isfinite(s_low[k])
        assert s_low[k] == pytest.approx(s_ref[k], rel=0.05, abs=0.02), k
    p_ref, p_low = ref.flat_params(), low.flat_params()
    assert p_low.dtype == np.float32  # the weights stay fp32
    assert relative_error(p_low - start, p_ref - start) < UPDATE_TOLERANCE[precision]


def test_autocast_really_runs_in_bf16():
    learner = make("bf16")
    seen = []
    handle = learner.model.actor[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    learner.update(batch())
    handle.remove()
    assert seen and all(d == torch.bfloat16 for d in seen)


def test_fp16_uses_a_grad_scaler_with_configured_settings():
    learner = make("fp16", fp16_init_scale=1024.0, fp16_growth_factor=4.0)
    assert learner.scaler is not None and learner.scaler.get_scale() == 1024.0
    assert learner.scaler.get_growth_factor() == 4.0
    learner.update(batch())
    assert np.isfinite(learner.flat_params()).all()
    assert make("fp32").scaler is None


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="learner.precision"):
        make("fp8")


def test_profiler_traces_n_iterations_after_warmup(tmp_path):
    prof = IterationProfiler(resolve("cpu"), iterations=2, out_dir=tmp_path, rank=0)
    learner = make("fp32")
    for _ in range(WARMUP_ITERATIONS + 3):
        prof.before()
        learner.update(batch())
        prof.after()
    assert prof.trace_path == str(tmp_path / "learner0.trace.json")
    trace = json.loads((tmp_path / "learner0.trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert any(n and "addmm" in n for n in names), "the trace does not contain the update's matmuls"


@pytest.mark.parametrize("fused", [True, False])
def test_host_syncs_count_grad_scaler_item_on_the_non_fused_path(fused):
    # Non-fused Adam (the NPU path, selected on CPU here): GradScaler.step reads found_inf with .item() before every
    # optimizer step, a device->host sync per minibatch. Fused Adam takes found_inf into its kernel: no sync.
    learner = make("fp16", fused_adam=fused)
    assert bool(learner.optimizer.defaults["fused"]) is fused
    assert getattr(learner.optimizer, "_step_supports_amp_scaling", False) is fused
    stats = learner.update(batch())
    assert stats["minibatch_steps"] == 4  # 2 epochs x 256 / 128
    assert learner.host_syncs == (1 if fused else 1 + stats["minibatch_steps"])
    learner.update(batch(seed=1))
    assert learner.host_syncs == (2 if fused else 2 * (1 + stats["minibatch_steps"]))


def test_host_syncs_stay_one_per_update_without_a_scaler():
    for precision in ("fp32", "bf16"):
        learner = make(precision, fused_adam=False)
        learner.update(batch())
        assert learner.host_syncs == 1, precision


def test_a_compiled_backward_that_fails_falls_back_to_eager():
    """torch.compile (AOTAutograd) compiles a graph's backward at its first call, so a compiler that fails there
    fails in ``loss.backward()``, after a forward that worked. Here a real compiler backend whose backward compiler
    raises: the learner goes eager, says why in compile_note, and trains that minibatch again, so the update is the
    eager one exactly (nothing stepped twice, nothing skipped)."""
    from torch._dynamo.backends.common import aot_autograd

    def no_backward(gm, example_inputs):
        raise RuntimeError("no backward kernels here")

    ref = make("fp32", fused_update=False)
    learner = make("fp32", compile=True)
    assert learner.compiled and learner.fused is None
    # The compiled evaluation with that backend instead of inductor (whose backward would compile).
    learner._evaluate = torch.compile(learner.model.evaluate, dynamic=False,
                                      backend=aot_autograd(fw_compiler=lambda gm, example_inputs: gm,
                                                           bw_compiler=no_backward))
    ref.update(batch())
    stats = learner.update(batch())
    assert not learner.compiled
    assert learner.compile_note.startswith("eager (torch.compile failed in the backward: "), learner.compile_note
    assert "no backward kernels here" in learner.compile_note
    assert stats["minibatch_steps"] == 4
    np.testing.assert_array_equal(learner.flat_params(), ref.flat_params())


def test_a_cpu_compile_checks_the_compiler_while_the_learner_waits_for_its_first_batch():
    """inductor checks which vector instruction sets it can build for (a child process per candidate, in every
    process) at a compile's first call: the learner starts that check on a thread of its own at construction, so the
    first update finds it done (learner.device.probe_cpu_compiler). The list is cleared first, so only the learner's
    thread can have filled it before any update."""
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    learner = make("fp32", compile=True)
    learner.compiler_probe.join(timeout=120)
    assert not learner.compiler_probe.is_alive()
    assert learner.updates_done == 0
    assert cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 1
    assert make("fp32").compiler_probe is None  # nothing to probe without learner.compile
