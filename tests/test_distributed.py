"""learner/distributed.py on 2 real gloo ranks (spawned processes, 127.0.0.1).

Every rank holds DIFFERENT gradients / normaliser statistics: with identical ranks a missing division by the world
size, or a merge that ignores the per-rank counts, would go unseen. Results come back as files; joins have a
deadline, so a hung collective fails the test instead of blocking the suite.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from learner import distributed
from learner.encoders import NORM_INITIAL_COUNT, VectorEncoder
from learner.model import ActorCritic, ModalityInput, PolicySpec

WORLD = 2
DEADLINE_S = 60.0
CALLS = 2
UPDATES = 3


# --------------------------------------------------------------------------- harness


def _entry(worker, rank: int, out_dir: str) -> None:
    """Rank 0 opens the group's rendezvous as a learner's ``address()`` does (``distributed.rendezvous_socket`` on
    127.0.0.1) and hands its port to the other rank through a file."""
    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        listening = None
        if rank == 0:
            listening = distributed.rendezvous_socket("127.0.0.1")
            port = listening.getsockname()[1]
            (out / "port.tmp").write_text(str(port))
            (out / "port.tmp").rename(out / "port")
        else:
            deadline = time.monotonic() + DEADLINE_S
            while not (out / "port").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            port = int((out / "port").read_text())
        distributed.init_process_group("gloo", "127.0.0.1", port, rank, WORLD, timeout_s=30.0, listening=listening)
        try:
            result = worker(rank)
        finally:
            distributed.destroy()
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        sys.exit(1)


def run_ranks(worker, tmp_path: Path) -> list:
    """Run ``worker(rank)`` on WORLD spawned gloo ranks; returns each rank's result."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(worker, r, str(tmp_path)), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + DEADLINE_S
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5)
    errors = {r: (tmp_path / f"rank{r}.err").read_text() for r in range(WORLD) if (tmp_path / f"rank{r}.err").exists()}
    assert not hung, f"ranks {hung} still running after {DEADLINE_S}s (hung collective?); errors: {errors}"
    assert not errors and all(p.exitcode == 0 for p in procs), (errors, [p.exitcode for p in procs])
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


# --------------------------------------------------------------------------- the rendezvous


def _listening_worker(rank: int) -> dict:
    """This rank's listening TCP sockets once the group has met and made a collective."""
    import os

    from tests.test_run_dir_trust import listening_sockets

    value = torch.ones(1)
    distributed.MeanAllReduce(WORLD)(value)
    return {"listening": [(ip, port) for _, ip, port in listening_sockets([os.getpid()])]}


def test_the_group_listens_on_its_rendezvous_address_only(tmp_path):
    """Rank 0's store serves on the socket ``rendezvous_socket`` bound to the node's address (127.0.0.1 here): a
    TCPStore opened by port alone listens on every interface, where anyone who reaches the host could set the
    group's keys while it meets. Each rank's gloo endpoint binds one address too."""
    results = run_ranks(_listening_worker, tmp_path)
    port = int((tmp_path / "port").read_text())
    assert (("127.0.0.1", port)) in results[0]["listening"], results[0]
    for rank, r in enumerate(results):
        opened = [entry for entry in r["listening"] if entry[0] != "127.0.0.1"]
        assert opened == [], f"rank {rank} listens beyond its address: {opened}"


# --------------------------------------------------------------------------- GradAllReduce


def _grad_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    model.frozen = nn.Parameter(torch.ones(5), requires_grad=False)  # grad stays None: must be skipped
    return model


def _rank_grads(rank: int, call: int) -> list[torch.Tensor]:
    """What rank ``rank`` holds before all-reduce ``call``: different on every rank and every call."""
    g = torch.Generator().manual_seed(100 * call + rank)
    return [torch.randn(p.shape, generator=g) * (1 + rank) + 3.0 * rank
            for p in _grad_model().parameters() if p.requires_grad]


