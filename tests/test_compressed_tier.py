"""The compressed resident tier (``streamkv.certify.tier``) and the per-chunk oracle.

A small causal GQA stream through a TOVA tier 1 whose evictions fill a small tier-2 ring (so
tier 3 holds blocks and recall runs): every certificate against float64 full history over the
original K/V, the read against float64 attention over what the tiers hold, the recall bytes
against their count, and the refusals.
"""

from __future__ import annotations

import math

import pytest
import torch

from streamkv.attention import attend

from streamkv import KVCache
from streamkv.budget.oracles import FixedWindow, PerChunkMass
from streamkv.caches import CacheObserver
from streamkv.certify.bound import certify
from streamkv.certify.tier import CompressedTier
from streamkv.policies import POLICIES, example_policy

from kinds import SCORED

B, H, G, D, C = 1, 2, 2, 16, 8
SINK, WINDOW, RECALL = 2, 2 * C + 6, 16


def _stream(T: int = 96, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, 1, H, D, generator=g)  # a shared direction: peaked, learned-looking attention
    q = (torch.randn(B, T, H * G, D, generator=g) + 2 * base.repeat_interleave(G, 2))
    k = torch.randn(B, T, H, D, generator=g) + base * torch.rand(B, T, 1, 1, generator=g) * 3
    v = torch.randn(B, T, H, D, generator=g)
    return q, k, v


def _build(kind="tova", fmt="int4", capacity=32, block=8, recall=RECALL, tau=0.02):
    cache = KVCache((B, SINK + WINDOW, H, D), (B, SINK + WINDOW, H, D), policy=kind, seq_dim=1, sink=SINK,
                    window=WINDOW, chunk=C, num_layers=1, recall_slots=recall, dtype=torch.float32,
                    **example_policy(kind))
    tier = CompressedTier(cache, fmt=fmt, capacity=capacity, block=block, recall_tau=tau if recall else None,
                          causal=True)
    return cache, tier


def _full(q, k, v, a, b):
    """Float64 causal full-history attention of queries ``[a, b)``, as certificate rows ``[B, H, G*n, D]``."""
    kk = k[:, :b].double().repeat_interleave(G, 2).transpose(1, 2)
    vv = v[:, :b].double().repeat_interleave(G, 2).transpose(1, 2)
    s = q[:, a:b].double().transpose(1, 2) @ kk.transpose(-1, -2) / math.sqrt(D)
    hide = torch.arange(b).view(1, -1) > torch.arange(a, b).view(-1, 1)
    p = s.masked_fill(hide, -math.inf).softmax(-1)  # [B, Hq, n, b]
    return (p @ vv).reshape(B, H, G * (b - a), D), p.reshape(B, H, G * (b - a), b)


