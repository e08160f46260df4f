"""The machinery of ``streamkv lm-eval`` computes the right numbers (tiny random Llama, short
random token streams; no SmolLM2):

- the oracle's kept set is ``PerQueryMass.keep``'s (ties, regrown topk widths) and a brute
  force per query; its attention is the renormalised softmax over that set;
- the full cache's perplexity is a plain forward's; the ring's and the window's equal a
  float64 sink + window reference (chunks, and the token-by-token tail after a chunked
  prefill); an oracle that keeps everything gives the full perplexity;
- the per-layer attention error of layer 0 equals one computed here from captured q/k/v;
- the JSON has its keys; bad settings are refused before any work.
"""

from __future__ import annotations

import io
import json
import math
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console
from transformers import AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM

from streamkv.budget.oracles import PerQueryMass
from streamkv_lab.cli import main
from streamkv_lab.commands.lm_eval import payload
from streamkv_lab.experiments.lm_eval import LMEvalConfig, evaluate
from streamkv_lab.experiments.lm_oracle import KWARG, OracleRun, mass_keep, oracle_attention
from streamkv_lab.experiments.lm_report import plot_lm_eval, print_lm_eval


def tiny(dtype=torch.float32):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def tokens(n, seed=1):
    return torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(seed))


# a small plan: 2 segments of 40 tokens, chunks of 4, memory 16, the last 8 tokens decoded one by one
SMALL = {"tokens": 80, "segment": 40, "chunks": (4,), "memory": (16,), "sink": 2, "decode": 8, "error_stride": 3,
         "oracle_span": 8}


def ppl(losses):
    return math.exp(sum(losses) / len(losses))


# ------------------------------------------------------------------ the oracle's set
def brute_keep(p_row, protected_row, tau):
    """One query: protected first, then the others by (mass desc, position asc) until the
    kept mass (float64 sum) reaches 1 - tau."""
    order = sorted(range(len(p_row)), key=lambda j: (not protected_row[j], -p_row[j], j))
    keep, mass, n_prot = set(), 0.0, sum(protected_row)
    for i, j in enumerate(order):
        if i >= n_prot and mass >= 1 - tau:
            break
        keep.add(j)
        mass += p_row[j]
    return keep


@pytest.mark.parametrize("seed", range(16))
def test_mass_keep_is_per_query_mass(seed):
    g = torch.Generator().manual_seed(seed)
    R, N = 7, int(torch.randint(6, 120, (1,), generator=g))
    s = torch.randn(R, N, generator=g) * (1 + seed % 4)
    if seed % 2:
        s = (s * 2).round() / 2  # exact ties in mass
    p = s.double().softmax(-1)  # float64 rows: PerQueryMass sums in float64 too (see mass_keep)
    tau = [0.3, 0.1, 0.02, 1e-3][seed % 4]
    oracle = PerQueryMass(tau, protect_sinks=seed % 3, protect_recent=seed % 5)
    prot = oracle.protected(torch.arange(N)).expand(R, N)
    got = mass_keep(p, prot, tau, width=1 + seed)  # narrow widths: rows regrow their topk
    assert torch.equal(got, oracle.keep(p))
    for r in range(R):  # and a brute force per query
        assert set(got[r].nonzero().flatten().tolist()) == brute_keep(p[r].tolist(), prot[r].tolist(), tau)


