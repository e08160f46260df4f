"""streamkv caches inside transformers 5.x, on the real model classes (tiny random Llama and
Qwen2 configs with grouped-query attention):

(a) with a window that holds everything, ``generate()`` with every kind gives DynamicCache's
    tokens and logits (float32 rounding), in one prefill and in prefill chunks;
(b) beyond the window, the ring (and the chronological path) equal a float64 reference of
    sink + window attention written here (full K/V history, a mask over positions), over
    several wraps, one token at a time and in prefill chunks, in forward loops and in
    ``generate()``; a control shows the reference differs from full attention there;
(c) a compiled ring decode step does not recompile across wraps and matches eager;
and the refusals of :mod:`streamkv.integrations.transformers`.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import assert_same_state, snapshot
from torch._dynamo.testing import CompileCounter
from transformers import (
    AttentionInterface,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from kinds import QUERY_SCORED, WINDOW, params
from streamkv.integrations.transformers import KINDS, StreamKVCache, build_cache

ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
# scored kinds with parameters that evict nothing while the window holds everything
PARAMS = {"mass": {"tau": 1e-9}}
GEN = {"do_sample": False, "output_logits": True, "return_dict_in_generate": True}
FP32_TOL = 5e-5  # an absolute cap: logits reach |8| here and float32 rounding through the model is ~1e-5
FP64_TOL = 1e-10  # float64 rounding: measured attention-output diffs are ~5e-15


def tiny(arch: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A 2-layer model: 6 query heads over 2 key/value heads (GQA), head_dim 8; weights drawn
    with initializer_range 0.3 so that attention is far from uniform."""
    config_cls, model_cls = ARCHS[arch]
    torch.manual_seed(0)
    config = config_cls(
        vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, pad_token_id=0,
        bos_token_id=None, eos_token_id=None,  # no early stop: generate() runs every step
    )
    return model_cls(config).to(dtype).eval()


def with_attention(model: torch.nn.Module, name: str) -> torch.nn.Module:
    out = copy.deepcopy(model)
    out.set_attn_implementation(name)
    return out


def reference_attention(sink: int, window: int) -> str:
    """Register (once) and name a float64 sink + window attention over a DynamicCache's full
    history: the keys are in position order ``0 .. E-1`` (E entered so far, this forward's T
    queries at ``E-T .. E-1``); a query at ``p`` sees key ``j`` iff ``j <= p`` and ``j`` is held
    after this forward's write: ``j < sink`` or ``j >= E - window``."""
    name = f"skv-test-reference-{sink}-{window}"

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        assert attention_mask is None and dropout == 0.0
        T, E = query.shape[2], key.shape[2]
        q_pos = torch.arange(E - T, E).view(-1, 1)
        k_pos = torch.arange(E).view(1, -1)
        visible = ((k_pos < sink) | (k_pos >= E - window)) & (k_pos <= q_pos)
        groups = query.shape[1] // key.shape[1]
        k = key.double().repeat_interleave(groups, dim=1)
        v = value.double().repeat_interleave(groups, dim=1)
        scores = (query.double() @ k.transpose(-1, -2)) * scaling
        out = scores.masked_fill(~visible, -math.inf).softmax(-1) @ v
        return out.transpose(1, 2).to(query.dtype), None

    AttentionInterface.register(name, attention)
    return name


def max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


