"""The input checks of a :class:`~streamkv.integrations.transformers_cache.StreamKVCache`: what
transformers hands the cache (attention kwargs, K/V, position ids, the model's config) is checked
here, before layer 0 commits the previous span or writes anything, so that a refused forward
changes nothing; and what a ``generate()`` call asks that the cache cannot do (:class:`GenerateChecks`:
beam search, a batch it was not built for, an input that does not extend the held stream), checked
when ``generate()`` marks the cache, before its first forward. No state of its own except the
per-thread mask-sizes token (``_ASKED``)."""

from __future__ import annotations

import inspect
import sys
import threading
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..caches import KVCache
    from .transformers_cache import StreamKVCache

__all__ = ["GenerateChecks", "check_attention_kwargs", "check_model_config", "check_positions", "check_states",
           "generate_call", "mark_asked", "take_asked"]


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


#: per thread, the :class:`StreamKVCache` whose ``get_mask_sizes`` ran last (eagerly). transformers'
#: masking utilities ask the cache for its mask sizes before the first layer of every forward,
#: then call the mask function with the model's config: :func:`check_model_config` compares the
#: two there, and layer 0's ``update`` consumes the token. A forward that never asked (a custom 4D
#: ``attention_mask`` skips the masking utilities, and the attention function would refuse it only
#: after layer 0's write) is refused at layer 0 before anything changes. Kept outside the cache so
#: that a forward refused before its first write leaves the cache's own state as it was.
_ASKED = threading.local()


def check_model_config(config: Any) -> None:
    """Called by the streamkv mask function with the model's config: raise ``ValueError`` if the
    :class:`StreamKVCache` whose mask sizes were just asked for (this forward's cache) was built for
    another number of decoder layers. Before any layer runs, so a refused forward changes nothing.
    A no-op when no cache asked, or without a config."""
    cache = getattr(_ASKED, "cache", None)
    if cache is None or config is None:
        return
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = getattr(cfg, "num_hidden_layers", None)
    if isinstance(layers, int) and layers != cache.num_layers:
        raise ValueError(
            f"this StreamKVCache was built for {cache.num_layers} decoder layers, the model has {layers} "
            f"(config.num_hidden_layers): build the cache from this model's config (build_cache(model.config, ...))"
        )


def mark_asked(cache: StreamKVCache | None) -> None:
    """``get_mask_sizes`` ran (eagerly) for ``cache`` (None: clear the token)."""
    _ASKED.cache = cache


def take_asked(cache: StreamKVCache) -> None:
    """Layer 0 of an eager forward: raise ``ValueError`` unless the masking utilities asked
    ``cache`` for its mask sizes first; consumes the token either way (see ``_ASKED``)."""
    asked = getattr(_ASKED, "cache", None) is cache
    _ASKED.cache = None
    if not asked:
        raise ValueError(
            "this forward did not ask the StreamKVCache for its mask sizes before its first layer: a custom 4D "
            "attention_mask (refused: the streamkv attention builds its mask from the slot positions), or a "
            "model that does not build its masks with transformers' masking utilities (create_causal_mask)"
        )


def check_positions(position_ids: Any, start: int, n: int) -> None:
    """Raise ``TypeError`` / ``ValueError`` unless ``position_ids`` are ``[batch or 1, n]`` and
    the stream's next positions ``[start, start + n)`` in every row."""
    if not isinstance(position_ids, Tensor):
        raise TypeError(f"position_ids must be a Tensor or None, got {type(position_ids).__name__}")
    if position_ids.dim() != 2 or position_ids.shape[-1] != n:
        raise ValueError(
            f"position_ids must be [batch or 1, {n}] for a forward of {n} tokens, got {tuple(position_ids.shape)}"
        )
    want = torch.arange(start, start + n, device=position_ids.device)
    if not bool((position_ids == want).all()):
        restart = (f"; a forward at position {int(position_ids.min())} on a cache that holds a stream starts another "
                   f"one: call cache.reset() first" if start and int(position_ids.min()) < start else "")
        raise ValueError(
            f"position_ids must be the stream's next positions [{start}, {start + n}) in every row (no padding, "
            f"no restart): the cache holds {start} positions, got {position_ids[0].tolist()} in row 0{restart}"
        )


