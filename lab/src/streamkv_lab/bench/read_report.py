"""The table and the plot of ``streamkv bench --read`` (JSON key ``read``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from streamkv_lab.bench.report import fmt_bytes

__all__ = ["print_reads", "plot_reads", "verdict"]


def verdict(met: bool | None) -> str:
    return "not measured" if met is None else ("met" if met else "NOT met")


def _ms(x: float | None) -> str:
    return "-" if x is None else (f"{x:.3f}" if x < 10 else f"{x:.1f}")


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def print_reads(read: dict[str, Any], console: Any) -> None:
    """One table per shape (every variant, both modes), then the targets with their verdicts."""
    from rich.table import Table

    modes = read["modes"]
    for name, rec in read["shapes"].items():
        sh, tm = rec["shape"], rec["timing"]
        t = Table(title=f"[b]read at {name}[/]: {sh['capacity']:,} tokens x {sh['heads']} of {sh['model_heads']} "
                        f"kv heads x {sh['head_dim']} ({sh['q_heads']} query heads), {rec['queries']:,} queries, "
                        f"{sh['dtype']}; median of {tm['repeats']} interleaved rounds", title_justify="left")
        t.add_column("variant", justify="left", no_wrap=True)
        for m in modes:
            for col in ("ms", "/ dense", "transient"):
                t.add_column(f"{m} {col}", justify="right")
        t.add_column("target" + (f" ({'/'.join(modes)})" if len(modes) > 1 else ""), justify="left", no_wrap=True)
        targets = {(x["variant"], x["mode"]): x for x in rec["targets"]}
        for v, row in rec["variants"].items():
            cells = []
            for m in modes:
                r = row.get(m, {})
                if r.get("error"):
                    cells += [f"not compiled: {r['error'][:60]}", "", ""]
                    continue
                cells += [_ms(r.get("ms")), _x(r.get("ratio_vs_dense")), fmt_bytes(r.get("transient_peak_bytes"))]
            tg = [targets[(v, m)] for m in modes if (v, m) in targets]
            tcell = "" if not tg else f"<= {tg[0]['threshold']:g}x: " + "/".join(
                "-" if x["met"] is None else ("met" if x["met"] else "NOT") for x in tg)
            t.add_row(v, *cells, tcell)
        load = tm.get("foreign_cpu_share")
        t.caption = (f"{sh['description']}. transient = peak allocation above the read's start. load: other "
                     f"processes used {'-' if load is None else f'{load:.0%}'} of the CPUs while timed; load average "
                     f"{tm.get('load_average_before')} -> {tm.get('load_average_after')}, {tm['threads']} thread(s)")
        console.print(t)
    console.print("[b]read targets[/] (verdicts computed from the measured ratios):")
    by: dict[str, list[dict[str, Any]]] = {}
    for x in read["targets"]:
        by.setdefault(x["target"], []).append(x)
    for text, xs in by.items():
        met = sum(1 for x in xs if x["met"])
        measured = [x for x in xs if x["met"] is not None]
        console.print(f"  {text}: {met} of {len(measured)} met")
        for x in measured:
            console.print(f"    {x['shape']} {x['variant']} {x['mode']}: {x['value']:.2f}x -> {verdict(x['met'])}"
                          f"{' (contended samples included: noisy)' if x.get('contended') else ''}")


def plot_reads(read: dict[str, Any], path: str | Path) -> Path:
    """One panel per shape: each variant's time over the dense read, eager and compiled, the targets marked."""
    from streamkv_lab.plotting import pyplot, save

    plt = pyplot()
    shapes = list(read["shapes"])
    n = max(len(rec["variants"]) for rec in read["shapes"].values())
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.2 * len(shapes), 0.32 * n + 1.8), squeeze=False)
    colors = {"eager": "tab:blue", "compiled": "tab:orange"}
    for ax, name in zip(axes[0], shapes):
        rec = read["shapes"][name]
        names = list(rec["variants"])
        h = 0.8 / max(1, len(read["modes"]))
        for j, m in enumerate(read["modes"]):
            ys = [i + j * h for i in range(len(names))]
            xs = [rec["variants"][v].get(m, {}).get("ratio_vs_dense") or 0.0 for v in names]
            ax.barh(ys, xs, height=h, color=colors.get(m, "0.5"), label=m)
        for x in rec["targets"]:
            if x["mode"] == read["modes"][0]:
                i = names.index(x["variant"])
                ax.plot([x["threshold"]] * 2, [i - h / 2, i + (len(read["modes"]) - 0.5) * h], color="k", lw=1.5)
        ax.axvline(1.0, color="0.6", lw=0.8, ls=":")
        ax.set_yticks([i + (len(read["modes"]) - 1) * h / 2 for i in range(len(names))], names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("time / dense bf16 read (log); | = target")
        ax.set_title(f"{name}: {rec['queries']:,} queries, {rec['shape']['capacity']:,} tokens", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("one read against the dense bf16 read", fontsize=10)
    return save(fig, path)
