import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def _ray_session():
    import ray

    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def ray_local(_ray_session):
    """A real local Ray shared by the tests that need one (start-up is seconds, not free).

    Re-started if a test that needs its own cluster (the multi-node placement test) shut it down.
    """
    import ray

    if not ray.is_initialized():
        # Logical CPUs beyond the machine's 2 so multi-actor graphs can be placed; token auth stays on.
        ray.init(address="local", num_cpus=8, include_dashboard=False, namespace="ascent_rl_tests", log_to_driver=False)
    return ray


def alive_actor_names(ray_mod) -> list[str]:
    """Class names of actors the GCS still reports alive (no dashboard needed)."""
    from ray._private import state

    return [a["ActorClassName"] for a in state.actors().values() if a["State"] == "ALIVE"]


@pytest.fixture
def no_leftover_actors(ray_local):
    """Asserts a test's actors are all gone when it ends."""
    yield
    import time

    deadline = time.monotonic() + 10
    while alive_actor_names(ray_local) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive_actor_names(ray_local) == []


def train_to_end(cfg, run_dir, resume=None):
    """Build, run and tear down a real actor graph; returns the driver's RunResult."""
    from cluster.driver import Trainer

    trainer = Trainer(cfg, run_dir, quiet=True, resume=resume)
    try:
        trainer.build()
        return trainer.run()
    finally:
        trainer.shutdown()


def build_and_run_striking(trainer, strike=None, join_s: float = 60.0):
    """``trainer.build()`` and ``trainer.run()``, with ``strike(trainer)`` on a thread meanwhile (joined within
    ``join_s``); returns the RunResult. The caller reads what it needs, then shuts the trainer down."""
    import threading

    trainer.build()
    striker = threading.Thread(target=strike, args=(trainer,), daemon=True) if strike else None
    if striker:
        striker.start()
    result = trainer.run()
    if striker:
        striker.join(timeout=join_s)
    return result


def train_while_rescaling(cfg, run_dir, steps):
    """Train while another thread does what a user does from a second shell: ``python -m cluster.control --run
    NAME --rollout-actors N``, once per (after_records, N) in ``steps``, each sent once the run has written that
    many metrics records (on the run's progress, not after a delay a loaded or a fast machine would outrun).
    Returns (RunResult, the commands' exit codes, in order; fewer if the run ended first)."""
    import threading
    import time

    from cluster import control
    from cluster.driver import Trainer

    trainer = Trainer(cfg, run_dir, quiet=True)
    calls: list = []
    done = threading.Event()
    metrics = run_dir / "metrics.jsonl"

    def operator():
        for after_records, n in steps:
            while not (metrics.exists() and len(metrics.read_text().splitlines()) >= after_records):
                if done.is_set():
                    return
                time.sleep(0.05)
            calls.append(control.main(["--run", run_dir.name, "--rollout-actors", str(n)]))

    try:
        trainer.build()
        t = threading.Thread(target=operator, daemon=True)
        t.start()
        result = trainer.run()
        done.set()
        t.join()
    finally:
        done.set()
        trainer.shutdown()
    return result, calls


def wait_for_records(run_dir, n: int, timeout_s: float = 120.0) -> None:
    """Until the run has written ``n`` iteration records: faults strike on the run's progress, not after a sleep
    that a faster (or slower) host would outrun."""
    import time

    path = Path(run_dir) / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach iteration {n} within {timeout_s:.0f} s")


def records_so_far(run_dir) -> list[dict]:
    """The run's metrics records written so far, read while it runs: only whole lines (the one being written may
    be cut off at the read)."""
    import json

    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line]


def wait_for_count(run_dir, key: str, timeout_s: float = 90.0) -> None:
    """Until some record of the run has a nonzero ``key`` (e.g. a restart counter): the next strike waits for the
    previous fault to have been handled, not for a delay."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not any(r[key] for r in records_so_far(run_dir)):
        time.sleep(0.05)


def kill_all(pids) -> None:
    """SIGKILL each process still there (the SIGSTOPped ones a test or bench left, whether or not the run killed
    them already)."""
    import signal

    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def session_processes(sid: int) -> list[str]:
    """The command lines of the live processes of session ``sid``."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: the session id
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out.append(f.read().replace(b"\0", b" ").decode(errors="replace")[:100])
        except (OSError, IndexError, ValueError):
            continue
    return out


def assert_session_ends(sid: int, timeout_s: float = 10.0) -> None:
    """Every process of session ``sid`` (a CLI started with ``start_new_session``, and all it started: Ray's) is
    gone within ``timeout_s`` of its exit."""
    import time

    deadline = time.monotonic() + timeout_s
    while (left := session_processes(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left running after the exit: {left}"


os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")


def vector_spec(shape, action_kind="discrete", action_dim=2, hidden_sizes=(64, 64), dtype="float32"):
    """The model spec of a Box env with observations of ``shape``: one ``vector`` modality (not normalised)."""
    from learner.spec import ModalityInput, PolicySpec

    mod = ModalityInput("vector", "vector", tuple(shape), dtype, normalize=False)
    return PolicySpec((mod,), action_kind, action_dim, hidden_sizes=hidden_sizes)


def env_spec(env_id, max_episode_steps=None, hidden_sizes=(64, 64), modalities=None):
    """The model spec the driver would build for ``env_id`` (``modalities``: env.modalities of a Dict env)."""
    from actors.envs import describe_env
    from learner.spec import spec_from_description

    return spec_from_description(describe_env(env_id, modalities, max_episode_steps), hidden_sizes)


# The modules whose tests take longest (a minute for the job submission, 30-60 s for the Tune and fault runs),
# collected first: pytest-xdist hands tests out in collection order, so the long ones start early and neither
# worker is left running one alone at the end. (Measured: 12:00 before, 12:17 after, within the machine's noise
# between runs; kept because a long test collected last can only lengthen the run.)
LONGEST_FIRST = ("test_job_submit.py", "test_tune.py", "test_faults.py", "test_env_faults.py", "test_layouts.py",
                 "test_recurrent.py", "test_autoscale.py", "test_multiagent.py", "test_run_files.py",
                 "test_deadlines.py")


def pytest_collection_modifyitems(config, items):
    """``long`` tests are left out unless the -m expression names them: ``make test``, a plain ``pytest`` and
    ``make test-fast`` (``-m "not slow"``) skip them; ``pytest -m long`` (``make test-long``) runs only them, and
    ``-m "long or not long"`` everything. The LONGEST_FIRST modules go first (a stable sort: each keeps its order)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    _group_for_xdist(config, items)
    if "long" in (config.getoption("markexpr", "") or ""):
        return  # -m decides
    long_items = [item for item in items if item.get_closest_marker("long") is not None]
    if long_items:
        config.hook.pytest_deselected(items=long_items)
        items[:] = [item for item in items if item.get_closest_marker("long") is None]


def _group_for_xdist(config, items) -> None:
    """``--dist loadgroup`` keeps an ``xdist_group``'s tests on one worker by the ``@group`` suffix of their node ids,
    which pytest-xdist 3.8 writes to ``item._nodeid``: pytest 9 reads ids from ``item._id``, so the suffix was lost
    and the multi-node tests' group was split over both workers (two cluster starts of 10-15 s, not one). Written
    here the way pytest 9 keeps it; where xdist's own suffix took (an older pytest), nothing is left to do."""
    if not getattr(config.option, "loadgroup", False):
        return
    try:
        from _pytest.nodeid import coerce_node_id
    except ImportError:  # before pytest 9: xdist's suffix works
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid.rpartition("]")[2] and hasattr(item, "_id"):
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")