def _run(cache, tier, q, k, v, each):
    for c in range(q.shape[1] // C):
        a, b = c * C, (c + 1) * C
        cache.begin_tokens(C)
        out = attend(q[:, a:b], cache.layer(0).update(k[:, a:b], v[:, a:b], q[:, a:b]), causal=tier.causal)[0]
        each(a, b, out)
        cache.commit()


@pytest.mark.parametrize("kind", SCORED)
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_certificate_never_below_float64_truth(kind, fmt):
    q, k, v = _stream()
    cache, tier = _build(kind, fmt)
    seen = {"rows": 0, "tier3": 0, "naive_below": 0}

    def each(a, b, out):
        cert = tier.last[0]
        full, p = _full(q, k, v, a, b)
        true = (full - cert.out_kept).abs()
        assert (true <= cert.error).all(), f"{kind} {fmt}: error certificate below the truth at [{a}, {b})"
        m_true = (p * (~tier.held(0)).unsqueeze(0).unsqueeze(2)).sum(-1)
        assert (m_true <= cert.mass).all(), f"{kind} {fmt}: mass certificate below the truth at [{a}, {b})"
        seen["rows"] += true.shape[2]
        seen["tier3"] += int((m_true > 0).sum())
        # the eviction certificate alone (no quantisation slack) is below the truth: the slack is needed
        st = cache.storage
        k2, v2, _, _ = tier.decoded(0)
        kk = torch.cat([st.head_view("k", 0).transpose(0, 1), k2], -2)
        vv = torch.cat([st.head_view("v", 0).transpose(0, 1), v2], -2)
        naive = certify(tier.query_rows(q[:, a:b]), kk, vv, None, tier.lo[0], tier.hi[0], tier.log_count[0],
                        tier.vlo[0], tier.vhi[0], scale=tier.scale, n_tokens=b)
        seen["naive_below"] += int(((full - cert.out_kept).abs() > naive.error + 1e-12).any() and tier.count[0][0] > 0)

    _run(cache, tier, q, k, v, each)
    assert tier.stats["dropped_blocks"] > 0 and seen["tier3"] > 0, "the stream must push blocks into tier 3"
    assert tier.stats["recalled_blocks"] > 0, "the stream must make the tier recall"
    assert seen["naive_below"] > 0, "a certificate without the quantisation slack must fail somewhere"


def test_read_is_attention_over_what_the_tiers_hold():
    """``attend`` = float64 softmax over tier 1 (recall slots included) and the live tier-2 entries
    as stored, and the certificate's ``out_kept`` is the same attention."""
    q, k, v = _stream(seed=1)
    cache, tier = _build()
    worst = [0.0]

    def each(a, b, out):
        st = cache.storage
        k2, v2, _, _ = tier.decoded(0)
        kk = torch.cat([st.head_view("k", 0).transpose(0, 1), k2], -2).double()
        vv = torch.cat([st.head_view("v", 0).transpose(0, 1), v2], -2).double()
        pos = st.layer_positions(0)  # [H, S]
        qpos = torch.arange(a, b).repeat(G)
        hide1 = (pos.unsqueeze(1) < 0) | (pos.unsqueeze(1) > qpos.view(1, -1, 1))  # [H, Q, S]
        hide2 = (~tier.live[0]).unsqueeze(1).expand(H, G * C, -1)
        s = tier.query_rows(q[:, a:b]).double() @ kk.transpose(-1, -2) * tier.scale
        s = s.masked_fill(torch.cat([hide1, hide2], -1), -math.inf)
        ref = s.softmax(-1) @ vv
        got = out.double().permute(0, 2, 1, 3).reshape(B, H, G * C, D)
        worst[0] = max(worst[0], float((got - ref).abs().max()))
        assert torch.allclose(tier.last[0].out_kept, ref, atol=1e-12, rtol=0)

    _run(cache, tier, q, k, v, each)
    assert worst[0] < 1e-5, f"attend differs from float64 attention over the held tokens by {worst[0]:.3g}"
    assert tier.stats["dropped_blocks"] > 0 and tier.stats["recalled_blocks"] > 0



def test_a_compiled_read_attends_tier_two():
    """A read traced by torch.compile attends the tier's rows too (it once read tier 1 alone: the
    traced read left the observers' segments out, silently)."""
    q, k, v = _stream(seed=2)
    cache, tier = _build(recall=0, tau=None)
    _run(cache, tier, q[:, :-C], k[:, :-C], v[:, :-C], lambda a, b, out: None)
    assert int(tier.live[0].sum()) > 0, "the stream must fill tier 2"
    cache.begin_tokens(C)
    a = q.shape[1] - C
    cache.layer(0).update(k[:, a:], v[:, a:], q[:, a:])

    def read(x):
        return attend(x, cache.read(0), causal=True)[0]

    eager = read(q[:, a:])
    compiled = torch.compile(read, backend="eager", fullgraph=True)(q[:, a:])
    assert torch.allclose(compiled, eager, atol=1e-6, rtol=0), float((compiled - eager).abs().max())

def test_recall_bytes_are_the_copied_tokens():
    """h2d bytes = recalled tokens x (K + V bytes of one token of one head), and the per-span
    counts sum to the total; the host holds every evicted token once."""
    q, k, v = _stream(seed=2)
    cache, tier = _build()
    _run(cache, tier, q, k, v, lambda a, b, out: None)
    per_token = B * 2 * D * 4  # float32 K and V of one head
    assert tier.stats["recalled_tokens"] > 0
    assert tier.stats["h2d_bytes"] == tier.stats["recalled_tokens"] * per_token
    assert sum(tier.stats["h2d_bytes_per_span"]) == tier.stats["h2d_bytes"]
    assert len(tier.stats["h2d_bytes_per_span"]) == q.shape[1] // C  # planned once per span
    evicted = sum(tier.count[0])
    assert tier.host_bytes == evicted * (per_token + 8)  # K, V and an int64 position
    assert evicted == H * q.shape[1] - int((cache.storage.layer_positions(0)[:, : cache.storage.capacity] >= 0).sum())


def test_tier_two_bytes_are_the_formats_bytes():
    cache, tier = _build(fmt="int4", capacity=32)
    fmt = tier.quant
    assert tier.bytes_per_entry() == B * fmt.bytes_per_token(D, D) + 1
    assert tier.k_codes.nbytes + tier.v_codes.nbytes + tier.k_scale.nbytes + tier.v_scale.nbytes + tier.live.nbytes \
        == H * 32 * tier.bytes_per_entry()


def test_a_vetoed_commit_leaves_the_tier_unchanged():
    q, k, v = _stream(seed=3)
    cache, tier = _build()

    class Veto(CacheObserver):
        armed = False

        def prepare(self, change):
            if self.armed and change.what == "commit":
                raise RuntimeError("veto")
            return None

    veto = Veto()
    cache.add_observer(veto)
    for c in range(6):
        a, b = c * C, (c + 1) * C
        cache.begin_tokens(C)
        attend(q[:, a:b], cache.layer(0).update(k[:, a:b], v[:, a:b], q[:, a:b]), causal=tier.causal)
        if c == 5:
            before = (list(tier.count[0]), tier.live.clone(), tier.host_bytes, tier.k_codes.clone())
            veto.armed = True
            with pytest.raises(RuntimeError, match="veto"):
                cache.commit()
            assert (list(tier.count[0]), tier.host_bytes) == (before[0], before[2])
            assert torch.equal(tier.live, before[1]) and torch.equal(tier.k_codes, before[3])
        else:
            cache.commit()
    assert sum(tier.count[0]) > 0, "the commits before the veto evicted into tier 2"


def test_refusals_name_the_constraint():
    kw = dict(seq_dim=1, sink=SINK, window=WINDOW, chunk=C, num_layers=1, dtype=torch.float32)
    shape = (B, SINK + WINDOW, H, D)
    with pytest.raises(ValueError, match="quant"):
        CompressedTier(KVCache(shape, shape, policy="tova", quant="int8", **kw), capacity=16)
    with pytest.raises(ValueError, match="multiple of block"):
        CompressedTier(KVCache(shape, shape, policy="tova", **kw), capacity=20, block=8)
    with pytest.raises(ValueError, match="recall_tau is None"):
        CompressedTier(KVCache(shape, shape, policy="tova", recall_slots=16, **kw), capacity=16)
    with pytest.raises(ValueError, match="recall_slots >= block"):
        CompressedTier(KVCache(shape, shape, policy="tova", **kw), capacity=16, recall_tau=0.1)
    with pytest.raises(ValueError, match="KVQuant keys"):
        CompressedTier(KVCache(shape, shape, policy="tova", **kw), capacity=16, fmt="int3")
    plain, _ = _build(recall=0)
    state = plain.state_dict()
    with pytest.raises(RuntimeError, match="does not load state dicts"):
        plain.load_state_dict(state)
    cache, tier = _build()
    with pytest.raises(ValueError, match="another observer recalls"):
        CompressedTier(cache, capacity=16, block=8, recall_tau=0.1)


def test_every_kind_feeds_tier_two():
    """Any evicting kind as tier 1: what it evicts is attended from tier 2 and the certificate holds."""
    q, k, v = _stream(T=64, seed=4)
    for kind in POLICIES:
        cache, tier = _build(kind, capacity=64)

        def each(a, b, out, tier=tier):
            full, _ = _full(q, k, v, a, b)
            assert ((full - tier.last[0].out_kept).abs() <= tier.last[0].error).all(), kind

        _run(cache, tier, q, k, v, each)
        assert sum(tier.count[0]) > 0, f"{kind}: nothing reached tier 2"


# ------------------------------------------------------------------ per-chunk oracle
def test_per_chunk_oracle_drawn():
    """Two query rows over 5 tokens, size 3, one sink and the newest protected::

        p = [[1/8, 1/2, 1/8, 1/8, 1/8],      summed: [1/4, 5/8, 3/8, 5/8, 1/8]
             [1/8, 1/8, 1/4, 1/2,   0]]      kept: sink 0, newest 4, then the heaviest: 1 (tie with 3: older first)
    """
    p = torch.tensor([[1, 4, 1, 1, 1], [1, 1, 2, 4, 0]], dtype=torch.float64) / 8
    keep = PerChunkMass(3, protect_sinks=1, protect_recent=1).keep(p)
    assert keep.tolist() == [[True, True, False, False, True]] * 2
    keep = PerChunkMass(4, protect_sinks=1, protect_recent=1).keep(p)
    assert keep[0].tolist() == [True, True, False, True, True]


def test_per_chunk_oracle_beats_random_and_window_sets():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randn(3, 12, 40, generator=g, dtype=torch.float64) * 3
        p = logits.softmax(-1)
        size, sinks, recent = 10, 2, 4
        keep = PerChunkMass(size, protect_sinks=sinks, protect_recent=recent).keep(p)
        assert (keep.sum(-1) == size).all() and (keep == keep[:, :1]).all()  # one set per chunk, of the size
        best = (p * keep).sum((-1, -2))
        window = FixedWindow(size - sinks, sinks=sinks).keep(p)
        assert ((p * window).sum((-1, -2)) <= best + 1e-12).all()
        for _ in range(10):
            rand = torch.zeros(40, dtype=torch.bool)
            rand[:sinks] = True
            rand[-recent:] = True
            rest = torch.randperm(40 - sinks - recent, generator=g)[: size - sinks - recent] + sinks
            rand[rest] = True
            assert ((p * rand).sum((-1, -2)) <= best + 1e-12).all()


def test_per_chunk_oracle_refusals():
    with pytest.raises(ValueError, match="size"):
        PerChunkMass(0)
    with pytest.raises(ValueError, match=r"\[\*, Q, N\]"):
        PerChunkMass(2).keep(torch.tensor([0.5, 0.5], dtype=torch.float64))
    with pytest.raises(ValueError, match="sum to 1"):
        PerChunkMass(2).keep(torch.tensor([[0.5, 0.6]], dtype=torch.float64))


def test_toy_stream_records_the_committed_pass():
    """The toy model's recorded stream: every chunk once (the committed pass), the keys the ring
    holds at the end (it holds every frame), queries of the model's head count."""
    from streamkv.lab.video import qkv
    from streamkv.lab.video.toy import load_model

    seen = {}
    real = qkv._Recorder.on_commit

    def spy(self, cache, chunk_idx):
        seen["cache"] = cache
        real(self, cache, chunk_idx)

    qkv._Recorder.on_commit = spy
    try:
        s = qkv.toy_stream(frames=8)
    finally:
        qkv._Recorder.on_commit = real
    cfg = load_model().cfg
    assert s.tokens == 8 * cfg.tokens_per_frame and s.chunk == cfg.frames_per_chunk * cfg.tokens_per_frame
    assert s.layers == cfg.layers and s.q[0].shape[2] == cfg.heads and not s.causal
    cache = seen["cache"]
    for layer in range(s.layers):
        assert torch.equal(cache.keys(layer)[:, : s.tokens], s.k[layer])
        assert torch.equal(cache.values(layer)[:, : s.tokens], s.v[layer])
    with pytest.raises(ValueError, match="multiple of the chunk"):
        qkv.toy_stream(frames=7)


def test_transformers_model_attends_tier_two():
    """``build_cache(..., tier=)``: every layer of a tiny Llama attends tiers 1 and 2; with tier 2
    holding the evicted history the logits are closer to the full cache's than tier 1 alone."""
    import streamkv.integrations.transformers as skv
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
                      pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation(skv.ATTN_IMPLEMENTATION)
    ids = torch.randint(1, 64, (1, 192))

    def logits(cache):
        out = []
        with torch.no_grad():
            for a in range(0, ids.shape[1], 16):
                out.append(model(input_ids=ids[:, a:a + 16], cache=cache).logits)
        return torch.cat(out, 1)

    build = lambda kind, memory, **kw: skv.build_cache(model.config, kind, memory_tokens=memory, sink=4, chunk=16, **kw)
    full = logits(build("ring", 192))
    alone = logits(build("tova", 48))
    cache = build("tova", 48, tier={"fmt": "int8", "capacity": 160, "certify": False})
    tiered = logits(cache)
    assert sum(cache.tier.count[0]) > 0
    assert (tiered - full).abs().max() < 0.2 * (alone - full).abs().max()
    with pytest.raises(ValueError, match="give one"):
        build("tova", 48, tier={"capacity": 16}, certify={"recall_tau": 0.1})
    with pytest.raises(TypeError, match="causal"):
        build("tova", 48, tier={"capacity": 16, "causal": True})
    odd = build("tova", 48, tier={"capacity": 16, "scale": 0.5})
    with pytest.raises(ValueError, match="softmax scale"):
        logits(odd)


def test_tier_geometry_fits_the_budget_or_refuses():
    from streamkv.lab.experiments.tier import TierConfig, tier_geometry
    from streamkv.lab.experiments.twotier import video_stream

    s = video_stream(frames=8, layers=1)
    per_slot = s.layers * s.k[0].shape[0] * s.k[0].shape[2] * 2 * s.k[0].shape[3] * 4
    budget = 200 * per_slot
    g = tier_geometry(s, TierConfig("int8", 0.5), budget, sink=2)
    assert g["sink"] + g["window"] + g["recall"] == 100 and g["capacity"] % 16 == 0 and g["capacity"] > 0
    with pytest.raises(ValueError, match="too few left for one tier-2 block"):
        tier_geometry(s, TierConfig("int8", 0.995), budget, sink=2)
    with pytest.raises(ValueError, match="too few for 2 sinks"):
        tier_geometry(s, TierConfig("int8", 0.1), budget, sink=2)
