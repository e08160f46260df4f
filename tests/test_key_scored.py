"""The key-scored policies against plain references (kvpress's formulas, recomputed per head
from a whole-history record of the keys): K-norm keeps the lowest key norms, KeyDiff the keys
least like the mean unit key. Both need no queries: attention may run in any kernel. A control
flips each rule and is caught; the per-kind properties read the same through every constructor."""

import math

import pytest
import torch

from kinds import KINDS
from streamkv import KVCache
from streamkv.caches import CACHE_KINDS
from streamkv.policies import POLICIES

S, W, C, H, D, B = 1, 12, 3, 3, 4, 2
f64 = torch.float64


def _knorm(kk):  # [B, n, D] -> per-position score to keep (higher kept)
    return -kk.norm(dim=-1).mean(0)


def _keydiff(kk):
    unit = torch.nn.functional.normalize(kk, dim=-1)
    anchor = unit.mean(1, keepdim=True)
    return -torch.nn.functional.cosine_similarity(unit, anchor, dim=-1).mean(0)


RULES = {"knorm": _knorm, "keydiff": _keydiff}


def _held(cache):
    pos = cache.slot_positions[0]
    return [{int(p) for p in pos[h].tolist() if p >= 0} for h in range(pos.shape[0])]


def _run(kind, budget, rule, seed):
    cache = KVCache((B, S + W, H, D), (B, S + W, H, D), policy=kind, seq_dim=1, sink=S, window=W, chunk=C,
                    budget=budget, dtype=f64)
    g = torch.Generator().manual_seed(seed)
    keys, evicted, wrong = {}, 0, 0
    for c in range(14):
        k = torch.randn(B, C, H, D, generator=g, dtype=f64) * torch.rand(1, C, H, 1, generator=g, dtype=f64) * 3
        cache.begin_chunk(c)
        cache.update(k, k)  # no queries, no attention: the policy scores keys only
        for i in range(C):
            keys[c * C + i] = k[:, i]
        before = _held(cache)
        cache.commit_chunk(c)
        after = _held(cache)
        for h in range(H):
            pos = sorted(before[h])
            score = dict(zip(pos, rule(torch.stack([keys[p][:, h] for p in pos], 1)).tolist()))
            protected = {x for x in pos if x < S or x >= c * C}
            rest = sorted(set(pos) - protected, key=lambda x: (-score[x], -x))
            want = protected | set(rest[: max(0, budget - len(protected))])
            wrong += after[h] != want
            evicted += len(before[h]) - len(after[h])
    return evicted, wrong


@pytest.mark.parametrize("kind", list(RULES))
@pytest.mark.parametrize("budget", [S + C, S + C + 4, S + W - C])
def test_key_scored_policies_keep_what_their_rule_ranks_highest(kind, budget):
    evicted, wrong = _run(kind, budget, RULES[kind], seed=budget)
    assert evicted > 0 and wrong == 0


@pytest.mark.parametrize("kind", list(RULES))
def test_a_flipped_rule_is_caught(kind):
    evicted, wrong = _run(kind, S + C + 4, lambda kk: -RULES[kind](kk), seed=3)
    assert evicted > 0 and wrong > 0


@pytest.mark.parametrize("kind", list(RULES))
def test_key_scored_policies_need_no_queries_and_take_no_score_block(kind):
    assert not POLICIES[kind].needs_queries
    with pytest.raises(TypeError, match="scores keys, not queries: score_block does not apply"):
        KVCache((1, S + W, H, D), (1, S + W, H, D), policy=kind, seq_dim=1, sink=S, window=W, chunk=C, score_block=8)


@pytest.mark.parametrize("kind", KINDS)
def test_per_kind_properties_read_the_same_through_every_constructor(kind):
    args = ((1, S + W, H, D), (1, S + W, H, D))
    kw = dict(seq_dim=1, sink=S, window=W, chunk=C, **POLICIES[kind].example_params)
    named, plain = CACHE_KINDS[kind](*args, **kw), KVCache(*args, policy=kind, **kw)
    assert type(named).__name__ == f"{POLICIES[kind].__name__}Cache" and named.name == plain.name == kind
    for prop in POLICIES[kind].cache_properties:
        a, b = getattr(named, prop), getattr(plain, prop)
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), prop
    with pytest.raises(AttributeError, match="no attribute 'not_a_property'"):
        plain.not_a_property


@pytest.mark.parametrize("kind", ["knorm", "keydiff"])
def test_a_cache_that_keeps_non_finite_scores_loads_its_own_state(kind):
    """``check_finite=False`` keeps (and counts) a key whose norm is inf or NaN; the cache's own state
    dict (an exported stream) then loads back and continues identically. A cache that checks
    finiteness still refuses such a state."""
    def build(**kw):
        return KVCache((1, 7, 2, 4), (1, 7, 2, 4), policy=kind, seq_dim=1, sink=1, window=6, chunk=2, dtype=f64, **kw)

    g = torch.Generator().manual_seed(0)
    c = build(check_finite=False)
    for i in range(4):
        k = torch.randn(1, 2, 2, 4, generator=g, dtype=f64)
        if i == 1:
            k[0, 1, 0, 0] = float("inf")  # the newest span: protected, kept by this commit
        c.begin_chunk(i)
        c.update(k, k)
        c.commit_chunk(i)
        d = build(check_finite=False)
        d.import_stream(c.export_stream())
        assert torch.equal(d.slot_positions, c.slot_positions)
    state = c.state_dict()
    if not bool(torch.isfinite(state["norms"]).all()):
        with pytest.raises(ValueError, match="norms must be finite"):
            build().load_state_dict({**state, "policy": build().state_dict()["policy"]})
    state["norms"] = torch.full_like(state["norms"], -math.inf)
    with pytest.raises(ValueError, match="norms"):
        build(check_finite=False).load_state_dict(state)


@pytest.mark.parametrize("compiled", [False, True])
def test_keydiff_cosines_of_bf16_keys_are_float32_accurate(monkeypatch, compiled):
    """A bf16 cache's cosines are float32 sums of the keys widened (not bf16 products rounded to
    bf16): within float32 rounding of the float64 definition, eager and through the compiled
    kernel (forced at this size)."""
    from streamkv.policies import keydiff

    monkeypatch.setattr(keydiff, "COMPILE_MIN", 0 if compiled else 1 << 62)
    g = torch.Generator().manual_seed(0)
    Hh, R, cap, Dd = 2, 2, 300, 64
    k = (torch.randn(Hh, R, cap, Dd, generator=g) * 4 + 1).bfloat16()
    held = torch.rand(Hh, 1, cap, generator=g) < 0.8
    norms = torch.where(held, k.float().norm(dim=-1), 0.0)
    inv = torch.where(held, 1.0 / norms.clamp(min=1e-12), 0.0)
    count = held.sum(-1, keepdim=True).float()
    got = keydiff.cosines(k, inv, norms, count)
    kk = k.double()
    unit = kk / kk.norm(dim=-1, keepdim=True)
    anchor = (unit * held.unsqueeze(-1)).sum(-2, keepdim=True) / held.sum(-1, keepdim=True).unsqueeze(-1)
    want = torch.nn.functional.cosine_similarity(kk, anchor, dim=-1)
    err = (got.double() - want).abs()[held.expand_as(got)]
    assert got.dtype == torch.float32 and err.max() < 1e-5, float(err.max())
