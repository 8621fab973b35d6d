"""Named wall-clock timings, in the spirit of Sample Factory's ``Timing``: one context manager instead of
hand-written ``perf_counter()`` pairs.

    timings = Timings()
    with timings.time("update"):
        ...
    timings["update"]          # seconds, accumulated over every ``time("update")`` block
    with Stopwatch() as sw:    # one-off: sw.s after the block (and while it runs)
        ...
"""

from __future__ import annotations

import collections
import time


class Stopwatch:
    """``with Stopwatch() as sw: ...`` then ``sw.s``: the block's duration (the time so far while inside)."""

    __slots__ = ("t0", "t1")

    def __init__(self):
        self.t0 = self.t1 = None

    def __enter__(self) -> "Stopwatch":
        self.t0 = time.perf_counter()
        self.t1 = None
        return self

    def __exit__(self, *exc) -> None:
        self.t1 = time.perf_counter()

    @property
    def s(self) -> float:
        if self.t0 is None:
            return 0.0
        return (self.t1 if self.t1 is not None else time.perf_counter()) - self.t0


class _Block:
    __slots__ = ("owner", "name", "t0")

    def __init__(self, owner: "Timings", name: str):
        self.owner, self.name = owner, name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.owner.seconds[self.name] += time.perf_counter() - self.t0


class Timings:
    """Seconds per name, accumulated over ``with timings.time(name):`` blocks (an exception still counts)."""

    def __init__(self):
        self.seconds: collections.defaultdict[str, float] = collections.defaultdict(float)

    def time(self, name: str) -> _Block:
        return _Block(self, name)

    def __getitem__(self, name: str) -> float:
        return self.seconds.get(name, 0.0)

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)
