"""env.isolation: process: the env's code runs only in its sandboxed children (issue 54, item 2). No driver, rollout
actor, learner, evaluator, preprocess worker, ``--dry-run``, ``load_policy``, ``Policy.make_env`` or
``cluster.evaluate`` imports the env's module (a ``module:Id`` id), its wrappers (env.wrappers) or a multi-agent
env's module, or makes the env: the spaces come from a child.

The env and wrapper modules below are written by the test. Their import-time code, the env's constructor and the
wrapper's call each write a marker file named for what ran and the process it ran in, holding ``host``, or
``child`` in a sandboxed child (``ASCENT_SANDBOX``). The markers go to a host path under /tmp, which a child with
its own mount namespace does not see (its /tmp is a private tmpfs) and which its uid could not write anyway: so
under ``process`` no ``host`` marker may appear, and under full isolation no marker at all; under ``none`` the
same calls leave ``host`` markers, the control that shows the markers work. The modules themselves live in an
ignored folder of their own at the repository's root (``.env-code-test-*``, removed afterwards), since a child sees
none of the host's /tmp and must import them; not under ``runs/``, which other tests' runs share and which a
``ray job submit`` of the repository must not find.
"""

import os
import shutil
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest

from cluster import config as config_mod
from tests.conftest import ROOT

# One xdist_group (`make test` runs --dist loadgroup): its module fixtures' sandboxed runs made once, on one
# worker.
pytestmark = pytest.mark.xdist_group("env_code_stays_in_child")

LIMITS = {"limits": dict(memory_mb=1024, cpu_s=60, processes=16, open_files=64, file_mb=64, step_timeout_s=10.0)}

MARKER = """
import os

MARKS = {marks!r}


def mark(what):
    try:
        with open(os.path.join(MARKS, f"{{what}}-{{os.getpid()}}"), "w") as f:
            f.write("child" if os.environ.get("ASCENT_SANDBOX") else "host")
    except OSError:  # a sandboxed child: the host's path is not there for it, nor writable by its uid
        pass
"""

ENV_MODULE = MARKER + """
import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

mark("import-{name}")


class Marked(CartPoleEnv):
    def __init__(self, **kwargs):
        mark("make-{name}")
        super().__init__(**kwargs)


class MarkedDict(gym.Env):
    \"\"\"CartPole's observation as a Dict of one key (a multimodal env, for the preprocess workers).\"\"\"

    def __init__(self):
        mark("make-{name}")
        self.inner = CartPoleEnv()
        self.observation_space = gym.spaces.Dict({{"vec": self.inner.observation_space}})
        self.action_space = self.inner.action_space

    def reset(self, *, seed=None, options=None):
        obs, info = self.inner.reset(seed=seed)
        return {{"vec": obs}}, info

    def step(self, action):
        obs, *rest = self.inner.step(action)
        return ({{"vec": obs}}, *rest)


gym.register("{env}-v0", entry_point=Marked, max_episode_steps=200)
gym.register("{env}Dict-v0", entry_point=MarkedDict, max_episode_steps=200)
"""

WRAPPER_MODULE = MARKER + """
mark("import-{name}")


def wrap(env):
    mark("wrap-{name}")
    return env
"""

# A PettingZoo env module's shape (an attribute with an ``env`` factory), which only its import can reveal.
MULTIAGENT_MODULE = MARKER + """
mark("import-{name}")


class game:
    @staticmethod
    def env(**kwargs):
        mark("make-{name}")
        raise RuntimeError("a sandboxed env is single-agent: this game is refused before it is made")
"""