# ------------------------------------------------------------------ (a) nothing evicted
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_generate_equals_dynamic_cache_when_the_window_holds_everything(arch):
    base = tiny(arch)
    ours = with_attention(base, "streamkv")
    prompt = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    ref = base.generate(prompt, cache=DynamicCache(config=base.config), max_new_tokens=12, **GEN)
    assert ref.sequences.shape == (2, 22)
    # the rounding scale: transformers' own eager attention against its sdpa, same cache
    eager = with_attention(base, "eager").generate(prompt, cache=DynamicCache(config=base.config), max_new_tokens=12,
                                                   **GEN)
    rounding = max_diff(eager.logits, ref.logits)
    assert 0 < rounding <= FP32_TOL
    for kind in KINDS:
        for prefill_chunk in (None, 4):  # one prefill forward of 10 tokens, or chunks of 4, 4, 2
            cache = build_cache(ours.config, kind, sink=2, window=30, chunk=10, batch_size=2,
                                **params(kind, **PARAMS.get(kind, {})))
            out = ours.generate(prompt, cache=cache, max_new_tokens=12, prefill_chunk_size=prefill_chunk, **GEN)
            assert torch.equal(out.sequences, ref.sequences), (kind, prefill_chunk)
            assert max_diff(out.logits, ref.logits) <= min(4 * rounding, FP32_TOL), (kind, prefill_chunk)
            # nothing was evicted: 21 positions entered, 32 slots
            assert cache.get_seq_length() == 21 and cache.kv.num_valid == 21
            if cache.kv.needs_queries:
                assert cache.kv.report()["evicted_total"] == 0


def test_on_attention_reports_each_layers_queries_read_and_output():
    base = tiny("llama")
    ours = with_attention(base, "streamkv")
    seen: dict[int, tuple] = {}
    cache = build_cache(ours.config, "ring", sink=2, window=16, chunk=8,
                        on_attention=lambda layer, q, read, out: seen.__setitem__(layer, (q, read, out.clone())))
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(2))
    want: dict[int, torch.Tensor] = {}
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(lambda mod, args, i=i: want.__setitem__(i, args[0]))
             for i, layer in enumerate(base.model.layers)]
    with torch.no_grad():
        base(input_ids=ids, cache=DynamicCache(config=base.config))
        ours(input_ids=ids, cache=cache)
    for h in hooks:
        h.remove()
    assert sorted(seen) == [0, 1]
    for i in (0, 1):
        q, read, out = seen[i]
        assert q.shape == (1, 6, 7, 8) and out.shape == (1, 7, 6, 8)
        assert read.query_positions.tolist() == list(range(7))
        assert read.positions[0].tolist() == list(range(7)) + [-1] * 11  # 7 of 18 slots filled
        assert float((out.reshape(1, 7, -1) - want[i]).abs().max()) <= FP32_TOL


