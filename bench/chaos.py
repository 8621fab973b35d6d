"""Chaos bench: faults drawn at random every few seconds for 15 minutes of CartPole, and the run must take them all.

Every ``--every`` seconds one fault is drawn from: SIGKILL or SIGSTOP of a rollout actor, a replay shard, a
learner or the supply board; an env that raises or hangs inside ``step`` (``tests/faulty_env.py``'s on-request
mode: the bench drops a request file, the first env to see it misbehaves); and, with ``--nodes``, the removal of a
CPU node of a ``ray.cluster_utils.Cluster`` (3 CPU nodes and a node with ``NPU: 2`` whose learners compute on the
CPU), which is added back right after so the cluster keeps its size. (CartPole has no remote preprocess workers;
their replacement is ``tests/test_env_faults.py``'s.)

At the end it checks, and prints as a table: the run ended by its time budget, not by a fault; it reached a
100-episode mean of ``--target``; every fault is counted in the metrics (each kind by its own counter); no
fragment was trained twice (the ticket ids of every update, unique across supply boards); every update trained
exactly its batch; and what went stale stays under 1% of what was produced.

    .venv/bin/python bench/chaos.py [--minutes 15] [--every 20] [--seed 0] [--nodes]
"""

from __future__ import annotations

import collections
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import cli, parser, signal_actor  # noqa: E402
from tests.conftest import kill_all  # noqa: E402

FAULTS = ("kill rollout", "stop rollout", "kill shard", "stop shard", "kill learner", "stop learner",
          "kill board", "stop board", "env raise", "env hang")
ROLES = {"rollout": "rollouts", "shard": "shards", "learner": "learners", "board": "board"}


def make_parser():
    p = parser(__doc__)
    p.add_argument("--minutes", type=float, default=15.0)
    p.add_argument("--every", type=float, default=20.0, help="seconds between faults")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=475.0)
    p.add_argument("--nodes", action="store_true", help="on a 4-node cluster_utils Cluster, with node removal")
    p.add_argument("--quiet-tail", type=float, default=60.0,
                   help="seconds at the end with no new fault, so the last ones are noticed and counted")
    return p


