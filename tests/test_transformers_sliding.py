"""Sliding-window layers on a ring of ``W + chunk - 1`` slots with a per-query window mask, on
tiny random Mistral (all sliding), Qwen2 with sliding layers (mixed) and a Gemma-2-style config
(alternating): tokens and logits equal to transformers' own ``DynamicCache`` with its own sliding
window; prompt logits independent of the prefill chunk size; StreamingLLM's in-cache positions on
a tiny Llama (SmolLM2's architecture; SmolLM2 itself runs in ``streamkv positions``) against a
reference written apart; and the refusals."""

from __future__ import annotations

import copy

import pytest
import torch

import streamkv.integrations.transformers_sliding as sw
from streamkv_lab.experiments.positions_lm import (
    ARCHS,
    sliding_window_parity,
    streaming_llm_parity,
    tiny_llama,
    tiny_model,
)

# These models normalise in float32 even when run in float64 (RMSNorm casts to float32; Gemma 2
# its RoPE angles too), so a 1e-16 difference in attention can flip a float32 rounding of a hidden
# state: measured 0 (Mistral, Qwen2) and 2.5e-6 (Gemma 2, logits up to |9|). The attention outputs
# themselves agree to 6e-15 (the StreamingLLM test below compares them directly).
FP32_NORM_TOL = 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_sliding_layers_equal_transformers_own_sliding_cache(arch):
    res = sliding_window_parity(arch)
    assert res["tokens_equal"] and res["generate_tokens_equal"], res
    assert res["max_logit_diff"] < FP32_NORM_TOL, res
    assert res["prefill_chunking_max_diff"] < FP32_NORM_TOL, res
    slid = res["groups"]["sliding_attention"]
    assert slid["slots"] == res["sliding_window"] + res["chunk"] - 1 and res["positions"] > 2 * slid["slots"]
    if arch != "mistral":
        assert set(res["layer_types"]) == {"full_attention", "sliding_attention"}


def test_streaming_llm_positions_equal_the_reference():
    ids = torch.randint(1, 96, (1, 13), generator=torch.Generator().manual_seed(0))
    res = streaming_llm_parity(tiny_llama(), ids, sink=2, window=8, chunk=4, steps=16)
    assert res["evicted"] and res["tokens_equal"], res
    assert res["max_attention_output_diff"] < 1e-12 and res["max_logit_diff"] < FP32_NORM_TOL, res
    assert res["control_absolute_max_logit_diff"] > 1e-2  # absolute positions past the window differ


def test_buffers_never_move():
    model = tiny_model("qwen2")
    model.set_attn_implementation(sw.ATTN_IMPLEMENTATION)
    cache = sw.build_windowed_cache(model.config, chunk=4, full_window=40, dtype=torch.float64)
    ptrs = {g: c.keys(0).data_ptr() for g, c in cache.groups.items()}
    with torch.no_grad():
        model.generate(torch.randint(1, 96, (1, 9)), cache=cache, max_new_tokens=20, do_sample=False, prefill_chunk_size=4)
    assert {g: c.keys(0).data_ptr() for g, c in cache.groups.items()} == ptrs


def test_refusals():
    gemma = tiny_model("gemma2")
    gemma.config.attn_logit_softcapping = 50.0
    for layer in gemma.model.layers:
        layer.self_attn.attn_logit_softcapping = 50.0
    gemma.set_attn_implementation(sw.ATTN_IMPLEMENTATION)
    cache = sw.build_windowed_cache(gemma.config, chunk=4, full_window=40, dtype=torch.float64)
    with torch.no_grad(), pytest.raises(ValueError, match="soft-capping"):
        gemma(input_ids=torch.randint(1, 96, (1, 4)), cache=cache)
    model = tiny_model("mistral")
    model.set_attn_implementation(sw.ATTN_IMPLEMENTATION)
    cache = sw.build_windowed_cache(model.config, chunk=4, dtype=torch.float64)
    with torch.no_grad(), pytest.raises(ValueError, match="stream's next positions"):
        model(input_ids=torch.randint(1, 96, (1, 4)), position_ids=torch.arange(3, 7).view(1, -1), cache=cache)
    assert cache.get_seq_length() == 0 and not cache.groups["sliding_attention"].is_open  # nothing changed
    with torch.no_grad(), pytest.raises(ValueError, match="1 to chunk=4"):
        model(input_ids=torch.randint(1, 96, (1, 5)), cache=cache)
    with pytest.raises(ValueError, match="full_window"):
        sw.build_windowed_cache(tiny_model("qwen2").config, chunk=4)
    with pytest.raises(ValueError, match="another pattern"):
        sw.windowed_mask(1, 4, 4, mask_function=lambda b, h, q, k: q >= 0)
    with pytest.raises(ValueError, match="padding"):
        sw.windowed_mask(1, 4, 4, attention_mask=torch.tensor([[1, 1, 0, 1]]))
    llama = copy.deepcopy(tiny_llama())
    llama.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="default RoPE only"):
        sw.build_windowed_cache(llama.config, chunk=4, full_window=8, positions="streaming_llm")


def test_the_guide_example_runs(tmp_path):
    import re
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    tiny_model("mistral", dtype=torch.float32).save_pretrained(tmp_path / "tiny")
    text = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "transformers.md").read_text()
    start = text.index("## Sliding-window and mixed models")
    code = re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)
    scope = {"name": str(tmp_path / "tiny"), "ids": torch.randint(1, 96, (1, 100)),
             "AutoModelForCausalLM": AutoModelForCausalLM}
    exec(compile(code, "docs/guides/transformers.md", "exec"), scope)
    assert scope["out"].shape == (1, 132) and scope["cache"].get_seq_length() == 131
