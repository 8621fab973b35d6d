"""The sandbox tried as an attacker would (docs/sandbox.md, "Attacks"): each test runs one attack from
``tests/attack_env.py`` inside a real sandboxed child and fails if the attack works, on the host as well as in
what the child reports. An attack that works raises ``ATTACK WORKED: ...`` in the child, or leaves its mark on the
host (a file, a signal, a process, a memory held); the tests look for both, and for the failure being counted
and named like any other breach.

The limits are the breach tests' (tests/test_sandbox.py): low enough that a bomb meets them at once.
"""

import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from actors import sandbox_cgroup
from actors.sandbox import SandboxFailed, SandboxVectorEnv, _uid_pids
from tests.attack_env import ARMED, ATTACK_ID
from tests.conftest import ROOT

ATTACK = f"tests.attack_env:{ATTACK_ID}"
LIMITS = dict(memory_mb=320, cpu_s=5, processes=16, open_files=64, file_mb=8, step_timeout_s=2.0)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's namespaces and uids need root")
needs_cgroup = pytest.mark.skipif(bool(sandbox_cgroup.unavailable()),
                                  reason=f"no cgroups here: {sandbox_cgroup.unavailable()}")


@pytest.fixture
def host_dir():
    """A directory on the host that anyone may write (mode 1777), outside every tmpfs the sandbox mounts: only a
    read-only view of the host keeps a child's uid out of it."""
    d = Path(ROOT) / f".attack-{uuid.uuid4().hex[:12]}"
    d.mkdir()
    d.chmod(0o1777)
    yield d
    for p in sorted(d.rglob("*"), reverse=True):
        p.unlink() if not p.is_dir() or p.is_symlink() else p.rmdir()
    d.rmdir()


#: For the attacks that end in a missed deadline: one second is plenty for a CartPole step, and each such test
#: waits it out once.
SHORT_DEADLINE = dict(LIMITS, step_timeout_s=1.0)


def attacked(attack: str, target: str = "", steps: int = 5, at_step: int = 3, limits: dict = LIMITS,
             envs: int = 1) -> SandboxVectorEnv:
    """One sandboxed env whose child attacks at its step ``at_step``, stepped ``steps`` times, then closed."""
    env = SandboxVectorEnv(ATTACK, envs, env_kwargs={"attack": attack, "at_step": at_step, "target": target},
                           limits=limits)
    try:
        env.reset(seed=0)
        for _ in range(steps):
            env.step(np.zeros(envs, dtype=np.int64))
    finally:
        env.close()
    return env


def assert_contained(env: SandboxVectorEnv, named: str = "") -> None:
    assert "ATTACK WORKED" not in env.last_fault, env.last_fault
    assert env.fault_count >= 1, "the attack went unnoticed"
    assert named in env.last_fault, env.last_fault


# --------------------------------------------------------------------------- code from the child


@pytest.mark.parametrize("attack", ["pickle_obs", "pickle_frame"])
def test_a_pickle_in_a_reply_runs_nothing_in_the_parent(attack, host_dir):
    marker = host_dir / "unpickled"
    env = attacked(attack, str(marker))
    assert not marker.exists(), "the parent ran the child's pickle"
    assert_contained(env, "broke the sandbox's protocol")


def test_a_pickle_in_info_never_crosses(host_dir):
    marker = host_dir / "unpickled"
    env = attacked("pickle_info", str(marker))
    assert not marker.exists()
    assert env.fault_count == 0  # info is not carried at all: nothing to refuse


def test_a_space_with_a_reduce_arrives_as_plain_numbers(host_dir):
    import gymnasium as gym

    marker = host_dir / "unpickled"
    env = SandboxVectorEnv(ATTACK, 1, env_kwargs={"attack": "pickle_space", "target": str(marker)}, limits=LIMITS)
    env.close()
    assert type(env.single_observation_space) is gym.spaces.Box  # rebuilt here from its fields, not its class
    assert not marker.exists()


