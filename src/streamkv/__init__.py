"""streamkv: attention KV caches for streaming (autoregressive) video diffusion.

- :class:`RingCache` — circular storage with pinned sinks; nothing retained moves.
- :class:`ChronologicalCache` — the current path (window rolled left on overflow).
- :class:`MassBudgetCache` — per-head mass budget with a stated guarantee.
- :class:`CacheSet` — all layers x independent ``cond`` / ``uncond`` branches.

See ``docs/ARCHITECTURE.md`` for the layers, vocabulary and invariants. The names below
are imported on first use, so ``import streamkv.cli`` (and ``streamkv --help``) does not
import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "CacheLayout": "streamkv.layout",
    "KVCache": "streamkv.caches",
    "LayerView": "streamkv.caches",
    "RingCache": "streamkv.caches",
    "ChronologicalCache": "streamkv.caches",
    "MassBudgetCache": "streamkv.caches",
    "H2OCache": "streamkv.caches",
    "CacheSet": "streamkv.caches",
    "CACHE_KINDS": "streamkv.caches",
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
