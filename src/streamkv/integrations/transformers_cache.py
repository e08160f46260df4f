"""The transformers ``Cache`` backed by one streamkv cache (see
:mod:`streamkv.integrations.transformers` for the semantics and the supported features).

:class:`StreamKVCache` holds a :class:`~streamkv.caches.KVCache` whose ``k_shape`` is
``(B, H_kv, sink + window, D)`` (``seq_dim=2``, heads at dim 1: transformers' own layout), or
``(B, sink + window, H_kv, D)`` (``seq_dim=1``, heads at dim 2: the *token-major* layout the
certifier serves, with recall slots; see :mod:`.transformers_two_tier`), and one
:class:`StreamKVLayer` per decoder layer. A forward of ``n`` tokens is one streamkv span::

    layer 0's update    commit the previous span (a scored policy evicts here), open the next
                        n positions (host side; skipped when prepare_step(n) already did it)
    layer i's update    write K/V into the span's slots; hand the layer's KVRead to the
                        attention function through the attention kwargs (key "streamkv")
    attention           streamkv_attention: the queries to the cache's observers if it has
                        any (certify, recall); attend(q, read, causal=True); marks layer i done

The span stays open after the forward: the next forward commits it (a scored policy needs
the statistics of every layer's attention first). Lifecycle checks are host-int checks
(layers in order, each layer attended by the streamkv attention function, the previous
forward complete); a violation raises ``RuntimeError`` naming the layer.

Why one module: :class:`StreamKVCache` is one transformers ``Cache`` whose lifecycle, layer
checks, saved state and host counters (the layers written and attended in the open span) are one
state machine; split, each part would read and reset the others' counters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from ..caches import KVCache, KVRead
from ..attention import attend as attend_read
from ..certify import Certifier
from ..certify.tier import CompressedTier
from ..storage import check_int
from .transformers_checks import (
    GenerateChecks,
    check_attention_kwargs,
    check_model_config,
    check_positions,
    check_states,
    mark_asked,
    take_asked,
)
from .transformers_layer import StreamKVLayer, refusal
from .transformers_two_tier import check_certifiers

__all__ = ["ATTN_IMPLEMENTATION", "KWARG", "Handoff", "StreamKVCache", "StreamKVLayer", "check_attention_kwargs",
           "check_model_config"]

#: the attention-kwargs key under which a layer's update hands its read to the attention function
KWARG = "streamkv"
#: the ``attn_implementation`` name of the streamkv attention function
ATTN_IMPLEMENTATION = "streamkv"


class Handoff:
    """What one layer's update hands to the attention function: the cache, the layer index,
    the :class:`~streamkv.caches.KVRead` to attend to (the span's queries' positions are
    ``read.query_positions``), and the ``keys``/``values`` the update returned to the model
    (``read.keys``/``read.values``, or their ``[B, H_kv, slots, D]`` views for a token-major
    cache): the attention function checks that it was handed those."""

    __slots__ = ("cache", "keys", "layer", "read", "values")

    def __init__(self, cache: StreamKVCache, layer: int, read: KVRead, keys: Tensor, values: Tensor) -> None:
        self.cache, self.layer, self.read = cache, layer, read
        self.keys, self.values = keys, values


_EAGER_ONLY = ("this cache has observers (a Certifier: certificates and recall run on the host between the write and "
               "the attention) or stores K/V token-major; it runs eagerly only")


@torch.compiler.disable(reason=refusal("torch.compile", _EAGER_ONLY))
def _refuse_compiled() -> None:
    """Raise the refusal of a compiled forward. Never traced: dynamo breaks the graph here and
    the compiled forward raises when it reaches layer 0's update (before any write); with
    ``fullgraph=True`` the trace itself fails."""
    raise RuntimeError(refusal("torch.compile", _EAGER_ONLY))


class StreamKVCache(GenerateChecks, Cache):
    """A transformers ``Cache`` over a streamkv cache, for ``generate()`` and forward loops.

    Args:
        kv: the streamkv cache, ``num_layers`` = the model's decoder layers, in one of two
            layouts: ``k_shape == (B, H_kv, sink + window, D)``, ``seq_dim=2``, heads at dim 1
            (transformers' own; no recall slots), or token-major ``(B, sink + window, H_kv,
            D)``, ``seq_dim=1``, heads at dim 2 (the certifier's; recall slots allowed): its
            K/V are written, and its queries handed over, as transposed views. Its ``chunk``
            is the largest forward (prefill chunk) accepted. Observers of ``kv`` (a
            :class:`~streamkv.certify.Certifier`, a ``HistoryCheck``) receive each layer's
            queries (``kv.observe_queries``) between its write and its attention; a cache
            with observers, or token-major, runs eagerly only (``torch.compile`` refused).
        config: optional, the model's (text) config: ``get_mask_sizes`` then refuses a model
            whose config names another attention implementation before any layer runs
            (without it, a foreign attention is caught at the next layer's update).
        on_attention: optional ``fn(layer, query, read, out)`` called by the attention
            function after each layer: ``query`` ``[B, H_q, T, D]`` (RoPE applied), the
            :class:`~streamkv.caches.KVRead` it attended to (physical ``keys``/``values``,
            slot ``positions``, ``query_positions``) and the output ``out`` ``[B, T, H_q, D]``
            (before ``o_proj``): per-layer outputs and attention for evaluations. It must not
            modify them. Traced along under ``torch.compile``. ``read`` is in ``kv``'s
            layout (``read.seq_dim``: 2, or 1 for a token-major cache).
        certifier: optional, the :class:`~streamkv.certify.Certifier` watching ``kv``
            (``causal=True``; :func:`~streamkv.integrations.transformers.build_cache` makes
            it with ``certify=``), kept as ``self.certifier`` (None: none).
        tier: optional, the :class:`~streamkv.certify.tier.CompressedTier` watching ``kv``
            (``causal=True``; ``build_cache(..., tier=)``): every layer then attends tiers 1
            and 2 together (:meth:`attend`), kept as ``self.tier``.

    Mutation: every forward writes the span's K/V in place (buffers never move); state lives
    in ``kv`` and three host counters here. Use under ``torch.no_grad()`` /
    ``torch.inference_mode()`` (the core refuses tensors that require grad).
    """

    def __init__(self, kv: KVCache, *, config: Any = None,
                 on_attention: Callable[[int, Tensor, KVRead, Tensor], None] | None = None,
                 certifier: Certifier | None = None, tier: CompressedTier | None = None) -> None:
        if not isinstance(kv, KVCache):
            raise TypeError(f"kv must be a streamkv KVCache, got {type(kv).__name__}")
        layout = (kv.seq_dim, kv.head_dim)
        if len(kv.k_shape) != 4 or layout not in ((2, 1), (1, 2)):
            raise ValueError(
                f"kv must have transformers' layout k_shape (B, H_kv, slots, D) with seq_dim=2 and head_dim=1, or the "
                f"token-major (B, slots, H_kv, D) with seq_dim=1 and head_dim=2, got k_shape={kv.k_shape}, "
                f"seq_dim={kv.seq_dim}, head_dim={kv.head_dim}"
            )
        if kv.storage.recall_slots and layout != (1, 2):
            raise ValueError(f"kv must have no recall slots (an observer's tokens) in transformers' layout, got "
                             f"{kv.storage.recall_slots}: recall slots need the token-major layout (the certifier's)")
        if on_attention is not None and not callable(on_attention):
            raise TypeError(f"on_attention must be callable or None, got {type(on_attention).__name__}")
        if certifier is not None and not isinstance(certifier, Certifier):
            raise TypeError(f"certifier must be a streamkv Certifier or None, got {type(certifier).__name__}")
        if certifier is not None and certifier.cache is not kv:
            raise ValueError("certifier must be a Certifier watching kv; this one watches another cache")
        if certifier is not None and not certifier.causal:
            raise ValueError("certifier must be built with causal=True (the streamkv attention is position-causal)")
        if tier is not None and (not isinstance(tier, CompressedTier) or tier.cache is not kv or not tier.causal):
            raise ValueError("tier must be a CompressedTier watching kv, built with causal=True (the streamkv "
                             "attention is position-causal)")
        if config is not None:
            cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
            layers = getattr(cfg, "num_hidden_layers", None)
            if isinstance(layers, int) and layers != kv.num_layers:
                raise ValueError(f"kv holds {kv.num_layers} layers, the config {layers} (num_hidden_layers): build kv "
                                 f"for the model's decoder layers")
        self.kv = kv
        self.config = config
        self.on_attention = on_attention
        self.certifier = certifier
        self.tier = tier
        #: K/V stored ``[B, slots, H_kv, D]`` (written and read through transposed views)
        self.token_major = layout == (1, 2)
        self._written = 0  # layers written in the open span
        self._attended = 0  # layers attended by streamkv_attention in the open span
        self._prepared = False  # prepare_step opened the span of the next forward
        self._stale: str | None = None  # why the stream must be reset before the next forward
        super().__init__(layers=[StreamKVLayer(self, i) for i in range(kv.num_layers)])

    # ------------------------------------------------------------------ lifecycle
    @property
    def num_layers(self) -> int:
        return self.kv.num_layers

    @property
    def eager_only(self) -> bool:
        """The cache has observers (they run on the host) or is token-major: ``torch.compile``
        and ``prepare_step`` are refused."""
        return self.token_major or bool(self.kv.observers)

    def prepare_step(self, n: int) -> None:
        """Commit the open span and open the next ``n`` positions *before* a forward, outside
        a compiled region (host side: Python ints, a few device ops, a sync for scored
        kinds). The next forward then does no lifecycle work in its layer 0, so a compiled
        decode step reads no changing host state. Without it, layer 0's update does this.

        Raises:
            RuntimeError: the previous forward did not complete (see :meth:`update`), a step
                is already prepared, or the cache runs eagerly only (:attr:`eager_only`).
            ValueError: ``n`` not in ``[1, chunk]``.
            TypeError: ``n`` not an int (``1.0``, ``True``).

        All raised before anything changes.
        """
        n = check_int("n", n)  # before anything: prepare_step(1.0) must not commit, then refuse
        if self.eager_only:
            raise RuntimeError(refusal("prepare_step (compiled steps)", _EAGER_ONLY))
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
        if self._stale is not None:
            raise RuntimeError(f"{self._stale}: call reset() and start the stream again")
        if kv.is_open and self._written != L:
            raise RuntimeError(
                f"the previous forward stopped after writing {self._written} and attending {self._attended} of {L} "
                f"layers: the open span is incomplete; call reset() and start the stream again (a state loaded "
                f"into .kv directly: load it with StreamKVCache.load_state_dict)"
            )
        if kv.is_open:
            self._check_attended()
        if position_ids is not None:
            check_positions(position_ids, kv.end, n)
        if kv.is_open:
            kv.commit()
        kv.begin_tokens(n)
        self._written = self._attended = 0

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Write one layer's K/V of the forward (``[B, H_kv, n, D]``, RoPE applied) and return
        the layer's physical buffers ``[B, H_kv, slots, D]`` (transposed views for a token-major
        cache); the read that says how to attend to them goes to the attention function in
        ``kwargs["kwargs"]["streamkv"]``.

        Raises:
            RuntimeError: layers out of order; a layer whose attention did not run through
                the streamkv attention function; a model that does not pass its attention
                kwargs to ``cache.update`` (``kwargs=``); a compiled forward with a cache that
                runs eagerly only (:attr:`eager_only`).
            ValueError / TypeError: K/V that do not fit the cache (batch, heads, dims, dtype,
                device), ``n`` outside ``[1, chunk]``, position ids that are not the stream's,
                attention kwargs the streamkv attention does not serve
                (:func:`check_attention_kwargs`). All raised before layer 0 changes anything.
        """
        L = self.num_layers
        compiling = torch.compiler.is_compiling()
        if compiling and self.eager_only:
            _refuse_compiled()  # a graph break that raises when the compiled forward runs
        attn_kwargs = kwargs.get("kwargs")
        if not isinstance(attn_kwargs, dict):
            raise RuntimeError(  # noqa: TRY004 - a model that does not pass its kwargs, not a bad value
                "StreamKVCache needs the attention kwargs dict passed to cache.update(k, v, layer_idx, kwargs=kwargs) "
                "(transformers' Llama/Qwen2-style attention modules do): it carries the cache read to the streamkv "
                "attention function; this model's attention module does not pass it"
            )
        check_attention_kwargs(attn_kwargs)
        layer_idx = self._check_layer(layer_idx)
        self.check_states(key_states, value_states, layer_idx)
        n = key_states.shape[-2]
        if layer_idx == 0 and not compiling:
            take_asked(self)
        if layer_idx == 0 and not self._prepared:
            self._advance(n, attn_kwargs.get("position_ids"))
        elif layer_idx != self._written:
            raise RuntimeError(
                f"layers must be updated in order once per forward: expected layer {self._written % L}, got "
                f"{layer_idx}; call reset() and start the stream again"
            )
        elif layer_idx == 0 and not compiling:  # prepare_step opened the span: its length and positions
            start, m = self.kv.open_span
            if n != m:
                raise ValueError(f"prepare_step({m}) opened {m} positions; this forward has {n} tokens")
            if attn_kwargs.get("position_ids") is not None:
                check_positions(attn_kwargs["position_ids"], start, n)
        self._check_attended()
        if self.token_major:
            key_states, value_states = key_states.transpose(1, 2), value_states.transpose(1, 2)
        read = self.kv.update(key_states, value_states, layer=layer_idx, occupancy="mask")
        keys, values = self.layers[layer_idx].keys, self.layers[layer_idx].values
        attn_kwargs[KWARG] = Handoff(self, layer_idx, read, keys, values)
        self._prepared = False
        self._written += 1
        return keys, values

    def _check_layer(self, layer_idx: Any) -> int:
        """``layer_idx`` as an int in ``[0, num_layers)``; refused before anything changes. A layer
        past the cache's last one after every layer of this forward was written (a model with more
        decoder layers than the cache, whose masks did not go through the streamkv mask function)
        leaves the stream to be reset: the next forward is refused instead of advancing it."""
        layer = check_int("layer_idx", layer_idx)
        L = self.num_layers
        if not 0 <= layer < L:
            if layer == L and self._written == L and self.kv.is_open and self._stale is None:
                self._stale = f"the last forward reached layer {L}, past this cache's {L} layers"
            raise ValueError(
                f"layer_idx must be in [0, {L}): this StreamKVCache holds {L} decoder layers, got layer {layer}; "
                f"build the cache from the model's config (build_cache(model.config, ...))"
            )
        return layer

    def _check_attended(self) -> None:
        """Every layer written in the open span was attended by the streamkv attention function."""
        if self._attended != self._written:
            raise RuntimeError(
                f"layer {self._attended} was written but its attention did not run through the streamkv attention "
                f"function (the model uses another attn_implementation, or the forward stopped in between): load the "
                f"model with attn_implementation='streamkv', and call reset() to start the stream again"
            )

    def queries(self, layer: int, query: Tensor, scaling: float | None) -> Tensor:
        """``query`` (``[B, H_q, T, D]``) in the cache's chunk layout (a view: transposed for a
        token-major cache), handed to the cache's observers first when it has any
        (``kv.observe_queries``: certified recall fills the recall slots here, which the
        layer's read sees). Called by the attention function before it attends.

        Raises:
            ValueError: a :class:`~streamkv.certify.Certifier` watching the cache certifies
                another attention than the model's (not causal, or another softmax scale than
                ``scaling``): raised before the observers run (the layer is written: the open
                span is then incomplete and the cache refuses forwards until ``reset()``).
        """
        q = query.transpose(1, 2) if self.token_major else query
        if self.kv.observers:
            check_certifiers(self.kv, scaling)
            self.kv.observe_queries(q, layer=layer)
        return q

    def attend(self, layer: int, q: Tensor, read: KVRead, scaling: float | None) -> Tensor:
        """Causal attention of ``q`` (from :meth:`queries`) over the layer's ``read`` (with a compressed
        tier, its tier 2 is part of the read: one softmax). Output in ``q``'s layout.

        Raises:
            ValueError: the tier attends at another softmax scale than ``scaling``.
        """
        if self.tier is not None:
            scale = q.shape[-1] ** -0.5 if scaling is None else float(scaling)
            if abs(scale - self.tier.scale) > 1e-12 * scale:
                raise ValueError(f"the compressed tier certifies softmax scale {self.tier.scale!r}, the model attends at "
                                 f"{scale!r}: build the cache with tier={{'scale': {scale!r}, ...}}")
        return attend_read(q, read, causal=True, scale=scaling)[0]

    def attended(self, layer: int, query: Tensor, read: KVRead, out: Tensor) -> None:
        """Called by the attention function once layer ``layer`` attended (``out``:
        ``[B, T, H_q, D]``); calls ``on_attention``."""
        self._attended += 1
        if self.on_attention is not None:
            self.on_attention(layer, query, read, out)

    def check_states(self, key_states: Tensor, value_states: Tensor, layer: int) -> None:
        """Raise ``ValueError``/``TypeError``/``RuntimeError`` unless K/V ``[B, H_kv, n, D]`` fit
        the cache as the core's write will check them (:func:`.transformers_checks.check_states`):
        checked before layer 0 opens the span, so a refused forward changes nothing."""
        check_states(self.kv, key_states, value_states, layer)

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
        mark_asked(None)
        if impl != ATTN_IMPLEMENTATION:
            raise RuntimeError(
                f"StreamKVCache ({self.kv.name}) needs attn_implementation='streamkv' (its keys lie in slot order); "
                f"the model config it was built for has {impl!r}: load the model with "
                f"attn_implementation='streamkv' or call model.set_attn_implementation('streamkv'), and build the "
                f"cache from model.config"
            )
        mark_asked(self)  # this forward's cache: the mask function and layer 0 check against it
        return self.get_seq_length() + query_length, 0

    def reset(self) -> None:
        """Forget the stream: every slot empty and zeroed, position 0 next. Buffers are kept."""
        self.kv.reset()
        self._written = self._attended = 0
        self._prepared = False
        self._stale = None

    def state_dict(self) -> dict[str, Any]:
        """The stream between two forwards (:meth:`~streamkv.caches.KVCache.state_dict` of
        :attr:`kv`), to continue with :meth:`load_state_dict` in a cache of the same configuration.
        Refused while a forward is incomplete (its open span is not a stream state)."""
        L = self.num_layers
        if self.kv.is_open and not self._written == self._attended == L:
            raise RuntimeError(f"state_dict(): the last forward wrote {self._written} and attended {self._attended} "
                               f"of {L} layers; save between two complete forwards")
        return self.kv.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream of ``state`` (:meth:`state_dict`): the next ``generate()`` or forward
        goes on from it. Refused as :meth:`~streamkv.caches.KVCache.load_state_dict` refuses (nothing
        changes). Load through this method, not through :attr:`kv`: the wrapper's count of the
        forward's layers follows the load."""
        self.kv.load_state_dict(state)
        L = self.num_layers
        self._written = self._attended = L if self.kv.is_open else 0  # saved between complete forwards
        self._prepared = False
        self._stale = None

    def fork(self, n: int = 1) -> list[StreamKVCache]:
        """``n`` caches continuing this stream (built with ``pages=``), for best-of-n ``generate()``
        continuations of one prompt: :mod:`.transformers_fork`."""
        from .transformers_fork import fork_cache
        return fork_cache(self, n)

    # ------------------------------------------------------------------ refused
    def reorder_cache(self, beam_idx: Tensor) -> None:
        raise RuntimeError(
            refusal("beam search (reorder_cache)", "one stream per batch row; use greedy or sampling"))

    def crop(self, tokens_to_remove: int) -> None:
        raise RuntimeError(refusal(
            "crop (assisted/speculative decoding, rollback)", "evicted tokens cannot be restored"))

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise RuntimeError(refusal("batch expansion", f"the buffers are allocated for batch {self.kv.k_shape[0]}"))

    def batch_select_indices(self, indices: Tensor) -> None:
        raise RuntimeError(refusal("batch selection", f"the buffers are allocated for batch {self.kv.k_shape[0]}"))

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
