"""The one block loop (:func:`streamkv.blockread.read_blocks`) against the query-blocked kernel that
materialises whole rows: equal outputs, log-sum-exps and per-slot statistics, whatever the
segments, block boundaries, masks, storage bases and slot maps; and ``attend`` through it equal to
the dense read."""

import itertools
import math

import pytest
import torch

from streamkv.blockread import BlockPlan, Statistic, read_blocks
from streamkv.scoring import blockwise_attention
from streamkv.masks import position_bias
from streamkv.stores import Dims, Segment

B, H, D = 2, 3, 8
DIMS = Dims((B, 12, H, D), (B, 12, H, 5), seq=1, head=2, slots=12, chunk=4)


def _segments(k, v, pos, cuts, *, basis=None, slot_maps=False):
    """``k``/``v`` ``[B, H, S, D]`` cut into segments at ``cuts``; with ``basis`` every other segment
    stores ``x @ R.T``; with ``slot_maps`` segments name their slots by a per-head map (reversed)."""
    edges = [0, *cuts, k.shape[-2]]
    out = []
    for i, (a, b) in enumerate(zip(edges[:-1], edges[1:])):
        kk, vv, kb, vb = k[..., a:b, :], v[..., a:b, :], None, None
        if basis is not None and i % 2:
            kk, kb = kk @ basis[0].T.to(kk.dtype), basis[0]
            if vv.shape[-1] == basis[1].shape[0]:
                vv, vb = vv @ basis[1].T.to(vv.dtype), basis[1]
        slots = a
        p = pos[:, a:b]
        if slot_maps:  # the same rows, listed backwards, each naming its slot
            kk, vv, p = kk.flip(-2), vv.flip(-2), p.flip(-1)
            slots = torch.arange(a, b).flip(0).expand(H, -1).clone()
        out.append(Segment(n=b - a, positions=p, keys=kk, values=vv, features=(k.shape[-1], v.shape[-1]),
                           dtype=k.dtype, k_basis=kb, v_basis=vb, slots=slots))
    return out


def _signed_permutation(n, g):
    """An orthogonal matrix exact in every float type (the stores' Hadamard basis is orthogonal only
    to float32 rounding: 1/sqrt(D) is not a float)."""
    r = torch.zeros(n, n, dtype=torch.float64)
    r[torch.arange(n), torch.randperm(n, generator=g)] = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    return r


def _statistics_path(slices, monkeypatch):
    import streamkv.blockread as br

    if slices == "row by row":
        monkeypatch.setattr(br, "_STAT_ELEMENTS", 1)
    elif slices == "key pairs":  # scores of two keys at a time (B x H x 5 queries each) in one reused buffer
        monkeypatch.setattr(br, "_STAT_SCORES", 2 * B * H * 5)
    elif slices == "compiled":
        monkeypatch.setattr(br, "COMPILE_MIN", 0)
        real = br._block_statistics

        def eager_refused(*a, sliced=True, **kw):  # the compiled kernel calls it with sliced=False, only
            assert not sliced, "the statistics ran eagerly"
            return real(*a, sliced=sliced, **kw)

        monkeypatch.setattr(br, "_block_statistics", eager_refused)


