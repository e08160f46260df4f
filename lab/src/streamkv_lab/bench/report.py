"""Tables (rich) and the scaling plot (matplotlib, Agg) of a benchmark document."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from streamkv_lab.plotting import pyplot, save
from streamkv_lab.bench.maintenance import LABELS, PEER_SUBJECTS, SUBJECTS

__all__ = ["print_report", "plot_scaling", "fmt_bytes"]


def fmt_bytes(n: float | None) -> str:
    """``1234567`` -> ``"1.23 MB"`` (decimal units); exact below 1 kB."""
    if n is None:
        return "-"
    if abs(n) < 1000:
        return f"{int(n)} B"
    for unit in ("kB", "MB", "GB", "TB"):
        n /= 1000
        if abs(n) < 1000:
            return f"{n:.3g} {unit}"
    return f"{n:.3g} PB"


def _ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _subjects(rec: dict[str, Any]) -> tuple[str, ...]:
    """The record's subjects: :data:`SUBJECTS`, then its preset's peers'."""
    return SUBJECTS + tuple(k for p in rec["preset"].get("peers", ()) for k in PEER_SUBJECTS[p])


def _gb_per_s(rec: dict[str, Any], key: str) -> float | None:
    if key in rec["achieved_gb_per_s"]:
        return rec["achieved_gb_per_s"][key]
    return next((rec[p]["achieved_gb_per_s"].get(key) for p in rec["preset"].get("peers", ()) if p in rec), None)


def _maintenance_table(name: str, rec: dict[str, Any]) -> Any:
    from rich.table import Table

    ver = rec["versions"]
    stats = rec["maintenance_stats_ms"]
    ring = stats.get("ring", {}).get("median")
    t = Table(
        title=f"[b]{name}[/]: cache maintenance per AR step and layer, steady state, "
        f"{ver['device_name']}, {ver['torch_threads']} threads, median of {rec.get('timing_repeats')} after warm-up",
        caption=f"{rec['preset']['description']}. " + "; ".join(f"{k} = {LABELS[k]}" for k in _subjects(rec))
        + ". written = chunk + retained + clone temporaries (K+V); traffic = 2 x written; "
        "transient = bytes allocated in one steady step (allocations) / peak above the step's start; "
        "faults = minor page faults in one step",
        title_justify="left",
    )
    for col in ("cache", "median ms", "p10-p90 ms", "/ ring", "written", "traffic", "GB/s", "transient", "peak",
                "faults"):
        t.add_column(col, justify="left" if col == "cache" else "right")
    for key in _subjects(rec):
        s = stats.get(key)
        if s is None:
            t.add_row(key, "not run", *[""] * 8)
            continue
        b = rec["bytes_moved"][key]
        tr = rec["transient_bytes"].get(key)
        if b is None:
            t.add_row(key, "not run", *[""] * 8)
            continue
        gbs = _gb_per_s(rec, key)
        t.add_row(
            key, _ms(s["median"]), f"{_ms(s['p10'])}-{_ms(s['p90'])}", _x(s["median"] / ring if ring else None),
            fmt_bytes(b["written_total"]), fmt_bytes(b["traffic"]), "-" if gbs is None else f"{gbs:.1f}",
            "-" if tr is None else f"{tr['allocated_bytes']:,} B ({tr['allocations']})",
            "-" if tr is None else f"{tr['peak_bytes']:,} B",
            "-" if tr is None or tr.get("page_faults") is None else f"{tr['page_faults']:,}",
        )
    return t


def _ratios_line(rec: dict[str, Any]) -> str:
    line = (
        f"current/ring [b]{_x(rec['ratio_current_over_ring'])}[/]   "
        f"flashdreams/ring [b]{_x(rec['ratio_flashdreams_over_ring'])}[/]   "
        f"ring/floor [b]{_x(rec['ratio_ring_over_floor'])}[/]"
    )
    for peer in rec["preset"].get("peers", ()):
        original, drop_in = PEER_SUBJECTS[peer]
        if peer in rec:
            line += f"   {original}/{drop_in} [b]{_x(rec[peer][f'ratio_{original}_over_{drop_in}'])}[/]"
    tm = rec.get("timing")
    if tm:
        load = tm.get("foreign_cpu_share")
        clean = ", ".join(
            f"{k} {n}{'*' if tm['contended_included'][k] else ''}" for k, n in tm["clean_samples"].items()
        )
        line += (f"   [dim](clean samples: {clean}; * = too few, contended ones included"
                 + ("" if load is None else f"; other processes' CPU share {load:.0%}") + ")[/]")
    return line


