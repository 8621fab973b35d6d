"""The control plane's protocol (pipeline/protocol.py): one table of clocks and limits that every module reads, the
orders between them that their invariants need, the typed messages, and the two rules (fair share, active window)
that the supply board and the node relays share. No Ray: each test takes well under a second."""

import ast
import re
from pathlib import Path

import pytest

from pipeline import protocol as P
from pipeline.protocol import (LIMITS, SCALE_MECHANISMS, ActiveWindow, Claim, Part, Poll, PollAnswer, RelayAnswer,
                               RelayPoll, Stored, Ticket, WeightsNews, block_size, fair_share, message)
from pipeline.relay import TicketRelay
from pipeline.supply import TicketLedger, keep_report

ROOT = Path(__file__).resolve().parent.parent
#: The modules of the control plane: their clocks and limits are the protocol's.
CONTROL_PLANE = ("pipeline/supply.py", "pipeline/relay.py", "pipeline/replay.py", "pipeline/feed.py",
                 "actors/rollout.py")


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _module_constants(path: Path) -> list[str]:
    """Upper-case names a module assigns a literal number to at its top level (a clock or limit of its own)."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                names = target.elts if isinstance(target, ast.Tuple) else [target]
                for n in names:
                    if isinstance(n, ast.Name) and n.id.isupper() and not n.id.startswith("_"):
                        out.append(n.id)
    return out


def test_every_clock_and_limit_of_the_control_plane_is_defined_once_in_the_protocol():
    for rel in CONTROL_PLANE:
        assert _module_constants(ROOT / rel) == [], f"{rel} defines clocks or limits of its own"
    # Below cluster/, a module takes a clock from the protocol, never from another module of the control plane.
    modules = {rel[:-3].replace("/", ".") for rel in CONTROL_PLANE}
    for package in ("pipeline", "actors", "learner"):
        for path in (ROOT / package).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module in modules:
                    clocks = [a.name for a in node.names if a.name in LIMITS]
                    assert not clocks, f"{path.relative_to(ROOT)} imports {clocks} from {node.module}"


def test_every_entry_of_the_table_names_its_value_invariant_and_a_test_that_exists():
    assert len(LIMITS) >= 35
    for name, limit in LIMITS.items():
        assert getattr(P, name) == limit.value and limit.name == name
        assert limit.unit and limit.keeper and len(limit.invariant) > 40, name
        path, _, test = limit.test.partition("::")
        assert re.search(rf"^def {test}\(", (ROOT / path).read_text(), re.M), f"{name}: {limit.test} not found"


def test_the_clocks_keep_the_order_their_invariants_need():
    from cluster.control import MAX_ROLLOUT_ACTORS
    from cluster.supervisor import SILENT_S

    # A confirmation a shard sends again (after RELAY_CONFIRM_S) is still told from a late copy.
    assert P.DONE_KEPT_S > 2 * P.RELAY_CONFIRM_S and P.DONE_MIN_KEPT <= P.DONE_KEPT
    # No healthy fragment outlives the smallest lease: its block, then the slowest path of its confirmation.
    assert P.LEASE_FLOOR_S > P.BLOCK_S + P.STORED_PACE_S + P.CONFIRM_GATHER_S + P.RELAY_INTERVAL_MAX_S
    # An actor parked at the board (or a relay's call parked there) still counts in the fair share.
    assert P.ACTIVE_WINDOW_S > max(P.TICKET_WAIT_S, P.BOARD_WAIT_S)
    # The driver hears from every actor, directly or through its relay, before the supervisor's health call.
    assert max(P.TICKET_WAIT_S, P.REPORT_EVERY_S, P.RELAY_INTERVAL_MAX_S) < SILENT_S
    assert P.RELAY_INTERVAL_MAX_S <= P.REPORT_EVERY_S
    # The short clock is shorter than the pace; a producer between two adds is still waited for.
    assert P.STORED_GATHER_S < min(P.STORED_PACE_S, P.CONFIRM_GATHER_S) and P.PRODUCER_ACTIVE_S > P.STORED_PACE_S
    # A wait is cut in slices; a stopped relay costs its wait once per retry.
    assert P.BOARD_SLICE_S < P.TICKET_WAIT_S and P.RELAY_CONFIRM_S < P.SHARD_RELAY_RETRY_S
    assert P.RELAY_ID_BASE > MAX_ROLLOUT_ACTORS


def test_a_message_is_one_instance_never_loose_fields_and_an_answer_is_read_by_name():
    poll = Poll(3, 1, 7, 0, 2, [], 2.0, max_tickets=4)
    assert message(Poll, (poll,), {}) is poll
    # Loose fields are refused, in full or in part: their order is the caller's belief, not the receiver's.
    for args, kwargs in [((3, 1, 7, 0, 2, [], 2.0), {"max_tickets": 4}), ((3, 1, 7), {}), ((), {"actor_id": 3}),
                         ((poll,), {"wait_s": 1.0}), ((Claim(0, 1, 2, 0.5, []),), {})]:
        with pytest.raises(TypeError, match="expected one Poll message"):
            message(Poll, args, kwargs)
    with pytest.raises(TypeError):
        Claim(0, 1, 2, 0.5, [], min_item=2)  # an unknown field is an error where the message is made
    answer = PollAnswer([], WeightsNews(4, ["w"]), None)
    tickets, news, change = answer  # unpacks as the tuple it replaces
    assert news.version == 4 and change is None and tickets == []
    assert Stored([1], 2) == Stored(tickets=[1], shard=2, urgent=False)
    assert RelayPoll._fields[-1] == "confirms" and RelayAnswer._fields[-1] == "interval_s"


def test_the_active_window_counts_weights_and_forgets_the_quiet():
    clock = Clock()
    window = ActiveWindow(P.ACTIVE_WINDOW_S, clock=clock)
    window.saw("actor 1")
    window.saw("relay", weight=12)
    assert window.count() == 13 and len(window) == 2
    clock.t = P.ACTIVE_WINDOW_S - 0.1
    window.saw("actor 2")
    assert window.count() == 14
    clock.t = P.ACTIVE_WINDOW_S + 0.1  # actor 1 and the relay went quiet
    assert window.count() == 1 and window.members() == {"actor 2"}
    window.forget("actor 2")
    assert window.count() == 0


def test_the_board_and_a_relay_give_the_same_fair_share():
    assert [fair_share(10, 1, a) for a in (1, 3, 4, 10, 11)] == [10, 4, 3, 1, 1]
    assert fair_share(10, 4, 12) == 4 and fair_share(0, 1, 3) == 0 and fair_share(5, 0, 0) == 5
    # The board: 10 free tickets, 3 actors asking, one asks for 16.
    led = TicketLedger(per_update=10, max_policy_lag=0)
    led.publish(0)
    assert len(led.request_block(0, 0, 0, 16, active_actors=3)) == fair_share(10, 1, 3)
    # A relay: 10 pooled tickets, 3 of its actors asking lately, one asks for 16.
    relay = TicketRelay(P.RELAY_ID_BASE)
    relay.pool.extend((Ticket(i, 0, 0, P.RELAY_ID_BASE, 0), float("inf")) for i in range(10))
    for a in range(3):
        relay.seen.saw(a)
    assert len(relay.take(0, 0, 0, 16)) == fair_share(10, 1, 3)


def test_a_block_is_about_block_s_of_fragments_within_its_bounds():
    assert block_size(None, 8) == 1  # no fragment time measured yet
    assert block_size(P.BLOCK_S / 10, 8) == 10
    assert block_size(P.BLOCK_S / 1000, 8) == P.TICKETS_PER_POLL
    assert block_size(P.BLOCK_S / 1000, 4 * P.TICKETS_PER_POLL) == 4 * P.TICKETS_PER_POLL  # one full add
    assert block_size(5 * P.BLOCK_S, 1) == 1


def test_an_actors_reports_keep_every_episode_up_to_the_bound():
    reports = {}
    keep_report(reports, 7, 0, {"episodes": list(range(P.MAX_REPORTED_EPISODES - 5))})
    keep_report(reports, 7, 0, {"episodes": list(range(10))})
    episodes = reports[7][1]["episodes"]
    assert len(episodes) == P.MAX_REPORTED_EPISODES and episodes[-10:] == list(range(10))  # the oldest went first
    keep_report(reports, 7, 1, {"episodes": [1]})  # a new incarnation starts afresh
    assert reports[7] == (1, {"episodes": [1]})


def test_a_claims_answer_is_a_part_per_shard():
    tickets = [Ticket(1, 0, 0, 0, 0)]
    epoch, got = Part(3, tickets)  # split_claims and the feed unpack it as (directory epoch, tickets)
    assert epoch == 3 and got is tickets


def test_the_protocol_page_names_every_state_message_clock_and_switch():
    page = (ROOT / "docs" / "protocol.md").read_text()
    names = list(LIMITS) + list(P.STATES) + list(SCALE_MECHANISMS)
    names += [n for n, v in vars(P).items() if isinstance(v, type) and issubclass(v, tuple) and v is not tuple]
    missing = [n for n in names if not re.search(rf"\b{re.escape(n)}\b", page)]
    assert not missing, missing
    assert P.limits_table() in page, "docs/protocol.md: the clocks table is not the code's (python -m pipeline.protocol)"
