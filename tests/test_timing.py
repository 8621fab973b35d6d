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
