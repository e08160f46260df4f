"""streamkv: attention KV caches for streaming (autoregressive) generators.

- :class:`RingCache` — circular storage with pinned sinks; nothing retained moves.
- :class:`ChronologicalCache` — the current path (window rolled left on overflow).
- :class:`MassBudgetCache`, :class:`H2OCache`, :class:`TOVACache` — per-head scored policies.
- :class:`CacheSet` — all layers x independent branches (``cond`` / ``uncond``), one allocation.
- :class:`CacheSpec` — shapes and layout, written once; :func:`~streamkv.attention.attend`.

See ``docs/ARCHITECTURE.md`` for the layers, vocabulary and invariants. The names below
are imported on first use, so ``import streamkv`` (and ``streamkv --help``) does not
import torch. The command-line lab (demo, benchmarks, experiments) is the separate
distribution ``streamkv-lab``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

_LAZY = {
    "CacheLayout": "streamkv.layout",
    "KVCache": "streamkv.caches",
    "LayerView": "streamkv.caches",
    "KVRead": "streamkv.caches",
    "CacheObserver": "streamkv.caches",
    "EvictionEvent": "streamkv.caches",
    "RingCache": "streamkv.caches",
    "ChronologicalCache": "streamkv.caches",
    "MassBudgetCache": "streamkv.caches",
    "H2OCache": "streamkv.caches",
    "TOVACache": "streamkv.caches",
    "CacheSet": "streamkv.caches",
    "CacheSpec": "streamkv.caches",
    "CACHE_KINDS": "streamkv.caches",
    "attend": "streamkv.attention",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'streamkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
