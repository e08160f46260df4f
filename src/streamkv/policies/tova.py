"""TOVA: keep the tokens the newest queries attend to most (Oren et al., "Transformers are
Multi-State RNNs", arXiv 2401.06104).

TOVA drops, at every decoding step, the token with the lowest attention weight from the
current query. Here, chunk by chunk and per head: after a commit each (layer, head) keeps its
``budget`` — the sinks, the chunk just committed, and the tokens with the highest attention
from *this* chunk's queries (``sum_i p_ij`` over the chunk and the batch; ties: newer
first). With one-token chunks and ``protect_newest=False`` that is TOVA's rule exactly, per head
(by default the newest chunk is protected: a token stays at least one step). Unlike H2O nothing
accumulates: a token that the present stops looking at leaves, whatever it was worth
before. No dropped-mass guarantee (``dropped_mass_bound`` still reports what left).
"""

from __future__ import annotations

from torch import Tensor

from .scored import FixedBudget, Scores

__all__ = ["TOVA"]


class TOVA(FixedBudget):
    """Attention of the newest chunk; ``budget`` as :class:`~streamkv.policies.scored.FixedBudget`."""

    name = "tova"
    reads_protected_statistics = False  # sinks and a protected span never leave: their scores rank nothing

    def priority(self, scores: Scores) -> Tensor:
        return scores.key_sum
