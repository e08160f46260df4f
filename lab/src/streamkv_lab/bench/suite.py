"""The benchmark run: options, sections, one record per preset, targets.

A run measures each preset through a list of *sections*. A section is a function
``(preset, options, device) -> dict`` whose keys are merged into the preset's record;
:data:`SECTIONS` holds them in run order:

``maintenance``
    the per-step cache maintenance of every cache and the floor, bytes moved,
    transient memory (:mod:`~streamkv_lab.bench.maintenance`); top-level keys
    ``maintenance_ms``, ``floor_ms``, ``ratio_*``, ``bytes_moved``, ``transient_bytes``...
``scaling``
    maintenance time vs window size at the preset's chunk and sink: key ``scaling``.
``counts``
    what each cache and peer dispatches per steady chunk, eager and compiled where it applies
    (:mod:`~streamkv_lab.bench.counts`): keys ``ops_per_chunk``, ``host_syncs_per_chunk``,
    ``allocations_per_chunk``, ``alloc_bytes_per_chunk`` (and their ``*_compiled``),
    ``bytes_written_per_chunk``, ``read_attention``, ``ops_per_write``, ``ring_write_ops_by_window``,
    ``counts`` (everything, per subject).
``write_kernels`` (opt-in)
    the ring's write kernel and slot plan apart (:mod:`~streamkv_lab.bench.kernels`).

The record of a preset (:func:`run_preset`) also holds ``preset`` (its config), ``versions``,
``options``, ``notes`` and ``targets`` (evaluated last, from whatever sections ran).

Why one module: the options, the sections and the targets are the run; each section is a few lines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from streamkv_lab.bench.maintenance import PEER_SUBJECTS, SUBJECTS, analytic_bytes, measure_maintenance
from streamkv_lab.measure import check_device
from streamkv_lab.env import environment, threads
from streamkv_lab.bench.presets import Preset, get_preset

__all__ = [
    "BenchOptions",
    "SECTIONS",
    "OPTIONAL_SECTIONS",
    "SCHEMA",
    "TARGETS",
    "COUNT_TARGETS",
    "run_bench",
    "run_preset",
    "evaluate_targets",
]

SCHEMA = "streamkv_lab.bench/1"

Section = Callable[[Preset, "BenchOptions", torch.device], dict[str, Any]]


@dataclass(frozen=True)
class BenchOptions:
    """How to measure (recorded with every result).

    Args:
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"``).
        repeats: timed steps per subject after warm-up; None: the preset's default.
        scaling_repeats: the same for each window of the scaling sweep; None: a third
            of ``repeats`` (at least 5).
        warmup, warmup_s: warm-up rounds, and the least warm-up time in seconds.
        threads: ``torch.set_num_threads`` for the run; None: leave torch's default.
        transient_steps: steady steps probed for transient memory (0: skip).
        count_bytes: also count bytes written per aten op (one extra step).
        sections: sections to run, by name (default: maintenance, scaling and counts).
        seed: of the chunk K/V.
        compiled_counts: the counts section also compiles each cache's write (``torch.compile``).
        compile_backend: the backend of those compilations (``"inductor"``; ``"aot_eager"`` runs
            the same graph op by op: faster to build, but it copies mutated inputs back).
    """

    device: str = "cpu"
    repeats: int | None = None
    scaling_repeats: int | None = None
    warmup: int = 3
    warmup_s: float = 0.25
    threads: int | None = None
    transient_steps: int = 3
    count_bytes: bool = True
    sections: tuple[str, ...] = ("maintenance", "scaling", "counts")
    seed: int = 0
    compiled_counts: bool = True
    compile_backend: str = "inductor"

    def __post_init__(self) -> None:
        for name in ("repeats", "scaling_repeats", "threads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
        if self.warmup < 0 or self.warmup_s < 0 or self.transient_steps < 0:
            raise ValueError(
                f"warmup, warmup_s and transient_steps must be >= 0, got {self.warmup}, {self.warmup_s}, {self.transient_steps}"
            )

    def repeats_for(self, preset: Preset) -> int:
        return self.repeats if self.repeats is not None else preset.repeats

    def scaling_repeats_for(self, preset: Preset) -> int:
        if self.scaling_repeats is not None:
            return self.scaling_repeats
        return max(5, self.repeats_for(preset) // 3)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["sections"] = list(self.sections)
        return d


# ================================================================ sections
def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


#: above this share of the machine used by other processes during a timing, say so
FOREIGN_LOAD_NOTE = 0.10


def _disturbance_notes(what: str, timing: Any) -> list[str]:
    notes = []
    if timing.foreign_load is not None and timing.foreign_load > FOREIGN_LOAD_NOTE:
        notes.append(f"{what}: other processes used {timing.foreign_load:.0%} of the CPUs while it was timed")
    left_out = {n: c for n, c in timing.contended.items() if c and not timing.included[n]}
    if left_out:
        notes.append(f"{what}: contended samples left out (preempted or stalled): "
                     + ", ".join(f"{n} {c}" for n, c in left_out.items()))
    kept = [n for n, inc in timing.included.items() if inc]
    if kept:
        notes.append(f"{what}: too few clean samples for {', '.join(kept)} "
                     f"({', '.join(str(timing.clean[n]) for n in kept)}): contended samples INCLUDED, treat as noisy")
    return notes


def maintenance_section(preset: Preset, options: BenchOptions, device: torch.device) -> dict[str, Any]:
    """Keys: maintenance_ms, maintenance_stats_ms, floor_ms, ratio_current_over_ring,
    ratio_flashdreams_over_ring, ratio_ring_over_floor, bytes_moved, achieved_gb_per_s,
    transient_bytes, notes; at a preset with peers also one key per peer (:func:`_peer_record`),
    and the peers' subjects in maintenance_stats_ms, bytes_moved and transient_bytes."""
    r = measure_maintenance(
        preset, device, repeats=options.repeats_for(preset), warmup=options.warmup, warmup_s=options.warmup_s,
        transient_steps=options.transient_steps, count_bytes=options.count_bytes, seed=options.seed,
    )
    med = {k: r.median(k) for k in SUBJECTS}
    keys = SUBJECTS + tuple(k for peer in preset.peers for k in PEER_SUBJECTS[peer])
    bytes_moved: dict[str, Any] = {k: None for k in keys}  # None: the subject did not run
    for k, b in r.analytic.items():
        bytes_moved[k] = b.to_dict()
        if k in r.counted:
            bytes_moved[k]["counted"] = r.counted[k].to_dict()
    transient: dict[str, Any] = {k: None for k in keys}
    transient.update({k: t.to_dict() for k, t in r.transient.items()})
    out = {
        "maintenance_ms": {k: med[k] for k in SUBJECTS if k != "floor"},
        "maintenance_stats_ms": {k: s.to_dict() for k, s in r.stats.items()},
        "floor_ms": med["floor"],
        "ratio_current_over_ring": _ratio(med["current"], med["ring"]),
        "ratio_flashdreams_over_ring": _ratio(med["flashdreams"], med["ring"]),
        "ratio_ring_over_floor": _ratio(med["ring"], med["floor"]),
        "bytes_moved": bytes_moved,
        "achieved_gb_per_s": {
            k: (r.analytic[k].traffic / (med[k] * 1e-3) / 1e9 if med[k] else None) for k in SUBJECTS
        },
        "transient_bytes": transient,
        "page_faults": {k: r.page_faults.get(k) for k in SUBJECTS},
        "timing_repeats": options.repeats_for(preset),
        "timing": r.timing.to_dict(),
        "notes": r.notes + _disturbance_notes("maintenance", r.timing),
    }
    for peer in preset.peers:  # new keys only at presets with peers (bytes and transients are in the maps above)
        out[peer] = _peer_record(peer, r, preset, med["floor"])
    return out


