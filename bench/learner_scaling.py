"""Multi-learner scaling: 1, 2, 4 data-parallel learners on one global batch.

Each of L learners (the real ``LearnerActor``: device feed, PPO update, gradient all-reduce) trains on batch/L
samples per update from the supply board's tickets (rank 0 publishes a policy version per update, max_policy_lag
1). One producer actor per learner fills its own replay shard, so the next update's data is waiting while this
one trains. Prints learner samples/s per L and the efficiency samples/s(L) / (L x samples/s(1)). It runs
unchanged on GPU or NPU hosts (``--device auto``). On a 2-core CPU machine more than two learners share cores,
so efficiency must fall: what matters there is that L=2 gives identical weights at a measured cost.

    .venv/bin/python bench/learner_scaling.py [--learners 1 2 4] [--iterations 30]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import ray  # noqa: E402

from bench._common import cli, local_ray, parser  # noqa: E402
from bench._supply import KINDS, Producer, policy_spec, supply  # noqa: E402
from learner import device as devices  # noqa: E402
from learner.actor import RemoteLearner  # noqa: E402

MAX_POLICY_LAG = 1  # replay.max_policy_lag's default: the next update's fragments are made while this one trains


def run_learners(L: int, kind: dict, batch: int, iterations: int, device_kind: str) -> dict:
    frag_samples = kind["T"] * kind["N"]
    per_learner = batch // L
    if per_learner % frag_samples:
        raise SystemExit(f"--batch {batch} / {L} learners is not a whole number of {frag_samples}-sample fragments")
    spec = policy_spec(kind)
    per_update = batch // frag_samples  # fragments of one update, over all learners
    # Version 0 is rank 0's to publish (at setup), as in a run; the tickets appear then.
    board, shards = supply(L, (MAX_POLICY_LAG + 1) * per_update, per_update, MAX_POLICY_LAG, publish=False)
    producers = [Producer.remote(board, s, i, kind, actor_id=i) for i, s in enumerate(shards)]
    _ = [pr.run.remote(3600) for pr in producers]
    res = devices.spec_for(device_kind).ray_resource  # Ray takes GPUs as num_gpus, other accelerators as resources
    opts = {"num_cpus": 1, **({"num_gpus": 1} if res == "GPU" else {"resources": {res: 1}} if res else {})}
    learners = [
        RemoteLearner.options(**opts).remote(
            rank=r, world_size=L, device_kind=device_kind, spec=spec,
            learner_kwargs=dict(lr=3e-4, adam_eps=1e-5, anneal_lr=False, total_updates=10**6, update_epochs=4,
                                minibatch_size=512 // L, max_grad_norm=0.5),
            coefs={}, seed=0, torch_threads=1)
        for r in range(L)
    ]
    try:
        addr, port = ray.get(learners[0].address.remote())
        ray.get([lr.setup.remote(addr, port, board, fragments_per_batch=per_learner // frag_samples,
                                 prefetch_batches=1, stall_timeout_s=120.0, group_claims=L > 1,
                                 peers=learners if r == 0 and L > 1 else None) for r, lr in enumerate(learners)])
        for _ in range(3):  # warm-up: process group, first allocations
            ray.get([lr.train_iteration.remote() for lr in learners])
        t0 = time.perf_counter()
        stats = []
        for _ in range(iterations):
            stats.append(ray.get([lr.train_iteration.remote() for lr in learners]))
        wall = time.perf_counter() - t0
        params = ray.get([lr.flat_params.remote() for lr in learners])
        identical = all(np.array_equal(params[0], p) for p in params[1:])
        return {
            "samples_per_s": iterations * batch / wall,
            "host_bound": float(np.mean([s["host_bound_fraction"] for it in stats for s in it])),
            "identical": identical,
        }
    finally:
        ray.get([lr.stop.remote() for lr in learners], timeout=30)
        for a in learners + producers + shards + [board]:
            ray.kill(a)


def make_parser():
    p = parser(__doc__, device=True)
    p.add_argument("--learners", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--batch", type=int, default=4096, help="global samples per update")
    return p


def run(args):
    rows = []
    with local_ray(max(8, 2 * max(args.learners) + 2)):
        kind_name = devices.detect() if args.device == "auto" else args.device
        kind = KINDS["vector"]
        print(f"device {kind_name}, backend {devices.spec_for(kind_name).backend}; global batch {args.batch}, "
              f"4 epochs of 512-sample global minibatches; {args.iterations} timed iterations after 3 warm-up")
        base = None
        for L in args.learners:
            r = run_learners(L, kind, args.batch, args.iterations, kind_name)
            base = base or r["samples_per_s"]
            eff = r["samples_per_s"] / (L * base)
            rows.append({"learners": L, **r, "efficiency": eff})
            print(f"learners {L}: {r['samples_per_s']:,.0f} samples/s | speed-up x{r['samples_per_s'] / base:.2f} | "
                  f"efficiency {100 * eff:.0f}% | host-bound {100 * r['host_bound']:.1f}% | "
                  f"weights identical across ranks: {r['identical']}", flush=True)
    return rows, None


if __name__ == "__main__":
    cli(make_parser, run)
