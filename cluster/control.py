"""Live control of a running job: the driver's named control actor and the ``scale`` command.

The driver registers an actor named ``control:<run name>`` in the ``ascent_rl``
namespace. ``python -m cluster.control --run NAME --rollout-actors N`` (from
any shell that can reach the cluster, e.g. the head node, or a second
``ray job submit``) asks for N rollout actors; the driver applies it at its
next iteration, without a restart, and the change shows in the metrics
(``rollout_actors``).
"""

from __future__ import annotations

import argparse
import sys

import ray

NAMESPACE = "ascent_rl"


#: The most rollout actors a run can be asked for (also rollout.num_actors' maximum).
MAX_ROLLOUT_ACTORS = 4096


def actor_name(run_name: str) -> str:
    return f"control:{run_name}"


@ray.remote(num_cpus=0, max_restarts=0, enable_task_events=False)  # polled every iteration
class ControlBoard:
    def __init__(self, rollout_actors: int, min_rollout_actors: int, max_rollout_actors: int = MAX_ROLLOUT_ACTORS):
        self.rollout_actors = rollout_actors
        self.min, self.max = min_rollout_actors, max_rollout_actors

    def set_rollout_actors(self, n: int) -> str | None:
        """None if accepted, else the one-line reason."""
        if not isinstance(n, int) or not self.min <= n <= self.max:
            return (f"rollout actors: {n!r} is out of range; allowed: {self.min} (replay.num_shards: every shard "
                    f"needs a producer) to {self.max}")
        self.rollout_actors = n
        return None

    def applied(self, n: int) -> None:
        """The driver could run only ``n`` (the rest did not fit): asking again is what retries."""
        self.rollout_actors = n

    def desired(self) -> dict:
        return {"rollout_actors": self.rollout_actors}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.control", description="Change a running job's scale.")
    p.add_argument("--run", required=True, help="the run's name (its run directory's name)")
    p.add_argument("--rollout-actors", type=int, required=True, metavar="N")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    args = p.parse_args(argv)
    connected_here = False
    if not ray.is_initialized():
        ray.init(address=args.address, namespace=NAMESPACE, log_to_driver=False)
        connected_here = True
    try:
        try:
            board = ray.get_actor(actor_name(args.run), namespace=NAMESPACE)
        except ValueError:
            print(f"error: no running job named {args.run!r} on this cluster", file=sys.stderr)
            return 2
        err = ray.get(board.set_rollout_actors.remote(args.rollout_actors))
        if err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"asked run {args.run!r} for {args.rollout_actors} rollout actors")
        return 0
    finally:
        if connected_here:
            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
