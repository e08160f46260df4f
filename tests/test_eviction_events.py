"""Eviction listeners see exactly the tokens that leave, before their slots change."""

import pytest
import torch

from streamkv import ChronologicalCache, RingCache
from streamkv.caches import MassBudgetCache


@pytest.mark.parametrize("cls", [RingCache, ChronologicalCache])
@pytest.mark.parametrize("sink,window,chunk", [(2, 5, 3), (0, 6, 3), (3, 7, 2)])
def test_ring_and_chronological_announce_the_dropped_positions(cls, sink, window, chunk):
    cap = sink + window
    cache = cls((1, cap, 2, 1), (1, cap, 2, 1), seq_dim=1, sink=sink, window=window, chunk=chunk, num_layers=2)
    seen = []

    def listener(ev):
        assert ev.layers == (0, 1) and ev.evicted.shape == (cap,)
        pos = ev.cache.slot_positions[ev.evicted].tolist()
        keys = ev.cache.keys(1)[0, ev.evicted, 0, 0].tolist()
        assert keys == [float(p) for p in pos]  # the data is still there
        seen.append((ev.chunk_idx, sorted(pos)))

    cache.add_eviction_listener(listener)
    L = cache.layout
    for c in range(12):
        before = set(L.retained_positions(c * chunk))
        cache.begin_chunk(c)
        dropped = sorted(before - set(L.retained_positions((c + 1) * chunk)))
        if dropped:
            assert seen and seen[-1] == (c, dropped)
        else:
            assert not seen or seen[-1][0] != c
        x = torch.arange(c * chunk, (c + 1) * chunk, dtype=torch.float32).view(1, chunk, 1, 1).expand(1, chunk, 2, 1)
        for layer in range(2):
            cache.write(x, x, layer=layer)
        cache.commit_chunk(c)
    assert seen


def test_mass_cache_announces_per_head_evictions():
    S, W, C, H = 1, 9, 2, 3
    cache = MassBudgetCache((1, S + W, H, 4), (1, S + W, H, 4), seq_dim=1, sink=S, window=W, chunk=C, tau=0.3,
                            dtype=torch.float64)
    events = []
    cache.add_eviction_listener(lambda ev: events.append((ev.layers, ev.evicted.clone(), ev.cache.slot_positions[0].clone())))
    gen = torch.Generator().manual_seed(0)
    for c in range(8):
        cache.begin_chunk(c)
        k = torch.randn(1, C, H, 4, generator=gen, dtype=torch.float64) * 2
        cache.write(k, k)
        cache.observe_queries(torch.randn(1, C, H, 4, generator=gen, dtype=torch.float64) * 2)
        before = cache.slot_positions[0].clone()
        cache.commit_chunk(c)
        layers, evicted, pos_at_call = events[-1]
        assert layers == (0,) and evicted.shape == (H, S + W)
        assert torch.equal(pos_at_call, before)  # announced before the slots were freed
        assert torch.equal(evicted, (before >= 0) & (cache.slot_positions[0] < 0))
    assert any(e[1].any() for e in events)
