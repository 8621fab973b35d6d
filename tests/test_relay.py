"""Node relays (pipeline/relay.py) on a real local Ray: the rollout actors of a node take their tickets from one
relay, which takes them from the supply board in blocks; the accounting stays the board's, and an actor whose relay
stops answering polls the board itself."""

import os
import signal
import threading
import time

import numpy as np
import pytest
import ray as _ray

from cluster import config as config_mod
from cluster.driver import Trainer
from pipeline.protocol import Poll, Publish, Stored
from tests.conftest import (ROOT, build_and_run_striking, kill_all, records_so_far, wait_for_count,
                            wait_for_records)


def cfg_for(*extra):
    return config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "rollout.num_actors=3", "rollout.envs_per_actor=8", "replay.num_shards=2", "run.require_target=false",
        "run.target_return=null", "run.checkpoint_interval_s=null", "rollout.node_relays=always",
        "run.total_env_steps=40960", *extra])


def run_and_inspect(cfg, run_dir, strike=None):
    """Train; ``strike(trainer)`` runs in a thread meanwhile. Returns (result, board stats, relay stats, rollout
    actors' stats), read before the graph is torn down."""
    trainer = Trainer(cfg, run_dir, quiet=True)
    try:
        result = build_and_run_striking(trainer, strike)
        board = _ray.get(trainer.board.stats.remote(), timeout=30)
        actors = _ray.get([a.stats.remote() for a in trainer.rollouts], timeout=30)
        relays = []
        for relay in trainer.relays:
            try:
                relays.append(_ray.get(relay.stats.remote(), timeout=5))
            except Exception:  # noqa: BLE001 - a stopped relay (the test's) does not answer
                relays.append(None)
    finally:
        trainer.shutdown()
    return result, board, relays, actors


@pytest.mark.long
def test_a_stopped_relay_leaves_its_actors_polling_the_board_and_the_run_goes_on(ray_local, tmp_path):
    stopped = []

    def stop_relay(trainer):
        wait_for_records(tmp_path / "run", 3)
        pid = _ray.get(trainer.relays[0].__ray_call__.remote(lambda self: os.getpid()))
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    try:
        t0 = time.monotonic()
        result, board, relays, actors = run_and_inspect(cfg_for(), tmp_path / "run", stop_relay)
    finally:
        kill_all(stopped)
    assert stopped and result.reason == "total_env_steps", (stopped, result.reason)
    # Each actor left the silent relay after its poll's wait plus RELAY_DEADLINE_S and polled the board itself;
    # the tickets the relay held came back through their leases.
    assert all(a["relay_fallbacks"] >= 1 and "Timeout" in a["relay_error"] for a in actors), actors
    assert board["board_calls"]["poll"] > 0 and relays == [None]
    assert board["rejected"] == 0 and board["voided"] == 0, board
    assert time.monotonic() - t0 < 120


# In `make test-long` (suite time): a relay fault case beyond the first (a SIGSTOPped relay).
@pytest.mark.long
def test_a_killed_actors_lent_tickets_go_back_through_its_relay_not_its_lease(ray_local, tmp_path):
    """The lease is 600 s, so the only way the tickets a killed actor was lent can come back is the relay hearing
    of its death from the board and returning them as failed adds: without that the update that owns them would
    wait past the run's stall deadline."""
    killed = []

    def kill_holding_actor(trainer):
        wait_for_records(tmp_path / "run", 3)
        relay, actor = trainer.relays[0], trainer.rollouts[0]
        pid = _ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # stopped while it holds a lent ticket whose fragment is not stored
            os.kill(pid, signal.SIGSTOP)
            # A stopped actor may still have an add in flight, and it keeps the tickets of a block it has sent
            # in full until its next poll: let the shard report what it got, then look at the ledger itself.
            time.sleep(0.5)
            held = unstored_lent_tickets(relay, trainer.board, actor_id=0)
            if held:
                break
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        killed.append(held)

    result, board, relays, actors = run_and_inspect(
        cfg_for("rollout.fragment_timeout_s=600", "run.stall_timeout_s=60"), tmp_path / "run", kill_holding_actor)
    assert killed and killed[0], "the actor was never stopped holding an unstored lent ticket"
    assert result.reason == "total_env_steps", result.reason
    # (At least one: an add that was still on its way after the wait would be stored, not refunded.)
    assert board["refunded"] >= 1 and board["lease_expired"] == 0, (killed, board)
    assert board["rejected"] == 0 and board["voided"] == 0, board


