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


@pytest.mark.parametrize("budget", [S + C, S + C + 3, S + W - C])
def test_ties_and_non_finite_scores_leave_in_position_order(budget):
    """Scores from three values (ties at the cut-off are the rule) and some NaN
    (``check_finite=False``: they leave first), given as the attention's statistics: after each
    commit every head keeps the same set as a full sort by (score, position) -- the selection
    sorts nothing, and an eviction count below its bound (a budget under the default) or zero
    (the fill) takes the same path."""
    cache = TOVACache((1, S + W, H, D), (1, S + W, H, D), seq_dim=1, sink=S, window=W, chunk=C, budget=budget,
                      dtype=f64, check_finite=False)
    g = torch.Generator().manual_seed(budget)
    cap = cache.policy.storage.capacity
    evicted = 0
    for c in range(16):
        k = torch.randn(1, C, H, D, generator=g, dtype=f64)
        cache.begin_chunk(c)
        cache.update(k, k)
        ksum = torch.randint(0, 3, (H, cap), generator=g).to(f64)
        ksum[torch.rand(H, cap, generator=g) < 0.1] = float("nan")
        cache.policy.receive(0, None, ksum)
        pos = cache.slot_positions[0].clone()
        before = _held(cache)
        cache.commit_chunk(c)
        after = _held(cache)
        for h in range(H):
            score = {int(p): ksum[h, i].item() for i, p in enumerate(pos[h].tolist()) if p >= 0}
            score = {p: (-torch.inf if s != s else s) for p, s in score.items()}
            protected = {x for x in before[h] if x < S or x >= c * C}
            rest = sorted(before[h] - protected, key=lambda x: (-score[x], -x))
            assert after[h] == protected | set(rest[: max(0, budget - len(protected))]), (c, h)
            evicted += len(before[h]) - len(after[h])
    assert evicted > 0
