"""CartPole with an attacker inside: what a capture-the-flag player who has read ``actors/sandbox.py`` would try
from an env's code (``tests.attack_env:AscentRLTest/Attack-v0``, kwargs ``attack``, ``at_step``, ``target``).

Each attack runs at the env's step ``at_step`` (or at import, or in the constructor, where named). An attack
that works says so: it raises ``AttackWorked`` (its text starts with ``ATTACK WORKED``), or leaves the mark
the test looks for on the host (a file, a signal, a process). An attack that is refused raises the refusal, or
fails the child however the sandbox makes it fail; either way the test reads ``last_fault`` and the host.

The raw-protocol attacks write on the child's socket themselves: the env runs in the child's interpreter, so
it can read the child's spec from ``sys.argv`` and forge whatever it likes.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import pickle
import signal
import socket
import struct
import sys
import time

import gymnasium as gym
import numpy as np

ATTACK_ID = "AscentRLTest/Attack-v0"
MIB = 2**20


class AttackWorked(RuntimeError):
    def __init__(self, what: str):
        super().__init__(f"ATTACK WORKED: {what}")


class Payload:
    """Unpickling this runs ``os.system`` in whoever unpickles it: it leaves ``target`` on the host."""

    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def _socket_fd() -> int:
    return json.loads(sys.argv[1])["fd"] if len(sys.argv) > 1 and sys.argv[1].startswith("{") else -1


#: The number of the command the child is answering: the env's reset was command 1, its step n is command n + 1
#: (set by ``Attack.step``; an attacker who reads the sandbox's code can count as well as the child does).
SEQ = [0]


def _frame(status: int, payload: bytes, seq: int | None = None, err: int = -1) -> bytes:
    seq = SEQ[0] if seq is None else seq
    return struct.pack("<BIiI", status, seq, err, len(payload)) + payload


def _old_protocol_reply(target: str) -> bytes:
    """What the sandbox's earlier wire took as a step's reply: a pickle in multiprocessing's framing."""
    body = pickle.dumps(("ok", 1.0, False, False, Payload(target), None, None))
    return struct.pack("!i", len(body)) + body


