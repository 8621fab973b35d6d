"""Environment report: ``python -m cluster.doctor [--json]``.

Prints the versions that matter (python, ray, torch, torch_npu, CANN, gymnasium, numpy), the
device the learners would use and its collective backend, and findings for known bad
combinations. Exit code 0, or 1 when any finding is an ERROR.

Each check is a pure function of plain values, so tests run it without the hardware. Nothing
heavy is imported at module level: with a torch_npu wheel installed, ``import torch`` autoloads
torch_npu and can itself fail, which is one of the things this command reports.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import platform
import re
import sys
from importlib import metadata
from typing import NamedTuple

EXIT_OK, EXIT_ERROR = 0, 1
ERROR, WARNING = "ERROR", "WARNING"

#: The Ascend install root: the driver, the firmware and the CANN toolkits lie below it. The checks that read files
#: take it as a parameter (tests stand a temporary directory in for it); this is where the installers put them.
ASCEND_ROOT = "/usr/local/Ascend"
DEFAULT_CANN_ROOT = "/usr/local/Ascend/ascend-toolkit/latest"
#: Where CANN lies below ASCEND_ROOT when no variable names it: ascend-toolkit/latest up to CANN 8.3, cann from CANN
#: 8.5.0 on (its set_env.sh moved to /usr/local/Ascend/cann/set_env.sh).
CANN_DIRS = ("ascend-toolkit/latest", "cann")
#: Searched in this order; ``set_env.sh`` of the CANN toolkit exports both.
CANN_ROOT_VARS = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
VISIBLE_DEVICE_VARS = ("ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
#: Set to 1, Ray leaves every device visible to an actor; learners then take the id Ray assigned them
#: (learner/device.py, local_index), so either setting works, and the report shows which is in force.
NOSET_VARS = ("RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES", "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES")
#: HCCL's network and timeout settings, each in the range CANN's environment reference gives (seconds); the
#: learners set both timeouts from run.stall_timeout_s when they are unset (learner/distributed.py).
HCCL_NET_VARS = ("HCCL_IF_IP", "HCCL_SOCKET_IFNAME")
HCCL_TIMEOUT_VARS = ("HCCL_EXEC_TIMEOUT", "HCCL_CONNECT_TIMEOUT")
#: Where the Ascend driver and the NPU firmware write their versions (``Version=24.1.rc2``, ``Version=7.1.0.6.220``)
#: below ASCEND_ROOT; torch_npu's get_cann_version("DRIVER") reads the driver's from the same file.
DRIVER_VERSION_PATH, FIRMWARE_VERSION_PATH = "driver/version.info", "firmware/version.info"
DRIVER_VERSION_FILE = f"{ASCEND_ROOT}/{DRIVER_VERSION_PATH}"
#: An NPU's character device; the runtime opens it read-write, with /dev/davinci_manager, /dev/devmm_svm, /dev/hisi_hdc.
DAVINCI_GLOB = "/dev/davinci[0-9]*"
DAVINCI_CONTROL = ("/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc")
AUTOLOAD_VAR = "TORCH_DEVICE_BACKEND_AUTOLOAD"


# --------------------------------------------------------------------------- versions
def release(version: str | None) -> tuple[int, ...] | None:
    """The numeric release part, padded to X.Y.Z: ``2.5.1+cpu``, ``2.5.1.post2`` -> (2, 5, 1),
    ``2.6.0rc1`` -> (2, 6, 0); None if there is none."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version or "")
    return (tuple(map(int, m.group(1).split("."))) + (0, 0, 0))[:3] if m else None


def is_cuda_build(torch_version: str | None, torch_cuda: str | None) -> bool:
    """``torch.version.cuda`` set, or a ``+cuXXX`` local version tag."""
    return bool(torch_cuda) or bool(torch_version and re.search(r"\+cu\d", torch_version))


def package_version(name: str) -> str | None:
    """Installed distribution version, without importing the package."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- CANN
def parse_cann_version(text: str) -> str | None:
    """The CANN version from ``ascend_toolkit_install.info`` (``version=8.0.RC3``)
    or ``version.cfg`` (``toolkit_running_version=[7.5.0.1.129:8.0.RC3]``)."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            values.setdefault(key.strip().lower(), value.strip().strip('"'))
    for key in ("version", "toolkit_running_version", "runtime_running_version"):
        value = values.get(key, "").strip("[]").strip()
        if value:
            # version.cfg pairs the inner build number with the public version.
            return value.rsplit(":", 1)[-1].strip() or None
    return None


class CannVersion(NamedTuple):
    """The installed CANN's version and the file it was read from; where there is none, ``missing`` says what was
    looked for and what was wrong with each file found (unreadable, no version line)."""
    version: str | None
    source: str | None = None
    missing: str | None = None


def cann_files(root: str, arch: str) -> list[str]:
    """The files a CANN install under ``root`` records its version in, in the order they are read: the toolkit's
    install record for this machine's architecture, any architecture's (torch_npu's collect_env reads the first
    ``ascend_*_install.info`` under ASCEND_HOME_PATH), then ``version.cfg``."""
    return list(dict.fromkeys([os.path.join(root, f"{arch}-linux", "ascend_toolkit_install.info"),
                               *sorted(glob.glob(os.path.join(glob.escape(root), "*-linux", "ascend_*_install.info"))),
                               os.path.join(root, "version.cfg")]))


