"""Tables and the plot of ``streamkv positions`` (:mod:`.positions`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["print_positions", "plot_positions"]


def print_positions(console: Any, res: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title="position maps: every cache kind x read path vs the float64 whole-history reference")
    for col in ("map", "bounded", "layouts", "comparisons", "max |diff| (fp64)", "ragged reads", "recompiles"):
        t.add_column(col, justify="left" if col == "map" else "right")
    for name, r in res["maps"].items():
        t.add_row(name, "yes" if r["bounded"] else "no", str(r["layouts"]), str(r["comparisons"]),
                  f"{r['max_abs_diff']:.1e}", str(r["ragged_reads"]), str(r["recompiles"]))
    console.print(t)
    rc, lp = res["ring_vs_chronological"], res["large_positions"]
    console.print(f"ring under cache_relative vs the chronological path: {rc['cache']['max_abs_diff']:.1e} (cache), "
                  f"{rc['dit']['ring_cache_relative_vs_chronological_max_abs_diff']:.1e} (tiny DiT, fp64); a wrong map "
                  f"is off by {res['wrong_map']['max_abs_diff']:.2f}")
    console.print(f"2**40 tokens on: bounded maps differ by {max(lp['bounded'].values()):.1e}; absolute vs exact "
                  f"angles {lp['absolute_vs_exact_angles']:.1e} (float64 RoPE at write: "
                  f"{lp['float64_rope_at_write_vs_exact']:.1e}); compiled frames {res['compile']['frames']}")
    sw = res["sliding_window"]
    console.print(f"sliding window ({', '.join(sw['models'])}): tokens equal {sw['tokens_equal']}, max logit diff "
                  f"{sw['max_logit_diff']:.1e}; StreamingLLM ({sw['streaming_llm'].get('model')}): tokens equal "
                  f"{sw['streaming_llm']['tokens_equal']}, logits {sw['streaming_llm']['max_logit_diff']:.1e}, "
                  f"attention {sw['streaming_llm']['max_attention_output_diff']:.1e}")
    console.print(f"recache vs rebuild: {res['recache']['max_abs_diff']:.1e}; flashdreams relative RoPE: "
                  f"{res['flashdreams'].get('max_abs_diff', float('nan')):.1e}")
    c = Table(title="cost per read (one head; ratios in one interleaved run)")
    for col in ("preset", "prerotated ms", "rotate at read ms", "read / prerotated", "read / RoPE at write",
                "read / chronological", "blocking alone", "transient peak (read / chrono)"):
        c.add_column(col, justify="right")
    for p, r in res["cost"].items():
        tb = r.get("transient_bytes", {})
        c.add_row(p, f"{r['ms']['prerotated']:.0f}", f"{r['ms']['rotate_at_read']:.0f}",
                  f"{r['ratios']['rotate_at_read_vs_prerotated']:.2f}x",
                  f"{r['ratios']['rotate_at_read_vs_rope_at_write']:.2f}x",
                  f"{r['ratios']['rotate_at_read_vs_chronological_rerotate']:.2f}x",
                  f"{r['ratios']['keyblocked_vs_prerotated']:.2f}x",
                  f"{tb.get('rotate_at_read_peak', 0) / 1e6:.1f} / {tb.get('chronological_peak', 0) / 1e6:.1f} MB")
    console.print(c)
    ls = res["long_stream"]
    t2 = Table(title=f"toy video, {ls['frames']} frames = {ls['factor']}x its {ls['training_window']}-frame training "
                     f"window, {ls['capacity_frames']} frames of cache: mean |RGB error|")
    for col in ("stream", "vs truth (in window)", "vs truth (past)", "vs full history (past)", "vs truth (last 1/4)"):
        t2.add_column(col, justify="left" if col == "stream" else "right")
    for name, r in ls["per_map"].items():
        vt, vf = r["vs_truth"], r["vs_full_history"]
        t2.add_row(name, f"{vt['horizon_mean']:.4f}", f"{vt['beyond_mean']:.4f}", f"{vf['beyond_mean']:.4f}",
                   f"{vt['last_quarter_mean']:.4f}")
    console.print(t2)


def plot_positions(res: dict[str, Any], path: str | Path) -> None:
    from streamkv_lab.plotting import pyplot, save

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    ls = res["long_stream"]
    for name, r in ls["per_map"].items():
        axes[0].plot(r["vs_truth"]["per_frame"], label=name, lw=1.2)
        axes[1].plot(r["vs_full_history"]["per_frame"], label=name, lw=1.2)
    for ax, what in ((axes[0], "vs ground truth"), (axes[1], "vs full history")):
        ax.axvline(ls["training_window"], color="k", ls=":", lw=1)
        ax.set_xlabel("frame")
        ax.set_ylabel("mean |RGB error|")
        ax.set_title(f"toy video {what} ({ls['capacity_frames']}-frame cache)")
    axes[0].legend(fontsize=7)
    presets = list(res["cost"])
    keys = ["rotate_at_read_vs_prerotated", "rotate_at_read_vs_rope_at_write", "rotate_at_read_vs_chronological_rerotate"]
    width = 0.8 / len(keys)
    for i, k in enumerate(keys):
        axes[2].bar([j + i * width for j in range(len(presets))], [res["cost"][p]["ratios"][k] for p in presets],
                    width, label=k.replace("rotate_at_read_vs_", "read / "))
    axes[2].axhline(1.3, color="r", ls="--", lw=1, label="target 1.3x")
    axes[2].set_xticks([j + width for j in range(len(presets))], presets)
    axes[2].set_title("cost of rotation at read (ratio)")
    axes[2].legend(fontsize=7)
    save(fig, path)
