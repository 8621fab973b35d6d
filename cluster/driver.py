"""The driver: builds the actor graph from the config, watches it, stops it.

It is on the control path only. Data flows rollout actor -> replay shard ->
learner feed through the object store; the driver sees small stats dicts.
Learner iterations are submitted two deep so a learner never waits for the
driver between updates.

Routing and the rate limit are not the driver's: the supply board's ticket
ledger (``pipeline/supply.py``) decides who makes which fragment and which
learner takes it, for any number of actors, shards and learners. The driver
only tells the board what it saw die or change.

Failures it handles: a rollout actor or a replay shard that dies is replaced
(same id, same place) and training goes on; the board has exactly the lost
fragments made again, and the metrics count it (``rollout_restarts``,
``shard_restarts``, ``fragments_lost``). The driver never waits on the learners
without a deadline: it checks the other actors every second, ends the run at
``run.time_budget_s`` or Ctrl-C even while a learner is stuck, and a learner
that gets no batch for ``run.stall_timeout_s`` stops the run with a one-line
report of what it waits for. A learner that dies takes the whole learner group
down with it (the others would hang in the all-reduce); the group is restarted
from the newest checkpoint, at most ``run.max_learner_restarts`` times.
Checkpoints (periodic and final) also let ``--resume`` continue a stopped run.
"""

from __future__ import annotations

import collections
import functools
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import ray
import yaml
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.rollout import RemoteRolloutActor
from cluster import checkpoint, control, placement, report
from cluster.config import Config, ConfigError
from cluster.metrics import JsonlWriter, ProgressLine, TensorBoardWriter
from learner.actor import LearnerStalled, RemoteLearner
from learner.model import PolicySpec
from learner.multimodal import make_policy, spec_from_description
from pipeline.replay import ReplayShard
from pipeline.supply import SupplyBoard

INFLIGHT_ITERATIONS = 2
HEALTH_CHECK_S = 1.0  # longest the driver waits on learners before checking the other actors
# A learner reports its own stall after run.stall_timeout_s; the driver gives up on an iteration this much later
# (a rank stuck somewhere the feed's deadline does not cover, e.g. an all-reduce whose peer vanished).
ITERATION_GRACE_S = 30.0
PPO_STATS = ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "explained_variance", "grad_norm",
             "lr")


class RolloutFailed(RuntimeError):
    """A rollout actor's loop raised (bad observation, env error): replacing it would fail the same way."""


class RunStalled(RuntimeError):
    """A learner got no batch within run.stall_timeout_s, or an iteration outlived every deadline."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank  # the stalled learner: it is between updates, so its state is a consistent checkpoint


class _BudgetSpent(Exception):
    """run.time_budget_s passed while the driver waited on the learners."""


class LearnerGroupDied(RuntimeError):
    pass


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


@dataclass
class RunState:
    """The driver's counters: what a checkpoint carries so a resumed run continues them."""

    window: collections.deque
    iteration: int = 0
    env_steps_retired: int = 0  # steps of actors that are gone (replaced, removed, or before a resume)
    episodes_total: int = 0
    samples_total: int = 0
    dropped_total: int = 0  # these three: counted by supply boards of the runs this one resumes
    fragments_lost: int = 0
    fragments_produced: int = 0
    rollout_restarts: int = 0
    shard_restarts: int = 0
    learner_restarts: int = 0
    checkpoints_skipped: int = 0
    train_time_before_s: float = 0.0  # training time of the runs this one resumes
    board: dict = field(default_factory=dict)  # the supply board's newest counters (this run's part)
    actor_steps: dict = field(default_factory=dict)  # actor id -> env steps of its current incarnation

    @property
    def env_steps(self) -> int:
        return self.env_steps_retired + sum(self.actor_steps.values())

    def retire(self, actor_id: int) -> None:
        self.env_steps_retired += self.actor_steps.pop(actor_id, 0)

    @property
    def dropped(self) -> int:
        """Fragments made and then not trained on (updates skipped by a learner-group restart)."""
        return self.dropped_total + self.board.get("voided_stored", 0)

    @property
    def lost(self) -> int:
        """Fragments given back to be made again (their actor, shard, add or learner died)."""
        return self.fragments_lost + self.board.get("refunded", 0)

    @property
    def produced(self) -> int:
        return self.fragments_produced + self.board.get("fragments_stored", 0)

    def to_checkpoint(self) -> dict:
        return {"window": list(self.window), "iteration": self.iteration, "env_steps": self.env_steps,
                "episodes_total": self.episodes_total, "samples_total": self.samples_total,
                "dropped_total": self.dropped, "rollout_restarts": self.rollout_restarts,
                "shard_restarts": self.shard_restarts, "learner_restarts": self.learner_restarts,
                "fragments_lost": self.lost, "fragments_produced": self.produced,
                "checkpoints_skipped": self.checkpoints_skipped}

    @classmethod
    def fresh(cls, window: int) -> "RunState":
        return cls(window=collections.deque(maxlen=window))

    @classmethod
    def from_checkpoint(cls, d: dict, window: int, train_time_s: float) -> "RunState":
        return cls(window=collections.deque(d["window"], maxlen=window), iteration=d["iteration"],
                   env_steps_retired=d["env_steps"], episodes_total=d["episodes_total"],
                   samples_total=d["samples_total"], dropped_total=d["dropped_total"],
                   rollout_restarts=d["rollout_restarts"], shard_restarts=d["shard_restarts"],
                   learner_restarts=d["learner_restarts"], fragments_lost=d["fragments_lost"],
                   fragments_produced=d.get("fragments_produced", 0),
                   checkpoints_skipped=d.get("checkpoints_skipped", 0), train_time_before_s=train_time_s)


