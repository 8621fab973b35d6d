"""``python -m cluster.doctor``: each check on hand-written values, then the command itself."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import doctor

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- version parsing


@pytest.mark.parametrize("version, expected", [
    ("2.5.1", (2, 5, 1)),
    ("2.5.1+cpu", (2, 5, 1)),
    ("2.5.1+cu121", (2, 5, 1)),
    ("2.5.1.post2", (2, 5, 1)),
    ("2.6.0rc1", (2, 6, 0)),
    ("2.5", (2, 5, 0)),
    ("1.11.0.post4", (1, 11, 0)),
    ("garbage", None),
    ("", None),
    (None, None),
])
def test_release(version, expected):
    assert doctor.release(version) == expected


@pytest.mark.parametrize("version, cuda, expected", [
    ("2.5.1+cpu", None, False),
    ("2.5.1", None, False),
    ("2.5.1+cu121", None, True),
    ("2.5.1", "12.1", True),
    (None, None, False),
])
def test_is_cuda_build(version, cuda, expected):
    assert doctor.is_cuda_build(version, cuda) is expected


# --------------------------------------------------------------------------- 1. torch / torch_npu pair


@pytest.mark.parametrize("torch_v, npu_v", [
    ("2.5.1", "2.5.1"),
    ("2.5.1", "2.5.1.post1"),
    ("2.5.1+cpu", "2.5.1.post2"),
    ("2.1.0", "2.1.0.post10"),
    ("2.13.0+cpu", None),  # no torch_npu: nothing to pair
    (None, None),
])
def test_torch_npu_pair_ok(torch_v, npu_v):
    assert doctor.check_torch_npu_pair(torch_v, npu_v) == []


@pytest.mark.parametrize("torch_v, npu_v", [
    ("2.4.0", "2.5.1"),
    ("2.5.0+cpu", "2.5.1.post1"),
    ("2.6.0", "2.5.1"),
    ("3.5.1", "2.5.1"),
])
def test_torch_npu_pair_mismatch_is_error(torch_v, npu_v):
    findings = doctor.check_torch_npu_pair(torch_v, npu_v)
    assert len(findings) == 1
    assert findings[0].startswith("ERROR")
    assert npu_v in findings[0] and torch_v in findings[0]
    assert doctor.exit_code(findings) == 1


def test_torch_npu_without_torch_is_error():
    [finding] = doctor.check_torch_npu_pair(None, "2.5.1")
    assert finding.startswith("ERROR")


def test_torch_npu_pair_unparseable_is_warning_not_error():
    [finding] = doctor.check_torch_npu_pair("2.5.1", "nightly")
    assert finding.startswith("WARNING") and "nightly" in finding


# --------------------------------------------------------------------------- 2. CUDA build of torch


@pytest.mark.parametrize("torch_v, cuda", [("2.5.1+cu121", None), ("2.5.1", "12.4"), ("2.5.1+cu118", "11.8")])
def test_torch_npu_beside_cuda_torch_is_error(torch_v, cuda):
    [finding] = doctor.check_cuda_build(torch_v, cuda, "2.5.1")
    assert finding.startswith("ERROR") and "CUDA" in finding


@pytest.mark.parametrize("torch_v, cuda, npu_v", [
    ("2.5.1+cpu", None, "2.5.1"),
    ("2.5.1", None, "2.5.1.post1"),
    ("2.5.1+cu121", "12.1", None),  # a CUDA build alone is fine
])
def test_cuda_build_check_ok(torch_v, cuda, npu_v):
    assert doctor.check_cuda_build(torch_v, cuda, npu_v) == []


# --------------------------------------------------------------------------- 3. visible-device variables


@pytest.mark.parametrize("env", [
    {},
    {"ASCEND_RT_VISIBLE_DEVICES": "0"},
    {"ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3"},
    {"ASCEND_RT_VISIBLE_DEVICES": "1,5,7"},
    {"CUDA_VISIBLE_DEVICES": "0,2"},
    {"CUDA_VISIBLE_DEVICES": "GPU-8a1b2c3d-0000-1111-2222-333344445555"},
    {"CUDA_VISIBLE_DEVICES": "MIG-GPU-abc/1/0"},
    {"OTHER": "3,1"},
])
def test_visible_devices_ok(env):
    assert doctor.check_visible_devices(env) == []


def test_cuda_visible_devices_may_come_in_any_order_but_ascend_ones_may_not():
    assert doctor.check_visible_devices({"CUDA_VISIBLE_DEVICES": "3,1"}) == []
    [finding] = doctor.check_visible_devices({"ASCEND_RT_VISIBLE_DEVICES": "3,1"})
    assert "ascending" in finding


@pytest.mark.parametrize("var", ["ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"])
@pytest.mark.parametrize("value", ["0,0", "a", "0,,1", "-1", "0, 1", "1,2,2", ""])
def test_visible_devices_bad(var, value):
    [finding] = doctor.check_visible_devices({var: value})
    assert finding.startswith("WARNING")
    assert var in finding and repr(value) in finding
    assert doctor.exit_code([finding]) == 0  # a warning never fails the command


def test_visible_devices_both_bad_gives_two_findings():
    findings = doctor.check_visible_devices({"ASCEND_RT_VISIBLE_DEVICES": "2,1", "CUDA_VISIBLE_DEVICES": "x"})
    assert len(findings) == 2
    assert "ASCEND_RT_VISIBLE_DEVICES" in findings[0] and "CUDA_VISIBLE_DEVICES" in findings[1]


def test_hccl_timeouts_are_checked_against_the_chip_familys_range():
    """CANN's ranges differ by family: 20000 s is valid on a 910B (A2) and out of range on a 910 (A1); 600 applies
    as 544 on A1 (a multiple of 68); 0 is "never" on A2 and out of range on A1; AIV expansion caps at 1091 s."""
    env = {"HCCL_EXEC_TIMEOUT": "20000", "HCCL_CONNECT_TIMEOUT": "60"}
    a2 = doctor.check_hccl_timeouts(env, "A2")
    assert len(a2) == 1 and "[120, 7200]" in a2[0]  # only the connect timeout: 20000 s is fine on A2
    a1 = doctor.check_hccl_timeouts(env, "A1")
    assert len(a1) == 2 and "outside (0, 17340]" in a1[1]
    assert "applies as 544" in doctor.check_hccl_timeouts({"HCCL_EXEC_TIMEOUT": "600"}, "A1")[0]
    assert "never times out" in doctor.check_hccl_timeouts({"HCCL_EXEC_TIMEOUT": "0"}, "A2")[0]
    assert "1091" in doctor.check_hccl_timeouts({"HCCL_EXEC_TIMEOUT": "1800", "HCCL_OP_EXPANSION_MODE": "AIV"},
                                                "A2")[0]
    assert doctor.check_hccl_timeouts({"HCCL_EXEC_TIMEOUT": "1836", "HCCL_CONNECT_TIMEOUT": "120"}, "A2") == []
    assert doctor.check_hccl_timeouts({"HCCL_EXEC_TIMEOUT": "1836"}, "A1") == []  # 27 x 68


# npu-smi info as an Atlas 800T A2 host prints it (two NPUs shown; the second unhealthy for the test).
NPU_SMI_INFO = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 24.1.rc1                 Version: 24.1.rc1                                             |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 93.6        40                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3161 / 65536         |
+===========================+===============+====================================================+
| 1     910B3               | Alarm         | 92.0        39                0    / 0             |
| 0                         | 0000:C2:00.0  | 0           0    / 0          3318 / 65536         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| No running processes found in NPU 0                                                            |
+===========================+===============+====================================================+
"""


