"""The mass budget: per head, evict the largest set of tokens whose attention mass from the
committed chunk's queries stays within ``tau``.

With ``m_j = max_i p_ij`` over the chunk's queries (exact, from the attention that read the
cache), evict candidates by ``m`` ascending (older first on ties) while ``sum m_j <= tau``.
Since ``sum_{j in D} p_ij <= sum_{j in D} m_j`` for every query ``i``, **each query of the
scoring chunk keeps mass >= 1 - tau of the cache it attended to**, so this eviction moves its
output by at most ``tau`` times the value range (the kvbudget bound). That is the whole
scope: later queries may weigh evicted tokens more (the holdout mass ``streamkv budget``
reports), errors against full-history attention accumulate over evictions, and an overflow
(counted per (layer, head)) voids the guarantee for that eviction.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..budget.mass import check_tau
from .scored import ScoredPolicy, Scores

__all__ = ["MassBudget"]


class MassBudget(ScoredPolicy):
    """Keep mass >= 1 - ``tau`` for every query of the scoring chunk (see the module docstring).

    Args:
        tau: the dropped-mass budget per eviction, in (0, 1).
        protect_newest, score_block, check_finite: see :class:`~streamkv.policies.scored.ScoredPolicy`.
    """

    name = "mass"
    reads_protected_statistics = False  # sinks and a protected span never leave: their scores rank nothing
    example_params = {"tau": 0.2}
    cache_properties = ("tau",)

    def __init__(self, tau: float, *, protect_newest: bool = True, score_block: int | None = None,
                 check_finite: bool = True) -> None:
        super().__init__(protect_newest=protect_newest, score_block=score_block, check_finite=check_finite)
        self.tau = check_tau(tau)

    def params(self) -> dict[str, Any]:
        return {"tau": self.tau, **super().params()}

    def priority(self, scores: Scores) -> Tensor:
        return scores.key_max

    def wanted(self, sorted_priority: Tensor, candidates: Tensor, protected: Tensor) -> Tensor:
        # a non-finite score (check_finite=False: -inf here, first in the order) leaves and weighs
        # nothing in the sum: the finite ones after it still stop at tau; inf (non-candidates) never counts
        weight = torch.where(sorted_priority == -math.inf, 0.0, sorted_priority)
        return (weight.cumsum(-1) <= self.tau).sum(-1)
