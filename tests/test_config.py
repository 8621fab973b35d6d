"""The config schema (cluster/config.py) and the CLI's config-error path (cluster/train.py).

A bad config must cost milliseconds and one line: ``config error: <key path>: <bad value> ... <what is allowed>``
on stderr, exit code 2, no traceback, and Ray never imported. No test here starts Ray; the only subprocesses that
import it (without starting it) are the two successful ``--dry-run`` runs.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import random
import re
import subprocess
import sys
import typing
from collections import Counter
from pathlib import Path

import pytest
import yaml

from cluster import config as C
from cluster.config import Config, ConfigError

ROOT = Path(__file__).resolve().parents[1]
CARTPOLE = ROOT / "configs" / "cartpole.yaml"
SHIPPED_CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


# --------------------------------------------------------------------------- helpers


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.train", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def assert_config_error(proc: subprocess.CompletedProcess, *expected: str) -> str:
    """Exit 2, exactly one stderr line 'config error: ...' holding every ``expected`` substring; returns the line."""
    both = proc.stdout + proc.stderr
    assert "Traceback" not in both, both
    assert proc.returncode == 2, f"rc={proc.returncode}\nstdout={proc.stdout!r}\nstderr={proc.stderr!r}"
    assert proc.stdout == "", proc.stdout
    line = proc.stderr.strip()
    assert line, "stderr is empty"
    assert len(line.splitlines()) == 1, f"stderr is not one line:\n{proc.stderr}"
    assert line.startswith("config error:"), line
    for s in expected:
        assert s in line, f"{s!r} not in {line!r}"
    return line


def plain(obj):
    """Tuples -> lists and config sections (env.wrappers' entries) -> dicts: what YAML round-trips."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return C.plain_data(dataclasses.asdict(obj))
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return C.plain_data(obj)


def section_classes() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


#: Where the fuzz puts a modality's settings: a concrete key under env.modalities (the table writes `<key>`).
MODALITY_SECTION = "env.modalities.cam"


def leaf_specs(modality_section: str = MODALITY_SECTION) -> list[tuple[str, str, typing.Any, typing.Mapping]]:
    """(section, name, annotation, metadata) for every setting in the schema; modality fields under one key."""
    out = []
    classes = section_classes()
    classes[modality_section] = C.ModalitySpec
    classes["env.limits"] = C.EnvLimitsConfig  # a section inside a section: its settings are fuzzed as its own
    for section, cls in classes.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not dataclasses.is_dataclass(hints[f.name]):
                out.append((section, f.name, hints[f.name], f.metadata))
    return out


def fuzz_base() -> dict:
    """Valid defaults plus one modality with default settings, so modality fields can be fuzzed too."""
    data = Config().to_dict()
    data["env"]["modalities"] = {"cam": dataclasses.asdict(C.ModalitySpec())}
    return copy.deepcopy(plain(data))


def node(data, section: str):
    """The section at a dotted path: of a config's plain data, or of a Config."""
    for part in section.split("."):
        data = data[part] if isinstance(data, dict) else getattr(data, part)
    return data


def default_of(section: str, name: str):
    obj = C.ModalitySpec() if section == MODALITY_SECTION else node(Config(), section)
    return getattr(obj, name)


def unwrap_optional(tp) -> tuple[type, bool]:
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        assert len(args) == 1, tp
        return args[0], True
    return tp, False


# --------------------------------------------------------------------------- shipped configs


def test_default_config_is_shipped():
    assert CARTPOLE in SHIPPED_CONFIGS


def test_schema_defaults_validate():
    cfg = C.validate(Config())
    assert cfg.learner.batch_size % cfg.fragment_samples == 0


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda p: p.name)
def test_shipped_config_loads_and_validates(path):
    cfg = C.load(str(path))
    assert isinstance(cfg, Config)
    C.validate(cfg)
    # Every key the file sets is what the loaded config holds (nothing silently dropped or defaulted).
    raw = yaml.safe_load(path.read_text()) or {}
    for section, values in raw.items():
        for key, value in (values or {}).items():
            if isinstance(value, str) and "e" in value.lower():
                try:
                    value = float(value)  # PyYAML reads 1e-3 (no dot) as a string; the loader means a float
                except ValueError:
                    pass
            got = getattr(getattr(cfg, section), key)
            if isinstance(value, dict) and all(isinstance(e, dict) for e in value.values()):
                # a mapping of sections (env.modalities): every key it sets, per entry
                for name, entry in value.items():
                    for field_name, v in entry.items():
                        loaded = getattr(got[name], field_name)
                        assert plain(loaded) == plain(v), f"{section}.{key}.{name}.{field_name}: {v!r} vs {loaded!r}"
                continue
            if dataclasses.is_dataclass(got):  # a section inside a section (env.limits): every key it sets
                for name, v in value.items():
                    assert plain(getattr(got, name)) == plain(v), f"{section}.{key}.{name}: {v!r} vs {got!r}"
                continue
            assert plain(got) == plain(value), f"{section}.{key}: file {value!r}, loaded {got!r}"


def test_cartpole_values_come_from_the_file():
    cfg = C.load(str(CARTPOLE))
    assert cfg.run.require_target is True and cfg.run.target_return == 475.0
    assert cfg.ppo.update_epochs == 8  # schema default 4
    assert cfg.learner.lr == pytest.approx(1.5e-3) and isinstance(cfg.learner.lr, float)  # schema default 1e-3
    assert cfg.learner.batch_size == 1024  # schema default 2048


def test_scientific_notation_in_yaml_file_is_a_float(tmp_path):
    """PyYAML reads 1e-3 (no dot) as a string; the loader turns it into the float the user meant."""
    path = tmp_path / "sci.yaml"
    path.write_text("learner:\n  lr: 1e-3\n  adam_eps: 1E-8\nrun:\n  target_return: 1e2\n")
    assert yaml.safe_load(path.read_text())["learner"]["lr"] == "1e-3"  # the premise
    cfg = C.load(str(path))
    assert cfg.learner.lr == 0.001 and cfg.learner.adam_eps == 1e-8 and cfg.run.target_return == 100.0


