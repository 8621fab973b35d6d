"""Replay shards and the device feed against a real local Ray."""

import time

import numpy as np
import pytest
import ray as _ray

from learner.device import resolve
from pipeline import fragment as F
from pipeline.feed import ClaimInbox, DeviceFeed, StallError, split_claims
from pipeline.fragment import FragmentMeta
from pipeline.protocol import ActorGone, Assignment, Claim, Part, Poll, Publish
from pipeline.replay import FragmentStore, ReplayShard
from pipeline.supply import SupplyBoard, Ticket

OBS = F.obs_key("vector")


def make_fragment(version: int, T: int = 4, N: int = 2, fill: float = 0.0, actor_id: int = 0) -> F.Fragment:
    arrays = {
        OBS: np.full((T, N, 3), fill, np.float32),
        F.ACTIONS: np.full((T, N), int(fill), np.int64),
        F.LOGP: np.full((T, N), fill, np.float32),
        F.VALUES: np.full((T, N), fill, np.float32),
        F.REWARDS: np.ones((T, N), np.float32),
        F.TERMINATED: np.zeros((T, N), bool),
        F.TRUNCATED: np.zeros((T, N), bool),
        F.ADVANTAGES: np.full((T, N), fill, np.float32),
        F.RETURNS: np.full((T, N), fill, np.float32),
    }
    return F.Fragment(arrays, policy_version=version, actor_id=actor_id)


def ticket(tid: int, update: int = 0, actor: int = 0, inc: int = 0, issue: int = 0) -> Ticket:
    return Ticket(tid, update, update, actor, inc, issue)


def test_store_is_bounded_keyed_by_ticket_and_hands_out_exactly_the_claimed_ones():
    store = FragmentStore(capacity=3)
    for i in range(3):
        store.add(ticket(i), FragmentMeta.of(make_fragment(0)), f"item{i}")
    assert not store.has_room()
    with pytest.raises(RuntimeError):
        store.add(ticket(3), FragmentMeta.of(make_fragment(0)), "overflow")
    got, missing = store.take([ticket(2), ticket(0), ticket(9)])
    assert [item for _, item in got] == ["item2", "item0"] and missing == [ticket(9)]
    # A refunded ticket's late copy and its remake (same id, another issuance) can sit side by side.
    store.add(ticket(5, issue=1), FragmentMeta.of(make_fragment(0)), "late")
    store.add(ticket(5, actor=1, issue=2), FragmentMeta.of(make_fragment(0)), "remake")
    store.reject(ticket(5, issue=1))
    got, _ = store.take([ticket(5, actor=1, issue=2)])
    assert [item for _, item in got] == ["remake"]
    assert store.drop([ticket(1)]) == 1
    snap = store.snapshot()
    assert snap["taken"] == 3 and snap["rejected"] == 1 and snap["dropped_stale"] == 1 and snap["depth"] == 0


@pytest.fixture
def board_and_shards(ray_local):
    made = []

    def make(per_update: int, lag: int, num_shards: int, capacity: int = 16, add_timeout_s: float = 120.0):
        board = SupplyBoard.remote(per_update, lag, num_shards)
        shards = [ReplayShard.remote(i, capacity, board, add_timeout_s=add_timeout_s) for i in range(num_shards)]
        _ray.get([board.register_shard.remote(i, s) for i, s in enumerate(shards)])
        _ray.get(board.publish.remote(Publish(0, [_ray.put({})])))
        made.extend([board, *shards])
        return board, shards

    yield make
    for a in made:
        _ray.kill(a)


def produce(board, shard, shard_index: int, actor: int = 0, version: int = 0, fill: float = 0.0, **kw):
    """One producer step as a rollout actor does it: poll for a ticket, make the fragment, add it."""
    (t,), _, _ = _ray.get(board.poll.remote(Poll(actor, 0, version, shard_index, 0, [], 0.0)))
    frag = make_fragment(version, fill=fill, actor_id=actor, **kw)
    return t, _ray.get(shard.add.remote(t, FragmentMeta.of(frag), frag))


def test_shard_keeps_only_confirmed_tickets_and_refuses_a_refunded_ones_late_copy(board_and_shards):
    board, (shard,) = board_and_shards(per_update=2, lag=0, num_shards=1)
    t0, ok = produce(board, shard, 0, actor=0)
    assert ok
    (t1,), _, _ = _ray.get(board.poll.remote(Poll(1, 0, 0, 0, 0, [], 0.0)))
    assert _ray.get(board.actor_gone.remote(ActorGone(1, 0))) == 1  # actor 1 died holding t1 ...
    frag = make_fragment(0)
    assert _ray.get(shard.add.remote(t1, FragmentMeta.of(frag), frag)) is False  # ... its add lands anyway
    stats = _ray.get(shard.stats.remote())
    assert stats["depth"] == 1 and stats["rejected"] == 1
    board_stats = _ray.get(board.stats.remote())
    assert board_stats["refunded"] == 1 and board_stats["rejected"] == 1 and board_stats["fragments_stored"] == 1


