"""The integrations and drop-ins as a careless or hostile user drives them: every refused call
raises a clear exception naming the constraint and the value, and leaves the full state as it
was (the caches' K/V, positions, plans, policy statistics, counters, observers; the integration's
own counters). Each case here was accepted, or refused only after the stream moved, before the
fix it pins (issue 18, item 4).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_same_state, snapshot
from test_transformers_cache import tiny, with_attention

from streamkv.integrations.transformers import build_cache

IDS = torch.tensor([[5, 6, 7]])


@pytest.fixture(scope="module")
def llama():
    return with_attention(tiny("llama"), "streamkv")


def started(model, kind="ring", **kw):
    """A cache of ``kind`` after one 3-token forward (its span open, as between forwards)."""
    cache = build_cache(model.config, kind, sink=2, window=8, chunk=4, **kw)
    with torch.no_grad():
        model(input_ids=IDS, cache=cache)
    return cache


def refused(cache, exc, match, call):
    before = snapshot(cache)
    with pytest.raises(exc, match=match):
        call()
    assert_same_state(before, snapshot(cache))


# ------------------------------------------------------------------ transformers
@pytest.mark.parametrize("kind", ["tova", "ring"])
def test_a_forward_outside_no_grad_is_refused_before_the_commit(llama, kind):
    """Refused only after the previous span was committed (TOVA evicted) and a new one opened."""
    cache = started(llama, kind)
    with torch.enable_grad():
        refused(cache, ValueError, "key_states require grad", lambda: llama(input_ids=IDS[:, :1], cache=cache))
    with torch.no_grad():  # the stream goes on where it was
        llama(input_ids=IDS[:, :1], cache=cache)
    assert cache.get_seq_length() == 4


@pytest.mark.parametrize("layers", [1, 3])
def test_a_cache_built_for_another_layer_count_is_refused_before_any_layer(llama, layers):
    """It advanced the stream on every refused forward (3 layers: the first forward was even
    accepted, leaving the span incomplete)."""
    config = copy.deepcopy(llama.config)
    config.num_hidden_layers = layers
    cache = build_cache(config, "ring", sink=2, window=8, chunk=4)
    with torch.no_grad():
        for _ in range(2):
            refused(cache, ValueError, f"built for {layers} decoder layers, the model has 2",
                    lambda: llama(input_ids=IDS, cache=cache))


def forward_by_hand(cache, n=1, layers=None, **attn):
    """What a Llama-pattern forward does with the cache, without the model: mask sizes, then
    each layer's update (its attention marked done)."""
    cache.get_mask_sizes(n, 0)
    for layer in range(cache.num_layers if layers is None else layers):
        cache.update(torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8), layer, kwargs=dict(attn))
        cache.attended(layer, None, None, None)


def test_a_layer_past_the_cache_leaves_the_stream_to_be_reset_not_advanced(llama):
    """A model whose masks bypass the streamkv mask function, with more layers than the cache:
    its layer 2 is refused, and so is every later forward until reset() (before: each later
    forward committed and advanced the stream, then failed again at layer 2)."""
    cache = started(llama)
    with torch.no_grad():
        forward_by_hand(cache)
        with pytest.raises(ValueError, match=r"layer_idx must be in \[0, 2\).*got layer 2"):
            cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), 2, kwargs={})
        before = snapshot(cache)
        with pytest.raises(RuntimeError, match="past this cache's 2 layers: call reset"):
            llama(input_ids=IDS[:, :1], cache=cache)
        assert_same_state(before, snapshot(cache))
        cache.reset()
        llama(input_ids=IDS, cache=cache)
    assert cache.get_seq_length() == 3


@pytest.mark.parametrize("n, exc", [(1.0, TypeError), (True, TypeError), ("1", TypeError), (0, ValueError),
                                    (5, ValueError)])
def test_prepare_step_refuses_a_bad_n_before_committing(llama, n, exc):
    """prepare_step(1.0) committed the open span, then raised."""
    cache = started(llama)
    refused(cache, exc, "n must be|a forward holds 1 to chunk=4", lambda: cache.prepare_step(n))


