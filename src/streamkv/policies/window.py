"""The two window policies: the ring (nothing retained moves) and the current path.

Both retain ``[0, min(sink, end)) U [max(sink, end - window), end)`` (see
:mod:`streamkv.layout`) with one plan shared by every layer and head. They differ in where
the tokens lie (``sink=2, window=4, chunk=3``; slot contents are positions)::

    slot:            0 1 | 2  3  4  5
    end=9   ring     0 1 | 6  7  8  5      chunk 2 overwrote slots 2, 3, 4 in place
            chrono   0 1 | 5  6  7  8      5 was rolled from slot 5 to slot 2 first
    end=12  ring     0 1 | 10 11 8  9      chunk 3 wrapped: slots 5, 2, 3
            chrono   0 1 | 8  9  10 11

The ring's position ``p >= sink`` lives at slot ``sink + (p - sink) % window`` forever; its
per-chunk work is ``C`` rows of K/V and ``C`` entries of metadata. A span's slots are one
range of consecutive slots, or two where it wraps, known on the host from that formula: the
plan is written on the device without allocating or reading it back (``fill_`` takes the
range's first slot as a Python scalar, unwrapped, then ``add_`` of a preallocated ``arange``:
a Python int in ``add_`` would be wrapped in a fresh 8-byte tensor per call), and the same
ranges go to the storage (``eager_ranges``) so that an eager write copies slices there, as the
floor does; compiled and captured writes follow the device plan. The chronological path clones and shifts the ``window - chunk`` retained tokens
of every layer on overflow (flashdreams 0.1.0's ``BlockKVCache``, extended to any sizes) and
writes at a host-int offset, so a CUDA graph is only valid for it once the cache is full.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..layout import CacheLayout
from ..storage import KVStorage
from .base import SlotPolicy, Step, empty_eviction

__all__ = ["Ring", "Chronological"]


class _Window(SlotPolicy):
    """What the two window policies share: a shared plan and a determined layout."""

    def bind(self, storage: KVStorage, layout: CacheLayout, lifecycle) -> None:
        super().bind(storage, layout, lifecycle)
        c, dev = layout.chunk, storage.device
        self._arange = torch.arange(c, dtype=torch.long, device=dev)
        self._chunk_pos = torch.zeros(c, dtype=torch.long, device=dev)

    def _set_positions(self, slots: Tensor, n: int) -> None:
        """The staged positions of the span's ``n`` rows take over ``slots`` (every layer and head)."""
        pos = self.storage.positions
        pos.index_copy_(-1, slots, self._chunk_pos[:n].expand(*pos.shape[:2], -1))

    def expected_positions(self, end: int) -> Tensor:
        """The position every slot holds once ``end`` positions are in the stream (``[cap]``)."""
        L, pos = self.layout, torch.full((self.storage.capacity,), -1, dtype=torch.long)
        for p, s in zip(L.retained_positions(end), self.chronological_slots(end)):
            pos[s] = p
        return pos

    def chronological_slots(self, end: int) -> list[int]:
        """Occupied slots ordered by the positions they hold."""
        raise NotImplementedError

    def expected_plan(self, start: int, n: int) -> list[int]:
        """The write slots of the span ``[start, start + n)`` once it is reserved."""
        raise NotImplementedError

    def check_state(self, state: dict[str, Any], end: int, span: int, is_open: bool) -> None:
        want = self.expected_positions(end)
        got = state["slot_positions"][..., : self.storage.capacity].to("cpu")
        if not bool((got == want).all()):
            raise ValueError(
                f"state dict slot_positions contradict end={end}: a {self.name} cache that has seen {end} positions "
                f"holds {want.tolist()} in its slots; the state has {got.reshape(-1, want.numel())[0].tolist()}"
                f"{' (and more rows)' if got.numel() > want.numel() else ''}"
            )
        if span:
            plan = torch.tensor(self.expected_plan(end - span, span), dtype=torch.long)
            got_plan = state["write_slots"].to("cpu").reshape(-1)[:span]
            if not bool((got_plan == plan).all()):
                raise ValueError(
                    f"state dict write_slots contradict end={end}: the span [{end - span}, {end}) of a {self.name} "
                    f"cache writes slots {plan.tolist()}, the state says {got_plan.tolist()}"
                )