def _peer_record(peer: str, r: Any, preset: Preset, floor: float | None) -> dict[str, Any]:
    """Key ``<peer>`` (e.g. ``sglang``): the original's and the drop-in's median maintenance, their
    ratio, the drop-in over the floor, achieved GB/s and page faults (None: the subject did not run)."""
    original, drop_in = PEER_SUBJECTS[peer]
    med = {k: r.median(k) for k in (original, drop_in)}
    return {
        "maintenance_ms": med,
        f"ratio_{original}_over_{drop_in}": _ratio(med[original], med[drop_in]),
        f"ratio_{drop_in}_over_floor": _ratio(med[drop_in], floor),
        "achieved_gb_per_s": {k: (analytic_bytes(k, preset).traffic / (m * 1e-3) / 1e9 if m else None)
                              for k, m in med.items()},
        "page_faults": {k: r.page_faults.get(k) for k in med},
    }


def scaling_section(preset: Preset, options: BenchOptions, device: torch.device) -> dict[str, Any]:
    """Key ``scaling``: per subject, the median (and p10/p90) maintenance time at each
    window of ``preset.scaling_windows``, the chunk and sink fixed."""
    windows = list(preset.scaling_windows)
    if not windows:
        return {"scaling": None}
    repeats = options.scaling_repeats_for(preset)
    med: dict[str, list[float | None]] = {k: [] for k in SUBJECTS}
    p10: dict[str, list[float | None]] = {k: [] for k in SUBJECTS}
    p90: dict[str, list[float | None]] = {k: [] for k in SUBJECTS}
    written: dict[str, list[int | None]] = {k: [] for k in SUBJECTS}
    faults: dict[str, list[int | None]] = {k: [] for k in SUBJECTS}
    contended: dict[str, list[bool | None]] = {k: [] for k in SUBJECTS}
    notes: list[str] = []
    timing: list[dict[str, Any]] = []
    for w in windows:
        p = preset.with_window(w)
        r = measure_maintenance(
            p, device, repeats=repeats, warmup=options.warmup, warmup_s=options.warmup_s, transient_steps=0,
            count_bytes=False, seed=options.seed,
        )
        notes.extend(n for n in r.notes + _disturbance_notes(f"scaling window {w}", r.timing) if n not in notes)
        timing.append(r.timing.to_dict())
        for k in SUBJECTS:
            s = r.stats.get(k)
            med[k].append(None if s is None else s.median)
            p10[k].append(None if s is None else s.p10)
            p90[k].append(None if s is None else s.p90)
            written[k].append(r.analytic[k].written_total if k in r.analytic else None)
            faults[k].append(r.page_faults.get(k))
            contended[k].append(r.timing.included.get(k) if s is not None else None)
    out: dict[str, Any] = {
        "windows_frames": windows,
        "chunk_frames": preset.chunk_frames,
        "sink_frames": preset.sink_frames,
        "repeats": repeats,
        "maintenance_ms": med,
        "p10_ms": p10,
        "p90_ms": p90,
        "written_bytes": written,
        "page_faults": faults,
        "contended_included": contended,
        "timing": timing,
    }
    if 21 in windows and 63 in windows:
        i, j = windows.index(21), windows.index(63)
        out["growth_63_over_21"] = {k: _ratio(med[k][j], med[k][i]) for k in SUBJECTS}
    return {"scaling": out, "notes": notes}