def _read_cann(roots: list[str], arch: str) -> CannVersion:
    problems = []
    for root in dict.fromkeys(roots):
        for path in cann_files(root, arch):
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
            except FileNotFoundError:
                continue
            except OSError as e:  # a directory, no permission: found but not readable, which is what to fix
                problems.append(f"{path} is unreadable ({type(e).__name__}: {e.strerror or e})")
                continue
            version = parse_cann_version(text)
            if version:
                return CannVersion(version, path)
            problems.append(f"{path} has no version line (version=... or toolkit_running_version=[...])")
    if not problems:
        problems.append(f"no <arch>-linux/ascend_toolkit_install.info or version.cfg under {', '.join(roots)}")
    return CannVersion(None, None, "; ".join(problems))


def read_cann(env: dict, ascend_root: str = ASCEND_ROOT, arch: str | None = None) -> CannVersion:
    """CANN's version from the roots ``CANN_ROOT_VARS`` name (set_env.sh exports them), then ``ascend_root``'s
    ``CANN_DIRS``."""
    roots = [env[v] for v in CANN_ROOT_VARS if env.get(v)] + [os.path.join(ascend_root, d) for d in CANN_DIRS]
    return _read_cann(roots, arch or platform.machine())


def find_cann(env: dict, default_root: str = DEFAULT_CANN_ROOT,
              arch: str | None = None) -> tuple[str | None, str | None]:
    """(version, file it was read from) from the variables' roots, then ``default_root``; (None, None) when no
    toolkit is found."""
    found = _read_cann([env[v] for v in CANN_ROOT_VARS if env.get(v)] + [default_root], arch or platform.machine())
    return found.version, found.source


# --------------------------------------------------------------------------- torch_npu against CANN
#: torch_npu's published (torch_npu, CANN) pairs: the "TorchNPU version mapping table" and its table of historical
#: versions in Ascend/pytorch's COMPATIBILITY.en.md (https://github.com/Ascend/pytorch/blob/master/COMPATIBILITY.en.md,
#: commit b48e6481 of 2026-08-20; COMPATIBILITY.md holds the same in Chinese, and README.md's "Ascend Auxiliary
#: Software" table held it before). Each torch_npu release is built against one CANN release; a torch_npu with
#: another CANN may fail to load or fail in an operator at run time. Rows from CANN 6.3.RC1 on (older ones pair
#: torch 1.5 / 1.8). CANN -> the torch_npu builds published for it; torch_npu X.Y.Z(.postN) goes with torch X.Y.Z.
#: A new torch_npu or CANN release is a new row here, with this comment's date moved.
TORCH_NPU_CANN_PAIRS: dict[str, tuple[str, ...]] = {
    "9.1.0": ("2.12.0", "2.11.0", "2.10.0.post4", "2.9.0.post6", "2.7.1.post8"),
    "9.0.0": ("2.9.0.post2", "2.8.0.post4", "2.7.1.post4"),
    "8.5.0": ("2.9.0", "2.8.0.post2", "2.7.1.post2", "2.6.0.post5"),
    "8.3.RC1": ("2.8.0", "2.7.1", "2.6.0.post3", "2.1.0.post17"),
    "8.2.RC1": ("2.6.0", "2.5.1.post1", "2.1.0.post13"),
    "8.1.RC1": ("2.5.1", "2.4.0.post4", "2.3.1.post6", "2.1.0.post12"),
    "8.0.0": ("2.4.0.post2", "2.3.1.post4", "2.1.0.post10"),
    # the historical table (end of life included)
    "8.0.RC3": ("2.4.0", "2.3.1.post2", "2.1.0.post8"),
    "8.0.RC2": ("2.3.1", "2.2.0.post2", "2.1.0.post6", "1.11.0.post14"),
    "8.0.RC1": ("2.2.0", "2.1.0.post4", "1.11.0.post11"),
    "7.0.0": ("2.1.0", "2.0.1.post1", "1.11.0.post8"),
    "7.0.RC1": ("2.1.0.rc1", "2.0.1", "1.11.0.post4"),
    "6.3.RC3.1": ("1.11.0.post3",),
    "6.3.RC3": ("1.11.0.post2",),
    "6.3.RC2": ("2.0.1.rc1", "1.11.0.post1", "1.8.1.post2"),
    "6.3.RC1": ("1.11.0", "1.8.1.post1"),
}
PAIRS_SOURCE = "torch_npu's table (Ascend/pytorch COMPATIBILITY.en.md, 2026-08-20)"


def torch_npu_key(version: str | None) -> tuple | None:
    """An order of torch_npu versions: X.Y.Z, then rcN before the final before .postN (``2.1.0.rc1`` <
    ``2.1.0`` < ``2.1.0.post17``); None for another form."""
    m = re.fullmatch(r"\s*(\d+)\.(\d+)\.(\d+)(?:\.?(rc|post)(\d+))?(?:\+\S*)?\s*", version or "", re.IGNORECASE)
    if not m:
        return None
    kind = {"rc": -1, "post": 1}.get((m.group(4) or "").lower(), 0)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3)), kind, int(m.group(5) or 0))


