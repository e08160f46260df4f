"""Every rejected call raises a clear exception and leaves the cache exactly as it was."""

import pytest
import torch

from conftest import assert_same_state, snapshot
from streamkv import CacheSet, ChronologicalCache, RingCache

KINDS = [RingCache, ChronologicalCache]
S, W, C, H, D = 2, 5, 3, 2, 4


def _cache(cls, num_layers=1, **kw):
    cap = S + W
    return cls((1, cap, H, D), (1, cap, H, D + 1), seq_dim=1, sink=S, window=W, chunk=C, num_layers=num_layers, **kw)


def _kv(num=0.0):
    return torch.full((1, C, H, D), float(num)), torch.full((1, C, H, D + 1), float(num))


def _mid_stream(cls, open_chunk=True):
    cache = _cache(cls)
    for c in range(5):  # past the first eviction and a wrap
        cache.begin_chunk(c)
        cache.write(*_kv(c))
        cache.commit_chunk(c)
    if open_chunk:
        cache.begin_chunk(5)
        cache.write(*_kv(5))
    return cache


def _rejects(cache, exc, match, fn):
    before = snapshot(cache)
    with pytest.raises(exc, match=match):
        fn()
    assert_same_state(before, snapshot(cache))


k_ok, v_ok = _kv()


@pytest.mark.parametrize("cls", KINDS)
@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda c: c.write(k_ok[:, :2], v_ok[:, :2]), ValueError, r"k must have shape \(1, 3, 2, 4\).*got \(1, 2, 2, 4\)"),
        (lambda c: c.write(k_ok[0], v_ok[0]), ValueError, "k must have rank 4"),
        (lambda c: c.write(k_ok, k_ok), ValueError, r"v must have shape \(1, 3, 2, 5\).*got \(1, 3, 2, 4\)"),
        (lambda c: c.write(k_ok.double(), v_ok), TypeError, "k must have the cache dtype torch.float32, got torch.float64"),
        (lambda c: c.write(k_ok, v_ok.half()), TypeError, "v must have the cache dtype"),
        (lambda c: c.write(k_ok.to("meta"), v_ok), ValueError, "k must be on the cache device cpu, got meta"),
        (lambda c: c.write([1.0], v_ok), TypeError, "k must be a Tensor, got list"),
        (lambda c: c.write(k_ok, v_ok, layer=1), ValueError, r"layer must be in \[0, 1\), got 1"),
        (lambda c: c.begin_chunk(6), RuntimeError, r"chunk 5 is still open: call commit_chunk\(5\)"),
        (lambda c: c.commit_chunk(4), ValueError, r"must name the open chunk \(5\), got 4"),
        (lambda c: c.commit_chunk("5"), TypeError, "chunk_idx must be an int, got str"),
    ],
)
def test_rejected_calls_with_an_open_chunk(cls, call, exc, match):
    cache = _mid_stream(cls, open_chunk=True)
    _rejects(cache, exc, match, lambda: call(cache))


@pytest.mark.parametrize("cls", KINDS)
@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda c: c.begin_chunk(7), ValueError, r"the next chunk \(5\) or the current one \(4\), got 7"),
        (lambda c: c.begin_chunk(3), ValueError, r"the next chunk \(5\) or the current one \(4\), got 3"),
        (lambda c: c.begin_chunk(-1), ValueError, "got -1"),
        (lambda c: c.begin_chunk(5.0), TypeError, "chunk_idx must be an int, got float"),
        (lambda c: c.begin_chunk(True), TypeError, "chunk_idx must be an int, got bool"),
        (lambda c: c.write(k_ok, v_ok), RuntimeError, r"write\(\) needs an open chunk"),
        (lambda c: c.commit_chunk(4), RuntimeError, r"commit_chunk\(4\) with no open chunk"),
    ],
)
def test_rejected_calls_between_chunks(cls, call, exc, match):
    cache = _mid_stream(cls, open_chunk=False)
    _rejects(cache, exc, match, lambda: call(cache))


@pytest.mark.parametrize("cls", KINDS)
def test_fresh_cache_accepts_only_chunk_zero(cls):
    cache = _cache(cls)
    _rejects(cache, ValueError, r"must be the next chunk \(0\), got 1", lambda: cache.begin_chunk(1))
    _rejects(cache, RuntimeError, "needs an open chunk", lambda: cache.write(k_ok, v_ok))


