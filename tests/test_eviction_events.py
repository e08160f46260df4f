"""The observer protocol: observers see exactly the tokens that leave, before their slots
change, in the documented order; an observer that raises aborts the call and the cache stays
as it was."""

import pytest
import torch

from conftest import assert_same_state, snapshot
from streamkv import CacheObserver, ChronologicalCache, KVCache, RingCache
from streamkv.attention import attend


@pytest.mark.parametrize("cls", [RingCache, ChronologicalCache])
@pytest.mark.parametrize("sink,window,chunk", [(2, 5, 3), (0, 6, 3), (3, 7, 2), (1, 4, 4), (0, 5, 2), (4, 9, 4)])
def test_window_caches_announce_the_dropped_positions(cls, sink, window, chunk):
    cap = sink + window
    cache = cls((1, cap, 2, 1), (1, cap, 2, 1), seq_dim=1, sink=sink, window=window, chunk=chunk, num_layers=2)
    seen = []

    def listener(ev):
        assert ev.at == "begin" and ev.evicted.shape == (2, 2, cap)
        assert (ev.evicted == ev.evicted[0, 0]).all()  # every layer and head loses the same slots
        assert sorted(ev.shared_slots) == ev.evicted[0, 0].nonzero().flatten().tolist()  # known on the host
        mask = ev.evicted[0, 0]
        pos = ev.cache.slot_positions[0, 0][mask].tolist()
        keys = ev.cache.keys(1)[0, mask, 0, 0].tolist()
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


@pytest.mark.parametrize("kind,params", [("mass", {"tau": 0.3}), ("h2o", {"budget": 6}), ("tova", {"budget": 6})])
def test_scored_caches_announce_per_head_evictions(kind, params):
    S, W, C, H = 1, 9, 2, 3
    cache = KVCache((1, S + W, H, 4), (1, S + W, H, 4), policy=kind, seq_dim=1, sink=S, window=W, chunk=C,
                    dtype=torch.float64, **params)
    events = []
    cache.add_eviction_listener(lambda ev: events.append((ev, ev.evicted.clone(), ev.cache.slot_positions[0].clone())))
    gen = torch.Generator().manual_seed(0)
    for c in range(8):
        cache.begin_chunk(c)
        k = torch.randn(1, C, H, 4, generator=gen, dtype=torch.float64) * 2
        q = torch.randn(1, C, H, 4, generator=gen, dtype=torch.float64) * 2
        attend(q, cache.update(k, k, q))
        before = cache.slot_positions[0].clone()
        cache.commit_chunk(c)
        ev, evicted, pos_at_call = events[-1]
        assert ev.at == "commit" and ev.shared_slots is None and evicted.shape == (1, H, S + W)
        assert set(ev.info) == {"overflow", "dropped_mass_bound"}
        assert torch.equal(pos_at_call, before)  # announced before the slots were freed
        assert torch.equal(evicted[0], (before >= 0) & (cache.slot_positions[0] < 0))
    assert any(e[1].any() for e in events)


class Log(CacheObserver):
    def __init__(self):
        self.calls = []

    def on_begin(self, cache, chunk_idx, advance):
        self.calls.append(("begin", chunk_idx, advance, cache.is_open))

    def on_evict(self, event):
        self.calls.append(("evict", event.chunk_idx, event.at))

    def on_write(self, cache, layer, k, v):
        self.calls.append(("write", layer))

    def on_queries(self, cache, layer, q):
        self.calls.append(("queries", layer))

    def on_commit(self, cache, chunk_idx):
        self.calls.append(("commit", chunk_idx, cache.is_open))

    def on_reset(self, cache):
        self.calls.append(("reset",))


def test_observer_calls_come_in_order_and_before_each_change():
    cache = RingCache((1, 5, 1, 2), (1, 5, 1, 2), seq_dim=1, sink=1, window=4, chunk=2, num_layers=2)
    log = cache.add_observer(Log())
    k = torch.zeros(1, 2, 1, 2)
    for c in range(3):
        cache.begin_chunk(c)
        for layer in range(2):
            cache.layer(layer).update(k, k, k)
        cache.commit_chunk(c)
    cache.begin_chunk(2)
    cache.commit_chunk(2)
    cache.reset()
    assert log.calls == [
        ("begin", 0, True, False), ("write", 0), ("queries", 0), ("write", 1), ("queries", 1), ("commit", 0, True),
        ("begin", 1, True, False), ("write", 0), ("queries", 0), ("write", 1), ("queries", 1), ("commit", 1, True),
        ("evict", 2, "begin"), ("begin", 2, True, False), ("write", 0), ("queries", 0), ("write", 1), ("queries", 1),
        ("commit", 2, True), ("begin", 2, False, False), ("commit", 2, True), ("reset",),
    ]
    with pytest.raises(ValueError, match="already watches"):
        cache.add_observer(log)
    cache.remove_observer(log)
    with pytest.raises(TypeError, match="observer must be a CacheObserver"):
        cache.add_observer(lambda ev: None)


def _refusing(hook):
    """An observer whose ``hook`` raises."""

    def refuse(self, *args):
        raise RuntimeError(f"observer refused {hook}")

    return type("Refuses", (CacheObserver,), {hook: refuse})()


@pytest.mark.parametrize("kind", ["ring", "chronological", "mass"])
@pytest.mark.parametrize("hook", ["on_evict", "on_begin", "on_write", "on_commit", "on_reset"])
def test_an_observer_that_raises_aborts_the_call_and_changes_nothing(kind, hook):
    """A listener that raises must not leave the ring's write slots moved (a reopen would then
    overwrite retained history), nor a chronological shift half done, nor a scored eviction."""
    params = {"tau": 0.3} if kind == "mass" else {}
    cache = KVCache((1, 8, 2, 4), (1, 8, 2, 4), policy=kind, seq_dim=1, sink=2, window=6, chunk=3, **params)
    gen = torch.Generator().manual_seed(1)

    def chunk(c, commit=True):
        cache.begin_chunk(c)
        k, q = torch.randn(1, 3, 2, 4, generator=gen), torch.randn(1, 3, 2, 4, generator=gen)
        attend(q, cache.update(k, k, q))
        if commit:
            cache.commit_chunk(c)

    for c in range(2):
        chunk(c)
    cache.begin_chunk(2)
    k = torch.randn(1, 3, 2, 4, generator=gen)
    attend(k, cache.update(k, k, k))
    obs = cache.add_observer(_refusing(hook))
    call = {"on_evict": lambda: cache.commit_chunk(2) if kind == "mass" else (cache.commit_chunk(2), cache.begin_chunk(3)),
            "on_begin": lambda: (cache.commit_chunk(2), cache.begin_chunk(3)),
            "on_write": lambda: cache.write(k, k),
            "on_commit": lambda: cache.commit_chunk(2),
            "on_reset": cache.reset}[hook]
    if hook in ("on_begin",) or (hook == "on_evict" and kind != "mass"):
        cache.remove_observer(obs)
        cache.commit_chunk(2)  # reach the state just before the refused call
        cache.add_observer(obs)
        call = lambda: cache.begin_chunk(3)  # noqa: E731
    before = snapshot(cache)
    with pytest.raises(RuntimeError, match=f"observer refused {hook}"):
        call()
    assert_same_state(before, snapshot(cache))
