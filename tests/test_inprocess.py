"""The in-process mode (``ray.address: inprocess``): Ray's actor semantics on threads, and whole runs without Ray.

The stall and Ctrl-C tests of ``test_layouts.py`` run in this mode too (parametrized there).
"""

import json
import subprocess
import sys
import threading
import time

import pytest
from ray.exceptions import GetTimeoutError, RayActorError

from cluster import config as config_mod
from pipeline import runtime
from tests.conftest import ROOT


# ---------------------------------------------------------------------- the runtime's actor semantics
class Counter:
    def __init__(self, start: int = 0):
        self.log: list = []
        self.value = start
        self.release = threading.Event()

    def add(self, n: int, pause_s: float = 0.0) -> int:
        time.sleep(pause_s)
        self.log.append(n)
        self.value += n
        return self.value

    def block(self) -> str:
        self.release.wait(10)
        return "released"

    def fail(self):
        raise ValueError("bad input 7")

    def unblock(self) -> None:
        self.release.set()


class Grouped(Counter):
    """``unblock`` in a concurrency group of its own, as the learner's ``stop`` is."""

    def unblock(self) -> None:
        self.release.set()

    unblock.__ray_concurrency_group__ = "control"  # what @ray.method(concurrency_group=...) sets


class AsyncBoard:
    def __init__(self):
        import asyncio

        self.items: list = []
        self.changed = asyncio.Condition()

    async def put(self, x) -> None:
        async with self.changed:
            self.items.append(x)
            self.changed.notify_all()

    async def wait_for(self, n: int, timeout_s: float) -> list:
        import asyncio

        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: len(self.items) >= n), timeout_s)
        return list(self.items)

    async def ask(self, other) -> int:
        return await other.add.remote(5)  # an async actor awaiting another actor's call, as shards await the board


def test_calls_to_one_actor_run_one_at_a_time_in_order():
    a = runtime.LocalActor(Counter, (10,), {})
    refs = [a.add.remote(1, pause_s=0.05), a.add.remote(2), a.add.remote(3)]
    assert runtime.get(refs, timeout=5) == [11, 13, 16]
    assert a._instance.log == [1, 2, 3]  # the slow first call did not let the others overtake it


def test_get_deadline_raises_rays_timeout_and_errors_are_the_methods_own():
    a = runtime.LocalActor(Counter, (), {})
    blocked = a.block.remote()
    t0 = time.monotonic()
    with pytest.raises(GetTimeoutError):
        runtime.get(blocked, timeout=0.2)
    assert time.monotonic() - t0 < 2
    queued = a.fail.remote()  # behind the blocked call, as in a Ray actor
    a._instance.unblock()
    assert runtime.get(blocked, timeout=5) == "released"
    with pytest.raises(ValueError, match="bad input 7"):
        runtime.get(queued, timeout=5)


def test_a_concurrency_group_runs_beside_a_blocked_call():
    plain = runtime.LocalActor(Counter, (), {})
    grouped = runtime.LocalActor(Grouped, (), {}, concurrency_groups={"control": 1})
    for actor, unblocks in ((grouped, True), (plain, False)):
        blocked = actor.block.remote()
        actor.unblock.remote()
        # Where it unblocks, a wide deadline (a loaded machine); where it must not, the wait proves nothing came.
        ready, _ = runtime.wait([blocked], timeout=10.0 if unblocks else 1.0)
        assert bool(ready) is unblocks  # in the default group, unblock waits behind block
        actor._instance.unblock()
        runtime.get(blocked, timeout=10)


def test_remote_class_options_carry_over():
    from learner.actor import LearnerActor, RemoteLearner

    assert runtime.plain_class(RemoteLearner) is LearnerActor
    # The learner's control, health and feed groups come from the Ray class's own options.
    assert dict(RemoteLearner._default_options["concurrency_groups"]) == {"control": 1, "health": 1, "feed": 1}


def test_async_actor_calls_interleave_and_can_await_other_actors():
    board = runtime.LocalActor(AsyncBoard, (), {})
    waiting = board.wait_for.remote(2, timeout_s=5)  # holds until two items exist, without blocking the loop
    board.put.remote("a")
    board.put.remote("b")
    assert runtime.get(waiting, timeout=5) == ["a", "b"]
    counter = runtime.LocalActor(Counter, (1,), {})
    assert runtime.get(board.ask.remote(counter), timeout=5) == 6


def test_wait_returns_the_ready_ones_in_order():
    a, b = runtime.LocalActor(Counter, (), {}), runtime.LocalActor(Counter, (), {})
    slow, fast = a.block.remote(), b.add.remote(1)
    ready, pending = runtime.wait([slow, fast], num_returns=1, timeout=5)
    assert ready == [fast] and pending == [slow]
    ready, pending = runtime.wait([slow, fast], num_returns=2, timeout=0.1)
    assert ready == [fast] and pending == [slow]  # the deadline, not both
    a._instance.unblock()


