"""The Self-Forcing per-block cache dicts on the ring: a minimal model loop in Self-Forcing's
format, run once with plain dicts (the attention module's own cache code: ``.item()`` reads, a
clone-and-shift roll, slice writes and a sliced read) and once with
:func:`~streamkv.compat.self_forcing.self_forcing_kv_caches` swapped in, gives the same outputs
(float64, 1e-12) over wraps, denoising steps, a clean pass per chunk and a reset."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_same_state, snapshot
from streamkv.compat.self_forcing import SelfForcingKVCache, self_forcing_kv_caches

F64 = torch.float64
B, H, D, LAYERS = 2, 2, 4, 3


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def _rope(x, start):
    """Rotary embedding at absolute positions ``start + i`` (pairs of features)."""
    n = x.shape[1]
    pos = torch.arange(start, start + n, dtype=F64).view(1, n, 1, 1)
    freq = 1.0 / (100.0 ** (torch.arange(0, D, 2, dtype=F64) / D))
    ang = pos * freq
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()), dim=-1).flatten(-2)


def _plain_dicts(size):
    return [{"k": torch.zeros(B, size, H, D, dtype=F64), "v": torch.zeros(B, size, H, D, dtype=F64),
             "global_end_index": torch.tensor([0], dtype=torch.long),
             "local_end_index": torch.tensor([0], dtype=torch.long)} for _ in range(LAYERS)]


def plain_cache_attention(kv, q, k, v, current_start, *, sink, max_attention, rolling):
    """What Self-Forcing's ``CausalWanSelfAttention`` does with its dict (written here from its
    description: reads the indices on the host, rolls with a clone, writes, reads a slice)."""
    n = q.shape[1]
    current_end = current_start + n
    size = kv["k"].shape[1]
    G, E = kv["global_end_index"].item(), kv["local_end_index"].item()
    if rolling and current_end > G and n + E > size:
        evicted = n + E - size
        rolled = E - evicted - sink
        for name in ("k", "v"):
            kv[name][:, sink:sink + rolled] = kv[name][:, sink + evicted:sink + evicted + rolled].clone()
        local_end = E + current_end - G - evicted
    else:
        local_end = E + current_end - G
    local_start = local_end - n
    kv["k"][:, local_start:local_end] = k
    kv["v"][:, local_start:local_end] = v
    lo = max(0, local_end - max_attention)
    out = _sdpa(q, kv["k"][:, lo:local_end], kv["v"][:, lo:local_end])
    kv["global_end_index"].fill_(current_end)
    kv["local_end_index"].fill_(local_end)
    return out


class TinyModel:
    """``LAYERS`` residual self-attention blocks in Self-Forcing's cache format."""

    def __init__(self, seed):
        g = torch.Generator().manual_seed(seed)
        dim = H * D
        self.w = [[torch.randn(dim, dim, generator=g, dtype=F64) / dim**0.5 for _ in range(4)] for _ in range(LAYERS)]

    def forward(self, x, current_start, attend):
        for i, (wq, wk, wv, wo) in enumerate(self.w):
            q, k, v = ((x @ w).view(B, -1, H, D) for w in (wq, wk, wv))
            out = attend(i, _rope(q, current_start), _rope(k, current_start), v, current_start)
            x = x + out.reshape(B, -1, H * D) @ wo
        return x


