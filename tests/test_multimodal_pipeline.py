"""The multimodal path end to end: bad input, corrupt images, the remote preprocessing tier, a real run.

Environments are the real multi-rate sensor env, subclassed to misbehave on
purpose (corrupt PNG bytes, a wrong-shaped vector) at known steps.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from actors.sampler import RolloutSampler, SamplerSettings
from actors.multirate_env import ENV_ID, MODALITIES
from cluster import config as config_mod
from learner.model import ActorCritic, state_dict_numpy
from pipeline import fragment as F
from pipeline.contract import ModalitySpec
from pipeline.modality import CorruptObservation, ObservationError

from conftest import env_spec, train_to_end
from misbehaving_env import BAD_PROPRIO_ID, MISBEHAVING_ID


def make_sampler(env_kwargs: dict, camera_policy: str = "fail", workers: int = 2, remote=None, num_envs=4,
                 as_objects: bool = False):
    """``as_objects``: hand the sampler the config's spec objects (cfg.env.modalities) instead of plain dicts."""
    modalities = {name: dict(d) for name, d in MODALITIES.items()}
    modalities["camera"]["on_corrupt"] = camera_policy
    if as_objects:
        modalities = config_mod.from_dict({"env": {"modalities": modalities}}).env.modalities
    spec = env_spec(ENV_ID, hidden_sizes=(64,), modalities=modalities)
    torch.manual_seed(0)
    sampler = RolloutSampler(SamplerSettings(env_id=MISBEHAVING_ID, env_kwargs=env_kwargs, num_envs=num_envs,
                                             fragment_length=16, gamma=0.99, gae_lambda=0.95, seed=1,
                                             modalities=modalities, preprocess_workers=workers),
                             lambda: ActorCritic(spec), remote_preprocess=remote)
    sampler.load_weights(0, state_dict_numpy(ActorCritic(spec)))
    return sampler


def test_spec_objects_and_their_plain_data_give_the_same_fragment():
    """The rollout side takes the config's spec objects as they are (Ray pickles them), or today's dicts."""
    fragments = []
    for as_objects in (False, True):
        sampler = make_sampler({}, as_objects=as_objects)
        try:
            assert all(isinstance(s, ModalitySpec) for s in sampler.pipeline.specs.values())
            fragments.append(sampler.collect())
        finally:
            sampler.close()
    dicts, objects = fragments
    assert dicts.arrays.keys() == objects.arrays.keys()
    for key, value in dicts.arrays.items():
        assert np.array_equal(value, objects.arrays[key]), key


def test_corrupt_camera_with_drop_episode_abandons_and_counts_never_a_silent_wrong_tensor():
    sampler = make_sampler({"corrupt_every": 37}, camera_policy="drop_episode")
    try:
        fragments = [sampler.collect() for _ in range(4)]
        stats = sampler.pipeline_stats()
    finally:
        sampler.close()
    assert stats["episodes_dropped"] >= 3, stats
    assert stats["corrupt_inputs"] == stats["episodes_dropped"]
    for frag in fragments:
        camera = frag.arrays[F.obs_key("camera")]
        # Every image an action was taken on is a real frame: the agent's white pixels are always in it.
        assert (camera.reshape(-1, 20 * 20 * 3).max(axis=1) == 255).all()
    # Abandoned episodes end in a truncation (bootstrapped), never in a fake termination.
    truncations = sum(int(f.arrays[F.TRUNCATED].sum()) for f in fragments)
    assert truncations >= stats["episodes_dropped"] - 1  # one may be at the very first reset


def test_corrupt_camera_with_fail_stops_with_an_error_naming_the_modality():
    sampler = make_sampler({"corrupt_every": 37}, camera_policy="fail")
    try:
        with pytest.raises(CorruptObservation, match="'camera'"):
            for _ in range(4):
                sampler.collect()
    finally:
        sampler.close()


def test_wrong_shape_observation_is_one_clear_error_with_expected_and_received():
    sampler = make_sampler({"bad_proprio_at": 10})
    try:
        with pytest.raises(ObservationError) as err:
            sampler.collect()
    finally:
        sampler.close()
    msg = str(err.value)
    assert "'proprio'" in msg and "(4,)" in msg and "(3,)" in msg and "\n" not in msg


