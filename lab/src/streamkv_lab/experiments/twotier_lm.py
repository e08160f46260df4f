"""The two-tier cache on a real model end to end: SmolLM2's perplexity with every layer on the
cache, against the full cache, the ring and TOVA at matched device memory.

The text: the first ``tokens`` tokens of Moby-Dick (:mod:`streamkv_lab.texts`), tokenised by
SmolLM2's tokenizer (:mod:`streamkv_lab.smollm2`), one stream from position 0 fed in prefill
chunks of ``chunk`` tokens through ``model(input_ids=..., cache=...)`` with
``attn_implementation="streamkv"`` (:mod:`streamkv.integrations.transformers`). The perplexity
is computed as :mod:`.lm_eval` computes it: ``exp`` of the mean next-token cross-entropy over
every prediction of the stream (``tokens - 1`` of them; :func:`.lm_stream.stream_losses`).

Caches (:func:`run_twotier_lm`):

``two_tier``     a device budget (``policy`` with ``sink + window`` slots per layer and key head)
                 + 8-bit key sketches of every evicted token + ``recall_slots`` recall slots
                 filled from the host store until every query's certificate is ``<= tau``
                 (``build_cache(..., recall_slots=, certify=)``); optionally every certificate
                 checked against the float64 whole history (:class:`~streamkv.certify.HistoryCheck`)
``full``         a ring that holds the whole stream (nothing evicted: the reference)
``ring``/``tova`` at the two-tier cache's device bytes, in token-equivalents
``budget_only``  the two-tier cache's budget alone (no sketch, no recall): what recall adds
``compressed_tier_quarter`` / ``tova_quarter``
                 at one quarter of the full cache's device bytes: the compressed tier
                 (``build_cache(..., tier=)``: ``tier_fp_fraction`` of the bytes a full-precision
                 TOVA tier 1, the rest ``tier_fmt`` entries of the evicted history, attended; no
                 recall, no certificate: the perplexity of what it attends) and TOVA alone

Device bytes of the two-tier cache: its K/V buffers (budget and recall slots), its policy's
state, and the peak of its key sketches (``sum(s.nbytes for s in certifier.summaries)`` after
each forward, as :mod:`.twotier` counts them). A *token-equivalent* is one position's K and V
in every layer and key head; the ring's and TOVA's ``memory_tokens`` (``sink + window``) is the
two-tier device bytes in token-equivalents, rounded. The evicted K/V the two-tier cache keeps on
the host are not device memory (reported as ``host_bytes``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from .lm_stream import stream_losses

__all__ = ["TwoTierLMConfig", "run_twotier_lm"]


@dataclass(frozen=True)
class TwoTierLMConfig:
    """What :func:`run_twotier_lm` runs (recorded with the result)."""

    tokens: int = 1024
    chunk: int = 16  # prefill chunk (every forward)
    policy: str = "tova"  # the two-tier budget's policy
    sink: int = 4
    window: int = 124  # the budget besides the sinks
    recall_slots: int = 128
    tau: float = 0.05
    sketch_bits: int = 8
    block_tokens: int = 32
    history_check: bool = True  # float64 whole-history check of every certificate
    tier_fmt: str = "int8"  # the compressed tier's tier 2 (at a quarter of the full cache's bytes)
    tier_fp_fraction: float = 0.3
    tier_block: int = 16

    def check(self) -> None:
        """Raise ``ValueError`` naming the first setting that cannot run."""
        if self.chunk < 1 or self.tokens < 2 * self.chunk:
            raise ValueError(f"need chunk >= 1 and tokens >= 2 * chunk, got tokens={self.tokens} chunk={self.chunk}")
        if not self.sink + 2 * self.chunk <= self.sink + self.window < self.tokens:
            raise ValueError(f"the budget sink + window = {self.sink + self.window} must hold two chunks beyond the "
                             f"sinks and be < tokens ({self.tokens})")
        if self.recall_slots < 1 or not 0 < self.tau < 1:
            raise ValueError(f"need recall_slots >= 1 and 0 < tau < 1, got {self.recall_slots}, {self.tau}")


def _token_bytes(cache: Any) -> int:
    """Device bytes of one position's K and V in every layer and key head (the cache's dtype)."""
    kv = cache.kv
    heads = kv.k_shape[kv.head_dim]
    return kv.num_layers * kv.k_shape[0] * heads * (kv.k_shape[-1] + kv.v_shape[-1]) * kv.storage.keys.element_size()


def _policy_bytes(cache: Any) -> int:
    return sum(t.nbytes for t in cache.kv.policy.state().values())


def _perplexity(losses: Tensor, start: int = 0) -> float:
    sel = losses[start:]
    if torch.isnan(sel).any():
        raise RuntimeError("a prediction was not made (NaN loss)")
    return math.exp(float(sel.mean()))


def _stream(model: Any, ids: Tensor, cache: Any, chunk: int, after: Callable[[], None] | None = None,
            progress: Callable[[int], None] | None = None) -> tuple[Tensor, float]:
    """Per-position losses ``[T - 1]`` float64 of one stream through ``cache``, and seconds."""
    losses = torch.full((ids.shape[1] - 1,), math.nan, dtype=torch.float64)

    def tick(n: int) -> None:
        if after is not None:
            after()
        if progress is not None:
            progress(n)

    t0 = time.perf_counter()
    stream_losses(model, ids, losses, span=chunk, forward_kwargs={"cache": cache}, progress=tick)
    return losses, time.perf_counter() - t0


@torch.no_grad()
def run_twotier_lm(cfg: TwoTierLMConfig | None = None, *, model: Any = None, ids: Tensor | None = None,
                   progress: Callable[[str, int], None] | None = None, num_threads: int | None = 1) -> dict[str, Any]:
    """Every cache of the module docstring on one stream; ``model``/``ids`` default to SmolLM2 and
    the first ``cfg.tokens`` tokens of Moby-Dick. The model's attention implementation is
    switched to ``"streamkv"`` and restored. ``progress(cache, tokens_done)`` after each forward.
    ``num_threads``: torch's intra-op threads during the run (:func:`streamkv_lab.env.threads`;
    the certifier's many small float64 ops run ~20x slower with 2 threads on a loaded 2-core
    machine than with 1), restored after.

    Returns ``{config, tokens, token_bytes, matched_memory_tokens, budget_tokens, caches}``; per
    cache ``{memory_tokens, device_bytes, perplexity, perplexity_past_budget, seconds}``
    (``perplexity_past_budget``: over the predictions at positions ``>= sink + window``, the
    same for every cache), the two-tier cache adding ``kv_bytes``, ``recall_slot_bytes``,
    ``policy_state_bytes``, ``sketch_bytes`` (peak), ``host_bytes``, ``recalled_tokens``,
    ``shortfalls``, ``recall_steps`` and, with ``history_check``, ``violations``,
    ``count_mismatch``, ``over_tau``, ``queries_checked``.
    """
    import streamkv.integrations.transformers as skv
    from streamkv_lab.env import threads

    cfg = cfg or TwoTierLMConfig()
    cfg.check()
    if model is None or ids is None:
        from streamkv_lab.smollm2 import load_smollm2, text_tokens
        from streamkv_lab.texts import moby_dick

        loaded, tok = load_smollm2()
        model = loaded if model is None else model
        ids = text_tokens(tok, moby_dick(), cfg.tokens) if ids is None else ids
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < cfg.tokens:
        raise ValueError(f"ids must be [1, >= {cfg.tokens}], got {tuple(ids.shape)}")
    ids = ids[:, : cfg.tokens]
    mcfg, T, C, budget = model.config, cfg.tokens, cfg.chunk, cfg.sink + cfg.window
    tick = (lambda name: (lambda n: progress(name, n))) if progress else (lambda name: None)

    def build(kind: str, memory: int, sink: int, **extra: Any) -> Any:
        return skv.build_cache(mcfg, kind, memory_tokens=memory, sink=sink, chunk=C, dtype=model.dtype, **extra)

    before = mcfg._attn_implementation
    caches: dict[str, dict[str, Any]] = {}
    with threads(num_threads):
        try:
            model.set_attn_implementation(skv.ATTN_IMPLEMENTATION)
            tt = build(cfg.policy, budget, cfg.sink, recall_slots=cfg.recall_slots,
                       certify={"recall_tau": cfg.tau, "sketch_bits": cfg.sketch_bits,
                                "block_tokens": cfg.block_tokens})
            caches["two_tier"] = _two_tier(model, ids, tt, cfg, tick("two_tier"))
            per_token = _token_bytes(tt)
            matched = round(caches["two_tier"]["device_bytes"] / per_token)
            runs = (("full", "ring", T, 0), ("ring", "ring", matched, cfg.sink), ("tova", "tova", matched, cfg.sink),
                    ("budget_only", cfg.policy, budget, cfg.sink))
            for name, kind, memory, sink in runs:
                cache = build(kind, memory, sink)
                losses, seconds = _stream(model, ids, cache, C, progress=tick(name))
                caches[name] = _entry(cache, losses, seconds, memory, budget)
            quarter = T // 4
            tier = _quarter_tier(build, cfg, quarter * per_token, per_token)
            losses, seconds = _stream(model, ids, tier, C, progress=tick("compressed_tier_quarter"))
            caches["compressed_tier_quarter"] = {
                **_entry(tier, losses, seconds, quarter, budget),
                "device_bytes": tier.kv.nbytes + _policy_bytes(tier) + _tier_bytes(tier.tier),
                "budget_bytes": quarter * per_token, "tier1_slots": tier.kv.storage.capacity,
                "tier2_entries": tier.tier.M, "tier2_format": cfg.tier_fmt, "dropped_blocks": tier.tier.stats["dropped_blocks"]}
            cache = build("tova", quarter, cfg.sink)
            losses, seconds = _stream(model, ids, cache, C, progress=tick("tova_quarter"))
            caches["tova_quarter"] = _entry(cache, losses, seconds, quarter, budget)
        finally:
            model.set_attn_implementation(before)
    return {"config": asdict(cfg), "tokens": T, "token_bytes": per_token, "matched_memory_tokens": matched,
            "budget_tokens": budget, "caches": caches}


def _tier_bytes(tier: Any) -> int:
    """A compressed tier's device bytes with tier 3 at its peak."""
    boxes = sum(a.nbytes + b.nbytes + c.nbytes for a, b, c in zip(tier.lo, tier.hi, tier.log_count))
    return tier.nbytes - boxes + tier.stats["box_bytes_peak"]


