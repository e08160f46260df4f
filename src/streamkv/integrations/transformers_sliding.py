"""Sliding-window and mixed models in transformers >= 5.24 (Mistral, Qwen2 with sliding layers,
Gemma-2/3-style alternation, gpt-oss-style), and StreamingLLM's in-cache positions.

Usage::

    import streamkv.integrations.transformers_sliding as sw     # registers attn_implementation="streamkv_windowed"

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="streamkv_windowed")
    cache = sw.build_windowed_cache(model.config, chunk=256, full_window=4092, sink=4, dtype=model.dtype)
    out = model.generate(ids, cache=cache, prefill_chunk_size=256, max_new_tokens=64)

The layers are grouped by ``config.layer_types`` (Mistral without ``layer_types``: every layer
sliding). Each group is one streamkv cache (one allocation for its layers):

``sliding_attention``  a **ring of ``sliding_window + chunk - 1`` slots**, no sinks: after a
                       forward of ``n <= chunk`` tokens at ``[e, e + n)`` it holds the last
                       ``W + chunk - 1 >= W + n - 1`` positions, which is every key any of the
                       forward's queries may see; the attention masks **per query**: a query
                       at ``p`` sees exactly ``(p - W, p]`` (transformers' sliding window:
                       ``kv_idx > q_idx - W``). Exact for every prefill chunk size: each query
                       of a chunk sees its own window, so outputs do not depend on how the
                       prompt is chunked. Nothing is ever re-allocated or shifted.
``full_attention``     a cache of ``kind`` (default the ring) of ``sink + full_window`` slots:
                       exact full attention while the stream fits, sink + window attention after
                       (:mod:`streamkv.integrations.transformers`' semantics).

StreamingLLM (arXiv 2309.17453, "positions within the cache"): ``positions="streaming_llm"`` stores
raw keys in the full-attention group and rotates them at every read by their rank in the cache
(:mod:`streamkv.rope_at_read`); sliding groups then rotate at read under ``absolute`` (their
model's rule, exactly). The model's own RoPE must then be the identity: call the model with
``position_ids`` of zeros (:func:`stream_generate` does; ``generate()`` computes its own position
ids and is refused by the check below). Only transformers' default RoPE (``rope_type="default"``)
is rebuilt here; other RoPE types are refused for ``positions``.

Refused with an error (besides what :mod:`streamkv.integrations.transformers` refuses): a mask
pattern other than causal or causal sliding window (checked by evaluating the mask function on a
grid before any layer runs), a ``sliding_window`` kwarg that is not the layer group's window,
attention logit soft-capping (``softcap``: Gemma 2's default; Gemma-2-style configs with
``attn_logit_softcapping=None`` run), ``position_ids`` that are not the stream's next positions
(or, with ``positions``, not zeros), padding, beam search, ``crop``, layers out of order.

Why this long: what is exact, against which transformers class, and every refusal are listed here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

from ..attention import attend
from ..caches import CACHE_KINDS, KVCache, KVRead
from ..rope_at_read import RopeAtRead
from ..rotary import Rope1D
from .transformers_cache import check_attention_kwargs
from .transformers_checks import GenerateChecks
from .transformers_layer import layer_buffers

__all__ = ["ATTN_IMPLEMENTATION", "WindowedStreamKVCache", "build_windowed_cache", "layer_groups",
           "stream_generate", "windowed_attention", "windowed_mask"]

ATTN_IMPLEMENTATION = "streamkv_windowed"
KWARG = "streamkv_windowed"


def layer_groups(config: Any) -> list[str]:
    """Each decoder layer's type, ``"full_attention"`` or ``"sliding_attention"``; refuses others."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = getattr(cfg, "layer_types", None)
    if types is None:
        kind = "sliding_attention" if getattr(cfg, "sliding_window", None) else "full_attention"
        types = [kind] * cfg.num_hidden_layers
    bad = sorted(set(types) - {"full_attention", "sliding_attention"})
    if bad:
        raise ValueError(f"{type(cfg).__name__} has layer types {bad}: only full and sliding attention are served")
    if "sliding_attention" in types and not getattr(cfg, "sliding_window", None):
        raise ValueError("sliding layers need config.sliding_window")
    return list(types)