@pytest.mark.parametrize("attack, named", [
    ("object_dtype", "dtype 'object'"),
    ("gigabyte_space", "over 64 MiB"),
])
def test_a_space_that_is_code_or_too_large_is_refused_in_one_line(attack, named, host_dir):
    marker = host_dir / "unpickled"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(SandboxFailed) as refused:
        SandboxVectorEnv(ATTACK, 1, env_kwargs={"attack": attack, "target": str(marker)}, limits=LIMITS)
    assert named in str(refused.value) and "\n" not in str(refused.value)
    assert not marker.exists()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 200 * 1024  # KiB: nothing like 1 GiB mapped


def test_import_time_code_writes_nothing_on_the_host(host_dir):
    marker = host_dir / "imported"
    Path(ARMED).write_text(str(marker))
    try:
        env = SandboxVectorEnv(ATTACK, 1, limits=LIMITS)
        env.close()
    finally:
        os.unlink(ARMED)
    assert not marker.exists(), marker.read_text() if marker.exists() else ""


def test_constructor_code_writes_nothing_on_the_host(host_dir):
    marker = host_dir / "constructed"
    with pytest.raises(SandboxFailed, match="Read-only file system"):
        SandboxVectorEnv(ATTACK, 1, env_kwargs={"attack": "constructor", "target": str(marker)}, limits=LIMITS)
    assert not marker.exists()


# --------------------------------------------------------------------------- the wire


def test_a_gigabyte_frame_header_is_refused_before_anything_is_read():
    env = attacked("huge_frame")
    assert_contained(env, f"broke the sandbox's protocol (a frame of {2**30} bytes")


@pytest.mark.parametrize("attack", ["half_frame", "drip"])
def test_half_a_frame_or_a_drip_is_a_missed_deadline_not_a_hang(attack):
    t0 = time.monotonic()
    env = attacked(attack, steps=4, limits=SHORT_DEADLINE)
    assert_contained(env, "missed its step deadline")
    assert time.monotonic() - t0 < 30  # one deadline (1 s) per attack, not a wait per byte


def test_a_reply_sent_twice_is_a_breach():
    env = attacked("extra_reply")
    assert_contained(env, "a reply to command")


def test_a_child_cannot_shrink_the_shared_block_under_its_parent():
    env = attacked("shrink_block")  # the parent reads the block after every step: a SIGBUS would end this test
    assert_contained(env, "PermissionError")


def test_a_gigabyte_observation_fails_the_child_not_the_parent():
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    env = attacked("huge_obs")
    assert_contained(env, "raised ValueError: could not broadcast")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 200 * 1024


def test_an_observation_outside_its_space_is_a_breach():
    env = attacked("outside_space")
    assert_contained(env, "choice: 7 outside Discrete(3")


# --------------------------------------------------------------------------- memory and processes


@needs_cgroup
@pytest.mark.long  # seconds of waiting on the kernel or a deadline: make test-long
def test_forks_cannot_hold_more_memory_together_than_the_limit():
    env = attacked("fork_memory", steps=4)
    assert_contained(env)


@needs_cgroup
def test_a_memfd_counts_against_the_memory_limit():
    env = attacked("memfd", steps=4)
    assert_contained(env, "over env.limits.memory_mb")


def test_dev_shm_is_private_and_bounded():
    env = attacked("dev_shm")
    assert_contained(env, "over env.limits.file_mb")
    assert not os.path.exists("/dev/shm/hoard")


def test_a_system_v_segment_does_not_outlive_its_child():
    before = open("/proc/sysvipc/shm").read().count("\n")
    env = attacked("sysv_shm", steps=4)
    assert "ATTACK WORKED" not in env.last_fault
    assert open("/proc/sysvipc/shm").read().count("\n") == before  # the child's IPC namespace went with it


@pytest.mark.long  # seconds of waiting on the kernel or a deadline: make test-long
def test_cpu_spent_in_short_steps_meets_the_cpu_budget():
    """0.3 s of CPU a step, each far inside the step deadline, in an episode that never ends: env.limits.cpu_s
    (1 s) holds all the same (the parent reads the kernel's count; RLIMIT_CPU could not be moved forward here)."""
    t0 = time.monotonic()
    env = attacked("cpu_hog", steps=20, limits=dict(LIMITS, cpu_s=1))
    assert_contained(env, "over env.limits.cpu_s = 1 (CPUTimeExceeded")
    assert time.monotonic() - t0 < 20