def cann_key(version: str | None) -> tuple | None:
    """An order of CANN versions: within X.Y the RCs come before the final releases (``8.0.RC3`` < ``8.0.0`` <
    ``8.1.RC1``), a fourth number after its three (``6.3.RC3`` < ``6.3.RC3.1``); None for another form."""
    m = re.fullmatch(r"\s*(?:CANN\s*)?(\d+)\.(\d+)\.(RC)?(\d+)((?:\.\d+)*)\s*", version or "", re.IGNORECASE)
    if not m:
        return None
    rest = tuple(int(x) for x in m.group(5).split(".") if x)
    return (int(m.group(1)), int(m.group(2)), 0 if m.group(3) else 1, int(m.group(4))) + rest


def check_torch_npu_cann(torch_npu_version: str | None, cann: CannVersion,
                         pairs: dict[str, tuple[str, ...]] = TORCH_NPU_CANN_PAIRS) -> list[str]:
    """The installed torch_npu and CANN against the published pairs: an ERROR with the line that fixes it where the
    table publishes this torch_npu for another CANN; a WARNING ("unknown pair") where either is newer than the table
    or this torch_npu is not in it; a WARNING naming what is missing where CANN's version could not be read."""
    if not torch_npu_version or (not cann.version and not cann.missing):  # (nothing read: nothing to say)
        return []
    if not cann.version:
        return [f"{WARNING}: torch_npu {torch_npu_version} is installed but CANN's version could not be read, so the "
                f"pair is not checked against {PAIRS_SOURCE}: {cann.missing} (source CANN's set_env.sh, which sets "
                f"ASCEND_HOME_PATH, or install CANN)"]
    npu, have = torch_npu_key(torch_npu_version), cann_key(cann.version)
    if npu is None or have is None:
        bad = (f"torch_npu {torch_npu_version!r} (allowed: X.Y.Z, X.Y.Z.postN, X.Y.Z.rcN)" if npu is None
               else f"CANN {cann.version!r} from {cann.source} (allowed: X.Y.Z, X.Y.RCn)")
        return [f"{WARNING}: cannot check torch_npu against CANN: unparseable version {bad}"]
    rows = [(c, n) for c, builds in pairs.items() for n in builds]
    published_for = [c for c, n in rows if torch_npu_key(n) == npu]
    if any(cann_key(c) == have for c in published_for):
        return []
    newest_cann = max(pairs, key=cann_key)
    same_release = [torch_npu_key(n) for _, n in rows if torch_npu_key(n)[:3] == npu[:3]]
    if not published_for:
        if not same_release or npu > max(same_release):
            return [f"{WARNING}: unknown pair: torch_npu {torch_npu_version} is newer than {PAIRS_SOURCE}, whose "
                    f"newest CANN is {newest_cann}; CANN {cann.version} is installed (check torch_npu's release "
                    f"notes for the CANN it needs)"]
        siblings = ", ".join(n for _, n in rows if torch_npu_key(n)[:3] == npu[:3])
        return [f"{WARNING}: unknown pair: torch_npu {torch_npu_version} is not in {PAIRS_SOURCE} (its builds for "
                f"torch {'.'.join(map(str, npu[:3]))}: {siblings}); CANN {cann.version} is installed"]
    if have > cann_key(newest_cann):
        return [f"{WARNING}: unknown pair: CANN {cann.version} ({cann.source}) is newer than {PAIRS_SOURCE}, whose "
                f"newest is CANN {newest_cann}; torch_npu {torch_npu_version} is published for CANN "
                f"{' / '.join(published_for)}"]
    wanted = " / ".join(published_for)
    for_this = [n for c, n in rows if cann_key(c) == have]
    same = max((n for n in for_this if torch_npu_key(n)[:3] == npu[:3]), key=torch_npu_key, default=None)
    if same:
        fix = f"pip install torch_npu=={same} (the build published for CANN {cann.version}), or install CANN {wanted}"
    elif for_this:
        other = max(for_this, key=torch_npu_key)
        fix = (f"install CANN {wanted}, or for CANN {cann.version}: pip install "
               f"torch=={'.'.join(map(str, torch_npu_key(other)[:3]))} torch_npu=={other}")
    else:
        fix = f"install CANN {wanted}"
    return [f"{ERROR}: torch_npu {torch_npu_version} is published for CANN {wanted}, but CANN {cann.version} is "
            f"installed ({cann.source}); {PAIRS_SOURCE} has no such pair: {fix}"]


def check_cann_pair(torch_npu_version: str | None, env: dict | None = None, ascend_root: str = ASCEND_ROOT,
                    arch: str | None = None) -> list[str]:
    """``check_torch_npu_cann`` on the CANN installed under ``ascend_root`` (or where ``env``'s variables say)."""
    return check_torch_npu_cann(torch_npu_version, read_cann(env or {}, ascend_root, arch))


