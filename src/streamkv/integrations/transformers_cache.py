"""The transformers ``Cache`` backed by one streamkv cache (see
:mod:`streamkv.integrations.transformers` for the semantics and the supported features).

:class:`StreamKVCache` holds a :class:`~streamkv.caches.KVCache` whose ``k_shape`` is
``(B, H_kv, sink + window, D)`` (``seq_dim=2``, heads at dim 1: transformers' own layout) and
one :class:`StreamKVLayer` per decoder layer. A forward of ``n`` tokens is one streamkv span::

    layer 0's update    commit the previous span (a scored policy evicts here), open the next
                        n positions (host side; skipped when prepare_step(n) already did it)
    layer i's update    write K/V into the span's slots; hand the layer's KVRead to the
                        attention function through the attention kwargs (key "streamkv")
    attention           streamkv_attention: attend(q, read, causal=True); marks layer i done

The span stays open after the forward: the next forward commits it (a scored policy needs
the statistics of every layer's attention first). Lifecycle checks are host-int checks
(layers in order, each layer attended by the streamkv attention function, the previous
forward complete); a violation raises ``RuntimeError`` naming the layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from ..caches import KVCache, KVRead

__all__ = ["ATTN_IMPLEMENTATION", "KWARG", "Handoff", "StreamKVCache", "StreamKVLayer", "check_attention_kwargs"]

#: the attention-kwargs key under which a layer's update hands its read to the attention function
KWARG = "streamkv"
#: the ``attn_implementation`` name of the streamkv attention function
ATTN_IMPLEMENTATION = "streamkv"


# attention kwargs that change what attention computes: refused
_REFUSED_KWARGS = {
    "sliding_window": "sliding-window layers (the cache's own window replaces them)",
    "softcap": "attention logit soft-capping",
    "s_aux": "attention sinks (s_aux)",
    "position_bias": "position bias",
    "cu_seq_lens_q": "packed sequences (cu_seq_lens)",
    "cu_seq_lens_k": "packed sequences (cu_seq_lens)",
}


def check_attention_kwargs(attn_kwargs: dict[str, Any]) -> None:
    """Raise ``ValueError`` if the attention kwargs ask for what the streamkv attention does
    not compute (sliding window, soft-capping, attention sinks, position bias, packed
    sequences, non-causal attention, attention weights). The cache checks them at each
    layer's ``update``, before anything is written; the attention function again."""
    for name, what in _REFUSED_KWARGS.items():
        if attn_kwargs.get(name) is not None:
            raise ValueError(
                f"the streamkv attention does not support {what} ({name}={attn_kwargs[name]!r} was passed)")
    if attn_kwargs.get("is_causal") is False:
        raise ValueError("the streamkv attention is causal; is_causal=False is refused")
    if attn_kwargs.get("output_attentions"):
        raise ValueError("the streamkv attention does not return attention weights (output_attentions=True)")


class Handoff:
    """What one layer's update hands to the attention function: the cache, the layer index
    and the :class:`~streamkv.caches.KVRead` to attend to (the span's queries' positions are
    ``read.query_positions``)."""

    __slots__ = ("cache", "layer", "read")

    def __init__(self, cache: StreamKVCache, layer: int, read: KVRead) -> None:
        self.cache, self.layer, self.read = cache, layer, read


class StreamKVLayer(CacheLayerMixin):
    """One decoder layer of a :class:`StreamKVCache` (transformers' per-layer interface).

    ``keys``/``values`` are the layer's physical buffers ``[B, H_kv, sink + window, D]``
    (views of the streamkv storage; slots in ring/policy order, not chronological). The
    layer holds no state of its own: ``update`` goes to the owning cache."""

    is_sliding = False
    is_croppable = False
    is_compileable = False  # see StreamKVCache.is_compileable

    def __init__(self, owner: StreamKVCache, index: int) -> None:
        super().__init__()
        kv = owner.kv
        self.owner, self.index = owner, index
        self.keys, self.values = kv.keys(index), kv.values(index)
        self.device = kv.device
        self.batch_size, self.num_heads, _, self.k_head_dim = kv.k_shape
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
        raise RuntimeError(_refusal("offloading", "the streamkv buffers stay on their device (fixed addresses)"))

    def prefetch(self) -> None:
        self.offload()

    def __repr__(self) -> str:
        return f"StreamKVLayer({self.owner.kv.name}, layer={self.index})"