def test_full_shard_add_waits_then_fails_naming_the_shard(board_and_shards):
    board, (shard,) = board_and_shards(per_update=4, lag=0, num_shards=1, capacity=1, add_timeout_s=0.5)
    produce(board, shard, 0)
    with pytest.raises(Exception, match="replay shard 0 stayed full"):
        produce(board, shard, 0)


def test_shard_take_returns_fragments_zero_copy(board_and_shards):
    board, (shard,) = board_and_shards(per_update=2, lag=0, num_shards=1)
    for fill in (1.0, 2.0):
        produce(board, shard, 0, fill=fill, T=64, N=16)
    claims = _ray.get(board.claim.remote(Claim(0, 0, 5, 0.0, [])))
    ((index, (_, tickets)),) = claims.items()
    items, missing = _ray.get(_ray.get(board.shard_handles.remote())[index].take.remote(tickets))
    assert missing == [] and sorted(f.arrays[OBS][0, 0, 0] for _, f in items) == [1.0, 2.0]
    # Arrays come back as read-only views of the received buffer (zero-copy), not copies.
    assert not items[0][1].arrays[OBS].flags.writeable


def test_device_feed_collates_in_order_reuses_buffers_and_prefetches(board_and_shards):
    # Lag 1: tickets of updates 0 and 1 exist at once, so both batches can be made before the first is used.
    board, (shard,) = board_and_shards(per_update=2, lag=1, num_shards=1)
    for fill in (1.0, 2.0, 3.0, 4.0):
        produce(board, shard, 0, fill=fill)
    feed = DeviceFeed(board, 0, fragments_per_batch=2, device=resolve("cpu"), prefetch_batches=1).start()
    try:
        b0 = feed.next(timeout_s=10)
        obs0 = b0.tensors[OBS]
        # Two fragments of 4x2 samples, flattened time-major and concatenated.
        assert obs0.shape == (16, 3)
        assert sorted({float(obs0[0, 0]), float(obs0[8, 0])}) == [1.0, 2.0]  # update 0's tickets
        assert b0.num_samples == 16 and list(b0.policy_versions) == [0, 0] and len(b0.ticket_ids) == 2
        # While b0 is held, the feed prepares b1 into the other slot (double buffering).
        deadline = time.monotonic() + 5
        while feed._ready.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not feed._ready.empty(), "the next batch was not prepared while the current one was in use"
        ptr0 = obs0.data_ptr()
        feed.release(b0)
        b1 = feed.next(timeout_s=10)
        assert sorted({float(b1.tensors[OBS][0, 0]), float(b1.tensors[OBS][8, 0])}) == [3.0, 4.0]
        assert b1.tensors[OBS].data_ptr() != ptr0
        feed.release(b1)
        _ray.get(board.publish.remote(Publish(1, [_ray.put({})])))  # update 0 done: tickets of update 2 appear
        for fill in (5.0, 6.0):
            produce(board, shard, 0, fill=fill)
        b2 = feed.next(timeout_s=10)
        # Pool of prefetch+1 = 2 slots allocated once: the third batch reuses the first buffer.
        assert b2.tensors[OBS].data_ptr() == ptr0
        assert b2.h2d_bytes == 0  # CPU: no copy
        feed.release(b2)
    finally:
        feed.stop()


def test_two_feeds_draw_from_every_shard_and_split_each_update_exactly(board_and_shards):
    """3 shards, 2 learners, 3 fragments each: no learner owns a shard, none can be short of its batch."""
    board, shards = board_and_shards(per_update=6, lag=0, num_shards=3)
    feeds = [DeviceFeed(board, r, fragments_per_batch=3, device=resolve("cpu")).start() for r in range(2)]
    try:
        for i in range(6):  # all in shards 0 and 2: learner 1 must still get its three
            produce(board, shards[2 * (i % 2)], 2 * (i % 2), actor=i, fill=float(i))
        b = [f.next(timeout_s=10) for f in feeds]
        assert [x.num_samples for x in b] == [24, 24]
        assert not set(b[0].ticket_ids) & set(b[1].ticket_ids)
        fills = sorted(float(v) for x in b for v in x.tensors[OBS][::8, 0])
        assert fills == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    finally:
        for f in feeds:
            f.stop()


