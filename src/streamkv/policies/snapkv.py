"""SnapKV: keep the tokens an observation window of the newest queries attends to, pooled over
their neighbours (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation",
arXiv 2404.14469; kvpress's ``SnapKVPress``).

Per (layer, head), after a commit: a held token's score is the attention the span's newest ``obs``
queries (and the batch) gave it, ``sum_i p_ij``, max-pooled over the ``kernel`` held tokens
around it in position order (so a token next to an important one is kept with it). The ``budget``
kept are the sinks, the chunk just committed and the highest pooled scores (ties: newer first).
The statistic over the newest rows is declared (:attr:`statistic`): the read computes it in the
same pass as attention. ``dropped_mass_bound`` bounds what those ``obs`` queries lost, not the
span's older queries.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..blockread import Statistic
from ..validate import check_int
from .scored import FixedBudget, Scores

__all__ = ["SnapKV"]


class SnapKV(FixedBudget):
    """Pooled attention of the newest ``obs`` queries; ``budget`` as
    :class:`~streamkv.policies.scored.FixedBudget`; ``kernel`` an odd pooling width."""

    name = "snapkv"
    example_params = {"obs": 4, "kernel": 3}
    cache_properties = ("budget", "obs", "kernel")

    def __init__(self, budget: int | None = None, *, obs: int = 32, kernel: int = 7,
                 score_block: int | None = None, check_finite: bool = True) -> None:
        super().__init__(budget, score_block=score_block, check_finite=check_finite)
        self.obs = check_int("obs", obs, 1)
        self.kernel = check_int("kernel", kernel, 1)
        if self.kernel % 2 == 0:
            raise ValueError(f"kernel must be odd (a window centred on each token), got {kernel}")
        self.statistic = Statistic(rows=self.obs)

    def params(self) -> dict[str, Any]:
        return {**super().params(), "obs": self.obs, "kernel": self.kernel}

    def priority(self, scores: Scores) -> Tensor:
        pos = torch.where(scores.valid, scores.positions, torch.iinfo(torch.long).max)
        order = pos.argsort(-1)  # held tokens in position order, empty slots last
        s = torch.where(scores.valid, scores.key_sum, 0.0).gather(-1, order)
        pooled = torch.nn.functional.max_pool1d(s.flatten(0, 1).unsqueeze(1), self.kernel, stride=1,
                                                padding=self.kernel // 2).view_as(s)
        return torch.empty_like(pooled).scatter_(-1, order, pooled)
