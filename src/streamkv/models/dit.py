"""``CausalVideoDiT``: a small causal Wan-2.1-style DiT whose self-attention runs on a cache.

Per chunk of latent frames ``[B, in_channels, F, latent_h, latent_w]``::

    patch embed (1 x p x p)  ->  tokens x [B, L, dim]      L = F * grid_h * grid_w
    timestep t -> sinusoid -> MLP -> e [B, dim] -> 6 x dim modulation per block
    per block:
        x += gate1 * SelfAttn(LN(x) * (1 + scale1) + shift1)   q/k RMSNorm, 3D RoPE,
                                                               K/V written to the cache,
                                                               attention over the cache
        x += CrossAttn(LN(x), text K/V cached once per prompt)
        x += gate2 * FFN(LN(x) * (1 + scale2) + shift2)
    head: LN(x) * (1 + scale) + shift -> linear -> unpatchify -> flow [B, C, F, H, W]

Self-attention within the chunk is bidirectional; the chunk sees the cached sinks and
window (the chunk itself included, as in Self-Forcing). With ``rope_mode="absolute"`` (the
Wan recipe) keys are rotated at their stream positions before the write, so attention
may read the cache in physical order -- unless the cache stores raw keys
(``cache.rope_at_read``, :meth:`CausalVideoDiT.rope_at_read`): then the blocks write raw
keys and every read rotates keys and queries by the cache's position map (frame axis only),
in physical order, on any cache kind. ``rope_mode="cache_relative"`` stores keys unrotated
and rotates them at read time by their index in the chronological view; that path
must gather.

Context parallelism (``cp``, Ulysses): each rank embeds a token shard of the chunk;
around self- and cross-attention an all-to-all trades token shards for head shards, so
each rank's cache and text K/V hold ``H/N`` heads (:mod:`streamkv.distributed`).

Weights are random (seeded); nothing is downloaded. The text encoder is replaced by a
seeded embedding of the prompt string (:meth:`CausalVideoDiT.encode_prompt`).

Why one module: the model reads top to bottom as the diagram above (embedding, blocks,
head), and the attention block's cache call, RoPE and context-parallel exchange are one
sequence that is clearer in place than split across files.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import Order, attend
from ..caches import CacheSpec, KVCache, KVRead
from ..caches.read import Occupancy
from ..distributed.group import check_split
from ..rope import Rope3D
from .config import DiTConfig

if TYPE_CHECKING:
    from ..distributed import ContextParallel

__all__ = ["CausalVideoDiT", "CrossKV"]

RopeMode = Literal["absolute", "cache_relative"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


@dataclass
class CrossKV:
    """Text cross-attention K/V of every layer for one prompt: ``[B, text_len, H, D]`` each."""

    keys: list[Tensor]
    values: list[Tensor]


class Block(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        d, eps = cfg.dim, cfg.eps
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.norm1 = nn.LayerNorm(d, eps=eps, elementwise_affine=False)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.norm_q, self.norm_k = RMSNorm(d, eps), RMSNorm(d, eps)
        self.norm3 = nn.LayerNorm(d, eps=eps, elementwise_affine=True)
        self.cq, self.ck, self.cv, self.co = (nn.Linear(d, d) for _ in range(4))
        self.cnorm_q, self.cnorm_k = RMSNorm(d, eps), RMSNorm(d, eps)
        self.norm2 = nn.LayerNorm(d, eps=eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(d, cfg.ffn), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn, d))
        self.modulation = nn.Parameter(torch.randn(1, 6, d) / d**0.5)

    def _heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.heads, self.head_dim))

    def cross_kv(self, context: Tensor) -> tuple[Tensor, Tensor]:
        return self._heads(self.cnorm_k(self.ck(context))), self._heads(self.cv(context))

    def forward(
        self,
        x: Tensor,
        e: Tensor,
        kv,
        cross: tuple[Tensor, Tensor],
        rope: tuple[Tensor, Tensor],
        *,
        rope_mode: RopeMode,
        relative_rope: Callable[[int], tuple[Tensor, Tensor]] | None,
        order: Order,
        occupancy: Occupancy | None,
        timer: Callable[[float], None] | None,
        cp: ContextParallel | None = None,
    ) -> Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation + e).unbind(1)  # e: [B, 6, dim]
        h = self.norm1(x) * (1 + scale1.unsqueeze(1)) + shift1.unsqueeze(1)
        q = self._heads(self.norm_q(self.q(h)))
        k = self._heads(self.norm_k(self.k(h)))
        v = self._heads(self.v(h))
        if cp is not None:  # Ulysses: token shard, all heads -> whole chunk, this rank's heads
            q, k, v = cp.tokens_to_heads(q, k, v)
        cos, sin = rope
        if rope_mode == "absolute" and getattr(getattr(kv, "cache", None), "rope_at_read", None) is not None:
            # the cache stores raw keys and rotates keys and queries by its position map at read
            read = _timed(timer, kv.update, k, v, q, occupancy=occupancy)
            attn, _ = attend(q, read, order=order)
        elif rope_mode == "absolute":
            q, k = Rope3D.rotate(q, cos, sin), Rope3D.rotate(k, cos, sin)
            read = _timed(timer, kv.update, k, v, q, occupancy=occupancy)
            attn, _ = attend(q, read, order=order)
        else:  # keys stored unrotated, rotated by their chronological index at read time
            read = _timed(timer, kv.update, k, v, occupancy=occupancy)
            n, c = read.num_retained, q.shape[1]
            if n is None:
                raise ValueError(f"cache-relative RoPE needs the chronological path: {read.chronological_refusal}")
            rel_cos, rel_sin = relative_rope(n)  # tables for relative positions 0..n-1
            q = Rope3D.rotate(q, rel_cos[n - c :].unsqueeze(1), rel_sin[n - c :].unsqueeze(1))
            attn, _ = attend(
                q, read, order=order, rope_mode="cache_relative",
                key_transform=lambda kc: Rope3D.rotate(kc, rel_cos, rel_sin),
            )
        if cp is not None:
            attn = cp.heads_to_tokens(attn)
        x = x + gate1.unsqueeze(1) * self.o(attn.flatten(-2))
        cq = self._heads(self.cnorm_q(self.cq(self.norm3(x))))
        if cp is not None:  # the text K/V hold this rank's heads (CausalVideoDiT.cross_kv)
            (cq,) = cp.tokens_to_heads(cq)
        ck, cv = cross
        ca = F.scaled_dot_product_attention(cq.transpose(1, 2), ck.transpose(1, 2), cv.transpose(1, 2))
        ca = ca.transpose(1, 2)
        if cp is not None:
            ca = cp.heads_to_tokens(ca)
        x = x + self.co(ca.flatten(-2))
        h = self.norm2(x) * (1 + scale2.unsqueeze(1)) + shift2.unsqueeze(1)
        return x + gate2.unsqueeze(1) * self.ffn(h)

    def forward_dense(self, x: Tensor, e: Tensor, cross: tuple[Tensor, Tensor], rope: tuple[Tensor, Tensor],
                      allowed: Tensor) -> Tensor:
        """The block over a whole token sequence with an attention mask (training; no cache).

        The same weights and arithmetic as :meth:`forward` with absolute RoPE, except that
        the modulation is per token (``e``: ``[B, L, 6, dim]``) and self-attention reads the
        sequence itself under ``allowed`` (bool ``[L, L]``, True where query row ``i`` sees
        key ``j``). Differentiable; mutates nothing.
        """
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation.unsqueeze(1) + e).unbind(2)
        h = self.norm1(x) * (1 + scale1) + shift1
        q = self._heads(self.norm_q(self.q(h)))
        k = self._heads(self.norm_k(self.k(h)))
        v = self._heads(self.v(h))
        cos, sin = rope
        q, k = Rope3D.rotate(q, cos, sin), Rope3D.rotate(k, cos, sin)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=allowed).transpose(1, 2)
        x = x + gate1 * self.o(attn.flatten(-2))
        cq = self._heads(self.cnorm_q(self.cq(self.norm3(x))))
        ck, cv = cross
        ca = F.scaled_dot_product_attention(cq.transpose(1, 2), ck.transpose(1, 2), cv.transpose(1, 2))
        x = x + self.co(ca.transpose(1, 2).flatten(-2))
        h = self.norm2(x) * (1 + scale2) + shift2
        return x + gate2 * self.ffn(h)


def _timed(timer: Callable[[float], None] | None, fn: Callable[..., KVRead], *args, **kwargs) -> KVRead:
    """``fn(*args, **kwargs)``, its seconds reported to ``timer`` (synchronising on CUDA)."""
    if timer is None:
        return fn(*args, **kwargs)
    cuda = args[0].is_cuda
    if cuda:
        torch.cuda.synchronize(args[0].device)
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    if cuda:
        torch.cuda.synchronize(args[0].device)
    timer(time.perf_counter() - t0)
    return out


def timestep_embedding(t: Tensor, dim: int) -> Tensor:
    """Sinusoidal embedding of timesteps ``[B]`` (0..1000) -> ``[B, dim]`` float32."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float().unsqueeze(-1) * freqs
    return torch.cat([args.cos(), args.sin()], dim=-1)


