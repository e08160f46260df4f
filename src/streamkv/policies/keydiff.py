"""KeyDiff: keep the keys least like the others (Park et al., "KeyDiff: Key Similarity-Based KV
Cache Eviction for Long-Context LLM Inference in Resource-Constrained Environments", arXiv
2504.15364; kvpress's ``KeyDiffPress``).

Per (layer, head), the anchor is the mean of the held keys after normalising each to unit
length; a key's score is minus its cosine similarity to the anchor (averaged over the batch).
After a commit the ``budget`` kept are the sinks, the chunk just committed and the highest
scores: the keys most like the anchor leave first. Keys only: no queries are needed.

Cost: each key's norm is computed once, at its commit, and kept per slot (per batch row,
:class:`~.scored.KeptNorms`); the
anchor moves with every commit, so a commit reads every held key twice (the anchor, then each
key's dot product with it): two matrix-vector products per (layer, head) in the cache's dtype,
no copy of the history.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .scored import KeptNorms, Scores

__all__ = ["KeyDiff"]

_EPS = 1e-12  # torch.nn.functional.normalize's floor on a norm


class KeyDiff(KeptNorms):
    """Most distinctive keys kept; ``budget`` as :class:`~streamkv.policies.scored.FixedBudget`."""

    name = "keydiff"
    norms_per_row = True

    def priority(self, scores: Scores) -> Tensor:
        span = scores.span_keys()  # [L, H, R, n, D]
        slots = scores.span_slots.unsqueeze(2).expand(-1, -1, span.shape[2], -1)
        scores.derived["norms"] = norms = self.norms.scatter(-1, slots, span.to(self.norms.dtype).norm(dim=-1))
        keys = scores.keys()  # [L, H, R, cap, D]
        held = scores.valid.unsqueeze(2)  # [L, H, 1, cap]
        inv = torch.where(held, 1.0 / norms.clamp(min=_EPS), 0.0)
        out = torch.empty(norms.shape, dtype=norms.dtype, device=norms.device)
        for layer in range(keys.shape[0]):  # one layer at a time: matrix-vector products, no copy of the keys
            k = keys[layer]  # [H, R, cap, D]
            w = inv[layer].to(k.dtype).unsqueeze(-2)  # [H, R, 1, cap]
            count = held[layer].sum(-1, keepdim=True).clamp(min=1).to(norms.dtype)  # [H, 1, 1]
            anchor = (w @ k).to(norms.dtype) / count.unsqueeze(-1)  # [H, R, 1, D]: the mean unit key
            dots = (k @ anchor.to(k.dtype).transpose(-1, -2)).squeeze(-1).to(norms.dtype)  # [H, R, cap]
            cos = dots / (norms[layer].clamp(min=_EPS) * anchor.squeeze(-2).norm(dim=-1, keepdim=True)).clamp(min=1e-8)
            out[layer] = cos
        return -out.mean(2)

    def on_commit(self, evict: Tensor, priority: Tensor, valid: Tensor, scores: Scores) -> None:
        self.norms.copy_(torch.where((valid & ~evict).unsqueeze(2), scores.derived["norms"], 0.0))
