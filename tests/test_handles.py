"""Reads know their generation, and every ``attend`` option takes effect or is refused: a read
kept across a begin, a commit, a reset or a load is refused (it held an old prefix, or zeros
after a reset, and was attended without complaint); ``key_transform`` without cache-relative
RoPE, a mask of the wrong key count, non-bool flags and bad scales are refused naming the
option, before any torch kernel runs."""

import math

import pytest
import torch

from kinds import KINDS, params
from streamkv import KVCache
from streamkv.attention import attend

S, W, C, H, D = 1, 6, 2, 2, 4


def _cache(kind):
    return KVCache((1, S + W, H, D), (1, S + W, H, D), policy=kind, seq_dim=1, sink=S, window=W, chunk=C,
                   dtype=torch.float64, **params(kind))


def _chunk(cache, c, gen):
    cache.begin_chunk(c)
    k, q = (torch.randn(1, C, H, D, generator=gen, dtype=torch.float64) for _ in range(2))
    read = cache.update(k, k, q)
    attend(q, read)
    return read, q


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("change", ["commit", "begin", "reset", "load"])
def test_a_read_from_an_earlier_generation_is_refused(kind, change):
    gen = torch.Generator().manual_seed(0)
    cache = _cache(kind)
    for c in range(3):
        _chunk(cache, c, gen)
        cache.commit_chunk(c)
    state = cache.state_dict()
    read, q = _chunk(cache, 3, gen)
    {"commit": lambda: cache.commit_chunk(3),
     "begin": lambda: (cache.commit_chunk(3), cache.begin_chunk(4)),
     "reset": cache.reset,
     "load": lambda: cache.load_state_dict(state)}[change]()
    with pytest.raises(ValueError, match="was read before the cache's last begin, commit, reset or load"):
        attend(q, read)
    if change == "reset":  # a fresh read of the empty cache is refused for its own reason
        with pytest.raises(ValueError, match="holds no token yet"):
            attend(q, cache.read())


def test_a_read_stays_valid_across_writes_and_queries_of_its_span():
    gen = torch.Generator().manual_seed(1)
    cache = _cache("tova")
    read, q = _chunk(cache, 0, gen)
    k = torch.randn(1, C, H, D, dtype=torch.float64)
    cache.write(k, k)  # a denoising step rewrites the span: same generation
    cache.observe_queries(q)
    out, _ = attend(q, read)
    assert torch.equal(out, attend(q, cache.read())[0])


def test_options_that_would_be_ignored_or_fail_inside_torch_are_refused():
    gen = torch.Generator().manual_seed(2)
    cache = _cache("ring")
    for c in range(5):
        _chunk(cache, c, gen)
        cache.commit_chunk(c)
    read, q = _chunk(cache, 5, gen)
    n = cache.num_valid
    with pytest.raises(ValueError, match="key_transform is applied only with rope_mode='cache_relative'"):
        attend(q, read, key_transform=lambda k: k)
    with pytest.raises(ValueError, match=r"attn_mask \(2, 3\) must broadcast to the scores over the chronological keys"):
        attend(q, read, attn_mask=torch.ones(C, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask must be bool or floating point"):
        attend(q, read, attn_mask=torch.ones(C, n, dtype=torch.long))
    with pytest.raises(TypeError, match="attn_mask must be a Tensor"):
        attend(q, read, attn_mask=[[True] * n] * C)
    with pytest.raises(TypeError, match="causal and return_lse must be bools"):
        attend(q, read, causal=1)
    for bad, exc in ((math.nan, ValueError), (0.0, ValueError), (-1, ValueError), (True, TypeError)):
        with pytest.raises(exc, match="scale"):
            attend(q, read, scale=bad)
    out, info = attend(q, read, attn_mask=torch.ones(C, n, dtype=torch.bool))  # the right count works
    assert info.path == "chronological" and torch.isfinite(out).all()
