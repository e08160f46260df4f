"""A streamed diffusers Wan through each cache kind (``streamkv rollout --model diffusers-wan``).

The real ``WanTransformer3DModel`` class with random weights (seeded; nothing is downloaded)
and seeded random text states stands in for a trained model: the point is the cache path.
One model is built; each cache kind is attached in turn (:class:`StreamingWan`), runs the
same stream (same noise seed) through :class:`WanStreamingRollout`, and is detached.

Reported per kind: per-chunk latency, cache bytes, forwards, the largest difference of the
clean latents from the first kind's, and (``tiny`` only: it keeps every forward's inputs)
the largest difference of any streamed forward from the block-causal reference
(:mod:`streamkv.integrations.wan_reference`; sink + window masks for ring/chronological,
the masks of what the cache reported holding for scored kinds).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import torch

from streamkv.layout import CacheLayout
from streamkv.rollout import Schedule

__all__ = ["WAN_CONFIGS", "WanKindRun", "WanRunResult", "run_diffusers_wan", "print_wan_tables"]

#: Model configs (``WanTransformer3DModel`` keyword arguments) and stream geometry (latent frames).
WAN_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                      out_channels=4, text_dim=16, freq_dim=16, ffn_dim=48, num_layers=2, rope_max_seq_len=256),
        "frames_per_chunk": 2, "sink_frames": 2, "window_frames": 6, "height": 8, "width": 8, "text_len": 8,
    },
    # random weights at the Wan 2.1 T2V 1.3B shape; 480x832 video (60x104 latents), Self-Forcing's
    # 3-frame chunks and a 21-frame cache (3 sink + 18 window)
    "wan2.1-1.3b": {
        "model": dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                      out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                      eps=1e-6, rope_max_seq_len=1024),
        "frames_per_chunk": 3, "sink_frames": 3, "window_frames": 18, "height": 60, "width": 104, "text_len": 512,
    },
}


@dataclass
class WanKindRun:
    cache: str
    chunk_latency_ms: list[float]
    cache_bytes: int
    forwards: int
    retains_window: bool
    reference_max_abs_diff: float | None  # None: not checked
    reference_masks: str | None  # "layout" (sink + window) or "recorded" (what the cache held)
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "chunk_latency_ms": median(self.chunk_latency_ms), "chunk_latency_ms_all": self.chunk_latency_ms,
            "cache_bytes": self.cache_bytes, "forwards": self.forwards, "retains_window": self.retains_window,
            "reference_max_abs_diff": self.reference_max_abs_diff, "reference_masks": self.reference_masks,
            **self.extra,
        }


@dataclass
class WanRunResult:
    config: dict[str, Any]
    runs: dict[str, WanKindRun]
    max_abs_diff: dict[str, float]  # clean latents vs the first kind
    output_scale: float

    def to_json(self) -> dict[str, Any]:
        return {"model": "diffusers-wan", "config": self.config, **{k: r.summary() for k, r in self.runs.items()},
                "max_abs_diff": self.max_abs_diff, "output_scale": self.output_scale}


def run_diffusers_wan(
    kinds: Sequence[str] = ("chronological", "ring"),
    *,
    config: str = "tiny",
    chunks: int = 8,
    guidance: float = 3.0,
    device: str = "cpu",
    seed: int = 0,
    schedule: Schedule | None = None,
    cache_kwargs: dict[str, dict[str, Any]] | None = None,
    progress: Callable[[str], None] | None = None,
) -> WanRunResult:
    """Run one stream of ``chunks`` chunks through each cache kind; see the module docstring.
    ``progress(kind)`` is called after each chunk."""
    import diffusers
    from diffusers import WanTransformer3DModel

    from streamkv.integrations.diffusers import StreamingWan, WanStreamingRollout
    from streamkv.integrations.wan_reference import (StreamRecorder, recorded_masks, reference_chunk,
                                                     window_visibility)

    if config not in WAN_CONFIGS:
        raise ValueError(f"unknown diffusers-wan config {config!r}; choose one of {sorted(WAN_CONFIGS)}")
    if not kinds:
        raise ValueError("kinds must name at least one cache kind")
    geo = WAN_CONFIGS[config]
    dev = torch.device(device)
    torch.manual_seed(seed)
    model = WanTransformer3DModel(**geo["model"]).to(dev).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    text = [torch.randn(1, geo["text_len"], geo["model"]["text_dim"], generator=gen).to(dev) for _ in range(2)]
    check_reference = config == "tiny"
    outputs: dict[str, torch.Tensor] = {}
    runs: dict[str, WanKindRun] = {}
    stream = None
    for kind in kinds:
        stream = StreamingWan(
            model, frames_per_chunk=geo["frames_per_chunk"], sink_frames=geo["sink_frames"],
            window_frames=geo["window_frames"], height=geo["height"], width=geo["width"], cache=kind,
            branches=("cond", "uncond") if guidance > 1 else ("cond",), cache_kwargs=(cache_kwargs or {}).get(kind),
        )
        rollout = WanStreamingRollout(stream, guidance=guidance, schedule=schedule, seed=seed)
        recorder = StreamRecorder(stream) if check_reference else None
        try:
            rollout.set_prompt(text[0], text[1] if guidance > 1 else None, seed=1000)
            clean = []
            for _ in range(chunks):
                clean.append(rollout.generate_chunk())
                if progress is not None:
                    progress(kind)
        finally:
            if recorder is not None:
                recorder.close()
            stream.detach()
        outputs[kind] = torch.cat(clean, dim=2)
        cond = stream.caches["cond"]
        ref_diff, masks = None, None
        if recorder is not None:
            masks = "layout" if cond.retains_window else "recorded"
            ref_diff = 0.0
            for r in recorder.records:
                tokens = (r.chunk + 1) * stream.chunk_tokens
                m = (window_visibility(tokens, chunk=stream.spec.chunk, sink=stream.spec.sink, window=stream.spec.window,
                                       device=dev) if masks == "layout"
                     else recorded_masks(recorder.records, r, stream.chunk_tokens))
                ref_diff = max(ref_diff, float((reference_chunk(model, r, clean, m) - r.output).abs().max()))
        report = cond.report()
        extra = {k: report[k] for k in ("kept_tokens_mean", "evicted_total") if k in report}
        runs[kind] = WanKindRun(kind, [1e3 * s for s in rollout.chunk_seconds], stream.caches.nbytes, rollout.forwards,
                                cond.retains_window, ref_diff, masks, extra)
    first = outputs[kinds[0]]
    layout = CacheLayout(sink=stream.spec.sink, window=stream.spec.window, chunk=stream.spec.chunk)
    sched = schedule or Schedule()
    cfg = {
        "name": config, **{k: v for k, v in geo.items() if k != "model"}, **geo["model"], "guidance": guidance,
        "device": str(dev), "seed": seed, "chunks": chunks, "timesteps": list(sched.timesteps), "shift": sched.shift,
        "chunk_tokens": stream.chunk_tokens, "sink_tokens": stream.spec.sink, "window_tokens": stream.spec.window,
        "first_eviction_chunk": layout.first_eviction_chunk(),
        "ring_wraps": layout.ring_wraps(chunks * stream.chunk_tokens), "diffusers": diffusers.__version__,
        "weights": "random (seeded)",
    }
    return WanRunResult(cfg, runs, {k: float((outputs[k] - first).abs().max()) for k in kinds[1:]},
                        float(first.abs().max()))


def print_wan_tables(console, result: WanRunResult) -> None:
    """The run's header line and per-kind table (rich console)."""
    from rich.table import Table

    c = result.config
    console.print(
        f"[bold]diffusers-wan {c['name']}[/] (diffusers {c['diffusers']}, {c['weights']} weights): "
        f"{c['num_layers']} layers, {c['num_attention_heads']} heads x {c['attention_head_dim']}; chunks of "
        f"{c['frames_per_chunk']} frames = {c['chunk_tokens']} tokens, sink {c['sink_tokens']}, window "
        f"{c['window_tokens']} tokens; {c['chunks']} chunks, guidance {c['guidance']}, {c['device']}; first eviction "
        f"at chunk {c['first_eviction_chunk']}, ring wraps {c['ring_wraps']}x"
    )
    table = Table(title="per cache kind (latency: median over chunks)")
    for col in ("cache", "chunk ms", "cache MiB", "forwards", "|diff| vs first", "reference |diff|", "masks"):
        table.add_column(col, justify="left" if col in ("cache", "masks") else "right")
    first = next(iter(result.runs))
    for kind, run in result.runs.items():
        diff = "-" if kind == first else f"{result.max_abs_diff[kind]:.2e}"
        ref = "not checked" if run.reference_max_abs_diff is None else f"{run.reference_max_abs_diff:.2e}"
        table.add_row(kind, f"{median(run.chunk_latency_ms):.1f}", f"{run.cache_bytes / 2**20:.2f}", str(run.forwards),
                      diff, ref, run.reference_masks or "-")
    console.print(table)
    console.print(f"output scale (max |clean latent| of {first}): {result.output_scale:.3f}; reference = one forward "
                  f"of the same model over the clean context and the chunk with a block-causal mask")
