"""Many agents: PettingZoo envs as env slots (actors/multiagent.py), self-play pools, their config errors, and
short learning runs of each kind (a parallel game with a shared policy, Connect Four against a fixed player and by
self-play)."""

import functools
import json
import sys

import numpy as np
import pytest
import torch

from actors.envs import describe_env, make_env, make_vector_env
from actors.multiagent import (AgentSlotVectorEnv, PolicyOpponents, SeatEnv, _four_through, connect_four_move,
                               pettingzoo_module)
from actors.probe_envs import NameYourSeat
from actors.sampler import RolloutSampler, SamplerSettings
from cluster import config as config_mod
from cluster.config import ConfigError
from learner.model import ActorCritic
from learner.spec import spec_from_description
from tests.conftest import ROOT, train_to_end

SEATS = "actors.probe_envs:name_your_seat"
C4 = "pettingzoo.classic:connect_four_v3"
C4_MODALITIES = {"observation": {"kind": "vector", "normalize": False}}
MA = {"api": "auto", "opponent": "latest", "agent_index": False, "self_play": False}


def sampler_for(env_id, num_envs, T, modalities=None, multiagent=None, self_play=None, seed=0):
    desc = describe_env(env_id, modalities, multiagent=multiagent)
    spec = spec_from_description(desc, (32, 32))
    sampler = RolloutSampler(SamplerSettings(env_id=env_id, num_envs=num_envs, fragment_length=T, gamma=0.99,
                                             gae_lambda=0.95, seed=seed, modalities=modalities, preprocess_workers=0,
                                             multiagent=multiagent, self_play=self_play,
                                             action_mask_key=desc["action_mask"]), functools.partial(ActorCritic, spec))
    model = ActorCritic(spec)
    sampler.load_weights(0, {k: v.numpy() for k, v in model.state_dict().items()})
    return sampler, model


# ------------------------------------------------------------------------------------------ parallel games
def test_parallel_game_agents_fill_slots_and_an_agent_that_leaves_early_gets_filler_steps():
    """Slot g*K + k is agent k of game g; agent_2 leaves at step 4 (terminated there, once), its slot then has
    filler steps (reward 0, terminated, marked dead, no episode) until the game ends at step 8 and restarts."""
    K, S, L = 3, NameYourSeat.STEPS, NameYourSeat.LEAVES_AT
    env = make_vector_env(SEATS, 6, multiagent=MA)
    assert isinstance(env, AgentSlotVectorEnv) and env.num_agents == K and len(env.games) == 2
    env.reset(seed=0)
    right = np.tile(np.arange(K), 2)  # every agent names its own index
    for t in range(1, 2 * S + 1):
        obs, rew, term, trunc, finals = env.step(right)
        step = (t - 1) % S + 1
        for g in range(2):
            i0, i2 = g * K, g * K + 2
            assert rew[i0] == 1.0 and term[i0] == (step == S) and not trunc[i0]
            if step < L:
                assert rew[i2] == 1.0 and not term[i2] and not env.dead[i2]
            elif step == L:  # its real last step: terminated, its final observation in finals, not filler
                assert rew[i2] == 1.0 and term[i2] and not env.dead[i2] and i2 in finals
            else:  # filler until the game ends
                assert rew[i2] == 0.0 and term[i2] and env.dead[i2] and i2 not in finals
            assert (i0 in finals) == (step == S)
    env.close()


def test_a_sampler_reports_each_agents_episodes_and_no_filler_episodes():
    S, L = NameYourSeat.STEPS, NameYourSeat.LEAVES_AT
    sampler, _ = sampler_for(SEATS, 3, 2 * S, multiagent=MA)
    fragment = sampler.collect()
    # Two games of 8 steps: per game, two agents' episodes of 8 steps and one of 4; filler steps are in none.
    assert sorted(fragment.episode_lengths.tolist()) == [L, L, S, S, S, S]
    assert fragment.arrays["rewards"][L:S, 2].sum() == 0  # agent_2's filler steps pay nothing
    sampler.close()


def test_agent_index_extends_the_observation_with_a_one_hot_index():
    env = make_vector_env(SEATS, 3, multiagent=dict(MA, agent_index=True))
    obs = env.reset(seed=0)
    assert obs.shape == (3, 2 + 3)
    np.testing.assert_array_equal(obs[:, 2:], np.eye(3, dtype=np.float32))
    np.testing.assert_array_equal(obs[:, 0], 1.0)
    env.close()


