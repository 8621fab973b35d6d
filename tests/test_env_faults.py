"""Faults past SIGKILL, on a real local Ray and in process: envs that raise, hang or leak, stopped processes
(SIGSTOP), a learner whose update raises, and scaling past the free CPUs (SIGTERM to the driver of a stuck run is
test_layouts', with the other stuck runs).

Every fault is injected on a condition (the run's own progress), never after a fixed sleep, and every run has a
deadline of its own (the faults must not hang it).
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import ray as _ray

from cluster import checkpoint
from cluster import config as config_mod
from cluster.driver import Trainer
from pipeline import runtime
from tests.conftest import (ROOT, build_and_run_striking, kill_all, records_so_far, train_to_end, wait_for_count,
                            wait_for_records)
from tests.faulty_env import FAULTY_ID

FAULTY = f"tests.faulty_env:{FAULTY_ID}"


def cfg_for(*extra):
    return config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "rollout.num_actors=2", "rollout.envs_per_actor=8", "replay.num_shards=2", "run.require_target=false",
        "run.target_return=null", "run.checkpoint_interval_s=null", "run.total_env_steps=20480",
        "run.stall_timeout_s=60", *extra])


def faulty(fault, token=None, at_step=100, *extra):
    kwargs = [f"env.id={FAULTY}", f"env.kwargs.fault={fault}", f"env.kwargs.at_step={at_step}"]
    if token is not None:
        kwargs.append(f"env.kwargs.token={token}")
    return cfg_for(*kwargs, *extra)


def records_of(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def pid_of(handle) -> int:
    return _ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=30)


def test_an_env_that_raises_once_is_replaced_counted_and_named(tmp_path):
    # In process: the replacement logic is the supervisor's, the same in both modes (a crashed process is
    # test_faults.py's SIGKILL); no Ray start-up to pay.
    trainer = Trainer(faulty("raise", tmp_path / "token", 300, "ray.address=inprocess"), tmp_path / "run", quiet=True)
    try:
        trainer.build()
        result = trainer.run()
        # The supervisor's records are the graph's slots (a shard's its own): one per index, on the same handle;
        # each slot's incarnation is the one its actor runs as. The replaced actor's slot is its successor's, which
        # has produced since (so no repeat count is left).
        watched = trainer.supervisor
        assert watched.rollouts.members is trainer.graph.slots
        for records, handles in ((watched.rollouts.members, trainer.rollouts),
                                 (watched.shards.members, trainer.shards)):
            assert sorted(records) == list(range(len(handles)))
            assert all(records[i].handle is h for i, h in enumerate(handles))
        incarnations = {i: m.incarnation for i, m in watched.rollouts.members.items()}
        running = {i: st["incarnation"] for i, st in enumerate(runtime.get([a.stats.remote() for a in trainer.rollouts],
                                                                            timeout=30))}
        assert incarnations == running and sorted(incarnations.values()) == [0, 1], (incarnations, running)
        assert trainer.state.env_steps == trainer.state.env_steps_retired + sum(
            m.steps for m in watched.rollouts.members.values())
        assert all(m.produced and m.repeats == ("", 0) and m.starting is None
                   for m in watched.rollouts.members.values())
    finally:
        trainer.shutdown()
    assert result.reason == "total_env_steps"
    last = records_of(tmp_path / "run")[-1]
    assert last["env_failures"] == 1 and last["rollout_restarts"] == 1 and last["rollout_hangs"] == 0
    assert "simulated simulator crash at step 300" in last["last_rollout_fault"]
    assert last["rollout_actors"] == 2
    assert last["fragments_dropped_stale"] == 0


def test_an_env_that_hangs_once_loses_its_ticket_and_its_actor(tmp_path):
    """One actor of two hangs inside step(): its ticket's lease runs out, the other actor makes that fragment, and
    the hung actor (alive, answering its health call) is replaced for making no env step. In process, where the
    hung thread cannot even be killed: it is left behind and the run goes on without it."""
    t0 = time.monotonic()
    # Long enough that the healthy actor alone cannot finish before the hang outlasts its 3 s lease.
    result = train_to_end(faulty("hang", tmp_path / "token", 300, "rollout.fragment_timeout_s=3",
                                 "run.total_env_steps=61440", "ray.address=inprocess"), tmp_path / "run")
    assert result.reason == "total_env_steps"
    last = records_of(tmp_path / "run")[-1]
    assert last["rollout_hangs"] == 1 and last["env_failures"] == 0 and last["rollout_restarts"] == 1
    assert "made no env step" in last["last_rollout_fault"]
    assert last["fragments_lost"] >= 1  # its ticket was given back (by the lease, or when it was replaced)
    assert time.monotonic() - t0 < 120, "the hang held the run for longer than its lease should allow"


def test_a_stopped_rollout_actor_and_a_stopped_replay_shard_are_replaced(ray_local, tmp_path):
    """SIGSTOP: the process answers nothing at all. A rollout actor and a replay shard at once, at iteration 3 (one
    actor graph start, not two; their deadlines run side by side):
    - the actor, silent on the board, gets a health call, which goes unanswered for a lease;
    - the shard's adds and takes hang, and its health call, one of a round robin the driver never waits on, goes
      unanswered for min(30 s, run.stall_timeout_s / 3) = 5 s, and it is replaced."""
    # Long enough to outlast 3 s of silence + a lease, and the shard's 5 s.
    cfg = cfg_for("run.total_env_steps=61440", "rollout.fragment_timeout_s=3", "run.stall_timeout_s=15")
    run_dir = tmp_path / "run"
    trainer = Trainer(cfg, run_dir, quiet=True)
    lines: list = []
    trainer.supervisor.say = lines.append
    stopped: list = []

    def stop_when_training():
        wait_for_records(run_dir, 3)
        for pid in (pid_of(trainer.shards[1]), pid_of(trainer.rollouts[1])):
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)

    try:
        trainer.build()
        striker = threading.Thread(target=stop_when_training, daemon=True)
        striker.start()
        result = trainer.run()
        striker.join(timeout=30)
    finally:
        trainer.shutdown()
        kill_all(stopped)
    assert len(stopped) == 2, "the test never stopped its targets"
    assert result.reason == "total_env_steps", trainer.failure
    last = records_of(run_dir)[-1]
    assert last["rollout_hangs"] == 1 and last["rollout_restarts"] == 1
    assert "did not answer its health call" in last["last_rollout_fault"]
    assert last["shard_restarts"] == 1
    assert any(line.startswith("replay shard 1 did not answer for 5 s") for line in lines), lines


@contextlib.contextmanager
def cpu_hogs(n: int = 2):
    """``n`` busy loops beside the run, each a process of its own (a loaded host: the run's processes share the
    cores with them, and the load average is theirs too), killed however the test ends. At nice 10: the other
    pytest worker shares this host, and busy loops at the run's own priority made its timed tests (a learner
    group's restart within 180 s) take 197-279 s; the run under test still never has a core to itself."""
    hogs = [subprocess.Popen([sys.executable, "-c", "import os; os.nice(10)\nwhile True: pass"]) for _ in range(n)]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(timeout=10)