@pytest.mark.parametrize("override, words", [
    ("env.modalities.proprio.kind=image", ["proprio"]),
    ("env.modalities.sonar.kind=audio", ["sonar", "camera"]),
    ("env.modalities.instruction.vocab=null", ["instruction", "vocab"]),
])
def test_modality_spec_that_does_not_fit_the_env_is_a_config_error_before_training(ray_local, tmp_path, override,
                                                                                   words):
    """The driver checks the specs against one throwaway env before any actor exists; the CLI turns the
    ConfigError into one line and exit code 2 (tested with the other config errors in test_config.py)."""
    from cluster.driver import Trainer

    cfg = config_mod.load("configs/multirate.yaml", [override, "run.total_env_steps=2048"])
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    try:
        with pytest.raises(config_mod.ConfigError) as err:
            trainer.build()
        assert not trainer.rollouts and not trainer.learners
    finally:
        trainer.shutdown()
    msg = str(err.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_remote_preprocessing_tier_gives_the_same_values(ray_local):
    from actors.preprocess_worker import RemotePreprocessWorker

    # Spec objects, pickled by Ray (the driver's run in test_multirate_config_runs_and_reports... sends plain dicts).
    specs = config_mod.from_dict({"env": {"modalities": MODALITIES}}).env.modalities
    slow = {n: m for n, m in specs.items() if not m.is_fast}
    worker = RemotePreprocessWorker.remote("actors.multirate_env:" + ENV_ID, slow)  # a fresh process: import it
    sampler = make_sampler({}, remote=worker)
    try:
        frag = sampler.collect()
        processors = sampler.pipeline.processors
        stats = ray_local.get(worker.stats.remote())
    finally:
        sampler.close()
        ray_local.kill(worker)
    assert stats["jobs"] > 0
    # Slow values computed remotely equal local processing of the same raw input (the instruction is the same
    # text in every step of an episode; check the ids decode to that env's instruction words).
    ids = frag.arrays[F.obs_key("instruction")]
    vocab = processors["instruction"].vocab
    words = {" ".join(vocab[i - 2] for i in row if i >= 2) for row in ids.reshape(-1, ids.shape[-1])}
    assert all(w.startswith("go to the ") and w.endswith(" beacon") for w in words), words


# Without remote preprocess actors the run is in process (the rollout's pipeline and its metrics are the same code in
# either mode, and no actor graph starts on Ray); with one, on Ray, which that tier needs.
# The Ray case is `long` (`make test-long`; CI runs it): remote preprocess workers on Ray are in test_env_faults.py.
@pytest.mark.parametrize("remote_actors, address", [(0, "inprocess"), pytest.param(1, "null", marks=pytest.mark.long)],
                         ids=["0-inprocess", "1-ray"])
def test_multirate_config_runs_and_reports_pipeline_metrics(ray_local, tmp_path, remote_actors, address):
    cfg = config_mod.load("configs/multirate.yaml", [
        "run.total_env_steps=4096", "run.target_return=null", f"preprocess.remote_actors={remote_actors}",
        "rollout.envs_per_actor=8", "learner.batch_size=512", "learner.minibatch_size=256", f"ray.address={address}",
    ])
    result = train_to_end(cfg, tmp_path / "run")
    assert result.env_steps >= 4096
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    last = records[-1]
    for key in ("preprocess/fast/wait_p99_ms", "preprocess/slow/service_p99_ms", "preprocess/slow/deadline_misses",
                "align/lidar/waits", "align/lidar/max_staleness", "episode_success_rate", "episodes_dropped"):
        assert key in last, key
    assert last["align/lidar/max_staleness"] <= 3  # every 4 steps, bound every - 1
    assert last["preprocess/fast/completed"] > 0 and last["preprocess/slow/completed"] > 0


def test_bad_observation_in_a_run_stops_it_with_the_cause_and_a_checkpoint(tmp_path):
    """Every fresh actor's first step is malformed: a replacement would fail the same way, so after three in a row
    the run ends with the cause (cluster/supervisor.py's repeat rule). In process: the rule is the supervisor's, the
    same in both modes, and three multimodal rollout processes started on Ray cost more than the rest of the test."""
    cfg = config_mod.load("configs/multirate.yaml", [
        f"env.id=tests.misbehaving_env:{BAD_PROPRIO_ID}", "env.kwargs.bad_proprio_at=2", "ray.address=inprocess",
        "run.total_env_steps=100000", "run.target_return=null",
        "rollout.envs_per_actor=8", "learner.batch_size=512", "learner.minibatch_size=256"])
    from cluster.driver import Trainer

    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    try:
        trainer.build()
        result = trainer.run()
    finally:
        trainer.shutdown()
    assert result.reason == "failed"
    assert "ObservationError" in trainer.failure and "'proprio'" in trainer.failure and "(3,)" in trainer.failure
    assert "3 fresh actors in a row" in trainer.failure
    assert result.checkpoint_path is not None and result.checkpoint_path.exists()


@pytest.mark.long  # a second model of test_integration.py's two-learner test (`make test-long`; CI runs it)
def test_two_learners_keep_identical_weights_and_normaliser_statistics(ray_local, tmp_path):
    """Each learner folds its own half of the batch into the running statistics; the all-reduce must leave every
    rank with the same buffers (and the same weights), or the ranks would train different models."""
    from cluster.driver import Trainer

    cfg = config_mod.load("configs/multirate.yaml", [
        "run.total_env_steps=4096", "run.target_success_rate=null", "learner.num_learners=2",
        "rollout.num_actors=2", "rollout.envs_per_actor=8", "replay.num_shards=2", "learner.batch_size=512",
        "learner.minibatch_size=256", "ray.num_cpus=4"])
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    try:
        trainer.build()
        trainer.run()
        states = ray_local.get([lr.state.remote() for lr in trainer.learners])
    finally:
        trainer.shutdown()
    first, second = (s["model"] for s in states)
    buffers = [k for k in first if k.endswith(("running_mean", "running_var", "running_count"))]
    assert buffers, "the multi-rate model normalises its proprioception"
    assert float(first[buffers[0].replace("running_mean", "running_count")]) > 1000  # statistics were updated
    for key in first:
        assert torch.equal(first[key], second[key]), key
