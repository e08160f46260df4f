"""K-norm: keep the keys of smallest L2 norm (Devoto et al., "A Simple and Effective L2
Norm-Based Strategy for KV Cache Compression", arXiv 2406.11430; kvpress's ``KnormPress``).

Per (layer, head), after a commit, the ``budget`` kept are the sinks, the chunk just committed
and the held keys of lowest norm (averaged over the batch); the keys of highest norm leave
first. Keys only: no queries are needed, so attention may run in any kernel. A key's norm is
computed once, when its span commits, and kept per slot (:attr:`norms`): a commit costs its
span, not the history.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..layout import CacheLayout
from ..storage import KVStorage
from .scored import FixedBudget, Scores, check_scores

__all__ = ["KNorm"]


class KNorm(FixedBudget):
    """Lowest key norm kept; ``budget`` as :class:`~streamkv.policies.scored.FixedBudget`."""

    name = "knorm"
    needs_queries = False

    def bind(self, storage: KVStorage, layout: CacheLayout, lifecycle) -> None:
        super().bind(storage, layout, lifecycle)
        #: ``[L, H, capacity]``: each held key's L2 norm, averaged over the batch (set at its commit)
        self.norms = torch.zeros((storage.num_layers, storage.heads, storage.capacity),
                                 dtype=torch.promote_types(storage.dtype, torch.float32), device=storage.device)

    def priority(self, scores: Scores) -> Tensor:
        new = scores.span_keys().to(self.norms.dtype).norm(dim=-1).mean(2)  # [L, H, n]
        return -self.norms.scatter(-1, scores.span_slots, new)  # out of place: a refused commit changes nothing

    def on_commit(self, evict: Tensor, priority: Tensor, valid: Tensor, scores: Scores) -> None:
        self.norms.copy_(torch.where(valid & ~evict, -priority, 0.0))

    def reset(self) -> None:
        super().reset()
        self.norms.zero_()

    def state(self) -> dict[str, Tensor]:
        return {**super().state(), "norms": self.norms}

    def check_state(self, state: dict[str, Any], end: int, span: int, is_open: bool) -> None:
        super().check_state(state, end, span, is_open)
        check_scores(f"state dict of a {self.name} cache at end={end}", "norms", state["norms"],
                     finite=self.check_finite)
