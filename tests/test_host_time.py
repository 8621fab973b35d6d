"""Where the rollout host's time goes (cluster/host_time.py): the rollout actors' stages cover their wall time on a
real run, the records fold them per iteration, and the progress line and the report name the stage that bounds a
host-bound learner with what to change."""

import dataclasses
import io
import json
import math

import pytest
import torch

from cluster import config as config_mod
from cluster import host_time
from cluster.host_time import ADVICE, HOST_BOUND_NAMED, RolloutTime
from cluster.metrics import ProgressLine
from cluster.report import summary_table
from pipeline import metric_keys as M
from pipeline import runtime
from tests.conftest import ROOT, env_spec

#: Of an actor's wall time, at most this share may lie outside every timed stage (its loop's own book-keeping: a few
#: list operations per fragment). A stage that went untimed would put its whole share here.
UNTIMED_AT_MOST = 0.1
STAGES = [stage for stage, _, _ in M.ROLLOUT_STAGES if stage != "other"]


def test_the_stages_cover_a_rollout_actor_s_wall_time_on_a_real_run(tmp_path):
    """CartPole in process, one actor: every stage of its loop was timed (each > 0), together they hold all but a
    sliver of the loop's wall time, a Box env has next to nothing to preprocess, and the records' per-iteration
    seconds add up to what the actor reported (each record's stages and `other` to its wall time)."""
    from cluster.driver import Trainer

    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "ray.address=inprocess", "rollout.envs_per_actor=8", "run.total_env_steps=16384", "run.require_target=false",
        "run.target_return=null", "run.checkpoint_interval_s=null", "run.progress_interval_s=1000"])
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    try:
        trainer.build()
        result = trainer.run()
        actor = runtime.get(trainer.rollouts[0].stats.remote(), timeout=10)
        reported = trainer.supervisor.rollout_stats[0]  # the newest stats the records were made from
    finally:
        trainer.shutdown()
    assert result.reason == "total_env_steps"
    wall, stages = actor["wall_s"], actor["stage_s"]
    assert set(stages) == set(STAGES)
    assert all(stages[s] > 0 for s in STAGES), stages
    untimed = wall - sum(stages.values())
    assert -1e-3 <= untimed <= UNTIMED_AT_MOST * wall, (wall, stages)
    assert stages["env_step"] + stages["forward"] > 0.2 * wall, stages  # the work itself, not only the waits
    assert stages["preprocess"] < 0.02 * wall, stages  # a Box env's array is used as it comes
    assert actor["rate_limited_s"] == stages["rate_limited"] and actor["backpressure_s"] == stages["backpressure"]

    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    rounding = len(records) * 1e-6  # the records keep microseconds
    assert sum(r[M.ROLLOUT_WALL_S] for r in records) == pytest.approx(reported["wall_s"], abs=rounding)
    for stage, key, _ in M.ROLLOUT_STAGES[:-1]:
        assert sum(r[key] for r in records) == pytest.approx(reported["stage_s"][stage], abs=rounding), stage
    for r in records:
        assert sum(r[key] for _, key, _ in M.ROLLOUT_STAGES) == pytest.approx(r[M.ROLLOUT_WALL_S], abs=1e-5)
    assert sum(records[-1][share] for _, _, share in M.ROLLOUT_STAGES) == pytest.approx(1.0, abs=1e-3)


