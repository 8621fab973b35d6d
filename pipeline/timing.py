"""Named wall-clock timings, in the spirit of Sample Factory's ``Timing``: one context manager instead of
hand-written ``perf_counter()`` pairs.

    timings = Timings()
    with timings.time("update"):
        ...
    timings["update"]          # seconds, accumulated over every ``time("update")`` block
    with Stopwatch() as sw:    # one-off: sw.s after the block (and while it runs)
        ...

A block nested in another counts for itself only: the outer name's seconds leave the inner block's out. So the
names partition the time spent inside blocks, and a loop whose every part is some block has stage times that add up
to its wall time (the rollout actors' breakdown, ``actors/rollout.py``, relies on it). One ``Timings`` belongs to one
thread (the stack of open blocks is that thread's); another thread may read ``snapshot()``.
"""

from __future__ import annotations

import time

_now = time.perf_counter


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
    """The context manager of one name, made once per name (a hot loop enters it every step, so it holds its own
    total and what it needs to reach the owner's stack): where an entry started lives on that stack, so the same
    name may even be nested in itself."""

    __slots__ = ("name", "total", "_open")

    def __init__(self, owner: "Timings", name: str):
        self.name, self.total, self._open = name, 0.0, owner._open

    def __enter__(self) -> None:
        # [name, start, seconds of the blocks nested in it so far]
        self._open.append([self.name, _now(), 0.0])

    def __exit__(self, *exc) -> None:
        open_ = self._open
        _, t0, inner = open_.pop()
        took = _now() - t0
        self.total += took - inner
        if open_:
            open_[-1][2] += took


class Timings:
    """Seconds per name, accumulated over ``with timings.time(name):`` blocks (an exception still counts), each
    block's own time only (module docstring)."""

    def __init__(self):
        self._open: list[list] = []  # the blocks entered and not yet left, outermost first
        self._blocks: dict[str, _Block] = {}

    def time(self, name: str) -> _Block:
        block = self._blocks.get(name)
        if block is None:
            block = self._blocks[name] = _Block(self, name)
        return block

    def __getitem__(self, name: str) -> float:
        block = self._blocks.get(name)
        return 0.0 if block is None else block.total

    def snapshot(self, now: float | None = None) -> dict[str, float]:
        """Seconds per name, the blocks still open counted up to ``now`` (``time.perf_counter()``; default: the
        present), so a reader on another thread sees a long wait while it lasts and the names still add up."""
        out = {name: block.total for name, block in list(self._blocks.items())}
        stack = [list(entry) for entry in list(self._open)]  # copies: the owning thread goes on meanwhile
        if stack:
            now = _now() if now is None else now
            for k, (name, t0, inner) in enumerate(stack):
                until = stack[k + 1][1] if k + 1 < len(stack) else now  # the block nested in it, open, is its own
                out[name] = out.get(name, 0.0) + max(0.0, until - t0 - inner)
        return out
