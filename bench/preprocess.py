"""Preprocessing inline in the learner vs the pipelined path, side by side in one run.

Both variants train the same PPO learner (the multimodal actor-critic of ``configs/multirate.yaml``'s multi-rate
env) on the same raw observations, collected once from 16 envs under random actions before anything is timed.
Inline: the learner process runs ``Processor.batch`` on every modality of every sample (a learner has no notion
of sensor rates), then updates. Pipelined: ``--producers`` Ray actors preprocess 64x16 fragments through the
rollout's ``ObservationPipeline`` (slow modalities only when due) on the ticketed data plane, and the learner
trains from a ``DeviceFeed``, publishing a policy version per update (``--max-policy-lag`` bounds how far
producers run ahead). Variants run in alternating ``--rounds`` so that background load falls on both alike.
A measurement: it exits 0 whatever the ratio, and says in words what limited it.

    .venv/bin/python bench/preprocess.py [--seconds 20] [--rounds 2] [--producers 1] [--batch-size 1024]
                                         [--update-epochs 2] [--minibatch 256] [--max-policy-lag 3]
                                         [--device auto]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cv2  # noqa: E402
import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from actors.envs import VectorEnv, describe_env  # noqa: E402
from bench._common import ROOT, cli, local_ray, machine_busy_s, median_s, parser, require, rotated, table  # noqa: E402
from bench._supply import TicketedProducer, pipelined_step, supply, timed  # noqa: E402
from cluster import config as config_mod  # noqa: E402
from learner import device as devices  # noqa: E402
from learner.learner import Learner  # noqa: E402
from learner.model import ActorCritic, spec_from_description  # noqa: E402
from learner.ppo import LossCoefs  # noqa: E402
from pipeline import fragment as F  # noqa: E402
from pipeline.feed import DeviceFeed  # noqa: E402
from pipeline.modality import ModalitySpec, make_processor  # noqa: E402
from pipeline.observations import ObservationPipeline  # noqa: E402
from pipeline.scheduler import EDFScheduler  # noqa: E402

CONFIG = ROOT / "configs" / "multirate.yaml"
T, N = 64, 16  # fragment shape: steps x envs (one fragment = 1024 samples)
REFERENCE_RATIO = 5.8  # what the public reference reports for moving preprocessing off the learner


# ---------------------------------------------------------------------------------------------- raw data
def collect_pool(env_id: str, pool_steps: int, seed: int = 0) -> dict:
    """Raw observations of the rollout's own ``VectorEnv`` of N envs under random actions, as the env returned
    them; with each env's episode step and number (which slow modalities are due; episodes kept apart)."""
    env = VectorEnv(env_id, N)
    rng = np.random.default_rng(seed)
    raws, ep_steps, episodes = [env.reset(seed=seed)], [env.episode_step.copy()], [env.episode.copy()]
    for _ in range(pool_steps - 1):
        raws.append(env.step(rng.integers(0, env.single_action_space.n, N))[0])
        ep_steps.append(env.episode_step.copy())
        episodes.append(env.episode.copy())
    env.close()
    # The PPO-side arrays: their values do not matter for throughput, only their shapes and dtypes do.
    train = {
        F.ACTIONS: rng.integers(0, env.single_action_space.n, (pool_steps, N)).astype(np.int64),
        F.LOGP: np.full((pool_steps, N), -np.log(5.0), np.float32),
        F.VALUES: rng.standard_normal((pool_steps, N)).astype(np.float32),
        F.ADVANTAGES: rng.standard_normal((pool_steps, N)).astype(np.float32),
        F.RETURNS: rng.standard_normal((pool_steps, N)).astype(np.float32),
    }
    return {"raws": raws, "episode_steps": np.stack(ep_steps), "episodes": np.stack(episodes), "train": train}


# ---------------------------------------------------------------------------------------------- learner
def make_learner(cfg, description: dict, device, update_epochs: int, minibatch: int) -> Learner:
    torch.manual_seed(0)  # both variants start from the same weights
    spec = spec_from_description(description, tuple(cfg.learner.hidden_sizes))
    ppo = cfg.ppo
    coefs = LossCoefs(clip_coef=ppo.clip_coef, clip_vloss=ppo.clip_vloss, vf_coef=ppo.vf_coef,
                      ent_coef=ppo.ent_coef, norm_adv=ppo.norm_adv)
    # anneal_lr off: the learning rate must not drift between the two variants' updates.
    return Learner(ActorCritic(spec), lr=cfg.learner.lr, adam_eps=cfg.learner.adam_eps, anneal_lr=False,
                   total_updates=10**6, update_epochs=update_epochs, minibatch_size=minibatch,
                   max_grad_norm=ppo.max_grad_norm, coefs=coefs, device=device.torch_device())


