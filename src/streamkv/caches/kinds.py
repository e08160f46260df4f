"""The named cache kinds: :class:`~streamkv.caches.cache.KVCache` with a fixed policy.

They add no behaviour and change no contract; a few read-only properties name what their
policy keeps (``wraps``, ``write_start``, ``tau``, ``budget``, ``accumulated``).
"""

from __future__ import annotations

from torch import Tensor

from .cache import KVCache

__all__ = ["RingCache", "ChronologicalCache", "MassBudgetCache", "H2OCache", "TOVACache", "CACHE_KINDS"]


class RingCache(KVCache):
    """Circular storage with pinned sinks: a new chunk overwrites the oldest window slots in
    place; nothing retained ever moves (:class:`~streamkv.policies.Ring`)."""

    kind = "ring"

    @property
    def wraps(self) -> int:
        """Times the write cursor has passed the end of the ring."""
        return self.layout.ring_wraps(self.end)


class ChronologicalCache(KVCache):
    """The current path: the window in position order, rolled left on overflow
    (:class:`~streamkv.policies.Chronological`)."""

    kind = "chronological"

    @property
    def write_start(self) -> int:
        """First slot of the open (or last) chunk: its slots are ``[write_start, write_start + chunk)``."""
        return self.storage.write_start


class MassBudgetCache(KVCache):
    """Per head, evict within a mass budget ``tau`` (:class:`~streamkv.policies.MassBudget`);
    ``tau=`` is required."""

    kind = "mass"

    @property
    def tau(self) -> float:
        return self.policy.tau


class H2OCache(KVCache):
    """Per head, a budget of accumulated-attention heavy hitters (:class:`~streamkv.policies.H2O`)."""

    kind = "h2o"

    @property
    def budget(self) -> int:
        return self.policy.budget

    @property
    def accumulated(self) -> Tensor:
        """Device ``float64 [num_layers, heads, capacity]``: each slot's accumulated attention."""
        return self.policy.accumulated


class TOVACache(KVCache):
    """Per head, a budget of the tokens the newest chunk attends to most (:class:`~streamkv.policies.TOVA`)."""

    kind = "tova"

    @property
    def budget(self) -> int:
        return self.policy.budget


#: Cache classes by kind name (the names of :data:`streamkv.policies.POLICIES`).
CACHE_KINDS: dict[str, type[KVCache]] = {
    cls.kind: cls for cls in (RingCache, ChronologicalCache, MassBudgetCache, H2OCache, TOVACache)
}
