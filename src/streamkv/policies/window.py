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
per-chunk work is ``C`` rows of K/V and ``C`` entries of metadata, planned on the device
without allocating (``fill_``/``clamp_`` take Python scalars unwrapped; ``sub_``/``remainder_``
take preallocated 0-dim tensors: a Python int there would be wrapped in a fresh 8-byte tensor
per call). The chronological path clones and shifts the ``window - chunk`` retained tokens
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


def _noop() -> None:
    pass


class _Window(SlotPolicy):
    """What the two window policies share: a shared plan and a determined layout."""

    def bind(self, storage: KVStorage, layout: CacheLayout) -> None:
        super().bind(storage, layout)
        c, dev = layout.chunk, storage.device
        self._arange = torch.arange(c, dtype=torch.long, device=dev)
        self._chunk_pos = torch.zeros(c, dtype=torch.long, device=dev)

    def _set_positions(self, slots: Tensor) -> None:
        """The staged chunk positions take over ``slots`` (every layer and head)."""
        pos = self.storage.positions
        pos.index_copy_(-1, slots, self._chunk_pos.expand(*pos.shape[:2], -1))

    def expected_positions(self, end: int) -> Tensor:
        L, pos = self.layout, torch.full((self.storage.capacity,), -1, dtype=torch.long)
        for p, s in zip(L.retained_positions(end), self.chronological_slots(end)):
            pos[s] = p
        return pos

    def chronological_slots(self, end: int) -> list[int]:
        """Occupied slots ordered by the positions they hold."""
        raise NotImplementedError

    def expected_plan(self, next_chunk: int) -> list[int]:
        """The write slots of the last reserved chunk (``next_chunk - 1``)."""
        raise NotImplementedError

    def check_state(self, state: dict[str, Any], next_chunk: int, open_chunk: int | None) -> None:
        end = next_chunk * self.layout.chunk
        want = self.expected_positions(end)
        got = state["slot_positions"][..., : self.storage.capacity].to("cpu")
        if not bool((got == want).all()):
            raise ValueError(
                f"state dict slot_positions contradict next_chunk={next_chunk}: a {self.name} cache that has seen "
                f"{end} positions holds {want.tolist()} in its slots, the state has {got.reshape(-1, want.numel())[0].tolist()}"
                f"{' (and more rows)' if got.numel() > want.numel() else ''}"
            )
        if next_chunk:
            plan = torch.tensor(self.expected_plan(next_chunk), dtype=torch.long)
            got_plan = state["write_slots"].to("cpu")
            if not bool((got_plan == plan).all()):
                raise ValueError(
                    f"state dict write_slots contradict next_chunk={next_chunk}: chunk {next_chunk - 1} of a "
                    f"{self.name} cache writes slots {plan.tolist()}"
                )


class Ring(_Window):
    """Circular storage with pinned sinks: a new chunk overwrites the oldest window slots."""

    name = "ring"

    def bind(self, storage: KVStorage, layout: CacheLayout) -> None:
        super().bind(storage, layout)
        dev = storage.device
        self._stage = torch.zeros(layout.chunk, dtype=torch.long, device=dev)
        self._scratch = torch.zeros(layout.chunk, dtype=torch.long, device=dev)
        self._sink = torch.tensor(layout.sink, dtype=torch.long, device=dev)
        self._window = torch.tensor(layout.window, dtype=torch.long, device=dev)

    def _plan(self, chunk_idx: int) -> None:
        """Stage the chunk's positions and slots, on the device, in place:
        ``slot = min(p, sink) + (max(p, sink) - sink) % window``."""
        s = self.layout.sink
        pos, slots = self._chunk_pos, self._stage
        pos.fill_(self.layout.chunk_start(chunk_idx)).add_(self._arange)
        slots.copy_(pos).clamp_(min=s).sub_(self._sink).remainder_(self._window)
        slots.add_(self._scratch.copy_(pos).clamp_(max=s))

    def begin(self, chunk_idx: int, advance: bool) -> Step:
        if not advance:
            return Step(_noop)  # the chunk's slots and positions are in place
        self._plan(chunk_idx)
        storage = self.storage

        def apply() -> None:
            storage.plan.view(-1).copy_(self._stage)
            self._set_positions(self._stage)

        def evicted() -> Tensor:
            mask = empty_eviction(storage)
            held = storage.positions.index_select(-1, self._stage) >= 0
            mask.index_copy_(-1, self._stage, held.expand(*mask.shape[:2], -1))
            return mask

        L = self.layout
        slots = tuple(L.ring_slot(p) for p in L.chunk_positions(chunk_idx) if p - L.window >= L.sink)
        return Step(apply, evicted if slots else None, slots)

    def chronological_slots(self, end: int) -> list[int]:
        return self.layout.ring_chronological_slots(end)

    def expected_plan(self, next_chunk: int) -> list[int]:
        return [self.layout.ring_slot(p) for p in self.layout.chunk_positions(next_chunk - 1)]

    def after_load(self, next_chunk: int, open_chunk: int | None) -> None:
        if next_chunk:
            self._plan(next_chunk - 1)
            self.storage.plan.view(-1).copy_(self._stage)


class Chronological(_Window):
    """The current path: sinks pinned, the window in position order, rolled left on overflow."""

    name = "chronological"

    @property
    def graph_safe_writes(self) -> bool:
        return False  # the write offset is a host int while the cache fills

    def bind(self, storage: KVStorage, layout: CacheLayout) -> None:
        super().bind(storage, layout)
        storage.write_start = 0

    def begin(self, chunk_idx: int, advance: bool) -> Step:
        if not advance:
            return Step(_noop)
        L, storage = self.layout, self.storage
        end = L.chunk_start(chunk_idx)  # positions before this chunk
        new_end = end + L.chunk
        shift = L.window_start(new_end) - L.window_start(end)
        keep = end - L.window_start(new_end)  # retained window positions that must move
        start = L.chronological_slot(end, new_end)

        def apply() -> None:
            if shift > 0 and keep > 0:
                storage.shift(L.sink, L.sink + shift, keep)
            self._place(start, end)

        def evicted() -> Tensor:
            mask = empty_eviction(storage)
            mask[..., L.sink : L.sink + shift] = True  # the oldest window positions
            return mask

        return Step(apply, evicted if shift > 0 else None, tuple(range(L.sink, L.sink + shift)))

    def _place(self, start: int, first_position: int) -> None:
        storage = self.storage
        storage.write_start = start
        torch.add(self._arange, start, out=storage.plan.view(-1))
        torch.add(self._arange, first_position, out=self._chunk_pos)
        self._set_positions(storage.plan.view(-1))

    def reset(self) -> None:
        self.storage.write_start = 0
        torch.add(self._arange, 0, out=self.storage.plan.view(-1))

    def chronological_slots(self, end: int) -> list[int]:
        return list(range(self.layout.num_valid(end)))

    def expected_plan(self, next_chunk: int) -> list[int]:
        L = self.layout
        start = L.chronological_slot(L.chunk_start(next_chunk - 1), next_chunk * L.chunk)
        return list(range(start, start + L.chunk))

    def after_load(self, next_chunk: int, open_chunk: int | None) -> None:
        if next_chunk:
            start = self.expected_plan(next_chunk)[0]
            self.storage.write_start = start
            torch.add(self._arange, start, out=self.storage.plan.view(-1))
        else:
            self.reset()
