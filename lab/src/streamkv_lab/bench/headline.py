"""The demo's headline: what the ring is for, where history is real.

One attention layer at the ``self-forcing`` preset (Wan2.1-1.3B as Self-Forcing runs it: a
21-frame window of 1,560 tokens per frame, 3-frame chunks, 12 x 128 heads, bf16: a 100 MB K
buffer) per autoregressive step: the current path (clone + shift of the retained window),
flashdreams' ``BlockKVCache`` (the same roll), the ring and the floor (a plain ``copy_`` of the
chunk), timed interleaved, with the bytes each step writes (counted per aten op) and the memory
it allocates (allocator events). Beside it, the tiny DiT's rollout (the demo's second table):
a layer whose history is 96 tokens, where maintenance is a few microseconds either way.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch

from streamkv_lab.bench.maintenance import measure_maintenance
from streamkv_lab.bench.presets import PRESETS
from streamkv_lab.bench.report import fmt_bytes

__all__ = ["HEADLINE_SUBJECTS", "measure_headline", "print_headline", "plot_headline"]

HEADLINE_SUBJECTS = ("current", "flashdreams", "ring", "floor")
_SHORT = {"current": "current\npath", "flashdreams": "flashdreams", "ring": "ring", "floor": "floor",
          "chronological": "current\npath"}
_NAMES = {"current": "current path (chronological)", "flashdreams": "flashdreams BlockKVCache",
          "ring": "ring", "floor": "floor (copy_ of the chunk)", "chronological": "current path (chronological)"}


def measure_headline(*, preset: str = "self-forcing", device: str = "cpu", repeats: int = 8) -> dict[str, Any]:
    """Per-step time (median), bytes written and transient bytes of each subject at ``preset``."""
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
        "tiny_layer": measure_tiny_layer(),
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
    t.caption = (f"SF: median of {headline['repeats']} steady steps (each evicts), {headline['threads']} thread(s), "
                 "interleaved; written = bytes written per step (the chunk, plus the roll's retained rows and clone "
                 "temporaries); allocated = bytes allocated inside the step. tiny: cache maintenance per forward of the "
                 "tiny DiT (all layers; begin and commit spread over the forwards), timed interleaved at its cache "
                 "shapes (one thread), and as the rollout below measured it (each cache in its own run), with its "
                 "share of a chunk")
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


def plot_headline(headline: dict[str, Any], rollout: dict[str, Any] | None, path: str | Path) -> Path:
    """Three panels: the Self-Forcing layer's time and bytes per step, the tiny DiT's maintenance."""
    from streamkv_lab.plotting import pyplot, save

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    keys = list(headline["subjects"])
    names = [_SHORT[k] for k in keys]
    colors = {"current": "tab:red", "flashdreams": "tab:orange", "ring": "tab:blue", "floor": "0.5",
              "chronological": "tab:red"}
    rows = headline["subjects"]
    ax = axes[0]
    ax.bar(names, [rows[k]["ms"] for k in keys], color=[colors[k] for k in keys])
    ax.set_yscale("log")
    ax.set_ylim(min(rows[k]["ms"] for k in keys) / 2, max(rows[k]["ms"] for k in keys) * 2)
    ax.set_ylabel("ms per step (log)")
    ax.set_title("Self-Forcing layer: time per AR step")
    for i, k in enumerate(keys):
        ax.annotate(f"{rows[k]['ms']:.1f}", (i, rows[k]["ms"]), ha="center", va="bottom", fontsize=8)
    ax = axes[1]
    x = range(len(keys))
    w = [(rows[k]["written_bytes"] or 0) / 1e6 for k in keys]
    a = [(rows[k]["transient_bytes"] or 0) / 1e6 for k in keys]
    ax.bar([i - 0.2 for i in x], w, width=0.4, label="written", color=[colors[k] for k in keys])
    ax.bar([i + 0.2 for i in x], a, width=0.4, label="allocated", color=[colors[k] for k in keys], alpha=0.45,
           hatch="//")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("MB per step")
    ax.set_title("Self-Forcing layer: bytes written / allocated per step")
    ax.legend(fontsize=8)
    ax = axes[2]
    layer = headline.get("tiny_layer", {}).get("us_per_forward", {})
    if layer:
        tk = list(layer)
        ax.bar([_SHORT[k] for k in tk], [layer[k] for k in tk], color=[colors[k] for k in tk])
        share = _tiny_rows(rollout) if rollout else {}
        for i, k in enumerate(tk):
            sh = share.get("chronological" if k == "current" else k)
            ax.annotate(f"{layer[k]:.0f} µs" + (f" ({sh['share']:.0%} of a chunk)" if sh else ""), (i, layer[k]),
                        ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("µs per forward (all layers)")
    ax.set_title("tiny DiT (96 tokens of history): maintenance, interleaved")
    p = headline["preset"]
    fig.suptitle(f"what the ring is for: a {p['window_frames']}-frame window of {p['tokens_per_frame']:,}-token "
                 f"frames moves {fmt_bytes(rows['current']['written_bytes'])} per step on the current path, the "
                 f"chunk ({fmt_bytes(rows['ring']['written_bytes'])}) on the ring", fontsize=10)
    fig.tight_layout()
    return save(fig, path, dpi=110)