def unstored_lent_tickets(relay, board, actor_id: int) -> list[int]:
    """Ids of the tickets ``relay`` has lent to ``actor_id`` that the board's ledger still holds as issued."""
    lent = _ray.get(relay.__ray_call__.remote(
        lambda self: [t.id for (a, _), ts in self.state.lent.items() if a == actor_id for t in ts]), timeout=10)
    states = _ray.get(board.__ray_call__.remote(
        lambda self: {tid: self.supply.ledger._state(tid) for tid in lent}), timeout=10)
    return [tid for tid, state in states.items() if state == "issued"]


# In `make test-long` (suite time): a relay fault case beyond the first (a SIGSTOPped relay).
@pytest.mark.long
def test_a_replaced_board_is_attached_to_the_relays_and_the_actors_return_to_them(ray_local, tmp_path):
    killed = []

    def kill_board(trainer):
        wait_for_records(tmp_path / "run", 3)
        pid = _ray.get(trainer.board.__ray_call__.remote(lambda self: os.getpid()))
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    result, board, relays, actors = run_and_inspect(cfg_for("run.total_env_steps=61440"), tmp_path / "run",
                                                    kill_board)
    assert killed and result.reason == "total_env_steps", result.reason
    # The new board (the one read at the end) serves the relay: its actors are back on it.
    calls = board["board_calls"]
    assert calls["relay_poll"] > 0 and calls.get("poll", 0) < calls["relay_poll"], calls
    assert relays[0]["lost"] is None, relays


def test_auto_gives_relays_only_to_the_busy_nodes_of_a_cluster():
    """rollout.node_relays: auto: none on one node (a relay would only move the board's work to another process on
    the same cores), none in process; on a cluster, the nodes that start with 16 rollout actors or more."""
    from types import SimpleNamespace

    from cluster.graph import ActorGraph

    def relay_nodes(nodes, actors, mode="auto", inprocess=False):
        cfg = cfg_for(f"rollout.num_actors={actors}", f"rollout.node_relays={mode}")
        graph = ActorGraph(cfg, None, print)
        graph.plan, graph.inprocess = SimpleNamespace(rollout_nodes=nodes), inprocess
        graph.make_relay = lambda node, index: f"relay {index} on {node}"  # what would be created, not created
        return graph.make_relays()

    assert relay_nodes(["a"], 64) == {}
    assert relay_nodes(["a", "b"], 64, inprocess=True) == {}
    assert relay_nodes(["a", "b"], 64, mode="never") == {}
    assert relay_nodes(["a", "a", "b"], 30) == {"a": "relay 0 on a"}  # a: 20 actors, b: 10
    assert relay_nodes(["a"], 3, mode="always") == {"a": "relay 0 on a"}


