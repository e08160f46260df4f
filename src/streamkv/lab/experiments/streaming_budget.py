"""Streaming budgets, measured: any cache through a stream, against its whole history.

A *recording* cache (:func:`recording`, e.g. :class:`RecordingMass`) is a cache class
with a shadow of everything the stream has committed: per layer and head, the K/V of
every position in position order, and the queries of each chunk. After every
``commit_chunk(c)`` it computes, exactly (float64, full matrices: the shadow is small by
construction), for every (layer, head) and every query ``i`` of chunk ``c`` (batch x
chunk rows):

``resident``
    tokens the head held while chunk ``c`` attended (the chunk itself included): the
    memory the cache really used. ``kept``: tokens left after the commit.
scoring (the eviction at this commit, relative to the pre-eviction cache)
    ``dropped_i``: the mass query ``i`` put, under its softmax over the resident set,
    on the tokens this commit evicted (``kept mass = 1 - dropped``);
    ``err_evict_i = ||o_post - o_pre||_inf``: how far this eviction moved the query's
    output; bound ``tau * range(V_resident)`` (L-infinity value range: max over channels
    of max - min over the resident values) where the cache has a ``tau`` and no overflow
    was counted for that (layer, head) at this commit.
against full-history attention (softmax over every committed position ``0 .. end``)
    ``missing_i``: the full-history mass outside the resident set, and ``err_attend_i =
    ||o_resident - o_full||_inf``: the error of the attention chunk ``c`` actually
    computed, with its exact bound ``missing_i * range(V_history)``; the same after the
    eviction (``missing_post``, ``err_post``). These accumulate over evictions: no
    single tau covers them.
``holdout``
    at commit ``c``, for the tokens evicted between chunk ``c-1``'s attention and chunk
    ``c``'s (what the commit of ``c-1`` evicted, or what a ring overwrote at
    ``begin_chunk(c)``): the mass chunk ``c``'s queries put on them under the
    full-history softmax. It measures how well the scoring chunk's mass transfers to
    the next chunk: the tau guarantee does **not** cover it.
``oracle`` (optional, ``oracle_taus``)
    the seed's per-query :class:`~streamkv.budget.oracles.PerQueryMass` on the full
    history (sinks and the newest chunk protected): each query of chunk ``c`` keeps its
    own smallest set with mass ``>= 1 - tau``. Kept count, kept mass and error against
    full-history attention. No streaming cache can do better at that tau: for any query
    whose resident set holds mass ``>= 1 - tau``, the oracle keeps no more tokens.

**Scope.** The mass cache's guarantee (kept mass ``>= 1 - tau``, error ``<= tau *
range``) covers the queries that measured the mass (the scoring chunk) for that one
eviction, relative to the cache they attended to. The holdout mass shows how well the
choice transfers to the next chunk; ``err_attend`` shows what the accumulated evictions
cost against full-history attention.

On top of the recorder: a synthetic multi-head stream built from the seed's generator
(:class:`SyntheticHeads`, :func:`synthetic_qkv`) that drives caches directly, the tiny
DiT through :class:`~streamkv.rollout.StreamingRollout`, matched-memory baselines
(:func:`matched_ring_window`, :func:`matched_h2o_budget`) and :func:`run_streaming_budget`
for the ``streamkv budget`` command.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from streamkv.budget.mass import check_tau, kept_mass, kept_output
from streamkv.budget.oracles import PerQueryMass
from streamkv.caches.base import KVCache
from streamkv.caches.h2o import H2OCache
from streamkv.caches.mass import MassBudgetCache
from streamkv.caches.ring import RingCache
from streamkv.lab.plotting import pyplot, save
from streamkv.lab.experiments.synthetic import GeneratorConfig, synthesize

__all__ = [
    "StepRecord",
    "RecordingMixin",
    "recording",
    "RecordingRing",
    "RecordingMass",
    "RecordingH2O",
    "summarize",
    "SyntheticHeads",
    "synthetic_qkv",
    "drive",
    "run_synthetic_cache",
    "matched_ring_window",
    "matched_h2o_budget",
    "run_dit_cache",
    "StreamingBudgetConfig",
    "run_streaming_budget",
    "plot_streaming",
]


# =========================================================================== records


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


def _head_index(k_shape: tuple[int, ...], seq_dim: int) -> int:
    """The head dimension: the last one other than the token and feature dims."""
    others = [d for d in range(len(k_shape) - 1) if d != seq_dim]
    if not others:
        raise ValueError(f"a recording cache needs a head dimension in k_shape {k_shape}")
    return others[-1]


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


class RecordingMixin:
    """Mix into a cache class (first base) to record every commit; see the module docstring.

    Extra keyword arguments: ``oracle_taus`` (taus at which to evaluate the per-query
    oracle on the shadow history; default none) and ``scale`` (softmax scale of the
    attention; default ``1/sqrt(head feature size)``, what the caches and the DiT use).

    The model must hand over every layer's queries each chunk (``observes_queries`` is
    True, so the DiT does); ``commit_chunk`` raises ``RuntimeError`` and changes nothing
    if a layer's queries are missing. ``records`` (a list of :class:`StepRecord`)
    describes the current stream; ``reset`` clears it with the shadow.
    """

    observes_queries = True

    def __init__(self, *args: Any, oracle_taus: Sequence[float] = (), scale: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.oracle_taus = tuple(check_tau(t, "oracle_taus entry") for t in oracle_taus)
        if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")
        self.scale = scale
        self._rec_head = _head_index(self.k_shape, self.seq_dim)
        self._rec_heads = self.k_shape[self._rec_head]
        self._rec_clear()

    def _rec_clear(self) -> None:
        L = self.num_layers
        self._q: list[Tensor | None] = [None] * L
        self._q_chunk: list[int | None] = [None] * L
        self._hk: list[Tensor | None] = [None] * L
        self._hv: list[Tensor | None] = [None] * L
        self._pre_masks: list[dict[int, Tensor]] = [{} for _ in range(L)]
        self.records: list[StepRecord] = []

    # ------------------------------------------------------------------ hooks
    def observe_queries(self, q: Tensor, layer: int | None = None) -> None:
        layer = self._check_layer(layer)
        self._check_chunk_tensor("q", q, self._chunk_shape_k)
        super().observe_queries(q, layer=layer)
        self._q[layer] = q.detach().to("cpu", torch.float64, copy=True)
        self._q_chunk[layer] = self._open

    def _on_reset(self) -> None:
        super()._on_reset()
        self._rec_clear()

    def _on_commit(self, chunk_idx: int) -> None:
        L = self.num_layers
        missing = [layer for layer in range(L) if self._q_chunk[layer] != chunk_idx]
        if missing:
            raise RuntimeError(
                f"recording cache: no queries observed for chunk {chunk_idx} in layer(s) {missing}; call "
                f"observe_queries(q, layer) after each write (nothing was committed)"
            )
        start, C = self.layout.chunk_start(chunk_idx), self.layout.chunk
        for layer in range(L):
            have = 0 if self._hk[layer] is None else self._hk[layer].shape[2]
            if start > have:
                raise RuntimeError(
                    f"recording cache: the shadow holds {have} positions but chunk {chunk_idx} starts at {start}; "
                    f"the recorder must see every chunk from the start of the stream"
                )
        pre = [self._head_positions(layer).clone() for layer in range(L)]
        chunk_kv = [self._read_chunk(layer, pre[layer], start) for layer in range(L)]
        overflows = getattr(self, "_overflows", None)
        ov_before = overflows.clone() if overflows is not None else None
        super()._on_commit(chunk_idx)
        post = [self._head_positions(layer).clone() for layer in range(L)]
        ov = (overflows - ov_before > 0).cpu() if overflows is not None else torch.zeros(
            (L, self._rec_heads), dtype=torch.bool)
        self.records = [r for r in self.records if r.chunk < chunk_idx]  # a reopened chunk replaces its records
        for layer in range(L):
            ck, cv = chunk_kv[layer]
            if self._hk[layer] is None or start == 0:
                self._hk[layer], self._hv[layer] = ck, cv
            else:
                self._hk[layer] = torch.cat([self._hk[layer][:, :, :start], ck], dim=2)
                self._hv[layer] = torch.cat([self._hv[layer][:, :, :start], cv], dim=2)
            self.records.append(self._measure(chunk_idx, layer, pre[layer], post[layer], ov[layer]))

    # ---------------------------------------------------------------- helpers
    def _head_positions(self, layer: int) -> Tensor:
        pos = self.layer_slot_positions(layer)
        if pos.dim() == 1:
            pos = pos.expand(self._rec_heads, -1)
        return pos.cpu()

    def _bhsd(self, t: Tensor) -> Tensor:
        """A per-layer tensor in the cache layout -> ``[B*, H, tokens, features]`` float64 CPU."""
        rank = t.dim()
        seq, head = self.seq_dim, self._rec_head
        rest = [d for d in range(rank - 1) if d not in (seq, head)]
        x = t.permute(*rest, head, seq, rank - 1)
        return x.reshape(-1, *x.shape[-3:]).to("cpu", torch.float64)

    def _read_chunk(self, layer: int, pos: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """The committed chunk's K/V, read from the slots that hold its positions."""
        C = self.layout.chunk
        target = torch.arange(start, start + C)
        match = pos.unsqueeze(-1) == target  # [H, cap, C]
        if not match.any(1).all():
            raise RuntimeError(f"recording cache: the chunk at positions {start}..{start + C - 1} is not resident at commit")
        slots = match.to(torch.int8).argmax(1)  # [H, C]
        out = []
        for buf in (self.keys(layer), self.values(layer)):
            x = self._bhsd(buf)  # [B, H, cap, D]
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
        S = self.layout.sink
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
            chunk=chunk_idx, layer=layer, history=n, tau=getattr(self, "tau", None),
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


