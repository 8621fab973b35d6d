"""The device path's defects that would only show on an Ascend host, each held on CPU through the same code: the
threads that bind the device, a failed graph capture or replay, a loss scaler's state across device types, the
profiler's options under ASCEND_RT_VISIBLE_DEVICES. (HCCL's timeouts: tests/test_distributed.py; the doctor's
Ascend checks: tests/test_doctor.py; the inference server's cold start: tests/test_inference.py.)"""

from __future__ import annotations

import inspect
import threading

import pytest
import torch

from learner import device as devices

# --------------------------------------------------------------------------- threads and devices


def _learner_actor():
    from cluster import config as config_mod
    from cluster.graph import learner_settings
    from learner.actor import LearnerActor
    from tests.conftest import ROOT, env_spec

    cfg = config_mod.load(str(ROOT / "configs" / "cartpole.yaml"), ["learner.device=cpu"])
    return LearnerActor(rank=0, world_size=1, device_kind="cpu", spec=env_spec("CartPole-v1", hidden_sizes=(8,)),
                        settings=learner_settings(cfg), seed=0, torch_threads=1), cfg


def _on_new_thread(fn, *args, **kwargs):
    """``fn`` run on a thread of its own, as Ray runs a method: (its result, whether that thread bound a device)."""
    out: dict = {}

    def run():
        out["result"] = fn(*args, **kwargs)
        out["bound"] = threading.get_ident() in devices.bound_threads()

    t = threading.Thread(target=run, name=f"call-{fn.__name__}")
    t.start()
    t.join(60)
    return out["result"], out["bound"]


def test_every_learner_method_that_touches_the_device_binds_its_thread_whatever_the_world_size():
    """Each public LearnerActor method outside HOST_ONLY_METHODS, called with one learner on a thread that never
    bound (as Ray's concurrency-group threads are), binds that thread: the bind is a real call on CPU too, recorded
    by the device layer. setup used to bind only with several learners, though it reads the weights to publish and
    builds the feed's pinned pool there; stop destroys the group's device resources on the control thread."""
    from learner.actor import HOST_ONLY_METHODS, LearnerActor
    from pipeline import runtime
    from pipeline.supply import SupplyBoard

    public = {n for n, _ in inspect.getmembers(LearnerActor, inspect.isfunction) if not n.startswith("_")}
    touching = public - HOST_ONLY_METHODS
    assert touching == {"setup", "train_iteration", "flat_params", "state", "state_between_updates", "load_state",
                        "stop"}, "a new LearnerActor method: bind the device in it, or name it in HOST_ONLY_METHODS"
    actor, cfg = _learner_actor()
    state, bound = _on_new_thread(actor.state)
    assert bound
    _, bound = _on_new_thread(actor.load_state, state)
    assert bound
    _, bound = _on_new_thread(actor.flat_params)
    assert bound
    board = runtime.create(SupplyBoard, {}, cfg.fragments_per_update, cfg.replay.max_policy_lag, 1, inprocess=True)
    try:
        _, bound = _on_new_thread(actor.setup, "127.0.0.1", 0, board, fragments_per_batch=cfg.fragments_per_update,
                                  prefetch_batches=1, stall_timeout_s=5.0)
        assert bound, "setup ran on a thread that never bound the device"
        _, bound = _on_new_thread(actor.state_between_updates)
        assert bound
        feed_threads = [name for name, *_ in devices.bound_threads().values() if name == "device-feed"]
        assert feed_threads, "the feed's thread copies batches to the device: it binds it"
    finally:
        _, bound = _on_new_thread(actor.stop)
        runtime.kill(board)
    assert bound, "stop ran on a thread that never bound the device"


# --------------------------------------------------------------------------- loss scaling across device types


def _trained_scaler_state() -> dict:
    """A CPU fp16 scaler's state after steps that overflowed once (its scale backed off) and grew its tracker."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    for x in (1.0, float("inf"), 1.0, 1.0):
        opt.zero_grad()
        scaler.scale((p * x).sum()).backward()
        scaler.step(opt)
        scaler.update()
    return scaler.state_dict()


def test_a_cpu_or_cuda_scaler_state_resumes_on_npu_and_back():
    """torch_npu's GradScaler.load_state_dict reads ``dynamic``, which torch's scaler never writes: a checkpoint from
    a CPU or CUDA run would stop an NPU resume with a KeyError. ``grad_scaler_state`` gives every device type the
    keys its scaler reads, with the scale and growth state unchanged; torch's scaler loads an NPU-written state."""
    state = _trained_scaler_state()
    assert "dynamic" not in state and state["scale"] == 2.0**9
    for_npu = devices.grad_scaler_state("npu", state)
    assert for_npu["dynamic"] is True
    assert {k: v for k, v in for_npu.items() if k != "dynamic"} == state
    npu_written = {**state, "dynamic": True}
    for device_type in ("cpu", "cuda"):
        back = devices.grad_scaler_state(device_type, npu_written)
        assert back == state
        scaler = torch.amp.GradScaler("cpu")
        scaler.load_state_dict(back)
        assert scaler.state_dict() == state


# --------------------------------------------------------------------------- the profiler under ASCEND_RT_VISIBLE_DEVICES


def test_npu_traces_name_the_physical_device_and_analyse_outside_the_iteration(tmp_path):
    """Two learners of one host, each narrowed by Ray to one NPU (ASCEND_RT_VISIBLE_DEVICES=4 and =5, both index 0
    inside): their traces name NPUs 4 and 5, not 0 twice; under RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES
    (all visible, index = place) the same. The analysis never runs synchronously inside the learner's iteration."""
    from learner.profiling import npu_trace_options

    names = {npu_trace_options(r, 0, tmp_path, {"ASCEND_RT_VISIBLE_DEVICES": d})["worker_name"]
             for r, d in ((0, "4"), (1, "5"))}
    assert names == {"learner0_npu4", "learner1_npu5"}
    wide = {"ASCEND_RT_VISIBLE_DEVICES": "2,4,5,7"}
    assert npu_trace_options(1, 2, tmp_path, wide)["worker_name"] == "learner1_npu5"
    assert npu_trace_options(0, 3, tmp_path, {})["worker_name"] == "learner0_npu3"
    options = npu_trace_options(0, 0, tmp_path, {})
    assert options["async_mode"] is True and options["dir_name"] == str(tmp_path / "learner0")
