"""``streamkv budget``: the streaming budgeted caches vs a window, H2O and the oracle, at
matched memory, on synthetic heads and the tiny DiT (see :mod:`streamkv_lab.budget.recorder`
for what is measured)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamkv.budget.mass import check_tau
from streamkv_lab.budget.recorder import Recorder
from streamkv_lab.budget.streams import (
    SyntheticHeads,
    matched_h2o_budget,
    matched_ring_window,
    run_dit_cache,
    run_synthetic_cache,
    synthetic_qkv,
)
from streamkv_lab.budget.summary import summarize
from streamkv_lab.env import threads
from streamkv_lab.plotting import pyplot, save

__all__ = ["StreamingBudgetConfig", "run_streaming_budget", "plot_streaming", "SCOPE"]


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


def _compare(run: Callable[..., Recorder], taus: Sequence[float], *, sink: int, chunk: int, chunks: int,
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
            kw = ring_kwargs(param) if kind == "ring" else h2o_kwargs(param)
            memo[kind, param] = summarize(run(kind, **kw).records)
        return memo[kind, param]

    mass_runs, groups = [], []
    for tau in taus:
        if progress:
            progress(f"mass tau={tau:g}")
        s = summarize(run("mass", tau=tau, oracle_taus=(tau,), window=mass_window).records)
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

    cfg = cfg or StreamingBudgetConfig()
    spec = spec or SyntheticHeads()
    _check_config(cfg)
    result: dict[str, Any] = {"config": cfg.as_dict()}
    with threads(1):
        # ---------------------------------------------------------------- synthetic
        qkv = synthetic_qkv(spec, cfg.seed)
        C = spec.base.tokens_per_frame
        chunks = spec.base.frames
        S, Wm = cfg.syn_sink, cfg.syn_window

        def syn(kind, window, **kw):
            return run_synthetic_cache(kind, qkv, sink=S, window=window, chunk=C, **kw)

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
            def run(kind, window=None, **kw):
                wf = window_frames if window is None else window // tpf
                return run_dit_cache(kind, chunks=nd, window_frames=wf, seed=cfg.seed, query_scale=query_scale, **kw)

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
