"""Envs that cannot hurt the run (``env.isolation: process``): each env in a child process with hard limits.

Under ``env.isolation: none`` an env runs inside its rollout actor's process, beside the actor's handles to the
supply board and the shards and the cluster's token, with no cap but ``rollout.memory_limit_mb``'s look at the
actor's own RSS once per fragment. ``SandboxVectorEnv`` is the same vector env (``actors.envs.VectorEnv``'s
interface: SAME_STEP autoreset, final observations apart) whose envs each live in a child that:

* is a fresh interpreter (``python -m actors.sandbox``), not a fork of the actor: no Ray module, no handle, no
  inherited file descriptor but its two channels, and an environment built from nothing (no ``RAY_*``, no token);
* gets, where the kernel allows it (root, or CAP_SYS_ADMIN), new mount, network and pid namespaces: a pid
  namespace whose init reaps every orphan the env leaves and whose end takes every process in it along (a fork
  bomb's included); no network at all
  (only a loopback that is down), a private empty tmpfs on ``/tmp``, ``/var/tmp`` and ``/dev/shm`` (its working
  directory is ``/tmp/work`` there, gone with the child), and the invoking user's home (``~/.ray/auth_token``)
  hidden behind an empty tmpfs, with only the Python installation bound back, read-only;
* runs as an unprivileged uid of its own (``UID_BASE`` on, one per live child on the host, claimed with a lock
  file): RLIMIT_NPROC counts processes per uid and does not bind root, so only a uid of its own makes the
  process limit a limit for this child alone, and the uid cannot write what root owns;
* has ``resource.setrlimit`` caps set before the env is made: address space (``memory_mb``), CPU seconds
  (``cpu_s``, per episode, see ``Limits``), processes, open files, file size, no core files.

Observations come back through shared memory: each child makes a memfd holding two observation slots (the
current one and an ended episode's final one) and hands its descriptor over the control socket once; a step's
reply on the socket is only (reward, terminated, truncated). Non-Box observations travel in the reply instead.

A child that breaks a limit, raises, dies or misses its step deadline (``step_timeout_s``) is killed with every
process of its uid and replaced (by a spare child that has made its env already); its episode ends as truncated
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
import mmap
import os
import pickle
import resource
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Mapping, Sequence

import numpy as np

from actors.env_factory import empty_batch, stacked_layout

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

CLONE_NEWPID = 0x20000000
CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_REMOUNT, _MS_BIND, _MS_MOVE, _MS_REC, _MS_PRIVATE = 1, 32, 4096, 8192, 16384, 1 << 18
#: Variables a child's environment is built from: none of the parent's others (RAY_*, tokens, credentials).
_KEPT_VARIABLES = ("PATH", "LANG", "LC_ALL", "TZ")


@dataclasses.dataclass(frozen=True)
class Limits:
    """A child's caps (``env.limits.*``); None leaves one off.

    ``cpu_s`` is per episode: RLIMIT_CPU counts a process's CPU time in whole seconds since it started, so the
    kernel can only enforce spans well above a second, which one CartPole step (microseconds) is far below; an
    episode is the unit whose length the env itself decides. After each episode the parent moves the soft limit
    to the CPU time used so far plus ``cpu_s`` (the hard one a second above it: the child cannot raise either).
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
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def _enter_pid_namespace(fd: int) -> None:
    """After unshare(CLONE_NEWPID): this process waits for the namespace's init and ends as it does; the init (pid
    1 there) reaps every orphan of the namespace (a fork bomb's processes, whose zombies would otherwise count
    against the uid's process limit until the host's init collects them, if it ever does) and ends when the env's
    process (pid 2) does, the kernel then killing whatever else is left in the namespace. Only pid 2 returns here,
    still root, to go on with the isolation."""
    init = os.fork()
    if init:
        os.close(fd)  # the socket is the env process's alone: its death is the parent's EOF
        _exit_as(os.waitpid(init, 0)[1])
    worker = os.fork()
    if worker:
        os.close(fd)
        while True:
            pid, status = os.wait()
            if pid == worker:
                os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


