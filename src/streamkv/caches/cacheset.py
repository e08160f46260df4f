"""All layers of a model, with independent branches (``cond`` / ``uncond`` for CFG).

One allocation holds every branch and layer::

    K: [branches, layers, *k_shape]      V: [branches, layers, *v_shape]

Each branch is a full cache (its own host counters and device metadata) over its
slice of that allocation; branches share no state, so resetting, reopening or
advancing one never touches another. ``begin_chunk`` / ``commit_chunk`` / ``reset``
act on all branches by default (one call per model step), or on the named ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from .base import KVCache, LayerView
from .chronological import ChronologicalCache
from .ring import RingCache

__all__ = ["CacheSet", "CACHE_KINDS"]

#: Cache classes by the name the CLI and configs use.
CACHE_KINDS: dict[str, type[KVCache]] = {
    "ring": RingCache,
    "chronological": ChronologicalCache,
}


class CacheSet:
    """Caches for ``num_layers`` layers x ``branches``.

    Args:
        kind: a cache class or a name from :data:`CACHE_KINDS` (``"ring"``,
            ``"chronological"``; more are registered by their modules).
        k_shape, v_shape, seq_dim, sink, window, chunk, dtype, device: as for
            :class:`~streamkv.caches.base.KVCache` (per layer).
        num_layers: layers per branch.
        branches: branch names, e.g. ``("cond", "uncond")`` or ``("cond",)``.
        **cache_kwargs: extra arguments of the cache class (e.g. ``tau``).
    """

    def __init__(
        self,
        kind: str | type[KVCache],
        *,
        k_shape: Sequence[int],
        v_shape: Sequence[int],
        seq_dim: int,
        sink: int,
        window: int,
        chunk: int,
        num_layers: int,
        branches: Sequence[str] = ("cond", "uncond"),
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        **cache_kwargs: Any,
    ) -> None:
        cls = self._resolve(kind)
        branches = tuple(branches)
        if not branches or any(not isinstance(b, str) or not b for b in branches):
            raise ValueError(f"branches must be non-empty names, got {branches!r}")
        if len(set(branches)) != len(branches):
            raise ValueError(f"branches must be distinct, got {branches!r}")
        config = dict(
            seq_dim=seq_dim, sink=sink, window=window, chunk=chunk,
            num_layers=num_layers, dtype=dtype, **cache_kwargs,
        )
        # validate every argument on the meta device (no memory) before allocating
        probe = cls(k_shape, v_shape, device="meta", **config)
        nb = len(branches)
        self._k = torch.zeros((nb, num_layers, *probe.k_shape), dtype=dtype, device=device)
        self._v = torch.zeros((nb, num_layers, *probe.v_shape), dtype=dtype, device=device)
        self.kind = cls
        self.branches = branches
        self.num_layers = num_layers
        self._caches: dict[str, KVCache] = {
            name: cls(k_shape, v_shape, device=device, buffers=(self._k[i], self._v[i]), **config)
            for i, name in enumerate(branches)
        }

    @staticmethod
    def _resolve(kind: str | type[KVCache]) -> type[KVCache]:
        if isinstance(kind, str):
            if kind not in CACHE_KINDS:
                raise ValueError(f"unknown cache kind {kind!r}; choose one of {sorted(CACHE_KINDS)}")
            return CACHE_KINDS[kind]
        if isinstance(kind, type) and issubclass(kind, KVCache):
            return kind
        raise TypeError(f"kind must be a cache name or a KVCache subclass, got {kind!r}")

    # --------------------------------------------------------------- access
    def __getitem__(self, branch: str) -> KVCache:
        try:
            return self._caches[branch]
        except KeyError:
            raise KeyError(f"no branch {branch!r}; this set has {list(self.branches)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.branches)

    def layer(self, branch: str, layer: int) -> LayerView:
        return self[branch].layer(layer)

    @property
    def nbytes(self) -> int:
        """Bytes of all K/V buffers (every branch and layer)."""
        return self._k.nbytes + self._v.nbytes

    # ------------------------------------------------------------ lifecycle
    def _select(self, branches: Iterable[str] | None) -> list[KVCache]:
        names = self.branches if branches is None else tuple(branches)
        return [self[b] for b in names]

    def begin_chunk(self, chunk_idx: int, branches: Iterable[str] | None = None) -> None:
        """``begin_chunk`` on every (or the named) branch; all-or-nothing."""
        caches = self._select(branches)
        for cache in caches:
            cache.check_begin(chunk_idx)
        for cache in caches:
            cache.begin_chunk(chunk_idx)

    def commit_chunk(self, chunk_idx: int, branches: Iterable[str] | None = None) -> None:
        """``commit_chunk`` on every (or the named) branch; all-or-nothing."""
        caches = self._select(branches)
        for cache in caches:
            cache.check_commit(chunk_idx)
        for cache in caches:
            cache.commit_chunk(chunk_idx)

    def reset(self, branches: Iterable[str] | None = None) -> None:
        for cache in self._select(branches):
            cache.reset()

    # ----------------------------------------------------------- state dict
    def state_dict(self) -> dict[str, Any]:
        return {name: cache.state_dict() for name, cache in self._caches.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or set(state) != set(self.branches):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"state dict must have branches {sorted(self.branches)}, got {got}")
        for name in self.branches:  # validate all before loading any
            self[name].validate_state(state[name])
        for name in self.branches:
            self[name].load_state_dict(state[name])