def _refusal(what: str, why: str) -> str:
    return f"StreamKVCache does not support {what}: {why}"


class StreamKVCache(Cache):
    """A transformers ``Cache`` over a streamkv cache, for ``generate()`` and forward loops.

    Args:
        kv: the streamkv cache: ``k_shape == (B, H_kv, sink + window, D)``, ``seq_dim=2``,
            heads at dim 1, ``num_layers`` = the model's decoder layers, no recall slots.
            Its ``chunk`` is the largest forward (prefill chunk) accepted.
        config: optional, the model's (text) config: ``get_mask_sizes`` then refuses a model
            whose config names another attention implementation before any layer runs
            (without it, a foreign attention is caught at the next layer's update).
        on_attention: optional ``fn(layer, query, read, out)`` called by the attention
            function after each layer: ``query`` ``[B, H_q, T, D]`` (RoPE applied), the
            :class:`~streamkv.caches.KVRead` it attended to (physical ``keys``/``values``,
            slot ``positions``, ``query_positions``) and the output ``out`` ``[B, T, H_q, D]``
            (before ``o_proj``): per-layer outputs and attention for evaluations. It must not
            modify them. Traced along under ``torch.compile``.

    Mutation: every forward writes the span's K/V in place (buffers never move); state lives
    in ``kv`` and three host counters here. Use under ``torch.no_grad()`` /
    ``torch.inference_mode()`` (the core refuses tensors that require grad).
    """

    def __init__(self, kv: KVCache, *, config: Any = None,
                 on_attention: Callable[[int, Tensor, KVRead, Tensor], None] | None = None) -> None:
        if not isinstance(kv, KVCache):
            raise TypeError(f"kv must be a streamkv KVCache, got {type(kv).__name__}")
        if len(kv.k_shape) != 4 or kv.seq_dim != 2 or kv.head_dim != 1:
            raise ValueError(
                f"kv must have transformers' layout k_shape (B, H_kv, slots, D) with seq_dim=2 and head_dim=1, got "
                f"k_shape={kv.k_shape}, seq_dim={kv.seq_dim}, head_dim={kv.head_dim}"
            )
        if kv.storage.recall_slots:
            raise ValueError(f"kv must have no recall slots (an observer's tokens), got {kv.storage.recall_slots}")
        if on_attention is not None and not callable(on_attention):
            raise TypeError(f"on_attention must be callable or None, got {type(on_attention).__name__}")
        self.kv = kv
        self.config = config
        self.on_attention = on_attention
        self._written = 0  # layers written in the open span
        self._attended = 0  # layers attended by streamkv_attention in the open span
        self._prepared = False  # prepare_step opened the span of the next forward
        super().__init__(layers=[StreamKVLayer(self, i) for i in range(kv.num_layers)])

    # ------------------------------------------------------------------ lifecycle
    @property
    def num_layers(self) -> int:
        return self.kv.num_layers

    def prepare_step(self, n: int) -> None:
        """Commit the open span and open the next ``n`` positions *before* a forward, outside
        a compiled region (host side: Python ints, a few device ops, a sync for scored
        kinds). The next forward then does no lifecycle work in its layer 0, so a compiled
        decode step reads no changing host state. Without it, layer 0's update does this.

        Raises:
            RuntimeError: the previous forward did not complete (see :meth:`update`), or a
                step is already prepared.
            ValueError: ``n`` not in ``[1, chunk]``.
        """
        if self._prepared:
            raise RuntimeError("prepare_step was already called and no forward ran since")
        self._advance(n, None)
        self._prepared = True

    @torch.compiler.disable
    def _advance(self, n: int, position_ids: Tensor | None) -> None:
        """Commit the open span and open ``n`` positions (never traced: a host-side plan)."""
        kv, L = self.kv, self.num_layers
        C = kv.layout.chunk
        if not 1 <= n <= C:
            raise ValueError(
                f"a forward holds 1 to chunk={C} tokens (the cache's largest span), got {n}: prefill in chunks of at "
                f"most {C} tokens (generate(..., prefill_chunk_size={C})) or build the cache with a larger chunk"
            )
        if kv.is_open and self._written != L:
            raise RuntimeError(
                f"the previous forward stopped after writing {self._written} and attending {self._attended} of {L} "
                f"layers: the open span is incomplete; call reset() and start the stream again"
            )
        if kv.is_open:
            self._check_attended()
        if position_ids is not None:
            self._check_positions(position_ids, kv.end, n)
        if kv.is_open:
            kv.commit()
        kv.begin_tokens(n)
        self._written = self._attended = 0

    @staticmethod
    def _check_positions(position_ids: Tensor, start: int, n: int) -> None:
        if position_ids.dim() != 2 or position_ids.shape[-1] != n:
            raise ValueError(
                f"position_ids must be [batch or 1, {n}] for a forward of {n} tokens, got {tuple(position_ids.shape)}"
            )
        want = torch.arange(start, start + n, device=position_ids.device)
        if not bool((position_ids == want).all()):
            raise ValueError(
                f"position_ids must be the stream's next positions [{start}, {start + n}) in every row (no padding, "
                f"no restart): the cache holds {start} positions, got {position_ids[0].tolist()} in row 0"
            )

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Write one layer's K/V of the forward (``[B, H_kv, n, D]``, RoPE applied) and return
        the layer's physical buffers ``[B, H_kv, sink + window, D]``; the read that says how to
        attend to them goes to the attention function in ``kwargs["kwargs"]["streamkv"]``.

        Raises:
            RuntimeError: layers out of order; a layer whose attention did not run through
                the streamkv attention function; a model that does not pass its attention
                kwargs to ``cache.update`` (``kwargs=``).
            ValueError / TypeError: K/V that do not fit the cache (batch, heads, dims, dtype,
                device), ``n`` outside ``[1, chunk]``, position ids that are not the stream's,
                attention kwargs the streamkv attention does not serve
                (:func:`check_attention_kwargs`). All raised before layer 0 changes anything.
        """
        L = self.num_layers
        attn_kwargs = kwargs.get("kwargs")
        if not isinstance(attn_kwargs, dict):
            raise RuntimeError(  # noqa: TRY004 - a model that does not pass its kwargs, not a bad value
                "StreamKVCache needs the attention kwargs dict passed to cache.update(k, v, layer_idx, kwargs=kwargs) "
                "(transformers' Llama/Qwen2-style attention modules do): it carries the cache read to the streamkv "
                "attention function; this model's attention module does not pass it"
            )
        check_attention_kwargs(attn_kwargs)
        self.check_states(key_states, value_states, layer_idx)
        if layer_idx == 0 and not self._prepared:
            self._advance(key_states.shape[-2], attn_kwargs.get("position_ids"))
        elif layer_idx != self._written:
            raise RuntimeError(
                f"layers must be updated in order once per forward: expected layer {self._written % L}, got "
                f"{layer_idx}; call reset() and start the stream again"
            )
        self._check_attended()
        read = self.kv.update(key_states, value_states, layer=layer_idx, occupancy="mask")
        attn_kwargs[KWARG] = Handoff(self, layer_idx, read)
        self._prepared = False
        self._written += 1
        return read.keys, read.values

    def _check_attended(self) -> None:
        """Every layer written in the open span was attended by the streamkv attention function."""
        if self._attended != self._written:
            raise RuntimeError(
                f"layer {self._attended} was written but its attention did not run through the streamkv attention "
                f"function (the model uses another attn_implementation, or the forward stopped in between): load the "
                f"model with attn_implementation='streamkv', and call reset() to start the stream again"
            )

    def attended(self, layer: int, query: Tensor, read: KVRead, out: Tensor) -> None:
        """Called by the attention function once layer ``layer`` attended (``out``:
        ``[B, T, H_q, D]``); calls ``on_attention``."""
        self._attended += 1
        if self.on_attention is not None:
            self.on_attention(layer, query, read, out)

    def check_states(self, key_states: Tensor, value_states: Tensor, layer: int) -> None:
        """Raise ``ValueError``/``TypeError`` unless K/V ``[B, H_kv, n, D]`` fit the cache
        (shape, dtype, device): checked before layer 0 opens the span, so a refused forward
        changes nothing."""
        kv = self.kv
        for name, t, shape in (("key", key_states, kv.k_shape), ("value", value_states, kv.v_shape)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name}_states must be a Tensor, got {type(t).__name__}")
            if t.dim() != 4 or t.shape[:2] != shape[:2] or t.shape[-1] != shape[-1]:
                raise ValueError(
                    f"layer {layer} {name}_states must be [batch={shape[0]}, kv_heads={shape[1]}, n, {shape[-1]}] "
                    f"(the cache was built for that batch and model), got {tuple(t.shape)}"
                )
            if t.dtype != kv.dtype:
                raise TypeError(f"layer {layer} {name}_states are {t.dtype}, the cache holds {kv.dtype}: build it with "
                                f"the model's compute dtype")
            if t.device != kv.device:
                raise ValueError(f"layer {layer} {name}_states are on {t.device}, the cache on {kv.device}")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions entered by the forwards so far (a span opened by ``prepare_step`` not
        counted): where the next forward's positions start. Not the number of tokens held
        (at most ``sink + window``). A host int: compiled steps pass ``position_ids``."""
        kv = self.kv
        return kv.end - kv.open_span[1] if self._prepared else kv.end

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """:meth:`get_seq_length` (0 inside a compiled step: only the streamkv mask function
        receives it, and ignores it)."""
        return 0 if torch.compiler.is_compiling() else self.get_seq_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """``(positions entered once this forward is in, 0)``: what the 2D padding mask must
        cover (:func:`~streamkv.integrations.transformers.streamkv_mask` checks it). Inside a
        compiled step ``(sink + window, 0)``, so no host counter is traced (compiled steps take
        no mask). The attention never reads these sizes: it masks by slot positions.

        Raises:
            RuntimeError: the config given at construction names another attention
                implementation (its masks would index this cache's slots as if they were
                in position order).
        """
        if torch.compiler.is_compiling():
            return self.kv.layout.capacity, 0
        impl = getattr(self.config, "_attn_implementation", ATTN_IMPLEMENTATION)
        if impl != ATTN_IMPLEMENTATION:
            raise RuntimeError(
                f"StreamKVCache ({self.kv.name}) needs attn_implementation='streamkv' (its keys lie in slot order); "
                f"the model config it was built for has {impl!r}: load the model with "
                f"attn_implementation='streamkv' or call model.set_attn_implementation('streamkv'), and build the "
                f"cache from model.config"
            )
        return self.get_seq_length() + query_length, 0

    def reset(self) -> None:
        """Forget the stream: every slot empty and zeroed, position 0 next. Buffers are kept."""
        self.kv.reset()
        self._written = self._attended = 0
        self._prepared = False

    # ------------------------------------------------------------------ refused
    def reorder_cache(self, beam_idx: Tensor) -> None:
        raise RuntimeError(
            _refusal("beam search (reorder_cache)", "one stream per batch row; use greedy or sampling"))

    def crop(self, tokens_to_remove: int) -> None:
        raise RuntimeError(_refusal(
            "crop (assisted/speculative decoding, rollback)", "evicted tokens cannot be restored"))

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise RuntimeError(_refusal("batch expansion", f"the buffers are allocated for batch {self.kv.k_shape[0]}"))

    def batch_select_indices(self, indices: Tensor) -> None:
        raise RuntimeError(_refusal("batch selection", f"the buffers are allocated for batch {self.kv.k_shape[0]}"))

    def early_initialization(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: the buffers are allocated at construction."""

    @property
    def is_compileable(self) -> bool:
        """False for every kind, so that ``generate()`` never compiles its forward by itself:
        that compiled forward would contain layer 0's lifecycle step (host ints; here a graph
        break, and transformers' decorators then recompile per frame). Compile the decode
        step yourself instead: ``cache.prepare_step(1)`` before each call of a
        ``torch.compile``'d ``model(input_ids=..., position_ids=..., cache=cache)``; with the
        ring it compiles to one graph (``fullgraph=True``) that does not recompile across
        wraps (tested). Nothing in the forward itself reads this flag."""
        return False

    def __repr__(self) -> str:
        return f"StreamKVCache({self.kv!r})"
