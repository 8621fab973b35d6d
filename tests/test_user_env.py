"""Your own env by config alone: env.kwargs and env.wrappers with an env module outside the package tree.

The module is written into a temporary project directory (as a user's repository would be) and the CLI runs from
there; tests/test_job_submit.py submits the same project with `ray job submit --working-dir`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from cluster import checkpoint
from tests.conftest import assert_session_ends

EPISODE_LENGTH = 8

USER_ENVS = textwrap.dedent(f"""
    import gymnasium as gym
    import numpy as np


    class Countdown(gym.Env):
        \"\"\"{EPISODE_LENGTH} steps, each paying `step_reward` (a required constructor argument).\"\"\"

        def __init__(self, step_reward):
            self.step_reward = float(step_reward)
            self.observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
            self.action_space = gym.spaces.Discrete(2)

        def _obs(self):
            return np.array([self.t / {EPISODE_LENGTH}], np.float32)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.t = 0
            return self._obs(), {{}}

        def step(self, action):
            self.t += 1
            return self._obs(), self.step_reward, self.t >= {EPISODE_LENGTH}, False, {{}}


    class ScaleReward(gym.RewardWrapper):
        def __init__(self, env, factor):
            super().__init__(env)
            self.factor = factor

        def reward(self, reward):
            return reward * self.factor


    class AddBias(gym.ObservationWrapper):
        \"\"\"Appends a constant 1: the observation becomes Box(2,), which the dry run shows.\"\"\"

        def __init__(self, env):
            super().__init__(env)
            self.observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)

        def observation(self, observation):
            return np.append(observation, np.float32(1.0))


    gym.register("UserCountdown-v0", entry_point=Countdown)
""")

USER_CONFIG = textwrap.dedent("""
    env:
      id: "user_envs:UserCountdown-v0"
      kwargs:
        step_reward: 0.5
      wrappers:
        - path: "user_envs:ScaleReward"
          kwargs: {factor: 3.0}
        - "user_envs:AddBias"
    rollout:
      envs_per_actor: 4
      fragment_length: 32
    learner:
      batch_size: 256
      minibatch_size: 128
    run:
      total_env_steps: 2048
      checkpoint_interval_s: null
""")

#: What every episode returns when the kwarg and the reward wrapper both reached the actors' envs.
EXPECTED_RETURN = EPISODE_LENGTH * 0.5 * 3.0


def make_user_project(parent: Path) -> Path:
    project = parent / "user_project"
    project.mkdir()
    (project / "user_envs.py").write_text(USER_ENVS)
    (project / "user.yaml").write_text(USER_CONFIG)
    return project


def cli(project: Path, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "cluster.train", "--config", "user.yaml", *args], cwd=project,
                          capture_output=True, text=True, timeout=timeout)


def test_dry_run_checks_the_wrapped_spaces(tmp_path):
    project = make_user_project(tmp_path)
    proc = cli(project, "--dry-run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == (
        "# env.id 'user_envs:UserCountdown-v0': observation vector: vector Box(2) float32, action Discrete(2)")


def test_bad_kwargs_and_wrappers_are_one_line_config_errors(tmp_path):
    project = make_user_project(tmp_path)
    cases = [
        (["--set", "env.kwargs={bogus: 1}"], "config error: env.kwargs: {'bogus': 1} rejected by "
                                             "'user_envs:UserCountdown-v0'"),
        (["--set", "env.wrappers=[no_such_module_q7:Wrap]"],
         "config error: env.wrappers[0]: 'no_such_module_q7:Wrap' cannot be imported (ModuleNotFoundError"),
        (["--set", "env.wrappers=[user_envs:NoSuchWrapper]"],
         "config error: env.wrappers[0]: 'user_envs:NoSuchWrapper' cannot be imported (AttributeError"),
        (["--set", "env.wrappers=[{path: 'user_envs:ScaleReward', kwargs: {wrong: 1}}]"],
         "config error: env.wrappers[0]: 'user_envs:ScaleReward' failed on the env (TypeError"),
    ]
    for i, (args, start) in enumerate(cases):
        # Each through --dry-run; the first also through a real start (the driver checks with the same function).
        for mode in (["--dry-run"], []) if i == 0 else (["--dry-run"],):
            proc = cli(project, *args, *mode)
            assert proc.returncode == 2, (args, mode, proc.stderr[-2000:])
            lines = proc.stderr.strip().splitlines()
            # A real run starts Ray first (its start-up line may come before); the error is the one line after.
            assert lines[-1].startswith(start) and "Traceback" not in proc.stderr, (args, mode, proc.stderr[-2000:])
            assert len(lines) == 1 or mode == [], (args, mode, proc.stderr[-2000:])


def check_user_run(run_dir: Path) -> None:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["env_steps"] >= 2048
    returns = [r["episode_return_mean"] for r in records if r["episode_return_mean"] is not None]
    assert returns and all(abs(r - EXPECTED_RETURN) < 1e-6 for r in returns), returns


def test_a_run_from_the_users_project_applies_kwargs_and_wrappers_in_the_actors(tmp_path):
    """Also the CLI end to end, `make train`'s path (it was test_integration.py's own run of configs/cartpole.yaml,
    which built the same thing once more): the real entry point in a process and session of its own, an embedded
    Ray up, train, checkpoint, Ray down. The CLI ends Ray through cluster.placement.stop_ray and exits without the
    interpreter's finalization (cluster.train.exit_without_finalization), so every output must be complete all
    the same (each metrics line whole, the summary, the plot, the TensorBoard file), and nothing of Ray left."""
    project = make_user_project(tmp_path)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "cluster.train", "--config", "user.yaml", "--run-dir", str(run_dir)],
                            cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert err.rstrip().splitlines()[-1].startswith("done: total_env_steps") and "Traceback" not in err, err[-3000:]
    assert (run_dir / "config.yaml").is_file()
    assert checkpoint.load(run_dir / "checkpoints" / "final.pt")["stop_reason"] == "total_env_steps"
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) >= 3
    check_user_run(run_dir)  # json.loads of every metrics line
    assert "stop reason: total_env_steps" in (run_dir / "summary.txt").read_text()
    assert (run_dir / "report.png").stat().st_size > 0  # drawn by the report thread while the actors went
    events = list(run_dir.glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0, sorted(p.name for p in run_dir.iterdir())
    assert_session_ends(proc.pid)