def default_rotary(config: Any) -> Rope1D:
    """transformers' default RoPE of ``config`` (``rope_type="default"``), rebuilt as its
    float32 ``inv_freq`` (the model's own values); other RoPE types are refused."""
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_type" not in params and any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type RoPE parameters are not rebuilt for positions=; pass rotary=")
    if params.get("rope_type", "default") != "default" or params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"positions= rebuilds transformers' default RoPE only; this config has {params}: pass rotary=")
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    return Rope1D(dim, inv_freq=inv, style="half")


class _Handoff:
    __slots__ = ("cache", "layer", "read", "window")

    def __init__(self, cache: WindowedStreamKVCache, layer: int, read: KVRead, window: int | None) -> None:
        self.cache, self.layer, self.read, self.window = cache, layer, read, window


class _Layer(CacheLayerMixin):
    is_croppable = False
    is_compileable = False

    def __init__(self, owner: WindowedStreamKVCache, index: int) -> None:
        super().__init__()
        group, local = owner.route[index]
        kv = owner.groups[group]
        self.owner, self.index = owner, index
        self.is_sliding = group == "sliding_attention"
        self.keys, self.values = kv.keys(local), kv.values(local)
        self.device = kv.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Allocated at construction."""

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        return self.owner.update(key_states, value_states, self.index, *args, **kwargs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length()

    def get_max_length(self) -> int:
        return self.keys.shape[-2]

    def reset(self) -> None:
        self.owner.reset()


class WindowedStreamKVCache(GenerateChecks, Cache):
    """A transformers ``Cache`` over one streamkv cache per layer group (see the module docstring).

    Args:
        groups: ``{"sliding_attention": KVCache, "full_attention": KVCache}`` (those the model has),
            each ``k_shape == (B, H_kv, slots, D)``, ``seq_dim=2``, one layer per layer of its type.
        layer_types: each decoder layer's type (:func:`layer_groups`).
        sliding_window: the model's window (for sliding groups).
        raw_keys: the caches rotate at read (``rope_at_read``): forwards must pass ``position_ids`` 0.
    """

    def __init__(self, groups: dict[str, KVCache], layer_types: list[str], *, sliding_window: int | None,
                 raw_keys: bool = False) -> None:
        counts = {g: layer_types.count(g) for g in set(layer_types)}
        if set(groups) != set(counts) or any(groups[g].num_layers != n for g, n in counts.items()):
            raise ValueError(f"groups must hold one cache per layer type with that many layers {counts}, got "
                             f"{ {g: c.num_layers for g, c in groups.items()} }")
        self.groups, self.layer_types, self.sliding_window, self.raw_keys = groups, list(layer_types), sliding_window, raw_keys
        seen: dict[str, int] = {}
        self.route = []
        for t in layer_types:
            self.route.append((t, seen.get(t, 0)))
            seen[t] = seen.get(t, 0) + 1
        self._written = self._attended = 0
        self.chunk = min(c.layout.chunk for c in groups.values())
        super().__init__(layers=[_Layer(self, i) for i in range(len(layer_types))])

    # ------------------------------------------------------------------ lifecycle
    @property
    def _any(self) -> KVCache:
        return next(iter(self.groups.values()))

    def _advance(self, n: int, position_ids: Tensor | None) -> None:
        if not 1 <= n <= self.chunk:
            raise ValueError(f"a forward holds 1 to chunk={self.chunk} tokens, got {n}: prefill in chunks of at most "
                             f"{self.chunk} (generate(..., prefill_chunk_size={self.chunk}))")
        L = len(self.layer_types)
        if self._any.is_open and (self._written != L or self._attended != L):
            raise RuntimeError(f"the previous forward wrote {self._written} and attended {self._attended} of {L} "
                               f"layers: the span is incomplete; call reset()")
        if position_ids is not None:
            start = self._any.end
            want = torch.zeros(n, dtype=torch.long) if self.raw_keys else torch.arange(start, start + n)
            if position_ids.dim() != 2 or position_ids.shape[-1] != n or not bool(
                    (position_ids.cpu() == want).all()):
                what = ("zeros (the caches rotate raw keys at read: the model's RoPE must be the identity)"
                        if self.raw_keys else f"the stream's next positions [{start}, {start + n})")
                raise ValueError(f"position_ids must be {what}, got {position_ids[0].tolist()}")
        for kv in self.groups.values():
            if kv.is_open:
                kv.commit()
        for kv in self.groups.values():
            kv.begin_tokens(n)
        self._written = self._attended = 0

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Write one layer's K/V ``[B, H_kv, n, D]`` and return its physical buffers; the read
        goes to :func:`windowed_attention` through the attention kwargs."""
        attn_kwargs = kwargs.get("kwargs")
        if not isinstance(attn_kwargs, dict):
            raise RuntimeError("WindowedStreamKVCache needs the attention kwargs passed to cache.update(..., kwargs=)")
        check_attention_kwargs({k: v for k, v in attn_kwargs.items() if k != "sliding_window"})
        group, local = self.route[layer_idx]
        kv = self.groups[group]
        if key_states.shape[:2] != (kv.k_shape[0], kv.k_shape[1]) or key_states.dtype != kv.dtype:
            raise ValueError(f"layer {layer_idx} key_states {tuple(key_states.shape)} {key_states.dtype} do not fit "
                             f"the cache ({kv.k_shape}, {kv.dtype})")
        if layer_idx == 0:
            self._advance(key_states.shape[-2], attn_kwargs.get("position_ids"))
        elif layer_idx != self._written or self._attended != self._written:
            raise RuntimeError(f"layers must be updated and attended in order: expected layer {self._written}, got "
                               f"{layer_idx}; call reset()")
        read = kv.update(key_states, value_states, layer=local, occupancy="mask")
        window = self.sliding_window if group == "sliding_attention" else None
        attn_kwargs[KWARG] = _Handoff(self, layer_idx, read, window)
        self._written += 1
        return layer_buffers(kv, local)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._any.end

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False

    def reset(self) -> None:
        for kv in self.groups.values():
            kv.reset()
        self._written = self._attended = 0

    def reorder_cache(self, beam_idx: Tensor) -> None:
        raise RuntimeError("WindowedStreamKVCache does not support beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int) -> None:
        raise RuntimeError("WindowedStreamKVCache does not support crop (evicted tokens cannot be restored)")


def windowed_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                       attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention interface for ``"streamkv_windowed"``: ``attend(q, read,
    causal=True, window=W)`` with ``W`` the layer group's window (None for full layers)."""
    handoff = kwargs.get(KWARG)
    if not isinstance(handoff, _Handoff):
        raise RuntimeError("attn_implementation='streamkv_windowed' needs a WindowedStreamKVCache "
                           "(build_windowed_cache) passed as cache=")
    if getattr(module, "layer_idx", handoff.layer) != handoff.layer:
        raise RuntimeError(f"the cache read is for layer {handoff.layer}, the module is layer {module.layer_idx}")
    if kwargs.get("sliding_window") != handoff.window:
        raise ValueError(f"layer {handoff.layer}: the model asks for sliding_window={kwargs.get('sliding_window')}, "
                         f"the cache's group serves {handoff.window}")
    check_attention_kwargs({k: v for k, v in kwargs.items() if k != "sliding_window"})
    if dropout:
        raise ValueError(f"no attention dropout; got dropout={dropout} (model.eval())")
    if attention_mask is not None:
        raise ValueError("the windowed attention builds its mask from the slot positions; a 4D mask is refused")
    out, _ = attend(query, handoff.read, causal=True, window=handoff.window, scale=scaling)
    handoff.cache._attended += 1
    return out.transpose(1, 2), None


def windowed_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                  mask_function: Any = None, attention_mask: Tensor | None = None, local_size: int | None = None,
                  **kwargs: Any) -> None:
    """The mask interface: checks that the pattern is causal (or causal sliding with the
    config's window) by evaluating ``mask_function`` on a grid, and the 2D padding mask; None."""
    if mask_function is not None:
        n = 2 * (local_size or 4) + 3
        qi, ki = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
        got = mask_function(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long), qi, ki)
        want = ki <= qi
        if local_size is not None:
            want = want & (ki > qi - local_size)
        if not bool((torch.as_tensor(got).expand(n, n) == want).all()):
            raise ValueError("the windowed attention serves causal and causal sliding-window masks; this model asks "
                             "for another pattern (bidirectional, chunked, overlays, packed sequences)")
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch_size, kv_length) or not bool(
            attention_mask.bool().all()):
        raise ValueError(f"attention_mask must be None or 2D [batch={batch_size}, {kv_length}] of ones (no padding), got "
                         f"{tuple(attention_mask.shape)}")
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, windowed_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, windowed_mask)