def run(args):

    import ray

    from bench._train import long_run, read_records
    from cluster.driver import Trainer
    from cluster.records import first_at
    from tests.faulty_env import FAULTY_ID

    rng = random.Random(args.seed)
    injected: collections.Counter = collections.Counter()
    stopped: list[int] = []
    trained: list[list[int]] = []

    class RecordingTrainer(Trainer):
        """The real driver, keeping each iteration's ticket ids (what "nothing trained twice" is checked on)."""

        def _account(self, results, sinks, progress):
            trained.append([tid for res in results for tid in res["ticket_ids"]])
            return super()._account(results, sinks, progress)

    with tempfile.TemporaryDirectory() as tmp:
        requests = Path(tmp) / "env-requests"
        requests.mkdir()
        run_dir = Path(tmp) / "chaos"
        overrides = [  # on top of bench/_train.py's long_run: its CartPole, time budget and no stop on a target
            f"env.id=tests.faulty_env:{FAULTY_ID}", "env.kwargs.fault=on_request", "env.kwargs.at_step=50",
            f"env.kwargs.token={requests}", "rollout.num_actors=3", "learner.num_learners=2",
            "run.checkpoint_interval_s=10", "run.stall_timeout_s=60"]
        cluster = None
        if args.nodes:
            from ray.cluster_utils import Cluster

            cluster = Cluster()
            nodes = [cluster.add_node(num_cpus=2) for _ in range(3)]  # nodes[0] is the head: never removed
            cluster.add_node(num_cpus=3, resources={"NPU": 2})
            ray.init(address=cluster.address, namespace="ascent_rl_chaos", log_to_driver=False)
            cluster.wait_for_nodes()
            overrides += ["learner.device=cpu", "learner.placement_resource=NPU"]
        faults = FAULTS + (("remove node",) if cluster is not None else ())

        def strike(trainer) -> str:
            fault = rng.choice(faults)
            verb, what = fault.split()
            if verb == "env":
                (requests / f"{what}-{time.monotonic_ns()}").touch()
                return fault
            if fault == "remove node":
                removable = [n for n in nodes[1:] if n in cluster.list_all_nodes()]
                node = rng.choice(removable)
                cluster.remove_node(node)
                nodes.remove(node)
                nodes.append(cluster.add_node(num_cpus=2))
                return fault
            handles = trainer.graph.board if what == "board" else getattr(trainer.graph, ROLES[what])
            handle = handles if what == "board" else rng.choice(handles)
            signal_actor(handle, signal.SIGKILL if verb == "kill" else signal.SIGSTOP, stopped, timeout=10)
            return fault

        def chaos(trainer, stop):
            last_fault_at = time.monotonic() + args.minutes * 60 - args.quiet_tail
            while not stop.wait(args.every) and time.monotonic() < last_fault_at:
                try:
                    fault = strike(trainer)
                except Exception as e:  # noqa: BLE001 - the target may be being replaced right now: skip this round
                    print(f"\nchaos: skipped a round ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
                    continue
                injected[fault] += 1
                print(f"\nchaos: {fault}", file=sys.stderr, flush=True)

        try:
            cfg, result = long_run(args.minutes, run_dir, chaos, overrides, RecordingTrainer,
                                   after_shutdown=lambda: kill_all(stopped))
        finally:
            if cluster is not None:
                ray.shutdown()
                cluster.shutdown()
        records = read_records(run_dir)
    last = records[-1]
    first_hit = first_at(records, 100, args.target)
    flat = [tid for ids in trained for tid in ids]
    twice = len(flat) - len(set(flat))
    wrong_batches = sum(len(ids) != cfg.fragments_per_update for ids in trained)
    stale = last["stale_fraction"]

    def n(*kinds):
        return sum(injected[k] for k in kinds)

    rows = [  # fault kinds -> the counter that must see each of them (a learner fault restarts the whole group)
        ("rollout actor kill / stop, env raise / hang", n("kill rollout", "stop rollout", "env raise", "env hang"),
         "rollout_restarts", last["rollout_restarts"]),
        ("  of which env raise", injected["env raise"], "env_failures", last["env_failures"]),
        ("  of which stop or env hang", n("stop rollout", "env hang"), "rollout_hangs", last["rollout_hangs"]),
        ("replay shard kill / stop", n("kill shard", "stop shard"), "shard_restarts", last["shard_restarts"]),
        ("learner kill / stop", n("kill learner", "stop learner"), "learner_restarts", last["learner_restarts"]),
        ("supply board kill / stop", n("kill board", "stop board"), "board_restarts", last["board_restarts"]),
    ]
    if cluster is not None:
        rows.append(("CPU node removed (its actors and shard)", injected["remove node"], "(in the rows above)", "-"))
    print(f"\n{'fault':<46} {'injected':>8}  {'counted by':<18} {'count':>6}")
    for name, count, key, seen in rows:
        print(f"{name:<46} {count:>8}  {key:<18} {seen!s:>6}")
    print(f"\nchaos: {sum(injected.values())} faults in {args.minutes:g} min; run ended '{result.reason}' after "
          f"{result.env_steps:,} env steps and {result.iterations} updates")
    print(f"chaos: {last['fragments_lost']} fragments made again, {last['board_voided']} voided by board restarts; "
          f"stale {last['fragments_dropped_stale']} of {last['fragments_produced']} produced ({stale:.2%}); "
          f"trained twice: {twice}; updates with a wrong batch: {wrong_batches}")
    print(f"chaos: {args.target:g} " + (f"first reached at {first_hit['env_steps']:,} env steps "
                                        f"({first_hit['train_time_s']:.0f} s)" if first_hit else "NOT reached"))
    # Counted at least as often as injected: a fault can cause more than one replacement (a node takes an actor and
    # a shard; a hung env's actor may also miss a health call), never fewer. Learner faults that land while the
    # group is restarting anyway may fold into one restart, so that row needs one restart, not one per fault.
    counted = (last["rollout_restarts"] >= n("kill rollout", "stop rollout", "env raise", "env hang")
               and last["env_failures"] >= injected["env raise"]
               and last["rollout_hangs"] >= n("stop rollout", "env hang")
               and last["shard_restarts"] >= n("kill shard", "stop shard")
               and last["board_restarts"] >= n("kill board", "stop board")
               and (n("kill learner", "stop learner") == 0 or last["learner_restarts"] >= 1))
    ok = (result.reason == "time_budget" and first_hit is not None and counted and twice == 0
          and wrong_batches == 0 and stale <= 0.01)
    print("chaos: PASS" if ok else "chaos: FAIL")
    return {"faults": dict(injected), "counters": {key: seen for _, _, key, seen in rows}, "reason": result.reason,
            "first_at_target": first_hit, "trained_twice": twice, "wrong_batches": wrong_batches, "stale": stale}, ok


if __name__ == "__main__":
    cli(make_parser, run)
