"""Quantised storage where users are: transformers' build_cache, the sglang drop-in, the
Self-Forcing dicts, the DiT rollout and CacheSet through cache_kwargs."""

import math

import pytest
import torch

from streamkv.quant import KV_FORMATS, KVQuant

transformers = pytest.importorskip("transformers")


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, pad_token_id=0,
                      bos_token_id=None, eos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def _relative_error(codec) -> float:
    """The format's largest round-trip error of a token, relative to the token's largest element."""
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(0))
    codes, scale = codec.encode(x, 16)
    return float(((codec.decode(codes, scale, 16, 16) - x).abs().amax(-1) / x.abs().amax(-1)).max())


@pytest.mark.parametrize("fmt", list(KV_FORMATS))
def test_build_cache_quant_streams_and_stays_close(fmt):
    import streamkv.integrations.transformers as skv

    model = _tiny()
    model.set_attn_implementation("streamkv")
    ids = torch.randint(1, 96, (1, 48), generator=torch.Generator().manual_seed(1))
    outs = {}
    for q in (None, KVQuant(fmt, basis="hadamard" if KV_FORMATS[fmt].bits <= 4 else "identity")):
        cache = skv.build_cache(model.config, "ring", memory_tokens=32, sink=2, chunk=8, quant=q)
        with torch.no_grad():
            outs[q is None] = torch.cat([model(input_ids=ids[:, i:i + 8], cache=cache).logits for i in range(0, 48, 8)], 1)
        if q is not None:
            assert cache.kv.nbytes == cache.kv.storage.store.nbytes
            assert cache.kv.storage.store.buffers() is None  # codes only: no dense copy of the history
            assert set(cache.layers[0].keys.stride()) == {0}  # transformers sees a shape-carrying placeholder
    diff = (outs[True] - outs[False]).abs().max().item()
    # a smoke bound (exactness over the stored values is test_quant's), scaled by the format's own
    # rounding: the measured logit change was 13-71x the relative round-trip error of a token
    # (0.08 / 0.81 / 0.28 / 3.0 / 8.5 for bf16 / fp8 / int8 / int4 / int2 on logits of |8|)
    assert diff < 150 * _relative_error(KV_FORMATS[fmt]), diff
    assert math.isfinite(diff)


def test_sglang_dropin_with_quant_views_are_the_stored_rows():
    from streamkv.attention import attend
    from streamkv.compat.sglang import RingCausalSelfAttentionKVCache

    B, L, H, D, n = 1, 24, 2, 8, 4
    ph = torch.zeros(()).expand(B, L, H, D)
    c = RingCausalSelfAttentionKVCache(ph, ph, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 0, 0,
                                       cache_size=L, sink_tokens=4, quant="int8")
    g = torch.Generator().manual_seed(0)
    for i in range(10):
        for _ in range(2):
            k, v, q = (torch.randn(B, n, H, D, generator=g) for _ in range(3))
            view = c.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * n)
        out_view = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), view.k.transpose(1, 2),
                                                                   view.v.transpose(1, 2)).transpose(1, 2)
        out_ring, _ = attend(q, c.ring.read(0))
        assert torch.allclose(out_view, out_ring, atol=1e-5)
        if i == 0:  # the open chunk is full precision: the view holds it as written
            assert torch.equal(view.k, k)
    c.pin_current_chunk(n)
    with pytest.raises(ValueError, match="quantised ring"):
        c.update_and_get_attention_kv(key=k, value=v, current_chunk_start=10 * n)


def test_self_forcing_dicts_with_quant():
    from streamkv.compat.self_forcing import self_forcing_kv_caches

    caches = self_forcing_kv_caches(2, 1, 24, 2, 8, sink_tokens=4, quant="int4", dtype=torch.float32)
    assert caches[0]["k"].stride() == (0, 0, 0, 0)
    g = torch.Generator().manual_seed(0)
    for i in range(8):
        k, v = (torch.randn(1, 4, 2, 8, generator=g) for _ in range(2))
        ka, va = caches[0].update(k, v, i * 4)
        assert ka.shape[1] == min(24, (i + 1) * 4) and ka.dtype == torch.float32
    caches[0]["global_end_index"] = torch.tensor([0])
    assert caches[0].ring_cache.global_end_index_int == 0


@pytest.mark.parametrize("kind", ["ring", "chronological"])
def test_dit_rollout_takes_quant(kind):
    from streamkv.models import CausalVideoDiT, get_config
    from streamkv.rollout import StreamingRollout

    torch.manual_seed(0)
    model = CausalVideoDiT(get_config("tiny")).eval()
    outs = []
    for q in (None, "bf16"):
        r = StreamingRollout(model, cache=kind, seed=0, cache_kwargs={"quant": q} if q else None)
        r.set_prompt("a", seed=0)
        with torch.no_grad():
            outs.append(r.run(5))
        if q:
            assert r.caches["cond"].storage.store.exact is False
    scale = outs[0].abs().max()
    assert (outs[0] - outs[1]).abs().max() / scale < 0.05
