"""flashdreams' KV-cache-relative RoPE on the ring (:class:`~streamkv.compat.flashdreams.CircularBlockKVCache`
with ``relative_rope_freqs=``).

flashdreams 0.1.0's Wan attention in KV-cache-relative mode (``apply_rope_before_kvcache=False``,
``KVCacheRelativeRotaryPositionEmbedding3D``) stores raw keys, and at every read rotates
``cache.cached_k().clone()`` by ``freqs[:cache.size]`` -- the key at index ``i`` of the returned
tensor at cache position ``i`` -- and the queries by ``freqs[write_end - chunk_size : write_end]``.
On ``BlockKVCache`` index ``i`` is the chronological index (it rolls the window). The ring does not
roll, so its slot ``s`` holds the key of chronological index ``j(s)`` (its rank among the held
positions: the ``cache_relative`` position map). ``cached_k()`` therefore returns the physical
buffer with slot ``s`` pre-rotated by ``freqs[j(s)] - freqs[s]``; flashdreams' own rotation by
``freqs[s]`` then places every key at ``freqs[j(s)]`` (rotations compose by adding angles), and
``write_end`` is the chronological right edge ``size``, where the current chunk's ranks end.

Cost and rounding, plainly: no roll and no chronological gather, but ``cached_k()`` is one rotated
copy of the valid slots per read (flashdreams then clones and rotates it again, as it does on
``BlockKVCache``); the two rotations round twice in the cache dtype (fp32: ~1e-7 relative; bf16:
one more bf16 rounding of the keys).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..positions import MapInputs

__all__ = ["check_relative_freqs", "rotate_full_width", "slot_ranks"]


def check_relative_freqs(freqs: object, capacity: int, head_dim: int) -> Tensor:
    """flashdreams' frequency table ``[>= capacity, 1, 1, head_dim]`` (angles, the full-width
    layout of ``KVCacheRelativeRotaryPositionEmbedding3D.shift_t``), or ``ValueError``/``TypeError``."""
    if not isinstance(freqs, Tensor) or not freqs.is_floating_point():
        raise TypeError(f"relative_rope_freqs must be a floating tensor [S, 1, 1, D], got {type(freqs).__name__}")
    if freqs.dim() != 4 or freqs.shape[0] < capacity or tuple(freqs.shape[1:3]) != (1, 1) or freqs.shape[3] != head_dim:
        raise ValueError(f"relative_rope_freqs must be [>= sink + window = {capacity}, 1, 1, {head_dim}] (flashdreams' "
                         f"KVCacheRelativeRotaryPositionEmbedding3D.shift_t layout), got {tuple(freqs.shape)}")
    return freqs


def slot_ranks(positions: Tensor) -> Tensor:
    """``int64 [S]``: each occupied slot's chronological index (rank among the held positions)."""
    pos = positions.view(1, -1)
    return MapInputs(pos, pos[:, :1], 0).rank(pos)[0]


def rotate_full_width(x: Tensor, angles: Tensor, interleaved: bool) -> Tensor:
    """``x [B, S, H, D]`` rotated by full-width ``angles [S, 1, 1, D]`` as flashdreams'
    ``apply_rope_freqs`` does (pairs ``(2k, 2k+1)`` when interleaved, else ``(d, d + D/2)``);
    computed in float32 (or wider), returned in ``x``'s dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf, a = x.to(acc), angles.to(acc)[:, 0]  # [S, 1, D]: broadcast over heads, aligned with x's [S, H, D]
    if interleaved:
        pairs = xf.unflatten(-1, (-1, 2))
        rot = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    else:
        h = xf.shape[-1] // 2
        rot = torch.cat((-xf[..., h:], xf[..., :h]), dim=-1)
    return (xf * a.cos() + rot * a.sin()).to(x.dtype)
