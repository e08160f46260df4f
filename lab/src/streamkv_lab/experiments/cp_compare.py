"""The same rollouts on one process and on ``N`` context-parallel ranks.

For every cache kind: the single-process rollout runs here, then ``N`` spawned ranks
(:func:`~streamkv.distributed.launch`) run it with Ulysses context parallelism on the
same weights, prompts and noise seeds. Each stream is two prompts (a reset between):
``chunks`` chunks, then ``chunks // 2``. Reported per cache kind: the largest
difference of the output latents against the single-process run, whether the ranks
agree bitwise, and the K/V cache bytes held by one rank against the single process
(Ulysses: ``1/N``). What ``streamkv rollout --nproc N`` prints and writes; under ``torchrun --nproc-per-node N -m
streamkv_lab.cli rollout ...`` the ranks are torchrun's (``env://``) instead of spawned here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import median
from typing import Any

import torch

from streamkv.distributed import ContextParallel, check_split
from streamkv.distributed.launcher import init_from_env, launch, rank_device
from streamkv_lab.experiments.rollout_compare import stream_config, two_streams
from streamkv.models import CausalVideoDiT, get_config
from streamkv.rollout import Schedule, StreamingRollout

__all__ = ["CPCompareResult", "compare_context_parallel"]


@dataclass
class CPCompareResult:
    """Parity and memory of context-parallel rollouts against one process, per cache kind."""

    config: dict[str, Any]
    world_size: int
    chunks: int
    max_abs_diff: dict[str, float]  # N-rank output vs the single-process output
    output_scale: dict[str, float]  # max |single-process output|
    ranks_agree: dict[str, bool]  # every rank returned the same bytes
    cache_bytes_per_rank: dict[str, int]
    cache_bytes_single: dict[str, int]
    cross_bytes_per_rank: dict[str, int]
    cross_bytes_single: dict[str, int]
    chunk_latency_ms: dict[str, float]  # rank 0, median over chunks
    chunk_latency_ms_single: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "world_size": self.world_size,
            "chunks": self.chunks,
            "max_abs_diff": self.max_abs_diff,
            "output_scale": self.output_scale,
            "max_abs_diff_over_scale": {k: self.max_abs_diff[k] / self.output_scale[k] for k in self.max_abs_diff},
            "ranks_agree": self.ranks_agree,
            "cache_bytes_per_rank": self.cache_bytes_per_rank,
            "cache_bytes_single": self.cache_bytes_single,
            "cache_fraction_per_rank": {
                k: self.cache_bytes_per_rank[k] / self.cache_bytes_single[k] for k in self.cache_bytes_per_rank
            },
            "cross_bytes_per_rank": self.cross_bytes_per_rank,
            "cross_bytes_single": self.cross_bytes_single,
            "chunk_latency_ms": self.chunk_latency_ms,
            "chunk_latency_ms_single": self.chunk_latency_ms_single,
        }


def _run(
    cp: ContextParallel | None, kind: str, config: str, chunks: int, guidance: float, mode: str, device: str,
    seed: int, schedule: Schedule | None, cache_kwargs: dict[str, dict[str, Any]],
    progress: Callable[[], None] | None = None,
) -> dict[str, Any]:
    dev = torch.device(device) if cp is None else rank_device(device, cp)
    model = CausalVideoDiT(get_config(config), seed=seed).to(dev).eval()
    rollout = StreamingRollout(
        model, cache=kind, guidance=guidance, schedule=schedule, mode=mode, seed=seed, cp=cp,
        cache_kwargs=cache_kwargs[kind],
    )
    out = two_streams(rollout, chunks, progress).cpu()
    return {
        "output": out,
        "cache_bytes": rollout.caches.nbytes,
        "cross_bytes": sum(t.nbytes for kv in rollout._cross.values() for t in (*kv.keys, *kv.values)),
        "latency_ms": median(rollout.stats.per_chunk_latency_ms()),
    }


def _rank_runs(cp: ContextParallel, kinds: Sequence[str], *args: Any) -> dict[str, dict[str, Any]]:
    return {kind: _run(cp, kind, *args) for kind in kinds}


def compare_context_parallel(
    caches: Sequence[str] = ("chronological", "ring"),
    *,
    nproc: int = 2,
    config: str = "tiny",
    chunks: int = 8,
    guidance: float = 3.0,
    mode: str = "eager",
    device: str = "cpu",
    seed: int = 0,
    schedule: Schedule | None = None,
    cache_kwargs: dict[str, dict[str, Any]] | None = None,
    progress: Callable[[str], None] | None = None,
    launcher: str = "spawn",
) -> CPCompareResult | None:
    """Run each cache kind on one process and on ``nproc`` ranks; see the module docstring.

    ``cache_kwargs`` maps a cache kind to extra constructor arguments (e.g.
    ``{"mass": {"tau": 0.05}}``); ``progress`` is called with what starts running.

    ``launcher``: ``"spawn"`` starts the ranks here (:func:`~streamkv.distributed.launch`);
    ``"torchrun"`` means this process is one rank of a group ``torchrun`` started
    (``env://``; ``nproc`` is then the group's size): every rank runs the rollouts, rank 0 also
    runs the single-process reference and returns the result, the other ranks return None.

    Raises ``ValueError`` before anything runs if the model's heads or chunk tokens do
    not divide by ``nproc``; ``RuntimeError`` for ``mode="graph"`` with more than one rank.
    """
    if launcher not in ("spawn", "torchrun"):
        raise ValueError(f"launcher must be 'spawn' or 'torchrun', got {launcher!r}")
    cp = None
    if launcher == "torchrun":
        cp = init_from_env(device)
        nproc = cp.world_size
    if not caches:
        raise ValueError("caches must name at least one cache kind")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be an int >= 1, got {nproc!r}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
    if mode == "graph" and nproc > 1:
        raise RuntimeError(
            f"mode='graph' is not supported with context parallelism (nproc={nproc}); use 'eager' or 'compile'"
        )
    cfg = get_config(config)
    check_split(
        heads=cfg.heads, chunk_tokens=cfg.chunk_tokens, world_size=nproc,
        what=f"config {cfg.name!r}: {cfg.frames_per_chunk} frames x {cfg.tokens_per_frame} tokens per chunk",
    )
    kwargs = {k: dict((cache_kwargs or {}).get(k, {})) for k in caches}
    args = (config, chunks, guidance, mode, device, seed, schedule, kwargs)
    single = {}
    if cp is None or cp.rank == 0:
        for kind in caches:
            tick = (lambda k=kind: progress(f"{k} (1 process)")) if progress is not None else None
            single[kind] = _run(None, kind, *args, progress=tick)
    if progress is not None:
        progress(f"{nproc} ranks")
    started = time.perf_counter()
    if cp is None:
        per_rank = launch(_rank_runs, nproc, tuple(caches), *args, device=device)
    else:  # this process is one of the ranks: run, then collect every rank's result on rank 0
        import torch.distributed as dist

        mine = _rank_runs(cp, tuple(caches), *args)
        per_rank = [None] * nproc
        dist.all_gather_object(per_rank, {k: {**v, "output": v["output"].cpu()} for k, v in mine.items()})
        dist.barrier()
        dist.destroy_process_group()  # every rank leaves the group cleanly before it exits
        if cp.rank != 0:
            return None
    wall = time.perf_counter() - started
    first = per_rank[0]
    return CPCompareResult(
        config={
            **stream_config(cfg, chunks, guidance=guidance, mode=mode, device=device, seed=seed, schedule=schedule),
            "parallelism": "ulysses (head-sharded attention, per-rank caches of heads / world_size)",
            "launcher": launcher, "launch_wall_s": wall, "cache_kwargs": kwargs,
        },
        world_size=nproc,
        chunks=chunks,
        max_abs_diff={k: float((first[k]["output"] - single[k]["output"]).abs().max()) for k in caches},
        output_scale={k: float(single[k]["output"].abs().max()) for k in caches},
        ranks_agree={k: all(torch.equal(r[k]["output"], first[k]["output"]) for r in per_rank) for k in caches},
        cache_bytes_per_rank={k: max(r[k]["cache_bytes"] for r in per_rank) for k in caches},
        cache_bytes_single={k: single[k]["cache_bytes"] for k in caches},
        cross_bytes_per_rank={k: max(r[k]["cross_bytes"] for r in per_rank) for k in caches},
        cross_bytes_single={k: single[k]["cross_bytes"] for k in caches},
        chunk_latency_ms={k: first[k]["latency_ms"] for k in caches},
        chunk_latency_ms_single={k: single[k]["latency_ms"] for k in caches},
    )