def _quarter_tier(build: Callable[..., Any], cfg: TwoTierLMConfig, budget: float, per_token: int) -> Any:
    """The compressed tier within ``budget`` device bytes: ``tier_fp_fraction`` of them a TOVA
    tier 1 (``sink`` + window slots), the rest tier-2 entries after room for tier 3's boxes at
    their largest on this stream (every token beyond the ring in a dropped block)."""
    slots = int(cfg.tier_fp_fraction * budget // per_token)
    if slots - cfg.sink < 2 * cfg.chunk:
        raise ValueError(f"the compressed tier's tier 1 ({slots} slots at tier_fp_fraction {cfg.tier_fp_fraction:g}) "
                         f"cannot hold {cfg.sink} sinks and two chunks of {cfg.chunk}")
    opts = {"fmt": cfg.tier_fmt, "block": cfg.tier_block, "certify": False}
    probe = build("tova", slots, cfg.sink, tier={**opts, "capacity": cfg.tier_block})
    t = probe.tier
    per_entry = t.L * t.H * t.bytes_per_entry()
    left = budget - probe.kv.nbytes - _policy_bytes(probe) - (t.nbytes - per_entry * cfg.tier_block)
    cap = cfg.tier_block
    for c in range(cfg.tier_block, int(left // per_entry) + 1, cfg.tier_block):
        if c * per_entry + t.tier3_bytes(-(-max(0, cfg.tokens - c) // cfg.tier_block) + 1) <= left:
            cap = c
    return build("tova", slots, cfg.sink, tier={**opts, "capacity": cap})


def _entry(cache: Any, losses: Tensor, seconds: float, memory: int, budget: int) -> dict[str, Any]:
    return {"memory_tokens": memory, "device_bytes": cache.kv.nbytes + _policy_bytes(cache),
            "perplexity": _perplexity(losses), "perplexity_past_budget": _perplexity(losses, budget),
            "seconds": seconds}


def _two_tier(model: Any, ids: Tensor, cache: Any, cfg: TwoTierLMConfig,
              progress: Callable[[int], None] | None) -> dict[str, Any]:
    """The two-tier cache's entry: perplexities, device bytes (the sketches' peak sampled after
    every forward), recall counters and, with ``cfg.history_check``, the whole-history check."""
    from streamkv.certify import HistoryCheck

    cert = cache.certifier
    check = HistoryCheck(cert, tau=cfg.tau) if cfg.history_check else None
    peak = [0]

    def sample_sketch() -> None:
        peak[0] = max(peak[0], sum(s.nbytes for s in cert.summaries))

    budget = cfg.sink + cfg.window
    losses, seconds = _stream(model, ids, cache, cfg.chunk, after=sample_sketch, progress=progress)
    policy_bytes = _policy_bytes(cache)
    out = {**_entry(cache, losses, seconds, budget, budget),
           "device_bytes": cache.kv.nbytes + policy_bytes + peak[0], "kv_bytes": cache.kv.nbytes,
           "recall_slot_bytes": cache.kv.nbytes * cfg.recall_slots // (budget + cfg.recall_slots),
           "policy_state_bytes": policy_bytes, "sketch_bytes": peak[0], "host_bytes": cert.store.nbytes,
           "recalled_tokens": cert.stats["recalled_tokens"], "shortfalls": cert.stats["shortfalls"],
           "recall_steps": cert.stats["steps"]}
    if check is not None:
        r = check.result()
        out.update(violations=r["violations"], count_mismatch=r["count_mismatch"], over_tau=r.get("over_tau"),
                   queries_checked=r["queries_checked"])
    return out