def _grad_worker(rank: int) -> dict:
    model = _grad_model()
    reduce = distributed.GradAllReduce(WORLD)
    after = []
    for call in range(CALLS):
        for p, g in zip([p for p in model.parameters() if p.requires_grad], _rank_grads(rank, call)):
            p.grad = g.clone()
        reduce(model)
        after.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
    # broadcast_params: every rank starts from rank 0's weights.
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(rank + 1))
    distributed.broadcast_params(model, src=0)
    return {"after": after, "calls": reduce.calls, "frozen_grad": model.frozen.grad,
            "params": [p.detach().clone() for p in model.parameters()]}


def test_grad_all_reduce_leaves_the_mean_of_different_gradients_on_every_rank(tmp_path):
    results = run_ranks(_grad_worker, tmp_path)
    for call in range(CALLS):
        per_rank = [_rank_grads(r, call) for r in range(WORLD)]
        expected = [torch.stack(gs).mean(0) for gs in zip(*per_rank)]
        for r, res in enumerate(results):
            for got, want, own in zip(res["after"][call], expected, per_rank[r]):
                assert not torch.allclose(want, own)  # the ranks really differed
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for res in results:
        assert res["calls"] == CALLS
        assert res["frozen_grad"] is None
        for p in res["params"]:
            assert torch.equal(p, torch.ones_like(p))  # rank 0 filled 1.0, rank 1 filled 2.0


def _missing_grad_worker(rank: int) -> dict:
    """Rank 1's backward reached only the first layer (several policies: its minibatch had no rows of the policy
    that owns the second), so its second layer's gradients are None."""
    model = _grad_model()
    params = [p for p in model.parameters() if p.requires_grad]
    for i, (p, g) in enumerate(zip(params, _rank_grads(rank, 0))):
        p.grad = None if rank == 1 and i >= 2 else g.clone()
    distributed.GradAllReduce(WORLD)(model)
    return {"after": [p.grad.clone() for p in params]}


def test_grad_all_reduce_takes_a_missing_gradient_as_zeros_on_every_rank(tmp_path):
    """Buffers of different lengths made gloo raise (NCCL and HCCL hang); now each rank sends every trainable
    parameter, and a rank's missing gradient counts as zeros in the mean."""
    results = run_ranks(_missing_grad_worker, tmp_path)
    per_rank = [_rank_grads(r, 0) for r in range(WORLD)]
    for i, want0 in enumerate(per_rank[0]):
        want = (want0 + per_rank[1][i]) / WORLD if i < 2 else want0 / WORLD
        for res in results:
            torch.testing.assert_close(res["after"][i], want, rtol=1e-6, atol=1e-6)


def _timeout_of(stall_s: float) -> float:
    return distributed.collective_timeout_s(stall_s)


def test_collective_timeout_outlasts_the_drivers_deadline_and_hccl_ranges():
    """The watchdog of NCCL and HCCL (the process group's timeout) must never strike before the driver ends an
    iteration (run.stall_timeout_s + ITERATION_GRACE_S), and HCCL's variables stay within HCCL's ranges; a value
    the user set is kept."""
    from cluster.driver import ITERATION_GRACE_S

    for stall in (1.0, 10.0, 60.0, 600.0, 3600.0):
        assert _timeout_of(stall) > stall + ITERATION_GRACE_S + max(30.0, stall)
    env, _ = distributed.hccl_settings(1e9, environ={"HCCL_CONNECT_TIMEOUT": "300"})
    assert env == {"HCCL_EXEC_TIMEOUT": "17340", "HCCL_CONNECT_TIMEOUT": "300"}  # A1's top: valid on every family
    assert distributed.hccl_settings(1.0, environ={})[0]["HCCL_CONNECT_TIMEOUT"] == "120"