@_ray.remote(num_cpus=0, concurrency_groups={"feed": 1})
class FeedHost:
    """A learner's feed in a process of its own, as ``learner.actor.LearnerActor`` holds it: the parts rank 0
    sends arrive through a real Ray call (``take_assignment``, in a group of its own) while ``next`` waits."""

    def __init__(self):
        self.inbox = ClaimInbox()
        self.feed = None

    def start(self, board, rank: int, world: int, per: int, peers=None, group: bool = True) -> None:
        self.feed = DeviceFeed(board, rank, per, resolve("cpu"), world_size=world, peers=peers,
                               inbox=self.inbox if group else None).start()

    @_ray.method(concurrency_group="feed")
    def take_assignment(self, assignment: Assignment) -> None:
        self.inbox.put(assignment.board_key, assignment.update, assignment.part)

    @_ray.method(concurrency_group="feed")
    def waiting_parts(self) -> list:
        """The tickets of the parts sent to this rank and not taken yet."""
        return self.inbox.waiting_tickets()

    def next(self, timeout_s: float = 30.0) -> tuple:
        batch = self.feed.next(timeout_s)
        out = (batch.ticket_ids, sorted(float(v) for v in batch.tensors[OBS][::8, 0]))
        self.feed.release(batch)
        return out

    def attach(self, board) -> None:
        self.feed.attach_board(board)

    def counters(self) -> dict:
        return {"parts_sent": self.feed.group_parts_sent, "replacement_claims": self.feed.replacement_claims,
                "take_failures": self.feed.take_failures}

    def stop(self) -> None:
        self.feed.stop()


