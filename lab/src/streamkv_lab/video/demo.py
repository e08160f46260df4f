"""The watchable part of ``streamkv demo``: the trained toy streams a held-out clip several
times longer than its training window, through the ring and through every other cache at
the same memory, beside the full-history rollout and the ground truth.

Outputs (in the demo's folder):

``demo.gif``        ground truth | ring stream (the toy's own cache: sinks + window)
``demo_panel.gif``  ground truth | full history | ring | window (no sinks) | mass | H2O | TOVA, and
                    the ring holding raw keys rotated at read by the position maps the registry
                    marks for the panel (``sliding_sinks``, ``block_relative``), every cache at the
                    ring's memory; under each tile its error against the ground truth, per frame
``demo_panel.png``  the same streams as a contact sheet (every 4th frame)
``demo_video.json`` per stream: mean error against the full-history stream and against the
                    ground truth (within / past the training window) and per frame, sprites
                    tracked; the ring vs chronological difference; wall time
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from streamkv.positions import POSITION_MAPS

from . import data, metrics
from .positions import stream_map
from .render import contact_sheet, tile_frames, write_gif
from .runs import cache_run_spec, run_stream
from .toy import CONTEXT_FRAMES, WEIGHTS, load_model, training_horizon

__all__ = ["DEMO_SEED", "video_demo"]

DEMO_SEED = 31_337  # held-out clips (training uses stream 0 of the data generator)

PANEL = (("full history", "full"), ("ring", "ring"), ("window, no sinks", "window"), ("mass tau=0.05", "mass"),
         ("H2O", "h2o"), ("TOVA", "tova"))


def _mean(x: np.ndarray) -> float | None:
    return float(x.mean()) if x.size else None


def video_demo(out: str | Path, *, frames: int = 64, clip: int = 0, weights: str | Path = WEIGHTS,
               progress: Callable[[str], None] | None = None) -> dict:
    """Stream clip ``clip`` of :data:`DEMO_SEED` for ``frames`` frames through each cache at
    the toy's own capacity; write the GIFs, the contact sheet and the JSON; return the JSON."""
    t0 = time.perf_counter()
    out = Path(out)
    model = load_model(weights)
    horizon = training_horizon(weights)
    capacity = model.cfg.sink_frames + model.cfg.window_frames
    _, truth, rgb = data.make_clip(DEMO_SEED, clip, frames)
    ctx = data.to_latents(rgb)[None][:, :, :CONTEXT_FRAMES]
    streams: dict[str, np.ndarray] = {"ground truth": rgb}
    latents = {}
    for label, kind in (*PANEL, ("chronological", "chronological")):
        if progress is not None:
            progress(label)
        spec = cache_run_spec(kind, capacity, total_frames=frames)
        lat, _, _ = run_stream(model, spec, ctx, frames, seed=0)
        latents[kind] = lat
        if kind != "chronological":
            streams[label if kind == "full" else f"{label} ({capacity}f)"] = data.to_rgb(lat[0])
    for name in (n for n, mk in POSITION_MAPS.items() if mk.panel):
        if progress is not None:
            progress(f"ring, {name} at read")
        lat = stream_map(model, name, ctx, frames, seed=0, sink_frames=model.cfg.sink_frames,
                         window_frames=model.cfg.window_frames)
        streams[f"{name} ({capacity}f)"] = data.to_rgb(lat[0])
    ring_label = f"ring ({capacity}f)"
    err_gt = {label: np.abs(x - rgb).mean((1, 2, 3)) for label, x in streams.items()}
    write_gif(tile_frames({"ground truth": rgb, ring_label: streams[ring_label]}, scale=12, horizon=horizon,
                          context=CONTEXT_FRAMES), out / "demo.gif")
    write_gif(tile_frames(streams, scale=8, horizon=horizon, context=CONTEXT_FRAMES, errors=err_gt),
              out / "demo_panel.gif")
    contact_sheet(streams, out / "demo_panel.png")
    full = streams["full history"]
    gen_in, gen_out = slice(CONTEXT_FRAMES, min(horizon, frames)), slice(horizon, frames)
    per = {}
    for label, frames_rgb in streams.items():
        if label == "ground truth":
            continue
        ef, eg = np.abs(frames_rgb - full).mean((1, 2, 3)), np.abs(frames_rgb - rgb).mean((1, 2, 3))
        per[label] = {
            "err_vs_full_horizon": _mean(ef[gen_in]), "err_vs_full_beyond": _mean(ef[gen_out]),
            "err_vs_gt_horizon": _mean(eg[gen_in]), "err_vs_gt_beyond": _mean(eg[gen_out]),
            "tracking_horizon": metrics.tracking(frames_rgb, truth, range(gen_in.start, gen_in.stop)),
            "tracking_beyond": metrics.tracking(frames_rgb, truth, range(horizon, frames)),
            "err_vs_full_per_frame": ef.tolist(), "err_vs_gt_per_frame": eg.tolist(),
        }
    return {
        "clip": {"seed": DEMO_SEED, "index": clip, "frames": frames, "context_frames": CONTEXT_FRAMES,
                 "training_window": horizon, "capacity_frames": capacity,
                 "tokens_per_frame": model.cfg.tokens_per_frame},
        "streams": per,
        "ring_vs_chronological_max_abs_diff": float((latents["ring"] - latents["chronological"]).abs().max()),
        "files": ["demo.gif", "demo_panel.gif", "demo_panel.png"],
        "wall_s": time.perf_counter() - t0,
    }
