"""``streamkv demo``'s summary table and figure, both drawn from the demo's JSON document (so the
numbers on screen, on the figure and in ``demo.json`` are the same run's).

The document (``doc``): ``headline`` (:func:`~streamkv_lab.bench.headline.measure_headline`),
``rollout`` (the tiny DiT's current path and ring, :func:`~streamkv_lab.experiments.rollout_compare.compare_rollouts`),
``quality`` (:func:`~streamkv_lab.experiments.demo_quality.quarter_quality`, or ``{"skipped": why}``),
``fork`` (:func:`~streamkv_lab.video.fork.fork_video`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["TABLE_COLUMNS", "summary_rows", "print_summary", "print_quality", "plot_demo"]

TABLE_COLUMNS = ("what", "streamkv", "compared with", "ratio")
_QNAMES = {"full": "full cache", "ring": "ring", "tova": "TOVA", "compressed_tier": "compressed tier"}


def _x(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f} MiB" if x >= 2**20 else f"{x / 2**10:.0f} KiB"


def summary_rows(doc: dict[str, Any]) -> list[list[str]]:
    """The rows of the demo's closing table (:data:`TABLE_COLUMNS`), each cell formatted from a
    number of ``doc``; the ratio is the other cache's over streamkv's (higher: streamkv better)."""
    from streamkv_lab.bench.report import fmt_bytes

    h = doc["headline"]["subjects"]
    ring = h["ring"]
    rows = [["Self-Forcing layer: ms per step", f"ring {ring['ms']:.2f} ms",
             f"current path {h['current']['ms']:.2f} ms", _x(h["current"]["ms"], ring["ms"])]]
    if "flashdreams" in h:
        rows.append(["", f"ring {ring['ms']:.2f} ms", f"flashdreams {h['flashdreams']['ms']:.2f} ms",
                     _x(h["flashdreams"]["ms"], ring["ms"])])
    rows.append(["", f"ring {ring['ms']:.2f} ms", f"floor {h['floor']['ms']:.2f} ms",
                 f"ring = {ring['ms'] / h['floor']['ms']:.2f}x the floor"])
    rows.append(["Self-Forcing layer: written per step", f"ring {fmt_bytes(ring['written_bytes'])}",
                 f"current path {fmt_bytes(h['current']['written_bytes'])}",
                 _x(h["current"]["written_bytes"] or 0, ring["written_bytes"] or 0)])
    rows.append(["Self-Forcing layer: allocated per step", f"ring {fmt_bytes(ring['transient_bytes'])}",
                 f"current path {fmt_bytes(h['current']['transient_bytes'])}",
                 _x(h["current"]["transient_bytes"] or 0, ring["transient_bytes"] or 0)])
    tiny = doc["headline"].get("tiny_layer", {}).get("us_per_forward", {})
    if tiny:
        rows.append(["tiny DiT: maintenance per forward", f"ring {tiny['ring']:.0f} µs",
                     f"current path {tiny['current']:.0f} µs", _x(tiny["current"], tiny["ring"])])
    ro = doc["rollout"]
    rows.append(["tiny DiT: ring output vs current path", "max |diff| / scale",
                 f"{ro['max_abs_diff']['ring']:.3g} / {ro['output_scale']:.3g}",
                 f"{ro['max_abs_diff']['ring'] / ro['output_scale']:.2e} (bound 1e-5)"])
    q = doc["quality"]
    if "skipped" in q:
        rows.append(["quality at a quarter of the memory", "not run", q["skipped"], "-"])
    else:
        c = q["caches"]
        what = "SmolLM2 at 1/4 memory: mean error"
        tier = c["compressed_tier"]
        for other in ("tova", "ring"):
            if "error_mean" in tier and "error_mean" in c[other]:
                rows.append([what, f"compressed tier {tier['error_mean']:.4f}",
                             f"{_QNAMES[other]} {c[other]['error_mean']:.4f}",
                             _x(c[other]["error_mean"], tier["error_mean"])])
                what = ""
        if "ms_per_chunk" in tier and "ms_per_chunk" in c["tova"]:  # what the tier costs, on this CPU
            rows.append(["SmolLM2 at 1/4 memory: ms per chunk", f"compressed tier {tier['ms_per_chunk']:.1f} ms",
                         f"TOVA {c['tova']['ms_per_chunk']:.1f} ms", _x(c["tova"]["ms_per_chunk"], tier["ms_per_chunk"])])
        if "violations" in tier and tier["violations"] is not None:
            rows.append(["compressed tier: its bound broken", f"{tier['violations']}", "", ""])
    f = doc["fork"]
    m, n = f["memory"], len(f["branches"])
    after = m["one_chunk_after"]
    rows.append([f"fork: {n} branches, 1 chunk after", f"pool {_mib(after['pool_bytes_in_use'])}",
                 f"{n + 1} full copies {_mib(after['full_copies_bytes'])}",
                 _x(after["full_copies_bytes"], after["pool_bytes_in_use"])])
    rows.append(["fork: branches vs unforked runs", "max |diff|", f"{f['max_abs_diff_vs_unforked']:.3g}",
                 ""])
    return rows


def print_summary(console: Any, doc: dict[str, Any]) -> None:
    """The closing table: ``doc["table"]`` (written by the caller from :func:`summary_rows`)."""
    from rich.markup import escape
    from rich.table import Table

    t = Table(title="[b]what streamkv buys, measured in this run[/] (ratio: the other cache's over streamkv's)",
              title_justify="left")
    for col in TABLE_COLUMNS:
        t.add_column(col, justify="left" if col == "what" else "right", overflow="fold")
    for row in doc["table"]:
        t.add_row(*map(escape, row))  # a cell is text: "[real]" in a pip line is not markup
    console.print(t)


def print_quality(console: Any, q: dict[str, Any]) -> None:
    """The quality section's table (or the line saying why it was skipped)."""
    from rich.markup import escape
    from rich.table import Table

    if "skipped" in q:
        console.print(f"[bold]quality at a quarter of the memory[/]: skipped ({escape(q['skipped'])})")
        return
    d = q["dataset"]
    t = Table(title=(f"[b]quality at a quarter of the memory[/]: SmolLM2-135M's own attention, {q['tokens']} tokens "
                     f"of text, layers {d.get('layers')}, chunks of {q['chunk']}; error vs float64 full-history "
                     "attention"),
              title_justify="left")
    for col in ("cache", "device KiB", "err mean", "err p99", "rel mean", "ms/chunk", "bound broken"):
        t.add_column(col, justify="left" if col == "cache" else "right")
    for name, c in q["caches"].items():
        if "skipped" in c:
            t.add_row(_QNAMES[name], "-", "-", "-", "-", "-", escape(f"not run: {c['skipped']}"))
            continue
        t.add_row(_QNAMES[name], f"{c['device_bytes'] / 1024:.0f}", f"{c['error_mean']:.3g}", f"{c['error_p99']:.3g}",
                  f"{c['rel_error_mean']:.3g}", f"{c['ms_per_chunk']:.1f}",
                  "-" if c.get("violations") is None else str(c["violations"]))
    t.caption = ("err: L-inf of each query's attention output, per layer, vs float64 attention over the whole history "
                 "(no compounding through layers); rel: over the head's value range; bound broken: queries whose true "
                 "error exceeded the tier's certified bound")
    console.print(t)


