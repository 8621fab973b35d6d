"""Weights fan-out: how many node-to-node copies one policy version costs, against how many actors read it.

A real run (CartPole with a policy large enough to be published as objects, ``cluster.driver.Trainer``) on a ``ray.cluster_utils.Cluster`` of --cpu-nodes CPU hosts and
one host declaring ``NPU: 1`` where the learner sits (computing on CPU). --actors rollout actors spread over the
CPU hosts. While it trains, the bench takes the weights reference the supply board hands out for each new version
(and holds it, so the object outlives the run); after the run it asks Ray where each version's object is
(``ray.experimental.get_object_locations``). Each node holding a copy that is not the owner's (learner rank 0's)
got it by one transfer. Printed: actors, the nodes they sit on, versions seen, copies and transfers per version,
and transfers per actor.

    .venv/bin/python bench/weights_fanout.py [--actors 32] [--cpu-nodes 3] [--steps 200000]
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench._common import ROOT, cli, parser  # noqa: E402


def make_parser():
    p = parser(__doc__, out="write the per-version figures as JSON here")
    p.add_argument("--actors", type=int, default=32)
    p.add_argument("--cpu-nodes", type=int, default=3)
    p.add_argument("--steps", type=int, default=200_000)
    return p


def run(args):

    import ray
    from ray.cluster_utils import Cluster

    from cluster import config as config_mod
    from cluster.driver import Trainer

    per_node = -(-args.actors // args.cpu_nodes)
    cluster = Cluster()
    for _ in range(args.cpu_nodes):  # logical CPUs: a quarter each per actor, plus room for a shard and the board
        cluster.add_node(num_cpus=per_node // 4 + 2)
    npu = cluster.add_node(num_cpus=2, resources={"NPU": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    cfg = config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "learner.device=cpu", "learner.placement_resource=NPU", f"rollout.num_actors={args.actors}",
        "rollout.envs_per_actor=4", "rollout.num_cpus_per_actor=0.25", f"replay.num_shards={args.cpu_nodes}",
        "run.target_return=null", "run.require_target=false", "run.checkpoint_interval_s=null",
        f"run.total_env_steps={args.steps}",
        # Hidden layers of 128 (138 KB): over learner.actor.WEIGHTS_BY_VALUE_MAX_BYTES, so each version is an object
        # (CartPole's own 37 KB policy goes by value, through the board or a node's relay, and has no object to find).
        "learner.hidden_sizes=[128,128]"])
    held: dict[int, object] = {}  # version -> its weights ref, held by this driver so the object outlives the run
    stop = threading.Event()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(cfg, Path(tmp) / "run", quiet=True)
            try:
                trainer.build()
                where = trainer.placement_report()

                def take_versions():
                    while not stop.is_set():
                        news = ray.get(trainer.graph.board.latest.remote(-1))
                        if news is not None and news[0] not in held:
                            held[news[0]] = news[1][0]
                        time.sleep(0.05)

                # The first and last versions seen are left out of the count: the first may predate some actors'
                # first read, the last may have come out after the actors stopped reading.
                t = threading.Thread(target=take_versions, daemon=True)
                t.start()
                t0 = time.perf_counter()
                result = trainer.run()
                seconds = time.perf_counter() - t0
                stop.set()
                t.join()
                # Asked before the shutdown: the objects belong to learner rank 0 and go with it.
                versions = sorted(held)[1:-1]
                locations = ray.experimental.get_object_locations([held[v] for v in versions])
            finally:
                stop.set()
                trainer.shutdown()
        owner = where["learners"][0]
        actor_nodes = set(where["rollouts"])
        rows = []
        for v in versions:
            nodes = set(locations[held[v]]["node_ids"])
            rows.append({"version": v, "copies": len(nodes), "transfers": len(nodes - {owner}),
                         "on_actor_nodes": len(nodes & actor_nodes),
                         "bytes": locations[held[v]]["object_size"]})
    finally:
        ray.shutdown()
        cluster.shutdown()

    transfers = np.array([r["transfers"] for r in rows])
    print(f"{args.actors} rollout actors on {len(actor_nodes)} CPU nodes, learner rank 0 on the NPU node "
          f"({'not ' if npu.node_id != owner else ''}where it should be); {result.iterations} updates in "
          f"{seconds:.0f} s; weights {rows[0]['bytes'] if rows else 0:,} bytes")
    print(f"versions measured: {len(rows)}; copies per version {int(np.min([r['copies'] for r in rows]))}-"
          f"{int(np.max([r['copies'] for r in rows]))}; transfers per version median {np.median(transfers):.0f} "
          f"(range {transfers.min()}-{transfers.max()}); per actor {np.median(transfers) / args.actors:.3f} "
          f"(one transfer per actor would be {args.actors})")
    return {"actors": args.actors, "actor_nodes": len(actor_nodes), "versions": rows}, None


if __name__ == "__main__":
    cli(make_parser, run)