# CANN's HCCL_EXEC_TIMEOUT reference, per family: A1 applies the value rounded down to a multiple of 68 (600 -> 544,
# its own example); A2 and A3 apply it as given, 0 meaning never, and at most 1091 under AIV expansion.
@pytest.mark.parametrize("family,aiv,value,applied", [
    ("A1", False, 600, 544), ("A1", False, 10, 68), ("A1", False, 99999, 17340),
    ("A2", False, 600, 600), ("A2", False, 0, float("inf")), ("A2", False, 99999, 99999),
    ("A3", True, 1500, 1091), ("A2", True, 0, 1091), ("A2", True, 300, 300)])
def test_hccl_applies_exec_timeouts_by_chip_family(family, aiv, value, applied):
    assert distributed.applied_exec_timeout_s(value, family, aiv) == applied


@pytest.mark.parametrize("soc,family", [("Ascend910B3", "A2"), ("Ascend910B4-1", "A2"), ("Ascend910_9391", "A3"),
                                        ("Ascend910ProB", "A1"), ("Ascend910A", "A1"), ("Ascend910B", "A1"),
                                        ("Ascend310P3", None), (None, None)])
def test_chip_family_from_torch_npus_soc_names(soc, family):
    assert distributed.chip_family(soc) == family


@pytest.mark.parametrize("family", ["A1", "A2", "A3", None])
@pytest.mark.parametrize("aiv", [False, True])
@pytest.mark.parametrize("stall", [1.0, 60.0, 600.0, 3600.0])
def test_the_group_outlasts_hccls_exec_timeout_which_outlasts_the_driver(family, aiv, stall):
    """HCCL's execution timeout, as HCCL applies it on each family, is at least the wait a collective must be allowed
    (the driver decides first) wherever the family allows that much (AIV caps it at 1091 s), and the process group's
    timeout (torch_npu's watchdog) is past it by WATCHDOG_AFTER_EXEC_S: torch_npu warns when the watchdog is not
    later, and HCCL's own report of a stuck collective would be lost."""
    need = _timeout_of(stall)
    env, group_s = distributed.hccl_settings(need, environ={"HCCL_OP_EXPANSION_MODE": "AIV"} if aiv else {},
                                             family=family)
    value = int(env["HCCL_EXEC_TIMEOUT"])
    assert value > 0 and value % distributed.HCCL_EXEC_STEP_S == 0 or value == distributed.HCCL_EXEC_AIV_MAX_S
    # Unknown family: right on every one (AIV expansion exists on A2 and A3 only).
    for reading in [family] if family else ["A2", "A3"] if aiv else ["A1", "A2", "A3"]:
        applied = distributed.applied_exec_timeout_s(value, reading, aiv and reading != "A1")
        cap = distributed.HCCL_EXEC_AIV_MAX_S if aiv and reading != "A1" else distributed.HCCL_EXEC_MAX_S[reading]
        assert applied >= min(need, cap), (reading, applied)
        assert group_s >= applied + distributed.WATCHDOG_AFTER_EXEC_S, (reading, applied, group_s)
    assert group_s >= need


def test_a_users_exec_timeout_is_kept_and_the_group_waits_past_it():
    env, group_s = distributed.hccl_settings(240.0, environ={"HCCL_EXEC_TIMEOUT": "1800"}, family="A2")
    assert env["HCCL_EXEC_TIMEOUT"] == "1800" and group_s == 1800 + distributed.WATCHDOG_AFTER_EXEC_S
    env, group_s = distributed.hccl_settings(240.0, environ={"HCCL_EXEC_TIMEOUT": "0"}, family="A2")
    assert group_s == 240.0  # never: the watchdog alone bounds a collective


# --------------------------------------------------------------------------- RunningStatsAllReduce

SPEC = PolicySpec(
    modalities=(
        ModalityInput("pos", "vector", (3,), "float32"),
        ModalityInput("vel", "vector", (2, 2), "float32"),
        ModalityInput("raw", "vector", (2,), "float32", normalize=False),  # no statistics: left out of the reduce
    ),
    action_kind="discrete",
    action_dim=2,
    hidden_sizes=(8,),
)
NORMALISED = ("pos", "vel")


