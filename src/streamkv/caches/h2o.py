"""An H2O-style cache: a fixed token budget per head, filled with the heavy hitters of
*accumulated* attention (Zhang et al., "H2O: Heavy-Hitter Oracle", arXiv 2306.14048).

A baseline for the mass budget, built on :class:`~streamkv.caches.mass.MassBudgetCache`'s
slot machinery (per-(layer, head) slot sets, ``index_put_`` writes, masked physical-order
attention, nothing retained ever moves). Only the selection differs:

- every committed chunk adds, to each cached token ``j`` of each (layer, head), the sum
  over the chunk's queries (and the batch) of ``p_ij``, the softmax over the slots the
  head holds at that moment (exact, blockwise, as the mass cache scores). A token's
  score is the attention it has received from every query since it entered the cache;
  a slot's score restarts at 0 when a new token takes the slot;
- after the commit each head keeps ``budget`` tokens: the sinks (positions ``< sink``)
  and the chunk just committed are protected; the remaining ``budget - protected``
  places go to the other cached tokens with the **highest accumulated score** (ties:
  the newer position first); everything else is evicted.

So during chunk ``c`` a head attends over at most ``budget + chunk`` tokens. There is
no dropped-mass guarantee of any kind: H2O controls a sum over past queries, not the
mass any one query loses. (H2O itself keeps a fixed heavy-hitter budget plus a recent
window; here the recent part is the protected newest chunk.)

``tau``, ``protect_newest`` and overflows of the mass cache do not apply: the budget is
checked at construction so that the next chunk always fits (``budget <= sink + window -
chunk``), so ``report()["overflow_total"]`` stays 0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .base import _index
from .mass import MassBudgetCache

__all__ = ["H2OCache"]


class H2OCache(MassBudgetCache):
    """Accumulated-attention heavy hitters with a fixed per-head budget. See the module docstring.

    Args:
        k_shape, v_shape, seq_dim, sink, window, chunk, head_dim, score_block, num_layers,
            dtype, device, buffers: as for :class:`~streamkv.caches.mass.MassBudgetCache`.
        budget: tokens each (layer, head) keeps after a commit, sinks and the newest chunk
            included; ``sink + chunk <= budget <= sink + window - chunk``. Default: the
            largest, ``sink + window - chunk``.

    Raises:
        TypeError: ``budget`` is not an int.
        ValueError: ``budget`` outside ``[sink + chunk, sink + window - chunk]``.
    """

    _EXTRA = MassBudgetCache._EXTRA + ("_acc",)

    def __init__(
        self,
        k_shape,
        v_shape,
        *,
        seq_dim: int,
        sink: int,
        window: int,
        chunk: int,
        budget: int | None = None,
        head_dim: int | None = None,
        score_block: int = 256,
        num_layers: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        buffers: tuple[Tensor, Tensor] | None = None,
    ) -> None:
        if budget is None and all(isinstance(x, int) for x in (sink, window, chunk)):
            budget = sink + window - chunk
        budget = _index("budget", budget)
        if isinstance(sink, int) and isinstance(window, int) and isinstance(chunk, int):
            lo, hi = sink + chunk, sink + window - chunk
            if not lo <= budget <= hi:
                raise ValueError(
                    f"budget must hold the {sink} sink(s) and the newest chunk ({chunk}) and leave room for the next "
                    f"chunk in sink + window = {sink + window} slots: {lo} <= budget <= {hi}, got {budget}"
                )
        # the mass cache's tau is unused here; any valid value passes its checks
        super().__init__(
            k_shape, v_shape, seq_dim=seq_dim, sink=sink, window=window, chunk=chunk, tau=0.5,
            head_dim=head_dim, protect_newest=True, score_block=score_block, num_layers=num_layers,
            dtype=dtype, device=device, buffers=buffers,
        )
        self.tau = None  # type: ignore[assignment]  # no mass budget: fail loudly if anything reads it
        self.budget = budget
        self._acc = torch.zeros((self.num_layers, self.heads, self.layout.capacity), dtype=torch.float64,
                                device=self.device)

    def _extra_config(self) -> dict[str, Any]:
        return {"budget": self.budget, "head_dim": self.head_dim}

    # ------------------------------------------------------------ lifecycle
    def _reserve(self, chunk_idx: int) -> None:
        super()._reserve(chunk_idx)
        self._acc.scatter_(-1, self._slots, 0.0)  # new tokens start with no received attention

    def _reopen(self, chunk_idx: int) -> None:
        # the rewritten chunk's own score restarts; scores it gave other tokens at its first
        # commit stay (H2O has no way to take them back)
        super()._reopen(chunk_idx)
        self._acc.scatter_(-1, self._slots, 0.0)

    def _on_reset(self) -> None:
        super()._on_reset()
        self._acc.zero_()

    # ------------------------------------------------------------- scoring
    @property
    def accumulated(self) -> Tensor:
        """Device ``float64 [num_layers, heads, capacity]``: each slot's accumulated attention
        (0 on empty slots). The cache's own tensor; do not mutate it."""
        return self._acc

    def _select(self, layer: int, m: Tensor, chunk_idx: int) -> Tensor:
        """Add this chunk's attention to the scores, then evict all but the budget ``[H, cap]``."""
        _, received = self.key_mass(layer)  # sum over the chunk's queries, under the current cache
        pos = self._slot_pos[layer]  # [H, cap]
        valid = pos >= 0
        acc = torch.where(valid, self._acc[layer] + received, 0.0)
        self._acc[layer] = acc
        S, C = self.layout.sink, self.layout.chunk
        protected = valid & ((pos < S) | (pos >= self.layout.chunk_start(chunk_idx)))
        cand = valid & ~protected
        cap = pos.shape[-1]
        # candidates by (score desc, position desc); non-candidates last
        by_pos = torch.where(cand, pos, -1).argsort(dim=-1, descending=True, stable=True)
        key = torch.where(cand, acc, -torch.inf).gather(-1, by_pos)
        order = by_pos.gather(-1, key.argsort(dim=-1, descending=True, stable=True))
        n_cand = cand.sum(-1)
        n_keep = (self.budget - protected.sum(-1)).clamp(min=0)
        n_evict = (n_cand - n_keep).clamp(min=0)
        # the budget leaves room for the next chunk by construction; keep the mass cache's
        # overflow accounting anyway in case a state was loaded from elsewhere
        free_win = (~valid[:, S:]).sum(-1)
        need = (C - free_win - n_evict).clamp(min=0)
        n_evict = torch.minimum(n_evict + need, n_cand)
        keep_sorted = torch.arange(cap, device=pos.device) < (n_cand - n_evict).unsqueeze(-1)
        kept = torch.zeros_like(cand).scatter(-1, order, keep_sorted) & cand
        evict = cand & ~kept
        self._acc[layer] = torch.where(evict, 0.0, acc)  # an evicted token's score leaves with it
        self._overflows[layer] += (need > 0).long()
        self._evictions[layer] += n_evict
        self._last_max_dropped[layer] = (m * evict).sum(-1)
        return evict

    def report(self) -> dict[str, Any]:
        """As :meth:`MassBudgetCache.report`, with ``budget`` instead of ``tau``."""
        out = super().report()
        out.pop("tau", None)
        return {"budget": self.budget, **out}