# ----------------------------------------------------------- (b) beyond the window
SCHEDULES = {
    "decode": [5] + [1] * 70,  # a short prefill, then one token per forward
    "prefill_chunks": [6, 1, 4, 6, 3, 1, 6, 5, 2, 6, 6, 1, 1, 6, 4, 6, 3, 5],  # spans of 1..chunk
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("kind", WINDOW)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_forward_loop_beyond_the_window_equals_float64_reference(arch, kind, schedule):
    """Logits and every layer's attention output (before o_proj), at every forward."""
    sink, window, chunk = 3, 13, 6
    base = tiny(arch, torch.float64)
    ours = with_attention(base, "streamkv")
    ref = with_attention(base, reference_attention(sink, window))
    spans = SCHEDULES[schedule]
    ids = torch.randint(3, 96, (1, sum(spans)), generator=torch.Generator().manual_seed(3))
    got_attn: dict[int, torch.Tensor] = {}
    want_attn: dict[int, torch.Tensor] = {}
    cache = build_cache(ours.config, kind, sink=sink, window=window, chunk=chunk, dtype=torch.float64,
                        on_attention=lambda layer, q, read, out: got_attn.__setitem__(layer, out.flatten(-2)))
    for i, layer in enumerate(ref.model.layers):
        layer.self_attn.o_proj.register_forward_pre_hook(lambda mod, args, i=i: want_attn.__setitem__(i, args[0]))
    ref_cache = DynamicCache(config=base.config)
    worst_logits = worst_attn = 0.0
    start = 0
    with torch.no_grad():
        for n in spans:
            got = ours(input_ids=ids[:, start:start + n], cache=cache).logits
            want = ref(input_ids=ids[:, start:start + n], cache=ref_cache).logits
            worst_logits = max(worst_logits, float((got - want).abs().max()))
            worst_attn = max(worst_attn, *(float((got_attn[i] - want_attn[i]).abs().max()) for i in (0, 1)))
            start += n
    assert worst_logits <= FP64_TOL and worst_attn <= FP64_TOL
    assert cache.get_seq_length() == start == sum(spans)
    assert cache.kv.layout.ring_wraps(start) >= 5  # 72 or 75 positions: (72 - 3 - 1) // 13 = 5


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_generate_beyond_the_window_equals_float64_reference(arch):
    sink, window, chunk = 2, 11, 5
    base = tiny(arch, torch.float64)
    ours = with_attention(base, "streamkv")
    ref = with_attention(base, reference_attention(sink, window))
    prompt = torch.randint(3, 96, (1, 23), generator=torch.Generator().manual_seed(4))  # 23 > sink + window
    kw = {"max_new_tokens": 40, "prefill_chunk_size": chunk, **GEN}
    cache = build_cache(ours.config, "ring", sink=sink, window=window, chunk=chunk, dtype=torch.float64)
    got = ours.generate(prompt, cache=cache, **kw)
    want = ref.generate(prompt, cache=DynamicCache(config=base.config), **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert max_diff(got.logits, want.logits) <= FP64_TOL
    assert cache.kv.wraps >= 4  # 62 positions entered
    # control: full attention is measurably different here, so the comparison can fail
    full = base.generate(prompt, cache=DynamicCache(config=base.config), **kw)
    assert max_diff(full.logits[:1], want.logits[:1]) > 1e-3


@pytest.mark.parametrize("kind", QUERY_SCORED)
def test_scored_kinds_evict_per_head_inside_generate(kind):
    """Beyond the window the scored kinds take their statistics from the streamkv attention
    (a commit without them raises) and evict per (layer, key head); sinks stay pinned."""
    base = tiny("qwen2")
    ours = with_attention(base, "streamkv")
    cache = build_cache(ours.config, kind, sink=2, window=16, chunk=4, **params(kind, **{"mass": {"tau": 0.05}}.get(kind, {})))
    prompt = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(6))
    out = ours.generate(prompt, cache=cache, max_new_tokens=30, prefill_chunk_size=4, **GEN)
    assert out.sequences.shape == (1, 42) and all(bool(torch.isfinite(x).all()) for x in out.logits)
    report = cache.kv.report()
    assert report["evicted_total"] > 0 and report["overflow_total"] == 0
    pos = cache.kv.slot_positions  # [layers, key heads, slots]
    assert bool((pos[..., :2] == torch.tensor([0, 1])).all())  # sinks pinned in every (layer, head)
    held = [frozenset(pos[layer, head].tolist()) for layer in range(2) for head in range(2)]
    assert len(set(held)) > 1  # heads keep different positions
    assert int(pos.max()) == 40  # the newest position (the open span) is held


# -------------------------------------------------------------------- (c) compile
def test_compiled_ring_decode_step_does_not_recompile_across_wraps():
    torch._dynamo.reset()
    base = tiny("llama")
    ours = with_attention(base, "streamkv")
    sizes = {"sink": 2, "window": 7, "chunk": 4}
    cache, eager_cache = (build_cache(ours.config, "ring", **sizes) for _ in range(2))
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(5))
    counter = CompileCounter()

    def decode(tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return ours(input_ids=tok, position_ids=pos, cache=cache).logits

    step = torch.compile(decode, backend=counter, fullgraph=True)
    worst, frames = 0.0, []
    with torch.no_grad():
        ours(input_ids=ids[:, :4], cache=cache)
        ours(input_ids=ids[:, :4], cache=eager_cache)
        for p in range(4, 40):
            tok, pos = ids[:, p:p + 1], torch.tensor([[p]])
            cache.prepare_step(1)
            got = step(tok, pos)
            want = ours(input_ids=tok, cache=eager_cache).logits
            worst = max(worst, float((got - want).abs().max()))
            frames.append(counter.frame_count)
    assert frames == [1] * 36  # one graph, compiled at the first step, reused across every wrap
    assert cache.kv.wraps >= 4 and cache.get_seq_length() == 40  # (40 - 2 - 1) // 7 = 5 wraps
    assert worst <= FP32_TOL
    assert not cache.is_compileable  # generate() must not compile its own forward around the lifecycle


# ---------------------------------------------------------------------- refusals
def test_another_attention_implementation_is_refused():
    base = tiny("llama")  # sdpa
    cache = build_cache(base.config, "ring", sink=2, window=8, chunk=4)
    with torch.no_grad(), pytest.raises(RuntimeError, match="needs attn_implementation='streamkv'"):
        base(input_ids=torch.tensor([[5, 6]]), cache=cache)
    assert cache.get_seq_length() == 0  # refused before any layer ran
    # without the config, the next layer's update sees that layer 0 was attended elsewhere
    bare = StreamKVCache(build_cache(base.config, "ring", sink=2, window=8, chunk=4).kv)
    with torch.no_grad(), pytest.raises(RuntimeError, match="did not run through the streamkv attention function"):
        base(input_ids=torch.tensor([[5, 6]]), cache=bare)


def test_padding_and_wrong_positions_are_refused_before_any_write():
    base = tiny("llama")
    ours = with_attention(base, "streamkv")
    cache = build_cache(ours.config, "ring", sink=2, window=8, chunk=4, batch_size=2)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    left_padded = torch.tensor([[0, 1, 1], [1, 1, 1]])
    before = snapshot(cache.kv)
    with pytest.raises(ValueError, match="padding"):
        ours.generate(ids, attention_mask=left_padded, cache=cache, max_new_tokens=2)
    assert_same_state(before, snapshot(cache.kv))
    before = snapshot(cache)
    with torch.no_grad():
        with pytest.raises(ValueError, match="padding"):
            ours(input_ids=ids, attention_mask=left_padded, cache=cache)
        with pytest.raises(ValueError, match=r"attention_mask must be None or 2D \[batch=2, 3\]"):
            ours(input_ids=ids, attention_mask=torch.ones(2, 5, dtype=torch.long), cache=cache)
        assert_same_state(before, snapshot(cache))
        ours(input_ids=ids, attention_mask=torch.ones(2, 3, dtype=torch.long), cache=cache)  # no padding: accepted
        before = snapshot(cache)
        with pytest.raises(ValueError, match=r"next positions \[3, 4\)"):
            ours(input_ids=ids[:, :1], position_ids=torch.tensor([[7]]), cache=cache)
        assert_same_state(before, snapshot(cache))
        ours(input_ids=ids[:, :1], cache=cache)
        assert cache.get_seq_length() == 4


def test_a_forward_interrupted_inside_the_model_is_reported_until_reset():
    base = tiny("llama")
    ours = with_attention(base, "streamkv")

    def fail(layer: int, *args: object) -> None:
        if layer == 0:
            raise KeyboardInterrupt

    cache = build_cache(ours.config, "ring", sink=2, window=8, chunk=4, on_attention=fail)
    with torch.no_grad():
        with pytest.raises(KeyboardInterrupt):
            ours(input_ids=torch.tensor([[5, 6]]), cache=cache)
        with pytest.raises(RuntimeError, match="previous forward stopped after writing 1 and attending 1 of 2 layers"):
            ours(input_ids=torch.tensor([[7]]), cache=cache)
        cache.reset()
        cache.on_attention = None
        ours(input_ids=torch.tensor([[5, 6]]), cache=cache)
        assert cache.get_seq_length() == 2


def test_a_forward_longer_than_chunk_is_refused_and_changes_nothing():
    base = tiny("qwen2")
    ours = with_attention(base, "streamkv")
    cache = build_cache(ours.config, "ring", sink=2, window=8, chunk=4)
    with torch.no_grad():
        ours(input_ids=torch.tensor([[3, 4, 5]]), cache=cache)
        before = snapshot(cache)
        with pytest.raises(ValueError, match="chunk=4"):
            ours(input_ids=torch.arange(3, 8).view(1, 5), cache=cache)
    assert_same_state(before, snapshot(cache))


def test_beam_search_crop_and_batch_changes_are_refused():
    base = tiny("llama")
    ours = with_attention(base, "streamkv")
    cache = build_cache(ours.config, "ring", sink=2, window=8, chunk=4, batch_size=2)
    with pytest.raises(RuntimeError, match="beam search"):
        ours.generate(torch.tensor([[5, 6, 7]]), cache=cache, num_beams=2, max_new_tokens=3, do_sample=False)
    for call in (lambda: cache.crop(-1), lambda: cache.batch_repeat_interleave(2),
                 lambda: cache.batch_select_indices(torch.tensor([0]))):
        with pytest.raises(RuntimeError, match="does not support"):
            call()


def test_use_cache_false_and_assisted_decoding_are_refused_by_name_before_any_forward():
    """generate(use_cache=False) fed the whole sequence again at its second step, and assisted
    decoding crops rejected drafts: each was refused only after the prefill had advanced the cache
    (with a message about the forward's length). Now by name, the cache unchanged."""
    base = tiny("llama")
    ours = with_attention(base, "streamkv")
    prompt = torch.tensor([[5, 6, 7]])
    assistant = with_attention(tiny("llama"), "sdpa")
    for kw, message in ((dict(use_cache=False), r"generate\(use_cache=False\)"),
                        (dict(prompt_lookup_num_tokens=2), r"speculative decoding \(generate\(\) with prompt_lookup_num_tokens=2\)"),
                        (dict(assistant_model=assistant), r"speculative decoding \(generate\(\) with an assistant model\)")):
        cache = build_cache(ours.config, "ring", sink=2, window=8, chunk=4)
        before = snapshot(cache)
        with pytest.raises(RuntimeError, match=message):
            ours.generate(prompt, cache=cache, max_new_tokens=3, do_sample=False, **kw)
        assert_same_state(before, snapshot(cache))
        assert cache.get_seq_length() == 0


def test_beam_search_and_a_batch_generate_does_not_run_are_refused_by_name_before_any_forward():
    """generate(num_beams=2) expands the batch before the first forward: refused as beam search
    (not as a batch mismatch) whatever batch the cache was built for, and num_return_sequences
    names the batch size to build; nothing changes."""
    base = tiny("llama")
    ours = with_attention(base, "streamkv")
    prompt = torch.tensor([[5, 6, 7]])
    for batch in (1, 2):
        cache = build_cache(ours.config, "ring", sink=2, window=8, chunk=4, batch_size=batch)
        before = snapshot(cache)
        with pytest.raises(RuntimeError, match=r"does not support beam search \(generate\(num_beams=2\)\)"):
            ours.generate(prompt, cache=cache, num_beams=2, max_new_tokens=3, do_sample=False)
        assert_same_state(before, snapshot(cache))
    cache = build_cache(ours.config, "ring", sink=2, window=8, chunk=4)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"generate\(\) runs 3 rows .*num_return_sequences=3.*build it with batch_size=3"):
        ours.generate(prompt, cache=cache, num_return_sequences=3, do_sample=True, max_new_tokens=3)
    assert_same_state(before, snapshot(cache))
    wide = build_cache(ours.config, "ring", sink=2, window=8, chunk=4, batch_size=3)
    out = ours.generate(prompt, cache=wide, num_return_sequences=3, do_sample=True, max_new_tokens=3)
    assert out.shape == (3, 6)


