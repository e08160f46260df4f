"""``LayerView``: one layer of a cache, the handle an attention module holds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from .read import KVRead, Occupancy

if TYPE_CHECKING:
    from .cache import KVCache

__all__ = ["LayerView"]


class LayerView:
    """One layer of a cache: what an attention module holds. No state of its own; the
    lifecycle (begin/commit/reset) stays on the cache."""

    __slots__ = ("cache", "index")

    def __init__(self, cache: KVCache, index: int) -> None:
        self.cache = cache
        self.index = index

    def update(self, k: Tensor, v: Tensor, q: Tensor | None = None, *, occupancy: Occupancy | None = None) -> KVRead:
        """Write ``k``/``v``, hand ``q`` to the policy and observers, return what to attend to
        (:meth:`KVCache.update`)."""
        return self.cache.update(k, v, q, layer=self.index, occupancy=occupancy)

    def write(self, k: Tensor, v: Tensor) -> None:
        self.cache.write(k, v, layer=self.index)

    def observe_queries(self, q: Tensor) -> None:
        """Queries after the write (:meth:`KVCache.observe_queries`)."""
        self.cache.observe_queries(q, layer=self.index)

    def read(self, occupancy: Occupancy | None = None) -> KVRead:
        return self.cache.read(self.index, occupancy)

    def keys(self) -> Tensor:
        return self.cache.keys(self.index)

    def values(self) -> Tensor:
        return self.cache.values(self.index)

    @property
    def slot_positions(self) -> Tensor:
        """``int64 [heads, slots]``."""
        return self.cache.layer_slot_positions(self.index)

    def chronological_keys(self) -> Tensor:
        return self.cache.chronological_keys(self.index)

    def chronological_values(self) -> Tensor:
        return self.cache.chronological_values(self.index)

    def __repr__(self) -> str:
        return f"LayerView({self.cache.name}, layer={self.index})"
