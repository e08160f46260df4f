"""Long streams: 100,000 chunk steps, resets, and exact resume from a state dict."""

import torch

from streamkv import ChronologicalCache, RingCache
from streamkv_lab.measure import probe_transient

S, W, C = 2, 5, 3


def _tensor_bytes(cache):
    return sum(v.nbytes for v in vars(cache).values() if isinstance(v, torch.Tensor))


def _allocations(fn):
    """Allocator events inside ``fn`` (raw profiler events: an op's own alloc + free of a
    temporary counts, unlike its net ``cpu_memory_usage``)."""
    t = probe_transient(fn, "cpu", steps=1)
    return [] if t.allocations == 0 else [(t.allocations, t.allocated_bytes, t.by_op)]


def test_soak_100k_chunk_steps_with_resets():
    ring = RingCache((1, S + W, 1, 1), (1, S + W, 1, 1), seq_dim=1, sink=S, window=W, chunk=C, dtype=torch.float64)
    ptrs = (ring.keys().data_ptr(), ring.values().data_ptr(), ring.slot_positions.data_ptr(), ring.write_slots.data_ptr())
    held_bytes = _tensor_bytes(ring)
    chunk = torch.zeros(1, C, 1, 1, dtype=torch.float64)
    resets_at = {10_000, 25_000, 60_003}
    state = {"c": 0}

    def steps(n):
        for _ in range(n):
            c = state["c"]
            ring.begin_chunk(c)
            ring.write(chunk, chunk)
            ring.commit_chunk(c)
            state["c"] += 1

    total = 0
    for block in range(100):
        if block in (1, 99):  # profile a steady block near the start and at the end
            allocs = _allocations(lambda: steps(1000))
            assert allocs == [], f"ring steps allocated memory: {allocs}"
        else:
            steps(1000)
        total += 1000
        if any(total - 1000 < r <= total for r in resets_at):
            ring.reset()
            state["c"] = 0
    assert total == 100_000
    # positions correct at the end: the last stream ran state["c"] chunks since its reset
    end = state["c"] * C
    assert ring.end == end
    pos = ring.slot_positions[0, 0].tolist()
    assert sorted(pos) == ring.layout.retained_positions(end)
    assert all(pos[ring.layout.ring_slot(p)] == p for p in ring.layout.retained_positions(end))
    assert (ring.keys().data_ptr(), ring.values().data_ptr(), ring.slot_positions.data_ptr(), ring.write_slots.data_ptr()) == ptrs
    assert _tensor_bytes(ring) == held_bytes


def _drive(cache, chunks, start, gen_seed):
    gen = torch.Generator().manual_seed(gen_seed)
    shape = list(cache.k_shape)
    shape[cache.seq_dim] = C
    outs = []
    for c in range(start, start + chunks):
        cache.begin_chunk(c)
        for _ in range(2):
            k = torch.randn(shape, generator=gen)
            cache.write(k, k[..., : cache.v_shape[-1]] * 2)
        cache.commit_chunk(c)
        outs.append((cache.chronological_keys().clone(), cache.keys().clone(), cache.slot_positions.clone()))
    return outs


def test_state_dict_resumes_an_identical_continuation():
    for cls in (RingCache, ChronologicalCache):
        kw = dict(seq_dim=1, sink=S, window=W, chunk=C)
        a = cls((2, S + W, 3, 4), (2, S + W, 3, 2), **kw)
        _drive(a, 7, 0, gen_seed=1)  # past the first eviction, one wrap
        saved = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.state_dict().items()}
        cont_a = _drive(a, 9, 7, gen_seed=2)
        b = cls((2, S + W, 3, 4), (2, S + W, 3, 2), **kw)
        _drive(b, 3, 0, gen_seed=3)  # b holds some other stream
        ptr = b.keys().data_ptr()
        b.load_state_dict(saved)
        assert b.keys().data_ptr() == ptr
        cont_b = _drive(b, 9, 7, gen_seed=2)
        for (ka, pa, sa), (kb, pb, sb) in zip(cont_a, cont_b):
            assert torch.equal(ka, kb) and torch.equal(pa, pb) and torch.equal(sa, sb)


def test_state_dict_with_an_open_chunk_resumes_mid_chunk():
    kw = dict(seq_dim=1, sink=S, window=W, chunk=C)
    a = RingCache((1, S + W, 1, 2), (1, S + W, 1, 2), **kw)
    _drive(a, 5, 0, gen_seed=4)
    a.begin_chunk(5)
    saved = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.state_dict().items()}
    b = RingCache((1, S + W, 1, 2), (1, S + W, 1, 2), **kw)
    b.load_state_dict(saved)
    assert b.open_chunk == 5
    x = torch.ones(1, C, 1, 2)
    for cache in (a, b):
        cache.write(x, x)  # the write metadata was restored: same slots
        cache.commit_chunk(5)
    assert torch.equal(a.keys(), b.keys())
    assert b.write_slots[0, 0].tolist() == a.write_slots[0, 0].tolist()
