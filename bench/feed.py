"""Inline feed vs the pipelined device feed, side by side in one run.

Both modes train the same PPO learner on the same fragments, on the ticketed data plane of a training run:
producer actors fill the supply board's tickets into one replay shard, and a new policy version is published
after every update (so producers run ``--max-policy-lag`` updates ahead and data is waiting). Inline: each
iteration claims, takes, collates and copies its update's fragments, then updates. Pipelined:
``pipeline.feed.DeviceFeed`` does the same on a background thread into a double buffer while the update runs.
Both modes run ``--warmup`` untimed iterations first. Prints host-bound fraction (time the update loop spent
getting data / wall time) and learner samples/s for both, and their ratios.

    .venv/bin/python bench/feed.py [--kind vector|image|both] [--iterations 40] [--warmup 2] [--max-policy-lag 3]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from learner import device as devices  # noqa: E402
from learner.learner import Learner  # noqa: E402
from learner.model import ActorCritic  # noqa: E402
from learner.ppo import LossCoefs  # noqa: E402
from pipeline import fragment as F  # noqa: E402
from pipeline.feed import DeviceFeed  # noqa: E402
from bench._common import local_ray, parser, run_main  # noqa: E402
from bench._supply import KINDS, Producer, next_batch, policy_spec, supply  # noqa: E402


def make_learner(kind: dict, device) -> Learner:
    torch.manual_seed(0)
    return Learner(ActorCritic(policy_spec(kind)), lr=3e-4, adam_eps=1e-5, anneal_lr=False, total_updates=10**6,
                   update_epochs=2, minibatch_size=256, max_grad_norm=0.5, coefs=LossCoefs(),
                   device=device.torch_device())


def pull(board, update: int, n: int) -> list[F.Fragment]:
    """What ``DeviceFeed`` does per batch, inline: claim ``n`` stored fragments of ``update``, take them."""
    frags, failed = [], []
    while len(frags) < n:
        claims = ray.get(board.claim.remote(0, update, n - len(frags), 0.05, failed))
        failed = []
        for ref in [handle.take.remote(tickets) for handle, tickets in claims.values()]:  # all sent, then gathered
            items, missing = ray.get(ref)
            failed += missing
            frags += [frag for _, frag in items]
    return frags


def run_inline(board, weights, kind, device, iterations: int, warmup: int) -> dict:
    learner = make_learner(kind, device)
    keys = None
    t_data, samples = 0.0, 0
    for i in range(warmup + iterations):
        if i == warmup:  # same clock start as run_pipelined
            t_data, samples, t0 = 0.0, 0, time.perf_counter()
        t = time.perf_counter()
        frags = pull(board, i, kind["fragments"])
        keys = keys or F.obs_keys(frags[0].arrays) + list(F.TRAIN_KEYS)
        batch = {k: torch.from_numpy(np.concatenate([f.flat(k) for f in frags])).to(device.torch_device())
                 for k in keys}
        device.synchronize()
        t_data += time.perf_counter() - t
        learner.update(batch)
        board.publish.remote(i + 1, weights)  # as LearnerActor: not awaited; creates the next update's tickets
        samples += batch[F.ACTIONS].shape[0]
    wall = time.perf_counter() - t0
    return {"host_bound": t_data / wall, "samples_per_s": samples / wall}


def run_pipelined(board, weights, kind, device, iterations: int, warmup: int) -> dict:
    learner = make_learner(kind, device)
    feed = DeviceFeed(board, 0, kind["fragments"], device, prefetch_batches=1).start()
    t_wait, samples = 0.0, 0
    try:
        for i in range(warmup + iterations):
            if i == warmup:  # same clock start as run_inline
                t_wait, samples, t0 = 0.0, 0, time.perf_counter()
            batch, wait_s = next_batch(feed, device, 60)
            t_wait += wait_s
            learner.update(batch.tensors)
            feed.release(batch)
            board.publish.remote(i + 1, weights)
            samples += batch.num_samples
        wall = time.perf_counter() - t0
    finally:
        feed.stop()
    return {"host_bound": t_wait / wall, "samples_per_s": samples / wall}


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--kind", choices=["vector", "image", "both"], default="both")
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed iterations (data + update) before the clock starts, in both modes")
    p.add_argument("--max-policy-lag", type=int, default=3,
                   help="how many updates ahead producers may fill tickets (3: 8 fragments in flight, as the old "
                        "8-fragment shard)")
    p.add_argument("--device", default="auto")
    args = p.parse_args()
    if args.iterations < 1 or args.warmup < 0 or args.max_policy_lag < 0:
        p.error("--iterations must be >= 1, --warmup >= 0 and --max-policy-lag >= 0")
    torch.set_num_threads(1)
    device = devices.resolve(args.device)
    with local_ray(4):
        print(f"device: {device.kind}; {args.iterations} iterations per mode after {args.warmup} untimed; "
              f"update = 2 epochs of 256-sample minibatches; ticketed data plane, max_policy_lag "
              f"{args.max_policy_lag}, a new policy version published after every update")
        for name in (["vector", "image"] if args.kind == "both" else [args.kind]):
            kind, per_update, res = KINDS[name], KINDS[name]["fragments"], {}
            for mode, fn in (("inline", run_inline), ("pipelined", run_pipelined)):
                board, (shard,) = supply(1, (args.max_policy_lag + 1) * per_update, per_update, args.max_policy_lag)
                weights = [ray.put(None)]  # the producers stamp versions but load no weights
                producers = [Producer.remote(board, shard, 0, kind, actor_id=i) for i in range(2)]
                runs = [pr.run.remote(600) for pr in producers]
                try:
                    res[mode] = fn(board, weights, kind, device, args.iterations, args.warmup)
                finally:
                    for a in producers + [shard, board]:
                        ray.kill(a)
                    del runs
                print(f"{name:6s} {mode:9s}: host-bound {100 * res[mode]['host_bound']:5.1f}% | "
                      f"learner {res[mode]['samples_per_s']:,.0f} samples/s", flush=True)
            inline, piped = res["inline"], res["pipelined"]
            print(f"{name:6s} pipelined/inline: samples/s x{piped['samples_per_s'] / inline['samples_per_s']:.2f}, "
                  f"host-bound {100 * inline['host_bound']:.1f}% -> {100 * piped['host_bound']:.1f}%", flush=True)
    return 0


if __name__ == "__main__":
    run_main(main)
