"""The attention dispatch: physical order where valid, chronological elsewhere, never a
silent fallback; the blockwise kernel (log-sum-exp, per-key statistics, grouped queries)."""

import pytest
import torch

from streamkv import ChronologicalCache, RingCache
from streamkv.attention import attend
from streamkv.scoring import blockwise_attention
from streamkv.reference import ReferenceCache, reference_attention
from streamkv.policies import POLICIES, example_policy
from streamkv.rope import Rope3D

S, W, C, H, D = 2, 7, 3, 2, 8


def _fill(cache, chunks, seed=0, ref=None):
    gen = torch.Generator().manual_seed(seed)
    for c in range(chunks):
        cache.begin_chunk(c)
        if ref is not None:
            ref.begin_chunk(c)
        k = torch.randn(1, C, H, D, generator=gen, dtype=cache.dtype)
        v = torch.randn(1, C, H, D + 1, generator=gen, dtype=cache.dtype)
        cache.write(k, v)
        if ref is not None:
            ref.write(k, v)
        if c + 1 < chunks:
            cache.commit_chunk(c)
            if ref is not None:
                ref.commit_chunk(c)
    return cache


def _ring(dtype=torch.float64):
    return RingCache((1, S + W, H, D), (1, S + W, H, D + 1), seq_dim=1, sink=S, window=W, chunk=C, dtype=dtype)


@pytest.mark.parametrize("chunks,occupancy", [(1, "prefix"), (2, "prefix"), (2, "mask"), (3, "all"), (7, "all"), (7, "mask")])
def test_physical_equals_reference_for_every_occupancy(chunks, occupancy):
    ref = ReferenceCache(sink=S, window=W, chunk=C, seq_dim=1)
    ring = _fill(_ring(), chunks, ref=ref)
    q = torch.randn(1, C, H, D, dtype=torch.float64)
    assert ring.all_valid == (occupancy == "all" or chunks >= 3)  # "all" is only asked of a full cache
    out, info = attend(q, ring.read(occupancy=occupancy), order="physical", return_lse=True)
    want = reference_attention(q.transpose(1, 2), ref.chronological_keys().transpose(1, 2), ref.chronological_values().transpose(1, 2))
    assert info.path == "physical" and info.occupancy == occupancy
    assert (out.transpose(1, 2) - want).abs().max() < 1e-12
    # the lse agrees with a full logsumexp over the retained keys
    scores = q.transpose(1, 2) @ ref.chronological_keys().permute(0, 2, 3, 1) / D**0.5
    assert (info.lse - scores.logsumexp(-1)).abs().max() < 1e-12


def test_auto_picks_the_path_and_says_so():
    ring = _fill(_ring(), 5)
    q = torch.randn(1, C, H, D, dtype=torch.float64)
    _, info = attend(q, ring)
    assert info.path == "physical" and info.occupancy == "all" and info.keys_read == S + W
    _, info = attend(q, ring, attn_mask=torch.ones(C, S + W, dtype=torch.bool))
    assert info.path == "chronological" and info.occupancy is None


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(rope_mode="cache_relative", key_transform=lambda k: k), "keys use cache-relative RoPE"),
        (dict(attn_mask=torch.zeros(C, S + W)), "an attention mask is given"),
    ],
)
def test_physical_request_is_refused_where_invalid(kwargs, match):
    ring = _fill(_ring(), 5)
    q = torch.randn(1, C, H, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="the physical-order path is invalid here: " + match):
        attend(q, ring, order="physical", **kwargs)


def test_cache_relative_rope_needs_the_chronological_path():
    """Keys stored unrotated and rotated at read time by their chronological index: after
    a wrap, rotating the physical buffer by slot index gives a different (wrong) answer;
    the chronological path matches the whole-history reference."""
    rope = Rope3D(D, 1, 3, max_frames=64)  # 3 tokens per frame
    ref = ReferenceCache(sink=S, window=W, chunk=C, seq_dim=1)
    ring = _fill(_ring(), 6, seed=3, ref=ref)  # wrapped
    assert ring.wraps >= 1
    n = ring.num_valid
    cos, sin = rope.cos_sin(torch.arange(n), torch.float64)
    q = torch.randn(1, C, H, D, dtype=torch.float64)
    qr = Rope3D.rotate(q, cos[n - C :].unsqueeze(1), sin[n - C :].unsqueeze(1))
    rotate = lambda k: Rope3D.rotate(k, cos, sin)  # noqa: E731  keys [B, H, n, D]
    out, info = attend(qr, ring, rope_mode="cache_relative", key_transform=rotate)
    assert info.path == "chronological"
    want = reference_attention(qr.transpose(1, 2), rotate(ref.chronological_keys().transpose(1, 2)), ref.chronological_values().transpose(1, 2))
    assert (out.transpose(1, 2) - want).abs().max() < 1e-12
    # what a physical read would compute: keys rotated by their slot, not their order
    wrong = reference_attention(qr.transpose(1, 2), rotate(ring.keys().transpose(1, 2)), ring.values().transpose(1, 2))
    assert (wrong - want).abs().max() > 1e-3


def test_chronological_cache_physical_equals_chronological_in_fp32():
    cache = _fill(ChronologicalCache((1, S + W, H, D), (1, S + W, H, D + 1), seq_dim=1, sink=S, window=W, chunk=C), 6)
    q = torch.randn(1, C, H, D)
    a, ia = attend(q, cache, order="physical")
    b, ib = attend(q, cache, order="chronological")
    assert (ia.path, ib.path) == ("physical", "chronological")
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()