# --------------------------------------------------------------------------- checks
def check_torch_npu_pair(torch_version: str | None, torch_npu_version: str | None) -> list[str]:
    """torch_npu X.Y.Z(.postN) must sit beside torch X.Y.Z exactly."""
    if not torch_npu_version:
        return []
    if not torch_version:
        return [f"{ERROR}: torch_npu {torch_npu_version} is installed but torch is not"]
    t, n = release(torch_version), release(torch_npu_version)
    if t is None or n is None:
        return [f"{WARNING}: cannot compare torch {torch_version} with torch_npu {torch_npu_version}: "
                "unparseable version"]
    if t != n:
        n_s, t_s = (".".join(map(str, rel)) for rel in (n, t))
        return [f"{ERROR}: torch_npu {torch_npu_version} needs torch {n_s} exactly, but torch is {torch_version} "
                f"(install torch=={n_s}, or the torch_npu release built for torch {t_s})"]
    return []


def check_cuda_build(torch_version: str | None, torch_cuda: str | None,
                     torch_npu_version: str | None) -> list[str]:
    """torch_npu refuses a CUDA build of torch."""
    if torch_npu_version and is_cuda_build(torch_version, torch_cuda):
        build = f"CUDA {torch_cuda}" if torch_cuda else "CUDA"
        return [f"{ERROR}: torch_npu {torch_npu_version} is installed beside a {build} build of "
                f"torch {torch_version}; torch_npu needs the CPU build of torch "
                "(pip install torch==X.Y.Z --index-url https://download.pytorch.org/whl/cpu)"]
    return []


_UUID_ENTRY = re.compile(r"^(GPU|MIG)-", re.IGNORECASE)


def check_visible_devices(env: dict) -> list[str]:
    """Each of VISIBLE_DEVICE_VARS, when set, must be a list of distinct non-negative integers (or, for CUDA, device
    UUIDs); ASCEND_RT_VISIBLE_DEVICES must also ascend (the Ascend runtime requires it; CUDA takes any order)."""
    findings = []
    for var in (v for v in VISIBLE_DEVICE_VARS if v in env):
        value = env[var]
        items = value.split(",")
        if value == "":
            findings.append(f"{WARNING}: {var}='' is set but empty: it hides every device")
        elif var == "CUDA_VISIBLE_DEVICES" and any(_UUID_ENTRY.match(i.strip()) for i in items):
            continue  # GPU-/MIG- UUIDs are valid for CUDA and carry no order to check
        elif not all(re.fullmatch(r"\d+", i) for i in items):
            findings.append(f"{WARNING}: {var}={value!r} is not a comma-separated list of "
                            "non-negative integers (e.g. '0,1,2')")
        elif len(set(items)) != len(items):
            findings.append(f"{WARNING}: {var}={value!r} names a device twice (use e.g. '0,1,2')")
        elif var == "ASCEND_RT_VISIBLE_DEVICES" and any(int(a) >= int(b) for a, b in zip(items, items[1:])):
            findings.append(f"{WARNING}: {var}={value!r} is not strictly ascending, which the Ascend runtime "
                            "requires (use e.g. '0,1,2')")
    return findings


def check_hccl_timeouts(env: dict, family: str | None) -> list[str]:
    """HCCL_EXEC_TIMEOUT and HCCL_CONNECT_TIMEOUT against CANN's ranges for the chip family (learner/distributed.py
    holds the numbers and their source): A1 rounds the execution timeout down to a multiple of 68 and has no
    "never"; A2/A3 take 0 as never (the watchdog alone then bounds a collective) and, under AIV expansion, at most
    1091 s."""
    from learner import distributed as d  # (imports torch: called once the report has done so)

    findings = []
    lo, hi = d.HCCL_CONNECT_TIMEOUT_RANGE_S
    value = env.get("HCCL_CONNECT_TIMEOUT")
    if value is not None and not (value.isdigit() and lo <= int(value) <= hi):
        findings.append(f"{WARNING}: HCCL_CONNECT_TIMEOUT={value!r} is outside HCCL's range [{lo}, {hi}] s "
                        f"(unset it: the learners set it from run.stall_timeout_s)")
    value = env.get("HCCL_EXEC_TIMEOUT")
    if value is None:
        return findings
    if not value.isdigit():
        return findings + [f"{WARNING}: HCCL_EXEC_TIMEOUT={value!r} is not a whole number of seconds (unset it: the "
                           f"learners set it from run.stall_timeout_s)"]
    n, top = int(value), d.HCCL_EXEC_MAX_S.get(family or "A1", d.HCCL_EXEC_MAX_S["A1"])
    aiv = env.get("HCCL_OP_EXPANSION_MODE", "").strip().upper() == "AIV"
    applied = d.applied_exec_timeout_s(n, family, aiv)
    if family == "A1" and (n == 0 or n > top):
        findings.append(f"{WARNING}: HCCL_EXEC_TIMEOUT={value} is outside (0, {top}] s on this Atlas training "
                        f"(910) host (set a multiple of 68 up to {top}, or unset it)")
    elif family == "A1" and applied != n:
        findings.append(f"{WARNING}: HCCL_EXEC_TIMEOUT={value} applies as {applied:.0f} s on this Atlas training (910) "
                        f"host, a multiple of 68 (set {applied:.0f} or {applied + d.HCCL_EXEC_STEP_S:.0f})")
    elif aiv and applied != n:
        findings.append(f"{WARNING}: HCCL_EXEC_TIMEOUT={value} applies as {applied:.0f} s under "
                        f"HCCL_OP_EXPANSION_MODE=AIV (at most {d.HCCL_EXEC_AIV_MAX_S}; set at most that)")
    elif n == 0:
        findings.append(f"{WARNING}: HCCL_EXEC_TIMEOUT=0 means HCCL never times out a collective: a stuck one is "
                        f"reported by torch_npu's watchdog only, without HCCL's own report (unset it)")
    return findings


