"""env.isolation: process (actors/sandbox.py): each breach an env may attempt, injected into real gymnasium envs in
real sandboxed children, is contained, counted with its limit named, and the vector env (and a training run) goes
on; the same breaches under env.isolation: none do what they do, for the ones that cannot take the host down.

Each breach happens at the third step of every child (tests/breach_env.py), so one step past it shows the
replacement at work. The limits are set low so a breach is met in well under a second of its own.
"""

import json
import os
import socket
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from actors.envs import make_vector_env
from actors.sandbox import Limits, SandboxVectorEnv, _uid_pids, host_note
from cluster import config as config_mod
from tests.breach_env import BREACH_ID
from tests.conftest import ROOT, train_to_end

BREACH = f"tests.breach_env:{BREACH_ID}"
#: Low enough that a bomb reaches it at once (an idle child maps ~120 MiB), high enough for numpy and gymnasium.
TEST_LIMITS = dict(memory_mb=320, cpu_s=5, processes=16, open_files=64, file_mb=8, step_timeout_s=2.0)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="uids and namespaces of their own need root")


def breached(breach: str, target: str = "", steps: int = 6):
    """One sandboxed env that breaches at step 3, stepped ``steps`` times -> (the env, the steps where its child
    failed, the most processes any of its uids held right after a failure). The env is closed."""
    env = SandboxVectorEnv(BREACH, 1, env_kwargs={"breach": breach, "at_step": 3, "target": target},
                           limits=TEST_LIMITS)
    failed_at, most = [], 0
    try:
        first = env.reset(seed=0)
        assert first.shape == (1, 4)
        for t in range(steps):
            obs, rew, term, trunc, finals = env.step(np.zeros(1, dtype=np.int64))
            assert obs.shape == (1, 4) and np.isfinite(obs).all()  # the replacement's first observation
            if env.failed:
                failed_at.append(t)
                assert trunc[0] and not term[0] and rew[0] == 0.0 and 0 in finals  # cut, not ended
                # The new child and the spare: one process each; the failed one's are gone with it. The spare has
                # just been started (under the failed child's uid) and may be between its processes for a moment:
                # counted once the counts settle, within 5 s (a fork bomb's survivors would not).
                uids = [c.uid for c in env._claims] + [env._spare[1].uid]
                settle = time.monotonic() + 5
                while (count := max(len(_uid_pids(u)) for u in uids)) > 1 and time.monotonic() < settle:
                    time.sleep(0.05)
                most = max(most, count)
    finally:
        env.close()
    return env, failed_at, most


def test_the_child_holds_nothing_of_the_parent_and_its_limits_are_set(tmp_path):
    # An env that reports what it sees: a probe wrapper is overkill; read the child's /proc while it waits.
    env = SandboxVectorEnv("CartPole-v1", 1, limits=TEST_LIMITS)
    try:
        pid = env._children[0].pid
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        names = {e.split(b"=")[0].decode() for e in environ if e}
        assert not [n for n in names if n.startswith("RAY_") or "TOKEN" in n.upper()]
        limits = open(f"/proc/{pid}/limits").read()
        assert "320" in [line.split()[3] for line in limits.splitlines() if line.startswith("Max address space")][0] \
            or str(320 * 2**20) in limits
        assert str(TEST_LIMITS["processes"]) in [l for l in limits.splitlines() if l.startswith("Max processes")][0]
        assert [l for l in limits.splitlines() if l.startswith("Max core file size")][0].split()[4] == "0"
        maps = open(f"/proc/{pid}/maps").read()
        assert "/ray/" not in maps and "_raylet" not in maps  # no Ray module loaded
        if os.geteuid() == 0:
            status = open(f"/proc/{pid}/status").read()
            uid = int([l for l in status.splitlines() if l.startswith("Uid:")][0].split()[1])
            assert uid == env._claims[0].uid and uid >= 1_500_000_000
            assert os.readlink(f"/proc/{pid}/cwd") == "/tmp/work"  # its own, in its own /tmp
            assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
            assert os.readlink(f"/proc/{pid}/ns/pid") != os.readlink("/proc/self/ns/pid")
    finally:
        env.close()


