"""The observer protocol, two phases: ``prepare`` sees exactly the tokens that are about to leave
(still in the cache) and may veto; the hooks after apply see what happened and nothing that did
not. A veto leaves the cache and every observer as they were; a hook that fails after apply
cannot undo the change and the cache says so."""

import pytest
import torch

from conftest import assert_same_state, snapshot
from streamkv import CacheObserver, CacheSet, ChronologicalCache, KVCache, RingCache
from streamkv.attention import attend
from streamkv.policies import POLICIES, example_policy


class Peek(CacheObserver):
    """Reads the evicted tokens in prepare (while the cache still holds them)."""

    def __init__(self):
        self.seen = []

    def prepare(self, change):
        ev = change.eviction
        if ev is None:
            return None
        mask = ev.evicted[0, 0]
        pos = ev.cache.slot_positions[0, 0][mask].tolist()
        assert ev.positions[0, 0][mask].tolist() == pos  # the event's copy of what is held now
        keys = ev.cache.keys(1)[0, mask, 0, 0].tolist()
        assert keys == [float(p) for p in pos]  # the data is still there
        return lambda: self.seen.append((ev.chunk_idx, sorted(pos)))


@pytest.mark.parametrize("cls", [RingCache, ChronologicalCache])
@pytest.mark.parametrize("sink,window,chunk", [(2, 5, 3), (0, 6, 3), (3, 7, 2), (1, 4, 4), (0, 5, 2), (4, 9, 4)])
def test_window_caches_announce_the_dropped_positions(cls, sink, window, chunk):
    cap = sink + window
    cache = cls((1, cap, 2, 1), (1, cap, 2, 1), seq_dim=1, sink=sink, window=window, chunk=chunk, num_layers=2)
    peek = cache.add_observer(Peek())
    after = []

    def listener(ev):
        assert ev.at == "begin" and ev.evicted.shape == (2, 2, cap)
        assert (ev.evicted == ev.evicted[0, 0]).all()  # every layer and head loses the same slots
        assert sorted(ev.shared_slots) == ev.evicted[0, 0].nonzero().flatten().tolist()  # known on the host
        after.append((ev.chunk_idx, sorted(ev.positions[0, 0][ev.evicted[0, 0]].tolist())))

    cache.add_eviction_listener(listener)
    L = cache.layout
    for c in range(12):
        before = set(L.retained_positions(c * chunk))
        cache.begin_chunk(c)
        dropped = sorted(before - set(L.retained_positions((c + 1) * chunk)))
        if dropped:
            assert peek.seen and peek.seen[-1] == (c, dropped) and after[-1] == (c, dropped)
        else:
            assert not peek.seen or peek.seen[-1][0] != c
        x = torch.arange(c * chunk, (c + 1) * chunk, dtype=torch.float32).view(1, chunk, 1, 1).expand(1, chunk, 2, 1)
        for layer in range(2):
            cache.write(x, x, layer=layer)
        cache.commit_chunk(c)
    assert peek.seen == after and after


