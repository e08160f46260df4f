"""The streams the budget experiments drive caches with: synthetic heads built from the
seed's generator, the tiny DiT, and matched-memory baselines."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from streamkv.caches import CacheSet, KVCache
from streamkv_lab.budget.recorder import Recorder
from streamkv_lab.experiments.synthetic import GeneratorConfig, synthesize

__all__ = ["SyntheticHeads", "synthetic_qkv", "drive", "run_synthetic_cache", "matched_ring_window",
           "matched_h2o_budget", "run_dit_cache"]


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
    D)``, ``seq_dim=1``: per chunk, begin, ``update(k, v, q)``, attend, commit."""
    from streamkv.attention import attend

    C = cache.layout.chunk
    total = q.shape[0] // C if chunks is None else chunks
    for c in range(total):
        sl = slice(c * C, (c + 1) * C)
        cache.begin_chunk(c)
        qc = q[sl].unsqueeze(0)
        attend(qc, cache.update(k[sl].unsqueeze(0), v[sl].unsqueeze(0), qc))
        cache.commit_chunk(c)
    return cache


def run_synthetic_cache(kind: str, qkv: tuple[Tensor, Tensor, Tensor], *, sink: int, window: int, chunk: int,
                        oracle_taus: tuple[float, ...] = (), **policy_params: Any) -> Recorder:
    """A cache of ``kind`` over the synthetic stream ``qkv``, recorded; returns the recorder."""
    q, k, v = qkv
    H = q.shape[1]
    cap = sink + window
    cache = KVCache((1, cap, H, k.shape[-1]), (1, cap, H, v.shape[-1]), policy=kind, seq_dim=1, sink=sink,
                    window=window, chunk=chunk, dtype=torch.float64, **policy_params)
    rec = Recorder(cache, oracle_taus=oracle_taus)
    drive(cache, q, k, v)
    return rec


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


def run_dit_cache(kind: str, *, chunks: int, window_frames: int | None = None, seed: int = 0,
                  query_scale: float | None = None, prompt: str = "a red fox running through snow",
                  oracle_taus: tuple[float, ...] = (), **policy_params: Any) -> Recorder:
    """Run the tiny DiT (random weights, ``seed``) through :class:`StreamingRollout` on a
    one-branch :class:`~streamkv.caches.CacheSet` of ``kind``, recorded; returns the recorder. ``window_frames`` overrides the config's window (the cache's
    capacity only: the weights do not depend on it and are loaded from the configured
    model). ``query_scale`` (a *variant*, off by default) multiplies every block's query
    RMSNorm weight, which scales every attention logit by that factor."""
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
    cs = CacheSet(kind, model.cache_spec(1), **policy_params)
    rec = Recorder(cs["cond"], oracle_taus=oracle_taus)
    roll = StreamingRollout(model, cache=cs, seed=seed)
    roll.set_prompt(prompt)
    roll.run(chunks)
    return rec


