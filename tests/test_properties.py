"""Property-based tests: random legal (and illegal) call sequences on every cache kind,
against a whole-history reference, with invariants checked after every call.

The state machine drives one cache of a drawn kind (ring, chronological, mass, H2O, TOVA, and
ring / mass caches watched by a certifier with recall slots) through chunks, reopened chunks,
spans of any length, writes with queries and attention, commits, resets, state-dict round
trips and illegal calls. After every step:

- buffers never move (``data_ptr``);
- per (layer, head): no position held twice, sinks pinned at their slots, nothing from the
  future, the open span resident, and the K/V in every occupied slot (recall slots included)
  equal to the history's K/V at the position it holds;
- window kinds hold exactly ``[sinks | last window]``, the ring a position's slot forever;
- attention over the cache's read (physical path) equals float64 softmax attention over
  exactly the history tokens each head holds, with position-causal masks too.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from conftest import assert_same_state, snapshot
from streamkv import KVCache
from streamkv.attention import attend
from kinds import CERTIFIED, KINDS, params, policy_of
from streamkv.certify import Certifier
from streamkv.policies import POLICIES

KINDS = KINDS + CERTIFIED
#: what the machine reached, per kind (the invariants saw real streams)
REACHED: dict[str, set[str]] = {}  # checked on a scripted stream (_scripted_stream)


class CacheMachine(RuleBasedStateMachine):
    kind: str  # set per kind (see the test below)

    @initialize(
        chunk=st.integers(1, 4),
        sink=st.integers(0, 5),
        window_extra=st.integers(0, 6),
        layout=st.sampled_from(["BTHD", "THD", "BHTD"]),
    )
    def setup(self, chunk, sink, window_extra, layout):
        kind = self.kind
        policy = policy_of(kind)
        scored = POLICIES[policy].per_head
        self.kind, self.chunk, self.sink = kind, chunk, sink
        self.window = (2 * chunk if scored else chunk) + window_extra
        cap = self.sink + self.window
        H, D = 2, 4
        self.k_shape, self.seq_dim = {"BTHD": ((1, cap, H, D), 1), "THD": ((cap, H, D), 0),
                                      "BHTD": ((1, H, cap, D), 2)}[layout]
        self.v_shape = self.k_shape[:-1] + (3,)
        certified = kind.startswith("certified-")
        self.cache = KVCache(self.k_shape, self.v_shape, policy=policy, seq_dim=self.seq_dim, sink=sink,
                             window=self.window, chunk=chunk, num_layers=2, dtype=torch.float64,
                             recall_slots=3 if certified else 0, **params(kind))
        if certified:
            Certifier(self.cache, recall_tau=0.3)
        self.ptrs = (self.cache.keys(0).data_ptr(), self.cache.values(0).data_ptr(),
                     self.cache.storage.positions.data_ptr())
        self.hist = [dict(), dict()]  # per layer: position -> (k row, v row), the latest write
        self.gen = torch.Generator().manual_seed(chunk * 100 + sink * 10 + window_extra)
        self.written = True  # every layer has been written (with queries) since the last begin

    # ------------------------------------------------------------------ helpers
    def _rows(self, shape, n):
        s = list(shape)
        s[self.seq_dim] = n
        return torch.randn(s, generator=self.gen, dtype=torch.float64)

    def _write(self, q_given=True):
        start, n = self.cache.open_span
        for layer in range(2):
            k, v = self._rows(self.k_shape, n), self._rows(self.v_shape, n)
            q = self._rows(self.k_shape, n)
            read = self.cache.layer(layer).update(k, v, q if q_given else None)
            for i in range(n):
                self.hist[layer][start + i] = (k.select(self.seq_dim, i), v.select(self.seq_dim, i))
            out, _ = attend(q, read, causal=True)
            self._check_attention(layer, q, out, causal=True)
        self.written = True

    def _held(self, layer):
        """Per head: the positions held (main and recall slots) -> slot."""
        pos = self.cache.layer_slot_positions(layer)
        return [{int(p): s for s, p in enumerate(pos[h].tolist()) if p >= 0} for h in range(pos.shape[0])]

    def _head_rows(self, t, head):
        """A layer tensor -> [rest..., T, D] for one head (the token dim next to the features)."""
        st_ = self.cache.storage
        x = t.movedim(st_.seq_dim, -2)
        return x.select(st_.head_axis, head) if st_.head_axis is not None else x

    def _check_attention(self, layer, q, out, causal):
        st_ = self.cache.storage
        qpos = range(*[self.cache.open_span[0], self.cache.end])
        for h, held in enumerate(self._held(layer)):
            positions = sorted(held)
            hist = [self.hist[layer].get(p) for p in positions]
            if any(x is None for x in hist):  # the open span not yet in the history: use the cache
                continue
            kh = torch.stack([self._head_rows(x[0].unsqueeze(st_.seq_dim), h).squeeze(-2) for x in hist], -2)
            vh = torch.stack([self._head_rows(x[1].unsqueeze(st_.seq_dim), h).squeeze(-2) for x in hist], -2)
            qh = self._head_rows(q, h)
            s = qh @ kh.transpose(-1, -2) / kh.shape[-1] ** 0.5
            if causal:
                hide = torch.tensor(positions).view(1, -1) > torch.tensor(list(qpos)).view(-1, 1)
                s = s.masked_fill(hide, float("-inf"))
            want = s.softmax(-1) @ vh
            assert (self._head_rows(out, h) - want).abs().max() < 1e-12

    # -------------------------------------------------------------------- rules
    @precondition(lambda self: not self.cache.is_open and self.cache.end % self.chunk == 0)
    @rule()
    def begin_next(self):
        self.cache.begin_chunk(self.cache.next_chunk)
        self.written = False

    @precondition(lambda self: not self.cache.is_open and self.cache.end % self.chunk == 0
                  and self.cache.last_span is not None and self.cache.last_span[1] == self.chunk)
    @rule()
    def begin_again(self):
        self.cache.begin_chunk(self.cache.next_chunk - 1)
        self.written = False

    @precondition(lambda self: not self.cache.is_open)
    @rule(n=st.integers(1, 4))
    def begin_span(self, n):
        n = min(n, self.chunk)
        self.cache.begin_tokens(n)
        self.written = False
        if n < self.chunk:
            REACHED.setdefault(self.kind, set()).add("partial span")

    @precondition(lambda self: self.cache.is_open)
    @rule()
    def write(self):
        self._write()

    @precondition(lambda self: not self.cache.is_open)
    @rule(n=st.integers(1, 12), partial=st.booleans())
    def burst(self, n, partial):
        """``n`` whole steps (begin, write, commit): streams get deep enough to evict and wrap."""
        for _ in range(n):
            if partial or self.cache.end % self.chunk:
                self.cache.begin_tokens(max(1, self.chunk - 1) if partial else self.chunk - self.cache.end % self.chunk)
            else:
                self.cache.begin_chunk(self.cache.next_chunk)
            self._write()
            self.cache.commit()

    @precondition(lambda self: self.cache.is_open and self.written)
    @rule()
    def commit(self):
        if self.cache.open_chunk is not None:
            self.cache.commit_chunk(self.cache.open_chunk)
        else:
            self.cache.commit()

    @rule()
    def reset(self):
        self.cache.reset()
        self.hist = [dict(), dict()]
        self.written = True

    @precondition(lambda self: not self.kind.startswith("certified-"))
    @rule()
    def state_dict_round_trip(self):
        """A snapshot taken now, the stream moved on, then the snapshot restored: the same state."""
        state = self.cache.state_dict()
        before = snapshot(self.cache.storage)
        if not self.cache.is_open:
            self.cache.begin_tokens(1)
            self.cache.write(self._rows(self.k_shape, 1), self._rows(self.v_shape, 1), layer=0)
            self.cache.write(self._rows(self.k_shape, 1), self._rows(self.v_shape, 1), layer=1)
        self.cache.load_state_dict(state)
        assert_same_state(before, snapshot(self.cache.storage))

    @rule(delta=st.integers(-3, 3).filter(lambda d: d not in (0, -1)))
    def illegal_begin(self, delta):
        """A chunk index that is neither next nor current (or any begin while open) is rejected."""
        before = snapshot(self.cache)
        try:
            self.cache.begin_chunk(self.cache.next_chunk + delta)
        except (ValueError, RuntimeError):
            pass
        else:
            raise AssertionError("illegal begin_chunk accepted")
        assert_same_state(before, snapshot(self.cache))

    # --------------------------------------------------------------- invariants
    @invariant()
    def storage_matches_history(self):
        if not hasattr(self, "cache"):
            return
        c, st_ = self.cache, self.cache.storage
        if c.end > c.layout.capacity:
            REACHED.setdefault(self.kind, set()).add("evicted")
        assert (c.keys(0).data_ptr(), c.values(0).data_ptr(), st_.positions.data_ptr()) == self.ptrs
        span = c.open_span
        for layer in range(2):
            pos = c.layer_slot_positions(layer)
            for h in range(pos.shape[0]):
                row = [p for p in pos[h].tolist() if p >= 0]
                assert len(row) == len(set(row)), "a position in two slots"
                assert all(p < c.end for p in row), "a position from the future"
                for s in range(min(self.sink, c.end)):
                    assert pos[h, s] == s, "a sink moved"
                if span is not None:
                    assert set(range(span[0], span[0] + span[1])) <= set(row), "the open span is not resident"
            if not self.written:
                continue
            kh, vh = self._head_rows(c.keys(layer), 0), self._head_rows(c.values(layer), 0)
            for h, held in enumerate(self._held(layer)):
                kh, vh = self._head_rows(c.keys(layer), h), self._head_rows(c.values(layer), h)
                for p, s in held.items():
                    hk, hv = self.hist[layer][p]
                    assert torch.equal(kh.select(-2, s), self._head_rows(hk.unsqueeze(self.seq_dim), h).squeeze(-2))
                    assert torch.equal(vh.select(-2, s), self._head_rows(hv.unsqueeze(self.seq_dim), h).squeeze(-2))
        if c.retains_window:
            pos = c.slot_positions[0, 0, : c.layout.capacity].tolist()
            assert sorted(p for p in pos if p >= 0) == c.layout.retained_positions(c.end)
            if c.name == "ring":
                for p in c.layout.retained_positions(c.end):  # a position's slot never changes
                    assert pos[c.layout.ring_slot(p)] == p

    @invariant()
    def physical_read_is_exact(self):
        """Attention over the read (no causal mask) equals float64 attention over the held tokens."""
        if not hasattr(self, "cache") or not self.written or self.cache.end == 0 or not self.cache.is_open:
            return
        q = self._rows(self.k_shape, self.cache.open_span[1])
        for layer in range(2):
            out, info = attend(q, self.cache.read(layer))
            assert info.path == "physical"
            self._check_attention(layer, q, out, causal=False)


def _scripted_stream(kind: str) -> set[str]:
    """One fixed stream through the machine's own rules, every invariant checked after each step:
    eviction, partial spans, a reopened chunk, a state round trip, an illegal begin, a reset. What
    hypothesis draws is not fixed: derandomized, its draws still depend on the constants of every
    module loaded (hypothesis' constant pool), so a new policy file, or a test file imported
    before, moves them; this stream reaches the deep states whatever they are."""
    REACHED.pop(kind, None)
    m = type(f"{kind}Script", (CacheMachine,), {"kind": kind})()
    m.setup(chunk=3, sink=1, window_extra=2, layout="BTHD")
    steps = [
        lambda: m.burst(n=6, partial=False),  # past the capacity: evicts
        lambda: m.begin_span(n=2), m.write, m.commit,  # a partial span
        lambda: m.burst(n=3, partial=True), lambda: m.burst(n=1, partial=False),  # back on a chunk boundary
        m.begin_next, m.write, m.commit, m.begin_again, m.write, m.commit,  # a chunk reopened
        *([] if kind.startswith("certified-") else [m.state_dict_round_trip]),
        lambda: m.illegal_begin(delta=2), m.reset, lambda: m.burst(n=4, partial=False),
    ]
    for step in steps:
        step()
        m.storage_matches_history()
        m.physical_read_is_exact()
    return REACHED.get(kind, set())


@pytest.mark.parametrize("kind", KINDS)
def test_state_machine(kind):
    assert {"evicted", "partial span"} <= _scripted_stream(kind), f"{kind}: the scripted stream stayed shallow"
    machine = type(f"{kind}Machine", (CacheMachine,), {"kind": kind})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=25, stateful_step_count=30, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow]))


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
