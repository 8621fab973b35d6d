"""``python -m cluster.train --dry-run`` builds the env once (gymnasium only, no Ray, no torch) and checks it.

A dry run that passes prints the resolved config and then one line (a YAML comment, so stdout stays loadable)
with the observation and action spaces the model will see. An env that cannot be made, or that does not match
env.modalities, is one ``config error: ...`` line on stderr and exit code 2, as it would be in ``Trainer.build``:
both call ``actors.envs.describe_env``. Every test here runs the real CLI in a subprocess.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import yaml

from cluster import config as C

ROOT = Path(__file__).resolve().parents[1]
CARTPOLE = ROOT / "configs" / "cartpole.yaml"
MULTIRATE = ROOT / "configs" / "multirate.yaml"
MULTIRATE_KEYS = ("camera", "proprio", "audio", "lidar", "instruction")


def dry_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.train", *args, "--dry-run"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def spaces_line(proc: subprocess.CompletedProcess) -> str:
    """Exit 0, no traceback, stdout = the resolved config then the spaces line (returned)."""
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout={proc.stdout!r}\nstderr={proc.stderr!r}"
    assert "Traceback" not in proc.stdout + proc.stderr
    last = proc.stdout.rstrip("\n").splitlines()[-1]
    assert last.startswith("# env.id "), last
    assert sum(1 for line in proc.stdout.splitlines() if line.startswith("# env.id ")) == 1, proc.stdout
    return last


def config_error_line(proc: subprocess.CompletedProcess, *expected: str) -> str:
    """Exit 2, nothing on stdout, exactly one stderr line ``config error: ...`` holding every ``expected``."""
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert proc.returncode == 2, f"rc={proc.returncode}\nstdout={proc.stdout!r}\nstderr={proc.stderr!r}"
    assert proc.stdout == "", proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for s in expected:
        assert s in lines[0], f"{s!r} not in {lines[0]!r}"
    return lines[0]


def test_cartpole_dry_run_prints_config_then_spaces():
    proc = dry_run("--config", str(CARTPOLE))
    line = spaces_line(proc)
    assert line == "# env.id 'CartPole-v1': observation vector: vector Box(4) float32, action Discrete(2)", line
    # The spaces line is a YAML comment: stdout is still exactly the resolved config.
    assert C.plain_data(C.load(str(CARTPOLE)).to_dict()) == yaml.safe_load(proc.stdout)


def test_continuous_actions_are_a_box():
    line = spaces_line(dry_run("--config", str(CARTPOLE), "--set", "env.id=Pendulum-v1"))
    assert line == ("# env.id 'Pendulum-v1': observation vector: vector Box(3) float32, action "
                    "Box(-2.0, 2.0, (1,), float32)"), line


def test_unknown_env_id_is_a_config_error():
    line = config_error_line(dry_run("--config", str(CARTPOLE), "--set", "env.id=NoSuchEnv-v9"))
    assert line.startswith("config error: env.id: 'NoSuchEnv-v9' cannot be made (NameNotFound: "), line


def test_env_module_that_does_not_exist_is_a_config_error():
    line = config_error_line(dry_run("--config", str(CARTPOLE), "--set", "env.id=no_such_module_q7:Foo-v0"))
    assert line.startswith("config error: env.id: 'no_such_module_q7:Foo-v0' cannot be made (ModuleNotFoundError: "
                           "No module named 'no_such_module_q7'"), line


def test_multirate_dry_run_checks_modalities_against_the_env():
    line = spaces_line(dry_run("--config", str(MULTIRATE)))
    assert line.startswith("# env.id 'actors.multirate_env:AscentRL/MultiRateSensor-v0': observation camera: image"), line
    for key in MULTIRATE_KEYS:
        assert f"{key}: " in line, (key, line)
    assert "camera: image Box(20, 20, 3) uint8" in line and "instruction: text Box(8) int64" in line, line
    assert line.endswith(", action Discrete(5)"), line


def test_modality_key_the_env_lacks_is_a_config_error():
    config_error_line(dry_run("--config", str(MULTIRATE), "--set", "env.modalities.sonar.kind=vector"),
                      "config error: env.modalities.sonar: ", "has no observation key 'sonar'", "allowed: ")


def test_dict_env_without_modalities_is_a_config_error():
    env_id = "actors.multirate_env:AscentRL/MultiRateSensor-v0"
    config_error_line(dry_run("--config", str(CARTPOLE), "--set", f"env.id={env_id}"),
                      "config error: env.modalities: empty, but env.id", "has Dict observations")


def test_modalities_on_a_box_env_are_a_config_error():
    config_error_line(dry_run("--config", str(CARTPOLE), "--set", "env.modalities.cam.kind=image"),
                      "config error: env.modalities: set, but env.id 'CartPole-v1'", "not a Dict")


def test_dry_run_imports_neither_ray_nor_torch_and_is_fast():
    code = ("import sys\nfrom cluster import train\nrc = train.main(['--config', sys.argv[1], '--dry-run'])\n"
            "print(rc, 'ray' in sys.modules, 'torch' in sys.modules, file=sys.stderr)")
    for config in (CARTPOLE, MULTIRATE):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", code, str(config)], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
        wall = time.perf_counter() - t0
        assert proc.stderr.split() == ["0", "False", "False"], proc.stderr
        assert proc.stdout.rstrip().splitlines()[-1].startswith("# env.id "), proc.stdout
        assert wall < 3.0, f"{config.name}: dry run took {wall:.2f} s"


def test_trainer_describe_env_gives_the_dry_run_error():
    """The driver's check is the same function: same one-line error for an env that cannot be made."""
    code = ("import sys\nfrom cluster import config as C\nfrom cluster.driver import Trainer\n"
            "t = Trainer.__new__(Trainer)\nt.cfg = C.load(sys.argv[1], ['env.id=NoSuchEnv-v9'])\n"
            "try:\n    t._describe_env()\nexcept C.ConfigError as e:\n    print(f'config error: {e}')\n"
            "t.cfg = C.load(sys.argv[1])\nprint(t._describe_env())\n")
    proc = subprocess.run([sys.executable, "-c", code, str(CARTPOLE)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    error, spec = proc.stdout.strip().splitlines()[-2:]
    assert error == config_error_line(dry_run("--config", str(CARTPOLE), "--set", "env.id=NoSuchEnv-v9"))
    assert "name='vector'" in spec and "shape=(4,)" in spec and "action_kind='discrete'" in spec and "action_dim=2" in spec, spec


def test_composite_and_masked_actions_are_described():
    line = spaces_line(dry_run("--config", str(CARTPOLE), "--set", "env.id=actors.probe_envs:AscentRL/Match-Hybrid-v0"))
    assert line.endswith("action Dict('amount': Box(-1.0, 1.0, (1,), float32), 'choice': Discrete(3)) "
                         "(parts: gaussian 1, categorical 3)"), line
    line = spaces_line(dry_run("--config", str(CARTPOLE), "--set", "env.id=actors.probe_envs:AscentRL/MaskedChoice-v0",
                               "--set", "env.modalities.observation.kind=vector"))
    assert line.endswith("action Discrete(20), masked by observation key 'action_mask'"), line


def test_continuous_actions_take_the_continuous_defaults_where_the_config_is_silent():
    """env.defaults: auto on a Box-action env: the learning settings the config leaves unset print as the
    continuous defaults (C.CONTINUOUS_DEFAULTS), a set one keeps its value, and the line says which were taken."""
    proc = dry_run("--set", "env.id=Pendulum-v1", "--set", "learner.lr=0.002")
    spaces_line(proc)
    printed = yaml.safe_load(proc.stdout)
    taken = {k: v for k, v in C.CONTINUOUS_DEFAULTS.items() if k != "learner.lr"}
    for key, value in taken.items():
        section, name = key.split(".")
        assert printed[section][name] == value, (key, printed[section][name])
    assert printed["learner"]["lr"] == 0.002
    comment = [line for line in proc.stdout.splitlines() if line.startswith("# env.defaults: ")]
    assert comment == ["# env.defaults: auto: continuous actions, so the settings the config leaves unset took the "
                       "continuous defaults: " + ", ".join(f"{k}={v}" for k, v in taken.items())], comment
    # A discrete env on the same command line keeps the schema's values, and prints no such line.
    proc = dry_run("--set", "env.id=Acrobot-v1", "--set", "learner.lr=0.002")
    spaces_line(proc)
    assert yaml.safe_load(proc.stdout)["learner"]["minibatch_size"] == C.LearnerConfig().minibatch_size
    assert "# env.defaults" not in proc.stdout


def test_continuous_defaults_that_break_the_layout_are_one_config_error():
    """A recurrent model's BPTT chunk (the fragment, 128 steps) cannot fit the continuous defaults' minibatch of
    64: the error names the key and says the 64 came from env.defaults."""
    line = config_error_line(dry_run("--set", "env.id=Pendulum-v1", "--set", "learner.rnn=gru"),
                             "learner.rnn_seq_len: 128", "env.defaults: auto", "learner.minibatch_size=64",
                             "env.defaults: discrete")
    assert line.startswith("config error: learner.rnn_seq_len: "), line
