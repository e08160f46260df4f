"""Peer test: sglang 0.5.23's ``CausalSelfAttentionKVCache`` (the real class, loaded by file path)
against :class:`~streamkv.compat.sglang.RingCausalSelfAttentionKVCache`.

Over seeded random call sequences on random layouts (sinks, global sinks, attention windows
smaller and larger than the buffer, growth, head slices, recent-window views, pins, resets,
window changes), every call is made on both: when sglang raises, the drop-in raises too; when
the drop-in refuses, the refusal is one of its documented ones and its state is unchanged;
otherwise attention (float64) over the two views agrees to 1e-12 and so do the cursors and the
view's indices. Targeted tests pin the production shapes of the three models sglang serves.
"""

from __future__ import annotations

import collections
import random
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_same_state, snapshot
from streamkv.compat.sglang import CausalAttentionKVView, CausalSelfAttentionKVCache, RingCausalSelfAttentionKVCache
from streamkv_lab.bench.peers import load_sglang_causal_kv_cache

F64 = torch.float64
#: the drop-in's documented refusals (module docstring), by the words of their messages
REFUSALS = {
    "gap_or_straddle": r"starts past global_end_index|straddles global_end_index",
    "rewrite_not_last": r"a rewrite must be the last chunk, whole",
    "ring_cannot_hold": r"so the ring cannot hold the same tokens",
    "unwritten_view": r"sglang's view would read slots .* never written",
    "head_slice": r"this cache serves heads",
}


@pytest.fixture(scope="session")
def SGLangCache() -> type:
    cls = load_sglang_causal_kv_cache()
    if cls is None:
        pytest.fail("sglang 0.5.23 is a test dependency: pip install --no-deps sglang==0.5.23 (make test does)")
    return cls


def _kwargs(B, L, H, D, **cfg):
    return dict(k=torch.zeros(B, L, H, D, dtype=F64), v=torch.zeros(B, L, H, D + 1, dtype=F64),
                global_end_index=torch.zeros(1, dtype=torch.long), local_end_index=torch.zeros(1, dtype=torch.long),
                global_end_index_int=0, local_end_index_int=0, **cfg)


def _pair(SGLangCache, B, L, H, D, **cfg):
    return SGLangCache(**_kwargs(B, L, H, D, **cfg)), RingCausalSelfAttentionKVCache(**_kwargs(B, L, H, D, **cfg))


def _attention(q, view):
    return F.scaled_dot_product_attention(q.transpose(1, 2), view.k.transpose(1, 2), view.v.transpose(1, 2)).transpose(1, 2)


def _assert_same(s, o, vs, vo, gen, where=""):
    """The two calls agree: cursors, view indices, view size and attention over the views."""
    assert (s.global_end_index_int, s.local_end_index_int) == (o.global_end_index_int, o.local_end_index_int), where
    assert int(s.global_end_index) == int(o.global_end_index) and int(s.local_end_index) == int(o.local_end_index)
    assert (s.pinned_start, s.pinned_len, s.cache_size, s.attention_window_size) == (
        o.pinned_start, o.pinned_len, o.cache_size, o.attention_window_size), where
    assert (vs.local_start_index, vs.local_end_index, vs.visible_local_end, vs.visible_global_end) == (
        vo.local_start_index, vo.local_end_index, vo.visible_local_end, vo.visible_global_end), where
    assert vs.k.shape == vo.k.shape and vs.v.shape == vo.v.shape, where
    if vs.k.shape[1]:
        q = torch.randn(vs.k.shape[0], 3, vs.k.shape[2], vs.k.shape[3], generator=gen, dtype=F64)
        want, got = _attention(q, vs), _attention(q, vo)
        assert (got - want).abs().max().item() <= 1e-12 * max(1.0, want.abs().max().item()), where


