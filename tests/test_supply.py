"""The data plane's routing and rate limit (pipeline/supply.py): the ledger without Ray, then the board's waits on
a real local Ray.

Unit tests pin the ledger's rules; a property-based test drives the scale model (tests/supply_model.py: the real
ledger and shard stores, simulated actors, learners, network and failures) over arbitrary layouts; one simulated
layout runs at 1,000 actors, 256 shards and 64 learners.
"""

import collections

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.protocol import (CLAIMED, ISSUED, PENDING, RELAY_CALLS_PER_S, SCALE_MECHANISMS, STORED, Claim, Poll,
                               Publish, Stored)
from pipeline.supply import Supply, TicketLedger, describe_line
from tests.supply_model import MS_PER_BOARD_CALL, SWITCHED_OFF, Faults, Layout, run


# ---------------------------------------------------------------------------- ledger rules
def test_tickets_exist_for_published_version_plus_lag_and_go_lowest_update_first():
    led = TicketLedger(per_update=2, max_policy_lag=1)
    led.publish(0)
    got = [led.request(0, 0, version=0) for _ in range(5)]
    assert [t.update for t in got[:4]] == [0, 0, 1, 1] and got[4] is None  # (lag + 1) x per_update, no more
    assert all(t.min_version == t.update - 1 for t in got[:4])
    assert led.in_flight() == 4 == led.bound()


def test_lag_zero_issues_only_the_current_update_and_only_to_current_policies():
    led = TicketLedger(per_update=3, max_policy_lag=0)
    led.publish(5)
    assert led.request(0, 0, version=4) is None  # an actor on policy 4 may not make update 5's data
    assert [led.request(0, 0, version=5).update for _ in range(3)] == [5, 5, 5]
    assert led.request(1, 0, version=5) is None


def test_an_update_is_claimed_exactly_once_and_split_between_learners():
    led = TicketLedger(per_update=4, max_policy_lag=0)
    led.publish(0)
    tickets = [led.request(a, 0, 0) for a in range(4)]
    for i, t in enumerate(tickets):
        assert led.stored(t, shard=i % 2)
    first = led.claim(rank=0, update=0, max_items=2)
    second = led.claim(rank=1, update=0, max_items=5)
    ids0 = {t.id for ts in first.values() for t in ts}
    ids1 = {t.id for ts in second.values() for t in ts}
    assert len(ids0) == 2 and len(ids1) == 2 and not ids0 & ids1
    assert led.claim(rank=1, update=0, max_items=5) == {}


def test_a_block_of_tickets_is_at_most_a_fair_share():
    led = TicketLedger(per_update=8, max_policy_lag=1)
    led.publish(0)  # 16 free: updates 0 and 1
    assert led.free_for(0) == 16
    first = led.request_block(0, 0, version=0, max_n=16, active_actors=4)
    assert [t.update for t in first] == [0, 0, 0, 0]  # ceil(16 / 4), lowest update first
    assert len(led.request_block(1, 0, version=0, max_n=2, active_actors=4)) == 2  # never more than asked
    # An actor's share is of what is left (10): an update's last tickets go to several actors.
    assert len(led.request_block(4, 0, version=0, max_n=16, active_actors=4)) == 3
    assert led.free_for(0) == 7
    assert len(led.request_block(2, 0, version=0, max_n=16, active_actors=1)) == 7  # alone: all that is free
    assert led.request_block(3, 0, version=0, max_n=16, active_actors=4) == []
    # A node relay (which shares its tickets among its actors again) asking for a quarter of the actors gets a
    # quarter of the open update each call: 4 calls drain it (a quarter of what is left would take ~10 calls).
    relay = TicketLedger(per_update=100, max_policy_lag=0)
    relay.publish(0)
    blocks = [len(relay.request_block(9, 0, version=0, max_n=1000, active_actors=1000, weight=250)) for _ in range(5)]
    assert blocks == [25, 25, 25, 25, 0], blocks
    lag0 = TicketLedger(per_update=3, max_policy_lag=0)
    lag0.publish(5)
    assert lag0.free_for(4) == 0 and lag0.request_block(0, 0, version=4, max_n=8, active_actors=1) == []
    assert len(lag0.request_block(0, 0, version=5, max_n=8, active_actors=100)) == 1  # a share is at least one


class FakeClock:
    """The ledger's injectable clock, moved by hand."""

    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_a_ticket_past_its_lease_goes_to_another_actor_and_the_late_copy_is_refused():
    clock = FakeClock()
    led = TicketLedger(per_update=2, max_policy_lag=0, clock=clock, lease_s=5.0)
    led.publish(0)
    assert led.next_expiry() is None  # no ticket out
    fast = led.request(1, 0, 0)
    clock.t += 1.0
    hung = led.request(0, 0, 0)
    assert led.next_expiry() == 100.0 + 5.0  # the oldest lease held: fast's
    assert led.stored(fast, shard=0)
    assert led.next_expiry() == 101.0 + 5.0  # fast's is gone with its store: the hung one's is next
    clock.t += 4.9
    assert led.expire_leases() == 0  # within its lease
    clock.t += 0.2
    assert led.expire_leases() == 1 and led.stats.lease_expired == 1  # only the unstored one; the stored one stays
    assert led.expire_leases() == 0  # once
    again = led.request(1, 0, 0)
    assert again.id == hung.id and again.actor_id == 1 and again.issue != hung.issue
    assert not led.stored(hung, shard=1)  # the hung actor's late fragment is thrown away
    assert led.stored(again, shard=0)
    assert led.next_expiry() is None  # the stale lease of the refunded issue is no lease
    assert led.describe(0)[STORED]["count"] == 2 and led.request(2, 0, 0) is None  # exactly the batch, once
    assert led.actor_gone(0, 0) == 0  # the lease already gave its ticket back: nothing is refunded twice
    clock.t += 100
    assert led.expire_leases() == 0  # stored tickets have no lease


