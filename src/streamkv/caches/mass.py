"""The streaming mass-budget cache: keep, per head, the fewest tokens whose attention mass
from the committed chunk's queries stays within a budget ``tau``.

Fixed capacity (``sink + window`` slots, allocated once). Each (layer, head) holds its own
set of positions; a slot ``s`` of head ``h`` holds position ``slot_positions[layer, h, s]``
(``-1`` empty). Sinks are pinned at slots ``[0, sink)`` of every head.

Lifecycle, per chunk ``c``::

    begin_chunk(c)    device: each (layer, head) takes the lowest free window slots for the
                      chunk's rows (sink rows go to their pinned slots); nothing moves
    write(k, v)       device: index_put_ into (slot, head) pairs: graph-capturable
    (the model hands over the chunk's rotated queries after every write; the last ones,
                      from the clean pass, are the chunk's queries)
    commit_chunk(c)   score and evict (below); frees slots; no retained token moves

Scoring (exact, blockwise): for every cached token ``j`` of head ``h``,
``m_j = max_i p_ij`` over the chunk's queries ``i`` (and the batch), where
``p_ij = exp(s_ij - lse_i)`` is the softmax over the head's occupied slots; query blocks
of ``score_block`` rows are processed at a time, so the full score matrix is never
materialised.

Selection: among the evictable tokens (not a sink, not the newest chunk), evict the
largest set ``D`` (lowest ``m`` first; ties by older position first) with
``sum_{j in D} m_j <= tau``. Since ``sum_{j in D} p_ij <= sum_{j in D} m_j`` for every
query ``i``, **every query of the scoring chunk keeps mass >= 1 - tau of the cache it
attended to**, hence its output moves by at most ``tau`` times the value range (the
kvbudget bound) because of this eviction. Scope: the guarantee covers those queries and
that eviction only. Future queries may weigh evicted tokens more (the "holdout" mass the
experiments report), and the error against full-history attention accumulates over
evictions.

If the budget frees fewer than ``chunk`` slots for the next chunk, more tokens are evicted
(lowest ``m`` next) to make room: an *overflow*, counted per (layer, head) in
:meth:`report`, where the guarantee above does not hold for that eviction. Size the
window so that overflows do not happen at your ``tau``.

Attention reads the buffer in physical order with a per-head validity bias
(``occupancy="mask"``): exact for unmasked attention with RoPE applied before the write.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..attention import valid_bias
from .base import KVCache, _index

__all__ = ["MassBudgetCache"]


class MassBudgetCache(KVCache):
    """Per-head mass-budgeted cache. See the module docstring.

    Args:
        k_shape, v_shape, seq_dim, num_layers, dtype, device, buffers: as for
            :class:`~streamkv.caches.base.KVCache`. ``k_shape[seq_dim]`` is the capacity
            ``sink + window``.
        sink: pinned positions (never evicted).
        window: slots for everything else (the budget's room; not a recency window).
        chunk: tokens per chunk.
        tau: the dropped-mass budget per eviction, in (0, 1).
        head_dim: the head dimension of ``k_shape``; it must be the last dimension other
            than the token and feature dimensions (``[B, T, H, D]`` or ``[B, H, T, D]``).
            Default: the dimension just before the features, unless that is the token
            dimension, in which case the one before it.
        protect_newest: never evict the chunk just committed (default True).
        score_block: query rows scored at a time.

    Raises:
        ValueError: ``tau`` outside (0, 1); a capacity smaller than the sinks plus the
            chunks that must fit (the newest, if protected, and the next).
    """

    physical_order_valid = True
    valid_is_prefix = False
    graph_safe_writes = True
    observes_queries = True
    retains_window = False

    def __init__(
        self,
        k_shape,
        v_shape,
        *,
        seq_dim: int,
        sink: int,
        window: int,
        chunk: int,
        tau: float,
        head_dim: int | None = None,
        protect_newest: bool = True,
        score_block: int = 256,
        num_layers: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        buffers: tuple[Tensor, Tensor] | None = None,
    ) -> None:
        from ..budget.mass import check_tau

        tau = check_tau(tau)
        if not isinstance(protect_newest, bool):
            raise TypeError(f"protect_newest must be a bool, got {protect_newest!r}")
        score_block = _index("score_block", score_block)
        if score_block < 1:
            raise ValueError(f"score_block must be >= 1, got {score_block}")
        need = chunk * (2 if protect_newest else 1)
        if isinstance(window, int) and isinstance(chunk, int) and window < need:
            raise ValueError(
                f"window ({window}) must hold {'the newest chunk and ' if protect_newest else ''}the next chunk: "
                f">= {need} slots besides the {sink} sink(s) (capacity >= {sink + need}), got capacity {sink + window}"
            )
        super().__init__(
            k_shape, v_shape, seq_dim=seq_dim, sink=sink, window=window, chunk=chunk,
            num_layers=num_layers, dtype=dtype, device=device, buffers=buffers,
        )
        rank = len(self.k_shape)
        others = [d for d in range(rank - 1) if d != self.seq_dim]
        if head_dim is None:
            head = others[-1]
        else:
            head_dim = _index("head_dim", head_dim)
            if not -rank <= head_dim < rank:
                raise ValueError(f"head_dim must index a dim of a rank-{rank} shape, got {head_dim}")
            head = head_dim % rank
        if head != others[-1]:
            raise ValueError(
                f"head_dim must be the last dim other than the token (seq_dim={self.seq_dim}) and feature dims, "
                f"i.e. {others[-1]} for k_shape {self.k_shape}; got {head}"
            )
        self.head_dim = head
        self.heads = self.k_shape[head]
        self.tau = tau
        self.protect_newest = protect_newest
        self.score_block = score_block
        L, H, cap, C, dev = num_layers, self.heads, self.layout.capacity, chunk, self.device
        # per (layer, head) slot contents; replaces the base class's shared [capacity] tensor
        self._slot_pos = torch.full((L, H, cap), -1, dtype=torch.long, device=dev)
        self._slots = torch.zeros((L, H, C), dtype=torch.long, device=dev)  # write slots of the open chunk
        self._heads_idx = torch.arange(H, device=dev).expand(C, H)  # [C, H] head of each (row, head)
        self._arange_c = torch.arange(C, device=dev)
        self._window_idx = torch.arange(sink, cap, device=dev)
        q_shape = self._chunk_shape_k
        self._queries = torch.zeros((L, *q_shape), dtype=dtype, device=dev)
        # reporting state (device tensors; read on report())
        self._overflows = torch.zeros((L, H), dtype=torch.long, device=dev)
        self._evictions = torch.zeros((L, H), dtype=torch.long, device=dev)
        self._last_max_dropped = torch.zeros((L, H), dtype=torch.float64, device=dev)
        self._last_kept_mass: Tensor | None = None  # [L, H, queries] of the last commit

    # ------------------------------------------------------------- helpers
    def _perm(self) -> list[int]:
        """Dim order (token, head, others..., feature) of a per-layer tensor."""
        rank = len(self.k_shape)
        rest = [d for d in range(rank - 1) if d not in (self.seq_dim, self.head_dim)]
        return [self.seq_dim, self.head_dim, *rest, rank - 1]

    def _extra_config(self) -> dict[str, Any]:
        return {"tau": self.tau, "head_dim": self.head_dim, "protect_newest": self.protect_newest}

    _EXTRA = ("_slots", "_queries", "_overflows", "_evictions", "_last_max_dropped")

    def _extra_state(self) -> dict[str, Any]:
        return {name.lstrip("_"): getattr(self, name) for name in self._EXTRA}

    def _check_extra_state(self, state: dict[str, Any]) -> None:
        for name in self._EXTRA:
            key, buf = name.lstrip("_"), getattr(self, name)
            t = state.get(key)
            if not isinstance(t, Tensor) or t.shape != buf.shape or t.dtype != buf.dtype:
                desc = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"state dict {key} must be a {tuple(buf.shape)} {buf.dtype} tensor, got {desc}")

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        for name in self._EXTRA:
            getattr(self, name).copy_(state[name.lstrip("_")])
        self._last_kept_mass = None

    # ------------------------------------------------------------ lifecycle
    def _reserve(self, chunk_idx: int) -> None:
        """Take the lowest free window slots of every (layer, head) for the chunk's rows."""
        S, C = self.layout.sink, self.layout.chunk
        start = self.layout.chunk_start(chunk_idx)
        pos = self._arange_c + start  # [C]
        n_sink_rows = max(0, min(S - start, C))
        n_win_rows = C - n_sink_rows
        if n_sink_rows:
            self._slots[:, :, :n_sink_rows] = pos[:n_sink_rows]
        if n_win_rows:
            win = self._slot_pos[:, :, S:]  # [L, H, W]
            w = win.shape[-1]
            key = torch.where(win < 0, self._window_idx - S, self._window_idx - S + w)
            first_free = key.topk(n_win_rows, dim=-1, largest=False, sorted=True).indices  # [L, H, n]
            self._slots[:, :, n_sink_rows:] = first_free + S
        self._slot_pos.scatter_(-1, self._slots, pos.expand_as(self._slots))

    def _write(self, layer: int, k: Tensor, v: Tensor) -> None:
        perm = self._perm()
        idx = (self._slots[layer].transpose(0, 1), self._heads_idx)  # [C, H] each
        self._k[layer].permute(perm).index_put_(idx, k.permute(perm))
        self._v[layer].permute(perm).index_put_(idx, v.permute(perm))

    def observe_queries(self, q: Tensor, layer: int | None = None) -> None:
        layer = self._check_layer(layer)
        self._check_chunk_tensor("q", q, self._chunk_shape_k)
        self._queries[layer].copy_(q)

    def _reopen(self, chunk_idx: int) -> None:
        # the chunk's slots are unchanged; re-mark them in case it was evicted (protect_newest=False)
        pos = self._arange_c + self.layout.chunk_start(chunk_idx)
        self._slot_pos.scatter_(-1, self._slots, pos.expand_as(self._slots))

    def _on_commit(self, chunk_idx: int) -> None:
        occupied = [self._slot_pos[layer] >= 0 for layer in range(self.num_layers)]
        masses = [self.key_mass(layer, occ)[0] for layer, occ in enumerate(occupied)]
        # one host sync per commit: refuse to evict on NaN/inf scores (nothing changed yet)
        finite = torch.stack([torch.isfinite(m).all() for m in masses]).all()
        if not bool(finite):
            bad = [layer for layer, m in enumerate(masses) if not bool(torch.isfinite(m).all())]
            raise ValueError(
                f"attention masses of chunk {chunk_idx} are not finite in layer(s) {bad}: NaN or inf in the "
                f"cached keys or the observed queries; the chunk stays open and nothing was evicted"
            )
        kept_mass = []
        for layer, (occ, m) in enumerate(zip(occupied, masses)):
            evict = self._select(layer, m, chunk_idx)
            kept_mass.append(self.query_kept_mass(layer, occ, occ & ~evict))
            self._notify_evict(chunk_idx, (layer,), evict)
            self._slot_pos[layer].masked_fill_(evict, -1)
        self._last_kept_mass = torch.stack(kept_mass)

    def _on_reset(self) -> None:
        self._overflows.zero_()
        self._evictions.zero_()
        self._last_max_dropped.zero_()
        self._last_kept_mass = None

    # ------------------------------------------------------------- scoring
    def _scores_blocks(self, layer: int, occupied: Tensor):
        """Yield ``(scores, lse)`` for blocks of the observed queries against the slots of
        ``layer``: ``scores [..., H, bq, cap]`` (``-inf`` where ``occupied [H, cap]`` is
        False), ``lse [..., H, bq]``."""
        seq = self.seq_dim
        acc = torch.promote_types(self.dtype, torch.float32)
        k = self._k[layer].movedim(seq, -2).to(acc)  # [..., H, cap, D]
        q = self._queries[layer].movedim(seq, -2).to(acc)  # [..., H, C, D]
        bias = valid_bias(torch.where(occupied, 0, -1), acc)  # [H, 1, cap]
        scale = 1.0 / math.sqrt(q.shape[-1])
        for start in range(0, q.shape[-2], self.score_block):
            s = q[..., start : start + self.score_block, :] @ k.transpose(-1, -2) * scale + bias
            yield s, torch.logsumexp(s, dim=-1)

    def key_mass(self, layer: int, occupied: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Per-key attention mass of the observed queries (exact, blockwise), under the
        softmax over the ``occupied`` slots (default: the occupied slots now).

        Returns ``(max, sum)``: ``float64 [H, capacity]`` each, the max and the sum over
        queries (and batch) of ``p_ij``; 0 on unoccupied slots.
        """
        if occupied is None:
            occupied = self._slot_pos[layer] >= 0
        heads, cap = self.heads, self.layout.capacity
        mmax = torch.zeros((heads, cap), dtype=torch.float64, device=self.device)
        msum = torch.zeros((heads, cap), dtype=torch.float64, device=self.device)
        for s, lse in self._scores_blocks(layer, occupied):
            p = torch.exp(s - lse.unsqueeze(-1)).to(torch.float64)  # [..., H, bq, cap]
            p = p.reshape(-1, heads, *p.shape[-2:])
            mmax = torch.maximum(mmax, p.amax(dim=(0, 2)))
            msum += p.sum(dim=(0, 2))
        return mmax, msum

    def query_kept_mass(self, layer: int, occupied: Tensor, kept: Tensor) -> Tensor:
        """Mass each observed query puts on the ``kept`` slots under its softmax over the
        ``occupied`` slots: ``float64 [H, queries]`` (queries = batch x chunk rows)."""
        heads = self.heads
        out = []
        for s, lse in self._scores_blocks(layer, occupied):
            p = torch.exp(s - lse.unsqueeze(-1)).to(torch.float64)
            km = (p * kept.unsqueeze(-2)).sum(-1)  # [..., H, bq]
            out.append(km.reshape(-1, heads, km.shape[-1]).transpose(0, 1).reshape(heads, -1))
        return torch.cat(out, dim=-1)

    def _select(self, layer: int, m: Tensor, chunk_idx: int) -> Tensor:
        """The eviction set ``[H, capacity]`` (bool) for ``layer`` (see module docstring)."""
        S, C = self.layout.sink, self.layout.chunk
        pos = self._slot_pos[layer]  # [H, cap]
        valid = pos >= 0
        protected = pos < S
        if self.protect_newest:
            protected = protected | (pos >= self.layout.chunk_start(chunk_idx))
        cand = valid & ~protected
        cap = pos.shape[-1]
        # order candidates by (mass, position) ascending; others last
        by_pos = torch.where(cand, pos, torch.iinfo(torch.long).max).argsort(dim=-1, stable=True)
        key = torch.where(cand, m, torch.inf).gather(-1, by_pos)
        sorted_m, order = key.sort(dim=-1, stable=True)
        order = by_pos.gather(-1, order)
        within = sorted_m.cumsum(-1) <= self.tau  # inf (non-candidates) never within
        n_tau = within.sum(-1)
        free_win = (~valid[:, S:]).sum(-1)
        need = (C - free_win - n_tau).clamp(min=0)
        n_evict = torch.minimum(n_tau + need, cand.sum(-1))
        evict_sorted = torch.arange(cap, device=m.device) < n_evict.unsqueeze(-1)
        evict = torch.zeros_like(cand).scatter(-1, order, evict_sorted)
        self._overflows[layer] += (need > 0).long()
        self._evictions[layer] += n_evict
        self._last_max_dropped[layer] = (m * evict).sum(-1)
        return evict

    # -------------------------------------------------------------- reading
    @property
    def slot_positions(self) -> Tensor:
        """Device ``int64 [num_layers, heads, capacity]`` (``-1`` empty)."""
        return self._slot_pos

    def layer_slot_positions(self, layer: int | None = None) -> Tensor:
        return self._slot_pos[self._check_layer(layer)]

    @property
    def write_slots(self) -> Tensor:
        """Device ``int64 [num_layers, heads, chunk]``: the open chunk's slots."""
        return self._slots

    @property
    def all_valid(self) -> bool:
        """Always False: heads are ragged, attention uses the validity mask."""
        return False

    @property
    def num_valid(self) -> int:
        """Most occupied slots of any (layer, head). Synchronises; for inspection."""
        return int((self._slot_pos >= 0).sum(-1).max())

    def valid_mask(self) -> Tensor:
        return self._slot_pos >= 0

    def valid_keys(self, layer: int | None = None) -> Tensor:
        raise RuntimeError("MassBudgetCache has no valid prefix (heads hold different slots); use keys() with the mask")

    valid_values = valid_keys

    def chronological_positions(self, layer: int | None = None) -> Tensor:
        """``int64 [heads, n]``: each head's positions in order, ``-1``-padded to the
        largest count ``n``."""
        pos = self._slot_pos[self._check_layer(layer)]
        key = torch.where(pos >= 0, pos, torch.iinfo(torch.long).max)
        ordered = key.sort(dim=-1).values
        n = int((pos >= 0).sum(-1).max())
        out = ordered[:, :n]
        return torch.where(out == torch.iinfo(torch.long).max, -1, out)

    def _chrono_gather(self, buf: Tensor, layer: int) -> Tensor:
        big = torch.iinfo(torch.long).max
        pos = self._slot_pos[layer]
        key = torch.where(pos >= 0, pos, big)
        n = int((pos >= 0).sum(-1).max())
        order = key.argsort(dim=-1)[:, :n].transpose(0, 1)  # [n, H]: slots in position order
        pad = (key.gather(-1, order.transpose(0, 1)) == big).transpose(0, 1)  # [n, H]
        perm = self._perm()
        g = buf.permute(perm)[order, self._heads_idx[:1].expand(n, -1)]  # [n, H, ..., D]
        g = g.masked_fill(pad.view(*pad.shape, *([1] * (g.dim() - 2))), 0)
        return g.permute([perm.index(d) for d in range(len(perm))])

    def chronological_keys(self, layer: int | None = None) -> Tensor:
        """Each head's keys in position order, zero-padded at the end to the largest count
        (see :meth:`chronological_positions`). The attention path for this cache is the
        physical one with the validity mask."""
        layer = self._check_layer(layer)
        return self._chrono_gather(self._k[layer], layer)

    def chronological_values(self, layer: int | None = None) -> Tensor:
        layer = self._check_layer(layer)
        return self._chrono_gather(self._v[layer], layer)

    def chronological_slots(self) -> list[int]:
        raise RuntimeError("MassBudgetCache heads hold different slots: use chronological_positions(layer)")

    # ------------------------------------------------------------- report
    def report(self) -> dict[str, Any]:
        """Per (layer, head): kept tokens, evictions, overflows; the last commit's kept mass
        of its queries (max/mean/p95 of the dropped side too). Synchronises."""
        kept = (self._slot_pos >= 0).sum(-1)
        out: dict[str, Any] = {
            "tau": self.tau,
            "capacity": self.layout.capacity,
            "kept_tokens": kept.tolist(),
            "kept_tokens_mean": float(kept.float().mean()),
            "evicted_total": int(self._evictions.sum()),
            "overflows": self._overflows.tolist(),
            "overflow_total": int(self._overflows.sum()),
            "last_max_dropped_bound": self._last_max_dropped.tolist(),
        }
        if self._last_kept_mass is not None:
            km = self._last_kept_mass.double()
            out["last_kept_mass_min"] = float(km.min())
            out["last_kept_mass_mean"] = float(km.mean())
            out["last_kept_mass_p05"] = float(km.flatten().quantile(0.05))
        return out