def check_hccl(npus: int, env: dict) -> list[str]:
    """On an NPU host: the interface HCCL talks on named where the host has several (HCCL otherwise takes the first
    it finds, which on a multi-homed host may not reach the other hosts)."""
    findings = []
    if npus and not any(env.get(v) for v in HCCL_NET_VARS) and len(_network_interfaces()) > 1:
        findings.append(f"{WARNING}: this NPU host has several network interfaces ({', '.join(_network_interfaces())})"
                        f" and neither HCCL_SOCKET_IFNAME nor HCCL_IF_IP is set: learners on several hosts may "
                        f"connect over the wrong one")
    return findings


#: HCCL's host ports (CANN's HCCL_IF_BASE_PORT page, envref_07_0074, hiascend.com): it collects the cluster's
#: information on the 32 ports from HCCL_IF_BASE_PORT (default 60000; CANN 8.0 and older documents use 16 of them:
#: 32 covers both), which must lie in [1024, 65520] and which the OS is asked to keep out of its ephemeral ports.
HCCL_BASE_PORT_VAR, HCCL_DEFAULT_BASE_PORT, HCCL_PORTS, HCCL_BASE_PORT_RANGE = "HCCL_IF_BASE_PORT", 60000, 32, (1024, 65520)


def parse_port_ranges(text: str) -> set[int]:
    """``ip_local_reserved_ports``' form, "60000-60031,8080", as the ports it names."""
    ports: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            ports.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            continue
    return ports


def parse_listening(proc_net_tcp: str) -> set[int]:
    """The local ports in LISTEN state (0A) of a /proc/net/tcp or tcp6 table."""
    ports = set()
    for line in proc_net_tcp.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 3 and fields[3] == "0A":
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def check_hccl_ports(env: dict, listening: set[int], reserved: set[int], ephemeral: tuple[int, int] | None,
                     npu_host: bool) -> list[str]:
    """On an NPU host: HCCL's host port range valid, free of listeners, and out of the OS's ephemeral ports (a
    connection this host opens may otherwise take one of them, and HCCL's start then fails to bind it)."""
    if not npu_host:
        return []
    raw = env.get(HCCL_BASE_PORT_VAR)
    try:
        base = int(raw) if raw is not None else HCCL_DEFAULT_BASE_PORT
    except ValueError:
        base = None
    lo, hi = HCCL_BASE_PORT_RANGE
    if base is None or not lo <= base <= hi:
        return [f"{ERROR}: {HCCL_BASE_PORT_VAR}={raw!r} is not a port in [{lo}, {hi}]: set it in that range, or "
                f"unset it (HCCL then uses {HCCL_DEFAULT_BASE_PORT})"]
    span = range(base, base + HCCL_PORTS)
    findings = []
    taken = sorted(set(span) & listening)
    if taken:
        findings.append(f"{ERROR}: HCCL's host ports {base}-{span[-1]} are not free ({', '.join(map(str, taken[:4]))}"
                        f" listening): stop what listens there, or move HCCL with {HCCL_BASE_PORT_VAR}=<a free base>")
    if ephemeral and set(span) & set(range(ephemeral[0], ephemeral[1] + 1)) - reserved:
        findings.append(f"{WARNING}: HCCL's host ports {base}-{span[-1]} lie in the OS's ephemeral ports "
                        f"({ephemeral[0]}-{ephemeral[1]}) and are not reserved: run "
                        f"sysctl -w net.ipv4.ip_local_reserved_ports={base}-{span[-1]}")
    return findings


def check_ray_npu_count(ray_npus: int | None, torch_npus: int) -> list[str]:
    """Ray's count of this node's NPUs (what it schedules ``NPU`` by) against the devices torch_npu sees."""
    if ray_npus is not None and torch_npus and ray_npus != torch_npus:
        return [f"{WARNING}: Ray counts {ray_npus} NPU(s) on this node but torch_npu sees {torch_npus}: Ray would "
                f"place learners by the first count (check ASCEND_RT_VISIBLE_DEVICES and /dev/davinci*)"]
    return []


# --------------------------------------------------------------------------- Ascend host
def parse_npu_smi_health(text: str) -> dict[int, str]:
    """{NPU id: Health} from ``npu-smi info``'s device table: the first row of each NPU reads
    ``| <id>  <name> | <Health> | <power> <temp> ... |``; the chip rows under it start with the chip number and a
    bus id, and the process table after it has no Health column."""
    health = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3:
            m = re.fullmatch(r"(\d+)\s+(\S+)", cells[0])
            if m and not re.fullmatch(r"[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d", cells[1]) \
                    and re.fullmatch(r"[A-Za-z][A-Za-z ]*", cells[1]):
                health[int(m.group(1))] = cells[1]
    return health