def test_the_automatic_lease_follows_the_median_fragment_time_with_a_floor():
    from pipeline.protocol import LEASE_FLOOR_S, LEASE_MEDIANS

    clock = FakeClock()
    led = TicketLedger(per_update=64, max_policy_lag=0, clock=clock)
    led.publish(0)
    assert led.lease() == LEASE_FLOOR_S  # nothing measured yet
    for seconds in [1.0] * 9 + [50.0] * 4:  # most actors take 1 s, one slow actor 50 s
        t = led.request(0, 0, 0)
        clock.t += seconds
        led.stored(t, shard=0)
    assert led.lease() == LEASE_FLOOR_S  # 4 x the 1 s median is under the floor
    for _ in range(20):
        t = led.request(0, 0, 0)
        clock.t += 8.0
        led.stored(t, shard=0)
    assert led.lease() == LEASE_MEDIANS * 8.0
    # Copies refused after their lease ran out still lengthen it: a lease shorter than every fragment cannot last.
    slow = TicketLedger(per_update=64, max_policy_lag=0, clock=clock, lease_s=None)
    slow.publish(0)
    t = slow.request(0, 0, 0)
    clock.t += 30.0
    assert slow.expire_leases() == 1  # 30 s is past the 10 s floor
    assert not slow.stored(t, shard=0)
    assert slow.lease() == LEASE_MEDIANS * 30.0
    t = slow.request(0, 0, 0)
    clock.t += 30.0
    assert slow.expire_leases() == 0 and slow.stored(t, shard=0)  # the next 30 s fragment keeps its ticket


def test_refunds_are_exact_and_a_late_copy_is_refused():
    led = TicketLedger(per_update=2, max_policy_lag=0)
    led.publish(0)
    a, b = led.request(0, 0, 0), led.request(1, 0, 0)
    assert led.actor_gone(0, 0) == 1  # actor 0 died holding ticket a
    assert led.actor_gone(0, 0) == 0  # noticing twice refunds nothing more
    assert not led.stored(a, shard=0)  # its add arrives after all: refused, the shard drops that copy
    again = led.request(2, 0, 0)
    assert again.id == a.id and again.actor_id == 2  # the refund is made once more, by someone else
    assert led.request(3, 0, 0) is None  # ... and only once
    assert led.stored(b, shard=1) and led.stored(again, shard=0)
    assert led.shard_lost(1) == 1 and led.shard_lost(1) == 0  # b was in shard 1
    assert led.add_failed(again) == 0  # stored already: shard_lost, not add_failed, would refund it
    assert led.stats.refunded == 2 and led.stats.rejected == 1


def test_a_confirmation_sent_again_is_the_same_one_while_stored_claimed_and_after_its_update_trained():
    """A shard whose relay carried a confirmation up and then went silent sends it itself RELAY_CONFIRM_S later:
    by then the fragment may be claimed, or its update trained. Each time it is the same confirmation (kept while
    its update is open, counted once, nothing refused or remade); a late copy of a refunded ticket still is
    refused, and so is the old issue of a ticket issued again."""
    led = TicketLedger(per_update=3, max_policy_lag=0)
    led.publish(0)
    a, b, c = (led.request(i, 0, 0) for i in range(3))
    assert all(led.stored(t, shard=0) for t in (a, b, c))
    assert led.stored(a, shard=0)  # again while stored
    claimed = led.claim(0, 0, 2)[0]
    again = claimed[0]
    assert led.stored(again, shard=0)  # again once claimed (a learner is about to take it: keep it)
    assert not led.stored(again, shard=1)  # ... but not from another shard: that is another copy
    led.claim(0, 0, 1)
    led.publish(1)  # update 0 trained
    assert led.stored(b, shard=0) is False  # again after its update is done: nothing to keep, nothing refused
    st = led.stats
    assert (st.fragments_stored, st.confirmed_again, st.refunded) == (3, 3, 0) and st.rejected == 1, st
    d = led.request(3, 0, 1)
    assert led.actor_gone(3, 0) == 1
    assert not led.stored(d, shard=0)  # a late copy of a refunded ticket: refused
    redone = led.request(4, 0, 1)
    assert redone.id == d.id and redone.issue != d.issue
    assert led.stored(redone, shard=0) and not led.stored(d, shard=0)  # the old issue's copy: refused
    assert led.stats.rejected == 3 and led.stats.confirmed_again == 3


