"""cluster/export.py: a policy exported to ONNX (run with onnxruntime) or torch.export's .pt2 gives the actions and
values the policy gives in torch, on real env observations, with any batch size."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from cluster import checkpoint
from cluster import config as config_mod
from cluster.api import load_policy
from cluster.config import ConfigError
from cluster.export import export
from cluster.graph import describe_env
from learner.model import ActorCritic
from tests.conftest import ROOT

ort = pytest.importorskip("onnxruntime")


def saved_policy(tmp_path, overrides=(), config="configs/cartpole.yaml", tweak=None):
    """A checkpoint of an untrained model of ``config`` (weights moved off their init by ``tweak``)."""
    cfg = config_mod.load(str(ROOT / config), list(overrides))
    torch.manual_seed(0)
    model = ActorCritic(describe_env(cfg))
    if tweak:
        tweak(model)
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, {"learner": {"model": model.state_dict(), "version": 0}, "config": cfg.to_dict(),
                           "versions": checkpoint.package_versions()})
    return path


def observations(env, n, seed=0):
    obs, _ = env.reset(seed=seed)
    env.action_space.seed(seed)
    out = []
    for _ in range(n):
        out.append(obs)
        obs, _, term, trunc, _ = env.step(env.action_space.sample())
        if term or trunc:
            obs, _ = env.reset()
    return out


def test_cartpole_onnx_gives_the_policys_actions_and_values(tmp_path):
    policy = load_policy(saved_policy(tmp_path))
    result = export(policy, tmp_path / "policy.onnx")
    assert result["inputs"] == ["vector"] and result["max_abs_diff"] < 1e-5
    session = ort.InferenceSession(str(tmp_path / "policy.onnx"))
    env = policy.make_env()
    obs = np.stack(observations(env, 37)).astype(np.float32)  # a batch size the export never saw
    action, head, value = session.run(None, {"vector": obs})
    np.testing.assert_array_equal(action, policy.act(obs, deterministic=True))
    with torch.no_grad():
        expected = policy.model.value({"vector": torch.from_numpy(obs)}).numpy()
    np.testing.assert_allclose(value, expected, atol=1e-5)
    env.close()


def test_normalisation_statistics_travel_inside_the_graph_and_pt2_needs_only_torch(tmp_path):
    """Pendulum normalises observations in the model: with statistics far from (0, 1), the exported graph must
    apply them (raw observations in). The .pt2 file runs with torch alone."""
    def skew(model):
        for name, buf in model.named_buffers():
            if name.endswith("mean"):
                buf.add_(3.0)
            elif name.endswith("var"):
                buf.mul_(40.0)

    policy = load_policy(saved_policy(tmp_path, config="configs/pendulum.yaml", tweak=skew))
    assert any(n.endswith("mean") for n, _ in policy.model.named_buffers())
    for fmt in ("onnx", "pt2"):
        result = export(policy, tmp_path / f"policy.{fmt}", fmt)
        assert result["max_abs_diff"] < 1e-5, result
    env = policy.make_env()
    obs = np.stack(observations(env, 9)).astype(np.float32)
    action_onnx = ort.InferenceSession(str(tmp_path / "policy.onnx")).run(None, {"vector": obs})[0]
    program = torch.export.load(str(tmp_path / "policy.pt2")).module()
    action_pt2 = program(torch.from_numpy(obs))[0].detach().numpy()
    low, high = env.action_space.low, env.action_space.high
    np.testing.assert_allclose(np.clip(action_onnx, low, high), policy.act(obs, deterministic=True), atol=1e-5)
    np.testing.assert_allclose(action_pt2, action_onnx, atol=1e-5)
    env.close()


def test_an_action_mask_is_an_input_and_illegal_actions_never_come_out(tmp_path):
    cfg = ["env.id=actors.probe_envs:AscentRL/MaskedChoice-v0", "env.modalities={observation: {kind: vector}}"]
    policy = load_policy(saved_policy(tmp_path, cfg), trust_code=True)
    result = export(policy, tmp_path / "masked.onnx")
    assert result["inputs"] == ["observation", "action_mask"]
    session = ort.InferenceSession(str(tmp_path / "masked.onnx"))
    env = policy.make_env()
    raws = observations(env, 20)
    feed = {"observation": np.stack([r["observation"] for r in raws]).astype(np.float32),
            "action_mask": np.stack([r["action_mask"] for r in raws]).astype(bool)}
    action = session.run(None, feed)[0]
    assert all(r["action_mask"][a] for r, a in zip(raws, action))
    np.testing.assert_array_equal(action, policy.act(raws, deterministic=True))
    env.close()


def test_categorical_ids_are_one_hot_inside_the_graph(tmp_path):
    """configs/minigrid_memory.yaml's view is ids (env.modalities.image.categories): the exported graph takes the
    ids and one-hots them as the model does, on real minigrid observations (and the export's own check draws
    ids within their counts, not random floats)."""
    def spread(model):  # weights off their tiny policy-head init, so that the actions differ between inputs
        for p in model.parameters():
            p.data.normal_(0, 0.5)

    policy = load_policy(saved_policy(tmp_path, ["learner.rnn=null"], config="configs/minigrid_memory.yaml",
                                      tweak=spread), trust_code=True)
    result = export(policy, tmp_path / "grid.onnx")
    assert result["inputs"] == ["image", "direction"] and result["max_abs_diff"] < 1e-5, result
    env = policy.make_env()
    raws = observations(env, 40)
    inputs, _ = policy._inputs(raws)
    feed = {name: t.numpy() for name, t in inputs.items()}
    assert feed["image"].max() >= 5  # ids, not one-hot blocks, go in
    action, _, value = ort.InferenceSession(str(tmp_path / "grid.onnx")).run(None, feed)
    np.testing.assert_array_equal(action, policy.act(raws, deterministic=True))
    assert len(set(action.tolist())) > 1
    with torch.no_grad():
        np.testing.assert_allclose(value, policy.model.value(inputs).numpy(), atol=1e-5)
    env.close()


@pytest.mark.parametrize("rnn", ["gru", "lstm"])
def test_a_recurrent_policy_takes_and_returns_its_state_and_acts_as_the_policy_does(tmp_path, rnn):
    """1,000 steps of CartPole episodes through the ONNX graph against ``Policy.act`` (which keeps the state and is
    reset per episode): at every step the graph, given the state the policy holds going into it (zeros after an
    episode start), gives the policy's action and, as state_out, the state the policy holds after it, to 1e-5.
    (Given per step rather than fed back from the graph's own output: two chains of float32 steps drift apart by
    more than 1e-5 over an episode, in an LSTM's unbounded cell state.) Weights moved off their init so that the
    state matters."""
    def shake(model):
        torch.manual_seed(1)
        for param in model.parameters():
            param.data.add_(0.3 * torch.randn_like(param))

    policy = load_policy(saved_policy(tmp_path, [f"learner.rnn={rnn}"], tweak=shake))
    result = export(policy, tmp_path / "r.onnx")
    assert result["inputs"] == ["vector", "state"] and result["outputs"][-1] == "state_out", result
    assert result["max_abs_diff"] < 1e-5, result
    session = ort.InferenceSession(str(tmp_path / "r.onnx"))
    env = policy.make_env()
    obs, _ = env.reset(seed=0)
    policy.reset()
    zeros = np.zeros((1, policy.model.spec.state_size), np.float32)
    episodes, moved = 0, 0
    for _ in range(1000):
        state = zeros if policy.state is None else policy.state.numpy().copy()
        action, _, _, state_out = session.run(None, {"vector": obs[None].astype(np.float32), "state": state})
        assert int(action[0]) == int(policy.act(obs, deterministic=True))
        np.testing.assert_allclose(state_out, policy.state.numpy(), atol=1e-5)
        moved += not np.allclose(state_out, state, atol=1e-3)
        obs, _, term, trunc, _ = env.step(int(action[0]))
        if term or trunc:
            obs, _ = env.reset()
            policy.reset()
            episodes += 1
    assert episodes >= 2 and moved > 900, (episodes, moved)
    env.close()


def test_a_composite_action_comes_out_as_the_flat_vector_of_each_parts_mode(tmp_path):
    """A Dict action (a Box amount and a Discrete choice): ``action`` is the flat vector in the space's order, the
    mode of each part, the same as the policy's deterministic action in the env's own type."""
    cfg = ["env.id=actors.probe_envs:AscentRL/Match-Hybrid-v0"]
    policy = load_policy(saved_policy(tmp_path, cfg), trust_code=True)
    assert policy.model.spec.action_kind == "composite"
    result = export(policy, tmp_path / "c.onnx")
    assert result["max_abs_diff"] < 1e-5, result
    env = policy.make_env()
    obs = np.stack(observations(env, 50)).astype(np.float32)
    action = ort.InferenceSession(str(tmp_path / "c.onnx")).run(None, {"vector": obs})[0]
    assert action.shape == (50, 2)  # amount (Box (1,)), then choice (Discrete 3): the Dict's sorted keys
    for row, o in zip(action, obs):
        expected = policy.act(o, deterministic=True)
        assert int(row[1]) == int(expected["choice"])
        np.testing.assert_allclose(np.clip(row[:1], -1, 1), expected["amount"], atol=1e-5)
    env.close()


def test_what_cannot_be_exported_is_one_line_exit_2(tmp_path, monkeypatch):
    missing = tmp_path / "no-checkpoint"
    missing.mkdir()
    out = subprocess.run([sys.executable, "-m", "cluster.export", str(missing), "--out", str(tmp_path / "r.onnx")],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "is not a checkpoint file or a run directory with one" in out.stderr, out.stderr
    policy = load_policy(saved_policy(tmp_path))
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # an install without the export extra
    with pytest.raises(ConfigError, match=r"--format onnx: needs onnxscript \(pip install -e '.\[export\]'\)"):
        export(policy, tmp_path / "x.onnx")
    with pytest.raises(ConfigError, match=r"--format: 'tflite' is not a format; allowed: onnx, pt2"):
        export(policy, tmp_path / "x.tflite", "tflite")


def test_the_cli_exports_a_run_directorys_newest_checkpoint(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    saved_policy(tmp_path).rename(run / "checkpoints" / "final.pt")
    out = subprocess.run([sys.executable, "-m", "cluster.export", str(run), "--out", str(tmp_path / "p.onnx")],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "exported onnx to" in out.stdout and "inputs vector -> outputs action, head, value" in out.stdout
    diff = float(out.stdout.rsplit("torch ", 1)[1])
    assert diff < 1e-5