def check_npu_health(health: dict[int, str]) -> list[str]:
    return [f"{ERROR}: NPU {npu} reports health {state!r} in npu-smi info (npu-smi info -t health -i {npu} says why; "
            f"leave it out of ASCEND_RT_VISIBLE_DEVICES until it reads OK)" for npu, state in sorted(health.items())
            if state.upper() != "OK"]


def parse_hccn(link_text: str, ip_text: str) -> tuple[str | None, str | None]:
    """(link status, IP address) from ``hccn_tool -i N -link -g`` (``link status: UP``) and ``hccn_tool -i N -ip -g``
    (``ipaddr:192.168.1.8``)."""
    link = re.search(r"link status\s*:\s*(\w+)", link_text, re.IGNORECASE)
    ip = re.search(r"ipaddr\s*:\s*([0-9.]+)", ip_text, re.IGNORECASE)
    return (link.group(1).upper() if link else None), (ip.group(1) if ip else None)


def check_hccn(per_device: dict[int, tuple[str | None, str | None]], multi_host: bool) -> list[str]:
    """Each NPU's RoCE port up and addressed: HCCL between hosts runs over them (within a host it uses HCCS)."""
    findings = []
    level = ERROR if multi_host else WARNING
    for npu, (link, ip) in sorted(per_device.items()):
        if link != "UP":
            findings.append(f"{level}: NPU {npu}'s network port is {link or 'unknown'} (hccn_tool -i {npu} -link -g): "
                            f"HCCL across hosts needs it UP (check its cable and switch port)")
        if not ip:
            findings.append(f"{level}: NPU {npu}'s network port has no IP address (set one: hccn_tool -i {npu} -ip -s "
                            f"address <ip> netmask <mask>)")
    return findings


def check_davinci_access(devices: dict[str, tuple[int, int, int]], uid: int, gids: set[int]) -> list[str]:
    """{path: (mode, owner uid, group gid)} of the NPU device files: each must be readable and writable by this user,
    through its owner, group or other bits."""
    findings = []
    for path, (mode, owner, group) in sorted(devices.items()):
        if uid == 0:
            continue
        bits = (mode >> 6) & 7 if owner == uid else (mode >> 3) & 7 if group in gids else mode & 7
        if bits & 6 != 6:
            findings.append(f"{ERROR}: {path} is not readable and writable by this user (mode {mode & 0o777:o}): "
                            f"add the user to the device's group (usermod -aG HwHiAiUser $USER) or run as its owner")
    return findings


def check_visible_against_devices(env: dict, present: list[int]) -> list[str]:
    """ASCEND_RT_VISIBLE_DEVICES against the NPUs present (/dev/davinciN): the runtime drops an id it does not
    have, and the learners would see fewer devices than Ray was told. Under
    RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES=1 Ray leaves the variable as it is for every actor: a value set
    there then hides the same devices from all of them."""
    value = env.get("ASCEND_RT_VISIBLE_DEVICES")
    if not value or not present or not all(re.fullmatch(r"\d+", i) for i in value.split(",")):
        return []
    missing = [int(i) for i in value.split(",") if int(i) not in present]
    findings = []
    if missing:
        findings.append(f"{ERROR}: ASCEND_RT_VISIBLE_DEVICES={value} names NPU(s) {missing} that this host does not "
                        f"have (it has {present}): set it from `ls /dev/davinci*`")
    if env.get("RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES") == "1" and len(value.split(",")) < len(present):
        findings.append(f"{WARNING}: RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES=1 with ASCEND_RT_VISIBLE_DEVICES="
                        f"{value}: Ray counts {len(present)} NPUs but every actor sees only these (unset one of them)")
    return findings


def parse_driver_version(text: str) -> str | None:
    """The driver's or the firmware's version from its version.info (``Version=24.1.rc2``)."""
    m = re.search(r"^\s*Version\s*=\s*(\S+)", text, re.MULTILINE | re.IGNORECASE)
    return m.group(1) if m else None


