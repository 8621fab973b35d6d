"""One cgroup per sandboxed env child (``actors.sandbox``): the kernel's own count of the child's memory and
processes, whatever it forks.

Per-process limits (RLIMIT_AS, RLIMIT_NPROC) bound each process alone: four forks of 500 MiB each pass a 1 GiB
address-space limit, and pages in a memfd, in shared memory or on a tmpfs belong to no process's address space at
all. A memory cgroup charges every page any process in it faults (anonymous, memfd, tmpfs, shared memory) to the
cgroup, and its limit holds for the sum: past it the kernel's OOM killer takes a process of the cgroup. A pids
cgroup counts every process and thread in it. The child joins its cgroups (as root, before anything of the env
runs); everything it starts is born inside them and cannot leave (moving a process needs write access to the
cgroup files, which the child's uid does not have and its mount namespace holds read-only).

Both cgroup versions: v2 (one hierarchy with the ``memory`` and ``pids`` controllers, ``memory.max``,
``memory.swap.max``, ``pids.max``, ``cgroup.kill``) where the host mounts it at ``/sys/fs/cgroup`` with both
controllers; else v1 (``/sys/fs/cgroup/memory`` and ``/sys/fs/cgroup/pids``, ``memory.limit_in_bytes``,
``memory.memsw.limit_in_bytes`` where swap is accounted, ``pids.max``). Where neither can be written (not root, a
read-only ``/sys/fs/cgroup``), ``unavailable()`` says why in one line and the per-process limits are all there is.
"""

from __future__ import annotations

import os
import signal
import time

ROOT = "/sys/fs/cgroup"
#: The folder, in each hierarchy, that holds one cgroup per live child (named by the child's uid).
GROUP = "ascent-sandbox"
#: Processes a child's cgroup holds beside the env's own: the child as started (which waits on its pid
#: namespace's init) and that init. env.limits.processes counts the env's processes, so the cgroup allows these on top.
OWN_PROCESSES = 2

_STATE: dict = {}


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _version() -> tuple[str, str]:
    """("v2" | "v1", "") where the host lets this process make cgroups with memory and pids limits, else
    ("", why not)."""
    if "version" in _STATE:
        return _STATE["version"]
    found = ("", "")
    if os.geteuid() != 0:
        found = ("", "not root: cgroups cannot be made")
    else:
        try:
            controllers = open(f"{ROOT}/cgroup.controllers").read().split()
        except OSError:
            controllers = []
        if {"memory", "pids"} <= set(controllers):
            try:
                base = f"{ROOT}/{GROUP}"
                os.makedirs(base, exist_ok=True)
                for where in (ROOT, base):
                    enabled = open(f"{where}/cgroup.subtree_control").read().split()
                    if not {"memory", "pids"} <= set(enabled):
                        _write(f"{where}/cgroup.subtree_control", "+memory +pids")
                found = ("v2", "")
            except OSError as e:
                found = ("", f"cgroup v2 at {ROOT} refused a group with memory and pids ({e.strerror})")
        elif os.path.exists(f"{ROOT}/memory/memory.usage_in_bytes") and os.path.exists(f"{ROOT}/pids/cgroup.procs"):
            try:
                for ctrl in ("memory", "pids", "cpuacct"):
                    if ctrl != "cpuacct" or os.path.isdir(f"{ROOT}/cpuacct"):
                        os.makedirs(f"{ROOT}/{ctrl}/{GROUP}", exist_ok=True)
                found = ("v1", "")
            except OSError as e:
                found = ("", f"cgroup v1 at {ROOT} refused a group ({e.strerror})")
        else:
            found = ("", f"no cgroup hierarchy with the memory and pids controllers at {ROOT}")
    _STATE["version"] = found
    return found


def unavailable() -> str:
    """Why children get no cgroup on this host, or '' when they do."""
    return _version()[1]


