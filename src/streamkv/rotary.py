"""Rotary embeddings evaluated at read time: what a position map's output is turned into.

A :class:`Rotary` rotates feature pairs of queries and keys by ``angle = position x freq``.
Two are built in:

- :class:`Rope1D`: the LLM RoPE over the token axis, in transformers' layout (``"half"``: the
  pair ``(x[i], x[i + D/2])``, ``rotate_half``) or Wan's (``"interleaved"``: ``(x[2i], x[2i+1])``);
  the unit of a position map is the token.
- :class:`FrameRope`: Wan 2.1's 3D RoPE (:class:`~streamkv.rope.Rope3D`'s bands) with the
  **frame axis only** re-indexed: the unit of a position map is the latent frame
  (``p // tokens_per_frame``); the height and width bands keep the token's row and column.

Angles are computed relative to an origin (the open span's first query, see
:mod:`streamkv.rope_at_read`): RoPE attention depends only on differences, so subtracting one
integer from every position changes no output, and it keeps the angles of nearby keys small.
Integer offsets ``d`` are split into 18-bit limbs, ``d = a 2^36 + b 2^18 + c``, and the angle is
``c f + b r1 + a r2`` with ``r_k = (2^(18k) f) mod 2 pi`` precomputed from the exact value of
the float64 frequency ``f`` (Python fractions, 2 pi to 60 digits). Stated error: for
``|d| < 2^18`` the angle is the float64 product ``d f`` (the naive formula, to 0.5 ulp); for
any ``|d| < 2^53`` it is within :data:`ANGLE_ERROR` (2e-9 rad) of ``d f mod 2 pi`` -- where the
naive float64 product ``d f`` is off by up to ``|d f| 2^-53`` (1.2e-4 rad at ``2^40``). Tested
against exact rational arithmetic in ``tests/test_positions.py``. Float offsets (a map that
returns fractional positions, and every map held beside one in a
:class:`~streamkv.rope_at_read.RopeAtRead`: its maps are selected on the device in one dtype)
use the plain float64 product.

Nothing here synchronises with the device or reads a host value from a tensor: every method is
traceable (``torch.compile``) and capturable (CUDA graphs).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Literal

import torch
from torch import Tensor

from .compiled import compile_kernel, may_compile

__all__ = ["ANGLE_ERROR", "FrameRope", "Rope1D", "Rotary", "exact_angles", "limb_residues", "narrowed"]

#: bound (radians) on the error of :func:`exact_angles` for integer offsets ``|d| < 2**53``
ANGLE_ERROR = 2e-9
_LIMB = 18
_PI = Fraction("3.141592653589793238462643383279502884197169399375105820974944592")


def limb_residues(freqs: Tensor) -> Tensor:
    """``float64 [3, F]``: ``(2^(18 k) f) mod 2 pi`` for ``k = 0, 1, 2`` and each float64
    frequency ``f`` (exact rational arithmetic on the host, once)."""
    two_pi = 2 * _PI
    rows = []
    for k in range(3):
        scale = 1 << (_LIMB * k)
        row = []
        for f in freqs.to(torch.float64).tolist():
            x = Fraction(f) * scale
            row.append(float(x - two_pi * math.floor(x / two_pi)) if k else f)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


def exact_angles(delta: Tensor, freqs: Tensor, residues: Tensor) -> Tensor:
    """Angles ``float64 [..., F]`` of offsets ``delta [...]`` (see the module docstring).

    ``delta`` int64: limbs (error :data:`ANGLE_ERROR`); floating: ``delta * freqs`` in float64.
    ``freqs`` float64 ``[F]`` and ``residues`` (:func:`limb_residues`) on ``delta``'s device."""
    if delta.dtype.is_floating_point:
        return delta.to(torch.float64).unsqueeze(-1) * freqs
    mag = delta.abs()
    mask = (1 << _LIMB) - 1
    c = (mag & mask).to(torch.float64).unsqueeze(-1)
    b = ((mag >> _LIMB) & mask).to(torch.float64).unsqueeze(-1)
    a = (mag >> (2 * _LIMB)).to(torch.float64).unsqueeze(-1)
    ang = c * residues[0] + b * residues[1] + a * residues[2]
    return torch.where(delta.unsqueeze(-1) < 0, -ang, ang)


_TWO_PI = float(2 * _PI)


def narrowed(ang: Tensor, dtype: torch.dtype) -> Tensor:
    """Float64 angles taken in ``dtype`` for its tables: reduced to ``[0, 2 pi)`` first where
    ``dtype`` is narrower (a float32 angle of ``1e6`` rad is off by up to half its ulp, 0.03 rad;
    the reduced one by float32 rounding only, the float64 reduction adding about ``|ang| 2^-52``,
    below 1e-9 rad for every limb sum); float64 angles as they are (their cos/sin reduce exactly)."""
    if dtype == torch.float64:
        return ang
    return (ang - _TWO_PI * torch.floor(ang / _TWO_PI)).to(dtype)


