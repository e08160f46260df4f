"""Forks of the drop-ins: the Self-Forcing per-block dicts (and the sglang-interface cache under
them) built with ``pages=`` continue one prefix in several branches, each equal to Self-Forcing's
own dicts copied at the fork and fed the same chunks (float64, over wraps, with sinks and a local
attention window); without pages a fork is refused with the reason, and a refusal changes nothing."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import assert_same_state, snapshot
from streamkv.compat.sglang import RingCausalSelfAttentionKVCache
from streamkv.compat.self_forcing import SelfForcingKVCache, fork_self_forcing_caches, self_forcing_kv_caches
from test_self_forcing import B, D, F64, H, LAYERS, TinyModel, _plain_dicts, _sdpa, plain_cache_attention

SIZE, SINK, ATTN, N = 12, 3, 10, 3
ULPS = 4 * torch.finfo(F64).eps  # equal to rounding: a few float64 ulps of the outputs' scale


def _chunk(model, x, start, plain, ring, steps=2, g=None):
    """Denoising steps and the clean pass of one chunk through both caches; the outputs' max |diff|
    in units of their scale (the tiny model's outputs reach 1e5, where one float64 ulp is 1.5e-11)."""
    def attend_plain(i, q, k, v, s):
        return plain_cache_attention(plain[i], q, k, v, s, sink=SINK, max_attention=ATTN, rolling=True)

    def attend_ring(i, q, k, v, s):
        return _sdpa(q, *ring[i].update(k, v, s))

    worst = 0.0
    for _ in range(steps):
        want, got = model.forward(x, start, attend_plain), model.forward(x, start, attend_ring)
        worst = max(worst, _rel(got, want))
        x = torch.randn(x.shape, generator=g, dtype=F64)
    want, got = model.forward(want, start, attend_plain), model.forward(want, start, attend_ring)
    return max(worst, _rel(got, want)), got


def _rel(got, want):
    return float((got - want).abs().max() / want.abs().max().clamp(min=1.0))


def test_branches_equal_self_forcings_dicts_copied_at_the_fork():
    model, g = TinyModel(0), torch.Generator().manual_seed(1)
    plain = _plain_dicts(SIZE)
    ring = self_forcing_kv_caches(LAYERS, B, SIZE, H, D, sink_tokens=SINK, attention_tokens=ATTN, dtype=F64,
                                  pages={"spare": 16})
    start = 0
    for _ in range(5):  # past the first wrap
        diff, _ = _chunk(model, torch.randn(B, N, H * D, generator=g, dtype=F64), start, plain, ring, g=g)
        assert diff <= ULPS
        start += N
    pool = ring[0].ring_cache.ring.storage.store.table.pool
    own = pool.used
    branches = fork_self_forcing_caches(ring, 3)
    assert pool.used == own  # no K/V copied
    copies = [copy.deepcopy(plain) for _ in range(3)]  # Self-Forcing's way: a copy of every dict
    outs = []
    for b, (branch, ref) in enumerate(zip([*branches, ring], [*copies, plain])):  # the parent is one more branch
    # each branch its own noise; several wraps after the fork
        gb, s, last = torch.Generator().manual_seed(100 + b), start, None
        for _ in range(6):
            diff, last = _chunk(model, torch.randn(B, N, H * D, generator=gb, dtype=F64), s, ref, branch, g=gb)
            assert diff <= ULPS, (b, s)
            s += N
        outs.append(last)
    assert (outs[0] - outs[1]).abs().max() > 1e-3  # different noise: different continuations
    assert branches[0][0].ring_cache.ring.wraps >= 3
    for blocks in (*branches, ring):
        for kv in blocks:
            kv.release()
    assert pool.used == 0


def test_a_fork_without_pages_or_before_the_first_chunk_is_refused_and_changes_nothing():
    kv = SelfForcingKVCache(1, 6, 2, 4, sink_tokens=1, dtype=F64)
    with pytest.raises(ValueError, match="holds no tokens|pages"):
        kv.fork(2)
    kv.update(torch.randn(1, 3, 2, 4, dtype=F64), torch.randn(1, 3, 2, 4, dtype=F64), 0)
    before = snapshot(kv.ring_cache)
    with pytest.raises(ValueError, match="k/v buffers its caller allocated"):
        kv.fork(2)
    assert_same_state(before, snapshot(kv.ring_cache))
    paged = [SelfForcingKVCache(1, 6, 2, 4, sink_tokens=1, dtype=F64, pages=True) for _ in range(2)]
    paged[0].update(torch.randn(1, 3, 2, 4, dtype=F64), torch.randn(1, 3, 2, 4, dtype=F64), 0)
    before = [snapshot(p.ring_cache) for p in paged]
    with pytest.raises(ValueError, match="holds no tokens"):  # block 1 never ran: no block forks
        fork_self_forcing_caches(paged, 2)
    for b, p in zip(before, paged):
        assert_same_state(b, snapshot(p.ring_cache))


def test_the_sglang_interface_forks_and_a_fork_closes_the_last_chunk():
    def cache(**kw):
        z = torch.zeros((), dtype=F64).expand(1, 8, 2, 4)
        return RingCausalSelfAttentionKVCache(z, z, torch.zeros(1, dtype=torch.long),
                                              torch.zeros(1, dtype=torch.long), 0, 0, sink_tokens=2, **kw)

    c = cache(pages=True)
    k, v = torch.randn(1, 2, 2, 4, dtype=F64), torch.randn(1, 2, 2, 4, dtype=F64)
    c.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    (b,) = c.fork(1)
    assert b.global_end_index is not c.global_end_index and int(b.global_end_index) == 2
    with pytest.raises(ValueError, match="rewrite"):  # the last chunk was closed by the fork
        c.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    for x in (c, b):  # both continue at the next chunk, on their own pages
        view = x.update_and_get_attention_kv(key=k + 1, value=v, current_chunk_start=2)
        assert view.k.shape[1] == 4
    with pytest.raises(ValueError, match="k/v buffers"):
        d = cache()
        d.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
        d.fork(1)
