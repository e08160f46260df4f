"""The caches judged on a real trained model: perplexity of a causal LM on a long text, each
cache at matched KV memory, against the full cache and the per-query oracle.

The text (``ids [1, tokens]``) is cut into segments of ``segment`` tokens; each segment is
a fresh stream (positions from 0; keys carry absolute RoPE positions). Every segment is fed
to the model through each cache:

``stream`` modes   the whole segment in spans of ``chunk`` tokens (the cache's chunk), for
                   each chunk in ``chunks``; the loss of every prediction in the segment
``decode`` mode    token by token: the segment up to ``split`` (the last chunk boundary at or
                   before ``segment - decode``) in spans of the largest chunk (a chunked
                   prefill, the cache's chunk), then ``decode`` tokens one per forward (the
                   cache's state is saved at the split and the same prefill continues in
                   chunks, so both share it); the loss of the predictions made by those
                   ``decode`` forwards

Caches (``memory_tokens`` = ``sink + window`` slots per layer and key head, equal KV bytes):
``full`` (a ring that holds the segment: nothing evicted; streamed at the largest chunk and
used as the reference of every mode, since it is exact at any chunk), ``window`` (no sinks),
``ring`` (sinks + window), ``mass(tau=...)``, ``h2o``, ``tova``; and the ``oracle``
(:mod:`.lm_oracle`) per tau and mode, whose memory is its mean kept keys per (query, head).

Per entry: perplexity over the mode's predictions; ``perplexity_evicting`` over the
predictions made at positions ``>= memory_tokens`` (where a bounded cache may have evicted)
beside the full cache's on the same predictions; the attention error of each layer against
full-history attention of the same queries (:class:`.lm_stream.AttentionErrors`).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor

from streamkv_lab.kinds import scored_kinds

from .lm_config import LMEvalConfig, cache_runs, plan_tokens
from .lm_oracle import KWARG, ORACLE_ATTENTION, OracleRun, register_oracle
from .lm_stream import AttentionErrors, stream_losses

__all__ = ["LMEvalConfig", "evaluate", "plan_tokens", "targets"]

class _Run:
    """The losses of one cache (or oracle) in every mode it ran: ``[segments, segment - 1]``
    float64 per mode key (NaN where the mode made no prediction)."""

    def __init__(self, segments: int, segment: int) -> None:
        self.shape = (segments, segment - 1)
        self.losses: dict[str, Tensor] = {}
        self.seconds: dict[str, float] = {}  # per mode key (a decode tail is counted in its prefill's mode)

    def timed(self, key: str, seconds: float) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds

    def mode(self, key: str) -> Tensor:
        return self.losses.setdefault(key, torch.full(self.shape, math.nan, dtype=torch.float64))


def _ppl(losses: Tensor, mask: Tensor) -> float | None:
    sel = losses[mask]
    if not sel.numel():
        return None
    if torch.isnan(sel).any():
        raise RuntimeError("a prediction of the mode was not made (NaN loss)")
    return math.exp(float(sel.mean()))


@torch.no_grad()
def evaluate(model: Any, ids: Tensor, cfg: LMEvalConfig,
             progress: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """Run the evaluation (see the module docstring) of ``model`` (a transformers causal LM,
    eval mode; its attention implementation is switched and restored) on ``ids [1, >=
    tokens]`` (the first ``tokens`` are used). ``progress(description, tokens_done)``.

    Returns ``{config, tokens, segment, segments, chunk, decode, prefill_chunk, caches:
    {label: [entry]}, oracle: [entry], targets}``; a cache entry is ``{mode, chunk,
    memory_tokens, perplexity, predictions, perplexity_evicting, full_perplexity_evicting,
    predictions_evicting, attn_error_mean, attn_error_p99, attn_error_layers, resident_mean,
    seconds}``, an oracle entry ``{tau, mode, chunk, memory_tokens (mean kept keys per (query,
    head)), memory_p99, memory_max, perplexity, full_perplexity, attn_error_*, seconds}``.
    Perplexities are ``exp`` of the mean next-token loss (log-softmax in the logits' dtype,
    summed in float64). Nothing of ``model`` changes but its attention implementation, which
    is restored.
    """
    from transformers import DynamicCache

    import streamkv.integrations.transformers as skv

    register_oracle()
    mcfg = model.config
    cfg.check(getattr(mcfg, "max_position_embeddings", cfg.segment))
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < cfg.tokens:
        raise ValueError(f"ids must be [1, >= {cfg.tokens}], got {tuple(ids.shape)}")
    S, nseg = cfg.segment, cfg.tokens // cfg.segment
    segs = [ids[:, i * S : (i + 1) * S] for i in range(nseg)]
    C = max(cfg.chunks)
    split = cfg.split()
    stop = split + cfg.decode  # the token-by-token tail: [split, stop)
    heads = mcfg.num_attention_heads
    kv_heads = getattr(mcfg, "num_key_value_heads", None) or heads
    head_dim = getattr(mcfg, "head_dim", None) or mcfg.hidden_size // heads
    errors = AttentionErrors(mcfg.num_hidden_layers, kv_heads, head_dim, S, cfg.error_stride)
    tick = (lambda what: (lambda n: progress(what, n))) if progress else (lambda what: None)
    before = mcfg._attn_implementation
    runs: dict[str, _Run] = {}
    meta: dict[str, dict[str, Any]] = {}

    def stream_cache(label: str, kind: str, memory: int, chunk: int, params: dict[str, Any], decode: bool) -> None:
        run = runs.setdefault(label + f"@{memory}", _Run(nseg, S))
        meta[label + f"@{memory}"] = {"label": label, "memory_tokens": memory}
        t0 = time.perf_counter()

        def build() -> Any:
            return skv.build_cache(mcfg, kind, memory_tokens=memory, chunk=chunk, on_attention=errors,
                                   dtype=model.dtype, **params)

        key = f"c{chunk}"
        for i, seg in enumerate(segs):
            cache = build()
            errors.tag = f"{label}@{memory}/{key}"
            common = {"forward_kwargs": {"cache": cache}, "progress": tick(f"{label} m={memory} c={chunk}")}
            if not decode:
                stream_losses(model, seg, run.mode(key)[i], span=chunk, **common)
                continue
            stream_losses(model, seg, run.mode(key)[i], span=chunk, stop=split, **common)
            cache.kv.commit()  # the prefill's last span, as the next forward would; then save the state
            tail = build()
            tail.kv.load_state_dict(cache.kv.state_dict())
            errors.tag = f"{label}@{memory}/decode"
            stream_losses(model, seg, run.mode("decode")[i], span=1, start=split, stop=stop,
                          forward_kwargs={"cache": tail}, progress=tick(f"{label} m={memory} decode"))
            errors.tag = f"{label}@{memory}/{key}"
            stream_losses(model, seg, run.mode(key)[i], span=chunk, start=split, **common)
        run.timed(key, time.perf_counter() - t0)

    def oracle(tau: float, chunk: int, decode: bool) -> None:
        name = f"oracle(tau={tau:g})@c{chunk}"
        run = runs.setdefault(name, _Run(nseg, S))
        stats = OracleRun(tau, cfg.sink, chunk, mcfg.num_hidden_layers, cfg.error_stride)
        tail_stats = OracleRun(tau, cfg.sink, 1, mcfg.num_hidden_layers, cfg.error_stride)
        t0 = time.perf_counter()
        for i, seg in enumerate(segs):
            dc = DynamicCache(config=mcfg)
            common = {"span": cfg.oracle_span, "progress": tick(f"oracle tau={tau:g} c={chunk}")}
            stream_losses(model, seg, run.mode(f"c{chunk}")[i], stop=split if decode else S,
                          forward_kwargs={"cache": dc, KWARG: stats}, **common)
            if decode:
                dc_tail = copy.deepcopy(dc)
                stream_losses(model, seg, run.mode("decode")[i], start=split, stop=stop,
                              forward_kwargs={"cache": dc_tail, KWARG: tail_stats}, **common)
                stream_losses(model, seg, run.mode(f"c{chunk}")[i], start=split,
                              forward_kwargs={"cache": dc, KWARG: stats}, **common)
        run.timed(f"c{chunk}", time.perf_counter() - t0)
        meta[name] = {"tau": tau, "chunk": chunk, "stats": stats.summary(),
                      "tail_stats": tail_stats.summary() if decode else None}

    try:
        model.set_attn_implementation(skv.ATTN_IMPLEMENTATION)
        stream_cache("full", "ring", S, C, {"sink": 0}, bool(cfg.decode))
        for chunk in cfg.chunks:
            for memory in cfg.memory:
                for label, kind, params in cache_runs(cfg):
                    stream_cache(label, kind, memory, chunk, params, bool(cfg.decode) and chunk == C)
        model.set_attn_implementation(ORACLE_ATTENTION)
        for chunk in cfg.chunks:
            for tau in cfg.oracle_taus:
                oracle(tau, chunk, bool(cfg.decode) and chunk == C)
    finally:
        model.set_attn_implementation(before)
    return _assemble(cfg, runs, meta, errors, C, split)


def _assemble(cfg: LMEvalConfig, runs: dict[str, _Run], meta: dict[str, dict[str, Any]], errors: AttentionErrors,
              C: int, split: int) -> dict[str, Any]:
    S, nseg = cfg.segment, cfg.tokens // cfg.segment
    pos = torch.arange(S - 1).expand(nseg, S - 1)  # the position each prediction is made at
    modes = [(f"c{c}", c, "stream", torch.ones(nseg, S - 1, dtype=torch.bool)) for c in cfg.chunks]
    if cfg.decode:
        modes.append(("decode", 1, "decode", (pos >= split) & (pos < split + cfg.decode)))
    full = runs[f"full@{S}"]
    caches: dict[str, list[dict[str, Any]]] = {}
    oracles: list[dict[str, Any]] = []
    for key, chunk, mode, mask in modes:
        full_key = f"c{C}" if mode == "stream" else "decode"  # the full cache is exact at any chunk
        full_losses = full.losses[full_key]
        for name, run in runs.items():
            if key not in run.losses and not (name.startswith("full@") and mode == "stream"):
                continue
            losses = run.losses[key] if key in run.losses else full_losses
            base = {"mode": mode, "chunk": chunk, "predictions": int(mask.sum()), "perplexity": _ppl(losses, mask),
                    "seconds": run.seconds.get(f"c{C}" if mode == "decode" else full_key if name.startswith("full@")
                                               else key)}
            if mode == "decode":
                base["prefill_chunk"] = C
                base[f"chunk{C}_perplexity_same_predictions"] = _ppl(run.losses[f"c{C}"], mask)
            if name.startswith("oracle("):
                m = meta[name]
                stats = m["tail_stats"] if mode == "decode" else m["stats"]
                if m["chunk"] != (C if mode == "decode" else chunk):
                    continue
                oracles.append({"tau": m["tau"], **base, **stats,
                                "full_perplexity": _ppl(full_losses, mask)})
                continue
            m = meta[name]
            memory = m["memory_tokens"]
            late = mask & (pos >= memory)
            entry = {**base, "memory_tokens": memory,
                     "perplexity_evicting": _ppl(losses, late), "full_perplexity_evicting": _ppl(full_losses, late),
                     "predictions_evicting": int(late.sum()),
                     **errors.summary(f"{name}/{full_key if name.startswith('full@') else key}")}
            if name.startswith("full@"):
                entry["streamed_at_chunk"] = C
            caches.setdefault(m["label"], []).append(entry)
    result = {"config": asdict(cfg), "tokens": cfg.tokens, "segment": S, "segments": nseg,
              "chunk": list(cfg.chunks) + ([1] if cfg.decode else []), "decode": cfg.decode, "prefill_chunk": C,
              "caches": caches, "oracle": oracles}
    result["targets"] = targets(result)
    return result


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per mode: at each memory the best scored policy (:func:`~streamkv_lab.kinds.scored_kinds`) against the ring
    (sinks + window), and whether one comes within 2% of the full cache's perplexity at
    ``<= 25%`` of its memory (the segment)."""
    out = []
    S = result["segment"]
    full = {e["mode"] + str(e["chunk"]): e for e in result["caches"].get("full", [])}
    for e_full in full.values():
        mode, chunk = e_full["mode"], e_full["chunk"]
        rows = []
        memories = sorted({e["memory_tokens"] for es in result["caches"].values() for e in es
                           if e["mode"] == mode and e["chunk"] == chunk and e["memory_tokens"] < S})
        for m in memories:
            at = {label: e for label, es in result["caches"].items() for e in es
                  if e["mode"] == mode and e["chunk"] == chunk and e["memory_tokens"] == m}
            scored = {k: e for k, e in at.items() if k.split("(")[0] in scored_kinds()}
            best = min(scored, key=lambda k: scored[k]["perplexity"]) if scored else None
            ring = at.get("ring")
            row = {"memory_tokens": m, "memory_fraction": m / S, "best": best,
                   "best_perplexity": scored[best]["perplexity"] if best else None,
                   "ring_perplexity": ring["perplexity"] if ring else None}
            row["beats_ring"] = None if not (best and ring) else row["best_perplexity"] < row["ring_perplexity"]
            row["ratio_to_full"] = row["best_perplexity"] / e_full["perplexity"] if best else None
            rows.append(row)
        small = [r for r in rows if r["memory_fraction"] <= 0.25 and r["ratio_to_full"] is not None]
        out.append({"mode": mode, "chunk": chunk, "full_perplexity": e_full["perplexity"], "rows": rows,
                    "beats_ring_everywhere": all(r["beats_ring"] for r in rows) if rows else None,
                    "within_2pct_at_25pct_memory": any(r["ratio_to_full"] <= 1.02 for r in small) if small else None,
                    "best_ratio_at_25pct_memory": min((r["ratio_to_full"] for r in small), default=None)})
    return out
