"""Dropped attention mass and the output error it causes: the identity and its bounds.

Notation, for one query (every function here broadcasts over leading dims ``*``):

- ``p``: ``[*, N]`` attention weights of the query over ``N`` cached tokens; each row
  is non-negative and sums to 1 (a softmax row).
- ``v``: ``[*, N, D]`` the cached values (leading dims broadcast against ``p``'s, so a
  ``[N, D]`` value set serves every query of a ``[Q, N]`` block).
- ``keep``: ``[*, N]`` bool, the kept set ``K``; its complement is the dropped set ``D``.
- ``m = sum_{j in D} p_j``: the dropped mass; ``1 - m`` is the kept mass.
- ``o = sum_j p_j v_j``: the full output; ``o_K = sum_{j in K} p_j v_j / (1 - m)``: the
  output of attention restricted to ``K`` and renormalised (what a cache holding only
  ``K`` computes); ``mean_K`` and ``mean_D`` are the ``p``-weighted means of ``v`` over
  ``K`` and ``D``, so ``o_K = mean_K``.

**The identity.** Since ``o = (1 - m) mean_K + m mean_D``::

    o - o_K = m * (mean_D - mean_K)            (exact; rows of p summing to 1)

**The bounds.** ``mean_D`` and ``mean_K`` are convex combinations of the cached values,
so each lies in their convex hull, and

- per channel ``c``: ``|o_c - o_K,c| <= m * range_c(v)`` with
  ``range_c(v) = max_j v_jc - min_j v_jc`` over the ``N`` cached values
  (:func:`channel_range`); hence ``||o - o_K||_inf <= m * max_c range_c(v)``;
- in L2: ``||o - o_K||_2 <= m * diam(v)`` with ``diam(v) = max_{i,j} ||v_i - v_j||_2``
  (:func:`value_diameter`; the diameter of a point set equals that of its hull).

A policy that keeps mass ``>= 1 - tau`` has ``m <= tau``, so its error is at most
``tau * range_c`` per channel and ``tau * diam`` in L2. The exact form
``m * |mean_D - mean_K|`` is the tighter one; the range forms are what a budget can
promise without looking at the values.

**Scope.** The bound covers the queries whose attention ``p`` was measured: the kept
set certifies nothing about queries that did not take part in choosing it.

**Prior art.** The identity and the diameter bound are not new: Tzachristas et al.,
"A Mathematical Theory of Top-k Sparse Attention via Total Variation Distance",
arXiv 2512.07647 (2025), prove ``||Attn - Attn_k||_2 = TV * ||mu_tail - mu_head||_2``
with ``TV`` the discarded mass. This module only implements and tests it.

Validation: functions that take ``p`` check that it is a floating tensor, finite,
non-negative, and that every row sums to 1 within :func:`row_sum_atol` (or a given
``atol``); ``v`` must be finite. Violations raise ``ValueError`` naming the constraint
and the offending value; wrong types raise ``TypeError``. With rows that sum to
``1 + delta`` the identity is off by at most ``|delta| * |mean_K|``.

Every function is plain torch, works in any floating dtype and is exact to that
dtype's rounding (use float64 for tests); none mutates its inputs.

Why this long: the identity and its bounds are the proof the mass budget and the certificate rest on.
"""

from __future__ import annotations

import math
from numbers import Real

import torch
from torch import Tensor

from ..validate import check_real

__all__ = [
    "check_tau",
    "check_attention",
    "check_values",
    "check_keep",
    "row_sum_atol",
    "softmax_attention",
    "full_output",
    "kept_mass",
    "dropped_mass",
    "kept_output",
    "weighted_mean",
    "identity_rhs",
    "channel_range",
    "value_diameter",
    "linf_bound",
    "l2_bound",
]


# --------------------------------------------------------------------------- checks


def check_tau(tau: object, name: str = "tau") -> float:
    """Return ``tau`` as a float after checking ``0 < tau < 1``.

    Raises:
        TypeError: ``tau`` is not a real number (bools are rejected).
        ValueError: ``tau`` is NaN or outside the open interval (0, 1).
    """
    if isinstance(tau, bool) or not isinstance(tau, Real):
        raise TypeError(f"{name} must be a real number, got {type(tau).__name__} {tau!r}")
    value = float(tau)
    if not (0.0 < value < 1.0):  # also rejects NaN
        raise ValueError(f"{name} must be in the open interval (0, 1), got {value!r}")
    return value


