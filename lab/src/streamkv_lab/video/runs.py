"""One clip through every cache at matched memory, and the full-history reference.

Memory is counted in cache slots (tokens): a capacity of ``M`` frames is ``M * 16`` slots
per (layer, head), K and V, for every kind:

``ring``      sinks (the first chunk: 2 frames) + a ring window of ``M - 2`` frames
``chronological``  the same slots, the current path (identical output to the ring)
``window``    no sinks, a window of ``M`` frames
``mass``      sinks + ``M - 2`` frames, per-head eviction within a mass budget ``tau``
              (overflows counted when the budget alone leaves no room)
``h2o``, ``tova``  sinks + ``M - 2`` frames, per-head budget ``sink + window - chunk`` (the
              default: the same history a ring keeps besides the chunk being written)
``full``      a window as long as the stream: nothing is ever evicted (the reference)

Every stream uses the same weights, the same ground-truth context chunks and the same noise
seed, so differences come from what each cache kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from streamkv.caches import CacheSet
from streamkv.models import CausalVideoDiT

from streamkv_lab.kinds import WINDOW, kind_params, policies

from .toy import geometry_model, stream

__all__ = ["CacheRunSpec", "cache_run_spec", "build_caches", "run_stream"]

SINK_FRAMES = 2


@dataclass(frozen=True)
class CacheRunSpec:
    """A cache kind at a capacity: its geometry (frames) and policy parameters."""

    kind: str  # ring, chronological, window, mass, h2o, tova, full
    capacity_frames: int
    sink_frames: int
    window_frames: int
    policy: str
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        return self.kind if self.kind == "full" else f"{self.kind}@{self.capacity_frames}f"


def cache_run_spec(kind: str, capacity_frames: int, *, total_frames: int | None = None, tau: float = 0.05,
                   chunk_frames: int = 2) -> CacheRunSpec:
    """The geometry of ``kind`` at ``capacity_frames`` (see the module docstring)."""
    if kind == "full":
        if total_frames is None:
            raise ValueError("kind 'full' needs total_frames (its window holds the whole stream)")
        return CacheRunSpec("full", total_frames, SINK_FRAMES, total_frames - SINK_FRAMES, "ring")
    if kind == "window":
        return CacheRunSpec(kind, capacity_frames, 0, capacity_frames, "ring")
    window = capacity_frames - SINK_FRAMES
    per_head = kind in policies() and policies()[kind].per_head
    need = 2 * chunk_frames if per_head else chunk_frames
    if kind not in policies():
        raise ValueError(f"unknown cache kind {kind!r}; choose from {('full', WINDOW, *policies())}")
    if window < need:
        raise ValueError(f"{kind} at {capacity_frames} frames leaves a window of {window} frames; it needs >= {need}")
    return CacheRunSpec(kind, capacity_frames, SINK_FRAMES, window, kind, tuple(kind_params(kind, tau=tau).items()))


def build_caches(model: CausalVideoDiT, spec: CacheRunSpec) -> tuple[CausalVideoDiT, CacheSet]:
    """The model under ``spec``'s geometry (same weights) and a one-branch cache set for it."""
    m = geometry_model(model, sink_frames=spec.sink_frames, window_frames=spec.window_frames)
    return m, CacheSet(spec.policy, m.cache_spec(1), **dict(spec.params))


def run_stream(model: CausalVideoDiT, spec: CacheRunSpec, context: Tensor, total_frames: int, *, seed: int,
               observers: Sequence[type] = (), observer_kwargs: Sequence[dict] = ()) -> tuple[Tensor, CacheSet, list]:
    """Stream ``total_frames`` frames through ``spec``'s cache; returns ``(latents, caches,
    observers)`` with each observer class built as ``cls(caches["cond"], **kwargs)``."""
    m, caches = build_caches(model, spec)
    obs = [cls(caches["cond"], **kw) for cls, kw in zip(observers, observer_kwargs or [{}] * len(observers))]
    with torch.no_grad():
        out = stream(m, context, total_frames, cache=caches, seed=seed)
    return out, caches, obs