def cartpole_to_target(*extra):
    """The default CartPole config with two rollout actors, to a return the run reaches within about 40k env steps.
    The lease is 15 s, longer than a claim's waits (CLAIM_WAIT_S, then CLAIM_PART_WAITS more: 10 s): while one
    actor holds the next update's ticket, the board answers the feed's claim with nothing at least once (the auto
    lease's 10 s floor does so only when the claim came first)."""
    return config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "rollout.num_actors=2", "run.stall_timeout_s=30", "rollout.fragment_timeout_s=15", "run.target_return=200",
        "run.total_env_steps=300000", "run.checkpoint_interval_s=null", *extra])


def assert_replaced_once_and_on_target(result, trainer, run_dir, fault: str) -> None:
    assert result.reason == "target_reached", trainer.failure  # not "learner 0 failed: ... device feed stopped"
    assert trainer.failure is None
    last = records_of(run_dir)[-1]
    assert last["rollout_hangs"] == 1 and last["rollout_restarts"] == 1 and last["env_failures"] == 0
    assert fault in last["last_rollout_fault"]
    assert last["rollout_actors"] == 2


@pytest.mark.long  # a run to a return beside two busy loops: `make test-long`, within make test's 8 minutes
def test_an_env_hung_in_one_of_two_actors_on_a_loaded_host_is_replaced_and_the_run_reaches_its_target(
        ray_local, tmp_path):
    """One env of one actor blocks in step() for good, with the host loaded. The feed's claim for the update whose
    ticket the hung actor holds is answered with nothing (no fragment of it stored within the claim's waits); the
    feed claims again until the lease gives the ticket to the other actor, and the hung actor is replaced."""
    run_dir = tmp_path / "run"
    cfg = cartpole_to_target(f"env.id={FAULTY}", "env.kwargs.fault=hang", "env.kwargs.at_step=300",
                             f"env.kwargs.token={tmp_path / 'token'}")
    with cpu_hogs():
        trainer = Trainer(cfg, run_dir, quiet=True)
        try:
            result = build_and_run_striking(trainer)
        finally:
            trainer.shutdown()
    assert (tmp_path / "token").exists(), "no env hung"
    assert_replaced_once_and_on_target(result, trainer, run_dir, "made no env step")