def _transient_line(rec: dict[str, Any]) -> str | None:
    parts = []
    for key, tr in rec.get("transient_bytes", {}).items():
        if tr and tr["by_op"]:
            ops = ", ".join(f"{op} {n:,} B" for op, n in sorted(tr["by_op"].items(), key=lambda kv: -kv[1]))
            parts.append(f"{key}: {ops}")
    return "allocations by op (worst probed step): " + "; ".join(parts) if parts else None


def _counted_line(rec: dict[str, Any]) -> str:
    parts = []
    for key in _subjects(rec):
        b = rec["bytes_moved"].get(key)
        if b and "counted" in b:
            c = b["counted"]
            ok = c["cache"] == b["chunk_written"] + b["retained_copied"] and c["temporary"] == b["clone_temporary"]
            parts.append(
                f"{key} {fmt_bytes(c['cache'])} cache + {fmt_bytes(c['temporary'])} temp + "
                f"{fmt_bytes(c['metadata'])} metadata ({'= analytic' if ok else '[red]!= analytic[/]'})"
            )
    return "bytes written, counted per aten op: " + "; ".join(parts)


def _targets_table(name: str, rec: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"targets at {name} (the flashdreams ratio is set at self-forcing, the sglang one at the sglang "
              f"presets, the rest at every preset)",
              title_justify="left")
    for col in ("target", "value", "threshold", "met"):
        t.add_column(col, justify="left" if col == "target" else "right")
    from streamkv_lab.bench.suite import COUNT_TARGETS

    for key, tg in rec["targets"].items():
        v = tg["value"]
        if key.endswith("bytes"):
            value, thr = ("-" if v is None else f"{int(v):,} B"), f"{int(tg['threshold'])} B"
        elif key in COUNT_TARGETS:
            value, thr = ("-" if v is None else f"{int(v):,}"), f"{int(tg['threshold'])}"
        else:
            value, thr = ("-" if v is None else f"{v:.2f}x"), f"{tg['threshold']:g}x"
        met = {True: "[green]yes[/]", False: "[red]no[/]", None: "not measured"}[tg["met"]]
        if tg.get("contended"):
            met += " [yellow](contended: rerun on a quiet machine)[/]"
        t.add_row(tg["target"], value, thr, met)
    return t


