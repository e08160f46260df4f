"""The chronological cache: the current path, kept for masks, cache-relative RoPE and
anything not yet proven equal on the ring.

Physical layout (``sink=2, window=4, chunk=3``; slot contents are positions)::

    slot:         0 1 | 2 3 4 5
    end=6         0 1 | 2 3 4 5
    end=9         0 1 | 5 6 7 8         roll: 5 moved from slot 5 to slot 2,
                                        then chunk 2 written at slots 3..5
    end=12        0 1 | 8 9 10 11

Slots are always in position order, so the buffer *is* the chronological view. The
price: when a new chunk overflows the window, the retained ``window - chunk`` tokens
are cloned and shifted left, for K and V of every layer, once per chunk. Its
observable behaviour equals flashdreams 0.1.0's ``BlockKVCache`` (where that class is
defined: ``(sink + window) % chunk == 0``) and extends it to any sizes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .base import KVCache

__all__ = ["ChronologicalCache"]


class ChronologicalCache(KVCache):
    """Sinks pinned, the window in position order, rolled left on overflow.

    The write goes to a contiguous slice whose start is a host int (``write_start``),
    as in the current path: constant once the cache is full, so a graph captured in
    the steady state replays correctly, but not across filling steps.
    """

    physical_order_valid = True
    valid_is_prefix = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._arange = torch.arange(self.layout.chunk, dtype=torch.long, device=self.device)
        self._write_start = 0

    @property
    def write_start(self) -> int:
        """First slot of the open (or last) chunk; its slots are ``[write_start, write_start + chunk)``."""
        return self._write_start

    def _reserve(self, chunk_idx: int) -> None:
        L = self.layout
        end = L.chunk_start(chunk_idx)  # positions before this chunk
        new_end = end + L.chunk
        shift = L.window_start(new_end) - L.window_start(end)
        keep = end - L.window_start(new_end)  # retained window positions that must move
        if shift > 0 and self._eviction_listeners:
            evicted = torch.zeros(L.capacity, dtype=torch.bool, device=self.device)
            evicted[L.sink : L.sink + shift] = True  # the oldest window positions, about to be overwritten
            self._notify_evict(chunk_idx, range(self.num_layers), evicted)
        if shift > 0 and keep > 0:
            src, dst = L.sink + shift, L.sink
            seq = self.seq_dim + 1  # buffers carry the layer dim first
            # the current path: clone, then copy back shifted (all layers at once)
            for buf in (self._k, self._v):
                buf.narrow(seq, dst, keep).copy_(buf.narrow(seq, src, keep).clone())
            self._slot_pos.narrow(0, dst, keep).copy_(self._slot_pos.narrow(0, src, keep).clone())
        self._write_start = L.chronological_slot(end, new_end)
        torch.add(self._arange, end, out=self._slot_pos.narrow(0, self._write_start, L.chunk))

    def _write(self, layer: int, k: Tensor, v: Tensor) -> None:
        start, c = self._write_start, self.layout.chunk
        self._k[layer].narrow(self.seq_dim, start, c).copy_(k)
        self._v[layer].narrow(self.seq_dim, start, c).copy_(v)

    def chronological_slots(self) -> list[int]:
        return list(range(self.num_valid))

    def _on_reset(self) -> None:
        self._write_start = 0

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        if self._next_chunk > 0:
            L = self.layout
            self._write_start = L.chronological_slot(L.chunk_start(self._next_chunk - 1), self.end)
        else:
            self._write_start = 0

    def _gather(self, buf: Tensor) -> Tensor:
        # already chronological: the valid prefix, copied like the other caches' views
        return buf.narrow(self.seq_dim, 0, self.num_valid).clone()