def test_claimed_fragments_of_a_dead_shard_come_back_through_claim_failed_only():
    led = TicketLedger(per_update=1, max_policy_lag=0)
    led.publish(0)
    t = led.request(0, 0, 0)
    led.stored(t, shard=0)
    claim = led.claim(0, 0, 1)
    assert led.shard_lost(0) == 0  # claimed: the learner's take decides
    assert led.claim_failed(claim[0]) == 1 and led.claim_failed(claim[0]) == 0
    assert led.request(0, 0, 0).id == t.id


def test_learner_restart_voids_skipped_updates_and_refunds_what_the_old_group_claimed():
    led = TicketLedger(per_update=1, max_policy_lag=1)
    led.publish(0)
    t0, t1 = led.request(0, 0, 0), led.request(0, 0, 0)
    led.stored(t0, 0), led.stored(t1, 0)
    led.claim(0, 0, 1), led.claim(0, 1, 1)  # the old group had claimed both, then died
    orphans = led.learners_restarted(next_version=1)  # update 1's claim is refunded; update 0 is skipped
    assert sorted(t.id for t, _ in orphans) == [t0.id, t1.id] and led.stats.refunded == 1
    void = led.publish(1)
    assert void == [] and led.stats.voided == led.stats.voided_stored == 1  # update 0's: claimed, never trained
    assert led.request(0, 0, 1).id == t1.id


def test_describe_says_where_the_tickets_of_an_update_are():
    clock = iter(range(100)).__next__
    led = TicketLedger(per_update=3, max_policy_lag=0, clock=lambda: float(clock()))
    led.publish(0)
    a = led.request(4, 0, 0)
    led.request(7, 1, 0)
    led.stored(a, shard=2)
    d = led.describe(0)
    assert d[PENDING]["count"] == 1 and d[ISSUED]["holders"] == {7: 1} and d[STORED]["holders"] == {2: 1}
    assert d[CLAIMED]["count"] == 0
    line = describe_line(d)
    assert "1 not yet issued" in line and "issued to rollout actor 7" in line and "stored in shard 2" in line


def test_supply_points_a_replaced_shard_out_and_refunds_its_fragments():
    sup = Supply(per_update=2, max_policy_lag=0, num_shards=2)
    assert sup.register_shard(0, "s0") == 0 and sup.register_shard(1, "s1") == 0
    sup.publish(0, ["w"])
    t = sup.ledger.request(0, 0, 0)
    sup.ledger.stored(t, 1)
    assert sup.shard_for(1, known_incarnation=0) is None
    assert sup.register_shard(1, "s1-new") == 1
    assert sup.shard_for(1, known_incarnation=0) == (1, "s1-new")


def test_a_replaced_learner_groups_late_claims_and_publishes_are_ignored():
    """ray.kill is asynchronous: a killed rank's feed may still claim, and its rank 0 publish, for a moment."""
    sup = Supply(per_update=2, max_policy_lag=0, num_shards=1)
    sup.register_shard(0, "s0")
    sup.publish(0, ["w0"])
    t = sup.ledger.request(0, 0, 0)
    sup.ledger.stored(t, 0)
    generation, orphans = sup.learners_restarted(next_version=1)
    assert generation == 1 and orphans == []
    assert sup.publish(1, ["old group"], generation=0) is None and sup.version == 0
    assert sup.publish(1, ["new group"], generation=1) == {0: [t]}  # update 0 skipped: its stored copy is void
    t1 = sup.ledger.request(0, 0, 1)
    sup.ledger.stored(t1, 0)
    assert sup.claim(0, 1, 2, [], generation=0) is None  # the old group's feed takes nothing ...
    assert sup.claim(0, 1, 2, [t1], generation=0) is None and sup.ledger.stats.refunded == 0  # ... refunds nothing
    assert sup.claim(0, 1, 2, [], generation=1) == {0: [t1]}


# ---------------------------------------------------------------------------- scale model
@st.composite
def layouts(draw):
    actors = draw(st.integers(1, 64))
    return Layout(actors=actors, shards=draw(st.integers(1, actors)), learners=draw(st.integers(1, 16)),
                  fragments_per_learner=draw(st.integers(1, 5)), lag=draw(st.integers(0, 2)),
                  prefetch=draw(st.integers(1, 2)), block=draw(st.integers(1, 16)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts(), seed=st.integers(0, 2**31))
def test_every_layout_trains_every_update_on_exactly_its_batch_with_nothing_stale(layout, seed):
    rep = run(layout, updates=6, seed=seed)
    assert set(rep.per_learner_per_update.values()) == {layout.fragments_per_learner}
    assert len(rep.per_learner_per_update) == 6 * layout.learners
    assert rep.stale == 0 and rep.refunded == 0 and rep.rejected == 0
    # Production follows consumption: what was made beyond what trained is at most the in-flight bound.
    assert rep.trained <= rep.produced <= rep.trained + (layout.lag + 1) * layout.learners * layout.fragments_per_learner


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts(), seed=st.integers(0, 2**31),
       faults=st.builds(Faults, actor_deaths=st.integers(0, 4), shard_deaths=st.integers(0, 3),
                        actors_added=st.integers(0, 3), actors_removed=st.integers(0, 3)))
