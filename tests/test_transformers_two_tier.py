"""The two-tier cache (a device budget + key sketches of the evicted tokens + certified recall
from the host) inside transformers 5.x, on tiny random Llama models with grouped-query attention:

(a) with a window that holds everything, every kind as the budget gives DynamicCache's tokens
    and logits (float32 rounding), and nothing is recalled;
(b) beyond the window, one token per forward and in prefill chunks: every layer's attention
    equals the certifier's float64 attention over what the cache holds after recall (so the
    recalled tokens are attended), every certificate holds against the float64 whole history
    (no violation, every query's certified mass <= tau, no shortfall), the kept and recalled
    slots hold the history's K/V, and the logits are far closer to DynamicCache's than the
    plain cache's at the same budget;
(c) ``generate()``, ``reset()``, and the refusals (sizes, options, a certifier of another
    attention, compiled steps).
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_state, snapshot
from test_transformers_cache import GEN, tiny, with_attention
from transformers import DynamicCache

from streamkv import RingCache
from streamkv.certify import Certifier, HistoryCheck
from streamkv.integrations.transformers import KINDS, StreamKVCache, build_cache

PARAMS = {"mass": {"tau": 1e-9}}  # evicts nothing while the window holds everything
TAU = 0.01
OUT_TOL = 1e-4  # float32 attention against the certifier's float64 attention over the same slots


def max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def two_tier(config, kind, *, tau=TAU, recall_slots=64, on_attention=None, **sizes):
    params = {"mass": {"tau": 0.05}}.get(kind, {})
    return build_cache(config, kind, recall_slots=recall_slots, on_attention=on_attention,
                       certify={"recall_tau": tau, "sketch_bits": 8, "block_tokens": 4}, **sizes, **params)


def forward_loop(model, cache, ids, spans) -> list[torch.Tensor]:
    out, start = [], 0
    with torch.no_grad():
        for n in spans:
            out.append(model(input_ids=ids[:, start:start + n], cache=cache).logits)
            start += n
    return out


# ------------------------------------------------------------------ (a) nothing evicted
@pytest.mark.parametrize("kind", KINDS)
def test_two_tier_equals_dynamic_cache_when_the_window_holds_everything(kind):
    base = tiny("llama")
    ours = with_attention(base, "streamkv")
    prompt = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    ref = base.generate(prompt, cache=DynamicCache(config=base.config), max_new_tokens=12, **GEN)
    eager = with_attention(base, "eager").generate(prompt, cache=DynamicCache(config=base.config), max_new_tokens=12,
                                                   **GEN)
    rounding = max_diff(eager.logits, ref.logits)  # transformers' own eager against its sdpa
    cache = build_cache(ours.config, kind, sink=2, window=30, chunk=4, batch_size=2, recall_slots=8,
                        certify={"recall_tau": 0.05, "sketch_bits": 8}, **PARAMS.get(kind, {}))
    assert cache.token_major and cache.kv.k_shape == (2, 32, 2, 8) and cache.kv.storage.recall_slots == 8
    out = ours.generate(prompt, cache=cache, max_new_tokens=12, prefill_chunk_size=4, **GEN)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_diff(out.logits, ref.logits) <= min(4 * rounding, 5e-5)
    cert = cache.certifier
    assert cert.stats["steps"] == 2 * (3 + 11)  # 2 layers x (3 prefill chunks + 11 decode forwards)
    assert cert.stats["recalled_tokens"] == 0
    assert all(float(c.mass.max()) == 0.0 for c in cert.last)  # nothing evicted: nothing to bound


# ----------------------------------------------------------- (b) beyond the window
SCHEDULES = {
    "decode": [5] + [1] * 55,  # a short prefill, then one token per forward
    "prefill_chunks": [6, 1, 4, 6, 3, 1, 6, 5, 2, 6, 6, 1, 1, 6, 4, 2],  # spans of 1..chunk
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("kind", ["ring", "tova"])
def test_certified_recall_beyond_the_window(kind, schedule):
    sink, window, chunk = 2, 14, 6
    base = tiny("llama")
    ours = with_attention(base, "streamkv")
    spans = SCHEDULES[schedule]
    ids = torch.randint(3, 96, (1, sum(spans)), generator=torch.Generator().manual_seed(3))
    worst_out = [0.0]

    def against_certificate(layer, query, read, out):
        # what the layer attended == the certifier's float64 attention over the slots held after recall
        kept = cache.certifier.last[layer].out_kept  # [B, H, G * n, Dv]
        B, n, Hq, Dv = out.shape
        H = kept.shape[1]
        got = out.double().view(B, n, H, Hq // H, Dv).permute(0, 2, 3, 1, 4).reshape(B, H, -1, Dv)
        worst_out[0] = max(worst_out[0], float((got - kept).abs().max()))

    cache = two_tier(ours.config, kind, sink=sink, window=window, chunk=chunk, on_attention=against_certificate)
    check = HistoryCheck(cache.certifier, tau=TAU, check_storage=True)
    got = forward_loop(ours, cache, ids, spans)
    plain = forward_loop(ours, build_cache(ours.config, kind, sink=sink, window=window, chunk=chunk), ids, spans)
    want = forward_loop(base, DynamicCache(config=base.config), ids, spans)
    r, stats = check.result(), cache.certifier.stats
    assert worst_out[0] <= OUT_TOL
    assert r["violations"] == 0 and r["count_mismatch"] == 0 and r["over_tau"] == 0
    assert r["queries_checked"] == 2 * 6 * sum(spans)  # every (layer, query head, position)
    assert stats["shortfalls"] == 0 and stats["recalled_tokens"] > 0
    assert cache.get_seq_length() == sum(spans) and sum(spans) > 3 * (sink + window)
    tt_err, plain_err = max_diff(got, want), max_diff(plain, want)
    assert plain_err > 1.0  # the budget alone loses much: a recall that did nothing would fail below
    assert tt_err < 0.05 * plain_err


def test_generate_with_recall():
    base = tiny("llama")
    ours = with_attention(base, "streamkv")
    prompt = torch.randint(3, 96, (1, 23), generator=torch.Generator().manual_seed(4))
    kw = {"max_new_tokens": 30, "prefill_chunk_size": 5, **GEN}
    cache = two_tier(ours.config, "ring", sink=2, window=11, chunk=5)
    check = HistoryCheck(cache.certifier, tau=TAU)
    got = ours.generate(prompt, cache=cache, **kw)
    want = base.generate(prompt, cache=DynamicCache(config=base.config), **kw)
    plain = ours.generate(prompt, cache=build_cache(ours.config, "ring", sink=2, window=11, chunk=5), **kw)
    r = check.result()
    assert r["violations"] == 0 and r["over_tau"] == 0 and cache.certifier.stats["shortfalls"] == 0
    assert cache.certifier.stats["recalled_tokens"] > 0 and cache.get_seq_length() == 52
    # the first forward that saw an eviction is compared on equal inputs
    first = next(i for i, (p, w) in enumerate(zip(plain.logits, want.logits)) if float((p - w).abs().max()) > 1e-3)
    assert float((got.logits[first] - want.logits[first]).abs().max()) < \
        0.05 * float((plain.logits[first] - want.logits[first]).abs().max())


def test_reset_replays_the_same_stream():
    base = tiny("llama")
    ours = with_attention(base, "streamkv")
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(6))
    cache = two_tier(ours.config, "tova", sink=2, window=12, chunk=4)
    first = forward_loop(ours, cache, ids, [4] * 10)
    stats = dict(cache.certifier.stats)
    cache.reset()
    assert cache.certifier.stats["recalled_tokens"] == 0 and cache.get_seq_length() == 0
    again = forward_loop(ours, cache, ids, [4] * 10)
    assert stats["recalled_tokens"] > 0 and cache.certifier.stats == stats
    assert all(torch.equal(a, b) for a, b in zip(first, again))


# ---------------------------------------------------------------------- refusals
def test_sizes_and_options_are_refused():
    config = tiny("llama").config
    sizes = {"sink": 2, "window": 8, "chunk": 4}
    with pytest.raises(ValueError, match="recall_slots=4 needs certify="):
        build_cache(config, "ring", recall_slots=4, **sizes)
    with pytest.raises(ValueError, match="recall_slots must be >= 0, got -1"):
        build_cache(config, "ring", recall_slots=-1, certify={}, **sizes)
    with pytest.raises(TypeError, match="recall_slots must be an int"):
        build_cache(config, "ring", recall_slots=2.0, certify={}, **sizes)
    with pytest.raises(TypeError, match=r"got \['causal'\]"):
        build_cache(config, "ring", recall_slots=4, certify={"recall_tau": 0.05, "causal": False}, **sizes)
    with pytest.raises(TypeError, match="certify must be a dict"):
        build_cache(config, "ring", recall_slots=4, certify=0.05, **sizes)
    with pytest.raises(ValueError, match="recall_tau needs a cache with recall_slots > 0"):
        build_cache(config, "ring", certify={"recall_tau": 0.05}, **sizes)
    with pytest.raises(ValueError, match="recall_tau must be in the open interval"):
        build_cache(config, "ring", recall_slots=4, certify={"recall_tau": 1.5}, **sizes)
    # certificates without recall: no recall slots needed
    assert build_cache(config, "ring", certify={"sketch_bits": 8}, **sizes).certifier.recall_tau is None
    # transformers' layout has no recall slots; a certifier must be causal and watch the cache
    heads_major = RingCache((1, 2, 10, 8), (1, 2, 10, 8), seq_dim=2, sink=2, window=8, chunk=4, num_layers=2,
                            recall_slots=4)
    with pytest.raises(ValueError, match="recall slots need the token-major layout"):
        StreamKVCache(heads_major)
    kv = RingCache((1, 10, 2, 8), (1, 10, 2, 8), seq_dim=1, sink=2, window=8, chunk=4, num_layers=2, recall_slots=4)
    with pytest.raises(ValueError, match="causal=True"):
        StreamKVCache(kv, certifier=Certifier(kv, recall_tau=0.05))
    other = two_tier(config, "ring", **sizes).certifier
    with pytest.raises(ValueError, match="this one watches another cache"):
        StreamKVCache(kv, certifier=other)
    with pytest.raises(TypeError, match="certifier must be a streamkv Certifier or None, got dict"):
        StreamKVCache(kv, certifier={"recall_tau": 0.05})


def test_the_integrations_refusals_hold_for_two_tier_caches_and_change_nothing():
    base = tiny("llama")
    ours = with_attention(base, "streamkv")
    cache = two_tier(ours.config, "tova", sink=2, window=8, chunk=4, batch_size=2, tau=0.05)
    ids = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(9))
    forward_loop(ours, cache, ids, [4, 4, 3])  # evicting and recalling already
    assert cache.certifier.stats["recalled_tokens"] > 0
    before, stats = snapshot(cache.kv), dict(cache.certifier.stats)
    with torch.no_grad():
        with pytest.raises(ValueError, match="padding"):
            ours(input_ids=ids[:, 11:13], attention_mask=torch.tensor([[0] * 13, [1] * 13]), cache=cache)
        with pytest.raises(ValueError, match="chunk=4"):
            ours(input_ids=ids[:, 11:16], cache=cache)
        with pytest.raises(ValueError, match=r"next positions \[11, 12\)"):
            ours(input_ids=ids[:, 11:12], position_ids=torch.tensor([[3]]), cache=cache)
    with pytest.raises(RuntimeError, match="beam search"):
        cache.reorder_cache(torch.tensor([0, 1]))
    assert_same_state(before, snapshot(cache.kv))
    assert cache.certifier.stats == stats and cache.get_seq_length() == 11


def test_a_certifier_of_another_attention_is_refused_at_the_attention():
    base = tiny("llama")
    ours = with_attention(base, "streamkv")
    ids = torch.tensor([[5, 6, 7]])
    cache = build_cache(ours.config, "ring", sink=2, window=8, chunk=4, recall_slots=4,
                        certify={"recall_tau": 0.05, "scale": 0.5})  # not the model's head_dim ** -0.5
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"softmax scale 0.5, the model attends at 0.35355"):
            ours(input_ids=ids, cache=cache)
        with pytest.raises(RuntimeError, match="previous forward stopped after writing 1 and attending 0"):
            ours(input_ids=ids, cache=cache)
    # a non-causal certifier added to a bare cache: caught at the first attention as well
    kv = RingCache((1, 10, 2, 8), (1, 10, 2, 8), seq_dim=1, sink=2, window=8, chunk=4, num_layers=2, recall_slots=4)
    Certifier(kv, recall_tau=0.05, scale=8 ** -0.5)
    with torch.no_grad(), pytest.raises(ValueError, match="must be built with causal=True"):
        ours(input_ids=ids, cache=StreamKVCache(kv, config=ours.config))


@pytest.mark.parametrize("fullgraph", [True, False])
def test_compiled_steps_are_refused(fullgraph):
    """prepare_step, and a compiled forward: with fullgraph the trace fails, without it the
    compiled forward raises at layer 0's update (a graph break); nothing changes either way."""
    base = tiny("llama")
    ours = with_attention(base, "streamkv")
    cache = two_tier(ours.config, "ring", sink=2, window=8, chunk=4, tau=0.05)
    with torch.no_grad():
        ours(input_ids=torch.tensor([[5, 6]]), cache=cache)
    before = snapshot(cache.kv)
    with pytest.raises(RuntimeError, match="prepare_step .* runs eagerly only"):
        cache.prepare_step(1)
    torch._dynamo.reset()
    step = torch.compile(lambda tok: ours(input_ids=tok, cache=cache).logits, backend="eager", fullgraph=fullgraph)
    try:
        with torch.no_grad(), pytest.raises(Exception, match="does not support torch.compile") as info:
            step(torch.tensor([[7]]))
    finally:
        torch._dynamo.reset()
    assert fullgraph or info.type is RuntimeError
    assert_same_state(before, snapshot(cache.kv))
    assert cache.get_seq_length() == 2 and cache.certifier.stats["steps"] == 2
    with torch.no_grad():
        ours(input_ids=torch.tensor([[7]]), cache=cache)  # eager: still fine
    assert cache.get_seq_length() == 3


