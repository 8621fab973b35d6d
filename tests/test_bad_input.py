"""Bad input ends in one line and exit code 2, found at ``--dry-run`` where it can be; Ray's security settings
are checked, not assumed.

Every CLI case runs the real ``python -m cluster.train`` in a subprocess and asserts exit code 2, nothing on stdout
and exactly one stderr line, ``config error: ...``, no longer than an error line may be. The schema cases
(``cluster.config.upper_bound``) walk every section, so a new duration or count cannot come without a bound. The
Ray cases start the real embedded Ray once (``placement.start_ray``) and attach to it from a second process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import threading
import typing
from pathlib import Path

import pytest

from cluster import config as C
from pipeline.contract import ModalitySpec

ROOT = Path(__file__).resolve().parents[1]
LONGEST_LINE = len("config error: ") + C.MAX_ERROR_CHARS


def train(*args: str, env: dict | None = None, dry_run: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}, **(env or {})}
    return subprocess.run([sys.executable, "-m", "cluster.train", *args, *(["--dry-run"] if dry_run else [])],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def one_config_error(proc: subprocess.CompletedProcess, *expected: str) -> str:
    """Exit 2, nothing on stdout, one stderr line ``config error: ...`` of bounded length holding ``expected``."""
    assert proc.returncode == 2, f"rc={proc.returncode}\nstdout={proc.stdout[-2000:]!r}\nstderr={proc.stderr[-3000:]!r}"
    assert proc.stdout == "", proc.stdout[-2000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    line = lines[0]
    assert line.startswith("config error: ") and len(line) <= LONGEST_LINE, line[:300]
    for s in expected:
        assert s in line, f"{s!r} not in {line!r}"
    return line


# --------------------------------------------------------------------------- bounds, NaN and infinities

RAY_AND_OS = "the longest wait Ray's int64-millisecond timeouts and the OS's timer waits (threading.TIMEOUT_MAX) accept"


@pytest.mark.parametrize("override, expected", [
    # Each passed --dry-run and failed at run time: the progress line's ETA, Ray's int64 ms, threading.Timer.
    ("run.total_env_steps=1e99", ["run.total_env_steps: 1e+99 is out of range", "<= 2^53"]),
    ("run.total_env_steps=" + "9" * 400, ["run.total_env_steps: an integer of 400 digits", "<= 2^53"]),
    ("run.stall_timeout_s=1e99", ["run.stall_timeout_s: 1e+99", "<= 1e+09", RAY_AND_OS]),
    ("run.startup_timeout_s=1e99", ["run.startup_timeout_s: 1e+99", "<= 1e+09", RAY_AND_OS]),
    ("run.shutdown_grace_s=1e99", ["run.shutdown_grace_s: 1e+99", "<= 1e+09", RAY_AND_OS]),
    ("rollout.fragment_timeout_s=1e99", ["rollout.fragment_timeout_s: 1e+99", "<= 1e+09", RAY_AND_OS]),
    ("run.time_budget_s=1e99", ["run.time_budget_s: 1e+99", "<= 1e+09"]),
    ("ray.num_cpus=1e15", ["ray.num_cpus: 1000000000000000", "<= 1,000,000", "int64"]),
    ("learner.hidden_sizes=[64, 100000000]", ["learner.hidden_sizes[1]: 100000000", "<= 65536"]),
    ("run.stall_timeout_s=.nan", ["run.stall_timeout_s: nan", "finite"]),
    ("run.shutdown_grace_s=.inf", ["run.shutdown_grace_s: inf", "finite"]),
    ("rollout.fragment_timeout_s=-.inf", ["rollout.fragment_timeout_s: -inf", "finite"]),
    ("run.total_env_steps=.inf", ["run.total_env_steps: inf is not an integer"]),
    ("run.total_env_steps=.nan", ["run.total_env_steps: nan is not an integer"]),
    # ray.address: the text as typed, checked, not the YAML mapping {':::': None} its colons make.
    ("ray.address=::::", ["ray.address: '::::' is not a Ray address", "allowed: auto, inprocess, host:port"]),
    ("ray.address=http://127.0.0.1:8265", ["ray.address: 'http://127.0.0.1:8265' is not a Ray address"]),
    ("ray.address=head:99999", ["ray.address: 'head:99999' is not a Ray address"]),
    # The run directory stays under run.output_dir.
    ("run.run_name=../escaped", ["run.run_name: '../escaped' is not a plain directory name", "one path component"]),
    ("run.run_name=/tmp/absolute", ["run.run_name: '/tmp/absolute'"]),
    ("run.run_name=a/b", ["run.run_name: 'a/b'"]),
    ("run.run_name=..", ["run.run_name: '..'"]),
    ("run.output_dir=../up", ["run.output_dir: '../up'", "without .. components"]),
    ("run.output_dir=runs/../../up", ["run.output_dir: 'runs/../../up'"]),
])
def test_a_bad_setting_is_one_line_at_dry_run(override, expected):
    one_config_error(train("--set", override), *expected)


def test_plain_names_absolute_output_dirs_and_ray_addresses_still_load():
    cfg = C.load(None, ["run.run_name=lr=1e-3_seed-2", "run.output_dir=/tmp/abs/runs", "run.total_env_steps=1e12",
                        "run.stall_timeout_s=86400", f"run.shutdown_grace_s={C.MAX_DURATION_S}"])
    assert cfg.run.run_name == "lr=1e-3_seed-2" and cfg.run.total_env_steps == 10**12
    for address in ("auto", "inprocess", "127.0.0.1:6379", "head-node.cluster.local:6379", "[::1]:6379",
                    "ray://10.0.0.2:10001"):
        assert C.load(None, [f"ray.address={address}"]).ray.address == address


def _numeric_fields():
    """(section class, field name, path of a config holding it) of every int, float and integer-list setting."""
    sections = [(cls, f"{f.name}.{{}}") for f in dataclasses.fields(C.Config) if dataclasses.is_dataclass(
        cls := C._type_of(C.Config, f.name))]
    sections += [(ModalitySpec, "env.modalities.cam.{}"), (C.PolicyConfig, "multiagent.policies.p.{}")]
    for cls, path in sections:
        for f in dataclasses.fields(cls):
            tp = C._type_of(cls, f.name)
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            base = args[0] if typing.get_origin(tp) is typing.Union and len(args) == 1 else tp
            if base in (int, float, tuple):
                yield cls, f.name, base, path.format(f.name)


def test_every_duration_and_count_has_an_upper_bound_the_loader_enforces():
    """One rule for the schema: a setting in seconds, milliseconds or CPUs, and every integer, is bounded (its own
    max or its kind's), and a value past the bound is a ConfigError naming the key. Plain floats without a unit
    (coefficients) are not durations or counts: finite is their only bound."""
    checked = []
    for cls, name, base, key in _numeric_fields():
        bound = C.upper_bound(cls, name)
        unit = cls.__dataclass_fields__[name].metadata.get("unit")
        if base is float and unit not in C.UNIT_BOUNDS:
            continue
        assert bound is not None, f"{key} ({base.__name__}, unit {unit!r}) has no upper bound"
        past = int(bound.value) + 1 if base in (int, tuple) else bound.value * 10
        value = [past] if base is tuple else past
        data: dict = {}
        C.apply_override(data, key.split("."), value)
        with pytest.raises(C.ConfigError) as err:
            C.from_dict(data)
        assert str(err.value).startswith(key) and "out of range" in str(err.value), (key, str(err.value))
        checked.append(key)
    for key in ("run.total_env_steps", "run.stall_timeout_s", "run.startup_timeout_s", "run.shutdown_grace_s",
                "rollout.fragment_timeout_s", "env.modalities.cam.budget_ms", "ray.num_cpus", "learner.hidden_sizes"):
        assert key in checked


def test_the_duration_bound_is_a_wait_ray_and_the_os_accept():
    """The longest wait a run derives from a duration at the bound (the learners' process group waits
    2 x run.stall_timeout_s + 120 s, learner/distributed.py) is a valid timeout for the OS's timer waits and for
    Ray's int64 milliseconds; 1e99, what the bound refuses, is not."""
    longest = C.MAX_DURATION_S * 2 + 120
    # threading's waits (Timer, Event, Condition, queue) all end in a lock's timed acquire, which checks its timeout
    # first: a free lock answers at once, or raises OverflowError for a timeout past threading.TIMEOUT_MAX.
    lock = threading.Lock()
    assert lock.acquire(timeout=longest)
    lock.release()
    assert int(longest * 1000) < 2**63  # ray.get / ray.wait: timeout_ms = int(timeout * 1000), an int64
    with pytest.raises(OverflowError):
        threading.Lock().acquire(timeout=1e99)


# --------------------------------------------------------------------------- env and wrapper modules


ENV_MODULES = {
    "raises_env": 'raise RuntimeError("no licence server")\n',
    "exits_env": "import sys\nsys.exit(0)\n",
    "fails_wrapper": 'raise KeyError("WRAPPER_TABLE")\n',
    "envpkg/__init__.py": "",
    "envpkg/broken.py": 'raise ZeroDivisionError("division by zero in the env table")\n',
}


@pytest.fixture
def env_modules(tmp_path) -> dict:
    for name, source in ENV_MODULES.items():
        path = tmp_path / (name if name.endswith(".py") else f"{name}.py")
        path.parent.mkdir(exist_ok=True)
        path.write_text(source)
    return {"PYTHONPATH": str(tmp_path)}


@pytest.mark.parametrize("override, expected", [
    ("env.id=raises_env:Anything-v0", ["env.id: 'raises_env:Anything-v0'", "importing 'raises_env' raised "
                                       "RuntimeError: no licence server"]),
    ("env.id=exits_env:Anything-v0", ["env.id: 'exits_env:Anything-v0'", "importing 'exits_env' called sys.exit(0)"]),
    ("env.id=envpkg:broken", ["env.id: 'envpkg:broken'", "importing 'envpkg.broken' raised ZeroDivisionError"]),
    ("env.wrappers=[fails_wrapper:Wrap]", ["env.wrappers[0]: 'fails_wrapper:Wrap' cannot be imported",
                                           "raised KeyError: 'WRAPPER_TABLE'"]),
    ("env.wrappers=[exits_env:Wrap]", ["env.wrappers[0]: 'exits_env:Wrap'", "called sys.exit(0)"]),
])
def test_an_env_module_that_raises_or_exits_on_import_is_one_line_at_dry_run(env_modules, override, expected):
    one_config_error(train("--set", override, env=env_modules), *expected)


@pytest.mark.parametrize("module, expected", [("raises_env", "raised RuntimeError: no licence server"),
                                              ("exits_env", "called sys.exit(0)")])
def test_an_env_module_that_raises_or_exits_on_import_is_one_line_at_train_time(env_modules, tmp_path, module,
                                                                                 expected):
    # The Trainer's own env check (the driver's describe_env), in process: no Ray start for this.
    proc = train("--set", f"env.id={module}:Anything-v0", "--address", "inprocess", "--run-dir",
                 str(tmp_path / "run"), env=env_modules, dry_run=False)
    one_config_error(proc, f"env.id: '{module}:Anything-v0'", expected)


# --------------------------------------------------------------------------- YAML


def _billion_laughs(levels: int, fanout: int) -> str:
    lines = [f"l0: &l0 [{', '.join(['lol'] * fanout)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * fanout)}]" for i in range(1, levels)]
    return "env:\n  kwargs:\n" + "".join(f"    {line}\n" for line in lines)


YAML_FILES = {
    # RecursionError, 2,989 lines, before.
    "deep": ("env:\n  kwargs:\n    x: " + "[" * 20_000 + "]" * 20_000 + "\n",
             ["line 3: nested deeper than 64 levels"]),
    # 10^9 values from 600 bytes: never finished loading, before.
    "bomb": (_billion_laughs(9, 10), ["expands to more than 100,000 values", "aliases"]),
    "self_alias": ("env:\n  kwargs:\n    x: &x [1, *x]\n", ["line 3: an alias holds the node it names"]),
    "long_int": ("run:\n  total_env_steps: " + "9" * 5000 + "\n", ["line 2: an integer of 5,000 characters"]),
    "huge": ("env:\n  kwargs:\n    pad: '" + "x" * (C.MAX_YAML_BYTES + 1) + "'\n", ["bytes; allowed: at most 1,048,576"]),
    # Under the value limit, and the env rejects the kwargs: the error quotes 800 KB of them, cut to one short line.
    "long_error": (_billion_laughs(5, 9), ["env.kwargs: ", "characters left out"]),
}


@pytest.mark.parametrize("name", list(YAML_FILES))
def test_a_yaml_too_deep_too_large_or_an_alias_bomb_is_one_bounded_line(tmp_path, name):
    text, expected = YAML_FILES[name]
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    one_config_error(train("--config", str(path)), *expected)


def test_a_deep_set_value_is_one_line_naming_the_key():
    one_config_error(train("--set", "env.kwargs={x: " + "[" * 5000 + "]" * 5000 + "}"),
                     "--set env.kwargs: nested deeper than 64 levels")


def test_error_lines_keep_the_key_and_what_is_allowed_and_drop_the_middle():
    err = C.ConfigError("env.kwargs: " + "x" * 1_000_000 + "; allowed: a mapping")
    assert len(str(err)) <= C.MAX_ERROR_CHARS
    assert str(err).startswith("env.kwargs: x") and str(err).endswith("; allowed: a mapping")


# --------------------------------------------------------------------------- Ray's security settings


def _start_ray_outcomes(env: dict) -> dict:
    """What placement.start_ray does in a fresh process with ``env``, for each case; Ray must not have started."""
    code = textwrap.dedent("""
        import json, os, ray
        from cluster import config as C, placement
        out = {}
        for case, address, overrides, mode, ray_address in [
                ("auth disabled", None, [], "disabled", None),
                ("auth unknown", None, [], "oauth", None),
                ("--address", "::::", [], None, None),
                ("RAY_ADDRESS", None, [], None, "http://127.0.0.1:8265")]:
            for key, value in (("RAY_AUTH_MODE", mode), ("RAY_ADDRESS", ray_address)):
                os.environ.pop(key, None)
                if value is not None:
                    os.environ[key] = value
            try:
                placement.start_ray(C.load(None, overrides), address)
                out[case] = "started"
            except C.ConfigError as e:
                out[case] = str(e)
            out[case + " ray"] = ray.is_initialized()
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_start_ray_refuses_an_open_embedded_ray_and_bad_addresses_before_starting_anything():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    out = _start_ray_outcomes(env)
    assert not any(v for k, v in out.items() if k.endswith(" ray")), out  # nothing started, nothing listens
    for case, mode in (("auth disabled", "'disabled'"), ("auth unknown", "'oauth'")):
        assert out[case].startswith("ray.allow_unauthenticated: false, and the embedded Ray would start without "
                                    "token authentication"), out[case]
        assert f"RAY_AUTH_MODE={mode}" in out[case] and "allowed: unset RAY_AUTH_MODE" in out[case], out[case]
    assert out["--address"].startswith("--address: '::::' is not a Ray address"), out["--address"]
    assert out["RAY_ADDRESS"].startswith("RAY_ADDRESS: 'http://127.0.0.1:8265' is not a Ray address"), out


@pytest.mark.long  # two Ray starts; the refusal itself runs in `make test`; CI runs it
def test_an_allowed_open_embedded_ray_warns_and_a_run_sent_elsewhere_names_the_cluster():
    """RAY_AUTH_MODE=disabled with ray.allow_unauthenticated: true: the embedded Ray starts open, with the warning;
    a second process whose RAY_ADDRESS points at it attaches and says so in one line."""
    code = textwrap.dedent("""
        import json, os, subprocess, sys, ray
        from cluster import config as C, placement
        assert placement.start_ray(C.load(None, ["ray.allow_unauthenticated=true", "ray.num_cpus=1"]), None)
        gcs = ray.get_runtime_context().gcs_address
        attach = ("import ray; from cluster import config as C, placement; "
                  "assert not placement.start_ray(C.load(None), None); ray.shutdown()")
        child = subprocess.run([sys.executable, "-c", attach], capture_output=True, text=True, timeout=120,
                               env={**os.environ, "RAY_ADDRESS": gcs})
        placement.stop_ray()
        print(json.dumps({"gcs": gcs, "rc": child.returncode, "stderr": child.stderr}))
    """)
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: the embedded Ray starts "
                                                                              "without token authentication")]
    assert len(warnings) == 1 and "RAY_AUTH_MODE='disabled'" in warnings[0], proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["rc"] == 0, out["stderr"][-3000:]
    attached = [line for line in out["stderr"].splitlines() if line.startswith("ray: attached to the existing cluster")]
    assert len(attached) == 1, out["stderr"][-3000:]
    assert attached[0].startswith(f"ray: attached to the existing cluster at {out['gcs']} (RAY_ADDRESS={out['gcs']}, "
                                  f"1 live node(s), token authentication off)"), attached[0]


@pytest.mark.parametrize("args, env, expected", [
    ((), {"RAY_AUTH_MODE": "disabled"}, "ray.allow_unauthenticated: false"),
    (("--address", "::::"), {}, "--address: '::::' is not a Ray address"),
    ((), {"RAY_ADDRESS": "::::"}, "RAY_ADDRESS: '::::' is not a Ray address"),
])
def test_the_cli_refuses_an_open_embedded_ray_and_bad_addresses_in_one_line(tmp_path, args, env, expected):
    proc = train(*args, "--run-dir", str(tmp_path / "run"), env=env, dry_run=False)
    one_config_error(proc, expected)


@pytest.mark.parametrize("body", ["raise RuntimeError('constructor failed')", "import sys; sys.exit(0)"])
def test_an_env_whose_constructor_raises_or_exits_is_one_line_at_dry_run(tmp_path, body):
    module = tmp_path / "ctor_env_mod.py"
    module.write_text("import gymnasium\n"
                      "class Env(gymnasium.Env):\n"
                      f"    def __init__(self):\n        {body}\n"
                      "gymnasium.register('CtorEnv-v0', entry_point=Env)\n")
    proc = subprocess.run([sys.executable, "-m", "cluster.train", "--dry-run", "--set", "env.id=ctor_env_mod:CtorEnv-v0"],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=f"{ROOT}:{tmp_path}"), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot be made" in lines[0], proc.stderr
