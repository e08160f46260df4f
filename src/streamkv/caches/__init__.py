"""KV caches: each is storage plus a slot policy, sharing one chunk lifecycle."""

from .base import KVCache, LayerView
from .cacheset import CACHE_KINDS, CacheSet
from .chronological import ChronologicalCache
from .mass import MassBudgetCache
from .ring import RingCache

CACHE_KINDS["mass"] = MassBudgetCache

__all__ = ["KVCache", "LayerView", "RingCache", "ChronologicalCache", "MassBudgetCache", "CacheSet", "CACHE_KINDS"]
