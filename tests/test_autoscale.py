"""rollout.num_actors: auto: the decision rule on hand-made records (cluster/autoscale.py), and a run on a real
local Ray whose slow env starves the learner until the autoscaler adds actors."""

import math

import pytest

from cluster import config as config_mod
from cluster.autoscale import BRACKET_WINDOWS, DOWN_TARGET_BUSY, RolloutAutoscaler
from pipeline import metric_keys as M
from tests.conftest import ROOT


def feed(scaler, have, host_bound, rate_limited, n, room=lambda k: k, t0=0.0, backpressure=0.0):
    """``n`` one-second iterations at these fractions (``rate_limited``, ``backpressure``: of each actor's time, the
    rest stepping the env), as the driver's records carry them (cluster/host_time.py: the actors' seconds in the
    iteration, summed); the decisions."""
    out = []
    for i in range(n):
        record = {"time_s": t0 + i + 1.0, M.HOST_BOUND_FRACTION: host_bound, M.ROLLOUT_WALL_S: 1.0 * have,
                  M.ROLLOUT_TICKET_WAIT_S: rate_limited * have, M.ROLLOUT_ADD_WAIT_S: backpressure * have,
                  M.ROLLOUT_ENV_STEP_S: (1.0 - rate_limited - backpressure) * have}
        out.append(scaler.observe(record, have, room))
    return out


def test_no_decision_before_the_window_is_full_then_up_by_what_the_wait_says():
    scaler = RolloutAutoscaler(min_actors=1, max_actors=64, host_bound_up=0.2, window=4)
    decisions = feed(scaler, have=4, host_bound=0.5, rate_limited=0.0, n=4)
    assert decisions[:3] == [None, None, None]
    # Learners waiting half their time: production must double for the wait to go.
    assert decisions[3].want == math.ceil(4 / (1 - 0.5)) == 8
    assert "learners waited 50% of their time for data over 4 iterations" in decisions[3].why


def test_up_is_capped_by_max_actors_and_by_the_free_cpus():
    scaler = RolloutAutoscaler(1, 6, 0.2, 2)
    assert feed(scaler, 4, 0.9, 0.0, 2)[-1].want == 6  # wanted 40, max_actors 6
    asked = []
    scaler = RolloutAutoscaler(1, 64, 0.2, 2)
    assert feed(scaler, 4, 0.9, 0.0, 2, room=lambda k: asked.append(k) or 1)[-1].want == 5
    assert asked == [36]  # it asked for what it wanted; one fits
    # Nothing fits: no decision (and nothing said), the next window asks again.
    scaler = RolloutAutoscaler(1, 64, 0.2, 2)
    assert feed(scaler, 4, 0.9, 0.0, 3, room=lambda k: 0) == [None, None, None]


def test_down_when_the_actors_wait_for_tickets_and_the_learners_do_not_wait():
    scaler = RolloutAutoscaler(2, 64, 0.2, 4)
    decision = feed(scaler, have=8, host_bound=0.02, rate_limited=0.8, n=4)[-1]
    # Busy 20% of their time: 8 x 0.2 / 0.75 -> 3 actors leave the survivors 75% busy.
    assert decision.want == math.ceil(8 * 0.2 / DOWN_TARGET_BUSY) == 3
    assert "rollout actors waited 80% of their time for tickets" in decision.why
    # Floored at min_actors.
    scaler = RolloutAutoscaler(5, 64, 0.2, 4)
    assert feed(scaler, 8, 0.02, 0.95, 4)[-1].want == 5
    assert feed(RolloutAutoscaler(8, 64, 0.2, 4), 8, 0.02, 0.95, 8) == [None] * 8  # already at the floor


@pytest.mark.parametrize("host_bound,rate_limited", [(0.15, 0.9), (0.1, 0.9), (0.02, 0.3), (0.19, 0.0)])
def test_between_the_thresholds_nothing_happens(host_bound, rate_limited):
    """Hysteresis: up needs the learners waiting >= 20%; down needs them under 10% and the actors rate-limited half
    their time. Anything between holds the count."""
    scaler = RolloutAutoscaler(1, 64, 0.2, 4)
    assert feed(scaler, 8, host_bound, rate_limited, 12) == [None] * 12