@pytest.mark.parametrize("name, value", [
    ("ppo.gamma", 0.0), ("ppo.gamma", 1.0), ("ppo.gae_lambda", 1.0), ("replay.max_policy_lag", 0),
    ("ppo.update_epochs", 1000), ("rollout.num_actors", 4096), ("learner.lr", 1.0), ("ppo.vf_coef", 0),
    ("rollout.num_cpus_per_actor", 0), ("run.seed", 0), ("run.seed", 2**31 - 1), ("learner.prefetch_batches", 16),
])
def test_inclusive_bounds_are_accepted(name, value):
    section, key = name.split(".")
    cfg = C.from_dict({section: {key: value}})
    got = getattr(getattr(cfg, section), key)
    assert got == value
    tp = next(t for (s, n, t, _) in leaf_specs() if s == section and n == key)
    assert type(got) is unwrap_optional(tp)[0]  # ints widen to float for float fields


# --------------------------------------------------------------------------- bad configs through the CLI

# (yaml text, key path, bad value as it appears in the message, what is allowed). "{file}" is the config's path.
BAD_CONFIGS = [
    pytest.param("lerner:\n  lr: 0.001\n", "lerner", "lerner",
                 "unknown key (did you mean 'learner'?); allowed keys here: env, eval, learner, multiagent, ppo", id="unknown-section"),
    pytest.param("learner:\n  lrr: 0.001\n", "learner.lrr", "lrr", "(did you mean 'learner.lr'?)",
                 id="unknown-nested-key"),
    pytest.param("rollout:\n  num_actors: four\n", "rollout.num_actors", "'four'", "is not an integer",
                 id="str-for-int"),
    pytest.param("rollout:\n  num_actors: true\n", "rollout.num_actors", "True", "is not an integer",
                 id="bool-for-int"),
    pytest.param("ppo:\n  gamma: high\n", "ppo.gamma", "'high'", "is not a number", id="str-for-float"),
    pytest.param("learner:\n  lr: null\n", "learner.lr", "None", "is not a number", id="null-for-float"),
    pytest.param("ppo:\n  norm_adv: 1\n", "ppo.norm_adv", "1", "allowed: true or false", id="int-for-bool"),
    pytest.param("env:\n  id: 5\n", "env.id", "5", "is not a string", id="int-for-str"),
    pytest.param("learner:\n  hidden_sizes: 64\n", "learner.hidden_sizes", "64",
                 "is not a non-empty list of positive integers", id="hidden-sizes-scalar"),
    pytest.param("learner:\n  hidden_sizes: '64,64'\n", "learner.hidden_sizes", "'64,64'",
                 "is not a non-empty list of positive integers", id="hidden-sizes-string"),
    pytest.param("learner:\n  hidden_sizes: [64, 0]\n", "learner.hidden_sizes", "[64, 0]",
                 "is not a non-empty list of positive integers", id="hidden-sizes-zero-width"),
    pytest.param("learner: 5\n", "learner", "5", "expected a mapping of keys", id="section-not-mapping"),
    pytest.param("rollout:\n  num_actors: 0\n", "rollout.num_actors", "0", "out of range; allowed: >= 1",
                 id="num-actors-zero"),
    pytest.param("ppo:\n  gamma: 1.5\n", "ppo.gamma", "1.5", "out of range; allowed: <= 1.0", id="gamma-above-1"),
    pytest.param("learner:\n  lr: 0\n", "learner.lr", "0.0", "out of range; allowed: > 0.0", id="lr-zero-exclusive"),
    pytest.param("run:\n  time_budget_s: 0\n", "run.time_budget_s", "0.0", "allowed: > 0.0",
                 id="time-budget-zero-exclusive"),
    pytest.param("run:\n  seed: -1\n", "run.seed", "-1", "allowed: >= 0", id="negative-seed"),
    pytest.param("run:\n  seed: 2147483648\n", "run.seed", "2147483648", "allowed: <= 2147483647",
                 id="seed-above-int32"),
    pytest.param("env:\n  max_episode_steps: 0\n", "env.max_episode_steps", "0", "allowed: >= 1",
                 id="optional-int-below-min"),
    pytest.param("learner:\n  device: tpu\n", "learner.device", "'tpu'", "allowed: auto, cpu, cuda, npu",
                 id="device-bad-choice"),
    # YAML 1.1 reads a bare `on` as true: the error says so, with the choices.
    pytest.param("learner:\n  graphs: on\n", "learner.graphs", "True (YAML reads a bare on, yes or true so)",
                 "allowed: auto, off", id="graphs-on"),
    pytest.param("learner:\n  batch_size: 2048\n  minibatch_size: 4096\n", "learner.minibatch_size", "4096",
                 "is larger than learner.batch_size (2048); allowed: <= 2048", id="minibatch-larger-than-batch"),
    pytest.param("learner:\n  num_learners: 3\n", "learner.batch_size", "2048",
                 "not divisible by learner.num_learners (3); allowed: a multiple of 3", id="batch-not-divisible"),
    pytest.param("learner:\n  num_learners: 2\n  batch_size: 4096\n  minibatch_size: 511\n",
                 "learner.minibatch_size", "511", "allowed: a multiple of 2", id="minibatch-not-divisible"),
    pytest.param("learner:\n  minibatch_size: 768\n", "learner.batch_size", "2048",
                 "not a multiple of learner.minibatch_size (768)", id="batch-not-multiple-of-minibatch"),
    pytest.param("learner:\n  num_learners: 2\n", "learner.batch_size", "2048",
                 "not a whole number of fragments of rollout.fragment_length x rollout.envs_per_actor = 2048; "
                 "allowed: a multiple of 4096", id="batch-not-whole-fragments"),
    pytest.param("replay:\n  num_shards: 2\n", "replay.num_shards", "2",
                 "more than rollout.num_actors (1), so some shard would never be fed; allowed: <= 1",
                 id="more-shards-than-actors"),
    pytest.param("run:\n  total_env_steps: 1000\n", "run.total_env_steps", "1000",
                 "less than one batch (learner.batch_size = 2048); allowed: >= 2048", id="steps-below-one-batch"),
    pytest.param("run:\n  require_target: true\n", "run.require_target", "true",
                 "needs run.target_return or run.target_success_rate to be set; allowed: a number",
                 id="require-target-without-target"),
    pytest.param("learner:\n  lr: 0.001\n bad: x\n", "{file}", "line 3", "is not valid YAML", id="invalid-yaml"),
    pytest.param("learner: [1, 2\n", "{file}", "line 2", "is not valid YAML", id="invalid-yaml-unclosed"),
    pytest.param("- learner\n- ppo\n", "{file}", "got list", "top level must be a mapping of sections",
                 id="top-level-list"),
    pytest.param("learner:\n  lr: 0.001\n  batch_size: 1024\n\n  lr: 0.002\n", "{file}", "learner.lr is given twice",
                 "(lines 2 and 5)", id="duplicate-key"),
    pytest.param("env:\n  id: CartPole-v1\nlearner:\n  lr: 0.001\nenv:\n  id: Pendulum-v1\n", "{file}",
                 "env is given twice", "(lines 1 and 5)", id="duplicate-section"),
]


