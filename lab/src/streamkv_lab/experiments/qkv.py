"""Synthetic video Q/K/V streams: real queries and keys (with 3D RoPE) whose attention has
the structure video attention is documented to have, for driving the real caches.

:mod:`streamkv_lab.experiments.synthetic` generates attention *logits*; a certificate needs
the queries and the keys themselves (the key boxes live in key space). This generator
builds them so that the attention has the same two ingredients:

- **temporal recency** from slowly drifting frame content: per (layer, head), frame ``f``
  has content ``z_f`` (a stationary AR(1) in ``R^D`` with persistence ``rho``); a token of
  frame ``f`` has key ``content * z_f + noise * e`` and query ``content * z_f + noise * e'``,
  so a query's logit on a key ``d`` frames back has mean ``content^2 * sqrt(D) * rho^d``
  (times the RoPE factor below);
- **keyframe sinks**: the first ``sink_tokens`` tokens of each frame in ``keyframes`` carry
  a large component along a reserved channel of the lowest time-RoPE frequency (it barely
  rotates over the stream), which every query shares: a sink gets a logit boost of about
  ``sink_logit`` at any distance. Ordinary tokens have that channel pair zeroed.

Then both are rotated by the DiT's 3D RoPE (:class:`~streamkv.rope.Rope3D`) at their
stream positions (``frame, row, col`` on a ``grid_h x grid_w`` frame), exactly like the model's
keys before the cache write. Values drift like the logits generator's:
``v = value_scale * tanh(z^v_f + spread * e)`` with an AR(1) ``z^v``.

Layers are independent streams (different seeds); batch elements too. Everything is
float32 (as a cache stores it), deterministic under the seed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from streamkv.rope import Rope3D

__all__ = ["QKVConfig", "QKVStream", "synthesize_qkv"]


@dataclass(frozen=True)
class QKVConfig:
    """Parameters of the synthetic Q/K/V stream (recorded with every result)."""

    frames: int = 128
    grid_h: int = 4
    grid_w: int = 4
    heads: int = 8
    head_dim: int = 32
    value_dim: int = 32
    layers: int = 2
    batch: int = 1
    content: float = 1.4
    persistence: float = 0.9
    key_noise: float = 0.1
    query_noise: float = 0.8
    keyframes: tuple[int, ...] = (0, 32, 64, 96)
    sink_tokens: int = 2
    sink_logit: float = 9.0
    value_persistence: float = 0.9
    value_spread: float = 0.5
    value_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("frames", "grid_h", "grid_w", "heads", "value_dim", "layers", "batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.head_dim < 12 or self.head_dim % 2:
            raise ValueError(f"head_dim must be even and >= 12, got {self.head_dim}")
        if not 0 <= self.sink_tokens <= self.grid_h * self.grid_w:
            raise ValueError(f"sink_tokens must be in [0, tokens per frame], got {self.sink_tokens}")
        if any(not 0 <= k < self.frames for k in self.keyframes):
            raise ValueError(f"keyframes must be frames in [0, {self.frames}), got {self.keyframes}")
        for name in ("persistence", "value_persistence"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        for name in ("content", "key_noise", "query_noise", "sink_logit", "value_spread", "value_scale"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {v!r}")

    @property
    def tokens_per_frame(self) -> int:
        return self.grid_h * self.grid_w

    @property
    def tokens(self) -> int:
        return self.frames * self.tokens_per_frame

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["keyframes"] = list(self.keyframes)
        return d


@dataclass(frozen=True)
class QKVStream:
    """Queries, keys, values ``[layers, B, tokens, H, D]`` (``Dv`` for values), float32,
    RoPE applied; ``sinks [tokens]`` bool."""

    config: QKVConfig
    seed: int
    q: Tensor
    k: Tensor
    v: Tensor
    sinks: Tensor

    def chunk(self, layer: int, start: int, size: int) -> tuple[Tensor, Tensor, Tensor]:
        """``(q, k, v)`` of positions ``[start, start + size)``: ``[B, size, H, D]`` each."""
        sl = slice(start, start + size)
        return self.q[layer, :, sl], self.k[layer, :, sl], self.v[layer, :, sl]


def _ar1(n: int, shape: tuple[int, ...], rho: float, g: torch.Generator) -> Tensor:
    e = torch.randn((n, *shape), generator=g, dtype=torch.float64)
    z = torch.empty_like(e)
    z[0] = e[0]
    for i in range(1, n):
        z[i] = rho * z[i - 1] + math.sqrt(1 - rho * rho) * e[i]
    return z


def synthesize_qkv(config: QKVConfig, seed: int = 0) -> QKVStream:
    """Generate a stream (deterministic in ``config`` and ``seed``)."""
    c = config
    g = torch.Generator().manual_seed(seed)
    L, B, F, T, H, D, Dv = c.layers, c.batch, c.frames, c.tokens_per_frame, c.heads, c.head_dim, c.value_dim
    n = F * T
    rope = Rope3D(D, c.grid_h, c.grid_w, max_frames=F)
    band_t = rope.bands[0]
    sink_ch = band_t - 2  # the lowest-frequency time pair (channels band_t - 2, band_t - 1)
    frame_of = torch.arange(n) // T
    sinks = torch.zeros(n, dtype=torch.bool)
    for kf in c.keyframes:
        sinks[kf * T : kf * T + c.sink_tokens] = True
    scale = 1.0 / math.sqrt(D)
    sink_amp = math.sqrt(c.sink_logit / scale)
    cos, sin = rope.cos_sin(torch.arange(n), torch.float64)  # [n, D/2]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [n, 1, D/2] against [.., n, H, D]
    qs, ks, vs = [], [], []
    for _ in range(L):
        z = _ar1(F, (B, H, D), c.persistence, g)  # [F, B, H, D]
        zt = z[frame_of].permute(1, 0, 2, 3)  # [B, n, H, D]
        kb = c.content * zt + c.key_noise * torch.randn((B, n, H, D), generator=g, dtype=torch.float64)
        qb = c.content * zt + c.query_noise * torch.randn((B, n, H, D), generator=g, dtype=torch.float64)
        kb[..., sink_ch : sink_ch + 2] = 0.0
        qb[..., sink_ch : sink_ch + 2] = 0.0
        qb[..., sink_ch] = sink_amp
        kb[:, sinks, :, sink_ch] = sink_amp
        qs.append(Rope3D.rotate(qb, cos, sin))
        ks.append(Rope3D.rotate(kb, cos, sin))
        zv = _ar1(F, (B, H, Dv), c.value_persistence, g)[frame_of].permute(1, 0, 2, 3)
        vs.append(c.value_scale * torch.tanh(zv + c.value_spread * torch.randn((B, n, H, Dv), generator=g,
                                                                                dtype=torch.float64)))
    f32 = torch.float32
    return QKVStream(config=c, seed=seed, q=torch.stack(qs).to(f32), k=torch.stack(ks).to(f32),
                     v=torch.stack(vs).to(f32), sinks=sinks)