def _scaling_table(name: str, sc: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(
        title=f"[b]{name}[/]: maintenance ms (median; p10-p90) vs window, chunk {sc['chunk_frames']} frames, "
        f"sink {sc['sink_frames']} (median of {sc['repeats']}; * = too few clean samples, contended ones included)",
        title_justify="left",
    )
    t.add_column("window (frames)", justify="right")
    keys = [k for k in SUBJECTS if any(x is not None for x in sc["maintenance_ms"][k])]
    for k in keys:
        t.add_column(k, justify="right")
    flagged = sc.get("contended_included", {})
    for i, w in enumerate(sc["windows_frames"]):
        cells = []
        for k in keys:
            m, lo, hi = sc["maintenance_ms"][k][i], sc["p10_ms"][k][i], sc["p90_ms"][k][i]
            star = "*" if (flagged.get(k) or [None] * (i + 1))[i] else ""
            cells.append("-" if m is None else f"{_ms(m)}{star} ({_ms(lo)}-{_ms(hi)})")
        t.add_row(str(w), *cells)
    growth = sc.get("growth_63_over_21")
    if growth:
        t.add_row("63 / 21", *[_x(growth[k]) for k in keys], style="bold")
    return t


def _n(x: int | None) -> str:
    return "-" if x is None else f"{x:,}"


_READ_SHORT = {"one kernel over the buffer": "1 kernel", "explicit softmax over the buffer": "softmax"}


def _counts_table(name: str, rec: dict[str, Any]) -> Any:
    from rich.table import Table

    from streamkv_lab.bench.counts import COUNT_LABELS

    per = rec["counts"]["subjects"]
    t = Table(
        title=f"[b]{name}[/]: counted per steady chunk and layer (begin, one write, scores, commit) at the dispatcher; "
        f"c. = the write under torch.compile ({rec['counts']['compile_backend']}), the rest eager",
        title_justify="left",
    )
    for col in ("cache", "ops", "write", "syncs", "allocs", "allocator", "written", "read", "c. ops", "c. syncs",
                "c. allocs", "recomp."):
        t.add_column(col, justify="left" if col in ("cache", "read") else "right", no_wrap=True)
    syncs: dict[str, str] = {}
    for key, c in per.items():
        if c is None:
            t.add_row(key, "not run", *[""] * 10)
            continue
        st, cm = c["step"], c["compiled"]
        w = c["phases"].get("write")
        if st["syncs"]:
            syncs[key] = ", ".join(f"{op} {n}" for op, n in st["syncs"].items())
        read = c["read"]["attention"]
        t.add_row(
            key, str(st["ops"]), "-" if w is None else str(w["ops"]), str(st["host_syncs"]),
            f"{st['allocations']} / {fmt_bytes(st['alloc_bytes'])}",
            f"{c['allocator']['allocations']} / {fmt_bytes(c['allocator']['allocated_bytes'])}",
            fmt_bytes(c["written"]["total"]), _READ_SHORT.get(read, read.replace("a copy first", "copy first")),
            "-" if cm is None else str(cm["ops_per_chunk"]), "-" if cm is None else str(cm["host_syncs_per_chunk"]),
            "-" if cm is None else f"{cm['allocations_per_chunk']} / {fmt_bytes(cm['alloc_bytes_per_chunk'])}",
            "-" if cm is None else str(cm["recompiles"]),
        )
    caption = ("ops: dispatched aten ops (views included); write: ops of one layer write; syncs: host waits (.item(), "
               ".tolist(), truth tests, nonzero, data-dependent shapes, device-to-host copies); allocs: new tensors "
               "at the dispatcher / bytes; allocator: allocator events / bytes; written: bytes written (cache, "
               "temporaries, metadata); read: attention over what the cache returns (1 kernel over the buffer, an "
               "explicit softmax over it, or a copy first)")
    if syncs:
        caption += ". Syncs: " + "; ".join(f"{k}: {v}" for k, v in syncs.items())
    w = rec.get("ring_write_ops_by_window")
    if w:
        caption += (f". Ring ops per layer write at windows {w['windows_frames']} frames: {w['write_ops']} "
                    f"({'constant' if w['constant'] else 'NOT constant'}); begin: {w['begin_ops']}")
    notes = {k: c["compile_note"] for k, c in per.items() if c is not None and c.get("compile_note")}
    if notes:
        caption += ". Not compiled: " + "; ".join(f"{k}: {why}" for k, why in notes.items())
    caption += ". " + "; ".join(f"{k} = {COUNT_LABELS.get(k, k)}" for k in per)
    t.caption = caption
    return t


def _scored_table(name: str, sc: dict[str, Any]) -> Any:
    from rich.table import Table

    ring = sc["ring_step_ms"]
    t = Table(title=f"[b]{name}[/]: the scored kinds per steady chunk against the ring (ring step {_ms(ring)} ms; "
              f"median of {sc['repeats']}; statistics synthetic: attention not timed)", title_justify="left")
    for col in ("kind", "step ms", "/ ring", "begin", "write", "scores", "commit", "commit / ring",
                "commit: where it goes"):
        t.add_column(col, justify="left" if col in ("kind", "commit: where it goes") else "right")
    for k, v in sc["kinds"].items():
        ph = v["phases_ms"]
        where = ", ".join(f"{g} {share:.0%}" for g, share in list(v["commit_groups_share"].items())[:4])
        t.add_row(k, _ms(v["step_ms"]), _x(v["step_over_ring_step"]), _ms(ph.get("begin")), _ms(ph.get("write")),
                  _ms(ph.get("scores")), _ms(ph.get("commit")), _x(v["commit_over_ring_step"]), where)
    att = sc.get("attention")
    if att:
        t.caption = (f"attention, one block of {att['query_rows']} queries over {att['keys']:,} keys: ring "
                     f"{_ms(att['ring_ms'])} ms ({att['ring_path']}), scored {_ms(att['tova_ms'])} ms "
                     f"({att['tova_path']}): {_x(att['scored_over_ring'])}")
    return t


def _write_kernels_table(name: str, wk: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"[b]{name}[/]: the ring's chunk write (K+V) by kernel, and its slot plan", title_justify="left")
    for col in ("variant", "median ms", "p10-p90 ms", "/ copy_"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    for v, s in wk["stats_ms"].items():
        t.add_row(v, _ms(s["median"]), f"{_ms(s['p10'])}-{_ms(s['p90'])}", _x(wk["over_copy"][v]))
    return t


def print_report(doc: dict[str, Any], console: Any = None) -> None:
    """One block of tables per preset: maintenance, ratios, targets, scaling, kernels."""
    from rich.console import Console

    console = console or Console()
    for name, rec in doc["presets"].items():
        if "maintenance_stats_ms" in rec:
            console.print(_maintenance_table(name, rec))
            console.print(_ratios_line(rec))
            console.print(_counted_line(rec), style="dim")
            line = _transient_line(rec)
            if line:
                console.print(line, style="dim")
        if rec.get("scaling"):
            console.print(_scaling_table(name, rec["scaling"]))
        if rec.get("counts"):
            console.print(_counts_table(name, rec))
        if rec.get("scored"):
            console.print(_scored_table(name, rec["scored"]))
        if rec.get("write_kernels"):
            console.print(_write_kernels_table(name, rec["write_kernels"]))
            for n in rec["write_kernels"]["notes"]:
                console.print(f"note: {n}", style="dim")
        if "targets" in rec:
            console.print(_targets_table(name, rec))
        for n in rec.get("notes", []):
            console.print(f"[yellow]note[/]: {n}")
        console.print()


_STYLE = {"current": ("tab:red", "o"), "flashdreams": ("tab:orange", "s"), "ring": ("tab:blue", "^"), "floor": ("0.4", "v")}


def plot_scaling(doc: dict[str, Any], path: str | Path) -> Path | None:
    """Maintenance time vs window size per cache, one panel per preset with a scaling
    sweep (median, p10-p90 band, log scale). None if no preset has one."""
    presets = [(n, r["scaling"]) for n, r in doc["presets"].items() if r.get("scaling")]
    if not presets:
        return None
    plt = pyplot()

    ncols = min(2, len(presets))
    nrows = -(-len(presets) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.0 * ncols, 4.2 * nrows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(presets):]:
        ax.set_visible(False)
    for ax, (name, sc) in zip(flat, presets):
        w = sc["windows_frames"]
        flagged = sc.get("contended_included", {})
        for k in SUBJECTS:
            m = sc["maintenance_ms"][k]
            if all(x is None for x in m):
                continue
            color, marker = _STYLE[k]
            ax.plot(w, m, marker=marker, color=color, label=LABELS[k])
            ax.fill_between(w, sc["p10_ms"][k], sc["p90_ms"][k], color=color, alpha=0.15, linewidth=0)
            bad = [(x, y) for x, y, f in zip(w, m, flagged.get(k) or [False] * len(w)) if f and y is not None]
            if bad:  # contended samples included: hollow, larger marker
                ax.scatter(*zip(*bad), s=120, facecolors="white", edgecolors=color, marker=marker, zorder=3)
        ax.set_yscale("log")
        ax.set_xticks(w)
        ax.set_xlabel(f"window (frames), chunk {sc['chunk_frames']}, sink {sc['sink_frames']}")
        ax.set_ylabel("maintenance per step and layer (ms)")
        ax.set_title(name)
        ax.grid(True, which="both", alpha=0.3)
    flat[0].legend(fontsize=8)
    dev = doc["versions"]["device_name"]
    fig.suptitle(f"cache maintenance per step and layer vs window (median, p10-p90 band; hollow: contended "
                 f"samples included) on {dev}", fontsize=10)
    return save(fig, path, dpi=120)