def test_a_second_generate_on_a_cache_that_holds_a_stream_says_reset_and_a_continuation_runs():
    """transformers treats a cache given to generate() as holding the start of its input
    (DynamicCache: it slices that many input tokens off). A second generate() on the same prompt
    is refused before any forward, with or without prefill chunks, naming cache.reset(); after a
    reset it gives the first call's tokens; a continuation (the previous output as input) runs
    and equals one longer generate()."""
    base = tiny("llama")
    ours = with_attention(base, "streamkv")
    prompt = torch.randint(3, 96, (1, 10), generator=torch.Generator().manual_seed(7))
    kw = {"max_new_tokens": 5, "do_sample": False}
    cache = build_cache(ours.config, "ring", sink=2, window=30, chunk=4)
    first = ours.generate(prompt, cache=cache, prefill_chunk_size=4, **kw)
    before = snapshot(cache)
    for chunked in (4, None):
        with pytest.raises(RuntimeError, match=r"input is 10 tokens and the StreamKVCache already holds a stream of 14 "
                                               r"positions.*call cache.reset\(\) first"):
            ours.generate(prompt, cache=cache, prefill_chunk_size=chunked, **kw)
        assert_same_state(before, snapshot(cache))
    more = ours.generate(first, cache=cache, prefill_chunk_size=4, **kw)  # a continuation
    once = ours.generate(prompt, cache=build_cache(ours.config, "ring", sink=2, window=30, chunk=4),
                         prefill_chunk_size=4, max_new_tokens=10, do_sample=False)
    assert torch.equal(more, once)
    cache.reset()
    assert torch.equal(ours.generate(prompt, cache=cache, prefill_chunk_size=4, **kw), first)
    with torch.no_grad(), pytest.raises(ValueError, match=r"a forward at position 0 on a cache that holds a stream "
                                                          r"starts another one: call cache.reset\(\) first"):
        ours(input_ids=prompt[:, :4], position_ids=torch.arange(4).view(1, -1), cache=cache)


