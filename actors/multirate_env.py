"""A built-in multi-rate sensor environment: `AscentRL/MultiRateSensor-v0`.

Task. A 5x5 grid; the agent starts in the centre cell. Each episode draws 3 distinct colours out of
red/green/blue/yellow for 3 beacons placed on distinct random cells (never the centre). One beacon is the goal.
Stepping onto the goal gives +1 and ends the episode; stepping onto a wrong beacon ends it with 0, so a policy that
cannot tell which beacon is the goal cannot simply visit all three. Episodes are truncated after 20 steps by the
registered TimeLimit. Actions: Discrete(5) = stay, up, down, left, right (moves are clipped at the walls).

Modalities (keys of the Dict observation) and their rates, counted in episode steps (0 = the reset observation):

    camera       image       every step    PNG bytes of a 20x20x3 RGB top-down render (4x4 px per cell; beacons in
                                           their colours, agent white, background black)
    proprio      vector      every step    float32 (4,): agent x, y scaled to [-1, 1] and the last move (dx, dy)
    audio        audio       every 2 steps float32 (256,): a sine tone whose frequency rises as the Manhattan distance
                                           to the NEAREST beacon (any colour) falls, plus small seeded noise
    lidar        pointcloud  every 4 steps float32 (24, 3): 8 points on each beacon cell's outline, relative to the
                                           agent (dx, dy in cells, z = 0), jittered; no colour
    instruction  text        at reset      "go to the {colour} beacon"

Between its updates a slow modality repeats its previous value (a fresh copy), the way a real sensor that
ticks slower than the control loop looks to the policy. `info["episode_step"]` says which step an observation
belongs to, so the pipeline can tell fresh values from repeated ones.

Why the reward needs two modalities: the instruction names the goal's colour but not where it is; the camera shows
where each colour is but not which one is the goal; lidar gives positions without colour and audio only the distance
to the nearest beacon. Only instruction + camera together identify the goal cell (a policy that guesses a beacon
succeeds about 1/3 of the time).

Importing this module registers the id (users write `env.id: "actors.multirate_env:AscentRL/MultiRateSensor-v0"`
so `gym.make` imports it first). The env is meant to be cheap (well under 100 us a step including the PNG encode)
so that benchmarks of the multimodal pipeline measure the pipeline, not the simulator.
"""

from __future__ import annotations

from collections import deque

import cv2
import gymnasium as gym
import numpy as np
from gymnasium import spaces

from pipeline.modality import EncodedImage

ENV_ID = "AscentRL/MultiRateSensor-v0"
MAX_EPISODE_STEPS = 20

GRID = 5
CELL_PX = 4
IMAGE_SIZE = GRID * CELL_PX
CENTRE = (GRID // 2, GRID // 2)
NUM_BEACONS = 3
POINTS_PER_BEACON = 8
AUDIO_SAMPLES = 256
AUDIO_EVERY = 2
LIDAR_EVERY = 4

# Colours in RGB, the order of the palette fixes nothing observable (colours are drawn at random each episode).
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
}
COLOURS = tuple(PALETTE)
AGENT_RGB = (255, 255, 255)

INSTRUCTION_TEMPLATE = "go to the {} beacon"
# Every word an instruction can contain, sorted (the text processor numbers vocabulary words in sorted order).
VOCAB: tuple[str, ...] = tuple(sorted(set(INSTRUCTION_TEMPLATE.format("").split()) | set(COLOURS)))
TEXT_CHARSET = "abcdefghijklmnopqrstuvwxyz "

# name -> plain modality config, in the shape `pipeline.modality.ModalitySpec.from_dict(name, d)` takes.
MODALITIES: dict[str, dict] = {
    "camera": {"kind": "image", "rate": "step", "encoding": "png"},
    "proprio": {"kind": "vector", "rate": "step"},
    "audio": {"kind": "audio", "rate": "every", "every": AUDIO_EVERY},
    "lidar": {"kind": "pointcloud", "rate": "every", "every": LIDAR_EVERY, "num_points": NUM_BEACONS * POINTS_PER_BEACON},
    "instruction": {"kind": "text", "rate": "reset", "vocab": list(VOCAB)},
}

# Action index -> (dx, dy); y grows downwards (image rows), so "up" is dy = -1.
MOVES = ((0, 0), (0, -1), (0, 1), (-1, 0), (1, 0))
STAY, UP, DOWN, LEFT, RIGHT = range(5)

# Cells a beacon may occupy: everything but the agent's start.
_BEACON_CELLS = tuple((x, y) for y in range(GRID) for x in range(GRID) if (x, y) != CENTRE)

# 8 points on a cell's square outline (corners and edge midpoints), relative to the cell centre, in cells.
_OUTLINE = np.array(
    [(-0.5, -0.5), (0.0, -0.5), (0.5, -0.5), (0.5, 0.0), (0.5, 0.5), (0.0, 0.5), (-0.5, 0.5), (-0.5, 0.0)],
    dtype=np.float32,
)
LIDAR_JITTER = 0.03
AUDIO_NOISE = 0.05
_MAX_DISTANCE = 2 * (GRID - 1)


