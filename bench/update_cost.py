"""One PPO update: the fused step against the autograd path, in one process, on the same fixed batch.

For each config (default configs/cartpole.yaml and configs/pendulum.yaml) the bench builds the model its run would
build (cluster.graph.describe_env) and two learners with that config's settings (cluster.graph.learner_settings),
identical weights, one with ``learner.fused_update: false`` (autograd: ``learner/ppo.py``'s loss, torch's
backward, ``clip_grad_norm_``, fused ``torch.optim.Adam``: the update as it was before the fused step) and one
with the fused step. The batch is fixed and synthetic, one learner's ``batch_size`` samples: observations and
actions from the model itself, stored log-probs and values offset so that clipping happens.

Printed per config: ms per update (median of alternating reps, after warm-up), ms per minibatch step, the
autograd / fused ratio, and how far apart the two learners' parameters are after one update and after all reps
(identical results are the acceptance bar: <= 1e-5). The learner's own thread count (learner.torch_threads) is
used, as in a run.

    .venv/bin/python bench/update_cost.py [--config configs/cartpole.yaml ...] [--reps 30] [--out FILE]
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import cli, parser, table  # noqa: E402
from cluster import config as config_mod  # noqa: E402
from cluster.graph import describe_env, learner_settings  # noqa: E402
from learner.learner import Learner, LearnerSettings  # noqa: E402
from learner.model import ActorCritic  # noqa: E402
from pipeline import fragment as F  # noqa: E402

DEFAULT_CONFIGS = ["configs/cartpole.yaml", "configs/pendulum.yaml"]


def synthetic_batch(spec, n: int, seed: int = 0, model: ActorCritic | None = None) -> dict[str, torch.Tensor]:
    """A fixed batch as the feed hands it over: obs/<modality> in the pipeline's dtypes plus the PPO arrays. With
    ``model``: actions, log-probs and values from the model itself, the stored ones offset so that clipping happens
    (this bench); without, random ones (bench/device_check.py: only shapes and dtypes matter for the update's cost)."""
    g = torch.Generator().manual_seed(seed)
    obs = {}
    for mod in spec.modalities:
        shape = (n,) + tuple(mod.shape)
        if mod.dtype == "uint8":
            obs[mod.name] = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        elif mod.dtype == "int64":
            obs[mod.name] = torch.randint(1, max(2, mod.vocab_size), shape, generator=g, dtype=torch.int64)
        else:
            obs[mod.name] = torch.randn(shape, generator=g)
    batch = {F.obs_key(k): v for k, v in obs.items()}
    if model is not None:
        with torch.no_grad():
            actions, logp, values = model.act(obs, generator=g)
        adv = torch.randn(n, generator=g)
        batch.update({F.ACTIONS: actions, F.LOGP: logp + 0.3 * torch.randn(n, generator=g),
                      F.VALUES: values + 0.3 * torch.randn(n, generator=g), F.ADVANTAGES: adv, F.RETURNS: values + adv})
        return batch
    if spec.action_kind == "discrete":
        batch[F.ACTIONS] = torch.randint(0, spec.action_dim, (n,), generator=g)
        batch[F.LOGP] = torch.full((n,), -math.log(spec.action_dim))
    else:
        batch[F.ACTIONS] = torch.randn((n, spec.action_dim), generator=g)
        batch[F.LOGP] = torch.randn((n,), generator=g)
    for k in (F.VALUES, F.ADVANTAGES, F.RETURNS):
        batch[k] = torch.randn((n,), generator=g)
    return batch


def make_learner(spec, settings: LearnerSettings, device, seed: int, grad_sync=None, **variant) -> Learner:
    """A ``Learner`` of a fresh ``ActorCritic(spec)`` (weights from ``seed``) with a config's settings
    (``cluster.graph.learner_settings``) and ``variant`` over them (precision, fused_update, graphs, compile...)."""
    torch.manual_seed(seed)
    return Learner(ActorCritic(spec), dataclasses.replace(settings, **variant, seed=seed), device, grad_sync=grad_sync)


def timed_update(learner: Learner, batch: dict, sync=lambda: None) -> tuple[float, dict]:
    """(seconds, stats) of one ``learner.update(batch)``; ``sync()`` before each clock read (a device's queue)."""
    sync()
    t = time.perf_counter()
    stats = learner.update(batch)
    sync()
    return time.perf_counter() - t, stats


def measure(config: str, reps: int) -> dict:
    cfg = config_mod.load(config)
    torch.set_num_threads(cfg.learner.torch_threads)
    spec, settings = describe_env(cfg), learner_settings(cfg)
    autograd, fused = (make_learner(spec, settings, torch.device("cpu"), cfg.run.seed, fused_update=f)
                       for f in (False, True))  # the same seed: the same weights
    if fused.fused is None:
        return {"config": config, "skipped": fused.update_path}
    batch = synthetic_batch(autograd.model.spec, cfg.learner.batch_size // cfg.learner.num_learners,
                            model=autograd.model)
    autograd.update(batch), fused.update(batch)
    diff_one = float(np.abs(autograd.flat_params() - fused.flat_params()).max())
    times = {"autograd": [], "fused": []}
    for r in range(reps):  # alternating which goes first, so drift in the machine's state hits both
        pair = [("autograd", autograd), ("fused", fused)]
        for name, learner in (pair if r % 2 == 0 else pair[::-1]):
            seconds, stats = timed_update(learner, batch)
            times[name].append(seconds)
    steps = stats["minibatch_steps"]
    ms = {k: 1000 * float(np.median(v)) for k, v in times.items()}
    return {"config": config, "samples": int(batch[F.ACTIONS].shape[0]), "minibatch_steps": steps,
            "autograd_ms": ms["autograd"], "fused_ms": ms["fused"], "ratio": ms["autograd"] / ms["fused"],
            "autograd_ms_range": [1000 * min(times["autograd"]), 1000 * max(times["autograd"])],
            "fused_ms_range": [1000 * min(times["fused"]), 1000 * max(times["fused"])],
            "max_param_diff_after_1": diff_one,
            "max_param_diff_after_all": float(np.abs(autograd.flat_params() - fused.flat_params()).max()),
            "updates": reps + 1, "torch_threads": cfg.learner.torch_threads, "update_path": fused.update_path}


def make_parser():
    p = parser(__doc__, out="write the results as JSON")
    p.add_argument("--config", nargs="+", default=DEFAULT_CONFIGS)
    p.add_argument("--reps", type=int, default=30)
    return p


def run(args):
    print(f"torch {torch.__version__} | {args.reps} alternating reps | torch threads: each config's "
          f"learner.torch_threads")
    results = [measure(c, args.reps) for c in args.config]
    rows = []
    for r in results:
        if "skipped" in r:
            print(f"{r['config']}: no fused step ({r['skipped']})")
            continue
        rows.append((r["config"], r["samples"], r["minibatch_steps"], r["autograd_ms"], r["fused_ms"],
                     r["autograd_ms"] / r["minibatch_steps"], r["fused_ms"] / r["minibatch_steps"], r["ratio"],
                     f"{r['max_param_diff_after_1']:.1e} / {r['max_param_diff_after_all']:.1e}"))
    table([("config", "<24"), ("samples", ">7d"), ("steps", ">5d"), ("autograd ms", ">11.2f"),
           ("fused ms", ">8.2f"), ("ms/step old", ">11.3f"), ("ms/step new", ">11.3f"), ("old/new", ">7.2f"),
           ("max |dparam| 1 update / all", ">28")], rows, sep="  ", rule=True)
    return results, None


if __name__ == "__main__":
    cli(make_parser, run)