def test_after_a_change_the_window_starts_over():
    scaler = RolloutAutoscaler(1, 64, 0.2, 3)
    first = feed(scaler, 2, 0.6, 0.0, 3)
    assert first[-1].want == 5
    # The new count's first records do not decide: its own measurements fill a fresh window.
    after = feed(scaler, 5, 0.6, 0.0, 3, t0=10.0)
    assert after[:2] == [None, None] and after[2].want == math.ceil(5 / 0.4)


def test_a_count_between_two_that_each_call_for_the_other_is_held_then_the_bracket_is_forgotten():
    """What a 2-core cluster did (window 4: 5 -> 3 -> 5 -> 3 -> 4 -> 5 -> 3 ... for the whole run): 5 actors wait
    for tickets, 3 leave the learners waiting. Once it has left 5 downwards and 3 upwards, it moves only between
    them: 4, where both signals still cross their thresholds, is held; BRACKET_WINDOWS windows later the bracket is
    forgotten and the count may move again."""
    scaler = RolloutAutoscaler(1, 5, 0.2, 2)
    assert feed(scaler, 1, 0.98, 0.0, 2)[-1].want == 5  # starved (1 is now too few)
    assert feed(scaler, 5, 0.08, 0.66, 2, t0=10)[-1].want == math.ceil(5 * 0.34 / DOWN_TARGET_BUSY) == 3
    assert feed(scaler, 3, 0.32, 0.0, 2, t0=20)[-1].want == 4  # ceil(3 / 0.68) = 5, but 5 was too many
    held = feed(scaler, 4, 0.25, 0.0, 4, t0=30) + feed(scaler, 4, 0.05, 0.9, 4, t0=40)
    assert held == [None] * 8  # up would be 5 (too many), down 3 (too few)
    later = [d for d in feed(scaler, 4, 0.25, 0.0, 2 * BRACKET_WINDOWS, t0=50) if d is not None]
    assert later and later[0].want == 5


def test_no_more_actors_while_they_wait_for_tickets_or_their_shard_even_when_the_learners_wait():
    """The learners wait, but the actors spend most of their time waiting too (for tickets: the ticket rule or the
    policy lag holds them; for their shard's acknowledgement): production is not what the learners wait for, so more
    actors would only wait as well. The same wait with busy actors scales up, and says where their time goes."""
    assert feed(RolloutAutoscaler(1, 64, 0.2, 4), 4, 0.5, 0.6, 8) == [None] * 8
    assert feed(RolloutAutoscaler(1, 64, 0.2, 4), 4, 0.5, 0.2, 8, backpressure=0.4) == [None] * 8
    busy = feed(RolloutAutoscaler(1, 64, 0.2, 4), 4, 0.5, 0.1, 4)[-1]
    assert busy.want == 8 and busy.why.endswith("while rollout actors were busy 90% of theirs, most in env step (90%)")


def test_an_iteration_no_actor_reported_in_weighs_nothing():
    """The window's shares are its seconds summed: iterations in which no actor reported (0 s) do not dilute the
    ticket wait of those in which they did."""
    scaler = RolloutAutoscaler(1, 64, 0.2, 4)
    quiet = {"time_s": 1.0, M.HOST_BOUND_FRACTION: 0.02}
    for _ in range(3):
        assert scaler.observe(quiet, 8, lambda k: k) is None
    decision = scaler.observe({**quiet, M.ROLLOUT_WALL_S: 8.0, M.ROLLOUT_TICKET_WAIT_S: 6.4,
                               M.ROLLOUT_ENV_STEP_S: 1.6}, 8, lambda k: k)
    assert decision is not None and decision.want == 3 and "waited 80% of their time for tickets" in decision.why


