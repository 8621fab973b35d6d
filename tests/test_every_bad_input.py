"""Every bad input, at every entry point and in every file the project reads: one line, the right exit code, nothing
lost, within seconds.

Each CLI case runs the entry point's real ``main(argv)`` in a child process of its own, forked from a case server
(``python -m tests.test_every_bad_input``) that imported every entry point once: real exit codes, real stderr, a
real hang (the server SIGKILLs a child past its deadline), without a fresh interpreter and its ~2 s of imports per
case. The cases that need Ray or a fresh interpreter run as real subprocesses. A Python API case calls the function
in the same kind of child; its contract is a raised ConfigError (or a subclass) whose message is one line. Every
config key gets a wrong-type value and, where it has a range, one outside it, through ``cluster.config.load``.

The table of every case and what it printed is docs/failures.md's "Bad input" section, generated here:
``ASCENT_WRITE_TABLES=1 .venv/bin/python -m pytest tests/test_every_bad_input.py`` writes it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import select
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: A case past this is a hang: the child is SIGKILLed and the case fails.
DEADLINE_S = 30.0
#: A Ray case's deadline: a fresh interpreter that imports Ray and gives up on a cluster within its own bound.
RAY_DEADLINE_S = 60.0
DOC = ROOT / "docs" / "failures.md"
START, END = "<!-- bad-input-table:start -->", "<!-- bad-input-table:end -->"
#: The tracebacks' and the error lines' marks: none of these may show in what a case prints.
TRACEBACK = "Traceback (most recent call last)"

# --------------------------------------------------------------------------- the case server

ENTRY_POINTS = ("cluster.train", "cluster.evaluate", "cluster.export", "cluster.report", "cluster.control",
                "cluster.doctor", "cluster.tune", "cluster.api")


def _child(case: dict, out_path: str, err_path: str) -> None:
    """In the forked child: stdout and stderr into files, the case's environment, its entry point; exits with its
    return code (an API call: 0 returned, 2 a ConfigError, printed as one line, 1 anything else, with its
    traceback), as ``python -m`` would."""
    import importlib
    import traceback

    out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(err, 2)
    rc = 1
    try:
        for key, value in case.get("env", {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for path in case.get("path", ()):
            sys.path.insert(0, path)
        os.chdir(case["cwd"])
        if case.get("call"):
            module, _, name = case["call"].partition(":")
            from cluster.config import ConfigError

            try:
                getattr(importlib.import_module(module), name)(*case["args"], **case.get("kwargs", {}))
                rc = 0
            except ConfigError as e:
                print(f"{type(e).__name__}: {e}", file=sys.stderr)
                rc = 2
        else:
            rc = importlib.import_module(case["module"]).main(case["argv"])
    except SystemExit as e:  # argparse
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - what an uncaught exception does to `python -m`
        traceback.print_exc()
        rc = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc if isinstance(rc, int) else 1)


def _run_forked(case: dict, scratch: str, n: int) -> dict:
    out_path, err_path = f"{scratch}/{n}.out", f"{scratch}/{n}.err"
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(case, out_path, err_path)
    hung = False
    deadline = t0 + case.get("deadline", DEADLINE_S)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            hung = True
            break
        time.sleep(0.005)
    read = (lambda p: Path(p).read_bytes().decode(errors="replace") if os.path.exists(p) else "")
    return {"rc": os.waitstatus_to_exitcode(status), "stdout": read(out_path), "stderr": read(err_path),
            "seconds": time.monotonic() - t0, "hung": hung}


def serve() -> None:
    """Import every entry point, then answer one case per stdin line with one JSON line on stdout. Nothing here
    starts a thread before the forks (checked), so each child is a clean copy."""
    import importlib
    import tempfile
    import threading

    import torch  # noqa: F401 - the children's heavy imports, done once

    for name in ENTRY_POINTS + ("cluster.driver", "actors.envs", "learner.model", "gymnasium"):
        importlib.import_module(name)
    assert threading.active_count() == 1, threading.enumerate()
    scratch = tempfile.mkdtemp(prefix="bad-input-")
    reply = os.fdopen(os.dup(1), "w")
    print("ready", file=reply, flush=True)
    for n, line in enumerate(sys.stdin):
        print(json.dumps(_run_forked(json.loads(line), scratch, n)), file=reply, flush=True)


class Server:
    def __init__(self):
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.test_every_bad_input"], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._line(120) == "ready"

    def _line(self, timeout: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, "the case server did not answer"
        return self.proc.stdout.readline().strip()

    def run(self, case: dict) -> dict:
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line(case.get("deadline", DEADLINE_S) + 30))

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


# --------------------------------------------------------------------------- the files the project reads


def _yaml(data) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


def build_files(d: Path) -> None:
    """Good and damaged checkpoints, run directories, configs and metrics files under ``d``."""
    import torch

    from cluster import checkpoint
    from cluster import config as C
    from cluster.graph import describe_env
    from learner.model import build_model

    cfg = C.load(str(ROOT / "configs" / "cartpole.yaml"))
    torch.manual_seed(0)
    model = build_model(describe_env(cfg)).state_dict()
    small = build_model(describe_env(C.load(str(ROOT / "configs" / "cartpole.yaml"),
                                            ["learner.hidden_sizes=[8]"]))).state_dict()
    from cluster.records import RunState

    run_state = {**RunState.fresh(100).to_checkpoint(), "iteration": 3, "env_steps": 3072}
    good = {"learner": {"model": model, "version": 3}, "run_state": run_state, "config": cfg.to_dict(),
            "run_id": "r1"}
    ckpt = lambda name, payload: checkpoint.save(d / name, payload)  # noqa: E731
    ckpt("ckpt.pt", good)
    raw = (d / "ckpt.pt").read_bytes()
    (d / "trunc.pt").write_bytes(raw[: len(raw) // 2])
    (d / "zero.pt").write_bytes(b"")
    (d / "text.pt").write_text("not a checkpoint\n")
    (d / "plain.pkl").write_bytes(pickle.dumps({"learner": {"model": {}}}))
    torch.save(argparse_namespace(), d / "object.pt")
    torch.save(torch.zeros(3), d / "tensor.pt")
    ckpt("nolearner.pt", {"weights": torch.zeros(2)})
    ckpt("nomodel.pt", {**good, "learner": {"version": 3}})
    ckpt("modelnotdict.pt", {**good, "learner": {"model": 5}})
    ckpt("noconfig.pt", {k: v for k, v in good.items() if k != "config"})
    ckpt("configstr.pt", {**good, "config": "CartPole-v1"})
    ckpt("badconfig.pt", {**good, "config": {**cfg.to_dict(), "ppo": {"gamma": 5}}})
    ckpt("shape.pt", {**good, "learner": {"model": small}})
    ckpt("modenv.pt", {**good, "config": {**cfg.to_dict(), "env": {**cfg.to_dict()["env"], "id": "evil_mod:Env-v0"}}})
    (d / "notdir").write_text("a file\n")
    (d / "empty").mkdir()
    (d / "nonutf8.yaml").write_bytes(b"run:\n  seed: \xff\xfe\n")
    (d / "binary.yaml").write_bytes(bytes(range(256)))
    (d / "empty.yaml").write_text("")
    (d / "comments.yaml").write_text("# nothing but a comment\n")
    (d / "list.yaml").write_text("- a\n- b\n")
    (d / "scalar.yaml").write_text("CartPole-v1\n")
    (d / "unknown.yaml").write_text("learner:\n  lrr: 0.001\n")
    (d / "dup.yaml").write_text("learner:\n  lr: 0.001\n  lr: 0.002\n")
    (d / "badyaml.yaml").write_text("learner: [\n")
    (d / "tabs.yaml").write_text("learner:\n\tlr: 0.001\n")
    (d / "section.yaml").write_text("learner: 5\n")
    (d / "env_list.yaml").write_text("env:\n  id: [CartPole-v1]\n")
    (d / "other_model.yaml").write_text("env:\n  id: CartPole-v1\nlearner:\n  hidden_sizes: [16, 16]\n")
    (d / "pendulum.yaml").write_text("env:\n  id: Pendulum-v1\n")
    # Run directories for --resume: each a config.yaml, a run.json and a checkpoint, one of them damaged.
    for name, final in [("run", good), ("run_trunc", None), ("run_zero", b""), ("run_text", b"text\n"),
                        ("run_object", "object"), ("run_nostate", {k: v for k, v in good.items() if k != "run_state"}),
                        ("run_badjson", good), ("run_listjson", good), ("run_foreign", good), ("run_noconfig", good),
                        ("run_badyaml", good), ("run_ckptdir", "dir"), ("run_nockpt", "none"),
                        ("run_modenv", good), ("run_badstate", {**good, "run_state": {"iteration": 3, "env_steps": 3072}}),
                        ("run_negstate", {**good, "run_state": {**run_state, "env_steps": -5}})]:
        run = d / name
        (run / "checkpoints").mkdir(parents=True)
        if name != "run_noconfig":
            (run / "config.yaml").write_text(_yaml(cfg.to_dict()))
        (run / "run.json").write_text(json.dumps({"run_id": "r1"}) + "\n")
        target = run / "checkpoints" / "final.pt"
        if isinstance(final, dict):
            checkpoint.save(target, final)
        elif isinstance(final, bytes):
            target.write_bytes(final)
        elif final is None:
            target.write_bytes(raw[: len(raw) // 3])
        elif final == "object":
            torch.save(argparse_namespace(), target)
        elif final == "dir":
            target.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i, "env_steps": 1024 * i}) + "\n"
                                                   for i in (1, 2, 3)))
    (d / "run_badjson" / "run.json").write_text("{\"run_id\": \n")
    (d / "run_listjson" / "run.json").write_text("[1, 2]\n")
    (d / "run_foreign" / "run.json").write_text(json.dumps({"run_id": "someone-else"}) + "\n")
    (d / "run_badyaml" / "config.yaml").write_text("learner: [\n")
    modenv = cfg.to_dict()
    modenv["env"]["id"] = "evil_mod:Env-v0"
    (d / "run_modenv" / "config.yaml").write_text(_yaml(modenv))
    # Metrics files for cluster.report.
    record = lambda i: json.dumps({"iteration": i, "env_steps": 1024 * i, "episode_return_mean": 10.0 * i})  # noqa
    metrics = {
        "m_nonutf8": b"\xff\xfe\x00\x01garbage\n\x80\x81\n",
        "m_empty": b"",
        "m_blank": b"\n\n   \n",
        "m_notjson": b"iteration 1\niteration 2\n",
        "m_arrays": b"[1, 2]\n[3]\n",
        "m_truncated": (record(1) + "\n" + record(2) + "\n" + record(3)[:15]).encode(),
        "m_badbyte": (record(1) + "\n").encode() + b"{\"iteration\": 2, \xff}\n" + (record(3) + "\n").encode(),
        "m_strings": (json.dumps({"iteration": "one", "env_steps": "many"}) + "\n").encode(),
        "m_huge": (json.dumps({"iteration": 1, "env_steps": 1e308, "episode_return_mean": 1e308}) + "\n" +
                   "{\"iteration\": 2, \"env_steps\": 1e999, \"episode_return_mean\": NaN}\n").encode(),
        "m_binary": bytes(range(256)) * 4,
    }
    for name, data in metrics.items():
        (d / name).mkdir()
        (d / name / "metrics.jsonl").write_bytes(data)
    (d / "m_isdir" / "metrics.jsonl").mkdir(parents=True)
    (d / "m_summarydir").mkdir()
    (d / "m_summarydir" / "metrics.jsonl").write_text(record(1) + "\n")
    (d / "m_summarydir" / "summary.txt").mkdir()
    (d / "modules").mkdir()
    (d / "modules" / "hang_import_env.py").write_text("import time\ntime.sleep(3600)\n")
    (d / "modules" / "hang_ctor_env.py").write_text(
        "import time\nimport gymnasium as gym\n\n\ndef make(**kwargs):\n    time.sleep(3600)\n\n\n"
        "gym.register('HangCtor-v0', entry_point=make)\n")
    (d / "hang.yaml").write_text("env:\n  id: hang_import_env:Env-v0\nrun:\n  startup_timeout_s: 2\n")
    (d / "modules" / "evil_mod.py").write_text("raise SystemExit('evil_mod was imported')\n")


def argparse_namespace():
    import argparse

    return argparse.Namespace(weights=[1, 2, 3])


# --------------------------------------------------------------------------- the cases


class Case(NamedTuple):
    entry: str  # the entry point: a module run as ``python -m``, or cluster.api
    what: str  # the bad input, in words: the table's second column
    argv: tuple = ()  # the command's arguments; {d} is the files' directory
    rc: int = 2
    expect: str = ""  # a piece of the line it prints
    call: str | None = None  # an API case: "cluster.api:load_policy", called with argv as its arguments
    kwargs: dict | None = None
    env: dict | None = None
    kept: str | None = None  # a path under {d} whose files must be as they were
    fresh: bool = False  # a real ``python -m`` subprocess (Ray, or a hang that lives in a fresh interpreter)

    @property
    def key(self) -> str:
        return f"{self.entry}: {self.what}"


def T(what, *argv, **kw) -> Case:
    return Case("cluster.train", what, ("--dry-run",) + argv, **kw)


def R(what, run: str, *argv, **kw) -> Case:
    """--resume of a run directory under {d}: refused, and its files as they were."""
    return Case("cluster.train", what, ("--dry-run", "--resume", "{d}/" + run) + argv, kept=run, **kw)


def E(what, *argv, **kw) -> Case:
    return Case("cluster.evaluate", what, argv, **kw)


def X(what, *argv, **kw) -> Case:
    return Case("cluster.export", what, argv, **kw)


def P(what, run: str, *argv, **kw) -> Case:
    """A run directory under {d}: a refusal leaves its files as they were (a report writes summary.txt)."""
    return Case("cluster.report", what, ("{d}/" + run, "--no-plot") + argv, kept=run if kw.get("rc", 2) else None,
                **kw)


def API(what, function, *args, **kw) -> Case:
    kwargs = kw.pop("kwargs", None)
    return Case("cluster.api", what, args, call=f"cluster.api:{function}", kwargs=kwargs, **kw)


CKPT = "{d}/ckpt.pt"
CASES = [
    # cluster.train: flags
    T("--profile -1", "--profile", "-1", expect="--profile: -1 is out of range"),
    T("--profile not a number", "--profile", "many", expect="argument --profile: invalid int value: 'many'"),
    T("an unknown flag", "--epochs", "3", expect="unrecognized arguments: --epochs 3"),
    T("--set without =", "--set", "learner.lr", expect="expected KEY.PATH=VALUE"),
    T("--set with an empty key", "--set", "learner.=1", expect="empty key"),
    T("--set an unknown key", "--set", "learner.lrr=1e-3", expect="learner.lrr: unknown key"),
    T("--set a section to a value", "--set", "learner=5", expect="learner: expected a mapping"),
    T("--set below a value", "--set", "learner.lr.x=1", expect="learner.lr: {'x': 1} is not a number"),
    T("--set a value of 2 MB", "--set", "env.id=" + "x" * (2 << 20), expect="allowed: at most 1,048,576"),
    T("--set run.run_name to a path", "--set", "run.run_name=../../etc", expect="run.run_name: '../../etc'"),
    T("--run-dir holding another run", "--run-dir", "{d}/run", kept="run", expect="holds another run"),
    T("--run-dir inside a file", "--run-dir", "{d}/notdir/run", expect="notdir"),
    # cluster.train: config files
    T("--config that does not exist", "--config", "{d}/missing.yaml", expect="does not exist or is not a file"),
    T("--config a directory", "--config", "{d}/empty", expect="does not exist or is not a file"),
    T("--config not UTF-8", "--config", "{d}/nonutf8.yaml", expect="is not UTF-8 text"),
    T("--config binary", "--config", "{d}/binary.yaml", expect="is not UTF-8 text"),
    T("--config empty", "--config", "{d}/empty.yaml", expect="holds no settings"),
    T("--config only comments", "--config", "{d}/comments.yaml", expect="holds no settings"),
    T("--config a YAML list", "--config", "{d}/list.yaml", expect="top level must be a mapping"),
    T("--config a YAML scalar", "--config", "{d}/scalar.yaml", expect="top level must be a mapping"),
    T("--config an unknown key", "--config", "{d}/unknown.yaml", expect="did you mean 'learner.lr'"),
    T("--config a duplicate key", "--config", "{d}/dup.yaml", expect="lr"),
    T("--config not valid YAML", "--config", "{d}/badyaml.yaml", expect="is not valid YAML"),
    T("--config indented with a tab", "--config", "{d}/tabs.yaml", expect="is not valid YAML"),
    T("--config a section as a value", "--config", "{d}/section.yaml", expect="learner: expected a mapping"),
    T("--config env.id a list", "--config", "{d}/env_list.yaml", expect="env.id: ['CartPole-v1'] is not a string"),
    T("--config a checkpoint", "--config", CKPT, expect="is not UTF-8 text"),
    T("an env id gymnasium does not know", "--set", "env.id=NoSuchEnv-v9", expect="NoSuchEnv-v9"),
    T("an env module that does not exist", "--set", "env.id=no_such_module:Env-v0", expect="no_such_module"),
    # cluster.train: --resume of damaged run directories
    R("--resume a directory that does not exist", "missing", expect="has no checkpoint"),
    R("--resume a file", "notdir", expect="notdir"),
    R("--resume an empty directory", "empty", expect="has no checkpoint"),
    R("--resume a truncated checkpoint", "run_trunc", expect="cannot be read as a checkpoint"),
    R("--resume a zero-byte checkpoint", "run_zero", expect="cannot be read as a checkpoint"),
    R("--resume a text file as checkpoint", "run_text", expect="cannot be read as a checkpoint"),
    R("--resume a pickle of other objects", "run_object", expect="refuses to build"),
    R("--resume a checkpoint without run state", "run_nostate", expect="holds weights but no run state"),
    R("--resume a run.json that is not JSON", "run_badjson", expect="run.json: cannot be read"),
    R("--resume a run.json that is a list", "run_listjson", expect="run.json: cannot be read"),
    R("--resume a checkpoint of another run", "run_foreign", expect="has no checkpoint"),
    R("--resume without config.yaml", "run_noconfig", expect="does not exist or is not a file"),
    R("--resume a config.yaml not valid YAML", "run_badyaml", expect="is not valid YAML"),
    R("--resume final.pt a directory", "run_ckptdir", expect="has no checkpoint"),
    R("--resume a checkpoints/ with none", "run_nockpt", expect="has no checkpoint"),
    R("--resume a config importing a module", "run_modenv", expect="--trust-code"),
    R("--resume a run state lacking counters", "run_badstate", expect="run_state lacks episodes_total"),
    R("--resume a negative counter", "run_negstate", expect="run_state.env_steps is -5, not an integer >= 0"),
    R("--resume --set another model", "run", "--set", "learner.hidden_sizes=[8]",
      expect="the checkpoint's weights do not fit the model this config builds"),
    R("--resume into a --run-dir of another run", "run", "--run-dir", "{d}/run_foreign", expect="holds another run"),
    Case("cluster.train", "--resume --set another model, past --dry-run",
         ("--address", "inprocess", "--resume", "{d}/run", "--set", "learner.hidden_sizes=[8]"), kept="run",
         expect="the checkpoint's weights do not fit the model this config builds"),
    R("--resume --set an unknown key", "run", "--set", "ppo.gama=0.9", expect="did you mean 'ppo.gamma'"),
    R("--resume --config that does not exist", "run", "--config", "{d}/missing.yaml", expect="does not exist"),
    # cluster.evaluate
    E("no argument", expect="the following arguments are required"),
    E("a path that does not exist", "{d}/missing", expect="is not a checkpoint file or a run directory"),
    E("an empty directory", "{d}/empty", expect="is not a checkpoint file or a run directory"),
    E("a truncated checkpoint", "{d}/trunc.pt", expect="cannot be read as a checkpoint"),
    E("a zero-byte checkpoint", "{d}/zero.pt", expect="cannot be read as a checkpoint"),
    E("a text file", "{d}/text.pt", expect="cannot be read as a checkpoint"),
    E("a plain pickle", "{d}/plain.pkl", expect="cannot be read as a checkpoint"),
    E("a pickle of other objects", "{d}/object.pt", expect="refuses to build"),
    E("a torch file of one tensor", "{d}/tensor.pt", expect="no learner state"),
    E("a checkpoint without learner state", "{d}/nolearner.pt", expect="no learner state"),
    E("a checkpoint without weights", "{d}/nomodel.pt", expect="no model weights"),
    E("a checkpoint whose weights are not a mapping", "{d}/modelnotdict.pt", expect="no model weights"),
    E("a checkpoint without a config", "{d}/noconfig.pt", expect="no config"),
    E("a checkpoint whose config is text", "{d}/configstr.pt", expect="no config"),
    E("a checkpoint whose config is out of range", "{d}/badconfig.pt", expect="ppo.gamma: 5"),
    E("a checkpoint of another model shape", "{d}/shape.pt", expect="does not fit the model"),
    E("a checkpoint importing a module", "{d}/modenv.pt", expect="--trust-code"),
    E("a run directory with a damaged checkpoint", "{d}/run_trunc", expect="cannot be read as a checkpoint"),
    E("a run.json that is not JSON", "{d}/run_badjson", expect="run.json: cannot be read"),
    E("--config of another model", CKPT, "--config", "{d}/other_model.yaml", expect="does not fit the model"),
    E("--config of another env", CKPT, "--config", "{d}/pendulum.yaml", expect="does not fit the model"),
    E("--config that does not exist", CKPT, "--config", "{d}/missing.yaml", expect="does not exist"),
    E("--config not UTF-8", CKPT, "--config", "{d}/nonutf8.yaml", expect="is not UTF-8 text"),
    E("--episodes 0", CKPT, "--episodes", "0", expect="--episodes: 0 is out of range"),
    E("--episodes -3", CKPT, "--episodes", "-3", expect="--episodes: -3 is out of range"),
    E("--episodes 1e9", CKPT, "--episodes", "1000000000", expect="--episodes: 1000000000 is out of range"),
    E("--episodes not a number", CKPT, "--episodes", "ten", expect="invalid int value: 'ten'"),
    E("--seed -1", CKPT, "--seed", "-1", expect="--seed: -1 is out of range"),
    E("--seed 2^64", CKPT, "--seed", str(2**64), expect="is out of range"),
    E("--device bogus", CKPT, "--device", "bogus", expect="--device: 'bogus'"),
    E("--device cuda:7", CKPT, "--device", "cuda:7", expect="--device: 'cuda:7'"),
    E("--device npu", CKPT, "--device", "npu", expect="--device: 'npu'"),
    E("--video into a file", CKPT, "--video", "{d}/notdir/videos", expect="--video"),
    E("--video a file", CKPT, "--video", "{d}/notdir", expect="--video"),
    E("--policy in a one-policy run", CKPT, "--policy", "red", expect="--policy: 'red' is not a policy"),
    # cluster.export
    X("no --out", CKPT, expect="the following arguments are required: --out"),
    X("a path that does not exist", "{d}/missing", "--out", "{d}/x.pt2", expect="is not a checkpoint file"),
    X("a truncated checkpoint", "{d}/trunc.pt", "--out", "{d}/x.pt2", expect="cannot be read as a checkpoint"),
    X("a zero-byte checkpoint", "{d}/zero.pt", "--out", "{d}/x.pt2", expect="cannot be read as a checkpoint"),
    X("a pickle of other objects", "{d}/object.pt", "--out", "{d}/x.pt2", expect="refuses to build"),
    X("a checkpoint without weights", "{d}/nomodel.pt", "--out", "{d}/x.pt2", expect="no model weights"),
    X("a checkpoint without a config", "{d}/noconfig.pt", "--out", "{d}/x.pt2", expect="no config"),
    X("a checkpoint of another model shape", "{d}/shape.pt", "--out", "{d}/x.pt2", expect="does not fit the model"),
    X("a checkpoint importing a module", "{d}/modenv.pt", "--out", "{d}/x.pt2", expect="--trust-code"),
    X("--format not a format", CKPT, "--out", "{d}/x.pt2", "--format", "tflite", expect="invalid choice: 'tflite'"),
    X("--out with an unknown suffix", CKPT, "--out", "{d}/x.txt", expect="--format: 'txt' is not a format"),
    X("--out inside a file", CKPT, "--out", "{d}/notdir/x.pt2", expect="--out"),
    X("--out a directory", CKPT, "--out", "{d}/empty", "--format", "pt2", expect="--out"),
    X("--config of another model", CKPT, "--out", "{d}/x.pt2", "--config", "{d}/other_model.yaml",
      expect="does not fit the model"),
    X("--policy in a one-policy run", CKPT, "--out", "{d}/x.pt2", "--policy", "red", expect="policy: 'red'"),
    # cluster.report
    Case("cluster.report", "a directory that does not exist", ("{d}/missing",), expect="no metrics.jsonl"),
    Case("cluster.report", "a file that does not exist", ("{d}/missing/metrics.jsonl",), expect="no metrics.jsonl"),
    P("a directory without metrics.jsonl", "empty", expect="no metrics.jsonl"),
    P("metrics.jsonl a directory", "m_isdir", expect="no metrics.jsonl"),
    P("metrics.jsonl not UTF-8", "m_nonutf8", expect="holds no metrics records"),
    P("metrics.jsonl binary", "m_binary", expect="holds no metrics records"),
    P("metrics.jsonl empty", "m_empty", expect="holds no metrics records"),
    P("metrics.jsonl blank lines", "m_blank", expect="holds no metrics records"),
    P("metrics.jsonl not JSON", "m_notjson", expect="holds no metrics records"),
    P("metrics.jsonl JSON arrays", "m_arrays", expect="holds no metrics records"),
    P("metrics.jsonl a truncated last line", "m_truncated", rc=0, expect="skipped 1 line(s) that are not JSON"),
    P("metrics.jsonl a line with a bad byte", "m_badbyte", rc=0, expect="skipped 1 line(s) that are not JSON"),
    P("metrics.jsonl text where numbers go", "m_strings", rc=0),
    P("metrics.jsonl 1e308, inf and NaN", "m_huge", rc=0),
    P("summary.txt a directory", "m_summarydir", expect="summary.txt"),
    P("an unknown flag", "run", "--png", expect="unrecognized arguments: --png"),
    # cluster.control (the cases that reach no cluster; those that try one run below, fresh)
    Case("cluster.control", "no --run", ("--rollout-actors", "2"), expect="the following arguments are required"),
    Case("cluster.control", "--rollout-actors not a number", ("--run", "x", "--rollout-actors", "two"),
         expect="invalid int value: 'two'"),
    Case("cluster.control", "--rollout-actors 0", ("--run", "x", "--rollout-actors", "0"),
         expect="--rollout-actors: 0 is out of range"),
    Case("cluster.control", "--rollout-actors 10^6", ("--run", "x", "--rollout-actors", "1000000"),
         expect="--rollout-actors: 1000000 is out of range"),
    Case("cluster.control", "--timeout 0", ("--run", "x", "--rollout-actors", "2", "--timeout", "0"),
         expect="--timeout: 0 is out of range"),
    Case("cluster.control", "--timeout nan", ("--run", "x", "--rollout-actors", "2", "--timeout", "nan"),
         expect="--timeout: nan is out of range"),
    Case("cluster.control", "--timeout 1e99", ("--run", "x", "--rollout-actors", "2", "--timeout", "1e99"),
         expect="--timeout: 1e+99 is out of range"),
    Case("cluster.control", "--address ::::", ("--run", "x", "--rollout-actors", "2", "--address", "::::"),
         expect="--address: '::::' is not a Ray address"),
    Case("cluster.control", "--address http://", ("--run", "x", "--rollout-actors", "2", "--address", "http://h:1"),
         expect="--address: 'http://h:1' is not a Ray address"),
    Case("cluster.control", "--address inprocess", ("--run", "x", "--rollout-actors", "2", "--address",
                                                    "inprocess"), expect="--address: 'inprocess'"),
    Case("cluster.control", "--run a path", ("--run", "../x", "--rollout-actors", "2"),
         expect="--run: '../x' is not a run name"),
    # cluster.doctor
    Case("cluster.doctor", "an unknown flag", ("--fix",), expect="unrecognized arguments: --fix"),
    Case("cluster.doctor", "an argument", ("now",), expect="unrecognized arguments: now"),
    # cluster.tune
    Case("cluster.tune", "no --config", (), expect="the following arguments are required: --config"),
    Case("cluster.tune", "--config that does not exist", ("--config", "{d}/missing.yaml"), expect="does not exist"),
    Case("cluster.tune", "--config not UTF-8", ("--config", "{d}/nonutf8.yaml"), expect="is not UTF-8 text"),
    Case("cluster.tune", "--grid without =", ("--config", "configs/cartpole.yaml", "--grid", "learner.lr"),
         expect="--grid"),
    Case("cluster.tune", "--grid without values", ("--config", "configs/cartpole.yaml", "--grid", "learner.lr="),
         expect="--grid"),
    Case("cluster.tune", "--grid an unknown key", ("--config", "configs/cartpole.yaml", "--grid", "learner.lrr=1,2"),
         expect="learner.lrr: unknown key"),
    Case("cluster.tune", "--grid a value out of range", ("--config", "configs/cartpole.yaml", "--grid",
                                                         "ppo.gamma=0.9,2"), expect="ppo.gamma: 2"),
    Case("cluster.tune", "--seeds not integers", ("--config", "configs/cartpole.yaml", "--seeds", "a,b"),
         expect="--seeds"),
    Case("cluster.tune", "--seeds empty", ("--config", "configs/cartpole.yaml", "--seeds", ""), expect="--seeds"),
    Case("cluster.tune", "--seeds -1", ("--config", "configs/cartpole.yaml", "--seeds", "-1"), expect="--seeds"),
    Case("cluster.tune", "--max-concurrent 0", ("--config", "configs/cartpole.yaml", "--max-concurrent", "0"),
         expect="--max-concurrent: 0"),
    Case("cluster.tune", "--scheduler unknown", ("--config", "configs/cartpole.yaml", "--scheduler", "asha"),
         expect="invalid choice: 'asha'"),
    Case("cluster.tune", "--population 1", ("--config", "configs/cartpole.yaml", "--scheduler", "pbt",
                                            "--population", "1", "--mutate", "learner.lr=1e-4:1e-3"),
         expect="--population: 1"),
    Case("cluster.tune", "--mutate without pbt", ("--config", "configs/cartpole.yaml", "--mutate",
                                                  "learner.lr=1e-4:1e-3"), expect="--mutate needs --scheduler pbt"),
    Case("cluster.tune", "--mutate not a range", ("--config", "configs/cartpole.yaml", "--scheduler", "pbt",
                                                  "--mutate", "learner.lr=fast"), expect="--mutate"),
    Case("cluster.tune", "--grid with pbt", ("--config", "configs/cartpole.yaml", "--scheduler", "pbt", "--grid",
                                             "learner.lr=1,2", "--mutate", "learner.lr=1e-4:1e-3"),
         expect="--grid is for --scheduler grid"),
    Case("cluster.tune", "--interval-steps 0", ("--config", "configs/cartpole.yaml", "--scheduler", "pbt",
                                                "--interval-steps", "0", "--mutate", "learner.lr=1e-4:1e-3"),
         expect="--interval-steps: 0"),
    Case("cluster.tune", "--out inside a file", ("--config", "configs/cartpole.yaml", "--out", "{d}/notdir/tune"),
         expect="--out"),
    Case("cluster.tune", "--address ::::", ("--config", "configs/cartpole.yaml", "--address", "::::"),
         expect="--address: '::::' is not a Ray address"),
    # the Python API: a ConfigError (or a subclass) with a one-line message
    API("train: a config that does not exist", "train", "{d}/missing.yaml", expect="does not exist"),
    API("train: a config out of range", "train", kwargs={"config": {"ppo": {"gamma": 5}}}, expect="ppo.gamma: 5"),
    API("train: an unknown override", "train", "configs/cartpole.yaml", kwargs={"learner__lrr": 1},
        expect="learner.lrr: unknown key"),
    API("train: an override of the wrong type", "train", "configs/cartpole.yaml", kwargs={"learner.lr": "fast"},
        expect="learner.lr: 'fast' is not a number"),
    API("train: a config of the wrong type", "train", kwargs={"config": 5}, expect="config"),
    API("train: an empty config file", "train", "{d}/empty.yaml", expect="holds no settings"),
    API("load_policy: a path that does not exist", "load_policy", "{d}/missing", expect="is not a checkpoint file"),
    API("load_policy: a truncated checkpoint", "load_policy", "{d}/trunc.pt", expect="cannot be read as a checkpoint"),
    API("load_policy: a pickle of other objects", "load_policy", "{d}/object.pt", expect="refuses to build"),
    API("load_policy: a checkpoint without weights", "load_policy", "{d}/nomodel.pt", expect="no model weights"),
    API("load_policy: a checkpoint without a config", "load_policy", "{d}/noconfig.pt", expect="no config"),
    API("load_policy: another model shape", "load_policy", "{d}/shape.pt", expect="does not fit the model"),
    API("load_policy: device bogus", "load_policy", CKPT, kwargs={"device": "bogus"}, expect="device: 'bogus'"),
    API("load_policy: device cuda:7", "load_policy", CKPT, kwargs={"device": "cuda:7"}, expect="device: 'cuda:7'"),
    API("load_policy: seed -1", "load_policy", CKPT, kwargs={"seed": -1}, expect="seed: -1 is out of range"),
    API("load_policy: an unknown policy", "load_policy", CKPT, kwargs={"policy": "red"}, expect="policy: 'red'"),
    API("load_policy: a config mapping out of range", "load_policy", CKPT, kwargs={"config": {"ppo": {"gamma": 5}}},
        expect="ppo.gamma: 5"),
    API("load_policy: a config of another model", "load_policy", CKPT, kwargs={"config": "{d}/other_model.yaml"},
        expect="does not fit the model"),
    API("load_policy: a module env without trust", "load_policy", "{d}/modenv.pt", expect="trust_code=True"),
    # Waits with a deadline: an env that hangs in its module or constructor (in this process: env.isolation none),
    # a cluster address where nothing listens
    T("an env module that hangs on import", "--set", "env.id=hang_import_env:Env-v0", "--set",
      "run.startup_timeout_s=2", expect="did not finish within 2 s (run.startup_timeout_s)"),
    T("an env constructor that hangs", "--set", "env.id=hang_ctor_env:HangCtor-v0", "--set",
      "run.startup_timeout_s=2", expect="did not finish within 2 s (run.startup_timeout_s)"),
    E("--config whose env module hangs on import", CKPT, "--config", "{d}/hang.yaml",
      expect="did not finish within 2 s (run.startup_timeout_s)"),
    Case("cluster.train", "--address where nothing listens", ("--address", "127.0.0.1:1", "--run-dir", "{d}/t1"),
         fresh=True, expect="no Ray cluster answers at 127.0.0.1:1"),
    # Ray, and what must end in a fresh interpreter
    Case("cluster.control", "--address ray://127.0.0.1:1", ("--run", "x", "--rollout-actors", "2", "--address",
                                                            "ray://127.0.0.1:1"), fresh=True, expect="127.0.0.1:1"),
    Case("cluster.control", "--address 127.0.0.1:1", ("--run", "x", "--rollout-actors", "2", "--address",
                                                      "127.0.0.1:1"), fresh=True, expect="127.0.0.1:1"),
    Case("cluster.control", "RAY_ADDRESS 127.0.0.1:1", ("--run", "x", "--rollout-actors", "2"), fresh=True,
         env={"RAY_ADDRESS": "127.0.0.1:1"}, expect="127.0.0.1:1"),
]


# --------------------------------------------------------------------------- running a case


def _snapshot(path: Path) -> dict:
    if not path.exists():
        return {}
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path.parent)): p.read_bytes() for p in files}


def _fill(value, d: Path):
    if isinstance(value, str):
        return value.replace("{d}", str(d))
    if isinstance(value, dict):
        return {k: _fill(v, d) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_fill(v, d) for v in value]
    return value


def _run_fresh(case: Case, d: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env.update({k: v for k, v in _fill(case.env or {}, d).items() if v is not None})
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", case.entry, *_fill(case.argv, d)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RAY_DEADLINE_S)
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        hung = True
    return {"rc": proc.returncode, "stdout": out, "stderr": err, "seconds": time.monotonic() - t0, "hung": hung}


def run_case(case: Case, d: Path, server: Server) -> dict:
    if case.fresh:
        return _run_fresh(case, d)
    env = {"RAY_ADDRESS": None, "RAY_AUTH_MODE": None, **_fill(case.env or {}, d)}
    request = {"module": case.entry, "argv": _fill(case.argv, d), "env": env, "cwd": str(ROOT),
               "path": [str(d / "modules")]}
    if case.call:
        request.update(call=case.call, args=_fill(case.argv, d), kwargs=_fill(case.kwargs or {}, d))
    return server.run(request)


def printed_line(result: dict, d: Path) -> str:
    """The line a case printed (its last stderr line; stdout's where stderr is empty), with the machine's paths as
    placeholders and cut to 100 characters: the table's last column."""
    lines = result["stderr"].strip().splitlines() or result["stdout"].strip().splitlines() or [""]
    line = lines[-1].replace(str(d), "DIR").replace(str(ROOT), "REPO")
    line = re.sub(r"/tmp/[\w./-]*", "TMP", line)
    return line if len(line) <= 100 else line[:99] + "…"


def row(case: Case, result: dict, d: Path) -> str:
    """The case's table row; what it printed as escaped text, not a code span (the docs' checks read code spans
    as commands and paths)."""
    printed = re.sub(r"([\\`*_<>\[\]|])", r"\\\1", printed_line(result, d))
    what = case.what.replace("|", "\\|")
    return f"| {case.entry} | {what} | {result['rc']} | {printed} |"


def contract_failures(case: Case, result: dict) -> list[str]:
    """What a case's outcome breaks of the contract: no hang, the exit code, no traceback, at most two stderr lines,
    the line bounded and holding what it should name."""
    from cluster.config import MAX_ERROR_CHARS

    out, err = result["stdout"], result["stderr"]
    lines = err.strip().splitlines()
    wrong = []
    if result["hung"]:
        wrong.append(f"hung: killed after {result['seconds']:.0f} s")
    if result["rc"] != case.rc:
        wrong.append(f"exit code {result['rc']}, expected {case.rc}")
    if TRACEBACK in out or TRACEBACK in err:
        wrong.append("a traceback")
    if len(lines) > 2:
        wrong.append(f"{len(lines)} stderr lines")
    if case.rc != 0 and out.strip():
        wrong.append("stdout not empty")
    if lines and len(lines[-1]) > MAX_ERROR_CHARS + 40:
        wrong.append(f"a line of {len(lines[-1])} characters")
    if case.expect and case.expect not in out + err:
        wrong.append(f"{case.expect!r} not printed")
    return wrong


def probe() -> None:
    """Every case once, and what of the contract it breaks: ``python -m tests.test_every_bad_input probe``."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="bad-input-files-"))
    build_files(d)
    server = Server()
    t0 = time.monotonic()
    for case in CASES:
        result = run_case(case, d, server)
        wrong = contract_failures(case, result)
        status = "ok  " if not wrong else "FAIL"
        print(f"{status} {result['seconds']:5.2f}s {case.key}: rc {result['rc']} {'; '.join(wrong)}\n"
              f"      {(result['stderr'].strip() or result['stdout'].strip())[-600:]!r}" if wrong else
              f"{status} {result['seconds']:5.2f}s {case.key}: {printed_line(result, d)}", flush=True)
    print(f"{len(CASES)} cases in {time.monotonic() - t0:.1f} s")
    server.close()



# --------------------------------------------------------------------------- the tests

WRITE = os.environ.get("ASCENT_WRITE_TABLES") == "1"
_rows: dict[str, str] = {}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad-input-files")
    build_files(d)
    return d


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.close()
    if WRITE and len(_rows) == len(CASES):
        write_table(table([_rows[c.key] for c in CASES]))


def doc_rows() -> dict[str, str]:
    text = DOC.read_text()
    section = text[text.index(START) + len(START):text.index(END)]
    return {_row_key(line): line for line in section.splitlines() if line.startswith("| cluster.")}


def _row_key(line: str) -> str:
    cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
    return f"{cells[0]}: {cells[1]}".replace("\\|", "|")


def table(rows: list[str]) -> str:
    return "| entry point | bad input | exit code | what it printed (its last line, cut to 100 characters) |\n" \
           "|---|---|---|---|\n" + "\n".join(rows)


def write_table(text: str) -> None:
    doc = DOC.read_text()
    head, rest = doc.split(START, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{START}\n{text}\n{END}{tail}")


def test_there_are_at_least_150_cases_over_every_entry_point():
    assert len(CASES) >= 150 and len({c.key for c in CASES}) == len(CASES)
    assert {c.entry for c in CASES} == set(ENTRY_POINTS)


def test_the_docs_table_has_a_row_for_every_case_in_order():
    if WRITE:
        pytest.skip("ASCENT_WRITE_TABLES=1: the table is being written")
    assert list(doc_rows()) == [c.key for c in CASES], "ASCENT_WRITE_TABLES=1 .venv/bin/python -m pytest " \
                                                       "tests/test_every_bad_input.py writes the table"


@pytest.mark.parametrize("case", CASES, ids=[c.key for c in CASES])
def test_a_bad_input_is_one_line_the_right_exit_code_nothing_lost_within_seconds(case, files, server):
    kept = files / case.kept if case.kept else None
    before = _snapshot(kept) if kept else None
    result = run_case(case, files, server)
    wrong = contract_failures(case, result)
    assert not wrong, f"{case.key}: {'; '.join(wrong)}\nstdout={result['stdout'][-2000:]!r}\n" \
                      f"stderr={result['stderr'][-3000:]!r}"
    if kept is not None:
        assert _snapshot(kept) == before, f"{case.key}: the files of {kept} changed"
    line = row(case, result, files)
    _rows[case.key] = line
    if not WRITE:
        assert doc_rows().get(case.key) == line, "the table in docs/failures.md is not what this case printed; " \
                                                 "ASCENT_WRITE_TABLES=1 writes it"


# --------------------------------------------------------------------------- every config key


def _settings():
    """(key, section class, field) of every setting in the schema: the sections of Config, one modality's and one
    multiagent policy's settings, and the sections inside sections (env.limits)."""
    from cluster import config as C
    from pipeline.contract import ModalitySpec

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            tp = C._type_of(cls, f.name)
            if dataclasses.is_dataclass(tp):
                yield from walk(tp, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}", cls, f

    yield from walk(C.Config, "")
    yield from walk(ModalitySpec, "env.modalities.cam.")
    yield from walk(C.PolicyConfig, "multiagent.policies.p.")


def _base(tp):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) is typing.Union and len(args) == 1 else tp