@pytest.mark.long  # as above
def test_a_stopped_rollout_actor_on_a_loaded_host_is_replaced_and_the_run_reaches_its_target(ray_local, tmp_path):
    """SIGSTOP of one rollout actor of two, with the host loaded: the tickets it holds come back by their lease
    (the feed's claims meanwhile answered with nothing), and it is replaced for leaving its health call
    unanswered."""
    run_dir = tmp_path / "run"
    stopped: list = []

    def stop_when_training(trainer):
        wait_for_records(run_dir, 3)
        pid = pid_of(trainer.rollouts[1])
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    with cpu_hogs():
        trainer = Trainer(cartpole_to_target(), run_dir, quiet=True)
        try:
            result = build_and_run_striking(trainer, stop_when_training)
        finally:
            trainer.shutdown()
            kill_all(stopped)
    assert stopped, "the test never stopped its target"
    assert_replaced_once_and_on_target(result, trainer, run_dir, "did not answer its health call")


def test_a_leaking_env_is_killed_at_its_memory_limit_and_the_fault_budget_ends_the_run(ray_local, tmp_path):
    # 8 envs x 1 MiB a step: one 128-step fragment grows the process by 1 GiB, over the limit.
    cfg = faulty("leak", None, 0, "env.kwargs.leak_mb_per_step=1", "rollout.memory_limit_mb=1000",
                 "rollout.max_env_failures=1", "run.total_env_steps=500000", "rollout.num_actors=1",
                 "replay.num_shards=1")
    t0 = time.monotonic()
    result = train_to_end(cfg, tmp_path / "run")
    assert result.reason == "failed" and time.monotonic() - t0 < 120
    last = records_of(tmp_path / "run")[-1] if (tmp_path / "run" / "metrics.jsonl").exists() else None
    assert result.checkpoint_path is not None and result.checkpoint_path.is_file()
    ck = checkpoint.load(result.checkpoint_path)
    assert ck["run_state"]["rollout_memory_kills"] == 2 and ck["run_state"]["rollout_restarts"] == 2
    if last is not None:
        assert last["rollout_memory_kills"] >= 1


def test_fresh_actors_failing_the_same_way_end_the_run_with_one_line(tmp_path):
    """An env that raises at every actor's first steps is a bug, not a transient: three fresh actors in a row fail
    before a single fragment, and the run ends (final.pt kept) instead of replacing actors forever. (On Ray too:
    test_multimodal_pipeline.py's bad observation.)"""
    cfg = faulty("raise", None, 5, "rollout.num_actors=1", "replay.num_shards=1", "ray.address=inprocess")
    result = train_to_end(cfg, tmp_path / "run")
    assert result.reason == "failed"
    ck = checkpoint.load(result.checkpoint_path)
    assert ck["run_state"]["env_failures"] == 3


def test_the_fault_budget_ends_the_run_in_process(tmp_path):
    cfg = faulty("raise", tmp_path / "token", 300, "rollout.max_env_failures=0", "ray.address=inprocess",
                 "run.total_env_steps=500000")
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    try:
        trainer.build()
        result = trainer.run()
    finally:
        trainer.shutdown()
    assert result.reason == "failed"
    assert "simulated simulator crash at step 300" in trainer.failure
    assert "over rollout.max_env_failures = 0" in trainer.failure
    assert "\n" not in trainer.failure


