"""SnapKV against a brute-force reference: after each commit every head keeps its sinks, the chunk
just committed, and the tokens with the highest attention from the chunk's newest ``obs`` queries
(summed over them and the batch), max-pooled over the ``kernel`` held tokens around each in position
order (ties: the newer position). Controls: the chunk's first queries, or no pooling, keep another
set."""

import pytest
import torch

from streamkv.attention import attend
from streamkv.caches import CACHE_KINDS

S, W, C, H, D, B = 1, 12, 4, 3, 4, 2
f64 = torch.float64


def _held(cache):
    pos = cache.slot_positions[0]
    return [{int(p) for p in pos[h].tolist() if p >= 0} for h in range(pos.shape[0])]


def _reference(q, keys, held, c, h, budget, obs, kernel, rows="newest"):
    pos = sorted(held)
    kk = torch.stack([keys[p][:, h] for p in pos], 1)  # [B, n, D]
    p = torch.softmax(torch.einsum("bcd,bnd->bcn", q[:, :, h], kk) / D**0.5, -1)
    sel = p[:, -obs:] if rows == "newest" else p[:, :obs]
    score = sel.sum(dim=(0, 1)).tolist()
    r = kernel // 2
    pooled = {x: max(score[max(0, i - r): i + r + 1]) for i, x in enumerate(pos)}
    protected = {x for x in pos if x < S or x >= c * C}
    rest = sorted(set(pos) - protected, key=lambda x: (-pooled[x], -x))
    return protected | set(rest[: max(0, budget - len(protected))])


def _run(budget, obs, kernel, rows="newest", seed=0, ref_kernel=None):
    cache = CACHE_KINDS["snapkv"]((B, S + W, H, D), (B, S + W, H, D), seq_dim=1, sink=S, window=W, chunk=C,
                                  budget=budget, obs=obs, kernel=kernel, dtype=f64)
    g = torch.Generator().manual_seed(seed)
    keys, wrong, evicted = {}, 0, 0
    for c in range(12):
        k, v, q = (torch.randn(B, C, H, D, generator=g, dtype=f64) * 2 for _ in range(3))
        cache.begin_chunk(c)
        attend(q, cache.update(k, v, q))
        for i in range(C):
            keys[c * C + i] = k[:, i]
        before = _held(cache)
        cache.commit_chunk(c)
        after = _held(cache)
        for h in range(H):
            ref = _reference(q, keys, before[h], c, h, budget, obs, kernel if ref_kernel is None else ref_kernel, rows)
            wrong += after[h] != ref
            evicted += len(before[h]) - len(after[h])
    return wrong, evicted


@pytest.mark.parametrize("budget,obs,kernel", [(S + C + 2, 2, 3), (S + W - C, 1, 1), (S + C + 4, 4, 5)])
def test_keeps_the_pooled_favourites_of_the_newest_queries(budget, obs, kernel):
    wrong, evicted = _run(budget, obs, kernel)
    assert evicted > 0 and wrong == 0


def test_controls_fail():
    """The reference with the chunk's first queries, or without pooling, disagrees with the cache:
    the test can fail."""
    assert _run(S + C + 2, 2, 3, rows="first")[0] > 0
    assert _run(S + C + 2, 2, 3, ref_kernel=1)[0] > 0