def _rank_obs(rank: int, update: int) -> dict[str, torch.Tensor]:
    """Rank-dependent batch sizes, means and spreads, so neither unweighted nor variance-only averaging fits."""
    g = torch.Generator().manual_seed(1000 * update + rank)
    n = 5 + 6 * rank + update
    return {m.name: torch.randn((n,) + m.shape, generator=g) * (1.0 + 1.5 * rank) + (2.0 * rank - update)
            for m in SPEC.modalities}


def _stats(model) -> dict[str, tuple[torch.Tensor, ...]]:
    return {name: tuple(getattr(model.encoders[name], b).detach().clone()
                        for b in ("running_mean", "running_var", "running_count")) for name in NORMALISED}


def _stats_worker(rank: int) -> dict:
    model = ActorCritic(SPEC)
    sync = distributed.RunningStatsAllReduce(WORLD)
    before, after = [], []
    for update in range(UPDATES):
        model.update_normalizers(_rank_obs(rank, update))
        before.append(_stats(model))
        sync(model)
        after.append(_stats(model))
    return {"before": before, "after": after}


def _pooled(update: int, name: str):
    """Hand-computed (float64) statistics of every rank's data up to ``update``, concatenated on one process.

    Each rank started from NORM_INITIAL_COUNT pseudo-samples at mean 0, var 1; pooled, that prior weighs
    WORLD * NORM_INITIAL_COUNT. The count each rank keeps is the pooled count / WORLD (per rank), so that the prior's
    weight against the next update's batches stays what one rank gives it.
    """
    batches = [_rank_obs(r, u)[name] for u in range(update + 1) for r in range(WORLD)]
    x = np.concatenate([b.reshape(len(b), -1).double().numpy() for b in batches])
    w0 = WORLD * NORM_INITIAL_COUNT
    total = w0 + len(x)
    mean = x.sum(0) / total
    var = (w0 * 1.0 + np.square(x).sum(0)) / total - np.square(mean)
    return mean, var, total / WORLD


def test_running_stats_all_reduce_pools_different_statistics(tmp_path):
    results = run_ranks(_stats_worker, tmp_path)
    for name in NORMALISED:
        assert not torch.allclose(results[0]["before"][0][name][0], results[1]["before"][0][name][0])
        assert results[0]["before"][0][name][2] != results[1]["before"][0][name][2]
    for update in range(UPDATES):
        for name in NORMALISED:
            mean, var, count = _pooled(update, name)
            for res in results:
                got_mean, got_var, got_count = (t.double().numpy() for t in res["after"][update][name])
                np.testing.assert_allclose(got_mean, mean, rtol=1e-5, atol=1e-5, err_msg=f"{name} mean, update {update}")
                np.testing.assert_allclose(got_var, var, rtol=1e-5, atol=1e-5, err_msg=f"{name} var, update {update}")
                np.testing.assert_allclose(got_count, count, rtol=1e-6, err_msg=f"{name} count, update {update}")
            # Every rank normalises identically afterwards.
            for a, b in zip(results[0]["after"][update][name], results[1]["after"][update][name]):
                assert torch.equal(a, b)
    raw = ActorCritic(SPEC).encoders["raw"]
    assert isinstance(raw, VectorEncoder) and not hasattr(raw, "running_mean")  # really had nothing to reduce


# Large mean, tiny spread: E[x^2] - mean^2 in float32 cancels to nothing here (the ulp of 1e6 is 0.06, the variance
# 1e-4). Each rank's data are symmetric about a float32-exact centre, so the rank means the float32 buffers hold are
# exact and the only error left to see is the reduction's own.
OFFSET_CENTRES = ((1000.0, 100.0), (1000.0 + 2.0 ** -7, 100.0 + 2.0 ** -9))  # per rank, per feature
OFFSET_STDS = (1e-2, 1.5e-2)  # per rank


