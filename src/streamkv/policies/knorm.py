"""K-norm: keep the keys of smallest L2 norm (Devoto et al., "A Simple and Effective L2
Norm-Based Strategy for KV Cache Compression", arXiv 2406.11430; kvpress's ``KnormPress``).

Per (layer, head), after a commit, the ``budget`` kept are the sinks, the chunk just committed
and the held keys of lowest norm (averaged over the batch); the keys of highest norm leave
first. Keys only: no queries are needed, so attention may run in any kernel.
"""

from __future__ import annotations

from torch import Tensor

from .scored import FixedBudget, Scores

__all__ = ["KNorm"]


class KNorm(FixedBudget):
    """Lowest key norm kept; ``budget`` as :class:`~streamkv.policies.scored.FixedBudget`."""

    name = "knorm"
    needs_queries = False

    def priority(self, scores: Scores) -> Tensor:
        return -scores.keys().double().norm(dim=-1).mean(2)
