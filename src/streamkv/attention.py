"""Attention over a cache, with an explicit dispatch between two paths.

``physical``
    SDPA straight on the cache's buffers as they lie in memory, no gather. Exact when
    attention is unmasked and every key carries its own absolute RoPE (applied before
    the cache write): softmax attention is invariant to one permutation applied to the
    K and V rows alike. Occupied slots are handled as

    - ``"all"``: every slot valid (steady state) — SDPA on the whole buffer;
    - ``"prefix"``: occupied slots are ``[0, num_valid)`` — SDPA on that slice;
    - ``"mask"``: an additive ``-inf`` bias on empty slots, built on the device from
      ``slot_positions`` (static shapes: what a compiled step or CUDA graph uses while
      the cache fills, and what ragged caches use).

``chronological``
    Gather the retained keys in position order first. Needed for masks over positions
    and for cache-relative RoPE (keys rotated at read time by their index in the
    chronological view), where physical order would be wrong.

``order="physical"`` where it is invalid raises ``ValueError`` with the reason; the
dispatcher never falls back silently. ``order="auto"`` picks physical when valid and
says which path ran in the returned :class:`AttentionInfo`.

Layouts: ``q`` has the layout of the cache's chunk tensors (the token dimension at the
cache's ``seq_dim``, features last); the output has the same layout with the value
feature size. Internally the token dim is moved to ``-2`` (views, no copies).

Log-sum-exp: ``return_lse=True`` also returns ``lse[..., i] = log sum_j exp(s_ij)`` over
the attended keys, computed blockwise (``block`` keys at a time) so the full score
matrix is never materialised; per-key attention mass is then ``exp(s_ij - lse_i)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["attend", "AttentionInfo", "AttentionSource", "blockwise_lse", "valid_bias"]

Order = Literal["auto", "physical", "chronological"]
Occupancy = Literal["all", "prefix", "mask"]


class AttentionSource(Protocol):
    """What :func:`attend` reads: a :class:`~streamkv.caches.base.LayerView` (or a
    one-layer cache)."""

    def keys(self) -> Tensor: ...
    def values(self) -> Tensor: ...
    def chronological_keys(self) -> Tensor: ...
    def chronological_values(self) -> Tensor: ...


@dataclass(frozen=True)
class AttentionInfo:
    """Which path ran, how empty slots were handled, and how many key rows were read."""

    path: Literal["physical", "chronological"]
    occupancy: Occupancy | None
    keys_read: int
    lse: Tensor | None = None


def _cache_of(source: object):
    cache = getattr(source, "cache", source)
    return cache


def valid_bias(slot_positions: Tensor, dtype: torch.dtype) -> Tensor:
    """Additive bias over slots: ``0`` where a slot holds a position, ``-inf`` where empty.

    ``slot_positions``: ``int64 [..., capacity]`` (``-1`` = empty). Returns ``dtype
    [..., 1, capacity]``, broadcastable against scores ``[..., Lq, capacity]``.
    """
    zero = torch.zeros((), dtype=dtype, device=slot_positions.device)
    ninf = torch.full((), float("-inf"), dtype=dtype, device=slot_positions.device)
    return torch.where(slot_positions >= 0, zero, ninf).unsqueeze(-2)


def blockwise_lse(q: Tensor, k: Tensor, *, scale: float, bias: Tensor | None = None, block: int = 1024) -> Tensor:
    """``log sum_j exp(scale * q_i . k_j + bias_j)`` over keys, ``block`` keys at a time.

    ``q``: ``[..., Lq, D]``; ``k``: ``[..., Lk, D]``; ``bias`` broadcastable to
    ``[..., Lq, Lk]`` or None. Returns ``float32``/``float64`` ``[..., Lq]`` (the wider of
    float32 and ``q.dtype``). Memory: ``O(Lq * block)`` per batch-head.
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    qf = q.to(acc)
    lse = None
    n = k.shape[-2]
    for start in range(0, n, block):
        stop = min(n, start + block)
        s = (qf @ k[..., start:stop, :].to(acc).transpose(-1, -2)) * scale
        if bias is not None:
            s = s + bias[..., start:stop].to(acc)
        part = torch.logsumexp(s, dim=-1)
        lse = part if lse is None else torch.logaddexp(lse, part)
    if lse is None:
        raise ValueError("blockwise_lse needs at least one key, got 0")
    return lse


