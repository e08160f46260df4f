"""``streamkv chart``, its timed half: per shape and row (:mod:`.chart_rows`), what one steady
chunk costs one layer of the cache, attention and every piece of cache work together.

A **chunk** (what ``ms_per_chunk`` times): ``begin_tokens(span)``, then for every layer
``attend(q, cache.layer(i).update(k, v, q))`` (the write, the policy's queries, the read, a
scored kind's statistics in that read, a tier's certificate), then ``commit()`` (a scored kind
selects and evicts; the tier quantises what tier 1 evicted). Eager, and compiled: the forward
(every layer's update and read) under ``torch.compile(fullgraph=True)``, begin and commit eager
(host plans). Every cache has wrapped before it is timed (steady state).

``cache_work_ms`` (eager, the ring, the full cache and the scored kinds): the same chunk without
attention: begin, every layer's write, the statistics a scored kind receives from attention
(synthetic, as :mod:`.scored` prices them), commit.

All of a shape's rows (both modes and the cache work) are timed in the same interleaved rounds
(:func:`~streamkv_lab.measure.time_interleaved`); ratios are to the ``full/bf16`` row of the same
mode. Counts per steady chunk: host syncs and allocations at the dispatcher
(:func:`~streamkv_lab.measure.count_dispatch`; compiled: begin and commit there, the forward by
its captured graph's synchronising ops and the allocator's events during its call, as ``bench``
counts a compiled write) and the allocator's events of the whole chunk
(:func:`~streamkv_lab.measure.probe_transient`).

A **loaded machine** (``load`` processes spinning on the CPUs, ``streamkv chart --load N``): the
eager chunks timed again in rounds of their own, every sample kept; each row's ratio to the full
cache under load over its quiet ratio is its ``load_slowdown`` (many small ops each wait for a
CPU: a row's advantage shrinks where its time is in them).
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from streamkv.attention import attend
from streamkv_lab.bench.chart_rows import Geometry, Row, build_row_cache, held_bytes
from streamkv_lab.bench.reads import load_average, own_code
from streamkv_lab.bench.shapes import Shape
from streamkv_lab.measure import Stats, count_compiled, count_dispatch, probe_transient, spin_load, time_interleaved

__all__ = ["measure_chart_shape", "shape_geometry"]


def shape_geometry(shape: Shape, layers: int) -> Geometry:
    return Geometry(full=shape.capacity, sink=shape.sink, span=shape.fill, unit=shape.tokens_per_frame,
                    heads=shape.heads, head_dim=shape.head_dim, layers=layers)


class _Subject:
    """One row's cache at a shape, in the steady state, and its steps."""

    def __init__(self, row: Row, shape: Shape, layers: int, seed: int) -> None:
        self.row, self.shape, self.layers = row, shape, layers
        self.cache, self.tier, self.caps = build_row_cache(row, shape_geometry(shape, layers),
                                                           dtype=shape.torch_dtype, causal=shape.causal)
        g = torch.Generator().manual_seed(seed)
        D, dt = shape.head_dim, shape.torch_dtype
        self.k, self.v = (torch.randn(1, shape.span, shape.heads, D, generator=g).to(dt) for _ in range(2))
        self.q = torch.randn(1, shape.span, shape.q_heads, D, generator=g).to(dt)
        self.fill_k, self.fill_v = (torch.randn(1, shape.fill, shape.heads, D, generator=g).to(dt) for _ in range(2))
        st = self.cache.storage
        ksum = torch.rand(st.heads, st.slots, generator=g, dtype=torch.float64)
        self.stats = (ksum / ksum.sum(-1, keepdim=True), ksum / ksum.sum(-1, keepdim=True) * shape.span)
        self.scored = self.cache.needs_queries
        for _ in range(-(-self.caps.get("tier2", 0) // shape.fill) + self.cache.layout.capacity // shape.fill + 2):
            self._work(self.fill_k, self.fill_v, shape.fill)  # past the first wrap (and tier 2 full)
        #: what the row holds here, at a fixed point of the stream (tier 3 grows with it: measured after
        #: the timing rounds, its boxes would depend on how many chunks they ran)
        self.held = held_bytes(self.cache, self.tier)
        #: how the steady reads treat empty slots (what the eager default picks now), given to every
        #: update: left to the default, a traced forward reads the host counter it is decided from
        #: (a guard on the stream's end, a recompilation after the first chunk)
        self.occupancy = self.cache.occupancy()

    def _work(self, k: torch.Tensor, v: torch.Tensor, n: int) -> None:
        c = self.cache
        c.begin_tokens(n)
        for i in range(self.layers):
            c.write(k, v, layer=i)
            if self.scored:
                c.policy.receive(i, *self.stats)
        c.commit()

    def work(self) -> None:
        """The chunk without attention (the module docstring's ``cache_work_ms``)."""
        self._work(self.k, self.v, self.shape.span)

    def forward(self) -> Callable[..., Any]:
        cache, layers, causal, occ = self.cache, self.layers, self.shape.causal, self.occupancy

        def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
            return [attend(q, cache.layer(i).update(k, v, q, occupancy=occ), causal=causal)[0] for i in range(layers)]

        return fwd

    def chunk(self, fwd: Callable[..., Any]) -> None:
        self.cache.begin_tokens(self.shape.span)
        fwd(self.q, self.k, self.v)
        self.cache.commit()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _eager_counts(s: _Subject, fwd: Callable[..., Any]) -> dict[str, Any]:
    c = count_dispatch(lambda: s.chunk(fwd))
    mem = probe_transient(lambda: s.chunk(fwd), "cpu", steps=1)
    return {"host_syncs_per_chunk": c.host_syncs, "syncs": c.syncs, "allocations_per_chunk": c.allocations,
            "alloc_bytes_per_chunk": c.alloc_bytes, "allocator_events_per_chunk": mem.allocations,
            "allocator_bytes_per_chunk": mem.allocated_bytes}


def _compiled_counts(s: _Subject, fwd: Callable[..., Any], graph_syncs: int) -> dict[str, Any]:
    begin = count_dispatch(lambda: s.cache.begin_tokens(s.shape.span))
    mem = probe_transient(lambda: fwd(s.q, s.k, s.v), "cpu", steps=1)
    commit = count_dispatch(lambda: s.cache.commit())
    whole = probe_transient(lambda: s.chunk(fwd), "cpu", steps=1)
    return {"host_syncs_per_chunk": begin.host_syncs + commit.host_syncs + graph_syncs,
            "syncs": dict(Counter(begin.syncs) + Counter(commit.syncs)),
            "allocations_per_chunk": begin.allocations + commit.allocations + mem.allocations,
            "alloc_bytes_per_chunk": begin.alloc_bytes + commit.alloc_bytes + mem.allocated_bytes,
            "allocator_events_per_chunk": whole.allocations, "allocator_bytes_per_chunk": whole.allocated_bytes}


def measure_chart_shape(shape: Shape, rows: Sequence[Row], *, layers: int = 1, modes: Sequence[str] = ("eager",),
                        repeats: int = 5, backend: str = "inductor", seed: int = 0, load: int = 0,
                        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every row at ``shape`` (module docstring): ``{"rows": {key: record}, "timing", "notes"}``; a
    record holds per mode ``ms_per_chunk`` (median), its p10/p90, ``ratio_to_full``, the counts,
    and ``cache_work_ms`` / ``cache_work_ratio_to_ring`` where measured; a row the library refuses
    at this shape holds ``not_run`` (the refusal). ``load``: the eager chunks are timed a second
    time with that many processes spinning on the CPUs (:func:`~streamkv_lab.measure.spin_load`),
    every sample kept: ``loaded_ms_per_chunk``, ``loaded_ratio_to_full`` and ``load_slowdown`` (the
    loaded ratio over the quiet one: what a loaded machine does to the row's advantage)."""
    import torch._dynamo

    say = progress or (lambda msg: None)
    subjects: dict[str, _Subject] = {}
    out: dict[str, dict[str, Any]] = {}
    steps: dict[str, Callable[[], None]] = {}
    torch._dynamo.reset()
    with torch.no_grad():
        for i, row in enumerate(rows):
            rec: dict[str, Any] = {**row.to_dict()}
            out[row.key] = rec
            say(f"chart {shape.name}: building {row.key}")
            try:
                s = _Subject(row, shape, layers, seed + i)
            except (ValueError, TypeError) as exc:  # the library refuses this budget at this shape
                rec["not_run"] = _first_line(exc)
                continue
            subjects[row.key] = s
            rec.update(tokens=s.cache.storage.slots + s.caps.get("tier2", 0), capacities=s.caps)
            eager = s.forward()
            for mode in modes:
                m: dict[str, Any] = {}
                rec[mode] = m
                if mode == "eager":
                    s.chunk(eager)
                    m.update(_eager_counts(s, eager))
                    steps[f"{row.key}|eager"] = (lambda s=s, f=eager: s.chunk(f))
                    continue
                say(f"chart {shape.name}: compiling {row.key}")
                t0 = time.perf_counter()
                try:
                    fn, cc = count_compiled(own_code(eager, f"chart_forward_{i}"), [s.chunk] * 3, backend=backend)
                except Exception as exc:  # noqa: BLE001 - a forward that does not compile is a finding, recorded
                    m["not_run"] = _first_line(exc)
                    if s.cache.is_open:  # the failed call's chunk: finished eagerly (tracing wrote nothing)
                        eager(s.q, s.k, s.v)
                        s.cache.commit()
                    continue
                m.update(compile_s=time.perf_counter() - t0, graphs=cc.graphs, recompiles=cc.recompiles,
                         graph_breaks=cc.graph_breaks, graph_syncs=cc.graph_syncs)
                m.update(_compiled_counts(s, fn, cc.graph_syncs))
                steps[f"{row.key}|compiled"] = (lambda s=s, f=fn: s.chunk(f))
            if s.tier is None and "eager" in modes:
                steps[f"{row.key}|work"] = s.work
        say(f"chart {shape.name}: timing {len(steps)} steps, interleaved")
        load_before = load_average()
        run = time_interleaved(steps, repeats=repeats, device="cpu", warmup=1, warmup_s=0.0)
        load_after = load_average()
        loaded = None
        if load:
            eager_steps = {k: f for k, f in steps.items() if k.endswith("|eager")}
            say(f"chart {shape.name}: timing {len(eager_steps)} eager chunks with {load} process(es) spinning")
            with spin_load(load):
                loaded = time_interleaved(eager_steps, repeats=repeats, device="cpu", warmup=1, warmup_s=0.0,
                                          keep_contended=True)
    for key, samples in run.samples_ms.items():
        rk, what = key.rsplit("|", 1)
        st = Stats.of(samples)
        if what == "work":
            out[rk]["cache_work_ms"] = st.median
            continue
        out[rk][what].update(ms_per_chunk=st.median, p10_ms=st.p10, p90_ms=st.p90,
                             ms_per_chunk_per_layer=st.median / layers, contended=run.included[key])
    for rk, s in subjects.items():
        out[rk].update(s.held)
        if s.tier is not None:
            out[rk]["certify_seconds"] = s.tier.stats["certify_seconds"]
    for key, samples in (loaded.samples_ms.items() if loaded is not None else ()):
        out[key.rsplit("|", 1)[0]]["eager"]["loaded_ms_per_chunk"] = Stats.of(samples).median
    full = out.get("full/bf16/all", {})
    for rec in out.values():
        for mode in modes:
            m = rec.get(mode)
            if m is not None and m.get("ms_per_chunk") is not None:
                base = full.get(mode, {}).get("ms_per_chunk")
                m["ratio_to_full"] = m["ms_per_chunk"] / base if base else None
            if m is not None and m.get("loaded_ms_per_chunk") is not None:
                base = full.get(mode, {}).get("loaded_ms_per_chunk")
                m["loaded_ratio_to_full"] = m["loaded_ms_per_chunk"] / base if base else None
                quiet = m.get("ratio_to_full")
                m["load_slowdown"] = m["loaded_ratio_to_full"] / quiet if quiet and base else None
        if "bytes" in rec and "bytes" in full:
            rec["bytes_ratio_to_full"] = rec["bytes"] / full["bytes"]
    ring = {k.split("/", 1)[1]: r.get("cache_work_ms") for k, r in out.items() if r["cache"] == "ring"}
    for rec in out.values():
        w, base = rec.get("cache_work_ms"), ring.get(rec["key"].split("/", 1)[1])
        rec["cache_work_ratio_to_ring"] = w / base if w is not None and base else None
    subjects.clear()
    gc.collect()
    torch._dynamo.reset()
    return {"rows": out, "layers": layers, "modes": list(modes),
            "timing": {**run.to_dict(), "repeats": repeats, "load_average_before": load_before,
                       "load_average_after": load_after, "threads": torch.get_num_threads(),
                       "load_processes": load,
                       "loaded": None if loaded is None else {"foreign_cpu_share": loaded.foreign_load,
                                                              "rounds": loaded.rounds}}}
