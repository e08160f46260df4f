"""What a fork costs at a benchmark preset (``streamkv fork --memory``): memory, time, reads.

One attention layer at a :mod:`~streamkv_lab.bench.presets` shape (as ``streamkv bench`` runs it:
``[batch, sink + window, heads, head_dim]``, the preset's dtype), the ring in pages
(``pages={"spare": ...}``, a page = a chunk), filled to a full window. Then:

- **memory**: ``fork(B)``, each branch writes one chunk; the pool's pages in use x bytes per page,
  against one cache's bytes (its own pages) and against ``B`` full copies. The arithmetic floor
  is ``1 + B x chunk / (sink + window)`` (every branch must store its own chunk): at
  self-forcing (3 of 21 frames, no sink) and ``B = 8`` that is 2.14x, above a 1.3x target,
  which no layout that stores each branch's chunk can meet.
- **fork time**: ``fork(B)`` (metadata: tables, slot positions, the plan), median of
  ``repeats``, against one chunk's attention: ``attend`` of a whole chunk of queries over the
  full window (the contiguous ring; ``attention_repeats`` calls).
- **reads and writes**, interleaved in one run (:func:`~streamkv_lab.measure.timing.time_interleaved`):
  the bench's read (``attend`` of ``READ_QUERIES`` query rows over the open chunk's read) on the
  unpaged ring, on a paged ring that never forked (its table the identity: the contiguous path)
  and on a forked branch whose table is no longer the identity (two of its pages moved); the
  chunk write of each. The three hold the same K/V: their reads' outputs are compared too.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import torch

from streamkv import RingCache
from streamkv.attention import attend
from streamkv.caches import KVCache
from streamkv_lab.bench.counts import READ_QUERIES
from streamkv_lab.bench.presets import Preset, get_preset
from streamkv_lab.measure.timing import Stats, time_interleaved

__all__ = ["TARGET_RATIO", "TARGET_FORK_SHARE", "TARGET_READ_RATIO", "page_report", "fork_memory"]

#: the issue's targets: pool bytes / one cache's bytes one chunk after an 8-way fork, fork time /
#: one chunk's attention time, paged read / contiguous read
TARGET_RATIO, TARGET_FORK_SHARE, TARGET_READ_RATIO = 1.3, 0.01, 1.1


def page_report(caches: list[KVCache]) -> dict[str, Any]:
    """The pool shared by ``caches`` (a cache and its branches): pages in use, bytes per page, one
    cache's own pages, and each cache's private pages (referenced by its table only)."""
    store = caches[0].storage.store
    table = store.table
    pool = table.pool
    page_bytes = sum(t.nbytes for t in store.paged()) // pool.capacity
    own = len(table.host)
    private = [sum(1 for p in c.storage.store.table.host if pool.refs[p] == 1) for c in caches]
    return {"pages_in_use": pool.used, "capacity_pages": pool.capacity, "page_rows": pool.page,
            "page_bytes": page_bytes, "bytes_in_use": pool.used * page_bytes, "one_cache_pages": own,
            "one_cache_bytes": own * page_bytes, "private_pages": private,
            "bytes_added": [p * page_bytes for p in private]}


def _chunk(preset: Preset, g: torch.Generator, rows: int | None = None) -> torch.Tensor:
    shape = (preset.batch, rows or preset.chunk, preset.heads, preset.head_dim)
    return torch.randn(shape, generator=g).to(preset.torch_dtype)


def _advance(cache: KVCache, k: torch.Tensor, v: torch.Tensor) -> None:
    c = cache.next_chunk
    cache.begin_chunk(c)
    cache.write(k, v, 0)
    cache.commit_chunk(c)


def _median_s(fn, repeats: int, after=None) -> tuple[float, list[float]]:
    out = []
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            got = fn()
            out.append(time.perf_counter() - t0)
        finally:
            gc.enable()
        if after is not None:
            after(got)
    return statistics.median(out), out


@torch.no_grad()
def fork_memory(preset: str | Preset = "self-forcing", *, branches: int = 8, repeats: int = 10,
                attention_repeats: int = 1, read_repeats: int = 10, seed: int = 0,
                progress=None) -> dict[str, Any]:
    """The measurements of the module docstring; JSON-ready."""
    p = get_preset(preset) if isinstance(preset, str) else preset
    say = progress or (lambda _msg: None)
    g = torch.Generator().manual_seed(seed)
    kw = dict(seq_dim=1, sink=p.sink, window=p.window, chunk=p.chunk, dtype=p.torch_dtype)
    spare = 2 * (branches + 2)  # a chunk per branch and two more for the timed one, each at most two pages
    say("filling the window")
    plain = RingCache(p.k_shape, p.k_shape, **kw)
    paged = RingCache(p.k_shape, p.k_shape, **kw, pages={"spare": spare})
    identity = RingCache(p.k_shape, p.k_shape, **kw, pages={"spare": 0})
    full_chunks = -(-(p.sink + p.window) // p.chunk)
    for _ in range(full_chunks):
        k, v = _chunk(p, g), _chunk(p, g)
        for c in (plain, paged, identity):
            _advance(c, k, v)
    before = paged.storage.store.table.pool.used

    say(f"fork({branches}) x {repeats}")
    fork_s, fork_samples = _median_s(lambda: paged.fork(branches), repeats, lambda bs: [b.release() for b in bs])

    say("one chunk per branch")
    forks = paged.fork(branches)
    after_fork = paged.storage.store.table.pool.used
    chunks = [(_chunk(p, g), _chunk(p, g)) for _ in forks]
    for b, (k, v) in zip(forks, chunks):
        _advance(b, k, v)
    mem = page_report([paged, *forks])
    one = mem["one_cache_bytes"]
    ratio = mem["bytes_in_use"] / one
    floor = 1 + branches * p.chunk / (p.sink + p.window)

    say("reads and writes, interleaved")
    timed = forks[0]
    for c in (plain, identity):  # the same history as the timed branch
        _advance(c, *chunks[0])
    k, v, q = _chunk(p, g), _chunk(p, g), _chunk(p, g, READ_QUERIES)
    subjects = {"ring": plain, "paged_identity": identity, "paged_forked": timed}
    for c in subjects.values():
        c.begin_chunk(c.next_chunk)
        c.write(k, v, 0)
    outs = {name: attend(q, c.read(0))[0] for name, c in subjects.items()}
    read_diff = max(float((outs[n] - outs["ring"]).abs().max()) for n in outs)
    reads = time_interleaved({n: (lambda c=c: attend(q, c.read(0))) for n, c in subjects.items()},
                             repeats=read_repeats, device="cpu")
    writes = time_interleaved({n: (lambda c=c: c.write(k, v, 0)) for n, c in subjects.items()},
                              repeats=read_repeats, device="cpu")
    read_ms = {n: Stats.of(s).median for n, s in reads.samples_ms.items()}
    write_ms = {n: Stats.of(s).median for n, s in writes.samples_ms.items()}

    say(f"one chunk's attention x {attention_repeats} (a whole chunk of queries over the full window)")
    qc = _chunk(p, g)
    attn_s, attn_samples = _median_s(lambda: attend(qc, plain.read(0)), attention_repeats)
    table = timed.storage.store.table
    return {
        "preset": p.to_dict(), "branches": branches, "page_rows": p.chunk,
        "memory": {
            **mem, "pages_before_fork": before, "pages_after_fork": after_fork,
            "ratio_vs_one_cache": ratio, "floor_ratio": floor, "target_ratio": TARGET_RATIO,
            "full_copies_bytes": branches * one, "full_copies_ratio": float(branches),
            "target_met": ratio <= TARGET_RATIO, "floor_above_target": floor > TARGET_RATIO,
        },
        "fork": {"median_s": fork_s, "samples_s": fork_samples, "chunk_attention_s": attn_s,
                 "chunk_attention_samples_s": attn_samples, "fork_over_attention": fork_s / attn_s,
                 "target_share": TARGET_FORK_SHARE, "target_met": fork_s / attn_s <= TARGET_FORK_SHARE,
                 "bytes_copied_by_fork": (after_fork - before) * mem["page_bytes"]},
        "read": {"query_rows": READ_QUERIES, "median_ms": read_ms,
                 "paged_forked_over_ring": read_ms["paged_forked"] / read_ms["ring"],
                 "paged_identity_over_ring": read_ms["paged_identity"] / read_ms["ring"],
                 "target_ratio": TARGET_READ_RATIO,
                 "target_met": read_ms["paged_forked"] / read_ms["ring"] <= TARGET_READ_RATIO,
                 "max_abs_diff_vs_ring": read_diff, "forked_table": list(table.host),
                 "forked_table_identity": table.identity, "timing": reads.to_dict()},
        "write": {"median_ms": write_ms, "paged_forked_over_ring": write_ms["paged_forked"] / write_ms["ring"],
                  "paged_identity_over_ring": write_ms["paged_identity"] / write_ms["ring"],
                  "timing": writes.to_dict()},
    }
