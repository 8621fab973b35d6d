"""`ray job submit` of the default config to a real, token-authenticated Ray head.

What this pins down (observed with Ray 2.60):

* `ray start --head` turns token auth on when a token exists (~/.ray/auth_token) or when
  RAY_AUTH_MODE=token; it never creates a token itself (with RAY_AUTH_MODE=token and no token it
  refuses to start; with neither it starts with auth OFF and only warns). This test generates a
  token with `ray get-auth-token --generate` in a private HOME and sets RAY_AUTH_MODE=token on
  the head, so auth is on whatever the machine's ~/.ray holds.
* The `ray job` CLI sends the token only when RAY_AUTH_MODE=token is set in its environment;
  without it the request is refused with 401 "Unauthorized: Missing authentication token",
  even though the token file is right there.
* The working directory upload honours .gitignore, so .venv/ and runs/ stay behind.

The head is isolated from every other Ray on the machine (the in-process `ray.init()` of the
other tests, other users' clusters): every port is chosen here, its temp dir is private (so
`ray_current_cluster`, which a bare `ray.init()` would join, is written there and not in
/tmp/ray), and it is stopped by signalling only the processes it started. Never `ray stop`:
that kills every Ray on the machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.conftest import ROOT, records_so_far
from tests.test_user_env import check_user_run, make_user_project

VENV_BIN = Path(sys.executable).parent
RAY = shutil.which("ray", path=str(VENV_BIN)) or shutil.which("ray")

pytestmark = pytest.mark.skipif(RAY is None, reason="the `ray` CLI is not installed (pip install 'ray[default]')")

HEAD_START_TIMEOUT_S = 120
JOB_TIMEOUT_S = 180
CLI_TIMEOUT_S = 90
ANSI = re.compile(r"\x1b\[[0-9;]*m")


# ---------------------------------------------------------------- helpers


def _free_ports(n: int) -> list[int]:
    """n distinct ports free on every interface (Ray binds some of them on 0.0.0.0)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _env(home: Path, **extra: str) -> dict[str, str]:
    """The caller's environment minus every RAY_* variable (after `ray.init()` in this pytest
    process, os.environ holds RAY_AUTH_MODE=token), with a private HOME and this venv first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(home)
    env["PATH"] = str(VENV_BIN) + os.pathsep + env.get("PATH", "")
    env.update(extra)
    return env


def _ray_cli(args: list[str], env: dict[str, str], cwd: Path = ROOT, timeout: float = CLI_TIMEOUT_S):
    """Run `ray ...`; returns (returncode, stdout+stderr without colour codes)."""
    proc = subprocess.run([RAY, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, ANSI.sub("", proc.stdout + proc.stderr)


def _ps() -> list[tuple[int, int, int, str]]:
    """(pid, ppid, pgid, args) of every process, zombies left out."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,pgid=,stat=,args="], capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split(None, 4)
        if len(parts) >= 4 and not parts[3].startswith("Z"):
            rows.append((int(parts[0]), int(parts[1]), int(parts[2]), parts[4] if len(parts) > 4 else ""))
    return rows


def _head_pids(root_pid: int, temp_dir: Path) -> set[int]:
    """Everything our head started: descendants of `ray start --block`, members of its process
    group (it is a session leader), and anything naming our private temp dir on its command line."""
    rows = _ps()
    children: dict[int, list[int]] = {}
    for pid, ppid, _, _ in rows:
        children.setdefault(ppid, []).append(pid)
    found = {pid for pid, _, pgid, args in rows if pgid == root_pid or str(temp_dir) in args}
    alive = {pid for pid, *_ in rows}
    stack = [root_pid]
    while stack:
        pid = stack.pop()
        if pid in alive:
            found.add(pid)
        stack.extend(children.get(pid, []))
    found.discard(os.getpid())
    return found


