"""Supervision of the actor graph: health checks, replacements, live scaling.

A rollout actor or a replay shard that dies is replaced (same id, same place,
made by ``ActorGraph``) and training goes on; the supply board is told, so it
has exactly the lost fragments made again, and the run state counts it
(``rollout_restarts``, ``shard_restarts``). The rollout actor count follows the
control board (``python -m cluster.control``). A learner that dies takes the
whole learner group down with it (the others would hang in the all-reduce);
the group is restarted from the newest checkpoint, at most
``run.max_learner_restarts`` times.
"""

from __future__ import annotations

from typing import Callable

from ray.exceptions import GetTimeoutError, RayActorError

from cluster.config import Config
from cluster.graph import ActorGraph
from cluster.records import RunState
from pipeline import runtime


class RolloutFailed(RuntimeError):
    """A rollout actor's loop raised (bad observation, env error): replacing it would fail the same way."""


class Supervisor:
    """Watches ``graph`` and folds what it sees into ``state``; ``say``: the driver's stderr line."""

    def __init__(self, cfg: Config, graph: ActorGraph, state: RunState, say: Callable[[str], None]):
        self.cfg = cfg
        self.graph = graph
        self.state = state
        self.say = say
        self.rollout_stats: dict[int, dict] = {}  # rollout actor id -> its newest stats

    def poll_rollouts(self) -> None:
        """Fold in every rollout actor's finished episodes and counters; replace the dead ones."""
        state, graph = self.state, self.graph
        refs = [a.stats.remote() for a in graph.rollouts]
        for i, ref in enumerate(refs):
            try:
                st = runtime.get(ref)
            except RayActorError:
                state.retire(i)
                state.rollout_restarts += 1
                self.rollout_stats.pop(i, None)
                # Its tickets go to the others (exactly the fragments it had not delivered), then it is replaced.
                runtime.get(graph.board.actor_gone.remote(i, graph.incarnation[i]))
                graph.rollouts[i] = graph.make_rollout(i, incarnation=graph.incarnation[i] + 1,
                                                       iteration=state.iteration)
                graph.rollouts[i].start.remote()
                self.say(f"rollout actor {i} died; replaced (restart {state.rollout_restarts})")
                continue
            if st["error"]:
                raise RolloutFailed(f"rollout actor {st['actor_id']} failed: {st['error']}")
            state.actor_steps[i] = st["env_steps"]
            state.window.extend(ret for ret, _ in st["episodes"])
            state.episodes_total += len(st["episodes"])
            self.rollout_stats[i] = st

    def poll_shards(self) -> list[dict]:
        """Shard stats; a dead shard is replaced. The board re-points its producers and readers and has exactly
        the fragments it held (and nobody had claimed) made again."""
        state, graph = self.state, self.graph
        refs = [s.stats.remote() for s in graph.shards]
        out = []
        for i, ref in enumerate(refs):
            try:
                st = runtime.get(ref, timeout=30)
            except (RayActorError, GetTimeoutError):
                state.shard_restarts += 1
                try:
                    runtime.kill(graph.shards[i])  # a hung shard is treated as dead
                except Exception:
                    pass
                graph.shards[i] = graph.make_shard(i)
                refunded = runtime.get(graph.board.register_shard.remote(i, graph.shards[i]))
                self.say(f"replay shard {i} died holding {refunded} unclaimed fragments; replaced, and those are "
                         f"made again (restart {state.shard_restarts})")
                st = runtime.get(graph.shards[i].stats.remote())
            out.append(st)
        state.board = runtime.get(graph.board.stats.remote())
        return out

    def apply_control(self) -> None:
        """Grow or shrink the rollout actor set to what the control board asks for."""
        graph, state = self.graph, self.state
        want = runtime.get(graph.control.desired.remote())["rollout_actors"]
        have = len(graph.rollouts)
        if want == have:
            return
        if want > have:
            if graph.plan.rollout_nodes[0] is not None:
                # Pinned placement: new actors go round-robin over the same CPU hosts.
                graph.plan.rollout_nodes += [graph.plan.rollout_nodes[i % have] for i in range(have, want)]
            new = [graph.make_rollout(i, incarnation=graph.incarnation.get(i, -1) + 1, iteration=state.iteration)
                   for i in range(have, want)]
            graph.rollouts += new
            runtime.get([a.start.remote() for a in new])
        else:
            gone, graph.rollouts = graph.rollouts[want:], graph.rollouts[:want]
            try:  # each delivers the fragment it is making, so nothing needs to be made again
                runtime.get([a.stop.remote(timeout_s=10.0) for a in gone], timeout=15)
            except Exception:
                pass  # stuck or dead: killed below either way, and its tickets refunded
            for i, a in enumerate(gone, start=want):
                runtime.kill(a)
                state.retire(i)
                self.rollout_stats.pop(i, None)
                # Tickets it held without a stored fragment go to the others; a late add of it is refused.
                runtime.get(graph.board.actor_gone.remote(i, graph.incarnation[i]))
        # Nothing else to adjust: the board's tickets follow what the learners consume, not the actor count.
        self.say(f"rollout actors: {have} -> {want}")

    def a_learner_is_dead(self) -> bool:
        for lr in self.graph.learners:
            try:
                runtime.get(lr.__ray_call__.remote(lambda self: None), timeout=10)
            except (RayActorError, GetTimeoutError):
                return True
        return False

    def restart_learners(self) -> None:
        """Replace the whole learner group, from the newest checkpoint (or from scratch without one)."""
        state, cfg = self.state, self.cfg
        state.learner_restarts += 1
        if state.learner_restarts > cfg.run.max_learner_restarts:
            raise RuntimeError(f"learners died {state.learner_restarts} times (run.max_learner_restarts = "
                               f"{cfg.run.max_learner_restarts}); resume later with --resume {self.graph.run_dir}")
        path = self.graph.restart_learners()
        self.say(f"a learner died; learner group restarted from {path or 'scratch'} "
                 f"(restart {state.learner_restarts} of at most {cfg.run.max_learner_restarts})")