def test_npu_smi_health_per_device_with_the_command_that_says_why():
    assert doctor.parse_npu_smi_health(NPU_SMI_INFO) == {0: "OK", 1: "Alarm"}
    [finding] = doctor.check_npu_health(doctor.parse_npu_smi_health(NPU_SMI_INFO))
    assert finding.startswith("ERROR: NPU 1") and "npu-smi info -t health -i 1" in finding


def test_hccn_link_and_ip_per_device():
    assert doctor.parse_hccn("link status: UP\n", "ipaddr:192.168.1.8\nnetmask:255.255.255.0\n") == (
        "UP", "192.168.1.8")
    down = doctor.parse_hccn("link status: DOWN", "")
    findings = doctor.check_hccn({0: ("UP", "192.168.1.8"), 3: down}, multi_host=True)
    assert len(findings) == 2 and all(f.startswith("ERROR: NPU 3") for f in findings)
    assert "hccn_tool -i 3 -ip -s" in findings[1]
    assert all(f.startswith("WARNING") for f in doctor.check_hccn({3: down}, multi_host=False))


def test_davinci_device_files_must_be_read_write_for_this_user():
    modes = {"/dev/davinci0": (0o20660, 1000, 1001), "/dev/davinci1": (0o20600, 0, 0)}
    [finding] = doctor.check_davinci_access(modes, uid=1500, gids={1001})
    assert finding.startswith("ERROR: /dev/davinci1") and "usermod -aG" in finding
    assert doctor.check_davinci_access(modes, uid=0, gids=set()) == []