def _child_isolate(uid: int | None, limits: Limits, fd: int) -> dict:
    """In the child, as root, before anything of the env's runs: namespaces, limits, then the uid. Returns what
    it could not do, by name."""
    gaps = {}
    libc = _libc()
    home = os.path.expanduser("~")
    if uid is not None and libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID) == 0:
        _enter_pid_namespace(fd)
        def mount(src, target, fstype, flags, data=None):
            if libc.mount(src and src.encode(), target.encode(), fstype and fstype.encode(), flags,
                          data and data.encode()) != 0:
                raise OSError(ctypes.get_errno(), f"mount {target}: {os.strerror(ctypes.get_errno())}")

        mount(None, "/", None, _MS_REC | _MS_PRIVATE)
        size = f"size={limits.file_mb}m," if limits.file_mb else ""
        # The Python installation may sit in root's home (pyenv); keep it, read-only, before the home is hidden.
        keep = sorted({p for p in (sys.base_prefix, sys.prefix) if p.startswith(home + os.sep)})
        for d in ("/tmp", "/var/tmp", "/dev/shm"):
            if os.path.isdir(d):
                mount("tmpfs", d, "tmpfs", 0, f"{size}mode=1777")
        for i, path in enumerate(keep):
            os.mkdir(f"/tmp/.keep{i}")
            mount(path, f"/tmp/.keep{i}", None, _MS_BIND | _MS_REC)
        if os.path.isdir(home) and home != "/":
            mount("tmpfs", home, "tmpfs", 0, "size=1m,mode=755")
        for i, path in enumerate(keep):
            os.makedirs(path, exist_ok=True)
            mount(f"/tmp/.keep{i}", path, None, _MS_MOVE)
            mount(None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY)
            os.rmdir(f"/tmp/.keep{i}")
    elif uid is not None:
        gaps["namespaces"] = os.strerror(ctypes.get_errno())
    work = "/tmp/work" if uid is not None and "namespaces" not in gaps else None
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
    if limits.cpu_s:
        soft = math.ceil(time.process_time()) + limits.cpu_s
        resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 1))
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    return gaps


def _write_obs(view: np.ndarray | None, obs):
    """Into the shared slot if there is one (nothing in the reply), else the observation itself for the reply."""
    if view is None:
        return obs
    view[...] = obs
    return None


def _say(conn: Connection, msg) -> None:
    """A last word to the parent, which may have stopped listening (it closed the env, or gave up on a deadline)."""
    try:
        conn.send(msg)
    except OSError:
        pass


def child_main(argv: Sequence[str]) -> None:
    """The child's loop: ``python -m actors.sandbox SPEC_JSON``. Commands on the socket: ("reset", seed),
    ("step", action), ("close",); replies ("ok", ...) or ("error", "Type: message")."""
    spec = json.loads(argv[0])
    sock = socket.socket(fileno=spec["fd"])
    limits = Limits(**spec["limits"])
    gaps = _child_isolate(spec["uid"], limits, spec["fd"])
    conn = Connection(os.dup(sock.fileno()))
    try:
        from actors.env_factory import make_env

        env = make_env(spec["env_id"], **spec["make"])
        space = env.observation_space
        import gymnasium as gym

        slots = None
        if isinstance(space, gym.spaces.Box):
            nbytes = int(np.prod(space.shape)) * np.dtype(space.dtype).itemsize
            fd = os.memfd_create("ascent-env-obs")
            os.ftruncate(fd, max(1, 2 * nbytes))
            buf = mmap.mmap(fd, max(1, 2 * nbytes))
            slots = [np.ndarray(space.shape, space.dtype, buf, k * nbytes) for k in (0, 1)]
        conn.send(("ready", pickle.dumps((space, env.action_space)), gaps))
        if slots is not None:
            socket.send_fds(sock, [b"m"], [fd])
            os.close(fd)
    except BaseException as e:  # noqa: BLE001 - the env's own code: anything it raises is its error
        _say(conn, ("error", f"{type(e).__name__}: {e}"))
        return
    obs_slot, final_slot = slots if slots is not None else (None, None)
    me = os.getpid()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent closed the env, or is gone
            return
        try:
            if msg[0] == "step":
                obs, reward, terminated, truncated = env.step(msg[1])[:4]
                final, cpu = None, None
                if terminated or truncated:
                    final = _write_obs(final_slot, obs)
                    obs = env.reset()[0]
                    cpu = time.process_time()
                if os.getpid() != me:  # a process the env forked, back from its step: it never answers
                    os._exit(0)
                conn.send(("ok", float(reward), bool(terminated), bool(truncated), _write_obs(obs_slot, obs),
                           final, cpu))
            elif msg[0] == "reset":
                conn.send(("ok", _write_obs(obs_slot, env.reset(seed=msg[1])[0])))
            else:
                env.close()
                conn.send(("ok",))
                return
        except BaseException as e:  # noqa: BLE001 - reported, and the parent replaces this child
            if os.getpid() != me:  # a process the env forked, unwinding: only the child itself speaks on the socket
                os._exit(1)
            _say(conn, ("error", f"{type(e).__name__}: {e}", getattr(e, "errno", None)))
            return