def test_deaths_and_rescaling_lose_nothing_and_make_nothing_twice(layout, seed, faults):
    planned = faults.actor_deaths + faults.shard_deaths + faults.actors_removed  # a removed actor leaves its ticket
    rep = run(layout, faults=faults, updates=8, seed=seed)
    assert set(rep.per_learner_per_update.values()) == {layout.fragments_per_learner}
    assert rep.stale == 0  # refunds keep the update a lost fragment was for: never stale
    # Every refund answers one lost fragment, and a refused copy is a refund that arrived late.
    assert rep.rejected <= rep.refunded
    bound = (layout.lag + 1) * layout.learners * layout.fragments_per_learner
    assert rep.produced <= rep.trained + bound + rep.refunded
    if planned == 0:
        assert rep.refunded == 0


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts(), seed=st.integers(0, 2**31), restarts=st.integers(1, 2))
def test_learner_group_restarts_waste_at_most_the_in_flight_bound_each(layout, seed, restarts):
    rep = run(layout, faults=Faults(learner_restarts=restarts), updates=8, seed=seed)
    assert set(rep.per_learner_per_update.values()) == {layout.fragments_per_learner}
    bound = (layout.lag + 1) * layout.learners * layout.fragments_per_learner
    assert rep.stale <= restarts * bound


def test_steady_state_stale_fraction_with_failures_is_within_one_percent():
    rep = run(Layout(actors=12, shards=5, learners=3, fragments_per_learner=3, lag=1),
              faults=Faults(actor_deaths=5, shard_deaths=3, actors_added=2, actors_removed=2), updates=200, seed=3)
    assert rep.stale_fraction <= 0.01 and rep.refunded > 0


def test_thousand_actors_256_shards_64_learners(capsys):
    layout = Layout(actors=1000, shards=256, learners=64, fragments_per_learner=2, lag=1, block=16)
    rep = run(layout, faults=Faults(actor_deaths=20, shard_deaths=4, actors_added=10, actors_removed=10),
              updates=12, seed=1)
    per_update = collections.defaultdict(list)
    for (rank, update), n in rep.per_learner_per_update.items():
        per_update[update].append(n)
    with capsys.disabled():
        print(f"\n1,000 actors x 256 shards x 64 learners, lag 1, 2 fragments per learner per update, blocks of 16, "
              f"{rep.events:,} events:")
        for u in sorted(per_update):
            ns = per_update[u]
            print(f"  update {u:2d}: {len(ns)} learners, fragments per learner min {min(ns)} max {max(ns)}")
        print(f"  produced {rep.produced}, trained {rep.trained}, stale {rep.stale} "
              f"({100 * rep.stale_fraction:.2f} %), refunded {rep.refunded}, refused late copies {rep.rejected}")
    assert all(ns == [2] * 64 for ns in per_update.values()) and len(per_update) == 12
    assert rep.stale_fraction <= 0.01


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts(), seed=st.integers(0, 2**31), per_add=st.integers(1, 8),
       faults=st.builds(Faults, actor_hangs=st.integers(1, 3), slow_actors=st.integers(0, 3),
                        actor_deaths=st.integers(0, 2), shard_deaths=st.integers(0, 2)))
def test_hung_and_slow_actors_and_multi_fragment_adds_keep_every_batch_exact(layout, seed, per_add, faults):
    """Hung actors keep their tickets until the leases give them to the others (or the driver's deadline kills
    them); one that wakes delivers late copies, which are refused; adds carry up to ``per_add`` fragments under one
    confirmation. Every update still gets exactly its batch, once, with nothing stale."""
    layout.fragments_per_add = per_add
    rep = run(layout, faults=faults, updates=8, seed=seed)
    assert set(rep.per_learner_per_update.values()) == {layout.fragments_per_learner}
    assert len(rep.per_learner_per_update) == 8 * layout.learners
    assert rep.stale == 0 and rep.rejected <= rep.refunded and rep.lease_expired <= rep.refunded
    assert rep.max_open_calls <= rep.concurrency
    # One confirmation per add: stored calls never exceed the adds, which carry at least one fragment each.
    assert rep.board_calls["stored"] <= rep.produced + rep.rejected


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts(), seed=st.integers(0, 2**31), relays=st.integers(1, 4), parts=st.integers(0, 4),
       group=st.booleans(), rate=st.sampled_from([0.0, 20.0, 2000.0]), budget=st.sampled_from([1.0, 100.0]),
       faults=st.builds(Faults, actor_deaths=st.integers(0, 3), shard_deaths=st.integers(0, 3),
                        actor_hangs=st.integers(0, 2), learner_restarts=st.integers(0, 1)))
