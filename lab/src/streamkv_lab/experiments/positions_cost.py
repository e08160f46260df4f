"""What rotation at read costs, as ratios measured in one run (interleaved rounds).

Per preset (:mod:`streamkv_lab.bench.presets`: the self-forcing and lingbot layers), one head of
the layer (every cost here is linear in the heads) in the preset's dtype, the cache full (steady
state), the open chunk's queries (the preset's whole chunk of tokens) reading it:

``prerotated``          SDPA over the ring's physical buffer of keys rotated at write (what runs
                        today with RoPE at write)
``rope_at_write``       rotating the chunk's queries and keys at their stream positions (Wan's 3D
                        RoPE): the per-pass work RoPE at write adds
``rotate_at_read``      the ring holding raw keys, ``cache_relative`` map: map evaluation on the
                        device, queries rotated once, keys rotated a block at a time inside the
                        key-blocked attention (:mod:`streamkv.rope_at_read`)
``keyblocked``          the same key-blocked attention over pre-rotated keys (the blocking alone)
``rotate_at_read / keyblocked`` is the rotation's own cost inside the blocks; ``keyblocked /
prerotated`` the cost of reading in blocks (one fused kernel call per block, merged by log-sum-exp)
instead of one SDPA call.

``chronological``       the current path for cache-relative RoPE: keys gathered in position
                        order, the whole window rotated by index (``rope_mode="cache_relative"``),
                        SDPA; plus its roll (``begin_chunk`` clones and shifts the window), charged
                        per read as ``roll / reads_per_chunk`` (4 denoising steps + the clean pass)

Transient memory per read (the torch profiler's allocator events on the CPU, peak above what was
in use): rotation at read against the chronological path's gathered, rotated copy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from streamkv.attention import attend
from streamkv.blockread import read_blocks
from streamkv.caches import ChronologicalCache, RingCache
from streamkv_lab.bench.presets import get_preset
from streamkv_lab.measure.memory import probe_transient
from streamkv_lab.measure.timing import Stats, time_interleaved
from streamkv.rope import Rope3D
from streamkv.rope_at_read import RopeAtRead
from streamkv.rotary import FrameRope

__all__ = ["COST_PRESETS", "read_cost"]

COST_PRESETS = ("self-forcing", "lingbot")
READS_PER_CHUNK = 5


def _grid(tpf: int) -> tuple[int, int]:
    return (tpf // 52, 52) if tpf % 52 == 0 else (1, tpf)


def read_cost(preset: str, *, repeats: int = 3, block: int = 16384, queries: int | None = None,
              memory: bool = True) -> dict[str, Any]:
    """Time the subjects of the module docstring at ``preset``; returns ms, ratios and bytes."""
    p = get_preset(preset)
    dtype, tpf, D = p.torch_dtype, p.tokens_per_frame, p.head_dim
    gh, gw = _grid(tpf)
    rope3d = Rope3D(D, gh, gw, max_frames=1 << 16)
    cap, chunk, sink = p.capacity, p.chunk, p.sink
    shape = (1, cap, 1, D)
    kw = dict(seq_dim=1, sink=sink, window=p.window, chunk=chunk, dtype=dtype)
    raw = RingCache(shape, shape, **kw, rope_at_read=RopeAtRead(FrameRope(rope3d), "cache_relative", block=block))
    rot = RingCache(shape, shape, **kw)
    chrono = ChronologicalCache(shape, shape, **kw)
    g = torch.Generator().manual_seed(0)
    n_chunks = cap // chunk + 2
    for c in range(n_chunks):  # fill to the steady state (every chunk evicts from here on)
        k, v = (torch.randn(1, chunk, 1, D, generator=g).to(dtype) for _ in range(2))
        pos = torch.arange(c * chunk, (c + 1) * chunk)
        cos, sin = rope3d.cos_sin(pos, dtype)
        kr = Rope3D.rotate(k, cos.unsqueeze(1), sin.unsqueeze(1))
        for cache, kk in ((raw, k), (rot, kr), (chrono, k)):
            cache.begin_chunk(c)
            cache.write(kk, v)
            if c < n_chunks - 1:
                cache.commit_chunk(c)
    nq = chunk if queries is None else queries
    q = torch.randn(1, nq, 1, D, generator=g).to(dtype)
    last = n_chunks - 1
    qpos = torch.arange(last * chunk, last * chunk + nq)
    qcos, qsin = rope3d.cos_sin(qpos, dtype)
    q_abs = Rope3D.rotate(q, qcos.unsqueeze(1), qsin.unsqueeze(1))
    k_chunk = torch.randn(1, chunk, 1, D, generator=g).to(dtype)
    wpos = torch.arange(last * chunk, (last + 1) * chunk)
    wcos, wsin = (t.unsqueeze(1) for t in rope3d.cos_sin(wpos, dtype))
    read_raw, read_rot, read_chrono = raw.read(), rot.read(), chrono.read()
    if queries is not None:  # a slice of the chunk's queries: the reads' query positions follow
        read_raw = dataclasses.replace(read_raw, query_positions=read_raw.query_positions[:nq])
    # the pre-rotated read through the block loop (what rotating at read adds to it is the rotation alone)
    q_blocked, blocked = read_rot.block_plan(read_rot.dims.attention(q_abs), scale=D**-0.5, block=block)
    n = read_chrono.num_retained
    rel_cos, rel_sin = (t.unsqueeze(1) for t in rope3d.cos_sin(torch.arange(n), dtype))
    q_rel = Rope3D.rotate(q, rel_cos[n - chunk:n - chunk + nq], rel_sin[n - chunk:n - chunk + nq])

    steps = {
        "prerotated": lambda: attend(q_abs, read_rot),
        "rope_at_write": lambda: (Rope3D.rotate(q_abs, wcos[:nq], wsin[:nq]), Rope3D.rotate(k_chunk, wcos, wsin)),
        "rotate_at_read": lambda: attend(q, read_raw),
        "keyblocked": lambda: read_blocks(q_blocked, blocked),
        "chronological": lambda: attend(q_rel, read_chrono, rope_mode="cache_relative",
                                        key_transform=lambda kc: Rope3D.rotate(kc, rel_cos[:, 0], rel_sin[:, 0])),
    }
    run = time_interleaved(steps, repeats=repeats, device="cpu", warmup=1, warmup_s=0.0, max_rounds_factor=1)
    ms = {k: Stats.of(v).median for k, v in run.samples_ms.items()}
    roll_ms = _time_roll(chrono, chunk, D, dtype)
    # the roll moved the chronological cache on (begins and commits): its read above is stale, so
    # read it again; _time_roll leaves it as it found it (full, the next chunk open and written),
    # so the same queries at the same cache-relative positions read it
    read_chrono = chrono.read()
    assert read_chrono.num_retained == n, (read_chrono.num_retained, n)
    steps["chronological"] = lambda: attend(q_rel, read_chrono, rope_mode="cache_relative",
                                            key_transform=lambda kc: Rope3D.rotate(kc, rel_cos[:, 0], rel_sin[:, 0]))
    chrono_read = ms["chronological"] + roll_ms / READS_PER_CHUNK
    out: dict[str, Any] = {
        "preset": preset, "heads_measured": 1, "heads_in_preset": p.heads, "dtype": p.dtype, "slots": cap,
        "queries": nq, "head_dim": D, "block_slots": block, "ms": {**ms, "chronological_roll_per_chunk": roll_ms},
        "ratios": {
            "rotate_at_read_vs_prerotated": ms["rotate_at_read"] / ms["prerotated"],
            "rotate_at_read_vs_rope_at_write": ms["rotate_at_read"] / (ms["prerotated"] + ms["rope_at_write"]),
            "rotate_at_read_vs_chronological_rerotate": ms["rotate_at_read"] / chrono_read,
            "keyblocked_vs_prerotated": ms["keyblocked"] / ms["prerotated"],
            "rotate_at_read_vs_keyblocked": ms["rotate_at_read"] / ms["keyblocked"],
        },
        "target": "rotate_at_read_vs_prerotated <= 1.3",
        "timing": {"rounds": run.rounds, "clean": run.clean, "contended": run.contended,
                   "foreign_load": run.foreign_load},
    }
    out["target_met"] = out["ratios"]["rotate_at_read_vs_prerotated"] <= 1.3
    if memory:
        tr = probe_transient(lambda: attend(q, read_raw), "cpu", steps=1)
        tc = probe_transient(steps["chronological"], "cpu", steps=1)
        elem = torch.tensor([], dtype=dtype).element_size()
        out["transient_bytes"] = {
            "rotate_at_read_peak": tr.peak_bytes, "chronological_peak": tc.peak_bytes,
            "rotated_history_copy": cap * D * elem, "one_block_keys": block * D * elem,
            "scores_per_block_float32": nq * block * 4,
        }
    return out


def _time_roll(chrono: ChronologicalCache, chunk: int, D: int, dtype: torch.dtype, repeats: int = 3) -> float:
    """Median ms of the chronological path's steady ``begin_chunk`` (clone + shift of the window).
    The cache moves on by ``repeats + 2`` chunks and is left as it was found: full, with the next
    chunk open and written (reads taken before are stale: read again)."""
    import time

    end = chrono.end
    times = []
    k = torch.zeros(1, chunk, 1, D, dtype=dtype)
    c = end // chunk
    if chrono.is_open:
        chrono.commit_chunk(c - 1)
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        chrono.begin_chunk(c)
        times.append((time.perf_counter() - t0) * 1e3)
        chrono.write(k, k)
        chrono.commit_chunk(c)
        c += 1
    chrono.begin_chunk(c)
    chrono.write(k, k)
    times = sorted(times[1:])
    return times[len(times) // 2] if times else math.nan
