"""The one block loop: attention of a span's queries over a read's segments, a block of rows at a
time, combined by the log-sum-exp (the online softmax), with the per-slot statistics a policy
declared computed in the same read.

Every read that is not one plain dense buffer comes here (on the CPU; the Triton kernel of
:mod:`streamkv.kernels` serves the same plan on CUDA): quantised codes decoded a block at a
time, raw keys rotated a block at a time by the cache's position map, pages walked through their
table, a compressed tier's rows beside the cache's, per-head holes, causal and window masks from
positions, grouped-query attention. Nothing of size ``O(history)`` is materialised besides the
positions; transient memory is one block's keys, values and scores.

Storage bases: a segment whose keys are stored as ``k @ R.T`` is read with queries ``q @ R.T``
(computed once per basis), and one whose values are stored as ``v @ R.T`` accumulates its part
of the output in that basis, rotated back once at the end: ``R`` is never applied to a key block.

Statistics (``statistic``, :class:`Statistic`): per cache slot and head,
``max_i p_ij`` and/or ``sum_i p_ij`` over the selected query rows (the newest ``rows`` of the
span, or all), the batch and the grouped query heads, where ``p`` is the softmax over every row
the read attends; float64 ``[H, S]``. They need the final normaliser, so they are a second pass
over the blocks of the segments that hold cache slots (maxima taken in the scores' dtype, then
widened; sums widened a slice of query rows at a time and accumulated in float64). Slots a policy
never reads (the sinks; the open span where it protects it) are left out where the host can
tell: whole rows below the sinks, rows that hold the span alone (``Segment.span_from``), and over
one dense segment the rows that are neither, gathered first (:func:`_candidates`).

On the CPU each block runs in torch's fused attention kernel (which returns its log-sum-exp), in
the dtype of the queries (a decoded block is rounded to it: for bf16 and fp16 a second rounding
of the keys' size; exact for float32/float64); the statistics pass scores the same rounded keys.
A row hidden from every query of a block is zeroed before it is attended (``where``: 0 times NaN
is NaN), so a stale non-finite row in an empty slot weighs nothing, unless the segment's rows are
all held or all finite (``visible``, ``finite``: host facts). A non-finite row some query sees is
attended as stored (quantised storage refuses one at the commit; a dense store holds what it got).

Why one module: the statistics are a second pass of the same loop (the same blocks, the same key
loads and queries per storage basis, the normaliser the first pass returns); apart, each half
would import the other's private helpers.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .compiled import compile_kernel, may_compile
from .scoring import Blockwise, fold_groups, unfold_groups
from .masks import position_mask, position_masks, position_ranks, ranks_hide
from .stores import Dims, Segment
from .stores.dense import gather_rows

__all__ = ["BlockPlan", "Statistic", "read_blocks"]

_FUSED_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
#: elements per slice of query rows widened at a time in the statistics pass (float64: 8 MiB)
_STAT_ELEMENTS = 1 << 20
#: scores per slice of keys in the statistics pass (float32: 16 MiB)
_STAT_SCORES = 1 << 22
#: per thread, the CPU buffer of the statistics pass's scores per dtype (:func:`_scores`): at most
#: :data:`_STAT_SCORES` elements each, kept for the thread's life
_SCRATCH = threading.local()


@dataclass(frozen=True)
class Statistic:
    """What a scored policy asks the read to compute per key, in the same pass as attention.

    ``rows``: the query rows that count (None: every row of the span; ``r``: the newest ``r``
    rows of the span, e.g. SnapKV's observation window); ``reduce``: over those rows, the
    batch and grouped query heads, ``"max"`` (``max_i p_ij``) and/or ``"sum"`` (``sum_i p_ij``);
    ``skip``: the slots ``[0, skip)`` get no statistic (they read 0), for a policy that never
    reads them (the sinks, which no scored policy evicts): on the CPU the pass leaves out the
    rows whose slots the host knows (``Segment.slots`` an int, or the ``pinned`` rows), a
    quarter of its products where the sinks are a quarter of the cache; other rows and the
    Triton kernel compute them, and the result is set to 0 alike. ``newest``: the slots that
    hold the open span's positions (from its first query position on) read 0 too, for a policy
    that protects the newest chunk: on the CPU a dense segment's pass then gathers the rows it
    scores (:func:`_candidates`: neither sinks nor the span, at most the rows less both), so
    that neither the span's keys nor, for a causal read without a window, a causal mask are
    computed (every such key precedes every query).

    The NaN of a poisoned head over-approximates: on the CPU a key with an infinite component,
    hidden by causality from a row, still makes that row's log-sum-exp and output NaN (the fused
    kernel adds the mask's ``-inf`` to its ``+inf`` score), so a policy that skips slots refuses
    that commit under ``check_finite`` where one that computes every statistic takes it with the
    NaN output row, and the Triton kernel, which masks before it adds, takes it with a finite
    one."""

    rows: int | None = None
    reduce: tuple[str, ...] = ("max", "sum")
    skip: int = 0
    newest: bool = False

    def __post_init__(self) -> None:
        if self.rows is not None and (isinstance(self.rows, bool) or not isinstance(self.rows, int) or self.rows < 1):
            raise ValueError(f"Statistic rows must be None (all) or an int >= 1, got {self.rows!r}")
        if not isinstance(self.reduce, tuple) or not self.reduce or any(r not in ("max", "sum") for r in self.reduce):
            raise ValueError(f"Statistic reduce must be a tuple naming 'max' and/or 'sum', got {self.reduce!r}")
        if isinstance(self.skip, bool) or not isinstance(self.skip, int) or self.skip < 0:
            raise ValueError(f"Statistic skip must be an int >= 0 (slots left out), got {self.skip!r}")
        if not isinstance(self.newest, bool):
            raise ValueError(f"Statistic newest must be a bool, got {self.newest!r}")

    def finish(self, x: Tensor | None, slots: int, poisoned: Tensor | None, newest: Tensor | None = None
               ) -> Tensor | None:
        """A pass's reduction ``x [H, slots + 1]`` (its last column: the rows without a slot) as the
        statistic, ``[H, slots]``, the skipped slots 0 (computed or not, they read alike) -- or NaN
        in a head where ``poisoned [H, 1]`` (a counted row's log-sum-exp is NaN or +inf: a key it
        sees is not finite, maybe a skipped one, whose own NaN would have told the commit).
        ``newest``: ``[H, slots + 1]`` bool, the open span's slots (:func:`newest_slots`)."""
        if x is None:
            return None
        fill = 0.0 if poisoned is None else torch.where(poisoned, math.nan, 0.0)
        if self.skip:
            x[:, :self.skip] = fill
        if newest is not None:
            x = torch.where(newest, fill, x)
        return x[:, :slots]

    def poisoned(self, lse_rows: Tensor, heads: int, head_axis: int | None) -> Tensor | None:
        """``[H, 1]`` bool for :meth:`finish`: a head with a counted row whose log-sum-exp
        ``lse_rows [..., rows]`` (the attention layout's leading dims) is NaN or +inf; None
        without skipped slots (nothing to tell)."""
        if not self.skip and not self.newest:
            return None
        bad = (lse_rows.isnan() | lse_rows.isposinf()).any(-1)
        bad = bad.movedim(head_axis, 0) if head_axis is not None else bad.unsqueeze(0)
        return bad.reshape(heads, -1).any(-1, keepdim=True)


@dataclass(frozen=True)
class BlockPlan:
    """What a block read needs besides the queries: the segments, the masks' inputs, the rotation
    (a :class:`~streamkv.rope_at_read.RotationPlan` or None), the statistic and the block size."""

    segments: list[Segment]
    dims: Dims
    scale: float
    query_positions: Tensor | None = None
    causal: bool = False
    window: int | None = None
    rotation: Any = None
    statistic: Statistic | None = None
    slots: int = 0
    block: int = 4096
    lse: bool = False
    #: what a read computes once and its later passes reuse (the positions are the same): masks by
    #: (segment, block, ...) for segments marked ``stable``; None: nothing kept
    memo: dict | None = None


def _mask(plan: BlockPlan, pos: Tensor, groups: int, key: tuple | None = None) -> Tensor:
    """Bool mask (True hides) of one block's ``positions [H, s]``, laid out against scores
    ``[..., G*Q, s]`` (``[..., 1, s]`` without causality); ``key`` names it in ``plan.memo`` (a
    stable segment's block: computed once per read)."""
    if key is not None and plan.memo is not None:
        key = ("mask", *key, groups, plan.causal, plan.window)
        got = plan.memo.get(key)
        if got is None:
            got = plan.memo[key] = _mask(plan, pos, groups)
        return got
    if plan.causal:
        hidden = position_mask(pos, plan.query_positions, plan.window)
    else:
        hidden = position_mask(pos)
    if groups > 1 and hidden.shape[-2] != 1:
        hidden = hidden.repeat(1, groups, 1)
    return plan.dims.lay_out_heads(hidden)


def _fused_masks(plan: BlockPlan, pos: Tensor, groups: int, dtype: torch.dtype, key: tuple | None = None
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """One block's masks for the fused kernel, laid out against scores ``[..., G*Q|1, s]``: the
    additive ``bias`` (``dtype``), ``seen [..., G*Q|1, 1]`` (the row sees a key of the block) and
    ``drop [..., s, 1]`` (the key is hidden from every row); a causal block's in one pass over the
    positions (:func:`~streamkv.masks.position_masks`). ``key`` names it in ``plan.memo``."""
    if key is not None and plan.memo is not None:
        key = ("fused", *key, groups, plan.causal, plan.window, dtype)
        got = plan.memo.get(key)
        if got is None:
            got = plan.memo[key] = _fused_masks(plan, pos, groups, dtype)
        return got
    if plan.causal:
        bias, seen, drop = position_masks(pos, plan.query_positions, plan.window, groups, dtype)
    else:  # one row
        drop = position_mask(pos)
        bias = torch.zeros(drop.shape, dtype=dtype, device=pos.device).masked_fill_(drop, float("-inf"))
        seen = (~drop).any(-1, keepdim=True)
    lay = plan.dims.lay_out_heads
    return lay(bias), lay(seen), lay(drop).transpose(-1, -2)


def _blocks(plan: BlockPlan):
    """``(segment, a, b, key)`` for every block of every segment, in order (``key``: the block's
    name in ``plan.memo`` when its segment is stable, else None). Blocks end where a run of
    consecutive pages does (:meth:`~streamkv.stores.Segment.cuts`): each block's rows are views."""
    for i, seg in enumerate(plan.segments):
        for a, b in seg.cuts(plan.block):
            yield seg, a, b, ((i, a, b) if seg.stable else None)


def _keys(plan: BlockPlan, seg: Segment, a: int, b: int, dtype: torch.dtype | None = None,
          drop: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """A block's attendable K/V (``drop``: rows given as zeros); rotated at read where the plan
    says (keys stored in a basis are taken back to theirs first: a rotation by position does not
    commute with the basis; a zero row stays zero)."""
    if plan.rotation is None:
        return seg.load(a, b, dtype, drop)
    if seg.k_basis is None:
        k, v = seg.load(a, b, dtype, drop)
        return plan.rotation.keys_at(k, seg.positions[:, a:b]), v
    k, v = seg.load(a, b, None, drop)  # decoded once at float32 or wider, then back out of the basis and rotated
    k = plan.rotation.keys_at(k @ seg.k_basis.to(k.dtype), seg.positions[:, a:b])
    return (k, v) if dtype is None else (k.to(dtype), v.to(dtype))


def _key_basis(plan: BlockPlan, seg: Segment) -> Tensor | None:
    """The basis the queries meet a segment's keys in (none where the keys were rotated at read)."""
    return seg.k_basis if plan.rotation is None else None


def _fuse(seg: Segment, fused: bool) -> bool:
    return fused and seg.features[0] == seg.features[1]


class _Queries:
    """The queries in each storage basis of the keys (computed once per basis)."""

    def __init__(self, q: Tensor) -> None:
        self.q, self.by_basis = q, {}

    def __call__(self, basis: Tensor | None) -> Tensor:
        if basis is None:
            return self.q
        key = id(basis)
        if key not in self.by_basis:
            acc = torch.promote_types(self.q.dtype, torch.float32)
            self.by_basis[key] = (self.q.to(acc) @ basis.T.to(acc)).to(self.q.dtype)
        return self.by_basis[key]


def read_blocks(qt: Tensor, plan: BlockPlan) -> Blockwise:
    """Attention of ``qt`` (attention layout ``[..., Q, D]``, rotated already when the keys are
    rotated at read; more heads than the keys for grouped-query attention) over ``plan``'s
    segments. Returns the output (``qt``'s layout and dtype, value features), the per-query
    log-sum-exp when ``plan.lse`` and the declared statistics."""
    heads = plan.dims.heads
    ha = plan.dims.head_axis
    groups = 1 if ha is None or qt.shape[ha] == heads else qt.shape[ha] // heads
    qf = fold_groups(qt, heads, ha)
    out, lse, own = _attend(qf, plan, groups)
    kmax = ksum = None
    if plan.statistic is not None:
        kmax, ksum = _statistics(qt, plan, own, groups)
    out = unfold_groups(out, groups, ha)
    if plan.lse:
        lse = unfold_groups(lse.unsqueeze(-1), groups, ha).squeeze(-1)
    return Blockwise(out, lse if plan.lse else None, kmax, ksum)


def _lse_merge(m: Tensor | None, s: Tensor | None, l: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """One block's log-sum-exp ``l`` into the running ``(max, sum)``: returns the new pair, the
    block's weight and the old sum's factor (``exp(-inf) = 0``: hidden rows weigh nothing)."""
    m_new = l if m is None else torch.maximum(m, l)
    safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
    w_new = torch.exp(l - safe)
    if m is None:
        return m_new, w_new, w_new, None
    w_old = torch.exp(m - safe)
    return m_new, s * w_old + w_new, w_new, w_old


def _lse(m: Tensor, s: Tensor) -> Tensor:
    return (torch.where(torch.isfinite(m), m, torch.zeros_like(m)) + torch.log(s)).squeeze(-1)


def _attend(qf: Tensor, plan: BlockPlan, groups: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """Output ``[..., G*Q, Dv]`` and log-sum-exp ``[..., G*Q]`` of the folded queries, and (with a
    statistic) the log-sum-exp over the rows that are cache slots: the statistics' normaliser, so
    that a policy ranks its slots as if the rows an observer adds were not there."""
    queries = _Queries(qf)
    fused = qf.device.type == "cpu" and _FUSED_CPU is not None and not torch.compiler.is_compiling()
    acc_t = torch.promote_types(qf.dtype, torch.float32)
    m = s_acc = m_own = s_own = None
    all_own = all(seg.slots is not None for seg in plan.segments)
    o_acc: dict[int, tuple[Tensor, Tensor | None]] = {}
    for seg, a, b, key in _blocks(plan):
        fuse = _fuse(seg, fused)
        hidden = masks = drop = None
        if seg.visible and not plan.causal:
            pass
        elif fuse:
            *masks, drop = _fused_masks(plan, seg.positions[:, a:b], groups, qf.dtype, key=key)
        else:
            hidden = _mask(plan, seg.positions[:, a:b], groups, key=key)
            drop = hidden.all(-2, keepdim=True).transpose(-1, -2)
        # rows every query of the block hides, given as zeros (a held row hidden by causality is attended as stored)
        drop = None if seg.visible or seg.finite else drop
        k, v = _keys(plan, seg, a, b, qf.dtype if fuse else None, drop)
        q = queries(_key_basis(plan, seg))
        if fuse:
            o, l = _fused_block(q, k, v, masks, plan.scale)
        else:
            o, l = _plain_block(q, k, v, hidden, plan.scale, acc_t)
        m, s_acc, w_new, w_old = _lse_merge(m, s_acc, l)
        if plan.statistic is not None and seg.slots is not None and not all_own:
            m_own, s_own, _, _ = _lse_merge(m_own, s_own, l)
        o = torch.where(w_new > 0, o, torch.zeros_like(o)) * w_new
        if w_old is not None:
            for key, (acc, basis) in o_acc.items():
                o_acc[key] = (acc * w_old, basis)
        key = id(seg.v_basis) if seg.v_basis is not None else 0
        prev = o_acc.get(key)
        o_acc[key] = (o if prev is None else prev[0] + o, seg.v_basis)
    if m is None:
        raise ValueError("a read needs at least one key block")
    out = None
    for acc, basis in o_acc.values():
        part = acc if basis is None else acc @ basis.to(acc.dtype)
        out = part if out is None else out + part
    out = (out / s_acc).to(qf.dtype)  # 0/0 = NaN where nothing is visible, as SDPA gives
    lse = _lse(m, s_acc)
    if all_own:
        own = lse
    else:
        own = None if m_own is None else _lse(m_own, s_own)
    return out, lse, own


def _fused_block(q: Tensor, k: Tensor, v: Tensor, masks: list[Tensor] | None, scale: float) -> tuple[Tensor, Tensor]:
    """One block in the CPU fused kernel: output (float32 or float64) and log-sum-exp ``[..., Q, 1]``
    (``-inf`` for a row that sees nothing in the block); ``masks``: ``(bias, seen)`` of
    :func:`_fused_masks`, or None: every row seen, no mask."""
    lead, n, d = q.shape[:-2], q.shape[-2], q.shape[-1]
    s = k.shape[-2]
    # the kernel reads rows with unit stride only (a strided feature dim gave a wrong output, silently)
    q4 = _unit_stride(q.reshape(1, -1, n, d))
    k4 = _unit_stride(k.to(q.dtype).expand(*lead, s, d).reshape(1, -1, s, d))
    v4 = _unit_stride(v.to(q.dtype).expand(*lead, s, v.shape[-1]).reshape(1, -1, s, v.shape[-1]))
    mask = None
    if masks is not None:
        bias, seen = masks
        rows = bias.shape[-2]  # 1: the kernel broadcasts one mask row over the queries
        mask = bias.expand(*lead, rows, s).reshape(1, -1, rows, s)
    o, l = _FUSED_CPU(q4, k4, v4, attn_mask=mask, scale=scale)
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    l = l.to(wide).reshape(*lead, n, 1)
    if masks is not None:  # the kernel reports lse 0 for a row it hid whole
        l = torch.where(seen.expand(*lead, n, 1), l, torch.full_like(l, float("-inf")))
    return o.to(wide).reshape(*lead, n, -1), l


def _unit_stride(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _plain_block(q: Tensor, k: Tensor, v: Tensor, hidden: Tensor | None, scale: float, acc: torch.dtype
                 ) -> tuple[Tensor, Tensor]:
    """One block by matmuls (any device, values of any feature size): normalised output and lse."""
    s = (q.to(acc) @ k.to(acc).transpose(-1, -2)).mul_(scale)
    if hidden is not None:
        s.masked_fill_(hidden, float("-inf"))
    mx = s.amax(-1, keepdim=True)
    safe = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    p = s.sub_(safe).exp_()
    denom = p.sum(-1, keepdim=True)
    o = (p @ v.to(acc)) / denom
    return o, safe + torch.log(denom)


def _statistics(qt: Tensor, plan: BlockPlan, lse: Tensor | None, groups: int) -> tuple[Tensor | None, Tensor | None]:
    """Per-slot ``max_i p_ij`` / ``sum_i p_ij`` over the declared rows (see the module docstring),
    ``p`` normalised by ``lse``, the log-sum-exp over the rows that are cache slots."""
    if lse is None:  # no row of the read is a cache slot: nothing to score
        z = torch.zeros((plan.dims.heads, plan.slots), dtype=torch.float64, device=qt.device)
        return (z if "max" in plan.statistic.reduce else None), (z.clone() if "sum" in plan.statistic.reduce else None)
    stat, dims = plan.statistic, plan.dims
    heads, ha = dims.heads, dims.head_axis
    Q = qt.shape[-2]
    r = Q if stat.rows is None else min(stat.rows, Q)
    rows = slice(Q - r, Q)
    qs = fold_groups(qt[..., rows, :], heads, ha)
    lse_rows = lse.reshape(*lse.shape[:-1], groups, Q)[..., rows].reshape(*lse.shape[:-1], groups * r)
    acc = torch.promote_types(qt.dtype, torch.float32)
    queries = _Queries(qs)
    fused = qt.device.type == "cpu" and _FUSED_CPU is not None and not torch.compiler.is_compiling()
    poisoned = stat.poisoned(lse_rows, heads, ha)
    # a row that sees no cache slot (only an observer's rows) gives every slot 0, not NaN
    lse_rows = torch.where(torch.isfinite(lse_rows), lse_rows, math.inf)
    H, S, dev = heads, plan.slots, qt.device
    lse_t = lse_rows.unsqueeze(-2).to(acc)  # [..., 1, G*r]
    # the mask is computed where the scores are reduced, from small float32 codes of the keys'
    # positions [..., s, 1] and the rows' [..., 1, G*r] (_rank_masks: exact, float compares)
    qpos = plan.query_positions[rows].repeat(groups) if plan.causal else None
    kmax = torch.zeros((H, S + 1), dtype=torch.float64, device=dev) if "max" in stat.reduce else None
    ksum = torch.zeros((H, S + 1), dtype=torch.float64, device=dev) if "sum" in stat.reduce else None
    gathered = set()  # ids of the segments scored whole from their gathered rows
    n_span = plan.query_positions.numel() if stat.newest and plan.query_positions is not None else 0
    for seg in plan.segments:
        got = _candidates(plan, seg, n_span) if n_span else None
        if got is None:
            continue
        gathered.add(id(seg))
        k, held, dest = got
        k = k.to(qs.dtype) if _fuse(seg, fused) else k  # the keys the attention pass read (_keys)
        if plan.rotation is not None:
            k = plan.rotation.keys_at(k, held)
        qk = queries(_key_basis(plan, seg)).to(acc).transpose(-1, -2)
        # every gathered key precedes every query: a causal read needs a mask only for a window
        codes = _rank_masks(held, qpos if plan.window is not None else None, plan.window, dims)
        _scatter_statistics(k, qk, codes, dest, 0, lse_t, plan, kmax, ksum)
    for seg, a, b, key in _blocks(plan):
        slots = seg.slot_index()
        if slots is None or id(seg) in gathered:
            continue
        # rows of slots below stat.skip are left out where the host knows their slots, and rows
        # that hold only the open span's positions where the statistic leaves the span out
        below = stat.skip - seg.slots if isinstance(seg.slots, int) else min(stat.skip, seg.pinned)
        j0 = min(b - a, max(0, below - a))
        j1 = b - a if not n_span or seg.span_from is None else min(b - a, max(0, seg.span_from - a))
        if j0 >= j1:
            continue
        b = a + j1
        k, _ = _keys(plan, seg, a, b, qs.dtype if _fuse(seg, fused) else None)  # the keys the attention pass read
        qk = queries(_key_basis(plan, seg)).to(acc).transpose(-1, -2)  # [..., D, G*r]
        codes = None if seg.visible and not plan.causal else _rank_masks(seg.positions[:, a:b], qpos, plan.window, dims)
        dest = slots[:, a:b]
        dest = torch.where(dest >= 0, dest, S).expand(H, -1)
        _scatter_statistics(k, qk, codes, dest, j0, lse_t, plan, kmax, ksum)
    newest = newest_slots(plan)
    return stat.finish(kmax, S, poisoned, newest), stat.finish(ksum, S, poisoned, newest)


def _scatter_statistics(k: Tensor, qk: Tensor, codes: tuple | None, dest: Tensor, j0: int, lse_t: Tensor,
                        plan: BlockPlan, kmax: Tensor | None, ksum: Tensor | None) -> None:
    """The statistics of keys ``k [..., s, D]`` from row ``j0`` on (their masks' ``codes``, their
    slots ``dest [H, s]``, ``S`` for none) reduced into ``kmax``/``ksum`` ``[H, S + 1]``. Scores
    key-major, ``[..., s, G*r]``: each key's reductions run along contiguous memory; a slice of
    keys at a time (at most :data:`_STAT_SCORES` scores, into :func:`_scores`' buffer)."""
    acc, H, ha = qk.dtype, plan.dims.heads, plan.dims.head_axis
    s = k.shape[-2]
    step = max(1, _STAT_SCORES * qk.shape[-2] // max(1, qk.numel()))
    for j in range(j0, s, step):
        j2 = min(s, j + step)
        st = _scores(k[..., j:j2, :].to(acc), qk)
        masks = None if codes is None else (codes[0][..., j:j2, :], None if codes[1] is None else codes[1][..., j:j2, :],
                                            codes[2])
        bmax, bsum = _reduce_block(st, masks, lse_t, plan.scale, H, ha, kmax is not None, ksum is not None)
        if kmax is not None:
            kmax.scatter_reduce_(-1, dest[:, j:j2], bmax, reduce="amax")
        if ksum is not None:
            ksum.scatter_add_(-1, dest[:, j:j2], bsum)


def newest_slots(plan: BlockPlan) -> Tensor | None:
    """``[H, S + 1]`` bool: the slots holding the open span's positions (from its first query
    position on), for :meth:`Statistic.finish`; None unless the statistic leaves them out."""
    stat, qpos = plan.statistic, plan.query_positions
    if stat is None or not stat.newest or qpos is None or not qpos.numel():
        return None
    H, S = plan.dims.heads, plan.slots
    count = torch.zeros((H, S + 1), dtype=torch.int32, device=qpos.device)  # a slot's rows may lie in two
    for seg in plan.segments:                                               # segments, one of them hidden
        idx = seg.slot_index()
        if idx is None:
            continue
        dest = torch.where(idx >= 0, idx, S).expand(H, seg.n)
        count.scatter_add_(-1, dest, (seg.positions >= qpos[:1]).expand(H, seg.n).to(torch.int32))
    count[:, S] = 0
    return count > 0


def _candidates(plan: BlockPlan, seg: Segment, rows: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """The rows of a dense segment whose statistic a policy reads, gathered (``Statistic.newest``):
    neither a sink's (slots below ``skip``) nor the open span's (positions from its first query
    position on), nor empty. Returns their keys ``[..., M, D]`` (attention layout, as stored),
    positions ``[H, M]`` (-1 past a head's count) and slots ``[H, M]`` (``plan.slots`` there),
    ``M`` the segment's rows less the sinks' and the span's ``rows`` (the span's slots lie in
    the segment: every slot of the cache does); None where the segment does not qualify (codes,
    a basis, pages, a slot map) or ``M`` is 0."""
    stat, qpos = plan.statistic, plan.query_positions
    if not seg.contiguous or not isinstance(seg.slots, int) or seg.slots or seg.n != plan.slots or qpos is None:
        return None
    lo = min(seg.n, stat.skip)
    M = seg.n - lo - rows
    if M <= 0:
        return None
    H = plan.dims.heads
    pos = seg.positions[:, lo:].expand(H, -1)
    keep = (pos >= 0) & (pos < qpos[:1])
    rank = keep.cumsum(-1) - 1  # a kept row's rank among its head's kept rows: < M (see above)
    dest = torch.where(keep, rank, M)
    idx = torch.zeros((H, M + 1), dtype=torch.long, device=pos.device)
    idx.scatter_(-1, dest, torch.arange(lo, seg.n, device=pos.device).expand(H, -1))
    idx = idx[:, :M]
    real = torch.arange(M, device=pos.device) < keep.sum(-1, keepdim=True)
    held = torch.where(real, seg.positions.expand(H, -1).gather(-1, idx), -1)
    slots = torch.where(real, idx, plan.slots)
    return gather_rows(seg.keys, plan.dims.lay_out_heads(idx.unsqueeze(-1)).squeeze(-1)), held, slots


def _scores(k: Tensor, qk: Tensor) -> Tensor:
    """``k @ qk``, on the CPU (eager, no autograd) into this thread's buffer of the scores' dtype
    (:data:`_SCRATCH`, grown as needed, at most :data:`_STAT_SCORES` elements): a fresh buffer of
    a few MB is mapped and faulted in anew at every slice, at about 3 GB/s, and at every read
    when a pass takes one slice (SmolLM2's prefill product took 7.6 ms so, 4.6 ms into a kept
    buffer); the result is used before the next call."""
    if (k.device.type != "cpu" or torch.compiler.is_compiling()
            or (torch.is_grad_enabled() and (k.requires_grad or qk.requires_grad))):
        return k @ qk
    shape = (*torch.broadcast_shapes(k.shape[:-2], qk.shape[:-2]), k.shape[-2], qk.shape[-1])
    n = math.prod(shape)
    bufs = _SCRATCH.__dict__.setdefault("bufs", {})
    key = (k.dtype, torch.is_inference_mode_enabled())  # an inference tensor takes no write outside the mode
    buf = bufs.get(key)
    if buf is None or buf.numel() < n:
        buf = bufs[key] = torch.empty(n, dtype=k.dtype)
    return torch.matmul(k, qk, out=buf[:n].view(shape))


def _rank_masks(pos: Tensor, qpos: Tensor | None, window: int | None, dims: Dims
                ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """What a block's statistics hide their entries by (:func:`_hidden`), from the rows' positions
    ``pos [H, s]``: the keys' codes laid out ``[..., s, 1]``. Without causality (``qpos`` None):
    ``1`` for an empty slot, else ``0``; with the rows' positions ``qpos [R]``:
    :func:`~streamkv.masks.position_ranks`' codes, the rows' laid out ``[..., 1, R]``."""
    if qpos is None:
        return dims.lay_out_heads((pos < 0).to(torch.float32).unsqueeze(-1)), None, None
    c, d, rho = position_ranks(pos, qpos, window)
    lay = dims.lay_out_heads
    return lay(c.unsqueeze(-1)), None if d is None else lay(d.unsqueeze(-1)), rho.view(*([1] * (dims.rank - 2)), -1)


def _hidden(masks: tuple) -> Tensor:
    """The entries of a block's key-major scores ``[..., s, R]`` that are hidden, from ``masks``
    (:func:`_rank_masks`, sliced to the block's keys): an empty slot, and with the rows' codes a
    later key or one out of the window."""
    c, d, rho = masks
    return c > 0 if rho is None else ranks_hide(c, d, rho)


def _block_statistics(st: Tensor, masks: tuple | None, lse: Tensor, scale: float, heads: int, ha: int | None,
                      want_max: bool, want_sum: bool, sliced: bool = True) -> tuple[Tensor | None, Tensor | None]:
    """Per key of one block and head: ``max_i p`` / ``sum_i p`` (float64 ``[H, s]``) of
    ``p = exp(scores * scale - lse)`` over the query rows (and the batch), from key-major scores
    ``st [..., s, R]``, the entries :func:`_hidden` finds from ``masks`` 0, ``lse [..., 1, R]``. A probability is at
    most 1: ``exp`` above it is the rounding of a float32 or narrower ``lse`` (1 + 2**-16 seen),
    clamped so that a statistic keeps the range its state dict is checked against (the true ``p``
    is <= 1, so the clamp never takes a value below the truth). Maxima of the rounded values,
    widened after (the same as widening first); sums of each value widened to float64 (``sliced``:
    a slice of keys at a time, eagerly, so that no float64 copy of ``p`` is made; a compiled kernel
    widens in registers). Each key's rows are reduced where they lie (the last dim), then the
    batch (a compiled kernel keeps ``p`` in registers: no reshape of it to materialise)."""
    t = st * scale
    if masks is not None:
        t = t.masked_fill(_hidden(masks), float("-inf"))
    p = (t - lse).exp().clamp(max=1.0)
    bmax = _per_head(p.amax(-1), heads, ha, "max").to(torch.float64) if want_max else None
    bsum = None
    if want_sum and not sliced:
        bsum = _per_head(p.to(torch.float64).sum(-1), heads, ha, "sum")
    elif want_sum:
        s = p.shape[-2]
        step = max(1, _STAT_ELEMENTS * s // max(1, p.numel()))
        bsum = torch.cat([p[..., j:j + step, :].to(torch.float64).sum(-1) for j in range(0, s, step)], dim=-1)
        bsum = _per_head(bsum, heads, ha, "sum")
    return bmax, bsum


def _per_head(x: Tensor, heads: int, ha: int | None, how: str) -> Tensor:
    """``x [..., s]`` (the attention layout's leading dims, the head's at ``ha``) reduced over every
    leading dim but the head's: ``[H, s]``."""
    xh = x.movedim(ha, 0) if ha is not None else x.unsqueeze(0)
    xh = xh.reshape(heads, -1, x.shape[-1])
    return xh.sum(1) if how == "sum" else xh.amax(1)


_REDUCE: dict[tuple, Any] = {}
#: score entries of a block from which the CPU statistics run compiled (smaller: the eager ops)
COMPILE_MIN = 1 << 18


def _reduce_block(s: Tensor, masks: tuple | None, lse: Tensor, scale: float, heads: int, ha: int | None,
                  want_max: bool, want_sum: bool) -> tuple[Tensor | None, Tensor | None]:
    """:func:`_block_statistics`; on the CPU, a block of at least :data:`COMPILE_MIN` scores in one
    compiled kernel (mask from positions, scale, exp, clamp and both reductions in one pass over the
    scores, where the eager ops make seven), outside a trace and a Python dispatch mode."""
    if may_compile(s, s.numel(), COMPILE_MIN):
        shape = None if masks is None else (masks[1] is None, masks[2] is None)  # (no window, not causal)
        key = (shape, ha, want_max, want_sum)
        fn = _REDUCE.get(key, False)
        if fn is False:
            fn = _REDUCE[key] = _compile_reduce(key)
        if fn is not None:
            return fn(s, masks, lse, scale, heads)
    return _block_statistics(s, masks, lse, scale, heads, ha, want_max, want_sum)


def _compile_reduce(key: tuple) -> Any:
    """One compiled :func:`_block_statistics` per (masks' shape, head axis, reductions); None where
    torch cannot compile here."""
    _, ha, want_max, want_sum = key

    def reduce(s: Tensor, masks: tuple | None, lse: Tensor, scale: float, heads: int):
        return _block_statistics(s, masks, lse, scale, heads, ha, want_max, want_sum, sliced=False)

    return compile_kernel(reduce, "statistics_" + "_".join(str(x) for x in key))