def bad_values(cls, f) -> list[tuple[str, str]]:
    """(what, --set text of a value) the setting must refuse: one of the wrong type, one past each end of its range
    where it has one, and for a float a value that is not finite."""
    from cluster import config as C

    tp = _base(C._type_of(cls, f.name))
    m = f.metadata
    origin = typing.get_origin(tp)
    if tp is bool:
        out = [("wrong type", "maybe")]
    elif tp is int:
        out = [("wrong type", "'many'")]
    elif tp is float:
        out = [("wrong type", "'fast'")]
    elif tp is str:
        out = [("wrong type", "[1, 2]")]
    elif tp is tuple:
        out = [("wrong type", "[0]")]
    elif tp is list:
        out = [("wrong type", "[]")]
    elif tp is dict or origin is dict:
        out = [("wrong type", "5")]
    elif origin is list:
        out = [("wrong type", "5")]
    else:
        raise AssertionError(f"{f.name}: no wrong value for {tp}")
    if m.get("choices") is not None and tp is str:
        out.append(("not a choice", "no-such-choice"))
    lo, hi = m.get("min"), C.upper_bound(cls, f.name)
    if tp in (int, float, tuple):
        wrap = (lambda v: f"[{v}]") if tp is tuple else str
        if lo is not None:
            below = lo if m.get("min_exclusive") else (lo - 1 if tp is not float else lo - max(abs(lo), 1.0))
            out.append(("below its range", wrap(int(below) if tp is not float else below)))
        if hi is not None:
            out.append(("above its range", wrap(int(hi.value) + 1 if tp is not float else hi.value * 10 + 1)))
    if tp is float:  # a float without a max of its own: finite is its bound
        out.append(("not finite", ".nan" if hi is not None else ".inf"))
    return out


