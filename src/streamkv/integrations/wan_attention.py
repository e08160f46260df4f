"""What makes diffusers' Wan attend over a streamkv cache: RoPE tables at absolute frame
offsets and the self-attention processor.

Nothing here imports diffusers. The processor is called by a diffusers ``WanAttention``
module and uses only its public parts (``to_q``/``to_k``/``to_v`` or the fused ``to_qkv``,
``norm_q``, ``norm_k``, ``heads``, ``to_out``); the tables are cut from a
``WanRotaryPosEmbed``'s public buffers ``freqs_cos``/``freqs_sin`` and sizes
``t_dim``/``h_dim``/``w_dim``/``max_seq_len``. :mod:`streamkv.integrations.diffusers`
installs both on a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..attention import Order, attend
from ..caches import KVCache
from ..storage import check_int

__all__ = ["StreamState", "CachedWanSelfAttention", "wan_rope_tables", "rotate_pairs", "check_pair_repeated"]


@dataclass
class StreamState:
    """What the processors and the RoPE hook of one attached model read during a forward.

    :class:`~streamkv.integrations.diffusers.StreamingWan` sets it around each forward and
    clears it after; outside such a forward both fields are None and every reader refuses.

    Attributes:
        cache: the branch's cache (all layers), with its chunk open; None outside a forward.
        frame_start: the open chunk's first frame after patching (``chunk * frames_per_chunk
            // patch_t``): the time offset of its RoPE; None outside a forward.
        order: the attention path asked of :func:`~streamkv.attention.attend`.
    """

    cache: KVCache | None = None
    frame_start: int | None = None
    order: Order = "auto"

    def active(self, what: str) -> tuple[KVCache, int]:
        """``(cache, frame_start)`` of the forward in progress; ``RuntimeError`` if none is."""
        if self.cache is None or self.frame_start is None:
            raise RuntimeError(
                f"{what} ran outside a streaming forward: this model has a StreamingWan attached, so call "
                f"StreamingWan.forward(branch, ...) (which opens the branch's cache for it), or detach() the stream "
                f"to use the model on its own"
            )
        return self.cache, self.frame_start


def check_pair_repeated(rope: nn.Module) -> None:
    """Refuse (``ValueError``) RoPE buffers that do not repeat each value over a feature pair
    (``freqs[:, 2i] == freqs[:, 2i + 1]``): :func:`rotate_pairs` reads one column per pair."""
    for name in ("freqs_cos", "freqs_sin"):
        table = getattr(rope, name)
        if not torch.equal(table[:, 0::2], table[:, 1::2]):
            raise ValueError(f"{type(rope).__name__}.{name} does not repeat each value over a feature pair "
                             f"(columns 2i and 2i+1 differ): Wan's interleaved RoPE layout is expected")


def wan_rope_tables(rope: nn.Module, frame_start: int, frames: int, grid_h: int, grid_w: int) -> tuple[Tensor, Tensor]:
    """Wan's 3D RoPE ``(cos, sin)`` for ``frames x grid_h x grid_w`` tokens whose first frame
    is frame ``frame_start`` of the stream (frames, rows and columns after patching).

    Args:
        rope: a diffusers ``WanRotaryPosEmbed`` (read only).
        frame_start: absolute (patched) frame index of the first frame, ``>= 0``.
        frames, grid_h, grid_w: the token grid, each ``>= 1``.

    Returns:
        ``cos, sin``: ``[1, frames * grid_h * grid_w, 1, head_dim]`` each, the dtype and device
        of the module's buffers, tokens in (frame, row, column) order: the layout of the
        module's own output, which they equal bitwise at ``frame_start = 0`` (tested). Row
        and column angles start at 0 in every frame; only the time angle moves.

    Raises:
        TypeError: a size that is not an int.
        ValueError: a negative ``frame_start``, an empty grid, or a grid past the module's
            ``max_seq_len`` (the RoPE horizon: frames ``[frame_start, frame_start + frames)``
            must lie below it, and so must ``grid_h`` and ``grid_w``).
    """
    frame_start = check_int("frame_start", frame_start, 0)
    frames, grid_h, grid_w = (check_int(n, v, 1) for n, v in (("frames", frames), ("grid_h", grid_h),
                                                              ("grid_w", grid_w)))
    horizon = rope.max_seq_len
    if frame_start + frames > horizon:
        raise ValueError(f"frames [{frame_start}, {frame_start + frames}) pass the RoPE horizon of {horizon} frames "
                         f"(rope_max_seq_len): start a new stream")
    if grid_h > horizon or grid_w > horizon:
        raise ValueError(f"a {grid_h} x {grid_w} token grid passes the RoPE table of {horizon} rows/columns")
    grid = (frames, grid_h, grid_w)
    out = []
    for table in (rope.freqs_cos, rope.freqs_sin):
        t_part, h_part, w_part = table.split([rope.t_dim, rope.h_dim, rope.w_dim], dim=1)
        axes = (
            t_part[frame_start: frame_start + frames].view(frames, 1, 1, -1),
            h_part[:grid_h].view(1, grid_h, 1, -1),
            w_part[:grid_w].view(1, 1, grid_w, -1),
        )
        full = torch.cat([a.expand(*grid, a.shape[-1]) for a in axes], dim=-1)
        out.append(full.reshape(1, frames * grid_h * grid_w, 1, full.shape[-1]))
    return out[0], out[1]


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each feature pair ``(2i, 2i + 1)`` of ``x`` ``[B, T, H, D]`` by the angle whose
    cosine and sine sit in column ``2i`` of the tables (``[1, T, 1, D]``, each value repeated
    over its pair: Wan's interleaved layout). Computed in the promoted dtype of ``x`` and the
    tables, returned in ``x.dtype``; a new tensor (``x`` is not modified)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    c, s = cos[..., 0::2], sin[..., 0::2]
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2).to(x.dtype)


class CachedWanSelfAttention:
    """A diffusers attention processor for the self-attention (``attn1``) of Wan block
    ``layer``: the chunk's K/V go into that layer of the active cache and attention reads it.

    Per call, with ``hidden_states`` ``[B, T, dim]`` (``T``: the open chunk's tokens)::

        q, k, v = projections; q, k = RMSNorm across heads; heads split -> [B, T, H, D]
        q, k rotated by rotary_emb (absolute frame offsets: StreamingWan's RoPE hook)
        read = cache.layer(layer).update(k, v, q)   # rewrites the open chunk's slots
        out, _ = attend(q, read)                    # [B, T, H, D]
        return to_out(out.flatten(2))               # [B, T, dim]

    Attention is block-causal: the chunk's tokens see one another (bidirectional) and every
    token the cache retains (sinks and window, or a scored policy's per-head set); the
    softmax scale is ``1/sqrt(D)`` as in diffusers. Keys are stored rotated, so attention may
    read the buffer in physical order (``order="auto"`` does).

    Mutation: writes the open chunk's slots of layer ``layer`` of the active cache; a scored
    policy receives this pass's attention statistics. Eager only (the cache's host state is
    read per call). The attention backend of diffusers (``set_attention_backend``) does not
    apply here: this processor has no ``_attention_backend``, so diffusers leaves it alone.

    Raises:
        RuntimeError: called outside :meth:`StreamingWan.forward` (no open cache).
        ValueError: an ``attention_mask`` (visibility is the cache's; a mask cannot be
            honoured exactly); ``encoder_hidden_states`` (this is a self-attention
            processor); no ``rotary_emb``; extra keyword arguments; a module with image
            projections; hidden states that are not one chunk (e.g. a context-parallel shard).
    """

    def __init__(self, state: StreamState, layer: int) -> None:
        if not isinstance(state, StreamState):
            raise TypeError(f"state must be a StreamState, got {type(state).__name__}")
        self.state = state
        self.layer = check_int("layer", layer, 0)

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        rotary_emb: tuple[Tensor, Tensor] | None = None,
        **kwargs: Any,
    ) -> Tensor:
        where = f"CachedWanSelfAttention (layer {self.layer})"
        if kwargs:
            raise ValueError(f"{where}: unexpected arguments {sorted(kwargs)}")
        if attention_mask is not None:
            raise ValueError(f"{where}: an attention_mask of shape {tuple(attention_mask.shape)} cannot be honoured: "
                             f"what each query sees is decided by the cache (block-causal over its retained tokens)")
        if encoder_hidden_states is not None:
            raise ValueError(f"{where} is a self-attention processor; got encoder_hidden_states of shape "
                             f"{tuple(encoder_hidden_states.shape)} (cross-attention keeps diffusers' processor)")
        if rotary_emb is None:
            raise ValueError(f"{where}: rotary_emb is required (keys are stored rotated at their absolute frames)")
        if getattr(attn, "add_k_proj", None) is not None:
            raise ValueError(f"{where}: a module with image projections (add_k_proj) is not a Wan self-attention")
        cache, _ = self.state.active(where)
        chunk = cache.layout.chunk
        if hidden_states.dim() != 3 or hidden_states.shape[1] != chunk:
            raise ValueError(f"{where}: hidden_states must be [B, {chunk}, dim] (one chunk of tokens), got "
                             f"{tuple(hidden_states.shape)}")
        if getattr(attn, "fused_projections", False):
            q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        q, k = rotate_pairs(q, *rotary_emb), rotate_pairs(k, *rotary_emb)
        read = cache.layer(self.layer).update(k, v, q)
        out, _ = attend(q, read, order=self.state.order)
        out = out.flatten(2).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))
