"""Readable tiny states: one head, head_dim 1, each key equal to its position.

Buffers are written as ``[slot 0, slot 1, ...]`` (position held; ``.`` empty).
"""

import torch

from streamkv import ChronologicalCache, RingCache


def _tiny(cls, sink, window, chunk):
    cap = sink + window
    return cls((1, cap, 1, 1), (1, cap, 1, 1), seq_dim=1, sink=sink, window=window, chunk=chunk)


def _step(cache, c, value_offset=0.0):
    cache.begin_chunk(c)
    n = cache.layout.chunk
    x = torch.arange(c * n, (c + 1) * n, dtype=torch.float32).view(1, n, 1, 1) + value_offset
    cache.write(x, x)
    cache.commit_chunk(c)


def _buf(cache):
    valid = cache.slot_positions[0, 0].tolist()
    keys = cache.keys().flatten().tolist()
    return [int(k) if p >= 0 else "." for k, p in zip(keys, valid)]


def test_ring_sink2_window4_chunk3():
    """
    chunk 0: [0, 1, 2, ., ., .]    filling; chunk 0 straddles the sink boundary
    chunk 1: [0, 1, 2, 3, 4, 5]    full
    chunk 2: [0, 1, 6, 7, 8, 5]    overwrites the oldest window slots 2, 3, 4
    chunk 3: [0, 1, 10, 11, 8, 9]  wraps: slots 5, 2, 3
    chunk 4: [0, 1, 14, 11, 12, 13]
    """
    ring = _tiny(RingCache, 2, 4, 3)
    expected = [
        [0, 1, 2, ".", ".", "."],
        [0, 1, 2, 3, 4, 5],
        [0, 1, 6, 7, 8, 5],
        [0, 1, 10, 11, 8, 9],
        [0, 1, 14, 11, 12, 13],
    ]
    for c, buf in enumerate(expected):
        _step(ring, c)
        assert _buf(ring) == buf
        assert [int(p) for p in ring.slot_positions[0, 0].tolist() if p >= 0] == [b for b in buf if b != "."]
    assert ring.write_slots[0, 0].tolist() == [4, 5, 2]  # chunk 4 = positions 12, 13, 14
    assert ring.chronological_keys().flatten().tolist() == [0, 1, 11, 12, 13, 14]


def test_chronological_sink2_window4_chunk3():
    """
    chunk 2: [0, 1, 5, 6, 7, 8]      5 rolled from slot 5 to slot 2
    chunk 3: [0, 1, 8, 9, 10, 11]
    """
    cache = _tiny(ChronologicalCache, 2, 4, 3)
    for c in range(2):
        _step(cache, c)
    _step(cache, 2)
    assert _buf(cache) == [0, 1, 5, 6, 7, 8]
    _step(cache, 3)
    assert _buf(cache) == [0, 1, 8, 9, 10, 11]
    assert cache.write_start == 3


def test_ring_repeated_writes_land_in_the_same_slots():
    """
    denoising writes of chunk 2 (values 100+pos, then 200+pos, then the clean pass):
    [0, 1, 106, 107, 108, 5] -> [0, 1, 206, 207, 208, 5] -> [0, 1, 6, 7, 8, 5]
    """
    ring = _tiny(RingCache, 2, 4, 3)
    _step(ring, 0)
    _step(ring, 1)
    ring.begin_chunk(2)
    x = torch.tensor([6.0, 7.0, 8.0]).view(1, 3, 1, 1)
    for offset, want in ((100, [0, 1, 106, 107, 108, 5]), (200, [0, 1, 206, 207, 208, 5]), (0, [0, 1, 6, 7, 8, 5])):
        ring.write(x + offset, x + offset)
        assert ring.keys().flatten().tolist() == want
    ring.commit_chunk(2)
    # reopening chunk 2 reuses its slots; nothing else moves
    ring.begin_chunk(2)
    ring.write(x + 300, x + 300)
    ring.commit_chunk(2)
    assert ring.keys().flatten().tolist() == [0, 1, 306, 307, 308, 5]


def test_ring_reset_keeps_the_buffer_and_starts_over():
    """
    after 3 chunks:  [0, 1, 6, 7, 8, 5]
    reset, chunk 0:  [0, 1, 2, ., ., .]   (stale rows 3.. are not valid)
    """
    ring = _tiny(RingCache, 2, 4, 3)
    ptr = ring.keys().data_ptr()
    for c in range(3):
        _step(ring, c)
    ring.reset()
    assert ring.num_valid == 0 and ring.slot_positions[0, 0].tolist() == [-1] * 6
    _step(ring, 0)
    assert _buf(ring) == [0, 1, 2, ".", ".", "."]
    assert ring.keys().data_ptr() == ptr


def test_ring_unaligned_sink1_window5_chunk2():
    """
    sink 1 (half a chunk), window 5 (not a multiple of 2):
    chunk 2: [0, 1, 2, 3, 4, 5]
    chunk 3: [0, 6, 7, 3, 4, 5]    6 -> slot 1, 7 -> slot 2
    chunk 4: [0, 6, 7, 8, 9, 5]
    chunk 5: [0, 11, 7, 8, 9, 10]  the chunk wraps across the end: slots 5, 1
    """
    ring = _tiny(RingCache, 1, 5, 2)
    want = {2: [0, 1, 2, 3, 4, 5], 3: [0, 6, 7, 3, 4, 5], 4: [0, 6, 7, 8, 9, 5], 5: [0, 11, 7, 8, 9, 10]}
    for c in range(6):
        _step(ring, c)
        if c in want:
            assert _buf(ring) == want[c]
    assert ring.write_slots[0, 0].tolist() == [5, 1]
