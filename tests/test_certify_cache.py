"""Certified caches end to end: every certificate of a rollout checked against the whole-history
float64 reference, with the ring and the mass-budget cache watched by a certifier, summaries
merged, recall into the storage's recall slots, and the tiny DiT."""

import pytest
import torch

from kinds import WINDOW
from streamkv import CacheSet, KVCache
from streamkv.attention import attend
from streamkv.certify import Certifier, HistoryCheck
from streamkv_lab.env import threads
from streamkv_lab.experiments.certify import RunConfig, SummaryOptions, run_dit, run_synthetic
from streamkv_lab.experiments.qkv import QKVConfig, synthesize_qkv

S, W, C, B, H, D = 2, 12, 4, 2, 3, 8


@pytest.fixture(autouse=True)
def _one_thread():
    with threads(1):
        yield


def _cache(kind, *, check=None, layers=2, recall_slots=0, device="cpu", **cert_kw):
    """A cache of ``kind`` watched by a certifier (and, with ``check``, a HistoryCheck built with
    those keyword arguments). Returns the cache; its certifier is ``cache.certifier``."""
    params = {"tau": 0.2} if kind == "mass" else {}
    cache = KVCache((B, S + W, H, D), (B, S + W, H, D + 1), policy=kind, seq_dim=1, sink=S, window=W, chunk=C,
                    num_layers=layers, recall_slots=recall_slots, device=device, **params)
    cache.certifier = Certifier(cache, **cert_kw)
    cache.check = HistoryCheck(cache.certifier, **check) if check is not None else None
    return cache


def _drive(cache, chunks, gen, *, scale=1.5, reopen_every=0):
    for c in range(chunks):
        cache.begin_chunk(c)
        for rep in range(2 if reopen_every and c % reopen_every == 0 else 1):
            if rep:  # reopen the same chunk: its slots are written again
                cache.commit_chunk(c)
                cache.begin_chunk(c)
            for layer in range(cache.num_layers):
                k = torch.randn(B, C, H, D, generator=gen) * scale
                v = torch.randn(B, C, H, D + 1, generator=gen)
                q = torch.randn(B, C, H, D, generator=gen) * scale
                out, _ = attend(q, cache.layer(layer).update(k, v, q))
                cert = cache.certifier.last[layer]
                ref, _ = attend(q, cache.read(layer))
                assert torch.equal(out, ref)
                # the certificate's float64 kept output is the attention output up to float32 rounding
                assert (out.transpose(1, 2).double() - cert.out_kept).abs().max() < 1e-4
        cache.commit_chunk(c)


@pytest.mark.parametrize("kind", ["ring", "mass", "h2o", "chronological"])
@pytest.mark.parametrize("summary", [
    dict(),
    dict(events_per_block=3),
    dict(pool_events=3, block_tokens=4, box_dtype=torch.float16),
    dict(pool_events=2, block_tokens=3, box_dtype=torch.bfloat16),
])
def test_random_streams_have_no_violations(kind, summary):
    cache = _cache(kind, check=dict(check_storage=True), **summary)
    _drive(cache, 20, torch.Generator().manual_seed(0), reopen_every=7)
    r = cache.check.result()
    assert r["violations"] == 0 and r["count_mismatch"] == 0 and r["storage_mismatch"] == 0
    assert r["duplicate_positions"] == 0 and r["kept_outside_history"] == 0
    assert r["nontrivial"] > 600


@pytest.mark.parametrize("kind", ["ring", "mass"])
def test_merging_bounds_summary_memory_and_stays_valid(kind):
    cache = _cache(kind, check={}, events_per_block=1, max_blocks=4)
    cert = cache.certifier
    gen = torch.Generator().manual_seed(1)
    peak = 0
    for c in range(40):
        _drive_one(cache, c, gen)
        peak = max(peak, max(s.nb for s in cert.summaries))
    r = cache.check.result()
    assert peak <= 4
    assert sum(s.merges for s in cert.summaries) > 10
    assert r["violations"] == 0 and r["count_mismatch"] == 0 and r["nontrivial"] > 1500
    # summary memory is flat while the offloaded K/V keeps growing
    m = cert.memory()
    assert m["summary_bytes"] <= cache.num_layers * cert.summaries[0].nbytes
    assert m["offloaded_kv_bytes"] > 20 * m["summary_bytes"]


def _drive_one(cache, c, gen, scale=1.5):
    cache.begin_chunk(c)
    for layer in range(cache.num_layers):
        k = torch.randn(B, C, H, D, generator=gen, device=cache.device) * scale
        v = torch.randn(B, C, H, D + 1, generator=gen, device=cache.device)
        q = torch.randn(B, C, H, D, generator=gen, device=cache.device) * scale
        attend(q, cache.layer(layer).update(k, v, q))
    cache.commit_chunk(c)


