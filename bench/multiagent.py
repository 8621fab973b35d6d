"""Many agents, side by side in one run: a shared policy on mpe2's simple_spread against a random policy,
Connect Four by self-play scored against a random and a one-step-lookahead player as it trains, and two trained
policies against each other (mpe2's simple_tag: predators and prey, configs/predator_prey.yaml), each one's
return as both train, against random play.

    python bench/multiagent.py [--seeds 0 1] [--spread-steps 300000] [--c4-steps 600000] [--tag-steps 300000]
                                [--parts spread c4 tag rllib] [--c4-final-games 1000] [--c4-set KEY=VALUE ...]

Needs the multiagent extra (pip install -e '.[multiagent]'). Every run is in process (ray.address: inprocess,
one learner), so the figures are the algorithm's, not the cluster's. Connect Four's win rates come from periodic
evaluation as it trains (100 games, argmax play) and, for the final policy, from --c4-final-games games in argmax
and in sampled play, against players it never trained against; the pass rule is the issue's: the final policy
wins > 0.95 of its games against a uniformly random player, on every seed.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench._common import ROOT, cli, local_ray, parser, table  # noqa: E402
from bench._train import train  # noqa: E402
from cluster import config as config_mod  # noqa: E402


def random_spread_return(cfg, episodes: int, seed: int, by_policy: bool = False):
    """Mean per-agent episode return of uniformly random actions in the config's game (``by_policy``: a list of
    each policy's agents' means, in multiagent.policies order)."""
    from actors.envs import make_vector_env

    env = make_vector_env(cfg.env.id, cfg.rollout.envs_per_actor, env_kwargs=dict(cfg.env.kwargs),
                          multiagent=cfg.multiagent.env_args())
    rng = np.random.default_rng(seed)
    env.reset(seed=seed)
    returns, running = [], np.zeros(env.num_envs)
    while len(returns) < episodes:
        _, rew, term, trunc, finals = env.step(rng.integers(env.single_action_space.n, size=env.num_envs))
        running += rew
        for i in finals:
            returns.append((running[i], env.slot_policy[i] if by_policy else 0))
            running[i] = 0.0
    env.close()
    returns = returns[:episodes]
    if not by_policy:
        return float(np.mean([r for r, _ in returns]))
    return [float(np.mean([r for r, p in returns if p == q])) for q in range(len(cfg.multiagent.policies))]


def final_games(run, graph, games: int, seed: int) -> dict:
    """The run's final weights against each fixed player (random, heuristic) over ``games`` games, argmax and
    sampled play: {play: {player: {win, draw, loss}}}. The rollouts' own sampler plays them (the seats alternate
    per game), from reset seeds the training never used."""
    from actors.evaluator import Evaluator
    from cluster import checkpoint

    weights = {k: v.numpy() for k, v in checkpoint.load(run.result.checkpoint_path)["learner"]["model"].items()}
    out = {}
    for play, deterministic in (("argmax", True), ("sampled", False)):
        evaluator = Evaluator(sampler_kwargs=graph.sampler_kwargs(seed + 10_000), episodes=games,
                              deterministic=deterministic, opponents=["random", "heuristic"])
        result = evaluator.run(0, weights)
        out[play] = {who: {o: result[f"{o}_rate/{who}"] for o in ("win", "draw", "loss")}
                     for who in ("random", "heuristic")}
    return out


def rllib_config(cfg, seed: int):
    """RLlib 2.60's PPOConfig (new API stack) with our config's hyperparameters, as far as its config allows. Not
    matched: RLlib clips the value loss's squared error, not V (vf_clip_param inf: unclipped, as our configs);
    its value loss is vf_loss_coeff * MSE against our vf_coef * 0.5 * MSE (vf_loss_coeff = 0.5 * vf_coef: the same
    gradient); Adam eps 1e-8 (ours 1e-5); advantages normalised per train batch (ours per minibatch); its heads keep
    torch's default init (ours orthogonal 0.01 / 1.0); it samples, then updates (policy lag 0)."""
    import math

    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.callbacks.callbacks import RLlibCallback
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    class EpisodeReturns(RLlibCallback):
        """Every completed episode's full return, kept on the env runner for ``pop_returns``: RLlib cuts episodes
        into chunks at every sample() call, and hands the earlier ones in as ``prev_episode_chunks``."""

        def on_episode_end(self, *, episode, env_runner=None, prev_episode_chunks=None, **kwargs):
            ret = episode.get_return() + sum(c.get_return() for c in (prev_episode_chunks or ()))
            env_runner.__dict__.setdefault("_bench_returns", []).append(float(ret))

    L = cfg.learner.num_learners
    lr = [[0, cfg.learner.lr], [cfg.run.total_env_steps, 0.0]] if cfg.learner.anneal_lr else cfg.learner.lr
    return (
        PPOConfig()
        .framework("torch")
        .env_runners(num_env_runners=cfg.rollout.num_actors, num_envs_per_env_runner=cfg.rollout.envs_per_actor,
                     rollout_fragment_length=cfg.rollout.fragment_length,
                     num_cpus_per_env_runner=cfg.rollout.num_cpus_per_actor, batch_mode="truncate_episodes")
        .learners(num_learners=0 if L == 1 else L, num_gpus_per_learner=0)
        .training(
            train_batch_size_per_learner=cfg.learner.batch_size // L, minibatch_size=cfg.learner.minibatch_size // L,
            num_epochs=cfg.ppo.update_epochs, lr=lr, gamma=cfg.ppo.gamma, lambda_=cfg.ppo.gae_lambda,
            clip_param=cfg.ppo.clip_coef, vf_loss_coeff=0.5 * cfg.ppo.vf_coef, vf_clip_param=float("inf"),
            entropy_coeff=cfg.ppo.ent_coef, grad_clip=cfg.ppo.max_grad_norm, grad_clip_by="global_norm",
            use_kl_loss=False, kl_coeff=0.0)
        .rl_module(model_config=DefaultModelConfig(
            fcnet_hiddens=list(cfg.learner.hidden_sizes), fcnet_activation="tanh", vf_share_layers=False,
            fcnet_kernel_initializer="orthogonal_", fcnet_kernel_initializer_kwargs={"gain": math.sqrt(2)},
            fcnet_bias_initializer="zeros_"))
        .callbacks(EpisodeReturns)
        .reporting(metrics_num_episodes_for_smoothing=cfg.run.target_window)
        .debugging(seed=seed, log_level="ERROR")
    )


