"""H2O: a fixed per-head budget filled with the heavy hitters of *accumulated* attention
(Zhang et al., "H2O: Heavy-Hitter Oracle", arXiv 2306.14048), as a baseline.

Every commit adds, to each cached token of each (layer, head), the attention the chunk's
queries (and the batch) gave it (``sum_i p_ij``, the softmax over the head's slots then). A
token's score is what it has received since it entered the cache (it restarts at 0 when a
new token takes the slot, or the chunk is rewritten). After the commit each head keeps its
``budget`` (sinks and the chunk just committed are protected; the rest go to the highest
scores, newer first on ties). There is no dropped-mass guarantee: H2O controls a sum over
past queries, not the mass any one query loses. (H2O keeps a heavy-hitter budget plus a
recent window; here the recent part is the protected newest chunk.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..layout import CacheLayout
from ..storage import KVStorage
from .scored import FixedBudget

__all__ = ["H2O"]


class H2O(FixedBudget):
    """Accumulated-attention heavy hitters; ``budget`` as :class:`~streamkv.policies.scored.FixedBudget`."""

    name = "h2o"

    def bind(self, storage: KVStorage, layout: CacheLayout) -> None:
        super().bind(storage, layout)
        self.accumulated = torch.zeros_like(self._key_sum)  # [L, H, cap]

    def priority(self, key_max: Tensor, key_sum: Tensor, valid: Tensor) -> Tensor:
        return torch.where(valid, self.accumulated + key_sum, 0.0)

    def on_commit(self, evict: Tensor, priority: Tensor, valid: Tensor) -> None:
        self.accumulated.copy_(torch.where(evict | ~valid, 0.0, priority))  # a leaving token's score leaves with it

    def on_new(self, slots: Tensor) -> None:
        self.accumulated.scatter_(-1, slots, 0.0)

    def reset(self) -> None:
        super().reset()
        self.accumulated.zero_()

    def state(self) -> dict[str, Tensor]:
        return {**super().state(), "accumulated": self.accumulated}