def _run_both(chunks, *, size, sink, max_attention, steps=3, seed=0, reset_at=None):
    model, g = TinyModel(seed), torch.Generator().manual_seed(seed + 1)
    plain = _plain_dicts(size)
    ring = self_forcing_kv_caches(LAYERS, B, size, H, D, sink_tokens=sink, attention_tokens=max_attention,
                                  dtype=F64)

    def attend_plain(i, q, k, v, start):
        return plain_cache_attention(plain[i], q, k, v, start, sink=sink, max_attention=max_attention, rolling=True)

    def attend_ring(i, q, k, v, start):
        k_att, v_att = ring[i].update(k, v, start)  # the swapped-in lines
        return _sdpa(q, k_att, v_att)

    start = 0
    for c, n in enumerate(chunks):
        if c == reset_at:  # a new generation: the pipeline's reset, unchanged
            for caches in (plain, ring):
                for kv in caches:
                    kv["global_end_index"] = torch.tensor([0], dtype=torch.long)
                    kv["local_end_index"] = torch.tensor([0], dtype=torch.long)
            start = 0
        for _ in range(steps):  # denoising steps, then the clean pass on the last output
            x = torch.randn(B, n, H * D, generator=g, dtype=F64)
            want, got = model.forward(x, start, attend_plain), model.forward(x, start, attend_ring)
            assert (got - want).abs().max().item() <= 1e-12 * max(1.0, want.abs().max().item()), (c, n)
        want, got = model.forward(want, start, attend_plain), model.forward(want, start, attend_ring)
        assert (got - want).abs().max().item() <= 1e-12 * max(1.0, want.abs().max().item()), (c, "clean")
        for kv_p, kv_r in zip(plain, ring):
            assert int(kv_p["global_end_index"]) == int(kv_r["global_end_index"]) == start + n
            assert int(kv_p["local_end_index"]) == int(kv_r["local_end_index"])
        start += n
    return ring


@pytest.mark.parametrize("sink, max_attention", [(0, 12), (3, 12), (3, 7)], ids=["no-sink", "sink", "local-attention"])
def test_model_loop_matches_the_plain_dicts_over_wraps(sink, max_attention):
    ring = _run_both([3] * 14, size=12, sink=sink, max_attention=max_attention)
    assert ring[0].ring_cache.ring.wraps >= 3


def test_variable_chunks_and_a_reset():
    # an independent first frame (1-token chunk), then 3-token chunks; a second generation after a reset
    _run_both([1] + [3] * 8 + [1] + [3] * 7, size=10, sink=1, max_attention=10, steps=2, reset_at=9)


def test_dict_interface():
    kv = SelfForcingKVCache(1, 6, 2, 4, sink_tokens=1, dtype=F64)
    assert list(kv) == ["k", "v", "global_end_index", "local_end_index"] and len(kv) == 4 and "k" in kv
    assert kv["k"].shape == (1, 6, 2, 4) and kv["global_end_index"].dtype == torch.long
    for c in range(3):
        kv.update(torch.randn(1, 3, 2, 4, dtype=F64), torch.randn(1, 3, 2, 4, dtype=F64), 3 * c)
    assert int(kv["global_end_index"]) == 9 and int(kv["local_end_index"]) == 6
    bad = [("global_end_index", torch.tensor([4]), ValueError, "only be reset to 0, got 4"),
           ("k", torch.zeros(1, 6, 2, 4), TypeError, "cannot be assigned"),
           ("local_end_index", 0, TypeError, "1-element integer tensor")]
    for key, value, exc, pattern in bad:
        before = snapshot(kv.ring_cache)
        with pytest.raises(exc, match=pattern):
            kv[key] = value
        assert_same_state(before, snapshot(kv.ring_cache))
    kv["local_end_index"] = torch.tensor([0])
    assert int(kv["global_end_index"]) == 0 and kv.ring_cache.global_end_index_int == 0


def test_without_rolling_a_full_cache_is_refused_like_self_forcing():
    plain = _plain_dicts(6)[0]
    kv = SelfForcingKVCache(B, 6, H, D, rolling=False, dtype=F64)
    q = torch.randn(B, 3, H, D, dtype=F64)
    for c in range(2):
        k, v = torch.randn(B, 3, H, D, dtype=F64), torch.randn(B, 3, H, D, dtype=F64)
        want = plain_cache_attention(plain, q, k, v, 3 * c, sink=0, max_attention=6, rolling=False)
        got = _sdpa(q, *kv.update(k, v, 3 * c))
        assert torch.allclose(got, want, rtol=0, atol=1e-12)
    k, v = torch.randn(B, 3, H, D, dtype=F64), torch.randn(B, 3, H, D, dtype=F64)
    with pytest.raises(RuntimeError):  # Self-Forcing: a zero-length slice cannot take the chunk
        plain_cache_attention(plain, q, k, v, 6, sink=0, max_attention=6, rolling=False)
    before = snapshot(kv.ring_cache)
    with pytest.raises(RuntimeError, match=r"cache full: the chunk \[6, 9\) needs 9 slots of 6"):
        kv.update(k, v, 6)
    assert_same_state(before, snapshot(kv.ring_cache))
