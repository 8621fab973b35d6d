"""The multi-rate sensor env: API, what each modality shows, its update rates, and how hard the task is."""

from __future__ import annotations

import importlib
import time

import cv2
import gymnasium as gym
import numpy as np
from gymnasium.utils.env_checker import check_env

import actors.multirate_env as mre
from actors.multirate_env import (
    CELL_PX,
    ENV_ID,
    LEFT,
    MODALITIES,
    PALETTE,
    RIGHT,
    STAY,
    UP,
    VOCAB,
    MultiRateSensorEnv,
    camera_only_action,
    oracle_action,
    path_action,
)


def make():
    return gym.make(f"actors.multirate_env:{ENV_ID}")


def decode_rgb(png: bytes) -> np.ndarray:
    bgr = cv2.imdecode(np.frombuffer(png, dtype=np.uint8), cv2.IMREAD_COLOR)
    assert bgr is not None
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def cell_pixels(image: np.ndarray, cell: tuple[int, int]) -> np.ndarray:
    x, y = cell
    return image[y * CELL_PX : (y + 1) * CELL_PX, x * CELL_PX : (x + 1) * CELL_PX].reshape(-1, 3)


def run_episodes(policy, episodes: int, seed: int) -> float:
    """Success rate of `policy(env_unwrapped, obs, rng) -> action` over seeded episodes of the registered env."""
    env = make()
    rng = np.random.default_rng(seed)
    successes = 0
    for episode in range(episodes):
        obs, info = env.reset(seed=seed * 100_000 + episode)
        state = {}
        while True:
            obs, reward, terminated, truncated, info = env.step(policy(env.unwrapped, obs, rng, state))
            if terminated or truncated:
                successes += reward == 1.0
                break
    env.close()
    return successes / episodes


def test_registered_with_time_limit_and_reimport_is_harmless():
    importlib.reload(mre)  # a second registration attempt must be skipped, not raise or warn
    env = make()
    assert env.spec.max_episode_steps == 20
    assert isinstance(env.unwrapped, mre.MultiRateSensorEnv)
    env.reset(seed=3)
    # Staying put never reaches a beacon (none is on the centre), so the episode runs into the time limit.
    for step in range(1, 21):
        obs, reward, terminated, truncated, info = env.step(STAY)
        assert info["episode_step"] == step
        assert not terminated and reward == 0.0
        assert truncated == (step == 20)
    env.close()


def test_gymnasium_env_checker_accepts_it():
    check_env(MultiRateSensorEnv(), skip_render_check=True)


def test_spaces_and_observation_types():
    env = make()
    obs, info = env.reset(seed=0)
    assert set(obs) == set(MODALITIES) == {"camera", "proprio", "audio", "lidar", "instruction"}
    assert isinstance(obs["camera"], bytes) and obs["camera"][:8] == b"\x89PNG\r\n\x1a\n"
    assert obs["proprio"].dtype == np.float32 and obs["proprio"].shape == (4,)
    assert obs["audio"].dtype == np.float32 and obs["audio"].shape == (256,)
    assert obs["lidar"].dtype == np.float32 and obs["lidar"].shape == (24, 3)
    assert isinstance(obs["instruction"], str)
    assert env.observation_space.contains(obs)
    assert info["episode_step"] == 0 and info["goal_colour"] in PALETTE
    assert MODALITIES["audio"]["every"] == 2 and MODALITIES["lidar"]["every"] == 4
    assert MODALITIES["instruction"]["rate"] == "reset"
    assert VOCAB == ("beacon", "blue", "go", "green", "red", "the", "to", "yellow")
    for _ in range(10):
        obs, *_ = env.step(env.action_space.sample())
        assert env.observation_space.contains(obs)
    env.close()


def test_camera_shows_beacons_agent_and_nothing_else():
    env = make()
    for seed in range(20):
        obs, info = env.reset(seed=seed)
        u = env.unwrapped
        image = decode_rgb(obs["camera"])
        assert image.shape == (20, 20, 3) and image.dtype == np.uint8
        goal_colour, goal_cell = u.beacons[u.goal_index]
        assert goal_colour == info["goal_colour"]
        assert (cell_pixels(image, goal_cell) == PALETTE[goal_colour]).all()
        expected = np.zeros_like(image)
        for colour, (x, y) in u.beacons:
            expected[y * 4 : (y + 1) * 4, x * 4 : (x + 1) * 4] = PALETTE[colour]
        expected[8:12, 8:12] = 255  # the agent, white, in the centre cell
        np.testing.assert_array_equal(image, expected)
        # After a move the agent's white block follows it and the centre goes black again.
        obs, _, terminated, _, _ = env.step(UP)
        if not terminated:
            image = decode_rgb(obs["camera"])
            assert (cell_pixels(image, (2, 1)) == 255).all()
            assert (cell_pixels(image, (2, 2)) == 0).all()
    env.close()


