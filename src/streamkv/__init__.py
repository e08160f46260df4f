"""streamkv: attention KV caches for streaming (autoregressive) video diffusion.

- :class:`RingCache` — circular storage with pinned sinks; nothing retained moves.
- :class:`ChronologicalCache` — the current path (window rolled left on overflow).
- :class:`CacheSet` — all layers x independent ``cond`` / ``uncond`` branches.

See ``docs/ARCHITECTURE.md`` for the layers, vocabulary and invariants.
"""

from .caches import CACHE_KINDS, CacheSet, ChronologicalCache, KVCache, LayerView, RingCache
from .layout import CacheLayout

__version__ = "0.1.0"

__all__ = [
    "CacheLayout",
    "KVCache",
    "LayerView",
    "RingCache",
    "ChronologicalCache",
    "CacheSet",
    "CACHE_KINDS",
    "__version__",
]
