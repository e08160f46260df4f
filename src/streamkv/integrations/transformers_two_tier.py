"""The two-tier cache in transformers: a device budget (any cache kind), key sketches of every
evicted token, and certified recall from the host store, behind the same
:class:`~streamkv.integrations.transformers_cache.StreamKVCache`.

The :class:`~streamkv.certify.Certifier` serves the token-major layout ``[B, T, H, D]``
(``seq_dim=1``, heads at dim 2), so a two-tier cache stores K/V that way and the integration
transposes views at the boundary: K/V are written as ``key_states.transpose(1, 2)``, the queries
``[B, H_q, T, D]`` are handed to the cache as ``query.transpose(1, 2)`` (``observe_queries``:
the certificate, and recall into the recall slots, before the layer attends), and ``attend``
returns ``[B, T, H_q, D]``, which is what transformers' attention functions return. No copy:
every transpose is a view.

This module builds the certifier of a cache for a model config (:func:`build_certifier`) and
checks, at every attention, that each certifier watching a cache certifies the attention the
model runs (:func:`check_certifiers`: position-causal, the model's softmax scale).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..caches import KVCache
from ..certify import Certifier

__all__ = ["CERTIFY_OPTIONS", "build_certifier", "check_certifiers", "config_scale"]

#: the Certifier options ``build_cache(..., certify={...})`` accepts (``causal`` is fixed: True)
CERTIFY_OPTIONS = ("recall_tau", "sketch_bits", "block_tokens", "box_dtype", "events_per_block", "pool_events",
                   "max_blocks", "scale")


def config_scale(cfg: Any) -> float:
    """The softmax scale of transformers' Llama-pattern attention modules for a (text) config:
    ``head_dim ** -0.5`` (``head_dim`` from the config, else ``hidden_size // heads``), computed
    as those modules compute it. A model that scales otherwise is refused at its first
    attention (:func:`check_certifiers`); pass ``certify={"scale": ...}`` for it."""
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return head_dim**-0.5


def build_certifier(kv: KVCache, cfg: Any, certify: Mapping[str, Any]) -> Certifier:
    """A position-causal :class:`~streamkv.certify.Certifier` watching ``kv`` (token-major layout),
    with ``certify``'s options (:data:`CERTIFY_OPTIONS`; ``scale`` defaults to
    :func:`config_scale`). Adds itself to ``kv``'s observers.

    Raises:
        TypeError: ``certify`` is not a mapping, or names an option not in :data:`CERTIFY_OPTIONS`
            (``causal`` included: the streamkv attention is causal, so the certificate is).
        ValueError / TypeError: what the Certifier refuses (``recall_tau`` outside (0, 1), or
            without recall slots; ``sketch_bits`` not 4 or 8, ...).
    """
    if not isinstance(certify, Mapping):
        raise TypeError(f"certify must be a dict of Certifier options, got {type(certify).__name__}")
    bad = sorted(k for k in certify if k not in CERTIFY_OPTIONS)
    if bad:
        raise TypeError(f"certify takes the Certifier options {list(CERTIFY_OPTIONS)}; got {bad} (causal is always "
                        f"True: the streamkv attention is position-causal)")
    options = dict(certify)
    options.setdefault("scale", config_scale(cfg))
    return Certifier(kv, causal=True, **options)


def check_certifiers(kv: KVCache, scaling: float | None) -> None:
    """Raise ``ValueError`` unless every :class:`~streamkv.certify.Certifier` watching ``kv``
    certifies the attention the model runs: position-causal, at the model's softmax scale
    ``scaling`` (None: ``1/sqrt(D)``, as ``attend``), compared exactly. Host checks, no device work."""
    scale = 1.0 / math.sqrt(kv.k_shape[-1]) if scaling is None else float(scaling)
    for obs in kv.observers:
        if not isinstance(obs, Certifier):
            continue
        if not obs.causal:
            raise ValueError("a Certifier watching a StreamKVCache must be built with causal=True (the streamkv "
                             "attention is position-causal); this one certifies block attention")
        if obs.scale != scale:
            raise ValueError(
                f"the Certifier certifies attention at softmax scale {obs.scale!r}, the model attends at {scale!r}: "
                f"build the cache with certify={{'scale': {scale!r}, ...}} (the stream must be reset: this forward "
                f"wrote its K/V before the attention function could check)"
            )