def test_a_nodes_actors_take_every_ticket_through_one_relay_also_across_a_killed_shard(ray_local, tmp_path):
    """3 actors on one node share a relay: no poll reaches the board, the relay asks the board less often than its
    actors ask it, their stats reach the driver, the ledger stays exact; and when shard 1 is SIGKILLed, its
    producer learns of the replacement from the relay's directory and goes on into it."""
    killed, sent_after = [], []

    def kill_shard(trainer):
        wait_for_records(tmp_path / "run", 3)
        pid = _ray.get(trainer.shards[1].__ray_call__.remote(lambda self: os.getpid()))
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
        wait_for_count(tmp_path / "run", "shard_restarts")
        sent_after.append(_ray.get(trainer.rollouts[1].stats.remote(), timeout=30)["fragments_sent"])

    result, board, relays, actors = run_and_inspect(cfg_for("run.total_env_steps=61440"), tmp_path / "run",
                                                    kill_shard)
    assert killed and result.reason == "total_env_steps", result.reason
    # The replacement's handle reached the producers of shard 1 through the relay's directory: none had to leave it,
    # and none was replaced (a fresh actor would have been made with the new handle).
    rec = records_so_far(tmp_path / "run")
    assert rec[-1]["shard_restarts"] == 1 and rec[-1]["rollout_restarts"] == 0, rec[-1]
    assert all(a["relay_fallbacks"] == 0 for a in actors), [a["relay_error"] for a in actors]
    # Actor 1 (shard 1's producer) went on producing into the replacement: the others alone would finish the run.
    assert sent_after and actors[1]["fragments_sent"] >= sent_after[0] + 4, (sent_after, actors[1]["fragments_sent"])
    calls = board["board_calls"]
    assert calls.get("poll", 0) == 0 and calls["relay_poll"] > 0, calls
    (relay,) = relays
    assert relay["lost"] is None and relay["calls"]["poll"] > relay["calls"]["board_calls"], relay
    # The ledger stayed exact: nothing refused or voided; what the dead shard held was refunded and made again.
    assert board["rejected"] == 0 and board["voided"] == 0, board
    assert board["fragments_stored"] >= board["fragments_claimed"] > 0, board
    assert result.episode_return_mean > 0  # the actors' stats (episodes) reached the driver through the relay


def test_a_relay_calls_the_board_at_most_once_a_pace_however_often_its_actors_ask(ray_local):
    """Twenty local actors asking for one ticket at a time as fast as they can, against a board that answers in
    milliseconds: the relay's board calls follow its clock (a pace of 0.5 s here, so that a call's round trip on a
    loaded machine is far below it), not the board's answers, and the actors are not kept waiting for the pace
    (what they will take in one is asked for ahead)."""
    from pipeline.protocol import RELAY_ID_BASE
    from pipeline.relay import NodeRelay
    from pipeline.supply import SupplyBoard

    pace_s = 0.5
    board = SupplyBoard.remote(100_000, 0, 1, expected_actors=20)
    relay = NodeRelay.remote(board, RELAY_ID_BASE, pace_s=pace_s)
    try:
        _ray.get(board.register_shard.remote(0, relay))  # any handle: nothing is stored in this test
        _ray.get(board.publish.remote(Publish(0, [_ray.put({})])))
        seconds, got, waits = 5.0, [0] * 20, []  # waits: the time of each poll (how many there were is what counts)
        stop = time.monotonic() + seconds

        def actor(a: int) -> None:
            while time.monotonic() < stop:
                t0 = time.monotonic()
                tickets, _, _ = _ray.get(relay.poll.remote(Poll(a, 0, 0, 0, 0, [], 2.0, max_tickets=1)), timeout=30)
                waits.append(time.monotonic() - t0)
                got[a] += len(tickets)

        threads = [threading.Thread(target=actor, args=(a,)) for a in range(20)]
        for t in threads:
            t.start()
        time.sleep(seconds / 2)  # the demand the look-ahead follows is measured by then
        polls_half, waited_half = len(waits), _ray.get(relay.stats.remote())["calls"].get("poll_waited", 0)
        for t in threads:
            t.join(timeout=60)
        relay_calls = _ray.get(relay.stats.remote())["calls"]
        calls = relay_calls["board_calls"]
        assert calls <= seconds / pace_s + 3, calls  # unpaced: ~30 in 5 s
        assert min(got) > 0 and sum(got) > 10 * calls, (got, calls)  # many tickets a call, every actor served
        # In the second half most polls find their ticket in the pool. Without the look-ahead each call brings only
        # the blocks of the actors waiting then, so every poll empties the pool and waits for the next call.
        polls, waited = len(waits) - polls_half, relay_calls.get("poll_waited", 0) - waited_half
        assert waited < 0.5 * polls, (waited, polls)
    finally:
        for a in (relay, board):
            _ray.kill(a)