def test_config_auto_starts_at_min_actors_and_checks_its_bounds():
    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "rollout.num_actors=auto", "rollout.min_actors=2", "rollout.max_actors=5", "replay.num_shards=2"])
    assert cfg.autoscale_rollouts and cfg.rollout_actors_at_start == 2
    with pytest.raises(config_mod.ConfigError, match=r"^rollout.min_actors: 6 is more than rollout.max_actors \(5\)"):
        config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
            "rollout.num_actors=auto", "rollout.min_actors=6", "rollout.max_actors=5"])
    with pytest.raises(config_mod.ConfigError, match=r"^replay.num_shards: 2 is more than rollout.min_actors \(1\)"):
        config_mod.load(str(ROOT / "configs/cartpole.yaml"), ["rollout.num_actors=auto", "replay.num_shards=2"])


def test_too_few_cpus_for_min_actors_names_min_actors_not_the_auto_key(ray_local):
    """Under ``auto`` the CPUs needed at start are rollout.min_actors', so that is the key the shortfall names."""
    from cluster import placement

    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "rollout.num_actors=auto", "rollout.min_actors=9", "rollout.max_actors=12"])
    with pytest.raises(placement.ResourceError) as err:
        placement.plan(cfg)
    assert str(err.value).startswith(
        "the Ray cluster has 8 CPU but the config needs 10 (rollout.min_actors (rollout.num_actors is auto) x "), err.value


@pytest.mark.long  # a run on Ray until the rule adds actors; the rule itself runs in make test on hand-made records
def test_a_starved_learner_gets_more_rollout_actors_on_ray(ray_local, tmp_path):
    """A slow env (2 ms of sleep a step, no CPU) and one rollout actor: the learner waits for data most of its time,
    so after a window of 2 iterations the autoscaler asks for more, up to rollout.max_actors = 3, through the control
    actor's live-rescale path; the records say it, and the stderr line says why."""
    import json

    from cluster.driver import Trainer
    from tests.slow_env import SLOW_ID

    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        f"env.id=tests.slow_env:{SLOW_ID}", "rollout.num_actors=auto", "rollout.min_actors=1",
        "rollout.max_actors=3", "rollout.autoscale_window=2", "replay.num_shards=1", "rollout.envs_per_actor=8",
        "learner.batch_size=1024", "learner.minibatch_size=512", "run.total_env_steps=10240",
        "run.target_return=null", "run.require_target=false", "run.checkpoint_interval_s=null"])
    run_dir = tmp_path / "run"
    trainer = Trainer(cfg, run_dir, quiet=True)
    lines: list = []
    trainer.supervisor.say = lines.append
    try:
        trainer.build()
        assert len(trainer.rollouts) == 1
        result = trainer.run()
    finally:
        trainer.shutdown()
    assert result.reason == "total_env_steps"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    asked = [(r["iteration"], r["rollout_autoscale"]) for r in records if r["rollout_autoscale"] is not None]
    assert asked and asked[0][1] > 1 and max(n for _, n in asked) == 3, asked
    assert records[0]["rollout_actors"] == 1 and records[-1]["rollout_actors"] == 3, \
        [r["rollout_actors"] for r in records]
    said = [line for line in lines if line.startswith("rollout actors: autoscale 1 -> ")]
    assert said and "learners waited" in said[0] and "for data over 2 iterations" in said[0], lines


def test_the_autoscaler_never_asks_for_more_actors_than_tickets_exist():
    """At replay.max_policy_lag 0 the learners wait for data by design; an actor beyond the tickets that can exist
    at once ((lag + 1) x fragments per update) could only wait, so that is the ceiling, under rollout.max_actors."""
    from cluster.supervisor import Supervisor

    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "rollout.num_actors=auto", "rollout.max_actors=64", "replay.num_shards=1", "replay.max_policy_lag=0",
        "rollout.envs_per_actor=8", "learner.batch_size=1024", "learner.minibatch_size=512"])
    assert cfg.replay_bound == 1024 // cfg.fragment_samples
    scaler = Supervisor(cfg, graph=None, state=None, say=print).autoscaler
    assert scaler.max == cfg.replay_bound
    assert feed(scaler, 1, 0.9, 0.0, 4)[-1].want == cfg.replay_bound
