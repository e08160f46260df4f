"""TOVA against a brute-force reference: after each commit every head keeps its sinks, the chunk
just committed, and the tokens the chunk's queries attended to most (sum over the chunk's queries
and the batch of the softmax over the head's slots then; ties: the newer position)."""

import pytest
import torch

from streamkv.attention import attend
from streamkv.caches import TOVACache

S, W, C, H, D, B = 1, 12, 3, 3, 4, 2
f64 = torch.float64


def _held(cache):
    pos = cache.slot_positions[0]
    return [{int(p) for p in pos[h].tolist() if p >= 0} for h in range(pos.shape[0])]


@pytest.mark.parametrize("budget", [S + C, S + C + 3, S + W - C])
def test_keeps_the_newest_chunks_favourites(budget):
    cache = TOVACache((B, S + W, H, D), (B, S + W, H, D), seq_dim=1, sink=S, window=W, chunk=C, budget=budget,
                      dtype=f64)
    g = torch.Generator().manual_seed(budget)
    keys = {}
    evicted = 0
    for c in range(14):
        k, v, q = (torch.randn(B, C, H, D, generator=g, dtype=f64) * 2 for _ in range(3))
        cache.begin_chunk(c)
        attend(q, cache.update(k, v, q))
        for i in range(C):
            keys[c * C + i] = k[:, i]
        before = _held(cache)
        cache.commit_chunk(c)
        after = _held(cache)
        for h in range(H):
            pos = sorted(before[h])
            kk = torch.stack([keys[p][:, h] for p in pos], 1)  # [B, n, D]
            p = torch.softmax(torch.einsum("bcd,bnd->bcn", q[:, :, h], kk) / D**0.5, -1)
            score = dict(zip(pos, p.sum(dim=(0, 1)).tolist()))
            protected = {x for x in pos if x < S or x >= c * C}
            rest = sorted(set(pos) - protected, key=lambda x: (-score[x], -x))
            want = protected | set(rest[: max(0, budget - len(protected))])
            assert after[h] == want, (c, h)
            evicted += len(before[h]) - len(after[h])
    assert evicted > 0 and cache.report()["overflow_total"] == 0


def test_forgets_what_the_present_ignores():
    """Unlike H2O, nothing accumulates: a token that was the favourite once leaves as soon as the
    newest chunk stops looking at it."""
    cache = TOVACache((1, S + W, 1, 2), (1, S + W, 1, 2), seq_dim=1, sink=S, window=W, chunk=C, budget=S + C + 2,
                      dtype=f64)
    far = torch.tensor([10.0, 0.0], dtype=f64).view(1, 1, 1, 2)
    for c in range(6):
        k = torch.zeros(1, C, 1, 2, dtype=f64)
        if c == 1:
            k[:, 0] = far[:, 0]  # position C: a key aligned with the early queries
        q = (far if c < 3 else -far).expand(1, C, 1, 2)
        cache.begin_chunk(c)
        attend(q, cache.update(k, k, q))
        cache.commit_chunk(c)
        held = _held(cache)[0]
        if c == 2:
            assert C * 1 in held  # the favourite of the early queries
    assert C * 1 not in held  # gone once the queries turned away