def test_a_dict_env_s_preprocessing_is_its_own_stage_and_collect_is_covered():
    """The multi-rate env (five modalities through the observation pipeline): preprocessing is a stage of its own,
    and the sampler's four stages hold collect()'s whole time."""
    from actors.multirate_env import ENV_ID
    from actors.sampler import RolloutSampler, SamplerSettings
    from learner.model import ActorCritic, state_dict_numpy

    modalities = config_mod.load(str(ROOT / "configs/multirate.yaml"), []).env.modalities
    spec = env_spec("actors.multirate_env:" + ENV_ID, hidden_sizes=(64,), modalities=modalities)
    torch.manual_seed(0)
    sampler = RolloutSampler(SamplerSettings(env_id="actors.multirate_env:" + ENV_ID, num_envs=4, fragment_length=16,
                                             gamma=0.99, gae_lambda=0.95, seed=1, modalities=modalities),
                             lambda: ActorCritic(spec))
    try:
        sampler.load_weights(0, state_dict_numpy(ActorCritic(spec)))
        for _ in range(3):
            sampler.collect()
    finally:
        sampler.close()
    timed = sampler.timings.snapshot()
    assert set(timed) == {"env_step", "preprocess", "forward", "fragment"}
    assert all(v > 0 for v in timed.values()), timed
    covered = sum(timed.values())
    assert covered == pytest.approx(sampler.sample_seconds, rel=UNTIMED_AT_MOST), (timed, sampler.sample_seconds)
    assert timed["preprocess"] > 0.05 * sampler.sample_seconds, timed  # PNG decodes, spectrograms: real work


def _actor(actor_id, incarnation, wall, **stages):
    return {"actor_id": actor_id, "incarnation": incarnation, "wall_s": wall,
            "stage_s": {s: stages.get(s, 0.0) for s in STAGES}}


def test_records_fold_the_actors_seconds_per_iteration_and_a_replacement_counts_from_zero():
    fold = RolloutTime().fold
    first = fold([_actor(0, 0, 2.0, env_step=1.0, rate_limited=0.5), _actor(1, 0, 2.0, forward=1.5)])
    assert first[M.ROLLOUT_WALL_S] == 4.0 and first[M.ROLLOUT_ENV_STEP_S] == 1.0 and first[M.ROLLOUT_OTHER_S] == 1.0
    assert first[M.ROLLOUT_FORWARD_SHARE] == pytest.approx(1.5 / 4)
    # Actor 1 was replaced: its new incarnation's counters count from zero, not as a step back; actor 0 moved on.
    second = fold([_actor(0, 0, 3.0, env_step=1.8, rate_limited=0.6), _actor(1, 1, 0.5, forward=0.25)])
    assert second[M.ROLLOUT_WALL_S] == pytest.approx(1.5)
    assert second[M.ROLLOUT_ENV_STEP_S] == pytest.approx(0.8) and second[M.ROLLOUT_FORWARD_S] == pytest.approx(0.25)
    assert second[M.ROLLOUT_TICKET_WAIT_S] == pytest.approx(0.1)
    assert second[M.ROLLOUT_OTHER_S] == pytest.approx(1.5 - 0.8 - 0.25 - 0.1)
    # No new report: zero seconds, and the newest shares stay.
    third = fold([_actor(0, 0, 3.0, env_step=1.8, rate_limited=0.6), _actor(1, 1, 0.5, forward=0.25)])
    assert third[M.ROLLOUT_WALL_S] == 0.0 and third[M.ROLLOUT_ENV_STEP_SHARE] == second[M.ROLLOUT_ENV_STEP_SHARE]


def _record(host_bound, **shares):
    """A record as the driver writes it, with the actors' shares (the rest of their time ``other``)."""
    record = {M.ITERATION: 7, M.TIME_S: 12.0, M.ENV_STEPS: 20_000, M.ENV_STEPS_PER_S: 3_000.0,
              M.LEARNER_SAMPLES_PER_S: 3_000.0, M.EPISODE_RETURN_MEAN: 0.5, M.EPISODES_IN_WINDOW: 100,
              M.HOST_BOUND_FRACTION: host_bound, M.POLICY_LAG_MEAN: 1.0, M.POLICY_LAG_MAX: 1, M.POLICY_VERSION: 7}
    wall = 10.0
    record[M.ROLLOUT_WALL_S] = wall
    for stage, seconds, share in M.ROLLOUT_STAGES:
        record[share] = shares.get(stage, 0.0)
        record[seconds] = shares.get(stage, 0.0) * wall
    record[M.ROLLOUT_OTHER_SHARE] = 1.0 - sum(shares.values())
    record[M.ROLLOUT_OTHER_S] = record[M.ROLLOUT_OTHER_SHARE] * wall
    return record


