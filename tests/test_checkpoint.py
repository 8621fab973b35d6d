"""cluster/checkpoint.py on real checkpoint files (checkpoint.save of small payloads)."""

from __future__ import annotations

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
