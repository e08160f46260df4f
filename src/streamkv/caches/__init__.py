"""KV caches: each is storage plus a slot policy, sharing one chunk lifecycle."""

from .base import KVCache, LayerView
from .cacheset import CACHE_KINDS, CacheSet
from .chronological import ChronologicalCache
from .ring import RingCache

__all__ = ["KVCache", "LayerView", "RingCache", "ChronologicalCache", "CacheSet", "CACHE_KINDS"]