def test_a_learner_whose_update_raises_ends_the_run_with_a_final_checkpoint(tmp_path):
    """Not a death (a device out of memory, a bug in the update): restarting would fail the same way."""
    cfg = cfg_for("run.total_env_steps=500000", "run.checkpoint_interval_s=0.5", "ray.address=inprocess")
    run_dir = tmp_path / "run"
    trainer = Trainer(cfg, run_dir, quiet=True)

    def break_the_update():
        wait_for_records(run_dir, 3)

        def install(actor):
            def update(*args, **kwargs):
                raise MemoryError("simulated device out of memory in the update")
            actor.learner.update = update

        runtime.get(trainer.learners[0].__ray_call__.remote(install), timeout=30)

    try:
        trainer.build()
        striker = threading.Thread(target=break_the_update, daemon=True)
        striker.start()
        result = trainer.run()
    finally:
        trainer.shutdown()
    assert result.reason == "failed"
    assert trainer.failure.startswith("learner 0 failed: MemoryError: simulated device out of memory")
    assert result.checkpoint_path is not None and result.checkpoint_path.name == "final.pt"
    assert checkpoint.load(result.checkpoint_path)["stop_reason"] == "failed"


# `make test-long` (CI runs it): make test's test_deadlines.py case scales past the free CPUs the same way and
# checks the same refusal, with the control actor stopped on top.
@pytest.mark.long
def test_scaling_past_the_free_cpus_adds_what_fits_and_refuses_the_rest(ray_local, tmp_path):
    @_ray.remote
    class Hog:
        def ping(self):
            return True

    run_dir = tmp_path / "run"
    cfg = cfg_for("run.total_env_steps=40960", "rollout.num_actors=1", "replay.num_shards=1")
    trainer = Trainer(cfg, run_dir, quiet=True)
    hog = None
    lines: list = []
    trainer.supervisor.say = lines.append
    try:
        trainer.build()
        # Leave exactly one CPU free, then ask for 3 more actors.
        free = _ray.available_resources().get("CPU", 0)
        if free > 1:
            hog = Hog.options(num_cpus=free - 1).remote()
            _ray.get(hog.ping.remote(), timeout=60)
        assert trainer.control is not None
        _ray.get(trainer.control.set_rollout_actors.remote(4), timeout=30)
        result = trainer.run()
    finally:
        trainer.shutdown()
        if hog is not None:
            _ray.kill(hog)
    assert result.reason == "total_env_steps"
    refusals = [line for line in lines if "only 1 more fit the free resources" in line]
    assert len(refusals) == 1, lines
    assert "4 asked" in refusals[0] and "running 2" in refusals[0] and "'CPU'" in refusals[0]
    assert records_of(run_dir)[-1]["rollout_actors"] == 2


