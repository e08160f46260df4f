"""The recording harness: any cache through a stream, measured against its whole history.

A :class:`Recorder` observes a cache (:class:`~streamkv.caches.CacheObserver`) and keeps a
shadow of everything the stream has committed: per layer and head, the K/V of every position
in position order, and the queries of each chunk (the model hands them over with
``update(k, v, q)``). At every ``commit_chunk(c)`` it computes, exactly (float64, full
matrices: the shadow is small by construction), for every (layer, head) and every query
``i`` of chunk ``c`` (batch x chunk rows):

``resident``
    tokens the head held while chunk ``c`` attended (the chunk itself included): the memory
    the cache really used. ``kept``: tokens left after the commit.
scoring (the eviction at this commit, relative to the pre-eviction cache)
    ``dropped_i``: the mass query ``i`` put, under its softmax over the resident set, on the
    tokens this commit evicted (``kept mass = 1 - dropped``); ``err_evict_i = ||o_post -
    o_pre||_inf``: how far this eviction moved the query's output; bound ``tau *
    range(V_resident)`` where the cache has a ``tau`` and no overflow was counted for that
    (layer, head) at this commit.
against full-history attention (softmax over every committed position ``0 .. end``)
    ``missing_i``: the full-history mass outside the resident set, and ``err_attend_i =
    ||o_resident - o_full||_inf``: the error of the attention chunk ``c`` actually computed,
    with its exact bound ``missing_i * range(V_history)``; the same after the eviction
    (``missing_post``, ``err_post``). These accumulate over evictions: no single tau covers them.
``holdout``
    at commit ``c``, for the tokens evicted between chunk ``c-1``'s attention and chunk
    ``c``'s: the mass chunk ``c``'s queries put on them under the full-history softmax. It
    measures how well the scoring chunk's mass transfers to the next chunk: the tau guarantee
    does **not** cover it.
``oracle`` (optional, ``oracle_taus``)
    the seed's per-query :class:`~streamkv.budget.oracles.PerQueryMass` on the full history
    (sinks and the newest chunk protected): each query of chunk ``c`` keeps its own smallest
    set with mass ``>= 1 - tau``. No streaming cache can do better at that tau.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from streamkv.budget.mass import check_tau, kept_mass, kept_output
from streamkv.budget.oracles import PerQueryMass
from streamkv.caches import CacheObserver, Change, KVCache

__all__ = ["StepRecord", "Recorder"]


@dataclass
class StepRecord:
    """What one commit did to one layer (float64 / int64 CPU tensors).

    Per head ``[H]``: ``resident``, ``kept``, ``evicted`` (resident minus kept),
    ``overflow`` (bool; all False for caches without overflow accounting). Per head and
    query ``[H, Q]`` (``Q`` = batch x chunk): see the module docstring (``mass_resident``
    is the full-history mass on the resident set, summed like
    :func:`~streamkv.budget.mass.kept_mass`, to compare with the oracle); ``range_resident``
    and ``range_history`` are the L-infinity value ranges the bounds use. ``holdout`` /
    ``holdout_tokens`` are None at chunk 0. ``oracle[tau]`` holds ``count``,
    ``kept_mass``, ``err`` (``[H, Q]``) and ``union`` (``[H]``, tokens any query of the
    chunk keeps).
    """

    chunk: int
    layer: int
    history: int
    tau: float | None
    resident: Tensor
    kept: Tensor
    evicted: Tensor
    overflow: Tensor
    dropped: Tensor
    kept_mass_evict: Tensor
    err_evict: Tensor
    range_resident: Tensor
    missing: Tensor
    mass_resident: Tensor
    err_attend: Tensor
    missing_post: Tensor
    err_post: Tensor
    range_history: Tensor
    holdout: Tensor | None
    holdout_tokens: Tensor | None
    oracle: dict[float, dict[str, Tensor]] = field(default_factory=dict)


def _position_mask(pos: Tensor, n: int) -> Tensor:
    """``[H, cap]`` slot positions (-1 empty) -> ``[H, n]`` bool over stream positions."""
    if (pos >= n).any():
        raise RuntimeError(f"a slot holds position {int(pos.max())} beyond the committed history ({n})")
    idx = torch.where(pos >= 0, pos, n)
    m = torch.zeros((pos.shape[0], n + 1), dtype=torch.bool)
    m.scatter_(1, idx.cpu(), True)
    return m[:, :n]


def _value_range(v: Tensor, mask: Tensor) -> Tensor:
    """L-infinity value range over the masked tokens: ``v [B, H, N, D]``, ``mask [H, N]``
    -> ``[B, H]`` (max over channels of max - min)."""
    m = mask[None, :, :, None]
    hi = v.masked_fill(~m, -math.inf).amax(2)
    lo = v.masked_fill(~m, math.inf).amin(2)
    return (hi - lo).amax(-1)


def _per_head(x: Tensor) -> Tensor:
    """``[B, H, C]`` -> ``[H, B * C]``."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)