@pytest.mark.parametrize("block", [1, 5, 64])
def test_blockwise_kernel_matches_a_full_softmax_with_a_bias(block):
    """Output, log-sum-exp and per-key statistics (max and sum over queries and batch, per
    head) against one full-matrix softmax."""
    q = torch.randn(2, 3, 11, 8, dtype=torch.float64)
    k = torch.randn(2, 3, 13, 8, dtype=torch.float64)
    v = torch.randn(2, 3, 13, 5, dtype=torch.float64)
    bias = torch.zeros(13, dtype=torch.float64)
    bias[[2, 7]] = float("-inf")
    res = blockwise_attention(q, k, v, bias, scale=0.3, block=block, statistics=True, lse=True, head_axis=1)
    s = q @ k.transpose(-1, -2) * 0.3 + bias
    p = s.softmax(-1)
    assert (res.lse - s.logsumexp(-1)).abs().max() < 1e-12
    assert (res.out - p @ v).abs().max() < 1e-12
    assert (res.key_max - p.amax(dim=(0, 2))).abs().max() < 1e-15
    assert (res.key_sum - p.sum(dim=(0, 2))).abs().max() < 1e-12
    assert res.key_max[:, [2, 7]].abs().max() == 0


def test_grouped_query_attention_equals_repeated_keys():
    """Six query heads over two key heads (query head h reads key head h // 3, as
    transformers' repeat_kv): the same as attention over keys repeated per query head."""
    ring = RingCache((1, S + W, 2, D), (1, S + W, 2, D + 1), seq_dim=1, sink=S, window=W, chunk=C, dtype=torch.float64)
    _fill_heads(ring, 5)
    q = torch.randn(1, C, 6, D, dtype=torch.float64)
    out, info = attend(q, ring, causal=True)
    k = ring.keys().repeat_interleave(3, dim=2).transpose(1, 2)
    v = ring.values().repeat_interleave(3, dim=2).transpose(1, 2)
    pos = ring.layer_slot_positions()[0]
    qpos = torch.arange(4 * C, 5 * C)
    mask = torch.zeros(C, S + W, dtype=torch.float64).masked_fill((pos.view(1, -1) > qpos.view(-1, 1)) | (pos < 0), float("-inf"))
    want = torch.softmax(q.transpose(1, 2) @ k.transpose(-1, -2) / D**0.5 + mask, -1) @ v
    assert out.shape == (1, C, 6, D + 1)
    assert (out.transpose(1, 2) - want).abs().max() < 1e-12


def _fill_heads(cache, chunks):
    gen = torch.Generator().manual_seed(7)
    hk = cache.k_shape[2]
    for c in range(chunks):
        cache.begin_chunk(c)
        cache.write(torch.randn(1, C, hk, D, generator=gen, dtype=cache.dtype),
                    torch.randn(1, C, hk, D + 1, generator=gen, dtype=cache.dtype))
        if c + 1 < chunks:
            cache.commit_chunk(c)


def test_bad_options_are_named():
    ring = _fill(_ring(), 2)
    q = torch.randn(1, C, H, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="order must be 'auto', 'physical' or 'chronological', got 'ring'"):
        attend(q, ring, order="ring")
    with pytest.raises(ValueError, match="needs key_transform"):
        attend(q, ring, rope_mode="cache_relative")
    with pytest.raises(ValueError, match="occupancy must be 'all', 'prefix' or 'mask', got 'full'"):
        ring.read(occupancy="full")
    with pytest.raises(ValueError, match="occupancy 'all' would read empty slots: 6 of 9"):
        ring.read(occupancy="all")


@pytest.mark.parametrize("kind", list(POLICIES))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_query_row_that_is_not_finite_reads_nan_on_every_path(kind, bad, dtype):
    """Every score of a query with NaN or an infinity is NaN or infinite, so its softmax is NaN (as
    float64 attention gives); torch's fused CPU kernel returned 0 for such a row where no mask was
    given. The other rows read as they do without it; a large finite query stays finite."""
    from streamkv import KVCache

    cache = KVCache((1, S + W, H, D), (1, S + W, H, D), seq_dim=1, sink=S, window=W, chunk=C, policy=kind,
                    dtype=dtype, **example_policy(kind))
    g = torch.Generator().manual_seed(0)
    for c in range(4):
        cache.begin_chunk(c)
        k, v, q = (torch.randn(1, C, H, D, generator=g, dtype=dtype) for _ in range(3))
        attend(q, cache.layer(0).update(k, v, q))
        if c < 3:
            cache.commit_chunk(c)
    poisoned = q.clone()
    poisoned[0, 1, 0, 3] = bad
    huge = q.clone()
    huge[0, 1, 0] = 1e18  # scores near 1e18: a one-hot softmax, finite
    for order, kernel in (("physical", "auto"), ("physical", "blocks"), ("auto", "auto")):
        if POLICIES[kind].per_head and order == "auto":  # no chronological view of per-head slots
            continue
        clean, _ = attend(q, cache.read(0), order=order, kernel=kernel)
        out, info = attend(poisoned, cache.read(0), order=order, kernel=kernel, return_lse=kernel == "blocks")
        assert out[0, 1, 0].isnan().all(), (order, kernel, info.kernel)
        if info.lse is not None:
            assert info.lse.isnan().any()
        keep = torch.ones_like(out, dtype=torch.bool)
        keep[0, 1, 0] = False
        assert torch.equal(out[keep], clean[keep])
        assert attend(huge, cache.read(0), order=order, kernel=kernel)[0][0, 1, 0].isfinite().all()