def test_visible_devices_against_the_npus_present_and_rays_noset_variable():
    [finding] = doctor.check_visible_against_devices({"ASCEND_RT_VISIBLE_DEVICES": "0,1,8"}, [0, 1, 2, 3])
    assert "[8]" in finding and "/dev/davinci" in finding
    env = {"ASCEND_RT_VISIBLE_DEVICES": "0,1", "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1"}
    [finding] = doctor.check_visible_against_devices(env, [0, 1, 2, 3])
    assert "Ray counts 4" in finding
    assert doctor.check_visible_against_devices({"ASCEND_RT_VISIBLE_DEVICES": "0,1"}, [0, 1, 2, 3]) == []


def test_driver_and_cann_on_a_host_with_npus():
    assert doctor.parse_driver_version("Version=24.1.rc2\nascendhal_version=7.35.23\n") == "24.1.rc2"
    findings = doctor.check_ascend_stack(None, None, "2.5.1", davinci=True)
    assert len(findings) == 2 and "driver" in findings[0] and "CANN" in findings[1]
    assert doctor.check_ascend_stack("24.1.rc2", "8.0.RC3", "2.5.1", davinci=True) == []
    assert doctor.check_ascend_stack(None, None, None, davinci=False) == []


def test_ray_and_torch_npu_counts_must_agree():
    [finding] = doctor.check_ray_npu_count(8, 4)
    assert "Ray counts 8" in finding and "sees 4" in finding
    assert doctor.check_ray_npu_count(4, 4) == [] and doctor.check_ray_npu_count(None, 4) == []


# --------------------------------------------------------------------------- 4. backend autoload without CANN


def test_autoload_warning_when_torch_npu_without_cann():
    [finding] = doctor.check_autoload("2.5.1", None, {})
    assert finding.startswith("WARNING") and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in finding


@pytest.mark.parametrize("npu_v, cann, env", [
    (None, None, {}),                                         # no torch_npu
    ("2.5.1", "8.0.RC3", {}),                                 # CANN present
    ("2.5.1", None, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}),  # already switched off
])
def test_autoload_ok(npu_v, cann, env):
    assert doctor.check_autoload(npu_v, cann, env) == []


def test_autoload_other_values_still_warn():
    assert doctor.check_autoload("2.5.1", None, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "1"})


def test_torch_npu_import_failure_is_warning():
    [finding] = doctor.check_torch_npu_import("2.5.1", False, "ImportError: libhccl.so")
    assert finding.startswith("WARNING") and "libhccl.so" in finding
    assert doctor.check_torch_npu_import("2.5.1", True, None) == []
    assert doctor.check_torch_npu_import(None, None, None) == []


def test_exit_code():
    assert doctor.exit_code([]) == 0
    assert doctor.exit_code(["WARNING: x"]) == 0
    assert doctor.exit_code(["WARNING: x", "ERROR: y"]) == 1


# --------------------------------------------------------------------------- CANN version files


def test_parse_cann_install_info():
    text = "package_name=Ascend-cann-toolkit\nversion=8.0.RC3\ninnerversion=V100R001C19\narch=x86_64\n"
    assert doctor.parse_cann_version(text) == "8.0.RC3"


def test_parse_cann_version_cfg():
    text = ("# version: 1.0\nruntime_running_version=[7.5.0.1.129:8.0.RC3]\n"
            "toolkit_running_version=[7.6.0.1.220:8.0.0]\n")
    assert doctor.parse_cann_version(text) == "8.0.0"
    assert doctor.parse_cann_version("# nothing here\n") is None


def test_find_cann_prefers_env_root(tmp_path):
    env_root, default_root = tmp_path / "env", tmp_path / "default"
    (env_root / "aarch64-linux").mkdir(parents=True)
    (env_root / "aarch64-linux" / "ascend_toolkit_install.info").write_text("version=8.1.RC1\n")
    default_root.mkdir()
    (default_root / "version.cfg").write_text("toolkit_running_version=[7.5.0.1.129:8.0.RC3]\n")

    version, path = doctor.find_cann({"ASCEND_HOME_PATH": str(env_root)}, str(default_root), arch="aarch64")
    assert version == "8.1.RC1" and path.endswith("ascend_toolkit_install.info")
    # other arch directory still found by the glob
    assert doctor.find_cann({"ASCEND_HOME_PATH": str(env_root)}, str(default_root), arch="x86_64")[0] == "8.1.RC1"
    # no env: the default root's version.cfg
    assert doctor.find_cann({}, str(default_root), arch="aarch64") == ("8.0.RC3", str(default_root / "version.cfg"))
    # nothing anywhere
    assert doctor.find_cann({}, str(tmp_path / "missing")) == (None, None)


