"""The non-finite guard: an update whose loss, gradient or weights come out NaN or inf is not applied and is counted;
``run.max_nonfinite_updates`` of them in a row stop the run with one line and exit 3 (``EXIT_DIVERGED``); no
checkpoint with a non-finite value is written; the config refuses coefficients and layer sizes that can only
overflow. Real torch, real runs (in process, and one on a local Ray with 2 learners), no mocks.

The runs diverge through ``tests/nonfinite_env.py``: CartPole whose reward turns NaN (for good) or inf (once).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from cluster import checkpoint
from cluster import config as config_mod
from learner.learner import NONFINITE, Learner, LearnerSettings
from learner.model import ActorCritic
from learner.ppo import LossCoefs
from learner.spec import ModalityInput, PolicySpec
from pipeline import fragment as F
from pipeline import metric_keys as M
from tests.conftest import ROOT
from tests.nonfinite_env import NONFINITE_ID

ENV = f"tests.nonfinite_env:{NONFINITE_ID}"


# ---------------------------------------------------------------------- the update
def _learner(path: str, normalize: bool = False, nonfinite_sync=None, **kw) -> Learner:
    mod = ModalityInput("vector", "vector", (4,), "float32", normalize=normalize)
    torch.manual_seed(0)
    model = ActorCritic(PolicySpec((mod,), "discrete", 2, hidden_sizes=(16, 16)))
    args = dict(lr=3e-3, adam_eps=1e-5, anneal_lr=False, total_updates=10, update_epochs=2, minibatch_size=32,
                max_grad_norm=0.5, coefs=LossCoefs(), seed=3,
                fused_update=path != "autograd", graphs="static" if path == "graphs" else "off")
    args.update(kw)
    learner = Learner(model, LearnerSettings(**args), torch.device("cpu"), nonfinite_sync=nonfinite_sync)
    assert learner.update_path.startswith("autograd" if path == "autograd" else "fused")
    return learner


def _batch(n: int = 64, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(n, generator=g)
    return {"obs/vector": torch.randn(n, 4, generator=g), F.ACTIONS: torch.randint(0, 2, (n,), generator=g),
            F.LOGP: torch.full((n,), -0.69), F.VALUES: torch.zeros(n), F.ADVANTAGES: adv, F.RETURNS: adv}


def _state(learner: Learner) -> list[torch.Tensor]:
    out = [t.detach().clone() for t in learner.model.state_dict().values()]
    opt = learner.optimizer.state_dict()["state"]
    return out + [v.clone() for s in opt.values() for v in s.values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("path", ["autograd", "fused", "graphs"])
@pytest.mark.parametrize("poison", ["returns", "advantages", "obs"])
def test_a_non_finite_update_is_undone_whole_and_named(path, poison):
    """A NaN or inf in one minibatch's rows: the update (all its epochs and minibatches, the finite ones before it
    too) is not applied: weights, Adam's state and step count, and the observation statistics are as before it;
    the result names what was not finite; the next finite update trains as usual."""
    learner = _learner(path, normalize=poison == "obs")
    first = learner.update(_batch(seed=1))  # Adam's state exists: its restore is checked too
    assert first[NONFINITE] is None
    before = _state(learner)
    steps_before = learner.optimizer.state_dict()["state"][0]["step"].item()
    batch = _batch(seed=2)
    bad = batch["obs/vector" if poison == "obs" else {"returns": F.RETURNS, "advantages": F.ADVANTAGES}[poison]]
    bad[5] = float("inf") if poison == "returns" else float("nan")
    out = learner.update(batch)
    assert out[NONFINITE], out
    assert out[NONFINITE].split()[0] in M.MINIBATCH_STATS + (M.GRAD_NORM, "the"), out[NONFINITE]
    after = _state(learner)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a non-finite update changed the learner's state"
    assert learner.optimizer.state_dict()["state"][0]["step"].item() == steps_before
    assert learner.updates_skipped_nonfinite == 1
    good = learner.update(_batch(seed=3))
    assert good[NONFINITE] is None
    assert not all(torch.equal(a, b) for a, b in zip(before, _state(learner)))
    assert all(torch.isfinite(t).all() for t in _state(learner))


@pytest.mark.parametrize("path", ["autograd", "fused"])
def test_a_first_update_that_is_not_finite_leaves_no_optimizer_state(path):
    """Before any step Adam has no state: an undone first update leaves none (and the next one starts at step 1)."""
    learner = _learner(path)
    weights = [t.clone() for t in learner.model.state_dict().values()]
    batch = _batch()
    batch[F.RETURNS][0] = float("nan")
    assert " nan" in learner.update(batch)[NONFINITE]
    assert learner.optimizer.state_dict()["state"] == {}
    assert all(torch.equal(a, b) for a, b in zip(weights, learner.model.state_dict().values()))
    assert learner.update(_batch(seed=4))[NONFINITE] is None
    assert learner.optimizer.state_dict()["state"][0]["step"].item() == 4  # 2 epochs x 2 minibatches


@pytest.mark.parametrize("path", ["autograd", "fused"])
def test_observation_statistics_that_turn_inf_are_caught_by_the_state_check(path):
    """An inf observation with normalised observations: the forward clips it (the loss and gradient stay finite),
    but the running statistics the update folds it into do not; only the check of the state sees it, and the
    update, statistics included, is not applied."""
    learner = _learner(path, normalize=True)
    before = _state(learner)
    batch = _batch()
    batch["obs/vector"][3, 1] = float("inf")
    out = learner.update(batch)
    assert out[NONFINITE] and out[NONFINITE].startswith("the weights"), out
    assert all(torch.isfinite(torch.tensor(out[k])) for k in M.MINIBATCH_STATS + (M.GRAD_NORM,))
    assert all(torch.equal(a, b) for a, b in zip(before, _state(learner)))


@pytest.mark.parametrize("path", ["autograd", "fused"])
def test_a_rank_undoes_a_finite_update_when_another_rank_flags_its_own(path):
    """The decision reads the flag reduced over the ranks, not this rank's own: with a peer whose update was not
    finite (the mean of the flags is 0.5), a rank whose own update was finite undoes it too, so the ranks' weights
    never part. (``nonfinite_sync`` is the learners' mean all-reduce; here, the mean with such a peer.)"""
    learner = _learner(path, nonfinite_sync=lambda flag: (flag + 1.0) / 2)
    before = _state(learner)
    out = learner.update(_batch())
    assert out[NONFINITE], out
    assert all(torch.equal(a, b) for a, b in zip(before, _state(learner)))
    alone = _learner(path, nonfinite_sync=lambda flag: flag / 2)  # a peer whose update was finite
    assert alone.update(_batch())[NONFINITE] is None


# ---------------------------------------------------------------------- checkpoints
def test_a_checkpoint_with_a_non_finite_value_is_refused_and_nothing_is_written(tmp_path):
    path = tmp_path / "checkpoints" / "ckpt-00000003.pt"
    payload = {"learner": {"model": {"actor.0.weight": torch.tensor([1.0, float("nan")])},
                           "optimizer": {"state": {}}}, "run_state": {"iteration": 3}}
    with pytest.raises(checkpoint.NonFiniteCheckpoint) as e:
        checkpoint.save(path, payload)
    text = str(e.value)
    assert "\n" not in text and "learner.model.actor.0.weight" in text and "nan" in text, text
    assert not path.exists() and not list(path.parent.glob(".*"))
    payload["learner"]["model"]["actor.0.weight"] = torch.tensor([1.0, 2.0])
    checkpoint.save(path, payload)
    assert path.is_file()


# ---------------------------------------------------------------------- the config
@pytest.mark.parametrize("override", ["ppo.vf_coef=1e308", "ppo.ent_coef=1e308", "ppo.max_grad_norm=1e308",
                                      "ppo.clip_coef=1e308", "ppo.gamma=1e308", "ppo.gae_lambda=1e308",
                                      "learner.lr=1e308", "learner.adam_eps=1e308", "ppo.target_kl=1e308",
                                      "ppo.ent_coef_end=1e308", "learner.fp16_init_scale=1e308",
                                      "learner.fp16_growth_factor=1e308", "run.max_nonfinite_updates=1e308"])
def test_coefficients_that_can_only_overflow_are_one_config_error_line(override):
    key = override.split("=")[0]
    with pytest.raises(config_mod.ConfigError) as e:
        config_mod.load(str(ROOT / "configs/cartpole.yaml"), [override])
    text = str(e.value)
    assert "\n" not in text and text.startswith(key) and "out of range" in text, text


def test_layer_sizes_whose_weights_alone_exceed_memory_are_one_config_error_line():
    for overrides in (["learner.hidden_sizes=[65536, 65536, 65536, 65536, 65536, 65536]"],
                      ["learner.rnn=lstm", "learner.rnn_hidden_size=65536", "learner.hidden_sizes=[65536]"]):
        with pytest.raises(config_mod.ConfigError) as e:
            config_mod.load(str(ROOT / "configs/cartpole.yaml"), overrides)
        text = str(e.value)
        assert "\n" not in text and "weights" in text and "allowed" in text, text
    config_mod.load(str(ROOT / "configs/cartpole.yaml"), ["learner.hidden_sizes=[4096, 4096]"])  # 134 MB: fine


def test_the_cli_refuses_a_huge_value_coefficient_in_one_line_with_exit_2():
    proc = subprocess.run([sys.executable, "-m", "cluster.train", "--config", "configs/cartpole.yaml", "--dry-run",
                           "--set", "ppo.vf_coef=1e308"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: ppo.vf_coef: 1e+308 is out of range"), lines


# ---------------------------------------------------------------------- whole runs
def _run_cli(run_dir, *sets: str, resume: bool = False, timeout: int = 300) -> subprocess.CompletedProcess:
    base = ["ray.address=inprocess", f"env.id={ENV}", "rollout.num_actors=1", "rollout.envs_per_actor=4",
            "rollout.fragment_length=32", "learner.batch_size=256", "learner.minibatch_size=128",
            "replay.max_policy_lag=0", "run.checkpoint_interval_s=0.001", "run.keep_checkpoints=2",
            "run.progress_interval_s=1000", "run.target_return=null", "run.require_target=false", "run.loggers=[jsonl]"]
    args = ["--resume", str(run_dir), "--trust-code"] if resume else ["--config", "configs/cartpole.yaml",
                                                                      "--run-dir", str(run_dir)]
    for item in (base if not resume else []) + list(sets):
        args += ["--set", item]
    return subprocess.run([sys.executable, "-m", "cluster.train", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _checkpoints_are_finite(run_dir) -> list[str]:
    names = []
    for path in sorted((run_dir / "checkpoints").glob("*.pt")):
        payload = checkpoint.load(path)
        assert checkpoint.first_nonfinite(payload) is None, path
        names.append(path.name)
    return names


def test_a_diverging_run_stops_with_exit_3_one_line_and_only_finite_checkpoints_then_resumes(tmp_path):
    """Rewards turn NaN for good after 1,500 env steps: from then on every update is skipped and counted, the third
    in a row stops the run with exit 3 and one line naming the metric, the iteration and the last finite
    checkpoint; checkpoints/ holds only finite checkpoints, the newest periodic ones kept; --resume of the directory
    (the env healed) trains on from the last finite state to the end."""
    run_dir = tmp_path / "run"
    proc = _run_cli(run_dir, "env.kwargs={nan_after: 1500}", "run.total_env_steps=20000")
    assert proc.returncode == 3, proc.stderr[-3000:]
    stopped = [line for line in proc.stderr.splitlines() if line.startswith("run stopped:")]
    assert len(stopped) == 1, proc.stderr[-3000:]
    assert "3 updates in a row" in stopped[0] and "iteration " in stopped[0] and " nan" in stopped[0], stopped
    assert "the last finite checkpoint is " in stopped[0] and "final.pt" in stopped[0], stopped
    assert "Traceback" not in proc.stderr
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert all(M.UPDATES_SKIPPED_NONFINITE in r for r in records)
    assert records[-1][M.UPDATES_SKIPPED_NONFINITE] == 3
    assert records[0][M.UPDATES_SKIPPED_NONFINITE] == 0
    names = _checkpoints_are_finite(run_dir)
    assert "final.pt" in names and len([n for n in names if n.startswith("ckpt-")]) == 2, names
    final = checkpoint.load(run_dir / "checkpoints" / "final.pt")
    assert final["stop_reason"] == "diverged"
    # The env healed: the same directory resumes from its last finite state and runs to its end.
    resumed = _run_cli(run_dir, "env.kwargs={nan_after: null}", resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "done: total_env_steps" in resumed.stderr
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert records[-1][M.ENV_STEPS] >= 20000 and records[-1][M.UPDATES_SKIPPED_NONFINITE] == 3
    _checkpoints_are_finite(run_dir)


def test_a_single_inf_reward_skips_one_update_and_the_run_goes_on(tmp_path):
    """An inf reward once (at one step of the one actor's envs, so in one fragment): the one update whose batch holds
    it is not applied and is counted; the run goes on to its end, exit 0, every checkpoint finite."""
    run_dir = tmp_path / "run"
    proc = _run_cli(run_dir, "env.kwargs={inf_at: 700}", "run.total_env_steps=6000")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: total_env_steps" in proc.stderr
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert records[-1][M.UPDATES_SKIPPED_NONFINITE] == 1
    assert sum(1 for r in records if r[M.UPDATES_SKIPPED_NONFINITE] == 1) >= 2  # it went on after the skip
    _checkpoints_are_finite(run_dir)


@pytest.mark.long  # two learners on Ray (~25 s): `make test-long`, as test_env_faults.py's, for make test's 8 minutes
@pytest.mark.usefixtures("no_leftover_actors")
def test_two_learners_on_ray_skip_together_and_stop_with_exit_3(tmp_path, ray_local):
    """Two learners on a local Ray: the flag is all-reduced, so both undo the same updates (their weights stay
    equal) and the run stops on the third in a row."""
    from cluster.driver import Trainer

    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        f"env.id={ENV}", "env.kwargs={nan_after: 1500}", "learner.num_learners=2", "learner.placement_resource=none",
        "rollout.num_actors=2", "rollout.envs_per_actor=4", "rollout.fragment_length=32", "learner.batch_size=256",
        "learner.minibatch_size=128", "replay.max_policy_lag=0", "run.total_env_steps=20000",
        "run.target_return=null", "run.require_target=false", "run.checkpoint_interval_s=null", "run.progress_interval_s=1000",
        "run.loggers=[jsonl]"])
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    try:
        trainer.build()
        result = trainer.run()
        params = [ray_local.get(lr.flat_params.remote(), timeout=30) for lr in trainer.learners]
    finally:
        trainer.shutdown()
    assert result.reason == "diverged" and trainer.diverged, trainer.failure
    assert "3 updates in a row" in trainer.failure
    assert (params[0] == params[1]).all()
    assert np.isfinite(params[0]).all()
    _checkpoints_are_finite(tmp_path / "run")