def check_states(kv: KVCache, key_states: Any, value_states: Any, layer: int) -> None:
    """Raise ``ValueError``/``TypeError``/``RuntimeError`` unless K/V ``[B, H_kv, n, D]`` fit
    the cache as the core's write will check them (dense, shape, one ``n``, dtype, device,
    no grad under grad mode, no memory shared with the cache's buffers, inference mode when
    the buffers are inference tensors): checked before layer 0 opens the span, so a refused
    forward changes nothing."""
    batch, heads = kv.k_shape[0], kv.k_shape[kv.head_dim]  # either layout
    for name, t, dim in (("key", key_states, kv.k_shape[-1]), ("value", value_states, kv.v_shape[-1])):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}_states must be a Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise ValueError(f"layer {layer} {name}_states must be a dense (strided) tensor, got layout {t.layout}")
        if t.dim() != 4 or t.shape[:2] != (batch, heads) or t.shape[-1] != dim:
            raise ValueError(
                f"layer {layer} {name}_states must be [batch={batch}, kv_heads={heads}, n, {dim}] "
                f"(the cache was built for that batch and model), got {tuple(t.shape)}"
            )
        if t.dtype != kv.dtype:
            raise TypeError(f"layer {layer} {name}_states are {t.dtype}, the cache holds {kv.dtype}: build it with "
                            f"the model's compute dtype")
        if t.device != kv.device:
            raise ValueError(f"layer {layer} {name}_states are on {t.device}, the cache on {kv.device}")
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"layer {layer} {name}_states require grad: the cache stores values, not an autograd graph; run "
                f"the model under torch.no_grad() or torch.inference_mode()"
            )
        if not torch.compiler.is_compiling() and kv.storage.owns(t):
            raise ValueError(f"layer {layer} {name}_states share memory with the cache's own buffers: pass a "
                             f"tensor of its own (clone it)")
    if key_states.shape[-2] != value_states.shape[-2]:
        raise ValueError(f"layer {layer} key_states and value_states must hold the same n tokens, got "
                         f"{tuple(key_states.shape)} and {tuple(value_states.shape)}")
    if (not torch.compiler.is_compiling() and kv.checks.inference_buffers
            and not torch.is_inference_mode_enabled()):
        raise RuntimeError(
            f"layer {layer}: this cache was built under torch.inference_mode(), so torch lets its buffers change "
            f"only inside inference mode; run the model under torch.inference_mode() (or build the cache outside it)"
        )


def _generate_code() -> Any:
    from transformers.generation.utils import GenerationMixin

    return inspect.unwrap(GenerationMixin.generate).__code__


def generate_call() -> tuple[Any, Tensor, dict[str, Any], Any] | None:
    """The transformers ``generate()`` call running on this thread, found on the Python stack
    (its frame is ``GenerationMixin.generate``'s code): ``(generation_config, input_ids,
    model_kwargs, assistant_model)`` as that call holds them (``input_ids`` already expanded for
    ``num_beams`` / ``num_return_sequences``), or None (not inside ``generate()``, or a
    transformers whose ``generate`` keeps other names: the checks that use it are then skipped).
    Read only, once per ``generate()`` call (:class:`GenerateChecks`): it never changes what runs."""
    code = _generate_code()
    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            return None
        if frame.f_code is code:
            loc = frame.f_locals
            cfg, ids, kwargs = loc.get("generation_config"), loc.get("input_ids"), loc.get("model_kwargs")
            if cfg is None or not isinstance(ids, Tensor) or not isinstance(kwargs, dict):
                return None
            return cfg, ids, kwargs, loc.get("assistant_model")
        frame = frame.f_back
    return None