def test_relays_coalesced_stored_and_claims_in_parts_keep_every_batch_exact(layout, seed, relays, parts, group,
                                                                            rate, budget, faults):
    """The control plane's batching together: a node's idle actors get their blocks in one relay call,
    a shard confirms every add that reached it since its last ``stored`` in one call, a claim waits for its
    whole remaining batch or a part of it, and (``group``) rank 0 claims for the whole learner group, each rank
    claiming the replacements of its own failed takes; with a clock (``rate``), each on its clock, the relays'
    calls within the board's budget (1 a second: each relay 1 s apart, the cap; or 100). Every update still gets
    exactly its batch, once, with nothing stale beyond restarts."""
    layout.relays, layout.coalesce_stored, layout.claim_parts, layout.group_claims = relays, True, parts, group
    layout.rate, layout.relay_calls_per_s = rate, budget
    restarts = faults.learner_restarts  # (the run counts its faults down)
    rep = run(layout, faults=faults, updates=6, seed=seed)
    assert set(rep.per_learner_per_update.values()) == {layout.fragments_per_learner}
    assert rep.max_open_calls <= rep.concurrency
    if not restarts:  # a restart voids what was made for the updates it skips
        assert rep.stale == 0 and rep.rejected <= rep.refunded
        assert len(rep.per_learner_per_update) == 6 * layout.learners
    assert rep.board_calls.get("poll", 0) == 0  # every block came through a relay


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts(), seed=st.integers(0, 2**31), group=st.booleans(),
       faults=st.builds(Faults, relay_resends=st.integers(1, 4), actor_deaths=st.integers(0, 2),
                        shard_deaths=st.integers(0, 2)))
def test_a_confirmation_a_relay_carried_up_and_the_shard_sent_again_counts_once(layout, seed, group, faults):
    """Shards confirming through their node's relay: when the relay carries a confirmation up and then fails to
    answer, the shard confirms with the board itself, which takes it as the same confirmation: the copy is kept,
    nothing is refused, counted twice or made again, and every update gets exactly its batch, once."""
    layout.coalesce_stored, layout.group_claims = True, group
    deaths = faults.actor_deaths + faults.shard_deaths  # (the run counts its faults down)
    rep = run(layout, faults=faults, updates=6, seed=seed)
    assert set(rep.per_learner_per_update.values()) == {layout.fragments_per_learner}
    assert len(rep.per_learner_per_update) == 6 * layout.learners
    assert rep.stale == 0
    # Stored once each: what was made beyond what trained is at most the in-flight bound, plus the deaths' remakes.
    bound = (layout.lag + 1) * layout.learners * layout.fragments_per_learner
    assert rep.produced <= rep.trained + bound + rep.refunded
    if not deaths:
        assert rep.refunded == 0 and rep.rejected == 0, rep


def test_the_model_has_a_switch_for_every_mechanism_that_exists_for_scale_only():
    assert set(SWITCHED_OFF) == set(SCALE_MECHANISMS)


@pytest.mark.parametrize("off", [None, *SCALE_MECHANISMS])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts(), seed=st.integers(0, 2**31), relays=st.integers(1, 4), per_add=st.integers(1, 8),
       rate=st.sampled_from([20.0, 2000.0]), budget=st.sampled_from([1.0, 100.0]),
       faults=st.builds(Faults, actor_deaths=st.integers(0, 2), shard_deaths=st.integers(0, 2),
                        actor_hangs=st.integers(0, 1), learner_restarts=st.integers(0, 1)))
def test_the_ledger_keeps_every_batch_exact_with_each_scale_mechanism_off(off, layout, seed, relays, per_add, rate,
                                                                         budget, faults):
    """The whole protocol on its clocks (blocks, multi-fragment adds, paced and hurried confirmations, relays
    within the board's call budget, group claims in parts), then the same with each mechanism that exists for scale
    only switched off (``off``; pipeline.protocol.SCALE_MECHANISMS, docs/protocol.md): none of them is what keeps a
    batch exact, so every update still gets exactly its batch, once, with nothing stale beyond restarts."""
    layout.relays, layout.coalesce_stored, layout.claim_parts, layout.group_claims = relays, True, 4, True
    layout.fragments_per_add, layout.rate, layout.relay_calls_per_s = per_add, rate, budget
    if off is not None:
        layout = SWITCHED_OFF[off](layout)
    restarts = faults.learner_restarts  # (the run counts its faults down)
    rep = run(layout, faults=faults, updates=5, seed=seed)
    assert set(rep.per_learner_per_update.values()) == {layout.fragments_per_learner}
    assert rep.max_open_calls <= rep.concurrency
    if not restarts:
        assert rep.stale == 0 and rep.rejected <= rep.refunded
        assert len(rep.per_learner_per_update) == 5 * layout.learners
    bound = (layout.lag + 1) * layout.learners * layout.fragments_per_learner
    assert rep.produced <= rep.trained + (restarts + 1) * bound + rep.refunded
    assert (rep.board_calls.get("poll", 0) == 0) == (layout.relays > 0)  # with relays every block came through one


def test_one_hung_actor_of_two_loses_its_tickets_to_the_other_at_lag_0():
    """The case the fault tests run on Ray (one env stuck in step, 2 actors): at lag 0 every ticket of an update is
    needed, so the run moves on only because the hung actor's leases expire and the other makes them."""
    layout = Layout(actors=2, shards=1, learners=1, fragments_per_learner=4, lag=0, block=2)
    hung_runs = [run(layout, faults=Faults(actor_hangs=1), updates=30, seed=seed) for seed in range(20)]
    for rep in hung_runs:
        assert set(rep.per_learner_per_update.values()) == {4} and rep.stale == 0
    # Over the seeds: the hang caught tickets (leases expired), a woken actor's copies were refused or the driver's
    # deadline killed it; never a deadlock (run() raises on one).
    assert sum(r.lease_expired for r in hung_runs) > 0
    assert sum(r.rejected for r in hung_runs) > 0 or sum(r.hung_killed for r in hung_runs) > 0


