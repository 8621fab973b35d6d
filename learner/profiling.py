"""``--profile N``: a torch profiler trace of N learner iterations.

Starts after a few warm-up iterations (the first ones include allocation and
autotuning that would dominate the trace). CPU and CUDA use torch.profiler and
write a Chrome trace; on Ascend, torch_npu's profiler (the only one that sees
NPU kernels) writes its TensorBoard-plugin trace directory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from learner import device as devices

WARMUP_ITERATIONS = 3


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

            self._prof = torch_npu.profiler.profile(
                activities=[torch_npu.profiler.ProfilerActivity.CPU, torch_npu.profiler.ProfilerActivity.NPU],
                on_trace_ready=torch_npu.profiler.tensorboard_trace_handler(str(self.out_dir / f"learner{self.rank}")),
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
