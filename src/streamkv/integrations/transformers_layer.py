"""One decoder layer of a :class:`~streamkv.integrations.transformers_cache.StreamKVCache`:
transformers' per-layer cache interface, with no state of its own (every call goes to the
owning cache)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin

if TYPE_CHECKING:
    from .transformers_cache import StreamKVCache

__all__ = ["StreamKVLayer", "refusal"]


def refusal(what: str, why: str) -> str:
    """The message of a StreamKVCache refusal."""
    return f"StreamKVCache does not support {what}: {why}"


def layer_buffers(kv, index: int) -> tuple[Tensor, Tensor]:
    """What a transformers cache layer exposes as its ``keys`` / ``values`` (layer layout): the
    store's dense buffers, or for a store without them (quantised codes) zero-stride placeholders
    that carry shape, dtype and device. The streamkv attention function never reads them: it
    attends the read handed to it."""
    bufs = kv.storage.store.buffers()
    if bufs is None:
        bufs = tuple(torch.zeros((), dtype=kv.dtype, device=kv.device).expand(kv.storage.full_shape(w))
                     for w in ("k", "v"))
    return bufs[0][index], bufs[1][index]


class StreamKVLayer(CacheLayerMixin):
    """One decoder layer of a :class:`StreamKVCache` (transformers' per-layer interface).

    ``keys``/``values`` are the layer's physical buffers ``[B, H_kv, slots, D]`` (views of
    the streamkv storage, transposed views for a token-major cache; slots in ring/policy
    order, not chronological; recall slots last). The layer holds no state of its own:
    ``update`` goes to the owning cache."""

    is_sliding = False
    is_croppable = False
    is_compileable = False  # see StreamKVCache.is_compileable

    def __init__(self, owner: StreamKVCache, index: int) -> None:
        super().__init__()
        kv = owner.kv
        self.owner, self.index = owner, index
        self.keys, self.values = layer_buffers(kv, index)
        if owner.token_major:  # [B, slots, H, D] -> transformers' [B, H, slots, D]
            self.keys, self.values = self.keys.transpose(1, 2), self.values.transpose(1, 2)
        self.device = kv.device
        self.batch_size, self.num_heads, _, self.k_head_dim = self.keys.shape
        self.v_head_dim = kv.v_shape[-1]
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Allocated at construction; raises ``ValueError`` if ``key_states`` do not fit."""
        self.owner.check_states(key_states, value_states, self.index)

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        return self.owner.update(key_states, value_states, self.index, *args, **kwargs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.get_mask_sizes(query_length, self.index)

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length(self.index)

    def get_max_length(self) -> int:
        """Slots per head (``sink + window``): what the layer holds, not a limit on the stream."""
        return self.owner.kv.layout.capacity

    def reset(self) -> None:
        """Resets the whole cache: the layers share one stream."""
        self.owner.reset()

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self.owner.reorder_cache(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        self.owner.crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.owner.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: Tensor) -> None:
        self.owner.batch_select_indices(indices)

    def offload(self) -> None:
        raise RuntimeError(refusal("offloading", "the streamkv buffers stay on their device (fixed addresses)"))

    def prefetch(self) -> None:
        self.offload()

    def __repr__(self) -> str:
        return f"StreamKVLayer({self.owner.kv.name}, layer={self.index})"
