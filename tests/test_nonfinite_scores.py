"""Scored caches built with ``check_finite=False`` (commits with no read-back, for captured
graphs) take non-finite statistics: such tokens leave first and are counted, and nothing else
about the cache breaks -- its state dict loads, its bound is not poisoned by a NaN that stayed,
and the mass budget still stops at ``tau`` over the finite tokens."""

import math

import pytest
import torch

from kinds import QUERY_SCORED, params
from streamkv import KVCache
from streamkv.quant import KVQuant
from streamkv.policies import POLICIES
from streamkv.attention import attend

B, D, SINK, WINDOW, C = 2, 4, 1, 12, 2


def _cache(kind, **kw):
    extra = {"budget": 7} if "budget" in params(kind) else {}
    return KVCache((B, SINK + WINDOW, 1, D), (B, SINK + WINDOW, 1, D), seq_dim=1, sink=SINK, window=WINDOW, chunk=C,
                   policy=kind, dtype=torch.float64, check_finite=False, **params(kind, **{**extra, **kw}))


def _stream(cache, chunks, nan_at, seed=0):
    """``chunks`` chunks; the key of batch row 1's first token of chunk ``nan_at`` is NaN."""
    g = torch.Generator().manual_seed(seed)
    for c in range(chunks):
        cache.begin_chunk(c)
        k, v, q = (torch.randn(B, C, 1, D, generator=g, dtype=torch.float64) for _ in range(3))
        if c == nan_at:
            k[1, 0, 0, 0] = math.nan
        attend(q, cache.layer(0).update(k, v, q))
        cache.commit_chunk(c)
    return q


@pytest.mark.parametrize("kind", QUERY_SCORED)
def test_a_cache_that_took_a_nan_statistic_loads_its_own_state_and_continues(kind):
    cache = _cache(kind)
    _stream(cache, 4, nan_at=3)  # the NaN key in the newest chunk: protected, it stays
    twin = _cache(kind)
    twin.load_state_dict(cache.state_dict())  # was refused: "key_max must be finite"
    g = torch.Generator().manual_seed(9)
    for c in (4, 5):
        k, v, q = (torch.randn(B, C, 1, D, generator=g, dtype=torch.float64) for _ in range(3))
        outs = []
        for x in (cache, twin):
            x.begin_chunk(c)
            outs.append(attend(q, x.layer(0).update(k, v, q))[0])
            x.commit_chunk(c)
        assert torch.equal(*[o.nan_to_num() for o in outs])
        assert torch.equal(cache.slot_positions, twin.slot_positions)


@pytest.mark.parametrize("kind", QUERY_SCORED)
def test_a_nan_that_stays_does_not_poison_the_bound_of_what_left(kind):
    """The NaN key's token is in the newest, protected chunk: what left is finite, and so is its bound."""
    cache = _cache(kind)
    _stream(cache, 8, nan_at=7)
    assert torch.isfinite(cache.policy.dropped_mass_bound).all()


def test_the_mass_budget_stops_at_tau_over_the_finite_tokens():
    """A non-finite token leaves first, and the finite candidates after it still stop at tau
    (their -inf place in the order weighed -inf in the sum, which took every candidate)."""
    cache = _cache("mass", tau=0.05)
    held = None
    g = torch.Generator().manual_seed(0)
    for c in range(5):
        cache.begin_chunk(c)
        k, v, q = (torch.randn(B, C, 1, D, generator=g, dtype=torch.float64) for _ in range(3))
        if c == 3:
            k[1, 0, 0, 0] = math.nan  # position 6, batch row 1
        held = sorted(p for p in cache.slot_positions[0, 0].tolist() if p >= 0)
        attend(q, cache.layer(0).update(k, v, q))
        cache.commit_chunk(c)
    after = sorted(p for p in cache.slot_positions[0, 0].tolist() if p >= 0)
    left = sorted(set(held) - set(after))
    assert 6 in left and int(cache.policy.nonfinite.sum()) == 1
    candidates = [p for p in held if p >= SINK and p < 4 * C]
    assert len(left) < len(candidates)  # not every candidate