def pipeline_metrics(per_actor: list[dict]) -> dict:
    """Multimodal pipeline metrics over rollout actors: latencies and staleness as the worst actor's, counts
    summed, queue depths summed (they are per actor)."""
    out: dict[str, float] = {}
    for stats in per_actor:
        for key, value in stats.items():
            worst = key.endswith("_ms") or key.endswith("max_staleness") or key.endswith("max_depth")
            out[key] = max(out.get(key, value), value) if worst else out.get(key, 0) + value
    return out


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, t_start: float | None = None, quiet: bool = False,
                 profile_iterations: int = 0, resume: dict | None = None):
        """``resume``: a checkpoint payload (``checkpoint.load``) to continue from."""
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.t_start = t_start if t_start is not None else time.perf_counter()
        self.quiet = quiet
        self.profile_iterations = profile_iterations
        self.resume = resume
        self.board = None
        self.shards: list = []
        self.learners: list = []
        self.rollouts: list = []
        self.preprocess_workers: list = []
        self.failure: str | None = None  # why the run stopped with reason "failed"
        self.learner_pg = None
        self.control = None
        self._profile_reported = False
        self._last_checkpoint_t = time.monotonic()
        self._rollout_stats: dict[int, dict] = {}
        self._incarnation: dict[int, int] = {}  # rollout actor id -> replacements so far (the board's key)
        if resume is not None:
            self.state = RunState.from_checkpoint(resume["run_state"], cfg.run.target_window,
                                                  resume.get("train_time_s", 0.0))
        else:
            self.state = RunState.fresh(cfg.run.target_window)

    # ------------------------------------------------------------------ build
    def build(self) -> None:
        cfg = self.cfg
        self.plan = plan = placement.plan(cfg)  # every check happens here, before any actor exists
        self.spec = self._describe_env()

        self.learner_pg = placement.reserve_learners(cfg, plan)
        if cfg.learner.batch_size == "auto":
            self._say(placement.resolve_auto_batch(cfg, plan, self.learner_pg, self.spec))
        # The board and shard i live on the node of rollout actor i (shard i's first producer).
        self.board = SupplyBoard.options(**placement.pinned(plan.rollout_nodes[0])).remote(
            cfg.fragments_per_update, cfg.replay.max_policy_lag, cfg.replay.num_shards)
        self.shards = [self._make_shard(i) for i in range(cfg.replay.num_shards)]
        ray.get([self.board.register_shard.remote(i, s) for i, s in enumerate(self.shards)])
        self.preprocess_workers = self._make_preprocess_workers()
        self.control = self._make_control()
        self.learners = self._make_learners()
        # Rollout actors are created before waiting on anything, so all worker processes start in parallel.
        self.rollouts = [self._make_rollout(i) for i in range(cfg.rollout.num_actors)]
        if self.resume is not None:
            ray.get([lr.load_state.remote(self.resume["learner"]) for lr in self.learners])
        self._setup_learners()
        ray.get([a.start.remote() for a in self.rollouts])

    def _describe_env(self):
        """The model's spec, from one throwaway env; a mismatch with the config is a one-line ConfigError."""
        from actors.envs import describe_env  # env errors -> ConfigError; shared with --dry-run (which has no Ray)

        cfg = self.cfg
        description = describe_env(cfg.env.id, self._modalities(), cfg.env.max_episode_steps)
        try:
            if cfg.env.modalities:
                return spec_from_description(description, cfg.learner.hidden_sizes)
            return PolicySpec(hidden_sizes=tuple(cfg.learner.hidden_sizes), **description)
        except ValueError as e:  # spec mismatches: the message names the key and what is allowed
            raise ConfigError(str(e)) from None

    def _modalities(self) -> dict[str, dict]:
        """env.modalities as plain data (what rollout actors and the pipeline's ModalitySpec take)."""
        return self.cfg.to_dict()["env"]["modalities"]

    def _make_preprocess_workers(self) -> list:
        """The second preprocessing tier (preprocess.remote_actors), spread over the rollout hosts."""
        cfg = self.cfg
        if not cfg.env.modalities or cfg.preprocess.remote_actors == 0:
            return []
        from actors.preprocess_worker import RemotePreprocessWorker

        slow = {name: d for name, d in self._modalities().items() if d["rate"] != "step"}
        nodes = self.plan.rollout_nodes
        # Soft affinity: a rollout host with no CPU left must not leave the worker pending forever.
        return [RemotePreprocessWorker.options(num_cpus=1, scheduling_strategy=NodeAffinitySchedulingStrategy(
                    node_id=nodes[i % len(nodes)], soft=True) if nodes[i % len(nodes)] else None).remote(
                    cfg.env.id, slow, cfg.env.max_episode_steps, cfg.run.seed + i)
                for i in range(cfg.preprocess.remote_actors)]

    def _make_control(self):
        name = control.actor_name(self.run_dir.name)
        try:
            return control.ControlBoard.options(name=name, namespace=control.NAMESPACE).remote(
                self.cfg.rollout.num_actors, self.cfg.replay.num_shards)
        except ValueError:  # another live run with the same directory name holds it
            self._say(f"warning: {name!r} is taken by another running job; this run cannot be scaled with "
                      f"python -m cluster.control")
            return control.ControlBoard.remote(self.cfg.rollout.num_actors, self.cfg.replay.num_shards)

    def _make_learners(self) -> list:
        cfg = self.cfg
        learner_kwargs = dict(
            lr=cfg.learner.lr, adam_eps=cfg.learner.adam_eps, anneal_lr=cfg.learner.anneal_lr,
            total_updates=cfg.total_updates, update_epochs=cfg.ppo.update_epochs,
            minibatch_size=cfg.local_minibatch_size, max_grad_norm=cfg.ppo.max_grad_norm,
            precision=cfg.learner.precision, fp16_init_scale=cfg.learner.fp16_init_scale,
            fp16_growth_factor=cfg.learner.fp16_growth_factor, compile=cfg.learner.compile,
        )
        coefs = dict(clip_coef=cfg.ppo.clip_coef, clip_vloss=cfg.ppo.clip_vloss, vf_coef=cfg.ppo.vf_coef,
                     ent_coef=cfg.ppo.ent_coef, norm_adv=cfg.ppo.norm_adv)
        return [
            RemoteLearner.options(**placement.learner_options(self.plan, self.learner_pg, r)).remote(
                rank=r, world_size=cfg.learner.num_learners, device_kind=self.plan.device_kind, spec=self.spec,
                learner_kwargs=learner_kwargs, coefs=coefs, seed=cfg.run.seed,
                torch_threads=cfg.learner.torch_threads, profile_iterations=self.profile_iterations,
                profile_dir=str((self.run_dir / "profile").resolve()))
            for r in range(cfg.learner.num_learners)
        ]

    def _setup_learners(self) -> None:
        cfg = self.cfg
        master_addr, master_port = ray.get(self.learners[0].address.remote())
        ray.get([
            lr.setup.remote(master_addr, master_port, self.board, fragments_per_batch=cfg.fragments_per_learner,
                            prefetch_batches=cfg.learner.prefetch_batches, stall_timeout_s=cfg.run.stall_timeout_s)
            for lr in self.learners
        ])

    def _make_shard(self, index: int):
        node = self.plan.rollout_nodes[index % len(self.plan.rollout_nodes)]
        return ReplayShard.options(**placement.pinned(node)).remote(
            index, self.cfg.replay_capacity, self.board, add_timeout_s=self.cfg.run.stall_timeout_s)

    def _make_rollout(self, actor_id: int, incarnation: int = 0):
        cfg = self.cfg
        self._incarnation[actor_id] = incarnation
        # A replacement (or a resumed run) must not replay the same episodes: fold both into the seed.
        seed = cfg.run.seed + 1_000_003 * (incarnation + self.state.iteration) + 7919 * actor_id
        sampler_kwargs = dict(
            env_id=cfg.env.id, num_envs=cfg.rollout.envs_per_actor, fragment_length=cfg.rollout.fragment_length,
            policy_factory=functools.partial(make_policy, self.spec), gamma=cfg.ppo.gamma,
            gae_lambda=cfg.ppo.gae_lambda, seed=seed, max_episode_steps=cfg.env.max_episode_steps,
        )
        if cfg.env.modalities:
            pre = cfg.preprocess
            sampler_kwargs.update(modalities=self._modalities(), preprocess_workers=pre.workers,
                                  max_slow_workers=pre.max_slow_workers, fast_queue=pre.fast_queue,
                                  slow_queue=pre.slow_queue,
                                  remote_preprocess=(self.preprocess_workers[actor_id % len(self.preprocess_workers)]
                                                     if self.preprocess_workers else None))
        node = self.plan.rollout_nodes[actor_id % len(self.plan.rollout_nodes)]
        # Shard a % K is on this actor's node (placement puts shard i with actor i): ``add`` stays local.
        shard_index = actor_id % len(self.shards)
        return RemoteRolloutActor.options(num_cpus=cfg.rollout.num_cpus_per_actor, **placement.pinned(node)).remote(
            actor_id=actor_id, shard=self.shards[shard_index], shard_index=shard_index, board=self.board,
            sampler_kwargs=sampler_kwargs, incarnation=incarnation, torch_threads=cfg.rollout.torch_threads,
            stall_timeout_s=cfg.run.stall_timeout_s)

    def placement_report(self) -> dict:
        """Node id of every actor, by role (what the placement test checks)."""
        def node_of(handles):
            return ray.get([h.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
                            for h in handles])
        return {"learners": node_of(self.learners), "rollouts": node_of(self.rollouts),
                "shards": node_of(self.shards), "board": node_of([self.board])[0]}

    # ------------------------------------------------------------------ watching
    def _poll_rollouts(self) -> None:
        """Fold in every rollout actor's finished episodes and counters; replace the dead ones."""
        state = self.state
        refs = [a.stats.remote() for a in self.rollouts]
        for i, ref in enumerate(refs):
            try:
                st = ray.get(ref)
            except RayActorError:
                state.retire(i)
                state.rollout_restarts += 1
                self._rollout_stats.pop(i, None)
                # Its tickets go to the others (exactly the fragments it had not delivered), then it is replaced.
                ray.get(self.board.actor_gone.remote(i, self._incarnation[i]))
                self.rollouts[i] = self._make_rollout(i, incarnation=self._incarnation[i] + 1)
                self.rollouts[i].start.remote()
                self._say(f"rollout actor {i} died; replaced (restart {state.rollout_restarts})")
                continue
            if st["error"]:
                raise RolloutFailed(f"rollout actor {st['actor_id']} failed: {st['error']}")
            state.actor_steps[i] = st["env_steps"]
            state.window.extend(ret for ret, _ in st["episodes"])
            state.episodes_total += len(st["episodes"])
            self._rollout_stats[i] = st

    def _poll_shards(self) -> list[dict]:
        """Shard stats; a dead shard is replaced. The board re-points its producers and readers and has exactly
        the fragments it held (and nobody had claimed) made again."""
        state = self.state
        refs = [s.stats.remote() for s in self.shards]
        out = []
        for i, ref in enumerate(refs):
            try:
                st = ray.get(ref, timeout=30)
            except (RayActorError, GetTimeoutError):
                state.shard_restarts += 1
                try:
                    ray.kill(self.shards[i])  # a hung shard is treated as dead
                except Exception:
                    pass
                self.shards[i] = self._make_shard(i)
                refunded = ray.get(self.board.register_shard.remote(i, self.shards[i]))
                self._say(f"replay shard {i} died holding {refunded} unclaimed fragments; replaced, and those are "
                          f"made again (restart {state.shard_restarts})")
                st = ray.get(self.shards[i].stats.remote())
            out.append(st)
        state.board = ray.get(self.board.stats.remote())
        return out

    def _await_learners(self, refs: list, check_budget: bool = True) -> list[dict]:
        """Results of one learner iteration, checking rollouts and shards while waiting. Every wait has a
        deadline: a rank that fails is seen at once (the others may be stuck in the all-reduce it left), the time
        budget ends the wait, and an iteration older than the stall deadline stops the run with what is missing."""
        t0 = time.monotonic()
        limit = self.cfg.run.stall_timeout_s + ITERATION_GRACE_S
        while True:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=HEALTH_CHECK_S)
            for ref in ready:
                self._raise_if_failed(ref, refs.index(ref))
            if len(ready) == len(refs):
                return ray.get(refs)
            if check_budget and self._budget_spent():
                raise _BudgetSpent()
            if time.monotonic() - t0 > limit:
                missing = [r for r, ref in enumerate(refs) if ref not in ready]
                raise RunStalled(f"learner rank(s) {missing} did not finish an iteration within run.stall_timeout_s + "
                                 f"{ITERATION_GRACE_S:.0f} s = {limit:.0f} s; ranks that finished: "
                                 f"{[r for r in range(len(refs)) if r not in missing]}")
            self._poll_rollouts()
            self._poll_shards()

    def _raise_if_failed(self, ref, rank: int) -> None:
        try:
            ray.get(ref, timeout=0)
        except LearnerStalled as e:
            raise RunStalled(str(getattr(e, "cause", e)).strip().splitlines()[-1], rank=rank) from None
        except (RayActorError, RayTaskError) as e:
            # A dead rank shows up as its own RayActorError, or as the survivors' failed all-reduce.
            if isinstance(e, RayActorError) or self._a_learner_is_dead():
                raise LearnerGroupDied(str(e).splitlines()[0]) from None
            raise

    def _budget_spent(self) -> bool:
        budget = self.cfg.run.time_budget_s
        train_s = self.state.train_time_before_s + time.perf_counter() - self._t_train
        return budget is not None and train_s >= budget

    def _a_learner_is_dead(self) -> bool:
        for lr in self.learners:
            try:
                ray.get(lr.__ray_call__.remote(lambda self: None), timeout=10)
            except (RayActorError, GetTimeoutError):
                return True
        return False

    def _restart_learners(self) -> None:
        """Replace the whole learner group, from the newest checkpoint (or from scratch without one)."""
        state, cfg = self.state, self.cfg
        state.learner_restarts += 1
        if state.learner_restarts > cfg.run.max_learner_restarts:
            raise RuntimeError(f"learners died {state.learner_restarts} times (run.max_learner_restarts = "
                               f"{cfg.run.max_learner_restarts}); resume later with --resume {self.run_dir}")
        for lr in self.learners:
            try:
                ray.kill(lr)
            except Exception:
                pass
        # Versions must keep increasing for the board and the rollout actors' lag accounting, even though
        # the weights go back to the checkpoint's.
        next_version = ray.get(self.board.latest.remote(-1))[0] + 1
        # What the dead group had claimed died with it: the board has it made again.
        ray.get(self.board.learners_restarted.remote(next_version))
        path = checkpoint.latest(self.run_dir)
        self.learners = self._make_learners()
        if path is not None:
            learner_state = checkpoint.load(path)["learner"]
            ray.get([lr.load_state.remote(learner_state, version=next_version) for lr in self.learners])
        else:
            ray.get([lr.start_at_version.remote(next_version) for lr in self.learners])
        self._setup_learners()
        self._say(f"a learner died; learner group restarted from {path or 'scratch'} "
                  f"(restart {state.learner_restarts} of at most {cfg.run.max_learner_restarts})")

    def _apply_control(self) -> None:
        """Grow or shrink the rollout actor set to what the control board asks for."""
        want = ray.get(self.control.desired.remote())["rollout_actors"]
        have = len(self.rollouts)
        if want == have:
            return
        if want > have:
            if self.plan.rollout_nodes[0] is not None:
                # Pinned placement: new actors go round-robin over the same CPU hosts.
                self.plan.rollout_nodes += [self.plan.rollout_nodes[i % have] for i in range(have, want)]
            new = [self._make_rollout(i, incarnation=self._incarnation.get(i, -1) + 1) for i in range(have, want)]
            self.rollouts += new
            ray.get([a.start.remote() for a in new])
        else:
            gone, self.rollouts = self.rollouts[want:], self.rollouts[:want]
            try:  # each delivers the fragment it is making, so nothing needs to be made again
                ray.get([a.stop.remote(timeout_s=10.0) for a in gone], timeout=15)
            except Exception:
                pass  # stuck or dead: killed below either way, and its tickets refunded
            for i, a in enumerate(gone, start=want):
                ray.kill(a)
                self.state.retire(i)
                self._rollout_stats.pop(i, None)
                # Tickets it held without a stored fragment go to the others; a late add of it is refused.
                ray.get(self.board.actor_gone.remote(i, self._incarnation[i]))
        # Nothing else to adjust: the board's tickets follow what the learners consume, not the actor count.
        self._say(f"rollout actors: {have} -> {want}")

    def _say(self, text: str) -> None:
        if not self.quiet:
            print(f"\n{text}", file=sys.stderr)

    # ------------------------------------------------------------------ run
    def run(self) -> RunResult:
        cfg, state = self.cfg, self.state
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        writer = JsonlWriter(self.run_dir / "metrics.jsonl")
        self._tb = TensorBoardWriter(self.run_dir)  # same names as the JSONL keys; `tensorboard --logdir runs`
        progress = ProgressLine(cfg.run.progress_interval_s, cfg.run.total_env_steps,
                                show_success=cfg.run.target_success_rate is not None)
        inflight: collections.deque = collections.deque()
        reason = None
        record: dict = {}
        stop_return = float("nan")
        stalled_rank = None
        self._t_train = t_train = time.perf_counter()
        self._last = (t_train, state.env_steps, state.samples_total)
        try:
            for _ in range(INFLIGHT_ITERATIONS):
                inflight.append(self._submit_iteration())
            while reason is None:
                try:
                    results = self._await_learners(inflight.popleft())
                except LearnerGroupDied:
                    self._restart_learners()  # the iterations in flight died with the group
                    inflight = collections.deque(self._submit_iteration() for _ in range(INFLIGHT_ITERATIONS))
                    continue
                except _BudgetSpent:
                    reason = "time_budget"  # a learner is stuck or slow: end now, without the iterations in flight
                    inflight.clear()
                    break
                inflight.append(self._submit_iteration())
                record = self._account(results, writer, progress)
                reason = self._stop_reason(record["train_time_s"])
                stop_return = record["episode_return_mean"]  # what the stop decision saw
            # The iterations still in flight are real updates: let them finish (they need the producers, which
            # are still running) and record them, so iteration, policy version and optimizer steps agree.
            while inflight:
                try:
                    results = self._await_learners(inflight.popleft(), check_budget=False)
                except (LearnerGroupDied, RunStalled):
                    break  # stopping anyway: the final checkpoint comes from a learner between updates
                record = self._account(results, writer, progress)
        except KeyboardInterrupt:
            reason = "interrupted"
        except RolloutFailed as e:
            # Stop with what was learned so far saved (final.pt); the CLI prints the cause in one line.
            reason = "failed"
            self.failure = str(e)
        except RunStalled as e:
            reason = "failed"
            self.failure = str(e)
            stalled_rank = e.rank
        finally:
            writer.close()
            self._tb.close()
        if not self.quiet and record:
            progress.update(record, force=True)
            progress.close()
        train_time = state.train_time_before_s + time.perf_counter() - t_train
        ckpt = self._save_final_checkpoint(reason, train_time, prefer_rank=stalled_rank)
        result = RunResult(
            reason=reason,
            reached_target=reason == "target_reached",
            env_steps=state.env_steps,
            iterations=state.iteration,
            wall_s=time.perf_counter() - self.t_start,
            episode_return_mean=stop_return,
            run_dir=self.run_dir,
            checkpoint_path=ckpt,
        )
        # End-of-run summary table (summary.txt) and learning curve + host-bound breakdown (report.png).
        table, _ = report.write_report(self.run_dir, asdict(result), window=cfg.run.target_window,
                                       target_return=cfg.run.target_return, plot=not self.quiet)
        if not self.quiet:
            print("\n" + table, file=sys.stderr)
        return result

    def _submit_iteration(self) -> list:
        """One iteration on every rank; rank 0 also snapshots its state when a periodic checkpoint is due, so the
        checkpoint holds exactly the update that this iteration's record describes."""
        snapshot = self._checkpoint_due()
        if snapshot:
            self._last_checkpoint_t = time.monotonic()
        return [lr.train_iteration.remote(snapshot=snapshot and r == 0) for r, lr in enumerate(self.learners)]

    def _account(self, results: list[dict], writer: JsonlWriter, progress: ProgressLine) -> dict:
        """Fold one finished learner iteration into the run state; write and show its record."""
        state = self.state
        state.iteration += 1
        self._apply_control()
        self._poll_rollouts()
        s_stats = self._poll_shards()
        state.samples_total += sum(res["samples"] for res in results)
        record = self._record(results, list(self._rollout_stats.values()), s_stats, time.perf_counter())
        snapshot = results[0].pop("state", None)
        if snapshot is not None:
            self._save_checkpoint(snapshot, None, record["train_time_s"])
        for res in results[1:]:
            res.pop("state", None)
        writer.write(record)
        self._tb.write(record)
        self._last = (time.perf_counter(), state.env_steps, state.samples_total)
        if not self.quiet:
            progress.update(record)
        return record

    def _record(self, results, r_stats, s_stats, now) -> dict:
        state = self.state
        t_train = self._t_train
        last_t, last_steps, last_samples = self._last
        dt = max(now - last_t, 1e-9)
        lead = results[0]

        def mean(key):
            return float(np.mean([res[key] for res in results]))

        record = {
            "iteration": state.iteration,
            "time_s": now - self.t_start,
            "train_time_s": state.train_time_before_s + now - t_train,
            "env_steps": state.env_steps,
            "env_steps_per_s": (state.env_steps - last_steps) / dt,
            "learner_samples": state.samples_total,
            "learner_samples_per_s": (state.samples_total - last_samples) / dt,
            "policy_version": lead["version"],
            "episodes": state.episodes_total,
            "episodes_in_window": len(state.window),
            "episode_return_mean": float(np.mean(state.window)) if state.window else float("nan"),
            # Sparse-reward tasks (minigrid, the multi-rate env) pay > 0 only on success.
            "episode_success_rate": float(np.mean(np.asarray(state.window) > 0)) if state.window else float("nan"),
            "host_bound_fraction": mean("host_bound_fraction"),
            "device_idle_fraction": mean("device_idle_fraction"),
            "learner_wait_s": mean("wait_s"),
            "learner_update_s": mean("update_s"),
            "learner_iter_s": mean("iter_s"),
            "feed_pull_s": mean("pull_s"),
            "feed_collate_s": mean("collate_s"),
            "h2d_ms": mean("h2d_ms"),
            "h2d_bytes": int(sum(res["h2d_bytes"] for res in results)),
            "host_syncs": int(lead["host_syncs"]),
            "allreduce_calls": int(lead["allreduce_calls"]),
            "policy_lag_mean": mean("policy_lag_mean"),
            "policy_lag_max": int(max(res["policy_lag_max"] for res in results)),
            # The data plane's ledger (pipeline/supply.py): cumulative over the run, resumes included.
            "fragments_produced": state.produced,
            "fragments_dropped_stale": state.dropped,
            "stale_fraction": state.dropped / max(state.produced, 1),
            "fragments_rejected": int(state.board.get("rejected", 0)),
            "tickets_in_flight": int(state.board.get("in_flight", 0)),
            "learner_take_failures": int(sum(res["take_failures"] for res in results)),
            "replay_depth": int(sum(s["depth"] for s in s_stats)),
            "replay_added": int(sum(s["added"] for s in s_stats)),
            "rollout_actors": len(self.rollouts),
            "rollout_restarts": state.rollout_restarts,
            "shard_restarts": state.shard_restarts,
            "learner_restarts": state.learner_restarts,
            "fragments_lost": state.lost,
            "checkpoints_skipped": state.checkpoints_skipped,
            "rollout_backpressure_s": float(sum(st["backpressure_s"] for st in r_stats)),
            "rollout_rate_limited_s": float(sum(st["rate_limited_s"] for st in r_stats)),
            **{k: lead[k] for k in PPO_STATS},
        }
        record.update(pipeline_metrics([st.get("pipeline", {}) for st in r_stats]))
        if state.iteration == 1:
            record["compile"] = lead["compile"]
        if lead["profile_trace"] and not self._profile_reported:
            record["profile_trace"] = lead["profile_trace"]
            self._profile_reported = True
            self._say(f"profiler trace written: {lead['profile_trace']}")
        return record

    def _stop_reason(self, train_s: float) -> str | None:
        run, state = self.cfg.run, self.state
        window = state.window
        full = len(window) == window.maxlen
        if run.target_return is not None and full and np.mean(window) >= run.target_return:
            return "target_reached"
        if run.target_success_rate is not None and full and np.mean(np.asarray(window) > 0) >= run.target_success_rate:
            return "target_reached"
        if state.env_steps >= run.total_env_steps:
            return "total_env_steps"
        if run.time_budget_s is not None and train_s >= run.time_budget_s:
            return "time_budget"
        return None

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_due(self) -> bool:
        every = self.cfg.run.checkpoint_interval_s
        return every is not None and time.monotonic() - self._last_checkpoint_t >= every

    def _save_final_checkpoint(self, reason: str | None, train_time_s: float,
                               prefer_rank: int | None = None) -> Path | None:
        """final.pt from a learner between two updates (``state_between_updates`` runs beside a blocked
        iteration). After a stall, the stalled rank first: it is between updates, while the others may be inside
        an update, stuck in the all-reduce the stalled one never joined. Skipped (logged and counted) if no
        rank answers."""
        order = list(range(len(self.learners)))
        if prefer_rank is not None and prefer_rank in order:
            order.remove(prefer_rank)
            order.insert(0, prefer_rank)
        errors = []
        for r in order:
            try:
                learner_state = ray.get(self.learners[r].state_between_updates.remote(), timeout=10)
                return self._save_checkpoint(learner_state, reason, train_time_s)
            except Exception as e:  # noqa: BLE001 - dead, or stuck inside an update
                errors.append(f"rank {r}: {type(e).__name__}")
        self.state.checkpoints_skipped += 1
        self._say(f"final checkpoint skipped: no learner answered between updates ({', '.join(errors)})")
        return None

    def _save_checkpoint(self, learner_state: dict, reason: str | None, train_time_s: float) -> Path:
        """Periodic (``reason`` None) as ckpt-<iteration>.pt, keeping the newest K; final as final.pt."""
        payload = {
            "learner": learner_state,
            "run_state": self.state.to_checkpoint(),
            "train_time_s": train_time_s,
            "stop_reason": reason,
            "config": self.cfg.to_dict(),
            "versions": checkpoint.package_versions(),
        }
        directory = self.run_dir / "checkpoints"
        if reason is None:
            path = checkpoint.save(directory / f"ckpt-{self.state.iteration:08d}.pt", payload)
            checkpoint.prune(directory, keep=self.cfg.run.keep_checkpoints)
            return path
        return checkpoint.save(directory / "final.pt", payload)

    # ------------------------------------------------------------------ teardown
    def shutdown(self) -> None:
        """Stop producers, then consumers, then kill every actor this driver made."""
        for group, timeout in ((self.rollouts, 5), (self.learners, 10)):
            refs = [a.stop.remote() for a in group]
            try:
                ray.get(refs, timeout=timeout)
            except Exception:
                pass  # stuck or dead: killed below either way
        extra = [x for x in (self.board, self.control) if x is not None]
        for a in self.rollouts + self.learners + self.shards + self.preprocess_workers + extra:
            try:
                ray.kill(a)
            except Exception:
                pass
        self.rollouts, self.learners, self.shards, self.board, self.control = [], [], [], None, None
        self.preprocess_workers = []
        if self.learner_pg is not None:
            try:
                ray.util.remove_placement_group(self.learner_pg)
            except Exception:
                pass
            self.learner_pg = None