class RecordingTrainer(Trainer):
    """The real driver, keeping the ticket ids every learner iteration trained on (what "nothing trained twice"
    is checked against)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained: list[list[int]] = []

    def _account(self, results, sinks, progress):
        self.trained.append([tid for res in results for tid in res["ticket_ids"]])
        return super()._account(results, sinks, progress)


def train_struck(cfg, run_dir, after_records: int, role: str, sig, index=None, trainer_class=Trainer):
    """Train ``cfg`` while ``sig`` strikes ``trainer.<role>[index]`` once the run has ``after_records`` records (see
    strike_when). Returns (trainer, RunResult, the pids struck, the supervisor's lines, seconds the run took); a
    stopped process is SIGKILLed at the end, whether or not the run killed it. ``trainer_class``: e.g.
    RecordingTrainer, to check what every update trained on."""
    trainer = trainer_class(cfg, run_dir, quiet=True)
    lines: list = []
    trainer.supervisor.say = lines.append
    try:
        trainer.build()
        striker, struck = strike_when(trainer, run_dir, after_records, role, sig, index=index)
        t0 = time.monotonic()
        result = trainer.run()
        seconds = time.monotonic() - t0
        striker.join(timeout=30)
    finally:
        trainer.shutdown()
        if sig == signal.SIGSTOP:
            kill_all(struck)
    return trainer, result, struck, lines, seconds


def multiagent_run_with_a_killed_actor(env: dict, run_dir) -> list[dict]:
    """A small multi-agent run on Ray (``env``: its env and multiagent sections; 2 rollout actors, 2 shards) whose
    rollout actor 0 is SIGKILLed at the third record: it must be replaced, every update must train exactly its
    fragments and none twice, and the run must end on its env-step budget. Returns the records."""
    from cluster import config as config_mod

    cfg = config_mod.from_dict({
        **env, "rollout": {"num_actors": 2, "envs_per_actor": 8, "fragment_length": 32}, "replay": {"num_shards": 2},
        "learner": {"batch_size": 512, "minibatch_size": 128, "hidden_sizes": [32, 32]},
        "run": {"total_env_steps": 8192, "checkpoint_interval_s": None}})
    trainer, result, struck, _, _ = train_struck(cfg, run_dir, 3, "rollouts", signal.SIGKILL, index=0,
                                                 trainer_class=RecordingTrainer)
    assert struck, "the test never killed the rollout actor"
    assert result.reason == "total_env_steps", trainer.failure
    records = records_of(run_dir)
    assert records[-1]["rollout_restarts"] == 1 and records[-1]["rollout_actors"] == 2
    assert records[-1]["fragments_dropped_stale"] == 0
    assert all(len(ids) == cfg.fragments_per_update for ids in trainer.trained)
    flat = [tid for ids in trainer.trained for tid in ids]
    assert len(flat) == len(set(flat)), "a fragment was trained twice"
    return records


def strike_when(trainer, run_dir, after_records: int, role: str, sig, index=None, seen=None) -> tuple[threading.Thread, list]:
    """Send ``sig`` to ``trainer.<role>`` (``[index]``) once the run has ``after_records`` records. ``seen``: a
    list that gets the run's records as they were just after the signal."""
    done: list = []

    def run():
        wait_for_records(run_dir, after_records)
        handle = getattr(trainer, role)
        pid = pid_of(handle if index is None else handle[index])
        os.kill(pid, sig)
        done.append(pid)
        if seen is not None:
            seen.extend(records_so_far(run_dir))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done


# Two learners: `make test-long` (CI runs it), to keep `make test` under its 8 minutes.
@pytest.mark.parametrize("learners", [1, pytest.param(2, marks=pytest.mark.long)])
def test_a_lost_supply_board_is_replaced_and_nothing_is_trained_twice(ray_local, tmp_path, learners):
    """Two losses in one run (one actor graph start, not two): the board is SIGKILLed at iteration 4, and its
    replacement SIGSTOPped (it answers nothing: a hung board) three iterations after the first replacement. With
    two learners the group claims as one: rank 0 starts the update over on the new board, and rank 1 drops the
    parts it had from the old one. run.board_memory_limit_mb is below a fresh board's size here: one warning for
    the run, and no board is replaced for it."""
    cfg = cfg_for("run.total_env_steps=40960", "run.stall_timeout_s=30", f"learner.num_learners={learners}",
                  "run.board_memory_limit_mb=1")
    run_dir = tmp_path / "run"
    trainer = RecordingTrainer(cfg, run_dir, quiet=True)
    lines: list = []
    trainer.supervisor.say = lines.append
    struck, held = [], []

    def strike_board(sig):
        """Once the ledger has stored fragments of the update after the one being prepared (no learner claims those
        for another ~100 ms, and none can once the board is stopped): stop it, then kill it or leave it stopped.
        Those fragments sit confirmed in their shards, where only the board's replacement can void them."""
        pid = pid_of(trainer.board)
        deadline = time.monotonic() + 60
        stored = 0
        while time.monotonic() < deadline and not stored:
            board = trainer.board
            nxt = _ray.get(board.stats.remote(), timeout=30)["published"] + 1
            stored = _ray.get(board.describe.remote(nxt), timeout=30)["stored"]["count"]
            if not stored:
                time.sleep(0.005)
        os.kill(pid, signal.SIGSTOP)
        held.append(stored)
        if sig == signal.SIGKILL:
            os.kill(pid, signal.SIGKILL)
        struck.append(pid)

    def strike():
        wait_for_records(run_dir, 4)
        strike_board(signal.SIGKILL)
        wait_for_count(run_dir, "board_restarts")
        wait_for_records(run_dir, len(records_so_far(run_dir)) + 3)
        strike_board(signal.SIGSTOP)

    try:
        trainer.build()
        striker = threading.Thread(target=strike, daemon=True)
        striker.start()
        t0 = time.monotonic()
        result = trainer.run()
        striker.join(timeout=30)
        # What the shards hold now was all ticketed by the third board (the dead boards' copies were dropped).
        left = _ray.get([s.__ray_call__.remote(lambda self: [t.id for t in self.store._items])
                         for s in trainer.shards], timeout=30)
    finally:
        trainer.shutdown()
        kill_all(struck)
    assert len(struck) == 2 and min(held) >= 1, "the test never struck the board while the shards held fragments"
    assert all(tid >= 2 << 40 for ids in left for tid in ids), left
    assert result.reason == "total_env_steps", trainer.failure
    assert time.monotonic() - t0 < 150
    last = records_of(run_dir)[-1]
    assert last["board_restarts"] == 2 and last["board_memory_replacements"] == 0
    warned = [line for line in lines if "run.board_memory_limit_mb" in line]
    assert len(warned) == 1 and "not enforced" in warned[0], warned
    assert last["board_voided"] >= sum(held)  # what the shards held is voided and counted (made again)
    replaced = [line for line in lines if line.startswith("the supply board")]
    assert len(replaced) == 2, lines
    assert "replaced (restart 1)" in replaced[0] and "replaced (restart 2)" in replaced[1], lines
    assert "did not answer" in replaced[1] and "did not answer" not in replaced[0], replaced
    # Every update trained exactly its batch, and no fragment twice (ticket ids are unique across boards).
    per_update = cfg.fragments_per_update
    assert all(len(ids) == per_update for ids in trainer.trained)
    flat = [tid for ids in trainer.trained for tid in ids]
    assert len(flat) == len(set(flat)), "a fragment was trained twice"
    assert any((1 << 40) <= tid < (2 << 40) for tid in flat), "nothing was trained from the second board's tickets"
    assert any(tid >= 2 << 40 for tid in flat), "nothing was trained from the third board's tickets"
    versions = [r["policy_version"] for r in records_of(run_dir)]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)