def test_mpe2_simple_spread_runs_as_slots_with_per_agent_returns():
    pytest.importorskip("mpe2")
    sampler, _ = sampler_for("mpe2:simple_spread_v3", 6, 25, multiagent=MA)
    fragment = sampler.collect()
    assert fragment.arrays["obs/vector"].shape == (25, 6, 18)
    assert fragment.arrays["truncated"][-1].all()  # max_cycles 25: every agent's episode is cut at once
    assert len(fragment.episode_returns) == 6
    sampler.close()


# ------------------------------------------------------------------------------------------ turn-based games
def test_seat_env_alternates_seats_and_plays_the_other_seat_itself():
    env = make_env(C4, multiagent=dict(MA, opponent="random"))
    assert isinstance(env.unwrapped, SeatEnv)
    seats, outcomes = [], []
    for episode in range(6):
        obs, info = env.reset(seed=episode)
        seats.append(info["seat"])
        # The learning seat moves second every other episode: the opponent's first piece is already down.
        assert obs["observation"].sum() == (0 if info["seat"] == "player_0" else 1)
        done, total = False, 0.0
        while not done:
            legal = np.flatnonzero(obs["action_mask"])
            obs, reward, terminated, truncated, _ = env.step(int(legal[0]))
            total += reward
            done = terminated or truncated
        outcomes.append(total)
    assert seats == ["player_0", "player_1"] * 3
    assert set(outcomes) <= {-1.0, 0.0, 1.0}
    env.close()


def test_connect_four_heuristic_wins_when_it_can_and_blocks_when_it_must():
    rng = np.random.default_rng(0)
    board = np.zeros((6, 7, 2), np.int8)
    board[5, 0:3, 0] = 1  # three of its own on the bottom row: column 3 wins
    board[5, 4:6, 1] = 1
    board[4, 4, 1] = 1
    mask = np.ones(7, np.int8)
    assert connect_four_move({"observation": board, "action_mask": mask}, rng) == 3
    board = np.zeros((6, 7, 2), np.int8)
    board[3:6, 6, 1] = 1  # three of the other's stacked in column 6: it must block there
    board[5, 0, 0] = board[5, 2, 0] = 1
    assert connect_four_move({"observation": board, "action_mask": mask}, rng) == 6
    diagonal = np.zeros((6, 7), np.int8)
    for k in range(4):
        diagonal[5 - k, k] = 1
    assert _four_through(diagonal, 2, 3) and _four_through(diagonal[:, ::-1].copy(), 2, 3)  # both diagonals
    diagonal[5, 0] = 0
    assert not _four_through(diagonal, 2, 3)


def test_the_heuristic_beats_a_random_player_and_the_latest_policy_plays_the_other_seat():
    env = make_env(C4, multiagent=dict(MA, opponent="random"))
    wins = 0
    for episode in range(20):
        obs, _ = env.reset(seed=100 + episode)
        done = False
        while not done:
            obs, reward, terminated, truncated, _ = env.step(connect_four_move(obs, np.random.default_rng(episode)))
            done = terminated or truncated
        wins += reward > 0
    assert wins >= 17
    env.close()
    # Under the sampler, the other seat is the policy itself: its moves come from the sampler's module.
    sampler, _ = sampler_for(C4, 2, 8, C4_MODALITIES, multiagent=MA)
    assert all(e.unwrapped.opponent is sampler.opponents for e in sampler.env.envs)
    assert sampler.opponents.new_episode().module is sampler.policy
    sampler.close()


def test_self_play_pool_keeps_frozen_snapshots_every_k_versions():
    sampler, model = sampler_for(C4, 2, 8, C4_MODALITIES, multiagent=dict(MA, self_play=True),
                                 self_play={"snapshot_every": 2, "pool_size": 3, "sampling": "uniform"})
    states = {}
    for version in range(1, 8):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * version)
        states[version] = {k: v.numpy().copy() for k, v in model.state_dict().items()}
        sampler.load_weights(version, states[version])
        sampler.collect()
    pool = sampler.opponents.pool
    assert [s.version for s in pool] == [2, 4, 6]  # one every 2 versions from v0, the last 3 kept
    for snapshot in pool:  # frozen: each still has its own version's weights, not the newest
        for k, v in snapshot.module.state_dict().items():
            np.testing.assert_array_equal(v.numpy(), states[snapshot.version][k])
    assert sum(s.games for s in pool) > 0  # episodes were played against the pool and scored
    sampler.close()


