"""Storage formats as codec classes, declared once: :data:`KV_FORMATS`.

A codec turns a token's features into stored bytes and back, per *group* of ``group``
consecutive channels of one token of one head (one scale a group, stored as bfloat16 rounded
*up* so that no code saturates):

``IntCodec(bits)`` (``int8``, ``int4``, ``int2``)
    symmetric mid-rise, ``M = 2^b - 1``: scale ``s = absmax / (M / 2)``, code
    ``c = clamp(floor(x / s + (M + 1) / 2), 0, M)``, value ``(2 c - M) * (s / 2)`` (every level
    used, no zero point); ``8 / bits`` codes a byte, low bits first. ``|x - x_hat| <= s / 2`` up
    to the float32 rounding of ``x / s`` (covered: the bound used is ``s * (1/2 + 2^-12)``).
    A width that does not divide a byte (3, 5, 6, 7 bits) is refused: it has no packing.
``Fp8Codec`` (``fp8``)
    e4m3 (``torch.float8_e4m3fn``) of ``x / s`` with ``s = absmax / 448``; value ``code * s``.
    ``|x - x_hat| <= s * max(2^-4 |code|, 2^-10)`` (half an ulp of three mantissa bits, or of
    the subnormal spacing 2^-9), plus the float32 rounding of ``x / s`` before it (two roundings:
    a quotient just above an e4m3 midpoint may land on it, then round the other way):
    ``+ 2^-22 (|x_hat| + b) + 2^-148``.
``BF16Codec`` (``bf16``)
    the bfloat16 of ``x``, no scale; ``|x - x_hat| <= max(2^-8 |x_hat|, 2^-134)``, plus the same
    term for a float64 ``x`` rounded to float32 first.

Every scale is at least ``absmax / k`` exactly (the float32 quotient is moved up where it rounded
down, an underflow included), so no group of tiny values gets a scale or a bound of 0.

Decoded values are float32 and *exact* there (a code of at most 9 significant bits times a
bfloat16 scale needs at most 17), so "the stored value" of a token is one float32 number per
channel wherever it is read. Adding a format is one class (or one instance of an existing
class) and one line in :data:`KV_FORMATS`; every test, command and docs table iterates it.

:class:`KVQuant` is the storage option a cache takes (``quant="int4"`` or ``KVQuant(...)``):
the key and value formats, the group size, the basis the codes live in and what stays in full
precision. ``basis="hadamard"`` stores ``R x`` (``R`` a fixed random-sign Hadamard matrix,
orthogonal, the same for every cache of a head dim; QuaRot, arXiv 2404.00456): it spreads a
channel outlier over the token; the read applies ``R`` to the queries and ``R^T`` to the
output once, never to key blocks (dot products are invariant under ``R``).

Why one module (and this long): the formats, their error bounds and byte counts are the
storage's definition, and the compiled CPU kernels that decode them belong with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from ..compiled import compile_kernel, may_compile

__all__ = ["Codec", "IntCodec", "Fp8Codec", "BF16Codec", "KV_FORMATS", "KVQuant", "as_quant", "hadamard",
           "codec_of"]

Basis = Literal["identity", "hadamard"]


_F32_MAX, _BF16_MAX = torch.finfo(torch.float32).max, torch.finfo(torch.bfloat16).max


def _round_up_bf16(s: Tensor) -> Tensor:
    """``s`` (float32, >= 0) rounded up to the next bfloat16 (returned as bfloat16)."""
    bits = s.contiguous().view(torch.int32)
    up = (bits + 0xFFFF) & ~0xFFFF
    return torch.where(torch.isfinite(s), up.view(torch.float32), s).to(torch.bfloat16)


def _scale(absmax: Tensor, k: float) -> Tensor:
    """The bfloat16 scale ``s >= absmax / k`` of a group (``absmax`` float32, >= 0): the float32
    quotient, moved up one ulp where it rounded below the exact quotient (an underflow to 0 or to a
    subnormal included: a tiny group would otherwise get ``s = 0`` and a bound of 0), then rounded up
    to bfloat16."""
    s = absmax / k
    low = s.double() * k < absmax.double()  # exact in float64
    return _round_up_bf16(torch.where(low, torch.nextafter(s, torch.full_like(s, math.inf)), s))


def _with_input_rounding(bound: Tensor, decoded: Tensor) -> Tensor:
    """``bound`` (float32, on ``|y - x_hat|`` for the float32 ``y`` the format rounded) widened to
    bound ``|x - x_hat|`` for the value ``x`` before a first rounding to float32 (a float64 cache's
    ``x.float()``, or fp8's ``x / s``): ``|x - y| <= 2^-24 |y| + 2^-150`` and ``|y| <= |x_hat| +
    bound``. Twice the relative term, so that the float32 arithmetic of the widening (three roundings
    of ``2^-24`` relative) cannot bring it below; the absolute term covers float32 subnormals."""
    return bound + (decoded.abs() + bound) * 2.0**-22 + 2.0**-148


def _groups(x: Tensor, group: int) -> Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group)


class Codec:
    """One storage format: ``bits`` per element, a bfloat16 scale per group when ``scaled``.
    Subclasses define :meth:`encode`, :meth:`decode` and :meth:`error_bound`."""

    #: stored bits per element
    bits: int
    #: a bfloat16 scale per group is stored beside the codes
    scaled: ClassVar[bool] = True
    #: a scaled codec's largest code magnitude: its scale is ``absmax / top``
    top: float = 1.0
    name: str
    description: str

    def largest(self) -> float:
        """The largest magnitude this format stores as a finite value (its bfloat16 scale finite
        after the rounding up, its decoded float32 value finite), with a margin of ``2^-6`` for
        the roundings on the way: a commit holding more is refused, not stored as inf or NaN."""
        return min(_F32_MAX, _BF16_MAX * (self.top if self.scaled else 1.0)) * (1 - 2**-6)

    def code_width(self, dim: int) -> int:
        """Bytes of codes per ``dim`` channels."""
        return dim * self.bits // 8

    def check_dim(self, dim: int, group: int) -> None:
        """Raise ``ValueError`` unless ``group`` divides ``dim`` and the codes fill whole bytes."""
        if dim % group:
            raise ValueError(f"{self.name}: group ({group}) must divide the feature size ({dim})")
        if (dim * self.bits) % 8:
            raise ValueError(f"{self.name}: {dim} channels of {self.bits} bits do not fill whole bytes")

    def bytes_per_token(self, dim: int, group: int) -> int:
        """Bytes per token and head: codes plus scales."""
        return self.code_width(dim) + (2 * (dim // group) if self.scaled else 0)

    def encode(self, x: Tensor, group: int) -> tuple[Tensor, Tensor | None]:
        """``x [..., D]`` (any float) -> ``(codes uint8 [..., W], scale bfloat16 [..., D / group] or None)``."""
        raise NotImplementedError

    def decode(self, codes: Tensor, scale: Tensor | None, dim: int, group: int) -> Tensor:
        """Float32 ``[..., D]`` values of ``codes`` / ``scale`` (exact in float32)."""
        raise NotImplementedError

    def error_bound(self, codes: Tensor, scale: Tensor | None, dim: int, group: int,
                    decoded: Tensor | None = None) -> Tensor:
        """Float32 ``[..., D]``: a bound on ``|x - x_hat|`` per element, from what is stored."""
        raise NotImplementedError

    def decode_as(self, codes: Tensor, scale: Tensor | None, dim: int, group: int, dtype: torch.dtype,
                  drop: Tensor | None = None) -> Tensor:
        """:meth:`decode` taken in ``dtype`` (the float32 values rounded once); ``drop`` (bool,
        broadcast against the values, e.g. ``[..., rows, 1]``): rows given as zeros instead (a
        stale row no read may see; ``where``, so a non-finite scale weighs nothing). On the CPU,
        blocks of at least :data:`COMPILE_MIN` codes go through one compiled kernel
        (``torch.compile``: a single pass reads the codes and scales and writes ``dtype``, where
        the eager ops make four or more passes); the values are the same, the kernel only fuses
        the passes. Under a Python dispatch mode (an op counter, a debug mode), where a compiled
        kernel cannot run, the eager ops do."""
        if may_compile(codes, codes.numel(), COMPILE_MIN):
            fn = _compiled(self, dim, group, dtype, drop is not None)
            if fn is not None:
                return fn(codes, scale) if drop is None else fn(codes, scale, drop)
        return _decoded(self, codes, scale, dim, group, dtype, drop)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class IntCodec(Codec):
    """Symmetric mid-rise integers of ``bits`` bits (see the module docstring)."""

    def __init__(self, bits: int) -> None:
        if isinstance(bits, bool) or not isinstance(bits, int) or bits < 1 or 8 % bits:
            raise ValueError(f"IntCodec packs 1, 2, 4 or 8 bits per code (a whole number of codes per byte), "
                             f"got {bits!r}")
        self.bits, self.name, self.top = bits, f"int{bits}", (2**bits - 1) / 2
        self.description = (f"symmetric mid-rise, {2 ** bits} levels, "
                            f"{'one code' if bits == 8 else f'{8 // bits} codes'} a byte, a bfloat16 scale per group")

    def encode(self, x: Tensor, group: int) -> tuple[Tensor, Tensor | None]:
        x = x.float()
        xg = _groups(x, group)
        M = 2**self.bits - 1
        scale = _scale(xg.abs().amax(-1), M / 2)
        s = scale.float().unsqueeze(-1)
        y = torch.where(s > 0, xg / torch.where(s > 0, s, 1.0), 0.0)
        c = torch.floor(y + (M + 1) / 2).clamp_(0, M).to(torch.uint8).reshape(x.shape)
        return self.pack(c), scale

    def decode(self, codes: Tensor, scale: Tensor | None, dim: int, group: int) -> Tensor:
        M = 2**self.bits - 1
        c = self.unpack(codes, dim).float()
        # (c - M / 2) is a half-integer of at most 9 bits: its product with a bfloat16 is exact
        lev = _groups(c.sub_(M / 2), group)
        return lev.mul_(scale.float().unsqueeze(-1)).reshape(*c.shape[:-1], dim)

    def error_bound(self, codes: Tensor, scale: Tensor | None, dim: int, group: int,
                    decoded: Tensor | None = None) -> Tensor:
        s = scale.float().unsqueeze(-1)
        lead = codes.shape[:-1]
        return (s * (0.5 + 2.0**-12)).expand(*lead, dim // group, group).reshape(*lead, dim)

    def pack(self, c: Tensor) -> Tensor:
        """uint8 codes ``[..., D]`` -> ``[..., D * bits / 8]`` bytes (low bits first)."""
        if self.bits == 8:
            return c
        per = 8 // self.bits
        c = c.reshape(*c.shape[:-1], -1, per)
        out = c[..., 0].clone()
        for i in range(1, per):
            out |= c[..., i] << (self.bits * i)
        return out

    def unpack(self, b: Tensor, dim: int) -> Tensor:
        if self.bits == 8:
            return b
        per, mask = 8 // self.bits, (1 << self.bits) - 1
        parts = [(b >> (self.bits * i)) & mask for i in range(per)]
        return torch.stack(parts, dim=-1).reshape(*b.shape[:-1], dim)


class Fp8Codec(Codec):
    """e4m3 of ``x / s`` (see the module docstring)."""

    bits, name, top = 8, "fp8", 448.0
    description = "e4m3 of x / s, a bfloat16 scale per group (s = absmax / 448)"

    def encode(self, x: Tensor, group: int) -> tuple[Tensor, Tensor | None]:
        x = x.float()
        xg = _groups(x, group)
        scale = _scale(xg.abs().amax(-1), 448.0)
        s = scale.float().unsqueeze(-1)
        y = torch.where(s > 0, xg / torch.where(s > 0, s, 1.0), 0.0)
        return y.to(torch.float8_e4m3fn).view(torch.uint8).reshape(x.shape), scale

    def decode(self, codes: Tensor, scale: Tensor | None, dim: int, group: int) -> Tensor:
        y = codes.contiguous().view(torch.float8_e4m3fn).float()
        return (_groups(y, group) * scale.float().unsqueeze(-1)).reshape(*y.shape[:-1], dim)

    def error_bound(self, codes: Tensor, scale: Tensor | None, dim: int, group: int,
                    decoded: Tensor | None = None) -> Tensor:
        y = _groups(codes.contiguous().view(torch.float8_e4m3fn).float(), group)
        s = scale.float().unsqueeze(-1)
        # half an e4m3 ulp of the code, then the float32 rounding of x / s before it (and of a float64 x)
        b = _with_input_rounding(torch.clamp(y.abs() * 2.0**-4, min=2.0**-10) * s, y * s)
        return b.reshape(*codes.shape[:-1], dim)


class BF16Codec(Codec):
    """The bfloat16 of each element, no scale."""

    bits, name, scaled = 16, "bf16", False
    description = "bfloat16 of each element, no scale"

    def encode(self, x: Tensor, group: int) -> tuple[Tensor, Tensor | None]:
        return x.float().to(torch.bfloat16).view(torch.uint8), None

    def decode(self, codes: Tensor, scale: Tensor | None, dim: int, group: int) -> Tensor:
        return codes.contiguous().view(torch.bfloat16).float()

    def decode_as(self, codes: Tensor, scale: Tensor | None, dim: int, group: int, dtype: torch.dtype,
                  drop: Tensor | None = None) -> Tensor:
        """In bfloat16 the codes are the values: a view of them (no pass), ``drop`` applied by ``where``."""
        if dtype != torch.bfloat16:
            return super().decode_as(codes, scale, dim, group, dtype, drop)
        aligned = codes.stride(-1) == 1 and codes.storage_offset() % 2 == 0 and all(
            st % 2 == 0 for st in codes.stride()[:-1])
        x = (codes if aligned else codes.contiguous()).view(torch.bfloat16)
        return x if drop is None else zero_rows(x, drop)

    def error_bound(self, codes: Tensor, scale: Tensor | None, dim: int, group: int,
                    decoded: Tensor | None = None) -> Tensor:
        xh = self.decode(codes, None, dim, group) if decoded is None else decoded
        # half a bfloat16 ulp, then a float64 x's rounding to float32 before it (double rounding)
        return _with_input_rounding(torch.clamp(xh.abs() * 2.0**-8, min=2.0**-134), xh)


#: codes per block from which a CPU decode runs compiled (smaller blocks: eager ops, no compile)
COMPILE_MIN = 1 << 18
_COMPILED: dict[tuple, object] = {}


_ZERO_ROWS: list = []


def zero_rows(x: Tensor, drop: Tensor) -> Tensor:
    """``x`` with the rows ``drop`` marks (bool, broadcast against ``x``) given as zeros
    (``where``: a non-finite row weighs nothing). On the CPU, blocks of at least
    :data:`COMPILE_MIN` elements go through one compiled kernel (the eager ``where`` over a
    broadcast row mask is several times slower); the values are the same."""
    if may_compile(x, x.numel(), COMPILE_MIN):
        if not _ZERO_ROWS:
            _ZERO_ROWS.append(compile_kernel(_zeroed, "zero_rows"))
        if _ZERO_ROWS[0] is not None:
            return _ZERO_ROWS[0](x, drop)
    return _zeroed(x, drop)


def _zeroed(x: Tensor, drop: Tensor) -> Tensor:
    return torch.where(drop, torch.zeros((), dtype=x.dtype, device=x.device), x)


def _decoded(codec: Codec, codes: Tensor, scale: Tensor | None, dim: int, group: int, dtype: torch.dtype,
             drop: Tensor | None) -> Tensor:
    x = codec.decode(codes, scale, dim, group)
    if drop is not None:
        x = _zeroed(x, drop)
    return x if x.dtype == dtype else x.to(dtype)


def _compiled(codec: Codec, dim: int, group: int, dtype: torch.dtype, dropping: bool):
    """One compiled :func:`_decoded` per (codec, features, group, dtype, rows dropped or not),
    dynamic in the rows (None where torch cannot compile here: the eager ops then run)."""
    key = (codec.name, dim, group, dtype, dropping)
    if key not in _COMPILED:
        if dropping:
            def decode(codes: Tensor, scale: Tensor | None, drop: Tensor) -> Tensor:
                return _decoded(codec, codes, scale, dim, group, dtype, drop)
        else:
            def decode(codes: Tensor, scale: Tensor | None) -> Tensor:
                return _decoded(codec, codes, scale, dim, group, dtype, None)
        name = f"decode_{codec.name}_{dim}_{group}_{str(dtype).removeprefix('torch.')}{'_drop' if dropping else ''}"
        _COMPILED[key] = compile_kernel(decode, name)
    return _COMPILED[key]


#: The storage formats, by name (iterate this; never a list of names elsewhere).
KV_FORMATS: dict[str, Codec] = {c.name: c for c in (BF16Codec(), Fp8Codec(), IntCodec(8), IntCodec(4), IntCodec(2))}


def codec_of(name: object, what: str = "format") -> Codec:
    """The codec named ``name`` (or ``name`` itself if it is a :class:`Codec`)."""
    if isinstance(name, Codec):
        return name
    if not isinstance(name, str) or name not in KV_FORMATS:
        raise ValueError(f"{what} must be one of {list(KV_FORMATS)}, got {name!r}")
    return KV_FORMATS[name]


_HADAMARD: dict[tuple[int, str], Tensor] = {}


def hadamard(dim: int, device: torch.device | str = "cpu") -> Tensor:
    """The fixed ``[dim, dim]`` random-sign Hadamard rotation ``R`` (float32, orthogonal:
    ``R @ R.T = I``; ``dim`` a power of two). The signs come from a fixed seed (0), so every
    cache of a head dim uses the same ``R``."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"basis='hadamard' needs a power-of-two feature size, got {dim}")
    key = (dim, str(torch.device(device)))
    if key not in _HADAMARD:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        g = torch.Generator().manual_seed(0)
        signs = torch.where(torch.rand(dim, generator=g) < 0.5, -1.0, 1.0).double()
        r = (h * signs / math.sqrt(dim)).T.contiguous()  # rows: R x rotates x
        _HADAMARD[key] = r.float().to(device)
    return _HADAMARD[key]


@dataclass(frozen=True)
class KVQuant:
    """The quantised-storage option of a cache (``quant=`` of every kind).

    Args:
        keys: the key format (a name of :data:`KV_FORMATS`).
        values: the value format (default: ``keys``).
        group: channels per scale (default: the whole head, one scale per token and head).
        basis: ``"identity"`` or ``"hadamard"`` (codes of the rotated token, see the module
            docstring); per tensor: ``key_basis`` / ``value_basis`` override it.
        sinks: keep the sink tokens in full precision (the cache dtype) forever.
        residual: the newest committed tokens kept in full precision besides the open span
            (``0``: quantised at their commit; the open span is always full precision: every
            denoising step and the clean pass rewrite it).
        check_finite: refuse a commit whose K/V are not finite (a scale of inf or NaN means
            nothing), or are finite beyond what the format stores and the cache's dtype reads back
            finitely (``Codec.largest``, the cache's ``finfo.max``, each less ``2^-6``; over
            ``sqrt(D)`` in a Hadamard basis), changing nothing: one read of the device per commit.
            ``False``: no read-back
            (a commit captured in a CUDA graph); non-finite K/V are then stored as non-finite codes
            and scales, which the cache's own state dicts carry.

    Every token is quantised once, when its span is committed; it is then read from its codes
    once it is neither a sink (with ``sinks``) nor among the ``residual`` newest positions. A
    span reopened after its commit reads the residual before it in full precision again, as its
    first pass did.
    """

    keys: str = "int8"
    values: str | None = None
    group: int | None = None
    basis: Basis = "identity"
    key_basis: Basis | None = None
    value_basis: Basis | None = None
    sinks: bool = True
    residual: int = 0
    check_finite: bool = True
    _fmt: tuple[Codec, Codec] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        kf = codec_of(self.keys, "the key format (KVQuant keys=)")
        vf = codec_of(self.keys if self.values is None else self.values, "the value format (KVQuant values=)")
        object.__setattr__(self, "keys", kf.name)
        object.__setattr__(self, "values", vf.name)
        object.__setattr__(self, "_fmt", (kf, vf))
        for name in ("basis", "key_basis", "value_basis"):
            b = getattr(self, name)
            if (b is not None or name == "basis") and b not in ("identity", "hadamard"):
                raise ValueError(f"KVQuant {name} must be 'identity' or 'hadamard', got {b!r}")
        if self.group is not None and (isinstance(self.group, bool) or not isinstance(self.group, int)
                                       or self.group < 1):
            raise ValueError(f"KVQuant group must be an int >= 1 or None, got {self.group!r}")
        for name in ("sinks", "check_finite"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"KVQuant {name} must be a bool, got {type(getattr(self, name)).__name__} "
                                f"{getattr(self, name)!r}")
        if isinstance(self.residual, bool) or not isinstance(self.residual, int) or self.residual < 0:
            raise ValueError(f"KVQuant residual must be an int >= 0 (tokens), got {self.residual!r}")

    @property
    def key_format(self) -> Codec:
        return self._fmt[0]

    @property
    def value_format(self) -> Codec:
        return self._fmt[1]

    def bases(self) -> tuple[Basis, Basis]:
        return (self.key_basis or self.basis, self.value_basis or self.basis)

    def groups(self, k_dim: int, v_dim: int) -> tuple[int, int]:
        return (self.group or k_dim, self.group or v_dim)

    def check(self, k_dim: int, v_dim: int) -> None:
        """Raise ``ValueError`` unless the formats fit these feature sizes."""
        gk, gv = self.groups(k_dim, v_dim)
        self.key_format.check_dim(k_dim, gk)
        self.value_format.check_dim(v_dim, gv)
        for which, b, d in (("keys", self.bases()[0], k_dim), ("values", self.bases()[1], v_dim)):
            if b == "hadamard" and (d & (d - 1)):
                raise ValueError(f"KVQuant basis='hadamard' for {which} needs a power-of-two feature size, got {d}")

    def bytes_per_token(self, k_dim: int, v_dim: int) -> int:
        """Code and scale bytes of one token's K and V in one head."""
        gk, gv = self.groups(k_dim, v_dim)
        return self.key_format.bytes_per_token(k_dim, gk) + self.value_format.bytes_per_token(v_dim, gv)

    def config(self) -> dict[str, Any]:
        """What a state dict records (and must match)."""
        return {"keys": self.keys, "values": self.values, "group": self.group, "bases": self.bases(),
                "sinks": self.sinks, "residual": self.residual, "check_finite": self.check_finite}

    def label(self) -> str:
        kv = self.keys if self.keys == self.values else f"k{self.keys}/v{self.values}"
        extra = [f"g{self.group}"] if self.group else []
        if self.bases() != ("identity", "identity"):
            extra.append("had" if self.bases() == ("hadamard", "hadamard") else f"had={self.bases()}")
        if self.residual:
            extra.append(f"r{self.residual}")
        if not self.sinks:
            extra.append("qsinks")
        return kv + ("(" + ",".join(extra) + ")" if extra else "")


def as_quant(quant: object) -> KVQuant | None:
    """``None``, a :class:`KVQuant`, a format name (``"int4"``), or a dict of its fields."""
    if quant is None or isinstance(quant, KVQuant):
        return quant
    if isinstance(quant, str):
        return KVQuant(quant)
    if isinstance(quant, dict):
        return KVQuant(**quant)
    raise TypeError(f"quant must be None, a KVQuant, a format name {list(KV_FORMATS)} or a dict, "
                    f"got {type(quant).__name__} {quant!r}")
