"""The rows of ``streamkv chart``: which cache, in which format, at which budget, and the cache
each row builds at a geometry (a timed shape, or the stream its error is measured on).

A row is ``(cache, format, budget)``:

``cache``    ``full`` (every token: the reference), ``ring``, every scored kind of
             :data:`~streamkv.policies.POLICIES` (``check_finite=False``: no read-back), ``tier``
             (the compressed tier, :class:`~streamkv.certify.tier.CompressedTier`, on a TOVA cache,
             no certificate) and ``tier+certificates`` (the same, every step certified)
``format``   ``bf16``: dense bfloat16 K/V; any other name of :data:`~streamkv.stores.KV_FORMATS`:
             ``KVQuant(format, check_finite=False)`` on the bfloat16 cache (the tier: its tier-2
             format, tier 1 dense)
``budget``   ``tokens:f``: ``f`` of the full cache's tokens (slots); ``bytes:f``: ``f`` of the
             full bf16 cache's K/V bytes, as many tokens as the format's codes and scales fit
             (at most every token); the tier: ``bytes:f`` only (tier 1 ``TIER_FP_FRACTION`` of the
             bytes, at least the sinks and two spans, the rest tier-2 entries). ``full``: none.

Capacities are whole frames on a video geometry. A row the library refuses at a geometry (a
scored kind needs ``sink + 2 spans`` slots: a quarter of Self-Forcing's 21 frames is less than
two 3-frame chunks) is not run there; the refusal is recorded with the row.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

__all__ = ["Row", "Geometry", "CHART_FORMATS", "BUDGETS", "TIER_FP_FRACTION", "TIER_BLOCK", "chart_caches",
           "chart_rows", "parse_budget", "row_capacity", "build_row_cache", "held_bytes"]

#: the formats of the issue's chart (any of KV_FORMATS may be asked for)
CHART_FORMATS = ("bf16", "int8", "int4")
BUDGETS = ("tokens:1/2", "tokens:1/4", "bytes:1/2", "bytes:1/4")
#: the compressed tier's share of its bytes in tier 1 (full precision), and its block
TIER_FP_FRACTION = 0.3
TIER_BLOCK = 16
#: the mass budget's tau (the share of attention mass it may drop; as ``streamkv bench`` prices it)
MASS_TAU = 0.05
TIERS = ("tier", "tier+certificates")


def chart_caches() -> tuple[str, ...]:
    """Every cache of the chart: full, the ring, each scored kind (the registry's), the tier."""
    from streamkv_lab.kinds import scored_kinds

    return ("full", "ring", *scored_kinds(), *TIERS)


def parse_budget(text: str) -> tuple[str, Fraction]:
    """``"tokens:1/4"`` -> ``("tokens", 1/4)``; ``ValueError`` naming the form otherwise."""
    kind, _, frac = text.partition(":")
    try:
        f = Fraction(frac)
    except (ValueError, ZeroDivisionError):
        f = None
    if kind not in ("tokens", "bytes") or f is None or not 0 < f < 1:
        raise ValueError(f"a budget is tokens:F or bytes:F with 0 < F < 1 (e.g. tokens:1/4), got {text!r}")
    return kind, f


@dataclass(frozen=True)
class Row:
    cache: str
    fmt: str
    budget: str | None  # None: the full cache

    @property
    def key(self) -> str:
        return f"{self.cache}/{self.fmt}/{self.budget or 'all'}"

    @property
    def tier(self) -> bool:
        return self.cache in TIERS

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "cache": self.cache, "format": self.fmt, "budget": self.budget}
        if self.budget is not None:
            kind, f = parse_budget(self.budget)
            out.update(budget_kind=kind, budget_fraction=float(f))
        return out


def chart_rows(caches: tuple[str, ...], formats: tuple[str, ...], budgets: tuple[str, ...]) -> list[Row]:
    """The rows of the chart (module docstring): ``full`` once per format, the ring and the scored
    kinds per format and budget (bf16's byte budgets are its token budgets: listed once), the tier
    per non-bf16 format and byte budget."""
    rows: list[Row] = []
    for cache in caches:
        for fmt in formats:
            if cache == "full":
                rows.append(Row(cache, fmt, None))
                continue
            for b in budgets:
                kind, _ = parse_budget(b)
                if cache in TIERS:
                    if fmt != "bf16" and kind == "bytes":
                        rows.append(Row(cache, fmt, b))
                elif not (fmt == "bf16" and kind == "bytes" and f"tokens:{b.split(':', 1)[1]}" in budgets):
                    rows.append(Row(cache, fmt, b))
    return rows