@needs_root
@pytest.mark.parametrize("breach, named", [
    ("memory", "over env.limits.memory_mb = 320 (MemoryError"),
    ("fork", "over env.limits.processes = 16 (BlockingIOError"),
    ("loop", "missed its step deadline (env.limits.step_timeout_s = 2 s)"),
    ("segfault", "died (killed by SIGSEGV)"),
])
def test_a_breach_against_a_limit_is_contained_counted_and_replaced(breach, named):
    env, failed_at, most = breached(breach, steps=5)
    # Step 3 of the first child (t = 2) breaches; its replacement starts afresh and breaches at its own step 3.
    assert failed_at == [2] and env.fault_count == 1
    assert named in env.last_fault and env.last_fault.startswith("env 0 ")
    assert most == 1  # a fork bomb's processes went with its child


@needs_root
def test_a_write_outside_the_working_directory_is_refused():
    target = os.path.expanduser(f"~/ascent-escaped-{uuid.uuid4().hex}")
    env, failed_at, _ = breached("write", target)
    assert failed_at and "denied by the sandbox's file system (PermissionError" in env.last_fault
    assert not os.path.exists(target)


@needs_root
def test_a_network_connection_finds_no_network():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        env, failed_at, _ = breached("network", f"127.0.0.1:{server.getsockname()[1]}")
        with pytest.raises(socket.timeout):
            server.accept()  # nobody came
    assert failed_at and "denied by the sandbox's network (OSError: [Errno 101]" in env.last_fault


@needs_root
def test_the_cluster_token_is_not_there_to_read(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "s3cret-of-the-cluster")
    env, failed_at, _ = breached("token")
    # Nothing in its environment or home: it got as far as its parent's environment, which it may not read.
    assert failed_at and "PermissionError" in env.last_fault and "environ" in env.last_fault
    assert "s3cret" not in env.last_fault


def test_under_none_the_same_breaches_reach_the_host(monkeypatch):
    """What env.isolation: none leaves open (docs/sandbox.md); the bombs are left out: they would take the host."""
    target = os.path.expanduser(f"~/ascent-escaped-{uuid.uuid4().hex}") if os.geteuid() == 0 else \
        f"/tmp/ascent-escaped-{uuid.uuid4().hex}"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "s3cret-of-the-cluster")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(5)
        outcomes = {}
        for breach, where in (("write", target), ("network", f"127.0.0.1:{server.getsockname()[1]}"),
                              ("token", "")):
            env = make_vector_env(BREACH, 1, env_kwargs={"breach": breach, "at_step": 1, "target": where})
            env.reset(seed=0)
            try:
                env.step(np.zeros(1, dtype=np.int64))
                outcomes[breach] = "no error"
            except Exception as e:  # noqa: BLE001 - under none the env's error is the actor's
                outcomes[breach] = str(e)
            finally:
                env.close()
        conn, _ = server.accept()
        assert conn.recv(64).startswith(b"hello from inside an env")
        conn.close()
    try:
        assert os.path.exists(target) and outcomes["write"] == "no error"
    finally:
        if os.path.exists(target):
            os.remove(target)
    assert "s3cret-of-the-cluster" in outcomes["token"]


def test_an_env_that_always_fails_ends_as_the_actors_fault():
    from actors.sandbox import REPEAT_FAILURES, SandboxFailed

    env = SandboxVectorEnv(BREACH, 1, env_kwargs={"breach": "segfault", "at_step": 1}, limits=TEST_LIMITS)
    try:
        env.reset(seed=0)
        with pytest.raises(SandboxFailed, match=f"{REPEAT_FAILURES} sandboxed children in a row failed"):
            for _ in range(REPEAT_FAILURES + 1):
                env.step(np.zeros(1, dtype=np.int64))
    finally:
        env.close()


def test_an_env_that_cannot_be_made_is_one_config_line():
    from actors.envs import describe_env

    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), ["env.id=NoSuchEnv-v9", "env.isolation=process"])
    with pytest.raises(config_mod.ConfigError, match=r"env.id: 'NoSuchEnv-v9' cannot be made.*in its sandbox"):
        describe_env(cfg.env.id, isolation=cfg.env.isolation_args(), **cfg.env.make_args())


