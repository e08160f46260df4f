"""The experiments behind ``streamkv certify``: certified rollouts, checked against the
whole-history reference, on synthetic video Q/K/V and on the tiny DiT.

Each rollout drives a cache watched by a :class:`~streamkv.certify.Certifier` chunk by chunk;
at every attention step (layer x denoising pass) the certifier certifies every query and the
:class:`~streamkv.certify.shadow.HistoryCheck` computes the truth. Reported per step
(chunk): rows checked, violations, true vs certified max error and mass, tightness
(``m_hat / m``, median), recall traffic, memory split (kept K/V, summaries, offloaded K/V).

- **synthetic**: :func:`~streamkv_lab.experiments.qkv.synthesize_qkv` (recency + keyframe
  sinks, 3D RoPE), the queries handed to the cache and attention exactly like the model
  does (``update(k, v, q)``, attend, commit); one chunk per ``chunk_frames`` frames.
- **dit**: the tiny causal DiT (random weights, seeded) in a
  :class:`~streamkv.rollout.StreamingRollout` over a one-branch cache set with recall slots
  and a certifier: 4 denoising passes + the clean pass per chunk, every layer certified at
  every pass.

Both run single-threaded (:func:`~streamkv_lab.env.threads`): thousands of
tiny ops, where intra-op threads only add contention.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from streamkv.attention import attend
from streamkv.caches import CacheSet, KVCache
from streamkv.certify import Certifier, HistoryCheck
from streamkv.certify.shadow import tightness_stats
from streamkv_lab.env import threads
from streamkv_lab.kinds import check_kinds, evicting_kinds, kind_params
from streamkv_lab.experiments.qkv import QKVConfig, synthesize_qkv
from streamkv_lab.plotting import pyplot, save

__all__ = ["SummaryOptions", "RunConfig", "run_synthetic", "run_dit", "run_certify", "plot_certify"]

#: the cache kinds the experiment certifies

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class SummaryOptions:
    """How evicted tokens are summarised (see :class:`~streamkv.certify.summary.BlockSummaries`)."""

    box_dtype: str | None = "float16"  # None: the cache dtype (exact boxes)
    events_per_block: int = 1
    pool_events: int | None = 8
    block_tokens: int = 24
    max_blocks: int | None = None
    sketch_bits: int | None = None  # 8 or 4: per-token key sketches instead of boxes (the two-tier cache)

    def kwargs(self) -> dict[str, Any]:
        if self.sketch_bits is not None:
            return dict(sketch_bits=self.sketch_bits, block_tokens=self.block_tokens)
        return dict(box_dtype=None if self.box_dtype is None else _DTYPES[self.box_dtype],
                    events_per_block=self.events_per_block, pool_events=self.pool_events,
                    block_tokens=self.block_tokens, max_blocks=self.max_blocks)


@dataclass(frozen=True)
class RunConfig:
    """One certified rollout's settings (recorded with its result)."""

    cache: str = "ring"  # any cache kind (every kind evicts): streamkv_lab.kinds.evicting_kinds()
    budget_tau: float = 0.05  # the mass cache's eviction budget (ignored by the ring)
    recall_tau: float | None = None  # recall threshold; None: no recall
    recall_slots: int = 0
    tau: float = 0.1  # the reference threshold: rows over it are counted, the oracle recall is sized by it
    summary: SummaryOptions = field(default_factory=SummaryOptions)
    seed: int = 0

    def cache_kwargs(self) -> dict[str, Any]:
        """The cache's policy parameters and recall slots."""
        kw: dict[str, Any] = kind_params(self.cache, tau=self.budget_tau)
        kw["recall_slots"] = self.recall_slots if self.recall_tau is not None else 0
        return kw

    def certifier_kwargs(self) -> dict[str, Any]:
        return {**self.summary.kwargs(), "recall_tau": self.recall_tau}


def _step_memory(cert: Certifier) -> dict[str, Any]:
    m = cert.memory()
    return {k: m[k] for k in ("kept_kv_bytes", "recall_kv_bytes", "summary_bytes", "offloaded_kv_bytes",
                              "summarised_kv_bytes", "summary_bytes_ratio", "summary_blocks")}