def test_a_killed_actor_fails_its_calls_like_a_dead_ray_actor():
    a = runtime.LocalActor(Counter, (), {})
    a.block.remote()  # in progress when the actor is killed: it runs on, on its daemon thread
    queued = a.add.remote(1)
    board = runtime.LocalActor(AsyncBoard, (), {})
    held = board.wait_for.remote(1, timeout_s=30)
    runtime.kill(a)
    runtime.kill(board)
    with pytest.raises(RayActorError):
        runtime.get(queued, timeout=5)  # not yet started: failed, as Ray fails a dead actor's queue
    with pytest.raises(RayActorError):
        runtime.get(a.add.remote(2), timeout=5)
    with pytest.raises(RayActorError):
        runtime.get(held, timeout=5)  # an async call pending on the killed loop
    a._instance.unblock()


def test_put_without_ray_is_the_value_itself_and_starts_no_ray():
    # In a fresh interpreter: this test process has a Ray up for the other tests, and there put goes to its store.
    code = ("import ray\nfrom pipeline import runtime\nvalue = {'w': [1, 2]}\nref = runtime.put(value)\n"
            "assert runtime.get(ref) is value and runtime.get([ref], timeout=1) == [value]\n"
            "assert not ray.is_initialized()\nprint('OK')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]


# ---------------------------------------------------------------------- whole runs
def test_cli_in_process_with_three_actors_and_two_shards_reaches_the_target_without_starting_ray(tmp_path):
    """The CLI in process, on an uneven layout: 475 reached, every fragment accounted, and Ray never started."""
    run_dir = tmp_path / "run"
    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), ["rollout.num_actors=3", "replay.num_shards=2"])
    code = (
        "import sys, ray\n"
        "from cluster.train import main\n"
        f"rc = main(['--config', {str(ROOT / 'configs/cartpole.yaml')!r}, '--address', 'inprocess', "
        f"'--set', 'rollout.num_actors=3', '--set', 'replay.num_shards=2', '--run-dir', {str(run_dir)!r}])\n"
        "print('RAY_INITIALIZED', ray.is_initialized())\n"
        "sys.exit(rc)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RAY_INITIALIZED False" in proc.stdout
    assert "done: target_reached" in proc.stderr
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    last = records[-1]
    # The fused step (learner.graphs: auto), over static buffers, uncaptured on CPU.
    assert records[0]["update_path"] == "fused (graphs: no capture on cpu)" and last["rollout_actors"] == 3
    assert last["episode_return_mean"] >= 475
    assert last["fragments_dropped_stale"] == 0 and last["fragments_lost"] == 0
    # Production followed consumption: at most the in-flight bound beyond what was trained.
    trained = last["learner_samples"] // cfg.fragment_samples
    assert trained <= last["fragments_produced"] <= trained + cfg.replay_bound
    saved = config_mod.load(str(run_dir / "config.yaml"))
    assert saved.ray.address == "inprocess"  # what ran is what the run directory says
    assert (run_dir / "checkpoints" / "final.pt").is_file()


def test_several_learners_in_process_is_a_config_error_naming_the_key():
    with pytest.raises(config_mod.ConfigError, match=r"learner.num_learners: 2 .*ray.address: inprocess"):
        config_mod.load(str(ROOT / "configs/cartpole.yaml"), ["ray.address=inprocess", "learner.num_learners=2"])


def test_a_ref_passed_as_an_argument_arrives_as_its_value_as_in_ray():
    a = runtime.LocalActor(Counter, (1,), {})
    board = runtime.LocalActor(AsyncBoard, (), {})
    pending = a.add.remote(2, pause_s=0.05)  # not finished when passed on
    assert runtime.get(a.add.remote(runtime.put(4)), timeout=5) == 7
    runtime.get(board.put.remote(pending), timeout=5)
    assert runtime.get(board.wait_for.remote(1, timeout_s=5), timeout=5) == [3]
    boxed = runtime.put(5)
    assert runtime.get(board.put.remote([boxed]), timeout=5) is None
    assert runtime.get(board.wait_for.remote(2, timeout_s=5), timeout=5)[1] == [boxed]  # inside a list: a ref



def test_adds_grow_only_while_the_shard_lags_and_every_fragment_stays_accounted(tmp_path):
    """rollout.fragments_per_add 4, 8 fragments per update (128-sample fragments, batch 1024), one actor (so its
    ticket blocks are long). While the shard keeps up, a fragment is its own add (mostly); while the shard's event
    loop is held for a second (a stalled host, three times), the fragments made meanwhile go together, at most 4 per
    add. Production still follows consumption exactly."""
    from cluster.driver import Trainer
    from tests.conftest import wait_for_records

    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "ray.address=inprocess", "rollout.num_actors=1", "rollout.envs_per_actor=8", "rollout.fragment_length=16",
        "replay.num_shards=1", "rollout.fragments_per_add=4", "run.total_env_steps=24576", "run.require_target=false",
        "run.checkpoint_interval_s=null", "run.progress_interval_s=1000"])
    run_dir = tmp_path / "run"
    trainer = Trainer(cfg, run_dir, quiet=True)
    stalled = []

    def stall_the_shard():
        # Three stalls, at records 2, 6 and 10: one that strikes while the actor waits for tickets (nothing of its
        # own to batch) is not the only chance.
        for at in (2, 6, 10):
            wait_for_records(run_dir, at)
            before = runtime.get(trainer.shards[0].stats.remote(), timeout=10)
            runtime.get(trainer.shards[0].__ray_call__.remote(lambda self: time.sleep(1.0)), timeout=30)
            stalled.append(before)

    try:
        trainer.build()
        t = threading.Thread(target=stall_the_shard, daemon=True)
        t.start()
        result = trainer.run()
        t.join(timeout=30)
        shard = runtime.get(trainer.shards[0].stats.remote(), timeout=10)
    finally:
        trainer.shutdown()
    assert len(stalled) == 3, "the shard was not stalled three times"
    assert result.reason == "total_env_steps"
    last = [json.loads(line) for line in open(run_dir / "metrics.jsonl")][-1]
    assert last["fragments_lost"] == 0 and last["fragments_dropped_stale"] == 0
    trained = last["learner_samples"] // cfg.fragment_samples
    assert trained <= last["fragments_produced"] <= trained + cfg.replay_bound
    # Before the first stall the shard mostly kept up: adds of one fragment are the rule. (Not always one: in process
    # the shard's thread waits for the GIL, so a loaded machine makes it lag now and then, and adds grow then too.)
    assert stalled[0]["added"] >= 4 and stalled[0]["add_calls"] >= stalled[0]["added"] / 2, stalled[0]
    # The stall batched what was made meanwhile, never past fragments_per_add.
    assert shard["added"] >= trained and 1 < shard["largest_add"] <= 4 and shard["add_calls"] < shard["added"], shard


