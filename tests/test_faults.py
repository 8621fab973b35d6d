"""Fault tolerance and resume on a real local Ray: processes are really killed (SIGKILL)."""

import json
import os
import signal
import threading
import time

import numpy as np
import pytest
import ray as _ray

from cluster import checkpoint
from cluster import config as config_mod
from cluster.driver import Trainer
from tests.conftest import (ROOT, kill_all, records_so_far, train_to_end, train_while_rescaling, wait_for_count,
                            wait_for_records)


def cfg_for(*extra):
    return config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "rollout.num_actors=2", "rollout.envs_per_actor=8", "replay.num_shards=2", "run.require_target=false",
        "run.checkpoint_interval_s=null", *extra])


def pid_of(handle) -> int:
    return _ray.get(handle.__ray_call__.remote(lambda self: os.getpid()))


def kill_when(trainer: Trainer, run_dir, role: str, index: int, after_records: int, killed: list,
              holding: bool = False, ready=lambda: True) -> threading.Thread:
    """SIGKILL ``trainer.<role>[index]`` once the run has ``after_records`` records (``holding``: and the shard holds
    a fragment; it is SIGSTOPped first, so nobody takes that fragment between the look and the kill)."""
    def run():
        wait_for_records(run_dir, after_records)
        deadline = time.monotonic() + 60
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        handle = getattr(trainer, role)[index]
        pid = pid_of(handle)
        deadline = time.monotonic() + 60
        while holding and time.monotonic() < deadline:
            os.kill(pid, signal.SIGSTOP)
            # The board's ledger, not the stopped shard, says what it holds that no learner has claimed yet.
            held = _ray.get(trainer.board.describe.remote(_ray.get(trainer.board.stats.remote())["published"] + 1))
            if held["stored"]["holders"].get(index, 0):
                break
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def records_of(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def run_with_kills(cfg, run_dir, kills):
    """Train while one thread per entry of ``kills`` (dicts of :func:`kill_when`'s arguments: role, index,
    after_records, and optionally holding and ready) SIGKILLs its target; (result, records)."""
    trainer = Trainer(cfg, run_dir, quiet=True)
    killed: list = []
    try:
        trainer.build()
        killers = [kill_when(trainer, run_dir, killed=killed, **k) for k in kills]
        result = trainer.run()
        for killer in killers:
            killer.join(timeout=60)
    finally:
        trainer.shutdown()
    assert len(killed) == len(kills), f"the test killed {len(killed)} of its {len(kills)} targets"
    return result, records_of(run_dir)


def test_killed_rollout_actor_and_replay_shard_are_replaced_and_the_run_goes_on(ray_local, tmp_path):
    """Two faults in one run (one actor graph start, not two): a rollout actor at the 3rd update, then a replay
    shard, stopped while it holds an unclaimed fragment, at the 6th. (That learning survives a restart is the
    learner test's: a rollout actor or shard holds no training state.)"""
    result, rec = run_with_kills(cfg_for("run.total_env_steps=30720", "run.target_return=null"), tmp_path / "run", [
        dict(role="rollouts", index=0, after_records=3),
        dict(role="shards", index=1, after_records=6, holding=True)])
    assert result.reason == "total_env_steps"
    assert rec[-1]["rollout_restarts"] == 1
    assert rec[-1]["rollout_actors"] == 2
    # Env steps never go backwards although the replacement's own counter starts at zero.
    steps = [r["env_steps"] for r in rec]
    assert steps == sorted(steps)
    assert rec[-1]["shard_restarts"] == 1
    # The shard died holding at least one unclaimed fragment, the actor holding its tickets: what each held (at most
    # the in-flight bound) is made again, and counted, beside tickets whose lease ran out on a loaded machine;
    # nothing goes stale.
    assert 1 <= rec[-1]["fragments_lost"] - rec[-1]["leases_expired"] <= 2 * cfg_for().replay_bound
    assert rec[-1]["fragments_dropped_stale"] == 0


@pytest.mark.long  # learning run to a threshold (`make test-long`; CI runs it); test_api.py resumes a run
def test_resume_continues_counters_and_optimizer_and_reaches_the_target(tmp_path):
    """In process: resuming is the driver's, the learner's and the checkpoint's, the same code in both modes (a
    learner restored on Ray is the learner-restart tests'), and this saves two actor graph starts."""
    run_dir = tmp_path / "run"
    cfg = cfg_for("run.total_env_steps=20480", "run.target_return=null", "ray.address=inprocess")
    r1 = train_to_end(cfg, run_dir)
    ck1 = checkpoint.load(checkpoint.latest(run_dir))
    assert ck1["run_state"]["iteration"] == r1.iterations and ck1["stop_reason"] == "total_env_steps"
    adam_steps_1 = int(ck1["learner"]["optimizer"]["state"][0]["step"])
    steps_per_update = cfg.ppo.update_epochs * cfg.learner.batch_size // cfg.learner.minibatch_size
    assert adam_steps_1 == r1.iterations * steps_per_update  # epochs x minibatches per update

    # Resumed with the budget it already spent, it trains nothing more (it did train 3 more updates, each resume).
    again = train_to_end(cfg, run_dir, resume=ck1)
    assert again.reason == "total_env_steps" and again.iterations == r1.iterations, again
    assert len(records_of(run_dir)) == r1.iterations
    assert checkpoint.load(run_dir / "checkpoints" / "final.pt")["learner"]["updates_done"] == r1.iterations

    cfg2 = cfg_for("run.total_env_steps=500000", "run.target_return=475", "ray.address=inprocess")
    r2 = train_to_end(cfg2, run_dir, resume=ck1)
    rec = records_of(run_dir)
    first_resumed = rec[r1.iterations]  # metrics.jsonl is appended to
    assert first_resumed["iteration"] == r1.iterations + 1
    assert first_resumed["policy_version"] == ck1["learner"]["version"] + 1
    assert first_resumed["env_steps"] >= r1.env_steps
    # What ran is named in the first record of every process that trains, a resumed one too, and again only when
    # it changes.
    assert first_resumed["update_path"] == rec[0]["update_path"] == "fused (graphs: no capture on cpu)"
    assert "update_path" not in rec[r1.iterations + 1]
    assert [r["iteration"] for r in rec] == list(range(1, len(rec) + 1))
    ck2 = checkpoint.load(run_dir / "checkpoints" / "final.pt")
    assert int(ck2["learner"]["optimizer"]["state"][0]["step"]) == r2.iterations * steps_per_update
    assert ck2["learner"]["updates_done"] == r2.iterations
    assert r2.reason == "target_reached"
    assert np.isfinite(r2.episode_return_mean) and r2.episode_return_mean >= 475


def test_periodic_checkpoints_keep_the_newest_k(tmp_path):
    # In process: checkpoints are the driver's (the learner's state comes the same way in both modes).
    cfg = cfg_for("run.total_env_steps=30720", "run.target_return=null", "run.checkpoint_interval_s=0.2",
                  "run.keep_checkpoints=2", "ray.address=inprocess")
    train_to_end(cfg, tmp_path / "run")
    periodic = checkpoint.periodic(tmp_path / "run" / "checkpoints")
    assert len(periodic) == 2
    loaded = [checkpoint.load(p) for p in periodic]
    iters = [ck["run_state"]["iteration"] for ck in loaded]
    assert iters == sorted(iters) and iters[0] < iters[1]
    for ck in loaded:  # one update's state: weights, optimizer and counters of the recorded iteration
        it = ck["run_state"]["iteration"]
        assert ck["learner"]["updates_done"] == it and ck["learner"]["version"] == it
        steps_per_update = cfg.ppo.update_epochs * cfg.learner.batch_size // cfg.learner.minibatch_size
        assert int(ck["learner"]["optimizer"]["state"][0]["step"]) == it * steps_per_update
    assert (tmp_path / "run" / "checkpoints" / "final.pt").is_file()
    assert not list((tmp_path / "run" / "checkpoints").glob(".*")), "a temp file was left behind"


def test_rollout_actors_scale_up_and_down_while_running(ray_local, tmp_path):
    run_dir = tmp_path / "scaled"
    # 24 updates: the last change comes at the 6th, and the run goes on at 2 actors for 18 more.
    cfg = cfg_for("rollout.num_actors=1", "replay.num_shards=1", "run.total_env_steps=24576",
                  "run.target_return=null")
    # 0 is refused (below replay.num_shards: every shard needs a producer).
    result, calls = train_while_rescaling(cfg, run_dir, [(2, 3), (6, 0), (6, 2)])
    assert calls == [0, 2, 0]
    counts = [r["rollout_actors"] for r in records_of(run_dir)]
    assert counts[0] == 1 and 3 in counts and counts[-1] == 2, counts
    # Changing the actor set never starved the learner into a hang. A removed actor delivers the fragment in hand; the
    # tickets of its block it had not started go back to the others (counted as lost: at most one block, fewer than
    # the in-flight bound), so a run of 24 updates loses at most that.
    assert result.reason == "total_env_steps"
    assert records_of(run_dir)[-1]["fragments_lost"] < cfg.replay_bound


@pytest.mark.long
def test_a_killed_and_a_stopped_learner_restart_the_group_from_the_newest_checkpoint(ray_local, tmp_path):
    """Two learner losses in one run (one actor graph start, not two), each after a periodic checkpoint, and the
    policy still reaches its target:
    - learner 1 SIGKILLed at iteration 3: its group's calls fail at once;
    - learner 0 of the restarted group SIGSTOPped three iterations after that restart: it answers nothing, so its
      group cannot finish an iteration; the health call goes unanswered and the group restarts again."""
    cfg = cfg_for("run.target_return=400", "run.checkpoint_interval_s=0.5", "learner.num_learners=2")
    run_dir = tmp_path / "learner_dies"
    trainer = Trainer(cfg, run_dir, quiet=True)
    lines: list = []
    trainer.supervisor.say = lines.append
    struck: list = []

    def strike(rank: int, sig, after_records: int):
        wait_for_records(run_dir, after_records)
        deadline = time.monotonic() + 60
        newest = checkpoint.periodic(run_dir / "checkpoints")
        while time.monotonic() < deadline and checkpoint.periodic(run_dir / "checkpoints") == newest:
            time.sleep(0.05)  # a checkpoint written after this point: the restart has a new one to start from
        pid = pid_of(trainer.learners[rank])
        os.kill(pid, sig)
        struck.append(pid)

    def striker():
        strike(1, signal.SIGKILL, 3)
        wait_for_count(run_dir, "learner_restarts")
        strike(0, signal.SIGSTOP, len(records_so_far(run_dir)) + 3)

    t0 = time.monotonic()
    try:
        trainer.build()
        thread = threading.Thread(target=striker, daemon=True)
        thread.start()
        result = trainer.run()
        thread.join(timeout=60)
    finally:
        trainer.shutdown()
        kill_all(struck)
    assert len(struck) == 2, f"the test struck {len(struck)} of its 2 targets"
    assert result.reason == "target_reached", trainer.failure
    assert time.monotonic() - t0 < 180
    rec = records_of(run_dir)
    assert rec[-1]["learner_restarts"] == 2
    restarts = [line for line in lines if line.startswith("a learner died; learner group restarted from ")]
    assert len(restarts) == 2 and not any("from scratch" in line for line in restarts), lines
    versions = [r["policy_version"] for r in rec]
    assert versions == sorted(versions), "policy versions must keep increasing across the restarts"


# `make test-long` (CI runs it), to keep `make test` within its 8 minutes: the deadline must outlast the learner's
# start on a loaded host (20 s), and the rollout actor then waits all of it (~30 s in all).
@pytest.mark.long
def test_an_actor_ray_cannot_place_on_a_shared_cluster_is_a_resource_error_not_a_hang(ray_local, tmp_path):
    """Another job holds all CPUs but one: the learner gets it, the rollout actor never starts."""
    import time

    import ray

    from cluster import placement
    from cluster.driver import Trainer

    @ray.remote
    class Hog:
        def ping(self):
            return True

    # All CPUs but one, once earlier tests' actors have let go of theirs (the ping waits for that).
    hog = Hog.options(num_cpus=ray.cluster_resources()["CPU"] - 1).remote()
    ray.get(hog.ping.remote(), timeout=120)
    # 20 s: the learner (its torch import, over 10 s on a loaded 2-core host) must start before the rollout
    # actor's deadline is what fires.
    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), ["run.startup_timeout_s=20"])
    trainer = Trainer(cfg, tmp_path, quiet=True)
    t0 = time.monotonic()
    try:
        with pytest.raises(placement.ResourceError, match=r"1 rollout actor\(s\) did not start within 20 s "
                                                          r"\(run.startup_timeout_s\)"):
            trainer.build()
    finally:
        trainer.shutdown()
        ray.kill(hog)
    assert time.monotonic() - t0 < 90
