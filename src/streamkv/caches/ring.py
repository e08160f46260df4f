"""The circular (ring) cache: pinned sinks, the window a ring overwritten in place.

Physical layout (``sink=2, window=4, chunk=3``; slot contents are positions)::

    slot:         0 1 | 2  3  4  5
    end=6         0 1 | 2  3  4  5      filling: positions land in slots 0..5
    end=9         0 1 | 6  7  8  5      chunk 2 overwrote the oldest slots 2, 3, 4
    end=12        0 1 | 10 11 8 9       chunk 3 wrapped: slots 5, 2, 3
                      ^ ring start = sink

A position ``p >= sink`` always lives at slot ``sink + (p - sink) % window``; sinks
at slot ``p``. Occupied slots are always a prefix ``[0, num_valid)``. Nothing
retained ever moves: a step's device work is writing the chunk's K/V (``C`` rows
per layer) and ``C`` entries of metadata.

Attention may read the buffer as it lies (``physical_order_valid``): unmasked
softmax attention is invariant to a permutation applied to K and V rows alike,
provided each key already carries its absolute RoPE (applied before the write).
Cache-relative RoPE and masks need the chronological view.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .base import KVCache

__all__ = ["RingCache"]


class RingCache(KVCache):
    """Circular K/V storage with pinned sinks. See the module docstring for the layout.

    Device-resident write metadata (updated in place by ``begin_chunk``; stable
    addresses for CUDA graphs):

    - ``write_slots``: ``int64 [chunk]``, the slot of each row of the chunk;
    - ``slot_positions``: ``int64 [capacity]``, the position held by each slot (-1 empty).

    ``write`` is one ``index_copy_`` per tensor reading ``write_slots``: a captured
    graph replayed for a later chunk writes that chunk's slots.
    """

    physical_order_valid = True
    valid_is_prefix = True
    graph_safe_writes = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        c = self.layout.chunk
        dev = self.device
        self._arange = torch.arange(c, dtype=torch.long, device=dev)
        self._chunk_pos = torch.zeros(c, dtype=torch.long, device=dev)
        self._slots = torch.arange(c, dtype=torch.long, device=dev)
        self._scratch = torch.zeros(c, dtype=torch.long, device=dev)
        self._sink = torch.tensor(self.layout.sink, dtype=torch.long, device=dev)

    @property
    def write_slots(self) -> Tensor:
        """Device ``int64 [chunk]``: slots of the open (or last) chunk, row by row."""
        return self._slots

    # ------------------------------------------------------------- lifecycle
    def _reserve(self, chunk_idx: int) -> None:
        self._plan(chunk_idx)
        if self._eviction_listeners and self.layout.chunk_start(chunk_idx) + self.layout.chunk > self.layout.capacity:
            evicted = torch.zeros(self.layout.capacity, dtype=torch.bool, device=self.device)
            evicted[self._slots] = self._slot_pos[self._slots] >= 0
            self._notify_evict(chunk_idx, range(self.num_layers), evicted)
        # the new positions take over their slots (evicting what was there)
        self._slot_pos.index_copy_(0, self._slots, self._chunk_pos)

    def _plan(self, chunk_idx: int) -> None:
        """Compute the chunk's positions and slots on the device, in place and
        allocation-free (Python scalars are passed only to ops that take them
        unwrapped): ``slot = min(p, sink) + (max(p, sink) - sink) % window``."""
        s, w = self.layout.sink, self.layout.window
        pos, slots = self._chunk_pos, self._slots
        pos.fill_(self.layout.chunk_start(chunk_idx)).add_(self._arange)
        slots.copy_(pos).clamp_(min=s).sub_(self._sink).remainder_(w)
        slots.add_(self._scratch.copy_(pos).clamp_(max=s))

    def _write(self, layer: int, k: Tensor, v: Tensor) -> None:
        self._k[layer].index_copy_(self.seq_dim, self._slots, k)
        self._v[layer].index_copy_(self.seq_dim, self._slots, v)

    def chronological_slots(self) -> list[int]:
        return self.layout.ring_chronological_slots(self.end)

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        # the write metadata is a function of the last reserved chunk
        if self._next_chunk > 0:
            self._plan(self._next_chunk - 1)

    @property
    def wraps(self) -> int:
        """Times the write cursor has passed the end of the ring."""
        return self.layout.ring_wraps(self.end)