def build_windowed_cache(config: Any, *, chunk: int, full_window: int | None = None, sink: int = 4,
                         kind: str = "ring", batch_size: int = 1, dtype: torch.dtype = torch.float32,
                         device: torch.device | str = "cpu", positions: str | None = None,
                         rotary: Rope1D | None = None, **policy_params: Any) -> WindowedStreamKVCache:
    """A :class:`WindowedStreamKVCache` for ``config``: sliding groups on a ring of
    ``sliding_window + chunk - 1`` slots, full groups on ``kind`` with ``sink + full_window``
    slots (needed when the model has full layers), ``positions`` a map of
    :data:`~streamkv.positions.POSITION_MAPS` for the full layers (raw keys; see the module
    docstring)."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = layer_groups(cfg)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    W = getattr(cfg, "sliding_window", None) if "sliding_attention" in types else None
    rot = None
    if positions is not None:
        rot = rotary if rotary is not None else default_rotary(cfg)
    groups: dict[str, KVCache] = {}
    for t in dict.fromkeys(types):
        n = types.count(t)
        if t == "sliding_attention":
            slots, s, win, k = W + chunk - 1, 0, W + chunk - 1, "ring"
            rope = RopeAtRead(rot, "absolute") if rot is not None else None
            params: dict[str, Any] = {}
        else:
            if full_window is None:
                raise ValueError("this model has full-attention layers: give full_window= (slots besides the sinks)")
            slots, s, win, k = sink + full_window, sink, full_window, kind
            rope = RopeAtRead(rot, positions) if rot is not None else None
            params = policy_params
        shape = (batch_size, kv_heads, slots, head_dim)
        groups[t] = CACHE_KINDS[k](shape, shape, seq_dim=2, head_dim=1, sink=s, window=win, chunk=chunk,
                                   num_layers=n, dtype=dtype, device=device, rope_at_read=rope, **params)
    return WindowedStreamKVCache(groups, types, sliding_window=W, raw_keys=rot is not None)


@torch.no_grad()
def stream_generate(model: Any, ids: Tensor, cache: WindowedStreamKVCache, *, max_new_tokens: int,
                    prefill_chunk: int) -> tuple[Tensor, list[Tensor]]:
    """Greedy decoding in a forward loop: the prompt in chunks of ``prefill_chunk``, then one token
    at a time; ``position_ids`` are zeros when the cache rotates raw keys (the model's RoPE the
    identity), else the stream positions. Returns ``(tokens [1, max_new_tokens], logits per step)``."""
    out, logits = [], []
    pos = 0

    def forward(x: Tensor) -> Tensor:
        nonlocal pos
        n = x.shape[1]
        p = torch.zeros(1, n, dtype=torch.long) if cache.raw_keys else torch.arange(pos, pos + n).view(1, -1)
        pos += n
        return model(input_ids=x, position_ids=p.to(x.device), cache=cache, use_cache=True).logits[:, -1]

    last = None
    for a in range(0, ids.shape[1], prefill_chunk):
        last = forward(ids[:, a:a + prefill_chunk])
    for _ in range(max_new_tokens):
        logits.append(last)
        tok = last.argmax(-1, keepdim=True)
        out.append(tok)
        last = forward(tok)
    return torch.cat(out, dim=1), logits
