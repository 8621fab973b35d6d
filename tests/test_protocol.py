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
    directory_version, got = Part(3, tickets)  # split_claims and the feed unpack it as (directory version, tickets)
    assert directory_version == 3 and got is tickets


def test_the_protocol_page_names_every_state_message_clock_and_switch():
    page = (ROOT / "docs" / "protocol.md").read_text()
    names = list(LIMITS) + list(P.STATES) + list(SCALE_MECHANISMS)
    names += [n for n, v in vars(P).items() if isinstance(v, type) and issubclass(v, tuple) and v is not tuple]
    missing = [n for n in names if not re.search(rf"\b{re.escape(n)}\b", page)]
    assert not missing, missing
    assert P.limits_table() in page, "docs/protocol.md: the clocks table is not the code's (python -m pipeline.protocol)"


# ---------------------------------------------------------------------------------------------------- one table
#: The control path: every module whose waits bound a call between processes. A clock of theirs is an entry of
#: LIMITS, read by name; a number written where one waits is a clock nobody can find, order or test.
CONTROL_PATH = CONTROL_PLANE + ("learner/actor.py", "cluster/supervisor.py", "cluster/driver.py", "cluster/control.py",
                                "cluster/graph.py", "cluster/placement.py")
#: Calls whose positional numbers are waits.
WAIT_CALLS = {"sleep", "join", "wait", "wait_for", "Timer"}
#: Numbers in the control path that look like clocks and are not, each with why: (module, the code) -> why.
NOT_A_CLOCK = {
    ("learner/actor.py", "self.stall_timeout_s = 120.0"):
        "a placeholder until setup() sets the run's run.stall_timeout_s, which every learner gets before its feed "
        "starts (the run's clock is a setting, checked in cluster/config.py)",
    ("pipeline/replay.py", "add_timeout_s: float"):
        "a constructor's default for a shard made outside a run (tests, benches): the graph always passes the run's "
        "run.stall_timeout_s",
    ("actors/rollout.py", "stall_timeout_s: float"):
        "a constructor's default for an actor made outside a run (tests, benches): the graph always passes the run's "
        "run.stall_timeout_s",
}


def _is_clock_name(name: str) -> bool:
    return name.endswith(("_s", "_S", "_ms", "_MS")) or "timeout" in name.lower()