def attend(
    q: Tensor,
    source: AttentionSource,
    *,
    order: Order = "auto",
    rope: Literal["absolute", "cache_relative"] = "absolute",
    key_transform: Callable[[Tensor], Tensor] | None = None,
    attn_mask: Tensor | None = None,
    occupancy: Occupancy | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    lse_block: int = 1024,
) -> tuple[Tensor, AttentionInfo]:
    """Attention of ``q`` over the cache behind ``source``.

    Args:
        q: queries in the cache's chunk layout (token dim at ``seq_dim``, features last).
        source: a layer of a cache (``cache.layer(i)``) or a one-layer cache.
        order: ``"physical"``, ``"chronological"`` or ``"auto"`` (physical when valid).
        rope: ``"absolute"`` (keys rotated at their positions before the write) or
            ``"cache_relative"`` (keys stored unrotated; ``key_transform`` rotates the
            chronological keys ``[..., L, D]`` at read time). Cache-relative needs the
            chronological path.
        attn_mask: an additive or boolean mask over the *chronological* keys,
            broadcastable to ``[..., Lq, L]``; needs the chronological path.
        occupancy: for the physical path, how empty slots are handled (see the module
            docstring); default: from the cache's host counters (``"all"`` when full,
            else ``"prefix"`` or ``"mask"``). Compiled steps pass it explicitly so
            the traced code reads no changing host ints.
        scale: softmax scale (default ``1/sqrt(D)``).
        return_lse: also return the per-query log-sum-exp in ``info.lse``
            (``[..., Lq]``, token dim moved last).

    Returns:
        ``(out, info)``: ``out`` in ``q``'s layout with the value feature size.

    Raises:
        ValueError: ``order="physical"`` where physical order is invalid (the message
            says why), or an unknown option.
    """
    cache = _cache_of(source)
    seq = cache.seq_dim
    if order not in ("auto", "physical", "chronological"):
        raise ValueError(f"order must be 'auto', 'physical' or 'chronological', got {order!r}")
    if rope not in ("absolute", "cache_relative"):
        raise ValueError(f"rope must be 'absolute' or 'cache_relative', got {rope!r}")
    if rope == "cache_relative" and key_transform is None:
        raise ValueError("rope='cache_relative' needs key_transform to rotate the chronological keys")
    reasons = []
    if rope == "cache_relative":
        reasons.append("keys use cache-relative RoPE (their rotation depends on chronological order)")
    if attn_mask is not None:
        reasons.append("an attention mask is given (it indexes chronological keys)")
    if not getattr(cache, "physical_order_valid", False):
        reasons.append(f"{type(cache).__name__} does not support physical-order reads")
    if order == "physical" and reasons:
        raise ValueError("the physical-order path is invalid here: " + "; ".join(reasons))
    path = "physical" if order == "physical" or (order == "auto" and not reasons) else "chronological"

    qt = q.movedim(seq, -2)
    d = qt.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    bias: Tensor | None = None
    if path == "physical":
        k = source.keys().movedim(seq, -2)
        v = source.values().movedim(seq, -2)
        if occupancy is None:
            if cache.all_valid:
                occupancy = "all"
            elif cache.valid_is_prefix:
                occupancy = "prefix"
            else:
                occupancy = "mask"
        if occupancy == "prefix":
            n = cache.num_valid
            k, v = k.narrow(-2, 0, n), v.narrow(-2, 0, n)
        elif occupancy == "mask":
            positions = source.slot_positions if hasattr(source, "slot_positions") else cache.slot_positions
            bias = valid_bias(positions, qt.dtype)
        elif occupancy != "all":
            raise ValueError(f"occupancy must be 'all', 'prefix' or 'mask', got {occupancy!r}")
    else:
        occupancy = None
        k = source.chronological_keys().movedim(seq, -2)
        v = source.chronological_values().movedim(seq, -2)
        if key_transform is not None:
            k = key_transform(k)
        if attn_mask is not None:
            bias = attn_mask if attn_mask.dtype != torch.bool else torch.zeros(
                attn_mask.shape, dtype=qt.dtype, device=qt.device
            ).masked_fill(~attn_mask, float("-inf"))
    out = F.scaled_dot_product_attention(qt, k, v, attn_mask=bias, scale=scale)
    lse = blockwise_lse(qt, k, scale=scale, bias=bias, block=lse_block) if return_lse else None
    info = AttentionInfo(path=path, occupancy=occupancy, keys_read=k.shape[-2], lse=lse)
    return out.movedim(-2, seq), info
