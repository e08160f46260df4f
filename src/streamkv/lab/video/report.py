"""Tables and plots of :func:`~.evaluate.evaluate` results (CLI only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from streamkv.lab.plotting import pyplot, save

__all__ = ["print_eval", "plot_eval"]


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _rates(block: dict, keys: tuple[str, ...]) -> str:
    if not block["n"]:
        return "no events"
    return "/".join(_f(block[k], ".2f") for k in keys) + f" ({block['n']})"


def _row(label: str, s: dict) -> list[str]:
    far = s.get("revisit_gap_over_capacity")
    return [
        label, _f(s["err_vs_full_horizon"]), _f(s["err_vs_full_beyond"]), _f(s["err_vs_gt_horizon"]),
        _f(s["tracking_horizon"]["tracked_rate"], ".2f"), _f(s["tracking_beyond"]["tracked_rate"], ".2f"),
        _rates(s["reentry"], ("colour_ok", "shape_ok", "position_ok")),
        _rates(s["revisit"], ("ok",)) + " " + _f(s["revisit"]["bg_err"]),
        "-" if far is None else _rates(far, ("ok",)) + " " + _f(far["bg_err"]),
        _f(s.get("full_history_mass_resident")), str(s.get("overflow_head_commits", "-")),
    ]


def print_eval(console: Any, result: dict) -> None:
    from rich.table import Table

    cfg = result["config"]
    console.print(
        f"[bold]video-eval[/]: {cfg['clips']} held-out clips x {cfg['frames']} frames (ground truth for the first "
        f"{cfg['context_frames']}), training window {cfg['horizon']} frames; memory in frames of "
        f"{cfg['tokens_per_frame']} tokens, sinks = the first {cfg['sink_frames']} frames"
    )
    cols = ("cache", "err/full <H", "err/full >=H", "err/GT <H", "track <H", "track >=H",
            "re-entry col/shape/pos (n)", "revisit ok (n) bg_err", "revisit gap>cap ok (n) bg_err",
            "hist. mass kept", "overflow")
    table = Table(title="streamed frames vs the full-history rollout and the ground truth (H = training window)")
    for c in cols:
        table.add_column(c, justify="left" if c == "cache" else "right")
    table.add_row(*_row("full history", result["reference_full_history"]))
    for kind, per in result["caches"].items():
        for cap, s in per.items():
            table.add_row(*_row(f"{kind} @ {cap} frames", s))
    console.print(table)
    ch = result["chronological_vs_ring_max_abs_diff"]
    console.print(f"ring vs chronological at {ch['capacity_frames']} frames: max |diff| = {ch['value']:.3g}")
    passes = result["attention_full_history"].get("passes", {})
    for p in (min(passes, key=int, default=None), max(passes, key=int, default=None)):
        if p is not None:
            o = passes[p]["overall"]
            console.print(f"attention (full history, pass {p}): " + ", ".join(f"{k} {v:.3f}" for k, v in o.items()))
    for tau, o in result["oracle_per_query_mass"].items():
        fits = ", ".join(f"{c}f {v:.2f}" for c, v in o["fits_capacity"].items())
        console.print(f"per-query oracle tau={tau}: {o['tokens_mean']:.0f} tokens mean (p95 {o['tokens_p95']:.0f}); "
                      f"fits in: {fits}")


def plot_eval(result: dict, path: str | Path) -> Path:
    plt = pyplot()
    cfg = result["config"]
    caps = [str(c) for c in cfg["capacities"]]
    kinds = list(result["caches"])
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    mid = caps[len(caps) // 2]
    ax = axes[0, 0]
    for k in kinds:
        ax.plot(result["caches"][k][mid]["err_vs_full_per_frame"], label=k)
    ax.axvline(cfg["horizon"], color="k", ls=":", lw=1)
    ax.axvline(cfg["context_frames"], color="gray", ls=":", lw=1)
    ax.set(title=f"error vs full history, {mid}-frame caches", xlabel="frame", ylabel="mean |RGB diff|")
    ax.legend()

    def bars(ax, key, sub, title, ref=None):
        width = 0.8 / len(kinds)
        for i, k in enumerate(kinds):
            vals = [result["caches"][k][c][key][sub] for c in caps]
            ax.bar([j + i * width for j in range(len(caps))], [v if v is not None else 0 for v in vals], width, label=k)
        if ref is not None:
            ax.axhline(ref, color="k", ls="--", lw=1, label="full history")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(caps))], [f"{c} frames" for c in caps])
        ax.set(title=title, ylim=(0, 1.05))

    ref = result["reference_full_history"]
    bars(axes[0, 1], "tracking_horizon", "tracked_rate", "sprites tracked (< training window)",
         ref["tracking_horizon"]["tracked_rate"])
    bars(axes[0, 2], "reentry", "colour_ok", "re-entry: colour kept", ref["reentry"]["colour_ok"])
    bars(axes[1, 0], "reentry", "shape_ok", "re-entry: shape kept", ref["reentry"]["shape_ok"])
    bars(axes[1, 1], "revisit_gap_over_capacity", "ok", "revisit (gap > capacity): background as before",
         None)
    axes[1, 1].legend(fontsize=8)
    ax = axes[1, 2]
    passes = result["attention_full_history"].get("passes", {})
    if passes:
        last = passes[max(passes, key=int)]["per_layer"]
        layers = range(len(last["sink"]))
        bottom = [0.0] * len(last["sink"])
        for c in ("sink", "self", "recent", "far"):
            ax.bar(list(layers), last[c], bottom=bottom, label=c)
            bottom = [b + v for b, v in zip(bottom, last[c])]
        ax.set(title="full-history attention mass by key class (clean pass)", xlabel="layer", ylim=(0, 1.0))
        ax.legend(fontsize=8)
    return save(fig, path)
