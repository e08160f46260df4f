"""The compressed resident tier (:class:`~streamkv.certify.tier.CompressedTier`) and the per-chunk
oracle on a :class:`~.twotier.Stream`, at a given device byte budget (``streamkv certify --real``).

``compressed_tier``: tier 1 a full-precision ``policy`` cache (sinks, the open span, what TOVA
ranks highest, and ``recall`` recall slots), tier 2 the evicted history quantised (``fmt``) and
attended, tier 3 block boxes beyond tier 2's horizon, recall from the host planned once per
chunk. Sizing (:func:`tier_geometry`): ``fp_fraction`` of the budget buys tier 1 (K/V slots of
the stream's dtype and the policy's state), the rest tier-2 entries at their own bytes (codes +
scales + a live flag); device bytes are counted from the allocated tensors (tier 3 at its peak).

Every step is checked against float64 full history over the original K/V: a *violation* is a
(query, head, channel) whose true error exceeds its certificate, or a (query, head) whose true
tier-3 mass exceeds its mass bound. Tightness: certified / true L-inf error (the quantisation
bound is a worst case over every rounding; the true rounding errors partly cancel) and, where
tier 3 holds tokens, certified / true mass.

``run_quarter``: the tier's cost. The full cache (a ring holding the stream), the ring and TOVA at a
quarter of its device bytes, and the tier at the same quarter with a TOVA or a ring tier 1, each
without certificates, certified, and certified with recall, all timed in one run (ms per chunk,
the float64 checks excluded; ``ms_per_chunk_in_certificates`` the certificates' and recall
plans' share).

``per_chunk_oracle`` (:class:`~streamkv.budget.oracles.PerChunkMass`): per key head and chunk,
the ``memory`` tokens of the largest summed attention over the chunk's queries (every query head
of the group), chosen on the float64 full history; sinks and the current chunk protected.

Recall is priced at the self-forcing shape (:func:`self_forcing_h2d`): the measured recall per
new token scaled to 1,560 tokens/frame, 3-frame chunks, 30 layers x 12 heads x 128 dims, bf16,
against a 35 GB/s host link; the 4 denoising passes share one recall.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from streamkv import KVCache
from streamkv.attention import attend
from streamkv.budget.oracles import PerChunkMass
from streamkv.certify.tier import CompressedTier
from streamkv_lab.kinds import kind_params

__all__ = ["TierConfig", "tier_geometry", "run_tier", "run_quarter", "QUARTER_CONFIGS", "QUARTER_CONFIGS_TOY",
           "per_chunk_oracle",
           "self_forcing_h2d", "SELF_FORCING"]


@dataclass(frozen=True)
class TierConfig:
    """One compressed-tier configuration (recorded with its result)."""

    fmt: str = "int4"
    fp_fraction: float = 0.5  # of the device bytes, for tier 1 (full precision)
    recall_fraction: float = 0.25  # of tier 1's slots, as recall slots
    block: int = 16
    tau: float | None = 0.01  # recall until every query's certified L-inf error <= tau x the value range (None: no recall)
    policy: str = "tova"
    certify: bool = True  # False: the tiers attend, nothing is certified (no recall)

    def label(self) -> str:
        extra = "" if self.policy == "tova" else f", {self.policy} tier 1"
        if not self.certify:
            extra += ", no certificates"
        elif not self.tau:
            extra += ", no recall"
        return f"{self.fmt}, {round(100 * self.fp_fraction)}% full precision{extra}"

    @property
    def recalls(self) -> bool:
        return bool(self.tau) and self.certify

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _probe(stream, cfg: TierConfig, sink: int, window: int, recall: int, capacity: int) -> tuple[KVCache, CompressedTier]:
    B, _, H, D = stream.k[0].shape
    Dv = stream.v[0].shape[-1]
    cache = KVCache((B, sink + window, H, D), (B, sink + window, H, Dv), policy=cfg.policy, seq_dim=1, sink=sink,
                    window=window, chunk=stream.chunk, num_layers=stream.layers, recall_slots=recall,
                    dtype=stream.k[0].dtype, device=stream.k[0].device, **kind_params(cfg.policy))
    tier = CompressedTier(cache, fmt=cfg.fmt, capacity=capacity, block=cfg.block,
                          recall_tau=cfg.tau if recall else None, causal=stream.causal, scale=stream.scale,
                          certify=cfg.certify)
    return cache, tier


def tier_geometry(stream, cfg: TierConfig, budget_bytes: float, sink: int) -> dict[str, int]:
    """``sink``, ``window``, ``recall`` slots and tier-2 ``capacity`` for ``budget_bytes``: tier 1
    takes ``fp_fraction`` of it (its K/V slots and policy state, as allocated), tier 2 what is left
    over its per-entry bytes (a multiple of ``block``) after room for tier 3's boxes at their
    largest on this stream (every token beyond the ring in a dropped block). Raises ``ValueError``
    naming the budget when tier 1 cannot hold the sinks and two chunks, or no tier-2 block fits."""
    B, _, H, D = stream.k[0].shape
    Dv, L, C = stream.v[0].shape[-1], stream.layers, stream.chunk
    per_slot = L * B * H * (D + Dv) * stream.k[0].element_size()
    _, probe = _probe(stream, cfg, sink, 2 * C, cfg.block if cfg.recalls else 0, cfg.block)
    per_entry = L * H * probe.bytes_per_entry()
    fixed2 = probe.nbytes - per_entry * cfg.block  # the value boxes and ranges (independent of capacity)
    slots = int(cfg.fp_fraction * budget_bytes // per_slot)
    recall = max(cfg.block, int(round(cfg.recall_fraction * slots / cfg.block)) * cfg.block) if cfg.recalls else 0
    window = slots - sink - recall
    if window < 2 * C:
        raise ValueError(f"budget {budget_bytes:.0f} B with fp_fraction {cfg.fp_fraction:g}: tier 1 holds {slots} slots, "
                         f"too few for {sink} sinks, two chunks of {C} and {recall} recall slots")
    cache, _ = _probe(stream, cfg, sink, window, recall, cfg.block)
    used = cache.storage.nbytes + sum(t.nbytes for t in cache.policy.state().values())
    # tier 3 at its largest for this stream: every entry beyond the ring, a box (lo, hi) and a count per block
    left = budget_bytes - used - fixed2
    capacity = 0
    for cap in range(cfg.block, int(left // per_entry) // cfg.block * cfg.block + 1, cfg.block):
        boxes = -(-max(0, stream.tokens - cap) // cfg.block) + 1
        if cap * per_entry + probe.tier3_bytes(boxes) <= left:
            capacity = cap
    if not capacity:
        raise ValueError(f"budget {budget_bytes:.0f} B with fp_fraction {cfg.fp_fraction:g}: tier 1 takes {used} B, too "
                         f"few left for one tier-2 block and tier 3's boxes")
    return {"sink": sink, "window": window, "recall": recall, "capacity": capacity}


def _rows(x: Tensor, H: int) -> Tensor:
    """``[B, C, Hq, Dv]`` -> the certificate's rows ``[B, H, G * C, Dv]``."""
    B, C, Hq, Dv = x.shape
    return x.permute(0, 2, 1, 3).reshape(B, H, (Hq // H) * C, Dv)


def _parts(cert, true_max: Tensor) -> Tensor:
    """Each row's certificate (at its largest channel) in its three parts, over the row's true error
    ``[3, rows]`` (rows with a true error > 0): the evicted mass times the gap (tier 3), the held
    tiers' error (tier 2's quantisation: ``error - mass gap - out_error``, with the certificate's
    float64 finishing margin, ~1e-12 of it), and the float32 rounding of the certificate's own
    output (``out_error``)."""
    c = cert.error.argmax(-1, keepdim=True)
    at = lambda x: x.gather(-1, c).squeeze(-1)  # noqa: E731
    evicted = cert.mass * at(cert.gap)
    rounding = at(cert.out_error)
    held = at(cert.error) - evicted - rounding
    ok = true_max > 0
    return torch.stack([evicted[ok], held[ok].clamp(min=0.0), rounding[ok]]) / true_max[ok]


def _looseness(parts: list[Tensor]) -> dict[str, Any] | None:
    """Where the certificate's distance from the truth comes from: per part (:func:`_parts`), the
    median over rows of that part over the true error, and the share of rows it dominates."""
    if not parts:
        return None
    p = torch.cat(parts, -1).double()
    if not p.shape[-1]:
        return None
    top = p.argmax(0)
    return {name: {"over_true_median": float(p[i].median()), "dominant_share": float((top == i).double().mean())}
            for i, name in enumerate(("evicted_mass_times_gap", "held_tiers_quantisation", "float32_rounding"))}


def run_tier(stream, cfg: TierConfig, budget_bytes: float, *, sink: int, fulls: list[Tensor], vranges: list[Tensor],
             probs: list[Tensor]) -> dict[str, Any]:
    """One compressed-tier run at ``budget_bytes`` (see the module docstring); ``probs``: the
    float64 full-history attention per layer ``[B, Hq, T, T]`` (the tier-3 mass check)."""
    from .twotier import _errors, _summary

    geo = tier_geometry(stream, cfg, budget_bytes, sink)
    cache, tier = _probe(stream, cfg, geo["sink"], geo["window"], geo["recall"], geo["capacity"])
    B, _, H, _ = stream.k[0].shape
    C, T = stream.chunk, stream.tokens
    outs = [torch.empty_like(f) for f in fulls]
    viol = mass_viol = 0
    tight_e, tight_m, gap_out, parts = [], [], 0.0, []
    check_s = 0.0
    t0 = time.perf_counter()
    for c in range(T // C):
        sl = slice(c * C, (c + 1) * C)
        cache.begin_tokens(C)
        for layer in range(stream.layers):
            q, k, v = stream.q[layer][:, sl], stream.k[layer][:, sl], stream.v[layer][:, sl]
            out = attend(q, cache.layer(layer).update(k, v, q), causal=tier.causal, scale=tier.scale)[0]
            t1 = time.perf_counter()
            outs[layer][:, sl] = out.double()
            cert = tier.last[layer]
            if cert is None:  # an uncertified run: the output's error only
                check_s += time.perf_counter() - t1
                continue
            true = (_rows(fulls[layer][:, sl], H) - cert.out_kept).abs()
            viol += int((true > cert.error).sum())
            gap_out = max(gap_out, float((_rows(out.double(), H) - cert.out_kept).abs().max()))
            te, ce = true.amax(-1), cert.error.amax(-1)
            tight_e.append((ce[te > 0] / te[te > 0]).flatten())
            parts.append(_parts(cert, te))
            held = tier.held(layer)  # [H, end]
            p = probs[layer][:, :, sl, : held.shape[1]]  # [B, Hq, C, end]
            p = p.reshape(B, H, -1, C, held.shape[1]).reshape(B, H, -1, held.shape[1])
            m_true = (p * (~held).unsqueeze(0).unsqueeze(2)).sum(-1)  # [B, H, G*C]
            mass_viol += int((m_true > cert.mass).sum())
            has = m_true > 0
            tight_m.append((cert.mass[has] / m_true[has]).flatten())
            check_s += time.perf_counter() - t1
        cache.commit()
    seconds = time.perf_counter() - t0 - check_s
    errs, rels = zip(*(_errors(outs[i], fulls[i], vranges[i]) for i in range(stream.layers)))
    te = torch.cat(tight_e) if tight_e else torch.zeros(0)
    tm = torch.cat(tight_m) if tight_m else torch.zeros(0)
    policy_bytes = sum(t.nbytes for t in cache.policy.state().values())
    tier_bytes = tier.nbytes - sum(a.nbytes + b.nbytes + c.nbytes for a, b, c in zip(tier.lo, tier.hi, tier.log_count))
    device = cache.storage.nbytes + policy_bytes + tier_bytes + tier.stats["box_bytes_peak"]
    spans = tier.stats["h2d_bytes_per_span"]
    chunks = T // C
    return {
        **_summary(list(errs), list(rels)), "device_bytes": device, "budget_bytes": budget_bytes,
        "tier1_kv_bytes": cache.storage.nbytes, "policy_state_bytes": policy_bytes,
        "tier2_bytes": tier_bytes, "tier3_box_bytes_peak": tier.stats["box_bytes_peak"],
        "host_bytes": tier.host_bytes, "geometry": geo, "config": cfg.as_dict(), "label": cfg.label(),
        "ms_per_chunk": 1e3 * seconds / chunks, "certified": cfg.certify,
        "ms_per_chunk_in_certificates": 1e3 * tier.stats["certify_seconds"] / chunks,
        "violations": (viol + mass_viol) if cfg.certify else None, "error_violations": viol, "mass_violations": mass_viol,
        "tightness_median": float(te.median()) if te.numel() else None, "certified_steps": tier.stats["steps"],
        "tightness_p95": float(te.quantile(0.95)) if te.numel() else None,
        "mass_tightness_median": float(tm.median()) if tm.numel() else None,
        "looseness": _looseness(parts),
        "output_vs_certified_output_max": gap_out,
        "recalled_tokens": tier.stats["recalled_tokens"], "recalled_tokens_per_chunk": tier.stats["recalled_tokens"] / chunks,
        "h2d_bytes_per_chunk": sum(spans) / chunks, "h2d_bytes_per_chunk_max": max(spans, default=0),
        "shortfalls": tier.stats["shortfalls"], "dropped_blocks": tier.stats["dropped_blocks"],
        "capacity": geo["sink"] + geo["window"], "perplexity": None,
        "recall_held_tokens": None, "oracle_recall_tokens": None,
        "h2d_self_forcing": self_forcing_h2d(tier.stats["recalled_tokens"] / (chunks * stream.layers * H * C)),
    }


def per_chunk_oracle(stream, memory_tokens: float, fulls: list[Tensor], vranges: list[Tensor], sink: int,
                     probs: list[Tensor]) -> dict[str, Any]:
    """The per-chunk oracle at ``memory_tokens`` per (layer, key head), its error against full attention."""
    from .twotier import _errors, _summary, _token_bytes

    size = max(1, int(round(memory_tokens)))
    C, T = stream.chunk, stream.tokens
    errs, rels = [], []
    for layer, p in enumerate(probs):
        B, Hq, _, _ = p.shape
        H = stream.k[layer].shape[2]
        v = stream.v[layer].double().transpose(1, 2).repeat_interleave(Hq // H, dim=1)  # [B, Hq, T, Dv]
        out = torch.empty(B, Hq, T, v.shape[-1], dtype=torch.float64)
        for c in range(T // C):
            n = (c + 1) * C
            pc = p[:, :, c * C:(c + 1) * C, :n]  # [B, Hq, C, n]
            rows = pc.reshape(B, H, (Hq // H) * C, n)  # the chunk's rows of each key head
            keep = PerChunkMass(size, protect_sinks=sink, protect_recent=C).keep(rows).reshape(pc.shape)
            w = pc * keep
            out[:, :, c * C:(c + 1) * C] = (w / w.sum(-1, keepdim=True)) @ v[:, :, :n]
        e, r = _errors(out.transpose(1, 2), fulls[layer], vranges[layer])
        errs.append(e)
        rels.append(r)
    return {**_summary(errs, rels), "memory_tokens": size, "device_bytes": int(size * _token_bytes(stream)),
            "perplexity": None, "violations": None, "tightness_median": None, "tightness_p95": None,
            "recalled_tokens": None, "recalled_tokens_per_chunk": None, "recall_held_tokens": None,
            "oracle_recall_tokens": None, "shortfalls": None, "ms_per_chunk": None}


#: the self-forcing (Wan 2.1 1.3B) shape recall is priced at
SELF_FORCING = {"tokens_per_frame": 1560, "frames_per_chunk": 3, "layers": 30, "heads": 12, "head_dim": 128,
                "bytes_per_element": 2, "passes": 4, "link_GBps": 35.0, "params": 1.3e9, "peak_TFLOPs": 989.0}


def self_forcing_h2d(recalled_per_new_token: float) -> dict[str, float]:
    """Host-to-device bytes and time per chunk at :data:`SELF_FORCING` for a measured recall of
    ``recalled_per_new_token`` (recalled (token, head, layer) triples per new (token, head,
    layer) of the stream), against a floor on one chunk's compute time: the linear layers'
    ``2 x params x tokens x passes`` FLOPs at the peak bf16 rate (attention and overheads come
    on top, so the real chunk time is longer)."""
    s = SELF_FORCING
    tokens = s["tokens_per_frame"] * s["frames_per_chunk"]
    per_token = s["layers"] * s["heads"] * 2 * s["head_dim"] * s["bytes_per_element"]  # K and V, every layer and head
    h2d = recalled_per_new_token * tokens * per_token  # one recall, shared by the passes
    ms = 1e3 * h2d / (s["link_GBps"] * 1e9)
    floor = 1e3 * 2 * s["params"] * tokens * s["passes"] / (s["peak_TFLOPs"] * 1e12)
    return {"h2d_bytes_per_chunk": h2d, "h2d_ms_per_chunk": ms, "compute_floor_ms_per_chunk": floor,
            "within_compute": ms <= floor}


#: the compressed tier at a quarter of the full cache's bytes: a TOVA and a ring tier 1, each without
#: certificates, certified without recall, and certified with recall (the cost of each part)
QUARTER_CONFIGS = tuple(TierConfig("int8", 0.3, policy=pol, certify=cert, tau=tau)
                        for pol in ("tova", "ring") for cert, tau in ((False, None), (True, None), (True, 0.01)))
#: the toy model's 32 sink tokens and 32-token chunks need more of tier 1 (as in its sweep)
QUARTER_CONFIGS_TOY = tuple(TierConfig("int8", 0.6, recall_fraction=0.15, policy=c.policy, certify=c.certify, tau=c.tau)
                            for c in QUARTER_CONFIGS)


def run_quarter(stream, *, sink: int, fulls: list[Tensor], vranges: list[Tensor], probs: list[Tensor],
                configs: tuple[TierConfig, ...] = QUARTER_CONFIGS, say=None) -> dict[str, Any]:
    """The full cache (a ring holding the whole stream), the ring and TOVA at a quarter of its
    device bytes, and the compressed tier at the same quarter (``configs``), all timed in this run
    (ms per chunk, the checks excluded): the tier's time against the full cache's."""
    from .twotier import _run_cache, _token_bytes

    say = say or (lambda _: None)
    T = stream.tokens
    per_token = _token_bytes(stream)
    budget = T * per_token / 4
    caches: dict[str, Any] = {}
    say("quarter: full")
    caches["full"] = _run_cache(stream, "ring", sink=sink, window=T - sink, fulls=fulls, vranges=vranges)
    W = int(budget // per_token) - sink
    for kind in ("ring", "tova"):
        say(f"quarter: {kind}")
        caches[kind] = _run_cache(stream, kind, sink=sink, window=W, fulls=fulls, vranges=vranges, **kind_params(kind))
    for cfg in configs:
        name = f"tier_{cfg.policy}_" + ("nocert" if not cfg.certify else "cert_recall" if cfg.tau else "cert")
        say(f"quarter: {name}")
        try:
            caches[name] = run_tier(stream, cfg, budget, sink=sink, fulls=fulls, vranges=vranges, probs=probs)
        except ValueError as exc:
            caches[name] = {"label": cfg.label(), "config": cfg.as_dict(), "skipped": str(exc)}
    full_ms = caches["full"]["ms_per_chunk"]
    ratios = {f"{k}_ms_over_full": c["ms_per_chunk"] / full_ms for k, c in caches.items() if "ms_per_chunk" in c}
    return {"budget_bytes": budget, "full_bytes": T * per_token, "caches": caches, "ratios": ratios}