def check_ascend_stack(driver: str | None, cann: str | None, torch_npu_version: str | None,
                       davinci: bool) -> list[str]:
    """On a host with NPUs: the driver and CANN both found, the pieces torch_npu needs to load."""
    findings = []
    if davinci and not driver:
        findings.append(f"{ERROR}: this host has /dev/davinci* but no Ascend driver version ({DRIVER_VERSION_FILE}): "
                        f"install the driver and firmware packages for its NPUs")
    if davinci and torch_npu_version and not cann:
        findings.append(f"{ERROR}: torch_npu {torch_npu_version} is installed but no CANN toolkit was found: install "
                        f"the CANN release that torch_npu's release notes pair with it, and source its set_env.sh")
    return findings


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _run(argv: list[str], timeout_s: float = 10.0) -> str | None:
    """A command's stdout, or None where it is not installed or fails (not an Ascend host)."""
    import shutil
    import subprocess

    if shutil.which(argv[0]) is None:
        return None
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def ascend_facts(env: dict, ascend_root: str = ASCEND_ROOT) -> dict:
    """What the Ascend checks read from this host; empty values on a host without NPUs. The driver's and the
    firmware's versions are read and shown, not checked against CANN: no machine-readable table of the versions a
    CANN release supports was found (docs/cluster.md, "What the doctor checks")."""
    paths = sorted(glob.glob(DAVINCI_GLOB), key=lambda p: int(re.sub(r"\D", "", p) or 0))
    present = [int(re.sub(r"\D", "", p)) for p in paths]
    modes = {}
    for path in paths + [p for p in DAVINCI_CONTROL if os.path.exists(p)]:
        try:
            st = os.stat(path)
            modes[path] = (st.st_mode, st.st_uid, st.st_gid)
        except OSError:
            continue
    smi = _run(["npu-smi", "info"]) if paths else None
    hccn = {}
    if paths and _run(["hccn_tool", "-h"]) is not None:
        for npu in present:
            hccn[npu] = parse_hccn(_run(["hccn_tool", "-i", str(npu), "-link", "-g"]) or "",
                                   _run(["hccn_tool", "-i", str(npu), "-ip", "-g"]) or "")
    driver_text = _read(os.path.join(ascend_root, DRIVER_VERSION_PATH))
    firmware_text = _read(os.path.join(ascend_root, FIRMWARE_VERSION_PATH))
    ports = None
    if paths:  # HCCL's port range against this host's listeners, reserved and ephemeral ports
        ephemeral = (_read("/proc/sys/net/ipv4/ip_local_port_range") or "").split()
        ports = {"listening": sorted(parse_listening(_read("/proc/net/tcp") or "")
                                     | parse_listening(_read("/proc/net/tcp6") or "")),
                 "reserved": _read("/proc/sys/net/ipv4/ip_local_reserved_ports") or "",
                 "ephemeral": [int(x) for x in ephemeral[:2]] if len(ephemeral) >= 2 else None}
    return {"davinci": present, "device_modes": modes, "npu_health": parse_npu_smi_health(smi) if smi else {},
            "hccn": hccn, "driver": parse_driver_version(driver_text) if driver_text else None,
            "firmware": parse_driver_version(firmware_text) if firmware_text else None, "ports": ports}


def _network_interfaces() -> list[str]:
    """This host's network interfaces other than loopback."""
    try:
        return sorted(n for n in os.listdir("/sys/class/net") if n != "lo")
    except OSError:
        return []


def check_autoload(torch_npu_version: str | None, cann_version: str | None, env: dict) -> list[str]:
    """With torch_npu installed, ``import torch`` autoloads it; without CANN that fails."""
    if torch_npu_version and not cann_version and env.get(AUTOLOAD_VAR) != "0":
        return [f"{WARNING}: torch_npu {torch_npu_version} is installed but no CANN toolkit was found; "
                "`import torch` autoloads torch_npu and may fail on this host: "
                f"set {AUTOLOAD_VAR}=0 here (or source the CANN set_env.sh)"]
    return []


def check_torch_npu_import(torch_npu_version: str | None, importable: bool | None,
                           error: str | None) -> list[str]:
    if torch_npu_version and importable is False:
        return [f"{WARNING}: torch_npu {torch_npu_version} is installed but does not import: {error}"]
    return []


def run_checks(facts: dict, env: dict) -> list[str]:
    v = facts["versions"]
    return (check_torch_npu_pair(v["torch"], v["torch_npu"])
            + check_torch_npu_cann(v["torch_npu"], CannVersion(v.get("cann"), v.get("cann_source"),
                                                               v.get("cann_missing")))
            + check_cuda_build(v["torch"], v["torch_cuda"], v["torch_npu"])
            + check_visible_devices(env)
            + check_hccl(facts.get("devices", {}).get("npus", 0), env)
            + check_hccl_timeouts(env, facts.get("devices", {}).get("chip_family"))
            + check_ascend(facts.get("ascend") or {}, v, env)
            + check_ray_npu_count(facts.get("devices", {}).get("ray_npus"), facts.get("devices", {}).get("npus", 0))
            + check_autoload(v["torch_npu"], v["cann"], env)
            + check_torch_npu_import(v["torch_npu"], v["torch_npu_importable"], v["torch_npu_import_error"]))


def check_ascend(ascend: dict, versions: dict, env: dict) -> list[str]:
    """Every Ascend host check on ``ascend_facts``' values; nothing on a host without NPUs."""
    present = ascend.get("davinci") or []
    return (check_ascend_stack(ascend.get("driver"), versions.get("cann"), versions.get("torch_npu"), bool(present))
            + check_npu_health(ascend.get("npu_health") or {})
            + check_hccn(ascend.get("hccn") or {}, multi_host=bool(any(env.get(v) for v in HCCL_NET_VARS)))
            + check_davinci_access(ascend.get("device_modes") or {}, os.getuid(), set(os.getgroups()))
            + check_visible_against_devices(env, present)
            + _check_ports(ascend.get("ports"), env))


def _check_ports(ports: dict | None, env: dict) -> list[str]:
    if not ports:
        return []
    ephemeral = ports.get("ephemeral")
    return check_hccl_ports(env, set(ports.get("listening") or ()), parse_port_ranges(ports.get("reserved") or ""),
                            tuple(ephemeral) if ephemeral else None, npu_host=True)


def exit_code(findings: list[str]) -> int:
    return EXIT_ERROR if any(f.startswith(ERROR) for f in findings) else EXIT_OK


