"""A file the run promises either lands whole or the run says so: a full disk, a read-only filesystem and a run
directory that cannot be made end in one line and their own exit code, with the last good checkpoint kept.

The disk is real: a tmpfs of a few MiB mounted for the test (root; the sandbox tests need root too), filled by the
test while a real run writes into it, or remounted read-only under it. Nothing here fakes an errno.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import checkpoint, exits
from cluster.metrics import JsonlWriter

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small filesystem needs root")


@pytest.fixture
def small_disk(tmp_path):
    """A 24 MiB tmpfs at tmp_path/disk: room for a CartPole run's checkpoints, metrics and events, and no more than
    a test can fill in a moment."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(mount: Path) -> Path:
    """Write a file until the filesystem refuses another byte; the file, to remove later."""
    filler = mount / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
        try:
            while True:
                f.write(b"\0" * 512)
        except OSError:
            pass
    return filler


def remount(mount: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(mount)], check=True)


# --------------------------------------------------------------------------- the writers themselves

def test_a_checkpoint_on_a_full_disk_is_one_line_and_the_old_one_is_kept(small_disk):
    import torch

    path = small_disk / "checkpoints" / "final.pt"
    checkpoint.save(path, {"learner": {"w": torch.ones(4)}})
    filler = fill(small_disk)
    with pytest.raises(checkpoint.WriteFailed) as caught:
        checkpoint.save(path, {"learner": {"w": torch.zeros(1 << 20)}})  # 4 MiB: cannot fit
    line = str(caught.value)
    assert "\n" not in line and str(path) in line, line
    assert "No space left on device (ENOSPC)" in line and "MiB free of 24 MiB on its filesystem" in line, line
    assert torch.equal(torch.load(path, weights_only=True)["learner"]["w"], torch.ones(4))  # the old file, whole
    assert sorted(p.name for p in path.parent.iterdir()) == ["final.pt"]  # no temp file left taking the space
    filler.unlink()
    checkpoint.save(path, {"learner": {"w": torch.zeros(1 << 20)}})  # room again: written


def test_a_checkpoint_on_a_read_only_filesystem_and_a_metrics_line_on_a_full_disk_are_one_line(small_disk):
    import torch

    metrics = JsonlWriter(small_disk / "metrics.jsonl")
    metrics.write({"iteration": 1, "text": "x" * 100})
    filler = fill(small_disk)
    with pytest.raises(checkpoint.WriteFailed, match=r"metrics.jsonl: not written: No space left on device \(ENOSPC\)"):
        for i in range(2, 200):  # the file's last page may hold a few records more
            metrics.write({"iteration": i, "text": "x" * 1000})
    filler.unlink()
    metrics.close()
    remount(small_disk, "ro")
    try:
        with pytest.raises(checkpoint.WriteFailed, match=r"final.pt: not written: Read-only file system \(EROFS\)"):
            checkpoint.save(small_disk / "final.pt", {"learner": {"w": torch.ones(4)}})
    finally:
        remount(small_disk, "rw")


# --------------------------------------------------------------------------- a real run

def train(*args: str, timeout: float = 120, wait: bool = True):
    cmd = [sys.executable, "-m", "cluster.train", *args]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


RUN = ["--address", "inprocess", "--set", "rollout.num_actors=1", "--set", "run.progress_interval_s=1000",
       "--set", "run.target_return=null", "--set", "run.require_target=false",
       "--set", "run.checkpoint_interval_s=0.2", "--set", "run.keep_checkpoints=2",
       "--set", "run.loggers=[jsonl, tensorboard]"]


