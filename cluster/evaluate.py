"""Evaluate a trained policy: ``python -m cluster.evaluate RUN_OR_CHECKPOINT --episodes 20 --deterministic``.

Plays ``--episodes`` episodes, one after another in one env made as the run made them (seeds ``--seed``,
``--seed + 1``, ...), and prints the mean and std of the return, the success rate (episodes with a positive return,
the rule ``run.target_success_rate`` uses) where the config sets a success target, the mean episode length and the
env steps per second. ``--video DIR`` records every episode with gymnasium's RecordVideo (needs moviepy: the
``video`` extra). A parallel multi-agent game plays ``--episodes`` games and counts every agent's episode, or with
``--policy NAME`` (a run with several policies) only that policy's agents'. Bad input (no checkpoint, a checkpoint
that does not fit, an env that cannot render, an unknown policy) is one line and exit code 2. Under the run's
``env.isolation: process`` the env lives in a sandboxed child, as in training (``cluster.api.Policy.make_env``), and
``--video`` is refused (frames do not cross the sandbox).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import numpy as np

from cluster.config import ArgumentParser, ConfigError

EXIT_OK, EXIT_BAD_INPUT = 0, 2
#: The most episodes one evaluation plays: eval.episodes' maximum (every episode's return is kept).
MAX_EPISODES = 100_000


def writable_directory(path: str, flag: str) -> Path:
    """``path`` as a directory this process can write into (made if missing), or a ConfigError naming ``flag``."""
    where = Path(path)
    try:
        where.mkdir(parents=True, exist_ok=True)
        if not os.access(where, os.W_OK | os.X_OK):
            raise PermissionError("not writable by this user")
    except OSError as e:
        reason = e.strerror or str(e)
        raise ConfigError(f"{flag}: {path!r} cannot be a directory written here ({type(e).__name__}: {reason}); "
                          f"allowed: a directory this process can create and write") from None
    return where


def evaluate_games(policy, games: int, agents: int, *, deterministic: bool = True, seed: int = 0,
                   only_policy: str | None = None, max_steps_per_game: int = 1_000_000) -> dict:
    """A parallel multi-agent game: ``games`` games one after another (game g reset with seed ``seed + g``), every
    agent played by the run's policy (each by its own under ``multiagent.policies``). The statistics are over the
    agents' episodes: all of them, or (``only_policy``) those of that policy's agents."""
    from actors.envs import make_vector_env

    cfg = policy.config
    env = make_vector_env(cfg.env.id, agents, cfg.env.max_episode_steps, dict(cfg.env.kwargs), (),
                          cfg.multiagent.env_args())
    names = list(cfg.multiagent.policies)
    wanted = (np.asarray(env.slot_policy) == names.index(only_policy) if only_policy is not None
              else np.ones(agents, dtype=bool))
    returns, lengths, steps_total = [], [], 0
    t0 = time.perf_counter()
    try:
        for game in range(games):
            obs = env.reset(seed=seed + game)
            total, length = np.zeros(agents), np.zeros(agents, dtype=np.int64)
            for _ in range(max_steps_per_game):  # a game that never ends is cut there, as evaluate() cuts an episode
                obs, reward, terminated, truncated, finals = env.step(policy.act(obs, deterministic=deterministic))
                steps_total += 1
                live = ~env.dead  # a filler step of an agent not in the game is no part of an episode
                total[live] += reward[live]
                length[live] += 1
                for i in finals:  # an agent's episode ended (left, won, lost, or the game was cut)
                    if wanted[i]:
                        returns.append(float(total[i]))
                        lengths.append(int(length[i]))
                    total[i], length[i] = 0.0, 0
                if env.game_step[0] == 0:  # every agent's episode ended: the env reset the game in this step
                    break
    finally:
        env.close()
    seconds = time.perf_counter() - t0
    out = {"episodes": len(returns), "return_mean": float(np.mean(returns)), "return_std": float(np.std(returns)),
           "length_mean": float(np.mean(lengths)), "steps_per_s": steps_total * agents / max(seconds, 1e-9),
           "returns": returns}
    if cfg.run.target_success_rate is not None:
        out["success_rate"] = float(np.mean(np.asarray(returns) > 0))
    return out


def evaluate(policy, episodes: int, *, deterministic: bool = True, seed: int = 0, video_dir: str | None = None,
             max_steps_per_episode: int = 1_000_000) -> dict:
    """Play ``episodes`` episodes with ``policy`` (a ``cluster.api.Policy``); returns their statistics."""
    if video_dir is not None:
        import gymnasium as gym

        if policy.config.env.isolation_args() is not None:
            raise ConfigError(f"--video: env.isolation: {policy.config.env.isolation} keeps {policy.config.env.id!r} "
                              f"in a sandboxed child, and its frames do not cross the sandbox; allowed: "
                              f"env.isolation: none for a video (--config, if you trust the env)")
        probe = policy.make_env()
        modes = probe.metadata.get("render_modes") or []
        probe.close()
        if "rgb_array" not in modes:
            raise ConfigError(f"--video: {policy.config.env.id!r} cannot render rgb_array frames (its render modes: "
                              f"{', '.join(modes) or 'none'})")
        if importlib.util.find_spec("moviepy") is None:  # RecordVideo writes with it
            raise ConfigError("--video: needs moviepy (pip install -e '.[video]')")
        env = gym.wrappers.RecordVideo(policy.make_env(render_mode="rgb_array"), str(video_dir),
                                       episode_trigger=lambda _: True, disable_logger=True)
    else:
        env = policy.make_env()
    returns, lengths = [], []
    t0 = time.perf_counter()
    try:
        for episode in range(episodes):
            obs, _ = env.reset(seed=seed + episode)
            policy.reset()  # a recurrent policy starts the episode from a zero state
            total, steps, done = 0.0, 0, False
            while not done and steps < max_steps_per_episode:
                obs, reward, terminated, truncated, _ = env.step(policy.act(obs, deterministic=deterministic))
                total += float(reward)
                steps += 1
                done = terminated or truncated
            returns.append(total)
            lengths.append(steps)
    finally:
        env.close()
    seconds = time.perf_counter() - t0
    out = {"episodes": episodes, "return_mean": float(np.mean(returns)), "return_std": float(np.std(returns)),
           "length_mean": float(np.mean(lengths)), "steps_per_s": sum(lengths) / max(seconds, 1e-9),
           "returns": returns}
    if policy.config.run.target_success_rate is not None:
        out["success_rate"] = float(np.mean(np.asarray(returns) > 0))
    return out


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m cluster.evaluate", description=__doc__.splitlines()[0])
    p.add_argument("run", metavar="RUN_OR_CHECKPOINT", help="a run directory (its newest checkpoint) or a .pt file")
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--deterministic", action="store_true", help="act with the policy's mode instead of sampling")
    p.add_argument("--video", metavar="DIR", help="record every episode as an mp4 into DIR")
    p.add_argument("--seed", type=int, default=0, help="the first episode's reset seed (then +1 per episode)")
    p.add_argument("--config", help="run under this config instead of the one saved with the checkpoint")
    p.add_argument("--trust-code", action="store_true",
                   help="let the checkpoint's own config import what it names to make the env (a module:Id env id, "
                        "env.wrappers); refused without it, since a checkpoint may come from anyone")
    p.add_argument("--device", default="cpu")
    p.add_argument("--policy", help="a run with several policies (multiagent.policies): the statistics of this "
                                    "policy's agents' episodes (every agent still plays with its own policy)")
    args = p.parse_args(argv)
    from cluster.api import MAX_SEED, load_policy, torch_device

    try:
        if not 1 <= args.episodes <= MAX_EPISODES:
            raise ConfigError(f"--episodes: {args.episodes} is out of range; allowed: 1 to {MAX_EPISODES:,} (as "
                              f"eval.episodes)")
        if not 0 <= args.seed <= MAX_SEED:
            raise ConfigError(f"--seed: {args.seed} is out of range; allowed: 0 to {MAX_SEED} (as run.seed)")
        if args.device != "cpu":
            try:
                torch_device(args.device)
            except ConfigError as e:
                raise ConfigError(f"--{e}") from None
        if args.video is not None:
            writable_directory(args.video, "--video")
        policy = load_policy(args.run, device=args.device, seed=args.seed, config=args.config,
                             trust_code=args.trust_code)
        names = list(policy.config.multiagent.policies)
        if args.policy is not None and args.policy not in names:
            raise ConfigError(f"--policy: {args.policy!r} is not a policy of this run; allowed: "
                              f"{', '.join(names) if names else 'none (it has one shared policy: leave it out)'}")
        # A parallel game is played as its agents' slots (load_policy found its agents while making the spaces).
        agents = policy.agents["slots_per_game"] if policy.agents and policy.agents["api"] == "parallel" else None
        if agents is None:
            stats = evaluate(policy, args.episodes, deterministic=args.deterministic, seed=args.seed,
                             video_dir=args.video)
        elif args.video:
            raise ConfigError(f"--video: {policy.config.env.id!r} is a parallel multi-agent game, which is not "
                              f"recorded; allowed: leave --video out")
        else:  # --episodes games, every agent's episode counted (or only --policy's agents')
            stats = evaluate_games(policy, args.episodes, agents, deterministic=args.deterministic, seed=args.seed,
                                   only_policy=args.policy)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    line = (f"{policy.config.env.id}: {stats['episodes']} episodes "
            f"({'deterministic' if args.deterministic else 'sampled'}) | return {stats['return_mean']:.2f} ± "
            f"{stats['return_std']:.2f} | length {stats['length_mean']:.1f}")
    if "success_rate" in stats:
        line += f" | success {stats['success_rate']:.3f}"
    line += f" | {stats['steps_per_s']:,.0f} steps/s"
    if args.video:
        line += f" | videos in {Path(args.video)}"
    print(line)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
