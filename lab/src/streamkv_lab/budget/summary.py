"""Condensed views of a recording (:class:`~streamkv_lab.budget.recorder.Recorder`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from streamkv_lab.budget.recorder import StepRecord

__all__ = ["summarize"]


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
      range_resident`` or dropped mass ``> tau``; exact comparisons),
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
        # the dropped mass summed directly (1 - the kept sum carries that sum's rounding, ~1e-16,
        # which a tau below it cannot see past)
        bad = (cat("err_evict") > tb) | (cat("dropped") > tau)
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