class _LazySlotsStep(Step):
    """A :class:`Step` whose ``evicted_slots`` is given as a function and built on first read:
    the cache reads it only to tell observers, and a ring's begin at the presets evicts
    thousands of slots (building the tuple every begin cost 0.5 ms at longlive2, a tenth of the
    chunk's copy)."""

    @property  # type: ignore[override]
    def evicted_slots(self) -> tuple[int, ...] | None:
        got = self.__dict__["_evicted_slots"]
        if callable(got):
            got = self.__dict__["_evicted_slots"] = got()
        return got

    @evicted_slots.setter
    def evicted_slots(self, value: object) -> None:  # the dataclass's __init__ sets it once
        self.__dict__["_evicted_slots"] = value


class Ring(_Window):
    """Circular storage with pinned sinks: a new chunk overwrites the oldest window slots."""

    name = "ring"
    cache_properties = ("wraps",)

    @property
    def wraps(self) -> int:
        """Times the write cursor has passed the end of the ring."""
        return self.layout.ring_wraps(self.lifecycle.end)

    def bind(self, storage: KVStorage, layout: CacheLayout, lifecycle) -> None:
        super().bind(storage, layout, lifecycle)
        # the plan is staged in place (a view of the storage's shared plan): begin's apply writes
        # it and nothing else reads it before then
        self._stage = storage.plan.view(-1)
        storage.eager_ranges = None  # set by each begin (and a load): the open span's host ranges

    def _span_ranges(self, start: int, n: int) -> tuple[tuple[int, int], ...]:
        """The slots of the span ``[start, start + n)`` as ``(first slot, rows)`` ranges in row
        order (host arithmetic): ``slot = min(p, sink) + (max(p, sink) - sink) % window`` runs on
        from ``ring_slot(start)`` and wraps to the first window slot at most once (``n <= window``)."""
        L = self.layout
        a, top = L.ring_slot(start), L.sink + L.window
        if a + n <= top:
            return ((a, n),)
        return ((a, top - a), (L.sink, n - (top - a)))

    def _plan(self, start: int) -> None:
        """Stage the slots of the span starting at position ``start`` (its host ranges are
        ``storage.eager_ranges``) in the storage's plan, on the device, in place and without
        allocating: ``fill_`` (a Python scalar, unwrapped) then ``add_`` of a preallocated
        ``arange``, once per range."""
        ranges = self.storage.eager_ranges
        stage, arange = self._stage, self._arange
        at = 0
        for a, m in ranges:
            if at == 0 and m == stage.shape[0]:
                stage.fill_(a).add_(arange)
            else:
                stage[at : at + m].fill_(a).add_(arange[:m])
            at += m

    def begin(self, start: int, n: int, advance: bool) -> Step:
        if not advance:  # the span's slots and positions are in place (and so are its ranges)
            return Step(writes=self.storage.eager_ranges)
        storage = self.storage
        full = n == self.layout.chunk

        def apply() -> None:  # planned here: a refused begin touches no tensor
            storage.eager_ranges = self._span_ranges(start, n)  # for eager writes, and for _plan
            self._plan(start)
            stage = self._stage if full else self._stage[:n]
            pos = self._chunk_pos if full else self._chunk_pos[:n]
            pos.fill_(start).add_(self._arange if full else self._arange[:n])
            storage.positions.index_copy_(-1, stage, pos.expand(*storage.positions.shape[:2], -1))

        # row i (position p) overwrites the slot of p - window, retained iff p - window >= sink:
        # the rows from position sink + window on, whose slots run on from ring_slot(first) and
        # wrap at most once (n <= chunk <= window); two ranges, no per-row host loop
        L = self.layout
        first, end = max(start, L.sink + L.window), start + n
        writes = self._span_ranges(start, n)
        if first >= end:
            return Step(apply, None, (), writes=writes)
        a, top = L.ring_slot(first), L.sink + L.window
        b = a + (end - first)

        def slots() -> tuple[int, ...]:  # built only when an observer asks (thousands of ints per chunk)
            return tuple(range(a, min(b, top))) + tuple(range(L.sink, L.sink + max(0, b - top)))

        def evicted() -> Tensor:
            mask = empty_eviction(storage)
            mask[..., a : min(b, top)] = True
            mask[..., L.sink : L.sink + max(0, b - top)] = True
            return mask

        return _LazySlotsStep(apply, evicted, slots, writes=writes)

    def reset(self) -> None:
        self.storage.eager_ranges = None  # nothing is open; the next begin plans chunk 0

    def chronological_slots(self, end: int) -> list[int]:
        return self.layout.ring_chronological_slots(end)

    def expected_plan(self, start: int, n: int) -> list[int]:
        return [self.layout.ring_slot(p) for p in range(start, start + n)]

    def after_load(self, end: int, span: int) -> None:
        # the write plan came with the state (checked against the layout arithmetic); the host
        # ranges of eager writes follow from the same arithmetic
        self.storage.eager_ranges = self._span_ranges(end - span, span) if span else None


