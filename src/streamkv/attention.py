"""Attention over a cache read, with an explicit dispatch between two paths.

:func:`attend` takes a :class:`~streamkv.caches.KVRead` (what ``layer.update(k, v, q)`` or
``cache.read(layer)`` returns; a layer handle is read on the spot):

``physical``
    SDPA straight on the buffers as they lie in memory, no gather. Exact when every key
    carries its own absolute RoPE (applied before the cache write): softmax attention is
    invariant to one permutation applied to the K and V rows alike. Empty slots are handled
    as the read says (``all`` / ``prefix`` / ``mask``). ``causal=True`` adds the mask a query
    at position ``p`` needs (occupied slots holding positions ``<= p``): a function of
    positions, so it stays exact in physical order (prefill chunks of an LLM).
``chronological``
    The retained keys gathered in position order first. Needed for masks that index the
    chronological view (``attn_mask``) and for cache-relative RoPE (``key_transform``
    rotates keys by their chronological index at read time). Refused where heads hold
    different positions (budgeted caches): there is no common order.

``order="physical"`` where it is invalid raises ``ValueError`` with every reason; so does
``order="chronological"`` where the read refuses it. ``order="auto"`` picks physical when
valid. The dispatcher never falls back silently; :class:`AttentionInfo` says which path ran.

The physical read's kernel (``kernel=``, see :func:`attend`): SDPA, the block loop or the Triton
read; ``"auto"`` chooses, a forced one that cannot serve the read raises naming why.

Scored policies (mass, H2O, TOVA) need the attention of the chunk's queries: when the read
asks for it (``read.scorer``), the physical path computes the softmax explicitly, a block of
queries at a time (:mod:`streamkv.scoring`), and hands the per-key statistics of that same
pass to the policy. No second pass over the cache.

Layouts: ``q`` in the cache's chunk layout (token dim at ``seq_dim``, features last; more heads
than the keys for grouped-query attention); the output alike, with the value feature size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from .caches.read import KVRead, Occupancy
from .masks import position_bias
from .validate import check_real
from .blockread import read_blocks
from .kernels import triton_read, why_not
from .scoring import blockwise_attention, check_block, fold_groups, unfold_groups

__all__ = ["attend", "AttentionInfo", "Kernel", "KERNELS", "Order", "RopeMode"]

Order = Literal["auto", "physical", "chronological"]
RopeMode = Literal["absolute", "cache_relative"]
Kernel = Literal["auto", "sdpa", "blocks", "triton"]
KERNELS = ("auto", "sdpa", "blocks", "triton")


class Readable(Protocol):
    def read(self) -> KVRead: ...


@dataclass(frozen=True)
class AttentionInfo:
    """Which path ran, how empty slots were handled, how many key rows were read, the per-query
    log-sum-exp when asked for, and which kernel ran and why (``kernel``: ``"sdpa"``,
    ``"blocks"``, ``"triton"``; ``"gathered"`` on the chronological path: its own SDPA or explicit
    softmax over the gathered keys; ``"answered"``: an observer had computed this read already,
    e.g. a certifying compressed tier, whose certificate computes the attention over tiers 1 and
    2; ``kernel_reason``: why ``kernel="auto"`` chose it, or that it was forced)."""

    path: Literal["physical", "chronological"]
    occupancy: Occupancy | None
    keys_read: int
    lse: Tensor | None = None
    scored: bool = False
    kernel: Literal["sdpa", "blocks", "triton", "gathered", "answered"] = "sdpa"
    kernel_reason: str = ""


def attend(
    q: Tensor,
    source: KVRead | Readable,
    *,
    order: Order = "auto",
    rope_mode: RopeMode = "absolute",
    key_transform: Callable[[Tensor], Tensor] | None = None,
    attn_mask: Tensor | None = None,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    block: int = 256,
    kernel: Kernel = "auto",
) -> tuple[Tensor, AttentionInfo]:
    """Attention of ``q`` over a cache read.

    Args:
        q: queries in the cache's chunk layout (token dim at ``seq_dim``, features last).
        source: a :class:`~streamkv.caches.KVRead`, or a layer handle (``cache.layer(i)``),
            or a one-layer cache (read now).
        order: ``"physical"``, ``"chronological"`` or ``"auto"`` (physical when valid).
        rope_mode: ``"absolute"`` (keys rotated at their positions before the write) or
            ``"cache_relative"`` (keys stored unrotated; ``key_transform`` rotates the
            chronological keys ``[..., L, D]`` at read time): chronological path only.
        attn_mask: additive or boolean mask over the *chronological* keys, broadcastable to
            ``[..., Lq, L]`` (chronological path only).
        causal: hide from a query the keys at later positions; the queries are the open
            chunk's rows (their positions come from the read).
        window: with ``causal``, a sliding window: a query at ``p`` sees only keys at
            positions ``> p - window`` (its own included), each query its own window
            (transformers' ``sliding_window``); None: no window.

    A read whose cache stores raw keys (``read.rope_at_read``, a
    :class:`~streamkv.rope_at_read.RopeAtRead`) is rotated here: ``q`` is given un-rotated
    and rotated by the position map, the keys a block of slots at a time as they are read
    (physical order) or after the gather (chronological).
        scale: softmax scale (default ``1/sqrt(D)``).
        return_lse: also return the per-query log-sum-exp in ``info.lse`` (``[..., Lq]``, the
            token dim moved last).
        block: query rows per block where the softmax is computed explicitly (slots per block
            where the read loads its keys, ``read.load``; a read that rotates raw keys uses its
            ``RopeAtRead``'s ``block``).
        kernel: the physical read's kernel: ``"sdpa"`` (one plain dense segment, no statistics
            and no ``return_lse``), ``"blocks"`` (the block loop, any physical read, any device),
            ``"triton"`` (the Triton read where :func:`streamkv.kernels.why_not` is None: CUDA, or
            the CPU under ``TRITON_INTERPRET=1``), or ``"auto"``: SDPA for a plain dense read, else
            Triton on CUDA tensors where it serves the plan, else the block loop (the CPU always).
            A forced kernel that cannot serve the read raises; the chronological path takes
            ``"auto"`` only. ``info.kernel`` and ``info.kernel_reason`` say what ran and why.
            Decided from types, shapes and devices (no host sync).
            With ``"auto"``, a read an observer already computed for this very ``q`` tensor and
            these options is answered from it (a certifying compressed tier's certificate:
            ``info.kernel == "answered"``); a forced kernel computes the read.

    Returns:
        ``(out, info)``: ``out`` in ``q``'s layout with the value feature size.

    Raises:
        ValueError: an invalid path, kernel or option (the message says why); a query whose batch,
            heads or features do not match the keys; a read of an empty cache.
        TypeError: ``q`` is not a tensor of the cache's dtype.
    """
    read = source if isinstance(source, KVRead) else _read_of(source)
    block = check_block(block)
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(map(repr, KERNELS))}, got {kernel!r}")
    path = _check(q, read, order, rope_mode, key_transform, attn_mask, causal, window, return_lse)
    if scale is not None:
        scale = check_real("scale", scale, positive=True)
    qt = read.dims.attention(q)
    scale = 1.0 / math.sqrt(qt.shape[-1]) if scale is None else float(scale)
    if path == "chronological":
        if kernel != "auto":
            raise ValueError(f"kernel={kernel!r} chooses the physical read's kernel; this read takes the chronological "
                             f"path (keys gathered in position order), which has its own: pass kernel='auto'")
        out, lse, keys_read = _chronological(qt, read, key_transform, attn_mask, causal, window, scale, return_lse)
        out, lse = _poisoned(qt, out, lse)
        return read.dims.from_attention(out), AttentionInfo(path=path, occupancy=None, keys_read=keys_read, lse=lse,
                                                            kernel="gathered", kernel_reason="the chronological path")
    scored = read.scorer is not None
    if kernel == "auto" and read.answer is not None:
        got = read.answer(q, scale=scale, causal=causal, window=window, statistic=read.statistic if scored else None,
                          lse=return_lse)
        if got is not None:
            if scored:
                read.scorer(got.key_max, got.key_sum)
            out, lse = _poisoned(qt, got.out, got.lse)
            return read.dims.from_attention(out), AttentionInfo(path=path, occupancy=read.occupancy, keys_read=got.keys,
                                                                lse=lse, scored=scored, kernel="answered",
                                                                kernel_reason=got.why)
    segments = read.segments()
    not_sdpa = _not_sdpa(read, segments, scored, return_lse)
    if kernel == "sdpa" and not_sdpa:
        raise ValueError(f"kernel='sdpa' cannot serve this read of {read.name}: " + "; ".join(not_sdpa))
    if kernel in ("auto", "sdpa") and not not_sdpa:
        out, _ = _poisoned(qt, _sdpa(qt, read, segments[0], causal, window, scale))
        why = "forced" if kernel == "sdpa" else "one plain dense segment: SDPA on the buffers as they lie"
        return read.dims.from_attention(out), AttentionInfo(path=path, occupancy=read.occupancy,
                                                            keys_read=read.visible, kernel="sdpa", kernel_reason=why)
    if len(segments) == 1 and segments[0].contiguous and read.rope_at_read is None and read.occupancy == "prefix":
        segments = [_prefix(segments[0], read.visible)]
    qt, plan = read.block_plan(qt, scale=scale, causal=causal, window=window,
                               statistic=read.statistic if scored else None, block=max(block, _KEY_BLOCK),
                               lse=return_lse, segments=segments)
    ran, why = _choose(kernel, qt, plan, not_sdpa)
    res = triton_read(qt, plan) if ran == "triton" else read_blocks(qt, plan)
    if scored:
        read.scorer(res.key_max, res.key_sum)
    out, lse = _poisoned(qt, res.out, res.lse)
    info = AttentionInfo(path=path, occupancy=read.occupancy, keys_read=sum(s.n for s in segments), lse=lse,
                         scored=scored, kernel=ran, kernel_reason=why)
    return read.dims.from_attention(out), info


def _poisoned(qt: Tensor, out: Tensor, lse: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """``out`` (and ``lse``) NaN in every row whose query holds NaN or an infinity: each of that row's
    scores is then NaN or infinite, so its softmax is NaN, as float64 attention gives, where torch's
    fused CPU kernel returns 0 for it when no mask is given. In place (the read's own tensors), no
    host read; a large finite query stays finite (its max and min times 0, not its sum)."""
    lo, hi = torch.aminmax(qt, dim=-1, keepdim=True)
    bad = lo.mul_(0).add_(hi.mul_(0))
    return out.add_(bad.to(out.dtype)), (None if lse is None else lse.add_(bad[..., 0].to(lse.dtype)))


def _not_sdpa(read: KVRead, segments: list, scored: bool, return_lse: bool) -> list[str]:
    """Why SDPA on the buffers as they lie cannot serve this physical read (empty: it can)."""
    why = []
    if any(seg.k_codec is not None or seg.v_codec is not None for seg in segments):
        why.append("it holds quantised codes (decoded a block at a time)")
    if any(seg.pages is not None for seg in segments):
        why.append("its rows lie in pages (a page table)")
    if any(seg.k_basis is not None or seg.v_basis is not None for seg in segments):
        why.append("its rows are stored in a rotated basis")
    if read.extras is not None:
        why.append("an observer adds rows to the read (a compressed tier)")
    if len(segments) != 1 and not why:
        why.append(f"the read has {len(segments)} segments")
    if read.rope_at_read is not None:
        why.append("its keys are raw and rotated at read by a position map")
    if scored:
        why.append("its policy asks the read for per-slot statistics")
    if return_lse:
        why.append("return_lse=True asks for the log-sum-exp")
    return why


def _choose(kernel: str, qt: Tensor, plan, not_sdpa: list[str]) -> tuple[str, str]:
    """The block plan's kernel (``"blocks"`` or ``"triton"``) and why; a forced Triton read that
    cannot serve the plan raises with :func:`~streamkv.kernels.why_not`'s reason."""
    if kernel == "blocks":
        return "blocks", "forced"
    if kernel == "triton":
        why = why_not(qt, plan)
        if why is not None:
            raise ValueError(f"kernel='triton' cannot serve this read: {why}")
        return "triton", "forced"
    plain = "; ".join(not_sdpa)
    if qt.device.type != "cuda":
        return "blocks", f"{qt.device.type} tensors (auto picks Triton on CUDA only); not SDPA: {plain}"
    if torch.compiler.is_compiling():
        return "blocks", f"under torch.compile (the Triton read runs eager or in a CUDA graph); not SDPA: {plain}"
    why = why_not(qt, plan)
    if why is not None:
        return "blocks", f"the Triton read cannot serve it: {why}; not SDPA: {plain}"
    return "triton", f"CUDA tensors the Triton read serves; not SDPA: {plain}"


#: key rows per block of the block loop (at least; ``attend``'s ``block`` if larger)
_KEY_BLOCK = 16384


def _check(q: Tensor, read: KVRead, order: str, rope_mode: str, key_transform, attn_mask, causal: object,
           window: object, return_lse: object) -> str:
    """Every option checked against the read, before any work; returns the path."""
    if order not in ("auto", "physical", "chronological"):
        raise ValueError(f"order must be 'auto', 'physical' or 'chronological', got {order!r}")
    if rope_mode not in ("absolute", "cache_relative"):
        raise ValueError(f"rope_mode must be 'absolute' or 'cache_relative', got {rope_mode!r}")
    if rope_mode == "cache_relative" and key_transform is None:
        raise ValueError("rope_mode='cache_relative' needs key_transform to rotate the chronological keys")
    if rope_mode != "cache_relative" and key_transform is not None:
        raise ValueError(f"key_transform is applied only with rope_mode='cache_relative' (keys stored unrotated); "
                         f"with rope_mode={rope_mode!r} it would be ignored")
    if key_transform is not None and not callable(key_transform):
        raise TypeError(f"key_transform must be callable, got {type(key_transform).__name__}")
    if not isinstance(return_lse, bool) or not isinstance(causal, bool):
        raise TypeError(f"causal and return_lse must be bools, got {causal!r} and {return_lse!r}")
    _check_query(q, read)
    read.check_current()
    if read.empty:
        raise ValueError(f"{read.name} holds no token yet: begin_chunk and write before attending")
    reasons = []
    if rope_mode == "cache_relative":
        reasons.append("keys use cache-relative RoPE (their rotation depends on chronological order)")
    if attn_mask is not None:
        reasons.append("an attention mask is given (it indexes chronological keys)")
    if order == "physical" and reasons:
        raise ValueError("the physical-order path is invalid here: " + "; ".join(reasons))
    path = "physical" if order == "physical" or (order == "auto" and not reasons) else "chronological"
    if path == "chronological" and read.chronological is None:
        raise ValueError(f"the chronological path is invalid for {read.name}: {read.chronological_refusal}"
                         + (f"; and it is needed because {'; '.join(reasons)}" if reasons else ""))
    if window is not None and (not causal or isinstance(window, bool) or not isinstance(window, int)
                               or not 1 <= window <= 2**53):
        raise ValueError(f"window must be an int in [1, 2**53] (positions are below 2**53) and needs causal=True, "
                         f"got window={window!r}, causal={causal}")
    if read.rope_at_read is not None and rope_mode == "cache_relative":
        raise ValueError(f"{read.name} rotates its raw keys by a position map at read (rope_at_read): "
                         f"rope_mode='cache_relative' with a key_transform would rotate them twice")
    rows = q.shape[read.seq_dim]
    if (causal or read.rope_at_read is not None) and read.query_positions is None:
        why = "causal=True" if causal else f"{read.name}: rotation at read (rope_at_read)"
        raise ValueError(f"{why} needs the queries' positions, and no span is open (begin_chunk / begin_tokens, "
                         f"then update, then attend)")
    if (causal or read.rope_at_read is not None) and rows != read.query_positions.numel():
        why = "causal=True" if causal else f"{read.name} rotates queries at their positions (rope_at_read)"
        raise ValueError(f"{why}: q has {rows} rows and the open span {read.query_positions.numel()}: the queries are "
                         f"the open span's rows")
    if attn_mask is not None:
        _check_mask(attn_mask, q, read)
    return path


def _sdpa(qt: Tensor, read: KVRead, seg, causal: bool, window: int | None, scale: float) -> Tensor:
    """One dense buffer as it lies: SDPA, with the mask the occupancy (and causality) needs."""
    k, v = seg.keys, seg.values
    if read.occupancy == "prefix":
        k, v = k.narrow(-2, 0, read.visible), v.narrow(-2, 0, read.visible)
    heads = read.dims.heads
    ha = read.head_axis
    groups = 1 if ha is None or qt.shape[ha] == heads else qt.shape[ha] // heads
    if causal:  # rows g*Q + i: the groups folded into the rows
        bias = read.causal_bias(read.query_positions, qt.dtype, window, groups)
    else:
        bias = read.bias(qt.dtype) if read.occupancy == "mask" else None
    if groups > 1:
        qf = fold_groups(qt, heads, ha)
        return unfold_groups(F.scaled_dot_product_attention(qf, k, v, attn_mask=bias, scale=scale), groups, ha)
    return F.scaled_dot_product_attention(qt, k, v, attn_mask=bias, scale=scale)


def _prefix(seg, visible: int):
    """A dense segment's first ``visible`` rows (the occupied prefix of a filling window cache)."""
    return dataclasses.replace(seg, n=visible, positions=seg.positions[:, :visible], visible=True,
                               keys=seg.keys.narrow(-2, 0, visible), values=seg.values.narrow(-2, 0, visible))


def _chronological(qt: Tensor, read: KVRead, key_transform, attn_mask, causal: bool, window: int | None,
                   scale: float, return_lse: bool) -> tuple[Tensor, Tensor | None, int]:
    """Keys gathered in position order (masks over them, cache-relative RoPE)."""
    kc, vc, positions = read.chronological()
    k, v = read.dims.attention(kc).to(qt.dtype), read.dims.attention(vc).to(qt.dtype)
    if read.rope_at_read is not None:  # raw keys: the queries and the gathered keys rotated by the map
        rotation = read.rope_at_read.plan(read)
        qt = rotation.queries(qt)
        k = rotation.chronological_keys(k, positions)
    if key_transform is not None:
        shape = tuple(k.shape)
        k = key_transform(k)
        if not isinstance(k, Tensor) or tuple(k.shape) != shape or k.dtype != qt.dtype:
            got = f"{tuple(k.shape)} {k.dtype}" if isinstance(k, Tensor) else type(k).__name__
            raise ValueError(f"key_transform must return the keys it was given, rotated: a {shape} {qt.dtype} tensor, "
                             f"got {got}")
    bias = None
    if attn_mask is not None:
        bias = attn_mask if attn_mask.dtype != torch.bool else torch.zeros(
            attn_mask.shape, dtype=qt.dtype, device=qt.device).masked_fill(~attn_mask, float("-inf"))
    if causal:
        kp = torch.tensor(positions, dtype=torch.long, device=qt.device)
        cb = position_bias(kp, read.query_positions, qt.dtype, window)
        bias = cb if bias is None else bias + cb
    heads, ha = read.dims.heads, read.head_axis
    groups = 1 if ha is None or qt.shape[ha] == heads else qt.shape[ha] // heads
    qf = fold_groups(qt, heads, ha)
    if bias is not None and groups > 1 and bias.dim() >= 2 and bias.shape[-2] != 1:
        bias = bias.repeat(*([1] * (bias.dim() - 2)), groups, 1)
    if return_lse:
        res = blockwise_attention(qf, k, v, bias, scale=scale, lse=True, head_axis=ha)
        out, lse = res.out, res.lse
        lse = unfold_groups(lse.unsqueeze(-1), groups, ha).squeeze(-1)
    else:
        out, lse = F.scaled_dot_product_attention(qf, k, v, attn_mask=bias, scale=scale), None
    return unfold_groups(out, groups, ha), lse, k.shape[-2]


def _read_of(source: object) -> KVRead:
    read = getattr(source, "read", None)
    if not callable(read):
        raise TypeError(f"source must be a KVRead or have a read() method (a cache layer), got {type(source).__name__}")
    return read()


def _check_mask(mask: object, q: Tensor, read: KVRead) -> None:
    """``attn_mask`` must be a bool or floating tensor on the queries' device, broadcastable to
    the scores over the chronological keys ``[..., Lq, L]`` (checked here, naming the mask)."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"attn_mask must be a Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"attn_mask must be bool or floating point (additive), got {mask.dtype}")
    if mask.device != q.device:
        raise ValueError(f"attn_mask must be on the queries' device {q.device}, got {mask.device}")
    if read.num_retained is None:
        return  # the chronological path refuses this read (and says why)
    scores = (*q.movedim(read.seq_dim, -2).shape[:-1], read.num_retained)
    try:
        ok = torch.broadcast_shapes(mask.shape, scores) == torch.Size(scores)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"attn_mask {tuple(mask.shape)} must broadcast to the scores over the chronological keys {scores} "
            f"(queries x the {read.num_retained} retained keys)"
        )


def _check_query(q: Tensor, read: KVRead) -> None:
    if not isinstance(q, Tensor):
        raise TypeError(f"q must be a Tensor, got {type(q).__name__}")
    shape = read.k_shape
    if q.dtype != read.dtype:
        raise TypeError(f"q must have the cache dtype {read.dtype}, got {q.dtype}")
    if q.device != read.device:
        raise ValueError(f"q must be on the cache device {read.device}, got {q.device}")
    if q.dim() != len(shape):
        raise ValueError(f"q must have rank {len(shape)} like the cache's keys {shape}, got {tuple(q.shape)}")
    for d in range(len(shape)):
        if d == read.seq_dim:
            continue
        qs, ks = q.shape[d], shape[d]
        head = d == read.dims.head
        if qs != ks and not (head and qs % ks == 0):
            what = "features" if d == len(shape) - 1 else ("heads (or a multiple)" if head else f"dim {d}")
            raise ValueError(
                f"q must match the cache's keys in {what}: q {tuple(q.shape)} vs keys {shape} "
                f"(dim {d}: {qs} vs {ks}); no broadcasting"
            )
    if q.shape[read.seq_dim] < 1:
        raise ValueError("q has no query rows")