# --------------------------------------------------------------------------- the parent


_SIGNAL_LIMITS = {signal.SIGXCPU: "cpu_s", signal.SIGXFSZ: "file_mb"}


def classify(text: str, err: int | None) -> str:
    """The env.limits key (or the isolation) an env's exception says it ran into, or '' for a plain error."""
    if text.startswith("MemoryError"):
        return "memory_mb"
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


class _Child:
    """One env's process, its socket and its shared observation slots."""

    def __init__(self, spec: dict, uid: int | None):
        parent_sock, child_sock = socket.socketpair()
        self.sock = parent_sock
        env = {k: os.environ[k] for k in _KEPT_VARIABLES if k in os.environ}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        paths = [root] + [p for p in sys.path if p and os.path.isdir(p) and p != root]
        env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONDONTWRITEBYTECODE="1", ASCENT_SANDBOX="1",
                   OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        spec = dict(spec, fd=child_sock.fileno(), uid=uid)
        self.proc = subprocess.Popen([sys.executable, "-m", "actors.sandbox", json.dumps(spec)], env=env,
                                     pass_fds=[child_sock.fileno()], stdin=subprocess.DEVNULL, cwd="/",
                                     start_new_session=True)
        child_sock.close()
        self.conn = Connection(os.dup(parent_sock.fileno()))
        self.uid = uid
        self.views: tuple | None = None
        self.buf = None

    def ready(self, deadline: float):
        """-> (observation space, action space, gaps) once the env is made; SandboxFailed if it is not."""
        reply = self.recv(deadline)
        if reply is None or reply[0] != "ready":
            why = reply[1] if reply else self.death() or f"no answer in {START_TIMEOUT_S:g} s"
            raise SandboxFailed(f"the env could not be made in its sandbox: {why}")
        # The env's own process, as this host numbers it: under a pid namespace the one of its uid (the process
        # started here waits for the namespace's init, which waits for it), else the one started here.
        own = _uid_pids(self.uid) if self.uid is not None else []
        self.pid = own[0] if len(own) == 1 else self.proc.pid
        obs_space, act_space = pickle.loads(reply[1])
        import gymnasium as gym

        if isinstance(obs_space, gym.spaces.Box):
            _, fds, _, _ = socket.recv_fds(self.sock, 1, 1)
            nbytes = int(np.prod(obs_space.shape)) * np.dtype(obs_space.dtype).itemsize
            self.buf = mmap.mmap(fds[0], max(1, 2 * nbytes))
            os.close(fds[0])
            self.views = tuple(np.ndarray(obs_space.shape, obs_space.dtype, self.buf, k * nbytes) for k in (0, 1))
        return obs_space, act_space, reply[2]

    def recv(self, deadline: float):
        """The next reply, or None if the child died or the deadline passed first."""
        try:
            if self.conn.poll(max(0.0, deadline - time.monotonic())):
                return self.conn.recv()
        except Exception:  # noqa: BLE001 - closed, or garbled by a process the env forked: a failed child either way
            pass
        return None

    def send(self, msg) -> bool:
        try:
            self.conn.send(msg)
            return True
        except OSError:
            return False

    def death(self) -> str:
        """How the child ended, if it has (waited for briefly: a reply that never came may be a death)."""
        try:
            code = self.proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            return ""
        if code < 0:
            sig = signal.Signals(-code)
            limit = _SIGNAL_LIMITS.get(sig)
            return f"killed by {sig.name}" + (f" (over env.limits.{limit})" if limit else "")
        return f"exited with status {code}"

    def obs(self, reply_obs, slot: int = 0):
        return reply_obs if self.views is None else self.views[slot].copy()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.uid is not None:
            kill_uid(self.uid)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for closing in (self.conn, self.sock):
            try:
                closing.close()
            except OSError:
                pass
        self.views = None
        if self.buf is not None:
            try:
                self.buf.close()
            except BufferError:  # a view still exported; the mapping goes with the last one
                pass


