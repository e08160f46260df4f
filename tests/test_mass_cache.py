"""The streaming mass-budget cache against independent full-matrix computations."""

import pytest
import torch

from conftest import assert_same_state, snapshot
from streamkv.attention import attend
from streamkv import KVCache
from streamkv.caches import CacheSet, MassBudgetCache

S, W, C, H, D = 2, 12, 3, 3, 4
TAU = 0.2


def _cache(**kw):
    args = dict(seq_dim=1, sink=S, window=W, chunk=C, tau=TAU, dtype=torch.float64)
    args.update(kw)
    cap = args["sink"] + args["window"]
    return MassBudgetCache((2, cap, H, D), (2, cap, H, D + 1), **args)


def _chunk(gen, scale=2.0):
    k = torch.randn(2, C, H, D, generator=gen, dtype=torch.float64) * scale
    v = torch.randn(2, C, H, D + 1, generator=gen, dtype=torch.float64)
    q = torch.randn(2, C, H, D, generator=gen, dtype=torch.float64) * scale
    return k, v, q


def _softmax_over(q, keys, occupied):
    """Independent full-matrix attention weights [B, H, C, cap] over occupied slots."""
    s = torch.einsum("bchd,bshd->bhcs", q, keys) / D**0.5
    s = s.masked_fill(~occupied.view(1, H, 1, -1), float("-inf"))
    return s.softmax(-1)


def _expected_eviction(p, pos, chunk_idx, tau):
    """Brute force per head: candidates (not sink, not the newest chunk) by (max mass, position)
    ascending; evict the longest prefix with sum <= tau."""
    m = p.amax(dim=(0, 2))  # [H, cap]
    evict = torch.zeros_like(pos, dtype=torch.bool)
    for h in range(H):
        cands = [s for s in range(pos.shape[1]) if pos[h, s] >= S and pos[h, s] < chunk_idx * C]
        cands.sort(key=lambda s: (m[h, s].item(), pos[h, s].item()))
        total = 0.0
        for s in cands:
            total += m[h, s].item()
            if total > tau:
                break
            evict[h, s] = True
    return evict


def test_eviction_matches_brute_force_and_keeps_the_mass():
    gen = torch.Generator().manual_seed(1)
    cache = _cache()
    for c in range(14):
        cache.begin_chunk(c)
        k, v, q = _chunk(gen)
        attend(q, cache.update(k, v, q))
        pos_before = cache.slot_positions[0].clone()
        occ = pos_before >= 0
        keys_before, vals_before = cache.keys().clone(), cache.values().clone()
        p = _softmax_over(q, keys_before, occ)
        out_before = torch.einsum("bhcs,bshd->bchd", p, vals_before)
        cache.commit_chunk(c)
        after = cache.slot_positions[0]
        evicted = occ & (after < 0)
        rep = cache.report()
        if rep["overflow_total"] == 0:
            assert torch.equal(evicted, _expected_eviction(p, pos_before, c, TAU))
            kept_mass = (p * (~evicted).view(1, H, 1, -1)).sum(-1)
            assert kept_mass.min().item() >= 1 - TAU - 1e-12
            # the reported bound: sum over the evicted of max_i p_ij, at least every query's dropped mass
            bound = torch.tensor(rep["last_dropped_mass_bound"][0], dtype=torch.float64)
            assert (bound - (p.amax(dim=(0, 2)) * evicted).sum(-1)).abs().max() < 1e-12
            assert ((1 - kept_mass).amax(dim=(0, 2)) <= bound + 1e-12).all() and (bound <= TAU).all()
            # the bound: |o_kept - o| <= tau * (max - min) per channel, per head
            out_after, info = attend(q, cache)
            assert info.occupancy == "mask"
            vrange = (vals_before.masked_fill(~occ.T.view(1, -1, H, 1), float("nan")))
            hi = vrange.nan_to_num(float("-inf")).amax(dim=(0, 1))
            lo = vrange.nan_to_num(float("inf")).amin(dim=(0, 1))
            assert ((out_after - out_before).abs() <= TAU * (hi - lo) + 1e-12).all()
        # sinks and the newest chunk are never evicted
        assert (after[:, :S] == torch.arange(S)).all()
        newest = set(range(c * C, (c + 1) * C))
        for h in range(H):
            assert newest <= set(after[h].tolist())
    assert cache.report()["evicted_total"] > 0


