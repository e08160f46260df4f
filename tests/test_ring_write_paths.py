"""The ring's write at the floor: eager writes copy slices at the host-known slot ranges, the
index path (the device plan) stays for traced and captured writes; both put the same bytes in
the same slots, over fills, wraps, reopens, partial spans, resets and state-dict loads."""

from __future__ import annotations

import random

import pytest
import torch

from streamkv.caches import RingCache, TOVACache
from streamkv_lab.measure import count_dispatch, probe_transient

LAYOUTS = [
    # sink, window, chunk, layout, dtype
    (0, 9, 3, "BTHD", torch.float32),  # window a whole number of chunks: never wraps mid-chunk
    (2, 7, 3, "BTHD", torch.bfloat16),  # wraps mid-chunk, a sink, 2-byte elements (the int64 view)
    (3, 5, 2, "BHTD", torch.float32),
    (1, 4, 4, "THD", torch.float64),
]


def _shapes(layout: str, S: int, C: int, B: int = 2, H: int = 3, D: int = 4):
    if layout == "BTHD":
        return (B, S, H, D), 1, (B, C, H, D)
    if layout == "BHTD":
        return (B, H, S, D), 2, (B, H, C, D)
    return (S, H, D), 0, (C, H, D)


def _pair(sink: int, window: int, chunk: int, layout: str, dtype: torch.dtype, wrap_slices: bool = True):
    shape, seq, _ = _shapes(layout, sink + window, chunk)
    mk = lambda: RingCache(shape, shape, seq_dim=seq, sink=sink, window=window, chunk=chunk, num_layers=2,  # noqa: E731
                           dtype=dtype)
    fast, index = mk(), mk()
    index.storage.store.eager_slices = False
    if wrap_slices:  # small test spans: take the two-slice path where they wrap, too
        fast.storage.store.wrap_slices_min_bytes = 0
    return fast, index, seq


def _same(a: RingCache, b: RingCache) -> None:
    for x, y in ((a.storage.keys, b.storage.keys), (a.storage.values, b.storage.values),
                 (a.storage.positions, b.storage.positions), (a.storage.plan, b.storage.plan)):
        assert torch.equal(x.view(torch.uint8) if x.is_floating_point() else x,
                           y.view(torch.uint8) if y.is_floating_point() else y)


@pytest.mark.parametrize("sink,window,chunk,layout,dtype", LAYOUTS)
def test_eager_slices_equal_the_index_path(sink, window, chunk, layout, dtype):
    fast, index, seq = _pair(sink, window, chunk, layout, dtype)
    rng = random.Random(sink * 100 + window)
    gen = torch.Generator().manual_seed(window)
    seen = {"wrap": 0, "one": 0, "reopen": 0, "partial": 0, "load": 0, "reset": 0}
    saved = None
    for step in range(120):
        caches = (fast, index)
        if not fast.is_open:
            r = rng.random()
            if r < 0.05 and step > 10:
                for c in caches:
                    c.reset()
                seen["reset"] += 1
                continue
            if r < 0.12 and saved is not None:
                for c, s in zip(caches, saved):
                    c.load_state_dict(s)
                seen["load"] += 1
                _same(fast, index)
                continue
            if r < 0.22 and fast.end % chunk == 0 and fast.last_span and fast.last_span[1] == chunk:
                for c in caches:
                    c.begin_chunk(c.next_chunk - 1)  # reopen the last chunk
                seen["reopen"] += 1
            elif r < 0.32 or fast.end % chunk:
                n = rng.randint(1, chunk)
                for c in caches:
                    c.begin_tokens(n)
                seen["partial"] += 1
            else:
                for c in caches:
                    c.begin_chunk(c.next_chunk)
            ranges = fast.storage.eager_ranges
            seen["wrap" if len(ranges) == 2 else "one"] += 1
            n = fast.open_span[1]
            want = [s for a, m in ranges for s in range(a, a + m)]
            assert want == fast.write_slots[0, 0, :n].tolist() == fast.policy.expected_plan(*fast.open_span)
            _same(fast, index)
        n = fast.open_span[1]
        _, _, rows = _shapes(layout, sink + window, n)
        for layer in range(2):
            k = torch.randn(rows, generator=gen).to(dtype)
            v = torch.randn(rows, generator=gen).to(dtype)
            for c in caches:
                c.write(k, v, layer=layer)
        _same(fast, index)
        if rng.random() < 0.5:
            for c in caches:
                c.commit()
            _same(fast, index)
            if rng.random() < 0.3:
                saved = [c.state_dict() for c in caches]
    assert seen["one"] and seen["reopen"] and seen["partial"] and seen["load"] and seen["reset"], seen
    if window % chunk:
        assert seen["wrap"], seen


