"""The two-tier cache on real and synthetic attention, against the ring, the scored caches and
the per-query oracle at matched device memory (``streamkv certify --real``).

A *stream* is the attention inputs of a model, per layer: queries ``[B, T, Hq, D]`` (after RoPE;
``Hq`` a multiple of the key heads), keys ``[B, T, H, D]`` (after RoPE) and values, replayed
through each cache span by span exactly as a model would (``update(k, v, q)`` then ``attend``),
and compared with full-history float64 attention over the same inputs:

- ``smollm2``: SmolLM2-135M-Instruct's own queries, keys and values on the first ``tokens``
  tokens of Moby-Dick (:mod:`streamkv_lab.smollm2`, :mod:`streamkv_lab.texts`), in prefill
  chunks, position-causal;
- ``video``: the synthetic video Q/K/V streams of :mod:`streamkv_lab.experiments.qkv` (recency
  and keyframe sinks under 3D RoPE), a frame per chunk, every query seeing its whole chunk.

Each layer's error is the attention output's, given that layer's true inputs (errors do not
compound through layers here; the perplexity of a model whose every layer runs on a cache is
``streamkv lm-eval``'s subject).

Caches (:func:`run_two_tier`): ``two_tier`` = a ring (sinks + a recent window: full-precision
K/V on the device) + a key sketch of every evicted token (:class:`~streamkv.certify.sketch.KeySketch`)
+ recall slots filled from the host store until every query's certificate is ``<= tau``
(:class:`~streamkv.certify.Certifier`), checked by the float64 whole-history reference
(:class:`~streamkv.certify.HistoryCheck`); ``ring``, ``mass``, ``h2o`` and ``tova`` with the
two-tier cache's device bytes (budget K/V + sketch + recall slots) as their K/V capacity;
``oracle``: the kvbudget seed's per-query mass budget on the full history, at the ``tau`` whose
mean kept tokens equal the same memory (each query keeps its own smallest set reaching mass
``1 - tau``; sinks and the newest chunk protected).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from streamkv import KVCache
from streamkv.attention import attend
from streamkv.budget.oracles import PerQueryMass
from streamkv.certify import Certifier, HistoryCheck
from streamkv_lab.kinds import kind_params, scored_kinds

__all__ = ["Stream", "smollm2_stream", "video_stream", "TwoTierConfig", "run_two_tier", "run_real", "plot_real",
           "DEFAULT_CONFIGS", "least_frames"]


@dataclass
class Stream:
    """The attention inputs of one dataset (per layer, cache layout ``[B, T, heads, D]``)."""

    name: str
    q: list[Tensor]
    k: list[Tensor]
    v: list[Tensor]
    chunk: int
    causal: bool
    scale: float
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.k[0].shape[1]

    @property
    def layers(self) -> int:
        return len(self.k)


def smollm2_stream(tokens: int = 2048, chunk: int = 16, layers: list[int] | None = None) -> Stream:
    """SmolLM2's attention inputs on the first ``tokens`` tokens of Moby-Dick (``layers``: a
    subset of the 30, default all)."""
    from streamkv_lab.smollm2 import SMOLLM2, capture_qkv, load_smollm2, text_tokens
    from streamkv_lab.texts import MOBY_DICK, moby_dick

    _, tok = load_smollm2()
    ids = text_tokens(tok, moby_dick(), tokens)
    cap = capture_qkv(ids)
    pick = list(range(len(cap["k"]))) if layers is None else list(layers)
    q, k, v = ([cap[name][i].transpose(1, 2).contiguous() for i in pick] for name in ("q", "k", "v"))
    return Stream("smollm2", q, k, v, chunk=chunk, causal=True, scale=cap["scale"] or q[0].shape[-1] ** -0.5,
                  info={"model": SMOLLM2, "text": {k2: MOBY_DICK[k2] for k2 in ("title", "author", "licence", "package")},
                        "tokens": tokens, "layers": pick, "chunk": chunk, "causal": True})


def video_stream(frames: int = 48, chunk_frames: int = 1, seed: int = 0, layers: int = 2) -> Stream:
    """The synthetic video Q/K/V streams (recency + keyframe sinks, 3D RoPE), a chunk per frame."""
    from streamkv_lab.experiments.qkv import QKVConfig, synthesize_qkv

    cfg = QKVConfig(frames=frames, layers=layers, keyframes=tuple(k for k in (0, 16, 32, 64, 96) if k < frames))
    s = synthesize_qkv(cfg, seed=seed)
    T = cfg.tokens_per_frame
    return Stream("video", list(s.q), list(s.k), list(s.v), chunk=chunk_frames * T, causal=False,
                  scale=cfg.head_dim ** -0.5, info={"generator": cfg.as_dict(), "seed": seed,
                                                     "chunk": chunk_frames * T, "causal": False})


# ------------------------------------------------------------------------ references
def _full_attention(stream: Stream, layer: int) -> tuple[Tensor, Tensor]:
    """Float64 full-history attention ``[B, T, Hq, Dv]`` (causal by position, or block-causal by
    chunk), and the per-key-head value range ``[H]`` (max - min over tokens and channels)."""
    q, k, v = (x.double().transpose(1, 2) for x in (stream.q[layer], stream.k[layer], stream.v[layer]))
    H, Hq = k.shape[1], q.shape[1]
    k = k.repeat_interleave(Hq // H, dim=1)
    v = v.repeat_interleave(Hq // H, dim=1)
    T = k.shape[2]
    qi, kj = torch.arange(T, device=q.device).view(-1, 1), torch.arange(T, device=q.device).view(1, -1)
    hide = kj > qi if stream.causal else (kj // stream.chunk) > (qi // stream.chunk)
    s = (q @ k.transpose(-1, -2)) * stream.scale
    out = s.masked_fill(hide, -math.inf).softmax(-1) @ v
    vr = stream.v[layer].double()
    vrange = (vr.amax(dim=(0, 1, 3)) - vr.amin(dim=(0, 1, 3)))  # [H]
    return out.transpose(1, 2), vrange


def _errors(out: Tensor, full: Tensor, vrange: Tensor) -> tuple[Tensor, Tensor]:
    """Per (query, query head): L-infinity error, and the same over the head's value range."""
    err = (out.double() - full).abs().amax(-1)  # [B, T, Hq]
    rel = err / vrange.repeat_interleave(err.shape[-1] // vrange.numel()).clamp(min=1e-12)
    return err.flatten(), rel.flatten()


def _summary(errs: list[Tensor], rels: list[Tensor]) -> dict[str, float]:
    e, r = torch.cat(errs), torch.cat(rels)
    q = (lambda x, p: float(x.quantile(p)) if x.numel() <= 16_000_000 else float(x.sort().values[int(p * (x.numel() - 1))]))
    return {"error_mean": float(e.mean()), "error_p99": q(e, 0.99), "error_max": float(e.max()),
            "rel_error_mean": float(r.mean()), "rel_error_p99": q(r, 0.99), "rel_error_max": float(r.max())}


# ------------------------------------------------------------------------------ runs
@dataclass(frozen=True)
class TwoTierConfig:
    """What :func:`run_two_tier` runs (recorded with the result)."""

    policy: str = "ring"  # the device budget's policy (any cache kind that evicts)
    sink: int = 4
    window: int = 124  # the device budget's capacity besides the sinks
    recall_slots: int = 128
    tau: float = 0.05  # recall until every query's certificate is <= tau
    sketch_bits: int = 8
    sketch_block: int = 32

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _token_bytes(stream: Stream) -> int:
    """Device bytes of one token's K and V, all layers and key heads (the cache dtype)."""
    k, v = stream.k[0], stream.v[0]
    return stream.layers * k.shape[0] * k.shape[2] * (k.shape[3] + v.shape[3]) * k.element_size()


def _run_cache(stream: Stream, kind: str, *, sink: int, window: int, recall_slots: int = 0,
               certifier: dict[str, Any] | None = None, fulls: list[Tensor], vranges: list[Tensor],
               **policy_params: Any) -> dict[str, Any]:
    B, _, H, D = stream.k[0].shape
    Dv = stream.v[0].shape[-1]
    C, T = stream.chunk, stream.tokens
    cache = KVCache((B, sink + window, H, D), (B, sink + window, H, Dv), policy=kind, seq_dim=1, sink=sink,
                    window=window, chunk=C, num_layers=stream.layers, recall_slots=recall_slots,
                    dtype=stream.k[0].dtype, device=stream.k[0].device, **policy_params)
    cert = check = None
    if certifier is not None:
        cert = Certifier(cache, causal=stream.causal, scale=stream.scale, **certifier)
        check = HistoryCheck(cert, tau=certifier.get("recall_tau") or 0.05)
    errs, rels = [], []
    outs = [torch.empty_like(f) for f in fulls]
    sketch_peak = 0
    sync = torch.cuda.synchronize if stream.k[0].is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for c in range(T // C):
        sl = slice(c * C, (c + 1) * C)
        cache.begin_tokens(C)
        for layer in range(stream.layers):
            q, k, v = stream.q[layer][:, sl], stream.k[layer][:, sl], stream.v[layer][:, sl]
            out, _ = attend(q, cache.layer(layer).update(k, v, q), causal=stream.causal, scale=stream.scale)
            outs[layer][:, sl] = out.double()
        cache.commit()
        if cert is not None:
            sketch_peak = max(sketch_peak, sum(s.nbytes for s in cert.summaries))
    sync()
    seconds = time.perf_counter() - t0 - (check.seconds if check is not None else 0.0)  # the cache, not the check
    for layer in range(stream.layers):
        e, r = _errors(outs[layer], fulls[layer], vranges[layer])
        errs.append(e)
        rels.append(r)
    kv_bytes = cache.storage.nbytes
    policy_bytes = sum(t.nbytes for t in cache.policy.state().values())
    recall_bytes = int(kv_bytes * recall_slots / (sink + window + recall_slots)) if recall_slots else 0
    res: dict[str, Any] = {
        **_summary(errs, rels), "device_bytes": kv_bytes + policy_bytes + sketch_peak,
        "budget_kv_bytes": kv_bytes - recall_bytes, "policy_state_bytes": policy_bytes,
        "sketch_bytes": sketch_peak or None, "recall_slot_bytes": recall_bytes or None, "host_bytes": None,
        "ms_per_chunk": 1e3 * seconds / (T // C), "capacity": sink + window, "perplexity": None,
        "violations": None, "tightness_median": None, "tightness_p95": None, "recalled_tokens": None,
        "recalled_tokens_per_chunk": None, "recall_held_tokens": None, "oracle_recall_tokens": None,
        "shortfalls": None,
    }
    if cert is not None:
        r = check.result()
        res.update(violations=r["violations"], count_mismatch=r["count_mismatch"], tightness_median=r["tightness_median"],
                   tightness_p95=r["tightness_p95"], recalled_tokens=cert.stats["recalled_tokens"],
                   recalled_tokens_per_chunk=cert.stats["recalled_tokens"] / (T // C),
                   recall_held_tokens=r.get("recall_held_total"), oracle_recall_tokens=r.get("oracle_recall_total"),
                   shortfalls=cert.stats["shortfalls"],
                   rows_checked=r["queries_checked"], rows_over_tau=r.get("over_tau"),
                   host_bytes=cert.store.nbytes, recall_steps=cert.stats["steps"])
    return res


def _probs(stream: Stream) -> list[Tensor]:
    """Float64 full-history attention weights per layer ``[B, Hq, T, T]`` (causal or block-causal)."""
    probs = []
    for layer in range(stream.layers):
        q, k = stream.q[layer].double().transpose(1, 2), stream.k[layer].double().transpose(1, 2)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        T = k.shape[2]
        qi, kj = torch.arange(T, device=q.device).view(-1, 1), torch.arange(T, device=q.device).view(1, -1)
        hide = kj > qi if stream.causal else (kj // stream.chunk) > (qi // stream.chunk)
        probs.append(((q @ k.transpose(-1, -2)) * stream.scale).masked_fill(hide, -math.inf).softmax(-1))
    return probs


def _oracle(stream: Stream, memory_tokens: float, fulls: list[Tensor], vranges: list[Tensor], sink: int,
            probs: list[Tensor], iters: int = 14) -> dict[str, Any]:
    """The per-query mass oracle at the ``tau`` whose mean kept tokens match ``memory_tokens``
    (bisection on ``log tau``), its error against full attention."""
    recent = stream.chunk

    def run(tau: float) -> tuple[float, list[Tensor], list[Tensor]]:
        kept, errs, rels = [], [], []
        pol = PerQueryMass(tau, protect_sinks=sink, protect_recent=recent)
        for layer, p in enumerate(probs):
            T = p.shape[-1]
            keep = pol.keep(p, torch.arange(T, device=p.device))
            keep &= p > 0 if stream.causal else keep  # future keys (weight 0) are not memory
            w = p * keep
            v = stream.v[layer].double().transpose(1, 2).repeat_interleave(p.shape[1] // stream.v[layer].shape[2], dim=1)
            out = (w / w.sum(-1, keepdim=True)) @ v
            kept.append(keep.sum(-1).double().flatten())
            e, r = _errors(out.transpose(1, 2), fulls[layer], vranges[layer])
            errs.append(e)
            rels.append(r)
        return float(torch.cat(kept).mean()), errs, rels

    lo, hi = math.log(1e-6), math.log(0.9)
    best = None
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        mean_kept, errs, rels = run(math.exp(mid))
        if best is None or abs(mean_kept - memory_tokens) < abs(best[1] - memory_tokens):
            best = (math.exp(mid), mean_kept, errs, rels)
        if mean_kept > memory_tokens:
            lo = mid  # keeps too much: a larger tau
        else:
            hi = mid
    tau, mean_kept, errs, rels = best
    return {**_summary(errs, rels), "tau": tau, "memory_tokens": mean_kept,
            "device_bytes": int(mean_kept * _token_bytes(stream)), "perplexity": None, "violations": None,
            "tightness_median": None, "tightness_p95": None, "recalled_tokens": None,
            "recalled_tokens_per_chunk": None, "recall_held_tokens": None, "oracle_recall_tokens": None,
            "shortfalls": None, "ms_per_chunk": None}


def run_two_tier(stream: Stream, cfg: TwoTierConfig | None = None,
                 progress: Callable[[str], None] | None = None, tiers: tuple[Any, ...] = (),
                 quarter: tuple[Any, ...] = ()) -> dict[str, Any]:
    """Every cache on ``stream`` at the two-tier cache's device memory (see the module docstring);
    with ``tiers`` (:class:`~.tier.TierConfig`) also the compressed tier at each (``tier_sweep``;
    ``caches["compressed_tier"]``: the sweep's lowest mean error among runs with no violation)
    and the per-chunk oracle; with ``quarter`` (:class:`~.tier.TierConfig` s) also the full cache and
    the compressed tier at a quarter of its bytes, timed (:func:`~.tier.run_quarter`)."""
    cfg = cfg or TwoTierConfig()
    fulls, vranges = zip(*(_full_attention(stream, layer) for layer in range(stream.layers)))
    fulls, vranges = list(fulls), list(vranges)
    say = progress or (lambda _: None)
    caches: dict[str, Any] = {}
    say("two_tier")
    caches["two_tier"] = _run_cache(
        stream, cfg.policy, sink=cfg.sink, window=cfg.window, recall_slots=cfg.recall_slots, fulls=fulls, vranges=vranges,
        certifier={"recall_tau": cfg.tau, "sketch_bits": cfg.sketch_bits, "block_tokens": cfg.sketch_block})
    per_token = _token_bytes(stream)
    memory = caches["two_tier"]["device_bytes"] / per_token  # token-equivalents per layer and key head
    cap = max(int(round(memory)), cfg.sink + 2 * stream.chunk)
    W = cap - cfg.sink
    for kind in ("ring", *scored_kinds()):  # every evicting kind at the same device bytes
        say(kind)
        caches[kind] = _run_cache(stream, kind, sink=cfg.sink, window=W, fulls=fulls, vranges=vranges,
                                  **kind_params(kind, tau=cfg.tau))
    say("oracle")
    probs = _probs(stream)
    caches["oracle"] = _oracle(stream, memory, fulls, vranges, cfg.sink, probs)
    from .tier import per_chunk_oracle, run_tier, tier_geometry

    say("per_chunk_oracle")
    caches["per_chunk_oracle"] = per_chunk_oracle(stream, memory, fulls, vranges, cfg.sink, probs)
    sweep = []
    for t in tiers:
        say(f"compressed_tier ({t.label()})")
        try:
            tier_geometry(stream, t, caches["two_tier"]["device_bytes"], cfg.sink)
        except ValueError as exc:  # this split does not fit the bytes: recorded, not run
            sweep.append({"label": t.label(), "config": t.as_dict(), "skipped": str(exc)})
            continue
        sweep.append(run_tier(stream, t, caches["two_tier"]["device_bytes"], sink=cfg.sink, fulls=fulls,
                              vranges=vranges, probs=probs))
    quarter_result = None
    if quarter:
        from .tier import run_quarter

        quarter_result = run_quarter(stream, sink=cfg.sink, fulls=fulls, vranges=vranges, probs=probs, configs=quarter,
                                     say=say)
    ok = [r for r in sweep if r.get("violations") == 0]
    if ok:
        caches["compressed_tier"] = min(ok, key=lambda r: r["error_mean"])
    del probs
    say("the two-tier budget alone")  # no sketch, no recall: what the sketch and recall add
    caches["budget_only"] = _run_cache(stream, cfg.policy, sink=cfg.sink, window=cfg.window, fulls=fulls,
                                            vranges=vranges)
    tt = caches["two_tier"]
    ratios = {
        "ring_over_two_tier_mean": caches["ring"]["error_mean"] / max(tt["error_mean"], 1e-30),
        "ring_over_two_tier_p99": caches["ring"]["error_p99"] / max(tt["error_p99"], 1e-30),
        "two_tier_over_oracle_mean": tt["error_mean"] / max(caches["oracle"]["error_mean"], 1e-30),
        "two_tier_over_oracle_p99": tt["error_p99"] / max(caches["oracle"]["error_p99"], 1e-30),
        # recalled tokens held at each attention step vs the fewest an exact recall would hold
        "recall_over_oracle_need": (tt["recall_held_tokens"] / tt["oracle_recall_tokens"]
                                    if tt["oracle_recall_tokens"] else None),
    }
    if "compressed_tier" in caches:
        ct = caches["compressed_tier"]
        for other in ("tova", "per_chunk_oracle", "oracle"):
            for stat in ("mean", "p99"):
                ratios[f"compressed_tier_over_{other}_{stat}"] = ct[f"error_{stat}"] / max(caches[other][f"error_{stat}"], 1e-30)
        ratios["compressed_tier_ms_over_ring"] = ct["ms_per_chunk"] / caches["ring"]["ms_per_chunk"]
    return {"info": stream.info, "config": cfg.as_dict(), "token_bytes": per_token,
            "matched_memory_tokens": memory, "caches": caches, "ratios": ratios,
            "tier_sweep": [{k: v for k, v in r.items()} for r in sweep], "quarter": quarter_result}


# -------------------------------------------------------------------- the command
DEFAULT_CONFIGS: dict[str, tuple[TwoTierConfig, ...]] = {
    # SmolLM2 (16-token prefill chunks): a TOVA device budget (it beat the ring as the budget on
    # this stream), 8-bit sketches, two memory points.
    "smollm2": (TwoTierConfig(policy="tova", sink=4, window=60, recall_slots=64, tau=0.05),
                TwoTierConfig(policy="tova", sink=4, window=124, recall_slots=128, tau=0.05)),
    # The synthetic video stream (a frame of 16 tokens per chunk; TOVA protects the newest chunk and
    # needs room for the next: a window of >= 2 chunks): the same budget, two recall rooms.
    "video": (TwoTierConfig(policy="tova", sink=2, window=46, recall_slots=48, tau=0.05),
              TwoTierConfig(policy="tova", sink=2, window=46, recall_slots=96, tau=0.05)),
    # The trained toy video model (2-frame chunks of 32 tokens; its own 2 sink frames): the same
    # budget shape in its units, two recall rooms.
    "toy": (TwoTierConfig(policy="tova", sink=32, window=96, recall_slots=64, tau=0.05),
            TwoTierConfig(policy="tova", sink=32, window=96, recall_slots=128, tau=0.05)),
}


def tier_configs() -> dict[str, tuple[Any, ...]]:
    """The compressed-tier sweep per dataset (run at the first configuration's device bytes):
    three splits of the bytes between the tiers with an int8 tier 2, and int4 at the middle one."""
    # recall_fraction: of tier 1's slots
    from .tier import TierConfig

    sweep = (*(TierConfig(fmt="int8", fp_fraction=s) for s in (0.3, 0.5, 0.7)), TierConfig(fmt="int4", fp_fraction=0.5))
    # the toy model's 32 sink tokens and 32-token chunks need more of tier 1: later splits, fewer recall slots
    toy = (*(TierConfig(fmt="int8", fp_fraction=s, recall_fraction=0.15) for s in (0.6, 0.75, 0.9)),
           TierConfig(fmt="int4", fp_fraction=0.75, recall_fraction=0.15))
    return {"smollm2": sweep, "video": sweep, "toy": toy}


def least_frames(name: str, tokens_per_frame: int, chunk: int) -> int:
    """The fewest frames of dataset ``name``'s stream (``tokens_per_frame``, chunks of ``chunk``
    tokens) that :func:`run_real` can run: a quarter of its tokens must hold the sinks of its
    configurations and two chunks (the ring and TOVA at a quarter of the bytes:
    :func:`~.tier.run_quarter`; TOVA protects the newest chunk and needs room for the next)."""
    sink = max(c.sink for c in DEFAULT_CONFIGS[name])
    return -(-4 * (sink + 2 * chunk) // tokens_per_frame)


def run_real(streams: dict[str, Callable[[], Stream]],
             configs: dict[str, tuple[TwoTierConfig, ...]] | None = None,
             progress: Callable[[str], None] | None = None,
             tiers: dict[str, tuple[Any, ...]] | None = None, quarter: bool = True) -> dict[str, Any]:
    """``streamkv certify --real``: every dataset of ``streams`` (name -> a builder) through
    :func:`run_two_tier` at each of its configurations (``configs[name]``, default
    :data:`DEFAULT_CONFIGS`). ``datasets[name]["caches"]`` is the first configuration's result;
    ``sweep`` holds every one (the plot's points)."""
    from streamkv_lab.env import threads

    configs = configs or DEFAULT_CONFIGS
    say = progress or (lambda _: None)
    out: dict[str, Any] = {"datasets": {}, "threads": 1}
    with threads(1):  # the certifier's many small float64 ops: one thread (two contend on a loaded 2-core CPU)
        for name, build in streams.items():
            out["datasets"][name] = _run_dataset(name, build, configs[name], say,
                                                 (tier_configs() if tiers is None else tiers).get(name, ()), quarter)
    return out


def _run_dataset(name: str, build: Callable[[], Stream], configs: tuple[TwoTierConfig, ...],
                 say: Callable[[str], None], tiers: tuple[Any, ...] = (), quarter: bool = True) -> dict[str, Any]:
    from .tier import QUARTER_CONFIGS, QUARTER_CONFIGS_TOY

    quarter_cfgs = QUARTER_CONFIGS_TOY if name == "toy" else QUARTER_CONFIGS

    say(f"{name}: attention inputs")
    stream = build()
    sweep = []
    for i, cfg in enumerate(configs):
        sweep.append(run_two_tier(stream, cfg, progress=lambda c, i=i: say(f"{name} [{i + 1}/{len(configs)}]: {c}"),
                                  tiers=tiers if i == 0 else (), quarter=quarter_cfgs if quarter and i == 0 else ()))
    first = sweep[0]
    return {"info": stream.info, "caches": first["caches"], "ratios": first["ratios"], "config": first["config"],
            "matched_memory_tokens": first["matched_memory_tokens"], "token_bytes": first["token_bytes"],
            "sweep": sweep, "tier_sweep": first["tier_sweep"], "quarter": first["quarter"]}


def plot_real(result: dict[str, Any], path: str) -> None:
    """Mean error vs device memory per cache, one panel per dataset (every sweep point)."""
    from streamkv_lab.plotting import pyplot, save

    plt = pyplot()
    names = [n for n, d in result["datasets"].items() if "sweep" in d]  # per-layer datasets (not perplexity)
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        sweep = result["datasets"][name]["sweep"]
        for cache in sweep[0]["caches"]:
            pts = sorted((r["caches"][cache]["device_bytes"] / 1024, r["caches"][cache]["error_mean"]) for r in sweep
                         if cache in r["caches"])  # the compressed tier runs at the first point only
            ax.plot(*zip(*pts), marker="o", label=cache)
        ax.set_xlabel("device memory (KiB: budget K/V + sketch + recall slots)")
        ax.set_ylabel("mean attention error (L-inf, vs full history)")
        ax.set_yscale("log")
        ax.set_title(name)
        ax.legend(fontsize=8)
    save(fig, path)
