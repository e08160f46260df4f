"""Matched rollouts: the same weights, prompts and noise through each cache, side by side.

Each cache runs two streams (a reset to a second prompt between them) with the same
noise seed. Reported per cache (medians over the steady chunks, those whose reservation
evicts): per-chunk latency, cache maintenance per DiT forward
(everything the cache does: begin, commit and every write of every layer and branch),
peak memory, and the largest output difference against the first cache.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` over the timed run; on the CPU
(which has no allocator statistics) the bytes held by weights, caches and prompt K/V
plus the peak of transient allocations (torch profiler allocator events) during the last
chunk of a second run of the same stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import torch

from streamkv.layout import CacheLayout
from streamkv.models import CausalVideoDiT, get_config
from streamkv.rollout import Schedule, StreamingRollout

__all__ = ["CacheRun", "CompareResult", "compare_rollouts", "two_streams", "stream_config", "PROMPTS"]

#: The two prompts of every compared stream (a reset between them).
PROMPTS = (("a red fox running through snow", "blurry"), ("a sailing boat at dusk", "low quality"))


@dataclass
class CacheRun:
    cache: str
    chunk_latency_ms: list[float]
    maintenance_ms: list[float]  # per DiT forward, per chunk
    steady: list[bool]  # the chunk's reservation evicted (index >= the first eviction in its stream)
    peak_bytes: int
    cache_bytes: int
    retains_window: bool = True  # same retained tokens as the current path: parity expected
    extra: dict[str, Any] = field(default_factory=dict)  # the cache's own report(), if any

    def steady_median(self, values: list[float]) -> float:
        """Median over the steady chunks (those that evict); over all if there are none."""
        picked = [x for x, s in zip(values, self.steady) if s]
        return median(picked or values)

    def summary(self) -> dict[str, Any]:
        return {
            "chunk_latency_ms": self.steady_median(self.chunk_latency_ms),
            "chunk_latency_ms_all": self.chunk_latency_ms,
            "maintenance_ms": self.steady_median(self.maintenance_ms),
            "maintenance_ms_all": self.maintenance_ms,
            "steady_chunks": self.steady,
            "peak_bytes": self.peak_bytes,
            "cache_bytes": self.cache_bytes,
            "retains_window": self.retains_window,
            **self.extra,
        }


@dataclass
class CompareResult:
    config: dict[str, Any]
    chunks: int
    runs: dict[str, CacheRun]
    max_abs_diff: dict[str, float]  # vs the first cache
    output_scale: float

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"config": self.config, "chunks": self.chunks}
        for name, run in self.runs.items():
            out[name] = run.summary()
        out["max_abs_diff"] = self.max_abs_diff
        out["output_scale"] = self.output_scale
        return out


def two_streams(rollout: StreamingRollout, chunks: int, progress: Callable[[], None] | None = None) -> torch.Tensor:
    """Two streams: ``chunks`` chunks of the first prompt, then a reset and ``chunks // 2``
    of the second; the same noise seeds for every cache."""
    outs = []
    for i, (prompt, negative) in enumerate(PROMPTS):
        rollout.set_prompt(prompt, negative if rollout.guidance > 1 else None, seed=1000 + i)
        n = chunks if i == 0 else max(1, chunks // 2)
        for _ in range(n):
            outs.append(rollout.generate_chunk())
            if progress is not None:
                progress()
    return torch.cat(outs, dim=2)


def compare_rollouts(
    caches: Sequence[str] = ("chronological", "ring"),
    *,
    config: str = "tiny",
    chunks: int = 8,
    guidance: float = 3.0,
    mode: str = "eager",
    device: str = "cpu",
    seed: int = 0,
    schedule: Schedule | None = None,
    cache_kwargs: dict[str, dict[str, Any]] | None = None,
    progress: Callable[[str], None] | None = None,
    measure_memory: bool = True,
) -> CompareResult:
    """Run the same streams through each cache; see the module docstring."""
    if not caches:
        raise ValueError("caches must name at least one cache kind")
    cfg = get_config(config)
    dev = torch.device(device)
    model = CausalVideoDiT(cfg, seed=seed).to(dev).eval()
    param_bytes = sum(p.nbytes for p in model.parameters())
    first_eviction = CacheLayout(sink=cfg.sink_tokens, window=cfg.window_tokens, chunk=cfg.chunk_tokens).first_eviction_chunk()
    outputs: dict[str, torch.Tensor] = {}
    runs: dict[str, CacheRun] = {}
    for kind in caches:
        kwargs = (cache_kwargs or {}).get(kind, {})

        def make() -> StreamingRollout:
            return StreamingRollout(
                model, cache=kind, guidance=guidance, schedule=schedule, mode=mode, seed=seed,
                instrument=(mode == "eager"), cache_kwargs=kwargs,
            )

        rollout = make()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        tick = (lambda: progress(kind)) if progress is not None else None
        outputs[kind] = two_streams(rollout, chunks, tick)
        stats = rollout.stats
        cache_bytes = rollout.caches.nbytes
        if dev.type == "cuda":
            peak = torch.cuda.max_memory_allocated(dev)
        elif measure_memory:
            cross_bytes = sum(t.nbytes for kv in rollout._cross.values() for t in (*kv.keys, *kv.values))
            # a second stream of the same chunks, profiling only its last (steady) chunk
            probe = make()
            prompt, negative = PROMPTS[0]
            probe.set_prompt(prompt, negative if guidance > 1 else None, seed=1000)
            for _ in range(chunks - 1):
                probe.generate_chunk()
            from streamkv_lab.measure import probe_transient

            transient = probe_transient(probe.generate_chunk, dev, steps=1)
            peak = param_bytes + cache_bytes + cross_bytes + transient.peak_bytes
        else:
            peak = 0
        cond = rollout.caches["cond"]
        runs[kind] = CacheRun(
            kind, stats.per_chunk_latency_ms(), stats.maintenance_per_step_ms(),
            [c.chunk >= first_eviction for c in stats.chunks], int(peak), cache_bytes,
            retains_window=cond.retains_window, extra={} if cond.retains_window else cond.report(),
        )
    first = caches[0]
    ref = outputs[first]
    scale = float(ref.abs().max())
    diffs = {k: float((outputs[k] - ref).abs().max()) for k in caches[1:]}
    return CompareResult(
        config=stream_config(cfg, chunks, guidance=guidance, mode=mode, device=str(dev), seed=seed,
                             schedule=schedule),
        chunks=chunks, runs=runs, max_abs_diff=diffs, output_scale=scale,
    )


def stream_config(cfg, chunks: int, *, guidance: float, mode: str, device: str, seed: int,
                  schedule: Schedule | None) -> dict[str, Any]:
    """The configuration record of :func:`two_streams` runs (JSON)."""
    layout = CacheLayout(sink=cfg.sink_tokens, window=cfg.window_tokens, chunk=cfg.chunk_tokens)
    sched = schedule or Schedule()
    return {
        **cfg.to_dict(), "guidance": guidance, "mode": mode, "device": device, "seed": seed,
        "timesteps": list(sched.timesteps), "shift": sched.shift,
        "streams": [chunks, max(1, chunks // 2)],
        "first_eviction_chunk": layout.first_eviction_chunk(),
        "ring_wraps_first_stream": layout.ring_wraps(chunks * cfg.chunk_tokens),
    }