def test_the_eager_write_copies_slices_and_the_index_path_indexes():
    """The fast path is taken (no indexed write is dispatched), the switch turns it off, and a
    wrapping span writes two slices per tensor."""
    fast, index, seq = _pair(2, 7, 3, "BTHD", torch.bfloat16)
    k = torch.randn(2, 3, 3, 4).to(torch.bfloat16)
    ops = {"fast": [], "index": []}
    for c in range(8):
        for cache, name in ((fast, "fast"), (index, "index")):
            cache.begin_chunk(c)
            got = count_dispatch(lambda: cache.write(k, k, layer=1))
            ops[name].append((len(cache.storage.eager_ranges), got.by_op))
            cache.commit_chunk(c)
    for ranges, by_op in ops["fast"]:
        assert "index_copy_" not in by_op and by_op["copy_"] == 2 * ranges
    assert any(r == 2 for r, _ in ops["fast"])  # a span wrapped
    assert all(by_op.get("index_copy_") == 2 for _, by_op in ops["index"])
    _same(fast, index)
    # below wrap_slices_min_bytes a wrapping span goes through the index path, a whole range never does
    small, _, _ = _pair(2, 7, 3, "BTHD", torch.bfloat16, wrap_slices=False)
    for c in range(8):
        small.begin_chunk(c)
        by_op = count_dispatch(lambda: small.write(k, k, layer=0)).by_op
        wraps = len(small.storage.eager_ranges) == 2
        assert ("index_copy_" in by_op) == wraps, (c, by_op)
        small.commit_chunk(c)


def test_a_compiled_write_follows_the_device_plan():
    """Compiled once, the write lands in every later chunk's slots (fills, wraps, a reset), with no
    recompilation, and it reads no host range: with the host ranges made wrong on purpose, the
    compiled write is still right (an eager write then goes astray: the control)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    shape = (1, 9, 2, 4)
    cache = RingCache(shape, shape, seq_dim=1, sink=2, window=7, chunk=3, num_layers=1)
    ref = RingCache(shape, shape, seq_dim=1, sink=2, window=7, chunk=3, num_layers=1)
    ref.storage.store.eager_slices = False
    cnt = CompileCounter()
    compiled = torch.compile(lambda k, v: cache.write(k, v), backend=cnt, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for stream in range(2):
            for c in range(10):
                for x in (cache, ref):
                    x.begin_chunk(c)
                k, v = torch.randn(1, 3, 2, 4, generator=gen), torch.randn(1, 3, 2, 4, generator=gen)
                if c % 3 == 2:
                    cache.storage.eager_ranges = ((0, 3),)  # wrong on purpose: only the plan is right
                compiled(k, v)
                ref.write(k, v)
                assert torch.equal(cache.storage.keys, ref.storage.keys), (stream, c)
                assert torch.equal(cache.storage.values, ref.storage.values), (stream, c)
                for x in (cache, ref):
                    x.commit_chunk(c)
            for x in (cache, ref):
                x.reset()
        assert cnt.frame_count == 1
        # the control: the same wrong ranges send an eager write astray
        for x in (cache, ref):
            x.begin_chunk(0)
        cache.storage.eager_ranges = ((5, 3),)
        k = torch.randn(1, 3, 2, 4, generator=gen)
        cache.write(k, k)
        ref.write(k, k)
        assert not torch.equal(cache.storage.keys, ref.storage.keys)
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", [RingCache, TOVACache])
def test_an_inductor_compiled_write_allocates_nothing(kind):
    """Under inductor the write is an in-place indexed write into the flattened buffer: no
    temporary per call (through the layer's select, inductor copied the whole layer)."""
    torch._dynamo.reset()
    shape = (1, 12, 2, 8)
    cache = kind(shape, shape, seq_dim=1, sink=0, window=12, chunk=3, num_layers=2)
    ref = kind(shape, shape, seq_dim=1, sink=0, window=12, chunk=3, num_layers=2)
    compiled = torch.compile(lambda k, v: cache.write(k, v, layer=1), fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for c in range(6):
            for x in (cache, ref):
                x.begin_chunk(c)
            k, v = torch.randn(1, 3, 2, 8, generator=gen), torch.randn(1, 3, 2, 8, generator=gen)
            compiled(k, v)
            ref.write(k, v, layer=1)
            if c == 5:
                mem = probe_transient(lambda: compiled(k, v), "cpu", steps=1)
            assert torch.equal(cache.storage.keys, ref.storage.keys)
            for x in (cache, ref):
                if x.needs_queries:
                    for layer in range(2):
                        st = torch.full((2, 12), 1.0 / 12, dtype=torch.float64)
                        x.policy.receive(layer, st, st)
                x.commit_chunk(c)
    aten = {op: n for op, n in mem.by_op.items() if op.startswith("aten::")}
    assert aten == {} and mem.allocations == 0, mem
    torch._dynamo.reset()