class Chronological(_Window):
    """Sinks pinned, the window kept in position order and rolled left on overflow (as most published code does)."""

    name = "chronological"
    cache_properties = ("write_start",)

    @property
    def write_start(self) -> int:
        """First slot of the open (or last) span: its slots are ``[write_start, write_start + n)``."""
        return self.storage.write_start

    @property
    def graph_safe_writes(self) -> bool:
        return False  # the write offset is a host int while the cache fills

    def bind(self, storage: KVStorage, layout: CacheLayout, lifecycle) -> None:
        super().bind(storage, layout, lifecycle)
        storage.write_start = 0

    def begin(self, start: int, n: int, advance: bool) -> Step:
        if not advance:
            return Step(writes=((self.storage.write_start, n),))
        L, storage = self.layout, self.storage
        end = start  # positions before this span
        new_end = end + n
        shift = L.window_start(new_end) - L.window_start(end)
        keep = end - L.window_start(new_end)  # retained window positions that must move
        first = L.chronological_slot(end, new_end)

        def apply() -> None:
            if shift > 0 and keep > 0:
                storage.shift(L.sink, L.sink + shift, keep)
            self._place(first, end, n)

        def evicted() -> Tensor:
            mask = empty_eviction(storage)
            mask[..., L.sink : L.sink + shift] = True  # the oldest window positions
            return mask

        # the roll reads the window before it overwrites it: its pages are copied, never taken blind
        writes = (((L.sink, L.window, False),) if shift > 0 and keep > 0 else ()) + ((first, n),)
        return Step(apply, evicted if shift > 0 else None, tuple(range(L.sink, L.sink + shift)), writes=writes)

    def _place(self, first_slot: int, first_position: int, n: int) -> None:
        storage = self.storage
        storage.write_start = first_slot
        torch.add(self._arange, first_slot, out=storage.plan.view(-1))
        torch.add(self._arange, first_position, out=self._chunk_pos)
        self._set_positions(storage.plan.view(-1)[:n], n)

    def reset(self) -> None:
        self.storage.write_start = 0
        torch.add(self._arange, 0, out=self.storage.plan.view(-1))

    def chronological_slots(self, end: int) -> list[int]:
        return list(range(self.layout.num_valid(end)))

    def expected_plan(self, start: int, n: int) -> list[int]:
        first = self.layout.chronological_slot(start, start + n)
        return list(range(first, first + n))

    def after_load(self, end: int, span: int) -> None:
        # the plan came with the state (checked); the host offset follows from it
        self.storage.write_start = self.expected_plan(end - span, span)[0] if span else 0