def _call(s, o, seen, **kw):
    """Call both; returns the two views, or None when either raised (after checking the raise)."""
    before = snapshot(o)
    try:
        vs = s.update_and_get_attention_kv(**kw)
    except (ValueError, RuntimeError):
        with pytest.raises((ValueError, RuntimeError, TypeError)):
            o.update_and_get_attention_kv(**kw)
        assert_same_state(before, snapshot(o))
        seen["both_raise"] += 1
        return None
    try:
        vo = o.update_and_get_attention_kv(**kw)
    except (ValueError, RuntimeError) as exc:
        kinds = [k for k, pat in REFUSALS.items() if re.search(pat, str(exc))]
        assert kinds, f"undocumented refusal: {exc}"
        assert_same_state(before, snapshot(o))
        seen["refused:" + kinds[0]] += 1
        return None
    return vs, vo


def _random_sequence(SGLangCache, seed, seen):
    r, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    B, H, D = r.choice([1, 2]), r.choice([1, 2, 3]), 4
    N = r.randint(2, 14)
    sink = r.choice([0, 0, r.randint(0, N - 1)])
    cfg = dict(cache_size=N, sink_tokens=sink, global_sink_tokens=r.choice([0, 0, sink, r.randint(0, N - 1)]),
               attention_window_size=r.choice([0, 0, 0, r.randint(1, N + 2)]), allow_growth=r.random() < 0.15)
    h = r.randint(1, H - 1) if H > 1 and r.random() < 0.25 else H
    h0 = r.randint(0, H - h) if h < H else None
    s, o = _pair(SGLangCache, B, N, H, D, **cfg)
    biggest = N if r.random() < 0.1 else max(1, N - max(sink, cfg["global_sink_tokens"]))
    recent_mode, last = r.random() < 0.3, None
    for step in range(30):
        u = r.random()
        if u < 0.08:
            m = r.randint(0, (last[1] if last else 2) + 1)
            s.pin_current_chunk(m)
            o.pin_current_chunk(m)
            continue
        if u < 0.10:
            s.reset_pinned_sink()
            o.reset_pinned_sink()
            continue
        if u < 0.12:
            s.reset_indices()
            o.reset_indices()
            last = None
            continue
        if u < 0.14:
            w = r.randint(0, N + 2)
            s.attention_window_size = o.attention_window_size = w
            continue
        G = s.global_end_index_int
        if last is not None and u < 0.45:  # a denoising step or the clean pass: the same chunk again
            start, n = last
            if r.random() < 0.05:
                start, n = max(0, G - r.randint(1, 5)), r.randint(1, 3)
        else:
            start, n = G, r.randint(1, biggest)
            if r.random() < 0.03:
                start += r.randint(1, 2)
            elif r.random() < 0.03 and G:
                start, n = G - 1, max(n, 2)
        recent = r.choice([None, 0, r.randint(0, N)]) if recent_mode else None
        if r.random() < 0.01:
            recent = -1
        k = torch.randn(B, n, h, D, generator=gen, dtype=F64)
        v = torch.randn(B, n, h, D + 1, generator=gen, dtype=F64)
        views = _call(s, o, seen, key=k, value=v, current_chunk_start=start, cache_head_start=h0,
                      recent_window_tokens=recent)
        if views is None:
            return  # the two may have diverged (sglang changes state before some of its checks)
        _assert_same(s, o, *views, gen, where=f"seed {seed} step {step}")
        last = (start, n)
        seen["compared"] += 1
        seen["evicting"] += o.global_end_index_int > o.cache_size
        seen["copied_view"] += views[1].k.data_ptr() != o.ring.keys(0).data_ptr() or views[1].k.shape[1] < o.ring.num_valid
        seen["global_sinks"] += cfg["global_sink_tokens"] > 0
        seen["pinned"] += o.pinned_start >= 0 and o.pinned_len > 0
        seen["window_below_buffer"] += o.attention_window_size < o.local_end_index_int
        seen["recent"] += recent is not None
        seen["grown"] += o.cache_size > N
        seen["head_slice"] += h < H


def test_random_call_sequences_match_sglang(SGLangCache):
    seen = collections.Counter()
    for seed in range(300):
        _random_sequence(SGLangCache, seed, seen)
    # the comparison is not vacuous: every mode was compared many times, and refusals are a minority
    for key, least in (("compared", 2500), ("evicting", 1200), ("copied_view", 500), ("global_sinks", 800),
                       ("pinned", 150), ("window_below_buffer", 400), ("recent", 500), ("grown", 100),
                       ("head_slice", 300), ("both_raise", 3)):
        assert seen[key] >= least, (key, dict(seen))
    refused = sum(v for k, v in seen.items() if k.startswith("refused:"))
    assert refused < seen["compared"] / 10, dict(seen)