class SandboxVectorEnv:
    """``actors.envs.VectorEnv``'s interface over envs in sandboxed children (module docstring)."""

    #: Single-agent envs have no filler slots; no env object lives in this process for the sampler to look into.
    dead = None
    envs = ()

    def __init__(self, env_id: str, num_envs: int, max_episode_steps: int | None = None,
                 env_kwargs: dict | None = None, wrappers: Sequence[Mapping] = (), multiagent: Mapping | None = None,
                 limits: Mapping | Limits | None = None):
        self.limits = limits if isinstance(limits, Limits) else Limits(**dict(limits or {}))
        self.spec = {"env_id": env_id, "limits": dataclasses.asdict(self.limits),
                     "make": {"max_episode_steps": max_episode_steps, "env_kwargs": dict(env_kwargs or {}),
                              "wrappers": [dict(w) for w in wrappers], "multiagent": dict(multiagent or {})}}
        self.num_envs = num_envs
        self.episode_step = np.zeros(num_envs, dtype=np.int64)
        self.episode = np.zeros(num_envs, dtype=np.int64)
        #: Children replaced so far and the last one's fault in words, the limit named; envs whose child failed in
        #: the last step (the sampler drops their episodes); consecutive failures per slot.
        self.fault_count, self.last_fault = 0, ""
        self.failed: set[int] = set()
        self.failures_in_a_row = np.zeros(num_envs, dtype=np.int64)
        self._claims = [_UidClaim() for _ in range(num_envs)]
        self._spare: tuple[_Child, _UidClaim] | None = None  # a child ready to replace a failed one (from the first)
        self._children: list[_Child | None] = [None] * num_envs
        self._last: list = [None] * num_envs  # each env's last good observation: a failed episode's final one
        note = host_note()
        try:
            started = [_Child(self.spec, c.uid) for c in self._claims]  # start together: their imports overlap
            self._children = started
            deadline = time.monotonic() + START_TIMEOUT_S
            for child in started:
                obs_space, act_space, gaps = child.ready(deadline)
        except BaseException:
            self.close()
            raise
        self.single_observation_space, self.single_action_space = obs_space, act_space
        if gaps:
            note = "; ".join(filter(None, [note, *(f"no {k}: {v}" for k, v in gaps.items())]))
        if note and note not in _SAID:
            _SAID.add(note)
            print(f"env.isolation: process: {note}", file=sys.stderr, flush=True)
        space = obs_space
        self._stacked = stacked_layout(space)

    def _batch(self, n: int):
        return empty_batch(self._stacked, n)

    # ------------------------------------------------------------------ failures
    def _fail(self, i: int, reply) -> None:
        """Kill env ``i``'s child after a failed reply (None: none came), count the fault and start a replacement
        (ready for a reset)."""
        self._count_failure(i, reply)
        self._replace([i])

    def _count_failure(self, i: int, reply) -> None:
        """Kill env ``i``'s child after a failed reply and count it; SandboxFailed on the slot's third in a row."""
        child = self._children[i]
        death = child.death() if child is not None and reply is None else ""
        why = f"died ({death})" if death else self._why(reply, self.limits)
        if child is not None:
            child.kill()
        self.fault_count += 1
        self.last_fault = f"env {i} {why}"
        self.failed.add(i)
        self.failures_in_a_row[i] += 1
        if self.failures_in_a_row[i] >= REPEAT_FAILURES:
            self._children[i] = None
            raise SandboxFailed(f"env {i}: {REPEAT_FAILURES} sandboxed children in a row failed with no good step "
                                f"between them; the last {why}")

    def _replace(self, indices: list[int]) -> None:
        """New children for the envs ``indices``, whose children were killed. The spare, started at the previous
        failure, has made its env by now and takes the first; the others start side by side, so envs failing in
        the same step (a breach every env meets at the same step count) cost one interpreter start, not one each,
        and the actor keeps within rollout.fragment_timeout_s. The next spare starts with them, under the uid the
        spare's slot freed (all of its processes are gone), and makes its env while these step."""
        fresh, freed = [], None
        for i in indices:
            if self._spare is not None and freed is None:
                child, claim = self._spare
                self._spare = None
                freed, self._claims[i] = self._claims[i], claim
            else:
                child = _Child(self.spec, self._claims[i].uid)
            self._children[i] = child
            fresh.append(child)
        self._spare = (_Child(self.spec, (freed or (freed := _UidClaim())).uid), freed)
        deadline = time.monotonic() + START_TIMEOUT_S
        for child in fresh:
            child.ready(deadline)

    @staticmethod
    def _why(reply, limits: Limits) -> str:
        """A failed reply in words: the error, and the limit it ran into."""
        if reply is None:
            return f"missed its step deadline (env.limits.step_timeout_s = {limits.step_timeout_s:g} s)"
        text, err = reply[1], (reply[2] if len(reply) > 2 else None)
        limit = classify(text, err)
        if limit in ("memory_mb", "processes", "open_files", "file_mb"):
            return f"over env.limits.{limit} = {getattr(limits, limit)} ({text})"
        if limit:
            return f"denied by the sandbox's {limit} ({text})"
        return f"raised {text}"

    def _first_obs(self, i: int, seed: int | None):
        """Reset env ``i`` (replacing its child when the reset fails) -> its first observation."""
        while True:
            child = self._children[i]
            deadline = time.monotonic() + self.limits.step_timeout_s
            reply = child.recv(deadline) if child.send(("reset", seed)) else None
            if reply is not None and reply[0] == "ok":
                obs = child.obs(reply[1])
                self._last[i] = obs
                return obs
            self._fail(i, reply)
            seed = None

    # ------------------------------------------------------------------ the VectorEnv interface
    def reset(self, seed: int):
        """Env i is seeded ``seed + i`` (as gymnasium's vector envs do)."""
        self.episode_step[:] = 0
        observations = self._batch(self.num_envs)
        for i in range(self.num_envs):
            observations[i] = self._first_obs(i, None if seed is None else seed + i)
        return observations

    def reset_one(self, i: int):
        """Abandon env ``i``'s episode and start a new one."""
        self.episode[i] += 1
        self.episode_step[i] = 0
        return self._first_obs(i, None)

    def step(self, actions):
        """-> (observations, rewards, terminated, truncated, final observations {env: raw} of ended episodes).
        An env whose child failed ends its episode truncated at its last good observation (named in ``failed``)."""
        n = self.num_envs
        observations = self._batch(n)
        rewards = np.zeros(n, dtype=np.float32)
        terminated = np.zeros(n, dtype=bool)
        truncated = np.zeros(n, dtype=bool)
        finals: dict[int, object] = {}
        self.failed = set()
        sent = [child.send(("step", actions[i])) for i, child in enumerate(self._children)]
        deadline = time.monotonic() + self.limits.step_timeout_s
        failed_now = []
        for i, child in enumerate(self._children):
            reply = child.recv(deadline) if sent[i] else None
            if reply is None or reply[0] != "ok":
                self._count_failure(i, reply)
                failed_now.append(i)
                truncated[i] = True
                finals[i] = self._last[i]
                self.episode[i] += 1
                self.episode_step[i] = 0
                continue
            self.failures_in_a_row[i] = 0
            _, rewards[i], terminated[i], truncated[i], obs, final, cpu = reply
            observations[i] = self._last[i] = child.obs(obs)
            if terminated[i] or truncated[i]:
                finals[i] = child.obs(final, 1)
                self.episode[i] += 1
                self.episode_step[i] = 0
                if cpu is not None and self.limits.cpu_s:
                    self._next_cpu_budget(child, cpu)
            else:
                self.episode_step[i] += 1
        if failed_now:  # replaced together (one start for all), then each reset
            self._replace(failed_now)
            for i in failed_now:
                observations[i] = self._first_obs(i, None)
        return observations, rewards, terminated, truncated, finals

    def _next_cpu_budget(self, child: _Child, cpu_used: float) -> None:
        """The next episode's env.limits.cpu_s, counted from what the child has used so far."""
        soft = math.ceil(cpu_used) + self.limits.cpu_s
        try:
            resource.prlimit(child.pid, resource.RLIMIT_CPU, (soft, soft + 1))
        except (OSError, ValueError):  # gone already (its next step says so), or not ours to raise (not root)
            pass

    def close(self) -> None:
        for child in self._children:
            if child is not None:
                child.send(("close",))
        for child in self._children:
            if child is not None:
                child.kill()
        self._children = [None] * self.num_envs
        spare, self._spare = getattr(self, "_spare", None), None
        if spare is not None:
            spare[0].kill()
            spare[1].release()
        for claim in getattr(self, "_claims", ()):
            claim.release()


_SAID: set[str] = set()


if __name__ == "__main__":
    child_main(sys.argv[1:])
