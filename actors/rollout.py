"""RolloutActor: the thin Ray shell that runs a ``RolloutSampler`` in a loop.

The loop runs on a background thread so the actor still answers ``stats`` and
``stop`` calls. Ray traffic is per fragment, never per step:

* before each fragment, poll the weight board (a version number unless it
  changed) and load new weights between fragments, so every fragment comes
  from exactly one policy version;
* after each fragment, wait for the previous ``add`` to be acknowledged, then
  send this one to the replay shard: at most one fragment in flight, so a full
  shard blocks the producer (backpressure) and nothing is dropped for space.

Rate limit: an actor produces at most ``fragments_per_version`` fragments per
policy version, and runs at most ``max_policy_lag`` versions ahead of the
weights it holds. Without it, rollouts faster than the learner produce data the
lag bound then throws away: env steps spent for nothing. With it, lag 1 gives
full overlap (version v data is sampled while update v runs and trained on by
update v+1) and lag 0 is exactly synchronous PPO.
"""

from __future__ import annotations

import threading
import time

import ray
import torch

from ray.exceptions import RayActorError

from actors.sampler import RolloutSampler
from pipeline.fragment import FragmentMeta


class RolloutActor:
    def __init__(self, *, actor_id: int, shard, board, sampler_kwargs: dict, fragments_per_version: int,
                 max_policy_lag: int, torch_threads: int = 1):
        torch.set_num_threads(torch_threads)
        self.actor_id = actor_id
        self.shard = shard
        self.board = board
        if sampler_kwargs.get("modalities"):
            from actors.modal_sampler import MultiModalSampler  # cv2 and the pipeline load only when needed

            self.sampler = MultiModalSampler(actor_id=actor_id, **sampler_kwargs)
        else:
            self.sampler = RolloutSampler(actor_id=actor_id, **sampler_kwargs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._lock = threading.Lock()
        self._episodes: list[tuple[float, int]] = []
        self.fragments_sent = 0
        self.weight_updates = 0
        self.fragments_per_version = fragments_per_version
        self.max_policy_lag = max_policy_lag
        self.backpressure_s = 0.0
        self.rate_limited_s = 0.0
        self.fragments_lost = 0
        self._credit = 0  # extra fragments granted by the driver after data was lost downstream
        self._sent_at_base = 0  # fragments_sent when the current budget started
        self._first_version: int | None = None

    def _apply(self, news) -> None:
        if news is not None:
            version, (ref,) = news
            self.sampler.load_weights(version, ray.get(ref))
            self.weight_updates += 1
            if self._first_version is None:
                self._first_version = version

    def _allowed_fragments(self) -> int:
        versions_seen = self.sampler.policy_version - self._first_version + 1
        return self._sent_at_base + (versions_seen + self.max_policy_lag) * self.fragments_per_version + self._credit

    def set_fragments_per_version(self, fragments: int) -> None:
        """New share of each version's batch, after the number of rollout actors changed.

        The budget restarts from here as for a new actor: counting the new share from the first version
        would leave an actor whose share shrank blocked for as many versions as it is now "ahead".
        """
        with self._lock:
            if self._first_version is not None:
                self._first_version = self.sampler.policy_version
                self._sent_at_base = self.fragments_sent
            self.fragments_per_version = fragments

    def set_shard(self, shard) -> None:
        """Point this actor at a replacement for its (dead) replay shard."""
        self.shard = shard

    def add_credit(self, fragments: int) -> None:
        """Allow ``fragments`` more than the rate limit: the driver's answer to data lost in a dead shard,
        without which the learner would wait for fragments the limiter never lets anyone produce."""
        self._credit += fragments

    def _await_add(self, ref, shard) -> None:
        """Wait for an add; if its shard died, count the fragment as lost and wait for a replacement."""
        try:
            ray.get(ref)
        except RayActorError:
            self.fragments_lost += 1
            self.fragments_sent -= 1  # not delivered: the rate limit lets us produce it again
            while self.shard is shard and not self._stop.is_set():
                time.sleep(0.05)

    def _wait_for_weights(self) -> None:
        """Block (without spinning) until the board has a newer version, or stop is asked."""
        t = time.perf_counter()
        seen = self.sampler.policy_version
        while not self._stop.is_set() and self.sampler.policy_version == seen:
            self._apply(ray.get(self.board.wait_newer.remote(seen, 0.5)))
        self.rate_limited_s += time.perf_counter() - t

    def _loop(self) -> None:
        pending_add = None
        try:
            self._wait_for_weights()  # the very first weights
            while not self._stop.is_set():
                if self.fragments_sent >= self._allowed_fragments():
                    self._wait_for_weights()
                    continue
                poll = self.board.latest.remote(self.sampler.policy_version)  # answered while we sample
                fragment = self.sampler.collect()
                with self._lock:
                    self._episodes.extend(zip(fragment.episode_returns.tolist(), fragment.episode_lengths.tolist()))
                t = time.perf_counter()
                if pending_add is not None:
                    self._await_add(*pending_add)
                self.backpressure_s += time.perf_counter() - t
                shard = self.shard
                pending_add = (shard.add.remote(FragmentMeta.of(fragment), fragment), shard)
                self.fragments_sent += 1
                self._apply(ray.get(poll))
        except Exception as e:  # reported through stats(); the driver decides what to do
            self._error = f"{type(e).__name__}: {e}"

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"rollout-{self.actor_id}", daemon=True)
            self._thread.start()

    def stats(self) -> dict:
        """Counters, plus the episodes finished since the previous call (drained)."""
        with self._lock:
            episodes, self._episodes = self._episodes, []
        return {
            "actor_id": self.actor_id,
            "env_steps": self.sampler.env_steps,
            "sample_s": self.sampler.sample_seconds,
            "fragments_sent": self.fragments_sent,
            "policy_version": self.sampler.policy_version,
            "weight_updates": self.weight_updates,
            "backpressure_s": self.backpressure_s,
            "rate_limited_s": self.rate_limited_s,
            "fragments_lost": self.fragments_lost,
            "episodes": episodes,
            "pipeline": self.sampler.pipeline_stats() if hasattr(self.sampler, "pipeline_stats") else {},
            "error": self._error,
            "running": self._thread is not None and self._thread.is_alive(),
        }

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            # The loop may be blocked on a full shard; the driver kills the actor after this returns.
            self._thread.join(timeout=2.0)
        if self._thread is None or not self._thread.is_alive():
            self.sampler.close()


# No GCS task records for the per-iteration stats calls (see pipeline/replay.py).
RemoteRolloutActor = ray.remote(max_restarts=0, enable_task_events=False)(RolloutActor)
