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

EXIT_OK, EXIT_ERROR = 0, 1
ERROR, WARNING = "ERROR", "WARNING"

DEFAULT_CANN_ROOT = "/usr/local/Ascend/ascend-toolkit/latest"
#: Searched in this order; ``set_env.sh`` of the CANN toolkit exports both.
CANN_ROOT_VARS = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
VISIBLE_DEVICE_VARS = ("ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
#: Set to 1, Ray leaves every device visible to an actor; learners then take the id Ray assigned them
#: (learner/device.py, local_index), so either setting works, and the report shows which is in force.
NOSET_VARS = ("RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES", "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES")
#: HCCL's network and timeout settings, each in the range CANN's environment reference gives (seconds); the
#: learners set both timeouts from run.stall_timeout_s when they are unset (learner/distributed.py).
HCCL_NET_VARS = ("HCCL_IF_IP", "HCCL_SOCKET_IFNAME")
HCCL_TIMEOUT_VARS = {"HCCL_EXEC_TIMEOUT": (68, 17340), "HCCL_CONNECT_TIMEOUT": (120, 7200)}
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


def find_cann(env: dict, default_root: str = DEFAULT_CANN_ROOT,
              arch: str | None = None) -> tuple[str | None, str | None]:
    """(version, file it was read from), or (None, None) when no toolkit is found."""
    arch = arch or platform.machine()
    for root in dict.fromkeys([env[v] for v in CANN_ROOT_VARS if env.get(v)] + [default_root]):
        info = "ascend_toolkit_install.info"
        for path in [os.path.join(root, f"{arch}-linux", info),
                     *sorted(glob.glob(os.path.join(glob.escape(root), "*-linux", info))),
                     os.path.join(root, "version.cfg")]:
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    version = parse_cann_version(f.read())
            except OSError:
                continue
            if version:
                return version, path
    return None, None


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


def check_hccl(npus: int, env: dict) -> list[str]:
    """On an NPU host: HCCL's timeouts within HCCL's ranges, and the interface HCCL talks on named where the host has
    several (HCCL otherwise takes the first it finds, which on a multi-homed host may not reach the other hosts)."""
    findings = []
    for var, (lo, hi) in HCCL_TIMEOUT_VARS.items():
        value = env.get(var)
        if value is not None and not (value.isdigit() and lo <= int(value) <= hi):
            findings.append(f"{WARNING}: {var}={value!r} is outside HCCL's range [{lo}, {hi}] s")
    if npus and not any(env.get(v) for v in HCCL_NET_VARS) and len(_network_interfaces()) > 1:
        findings.append(f"{WARNING}: this NPU host has several network interfaces ({', '.join(_network_interfaces())})"
                        f" and neither HCCL_SOCKET_IFNAME nor HCCL_IF_IP is set: learners on several hosts may "
                        f"connect over the wrong one")
    return findings


def check_ray_npu_count(ray_npus: int | None, torch_npus: int) -> list[str]:
    """Ray's count of this node's NPUs (what it schedules ``NPU`` by) against the devices torch_npu sees."""
    if ray_npus is not None and torch_npus and ray_npus != torch_npus:
        return [f"{WARNING}: Ray counts {ray_npus} NPU(s) on this node but torch_npu sees {torch_npus}: Ray would "
                f"place learners by the first count (check ASCEND_RT_VISIBLE_DEVICES and /dev/davinci*)"]
    return []


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
            + check_cuda_build(v["torch"], v["torch_cuda"], v["torch_npu"])
            + check_visible_devices(env)
            + check_hccl(facts.get("devices", {}).get("npus", 0), env)
            + check_ray_npu_count(facts.get("devices", {}).get("ray_npus"), facts.get("devices", {}).get("npus", 0))
            + check_autoload(v["torch_npu"], v["cann"], env)
            + check_torch_npu_import(v["torch_npu"], v["torch_npu_importable"], v["torch_npu_import_error"]))


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
                              "torch_npu_importable", "torch_npu_import_error", "cann", "cann_source", "gymnasium",
                              "numpy"))
    versions["python"] = platform.python_version()
    versions.update({name: package_version(name) for name in ("ray", "torch", "torch_npu", "gymnasium", "numpy")})
    versions["cann"], versions["cann_source"] = find_cann(env)
    devices = {"detected": None, "backend": None, "ray_resource": None, "cuda_devices": 0, "npus": 0,
               "ray_npus": None, "visible": {var: env.get(var) for var in VISIBLE_DEVICE_VARS + NOSET_VARS},
               "hccl": {var: env.get(var) for var in HCCL_NET_VARS + tuple(HCCL_TIMEOUT_VARS)}}
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

    facts = {"versions": versions, "devices": devices}
    facts["findings"] = findings = errors + run_checks(facts, env)
    facts["ok"] = exit_code(findings) == EXIT_OK
    return facts


# --------------------------------------------------------------------------- output
def format_text(facts: dict) -> str:
    v, d = facts["versions"], facts["devices"]
    ver = {k: x or "not installed" for k, x in v.items()}
    torch_line = ver["torch"] + (f" ({v['torch_build']} build)" if v["torch"] and v["torch_build"] else "")
    npu_line = ver["torch_npu"]
    if v["torch_npu"] and v["torch_npu_importable"] is not None:
        npu_line += " (imports)" if v["torch_npu_importable"] else " (import fails)"
    rows = ["versions", ("python", v["python"]), ("ray", ver["ray"]), ("torch", torch_line), ("torch_npu", npu_line),
            ("CANN", f"{v['cann']} ({v['cann_source']})" if v["cann"] else "not found"),
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
