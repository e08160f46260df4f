"""streamkv caches in Hugging Face transformers >= 5.24, < 6 (``pip install 'streamkv[transformers]'``).

Usage::

    import streamkv.integrations.transformers as skv    # registers attn_implementation="streamkv"

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="streamkv")
    cache = skv.build_cache(model.config, "ring", sink=4, window=1020, chunk=256,
                            dtype=model.dtype, device=model.device)
    out = model.generate(ids, cache=cache, prefill_chunk_size=256, max_new_tokens=64)

Needs transformers 5.24 or later in 5.x (tested: 5.24.0): its attention modules call
``cache.update(k, v, layer_idx, kwargs=kwargs)`` and then the attention function with the same
kwargs, which is how a layer's read reaches :func:`streamkv_attention` (earlier 5.x releases do
not pass the kwargs; the import refuses them).

Kinds: any kind of :data:`streamkv.policies.POLICIES` (:data:`KINDS`): the window kinds
(sinks + window) and the scored per-head ones, each with its policy's parameters as keywords
(a missing required one is named with its meaning and example value). :func:`build_cache`
sizes any of them for a model config at a memory budget (``memory_tokens = sink + window``
slots per layer and key head; the buffers are allocated once).

Semantics (every kind). A forward of ``n`` tokens (``1 <= n <= chunk``: the cache's
``chunk`` is the largest prefill chunk accepted) enters positions ``[e, e + n)``, where ``e``
is the number of positions entered before (``cache.get_seq_length()``; positions are
absolute, so RoPE is applied at the stream position before the write). The forward writes the
``n`` tokens' K/V of every layer first; then each query at position ``p`` attends to the keys
the cache *holds after that write* whose position is ``<= p``. For the ring and the
chronological path what is held is ``[sinks | the last window positions]``, i.e.
``[0, min(sink, e + n)) U [max(sink, e + n - window), e + n)``: a query early in a prefill
chunk does not see keys that later tokens of the same chunk evicted, so chunked prefill is
exact for "sink + window attention, evaluated at the end of each chunk" and one-token decode is
exactly sink + window attention. For the scored kinds what is held is each (layer, key head)'s
own set (sinks pinned, the newest span protected); evictions happen when the *next* forward
begins, scored with this forward's attention. The attention runs in the buffer's physical
order with the mask built from the slot positions and the query positions (occupied and
``key_pos <= query_pos``): exact in any slot order.

The attention function. The ring's buffer is not in position order, and the scored kinds'
heads hold different positions, so transformers' masks (indexed by key order, one per
layer) cannot describe them. ``attn_implementation="streamkv"`` (registered on import in
transformers' ``AttentionInterface`` and ``AttentionMaskInterface``) calls
:func:`streamkv.attention.attend` with ``causal=True`` on the read each layer's
``cache.update`` hands over (through the attention kwargs); it also delivers the scored
kinds' attention statistics (no second pass, no model patching). Its mask function only
checks the 2D padding mask, before any layer runs. Another attention implementation with a
:class:`StreamKVCache` is refused: before any layer runs when the cache was built from the
model's config (:func:`build_cache`), else at the next layer's ``update`` (for a one-layer
model, at the next forward).

The two-tier cache. ``build_cache(config, kind, ..., recall_slots=R, certify={"recall_tau":
0.05, "sketch_bits": 8})``: the cache of ``kind`` is the device budget; a
:class:`~streamkv.certify.Certifier` (``cache.certifier``, position-causal, at the config's
softmax scale ``head_dim ** -0.5``) keeps a key sketch of every evicted token on the device and
its K/V on the host, and at every layer of every forward, between the write and the attention,
certifies each query's evicted mass and copies evicted tokens back into the ``R`` recall slots
per layer and key head until every query's certified mass is ``<= recall_tau`` (or the slots
run out: ``cache.certifier.stats["shortfalls"]``). The attention then reads the budget's slots
and the recall slots (positions masked as above): what each query attends to is what its
certificate bounds. Such a cache stores K/V token-major (``[B, slots, H_kv, D]``, the
certifier's layout; :mod:`.transformers_two_tier`) and hands transposed views across the
boundary. Scope: the certificate bounds each layer's eviction error given that layer's inputs
(:mod:`streamkv.certify`), not the drift of later layers' inputs. Eager only: ``prepare_step``
is refused, and a ``torch.compile``'d forward raises ``RuntimeError`` at layer 0's update,
before any write (a graph break that raises; with ``fullgraph=True`` the trace fails with the
same message). A certifier whose scale
or causality is not the model's attention is refused at the first attention (the forward has
then written layer 0: ``reset()``). No state dicts (the core refuses them with recall slots).

Supported: ``generate()`` (tested: greedy, with and without ``prefill_chunk_size``; sampling
runs the same forwards), batches without padding (every row at the same positions), forward loops
``model(input_ids=ids, cache=cache)`` in spans of ``1..chunk`` tokens, grouped-query attention,
``cache.reset()``, ``cache.fork(n)`` (best-of-n continuations of one prompt over pages shared
copy-on-write: ``build_cache(..., pages=...)``, :mod:`.transformers_fork`), ``torch.compile`` of the
decode step with the ring (call
``cache.prepare_step(n)`` before each compiled forward and pass ``position_ids`` and no
``attention_mask``: one graph, no recompiles across wraps; without ``prepare_step`` the
lifecycle runs eagerly in a graph break: correct, not checked for recompiles). ``generate()``
does not auto-compile these caches (``is_compileable`` is False; see :class:`StreamKVCache`).
Models: decoder-only models whose attention modules follow transformers' Llama pattern
(``cache.update(k, v, layer_idx, kwargs=kwargs)`` then the attention function with those
kwargs) and only full-attention layers; tested: Llama, Qwen2.

Refused with an error: an ``attention_mask`` with padding (or not covering the stream),
position ids that are not the stream's next positions (left padding, restarts: "call
``cache.reset()``"), a ``generate()`` call whose input does not extend the stream the cache
holds (a second ``generate()`` on a prompt: ``cache.reset()`` first; a continuation passes the
previous output and new tokens), beam search (``generate(num_beams>1)``, refused by name before
any forward; ``reorder_cache``), a ``generate()`` batch (prompts x ``num_return_sequences``)
the cache was not built for, ``crop`` (assisted / speculative decoding, rollback), batch expansion
or selection, offloading, a forward longer than ``chunk``, sliding-window / chunked /
linear-attention layers, attention logit soft-capping, attention sinks (``s_aux``),
position bias, packed sequences (``cu_seq_lens``), non-causal attention, attention dropout
in training, ``output_attentions=True``, custom 4D masks, K/V requiring grad, K/V of another
batch size, dtype or device, encoder-decoder models, and other attention implementations.
A refusal before the first layer's write leaves the cache unchanged: the mask (padding, a custom
4D mask: a forward that did not ask the cache for its mask sizes first), a model config with
another number of decoder layers than the cache (checked by the mask function), position ids
(checked against the cache's own positions, after ``prepare_step`` too, in eager mode), the
forward length, K/V that do not fit or that the core's write would refuse (grad under grad mode,
sparse, memory shared with the cache, inference mode), ``prepare_step`` of a non-int. A forward
that stops inside the model (an exception in a later layer, a layer index past the cache's last)
leaves its span incomplete: the cache then refuses every forward until ``cache.reset()``. Not
checked before the write (the attention function sees them first): a non-causal attention
module, attention dropout in training, a certifier at another softmax scale than the model's.

Why this long: every refusal and the scope of each parity claim are listed here, where a user looks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

_NEEDS = "transformers>=5.24,<6"
try:
    import transformers
    from packaging.version import Version
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, causal_mask_function
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"streamkv.integrations.transformers needs {_NEEDS}: pip install 'streamkv[transformers]'") from exc

from ..attention import attend
from ..caches import CACHE_KINDS, KVRead
from .transformers_cache import (
    ATTN_IMPLEMENTATION,
    KWARG,
    Handoff,
    StreamKVCache,
    StreamKVLayer,
    check_attention_kwargs,
    check_model_config,
)
from .transformers_two_tier import build_certifier

if not Version("5.24") <= Version(transformers.__version__) < Version("6"):  # pragma: no cover - environment
    raise ImportError(
        f"streamkv.integrations.transformers needs {_NEEDS} (from 5.24 on, attention modules hand their kwargs to "
        f"cache.update, which is how the cache's read reaches the attention function); found {transformers.__version__}"
    )

__all__ = [
    "ATTN_IMPLEMENTATION", "KINDS", "StreamKVCache", "StreamKVLayer", "build_cache", "cache_shape",
    "register", "streamkv_attention", "streamkv_mask",
]

#: the cache kinds :func:`build_cache` makes: every kind of :data:`streamkv.policies.POLICIES`
KINDS = tuple(CACHE_KINDS)


def streamkv_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function interface over a :class:`StreamKVCache` layer.

    Args:
        module: the attention module (its ``layer_idx`` must match the read's layer).
        query: ``[B, H_q, T, D]``, RoPE applied; ``H_q`` a multiple of the key heads.
        key, value: what the cache's ``update`` returned (the layer's physical buffers).
        attention_mask: None: :func:`streamkv_mask` checked the 2D mask and returned None; a
            mask that reaches here did not come from it (a custom 4D mask) and is refused.
        dropout: must be 0 (no attention dropout in training).
        scaling: the softmax scale (default ``1/sqrt(D)``).
        kwargs: the attention kwargs; ``kwargs["streamkv"]`` is the layer's handoff.

    Returns:
        ``(out, None)``: ``out`` ``[B, T, H_q, D]`` in ``query``'s dtype. Nothing is mutated
        except the scored policies' statistics (delivered by ``attend``), the cache's
        attended-layer count and, when the cache has observers, what they do with the
        queries before the attention (a certifier: certificate, recall into the recall slots).
    """
    handoff = kwargs.get(KWARG)
    if not isinstance(handoff, Handoff):
        raise RuntimeError(  # noqa: TRY004 - a missing cache, not a value of the wrong type
            "attn_implementation='streamkv' needs a StreamKVCache (streamkv.integrations.transformers.build_cache) "
            "passed as cache= (or past_key_values=), and a model that hands its attention kwargs to "
            "cache.update"
        )
    read, layer = handoff.read, handoff.layer
    if getattr(module, "layer_idx", layer) != layer:
        raise RuntimeError(f"the cache read is for layer {layer}, the attention module is layer {module.layer_idx}")
    if key is not handoff.keys or value is not handoff.values:
        raise RuntimeError(f"layer {layer}: key/value are not the buffers the StreamKVCache returned")
    check_attention_kwargs(kwargs)
    if getattr(module, "is_causal", True) is False:
        raise ValueError("the streamkv attention is causal; a non-causal attention module is refused")
    if dropout:
        raise ValueError(f"the streamkv attention has no attention dropout; got dropout={dropout} (model.eval())")
    if attention_mask is not None:
        raise ValueError(
            f"the streamkv attention builds its mask from the cache's slot positions; got a "
            f"{type(attention_mask).__name__} mask that did not come from the streamkv mask function "
            f"(a custom 4D mask?)"
        )
    cache = handoff.cache
    q = cache.queries(layer, query, scaling)  # the cache's layout; its observers certify and recall here
    out = cache.attend(layer, q, read, scaling)  # the read (and a compressed tier's tier 2)
    if not cache.token_major:  # [B, H_q, T, D] -> [B, T, H_q, D] (token-major: already)
        out = out.transpose(1, 2)
    cache.attended(layer, query, read, out)
    return out, None


