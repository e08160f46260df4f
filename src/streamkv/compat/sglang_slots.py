"""Host arithmetic of sglang 0.5.23's ``CausalSelfAttentionKVCache``: which position each slot
of its buffer holds, how one call changes that, and which slots its view returns.

sglang keeps one layer's K/V in position order, ``[sinks | window]``, and rolls the window
left (clone + shift) when a new chunk does not fit. :mod:`streamkv.compat.sglang` keeps the
same tokens in a ring where nothing moves, so for every call it must know what sglang's
buffer would hold and which of its slots sglang's view would read. This module answers with
Python ints only (no tensor, no device, nothing to synchronise). It is a model of sglang's
documented behaviour written from its source, not a copy of it.

Vocabulary (as in :mod:`streamkv.layout`): a *position* is a token's index in the stream, a
*slot* a row of a buffer. sglang's buffer is described by *runs* ``(slot, position, n)``:
slots ``[slot, slot + n)`` hold positions ``[position, position + n)``; ``position == -1``
marks slots that hold no written token (sglang counts them as valid but never wrote them).
Runs are sorted by slot and cover ``[0, local_end)`` exactly.

Everything here is pure: a plan returns a new :class:`SGLangState`; nothing is mutated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..layout import CacheLayout

__all__ = [
    "Run", "SGLangState", "Update", "VirtualMap", "effective_sink", "plan_update", "slot_positions", "position_intervals",
    "ring_holds", "ring_rows",
]

#: ``(slot, position, n)``; position -1: never written
Run = tuple[int, int, int]
UNKNOWN = -1


# ===================================================================== runs
def _cut(runs: tuple[Run, ...], lo: int, hi: int) -> tuple[Run, ...]:
    """The parts of ``runs`` inside slots ``[lo, hi)``, unshifted."""
    out = []
    for slot, pos, n in runs:
        a, b = max(slot, lo), min(slot + n, hi)
        if a < b:
            out.append((a, UNKNOWN if pos == UNKNOWN else pos + a - slot, b - a))
    return tuple(out)


def _shift(runs: tuple[Run, ...], by: int) -> tuple[Run, ...]:
    return tuple((slot + by, pos, n) for slot, pos, n in runs)


def _covered(runs: tuple[Run, ...], end: int) -> tuple[Run, ...]:
    """``runs`` with every slot of ``[0, end)`` they miss added as never written."""
    out: list[Run] = []
    at = 0
    for slot, pos, n in sorted(runs):
        if slot > at:
            out.append((at, UNKNOWN, slot - at))
        out.append((slot, pos, n))
        at = slot + n
    if at < end:
        out.append((at, UNKNOWN, end - at))
    merged: list[Run] = []
    for slot, pos, n in out:  # one run per stretch of consecutive slots holding consecutive positions
        if merged:
            ps, pp, pn = merged[-1]
            if ps + pn == slot and (pp == pos == UNKNOWN or UNKNOWN not in (pp, pos) and pp + pn == pos):
                merged[-1] = (ps, pp, pn + n)
                continue
        merged.append((slot, pos, n))
    return tuple(merged)


def _roll(runs: tuple[Run, ...], end: int, keep: int, drop: int) -> tuple[Run, ...]:
    """sglang's eviction: slots ``[0, keep)`` stay, the ``moved = end - drop - keep`` slots
    after ``keep + drop`` move down to ``keep`` (nothing moves when that is <= 0); the slots
    no one overwrote keep what they held."""
    moved = end - drop - keep
    if moved <= 0:
        return runs
    src = keep + drop
    return (*_cut(runs, 0, keep), *_shift(_cut(runs, src, src + moved), -drop), *_cut(runs, keep + moved, end))


def _write(runs: tuple[Run, ...], slot: int, pos: int, n: int, end: int) -> tuple[Run, ...]:
    """Slots ``[slot, slot + n)`` now hold positions ``[pos, pos + n)``; ``end`` slots in all."""
    return _covered((*_cut(runs, 0, slot), (slot, pos, n), *_cut(runs, slot + n, end)), end)


def slot_positions(runs: tuple[Run, ...], lo: int, hi: int) -> list[tuple[int, int]]:
    """``(position, n)`` pieces held by slots ``[lo, hi)``, in slot order (position -1: never
    written)."""
    return [(pos, n) for _, pos, n in _cut(runs, lo, hi)]


def position_intervals(pieces: list[tuple[int, int]]) -> tuple[tuple[int, int], ...] | None:
    """The positions of ``pieces`` as sorted, merged ``[lo, hi)`` intervals; None when a piece
    was never written or a position appears twice (a multiset a set cannot describe)."""
    spans = sorted((p, p + n) for p, n in pieces if n > 0)
    out: list[list[int]] = []
    for lo, hi in spans:
        if lo == UNKNOWN:
            return None
        if out and lo < out[-1][1]:
            return None
        if out and lo == out[-1][1]:
            out[-1][1] = hi
        else:
            out.append([lo, hi])
    return tuple((a, b) for a, b in out)


# ==================================================================== state
@dataclass(frozen=True)
class SGLangState:
    """What one sglang cache block knows, as host ints.

    ``global_end``: positions written so far (sglang's ``global_end_index``); ``local_end``:
    occupied slots (``local_end_index``); ``cache_size``: slots; ``window``: sglang's
    ``attention_window_size``; ``pinned_start``/``pinned_len``: the multi-shot pinned
    region (slots; ``-1``/``0``: none); ``runs``: the positions its slots hold.
    """

    global_end: int
    local_end: int
    cache_size: int
    window: int
    pinned_start: int = -1
    pinned_len: int = 0
    runs: tuple[Run, ...] = ()

    @property
    def pinned(self) -> bool:
        return self.pinned_start >= 0 and self.pinned_len > 0


def effective_sink(state: SGLangState, sink_tokens: int, global_sink_tokens: int) -> int:
    """The slots sglang never rolls: the global sinks, plus the pinned region when it lies
    right after them; without a pin, the larger of the two sink sizes."""
    if state.pinned:
        if state.pinned_start == global_sink_tokens:
            return global_sink_tokens + state.pinned_len
        return global_sink_tokens
    return max(global_sink_tokens, sink_tokens)


@dataclass(frozen=True)
class Update:
    """One planned ``update_and_get_attention_kv`` call.

    ``state``: sglang's state after it; ``advance``: the chunk ends past ``global_end`` (else it
    rewrites written positions); ``local_start``: the chunk's first slot in sglang's buffer;
    ``roll_sink``: the sinks sglang kept while rolling; ``evicted``: slots it rolled out;
    ``grown``: the buffer grew (``allow_growth``); ``view``: the sglang slot ranges its view
    concatenates, in order (a range may repeat slots of another).
    """

    state: SGLangState
    advance: bool
    local_start: int
    roll_sink: int
    evicted: int
    grown: bool
    view: tuple[tuple[int, int], ...]


def plan_update(state: SGLangState, *, start: int, n: int, sink_tokens: int, global_sink_tokens: int,
                allow_growth: bool, recent: int | None, name: str = "causal KV cache") -> Update:
    """sglang's effect of writing positions ``[start, start + n)`` (``n >= 1``) and reading its
    view; raises where sglang raises (``RuntimeError`` for a write outside its buffer,
    ``ValueError`` for ``recent < 0``), before anything changes."""
    if recent is not None and recent < 0:
        raise ValueError(f"{name}: recent_window_tokens must be non-negative or None, got {recent}")
    G, E, N, A = state.global_end, state.local_end, state.cache_size, state.window
    sink = effective_sink(state, sink_tokens, global_sink_tokens)
    end = start + n
    runs, ps, evicted, grown = state.runs, state.pinned_start, 0, False
    if end <= G:  # rewrite in place: the buffer's first slot holds position G - E
        ls, E2, G2 = start - (G - E), E, G
    else:
        appended = end - G
        if allow_growth and E + appended > N:
            old, N = N, max(E + appended, 2 * N)
            grown = True
            A = N if A == old else A
        if E + appended > N:
            evicted = E + appended - N
            runs = _roll(runs, E, sink, evicted)
            if state.pinned and ps >= sink:
                ps -= evicted
            E2 = N
        else:
            E2 = E + appended
        ls, G2 = E2 - n, end
    if ls < 0 or ls + n > N:
        raise RuntimeError(
            f"{name}: invalid write range local=[{ls}, {ls + n}) for positions [{start}, {end}): global_end={G}, "
            f"local_end={E}, cache_size={N}"
        )
    runs = _write(runs, ls, start, n, E2)
    new = replace(state, global_end=G2, local_end=E2, cache_size=N, window=A, pinned_start=ps, runs=runs)
    view = _view_ranges(new, ls, recent, effective_sink(new, sink_tokens, global_sink_tokens), global_sink_tokens)
    return Update(new, end > G, ls, sink, evicted, grown, view)


def _view_ranges(s: SGLangState, ls: int, recent: int | None, sink: int,
                 global_sink_tokens: int) -> tuple[tuple[int, int], ...]:
    """The slot ranges sglang's view concatenates (after the write), in its order: the last
    ``window`` slots; with global sinks or a pin, the sinks and the pinned region put in front
    of a window shortened by them; with ``recent``, the sinks, the pin and the ``recent`` slots
    before the chunk (and everything after its start)."""
    E = s.local_end
    attn_start = max(0, E - s.window)
    if recent is None:
        if global_sink_tokens <= 0 and not s.pinned:
            return ((attn_start, E),)
        sink_in = sink > 0 and attn_start > 0
        pin_in = s.pinned and sink <= s.pinned_start < attn_start
        if not (sink_in or pin_in):
            return ((attn_start, E),)
        extra = (sink if sink_in else 0) + (s.pinned_len if pin_in else 0)
        lo = max(sink if sink_in else 0, E - max(0, s.window - extra))
        out = [(0, sink)] if sink_in else []
        if pin_in:
            out.append((s.pinned_start, s.pinned_start + s.pinned_len))
        return (*out, (lo, E))
    sink_end = min(sink, E)
    recent_start = max(sink_end, ls - recent)
    if recent_start <= sink_end:
        return ((0, E),)
    out = [(0, sink_end)] if sink_end > 0 else []
    if s.pinned and sink_end <= s.pinned_start < recent_start:
        out.append((s.pinned_start, s.pinned_start + s.pinned_len))
    return (*out, (recent_start, E))


# ========================================================== ring numbering
@dataclass(frozen=True)
class VirtualMap:
    """The ring's numbering of sglang's positions.

    A ring keeps sinks at its first positions and a window of its last ones; sglang's frozen
    prefix may hold other positions (a pinned chunk that slid next to the global sinks). So the
    ring counts its own *virtual* positions: after a re-layout, virtual ``v`` is the token sglang
    kept in slot ``v`` (``frozen``: runs ``(virtual, position, n)``), and positions appended since
    (``>= base``) follow at ``virtual = position - base + base_virtual``. The identity map is
    ``VirtualMap()``.
    """

    frozen: tuple[Run, ...] = ()
    base: int = 0
    base_virtual: int = 0

    @classmethod
    def of_buffer(cls, runs: tuple[Run, ...], global_end: int, local_end: int) -> VirtualMap:
        """Virtual positions = the slots of sglang's buffer ``runs`` (``local_end`` slots,
        ``global_end`` positions written); later positions continue after them."""
        return cls(tuple(r for r in runs if r[1] != UNKNOWN), global_end, local_end)

    def virtual(self, pos: int, n: int) -> list[tuple[int, int]]:
        """``(virtual, n)`` pieces of positions ``[pos, pos + n)``, in position order;
        ``KeyError`` if one is unmapped."""
        out: list[tuple[int, int]] = []
        end = pos + n
        while pos < min(end, self.base):
            for v, p, m in self.frozen:
                if p <= pos < p + m:
                    take = min(end, self.base, p + m) - pos
                    out.append((v + pos - p, take))
                    pos += take
                    break
            else:
                raise KeyError(pos)
        if end > pos:
            out.append((pos - self.base + self.base_virtual, end - pos))
        merged: list[tuple[int, int]] = []
        for v, m in out:
            if merged and merged[-1][0] + merged[-1][1] == v:
                merged[-1] = (merged[-1][0], merged[-1][1] + m)
            else:
                merged.append((v, m))
        return merged


# ============================================================ ring queries
def ring_holds(L: CacheLayout, end: int, vmap: VirtualMap, st: SGLangState) -> bool:
    """A ring of layout ``L`` at virtual ``end``, numbered by ``vmap``, holds exactly the tokens of
    sglang's buffer ``st`` (each once)."""
    pieces: list[tuple[int, int]] = []
    for _, pos, m in st.runs:
        if pos < 0:
            return False
        try:
            pieces.extend(vmap.virtual(pos, m))
        except KeyError:
            return False
    want = [(0, min(L.sink, end)), (L.window_start(end), end)]
    merged: list[tuple[int, int]] = []
    for a, b in want:
        if a >= b:
            continue
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return position_intervals(pieces) == tuple(merged)


def ring_rows(L: CacheLayout, end: int, pos: int, m: int) -> list[tuple[int, int]]:
    """Slot ranges of a ring of layout ``L`` at ``end`` holding its positions ``[pos, pos + m)`` (in
    position order); ``RuntimeError`` if it does not hold them all."""
    if pos < 0 or pos + m > end or (pos + m > L.sink and max(pos, L.sink) < L.window_start(end)):
        raise RuntimeError(f"positions [{pos}, {pos + m}) are not held by the ring ({L}, end {end}): a bug, please report")
    out = []
    if pos < L.sink:
        a = min(pos + m, L.sink)
        out.append((pos, a))
        m, pos = m - (a - pos), a
    while m > 0:
        slot = L.ring_slot(pos)
        take = min(m, L.capacity - slot)
        out.append((slot, slot + take))
        pos, m = pos + take, m - take
    return out
