"""cluster/checkpoint.py on real checkpoint files (checkpoint.save of small payloads)."""

from __future__ import annotations

import pytest
import torch

from cluster import checkpoint


def _save(directory, name: str, iteration: int):
    payload = {"learner": {"model": {"w": torch.full((2,), float(iteration))}}, "run_state": {"iteration": iteration}}
    return checkpoint.save(directory / name, payload)


def test_latest_is_the_most_trained_checkpoint_not_a_stale_final(tmp_path):
    directory = tmp_path / "checkpoints"
    assert checkpoint.latest(tmp_path) is None
    final = _save(directory, "final.pt", 10)  # the first run stopped at iteration 10
    assert checkpoint.latest(tmp_path) == final
    # --resume reuses the directory: the resumed run's periodic checkpoint is newer than the old final.pt.
    ckpt = _save(directory, "ckpt-00000015.pt", 15)
    assert checkpoint.latest(tmp_path) == ckpt
    # ... until the resumed run writes its own final.pt.
    final = _save(directory, "final.pt", 20)
    assert checkpoint.latest(tmp_path) == final
    assert checkpoint.load(checkpoint.latest(tmp_path))["run_state"]["iteration"] == 20


def test_latest_prefers_final_on_a_tie_and_takes_periodic_ones_alone(tmp_path):
    directory = tmp_path / "checkpoints"
    _save(directory, "ckpt-00000003.pt", 3)
    newest = _save(directory, "ckpt-00000012.pt", 12)
    assert checkpoint.latest(tmp_path) == newest
    final = _save(directory, "final.pt", 12)  # stopped right after a periodic checkpoint: the same update
    assert checkpoint.latest(tmp_path) == final


def _tensors(value, path=""):
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{path}[{i}]")


@pytest.mark.parametrize("fused", ["true", pytest.param("false", marks=pytest.mark.long)])
def test_a_learners_state_is_a_host_copy_of_every_tensor_it_holds(tmp_path, fused):
    """What a learner hands the driver for a checkpoint (``LearnerActor.state``, also inside ``train_iteration``'s
    result) holds CPU tensors that share no storage with the learner's live ones: the model's weights and buffers
    and the optimizer's moments (which on a device would not load on a CPU-only head, and which the next update
    overwrites in place while the driver writes the checkpoint)."""
    from cluster import config as config_mod
    from cluster.driver import Trainer
    from tests.conftest import ROOT

    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "ray.address=inprocess", "run.total_env_steps=4096", "run.target_return=null", "run.require_target=false",
        "run.checkpoint_interval_s=null", f"learner.fused_update={fused}"])
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    try:
        trainer.build()
        trainer.run()
        learner = trainer.learners[0]._instance
        state = learner.state()
        live = {t.untyped_storage().data_ptr() for _, t in _tensors(learner.learner.model.state_dict())}
        live |= {t.untyped_storage().data_ptr() for _, t in _tensors(learner.learner.optimizer.state_dict())}
        held = list(_tensors(state))
        assert any(".exp_avg" in name for name, _ in held)  # the optimizer's moments are in it
        assert all(t.device.type == "cpu" for _, t in held)
        shared = [name for name, t in held if t.untyped_storage().data_ptr() in live]
        assert not shared, f"the learner's live tensors, not copies: {shared}"
    finally:
        trainer.shutdown()