_RECORDING: dict[type, type] = {}


def recording(cls: type[KVCache]) -> type[KVCache]:
    """The recording subclass of a cache class (created once per class)."""
    if not (isinstance(cls, type) and issubclass(cls, KVCache)):
        raise TypeError(f"recording() needs a KVCache subclass, got {cls!r}")
    if issubclass(cls, RecordingMixin):
        return cls
    if cls not in _RECORDING:
        _RECORDING[cls] = type(f"Recording{cls.__name__}", (RecordingMixin, cls), {"__module__": __name__})
    return _RECORDING[cls]


RecordingRing = recording(RingCache)
RecordingMass = recording(MassBudgetCache)
RecordingH2O = recording(H2OCache)


# =========================================================================== summaries


def _q(x: Tensor, q: float) -> float:
    return float(x.flatten().quantile(q)) if x.numel() <= 16_000_000 else float("nan")


def _stats(x: Tensor) -> dict[str, float]:
    x = x.double().flatten()
    return {"max": float(x.max()), "mean": float(x.mean()), "p95": _q(x, 0.95)}


def summarize(records: Sequence[StepRecord]) -> dict[str, Any]:
    """Condense a recording: memory, error vs full history, the scoring-chunk numbers,
    holdout, overflows, per (layer, head), and the oracle at each recorded tau.

    Keys (all floats unless noted; ``mean``/``p95``/``max`` over every query of every
    step, layer and head unless noted):

    - ``memory``: ``mean`` / ``peak`` resident tokens per (layer, head) while a chunk
      attends (mean over steps, layers, heads); ``kept_mean`` / ``kept_peak`` after the
      commits;
    - ``error``: ``err_attend`` stats (the chunk's attention vs full history);
      ``bound_max``: max of ``missing * range_history``; ``missing``: its stats;
    - ``post``: ``err_post`` and ``missing_post`` stats (the scoring chunk's queries
      after the eviction, vs full history);
    - ``scoring``: ``dropped`` stats and ``kept_mass_min`` (the scoring queries, vs the
      pre-eviction cache), ``err_evict_max``, and when the cache has a tau:
      ``tau_bound_max`` (max of ``tau * range_resident``), ``checked`` (queries where no
      overflow was counted), ``kept_mass_min_checked`` (over those), ``violations`` (checked queries with ``err_evict > tau *
      range_resident`` or kept mass ``< 1 - tau``; exact comparisons),
      ``within_bound`` (bool);
    - ``overflow_steps`` (int): (step, layer, head) triples with an overflow;
    - ``holdout``: stats from chunk 1 on, ``tokens_mean`` (tokens evicted per step and
      head), ``over_tau`` (fraction of (step, layer, head) whose max holdout exceeds tau);
    - ``per_head``: a list of dicts per (layer, head);
    - ``oracle``: ``{tau: {count_mean, count_max, union_mean, kept_mass_min, err_mean,
      err_p95, err_max, bound_max, within_bound}}``.
    """
    if not records:
        raise ValueError("no records: run at least one chunk through the recording cache")
    tau = records[0].tau

    def cat(name: str, recs: Sequence[StepRecord] = records) -> Tensor:
        return torch.cat([getattr(r, name).double().flatten() for r in recs])

    resident, kept = cat("resident"), cat("kept")
    out: dict[str, Any] = {
        "tau": tau,
        "steps": len({r.chunk for r in records}),
        "memory": {"mean": float(resident.mean()), "peak": float(resident.max()),
                   "kept_mean": float(kept.mean()), "kept_peak": float(kept.max())},
    }
    err, miss = cat("err_attend"), cat("missing")
    bound = torch.cat([(r.missing * r.range_history).flatten() for r in records])
    out["error"] = {**_stats(err), "bound_max": float(bound.max()), "missing": _stats(miss)}
    out["post"] = {"err": _stats(cat("err_post")), "missing": _stats(cat("missing_post"))}
    dropped = cat("dropped")
    scoring: dict[str, Any] = {"dropped": _stats(dropped), "kept_mass_min": float(cat("kept_mass_evict").min()),
                               "err_evict_max": float(cat("err_evict").max())}
    ov = cat("overflow")
    if tau is not None:
        ok = torch.cat([(~r.overflow).unsqueeze(-1).expand_as(r.err_evict).flatten() for r in records])
        tb = torch.cat([(tau * r.range_resident).flatten() for r in records])
        bad = (cat("err_evict") > tb) | (cat("kept_mass_evict") < 1.0 - tau)
        kme = cat("kept_mass_evict")
        scoring.update(tau_bound_max=float(tb.max()), checked=int(ok.sum()), violations=int((bad & ok).sum()),
                       within_bound=bool(not (bad & ok).any()),
                       kept_mass_min_checked=float(kme[ok].min()) if ok.any() else None)
    out["scoring"] = scoring
    out["overflow_steps"] = int(ov.sum())
    hrec = [r for r in records if r.holdout is not None]
    if hrec:
        h = cat("holdout", hrec)
        hmax = torch.cat([r.holdout.amax(-1) for r in hrec])
        out["holdout"] = {**_stats(h), "tokens_mean": float(cat("holdout_tokens", hrec).mean()),
                          "over_tau": float((hmax > tau).double().mean()) if tau is not None else None}
    else:
        out["holdout"] = None
    per_head = []
    layers = sorted({r.layer for r in records})
    for layer in layers:
        lr = [r for r in records if r.layer == layer]
        for h in range(lr[0].resident.shape[0]):
            def col(name: str, rs: Sequence[StepRecord] = lr) -> Tensor:
                return torch.cat([getattr(r, name)[h].double().flatten() for r in rs])

            row: dict[str, Any] = {
                "layer": layer, "head": h,
                "resident_mean": float(col("resident").mean()), "resident_peak": float(col("resident").max()),
                "kept_mean": float(col("kept").mean()), "kept_peak": float(col("kept").max()),
                "dropped": _stats(col("dropped")), "kept_mass_min": float(col("kept_mass_evict").min()),
                "err_evict_max": float(col("err_evict").max()),
                "tau_bound_max": float((tau * col("range_resident")).max()) if tau is not None else None,
                "err_attend": _stats(col("err_attend")), "missing_max": float(col("missing").max()),
                "err_post_max": float(col("err_post").max()),
                "overflows": int(col("overflow").sum()),
            }
            lh = [r for r in lr if r.holdout is not None]
            row["holdout"] = _stats(col("holdout", lh)) if lh else None
            per_head.append(row)
    out["per_head"] = per_head
    oracle = {}
    for t in records[0].oracle:
        cnt = torch.cat([r.oracle[t]["count"].double().flatten() for r in records])
        km = torch.cat([r.oracle[t]["kept_mass"].flatten() for r in records])
        oe = torch.cat([r.oracle[t]["err"].flatten() for r in records])
        ob = torch.cat([(t * r.range_history).flatten() for r in records])
        un = torch.cat([r.oracle[t]["union"].double().flatten() for r in records])
        oracle[t] = {"count_mean": float(cnt.mean()), "count_max": float(cnt.max()), "union_mean": float(un.mean()),
                     "kept_mass_min": float(km.min()), "err_mean": float(oe.mean()), "err_p95": _q(oe, 0.95),
                     "err_max": float(oe.max()), "bound_max": float(ob.max()),
                     "within_bound": bool((oe <= ob).all() and (km >= 1.0 - t).all())}
    out["oracle"] = oracle
    return out


