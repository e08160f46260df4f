"""The demo's headline: what the ring is for, where history is real.

One attention layer at the ``self-forcing`` preset (Wan2.1-1.3B as Self-Forcing runs it: a
21-frame window of 1,560 tokens per frame, 3-frame chunks, 12 x 128 heads, bf16: a 100 MB K
buffer) per autoregressive step: the current path (clone + shift of the retained window),
flashdreams' ``BlockKVCache`` (the same roll), the ring and the floor (a plain ``copy_`` of the
chunk), timed interleaved, with the bytes each step writes (counted per aten op) and the memory
it allocates (allocator events). Beside it, the tiny DiT (timed interleaved, and as its rollout measured it):
a layer whose history is 96 tokens, where maintenance is a few microseconds either way.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from streamkv_lab.bench.maintenance import measure_maintenance
from streamkv_lab.bench.presets import PRESETS
from streamkv_lab.bench.report import fmt_bytes

__all__ = ["HEADLINE_SUBJECTS", "FLOOR_NOTE", "measure_headline", "print_headline", "draw_maintenance",
           "maintenance_title"]

HEADLINE_SUBJECTS = ("current", "flashdreams", "ring", "floor")
_SHORT = {"current": "current\npath", "flashdreams": "flashdreams", "ring": "ring", "floor": "floor",
          "chronological": "current\npath"}
_COLORS = {"current": "tab:red", "flashdreams": "tab:orange", "ring": "tab:blue", "floor": "0.5",
           "chronological": "tab:red"}
_NAMES = {"current": "current path", "flashdreams": "flashdreams", "ring": "ring", "floor": "floor",
          "chronological": "current path"}


def measure_headline(*, preset: str = "self-forcing", device: str = "cpu", repeats: int = 8,
                     tiny_repeats: int = 200) -> dict[str, Any]:
    """Per-step time (median), bytes written and transient bytes of each subject at ``preset``,
    and the tiny DiT's maintenance (:func:`measure_tiny_layer`, ``tiny_repeats`` rounds)."""
    p = PRESETS[preset]
    r = measure_maintenance(p, device, repeats=repeats, warmup=1, warmup_s=0.1, transient_steps=1)
    rows = {}
    for key in HEADLINE_SUBJECTS:
        if key not in r.stats:
            continue
        counted = r.counted.get(key)
        rows[key] = {
            "ms": r.stats[key].median, "p10_ms": r.stats[key].p10, "p90_ms": r.stats[key].p90,
            "written_bytes": None if counted is None else counted.cache + counted.temporary + counted.metadata,
            "temporary_written_bytes": None if counted is None else counted.temporary,
            "transient_bytes": r.transient[key].allocated_bytes if key in r.transient else None,
            "allocations": r.transient[key].allocations if key in r.transient else None,
        }
    ring = rows["ring"]["ms"]
    out = {
        "preset": p.to_dict(), "repeats": repeats, "threads": torch.get_num_threads(), "subjects": rows,
        "tiny_layer": measure_tiny_layer(repeats=tiny_repeats),
        "ratios": {f"{k}_over_ring": (rows[k]["ms"] / ring if ring else None) for k in rows if k != "ring"},
        "notes": r.notes, "timing": r.timing.to_dict(),
    }
    del r
    gc.collect()
    return out