def test_run_checks_combines_every_check():
    facts = {"versions": {"torch": "2.4.0+cu121", "torch_cuda": "12.1", "torch_npu": "2.5.1",
                          "cann": None, "torch_npu_importable": False, "torch_npu_import_error": "boom"}}
    findings = doctor.run_checks(facts, {"ASCEND_RT_VISIBLE_DEVICES": "0,0"})
    assert [f.split(":")[0] for f in findings] == ["ERROR", "ERROR", "WARNING", "WARNING", "WARNING"]


# --------------------------------------------------------------------------- the command


def _run(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items()
           if k not in doctor.VISIBLE_DEVICE_VARS + doctor.CANN_ROOT_VARS + (doctor.AUTOLOAD_VAR,)}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "cluster.doctor", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_command_on_this_cpu_machine():
    proc = _run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert re.search(r"^\s*torch\s+2\.13\.0\b", out, re.M), out
    assert re.search(r"^\s*detected\s+cpu$", out, re.M), out
    assert re.search(r"^\s*backend\s+gloo$", out, re.M), out
    for name in ("python", "ray", "torch_npu", "CANN", "gymnasium", "numpy"):
        assert re.search(rf"^\s*{name}\s+\S", out, re.M), name

    proc = _run("--json")
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout)
    assert facts["versions"]["torch"].startswith("2.13.0")
    assert facts["versions"]["torch_cuda"] is None
    assert facts["devices"]["detected"] == "cpu" and facts["devices"]["backend"] == "gloo"
    assert facts["ok"] is True and facts["findings"] == []


def test_command_with_broken_torch_npu_exits_1(tmp_path):
    """A fake torch_npu 2.5.1 wheel that cannot load (no CANN) beside torch 2.13: ERROR, exit 1."""
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text("raise ImportError('libascendcl.so: cannot open')\n")
    dist = tmp_path / "torch_npu-2.5.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.5.1\n")
    empty_cann = tmp_path / "no-cann"
    empty_cann.mkdir()

    proc = _run("--json", env_extra={"PYTHONPATH": str(tmp_path), "ASCEND_HOME_PATH": str(empty_cann),
                                     "ASCEND_RT_VISIBLE_DEVICES": "1,0"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    facts = json.loads(proc.stdout)
    assert facts["versions"]["torch_npu"] == "2.5.1"
    assert facts["versions"]["torch_npu_importable"] is False
    assert facts["devices"]["detected"] in ("cpu", "cuda")  # the broken NPU stack is not picked
    text = "\n".join(facts["findings"])
    assert "ERROR: torch_npu 2.5.1 needs torch 2.5.1" in text
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in text
    assert "libascendcl.so" in text
    assert "ASCEND_RT_VISIBLE_DEVICES='1,0'" in text


def test_hccl_host_ports_valid_free_and_out_of_the_ephemeral_range():
    """HCCL's 32 host ports from HCCL_IF_BASE_PORT (60000): a base out of [1024, 65520] or not a number is an
    error, a listener in the range is an error, and a range inside the OS's ephemeral ports that is not reserved is
    a warning carrying the sysctl that reserves it. Read from this host's real /proc tables: a port this test
    listens on is seen as taken."""
    import socket

    from cluster.doctor import check_hccl_ports, parse_listening, parse_port_ranges

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    port = sock.getsockname()[1]
    try:
        listening = parse_listening(open("/proc/net/tcp").read())
    finally:
        sock.close()
    assert port in listening
    taken = check_hccl_ports({"HCCL_IF_BASE_PORT": str(port - 3)}, listening, set(), None, npu_host=True)
    assert len(taken) == 1 and taken[0].startswith(doctor.ERROR) and f"{port} listening" in taken[0], taken
    assert "HCCL_IF_BASE_PORT=<a free base>" in taken[0]
    for bad in ("70000", "80", "sixty"):
        found = check_hccl_ports({"HCCL_IF_BASE_PORT": bad}, set(), set(), None, npu_host=True)
        assert len(found) == 1 and "is not a port in [1024, 65520]" in found[0], (bad, found)
    # Linux's default ephemeral range, 32768-60999, holds HCCL's default ports: reserve them.
    warned = check_hccl_ports({}, set(), set(), (32768, 60999), npu_host=True)
    assert len(warned) == 1 and warned[0].startswith(doctor.WARNING), warned
    assert "sysctl -w net.ipv4.ip_local_reserved_ports=60000-60031" in warned[0]
    assert check_hccl_ports({}, set(), parse_port_ranges("60000-60031, 8080"), (32768, 60999), npu_host=True) == []
    assert check_hccl_ports({"HCCL_IF_BASE_PORT": "50000"}, set(), set(), (32768, 49999), npu_host=True) == []
    assert check_hccl_ports({"HCCL_IF_BASE_PORT": "1"}, listening, set(), (1, 65535), npu_host=False) == []