@pytest.mark.parametrize("override, message", [
    ("env.isolation=container", "env.isolation: 'container' is not allowed; allowed: none, process"),
    ("env.limits.memory_mb=8", "env.limits.memory_mb: 8 is out of range"),
    ("env.limits.step_timeout_s=0", "env.limits.step_timeout_s: 0"),
    ("env.limits.nproc=4", "env.limits.nproc: unknown key"),
])
def test_bad_isolation_settings_are_one_line_errors(override, message):
    with pytest.raises(config_mod.ConfigError) as e:
        config_mod.load(str(ROOT / "configs/cartpole.yaml"), [override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_run_counts_its_crashing_envs_and_goes_on(tmp_path):
    """Every child segfaults after 100 steps of its own: the actor replaces them and the run ends on its steps."""
    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        f"env.id={BREACH}", "env.kwargs.breach=segfault", "env.kwargs.at_step=100", "env.isolation=process",
        "rollout.envs_per_actor=2", "rollout.fragment_length=64", "learner.batch_size=256",
        "learner.minibatch_size=128", "run.require_target=false", "run.target_return=null",
        "run.total_env_steps=512", "run.checkpoint_interval_s=null", "ray.address=inprocess",
        "run.stall_timeout_s=60", "rollout.max_env_failures=0"])
    result = train_to_end(cfg, tmp_path / "run")
    assert result.reason == "total_env_steps"
    last = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")][-1]
    # 512 steps over 2 envs: 256 each, a crash every 100 of them; not one cost the actor (a budget of 0 faults).
    assert last["env_failures"] >= 4 and last["rollout_restarts"] == 0
    assert last["last_rollout_fault"].startswith("rollout actor 0 env ") and "SIGSEGV" in last["last_rollout_fault"]


@pytest.mark.long  # a learning run to a threshold: `make test-long`; the isolation itself is held by the tests above
def test_the_code_env_learns_in_its_sandbox(tmp_path):
    """configs/code.yaml in small: two tasks, one-instruction programs (loop, grow, fork and write among the
    choices), to a mean of 0.8 hidden tests passed; a random policy passes ~0.1 (bench/sandbox_cost.py --learn has
    the full task set)."""
    cfg = config_mod.load(str(ROOT / "configs/code.yaml"), [
        "env.kwargs.tasks=2", "env.kwargs.max_len=1", "rollout.fragment_length=16", "learner.batch_size=128",
        "learner.minibatch_size=64", "learner.lr=3e-3", "run.total_env_steps=8192", "run.target_return=0.8",
        "run.checkpoint_interval_s=null", "ray.address=inprocess"])
    result = train_to_end(cfg, tmp_path / "run")
    assert result.reached_target, result
    means = [r["episode_return_mean"] for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl"))
             if r.get("episode_return_mean") is not None]
    assert means[0] < 0.5  # it started near chance: the target was learned, not given


@pytest.mark.long
def test_a_run_with_a_crashing_env_reaches_its_target(tmp_path):
    """Every child segfaults after 600 steps of its own; the actor replaces them, the run learns CartPole."""
    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        f"env.id={BREACH}", "env.kwargs.breach=segfault", "env.kwargs.at_step=600", "env.isolation=process",
        "rollout.envs_per_actor=8", "rollout.fragment_length=64", "run.target_return=120",
        "run.total_env_steps=120000", "run.checkpoint_interval_s=null", "ray.address=inprocess",
        "run.stall_timeout_s=60", "rollout.max_env_failures=1"])
    result = train_to_end(cfg, tmp_path / "run")
    assert result.reached_target, result
    last = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")][-1]
    # Counted, named, and none of them cost the actor (one actor fault would be over the budget of 1... plus one).
    assert last["env_failures"] >= 8 and last["rollout_restarts"] == 0
    assert "env " in last["last_rollout_fault"] and "SIGSEGV" in last["last_rollout_fault"]