# ====================================================================== synthetic heads


@dataclass(frozen=True)
class SyntheticHeads:
    """A multi-head stream from the seed's generator: head ``h`` is
    ``synthesize(base.with_(**heads[h]), seed + h)``.

    Defaults (chosen before any streaming run, for variety, not tuned): the default
    generator (48 frames x 8 tokens, recency 0.25/frame, keyframes 0/16/32 with 2 sink
    tokens of boost 3, noise 1); the same without sinks (``sink_boost=0``); a sharper
    recency (``recency_decay=0.5``); stronger sinks (``sink_boost=6``).
    """

    base: GeneratorConfig = field(default_factory=GeneratorConfig)
    heads: tuple[tuple[tuple[str, float], ...], ...] = (
        (),
        (("sink_boost", 0.0),),
        (("recency_decay", 0.5),),
        (("sink_boost", 6.0),),
    )

    def configs(self) -> list[GeneratorConfig]:
        return [self.base.with_(**dict(h)) for h in self.heads]

    def as_dict(self) -> dict[str, Any]:
        return {"base": self.base.as_dict(), "heads": [dict(h) for h in self.heads]}


def synthetic_qkv(spec: SyntheticHeads, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Queries, keys and values ``[N, H, *]`` (float64) whose attention is exactly the
    generator's: keys are the standard basis ``e_j`` of ``R^N`` and the query of token
    ``i`` is ``sqrt(N)`` times its logit row, so ``q_i . k_j / sqrt(N) = logit(i -> j)``
    for every pair and a cache's softmax over any subset is the generator's attention
    restricted to it. Values are each head's generator values. Within a frame the
    logits are the generator's too (distance ``-1``: recency ``+recency_decay``), so a
    chunk (one frame) also attends to itself, as in the DiT."""
    cfgs = spec.configs()
    if len({(c.frames, c.tokens_per_frame, c.value_dim) for c in cfgs}) != 1:
        raise ValueError("every head must share frames, tokens_per_frame and value_dim")
    streams = [synthesize(c, seed + h) for h, c in enumerate(cfgs)]
    n = cfgs[0].tokens
    q = torch.stack([math.sqrt(n) * s.logits for s in streams], dim=1)  # [N, H, N]
    k = torch.eye(n, dtype=torch.float64).unsqueeze(1).expand(n, len(streams), n).contiguous()
    v = torch.stack([s.values for s in streams], dim=1)  # [N, H, Dv]
    return q, k, v


def drive(cache: KVCache, q: Tensor, k: Tensor, v: Tensor, chunks: int | None = None) -> KVCache:
    """Stream ``[N, H, *]`` tensors through a one-layer cache with ``k_shape = (1, cap, H,
    D)``, ``seq_dim=1``: per chunk, begin, write, observe the queries, commit."""
    C = cache.layout.chunk
    total = q.shape[0] // C if chunks is None else chunks
    for c in range(total):
        sl = slice(c * C, (c + 1) * C)
        cache.begin_chunk(c)
        cache.write(k[sl].unsqueeze(0), v[sl].unsqueeze(0))
        cache.observe_queries(q[sl].unsqueeze(0))
        cache.commit_chunk(c)
    return cache


def run_synthetic_cache(cls: type[KVCache], qkv: tuple[Tensor, Tensor, Tensor], *, sink: int, window: int,
                        chunk: int, **kwargs: Any) -> KVCache:
    """A recording ``cls`` over the synthetic stream ``qkv``; returns the cache (``.records``)."""
    q, k, v = qkv
    H = q.shape[1]
    cap = sink + window
    cache = recording(cls)((1, cap, H, k.shape[-1]), (1, cap, H, v.shape[-1]), seq_dim=1, sink=sink, window=window,
                           chunk=chunk, dtype=torch.float64, **kwargs)
    return drive(cache, q, k, v)


# ============================================================ matched-memory baselines


def _resident_ring(window: int, sink: int, chunk: int, chunks: int) -> float:
    return sum(min((c + 1) * chunk, sink + window) for c in range(chunks)) / chunks


def _resident_h2o(budget: int, chunk: int, chunks: int) -> float:
    return sum(min((c + 1) * chunk, budget + chunk) for c in range(chunks)) / chunks


def matched_ring_window(target: float, *, sink: int, chunk: int, chunks: int, step: int = 1,
                        max_window: int | None = None) -> tuple[int, float]:
    """The ring window (a multiple of ``step``, ``>= chunk``) whose mean resident tokens
    over ``chunks`` chunks (``min(end, sink + window)`` per chunk) is closest to
    ``target`` (ties: the smaller window). Returns ``(window, its mean)``."""
    hi = max_window if max_window is not None else chunks * chunk
    lo = -(-chunk // step) * step
    best = None
    for w in range(lo, max(hi, lo) + 1, step):
        m = _resident_ring(w, sink, chunk, chunks)
        if best is None or abs(m - target) < abs(best[1] - target):
            best = (w, m)
    assert best is not None
    return best


def matched_h2o_budget(target: float, *, sink: int, chunk: int, chunks: int, max_budget: int) -> tuple[int, float]:
    """The H2O budget in ``[sink + chunk, max_budget]`` whose mean resident tokens
    (``min(end, budget + chunk)`` per chunk) is closest to ``target`` (ties: smaller)."""
    best = None
    for b in range(sink + chunk, max_budget + 1):
        m = _resident_h2o(b, chunk, chunks)
        if best is None or abs(m - target) < abs(best[1] - target):
            best = (b, m)
    if best is None:
        raise ValueError(f"no H2O budget fits: max_budget {max_budget} < sink + chunk = {sink + chunk}")
    return best


# =========================================================================== tiny DiT


def run_dit_cache(cls: type[KVCache], *, chunks: int, window_frames: int | None = None, seed: int = 0,
                  query_scale: float | None = None, prompt: str = "a red fox running through snow",
                  **kwargs: Any) -> KVCache:
    """Run the tiny DiT (random weights, ``seed``) through :class:`StreamingRollout` on a
    prebuilt one-branch :class:`~streamkv.caches.CacheSet` of ``recording(cls)``; returns
    the ``cond`` cache. ``window_frames`` overrides the config's window (the cache's
    capacity only: the weights do not depend on it and are loaded from the configured
    model). ``query_scale`` (a *variant*, off by default) multiplies every block's query
    RMSNorm weight, which scales every attention logit by that factor."""
    from streamkv.caches import CacheSet
    from streamkv.models import CausalVideoDiT, get_config
    from streamkv.rollout import StreamingRollout

    base_cfg = get_config("tiny")
    base = CausalVideoDiT(base_cfg, seed=seed).eval()
    cfg = base_cfg if window_frames is None else replace(base_cfg, window_frames=window_frames)
    model = base if cfg == base_cfg else CausalVideoDiT(cfg, seed=seed).eval()
    if model is not base:
        model.load_state_dict(base.state_dict())
    if query_scale is not None:
        with torch.no_grad():
            for block in model.blocks:
                block.norm_q.weight.mul_(query_scale)
    cs = CacheSet(recording(cls), branches=("cond",), dtype=torch.float32, device="cpu", **model.cache_kwargs(1),
                  **kwargs)
    roll = StreamingRollout(model, cache=cs, seed=seed)
    roll.set_prompt(prompt)
    roll.run(chunks)
    return cs["cond"]


# ======================================================================= experiment


@dataclass(frozen=True)
class StreamingBudgetConfig:
    """What :func:`run_streaming_budget` runs (recorded with the result)."""

    # synthetic: sink tokens pinned (the first keyframe's 2 sinks), capacity of the mass cache
    syn_taus: tuple[float, ...] = (0.2, 0.1, 0.05, 0.02)
    syn_sink: int = 2
    syn_window: int = 256
    # tiny DiT
    dit_taus: tuple[float, ...] = (0.2, 0.1, 0.05)
    dit_chunks: int = 16
    dit_window_frames: int = 16  # the capacity variant for the mass cache (the config has 5)
    dit_query_scale: float | None = 4.0  # the sharper-attention variant; None skips it
    seed: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}


def _row(policy: str, param: str, s: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    row = {
        "policy": policy, "param": param,
        "memory_mean": s["memory"]["mean"], "memory_peak": s["memory"]["peak"],
        "err_mean": s["error"]["mean"], "err_p95": s["error"]["p95"], "err_max": s["error"]["max"],
        "missing_mean": s["error"]["missing"]["mean"], "missing_max": s["error"]["missing"]["max"],
        "holdout_mean": s["holdout"]["mean"] if s["holdout"] else None,
        "holdout_max": s["holdout"]["max"] if s["holdout"] else None,
        "overflow_steps": s["overflow_steps"],
    }
    row.update(extra or {})
    return row


def _oracle_row(tau: float, o: dict[str, Any]) -> dict[str, Any]:
    return {"policy": "oracle", "param": f"tau={tau:g}", "memory_mean": o["count_mean"], "memory_peak": o["count_max"],
            "err_mean": o["err_mean"], "err_p95": o["err_p95"], "err_max": o["err_max"],
            "missing_mean": None, "missing_max": 1.0 - o["kept_mass_min"], "holdout_mean": None, "holdout_max": None,
            "overflow_steps": 0, "union_mean": o["union_mean"]}


def _compare(run: Callable[..., KVCache], taus: Sequence[float], *, sink: int, chunk: int, chunks: int,
             mass_window: int, ring_step: int, ring_kwargs: Callable[[int], dict[str, Any]],
             h2o_kwargs: Callable[[int], dict[str, Any]], h2o_max_budget: int,
             progress: Callable[[str], None] | None) -> dict[str, Any]:
    """Per tau: the mass cache, then a ring and an H2O cache matched to its mean resident
    tokens, and matched to its peak (``window@peak``: ``sink + W`` = the peak, rounded to
    ``ring_step``; ``h2o@peak``: ``budget + chunk`` = the peak), and the oracle row."""
    memo: dict[tuple[str, int], dict[str, Any]] = {}

    def baseline(kind: str, param: int) -> dict[str, Any]:
        if (kind, param) not in memo:
            if progress:
                progress(f"{kind} {param}")
            cls, kw = (RingCache, ring_kwargs(param)) if kind == "ring" else (H2OCache, h2o_kwargs(param))
            memo[kind, param] = summarize(run(cls, **kw).records)
        return memo[kind, param]

    mass_runs, groups = [], []
    for tau in taus:
        if progress:
            progress(f"mass tau={tau:g}")
        s = summarize(run(MassBudgetCache, tau=tau, oracle_taus=(tau,), **{"window": mass_window}).records)
        mass_runs.append(s)
        target, peak = s["memory"]["mean"], int(s["memory"]["peak"])
        w, _ = matched_ring_window(target, sink=sink, chunk=chunk, chunks=chunks, step=ring_step)
        b, _ = matched_h2o_budget(target, sink=sink, chunk=chunk, chunks=chunks, max_budget=h2o_max_budget)
        lo_w = -(-chunk // ring_step) * ring_step
        wp = max(lo_w, int(round((peak - sink) / ring_step)) * ring_step)
        bp = min(max(peak - chunk, sink + chunk), h2o_max_budget)
        rows = [
            _row("mass", f"tau={tau:g}", s, {"kept_mass_min": s["scoring"]["kept_mass_min"],
                                             "within_bound": s["scoring"].get("within_bound")}),
            _row("window", f"W={w}", baseline("ring", w)),
            _row("h2o", f"budget={b}", baseline("h2o", b)),
            _row("window@peak", f"W={wp}", baseline("ring", wp)),
            _row("h2o@peak", f"budget={bp}", baseline("h2o", bp)),
            _oracle_row(tau, s["oracle"][tau]),
        ]
        groups.append({"tau": tau, "rows": rows, "window": w, "h2o_budget": b, "window_at_peak": wp,
                       "h2o_budget_at_peak": bp, "ring": baseline("ring", w), "h2o": baseline("h2o", b)})
    return {"mass": mass_runs, "groups": groups}


def _check_config(cfg: StreamingBudgetConfig) -> None:
    for t in cfg.syn_taus + cfg.dit_taus:
        check_tau(t)
    for name in ("syn_sink", "syn_window", "dit_chunks", "dit_window_frames", "seed"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    if cfg.dit_chunks < 2:
        raise ValueError(f"dit_chunks must be >= 2 (holdout needs a next chunk), got {cfg.dit_chunks}")
    if cfg.dit_query_scale is not None and not (math.isfinite(cfg.dit_query_scale) and cfg.dit_query_scale > 0):
        raise ValueError(f"dit_query_scale must be positive and finite or None, got {cfg.dit_query_scale!r}")


def run_streaming_budget(cfg: StreamingBudgetConfig | None = None, spec: SyntheticHeads | None = None,
                         progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The streaming experiments: synthetic heads, the tiny DiT as configured, the DiT
    with a larger capacity, and (optionally) the sharper-query variant. See
    ``streamkv budget --help`` for the result's keys."""
    from streamkv.models import get_config
    from streamkv.lab.experiments.pareto import single_thread

    cfg = cfg or StreamingBudgetConfig()
    spec = spec or SyntheticHeads()
    _check_config(cfg)
    result: dict[str, Any] = {"config": cfg.as_dict()}
    with single_thread():
        # ---------------------------------------------------------------- synthetic
        qkv = synthetic_qkv(spec, cfg.seed)
        C = spec.base.tokens_per_frame
        chunks = spec.base.frames
        S, Wm = cfg.syn_sink, cfg.syn_window

        def syn(cls, window, **kw):
            return run_synthetic_cache(cls, qkv, sink=S, window=window, chunk=C, **kw)

        syn_res = _compare(
            syn, cfg.syn_taus, sink=S, chunk=C, chunks=chunks, mass_window=Wm, ring_step=1,
            ring_kwargs=lambda w: {"window": w}, h2o_kwargs=lambda b: {"window": max(Wm, b + C - S), "budget": b},
            h2o_max_budget=chunks * C, progress=progress,
        )
        result["synthetic"] = {
            "generator": {**spec.as_dict(), "seed": cfg.seed, "embedding": "keys e_j in R^N, queries sqrt(N) * logit rows"},
            "sink": S, "chunk": C, "chunks": chunks, "mass_capacity": S + Wm, **syn_res,
        }
        # ---------------------------------------------------------------- tiny DiT
        tiny = get_config("tiny")
        Sd, Cd, tpf = tiny.sink_tokens, tiny.chunk_tokens, tiny.tokens_per_frame
        nd = cfg.dit_chunks

        def dit_section(window_frames: int, query_scale: float | None, label: str) -> dict[str, Any]:
            def run(cls, window=None, **kw):
                wf = window_frames if window is None else window // tpf
                return run_dit_cache(cls, chunks=nd, window_frames=wf, seed=cfg.seed, query_scale=query_scale, **kw)

            wt = window_frames * tpf
            res = _compare(
                run, cfg.dit_taus, sink=Sd, chunk=Cd, chunks=nd, mass_window=wt, ring_step=tpf,
                ring_kwargs=lambda w: {"window": w}, h2o_kwargs=lambda b: {"budget": b},
                h2o_max_budget=Sd + wt - Cd, progress=(lambda m: progress(f"{label}: {m}")) if progress else None,
            )
            return {"label": label, "window_frames": window_frames, "capacity": Sd + wt, "query_scale": query_scale,
                    "sink": Sd, "chunk": Cd, "chunks": nd, **res}

        dit = {"model": tiny.to_dict(), "sections": []}
        dit["sections"].append(dit_section(tiny.window_frames, None, f"tiny as configured (window {tiny.window_frames} frames)"))
        dit["sections"].append(dit_section(cfg.dit_window_frames, None, f"tiny, capacity variant (window {cfg.dit_window_frames} frames)"))
        if cfg.dit_query_scale is not None:
            dit["sections"].append(dit_section(
                cfg.dit_window_frames, cfg.dit_query_scale,
                f"VARIANT: queries x{cfg.dit_query_scale:g} (window {cfg.dit_window_frames} frames)"))
        result["dit"] = dit
    result["scope"] = SCOPE
    return result


