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
key's dot product with it): two reductions per layer, each key widened to the norms' dtype
(float32 for a 16-bit cache) as it is read. On the CPU, layers of at least :data:`COMPILE_MIN`
key elements run both in one compiled kernel (no widened copy of the history; at 15,600 bf16
keys of 128 channels 0.54 ms, where bf16 matrix-vector products took 5 ms and rounded the
anchor to bf16); smaller ones run the same ops eagerly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..compiled import compile_kernel, may_compile
from .scored import KeptNorms, Scores

__all__ = ["KeyDiff"]

_EPS = 1e-12  # torch.nn.functional.normalize's floor on a norm
#: key elements per layer from which a CPU commit computes the cosines compiled
COMPILE_MIN = 1 << 18
_COSINES: list = []


def _cosines(k: Tensor, inv: Tensor, norms: Tensor, count: Tensor) -> Tensor:
    """Each held key's cosine with the mean unit key, ``[H, R, cap]`` in ``inv``'s dtype: keys
    ``[H, R, cap, D]``, ``inv`` their inverse norms (0 where a slot is empty), ``norms`` their
    norms, ``count`` the held keys per head ``[H, 1, 1]``."""
    wide = k.to(inv.dtype)
    anchor = (wide * inv.unsqueeze(-1)).sum(-2) / count  # [H, R, D]: the mean unit key
    dots = (wide * anchor.unsqueeze(-2)).sum(-1)  # [H, R, cap]
    return dots / (norms.clamp(min=_EPS) * anchor.norm(dim=-1, keepdim=True)).clamp(min=1e-8)


def cosines(k: Tensor, inv: Tensor, norms: Tensor, count: Tensor) -> Tensor:
    """:func:`_cosines`, through its compiled kernel where one may run (see the module docstring)."""
    if may_compile(k, k.numel(), COMPILE_MIN):
        if not _COSINES:
            _COSINES.append(compile_kernel(_cosines, "keydiff_cosines"))
        if _COSINES[0] is not None:
            return _COSINES[0](k, inv, norms, count)
    return _cosines(k, inv, norms, count)


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
        count = held.sum(-1, keepdim=True).clamp(min=1).to(norms.dtype)  # [L, H, 1, 1]
        out = torch.empty(norms.shape, dtype=norms.dtype, device=norms.device)
        for layer in range(keys.shape[0]):  # one layer at a time
            out[layer] = cosines(keys[layer], inv[layer], norms[layer], count[layer])
        return -out.mean(2)

    def on_commit(self, evict: Tensor, priority: Tensor, valid: Tensor, scores: Scores) -> None:
        self.norms.copy_(torch.where((valid & ~evict).unsqueeze(2), scores.derived["norms"], 0.0))