@needs_root
@pytest.mark.long
@pytest.mark.parametrize("breach, target, named", [
    ("memory", "", "over env.limits.memory_mb = 320"),
    ("fork", "", "over env.limits.processes = 16"),
    ("loop", "", "missed its step deadline"),
    ("segfault", "", "SIGSEGV"),
    ("write", "~/ascent-escaped-run", "denied by the sandbox's file system"),
    ("network", "127.0.0.1:9", "denied by the sandbox's network"),
    ("token", "", "denied by the sandbox's file system"),
])
def test_a_run_whose_env_breaches_reaches_its_target(breach, target, named, tmp_path, monkeypatch):
    """Each breach in a training run: every child of 8 envs attempts it after 600 of its own steps, all through
    training; each attempt is contained and counted (the limit named), no actor is replaced, and CartPole is
    learned to 120 all the same. The cluster's token is in the actor's environment for the whole run."""
    monkeypatch.setenv("RAY_AUTH_TOKEN", "s3cret-of-the-cluster")
    target = os.path.expanduser(target) if target.startswith("~") else target
    limits = [f"env.limits.{k}={v}" for k, v in TEST_LIMITS.items()]
    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        f"env.id={BREACH}", f"env.kwargs.breach={breach}", "env.kwargs.at_step=600", f"env.kwargs.target={target}",
        "env.isolation=process", *limits, "rollout.envs_per_actor=8", "rollout.fragment_length=64",
        "run.target_return=120", "run.total_env_steps=120000", "run.checkpoint_interval_s=null",
        "ray.address=inprocess", "run.stall_timeout_s=60", "rollout.max_env_failures=0"])
    result = train_to_end(cfg, tmp_path / "run")
    assert result.reached_target, (breach, result)
    last = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")][-1]
    assert last["env_failures"] >= 8 and last["rollout_restarts"] == 0, (breach, last)
    assert named in last["last_rollout_fault"] and "s3cret" not in last["last_rollout_fault"], last
    if breach == "write":
        assert not os.path.exists(target)


def test_host_note_is_one_line():
    assert "\n" not in host_note()
    assert Limits().cpu_s and Limits().memory_mb


def test_a_failed_childs_episode_is_cut_bootstrapped_and_dropped_from_the_statistics():
    """3-step episodes, each child segfaulting at its 5th step (the 2nd step of its 2nd episode): of 12 steps,
    episodes A (steps 1-3) and C (6-8) are reported; B (4-5) and D (9-10) are cut at their last good observation."""
    import functools

    import torch  # noqa: F401 - the policy's

    from actors.sampler import RolloutSampler, SamplerSettings
    from learner.model import ActorCritic
    from pipeline import fragment as F
    from tests.conftest import env_spec
    from tests.test_sampler import constant_value_policy

    c, gamma = 2.0, 0.9
    spec = env_spec("CartPole-v1", 3)
    s = RolloutSampler(SamplerSettings(env_id=BREACH, num_envs=1, fragment_length=12, gamma=gamma, gae_lambda=0.5,
                                       seed=0, max_episode_steps=3, env_kwargs={"breach": "segfault", "at_step": 5},
                                       isolation={"limits": TEST_LIMITS}), functools.partial(ActorCritic, spec))
    try:
        s.load_weights(0, constant_value_policy(spec, c))
        frag = s.collect()
        assert list(frag.episode_lengths) == [3, 3]
        assert s.episodes_dropped == 2 and s.env_faults()[0] == 2 and "SIGSEGV" in s.env_faults()[1]
        trunc, term = frag.arrays[F.TRUNCATED][:, 0], frag.arrays[F.TERMINATED][:, 0]
        assert list(np.flatnonzero(trunc)) == [2, 4, 7, 9] and not term.any()
        # The cut steps: no reward, bootstrapped from V of the last good observation (c here).
        assert np.allclose(frag.arrays[F.REWARDS][[4, 9], 0], 0.0)
        assert np.allclose(frag.arrays[F.ADVANTAGES][[4, 9], 0], gamma * c - c)
    finally:
        s.close()


