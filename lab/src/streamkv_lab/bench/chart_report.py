"""``streamkv chart``: the document (one row per shape, cache configuration and mode), the issue's
targets evaluated from it, the tables and the plot (time per chunk against error)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from streamkv_lab.bench.report import fmt_bytes

__all__ = ["ROW_KEYS", "CHART_TARGETS", "flat_rows", "evaluate_chart_targets", "print_chart", "plot_chart"]

#: every key of a row of the document's ``rows`` (None where it does not apply or was not measured)
ROW_KEYS = ("shape", "key", "cache", "format", "budget", "budget_kind", "budget_fraction", "mode", "ms_per_chunk",
            "p10_ms", "p90_ms", "ms_per_chunk_per_layer", "ratio_to_full", "tokens", "bytes", "bytes_ratio_to_full",
            "cache_work_ms", "cache_work_ratio_to_ring", "loaded_ratio_to_full", "load_slowdown",
            "host_syncs_per_chunk", "allocations_per_chunk",
            "alloc_bytes_per_chunk", "allocator_events_per_chunk", "recompiles", "error_stream", "error_mean",
            "error_p99", "rel_error_mean", "rel_error_p99", "error_tokens", "error_bytes_ratio_to_full", "not_run")

#: (name, what, row pattern ("{kind}": every one of ``kinds``; "{fmt}": every tier format run), value,
#: threshold, kinds, shapes (None: every shape)) -- the issue's targets, at a quarter of the full cache
CHART_TARGETS: tuple[tuple[str, str, str, str, float, tuple[str, ...], tuple[str, ...] | None], ...] = (
    ("scored_quarter", "TOVA and H2O at 1/4 of the tokens <= 0.4x the full cache's time per chunk",
     "{kind}/bf16/tokens:1/4", "ratio_to_full", 0.4, ("tova", "h2o"), None),
    ("int8_ring_quarter", "the int8 ring at 1/4 of the tokens <= 0.45x the full cache's time per chunk",
     "ring/int8/tokens:1/4", "ratio_to_full", 0.45, (), None),
    ("int8_tova_quarter", "int8 TOVA at 1/4 of the tokens <= 0.5x the full cache's time per chunk",
     "tova/int8/tokens:1/4", "ratio_to_full", 0.5, (), None),
    ("tier_quarter", "the compressed tier at 1/4 of the bytes, no certificates, <= 1.0x the full cache's time per chunk",
     "tier/{fmt}/bytes:1/4", "ratio_to_full", 1.0, (), None),
    ("tier_quarter_certified", "the compressed tier at 1/4 of the bytes with certificates <= 1.5x the full cache's",
     "tier+certificates/{fmt}/bytes:1/4", "ratio_to_full", 1.5, (), None),
    ("loaded", "under load (processes spinning on the CPUs: --load), TOVA and H2O, the int8 ring and int8 TOVA at 1/4 "
     "of the tokens: the ratio to the full cache <= 1.5x the quiet ratio", "{kind}/tokens:1/4", "load_slowdown", 1.5,
     ("tova/bf16", "h2o/bf16", "ring/int8", "tova/int8"), None),
    ("cache_work", "each scored kind's cache work per chunk (begin + writes + scores + commit, no attention) <= 1.5x "
     "the ring's, at the self-forcing shape (bf16, at each token budget)", "{kind}/bf16/{budget}",
     "cache_work_ratio_to_ring", 1.5, ("{scored}",), ("self-forcing",)),
)


def flat_rows(shapes: dict[str, Any], errors: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (shape, row, mode) with every key of :data:`ROW_KEYS`: the timed record and the
    error of its stream at the same budget."""
    out = []
    for name, rec in shapes.items():
        err_rows = errors.get(rec["error_stream"], {}).get("rows", {})
        for key, r in rec["rows"].items():
            e = err_rows.get(key, {})
            for mode in rec["modes"]:
                m = r.get(mode) or {}
                row = {k: None for k in ROW_KEYS}
                row.update({k: r.get(k) for k in ("key", "cache", "format", "budget", "budget_kind", "budget_fraction",
                                                 "tokens", "bytes", "bytes_ratio_to_full", "cache_work_ms",
                                                 "cache_work_ratio_to_ring")})
                if mode != "eager":
                    row["cache_work_ms"] = row["cache_work_ratio_to_ring"] = None
                row.update({k: m.get(k) for k in ("ms_per_chunk", "p10_ms", "p90_ms", "ms_per_chunk_per_layer",
                                                 "ratio_to_full", "loaded_ratio_to_full", "load_slowdown",
                                                 "host_syncs_per_chunk", "allocations_per_chunk",
                                                 "alloc_bytes_per_chunk", "allocator_events_per_chunk", "recompiles")})
                row.update(shape=name, mode=mode, error_stream=rec["error_stream"],
                           not_run=r.get("not_run") or m.get("not_run"))
                row.update({k: e.get(k) for k in ("error_mean", "error_p99", "rel_error_mean", "rel_error_p99")})
                row.update(error_tokens=e.get("tokens"), error_bytes_ratio_to_full=e.get("bytes_ratio_to_full"))
                if e.get("not_run") and not row["not_run"]:
                    row["not_run"] = f"error stream: {e['not_run']}"
                out.append(row)
    return out


