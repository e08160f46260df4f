"""The H2O-style cache against a brute-force accumulated-attention reference."""

import pytest
import torch

from streamkv.attention import attend

from streamkv.caches import CACHE_KINDS, CacheSet, H2OCache

S, W, C, H, D, B = 2, 14, 3, 3, 4, 2
f64 = torch.float64


def _cache(**kw):
    args = dict(seq_dim=1, sink=S, window=W, chunk=C, budget=S + C + 4, dtype=f64)
    args.update(kw)
    cap = args["sink"] + args["window"]
    return H2OCache((B, cap, H, D), (B, cap, H, D + 1), **args)


def _chunks(n, seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, C, H, D, generator=g, dtype=f64) * scale,
             torch.randn(B, C, H, D + 1, generator=g, dtype=f64),
             torch.randn(B, C, H, D, generator=g, dtype=f64) * scale) for _ in range(n)]


def _positions(cache):
    pos = cache.slot_positions[0]
    return [{int(p) for p in pos[h].tolist() if p >= 0} for h in range(H)]


@pytest.mark.parametrize("budget", [S + C, S + C + 4, S + W - C])
def test_keeps_exactly_its_budget_with_the_highest_accumulated_scores(budget):
    cache = _cache(budget=budget)
    keys: dict[int, torch.Tensor] = {}  # position -> [B, H, D]
    score: list[dict[int, float]] = [dict() for _ in range(H)]  # brute force, per head
    evicted_any = False
    for c, (k, v, q) in enumerate(_chunks(14, seed=budget)):
        cache.begin_chunk(c)
        attend(q, cache.update(k, v, q))
        for i in range(C):
            keys[c * C + i] = k[:, i]
        resident = _positions(cache)
        for h in range(H):
            pos = sorted(resident[h])
            kk = torch.stack([keys[p][:, h] for p in pos], dim=1)  # [B, n, D]
            p = torch.softmax(torch.einsum("bcd,bnd->bcn", q[:, :, h], kk) / D**0.5, dim=-1)
            received = p.sum(dim=(0, 1))
            for j, pp in enumerate(pos):
                score[h][pp] = score[h].get(pp, 0.0) + float(received[j])
        cache.commit_chunk(c)
        after = _positions(cache)
        for h in range(H):
            protected = {p for p in resident[h] if p < S or p >= c * C}
            others = sorted(resident[h] - protected, key=lambda p: (-score[h][p], -p))
            want = protected | set(others[: max(0, budget - len(protected))])
            assert after[h] == want, (c, h)
            assert len(after[h]) == min(budget, len(resident[h]))
            evicted_any |= len(after[h]) < len(resident[h])
            for s in range(S + W):  # the cache's own scores match the brute force (0 on empty slots)
                p = int(cache.slot_positions[0, h, s])
                want_score = score[h][p] if p >= 0 else 0.0
                assert abs(float(cache.accumulated[0, h, s]) - want_score) <= 1e-12
            for p in resident[h] - after[h]:
                del score[h][p]  # an evicted token's score is gone; a new token starts from 0
    assert evicted_any
    rep = cache.report()
    assert rep["overflow_total"] == 0 and rep["budget"] == budget and "tau" not in rep


def test_heads_diverge_and_nothing_moves():
    cache = _cache()
    ptr = cache.keys().data_ptr()
    sets = set()
    for c, (k, v, q) in enumerate(_chunks(10, seed=7)):
        cache.begin_chunk(c)
        before = cache.slot_positions[0].clone()
        attend(q, cache.update(k, v, q))
        cache.commit_chunk(c)
        after = cache.slot_positions[0]
        still = (before >= 0) & (after >= 0)
        assert torch.equal(before[still], after[still])  # retained tokens keep their slots
        sets = {frozenset(s) for s in _positions(cache)}
    assert len(sets) > 1 and cache.keys().data_ptr() == ptr


@pytest.mark.parametrize("budget,match", [
    (S + C - 1, rf"{S + C} <= budget <= {S + W - C}, got {S + C - 1}"),
    (S + W - C + 1, rf"got {S + W - C + 1}"),
])
def test_budget_out_of_range(budget, match):
    with pytest.raises(ValueError, match=match):
        _cache(budget=budget)


def test_budget_type_and_default():
    with pytest.raises(TypeError, match="budget must be an int"):
        _cache(budget=7.0)
    assert _cache(budget=None).budget == S + W - C


def test_registered_and_in_a_cacheset():
    assert CACHE_KINDS["h2o"] is H2OCache
    cs = CacheSet("h2o", k_shape=(1, S + W, H, D), v_shape=(1, S + W, H, D), seq_dim=1, sink=S, window=W, chunk=C,
                  num_layers=2, budget=S + C + 1, branches=("cond", "uncond"))
    assert isinstance(cs["cond"], H2OCache) and cs["uncond"].accumulated.shape == (2, H, S + W)


def test_state_dict_resumes_identically_and_reset_clears_scores():
    a, b = _cache(), _cache()
    chunks = _chunks(10, seed=3)
    for c in range(5):
        a.begin_chunk(c)
        attend(chunks[c][2], a.update(*chunks[c][:2], chunks[c][2]))
        a.commit_chunk(c)
    b.load_state_dict({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.state_dict().items()})
    assert torch.equal(a.accumulated, b.accumulated)
    for cache in (a, b):
        for c in range(5, 10):
            cache.begin_chunk(c)
            attend(chunks[c][2], cache.update(*chunks[c][:2], chunks[c][2]))
            cache.commit_chunk(c)
    assert torch.equal(a.slot_positions, b.slot_positions) and torch.equal(a.accumulated, b.accumulated)
    assert a.accumulated.abs().sum() > 0
    a.reset()
    assert a.accumulated.abs().sum() == 0 and (a.slot_positions < 0).all()


def test_a_reopened_chunk_replaces_what_its_first_commit_added():
    """The first pass's queries of a rewritten chunk no longer count: the older tokens' scores after
    its second commit are those of a stream that only ever saw the second pass (they were counted
    twice), and the evictions that follow agree."""
    from streamkv import KVCache

    def build():
        return KVCache((1, 12, 2, 4), (1, 12, 2, 4), seq_dim=1, sink=1, window=11, chunk=2, policy="h2o",
                       dtype=torch.float64, budget=9)

    g = torch.Generator().manual_seed(4)
    data = [tuple(torch.randn(1, 2, 2, 4, generator=g, dtype=torch.float64) for _ in range(3)) for _ in range(8)]
    redo = tuple(torch.randn(1, 2, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    a, b = build(), build()
    for c in range(4):
        for x, d in ((a, data[c]), (b, data[c] if c < 3 else redo)):
            x.begin_chunk(c)
            attend(d[2], x.layer(0).update(d[0], d[1], d[2]))
            x.commit_chunk(c)
    a.begin_chunk(3)  # reopened: rewritten with what b committed
    attend(redo[2], a.layer(0).update(redo[0], redo[1], redo[2]))
    a.commit_chunk(3)
    assert torch.allclose(a.policy.accumulated, b.policy.accumulated, rtol=0, atol=1e-15)
    for c in range(4, 8):
        for x in (a, b):
            x.begin_chunk(c)
            attend(data[c][2], x.layer(0).update(*data[c][:2], data[c][2]))
            x.commit_chunk(c)
        assert torch.equal(a.slot_positions, b.slot_positions)
