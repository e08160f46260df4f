"""Every kind, quantised or not, runs a chunk without reading the device back: the forward (every
layer's update, read and statistics) traces into one graph with no break and no recompile across
fills and wraps; begin and commit trace whole (no read-back, which would break the graph); a steady
chunk synchronises 0 times (counted at the dispatcher, as the bench counts)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

from streamkv import KVCache
from streamkv.attention import attend
from streamkv_lab.measure.counts import count_dispatch
from streamkv.policies import POLICIES, make_policy
from streamkv.quant import KVQuant

from kinds import KINDS, params

SINK, WINDOW, CHUNK, LAYERS = 2, 12, 4, 2


def _cache(kind, quant=None):
    """``check_finite=False``: the checks that read the device back (non-finite scores, non-finite
    K/V into codes) are off, as a captured graph needs them."""
    extra = {"check_finite": False} if POLICIES[kind].per_head else {}
    quant = None if quant is None else KVQuant(quant, check_finite=False)
    budget = {"budget": SINK + WINDOW - CHUNK} if "budget" in POLICIES[kind].cache_properties else {}
    return KVCache((1, SINK + WINDOW, 2, 8), (1, SINK + WINDOW, 2, 8), seq_dim=1, sink=SINK, window=WINDOW,
                   chunk=CHUNK, policy=kind, num_layers=LAYERS, quant=quant, **params(kind, **budget, **extra))


def _forward(cache):
    def fwd(q, k, v):
        return torch.stack([attend(q, cache.layer(i).update(k, v, q, occupancy="mask"))[0] for i in range(LAYERS)])
    return fwd


def _data(g):
    return tuple(torch.randn(1, CHUNK, 2, 8, generator=g) for _ in range(3))


@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize("kind", [k for k in KINDS if make_policy(k, **params(k)).graph_safe_writes])
def test_the_forward_is_one_graph_across_fills_and_wraps(kind, quant):
    torch._dynamo.reset()
    cache, cnt, g = _cache(kind, quant), CompileCounter(), torch.Generator().manual_seed(0)
    eager = _cache(kind, quant)
    fwd = torch.compile(_forward(cache), backend=cnt, fullgraph=True)
    for c in range(3 * (SINK + WINDOW) // CHUNK):  # fills, first eviction, wraps
        data = _data(g)
        for cc, f in ((cache, fwd), (eager, _forward(eager))):
            cc.begin_chunk(c)
            out = f(*data)
            cc.commit_chunk(c)
            if cc is cache:
                got = out
        assert torch.allclose(got, out, rtol=1e-5, atol=1e-6), (c, (got - out).abs().max())
        assert torch.equal(cache.slot_positions, eager.slot_positions)
    assert cnt.frame_count == 1, f"{kind}: {cnt.frame_count} graphs (a recompile or a graph break)"


@pytest.mark.parametrize("kind", KINDS)
def test_begin_and_commit_trace_whole(kind):
    """fullgraph=True: a read of the device (``.item()``, ``.tolist()``, ``bool(t)``) would break the
    graph and raise. (They recompile per chunk: the host's counters are part of them.)"""
    torch._dynamo.reset()
    cache, g = _cache(kind), torch.Generator().manual_seed(1)
    begin = torch.compile(lambda c: cache.begin_chunk(c), backend="eager", fullgraph=True)
    commit = torch.compile(lambda c: cache.commit_chunk(c), backend="eager", fullgraph=True)
    for c in range(5):
        begin(c)
        q, k, v = _data(g)
        for i in range(LAYERS):
            attend(q, cache.layer(i).update(k, v, q))
        commit(c)


@pytest.mark.parametrize("kind", KINDS)
def test_a_tiered_commit_traces_whole(kind):
    """The compressed tier (no recall) records what its cache evicts with no read-back either:
    fixed shapes from host bounds, on the device; the same tier state as an eager twin. Every
    other kind's tier certifies (its begin checks the host's product precision). (Each chunk
    recompiles, as above: the recompile limit is raised for the run past tier 2's ring.)"""
    torch._dynamo.reset()
    certify = KINDS.index(kind) % 2 == 1
    (cache, tier), (twin, ttwin) = _tiered(kind, certify), _tiered(kind, certify)
    g = torch.Generator().manual_seed(3)
    begin = torch.compile(lambda c: cache.begin_chunk(c), backend="eager", fullgraph=True)
    commit = torch.compile(lambda c: cache.commit_chunk(c), backend="eager", fullgraph=True)
    with torch._dynamo.config.patch(recompile_limit=16):
        for c in range(6):  # past tier 2's ring: blocks reach tier 3
            q, k, v = _data(g)
            for cc, b, m in ((cache, begin, commit), (twin, twin.begin_chunk, twin.commit_chunk)):
                b(c)
                for i in range(LAYERS):
                    attend(q, cc.layer(i).update(k, v, q))
                m(c)
    assert tier.frontier == ttwin.frontier and max(max(f) for f in tier.frontier) > 0
    for name in ("k_codes", "v_codes", "live", "entry_pos", "vlo", "vhi"):
        assert torch.equal(getattr(tier, name), getattr(ttwin, name)), name
    for a, b in zip(tier.lo + tier.hi, ttwin.lo + ttwin.hi):
        assert torch.equal(a, b)


def _tiered(kind, certify):
    from streamkv.certify.tier import CompressedTier

    cache = _cache(kind)
    return cache, CompressedTier(cache, fmt="int8", capacity=4, block=4, causal=False, certify=certify)


@pytest.mark.parametrize("quant", [None, "int8", "tier", "tier+certificates"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_steady_chunk_reads_the_device_back_zero_times(kind, quant):
    """``tier``: a compressed tier (no recall) on the full-precision cache, with or without its
    certificate."""
    if quant is not None and quant.startswith("tier"):
        cache, _ = _tiered(kind, certify=quant == "tier+certificates")
    else:
        cache = _cache(kind, quant)
    g = torch.Generator().manual_seed(2)

    def chunk():
        c = cache.next_chunk
        cache.begin_chunk(c)
        q, k, v = _data(g)
        for i in range(LAYERS):
            attend(q, cache.layer(i).update(k, v, q, occupancy="mask"))
        cache.commit_chunk(c)

    for _ in range(4 * (SINK + WINDOW) // CHUNK):
        chunk()  # past the first evictions (and a tier's first blocks into tier 3)
    counts = count_dispatch(chunk)
    assert counts.host_syncs == 0, counts.syncs


@pytest.mark.parametrize("kind", [k for k in KINDS if POLICIES[k].per_head])
def test_without_the_finite_check_non_finite_tokens_leave_first_and_are_counted(kind):
    """check_finite=True (the default) refuses a commit of non-finite scores, changing nothing;
    check_finite=False reads nothing back: the tokens whose scores are not finite leave first, counted."""
    g = torch.Generator().manual_seed(3)
    for strict in (True, False):
        budget = {"budget": SINK + WINDOW - CHUNK} if "budget" in POLICIES[kind].cache_properties else {}
        cache = KVCache((1, SINK + WINDOW, 2, 8), (1, SINK + WINDOW, 2, 8), seq_dim=1, sink=SINK, window=WINDOW,
                        chunk=CHUNK, policy=kind, **params(kind, **budget, check_finite=strict))
        for c in range(4):
            q, k, v = _data(g)
            if c == 1:
                k[0, 0, 0, 0] = float("nan")  # position 4: a NaN key in head 0
            cache.begin_chunk(c)
            attend(q, cache.layer(0).update(k, v, q))
            if c == 1 and strict:
                before = cache.state_dict()
                with pytest.raises(ValueError, match="not finite"):
                    cache.commit_chunk(c)
                assert torch.equal(cache.slot_positions, before["slot_positions"]) and cache.is_open
                break
            cache.commit_chunk(c)
        if not strict:
            assert int(cache.policy.nonfinite.sum()) >= 1
            assert not bool((cache.slot_positions[0, 0] == CHUNK).any())  # position 4 left head 0


def test_quantised_storage_without_the_finite_check_keeps_what_it_was_given():
    g = torch.Generator().manual_seed(4)
    for strict in (True, False):
        cache = KVCache((1, SINK + WINDOW, 2, 8), (1, SINK + WINDOW, 2, 8), seq_dim=1, sink=SINK, window=WINDOW,
                        chunk=CHUNK, policy="ring", quant=KVQuant("int8", check_finite=strict))
        q, k, v = _data(g)
        k[0, SINK, 0, 0] = float("inf")  # past the sinks (those stay full precision)
        cache.begin_chunk(0)
        cache.layer(0).update(k, v)
        if strict:
            with pytest.raises(ValueError, match="NaN or inf"):
                cache.commit_chunk(0)
            continue
        cache.commit_chunk(0)
        again = KVCache((1, SINK + WINDOW, 2, 8), (1, SINK + WINDOW, 2, 8), seq_dim=1, sink=SINK, window=WINDOW,
                        chunk=CHUNK, policy="ring", quant=KVQuant("int8", check_finite=False))
        again.load_state_dict(cache.state_dict())  # its own state dict loads


@pytest.mark.parametrize("kind", KINDS)
def test_the_hosts_eviction_counts_hold_on_the_device(kind):
    """What the host knows of a commit without reading the device, and what an observer sizes
    its gathers and tier 3 by, checked against the device: a commit evicts at most
    ``most_evicted()`` per (layer, head); where ``kept(end)`` is known, every head holds exactly
    that after a commit."""
    cache, g = _cache(kind), torch.Generator().manual_seed(4)
    policy, cap = cache.policy, cache.storage.capacity
    if policy.most_evicted() is None and policy.kept(0) is None:
        pytest.skip(f"{kind}: the host knows neither count")
    for c in range(3 * (SINK + WINDOW) // CHUNK):
        cache.begin_chunk(c)
        q, k, v = _data(g)
        for i in range(LAYERS):
            attend(q, cache.layer(i).update(k, v, q))
        before = (cache.slot_positions[..., :cap] >= 0).sum(-1)
        cache.commit_chunk(c)
        held = (cache.slot_positions[..., :cap] >= 0).sum(-1)
        if policy.most_evicted() is not None:
            assert int((before - held).max()) <= policy.most_evicted(), c
        if policy.kept(cache.end) is not None:
            assert bool((held == policy.kept(cache.end)).all()), (c, held.tolist(), policy.kept(cache.end))
