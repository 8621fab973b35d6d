"""What the long-lived processes keep stays bounded however many iterations a run has.

Each test drives a plain class (no Ray) through many more updates than any of its bounds and checks the containers
that used to grow with them: the supply board's ledger (finished tickets, the lease queue), the board around it, and
a learner's claim inbox (one entry per supply board replacement).
"""

from __future__ import annotations

import asyncio

from pipeline import supply as supply_mod
from pipeline.feed import BOARDS_KEPT, ClaimInbox
from pipeline.protocol import Claim, Poll, Publish, Stored
from pipeline.runtime import plain_class
from pipeline.supply import DONE_KEPT_S, DONE_MIN_KEPT, SupplyBoard, TicketLedger


class Clock:
    """A ledger's clock that the test moves on."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def one_update(led: TicketLedger, version: int, per_update: int) -> list:
    """Update ``version``'s batch made, stored, claimed and trained; the next version published."""
    tickets = led.request_block(0, 0, version, per_update, active_actors=1)
    assert [t.update for t in tickets] == [version] * per_update
    assert all(led.stored(t, shard=0) for t in tickets)
    assert sum(len(ts) for ts in led.claim(0, version, per_update).values()) == per_update
    led.publish(version + 1)
    return tickets


def test_the_ledger_forgets_finished_tickets_once_no_confirmation_sent_again_can_name_them():
    """20,000 updates of one fragment at 20 updates a second (the default job's shape): the finished tickets it
    remembers are those of the last DONE_KEPT_S, never fewer than the newest DONE_MIN_KEPT, not every one of them."""
    clock = Clock()
    led = TicketLedger(per_update=1, max_policy_lag=1, clock=clock)
    led.publish(0)
    most = 0
    for version in range(20_000):
        clock.t += 0.05
        last = one_update(led, version, 1)
        most = max(most, len(led._done))
    assert most <= DONE_MIN_KEPT, most
    # What the entries are kept for still holds: the newest finished ticket confirmed again is the same copy, not a
    # late one; one older than the window and past the newest DONE_MIN_KEPT is forgotten (a late copy, refused).
    assert led.stored(last[0], shard=0) is False and led.stats.confirmed_again == 1 and led.stats.rejected == 0
    assert 20 * DONE_KEPT_S < DONE_MIN_KEPT < 20_000  # the floor, not the window, binds at this rate


def test_the_lease_queue_holds_the_leases_still_out_not_a_whole_lease_of_finished_ones():
    """A fixed lease of an hour and 5,000 updates of 4 fragments, each stored within a second: the board looks for
    expired leases on every call, and the queue it looks at keeps only what is still out."""
    clock = Clock()
    led = TicketLedger(per_update=4, max_policy_lag=1, clock=clock, lease_s=3600.0)
    led.publish(0)
    most = 0
    for version in range(5_000):
        clock.t += 0.5
        one_update(led, version, 4)
        assert led.expire_leases() == 0
        most = max(most, len(led._leases))
    assert most <= led.bound(), most


