"""Where the trained model's attention goes: mass on the sinks, the chunk itself, the recent
window and far history, read through the cache observer protocol (no monkey-patching).

:class:`AttentionProfile` observes a cache; at every ``update(k, v, q)`` (``on_queries``:
after the write, before attention) it recomputes that pass's softmax exactly from the
queries and the cache's own buffers — ``q`` and the stored keys carry absolute RoPE, so the
softmax over the occupied slots (``1 / sqrt(D)`` scale, the chunk attending to itself
bidirectionally) is the model's attention of that pass — and sums each query's mass by the
position class of the key:

``sink``    positions ``< sink_tokens`` (the first chunk, the conditioning frames' start);
``self``    the chunk being written;
``recent``  the ``recent_tokens`` positions before the chunk;
``far``     everything older (and not a sink).

Passes are numbered within a chunk (``0`` = the first denoising step; the last is the clean
pass); record generated chunks only (``chunks``): a prefilled chunk has a clean pass alone,
which would be counted as pass ``0``. Means are over queries and the batch, per (pass,
layer, head). Float32; observers run eagerly only.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from streamkv.caches import CacheObserver, KVCache

__all__ = ["AttentionProfile", "CLASSES", "profile_json"]

CLASSES = ("sink", "self", "recent", "far")


class AttentionProfile(CacheObserver):
    """Accumulate attention mass by key class (see the module docstring).

    Args:
        cache: a cache with layout ``[B, S, H, D]`` (``seq_dim=1``), the DiT's.
        sink_tokens, recent_tokens: the class boundaries, in tokens (any values: they need
            not match the cache's own sink and window).
        chunks: which chunk indices to record (default: all).
    """

    def __init__(self, cache: KVCache, *, sink_tokens: int, recent_tokens: int, chunks: range | None = None) -> None:
        if cache.seq_dim != 1 or len(cache.k_shape) != 4:
            raise ValueError(f"AttentionProfile reads [B, S, H, D] caches (seq_dim=1), got {cache.k_shape} "
                             f"seq_dim={cache.seq_dim}")
        if sink_tokens < 0 or recent_tokens < 0:
            raise ValueError(f"sink_tokens and recent_tokens must be >= 0, got {sink_tokens}, {recent_tokens}")
        self.cache, self.sink, self.recent, self.chunks = cache, sink_tokens, recent_tokens, chunks
        self.sums: dict[int, Tensor] = {}  # pass -> float64 [L, H, 4]
        self.counts: dict[int, int] = {}  # pass -> queries summed (per layer, head)
        self._pass = 0
        self._layers_seen: set[int] = set()
        cache.add_observer(self)

    def on_begin(self, cache: KVCache, chunk_idx: int, advance: bool) -> None:
        self._pass, self._layers_seen = 0, set()

    def on_queries(self, cache: KVCache, layer: int, q: Tensor) -> None:
        chunk = cache.open_chunk
        if layer in self._layers_seen:  # a new pass starts when layer 0.. comes again
            self._pass += 1
            self._layers_seen = set()
        self._layers_seen.add(layer)
        if self.chunks is not None and chunk not in self.chunks:
            return
        start, n = cache.open_span
        keys = cache.keys(layer)  # [B, S, H, D]
        pos = cache.layer_slot_positions(layer)  # [H, S]
        scores = torch.einsum("bqhd,bshd->bhqs", q.float(), keys.float()) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill((pos < 0)[None, :, None, :], -math.inf)
        p = scores.softmax(-1)  # [B, H, Q, S]
        cls = torch.full(pos.shape, 3, dtype=torch.long, device=pos.device)  # far
        cls = torch.where(pos >= start - self.recent, 2, cls)
        cls = torch.where(pos >= start, 1, cls)
        cls = torch.where((pos >= 0) & (pos < self.sink), 0, cls)
        onehot = torch.nn.functional.one_hot(cls, 4).to(p.dtype) * (pos >= 0)[..., None]  # [H, S, 4]
        mass = torch.einsum("bhqs,hsc->hc", p, onehot).double().cpu()  # summed over batch and queries
        key = self._pass
        if key not in self.sums:
            self.sums[key] = torch.zeros(cache.num_layers, pos.shape[0], 4, dtype=torch.float64)
            self.counts[key] = 0
        self.sums[key][layer] += mass
        if layer == 0:
            self.counts[key] += q.shape[0] * q.shape[1]

    def on_reset(self, cache: KVCache) -> None:
        self._pass, self._layers_seen = 0, set()


def profile_json(sums: dict[int, Tensor], counts: dict[int, int]) -> dict:
    """Per pass: mean mass per class overall, per layer and per (layer, head), from the
    ``sums`` / ``counts`` of one or more profiles added together (JSON-ready)."""
    out: dict = {"classes": list(CLASSES), "passes": {}}
    for k in sorted(sums):
        mean = sums[k] / max(1, counts[k])  # [L, H, 4]
        out["passes"][str(k)] = {
            "queries": counts[k], "overall": dict(zip(CLASSES, mean.mean((0, 1)).tolist())),
            "per_layer": {c: mean[..., i].mean(-1).tolist() for i, c in enumerate(CLASSES)},
            "per_layer_head": {c: mean[..., i].tolist() for i, c in enumerate(CLASSES)},
        }
    return out
