"""Streaming a language model through a cache: per-token losses, and each layer's attention
error against full-history attention of the same queries.

:class:`AttentionErrors` is a cache's ``on_attention`` callback (the transformers
integration calls it after every layer's attention). It copies the span's K/V out of the
read (every kind holds the span it just wrote) into a full history of the stream, and for
sampled queries computes exact causal attention over that whole history in float32:
``err = ||o_cache - o_full|| / ||o_full||`` per (query, head), the error the cache's
eviction causes *in that layer, given that layer's inputs* (the inputs themselves already
carry the earlier layers' and tokens' errors; the perplexity measures the end result).

:func:`stream_losses` feeds a segment through a model and a cache in spans and returns the
next-token losses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from streamkv.caches import KVRead

__all__ = ["AttentionErrors", "stream_losses", "nll"]


class AttentionErrors:
    """``on_attention(layer, query, read, out)`` for one stream (batch 1), see the module docstring.

    Args:
        num_layers, kv_heads, head_dim: the model's.
        length: the longest stream (positions ``[0, length)``); the history is ``2 x
            [num_layers, kv_heads, length, head_dim]`` float32, overwritten span by span (a
            new stream, or a second continuation from a saved state, rewrites positions
            before reading them).
        stride: queries at positions ``p`` with ``(p + 1) % stride == 0`` are measured.

    ``tag`` (set between runs) names the bucket the errors go to; :meth:`summary` gives the
    per-layer and overall mean and p99 of a bucket, and the mean occupied slots per (layer,
    head) during attention (``resident``).
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, length: int, stride: int = 8) -> None:
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        self.k = torch.zeros(num_layers, kv_heads, length, head_dim)
        self.v = torch.zeros_like(self.k)
        self.stride, self.length = stride, length
        self.tag = "default"
        self.errors: dict[str, list[list[Tensor]]] = {}
        self.resident: dict[str, list[float]] = {}  # tag -> [occupied slot sum, reads x heads]

    def __call__(self, layer: int, query: Tensor, read: KVRead, out: Tensor) -> None:
        q_pos = read.query_positions.cpu()
        start, n = int(q_pos[0]), q_pos.numel()
        end = start + n
        if end > self.length:
            raise ValueError(f"the stream reached position {end}, the error history holds {self.length}")
        if query.shape[0] != 1:
            raise ValueError(f"AttentionErrors measures batch 1, got {query.shape[0]}")
        pos = read.positions  # [H_kv, S]
        H, S = pos.shape
        # the slot of each (head, span position): every kind holds the span it just wrote
        in_span = (pos >= start) & (pos < end)
        if int(in_span.sum()) != H * n:
            raise RuntimeError(f"layer {layer}: the read does not hold positions [{start}, {end}) in every head")
        heads, slots = in_span.nonzero(as_tuple=True)
        slot_of = torch.empty(H, n, dtype=torch.long)
        slot_of[heads, pos[heads, slots] - start] = slots
        keys, values = read.stored()  # as stored (quantised: decoded)
        index = slot_of.unsqueeze(-1).expand(H, n, keys.shape[-1])
        if read.seq_dim != 2:  # token-major [B, S, H, D]
            keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        self.k[layer, :, start:end] = keys[0].gather(1, index).float()
        self.v[layer, :, start:end] = values[0].gather(1, index).float()
        acc = self.resident.setdefault(self.tag, [0.0, 0.0])
        acc[0] += float((pos >= 0).sum())
        acc[1] += H
        sel = ((q_pos + 1) % self.stride == 0).nonzero().flatten()
        if not sel.numel():
            return
        Hq, D = query.shape[1], query.shape[-1]
        G, r = Hq // H, sel.numel()
        q = query[0][:, sel].float().reshape(H, G * r, D)
        k, v = self.k[layer, :, :end], self.v[layer, :, :end]
        scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).view(Hq, r, end)
        hidden = torch.arange(end).unsqueeze(0) > q_pos[sel].unsqueeze(1)  # [r, end]
        p = scores.masked_fill(hidden, -math.inf).softmax(-1)
        full = (p.view(H, G * r, end) @ v).view(Hq, r, D)
        got = out[0][sel].transpose(0, 1).float()  # [Hq, r, D]
        err = (got - full).norm(dim=-1) / full.norm(dim=-1).clamp_min(1e-30)
        buckets = self.errors.setdefault(self.tag, [[] for _ in range(self.k.shape[0])])
        buckets[layer].append(err.flatten())

    def summary(self, tag: str) -> dict[str, Any]:
        """``{attn_error_mean, attn_error_p99, attn_error_layers: [{mean, p99}], resident_mean}``
        of a bucket (None where nothing was measured)."""
        layers = self.errors.get(tag, [[] for _ in range(self.k.shape[0])])
        every = _stats([t for parts in layers for t in parts])
        acc = self.resident.get(tag)
        return {"attn_error_mean": every["mean"], "attn_error_p99": every["p99"],
                "attn_error_layers": [_stats(parts) for parts in layers],
                "resident_mean": acc[0] / acc[1] if acc else None}


def _stats(parts: list[Tensor]) -> dict[str, float | None]:
    if not parts:
        return {"mean": None, "p99": None}
    e = torch.cat(parts).double()
    p99 = torch.quantile(e, 0.99) if e.numel() < 2**24 else e.max()
    return {"mean": float(e.mean()), "p99": float(p99)}


def nll(logits: Tensor, targets: Tensor) -> Tensor:
    """``[n]`` float64: ``-log softmax(logits)[target]`` for the first ``n = len(targets)`` rows
    of ``logits`` ``[T, vocab]`` (the log-softmax in the logits' dtype, at least float32)."""
    n = targets.numel()
    x = logits[:n]
    lp = (x if x.dtype == torch.float64 else x.float()).log_softmax(-1)
    return -lp.gather(1, targets.view(-1, 1)).view(-1).double()


@torch.no_grad()
def stream_losses(
    model: Any,
    ids: Tensor,
    losses: Tensor,
    *,
    span: int,
    start: int = 0,
    stop: int | None = None,
    forward_kwargs: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Feed ``ids[:, start:stop]`` (``[1, T]``, one stream that already holds ``start``
    positions) to ``model`` in spans of ``span`` tokens; write the loss of predicting token
    ``i + 1`` from position ``i`` into ``losses[i]`` (``[T - 1]`` float64, mutated; the last
    position predicts nothing). ``forward_kwargs``: passed to every forward (the cache, the
    oracle run). ``progress(n)`` after each span of ``n`` tokens.
    """
    T = ids.shape[1]
    stop = T if stop is None else stop
    kwargs = forward_kwargs or {}
    for s in range(start, stop, span):
        e = min(s + span, stop)
        logits = model(input_ids=ids[:, s:e], **kwargs).logits[0]
        targets = ids[0, s + 1 : e + 1]
        losses[s : s + targets.numel()] = nll(logits, targets)
        if progress is not None:
            progress(e - s)
