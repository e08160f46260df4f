"""K-norm: keep the keys of smallest L2 norm (Devoto et al., "A Simple and Effective L2
Norm-Based Strategy for KV Cache Compression", arXiv 2406.11430; kvpress's ``KnormPress``).

Per (layer, head), after a commit, the ``budget`` kept are the sinks, the chunk just committed
and the held keys of lowest norm (averaged over the batch); the keys of highest norm leave
first. Keys only: no queries are needed, so attention may run in any kernel. A key's norm is
computed once, when its span commits, and kept per slot (:class:`~.scored.KeptNorms`): a commit
costs its span, not the history.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .scored import KeptNorms, Scores

__all__ = ["KNorm"]


class KNorm(KeptNorms):
    """Lowest key norm kept; ``budget`` as :class:`~streamkv.policies.scored.FixedBudget`."""

    name = "knorm"

    def priority(self, scores: Scores) -> Tensor:
        new = scores.span_keys().to(self.norms.dtype).norm(dim=-1).mean(2)  # [L, H, n]
        return -self.norms.scatter(-1, scores.span_slots, new)

    def on_commit(self, evict: Tensor, priority: Tensor, valid: Tensor, scores: Scores) -> None:
        self.norms.copy_(torch.where(valid & ~evict, -priority, 0.0))
