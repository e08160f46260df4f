"""KV caches: each is storage plus a slot policy, sharing one chunk lifecycle."""

from .base import KVCache, LayerView
from .cacheset import CACHE_KINDS, CacheSet
from .chronological import ChronologicalCache
from .h2o import H2OCache
from .mass import MassBudgetCache
from .ring import RingCache

CACHE_KINDS["mass"] = MassBudgetCache
CACHE_KINDS["h2o"] = H2OCache

__all__ = ["KVCache", "LayerView", "RingCache", "ChronologicalCache", "MassBudgetCache", "H2OCache", "CacheSet", "CACHE_KINDS"]