def _finish(name: str, run: RunConfig, mon: HistoryCheck, caches: list[Certifier], steps_extra: list[dict],
            wall: float, extra: dict[str, Any]) -> dict[str, Any]:
    res = mon.result()
    steps = mon.step_rows()
    for st, ex in zip(steps, steps_extra):
        st.update(ex)
    mem = [c.memory() for c in caches]
    recall = {k: sum(c.stats[k] for c in caches) for k in caches[0].stats}
    recall["peak_slots_used"] = max(c.stats["peak_slots_used"] for c in caches)
    ratios = [s["summary_bytes_ratio"] for s in steps_extra if s.get("summarised_kv_bytes")]
    below = None  # first step from which the summary ratio stays <= 3%
    for st in reversed(steps_extra):
        if st.get("summarised_kv_bytes") and st["summary_bytes_ratio"] > 0.03:
            break
        below = st["chunk"] if "chunk" in st else below
    out = {
        "name": name,
        "run": {**asdict(run), "summary": asdict(run.summary)},
        **res,
        "summary_bytes_ratio": max(m["summary_bytes_ratio"] for m in mem),
        "summary_bytes_ratio_max_over_run": max(ratios) if ratios else 0.0,
        "summary_bytes_ratio_le_3pct_from_chunk": below,
        "memory": {k: sum(m[k] for m in mem) for k in ("kept_kv_bytes", "recall_kv_bytes", "summary_bytes",
                                                         "summarised_kv_bytes", "offloaded_kv_bytes",
                                                         "summary_blocks", "summary_merges")},
        "recall_events": recall["recall_events"],
        "recalled_tokens": recall["recalled_tokens"],
        "recalled_bytes": recall["recalled_bytes"],
        "recall_shortfalls": recall["shortfalls"],
        "recall_syncs": recall["syncs"],
        "recall_peak_slots_used": recall["peak_slots_used"],
        "recall_slots": run.recall_slots if run.recall_tau is not None else 0,
        "attention_steps": recall["steps"],
        "wall_s": wall,
        "steps": steps,
        "_log_ratios": mon.log_ratios(),
        **extra,
    }
    return out


