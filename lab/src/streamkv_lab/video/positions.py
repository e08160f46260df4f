"""Does a position map help the trained toy run past its training window?

The toy was trained on 16-frame clips with absolute RoPE (frames 0..15). Here it streams
``factor`` times that (default 8: 128 frames) through the ring at its own memory (2 sink frames
+ a 6-frame window = 8 frames of slots, every stream alike), storing raw keys and rotating them at
every read under each position map of :data:`~streamkv.positions.POSITION_MAPS` (parameters from
the registry's ``for_geometry``; maps that are the same rule as another, ``same_as``, are left out),
beside the full-history rollout and the ground truth. ``absolute`` is the toy's own rule (the ring
with RoPE at write, to rounding): past the window its sinks sit ever further back (frame 127 sees
frames 0 and 1 at offsets up to 127, never seen in training), where the bounded maps keep every
offset within the cache (at most 7 frames).

Per map and frame: mean absolute RGB error against the ground truth and against the full-history
stream; summaries within the training window and past it. On a ring (a contiguous window),
``cache_relative``, ``sliding_sinks`` and ``block_relative`` are the same rule up to a shift (tested
in ``tests/test_positions.py``), so their streams agree to float rounding: they are reported
separately, and the differences between them measure rounding only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from streamkv.caches import CacheSet
from streamkv.models import CausalVideoDiT
from streamkv.positions import POSITION_MAPS, position_map

from . import data
from .config import CONTEXT_FRAMES
from .runs import cache_run_spec, run_stream
from .toy import geometry_model, stream

__all__ = ["long_stream_maps", "map_cache", "stream_map"]


def long_stream_maps() -> list[str]:
    """The registry's maps streamed here (one per rule)."""
    return [name for name, mk in POSITION_MAPS.items() if mk.same_as is None]


def map_cache(model: CausalVideoDiT, name: str, *, sink_frames: int, window_frames: int
              ) -> tuple[CausalVideoDiT, CacheSet]:
    """The model under the geometry and a one-branch ring of raw keys rotated by map ``name``."""
    m = geometry_model(model, sink_frames=sink_frames, window_frames=window_frames)
    fpc = m.cfg.frames_per_chunk
    params = POSITION_MAPS[name].for_geometry(sink_frames, sink_frames + window_frames, fpc)
    spec = m.cache_spec(1).replace(rope_at_read=m.rope_at_read(position_map(name, **params)))
    return m, CacheSet("ring", spec)


def stream_map(model: CausalVideoDiT, name: str, context: torch.Tensor, frames: int, *, seed: int,
               sink_frames: int, window_frames: int) -> torch.Tensor:
    """``frames`` latents streamed through :func:`map_cache`'s ring."""
    m, caches = map_cache(model, name, sink_frames=sink_frames, window_frames=window_frames)
    with torch.no_grad():
        return stream(m, context, frames, cache=caches, seed=seed)


def _summary(err: np.ndarray, horizon: int) -> dict[str, Any]:
    inside, beyond = err[CONTEXT_FRAMES:horizon], err[horizon:]
    return {"per_frame": err.tolist(), "horizon_mean": float(inside.mean()) if inside.size else None,
            "beyond_mean": float(beyond.mean()) if beyond.size else None,
            "last_quarter_mean": float(err[-max(1, len(err) // 4):].mean())}


def long_stream(model: CausalVideoDiT, *, horizon: int, factor: int = 8, clips: int = 1, data_seed: int = 31_337,
                noise_seed: int = 0, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Stream ``factor * horizon`` frames per clip under every map (module docstring)."""
    t0 = time.perf_counter()
    frames = factor * horizon
    sink, window = model.cfg.sink_frames, model.cfg.window_frames
    names = long_stream_maps()
    gt_err: dict[str, list[np.ndarray]] = {n: [] for n in ["full history", "ring (RoPE at write)", *names]}
    full_err: dict[str, list[np.ndarray]] = {n: [] for n in gt_err}
    write_vs_absolute = 0.0
    for i in range(clips):
        _, _, rgb = data.make_clip(data_seed, i, frames)
        ctx = data.to_latents(rgb)[None][:, :, :CONTEXT_FRAMES]
        if progress is not None:
            progress(f"clip {i + 1}/{clips}: full history")
        full_lat, _, _ = run_stream(model, cache_run_spec("full", 0, total_frames=frames), ctx, frames, seed=noise_seed + i)
        ring_lat, _, _ = run_stream(model, cache_run_spec("ring", sink + window), ctx, frames, seed=noise_seed + i)
        lat = {"full history": full_lat, "ring (RoPE at write)": ring_lat}
        for name in names:
            if progress is not None:
                progress(f"clip {i + 1}/{clips}: {name}")
            lat[name] = stream_map(model, name, ctx, frames, seed=noise_seed + i, sink_frames=sink, window_frames=window)
        write_vs_absolute = max(write_vs_absolute, float((lat["absolute"] - ring_lat).abs().max()))
        full = data.to_rgb(full_lat[0])
        for name, x in lat.items():
            rgb_x = data.to_rgb(x[0])
            gt_err[name].append(np.abs(rgb_x - rgb).mean((1, 2, 3)))
            full_err[name].append(np.abs(rgb_x - full).mean((1, 2, 3)))
    per_map = {name: {"vs_truth": _summary(np.mean(gt_err[name], 0), horizon),
                      "vs_full_history": _summary(np.mean(full_err[name], 0), horizon)} for name in gt_err}
    return {
        "frames": frames, "training_window": horizon, "factor": factor, "clips": clips, "data_seed": data_seed,
        "capacity_frames": sink + window, "sink_frames": sink, "window_frames": window,
        "context_frames": CONTEXT_FRAMES, "maps": names, "per_map": per_map,
        "absolute_at_read_vs_ring_at_write_max_abs_latent_diff": write_vs_absolute,
        "wall_s": time.perf_counter() - t0,
    }