def write_kernels_section(preset: Preset, options: BenchOptions, device: torch.device) -> dict[str, Any]:
    """Key ``write_kernels``: the ring's write kernel variants and slot plan, apart."""
    from streamkv_lab.bench.kernels import measure_write_kernels

    return {
        "write_kernels": measure_write_kernels(
            preset, device, repeats=options.repeats_for(preset), warmup=options.warmup,
            warmup_s=options.warmup_s, seed=options.seed,
        )
    }


def counts_section(preset: Preset, options: BenchOptions, device: torch.device) -> dict[str, Any]:
    """What each cache and peer dispatches per steady chunk (:mod:`~streamkv_lab.bench.counts`):
    the four per-chunk maps of the issue (eager, and ``*_compiled`` where the write compiles),
    bytes written, the read, ops per write, and the ring's write ops against the window."""
    from streamkv_lab.bench.counts import COUNT_SUBJECTS, count_preset, write_ops_by_window

    r = count_preset(preset, device, subjects=COUNT_SUBJECTS, compiled=options.compiled_counts,
                     compile_backend=options.compile_backend, seed=options.seed)
    per = r["subjects"]

    def eager(key: str) -> dict[str, int | None]:
        return {k: (None if c is None else c["step"][key]) for k, c in per.items()}

    def compiled(key: str) -> dict[str, int | None]:
        return {k: (None if c is None or c["compiled"] is None else c["compiled"][key]) for k, c in per.items()}

    return {
        "ops_per_chunk": eager("ops"),
        "host_syncs_per_chunk": eager("host_syncs"),
        "allocations_per_chunk": eager("allocations"),
        "alloc_bytes_per_chunk": eager("alloc_bytes"),
        "ops_per_chunk_compiled": compiled("ops_per_chunk"),
        "host_syncs_per_chunk_compiled": compiled("host_syncs_per_chunk"),
        "allocations_per_chunk_compiled": compiled("allocations_per_chunk"),
        "alloc_bytes_per_chunk_compiled": compiled("alloc_bytes_per_chunk"),
        "recompiles_after_warmup": compiled("recompiles"),
        "allocator_events_per_chunk": {k: (None if c is None else c["allocator"]["allocations"]) for k, c in per.items()},
        "allocator_bytes_per_chunk": {k: (None if c is None else c["allocator"]["allocated_bytes"])
                                      for k, c in per.items()},
        "bytes_written_per_chunk": {k: (None if c is None else c["written"]["total"]) for k, c in per.items()},
        "read_attention": {k: (None if c is None else c["read"]["attention"]) for k, c in per.items()},
        "ops_per_write": {k: (None if c is None or "write" not in c["phases"] else c["phases"]["write"]["ops"])
                          for k, c in per.items()},
        "ring_write_ops_by_window": write_ops_by_window(preset, device),
        "counts": {"subjects": per, "compiled": options.compiled_counts, "compile_backend": options.compile_backend},
        "notes": r["notes"],
    }