def evaluate_chart_targets(rows: list[dict[str, Any]], scored: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every target of :data:`CHART_TARGETS` at every shape and mode the rows hold: value,
    threshold, met (None: not measured, with the reason)."""
    by = {(r["shape"], r["mode"], r["key"]): r for r in rows}
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fmts = sorted({r["format"] for r in rows if r["cache"] == "tier"})
    budgets = sorted({r["budget"] for r in rows if r["budget_kind"] == "tokens"}) or ["tokens:1/4"]
    out = []
    for name, text, pattern, value, threshold, kinds, where in CHART_TARGETS:
        kinds = scored if kinds == ("{scored}",) else kinds
        keys = ([pattern.format(kind=k, budget=b) for k in kinds for b in (budgets if "{budget}" in pattern else [""])]
                if "{kind}" in pattern else
                [pattern.format(fmt=f) for f in fmts] if "{fmt}" in pattern else [pattern])
        for shape in shapes + [w for w in where or () if w not in shapes]:
            if where is not None and shape not in where:
                continue
            for mode in modes:
                if value in ("cache_work_ratio_to_ring", "load_slowdown") and mode != "eager":
                    continue  # measured eagerly only
                for key in keys:
                    r = by.get((shape, mode, key))
                    v = None if r is None else r[value]
                    why = None
                    if v is None:
                        why = (f"no {shape} shape in this run" if shape not in shapes else "not in this run"
                               if r is None else (r["not_run"] or ("not timed under load (--load N)"
                                                                   if value == "load_slowdown" else "not measured")))
                    out.append({"target": name, "text": text, "shape": shape, "mode": mode, "row": key, "value": v,
                                "threshold": threshold, "met": None if v is None else v <= threshold,
                                "why_not_measured": why})
    return out


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def print_chart(doc: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    for name, rec in doc["shapes"].items():
        sh, tm = rec["shape"], rec["timing"]
        rows = [r for r in doc["rows"] if r["shape"] == name]
        modes = rec["modes"]
        loaded = any(r["load_slowdown"] is not None for r in rows)
        t = Table(title=f"[b]chart at {name}[/]: attention + cache work per chunk, one layer ({sh['heads']} of "
                        f"{sh['model_heads']} kv heads x {sh['head_dim']}, span {sh['span']:,}, full cache "
                        f"{sh['capacity']:,} tokens); error: {rec['error_stream']} stream", title_justify="left")
        for col in ("row", "tokens", "bytes/full", *[f"{m} ms" for m in modes], *[f"{m} /full" for m in modes],
                    *(("loaded /full", "load slowdown") if loaded else ()),
                    "work/ring", "syncs", "allocs", "rel err mean", "rel err p99"):
            t.add_column(col, justify="left" if col == "row" else "right", no_wrap=True)
        skipped: list[str] = []
        for key in rec["rows"]:
            rs = {r["mode"]: r for r in rows if r["key"] == key}
            first = rs[modes[0]]
            if first["not_run"] and all(rs[m]["ms_per_chunk"] is None for m in modes):
                skipped.append(f"{key}: {first['not_run']}")
                continue
            t.add_row(key, _f(first["tokens"], ",d") if first["tokens"] is not None else "-",
                      _f(first["bytes_ratio_to_full"]),
                      *[_f(rs[m]["ms_per_chunk"], ".3g") if rs[m]["ms_per_chunk"] is not None else
                        "[dim]not run[/]" for m in modes],
                      *[_f(rs[m]["ratio_to_full"]) for m in modes],
                      *((_f(rs["eager"]["loaded_ratio_to_full"]), _f(rs["eager"]["load_slowdown"])) if loaded else ()),
                      _f(first["cache_work_ratio_to_ring"]),
                      "/".join(_f(rs[m]["host_syncs_per_chunk"], "d") if rs[m]["host_syncs_per_chunk"] is not None
                               else "-" for m in modes),
                      "/".join(_f(rs[m]["allocations_per_chunk"], "d") if rs[m]["allocations_per_chunk"] is not None
                               else "-" for m in modes),
                      _f(first["rel_error_mean"], ".2e"), _f(first["rel_error_p99"], ".2e"))
        load = tm.get("foreign_cpu_share")
        t.caption = (f"{sh['description']}. median of {tm['repeats']} interleaved rounds; /full: over full/bf16/all in "
                     f"the same mode; work/ring: cache work without attention over the ring's at the same format and "
                     f"budget; syncs, allocs: host syncs and allocations per steady chunk ({'/'.join(modes)}). load: "
                     f"other processes used {'-' if load is None else f'{load:.0%}'} of the CPUs; load average "
                     f"{tm.get('load_average_before')} -> {tm.get('load_average_after')}, {tm['threads']} thread(s)"
                     + (f"; loaded /full: the eager chunks again with {tm['load_processes']} process(es) spinning on "
                        f"the CPUs, load slowdown: that ratio over the quiet one" if loaded else ""))
        console.print(t)
        skipped += [f"{r['key']} {r['mode']}: {r['not_run']}" for r in rows
                    if r["ms_per_chunk"] is None and r["not_run"] and not any(x.startswith(r["key"] + ":") for x in skipped)]
        for line in skipped:
            console.print(f"  [dim]not run at {name}: {line}[/]")
    console.print("[b]targets[/] (verdicts computed from the measured ratios):")
    seen = set()
    for x in doc["targets"]:
        if x["target"] not in seen:
            seen.add(x["target"])
            console.print(f"  {x['text']}:")
        v = "not measured: " + x["why_not_measured"] if x["met"] is None else (
            f"{x['value']:.2f}x -> {'met' if x['met'] else 'NOT met'}")
        console.print(f"    {x['shape']} {x['mode']} {x['row']}: {v}")


_MARKERS = {"bf16": "o", "int8": "s", "int4": "^", "fp8": "D", "int2": "v"}


def plot_chart(doc: dict[str, Any], path: str | Path) -> Path:
    """One panel per shape: ms per chunk (x, log) against the mean relative error (y, log), one
    point per cache configuration (colour: cache; marker: format; size: budget; hollow: compiled)."""
    from streamkv_lab.plotting import pyplot, save

    plt = pyplot()
    shapes = list(doc["shapes"])
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 5.0), squeeze=False)
    caches = list(dict.fromkeys(r["cache"] for r in doc["rows"]))
    cmap = plt.get_cmap("tab10" if len(caches) <= 10 else "tab20")
    colors = {c: cmap(i % cmap.N) for i, c in enumerate(caches)}
    for ax, name in zip(axes[0], shapes):
        for r in doc["rows"]:
            if r["shape"] != name or r["ms_per_chunk"] is None or not r["rel_error_mean"]:
                continue
            size = 70 if r["budget"] is None else 70 * (r["budget_fraction"] or 1) ** 0.5
            filled = r["mode"] == "eager"
            ax.scatter(r["ms_per_chunk"], r["rel_error_mean"], s=size, marker=_MARKERS.get(r["format"], "o"),
                       facecolors=colors[r["cache"]] if filled else "none", edgecolors=colors[r["cache"]],
                       linewidths=1.0, alpha=0.85)
        full = next((r["ms_per_chunk"] for r in doc["rows"] if r["shape"] == name and r["key"] == "full/bf16/all"
                     and r["mode"] == "eager"), None)
        if full:
            ax.axvline(full, color="0.6", ls=":", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("ms per chunk and layer (attention + cache work; log)")
        ax.set_ylabel("mean attention error / value range (log)")
        rec = doc["shapes"][name]
        ax.set_title(f"{name} (error: {rec['error_stream']} stream)", fontsize=9)
    handles = [plt.Line2D([], [], marker="o", ls="", color=colors[c], label=c) for c in caches]
    handles += [plt.Line2D([], [], marker=_MARKERS.get(f, "o"), ls="", color="0.3", label=f)
                for f in dict.fromkeys(r["format"] for r in doc["rows"])]
    handles += [plt.Line2D([], [], marker="o", ls="", markerfacecolor="none", color="0.3", label="compiled (hollow)")]
    axes[0][-1].legend(handles=handles, loc="best", fontsize=6, framealpha=0.7)
    fig.suptitle("time per chunk against error\n(dotted: the full bf16 cache)", fontsize=9)
    return save(fig, path)