def streamkv_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = causal_mask_function,
    attention_mask: Tensor | None = None,
    **kwargs: Any,
) -> None:
    """transformers' mask-function interface for ``"streamkv"``: checks the 2D padding mask
    before any layer runs, and returns None (the attention function builds the mask from
    the slot positions).

    ``kv_length`` is what :meth:`StreamKVCache.get_mask_sizes` says: every position entered
    once this forward's ``q_length`` are in. Accepted: ``attention_mask`` None, or 2D
    ``[batch_size, kv_length]`` of ones; ``mask_function`` transformers' plain causal one.

    Raises:
        ValueError: padding (zeros), a mask of another length, a non-causal or overlaid
            mask pattern (sliding window, bidirectional, image-token overlays, packed
            sequences), or any mask inside a compiled step (pass None there); a cache built
            for another number of decoder layers than the model's config (``kwargs["config"]``).
    """
    if not torch.compiler.is_compiling():
        check_model_config(kwargs.get("config"))
    if mask_function is not causal_mask_function:
        name = getattr(mask_function, "__name__", type(mask_function).__name__)
        raise ValueError(f"the streamkv attention is plain causal attention; this model asks for the mask pattern "
                         f"{name!r} (sliding window, bidirectional, overlays and packed sequences are refused)")
    if attention_mask is None:
        return
    if torch.compiler.is_compiling():
        raise ValueError("a compiled step with StreamKVCache takes attention_mask=None (no padding)")
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch_size, kv_length):
        raise ValueError(
            f"attention_mask must be None or 2D [batch={batch_size}, {kv_length}] (every position entered, this "
            f"forward's included), got {tuple(attention_mask.shape)}"
        )
    if not bool(attention_mask.bool().all()):
        raise ValueError("attention_mask has padding (zeros): StreamKVCache refuses padded batches (every row must be "
                         "at the same positions: batch 1, or prompts of equal length)")


