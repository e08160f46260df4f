"""Tables and plots of :func:`~.evaluate.evaluate` results (CLI only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from streamkv_lab.plotting import pyplot, save

__all__ = ["print_eval", "plot_eval", "print_position_maps"]


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _rates(block: dict, keys: tuple[str, ...]) -> str:
    if not block["n"]:
        return "no events"
    return "/".join(_f(block[k], ".2f") for k in keys) + f" ({block['n']})"


def _row(label: str, s: dict) -> list[str]:
    far = s.get("revisit_gap_over_capacity")
    return [
        label, _f(s["err_vs_full_horizon"]), _f(s["err_vs_full_beyond"]),
        _f(s["tracking_horizon"]["tracked_rate"], ".2f"),
        _rates(s["reentry"], ("colour_ok", "shape_ok", "position_ok")),
        _rates(s["revisit"], ("ok",)), "-" if far is None else _rates(far, ("ok",)),
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
    cols = ("cache", "err<H", "err>=H", "track<H", "re-entry c/s/p (n)", "revisit (n)", "gap>cap (n)", "mass", "ovf")
    table = Table(title="streamed frames vs the full-history rollout and the ground truth (H = training window; "
                        "JSON has more)")
    for c in cols:
        table.add_column(c, justify="left" if c == "cache" else "right", no_wrap=True)
    table.add_row(*_row("full history", result["reference_full_history"]))
    for kind, per in result["caches"].items():
        for cap, s in per.items():
            table.add_row(*_row(f"{kind} {cap}f", s))
    console.print(table)
    console.print("err: mean |RGB| error vs the full-history stream (< / >= the training window H); track: share of "
                  "sprites found within 1 px; re-entry: colour / shape / position kept (events); revisit: background "
                  "within tolerance where a region comes back (gap>cap: after more frames than the cache holds); "
                  "mass: full-history attention mass the cache held; ovf: mass-budget overflows (head-commits)")
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
    if "position_maps" in result:
        print_position_maps(console, result["position_maps"])


def print_position_maps(console: Any, pm: dict) -> None:
    """The ``position_maps`` section: per map, mean |RGB| error within / past the training window."""
    from rich.table import Table

    t = Table(title=f"position maps: {pm['frames']} frames = {pm['factor']}x the {pm['training_window']}-frame "
                    f"training window, {pm['capacity_frames']} frames of cache, {pm['clips']} clip(s)")
    for col in ("stream", "vs truth < H", "vs truth >= H", "vs full history >= H", "vs truth, last 1/4"):
        t.add_column(col, justify="left" if col == "stream" else "right")
    for name, r in pm["per_map"].items():
        vt, vf = r["vs_truth"], r["vs_full_history"]
        t.add_row(name, _f(vt["horizon_mean"], ".4f"), _f(vt["beyond_mean"], ".4f"), _f(vf["beyond_mean"], ".4f"),
                  _f(vt["last_quarter_mean"], ".4f"))
    console.print(t)


def plot_eval(result: dict, path: str | Path) -> Path:
    plt = pyplot()
    cfg = result["config"]
    caps = [str(c) for c in cfg["capacities"]]
    kinds = list(result["caches"])
    ref = result["reference_full_history"]
    fig, axes = plt.subplots(2, 4, figsize=(21, 9))
    mid = caps[len(caps) // 2]
    for ax, key, what in ((axes[0, 0], "err_vs_full_per_frame", "full history"),
                          (axes[1, 0], "err_vs_gt_per_frame", "ground truth")):
        for k in kinds:
            ax.plot(result["caches"][k][mid][key], label=k)
        if key == "err_vs_gt_per_frame":
            ax.plot(ref[key], color="k", ls="--", lw=1, label="full history")
        ax.axvline(cfg["horizon"], color="k", ls=":", lw=1)
        ax.axvline(cfg["context_frames"], color="gray", ls=":", lw=1)
        ax.set(title=f"error vs {what}, {mid}-frame caches", xlabel="frame (dotted: context end, training window)",
               ylabel="mean |RGB diff|")
        ax.legend(fontsize=8)

    def bars(ax, key, sub, title, refval=None, ylim=(0, 1.05)):
        width = 0.8 / len(kinds)
        for i, k in enumerate(kinds):
            vals = [result["caches"][k][c][key] if sub is None else result["caches"][k][c][key][sub] for c in caps]
            ax.bar([j + i * width for j in range(len(caps))], [v if v is not None else 0 for v in vals], width, label=k)
        if refval is not None:
            ax.axhline(refval, color="k", ls="--", lw=1, label="full history")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(caps))], [f"{c} frames" for c in caps])
        ax.set(title=title, ylim=ylim)

    bars(axes[0, 1], "tracking_horizon", "tracked_rate", "sprites tracked (< training window)",
         ref["tracking_horizon"]["tracked_rate"])
    bars(axes[0, 2], "reentry", "colour_ok", "re-entry: colour kept", ref["reentry"]["colour_ok"])
    bars(axes[0, 3], "reentry", "shape_ok", "re-entry: shape kept", ref["reentry"]["shape_ok"])
    bars(axes[1, 1], "revisit_gap_over_capacity", "ok", "revisit, gap > capacity: background as it was")
    axes[1, 1].legend(fontsize=8)
    bars(axes[1, 2], "full_history_mass_resident", None, "full-history attention mass held by the cache",
         ylim=(0, 1.05))
    oracle = result["oracle_per_query_mass"]
    for tau, o in oracle.items():
        axes[1, 2].plot([j + 0.4 for j in range(len(caps))], [o["fits_capacity"][c] for c in caps], marker="o",
                        color="k", lw=1, label=f"oracle tau={tau}: share of queries that fit")
    axes[1, 2].legend(fontsize=7)
    ax = axes[1, 3]
    passes = result["attention_full_history"].get("passes", {})
    if passes:
        last = passes[max(passes, key=int)]["per_layer"]
        layers = list(range(len(last["sink"])))
        bottom = [0.0] * len(layers)
        for c in ("sink", "self", "recent", "far"):
            ax.bar(layers, last[c], bottom=bottom, label=c)
            bottom = [b + v for b, v in zip(bottom, last[c])]
        ax.set_xticks(layers)
        ax.set(title="full-history attention mass by key (clean pass)", xlabel="layer", ylim=(0, 1.0))
        ax.legend(fontsize=8)
    return save(fig, path)
