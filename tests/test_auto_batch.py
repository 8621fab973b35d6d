"""learner.batch_size: auto — the sizing rule by hand, the config checks, and a real run that uses it."""

import json

import pytest

from cluster import config as config_mod
from cluster import placement
from learner.spec import ModalityInput, PolicySpec
from tests.conftest import ROOT, train_to_end


def test_pick_batch_size_by_hand():
    # 1 MiB free, a quarter usable = 262144 bytes; 40-byte samples x 2 buffers -> 3276 samples fit;
    # multiples of 512 within [512, 65536]: 3072.
    assert placement.pick_batch_size(2**20, 40, 2, 512, 512, 65536, 0.25) == 3072
    # The upper bound wins when memory is plentiful.
    assert placement.pick_batch_size(2**40, 40, 2, 512, 512, 8192, 0.25) == 8192
    # Nothing in range fits: one clear error naming the setting.
    with pytest.raises(placement.ResourceError, match=r"learner.batch_size: auto found no batch in \[4096, 8192\]"):
        placement.pick_batch_size(2**20, 40, 2, 512, 4096, 8192, 0.25)


def test_sample_bytes():
    # CartPole: float32 obs, int64 action, 4 float32 columns (logp, value, advantage, return).
    cartpole = PolicySpec((ModalityInput("vector", "vector", (4,), "float32"),), "discrete", 2)
    assert cartpole.sample_nbytes == 16 + 8 + 16
    # An image stays uint8; a 3-dim continuous action is 3 float32.
    image = PolicySpec((ModalityInput("image", "image", (84, 84, 3), "uint8"),), "continuous", 3)
    assert image.sample_nbytes == 3 * 84 * 84 + 12 + 16


def test_auto_batch_config_checks():
    base = [f"learner.batch_size=auto"]
    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), base)
    assert cfg.learner.batch_size == "auto"
    assert config_mod.batch_granule(cfg) == 1024  # lcm(1024-sample fragments, 512-sample minibatches)
    with pytest.raises(config_mod.ConfigError, match="learner.batch_size_min: 4096 is larger than"):
        config_mod.load(str(ROOT / "configs/cartpole.yaml"), base + ["learner.batch_size_min=4096",
                                                                     "learner.batch_size_max=2048"])
    with pytest.raises(config_mod.ConfigError, match="learner.batch_size_max: 1500 leaves no batch"):
        config_mod.load(str(ROOT / "configs/cartpole.yaml"), base + ["learner.batch_size_min=1100",
                                                                     "learner.batch_size_max=1500"])
    with pytest.raises(config_mod.ConfigError, match="learner.batch_size: 'big'"):
        config_mod.load(str(ROOT / "configs/cartpole.yaml"), ["learner.batch_size=big"])


def test_auto_batch_is_decided_on_the_learner_host_and_used(ray_local, tmp_path):
    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "learner.batch_size=auto", "learner.batch_size_max=3072", "run.total_env_steps=12288",
        "run.target_return=null", "run.require_target=false"])
    result = train_to_end(cfg, tmp_path / "run")
    # Plenty of RAM here, so the upper bound decides; every iteration trained exactly that many samples.
    assert cfg.learner.batch_size == 3072
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert records[-1]["learner_samples"] == len(records) * 3072
    assert result.iterations == len(records)
