"""flashdreams' KV-cache-relative RoPE flow (raw keys, ``cached_k().clone()`` rotated by index,
queries at ``freqs[write_end - chunk : write_end]``) over ``CircularBlockKVCache(relative_rope_freqs=)``
equals the same flow over flashdreams 0.1.0's own ``BlockKVCache``, through fills, evictions,
wraps, rewrites of the open chunk; the rotation is written here apart (complex numbers)."""

import pytest
import torch
import torch.nn.functional as F

from streamkv.compat.flashdreams import CircularBlockKVCache

H, D = 2, 8


def _apply_rope_freqs(x, freqs, interleaved):
    """flashdreams' ``apply_rope_freqs`` in plain torch: ``x [B, S, H, D]``, full-width angles ``[S, 1, 1, D]``
    (row ``s`` rotates token ``s``)."""
    freqs = freqs[:, 0]  # [S, 1, D] against x's [S, H, D]
    if interleaved:
        z = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
        out = torch.view_as_real(z * torch.polar(torch.ones_like(freqs[..., ::2]), freqs[..., ::2].double())).flatten(-2)
    else:
        h = x.shape[-1] // 2
        z = torch.complex(x[..., :h].double(), x[..., h:].double()) * torch.polar(
            torch.ones_like(freqs[..., :h]).double(), freqs[..., :h].double())
        out = torch.cat([z.real, z.imag], dim=-1)
    return out.to(x.dtype)


def _freqs(n, interleaved):
    """A flashdreams-layout table: token i at frame i // 2 (a 1x2 frame), height 0, width i % 2."""
    inv = 100.0 ** (-torch.arange(0, D // 2, dtype=torch.float64) / (D // 2))
    i = torch.arange(n, dtype=torch.float64)
    ang = torch.outer(i // 2, inv) + torch.outer(i % 2, inv) * 0.37
    full = ang.repeat_interleave(2, -1) if interleaved else torch.cat([ang, ang], -1)
    return full.view(n, 1, 1, D)


def _flow(cache, q, freqs, interleaved):
    end = cache.write_end
    qr = _apply_rope_freqs(q, freqs[end - cache.chunk_size:end], interleaved)
    k = _apply_rope_freqs(cache.cached_k().clone(), freqs[:cache.size], interleaved)
    return F.scaled_dot_product_attention(qr.transpose(1, 2), k.transpose(1, 2), cache.cached_v().transpose(1, 2))


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("sink,window,chunk", [(0, 8, 2), (2, 6, 2), (3, 9, 3), (4, 8, 4)])
def test_cache_relative_flow_equals_block_kv_cache(BlockKVCache, interleaved, sink, window, chunk):
    cap = sink + window
    freqs = _freqs(cap, interleaved)
    g = torch.Generator().manual_seed(sink * 7 + window)
    shape = (1, cap, H, D)
    fd = BlockKVCache(k_shape=shape, v_shape=shape, seq_dim=-3, chunk_size=chunk, window_size=window,
                      sink_size=sink, device="cpu", dtype=torch.float64)
    ring = CircularBlockKVCache(shape, shape, -3, chunk, window, sink, device="cpu", dtype=torch.float64,
                                relative_rope_freqs=freqs, interleaved=interleaved)
    worst = 0.0
    for c in range(4 * cap // chunk):
        for rewrite in range(2):  # the open chunk written twice (denoising steps)
            fd.before_update(c) if rewrite == 0 else None
            ring.before_update(c) if rewrite == 0 else None
            k, v, q = (torch.randn(1, chunk, H, D, generator=g, dtype=torch.float64) for _ in range(3))
            fd.update(k, v)
            ring.update(k, v)
            assert ring.write_end == fd.write_end and ring.size == fd.size
            worst = max(worst, float((_flow(ring, q, freqs, interleaved) - _flow(fd, q, freqs, interleaved)).abs().max()))
        fd.after_update(c)
        ring.after_update(c)
    assert worst < 1e-12
    assert ring.ring.end > 2 * cap  # wrapped


def test_bad_frequency_tables_are_refused():
    with pytest.raises(ValueError, match="relative_rope_freqs must be"):
        CircularBlockKVCache((1, 8, H, D), (1, 8, H, D), -3, 2, 6, 2, device="cpu", relative_rope_freqs=torch.zeros(7, 1, 1, D))
    with pytest.raises(TypeError, match="floating tensor"):
        CircularBlockKVCache((1, 8, H, D), (1, 8, H, D), -3, 2, 6, 2, device="cpu", relative_rope_freqs=[1, 2])
