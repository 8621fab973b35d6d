"""The device layer: the one module that knows npu / cuda / cpu.

Everything device-specific is derived here from a single decision, so no other
module says "cuda" or "npu". ``torch_npu`` is imported lazily and only here:
importing it without the CANN libraries fails, and it must never be a hard
dependency of the CPU path.

The device table itself (kinds, Ray resources, backends) needs no torch, and
neither does importing this module: ``torch`` is imported inside the functions
that use it, so the config schema (its ``learner.device`` choices) and
placement (Ray resources to device kinds) read the table here without
``cluster.train --dry-run`` paying for ``import torch``.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    import torch

KINDS = ("auto", "cpu", "cuda", "npu")


@dataclass(frozen=True)
class DeviceSpec:
    kind: str  # "npu" | "cuda" | "cpu"
    #: Ray resource that pins an actor to one such device (None for CPU).
    ray_resource: str | None
    #: torch.distributed backend for gradient all-reduce.
    backend: str
    #: torch.optim.Adam(fused=True) exists for this device type (CPU, CUDA); others take the default implementation.
    fused_adam: bool

    def torch_device(self, local_index: int = 0) -> torch.device:
        import torch

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
            import_torch_npu()
        import torch

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


# In detection order: NPU first, then CUDA, then CPU.
_SPECS = {
    "npu": DeviceSpec("npu", "NPU", "hccl", fused_adam=False),
    "cuda": DeviceSpec("cuda", "GPU", "nccl", fused_adam=True),
    "cpu": DeviceSpec("cpu", None, "gloo", fused_adam=True),
}

#: Ray resources that make a node an accelerator host.
ACCELERATOR_RESOURCES = tuple(s.ray_resource for s in _SPECS.values() if s.ray_resource is not None)


def import_torch_npu():
    """``torch_npu``, imported here and nowhere else (it fails to import without the CANN libraries)."""
    return importlib.import_module("torch_npu")


def npu_available() -> bool:
    try:
        import_torch_npu()
    except Exception:  # ImportError, or CANN libraries missing at load time
        return False
    import torch

    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def detect() -> str:
    """NPU first, then CUDA, then CPU."""
    import torch

    if npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def resolve(requested: str = "auto") -> DeviceSpec:
    """One answer for the whole process; an explicit request overrides detection."""
    if requested not in KINDS:
        raise ValueError(f"device: {requested!r} is not one of {', '.join(KINDS)}")
    import torch

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


def kind_for_resources(resources: Mapping[str, float]) -> str:
    """The device kind a set of Ray resources offers (at least one of the kind's resource), in detection order:
    NPU, then GPU, then CPU. Reads the table only: no torch, no hardware probe."""
    for spec in _SPECS.values():
        if spec.ray_resource is not None and resources.get(spec.ray_resource, 0) >= 1:
            return spec.kind
    return "cpu"


def supports_fused_adam(device_type: str) -> bool:
    """Whether torch.optim.Adam(fused=True) runs on this torch device type (``torch.device.type``)."""
    spec = _SPECS.get(device_type)
    return spec is not None and spec.fused_adam
