"""The streaming-budget recorder against independent full-matrix computations; the mass
cache's guarantee on its scoring queries; the oracle's dominance; the ``budget`` CLI."""

import json
import math

import pytest
import torch

from streamkv.attention import attend
from streamkv.caches import KVCache
from streamkv_lab.budget import (
    Recorder,
    SyntheticHeads,
    matched_h2o_budget,
    matched_ring_window,
    run_dit_cache,
    run_synthetic_cache,
    summarize,
    synthetic_qkv,
)
from streamkv_lab.cli import main

S, C, H, D, DV, B = 2, 3, 2, 4, 5, 2
f64 = torch.float64


def _stream(chunks, seed, layers=1, scale=2.0):
    """Per layer: q, k ``[B, T, H, D]``, v ``[B, T, H, DV]`` (float64)."""
    g = torch.Generator().manual_seed(seed)
    T = chunks * C
    out = []
    for _ in range(layers):
        out.append((torch.randn(B, T, H, D, generator=g, dtype=f64) * scale,
                    torch.randn(B, T, H, D, generator=g, dtype=f64) * scale,
                    torch.randn(B, T, H, DV, generator=g, dtype=f64)))
    return out


def _make(kind, window, layout, layers, oracle_taus=(), **kw):
    """A cache of ``kind`` and the recorder observing it."""
    cap = S + window
    if layout == "bthd":
        shapes, seq = ((B, cap, H, D), (B, cap, H, DV)), 1
    else:
        shapes, seq = ((B, H, cap, D), (B, H, cap, DV)), 2
    cache = KVCache(*shapes, policy=kind, seq_dim=seq, sink=S, window=window, chunk=C, num_layers=layers, dtype=f64,
                    **kw)
    return cache, Recorder(cache, oracle_taus=oracle_taus)


def _heads_positions(cache, layer):
    pos = cache.layer_slot_positions(layer)
    if pos.dim() == 1:
        pos = pos.expand(H, -1)
    return [sorted(int(p) for p in pos[h].tolist() if p >= 0) for h in range(H)]


def _drive(cache, data, layout):
    """Run every chunk; return per chunk, per layer, the resident positions before and after the commit."""
    seen = []
    chunks = data[0][0].shape[1] // C
    for c in range(chunks):
        sl = slice(c * C, (c + 1) * C)
        cache.begin_chunk(c)
        for layer, (q, k, v) in enumerate(data):
            qc, kc, vc = q[:, sl], k[:, sl], v[:, sl]
            if layout == "bhtd":
                qc, kc, vc = (x.transpose(1, 2).contiguous() for x in (qc, kc, vc))
            attend(qc, cache.layer(layer).update(kc, vc, qc))
        pre = [_heads_positions(cache, layer) for layer in range(len(data))]
        cache.commit_chunk(c)
        post = [_heads_positions(cache, layer) for layer in range(len(data))]
        seen.append((pre, post))
    return seen


def _attend(q, k, v, idx):
    """Softmax attention of ``q [n, D]`` over the keys ``idx`` of ``k [T, D]``; weights ``[n, T]`` (0 off idx), out."""
    s = q @ k[idx].T / math.sqrt(D)
    p_sub = torch.softmax(s, dim=-1)
    p = torch.zeros(q.shape[0], k.shape[0], dtype=f64)
    p[:, idx] = p_sub
    return p, p_sub @ v[idx]


def _vrange(v, idx):
    sub = v[idx]
    return float((sub.amax(0) - sub.amin(0)).max())


def _greedy_oracle(p_row, n, tau, chunk_start):
    """Brute-force per-query mass budget: protected (sinks, the newest chunk) first, then by mass
    descending until the kept mass reaches 1 - tau."""
    protected = [j for j in range(n) if j < S or j >= chunk_start]
    rest = sorted((j for j in range(n) if j not in protected), key=lambda j: (-float(p_row[j]), j))
    keep = list(protected)
    while float(p_row[keep].sum()) < 1 - tau and rest:
        keep.append(rest.pop(0))
    return sorted(keep)


CASES = [
    ("mass", 10, "bthd", 2, dict(tau=0.2, oracle_taus=(0.2,))),
    ("mass", 9, "bhtd", 1, dict(tau=0.1)),
    ("ring", 7, "bhtd", 1, dict()),
    ("h2o", 12, "bthd", 2, dict(budget=S + C + 3)),
    ("tova", 12, "bthd", 1, dict(budget=S + C + 3)),
]


