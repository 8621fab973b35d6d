"""Atomic checkpoints and the run directory's owner (``RunFiles``).

Every file here is written to a temp file, fsynced and renamed: a reader sees the old file or the new one.
``RunFiles`` knows where every file of a run is: the run directory is resolved once (``RunFiles.resolve``, by
``cluster.api.train`` and the CLI), and the code that writes a run's files is handed that object, not a path.

One directory holds one run. ``run.json`` names the run (a random id) that owns the directory, and every checkpoint
payload carries the same id (``run_id``): a new run refuses a directory that holds another run's files (``claim``),
and ``latest`` takes only checkpoints of the directory's own run, so ``--resume``, ``load_policy(run_dir)`` and
``cluster.evaluate`` never pick up weights of a run that happened to use the same name. A resumed run keeps its id,
so its checkpoints, in the old directory or in a new ``--run-dir``, are the same run's. Checkpoints written before
ids existed carry none and count as the directory's own.

torch is imported where it is used, so the CLI can find a checkpoint to resume
before it imports anything heavy.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import platform
import re
import tempfile
import uuid
import warnings
from datetime import datetime
from importlib import metadata
from pathlib import Path

from cluster.config import ConfigError

RUN_FILE = "run.json"  # the run that owns the directory: {"run_id": ...}
_PERIODIC = re.compile(r"ckpt-(\d+)\.pt")  # ckpt-<iteration>.pt; any other name is not ours to read or prune


class CheckpointError(ConfigError):
    """A checkpoint (or a run directory's run.json) that cannot be read or is not this project's: one line."""


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "ray", "gymnasium", "numpy", "torch_npu"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


class WriteFailed(Exception):
    """A file the run promises (a checkpoint, config.yaml, run.json, metrics.jsonl, the TensorBoard events, the
    report) could not be written: a full disk, a quota, a read-only or failing filesystem. The message is one line
    naming the path, the error and the space left (``describe_write_error``); the file's previous version, if any,
    is untouched."""


def free_space(path: Path) -> str:
    """The space left on ``path``'s filesystem (its nearest existing directory), as a line can say it."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return "free space unknown"
    mib = 1 << 20
    return f"{st.f_bavail * st.f_frsize / mib:,.1f} MiB free of {st.f_blocks * st.f_frsize / mib:,.0f} MiB"


def describe_write_error(path: Path, error: OSError) -> str:
    """``<path>: not written: No space left on device (ENOSPC); 0.0 MiB free of 32 MiB on its filesystem``."""
    code = errno.errorcode.get(error.errno, "") if error.errno else ""
    why = (error.strerror or str(error)) + (f" ({code})" if code else "")
    return f"{path}: not written: {why}; {free_space(path)} on its filesystem"


def _write_atomic(path: Path, write) -> Path:
    """``write(file)`` into a temp file beside ``path``, fsync, rename: a reader sees the old file or the new one,
    never half of one. A temp file a SIGKILL leaves (``.<name>.XXXX``) is removed by the next ``claim``. Any OS error
    on the way (ENOSPC, EDQUOT, EROFS, EIO) is ``WriteFailed``, one line, with the temp file removed and the old
    file kept."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)
    except OSError as e:
        raise WriteFailed(describe_write_error(path, e)) from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return path


class NonFiniteCheckpoint(ValueError):
    """A checkpoint payload holding a NaN or inf (weights, optimizer state, observation statistics): refused, not
    written. The message is one line naming the tensor."""


def first_nonfinite(payload, where: str = "") -> str | None:
    """Where the first NaN or inf of a floating-point tensor in ``payload`` (nested dicts, lists, tuples) is, with
    its value ("learner.model.actor.0.weight holds nan"), or None: every tensor is finite. Plain numbers (counters,
    the episode window) are not the learner's state and are not looked at."""
    import torch

    if isinstance(payload, torch.Tensor):
        if payload.is_floating_point() or payload.is_complex():
            bad = ~torch.isfinite(payload)
            if bad.any():
                return f"{where or 'the payload'} holds {payload[bad].reshape(-1)[0].item()}"
        return None
    if isinstance(payload, dict):
        items = payload.items()
    elif isinstance(payload, (list, tuple)):
        items = enumerate(payload)
    else:
        return None
    for key, value in items:
        found = first_nonfinite(value, f"{where}.{key}" if where else str(key))
        if found:
            return found
    return None


def save(path: Path, payload: dict) -> Path:
    """Write ``payload`` atomically; a payload with a non-finite tensor is refused (``NonFiniteCheckpoint``, one line)
    and nothing is written: a run's checkpoints are always weights it can continue from."""
    import torch

    found = first_nonfinite(payload)
    if found is not None:
        raise NonFiniteCheckpoint(f"checkpoint {path} not written: {found}")
    # Serialized in memory, then written: torch's zip writer, writing into the file itself, turns a full disk into
    # its own RuntimeError (or, failing in its destructor, an abort of the process); a plain write of the bytes
    # raises the OSError that says what happened. The cost is one more copy of the payload in the driver's memory.
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return _write_atomic(path, lambda f: f.write(buffer.getbuffer()))


def write_text(path: Path, text: str) -> Path:
    """A small text file (config.yaml, run.json), atomically."""
    return _write_atomic(path, lambda f: f.write(text.encode()))


def load(path: Path) -> dict:
    """A checkpoint's payload, unpickled with ``weights_only`` (tensors and plain data: loading it runs nothing).
    Anything else (a truncated or foreign file, a pickle of other objects) is one CheckpointError line."""
    import torch

    allowed = "allowed: a checkpoint written by cluster.train (checkpoints/final.pt, ckpt-<iteration>.pt, best.pt)"
    try:
        with warnings.catch_warnings():  # torch's safe loader warns of a foreign file's pickle protocol: the one
            warnings.simplefilter("ignore")  # line below says all there is to say about such a file
            payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint") from None
    except pickle.UnpicklingError:
        raise CheckpointError(f"{path}: cannot be read as a checkpoint: it is damaged, or holds Python objects other "
                              f"than tensors and plain data, which a safe load refuses to build (unpickling them "
                              f"could run code); {allowed}") from None
    except Exception as e:  # noqa: BLE001 - truncated, corrupt or not a torch file: every one is the same refusal
        text = " ".join(str(e).split())[:200]
        raise CheckpointError(f"{path}: cannot be read as a checkpoint ({type(e).__name__}: {text}); {allowed}") \
            from None
    if not isinstance(payload, dict) or not isinstance(payload.get("learner"), dict):
        raise CheckpointError(f"{path}: is not a checkpoint (no learner state in it); {allowed}")
    if not isinstance(payload["learner"].get("model"), dict):
        raise CheckpointError(f"{path}: holds no model weights (learner.model is "
                              f"{type(payload['learner'].get('model')).__name__}); {allowed}")
    return payload


def config_of(path: Path, payload: dict) -> dict:
    """The config stored in a checkpoint ``load`` returned, as plain data: one CheckpointError line without one."""
    stored = payload.get("config")
    if not isinstance(stored, dict):
        raise CheckpointError(f"{path}: holds no config (config is {type(stored).__name__}), so its env and model are "
                              f"unknown; allowed: a checkpoint written by cluster.train, or your own config "
                              f"(config=... / --config)")
    return stored


def refuse_unfit(payload: dict, spec, what: str = "--resume") -> None:
    """CheckpointError (one line) if the checkpoint's model weights do not fit the model ``spec`` builds: a name
    missing or extra, or a shape that differs (``--set learner.hidden_sizes=...`` against a run trained with other
    sizes). Compared on the meta device: the model is built without memory, so the check costs the same for any
    size, and it runs before a learner starts, where the same mismatch would be a traceback in its actor."""
    import torch

    from learner.model import build_model

    with torch.device("meta"):
        wanted = {k: tuple(v.shape) for k, v in build_model(spec).state_dict().items()}
    held = {k: tuple(v.shape) for k, v in payload["learner"]["model"].items() if hasattr(v, "shape")}
    allowed = "allowed: the model settings the run was trained with (its config.yaml; leave them out of --set)"
    missing, extra = sorted(set(wanted) - set(held)), sorted(set(held) - set(wanted))
    if missing or extra:
        names = ", ".join([f"missing {k}" for k in missing[:2]] + [f"unexpected {k}" for k in extra[:2]])
        raise CheckpointError(f"{what}: the checkpoint's weights do not fit the model this config builds ({names}); "
                              f"{allowed}")
    for key, shape in wanted.items():
        if held[key] != shape:
            raise CheckpointError(f"{what}: the checkpoint's weights do not fit the model this config builds ({key} "
                                  f"is {list(held[key])} in the checkpoint, {list(shape)} in the model); {allowed}")


def new_run_id() -> str:
    return uuid.uuid4().hex


class RunFiles:
    """Every file of one run, by its place in the run directory, and the writing of the ones written whole.

    One directory holds one run (``claim``). The checkpoints, config.yaml and run.json are written here (temp file,
    fsync, rename; an OS error is one ``WriteFailed`` line); the metrics streams are ``cluster.metrics``' sinks,
    opened at the paths named here (``make_sinks``). A new file of a run is a path here and, if it is written whole,
    a method beside the others."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    @classmethod
    def of(cls, run_dir: "str | os.PathLike | RunFiles") -> "RunFiles":
        """``run_dir`` as a RunFiles (callers that hold only a path: ``cluster.tune``, the tests, the benches)."""
        return run_dir if isinstance(run_dir, RunFiles) else cls(run_dir)

    @classmethod
    def resolve(cls, cfg, run_dir: str | os.PathLike | None = None) -> "RunFiles":
        """``run_dir`` if given, else ``run.output_dir / (run.run_name or <env>-<timestamp>)``. The env part is the
        id without a ``module:`` prefix, with anything but letters, digits, ``.``, ``_`` and ``-`` replaced by
        ``-``: one flat directory that ``--resume``, ``cluster.control --run`` and TensorBoard's ``name:path``
        syntax all take. A default name already taken gets ``-2``, ``-3``, ..."""
        if run_dir is not None:
            return cls(run_dir)
        if cfg.run.run_name:
            return cls(Path(cfg.run.output_dir) / cfg.run.run_name)
        env = re.sub(r"[^A-Za-z0-9._-]+", "-", cfg.env.id.rpartition(":")[2]).strip("-") or "env"
        base = Path(cfg.run.output_dir) / f"{env}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
        path, n = base, 1
        while path.exists():
            n += 1
            path = base.with_name(f"{base.name}-{n}")
        return cls(path)

    # ------------------------------------------------------------------ where each file is
    name = property(lambda self: self.root.name)  # the run's name: its control actor's and placement group's
    run_json = property(lambda self: self.root / RUN_FILE)
    config = property(lambda self: self.root / "config.yaml")
    metrics = property(lambda self: self.root / "metrics.jsonl")
    events = property(lambda self: self.root)  # TensorBoard's log directory: the run directory itself
    mlruns = property(lambda self: self.root / "mlruns")  # MLflow's file store, when no tracking URI is set
    profile = property(lambda self: self.root / "profile")  # --profile N: the learners' torch profiler traces
    checkpoints = property(lambda self: self.root / "checkpoints")
    final = property(lambda self: self.checkpoints / "final.pt")
    best = property(lambda self: self.checkpoints / "best.pt")
    summary = property(lambda self: self.root / "summary.txt")  # cluster.report's table of the run
    report_png = property(lambda self: self.root / "report.png")  # cluster.report's plot of the run
    pbt_log = property(lambda self: self.root / "pbt.jsonl")  # cluster.tune: where a trial's state came from

    def periodic(self) -> list[Path]:
        """This directory's periodic checkpoints, oldest first."""
        return periodic(self.checkpoints)

    # ------------------------------------------------------------------ writing
    def claim(self, run_id: str, continues_legacy: bool = False) -> None:
        """Make the directory (``WriteFailed`` if it cannot be) and run ``run_id``'s, or refuse (ConfigError, one
        line) if it holds another run: a run whose run.json names another id, or, without run.json, a run from
        before run ids (``continues_legacy``: the run resumed from such a checkpoint, which may continue in its own
        directory). Removes the temp files a SIGKILL in the middle of a save left behind: nothing else writes into
        the directory before its owner starts."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise WriteFailed(describe_write_error(self.root, e)) from None
        owner = self.refuse_foreign(run_id, continues_legacy)
        ours = tuple(f".{path.name}." for path in (self.final, self.best, self.config, self.run_json)) + (".ckpt-",)
        for directory in (self.root, self.checkpoints):
            for temp in directory.glob(".*.*"):
                if temp.is_file() and temp.name.startswith(ours):
                    temp.unlink(missing_ok=True)
        if owner != run_id:
            write_text(self.run_json, json.dumps({"run_id": run_id}) + "\n")

    def write_config(self, text: str) -> Path:
        return write_text(self.config, text)

    def save_periodic(self, iteration: int, payload: dict, keep: int) -> Path:
        """ckpt-<iteration>.pt, then all but the newest ``keep`` periodic checkpoints removed (``prune``)."""
        path = save(self.checkpoints / f"ckpt-{iteration:08d}.pt", payload)
        prune(self.checkpoints, keep)
        return path

    def save_final(self, payload: dict) -> Path:
        return save(self.final, payload)

    def save_best(self, payload: dict) -> Path:
        return save(self.best, payload)

    # ------------------------------------------------------------------ reading
    def run_id(self) -> str | None:
        """The id of the run that owns the directory (its run.json), None where there is none."""
        path = self.run_json
        try:
            run_id = json.loads(path.read_text())["run_id"]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path}: cannot be read ({type(e).__name__}); it names the run that owns the "
                                  f"directory: restore it, or pick another run directory") from None
        if not isinstance(run_id, str) or not run_id:
            raise CheckpointError(f"{path}: run_id {run_id!r} is not a run id")
        return run_id

    def refuse_foreign(self, run_id: str | None, continues_legacy: bool = False) -> str | None:
        """ConfigError (one line) if the directory holds the output of a run other than ``run_id`` (None: a new
        run, for which any run is another); else the id run.json names (None: none)."""
        owner = self.run_id()
        # What makes a directory hold a run is its output: a run that wrote none (it failed at start-up) leaves
        # nothing to mix, and its name may be used again at once.
        has_output = any(path.exists() for path in (self.final, self.best, self.metrics)) or bool(self.periodic())
        if owner is None:
            foreign = has_output and not continues_legacy
        else:
            foreign = has_output and owner != run_id
        if foreign:
            raise ConfigError(f"run directory {str(self.root)!r} holds another run ({self._describe()}); a new run "
                              f"never writes over another run's checkpoints; allowed: --resume {self.root} to "
                              f"continue it, or another run.run_name or --run-dir")
        return owner

    def refuse_unwritable(self) -> None:
        """ConfigError (one line) if the directory cannot be made or written by this process: a path through a
        file, a read-only filesystem, a directory without write permission. Checked before anything starts
        (``--dry-run`` included) without making anything: the nearest existing directory on the way is what is
        asked."""
        probe = self.root
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        allowed = "allowed: a directory this user can create and write (--run-dir, run.output_dir)"
        if not probe.is_dir():
            raise ConfigError(f"run directory {str(self.root)!r}: {str(probe)!r} is a file, not a directory; {allowed}")
        if not os.access(probe, os.W_OK | os.X_OK):  # EROFS for a read-only filesystem, even for root
            how = "on a read-only filesystem" if _read_only(probe) else "not writable by this user"
            raise ConfigError(f"run directory {str(self.root)!r}: {str(probe)!r} is {how}; {allowed}")

    def _describe(self) -> str:
        names = [p.name for p in self.periodic()] + [p.name for p in (self.final, self.best) if p.is_file()]
        return f"checkpoints {', '.join(names[-3:])}" if names else "its metrics.jsonl"

    def latest(self, run_id: str | None = None) -> Path | None:
        """``latest_loaded``'s path."""
        found = self.latest_loaded(run_id)
        return None if found is None else found[0]

    def latest_loaded(self, run_id: str | None = None) -> tuple[Path, dict] | None:
        """(path, payload) of the checkpoint of the most training of the directory's own run (``run_id``, else its
        run.json's): what ``--resume``, ``load_policy(run_dir)`` and ``cluster.evaluate`` take; the one of the
        highest iteration, final.pt on a tie. A checkpoint of another run (copied in by hand) is passed over.

        Not simply final.pt first: ``--resume`` reuses the run directory, so while a resumed run goes, the previous
        run's final.pt is older than the ckpt-*.pt files the resumed run writes. A periodic checkpoint's name carries
        its iteration; final.pt's is read from its payload. Not mtimes, which a copied run directory does not keep.
        """
        want = run_id or self.run_id()
        loaded: dict[Path, dict] = {}
        ranked = [(int(_PERIODIC.fullmatch(p.name).group(1)), 0, p) for p in self.periodic()]
        final = self.final
        if final.is_file():
            loaded[final] = load(final)
            ranked.append((loaded[final].get("run_state", {}).get("iteration", -1), 1, final))  # -1: hand-made
        for _, _, path in sorted(ranked, reverse=True):
            payload = loaded.get(path) or load(path)  # each read once: the caller gets the payload it was judged by
            if want is None or payload.get("run_id") in (want, None):  # None: written before run ids, here
                return path, payload
        return None


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def periodic(directory: Path) -> list[Path]:
    """Periodic checkpoints, oldest first (names sort by iteration)."""
    return sorted(p for p in Path(directory).glob("ckpt-*.pt") if _PERIODIC.fullmatch(p.name))


def prune(directory: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` periodic checkpoints. Every checkpoint ``save`` wrote is finite, and pruning
    runs only after a save succeeded, so the ones kept are the newest finite ones."""
    for old in periodic(directory)[:-keep]:
        old.unlink(missing_ok=True)


# A directory given by path (load_policy): its RunFiles' answer.
def latest(run_dir: Path, run_id: str | None = None) -> Path | None:
    return RunFiles(run_dir).latest(run_id)