def _build_tones() -> np.ndarray:
    """One tone per nearest-beacon distance 0..8, precomputed so a step only adds noise.

    Distance d gets 4 * (9 - d) cycles per 256 samples: every distance step moves the tone by exactly one rfft bin of
    a 64-sample frame (the pipeline's default n_fft), so the spectrogram separates all distances; the highest tone
    (36 cycles) stays far below Nyquist (128).
    """
    t = np.arange(AUDIO_SAMPLES, dtype=np.float64) / AUDIO_SAMPLES
    cycles = 4.0 * (_MAX_DISTANCE + 1 - np.arange(_MAX_DISTANCE + 1))
    return np.sin(2.0 * np.pi * cycles[:, None] * t[None, :]).astype(np.float32)


_TONES = _build_tones()
_PNG_PARAMS = [cv2.IMWRITE_PNG_COMPRESSION, 1]  # the frames are tiny: fastest compression costs nothing in size


class MultiRateSensorEnv(gym.Env):
    """See the module docstring. Public state for scripted policies and tests:

    beacons: list of (colour, (x, y)), sorted by cell (row-major) so list order carries no colour information
    goal_index: index into `beacons` of the goal
    agent: (x, y) of the agent
    episode_step: step index of the last returned observation within its episode
    """

    metadata = {"render_modes": []}

    def __init__(self):
        self.action_space = spaces.Discrete(len(MOVES))
        self.observation_space = spaces.Dict(
            {
                "camera": EncodedImage((IMAGE_SIZE, IMAGE_SIZE, 3), "png"),
                "proprio": spaces.Box(-1.0, 1.0, (4,), np.float32),
                "audio": spaces.Box(-2.0, 2.0, (AUDIO_SAMPLES,), np.float32),
                "lidar": spaces.Box(-10.0, 10.0, (NUM_BEACONS * POINTS_PER_BEACON, 3), np.float32),
                "instruction": spaces.Text(max_length=32, min_length=1, charset=TEXT_CHARSET),
            }
        )
        self.beacons: list[tuple[str, tuple[int, int]]] = []
        self.goal_index = 0
        self.agent = CENTRE
        self.episode_step = 0
        self._last_move = (0, 0)
        self._background: np.ndarray | None = None
        self._png_cache: dict[tuple[int, int], bytes] = {}
        self._beacon_at: dict[tuple[int, int], int] = {}
        self._outline_points = np.zeros((0, 2), dtype=np.float32)
        self._audio: np.ndarray | None = None
        self._lidar: np.ndarray | None = None
        self._instruction = ""

    # ---- gymnasium API -------------------------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        rng = self.np_random
        # permutation()[:k] rather than choice(replace=False): the same distribution at a fifth of the cost.
        cells = sorted(_BEACON_CELLS[i] for i in rng.permutation(len(_BEACON_CELLS))[:NUM_BEACONS])
        # Sorting by cell and drawing colours independently keeps list order (hence lidar point order) colour-free.
        colours = [COLOURS[i] for i in rng.permutation(len(COLOURS))[:NUM_BEACONS]]
        self.beacons = [(colour, (int(x), int(y))) for colour, (x, y) in zip(colours, cells)]
        self.goal_index = int(rng.integers(NUM_BEACONS))
        self.agent = CENTRE
        self.episode_step = 0
        self._last_move = (0, 0)
        self._beacon_at = {cell: i for i, (_, cell) in enumerate(self.beacons)}
        # Absolute outline points of every beacon: a lidar sample only subtracts the agent and adds jitter.
        centres = np.array([cell for _, cell in self.beacons], dtype=np.float32)
        self._outline_points = (centres[:, None, :] + _OUTLINE[None, :, :]).reshape(-1, 2)
        self._background = self._render_background()
        self._png_cache = {}
        self._instruction = INSTRUCTION_TEMPLATE.format(self.goal_colour)
        return self._observe(), self._info(success=False)

    def step(self, action):
        dx, dy = MOVES[int(action)]
        x, y = self.agent
        nx = min(max(x + dx, 0), GRID - 1)
        ny = min(max(y + dy, 0), GRID - 1)
        # The realised displacement (0 when a wall blocks): that is what a proprioceptive sensor would measure.
        self._last_move = (nx - x, ny - y)
        self.agent = (nx, ny)
        self.episode_step += 1
        hit = self._beacon_at.get(self.agent)
        terminated = hit is not None
        success = hit == self.goal_index
        reward = 1.0 if success else 0.0
        return self._observe(), reward, terminated, False, self._info(success=success)

    # ---- helpers -------------------------------------------------------------------------------------------------

    @property
    def goal_colour(self) -> str:
        return self.beacons[self.goal_index][0]

    @property
    def goal_cell(self) -> tuple[int, int]:
        return self.beacons[self.goal_index][1]

    def _info(self, success: bool) -> dict:
        return {"episode_step": self.episode_step, "goal_colour": self.goal_colour, "is_success": success}

    def _observe(self) -> dict:
        t = self.episode_step
        if t % AUDIO_EVERY == 0:
            self._audio = self._sample_audio()
        if t % LIDAR_EVERY == 0:
            self._lidar = self._sample_lidar()
        x, y = self.agent
        half = (GRID - 1) / 2.0
        proprio = np.array(
            [(x - half) / half, (y - half) / half, self._last_move[0], self._last_move[1]], dtype=np.float32
        )
        return {
            "camera": self._camera(),  # bytes are immutable: a cached frame can be handed out again safely
            "proprio": proprio,
            # Copies, not the stored arrays: a caller may keep or edit an observation (buffers, in-place
            # normalisation), and gymnasium's checker rejects observations that share memory across steps.
            # Two small copies cost about a microsecond.
            "audio": self._audio.copy(),
            "lidar": self._lidar.copy(),
            "instruction": self._instruction,
        }

    def _render_background(self) -> np.ndarray:
        # Kept in BGR because cv2.imencode reads BGR: the PNG file then holds true RGB colours, and cv2.imdecode
        # returns BGR (convert with cv2.COLOR_BGR2RGB for RGB).
        frame = np.zeros((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
        for colour, (x, y) in self.beacons:
            frame[y * CELL_PX : (y + 1) * CELL_PX, x * CELL_PX : (x + 1) * CELL_PX] = PALETTE[colour][::-1]
        return frame

    def _camera(self) -> bytes:
        # Beacons never move within an episode, so the frame depends on the agent cell only: encode each cell once.
        png = self._png_cache.get(self.agent)
        if png is None:
            frame = self._background.copy()
            x, y = self.agent
            frame[y * CELL_PX : (y + 1) * CELL_PX, x * CELL_PX : (x + 1) * CELL_PX] = AGENT_RGB[::-1]
            ok, buf = cv2.imencode(".png", frame, _PNG_PARAMS)
            if not ok:  # cv2 reports failure by flag, not exception
                raise RuntimeError("cv2.imencode failed to encode the camera frame")
            png = buf.tobytes()
            self._png_cache[self.agent] = png
        return png

    def nearest_beacon_distance(self) -> int:
        x, y = self.agent
        return min(abs(bx - x) + abs(by - y) for _, (bx, by) in self.beacons)

    def _sample_audio(self) -> np.ndarray:
        noise = self.np_random.standard_normal(AUDIO_SAMPLES, dtype=np.float32)
        noise *= AUDIO_NOISE
        # No clip needed for the Box(-2, 2): the tone is within [-1, 1] and noise would need 20 sigma to leave it.
        noise += _TONES[self.nearest_beacon_distance()]
        return noise

    def _sample_lidar(self) -> np.ndarray:
        jitter = self.np_random.standard_normal(self._outline_points.shape, dtype=np.float32)
        jitter *= LIDAR_JITTER
        points = np.zeros((self._outline_points.shape[0], 3), dtype=np.float32)  # z stays 0: a planar scan
        points[:, :2] = self._outline_points + jitter
        points[:, :2] -= self.agent  # relative to the agent, in cells
        return points


# ---- scripted policies for tests and benchmarks ------------------------------------------------------------------


def path_action(env: MultiRateSensorEnv, target_index: int) -> int:
    """First action of a shortest path to beacon `target_index` that steps on no other beacon (breadth-first).

    A straight greedy walk can cross a wrong beacon and end the episode, which would make a perfect-information
    policy look imperfect. Falls back to STAY when the target is walled in by the other two beacons (a corner
    target with both neighbours taken: about 1 episode in 1500).
    """
    target = env.beacons[target_index][1]
    blocked = {cell for i, (_, cell) in enumerate(env.beacons) if i != target_index}
    start = env.agent
    if start == target:
        return STAY
    first_action: dict[tuple[int, int], int] = {start: STAY}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        for action in (UP, DOWN, LEFT, RIGHT):
            dx, dy = MOVES[action]
            nxt = (cell[0] + dx, cell[1] + dy)
            if not (0 <= nxt[0] < GRID and 0 <= nxt[1] < GRID) or nxt in first_action or nxt in blocked:
                continue
            first_action[nxt] = action if cell == start else first_action[cell]
            if nxt == target:
                return first_action[nxt]
            queue.append(nxt)
    return STAY


def oracle_action(env: MultiRateSensorEnv) -> int:
    """Walk to the goal: what a policy that fuses instruction and camera could learn."""
    return path_action(env, env.goal_index)


def camera_only_action(env: MultiRateSensorEnv, chosen_index: int) -> int:
    """Walk to a beacon chosen without the instruction: a camera-only policy can do no better than guess."""
    return path_action(env, chosen_index)


if ENV_ID not in gym.registry:  # re-imports (pytest, Ray workers, importlib.reload) must not re-register
    # A string entry point keeps the EnvSpec picklable by reference (Ray ships specs to workers).
    gym.register(id=ENV_ID, entry_point="actors.multirate_env:MultiRateSensorEnv", max_episode_steps=MAX_EPISODE_STEPS)
