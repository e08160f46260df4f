"""Eviction policies: small frozen dataclasses that choose the kept set of cached tokens.

Every policy has one job, :meth:`Oracle.keep`::

    keep = policy.keep(attention, positions)     # [*, N] bool

- ``attention``: ``[*, N]`` floating, the weights of each query (a row) over the ``N``
  cached tokens; only policies that look at it validate it (rows summing to 1, see
  :func:`streamkv.budget.mass.check_attention`).
- ``positions``: ``[N]`` int64, the stream positions of the cached tokens (distinct,
  in any order); default ``arange(N)``, i.e. the cache in chronological order.
- returns a new ``[*, N]`` bool tensor on ``attention``'s device; inputs are not mutated.

The policies here are *oracles* for one block of queries: they see the whole cached
past and that block's attention. A streaming cache that has already evicted tokens is
a different object (see the mass-budget cache); these define what it approximates.

- :class:`Full` keeps everything.
- :class:`FixedWindow` keeps the ``window`` newest tokens plus the stream's first
  ``sinks`` positions (StreamingLLM's sinks + window; ``sinks=0`` is a plain window).
- :class:`PerQueryMass` keeps the smallest set with kept mass ``>= 1 - tau``, so the
  output error is at most ``tau`` times the value range (:mod:`streamkv.budget.mass`).
- :class:`PerChunkMass` keeps one set of ``size`` tokens for a whole chunk of queries (the
  rows of dim ``-2``): the limit of any cache that fetches once per chunk.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from .mass import check_attention, check_tau
from ..validate import check_int

__all__ = ["Oracle", "Full", "FixedWindow", "PerQueryMass", "PerChunkMass"]


def _count(name: str, value: object, minimum: int = 0) -> int:
    return check_int(name, value, minimum)


def _shape_of(attention: object) -> Tensor:
    if not isinstance(attention, Tensor):
        raise TypeError(f"attention must be a Tensor, got {type(attention).__name__}")
    if attention.dim() < 1:
        raise ValueError(f"attention must have at least 1 dim ([*, N]), got shape {tuple(attention.shape)}")
    return attention


def _positions(positions: object, n: int, device: torch.device) -> Tensor:
    if positions is None:
        return torch.arange(n, device=device)
    if not isinstance(positions, Tensor):
        raise TypeError(f"positions must be an int64 Tensor, got {type(positions).__name__}")
    if positions.dtype != torch.int64:
        raise TypeError(f"positions must have dtype torch.int64, got {positions.dtype}")
    if positions.shape != (n,):
        raise ValueError(f"positions must have shape ({n},) (one per cached token), got {tuple(positions.shape)}")
    if (positions < 0).any():
        raise ValueError(f"positions must be >= 0, got min {positions.min().item()}")
    if positions.unique().numel() != n:
        raise ValueError("positions must be distinct (one token per position)")
    return positions.to(device)


def _newest(pos: Tensor, count: int) -> Tensor:
    """``[N]`` bool: the ``count`` tokens with the largest positions."""
    n = pos.numel()
    mask = torch.zeros(n, dtype=torch.bool, device=pos.device)
    if count > 0 and n > 0:
        mask[pos.topk(min(count, n)).indices] = True
    return mask


class Oracle(abc.ABC):
    """Base class: choose the kept set. Subclasses are frozen dataclasses."""

    #: short name used in tables and JSON
    kind: ClassVar[str] = "policy"

    @abc.abstractmethod
    def keep(self, attention: Tensor, positions: Tensor | None = None) -> Tensor:
        """``[*, N]`` bool mask of the cached tokens to keep for each query row."""

    def label(self) -> str:
        """A short human-readable description, e.g. ``mass(tau=0.05)``."""
        return self.kind


@dataclass(frozen=True)
class Full(Oracle):
    """Keep every cached token (the exact reference)."""

    kind: ClassVar[str] = "full"

    def keep(self, attention: Tensor, positions: Tensor | None = None) -> Tensor:
        a = _shape_of(attention)
        _positions(positions, a.shape[-1], a.device)
        return torch.ones(a.shape, dtype=torch.bool, device=a.device)


@dataclass(frozen=True)
class FixedWindow(Oracle):
    """Keep the ``window`` newest cached tokens and any cached token with position < ``sinks``.

    Ignores the attention weights (only their shape is used). ``window >= 0``,
    ``sinks >= 0`` and ``window + sinks >= 1``.
    """

    window: int
    sinks: int = 0
    kind: ClassVar[str] = "window"

    def __post_init__(self) -> None:
        _count("window", self.window)
        _count("sinks", self.sinks)
        if self.window + self.sinks < 1:
            raise ValueError(f"window + sinks must be >= 1 (a cache that keeps nothing), got {self.window} + {self.sinks}")

    def keep(self, attention: Tensor, positions: Tensor | None = None) -> Tensor:
        a = _shape_of(attention)
        pos = _positions(positions, a.shape[-1], a.device)
        mask = _newest(pos, self.window) | (pos < self.sinks)
        return mask.expand(a.shape).clone()

    def label(self) -> str:
        return f"window(W={self.window}" + (f", sinks={self.sinks})" if self.sinks else ")")


@dataclass(frozen=True)
class PerQueryMass(Oracle):
    """Keep the smallest set of cached tokens whose attention mass is ``>= 1 - tau``.

    Per query row. Protected tokens (positions ``< protect_sinks`` and the
    ``protect_recent`` newest cached tokens) are always kept and count toward the mass;
    the rest are added in order of **mass descending, then position ascending** (the
    older of two equal-mass tokens first) until the kept mass reaches ``1 - tau``.
    Taking the heaviest first makes the set minimal: no set containing the protected
    tokens with fewer tokens reaches the mass. Ties in that order make the choice
    deterministic (independent of the order the cached tokens are stored in).

    Floating point: the kept mass is measured as
    :func:`streamkv.budget.mass.kept_mass` computes it (in the attention's dtype), and
    the count is settled on that measure, so ``kept_mass >= 1 - tau`` always holds
    and no shorter prefix of the order reaches it — except when every token is kept
    and the row sums to slightly less than ``1 - tau`` (possible only for ``tau``
    below the row-sum tolerance), in which case the output is exact anyway. Where
    every partial sum is exact (e.g. dyadic masses) the set is minimal among *all*
    sets; in general, a different set whose exact mass ties the prefix's can round
    to the other side of ``1 - tau`` (an ulp-level effect).

    Args:
        tau: the dropped-mass budget, in the open interval (0, 1).
        protect_sinks: keep every cached token with position < this (>= 0).
        protect_recent: keep the newest this-many cached tokens (>= 0), e.g. the
            newest chunk.
    """

    tau: float
    protect_sinks: int = 0
    protect_recent: int = 0
    kind: ClassVar[str] = "mass"

    def __post_init__(self) -> None:
        object.__setattr__(self, "tau", check_tau(self.tau))
        _count("protect_sinks", self.protect_sinks)
        _count("protect_recent", self.protect_recent)

    def protected(self, positions: Tensor) -> Tensor:
        """``[N]`` bool: the tokens kept regardless of mass."""
        return (positions < self.protect_sinks) | _newest(positions, self.protect_recent)

    def keep(self, attention: Tensor, positions: Tensor | None = None) -> Tensor:
        p = check_attention(attention)
        n = p.shape[-1]
        pos = _positions(positions, n, p.device)
        if n == 0:
            return torch.zeros(p.shape, dtype=torch.bool, device=p.device)
        prot = self.protected(pos)
        lead = p.shape[:-1]
        p2 = p.reshape(-1, n)
        rows = p2.shape[0]

        # order: protected first, then mass descending, then position ascending;
        # three stable sorts, least significant key first
        by_pos = pos.argsort(stable=True)                                   # [N]
        order = by_pos.expand(rows, n)
        order = order.gather(1, p2.gather(1, order).sort(dim=1, descending=True, stable=True).indices)
        prot_in_order = prot[order].to(torch.int8)
        order = order.gather(1, prot_in_order.sort(dim=1, descending=True, stable=True).indices)

        target = 1.0 - self.tau
        csum = p2.gather(1, order).cumsum(1)
        reached = csum >= target
        # count = 1 + first index where the cumulative mass reaches the target (N if never)
        first = torch.where(reached.any(1), reached.to(torch.int8).argmax(1) + 1, torch.full_like(order[:, 0], n))
        n_prot = int(prot.sum())
        count = first.clamp(min=n_prot)
        rank = torch.arange(n, device=p.device)

        def prefix(c: Tensor) -> tuple[Tensor, Tensor]:
            keep = torch.zeros_like(p2, dtype=torch.bool).scatter(1, order, rank < c.unsqueeze(1))
            return keep, (p2 * keep).sum(1)   # the canonical kept mass (kept_mass)

        # the cumulative sum and the canonical sum may round differently; settle the
        # count on the canonical one (it is monotone in the prefix length): grow while
        # short of the target, then shrink while one fewer still reaches it
        keep, km = prefix(count)
        while True:
            short = (km < target) & (count < n)
            if not short.any():
                break
            count = count + short.to(count.dtype)
            keep, km = prefix(count)
        while True:
            fewer = (count - (count > n_prot).to(count.dtype))
            _, km_fewer = prefix(fewer)
            drop = (fewer < count) & (km_fewer >= target)
            if not drop.any():
                break
            count = count - drop.to(count.dtype)
        keep, _ = prefix(count)
        return keep.reshape(*lead, n)

    def label(self) -> str:
        return f"mass(tau={self.tau:g}{_protected(self)})"


def _protected(oracle: Any) -> str:
    """The label suffix naming what a mass oracle protects (sinks, recent tokens), if anything."""
    return "".join(f", {name}={n}" for name, n in (("sinks", oracle.protect_sinks), ("recent", oracle.protect_recent)) if n)


@dataclass(frozen=True)
class PerChunkMass(Oracle):
    """Keep, for a chunk of queries together, the ``size`` cached tokens of the largest summed
    attention mass over the chunk's queries.

    ``attention`` is ``[*, Q, N]``: the ``Q`` rows of dim ``-2`` are the chunk's queries (for a
    key head under grouped-query attention, every query head it serves), and one set is chosen
    per leading index and returned broadcast over the rows. Protected tokens (positions
    ``< protect_sinks`` and the ``protect_recent`` newest) are kept first and count toward
    ``size``; the rest are taken by summed mass descending, then position ascending. Taking the
    heaviest first maximises the total kept mass ``sum_q sum_{j in S} p_qj`` over every set of
    that size containing the protected tokens (the objective is additive over tokens): the
    chunk's limit when the set is chosen with the whole history in view. When ``size`` is
    below the protected count every protected token is still kept (the set is larger than
    ``size``); with ``size >= N`` everything is kept.

    Args:
        size: tokens kept per set (>= 1).
        protect_sinks, protect_recent: as :class:`PerQueryMass`.
    """

    size: int
    protect_sinks: int = 0
    protect_recent: int = 0
    kind: ClassVar[str] = "chunk_mass"

    def __post_init__(self) -> None:
        _count("size", self.size, 1)
        _count("protect_sinks", self.protect_sinks)
        _count("protect_recent", self.protect_recent)

    def keep(self, attention: Tensor, positions: Tensor | None = None) -> Tensor:
        p = check_attention(attention)
        if p.dim() < 2:
            raise ValueError(f"attention must be [*, Q, N] (a chunk of query rows), got shape {tuple(p.shape)}")
        n = p.shape[-1]
        pos = _positions(positions, n, p.device)
        if n == 0:
            return torch.zeros(p.shape, dtype=torch.bool, device=p.device)
        prot = (pos < self.protect_sinks) | _newest(pos, self.protect_recent)
        score = p.sum(-2).reshape(-1, n)  # [sets, N]
        rows = score.shape[0]
        order = pos.argsort(stable=True).expand(rows, n)
        order = order.gather(1, score.gather(1, order).sort(dim=1, descending=True, stable=True).indices)
        order = order.gather(1, prot[order].to(torch.int8).sort(dim=1, descending=True, stable=True).indices)
        count = max(self.size, int(prot.sum()))
        rank = torch.arange(n, device=p.device).expand(rows, n)
        keep = torch.zeros((rows, n), dtype=torch.bool, device=p.device).scatter(1, order, rank < count)
        return keep.reshape(*p.shape[:-2], 1, n).expand(p.shape).clone()

    def label(self) -> str:
        return f"chunk_mass(size={self.size}{_protected(self)})"