@pytest.mark.parametrize("env_id", [
    "CartPole-v1",
    "actors.probe_envs:AscentRL/Match-MultiDiscrete-v0",
    "actors.probe_envs:AscentRL/Match-MultiBinary-v0",
    "actors.probe_envs:AscentRL/Match-Box2D-v0",
    "actors.probe_envs:AscentRL/Match-Hybrid-v0",  # a Dict action: it travels in the command, not the block
    "actors.probe_envs:AscentRL/MaskedChoice-v0",  # Dict observations with an action mask
    "actors.multirate_env:AscentRL/MultiRateSensor-v0",  # Dict with text and PNG bytes
])
def test_a_sandboxed_vector_env_steps_as_the_in_process_one(env_id):
    """Same seeds, same actions: the same observations, rewards, flags and final observations under process (one
    env per child, and all three in one child) as under none, for every kind of action and observation the wire
    carries."""
    envs = [make_vector_env(env_id, 3)] + [make_vector_env(env_id, 3, isolation={"limits": TEST_LIMITS,
                                                                                  "envs_per_child": k})
                                            for k in (1, 3)]

    def same(a, b):
        if isinstance(a, dict):
            assert a.keys() == b.keys()
            for key in a:
                same(a[key], b[key])
        elif isinstance(a, (str, bytes)):
            assert a == b
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    try:
        space = envs[0].single_action_space
        space.seed(0)
        firsts = [env.reset(seed=5) for env in envs]
        for first in firsts[1:]:
            for i in range(3):
                same(firsts[0][i], first[i])
        for _ in range(40):
            actions = [space.sample() for _ in range(3)]
            if not isinstance(actions[0], dict):
                actions = np.stack(actions)
            results = [env.step(actions) for env in envs]
            for result in results[1:]:
                for i in range(3):
                    same(results[0][0][i], result[0][i])
                for k in (1, 2, 3):
                    np.testing.assert_array_equal(results[0][k], result[k])
                assert results[0][4].keys() == result[4].keys()
                for i in results[0][4]:
                    same(results[0][4][i], result[4][i])
        assert all(env.fault_count == 0 for env in envs[1:])
    finally:
        for env in envs:
            env.close()


def _processes(field: str) -> dict[int, int]:
    """{pid: the first number of ``field`` in its /proc/<pid>/status} for every process of the host."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                found[int(name)] = int([l for l in open(f"/proc/{name}/status")
                                        if l.startswith(f"{field}:")][0].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return found


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (its sandboxed children, their namespaces' inits and envs)."""
    children: dict[int, list[int]] = {}
    for child, ppid in _processes("PPid").items():
        children.setdefault(ppid, []).append(child)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@needs_root
@pytest.mark.long  # a training run on Ray with an actor replaced: the sandbox's own tests above stay in make test
def test_a_sigkilled_rollout_actor_on_ray_leaves_no_sandboxed_child_and_the_run_goes_on(ray_local, tmp_path):
    """Two rollout actors on a real Ray under env.isolation: process; actor 0 is SIGKILLed mid-run. Its children
    (its envs, their namespaces' inits) are gone within seconds, however busy the host, and the actor is replaced
    and the run ends on its steps."""
    from cluster.driver import Trainer
    from tests.conftest import build_and_run_striking, wait_for_records
    from tests.test_faults import pid_of

    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "env.isolation=process", "rollout.num_actors=2", "rollout.envs_per_actor=2", "rollout.fragment_length=64",
        "learner.batch_size=256", "learner.minibatch_size=128", "run.require_target=false",
        "run.target_return=null", "run.total_env_steps=6000", "run.checkpoint_interval_s=null",
        "run.stall_timeout_s=60"])
    left: list = []

    def strike(trainer):
        wait_for_records(tmp_path / "run", 2)
        actor = pid_of(trainer.rollouts[0])
        children = _descendants(actor)
        os.kill(actor, 9)
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        left.extend([p for p in children if _alive(p)] + ([] if children else ["no children found"]))

    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    try:
        result = build_and_run_striking(trainer, strike)
    finally:
        trainer.shutdown()
    assert not left, f"outlived their SIGKILLed actor: {left}"
    last = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")][-1]
    assert result.reason == "total_env_steps" and last["rollout_restarts"] >= 1