def plot_demo(doc: dict[str, Any], path: str | Path) -> Path:
    """Top: the maintenance panels (:func:`~streamkv_lab.bench.headline.draw_maintenance`) with
    the floor explained; bottom: quality at a quarter of the memory (mean and p99 error per cache)
    and the fork's memory. Every number comes from ``doc``."""
    from streamkv_lab.bench.headline import FLOOR_NOTE, draw_maintenance, maintenance_title
    from streamkv_lab.experiments.demo_quality import QUALITY_CACHES, self_forcing_quarter_note
    from streamkv_lab.plotting import pyplot

    plt = pyplot()
    fig = plt.figure(figsize=(15, 9.6))
    gs = fig.add_gridspec(2, 3, hspace=0.55, wspace=0.28, top=0.9, bottom=0.12, left=0.05, right=0.98)
    top = [fig.add_subplot(gs[0, i]) for i in range(3)]
    draw_maintenance(top, doc["headline"])
    fig.suptitle("streamkv demo: " + maintenance_title(doc["headline"]), fontsize=11)
    fig.text(0.5, 0.485, FLOOR_NOTE, ha="center", fontsize=8)

    ax = fig.add_subplot(gs[1, :2])
    q = doc["quality"]
    note = self_forcing_quarter_note(doc["headline"]["preset"])
    if "skipped" in q:
        ax.set_axis_off()
        ax.text(0.5, 0.5, f"quality at a quarter of the memory: not run\n({q['skipped']})", ha="center", va="center",
                fontsize=10, wrap=True)
    else:
        names = [n for n in QUALITY_CACHES if "error_mean" in q["caches"][n]]
        colors = {"full": "0.5", "ring": "tab:blue", "tova": "tab:purple", "compressed_tier": "tab:green"}
        x = list(range(len(names)))
        mean = [q["caches"][n]["error_mean"] for n in names]
        p99 = [q["caches"][n]["error_p99"] for n in names]
        ax.bar([i - 0.2 for i in x], mean, width=0.4, color=[colors[n] for n in names], label="mean")
        ax.bar([i + 0.2 for i in x], p99, width=0.4, color=[colors[n] for n in names], alpha=0.45, hatch="//",
               label="p99")
        for i, (a, b) in enumerate(zip(mean, p99)):
            ax.annotate(f"{a:.3g}", (i - 0.2, a), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=8)
            ax.annotate(f"{b:.3g}", (i + 0.2, b), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=8)
        ax.set_ylim(0, max(p99) * 1.18)
        labels = []
        for n in names:
            kib = q["caches"][n]["device_bytes"] / 1024
            labels.append(f"{_QNAMES[n]}\n{kib:.0f} KiB" + (" (1x)" if n == "full" else ""))
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_ylabel("attention output error vs full history")
        ax.legend(fontsize=8, loc="upper left")
        r = q["ratios"]
        ax.set_title(f"quality at a quarter of the memory: SmolLM2-135M's own attention ({q['tokens']} tokens, "
                     f"{q['layers']} layers)\nmean error: the compressed tier's is "
                     f"{r.get('tova_over_tier_mean', float('nan')):.2f}x below TOVA's, "
                     f"{r.get('ring_over_tier_mean', float('nan')):.2f}x below the ring's", fontsize=10)
        ax.set_xlabel("error: L-inf of each query's attention output vs float64 attention over the whole history, per "
                      "layer (the full cache's: float32 rounding)" + (f"\n{note}" if note else ""), fontsize=8)

    ax = fig.add_subplot(gs[1, 2])
    f = doc["fork"]
    m, n = f["memory"], len(f["branches"])
    bars = [("one cache", m["one_cache_bytes"], "0.5"),
            (f"{n} branches,\n1 chunk after", m["one_chunk_after"]["pool_bytes_in_use"], "tab:blue"),
            (f"{n} branches,\nat the end", m["end"]["pool_bytes_in_use"], "tab:cyan"),
            (f"{n + 1} full\ncopies", m["one_chunk_after"]["full_copies_bytes"], "tab:red")]
    vals = [b[1] / 2**20 for b in bars]
    ax.bar(range(len(bars)), vals, color=[b[2] for b in bars])
    for i, b in enumerate(bars):
        ax.annotate(_mib(b[1]), (i, vals[i]), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=8)
    ax.set_ylim(0, max(vals) * 1.18)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    ax.set_ylabel("MiB of K/V pages (toy video model)")
    ax.set_title(f"fork: one {f['clip']['prefix_frames']}-frame prefix, {n} branches sharing its pages\n"
                 f"(each = a run that never forked: max |diff| {f['max_abs_diff_vs_unforked']:.3g})", fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)  # the grid is placed by hand: no tight_layout
    plt.close(fig)
    return path