# --------------------------------------------------------------------------- the host


def test_the_hosts_processes_are_not_in_its_proc():
    env = attacked("host_proc")
    assert_contained(env, "only")


def test_nothing_of_the_host_is_writable(host_dir):
    target = host_dir / "written"
    before = {p: os.path.exists(p) for p in ("/run/lock/ascent-attack", "/var/tmp/ascent-attack",
                                             "/dev/shm/ascent-attack", "/tmp/ascent-attack")}
    env = attacked("write_host", str(target))
    assert not target.exists()
    assert {p: os.path.exists(p) for p in before} == before
    assert "ATTACK WORKED" not in env.last_fault


def test_a_symlink_out_of_the_working_directory_reaches_nothing(host_dir):
    env = attacked("symlink", str(host_dir))
    assert not (host_dir / "ascent-attack").exists()
    assert_contained(env, "Read-only file system")


def test_rays_session_directory_and_sockets_are_out_of_reach():
    os.makedirs("/tmp/ray", exist_ok=True)  # what any Ray on this host has made
    env = attacked("ray_session")
    assert_contained(env, "no Ray session in reach")


def test_the_parent_cannot_be_signalled():
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(1))
    try:
        env = attacked("signal_parent", str(os.getpid()))
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert not received
    assert_contained(env, "no signal delivered")


def test_the_parent_cannot_be_traced():
    env = attacked("trace_parent", str(os.getpid()))
    assert_contained(env, "ptrace refused")


def test_no_way_back_to_root():
    env = attacked("regain_root")
    assert_contained(env, "no way back to root")


@needs_cgroup
def test_the_child_cannot_leave_its_cgroup():
    env = attacked("escape_cgroup")
    assert_contained(env, "cgroup files not writable")


def test_a_spin_in_c_with_signals_blocked_is_killed_at_its_deadline():
    t0 = time.monotonic()
    env = SandboxVectorEnv(ATTACK, 1, env_kwargs={"attack": "c_spin", "at_step": 2}, limits=SHORT_DEADLINE)
    uid = env._claims[0].uid
    try:
        env.reset(seed=0)
        for _ in range(3):
            env.step(np.zeros(1, dtype=np.int64))
        assert_contained(env, "missed its step deadline")
    finally:
        env.close()
    assert not _uid_pids(uid) and time.monotonic() - t0 < 30


# --------------------------------------------------------------------------- the parent's death


OWNER = textwrap.dedent("""
    import sys, time, numpy as np
    sys.path.insert(0, {root!r})
    from actors.sandbox import SandboxVectorEnv
    env = SandboxVectorEnv({attack_id!r}, 2, env_kwargs={{"attack": "escape_parent_death", "at_step": 1}},
                           limits={limits!r})
    env.reset(seed=0)
    env.step(np.zeros(2, dtype=np.int64))
    print(" ".join(str(c.uid) for c in env._claims), flush=True)
    env.step(np.zeros(2, dtype=np.int64))  # the envs sleep in this step: their children read nothing

""")


@pytest.mark.long  # seconds of waiting on the kernel or a deadline: make test-long
def test_a_sigkilled_owner_leaves_no_child_behind_not_even_a_daemon():
    owner = subprocess.Popen([sys.executable, "-c", OWNER.format(root=str(ROOT), attack_id=ATTACK,
                                                                  limits=dict(LIMITS, step_timeout_s=600))],
                             stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
    try:
        uids = [int(u) for u in owner.stdout.readline().split()]
        assert len(uids) == 2 and all(_uid_pids(u) for u in uids)  # each env's process, and its daemon
        time.sleep(0.5)  # into the step that never ends
        owner.kill()
        owner.wait(timeout=10)
        deadline = time.monotonic() + 5
        while any(_uid_pids(u) for u in uids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_uid_pids(u) for u in uids), "processes outlived their owner"
    finally:
        owner.kill()