def test_after_prepare_step_the_forward_is_checked_against_the_open_span(llama):
    """Wrong position_ids were accepted in eager mode after prepare_step (logits off by 6.6)."""
    cache = started(llama)
    cache.prepare_step(1)
    with torch.no_grad():
        refused(cache, ValueError, r"next positions \[3, 4\).*got \[9\]",
                lambda: llama(input_ids=IDS[:, :1], position_ids=torch.tensor([[9]]), cache=cache))
        refused(cache, ValueError, r"prepare_step\(1\) opened 1 positions; this forward has 2 tokens",
                lambda: llama(input_ids=IDS[:, :2], cache=cache))
        llama(input_ids=IDS[:, :1], position_ids=torch.tensor([[3]]), cache=cache)
    assert cache.get_seq_length() == 4


def test_a_custom_4d_mask_is_refused_before_layer_0_writes(llama):
    """The attention function refused it, after layer 0 had committed, advanced and written."""
    cache = started(llama)
    with torch.no_grad():
        refused(cache, ValueError, "did not ask the StreamKVCache for its mask sizes.*custom 4D attention_mask",
                lambda: llama(input_ids=IDS[:, :1], attention_mask=torch.zeros(1, 1, 1, 4), cache=cache))


@pytest.mark.parametrize("case", ["key aliases the buffer", "value aliases the buffer", "sparse key", "n differs",
                                  "float layer index", "position_ids not a tensor"])
def test_layer_0_inputs_the_core_would_refuse_are_refused_before_the_commit(llama, case):
    """Each was refused by the core's write only after layer 0 had committed the previous span
    and opened the next (or, for a list of position ids, an AttributeError)."""
    cache = started(llama)
    z = torch.zeros(1, 2, 1, 8)
    calls = {
        "key aliases the buffer": (ValueError, "share memory", lambda: cache.update(
            cache.layers[0].keys[:, :, :1], z, 0, kwargs={})),
        "value aliases the buffer": (ValueError, "share memory", lambda: cache.update(
            z, cache.layers[1].values[:, :, 3:4], 0, kwargs={})),
        "sparse key": (ValueError, "dense", lambda: cache.update(z.to_sparse(), z, 0, kwargs={})),
        "n differs": (ValueError, "the same n tokens", lambda: cache.update(z, torch.zeros(1, 2, 2, 8), 0, kwargs={})),
        "float layer index": (TypeError, "layer_idx must be an int, got float", lambda: cache.update(
            z, z, 0.0, kwargs={})),
        "position_ids not a tensor": (TypeError, "position_ids must be a Tensor or None, got list", lambda: cache.update(
            z, z, 0, kwargs={"position_ids": [3]})),
    }
    exc, match, call = calls[case]
    with torch.no_grad():
        cache.get_mask_sizes(1, 0)  # what the masking utilities do first
        refused(cache, exc, match, call)


# ------------------------------------------------------------------ sglang drop-in, Self-Forcing dicts
def sglang_cache(heads=4, **kw):
    from streamkv.compat.sglang import CausalSelfAttentionKVCache

    return CausalSelfAttentionKVCache(torch.zeros(1, 12, heads, 8), torch.zeros(1, 12, heads, 8),
                                      torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 0, 0, **kw)


def chunk(n=4, heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, n, heads, 8, generator=g), torch.randn(1, n, heads, 8, generator=g)


def head_slice_stream(calls=4, inference=False):
    """Head-slice mode (heads [1, 3) of 4): the ring keeps buffers of its own (made by the first
    call: under torch.inference_mode() with ``inference``)."""
    cache = sglang_cache(sink_tokens=2)
    with torch.inference_mode(inference):
        for i in range(calls):
            k, v = chunk(seed=i)
            cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=4 * i, cache_head_start=1)
    return cache


@pytest.mark.parametrize("which", ["key", "value"])
def test_sglang_head_slice_refuses_a_key_aliasing_the_rings_own_buffer_before_advancing(which):
    """Refused by the ring's write, after the ring had committed and advanced (the next call then
    reported 'positions ... are not held by the ring: a bug')."""
    cache = head_slice_stream()
    own = cache._own[0 if which == "key" else 1]
    k, v = chunk(seed=9)
    kv = {"key": own[:, :4], "value": v} if which == "key" else {"key": k, "value": own[:, 2:6]}
    refused(cache, ValueError, f"{which} shares memory with the cache buffers",
            lambda: cache.update_and_get_attention_kv(**kv, current_chunk_start=16, cache_head_start=1))
    k, v = chunk(seed=9)
    cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=16, cache_head_start=1)  # goes on