def test_merging_pooled_summaries_stays_valid():
    cache = _cache("ring", check={}, pool_events=2, block_tokens=4, max_blocks=6)
    gen = torch.Generator().manual_seed(2)
    for c in range(30):
        _drive_one(cache, c, gen)
    r = cache.check.result()
    assert sum(s.merges for s in cache.certifier.summaries) > 0
    assert r["violations"] == 0 and r["count_mismatch"] == 0


@pytest.mark.parametrize("kind", ["ring", "mass"])
@pytest.mark.parametrize("summary", [dict(), dict(pool_events=3, block_tokens=4, max_blocks=8)])
def test_recall_keeps_every_query_under_tau(kind, summary):
    """With room to recall, every row's certified error is at most tau times its value gap
    (m_hat <= tau), the certificates stay valid, and recalled tokens are what the history holds."""
    tau = 0.1
    cache = _cache(kind, check=dict(check_storage=True, tau=tau), recall_tau=tau, recall_slots=200, **summary)
    _drive(cache, 24, torch.Generator().manual_seed(3))
    r = cache.check.result()
    st = cache.certifier.stats
    assert st["recall_events"] > 0 and st["recalled_tokens"] > 0 and st["shortfalls"] == 0
    assert r["over_tau"] == 0
    assert r["violations"] == 0 and r["count_mismatch"] == 0 and r["storage_mismatch"] == 0
    assert r["duplicate_positions"] == 0
    for layer in range(cache.num_layers):
        cert = cache.certifier.last[layer]
        assert (cert.mass <= tau).all() and (cert.error <= tau * cert.gap).all()


def test_recall_shortfall_is_reported_not_hidden():
    tau = 0.01
    cache = _cache("ring", check=dict(tau=tau), recall_tau=tau, recall_slots=4)
    _drive(cache, 16, torch.Generator().manual_seed(4))
    r = cache.check.result()
    assert cache.certifier.stats["shortfalls"] > 0 and r["over_tau"] > 0
    assert r["violations"] == 0  # still a valid certificate, just above tau