class GenerateChecks:
    """What a streamkv transformers cache refuses of a ``generate()`` call, before its first
    forward: transformers marks a cache passed to ``generate()`` (``cache._is_user_defined =
    True``) once per call, after expanding the inputs and before any forward; the setter here
    reads that call (:func:`generate_call`) and refuses, changing nothing:

    - beam search (``num_beams > 1``): one stream per batch row, and beams reorder rows after
      every step (``reorder_cache``), which evicted tokens cannot follow;
    - ``use_cache=False`` (every step feeds the whole sequence again), and assisted or
      speculative decoding (a prompt lookup, an assistant model, early exit: rejected drafts are
      cropped, which evicted tokens cannot undo);
    - a batch the cache was not built for (``generate()`` runs ``batch x num_return_sequences``
      rows);
    - a call whose input does not extend the stream the cache holds. transformers' ``generate()``
      treats a cache it is given as holding the first tokens of its input (``DynamicCache``
      too: it slices off as many input tokens as the cache holds), so a second ``generate()`` on
      the same prompt with the same cache is not a new stream: ``DynamicCache`` then continues
      from the wrong tokens without a word (or fails inside RoPE with prefill chunks). This cache
      refuses it and says ``cache.reset()``; it does not reset by itself, because continuing a
      stream (the previous output and new tokens as input) is a valid use that a silent reset
      would turn into a different computation.
    """

    @property
    def _is_user_defined(self) -> bool:
        return self.__dict__.get("_user_defined", False)

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        if value:
            self._check_generate()
        self.__dict__["_user_defined"] = bool(value)

    def _check_generate(self) -> None:
        call = generate_call()
        if call is None:
            return
        cfg, ids, kwargs, assistant = call
        name = type(self).__name__
        beams = getattr(cfg, "num_beams", 1) or 1
        if beams > 1:
            raise RuntimeError(
                f"{name} does not support beam search (generate(num_beams={beams})): it holds one stream per batch "
                f"row, and beams reorder rows after every step (reorder_cache), which evicted tokens cannot follow; "
                f"use greedy decoding or sampling (num_beams=1)")
        if getattr(cfg, "use_cache", True) is False:
            raise RuntimeError(
                f"{name} does not support generate(use_cache=False): every step then feeds the whole sequence "
                f"again, where a cache holds a stream that each forward extends; leave use_cache at True, or "
                f"pass no cache")
        asked = [f"{k}={getattr(cfg, k)}" for k in ("prompt_lookup_num_tokens", "assistant_early_exit")
                 if getattr(cfg, k, None)] + (["an assistant model"] if assistant is not None else [])
        if asked:
            raise RuntimeError(
                f"{name} does not support assisted or speculative decoding (generate() with {', '.join(asked)}): "
                f"rejected draft tokens are rolled back (crop), and evicted tokens cannot be restored")
        batch = self.layers[0].keys.shape[0]  # every layer's buffer is [batch, ...]
        if ids.shape[0] != batch:
            returns = getattr(cfg, "num_return_sequences", 1) or 1
            raise ValueError(
                f"generate() runs {ids.shape[0]} rows (the prompts x num_return_sequences={returns}) and this {name} "
                f"was built for batch {batch}: build it with batch_size={ids.shape[0]}")
        held = self.get_seq_length()
        mask = kwargs.get("attention_mask")
        length = max(ids.shape[-1], mask.shape[-1] if isinstance(mask, Tensor) and mask.dim() == 2 else 0)
        if held and length <= held:
            raise RuntimeError(
                f"this generate() call's input is {length} tokens and the {name} already holds a stream of {held} "
                f"positions: generate() continues the stream its cache holds (its input must be that stream's tokens "
                f"and new ones, e.g. the previous output plus a new turn); to start a new stream (another prompt, or "
                f"the same one again) call cache.reset() first")