def test_a_share_of_self_play_episodes_is_against_random_legal_moves():
    """multiagent.random_opponent_share: that share of episodes draws the random player instead of a snapshot, and
    its moves are legal (from the observation's mask) and spread over every legal column."""
    sampler, _ = sampler_for(C4, 4, 32, C4_MODALITIES, multiagent=dict(MA, self_play=True),
                             self_play={"snapshot_every": 2, "pool_size": 3, "sampling": "uniform",
                                        "random_share": 0.25})
    opponents = sampler.opponents
    drawn = [opponents.new_episode() for _ in range(800)]
    assert 150 < sum(d is opponents.random for d in drawn) < 250
    mask = np.array([1, 0, 1, 0, 0, 1, 0], dtype=np.int8)
    moves = opponents.act_batch([(opponents.random, "player_1", {"observation": None, "action_mask": mask})] * 300)
    assert set(moves) == {0, 2, 5}
    for _ in range(3):  # whole games (~20 of them), a quarter against random play
        sampler.collect()
    assert opponents.random.games > 0
    sampler.close()


def test_prioritized_sampling_prefers_the_snapshots_the_learner_loses_to():
    opponents = PolicyOpponents(None, None, None, None, self_play=True, sampling="prioritized", seed=0)
    from actors.multiagent import Snapshot

    strong, weak = Snapshot(1, None), Snapshot(2, None)
    strong.games, strong.wins = 100, 5.0
    weak.games, weak.wins = 100, 95.0
    opponents.pool = [strong, weak]
    drawn = [opponents.new_episode() for _ in range(400)]
    assert sum(d is strong for d in drawn) > 300
    opponents.sampling = "uniform"
    drawn = [opponents.new_episode() for _ in range(400)]
    assert 150 < sum(d is strong for d in drawn) < 250


# ------------------------------------------------------------------------------------------ bad input
C4_CFG = {"env": {"id": C4, "modalities": C4_MODALITIES}}


@pytest.mark.parametrize("data, message", [
    ({"multiagent": {"self_play": True}}, r"multiagent.self_play: True is set, but env.id 'CartPole-v1' is a "
                                          r"single-agent gymnasium env"),
    ({"env": {"id": SEATS}, "multiagent": {"self_play": True}}, r"multiagent.self_play: true needs a turn-based game"),
    ({"env": {"id": SEATS}, "rollout": {"envs_per_actor": 4}},
     r"rollout.envs_per_actor: 4 is not a whole number of .* games of 3 agents.*allowed: a multiple of 3"),
    (dict(C4_CFG, multiagent={"api": "parallel"}), r"multiagent.api: 'parallel', but .* has no parallel_env"),
    ({"env": {"id": "pettingzoo.classic:tictactoe_v3", "modalities": C4_MODALITIES},
      "multiagent": {"opponent": "heuristic"}}, r"multiagent.opponent: 'heuristic', and there is no heuristic player"),
    ({"env": {"id": "mpe2:simple_adversary_v3"}},
     r"agents 'adversary_0' and 'agent_0' have different observation spaces"),
    ({"multiagent": {"eval_opponents": ["pool"]}}, r"multiagent.eval_opponents.*'pool' is not allowed; allowed: "
                                                   r"random / heuristic|allowed: random, heuristic"),
    (dict(C4_CFG, multiagent={"self_play": True, "opponent": "random"}),
     r"multiagent.opponent: 'random' with multiagent.self_play: true"),
])
def test_bad_multiagent_input_is_one_line_naming_the_key(data, message):
    from cluster.graph import describe_env as describe

    with pytest.raises(ConfigError, match=message) as e:
        describe(config_mod.from_dict(data))
    assert "\n" not in str(e.value)


def test_a_pettingzoo_env_without_its_extra_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpe2", None)  # what an install without the multiagent extra looks like
    with pytest.raises(ValueError, match=r"'mpe2' is not installed; allowed: install the multiagent extra "
                                         r"\(pip install -e '.\[multiagent\]'\)"):
        pettingzoo_module("mpe2:simple_spread_v3")
    assert pettingzoo_module("CartPole-v1") is None
    assert pettingzoo_module("minigrid:MiniGrid-Fetch-5x5-N2-v0") is None  # a gymnasium registration


