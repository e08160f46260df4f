"""Quantised caches on the trained toy video model: error against the full-history rollout.

Held-out clips (``data_seed`` of :mod:`streamkv_lab.video.config`), the ground truth's first
:data:`~streamkv_lab.video.config.CONTEXT_FRAMES` frames committed, the rest generated with the
same noise for every cache. The reference is the full-history rollout in float32 (a window as
long as the stream). Error per generated frame: ``||x - x_full|| / ||x_full||`` over the latent;
mean and p99 over the frames of every clip.

Rows: the full-history cache in each format of :data:`~streamkv.quant.KV_FORMATS`; at a quarter
of the bfloat16 full cache's device bytes the bfloat16 ring, mass, H2O and TOVA, and the int8 /
int4 ring and TOVA sized to the same bytes. Device bytes: what the cache allocates (one
branch, every layer); the transient bytes of one read of its last layer; ms per chunk: the
rollout's wall time per generated chunk (the model included).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from streamkv.caches import CacheSet
from streamkv.quant import KV_FORMATS

from .quant_lm import quant_of

__all__ = ["run_video"]


def _spec_bytes(model: Any, kind: str, frames: int, fmt: str | None, total: int) -> tuple[Any, int]:
    from streamkv_lab.video.runs import cache_run_spec
    from streamkv_lab.video.toy import geometry_model

    spec = cache_run_spec(kind, frames, total_frames=total) if kind != "full" else cache_run_spec(
        "full", 0, total_frames=total)
    m = geometry_model(model, sink_frames=spec.sink_frames, window_frames=spec.window_frames)
    probe = CacheSet(spec.policy, m.cache_spec(1).replace(device="meta"), quant=quant_of(fmt), **dict(spec.params))
    return spec, probe.nbytes


def run_video(*, clips: int = 2, frames: int = 32, progress=None) -> dict[str, Any]:
    from streamkv.attention import attend
    from streamkv_lab.measure.memory import probe_transient
    from streamkv_lab.video import data
    from streamkv_lab.video.config import CONTEXT_FRAMES, EvalConfig
    from streamkv_lab.video.toy import geometry_model, load_model, stream

    say = progress or (lambda s: None)
    cfg = EvalConfig()
    model = load_model()
    fpc = model.cfg.frames_per_chunk
    ctxs = []
    for i in range(clips):
        _, _, rgb = data.make_clip(cfg.data_seed, i, frames)
        ctxs.append(data.to_latents(rgb)[None][:, :, :CONTEXT_FRAMES])
    runs: list[tuple[str, str, int, str | None]] = [("full", "full", frames, "fp32")]
    runs += [(f"full {f}", "full", frames, f) for f in KV_FORMATS]
    # a quarter of the full cache in the model's own precision (float32): at the toy's size the
    # full-precision rows (2 sink frames + the open 2-frame chunk) are already most of a quarter
    # of a bf16 cache
    _, full_fp32 = _spec_bytes(model, "full", frames, None, frames)
    quarter = full_fp32 // 4
    for fmt, kinds in (("bf16", ("ring", "mass", "h2o", "tova")), ("int8", ("ring", "tova")), ("int4", ("ring", "tova"))):
        for kind in kinds:
            best = None
            for cap in range(2 + 2 * fpc, frames + 1, fpc):  # the largest capacity within the bytes
                try:
                    _, nb = _spec_bytes(model, kind, cap, fmt, frames)
                except ValueError:
                    continue
                if nb <= quarter:
                    best = cap
            if best is not None:
                runs.append((f"{kind} {fmt}", kind, best, fmt))
    ref: list[torch.Tensor] = []
    rows = []
    for label, kind, cap, fmt in runs:
        say(f"video {label} {cap}f")
        spec, _ = _spec_bytes(model, kind, cap, fmt, frames)
        m = geometry_model(model, sink_frames=spec.sink_frames, window_frames=spec.window_frames)
        errs = []
        wall = 0.0
        caches = None
        for i, ctx in enumerate(ctxs):
            caches = CacheSet(spec.policy, m.cache_spec(1), quant=quant_of(None if fmt == "fp32" else fmt),
                              **dict(spec.params))
            t0 = time.perf_counter()
            with torch.no_grad():
                out = stream(m, ctx, frames, cache=caches, seed=cfg.noise_seed + i)
            wall += time.perf_counter() - t0
            if label == "full":
                ref.append(out)
            gen = out[:, :, CONTEXT_FRAMES:]
            r = ref[i][:, :, CONTEXT_FRAMES:]
            e = (gen - r).flatten(3).norm(dim=-1).squeeze(0).norm(dim=0) / r.flatten(3).norm(dim=-1).squeeze(0).norm(
                dim=0).clamp_min(1e-30)
            errs.append(e)
        e = torch.cat(errs).double()
        cache = caches["cond"]
        L = cache.num_layers
        B, T, H, Dh = cache.storage.chunk_shape("k")
        q = torch.randn(B, T, H, Dh)
        read = cache.read(L - 1, "mask")
        trans = probe_transient(lambda: attend(q, read), "cpu", steps=1).peak_bytes
        st = cache.storage
        bpt = st.store.bytes_per_token()
        n_chunks = clips * (frames - CONTEXT_FRAMES) // fpc
        rows.append({"dataset": "toy-video", "cache": f"streamkv {label}", "kind": kind,
                     "bits": 32 if fmt == "fp32" else KV_FORMATS[fmt].bits, "format": fmt,
                     "memory_tokens": cap * model.cfg.tokens_per_frame, "capacity_frames": cap,
                     "bytes_per_token": bpt, "device_bytes": cache.nbytes, "transient_bytes": trans,
                     "error_mean": float(e.mean()), "error_p99": float(torch.quantile(e, 0.99)),
                     "perplexity": None, "certificate_violations": None, "tightness_median": None,
                     "ms_per_chunk": 1000.0 * wall / n_chunks})
    return {"clips": clips, "frames": frames, "quarter_bytes": quarter, "rows": rows}
