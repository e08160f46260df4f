"""The scored kinds priced: what mass, H2O and TOVA cost per steady chunk against the ring, by
phase, and where the commit's time goes.

One steady chunk of one layer, as :mod:`.counts` builds it: ``begin_chunk`` (the lowest free
window slots per head: ``topk``), ``write`` (an ``index_put_`` of (slot, head) pairs), the
statistics attention hands the policy (``receive``: synthetic and fixed, so that the attention
itself is not timed), ``commit_chunk`` (selection: sorts, cumulative sums, the eviction mask; one
host read of the flags and one of the finiteness check). The ring's step is the reference.

Reported (:func:`price_scored`): the whole step of each kind interleaved with the ring's
(``time_interleaved``), each phase timed apart, the ratios ``commit / ring step`` and
``step / ring step``, and a profile of the commit by aten op (self time, grouped: statistics,
selection, synchronisation, apply). ``attention``: one block of queries through the read each
kind gets (the ring: one SDPA kernel over the buffer; a scored kind: the explicit softmax with
statistics) at the preset's key count, the model's cost a scored kind adds, apart.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import torch

from streamkv.attention import attend
from streamkv_lab.bench.counts import SCORED, build_count_subject
from streamkv_lab.bench.presets import Preset
from streamkv_lab.measure import Stats, check_device, sync, time_interleaved

__all__ = ["price_scored", "COMMIT_GROUPS"]

#: aten ops of a scored commit, by what they are for
COMMIT_GROUPS: dict[str, tuple[str, ...]] = {
    "synchronisation": ("aten::_local_scalar_dense", "aten::item", "aten::stack", "aten::is_nonzero"),
    "finiteness check": ("aten::isfinite", "aten::abs", "aten::ne", "aten::eq", "aten::mul", "aten::all"),
    "sort / order": ("aten::sort", "aten::argsort", "aten::gather"),
    "selection arithmetic": ("aten::where", "aten::cumsum", "aten::sum", "aten::clamp", "aten::minimum", "aten::lt",
                             "aten::le", "aten::gt", "aten::ge", "aten::bitwise_and", "aten::bitwise_or_",
                             "aten::bitwise_not", "aten::rsub", "aten::sub", "aten::add", "aten::arange",
                             "aten::unsqueeze", "aten::scalar_tensor"),
    "eviction mask": ("aten::zeros_like", "aten::scatter", "aten::_to_copy", "aten::to"),
    "apply (masked_fill_, counters)": ("aten::masked_fill_", "aten::add_", "aten::copy_"),
}


def _group(op: str) -> str:
    for group, ops in COMMIT_GROUPS.items():
        if op in ops:
            return group
    return "other"


def _phase_times(subject: Any, device: torch.device, repeats: int) -> dict[str, Stats]:
    samples: dict[str, list[float]] = {name: [] for name, _ in subject.phases}
    for _ in range(repeats):
        for name, fn in subject.phases:
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            samples[name].append((time.perf_counter() - t0) * 1e3)
    return {name: Stats.of(s) for name, s in samples.items()}


def _profile_phase(subject: Any, phase: str) -> dict[str, float]:
    """Self CPU time (ms) per aten op of one call of ``phase`` (the other phases run unprofiled)."""
    from torch.profiler import ProfilerActivity, profile

    from streamkv_lab.measure.memory import _native_stderr_muted

    out: dict[str, float] = {}
    for name, fn in subject.phases:
        if name != phase:
            fn()
            continue
        with _native_stderr_muted(), profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        for e in prof.key_averages():
            if e.key.startswith("aten::") and e.self_cpu_time_total > 0:
                out[e.key] = out.get(e.key, 0.0) + e.self_cpu_time_total / 1e3
    return out


def _attention_block(preset: Preset, device: torch.device, rows: int, repeats: int) -> dict[str, Any]:
    """One block of ``rows`` queries through the ring's read and a scored kind's read."""
    out: dict[str, Any] = {"query_rows": rows, "keys": preset.capacity}
    for key in ("ring", "tova"):
        subject, _ = build_count_subject(key, preset, device)
        g = torch.Generator(device="cpu").manual_seed(3)
        q = torch.randn(preset.batch, rows, preset.heads, preset.head_dim, generator=g).to(device=device,
                                                                                          dtype=preset.torch_dtype)
        with torch.no_grad():
            ph = dict(subject.phases)
            ph["begin"]()
            ph["write"]()
            read = subject.obj.read(0)
            times = []
            for _ in range(repeats):
                sync(device)
                t0 = time.perf_counter()
                attend(q, read)
                sync(device)
                times.append((time.perf_counter() - t0) * 1e3)
        out[f"{key}_ms"] = Stats.of(times).median
        out[f"{key}_path"] = "one SDPA kernel over the buffer" if key == "ring" else \
            "explicit softmax with per-key statistics (blockwise), over an fp32 copy of K/V"
        del subject, read
        gc.collect()
    out["scored_over_ring"] = out["tova_ms"] / out["ring_ms"] if out["ring_ms"] > 0 else None
    return out


def price_scored(preset: Preset, device: torch.device | str, *, repeats: int = 10, warmup: int = 2,
                 warmup_s: float = 0.25, attention_rows: int = 256, attention_repeats: int = 3,
                 progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The scored kinds against the ring at ``preset`` (module docstring); JSON-ready."""
    device = check_device(device)
    subjects = {}
    for key in ("ring", *SCORED):
        if progress is not None:
            progress(f"scored: building {key}")
        subjects[key], _ = build_count_subject(key, preset, device)
    try:
        with torch.no_grad():
            if progress is not None:
                progress("scored: timing the steps interleaved")
            timing = time_interleaved({k: s.step for k, s in subjects.items()}, repeats=repeats, device=device,
                                      warmup=warmup, warmup_s=warmup_s)
            step = {k: Stats.of(v).median for k, v in timing.samples_ms.items()}
            phases = {k: {n: st.median for n, st in _phase_times(s, device, repeats).items()}
                      for k, s in subjects.items()}
            profiles = {k: _profile_phase(subjects[k], "commit") for k in SCORED}
    finally:
        subjects.clear()
        gc.collect()
    ring = step["ring"]
    kinds: dict[str, Any] = {}
    for k in SCORED:
        prof = profiles[k]
        total = sum(prof.values()) or 1.0
        groups: dict[str, float] = {}
        for op, ms in prof.items():
            groups[_group(op)] = groups.get(_group(op), 0.0) + ms
        kinds[k] = {
            "step_ms": step[k], "phases_ms": phases[k],
            "commit_over_ring_step": phases[k]["commit"] / ring if ring else None,
            "step_over_ring_step": step[k] / ring if ring else None,
            "begin_write_over_ring_step": (phases[k]["begin"] + phases[k]["write"]) / ring if ring else None,
            "commit_profile_ms": dict(sorted(prof.items(), key=lambda kv: -kv[1])),
            "commit_groups_share": {g: ms / total for g, ms in sorted(groups.items(), key=lambda kv: -kv[1])},
        }
    out: dict[str, Any] = {"ring_step_ms": ring, "ring_phases_ms": phases["ring"], "kinds": kinds,
                           "repeats": repeats, "timing": timing.to_dict()}
    if attention_rows:
        if progress is not None:
            progress("scored: one block of attention")
        out["attention"] = _attention_block(preset, device, min(attention_rows, preset.chunk), attention_repeats)
    return out
