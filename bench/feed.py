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

import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from learner import device as devices  # noqa: E402
from learner.learner import Learner, LearnerSettings  # noqa: E402
from learner.model import ActorCritic  # noqa: E402
from learner.ppo import LossCoefs  # noqa: E402
from pipeline import fragment as F  # noqa: E402
from pipeline.feed import DeviceFeed  # noqa: E402
from pipeline.protocol import Publish  # noqa: E402
from bench._common import cli, local_ray, parser, require  # noqa: E402
from bench._supply import KINDS, Producer, claim_take, data_plane, pipelined_step, policy_spec, timed  # noqa: E402


def make_learner(kind: dict, device) -> Learner:
    torch.manual_seed(0)
    settings = LearnerSettings(lr=3e-4, adam_eps=1e-5, anneal_lr=False, total_updates=10**6, update_epochs=2,
                               minibatch_size=256, max_grad_norm=0.5, coefs=LossCoefs())
    return Learner(ActorCritic(policy_spec(kind)), settings, device.torch_device())


def pull(board, update: int, n: int) -> list[F.Fragment]:
    """What ``DeviceFeed`` does per batch, inline: claim ``n`` stored fragments of ``update``, take them."""
    frags, failed = [], []
    while len(frags) < n:
        got, failed = claim_take(board, update, n - len(frags), 0.05, failed)
        frags += got
    return frags


def run_inline(board, weights, kind, device, iterations: int, warmup: int) -> dict:
    learner, update = make_learner(kind, device), itertools.count()

    def step():
        i, t = next(update), time.perf_counter()
        frags = pull(board, i, kind["fragments"])
        batch = {k: torch.from_numpy(np.concatenate([f.flat(k) for f in frags])).to(device.torch_device())
                 for k in F.obs_keys(frags[0].arrays) + list(F.TRAIN_KEYS)}
        device.synchronize()
        data_s = time.perf_counter() - t
        learner.update(batch)
        board.publish.remote(Publish(i + 1, weights))  # as LearnerActor: not awaited; creates the next update's tickets
        return batch[F.ACTIONS].shape[0], data_s

    return timed(step, warmup=warmup, iterations=iterations)  # the same clock as run_pipelined's


def run_pipelined(board, weights, kind, device, iterations: int, warmup: int) -> dict:
    feed = DeviceFeed(board, 0, kind["fragments"], device, prefetch_batches=1).start()
    try:
        return timed(pipelined_step(feed, make_learner(kind, device), board, weights, device), warmup=warmup,
                     iterations=iterations)
    finally:
        feed.stop()


def compare(name: str, device, iterations: int, warmup: int, max_policy_lag: int, into: dict | None = None) -> dict:
    """Both modes on ``KINDS[name]``'s fragments, each on a fresh board, shard and two producers (on the Ray this
    process has): {mode: {host_bound, samples_per_s}}, each mode into ``into`` as it finishes, then the two
    host-bound fractions and the samples/s ratio pipelined / inline."""
    kind, per_update = KINDS[name], KINDS[name]["fragments"]
    res = {} if into is None else into
    for mode, fn in (("inline", run_inline), ("pipelined", run_pipelined)):
        with data_plane(1, (max_policy_lag + 1) * per_update, per_update, max_policy_lag) as (board, (shard,), actors):
            weights = [ray.put(None)]  # the producers stamp versions but load no weights
            actors += [Producer.remote(board, shard, 0, kind, actor_id=i) for i in range(2)]
            runs = [pr.run.remote(600) for pr in actors]
            res[mode] = fn(board, weights, kind, device, iterations, warmup)
            del runs
        print(f"{name:6s} {mode:9s}: host-bound {100 * res[mode]['host_bound']:5.1f}% | "
              f"learner {res[mode]['samples_per_s']:,.0f} samples/s", flush=True)
    inline, piped = res["inline"], res["pipelined"]
    res.update(host_bound_inline=inline["host_bound"], host_bound_pipelined=piped["host_bound"],
               samples_per_s_ratio=piped["samples_per_s"] / inline["samples_per_s"])
    print(f"{name:6s} pipelined/inline: samples/s x{res['samples_per_s_ratio']:.2f}, "
          f"host-bound {100 * inline['host_bound']:.1f}% -> {100 * piped['host_bound']:.1f}%", flush=True)
    return res


def make_parser():
    p = parser(__doc__, device=True)
    p.add_argument("--kind", choices=["vector", "image", "both"], default="both")
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed iterations (data + update) before the clock starts, in both modes")
    p.add_argument("--max-policy-lag", type=int, default=3,
                   help="how many updates ahead producers may fill tickets (3: 8 fragments in flight, as the old "
                        "8-fragment shard)")
    return p


def run(args) -> tuple[dict, None]:
    require(args.iterations >= 1 and args.warmup >= 0 and args.max_policy_lag >= 0,
            "--iterations must be >= 1, --warmup >= 0 and --max-policy-lag >= 0")
    torch.set_num_threads(1)
    device = devices.resolve(args.device)
    with local_ray(4):
        print(f"device: {device.kind}; {args.iterations} iterations per mode after {args.warmup} untimed; "
              f"update = 2 epochs of 256-sample minibatches; ticketed data plane, max_policy_lag "
              f"{args.max_policy_lag}, a new policy version published after every update")
        return {name: compare(name, device, args.iterations, args.warmup, args.max_policy_lag)
                for name in (["vector", "image"] if args.kind == "both" else [args.kind])}, None


if __name__ == "__main__":
    cli(make_parser, run)