@pytest.mark.long  # a second board-replacement run beside the one above: `make test-long`, within make test's 8 minutes
def test_a_supply_board_past_its_memory_limit_is_replaced_once_and_the_run_goes_on(ray_local, tmp_path):
    """run.board_memory_limit_mb: once the board's process holds 256 MiB more (ballast put into it at the third
    record, as memory Ray keeps per call would be), it is past the limit and replaced, once: the new board is
    under it again. The records carry the board's RSS; nothing is trained twice."""
    cfg = cfg_for("run.total_env_steps=40960", "run.board_memory_limit_mb=320")
    run_dir = tmp_path / "run"
    trainer = RecordingTrainer(cfg, run_dir, quiet=True)
    lines: list = []
    trainer.supervisor.say = lines.append
    grown: list = []

    def grow():
        wait_for_records(run_dir, 3)
        board = trainer.board
        grown.append(_ray.get(board.__ray_call__.remote(
            lambda self: setattr(self, "ballast", b"x" * (256 << 20)) or runtime.process_rss_mb()), timeout=30))

    try:
        trainer.build()
        first_rss = _ray.get(trainer.board.stats.remote(), timeout=30)["rss_mb"]
        grower = threading.Thread(target=grow, daemon=True)
        grower.start()
        result = trainer.run()
        grower.join(timeout=30)
    finally:
        trainer.shutdown()
    assert first_rss < 320 < grown[0], (first_rss, grown)
    assert result.reason == "total_env_steps", trainer.failure
    records = records_of(run_dir)
    last = records[-1]
    assert last["board_restarts"] == last["board_memory_replacements"] == 1, last
    assert all(0 < r["board_rss_mb"] for r in records if r["board_rss_mb"] is not None)
    assert last["board_rss_mb"] < 320, last["board_rss_mb"]
    replaced = [line for line in lines if line.startswith("the supply board")]
    assert len(replaced) == 1 and "over run.board_memory_limit_mb = 320" in replaced[0], lines
    assert all(len(ids) == cfg.fragments_per_update for ids in trainer.trained)
    flat = [tid for ids in trainer.trained for tid in ids]
    assert len(flat) == len(set(flat)), "a fragment was trained twice"


