"""The control plane's protocol in one place: the ticket states, every message that crosses a process, every clock
and limit, and the two rules the supply board and the node relays share (the fair share, the active window).

A fragment is made only against a ticket, and a ticket names the learner update that will train on it
(``pipeline/supply.py``). The processes that move tickets:

* a rollout actor polls the supply board (or its node's relay) for a block of tickets (``poll``), and adds what it
  made to its node's replay shard;
* a replay shard confirms what it holds with the board (``stored``; through its node's relay when it has one);
* a node relay asks the board for its actors' blocks and carries their reports and its shards' confirmations up in
  one call (``relay_poll``);
* a learner's feed claims stored fragments of the update it prepares (``claim``) and takes them from the shards.

Every message is a NamedTuple: a field is read by name in the process that receives it, so a field added in one
process cannot be misread in another, and a call takes one instance, never loose fields (``message``). Answers
also unpack as tuples (``tickets, news, change = board.poll.remote(poll)``). ``docs/protocol.md`` is the page that reads with this module: the states, the message
table, a fragment's life and the mechanisms that exist for scale only.

Every clock and limit of the control path (the protocol's, the driver's and its supervisor's, Ray's start-up, the
learners' and the actors' waits) is defined here with ``_limit``: its value, its unit, who keeps it, the invariant
it protects and the test that holds it. ``LIMITS`` is that table; the modules of the control path import their
clocks from here, never from each other, and write none as a number (``tests/test_protocol.py`` holds all three).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, NamedTuple

# ---------------------------------------------------------------------------------------------------- ticket states
#: A ticket moves pending -> issued (to a rollout actor or a node relay) -> stored (in a shard) -> claimed (by a
#: learner), and back to pending when its fragment is lost (its actor, shard, add or learner died, or its lease ran
#: out). Finished tickets (their update trained) are forgotten; skipped ones (a learner-group restart) are void.
PENDING, ISSUED, STORED, CLAIMED = "pending", "issued", "stored", "claimed"
STATES = (PENDING, ISSUED, STORED, CLAIMED)
#: Every move of the ledger and the call that makes it: (from, to, call).
MOVES = (
    (PENDING, ISSUED, "poll / relay_poll (TicketLedger.request_block)"),
    (ISSUED, STORED, "stored / stored_many / relay_poll's confirms (TicketLedger.stored)"),
    (STORED, CLAIMED, "claim (TicketLedger.claim)"),
    (ISSUED, PENDING, "a failed add, the actor gone, its lease expired, a learner-group restart"),
    (STORED, PENDING, "its shard lost, a learner-group restart"),
    (CLAIMED, PENDING, "a failed take (claim's failed), a learner-group restart"),
)


@dataclass(frozen=True)
class Ticket:
    """The right to produce one fragment for learner update ``update``, with a policy >= ``min_version``."""

    id: int
    update: int
    min_version: int
    actor_id: int
    incarnation: int
    issue: int = 0  # serial of this issuance: a refunded ticket issued again is a different key in a shard
    issued_at: float = 0.0  # the board's clock at issue: where its lease runs from, and the measured fragment time


# ---------------------------------------------------------------------------------------------------- messages
class WeightsNews(NamedTuple):
    """Newer policy weights: ``ref_box`` is [weights or their ObjectRef, (self-play) pool]."""

    version: int
    ref_box: list


class ShardChange(NamedTuple):
    """An actor's shard was replaced: the new one's incarnation and handle."""

    incarnation: int
    handle: Any


class Poll(NamedTuple):
    """Rollout actor -> supply board or node relay: settle the last block, ask for the next.

    ``failed``: tickets of adds that failed (their shard died); ``wait_s``: how long the call may park for a ticket;
    ``want_ticket=False``: the actor's shard died, wait for its replacement; ``max_tickets``: the block asked for
    (the answer is at most a fair share); ``report``: the actor's stats, with the episodes it finished."""

    actor_id: int
    incarnation: int
    seen_version: int
    shard_index: int
    shard_incarnation: int
    failed: list
    wait_s: float = 0.0
    want_ticket: bool = True
    max_tickets: int = 1
    report: dict | None = None


class PollAnswer(NamedTuple):
    """Board or relay -> rollout actor: a block (maybe empty), newer weights (or None) and a replaced shard (or
    None). The tickets are for the policy the actor holds once it loads ``news``."""

    tickets: list
    news: WeightsNews | None
    shard_change: ShardChange | None


class Stored(NamedTuple):
    """Replay shard -> board (or its node's relay): it holds these tickets' fragments. ``urgent`` (to a relay): a
    producer waits for the answer, an add for room, or a ticket is of an update at its tail (the short clock)."""

    tickets: list
    shard: int
    urgent: bool = False


class Gone(NamedTuple):
    """A rollout actor died or was removed (``seq``: the board's count of deaths, what a relay has read up to)."""

    seq: int
    actor_id: int
    incarnation: int


class ShardDirectory(NamedTuple):
    """Every shard's (incarnation, handle), as of the board's ``directory_version``."""

    directory_version: int
    shards: list


