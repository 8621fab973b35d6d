"""Atomic checkpoints: write to a temp file, fsync, rename.

torch is imported where it is used, so the CLI can find a checkpoint to resume
before it imports anything heavy.
"""

from __future__ import annotations

import os
import platform
import tempfile
from importlib import metadata
from pathlib import Path


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "ray", "gymnasium", "numpy", "torch_npu"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def save(path: Path, payload: dict) -> Path:
    """A reader sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    import torch

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return path


def load(path: Path) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def periodic(directory: Path) -> list[Path]:
    """Periodic checkpoints, oldest first (names sort by iteration)."""
    return sorted(Path(directory).glob("ckpt-*.pt"))


def prune(directory: Path, keep: int) -> None:
    for old in periodic(directory)[:-keep]:
        old.unlink(missing_ok=True)


def latest(run_dir: Path) -> Path | None:
    """What ``--resume`` continues from: the final checkpoint, else the newest periodic one."""
    directory = Path(run_dir) / "checkpoints"
    final = directory / "final.pt"
    if final.is_file():
        return final
    found = periodic(directory)
    return found[-1] if found else None