def register() -> None:
    """Register :func:`streamkv_attention` and :func:`streamkv_mask` as
    ``attn_implementation="streamkv"`` in transformers' registries (done on import; idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, streamkv_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, streamkv_mask)


register()


def _text_config(config: Any, who: str) -> Any:
    """The text decoder's config of a model config; ``TypeError`` for what is not one."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    missing = [n for n in ("num_attention_heads", "num_hidden_layers", "hidden_size") if not hasattr(cfg, n)]
    if config is None or missing:
        raise TypeError(f"{who} needs the model's config (model.config: a transformers config with "
                        f"num_attention_heads, num_hidden_layers, hidden_size), got {type(config).__name__}"
                        + (f" without {missing}" if config is not None else ""))
    return cfg


def cache_shape(config: Any, batch_size: int, slots: int) -> tuple[int, int, int, int]:
    """``(batch_size, key_value_heads, slots, head_dim)``: one layer's key buffer for a model
    config (its text decoder); refuses what the cache cannot serve.

    Raises:
        TypeError: ``config`` is not a model config (None, ...).
        ValueError: an encoder-decoder model, or layers that are not all full attention.
    """
    cfg = _text_config(config, "cache_shape")
    if getattr(cfg, "is_encoder_decoder", False):
        raise ValueError(f"encoder-decoder models are not supported ({type(cfg).__name__})")
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"every layer must be full attention for StreamKVCache; {type(cfg).__name__} has layer types "
                         f"{sorted(set(layer_types))}")
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    return (batch_size, kv_heads, slots, head_dim)


