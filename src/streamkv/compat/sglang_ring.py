"""The tensor side of :mod:`streamkv.compat.sglang`: re-laying out the ring over the cache's
memory, and the K/V rows of a view. Host arithmetic lives in :mod:`.sglang_slots`."""

from __future__ import annotations

import torch
from torch import Tensor

from ..caches import RingCache
from .sglang_slots import VirtualMap, ring_rows

__all__ = ["relayout", "ring_slices"]


def relayout(old: RingCache | None, old_map: VirtualMap, new_map: VirtualMap, keys: Tensor, values: Tensor, *,
             sink: int, end: int, max_chunk: int | None, quant: object = None, pages: object = None) -> RingCache:
    """A new :class:`~streamkv.RingCache` of ``sink`` sinks over ``keys``/``values`` (``[B, S, h, D]``,
    contiguous, ``S`` slots: the memory ``old`` used, possibly grown) whose slot ``i`` holds
    what slot ``i`` of sglang's buffer holds (``new_map``: virtual position ``i``), ``end`` slots
    of it.

    Mutates ``keys``/``values``: the rows not already in place are gathered into one temporary
    (those rows, K and V) and copied there (nothing moves when ``old`` never wrapped and the
    numbering is unchanged, e.g. the first call). The new ring's metadata is then advanced to
    ``end`` by spans that write nothing (``end / chunk`` begin/commit pairs). Host work and
    device copies; no synchronisation.
    """
    moves = []  # (source slot, destination slot, n)
    if old is not None:
        layout, old_end = old.layout, old.end
        for slot, pos, m in new_map.frozen:
            for v, k in old_map.virtual(pos, m):
                for a, b in ring_rows(layout, old_end, v, k):
                    if a != slot:
                        moves.append((a, slot, b - a))
                    slot += b - a
    own = quant is not None or pages is not None  # the ring's own storage: never re-laid out once it holds tokens
    for buf in (keys, values) if not own else ():
        if moves:
            rows = torch.cat([buf.narrow(1, a, m) for a, _, m in moves], dim=1)
            at = 0
            for _, d, m in moves:
                buf.narrow(1, d, m).copy_(rows.narrow(1, at, m))
                at += m
    size = keys.shape[1]
    window = size - sink
    chunk = window if max_chunk is None else min(window, max_chunk)
    with torch.inference_mode(False):  # metadata the ring updates in place, in or out of inference mode
        ring = RingCache(tuple(keys.shape), tuple(values.shape), seq_dim=1, sink=sink, window=window, chunk=chunk,
                         dtype=keys.dtype, device=keys.device,
                         **({"buffers": (keys.unsqueeze(0), values.unsqueeze(0))} if not own else
                            {"quant": quant, "pages": pages}))
    at = 0
    while at < end:
        m = min(chunk, end - at)
        ring.begin_tokens(m)
        ring.commit()
        at += m
    return ring


def ring_slices(ring: RingCache, rows: list[tuple[int, int]]) -> tuple[Tensor, Tensor]:
    """K/V ``[B, T, h, D]`` of the ring's slot ``rows``: one zero-copy slice when they are one
    range (or none), else a concatenation (a copy) in the order given; a gathered copy for a ring
    of codes (dequantised) or of pages."""
    store = ring.storage.store
    if store.buffers() is None or store.table is not None:  # codes or pages: a copy of those rows, in the cache dtype
        idx = torch.tensor([s for a, b in rows for s in range(a, b)], dtype=torch.long, device=ring.device)
        st = ring.storage
        return st.gather(0, "k", idx).to(ring.dtype), st.gather(0, "v", idx).to(ring.dtype)
    keys, values = ring.keys(0), ring.values(0)
    if len(rows) == 1:
        a, b = rows[0]
        return keys.narrow(1, a, b - a), values.narrow(1, a, b - a)
    if not rows:
        return keys.narrow(1, 0, 0), values.narrow(1, 0, 0)
    return (torch.cat([keys.narrow(1, a, b - a) for a, b in rows], dim=1),
            torch.cat([values.narrow(1, a, b - a) for a, b in rows], dim=1))