def test_sglang_head_slice_buffers_made_in_inference_mode_are_refused_outside_it_before_a_relayout():
    """Own buffers allocated under inference_mode: outside it, a call that re-lays the ring out
    (sink_tokens changed) is refused before the re-layout (a guard: the core refused it too)."""
    cache = head_slice_stream(3, inference=True)
    assert not cache.k.is_inference() and cache._own[0].is_inference()
    cache.sink_tokens = 4
    k, v = chunk(seed=5)
    refused(cache, RuntimeError, "inference tensors",
            lambda: cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=12, cache_head_start=1))


@pytest.mark.parametrize("value", [torch.tensor([False]), torch.tensor([0j])])
def test_self_forcing_index_reset_takes_an_integer_tensor_only(value):
    """A bool tensor reset the block; a complex one failed inside int() without naming the constraint."""
    from streamkv.compat.self_forcing import SelfForcingKVCache

    cache = SelfForcingKVCache(1, 12, 2, 8, sink_tokens=2, dtype=torch.float32)
    for i in range(3):
        cache.update(*chunk(seed=i), 4 * i)
    refused(cache, TypeError, "must be assigned a 1-element integer tensor",
            lambda: cache.__setitem__("global_end_index", value))


# ------------------------------------------------------------------ diffusers Wan
@pytest.fixture(scope="module")
def wan():
    from test_diffusers_wan import tiny_model

    return tiny_model()


def wan_rollout(model, chunks=2):
    from test_diffusers_wan import SCHEDULE, prompts

    from streamkv.integrations.diffusers import StreamingWan, WanStreamingRollout

    stream = StreamingWan(model, frames_per_chunk=2, sink_frames=1, window_frames=5, height=4, width=4,
                          branches=("cond", "uncond"))
    rollout = WanStreamingRollout(stream, guidance=3.0, schedule=SCHEDULE, seed=3)
    rollout.set_prompt(*prompts())
    for _ in range(chunks):
        rollout.generate_chunk()
    return stream, rollout


def rollout_state(r):
    """The rollout's full state: its caches, the noise generator, the prompts, its counters."""
    return (snapshot(r.stream.caches), r._gen.get_state(), {k: v.clone() for k, v in r._prompts.items()},
            r._chunk, r.forwards, len(r.chunk_seconds))


def assert_same_rollout(before, after):
    assert_same_state(before[0], after[0])
    assert torch.equal(before[1], after[1]), "the noise generator moved"
    assert before[2].keys() == after[2].keys() and all(torch.equal(before[2][k], after[2][k]) for k in before[2])
    assert before[3:] == after[3:]


@pytest.mark.parametrize("case", ["seed str", "seed too large", "text_dim", "empty text", "int text",
                                  "negative without guidance"])
def test_set_prompt_checks_everything_before_the_reset(wan, case):
    """set_prompt(seed='11') reset the caches, then raised; a wrong text_dim (or an empty or
    integer text) was accepted and failed deep in diffusers at the next forward."""
    from test_diffusers_wan import prompts

    stream, rollout = wan_rollout(wan)
    cond, uncond = prompts()
    calls = {
        "seed str": (TypeError, "seed must be an int, got str '11'", lambda: rollout.set_prompt(cond, uncond, seed="11")),
        "seed too large": (ValueError, r"seed must be in \[-2\*\*63, 2\*\*64\)",
                           lambda: rollout.set_prompt(cond, uncond, seed=2**70)),
        "text_dim": (ValueError, r"text_dim=16\] \(the model's config.text_dim\), got \(1, 5, 17\)",
                     lambda: rollout.set_prompt(torch.randn(1, 5, 17), uncond)),
        "empty text": (ValueError, "text_len >= 1", lambda: rollout.set_prompt(cond[:, :0], uncond)),
        "int text": (TypeError, "dense floating tensor, got torch.strided torch.int64",
                     lambda: rollout.set_prompt(cond.long(), uncond)),
        "negative without guidance": (ValueError, "guidance 1.0 runs the cond branch only", None),
    }
    exc, match, call = calls[case]
    try:
        if case == "negative without guidance":
            from streamkv.integrations.diffusers import WanStreamingRollout

            rollout = WanStreamingRollout(stream, guidance=1.0, seed=3)
            call = lambda: rollout.set_prompt(cond, uncond)  # noqa: E731
        before = rollout_state(rollout)
        with pytest.raises(exc, match=match):
            call()
        assert_same_rollout(before, rollout_state(rollout))
    finally:
        stream.detach()