def parts_sent_to(host, n: int, timeout_s: float = 30.0) -> list:
    """The tickets of the parts rank 0 sent ``host`` and it has not taken, once there are ``n`` (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while len(part := _ray.get(host.waiting_parts.remote())) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return part


def test_split_claims_gives_each_rank_what_it_is_owed_from_as_few_shards_as_it_can():
    claims = {0: Part(2, [ticket(i) for i in range(3)]), 2: Part(2, [ticket(i) for i in range(3, 7)])}
    owed = {0: 2, 1: 0, 2: 3, 3: 2}
    pieces = split_claims(claims, owed)
    assert {r: {s: [t.id for t in ts] for s, (_, ts) in p.items()} for r, p in pieces.items()} == {
        0: {0: [0, 1]}, 2: {0: [2], 2: [3, 4]}, 3: {2: [5, 6]}}
    assert owed == {0: 0, 1: 0, 2: 0, 3: 0}
    with pytest.raises(RuntimeError, match="more than the ranks are owed"):
        split_claims({0: Part(2, [ticket(9)])}, {0: 0})


def test_claims_name_shards_by_index_and_a_feed_reads_the_directory_once_per_replacement(board_and_shards):
    """A claim's answer carries the board's shard directory version, never an actor handle (each handle in an answer
    costs the board memory Ray keeps: once an update, a run's board grew without bound). The feed asks for the
    directory once, then only after a shard is replaced, and takes the new shard's fragments from the new shard."""
    board, shards = board_and_shards(per_update=2, lag=0, num_shards=2)
    for i in range(2):
        produce(board, shards[i], i, actor=i)
    claims = _ray.get(board.claim.remote(Claim(0, 0, 2, 1.0, [], min_items=2)))
    assert sorted(claims) == [0, 1] and all(type(p) is Part and p.directory_version == 2 and len(p.tickets) == 1
                                            for p in claims.values())  # two shards registered: version 2

    board, shards = board_and_shards(per_update=2, lag=0, num_shards=2)
    feed = DeviceFeed(board, 0, fragments_per_batch=2, device=resolve("cpu")).start()
    try:
        for update in range(4):
            if update == 2:  # shard 1 replaced (as the driver does after a death): the directory version moves on
                replacement = ReplayShard.remote(1, 16, board)
                _ray.get(board.register_shard.remote(1, replacement))
                shards = [shards[0], replacement]
            for i in range(2):
                produce(board, shards[i], i, actor=i, version=update, fill=float(10 * update + i))
            batch = feed.next(timeout_s=30)
            assert sorted(float(v) for v in batch.tensors[OBS][::8, 0]) == [10.0 * update, 10.0 * update + 1]
            feed.release(batch)
            _ray.get(board.publish.remote(Publish(update + 1, [_ray.put({})])))
        calls = _ray.get(board.stats.remote())["board_calls"]
        assert calls["shard_directory"] == 2 and feed.take_failures == 0
        assert _ray.get(replacement.stats.remote())["taken"] == 2  # updates 2 and 3: one fragment each
    finally:
        feed.stop()


def test_a_learner_group_claims_each_update_once_and_every_rank_gets_its_own_part(board_and_shards):
    """3 ranks, 2 fragments each, 2 shards, two updates: rank 0 claims all six in one board call an update and
    sends ranks 1 and 2 their parts; the ranks' batches are disjoint and together the whole update. Each rank
    claiming its own (group=False) makes three claims an update."""
    for group in (True, False):
        board, shards = board_and_shards(per_update=6, lag=0, num_shards=2)
        hosts = [FeedHost.remote() for _ in range(3)]
        _ray.get([h.start.remote(board, r, 3, 2, peers=hosts if r == 0 and group else None, group=group)
                  for r, h in enumerate(hosts)])
        try:
            for update in range(2):
                for i in range(6):
                    produce(board, shards[i % 2], i % 2, actor=i, version=update, fill=float(10 * update + i))
                got = _ray.get([h.next.remote() for h in hosts], timeout=60)
                ids = [set(i) for i, _ in got]
                assert [len(i) for i in ids] == [2, 2, 2] and len(set.union(*ids)) == 6
                assert sorted(f for _, fills in got for f in fills) == [10.0 * update + i for i in range(6)]
                _ray.get(board.publish.remote(Publish(update + 1, [_ray.put({})])))
            claims = _ray.get(board.stats.remote())["board_calls"]["claim"]
            if group:
                # One an update, and the next update's, parked (at most one more wait may have ended meanwhile).
                assert claims <= 2 + 2, claims
                assert _ray.get(hosts[0].counters.remote())["parts_sent"] == 4
            else:
                assert claims >= 6, claims
        finally:
            _ray.get([h.stop.remote() for h in hosts])
            for h in hosts:
                _ray.kill(h)


def test_a_rank_whose_part_is_gone_from_its_shard_claims_the_replacements_itself(board_and_shards):
    """Rank 1's part of the group claim is dropped from its shard before rank 1 takes it (as a shard that died
    with it would lose it): rank 1 hands those tickets back in a claim of its own, they are made again, and its
    batch is whole and disjoint from rank 0's. Rank 0 owes rank 1 nothing more, so it does not claim them too."""
    board, (shard,) = board_and_shards(per_update=4, lag=0, num_shards=1)
    hosts = [FeedHost.remote() for _ in range(2)]
    _ray.get(hosts[0].start.remote(board, 0, 2, 2, peers=hosts))
    try:
        for i in range(4):
            produce(board, shard, 0, actor=i, fill=float(i))
        first = _ray.get(hosts[0].next.remote(), timeout=30)
        part = parts_sent_to(hosts[1], 2)
        assert len(part) == 2, "rank 0 did not send rank 1 its part"
        assert _ray.get(shard.drop.remote(part)) == 2
        _ray.get(hosts[1].start.remote(board, 1, 2, 2))  # rank 1's feed starts: its take finds them gone
        deadline = time.monotonic() + 30
        while _ray.get(board.stats.remote())["refunded"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _ray.get(board.stats.remote())["refunded"] == 2
        for i in range(2):  # the refunded tickets, made again
            produce(board, shard, 0, actor=10 + i, fill=float(10 + i))
        second = _ray.get(hosts[1].next.remote(), timeout=30)
        assert len(second[0]) == 2 and not set(first[0]) & set(second[0])
        assert second[1] == [10.0, 11.0] and set(first[1]) < {0.0, 1.0, 2.0, 3.0}
        c1 = _ray.get(hosts[1].counters.remote())
        assert c1["replacement_claims"] == 1 and c1["parts_sent"] == 0
        st = _ray.get(board.stats.remote())
        assert st["fragments_claimed"] == 6 and st["refunded"] == 2
    finally:
        _ray.get([h.stop.remote() for h in hosts])
        for h in hosts:
            _ray.kill(h)


def test_a_rank_an_update_behind_when_the_board_is_replaced_claims_that_update_itself(board_and_shards):
    """Rank 0 has sent rank 1 its part of update 0 and gone on to update 1 when the board is replaced; rank 1 has
    not taken its part yet, so it must make update 0 again from the new board. Rank 0 leads there from update 1
    and says so: rank 1 claims update 0's batch itself, then takes its part of update 1 from rank 0's claim.
    (Waiting for a part of update 0 that rank 0 will never claim, it stalled.)"""
    old, (old_shard,) = board_and_shards(per_update=2, lag=1, num_shards=1)
    hosts = [FeedHost.remote() for _ in range(2)]
    _ray.get(hosts[0].start.remote(old, 0, 2, 1, peers=hosts))
    try:
        for i in range(2):
            produce(old, old_shard, 0, actor=i, fill=float(i))
        first0 = _ray.get(hosts[0].next.remote(), timeout=30)  # rank 0's update 0, from the old board
        assert len(parts_sent_to(hosts[1], 1)) == 1, "rank 0 did not send rank 1 its part"
        new, (new_shard,) = board_and_shards(per_update=2, lag=1, num_shards=1)
        _ray.get(hosts[0].attach.remote(new))  # rank 0 drops its claim of update 1 on the old board
        _ray.get(hosts[1].start.remote(new, 1, 2, 1))  # rank 1 starts on the new board, at update 0
        for i in range(4):  # updates 0 and 1 on the new board (lowest first)
            produce(new, new_shard, 0, actor=10 + i, fill=float(10 + i))
        first1 = _ray.get(hosts[1].next.remote(), timeout=30)
        second = _ray.get([h.next.remote() for h in hosts], timeout=30)
        assert first0[1][0] in (0.0, 1.0) and first1[1][0] in (10.0, 11.0)  # update 0: old board / new board
        assert all(fills[0] in (12.0, 13.0) for _, fills in second) and second[0][1] != second[1][1]
        assert _ray.get(hosts[1].counters.remote())["replacement_claims"] == 1
    finally:
        _ray.get([h.stop.remote() for h in hosts])
        for h in hosts:
            _ray.kill(h)


def test_feed_stall_names_the_update_and_what_it_has(board_and_shards):
    board, (shard,) = board_and_shards(per_update=2, lag=0, num_shards=1)
    produce(board, shard, 0)
    feed = DeviceFeed(board, 0, fragments_per_batch=2, device=resolve("cpu")).start()
    try:
        # Once the feed has taken the one fragment there is (a condition: a loaded machine took over the 1 s
        # stall below to get there, and the stall then said 0 of 2), the stall must name it.
        deadline = time.monotonic() + 30
        while feed.have < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert feed.have == 1, "the feed did not take the stored fragment within 30 s"
        t = time.monotonic()
        with pytest.raises(StallError) as e:
            feed.next(timeout_s=1.0)
        assert 0.9 <= time.monotonic() - t < 5
        assert e.value.args[0] == (0, 1, 2)  # update 0, 1 of 2 fragments
    finally:
        feed.stop()


def test_a_claim_answered_with_nothing_leaves_the_feed_claiming_until_the_fragment_comes(board_and_shards):
    """A hung or stopped actor holds an update's last ticket: the board answers the feed's claims with nothing
    until its lease runs out. The feed claims again each time (it stopped at the first empty answer, reading the
    shard directory version of no part), and takes the fragment once another actor has made it."""
    board, (shard,) = board_and_shards(per_update=2, lag=0, num_shards=1)
    produce(board, shard, 0)
    # A claim waits 0.05 s for its whole batch, then 4 x 0.05 s for a part: empty answers every 0.25 s.
    feed = DeviceFeed(board, 0, fragments_per_batch=2, device=resolve("cpu"), claim_wait_s=0.05).start()
    try:
        deadline = time.monotonic() + 30
        while (_ray.get(board.stats.remote())["board_calls"].get("claim", 0) < 5 and feed._error is None
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert feed._error is None, f"the feed thread failed: {feed._error!r}"
        assert _ray.get(board.stats.remote())["board_calls"]["claim"] >= 5, "the feed claimed fewer than 5 times"
        assert feed.have == 1
        produce(board, shard, 0, actor=1)  # the update's last fragment, made by another actor
        batch = feed.next(timeout_s=30)
        assert len(batch.ticket_ids) == 2 and batch.num_samples == 2 * 4 * 2
    finally:
        feed.stop()


def test_one_poll_gives_several_tickets_lowest_update_first_and_one_add_stores_them(board_and_shards):
    board, (shard,) = board_and_shards(per_update=3, lag=1, num_shards=1)
    # Version 0 at lag 1: updates 0 and 1 have 3 tickets each. Five asked: all of update 0, then two of update 1.
    tickets, _, _ = _ray.get(board.poll.remote(Poll(0, 0, 0, 0, 0, [], 0.0, max_tickets=5)))
    assert [t.update for t in tickets] == [0, 0, 0, 1, 1] and len({t.id for t in tickets}) == 5
    (late,), _, _ = _ray.get(board.poll.remote(Poll(1, 0, 0, 0, 0, [], 0.0, max_tickets=4)))  # the one left
    assert _ray.get(board.actor_gone.remote(ActorGone(1, 0))) == 1  # actor 1 died holding it; its add lands anyway
    entries = [(t, FragmentMeta.of(f), f) for t, f in ((t, make_fragment(0, fill=i)) for i, t in
                                                       enumerate([*tickets, late]))]
    ok = _ray.get(shard.add_many.remote(entries))
    assert ok == [True] * 5 + [False]  # the refunded ticket's copy is refused and dropped, the others kept
    assert _ray.get(shard.stats.remote())["depth"] == 5
    claims = _ray.get(board.claim.remote(Claim(0, 0, 10, 0.0, [])))
    assert sorted(t.id for _, ts in claims.values() for t in ts) == sorted(t.id for t in tickets[:3])
    st = _ray.get(board.stats.remote())
    assert st["fragments_stored"] == 5 and st["rejected"] == 1


def test_an_add_of_more_fragments_than_the_shard_holds_confirms_as_it_goes(board_and_shards):
    """Capacity 2, an add of 3: the first two must be confirmed (so claimable) before the add waits for room, or
    no learner could ever take them and make that room."""
    board, (shard,) = board_and_shards(per_update=3, lag=0, num_shards=1, capacity=2, add_timeout_s=20.0)
    tickets, _, _ = _ray.get(board.poll.remote(Poll(0, 0, 0, 0, 0, [], 0.0, max_tickets=3)))
    pending = shard.add_many.remote([(t, FragmentMeta.of(f), f) for t, f in ((t, make_fragment(0)) for t in tickets)])
    taken = []
    deadline = time.monotonic() + 15
    while len(taken) < 3 and time.monotonic() < deadline:  # a learner's feed: claim, then take
        for index, (_, ts) in _ray.get(board.claim.remote(Claim(0, 0, 3, 0.5, []))).items():
            items, missing = _ray.get(shard.take.remote(ts))
            assert index == 0
            assert not missing
            taken += items
    assert len(taken) == 3
    assert _ray.get(pending, timeout=10) == [True, True, True]


def test_a_feed_claims_a_batch_made_over_a_second_once(board_and_shards):
    """Four fragments, one every 0.1 s: the feed's one claim waits for the whole batch (CLAIM_WAIT_S, 2 s: a wide
    margin on a loaded machine) instead of taking it in parts, so an update costs the board one claim per learner
    when its batch is made within the wait (at 1,000 actors and 64 learners claims in parts were the board's
    largest share of calls). With a 0.25 s wait it claimed in parts."""
    board, (shard,) = board_and_shards(per_update=4, lag=0, num_shards=1)
    feed = DeviceFeed(board, 0, fragments_per_batch=4, device=resolve("cpu")).start()
    try:
        time.sleep(0.1)  # the feed's claim is parked before the first fragment is stored
        t0 = time.monotonic()
        for fill in range(4):
            produce(board, shard, 0, fill=float(fill))
            time.sleep(0.1)
        made_s = time.monotonic() - t0
        batch = feed.next(timeout_s=20)
        assert len(batch.ticket_ids) == 4
        # The feed goes on to the next update's batch: wait until that claim is parked too.
        deadline = time.monotonic() + 10
        while _ray.get(board.stats.remote())["board_calls"].get("claim", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        claims = _ray.get(board.stats.remote())["board_calls"]["claim"]
        assert claims == 2, (claims, f"batch made in {made_s:.2f} s")  # one for update 0, one waiting for 1
    finally:
        feed.stop()


def test_a_stored_fragment_wakes_only_the_claims_it_can_fill(board_and_shards):
    """Four learners parked in claims for two fragments each; two fragments are stored: one claim is answered with
    both, three stay parked (no wake-up of every learner to find nothing and ask again)."""
    board, (shard,) = board_and_shards(per_update=8, lag=0, num_shards=1)
    tickets, _, _ = _ray.get(board.poll.remote(Poll(0, 0, 0, 0, 0, [], 0.0, max_tickets=8)))
    claims = [board.claim.remote(Claim(rank, 0, 2, 20.0, [], 0, min_items=2)) for rank in range(4)]
    time.sleep(0.5)  # parked
    frag = make_fragment(0)
    assert _ray.get(shard.add_many.remote([(t, FragmentMeta.of(frag), frag) for t in tickets[:2]])) == [True] * 2
    ready, parked = _ray.wait(claims, num_returns=1, timeout=10)
    assert len(ready) == 1 and sum(len(ts) for _, ts in _ray.get(ready[0]).values()) == 2
    assert _ray.wait(parked, num_returns=1, timeout=1.0)[0] == []  # the other three were not woken ...
    assert _ray.get(board.stats.remote())["board_calls"]["claim_wakeups"] == 1  # ... not even to look
    assert _ray.get(shard.add_many.remote([(t, FragmentMeta.of(frag), frag) for t in tickets[2:]])) == [True] * 6
    got = [sum(len(ts) for _, ts in g.values()) for g in _ray.get(parked, timeout=10)]
    assert got == [2, 2, 2]


def test_a_stored_call_gathers_the_adds_of_several_producers_and_never_holds_a_lone_one(ray_local):
    """A shard's only producer is confirmed at once, one call per add, however long the gathering time. Eight
    producers each adding one fragment at a time as soon as the previous add is answered (a rollout actor's
    protocol, 20-60 ms to make each): a stored call waits for all eight (at most the gathering time), so each
    carries about one add per producer, not one or two."""
    import random
    import threading

    gather_s = 0.3
    board = SupplyBoard.remote(2000, 0, 1)
    lone = ReplayShard.remote(0, 2000, board, gather_s=30.0)
    busy = ReplayShard.remote(0, 2000, board, gather_s=gather_s)
    try:
        _ray.get(board.register_shard.remote(0, lone))
        _ray.get(board.publish.remote(Publish(0, [_ray.put({})])))
        tickets, _, _ = _ray.get(board.poll.remote(Poll(0, 0, 0, 0, 0, [], 0.0, max_tickets=2000)))
        frag = make_fragment(0)
        meta = FragmentMeta.of(frag)
        it = iter(tickets)
        t0 = time.monotonic()
        for _ in range(3):
            assert _ray.get(lone.add_many.remote([(next(it), meta, frag)], producer=0)) == [True]
        assert time.monotonic() - t0 < 10 and _ray.get(lone.stats.remote())["stored_calls"] == 3
        _ray.get(board.register_shard.remote(0, busy))  # the board now confirms shard 0's adds from this one
        lock, adds, errors, stop = threading.Lock(), [0], [], time.monotonic() + 3.0

        def producer(p: int) -> None:
            rng = random.Random(p)
            try:
                while time.monotonic() < stop:
                    time.sleep(rng.uniform(0.02, 0.06))  # making the fragment
                    with lock:
                        ticket = next(it)
                    assert _ray.get(busy.add_many.remote([(ticket, meta, frag)], producer=p), timeout=30) == [True]
                    with lock:
                        adds[0] += 1
            except Exception as e:  # noqa: BLE001 - failed in the test's thread: failed in the test
                errors.append(repr(e))

        t0 = time.monotonic()
        threads = [threading.Thread(target=producer, args=(p,)) for p in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
        assert not errors, errors
        calls = _ray.get(busy.stats.remote())["stored_calls"]
        assert calls <= elapsed / 0.02, (calls, elapsed)  # paced by the producers, about one call per fragment time
        assert adds[0] >= 5 * calls, (adds[0], calls)  # a call carries most producers' adds
    finally:
        for a in (lone, busy, board):
            _ray.kill(a)


def test_held_adds_are_confirmed_on_the_pace_clock_and_an_updates_tail_at_once(ray_local):
    """Rollout actors' adds are acknowledged once the shard holds them (``ack="held"``): forty producers' adds made
    within a moment reach the board in one ``stored`` call when the shard's pace runs out, not one call each. Once a
    learner's claim waits for an update's last fragments, the board tells the shard to hurry (``hurry``), so those
    are confirmed on the short clock instead of waiting out a pace."""
    pace_s = 3.0
    board = SupplyBoard.remote(64, 0, 1)
    shard = ReplayShard.remote(0, 256, board, pace_s=pace_s)
    try:
        _ray.get(board.register_shard.remote(0, shard))
        _ray.get(board.publish.remote(Publish(0, [_ray.put({})])))
        tickets, _, _ = _ray.get(board.poll.remote(Poll(0, 0, 0, 0, 0, [], 0.0, max_tickets=64)))
        assert len(tickets) == 64
        frag = make_fragment(0)
        meta = FragmentMeta.of(frag)
        t0 = time.monotonic()
        acks = _ray.get([shard.add_many.remote([(t, meta, frag)], producer=p, ack="held")
                         for p, t in enumerate(tickets[:40])])
        assert acks == [[True]] * 40 and time.monotonic() - t0 < pace_s / 2  # acknowledged once held
        time.sleep(0.5)
        assert _ray.get(board.stats.remote())["fragments_stored"] == 0  # held, not confirmed yet
        deadline = time.monotonic() + 20
        while _ray.get(board.stats.remote())["fragments_stored"] < 40 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _ray.get(board.stats.remote())["fragments_stored"] == 40
        assert _ray.get(shard.stats.remote())["stored_calls"] == 1
        claim = board.claim.remote(Claim(0, 0, 64, 30.0, [], 0, min_items=64))  # a learner waits for the whole batch
        time.sleep(0.3)
        t1 = time.monotonic()
        _ray.get([shard.add_many.remote([(t, meta, frag)], producer=40 + k, ack="held")
                  for k, t in enumerate(tickets[40:])])
        got = _ray.get(claim, timeout=30)
        waited = time.monotonic() - t1
        assert sum(len(ts) for _, ts in got.values()) == 64
        assert waited < pace_s / 2, f"the tail waited {waited:.2f} s for a {pace_s} s pace"
        assert _ray.get(board.stats.remote())["board_calls"]["hurry"] == 1
    finally:
        for a in (shard, board):
            _ray.kill(a)


def test_a_rollout_actor_gives_back_what_a_dead_shard_held_unconfirmed(ray_local):
    """A shard acknowledges an add once it holds it and confirms it with the board later. If it dies in between, the
    board never heard of those fragments: the rollout actor, which keeps what it sent until its update is done,
    reports them as failed adds once the board names the replacement, and exactly those are made again (the lease,
    two minutes here, would take far longer)."""
    from actors.rollout import RolloutActor
    from cluster import config as config_mod
    from cluster.graph import ActorGraph
    from learner.model import build_model, state_dict_numpy
    from tests.conftest import ROOT, env_spec

    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), ["rollout.fragment_length=4",
                                                                  "rollout.envs_per_actor=1"])
    graph = ActorGraph(cfg, None, print)
    graph.spec = env_spec("CartPole-v1")
    per_update = 24  # above TAIL_MIN: not at its tail from the start, so the dying shard's pace holds it all
    board = SupplyBoard.remote(per_update, 0, 1, lease_s=120.0)
    dying = ReplayShard.remote(0, 64, board, pace_s=600.0)  # confirms nothing while the test runs
    replacement = ReplayShard.remote(0, 64, board)
    actor = RolloutActor(actor_id=0, shard=dying, shard_index=0, board=board,
                         sampler_settings=graph.sampler_settings(1), policy_factory=graph.policy_factory(),
                         stall_timeout_s=60.0)
    try:
        _ray.get(board.register_shard.remote(0, dying))
        _ray.get(board.publish.remote(Publish(0, [_ray.put(state_dict_numpy(build_model(graph.spec)))])))
        actor.start()
        deadline = time.monotonic() + 60
        while _ray.get(dying.stats.remote())["depth"] < per_update and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _ray.get(dying.stats.remote())["depth"] == per_update  # the update's whole batch, held ...
        assert _ray.get(board.stats.remote())["fragments_stored"] == 0  # ... and not confirmed
        _ray.kill(dying)
        assert _ray.get(board.register_shard.remote(0, replacement)) == 0  # the board knew of nothing stored there
        deadline = time.monotonic() + 30
        while _ray.get(board.stats.remote())["fragments_stored"] < per_update and time.monotonic() < deadline:
            time.sleep(0.1)
        st = _ray.get(board.stats.remote())
        assert st["refunded"] == per_update and st["fragments_stored"] == per_update, st
        assert st["lease_expired"] == 0 and actor.stats()["error"] is None
        assert _ray.get(replacement.stats.remote())["depth"] == per_update
    finally:
        actor.stop()
        for a in (replacement, board):
            _ray.kill(a)


def test_tickets_freed_while_polls_are_parked_reach_every_parked_poll(board_and_shards):
    """Ten actors parked in polls when 25 tickets come free: the first wake-up is sized by the first share (3 each,
    so 9 polls), but each share is of what is left, so those nine take fewer than 27 and tickets stay free. The
    next parked poll is woken for them at once, not when its wait runs out (at 1,000 actors polling the board
    itself, 833 tickets sat free beside 317 parked polls for up to 2 s)."""
    board = SupplyBoard.remote(25, 0, 1, expected_actors=10)
    shard = ReplayShard.remote(0, 64, board)
    try:
        _ray.get(board.register_shard.remote(0, shard))
        polls = [board.poll.remote(Poll(a, 0, 0, 0, 0, [], 20.0, max_tickets=16)) for a in range(10)]
        time.sleep(1.0)  # all parked: no policy yet, so no tickets
        t0 = time.monotonic()
        _ray.get(board.publish.remote(Publish(0, [_ray.put({})])))
        got = [len(tickets) for tickets, _, _ in _ray.get(polls, timeout=60)]
        waited = time.monotonic() - t0
        assert min(got) >= 1 and sum(got) <= 25, got
        assert waited < 5.0, f"a parked poll waited {waited:.1f} s beside free tickets ({got})"
    finally:
        for a in (shard, board):
            _ray.kill(a)