@pytest.mark.parametrize("actors", [1, 6])
def test_the_drivers_calls_about_rollout_actors_do_not_grow_with_their_number(tmp_path, actors):
    """Every actor's stats come with its board polls (one board call per driver pass reads all of them), a death
    shows in one until_done call per actor incarnation, and only a silent actor gets a health call: with 1 or 6
    healthy actors the driver makes one board call per pass, one until_done per actor, and (almost) no health
    calls, where it used to call every actor on every pass. The episodes still all arrive."""
    from cluster.driver import Trainer

    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "ray.address=inprocess", f"rollout.num_actors={actors}", "rollout.envs_per_actor=4",
        "rollout.fragment_length=64", "replay.num_shards=1", "run.total_env_steps=30720", "run.require_target=false",
        "run.target_return=null", "run.checkpoint_interval_s=null", "run.progress_interval_s=1000"])
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    try:
        trainer.build()
        result = trainer.run()
    finally:
        trainer.shutdown()
    assert result.reason == "total_env_steps"
    calls = trainer.supervisor.calls
    passes = calls["actor_reports"]
    assert passes >= result.iterations
    assert calls["until_done"] == actors  # one per incarnation, none replaced
    # A silent spell (a loaded machine, the first weights) may cost a health call; never one per actor per pass.
    assert calls["health"] <= max(2, passes // 10), dict(calls)
    # Episodes reached the driver through the board: 30k CartPole steps are at least 61 episodes of at most 500.
    assert trainer.state.episodes_total >= 30720 // 500, trainer.state.episodes_total


def test_a_run_with_ticket_blocks_and_stored_pacing_off_keeps_every_batch_exact(tmp_path):
    """The two scale-only mechanisms with a config switch of their own (docs/protocol.md): with
    ``rollout.ticket_blocks: false`` an actor's every poll takes at most one ticket, so the board sees at least one
    poll per fragment made; with ``replay.stored_pacing: false`` each shard confirms on the short clock. The ledger
    is the same: nothing is lost or made stale and production follows consumption."""
    from cluster.driver import Trainer
    from pipeline.protocol import STORED_GATHER_S

    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "ray.address=inprocess", "rollout.num_actors=2", "rollout.envs_per_actor=8", "rollout.fragment_length=16",
        "replay.num_shards=2", "rollout.ticket_blocks=false", "replay.stored_pacing=false",
        "run.total_env_steps=16384", "run.require_target=false", "run.checkpoint_interval_s=null",
        "run.progress_interval_s=1000"])
    run_dir = tmp_path / "run"
    trainer = Trainer(cfg, run_dir, quiet=True)
    try:
        trainer.build()
        result = trainer.run()
        calls = runtime.get(trainer.graph.board.__ray_call__.remote(lambda self: dict(self.calls)), timeout=10)
        paces = [runtime.get(s.__ray_call__.remote(lambda self: self.pace_s), timeout=10) for s in trainer.shards]
    finally:
        trainer.shutdown()
    assert result.reason == "total_env_steps"
    last = [json.loads(line) for line in open(run_dir / "metrics.jsonl")][-1]
    assert last["fragments_lost"] == 0 and last["fragments_dropped_stale"] == 0
    trained = last["learner_samples"] // cfg.fragment_samples
    assert trained <= last["fragments_produced"] <= trained + cfg.replay_bound
    assert calls["poll"] >= last["fragments_produced"], (calls, last["fragments_produced"])
    assert paces == [STORED_GATHER_S] * 2
