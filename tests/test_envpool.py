"""env.backend: envpool: EnvPool's batched envs behind the rollouts' env interface, with the gymnasium path's
same-step autoreset, final observations and truncation; the model's view of an Atari task; a CartPole run to 475
in process; and its bad input as one line."""

import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("envpool")

from actors.envpool_env import EnvPoolVectorEnv  # noqa: E402
from actors.envs import VectorEnv, describe_env  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

THETA, X = 12 * 2 * np.pi / 360, 2.4  # CartPole-v1's termination bounds


def run_random(env, steps: int, seed: int = 0):
    """(observations after each step, finals, terminated, truncated, episode_step) over ``steps`` random steps."""
    rng = np.random.default_rng(seed)
    env.reset(seed)
    out = []
    for _ in range(steps):
        obs, rew, term, trunc, finals = env.step(rng.integers(0, 2, env.num_envs))
        out.append((obs.copy(), dict(finals), term.copy(), trunc.copy(), env.episode_step.copy(), rew.copy()))
    return out


@pytest.mark.parametrize("make", [lambda: EnvPoolVectorEnv("CartPole-v1", 6),
                                  lambda: VectorEnv("CartPole-v1", 6)], ids=["envpool", "gymnasium"])
def test_same_step_autoreset_final_observations_and_episode_steps(make):
    """Both backends: an env that ended hands back its episode's final observation (past a termination bound)
    apart, and the next episode's first observation (near the origin) in the same step; its episode step restarts;
    every reward is a real step's (1 in CartPole: no zero-reward reset steps in a fragment)."""
    env = make()
    steps = run_random(env, 200)
    ended = 0
    for t, (obs, finals, term, trunc, episode_step, rew) in enumerate(steps):
        assert np.all(rew == 1.0), (t, rew)
        for i, final in finals.items():
            ended += 1
            assert term[i] and not trunc[i]
            assert abs(final[0]) > X or abs(final[2]) > THETA, final  # the terminal state itself
            assert np.all(np.abs(obs[i]) <= 0.05), obs[i]  # a fresh episode's first observation
            assert episode_step[i] == 0
        alive = [i for i in range(env.num_envs) if i not in finals]
        if t:
            assert np.all(episode_step[alive] == steps[t - 1][4][alive] + 1)
    assert ended >= 40  # random CartPole episodes last ~22 steps
    env.close()


def test_a_time_limit_is_a_truncation_with_its_final_observation():
    env = EnvPoolVectorEnv("CartPole-v1", 3, max_episode_steps=5)
    steps = run_random(env, 12)
    cut = [(t, i) for t, s in enumerate(steps) for i in s[1] if s[3][i]]
    assert cut and all(t % 5 == 4 for t, _ in cut), cut  # every 5th step, for the envs that lived that long
    for t, i in cut:
        obs, finals, term, trunc, _, _ = steps[t]
        assert not term[i] and np.any(finals[i] != obs[i])


def test_seeding_is_per_env_and_repeatable():
    a = run_random(EnvPoolVectorEnv("CartPole-v1", 4), 30, seed=7)
    b = run_random(EnvPoolVectorEnv("CartPole-v1", 4), 30, seed=7)
    c = run_random(EnvPoolVectorEnv("CartPole-v1", 4), 30, seed=8)
    assert all(np.array_equal(x[0], y[0]) for x, y in zip(a, b))
    assert not all(np.array_equal(x[0], y[0]) for x, y in zip(a, c))
    env = EnvPoolVectorEnv("CartPole-v1", 4)
    first = env.reset(3)
    assert len({tuple(row) for row in first}) == 4  # env i seeded seed + i: four different starts
    for _ in range(3):
        env.step(np.ones(4, dtype=np.int64))
    # Abandoning one env's episode starts only that one again.
    assert np.all(np.abs(env.reset_one(2)) <= 0.05) and env.episode_step[2] == 0 and env.episode_step[0] == 3


def test_an_atari_task_is_one_hwc_uint8_image_for_the_model():
    """EnvPool's Pong frames are (4, 84, 84), channels first; the model's image encoder takes H x W x C."""
    env = EnvPoolVectorEnv("Pong-v5", 2)
    obs = env.reset(0)
    assert obs.shape == (2, 84, 84, 4) and obs.dtype == np.uint8 and obs.flags["C_CONTIGUOUS"]
    assert env.single_observation_space.shape == (84, 84, 4)
    obs, *_ = env.step(np.zeros(2, dtype=np.int64))
    assert obs.shape == (2, 84, 84, 4)
    env.close()
    described = describe_env("Pong-v5", backend="envpool")
    (mod,) = described["modalities"]
    assert mod["kind"] == "image" and tuple(mod["shape"]) == (84, 84, 4) and mod["dtype"] == "uint8"
    assert described["action_kind"] == "discrete" and described["action_dim"] == 6


@pytest.mark.long  # learning run to a threshold (`make test-long`; CI runs it)
def test_cartpole_on_envpool_reaches_475_in_process(tmp_path):
    from cluster.api import train

    result = train("configs/cartpole.yaml", run_dir=tmp_path / "run", env__backend="envpool",
                   ray__address="inprocess", run__total_env_steps=300000)
    assert result.reason == "target_reached", result


@pytest.mark.parametrize("sets,message", [
    (["env.id=Pong-v4"], "env.id: 'Pong-v4' is not an EnvPool task (env.backend: envpool); closest: Pong-v5"),
    (["env.wrappers=[gymnasium.wrappers:ClipReward]"], "env.wrappers: set, but env.backend is envpool"),
    (["env.backend=envpol"], "env.backend: 'envpol' is not allowed; allowed: gymnasium, envpool"),
])
def test_bad_envpool_config_is_one_line_exit_2(sets, message):
    cmd = [sys.executable, "-m", "cluster.train", "--config", str(ROOT / "configs/cartpole.yaml"), "--dry-run",
           "--set", "env.backend=envpool", *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_envpool_not_installed_names_the_extra():
    """Where envpool does not import (here: blocked in the child's import system), the config error says which extra
    to install."""
    code = ("import sys; sys.modules['envpool'] = None\n"
            "from cluster import config as c\n"
            "try:\n    c.load('configs/cartpole.yaml', ['env.backend=envpool'])\n"
            "except c.ConfigError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "env.backend: envpool needs the envpool package" in proc.stdout and ".[envpool]" in proc.stdout, \
        proc.stdout + proc.stderr
