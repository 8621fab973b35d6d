"""The device layer: the one module that knows npu / cuda / cpu.

Everything device-specific is derived here from a single decision, so no other
module says "cuda" or "npu". ``torch_npu`` is imported lazily and only here:
importing it without the CANN libraries fails, and it must never be a hard
dependency of the CPU path.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass

import torch

KINDS = ("auto", "cpu", "cuda", "npu")


@dataclass(frozen=True)
class DeviceSpec:
    kind: str  # "npu" | "cuda" | "cpu"
    #: Ray resource that pins an actor to one such device (None for CPU).
    ray_resource: str | None
    #: torch.distributed backend for gradient all-reduce.
    backend: str

    def torch_device(self, local_index: int = 0) -> torch.device:
        if self.kind == "cpu":
            return torch.device("cpu")
        return torch.device(self.kind, local_index)

    @property
    def is_accelerator(self) -> bool:
        return self.kind != "cpu"

    @property
    def module(self):
        """``torch.npu`` / ``torch.cuda`` (streams, events, synchronize); None on CPU."""
        if self.kind == "cpu":
            return None
        if self.kind == "npu":
            _import_torch_npu()
        return getattr(torch, self.kind)

    def new_stream(self):
        return self.module.Stream() if self.is_accelerator else None

    def stream_context(self, stream):
        if stream is None:
            return contextlib.nullcontext()
        return self.module.stream(stream)

    def free_memory_bytes(self) -> int:
        """Free memory of this process's device: the accelerator's, or the host's available RAM on CPU."""
        if self.is_accelerator:
            return int(self.module.mem_get_info()[0])
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("MemAvailable missing from /proc/meminfo")

    def synchronize(self) -> None:
        if self.is_accelerator:
            self.module.synchronize()


_SPECS = {
    "npu": DeviceSpec("npu", "NPU", "hccl"),
    "cuda": DeviceSpec("cuda", "GPU", "nccl"),
    "cpu": DeviceSpec("cpu", None, "gloo"),
}


def _import_torch_npu():
    return importlib.import_module("torch_npu")


def npu_available() -> bool:
    try:
        _import_torch_npu()
    except Exception:  # ImportError, or CANN libraries missing at load time
        return False
    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def detect() -> str:
    """NPU first, then CUDA, then CPU."""
    if npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def resolve(requested: str = "auto") -> DeviceSpec:
    """One answer for the whole process; an explicit request overrides detection."""
    if requested not in KINDS:
        raise ValueError(f"device: {requested!r} is not one of {', '.join(KINDS)}")
    kind = detect() if requested == "auto" else requested
    if kind == "npu" and not npu_available():
        raise RuntimeError("device 'npu' requested but torch_npu is not importable or sees no NPU")
    if kind == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but torch.cuda.is_available() is False")
    return _SPECS[kind]


def spec_for(kind: str) -> DeviceSpec:
    """The spec for a known kind without probing hardware (used by the driver,
    which may run on a CPU-only head node while learners sit on NPU hosts)."""
    return _SPECS[kind]


def visible_device_env(kind: str) -> str | None:
    """Ray narrows this variable per actor, so an actor's device is always index 0."""
    return {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}.get(kind)