def _progress(record) -> str:
    out = io.StringIO()
    ProgressLine(0.0, 100_000, stream=out).update(record, force=True)
    return out.getvalue()


def test_the_progress_line_names_the_largest_rollout_stage_when_the_learner_is_host_bound():
    line = _progress(_record(0.54, env_step=0.61, forward=0.2, rate_limited=0.1))
    assert "| host-bound 54.0% (rollouts: env step 61%) |" in line, line
    line = _progress(_record(0.3, preprocess=0.5, forward=0.3, other=0.0))
    assert "host-bound 30.0% (rollouts: preprocess 50%)" in line, line
    # Not host-bound: the figure alone (the learner is the bound, no rollout stage to fix).
    assert "host-bound  2.0% |" in _progress(_record(0.02, env_step=0.61))
    # Records without the actors' figures (shares null): the figure alone.
    assert "host-bound 54.0% |" in _progress({**_record(0.54), **{s: None for _, _, s in M.ROLLOUT_STAGES}})


@pytest.mark.parametrize("stage,keys", [
    ("env_step", ["rollout.num_actors", "rollout.envs_per_actor", "env.backend"]),
    ("preprocess", ["preprocess.remote_actors", "preprocess.workers"]),
    ("forward", ["rollout.num_actors", "rollout.envs_per_actor", "learner.hidden_sizes"]),
    ("backpressure", ["replay.num_shards"]),
    ("add", ["replay.num_shards", "rollout.fragments_per_add"]),
])
def test_the_report_names_the_bounding_stage_and_what_to_change(stage, keys):
    shares = {stage: 0.6, "rate_limited": 0.05, "fragment": 0.05}
    records = [_record(0.5, **shares) for _ in range(6)]
    table = " ".join(summary_table(records).split())  # the verdict is wrapped: compare it unwrapped
    label = host_time.LABELS[stage]
    assert f"{label} 60.0 %" in table, table
    assert f"-> {label} (60% of the rollout actors' time) bounds the learner:" in table, table
    for key in keys:
        assert key in table, (key, table)


def test_the_report_says_the_learner_is_the_bound_when_the_actors_wait_for_tickets():
    table = " ".join(summary_table([_record(0.02, rate_limited=0.7, env_step=0.2) for _ in range(4)]).split())
    assert "the learner waited 2% for data (under 10%): it is the bound, not the rollout host" in table, table
    assert "largest stage is ticket wait (70%)" in table
    # Host-bound while the actors wait for tickets: the ticket rule holds them, not the host's work.
    table = " ".join(summary_table([_record(0.4, rate_limited=0.7, env_step=0.2) for _ in range(4)]).split())
    assert "ticket wait (70% of the rollout actors' time) bounds the learner: nothing on the host" in table
    assert "replay.max_policy_lag" in table
    # Records from before the stages were timed: no section, no verdict.
    assert "rollout actors, share" not in summary_table([{M.ITERATION: 1, M.HOST_BOUND_FRACTION: 0.5}])


def test_every_config_key_the_advice_names_exists():
    """Advice the config cannot follow is no advice: every `section.key` it names is a key of the schema."""
    import re

    schema = {f"{section.name}.{key.name}" for section in dataclasses.fields(config_mod.Config)
              for key in dataclasses.fields(section.default_factory)}
    named = {m for text in ADVICE.values() for m in re.findall(r"\b[a-z]+\.[a-z_]+\b", text)}
    assert named and named <= schema, named - schema
    assert set(ADVICE) == set(STAGES) and math.isclose(HOST_BOUND_NAMED, 0.1)