class CausalVideoDiT(nn.Module):
    """Causal Wan-style DiT over a streaming cache. See the module docstring.

    Args:
        cfg: the configuration (``get_config("tiny")``, ``get_config("wan2.1-1.3b")``).
        seed: seed of the random initialisation (weights are reproducible).
    """

    def __init__(self, cfg: DiTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            d, p = cfg.dim, cfg.patch
            self.patch_embed = nn.Linear(cfg.in_channels * p * p, d)
            self.text_embed = nn.Sequential(nn.Linear(cfg.text_dim, d), nn.GELU(approximate="tanh"), nn.Linear(d, d))
            self.time_embed = nn.Sequential(nn.Linear(cfg.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
            self.time_proj = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
            self.head_norm = nn.LayerNorm(d, eps=cfg.eps, elementwise_affine=False)
            self.head_modulation = nn.Parameter(torch.randn(1, 2, d) / d**0.5)
            self.head = nn.Linear(d, cfg.in_channels * p * p)
        self.rope = Rope3D(cfg.head_dim, cfg.grid_h, cfg.grid_w, max_frames=cfg.max_frames, theta=cfg.rope_theta)

    # ----------------------------------------------------------------- shapes
    def latent_shape(self, batch: int) -> tuple[int, ...]:
        """Shape of one chunk of latents: ``[B, in_channels, F, latent_h, latent_w]``."""
        c = self.cfg
        return (batch, c.in_channels, c.frames_per_chunk, c.latent_h, c.latent_w)

    def check_context_parallel(self, world_size: int) -> None:
        """Raise ``ValueError`` unless heads and chunk tokens split evenly over
        ``world_size`` ranks (Ulysses context parallelism)."""
        c = self.cfg
        check_split(
            heads=c.heads, chunk_tokens=c.chunk_tokens, world_size=world_size,
            what=f"config {c.name!r}: {c.frames_per_chunk} frames x {c.tokens_per_frame} tokens per chunk",
        )

    def cache_shapes(self, batch: int, world_size: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-layer K and V buffer shapes ``[B, sink + window, H / world_size, D]``
        (``seq_dim=1``): with context parallelism each rank caches its own heads."""
        c = self.cfg
        if world_size != 1:
            self.check_context_parallel(world_size)
        shape = (batch, c.sink_tokens + c.window_tokens, c.heads // world_size, c.head_dim)
        return shape, shape

    def cache_spec(self, batch: int, world_size: int = 1) -> CacheSpec:
        """The :class:`~streamkv.caches.CacheSpec` of this model's self-attention cache (one
        rank's heads when ``world_size > 1``), in the model's dtype and on its device."""
        k_shape, v_shape = self.cache_shapes(batch, world_size)
        c = self.cfg
        p = next(self.parameters())
        return CacheSpec(
            k_shape=k_shape, v_shape=v_shape, seq_dim=1, sink=c.sink_tokens, window=c.window_tokens,
            chunk=c.chunk_tokens, num_layers=c.layers, head_dim=2, dtype=p.dtype, device=p.device,
        )

    def check_cache(self, cache: KVCache, batch: int, world_size: int = 1) -> None:
        """Raise ``ValueError`` unless ``cache`` was built for this model and batch size
        (and for one rank of ``world_size``), in its dtype and on its device."""
        want = self.cache_spec(batch, world_size)
        got = dict(
            k_shape=cache.k_shape, v_shape=cache.v_shape, seq_dim=cache.seq_dim, sink=cache.layout.sink,
            window=cache.layout.window, chunk=cache.layout.chunk, num_layers=cache.num_layers,
            head_dim=cache.head_dim, dtype=cache.dtype, device=cache.device,
        )
        want = {k: getattr(want, k) for k in got}
        want["device"] = torch.device(want["device"])
        bad = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
        if bad:
            detail = ", ".join(f"{k}={g} (model needs {w})" for k, (g, w) in bad.items())
            raise ValueError(f"cache was built for another model shape: {detail}")

    # ----------------------------------------------------------------- prompt
    def encode_prompt(self, prompt: str, batch: int = 1) -> Tensor:
        """Stand-in for the text encoder: a seeded embedding ``[B, text_len, text_dim]``."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        gen = torch.Generator().manual_seed(zlib.crc32(prompt.encode()))
        emb = torch.randn(1, self.cfg.text_len, self.cfg.text_dim, generator=gen)
        p = next(self.parameters())
        return emb.expand(batch, -1, -1).to(device=p.device, dtype=p.dtype)

    @torch.no_grad()
    def cross_kv(self, text: Tensor, cp: ContextParallel | None = None) -> CrossKV:
        """Cross-attention K/V for every layer, computed once per prompt.

        With ``cp``, each rank keeps only its heads ``[B, text_len, H/N, D]`` (the key
        RMSNorm spans all heads, so the full projection is computed, then sliced).
        """
        ctx = self.text_embed(text)
        pairs = [blk.cross_kv(ctx) for blk in self.blocks]
        if cp is not None:
            pairs = [(cp.shard_heads(k), cp.shard_heads(v)) for k, v in pairs]
        return CrossKV([k for k, _ in pairs], [v for _, v in pairs])

    # --------------------------------------------------------------- RoPE
    def rope_tables(self, chunk_idx: int, *, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """``cos``/``sin`` ``[chunk_tokens, 1, head_dim / 2]`` at the chunk's stream positions.

        Raises ``ValueError`` if the chunk lies beyond the RoPE horizon.
        """
        c = self.cfg.chunk_tokens
        pos = torch.arange(chunk_idx * c, (chunk_idx + 1) * c, device=device)
        cos, sin = self.rope.cos_sin(pos, dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def rope_at_read(self, maps: Any = "cache_relative") -> Any:
        """A :class:`~streamkv.rope_at_read.RopeAtRead` for this model's 3D RoPE (the frame axis
        re-indexed by ``maps``, height/width bands unchanged): pass it as ``rope_at_read=`` to a
        cache (``CacheSet(kind, model.cache_spec(b).replace(rope_at_read=...))``) and the
        blocks write raw keys and the cache rotates them at every read."""
        from ..rope_at_read import RopeAtRead
        from ..rotary import FrameRope

        return RopeAtRead(FrameRope(self.rope), maps)

    def relative_rope(self, *, dtype: torch.dtype, device: torch.device) -> Callable[[int], tuple[Tensor, Tensor]]:
        """Tables for cache-relative RoPE: relative positions ``0..n-1``."""
        cos, sin = self.rope.cos_sin(torch.arange(self.cfg.sink_tokens + self.cfg.window_tokens, device=device), dtype)
        return lambda n: (cos[:n], sin[:n])

    # -------------------------------------------------------------- forward
    def patchify(self, x: Tensor) -> Tensor:
        b, ch, f, h, w = x.shape
        p = self.cfg.patch
        x = x.reshape(b, ch, f, h // p, p, w // p, p).permute(0, 2, 3, 5, 1, 4, 6)
        return x.reshape(b, f * (h // p) * (w // p), ch * p * p)

    def unpatchify(self, tokens: Tensor, frames: int) -> Tensor:
        c, p = self.cfg, self.cfg.patch
        b = tokens.shape[0]
        x = tokens.reshape(b, frames, c.grid_h, c.grid_w, c.in_channels, p, p).permute(0, 4, 1, 2, 5, 3, 6)
        return x.reshape(b, c.in_channels, frames, c.latent_h, c.latent_w)

    def forward(
        self,
        x: Tensor,
        t: Tensor,
        cache: KVCache,
        cross: CrossKV,
        rope: tuple[Tensor, Tensor],
        *,
        rope_mode: RopeMode = "absolute",
        relative_rope: Callable[[int], tuple[Tensor, Tensor]] | None = None,
        order: Order = "auto",
        occupancy: Occupancy | None = None,
        timer: Callable[[float], None] | None = None,
        cp: ContextParallel | None = None,
    ) -> Tensor:
        """Predict the flow of one chunk; writes the chunk's K/V into ``cache`` (every layer).

        Args:
            x: latents ``[B, in_channels, frames_per_chunk, latent_h, latent_w]``.
            t: timesteps ``[B]`` (0..1000; 0 is the clean pass).
            cache: one branch's cache (all layers), with the chunk begun.
            cross: the prompt's cross-attention K/V (:meth:`cross_kv`).
            rope: tables from :meth:`rope_tables` for this chunk (absolute mode).
            rope_mode, relative_rope: see the module docstring.
            order, occupancy: forwarded to :func:`~streamkv.attention.attend`.
            timer: called with the seconds of every cache write (eager measurements).
            cp: context parallelism (Ulysses). Every rank passes the same ``x`` and
                ``t``; it embeds its token shard ``[B, L/N, dim]``, its ``cache`` and
                ``cross`` hold its ``H/N`` heads (``cache_kwargs(batch, N)``,
                ``cross_kv(text, cp)``), and the output tokens are gathered, so every
                rank returns the whole flow. Four all-to-alls per block and one
                all-gather; ``None``: one process, no collective.

        Returns:
            flow prediction, the shape of ``x``.
        """
        frames = x.shape[2]
        tokens = self.patch_embed(self.patchify(x))
        if cp is not None:
            tokens = cp.shard_tokens(tokens)
        e = self.time_embed(timestep_embedding(t, self.cfg.freq_dim).to(tokens.dtype))
        e6 = self.time_proj(e).unflatten(-1, (6, self.cfg.dim))
        for i, blk in enumerate(self.blocks):
            tokens = blk(
                tokens, e6, cache.layer(i), (cross.keys[i], cross.values[i]), rope,
                rope_mode=rope_mode, relative_rope=relative_rope, order=order, occupancy=occupancy, timer=timer,
                cp=cp,
            )
        shift, scale = (self.head_modulation + e.unsqueeze(1)).unbind(1)
        out = self.head(self.head_norm(tokens) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1))
        if cp is not None:
            out = cp.gather_tokens(out)
        return self.unpatchify(out, frames)

    def forward_sequence(self, x: Tensor, t: Tensor, text: Tensor, frame_index: Tensor, allowed: Tensor) -> Tensor:
        """Flow of a whole sequence of frames in one differentiable pass (training), no cache.

        The streaming :meth:`forward` reads a cache; this reads the sequence itself under a
        frame-level mask, with the same weights (:meth:`Block.forward_dense`) and absolute
        RoPE. With a block-causal mask (each chunk sees the earlier chunks and itself) and
        clean earlier chunks at ``t = 0`` it computes what a full-history streaming rollout
        computes for the last chunk (float rounding apart). Sequences may repeat a stream
        frame (teacher forcing: a clean and a noised copy share a ``frame_index``).

        Args:
            x: latents ``[B, in_channels, F, latent_h, latent_w]`` (any float dtype of the model).
            t: timesteps ``[B, F]`` (0..1000), one per frame.
            text: prompt embeddings ``[B, text_len, text_dim]`` (:meth:`encode_prompt`); the
                cross-attention K/V are computed here, with gradients.
            frame_index: ``int64 [F]``, the stream frame of each frame (its RoPE time).
            allowed: ``bool [F, F]``, True where frame ``i``'s tokens attend to frame ``j``'s;
                every row needs at least one True (its own frame, for a streaming model).

        Returns:
            the flow ``[B, in_channels, F, latent_h, latent_w]``. Mutates nothing.

        Raises:
            TypeError: ``frame_index`` not int64 or ``allowed`` not bool.
            ValueError: shapes that do not match ``x`` or the config; an empty mask row;
                a frame beyond the RoPE horizon.
        """
        c = self.cfg
        if x.dim() != 5 or x.shape[1] != c.in_channels or tuple(x.shape[3:]) != (c.latent_h, c.latent_w):
            raise ValueError(f"x must be [B, {c.in_channels}, F, {c.latent_h}, {c.latent_w}], got {tuple(x.shape)}")
        b, f = x.shape[0], x.shape[2]
        if tuple(t.shape) != (b, f):
            raise ValueError(f"t must be [B, F] = [{b}, {f}], got {tuple(t.shape)}")
        if tuple(text.shape) != (b, c.text_len, c.text_dim):
            raise ValueError(f"text must be [{b}, {c.text_len}, {c.text_dim}], got {tuple(text.shape)}")
        if frame_index.dtype != torch.int64 or allowed.dtype != torch.bool:
            raise TypeError(f"frame_index must be int64 and allowed bool, got {frame_index.dtype} and {allowed.dtype}")
        if tuple(frame_index.shape) != (f,) or tuple(allowed.shape) != (f, f):
            raise ValueError(f"frame_index must be [{f}] and allowed [{f}, {f}], got {tuple(frame_index.shape)} "
                             f"and {tuple(allowed.shape)}")
        if not bool(allowed.any(1).all()):
            raise ValueError("every frame must attend to at least one frame (a row of allowed is all False)")
        n = c.tokens_per_frame
        positions = (frame_index.to(x.device).unsqueeze(1) * n + torch.arange(n, device=x.device)).flatten()
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        rope = (cos.unsqueeze(1), sin.unsqueeze(1))
        token_mask = allowed.to(x.device).repeat_interleave(n, 0).repeat_interleave(n, 1)
        tokens = self.patch_embed(self.patchify(x))
        e = self.time_embed(timestep_embedding(t, c.freq_dim).to(tokens.dtype)).repeat_interleave(n, 1)  # [B, L, d]
        e6 = self.time_proj(e).unflatten(-1, (6, c.dim))
        ctx = self.text_embed(text)
        for blk in self.blocks:
            tokens = blk.forward_dense(tokens, e6, blk.cross_kv(ctx), rope, token_mask)
        shift, scale = (self.head_modulation.unsqueeze(1) + e.unsqueeze(2)).unbind(2)
        return self.unpatchify(self.head(self.head_norm(tokens) * (1 + scale) + shift), f)
