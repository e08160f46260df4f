"""Quantised KV storage formats: declared once, here.

:data:`KV_FORMATS` is the registry every test, the ``streamkv quant`` command, the fuzzer hook
and the docs tables iterate: ``bf16`` (16 bits), ``fp8`` (e4m3) and ``int8`` (8 bits), ``int4``
(two codes a byte) and ``int2`` (four codes a byte). :class:`KVQuant` is the storage option a
cache takes (``quant=KVQuant("int4")`` or just ``quant="int4"``): the key and value formats, the
group size of the scales, the basis the codes live in, and what stays in full precision (the
sinks, the open span, a residual of the newest tokens).

The formats (per *group* of ``group`` consecutive channels of one token of one head; one scale a
group, stored as bfloat16 rounded *up* so that no code saturates):

``int8`` / ``int4`` / ``int2``
    symmetric mid-rise, ``M = 2^b - 1``: scale ``s = absmax / (M / 2)``, code
    ``c = clamp(floor(x / s + (M + 1) / 2), 0, M)``, value ``(2 c - M) * (s / 2)`` (every level
    used, no zero point). ``|x - x_hat| <= s / 2`` up to the float32 rounding of ``x / s``
    (covered: the bound used is ``s * (1/2 + 2^-12)``).
``fp8``
    e4m3 (``torch.float8_e4m3fn``) of ``x / s`` with ``s = absmax / 448``; value ``code * s``.
    ``|x - x_hat| <= s * max(2^-4 |code|, 2^-10)`` (half an ulp of three mantissa bits, or of the
    subnormal spacing 2^-9).
``bf16``
    the bfloat16 of ``x``, no scale; ``|x - x_hat| <= max(2^-8 |x_hat|, 2^-134)``.

Decoded values are float32 and *exact* there: a code of at most 9 significant bits times a
bfloat16 scale (8 bits) needs at most 17. So "the stored value" of a token is one float32
number per channel, the same wherever it is read (attention, ``cache.keys()``, a state dict).

The basis: ``basis="hadamard"`` stores ``R x`` instead of ``x`` (``R`` a fixed random-sign
Hadamard matrix, orthogonal, the same for every cache of a head dim; QuaRot, arXiv 2404.00456,
uses the same trick for weights and activations). It spreads a channel outlier over every
channel of the token, so one scale per token serves it; the read rotates each block back
(``R^T``, a ``D x D`` matmul per block). Dot products are invariant, so the key-error bound of the
certificate is computed in the rotated basis (:meth:`KVQuant.key_basis`), where it is tight.

Why this long: the table of formats, their error bounds and byte counts is the storage's definition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = ["KVFormat", "KV_FORMATS", "KVQuant", "as_quant", "hadamard"]

Basis = Literal["identity", "hadamard"]


def _round_up_bf16(s: Tensor) -> Tensor:
    """``s`` (float32, >= 0) rounded up to the next bfloat16 (returned as bfloat16)."""
    bits = s.contiguous().view(torch.int32)
    up = (bits + 0xFFFF) & ~0xFFFF
    return torch.where(torch.isfinite(s), up.view(torch.float32), s).to(torch.bfloat16)


@dataclass(frozen=True)
class KVFormat:
    """One storage format (see the module docstring). ``bits``: per element; ``scaled``: a
    bfloat16 scale per group is stored beside the codes."""

    name: str
    bits: int
    kind: Literal["int", "float", "bf16"]
    description: str

    @property
    def scaled(self) -> bool:
        return self.kind != "bf16"

    def code_width(self, dim: int) -> int:
        """Bytes of codes per ``dim`` channels."""
        return dim * self.bits // 8

    def check_dim(self, dim: int, group: int) -> None:
        if dim % group:
            raise ValueError(f"{self.name}: group ({group}) must divide the feature size ({dim})")
        if (dim * self.bits) % 8:
            raise ValueError(f"{self.name}: {dim} channels of {self.bits} bits do not fill whole bytes")

    def bytes_per_token(self, dim: int, group: int) -> int:
        """Bytes per token and head: codes plus scales."""
        return self.code_width(dim) + (2 * (dim // group) if self.scaled else 0)

    # ----------------------------------------------------------------- codec
    def encode(self, x: Tensor, group: int) -> tuple[Tensor, Tensor | None]:
        """``x [..., D]`` (any float) -> ``(codes uint8 [..., W], scale bfloat16 [..., D / group] or None)``."""
        x = x.float()
        if self.kind == "bf16":
            return x.to(torch.bfloat16).view(torch.uint8), None
        D = x.shape[-1]
        xg = x.reshape(*x.shape[:-1], D // group, group)
        absmax = xg.abs().amax(-1)
        if self.kind == "float":
            scale = _round_up_bf16(absmax / 448.0)
            s = scale.float().unsqueeze(-1)
            y = torch.where(s > 0, xg / torch.where(s > 0, s, 1.0), 0.0)
            codes = y.to(torch.float8_e4m3fn).view(torch.uint8).reshape(x.shape)
            return codes, scale
        M = 2**self.bits - 1
        scale = _round_up_bf16(absmax / (M / 2))
        s = scale.float().unsqueeze(-1)
        y = torch.where(s > 0, xg / torch.where(s > 0, s, 1.0), 0.0)
        c = torch.floor(y + (M + 1) / 2).clamp_(0, M).to(torch.uint8).reshape(x.shape)
        return _pack(c, self.bits), scale

    def decode(self, codes: Tensor, scale: Tensor | None, dim: int, group: int) -> Tensor:
        """Float32 ``[..., D]`` values of ``codes`` / ``scale`` (exact in float32)."""
        if self.kind == "bf16":
            return codes.contiguous().view(torch.bfloat16).float()
        s = scale.float().unsqueeze(-1)
        if self.kind == "float":
            y = codes.contiguous().view(torch.float8_e4m3fn).float()
            return (y.reshape(*y.shape[:-1], dim // group, group) * s).reshape(*y.shape[:-1], dim)
        M = 2**self.bits - 1
        c = _unpack(codes, self.bits, dim).float()
        # (c - M / 2) is a half-integer of at most 9 bits: its product with a bfloat16 is exact
        lev = c.sub_(M / 2).reshape(*c.shape[:-1], dim // group, group)
        return lev.mul_(s).reshape(*c.shape[:-1], dim)

    def error_bound(self, codes: Tensor, scale: Tensor | None, dim: int, group: int,
                    decoded: Tensor | None = None) -> Tensor:
        """Float32 ``[..., D]``: a bound on ``|x - x_hat|`` per element, from what is stored
        (``decoded``: the values, if already at hand)."""
        if self.kind == "bf16":
            xh = self.decode(codes, None, dim, group) if decoded is None else decoded
            return torch.clamp(xh.abs() * 2.0**-8, min=2.0**-134)
        s = scale.float().unsqueeze(-1)
        lead = codes.shape[:-1]
        if self.kind == "float":
            y = codes.contiguous().view(torch.float8_e4m3fn).float()
            y = y.reshape(*lead, dim // group, group)
            return (torch.clamp(y.abs() * 2.0**-4, min=2.0**-10) * s).reshape(*lead, dim)
        return (s * (0.5 + 2.0**-12)).expand(*lead, dim // group, group).reshape(*lead, dim)


def _pack(c: Tensor, bits: int) -> Tensor:
    """uint8 codes ``[..., D]`` of ``bits`` bits -> ``[..., D * bits / 8]`` bytes (low bits first)."""
    if bits == 8:
        return c
    per = 8 // bits
    c = c.reshape(*c.shape[:-1], -1, per)
    out = c[..., 0].clone()
    for i in range(1, per):
        out |= c[..., i] << (bits * i)
    return out


def _unpack(b: Tensor, bits: int, dim: int) -> Tensor:
    if bits == 8:
        return b
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(b >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, dim=-1).reshape(*b.shape[:-1], dim)


#: The storage formats, by name (iterate this; never a list of names elsewhere).
KV_FORMATS: dict[str, KVFormat] = {
    f.name: f for f in (
        KVFormat("bf16", 16, "bf16", "bfloat16 of each element, no scale"),
        KVFormat("fp8", 8, "float", "e4m3 of x / s, a bfloat16 scale per group (s = absmax / 448)"),
        KVFormat("int8", 8, "int", "symmetric mid-rise, 256 levels, a bfloat16 scale per group"),
        KVFormat("int4", 4, "int", "symmetric mid-rise, 16 levels, two codes a byte, a bfloat16 scale per group"),
        KVFormat("int2", 2, "int", "symmetric mid-rise, 4 levels, four codes a byte, a bfloat16 scale per group"),
    )
}


def _format(name: object, what: str) -> KVFormat:
    if isinstance(name, KVFormat):
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

    Every token is quantised once, when its span is committed; it is then read from its codes
    once it is neither a sink (with ``sinks``) nor among the ``residual`` newest positions.
    """

    keys: str = "int8"
    values: str | None = None
    group: int | None = None
    basis: Basis = "identity"
    key_basis: Basis | None = None
    value_basis: Basis | None = None
    sinks: bool = True
    residual: int = 0
    _fmt: tuple[KVFormat, KVFormat] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        kf = _format(self.keys, "KVQuant keys")
        vf = _format(self.keys if self.values is None else self.values, "KVQuant values")
        object.__setattr__(self, "keys", kf.name)
        object.__setattr__(self, "values", vf.name)
        object.__setattr__(self, "_fmt", (kf, vf))
        for name in ("basis", "key_basis", "value_basis"):
            b = getattr(self, name)
            if b is not None and b not in ("identity", "hadamard"):
                raise ValueError(f"KVQuant {name} must be 'identity' or 'hadamard', got {b!r}")
        if self.group is not None and (isinstance(self.group, bool) or not isinstance(self.group, int)
                                       or self.group < 1):
            raise ValueError(f"KVQuant group must be an int >= 1 or None, got {self.group!r}")
        if not isinstance(self.sinks, bool):
            raise TypeError(f"KVQuant sinks must be a bool, got {type(self.sinks).__name__} {self.sinks!r}")
        if isinstance(self.residual, bool) or not isinstance(self.residual, int) or self.residual < 0:
            raise ValueError(f"KVQuant residual must be an int >= 0 (tokens), got {self.residual!r}")

    @property
    def key_format(self) -> KVFormat:
        return self._fmt[0]

    @property
    def value_format(self) -> KVFormat:
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
                "sinks": self.sinks, "residual": self.residual}

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