def test_a_disk_that_fills_mid_run_stops_it_with_exit_4_one_line_and_the_last_good_checkpoint_which_resumes(
        small_disk):
    """CartPole in process writes a checkpoint every 0.2 s into a 24 MiB tmpfs; once some are there the test fills
    the disk. The run's next write (a checkpoint, a metrics line or the events) fails: the run stops with exit 4 and
    one `write failed:` line naming the path, ENOSPC and the space left, and the last good checkpoint, which loads
    and is finite; no temp file is left. With room again, --resume continues from that checkpoint to its end."""
    run_dir = small_disk / "run"
    proc = train("--config", "configs/cartpole.yaml", "--run-dir", str(run_dir), *RUN,
                 "--set", "run.total_env_steps=100000000", wait=False)
    try:
        deadline = time.monotonic() + 90
        while len(checkpoint.periodic(run_dir / "checkpoints")) < 2:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no periodic checkpoint within 90 s"
            time.sleep(0.1)
        filler = fill(small_disk)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == exits.WRITE_FAILED.code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    failed = [line for line in err.splitlines() if line.startswith("write failed:")]
    assert len(failed) == 1, err[-3000:]
    line = failed[0]
    assert str(run_dir) in line and "No space left on device (ENOSPC)" in line and "MiB free of 24 MiB" in line, line
    assert "the last good checkpoint is " in line and f"--resume {run_dir} continues from it" in line, line
    good = Path(line.split("the last good checkpoint is ")[1].split(":")[0])
    payload = checkpoint.load(good)
    assert checkpoint.first_nonfinite(payload) is None
    assert not [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]  # no temp file
    steps = payload["run_state"]["env_steps"]

    filler.unlink()
    resumed = train("--resume", str(run_dir), "--set", f"run.total_env_steps={steps + 4096}", "--set",
                    "run.checkpoint_interval_s=null")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {good}" in resumed.stderr, resumed.stderr[-3000:]
    final = checkpoint.load(run_dir / "checkpoints" / "final.pt")
    assert final["run_state"]["env_steps"] >= steps + 4096
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["env_steps"] == final["run_state"]["env_steps"]


# --------------------------------------------------------------------------- before anything starts

@pytest.mark.parametrize("dry_run", [True, False])
def test_a_run_directory_on_a_read_only_filesystem_or_through_a_file_is_one_line_exit_2(small_disk, dry_run):
    (small_disk / "a-file").write_text("x")
    remount(small_disk, "ro")
    try:
        cases = {small_disk / "run": "is on a read-only filesystem",
                 small_disk / "a-file" / "run": "is a file, not a directory"}
        for run_dir, why in cases.items():
            proc = train("--config", "configs/cartpole.yaml", "--run-dir", str(run_dir), "--address", "inprocess",
                         *(["--dry-run"] if dry_run else []))
            assert proc.returncode == exits.BAD_INPUT.code, proc.stderr[-3000:]
            assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1, proc.stderr[-3000:]
            assert proc.stderr.startswith(f"config error: run directory {str(run_dir)!r}") and why in proc.stderr
    finally:
        remount(small_disk, "rw")


def test_the_tensorboard_events_on_a_full_disk_are_one_line_not_a_thread_traceback(small_disk):
    """tensorboard writes its events in a thread of its own: a full disk there is raised by the next write or by
    close as one WriteFailed line, and that thread's own traceback is not printed. In a process of its own: pytest
    catches thread exceptions itself, so only a real stderr shows what a run's user would see."""
    script = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from cluster.checkpoint import WriteFailed
from cluster.metrics import TensorBoardWriter
from tests.test_write_failures import fill

writer = TensorBoardWriter({str(small_disk / "tb")!r}, flush_secs=0)
writer.write({{"iteration": 0, "env_steps": 0, "x": 1.0}})
writer.flush()
fill(__import__("pathlib").Path({str(small_disk)!r}))
try:
    for i in range(1, 100000):
        writer.write({{"iteration": i, "env_steps": i, "x": float(i)}})
        if i % 100 == 0:
            writer.flush()
    writer.close()
except WriteFailed as e:
    print(e)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tb: not written: No space left on device (ENOSPC)" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Exception in thread" not in proc.stderr, proc.stderr[-3000:]