def measure_tiny_layer(*, config: str = "tiny", repeats: int = 200, forwards: int = 5) -> dict[str, Any]:
    """The tiny DiT's cache maintenance per forward (all its layers), current path against the ring,
    timed interleaved (the rollout times each cache in its own run, so a burst of load elsewhere
    lands on one of them): per chunk ``begin_chunk``, ``forwards`` x layers ``update(k, v, q)``,
    ``commit_chunk``, at the model's cache shapes, one thread."""
    from streamkv.caches import ChronologicalCache, RingCache
    from streamkv_lab.env import threads
    from streamkv_lab.measure import Stats, time_interleaved
    from streamkv.models import get_config

    cfg = get_config(config)
    shape = (1, cfg.sink_tokens + cfg.window_tokens, cfg.heads, cfg.dim // cfg.heads)
    rows = (1, cfg.chunk_tokens, cfg.heads, cfg.dim // cfg.heads)
    steps, keep = {}, []
    g = torch.Generator().manual_seed(0)
    for key, cls in (("current", ChronologicalCache), ("ring", RingCache)):
        cache = cls(shape, shape, seq_dim=1, sink=cfg.sink_tokens, window=cfg.window_tokens, chunk=cfg.chunk_tokens,
                    num_layers=cfg.layers, head_dim=2)
        k, v, q = (torch.randn(rows, generator=g) for _ in range(3))

        def step(cache: Any = cache, k: torch.Tensor = k, v: torch.Tensor = v, q: torch.Tensor = q) -> None:
            c = cache.next_chunk
            cache.begin_chunk(c)
            for _ in range(forwards):
                for layer in range(cfg.layers):
                    cache.update(k, v, q, layer=layer)
            cache.commit_chunk(c)

        for _ in range(cache.layout.first_eviction_chunk() + 2):
            step()
        steps[key], _ = step, keep.append(cache)
    with threads(1), torch.no_grad():
        run = time_interleaved(steps, repeats=repeats, device="cpu", warmup_s=0.5)
    us = {k: Stats.of(v).median * 1e3 / forwards for k, v in run.samples_ms.items()}
    return {"config": config, "forwards_per_chunk": forwards, "layers": cfg.layers, "repeats": repeats,
            "us_per_forward": us, "ring_over_current": us["ring"] / us["current"] if us["current"] else None,
            "timing": run.to_dict()}


def _tiny_rows(rollout: dict[str, Any]) -> dict[str, dict[str, float]]:
    forwards = (len(rollout["config"]["timesteps"]) + 1) * (2 if rollout["config"]["guidance"] > 1 else 1)
    return {k: {"maintenance_us_per_forward": rollout[k]["maintenance_ms"] * 1e3,
                "chunk_ms": rollout[k]["chunk_latency_ms"],
                "share": rollout[k]["maintenance_ms"] * forwards / rollout[k]["chunk_latency_ms"]}
            for k in ("chronological", "ring") if k in rollout}


def print_headline(console: Any, headline: dict[str, Any], rollout: dict[str, Any] | None = None) -> None:
    """The first table of the demo: the Self-Forcing layer, and the tiny DiT beside it."""
    from rich.table import Table

    p = headline["preset"]
    t = Table(title=(f"[b]What the ring is for[/]: one Self-Forcing layer ({p['window_frames']}-frame window of "
                     f"{p['tokens_per_frame']:,} tokens per frame, {p['chunk_frames']}-frame chunks, {p['heads']} x "
                     f"{p['head_dim']} heads, {p['dtype']}: K buffer {fmt_bytes(p['buffer_bytes'])}) per step, "
                     f"beside the tiny DiT (96 tokens of history per layer)"), title_justify="left")
    for col in ("cache", "SF ms/step", "/ ring", "SF written/step", "SF allocated/step", "tiny µs/forward",
                "tiny (rollout)", "tiny share"):
        t.add_column(col, justify="left" if col == "cache" else "right")
    tiny = _tiny_rows(rollout) if rollout else {}
    layer = headline.get("tiny_layer", {}).get("us_per_forward", {})
    ring = headline["subjects"]["ring"]["ms"]
    for key, row in headline["subjects"].items():
        tk = "chronological" if key == "current" else key
        tr = tiny.get(tk)
        t.add_row(
            _NAMES[key], f"{row['ms']:.2f}", f"{row['ms'] / ring:.1f}x" if ring else "-",
            fmt_bytes(row["written_bytes"]), fmt_bytes(row["transient_bytes"]),
            f"{layer[key]:.0f}" if key in layer else "-",
            "-" if tr is None else f"{tr['maintenance_us_per_forward']:.0f}",
            "-" if tr is None else f"{tr['share']:.1%}",
        )
    t.caption = ("current path: the window rolled left (clone + shift); flashdreams: its BlockKVCache (the same roll); "
                 f"floor: one copy_ of the chunk. SF: median of {headline['repeats']} steady steps (each evicts), "
                 f"{headline['threads']} thread(s), interleaved; written = bytes written per step (the chunk, plus "
                 "the roll's retained rows and clone temporaries); allocated = bytes allocated inside the step. tiny: "
                 "cache maintenance per forward of the tiny DiT (all layers; begin and commit spread over the "
                 "forwards), timed interleaved at its cache shapes (one thread), and as its rollout measured it (each "
                 "cache in its own run), with its share of a chunk")
    console.print(t)
    r = headline["ratios"]
    fd = r.get("flashdreams_over_ring")
    console.print(
        f"at the Self-Forcing layer the ring writes the chunk and nothing else: the current path costs "
        f"[b]{r['current_over_ring']:.1f}x[/] the ring's time"
        + (f", flashdreams [b]{fd:.1f}x[/]" if fd else "")
        + f", the ring [b]{headline['subjects']['ring']['ms'] / headline['subjects']['floor']['ms']:.2f}x[/] the floor; "
        f"on the tiny DiT both are a small share of a chunk"
        + (f" (ring / current path [b]{headline['tiny_layer']['ring_over_current']:.2f}x[/] per forward, interleaved)"
           if headline.get("tiny_layer", {}).get("ring_over_current") else "")
    )
    for n in headline.get("notes", []):
        console.print(f"[dim]note: {n}[/]")


#: one line under the maintenance panels: what the subjects are
FLOOR_NOTE = ("floor = one plain copy_ of the new chunk into a preallocated buffer: the least any cache must write per step; "
              "current path = the window rolled left (clone + shift), as Self-Forcing and flashdreams' BlockKVCache do")


def _bar_labels(ax: Any, xs: list[float], values: list[float], texts: list[str]) -> None:
    """A label on every bar, at its top (a 0 bar gets its label on the axis, so it is seen)."""
    top = max(values) if values and max(values) > 0 else 1.0
    for x, v, t in zip(xs, values, texts):
        ax.annotate(t, (x, v), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, top * 1.18)


def draw_maintenance(axes: Any, headline: dict[str, Any]) -> None:
    """Three panels on ``axes``: the Self-Forcing layer's time and bytes per step, the tiny DiT's
    maintenance per forward (timed interleaved); linear axes from zero, every bar labelled with
    its value (a 0-byte bar with "0 B")."""
    keys = list(headline["subjects"])
    names = [_SHORT[k] for k in keys]
    rows = headline["subjects"]
    ax = axes[0]
    ms = [rows[k]["ms"] for k in keys]
    ax.bar(range(len(keys)), ms, color=[_COLORS[k] for k in keys])
    ax.set_xticks(range(len(keys)), names, fontsize=8)
    _bar_labels(ax, list(range(len(keys))), ms, [f"{v:.3g} ms" for v in ms])
    ax.set_ylabel("ms per step")
    ax.set_title("Self-Forcing layer: time per step", fontsize=10)
    ax = axes[1]
    x = list(range(len(keys)))
    w = [(rows[k]["written_bytes"] or 0) / 1e6 for k in keys]
    a = [(rows[k]["transient_bytes"] or 0) / 1e6 for k in keys]
    ax.bar([i - 0.2 for i in x], w, width=0.4, label="written", color=[_COLORS[k] for k in keys])
    ax.bar([i + 0.2 for i in x], a, width=0.4, label="allocated", color=[_COLORS[k] for k in keys], alpha=0.45,
           hatch="//")
    _bar_labels(ax, [i - 0.2 for i in x] + [i + 0.2 for i in x], w + a,
                [fmt_bytes(rows[k]["written_bytes"]) for k in keys]
                + [fmt_bytes(rows[k]["transient_bytes"]) for k in keys])
    for t in ax.texts:
        t.set_fontsize(7)
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylabel("MB per step")
    ax.set_title("Self-Forcing layer: bytes written / allocated per step", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    ax = axes[2]
    layer = headline.get("tiny_layer", {}).get("us_per_forward", {})
    if layer:
        tk = list(layer)
        vals = [layer[k] for k in tk]
        ax.bar(range(len(tk)), vals, color=[_COLORS[k] for k in tk])
        ax.set_xticks(range(len(tk)), [_SHORT[k] for k in tk], fontsize=8)
        _bar_labels(ax, list(range(len(tk))), vals, [f"{v:.0f} µs" for v in vals])
    ax.set_ylabel("µs per forward (all layers)")
    ax.set_title("tiny DiT (96-token history): maintenance per forward", fontsize=10)


def maintenance_title(headline: dict[str, Any]) -> str:
    """The figure's title line: the bytes each step writes on the current path and on the ring."""
    p, rows = headline["preset"], headline["subjects"]
    return (f"one Self-Forcing attention layer ({p['window_frames']}-frame window of {p['tokens_per_frame']:,}-token "
            f"frames): the current path writes {fmt_bytes(rows['current']['written_bytes'])} per step, the ring the "
            f"chunk ({fmt_bytes(rows['ring']['written_bytes'])})")