def scored_section(preset: Preset, options: BenchOptions, device: torch.device) -> dict[str, Any]:
    """Key ``scored``: mass, H2O and TOVA per steady chunk against the ring, by phase, and where
    their commit's time goes (:mod:`~streamkv_lab.bench.scored`)."""
    from streamkv_lab.bench.scored import price_scored

    r = price_scored(preset, device, repeats=options.repeats_for(preset), warmup=options.warmup,
                     warmup_s=options.warmup_s)
    return {"scored": r, "notes": _disturbance_notes("scored", _TimingView(r["timing"]))}


class _TimingView:
    """A ``TimingRun``'s JSON read back for :func:`_disturbance_notes`."""

    def __init__(self, d: dict[str, Any]) -> None:
        self.foreign_load = d.get("foreign_cpu_share")
        self.contended = d.get("contended_samples", {})
        self.included = d.get("contended_included", {})
        self.clean = d.get("clean_samples", {})


SECTIONS: dict[str, Section] = {
    "maintenance": maintenance_section,
    "scaling": scaling_section,
    "counts": counts_section,
    "scored": scored_section,
    "write_kernels": write_kernels_section,
}
#: sections that run only when asked for
OPTIONAL_SECTIONS = ("scored", "write_kernels")


# ================================================================= targets
#: the issue's targets: (key, description, threshold); checked on every preset (the ratio
#: against flashdreams is set at ``self-forcing``, the sglang one at the sglang presets; elsewhere
#: they are for reference)
TARGETS: tuple[tuple[str, str, float], ...] = (
    ("flashdreams_over_ring", "ring maintenance >= 40x less than flashdreams BlockKVCache (set at self-forcing)", 40.0),
    ("ring_over_floor", "ring within 1.05x of the floor", 1.05),
    ("ring_over_current", "ring never slower than the current path", 1.0),
    ("ring_growth_63_over_21", "ring flat (within 1.2x) from a 21- to a 63-frame window", 1.2),
    ("ring_transient_bytes", "zero transient bytes per steady ring step", 0.0),
    ("sglang_over_drop_in", "sglang's CausalSelfAttentionKVCache >= 10x the drop-in (sglang presets)", 10.0),
    ("ring_host_syncs", "0 host syncs per steady ring chunk, eager and compiled", 0.0),
    ("ring_allocations", "0 allocations per steady ring chunk, eager and compiled", 0.0),
    ("ring_write_ops_spread", "ring ops per layer write constant in the window length (max - min)", 0.0),
)
#: targets met from above (the others from below)
_AT_LEAST = {"flashdreams_over_ring", "sglang_over_drop_in"}
#: targets whose value is a count (the rest are ratios or bytes)
COUNT_TARGETS = ("ring_host_syncs", "ring_allocations", "ring_write_ops_spread")


def _worst(*values: int | None) -> int | None:
    got = [v for v in values if v is not None]
    return max(got) if got else None


