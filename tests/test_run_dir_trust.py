"""A run directory reaches nothing the user did not name, and the embedded Ray listens on loopback only.

Real processes, real sockets: a run directory (made by a real in-process run) whose config.yaml names a Ray address
where this test listens; ``--resume`` of it must not connect there unless the user trusts the directory or names
the address themselves. The listener is on 127.0.0.2, a loopback address Ray takes as written (127.0.0.1 it
rewrites to this machine's routable address before connecting), so a connection, had there been one, arrives here.
The loopback test starts the real embedded Ray (``placement.start_ray``) and reads the listening sockets of every
process it started.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# One xdist_group (`make test` runs --dist loadgroup): made_run (a module fixture: a real run, ~6 s) made once,
# on one worker.
pytestmark = pytest.mark.xdist_group("run_dir_trust")

ROOT = Path(__file__).resolve().parents[1]
#: The refusal comes before Ray or anything else starts: an interpreter start and a config load, about 2 s here.
REFUSAL_S = 20.0


def clean_env() -> dict:
    """The user's environment without a RAY_ADDRESS or RAY_AUTH_MODE of their own."""
    return {**{k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")},
            "PYTHONPATH": str(ROOT)}


def train(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.train", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=clean_env())


def connected(listener: socket.socket, wait_s: float) -> bool:
    """Whether a connection reached ``listener`` (one made and closed again still waits in its queue)."""
    ready, _, _ = select.select([listener], [], [], wait_s)
    if not ready:
        return False
    listener.accept()[0].close()
    return True


def listening_sockets(pids) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket the processes ``pids`` hold, from /proc (Linux): each
    process's socket inodes (/proc/PID/fd), looked up in /proc/net/tcp and tcp6 (state 0A: LISTEN)."""
    import ipaddress

    listen = {}
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                if fields[3] != "0A":
                    continue
                hex_ip, hex_port = fields[1].split(":")
                # Each 32-bit word is in host (little-endian) order.
                raw = b"".join(bytes.fromhex(hex_ip[i:i + 8])[::-1] for i in range(0, len(hex_ip), 8))
                ip = ipaddress.ip_address(raw[:width])
                mapped = getattr(ip, "ipv4_mapped", None)
                listen[fields[9]] = (str(mapped or ip), int(hex_port, 16))
    found = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed meanwhile (the listing's own descriptor, for one)
                continue
            inode = link[len("socket:["):-1] if link.startswith("socket:[") else None
            if inode in listen:
                found.append((pid, *listen[inode]))
    return found


@pytest.fixture
def listener():
    s = socket.socket()
    s.bind(("127.0.0.2", 0))
    s.listen(8)
    yield s
    s.close()


@pytest.fixture(scope="module")
def made_run(tmp_path_factory) -> Path:
    """A run directory a real (in-process, ~3 s) run wrote: config.yaml, run.json, checkpoints/final.pt."""
    run = tmp_path_factory.mktemp("made") / "run"
    proc = train("--config", "configs/cartpole.yaml", "--address", "inprocess", "--run-dir", str(run),
                 "--set", "run.total_env_steps=2048", "--set", "run.target_return=null",
                 "--set", "run.require_target=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.fixture
def run_naming(made_run, tmp_path, listener) -> Path:
    """A copy of the made run whose config.yaml names the listener as ray.address (what a shared directory could)."""
    import shutil

    import yaml

    run = tmp_path / "shared-run"
    shutil.copytree(made_run, run)
    data = yaml.safe_load((run / "config.yaml").read_text())
    data["ray"]["address"] = "%s:%d" % listener.getsockname()
    (run / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return run


def test_resume_refuses_a_stored_ray_address_before_connecting(run_naming, listener):
    address = "%s:%d" % listener.getsockname()
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "cluster.train", "--resume", str(run_naming)], cwd=ROOT,
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=REFUSAL_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        pytest.fail(f"--resume still ran after {REFUSAL_S:g} s; a connection to {address} arrived: "
                    f"{connected(listener, 0)}")
    took = time.monotonic() - t0
    lines = stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, f"rc={proc.returncode}\n{stderr[-3000:]}"
    assert stdout == ""
    assert lines[0].startswith(f"config error: {run_naming / 'config.yaml'}: the config stored in this run directory "
                               f"names ray.address '{address}'"), lines[0]
    assert lines[0].endswith(f"allowed: --trust-code if you trust {run_naming}, your own config (--config), "
                             f"--address (for the ray keys), or the key set with --set"), lines[0]
    assert took < REFUSAL_S, took
    assert not connected(listener, 0.5), "the refused run connected to the address its stored config names"
    # The user's own word for the address, on the command line, is taken: it replaces the stored one.
    proc = train("--resume", str(run_naming), "--set", "ray.address=inprocess", "--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not connected(listener, 0.1)


def test_resume_with_trust_code_joins_the_stored_address(run_naming, listener):
    """--trust-code: the user trusts the directory, so the run tries the address it names (and this listener, no
    Ray, sees the connection; the run is stopped then)."""
    proc = subprocess.Popen([sys.executable, "-m", "cluster.train", "--resume", str(run_naming), "--trust-code"],
                            cwd=ROOT, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert connected(listener, 90), "the trusted run did not try the address its config names"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)


@pytest.mark.long  # a second training run: make test-long
def test_resume_with_the_users_own_address_goes_on(run_naming, listener):
    """--address inprocess is the user's word: the stored ray.address is not used, and the run trains on."""
    steps = json.loads((run_naming / "metrics.jsonl").read_text().splitlines()[-1])["env_steps"]
    proc = train("--resume", str(run_naming), "--address", "inprocess", "--set",
                 f"run.total_env_steps={steps + 2048}", timeout=180)
    assert proc.returncode == 0 and "resuming from" in proc.stderr, proc.stderr[-3000:]
    records = (run_naming / "metrics.jsonl").read_text().splitlines()
    assert json.loads(records[-1])["env_steps"] >= steps + 2048
    assert not connected(listener, 0.1)


@pytest.mark.parametrize("stored, sets, refused", [
    pytest.param({"ray.listen_address": "0.0.0.0"}, [], "names ray.listen_address '0.0.0.0' (the embedded Ray's ports "
                 "open to other hosts)", id="listen-0.0.0.0"),
    pytest.param({"ray.address": "auto"}, [], "names ray.address 'auto' (a Ray cluster this run would join",
                 id="address-auto"),
    # What the user sets on the command line is theirs, also when it opens or joins something.
    pytest.param({"ray.listen_address": "192.0.2.9"}, ["ray.listen_address=0.0.0.0"], None, id="listen-set-by-user"),
    pytest.param({"ray.address": "10.1.2.3:6379"}, ["ray.address=auto"], None, id="address-set-by-user"),
    pytest.param({"ray.address": "auto", "ray.listen_address": "0.0.0.0"}, ["ray.listen_address=0.0.0.0"],
                 "names ray.address 'auto' (", id="one-of-two-set-by-user"),
    pytest.param({"ray.address": "inprocess"}, [], None, id="address-inprocess"),  # reaches nothing
    # The sinks that send the run to a server: the user's --set run.loggers is their word; --address is not.
    pytest.param({"run.loggers": ["jsonl", "wandb"]}, [], "names run.loggers 'wandb' (this run's metrics and config "
                 "sent to the W&B server of this environment)", id="loggers-wandb"),
    pytest.param({"run.loggers": ["jsonl", "mlflow"]}, ["ray.address=inprocess"], "names run.loggers 'mlflow' (",
                 id="loggers-mlflow-with-an-address"),
    pytest.param({"run.loggers": ["jsonl", "wandb"]}, ["run.loggers=[jsonl]"], None, id="loggers-set-by-user"),
])
def test_stored_network_settings_are_refused_at_dry_run_unless_the_user_set_them(made_run, tmp_path, stored, sets,
                                                                                  refused):
    import shutil

    import yaml

    run = tmp_path / "run"
    shutil.copytree(made_run, run)
    data = yaml.safe_load((run / "config.yaml").read_text())
    for key, value in stored.items():
        section, name = key.split(".")
        data[section][name] = value
    (run / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    proc = train("--resume", str(run), "--dry-run", *[arg for s in sets for arg in ("--set", s)])
    if refused is None:
        assert proc.returncode == 0, proc.stderr[-3000:]
        return
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and proc.stdout == "", proc.stderr[-3000:]
    assert lines[0].startswith(f"config error: {run / 'config.yaml'}: the config stored in this run directory "
                               f"{refused}"), lines[0]
    assert not any(s.split("=")[0] in lines[0] for s in sets), lines[0]  # what the user set is not named


@pytest.mark.parametrize("value, expected", [
    ("127.0.0.2", "ray.listen_address: '127.0.0.2' is a loopback address other than 127.0.0.1"),
    ("localhost", "ray.listen_address: 'localhost' is not an IPv4 address"),
    ("224.0.0.1", "ray.listen_address: '224.0.0.1' is not one host's address"),
])
def test_a_bad_listen_address_is_one_config_error_line(value, expected):
    proc = train("--dry-run", "--set", f"ray.listen_address={value}")
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and proc.stdout == "", proc.stderr[-3000:]
    assert lines[0].startswith(f"config error: {expected}") and "allowed: 127.0.0.1 (loopback only)" in lines[0]


@pytest.mark.long  # a whole embedded Ray and a second process joining it: ~10 s on 2 cores
def test_the_embedded_ray_listens_on_loopback_only_and_a_second_process_joins_it():
    """Every listening TCP socket of the embedded Ray's processes (GCS, raylet, agents, a worker that ran a task,
    the driver) is on 127.0.0.1; a second process on this machine joins it at its address, as
    ``cluster.control`` does."""
    code = textwrap.dedent("""
        import json, os, subprocess, sys
        import ray
        from cluster import config as C, placement
        from tests.test_run_dir_trust import listening_sockets
        placement.start_ray(C.load(None, ["ray.num_cpus=1"]), None)
        gcs = ray.get_runtime_context().gcs_address
        ray.get(ray.remote(lambda: 0).remote())  # a worker, with its own port
        node = ray._private.worker._global_node
        pids = [info.process.pid for infos in node.all_processes.values() for info in infos]
        pids += placement._descendants(pids) + [os.getpid()]
        listening = [[pid, ip, port] for pid, ip, port in listening_sockets(pids)]
        join = ("import ray; from cluster import placement; "
                "placement.join(sys.argv[1], log_to_driver=False); print(len(ray.nodes()))")
        child = subprocess.run([sys.executable, "-c", "import sys; " + join, gcs], capture_output=True, text=True,
                               timeout=60)
        placement.stop_ray()
        print(json.dumps({"gcs": gcs, "listening": listening, "join_rc": child.returncode,
                          "join_out": child.stdout.strip(), "join_err": child.stderr[-2000:]}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    gcs_port = int(out["gcs"].rsplit(":", 1)[1])
    assert gcs_port in [port for _, _, port in out["listening"]], out["listening"]
    assert len(out["listening"]) >= 5, out["listening"]  # GCS, raylet (2), driver, worker, agents
    loopback = ("127.0.0.1",)  # an IPv6 socket's IPv4-mapped ::ffff:127.0.0.1 is read as 127.0.0.1
    opened = [entry for entry in out["listening"] if entry[1] not in loopback]
    assert opened == [], f"listening beyond loopback: {opened}"
    assert out["gcs"].startswith("127.0.0.1:"), out["gcs"]
    assert out["join_rc"] == 0 and out["join_out"] == "1", out["join_err"]