# ============================================================== the production shapes
def _stream(SGLangCache, chunks, n, *, steps=3, cuts=(), recent=None, seed=0, **cfg):
    """A model's call pattern on one block: per chunk ``steps`` denoising calls and a clean one,
    then (at a scene cut) a pin; returns the pair."""
    gen = torch.Generator().manual_seed(seed)
    B, H, D = 1, 2, 4
    s, o = _pair(SGLangCache, B, cfg.pop("cache_size"), H, D, **cfg)
    for c in range(chunks):
        for _ in range(steps + 1):
            k, v = torch.randn(B, n, H, D, generator=gen, dtype=F64), torch.randn(B, n, H, D + 1, generator=gen, dtype=F64)
            kw = dict(key=k, value=v, current_chunk_start=c * n, recent_window_tokens=recent)
            _assert_same(s, o, s.update_and_get_attention_kv(**kw), o.update_and_get_attention_kv(**kw), gen, f"chunk {c}")
        if c in cuts:
            s.pin_current_chunk(n)
            o.pin_current_chunk(n)
    return s, o


def test_krea_self_forcing_shape_no_sink_is_zero_copy(SGLangCache):
    # sglang's causal Wan defaults: 21-frame cache, 3-frame chunks, no sink (frames of 2 tokens here)
    s, o = _stream(SGLangCache, 20, 6, cache_size=42)
    view = o.update_and_get_attention_kv(key=torch.randn(1, 6, 2, 4, dtype=F64), value=torch.randn(1, 6, 2, 5, dtype=F64),
                                         current_chunk_start=19 * 6)
    assert view.k.data_ptr() == o.k.data_ptr() and view.k.shape[1] == 42  # the whole ring buffer, no copy
    assert o.ring.layout.sink == 0 and o.ring.wraps > 0


def test_longlive2_multi_shot_sink(SGLangCache):
    # LongLive 2: 8-frame chunks, 8-frame sink, 32-frame cache, multi-shot global sinks; a scene cut on
    # the chunk right after the sinks (sglang then keeps it as a sink too), another before the cache fills
    s, o = _stream(SGLangCache, 9, 8, cuts=(1, 2), cache_size=32, sink_tokens=8, global_sink_tokens=8)
    s, o = _stream(SGLangCache, 9, 8, cuts=(1,), cache_size=32, sink_tokens=8, global_sink_tokens=8)
    assert o.ring.layout.sink == 16  # the pinned chunk became a sink before the first eviction


def test_longlive2_scene_cuts_after_the_cache_filled(SGLangCache):
    # every scene cut's first chunk slides down to the global sinks and stays there (sglang's
    # multi-shot sink); the ring follows by re-laying out when sglang's frozen prefix changes
    s, o = _stream(SGLangCache, 24, 8, cuts=(1, 6, 11, 17), cache_size=32, sink_tokens=8, global_sink_tokens=8)
    assert o.ring.layout.sink == 16 and s.pinned_start == 8  # the last cut's chunk is frozen next to the sinks
    view = o.update_and_get_attention_kv(key=torch.randn(1, 8, 2, 4, dtype=F64), value=torch.randn(1, 8, 2, 5, dtype=F64),
                                         current_chunk_start=23 * 8)
    assert view.k.data_ptr() == o.k.data_ptr() and view.k.shape[1] == 32  # still the whole buffer, no copy


def test_lingbot_recent_window_views(SGLangCache):
    # LingBot-World: 3-frame sink and chunks, 45-frame cache, interactive recent-window views
    for recent in (0, 3, 9, 40):
        _stream(SGLangCache, 20, 3, recent=recent, cache_size=45, sink_tokens=3)