@pytest.mark.parametrize("cls", KINDS)
def test_multi_layer_cache_requires_the_layer(cls):
    cache = _cache(cls, num_layers=3)
    cache.begin_chunk(0)
    _rejects(cache, ValueError, "layer is required: this cache holds 3 layers", lambda: cache.write(k_ok, v_ok))
    _rejects(cache, ValueError, r"layer must be in \[0, 3\), got -1", lambda: cache.write(k_ok, v_ok, layer=-1))


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(k_shape=(1, 7, 2, 4), v_shape=(1, 7, 3, 4)), ValueError, "must agree except in the last dim"),
        (dict(k_shape=(1, 8, 2, 4), v_shape=(1, 8, 2, 4)), ValueError, r"k_shape\[seq_dim=1\] must equal sink \+ window = 7, got 8"),
        (dict(seq_dim=3), ValueError, "seq_dim must index a non-feature dim of a rank-4 shape.*got 3"),
        (dict(seq_dim=-1), ValueError, "got -1"),
        (dict(seq_dim=4), ValueError, "got 4"),
        (dict(k_shape=(7,), v_shape=(7,), seq_dim=0), ValueError, "at least 2 dims"),
        (dict(k_shape=(1, 7, 0, 4), v_shape=(1, 7, 0, 4)), ValueError, "positive sizes"),
        (dict(chunk=6), ValueError, r"chunk \(6\) must be <= window \(5\)"),
        (dict(sink=-2), ValueError, "sink must be >= 0, got -2"),
        (dict(num_layers=0), ValueError, "num_layers must be >= 1, got 0"),
        (dict(dtype=torch.int32), TypeError, "dtype must be a floating-point torch.dtype"),
        (dict(buffers=(torch.zeros(2, 1, 7, 2, 4), torch.zeros(2, 1, 7, 2, 4))), ValueError, r"buffers K must have shape \(1, 1, 7, 2, 4\), got \(2, 1, 7, 2, 4\)"),
    ],
)
@pytest.mark.parametrize("cls", KINDS)
def test_bad_construction(cls, kwargs, exc, match):
    base = dict(k_shape=(1, 7, 2, 4), v_shape=(1, 7, 2, 4), seq_dim=1, sink=S, window=W, chunk=C)
    base.update(kwargs)
    with pytest.raises(exc, match=match):
        cls(base.pop("k_shape"), base.pop("v_shape"), **base)


@pytest.mark.parametrize("cls", KINDS)
def test_load_state_dict_of_another_layout_is_rejected(cls):
    cache = _mid_stream(cls, open_chunk=False)
    other_kind = _mid_stream(RingCache if cls is ChronologicalCache else ChronologicalCache, open_chunk=False)
    other_layout = cls((1, 8, H, D), (1, 8, H, D + 1), seq_dim=1, sink=S, window=W + 1, chunk=C)
    other_dtype = _cache(cls, dtype=torch.float64)
    other_layers = _cache(cls, num_layers=2)
    for other, match in (
        (other_kind, "state dict kind must be"),
        (other_layout, r"state dict layout must be \(2, 5, 3\) for this cache, got \(2, 6, 3\)"),
        (other_dtype, "state dict dtype must be 'torch.float32'"),
        (other_layers, "state dict num_layers must be 1"),
    ):
        _rejects(cache, ValueError, match, lambda: cache.load_state_dict(other.state_dict()))
    bad = dict(cache.state_dict(), open_chunk=2)
    _rejects(cache, ValueError, r"open_chunk must be None or next_chunk - 1 = 4, got 2", lambda: cache.load_state_dict(bad))
    bad = dict(cache.state_dict(), keys=torch.zeros(3))
    _rejects(cache, ValueError, r"state dict keys must be a \(1, 1, 7, 2, 4\) torch.float32 tensor, got \(3,\)", lambda: cache.load_state_dict(bad))
    bad = {k: v for k, v in cache.state_dict().items() if k != "seq_dim"}
    _rejects(cache, ValueError, "state dict lacks 'seq_dim'", lambda: cache.load_state_dict(bad))


def test_cacheset_begin_is_all_or_nothing():
    cs = CacheSet("ring", k_shape=(1, 7, H, D), v_shape=(1, 7, H, D), seq_dim=1, sink=S, window=W, chunk=C, num_layers=2)
    k = torch.zeros(1, C, H, D)
    for c in range(2):
        cs.begin_chunk(c)
        for layer in range(2):
            for b in cs:
                cs[b].write(k, k, layer=layer)
        cs.commit_chunk(c)
    cs.reset(branches=["uncond"])  # the branches now disagree on the next chunk
    before = snapshot(cs)
    with pytest.raises(ValueError, match=r"the next chunk \(0\), got 2"):
        cs.begin_chunk(2)
    assert_same_state(before, snapshot(cs))
    with pytest.raises(KeyError, match="no branch 'neg'"):
        cs.begin_chunk(2, branches=["neg"])
    assert_same_state(before, snapshot(cs))