def run_synthetic(run: RunConfig, qkv: QKVConfig | None = None, *, sink_frames: int = 1, window_frames: int = 4,
                  chunk_frames: int = 1, check_storage: bool = False,
                  progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """A certified rollout over a synthetic Q/K/V stream (see the module docstring)."""
    qkv = qkv or QKVConfig()
    t0 = time.perf_counter()
    stream = synthesize_qkv(qkv, seed=run.seed)
    T = qkv.tokens_per_frame
    C, S, W = chunk_frames * T, sink_frames * T, window_frames * T
    B, H, D, Dv, L = qkv.batch, qkv.heads, qkv.head_dim, qkv.value_dim, qkv.layers
    cache = KVCache((B, S + W, H, D), (B, S + W, H, Dv), policy=run.cache, seq_dim=1, sink=S, window=W, chunk=C,
                    num_layers=L, **run.cache_kwargs())
    cert = Certifier(cache, **run.certifier_kwargs())
    mon = HistoryCheck(cert, check_storage=check_storage, tau=run.recall_tau if run.recall_tau is not None else run.tau)
    n_chunks = qkv.frames // chunk_frames
    extra_steps = []
    kernel_dev = torch.zeros((), dtype=torch.float64)
    for c in range(n_chunks):
        before = cert.stats["recalled_tokens"]
        cache.begin_chunk(c)
        for layer in range(L):
            q, k, v = stream.chunk(layer, c * C, C)
            out, _ = attend(q, cache.layer(layer).update(k, v, q))
            # the attention kernel (float32) against the certificate's float64 o_K: kernel rounding only
            kernel_dev = torch.maximum(kernel_dev, (out.transpose(1, 2).double() - cert.last[layer].out_kept).abs().amax())
        cache.commit_chunk(c)
        extra_steps.append({"chunk": c, **_step_memory(cert),
                            "recalled_tokens": cert.stats["recalled_tokens"] - before})
        if progress is not None:
            progress(c + 1, n_chunks)
    return _finish("synthetic", run, mon, [cert], extra_steps, time.perf_counter() - t0, {
        "generator": qkv.as_dict(),
        "layout": {"sink": S, "window": W, "chunk": C, "capacity": S + W},
        "kernel_vs_float64_max": float(kernel_dev),
    })


def run_dit(run: RunConfig, *, config: str = "tiny", batch: int = 2, chunks: int | None = None,
            check_storage: bool = False, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """A certified rollout of the causal DiT (random seeded weights), one branch."""
    from streamkv.models.config import get_config
    from streamkv.models.dit import CausalVideoDiT
    from streamkv.rollout import StreamingRollout

    t0 = time.perf_counter()
    cfg = get_config(config)
    model = CausalVideoDiT(cfg, seed=run.seed)
    chunks = cfg.max_chunks if chunks is None else chunks
    caches = CacheSet(run.cache, model.cache_spec(batch), **run.cache_kwargs())
    cert = Certifier(caches["cond"], **run.certifier_kwargs())
    mon = HistoryCheck(cert, check_storage=check_storage, tau=run.recall_tau if run.recall_tau is not None else run.tau)
    ro = StreamingRollout(model, cache=caches, batch=batch, seed=run.seed)
    ro.set_prompt("a red kite over a grey sea")
    extra_steps = []
    for c in range(chunks):
        before = cert.stats["recalled_tokens"]
        ro.generate_chunk()
        extra_steps.append({"chunk": c, **_step_memory(cert),
                            "recalled_tokens": cert.stats["recalled_tokens"] - before})
        if progress is not None:
            progress(c + 1, chunks)
    return _finish("dit", run, mon, [cert], extra_steps, time.perf_counter() - t0, {
        "model": {"config": config, "batch": batch, "chunks": chunks, "layers": cfg.layers, "heads": cfg.heads,
                  "head_dim": cfg.head_dim, "chunk_tokens": cfg.chunk_tokens, "sink_tokens": cfg.sink_tokens,
                  "window_tokens": cfg.window_tokens, "passes_per_chunk": 5},
    })


def run_certify(cache: str = "ring", *, tau: float = 0.05, recall: bool = False, recall_slots: int | None = None,
                budget_tau: float = 0.05, summary: SummaryOptions | None = None, seed: int = 0,
                qkv: QKVConfig | None = None, dit_batch: int = 2, dit_chunks: int | None = None,
                progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Both rollouts with the same settings; the totals the CLI reports.

    ``tau`` is the recall threshold (with ``recall``) and the reference for the guarantee
    check; ``budget_tau`` is the mass cache's own eviction budget.
    """
    check_kinds((cache,), evicting_kinds(), "cache")
    from streamkv.budget.mass import check_tau

    tau = check_tau(tau)
    summary = summary or SummaryOptions()
    base = RunConfig(cache=cache, budget_tau=budget_tau, summary=summary, seed=seed,
                     recall_tau=tau if recall else None, tau=tau)
    qkv = qkv or QKVConfig()
    from streamkv.models.config import get_config

    dit_cfg = get_config("tiny")
    n_dit = dit_cfg.max_chunks if dit_chunks is None else dit_chunks
    with threads(1):
        # default hard capacity of the recall slots: the stream's whole history (per head), so
        # that the guarantee can always be met; the report says how much of it was used
        syn_run = replace(base, recall_slots=recall_slots if recall_slots is not None else qkv.tokens)
        syn = run_synthetic(syn_run, qkv, progress=None if progress is None else lambda i, n: progress("synthetic", i, n))
        dit_run = replace(base, recall_slots=recall_slots if recall_slots is not None else n_dit * dit_cfg.chunk_tokens)
        dit = run_dit(dit_run, batch=dit_batch, chunks=n_dit,
                      progress=None if progress is None else lambda i, n: progress("dit", i, n))
    runs = {"synthetic": syn, "dit": dit}
    lr = []
    total = {k: sum(r[k] for r in runs.values()) for k in (
        "queries_checked", "nontrivial", "violations", "violations_mass", "violations_error", "count_mismatch",
        "storage_mismatch", "duplicate_positions", "kept_outside_history", "recall_events", "recalled_tokens", "recalled_bytes", "recall_shortfalls")}
    for r in runs.values():
        lr.append(r.pop("_log_ratios"))
    combined = tightness_stats(torch.cat(lr))
    worst = lambda key: max((r[key] for r in runs.values() if not math.isnan(r[key])), default=math.nan)  # noqa: E731
    out = {
        "cache": cache,
        "tau": tau,
        "recall": recall,
        "budget_tau": budget_tau if "tau" in kind_params(cache) else None,
        **total,
        # the larger (looser) of the two rollouts' figures; per rollout in "tightness"
        "tightness_median": worst("tightness_median"),
        "tightness_p95": worst("tightness_p95"),
        "tightness_all_rows": {"median": combined["tightness_median"], "p95": combined["tightness_p95"]},
        "tightness": {n: {"median": r["tightness_median"], "p95": r["tightness_p95"], "max": r["tightness_max"],
                          "rows": r["tightness_rows"], "partition_median": r["partition_ratio_median"],
                          "partition_p95": r["partition_ratio_p95"]} for n, r in runs.items()},
        "summary_bytes_ratio": max(r["summary_bytes_ratio"] for r in runs.values()),
        "summary_bytes_ratio_max_over_run": max(r["summary_bytes_ratio_max_over_run"] for r in runs.values()),
        "summary_bytes_ratio_le_3pct_from_chunk": {n: r["summary_bytes_ratio_le_3pct_from_chunk"] for n, r in runs.items()},
        "recall_peak_slots_used": {n: r["recall_peak_slots_used"] for n, r in runs.items()},
        "recall_slots": {n: r["recall_slots"] for n, r in runs.items()},
        "certified_error_max": max(r["cert_err_max"] for r in runs.values()),
        "true_error_max": max(r["true_err_max"] for r in runs.values()),
        "summary": asdict(summary),
        "runs": runs,
    }
    out["over_tau"] = sum(r.get("over_tau", 0) for r in runs.values())
    out["oracle_recall_peak"] = {n: r.get("oracle_recall_peak", 0) for n, r in runs.items()}
    return out


def plot_certify(result: dict[str, Any], path: str | Path) -> Path:
    """Certificate vs truth over the stream: per step, max certified and true error (log
    scale) and the median tightness, one column per rollout."""
    plt = pyplot()

    runs = result["runs"]
    fig, axes = plt.subplots(2, len(runs), figsize=(6 * len(runs), 7), squeeze=False)
    for j, (name, r) in enumerate(runs.items()):
        steps = [s for s in r["steps"] if s["nontrivial"]]
        x = [s["chunk"] for s in steps]
        ax = axes[0][j]
        ax.semilogy(x, [max(s["cert_err_max"], 1e-300) for s in steps], "o-", ms=3, label="certified error (max)")
        ax.semilogy(x, [max(s["true_err_max"], 1e-300) for s in steps], "s-", ms=3, label="true error (max)")
        ax.semilogy(x, [max(s["cert_mass_median"], 1e-300) for s in steps], "--", label="certified mass m_hat (median)")
        ax.semilogy(x, [max(s["true_mass_median"], 1e-300) for s in steps], ":", label="true dropped mass m (median)")
        if result.get("recall"):
            ax.axhline(result["tau"], color="k", lw=0.8, label=f"tau = {result['tau']:g}")
        ax.set_title(f"{name}: {result['cache']} cache{' + recall' if result.get('recall') else ''}")
        ax.set_xlabel("chunk")
        ax.legend(fontsize=7)
        ax = axes[1][j]
        ax.semilogy(x, [s["tightness_median"] for s in steps], "o-", ms=3, label="median m_hat / m")
        ax.semilogy(x, [s["tightness_p95"] for s in steps], "s-", ms=3, label="p95 m_hat / m")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xlabel("chunk")
        ax.set_ylabel("tightness (>= 1)")
        ax.legend(fontsize=7)
    return save(fig, path, dpi=110)