def test_window_smaller_than_buffer_and_growth(SGLangCache):
    _stream(SGLangCache, 12, 3, cache_size=12, sink_tokens=3, attention_window_size=7)
    _stream(SGLangCache, 12, 3, cache_size=12, sink_tokens=3, global_sink_tokens=3, attention_window_size=7)
    s, o = _stream(SGLangCache, 7, 3, cache_size=4, allow_growth=True)
    assert o.cache_size == s.cache_size == 32 and o.k.shape == s.k.shape and o.ring.layout.capacity == 32


def test_head_slice(SGLangCache):
    gen = torch.Generator().manual_seed(3)
    s, o = _pair(SGLangCache, 2, 6, 4, 4, sink_tokens=1)
    for c in range(6):
        kw = dict(key=torch.randn(2, 2, 2, 4, generator=gen, dtype=F64), value=torch.randn(2, 2, 2, 5, generator=gen, dtype=F64),
                  current_chunk_start=2 * c, cache_head_start=1)
        _assert_same(s, o, s.update_and_get_attention_kv(**kw), o.update_and_get_attention_kv(**kw), gen)
    before = snapshot(o)
    with pytest.raises(ValueError, match=r"serves heads \[1, 3\).*got \[2, 4\)"):
        o.update_and_get_attention_kv(key=torch.randn(2, 2, 2, 4, dtype=F64), value=torch.randn(2, 2, 2, 5, dtype=F64),
                                      current_chunk_start=12, cache_head_start=2)
    assert_same_state(before, snapshot(o))
    with pytest.raises(ValueError, match="requires cache_head_start"):
        o.update_and_get_attention_kv(key=torch.randn(2, 2, 2, 4, dtype=F64), value=torch.randn(2, 2, 2, 5, dtype=F64),
                                      current_chunk_start=12)


# ====================================================================== the interface
def test_has_every_field_and_method_of_sglangs_class(SGLangCache):
    import dataclasses

    fields = {f.name for f in dataclasses.fields(SGLangCache)}
    methods = {n for n in dir(SGLangCache) if not n.startswith("_")}
    ours = set(dir(RingCausalSelfAttentionKVCache))
    assert fields | methods <= ours, sorted((fields | methods) - ours)
    assert CausalSelfAttentionKVCache is RingCausalSelfAttentionKVCache
    assert {f.name for f in dataclasses.fields(CausalAttentionKVView)} == {
        "k", "v", "local_start_index", "local_end_index", "visible_local_end", "visible_global_end"}