class Code:
    """The written modules and where their markers go."""

    def __init__(self, code_dir, marks):
        self.dir, self.marks = code_dir, marks
        for name, source, fields in (
                ("marked_env", ENV_MODULE, {"env": "Marked"}),
                ("marked_wrapper", WRAPPER_MODULE, {}),
                ("marked_ma", MULTIAGENT_MODULE, {}),
                # The control's own modules: once the control imports them here, they stay in sys.modules.
                ("control_env", ENV_MODULE, {"env": "Control"}),
                ("control_wrapper", WRAPPER_MODULE, {})):
            (code_dir / f"{name}.py").write_text(source.format(marks=str(marks), name=name, **fields))

    def clear(self):
        for p in self.marks.iterdir():
            p.unlink()

    def found(self) -> dict:
        """{marker name: 'host' or 'child'}."""
        return {p.name: p.read_text() for p in self.marks.iterdir()}

    def host(self) -> list:
        """What ran outside a sandboxed child: markers, and the test's modules loaded in this process."""
        loaded = [m for m in ("marked_env", "marked_wrapper", "marked_ma") if m in sys.modules]
        return sorted(name for name, where in self.found().items() if where == "host") + loaded

    def isolated(self) -> bool:
        """Whether a child has a /tmp of its own (root with namespaces): then it leaves no marker at all."""
        from actors.sandbox import host_note

        return os.geteuid() == 0 and not host_note()


ENV_ID = "marked_env:Marked-v0"
WRAPPERS = [{"path": "marked_wrapper:wrap", "kwargs": {}}]


@pytest.fixture(scope="module")
def code(tmp_path_factory):
    # Readable by a child's uid (0755 folders, 0644 files), writable by none but this one.
    code_dir = ROOT / f".env-code-test-{uuid.uuid4().hex[:8]}"
    code_dir.mkdir()
    os.chmod(code_dir, 0o755)
    marks = tmp_path_factory.mktemp("marks")
    sys.path.insert(0, str(code_dir))  # children get this process's sys.path as their PYTHONPATH
    try:
        yield Code(code_dir, marks)
    finally:
        sys.path.remove(str(code_dir))
        shutil.rmtree(code_dir, ignore_errors=True)


def dry_run(code, tmp_path, env_id, wrapper, isolation):
    """``python -m cluster.train --config X --dry-run`` in a process of its own."""
    cfg = tmp_path / f"{isolation}.yaml"
    cfg.write_text(textwrap.dedent(f"""\
        env:
          id: {env_id}
          wrappers: [{{path: {wrapper}}}]
          isolation: {isolation}
        """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(code.dir), str(ROOT)]))
    return subprocess.run([sys.executable, "-m", "cluster.train", "--config", str(cfg), "--dry-run"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


def test_under_none_the_env_code_runs_here_and_leaves_its_markers(code, tmp_path):
    """The control: the same calls under env.isolation: none import and make the env in this process."""
    from actors.envs import describe_env

    code.clear()
    describe_env("control_env:Control-v0", wrappers=[{"path": "control_wrapper:wrap", "kwargs": {}}])
    pid = os.getpid()
    assert {f"{what}-{pid}" for what in ("import-control_env", "make-control_env", "import-control_wrapper",
                                         "wrap-control_wrapper")} <= set(code.found()), code.found()
    assert set(code.found().values()) == {"host"}

    code.clear()
    out = dry_run(code, tmp_path, "control_env:Control-v0", "control_wrapper:wrap", "none")
    assert out.returncode == 0, out.stderr
    found = code.found()
    assert {n.rsplit("-", 1)[0] for n, where in found.items() if where == "host"} == {
        "import-control_env", "make-control_env", "import-control_wrapper", "wrap-control_wrapper"}, found
    assert not [n for n in found if n.endswith(f"-{pid}")]  # the subprocess's, not this process's


def test_dry_run_under_process_makes_the_env_in_a_child_only(code, tmp_path):
    code.clear()
    out = dry_run(code, tmp_path, ENV_ID, WRAPPERS[0]["path"], "process")
    assert out.returncode == 0, out.stderr
    assert ("# env.id 'marked_env:Marked-v0': observation vector: vector Box(4) float32, action Discrete(2)"
            in out.stdout)
    assert [n for n, where in code.found().items() if where == "host"] == [], code.found()
    if code.isolated():
        assert code.found() == {}


def test_describe_env_under_process_makes_the_env_in_a_child_only(code):
    from actors.envs import describe_env

    code.clear()
    description = describe_env(ENV_ID, wrappers=WRAPPERS, isolation=LIMITS)
    assert description["action_space"] == "Discrete(2)" and description["modalities"][0]["shape"] == (4,)
    assert code.host() == []
    if code.isolated():
        assert code.found() == {}


def test_a_preprocess_worker_under_process_reads_its_space_from_a_child(code, tmp_path):
    """A remote preprocess worker (preprocess.remote_actors, a Dict env's slow modalities) as the graph makes it."""
    from cluster import placement
    from cluster.graph import ActorGraph
    from pipeline import runtime

    code.clear()
    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "env.id=marked_env:MarkedDict-v0", "env.modalities.vec.kind=vector", "env.modalities.vec.rate=every",
        "env.modalities.vec.every=2", "env.isolation=process", "preprocess.remote_actors=1", "ray.address=inprocess"])
    graph = ActorGraph(cfg, None, say=print)  # never built: no run files
    graph.plan = placement.local_plan(cfg)
    worker = graph.make_preprocess_worker(0)
    try:
        out = runtime.get(worker.process.remote("vec", [np.zeros(4, np.float32), np.ones(4, np.float32)]),
                          timeout=60)
    finally:
        runtime.kill(worker)
    assert out.shape == (2, 4)
    assert code.host() == [], code.found()