def pop_returns(env_runner) -> list[float]:
    """The returns ``rllib_config``'s callback kept on an env runner since the last call."""
    return env_runner.__dict__.pop("_bench_returns", [])


def rllib_spread(cfg, seed: int, agent_steps: int) -> dict:
    """RLlib 2.60's multi-agent PPO (new API stack, one module shared by the 3 agents) on the same simple_spread
    game with our config's hyperparameters (``rllib_config``, with its listed gaps; and no agent index: RLlib's
    PettingZoo wrapper has none), to the same agent steps. Per-agent return: each episode's return summed over its
    agents, over the agents (simple_spread's reward is mostly shared)."""
    import collections

    from ray.rllib.env.wrappers.pettingzoo_env import ParallelPettingZooEnv
    from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS, NUM_AGENT_STEPS_SAMPLED_LIFETIME
    from ray.tune.registry import register_env

    from actors.envs import _pettingzoo

    module, kwargs = _pettingzoo(cfg.env.id), dict(cfg.env.kwargs)
    register_env("ascent_spread", lambda _: ParallelPettingZooEnv(module.parallel_env(**kwargs)))
    agents = len(module.parallel_env(**kwargs).possible_agents)
    config = (rllib_config(cfg, seed).environment("ascent_spread")
              .env_runners(num_envs_per_env_runner=cfg.rollout.envs_per_actor // agents)
              .multi_agent(policies={"shared"}, policy_mapping_fn=lambda agent_id, episode, **kw: "shared"))
    window: collections.deque = collections.deque(maxlen=cfg.run.target_window)
    t0 = time.perf_counter()
    algo = config.build_algo()
    try:
        steps = 0
        while steps < agent_steps:
            r = algo.train()
            for rets in algo.env_runner_group.foreach_env_runner(pop_returns, local_env_runner=False):
                window.extend(ret / agents for ret in rets)
            steps = int(r.get(NUM_AGENT_STEPS_SAMPLED_LIFETIME)
                        or sum(r[ENV_RUNNER_RESULTS][NUM_AGENT_STEPS_SAMPLED_LIFETIME].values()))
    finally:
        algo.stop()
    return {"seed": seed, "agent_steps": steps, "rllib": float(np.mean(window)), "seconds": time.perf_counter() - t0}


def about_eight(curve: list) -> list:
    """About eight rows of a learning curve, evenly spaced, and its last."""
    rows = curve[::max(1, len(curve) // 8)]
    return rows + [c for c in curve[-1:] if c not in rows]


def make_parser():
    p = parser(__doc__, seeds=[0, 1])
    p.add_argument("--spread-steps", type=int, default=300_000)
    p.add_argument("--c4-steps", type=int, default=600_000)
    p.add_argument("--tag-steps", type=int, default=300_000)
    p.add_argument("--c4-config", default=str(ROOT / "configs/connect_four.yaml"))
    p.add_argument("--c4-set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for the Connect Four runs")
    p.add_argument("--c4-final-games", type=int, default=1000,
                   help="games of the final policy against each fixed player, argmax and sampled play")
    p.add_argument("--parts", nargs="+", default=["spread", "c4", "tag"], choices=["spread", "c4", "tag", "rllib"],
                   help="rllib: simple_spread on RLlib's multi-agent PPO too (the rllib extra), to --spread-steps")
    return p


def run(args):
    out: dict = {"spread": [], "connect_four": [], "tag": [], "rllib": []}
    with tempfile.TemporaryDirectory() as tmp:
        def train_in_process(config: str, seed: int, steps: int, extra=(), on_built=None):
            """(config, Trained, seconds from before the graph build to after the shutdown)."""
            cfg = config_mod.load(config, ["ray.address=inprocess", f"run.seed={seed}", f"run.total_env_steps={steps}",
                                           *extra])
            t0 = time.perf_counter()
            run = train(cfg, Path(tmp) / f"{Path(config).stem}{seed}", on_built=on_built)
            return cfg, run, time.perf_counter() - t0

        for seed in args.seeds if "spread" in args.parts else []:
            cfg, run, seconds = train_in_process(str(ROOT / "configs/simple_spread.yaml"), seed, args.spread_steps)
            last = run.records[-1]
            out["spread"].append({"seed": seed, "env_steps": last["env_steps"], "seconds": seconds,
                                  "ours": last["episode_return_mean"],
                                  "first": run.records[0]["episode_return_mean"],
                                  "random": random_spread_return(cfg, 480, seed)})
        if "rllib" in args.parts:
            with local_ray(4):
                for seed in args.seeds:
                    cfg = config_mod.load(str(ROOT / "configs/simple_spread.yaml"), [
                        f"run.seed={seed}", f"run.total_env_steps={args.spread_steps}"])
                    out["rllib"].append(rllib_spread(cfg, seed, args.spread_steps))
        for seed in args.seeds if "c4" in args.parts else []:
            built: list = []
            cfg, run, seconds = train_in_process(args.c4_config, seed, args.c4_steps, args.c4_set,
                                                 on_built=lambda trainer: built.append(trainer.graph))
            curve = [(r["env_steps"], r["eval_policy_version"], r["eval_win_rate/random"],
                      r["eval_win_rate/heuristic"]) for r in run.records if r.get("eval_policy_version") is not None]
            curve = [c for i, c in enumerate(curve) if i == 0 or c[1] != curve[i - 1][1]]  # one row per evaluation
            out["connect_four"].append({"seed": seed, "curve": curve, "seconds": seconds,
                                        "final": final_games(run, built[0], args.c4_final_games, seed)})
        for seed in args.seeds if "tag" in args.parts else []:
            cfg, run, seconds = train_in_process(str(ROOT / "configs/predator_prey.yaml"), seed, args.tag_steps)
            names = list(cfg.multiagent.policies)
            curve = [(r["env_steps"], *(r[f"policy/{n}/episode_return_mean"] for n in names)) for r in run.records]
            out["tag"].append({"seed": seed, "policies": names, "curve": curve, "seconds": seconds,
                               "random": random_spread_return(cfg, 960, seed, by_policy=True)})
    if out["spread"]:
        print("\nsimple_spread_v3, shared policy (3 agents), mean per-agent episode return over the last 96 episodes")
        table([("seed", ">4"), ("env steps", ">10,"), ("ours", ">8.1f"), ("first", ">8.1f"), ("random", ">8.1f"),
               ("seconds", ">8.0f")],
              [(r["seed"], r["env_steps"], r["ours"], r["first"], r["random"], r["seconds"]) for r in out["spread"]])
    if out["rllib"]:
        print("\nsimple_spread_v3 on RLlib's multi-agent PPO (one shared module, our hyperparameters), mean per-agent "
              "episode return over the last 96 episodes")
        table([("seed", ">4"), ("agent steps", ">12,"), ("rllib", ">8.1f"), ("seconds", ">8.0f")],
              [(r["seed"], r["agent_steps"], r["rllib"], r["seconds"]) for r in out["rllib"]])
    if out["connect_four"]:
        print("\nConnect Four by self-play: win rate (argmax play) against a random and a one-step-lookahead player, "
              "per periodic evaluation (100 games)")
    for r in out["connect_four"]:
        print(f"seed {r['seed']}, {r['seconds']:.0f} s:")
        table([("env steps", ">10,"), ("version", ">8"), ("vs random", ">10.2f"), ("vs heuristic", ">13.2f")],
              about_eight(r["curve"]))
    if out["connect_four"]:
        games = args.c4_final_games
        print(f"\nConnect Four, the final policy: win / draw / loss over {games:,} games against each player")
        table([("seed", ">4"), ("play", "<8"), ("vs random", ">20"), ("vs heuristic", ">20")],
              [(r["seed"], play, *("{win:.3f} / {draw:.3f} / {loss:.3f}".format(**r["final"][play][who])
                                   for who in ("random", "heuristic")))
               for r in out["connect_four"] for play in ("argmax", "sampled")])
        wins = [r["final"]["argmax"]["random"]["win"] for r in out["connect_four"]]
        print(f"argmax play against random: win rate {min(wins):.3f}-{max(wins):.3f} over {len(wins)} seeds; "
              f"> 0.95 on every seed: {'yes' if min(wins) > 0.95 else 'no'}")
    if out["tag"]:
        print("\nsimple_tag_v3, two trained policies (3 predators, 1 prey), each one's mean per-agent episode return "
              "over its last 96 episodes as both train; random: both sides uniformly random")
    for r in out["tag"]:
        print(f"seed {r['seed']}, {r['seconds']:.0f} s; random play: "
              + ", ".join(f"{n} {v:.1f}" for n, v in zip(r["policies"], r["random"])))
        table([("env steps", ">10,")] + [(n, ">10.1f") for n in r["policies"]], about_eight(r["curve"]))
    return out, None


if __name__ == "__main__":
    cli(make_parser, run)