def test_a_slow_actor_makes_less_and_holds_no_update_back():
    """One actor of four ten times slower: its leases expire where its fragments take too long, the others make
    the rest, and it makes less than its even share."""
    layout = Layout(actors=4, shards=2, learners=2, fragments_per_learner=2, lag=1, block=4)
    reps = [run(layout, faults=Faults(slow_actors=1), updates=40, seed=seed) for seed in range(5)]
    for rep in reps:
        assert set(rep.per_learner_per_update.values()) == {2} and rep.stale == 0
    made_by_slow = sum(r.made_by_slow for r in reps)
    made = sum(r.produced + r.rejected for r in reps)
    assert made_by_slow < 0.25 * made, (made_by_slow, made)  # under its even share of a quarter


def test_board_calls_per_fragment_with_blocks_and_multi_fragment_adds_and_where_they_stop_helping(capsys):
    """The model's board calls per fragment, by kind, at the shipped protocol (blocks of up to 16 tickets, adds of
    up to 8) against one ticket and one fragment per call; times a call's measured cost this is the board's CPU
    per fragment. Parked polls that time out and ask again are not modelled (the bench counts them): these are the
    calls that move fragments. With more tickets in flight than actors (64 actors, 256 tickets) blocks and batched
    adds cut the calls; with 1,000 actors sharing 256 tickets the fair share is one ticket a poll, so every fragment
    still costs a poll and a stored: there a board per node (a hierarchy) is what would help."""
    out = {}
    for actors in (64, 1000):
        for block, per_add in ((1, 1), (16, 8)):
            layout = Layout(actors=actors, shards=min(actors, 256), learners=64, fragments_per_learner=2, lag=1,
                            block=block, fragments_per_add=per_add)
            out[(actors, block)] = run(layout, updates=6, seed=2)
    with capsys.disabled():
        for (actors, block), rep in out.items():
            calls = ", ".join(f"{k} {v / rep.produced:.3f}" for k, v in sorted(rep.board_calls.items()))
            print(f"\n{actors:,} actors x 64 learners, 256 tickets in flight, blocks of {block}: "
                  f"{rep.board_calls_per_fragment:.3f} board calls per fragment ({calls}); "
                  f"at most {rep.max_open_calls} calls open at once, board_concurrency {rep.concurrency}")
    # Polls and stored halve; the 64 learners' claims (one per learner and update at best) stay.
    assert out[(64, 16)].board_calls_per_fragment < 0.75 * out[(64, 1)].board_calls_per_fragment
    assert out[(1000, 16)].board_calls_per_fragment > 2.0  # one ticket a poll: no saving to be had
    assert all(r.max_open_calls <= r.concurrency for r in out.values())
    # A relay per node (16 nodes of ~63 actors): one board call gives all of a node's idle actors their blocks.
    relayed = run(Layout(actors=1000, shards=256, learners=64, fragments_per_learner=2, lag=1, block=16,
                         fragments_per_add=8, relays=16, coalesce_stored=True, claim_parts=4), updates=6, seed=2)
    with capsys.disabled():
        calls = ", ".join(f"{k} {v / relayed.produced:.3f}" for k, v in sorted(relayed.board_calls.items()))
        print(f"\n1,000 actors x 64 learners, 16 relays, coalesced stored, claims in quarters: "
              f"{relayed.board_calls_per_fragment:.3f} board calls per fragment ({calls}); x "
              f"{MS_PER_BOARD_CALL} ms a call = {relayed.board_cpu_ms_per_fragment():.3f} ms of board CPU per fragment")
    assert relayed.board_calls.get("relay_poll", 0) < 0.25 * out[(1000, 16)].board_calls["poll"]
    # The learner group claiming as one: rank 0's one claim an update (or a few parts) instead of 64.
    grouped = run(Layout(actors=1000, shards=256, learners=64, fragments_per_learner=2, lag=1, block=16,
                         fragments_per_add=8, relays=16, coalesce_stored=True, claim_parts=4, group_claims=True),
                  updates=6, seed=2)
    with capsys.disabled():
        calls = ", ".join(f"{k} {v / grouped.produced:.3f}" for k, v in sorted(grouped.board_calls.items()))
        print(f"1,000 actors x 64 learners, as above, the group claiming as one: "
              f"{grouped.board_calls_per_fragment:.3f} board calls per fragment ({calls}); x {MS_PER_BOARD_CALL} ms "
              f"a call = {grouped.board_cpu_ms_per_fragment():.3f} ms of board CPU per fragment")
    assert grouped.board_calls["claim"] < relayed.board_calls["claim"] / 4, (grouped.board_calls, relayed.board_calls)


def _at_rate(relays: int, budget: float = RELAY_CALLS_PER_S, rate: float = 5000.0):
    """The clocked model at ``rate`` fragments a second: 1,000 actors x 64 learners, 2,048-fragment updates (as
    bench/control_plane.py's cell), 256 shards, ``relays`` nodes, the shipped protocol."""
    layout = Layout(actors=1000, shards=256, learners=64, fragments_per_learner=32, lag=1, block=16,
                    fragments_per_add=8, relays=relays, coalesce_stored=True, claim_parts=4, group_claims=True,
                    rate=rate, relay_calls_per_s=budget)
    return run(layout, updates=3, seed=2)