def _offset_obs(rank: int) -> np.ndarray:
    z = np.random.default_rng(rank).standard_normal((100 + 50 * rank, 2))
    return (np.array(OFFSET_CENTRES[rank]) + OFFSET_STDS[rank] * np.concatenate([z, -z])).astype(np.float32)


def _offset_worker(rank: int) -> dict:
    enc = VectorEncoder(ModalityInput("x", "vector", (2,), "float32", normalize=True), features=0)
    x = _offset_obs(rank).astype(np.float64)
    with torch.no_grad():  # this rank's exact statistics, as float32 buffers
        enc.running_mean.copy_(torch.from_numpy(x.mean(0)))
        enc.running_var.copy_(torch.from_numpy(x.var(0)))
        enc.running_count.fill_(len(x))
    distributed.RunningStatsAllReduce(WORLD)(enc)
    return {b: getattr(enc, b).clone() for b in ("running_mean", "running_var", "running_count")}


def test_running_stats_all_reduce_keeps_a_tiny_variance_at_a_large_mean(tmp_path):
    per_rank = [_offset_obs(r).astype(np.float64) for r in range(WORLD)]
    for x in per_rank:
        assert np.array_equal(x.mean(0).astype(np.float32), x.mean(0))  # the premise: float32 holds the means
    pooled = np.concatenate(per_rank)
    for res in run_ranks(_offset_worker, tmp_path):
        assert res["running_var"].dtype == torch.float32 and res["running_var"].shape == (2,)
        np.testing.assert_allclose(res["running_var"].double().sqrt().numpy(), pooled.std(0), rtol=1e-6)
        np.testing.assert_allclose(res["running_mean"].double().numpy(), pooled.mean(0), rtol=1e-7)
        assert float(res["running_count"]) == len(pooled) / WORLD


def _kl_worker(rank: int) -> dict:
    """Two learners on different batches under ppo.target_kl: alone, the ranks' KLs pass the target at different
    epochs (4 and 5 here); with the KL averaged over the ranks they stop together."""
    from learner.learner import Learner, LearnerSettings
    from learner.ppo import LossCoefs
    from pipeline import fragment as F

    from tests.conftest import vector_spec

    torch.manual_seed(0)
    model = ActorCritic(vector_spec((4,), "discrete", 2, hidden_sizes=(8, 8)))
    g = torch.Generator().manual_seed(rank)
    obs = torch.randn(32, 4, generator=g)
    actions = torch.randint(0, 2, (32,), generator=g)
    with torch.no_grad():
        logp, _, values = model.evaluate({"vector": obs}, actions)
    adv = torch.randn(32, generator=g) * (1.0 if rank == 0 else 30.0)
    batch = {F.obs_key("vector"): obs, F.ACTIONS: actions, F.LOGP: logp, F.VALUES: values, F.ADVANTAGES: adv,
             F.RETURNS: adv + values}
    out = {}
    for synced in (False, True):
        learner = Learner(copy_model(model), LearnerSettings(lr=1e-2, adam_eps=1e-5, anneal_lr=False, total_updates=1,
                                                             update_epochs=8, minibatch_size=8, max_grad_norm=1e9,
                                                             coefs=LossCoefs(norm_adv=False), target_kl=0.02),
                          torch.device("cpu"), kl_sync=distributed.MeanAllReduce(WORLD) if synced else None)
        out["synced" if synced else "alone"] = learner.update(batch)["update_epochs_run"]
    return out


def copy_model(model):
    import copy

    return copy.deepcopy(model)


def test_target_kl_stops_every_learner_at_the_same_epoch(tmp_path):
    results = run_ranks(_kl_worker, tmp_path)
    alone = [r["alone"] for r in results]
    assert alone[0] != alone[1], alone  # the premise: on their own they would part ways
    synced = [r["synced"] for r in results]
    assert synced[0] == synced[1], synced
