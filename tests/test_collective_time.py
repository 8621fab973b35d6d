"""Each learner times its own collectives (``collective_s``; ``collective_share`` of its update), on 2 real gloo ranks.

Two spawned processes in a gloo group train the same model on different batches through ``Learner`` with the
collectives a ``LearnerActor`` gives it (``distributed.learner_collectives``). Rank 1 is a slow peer: it sleeps
PEER_DELAY_S before each gradient all-reduce, so rank 0 waits that long inside every one of them. What rank 0's update
reports must hold that wait: at least the delay times its minibatch steps, and still less than the update itself.
A learner that stopped timing its gradient all-reduce (or timed only the call's start on a device stream) would
report the small collectives alone and fail the lower bound; one that timed outside the update, the upper.
"""

from __future__ import annotations

import time

import pytest
import torch

from learner import device as devices
from learner import distributed
from learner.learner import Learner, LearnerSettings
from learner.model import ActorCritic
from learner.ppo import LossCoefs
from learner.spec import ModalityInput, PolicySpec
from pipeline import fragment as F
from pipeline import metric_keys as M
from tests.test_distributed import WORLD, run_ranks

# One xdist_group (`make test` runs --dist loadgroup): its two ranks' run (a module fixture, ~12 s of spawning
# and gloo) made once, on one worker.
pytestmark = pytest.mark.xdist_group("collective_time")

#: Rank 1's sleep before each gradient all-reduce: long beside a CartPole-size step on this CPU (well under a
#: millisecond of all-reduce), short enough that the whole test stays a few seconds.
PEER_DELAY_S = 0.02
ROWS, MINIBATCH, EPOCHS, UPDATES = 256, 64, 2, 3
STEPS = EPOCHS * ROWS // MINIBATCH  # gradient all-reduces an update
#: A normalised vector: the update also gathers the observation statistics (one more collective per update).
SPEC = PolicySpec((ModalityInput("vector", "vector", (4,), "float32", normalize=True),), "discrete", 2,
                  hidden_sizes=(32, 32))


def _batch(rank: int, model: ActorCritic) -> dict:
    g = torch.Generator().manual_seed(rank)
    obs = torch.randn(ROWS, 4, generator=g) * (1 + rank)
    actions = torch.randint(0, 2, (ROWS,), generator=g)
    with torch.no_grad():
        logp, _, values = model.evaluate({"vector": obs}, actions)
    adv = torch.randn(ROWS, generator=g)
    return {F.obs_key("vector"): obs, F.ACTIONS: actions, F.LOGP: logp, F.VALUES: values, F.ADVANTAGES: adv,
            F.RETURNS: adv + values}


def _updates(rank: int, fused: bool) -> list[dict]:
    c = distributed.learner_collectives(WORLD, devices.spec_for("cpu"))
    grad_sync = c.grad
    if rank == 1:  # the slow peer: rank 0's all-reduce waits for it
        def grad_sync(model):
            time.sleep(PEER_DELAY_S)
            c.grad(model)

    torch.manual_seed(0)
    model = ActorCritic(SPEC)
    settings = LearnerSettings(lr=1e-3, adam_eps=1e-5, anneal_lr=False, total_updates=UPDATES, update_epochs=EPOCHS,
                               minibatch_size=MINIBATCH, max_grad_norm=0.5, coefs=LossCoefs(), fused_update=fused)
    learner = Learner(model, settings, torch.device("cpu"), grad_sync=grad_sync, stats_sync=c.stats,
                      kl_sync=c.mean, nonfinite_sync=c.mean, collective_clock=c.clock)
    batch = _batch(rank, model)
    out = []
    for _ in range(UPDATES):
        t = time.perf_counter()
        stats = learner.update(batch)
        update_s = time.perf_counter() - t  # as LearnerActor.train_iteration times the update
        out.append({"collective_s": stats[M.COLLECTIVE_S], "update_s": update_s, "intervals": c.clock.intervals,
                    "path": learner.update_path})
    return out


def _worker(rank: int) -> dict:
    return {"fused": _updates(rank, True), "autograd": _updates(rank, False)}


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    return run_ranks(_worker, tmp_path_factory.mktemp("ranks"))


@pytest.mark.parametrize("step", ["fused", "autograd"])
def test_each_update_reports_its_collectives_seconds_and_their_share(per_rank, step):
    lead = per_rank[0][step]
    assert lead[0]["path"].startswith(step), lead[0]["path"]  # the step the case names really ran
    for u, rec in enumerate(lead):
        seconds, update_s = rec["collective_s"], rec["update_s"]
        share = seconds / update_s  # COLLECTIVE_SHARE, as LearnerActor computes it
        # Rank 0 waited for its slow peer in each of the update's gradient all-reduces.
        assert seconds >= 0.8 * STEPS * PEER_DELAY_S, (step, u, rec)
        assert 0.0 < seconds < update_s and 0.0 < share < 1.0, (step, u, rec)
        # Every collective of the update, each once: the gradient all-reduces, the statistics, the non-finite flag.
        assert rec["intervals"] == STEPS + 2, (step, u, rec)


def test_one_learner_reports_zero():
    """No collectives, no clock: the keys are there, and 0.0."""
    torch.manual_seed(0)
    model = ActorCritic(SPEC)
    settings = LearnerSettings(lr=1e-3, adam_eps=1e-5, anneal_lr=False, total_updates=1, update_epochs=1,
                               minibatch_size=MINIBATCH, max_grad_norm=0.5, coefs=LossCoefs())
    assert distributed.learner_collectives(1, devices.spec_for("cpu")) is None
    stats = Learner(model, settings, torch.device("cpu")).update(_batch(0, model))
    assert stats[M.COLLECTIVE_S] == 0.0