def test_a_multiagent_env_under_process_is_refused_without_importing_it(code):
    from actors.envs import describe_env

    code.clear()
    # A PettingZoo module of the user's: only importing it tells, so its child refuses it, in one line.
    with pytest.raises(config_mod.ConfigError) as e:
        describe_env("marked_ma:game", isolation=LIMITS)
    assert str(e.value) == ("env.isolation: process runs single-agent gymnasium envs, and 'marked_ma:game' is a "
                            "PettingZoo env; allowed: env.isolation: none")
    assert code.host() == [] and not [n for n in code.found() if n.startswith("make-")]
    # A multiagent setting says it from the config alone: no child starts.
    with pytest.raises(config_mod.ConfigError) as e:
        describe_env("marked_ma:game", isolation=LIMITS, multiagent={"opponent": "random"})
    assert str(e.value).startswith("env.isolation: process runs single-agent gymnasium envs, and "
                                   "multiagent.opponent: 'random' is set") and "\n" not in str(e.value)
    assert code.host() == []


@pytest.fixture(scope="module")
def sandboxed_run(code, tmp_path_factory):
    """One short in-process run under process (the driver, the rollout actor and the learner: threads of this
    process), with the markers it left."""
    from cluster.api import train

    code.clear()
    run_dir = tmp_path_factory.mktemp("run") / "run"
    result = train(ROOT / "configs/cartpole.yaml", run_dir=run_dir, **{
        "env.id": ENV_ID, "env.wrappers": WRAPPERS, "env.isolation": "process", "ray.address": "inprocess",
        "rollout.envs_per_actor": 2, "rollout.fragment_length": 64, "learner.batch_size": 256,
        "learner.minibatch_size": 128, "ppo.update_epochs": 1, "run.total_env_steps": 512,
        "run.require_target": False, "run.target_return": None, "run.checkpoint_interval_s": None,
        "run.stall_timeout_s": 60})
    return result, code.host(), code.found()


def test_a_run_under_process_makes_its_envs_in_children_only(sandboxed_run, code):
    result, host, found = sandboxed_run
    assert result.reason == "total_env_steps" and result.env_steps >= 512
    assert host == [], found
    if code.isolated():
        assert found == {}


