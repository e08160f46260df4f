"""Mass budgets: the dropped-mass identity, its error bounds, and the per-query oracles.

- :mod:`streamkv.budget.mass` — ``o - o_K = m * (mean_D - mean_K)`` and the bounds
  ``m * range_c`` (per channel, L-infinity) and ``m * diam`` (L2). Prior art:
  Tzachristas et al., arXiv 2512.07647.
- :mod:`streamkv.budget.oracles` — :class:`Full`, :class:`FixedWindow`,
  :class:`PerQueryMass`: per-query oracles (frozen dataclasses) that choose the kept set.
"""

from .mass import (
    channel_range,
    check_attention,
    check_tau,
    dropped_mass,
    full_output,
    identity_rhs,
    kept_mass,
    kept_output,
    l2_bound,
    linf_bound,
    softmax_attention,
    value_diameter,
    weighted_mean,
)
from .oracles import FixedWindow, Full, PerQueryMass, Oracle

__all__ = [
    "check_tau",
    "check_attention",
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
    "Oracle",
    "Full",
    "FixedWindow",
    "PerQueryMass",
]