def test_dry_run_prints_each_agent_and_what_plays_it(tmp_path):
    import subprocess

    out = subprocess.run([sys.executable, "-m", "cluster.train", "--config", str(ROOT / "configs/connect_four.yaml"),
                          "--dry-run"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("# agent ")]
    assert len(lines) == 2 and lines[0].startswith("# agent 'player_0' (aec)")
    assert "self-play pool of the last 8 snapshots" in lines[1]


# ------------------------------------------------------------------------------------------ learning, short
def _records(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def test_a_shared_policy_learns_a_parallel_game_and_needs_the_agent_index_for_it(tmp_path):
    """NameYourSeat: only the agent's index tells the shared policy which action pays; with it the mean episode
    return nears the optimum (6.67), without it it cannot pass 8 / 3 in expectation. The window is the last two
    fragments' 96 episodes exactly (8 games of 3 agents, two games each per 16-step fragment), so it holds as many
    episodes of each agent and the blind bound is not a matter of which agents' episodes happen to be in it."""
    def run(index: bool, name: str):
        cfg = config_mod.load(None, [
            f"env.id={SEATS}", f"multiagent.agent_index={str(index).lower()}", "rollout.envs_per_actor=24",
            "rollout.fragment_length=16", "learner.batch_size=384", "learner.minibatch_size=96", "learner.lr=3e-3",
            "ppo.ent_coef=0.0", "run.total_env_steps=15000", "ray.address=inprocess", "run.target_window=96"])
        train_to_end(cfg, tmp_path / name)
        return _records(tmp_path / name)[-1]["episode_return_mean"]

    with_index, blind = run(True, "index"), run(False, "blind")
    assert with_index > 0.9 * NameYourSeat.OPTIMUM, with_index
    assert blind < NameYourSeat.STEPS / 3 + 0.3, blind


def _win_rate(cfg, spec, weights, player: str, episodes: int) -> tuple[float, float]:
    """(win rate, draw rate) of ``weights`` against ``player``, sampling its actions, on fixed reset seeds."""
    from actors.evaluator import Evaluator
    from cluster.graph import ActorGraph

    graph = ActorGraph(cfg, None, print)
    graph.spec = spec
    result = Evaluator(graph.sampler_settings(12345), graph.policy_factory(), episodes=episodes, deterministic=False,
                       opponents=[player]).run(0, weights)
    return result[f"win_rate/{player}"], result[f"draw_rate/{player}"]


@pytest.mark.long  # a learning run to a threshold (15 s in process on a quiet host): make test-long, CI runs it
def test_connect_four_learns_to_beat_a_random_player_by_self_play(tmp_path):
    """Self-play from scratch against its own snapshots only, then scored against a uniformly random player it
    never met, acting by sampling (argmax play of an untrained net already wins ~0.9 against random by stacking
    one column, so it would show little). An untrained policy wins half its games by symmetry (the seats
    alternate); after 40k env steps (~16 snapshots) it must win clearly more, on the same 300 reset seeds."""
    from cluster import checkpoint
    from cluster.evaluation import elo_against
    from cluster.graph import describe_env as describe

    cfg = config_mod.load(str(ROOT / "configs/connect_four.yaml"), [
        "ray.address=inprocess", "run.total_env_steps=40960", "eval.interval_iterations=19", "eval.episodes=16",
        "multiagent.eval_opponents=[random]", "run.checkpoint_interval_s=null",
        "multiagent.random_opponent_share=0.0"])  # its own snapshots only: it never meets the random player
    train_to_end(cfg, tmp_path / "run")
    rec = _records(tmp_path / "run")
    evaluated = [r for r in rec if r.get("eval_win_rate/random") is not None]
    assert evaluated and np.isfinite(evaluated[-1]["eval_elo/random"])  # periodic evaluation scores per player
    spec = describe(cfg)
    trained = {k: v.numpy() for k, v in checkpoint.load(tmp_path / "run/checkpoints/final.pt")["learner"]["model"].items()}
    untrained = {k: v.numpy() for k, v in ActorCritic(spec).state_dict().items()}
    before, _ = _win_rate(cfg, spec, untrained, "random", 300)
    after, draws = _win_rate(cfg, spec, trained, "random", 300)
    assert 0.38 <= before <= 0.62, before
    assert after >= before + 0.12 and after >= 0.65, (before, after)
    assert elo_against(after, draws) > elo_against(before, 0.0) + 80


# ------------------------------------------------------------------------------------------ faults
@pytest.mark.long  # a second model of test_faults.py's killed-actor test (`make test-long`; CI runs it)
def test_a_killed_rollout_actor_of_a_multiagent_run_is_replaced_and_the_accounting_stays_exact(ray_local, tmp_path):
    """Turn-based self-play on Ray, 2 rollout actors and 2 shards: one actor is SIGKILLed mid-run; it is
    replaced, every update still trains exactly its batch of fragments, none twice, and the run ends on its
    env-step budget."""
    from tests.test_env_faults import multiagent_run_with_a_killed_actor

    multiagent_run_with_a_killed_actor({"env": {"id": C4, "modalities": C4_MODALITIES},
                                        "multiagent": {"self_play": True, "snapshot_every": 2}}, tmp_path / "run")


def test_load_policy_of_a_parallel_game_acts_on_its_agents_slots(tmp_path):
    """A parallel game is no single-agent env, so the policy's spaces come from one agent's slot."""
    from cluster import checkpoint
    from cluster.api import load_policy
    from cluster.graph import describe_env as describe

    cfg = config_mod.from_dict({"env": {"id": SEATS}, "multiagent": {"agent_index": True},
                                "rollout": {"envs_per_actor": 3, "fragment_length": 16},
                                "learner": {"batch_size": 96, "minibatch_size": 48}})
    model = ActorCritic(describe(cfg))
    checkpoint.save(tmp_path / "ckpt.pt", {"learner": {"model": model.state_dict(), "version": 0},
                                           "config": cfg.to_dict(), "versions": checkpoint.package_versions()})
    policy = load_policy(tmp_path / "ckpt.pt", trust_code=True)
    assert policy.observation_space.shape == (2 + 3,)
    env = make_vector_env(SEATS, 3, multiagent=cfg.multiagent.env_args())
    actions = policy.act(env.reset(seed=0), deterministic=True)
    assert actions.shape == (3,) and set(actions.tolist()) <= {0, 1, 2}
    env.close()


def test_the_self_play_pool_is_learner_rank_0s_checkpointed_and_resumed(tmp_path):
    """Self-play in process: the rollout actor's pool is the one learner rank 0 keeps (the same versions, a snapshot
    every 2 versions, the last 3), the checkpoint holds those snapshots, and a resumed run's actor plays them from
    its first fragment on instead of starting a pool from the newest weights."""
    import time

    from cluster import checkpoint
    from cluster.driver import Trainer
    from pipeline import runtime

    cfg = config_mod.from_dict({
        "env": {"id": C4, "modalities": C4_MODALITIES},
        "multiagent": {"self_play": True, "snapshot_every": 2, "pool_size": 3},
        "rollout": {"envs_per_actor": 8, "fragment_length": 32},
        "learner": {"batch_size": 256, "minibatch_size": 128, "hidden_sizes": [32, 32]},
        "run": {"total_env_steps": 4096, "checkpoint_interval_s": None}, "ray": {"address": "inprocess"}})

    def run(resume=None, steps=4096):
        trainer = Trainer(config_mod.from_dict({**cfg.to_dict(), "run": {**cfg.to_dict()["run"],
                                                                         "total_env_steps": steps}}),
                          tmp_path / "run", quiet=True, resume=resume)
        try:
            trainer.build()
            actor = trainer.graph.rollouts[0]
            deadline = time.monotonic() + 60
            while not runtime.get(actor.opponent_pool.remote()) and time.monotonic() < deadline:
                time.sleep(0.02)
            first = runtime.get(actor.opponent_pool.remote())
            trainer.run()
            return first, runtime.get(actor.opponent_pool.remote())
        finally:
            trainer.shutdown()

    _, actors_pool = run()
    saved = checkpoint.load(tmp_path / "run" / "checkpoints" / "final.pt")
    pool = [version for version, _ in saved["learner"]["self_play_pool"]]
    assert len(pool) == 3 and all(b - a >= 2 for a, b in zip(pool, pool[1:])), pool
    # The actor plays rank 0's pool as of the last weights it loaded: at most the final version's publish behind.
    assert actors_pool == pool or actors_pool == [pool[0] - 2] + pool[:-1], (actors_pool, pool)
    weights = saved["learner"]["self_play_pool"][-1][1]
    assert set(weights) == set(saved["learner"]["model"])
    # The records score the learning seat against the pool: win + draw + loss = 1, and the Elo-style rating.
    from cluster.evaluation import elo_against

    last = _records(tmp_path / "run")[-1]
    assert last["pool_win_rate"] + last["pool_draw_rate"] + last["pool_loss_rate"] == pytest.approx(1.0)
    assert last["pool_win_rate"] == last["episode_success_rate"]
    assert last["pool_elo"] == pytest.approx(elo_against(last["pool_win_rate"], last["pool_draw_rate"]))

    first, _ = run(resume=saved, steps=8192)
    # Rank 0 publishes the checkpoint's version with the checkpoint's pool (plus that version, when a snapshot is
    # due there): the resumed actor's first pool is the saved one, not one started from the newest weights.
    version = saved["learner"]["version"]
    assert first in (pool, pool[1:] + [version]), (first, pool, version)