# ---------------------------------------------------------------------------------------------- per modality
def modality_costs(specs, processors, cols, pool, reps: int = 5) -> list[dict]:
    """ms per 1024 samples of each modality's Processor.batch in this process: one batch of 1024 (the inline
    learner), 16-env step batches (the rollout's jobs), and step batches of only the due envs (the pipeline's)."""
    n = T * N
    rows = []
    for spec in specs:
        proc, col = processors[spec.name], cols[spec.name]

        def inline_batch():
            proc.batch(col[:n])

        def step_batches():
            for t in range(T):
                proc.batch(col[t * N:(t + 1) * N])

        def due_batches():
            for t in range(T):
                due = [i for i in range(N) if spec.due(int(pool["episode_steps"][t, i]))]
                if due:
                    proc.batch([col[t * N + i] for i in due])

        due_share = float(np.mean([spec.due(int(s)) for s in pool["episode_steps"].reshape(-1)]))
        rows.append({"name": spec.name, "kind": spec.kind,
                     "rate": spec.rate if spec.rate != "every" else f"every {spec.every}",
                     "inline_ms": 1e3 * median_s(inline_batch, reps), "step_ms": 1e3 * median_s(step_batches, reps),
                     "due_ms": 1e3 * median_s(due_batches, reps), "due_share": due_share})
    return rows


# ---------------------------------------------------------------------------------------------- inline
def run_inline(learner, processors, cols, train, device, batch_size: int, seconds: float, warmup: int,
               cursor: list) -> dict:
    """Preprocess + collate + (copy) + update, one after the other, in this process."""
    pool_samples = len(next(iter(cols.values())))
    dev = device.torch_device()

    def prepare():
        lo, hi = cursor[0], cursor[0] + batch_size
        cursor[0] = hi % pool_samples  # kept across rounds: every round reads on through the pool
        t0 = time.perf_counter()
        # The same Processor.batch calls the rollout pipeline makes, on every sample of every modality.
        obs = {name: proc.batch(cols[name][lo:hi]) for name, proc in processors.items()}
        t1 = time.perf_counter()
        batch = {F.obs_key(name): torch.from_numpy(a).to(dev) for name, a in obs.items()}
        batch.update({k: torch.from_numpy(a[lo:hi]).to(dev) for k, a in train.items()})
        device.synchronize()  # an accelerator copy is only done once synchronised: count it as data time
        return batch, t1 - t0, time.perf_counter() - t0

    def step():
        batch, prep_s, data_s = prepare()
        learner.update(batch)
        return batch_size, data_s, prep_s

    return timed(step, warmup=warmup, seconds=seconds)