@pytest.mark.parametrize("text, key, value, allowed", BAD_CONFIGS)
def test_bad_config_cli(tmp_path, text, key, value, allowed):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    key = key.replace("{file}", str(path))
    line = assert_config_error(run_cli("--config", str(path), "--dry-run"), key, value, allowed)
    assert line.startswith(f"config error: {key}:"), line  # the key path is the subject of the message


def test_bad_config_cases_are_distinct():
    texts = [p.values[0] for p in BAD_CONFIGS]
    assert len(set(texts)) == len(texts) >= 14


def test_missing_config_file_cli(tmp_path):
    missing = tmp_path / "nope.yaml"
    assert_config_error(run_cli("--config", str(missing), "--dry-run"), "--config", repr(str(missing)),
                        "does not exist or is not a file")


def test_config_path_is_a_directory_cli(tmp_path):
    assert_config_error(run_cli("--config", str(tmp_path), "--dry-run"), "--config", repr(str(tmp_path)),
                        "does not exist or is not a file")


def test_error_path_does_not_import_ray_or_torch(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner:\n  lrr: 1\n")
    code = ("import sys\nfrom cluster import train\nrc = train.main(['--config', sys.argv[1], '--dry-run'])\n"
            "print(rc, 'ray' in sys.modules, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, str(bad)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout.split() == ["2", "False", "False"], proc.stdout + proc.stderr
    assert proc.stderr.startswith("config error: learner.lrr: unknown key")


def test_in_process_error_matches_cli(tmp_path):
    """``ConfigError`` is the message the CLI prints, verbatim."""
    path = tmp_path / "bad.yaml"
    path.write_text("ppo:\n  gamma: 1.5\n")
    with pytest.raises(ConfigError) as exc:
        C.load(str(path))
    line = assert_config_error(run_cli("--config", str(path), "--dry-run"))
    assert line == f"config error: {exc.value}"


# --------------------------------------------------------------------------- --set overrides


@pytest.mark.parametrize("text, keys, value", [
    ("learner.lr=1e-3", ["learner", "lr"], 0.001),
    ("learner.lr=0.5", ["learner", "lr"], 0.5),
    ("rollout.num_actors=4", ["rollout", "num_actors"], 4),
    ("ppo.norm_adv=false", ["ppo", "norm_adv"], False),
    ("learner.hidden_sizes=[128, 32]", ["learner", "hidden_sizes"], [128, 32]),
    ("env.id=CartPole-v1", ["env", "id"], "CartPole-v1"),
    ("run.run_name=a=b", ["run", "run_name"], "a=b"),
    ("run.target_return=", ["run", "target_return"], None),
    (" learner.lr = 2e-4", ["learner", "lr"], 2e-4),
])
def test_parse_override(text, keys, value):
    got_keys, got_value = C.parse_override(text)
    assert got_keys == keys
    assert got_value == value and type(got_value) is type(value)


@pytest.mark.parametrize("text, expected", [
    ("learnerlr", "expected KEY.PATH=VALUE"),
    ("=3", "empty key"),
    ("  =3", "empty key"),
])
def test_parse_override_rejects(text, expected):
    with pytest.raises(ConfigError) as exc:
        C.parse_override(text)
    assert expected in str(exc.value) and repr(text) in str(exc.value)


def test_set_override_via_load():
    assert C.load(str(CARTPOLE)).learner.lr == pytest.approx(1.5e-3)
    cfg = C.load(str(CARTPOLE), ["learner.lr=3e-4"])
    assert cfg.learner.lr == 0.0003 and isinstance(cfg.learner.lr, float)
    # later overrides win; an override may name a section the file leaves out
    cfg = C.load(str(CARTPOLE), ["learner.lr=1e-3", "learner.lr=2e-3", "ray.num_cpus=3"])
    assert cfg.learner.lr == 0.002 and cfg.ray.num_cpus == 3
    # defaults only (no file)
    assert C.load(None, ["rollout.num_actors=3"]).rollout.num_actors == 3


def test_set_override_through_a_value_is_an_error():
    with pytest.raises(ConfigError) as exc:
        C.load(str(CARTPOLE), ["learner.lr.x=1"])
    assert "learner.lr" in str(exc.value) and "\n" not in str(exc.value)


def test_set_override_is_validated():
    with pytest.raises(ConfigError) as exc:
        C.load(str(CARTPOLE), ["ppo.gamma=2"])
    assert str(exc.value).startswith("ppo.gamma: 2.0 is out of range")


def test_set_seed_too_large_for_torch_is_rejected():
    with pytest.raises(ConfigError) as exc:
        C.load(None, ["run.seed=1e99"])  # used to pass, then overflow in torch.manual_seed
    assert str(exc.value).startswith("run.seed: ") and str(exc.value).endswith("out of range; allowed: <= 2147483647")


def test_largest_seed_is_taken_by_its_consumers():
    """The largest seed, with the offsets the run adds to it, seeds the learner's torch generators and a sampler
    that resets its envs (gymnasium's seeding) and samples actions (a torch generator)."""
    import functools

    import torch

    from actors.sampler import RolloutSampler, SamplerSettings
    from learner.model import ActorCritic, state_dict_numpy
    from tests.conftest import env_spec

    seed = C.load(None, [f"run.seed={2**31 - 1}"]).run.seed
    torch.manual_seed(seed)  # the learner's init (learner/actor.py)
    torch.Generator().manual_seed(seed * 1000 + 7)  # the learner's sampling generator
    spec = env_spec("CartPole-v1")
    # cluster/graph.py: the evaluator's seed; a rollout actor's after 10^7 iterations + replacements, id 4095.
    for offset in (424_242, 1_000_003 * 10**7 + 7919 * 4095):
        sampler = RolloutSampler(SamplerSettings(env_id="CartPole-v1", num_envs=2, fragment_length=2, gamma=0.99,
                                                 gae_lambda=0.95, seed=seed + offset),
                                 functools.partial(ActorCritic, spec), actor_id=4095)
        sampler.load_weights(0, state_dict_numpy(ActorCritic(spec)))
        assert sampler.collect().num_samples == 4


def test_duplicate_key_is_rejected_in_process(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("env:\n  id: CartPole-v1\n  wrappers:\n    - path: a:b\n      path: c:d\n")
    with pytest.raises(ConfigError) as exc:
        C.load(str(path))
    assert str(exc.value) == f"{path}: env.wrappers[0].path is given twice (lines 4 and 5)"


def test_yaml_merge_key_may_be_overridden():
    """'<<' merges an anchor's keys and lets the mapping override them: not a duplicate."""
    text = "defaults: &d {lr: 0.001, batch_size: 1024}\nlearner:\n  <<: *d\n  lr: 0.002\n"
    assert C._load_yaml_text(text, "x.yaml")["learner"] == {"lr": 0.002, "batch_size": 1024}


def test_set_override_dry_run_cli():
    proc = run_cli("--config", str(CARTPOLE), "--set", "learner.lr=1e-3", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    resolved = yaml.safe_load(proc.stdout)
    assert resolved["learner"]["lr"] == 0.001
    # the whole printed config is the resolved one
    assert resolved == plain(C.load(str(CARTPOLE), ["learner.lr=1e-3"]).to_dict())
    # and it is itself a valid config that reloads to the same thing
    assert plain(C.from_dict(resolved).to_dict()) == resolved


def test_set_unknown_key_cli():
    assert_config_error(run_cli("--config", str(CARTPOLE), "--set", "learner.lrr=1e-3", "--dry-run"),
                        "learner.lrr", "unknown key", "did you mean 'learner.lr'?")


def test_set_unknown_section_cli():
    assert_config_error(run_cli("--set", "rolout.num_actors=2", "--dry-run"),
                        "rolout", "did you mean 'rollout'?")


def test_set_malformed_cli():
    assert_config_error(run_cli("--config", str(CARTPOLE), "--set", "learnerlr", "--dry-run"),
                        "--set", "'learnerlr'", "expected KEY.PATH=VALUE")


def test_set_bad_value_cli():
    assert_config_error(run_cli("--config", str(CARTPOLE), "--set", "learner.device=tpu", "--dry-run"),
                        "learner.device", "'tpu'", "allowed: auto, cpu, cuda, npu")


# --------------------------------------------------------------------------- docs table


def test_markdown_table_has_a_documented_row_per_field():
    lines = C.markdown_table().splitlines()
    assert lines[0] == "| key | default | unit | allowed | meaning |"
    assert set(lines[1]) <= {"|", "-"}
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 5, f"row does not have 5 cells (a '|' in a doc?): {line}"
        rows.setdefault(cells[0].strip("`"), []).append(cells)
    expected = {f"{s}.{n}": (tp, m) for s, n, tp, m in leaf_specs("env.modalities.<key>")}
    expected.update({f"multiagent.policies.<name>.{f.name}": (None, f.metadata)
                     for f in dataclasses.fields(C.PolicyConfig)})
    assert len(expected) > 30
    assert set(rows) == set(expected)
    assert all(len(v) == 1 for v in rows.values()), [k for k, v in rows.items() if len(v) > 1]

    classes = section_classes()
    classes["env.modalities.<key>"] = C.ModalitySpec
    classes["multiagent.policies.<name>"] = C.PolicyConfig
    classes["env.limits"] = C.EnvLimitsConfig
    for key, [(_, default, unit, allowed, meaning)] in rows.items():
        section, name = key.rsplit(".", 1)
        f = {f.name: f for f in dataclasses.fields(classes[section])}[name]
        m = f.metadata
        assert meaning and meaning == m["doc"], key
        assert unit == m.get("unit", ""), key
        f_default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert yaml.safe_load(default.strip("`")) == plain(f_default), key
        if m.get("min") is not None:
            assert f"{'>' if m.get('min_exclusive') else '>='} {m['min']}" in allowed, key
        if m.get("max") is not None:
            assert f"<= {m['max']}" in allowed, key
        for choice in m.get("choices") or ():
            assert ("null" if choice is None else choice) in allowed.split(" / "), key


def test_every_field_has_documentation():
    for section, name, _, meta in leaf_specs():
        assert meta.get("doc", "").strip(), f"{section}.{name} has no doc"


def test_markdown_cli_prints_the_table():
    proc = subprocess.run([sys.executable, "-m", "cluster.config", "--markdown"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == C.markdown_table().strip()


# --------------------------------------------------------------------------- fuzz

# Values of the wrong type for each base annotation (ints are valid floats, so none appear under float).
WRONG_TYPE = {
    int: ["four", 2.5, True, False, [1], {"n": 1}],
    float: ["high", True, False, [0.5], {"x": 1.0}],
    bool: [1, 0, "yes", 1.0, [True]],
    str: [5, 2.5, True, ["CartPole-v1"], {"id": "x"}],
    tuple: ["64,64", 64, [], [0], [64, -1], [64, True], [64.0], {"a": 64}],
    list: ["go to", 5, [], [1], [""], {"a": "b"}],
    dict: ["camera", 5, [1], {"cam": 3}, {"cam": {"kind": "lidar"}}, {"bad key!": {}}],
    "kwargs": ["x", 5, [1], True],  # env.kwargs: free-form plain data, but a mapping
    "wrappers": ["x:y", 5, True, {"path": "a:b"}],  # env.wrappers: a list of sections
}


def type_key(base):
    """WRONG_TYPE's key for an annotation."""
    if base is dict:
        return "kwargs"
    if typing.get_origin(base) is list:
        return "wrappers"
    return dict if typing.get_origin(base) is dict else base


def leaf_is_valid(value, tp, meta) -> bool:
    """Independent oracle for one setting: does ``value`` satisfy its annotation and metadata?"""
    base, optional = unwrap_optional(tp)
    if value is None:
        return optional
    if value == "auto" and meta.get("auto"):
        return True
    if base is bool:
        return isinstance(value, bool)
    if base is str:
        ok = isinstance(value, str)
    elif base is tuple:
        return (isinstance(value, (list, tuple)) and len(value) > 0
                and all(type(v) is int and v > 0 for v in value))
    elif base is list:
        return isinstance(value, list) and len(value) > 0 and all(isinstance(v, str) and v for v in value)
    elif base is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    elif typing.get_origin(base) is list:
        entry = re.compile(r"[\w.]+:[\w.]+")
        return isinstance(value, list) and all(
            (isinstance(v, str) and entry.fullmatch(v)) or (isinstance(v, dict) and set(v) <= {"path", "kwargs"}
                                                             and entry.fullmatch(str(v.get("path", ""))))
            for v in value)
    elif typing.get_origin(base) is dict:
        try:  # the oracle for a mapping of sections is the schema itself: every entry must build
            C.from_dict({"env": {"modalities": value}})
            return True
        except ConfigError:
            return False
    elif base is int:
        ok = type(value) is int
    elif base is float:
        ok = type(value) in (int, float)
    else:
        raise AssertionError(f"oracle does not know {tp}")
    if not ok:
        return False
    if meta.get("choices") is not None and value not in meta["choices"]:
        return False
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and not (value > lo if meta.get("min_exclusive") else value >= lo):
        return False
    if hi is not None and not value <= hi:
        return False
    return True


def invalid_values(tp, meta) -> list:
    base, optional = unwrap_optional(tp)
    vals = list(WRONG_TYPE[type_key(base)])
    if not optional:
        vals.append(None)
    lo, hi = meta.get("min"), meta.get("max")
    if base is int:
        if lo is not None:
            vals += [lo - 1, lo - 1000] + ([lo] if meta.get("min_exclusive") else [])
        if hi is not None:
            vals += [hi + 1, hi * 10]
    if base is float:
        if lo is not None:
            vals += [float(lo) - 0.5, float(lo) - 1e6] + ([float(lo)] if meta.get("min_exclusive") else [])
        if hi is not None:
            vals += [float(hi) + 0.5, float(hi) * 10 + 1.0, math.inf]
    if meta.get("choices"):
        vals += [c for c in ("tpu", "CPU", "", "gpu", "cuda:0") if c not in meta["choices"]]
    return vals


def misspell(rng: random.Random, word: str, known) -> str:
    for _ in range(100):
        i = rng.randrange(len(word))
        kind = rng.randrange(5)
        if kind == 0 and len(word) > 1:
            typo = word[:i] + word[i + 1:]                       # dropped letter
        elif kind == 1:
            typo = word[:i] + word[i] + word[i:]                 # doubled letter
        elif kind == 2 and i + 1 < len(word):
            typo = word[:i] + word[i + 1] + word[i] + word[i + 2:]  # swapped letters
        elif kind == 3:
            typo = word + rng.choice(["s", "_", "2", "x"])       # stray suffix
        else:
            typo = word[:i] + rng.choice("abcdefghijklmnopqrstuvwxyz") + word[i + 1:]  # wrong letter
        if typo and typo not in known:
            return typo
    raise AssertionError(f"could not misspell {word!r}")


def generate_fuzz_cases(n: int = 400, seed: int = 0) -> list[tuple[str, dict, str, str, object]]:
    """(case id, config dict, expected key path, kind, bad value) -- each dict is invalid in exactly one place."""
    rng = random.Random(seed)
    base = fuzz_base()
    specs = leaf_specs()
    sections = list(section_classes())
    cases = []
    # Value cases walk the settings in a shuffled cycle, so every setting is fuzzed at least once.
    value_targets = itertools.cycle(rng.sample(specs, len(specs)))
    for i in range(n):
        data = copy.deepcopy(base)
        roll = rng.random()
        if roll < 0.1:                                           # misspelled section
            typo = misspell(rng, rng.choice(sections), sections)
            data[typo] = {}
            cases.append((f"{i}-section-{typo}", data, typo, "unknown", None))
        elif roll < 0.25:                                        # misspelled key inside a section
            section, name, _, _ = rng.choice(specs)
            known = [n for s, n, _, _ in specs if s == section]
            typo = misspell(rng, name, known)
            node(data, section)[typo] = node(data, section)[name]
            cases.append((f"{i}-key-{section}.{typo}", data, f"{section}.{typo}", "unknown", None))
        else:                                                    # invalid value for one setting
            section, name, tp, meta = next(value_targets)
            bad = rng.choice(invalid_values(tp, meta))
            assert not leaf_is_valid(bad, tp, meta), (section, name, bad)
            node(data, section)[name] = bad
            cases.append((f"{i}-value-{section}.{name}={bad!r}", data, f"{section}.{name}", "value", bad))
    return cases


FUZZ_CASES = generate_fuzz_cases()


def test_fuzz_generator_is_sound():
    """The oracle accepts every schema default and rejects what the generator makes; the cases span the schema."""
    for section, name, tp, meta in leaf_specs():
        assert leaf_is_valid(plain(default_of(section, name)), tp, meta), (section, name)
        for bad in invalid_values(tp, meta):
            assert not leaf_is_valid(bad, tp, meta), (section, name, bad)
    assert len(FUZZ_CASES) >= 100
    assert [c[0] for c in generate_fuzz_cases()] == [c[0] for c in FUZZ_CASES]  # deterministic
    kinds = Counter(c[3] for c in FUZZ_CASES)
    assert kinds["value"] >= 100 and kinds["unknown"] >= 20
    covered = {c[2] for c in FUZZ_CASES if c[3] == "value"}
    assert covered == {f"{s}.{n}" for s, n, _, _ in leaf_specs()}, "some setting was never fuzzed"
    # Each case differs from the valid defaults in exactly one place.
    base = flatten(fuzz_base())
    for case_id, data, path, kind, _ in FUZZ_CASES:
        flat = flatten(data)
        diffs = [k for k in flat.keys() | base.keys()
                 if k not in flat or k not in base or type(flat[k]) is not type(base[k]) or flat[k] != base[k]]
        # Replacing a whole mapping changes its entries too: everything that differs must lie under the one
        # path the case names (an unknown key differs at its own new path).
        where = tuple(path.split("."))
        assert diffs and all(d[:len(where)] == where for d in diffs), (case_id, diffs)
        if kind == "value" and path not in SECTIONS:  # a plain setting: exactly that one entry differs
            assert diffs == [where], (case_id, diffs)


def flatten(data: dict, prefix: tuple = ()) -> dict:
    """{section: {key: v}} -> {(section, key): v}; an empty or non-mapping section is the entry (section, None)."""
    out = {}
    for section, values in data.items():
        path = prefix + (section,)
        if isinstance(values, dict) and values and ".".join(path) in SECTIONS:
            out.update(flatten(values, path))
        else:
            out[path] = values
    return out


#: Mappings of settings (anything else that is a mapping is one value).
SECTIONS = set(section_classes()) | {"env.modalities", MODALITY_SECTION, "env.limits"}


def test_fuzz_from_dict_rejects_every_case():
    failures = []
    for case_id, data, path, kind, bad in FUZZ_CASES:
        try:
            C.from_dict(data)
        except ConfigError as e:
            msg = str(e)
            ok = "\n" not in msg and msg.strip() == msg and path in msg
            if kind == "unknown":
                ok = ok and "unknown key" in msg
            elif not isinstance(bad, dict):  # a bad mapping is reported at the entry inside it that is wrong
                ok = ok and repr(bad) in msg
            if not ok:
                failures.append(f"{case_id}: {msg!r}")
        except Exception as e:  # anything but ConfigError is a crash the CLI would show as a traceback
            failures.append(f"{case_id}: raised {type(e).__name__}: {e}")
        else:
            failures.append(f"{case_id}: accepted")
    assert not failures, f"{len(failures)}/{len(FUZZ_CASES)} bad:\n" + "\n".join(failures[:30])


def test_every_invalid_value_for_every_setting_is_rejected():
    """Exhaustive companion to the random fuzz: each setting x each invalid value the generator knows."""
    base = fuzz_base()
    failures, n = [], 0
    for section, name, tp, meta in leaf_specs():
        for bad in invalid_values(tp, meta):
            n += 1
            data = copy.deepcopy(base)
            node(data, section)[name] = bad
            path = f"{section}.{name}"
            try:
                C.from_dict(data)
            except ConfigError as e:
                msg = str(e)
                if "\n" in msg or path not in msg or (repr(bad) not in msg and not isinstance(bad, dict)):
                    failures.append(f"{path}={bad!r}: {msg!r}")
            except Exception as e:
                failures.append(f"{path}={bad!r}: raised {type(e).__name__}: {e}")
            else:
                failures.append(f"{path}={bad!r}: accepted")
    assert n > 300
    assert not failures, "\n".join(failures)


def _yaml_safe(data) -> bool:
    """The dict survives a YAML dump/load unchanged (so the CLI sees the same invalid value)."""
    d = plain(data)
    return yaml.safe_load(yaml.safe_dump(d)) == d and not any(
        isinstance(v, float) and not math.isfinite(v) for sec in d.values() if isinstance(sec, dict)
        for v in sec.values())


CLI_FUZZ = [c for c in FUZZ_CASES if _yaml_safe(c[1])][::23][:6]


@pytest.mark.parametrize("case_id, data, path, kind, bad", CLI_FUZZ, ids=[c[0] for c in CLI_FUZZ])
def test_fuzz_cli(tmp_path, case_id, data, path, kind, bad):
    cfg = tmp_path / "fuzz.yaml"
    cfg.write_text(yaml.safe_dump(plain(data), sort_keys=False))
    assert_config_error(run_cli("--config", str(cfg), "--dry-run"), path)


@pytest.mark.long  # 30 CLI processes; tests/test_every_bad_input.py runs the CLI cases in make test
def test_fuzz_every_case_through_the_cli_entry_point(tmp_path, capsys):
    """All YAML-expressible fuzz cases (well over 100) through cluster.train.main, the function behind
    ``python -m cluster.train``: exit code 2, one line naming the key, never a traceback. In-process, so
    the 100+ cases cost milliseconds each instead of an interpreter start each."""
    from cluster import train

    cases = [c for c in FUZZ_CASES if _yaml_safe(c[1])]
    assert len(cases) >= 100
    failures = []
    for case_id, data, path, _kind, _bad in cases:
        cfg = tmp_path / f"{case_id}.yaml"
        cfg.write_text(yaml.safe_dump(plain(data), sort_keys=False))
        try:
            rc = train.main(["--config", str(cfg), "--dry-run"])
        except BaseException as e:  # a traceback would reach the user
            failures.append(f"{case_id}: raised {type(e).__name__}: {e}")
            continue
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        if rc != 2 or out or len(lines) != 1 or not lines[0].startswith("config error: ") or path not in lines[0] \
                or "Traceback" in err:
            failures.append(f"{case_id}: rc={rc} stdout={out!r} stderr={err!r}")
    assert not failures, "\n".join(failures[:20])


def test_fuzz_cli_sample_is_varied():
    assert len(CLI_FUZZ) >= 5
    assert len({c[2] for c in CLI_FUZZ}) >= 4


# --------------------------------------------------------------------------- regressions
# Each of these was a bug found by this file (NaN through range checks, non-UTF-8 files, multi-line messages,
# quoted numbers turned into floats), now fixed in cluster/config.py.


@pytest.mark.parametrize("name", ["ppo.gamma", "ppo.gae_lambda", "ppo.vf_coef", "learner.num_cpus"])
def test_regression_nan_passes_range_checks(name):
    section, key = name.split(".")
    with pytest.raises(ConfigError):
        C.from_dict({section: {key: float("nan")}})


def test_regression_non_utf8_config_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("env:\n  id: caf\xe9\n".encode("latin-1"))
    assert_config_error(run_cli("--config", str(path), "--dry-run"), str(path))


def test_regression_control_character_in_yaml_gives_two_lines(tmp_path):
    path = tmp_path / "ctrl.yaml"
    path.write_text("env:\n  id: a\x07b\n")
    assert_config_error(run_cli("--config", str(path), "--dry-run"), str(path), "is not valid YAML")


def test_regression_unknown_key_with_newline():
    with pytest.raises(ConfigError) as exc:
        C.from_dict({"learner": {"lr\n": 1}})
    assert "\n" not in str(exc.value)


def test_regression_quoted_scientific_string_for_str_field(tmp_path):
    path = tmp_path / "name.yaml"
    path.write_text('run:\n  run_name: "1e3"\n')
    assert C.load(str(path)).run.run_name == "1e3"


def test_regression_quoted_numeric_set_value_for_str_field():
    assert C.load(None, ['run.run_name="2.0"']).run.run_name == "2.0"


def test_configuration_reference_table_matches_schema():
    """The configuration reference (docs/configuration.md) is the generated table, verbatim, between its markers."""
    reference = (Path(__file__).resolve().parent.parent / C.REFERENCE_PATH).read_text()
    start = reference.index("\n", reference.index("<!-- config-table:start")) + 1
    end = reference.index("<!-- config-table:end -->")
    assert reference[start:end] == C.markdown_table() + "\n"


def test_update_reference_rewrites_only_the_table(tmp_path):
    """`make docs` (--update-reference) replaces what lies between the markers and nothing else."""
    path = tmp_path / "configuration.md"
    path.write_text("intro\n<!-- config-table:start (generated) -->\n| stale |\n<!-- config-table:end -->\nafter\n")
    assert C.update_reference(str(path)) is True
    assert path.read_text() == ("intro\n<!-- config-table:start (generated) -->\n" + C.markdown_table()
                                + "\n<!-- config-table:end -->\nafter\n")
    assert C.update_reference(str(path)) is False


# --------------------------------------------------------------------------- local minibatch vs advantage normalisation

#: Small fragments (2 samples) so tiny batches are otherwise valid; batch_size 8 over 2 learners = 2 fragments each.
_TINY = {"rollout": {"fragment_length": 2, "envs_per_actor": 1}, "run": {"total_env_steps": 64}}


def _tiny(learner: dict, **sections) -> dict:
    data = copy.deepcopy(_TINY)
    data["learner"] = learner
    data.update(sections)
    return data


@pytest.mark.parametrize("learner, per_learner, allowed", [
    ({"num_learners": 2, "batch_size": 8, "minibatch_size": 2}, 1, ">= 4 (2 per learner)"),
    ({"num_learners": 1, "batch_size": 8, "minibatch_size": 1}, 1, ">= 2 (2 per learner)"),
    ({"num_learners": 4, "batch_size": 16, "minibatch_size": 4}, 1, ">= 8 (2 per learner)"),
    ({"num_learners": 2, "batch_size": "auto", "batch_size_min": 8, "batch_size_max": 64, "minibatch_size": 2}, 1,
     ">= 4 (2 per learner)"),
    ({"num_learners": 1, "batch_size": "auto", "batch_size_min": 8, "batch_size_max": 64, "minibatch_size": 1}, 1,
     ">= 2 (2 per learner)"),
], ids=["2-learners", "1-learner", "4-learners", "auto-2-learners", "auto-1-learner"])
def test_one_sample_local_minibatch_rejected_with_norm_adv(learner, per_learner, allowed):
    """minibatch_size == num_learners leaves 1 sample per learner, whose unbiased std is NaN (NaN training)."""
    with pytest.raises(ConfigError) as exc:
        C.from_dict(_tiny(learner))
    msg = str(exc.value)
    mb = learner["minibatch_size"]
    assert msg.startswith(f"learner.minibatch_size: {mb} gives {per_learner} sample per learner"), msg
    assert "advantage normalisation" in msg and f"allowed: {allowed}" in msg and "ppo.norm_adv: false" in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("learner", [
    {"num_learners": 2, "batch_size": 8, "minibatch_size": 4},
    {"num_learners": 1, "batch_size": 8, "minibatch_size": 2},
    {"num_learners": 2, "batch_size": "auto", "batch_size_min": 8, "batch_size_max": 64, "minibatch_size": 4},
], ids=["2-learners", "1-learner", "auto"])
def test_two_sample_local_minibatch_accepted(learner):
    cfg = C.from_dict(_tiny(learner))
    assert cfg.local_minibatch_size == 2


@pytest.mark.parametrize("learner", [
    {"num_learners": 2, "batch_size": 8, "minibatch_size": 2},
    {"num_learners": 2, "batch_size": "auto", "batch_size_min": 8, "batch_size_max": 64, "minibatch_size": 2},
], ids=["fixed", "auto"])
def test_one_sample_local_minibatch_accepted_without_norm_adv(learner):
    cfg = C.from_dict(_tiny(learner, ppo={"norm_adv": False}))
    assert cfg.local_minibatch_size == 1


def test_one_sample_local_minibatch_cli():
    proc = run_cli("--config", str(CARTPOLE), "--set", "learner.num_learners=2", "--set", "learner.minibatch_size=2",
                   "--dry-run")
    line = assert_config_error(proc, "learner.minibatch_size: 2", "1 sample per learner", "(2 learners)",
                               "allowed: >= 4")
    assert line.startswith("config error: learner.minibatch_size:"), line


# --------------------------------------------------------------------------- defaults by env class


def test_class_defaults_fill_only_the_settings_the_config_leaves_unset():
    cfg = C.load(None, ["env.id=Pendulum-v1", "ppo.update_epochs=3"])
    assert cfg.keys_set == {"env.id", "ppo.update_epochs"}
    assert C.class_defaults_pending(cfg)
    resolved = C.with_class_defaults(cfg, "continuous")
    expected = {k: v for k, v in C.CONTINUOUS_DEFAULTS.items() if k != "ppo.update_epochs"}
    assert resolved.class_defaults == expected
    assert (resolved.replay.max_policy_lag, resolved.ppo.ent_coef, resolved.learner.minibatch_size,
            resolved.learner.lr) == (0, 0.0, 64, 3e-4)
    assert resolved.ppo.update_epochs == 3  # set by the user: kept
    # Everything else is the config as it was.
    a, b = cfg.to_dict(), resolved.to_dict()
    for key in C.CONTINUOUS_DEFAULTS:
        section, name = key.split(".")
        a[section].pop(name), b[section].pop(name)
    assert a == b
    # Once applied, never again; and the resolved config read back (a run's config.yaml) names every key.
    assert not C.class_defaults_pending(resolved) and C.with_class_defaults(resolved, "continuous") is resolved
    again = C.from_dict(resolved.to_dict())
    assert not C.class_defaults_pending(again)
    assert C.with_class_defaults(again, "continuous").to_dict() == resolved.to_dict()


@pytest.mark.parametrize("defaults, kind, takes", [("auto", "continuous", True), ("auto", "discrete", False),
                                                   ("auto", "composite", False), ("discrete", "continuous", False),
                                                   ("continuous", "discrete", True)])
def test_env_defaults_picks_by_the_action_space_or_as_told(defaults, kind, takes):
    cfg = C.load(None, [f"env.defaults={defaults}"])
    resolved = C.with_class_defaults(cfg, kind)
    assert bool(resolved.class_defaults) == takes
    assert resolved.learner.lr == (3e-4 if takes else C.LearnerConfig().lr)


def test_a_config_object_or_a_shipped_config_that_sets_them_takes_no_class_defaults():
    assert C.with_class_defaults(Config(), "continuous").class_defaults == {}  # not from plain data: decided
    pendulum = C.load(str(ROOT / "configs/pendulum.yaml"))
    assert C.class_defaults_for(pendulum, "continuous") == {}  # its file sets every one of them


def test_class_defaults_that_break_the_layout_name_the_key_and_where_the_value_came_from():
    cfg = C.load(None, ["env.id=Pendulum-v1", "learner.rnn=gru"])
    with pytest.raises(ConfigError, match=r"^learner.rnn_seq_len: 128 does not divide .* \(env.defaults: auto gave "
                                          r"this env's continuous actions the continuous defaults .*"
                                          r"learner.minibatch_size=64.*env.defaults: discrete\)$"):
        C.with_class_defaults(cfg, "continuous")


def test_the_trainer_runs_on_the_class_defaults(tmp_path):
    """Every part of a run reads the resolved config: the Trainer resolves it before it builds anything."""
    from cluster.driver import Trainer

    trainer = Trainer(C.load(None, ["env.id=Pendulum-v1", "ray.address=inprocess"]), tmp_path, quiet=True)
    assert trainer.cfg.learner.lr == 3e-4 and trainer.cfg.class_defaults
    assert trainer.graph.cfg is trainer.cfg and trainer.supervisor.cfg is trainer.cfg
    assert Trainer(C.load(None, ["ray.address=inprocess"]), tmp_path, quiet=True).cfg.class_defaults == {}
    assert Trainer(C.load(str(CARTPOLE), ["ray.address=inprocess"]), tmp_path, quiet=True).cfg.class_defaults == {}


@pytest.mark.parametrize("text", ["learner:\n  graphs: off\n", "learner:\n  graphs: 'off'\n"])
def test_a_bare_off_is_the_word_off(tmp_path, text):
    """YAML 1.1 reads a bare ``off`` as False; a setting whose choices include "off" takes it back as the word."""
    path = tmp_path / "c.yaml"
    path.write_text("env:\n  id: CartPole-v1\n" + text)
    assert C.load(str(path)).learner.graphs == "off"
    assert C.load(str(path), ["learner.graphs=auto"]).learner.graphs == "auto"
    assert C.load(str(path), ["learner.graphs=off"]).learner.graphs == "off"
