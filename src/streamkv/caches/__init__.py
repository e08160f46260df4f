"""KV caches: storage plus a slot policy, one chunk lifecycle, observers.

- :class:`KVCache` (:mod:`.cache`) and the named kinds (:mod:`.kinds`): ``RingCache``,
  ``ChronologicalCache``, ``MassBudgetCache``, ``H2OCache``, ``TOVACache``;
- :class:`KVRead` (:mod:`.read`): what attention reads, decided by the cache in one place;
- :class:`CacheObserver`, :class:`EvictionEvent` (:mod:`.observers`);
- :class:`CacheSpec` (:mod:`.spec`) and :class:`CacheSet` (:mod:`.cacheset`).
"""

from .cache import MAX_POSITION, KVCache, LayerView, Transition
from .cacheset import CacheSet
from .kinds import CACHE_KINDS, ChronologicalCache, H2OCache, MassBudgetCache, RingCache, TOVACache
from .observers import CacheObserver, EvictionEvent
from .read import KVRead
from .spec import CacheSpec

__all__ = [
    "KVCache", "LayerView", "Transition", "KVRead", "CacheObserver", "EvictionEvent", "CacheSpec", "CacheSet",
    "RingCache", "ChronologicalCache", "MassBudgetCache", "H2OCache", "TOVACache", "CACHE_KINDS", "MAX_POSITION",
]
