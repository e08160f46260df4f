"""The fuzzer's position-map hook: random :class:`~streamkv_lab.experiments.positions_check.MapLayout`
draws over the whole registry (:data:`~streamkv.positions.POSITION_MAPS`: map, its variants,
cache kind, rotary, sizes, occupancy, causal / window masks, grouped queries, LLM spans or chunks,
token-dim layout), each streamed against the float64 whole-history reference
(:func:`~streamkv_lab.experiments.positions_check.run_map_layout`). ``streamkv fuzz --positions N``."""

from __future__ import annotations

import random

from streamkv.caches import CACHE_KINDS
from streamkv_lab.experiments.positions_check import ROTARIES, MapLayout, run_map_layout
from streamkv.positions import POSITION_MAPS

__all__ = ["TOL", "draw_map_layout", "fuzz_maps"]

TOL = 1e-10  # float64 throughout (measured: 2.4e-15 at worst)


def draw_map_layout(rng: random.Random) -> MapLayout:
    name = rng.choice(list(POSITION_MAPS))
    kind = rng.choice(list(CACHE_KINDS))
    rotary = rng.choice(ROTARIES)
    scored = kind not in ("ring", "chronological")
    chunk = rng.randint(1, 4)
    tpu = 2 if rotary == "frame" else 1
    sink = tpu * rng.randint(0, 2)
    window = (2 * chunk if scored else chunk) + rng.randint(0, 6)
    params: tuple = ()
    cut_at = None
    if name == "block_relative":
        if rng.random() < 0.3:
            params = (("anchor", "end"),)
        elif rng.random() < 0.5:
            cut_at = rng.randint(1, 6)
    tokens = kind != "chronological" and rng.random() < 0.4
    causal = tokens or rng.random() < 0.3
    return MapLayout(map=name, kind=kind, rotary=rotary, params=params, sink=sink, window=window, chunk=chunk,
                     heads=rng.randint(1, 3), groups=rng.choice((1, 2)), occupancy=rng.choice((None, "mask")),
                     causal=causal, window_mask=rng.choice((None, rng.randint(1, 6))) if causal else None,
                     spans="tokens" if tokens else "chunks", seq_dim=rng.choice((1, 2)),
                     chunks=rng.randint(3, 12), cut_at=cut_at, seed=rng.randrange(1 << 30))


def fuzz_maps(n: int, rng: random.Random) -> dict:
    """``n`` random map layouts; counts and the worst difference (a mismatch: > :data:`TOL`)."""
    out = {"layouts": 0, "comparisons": 0, "max_abs_diff": 0.0, "mismatches": 0, "maps": {}, "failures": []}
    for _ in range(n):
        lay = draw_map_layout(rng)
        res = run_map_layout(lay)
        out["layouts"] += 1
        out["comparisons"] += res.comparisons
        out["max_abs_diff"] = max(out["max_abs_diff"], res.max_abs_diff)
        out["maps"][lay.map] = out["maps"].get(lay.map, 0) + 1
        if res.max_abs_diff > TOL:
            out["mismatches"] += 1
            if len(out["failures"]) < 5:
                out["failures"].append(f"{lay.name}: {res.max_abs_diff:.3g}")
    return out