# ------------------------------------------------------------ the perplexity measurement
def test_twotier_lm_measurement_on_a_tiny_model():
    """The measurement's arithmetic and its caches: the full cache's perplexity is DynamicCache's;
    the two-tier device bytes add up; the ring and TOVA get them as token-equivalents."""
    import math

    from streamkv_lab.experiments.lm_stream import nll
    from streamkv_lab.experiments.twotier_lm import TwoTierLMConfig, run_twotier_lm

    model = tiny("llama")
    ids = torch.randint(3, 96, (1, 160), generator=torch.Generator().manual_seed(8))
    cfg = TwoTierLMConfig(tokens=160, chunk=4, policy="ring", sink=2, window=14, recall_slots=16, tau=0.05,
                          block_tokens=4)
    r = run_twotier_lm(cfg, model=model, ids=ids)
    assert model.config._attn_implementation == "sdpa"  # restored
    c = r["caches"]
    with torch.no_grad():
        logits = model(input_ids=ids, cache=DynamicCache(config=model.config)).logits[0]
    losses = nll(logits, ids[0, 1:])
    assert c["full"]["perplexity"] == pytest.approx(math.exp(float(losses.mean())), rel=1e-5)
    assert c["full"]["perplexity_past_budget"] == pytest.approx(math.exp(float(losses[16:].mean())), rel=1e-5)
    tt = c["two_tier"]
    assert tt["device_bytes"] == tt["kv_bytes"] + tt["policy_state_bytes"] + tt["sketch_bytes"]
    assert tt["kv_bytes"] == r["token_bytes"] * (16 + 16) and tt["recall_slot_bytes"] == r["token_bytes"] * 16
    assert r["matched_memory_tokens"] == round(tt["device_bytes"] / r["token_bytes"])
    for name in ("ring", "tova"):
        assert c[name]["memory_tokens"] == r["matched_memory_tokens"] < 160
    assert tt["violations"] == 0 and tt["recalled_tokens"] > 0
    assert c["budget_only"]["memory_tokens"] == 16 and c["budget_only"]["perplexity"] != c["full"]["perplexity"]