def _signal_all(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_gone(root_pid: int, temp_dir: Path, known: set[int], timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while True:
        alive_now = {pid for pid, *_ in _ps()}
        left = (known & alive_now) | _head_pids(root_pid, temp_dir)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.5)


def _stop_head(head: subprocess.Popen, temp_dir: Path) -> set[int]:
    """SIGTERM `ray start --block` (it tears its node down), then SIGKILL whatever is left.
    Returns the pids still alive at the end (empty when all went)."""
    known = _head_pids(head.pid, temp_dir)  # workers are in their own process groups: snapshot them now
    if head.poll() is None:
        head.send_signal(signal.SIGTERM)
    left = _wait_gone(head.pid, temp_dir, known, timeout=20)
    if left:
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        _signal_all(left, signal.SIGKILL)
        left = _wait_gone(head.pid, temp_dir, known, timeout=15)
    try:
        head.wait(timeout=10)
    except subprocess.TimeoutExpired:
        head.kill()
        head.wait(timeout=10)
    return left


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return ANSI.sub("", path.read_text(errors="replace"))[-n:]
    except OSError as e:
        return f"<{path}: {e}>"


def _start_head(home: Path, temp_dir: Path, log_path: Path):
    """`ray start --head --block` in its own session; returns (Popen, dashboard_port, gcs_port)."""
    gcs, dash, client, agent_http, agent_grpc, runtime_env, metrics, node_mgr, obj_mgr = _free_ports(9)
    cmd = [
        RAY, "start", "--head", "--block",
        "--node-ip-address=127.0.0.1", f"--port={gcs}",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
        "--num-cpus=8", "--object-store-memory=268435456", f"--temp-dir={temp_dir}",
        # Every port explicit: the defaults (10001, 52365, worker ports 10002-19999, ...) may be
        # taken by another Ray on this machine.
        f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={runtime_env}",
        f"--metrics-export-port={metrics}", f"--node-manager-port={node_mgr}",
        f"--object-manager-port={obj_mgr}", "--min-worker-port=0", "--max-worker-port=0",
        "--disable-usage-stats",
    ]
    # Token auth explicitly on (never "disabled"); no node drain on SIGTERM, this is a throwaway head.
    # RAY_JOB_STOP_WAIT_TIME_S: how long `ray job stop` waits after its SIGTERM before a SIGKILL (Ray's default is
    # 3 s); as docs/failures.md says, give it the run's run.shutdown_grace_s (20 s) and a margin.
    env = _env(home, RAY_AUTH_MODE="token", RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0", RAY_JOB_STOP_WAIT_TIME_S="30")
    with open(log_path, "wb") as log:
        head = subprocess.Popen(cmd, env=env, cwd=temp_dir, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return head, dash, gcs


def _wait_head_ready(head: subprocess.Popen, dash: int, log_path: Path) -> str:
    """Until the CLI reports the runtime up and the dashboard answers HTTP; returns /api/version's reply."""
    deadline = time.monotonic() + HEAD_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise RuntimeError(f"`ray start` exited with {head.returncode}:\n{_tail(log_path)}")
        if "Ray runtime started" in _tail(log_path, 10**6):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{dash}/api/version", timeout=5) as r:
                    return f"{r.status} {r.read().decode(errors='replace')}"
            except urllib.error.HTTPError as e:
                return f"{e.code} {e.read().decode(errors='replace')}"
            except OSError:
                pass
        time.sleep(0.5)
    raise RuntimeError(f"Ray head not up after {HEAD_START_TIMEOUT_S} s:\n{_tail(log_path)}")


def _default_ray_address_file() -> Path:
    """Where a bare `ray.init()` looks for a cluster to join (normally /tmp/ray/ray_current_cluster)."""
    try:
        from ray._common.utils import get_ray_address_file
    except ImportError:  # private API; the path has been the same for years
        return Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    return Path(get_ray_address_file(None))


def _has_tensor(obj) -> bool:
    import torch

    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return False


def _job_status(address: str, job_id: str, token: str) -> tuple[str | None, str]:
    """The job's status from the dashboard's REST API (GET /api/jobs/<id>, the token as a Bearer header): what
    `ray job status` asks for, without starting a CLI process (1.6 s of CPU each) every poll."""
    req = urllib.request.Request(f"{address}/api/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            reply = json.loads(r.read().decode(errors="replace"))
    except (OSError, ValueError) as e:
        return None, f"{type(e).__name__}: {e}"
    return reply.get("status"), json.dumps({k: reply.get(k) for k in ("status", "message", "driver_exit_code")})


def _wait_job(address: str, job_id: str, token: str, timeout: float) -> tuple[str | None, str]:
    """Polls until the job has ended (or the deadline); returns its last status and reply."""
    deadline = time.monotonic() + timeout
    status, reply = None, ""
    while time.monotonic() < deadline:
        status, reply = _job_status(address, job_id, token)
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            break
        time.sleep(1)
    return status, reply


# ---------------------------------------------------------------- the test


@pytest.mark.long  # an end-to-end run through another tool (`make test-long`; CI runs it)
def test_ray_job_submit_to_token_auth_head_trains_and_checkpoints(tmp_path):
    import torch

    t0 = time.monotonic()
    # Short root: Ray puts unix sockets under <temp-dir>/session_<timestamp>/sockets/ (108-byte limit).
    base = Path(tempfile.mkdtemp(prefix="rjs", dir="/tmp" if os.path.isdir("/tmp") else None))
    home, temp_dir = base / "home", base / "r"
    home.mkdir()
    temp_dir.mkdir()
    head_log = base / "head.log"

    # A token in the private HOME's ~/.ray/auth_token, made by the documented command.
    rc, out = _ray_cli(["get-auth-token", "--generate"], _env(home))
    token_file = home / ".ray" / "auth_token"
    assert rc == 0 and token_file.is_file(), "ray get-auth-token --generate failed:\n" + out.replace(
        token_file.read_text().strip() if token_file.is_file() else "\0", "<token>")
    token = token_file.read_text().strip()

    head = None
    leftovers: set[int] = set()
    try:
        for attempt in range(2):  # a port picked above can be grabbed by someone else before Ray binds it
            head, dash, gcs = _start_head(home, temp_dir, head_log)
            try:
                version_reply = _wait_head_ready(head, dash, head_log)
                break
            except RuntimeError:
                leftovers |= _stop_head(head, temp_dir)
                if attempt == 1:
                    raise
        t_head = time.monotonic() - t0
        address = f"http://127.0.0.1:{dash}"
        authed = _env(home, RAY_AUTH_MODE="token")
        unauthed = _env(home)  # same token file in ~/.ray, but no RAY_AUTH_MODE and no RAY_AUTH_TOKEN*

        # The dashboard itself demands the token.
        assert version_reply.startswith("401"), version_reply
        # Our head wrote its address into its own temp dir, not where a bare ray.init() looks.
        assert (temp_dir / "ray_current_cluster").is_file()
        default_addr_file = _default_ray_address_file()
        if default_addr_file.is_file():
            assert f":{gcs}" not in default_addr_file.read_text()

        # 1. Without RAY_AUTH_MODE=token the CLI sends no token and the submission is refused.
        marker = f"unauthenticated-{uuid.uuid4().hex[:8]}"
        rc, out = _ray_cli(["job", "submit", "--address", address, "--no-wait", "--", "echo", marker], unauthed)
        assert rc != 0, out
        assert "AuthenticationError" in out and "Unauthorized: Missing authentication token" in out, out[-3000:]
        # A wrong token is refused too (403), even with RAY_AUTH_MODE=token.
        rc, out = _ray_cli(["job", "submit", "--address", address, "--no-wait", "--", "echo", marker],
                           {**authed, "RAY_AUTH_TOKEN": "0" * 32})
        assert rc != 0 and "Forbidden: Invalid authentication token" in out, out[-3000:]

        # 2. The real submission, exactly as documented (cwd = repo root). It is also the run that `ray job stop`
        # ends below (step 5), so it has no step target: one repository job on the head instead of two in a row.
        stop_run = tmp_path / "stopped_run"
        submit = ["job", "submit", "--address", address, "--working-dir", str(ROOT), "--no-wait", "--",
                  "python", "-m", "cluster.train", "--config", "configs/cartpole.yaml",
                  "--set", "run.total_env_steps=50000000", "--set", "run.target_return=null",
                  "--set", "run.require_target=false", "--run-dir", str(stop_run)]
        rc, out = _ray_cli(submit, authed, cwd=ROOT)
        assert rc == 0, out[-3000:]
        m = re.search(r"Job '([^']+)' submitted successfully", out)
        assert m, out[-3000:]
        job_id = m.group(1)

        # 3. A user's own project (an env module and a config, outside this repository) as the working dir: the
        # env's kwargs and wrappers reach the actors on the cluster. It runs beside the first job (the head has
        # room for both) and is the one that ends by itself: SUCCEEDED, with its final checkpoint.
        project = make_user_project(tmp_path)
        user_run = tmp_path / "user_run"
        rc, out = _ray_cli(["job", "submit", "--address", address, "--working-dir", str(project), "--no-wait", "--",
                            "python", "-m", "cluster.train", "--config", "user.yaml", "--run-dir", str(user_run)],
                           authed, cwd=project)
        assert rc == 0, out[-3000:]
        user_job = re.search(r"Job '([^']+)' submitted successfully", out).group(1)

        # 4. What the repository's job writes while it runs.
        # (Read as soon as it has trained past its first record, then stopped: it trains seconds, not as long as the
        # user's job takes. Only whole lines: the job is writing the file.)
        deadline = time.monotonic() + JOB_TIMEOUT_S
        metrics = stop_run / "metrics.jsonl"
        records = []
        while time.monotonic() < deadline and not (
                len(records) >= 2 and records[-1]["env_steps"] > records[0]["env_steps"]):
            time.sleep(0.5)
            records = records_so_far(stop_run)
        assert metrics.is_file(), "the repository's job never trained"
        assert len(records) >= 2, records
        for r in records:
            assert {"env_steps", "host_bound_fraction", "episode_return_mean"} <= r.keys(), sorted(r)
            assert 0.0 <= r["host_bound_fraction"] <= 1.0
        assert records[-1]["env_steps"] > records[0]["env_steps"] > 0
        assert (stop_run / "config.yaml").is_file()

        # The upload honoured .gitignore: the job runs from a copy without .venv/ or runs/.
        pkgs = {p.resolve() for p in temp_dir.glob("session_*/runtime_resources/working_dir_files/_ray_pkg_*")
                if p.is_dir()}
        # (The user's project is the other package there.)
        ours = [pkg for pkg in pkgs if (pkg / "cluster" / "train.py").is_file()]
        assert ours, f"no working_dir package of this repository on the head: {sorted(map(str, pkgs))}"
        for pkg in ours:
            assert not (pkg / ".venv").exists() and not (pkg / "runs").exists(), sorted(p.name for p in pkg.iterdir())

        # 5. `ray job stop` sends SIGTERM: the run stops as on Ctrl-C, with its final checkpoint.
        rc, out = _ray_cli(["job", "stop", "--address", address, job_id], authed)
        assert rc == 0, out[-3000:]
        status, status_out = _wait_job(address, job_id, token, 60)
        _, logs = _ray_cli(["job", "logs", "--address", address, job_id], authed)
        assert status == "STOPPED", f"stopped job ended {status!r}\n{logs[-4000:]}"
        assert "SIGTERM: stopping" in logs and "done: interrupted" in logs, logs[-4000:]
        stopped = torch.load(stop_run / "checkpoints" / "final.pt", map_location="cpu", weights_only=True)
        assert stopped["stop_reason"] == "interrupted" and _has_tensor(stopped)

        # The user's job, meanwhile, ends by itself.
        status, status_out = _wait_job(address, user_job, token, JOB_TIMEOUT_S)
        t_job = time.monotonic() - t0
        rc_logs, logs = _ray_cli(["job", "logs", "--address", address, user_job], authed)
        assert status == "SUCCEEDED", (
            f"user-project job {user_job} ended {status!r} after {time.monotonic() - t0:.0f} s\n--- status:\n"
            f"{status_out[-1500:]}\n--- job logs:\n{logs[-6000:]}\n--- head log:\n{_tail(head_log, 2000)}")
        assert rc_logs == 0 and "done: total_env_steps" in logs, logs[-3000:]
        check_user_run(user_run)
        assert (user_run / "config.yaml").is_file()
        ckpt = torch.load(user_run / "checkpoints" / "final.pt", map_location="cpu", weights_only=True)
        # Schema-agnostic on purpose (the checkpoint layout is the driver's business): a dict holding weights.
        assert isinstance(ckpt, dict) and _has_tensor(ckpt), type(ckpt)
        assert not default_addr_file.is_file() or f":{gcs}" not in default_addr_file.read_text()

        # The refused submissions never reached the job table.
        rc, listing = _ray_cli(["job", "list", "--address", address], authed)
        assert rc == 0 and job_id in listing and marker not in listing, listing[-3000:]
    finally:
        t_stop = time.monotonic()
        if head is not None:
            leftovers |= _stop_head(head, temp_dir)
        t_stop = time.monotonic() - t_stop
        shutil.rmtree(base, ignore_errors=True)
    # 6. Every process of our head is gone (checked after the finally so a failure above is not masked).
    assert not leftovers, f"head processes still alive after SIGKILL: {sorted(leftovers)}"
    print(f"job submit test: head up {t_head:.1f} s, user job SUCCEEDED at {t_job:.1f} s, "
          f"head stopped in {t_stop:.1f} s, total {time.monotonic() - t0:.1f} s")