class RelayPoll(NamedTuple):
    """Node relay -> supply board: everything the relay carries up, and the block it asks for its actors.

    ``confirms``: its shards' confirmations ([Stored], taken first: a claim may wait for them); ``failed`` and
    ``reports``: its actors' failed adds and stats ({actor id: (incarnation, stats)}); ``max_tickets`` for
    ``weight`` active actors (0: no tickets wanted), parked up to ``wait_s``; ``directory_version`` and
    ``gone_seen``: what it knows of the shard directory and of the actors gone."""

    relay_id: int
    incarnation: int
    seen_version: int
    failed: list
    wait_s: float
    max_tickets: int
    reports: dict
    directory_version: int
    gone_seen: int
    weight: int
    confirms: tuple = ()


class RelayAnswer(NamedTuple):
    """Supply board -> node relay: the block, newer weights, the shard directory when it changed since
    ``directory_version`` (else None), the actors gone since ``gone_seen``, the ticket lease, one answer per
    confirmation (a list of booleans each, as ``stored``'s) and the least interval before the relay's next call (the
    budget)."""

    tickets: list
    news: WeightsNews | None
    shards: ShardDirectory | None
    gone: list
    lease_s: float
    confirmed: list
    interval_s: float


class Entry(NamedTuple):
    """Rollout actor -> replay shard (``add_many``: a list of them): one fragment, its meta and its ticket."""

    ticket: Ticket
    meta: Any
    fragment: Any


class Taken(NamedTuple):
    """Replay shard -> learner feed (``take``'s answer): (meta, fragment) of each claimed ticket it holds, in the
    claim's order, and the tickets it does not hold (their fragments are made again)."""

    items: list
    missing: list


class Claim(NamedTuple):
    """Learner feed -> supply board: up to ``max_items`` stored fragments of ``update``, as soon as ``min_items``
    are stored (a part after ``wait_s``); ``failed``: claimed tickets whose take failed (made again);
    ``generation``: the learner group's (a replaced group's claims get nothing)."""

    rank: int
    update: int
    max_items: int
    wait_s: float
    failed: list
    generation: int = 0
    min_items: int = 1


class Part(NamedTuple):
    """One shard's share of a claim's answer ({shard index: Part}): which tickets, and the board's shard directory
    version when it answered (the feed takes them from that shard's handle in a directory at least that new). No
    actor handle: Ray keeps ~400 B in the answering process for each answer carrying a handle it goes on holding,
    for as long as it holds it (bench/ray_call_memory.py), and a claim is answered every update."""

    directory_version: int
    tickets: list


class Publish(NamedTuple):
    """Learner rank 0 -> supply board: policy ``version`` is out, ``ref_box`` is [weights or their ObjectRef,
    (self-play) pool]; ``generation``: the learner group's (a replaced group's publishes are ignored)."""

    version: int
    ref_box: list
    generation: int = 0


class ActorGone(NamedTuple):
    """Driver -> supply board: rollout actor ``actor_id``'s incarnation ``incarnation`` died or was removed; the
    tickets it held go back to pending (the answer is how many), and the relays hear of it (``Gone``)."""

    actor_id: int
    incarnation: int


class WeightsWait(NamedTuple):
    """Rollout actor -> supply board: newer weights than ``seen_version`` (a ``WeightsNews``), parked up to
    ``wait_s`` for them (None when none came)."""

    seen_version: int
    wait_s: float


class Assignment(NamedTuple):
    """Learner rank 0's feed -> another rank's learner actor: that rank's ``part`` of a group claim of ``update``
    ({shard index: Part}; None: the rank claims its part itself), made on the board named ``board_key``."""

    board_key: str
    update: int
    part: dict | None


def message(cls, args: tuple, kwargs: dict):
    """The ``cls`` message a call was given, which must be one instance of it: loose fields, in an order the
    caller believes in, are how a field added on one side is misread on the other, so they are a TypeError."""
    if len(args) == 1 and not kwargs and isinstance(args[0], cls):
        return args[0]
    got = ", ".join([type(a).__name__ for a in args] + [f"{k}=" for k in kwargs]) or "nothing"
    raise TypeError(f"expected one {cls.__name__} message, got {got}")