def _sandboxed_pids() -> list[int]:
    from actors.sandbox import UID_BASE, UID_COUNT

    return [pid for pid, uid in _processes("Uid").items() if UID_BASE <= uid < UID_BASE + UID_COUNT and _alive(pid)]


@needs_root
@pytest.mark.long  # a whole `python -m cluster.train` on its embedded Ray
def test_a_sigkilled_driver_leaves_no_sandboxed_child(tmp_path):
    """The CLI's default job under env.isolation: process, its driver SIGKILLed once it has trained: Ray ends the
    rollout actors, and their children follow (the lifeline) within seconds."""
    run_dir = tmp_path / "run"
    driver = subprocess.Popen(
        [sys.executable, "-m", "cluster.train", "--config", "configs/cartpole.yaml", "--run-dir", str(run_dir),
         "--set", "env.isolation=process", "--set", "run.total_env_steps=10000000", "--set", "run.target_return=null",
         "--set", "run.require_target=false"], cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        from tests.conftest import wait_for_records

        wait_for_records(run_dir, 2)
        below = _descendants(driver.pid)  # its embedded Ray's raylet, the workers, their envs' children
        children = [p for p in _sandboxed_pids() if p in below]
        assert children
        driver.kill()
        driver.wait(timeout=10)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in children if _alive(p)], "sandboxed children outlived their SIGKILLed driver"
    finally:
        driver.kill()


@needs_root
def test_children_of_uneven_groups_fail_together_and_are_replaced():
    """5 envs, 2 a child: children of 2, 2 and 1 envs. Every child segfaults at its third step: each is counted
    once, every env's episode is cut, the replacements (the spare among them) step on and fail in turn, and nothing
    of any of them is left."""
    env = SandboxVectorEnv(BREACH, 5, env_kwargs={"breach": "segfault", "at_step": 3}, limits=TEST_LIMITS,
                           envs_per_child=2)
    assert env.groups == [(0, 2), (2, 2), (4, 1)]
    failed_at = []
    try:
        env.reset(seed=0)
        for t in range(6):
            obs, rew, term, trunc, finals = env.step(np.zeros(5, dtype=np.int64))
            assert obs.shape == (5, 4) and np.isfinite(obs).all()
            if env.failed:
                failed_at.append(t)
                assert env.failed == {0, 1, 2, 3, 4} and trunc.all() and sorted(finals) == [0, 1, 2, 3, 4]
        uids = [c.uid for c in env._claims] + [env._spare[1].uid]
    finally:
        env.close()
    assert failed_at == [2, 5] and env.fault_count == 6 and "SIGSEGV" in env.last_fault
    assert not any(_uid_pids(u) for u in uids)


def test_an_env_module_on_an_import_path_below_tmp_is_importable_in_the_child():
    """The child sees /tmp and the home as empty private tmpfs; the folders on its import path (the PYTHONPATH it is
    given: a clone, its venv, a user's env folder) are bound back read-only where they lie below one of them. A
    project cloned into /tmp or the home, or an env folder there, imports in the child as where nothing is hidden."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="env-folder-", dir="/tmp")
    os.chmod(folder, 0o755)  # readable by the child's uid, as a user's own folder is
    module = f"tmp_env_{uuid.uuid4().hex[:8]}"
    with open(os.path.join(folder, f"{module}.py"), "w") as f:
        f.write("import gymnasium as gym\n"
                "from gymnasium.envs.classic_control.cartpole import CartPoleEnv\n"
                "gym.register(id='TmpCartPole-v0', entry_point=CartPoleEnv, max_episode_steps=50)\n")
    os.chmod(os.path.join(folder, f"{module}.py"), 0o644)
    sys.path.insert(0, folder)
    env = None
    try:
        env = make_vector_env(f"{module}:TmpCartPole-v0", 2, isolation={"limits": TEST_LIMITS, "envs_per_child": 2})
        obs, _ = env.reset(seed=0)
        obs, reward, *_ = env.step(np.zeros(2, dtype=np.int64))
        assert obs.shape == (2, 4) and list(reward) == [1.0, 1.0]
    finally:
        if env is not None:
            env.close()
        sys.path.remove(folder)
        shutil.rmtree(folder, ignore_errors=True)
