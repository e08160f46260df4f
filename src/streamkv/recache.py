"""Re-cache in place: the K/V of a span of held positions rewritten in their own slots.

LongLive's prompt switch recomputes the cache's K/V under the new prompt (Scope resets the whole
cache per prompt instead); with raw keys (:mod:`streamkv.rope_at_read`) the recomputed keys need
no rotation at all, and with RoPE at write they are rotated at their stream positions as any
write is. :func:`recache` writes them where their positions already lie -- nothing else moves:
positions, the write plan, policy statistics and every other slot stay as they are.

Exact against rebuilding: for window caches (ring, chronological) the buffers equal, element for
element, those of a cache that streamed the whole history with the new K/V in the span (tested);
for every kind, each (slot, head) holding a position of the span holds the new K/V of that
position afterwards and nothing else changes (per-head caches: a head that evicted a position
simply has nothing to rewrite for it).

Refused, changing nothing: positions outside ``[0, end)``; for window caches a position of the
span that the cache no longer holds, in its window or (recall slots) in any head's recall slots
(the message names it); K/V of the wrong shape, dtype or
device, sparse, requiring grad, or sharing memory with the cache; a cache with observers (they
are not told of re-caches); a cache whose buffers are inference tensors outside inference mode.
Host side (one sync for per-head caches, to find the slots); not for use inside a captured graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .caches import KVCache
from .storage import check_int

__all__ = ["recache"]


def _check(cache: KVCache, name: str, t: object, shape: tuple[int, ...]) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} (the span's rows at seq_dim={cache.seq_dim}), got "
                         f"{tuple(t.shape)}")
    if t.dtype != cache.dtype:
        raise TypeError(f"{name} must have the cache dtype {cache.dtype}, got {t.dtype}")
    if t.device != cache.device:
        raise ValueError(f"{name} must be on the cache device {cache.device}, got {t.device}")
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad: pass {name}.detach() or run under torch.no_grad()")
    if cache.storage.owns(t):
        raise ValueError(f"{name} shares memory with this cache's own buffers: pass a tensor of its own (clone it)")


def _own_rows(st, host_slots: list[int], slots: Tensor) -> Tensor:
    """The buffer rows of ``slots``; a paged store first makes the pages holding them its own (copy
    on write: a branch's re-cache never changes what another branch or a kept boundary holds).
    Raises ``RuntimeError`` (nothing changes) when the page pool lacks free pages."""
    store = st.store
    if store.table is None:
        return slots
    own = store.prepare_writes([(s, 1, False) for s in sorted(set(host_slots))], "recache")
    if own is not None:
        own()
    return store.rows_of(slots)


def recache(cache: KVCache, start: int, k: Tensor, v: Tensor, *, layer: int | None = None) -> int:
    """Rewrite the K/V of positions ``[start, start + n)`` (``n = k.shape[seq_dim]``) of ``layer``
    in the slots that hold them; returns the number of (slot, head) pairs written.

    Raises:
        TypeError / ValueError / RuntimeError: see the module docstring (nothing changes).
    """
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a streamkv KVCache, got {type(cache).__name__}")
    if cache.observers:
        raise RuntimeError("recache: this cache has observers, which are not told of re-caches; remove them first")
    layer = cache.checks.layer(layer)
    cache.checks.mutable("recache")
    bufs = cache.storage.store.buffers()
    if bufs is None:
        raise RuntimeError(f"recache: this cache stores {cache.storage.store!r}, re-cached by rebuilding the cache "
                           f"(codes are written once, at commit, through the device plan); not in place")
    start = check_int("start", start, 0)
    st = cache.storage
    seq = st.seq_dim
    n = k.shape[seq] if isinstance(k, Tensor) and k.dim() == len(st.k_shape) else None
    if n is None or not 1 <= n <= st.slots:
        got = tuple(k.shape) if isinstance(k, Tensor) else type(k).__name__
        raise ValueError(f"k must have rank {len(st.k_shape)} with 1 to {st.slots} rows at seq_dim={seq}, got {got}")
    if start + n > cache.end:
        raise ValueError(f"positions [{start}, {start + n}) reach past the stream's end ({cache.end}): only positions "
                         f"that entered the cache can be re-cached")
    for name, t, full in (("k", k, st.k_shape), ("v", v, st.v_shape)):
        _check(cache, name, t, full[:seq] + (n,) + full[seq + 1:])
    positions = st.layer_positions(layer)  # [H, S]
    if not cache.per_head:  # a window cache: its window is host arithmetic; recall slots are read (one sync)
        held = cache.layout.retained_positions(cache.end)
        slot_of = dict(zip(held, cache.policy.chronological_slots(cache.end)))
        missing = [p for p in range(start, start + n) if p not in slot_of]
        recalled = set(positions[:, cache.layout.capacity:].flatten().tolist()) if missing and st.recall_slots else set()
        missing = [p for p in missing if p not in recalled]
        if missing:
            where = f" nor by any of its {st.recall_slots} recall slots per head" if st.recall_slots else ""
            raise ValueError(f"positions {missing[:8]}{'...' if len(missing) > 8 else ''} are no longer held by this "
                             f"{cache.name} cache (its window holds {held[:3]}...{held[-3:]}){where}: only held "
                             f"positions can be re-cached in place")
    if not cache.per_head and not st.recall_slots:
        slots = torch.tensor([slot_of[p] for p in range(start, start + n)], dtype=torch.long, device=st.device)
        slots = _own_rows(st, slots.tolist(), slots)
        bufs[0][layer].index_copy_(seq, slots, k)
        bufs[1][layer].index_copy_(seq, slots, v)
        return n * st.heads
    rows = positions - start
    hit = (rows >= 0) & (rows < n) & (positions >= 0)
    head_idx, slot_idx = hit.nonzero(as_tuple=True)  # one sync
    row_idx = rows[head_idx, slot_idx]
    slot_idx = _own_rows(st, slot_idx.tolist(), slot_idx)
    per_head = st.dims.rows  # (token, head, other dims..., feature): the per-head write's view
    for buf, x in zip(bufs, (k, v)):
        if st.head_dim is None:
            buf[layer].index_copy_(seq, slot_idx, x.index_select(seq, row_idx))
        else:
            per_head(buf[layer]).index_put_((slot_idx, head_idx), per_head(x)[row_idx, head_idx])
    return int(head_idx.numel())
