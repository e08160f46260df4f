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

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from .validate import check_int

__all__ = ["Blockwise", "blockwise_attention", "key_blockwise_attention", "KeyBlocks", "check_block", "fold_groups",
           "unfold_groups"]


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


#: A source of key blocks for :func:`key_blockwise_attention`: called once per pass, it yields
#: ``(k [..., s, D], v [..., s, Dv] or None, bias broadcastable to [..., Q, s] or None)`` (an
#: additive float bias, or a bool mask where True hides the key) for
#: consecutive slot ranges that together cover the keys once, in the same order every call.
KeyBlocks = Callable[[], Iterable[tuple[Tensor, Tensor | None, Tensor | None]]]


def key_blockwise_attention(
    q: Tensor,
    blocks: KeyBlocks,
    *,
    scale: float,
    statistics: bool = False,
    lse: bool = False,
    head_axis: int | None = None,
) -> Blockwise:
    """Softmax attention of ``q [..., Q, D]`` over keys that arrive a block of slots at a time,
    combined by the log-sum-exp (the online softmax): nothing larger than one block's scores
    ``[..., Q, s]`` and its keys is materialised, so a cache whose keys are not stored as dense
    rows (codes to dequantise, raw keys to rotate) is attended without a dense copy of its
    history. ``blocks`` (:data:`KeyBlocks`) is called once for the output and, with
    ``statistics``, a second time for the per-key statistics (which need the final
    normaliser); the statistics are concatenated over the blocks in their order
    (float64 ``[H, S]`` as :func:`blockwise_attention`). Scores are computed in the wider of
    float32 and ``q``'s dtype. A query whose keys are all hidden yields NaN, as there.

    On the CPU, without statistics, each block runs in torch's fused attention kernel (which
    returns its log-sum-exp) and the blocks are merged by their log-sum-exps: the same
    function, at the fused kernel's speed (the per-block matmuls ran 2.9x slower than one
    SDPA call at the self-forcing shapes). Block outputs are then rounded to ``q``'s dtype
    before the merge (for bf16/fp16 a second rounding of the output's size; exact for fp32/fp64)."""
    if not statistics and q.device.type == "cpu" and _FUSED_CPU is not None:
        fused = _fused_key_blocks(q, blocks, scale=scale, lse=lse)
        if fused is not None:
            return fused
    acc = torch.promote_types(q.dtype, torch.float32)
    qf = q.to(acc)
    m = l = out = None
    for k, v, bias in blocks():
        s = _block_scores(qf, k, bias, acc, scale)
        bm = s.amax(dim=-1, keepdim=True)
        if m is None:
            m_new = bm
        else:
            m_new = torch.maximum(m, bm)
        # a row with every key so far hidden has m_new = -inf: keep it at 0 weight, not NaN
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        p = s.sub_(safe).exp_()  # in place: one score-sized buffer per block
        if m is None:
            l = p.sum(-1, keepdim=True)
            out = p @ v.to(acc) if v is not None else None
        else:
            alpha = torch.exp(torch.where(torch.isfinite(m), m, safe) - safe)
            l = l * alpha + p.sum(-1, keepdim=True)
            if v is not None:
                out = out * alpha + p @ v.to(acc)
        m = m_new
    if m is None:
        raise ValueError("key_blockwise_attention needs at least one key block")
    row = torch.where(torch.isfinite(m), m, torch.zeros_like(m)) + torch.log(l)  # -inf where nothing is visible
    res_out = (out / l).to(q.dtype) if out is not None else None
    kmax = ksum = None
    if statistics:
        maxes, sums = [], []
        for k, _, bias in blocks():
            s = _block_scores(qf, k, bias, acc, scale)
            ph = _to_heads(s.sub_(row).exp_().to(torch.float64), head_axis)
            maxes.append(ph.amax(dim=1))
            sums.append(ph.sum(dim=1))
        kmax, ksum = torch.cat(maxes, dim=-1), torch.cat(sums, dim=-1)
    return Blockwise(res_out, row.squeeze(-1) if lse else None, kmax, ksum)


_FUSED_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _fused_key_blocks(q: Tensor, blocks: KeyBlocks, *, scale: float, lse: bool) -> Blockwise:
    """:func:`key_blockwise_attention` without statistics, each block in the CPU fused kernel;
    None when the kernel does not apply (values of another feature size than the keys)."""
    lead, n, d = q.shape[:-2], q.shape[-2], q.shape[-1]
    q4 = q.reshape(1, -1, n, d)
    m = s_acc = o_acc = None
    for k, v, bias in blocks():
        if v.shape[-1] != d:
            return None
        s = k.shape[-2]
        k4 = k.to(q.dtype).reshape(1, -1, s, d)
        v4 = v.to(q.dtype).reshape(1, -1, s, v.shape[-1])
        mask = None
        if bias is not None:
            if bias.dtype == torch.bool:  # True hides (a block's position mask)
                bias = torch.zeros(bias.shape, dtype=q.dtype, device=bias.device).masked_fill_(bias, float("-inf"))
            mask = bias.to(q.dtype).expand(*lead, n, s).reshape(1, -1, n, s)
        o, l = _FUSED_CPU(q4, k4, v4, attn_mask=mask, scale=scale)
        l = l.to(torch.float64 if q.dtype == torch.float64 else torch.float32).unsqueeze(-1)
        if mask is not None:  # the kernel reports lse 0 for a row that sees nothing in the block
            l = torch.where((mask > float("-inf")).any(-1, keepdim=True), l, torch.full_like(l, float("-inf")))
        o = o.to(l.dtype)
        if m is None:
            seen = torch.isfinite(l)
            m, s_acc, o_acc = l, seen.to(l.dtype), torch.where(seen, o, torch.zeros_like(o))
            continue
        m_new = torch.maximum(m, l)
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        a_old, a_new = torch.exp(m - m_safe), torch.exp(l - m_safe)  # exp(-inf) = 0: hidden rows add nothing
        s_acc = s_acc * a_old + a_new
        o_acc = o_acc * a_old + torch.where(a_new > 0, o, torch.zeros_like(o)) * a_new
        m = m_new
    if m is None:
        raise ValueError("key_blockwise_attention needs at least one key block")
    out = (o_acc / s_acc).to(q.dtype).reshape(*lead, n, -1)  # 0/0 = NaN where nothing is visible, as elsewhere
    row = (torch.where(torch.isfinite(m), m, torch.zeros_like(m)) + torch.log(s_acc)).squeeze(-1)
    return Blockwise(out, row.reshape(*lead, n) if lse else None, None, None)


def _block_scores(qf: Tensor, k: Tensor, bias: Tensor | None, acc: torch.dtype, scale: float) -> Tensor:
    """``q @ k^T * scale`` plus the block's bias: additive (float) or a mask (bool, True hides)."""
    s = (qf @ k.to(acc).transpose(-1, -2)).mul_(scale)
    if bias is None:
        return s
    if bias.dtype == torch.bool:
        return s.masked_fill_(bias, float("-inf"))
    return s.add_(bias.to(acc))


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