def _first_bad(mask: Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def _check_tensor(name: str, x: object, min_dim: int) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dims, got shape {tuple(x.shape)}")
    bad = ~torch.isfinite(x)
    if bad.any():
        idx = _first_bad(bad)
        raise ValueError(f"{name} must be finite: found {x[idx].item()!r} at index {idx}")
    return x


def row_sum_atol(dtype: torch.dtype, n: int) -> float:
    """Default tolerance for ``|sum(row) - 1|``: ``(n + 16) * eps(dtype)``.

    ``n * eps`` is the worst-case rounding of summing ``n`` terms; the ``+ 16`` covers
    the rounding of the softmax that produced them. For float64 and ``n = 1000`` this
    is about ``2.3e-13``; for float32 about ``1.2e-4``.
    """
    return (n + 16) * torch.finfo(dtype).eps


def check_attention(p: object, name: str = "attention", atol: float | None = None) -> Tensor:
    """Check attention weights ``p: [*, N]`` and return them unchanged.

    Constraints: floating Tensor with at least one dim, finite, ``>= 0``, and each
    row (last dim) summing to 1 within ``atol`` (default :func:`row_sum_atol`).
    Rows over zero tokens (``N == 0``) are accepted: there is nothing to attend to.
    """
    p = _check_tensor(name, p, 1)
    neg = p < 0
    if neg.any():
        idx = _first_bad(neg)
        raise ValueError(f"{name} must be non-negative: found {p[idx].item()!r} at index {idx}")
    n = p.shape[-1]
    if n == 0 or p.numel() == 0:
        return p
    tol = row_sum_atol(p.dtype, n) if atol is None else check_real("atol", atol, minimum=0.0)
    sums = p.sum(-1)
    off = (sums - 1).abs() > tol
    if off.any():
        idx = _first_bad(off)
        raise ValueError(
            f"{name} rows must sum to 1 (within atol={tol:.3g}): row {idx} sums to {sums[idx].item()!r}"
        )
    return p


def check_values(v: object, name: str = "values") -> Tensor:
    """Check cached values ``v: [*, N, D]`` (floating, at least 2 dims, finite)."""
    return _check_tensor(name, v, 2)


def check_keep(keep: object, p: Tensor, name: str = "keep") -> Tensor:
    """Check a kept-set mask: a bool Tensor broadcastable to ``p``'s shape ``[*, N]``."""
    if not isinstance(keep, Tensor):
        raise TypeError(f"{name} must be a bool Tensor, got {type(keep).__name__}")
    if keep.dtype != torch.bool:
        raise TypeError(f"{name} must have dtype torch.bool, got {keep.dtype}")
    try:
        shape = torch.broadcast_shapes(keep.shape, p.shape)
    except RuntimeError:
        shape = None
    if shape != p.shape:
        raise ValueError(
            f"{name} must broadcast to the attention shape {tuple(p.shape)}, got {tuple(keep.shape)}"
        )
    return keep


def _check_pv(p: Tensor, v: Tensor) -> None:
    if v.dtype != p.dtype:
        raise ValueError(f"attention and values must share a dtype, got {p.dtype} and {v.dtype}")
    if v.shape[-2] != p.shape[-1]:
        raise ValueError(
            f"values must hold one row per cached token: attention has N={p.shape[-1]}, "
            f"values have shape {tuple(v.shape)} (N is dim -2)"
        )


def softmax_attention(scores: object, name: str = "scores") -> Tensor:
    """Softmax over the last dim of finite attention scores ``[*, N]``.

    Non-finite scores (NaN, +-inf) are rejected rather than masked: express a kept
    set with a ``keep`` mask instead of ``-inf`` scores.
    """
    s = _check_tensor(name, scores, 1)
    return torch.softmax(s, dim=-1)


# ------------------------------------------------------------------------- outputs


def _weighted_sum(w: Tensor, v: Tensor) -> Tensor:
    # [*, N] x [*, N, D] -> [*, D]
    return (w.unsqueeze(-2) @ v).squeeze(-2)


def full_output(p: Tensor, v: Tensor) -> Tensor:
    """Full attention output ``o = sum_j p_j v_j``: ``[*, N], [*, N, D] -> [*, D]``."""
    p = check_attention(p)
    v = check_values(v)
    _check_pv(p, v)
    return _weighted_sum(p, v)


def kept_mass(p: Tensor, keep: Tensor) -> Tensor:
    """Kept mass ``sum_{j in K} p_j``: ``[*, N] -> [*]``, in ``p``'s dtype.

    This is the canonical mass a policy's guarantee is stated in: the sum runs in
    index order whatever the kept set, so it is deterministic.
    """
    p = check_attention(p)
    keep = check_keep(keep, p)
    return (p * keep).sum(-1)


def dropped_mass(p: Tensor, keep: Tensor) -> Tensor:
    """Dropped mass ``m = sum_{j in D} p_j``: ``[*, N] -> [*]``."""
    p = check_attention(p)
    keep = check_keep(keep, p)
    return (p * ~keep).sum(-1)


def weighted_mean(p: Tensor, v: Tensor, mask: Tensor, name: str = "set", mask_name: str = "mask") -> Tensor:
    """``p``-weighted mean of ``v`` over the set ``mask``: ``[*, D]``.

    Raises ``ValueError`` if the set carries zero mass in some row (the mean is then
    undefined).
    """
    p = check_attention(p)
    v = check_values(v)
    _check_pv(p, v)
    mask = check_keep(mask, p, name=mask_name)
    w = p * mask
    mass = w.sum(-1)
    zero = mass <= 0
    if zero.any():
        idx = _first_bad(zero)
        raise ValueError(f"the {name} must carry positive attention mass: row {idx} has mass {mass[idx].item()!r}")
    return _weighted_sum(w, v) / mass.unsqueeze(-1)


def kept_output(p: Tensor, v: Tensor, keep: Tensor) -> Tensor:
    """Output of attention over the kept set only, renormalised: ``o_K = mean_K``.

    Shapes ``[*, N], [*, N, D], [*, N] -> [*, D]``. Raises ``ValueError`` if a row's
    kept mass is zero (a cache with nothing attended to has no output).
    """
    return weighted_mean(p, v, keep, name="kept set", mask_name="keep")


def identity_rhs(p: Tensor, v: Tensor, keep: Tensor) -> Tensor:
    """The identity's right-hand side ``m * (mean_D - mean_K)``, equal to ``o - o_K``.

    Computed as ``sum_{j in D} p_j v_j - m * mean_K``, which is defined also when the
    dropped set is empty or has zero mass (then it is 0). Shape ``[*, D]``.
    """
    p = check_attention(p)
    keep = check_keep(keep, p)
    mean_k = kept_output(p, v, keep)
    drop = ~keep
    m = (p * drop).sum(-1, keepdim=True)
    return _weighted_sum(p * drop, v) - m * mean_k


# -------------------------------------------------------------------------- bounds


def channel_range(v: Tensor) -> Tensor:
    """Per-channel value range ``max_j v_jc - min_j v_jc``: ``[*, N, D] -> [*, D]``.

    ``N`` must be at least 1.
    """
    v = check_values(v)
    if v.shape[-2] == 0:
        raise ValueError("channel_range needs at least one cached value, got N=0")
    # the difference in float64 (exact for every narrower dtype), rounded up to v's: a range is a bound
    return _round_up(v.amax(-2).double() - v.amin(-2).double(), v.dtype)


def value_diameter(v: Tensor) -> Tensor:
    """Diameter of the value set, ``max_{i,j} ||v_i - v_j||_2``: ``[*, N, D] -> [*]``.

    Exact (all pairs, ``O(N^2 D)`` time and ``O(N^2)`` memory per leading index).
    """
    v = check_values(v)
    if v.shape[-2] == 0:
        raise ValueError("value_diameter needs at least one cached value, got N=0")
    # the direct differences: cdist's default switches to |a|^2 + |b|^2 - 2ab past 25 rows, which
    # cancels to 0 for values far from the origin (a bound below the truth); in float64 (cdist has
    # no 16-bit kernels), rounded up to v's dtype
    w = v.double()
    return _round_up(torch.cdist(w, w, compute_mode="donot_use_mm_for_euclid_dist").amax(dim=(-2, -1)), v.dtype)


def _round_up(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Float64 ``x`` in ``dtype``, rounded toward ``+inf`` (never below ``x``)."""
    y = x.to(dtype)
    if dtype == x.dtype:
        return y
    return torch.where(y.to(x.dtype) < x, torch.nextafter(y, torch.full_like(y, math.inf)), y)


def _budget(budget: float | Tensor) -> float | Tensor:
    if isinstance(budget, Tensor):
        budget = _check_tensor("mass", budget, 0)
        if (budget < 0).any() or (budget > 1).any():
            raise ValueError(f"mass must be in [0, 1], got values in [{budget.min().item()}, {budget.max().item()}]")
        return budget
    return check_tau(budget)


def linf_bound(budget: float | Tensor, v: Tensor) -> Tensor:
    """Per-channel error bound ``budget * range_c(v)``: ``[*, D]`` (or ``[*', *, D]``).

    ``budget`` is ``tau`` (a float in (0, 1)) or per-query dropped masses ``m: [*]``
    in [0, 1] (then ``v``'s leading dims must broadcast with ``m``'s). The error
    ``|o_c - o_K,c|`` of any query with dropped mass ``<= budget`` is at most this,
    channel by channel; the L-infinity error is at most its max over ``c``.
    """
    b = _budget(budget)
    r = channel_range(v)
    return b.unsqueeze(-1) * r if isinstance(b, Tensor) else b * r


def l2_bound(budget: float | Tensor, v: Tensor) -> Tensor:
    """L2 error bound ``budget * diam(v)``; ``budget`` as in :func:`linf_bound`."""
    b = _budget(budget)
    return b * value_diameter(v)