def _number(node) -> float | None:
    """The value of a numeric literal (an arithmetic of literals included), else None."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, (ast.UnaryOp, ast.BinOp)) and not any(isinstance(n, ast.Name) for n in ast.walk(node)):
        try:
            return float(eval(compile(ast.Expression(node), "<literal>", "eval")))  # noqa: S307 - literals only
        except Exception:  # noqa: BLE001 - not a number
            return None
    return None


def timing_literals(source: str) -> list[str]:
    """The clocks written as numbers in ``source``: a module constant named ``*_S`` / ``*_MS``, a wait's keyword
    (``timeout=``, ``*_s=``), a positional wait (``time.sleep(0.5)``, ``thread.join(2)``), a parameter's default or
    an attribute named as a clock, a config entry named ``*timeout*``. 0 is not a clock: it waits for nothing (a look
    that does not block) or says nothing is measured yet."""
    found = []

    def clock(node, value) -> None:
        n = _number(value)
        if n is not None and n != 0:
            found.append(ast.unparse(node))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else ""
                if name and _is_clock_name(name) and node.value is not None:
                    clock(node, node.value)
        elif isinstance(node, ast.Call):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            for kw in node.keywords:
                if kw.arg and _is_clock_name(kw.arg):
                    clock(node, kw.value)
            if fname in WAIT_CALLS:
                for a in node.args:
                    clock(node, a)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = a.posonlyargs + a.args
            for arg, default in zip(positional[len(positional) - len(a.defaults):], a.defaults):
                if _is_clock_name(arg.arg):
                    clock(arg, default)
            for arg, default in zip(a.kwonlyargs, a.kw_defaults):
                if default is not None and _is_clock_name(arg.arg):
                    clock(arg, default)
        elif isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and isinstance(k.value, str) and "timeout" in k.value:
                    clock(node, v)
    return found


def test_no_clock_of_the_control_path_is_a_number_outside_the_table():
    unknown = []
    for rel in CONTROL_PATH:
        for code in timing_literals((ROOT / rel).read_text()):
            if (rel, code) not in NOT_A_CLOCK:
                unknown.append(f"{rel}: {code}")
    assert not unknown, "clocks written as numbers (an entry of pipeline/protocol.py's LIMITS instead):\n" + \
        "\n".join(unknown)
    # The allow-list names only what is still there.
    for path, code in NOT_A_CLOCK:
        assert code in timing_literals((ROOT / path).read_text()), (path, code)


def test_the_literal_check_finds_each_way_a_clock_is_written():
    for code in ["RETRY_S = 5.0", "ray.get(ref, timeout=5)", "time.sleep(0.5)", "t.join(2)", "a.stop.remote(timeout_s=1)",
                 "def f(wait_s=2.0): pass", "self.lease_s = 3", "C = {'connect_timeout_ms': 50}",
                 "asyncio.wait_for(x, 1 / 2)"]:
        assert timing_literals(code), code
    for code in ["ray.get(ref, timeout=0)", "RETRY_S = P.RETRY_S", "time.sleep(SLICE_S / 5)", "MAX_ACTORS = 4096",
                 "self.interval_s = 0.0", "runtime.wait(refs, timeout=TIMEOUT_S)"]:
        assert not timing_literals(code), code


def test_the_driver_and_supervisor_clocks_keep_their_order():
    # The control command's default outlasts the driver's wait on a silent control actor, so asking again reaches
    # the new one; the driver's loop is held by a control call no longer than by a board call.
    assert P.ANSWER_S >= P.CONTROL_CALL_S <= P.BOARD_CALL_S and P.MAX_ANSWER_S * 1000 < 2**63
    # A scale-down's stop answers before the driver's wait for it ends; the driver's look at the others comes first.
    assert P.SCALE_DOWN_STOP_S < P.SCALE_DOWN_WAIT_S
    assert P.HEALTH_CHECK_S < P.LEARNER_HEALTH_AFTER_S < P.ITERATION_GRACE_S
    # A learner's stop does not wait out a take; the feed's slices are shorter than the board's.
    assert P.FEED_JOIN_S < P.TAKE_TIMEOUT_S and P.FEED_SLICE_S < P.BOARD_SLICE_S
    assert P.STALL_REPORT_SHARD_S <= P.STALL_REPORT_BOARD_S and P.WATCH_START_S < P.WATCH_SLICE_S
    # The modules that keep these clocks read them from the table (tests and benches import them there).
    from cluster import control, driver, placement, supervisor
    assert (supervisor.SILENT_S, driver.REPORT_DEADLINE_S, control.ANSWER_S, placement.CONNECT_S) == \
        (P.SILENT_S, P.REPORT_DEADLINE_S, P.ANSWER_S, P.CONNECT_S)
    assert placement.LOCAL_RAY_SYSTEM_CONFIG["raylet_client_connect_timeout_milliseconds"] == P.RAYLET_CONNECT_MS


# ---------------------------------------------------------------------------------------------------- typed messages
#: The messages of the protocol: its NamedTuples (Ticket, a frozen dataclass, is a value they carry).
MESSAGES = {n for n, v in vars(P).items() if isinstance(v, type) and issubclass(v, tuple) and v is not tuple}
#: Remote methods that still take several loose values, each with why: (class, method) -> why.
LOOSE_CALLS = {
    ("SupplyBoard", "register_shard"):
        "the driver's wiring of a shard's (index, handle) at start and on a replacement (cluster/graph.py, "
        "cluster/supervisor.py): one caller, never another process's message",
    ("ReplayShard", "add"):
        "one fragment by value, not used by the run (the benches' one-fragment path); the run's adds are add_many's "
        "Entry values",
    ("ReplayShard", "add_many"):
        "its entries are Entry messages; producer and ack are the call's options, passed by keyword at every call",
    ("LearnerActor", "setup"):
        "the learner's wiring, called once by the driver at start with every field by keyword (cluster/graph.py)",
    ("LearnerActor", "load_state"):
        "a checkpoint's state, driver -> learner at start, with the version to number from by keyword",
    ("PreprocessWorker", "process"):
        "the data path: a modality's name and its column of observations, not a message of the control plane",
    ("InferenceServer", "infer"):
        "the data path: a step's observations for a policy version (and its weights when the server lacks them)",
    ("RemoteEvaluator", "run"):
        "the data path: the weights of one policy version to evaluate",
}


def _actor_shells() -> dict[str, tuple[str, ast.ClassDef]]:
    """Every class a module makes a Ray actor of (``@ray.remote`` or ``ray.remote(...)(Class)``): {name: (module,
    class)}. The shells are the only things another process calls."""
    shells = {}
    for package in ("pipeline", "actors", "learner", "cluster"):
        for path in sorted((ROOT / package).glob("*.py")):
            tree = ast.parse(path.read_text())
            classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and any("ray.remote" in ast.unparse(d) for d in node.decorator_list):
                    shells[node.name] = (path.relative_to(ROOT).as_posix(), node)
                elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                    f, args = node.value.func, node.value.args
                    if "ray.remote" in ast.unparse(f) and args and isinstance(args[0], ast.Name) and args[0].id in classes:
                        shells[args[0].id] = (path.relative_to(ROOT).as_posix(), classes[args[0].id])
    return shells


def test_every_cross_process_call_takes_one_typed_message_or_one_value():
    shells = _actor_shells()
    assert {"SupplyBoard", "NodeRelay", "ReplayShard", "RolloutActor", "LearnerActor", "ControlActor"} <= set(shells)
    loose, typed = [], set()
    for cls, (rel, node) in shells.items():
        for m in node.body:
            if not isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) or m.name.startswith("_"):
                continue
            a = m.args
            params = a.posonlyargs[1:] + a.args[1:] + a.kwonlyargs if not a.posonlyargs else a.posonlyargs[1:] + a.args
            if a.vararg or a.kwarg:  # message(Cls, given, loose): one instance of Cls, never loose fields
                calls = [c for c in ast.walk(m) if isinstance(c, ast.Call) and ast.unparse(c.func) == "message"]
                assert calls and not params and a.vararg and a.kwarg, f"{rel}: {cls}.{m.name}"
                named = {ast.unparse(c.args[0]) for c in calls}
                assert named <= MESSAGES, f"{rel}: {cls}.{m.name} takes {named - MESSAGES}"
                typed |= named
            elif len(params) > 1 and (cls, m.name) not in LOOSE_CALLS:
                loose.append(f"{rel}: {cls}.{m.name}({', '.join(p.arg for p in params)})")
            elif len(params) == 1 and params[0].annotation is not None:
                typed.add(ast.unparse(params[0].annotation))
    assert not loose, "remote methods taking loose values (a message of pipeline/protocol.py instead):\n" + \
        "\n".join(loose)
    # Every method the allow-list names still exists and still takes loose values.
    for cls, method in LOOSE_CALLS:
        node = shells[cls][1]
        assert any(getattr(m, "name", None) == method and len(m.args.args) > 2 for m in node.body), (cls, method)
    # The messages that are a call's (not an answer's or a field's) are taken by some shell.
    assert {"Poll", "Stored", "Claim", "RelayPoll", "Publish", "ActorGone", "WeightsWait", "Assignment"} <= typed


def test_every_message_of_the_protocol_is_a_named_tuple_used_across_the_control_path():
    sources = {rel: (ROOT / rel).read_text() for rel in CONTROL_PATH}
    for name in MESSAGES:
        cls = getattr(P, name)
        assert hasattr(cls, "_fields") and cls.__doc__, f"{name}: a NamedTuple saying what it carries"
        users = [rel for rel, text in sources.items() if re.search(rf"\b{name}\b", text)]
        assert users, f"{name} is used by no module of the control path"
    assert Ticket.__dataclass_params__.frozen