def test_proprio_position_last_move_and_walls():
    env = make()
    # A layout whose left half of the middle row is free, so walking left reaches the wall without touching a beacon.
    def left_row_free(seed):
        env.reset(seed=seed)
        return not {cell for _, cell in env.unwrapped.beacons} & {(0, 2), (1, 2)}

    seed = next(s for s in range(100) if left_row_free(s))
    obs, _ = env.reset(seed=seed)
    u = env.unwrapped
    np.testing.assert_array_equal(obs["proprio"], [0, 0, 0, 0])
    obs, *_ = env.step(LEFT)
    np.testing.assert_array_equal(obs["proprio"], [-0.5, 0.0, -1.0, 0.0])
    obs, *_ = env.step(LEFT)
    np.testing.assert_array_equal(obs["proprio"], [-1.0, 0.0, -1.0, 0.0])
    # Into the wall: the position stays and the realised move is 0.
    obs, _, terminated, _, _ = env.step(LEFT)
    assert u.agent == (0, 2) and not terminated
    np.testing.assert_array_equal(obs["proprio"], [-1.0, 0.0, 0.0, 0.0])
    obs, *_ = env.step(RIGHT)
    np.testing.assert_array_equal(obs["proprio"], [-0.5, 0.0, 1.0, 0.0])
    env.close()


def test_slow_modalities_repeat_between_updates():
    env = make()
    rng = np.random.default_rng(0)
    steps_seen = 0
    for episode in range(15):
        obs, info = env.reset(seed=1000 + episode)
        prev = obs
        while True:
            obs, _, terminated, truncated, info = env.step(int(rng.integers(5)))
            t = info["episode_step"]
            steps_seen += 1
            # Fresh noise/jitter makes every update differ from the last; repeats are bit-identical.
            assert np.array_equal(obs["audio"], prev["audio"]) == (t % 2 != 0), t
            assert np.array_equal(obs["lidar"], prev["lidar"]) == (t % 4 != 0), t
            assert obs["instruction"] == prev["instruction"]
            # Repeats are copies: editing a kept observation must not change the value the env hands out next.
            assert not np.shares_memory(obs["audio"], prev["audio"])
            assert not np.shares_memory(obs["lidar"], prev["lidar"])
            prev = obs
            if terminated or truncated:
                break
    assert steps_seen > 60  # enough steps past the first update period to mean something
    instructions = set()
    for seed in range(30):
        obs, info = env.reset(seed=seed)
        assert obs["instruction"] == f"go to the {info['goal_colour']} beacon"
        instructions.add(obs["instruction"])
    assert len(instructions) == 4  # every palette colour gets to be the goal
    env.close()


def test_audio_pitch_encodes_nearest_beacon_distance():
    env = make()
    for seed in range(30):
        obs, _ = env.reset(seed=seed)
        u = env.unwrapped
        distance = min(abs(x - 2) + abs(y - 2) for _, (x, y) in u.beacons)
        peak = int(np.argmax(np.abs(np.fft.rfft(obs["audio"]))))
        assert peak == 4 * (9 - distance), (distance, peak)  # nearer beacon -> higher tone
        assert np.abs(obs["audio"]).max() < 1.5
    env.close()


def test_lidar_points_outline_beacons_relative_to_agent():
    env = make()
    for seed in range(20):
        obs, _ = env.reset(seed=seed)
        u = env.unwrapped
        points = obs["lidar"].reshape(3, 8, 3)
        assert (points[..., 2] == 0).all()
        for (_, (bx, by)), group in zip(u.beacons, points):
            centre = group[:, :2].mean(axis=0)
            np.testing.assert_allclose(centre, (bx - 2, by - 2), atol=0.1)
            # On the cell's outline: Chebyshev distance to the centre is half a cell (up to the jitter).
            np.testing.assert_allclose(np.abs(group[:, :2] - (bx - 2, by - 2)).max(axis=1), 0.5, atol=0.15)
    env.close()


