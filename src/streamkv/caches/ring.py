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


def _int64_view(t: Tensor) -> Tensor | None:
    """``t`` reinterpreted as int64 along its last dim, or None when its elements are
    already 8 bytes wide or the last dim is not contiguous, 8-byte aligned whole words."""
    size = t.element_size()
    if size >= 8 or t.stride(-1) != 1 or (t.shape[-1] * size) % 8 or (t.storage_offset() * size) % 8:
        return None
    if any((st * size) % 8 for st in t.stride()[:-1]):
        return None
    return t.view(torch.long)


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
        # 0-dim operands: a Python int would be wrapped in a fresh 8-byte tensor per call
        self._sink = torch.tensor(self.layout.sink, dtype=torch.long, device=dev)
        self._window = torch.tensor(self.layout.window, dtype=torch.long, device=dev)
        # the same bytes seen as int64 rows: index_copy_ of 8-byte elements is several times
        # faster on CPU than of 2-byte bf16 ones (and no slower on CUDA); None if the row
        # does not split into whole int64s
        self._k_wide, self._v_wide = _int64_view(self._k), _int64_view(self._v)

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
        allocation-free (``fill_`` and ``clamp_`` take Python scalars unwrapped; the other
        operands are preallocated 0-dim tensors):
        ``slot = min(p, sink) + (max(p, sink) - sink) % window``."""
        s = self.layout.sink
        pos, slots = self._chunk_pos, self._slots
        pos.fill_(self.layout.chunk_start(chunk_idx)).add_(self._arange)
        slots.copy_(pos).clamp_(min=s).sub_(self._sink).remainder_(self._window)
        slots.add_(self._scratch.copy_(pos).clamp_(max=s))

    def _write(self, layer: int, k: Tensor, v: Tensor) -> None:
        # the int64 view helps the eager CPU kernel; a compiled step generates its own
        # kernel (and cannot inspect a traced tensor's storage offset)
        eager = not torch.compiler.is_compiling()
        for buf, wide, x in ((self._k, self._k_wide, k), (self._v, self._v_wide, v)):
            x_wide = _int64_view(x) if eager and wide is not None else None
            if x_wide is not None:
                wide[layer].index_copy_(self.seq_dim, self._slots, x_wide)
            else:
                buf[layer].index_copy_(self.seq_dim, self._slots, x)

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
