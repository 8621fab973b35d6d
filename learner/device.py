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
import dataclasses
import importlib
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

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
    #: The process's device among those it sees (``local_index``); ``on(index)`` gives the spec of another.
    index: int = 0
    #: Environment variable through which Ray narrows the devices a process sees (None for CPU).
    visible_env: str | None = None

    def on(self, index: int) -> "DeviceSpec":
        return dataclasses.replace(self, index=index)

    def torch_device(self, local_index: int | None = None) -> torch.device:
        import torch

        if self.kind == "cpu":
            return torch.device("cpu")
        return torch.device(self.kind, self.index if local_index is None else local_index)

    def bind_thread(self) -> None:
        """Make this process's device the current one of the calling thread. torch_npu (and CUDA) keep the current
        device per thread, and a new thread starts on device 0: every thread that allocates, copies or syncs (the
        feed's, Ray's concurrency-group threads) calls this first, whatever the world size. Nothing to set on CPU;
        every kind records the thread (``bound_threads``), which is how a CPU test sees which threads bound."""
        if self.is_accelerator:
            self.module.set_device(self.index)
        _BOUND[threading.get_ident()] = (threading.current_thread().name, self.kind, self.index)

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

    def current_stream(self):
        """The calling thread's current stream on this device; None on CPU."""
        return self.module.current_stream() if self.is_accelerator else None

    def graph_unavailable(self) -> str | None:
        """Why work cannot be captured into a device graph here (None: it can, with ``new_graph``)."""
        if not self.is_accelerator:
            return f"no capture on {self.kind}"
        try:
            _graph_class(self.kind)
        except Exception as e:  # noqa: BLE001 - an old torch_npu, a torch without graphs: said in words
            return f"no graph capture on {self.kind}: {type(e).__name__}: {e}"[:300]
        return None

    def new_graph(self, pool=None) -> "DeviceGraph":
        """An empty graph on this device (``pool``: another graph's ``pool()``, to share its memory)."""
        return DeviceGraph(self.kind, pool)

    def interval_clock(self) -> "IntervalClock":
        """A clock of the time this device spends between marks (``IntervalClock``): the host's clock on CPU, where
        the work between the marks runs in the call; timing events on the calling thread's stream elsewhere."""
        return IntervalClock(self.module if self.is_accelerator else None)


class IntervalClock:
    """The seconds a device spent inside marked intervals of an update (its collectives), summed since ``reset``.

    On CPU the work between ``start`` and ``stop`` runs inside the call (gloo's collectives return when done), so the
    host's clock is the measurement. On CUDA and NPU a call only enqueues its work: the host's clock would time the
    enqueue. There each mark records a timing event (``torch.cuda.Event`` / ``torch.npu.Event``, the same API) on the
    calling thread's current stream, and ``seconds`` reads the pairs once, after the caller's own host sync has let
    the stream pass them: no synchronize per interval, so the measured update is not slowed by measuring it. The
    events are made once and reused every update (an event's creation is a driver call)."""

    def __init__(self, module=None):
        self._module = module  # torch.cuda / torch.npu; None: the host's clock
        self._now = time.perf_counter
        self._pairs: list = []  # accelerator: (start, stop) events, reused; the first ``_used`` of them hold marks
        self._used = 0
        self._host_s = 0.0
        self._started: float | None = None
        self.intervals = 0  # marked intervals since reset: one per collective call

    def reset(self) -> None:
        self._used, self._host_s, self._started, self.intervals = 0, 0.0, None, 0

    def start(self) -> None:
        if self._module is None:
            self._started = self._now()
            return
        if self._used == len(self._pairs):
            self._pairs.append((self._module.Event(enable_timing=True), self._module.Event(enable_timing=True)))
        self._pairs[self._used][0].record()

    def stop(self) -> None:
        self.intervals += 1
        if self._module is None:
            if self._started is None:
                raise RuntimeError("IntervalClock.stop without a start")
            self._host_s += self._now() - self._started
            self._started = None
            return
        self._pairs[self._used][1].record()
        self._used += 1

    @contextlib.contextmanager
    def interval(self):
        """Marks the block as one interval (a collective call)."""
        self.start()
        try:
            yield
        finally:
            self.stop()

    def seconds(self) -> float:
        """The marked intervals' seconds since ``reset``. On an accelerator only after a host sync that follows the
        last mark (the update's read of its statistics): an event the stream has not passed yet is waited for here
        (``synchronize`` on it), which is that sync's cost paid once, never per interval."""
        if self._module is None:
            return self._host_s
        total_ms = 0.0
        for start, stop in self._pairs[:self._used]:
            stop.synchronize()
            total_ms += start.elapsed_time(stop)
        return total_ms / 1e3


