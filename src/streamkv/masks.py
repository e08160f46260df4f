"""Masks from positions: which keys each query row sees, as a function of the positions the slots
hold (``-1``: empty) and the queries', so exact in any physical order. The one mask builder of the
project (reads, the chronological path, the certifier, the whole-history check).

A causal mask is computed from the positions' ranks (:func:`position_ranks`): float32 counts, exact
where the positions are not, so that the masks' one vectorised pass compares floats (an int64
compare per entry is several times slower on an AVX2 CPU). Each distinct row is evaluated once:
heads holding the same positions (a broadcast row) share one head's mask, and grouped query rows
are copies.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .compiled import compile_kernel, may_compile

__all__ = ["position_bias", "position_mask", "position_masks", "position_ranks", "ranks_hide"]


def position_bias(key_positions: Tensor, query_positions: Tensor | None = None,
                  dtype: torch.dtype = torch.float32, window: int | None = None, groups: int = 1) -> Tensor:
    """The additive mask of attention over slots holding ``key_positions [..., S]`` (``-1``:
    empty): ``-inf`` on empty slots and, given ``query_positions [Q]`` (causal attention), on
    keys at later positions than the query, and with ``window`` on keys at positions ``<= p -
    window`` (a sliding window of ``window`` positions, the query's own included). Shape
    ``[..., Q, S]`` (``Q = 1`` without queries); ``groups`` repeats the query rows (``[..., G*Q,
    S]``, row ``g*Q + i`` is query ``i``: grouped-query attention with the groups folded into the
    rows).
    A function of positions, so it is exact in any physical order: the one mask builder of the
    project (reads, the chronological path, the certifier, the whole-history check)."""
    if query_positions is not None:
        return position_masks(key_positions, query_positions, window, groups, dtype, bias_only=True)[0]
    hidden = position_mask(key_positions)
    return torch.zeros(hidden.shape, dtype=dtype, device=key_positions.device).masked_fill_(hidden, float("-inf"))


def position_mask(key_positions: Tensor, query_positions: Tensor | None = None, window: int | None = None) -> Tensor:
    """:func:`position_bias` as a bool mask (True hides): ``[..., Q, S]``."""
    k = key_positions.unsqueeze(-2)
    hidden = k < 0
    if query_positions is not None:
        qp = query_positions.reshape(-1, 1)
        hidden = hidden | (k > qp)
        if window is not None:
            hidden = hidden | (k <= qp - window)
    return hidden


def position_ranks(key_positions: Tensor, query_positions: Tensor, window: int | None = None
                   ) -> tuple[Tensor, Tensor | None, Tensor]:
    """:func:`position_mask`'s causal test as float32 codes, exactly: ``(c [..., S], d [..., S] or
    None, rho [Q])``, with which query ``i`` hides key ``j`` iff :func:`ranks_hide` says so. With the
    queries' positions sorted, ``q``: ``rho_i = #{q < q_i}``; ``c_j = #{q < p_j}`` (``|q| + 1`` for an
    empty slot): ``p_j > q_i`` iff ``c_j > rho_i``; with ``window``, ``d_j = #{q < p_j + window}``:
    ``p_j <= q_i - window`` iff ``d_j <= rho_i``. Counts of at most ``|q| + 1`` are exact in float32
    where positions are not (past ``2**24``), and a float compare is the cheap one in a vectorised
    kernel (an int64 one is several times slower on an AVX2 CPU). Small tensors (a sort and two
    binary searches); no host sync."""
    qp = query_positions.reshape(-1)
    qs = qp.sort().values
    rho = torch.searchsorted(qs, qp).to(torch.float32)
    kp = key_positions.contiguous()  # searchsorted reads contiguous values
    c = torch.where(kp < 0, qs.numel() + 1, torch.searchsorted(qs, kp)).to(torch.float32)
    d = None if window is None else torch.searchsorted(qs, kp + window).to(torch.float32)
    return c, d, rho


def ranks_hide(c: Tensor, d: Tensor | None, rho: Tensor) -> Tensor:
    """The entries :func:`position_ranks`' codes hide, the codes shaped to broadcast against each
    other (keys' ``c``, ``d`` against rows' ``rho``)."""
    hidden = c > rho
    return hidden if d is None else hidden | (d <= rho)


def _masks(c: Tensor, d: Tensor | None, rho: Tensor, dtype: torch.dtype, bias_only: bool) -> tuple[Tensor, ...]:
    rows = rho.view(-1, 1)
    hidden = ranks_hide(c.unsqueeze(-2), None if d is None else d.unsqueeze(-2), rows)  # [..., Q, S]
    bias = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(hidden, float("-inf"))
    if bias_only:
        return (bias,)
    return bias, (~hidden).any(-1, keepdim=True), hidden.all(-2, keepdim=True)


#: masks of at least this many entries are built by one compiled kernel on the CPU
MASK_COMPILE_MIN = 1 << 18
_MASKS: dict = {}


def position_masks(key_positions: Tensor, query_positions: Tensor, window: int | None = None, groups: int = 1,
                   dtype: torch.dtype = torch.float32, bias_only: bool = False) -> tuple[Tensor, ...]:
    """A causal read's masks in one pass over the positions: ``(bias, seen, drop)`` (``(bias,)``
    with ``bias_only``), the additive ``bias [..., G*Q, S]`` of :func:`position_bias`, ``seen
    [..., G*Q, 1]`` (the row sees some key) and ``drop [..., 1, S]`` (the key is hidden from
    every row). Each distinct row is evaluated once: where every head holds the same positions (a
    broadcast view, stride 0 over the heads ``[..., H, S]``, as a window cache's are) the masks
    are one head's, expanded over the heads (views), and the grouped rows are copies of the query
    rows' (``repeat``). On the CPU, masks of at least :data:`MASK_COMPILE_MIN` entries are one
    compiled kernel (no bool mask, no separate reductions)."""
    kp = key_positions
    if kp.dim() >= 2 and kp.shape[-2] > 1 and kp.stride(-2) == 0:
        one = position_masks(kp.narrow(-2, 0, 1), query_positions, window, groups, dtype, bias_only)
        return tuple(t.expand(*t.shape[:-3], kp.shape[-2], *t.shape[-2:]) for t in one)
    masks = _masks_once(kp, query_positions, window, dtype, bias_only)
    if groups == 1:
        return masks
    rows = (*([1] * (kp.dim() - 1)), groups, 1)  # [..., Q, x] -> [..., G*Q, x], row g*Q + i = query i
    return (masks[0].repeat(rows), *((masks[1].repeat(rows), masks[2]) if not bias_only else ()))


def _masks_once(key_positions: Tensor, query_positions: Tensor, window: int | None, dtype: torch.dtype,
                bias_only: bool) -> tuple[Tensor, ...]:
    """:func:`_masks` of the positions' ranks, compiled where :func:`~streamkv.compiled.may_compile`
    allows."""
    codes = position_ranks(key_positions, query_positions, window)
    if may_compile(key_positions, key_positions.numel() * query_positions.numel(), MASK_COMPILE_MIN):
        key = (window is None, dtype, bias_only)
        if key not in _MASKS:
            _MASKS[key] = compile_kernel(_masks, f"position_masks_{'window' if window is not None else 'causal'}_"
                                                 f"{str(dtype).removeprefix('torch.')}{'_bias' if bias_only else ''}")
        if _MASKS[key] is not None:
            return _MASKS[key](*codes, dtype, bias_only)
    return _masks(*codes, dtype, bias_only)