def _print_at_rate(label: str, rep) -> None:
    calls = ", ".join(f"{k} {v / rep.seconds:.0f}" for k, v in sorted(rep.board_calls.items()))
    print(f"\n{label}: {rep.produced / rep.seconds:,.0f} fragments/s made, board "
          f"{100 * rep.board_core_fraction():.1f}% of a core (calls a second: {calls})")


def test_the_board_at_5000_fragments_a_second_for_1000_actors_and_64_learners_in_the_clocked_model(capsys):
    """Issue 20's case with the model's clock: its calls follow the system's clocks (shards', relays', claims'),
    each costs MS_PER_BOARD_CALL and its tickets theirs. On 16 relay nodes the board keeps under a quarter of a
    core within the relays' call budget; without the budget each relay calls on its own clocks (the short one, at
    that rate every update is at its tail) and the board is past a quarter."""
    budgeted, unbounded = _at_rate(16), _at_rate(16, budget=float("inf"))
    with capsys.disabled():
        _print_at_rate(f"16 relays, {RELAY_CALLS_PER_S:.0f} calls/s budget", budgeted)
        _print_at_rate("16 relays, no budget", unbounded)
    assert budgeted.board_core_fraction() < 0.25 < unbounded.board_core_fraction()
    assert budgeted.produced / budgeted.seconds > 0.7 * 5000  # what the budget costs in rate (its relays' latency)


@pytest.mark.long
def test_the_clocked_model_board_and_rate_over_4_16_and_64_relay_nodes(capsys):
    """The same at 4, 16 and 64 nodes: within the budget the board stays under a quarter of a core however many
    nodes there are; what grows with the node count is the interval each relay is held to, and with it the wait
    of an update's last fragments (the rate falls at 64 nodes, lag 1)."""
    reps = {n: _at_rate(n) for n in (4, 16, 64)}
    with capsys.disabled():
        for n, rep in reps.items():
            _print_at_rate(f"{n} relays, {RELAY_CALLS_PER_S:.0f} calls/s budget", rep)
    assert all(rep.board_core_fraction() < 0.25 for rep in reps.values())


def test_after_a_learner_group_restart_no_actor_is_sent_the_dead_groups_weights():
    """Rank 0 of the dead group owned the weights object: reading it raises OwnerDiedError. Until the new group
    publishes, the board has no news, and actors keep the weights they have."""
    supply = Supply(per_update=2, max_policy_lag=1, num_shards=1)
    supply.publish(3, ["dead group's ref"], generation=0)
    assert supply.news(2) == (3, ["dead group's ref"])
    generation, _ = supply.learners_restarted(next_version=4)
    assert supply.news(2) is None and supply.news(-1) is None
    supply.publish(4, ["new group's ref"], generation=generation)
    assert supply.news(2) == (4, ["new group's ref"])


def test_after_a_learner_group_restart_only_the_new_groups_policy_fills_tickets():
    """The restored group starts from an older checkpoint than the dead group's newest weights: a fragment made
    with those weights would train with a policy lag of hundreds of updates under a small version difference."""
    led = TicketLedger(per_update=1, max_policy_lag=1)
    led.publish(5)  # tickets for updates 5 and 6
    old_issued = led.request(0, 0, version=5)  # update 5, being made with the dead group's policy 5
    old_stored = led.request(1, 0, version=5)  # update 6, already stored
    assert old_stored.update == 6 and led.stored(old_stored, shard=0)
    orphans = led.learners_restarted(next_version=6)
    assert (old_stored, 0) in orphans  # its shard drops the copy
    assert led.request(2, 0, version=5) is None  # the dead group's policy may fill nothing now
    led.publish(6)  # the new group's first weights
    assert not led.stored(old_issued, shard=0)  # update 5 is skipped: its late copy is refused
    fresh = led.request(2, 0, version=6)
    assert fresh.update == 6 and fresh.min_version == 6 and fresh.id == old_stored.id


# ---------------------------------------------------------------------------- the board's waits (real Ray)
def _board(ray_mod, per_update: int, lag: int, **options):
    from pipeline.supply import SupplyBoard

    return SupplyBoard.options(**options).remote(per_update, lag, 1)


def test_a_freed_ticket_wakes_about_one_parked_poll_not_all(ray_local):
    """Ten actors parked in a poll; one ticket comes into being: one poll is woken and takes it, nine stay parked
    (no wake-up of everyone); ten more tickets wake the nine."""
    import time

    board = _board(ray_local, per_update=1, lag=0)
    try:
        polls = [board.poll.remote(Poll(a, 0, 0, 0, 0, [], 20.0)) for a in range(10)]
        deadline = time.monotonic() + 20
        while ray_local.get(board.stats.remote())["parked_polls"] < 10:
            assert time.monotonic() < deadline, "the polls never parked"
            time.sleep(0.05)
        ray_local.get(board.publish.remote(Publish(0, [None])))  # update 0's single ticket
        ready, parked = ray_local.wait(polls, num_returns=1, timeout=10)
        assert len(ready) == 1 and len(ray_local.get(ready[0])[0]) == 1
        ready_more, _ = ray_local.wait(parked, num_returns=1, timeout=0.5)
        assert ready_more == []  # nobody else was woken for nothing
        st = ray_local.get(board.stats.remote())
        assert st["parked_polls"] == 9 and st["board_calls"]["poll_wakeups"] == 1, st
    finally:
        ray_local.kill(board)


