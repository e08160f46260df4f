"""The arithmetic every cache shares."""

import pytest

from streamkv.layout import CacheLayout


def test_retained_positions_sinks_then_last_window():
    L = CacheLayout(sink=2, window=4, chunk=3)
    assert L.retained_positions(0) == []
    assert L.retained_positions(3) == [0, 1, 2]
    assert L.retained_positions(6) == [0, 1, 2, 3, 4, 5]
    assert L.retained_positions(9) == [0, 1, 5, 6, 7, 8]
    assert L.num_valid(9) == 6 == L.capacity


def test_ring_slots_match_the_docstring_diagram():
    L = CacheLayout(sink=2, window=4, chunk=3)

    def physical(end):
        buf = [None] * L.capacity
        for p in L.retained_positions(end):
            buf[L.ring_slot(p)] = p
        return buf

    assert physical(9) == [0, 1, 6, 7, 8, 5]
    assert physical(12) == [0, 1, 10, 11, 8, 9]
    assert physical(15) == [0, 1, 14, 11, 12, 13]
    assert L.ring_chronological_slots(12) == [0, 1, 4, 5, 2, 3]


@pytest.mark.parametrize("sink,window,chunk", [(0, 3, 3), (1, 5, 2), (3, 7, 3), (4, 4, 4), (5, 11, 4)])
def test_ring_slots_are_distinct_and_in_range(sink, window, chunk):
    L = CacheLayout(sink=sink, window=window, chunk=chunk)
    for end in range(0, 10 * L.capacity, chunk):
        slots = L.ring_chronological_slots(end)
        assert len(set(slots)) == len(slots) == L.num_valid(end)
        assert all(0 <= s < L.capacity for s in slots)
        # while filling, the occupied slots are the prefix [0, num_valid)
        assert sorted(slots) == list(range(L.num_valid(end)))


def test_chronological_slots_are_the_prefix_in_order():
    L = CacheLayout(sink=3, window=5, chunk=2)
    for end in range(0, 40, 2):
        assert [L.chronological_slot(p, end) for p in L.retained_positions(end)] == list(range(L.num_valid(end)))


def test_wraps_and_first_eviction():
    L = CacheLayout(sink=2, window=4, chunk=3)
    assert L.first_eviction_chunk() == 2  # chunk 2 ends at 9 > 6
    # chunk 2 (slots 2,3,4) wraps once; chunk 3 (slots 5,2,3) passes the end again
    assert [L.ring_wraps(e) for e in (3, 6, 9, 12, 15)] == [0, 0, 1, 2, 3]


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(sink=-1, window=4, chunk=2), ValueError, "sink must be >= 0, got -1"),
        (dict(sink=0, window=0, chunk=1), ValueError, "window must be >= 1, got 0"),
        (dict(sink=0, window=4, chunk=0), ValueError, "chunk must be >= 1, got 0"),
        (dict(sink=0, window=3, chunk=4), ValueError, r"chunk \(4\) must be <= window \(3\)"),
        (dict(sink=0, window=4.0, chunk=2), TypeError, "window must be an int, got float"),
        (dict(sink=True, window=4, chunk=2), TypeError, "sink must be an int, got bool"),
    ],
)
def test_bad_sizes_name_the_constraint_and_value(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        CacheLayout(**kwargs)