@pytest.mark.parametrize("kind", [k for k, p in POLICIES.items() if p.per_head])
def test_scored_caches_announce_per_head_evictions(kind):
    S, W, C, H = 1, 9, 2, 3
    cache = KVCache((1, S + W, H, 4), (1, S + W, H, 4), policy=kind, seq_dim=1, sink=S, window=W, chunk=C,
                    dtype=torch.float64, **example_policy(kind, **({"budget": 6} if "budget" in
                                                                   POLICIES[kind].cache_properties else {})))
    events = []
    cache.add_eviction_listener(lambda ev: events.append((ev, ev.evicted.clone(), cache.slot_positions[0].clone())))
    gen = torch.Generator().manual_seed(0)
    for c in range(8):
        cache.begin_chunk(c)
        k = torch.randn(1, C, H, 4, generator=gen, dtype=torch.float64) * 2
        q = torch.randn(1, C, H, 4, generator=gen, dtype=torch.float64) * 2
        attend(q, cache.update(k, k, q))
        before = cache.slot_positions[0].clone()
        cache.commit_chunk(c)
        if not events or events[-1][0].chunk_idx != c:
            continue
        ev, evicted, pos_at_call = events[-1]
        assert ev.at == "commit" and ev.shared_slots is None and evicted.shape == (1, H, S + W)
        assert set(ev.info) == {"overflow", "dropped_mass_bound"}
        assert torch.equal(ev.positions[0], before)  # what was held before the commit
        assert torch.equal(pos_at_call, cache.slot_positions[0])  # told after the slots were freed
        assert torch.equal(evicted[0], (before >= 0) & (cache.slot_positions[0] < 0))
    assert any(e[1].any() for e in events)
    if cache.policy.kept(1) is not None:  # the host knows the count: an event only where tokens leave
        assert events and all(e[1].any() for e in events)
        assert events[0][0].chunk_idx == -(-(cache.budget + 1) // C) - 1  # the first commit past the budget


class Log(CacheObserver):
    def __init__(self):
        self.calls = []

    def prepare(self, change):
        self.calls.append(("prepare", change.what, change.chunk_idx, change.cache.is_open))

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
        self.calls.append(("reset", cache.end))


def test_observer_calls_come_in_order_prepare_before_and_hooks_after_each_change():
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
    span = [("write", 0), ("queries", 0), ("write", 1), ("queries", 1)]
    assert log.calls == [
        ("prepare", "begin", 0, False), ("begin", 0, True, True), *span,
        ("prepare", "commit", 0, True), ("commit", 0, False),
        ("prepare", "begin", 1, False), ("begin", 1, True, True), *span,
        ("prepare", "commit", 1, True), ("commit", 1, False),
        ("prepare", "begin", 2, False), ("evict", 2, "begin"), ("begin", 2, True, True), *span,
        ("prepare", "commit", 2, True), ("commit", 2, False),
        ("prepare", "begin", 2, False), ("begin", 2, False, True), ("prepare", "commit", 2, True), ("commit", 2, False),
        ("prepare", "reset", None, False), ("reset", 0),
    ]
    with pytest.raises(ValueError, match="already watches"):
        cache.add_observer(log)
    cache.remove_observer(log)
    with pytest.raises(TypeError, match="observer must be a CacheObserver"):
        cache.add_observer(lambda ev: None)


class Vetoes(CacheObserver):
    """Vetoes one kind of change."""

    def __init__(self, what):
        self.what = what

    def prepare(self, change):
        if change.what == self.what:
            raise RuntimeError(f"observer refused {self.what}")


def _advanced(kind):
    cache = KVCache((1, 8, 2, 4), (1, 8, 2, 4), policy=kind, seq_dim=1, sink=2, window=6, chunk=3,
                    **example_policy(kind))
    gen = torch.Generator().manual_seed(1)
    for c in range(3):
        cache.begin_chunk(c)
        k, q = torch.randn(1, 3, 2, 4, generator=gen), torch.randn(1, 3, 2, 4, generator=gen)
        attend(q, cache.update(k, k, q))
        if c < 2:
            cache.commit_chunk(c)
    return cache


@pytest.mark.parametrize("kind", list(POLICIES))
@pytest.mark.parametrize("what", ["begin", "commit", "reset", "load"])
def test_a_veto_aborts_the_call_and_changes_nothing_in_any_observer(kind, what):
    """A veto must not leave the ring's write slots moved (a reopen would then overwrite retained
    history), nor a chronological shift half done, nor a scored eviction; and an observer told
    before the veto (a recorder here) acts on nothing."""
    cache = _advanced(kind)
    state = cache.state_dict()
    if what == "begin":
        cache.commit_chunk(2)
    recorded = []
    cache.add_eviction_listener(recorded.append)
    log = cache.add_observer(Log())
    cache.add_observer(Vetoes(what))
    call = {"begin": lambda: cache.begin_chunk(3), "commit": lambda: cache.commit_chunk(2), "reset": cache.reset,
            "load": lambda: cache.load_state_dict(state)}[what]
    before = snapshot(cache)
    with pytest.raises(RuntimeError, match=f"observer refused {what}"):
        call()
    assert_same_state(before, snapshot(cache))
    assert recorded == [] and [c[0] for c in log.calls] == ["prepare"]


class FailsAfter(CacheObserver):
    def on_commit(self, cache, chunk_idx):
        raise KeyError("bookkeeping")


def test_a_hook_that_fails_after_apply_says_the_change_stands_and_others_are_told():
    cache = _advanced("ring")
    cache.add_observer(FailsAfter())
    log = cache.add_observer(Log())
    with pytest.raises(RuntimeError, match=r"FailsAfter failed after the commit was applied \(the change stands"):
        cache.commit_chunk(2)
    assert not cache.is_open and log.calls[-1] == ("commit", 2, False)


@pytest.mark.parametrize("what", ["begin", "commit", "reset"])
def test_a_cache_set_is_all_or_nothing_when_one_branch_vetoes(what):
    cs = CacheSet("tova", k_shape=(1, 8, 2, 4), v_shape=(1, 8, 2, 4), seq_dim=1, sink=2, window=6, chunk=3,
                  branches=("cond", "uncond"))
    gen = torch.Generator().manual_seed(2)
    for c in range(3):
        cs.begin_chunk(c)
        for b in cs:
            k = torch.randn(1, 3, 2, 4, generator=gen)
            attend(k, cs[b].update(k, k, k))
        if c < 2:
            cs.commit_chunk(c)
    if what == "begin":
        cs.commit_chunk(2)
    logs = {b: cs[b].add_observer(Log()) for b in cs}
    cs["uncond"].add_observer(Vetoes(what))
    before = snapshot(cs)
    call = {"begin": lambda: cs.begin_chunk(3), "commit": lambda: cs.commit_chunk(2), "reset": cs.reset}[what]
    with pytest.raises(RuntimeError, match=f"observer refused {what}"):
        call()
    assert_same_state(before, snapshot(cs))
    assert all([c[0] for c in log.calls] == ["prepare"] for log in logs.values())