def test_oracle_attention_is_the_renormalised_softmax_over_the_set():
    torch.manual_seed(3)
    Hq, Hkv, n, E, D, tau = 4, 2, 6, 20, 8, 0.1
    q, k, v = torch.randn(1, Hq, n, D) * 2, torch.randn(1, Hkv, E, D), torch.randn(1, Hkv, E, D)
    run = OracleRun(tau, sink=2, chunk=4, num_layers=1, error_stride=1)
    out, _ = oracle_attention(SimpleNamespace(layer_idx=0), q, k, v, None, scaling=D ** -0.5,
                              position_ids=torch.arange(E - n, E)[None], **{KWARG: run})
    assert out.shape == (1, n, Hq, D)
    kept = run.kept[0].view(Hq, n)
    for h in range(Hq):
        kh = k[0, h // 2].double()
        for i in range(n):
            pos = E - n + i
            p = torch.softmax(q[0, h, i].double() @ kh[: pos + 1].T * D ** -0.5, -1)
            prot = [j < 2 or pos - pos % 4 <= j for j in range(pos + 1)]
            keep = sorted(brute_keep(p.tolist(), prot, tau))
            assert kept[h, i] == len(keep)
            w = p[keep] / p[keep].sum()
            want = w @ v[0, h // 2, keep].double()
            torch.testing.assert_close(out[0, i, h].double(), want, atol=1e-5, rtol=1e-5)
            full = p @ v[0, h // 2, : pos + 1].double()
            assert (out[0, i, h].double() - full).norm() > 0 or len(keep) == pos + 1
    assert len(run.errors[0]) == 1 and run.errors[0][0].numel() == Hq * n


# ------------------------------------------------------------------ perplexities
def plain_losses(model, seg):
    with torch.no_grad():
        logits = model(input_ids=seg).logits[0].double()
    return (-logits[:-1].log_softmax(-1).gather(1, seg[0, 1:, None])[:, 0]).tolist()


def test_full_cache_is_a_plain_forward_and_a_keep_all_oracle_is_full():
    model = tiny()
    ids = tokens(80)
    cfg = LMEvalConfig(**SMALL, kinds=("ring",), oracle_taus=(1e-9,))  # the oracle keeps every key
    result = evaluate(model, ids, cfg)
    assert model.config._attn_implementation != "streamkv"  # restored
    want = ppl([x for s in (ids[:, :40], ids[:, 40:]) for x in plain_losses(model, s)])
    full = {e["mode"]: e for e in result["caches"]["full"]}
    assert full["stream"]["perplexity"] == pytest.approx(want, rel=1e-5)
    assert full["stream"]["predictions"] == 2 * 39 and full["decode"]["predictions"] == 2 * 7  # positions 32..38
    assert full["stream"]["attn_error_p99"] < 1e-5  # nothing evicted: rounding only
    oracle = {o["mode"]: o for o in result["oracle"]}
    assert oracle["stream"]["perplexity"] == pytest.approx(full["stream"]["perplexity"], rel=1e-5)
    assert oracle["decode"]["perplexity"] == pytest.approx(full["decode"]["perplexity"], rel=1e-5)
    assert oracle["stream"]["memory_tokens"] == pytest.approx((40 + 1) / 2)  # mean visible history
    ring = result["caches"]["ring"][0]
    assert ring["perplexity"] != pytest.approx(want, rel=1e-4) and ring["attn_error_mean"] > 1e-3  # it evicted


def reference_attention(sink, window):
    """float64 sink + window attention over a DynamicCache's full history: after a forward
    writes positions up to E - 1, a query at p sees j <= p held then (j < sink or j >= E - window)."""
    name = f"lm-eval-test-ref-{sink}-{window}"

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        T, E = query.shape[2], key.shape[2]
        j, p = torch.arange(E)[None], torch.arange(E - T, E)[:, None]
        visible = ((j < sink) | (j >= E - window)) & (j <= p)
        g = query.shape[1] // key.shape[1]
        scores = query.double() @ key.double().repeat_interleave(g, 1).transpose(-1, -2) * scaling
        out = scores.masked_fill(~visible, -math.inf).softmax(-1) @ value.double().repeat_interleave(g, 1)
        return out.transpose(1, 2).to(query.dtype), None

    AttentionInterface.register(name, attention)
    return name


def reference_losses(model, seg, sink, window, spans):
    model.set_attn_implementation(reference_attention(sink, window))
    cache, losses, s = DynamicCache(config=model.config), [], 0
    try:
        with torch.no_grad():
            for n in spans:
                logits = model(input_ids=seg[:, s : s + n], cache=cache).logits[0].double()
                tgt = seg[0, s + 1 : s + n + 1]
                losses += (-logits[: tgt.numel()].log_softmax(-1).gather(1, tgt[:, None])[:, 0]).tolist()
                s += n
    finally:
        model.set_attn_implementation("sdpa")
    return losses


@pytest.mark.parametrize("decode", [8, 5])  # the tail starts at the chunk boundary 32 either way
def test_ring_and_window_equal_a_float64_sink_window_reference(decode):
    model = tiny(torch.float64)
    ids = tokens(80, seed=2)
    result = evaluate(model, ids, LMEvalConfig(**{**SMALL, "decode": decode}, kinds=("window", "ring"), oracle_taus=()))
    n = min(decode, 7)  # predictions of the tail: positions 32 .. 32 + decode - 1, at most 38
    for label, sink in (("window", 0), ("ring", 2)):
        entries = {e["mode"]: e for e in result["caches"][label]}
        assert entries["decode"]["predictions"] == 2 * n
        stream, dec = [], []
        for seg in (ids[:, :40], ids[:, 40:]):
            stream += reference_losses(model, seg, sink, 16 - sink, [4] * 10)
            dec += reference_losses(model, seg, sink, 16 - sink, [4] * 8 + [1] * decode)[32 : 32 + n]
        assert entries["stream"]["perplexity"] == pytest.approx(ppl(stream), rel=1e-10)
        assert entries["decode"]["perplexity"] == pytest.approx(ppl(dec), rel=1e-10)
        # the chunked run on the decoded predictions: the stream reference's tail
        tail = [x for i in range(2) for x in stream[39 * i + 32 : 39 * i + 32 + n]]
        assert entries["decode"]["chunk4_perplexity_same_predictions"] == pytest.approx(ppl(tail), rel=1e-10)


# ------------------------------------------------------------------ attention error
def test_layer0_attention_error_matches_captured_qkv():
    model = tiny()
    ids = tokens(40, seed=4)
    captured = []

    def capture(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if module.layer_idx == 0:
            captured.append((query[0].double(), key[0].double(), value[0].double()))
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)

    AttentionInterface.register("lm-eval-test-capture", capture)
    model.set_attn_implementation("lm-eval-test-capture")
    with torch.no_grad():
        model(input_ids=ids)  # layer 0's q/k/v depend on the tokens only, not on the cache
    model.set_attn_implementation("sdpa")
    q, k, v = captured[0]
    k, v = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)
    errs = []
    for pos in range(40):
        if (pos + 1) % 3:
            continue
        E = pos - pos % 4 + 4  # positions held once the query's chunk is written
        j = torch.arange(pos + 1)
        held = (j < 2) | (j >= E - 14)
        s = torch.einsum("hd,hjd->hj", q[:, pos], k[:, : pos + 1]) * 8 ** -0.5
        full = torch.einsum("hj,hjd->hd", s.softmax(-1), v[:, : pos + 1])
        ring = torch.einsum("hj,hjd->hd", s.masked_fill(~held, -math.inf).softmax(-1), v[:, : pos + 1])
        errs += ((ring - full).norm(dim=-1) / full.norm(dim=-1)).tolist()
    cfg = LMEvalConfig(**{**SMALL, "tokens": 40, "decode": 0}, kinds=("ring",), oracle_taus=())
    layer0 = evaluate(model, ids, cfg)["caches"]["ring"][0]["attn_error_layers"][0]
    assert layer0["mean"] == pytest.approx(sum(errs) / len(errs), rel=1e-4)
    assert layer0["mean"] > 1e-3


# ------------------------------------------------------------------ JSON, refusals
def test_json_payload_has_the_documented_keys(tmp_path):
    model = tiny()
    result = evaluate(model, tokens(80), LMEvalConfig(**SMALL, kinds=("ring", "mass", "tova"), taus=(0.05,),
                                                      oracle_taus=(0.1,)))
    doc = json.loads(json.dumps(payload(result, {"name": "tiny"}, {"title": "t", "offset": 0}, "cmd", 1.0, {})))
    for key in ("model", "text", "tokens", "chunk", "caches", "oracle", "targets", "versions"):
        assert key in doc
    assert doc["tokens"] == 80 and doc["chunk"] == [4, 1]
    assert set(doc["caches"]) == {"full", "ring", "mass(tau=0.05)", "tova"}
    for entries in doc["caches"].values():
        for e in entries:
            assert {"memory_tokens", "perplexity", "attn_error_mean", "attn_error_p99"} <= set(e)
            assert e["perplexity"] > 1 and math.isfinite(e["attn_error_mean"]) and e["attn_error_p99"] >= 0
    assert {(o["mode"], o["tau"]) for o in doc["oracle"]} == {("stream", 0.1), ("decode", 0.1)}
    assert [t["mode"] for t in doc["targets"]] == ["stream", "decode"]
    out = io.StringIO()  # the tables and the plot render from the JSON document
    print_lm_eval(Console(file=out, width=170), doc)
    assert "tova" in out.getvalue() and "oracle" in out.getvalue()
    assert plot_lm_eval(doc, tmp_path / "p.png").stat().st_size > 0


@pytest.mark.parametrize("bad, match", [
    ({"segment": 300}, "trained context"),
    ({"tokens": 70}, "multiple of segment"),
    ({"memory": (8,)}, "memory 8"),
    ({"decode": 30}, "decode"),  # the prefill (to position 8) would not fill the 16-token memory
    ({"decode": -1}, "decode"),
    ({"kinds": ("lru",)}, "kinds"),
])
def test_bad_settings_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        evaluate(tiny(), tokens(80), LMEvalConfig(**{**SMALL, **bad}))


def test_cli_refuses_before_loading_the_model(tmp_path, capsys):
    assert main(["lm-eval", "--memory", "8", "--json", str(tmp_path / "x.json")]) == 2
    assert "memory 8" in capsys.readouterr().err