def test_build_cache_without_a_model_config_is_a_type_error():
    for config in (None, {"num_attention_heads": 2}):
        with pytest.raises(TypeError, match="build_cache needs the model's config"):
            build_cache(config, "ring", sink=2, window=8, chunk=4)


def test_configs_and_sizes_the_cache_cannot_serve_are_refused():
    config_cls, _ = ARCHS["qwen2"]
    sliding = config_cls(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                         max_window_layers=0)
    with pytest.raises(ValueError, match="full attention"):
        build_cache(sliding, "ring", sink=2, window=8, chunk=4)
    config = tiny("llama").config
    with pytest.raises(ValueError, match="kind must be one of"):
        build_cache(config, "lru", sink=2, window=8, chunk=4)
    with pytest.raises(TypeError, match="exactly one of window= and memory_tokens="):
        build_cache(config, "ring", sink=2, window=8, memory_tokens=10, chunk=4)
    with pytest.raises(ValueError, match="window"):
        build_cache(config, "h2o", sink=2, window=6, chunk=4)  # scored kinds need window >= 2 * chunk
    cache = build_cache(config, "tova", memory_tokens=24, sink=4, chunk=4)
    assert cache.kv.layout.capacity == 24 and cache.kv.k_shape == (1, 2, 24, 8)
    assert cache.kv.budget == 20 and not cache.is_compileable  # sink + window - chunk


def test_attention_weights_are_refused_before_any_write():
    base = tiny("llama")
    ours = with_attention(base, "streamkv")
    cache = build_cache(ours.config, "ring", sink=2, window=8, chunk=4)
    before = snapshot(cache)
    with torch.no_grad(), pytest.raises(ValueError, match="output_attentions=True"):
        ours(input_ids=torch.tensor([[5, 6]]), cache=cache, output_attentions=True)
    assert_same_state(before, snapshot(cache))


def test_a_cache_of_another_dtype_is_refused():
    base = tiny("llama")
    ours = with_attention(base, "streamkv")
    cache = build_cache(ours.config, "ring", sink=2, window=8, chunk=4, dtype=torch.float64)
    before = snapshot(cache)
    with torch.no_grad(), pytest.raises(TypeError, match="float32, the cache holds torch.float64"):
        ours(input_ids=torch.tensor([[5, 6]]), cache=cache)
    assert_same_state(before, snapshot(cache))
