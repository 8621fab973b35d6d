"""Image Box envs under their own ids, for configs to name as ``actors.wrapped_envs:<Id>``, and wrappers for
``env.wrappers``.

The two image envs the docs train (docs/results.md, image Box) are registered here, with their usual wrappers
applied (registered before ``env.wrappers`` existed; their ids stay). Both observations are
H x W x C uint8, so ``actors.envs.box_modality`` makes them one ``image`` modality: the CNN encoder, uint8 up
to the learner device, and no ``env.modalities`` in the config.

* ``AscentRL/MiniGridImg-Empty-5x5-v0``: minigrid's ``ImgObsWrapper`` (the 7x7x3 symbolic egocentric view only).
* ``AscentRL/Atari-<Game>-v0`` for Pong and Breakout: ``ale-py`` (the ``atari`` extra) with the Nature-DQN
  preprocessing (no-op starts, frame skip 4 with max-pooling, 84x84 greyscale, life loss not used as episode end,
  reward clipping) and the last 4 frames stacked channels-last: (84, 84, 4).
* ``FirstActions``: a Discrete env restricted to its first n actions (minigrid navigation: left, right, forward).
* ``MemoryCueInView``: MiniGrid-Memory with the agent always starting where the cue is in view (the remembering
  half of the task without the exploring half; docs/memory_and_actions.md).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

ATARI_GAMES = ("Pong", "Breakout")


def make_minigrid_image(**kwargs):
    try:
        from minigrid.wrappers import ImgObsWrapper  # importing minigrid registers the MiniGrid ids
    except ImportError as e:
        raise ImportError(f"MiniGrid envs need minigrid: pip install -e '.[minigrid]' ({e})") from None

    return ImgObsWrapper(gym.make("MiniGrid-Empty-5x5-v0", **kwargs))


class ChannelsLast(gym.ObservationWrapper):
    """(stack, H, W) -> (H, W, stack): the frame stack becomes the image's channels."""

    def __init__(self, env):
        super().__init__(env)
        stack, height, width = env.observation_space.shape
        self.observation_space = gym.spaces.Box(0, 255, (height, width, stack), np.uint8)

    def observation(self, observation):
        return np.ascontiguousarray(np.moveaxis(np.asarray(observation), 0, -1))


class FirstActions(gym.ActionWrapper):
    """A ``Discrete(n)`` env restricted to its first ``n`` actions (``env.wrappers: [{path:
    "actors.wrapped_envs:FirstActions", kwargs: {n: 3}}]``): minigrid's navigation tasks need only turn left, turn
    right and forward, and the other four actions (pick up, drop, toggle, done) are no-ops that dilute exploration."""

    def __init__(self, env, n: int):
        super().__init__(env)
        space = env.action_space
        if not isinstance(space, gym.spaces.Discrete) or not 1 <= n <= space.n:
            raise ValueError(f"FirstActions(n={n}): needs a Discrete action space of at least n actions; the env "
                             f"has {space}")
        self.action_space = gym.spaces.Discrete(n, start=int(space.start))

    def action(self, action):
        return action


class MemoryCueInView(gym.Wrapper):
    """MiniGrid-Memory (``MiniGrid-MemoryS<n>-v0``) with the agent always starting at the west end of the hallway
    row, facing east, where the start room's object (the cue) is in even a 3x3 view at the first step.

    minigrid starts the agent anywhere along that row; from most places the cue is behind it, so a policy must
    first learn to walk back and look, which pays only once it can also remember what it saw. Here it only has to
    remember: what is left is carrying one object through the hallway and comparing it with the one it finds at
    the junction. A memoryless policy still can only guess (the cue is out of view from the first step on)."""

    def reset(self, **kwargs):
        _, info = self.env.reset(**kwargs)
        grid = self.env.unwrapped
        grid.agent_pos, grid.agent_dir = np.array((1, grid.height // 2)), 0  # (1, middle row) is always empty
        return grid.gen_obs(), info


def make_atari(game: str, **kwargs):
    try:
        import ale_py
    except ImportError as e:
        raise ImportError(f"Atari envs need ale-py: pip install -e '.[atari]' ({e})") from None
    gym.register_envs(ale_py)
    # frameskip=1 in the ALE: AtariPreprocessing does the skipping (and max-pools the last two frames).
    env = gym.make(f"ALE/{game}-v5", frameskip=1, repeat_action_probability=0.0, **kwargs)
    env = gym.wrappers.AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84, grayscale_obs=True)
    env = gym.wrappers.TransformReward(env, lambda r: float(np.sign(r)))
    return ChannelsLast(gym.wrappers.FrameStackObservation(env, 4))


gym.register("AscentRL/MiniGridImg-Empty-5x5-v0", entry_point=make_minigrid_image)
for _game in ATARI_GAMES:
    # Kept below gymnasium's own 108k-frame limit; 27k agent steps = 108k frames at frame skip 4.
    gym.register(f"AscentRL/Atari-{_game}-v0", entry_point=make_atari, kwargs={"game": _game},
                 max_episode_steps=27_000)
