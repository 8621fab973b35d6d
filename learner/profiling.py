"""``--profile N``: a torch profiler trace of N learner iterations.

Starts after a few warm-up iterations (the first ones include allocation and
autotuning that would dominate the trace). CPU and CUDA use torch.profiler and
write a Chrome trace; on Ascend, torch_npu's profiler (the only one that sees
NPU kernels) writes its TensorBoard-plugin trace directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from learner import device as devices

WARMUP_ITERATIONS = 3


def physical_device_id(visible_env: str | None, index: int, environ) -> str:
    """The id the host knows this process's device by (``npu-smi``'s, the kernel's /dev/davinciN): the ``index``-th
    of the visible devices, or ``index`` itself where the variable is unset. Under Ray's narrowing every learner sees
    its device as index 0, so the index alone names the same device for all of them."""
    visible = [d.strip() for d in environ.get(visible_env or "", "").split(",") if d.strip()]
    return visible[index] if index < len(visible) else str(index)


def npu_trace_options(rank: int, index: int, out_dir: str | Path, environ) -> dict:
    """``torch_npu.profiler.tensorboard_trace_handler``'s arguments (Ascend/pytorch, torch_npu/profiler/profiler.py:
    dir_name, worker_name, analyse_flag, async_mode). The worker's name carries the rank and the physical device, so
    the traces of the learners of one host (all of them device 0 under ASCEND_RT_VISIBLE_DEVICES) are told apart;
    the analysis runs in a process of its own (async_mode), because a synchronous one runs inside the learner's
    iteration for tens of seconds and more, past the driver's deadline for that iteration."""
    device = physical_device_id("ASCEND_RT_VISIBLE_DEVICES", index, environ)
    return {"dir_name": str(Path(out_dir) / f"learner{rank}"), "worker_name": f"learner{rank}_npu{device}",
            "analyse_flag": True, "async_mode": True}


class IterationProfiler:
    def __init__(self, device, iterations: int, out_dir: str | Path, rank: int):
        self.device = device
        self.iterations = iterations
        self.out_dir = Path(out_dir)
        self.rank = rank
        self._prof = None
        self._seen = 0
        self.trace_path: str | None = None

    def before(self) -> None:
        if self.iterations <= 0 or self._prof is not None or self._seen != WARMUP_ITERATIONS:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.device.kind == "npu":
            torch_npu = devices.import_torch_npu()  # the NPU profiler lives in torch_npu

            self.device.bind_thread()  # the profiler attaches to the calling thread's current device
            options = npu_trace_options(self.rank, self.device.index, self.out_dir, os.environ)
            self._prof = torch_npu.profiler.profile(
                activities=[torch_npu.profiler.ProfilerActivity.CPU, torch_npu.profiler.ProfilerActivity.NPU],
                on_trace_ready=torch_npu.profiler.tensorboard_trace_handler(**options),
            )
        else:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.kind == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
        self._prof.__enter__()

    def after(self) -> None:
        self._seen += 1
        if self._prof is None or self._seen < WARMUP_ITERATIONS + self.iterations:
            return
        prof, self._prof = self._prof, None
        self.iterations = 0
        prof.__exit__(None, None, None)
        if self.device.kind == "npu":
            self.trace_path = str(self.out_dir / f"learner{self.rank}")
        else:
            path = self.out_dir / f"learner{self.rank}.trace.json"
            prof.export_chrome_trace(str(path))
            self.trace_path = str(path)
