"""KeyDiff: keep the keys least like the others (Park et al., "KeyDiff: Key Similarity-Based KV
Cache Eviction for Long-Context LLM Inference in Resource-Constrained Environments", arXiv
2504.15364; kvpress's ``KeyDiffPress``).

Per (layer, head), the anchor is the mean of the held keys after normalising each to unit
length; a key's score is minus its cosine similarity to the anchor (averaged over the batch).
After a commit the ``budget`` kept are the sinks, the chunk just committed and the highest
scores: the keys most like the anchor leave first. Keys only: no queries are needed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .scored import FixedBudget, Scores

__all__ = ["KeyDiff"]


class KeyDiff(FixedBudget):
    """Most distinctive keys kept; ``budget`` as :class:`~streamkv.policies.scored.FixedBudget`."""

    name = "keydiff"
    needs_queries = False

    def priority(self, scores: Scores) -> Tensor:
        unit = torch.nn.functional.normalize(scores.keys().double(), dim=-1)  # [L, H, R, cap, D]
        held = scores.valid[:, :, None, :, None]
        anchor = (unit * held).sum(3, keepdim=True) / held.sum(3, keepdim=True).clamp(min=1)
        return -torch.nn.functional.cosine_similarity(unit, anchor, dim=-1).mean(2)