#: elements per block from which a CPU rotation runs compiled (smaller ones: eager ops)
COMPILE_MIN = 1 << 18
_ROTATE: dict[str, object] = {}


def _compiled_rotate(style: str):
    """``rotate(x.to(cos.dtype), cos, sin).to(x.dtype)`` compiled once per pair style (dynamic
    shapes), or None where torch cannot compile here."""
    if style not in _ROTATE:
        def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
            xf = x.to(cos.dtype)
            if style == "interleaved":
                x2 = xf.unflatten(-1, (-1, 2))
                a, b = x2[..., 0], x2[..., 1]
                return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x.dtype)
            a, b = xf.chunk(2, dim=-1)
            return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1).to(x.dtype)
        _ROTATE[style] = compile_kernel(rotate, f"rotate_{style}")
    return _ROTATE[style]


_COS_SIN: dict[torch.dtype, object] = {}


def _compiled_cos_sin(dtype: torch.dtype):
    """``cos``/``sin`` in ``dtype`` of :func:`exact_angles` compiled once per dtype (one pass over
    the offsets: the limbs, the float64 angles and both tables), or None where torch cannot
    compile here."""
    if dtype not in _COS_SIN:
        def cos_sin(delta: Tensor, freqs: Tensor, residues: Tensor) -> tuple[Tensor, Tensor]:
            ang = narrowed(exact_angles(delta, freqs, residues), dtype)
            return ang.cos(), ang.sin()
        _COS_SIN[dtype] = compile_kernel(cos_sin, f"cos_sin_{str(dtype).removeprefix('torch.')}")
    return _COS_SIN[dtype]