# --------------------------------------------------------------------------- facts
def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _try_import_torch_npu() -> tuple[bool, str | None]:
    """Lazy and guarded: importing torch_npu without CANN raises (or worse, at load time)."""
    try:
        importlib.import_module("torch_npu")
    except Exception as exc:
        return False, _first_line(exc)
    return True, None


def _ray_npu_count() -> int | None:
    """Ray's own count of this node's NPUs (its Ascend accelerator manager), None where Ray cannot tell."""
    try:
        from ray._private.accelerators import get_accelerator_manager_for_resource

        return int(get_accelerator_manager_for_resource("NPU").get_current_node_num_accelerators())
    except Exception:  # noqa: BLE001 - a Ray without that interface: nothing to compare
        return None


def collect(env: dict | None = None) -> dict:
    env = dict(os.environ if env is None else env)
    # Key order is the --json output's order.
    versions = dict.fromkeys(("python", "ray", "torch", "torch_cuda", "torch_build", "torch_npu",
                              "torch_npu_importable", "torch_npu_import_error", "cann", "cann_source", "cann_missing",
                              "gymnasium", "numpy"))
    versions["python"] = platform.python_version()
    versions.update({name: package_version(name) for name in ("ray", "torch", "torch_npu", "gymnasium", "numpy")})
    versions["cann"], versions["cann_source"], versions["cann_missing"] = read_cann(env)
    devices = {"detected": None, "backend": None, "ray_resource": None, "cuda_devices": 0, "npus": 0,
               "ray_npus": None, "visible": {var: env.get(var) for var in VISIBLE_DEVICE_VARS + NOSET_VARS},
               "hccl": {var: env.get(var) for var in HCCL_NET_VARS + HCCL_TIMEOUT_VARS}, "chip_family": None}
    errors: list[str] = []

    try:
        import torch
    except Exception as exc:  # e.g. torch_npu autoloaded without CANN
        errors.append(f"{ERROR}: import torch failed: {_first_line(exc)}")
        torch = None
    if torch is not None:
        versions["torch"] = versions["torch"] or torch.__version__
        versions["torch_cuda"] = cuda = torch.version.cuda
        hip = getattr(torch.version, "hip", None)
        versions["torch_build"] = f"CUDA {cuda}" if cuda else f"ROCm {hip}" if hip else "CPU"
        if versions["torch_npu"]:
            versions["torch_npu_importable"], versions["torch_npu_import_error"] = _try_import_torch_npu()
        try:
            from learner import device as dev

            devices["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if dev.npu_available():
                devices["npus"] = torch.npu.device_count()
                devices["ray_npus"] = _ray_npu_count()
            spec = dev.resolve("auto")
            devices.update(detected=spec.kind, backend=spec.backend, ray_resource=spec.ray_resource)
        except Exception as exc:
            errors.append(f"{ERROR}: device detection failed: {_first_line(exc)}")
    elif versions["torch"]:
        versions["torch_build"] = "CUDA (from version tag)" if is_cuda_build(versions["torch"], None) else None

    if devices["npus"]:
        from learner import distributed

        devices["chip_family"] = distributed.npu_chip_family()
    facts = {"versions": versions, "devices": devices, "ascend": ascend_facts(env)}
    facts["findings"] = findings = errors + run_checks(facts, env)
    facts["ok"] = exit_code(findings) == EXIT_OK
    return facts


# --------------------------------------------------------------------------- output
def format_text(facts: dict) -> str:
    v, d, a = facts["versions"], facts["devices"], facts.get("ascend") or {}
    ver = {k: x or "not installed" for k, x in v.items()}
    torch_line = ver["torch"] + (f" ({v['torch_build']} build)" if v["torch"] and v["torch_build"] else "")
    npu_line = ver["torch_npu"]
    if v["torch_npu"] and v["torch_npu_importable"] is not None:
        npu_line += " (imports)" if v["torch_npu_importable"] else " (import fails)"
    rows = ["versions", ("python", v["python"]), ("ray", ver["ray"]), ("torch", torch_line), ("torch_npu", npu_line),
            ("CANN", f"{v['cann']} ({v['cann_source']})" if v["cann"] else "not found"),
            ("Ascend driver", a.get("driver") or "not found"), ("NPU firmware", a.get("firmware") or "not found"),
            ("gymnasium", ver["gymnasium"]), ("numpy", ver["numpy"]),
            "devices", ("detected", d["detected"] or "unknown"), ("backend", d["backend"] or "unknown"),
            ("CUDA devices", str(d["cuda_devices"])), ("NPUs", str(d["npus"])),
            *((var, "unset" if val is None else repr(val)) for var, val in d["visible"].items()),
            *((var, "unset" if val is None else repr(val)) for var, val in d["hccl"].items())]
    width = max(len(r[0]) for r in rows if isinstance(r, tuple))
    lines = ["Ascent-RL doctor", *(r if isinstance(r, str) else f"  {r[0]:<{width}}  {r[1]}" for r in rows)]
    lines += ["findings", *([f"  {f}" for f in facts["findings"]] or ["  none"])]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.doctor", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the same facts as one JSON object")
    args = p.parse_args(argv)
    facts = collect()
    print(json.dumps(facts, indent=2) if args.json else format_text(facts))
    return exit_code(facts["findings"])


if __name__ == "__main__":
    sys.exit(main())