def evaluate_targets(record: dict[str, Any]) -> dict[str, Any]:
    """Each target's value, threshold and verdict (``met`` None: not measured in this
    run); ``contended`` is True when a timing behind the value had too few clean
    samples (the verdict is then about a loaded machine, not the caches)."""
    scaling = record.get("scaling") or {}
    transient = (record.get("transient_bytes") or {}).get("ring")
    included = (record.get("timing") or {}).get("contended_included") or {}
    sg = record.get("sglang") or {}
    by_window = record.get("ring_write_ops_by_window") or {}
    ops = by_window.get("write_ops") or []
    counted = "ops_per_chunk" in record
    values = {
        "flashdreams_over_ring": record.get("ratio_flashdreams_over_ring"),
        "ring_over_floor": record.get("ratio_ring_over_floor"),
        "ring_over_current": (None if not record.get("ratio_current_over_ring") else
                              1.0 / record["ratio_current_over_ring"]),
        "ring_growth_63_over_21": (scaling.get("growth_63_over_21") or {}).get("ring"),
        "ring_transient_bytes": None if transient is None else transient["allocated_bytes"],
        "sglang_over_drop_in": sg.get("ratio_sglang_over_sglang_ring"),
        "ring_host_syncs": None if not counted else _worst(
            record["host_syncs_per_chunk"].get("ring"), record.get("host_syncs_per_chunk_compiled", {}).get("ring")),
        "ring_allocations": None if not counted else _worst(
            record["allocations_per_chunk"].get("ring"), record.get("allocations_per_chunk_compiled", {}).get("ring"),
            record.get("allocator_events_per_chunk", {}).get("ring")),
        "ring_write_ops_spread": (max(ops) - min(ops)) if ops else None,
    }
    flagged = (scaling.get("contended_included") or {}).get("ring") or []
    windows = scaling.get("windows_frames") or []
    contended = {
        "flashdreams_over_ring": bool(included.get("flashdreams") or included.get("ring")),
        "ring_over_floor": bool(included.get("ring") or included.get("floor")),
        "ring_over_current": bool(included.get("ring") or included.get("current")),
        "ring_growth_63_over_21": any(flagged[windows.index(w)] for w in (21, 63) if w in windows and flagged),
        "ring_transient_bytes": False,
        "sglang_over_drop_in": bool(included.get("sglang") or included.get("sglang_ring")),
        "ring_host_syncs": False,
        "ring_allocations": False,
        "ring_write_ops_spread": False,
    }
    out = {}
    for key, text, threshold in TARGETS:
        v = values[key]
        if v is None:
            met = None
        elif key in _AT_LEAST:
            met = v >= threshold
        else:
            met = v <= threshold
        out[key] = {"target": text, "value": v, "threshold": threshold, "met": met,
                    "contended": contended[key] if v is not None else None}
    return out


# ===================================================================== run
def run_preset(preset: Preset | str, options: BenchOptions, *, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every requested section at ``preset``: the preset's JSON record."""
    if isinstance(preset, str):
        preset = get_preset(preset)
    unknown = [s for s in options.sections if s not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown section(s) {unknown}; available: {', '.join(SECTIONS)}")
    device = check_device(options.device)
    with threads(options.threads):
        record: dict[str, Any] = {
            "preset": preset.to_dict(),
            "versions": environment(device),
            "options": options.to_dict(),
        }
        notes: list[str] = []
        for name in options.sections:
            if progress is not None:
                progress(f"{preset.name}: {name}")
            part = SECTIONS[name](preset, options, device)
            notes.extend(n for n in part.pop("notes", []) if n not in notes)
            record.update(part)
        record["notes"] = notes
        record["targets"] = evaluate_targets(record)
    return record


def run_bench(
    presets: Sequence[Preset | str], options: BenchOptions, *, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Run every preset; the JSON document: ``{"schema", "versions", "options", "presets": {name: record}}``."""
    device = check_device(options.device)
    resolved = [get_preset(p) if isinstance(p, str) else p for p in presets]
    if not resolved:
        raise ValueError("no preset to run")
    with threads(options.threads):
        env = environment(device)
    return {
        "schema": SCHEMA,
        "versions": env,
        "options": options.to_dict(),
        "presets": {p.name: run_preset(p, options, progress=progress) for p in resolved},
    }
