"""Why the ring's step costs what it costs: its write kernel and its slot plan, apart.

``RingCache.write`` is one ``index_copy_`` per tensor along the slot dimension, with the
slots read from a device tensor (graph-safe). This section times, at a preset's shape,
the same chunk write (K and V, into the ring's rows of a steady chunk) through:

=======================  ==========================================================
variant                  what it runs
=======================  ==========================================================
``copy_``                ``buf.narrow(seq, s, C).copy_(x)``: the floor (host offset)
``index_copy_``          ``buf.index_copy_(seq, slots, x)`` in the cache dtype: what
                         ``RingCache._write`` does today
``index_copy_ int64``    the same on ``buf.view(torch.int64)`` (4 bf16 per element)
``index_copy_ c128``     the same on ``buf.view(torch.complex128)`` (16-byte elements)
``plan``                 ``RingCache.begin_chunk`` + ``commit_chunk`` alone (slot
                         arithmetic on the device, no K/V write)
=======================  ==========================================================

The reinterpreting views write the same bytes to the same rows (checked against the
native write before timing) and read the same device-resident slot tensor: they keep
the graph-safety of ``index_copy_``. They need the feature row (``head_dim * itemsize``)
to be a multiple of the wide element, and a contiguous last dimension.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from streamkv.caches import RingCache
from streamkv.layout import CacheLayout
from streamkv_lab.measure import Stats, check_device, time_interleaved
from streamkv_lab.bench.presets import Preset

__all__ = ["measure_write_kernels", "WIDE_DTYPES"]

#: reinterpretation dtypes tried for the indexed write
WIDE_DTYPES: dict[str, torch.dtype] = {"int64": torch.int64, "c128": torch.complex128}


def measure_write_kernels(
    preset: Preset, device: torch.device | str, *, repeats: int, warmup: int = 3, warmup_s: float = 0.25, seed: int = 0
) -> dict[str, Any]:
    """Time the write variants (module docstring) at ``preset``; JSON-ready dict.

    Returns ``{"ms": {variant: median}, "stats_ms": {variant: Stats}, "over_copy": {variant:
    median / copy_ median}, "notes": [...]}``.
    """
    device = check_device(device)
    layout = CacheLayout(sink=preset.sink, window=preset.window, chunk=preset.chunk)
    C, d, dt = preset.chunk, preset.seq_dim, preset.torch_dtype
    g = torch.Generator(device="cpu").manual_seed(seed)
    k = torch.randn(preset.chunk_shape, generator=g).to(device=device, dtype=dt)
    v = torch.randn(preset.chunk_shape, generator=g).to(device=device, dtype=dt)
    K = torch.zeros(preset.k_shape, dtype=dt, device=device)
    V = torch.zeros(preset.k_shape, dtype=dt, device=device)
    # the slots of the steady chunks of one ring cycle, as the ring would plan them
    first = layout.first_eviction_chunk()
    cycle = [first + i for i in range(max(1, layout.window // C))]
    slots = [
        torch.tensor([layout.ring_slot(p) for p in layout.chunk_positions(c)], dtype=torch.long, device=device)
        for c in cycle
    ]
    starts = [min(layout.ring_slot(layout.chunk_start(c)), layout.capacity - C) for c in cycle]
    state = {"i": 0}
    notes: list[str] = []

    def rotating(body: Callable[[int], None]) -> Callable[[], None]:
        def step() -> None:
            i = state["i"] % len(cycle)
            body(i)
            state["i"] += 1
        return step

    variants: dict[str, Callable[[], None]] = {}
    variants["copy_"] = rotating(lambda i: (K.narrow(d, starts[i], C).copy_(k), V.narrow(d, starts[i], C).copy_(v)))
    variants["index_copy_"] = rotating(lambda i: (K.index_copy_(d, slots[i], k), V.index_copy_(d, slots[i], v)))
    for name, wide in WIDE_DTYPES.items():
        views = _wide_views(K, V, k, v, wide)
        if views is None:
            notes.append(f"index_copy_ {name} skipped: a row of {preset.head_dim * dt.itemsize} B is not a whole number of {wide}")
            continue
        try:
            _check_same_write(K, k, slots[0], d, wide)
        except RuntimeError as exc:  # e.g. a backend without this dtype's index_copy_
            notes.append(f"index_copy_ {name} skipped: {exc}")
            continue
        Kw, Vw, kw, vw = views
        variants[f"index_copy_ {name}"] = rotating(
            lambda i, Kw=Kw, Vw=Vw, kw=kw, vw=vw: (Kw.index_copy_(d, slots[i], kw), Vw.index_copy_(d, slots[i], vw))
        )
    ring = RingCache(
        (1, preset.capacity, 1, 1), (1, preset.capacity, 1, 1), seq_dim=1, sink=preset.sink,
        window=preset.window, chunk=C, dtype=dt, device=device,
    )

    def plan() -> None:
        c = ring.next_chunk
        ring.begin_chunk(c)
        ring.commit_chunk(c)

    for _ in range(first):
        plan()
    variants["plan"] = plan
    try:
        timing = time_interleaved(variants, repeats=repeats, device=device, warmup=warmup, warmup_s=warmup_s)
    finally:
        variants.clear()  # the closures hold the buffers
        gc.collect()
    stats = {n: Stats.of(s) for n, s in timing.samples_ms.items()}
    floor = stats["copy_"].median
    return {
        "ms": {n: s.median for n, s in stats.items()},
        "stats_ms": {n: s.to_dict() for n, s in stats.items()},
        "over_copy": {n: (s.median / floor if floor > 0 else None) for n, s in stats.items()},
        "repeats": repeats,
        "timing": timing.to_dict(),
        "notes": notes,
    }


def _wide_views(K: Tensor, V: Tensor, k: Tensor, v: Tensor, wide: torch.dtype) -> tuple[Tensor, ...] | None:
    if (K.shape[-1] * K.element_size()) % wide.itemsize:
        return None
    try:
        return tuple(t.view(wide) for t in (K, V, k, v))
    except RuntimeError:
        return None


def _check_same_write(K: Tensor, k: Tensor, slots: Tensor, d: int, wide: torch.dtype) -> None:
    """The reinterpreting write puts the same bytes in the same rows as the native one."""
    a, b = K.clone(), K.clone()
    a.index_copy_(d, slots, k)
    b.view(wide).index_copy_(d, slots, k.view(wide))
    if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
        raise RuntimeError(f"the {wide} view wrote different bytes")
