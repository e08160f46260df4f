"""The key-blocked attention kernel (online softmax over blocks of slots) against the
query-blocked one that materialises whole rows: equal outputs, log-sum-exps and per-key
statistics, whatever the block boundaries and masks."""

import math

import pytest
import torch

from streamkv.scoring import blockwise_attention, key_blockwise_attention


def _blocks(k, v, bias, cuts):
    def gen():
        edges = [0, *cuts, k.shape[-2]]
        for a, b in zip(edges[:-1], edges[1:]):
            yield k[..., a:b, :], v[..., a:b, :], None if bias is None else bias[..., a:b]
    return gen


@pytest.mark.parametrize("cuts", [[], [1], [3, 4], [2, 5, 9], list(range(1, 12))])
@pytest.mark.parametrize("masked", [False, True])
def test_key_blocks_equal_whole_rows(cuts, masked):
    g = torch.Generator().manual_seed(len(cuts) * 2 + masked)
    B, H, Q, S, D = 2, 3, 5, 12, 4
    q, k = torch.randn(B, H, Q, D, generator=g, dtype=torch.float64), torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, S, 3, generator=g, dtype=torch.float64)
    bias = None
    if masked:  # whole blocks hidden for some rows, including the first block
        hide = torch.rand(1, H, Q, S, generator=g) < 0.5
        hide[..., 0, :6] = True
        hide[..., :, -1] = False  # every row sees something
        bias = torch.zeros(hide.shape, dtype=torch.float64).masked_fill(hide, -math.inf)
    ref = blockwise_attention(q, k, v, bias, scale=0.5, statistics=True, lse=True, head_axis=1)
    got = key_blockwise_attention(q, _blocks(k, v, bias, cuts), scale=0.5, statistics=True, lse=True, head_axis=1)
    for a, b in ((got.out, ref.out), (got.lse, ref.lse), (got.key_max, ref.key_max), (got.key_sum, ref.key_sum)):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-13), (a - b).abs().max()


def test_a_row_that_sees_nothing_is_nan_as_in_the_row_kernel():
    q, k, v = torch.randn(1, 2, 4), torch.randn(1, 3, 4), torch.randn(1, 3, 4)
    bias = torch.zeros(1, 2, 3)
    bias[0, 0] = -math.inf
    got = key_blockwise_attention(q, _blocks(k, v, bias, [1]), scale=1.0)
    assert torch.isnan(got.out[0, 0]).all() and torch.isfinite(got.out[0, 1]).all()


def test_no_blocks_is_refused():
    with pytest.raises(ValueError, match="at least one key block"):
        key_blockwise_attention(torch.randn(1, 2, 4), lambda: iter(()), scale=1.0)


@pytest.mark.parametrize("kind", ["ring", "tova"])
@pytest.mark.parametrize("causal", [False, True])
def test_attend_through_load_equals_the_dense_read(kind, causal):
    """A read that hands its slots out a block at a time (``read.load``) attends exactly as the
    dense read does, statistics for a scored policy included."""
    import dataclasses

    from streamkv import KVCache
    from streamkv.attention import attend

    def build():
        c = KVCache((1, 12, 2, 4), (1, 12, 2, 4), seq_dim=1, sink=2, window=10, chunk=3, policy=kind,
                    dtype=torch.float64)
        return c

    g = torch.Generator().manual_seed(7)
    dense, blocked = build(), build()
    for c in range(6):
        q, k, v = (torch.randn(1, 3, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
        outs = []
        for cache, via_load in ((dense, False), (blocked, True)):
            cache.begin_chunk(c)
            read = cache.layer(0).update(k, v)
            if via_load:
                keys, values, seq = read.keys, read.values, read.seq_dim
                read = dataclasses.replace(read, load=lambda a, b: (keys.narrow(seq, a, b - a),
                                                                   values.narrow(seq, a, b - a)))
            out, info = attend(q, read, causal=causal, block=4)
            outs.append(out)
            cache.commit_chunk(c)
        assert torch.allclose(outs[0], outs[1], rtol=1e-12, atol=1e-13)
        assert torch.equal(dense.slot_positions, blocked.slot_positions)