@pytest.mark.parametrize("kind,window,layout,layers,kw", CASES)
def test_records_match_independent_full_matrix_computation(kind, window, layout, layers, kw):
    chunks = 9
    data = _stream(chunks, seed=window + layers, layers=layers)
    cache, recorder = _make(kind, window, layout, layers, **kw)
    seen = _drive(cache, data, layout)
    assert [(r.chunk, r.layer) for r in recorder.records] == [(c, l) for c in range(chunks) for l in range(layers)]
    evicted = 0
    for rec in recorder.records:
        c, layer = rec.chunk, rec.layer
        q, k, v = data[layer]
        end = (c + 1) * C
        pre, post = seen[c][0][layer], seen[c][1][layer]
        assert rec.history == end
        for h in range(H):
            assert rec.resident[h] == len(pre[h]) and rec.kept[h] == len(post[h])
            assert rec.evicted[h] == len(set(pre[h]) - set(post[h]))
            evicted += int(rec.evicted[h])
            gone = sorted(set(pre[h]) - set(post[h]))
            for b in range(B):
                qq, kk, vv = q[b, c * C:end, h], k[b, :end, h], v[b, :end, h]
                p_full, o_full = _attend(qq, kk, vv, list(range(end)))
                p_pre, o_pre = _attend(qq, kk, vv, pre[h])
                p_post, o_post = _attend(qq, kk, vv, post[h])
                cols = slice(b * C, (b + 1) * C)
                want = {
                    "dropped": p_pre[:, gone].sum(-1),
                    "kept_mass_evict": p_pre[:, post[h]].sum(-1),
                    "err_evict": (o_post - o_pre).abs().amax(-1),
                    "missing": 1 - p_full[:, pre[h]].sum(-1),
                    "mass_resident": p_full[:, pre[h]].sum(-1),
                    "err_attend": (o_pre - o_full).abs().amax(-1),
                    "missing_post": 1 - p_full[:, post[h]].sum(-1),
                    "err_post": (o_post - o_full).abs().amax(-1),
                    "range_resident": torch.full((C,), _vrange(vv, pre[h]), dtype=f64),
                    "range_history": torch.full((C,), _vrange(vv, list(range(end))), dtype=f64),
                }
                if c > 0:
                    prev_gone = sorted(set(seen[c - 1][0][layer][h]) - set(pre[h]))
                    want["holdout"] = p_full[:, prev_gone].sum(-1)
                    assert rec.holdout_tokens[h] == len(prev_gone)
                    evicted += len(prev_gone)  # a ring evicts at begin_chunk, not at the commit
                else:
                    assert rec.holdout is None
                for name, expected in want.items():
                    got = getattr(rec, name)[h, cols]
                    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12, msg=f"{name} chunk {c} layer {layer}")
                for tau in kw.get("oracle_taus", ()):
                    o = rec.oracle[tau]
                    for i in range(C):
                        keep = _greedy_oracle(p_full[i], end, tau, c * C)
                        assert o["count"][h, b * C + i] == len(keep)
                        p_k, o_k = _attend(qq[i:i + 1], kk, vv, keep)
                        assert abs(float(o["kept_mass"][h, b * C + i]) - float(p_full[i, keep].sum())) <= 1e-12
                        assert abs(float(o["err"][h, b * C + i]) - float((o_k[0] - o_full[i]).abs().max())) <= 1e-12
    assert evicted > 0
    # the shadow holds exactly the stream
    for layer, (q, k, v) in enumerate(data):
        torch.testing.assert_close(recorder._hk[layer], k.transpose(1, 2), rtol=0, atol=0)
        torch.testing.assert_close(recorder._hv[layer], v.transpose(1, 2), rtol=0, atol=0)


def _checked(records, tau):
    """(kept mass, error, bound) of the scoring queries of overflow-free (step, layer, head)s."""
    km, err, bound = [], [], []
    for r in records:
        ok = ~r.overflow
        km.append(r.kept_mass_evict[ok].flatten())
        err.append(r.err_evict[ok].flatten())
        bound.append((tau * r.range_resident)[ok].flatten())
    return torch.cat(km), torch.cat(err), torch.cat(bound)