class Recorder(CacheObserver):
    """Record every commit of ``cache`` against its whole history (see the module docstring).

    Args:
        cache: any cache with a head dimension; the model must pass each layer's queries to
            ``update(k, v, q)``. A commit with a layer whose queries are missing raises
            ``RuntimeError`` before anything changes.
        oracle_taus: taus at which to evaluate the per-query oracle on the shadow history.
        scale: softmax scale of the attention (default ``1/sqrt(head feature size)``).

    ``records`` (a list of :class:`StepRecord`) describes the current stream; a reset of the
    cache clears it with the shadow.
    """

    def __init__(self, cache: KVCache, *, oracle_taus: Sequence[float] = (), scale: float | None = None) -> None:
        if cache.head_dim is None:
            raise ValueError(f"a recorder needs a head dimension in k_shape {cache.k_shape}")
        self.oracle_taus = tuple(check_tau(t, "oracle_taus entry") for t in oracle_taus)
        if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")
        self.cache, self.scale = cache, scale
        self.heads = cache.k_shape[cache.head_dim]
        self._clear()
        cache.add_observer(self)

    def _clear(self) -> None:
        L = self.cache.num_layers
        self._q: list[Tensor | None] = [None] * L
        self._q_chunk: list[int | None] = [None] * L
        self._hk: list[Tensor | None] = [None] * L
        self._hv: list[Tensor | None] = [None] * L
        self._pre_masks: list[dict[int, Tensor]] = [{} for _ in range(L)]
        self.records: list[StepRecord] = []

    # ------------------------------------------------------------------ hooks
    def on_reset(self, cache: KVCache) -> None:
        self._clear()

    def on_queries(self, cache: KVCache, layer: int, q: Tensor) -> None:
        self._q[layer] = q.detach().to("cpu", torch.float64, copy=True)
        self._q_chunk[layer] = cache.open_chunk

    def prepare(self, change: Change):
        """A commit: refuse it (nothing changes) when a layer's queries or the history are
        missing; else capture what the cache holds before the eviction and record it once the
        commit is applied."""
        if change.what == "load":
            raise RuntimeError("a recorded cache does not load state dicts (the recorder's shadow would not match)")
        if change.what != "commit":
            return None
        cache, chunk_idx = change.cache, change.chunk_idx
        L = cache.num_layers
        missing = [layer for layer in range(L) if self._q_chunk[layer] != chunk_idx]
        if missing:
            raise RuntimeError(
                f"recorder: no queries for chunk {chunk_idx} in layer(s) {missing}; pass them with "
                f"update(k, v, q) after each write (nothing was committed)"
            )
        start = cache.layout.chunk_start(chunk_idx)
        for layer in range(L):
            have = 0 if self._hk[layer] is None else self._hk[layer].shape[2]
            if start > have:
                raise RuntimeError(
                    f"recorder: the shadow holds {have} positions but chunk {chunk_idx} starts at {start}; "
                    f"the recorder must see every chunk from the start of the stream"
                )
        pre = [self._head_positions(layer) for layer in range(L)]
        ev = change.eviction
        cap = cache.layout.capacity
        post = [p.masked_fill(ev.evicted[layer, :, :cap].cpu(), -1) if ev is not None else p for layer, p in enumerate(pre)]
        ov = (ev.info["overflow"].cpu() if ev is not None and "overflow" in ev.info
              else torch.zeros((L, self.heads), dtype=torch.bool))
        chunk_kv = [self._read_chunk(layer, pre[layer], start) for layer in range(L)]
        return lambda: self._record(chunk_idx, start, pre, post, ov, chunk_kv)

    def _record(self, chunk_idx, start, pre, post, ov, chunk_kv) -> None:
        self.records = [r for r in self.records if r.chunk < chunk_idx]  # a reopened chunk replaces its records
        for layer in range(self.cache.num_layers):
            ck, cv = chunk_kv[layer]
            if self._hk[layer] is None or start == 0:
                self._hk[layer], self._hv[layer] = ck, cv
            else:
                self._hk[layer] = torch.cat([self._hk[layer][:, :, :start], ck], dim=2)
                self._hv[layer] = torch.cat([self._hv[layer][:, :, :start], cv], dim=2)
            self.records.append(self._measure(chunk_idx, layer, pre[layer], post[layer], ov[layer]))

    # ---------------------------------------------------------------- helpers
    def _head_positions(self, layer: int) -> Tensor:
        return self.cache.layer_slot_positions(layer)[:, : self.cache.layout.capacity].cpu().clone()

    def _bhsd(self, t: Tensor) -> Tensor:
        """A per-layer tensor in the cache layout -> ``[B*, H, tokens, features]`` float64 CPU."""
        rank = t.dim()
        seq, head = self.cache.seq_dim, self.cache.head_dim
        rest = [d for d in range(rank - 1) if d not in (seq, head)]
        x = t.permute(*rest, head, seq, rank - 1)
        return x.reshape(-1, *x.shape[-3:]).to("cpu", torch.float64)

    def _read_chunk(self, layer: int, pos: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """The committed chunk's K/V, read from the slots that hold its positions."""
        C, cap = self.cache.layout.chunk, self.cache.layout.capacity
        target = torch.arange(start, start + C)
        match = pos.unsqueeze(-1) == target  # [H, cap, C]
        if not match.any(1).all():
            raise RuntimeError(f"recorder: the chunk at positions {start}..{start + C - 1} is not resident at commit")
        slots = match.to(torch.int8).argmax(1)  # [H, C]
        out = []
        for buf in (self.cache.keys(layer), self.cache.values(layer)):
            x = self._bhsd(buf)[:, :, :cap]  # [B, H, cap, D]
            idx = slots[None, :, :, None].expand(x.shape[0], -1, -1, x.shape[-1])
            out.append(x.gather(2, idx))
        return out[0], out[1]

    def _measure(self, chunk_idx: int, layer: int, pre_pos: Tensor, post_pos: Tensor, overflow: Tensor) -> StepRecord:
        K, V = self._hk[layer], self._hv[layer]  # [B, H, N, D]
        Q = self._bhsd(self._q[layer])  # [B, H, C, D]
        n = K.shape[2]
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(Q.shape[-1])
        s = (Q @ K.transpose(-1, -2)) * scale  # [B, H, C, N]
        pre, post = _position_mask(pre_pos, n), _position_mask(post_pos, n)

        def softmax_over(mask: Tensor) -> Tensor:
            return s.masked_fill(~mask[None, :, None, :], -math.inf).softmax(-1)

        def out(p: Tensor) -> Tensor:
            return p @ V

        p_full, p_pre, p_post = s.softmax(-1), softmax_over(pre), softmax_over(post)
        o_full, o_pre, o_post = out(p_full), out(p_pre), out(p_post)
        gone = pre & ~post
        B, H, C = Q.shape[:3]

        def spread(r: Tensor) -> Tensor:  # [B, H] -> [H, B*C]
            return _per_head(r.unsqueeze(-1).expand(B, H, C))

        holdout = holdout_tokens = None
        prev = self._pre_masks[layer].get(chunk_idx - 1)
        if prev is not None:
            m = prev.shape[1]
            evicted = prev & ~pre[:, :m]
            holdout = _per_head((p_full[..., :m] * evicted[None, :, None, :]).sum(-1))
            holdout_tokens = evicted.sum(-1)
        self._pre_masks[layer] = {k: v for k, v in self._pre_masks[layer].items() if k == chunk_idx - 1}
        self._pre_masks[layer][chunk_idx] = pre

        oracle: dict[float, dict[str, Tensor]] = {}
        S = self.cache.layout.sink
        for tau in self.oracle_taus:
            policy = PerQueryMass(tau, protect_sinks=S, protect_recent=C)
            keep = policy.keep(p_full, torch.arange(n))  # [B, H, C, N]
            o_k = kept_output(p_full, V.unsqueeze(2), keep)
            oracle[tau] = {
                "count": _per_head(keep.sum(-1)),
                "kept_mass": _per_head(kept_mass(p_full, keep)),
                "err": _per_head((o_k - o_full).abs().amax(-1)),
                "union": keep.any(dim=(0, 2)).sum(-1),
            }
        return StepRecord(
            chunk=chunk_idx, layer=layer, history=n, tau=self.cache.policy.params().get("tau"),
            resident=pre.sum(-1), kept=post.sum(-1), evicted=gone.sum(-1), overflow=overflow.clone(),
            dropped=_per_head((p_pre * gone[None, :, None, :]).sum(-1)),
            kept_mass_evict=_per_head((p_pre * post[None, :, None, :]).sum(-1)),
            err_evict=_per_head((o_post - o_pre).abs().amax(-1)),
            range_resident=spread(_value_range(V, pre)),
            missing=_per_head((p_full * ~pre[None, :, None, :]).sum(-1)),
            mass_resident=_per_head((p_full * pre[None, :, None, :]).sum(-1)),
            err_attend=_per_head((o_pre - o_full).abs().amax(-1)),
            missing_post=_per_head((p_full * ~post[None, :, None, :]).sum(-1)),
            err_post=_per_head((o_post - o_full).abs().amax(-1)),
            range_history=spread(_value_range(V, torch.ones_like(pre))),
            holdout=holdout, holdout_tokens=holdout_tokens, oracle=oracle,
        )