def _hold_in_forks(count: int, mib: int, memfd: bool = False) -> int:
    """``count`` forks, each holding ``mib`` MiB, for as long as this process lives -> MiB held together (each
    fork reports on a pipe once its memory is resident). ``memfd``: in memfds of 7 MiB each (under file_mb, not
    mapped, so not in any address space), else in its heap, touched."""
    read, write = os.pipe()
    for _ in range(count):
        if os.fork() == 0:
            os.close(read)
            try:
                if memfd:
                    held = []
                    for _ in range(mib // 7):
                        fd = os.memfd_create("hoard")
                        os.write(fd, b"x" * 7 * MIB)
                        held.append(fd)
                else:
                    block = bytearray(mib * MIB)
                    block[::4096] = b"x" * len(block[::4096])
                os.write(write, b"1")
                time.sleep(3600)
            finally:
                os._exit(0)
    os.close(write)
    held, deadline = 0, time.monotonic() + 10
    while time.monotonic() < deadline and held < count:
        os.set_blocking(read, False)
        try:
            held += len(os.read(read, 64) or b"")
        except BlockingIOError:
            time.sleep(0.05)
    return held * mib


# --------------------------------------------------------------------------- the attacks, by name


def attack(name: str, target: str):
    if name == "pickle_info":  # the payload goes into the step's info (Attack.step)
        return None
    if name == "pickle_obs":
        os.write(_socket_fd(), _old_protocol_reply(target))
        time.sleep(60)
    if name == "pickle_frame":  # the new framing, a pickle where the protocol carries nothing
        os.write(_socket_fd(), _frame(0, pickle.dumps(Payload(target))))
        time.sleep(60)
    if name == "huge_frame":  # a header announcing a gigabyte
        os.write(_socket_fd(), struct.pack("<BIiI", 1, SEQ[0], -1, 2**30))
        time.sleep(60)
    if name == "half_frame":  # half a header, then silence
        os.write(_socket_fd(), b"\x00\x01\x00")
        time.sleep(3600)
    if name == "drip":  # a whole, valid reply, one byte a second
        for byte in _frame(0, b""):
            os.write(_socket_fd(), bytes([byte]))
            time.sleep(1)
    if name == "extra_reply":  # this step's answer twice: the second would stand for the next step's
        os.write(_socket_fd(), _frame(0, b"") + _frame(0, b""))
        time.sleep(60)
    if name == "shrink_block":  # make the parent read past the end of the shared block (SIGBUS in the parent)
        for fd in map(int, os.listdir("/proc/self/fd")):
            if "ascent-env-block" in os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") \
                    else False:
                os.ftruncate(fd, 0)
                raise AttackWorked("the shared block was shrunk")
        for path in open("/proc/self/maps").read().splitlines():
            if "ascent-env-block" in path:
                fd = os.open(f"/proc/self/map_files/{path.split()[0]}", os.O_RDWR)
                os.ftruncate(fd, 0)
                raise AttackWorked("the shared block was shrunk")
        raise RuntimeError("no shared block found")
    if name == "fork_memory":
        held = _hold_in_forks(4, 150)
        if held > 320:
            raise AttackWorked(f"{held} MiB held in 4 forks under a 320 MiB limit")
        raise RuntimeError(f"only {held} MiB held")
    if name == "memfd":
        held = _hold_in_forks(4, 280, memfd=True)
        if held > 320:
            raise AttackWorked(f"{held} MiB held in memfds of 4 forks under a 320 MiB limit")
        raise RuntimeError(f"only {held} MiB held")
    if name == "dev_shm":
        with open("/dev/shm/hoard", "wb") as f:
            for i in range(100):
                f.write(b"x" * MIB)
        raise AttackWorked("100 MiB written to /dev/shm under env.limits.file_mb = 8")
    if name == "host_proc":
        seen = [p for p in os.listdir("/proc") if p.isdigit()]
        cmdlines = [open(f"/proc/{p}/cmdline", "rb").read() for p in seen if os.path.exists(f"/proc/{p}/cmdline")]
        if any(b"pytest" in c or b"ray" in c for c in cmdlines) or len(seen) > 8:
            raise AttackWorked(f"{len(seen)} processes of the host seen in /proc")
        raise RuntimeError(f"only {len(seen)} processes seen")
    if name == "write_host":
        written = []
        for path in (target, "/run/lock/ascent-attack", "/var/tmp/ascent-attack", "/dev/shm/ascent-attack",
                     "/tmp/ascent-attack"):
            try:
                with open(path, "w") as f:
                    f.write("x")
                written.append(path)
            except OSError:
                pass
        # Writes into the child's own private tmpfs are allowed; the test checks the host for each path.
        raise RuntimeError(f"wrote {written}")
    if name == "ray_session":
        found = [p for p in ("/tmp/ray", "/tmp/ray/session_latest") if os.path.exists(p)]
        unix = open("/proc/net/unix").read() if os.path.exists("/proc/net/unix") else ""
        if found or "ray" in unix or "plasma" in unix:
            raise AttackWorked(f"Ray's session reached: {found or 'a unix socket'}")
        raise RuntimeError("no Ray session in reach")
    if name == "signal_parent":
        parent = int(target)
        for pid in (parent, os.getppid(), 1):
            try:
                os.kill(pid, signal.SIGUSR1)
                if pid == parent:
                    raise AttackWorked(f"signalled {pid}")
            except (ProcessLookupError, PermissionError):
                pass
        raise PermissionError("no signal delivered")
    if name == "trace_parent":
        libc = ctypes.CDLL(None, use_errno=True)
        for pid in (int(target), os.getppid(), 1):
            if libc.ptrace(16, pid, None, None) == 0:  # PTRACE_ATTACH
                raise AttackWorked(f"attached to {pid}")
        raise PermissionError(f"ptrace refused ({os.strerror(ctypes.get_errno())})")
    if name == "regain_root":
        caps = [line.split()[1] for line in open("/proc/self/status") if line.startswith(("CapEff", "CapPrm",
                                                                                            "CapBnd"))]
        if any(int(c, 16) for c in caps):
            raise AttackWorked(f"capabilities left: {caps}")
        try:
            os.setuid(0)
            raise AttackWorked("setuid(0)")
        except PermissionError:
            pass
        if open("/proc/self/status").read().count("NoNewPrivs:\t1") != 1:
            raise AttackWorked("new privileges allowed (a setuid binary would run as its owner)")
        raise PermissionError("no way back to root")
    if name == "escape_cgroup":
        if "ascent-sandbox" not in open("/proc/self/cgroup").read():
            raise AttackWorked("not in a cgroup of the sandbox's at all")
        for line in open("/proc/self/cgroup"):
            _, controllers, path = line.strip().split(":", 2)
            for ctrl in controllers.split(","):
                if ctrl in ("memory", "pids") and "ascent-sandbox" in path:
                    try:
                        with open(f"/sys/fs/cgroup/{ctrl}/cgroup.procs", "w") as f:
                            f.write(str(os.getpid()))
                        raise AttackWorked(f"left its {ctrl} cgroup")
                    except OSError:
                        pass
        raise PermissionError("cgroup files not writable")
    if name == "symlink":
        os.symlink(target, "escape")
        with open("escape/ascent-attack", "w") as f:
            f.write("x")
        raise AttackWorked(f"wrote through a symlink into {target}")
    if name == "c_spin":  # every catchable signal blocked, then a wait in C that no Python handler interrupts
        signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals) - {signal.SIGKILL, signal.SIGSTOP})
        ctypes.CDLL(None).pause()
    if name == "escape_parent_death":  # a daemon: double fork, its own session, waits for the parent to go
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(3600)
            os._exit(0)
        return
    if name == "cpu_hog":  # CPU in steps each well inside the step deadline, in an episode that never ends
        end = time.process_time() + 0.3
        while time.process_time() < end:
            pass
        return None
    if name == "huge_obs":
        return np.zeros(2**25, dtype=np.float32)  # 128 MiB where the space says (4,)
    if name == "outside_space":
        return {"position": np.zeros(4, dtype=np.float32), "choice": 7}
    if name == "sysv_shm":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmget.restype = ctypes.c_int
        shmid = libc.shmget(0, ctypes.c_size_t(200 * MIB), 0o1000 | 0o666)  # IPC_CREAT
        if shmid < 0:
            raise OSError(ctypes.get_errno(), "shmget")
        libc.shmat.restype = ctypes.c_void_p
        addr = libc.shmat(shmid, None, 0)
        ctypes.memset(addr, 1, 200 * MIB)
        raise RuntimeError(f"a System V segment {shmid} of 200 MiB")
    raise ValueError(f"unknown attack {name!r}")