def test_the_periodic_evaluator_of_a_sandboxed_run_plays_in_children(sandboxed_run, code):
    """The evaluator as the graph makes it (``ActorGraph.make_evaluator``'s sampler settings), scoring the run's
    final weights: a run's own evaluation may still be under way when a short run ends."""
    import torch

    from actors.evaluator import Evaluator
    from cluster import checkpoint
    from cluster.graph import ActorGraph, describe_env

    result, _, _ = sandboxed_run
    code.clear()
    cfg = config_mod.load(str(result.run_dir / "config.yaml"), [])
    graph = ActorGraph(cfg, None, say=print)  # only its settings: no actor is made
    graph.spec = describe_env(cfg)
    weights = {k: v.numpy() for k, v in checkpoint.load(result.checkpoint)["learner"]["model"].items()
               if isinstance(v, torch.Tensor)}
    evaluator = Evaluator(graph.sampler_settings(cfg.run.seed + 424_242), graph.policy_factory(), episodes=2)
    stats = evaluator.run(1, weights)
    assert stats["episodes"] == 2 and stats["length_mean"] >= 1
    assert code.host() == [], code.found()
    if code.isolated():
        assert code.found() == {}


def test_a_policy_of_a_sandboxed_run_plays_in_a_child(sandboxed_run, code, tmp_path):
    from cluster.api import load_policy
    from cluster.evaluate import evaluate

    result, _, _ = sandboxed_run
    code.clear()
    policy = load_policy(result.run_dir, trust_code=True)
    assert code.host() == [], code.found()
    env = policy.make_env()
    try:
        assert str(env.observation_space) == str(policy.observation_space) and env.action_space.n == 2
        obs, info = env.reset(seed=0)
        assert obs.shape == (4,) and info == {}
        first = obs.copy()
        assert np.array_equal(env.reset(seed=0)[0], first)  # seeded as asked
        for steps in range(1, 501):
            obs, reward, terminated, truncated, info = env.step(policy.act(obs))
            assert obs.shape == (4,) and reward == 1.0
            if terminated or truncated:
                break
        # The episode's own final observation (the child has started the next one): CartPole ends out of bounds,
        # or at the registered 200 steps.
        assert (terminated and (abs(obs[0]) > 2.4 or abs(obs[2]) > 0.2095)) or (truncated and steps == 200), obs
    finally:
        env.close()
    assert code.host() == [], code.found()
    stats = evaluate(policy, 2)
    assert stats["episodes"] == 2 and stats["length_mean"] >= 1
    assert code.host() == [], code.found()
    with pytest.raises(config_mod.ConfigError, match=r"^env.isolation: process keeps 'marked_env:Marked-v0' in a "
                                                     r"sandboxed child, and its frames do not cross the sandbox"):
        policy.make_env(render_mode="rgb_array")
    with pytest.raises(config_mod.ConfigError, match=r"^--video: env.isolation: process keeps"):
        evaluate(policy, 1, video_dir=str(tmp_path / "videos"))
    assert code.host() == [], code.found()
    if code.isolated():
        assert code.found() == {}


def test_a_sandboxed_env_whose_child_dies_ends_its_episode_truncated_and_names_it():
    from actors.envs import SandboxedEnv
    from tests.breach_env import BREACH_ID

    env = SandboxedEnv(f"tests.breach_env:{BREACH_ID}", LIMITS, env_kwargs={"breach": "segfault", "at_step": 3})
    try:
        obs, _ = env.reset(seed=0)
        steps = []
        for _ in range(4):
            obs, reward, terminated, truncated, info = env.step(0)
            steps.append((truncated, info))
            if truncated:
                break
        # Steps 1 and 2 are CartPole's (pushing left ends it no sooner than step 8); the child segfaults at step 3.
        assert [t for t, _ in steps] == [False, False, True] and obs.shape == (4,)
        assert "SIGSEGV" in steps[-1][1]["env_failure"], steps
        assert env.reset(seed=1)[0].shape == (4,)  # its replacement plays on
    finally:
        env.close()
