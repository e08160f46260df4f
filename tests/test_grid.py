"""The layout grid: every cache against the whole-history reference, after every call."""

import random
import zlib

import pytest
import torch
import torch.nn.functional as F

from streamkv import ChronologicalCache, RingCache
from streamkv_lab.experiments.verify import default_layouts, run_layout, stream_ops
from streamkv.reference import ReferenceCache, reference_attention

LAYOUTS = default_layouts()


def test_grid_has_the_required_coverage():
    assert len(LAYOUTS) >= 48
    sizes = {(g.sink, g.window, g.chunk) for g in LAYOUTS}
    assert len(sizes) == 48
    assert any(g.sink == 0 for g in LAYOUTS)
    assert any(0 < g.sink % g.chunk for g in LAYOUTS)  # partial-chunk sinks
    assert any(g.sink and g.sink % g.chunk == 0 for g in LAYOUTS)  # whole-chunk sinks
    assert any(g.window % g.chunk for g in LAYOUTS) and any(g.window % g.chunk == 0 for g in LAYOUTS)
    assert {g.seq_dim for g in LAYOUTS} == {1, -3}
    assert len({g.chunk for g in LAYOUTS}) >= 3


def _movement_check(cache, before_k, rows_allowed):
    """Rows outside ``rows_allowed`` are bit-identical to ``before_k``."""
    seq = cache.seq_dim
    after = cache.keys()
    keep = [s for s in range(cache.layout.capacity) if s not in rows_allowed]
    idx = torch.tensor(keep, dtype=torch.long)
    assert torch.equal(before_k.index_select(seq, idx), after.index_select(seq, idx))


@pytest.mark.parametrize("g", LAYOUTS, ids=lambda g: g.name)
def test_caches_match_reference_every_call(g):
    rng = random.Random(zlib.crc32(g.name.encode()))
    gen = torch.Generator().manual_seed(7)
    k_shape, v_shape = g.shapes()
    kw = dict(seq_dim=g.seq_dim, sink=g.sink, window=g.window, chunk=g.chunk, dtype=torch.float64)
    ring, chron = RingCache(k_shape, v_shape, **kw), ChronologicalCache(k_shape, v_shape, **kw)
    ref = ReferenceCache(sink=g.sink, window=g.window, chunk=g.chunk, seq_dim=g.seq_dim)
    ptrs = {id(c): (c.keys().data_ptr(), c.values().data_ptr()) for c in (ring, chron)}
    seq = ring.seq_dim
    chunk_k = k_shape[:seq] + (g.chunk,) + k_shape[seq + 1 :]
    chunk_v = v_shape[:seq] + (g.chunk,) + v_shape[seq + 1 :]
    saw_wrap = saw_eviction = False
    for op, c in stream_ops(g, rng):
        if op == "reset":
            for x in (ring, chron, ref):
                x.reset()
            continue
        if op == "begin":
            before = ring.keys().clone()
            for x in (ring, chron, ref):
                x.begin_chunk(c)
            assert torch.equal(ring.keys(), before), "begin_chunk moved ring data"
        elif op == "commit":
            for x in (ring, chron, ref):
                x.commit_chunk(c)
        else:
            k = torch.randn(chunk_k, generator=gen, dtype=torch.float64)
            v = torch.randn(chunk_v, generator=gen, dtype=torch.float64)
            before = ring.keys().clone()
            for x in (ring, chron, ref):
                x.write(k, v)
            _movement_check(ring, before, set(ring.write_slots[0, 0].tolist()))
            rk, rv = ref.chronological_keys(), ref.chronological_values()
            q = torch.randn(k.movedim(seq, -2).shape, generator=gen, dtype=torch.float64)
            want = reference_attention(q, rk.movedim(seq, -2), rv.movedim(seq, -2))
            for cache in (ring, chron):
                assert torch.equal(cache.chronological_keys(), rk)
                assert torch.equal(cache.chronological_values(), rv)
                n = cache.num_valid
                got = F.scaled_dot_product_attention(
                    q, cache.keys().narrow(seq, 0, n).movedim(seq, -2), cache.values().narrow(seq, 0, n).movedim(seq, -2)
                )
                assert (got - want).abs().max().item() < 1e-12
        for cache in (ring, chron):
            assert (cache.keys().data_ptr(), cache.values().data_ptr()) == ptrs[id(cache)]
            # the device position tensor agrees with the host arithmetic
            assert cache.slot_positions.shape == (1, cache.storage.heads, cache.layout.capacity)
            assert (cache.slot_positions == cache.slot_positions[0, 0]).all()  # one plan, broadcast
            pos = cache.slot_positions[0, 0].tolist()
            held = sorted(p for p in pos if p >= 0)
            assert held == sorted(cache.layout.retained_positions(cache.end))
            assert all(p == -1 for p in pos[cache.num_valid :])
            assert pos[: g.sink] == list(range(min(g.sink, cache.end))) + [-1] * max(0, g.sink - cache.end)
        saw_eviction |= ring.end > ring.layout.capacity
        saw_wrap |= ring.wraps >= 2
    assert saw_eviction and saw_wrap


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_verify_grid_physical_attention_within_rounding(dtype, tol):
    """The verify experiment's own numbers (fp64 abs, fp32 relative to the output scale)."""
    for i, g in enumerate(LAYOUTS[::4]):
        r = run_layout(g, dtype=dtype, seed=i)
        assert r.comparisons > 0
        assert r.identical == {"chronological": r.comparisons, "ring": r.comparisons}
        assert max(r.max_attention_diff.values()) < tol


@pytest.mark.parametrize("dtype,k_dim", [(torch.bfloat16, 128), (torch.float16, 4), (torch.float32, 3), (torch.bfloat16, 3)])
def test_ring_write_paths_are_bit_exact(dtype, k_dim):
    """Rows that split into whole int64 words are written through an int64 view of the
    same bytes; other rows through the dtype itself. Both must equal the current path."""
    g = default_layouts()[7]
    cap = g.sink + g.window
    kw = dict(seq_dim=1, sink=g.sink, window=g.window, chunk=g.chunk, dtype=dtype)
    ring = RingCache((2, cap, 3, k_dim), (2, cap, 3, k_dim), **kw)
    chron = ChronologicalCache((2, cap, 3, k_dim), (2, cap, 3, k_dim), **kw)
    assert (ring.storage.store._k_wide is not None) == (k_dim * torch.finfo(dtype).bits // 8 % 8 == 0)
    gen = torch.Generator().manual_seed(0)
    for c in range(3 * cap // g.chunk):
        k = torch.randn(2, g.chunk, 3, k_dim, generator=gen).to(dtype)
        for cache in (ring, chron):
            cache.begin_chunk(c)
            cache.write(k, -k)
            cache.commit_chunk(c)
        assert torch.equal(ring.chronological_keys(), chron.chronological_keys())
        assert torch.equal(ring.chronological_values(), chron.chronological_values())
    # a non-contiguous chunk (last dim strided) still works, through the dtype path
    wide = torch.randn(2, g.chunk, 3, 2 * k_dim, generator=gen).to(dtype)[..., ::2]
    ring.begin_chunk(c + 1)
    ring.write(wide, wide)
    assert torch.equal(ring.keys().index_select(1, ring.write_slots[0, 0]), wide)