@pytest.mark.parametrize("cuts", [[], [1], [3, 4], [2, 5, 9]])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant", ["plain", "basis", "slot_maps", "value_dim"])
@pytest.mark.parametrize("slices", ["whole", "row by row", "key pairs", "compiled"])
def test_block_read_equals_whole_rows(cuts, causal, variant, slices, monkeypatch):
    """The block loop = whole-row attention (outputs, log-sum-exps, statistics), its statistics pass
    reducing every key at once, a key at a time, scoring two keys at a time, or in its compiled kernel (the CPU's for large blocks)."""
    _statistics_path(slices, monkeypatch)
    g = torch.Generator().manual_seed(len(cuts) * 4 + causal * 2 + len(variant))
    S, Q = 12, 5
    dv = 5 if variant == "value_dim" else D
    q = torch.randn(B, H, Q, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, S, dv, generator=g, dtype=torch.float64)
    pos = torch.randperm(S, generator=g).expand(H, -1).clone()
    pos[0, 2] = -1  # an empty slot in one head
    pos[1, 7] = -1
    qp = torch.arange(6, 6 + Q)  # causal: queries at positions 6..10 see keys at positions <= theirs
    basis = (_signed_permutation(D, g), _signed_permutation(dv, g)) if variant == "basis" else None
    segs = _segments(k, v, pos, cuts, basis=basis, slot_maps=variant == "slot_maps")
    dims = Dims((B, S, H, D), (B, S, H, dv), seq=1, head=2, slots=S, chunk=Q)
    plan = BlockPlan(segs, dims, 0.5, qp, causal, None, None, Statistic(), S, block=3, lse=True)
    got = read_blocks(q, plan)
    bias = position_bias(pos, qp if causal else None, torch.float64).unsqueeze(0)  # [1, H, Q|1, S]
    ref = blockwise_attention(q, k, v, bias, scale=0.5, statistics=True, lse=True, head_axis=1)
    for name, a, b in (("out", got.out, ref.out), ("lse", got.lse, ref.lse), ("max", got.key_max, ref.key_max),
                       ("sum", got.key_sum, ref.key_sum)):
        assert torch.allclose(a, b, rtol=1e-11, atol=1e-12), (name, (a - b).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("slices", ["whole", "row by row", "compiled"])
def test_grouped_queries_and_newest_rows(dtype, slices, monkeypatch):
    """Grouped-query attention (6 query heads on 3 key heads) and a statistic over the newest 2 rows
    (reduced at once, a key at a time, or compiled)."""
    _statistics_path(slices, monkeypatch)
    g = torch.Generator().manual_seed(5)
    S, Q = 12, 4
    q = torch.randn(B, 2 * H, Q, D, generator=g, dtype=dtype)
    k, v = (torch.randn(B, H, S, D, generator=g, dtype=dtype) for _ in range(2))
    pos = torch.arange(S).expand(H, -1)
    dims = Dims((B, S, H, D), (B, S, H, D), seq=1, head=2, slots=S, chunk=Q)
    plan = BlockPlan(_segments(k, v, pos, [5]), dims, 0.3, None, False, None, None, Statistic(rows=2, reduce=("sum",)),
                     S, block=4, lse=True)
    got = read_blocks(q, plan)
    kr = k.repeat_interleave(2, 1)
    vr = v.repeat_interleave(2, 1)
    ref = blockwise_attention(q, kr, vr, None, scale=0.3, lse=True, head_axis=1)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert torch.allclose(got.out, ref.out, rtol=tol, atol=tol) and torch.allclose(got.lse, ref.lse, rtol=tol, atol=tol)
    p = torch.softmax(q[..., -2:, :].double() @ kr.double().transpose(-1, -2) * 0.3, -1)  # [B, 2H, 2, S]
    want = p.reshape(B, H, 2, 2, S).sum(dim=(0, 2, 3))
    assert got.key_max is None and torch.allclose(got.key_sum, want, rtol=1e-5, atol=1e-6)


def test_a_row_that_sees_nothing_is_nan_and_no_block_is_refused():
    q = torch.randn(1, H, 2, D, dtype=torch.float64)
    k, v = torch.randn(1, H, 3, D, dtype=torch.float64), torch.randn(1, H, 3, D, dtype=torch.float64)
    pos = torch.tensor([[5, 6, 7]]).expand(H, -1)
    dims = Dims((1, 3, H, D), (1, 3, H, D), seq=1, head=2, slots=3, chunk=2)
    plan = BlockPlan(_segments(k, v, pos, [1]), dims, 1.0, torch.tensor([4, 6]), True, None, None, None, 3, block=2)
    out = read_blocks(q, plan).out
    assert torch.isnan(out[:, :, 0]).all() and torch.isfinite(out[:, :, 1]).all()
    with pytest.raises(ValueError, match="at least one key block"):
        read_blocks(q, BlockPlan([], dims, 1.0))


@pytest.mark.parametrize("kind", ["ring", "tova"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fmt", [None, "int8"])
def test_attend_through_the_block_loop_equals_float64_over_the_stored_values(kind, causal, fmt):
    """Every read goes through the one loop or SDPA: equal to float64 attention over the values the
    cache stores (dequantised), statistics for a scored policy included."""
    from streamkv import KVCache
    from streamkv.attention import attend

    cache = KVCache((1, 12, 2, 4), (1, 12, 2, 4), seq_dim=1, sink=2, window=10, chunk=3, policy=kind,
                    dtype=torch.float64, quant=fmt)
    g = torch.Generator().manual_seed(7)
    for c in range(6):
        q, k, v = (torch.randn(1, 3, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
        cache.begin_chunk(c)
        read = cache.layer(0).update(k, v)
        out, _ = attend(q, read, causal=causal, block=4)
        keys, values = cache.keys(0), cache.values(0)
        pos = cache.layer_slot_positions(0)
        bias = position_bias(pos, read.query_positions if causal else None, torch.float64).unsqueeze(0)
        want = blockwise_attention(q.transpose(1, 2), keys.transpose(1, 2).double(), values.transpose(1, 2).double(),
                                   bias, scale=0.5).out.transpose(1, 2)
        assert torch.allclose(out, want, rtol=1e-12, atol=1e-12), (c, (out - want).abs().max())
        cache.commit_chunk(c)


def test_queries_with_a_strided_feature_dim():
    """CPU's fused kernel reads rows with unit stride only: a query view with a strided feature dim
    (every other element of a wider tensor) must give the same output as a contiguous one."""
    g = torch.Generator().manual_seed(11)
    S, Q = 10, 2
    wide = torch.randn(B, H, Q, 2 * D, generator=g, dtype=torch.float64)
    q = wide[..., ::2]
    assert q.stride(-1) == 2
    k, v = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    pos = torch.arange(S).expand(H, -1).clone()
    pos[:, 4:] = -1
    dims = Dims((B, S, H, D), (B, S, H, D), seq=1, head=2, slots=S, chunk=Q)
    plan = BlockPlan(_segments(k, v, pos, []), dims, 0.5, None, False, None, None, None, S, block=16)
    got = read_blocks(q, plan).out
    want = read_blocks(q.contiguous(), plan).out
    ref = blockwise_attention(q, k, v, position_bias(pos, None, torch.float64).unsqueeze(0), scale=0.5).out
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-13) and torch.allclose(want, ref, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_keys_stored_in_a_basis_and_rotated_at_read(fmt):
    """A store in the Hadamard basis read by a cache that rotates raw keys at read: the keys go
    back to their own basis before the rotation (which does not commute with it), so the read
    equals float64 attention over the stored values rotated by the map."""
    from streamkv import KVCache
    from streamkv.attention import attend
    from streamkv.quant import KVQuant
    from streamkv.rope_at_read import RopeAtRead
    from streamkv.rotary import Rope1D

    rope = RopeAtRead(Rope1D(8), "cache_relative")
    cache = KVCache((1, 12, 2, 8), (1, 12, 2, 8), seq_dim=1, sink=2, window=10, chunk=3, policy="ring",
                    dtype=torch.float64, quant=KVQuant(fmt, basis="hadamard"), rope_at_read=rope)
    g = torch.Generator().manual_seed(12)
    for c in range(6):
        q, k, v = (torch.randn(1, 3, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
        cache.begin_chunk(c)
        read = cache.layer(0).update(k, v)
        out, _ = attend(q, read)
        plan = rope.plan(read)
        pos = read.positions
        keys = plan.keys_at(cache.keys(0).transpose(1, 2), pos)  # the stored values, rotated by the map
        qr = plan.queries(q.transpose(1, 2))
        bias = position_bias(pos, None, torch.float64).unsqueeze(0)
        want = blockwise_attention(qr, keys, cache.values(0).transpose(1, 2), bias, scale=8**-0.5).out.transpose(1, 2)
        assert torch.allclose(out, want, rtol=1e-9, atol=1e-9), (c, (out - want).abs().max())
        cache.commit_chunk(c)


@pytest.mark.parametrize("fused", [True, False])
def test_a_non_finite_row_hidden_from_every_query_weighs_nothing(fused, monkeypatch):
    """A stale row in an empty or evicted slot may hold NaN (a NaN value the commit accepted, then
    evicted): hidden from every query, it weighs nothing (``where``, not a weight of 0 times NaN) in
    the fused CPU kernel and in the plain block alike; a held row is attended as stored."""
    import streamkv.blockread as br

    if not fused:
        monkeypatch.setattr(br, "_FUSED_CPU", None)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, H, 2, D, generator=g, dtype=torch.float64)
    k, v = torch.randn(1, H, 4, D, generator=g, dtype=torch.float64), torch.randn(1, H, 4, D, generator=g,
                                                                                  dtype=torch.float64)
    k[..., 1, :], v[..., 1, :] = float("nan"), float("inf")  # slot 1: empty (position -1), stale non-finite
    v[..., 3, 0] = float("nan")  # slot 3: position 9, held: seen by the second query (causal)
    pos = torch.tensor([[5, -1, 6, 9]]).expand(H, -1)
    dims = Dims((1, 4, H, D), (1, 4, H, D), seq=1, head=2, slots=4, chunk=2)
    for causal, qpos in ((False, None), (True, torch.tensor([9, 9]))):
        plan = BlockPlan(_segments(k, v, pos, []), dims, 0.5, qpos, causal, None, None, None, 4, block=4)
        out = read_blocks(q, plan).out
        held = torch.tensor([0, 2, 3])
        p = ((q @ k[..., held, :].transpose(-1, -2)) * 0.5).softmax(-1)
        want = p @ v[..., held, :]  # the held NaN stays in its channel; the stale row adds nothing anywhere
        assert torch.equal(torch.isnan(out), torch.isnan(want)) and torch.isnan(out[..., 0]).all()
        assert torch.allclose(out[..., 1:], want[..., 1:], rtol=1e-12, atol=1e-12)


def test_an_evicted_nan_value_does_not_poison_later_reads():
    """A mass cache accepts a NaN value (its scores are finite), then evicts it: every later read
    equals float64 attention over the tokens held (the stale row stays in its empty slot)."""
    from streamkv import KVCache
    from streamkv.attention import attend

    g = torch.Generator().manual_seed(1)
    c = KVCache((1, 7, 2, 4), (1, 7, 2, 4), seq_dim=1, sink=1, window=6, chunk=2, policy="mass",
                dtype=torch.float64, tau=0.25)
    checked = 0
    for _ in range(12):
        c.begin_tokens(1)
        q, k, v = (torch.randn(1, 1, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
        if c.end - 1 == 6:
            v[:] = float("nan")
            k[:] = -9.0 * q
        out, _ = attend(q, c.layer(0).update(k, v, q))
        pos = c.layer_slot_positions(0)
        if not (pos == 6).any():
            held = (pos >= 0).T[None, :, :, None]
            keys, values = torch.where(held, c.keys(0), 0), torch.where(held, c.values(0), 0)
            want = blockwise_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                       position_bias(pos, None, torch.float64).unsqueeze(0), scale=0.5).out
            assert torch.allclose(out, want.transpose(1, 2), rtol=1e-12, atol=1e-12)
            checked += c.end > 7
        c.commit()
    assert checked  # the NaN token entered, was evicted, and later reads were checked


def test_page_runs_cut_the_blocks_and_each_block_is_a_view():
    """Over a page table (host pages known) a segment longer than a block is cut where a run of
    consecutive physical pages ends, so every block is read as a view of the buffers (no copy), and
    the read equals the one over the rows in logical order."""
    from dataclasses import replace

    import streamkv.stores.base as base

    g = torch.Generator().manual_seed(13)
    P, pages, S = 2, (4, 5, 0, 1, 2, 6), 12  # logical page -> physical page: runs [0, 2) [2, 5) [5, 6)
    k, v = (torch.randn(B, H, 7 * P, D, generator=g, dtype=torch.float64) for _ in range(2))
    rows = torch.tensor([p * P + r for p in pages for r in range(P)])
    pos = torch.arange(S).expand(H, -1)
    seg = Segment(n=S, positions=pos, keys=k, values=v, features=(D, D), dtype=torch.float64,
                  pages=torch.tensor(pages), page=P, host_pages=pages)
    assert seg.cuts(11) == [(0, 4), (4, 10), (10, 12)]
    assert seg.cuts(4) == [(0, 4), (4, 8), (8, 10), (10, 12)]
    assert seg.cuts(12) == [(0, 12)]  # one block: one call, the rounding of a contiguous read (a copy)
    assert replace(seg, host_pages=None).cuts(5) == [(0, 5), (5, 10), (10, 12)]  # traced: the table on the device
    copies = []
    cat = torch.cat
    try:
        base.torch.cat = lambda *a, **kw: copies.append(1) or cat(*a, **kw)
        q = torch.randn(B, H, 3, D, generator=g, dtype=torch.float64)
        dims = Dims((B, S, H, D), (B, S, H, D), seq=1, head=2, slots=S, chunk=3)
        got = read_blocks(q, BlockPlan([seg], dims, 0.5, None, False, None, None, None, S, block=11)).out
    finally:
        base.torch.cat = cat
    assert not copies
    flat = Segment(n=S, positions=pos, keys=k[..., rows, :], values=v[..., rows, :], features=(D, D),
                   dtype=torch.float64)
    want = read_blocks(q, BlockPlan([flat], dims, 0.5, None, False, None, None, None, S, block=16)).out
    assert torch.allclose(got, want, rtol=1e-13, atol=1e-14)


def test_a_segment_every_row_of_which_is_visible_is_read_without_a_mask(monkeypatch):
    """``Segment.visible`` (a host promise, from a full window cache's occupancy): the CPU fused kernel
    gets no mask, and the read equals the masked one; a full ring's read sets it, a filling one not."""
    import streamkv.blockread as br
    from streamkv import KVCache
    from streamkv.attention import attend

    masks = []
    fused = br._FUSED_CPU
    monkeypatch.setattr(br, "_FUSED_CPU", lambda *a, attn_mask=None, **kw: masks.append(attn_mask) or fused(
        *a, attn_mask=attn_mask, **kw))
    cache = KVCache((1, 12, 2, 8), (1, 12, 2, 8), seq_dim=1, sink=2, window=10, chunk=3, policy="ring",
                    dtype=torch.float32, quant="int8")
    g = torch.Generator().manual_seed(14)
    for c in range(6):
        q, k, v = (torch.randn(1, 3, 2, 8, generator=g) for _ in range(3))
        cache.begin_chunk(c)
        read = cache.layer(0).update(k, v)
        qt, plan = read.block_plan(q.transpose(1, 2), scale=8 ** -0.5)
        masks.clear()
        got = read_blocks(qt, plan).out
        unmasked = [m is None for m in masks]
        shown = [s.visible for s in plan.segments]
        want = read_blocks(qt, replace_segments(plan, visible=False)).out
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), (c, (got - want).abs().max())
        assert not any(shown) and not any(unmasked)  # a quantised store's segments hide rows: always masked
        cache.commit_chunk(c)
    dense = KVCache((1, 12, 2, 8), (1, 12, 2, 8), seq_dim=1, sink=2, window=10, chunk=3, policy="ring")
    for c in range(6):
        q, k, v = (torch.randn(1, 3, 2, 8, generator=g) for _ in range(3))
        dense.begin_chunk(c)
        read = dense.layer(0).update(k, v)
        masks.clear()
        out, info = attend(q, read, kernel="blocks")
        assert torch.allclose(out, attend(q, read, kernel="sdpa")[0], rtol=1e-5, atol=1e-6)
        # filling: the occupied prefix (visible by definition); full: every slot
        assert masks and all(m is None for m in masks), (c, read.occupancy)
        masks.clear()
        attend(q, read, kernel="blocks", causal=True)
        assert masks and all(m is not None for m in masks)  # a causal mask is a mask
        dense.commit_chunk(c)


def replace_segments(plan, **changes):
    from dataclasses import replace

    return replace(plan, segments=[replace(s, **changes) for s in plan.segments], memo=None)


@pytest.mark.parametrize("window", [None, 3])
def test_causal_statistics_are_exact_at_positions_float32_cannot_hold(window, monkeypatch):
    """The statistics' causal mask (the compiled kernel's float32 codes) at positions past 2**40,
    where neighbouring positions are one float32 apart from nothing: the statistics of the same
    read shifted by 2**40 equal the unshifted ones, and both equal whole-row attention's."""
    import streamkv.blockread as br

    monkeypatch.setattr(br, "COMPILE_MIN", 0)
    g = torch.Generator().manual_seed(11)
    S, Q = 12, 5
    q = torch.randn(B, H, Q, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    pos = torch.randperm(S, generator=g).expand(H, -1).clone()
    pos[0, 2] = -1
    qp = torch.arange(6, 6 + Q)
    dims = Dims((B, S, H, D), (B, S, H, D), seq=1, head=2, slots=S, chunk=Q)
    got = []
    for shift in (0, 2**40):
        p = torch.where(pos >= 0, pos + shift, pos)
        plan = BlockPlan(_segments(k, v, p, [4]), dims, 0.5, qp + shift, True, window, None, Statistic(), S, block=3)
        got.append(read_blocks(q, plan))
    bias = position_bias(pos, qp, torch.float64, window).unsqueeze(0)
    ref = blockwise_attention(q, k, v, bias, scale=0.5, statistics=True, head_axis=1)
    for a in got:
        assert torch.allclose(a.key_max, ref.key_max, rtol=1e-11, atol=1e-12)
        assert torch.allclose(a.key_sum, ref.key_sum, rtol=1e-11, atol=1e-12)
    assert torch.equal(got[0].key_max, got[1].key_max) and torch.equal(got[0].key_sum, got[1].key_sum)


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_gathered_rows_are_gathers_rows_in_every_storage_order(order):
    """The statistics pass's row gather (one ``index_select`` over the buffer seen as rows) takes
    the rows ``gather`` takes, in every storage order of (batch, head, token), from a view at an
    offset in a larger buffer, over a broadcast batch, and with strided features (its fallback)."""
    from streamkv.stores.dense import gather_rows

    g = torch.Generator().manual_seed(sum(i * 3 ** k for k, i in enumerate(order)))
    n, D, M = 11, 5, 7
    for B, H in ((1, 1), (2, 3), (3, 1)):
        sizes = (B, H, n)
        store = torch.randn(2, *[sizes[p] for p in order], D, generator=g)[1]  # a layer's view: an offset
        t = store.permute(*[order.index(i) for i in range(3)], 3)  # [B, H, n, D]
        idx = torch.randint(0, n, (1, H, M), generator=g)
        for view in (t, t[:1].expand(B, H, n, D), torch.randn(B, H, n, 2 * D, generator=g)[..., ::2]):
            want = view.gather(-2, idx.unsqueeze(-1).expand(B, H, M, D))
            assert torch.equal(gather_rows(view, idx), want), (B, H)