class Rotary:
    """What :class:`~streamkv.rope_at_read.RopeAtRead` needs of a rotary embedding.

    ``tokens_per_unit``: stream positions per position-map unit (1 for tokens; a frame's
    tokens for :class:`FrameRope`). ``angles(delta, positions)``: ``float64 [..., D/2]`` for
    rotation offsets ``delta`` (units, from the map, relative to the origin) of the tokens at
    stream ``positions`` (same shape). ``rotate(x, cos, sin)``: ``x [..., D]`` by tables
    broadcastable to ``[..., D/2]``."""

    head_dim: int
    tokens_per_unit: int = 1
    style: Literal["half", "interleaved"] = "half"

    def angles(self, delta: Tensor, positions: Tensor) -> Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def cos_sin(self, delta: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``cos``/``sin`` ``[..., D/2]`` in ``dtype`` of :meth:`angles` (angles computed in
        float64, then taken in ``dtype`` (:func:`narrowed`: reduced mod ``2 pi`` first): float64
        tables for float64 reads, float32 ones for float32 / bf16 / fp16 reads, whose keys are
        rounded far more coarsely)."""
        ang = narrowed(self.angles(delta, positions), dtype)
        return ang.cos(), ang.sin()

    def to(self, device: torch.device) -> Rotary:  # pragma: no cover - interface
        raise NotImplementedError

    def config(self) -> dict:
        """What identifies this rotation (host values: class, sizes, layout and the exact float64
        frequencies), recorded in the state dicts of caches that rotate at read."""
        return {"class": type(self).__name__, "head_dim": self.head_dim, "style": self.style,
                "tokens_per_unit": self.tokens_per_unit, **self._config()}

    def _config(self) -> dict:
        return {}

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``x`` rotated pairwise (a new tensor, in the dtype of ``x``). Interleaved pairs of a
        float32/float64 ``x`` are one complex multiplication (a single pass)."""
        if self.style == "interleaved":
            if x.dtype in (torch.float32, torch.float64) and cos.dtype == x.dtype and x.shape[-1] % 2 == 0:
                z = torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous())
                return torch.view_as_real(z * torch.complex(cos, sin)).flatten(-2)
            x2 = x.unflatten(-1, (-1, 2))
            a, b = x2[..., 0], x2[..., 1]
            return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        a, b = x.chunk(2, dim=-1)
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)

    def rotate_as(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``x`` rotated by float tables (computed in their dtype), returned in ``x``'s dtype. On the
        CPU, blocks of at least :data:`COMPILE_MIN` elements go through one compiled kernel (a
        single pass where the eager ops make six or more); the arithmetic is the same. Under a Python
        dispatch mode (an op counter, a debug mode), where a compiled kernel cannot run, the eager ops do."""
        if x.dtype != cos.dtype and may_compile(x, x.numel(), COMPILE_MIN):
            fn = _compiled_rotate(self.style)
            if fn is not None:
                return fn(x, cos, sin)
        return self.rotate(x.to(cos.dtype), cos, sin).to(x.dtype)

    def units(self, positions: Tensor) -> Tensor:
        """Stream positions -> map units (``-1`` stays ``-1``: an empty slot)."""
        if self.tokens_per_unit == 1:
            return positions
        return torch.where(positions >= 0, positions // self.tokens_per_unit, positions)


def _check_dim(head_dim: object, minimum: int) -> int:
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise TypeError(f"head_dim must be an int, got {type(head_dim).__name__} {head_dim!r}")
    if head_dim < minimum or head_dim % 2:
        raise ValueError(f"head_dim must be even and >= {minimum}, got {head_dim}")
    return head_dim


class Rope1D(Rotary):
    """The token-axis RoPE of LLMs.

    Args:
        head_dim: channels per head (even).
        theta: the base (``inv_freq = theta ** (-2i / head_dim)``), ignored when ``inv_freq``
            is given.
        inv_freq: the model's own frequencies ``[head_dim / 2]`` (transformers keeps them on
            ``model.model.rotary_emb.inv_freq``, float32): used as float64 exactly.
        style: ``"half"`` (transformers' ``rotate_half``) or ``"interleaved"``.
    """

    def __init__(self, head_dim: int, *, theta: float = 10000.0, inv_freq: Tensor | None = None,
                 style: Literal["half", "interleaved"] = "half") -> None:
        self.head_dim = _check_dim(head_dim, 2)
        if style not in ("half", "interleaved"):
            raise ValueError(f"style must be 'half' or 'interleaved', got {style!r}")
        self.style = style
        if inv_freq is None:
            if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 1:
                raise ValueError(f"theta must be a finite number > 1 (the RoPE base), got {theta!r}")
            inv_freq = float(theta) ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        if not isinstance(inv_freq, Tensor) or tuple(inv_freq.shape) != (head_dim // 2,):
            raise ValueError(f"inv_freq must be a tensor [head_dim / 2 = {head_dim // 2}], got "
                             f"{tuple(inv_freq.shape) if isinstance(inv_freq, Tensor) else type(inv_freq).__name__}")
        self.freqs = inv_freq.detach().to("cpu", torch.float64)
        if not bool(torch.isfinite(self.freqs).all()) or bool((self.freqs < 0).any()):
            raise ValueError("inv_freq must be finite and >= 0")
        self.residues = limb_residues(self.freqs)

    def to(self, device: torch.device) -> Rope1D:
        out = object.__new__(Rope1D)
        out.head_dim, out.style, out.tokens_per_unit = self.head_dim, self.style, 1
        out.freqs, out.residues = self.freqs.to(device), self.residues.to(device)
        return out

    def angles(self, delta: Tensor, positions: Tensor) -> Tensor:
        return exact_angles(delta, self.freqs, self.residues)

    def cos_sin(self, delta: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """As :meth:`Rotary.cos_sin`; on the CPU, integer offsets of at least :data:`COMPILE_MIN`
        table entries go through one compiled kernel (the same arithmetic in one pass, where the
        eager ops make a dozen over float64 tables)."""
        if not delta.dtype.is_floating_point and may_compile(delta, delta.numel() * self.freqs.numel(), COMPILE_MIN):
            fn = _compiled_cos_sin(dtype)
            if fn is not None:
                return fn(delta, self.freqs, self.residues)
        return super().cos_sin(delta, positions, dtype)

    def _config(self) -> dict:
        return {"freqs": tuple(self.freqs.tolist())}

    def __repr__(self) -> str:
        return f"Rope1D(head_dim={self.head_dim}, style={self.style!r})"


def _wan_recipe(rope: object) -> str:
    """For diffusers' ``WanRotaryPosEmbed``: how to build the streamkv Rope3D of the same RoPE
    (the same band split and frequencies; its grid is the transformer input's, which the module
    does not keep, and its theta is checked against its own tables). Empty for anything else."""
    names = ("attention_head_dim", "patch_size", "max_seq_len", "t_dim", "h_dim", "w_dim", "freqs_cos")
    if not all(hasattr(rope, n) for n in names):
        return ""
    d, (_, p_h, p_w), frames = rope.attention_head_dim, rope.patch_size, rope.max_seq_len
    band_hw = 2 * (d // 6)  # Rope3D's split: time d - 2 band_hw, height and width band_hw each
    if (rope.t_dim, rope.h_dim, rope.w_dim) != (d - 2 * band_hw, band_hw, band_hw):
        return f"; its bands {(rope.t_dim, rope.h_dim, rope.w_dim)} are not Wan's split, which Rope3D has"
    # theta: diffusers' default unless its own tables say otherwise (float32 tables: one ulp at 1)
    t = torch.arange(frames, dtype=torch.float64).unsqueeze(-1)
    want = torch.cat([(t * 10000.0 ** (-torch.arange(0, b, 2, dtype=torch.float64) / b)).cos() for b in
                      (rope.t_dim, rope.h_dim, rope.w_dim)], dim=-1)
    got = rope.freqs_cos.detach().to("cpu", torch.float64)[:, ::2]
    theta = "10000.0" if got.shape == want.shape and bool(((got - want).abs() <= 2.0**-24).all()) else \
        "<the theta it was built with>"
    return (f". diffusers' WanRotaryPosEmbed is the same 3D RoPE as streamkv's Rope3D (bands {rope.t_dim}/"
            f"{rope.h_dim}/{rope.w_dim}, frequencies theta ** (-2i / band)); build it for the transformer input's "
            f"latent size (latent_height x latent_width; one token per {p_h} x {p_w} patch) as "
            f"`FrameRope(Rope3D({d}, latent_height // {p_h}, latent_width // {p_w}, max_frames={frames}, "
            f"theta={theta}))` (from streamkv.rope import Rope3D)")


class FrameRope(Rotary):
    """Wan 2.1's 3D RoPE with the frame axis given by a position map (height and width bands
    from the token's own row and column): :class:`~streamkv.rope.Rope3D`'s band split,
    frequencies and interleaved pairs, so that ``absolute`` reproduces ``Rope3D`` exactly.

    Args:
        rope: the model's :class:`~streamkv.rope.Rope3D` (``CausalVideoDiT.rope``).
    """

    style = "interleaved"

    def __init__(self, rope) -> None:  # a Rope3D (duck-typed: rotary sits below rope in the layers)
        for name in ("head_dim", "grid_h", "grid_w", "tokens_per_frame", "bands", "_freqs"):
            if not hasattr(rope, name):
                raise TypeError(f"rope must be a streamkv Rope3D, got {type(rope).__name__} (no {name!r})"
                                + _wan_recipe(rope))
        self.head_dim = rope.head_dim
        self.grid_w = rope.grid_w
        self.tokens_per_unit = rope.tokens_per_frame
        self.bands = rope.bands
        self.time_freqs = rope._freqs[0].to(torch.float64)
        self.hw_freqs = [f.to(torch.float64) for f in rope._freqs[1:]]
        self.residues = limb_residues(self.time_freqs)

    def to(self, device: torch.device) -> FrameRope:
        out = object.__new__(FrameRope)
        out.head_dim, out.grid_w, out.tokens_per_unit, out.bands = self.head_dim, self.grid_w, self.tokens_per_unit, self.bands
        out.time_freqs, out.residues = self.time_freqs.to(device), self.residues.to(device)
        out.hw_freqs = [f.to(device) for f in self.hw_freqs]
        return out

    def angles(self, delta: Tensor, positions: Tensor) -> Tensor:
        within = positions.clamp_min(0) % self.tokens_per_unit
        row, col = within // self.grid_w, within % self.grid_w
        return torch.cat([exact_angles(delta, self.time_freqs, self.residues),
                          row.to(torch.float64).unsqueeze(-1) * self.hw_freqs[0],
                          col.to(torch.float64).unsqueeze(-1) * self.hw_freqs[1]], dim=-1)

    def _config(self) -> dict:
        return {"bands": tuple(self.bands), "grid_w": self.grid_w, "time_freqs": tuple(self.time_freqs.tolist()),
                "hw_freqs": tuple(tuple(f.tolist()) for f in self.hw_freqs)}

    def cos_sin(self, delta: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """As :meth:`Rotary.cos_sin`; the height/width bands (fixed per token of a frame) come
        from per-frame tables built once per dtype, only the frame band is computed."""
        tables = self._hw_tables.get(dtype) if hasattr(self, "_hw_tables") else None
        if tables is None:
            within = torch.arange(self.tokens_per_unit, device=self.time_freqs.device)
            row, col = within // self.grid_w, within % self.grid_w
            hw = torch.cat([row.to(torch.float64).unsqueeze(-1) * self.hw_freqs[0],
                            col.to(torch.float64).unsqueeze(-1) * self.hw_freqs[1]], dim=-1)
            hw = narrowed(hw, dtype)
            tables = (hw.cos(), hw.sin())
            if not hasattr(self, "_hw_tables"):
                self._hw_tables = {}
            self._hw_tables[dtype] = tables
        t = narrowed(exact_angles(delta, self.time_freqs, self.residues), dtype)
        idx = positions.clamp_min(0) % self.tokens_per_unit
        hc, hs = (tab[idx] for tab in tables)
        return torch.cat([t.cos(), hc], dim=-1), torch.cat([t.sin(), hs], dim=-1)

    def __repr__(self) -> str:
        return f"FrameRope(head_dim={self.head_dim}, tokens_per_frame={self.tokens_per_unit})"
