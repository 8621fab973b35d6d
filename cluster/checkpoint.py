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
    """The checkpoint of the most training (what ``--resume``, a learner-group restart and ``load_policy(run_dir)``
    take): the one of the highest iteration, final.pt on a tie.

    Not simply final.pt first: ``--resume`` reuses the run directory, so while a resumed run goes, the previous
    run's final.pt is older than the ckpt-*.pt files the resumed run writes. A periodic checkpoint's name carries
    its iteration; final.pt's is read from its payload, and only when there are periodic ones to compare it with
    (the resume case). Not mtimes, which a copied run directory does not keep.
    """
    directory = Path(run_dir) / "checkpoints"
    final = directory / "final.pt"
    found = periodic(directory)
    if not final.is_file():
        return found[-1] if found else None
    if not found:
        return final
    newest = found[-1]
    final_iteration = load(final).get("run_state", {}).get("iteration", -1)  # -1: not a run's (hand-made)
    return final if final_iteration >= int(newest.stem.removeprefix("ckpt-")) else newest