@pytest.mark.parametrize("case", ["float64 latents", "float16 latents", "text_dim", "float64 text", "timestep str",
                                  "timestep bool", "timestep nan", "timestep negative", "timestep tensor nan"])
def test_streaming_wan_forward_refuses_what_diffusers_would_fail_on_before_any_layer(wan, case):
    """float64 latents or a wrong text_dim failed deep in diffusers (RuntimeError: 'Input type
    (double) and bias type (float)', 'mat1 and mat2 shapes'); a timestep '5', True, NaN or -5
    was accepted and written into the cache."""
    from test_diffusers_wan import prompts

    stream, rollout = wan_rollout(wan, chunks=1)
    e, _ = prompts()
    x = torch.randn(1, 4, 2, 4, 4)
    calls = {
        "float64 latents": (TypeError, "latents must be a dense torch.float32 tensor", lambda: stream.forward(
            "cond", x.double(), 500.0, e)),
        "float16 latents": (TypeError, "got torch.strided torch.float16", lambda: stream.forward(
            "cond", x.half(), 500.0, e)),
        "text_dim": (ValueError, r"text_dim=16\].*got \(1, 5, 17\)", lambda: stream.forward(
            "cond", x, 500.0, torch.randn(1, 5, 17))),
        "float64 text": (TypeError, "prompt_embeds must be torch.float32", lambda: stream.forward(
            "cond", x, 500.0, e.double())),
        "timestep str": (TypeError, "timestep must be a number or a \\[B\\] tensor, got str", lambda: stream.forward(
            "cond", x, "5", e)),
        "timestep bool": (TypeError, "got bool True", lambda: stream.forward("cond", x, True, e)),
        "timestep nan": (ValueError, r"timestep must be in \[0, 1000\]", lambda: stream.forward(
            "cond", x, float("nan"), e)),
        "timestep negative": (ValueError, r"in \[0, 1000\].*got -5.0", lambda: stream.forward("cond", x, -5.0, e)),
        "timestep tensor nan": (ValueError, r"timestep values must be in \[0, 1000\]", lambda: stream.forward(
            "cond", x, torch.tensor([float("nan")]), e)),
    }
    exc, match, call = calls[case]
    try:
        stream.begin_chunk(1)
        with torch.no_grad():
            stream.forward("cond", x, 500.0, e)  # the open chunk holds this forward's K/V
        refused(stream.caches, exc, match, call)
    finally:
        stream.detach()


def test_generate_chunk_on_a_detached_stream_is_refused_before_begin_chunk(wan):
    """begin_chunk moved every branch's cache, then the first forward refused the detached stream."""
    stream, rollout = wan_rollout(wan, chunks=1)
    stream.detach()
    before = rollout_state(rollout)
    with pytest.raises(RuntimeError, match="detached"):
        rollout.generate_chunk()
    assert_same_rollout(before, rollout_state(rollout))


def test_rollout_noise_and_schedule_are_type_checked(wan):
    """Integer noise was cast and used; a schedule that is not a Schedule was accepted (and failed
    at the first chunk)."""
    from streamkv.integrations.diffusers import WanStreamingRollout

    stream, rollout = wan_rollout(wan, chunks=1)
    try:
        before = rollout_state(rollout)
        with pytest.raises(TypeError, match="noise must be a dense floating tensor"):
            rollout.generate_chunk(torch.ones(1, 4, 2, 4, 4, dtype=torch.long))
        assert_same_rollout(before, rollout_state(rollout))
        with pytest.raises(TypeError, match="schedule must be a streamkv.rollout.Schedule or None, got int"):
            WanStreamingRollout(stream, guidance=3.0, schedule=5)
    finally:
        stream.detach()


def test_a_streamkv_cache_for_a_config_of_another_layer_count_is_refused_at_construction(llama):
    """Accepted; every forward then refused (or, without the mask check, advanced) the stream."""
    from streamkv.integrations.transformers import StreamKVCache

    kv = build_cache(llama.config, "ring", sink=2, window=8, chunk=4).kv
    config = copy.deepcopy(llama.config)
    config.num_hidden_layers = 3
    with pytest.raises(ValueError, match="kv holds 2 layers, the config 3"):
        StreamKVCache(kv, config=config)
