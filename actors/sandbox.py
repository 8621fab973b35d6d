"""Envs that cannot hurt the run (``env.isolation: process``): each env in a child process with hard limits.

Under ``env.isolation: none`` an env runs inside its rollout actor's process, beside the actor's handles to the
supply board and the shards and the cluster's token, with no cap but ``rollout.memory_limit_mb``'s look at the
actor's own RSS once per fragment. ``SandboxVectorEnv`` is the same vector env (``actors.envs.VectorEnv``'s
interface: SAME_STEP autoreset, final observations apart) whose envs live in children (``envs_per_child`` each,
one by default), each of which:

* is a fresh interpreter (``python -m actors.sandbox``), not a fork of the actor: no Ray module, no handle, no
  inherited file descriptor but its socket and its lifeline, and an environment built from nothing (no ``RAY_*``,
  no token);
* joins cgroups of its own (``actors.sandbox_cgroup``) before anything else, where the host has them: its memory
  (every process it forks, memfd, shared memory and tmpfs pages together) and its processes counted by the kernel;
* gets, where the kernel allows it (root, or CAP_SYS_ADMIN), new mount, network, pid, IPC and UTS namespaces: a pid
  namespace whose init reaps every orphan the env leaves and whose end takes every process in it along (a fork
  bomb's included), with a ``/proc`` of its own; no network at all (only a loopback that is down); every mount of
  the host read-only, with a private empty tmpfs on ``/tmp`` (which hides Ray's session directory and sockets),
  ``/var/tmp``, ``/dev/shm`` and ``/run`` (its working directory is ``/tmp/work`` there, gone with the child), and
  the invoking user's home (``~/.ray/auth_token``) hidden behind an empty tmpfs, with only the Python installation
  bound back, read-only;
* dies with its parent process however that dies: the process started here holds the read end of a pipe (the
  lifeline) whose write end only the parent holds; when it hangs up, it kills the namespace's init;
* runs as an unprivileged uid of its own (``UID_BASE`` on, one per live child on the host, claimed with a lock
  file), with an empty capability bounding set and no new privileges: RLIMIT_NPROC counts processes per uid and
  does not bind root, so only a uid of its own makes the process limit a limit for this child alone, and the uid
  cannot write what root owns, signal or trace the host's processes;
* has ``resource.setrlimit`` caps set before the env is made: address space (``memory_mb``), CPU seconds
  (``cpu_s`` is the parent's to enforce, see ``Limits``), processes, open files, file size, no core files.

Nothing the child sends runs as code (``actors.sandbox_wire``): its spaces arrive as checked JSON, a step's reply
is a fixed header, and observations, rewards and flags sit in a shared block the parent makes, sizes and seals,
copied out and checked before use. One round trip per child per vector step. The parent's commands to the child
are pickles the parent makes; the child trusts its parent, never the other way.

A child that breaks a limit, raises, dies, misses its step deadline (``step_timeout_s``) or sends what the
protocol does not allow is killed with every process of its cgroup and uid and replaced (by a spare child that has made its env already); its episode ends as truncated
at the last good observation, ``failed`` names it for the sampler (which drops the episode from the statistics),
and ``fault_count`` and ``last_fault`` record it, the limit named, for the run's ``env_failures`` and
``last_rollout_fault``. The actor goes on. A slot whose children fail
``REPEAT_FAILURES`` times in a row without one good step in between raises ``SandboxFailed``: the env is broken
rather than unlucky, and the actor's own fault budget (``rollout.max_env_failures``) takes over.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import json
import math
import os
import pickle
import resource
import signal
import socket
import subprocess
import sys
import time
from typing import Mapping, Sequence

import numpy as np

from actors import sandbox_cgroup
from actors import sandbox_wire as wire
from actors.env_factory import empty_batch, stacked_layout, step_buffers

#: First uid handed to a child. Far above any distribution's user ranges (useradd stops at 60000, systemd's
#: dynamic users at 65519, container subuid ranges start at 100000 and take 65536 each), so no file on the host is
#: owned by it and no real user shares its process count.
UID_BASE = 1_500_000_000
#: Uids in the pool: the most children alive at once on one host (a 256-core host with 16 actors of 64 envs each
#: needs 1024 of them).
UID_COUNT = 65536
#: Where the claims of the uids live: one lock file per uid, held (flock) by the process whose child has it, so a
#: dead actor's claims end with it.
UID_LOCKS = "/run/ascent-sandbox-uids"
#: Children of a slot failing in a row, with no good step between them, before the env counts as broken: one is
#: bad luck (a program that loops), several with nothing good between are a bug that a replacement only repeats.
REPEAT_FAILURES = 3
#: How long a new child may take to start and make its env (a fresh interpreter importing numpy, gymnasium and
#: the env's module, as much as a cold file cache needs).
START_TIMEOUT_S = 60.0
#: Longest wall time between two looks at a child's CPU time (besides one at each episode's end): an episode that
#: never ends is still held to env.limits.cpu_s, within about this much more CPU than the budget.
CPU_LOOK_S = 1.0

CLONE_NEWPID = 0x20000000
CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUTS = 0x04000000
#: Its own mounts, network (none), pids, System V IPC (segments that would outlive it on the host) and host name.
_NAMESPACES = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_MOVE, _MS_REC, _MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
_PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 1, 24, 38
#: Variables a child's environment is built from: none of the parent's others (RAY_*, tokens, credentials).
_KEPT_VARIABLES = ("PATH", "LANG", "LC_ALL", "TZ")


@dataclasses.dataclass(frozen=True)
class Limits:
    """A child's caps (``env.limits.*``); None leaves one off.

    ``cpu_s`` is per episode (of any env of the child), enforced by the parent from the kernel's count (the
    child's cgroup's CPU time, all its processes, where it has one; else its process's and its reaped children's),
    looked at when an episode ends and at least every ``CPU_LOOK_S``. Not RLIMIT_CPU: that counts a process's whole
    life, and moving it forward after each episode needs CAP_SYS_RESOURCE, which a container's root often lacks
    (the limit then ended every child after ``cpu_s`` seconds of its life, however short its episodes).
    A single step is bounded in wall time by ``step_timeout_s``, which also catches an env that blocks or sleeps
    without using the CPU.
    """

    memory_mb: int | None = 1024
    cpu_s: int | None = 60
    processes: int | None = 16
    open_files: int | None = 64
    file_mb: int | None = 64
    step_timeout_s: float = 10.0


class SandboxFailed(RuntimeError):
    """An env whose children keep failing (``REPEAT_FAILURES`` in a row), or one that cannot start."""


# --------------------------------------------------------------------------- what the host allows


def _libc():
    return ctypes.CDLL(None, use_errno=True)


_HOST_NOTE: list[str] = []  # said once per process


def host_note() -> str:
    """What isolation this host gives a child, in one line (and printed once, at the first child)."""
    if not _HOST_NOTE:
        missing = []
        if os.geteuid() != 0:
            missing.append("not root: children keep this uid (env.limits.processes counts this user's processes "
                           "too) and new namespaces are unavailable (network and file system stay the host's)")
        elif sandbox_cgroup.unavailable():
            missing.append(f"no cgroups ({sandbox_cgroup.unavailable()}): env.limits.memory_mb and processes hold "
                           f"per process, not for all of a child's processes, memfd and tmpfs together")
        _HOST_NOTE.append("; ".join(missing))
    return _HOST_NOTE[0]


# --------------------------------------------------------------------------- uids


class _UidClaim:
    """A uid of the pool, held for as long as this object (and this process) lives."""

    def __init__(self):
        self.uid, self._fd = None, None
        if os.geteuid() != 0:
            return
        os.makedirs(UID_LOCKS, mode=0o700, exist_ok=True)
        start = (os.getpid() * 64) % UID_COUNT  # spread processes over the pool: fewer locks tried
        for k in range(UID_COUNT):
            uid = UID_BASE + (start + k) % UID_COUNT
            fd = os.open(os.path.join(UID_LOCKS, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            kill_uid(uid)  # whatever a dead holder's child left behind
            return
        raise SandboxFailed(f"all {UID_COUNT} sandbox uids from {UID_BASE} are held on this host")

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _uid_pids(uid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:  # the real uid from status: /proc/<pid> itself is root's for a process made non-dumpable by setuid
            with open(f"/proc/{name}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        if int(line.split()[1]) == uid:
                            pids.append(int(name))
                        break
        except (OSError, ValueError, IndexError):
            pass
    return pids


def kill_uid(uid: int, rounds: int = 100) -> int:
    """SIGKILL every process of ``uid`` until none is left (a fork bomb forks between two looks; its processes
    are bounded by env.limits.processes, and a killed one forks no more). Returns the processes killed."""
    killed = 0
    for _ in range(rounds):
        pids = _uid_pids(uid)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed


# --------------------------------------------------------------------------- the child


def _exit_as(status: int) -> None:
    """End this process as a wait status says its child ended: by the same signal, or with the same code (a code
    of 128 + N from a namespace's init, which cannot die of most signals, is signal N)."""
    sig = (os.WTERMSIG(status) if os.WIFSIGNALED(status)
           else os.WEXITSTATUS(status) - 128 if os.WEXITSTATUS(status) > 128 else 0)
    if sig:
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def _watch(init: int, lifeline: int) -> None:
    """The child as started, after the fork of its pid namespace's init: wait for the init and end as it does, or,
    when the lifeline says the parent process is gone (its write end closed: however the parent died, the kernel
    closed it), SIGKILL the init, which ends the namespace and every process in it."""
    import select

    pidfd = os.pidfd_open(init)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.register(lifeline, select.POLLIN | select.POLLHUP)
    while True:
        for fd, _ in poller.poll():
            if fd == lifeline:
                os.kill(init, signal.SIGKILL)
            _exit_as(os.waitpid(init, 0)[1])


def _enter_pid_namespace(fd: int, lifeline: int) -> None:
    """After unshare(CLONE_NEWPID): this process watches the namespace's init (``_watch``); the init (pid 1 there)
    reaps every orphan of the namespace (a fork bomb's processes, whose zombies would otherwise count against the
    uid's process limit until the host's init collects them, if it ever does) and ends when the env's process
    (pid 2) does, the kernel then killing whatever else is left in the namespace. Only pid 2 returns here, still
    root, to go on with the isolation."""
    init = os.fork()
    if init:
        os.close(fd)  # the socket is the env process's alone: its death is the parent's EOF
        _watch(init, lifeline)
    os.close(lifeline)
    worker = os.fork()
    if worker:
        os.close(fd)
        while True:
            pid, status = os.wait()
            if pid == worker:
                os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


_MOUNT_FLAGS = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}


