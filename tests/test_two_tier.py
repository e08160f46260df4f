"""The two-tier cache: key sketches (per-token int8 / int4 codes with measured per-channel error),
certificates from them (causal, grouped-query), certified recall, and ``streamkv certify --real``
on the synthetic video stream — every certificate checked against the float64 whole history."""

import json
import math

import pytest
import torch

from streamkv import KVCache
from streamkv.attention import attend
from streamkv.certify import Certifier, HistoryCheck
from streamkv.certify.sketch import KeySketch
from streamkv_lab.cli import main
from streamkv_lab.env import threads
from streamkv_lab.experiments.twotier import Stream, TwoTierConfig, run_two_tier

B, H, D = 1, 2, 8


@pytest.fixture(autouse=True)
def _one_thread():
    with threads(1):
        yield


@pytest.mark.parametrize("bits", [8, 4])
def test_sketch_boxes_hold_every_key(bits):
    """|k - k_hat| <= e on every token and channel; pending tokens (a block not yet full) exact;
    8-bit boxes narrower than 4-bit ones."""
    gen = torch.Generator().manual_seed(0)
    sk = KeySketch(batch=B, heads=H, head_dim=D, value_dim=3, device="cpu", bits=bits, block_tokens=5)
    keys = []
    for event in range(7):
        k = torch.randn(B, H, 3, D, generator=gen) * torch.tensor([1, 10, 0.1, 3, 1, 1, 50, 2])  # outlier channels
        mask = torch.tensor([[True, False, True], [True, True, True]])
        sk.add(event, k, torch.randn(B, H, 3, 3, generator=gen), mask)
        keys.append((k, mask))
    lo, hi = sk.boxes()
    for h in range(H):
        kh = torch.cat([k[:, h][:, m[h]] for k, m in keys], dim=1).double()  # the head's evicted keys, in order
        n = kh.shape[1]
        assert sk.n[h] == n
        assert (lo[:, h, :n] <= kh).all() and (kh <= hi[:, h, :n]).all()
        q = sk.quantized[h]
        assert q == (n // 5) * 5 and torch.equal(lo[:, h, q:n], kh[:, q:])  # pending: exact
    width = (hi - lo)[:, :, : min(sk.quantized)].mean()
    assert width > 0
    if bits == 8:
        sk4 = KeySketch(batch=B, heads=H, head_dim=D, value_dim=3, device="cpu", bits=4, block_tokens=5)
        for event, (k, mask) in enumerate(keys):
            sk4.add(event, k, torch.zeros(B, H, 3, 3), mask)
        lo4, hi4 = sk4.boxes()
        assert (hi4 - lo4)[:, :, : min(sk4.quantized)].mean() > 4 * width
        assert sk4.nbytes < sk.nbytes


def test_sketch_rejects_bad_sizes():
    with pytest.raises(ValueError, match="bits must be 4 or 8, got 3"):
        KeySketch(batch=1, heads=1, head_dim=4, value_dim=4, device="cpu", bits=3)
    with pytest.raises(ValueError, match="block_tokens must be >= 1, got 0"):
        KeySketch(batch=1, heads=1, head_dim=4, value_dim=4, device="cpu", block_tokens=0)
    with pytest.raises(ValueError, match="head_dim must be even, got 5"):
        KeySketch(batch=1, heads=1, head_dim=5, value_dim=4, device="cpu", bits=4)


def _stream(kind, *, sketch_bits, causal, groups=1, recall=0, tau=None, chunks=18, C=4, S=1, W=9, seed=0):
    """Random keys with a few heavy tokens, queries of ``groups`` query heads per key head,
    through ``kind`` watched by a sketch certifier and the float64 whole-history check."""
    gen = torch.Generator().manual_seed(seed)
    params = {"tau": 0.2} if kind == "mass" else {}
    cache = KVCache((B, S + W, H, D), (B, S + W, H, D), policy=kind, seq_dim=1, sink=S, window=W, chunk=C,
                    num_layers=2, recall_slots=recall, **params)
    cert = Certifier(cache, sketch_bits=sketch_bits, block_tokens=4, causal=causal, recall_tau=tau)
    check = HistoryCheck(cert, tau=tau or 0.05)
    for c in range(chunks):
        cache.begin_tokens(C) if causal else cache.begin_chunk(c)
        for layer in range(2):
            k = torch.randn(B, C, H, D, generator=gen) * 1.5
            k[:, 0] *= 3 if c % 5 == 0 else 1  # some keys far heavier than the rest
            v = torch.randn(B, C, H, D, generator=gen)
            q = torch.randn(B, C, H * groups, D, generator=gen) * 1.5
            out, _ = attend(q, cache.layer(layer).update(k, v, q), causal=causal)
            c_out = cert.last[layer].out_kept  # [B, H, G*n, Dv], float64: the attention over what is held
            ref = out.double().view(B, C, H, groups, D).permute(0, 2, 3, 1, 4).reshape(B, H, groups * C, D)
            assert (c_out - ref).abs().max() < 1e-4
        cache.commit() if causal else cache.commit_chunk(c)
    return cache, cert, check.result()


@pytest.mark.parametrize("kind", ["ring", "tova", "mass"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("causal,groups", [(False, 1), (True, 3)])
def test_sketch_certificates_are_valid_and_tight(kind, bits, causal, groups):
    _, _, r = _stream(kind, sketch_bits=bits, causal=causal, groups=groups)
    assert r["violations"] == 0 and r["count_mismatch"] == 0 and r["nontrivial"] > 100
    assert r["tightness_median"] < (1.5 if bits == 8 else 4.0)


def test_sketch_certificates_are_tighter_than_boxes():
    _, _, sketch = _stream("ring", sketch_bits=8, causal=False)
    _, _, boxes = _stream("ring", sketch_bits=None, causal=False)
    assert sketch["violations"] == boxes["violations"] == 0
    assert sketch["tightness_median"] < 1.2 < boxes["tightness_median"]


@pytest.mark.parametrize("causal,groups", [(False, 1), (True, 3)])
def test_certified_recall_from_sketches_keeps_every_query_under_tau(causal, groups):
    tau = 0.05
    cache, cert, r = _stream("ring", sketch_bits=8, causal=causal, groups=groups, recall=64, tau=tau)
    st = cert.stats
    assert st["recalled_tokens"] > 0 and st["shortfalls"] == 0
    assert r["over_tau"] == 0 and r["violations"] == 0 and r["count_mismatch"] == 0
    # what the certified recall holds at each step vs the fewest tokens an exact recall would hold;
    # the traffic (new fetches) is less than what is held: recalled tokens stay while they are useful
    assert 0.5 * r["oracle_recall_total"] <= r["recall_held_total"] <= 3 * r["oracle_recall_total"]
    assert st["recalled_tokens"] < r["recall_held_total"]
    for layer in range(2):
        c = cert.last[layer]
        assert (c.mass <= tau).all()


def _tiny_video_stream():
    from streamkv_lab.experiments.twotier import video_stream

    return video_stream(frames=12, layers=1)


def test_two_tier_against_the_others_at_matched_memory():
    stream = _tiny_video_stream()
    cfg = TwoTierConfig(policy="ring", sink=2, window=30, recall_slots=32, tau=0.05)
    r = run_two_tier(stream, cfg)
    c = r["caches"]
    from streamkv_lab.kinds import scored_kinds

    assert set(c) == {"two_tier", "ring", *scored_kinds(), "oracle", "per_chunk_oracle", "budget_only"}
    tt = c["two_tier"]
    assert tt["violations"] == 0 and tt["tightness_median"] < 1.5
    assert tt["device_bytes"] == tt["budget_kv_bytes"] + tt["recall_slot_bytes"] + tt["sketch_bytes"] + tt["policy_state_bytes"]
    # matched memory: the ring's K/V is the two-tier's device bytes, to within one token
    assert abs(c["ring"]["device_bytes"] - tt["device_bytes"]) <= r["token_bytes"]
    assert abs(c["oracle"]["memory_tokens"] - r["matched_memory_tokens"]) < 0.05 * r["matched_memory_tokens"]
    # recall brings back what the budget alone lost; full attention would be 0 error
    assert tt["error_mean"] < 0.5 * c["budget_only"]["error_mean"]
    assert c["oracle"]["error_mean"] < c["ring"]["error_mean"]
    # the per-chunk oracle holds the same tokens per head as the ring, chosen with the history in view
    assert c["per_chunk_oracle"]["memory_tokens"] == round(r["matched_memory_tokens"])
    assert c["per_chunk_oracle"]["error_mean"] < c["ring"]["error_mean"]
    assert r["ratios"]["ring_over_two_tier_mean"] == pytest.approx(c["ring"]["error_mean"] / tt["error_mean"])
    for name, res in c.items():
        assert math.isfinite(res["error_mean"]) and res["error_mean"] <= res["error_p99"] <= res["error_max"] or \
            res["error_p99"] < res["error_mean"] <= res["error_max"], name


def test_two_tier_equals_a_plain_cache_when_nothing_is_evicted():
    stream = _tiny_video_stream()
    T = stream.tokens
    r = run_two_tier(stream, TwoTierConfig(policy="ring", sink=2, window=T, recall_slots=8, tau=0.05))
    for name in ("two_tier", "ring", "budget_only"):
        assert r["caches"][name]["error_max"] < 1e-5, name
    assert r["caches"]["two_tier"]["recalled_tokens"] == 0


def test_causal_streams_are_causal():
    """A causal stream (the LLM case) through the two-tier path: the certifier hides the future."""
    g = torch.Generator().manual_seed(5)
    T, Hk, G = 48, 2, 3
    q = [torch.randn(1, T, Hk * G, D, generator=g)]
    k = [torch.randn(1, T, Hk, D, generator=g)]
    v = [torch.randn(1, T, Hk, D, generator=g)]
    s = Stream("causal", q, k, v, chunk=4, causal=True, scale=D ** -0.5)
    r = run_two_tier(s, TwoTierConfig(policy="ring", sink=1, window=11, recall_slots=16, tau=0.05, sketch_block=4))
    tt = r["caches"]["two_tier"]
    assert tt["violations"] == 0 and tt["rows_checked"] == T * Hk * G
    assert tt["error_mean"] < r["caches"]["budget_only"]["error_mean"]


def test_cli_real_writes_the_promised_json(tmp_path, capsys):
    out = tmp_path / "real.json"
    rc = main(["certify", "--real", "--datasets", "video", "--video-frames", "12", "--json", str(out),
               "--plot", str(tmp_path / "real.png")])
    assert rc == 0
    res = json.loads(out.read_text())
    caches = res["datasets"]["video"]["caches"]
    assert {"two_tier", "ring", "mass", "h2o", "oracle"} <= set(caches)
    keys = {"device_bytes", "error_mean", "error_p99", "error_max", "violations", "tightness_median",
            "tightness_p95", "recalled_tokens", "oracle_recall_tokens", "shortfalls", "ms_per_chunk"}
    for c in caches.values():
        assert keys <= set(c)
    assert caches["two_tier"]["violations"] == 0 and caches["ring"]["violations"] is None
    assert caches["two_tier"]["error_mean"] < caches["budget_only"]["error_mean"]
    assert len(res["datasets"]["video"]["sweep"]) == 2
    tiers = res["datasets"]["video"]["tier_sweep"]
    assert tiers and all(t.get("violations") == 0 or "too few" in t["skipped"] for t in tiers)
    assert {"per_chunk_oracle", "compressed_tier"} <= set(caches)
    assert caches["compressed_tier"]["h2d_bytes_per_chunk"] >= 0 and "h2d_self_forcing" in caches["compressed_tier"]
    assert (tmp_path / "real.png").stat().st_size > 10_000
    quarter = res["datasets"]["video"]["quarter"]["caches"]
    assert {"full", "ring", "tova", "tier_tova_nocert", "tier_tova_cert", "tier_ring_cert_recall"} <= set(quarter)
    assert all("skipped" in c or c["violations"] in (0, None) for c in quarter.values())
    out = capsys.readouterr().out
    assert "ring / two_tier error" in out and "at a quarter of the full cache's bytes" in out


def test_cli_real_runs_at_its_fewest_frames_and_refuses_one_fewer(tmp_path, capsys):
    """The smallest streams the checks accept run to the end (one frame fewer failed in the library,
    a traceback); one fewer is a usage error."""
    from streamkv.models.config import get_config
    from streamkv_lab.experiments.qkv import QKVConfig
    from streamkv_lab.experiments.twotier import least_frames
    from streamkv_lab.video.config import CONTEXT_FRAMES

    tpf, toy = QKVConfig().tokens_per_frame, get_config("toy")
    fewest = {"video": least_frames("video", tpf, tpf),
              "toy": max(CONTEXT_FRAMES + 1, least_frames("toy", toy.tokens_per_frame, toy.chunk_tokens))}
    fewest["toy"] += fewest["toy"] % toy.frames_per_chunk
    for name, n in fewest.items():
        step = 1 if name == "video" else toy.frames_per_chunk
        for frames, rc in ((n, 0), (n - step, 2)):
            argv = ["certify", "--real", "--datasets", name, f"--{name}-frames", str(frames),
                    "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")]
            assert main(argv) == rc, (name, frames)
    assert "Traceback" not in capsys.readouterr().err


def test_cli_real_fails_fast_on_bad_arguments(capsys):
    for argv in (["--datasets", "imagenet"], ["--lm-layers", "2,40"], ["--tokens", "1000", "--lm-chunk", "16"],
                 ["--video-frames", "0"]):
        assert main(["certify", "--real", *argv]) == 2, argv
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["ring", "tova"])
def test_two_tier_in_the_video_rollout(kind):
    """The DiT's rollout (every denoising step and the clean pass rewrite the chunk) with key sketches
    and certified recall: every certificate valid, recall used, the kernel equal to the certificate's
    float64 attention over what is held."""
    from streamkv_lab.experiments.certify import RunConfig, SummaryOptions, run_dit

    run = RunConfig(cache=kind, recall_tau=0.05, recall_slots=48, tau=0.05, summary=SummaryOptions(sketch_bits=8))
    r = run_dit(run, chunks=6)
    assert r["violations"] == 0 and r["count_mismatch"] == 0 and r["queries_checked"] > 10_000
    assert r["recalled_tokens"] > 0 and r["tightness_median"] < 1.2


def test_queries_after_the_write_equal_queries_with_it():
    """observe_queries (queries that arrive after the write, as in transformers) does what
    update(k, v, q) does: the same recall, the same outputs; refused outside an open span."""
    outs = {}
    for split in (False, True):
        g = torch.Generator().manual_seed(0)
        c = KVCache((1, 12, 2, 8), (1, 12, 2, 8), policy="ring", seq_dim=1, sink=2, window=10, chunk=4,
                    num_layers=1, recall_slots=8)
        cert = Certifier(c, sketch_bits=8, block_tokens=4, recall_tau=0.05)
        check = HistoryCheck(cert, tau=0.05)
        res = []
        for i in range(10):
            c.begin_chunk(i)
            q, k, v = (torch.randn(1, 4, 2, 8, generator=g) * 2 for _ in range(3))
            if split:
                read = c.layer(0).update(k, v)
                c.layer(0).observe_queries(q)
            else:
                read = c.layer(0).update(k, v, q)
            res.append(attend(q, read)[0])
            c.commit_chunk(i)
        assert check.result()["violations"] == 0 and cert.stats["recalled_tokens"] > 0
        outs[split] = torch.cat(res)
    assert torch.equal(outs[False], outs[True])
    with pytest.raises(RuntimeError, match="observe_queries\\(\\) needs an open span"):
        c.observe_queries(torch.zeros(1, 4, 2, 8), layer=0)


def test_compressed_tier_in_the_comparison():
    """``run_two_tier(tiers=...)``: the compressed tier fits the two-tier cache's device bytes,
    is checked (0 violations) and priced; the chosen run is the sweep's lowest mean error."""
    from streamkv_lab.experiments.tier import SELF_FORCING, TierConfig, self_forcing_h2d

    stream = _tiny_video_stream()
    cfg = TwoTierConfig(policy="tova", sink=2, window=46, recall_slots=48, tau=0.05)
    tiers = (TierConfig("int8", 0.5), TierConfig("int4", 0.5))
    r = run_two_tier(stream, cfg, tiers=tiers)
    c, sweep = r["caches"], r["tier_sweep"]
    assert [t["label"] for t in sweep] == [t.label() for t in tiers]
    for t in sweep:
        assert t["violations"] == 0
        assert t["device_bytes"] <= c["two_tier"]["device_bytes"] == t["budget_bytes"]
        assert t["device_bytes"] == t["tier1_kv_bytes"] + t["policy_state_bytes"] + t["tier2_bytes"] + \
            t["tier3_box_bytes_peak"]
        rate = t["recalled_tokens"] / (stream.tokens * stream.layers * stream.k[0].shape[2])
        assert t["h2d_self_forcing"] == self_forcing_h2d(rate)
    assert c["compressed_tier"] == min(sweep, key=lambda t: t["error_mean"])
    for t in sweep:  # where the certificate's distance from the truth comes from, every part >= 0
        lo = t["looseness"]
        assert set(lo) == {"evicted_mass_times_gap", "held_tiers_quantisation", "float32_rounding"}
        assert all(v["over_true_median"] >= 0 for v in lo.values())
        assert sum(v["dominant_share"] for v in lo.values()) == pytest.approx(1.0)
    s = SELF_FORCING
    h = self_forcing_h2d(1.0)  # recalling as many tokens as the chunk brings: one chunk's K/V of every layer
    assert h["h2d_bytes_per_chunk"] == 4680 * s["layers"] * s["heads"] * 2 * s["head_dim"] * s["bytes_per_element"]
    assert h["h2d_ms_per_chunk"] == pytest.approx(1e3 * h["h2d_bytes_per_chunk"] / 35e9)


def test_the_certificates_parts_add_up_to_it():
    """``_parts``: at each row's largest channel, the evicted mass times the gap, the held tiers'
    error and the output's rounding, over the true error, are the certificate's own terms."""
    from types import SimpleNamespace

    from streamkv_lab.experiments.tier import _looseness, _parts

    g = torch.Generator().manual_seed(0)
    mass, gap, held, eps = (torch.rand(1, 2, 3, *s, generator=g, dtype=torch.float64) for s in ((), (4,), (4,), (4,)))
    cert = SimpleNamespace(mass=mass, gap=gap, out_error=eps,
                           error=(mass.unsqueeze(-1) * gap + held + eps) * (1.0 + 2.0**-40))
    true = torch.tensor([[[0.5, 0.0, 2.0], [1.0, 0.25, 4.0]]], dtype=torch.float64)
    got = _parts(cert, true)
    c = cert.error.argmax(-1, keepdim=True)
    at = lambda x: x.gather(-1, c).squeeze(-1)  # noqa: E731
    ok = true > 0
    want = torch.stack([(mass * at(gap))[ok], at(held)[ok], at(eps)[ok]]) / true[ok]
    assert got.shape == (3, 5) and torch.allclose(got, want, rtol=1e-9, atol=0)  # held: + the 2^-40 finishing
    lo = _looseness([got])
    assert lo["held_tiers_quantisation"]["over_true_median"] == pytest.approx(float(want[1].median()))


def test_quarter_tier_timed_against_the_full_cache():
    """``run_quarter``: the full cache, the ring and TOVA at a quarter of its bytes and the compressed
    tier at the same bytes, uncertified and certified, in one run; the certified run has 0
    violations and the uncertified one certifies nothing; the tier's bytes stay within the quarter."""
    from streamkv_lab.experiments.tier import TierConfig, run_quarter
    from streamkv_lab.experiments.twotier import _full_attention, _probs, video_stream

    s = video_stream(frames=32, layers=1)
    fulls, vranges = zip(*(_full_attention(s, 0),))
    cfgs = (TierConfig("int8", 0.3, certify=False, tau=None), TierConfig("int8", 0.5, tau=0.01))
    r = run_quarter(s, sink=2, fulls=list(fulls), vranges=list(vranges), probs=_probs(s), configs=cfgs)
    c = r["caches"]
    assert set(c) == {"full", "ring", "tova", "tier_tova_nocert", "tier_tova_cert_recall"}
    assert c["full"]["error_mean"] < 1e-5 and r["ratios"]["full_ms_over_full"] == 1.0
    nc, ce = c["tier_tova_nocert"], c["tier_tova_cert_recall"]
    assert nc["violations"] is None and nc["certified_steps"] == 0 and nc["tightness_median"] is None
    assert ce["violations"] == 0 and ce["certified_steps"] == s.tokens // s.chunk and ce["recalled_tokens"] > 0
    for t in (nc, ce):
        assert t["device_bytes"] <= r["budget_bytes"] == r["full_bytes"] / 4
        assert r["ratios"][f"tier_tova_{'nocert' if t is nc else 'cert_recall'}_ms_over_full"] > 0
    assert nc["error_mean"] < c["tova"]["error_mean"]  # the evicted history attended from tier 2