class ChildCgroup:
    """The cgroups of one child: made with its limits before the child starts; ``procs`` are the files it writes
    its pid into; ``kill`` ends every process in them; ``remove`` deletes them once empty."""

    def __init__(self, name: str, memory_mb: int | None, processes: int | None):
        self.version = _version()[0]
        self.dirs: list[str] = []
        if not self.version:
            return
        memory = str(memory_mb * 2**20) if memory_mb else None
        pids = str(processes + OWN_PROCESSES) if processes else "max"
        if self.version == "v2":
            d = f"{ROOT}/{GROUP}/{name}"
            self._fresh(d)
            if memory:
                _write(f"{d}/memory.max", memory)
                if os.path.exists(f"{d}/memory.swap.max"):
                    _write(f"{d}/memory.swap.max", "0")
            _write(f"{d}/pids.max", pids)
            self.dirs = [d]
        else:
            mem, pid = f"{ROOT}/memory/{GROUP}/{name}", f"{ROOT}/pids/{GROUP}/{name}"
            cpu = f"{ROOT}/cpuacct/{GROUP}/{name}" if os.path.isdir(f"{ROOT}/cpuacct") else None
            for d in filter(None, (mem, pid, cpu)):
                self._fresh(d)
            if memory:
                _write(f"{mem}/memory.limit_in_bytes", memory)
                if os.path.exists(f"{mem}/memory.memsw.limit_in_bytes"):  # swap accounted: no escape into swap
                    _write(f"{mem}/memory.memsw.limit_in_bytes", memory)
            _write(f"{pid}/pids.max", pids)
            self.dirs = [d for d in (mem, pid, cpu) if d]

    def _fresh(self, d: str) -> None:
        """The directory, empty: a dead holder's leftovers (same uid, same name) are killed and it is made anew."""
        if os.path.isdir(d):
            self._kill_in(d)
            self._rmdir(d)
        os.makedirs(d, exist_ok=True)

    @property
    def procs(self) -> list[str]:
        return [f"{d}/cgroup.procs" for d in self.dirs]

    @staticmethod
    def _pids(d: str) -> list[int]:
        try:
            return [int(p) for p in open(f"{d}/cgroup.procs").read().split()]
        except (OSError, ValueError):
            return []

    def _kill_in(self, d: str, budget_s: float = 5.0) -> None:
        if os.path.exists(f"{d}/cgroup.kill"):
            try:
                _write(f"{d}/cgroup.kill", "1")
            except OSError:
                pass
        deadline = time.monotonic() + budget_s
        while (pids := self._pids(d)) and time.monotonic() < deadline:
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)

    def kill(self) -> None:
        for d in self.dirs:
            self._kill_in(d)

    @staticmethod
    def _rmdir(d: str, budget_s: float = 2.0) -> None:
        deadline = time.monotonic() + budget_s
        while True:
            try:
                os.rmdir(d)
                return
            except FileNotFoundError:
                return
            except OSError:  # EBUSY while the last killed process is being reaped
                if time.monotonic() > deadline:
                    return
                time.sleep(0.005)

    def remove(self) -> None:
        self.kill()
        for d in self.dirs:
            self._rmdir(d)
        self.dirs = []

    def _counter(self, filename: str, key: str) -> int:
        for d in self.dirs:
            try:
                for line in open(f"{d}/{filename}"):
                    name, _, value = line.partition(" ")
                    if name == key:
                        return int(value)
            except (OSError, ValueError):
                pass
        return 0

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer took in this cgroup (over its memory limit)."""
        return self._counter("memory.events" if self.version == "v2" else "memory.oom_control", "oom_kill")

    def pids_refused(self) -> int:
        """Forks the pids limit refused."""
        return self._counter("pids.events", "max")

    def cpu_seconds(self) -> float | None:
        """CPU time of every process that was ever in the cgroup, as the kernel counts it; None without one."""
        for d in self.dirs:
            try:
                if self.version == "v2":
                    return self._counter("cpu.stat", "usage_usec") / 1e6
                if d.startswith(f"{ROOT}/cpuacct/"):
                    return int(open(f"{d}/cpuacct.usage").read()) / 1e9
            except (OSError, ValueError):
                pass
        return None

    def memory_bytes(self) -> int:
        name = "memory.current" if self.version == "v2" else "memory.usage_in_bytes"
        for d in self.dirs[:1]:
            try:
                return int(open(f"{d}/{name}").read())
            except (OSError, ValueError):
                pass
        return 0
