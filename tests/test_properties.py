"""Property-based tests: random legal (and illegal) call sequences against the reference,
invariants checked after every call."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from conftest import assert_same_state, snapshot
from streamkv import ChronologicalCache, RingCache
from streamkv.reference import ReferenceCache


class CacheMachine(RuleBasedStateMachine):
    """Drives a ring and a chronological cache plus the reference through random calls."""

    @initialize(
        chunk=st.integers(1, 4),
        sink_extra=st.integers(0, 6),
        window_extra=st.integers(0, 7),
        seq_dim=st.sampled_from([0, 1, -2]),
    )
    def setup(self, chunk, sink_extra, window_extra, seq_dim):
        self.sink, self.window, self.chunk = sink_extra, chunk + window_extra, chunk
        cap = self.sink + self.window
        # rank-3 shapes [*, *, D]: seq_dim 0, 1 or -2 (== 1) holds the slots
        self.k_shape = (cap, 2, 3) if seq_dim == 0 else (2, cap, 3)
        self.v_shape = self.k_shape[:-1] + (1,)
        self.seq_dim = seq_dim
        kw = dict(seq_dim=seq_dim, sink=self.sink, window=self.window, chunk=chunk, dtype=torch.float64)
        self.caches = [RingCache(self.k_shape, self.v_shape, **kw), ChronologicalCache(self.k_shape, self.v_shape, **kw)]
        self.ref = ReferenceCache(sink=self.sink, window=self.window, chunk=chunk, seq_dim=seq_dim)
        self.ptrs = [(c.keys().data_ptr(), c.values().data_ptr()) for c in self.caches]
        self.counter = 0.0
        self.written_since_begin = True

    def _chunk_tensors(self):
        seq = self.caches[0].seq_dim
        ks = list(self.k_shape)
        ks[seq] = self.chunk
        vs = list(self.v_shape)
        vs[seq] = self.chunk
        self.counter += 1.0
        k = torch.arange(torch.Size(ks).numel(), dtype=torch.float64).view(ks) + 1000 * self.counter
        return k, k.sum(-1, keepdim=True)

    @property
    def cache(self):
        return self.caches[0]

    @precondition(lambda self: self.cache.open_chunk is None)
    @rule()
    def begin_next(self):
        c = self.cache.next_chunk
        for x in (*self.caches, self.ref):
            x.begin_chunk(c)
        self.written_since_begin = False

    @precondition(lambda self: self.cache.open_chunk is None and self.cache.next_chunk > 0)
    @rule()
    def begin_again(self):
        c = self.cache.next_chunk - 1
        for x in (*self.caches, self.ref):
            x.begin_chunk(c)

    @precondition(lambda self: self.cache.open_chunk is not None)
    @rule()
    def write(self):
        k, v = self._chunk_tensors()
        for x in (*self.caches, self.ref):
            x.write(k, v)
        self.written_since_begin = True

    @precondition(lambda self: self.cache.open_chunk is not None and self.written_since_begin)
    @rule()
    def commit(self):
        c = self.cache.open_chunk
        for x in (*self.caches, self.ref):
            x.commit_chunk(c)

    @rule()
    def reset(self):
        for x in (*self.caches, self.ref):
            x.reset()
        self.written_since_begin = True

    @rule(delta=st.integers(-3, 3).filter(lambda d: d not in (0, -1)))
    def illegal_begin(self, delta):
        """A chunk index that is neither next nor current (or any begin while open) is rejected."""
        for cache in self.caches:
            before = snapshot(cache)
            try:
                cache.begin_chunk(cache.next_chunk + delta)
            except (ValueError, RuntimeError):
                pass
            else:
                raise AssertionError("illegal begin_chunk accepted")
            assert_same_state(before, snapshot(cache))

    @invariant()
    def matches_reference(self):
        if not hasattr(self, "caches") or not self.written_since_begin or self.cache.end == 0:
            return
        rk, rv = self.ref.chronological_keys(), self.ref.chronological_values()
        for cache in self.caches:
            assert torch.equal(cache.chronological_keys(), rk)
            assert torch.equal(cache.chronological_values(), rv)

    @invariant()
    def structural_invariants(self):
        if not hasattr(self, "caches"):
            return
        for cache, ptrs in zip(self.caches, self.ptrs):
            assert (cache.keys().data_ptr(), cache.values().data_ptr()) == ptrs  # allocated once
            pos = cache.slot_positions.tolist()
            held = [p for p in pos if p >= 0]
            assert len(held) == len(set(held)), "a position in two slots"
            assert sorted(held) == cache.layout.retained_positions(cache.end)
            assert pos[cache.num_valid :] == [-1] * (cache.layout.capacity - cache.num_valid)
            for s in range(min(self.sink, cache.end)):  # sinks never move
                assert pos[s] == s
        ring = self.caches[0]
        for p in ring.layout.retained_positions(ring.end):  # ring: a position's slot never changes
            assert ring.slot_positions[ring.layout.ring_slot(p)].item() == p


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@settings(max_examples=200, deadline=None)
@given(sink=st.integers(0, 9), window=st.integers(1, 13), chunk=st.integers(1, 13), end_chunks=st.integers(0, 40))
def test_ring_and_chronological_hold_the_same_positions(sink, window, chunk, end_chunks):
    if chunk > window:
        return
    from streamkv.layout import CacheLayout

    L = CacheLayout(sink=sink, window=window, chunk=chunk)
    end = end_chunks * chunk
    ring = sorted(L.ring_chronological_slots(end))
    assert ring == list(range(L.num_valid(end)))  # the ring's occupied slots are a prefix