def test_a_nodes_shards_confirm_through_its_relay_and_with_the_board_once_it_is_gone(ray_local):
    """Two shards of one node hold adds on their pace clock and confirm them through the node's relay, which carries
    both up in one board call (its ``relay_poll``; the board sees no ``stored``). Once the relay is killed, the next
    adds are confirmed by the board directly: nothing is lost or refused, and the ledger holds all eight."""
    from pipeline.fragment import FragmentMeta
    from pipeline.protocol import RELAY_ID_BASE
    from pipeline.relay import NodeRelay
    from pipeline.replay import ReplayShard
    from pipeline.supply import SupplyBoard
    from tests.test_replay import make_fragment

    board = SupplyBoard.remote(8, 0, 2)
    relay = NodeRelay.remote(board, RELAY_ID_BASE)
    shards = [ReplayShard.remote(i, 16, board, relay=relay) for i in range(2)]
    try:
        _ray.get([board.register_shard.remote(i, s) for i, s in enumerate(shards)])
        _ray.get(board.publish.remote(Publish(0, [_ray.put({})])))
        tickets, _, _ = _ray.get(board.poll.remote(Poll(0, 0, 0, 0, 0, [], 0.0, max_tickets=8)))
        assert len(tickets) == 8

        def add(shard: int, ts: list, ack: str):
            entries = [(t, FragmentMeta.of(f), f) for t, f in ((t, make_fragment(0)) for t in ts)]
            return shards[shard].add_many.remote(entries, producer=shard, ack=ack)

        assert _ray.get([add(0, tickets[0:2], "held"), add(1, tickets[2:4], "held")]) == [[True] * 2] * 2
        deadline = time.monotonic() + 20
        while _ray.get(board.stats.remote())["fragments_stored"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        st = _ray.get(board.stats.remote())
        assert st["fragments_stored"] == 4, st
        # Carried by the relay's own call (nothing else to carry here, so it asks for no tickets and never waits).
        calls = st["board_calls"]
        assert calls.get("stored", 0) == calls.get("stored_many", 0) == 0 and 1 <= calls["relay_confirms"] <= 2, st
        assert _ray.get(relay.stats.remote())["calls"]["stored"] == 2
        _ray.kill(relay)
        t0 = time.monotonic()
        assert _ray.get([add(0, tickets[4:6], "confirmed"), add(1, tickets[6:8], "confirmed")],
                        timeout=30) == [[True] * 2] * 2
        assert time.monotonic() - t0 < 10
        st = _ray.get(board.stats.remote())
        assert st["fragments_stored"] == 8 and st["rejected"] == 0 and st["board_calls"]["stored"] >= 1, st
        assert [_ray.get(s.stats.remote())["relayed_calls"] for s in shards] == [1, 1]
    finally:
        for a in (*shards, relay, board):
            _ray.kill(a)


def test_the_relays_calls_together_keep_to_the_boards_budget_however_many_relays_there_are(ray_local):
    """Four relays whose shards confirm urgently without pause (each relay would call the board every ~20 ms, its
    short clock: ~200 calls a second together). The board gives them a budget of 8 calls a second (4 relays: each
    told 0.5 s apart): in 3 s they make at most that budget's calls (and a first call each, before they were told),
    and every confirmation is still answered and counted once."""
    from pipeline.protocol import RELAY_ID_BASE
    from pipeline.relay import NodeRelay
    from pipeline.supply import SupplyBoard

    budget, seconds, n = 8.0, 3.0, 4
    board = SupplyBoard.remote(100_000, 0, n, expected_actors=1, relay_calls_per_s=budget)
    relays = [NodeRelay.remote(board, RELAY_ID_BASE + k) for k in range(n)]
    try:
        _ray.get(board.publish.remote(Publish(0, [_ray.put({})])))
        tickets, _, _ = _ray.get(board.poll.remote(Poll(0, 0, 0, 0, 0, [], 0.0, max_tickets=4000)))
        assert len(tickets) == 4000
        answers, waits = [[] for _ in range(n)], []

        def shard(k: int, stop: float) -> None:
            mine = iter(tickets[n + k::n])  # (tickets[k] went before the window)
            while time.monotonic() < stop:
                chunk = [next(mine), next(mine)]
                t0 = time.monotonic()
                answers[k].extend(_ray.get(relays[k].stored.remote(Stored(chunk, k, True)), timeout=30))
                waits.append(time.monotonic() - t0)

        # Every relay calls once (and is counted by the board) before the measured window.
        _ray.get([r.stored.remote(Stored([tickets[k]], k, True)) for k, r in enumerate(relays)], timeout=30)
        st0 = _ray.get(board.stats.remote())
        stop = time.monotonic() + seconds
        threads = [threading.Thread(target=shard, args=(k, stop)) for k in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        st = _ray.get(board.stats.remote())
        calls = {k: st["board_calls"].get(k, 0) - st0["board_calls"].get(k, 0) for k in ("relay_poll", "stored_many")}
        # A first call each at the start, and the window read half an interval late at most (a call just out).
        assert sum(calls.values()) <= budget * (seconds + 0.5) + n, calls  # without the interval: ~100 or more
        assert sum(calls.values()) >= 2 * n, calls  # each relay kept calling at its interval
        sent = sum(len(a) for a in answers)
        assert all(all(a) for a in answers) and sent > 0, answers
        assert st["fragments_stored"] == sent + n and st["rejected"] == 0, st
        assert max(waits) < 0.5 + 2.5, max(waits)  # an interval (0.5 s), and a round trip on a loaded machine
    finally:
        for a in (*relays, board):
            _ray.kill(a)


def _fragments(tickets):
    from pipeline.fragment import FragmentMeta
    from tests.test_replay import make_fragment

    return [(t, FragmentMeta.of(f), f) for t, f in ((t, make_fragment(0)) for t in tickets)]


def test_a_relay_carries_its_shards_confirmations_in_the_calls_it_makes_for_tickets(ray_local):
    """Four local actors taking tickets through the relay while the node's two shards confirm what they add: the
    relay's one call a pace carries both (``relay_poll`` with the confirmations; ``stored_many`` only for one that
    came while a ticket call was out), so the board sees the ticket clock's calls, not that plus the confirmations'
    clock."""
    from pipeline.protocol import RELAY_ID_BASE
    from pipeline.relay import NodeRelay
    from pipeline.replay import ReplayShard
    from pipeline.supply import SupplyBoard

    board = SupplyBoard.remote(100_000, 0, 2, expected_actors=4)  # no update reaches its tail: no short clocks
    relay = NodeRelay.remote(board, RELAY_ID_BASE)
    shards = [ReplayShard.remote(i, 100_000, board, relay=relay) for i in range(2)]
    try:
        _ray.get([board.register_shard.remote(i, s) for i, s in enumerate(shards)])
        _ray.get(board.publish.remote(Publish(0, [_ray.put({})])))
        stop, added = time.monotonic() + 4.0, [0] * 4

        def actor(a: int) -> None:
            while time.monotonic() < stop:
                tickets, _, _ = _ray.get(relay.poll.remote(Poll(a, 0, 0, a % 2, 0, [], 2.0, max_tickets=4)), timeout=30)
                if tickets:
                    _ray.get(shards[a % 2].add_many.remote(_fragments(tickets), producer=a, ack="held"), timeout=30)
                    added[a] += len(tickets)
                time.sleep(0.05)

        threads = [threading.Thread(target=actor, args=(a,)) for a in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        deadline = time.monotonic() + 20
        while _ray.get(board.stats.remote())["fragments_stored"] < sum(added) and time.monotonic() < deadline:
            time.sleep(0.05)
        st = _ray.get(board.stats.remote())
        calls = st["board_calls"]
        assert st["fragments_stored"] == sum(added) > 40 and st["rejected"] == 0, (st, added)
        # ~10 paces a second carry them; apart only when one came while a ticket call was out (slow on a busy
        # machine). The relay before this sent every one apart: ~3 stored_many a second, no relay_confirms.
        assert calls.get("stored", 0) == 0, calls
        assert calls.get("relay_confirms", 0) >= max(3, 2 * calls.get("stored_many", 0)), calls
    finally:
        for a in (*shards, relay, board):
            _ray.kill(a)


def _every_ticket_out(pace_s: float):
    """A board of 4 tickets an update at lag 0, a relay (``pace_s``) and its node's shard: actor 0 takes all 4
    through the relay, actor 1 then waits there for more. Returns (board, relay, shard, the 4 tickets, actor 1's
    poll)."""
    from pipeline.protocol import RELAY_ID_BASE
    from pipeline.relay import NodeRelay
    from pipeline.replay import ReplayShard
    from pipeline.supply import SupplyBoard

    board = SupplyBoard.remote(4, 0, 1)
    relay = NodeRelay.remote(board, RELAY_ID_BASE, pace_s=pace_s)
    shard = ReplayShard.remote(0, 16, board, relay=relay)
    try:
        _ray.get(board.register_shard.remote(0, shard))
        _ray.get(board.publish.remote(Publish(0, [_ray.put({})])))
        tickets, _, _ = _ray.get(relay.poll.remote(Poll(0, 0, 0, 0, 0, [], 5.0, max_tickets=4)), timeout=30)
        assert len(tickets) == 4
        waiting = relay.poll.remote(Poll(1, 0, 0, 0, 0, [], 20.0, max_tickets=4))  # none left: it waits
        deadline = time.monotonic() + 10
        while _ray.get(relay.stats.remote())["waiting"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
    except BaseException:
        for a in (shard, relay, board):
            _ray.kill(a)
        raise
    return board, relay, shard, tickets, waiting


def test_a_confirmation_does_not_wait_behind_a_relay_call_parked_for_tickets(ray_local):
    """Every ticket is out and a local actor waits for more, so the relay's call waits at the board (up to
    BOARD_WAIT_S) for the next publish. A shard's confirmation that a producer waits for goes up on its own
    meanwhile (``stored_many``) instead of waiting for that call to come back."""
    from pipeline.protocol import BOARD_WAIT_S, RELAY_PACE_S

    board, relay, shard, tickets, waiting = _every_ticket_out(RELAY_PACE_S)
    try:
        time.sleep(0.3)  # the relay's call is at the board, waiting for tickets
        t0 = time.monotonic()
        assert _ray.get(shard.add_many.remote(_fragments(tickets), producer=0, ack="confirmed"),
                        timeout=30) == [True] * 4
        assert time.monotonic() - t0 < BOARD_WAIT_S / 2, time.monotonic() - t0
        calls = _ray.get(board.stats.remote())["board_calls"]
        assert calls["stored_many"] == 1 and calls.get("stored", 0) == 0, calls
        _ray.get(board.publish.remote(Publish(1, [_ray.put({})])))  # the waiting actor's tickets (its share of the pool)
        assert _ray.get(waiting, timeout=30)[0]
    finally:
        for a in (shard, relay, board):
            _ray.kill(a)


def test_a_relay_whose_actors_wait_for_tickets_takes_them_when_freed_also_while_its_shards_confirm(ray_local):
    """Every ticket is out and a local actor waits when the node's shard confirms the fragments made: the relay's
    call carries that confirmation (it may not wait at the board) and comes back with no ticket. Its next call
    waits at the board for tickets at once, so the actor has the next update's tickets moments after the publish,
    not a relay pace (3 s here) later."""
    board, relay, shard, tickets, waiting = _every_ticket_out(3.0)
    try:
        deadline = time.monotonic() + 10
        assert _ray.get(shard.add_many.remote(_fragments(tickets), producer=0, ack="held"), timeout=30) == [True] * 4
        while _ray.get(board.stats.remote())["fragments_stored"] < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        calls = _ray.get(relay.stats.remote())["calls"]
        assert calls.get("carried_confirms", 0) == 1, calls  # the call that came back with no ticket
        time.sleep(0.3)
        t0 = time.monotonic()
        _ray.get(board.publish.remote(Publish(1, [_ray.put({})])))
        assert _ray.get(waiting, timeout=30)[0]
        assert time.monotonic() - t0 < 1.0, time.monotonic() - t0
    finally:
        for a in (shard, relay, board):
            _ray.kill(a)