#: thread id -> (thread name, kind, index) of every thread that called ``bind_thread`` in this process, last bind
#: kept. A dict write under the GIL: no lock, and nothing on the device path waits for it.
_BOUND: dict[int, tuple[str, str, int]] = {}


def bound_threads() -> dict[int, tuple[str, str, int]]:
    """Every thread of this process that bound a device (``DeviceSpec.bind_thread``): id -> (name, kind, index)."""
    return dict(_BOUND)


# In detection order: NPU first, then CUDA, then CPU.
_SPECS = {
    "npu": DeviceSpec("npu", "NPU", "hccl", fused_adam=False, visible_env="ASCEND_RT_VISIBLE_DEVICES"),
    "cuda": DeviceSpec("cuda", "GPU", "nccl", fused_adam=True, visible_env="CUDA_VISIBLE_DEVICES"),
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


def local_index(spec: DeviceSpec, assigned: Sequence[str], environ: Mapping[str, str]) -> int:
    """Which of the devices this process sees is the one Ray assigned it (``assigned``: its ids from
    ``ray.get_runtime_context().get_accelerator_ids()[spec.ray_resource]``).

    By default Ray narrows the visible devices (``ASCEND_RT_VISIBLE_DEVICES``, ``CUDA_VISIBLE_DEVICES``) to the
    assigned ones, and the process's device is index 0 of what it sees. With
    ``RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES=1`` (some Ascend RL stacks set it) or its CUDA twin, Ray leaves
    every device visible, and index 0 would put every learner of a node on the same device: the device is then the
    assigned id's place among the visible ones (its number when the variable is unset). Both cases are one rule."""
    if not spec.is_accelerator or not assigned:
        return 0
    visible = [d.strip() for d in environ.get(spec.visible_env or "", "").split(",") if d.strip()]
    first = str(assigned[0])
    if visible:
        if first not in visible:
            raise RuntimeError(f"Ray assigned {spec.ray_resource} {first}, which is not among the visible devices "
                               f"{spec.visible_env}={','.join(visible)}")
        return visible.index(first)
    return int(first)


def assigned_index(spec: DeviceSpec) -> int:
    """``local_index`` of the device Ray assigned this process; outside Ray (in process) or on CPU, 0."""
    import os

    assigned: Sequence[str] = ()
    if spec.is_accelerator:
        try:
            import ray

            if ray.is_initialized():
                assigned = ray.get_runtime_context().get_accelerator_ids().get(spec.ray_resource, ())
        except Exception:  # noqa: BLE001 - not in a Ray worker: the process's first visible device
            assigned = ()
    return local_index(spec, assigned, os.environ)


def for_this_process(spec: DeviceSpec) -> DeviceSpec:
    """``spec`` on the device Ray assigned this process, made the current device of the calling thread: done before
    the process group starts, which binds its communicator to the current device."""
    bound = spec.on(assigned_index(spec))
    bound.bind_thread()
    return bound


def for_inference(requested: str = "auto") -> DeviceSpec:
    """The device of a rollout node's inference server (rollout.inference: remote): ``requested``'s kind
    (learner.device; auto: what this process sees, NPU then CUDA) where this process has it, else the CPU. Ray gives
    the server no accelerator of its own, and with none assigned it leaves the node's devices visible: the server
    shares the node's first device with whatever else runs there, as SEED RL's inference shares the learner's."""
    kind = detect() if requested == "auto" else requested
    if kind == "npu" and not npu_available():
        kind = "cpu"
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            kind = "cpu"
    return for_this_process(_SPECS[kind])


#: Graph capture bars unsafe device calls in the capturing thread only: the feed's thread keeps copying the next
#: batch on its own stream while the update captures, and under "global" (the backends' default) those copies would
#: fail the capture or the feed.
GRAPH_CAPTURE_MODE = "thread_local"


def _graph_class(kind: str):
    """The graph class for a device kind: torch_npu's ``NPUGraph`` on NPU; on CUDA ``torch.accelerator.Graph``
    (torch 2.13), else ``torch.cuda.CUDAGraph``."""
    import torch

    if kind == "npu":
        return import_torch_npu().npu.NPUGraph
    if kind == "cuda":
        accelerator = getattr(torch, "accelerator", None)
        return getattr(accelerator, "Graph", None) or torch.cuda.CUDAGraph
    raise RuntimeError(f"no graph capture on {kind}")


class DeviceGraph:
    """One capturable graph, whichever backend class holds it. ``torch.accelerator.Graph`` takes its pool and capture
    mode when made; ``CUDAGraph`` and ``NPUGraph`` take them in ``capture_begin``: callers see one interface.
    Capture runs on the calling thread's current stream (a side stream: the default one cannot capture); ``replay``
    launches the whole graph on the current stream."""

    def __init__(self, kind: str, pool=None):
        import torch

        cls = _graph_class(kind)
        self._takes_mode_in_init = getattr(getattr(torch, "accelerator", None), "Graph", None) is cls
        self._pool = pool
        self.graph = cls(pool=pool, capture_error_mode=GRAPH_CAPTURE_MODE) if self._takes_mode_in_init else cls()

    def capture_begin(self) -> None:
        if self._takes_mode_in_init:
            self.graph.capture_begin()
        else:
            self.graph.capture_begin(pool=self._pool, capture_error_mode=GRAPH_CAPTURE_MODE)

    def capture_end(self) -> None:
        self.graph.capture_end()

    def replay(self) -> None:
        self.graph.replay()

    def pool(self):
        return self.graph.pool()


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


def grad_scaler(device_type: str, **kwargs):
    """The fp16 loss scaler for a torch device type: on NPU the one torch_npu documents
    (``torch_npu.npu.amp.GradScaler``), whose inf/nan check runs on the NPU's own float-status path; elsewhere
    ``torch.amp.GradScaler``."""
    if device_type == "npu":
        return import_torch_npu().npu.amp.GradScaler(**kwargs)
    import torch

    return torch.amp.GradScaler(device_type, **kwargs)


#: The one key torch_npu's ``GradScaler.load_state_dict`` reads beyond torch's (Ascend/pytorch,
#: torch_npu/npu/amp/grad_scaler.py: ``state_dict["dynamic"]``, no default); torch's own scaler writes it never and
#: ignores it when present.
NPU_SCALER_EXTRA_KEYS = {"dynamic": True}


def grad_scaler_state(device_type: str, state: dict) -> dict:
    """A loss scaler's ``state_dict``, written on any device type, as ``grad_scaler(device_type)`` loads it: a CPU or
    CUDA run's state resumed on NPU gets ``dynamic`` (torch's scaler is always dynamic, and so is the learner's NPU
    one); an NPU run's state resumed elsewhere drops it. The scale and growth state carry over unchanged."""
    out = {k: v for k, v in state.items() if k not in NPU_SCALER_EXTRA_KEYS}
    if device_type == "npu":
        out.update({k: state.get(k, default) for k, default in NPU_SCALER_EXTRA_KEYS.items()})
    return out


def supports_fused_adam(device_type: str) -> bool:
    """Whether torch.optim.Adam(fused=True) runs on this torch device type (``torch.device.type``)."""
    spec = _SPECS.get(device_type)
    return spec is not None and spec.fused_adam


def probe_cpu_compiler() -> threading.Thread:
    """Start, on a thread of its own, what a CPU compile's first call would otherwise wait for: inductor's check of
    which vector instruction sets (AMX, AVX-512, AVX2) it can build for, which compiles and loads a test library in a
    child process per candidate, every process, even with every kernel in the compile cache: about half of Pong's
    compile warm-up (docs/results.md). Started where ``learner.compile`` is on, it runs while the learner waits for
    its first batch: the waits are on child processes, which hold no GIL. Its result is cached per process
    by inductor itself; where this fails (a torch without that module), the first compile probes as before."""

    def probe() -> None:
        try:
            from torch._inductor import cpu_vec_isa

            cpu_vec_isa.pick_vec_isa()
        except Exception:  # noqa: BLE001 - the first compile probes again and reports what fails
            pass

    thread = threading.Thread(target=probe, name="cpu-compiler-probe", daemon=True)
    thread.start()
    return thread