@pytest.mark.parametrize("tau,scale,seed", [(0.3, 2.0, 1), (0.1, 3.0, 2), (0.02, 4.0, 3)])
def test_scoring_queries_keep_their_mass_and_stay_within_the_bound(tau, scale, seed):
    data = _stream(14, seed=seed, layers=2, scale=scale)
    cache, recorder = _make("mass", 15, "bthd", 2, tau=tau)
    _drive(cache, data, "bthd")
    km, err, bound = _checked(recorder.records, tau)
    assert km.numel() > 0 and sum(int(r.evicted.sum()) for r in recorder.records) > 0
    assert (km >= 1 - tau).all()
    assert (err <= bound).all()
    s = summarize(recorder.records)
    assert s["scoring"]["within_bound"] and s["scoring"]["violations"] == 0
    assert s["scoring"]["checked"] == km.numel()
    # the check can fail: the same records read against a budget 10x tighter violate it
    tight = tau / 10
    for r in recorder.records:
        r.tau = tight
    want = sum(int((((r.err_evict > tight * r.range_resident) | (r.dropped > tight))
                    & ~r.overflow.unsqueeze(-1)).sum()) for r in recorder.records)
    s = summarize(recorder.records)["scoring"]
    assert want > 0 and s["violations"] == want and not s["within_bound"]


def test_a_tau_below_rounding_is_checked_on_the_dropped_mass():
    """tau = 1e-300: the cache evicts only tokens of no mass, and the check reads the dropped mass
    itself (1 - the kept sum carried that sum's ~1e-16 rounding: hundreds of false violations)."""
    data = _stream(14, seed=1, layers=2, scale=2.0)
    cache, recorder = _make("mass", 15, "bthd", 2, tau=1e-300)
    _drive(cache, data, "bthd")
    assert any(float(r.kept_mass_evict.min()) < 1.0 for r in recorder.records)  # the kept sums do round
    s = summarize(recorder.records)["scoring"]
    assert s["checked"] > 0 and s["violations"] == 0 and s["within_bound"]


def test_overflow_steps_are_flagged_and_excluded():
    data = _stream(8, seed=5, layers=1, scale=0.1)  # diffuse attention: tau frees almost nothing
    cache, recorder = _make("mass", 2 * C, "bthd", 1, tau=0.01)
    _drive(cache, data, "bthd")
    flagged = [r for r in recorder.records if r.overflow.any()]
    assert flagged
    assert min(float(r.kept_mass_evict[r.overflow].min()) for r in flagged) < 1 - 0.01
    s = summarize(recorder.records)
    assert s["overflow_steps"] == sum(int(r.overflow.sum()) for r in recorder.records)
    assert s["scoring"]["within_bound"]


