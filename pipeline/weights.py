"""The weight board: where learner rank 0 posts (version, ObjectRef) of the policy.

Rollout actors poll ``latest(seen_version)``: a few bytes unless the version
changed, so polling every fragment is cheap and the weights travel once per
version through the object store. ``wait_newer`` lets a rate-limited actor
sleep until the next version instead of spinning.
"""

from __future__ import annotations

import asyncio

import ray


class WeightBoardState:
    def __init__(self):
        self.version = -1
        self.ref_box: list | None = None  # [ObjectRef]: a list so Ray passes the ref, not the value

    def publish(self, version: int, ref_box: list) -> None:
        if version <= self.version:
            raise ValueError(f"weight version must increase: got {version} after {self.version}")
        self.version, self.ref_box = version, ref_box

    def latest(self, seen_version: int):
        if self.version > seen_version:
            return self.version, self.ref_box
        return None


@ray.remote(num_cpus=0, max_restarts=0, enable_task_events=False)  # polled per fragment: no GCS task records
class WeightBoard:
    def __init__(self):
        self.state = WeightBoardState()
        self._changed = asyncio.Condition()

    async def publish(self, version: int, ref_box: list) -> None:
        async with self._changed:
            self.state.publish(version, ref_box)
            self._changed.notify_all()

    async def latest(self, seen_version: int):
        return self.state.latest(seen_version)

    async def wait_newer(self, seen_version: int, timeout_s: float):
        """Like ``latest`` but waits up to ``timeout_s`` for a version newer than ``seen_version``."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.state.version > seen_version), timeout_s)
            except asyncio.TimeoutError:
                pass
            return self.state.latest(seen_version)