KEY_CASES = [(key, what, value) for key, cls, f in _settings() for what, value in bad_values(cls, f)]


def test_every_setting_has_a_wrong_type_and_every_bounded_one_an_out_of_range_case():
    keys = {key for key, _, _ in _settings()}
    assert keys == {key for key, _, _ in KEY_CASES}
    assert len(keys) >= 100, len(keys)


@pytest.mark.parametrize("key, what, value", KEY_CASES, ids=[f"{k}={v[:20]}" for k, _, v in KEY_CASES])
def test_a_setting_refuses_a_wrong_type_and_a_value_out_of_range_in_one_line_naming_it(key, what, value):
    from cluster import config as C

    with pytest.raises(C.ConfigError) as err:
        C.load(None, [f"{key}={value}"])
    message = str(err.value)
    assert "\n" not in message and len(message) <= C.MAX_ERROR_CHARS, message
    assert key.rpartition(".")[2] in message, (key, message)


#: A sample of the same through the real command (the in-process cases above are the same code path).
CLI_KEYS = ["run.total_env_steps", "learner.lr", "ppo.vf_coef", "learner.hidden_sizes", "env.isolation",
            "rollout.num_actors", "run.seed", "ray.num_cpus", "env.kwargs", "env.wrappers"]


@pytest.mark.parametrize("key", CLI_KEYS)
def test_a_sample_of_the_settings_through_the_command(key, files, server):
    for what, value in [(w, v) for k, w, v in KEY_CASES if k == key]:
        case = Case("cluster.train", f"{key}={value}", ("--dry-run", "--set", f"{key}={value}"), expect=key)
        result = run_case(case, files, server)
        assert not contract_failures(case, result), (case.what, result["stderr"][-2000:])


if __name__ == "__main__":
    probe() if sys.argv[1:] == ["probe"] else serve()