def test_beacon_contact_ends_the_episode():
    env = make()
    wrong_hits = goal_hits = 0
    for seed in range(40):
        env.reset(seed=seed)
        u = env.unwrapped
        target = seed % 3
        while True:
            obs, reward, terminated, truncated, info = env.step(path_action(u, target))
            if terminated or truncated:
                break
        assert terminated and u.agent == u.beacons[target][1]
        if target == u.goal_index:
            goal_hits += 1
            assert reward == 1.0 and info["is_success"]
        else:
            wrong_hits += 1
            assert reward == 0.0 and not info["is_success"]
    assert goal_hits > 5 and wrong_hits > 5
    env.close()


def test_seeded_determinism():
    def trajectory(seed):
        env = make()
        obs, _ = env.reset(seed=seed)
        env.action_space.seed(seed)
        out = [obs]
        for _ in range(20):
            obs, _, terminated, truncated, _ = env.step(env.action_space.sample())
            out.append(obs)
            if terminated or truncated:
                obs, _ = env.reset()
                out.append(obs)
        env.close()
        return out

    def same(a, b):
        return all(
            a[k] == b[k] if isinstance(a[k], (bytes, str)) else np.array_equal(a[k], b[k]) for k in MODALITIES
        )

    a, b, c = trajectory(7), trajectory(7), trajectory(8)
    assert len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    assert not all(same(x, y) for x, y in zip(a, c))


def oracle_from_observations(u, obs, rng, state):
    """Instruction says the colour, the camera says where it is: the information a learned policy has."""
    if "goal_cell" not in state:
        colour = obs["instruction"].split()[3]
        image = decode_rgb(obs["camera"])
        cells = [(x, y) for y in range(5) for x in range(5) if (cell_pixels(image, (x, y)) == PALETTE[colour]).all()]
        assert len(cells) == 1
        state["goal_cell"] = cells[0]
        state["index"] = [cell for _, cell in u.beacons].index(cells[0])
    return path_action(u, state["index"])


def test_oracle_solves_it():
    rate = run_episodes(oracle_from_observations, 300, seed=1)
    print(f"\noracle (instruction + camera) success: {rate:.3f}")
    assert rate >= 0.99
    assert run_episodes(lambda u, obs, rng, state: oracle_action(u), 300, seed=2) >= 0.99


def test_guessing_a_beacon_succeeds_a_third_of_the_time():
    def guess(u, obs, rng, state):
        if "index" not in state:
            state["index"] = int(rng.integers(3))
        return camera_only_action(u, state["index"])

    rate = run_episodes(guess, 600, seed=3)
    print(f"\nrandom-beacon (camera only) success: {rate:.3f}")
    assert 0.2 <= rate <= 0.45


def test_uniform_random_policy_rarely_succeeds():
    # The expected rate is about 0.23 (about 70% of random walks touch some beacon within 20 steps, a third of
    # those the goal); 3000 seeded episodes keep the estimate's standard error near 0.008.
    rate = run_episodes(lambda u, obs, rng, state: int(rng.integers(5)), 3000, seed=4)
    print(f"\nuniform random policy success: {rate:.3f}")
    assert rate < 0.25


def test_step_time_benchmark():
    for label, env in (("unwrapped", MultiRateSensorEnv()), ("gym.make (wrappers)", make())):
        env.reset(seed=0)
        actions = np.random.default_rng(0).integers(5, size=5000)
        steps = 0
        start = time.perf_counter()
        for action in actions:
            _, _, terminated, truncated, _ = env.step(int(action))
            steps += 1
            if terminated or truncated:
                env.reset()
        per_step = (time.perf_counter() - start) / steps
        print(f"\nstep time ({label}, incl. resets and PNG encodes): {per_step * 1e6:.1f} us")
        # Worst case: an uncached PNG encode on every step.
        u = env.unwrapped
        u.reset(seed=0)
        start = time.perf_counter()
        for _ in range(2000):
            u._png_cache.clear()
            u._observe()
        print(f"observation with a fresh PNG encode ({label}): {(time.perf_counter() - start) / 2000 * 1e6:.1f} us")
        env.close()
