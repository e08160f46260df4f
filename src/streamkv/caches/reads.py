"""What a cache offers to read: its occupancy, the :class:`~streamkv.caches.read.KVRead` of a
layer (decided here, once per lifecycle generation), and the chronological view where every
head holds the same positions."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor

from ..layout import CacheLayout
from ..policies import SlotPolicy
from ..storage import KVStorage
from ..stores import Segment
from .checks import InputChecks
from .lifecycle import Lifecycle
from .read import KVRead, Occupancy

__all__ = ["Reads"]


class Reads:
    """Occupancy, reads and chronological views of one cache. ``extra(layer)``: the segments
    the cache's observers add to a read; ``adds()``: whether any does."""

    def __init__(self, storage: KVStorage, layout: CacheLayout, lifecycle: Lifecycle, policy: SlotPolicy,
                 checks: InputChecks, rope_at_read=None, extra: Callable[[int], list[Segment]] | None = None,
                 adds: Callable[[], bool] | None = None, answer: Callable[..., Any] | None = None) -> None:
        self.storage, self.layout, self.lifecycle, self.policy, self.checks = storage, layout, lifecycle, policy, checks
        self.rope_at_read = rope_at_read
        self._extra, self._adds, self._answer = extra, adds, answer
        # (generation, reads of it by (layer, occupancy)): a read changes only when the lifecycle
        # does, so the per-pass cost is a dict lookup (derived state: snapshots leave it out)
        self._memo: tuple[int, dict[tuple[int, str, bool], KVRead]] = (-1, {})

    @property
    def num_valid(self) -> int:
        """Occupied managed slots: the count for window caches (host arithmetic), the most of any
        (layer, head) for per-head ones (synchronises)."""
        if not self.policy.per_head:
            return self.layout.num_valid(self.lifecycle.end)
        return int((self.storage.positions[..., : self.layout.capacity] >= 0).sum(-1).max())

    def occupancy(self, static: bool = False) -> Occupancy:
        """How a read treats empty slots now (see :meth:`KVCache.occupancy`)."""
        if not self.checks.valid_is_prefix:
            return "mask"
        if self.layout.num_valid(self.lifecycle.end) == self.layout.capacity:
            return "all"
        return "mask" if static else "prefix"

    @property
    def chronological_refusal(self) -> str | None:
        if self.policy.per_head:
            return (f"the heads of this {self.policy.name} cache hold different positions: there is no common "
                    f"chronological order (use the physical path, occupancy 'mask')")
        if self.storage.recall_slots:
            return "recall slots hold tokens outside the window: the chronological view does not include them"
        return None

    def read(self, layer: int, occupancy: Occupancy) -> KVRead:
        extra = bool(self._adds and self._adds())  # host state that changes only with the observers
        if torch.compiler.is_compiling():
            # a traced step must not read the host counters (each value would be a guard, and
            # a recompilation per chunk): only what stays the same from chunk to chunk
            return self._make(layer, occupancy, traced=True, extra=extra)
        generation, memo = self._memo
        if generation != self.lifecycle.generation:
            memo = {}
            self._memo = (self.lifecycle.generation, memo)
        read = memo.get((layer, occupancy, extra))
        if read is None:
            read = memo[(layer, occupancy, extra)] = self._make(layer, occupancy, extra=extra)
        return read

    def _own(self, layer: int, positions: Tensor) -> list[Segment]:
        return self.storage.store.segments(layer, positions)

    def _make(self, layer: int, occupancy: Occupancy, traced: bool = False, extra: bool = False) -> KVRead:
        st, lc = self.storage, self.lifecycle
        if occupancy == "prefix" and traced:
            raise ValueError("occupancy 'prefix' has a data-dependent shape: compiled steps read with 'all' or 'mask'")
        visible = self.layout.num_valid(lc.end) if occupancy == "prefix" else st.slots
        refusal = self.chronological_refusal
        if extra:
            refusal = refusal or "an observer adds rows to the read (a compressed tier): they have no chronological slot"
        chrono = None if refusal or traced else partial(self.chronological, layer)
        pol = self.policy
        return KVRead(
            dims=st.dims, dtype=st.dtype, device=st.device, positions=st.layer_positions(layer), occupancy=occupancy,
            visible=visible, query_positions=lc.query_positions(), empty=False if traced else lc.end == 0,
            num_retained=None if chrono is None else self.layout.num_valid(lc.end), chronological=chrono,
            chronological_refusal=refusal if not traced else (refusal or "not inside a compiled step"),
            scorer=partial(pol.receive, layer) if pol.needs_queries else None,
            statistic=pol.statistic if pol.needs_queries else None, name=f"{pol.name} cache layer {layer}",
            source=partial(self._own, layer), generation=None if traced else lc.generation,
            lifecycle=None if traced else lc, rope_at_read=self.rope_at_read,
            extras=partial(self._extra, layer) if extra and self._extra is not None else None,
            answer=partial(self._answer, layer) if extra and self._answer is not None and not traced else None,
        )

    def chronological(self, layer: int) -> tuple[Tensor, Tensor, list[int]]:
        """Keys, values (gathered copies) and positions in position order."""
        end = self.lifecycle.end
        idx = torch.tensor(self.policy.chronological_slots(end), dtype=torch.long, device=self.storage.device)
        st = self.storage
        return st.gather(layer, "k", idx), st.gather(layer, "v", idx), self.layout.retained_positions(end)

    def chronological_view(self, layer: int) -> tuple[Tensor, Tensor, list[int]]:
        refusal = self.chronological_refusal
        if refusal:
            raise ValueError(f"no chronological view: {refusal}")
        return self.chronological(layer)