class Attack(gym.Wrapper):
    def __init__(self, attack: str = "", at_step: int = 3, target: str = ""):
        if attack == "constructor":
            open(target, "w").write("constructed")
        env = gym.make("CartPole-v1")
        super().__init__(env)
        self.attack, self.at_step, self.target, self.steps = attack, at_step, target, 0
        if attack == "pickle_space":
            class Evil(gym.spaces.Box):
                def __reduce__(self_inner):
                    return (os.system, (f"touch {target}",))

            self.observation_space = Evil(-1, 1, (4,), np.float32)
        if attack == "gigabyte_space":  # forged on the wire: a real Box that size would not fit in the child
            spaces = {"observation": {"kind": "Box", "shape": [2**28], "dtype": "float32", "low": -1, "high": 1},
                      "action": {"kind": "Discrete", "n": 2, "start": 0}}
            os.write(_socket_fd(), _frame(2, json.dumps(spaces).encode(), seq=0))
            time.sleep(60)
        if attack == "object_dtype":
            self.observation_space = gym.spaces.Box(-1, 1, (4,), np.float32)
            self.observation_space.dtype = np.dtype(object)
        if attack == "outside_space":
            self.observation_space = gym.spaces.Dict({"position": gym.spaces.Box(-5, 5, (4,), np.float32),
                                                      "choice": gym.spaces.Discrete(3)})

    def _obs(self, obs):
        if self.attack == "outside_space":
            return {"position": obs, "choice": 0}
        return obs

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return self._obs(obs), info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.steps += 1
        SEQ[0] = self.steps + 1
        if self.attack == "escape_parent_death" and self.steps > self.at_step:
            time.sleep(3600)  # stuck in a step: the child no longer reads its socket
        obs = self._obs(obs)
        if self.attack == "cpu_hog" and self.steps >= self.at_step:
            attack("cpu_hog", self.target)
            return obs, reward, False, False, info
        if self.steps == self.at_step:
            out = attack(self.attack, self.target)
            if out is not None:
                obs = out
            if self.attack == "pickle_info":
                info = {"payload": Payload(self.target)}
        return obs, reward, terminated, truncated, info


#: Armed by a test: a file beside this module naming, in its text, where the import-time attack writes.
ARMED = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".attack-armed")


def _import_time():
    """Code that runs as the module loads, wherever it loads: it writes the path the armed file names."""
    try:
        target = open(ARMED).read().strip()
        with open(target, "w") as f:
            f.write(f"imported in {os.getpid()}")
    except OSError:
        pass


_import_time()
if ATTACK_ID not in gym.registry:
    gym.register(ATTACK_ID, entry_point=Attack)
