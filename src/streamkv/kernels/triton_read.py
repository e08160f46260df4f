"""The block read in Triton: :func:`triton_read` serves a :class:`~streamkv.blockread.BlockPlan` with
the semantics of :func:`~streamkv.blockread.read_blocks` (one softmax over every segment, masks
from positions, grouped-query attention, storage bases, RoPE at read, per-slot statistics), on
CUDA tensors -- and on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``), which
is how the test suite checks it on a machine without a GPU. :func:`why_not` says why a plan
cannot be served (None when it can): the dispatcher asks it first and never falls back silently.

Launches (per read):

1. one :func:`~._read_kernels.attn_kernel` launch per segment (flash-attention style: a tile of
   ``BLOCK_M`` folded query rows of one key head, an online softmax over ``BLOCK_N`` keys at a
   time). Everything per key happens in registers: the page-table walk, the decoding of codes
   (int1/2/4/8 unpacking, fp8 e4m3 from its bits, bf16 bytes, times the group's scale), the
   rotation of raw keys (the angle from the key's rotation offset -- evaluated by the position
   map in torch before the launch, ``O(S)`` -- and the rotary's limb residues; FrameRope's
   height/width bands from a per-token table), the masks. Where a segment's programs would not
   fill the device (decoding: one query) its keys are split over ``splits`` programs
   (flash-decoding). The queries of a segment stored in a key basis ``R`` are ``q @ R.T``,
   computed once per basis in torch; a segment stored in a value basis applies ``R`` to its
   normalised output once, in the kernel's epilogue.
2. where the read has more than one part (segments x splits): one
   :func:`~._read_kernels.merge_kernel` launch combining the parts by their log-sum-exps (the
   same softmax: a part's output is normalised, its weight ``exp(lse_part - lse)``), which
   also gives the log-sum-exp over the parts that are cache slots. One launch per segment,
   not one for all: each segment's storage format (codec, bits, groups, page table, bases,
   rotation) is a compile-time specialisation of the decode path; serving several formats in
   one launch would mean a runtime switch in the inner loop (registers, divergence) or one
   compiled kernel per combination of formats. The merge costs ``O(parts x Q x Dv)``.
3. with a declared :class:`~streamkv.blockread.Statistic`: one
   :func:`~._read_kernels.stat_kernel` launch per segment holding cache slots (each key block
   decoded and rotated once, then every selected query row against it), producing ``[H, n]``
   reductions per row of the segment, scattered to the cache's slots in torch
   (:meth:`~streamkv.stores.Segment.slot_index`, float64 ``[H, S]``).

Rounding: scores and the softmax in float32 (float64 for float64 queries), the two products in
the queries' dtype (decoded or rotated keys rounded to it, as the reference's fused block does;
float32 and float64 products in IEEE precision, not TF32), rotation angles from the limbs in
float64 then taken in float32, reduced mod 2 pi first (float64: as they are), as
:meth:`~streamkv.rotary.Rotary.cos_sin` takes them,
statistics summed in float64.

Where it differs from :func:`~streamkv.blockread.read_blocks` (both on purpose): a hidden row
(position -1) weighs nothing whatever it holds (the reference multiplies its values by 0: NaN
where they are NaN); a query row that sees no cache slot (only rows outside the slots, a tier's)
adds nothing to the statistics (the reference normalises it by ``-inf``: NaN statistics for
every slot). Refused (:func:`why_not`): keys in a storage basis read with rotation at read (the
reference rotates the stored ``k @ R.T``, which is not ``k`` rotated: exact only with ``R`` applied
to every key block), rotaries other than :class:`~streamkv.rotary.Rope1D` /
:class:`~streamkv.rotary.FrameRope`, codecs other than those of
:data:`~streamkv.stores.KV_FORMATS`' classes, feature sizes above :data:`MAX_FEATURES`, layouts
whose leading dims besides the heads do not merge into one stride (the kernel never copies a
buffer), float dtypes other than float16 / bfloat16 / float32 / float64.

On the CPU the kernels run in Triton's interpreter, which needs ``TRITON_INTERPRET=1`` before
``triton`` is first imported (:func:`interpreter_reason`); its product of bfloat16 tensors
multiplies their bit patterns, so there bfloat16 operands are widened to float32 first (exact:
the same products, accumulated in float32 as the tensor cores do).

Graph safety: no host read of a tensor value, no host-to-device copy, no synchronisation: every
changing input (positions, rotation offsets, page tables, query positions, map parameters) is
device data read by the kernels; tile sizes and splits depend on shapes only. The allocations
are the outputs and, with several parts, the parts' workspace (``parts x rows x Dv``), from
torch's allocator (a captured graph's pool). The kernels compile on first use: warm up before
capturing.

Why one module, and why this long: the launch plan, its refusals and the rounding contract above
are one specification of one read; split, each half would restate the other.
"""

