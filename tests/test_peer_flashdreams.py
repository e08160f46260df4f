"""Peer test: flashdreams 0.1.0's BlockKVCache (loaded by file path) against our caches.

Over random legal call sequences on the layouts BlockKVCache supports
(``(sink + window) % chunk == 0``): ``ChronologicalCache`` and ``CircularBlockKVCache``
hold exactly its chronological contents; attention over the ring's physical buffer
equals attention over its buffer to rounding; ``size``, ``is_steady_state`` and
``write_end`` (before the first eviction) agree.
"""

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from streamkv import ChronologicalCache
from streamkv.compat.flashdreams import CircularBlockKVCache

H, D = 2, 4


@st.composite
def layouts(draw):
    chunk = draw(st.integers(1, 4))
    sink = draw(st.integers(0, 2 * chunk))
    window = draw(st.integers(chunk, 4 * chunk))
    # BlockKVCache needs (sink + window) % chunk == 0: round the window up
    window += (-(sink + window)) % chunk
    return sink, window, chunk


@st.composite
def call_sequences(draw):
    ops = []
    n_chunks = draw(st.integers(1, 14))
    for c in range(n_chunks):
        ops.append(("step", c, draw(st.integers(1, 3))))
        if draw(st.booleans()):
            ops.append(("step", c, 1))  # the same chunk index again
        if draw(st.integers(0, 12)) == 0:
            ops.append(("reset", -1, 0))
            break
    return ops


@settings(max_examples=150, deadline=None)
@given(layout=layouts(), ops=call_sequences(), seed=st.integers(0, 2**16))
def test_matches_block_kv_cache(BlockKVCache, layout, ops, seed):
    sink, window, chunk = layout
    cap = sink + window
    gen = torch.Generator().manual_seed(seed)
    shape = (1, cap, H, D)
    fd = BlockKVCache(k_shape=shape, v_shape=shape, seq_dim=-3, chunk_size=chunk, window_size=window,
                      sink_size=sink, device="cpu", dtype=torch.float32)
    ring = CircularBlockKVCache(shape, shape, -3, chunk, window, sink, device="cpu", dtype=torch.float32)
    chron = ChronologicalCache(shape, shape, seq_dim=-3, sink=sink, window=window, chunk=chunk)
    stream_chunk = 0
    for op, c, writes in ops:
        if op == "reset":
            fd.reset()
            ring.reset()
            chron.reset()
            break
        fd.before_update(c)
        ring.before_update(c)
        chron.begin_chunk(c)
        assert ring.is_steady_state() == fd.is_steady_state()
        assert ring.size == fd.size == chron.num_valid
        if (c + 1) * chunk <= cap:
            assert ring.write_end == fd.write_end
        for _ in range(writes):
            k = torch.randn(1, chunk, H, D, generator=gen)
            v = torch.randn(1, chunk, H, D, generator=gen)
            fd.update(k, v)
            ring.update(k, v)
            chron.write(k, v)
            want_k, want_v = fd.cached_k(), fd.cached_v()
            n = chron.num_valid
            assert torch.equal(chron.keys().narrow(1, 0, n), want_k) and torch.equal(chron.values().narrow(1, 0, n), want_v)
            assert torch.equal(ring.ring.chronological_keys(), want_k)
            assert torch.equal(ring.ring.chronological_values(), want_v)
            q = torch.randn(1, H, chunk, D, generator=gen)
            want = F.scaled_dot_product_attention(q, want_k.transpose(1, 2), want_v.transpose(1, 2))
            got = F.scaled_dot_product_attention(q, ring.cached_k().transpose(1, 2), ring.cached_v().transpose(1, 2))
            assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
        fd.after_update(c)
        ring.after_update(c)
        chron.commit_chunk(c)
        stream_chunk = c
    assert stream_chunk >= 0


def test_from_tensor_matches(BlockKVCache):
    k = torch.randn(1, 5, H, D)
    v = torch.randn(1, 5, H, D + 1)
    fd = BlockKVCache.from_tensor(k, v, seq_dim=-3)
    ours = CircularBlockKVCache.from_tensor(k, v, seq_dim=-3)
    assert torch.equal(ours.cached_k(), fd.cached_k()) and torch.equal(ours.cached_v(), fd.cached_v())
    assert ours.size == fd.size == 5
    assert ours.is_steady_state() == fd.is_steady_state()
