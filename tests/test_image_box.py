"""Image Box envs: an H x W x C uint8 Box observation is one `image` modality, with no modality config.

Real minigrid env (ImgObsWrapper), real sampler, real model, and a real run (in process) that must learn.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from actors.envs import describe_env
from actors.sampler import RolloutSampler, SamplerSettings
from cluster import checkpoint
from cluster import config as config_mod
from learner.encoders import ImageEncoder, VectorEncoder
from learner.model import ActorCritic, state_dict_numpy
from pipeline import fragment as F
from tests.conftest import ROOT, env_spec, train_to_end

MINIGRID_IMAGE = "actors.wrapped_envs:AscentRL/MiniGridImg-Empty-5x5-v0"


def test_an_image_box_is_one_uint8_image_modality_with_the_cnn_encoder():
    (mod,) = describe_env(MINIGRID_IMAGE)["modalities"]
    assert (mod["name"], mod["kind"], mod["shape"], mod["dtype"]) == ("image", "image", (7, 7, 3), "uint8")
    model = ActorCritic(env_spec(MINIGRID_IMAGE, hidden_sizes=(128,)))
    assert isinstance(model.encoders["image"], ImageEncoder) and not model.state_only
    # A float Box stays on the vector path: CleanRL's MLP pair on the state, no encoder layer.
    cartpole = ActorCritic(env_spec("CartPole-v1"))
    assert isinstance(cartpole.encoders["vector"], VectorEncoder) and cartpole.state_only
    assert {k.split(".")[0] for k in cartpole.state_dict()} == {"actor", "critic"}


def test_image_box_fragments_stay_uint8_and_the_model_reads_them():
    spec = env_spec(MINIGRID_IMAGE, hidden_sizes=(128,))
    sampler = RolloutSampler(SamplerSettings(env_id=MINIGRID_IMAGE, num_envs=3, fragment_length=8, gamma=0.99,
                                             gae_lambda=0.95, seed=0), functools.partial(ActorCritic, spec))
    torch.manual_seed(0)
    model = ActorCritic(spec)
    sampler.load_weights(0, state_dict_numpy(model))
    try:
        frag = sampler.collect()
    finally:
        sampler.close()
    obs = frag.arrays[F.obs_key("image")]
    assert obs.dtype == np.uint8 and obs.shape == (8, 3, 7, 7, 3)
    assert sampler.pipeline is None and sampler.pipeline_stats() == {}  # no scheduler on a Box env's step
    # The stored log-probs are the model's on the stored uint8 images.
    logp, _, _ = model.evaluate({"image": torch.from_numpy(frag.flat(F.obs_key("image")))},
                                torch.from_numpy(frag.flat(F.ACTIONS)))
    np.testing.assert_allclose(logp.detach().numpy(), frag.flat(F.LOGP), rtol=1e-5, atol=1e-5)


@pytest.mark.long  # learning run to a threshold (`make test-long`; CI runs it)
def test_minigrid_image_box_learns_to_a_090_success_rate(tmp_path):
    """configs/minigrid_image.yaml as shipped (no env.modalities): the CNN learns Empty-5x5 from pixels.

    In process (the same job on threads): what is tested is the image path and its learning, not Ray; this saves
    starting the actor graph on Ray."""
    cfg = config_mod.load(str(ROOT / "configs/minigrid_image.yaml"), ["run.total_env_steps=300000",
                                                                       "run.progress_interval_s=1000",
                                                                       "ray.address=inprocess"])
    result = train_to_end(cfg, tmp_path)
    assert result.reached_target, result
    assert result.env_steps <= 300_000
    keys = checkpoint.load(tmp_path / "checkpoints" / "final.pt")["learner"]["model"]
    assert any(k.startswith("encoders.image.convs") for k in keys), sorted(keys)[:5]


def test_first_actions_keeps_a_discrete_envs_first_n_actions_and_refuses_what_it_cannot_keep():
    import gymnasium as gym
    import minigrid  # noqa: F401  (registers the MiniGrid ids)

    from actors.wrapped_envs import FirstActions

    env = FirstActions(gym.make("MiniGrid-MemoryS7-v0"), n=3)
    assert env.action_space == gym.spaces.Discrete(3)
    env.reset(seed=0)
    before = env.unwrapped.agent_dir
    env.step(0)  # turn left: the env's own action 0 reaches it unchanged
    assert env.unwrapped.agent_dir == (before - 1) % 4
    env.close()
    for n in (0, 8):
        with pytest.raises(ValueError, match=f"FirstActions\\(n={n}\\).*Discrete\\(7\\)"):
            FirstActions(gym.make("MiniGrid-MemoryS7-v0"), n=n)
    with pytest.raises(ValueError, match="needs a Discrete action space"):
        FirstActions(gym.make("Pendulum-v1"), n=1)


def test_memory_cue_in_view_starts_every_episode_with_the_cue_in_a_3x3_view_and_only_then():
    """The minigrid-cue bench task: at reset the start room's object is in the agent's 3x3 view, whatever the
    seed; one step east it is out of view (so a memoryless policy still has to guess at the junction)."""
    import gymnasium as gym
    import minigrid  # noqa: F401  (registers the MiniGrid ids)
    from minigrid.core.constants import OBJECT_TO_IDX

    from actors.wrapped_envs import MemoryCueInView

    env = MemoryCueInView(gym.make("MiniGrid-MemoryS7-v0", agent_view_size=3))
    cues = set()
    for seed in range(8):
        obs, _ = env.reset(seed=seed)
        grid = env.unwrapped
        cue = grid.grid.get(1, grid.height // 2 - 1).type
        cues.add(cue)
        assert OBJECT_TO_IDX[cue] in obs["image"][..., 0], (seed, cue)
        obs, *_ = env.step(2)  # forward, east
        assert not {OBJECT_TO_IDX["key"], OBJECT_TO_IDX["ball"]} & set(obs["image"][..., 0].ravel()), seed
    assert cues == {"key", "ball"}
    env.close()