SCOPE = (
    "The tau bound covers the queries that measured the mass (the scoring chunk) for that eviction, relative to "
    "the cache they attended to: kept mass >= 1 - tau and |o_post - o_pre|_inf <= tau * range, where no overflow "
    "was counted. The holdout mass (what the next chunk's queries put on the evicted tokens, full-history softmax) "
    "shows how well the choice transfers; the error vs full-history attention accumulates over evictions and no "
    "single tau covers it."
)


# ============================================================================= plot


def plot_streaming(result: dict[str, Any], path: str | Path) -> None:
    """Mean error vs mean resident tokens for each policy: one panel for the synthetic
    stream, one per DiT section (log error axis)."""
    plt = pyplot()

    panels = [("synthetic heads", result["synthetic"])] + [(s["label"], s) for s in result["dit"]["sections"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), squeeze=False)
    styles = {"mass": ("tab:blue", "o-"), "window": ("tab:red", "s-"), "h2o": ("tab:green", "^-"),
              "oracle": ("black", "x--")}
    for ax, (title, sec) in zip(axes[0], panels):
        for policy, (color, style) in styles.items():
            # the peak-matched baselines are more points of the same curves
            pts = sorted({(r["memory_mean"], r["err_mean"]) for g in sec["groups"] for r in g["rows"]
                          if r["policy"].split("@")[0] == policy and r["err_mean"] > 0})
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=policy)
        ax.set_yscale("log")
        ax.set_xlabel("mean resident tokens per head")
        ax.set_ylabel("mean L-inf error vs full-history attention")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, path, dpi=110)