# ---------------------------------------------------------------------------------------------- pipelined
@ray.remote(num_cpus=1)
class PreprocessProducer(TicketedProducer):
    """The rollout's preprocessing half, with ``RolloutActor``'s protocol (bench/_supply.py's ``TicketedProducer``).
    The raw pool is resolved once at construction, before any timing. Episode numbers are offset on every pass
    through the pool: the aligner must see the wrap-around as new episodes."""

    def __init__(self, board, shard, pool: dict, modalities: dict, env_id: str, preprocess: dict, actor_id: int):
        super().__init__(board, shard, 0, actor_id)
        cv2.setNumThreads(1)  # the scheduler's workers are the parallelism; a cv2 pool would compete with them
        self.pool = pool
        specs = [ModalitySpec.from_dict(name, d) for name, d in modalities.items()]
        env = gym.make(env_id)
        obs_space = env.observation_space
        env.close()
        self.scheduler = EDFScheduler(num_workers=preprocess["workers"], fast_capacity=preprocess["fast_queue"],
                                      slow_capacity=preprocess["slow_queue"],
                                      max_slow_workers=preprocess["max_slow_workers"], name=f"bench-{actor_id}")
        self.pipeline = ObservationPipeline(specs, obs_space, N, self.scheduler, seed=actor_id)
        self.out_spaces = self.pipeline.out_spaces()
        self.pool_steps = len(pool["raws"])
        self.episode_offset = int(pool["episodes"].max()) + 1
        self.step = 0  # global step: the aligner's clock only moves forward

    def identity(self) -> tuple[int, int]:
        """(pid, niceness): Ray starts workers at a raised niceness, which decides who yields on a full machine."""
        return os.getpid(), os.nice(0)

    def make(self) -> F.Fragment:
        obs = {name: np.empty((T, N) + shape, dtype) for name, (shape, dtype) in self.out_spaces.items()}
        s0 = self.step % self.pool_steps  # T divides the pool, so a fragment never straddles the wrap
        for t in range(T):
            s = s0 + t
            episodes = self.pool["episodes"][s] + (self.step // self.pool_steps) * self.episode_offset
            # submit then gather, as a rollout does between two env steps: fast modalities of every env as
            # fast jobs, each slow modality only for the envs where it is due; the aligner serves the rest.
            self.pipeline.submit(self.step, self.pool["raws"][s], self.pool["episode_steps"][s], episodes)
            g = self.pipeline.gather(self.step, episodes)
            for name, value in g.obs.items():
                obs[name][t] = value
            self.step += 1
        arrays = {F.obs_key(name): a for name, a in obs.items()}
        arrays.update({k: a[s0:s0 + T] for k, a in self.pool["train"].items()})
        return F.Fragment(arrays, policy_version=self.version, actor_id=self.actor_id)

    def run(self, seconds: float) -> dict:
        stats = super().run(seconds)
        self.scheduler.close()
        return {**stats, "scheduler": self.scheduler.metrics(), "aligner": self.pipeline.aligner.metrics()}


def run_pipelined(learner, pool_ref, modalities, env_id, preprocess, device, batch_size: int, producers: int,
                  max_policy_lag: int, seconds: float, warmup: int) -> dict:
    """Fresh producers, board and shard per call (start-up untimed); the learner trains from the DeviceFeed and
    publishes a policy version after every update (what creates the tickets the producers fill)."""
    per_update = batch_size // (T * N)
    board, (shard,) = supply(1, (max_policy_lag + 1) * per_update, per_update, max_policy_lag)
    weights = [ray.put(None)]  # producers only read the version number
    actors = [PreprocessProducer.remote(board, shard, pool_ref, modalities, env_id, preprocess, i)
              for i in range(producers)]
    # Also waits for construction (pool resolved, processors built), so none of that is timed.
    ids = ray.get([a.identity.remote() for a in actors])
    runs = [a.run.remote(10**6) for a in actors]
    feed = DeviceFeed(board, 0, per_update, device, prefetch_batches=1).start()
    try:
        out = dict(timed(pipelined_step(feed, learner, board, weights, device), warmup=warmup, seconds=seconds,
                         producer_pids=[pid for pid, _ in ids]), niceness=[n for _, n in ids])
    finally:
        feed.stop()
        ray.kill(board)  # a producer waiting on a ticket or an add gets RayActorError and returns its stats
        ray.kill(shard)
    try:
        out["producers"] = ray.get(runs, timeout=120)
    finally:
        for a in actors:
            ray.kill(a)
    return out


def combine(segments: list[dict]) -> dict:
    """Sum the rounds of one variant, then turn sums into rates."""
    tot = {k: sum(seg[k] for seg in segments) for k in ("wall", "data_s", "prep_s", "samples", "updates",
                                                         "learner_cpu", "producer_cpu", "machine_cpu")}
    wall = tot["wall"]
    out = {"wall": wall, "updates": tot["updates"], "samples_per_s": tot["samples"] / wall,
           "host_bound": tot["data_s"] / wall, "update_only": tot["samples"] / (wall - tot["data_s"]),
           "prep_ms_per_1024": 1e3 * tot["prep_s"] / tot["samples"] * 1024,
           "learner_cores": tot["learner_cpu"] / wall, "producer_cores": tot["producer_cpu"] / wall,
           "machine_cores": tot["machine_cpu"] / wall, "rounds": [s["samples"] / s["wall"] for s in segments]}
    stats = [dict(p, label=f"segment {k + 1} producer {i}") for k, seg in enumerate(segments)
             for i, p in enumerate(seg.get("producers", []))]
    if stats:
        frags = max(1, sum(s["fragments"] for s in stats))
        out.update(producers=stats, niceness=sorted({n for seg in segments for n in seg["niceness"]}),
                   producer_prep_wall_ms=1e3 * sum(s["prep_wall_s"] for s in stats) / frags,
                   producer_prep_cpu_ms=1e3 * sum(s["prep_cpu_s"] for s in stats) / frags,
                   producer_add_wait_s=sum(s["add_wait_s"] for s in stats),
                   producer_ticket_wait_s=sum(s["ticket_wait_s"] for s in stats))
    return out


# ---------------------------------------------------------------------------------------------- main
def make_parser():
    p = parser(__doc__, config=str(CONFIG), device=True)
    p.add_argument("--seconds", type=float, default=20.0, help="timed seconds per variant (after warm-up)")
    p.add_argument("--producers", type=int, default=1, help="preprocessing actors in the pipelined variant")
    p.add_argument("--batch-size", type=int, default=1024, help="samples per PPO update (whole 1024-sample fragments)")
    p.add_argument("--update-epochs", type=int, default=2)
    p.add_argument("--minibatch", type=int, default=256)
    p.add_argument("--pool-samples", type=int, default=4096, help="raw observations collected up front")
    p.add_argument("--max-policy-lag", type=int, default=3,
                   help="updates producers may run ahead of the learner (tickets); 3 at one fragment per update: "
                        "4 fragments in flight, as the former 4-fragment shard")
    p.add_argument("--warmup", type=int, default=3, help="untimed updates before each timed segment")
    p.add_argument("--rounds", type=int, default=2,
                   help="split each variant's --seconds into this many segments, alternating the order")
    p.add_argument("--torch-threads", type=int, default=1)
    return p


def run(args) -> tuple[dict, None]:
    fragment = T * N
    require(args.batch_size % fragment == 0 and args.batch_size >= fragment,
            f"--batch-size must be a positive multiple of {fragment} (one fragment = {T} steps x {N} envs)")
    require(args.pool_samples % args.batch_size == 0, "--pool-samples must be a multiple of --batch-size")
    require(args.rounds >= 1 and args.producers >= 1 and args.max_policy_lag >= 0,
            "--rounds and --producers must be >= 1, --max-policy-lag >= 0")
    require(args.batch_size % args.minibatch == 0, "--batch-size must be a multiple of --minibatch")

    # One learner thread, as bench/feed.py: on a 2-core machine the other core is what producers can use.
    torch.set_num_threads(args.torch_threads)
    cv2.setNumThreads(1)  # same for both variants (and the producers): decode parallelism comes from workers
    device = devices.resolve(args.device)
    cfg = config_mod.load(args.config)
    plain = cfg.to_dict()
    modalities, preprocess, env_id = plain["env"]["modalities"], plain["preprocess"], cfg.env.id
    specs = [ModalitySpec.from_dict(name, d) for name, d in modalities.items()]
    description = describe_env(env_id, modalities)
    env = gym.make(env_id)
    obs_space = env.observation_space
    env.close()
    processors = {s.name: make_processor(s, obs_space[s.name]) for s in specs}

    t = time.perf_counter()
    pool = collect_pool(env_id, args.pool_samples // N)
    cols = {name: [obs[name] for step in pool["raws"] for obs in step] for name in processors}  # as Fragment.flat
    train = {k: a.reshape(-1) for k, a in pool["train"].items()}
    print(f"pool: {args.pool_samples} raw observations ({args.pool_samples // N} steps x {N} envs of {env_id}, "
          f"random actions) in {time.perf_counter() - t:.1f} s")
    device_line = (f"device: {device.kind}; torch threads {args.torch_threads}; cpus {os.cpu_count()}; update = "
                   f"{args.update_epochs} epochs of {args.minibatch}-sample minibatches on {args.batch_size} samples; "
                   f"{args.seconds:g} s timed per variant after {args.warmup} warm-up updates")
    print(device_line)

    rows = modality_costs(specs, processors, cols, pool)
    print("\nper-modality preprocessing, ms per 1024 samples (Processor.batch, this process, one thread)")
    table([("modality", "<12"), ("kind", "<10"), ("rate", "<8"), ("1x1024 batch", ">12.2f"), ("64x16 steps", ">12.2f"),
           ("due share", ">9"), ("due only", ">9.2f")],
          [(r["name"], r["kind"], r["rate"], r["inline_ms"], r["step_ms"], f"{100 * r['due_share']:.1f}%", r["due_ms"])
           for r in rows]
          + [("total", "", "", *(sum(r[k] for r in rows) for k in ("inline_ms", "step_ms")), "",
              sum(r["due_ms"] for r in rows))])
    print("  (1x1024: the inline learner's call; 64x16: the rollout's per-step jobs; due only: per-step jobs of "
          "just the envs where a slow modality is due, the work the pipelined path does)")

    # Other processes on a shared machine show up in every number below: measure them before Ray starts.
    background = machine_load(1.0)
    segments: dict[str, list] = {"inline": [], "pipelined": []}
    with local_ray(4):
        pool_ref = ray.put(pool)  # once; every producer resolves the same object
        time.sleep(2.0)  # let Ray's freshly started processes settle before anything is timed
        print(f"\nbackground: {background:.2f} of {os.cpu_count()} cores busy before Ray started, "
              f"{machine_load(1.0):.2f} just before timing (Ray idle, plus anything else)")
        learners = {v: make_learner(cfg, description, device, args.update_epochs, args.minibatch)
                    for v in segments}
        cursor, rounds = [0], []
        per_round = args.seconds / args.rounds
        for r in range(args.rounds):
            # Odd rounds reverse the order (ABBA...), so a drift in background load falls on both variants alike.
            for variant in rotated(["inline", "pipelined"], r):
                if variant == "inline":
                    seg = run_inline(learners[variant], processors, cols, train, device, args.batch_size, per_round,
                                     args.warmup, cursor)
                else:
                    seg = run_pipelined(learners[variant], pool_ref, modalities, env_id, preprocess, device,
                                        args.batch_size, args.producers, args.max_policy_lag, per_round,
                                        args.warmup)
                segments[variant].append(seg)
                rounds.append({"round": r + 1, "variant": variant, "samples_per_s": seg["samples"] / seg["wall"],
                               "host_bound": seg["data_s"] / seg["wall"], "updates": seg["updates"],
                               "seconds": seg["wall"]})
                print(f"round {r + 1}/{args.rounds} {variant:9s}: learner {seg['samples'] / seg['wall']:,.0f} "
                      f"samples/s, host-bound {100 * seg['data_s'] / seg['wall']:.1f}%, {seg['updates']} updates "
                      f"in {seg['wall']:.1f} s", flush=True)
    results = {v: combine(segs) for v, segs in segments.items()}

    inline, piped = results["inline"], results["pipelined"]
    ratio = piped["samples_per_s"] / inline["samples_per_s"]
    ceiling = 1.0 / max(1e-9, 1.0 - inline["host_bound"])
    print()
    table([("variant", "<10"), ("samples/s", ">10,.0f"), ("host-bound", ">10"), ("prep ms/1024", ">12"),
           ("update-only/s", ">13,.0f"), ("updates", ">7d"), ("learner cores", ">13.2f"), ("producer cores", ">14.2f"),
           ("machine cores", ">13.2f")],
          [(name, r["samples_per_s"], f"{100 * r['host_bound']:.1f}%",
            f"{r['prep_ms_per_1024']:.1f}" if name == "inline" else "0 (off)", r["update_only"], r["updates"],
            r["learner_cores"], r["producer_cores"], r["machine_cores"]) for name, r in results.items()])
    print("  (host-bound: share of wall time the update loop spent getting its batch; prep: Processor.batch time in "
          "the learner process; update-only/s: samples per second of update time alone)")
    for name, r in results.items():
        print(f"{name:10s} per round: " + ", ".join(f"{x:,.0f}" for x in r["rounds"]) + " samples/s")
    print(f"producers ({args.producers}, niceness {'/'.join(map(str, piped['niceness']))}): "
          f"{piped['producer_prep_wall_ms']:.1f} ms wall / "
          f"{piped['producer_prep_cpu_ms']:.1f} ms CPU per 1024-sample fragment, "
          f"{piped['producer_ticket_wait_s']:.1f} s waiting for a ticket (rate limit: the learner had not published "
          f"the update they would fill), {piped['producer_add_wait_s']:.1f} s waiting for an add")
    for s in piped["producers"]:
        sch = s["scheduler"]
        waits = sum(v for k, v in s["aligner"].items() if k.endswith("/waits"))
        print(f"  {s['label']}: {s['fragments']} fragments; fast jobs {sch['fast']['completed']} "
              f"(p99 {sch['fast']['latency_p99_ms']:.2f} ms, {sch['fast']['deadline_misses']} past budget), "
              f"slow jobs {sch['slow']['completed']} (p99 {sch['slow']['latency_p99_ms']:.2f} ms, "
              f"{sch['slow']['deadline_misses']} past budget); aligner waits {waits}")
    print(f"\npipelined/inline learner samples/s: x{ratio:.2f}  "
          f"(host-bound {100 * inline['host_bound']:.1f}% -> {100 * piped['host_bound']:.1f}%; "
          f"ceiling from the inline host-bound share: x{ceiling:.2f}; public reference: x{REFERENCE_RATIO})")
    why = _explain(ratio, ceiling, inline, piped, background, args)
    return {
        "ratio": ratio, "host_bound_inline": inline["host_bound"], "host_bound_pipelined": piped["host_bound"],
        "ceiling": ceiling, "rounds": rounds, "why": why, "device_line": device_line,
        "variants": {name: {"samples_per_s": r["samples_per_s"], "host_bound": r["host_bound"],
                            "update_only_samples_per_s": r["update_only"], "updates": r["updates"],
                            "learner_cores": r["learner_cores"], "producer_cores": r["producer_cores"],
                            "machine_cores": r["machine_cores"]} for name, r in results.items()},
        "prep_ms_per_1024": {"inline_batch": sum(r["inline_ms"] for r in rows),
                             "step_batches": sum(r["step_ms"] for r in rows),
                             "due_only": sum(r["due_ms"] for r in rows)}}, None


def machine_load(seconds: float) -> float:
    """Average busy cores of the whole machine over ``seconds``."""
    b0 = machine_busy_s()
    time.sleep(seconds)
    return (machine_busy_s() - b0) / seconds


def _explain(ratio: float, ceiling: float, inline: dict, piped: dict, background: float, args) -> list[str]:
    """Say in words why the ratio is what it is (printed, and returned); the numbers above are the evidence."""
    notes = []
    cpus = os.cpu_count() or 1
    if ceiling < 2.0:
        notes.append(f"inline, data preparation is only {100 * inline['host_bound']:.0f}% of each learner iteration "
                     f"(the PPO update is the rest), so taking it off the learner can speed the learner up at most "
                     f"x{ceiling:.2f}; a x{REFERENCE_RATIO} gain needs preprocessing to dominate the learner step "
                     f"(heavier modalities, or an update that an accelerator makes fast)")
    if ratio > ceiling * 1.03:
        notes.append(f"x{ratio:.2f} is above that ceiling: the excess is measurement noise (background load that "
                     f"changed between segments; compare the per-round numbers), not a gain of the pipeline")
    if inline["learner_cores"] < 0.9 * args.torch_threads:
        notes.append(f"the learner process got only {inline['learner_cores']:.2f} cores inline with "
                     f"{args.torch_threads} torch thread(s): other processes were competing for this "
                     f"machine ({background:.2f} of {cpus} cores busy before Ray started), so absolute rates are low "
                     f"and noisy")
    if piped["host_bound"] > 0.05:
        # Producers keep up when they finish a fragment well within the time the learner spends updating on one.
        update_ms = 1e3 * T * N / piped["update_only"]
        per_fragment_ms = piped["producer_prep_wall_ms"] / args.producers
        if per_fragment_ms > 0.8 * update_ms:
            notes.append(f"pipelined, the learner still waited {100 * piped['host_bound']:.0f}% of the time: "
                         f"{args.producers} producer(s) took {piped['producer_prep_wall_ms']:.0f} ms wall (for "
                         f"{piped['producer_prep_cpu_ms']:.0f} ms CPU) per fragment against {update_ms:.0f} ms of "
                         f"update per fragment, so they barely kept up; they mostly waited for a core (Ray runs "
                         f"them at niceness {'/'.join(map(str, piped['niceness']))}); try --producers")
        else:
            notes.append(f"pipelined, the learner still waited {100 * piped['host_bound']:.0f}% of the time for the "
                         f"feed (pulling from the shard and collating, which share the learner's process)")
    if piped["machine_cores"] > 0.85 * cpus and ratio < 0.9 * ceiling:
        notes.append(f"this machine has {cpus} cores and they were {100 * piped['machine_cores'] / cpus:.0f}% busy "
                     f"in the pipelined run: producers, Ray and the learner share them, so moving preprocessing "
                     f"to another process finds no idle core to run on")
    if piped["update_only"] < 0.95 * inline["update_only"]:
        notes.append(f"the update itself ran {100 * (1 - piped['update_only'] / inline['update_only']):.0f}% slower "
                     f"pipelined (learner process {piped['learner_cores']:.2f} cores vs {inline['learner_cores']:.2f} "
                     f"inline): the producer, the shard and the feed thread took CPU the update needed")
    if notes:
        print("why:")
        for n in notes:
            print(f"  - {n}")
    return notes


if __name__ == "__main__":
    cli(make_parser, run)