@dataclass(frozen=True)
class Geometry:
    """Where a row's cache is built: ``full`` tokens (the full cache's), ``sink``, ``span`` (the
    cache's chunk), ``unit`` (tokens per frame: capacities in whole units), heads x head_dim,
    layers."""

    full: int
    sink: int
    span: int
    unit: int
    heads: int
    head_dim: int
    layers: int

    def token_bytes(self, fmt: str) -> float:
        """Bytes of one token's K and V in every head and layer: dense bf16, or the format's codes and scales."""
        if fmt == "bf16":
            return 2 * self.heads * self.head_dim * 2 * self.layers
        from streamkv.stores import KVQuant

        return KVQuant(fmt).bytes_per_token(self.head_dim, self.head_dim) * self.heads * self.layers

    @property
    def full_bytes(self) -> int:
        return int(self.full * self.token_bytes("bf16"))


def _units(tokens: float, unit: int) -> int:
    return int(tokens // unit) * unit


def row_capacity(row: Row, geo: Geometry) -> dict[str, int]:
    """``{"capacity": slots}`` (and for the tier ``{"tier1": slots, "tier2": entries}``) of ``row`` at
    ``geo``. ``ValueError`` when the budget holds less than the sinks and a span (two for the tier)."""
    if row.budget is None:
        return {"capacity": geo.full}
    kind, f = parse_budget(row.budget)
    if row.tier:
        budget = float(f) * geo.full_bytes
        per1 = geo.token_bytes("bf16")
        t1 = max(_units(TIER_FP_FRACTION * budget / per1, geo.unit), geo.sink + 2 * geo.span)
        per2 = geo.token_bytes(row.fmt) + geo.heads * geo.layers  # codes, scales and a live flag per entry
        m = int((budget - t1 * per1) / per2) // TIER_BLOCK * TIER_BLOCK
        if m < TIER_BLOCK:
            raise ValueError(f"{row.budget} of {geo.full_bytes} bytes: tier 1 ({t1} slots: the sinks and two spans "
                             f"at least) leaves no room for a tier-2 block of {TIER_BLOCK}")
        return {"capacity": t1, "tier1": t1, "tier2": m}
    if kind == "tokens":
        cap = _units(float(f) * geo.full, geo.unit)
    else:
        cap = min(geo.full, _units(float(f) * geo.full_bytes / geo.token_bytes(row.fmt), geo.unit))
    if cap < geo.sink + geo.span:
        raise ValueError(f"{row.budget} of {geo.full} tokens is {cap} slots, fewer than the {geo.sink} sinks and a "
                         f"span of {geo.span}")
    return {"capacity": cap}


def build_row_cache(row: Row, geo: Geometry, *, dtype: torch.dtype = torch.bfloat16, causal: bool = False,
                    scale: float | None = None) -> tuple[Any, Any, dict[str, int]]:
    """``(cache, tier or None, capacities)`` of ``row`` at ``geo`` (``[1, slots, heads, head_dim]``,
    seq_dim 1). Raises the library's ``ValueError``/``TypeError`` where it refuses the layout."""
    from streamkv import KVCache
    from streamkv_lab.kinds import kind_params, policies
    from streamkv.stores import KVQuant

    caps = row_capacity(row, geo)
    cap = caps["capacity"]
    shape = (1, cap, geo.heads, geo.head_dim)
    kind = "tova" if row.tier else ("ring" if row.cache == "full" else row.cache)
    params = kind_params(kind, tau=MASS_TAU)
    if policies()[kind].per_head:
        params["check_finite"] = False
    quant = None if row.fmt == "bf16" or row.tier else KVQuant(row.fmt, check_finite=False)
    cache = KVCache(shape, shape, seq_dim=1, sink=geo.sink, window=cap - geo.sink, chunk=geo.span, policy=kind,
                    num_layers=geo.layers, dtype=dtype, quant=quant, **params)
    tier = None
    if row.tier:
        from streamkv.certify.tier import CompressedTier

        tier = CompressedTier(cache, fmt=row.fmt, capacity=caps["tier2"], block=TIER_BLOCK, causal=causal,
                              scale=scale, certify=row.cache == "tier+certificates")
    return cache, tier, caps


def held_bytes(cache: Any, tier: Any) -> dict[str, int]:
    """Device bytes a row's cache holds: K/V storage, the policy's state, the tier's (tier 3 at its
    peak so far)."""
    policy = sum(t.nbytes for t in cache.policy.state().values())
    out = {"kv_bytes": cache.storage.nbytes, "policy_bytes": policy, "tier_bytes": 0}
    if tier is not None:
        boxes = sum(a.nbytes + b.nbytes + c.nbytes for a, b, c in zip(tier.lo, tier.hi, tier.log_count))
        out["tier_bytes"] = tier.nbytes - boxes + tier.stats["box_bytes_peak"]
    out["bytes"] = out["kv_bytes"] + out["policy_bytes"] + out["tier_bytes"]
    return out
