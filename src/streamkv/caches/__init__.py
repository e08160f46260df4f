"""KV caches: storage plus a slot policy, one chunk lifecycle, observers.

- :class:`KVCache` (:mod:`.cache`) and the named kinds derived from the policy registry
  (:mod:`.kinds`: ``RingCache``, ``TOVACache``, ... and ``CACHE_KINDS``);
- :class:`KVRead` (:mod:`.read`): what attention reads, decided by the cache in one place;
- :class:`Lifecycle` (:mod:`.lifecycle`): where the stream stands, the read generation;
- :class:`CacheObserver`, :class:`Change`, :class:`EvictionEvent`, :class:`ReadAnswer` (:mod:`.observers`);
- :class:`CacheSpec` (:mod:`.spec`) and :class:`CacheSet` (:mod:`.cacheset`).
"""

from .cache import MAX_POSITION, KVCache, LayerView
from .cacheset import CacheSet
from .kinds import CACHE_KINDS, ChronologicalCache, H2OCache, MassBudgetCache, RingCache, TOVACache
from .lifecycle import Lifecycle
from .observers import CacheObserver, Change, EvictionEvent, ReadAnswer
from .read import KVRead
from .spec import CacheSpec

__all__ = [
    "KVCache", "LayerView", "Lifecycle", "KVRead", "CacheObserver", "Change", "EvictionEvent", "ReadAnswer", "CacheSpec",
    "CacheSet",
    "RingCache", "ChronologicalCache", "MassBudgetCache", "H2OCache", "TOVACache", "CACHE_KINDS", "MAX_POSITION",
]
