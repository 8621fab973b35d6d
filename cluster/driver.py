"""The driver: builds the actor graph from the config, watches it, stops it.

It is on the control path only. Data flows rollout actor -> replay shard ->
learner feed through the object store; the driver sees small stats dicts.
Learner iterations are submitted two deep so a learner never waits for the
driver between updates.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
import yaml

from actors.envs import describe_spaces
from actors.rollout import RemoteRolloutActor
from cluster import checkpoint, placement
from cluster.config import Config
from cluster.metrics import JsonlWriter, ProgressLine
from learner.actor import RemoteLearner
from learner.model import ActorCritic, PolicySpec
from pipeline.replay import ReplayShard
from pipeline.weights import WeightBoard

INFLIGHT_ITERATIONS = 2


@dataclass
class RunResult:
    reason: str  # "target_reached" | "total_env_steps" | "time_budget" | "interrupted"
    reached_target: bool
    env_steps: int
    iterations: int
    wall_s: float
    episode_return_mean: float
    run_dir: Path
    checkpoint_path: Path | None


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, t_start: float | None = None, quiet: bool = False,
                 profile_iterations: int = 0):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.t_start = t_start if t_start is not None else time.perf_counter()
        self.quiet = quiet
        self.profile_iterations = profile_iterations
        self.board = None
        self.shards: list = []
        self.learners: list = []
        self.rollouts: list = []
        self._profile_reported = False
        self.learner_pg = None

    # ------------------------------------------------------------------ build
    def build(self) -> None:
        cfg = self.cfg
        self.plan = plan = placement.plan(cfg)  # every check happens here, before any actor exists
        kind = plan.device_kind
        spaces = describe_spaces(cfg.env.id, cfg.env.max_episode_steps)
        self.spec = PolicySpec(hidden_sizes=tuple(cfg.learner.hidden_sizes), **spaces)
        self.device_kind = kind

        self.learner_pg = placement.reserve_learners(cfg, plan)
        # The board and shard i live on the node of rollout actor i (shard i's first producer).
        self.board = WeightBoard.options(**placement.pinned(plan.rollout_nodes[0])).remote()
        self.shards = [
            ReplayShard.options(**placement.pinned(plan.rollout_nodes[i])).remote(i, cfg.replay.capacity_fragments)
            for i in range(cfg.replay.num_shards)
        ]

        L = cfg.learner.num_learners
        learner_kwargs = dict(
            lr=cfg.learner.lr, adam_eps=cfg.learner.adam_eps, anneal_lr=cfg.learner.anneal_lr,
            total_updates=cfg.total_updates, update_epochs=cfg.ppo.update_epochs,
            minibatch_size=cfg.local_minibatch_size, max_grad_norm=cfg.ppo.max_grad_norm,
            precision=cfg.learner.precision, fp16_init_scale=cfg.learner.fp16_init_scale,
            fp16_growth_factor=cfg.learner.fp16_growth_factor, compile=cfg.learner.compile,
        )
        coefs = dict(clip_coef=cfg.ppo.clip_coef, clip_vloss=cfg.ppo.clip_vloss, vf_coef=cfg.ppo.vf_coef,
                     ent_coef=cfg.ppo.ent_coef, norm_adv=cfg.ppo.norm_adv)
        self.learners = [
            RemoteLearner.options(**placement.learner_options(plan, self.learner_pg, r)).remote(
                rank=r, world_size=L, device_kind=kind, spec=self.spec, learner_kwargs=learner_kwargs,
                coefs=coefs, seed=cfg.run.seed, torch_threads=cfg.learner.torch_threads,
                profile_iterations=self.profile_iterations, profile_dir=str((self.run_dir / "profile").resolve()))
            for r in range(L)
        ]
        # Rollout actors are created before waiting on anything, so all worker processes start in parallel.
        sampler_kwargs = dict(
            env_id=cfg.env.id, num_envs=cfg.rollout.envs_per_actor, fragment_length=cfg.rollout.fragment_length,
            policy_factory=functools.partial(ActorCritic, self.spec), gamma=cfg.ppo.gamma,
            gae_lambda=cfg.ppo.gae_lambda, seed=cfg.run.seed, max_episode_steps=cfg.env.max_episode_steps,
        )
        self.rollouts = [
            RemoteRolloutActor.options(num_cpus=cfg.rollout.num_cpus_per_actor,
                                       **placement.pinned(plan.rollout_nodes[i])).remote(
                actor_id=i, shard=self.shards[i % len(self.shards)], board=self.board,
                sampler_kwargs=sampler_kwargs, fragments_per_version=cfg.fragments_per_version,
                max_policy_lag=cfg.replay.max_policy_lag, torch_threads=cfg.rollout.torch_threads)
            for i in range(cfg.rollout.num_actors)
        ]
        master_addr, master_port = ray.get(self.learners[0].address.remote())
        ray.get([
            lr.setup.remote(master_addr, master_port, self._shards_for(r), self.board,
                            fragments_per_batch=cfg.fragments_per_learner,
                            max_policy_lag=cfg.replay.max_policy_lag,
                            prefetch_batches=cfg.learner.prefetch_batches)
            for r, lr in enumerate(self.learners)
        ])

        ray.get([a.start.remote() for a in self.rollouts])

    def placement_report(self) -> dict:
        """Node id of every actor, by role (what the placement test checks)."""
        def node_of(handles):
            return ray.get([h.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
                            for h in handles])
        return {"learners": node_of(self.learners), "rollouts": node_of(self.rollouts),
                "shards": node_of(self.shards), "board": node_of([self.board])[0]}

    def _shards_for(self, rank: int) -> list:
        """Learner r reads shards r, r+L, ...; with fewer shards than learners, learners share."""
        L, K = self.cfg.learner.num_learners, len(self.shards)
        mine = [s for i, s in enumerate(self.shards) if i % L == rank]
        return mine or [self.shards[rank % K]]

    # ------------------------------------------------------------------ run
    def run(self) -> RunResult:
        cfg = self.cfg
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(_plain(cfg.to_dict()), sort_keys=False))
        writer = JsonlWriter(self.run_dir / "metrics.jsonl")
        progress = ProgressLine(cfg.run.progress_interval_s, cfg.run.total_env_steps)
        window: collections.deque[float] = collections.deque(maxlen=cfg.run.target_window)
        episodes_total = 0
        inflight: collections.deque = collections.deque()
        iteration = 0
        env_steps = 0
        reason = None
        record: dict = {}
        t_train = time.perf_counter()
        last_t, last_steps, last_samples, samples_total = t_train, 0, 0, 0
        dropped_total = 0
        try:
            for _ in range(INFLIGHT_ITERATIONS):
                inflight.append([lr.train_iteration.remote() for lr in self.learners])
            while reason is None:
                results = ray.get(inflight.popleft())
                inflight.append([lr.train_iteration.remote() for lr in self.learners])
                iteration += 1
                r_stats = ray.get([a.stats.remote() for a in self.rollouts])
                s_stats = ray.get([s.stats.remote() for s in self.shards])
                for st in r_stats:
                    if st["error"]:
                        raise RuntimeError(f"rollout actor {st['actor_id']} failed: {st['error']}")
                    for ret, _ in st["episodes"]:
                        window.append(ret)
                    episodes_total += len(st["episodes"])
                env_steps = sum(st["env_steps"] for st in r_stats)
                samples_total += sum(res["samples"] for res in results)
                dropped_total += sum(res["dropped_stale"] for res in results)
                now = time.perf_counter()
                dt = max(now - last_t, 1e-9)
                ret_mean = float(np.mean(window)) if window else float("nan")
                lead = results[0]
                record = {
                    "iteration": iteration,
                    "time_s": now - self.t_start,
                    "train_time_s": now - t_train,
                    "env_steps": env_steps,
                    "env_steps_per_s": (env_steps - last_steps) / dt,
                    "learner_samples": samples_total,
                    "learner_samples_per_s": (samples_total - last_samples) / dt,
                    "policy_version": lead["version"],
                    "episodes": episodes_total,
                    "episodes_in_window": len(window),
                    "episode_return_mean": ret_mean,
                    "host_bound_fraction": float(np.mean([res["host_bound_fraction"] for res in results])),
                    "learner_wait_s": float(np.mean([res["wait_s"] for res in results])),
                    "learner_update_s": float(np.mean([res["update_s"] for res in results])),
                    "learner_iter_s": float(np.mean([res["iter_s"] for res in results])),
                    "feed_pull_s": float(np.mean([res["pull_s"] for res in results])),
                    "feed_collate_s": float(np.mean([res["collate_s"] for res in results])),
                    "h2d_ms": float(np.mean([res["h2d_ms"] for res in results])),
                    "h2d_bytes": int(sum(res["h2d_bytes"] for res in results)),
                    "host_syncs": int(lead["host_syncs"]),
                    "allreduce_calls": int(lead["allreduce_calls"]),
                    "policy_lag_mean": float(np.mean([res["policy_lag_mean"] for res in results])),
                    "policy_lag_max": int(max(res["policy_lag_max"] for res in results)),
                    "fragments_dropped_stale": dropped_total,
                    "replay_depth": int(sum(s["depth"] for s in s_stats)),
                    "replay_added": int(sum(s["added"] for s in s_stats)),
                    "rollout_backpressure_s": float(sum(st["backpressure_s"] for st in r_stats)),
                    "rollout_rate_limited_s": float(sum(st["rate_limited_s"] for st in r_stats)),
                    **{k: lead[k] for k in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction",
                                            "explained_variance", "grad_norm", "lr")},
                }
                if iteration == 1:
                    record["compile"] = lead["compile"]
                if lead["profile_trace"] and not self._profile_reported:
                    record["profile_trace"] = lead["profile_trace"]
                    self._profile_reported = True
                    if not self.quiet:
                        print(f"\nprofiler trace written: {lead['profile_trace']}", file=sys.stderr)
                writer.write(record)
                last_t, last_steps, last_samples = now, env_steps, samples_total
                if not self.quiet:
                    progress.update(record)
                reason = self._stop_reason(window, env_steps, now - t_train)
        except KeyboardInterrupt:
            reason = "interrupted"
        finally:
            writer.close()
        if not self.quiet and record:
            progress.update(record, force=True)
            progress.close()
        if reason != "interrupted":
            # The iterations still in flight need data: finish them before the producers stop.
            for refs in inflight:
                ray.get(refs)
        ckpt = self._save_checkpoint(env_steps, iteration, reason)
        ret_mean = float(np.mean(window)) if window else float("nan")
        return RunResult(
            reason=reason,
            reached_target=reason == "target_reached",
            env_steps=env_steps,
            iterations=iteration,
            wall_s=time.perf_counter() - self.t_start,
            episode_return_mean=ret_mean,
            run_dir=self.run_dir,
            checkpoint_path=ckpt,
        )

    def _stop_reason(self, window, env_steps: int, train_s: float) -> str | None:
        run = self.cfg.run
        if run.target_return is not None and len(window) == window.maxlen and np.mean(window) >= run.target_return:
            return "target_reached"
        if env_steps >= run.total_env_steps:
            return "total_env_steps"
        if run.time_budget_s is not None and train_s >= run.time_budget_s:
            return "time_budget"
        return None

    def _save_checkpoint(self, env_steps: int, iteration: int, reason: str) -> Path | None:
        try:
            state = ray.get(self.learners[0].state.remote(), timeout=30)
        except Exception:
            return None  # interrupted mid-update, or the learner is gone: nothing consistent to save
        payload = {
            **state,
            "env_steps": env_steps,
            "iteration": iteration,
            "stop_reason": reason,
            "config": _plain(self.cfg.to_dict()),
            "versions": checkpoint.package_versions(),
        }
        return checkpoint.save(self.run_dir / "checkpoints" / "final.pt", payload)

    # ------------------------------------------------------------------ teardown
    def shutdown(self) -> None:
        """Stop producers, then consumers, then kill every actor this driver made."""
        for group, timeout in ((self.rollouts, 5), (self.learners, 10)):
            refs = [a.stop.remote() for a in group]
            try:
                ray.get(refs, timeout=timeout)
            except Exception:
                pass  # stuck or dead: killed below either way
        for a in self.rollouts + self.learners + self.shards + ([self.board] if self.board else []):
            try:
                ray.kill(a)
            except Exception:
                pass
        self.rollouts, self.learners, self.shards, self.board = [], [], [], None
        if self.learner_pg is not None:
            try:
                ray.util.remove_placement_group(self.learner_pg)
            except Exception:
                pass
            self.learner_pg = None


def _plain(obj):
    """Tuples -> lists so the config serialises as plain YAML / weights_only-safe data."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj
