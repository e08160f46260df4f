"""Softmax attention computed a block of queries at a time, with what scored policies need.

One kernel serves two callers: :func:`~streamkv.attention.attend` (the model's attention;
when the cache's policy needs scores, the per-key statistics come out of the same pass) and
the scored policies (scoring stored queries when the attention ran elsewhere).

Inputs are in attention layout: ``q [..., Q, D]``, ``k [..., S, D]``, ``v [..., S, Dv]`` and
an additive ``bias`` broadcastable to ``[..., Q, S]``. Scores are computed in the wider of
float32 and the input dtype; statistics are accumulated in float64. For each query block
the full row of ``S`` scores is materialised (memory ``O(block x S)`` per batch-head), never
the whole ``Q x S`` matrix at once. Nothing here synchronises with the device.

Statistics, per head and key: ``max_j = max_i p_ij`` and ``sum_j = sum_i p_ij`` over every
query ``i`` of the call (and every leading dimension other than the head), where ``p`` is
the softmax over the keys the bias leaves visible. A row whose keys are all masked yields NaN (callers
refuse such reads from host knowledge before they get here).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .validate import check_int

__all__ = ["Blockwise", "blockwise_attention", "check_block", "fold_groups", "unfold_groups"]


def check_block(block: object) -> int:
    """A query (or key) block size: an int >= 1."""
    return check_int("block", block, 1)


class Blockwise:
    """The outputs of :func:`blockwise_attention` (each None unless asked for)."""

    __slots__ = ("out", "lse", "key_max", "key_sum")

    def __init__(self, out: Tensor | None, lse: Tensor | None, key_max: Tensor | None, key_sum: Tensor | None):
        self.out, self.lse, self.key_max, self.key_sum = out, lse, key_max, key_sum


def _to_heads(x: Tensor, head_axis: int | None) -> Tensor:
    """``x [*lead, Q, S]`` -> ``[H, rest, S]`` (head axis first, everything else but keys flattened)."""
    if head_axis is None:
        return x.reshape(1, -1, x.shape[-1])
    x = x.movedim(head_axis, 0)
    return x.reshape(x.shape[0], -1, x.shape[-1])


def blockwise_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor | None,
    bias: Tensor | None,
    *,
    scale: float,
    block: int = 256,
    statistics: bool = False,
    lse: bool = False,
    head_axis: int | None = None,
) -> Blockwise:
    """Softmax attention ``q @ k^T * scale + bias`` over ``k``, ``block`` query rows at a time.

    Args:
        q, k, v: ``[..., Q, D]``, ``[..., S, D]``, ``[..., S, Dv]`` (``v`` None: no output).
        bias: additive, broadcastable to ``[..., Q, S]`` (``-inf`` hides a key), or None.
        statistics: also return ``key_max`` / ``key_sum`` (float64 ``[H, S]``, ``H`` the size
            of leading dim ``head_axis``, 1 when it is None).
        lse: also return the per-query log-sum-exp ``[..., Q]``.
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    qf, kf = q.to(acc), k.to(acc)
    kt = kf.transpose(-1, -2)
    vf = v.to(acc) if v is not None else None
    n = q.shape[-2]
    outs, lses = [], []
    kmax = ksum = None
    for start in range(0, n, block):
        s = (qf[..., start : start + block, :] @ kt) * scale
        if bias is not None:
            b = bias if bias.dim() < 2 or bias.shape[-2] == 1 else bias[..., start : start + block, :]
            s = s + b.to(acc)
        row = torch.logsumexp(s, dim=-1, keepdim=True)
        p = torch.exp(s - row)
        if vf is not None:
            outs.append(p @ vf)
        if lse:
            lses.append(row.squeeze(-1))
        if statistics:
            ph = _to_heads(p.to(torch.float64), head_axis)
            bmax, bsum = ph.amax(dim=1), ph.sum(dim=1)
            kmax = bmax if kmax is None else torch.maximum(kmax, bmax)
            ksum = bsum if ksum is None else ksum + bsum
    out = torch.cat(outs, dim=-2).to(q.dtype) if outs else None
    return Blockwise(out, torch.cat(lses, dim=-1) if lse else None, kmax, ksum)


def fold_groups(q: Tensor, heads: int, head_axis: int | None) -> Tensor:
    """Grouped-query attention: queries with ``G`` times the ``heads`` of the keys, folded into
    the query rows of their key head (query head ``h`` reads key head ``h // G``, as
    transformers' ``repeat_kv``): dim ``head_axis`` shrinks from ``G * heads`` to ``heads`` and
    the token dim (``-2``) grows to ``G * Q`` rows ordered ``(group, query)``. Identity when
    the head counts agree. The one fold of the project (attention, scoring, the certifier)."""
    if head_axis is None or q.shape[head_axis] == heads:
        return q
    hq = q.shape[head_axis]
    if hq % heads:
        raise ValueError(f"queries have {hq} heads and keys {heads}: grouped-query attention needs a multiple")
    x = q.movedim(head_axis, -3)  # [..., G*H, Q, D]
    x = x.reshape(*x.shape[:-3], heads, (hq // heads) * x.shape[-2], x.shape[-1])
    return x.movedim(-3, head_axis)


def unfold_groups(out: Tensor, groups: int, head_axis: int | None) -> Tensor:
    """The inverse of :func:`fold_groups` for the attention output: ``G * Q`` rows of each key
    head back to ``G`` query heads of ``Q`` rows."""
    if head_axis is None or groups == 1:
        return out
    x = out.movedim(head_axis, -3)  # [..., H, G*Q, D]
    x = x.reshape(*x.shape[:-3], x.shape[-3] * groups, x.shape[-2] // groups, x.shape[-1])
    return x.movedim(-3, head_axis)