from __future__ import annotations

import importlib
import importlib.util
import struct
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from ..blockread import BlockPlan, Statistic, newest_slots
from ..rotary import _LIMB, FrameRope, Rope1D
from ..scoring import Blockwise
from ..stores import BF16Codec, Fp8Codec, IntCodec, Segment

__all__ = ["KernelConfig", "MAX_FEATURES", "interpreter_reason", "triton_read", "why_not"]

#: the largest key/value feature size a tile holds (registers: a tile is ``BLOCK x features``)
MAX_FEATURES = 256

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CODEC_DENSE, _CODEC_INT, _CODEC_FP8 = 0, 1, 2


@dataclass(frozen=True)
class KernelConfig:
    """Tiles of the kernels (0: chosen from the shapes and the device).

    ``block_m``: folded query rows per program; ``block_n``: keys per step; ``splits``: programs
    a segment's keys are split over (1: none); ``stat_block_m`` / ``stat_block_n``: the
    statistics kernel's query rows per step and keys per program; ``num_warps``,
    ``num_stages``: Triton's launch options. Powers of two, at least 16 (a product's minimum)."""

    block_m: int = 0
    block_n: int = 0
    splits: int = 0
    stat_block_m: int = 0
    stat_block_n: int = 0
    num_warps: int = 0
    num_stages: int = 0

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "stat_block_m", "stat_block_n"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or (v and (v < 16 or v & (v - 1))):
                raise ValueError(f"KernelConfig.{name} must be 0 (chosen) or a power of two >= 16, got {v!r}")
        for name in ("splits", "num_warps", "num_stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"KernelConfig.{name} must be an int >= 0 (0: chosen), got {v!r}")


# ---------------------------------------------------------------------------------------- triton
def _interpreting() -> bool:
    import triton

    return bool(triton.knobs.runtime.interpret)


def interpreter_reason() -> str | None:
    """Why this process cannot run the kernels on CPU tensors (None: it can). The interpreter needs
    ``TRITON_INTERPRET=1`` now, and needed it when ``triton`` was first imported: Triton jits its
    own language functions (``tl.sum``, ``tl.zeros``...) for one mode at import. Import-free of
    values: safe anywhere."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if not _interpreting():
        return ("CPU tensors run only under the Triton interpreter (set TRITON_INTERPRET=1 before triton is first "
                "imported)")
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.zeros, InterpretedFunction):
        return ("triton was imported before TRITON_INTERPRET=1 was set: its language functions are jitted for the "
                "compiler, not the interpreter (set it before triton is first imported, e.g. in a fresh process)")
    return None


def _kernels() -> Any:
    """The kernels module, jitted for the current mode (compiled, or the interpreter: Triton fixes
    the mode when a kernel is decorated, so a module loaded in the other mode is reloaded)."""
    mod = importlib.import_module("streamkv.kernels._read_kernels")
    if mod.INTERPRETED != _interpreting():
        mod = importlib.reload(mod)
    return mod


def _tl(dtype: torch.dtype) -> Any:
    import triton.language as tl

    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
            torch.float64: tl.float64}[dtype]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(x: int, least: int = 16) -> int:
    return max(least, 1 << max(0, (x - 1).bit_length()))


def _split3(x: float) -> tuple[float, float, float]:
    """``x`` as three float32 numbers whose float64 sum is ``x`` exactly (Triton passes float
    scalars as float32)."""
    f32 = lambda v: struct.unpack("f", struct.pack("f", v))[0]  # noqa: E731 - round to nearest float32
    hi = f32(x)
    mid = f32(x - hi)
    return hi, mid, f32(x - hi - mid)


_SMS: dict[int, int] = {}


def _sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


# ---------------------------------------------------------------------------------------- layout
def _as4(t: Tensor, lead: tuple[int, ...], head_axis: int | None) -> Tensor:
    """A tensor in the attention layout ``[*lead', N, W]`` (leading dims broadcastable to ``lead``,
    the folded queries' leading dims) as a view ``[R, H, N, W]``. Raises RuntimeError where the
    leading dims besides the head do not merge into one stride (it never copies)."""
    n, w = t.shape[-2:]
    t = t.expand(*lead, n, w)
    t = t.unsqueeze(-3) if head_axis is None else t.movedim(head_axis, -3)
    return t.view(-1, *t.shape[-3:])


def _codec(codec: Any) -> tuple[int, int] | None:
    """``(kind, bits)`` of a codec the kernel decodes (None: dense rows), or raise ValueError."""
    if codec is None:
        return None
    if type(codec) is IntCodec and codec.bits in (1, 2, 4, 8):
        return _CODEC_INT, codec.bits
    if type(codec) is Fp8Codec:
        return _CODEC_FP8, 8
    if type(codec) is BF16Codec:
        return _CODEC_DENSE, 16  # its bytes are read as bfloat16 rows
    raise ValueError(f"the kernel decodes IntCodec(1|2|4|8), Fp8Codec and BF16Codec, not {codec!r}")


@dataclass
class _Rows:
    """One of a segment's stored tensors (keys or values) as the kernel reads it."""

    x: Tensor  # [R, H, N, W] codes or dense rows (bf16 codes viewed as bfloat16)
    scale: Tensor | None  # [R, H, N, G]
    kind: int
    bits: int
    group: int
    dtype: torch.dtype  # of the decoded rows (dense: as stored; codes: the segment's dtype)


def _rows(seg: Segment, which: int, lead: tuple[int, ...], head_axis: int | None) -> _Rows:
    codec = seg.k_codec if which == 0 else seg.v_codec
    x = seg.keys if which == 0 else seg.values
    scale = seg.k_scale if which == 0 else seg.v_scale
    kind = _codec(codec)
    if kind is None:
        if x.dtype not in _FLOATS:
            raise ValueError(f"dense rows of dtype {x.dtype} (the kernel reads {', '.join(map(str, _FLOATS))})")
        return _Rows(_as4(x, lead, head_axis), None, _CODEC_DENSE, 0, 1, x.dtype)
    if seg.dtype not in _FLOATS:
        raise ValueError(f"a code segment computed in {seg.dtype}")
    if x.dtype != torch.uint8:
        raise ValueError(f"codes of dtype {x.dtype} (uint8 expected)")
    if kind[0] == _CODEC_DENSE:  # bf16 bytes
        try:
            x = x.view(torch.bfloat16)
        except RuntimeError as exc:
            raise ValueError(f"bf16 codes that cannot be viewed as bfloat16 rows ({exc})") from None
        return _Rows(_as4(x, lead, head_axis), None, _CODEC_DENSE, 0, 1, seg.dtype)
    if scale is None:
        raise ValueError(f"{codec!r} codes without their scales")
    group = seg.groups[which]
    dim = seg.features[which]
    if group < 1 or dim % group:
        raise ValueError(f"scale groups of {group} channels over {dim} features")
    return _Rows(_as4(x, lead, head_axis), _as4(scale, lead, head_axis), kind[0], kind[1], group, seg.dtype)


@dataclass
class _Rotation:
    """The rotary's tables as the kernel reads them."""

    interleaved: bool
    residues: Tensor  # float64 [3, F_MOVE] on the device (row 0: the frequencies)
    f_move: int
    nstat: int
    tpu: int
    hw_cos: Tensor | None  # [TPU, NSTAT] in the accumulation dtype (FrameRope)
    hw_sin: Tensor | None


_HW_TABLES: dict[tuple[int, torch.dtype], tuple[Any, Tensor, Tensor]] = {}


def _rotation(plan: BlockPlan, D: int, acc: torch.dtype) -> _Rotation:
    rot = plan.rotation.rotary  # checked by _rotation_check
    if type(rot) is Rope1D:
        res = rot.residues
        return _Rotation(rot.style == "interleaved", res, res.shape[1], 0, 1, None, None)
    if type(rot) is FrameRope:
        res = rot.residues
        f_move, npair = res.shape[1], D // 2
        key = (id(rot), acc)
        if key not in _HW_TABLES:  # the rotary's own cos/sin of a frame's tokens: its static bands
            tpu = rot.tokens_per_unit
            pos = torch.arange(tpu, device=res.device)
            cos, sin = rot.cos_sin(torch.zeros_like(pos), pos, acc)
            _HW_TABLES[key] = (rot, cos[:, f_move:].contiguous(), sin[:, f_move:].contiguous())
        _, hc, hs = _HW_TABLES[key]
        return _Rotation(True, res, f_move, npair - f_move, rot.tokens_per_unit, hc, hs)
    raise AssertionError(type(rot))


# ---------------------------------------------------------------------------------------- checks
def why_not(qt: Tensor, plan: BlockPlan) -> str | None:
    """Why :func:`triton_read` cannot serve ``plan`` for queries ``qt`` (None: it can). Reads
    shapes, dtypes, devices and types only (no tensor value): safe to call under capture."""
    reasons = _reasons(qt, plan)
    return "; ".join(reasons) if reasons else None


def _reasons(qt: Tensor, plan: BlockPlan) -> list[str]:
    if importlib.util.find_spec("triton") is None:
        return ["triton is not installed (pip install triton: the kernels import it on first use)"]
    if not isinstance(qt, Tensor) or qt.dim() < 2:
        return ["the queries must be a tensor in the attention layout [..., Q, D]"]
    if not isinstance(plan, BlockPlan):
        return [f"a BlockPlan is needed, got {type(plan).__name__}"]
    out = []
    dev = qt.device
    if dev.type == "cpu" and interpreter_reason() is not None:
        out.append(interpreter_reason())
    elif dev.type not in ("cpu", "cuda"):
        out.append(f"tensors on {dev.type} (the kernel runs on CUDA, or on the CPU under the interpreter)")
    if qt.dtype not in _FLOATS:
        out.append(f"queries of dtype {qt.dtype} (float16, bfloat16, float32 or float64)")
    if not plan.segments or all(seg.n == 0 for seg in plan.segments):
        out.append("a read needs at least one key block")
    dims, D = plan.dims, qt.shape[-1]
    H, ha = dims.heads, dims.head_axis
    if ha is not None and (qt.dim() < ha + 3 or qt.shape[ha] % H):
        out.append(f"queries {tuple(qt.shape)} do not have a multiple of the keys' {H} heads at dim {ha}")
        return out
    if D > MAX_FEATURES:
        out.append(f"a key feature size of {D} (a tile holds at most {MAX_FEATURES})")
    lead = tuple(qt.shape[:-2])
    if ha is not None:
        lead = lead[:ha] + (H,) + lead[ha + 1:]
    if plan.causal:
        qp = plan.query_positions
        if not isinstance(qp, Tensor) or qp.shape != (qt.shape[-2],) or qp.dtype.is_floating_point:
            out.append(f"causal masks need integer query positions [{qt.shape[-2]}]")
        elif qp.device != dev:
            out.append(f"query positions on {qp.device}, queries on {dev}")
    acc = torch.float64 if qt.dtype == torch.float64 else torch.float32
    if plan.rotation is not None:
        try:
            _rotation_check(plan, D)
        except ValueError as exc:
            out.append(f"rotation at read: {exc}")
    dvs = set()
    for i, seg in enumerate(plan.segments):
        what = f"segment {i}"
        if not isinstance(seg, Segment):
            out.append(f"{what} is a {type(seg).__name__}, not a Segment")
            continue
        d, dv = seg.features
        dvs.add(dv)
        if d != D:
            out.append(f"{what} has {d} key features, the queries {D}")
        if dv > MAX_FEATURES:
            out.append(f"{what}: a value feature size of {dv} (a tile holds at most {MAX_FEATURES})")
        tensors = [seg.positions, seg.keys, seg.values, seg.k_scale, seg.v_scale, seg.k_basis, seg.v_basis, seg.pages,
                   seg.slots if isinstance(seg.slots, Tensor) else None]
        if any(t is not None and t.device != dev for t in tensors):
            out.append(f"{what} has tensors off the queries' device {dev}")
            continue
        if seg.positions.dim() != 2 or seg.positions.shape[0] not in (1, H) or seg.positions.shape[1] != seg.n:
            out.append(f"{what}: positions {tuple(seg.positions.shape)}, not [H|1, n] = [{H}, {seg.n}]")
        elif seg.positions.dtype.is_floating_point:
            out.append(f"{what}: positions of dtype {seg.positions.dtype}")
        for which, name in ((0, "keys"), (1, "values")):
            try:
                rows = _rows(seg, which, lead, ha)
                if rows.x.shape[-1] * (8 // rows.bits if rows.bits and rows.bits < 8 else 1) < seg.features[which]:
                    out.append(f"{what}: {name} rows of {rows.x.shape[-1]} stored elements for "
                               f"{seg.features[which]} features")
                if seg.pages is None and rows.x.shape[-2] < seg.n:
                    out.append(f"{what}: {name} hold {rows.x.shape[-2]} rows, the segment {seg.n}")
            except ValueError as exc:
                out.append(f"{what}: {name}: {exc}")
            except RuntimeError as exc:
                out.append(f"{what}: the {name}' layout cannot be read by strides (its leading dims besides the heads "
                           f"do not merge into one, or do not broadcast to the queries' {lead}): "
                           f"{str(exc).splitlines()[0]}")
        for basis, size, name in ((seg.k_basis, d, "key"), (seg.v_basis, dv, "value")):
            if basis is not None and (basis.shape != (size, size) or not basis.dtype.is_floating_point):
                out.append(f"{what}: a {name} basis {tuple(basis.shape)} {basis.dtype}, not a float [{size}, {size}]")
        if seg.k_basis is not None and plan.rotation is not None:
            out.append(f"{what}: keys in a storage basis with rotation at read (the rotation applies to the keys, "
                       f"R to their stored form: exact only with R applied to every key block, which the read "
                       f"never does)")
        if seg.pages is not None:
            if seg.page < 1 or seg.pages.dim() != 1 or seg.pages.dtype.is_floating_point:
                out.append(f"{what}: a page table {tuple(seg.pages.shape)} {seg.pages.dtype} of pages of {seg.page}")
            elif seg.pages.shape[0] * seg.page < seg.n:
                out.append(f"{what}: a page table of {seg.pages.shape[0]} pages of {seg.page} rows for {seg.n} rows")
        if isinstance(seg.slots, Tensor) and (seg.slots.dim() != 2 or seg.slots.shape[-1] != seg.n
                                              or seg.slots.shape[0] not in (1, H)):
            out.append(f"{what}: a slot map {tuple(seg.slots.shape)}, not [H|1, n]")
    if len(dvs) > 1:
        out.append(f"segments with different value feature sizes {sorted(dvs)}")
    if plan.statistic is not None and not isinstance(plan.statistic, Statistic):
        out.append(f"a statistic of type {type(plan.statistic).__name__}")
    return out


def _rotation_check(plan: BlockPlan, D: int) -> None:
    """What :func:`_rotation` needs, from types and shapes only."""
    if not hasattr(plan.rotation, "key_units") or not hasattr(plan.rotation, "rotary"):
        raise ValueError(f"a {type(plan.rotation).__name__}, not a RotationPlan")
    rot = plan.rotation.rotary
    if rot is None:
        raise ValueError("the rotation's RopeAtRead is not bound to a device")
    if type(rot) not in (Rope1D, FrameRope):
        raise ValueError(f"the kernel rotates Rope1D and FrameRope keys, not {type(rot).__name__}")
    if D % 2 or rot.head_dim != D:
        raise ValueError(f"the rotary rotates {rot.head_dim} features, the keys have {D}")
    if rot.residues.dim() != 2 or rot.residues.shape[0] != 3 or rot.residues.shape[1] > D // 2:
        raise ValueError(f"limb residues {tuple(rot.residues.shape)} for {D // 2} feature pairs")


# ---------------------------------------------------------------------------------------- the read
def triton_read(qt: Tensor, plan: BlockPlan, config: KernelConfig | None = None) -> Blockwise:
    """Attention of ``qt`` over ``plan``'s segments in Triton: the semantics of
    :func:`~streamkv.blockread.read_blocks` (see the module docstring).

    Args:
        qt: queries in the attention layout ``[..., Q, D]`` (rotated already where the plan
            rotates keys; ``G`` times the key heads at the head axis for grouped-query
            attention), float16 / bfloat16 / float32 / float64, on CUDA (or the CPU under
            ``TRITON_INTERPRET=1``).
        plan: the read (:class:`~streamkv.blockread.BlockPlan`); ``plan.block`` is not used
            (the kernel's tiles are its own).
        config: tiles (:class:`KernelConfig`; default: chosen from the shapes).

    Returns:
        :class:`~streamkv.scoring.Blockwise`: ``out`` in ``qt``'s layout and dtype with the value
        features; ``lse`` ``[..., Q]`` (float32, float64 for float64 queries) when ``plan.lse``;
        ``key_max`` / ``key_sum`` float64 ``[H, S]`` as the plan's statistic declares.

    Raises:
        ValueError: the reason of :func:`why_not`, where the kernel cannot serve the plan.
    """
    reasons = _reasons(qt, plan)
    if reasons:
        raise ValueError("the Triton read cannot serve this plan: " + "; ".join(reasons))
    native = qt.device.type != "cpu"
    tiles = _tiles(qt, plan, config or KernelConfig(), native)
    if native:
        return _fitting(qt, plan, tiles)
    import numpy as np  # the interpreter runs the kernels in numpy: -inf and 0/0 are meant (hidden rows)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return _read(qt, plan, tiles, native=False)


def _tiles(qt: Tensor, plan: BlockPlan, config: KernelConfig, native: bool) -> KernelConfig:
    """``config`` with every tile chosen (``splits`` stays as given: 0 is chosen per segment). The
    interpreter: 16 x 16. Compiled: 16-bit queries on the tensor cores 128 (64 for short or wide
    reads) x 64; float32 / float64 products on the FMA units 64 x 32; decoding (at most 16 rows) 16."""
    H, ha = plan.dims.heads, plan.dims.head_axis
    G = 1 if ha is None else qt.shape[ha] // H
    GQ, D, wide = G * qt.shape[-2], qt.shape[-1], qt.dtype.itemsize
    if not native:
        bm = bn = sbm = sbn = 16
    else:
        bm = 16 if GQ <= 16 else 64 if GQ <= 64 or D > 128 or wide > 2 else 128
        bn = 64 if wide == 2 else 32
        sbm, sbn = 64, bn
    bm, bn = config.block_m or bm, config.block_n or bn
    return KernelConfig(block_m=bm, block_n=bn, splits=config.splits, stat_block_m=config.stat_block_m or sbm,
                        stat_block_n=config.stat_block_n or sbn, num_warps=config.num_warps or (8 if bm >= 128 else 4),
                        num_stages=config.num_stages or (2 if native else 1))


#: tiles that fit the device, by (device, query dtype, features, requested tiles): after a launch
#: refused for its shared memory (a smaller GPU), the tiles shrunk until it fits, remembered
_FITTING: dict[tuple, KernelConfig] = {}


def _shrink(t: KernelConfig) -> KernelConfig | None:
    """Smaller tiles (keys per step, then query rows per program, then one pipeline stage), or None."""
    if t.block_n > 16 or t.stat_block_n > 16:
        return replace(t, block_n=max(16, t.block_n // 2), stat_block_n=max(16, t.stat_block_n // 2))
    if t.block_m > 16 or t.stat_block_m > 16:
        bm = max(16, t.block_m // 2)
        return replace(t, block_m=bm, stat_block_m=max(16, t.stat_block_m // 2), num_warps=min(t.num_warps, 4))
    if t.num_stages > 1:
        return replace(t, num_stages=1)
    return None


def _fitting(qt: Tensor, plan: BlockPlan, tiles: KernelConfig) -> Blockwise:
    """:func:`_read` with tiles that fit the device: a launch refused for its resources (raised when
    the compiled kernel is first loaded, before anything runs: warm-up, never under capture) is
    retried with :func:`_shrink`'s tiles, and the tiles that fit are remembered."""
    from triton.runtime.errors import OutOfResources

    key = (qt.device, qt.dtype, qt.shape[-1], plan.segments[0].features[1], tiles)
    t = _FITTING.get(key, tiles)
    while True:
        try:
            out = _read(qt, plan, t, native=True)
        except OutOfResources:
            t = _shrink(t)
            if t is None:
                raise
            continue
        _FITTING[key] = t
        return out


def _read(qt: Tensor, plan: BlockPlan, config: KernelConfig, native: bool) -> Blockwise:
    """The launches with the tiles of ``config`` (:func:`_tiles`; ``native``: compiled kernels, else
    the interpreter)."""
    k = _kernels()
    dims = plan.dims
    H, ha = dims.heads, dims.head_axis
    Hq = 1 if ha is None else qt.shape[ha]
    G = Hq // H
    Q, D = qt.shape[-2], qt.shape[-1]
    Dv = plan.segments[0].features[1]
    dev, qdt = qt.device, qt.dtype
    acc = torch.float64 if qdt == torch.float64 else torch.float32
    lead = tuple(qt.shape[:-2])
    if ha is not None:
        lead = lead[:ha] + (H,) + lead[ha + 1:]
    qm = qt.unsqueeze(-3) if ha is None else qt.movedim(ha, -3)
    rest = tuple(qm.shape[:-3])
    q4 = qm.reshape(-1, Hq, Q, D)
    R = q4.shape[0]
    GQ = G * Q
    interp = not native
    rot = _rotation(plan, D, acc) if plan.rotation is not None else None
    half = D // 2 if rot is not None else (D + 1) // 2
    block_dh, block_dv = _pow2(half), _pow2(Dv)
    block_m, block_n, num_warps, num_stages = config.block_m, config.block_n, config.num_warps, config.num_stages
    m_blocks = _cdiv(GQ, block_m)
    segs = [s for s in plan.segments if s.n > 0]
    owned = [s for s in segs if s.slots is not None]
    order = owned + [s for s in segs if s.slots is None]  # the slots' parts first: their lse is a prefix
    splits = []
    for seg in order:
        if config.splits:
            sp = config.splits
        elif interp:
            sp = 1
        else:
            programs = m_blocks * R * H
            target = 2 * (_sms(dev) if dev.type == "cuda" else 132)
            sp = 1 if programs >= target else _cdiv(target, programs)
        sp = max(1, min(sp, _cdiv(seg.n, block_n)))
        per = _cdiv(_cdiv(seg.n, sp), block_n) * block_n  # keys per split: whole key blocks
        splits.append((_cdiv(seg.n, per), per))
    parts = sum(s for s, _ in splits)
    own_parts = sum(s for (s, _), seg in zip(splits, order) if seg.slots is not None)
    out4 = torch.empty((R, Hq, Q, Dv), dtype=qdt, device=dev)
    lse4 = torch.empty((R, Hq, Q), dtype=acc, device=dev)
    if parts == 1:
        ws_o, ws_l = out4, lse4
    else:
        ws_o = torch.empty((parts, R * H * GQ, Dv), dtype=acc, device=dev)
        ws_l = torch.empty((parts, R * H * GQ), dtype=acc, device=dev)
    scale = _split3(float(plan.scale))
    causal = bool(plan.causal)
    window = plan.window if causal and plan.window is not None else 0
    qpos = plan.query_positions if causal else q4
    by_basis: dict[int, Tensor] = {}

    def queries(basis: Tensor | None) -> Tensor:
        if basis is None:
            return q4
        if id(basis) not in by_basis:  # once per basis, rounded to the queries' dtype (as the reference)
            by_basis[id(basis)] = (q4.to(acc) @ basis.T.to(acc)).to(qdt)
        return by_basis[id(basis)]

    common = dict(D=D, HALF=half, BLOCK_DH=block_dh, ACC=_tl(acc), QT=_tl(qdt),
                  IEEE=qdt in (torch.float32, torch.float64), UP=interp and qdt == torch.bfloat16,
                  CAUSAL=causal, WINDOW=window > 0, LIMB=_LIMB)
    if rot is not None:
        common.update(ROTATE=True, INTERLEAVED=rot.interleaved, F_MOVE=rot.f_move, NPAIR=D // 2, NSTAT=rot.nstat,
                      TPU=rot.tpu)
    else:
        common.update(ROTATE=False, INTERLEAVED=False, F_MOVE=0, NPAIR=0, NSTAT=0, TPU=1)
    prepared = []
    part = 0
    for seg, (sp, per) in zip(order, splits):
        kr, vr = _rows(seg, 0, lead, ha), _rows(seg, 1, lead, ha)
        pos = seg.positions.expand(H, seg.n)
        units = res = hwc = hws = q4
        float_units = False
        if rot is not None:
            units = plan.rotation.key_units(pos).expand(H, seg.n)  # [1, n] where the heads hold the same
            float_units = units.dtype.is_floating_point
            units = units.to(torch.float64 if float_units else torch.int64)
            res = rot.residues
            if rot.hw_cos is not None:
                hwc, hws = rot.hw_cos, rot.hw_sin
        qs = queries(seg.k_basis)
        key_args = (kr.x, *kr.x.stride(), kr.scale if kr.scale is not None else kr.x,
                    *(kr.scale.stride() if kr.scale is not None else (0, 0, 0, 0)))
        tail = (pos, *pos.stride(), seg.pages if seg.pages is not None else pos, qpos, units,
                *(units.stride() if units.dim() == 2 else (0, 0)), res, hwc, hws)
        kc = dict(K_CODEC=kr.kind, K_BITS=kr.bits or 8, K_GROUP=kr.group, PAGE=seg.page if seg.pages is not None else 0,
                  FLOAT_UNITS=float_units, KDT=_tl(kr.dtype))
        prepared.append((seg, qs, key_args, tail, kc))
        vb = seg.v_basis.to(acc).contiguous() if seg.v_basis is not None else q4
        k.attn_kernel[(m_blocks, R * H, sp)](
            qs, *qs.stride(), *key_args,
            vr.x, *vr.x.stride(), vr.scale if vr.scale is not None else vr.x,
            *(vr.scale.stride() if vr.scale is not None else (0, 0, 0, 0)),
            *tail, vb, ws_o, ws_l, part,
            seg.n, Q, G, H, window, per, *scale,
            DV=Dv, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DV=block_dv,
            V_CODEC=vr.kind, V_BITS=vr.bits or 8, V_GROUP=vr.group, V_BASIS=seg.v_basis is not None,
            VDT=_tl(vr.dtype), **kc, **common, num_warps=num_warps, num_stages=num_stages)
        part += sp
    stat = plan.statistic
    need_own = stat is not None and 0 < own_parts < parts
    lse_own = torch.empty((R * H * GQ,), dtype=acc, device=dev) if need_own else lse4
    if parts > 1:
        mb = 16 if interp else 64
        k.merge_kernel[(_cdiv(R * H * GQ, mb),)](
            ws_o, ws_l, parts, own_parts, out4, lse4, lse_own, R * H * GQ,
            DV=Dv, BLOCK_M=mb, BLOCK_DV=block_dv, OWN=need_own, ACC=_tl(acc), num_warps=4)
    kmax = ksum = None
    if stat is not None:
        S = plan.slots
        kmax = torch.zeros((H, S + 1), dtype=torch.float64, device=dev) if "max" in stat.reduce else None
        ksum = torch.zeros((H, S + 1), dtype=torch.float64, device=dev) if "sum" in stat.reduce else None
        rows_sel = Q if stat.rows is None else min(stat.rows, Q)
        sbm, sbn = config.stat_block_m, config.stat_block_n
        for seg, qs, key_args, tail, kc in prepared:
            if seg.slots is None:
                continue
            smax = torch.empty((H, seg.n), dtype=torch.float64, device=dev) if kmax is not None else lse4
            ssum = torch.empty((H, seg.n), dtype=torch.float64, device=dev) if ksum is not None else lse4
            k.stat_kernel[(_cdiv(seg.n, sbn), H)](
                qs, *qs.stride(), *key_args, *tail, lse_own, smax, ssum,
                seg.n, Q, G, H, R, rows_sel, window, *scale,
                BLOCK_M=sbm, BLOCK_N=sbn, DO_MAX=kmax is not None, DO_SUM=ksum is not None,
                **kc, **common, num_warps=4, num_stages=num_stages)
            dest = seg.slot_index()
            dest = torch.where(dest >= 0, dest, S).expand(H, seg.n)
            if kmax is not None:
                kmax.scatter_reduce_(-1, dest, smax, reduce="amax")
            if ksum is not None:
                ksum.scatter_add_(-1, dest, ssum)
        counted = lse_own.view(R, H, G, Q)[..., Q - rows_sel:].reshape(R, H, G * rows_sel)
        poisoned = stat.poisoned(counted, H, 1)
        newest = newest_slots(plan)
        kmax, ksum = stat.finish(kmax, S, poisoned, newest), stat.finish(ksum, S, poisoned, newest)
    out = out4.view(*rest, Hq, Q, Dv)
    out = out.squeeze(-3) if ha is None else out.movedim(-3, ha)
    lse = None
    if plan.lse:
        lse = lse4.view(*rest, Hq, Q)
        lse = lse.squeeze(-2) if ha is None else lse.movedim(-2, ha)
    return Blockwise(out, lse, kmax, ksum)