def test_heads_keep_different_sets_and_nothing_moves():
    gen = torch.Generator().manual_seed(2)
    cache = _cache()
    ptr = cache.keys().data_ptr()
    differ = False
    for c in range(12):
        cache.begin_chunk(c)
        before = cache.keys().clone()
        pos_before = cache.slot_positions[0].clone()
        k, v, q = _chunk(gen)
        attend(q, cache.update(k, v, q))
        # only the chunk's (slot, head) rows changed
        changed = (cache.keys() != before).any(dim=0).any(dim=-1)  # [cap, H]
        allowed = torch.zeros_like(changed)
        allowed[cache.write_slots[0].T, torch.arange(H).expand(C, H)] = True
        assert not (changed & ~allowed).any()
        # retained tokens keep their slots
        kept_then = pos_before >= 0
        assert torch.equal(cache.slot_positions[0][kept_then & (cache.slot_positions[0] >= 0)],
                           pos_before[kept_then & (cache.slot_positions[0] >= 0)])
        cache.commit_chunk(c)
        sets = [frozenset(x for x in cache.slot_positions[0, h].tolist() if x >= 0) for h in range(H)]
        differ |= len(set(sets)) > 1
    assert differ, "per-head budgets never diverged"
    assert cache.keys().data_ptr() == ptr


def test_overflow_is_counted_when_the_window_is_too_small():
    gen = torch.Generator().manual_seed(3)
    cache = _cache(window=2 * C, tau=0.01)
    for c in range(6):
        cache.begin_chunk(c)
        k, v, q = _chunk(gen, scale=0.1)  # diffuse attention: tau frees almost nothing
        attend(q, cache.update(k, v, q))
        cache.commit_chunk(c)
    rep = cache.report()
    assert rep["overflow_total"] > 0
    assert max(max(r) for r in rep["kept_tokens"]) <= S + 2 * C


def test_nan_scores_refuse_to_evict_and_leave_the_cache_unchanged():
    gen = torch.Generator().manual_seed(4)
    cache = _cache()
    for c in range(3):
        cache.begin_chunk(c)
        k, v, q = _chunk(gen)
        attend(q, cache.update(k, v, q))
        cache.commit_chunk(c)
    cache.begin_chunk(3)
    k, v, q = _chunk(gen)
    k[0, 1, 2, 0] = float("nan")
    attend(q, cache.update(k, v, q))
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"attention statistics of chunk 3 \(positions \[9, 12\)\) are not finite in layer"):
        cache.commit_chunk(3)
    assert_same_state(before, snapshot(cache))


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(tau=0.0), ValueError, r"tau must be in the open interval \(0, 1\), got 0.0"),
        (dict(tau=1.5), ValueError, "got 1.5"),
        (dict(window=5), ValueError, r"window \(5\) must hold the newest chunk and the next chunk: >= 6 slots"),
        (dict(window=2, protect_newest=False), ValueError, r"chunk \(3\) must be <= window \(2\)"),
        (dict(head_dim=3), ValueError, "head_dim must index a dim of k_shape"),
    ],
)
def test_bad_construction(kw, exc, match):
    with pytest.raises(exc, match=match):
        _cache(**kw)


def test_state_dict_resumes_identically():
    gen = torch.Generator().manual_seed(5)
    a, b = _cache(), _cache()
    chunks = [_chunk(gen) for _ in range(9)]
    for c in range(5):
        a.begin_chunk(c)
        attend(chunks[c][2], a.update(*chunks[c][:2], chunks[c][2]))
        a.commit_chunk(c)
    saved = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.state_dict().items()}
    b.load_state_dict(saved)
    for cache in (a, b):
        for c in range(5, 9):
            cache.begin_chunk(c)
            attend(chunks[c][2], cache.update(*chunks[c][:2], chunks[c][2]))
            cache.commit_chunk(c)
    assert torch.equal(a.slot_positions, b.slot_positions) and torch.equal(a.keys(), b.keys())


def test_cacheset_of_mass_caches_with_layers():
    cs = CacheSet("mass", k_shape=(1, S + W, H, D), v_shape=(1, S + W, H, D), seq_dim=1, sink=S, window=W,
                  chunk=C, num_layers=2, tau=0.1, branches=("cond", "uncond"))
    assert isinstance(cs["uncond"], MassBudgetCache) and cs["cond"].slot_positions.shape == (2, H, S + W)


