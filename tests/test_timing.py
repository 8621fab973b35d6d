import time

import pytest

from pipeline.timing import Stopwatch, Timings


def test_timings_accumulate_per_name_and_count_a_block_that_raised():
    t = Timings()
    for _ in range(2):
        with t.time("a"):
            time.sleep(0.02)
    with pytest.raises(RuntimeError):
        with t.time("b"):
            time.sleep(0.01)
            raise RuntimeError
    assert 0.04 <= t["a"] < 0.2 and 0.01 <= t["b"] < 0.1 and t["never"] == 0.0
    assert set(t.snapshot()) == {"a", "b"}


def test_stopwatch_reads_inside_and_after_the_block():
    with Stopwatch() as sw:
        time.sleep(0.02)
        inside = sw.s
    after = sw.s
    time.sleep(0.01)
    assert 0.02 <= inside <= after < 0.2 and sw.s == after


def test_a_nested_block_counts_for_itself_only_so_the_names_partition_the_time():
    """The rollout actors' stages add up to their loop's wall time because a block inside another (the weight fetch
    inside the wait for a ticket, the wait for an add inside the add) leaves the outer name's seconds. (Lower bounds
    and sums only: a loaded machine oversleeps, it never undersleeps.)"""
    t = Timings()
    with Stopwatch() as sw:
        with t.time("outer"):
            time.sleep(0.02)
            with t.time("inner"):
                time.sleep(0.03)
                with t.time("outer"):  # the same name again, deeper: still its own time only
                    time.sleep(0.01)
    assert t["outer"] >= 0.03 and t["inner"] >= 0.03
    # Counted once each: an outer block that kept its inner blocks' time would take the sum past the elapsed time.
    assert t["outer"] + t["inner"] <= sw.s and t["outer"] + t["inner"] >= sw.s - 0.01


def test_a_snapshot_counts_the_blocks_still_open():
    """A reader on another thread (the actor's stats) sees a long wait while it lasts, each open block's own part."""
    t = Timings()
    with Stopwatch() as sw:
        with t.time("wait"):
            time.sleep(0.02)
            with t.time("fetch"):
                time.sleep(0.01)
                mid = t.snapshot()
                elapsed = sw.s
    assert mid["wait"] >= 0.02 and mid["fetch"] >= 0.01 and mid["wait"] + mid["fetch"] <= elapsed
    assert t["wait"] >= mid["wait"] and t["fetch"] >= mid["fetch"]
