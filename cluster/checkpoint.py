"""Atomic checkpoints: write to a temp file, fsync, rename."""

from __future__ import annotations

import os
import platform
import tempfile
from importlib import metadata
from pathlib import Path

import torch


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
    return torch.load(path, map_location="cpu", weights_only=True)
