"""Live control of a running job: the driver's named control actor and the ``scale`` command.

The driver registers an actor named ``control:<run name>`` in the ``ascent_rl``
namespace. ``python -m cluster.control --run NAME --rollout-actors N`` (from
any shell that can reach the cluster, e.g. the head node, or a second
``ray job submit``) asks for N rollout actors; the driver applies it at its
next iteration, without a restart, and the change shows in the metrics
(``rollout_actors``).
"""

from __future__ import annotations

import os
import re
import sys

import ray

from pipeline.protocol import ANSWER_S, MAX_ANSWER_S  # its clocks: pipeline/protocol.py's LIMITS

NAMESPACE = "ascent_rl"


#: The most rollout actors a run can be asked for (also rollout.num_actors' maximum).
MAX_ROLLOUT_ACTORS = 4096


def actor_name(run_name: str) -> str:
    return f"control:{run_name}"


@ray.remote(num_cpus=0, max_restarts=0, enable_task_events=False)  # polled every iteration
class ControlActor:
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


def cluster_address(address: str) -> str:
    """Where the command joins: ``address`` (--address; RAY_ADDRESS in its place when it is auto), checked, and a
    cluster listening there within ``placement.CONNECT_S`` (``placement.reachable``); else a ConfigError, one
    line."""
    from cluster import placement
    from cluster.config import ConfigError, check_address

    key, env = "--address", os.environ.get("RAY_ADDRESS")
    if address == "auto" and env:
        address, key = env, "RAY_ADDRESS"
    check_address(address, key)
    if address == "inprocess":
        raise ConfigError(f"{key}: 'inprocess' runs a job inside its own process, with no cluster to reach; allowed: "
                          f"auto or the address of the cluster the run is on (host:port, ray://host:port)")
    return placement.reachable(address, key)


def main(argv=None) -> int:
    from cluster.config import ArgumentParser, ConfigError

    p = ArgumentParser(prog="python -m cluster.control", description="Change a running job's scale.")
    p.add_argument("--run", required=True, help="the run's name (its run directory's name)")
    p.add_argument("--rollout-actors", type=int, required=True, metavar="N")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    p.add_argument("--timeout", type=float, default=ANSWER_S, metavar="S",
                   help=f"seconds to wait for the run to answer (default: {ANSWER_S:g})")
    args = p.parse_args(argv)
    if not 0 < args.timeout <= MAX_ANSWER_S:  # also NaN
        print(f"error: --timeout: {args.timeout:g} is out of range; allowed: 0 < S <= {MAX_ANSWER_S:g}",
              file=sys.stderr)
        return 2
    if args.run in (".", "..") or re.search(r"[/\\\x00-\x1f]", args.run):
        print(f"error: --run: {args.run!r} is not a run name; allowed: the run directory's name (one path component)",
              file=sys.stderr)
        return 2
    if not 1 <= args.rollout_actors <= MAX_ROLLOUT_ACTORS:
        print(f"error: --rollout-actors: {args.rollout_actors} is out of range; allowed: 1 to {MAX_ROLLOUT_ACTORS} "
              f"(the run itself holds at least replay.num_shards)", file=sys.stderr)
        return 2
    connected_here = False
    if not ray.is_initialized():
        from cluster import placement  # join: a local run's Ray listens on 127.0.0.1 (ray.listen_address)

        try:
            address = cluster_address(args.address)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        placement.join(address, deadline_s=args.timeout, deadline_key="--timeout", namespace=NAMESPACE,
                       log_to_driver=False)
        connected_here = True
    try:
        try:
            actor = ray.get_actor(actor_name(args.run), namespace=NAMESPACE)
        except ValueError:
            print(f"error: no running job named {args.run!r} on this cluster", file=sys.stderr)
            return 2
        try:
            err = ray.get(actor.set_rollout_actors.remote(args.rollout_actors), timeout=args.timeout)
        except ray.exceptions.GetTimeoutError:
            print(f"error: run {args.run!r} did not answer within {args.timeout:g} s (its control actor is stopped "
                  f"or its host unreachable; the run replaces a silent one: ask again)", file=sys.stderr)
            return 1
        except ray.exceptions.RayActorError:
            print(f"error: run {args.run!r} did not answer: its control actor died (the run replaces it: ask "
                  f"again)", file=sys.stderr)
            return 1
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