def _mount_points() -> list[tuple[str, int]]:
    """(mount point, its nosuid/nodev/noexec/atime flags) of every mount this mount namespace sees."""
    found = []
    for line in open("/proc/self/mountinfo"):
        fields = line.split()
        point = fields[4].encode().decode("unicode_escape")  # \040 and friends: octal escapes of the kernel's
        flags = sum(_MOUNT_FLAGS.get(o, 0) for o in fields[5].split(","))
        found.append((point, flags))
    return found


def _private_view(libc, limits: Limits, gaps: dict) -> None:
    """In the child's own mount namespace, still root: every mount of the host read-only; empty private tmpfs on
    the host's writable places (``/tmp``, which hides Ray's session directory and its sockets, ``/var/tmp``,
    ``/dev/shm``, ``/run``) and on the home (the token), the Python installation and the folders on the child's
    import path bound back read-only where they lie below one of those (a clone and its venv in the home or in
    /tmp); a ``/proc`` of its own pid namespace (the host's processes and their command lines unseen)."""
    def mount(src, target, fstype, flags, data=None):
        if libc.mount(src and src.encode(), target.encode(), fstype and fstype.encode(), flags,
                      data and data.encode()) != 0:
            raise OSError(ctypes.get_errno(), f"mount {target}: {os.strerror(ctypes.get_errno())}")

    home = os.path.expanduser("~")
    mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    failed = []
    for point, flags in _mount_points():
        try:
            mount(None, point, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags)
        except OSError:
            failed.append(point)
    if "/" in failed:
        gaps["read-only host"] = "the root file system could not be remounted read-only"
    size = f"size={limits.file_mb}m," if limits.file_mb else ""
    hidden = [d for d in ("/tmp", "/var/tmp", "/dev/shm", "/run") if os.path.isdir(d)]
    hidden += [home] if os.path.isdir(home) and home != "/" else []
    # What the child must still import, where a hidden place holds it (pyenv in root's home; a clone and its venv
    # in the home or in /tmp): the Python installation and the folders on its path (the PYTHONPATH the parent gave
    # it: this project's root first), each as visible as it is where no hidden place holds it. Held open now, bound
    # back read-only once hidden (through /proc/self/fd, still the host's /proc here). A hidden place itself is
    # never kept (the home's token, /tmp's Ray session stay out of sight).
    paths = [sys.base_prefix, sys.prefix, *(os.path.abspath(p) for p in sys.path if p and os.path.isdir(p))]
    keep = sorted({p for p in paths if any(p.startswith(d + os.sep) for d in hidden)})
    held = [os.open(path, os.O_PATH | os.O_DIRECTORY) for path in keep]
    for d in hidden:
        if d == "/run":
            mount("tmpfs", d, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "size=64k,mode=755")
        elif d == home:
            mount("tmpfs", d, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=755")
        else:
            mount("tmpfs", d, "tmpfs", _MS_NOSUID | _MS_NODEV, f"{size}mode=1777")
    for path, fd in zip(keep, held):
        os.makedirs(path, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
        mount(None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY)
        os.close(fd)
    mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)



def _drop_privileges(libc, uid: int) -> None:
    """No way back to root: every capability out of the bounding set, no new privileges (a setuid binary runs
    as its caller), then the uid (which empties the permitted and effective sets)."""
    for cap in range(64):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
            break  # past the kernel's last capability
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _child_isolate(spec: dict, limits: Limits, fd: int, lifeline: int) -> dict:
    """In the child, as root, before anything of the env's runs: cgroups, namespaces, a private view of the host,
    limits, then the uid. Returns what it could not do, by name."""
    gaps = {}
    libc = _libc()
    uid = spec["uid"]
    for procs in spec.get("cgroup_procs") or ():
        with open(procs, "w") as f:  # everything this process starts is born in the cgroup, and stays there
            f.write(str(os.getpid()))
    namespaced = uid is not None and libc.unshare(_NAMESPACES) == 0
    if namespaced:
        _enter_pid_namespace(fd, lifeline)
        _private_view(libc, limits, gaps)
    else:
        if uid is not None:
            gaps["namespaces"] = os.strerror(ctypes.get_errno())
        # No namespace's init to watch the lifeline: the kernel signals this process when the thread that started
        # it ends (the rollout's env thread, which outlives its envs).
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        os.close(lifeline)
    work = "/tmp/work" if namespaced else None
    if work is None:
        import tempfile

        work = tempfile.mkdtemp(prefix="ascent-env-")
    os.makedirs(work, exist_ok=True)
    if uid is not None:
        os.chown(work, uid, uid)
    os.chmod(work, 0o700)
    os.chdir(work)
    os.environ["HOME"] = os.environ["TMPDIR"] = work

    mib = 2**20
    caps = [(resource.RLIMIT_CORE, 0)]
    if limits.memory_mb:
        caps.append((resource.RLIMIT_AS, limits.memory_mb * mib))
    if limits.processes:
        caps.append((resource.RLIMIT_NPROC, limits.processes))
    if limits.open_files:
        caps.append((resource.RLIMIT_NOFILE, limits.open_files))
    if limits.file_mb:
        caps.append((resource.RLIMIT_FSIZE, limits.file_mb * mib))
    for which, value in caps:
        resource.setrlimit(which, (value, value))
    if uid is not None:
        _drop_privileges(libc, uid)
    return gaps


def _recv_command(commands):
    """The parent's next command, (number, message) (its own pickle: the child trusts its parent, never the other
    way), or None when the parent has closed the socket. ``commands``: the socket's buffered reader (one system
    call reads a whole small command)."""
    try:
        header = commands.read(8)
        if len(header) < 8:
            return None
        n = int.from_bytes(header[4:], "little")
        body = commands.read(n)
    except OSError:
        return None
    return None if len(body) < n else (int.from_bytes(header[:4], "little"), pickle.loads(body))


def child_main(argv: Sequence[str]) -> None:
    """The child's loop: ``python -m actors.sandbox SPEC_JSON``. It says what isolation it could not get, makes its
    ``k`` envs, sends their spaces (``actors.sandbox_wire``), maps the block its parent makes, then answers
    commands: ("reset", {env: seed}), ("step", [action per env]), ("close",); each answered by one frame, OK
    (the block holds the results) or ERROR (the exception's text and errno)."""
    spec = json.loads(argv[0])
    sock = socket.socket(fileno=spec["fd"])
    limits = Limits(**spec["limits"])
    gaps = _child_isolate(spec, limits, spec["fd"], spec["lifeline"])
    sock.setblocking(True)
    commands = sock.makefile("rb", buffering=1 << 16)
    wire.send_frame(sock, wire.OK, json.dumps(gaps).encode()[: wire.TEXT_LIMIT])
    me, seq = os.getpid(), 0

    def fail(e: BaseException) -> None:
        if os.getpid() != me:  # a process the env forked, unwinding: only the child itself speaks on the socket
            os._exit(1)
        try:
            wire.send_frame(sock, wire.ERROR, f"{type(e).__name__}: {e}".encode()[: wire.TEXT_LIMIT],
                            getattr(e, "errno", None) if isinstance(getattr(e, "errno", None), int) else None, seq)
        except OSError:  # the parent stopped listening (it closed the env, or gave up on a deadline)
            pass

    try:
        from actors.env_factory import make_env

        envs = [make_env(spec["env_id"], **spec["make"]) for _ in range(spec["k"])]
        spaces = wire.spaces_to_wire(envs[0].observation_space, envs[0].action_space)
        wire.send_frame(sock, wire.READY, spaces)
        _, fds, _, _ = socket.recv_fds(sock, 1, 1)
        if not fds:
            return
        obs_space, act_space = wire.spaces_from_wire(spaces)  # as the parent rebuilds them: the same block layout
        block = wire.Layout(obs_space, len(envs), act_space).map(fds[0])
        os.close(fds[0])
    except BaseException as e:  # noqa: BLE001 - the env's own code: anything it raises is its error
        fail(e)
        return
    while True:
        got = _recv_command(commands)
        if got is None:  # the parent closed the env, or is gone
            return
        seq, msg = got
        try:
            if msg[0] == "step":
                actions = msg[1] if msg[1] is not None else block.actions.tolist() if block.actions.ndim == 1 \
                    else list(block.actions.copy())
                rewards, flags = [0.0] * len(envs), [(False, False)] * len(envs)
                for j, (env, action) in enumerate(zip(envs, actions)):
                    obs, rewards[j], terminated, truncated = env.step(action)[:4]
                    flags[j] = (terminated, truncated)
                    if terminated or truncated:
                        block.write_obs(j, 1, obs)
                        obs = env.reset()[0]
                    block.write_obs(j, 0, obs)
                block.rewards[:] = rewards
                block.flags[:] = flags
                if os.getpid() != me:  # a process the env forked, back from its step: it never answers
                    os._exit(0)
                wire.send_frame(sock, wire.OK, seq=seq)
            elif msg[0] == "reset":
                for j, seed in msg[1].items():
                    block.write_obs(j, 0, envs[j].reset(seed=seed)[0])
                if os.getpid() != me:
                    os._exit(0)
                wire.send_frame(sock, wire.OK, seq=seq)
            else:
                for env in envs:
                    env.close()
                wire.send_frame(sock, wire.OK, seq=seq)
                return
        except BaseException as e:  # noqa: BLE001 - reported, and the parent replaces this child
            fail(e)
            return


# --------------------------------------------------------------------------- the parent


#: Signals the child's own limits send (cpu_s is the parent's count, not RLIMIT_CPU: no SIGXCPU of ours).
_SIGNAL_LIMITS = {signal.SIGXFSZ: "file_mb"}
#: The command of a step whose actions are in the shared block: the same bytes every step.
_STEP_IN_BLOCK = pickle.dumps(("step", None), protocol=pickle.HIGHEST_PROTOCOL)


def classify(text: str, err: int | None) -> str:
    """The env.limits key (or the isolation) an env's exception says it ran into, or '' for a plain error."""
    if text.startswith("MemoryError"):
        return "memory_mb"
    if text.startswith("CPUTimeExceeded"):
        return "cpu_s"
    if err == errno.EAGAIN and ("fork" in text or "Resource temporarily unavailable" in text):
        return "processes"
    if err == errno.EMFILE:
        return "open_files"
    if err == errno.EFBIG:
        return "file_mb"
    if err in (errno.ENETUNREACH, errno.ENETDOWN, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL):
        return "network"
    if err in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "file system"
    return ""


def _cpu_seconds(pid: int) -> float | None:
    """A process's CPU time and its reaped children's, as the kernel counts it: never a number the child
    reports."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
        return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class _Child:
    """One child's process, its socket, its lifeline, its cgroups and its shared block, holding envs
    ``lo .. lo + k - 1`` of the vector env."""

    def __init__(self, spec: dict, uid: int | None, k: int):
        parent_sock, child_sock = socket.socketpair()
        self.sock = parent_sock
        # The lifeline: the child's watcher sees its read end hang up when this process is gone, however it died.
        read_end, self.lifeline = os.pipe2(os.O_CLOEXEC)
        env = {key: os.environ[key] for key in _KEPT_VARIABLES if key in os.environ}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        paths = [root] + [p for p in sys.path if p and os.path.isdir(p) and p != root]
        env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONDONTWRITEBYTECODE="1", ASCENT_SANDBOX="1",
                   OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.uid, self.k = uid, k
        self.cgroup = None
        if uid is not None and not sandbox_cgroup.unavailable():
            try:
                self.cgroup = sandbox_cgroup.ChildCgroup(str(uid), spec["limits"]["memory_mb"],
                                                         spec["limits"]["processes"])
            except OSError as e:  # the hierarchy was there a moment ago: a host problem, said in one line
                raise SandboxFailed(f"the env's cgroup could not be made ({e})") from None
        spec = dict(spec, fd=child_sock.fileno(), lifeline=read_end, uid=uid, k=k,
                    cgroup_procs=self.cgroup.procs if self.cgroup else [])
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "actors.sandbox", json.dumps(spec)], env=env,
                                         pass_fds=[child_sock.fileno(), read_end], stdin=subprocess.DEVNULL,
                                         cwd="/", start_new_session=True)
        finally:
            child_sock.close()
            os.close(read_end)
        self.block: wire.Block | None = None
        self.pid = self.proc.pid
        self.spaces = None
        self.gaps: dict = {}
        self.seq = 0  # the last command's number
        #: CPU seconds the child had used when its current episode began, and when that was last looked at.
        self.cpu_mark, self.cpu_looked, self.episode_ended = 0.0, time.monotonic(), False

    def cpu_seconds(self) -> float | None:
        """The child's CPU time so far, all its processes where it has a cgroup."""
        used = self.cgroup.cpu_seconds() if self.cgroup is not None else None
        return used if used is not None else _cpu_seconds(self.pid)

    def ready(self, deadline: float) -> None:
        """Read what the child could not isolate, then its spaces (checked: ``actors.sandbox_wire``), and hand
        it the shared block; SandboxFailed if the env could not be made or the child broke the protocol."""
        try:
            said = wire.recv_frame(self.sock, deadline, wire.TEXT_LIMIT)  # before any env code ran: our own words
            if said is not None and said[0] == wire.OK:
                gaps = json.loads(said[2])
                self.gaps = {str(k): str(v) for k, v in gaps.items()} if isinstance(gaps, dict) else {}
                said = wire.recv_frame(self.sock, deadline, wire.SPACES_LIMIT)
            if said is None or said[0] != wire.READY:
                why = (wire.error_text(said[2]) if said else self.death()
                       or f"no answer in {START_TIMEOUT_S:g} s")
                raise SandboxFailed(f"the env could not be made in its sandbox: {why}")
            self.spaces = said[2]
            obs_space, act_space = wire.spaces_from_wire(said[2])
            layout = wire.Layout(obs_space, self.k, act_space)
        except (wire.ProtocolBreach, ValueError) as e:  # ValueError: a first frame that is not our JSON
            raise SandboxFailed(f"the env's child broke the sandbox's protocol: {e}") from None
        # The env's own process, as this host numbers it: under a pid namespace the one of its uid (the process
        # started here watches the namespace's init, which waits for it), else the one started here.
        own = _uid_pids(self.uid) if self.uid is not None else []
        self.pid = own[0] if len(own) == 1 else self.proc.pid
        fd = layout.make_block()
        try:
            socket.send_fds(self.sock, [b"m"], [fd])
            self.block = layout.map(fd)
        except OSError as e:
            raise SandboxFailed(f"the env's child did not take its shared block: {e}") from None
        finally:
            os.close(fd)

    def command(self, msg) -> bool:
        """Send the next command, numbered; False when the child does not take it."""
        self.seq = (self.seq + 1) % 2**32 or 1
        body = _STEP_IN_BLOCK if msg == ("step", None) else pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.sock.settimeout(1.0)  # a socket buffer the child does not drain is a child that failed
            self.sock.sendall(self.seq.to_bytes(4, "little") + len(body).to_bytes(4, "little") + body)
            return True
        except OSError:
            return False

    def reply(self, deadline: float):
        """("ok",), ("error", text, errno), ("breach", text), or None if the child died or the deadline passed
        first."""
        try:
            frame = wire.recv_frame(self.sock, deadline, wire.TEXT_LIMIT, self.seq)
        except wire.ProtocolBreach as e:
            return ("breach", str(e))
        if frame is None:
            return None
        status, err, payload = frame
        if status == wire.OK and not payload:
            return ("ok",)
        if status == wire.ERROR:
            return ("error", wire.error_text(payload), err if err >= 0 else None)
        return ("breach", f"a frame of status {status} with {len(payload)} bytes where a step's reply was due")

    def death(self) -> str:
        """How the child ended, if it has (waited for briefly: a reply that never came may be a death)."""
        try:
            code = self.proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            return ""
        if self.cgroup is not None and self.cgroup.oom_kills():
            return "killed by the kernel's OOM killer (over env.limits.memory_mb, counted over all its processes)"
        if code < 0:
            sig = signal.Signals(-code)
            limit = _SIGNAL_LIMITS.get(sig)
            return f"killed by {sig.name}" + (f" (over env.limits.{limit})" if limit else "")
        return f"exited with status {code}"

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.cgroup is not None:
            self.cgroup.kill()
        if self.uid is not None:
            kill_uid(self.uid)
        if self.lifeline is not None:
            os.close(self.lifeline)
            self.lifeline = None
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if self.cgroup is not None:
            self.cgroup.remove()
        try:
            self.sock.close()
        except OSError:
            pass
        if self.block is not None:
            self.block.close()
            self.block = None


class SandboxVectorEnv:
    """``actors.envs.VectorEnv``'s interface over envs in sandboxed children (module docstring)."""

    #: Single-agent envs have no filler slots; no env object lives in this process for the sampler to look into.
    dead = None
    envs = ()

    def __init__(self, env_id: str, num_envs: int, max_episode_steps: int | None = None,
                 env_kwargs: dict | None = None, wrappers: Sequence[Mapping] = (), multiagent: Mapping | None = None,
                 limits: Mapping | Limits | None = None, envs_per_child: int = 1):
        self.limits = limits if isinstance(limits, Limits) else Limits(**dict(limits or {}))
        self.spec = {"env_id": env_id, "limits": dataclasses.asdict(self.limits),
                     "make": {"max_episode_steps": max_episode_steps, "env_kwargs": dict(env_kwargs or {}),
                              "wrappers": [dict(w) for w in wrappers], "multiagent": dict(multiagent or {})}}
        self.num_envs = num_envs
        #: Envs each child holds: envs lo .. lo + k - 1 of child c (the last child may hold fewer).
        per = max(1, min(int(envs_per_child), num_envs))
        self.groups = [(lo, min(per, num_envs - lo)) for lo in range(0, num_envs, per)]
        self.episode_step = np.zeros(num_envs, dtype=np.int64)
        self.episode = np.zeros(num_envs, dtype=np.int64)
        #: Children replaced so far and the last one's fault in words, the limit named; envs whose child failed in
        #: the last step (the sampler drops their episodes); consecutive failures per env.
        self.fault_count, self.last_fault = 0, ""
        self.failed: set[int] = set()
        self.failures_in_a_row = np.zeros(num_envs, dtype=np.int64)
        self._claims = [_UidClaim() for _ in self.groups]
        self._spare: tuple[_Child, _UidClaim] | None = None  # a child ready to replace a failed one (from the first)
        self._children: list[_Child | None] = [None] * len(self.groups)
        self._last: list = [None] * num_envs  # each env's last good observation: a failed episode's final one
        self._spaces = None
        note = host_note()
        try:
            self._children = [_Child(self.spec, c.uid, k) for c, (_, k) in zip(self._claims, self.groups)]
            deadline = time.monotonic() + START_TIMEOUT_S
            for child in self._children:  # started together: their imports overlap
                self._ready(child, deadline)
        except BaseException:
            self.close()
            raise
        obs_space, act_space = wire.spaces_from_wire(self._spaces)
        self.single_observation_space, self.single_action_space = obs_space, act_space
        gaps = self._children[0].gaps
        if gaps:
            note = "; ".join(filter(None, [note, *(f"no {k}: {v}" for k, v in gaps.items())]))
        if note and note not in _SAID:
            _SAID.add(note)
            print(f"env.isolation: process: {note}", file=sys.stderr, flush=True)
        self._stacked = stacked_layout(obs_space)

    def _ready(self, child: _Child, deadline: float) -> None:
        """``child.ready``, and its spaces the first child's: a replacement may not change them."""
        child.ready(deadline)
        if self._spaces is None:
            self._spaces = child.spaces
        elif child.spaces != self._spaces:
            raise SandboxFailed("the env's child broke the sandbox's protocol: its spaces differ from the first "
                                "child's")

    def _envs(self, c: int) -> range:
        lo, k = self.groups[c]
        return range(lo, lo + k)

    def _batch(self, n: int):
        return empty_batch(self._stacked, n)

    # ------------------------------------------------------------------ failures
    def _count_failure(self, c: int, reply) -> None:
        """Kill child ``c`` after a failed reply and count it; SandboxFailed on its envs' third in a row."""
        child = self._children[c]
        death = child.death() if child is not None and reply is None else ""
        why = f"died ({death})" if death else self._why(reply, self.limits)
        if child is not None:
            child.kill()
        lo, k = self.groups[c]
        self.fault_count += 1
        self.last_fault = (f"env {lo} " if k == 1 else f"envs {lo}-{lo + k - 1} ") + why
        envs = self._envs(c)
        self.failed.update(envs)
        self.failures_in_a_row[envs.start:envs.stop] += 1
        if self.failures_in_a_row[lo] >= REPEAT_FAILURES:
            self._children[c] = None
            raise SandboxFailed(f"{self.last_fault.split(' ', 2)[0]} {self.last_fault.split(' ', 2)[1]}: "
                                f"{REPEAT_FAILURES} sandboxed children in a row failed with no good step between "
                                f"them; the last {why}")

    def _replace(self, failed: list[int]) -> None:
        """New children for the children ``failed``, which were killed. The spare, started at the previous failure,
        has made its envs by now and takes the first it fits; the others start side by side, so children failing
        in the same step (a breach every env meets at the same step count) cost one interpreter start, not one
        each, and the actor keeps within rollout.fragment_timeout_s. The next spare starts with them, under the
        uid the spare's slot freed (all of its processes are gone), and makes its envs while these step."""
        fresh, freed = [], None
        for c in failed:
            k = self.groups[c][1]
            if self._spare is not None and freed is None and self._spare[0].k == k:
                child, claim = self._spare
                self._spare = None
                freed, self._claims[c] = self._claims[c], claim
            else:
                child = _Child(self.spec, self._claims[c].uid, k)
            self._children[c] = child
            fresh.append(child)
        if self._spare is None:
            self._spare = (_Child(self.spec, (freed or (freed := _UidClaim())).uid, self.groups[0][1]), freed)
        elif freed is not None:
            freed.release()
        deadline = time.monotonic() + START_TIMEOUT_S
        for child in fresh:
            self._ready(child, deadline)

    @staticmethod
    def _why(reply, limits: Limits) -> str:
        """A failed reply in words: the error, and the limit it ran into."""
        if reply is None:
            return f"missed its step deadline (env.limits.step_timeout_s = {limits.step_timeout_s:g} s)"
        if reply[0] == "breach":
            return f"broke the sandbox's protocol ({reply[1]})"
        text, err = reply[1], (reply[2] if len(reply) > 2 else None)
        limit = classify(text, err)
        if limit in ("memory_mb", "cpu_s", "processes", "open_files", "file_mb"):
            return f"over env.limits.{limit} = {getattr(limits, limit)} ({text})"
        if limit:
            return f"denied by the sandbox's {limit} ({text})"
        return f"raised {text}"

    def _call(self, c: int, msg):
        """Send ``msg`` to child ``c`` and read its reply within one step deadline -> the reply (None: none)."""
        child = self._children[c]
        deadline = time.monotonic() + self.limits.step_timeout_s
        return child.reply(deadline) if child.command(msg) else None

    def _read_obs(self, c: int, j: int, slot: int):
        """Env ``lo + j``'s observation from child ``c``'s block, checked; ProtocolBreach when it is not in its
        space."""
        return self._children[c].block.read_obs(j, slot)

    def _reset_child(self, c: int, seeds: dict[int, int | None]):
        """Reset envs of child ``c`` (``seeds``: env within the child -> seed), replacing the child while that
        fails (each failure counted) -> {env within the child: first observation}."""
        while True:
            reply = self._call(c, ("reset", seeds))
            if reply is not None and reply[0] == "ok":
                try:
                    return {j: self._read_obs(c, j, 0) for j in seeds}
                except wire.ProtocolBreach as e:
                    reply = ("breach", str(e))
            self._count_failure(c, reply)
            self._replace([c])
            seeds = {j: None for j in range(self.groups[c][1])}  # a new child: every env of it starts afresh

    # ------------------------------------------------------------------ the VectorEnv interface
    def reset(self, seed: int):
        """Env i is seeded ``seed + i`` (as gymnasium's vector envs do)."""
        self.episode_step[:] = 0
        observations = self._batch(self.num_envs)
        for c, (lo, k) in enumerate(self.groups):
            first = self._reset_child(c, {j: None if seed is None else seed + lo + j for j in range(k)})
            for j, obs in first.items():
                observations[lo + j] = self._last[lo + j] = obs
        return observations

    def reset_one(self, i: int):
        """Abandon env ``i``'s episode and start a new one."""
        c = next(c for c, (lo, k) in enumerate(self.groups) if lo <= i < lo + k)
        lo = self.groups[c][0]
        self.episode[i] += 1
        self.episode_step[i] = 0
        first = self._reset_child(c, {i - lo: None})
        if len(first) > 1:  # the child failed and was replaced: its other envs started new episodes too
            for j, obs in first.items():
                if lo + j != i:
                    self._restart(lo + j)
                self._last[lo + j] = obs
        self._last[i] = first[i - lo]
        return first[i - lo]

    def _restart(self, i: int) -> None:
        self.episode[i] += 1
        self.episode_step[i] = 0
        self.failed.add(i)

    def step(self, actions):
        """-> (observations, rewards, terminated, truncated, final observations {env: raw} of ended episodes).
        An env whose child failed ends its episode truncated at its last good observation (named in ``failed``);
        every env of a failed child does."""
        observations, rewards, terminated, truncated, finals = step_buffers(self._stacked, self.num_envs)
        self.failed = set()
        sent = [self._send_step(child, actions, lo, k) for child, (lo, k) in zip(self._children, self.groups)]
        deadline = time.monotonic() + self.limits.step_timeout_s
        failed_now = []
        for c, child in enumerate(self._children):
            reply = child.reply(deadline) if sent[c] else None
            lo, k = self.groups[c]
            results = None
            if reply is not None and reply[0] == "ok":
                try:
                    rew, term, trunc = child.block.read_steps()
                    results = child.block.read_all(0)
                    ended = {j: child.block.read_obs(j, 1) for j in np.flatnonzero(term | trunc)}
                except wire.ProtocolBreach as e:
                    reply, results = ("breach", str(e)), None
            if results is None:
                self._count_failure(c, reply)
                failed_now.append(c)
                for i in self._envs(c):
                    truncated[i] = True
                    finals[i] = self._last[i]
                    self.episode[i] += 1
                    self.episode_step[i] = 0
                continue
            self.failures_in_a_row[lo:lo + k] = 0
            rewards[lo:lo + k], terminated[lo:lo + k], truncated[lo:lo + k] = rew, term, trunc
            self.episode_step[lo:lo + k] += 1
            if isinstance(results, np.ndarray):  # a plain Box: one copy into the batch
                observations[lo:lo + k] = results
                self._last[lo:lo + k] = list(results)
            else:
                for j, obs in enumerate(results):
                    observations[lo + j] = self._last[lo + j] = obs
            for j, final in ended.items():
                finals[lo + j] = final
                self.episode[lo + j] += 1
                self.episode_step[lo + j] = 0
            if ended:
                child.episode_ended = True
            if self.limits.cpu_s and time.monotonic() - child.cpu_looked > CPU_LOOK_S:
                over = self._cpu_over(child)
                if over:  # the step's results stand; the episodes end here, cut, as any failed child's do
                    self._count_failure(c, ("error", over, None))
                    failed_now.append(c)
                    for i in self._envs(c):
                        if not (terminated[i] or truncated[i]):
                            truncated[i], finals[i] = True, self._last[i]
                            self.episode[i] += 1
                            self.episode_step[i] = 0
        if failed_now:  # replaced together (one start for all), then each reset
            self._replace(failed_now)
            for c in failed_now:
                lo, k = self.groups[c]
                for j, obs in self._reset_child(c, {j: None for j in range(k)}).items():
                    observations[lo + j] = self._last[lo + j] = obs
        return observations, rewards, terminated, truncated, finals

    @staticmethod
    def _send_step(child: _Child, actions, lo: int, k: int) -> bool:
        """Envs ``lo .. lo + k - 1``'s actions to their child: written into its block when they are arrays (the
        command then carries none), else in the command."""
        if child.block.actions is not None:
            child.block.actions[...] = actions[lo:lo + k]
            return child.command(("step", None))
        return child.command(("step", [actions[i] for i in range(lo, lo + k)]))

    def _cpu_over(self, child: _Child) -> str:
        """'' while the child's CPU time since the last look at which one of its episodes had ended is within
        env.limits.cpu_s, else the fault in words. Looked at every ``CPU_LOOK_S`` of wall time, from the kernel's
        count (a look per episode's end would cost more than a CartPole step)."""
        child.cpu_looked = time.monotonic()
        used = child.cpu_seconds()
        if used is None:
            return ""  # gone already: its next step says so
        spent = used - child.cpu_mark
        if child.episode_ended:
            child.cpu_mark, child.episode_ended = used, False
        if spent > self.limits.cpu_s:
            return f"CPUTimeExceeded: {spent:.1f} s of CPU in one episode"
        return ""

    def close(self) -> None:
        for child in self._children:
            if child is not None:
                child.command(("close",))
        for child in self._children:
            if child is not None:
                child.kill()
        self._children = [None] * len(self.groups)
        spare, self._spare = getattr(self, "_spare", None), None
        if spare is not None:
            spare[0].kill()
            spare[1].release()
        for claim in getattr(self, "_claims", ()):
            claim.release()


_SAID: set[str] = set()


if __name__ == "__main__":
    child_main(sys.argv[1:])