def test_certificate_step_does_not_synchronise(monkeypatch):
    """The certificate is device work only: no .item(), .tolist(), bool(tensor) or host copies."""
    cache = _cache("mass", pool_events=2, block_tokens=4)
    gen = torch.Generator().manual_seed(5)
    for c in range(6):
        _drive_one(cache, c, gen)
    cache.begin_chunk(6)
    cache.write(torch.randn(B, C, H, D, generator=gen), torch.randn(B, C, H, D + 1, generator=gen), layer=0)
    q = torch.randn(B, C, H, D, generator=gen)

    def boom(*a, **k):
        raise AssertionError("host synchronisation in the certificate step")

    for name in ("item", "tolist", "__bool__", "cpu", "numpy", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    cert = cache.certifier.certificate(0, q)
    monkeypatch.undo()
    assert cert.mass.shape == (B, H, C) and bool((cert.mass > 0).any())


def test_synthetic_rollouts_ring_and_mass():
    qkv = QKVConfig(frames=24, keyframes=(0, 8, 16), heads=4, layers=1)
    for cache in ("ring", "mass"):
        r = run_synthetic(RunConfig(cache=cache, summary=SummaryOptions(pool_events=4, block_tokens=32)), qkv,
                          check_storage=True)
        assert r["violations"] == 0 and r["count_mismatch"] == 0 and r["storage_mismatch"] == 0
        assert r["nontrivial"] > 1000
        assert r["summary_bytes_ratio"] <= 0.03
        assert r["tightness_median"] >= 1 and r["kernel_vs_float64_max"] < 1e-4


@pytest.mark.parametrize("cache", ["ring", "mass"])
def test_dit_rollouts_with_and_without_recall(cache):
    r = run_dit(RunConfig(cache=cache), batch=1, chunks=6, check_storage=True)
    assert r["violations"] == 0 and r["count_mismatch"] == 0 and r["storage_mismatch"] == 0
    assert r["nontrivial"] > 1000
    rr = run_dit(RunConfig(cache=cache, recall_tau=0.1, recall_slots=192), batch=1, chunks=6, check_storage=True)
    assert rr["violations"] == 0 and rr["over_tau"] == 0 and rr["recall_events"] > 0 and rr["recall_shortfalls"] == 0


def test_synthetic_stream_is_deterministic_and_structured():
    a = synthesize_qkv(QKVConfig(frames=8, keyframes=(0, 4), layers=1), seed=3)
    b = synthesize_qkv(QKVConfig(frames=8, keyframes=(0, 4), layers=1), seed=3)
    assert torch.equal(a.k, b.k) and torch.equal(a.q, b.q) and torch.equal(a.v, b.v)
    assert a.k.dtype == torch.float32 and a.sinks.sum() == 4
    assert (a.v.abs() < 1).all()


def test_recall_slots_are_a_storage_option_of_the_cache_set():
    cs = CacheSet("ring", k_shape=(1, 14, 2, 4), v_shape=(1, 14, 2, 4), seq_dim=1, sink=2, window=12, chunk=4,
                  num_layers=2, branches=("cond", "uncond"), recall_slots=8)
    assert cs._k.shape == (2, 2, 1, 22, 2, 4)
    c = cs["cond"]
    assert c.keys(0).data_ptr() == cs._k[0, 0].data_ptr() and c.keys(0).shape[1] == 22
    assert c.layer_slot_positions(0).shape == (2, 22) and c.slot_positions.shape == (2, 2, 22)
    assert c.occupancy() == "mask" and c.chronological_refusal is not None


def test_bad_input():
    with pytest.raises(ValueError, match="recall_slots"):
        _cache("ring", recall_tau=0.1)
    no_heads = KVCache((S + W, D), (S + W, D), policy="ring", seq_dim=0, sink=S, window=W, chunk=C)
    with pytest.raises(ValueError, match="head dimension"):
        Certifier(no_heads)
    with pytest.raises(ValueError, match="tau"):
        _cache("ring", recall_tau=1.5, recall_slots=4)
    with pytest.raises(ValueError, match="pool_events"):
        _cache("ring", pool_events=0)
    with pytest.raises(TypeError, match="cache must be a KVCache"):
        Certifier("ring")


def test_reset_forgets_summaries_store_and_recall():
    cache = _cache("ring", check=dict(tau=0.1), recall_tau=0.1, recall_slots=64)
    cert = cache.certifier
    gen = torch.Generator().manual_seed(6)
    for c in range(8):
        _drive_one(cache, c, gen)
    assert cert.summaries[0].nb > 0 and cert.store.entries and cert.recall_slots_in_use() > 0
    cache.reset()
    assert cert.summaries[0].nb == 0 and not cert.store.entries and cert.recall_slots_in_use() == 0
    assert bool((cache.slot_positions < 0).all()) and cache.keys(0).abs().sum() == 0 and cache.keys(1).abs().sum() == 0
    for c in range(8):
        _drive_one(cache, c, gen)
    assert cache.check.result()["violations"] == 0 and cache.check.result()["count_mismatch"] == 0


@pytest.mark.parametrize("kind", WINDOW)
def test_a_detached_recaller_empties_its_recall_slots(kind):
    """Nothing keeps recalled tokens current once their owner is gone: they leave the reads, which
    are then the policy's own tokens (what a cache without recall slots fed the same stream reads)."""
    cache = _cache(kind, recall_tau=0.1, recall_slots=64, layers=1)
    plain = KVCache((B, S + W, H, D), (B, S + W, H, D + 1), policy=kind, seq_dim=1, sink=S, window=W, chunk=C)
    gen = torch.Generator().manual_seed(6)
    for c in range(8):
        k, v, q = (torch.randn(B, C, H, d, generator=gen) * 1.5 for d in (D, D + 1, D))
        for x in (cache, plain):
            x.begin_chunk(c)
            attend(q, x.update(k, v, q))
            x.commit_chunk(c)
    assert cache.certifier.recall_slots_in_use() > 0
    cap = cache.layout.capacity
    assert torch.equal(cache.slot_positions[..., :cap], plain.slot_positions)
    cache.remove_observer(cache.certifier)
    assert bool((cache.slot_positions[..., cap:] < 0).all()) and cache.storage.recall_owner is None
    q = torch.randn(B, C, H, D, generator=gen)
    cache.begin_chunk(8)
    plain.begin_chunk(8)
    k, v = torch.randn(B, C, H, D, generator=gen), torch.randn(B, C, H, D + 1, generator=gen)
    out, _ = attend(q, cache.update(k, v, q))
    ref, _ = attend(q, plain.update(k, v, q))
    assert (out - ref).abs().max() < 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned host memory, non_blocking copies)")
def test_cuda_offload_is_pinned_and_recall_is_valid():  # pragma: no cover - GPU only
    cache = _cache("ring", check=dict(tau=0.1, check_storage=True), layers=1, recall_tau=0.1, recall_slots=200,
                   device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for c in range(16):
        _drive_one(cache, c, gen)
    assert all(e.keys.is_pinned() for e in cache.certifier.store.entries.values())
    r = cache.check.result()
    assert r["violations"] == 0 and r["over_tau"] == 0


def test_the_reference_catches_a_summary_that_misses_tokens(monkeypatch):
    """Control: drop every third eviction event from the summaries; the whole-history check must
    flag the bookkeeping and find violations (so the zero counts above can fail)."""
    seen = {"n": 0}
    orig = Certifier._record

    def lossy(self, captured):
        seen["n"] += 1
        if seen["n"] % 3:
            orig(self, captured)

    monkeypatch.setattr(Certifier, "_record", lossy)
    cache = _cache("ring", check={})
    _drive(cache, 16, torch.Generator().manual_seed(7), scale=3.0)
    r = cache.check.result()
    assert r["count_mismatch"] > 0 and r["violations"] > 0
