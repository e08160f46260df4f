"""Indexed writes move a row's bytes as the widest words it splits into (16-byte ``complex128``,
else ``int64``; a reinterpreting view, never a conversion): every bit pattern lands as written,
NaN payloads included, through the shared plan's ``index_copy_`` and a per-head plan's rows, and
the open span reads back (``index_select`` of the same words) as written."""

from __future__ import annotations

import pytest
import torch

from streamkv.caches import RingCache, TOVACache
from streamkv.stores.dense import word_size


def test_the_word_is_the_widest_the_rows_split_into():
    bf = torch.zeros(4, 128, dtype=torch.bfloat16)
    assert word_size(bf) == 16
    assert word_size(bf[:, 4:]) == 8  # 8-byte offset and 248-byte rows
    assert word_size(torch.zeros(4, 4, dtype=torch.bfloat16)) == 8
    assert word_size(torch.zeros(4, 3, dtype=torch.bfloat16)) is None
    assert word_size(bf[:, ::2]) is None  # strided along the last dim
    assert word_size(torch.zeros(4, 8, dtype=torch.float64)) is None  # already 8 bytes wide
    assert word_size(torch.zeros(3, 4, 5, dtype=torch.float32)[:, 1:]) is None  # 20-byte rows


def _bits(shape, gen) -> torch.Tensor:
    """bfloat16 of random bit patterns, with quiet and signalling NaNs and infinities among them."""
    raw = torch.randint(-(2 ** 15), 2 ** 15, shape, generator=gen, dtype=torch.int32).to(torch.int16)
    flat = raw.view(-1)
    special = torch.tensor([0x7F81, 0x7FC1, -0x7F, 0x7F80, -0x80, 0x0001], dtype=torch.int16)  # sNaN, qNaN, -sNaN, inf, -inf, subnormal
    flat[: special.numel()] = special
    return raw.view(torch.bfloat16)


@pytest.mark.parametrize("cls,D", [(RingCache, 8), (RingCache, 4), (TOVACache, 8), (TOVACache, 4), (TOVACache, 3)])
def test_an_indexed_write_lands_every_bit_pattern(cls, D):
    """Through the device plan (the ring's eager slices off, a scored cache's per-head rows), each
    written row holds exactly the chunk's bytes, at words of 16, 8 and no bytes."""
    B, S, W, C, H = 2, 1, 8, 3, 3
    shape = (B, S + W, H, D)
    cache = cls(shape, shape, seq_dim=1, sink=S, window=W, chunk=C, num_layers=2, dtype=torch.bfloat16)
    if cls is RingCache:
        cache.storage.store.eager_slices = False
    gen = torch.Generator().manual_seed(0)
    for c in range(6):
        cache.begin_tokens(C)
        k, v = _bits((B, C, H, D), gen), _bits((B, C, H, D), gen)
        for layer in range(2):
            cache.write(k, v, layer=layer)
            slots = cache.storage.write_slots[layer, :, :C] if cache.storage.per_head else \
                cache.storage.write_slots[0, 0, :C].expand(H, C)
            for buf, x in ((cache.storage.keys, k), (cache.storage.values, v)):
                for h in range(H):
                    got = buf[layer][:, slots[h], h].view(torch.int16)
                    assert torch.equal(got, x[:, :, h].view(torch.int16)), (c, layer, h)
            if cache.policy.needs_queries:
                cache.policy.receive(layer, torch.rand(H, S + W, generator=gen).double(), None)
        for which, x in (("k", k), ("v", v)):  # the span read back per head, the same bits
            want = x.permute(2, 0, 1, 3).view(torch.int16).expand(2, -1, -1, -1, -1)
            assert torch.equal(cache.storage.span(which, C).view(torch.int16), want), (c, which)
        cache.commit()