def test_a_claim_waits_for_its_whole_batch_and_takes_it_in_one_call(ray_local):
    board = _board(ray_local, per_update=3, lag=0)
    try:
        ray_local.get(board.publish.remote(Publish(0, [None])))
        tickets, _, _ = ray_local.get(board.poll.remote(Poll(0, 0, 0, 0, 0, [], 0.0, max_tickets=3)))
        assert len(tickets) == 3
        claim = board.claim.remote(Claim(0, 0, 3, 20.0, [], 0, min_items=3))
        ray_local.get(board.stored.remote(Stored(tickets[:2], 0)))
        assert ray_local.wait([claim], timeout=0.5)[0] == []  # two of three stored: it keeps waiting
        ray_local.get(board.stored.remote(Stored(tickets[2:], 0)))
        got = ray_local.get(claim, timeout=10)
        assert sorted(t.id for _, ts in got.values() for t in ts) == sorted(t.id for t in tickets)
        # Its wait ending first, it takes what is there.
        ray_local.get(board.publish.remote(Publish(1, [None])))
        more, _, _ = ray_local.get(board.poll.remote(Poll(0, 0, 1, 0, 0, [], 0.0, max_tickets=3)))
        ray_local.get(board.stored.remote(Stored(more[:1], 0)))
        part = ray_local.get(board.claim.remote(Claim(0, 1, 3, 0.3, [], 0, min_items=3)), timeout=10)
        assert [t.id for _, ts in part.values() for t in ts] == [more[0].id]
    finally:
        ray_local.kill(board)


def test_the_boards_concurrency_leaves_room_for_progress_beside_a_thousand_parked_polls(ray_local):
    """Ray's default for an async actor is 1,000 concurrent calls: past that, a call that makes progress would queue
    behind parked polls. With board_concurrency (what the driver sets) it is answered at once."""
    import time

    from pipeline.supply import board_concurrency

    n = 1100
    board = _board(ray_local, per_update=1, lag=0, max_concurrency=board_concurrency(n, 1, 1))
    try:
        polls = [board.poll.remote(Poll(a, 0, 0, 0, 0, [], 30.0)) for a in range(n)]
        deadline = time.monotonic() + 20
        while ray_local.get(board.stats.remote(), timeout=30)["parked_polls"] < n:
            assert time.monotonic() < deadline, "the polls never all parked"
            time.sleep(0.1)
        t0 = time.monotonic()
        ray_local.get(board.publish.remote(Publish(0, [None])), timeout=10)
        assert ray_local.get(board.stats.remote(), timeout=10)["published"] == 0
        assert time.monotonic() - t0 < 10  # answered, not queued for the polls' 30 s
        assert len(ray_local.wait(polls, num_returns=1, timeout=10)[0]) == 1
    finally:
        ray_local.kill(board)



def test_unstored_counts_what_is_left_to_store_through_claims_and_refunds():
    """What decides an update's tail (the shards confirm it on their short clock): fragments not stored yet. A
    claimed one stays delivered; one lost with its shard is to be made again."""
    led = TicketLedger(4, 0)
    led.publish(0)
    ts = [led.request(0, 0, 0) for _ in range(4)]
    assert led.unstored(0) == 4
    assert led.stored(ts[0], 0) and led.stored(ts[1], 1)
    assert led.unstored(0) == 2
    assert sum(len(v) for v in led.claim(0, 0, 1).values()) == 1
    assert led.unstored(0) == 2
    assert led.shard_lost(1) + led.shard_lost(0) == 1  # the unclaimed one is made again
    assert led.unstored(0) == 3
    led.publish(1)
    assert led.unstored(1) == 4  # a new update: its whole batch


def test_a_publish_that_arrives_after_a_newer_one_is_superseded_not_an_error():
    """Ray does not keep an async actor's calls in the order their caller sent them, so learner rank 0's publish
    of version 6 can reach the board after its publish of 7: 7 superseded it, and the board keeps 7 (its weights,
    its tickets) and counts the late one instead of raising from the actor call."""
    import asyncio

    from pipeline.runtime import plain_class
    from pipeline.supply import SupplyBoard

    async def drive():
        board = plain_class(SupplyBoard)(per_update=1, max_policy_lag=1, num_shards=1)
        await board.publish(Publish(5, ["w5"]))
        await board.publish(Publish(7, ["w7"]))
        await board.publish(Publish(6, ["w6"]))  # late: superseded by 7
        news = await board.latest(-1)
        if board._lease_watch is not None:
            board._lease_watch.cancel()
        return news, board.supply.ledger.published, board.calls

    news, published, calls = asyncio.run(drive())
    assert news == (7, ["w7"]) and published == 7
    assert calls["publish_superseded"] == 1, calls