def test_synthetic_heads_guarantee_and_oracle_dominance():
    spec = SyntheticHeads()
    qkv = synthetic_qkv(spec, seed=0)
    n = spec.base.tokens
    # the embedding reproduces the generator's logits exactly enough to be its attention
    from streamkv_lab.experiments.synthetic import synthesize

    s0 = synthesize(spec.configs()[0], 0)
    torch.testing.assert_close(qkv[0][:, 0] @ qkv[1][:, 0].T / math.sqrt(n), s0.logits, rtol=0, atol=1e-12)
    tau = 0.05
    rec = run_synthetic_cache("mass", qkv, sink=2, window=256, chunk=8, tau=tau, oracle_taus=(tau,))
    km, err, bound = _checked(rec.records, tau)
    assert km.numel() == (n // 8) * 8 * 4 and (km >= 1 - tau).all() and (err <= bound).all()
    _assert_oracle_dominates(rec.records, tau)
    s = summarize(rec.records)
    assert s["oracle"][tau]["within_bound"]


def _assert_oracle_dominates(records, tau):
    """Per query: the oracle keeps mass >= 1 - tau; wherever the streaming cache's resident set
    holds mass >= 1 - tau (full history), the oracle keeps no more tokens than it."""
    compared = 0
    for r in records:
        o = r.oracle[tau]
        assert (o["kept_mass"] >= 1 - tau).all()
        assert (o["err"] <= tau * r.range_history).all()
        reached = r.mass_resident >= 1 - tau
        resident = r.resident.unsqueeze(-1).expand_as(o["count"])
        assert (o["count"][reached] <= resident[reached]).all()
        compared += int(reached.sum())
    assert compared > 0


def test_tiny_dit_through_the_rollout_with_a_recorder():
    tau = 0.1
    rec = run_dit_cache("mass", chunks=6, window_frames=6, tau=tau, oracle_taus=(tau,))
    cache = rec.cache
    assert len(rec.records) == 6 * cache.num_layers
    km, err, bound = _checked(rec.records, tau)
    assert (km >= 1 - tau).all() and (err <= bound).all()
    _assert_oracle_dominates(rec.records, tau)
    # the shadow agrees with every resident slot of the live cache
    for layer in range(cache.num_layers):
        pos, keys = cache.layer_slot_positions(layer), cache.keys(layer)  # [H, cap], [B, cap, H, D]
        for h in range(pos.shape[0]):
            for s in range(pos.shape[1]):
                if pos[h, s] >= 0:
                    assert torch.equal(rec._hk[layer][0, h, int(pos[h, s])], keys[0, s, h].double())
    ring = run_dit_cache("ring", chunks=6)
    s = summarize(ring.records)
    assert s["memory"]["peak"] == ring.cache.layout.capacity and s["scoring"].get("within_bound") is None


@pytest.mark.parametrize("kind", ["mass", "ring"])
def test_commit_without_queries_refuses_and_changes_nothing(kind):
    cache, rec = _make(kind, 10, "bthd", 1, **({"tau": 0.2} if kind == "mass" else {}))
    (q, k, v), = _stream(2, seed=9)
    cache.begin_chunk(0)
    attend(q[:, :C], cache.update(k[:, :C], v[:, :C]))  # attention, but the recorder never saw the queries
    pos = cache.slot_positions.clone()
    with pytest.raises(RuntimeError, match=r"recorder: no queries for chunk 0 in layer\(s\) \[0\]"):
        cache.commit_chunk(0)
    assert torch.equal(pos, cache.slot_positions) and rec.records == [] and cache.open_chunk == 0
    cache.update(k[:, :C], v[:, :C], q[:, :C])
    cache.commit_chunk(0)
    assert len(rec.records) == 1


def test_matched_baselines_are_the_closest():
    for target in (7.0, 20.5, 33.3):
        w, m = matched_ring_window(target, sink=2, chunk=4, chunks=10)
        means = {ww: sum(min((c + 1) * 4, 2 + ww) for c in range(10)) / 10 for ww in range(4, 41)}
        assert m == means[w] and all(abs(m - target) <= abs(x - target) for x in means.values())
        b, mb = matched_h2o_budget(target, sink=2, chunk=4, chunks=10, max_budget=30)
        mbs = {bb: sum(min((c + 1) * 4, bb + 4) for c in range(10)) / 10 for bb in range(6, 31)}
        assert mb == mbs[b] and all(abs(mb - target) <= abs(x - target) for x in mbs.values())
    w, _ = matched_ring_window(100.0, sink=16, chunk=32, chunks=16, step=16)
    assert w % 16 == 0 and w >= 32


def test_cli_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "b.json", tmp_path / "plots" / "b.png"
    rc = main(["budget", "--json", str(out), "--plot", str(png), "--syn-taus", "0.1", "--dit-taus", "0.2",
               "--dit-chunks", "3", "--dit-window-frames", "6", "--query-scale", "0"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert {"config", "scope", "synthetic", "dit", "versions"} <= data.keys()
    assert data["config"]["syn_taus"] == [0.1] and data["config"]["dit_chunks"] == 3
    sections = [data["synthetic"], *data["dit"]["sections"]]
    assert len(data["dit"]["sections"]) == 2  # as configured + capacity variant; no query-scale variant
    for sec in sections:
        for g in sec["groups"]:
            assert [r["policy"] for r in g["rows"]] == ["mass", "window", "h2o", "window@peak", "h2o@peak", "oracle"]
            for r in g["rows"]:
                assert all(isinstance(r[k], float) and math.isfinite(r[k])
                           for k in ("memory_mean", "memory_peak", "err_mean", "err_p95", "err_max"))
        for s in sec["mass"]:
            assert s["scoring"]["within_bound"] is True
            assert {"max", "mean", "p95", "tokens_mean", "over_tau"} <= s["holdout"].keys()
            assert set(s["oracle"]) == {str(s["tau"])}
            assert len(s["per_head"]) == (4 if sec is data["synthetic"] else 8)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "scope" in printed and "holdout" in printed and "error vs memory" in printed


def test_cli_says_which_guarantee_failed_when_it_exits_1(tmp_path, capsys, monkeypatch):
    """A failed tau check exits 1 naming the section and tau on stderr (it exited 1 silently)."""
    import streamkv_lab.budget as budget

    real = budget.run_streaming_budget

    def failing(*args, **kwargs):
        result = real(*args, **kwargs)
        result["synthetic"]["mass"][0]["scoring"]["within_bound"] = False
        return result

    monkeypatch.setattr(budget, "run_streaming_budget", failing)
    rc = main(["budget", "--syn-taus", "0.1", "--dit-taus", "0.2", "--dit-chunks", "2", "--dit-window-frames", "4",
               "--query-scale", "0", "--json", str(tmp_path / "b.json")])
    err = capsys.readouterr().err
    assert rc == 1 and "the mass cache's guarantee failed in synthetic tau=0.1" in err


def test_cli_rejects_bad_arguments(capsys):
    assert main(["budget", "--dit-chunks", "1"]) == 2
    assert "--dit-chunks must be in [2, 32]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["budget", "--syn-taus", "0.1,1.5"])
