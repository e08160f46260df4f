"""H2O: a fixed per-head budget filled with the heavy hitters of *accumulated* attention
(Zhang et al., "H2O: Heavy-Hitter Oracle", arXiv 2306.14048), as a baseline.

Every commit adds, to each cached token of each (layer, head), the attention the chunk's
queries (and the batch) gave it (``sum_i p_ij``, the softmax over the head's slots then). A
token's score is what it has received since it entered the cache (it restarts at 0 when a
new token takes the slot, or the chunk is rewritten; a reopened chunk's commit replaces what its
first commit added, not adds to it). After the commit each head keeps its
``budget`` (sinks and the chunk just committed are protected; the rest go to the highest
scores, newer first on ties). There is no dropped-mass guarantee: H2O controls a sum over
past queries, not the mass any one query loses. (H2O keeps a heavy-hitter budget plus a
recent window; here the recent part is the protected newest chunk.)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..layout import CacheLayout
from ..storage import KVStorage
from .scored import FixedBudget, Scores, check_scores

__all__ = ["H2O"]


class H2O(FixedBudget):
    """Accumulated-attention heavy hitters; ``budget`` as :class:`~streamkv.policies.scored.FixedBudget`."""

    name = "h2o"
    cache_properties = ("budget", "accumulated")

    def bind(self, storage: KVStorage, layout: CacheLayout, lifecycle) -> None:
        super().bind(storage, layout, lifecycle)
        #: device ``float64 [num_layers, heads, capacity]``: each slot's accumulated attention
        self.accumulated = torch.zeros_like(self._key_sum)
        #: the accumulated attention before the last commit (what a reopen of its chunk returns to)
        self.before_commit = torch.zeros_like(self._key_sum)

    def priority(self, scores: Scores) -> Tensor:
        return torch.where(scores.valid, self.accumulated + scores.key_sum, 0.0)

    def on_commit(self, evict: Tensor, priority: Tensor, valid: Tensor, scores: Scores) -> None:
        self.before_commit.copy_(self.accumulated)
        self.accumulated.copy_(torch.where(evict | ~valid, 0.0, priority))  # a leaving token's score leaves with it

    def on_reopen(self) -> None:
        self.accumulated.copy_(self.before_commit)  # the chunk's first queries no longer count

    def on_new(self, slots: Tensor) -> None:
        self.accumulated.scatter_(-1, slots, 0.0)

    def reset(self) -> None:
        super().reset()
        self.accumulated.zero_()
        self.before_commit.zero_()

    def state(self) -> dict[str, Tensor]:
        return {**super().state(), "accumulated": self.accumulated, "before_commit": self.before_commit}

    def check_state(self, state: dict[str, Any], end: int, span: int, is_open: bool) -> None:
        super().check_state(state, end, span, is_open)
        for name in ("accumulated", "before_commit"):
            acc = state[name]
            if not self.check_finite:  # a kept token with a non-finite score holds -inf (it leaves first next)
                acc = torch.where(acc == -math.inf, math.inf, acc)
            check_scores(f"state dict of a {self.name} cache at end={end}", name, acc, finite=self.check_finite)