def test_no_host_sync_in_the_per_layer_path(SGLangCache, monkeypatch):
    o = RingCausalSelfAttentionKVCache(**_kwargs(1, 12, 2, 4, sink_tokens=3, global_sink_tokens=3))

    def refuse(*args, **kwargs):
        raise AssertionError("a device value was read on the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    rings = []
    for c in range(10):  # fill, evictions, wraps, pins that slide into the sinks (re-layouts), recent views
        for _ in range(2):
            o.update_and_get_attention_kv(key=torch.randn(1, 3, 2, 4, dtype=F64), value=torch.randn(1, 3, 2, 5, dtype=F64),
                                          current_chunk_start=3 * c, recent_window_tokens=[None, 3][c % 2])
            rings.append(o.ring)
        if c in (3, 6):
            o.pin_current_chunk(3)
    monkeypatch.undo()
    assert len({id(r) for r in rings}) >= 3  # the ring was re-laid out at least twice under the guard
    assert o.global_end_index_int == 30 and int(o.global_end_index) == 30 and int(o.local_end_index) == 12


def test_retained_rows_never_move(SGLangCache):
    o = RingCausalSelfAttentionKVCache(**_kwargs(1, 9, 1, 2, sink_tokens=3))
    rows = {}
    for c in range(8):
        k = torch.full((1, 3, 1, 2), float(c), dtype=F64)
        o.update_and_get_attention_kv(key=k, value=torch.zeros(1, 3, 1, 3, dtype=F64), current_chunk_start=3 * c)
        held = o.ring.layer_slot_positions(0)[0]
        for slot, pos in enumerate(held.tolist()):
            if pos >= 0 and pos in rows:
                assert rows[pos] == slot  # a retained position stays in its slot
            rows[pos] = slot
        assert o.k[0, :3, 0, 0].tolist() == [0.0] * 3  # the sinks are chunk 0's keys, never overwritten


def test_reset_and_a_second_stream(SGLangCache):
    s, o = _stream(SGLangCache, 5, 3, cache_size=9, sink_tokens=3)
    s.reset_indices()
    o.reset_indices()
    assert (o.global_end_index_int, o.local_end_index_int, int(o.global_end_index), o.ring) == (0, 0, 0, None)
    gen = torch.Generator().manual_seed(9)
    for c in range(6):
        kw = dict(key=torch.randn(1, 3, 2, 4, generator=gen, dtype=F64), value=torch.randn(1, 3, 2, 5, generator=gen, dtype=F64),
                  current_chunk_start=3 * c)
        _assert_same(s, o, s.update_and_get_attention_kv(**kw), o.update_and_get_attention_kv(**kw), gen)


def test_other_float_inputs_are_cast_like_sglang(SGLangCache):
    s, o = _pair(SGLangCache, 1, 6, 2, 4)
    gen = torch.Generator().manual_seed(1)
    for c in range(4):
        kw = dict(key=torch.randn(1, 2, 2, 4, generator=gen), value=torch.randn(1, 2, 2, 5, generator=gen), current_chunk_start=2 * c)
        _assert_same(s, o, s.update_and_get_attention_kv(**kw), o.update_and_get_attention_kv(**kw), gen)


# ====================================================================== refusals
def test_bad_calls_are_refused_and_change_nothing(SGLangCache):
    with pytest.raises(ValueError, match="starts empty"):
        RingCausalSelfAttentionKVCache(**{**_kwargs(1, 4, 1, 2), "global_end_index_int": 7, "local_end_index_int": 3})
    with pytest.raises(ValueError, match="cache_size"):
        RingCausalSelfAttentionKVCache(**_kwargs(1, 4, 1, 2, cache_size=5))
    with pytest.raises(TypeError, match="allow_growth"):
        RingCausalSelfAttentionKVCache(**_kwargs(1, 4, 1, 2, allow_growth=1))
    o = RingCausalSelfAttentionKVCache(**_kwargs(1, 8, 2, 4, sink_tokens=2))
    for c in range(4):
        o.update_and_get_attention_kv(key=torch.randn(1, 3, 2, 4, dtype=F64), value=torch.randn(1, 3, 2, 5, dtype=F64),
                                      current_chunk_start=3 * c)
    k, v = torch.randn(1, 3, 2, 4, dtype=F64), torch.randn(1, 3, 2, 5, dtype=F64)
    bad = [
        (dict(current_chunk_start=13), ValueError, r"\[13, 16\) starts past global_end_index=12"),
        (dict(current_chunk_start=11), ValueError, r"\[11, 14\) straddles global_end_index=12"),
        (dict(current_chunk_start=6), ValueError, r"rewrite must be the last chunk.*global_end_index=12"),
        (dict(current_chunk_start=12, recent_window_tokens=-1), ValueError, "recent_window_tokens must be non-negative"),
        (dict(current_chunk_start=-1), ValueError, "current_chunk_start must be >= 0"),
        (dict(current_chunk_start=12, key=k[:, :2]), ValueError, "same n >= 1 tokens"),
        (dict(current_chunk_start=12, key=k.clone().requires_grad_(True)), ValueError, "requires grad"),
        (dict(current_chunk_start=12, key=o.k[:, :3]), ValueError, "shares memory"),
        (dict(current_chunk_start=12, value=v[..., :4]), ValueError, r"value must be \[1, n, h, 5\]"),
        (dict(current_chunk_start=12, key=torch.randn(1, 9, 2, 4, dtype=F64),
              value=torch.randn(1, 9, 2, 5, dtype=F64)), RuntimeError, "invalid write range"),  # sglang's own
    ]
    for kw, exc, pattern in bad:
        before = snapshot(o)
        with pytest.raises(exc, match=pattern):
            o.update_and_get_attention_kv(**{"key": k.detach(), "value": v, **kw})
        assert_same_state(before, snapshot(o))
    with pytest.raises(ValueError, match="sink_tokens must be >= 0"):
        o.sink_tokens = -1
    with pytest.raises(AttributeError):
        o.cache_size = 4