# `make test-long` (CI runs it), to keep `make test` within its 8 minutes: a 60-iteration run on Ray (~30 s). The
# control actor's replacement is also test_deadlines.py's stopped-control-actor case in `make test`.
@pytest.mark.long
def test_a_killed_control_actor_and_evaluator_are_replaced(ray_local, tmp_path):
    cfg = cfg_for("run.total_env_steps=61440", "eval.interval_iterations=2", "eval.episodes=2")
    run_dir = tmp_path / "run"
    trainer = Trainer(cfg, run_dir, quiet=True)
    lines: list = []
    trainer.supervisor.say = lines.append
    trainer.evaluation.say = lines.append
    try:
        trainer.build()
        s1, d1 = strike_when(trainer, run_dir, 3, "control", signal.SIGKILL)
        at_kill: list = []
        s2, d2 = strike_when(trainer.graph, run_dir, 5, "evaluator", signal.SIGKILL, seen=at_kill)
        result = trainer.run()
        s1.join(timeout=30)
        s2.join(timeout=30)
    finally:
        trainer.shutdown()
    assert d1 and d2, "the test never struck its targets"
    assert result.reason == "total_env_steps", trainer.failure
    assert records_of(run_dir)[-1]["control_restarts"] == 1
    assert any(line.startswith("the control actor died; replaced") for line in lines), lines
    assert any(line.startswith("the evaluator died") for line in lines), lines
    # Evaluations went on after it: the replacement evaluated a policy newer than any the killed one can have been
    # given (the newest recorded when it was killed, or the one its update was finishing), however far a loaded
    # machine let the run get before the kill.
    newest_at_kill = max(r["policy_version"] for r in at_kill)
    final = records_of(run_dir)[-1]
    assert final["eval_policy_version"] > newest_at_kill + 1, (newest_at_kill, final["eval_policy_version"])


@pytest.mark.long  # a multi-rate run on Ray (~30 s): `make test-long`, to keep `make test` within its 8 minutes
def test_a_killed_remote_preprocess_worker_is_replaced(ray_local, tmp_path):
    cfg = config_mod.load("configs/multirate.yaml", [
        "run.total_env_steps=4096", "run.target_return=null", "run.target_success_rate=null",
        "preprocess.remote_actors=1", "rollout.envs_per_actor=8", "learner.batch_size=512",
        "learner.minibatch_size=256", "run.stall_timeout_s=60"])
    run_dir = tmp_path / "run"
    trainer, result, struck, lines, _ = train_struck(cfg, run_dir, 2, "preprocess_workers", signal.SIGKILL, index=0)
    assert struck
    assert result.reason == "total_env_steps", (trainer.failure, lines)
    last = records_of(run_dir)[-1]
    assert last["preprocess_restarts"] == 1 and last["rollout_restarts"] >= 1, lines


def test_reward_normalisation_statistics_survive_a_resume_and_a_replacement(tmp_path):
    """env.normalize_reward scales by a running std per actor: a resumed run's actors (and a replacement) continue
    those statistics instead of starting again at variance 1. The count grows by one per env per step, so it
    says whose steps the statistics have seen."""
    run_dir = tmp_path / "run"
    base = ["rollout.num_actors=1", "replay.num_shards=1", "ray.address=inprocess", "env.normalize_reward=true"]
    # The env fails at 4,800 of 10,240 env steps: carried over, the statistics miss at most the steps since the
    # driver last read them (one iteration, 2,048); started afresh, they would miss 4,800.
    first = train_to_end(faulty("raise", tmp_path / "token", 600, *base, "run.total_env_steps=10240"), run_dir)
    ck = checkpoint.load(checkpoint.latest(run_dir))
    assert ck["run_state"]["env_failures"] == 1  # the replacement continued the statistics too ...
    count_1 = ck["run_state"]["reward_scalers"]["0"]["count"]
    assert count_1 >= 0.75 * first.env_steps, (count_1, first.env_steps)  # ... so they saw nearly every step
    second = train_to_end(faulty("raise", tmp_path / "token", 600, *base, "run.total_env_steps=20480"), run_dir,
                          resume=ck)
    count_2 = checkpoint.load(checkpoint.latest(run_dir))["run_state"]["reward_scalers"]["0"]["count"]
    assert count_2 >= 0.9 * second.env_steps and count_2 > 1.5 * count_1, (count_1, count_2, second.env_steps)