def build_cache(
    config: Any,
    kind: str,
    *,
    chunk: int,
    window: int | None = None,
    memory_tokens: int | None = None,
    sink: int = 4,
    batch_size: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    on_attention: Callable[[int, Tensor, KVRead, Tensor], None] | None = None,
    recall_slots: int = 0,
    certify: Mapping[str, Any] | None = None,
    quant: Any = None,
    tier: Mapping[str, Any] | None = None,
    pages: Any = None,
    **policy_params: Any,
) -> StreamKVCache:
    """A :class:`StreamKVCache` of ``kind`` for a model config.

    Args:
        config: the model's config (``model.config``); its text decoder is used.
        kind: any kind of :data:`streamkv.policies.POLICIES` (:data:`KINDS`).
        chunk: the largest forward (prefill chunk) in tokens; decode steps are 1.
        window, memory_tokens: exactly one: the window (slots besides the sinks), or the
            slots per layer and key head in all (``memory_tokens = sink + window``).
        sink: pinned first positions.
        batch_size, dtype, device: of the K/V buffers (``dtype``: the model's compute dtype).
        on_attention: see :class:`StreamKVCache`.
        recall_slots: the two-tier cache's recall slots per layer and key head (besides
            ``sink + window``); needs ``certify``.
        certify: a dict of :class:`~streamkv.certify.Certifier` options (``recall_tau``,
            ``sketch_bits``, ``block_tokens``, ...; ``scale`` defaults to the config's
            ``head_dim ** -0.5``; ``causal`` is always True): makes the two-tier cache (see
            the module docstring), ``cache.certifier``. None: a plain cache.
        quant: quantised storage (:class:`~streamkv.quant.KVQuant` or a format name such as
            ``"int4"``; None: the cache dtype): codes + scales, the sinks, the open span and a
            residual in full precision, attended block by block (:mod:`streamkv.stores.quant`);
            ``cache.kv.nbytes`` counts what is allocated.
        tier: a dict of :class:`~streamkv.certify.tier.CompressedTier` options (``capacity``
            required; ``fmt``, ``group``, ``block``, ``recall_tau``, ``certify``, ``scale``, default
            the config's; ``causal`` is always True): the evicted history kept quantised on the
            device and attended (``cache.tier``); ``recall_slots`` then need ``recall_tau``.
        pages: the K/V rows in pages (``True``, or ``{"page": ..., "spare": ..., "history": ...}``:
            :class:`~streamkv.stores.PageOptions`), so that :meth:`StreamKVCache.fork` makes branches
            sharing them copy-on-write (best-of-n continuations of one prompt,
            :mod:`.transformers_fork`); ``spare`` pages are allocated for the branches' writes.
        policy_params: the policy's constructor parameters (its ``example_params`` show the
            required ones; a missing or unknown one is refused naming what the policy takes).

    Memory: the buffers are ``2 x num_layers x [batch_size, kv_heads, sink + window,
    head_dim]`` (``cache.kv.nbytes``) whatever the kind, so equal ``memory_tokens`` is equal
    KV memory. What is attended: the ring and the chronological path hold up to
    ``sink + window`` positions (the open span included); the scored kinds keep at most
    ``sink + window - chunk`` after each commit (``chunk`` slots stay free for the next span),
    so a larger ``chunk`` costs them retained tokens.

    Two-tier memory on the device: the buffers (``recall_slots`` more slots per layer and
    key head: ``cache.kv.nbytes``), the policy's state, and the certifier's key sketches (they
    grow with the evicted tokens: ``sum(s.nbytes for s in cache.certifier.summaries)``); the
    evicted K/V themselves are on the host.

    Raises ``ValueError``/``TypeError`` naming the bad size, as the core does (e.g. scored
    kinds need ``window >= 2 * chunk``), and as :func:`cache_shape` for configs (``TypeError``
    for what is not a model config, e.g. None); recall slots without ``certify``; ``certify``
    options the Certifier does not take, or refuses.
    """
    cfg = _text_config(config, "build_cache")
    if kind not in CACHE_KINDS:
        raise ValueError(f"kind must be one of {list(CACHE_KINDS)}, got {kind!r}")
    if (window is None) == (memory_tokens is None):
        raise TypeError(f"give exactly one of window= and memory_tokens=, got window={window!r}, "
                        f"memory_tokens={memory_tokens!r}")
    for name, value in (("sink", sink), ("window", window), ("memory_tokens", memory_tokens)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if window is None:
        if memory_tokens <= sink:
            raise ValueError(f"memory_tokens (sink + window) must be > sink={sink}, got {memory_tokens}")
        window = memory_tokens - sink
    if isinstance(recall_slots, bool) or not isinstance(recall_slots, int):
        raise TypeError(f"recall_slots must be an int, got {type(recall_slots).__name__} {recall_slots!r}")
    if recall_slots < 0:
        raise ValueError(f"recall_slots must be >= 0, got {recall_slots}")
    if recall_slots and certify is None and tier is None:
        raise ValueError(f"recall_slots={recall_slots} needs certify= or tier= (an observer fills the recall slots)")
    if certify is not None and tier is not None:
        raise ValueError("certify= and tier= both recall into the cache: give one (the compressed tier certifies itself)")
    if tier is not None and not isinstance(tier, Mapping):
        raise TypeError(f"tier must be a dict of CompressedTier options, got {type(tier).__name__}")
    if tier is not None and "causal" in tier:
        raise TypeError("tier takes no causal option: the streamkv attention is position-causal, so the tier is")
    k_shape = cache_shape(cfg, batch_size, sink + window)
    layout = {"seq_dim": 2, "head_dim": 1}
    if certify is not None or tier is not None:  # token-major: the certifier's (and the tier's) layout
        B, H, S, D = k_shape
        k_shape, layout = (B, S, H, D), {"seq_dim": 1, "head_dim": 2, "recall_slots": recall_slots}
    kv = CACHE_KINDS[kind](
        k_shape, k_shape, sink=sink, window=window, chunk=chunk, num_layers=cfg.num_hidden_layers, dtype=dtype,
        device=device, **layout, **({"quant": quant} if quant is not None else {}),
        **({"pages": pages} if pages is not None else {}), **policy_params,
    )
    certifier = None if certify is None else build_certifier(kv, cfg, certify)
    compressed = None
    if tier is not None:
        from ..certify.tier import CompressedTier
        from .transformers_two_tier import config_scale

        compressed = CompressedTier(kv, causal=True, **{"scale": config_scale(cfg), **tier})
    return StreamKVCache(kv, config=cfg, on_attention=on_attention, certifier=certifier, tier=compressed)
