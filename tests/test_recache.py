"""Re-cache in place: a held span's K/V rewritten in its own slots equals rebuilding the cache
from scratch with the new K/V (window kinds, RoPE at write and raw keys alike); per-head kinds
rewrite exactly the (slot, head) pairs that hold the span; refusals change nothing."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_state, snapshot
from kinds import SCORED, params
from kinds import WINDOW as WINDOW_KINDS

from streamkv import CACHE_KINDS
from streamkv.attention import attend
from streamkv.recache import recache
from streamkv.rope_at_read import RopeAtRead
from streamkv.rotary import Rope1D

SINK, WINDOW, CHUNK, H, D = 2, 7, 3, 2, 8


def _build(kind, raw=False, **kw):
    rope = RopeAtRead(Rope1D(D), "cache_relative") if raw else None
    return CACHE_KINDS[kind]((1, SINK + WINDOW, H, D), (1, SINK + WINDOW, H, D), seq_dim=1, sink=SINK, window=WINDOW,
                             chunk=CHUNK, num_layers=2, dtype=torch.float64, rope_at_read=rope, **params(kind), **kw)


def _stream(cache, ks, vs, qs):
    for c in range(len(ks)):
        cache.begin_chunk(c)
        for layer in range(2):
            cache.layer(layer).update(ks[c][layer], vs[c][layer], qs[c])
            if cache.needs_queries:
                attend(qs[c], cache.layer(layer).read())
        cache.commit_chunk(c)


def _history(chunks, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, CHUNK, H, D, generator=g, dtype=torch.float64) for _ in range(2)] for _ in range(chunks)]


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("kind", WINDOW_KINDS)
def test_recache_equals_rebuilding_from_scratch(kind, raw):
    ks, vs = _history(9, 0), _history(9, 1)
    qs = [t[0] for t in _history(9, 2)]
    cache = _build(kind, raw)
    _stream(cache, ks, vs, qs)
    held = cache.chronological_positions()
    span = [p for p in held if p >= SINK][:4]  # part of the window, across a chunk boundary
    start, n = span[0], len(span)
    nk = torch.randn(1, n, H, D, dtype=torch.float64)
    nv = torch.randn(1, n, H, D, dtype=torch.float64)
    nk2, nv2 = nk * 2, nv - 1
    assert recache(cache, start, nk, nv, layer=0) == n * H
    assert recache(cache, 0, nk2[:, :SINK], nv2[:, :SINK], layer=1) == SINK * H  # the sinks, another layer
    ks2 = [[x.clone() for x in c] for c in ks]
    vs2 = [[x.clone() for x in c] for c in vs]
    for i, p in enumerate(range(start, start + n)):
        ks2[p // CHUNK][0][:, p % CHUNK] = nk[:, i]
        vs2[p // CHUNK][0][:, p % CHUNK] = nv[:, i]
    for p in range(SINK):
        ks2[p // CHUNK][1][:, p % CHUNK] = nk2[:, p]
        vs2[p // CHUNK][1][:, p % CHUNK] = nv2[:, p]
    rebuilt = _build(kind, raw)
    _stream(rebuilt, ks2, vs2, qs)
    assert torch.equal(cache.storage.keys, rebuilt.storage.keys) and torch.equal(cache.storage.values, rebuilt.storage.values)
    assert torch.equal(cache.slot_positions, rebuilt.slot_positions)
    for c in (cache, rebuilt):
        c.begin_chunk(9)
    q, k, v = (torch.randn(1, CHUNK, H, D, dtype=torch.float64) for _ in range(3))
    a, _ = attend(q, cache.layer(0).update(k, v))
    b, _ = attend(q, rebuilt.layer(0).update(k, v))
    assert torch.equal(a, b)


@pytest.mark.parametrize("kind", SCORED)
def test_per_head_recache_writes_exactly_the_heads_that_hold_the_span(kind):
    ks, vs = _history(8, 0), _history(8, 1)
    qs = [t[0] for t in _history(8, 2)]
    cache = _build(kind)
    _stream(cache, ks, vs, qs)
    pos = cache.layer_slot_positions(0).clone()
    before_k, before_v = cache.keys(0).clone(), cache.values(0).clone()
    start = int(pos[pos >= SINK].min())
    n = min(9, cache.end - start)
    nk, nv = torch.randn(1, n, H, D, dtype=torch.float64), torch.randn(1, n, H, D, dtype=torch.float64)
    written = recache(cache, start, nk, nv, layer=0)
    hit = (pos >= start) & (pos < start + n)
    same = all(set(pos[h].tolist()) == set(pos[0].tolist()) for h in range(H))
    if same:  # a rule that kept the same positions in every head here (SnapKV on this stream: the newest)
        assert written == int(hit.sum()) == H * int(hit[0].sum()) > 0
    else:  # the heads hold different parts of the span
        assert written == int(hit.sum()) and 0 < written < n * H
    for h in range(H):
        for s in range(pos.shape[1]):
            got_k, got_v = cache.keys(0)[0, s, h], cache.values(0)[0, s, h]
            if hit[h, s]:
                r = int(pos[h, s]) - start
                assert torch.equal(got_k, nk[0, r, h]) and torch.equal(got_v, nv[0, r, h])
            else:
                assert torch.equal(got_k, before_k[0, s, h]) and torch.equal(got_v, before_v[0, s, h])
    assert torch.equal(cache.layer_slot_positions(0), pos)


def test_refusals_change_nothing():
    cache = _build("ring")
    _stream(cache, _history(6, 0), _history(6, 1), [t[0] for t in _history(6, 2)])
    snap = snapshot(cache)
    good = torch.randn(1, 2, H, D, dtype=torch.float64)
    cases = [
        (ValueError, "no longer held", lambda: recache(cache, SINK, good, good, layer=0)),
        (ValueError, "past the stream's end", lambda: recache(cache, cache.end - 1, good, good, layer=0)),
        (ValueError, "must have shape", lambda: recache(cache, cache.end - 2, good, good[..., :4], layer=0)),
        (TypeError, "dtype", lambda: recache(cache, cache.end - 2, good.float(), good.float(), layer=0)),
        (ValueError, "shares memory", lambda: recache(cache, cache.end - 2, cache.keys(0)[:, :2], good, layer=0)),
        (ValueError, "layer must be", lambda: recache(cache, cache.end - 2, good, good, layer=5)),
        (ValueError, "rows at seq_dim", lambda: recache(cache, 0, good[:, :0], good[:, :0], layer=0)),
    ]
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()
        assert_same_state(snap, snapshot(cache))
    cache.add_eviction_listener(lambda e: None)
    with pytest.raises(RuntimeError, match="observers"):
        recache(cache, cache.end - 2, good, good, layer=0)


def test_a_ring_with_recall_slots_refuses_evicted_positions_and_rewrites_held_ones():
    """Recall slots make a window cache's slots per head, but what its window holds is still the
    window: an evicted position that no recall slot holds is refused (it wrote nothing, silently),
    a held one is rewritten in every head."""
    cache = _build("ring", recall_slots=2)
    _stream(cache, _history(6, 0), _history(6, 1), [t[0] for t in _history(6, 2)])
    snap = snapshot(cache)
    good = torch.randn(1, 2, H, D, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"positions \[2, 3\] are no longer held by this ring cache .* nor by any of "
                                         r"its 2 recall slots per head"):
        recache(cache, SINK, good, good, layer=0)
    assert_same_state(snap, snapshot(cache))
    start = cache.end - 2
    assert recache(cache, start, good, good, layer=0) == 2 * H
    slots = [cache.layer_slot_positions(0)[0].tolist().index(p) for p in (start, start + 1)]
    assert torch.equal(cache.keys(0)[:, slots], good) and torch.equal(cache.values(0)[:, slots], good)


def test_a_recache_on_a_branch_copies_shared_pages_first():
    """A paged branch shares its parent's pages: a re-cache writes through its own page table and
    copies a shared page first (it wrote slot indices as buffer rows, into the parent's pages)."""
    from streamkv import KVCache

    def build(pages):
        return KVCache((1, 10, 2, 4), (1, 10, 2, 4), seq_dim=1, sink=2, window=8, chunk=2, policy="ring",
                       dtype=torch.float64, pages=pages)

    g = torch.Generator().manual_seed(0)
    parent, ref = build({"history": 2, "spare": 8}), build(None)
    for c in range(3):
        k = torch.randn(1, 2, 2, 4, generator=g, dtype=torch.float64)
        for x in (parent, ref):
            x.begin_chunk(c), x.write(k, k), x.commit_chunk(c)
    before = parent.keys(0).clone()
    (branch,) = parent.fork()
    for c in range(3, 5):
        k = torch.randn(1, 2, 2, 4, generator=g, dtype=torch.float64)
        for x in (branch, ref):
            x.begin_chunk(c), x.write(k, k), x.commit_chunk(c)
    new = torch.full((1, 2, 2, 4), 7.0, dtype=torch.float64)
    assert recache(branch, 2, new, new) == recache(ref, 2, new, new)
    assert torch.equal(parent.keys(0), before)  # the parent's pages are untouched
    assert torch.equal(branch.keys(0), ref.keys(0)) and torch.equal(branch.values(0), ref.values(0))
    parent.rewind(2)  # a kept boundary's pages are untouched too
    assert torch.equal(parent.keys(0)[:, :4], before[:, :4])
