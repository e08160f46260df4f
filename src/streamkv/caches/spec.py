"""``CacheSpec``: everything about a cache but its policy, written once.

Models describe the cache they need with one (``CausalVideoDiT.cache_spec(batch)``); caches
and cache sets are built from it::

    spec = CacheSpec(k_shape=(1, 144, 12, 128), v_shape=(1, 144, 12, 128), seq_dim=1,
                     sink=48, window=96, chunk=48, num_layers=30)
    cache = spec.build("mass", tau=0.05)
    caches = CacheSet("ring", spec, branches=("cond", "uncond"))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

import torch

from .cache import KVCache
from .kinds import CACHE_KINDS

__all__ = ["CacheSpec"]


@dataclass(frozen=True)
class CacheSpec:
    """Shapes, layout, dtype and device of a cache (see :class:`~streamkv.caches.KVCache`).
    Validated when a cache is built from it."""

    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    seq_dim: int
    sink: int
    window: int
    chunk: int
    num_layers: int = 1
    head_dim: int | None = None
    recall_slots: int = 0
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    quant: Any = None  # quantised storage (streamkv.quant.KVQuant or a format name)
    pages: Any = None  # rows in pages shared copy-on-write by forks (True or streamkv.stores.PageOptions)
    rope_at_read: Any = None  # a streamkv.rope_at_read.RopeAtRead: raw keys, rotated by a position map at read

    def __post_init__(self) -> None:
        for name in ("k_shape", "v_shape"):
            value = getattr(self, name)
            if isinstance(value, (list, torch.Size)):
                object.__setattr__(self, name, tuple(value))

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :class:`~streamkv.caches.KVCache` (shapes positional)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("k_shape", "v_shape")}

    def replace(self, **changes: Any) -> CacheSpec:
        return dataclasses.replace(self, **changes)

    def build(self, kind: Any, **policy_params: Any) -> KVCache:
        """A cache of ``kind`` (a name, a policy class or instance, or a cache class)."""
        if isinstance(kind, type) and issubclass(kind, KVCache):
            return kind(self.k_shape, self.v_shape, **self.kwargs(), **policy_params)
        if isinstance(kind, str) and kind in CACHE_KINDS:
            return CACHE_KINDS[kind](self.k_shape, self.v_shape, **self.kwargs(), **policy_params)
        return KVCache(self.k_shape, self.v_shape, policy=kind, **self.kwargs(), **policy_params)