@pytest.mark.parametrize("kind,params", [("h2o", {"budget": S + 7}), ("tova", {"budget": S + 7})])
def test_scores_from_attention_equal_scores_of_the_stored_queries(kind, params):
    """One cache takes its statistics from the model's attention (attend, no second pass);
    the other gets the queries through update(k, v, q) only and scores them at the commit: the
    same sums, so the same evictions and slots; the stored queries' maxima are also the causal
    attention's where larger, so their bound is at least the attention's (the mass budget's
    guarantee over stored queries: the test below)."""
    gen = torch.Generator().manual_seed(11)
    a = CacheSet(kind, k_shape=(2, S + W, H, D), v_shape=(2, S + W, H, D + 1), seq_dim=1, sink=S, window=W, chunk=C,
                 num_layers=2, dtype=torch.float64, **params)["cond"]
    b = CacheSet(kind, k_shape=(2, S + W, H, D), v_shape=(2, S + W, H, D + 1), seq_dim=1, sink=S, window=W, chunk=C,
                 num_layers=2, dtype=torch.float64, **params)["cond"]
    for c in range(12):
        for cache in (a, b):
            cache.begin_chunk(c)
        for step in range(2):  # the last pass before the commit is the one that counts
            for layer in range(2):
                k, v, q = _chunk(gen)
                out, info = attend(q, a.layer(layer).update(k, v, q))
                assert info.scored
                b.layer(layer).update(k, v, q)
        for cache in (a, b):
            cache.commit_chunk(c)
        assert torch.equal(a.slot_positions, b.slot_positions), c
    ra, rb = a.report(), b.report()
    assert ra["evicted_total"] == rb["evicted_total"] > 0
    assert min(y - x for x, y in zip(sum(ra["last_dropped_mass_bound"], []), sum(rb["last_dropped_mass_bound"], []))) > -1e-12


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("begin", ["chunk", "tokens"])
def test_stored_queries_keep_the_mass_guarantee_whatever_attention_the_caller_ran(begin, causal):
    """Queries handed to update(k, v, q) with attention run elsewhere, causal by position or over
    the whole span: the cache cannot know which, so it scores both. Every query of the span keeps
    mass >= 1 - tau of what it attended, and dropped_mass_bound is at least what any lost. (Scored
    over the whole span only, a causal query lost 0.43 at tau 0.3.)"""
    gen = torch.Generator().manual_seed(3)
    cache = _cache()
    worst = 0.0
    for c in range(14):
        if begin == "chunk":
            cache.begin_chunk(c)
        else:
            cache.begin_tokens(C)
        k, v, q = _chunk(gen, scale=3.0)
        read = cache.layer(0).update(k, v, q)
        pos = read.positions.clone()  # [H, cap], the held positions the span's queries attend
        keys = read.stored()[0]  # [B, cap, H, D]
        qpos = torch.arange(c * C, c * C + C)
        s = torch.einsum("bchd,bshd->bhcs", q, keys) / D**0.5
        hide = (pos < 0).view(1, H, 1, -1)
        if causal:
            hide = hide | (pos.view(1, H, 1, -1) > qpos.view(1, 1, -1, 1))
        p = s.masked_fill(hide, float("-inf")).softmax(-1)
        cache.commit()
        after = cache.slot_positions[0]
        gone = (pos >= 0) & (after != pos)  # left (a new token took the slot, or none)
        lost = (p * gone.view(1, H, 1, -1)).sum(-1)  # [B, H, C]
        bound = cache.policy.dropped_mass_bound[0]  # [H]
        assert (lost.amax(dim=(0, 2)) <= bound + 1e-12).all(), c
        assert (bound <= TAU + 1e-12).all() and int(cache.policy.overflows.sum()) == 0
        worst = max(worst, float(lost.max()))
    assert worst > 0.05  # evictions took real mass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["mass", "h2o", "tova", "snapkv"])
def test_a_narrow_cache_with_a_dominant_key_loads_its_own_state(kind, dtype):
    """One key takes nearly all of a query's attention: in float32 or bfloat16 the read's
    ``exp(s - lse)`` rounds above 1 (1 + 2**-16 seen). The statistic is a probability: it stays in
    ``[0, 1]``, so the cache's own state dict loads at every step."""
    from kinds import params

    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        c = KVCache((1, 7, 2, 4), (1, 7, 2, 4), policy=kind, seq_dim=1, sink=1, window=6, chunk=2, dtype=dtype,
                    **params(kind))
        for t in range(4):
            q, k, v = (torch.randn(1, 2, 2, 4, generator=g, dtype=dtype) for _ in range(3))
            k[0, 0] = q[0, 0] * 30
            c.begin_chunk(t)
            attend(q, c.layer(0).update(k, v, q))
            state = c.state_dict()
            assert float(state["key_max"].max()) <= 1.0
            KVCache((1, 7, 2, 4), (1, 7, 2, 4), policy=kind, seq_dim=1, sink=1, window=6, chunk=2, dtype=dtype,
                    **params(kind)).load_state_dict(state)
            c.commit_chunk(t)