def test_the_supply_board_keeps_what_is_in_flight_not_what_a_run_made(monkeypatch):
    """The board's own class (plain, on an event loop, no Ray) through 6,000 updates of one fragment from one
    rollout actor: its tables of updates, waiters, recent stores, leases and finished tickets all stay small."""
    monkeypatch.setattr(supply_mod, "LEASE_CHECK_S", 0.01)  # its housekeeping clock, in the test's time

    async def drive():
        board = plain_class(SupplyBoard)(per_update=1, max_policy_lag=1, num_shards=1)
        clock = Clock()
        board.supply.ledger.clock = board._stored_recent.clock = clock
        await board.publish(Publish(0, [None]))
        sizes = []
        for version in range(6_000):
            clock.t += 0.05
            tickets, news, _ = await board.poll(Poll(0, 0, version - 1, 0, 0, [], max_tickets=1,
                                                     report={"episodes": [1.0]}))
            assert news[0] == version and [t.update for t in tickets] == [version]
            assert await board.stored(Stored(tickets, 0)) == [True]
            got = await board.claim(Claim(0, version, 1, 0.0, []))
            assert [t.id for _, ts in got.values() for t in ts] == [tickets[0].id]
            await board.publish(Publish(version + 1, [None]))
            if version % 200 == 0:
                await board.actor_reports()  # the driver drains them every iteration
                await asyncio.sleep(0.02)  # the board's housekeeping runs between calls
                led = board.supply.ledger
                sizes.append({"done": len(led._done), "leases": len(led._leases), "entries": len(led._entries),
                              "claim_waiters": len(board._claim_waiters), "hurried": len(board._hurried),
                              "stored_recent": len(board._stored_recent._log), "active": len(board._active),
                              "by_actor": sum(len(ids) for ids in led._by_actor.values())})
        board._lease_watch.cancel()
        return sizes

    sizes = asyncio.run(drive())
    most = {key: max(s[key] for s in sizes) for key in sizes[0]}
    assert most["done"] <= DONE_MIN_KEPT, most
    assert most["leases"] <= 2 and most["entries"] <= 2 and most["by_actor"] <= 2, most
    assert most["claim_waiters"] <= 50 and most["hurried"] <= 50 and most["stored_recent"] <= 50, most
    assert most["active"] == 1, most


def test_a_learners_claim_inbox_remembers_the_newest_boards_only():
    """Rank 0 says from which update it leads on every new supply board: 1,000 board replacements leave the newest
    BOARDS_KEPT in a rank's inbox, each still readable."""
    inbox = ClaimInbox()
    for board in range(1_000):
        inbox.put(f"board-{board}", 10 * board, None)
        assert inbox.lead_from(f"board-{board}") == 10 * board
        assert board < 1 or inbox.lead_from(f"board-{board - 1}") == 10 * (board - 1)
    assert len(inbox._lead_from) == BOARDS_KEPT
    assert inbox.lead_from("board-0") is None


def test_small_policy_weights_reach_the_actors_by_value_and_large_ones_as_one_object(tmp_path):
    """Each Ray object a process hands to another stays ~450 B in its owner for the owner's life, so publishing
    one per weights version grew learner rank 0 without bound. CartPole's policy (37 KB) goes by value; a policy
    over ``WEIGHTS_BY_VALUE_MAX_BYTES`` still goes as one object a version (a node reads it through its store:
    tests/test_multinode.py checks that on Ray). In process, where an object is a ``LocalRef``, so the rule is
    checked without starting Ray; either way the rollout actor loads the published version."""
    import time

    import numpy as np

    from cluster import config as config_mod
    from cluster.driver import Trainer
    from learner.actor import WEIGHTS_BY_VALUE_MAX_BYTES
    from pipeline import runtime
    from tests.conftest import ROOT

    for hidden, by_value in (("[64,64]", True), ("[128,128]", False)):
        cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
            "ray.address=inprocess", f"learner.hidden_sizes={hidden}", "rollout.envs_per_actor=4",
            "run.require_target=false", "run.target_return=null", "run.checkpoint_interval_s=null"])
        trainer = Trainer(cfg, tmp_path / f"run{hidden}", quiet=True)
        try:
            trainer.build()  # learner rank 0 publishes version 0 at set-up
            version, (head, *_) = runtime.get(trainer.graph.board.latest.remote(-1), timeout=30)
            # An object: a LocalRef, or a Ray ref when this process has Ray up (runtime.put uses it then).
            assert isinstance(head, dict) is by_value and runtime._is_ref(head) is not by_value, (hidden, type(head))
            weights = runtime.resolve(head, timeout=30)
            assert (sum(a.nbytes for a in weights.values()) <= WEIGHTS_BY_VALUE_MAX_BYTES) is by_value
            assert all(isinstance(a, np.ndarray) for a in weights.values())
            deadline = time.monotonic() + 30
            while runtime.get(trainer.rollouts[0].stats.remote(), timeout=30)["policy_version"] < version:
                assert time.monotonic() < deadline, "the rollout actor loaded no published weights within 30 s"
                time.sleep(0.1)
        finally:
            trainer.shutdown()