@pytest.mark.parametrize("kind", QUERY_SCORED)
def test_a_nan_in_a_sink_is_refused_at_the_commit_where_its_statistic_is_skipped(kind):
    """A kind that never reads the sinks' statistics (``reads_protected_statistics`` False) has them
    skipped by the read; a NaN sink key still makes the commit refuse under ``check_finite``
    (the rows that see it have a NaN log-sum-exp: the skipped slots read NaN), changing nothing."""
    extra = {"budget": 7} if "budget" in params(kind) else {}
    cache = KVCache((B, SINK + WINDOW, 1, D), (B, SINK + WINDOW, 1, D), seq_dim=1, sink=SINK, window=WINDOW, chunk=C,
                    policy=kind, dtype=torch.float64, **params(kind, **extra))
    assert cache.policy.statistic.skip == (0 if cache.policy.reads_protected_statistics else SINK)
    g = torch.Generator().manual_seed(1)
    for c in range(3):
        k, v, q = (torch.randn(B, C, 1, D, generator=g, dtype=torch.float64) for _ in range(3))
        cache.begin_chunk(c)
        attend(q, cache.layer(0).update(k, v, q))
        cache.commit_chunk(c)
    cache.storage.store.keys[0][0, 0, 0, 0] = math.nan  # the sink's key, batch row 0, after its commit
    k, v, q = (torch.randn(B, C, 1, D, generator=g, dtype=torch.float64) for _ in range(3))
    cache.begin_chunk(3)
    attend(q, cache.layer(0).update(k, v, q))
    before = {n: t.clone() for n, t in cache.state_dict().items() if isinstance(t, torch.Tensor)}
    with pytest.raises(ValueError, match="not finite"):
        cache.commit_chunk(3)
    after = cache.state_dict()
    assert all(torch.equal(t, after[n]) or torch.equal(t.isnan(), after[n].isnan()) and torch.equal(
        t.nan_to_num(), after[n].nan_to_num()) for n, t in before.items())


@pytest.mark.parametrize("mode", ["plain", "causal", "window"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("quant", [None, "int8", "int8+residual"])
@pytest.mark.parametrize("kind", QUERY_SCORED)
def test_skipping_the_protected_statistics_changes_no_eviction(kind, quant, dtype, mode):
    """A kind whose read skips the statistics of the slots it never evicts (the sinks; the newest
    chunk, which a dense store's pass leaves out by gathering the other rows) evicts, chunk by
    chunk, exactly what it evicts with every statistic computed, with the same bound, and every
    statistic it reads is the same; dense, and quantised with the sinks in full precision (the
    first hot rows, ``Segment.pinned``; the span's hot rows are left out without a residual,
    ``Segment.span_from``, and scored with one); causal reads, with and without a window, included."""
    extra = {"budget": 7} if "budget" in params(kind) else {}
    caches = []
    for computed in (False, True):
        cls = POLICIES[kind]
        if computed:  # the same rule, reading every slot's statistic
            cls = type(cls.__name__, (cls,), {"reads_protected_statistics": True})
        pol = cls(**params(kind, **extra))
        caches.append(KVCache((B, SINK + 2 + WINDOW, 1, D), (B, SINK + 2 + WINDOW, 1, D), seq_dim=1, sink=SINK + 2,
                              window=WINDOW, chunk=C, policy=pol, dtype=dtype,
                              quant=None if quant is None else KVQuant(
                                  "int8", sinks=True, residual=3 if quant.endswith("residual") else 0)))
    skipping = not POLICIES[kind].reads_protected_statistics
    assert caches[0].policy.statistic.newest == skipping and caches[1].policy.statistic.skip == 0
    g = torch.Generator().manual_seed(4)
    how = {"plain": {}, "causal": {"causal": True}, "window": {"causal": True, "window": 5}}[mode]
    for c in range(10):
        k, v, q = ((torch.randn(B, C, 1, D, generator=g, dtype=torch.float64) * 3).to(dtype) for _ in range(3))
        for cache in caches:
            cache.begin_chunk(c)
            attend(q, cache.layer(0).update(k, v, q), **how)
        # the statistics the policy reads: every candidate's (not a sink, not the open span)
        pos = caches[0].slot_positions
        cand = (pos >= SINK + 2) & (pos < c * C)
        for name in ("key_max", "key_sum"):
            got, want = (cache.policy.state()[name] for cache in caches)
            assert torch.equal(torch.where(cand, got, 0), torch.where(cand, want, 0)), (c, name)
            if skipping:
                assert not bool(torch.where(cand, 0, got).any()), (c, name)  # the others read 0
        for cache in caches:
            cache.commit_chunk(c)
        assert torch.equal(caches[0].slot_positions, caches[1].slot_positions), c
        assert torch.equal(caches[0].policy.dropped_mass_bound, caches[1].policy.dropped_mass_bound), c