# ---------------------------------------------------------------------------------------------------- the two rules
def fair_share(free: int, weight: int, active: int) -> int:
    """A holder's fair share of ``free`` tickets: ``ceil(free * weight / active)``, where ``weight`` is the actors
    it asks for (a node relay asks for its active actors; an actor for itself) and ``active`` the actors asking
    lately (``ActiveWindow``). The board's blocks, the wake-ups of its parked polls and a relay's hand-outs to its
    actors are all this share."""
    return -(-free * max(1, weight) // max(1, active))


class ActiveWindow:
    """Who asked lately: a member counts for ``window_s`` after it was last seen, with the weight it was seen with
    (a node relay counts as the actors it asks for). The denominator of every fair share, and the set of producers
    a shard's confirmation waits for."""

    def __init__(self, window_s: float, clock=time.monotonic):
        self.window_s, self.clock = window_s, clock
        self._seen: dict = {}  # member -> (when last seen, weight)

    def saw(self, member, weight: int = 1) -> None:
        self._seen[member] = (self.clock(), weight)

    def forget(self, member) -> None:
        self._seen.pop(member, None)

    def members(self) -> set:
        """The members seen within the window (the older ones are forgotten here)."""
        limit = self.clock() - self.window_s
        for m in [m for m, (t, _) in self._seen.items() if t < limit]:
            del self._seen[m]
        return set(self._seen)

    def count(self) -> int:
        """The weights of the members seen within the window, summed."""
        self.members()
        return sum(w for _, w in self._seen.values())

    def __len__(self) -> int:
        return len(self.members())


# ---------------------------------------------------------------------------------------------------- clocks, limits
@dataclass(frozen=True)
class Limit:
    """One clock or limit of the protocol: ``keeper`` is the process that acts on it."""

    name: str
    value: float
    unit: str
    keeper: str
    invariant: str
    test: str  # tests/file.py::test_name


LIMITS: dict[str, Limit] = {}


def _limit(name: str, value, unit: str, keeper: str, invariant: str, test: str):
    LIMITS[name] = Limit(name, value, unit, keeper, invariant, test)
    return value


# The ledger (supply board).
DONE_KEPT_S = _limit(
    "DONE_KEPT_S", 60.0, "s", "board",
    "a trained ticket is remembered this long after its update finished, so a confirmation a shard sends again "
    "(at most RELAY_CONFIRM_S after its relay carried it up) is told from a late copy of a refunded ticket; "
    "> RELAY_CONFIRM_S with room for a loaded host's queues",
    "tests/test_bounded.py::test_the_ledger_forgets_finished_tickets_once_no_confirmation_sent_again_can_name_them")
DONE_MIN_KEPT = _limit(
    "DONE_MIN_KEPT", 1 << 12, "tickets", "board",
    "the newest trained tickets kept whatever their age (a burst, or a ledger on a model's clock)",
    "tests/test_bounded.py::test_the_ledger_forgets_finished_tickets_once_no_confirmation_sent_again_can_name_them")
DONE_KEPT = _limit(
    "DONE_KEPT", 1 << 16, "tickets", "board",
    "never more trained tickets than this (~10 MB): what the ledger holds follows the fragment rate, not the run's "
    "length (5 s of 5,000 fragments a second fit)",
    "tests/test_bounded.py::test_the_supply_board_keeps_what_is_in_flight_not_what_a_run_made")
LEASE_MEDIANS = _limit(
    "LEASE_MEDIANS", 4.0, "medians", "board",
    "the automatic lease (rollout.fragment_timeout_s: auto) is this many medians of the issue-to-store time: a "
    "healthy block is stored well inside it, a hung or 10x slower actor loses its tickets to the others",
    "tests/test_supply.py::test_the_automatic_lease_follows_the_median_fragment_time_with_a_floor")
LEASE_SAMPLES = _limit(
    "LEASE_SAMPLES", 64, "fragments", "board",
    "the median is over the newest fragments only: the lease follows the env's speed as it changes",
    "tests/test_supply.py::test_the_automatic_lease_follows_the_median_fragment_time_with_a_floor")
LEASE_FLOOR_S = _limit(
    "LEASE_FLOOR_S", 10.0, "s", "board",
    "no lease is shorter: at start-up and on a loaded host no healthy block loses its tickets; > the longest a "
    "fragment waits for the clocks to be confirmed (STORED_PACE_S + CONFIRM_GATHER_S + RELAY_INTERVAL_MAX_S)",
    "tests/test_supply.py::test_the_automatic_lease_follows_the_median_fragment_time_with_a_floor")
LEASE_CHECK_S = _limit(
    "LEASE_CHECK_S", 0.5, "s", "board",
    "expired leases are found this often while nobody calls: an update's last ticket held by a hung actor goes to "
    "a parked poll within a lease and this, though a parked poll only wakes on a change",
    "tests/test_supply.py::test_one_hung_actor_of_two_loses_its_tickets_to_the_other_at_lag_0")
BOARD_SPARE_CALLS = _limit(
    "BOARD_SPARE_CALLS", 64, "calls", "board",
    "the board's max_concurrency is every call that can be parked at once plus this: a call that makes progress "
    "(stored, publish, the driver's stats) never queues behind parked polls",
    "tests/test_supply.py::test_the_boards_concurrency_leaves_room_for_progress_beside_a_thousand_parked_polls")
MAX_REPORTED_EPISODES = _limit(
    "MAX_REPORTED_EPISODES", 10_000, "episodes", "board, relay",
    "the finished episodes kept per actor between two reads of the driver: bounded if nobody reads",
    "tests/test_protocol.py::test_an_actors_reports_keep_every_episode_up_to_the_bound")
MAX_GONE_KEPT = _limit(
    "MAX_GONE_KEPT", 10_000, "deaths", "board",
    "actor deaths remembered for the relays (each reads those after its last call): a relay hears of every death "
    "among the last this many, whose lent tickets go back as failed adds",
    "tests/test_relay.py::test_a_killed_actors_lent_tickets_go_back_through_its_relay_not_its_lease")

# The fair share.
ACTIVE_WINDOW_S = _limit(
    "ACTIVE_WINDOW_S", 5.0, "s", "board, relay",
    "an actor (a relay: its actors) counts in the fair share this long after its last poll; > TICKET_WAIT_S, so an "
    "idle actor parked at the board still counts, and a dead one stops counting within it",
    "tests/test_protocol.py::test_the_active_window_counts_weights_and_forgets_the_quiet")

# Tickets (rollout actor).
TICKET_WAIT_S = _limit(
    "TICKET_WAIT_S", 2.0, "s", "rollout actor",
    "a poll parks at most this long for a ticket (woken as soon as one it may take exists): an idle actor calls, "
    "and reports its stats, at least this often; < the supervisor's SILENT_S",
    "tests/test_supply.py::test_a_freed_ticket_wakes_about_one_parked_poll_not_all")
TICKETS_PER_POLL = _limit(
    "TICKETS_PER_POLL", 16, "tickets", "rollout actor",
    "the most tickets one poll asks for (never more than a fair share is given): board calls per fragment fall by "
    "up to this factor",
    "tests/test_protocol.py::test_a_block_is_about_block_s_of_fragments_within_its_bounds")
BLOCK_S = _limit(
    "BLOCK_S", 1.0, "s", "rollout actor",
    "a block is about this much of fragments: made well inside its tickets' lease (< LEASE_FLOOR_S), and one actor "
    "never sits on a long row of an update's tickets",
    "tests/test_protocol.py::test_a_block_is_about_block_s_of_fragments_within_its_bounds")
BOARD_SLICE_S = _limit(
    "BOARD_SLICE_S", 0.5, "s", "rollout actor",
    "a wait on the board is cut in slices of this: a replaced board and a stop are noticed within one",
    "tests/test_relay.py::test_a_replaced_board_is_attached_to_the_relays_and_the_actors_return_to_them")
RELAY_DEADLINE_S = _limit(
    "RELAY_DEADLINE_S", 5.0, "s", "rollout actor",
    "past its poll's own wait, an actor waits this long for its relay before it polls the board itself: a dead "
    "or stopped relay never stops its actors",
    "tests/test_relay.py::test_a_stopped_relay_leaves_its_actors_polling_the_board_and_the_run_goes_on")
ACTOR_RELAY_RETRY_S = _limit(
    "ACTOR_RELAY_RETRY_S", 10.0, "s", "rollout actor",
    "after its relay said it lost its board, an actor polls the board itself this long before trying the relay "
    "again (the driver attaches the replacement board to the relay meanwhile)",
    "tests/test_relay.py::test_a_replaced_board_is_attached_to_the_relays_and_the_actors_return_to_them")

# Confirmations (replay shard).
STORED_PACE_S = _limit(
    "STORED_PACE_S", 0.25, "s", "replay shard",
    "an add nobody waits for (ack='held') is confirmed at most this long after it came: a shard's stored calls a "
    "second follow this clock, not its producers",
    "tests/test_replay.py::test_held_adds_are_confirmed_on_the_pace_clock_and_an_updates_tail_at_once")
STORED_GATHER_S = _limit(
    "STORED_GATHER_S", 0.02, "s", "replay shard, relay",
    "the short clock: an urgent confirmation (a producer waits, an add waits for room, an update at its tail) "
    "waits at most this for the others to gather; a shard with one producer is never held back",
    "tests/test_replay.py::test_a_stored_call_gathers_the_adds_of_several_producers_and_never_holds_a_lone_one")
PRODUCER_ACTIVE_S = _limit(
    "PRODUCER_ACTIVE_S", 2.0, "s", "replay shard",
    "a gathering stored call waits only for the producers that added within this (a dead one is not waited for)",
    "tests/test_replay.py::test_a_stored_call_gathers_the_adds_of_several_producers_and_never_holds_a_lone_one")
RELAY_CONFIRM_S = _limit(
    "RELAY_CONFIRM_S", 5.0, "s", "replay shard",
    "a shard waits this long for its relay's answer, then confirms with the board itself (the same confirmation "
    "again is counted once: < DONE_KEPT_S)",
    "tests/test_relay.py::test_a_nodes_shards_confirm_through_its_relay_and_with_the_board_once_it_is_gone")
SHARD_RELAY_RETRY_S = _limit(
    "SHARD_RELAY_RETRY_S", 30.0, "s", "replay shard",
    "after its relay failed, a shard confirms with the board itself this long before trying the relay again: a "
    "stopped relay costs RELAY_CONFIRM_S once per retry, not per confirmation",
    "tests/test_relay.py::test_a_nodes_shards_confirm_through_its_relay_and_with_the_board_once_it_is_gone")
TAIL_FRACTION = _limit(
    "TAIL_FRACTION", 1 / 8, "of a batch", "board",
    "an update is at its tail (confirmed on the short clock, ReplayShard.hurry) when no more than this of its batch "
    "is left to store: pacing holds no batch back by more than the short clock",
    "tests/test_replay.py::test_held_adds_are_confirmed_on_the_pace_clock_and_an_updates_tail_at_once")
TAIL_PACES = _limit(
    "TAIL_PACES", 2, "paces", "board",
    "... or no more than the shards stored over this many STORED_PACE_S (what paced shards may hold unconfirmed)",
    "tests/test_supply.py::test_the_board_at_5000_fragments_a_second_for_1000_actors_and_64_learners_in_the_clocked_model")
TAIL_MIN = _limit(
    "TAIL_MIN", 16, "fragments", "board",
    "... or no more than this: an update this small is at its tail from the start, confirmed as it comes",
    "tests/test_replay.py::test_held_adds_are_confirmed_on_the_pace_clock_and_an_updates_tail_at_once")

# Node relays.
RELAY_ID_BASE = _limit(
    "RELAY_ID_BASE", 1 << 30, "id", "relay",
    "relay ids sit above every rollout actor id (> cluster.control.MAX_ROLLOUT_ACTORS): the ledger tells a relay's "
    "tickets from an actor's, and the board's reports never mix them up",
    "tests/test_protocol.py::test_the_clocks_keep_the_order_their_invariants_need")
RELAY_PACE_S = _limit(
    "RELAY_PACE_S", 0.1, "s", "relay",
    "a relay calls the board for tickets at most once a pace, asking for what its actors will take during one "
    "(so the pace is not a wait for them)",
    "tests/test_relay.py::test_a_relay_calls_the_board_at_most_once_a_pace_however_often_its_actors_ask")
DEMAND_WINDOW_S = _limit(
    "DEMAND_WINDOW_S", 2.0, "s", "relay",
    "a relay's demand ahead is what its actors took over this window: it asks for no more than a pace of it, so a "
    "pool holds no tickets idle actors on other nodes could be making",
    "tests/test_relay.py::test_a_relay_calls_the_board_at_most_once_a_pace_however_often_its_actors_ask")
CONFIRM_GATHER_S = _limit(
    "CONFIRM_GATHER_S", 0.1, "s", "relay",
    "a relay gathers its shards' confirmations this long (the short clock once one is urgent): one node's shards "
    "cost the board at most 1 / this calls a second",
    "tests/test_relay.py::test_a_relay_carries_its_shards_confirmations_in_the_calls_it_makes_for_tickets")
REPORT_EVERY_S = _limit(
    "REPORT_EVERY_S", 1.0, "s", "relay",
    "a relay with reports or failed adds to carry calls the board at least this often: the driver sees every "
    "actor's stats within the supervisor's SILENT_S",
    "tests/test_protocol.py::test_the_clocks_keep_the_order_their_invariants_need")
BOARD_WAIT_S = _limit(
    "BOARD_WAIT_S", 2.0, "s", "relay",
    "a relay's board call parks at most this long for tickets (it carries no confirmations then)",
    "tests/test_relay.py::test_a_confirmation_does_not_wait_behind_a_relay_call_parked_for_tickets")
RELAY_ANSWER_SLACK_S = _limit(
    "RELAY_ANSWER_SLACK_S", 10.0, "s", "relay",
    "a board that has not answered a relay's call within BOARD_WAIT_S and this is silent: the relay's actors and "
    "shards go to the board themselves",
    "tests/test_relay.py::test_a_stopped_relay_leaves_its_actors_polling_the_board_and_the_run_goes_on")
RELAY_CALLS_PER_S = _limit(
    "RELAY_CALLS_PER_S", 100.0, "calls/s", "board",
    "the relays' calls together, a second (rollout.relay_calls_per_s's default): each relay is told the least "
    "interval between its calls (relays / this), so the board's calls follow the budget, not the node count",
    "tests/test_relay.py::test_the_relays_calls_together_keep_to_the_boards_budget_however_many_relays_there_are")
RELAY_INTERVAL_MAX_S = _limit(
    "RELAY_INTERVAL_MAX_S", 1.0, "s", "board",
    "the interval the budget sets is never longer: a relay's reports and failed adds still go up every "
    "REPORT_EVERY_S",
    "tests/test_protocol.py::test_the_clocks_keep_the_order_their_invariants_need")

# Claims (learner feed).
CLAIM_WAIT_S = _limit(
    "CLAIM_WAIT_S", 2.0, "s", "learner feed",
    "a claim waits this long for its whole remaining batch (one claim per learner and update where batches are "
    "quick to make), then takes parts; waiting for a whole batch delays no update (it trains only once whole)",
    "tests/test_replay.py::test_a_feed_claims_a_batch_made_over_a_second_once")
CLAIM_PARTS = _limit(
    "CLAIM_PARTS", 4, "parts", "board",
    "after its wait a claim takes at least 1/this of what it asks for: a slow update's batch comes in a few "
    "claims, not one per wait, and the first takes overlap the making of the last",
    "tests/test_supply.py::test_a_claim_waits_for_its_whole_batch_and_takes_it_in_one_call")
CLAIM_PART_WAITS = _limit(
    "CLAIM_PART_WAITS", 4, "waits", "board",
    "... or whatever is stored this many waits later",
    "tests/test_supply.py::test_a_claim_waits_for_its_whole_batch_and_takes_it_in_one_call")
TAKE_TIMEOUT_S = _limit(
    "TAKE_TIMEOUT_S", 30.0, "s", "learner feed",
    "a take from a shard is given up after this (a live shard answers in milliseconds): a hung shard's claimed "
    "fragments go back in the next claim and are made again",
    "tests/test_replay.py::test_a_rank_whose_part_is_gone_from_its_shard_claims_the_replacements_itself")
BOARDS_KEPT = _limit(
    "BOARDS_KEPT", 4, "boards", "learner feed",
    "a rank's claim inbox remembers rank 0's lead on this many newest boards: the one it is on and the one before "
    "a replacement, with room for boards replaced in quick succession",
    "tests/test_bounded.py::test_a_learners_claim_inbox_remembers_the_newest_boards_only")

# The driver and its supervisor (cluster/). Their clocks bound the driver's waits on the actors of the run, so that
# no wait of the control path is without a deadline and each deadline sits inside the one above it.
SILENT_S = _limit(
    "SILENT_S", 3.0, "s", "supervisor",
    "a rollout actor whose stats have not come with a board poll for this long gets a health call of its own; a "
    "healthy one polls at least every TICKET_WAIT_S (REPORT_EVERY_S through its relay), so a stopped one is found "
    "within this and one ticket lease",
    "tests/test_env_faults.py::test_a_stopped_rollout_actor_and_a_stopped_replay_shard_are_replaced")
HEALTH_CALLS_PER_S = _limit(
    "HEALTH_CALLS_PER_S", 20.0, "calls/s", "supervisor",
    "the most health calls a second over all silent rollout actors and shards (a token bucket of one second's "
    "worth): the driver's calls stay bounded at any actor count",
    "tests/test_env_faults.py::test_a_stopped_rollout_actor_on_a_loaded_host_is_replaced_and_the_run_reaches_its_target")
BOARD_CALL_S = _limit(
    "BOARD_CALL_S", 30.0, "s", "supervisor",
    "the longest a driver call to the supply path's actors, the supply board and the replay shards, may take (they "
    "answer in milliseconds): one silent past min(this, run.stall_timeout_s / 3) is hung and replaced, before the "
    "learners give up on it; a new board's first answers, its start included, get max(this, run.stall_timeout_s)",
    "tests/test_env_faults.py::test_a_lost_supply_board_is_replaced_and_nothing_is_trained_twice")
CONTROL_CALL_S = _limit(
    "CONTROL_CALL_S", 30.0, "s", "supervisor",
    "the longest a driver call to the control actor may take (it holds only the rollout actor count and answers in "
    "milliseconds): one silent past min(this, run.stall_timeout_s / 3) is replaced, asking for the actors running "
    "now; the driver's loop waits on the call, so it is held no longer than by a board call",
    "tests/test_deadlines.py::test_a_control_actor_stopped_while_a_rescale_is_refused_is_replaced_and_the_run_goes_on")
LEARNER_PING_S = _limit(
    "LEARNER_PING_S", 5.0, "s", "supervisor",
    "a learner's health call is answered on a thread of its own within milliseconds when alive: one silent this long "
    "is stopped, and its group restarts",
    "tests/test_faults.py::test_a_killed_and_a_stopped_learner_restart_the_group_from_the_newest_checkpoint")
LEARNER_ALIVE_S = _limit(
    "LEARNER_ALIVE_S", 10.0, "s", "supervisor",
    "a failed iteration asks each learner for an empty call this long: one that does not answer is dead or "
    "unplaceable, and the group restarts instead of failing the run",
    "tests/test_faults.py::test_a_killed_and_a_stopped_learner_restart_the_group_from_the_newest_checkpoint")
SCALE_DOWN_STOP_S = _limit(
    "SCALE_DOWN_STOP_S", 10.0, "s", "supervisor",
    "a rollout actor removed by a scale-down delivers the fragment in hand within this, so nothing is made again; "
    "a stuck one is killed after it and its tickets refunded",
    "tests/test_faults.py::test_rollout_actors_scale_up_and_down_while_running")
SCALE_DOWN_WAIT_S = _limit(
    "SCALE_DOWN_WAIT_S", 15.0, "s", "supervisor",
    "the driver waits this long for the removed actors' stop calls together: > SCALE_DOWN_STOP_S, so a healthy "
    "actor's stop answers before the kill",
    "tests/test_faults.py::test_rollout_actors_scale_up_and_down_while_running")
SHUTDOWN_STOP_S = _limit(
    "SHUTDOWN_STOP_S", 2.0, "s", "rollout actor",
    "at the run's end a rollout actor's stop waits this long for the fragment in hand (RolloutActor.stop's default): "
    "the driver kills it after, so a loop blocked in its env is not waited for longer",
    "tests/test_integration.py::test_full_graph_runs_writes_metrics_and_checkpoint_and_leaves_no_actor")
HEALTH_CHECK_S = _limit(
    "HEALTH_CHECK_S", 1.0, "s", "driver",
    "the longest the driver waits on its learners before it looks at the other actors: a death anywhere is seen "
    "within this, whatever an iteration takes",
    "tests/test_faults.py::test_killed_rollout_actor_and_replay_shard_are_replaced_and_the_run_goes_on")
ITERATION_GRACE_S = _limit(
    "ITERATION_GRACE_S", 30.0, "s", "driver",
    "a learner reports its own stall after run.stall_timeout_s; the driver gives up on an iteration this much later "
    "(a rank stuck where the feed's deadline does not reach, e.g. an all-reduce whose peer vanished); the "
    "collective's own timeout outlasts both",
    "tests/test_distributed.py::test_collective_timeout_outlasts_the_drivers_deadline_and_hccl_ranges")
LEARNER_HEALTH_AFTER_S = _limit(
    "LEARNER_HEALTH_AFTER_S", 5.0, "s", "driver",
    "an iteration taking longer than this has its learners' health checked on every look (cheap: a thread of "
    "theirs), so a stopped learner is found without waiting out the iteration's deadline",
    "tests/test_faults.py::test_a_killed_and_a_stopped_learner_restart_the_group_from_the_newest_checkpoint")
STOP_DRAIN_S = _limit(
    "STOP_DRAIN_S", 5.0, "s", "driver",
    "after Ctrl-C or SIGTERM the iterations in flight get this long (at most a quarter of run.shutdown_grace_s, "
    "which the final save and the shutdown share) to finish and be counted: final.pt counts every update its "
    "weights hold",
    "tests/test_layouts.py::test_final_pt_written_on_a_signal_holds_the_counters_of_its_weights")
LEARNER_STATE_S = _limit(
    "LEARNER_STATE_S", 10.0, "s", "driver",
    "a learner's state for final.pt is asked for between updates and answers in well under this; one that does not "
    "is passed over for the next rank, and the exit never waits on a stuck learner",
    "tests/test_layouts.py::test_final_pt_written_on_a_signal_holds_the_counters_of_its_weights")
REPORT_DEADLINE_S = _limit(
    "REPORT_DEADLINE_S", 120.0, "s", "driver",
    "the end-of-run report streams a bounded metrics.jsonl and draws one figure (seconds on any host): past this it "
    "is stuck (a stopped file system, a hung plotting backend), and the run's exit does not wait on it",
    "tests/test_run_files.py::test_shutdown_does_not_wait_past_the_report_deadline")
PREPROCESS_PING_S = _limit(
    "PREPROCESS_PING_S", 10.0, "s", "driver",
    "a remote preprocess worker answers its health call between two jobs of milliseconds: one silent this long is "
    "replaced before the rollout actors that use it are",
    "tests/test_env_faults.py::test_a_killed_remote_preprocess_worker_is_replaced")
ANSWER_S = _limit(
    "ANSWER_S", 30.0, "s", "control command",
    "cluster.control waits this long for the run's control actor by default (it answers in milliseconds); >= "
    "CONTROL_CALL_S, the longest the driver leaves a silent control actor before replacing it, so asking again "
    "after this reaches the new one",
    "tests/test_deadlines.py::test_the_control_command_on_a_stopped_control_actor_exits_in_one_line_within_its_timeout")
MAX_ANSWER_S = _limit(
    "MAX_ANSWER_S", 86400.0, "s", "control command",
    "the longest --timeout taken: a day is past any wait worth making and far inside the int64 milliseconds of "
    "Ray's timeouts, which a larger number overflows",
    "tests/test_deadlines.py::test_the_control_command_on_a_stopped_control_actor_exits_in_one_line_within_its_timeout")

# Start-up and shutdown of Ray (cluster/placement.py).
CONNECT_S = _limit(
    "CONNECT_S", 5.0, "s", "driver",
    "a cluster's address must accept a TCP connection within this (a host that answers at all does so in a round "
    "trip or two); past it the host is down, firewalled or not there, one line instead of Ray's retries for minutes",
    "tests/test_deadlines.py::test_joining_a_cluster_that_accepts_and_never_answers_ends_in_one_line_within_its_deadline")
PLACEMENT_GROUP_TIMEOUT_S = _limit(
    "PLACEMENT_GROUP_TIMEOUT_S", 60.0, "s", "driver",
    "the learners' placement group is reserved within this or the run ends with a ResourceError naming the bundle "
    "(resources exist in total but are taken or split across nodes), never a wait for good",
    "tests/test_faults.py::test_an_actor_ray_cannot_place_on_a_shared_cluster_is_a_resource_error_not_a_hang")
MONITOR_KILL_S = _limit(
    "MONITOR_KILL_S", 2.0, "s", "driver",
    "stopping the embedded Ray, its monitor gets SIGKILL first and is waited for this long (it exits at once); "
    "then Ray's own shutdown goes on either way",
    "tests/test_layouts.py::test_stop_ray_ends_every_process_ray_init_started")
RAYLET_CONNECT_MS = _limit(
    "RAYLET_CONNECT_MS", 50, "ms", "driver",
    "the embedded raylet retries its first connection to its own object store every this (Ray's 1,000 ms default "
    "is a 1 s gap in every start-up); 200 tries keep Ray's 10 s before it gives up",
    "tests/test_integration.py::test_the_embedded_ray_starts_only_what_a_local_run_needs")

# The learners' and the actors' own waits.
FEED_SLICE_S = _limit(
    "FEED_SLICE_S", 0.1, "s", "learner feed",
    "the feed's queue waits (a prepared batch, a free pinned slot, a board being replaced) are cut in slices of "
    "this: a stop and the learner's stall deadline are noticed within one; < BOARD_SLICE_S",
    "tests/test_replay.py::test_claims_name_shards_by_index_and_a_feed_reads_the_directory_once_per_replacement")
FEED_JOIN_S = _limit(
    "FEED_JOIN_S", 2.0, "s", "learner feed",
    "a stopped feed's thread is waited for this long: one blocked in a claim or a take is left to the actor's kill, "
    "so a learner's stop never waits out a take's TAKE_TIMEOUT_S",
    "tests/test_faults.py::test_a_killed_and_a_stopped_learner_restart_the_group_from_the_newest_checkpoint")
STALL_REPORT_BOARD_S = _limit(
    "STALL_REPORT_BOARD_S", 10.0, "s", "learner",
    "a stalled learner asks the board where its fragments are for at most this: the stall's one line comes whatever "
    "the board's state (an unreachable board is named)",
    "tests/test_layouts.py::test_a_starved_learner_stops_the_run_with_one_line_exit_1_and_a_final_checkpoint")
STALL_REPORT_SHARD_S = _limit(
    "STALL_REPORT_SHARD_S", 5.0, "s", "learner",
    "... and every shard what it holds, all at once, for at most this: one slow shard, not K, bounds the report",
    "tests/test_layouts.py::test_a_starved_learner_stops_the_run_with_one_line_exit_1_and_a_final_checkpoint")
WATCH_START_S = _limit(
    "WATCH_START_S", 0.2, "s", "rollout actor",
    "the driver's watch call (until_done) looks for the actor's loop to start this often: a watch sent before start "
    "answers within this of the loop's end",
    "tests/test_faults.py::test_killed_rollout_actor_and_replay_shard_are_replaced_and_the_run_goes_on")
WATCH_SLICE_S = _limit(
    "WATCH_SLICE_S", 1.0, "s", "rollout actor",
    "the watch call waits for the loop in slices of this: it answers within one of the loop's end, and a thread "
    "join never waits without a deadline",
    "tests/test_faults.py::test_killed_rollout_actor_and_replay_shard_are_replaced_and_the_run_goes_on")


def block_size(fragment_s: float | None, fragments_per_add: int) -> int:
    """Tickets a rollout actor asks for in one poll: about BLOCK_S of fragments (one until a fragment's time
    ``fragment_s`` is measured), at most TICKETS_PER_POLL or one full add, whichever is more."""
    n = 1 if fragment_s is None else int(BLOCK_S / max(fragment_s, 1e-3))
    return min(max(TICKETS_PER_POLL, fragments_per_add), max(1, n))


#: The mechanisms that exist for scale only: with each off the protocol is the same ledger with more calls, and the
#: scale model runs with each off (tests/test_supply.py). {name: (what it saves, the switch that turns it off)}.
SCALE_MECHANISMS = {
    "blocks": ("one poll per block of tickets, not one per fragment",
               "rollout.ticket_blocks: false (one ticket a poll)"),
    "multi_fragment_adds": ("one add, and one confirmation, for the fragments made while the last add was out",
                            "rollout.fragments_per_add: 1"),
    "pacing": ("a shard confirms what nobody waits for once every STORED_PACE_S, not once per add",
               "replay.stored_pacing: false (every add confirmed on the short clock)"),
    "hurry": ("with pacing on, an update's tail is confirmed on the short clock",
              "no switch of its own: without pacing there is nothing to hurry; without hurry a tail waits up to "
              "STORED_PACE_S"),
    "relays": ("the board's calls grow with nodes, not with actors or shards", "rollout.node_relays: never"),
    "group_claims": ("one claim per update for the learner group, not one per learner",
                     "learner.group_claims: false"),
    "call_budget": ("the relays' calls together stay within RELAY_CALLS_PER_S, whatever the node count",
                    "rollout.relay_calls_per_s: 100000 (its maximum)"),
}


def limits_table() -> str:
    """``LIMITS`` as the Markdown table of ``docs/protocol.md`` (``python -m pipeline.protocol`` prints it)."""
    rows = ["| name | value | keeper | invariant | held by |", "|---|---|---|---|---|"]
    for lim in LIMITS.values():
        value = f"{lim.value:g}" if isinstance(lim.value, float) else f"{lim.value:,}"
        rows.append(f"| `{lim.name}` | {value} {lim.unit} | {lim.keeper} | {lim.invariant} | `{lim.test}` |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(limits_table(), end="")
