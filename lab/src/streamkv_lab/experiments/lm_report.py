"""Tables and the plot of ``streamkv lm-eval`` (:mod:`.lm_eval` results)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from streamkv_lab.plotting import pyplot, save

__all__ = ["print_lm_eval", "plot_lm_eval", "mode_name"]


def mode_name(mode: str, chunk: int, prefill: int | None = None) -> str:
    if mode == "decode":
        return f"token by token (last tokens of each segment, after a {prefill}-token-chunk prefill)"
    return f"chunks of {chunk}" if chunk > 1 else "token by token (whole segment)"


def _modes(result: dict[str, Any]) -> list[tuple[str, int]]:
    return [(e["mode"], e["chunk"]) for e in result["caches"]["full"]]


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x: float | None, ref: float | None) -> str:
    return "-" if x is None or ref is None else f"{100 * (x / ref - 1):+.2f}%"


def print_lm_eval(console: Any, result: dict[str, Any]) -> None:
    """One table per mode (memory x cache), the oracle table, and the targets."""
    from rich.table import Table

    for mode, chunk in _modes(result):
        full = next(e for e in result["caches"]["full"] if (e["mode"], e["chunk"]) == (mode, chunk))
        t = Table(title=f"{mode_name(mode, chunk, result['prefill_chunk'])}: {full['predictions']} predictions. ppl; "
                        f"ppl@filled: on the predictions made at positions >= memory (the full cache's there); "
                        f"attn err: ||o - o_full|| / ||o_full|| per (query, head) vs full-history attention, all "
                        f"layers; resident: mean occupied slots per (layer, head); s: wall seconds of the cache's runs (chunks "
                        f"and token-by-token tail together)")
        for c in ("memory", "cache", "ppl", "vs full", "ppl@filled", "full@filled", "vs full", "err mean",
                  "err p99", "resident", "s"):
            t.add_column(c, justify="left" if c == "cache" else "right", no_wrap=True)
        t.add_row(str(result["segment"]), "full", _f(full["perplexity"]), "", "", "", "",
                  _f(full["attn_error_mean"], ".1e"), _f(full["attn_error_p99"], ".1e"),
                  _f(full["resident_mean"], ".0f"), _f(full["seconds"], ".0f"), end_section=True)
        memories = sorted({e["memory_tokens"] for k, es in result["caches"].items() if k != "full" for e in es})
        for m in memories:
            rows = [(k, e) for k, es in result["caches"].items() if k != "full" for e in es
                    if (e["mode"], e["chunk"], e["memory_tokens"]) == (mode, chunk, m)]
            best = min((e["perplexity"] for _, e in rows), default=None)
            for i, (k, e) in enumerate(rows):
                style = "bold" if e["perplexity"] == best else None
                t.add_row(str(m) if i == 0 else "", k, _f(e["perplexity"]), _pct(e["perplexity"], full["perplexity"]),
                          _f(e["perplexity_evicting"]), _f(e["full_perplexity_evicting"]),
                          _pct(e["perplexity_evicting"], e["full_perplexity_evicting"]),
                          _f(e["attn_error_mean"], ".2e"), _f(e["attn_error_p99"], ".2e"),
                          _f(e["resident_mean"], ".0f"), _f(e["seconds"], ".0f"), style=style,
                          end_section=i == len(rows) - 1)
        console.print(t)
    if result["oracle"]:
        t = Table(title="per-query oracle mass budget (kvbudget seed; full history, sinks and the query's own chunk "
                        "protected): memory = mean kept keys per (query, head), over every query")
        for c in ("mode", "tau", "memory (mean)", "p99", "max", "ppl", "full", "vs full", "attn err mean",
                  "attn err p99", "s"):
            t.add_column(c, justify="right", no_wrap=True)
        for o in result["oracle"]:
            t.add_row(mode_name(o["mode"], o["chunk"], result["prefill_chunk"]).split(" (")[0], f"{o['tau']:g}",
                      _f(o["memory_tokens"], ".1f"), _f(o["memory_p99"], ".0f"), _f(o["memory_max"], ".0f"),
                      _f(o["perplexity"]), _f(o["full_perplexity"]), _pct(o["perplexity"], o["full_perplexity"]),
                      _f(o["attn_error_mean"], ".2e"), _f(o["attn_error_p99"], ".2e"), _f(o["seconds"], ".0f"))
        console.print(t)
    for tg in result["targets"]:
        name = mode_name(tg["mode"], tg["chunk"], result["prefill_chunk"]).split(" (")[0]
        rows = "; ".join(
            f"{r['memory_tokens']}: {r['best']} {_f(r['best_perplexity'])} vs ring {_f(r['ring_perplexity'])} "
            f"({'beats' if r['beats_ring'] else 'does not beat'}), {_pct(r['best_perplexity'], tg['full_perplexity'])} "
            f"vs full" for r in tg["rows"])
        ok = tg["within_2pct_at_25pct_memory"]
        console.print(f"[bold]{name}[/]: best scored policy per memory: {rows}. Within 2% of full at <= 25% memory: "
                      f"{'MET' if ok else 'NOT MET' if ok is not None else 'not measured'} (best ratio "
                      f"{_f(tg['best_ratio_at_25pct_memory'], '.4f')}); beats the ring at every memory: "
                      f"{'yes' if tg['beats_ring_everywhere'] else 'no'}")


def plot_lm_eval(result: dict[str, Any], path: str | Path) -> Path:
    """Perplexity and attention error vs memory, one column per mode; the full cache as a
    dashed line, the oracle at its mean kept keys."""
    plt = pyplot()
    modes = _modes(result)
    fig, axes = plt.subplots(2, len(modes), figsize=(6 * len(modes), 9), squeeze=False)
    for j, (mode, chunk) in enumerate(modes):
        ax, ax_err = axes[0, j], axes[1, j]
        for label, es in result["caches"].items():
            pts = sorted((e["memory_tokens"], e["perplexity"], e["attn_error_mean"]) for e in es
                         if (e["mode"], e["chunk"]) == (mode, chunk))
            if label == "full":
                ax.axhline(pts[0][1], color="k", ls="--", lw=1, label="full")
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            ax_err.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=label)
        for o in result["oracle"]:
            if (o["mode"], o["chunk"]) == (mode, chunk):
                ax.plot([o["memory_tokens"]], [o["perplexity"]], marker="*", ms=14, ls="", color="k")
                ax.annotate(f"oracle tau={o['tau']:g}: {o['memory_tokens']:.0f} kept", (o["memory_tokens"], o["perplexity"]),
                            fontsize=8)
                ax_err.plot([o["memory_tokens"]], [o["attn_error_mean"]], marker="*", ms=14, ls="", color="k")
        ax.set(xscale="log", yscale="log", xlabel="KV memory (tokens per layer and key head)",
               ylabel="perplexity (log scale)", title=mode_name(mode, chunk, result["prefill_chunk"]).split(" (")[0])
        ax_err.set(xscale="log", yscale="log", xlabel="KV memory (tokens per layer and key head)",
                   ylabel="attention error, mean ||o - o_full|| / ||o_full||")
        ax.legend(fontsize=8)
        ticks = sorted({e["memory_tokens"] for k, es in result["caches"].items() if k != "full" for e in es})
        for a in (ax, ax_err):
            a.set_xticks(ticks, [str(t) for t in ticks])
            a.xaxis.set_minor_formatter(plt.matplotlib.ticker.NullFormatter())
    fig.suptitle(f"{result.get('model', {}).get('name', 'model')}: {result['tokens']} tokens in segments of "
                 f"{result['segment']}")
    return save(fig, path)
