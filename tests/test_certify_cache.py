"""Certified caches end to end: every certificate of a rollout checked against the whole-history
float64 reference, with the ring and the mass-budget cache, summaries merged, recall on, and
the tiny DiT."""

import pytest
import torch

from streamkv.attention import attend
from streamkv.certify import CertifiedCacheSet, CertifiedMassCache, CertifiedRingCache, HistoryCheck, certified_attend
from streamkv.lab.experiments.certify import RunConfig, SummaryOptions, run_dit, run_synthetic
from streamkv.lab.experiments.qkv import QKVConfig, synthesize_qkv
from streamkv.lab.experiments.pareto import single_thread

S, W, C, B, H, D = 2, 12, 4, 2, 3, 8


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


def _cache(cls, *, monitor, layers=2, **kw):
    if cls is CertifiedMassCache:
        kw.setdefault("tau", 0.2)
    return cls((B, S + W, H, D), (B, S + W, H, D + 1), seq_dim=1, sink=S, window=W, chunk=C, num_layers=layers,
               monitor=monitor, **kw)


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
                cache.write(k, v, layer=layer)
                out, _, cert = certified_attend(q, cache.layer(layer))
                ref, _ = attend(q, cache.layer(layer))
                assert torch.equal(out, ref)
                # the certificate's float64 kept output is the attention output up to float32 rounding
                assert (out.transpose(1, 2).double() - cert.out_kept).abs().max() < 1e-4
        cache.commit_chunk(c)


@pytest.mark.parametrize("cls", [CertifiedRingCache, CertifiedMassCache])
@pytest.mark.parametrize("summary", [
    dict(),
    dict(events_per_block=3),
    dict(pool_events=3, block_tokens=4, box_dtype=torch.float16),
    dict(pool_events=2, block_tokens=3, box_dtype=torch.bfloat16),
])
def test_random_streams_have_no_violations(cls, summary):
    mon = HistoryCheck(check_storage=True)
    cache = _cache(cls, monitor=mon, **summary)
    _drive(cache, 20, torch.Generator().manual_seed(0), reopen_every=7)
    r = mon.result()
    assert r["violations"] == 0 and r["count_mismatch"] == 0 and r["storage_mismatch"] == 0
    assert r["duplicate_positions"] == 0 and r["kept_outside_history"] == 0
    assert r["nontrivial"] > 600


@pytest.mark.parametrize("cls", [CertifiedRingCache, CertifiedMassCache])
def test_merging_bounds_summary_memory_and_stays_valid(cls):
    mon = HistoryCheck()
    cache = _cache(cls, monitor=mon, events_per_block=1, max_blocks=4)
    gen = torch.Generator().manual_seed(1)
    peak = 0
    for c in range(40):
        _drive_one(cache, c, gen)
        peak = max(peak, max(s.nb for s in cache.summaries))
    r = mon.result()
    assert peak <= 4
    assert sum(s.merges for s in cache.summaries) > 10
    assert r["violations"] == 0 and r["count_mismatch"] == 0 and r["nontrivial"] > 1500
    # summary memory is flat while the offloaded K/V keeps growing
    m = cache.memory()
    assert m["summary_bytes"] <= cache.num_layers * cache.summaries[0].nbytes
    assert m["offloaded_kv_bytes"] > 20 * m["summary_bytes"]


def _drive_one(cache, c, gen, scale=1.5):
    cache.begin_chunk(c)
    for layer in range(cache.num_layers):
        cache.write(torch.randn(B, C, H, D, generator=gen) * scale, torch.randn(B, C, H, D + 1, generator=gen),
                    layer=layer)
        certified_attend(torch.randn(B, C, H, D, generator=gen) * scale, cache.layer(layer))
    cache.commit_chunk(c)


def test_merging_pooled_summaries_stays_valid():
    mon = HistoryCheck()
    cache = _cache(CertifiedRingCache, monitor=mon, pool_events=2, block_tokens=4, max_blocks=6)
    gen = torch.Generator().manual_seed(2)
    for c in range(30):
        _drive_one(cache, c, gen)
    r = mon.result()
    assert sum(s.merges for s in cache.summaries) > 0
    assert r["violations"] == 0 and r["count_mismatch"] == 0


@pytest.mark.parametrize("cls", [CertifiedRingCache, CertifiedMassCache])
@pytest.mark.parametrize("summary", [dict(), dict(pool_events=3, block_tokens=4, max_blocks=8)])
def test_recall_keeps_every_query_under_tau(cls, summary):
    """With room to recall, every row's certified error is at most tau times its value gap
    (m_hat <= tau), the certificates stay valid, and recalled tokens are what the history holds."""
    tau = 0.1
    mon = HistoryCheck(check_storage=True, tau=tau)
    cache = _cache(cls, monitor=mon, recall_tau=tau, recall_slots=200, **summary)
    _drive(cache, 24, torch.Generator().manual_seed(3))
    r = mon.result()
    st = cache.recall_stats
    assert st["recall_events"] > 0 and st["recalled_tokens"] > 0 and st["shortfalls"] == 0
    assert r["over_tau"] == 0
    assert r["violations"] == 0 and r["count_mismatch"] == 0 and r["storage_mismatch"] == 0
    assert r["duplicate_positions"] == 0
    for layer in range(cache.num_layers):
        cert = cache.last_certificate[layer]
        assert (cert.mass <= tau).all() and (cert.error <= tau * cert.gap).all()


def test_recall_shortfall_is_reported_not_hidden():
    tau = 0.01
    mon = HistoryCheck(tau=tau)
    cache = _cache(CertifiedRingCache, monitor=mon, recall_tau=tau, recall_slots=4)
    _drive(cache, 16, torch.Generator().manual_seed(4))
    r = mon.result()
    assert cache.recall_stats["shortfalls"] > 0 and r["over_tau"] > 0
    assert r["violations"] == 0  # still a valid certificate, just above tau


def test_certificate_step_does_not_synchronise(monkeypatch):
    """The certificate is device work only: no .item(), .tolist(), bool(tensor) or host copies."""
    cache = _cache(CertifiedMassCache, monitor=None, pool_events=2, block_tokens=4)
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
    cert = cache.certificate(0, q)
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


def test_cache_set_holds_recall_slots_next_to_the_cache():
    cs = CertifiedCacheSet("ring", k_shape=(1, 14, 2, 4), v_shape=(1, 14, 2, 4), seq_dim=1, sink=2, window=12,
                           chunk=4, num_layers=2, branches=("cond", "uncond"), recall_tau=0.1, recall_slots=8)
    assert cs._k.shape == (2, 2, 1, 22, 2, 4)
    c = cs["cond"]
    assert c.keys(0).data_ptr() == cs._k[0, 0].data_ptr() and c.keys(0).shape[1] == 22
    assert c.layer_slot_positions(0).shape == (2, 22) and not c.all_valid


def test_bad_input():
    with pytest.raises(ValueError, match="recall_slots"):
        _cache(CertifiedRingCache, monitor=None, recall_tau=0.1)
    with pytest.raises(ValueError, match="layout"):
        CertifiedRingCache((B, H, S + W, D), (B, H, S + W, D), seq_dim=2, sink=S, window=W, chunk=C)
    with pytest.raises(ValueError, match="tau"):
        _cache(CertifiedRingCache, monitor=None, recall_tau=1.5, recall_slots=4)
    with pytest.raises(ValueError, match="pool_events"):
        _cache(CertifiedRingCache, monitor=None, pool_events=0)
    cache = _cache(CertifiedRingCache, monitor=None)
    with pytest.raises(RuntimeError, match="state dict"):
        cache.state_dict()
    with pytest.raises(TypeError):
        CertifiedCacheSet("chronological", k_shape=(1, 14, 2, 4), v_shape=(1, 14, 2, 4), seq_dim=1, sink=2,
                          window=12, chunk=4, num_layers=1)


def test_reset_forgets_summaries_store_and_recall():
    mon = HistoryCheck(tau=0.1)
    cache = _cache(CertifiedRingCache, monitor=mon, recall_tau=0.1, recall_slots=64)
    gen = torch.Generator().manual_seed(6)
    for c in range(8):
        _drive_one(cache, c, gen)
    assert cache.summaries[0].nb > 0 and cache.store.entries
    cache.reset()
    assert cache.summaries[0].nb == 0 and not cache.store.entries and bool((cache._rpos < 0).all())
    for c in range(8):
        _drive_one(cache, c, gen)
    assert mon.result()["violations"] == 0 and mon.result()["count_mismatch"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned host memory, non_blocking copies)")
def test_cuda_offload_is_pinned_and_recall_is_valid():  # pragma: no cover - GPU only
    mon = HistoryCheck(tau=0.1, check_storage=True)
    cache = CertifiedRingCache((B, S + W, H, D), (B, S + W, H, D), seq_dim=1, sink=S, window=W, chunk=C,
                               num_layers=1, monitor=mon, recall_tau=0.1, recall_slots=200, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for c in range(16):
        cache.begin_chunk(c)
        cache.write(torch.randn(B, C, H, D, device="cuda", generator=gen), torch.randn(B, C, H, D, device="cuda",
                                                                                     generator=gen), layer=0)
        certified_attend(torch.randn(B, C, H, D, device="cuda", generator=gen), cache.layer(0))
        cache.commit_chunk(c)
    assert all(e.keys.is_pinned() for e in cache.store.entries.values())
    r = mon.result()
    assert r["violations"] == 0 and r["over_tau"] == 0


def test_the_reference_catches_a_summary_that_misses_tokens(monkeypatch):
    """Control: drop every third eviction event from the summaries; the whole-history check must
    flag the bookkeeping and find violations (so the zero counts above can fail)."""
    seen = {"n": 0}
    orig = CertifiedRingCache._summarise_eviction

    def lossy(self, ev):
        seen["n"] += 1
        if seen["n"] % 3:
            orig(self, ev)

    monkeypatch.setattr(CertifiedRingCache, "_summarise_eviction", lossy)
    mon = HistoryCheck()
    cache = _cache(CertifiedRingCache, monitor=mon)
    _drive(cache, 16, torch.Generator().manual_seed(7), scale=3.0)
    r = mon.result()
    assert r["count_mismatch"] > 0 and r["violations"] > 0


@pytest.mark.parametrize("sink,window,chunk", [(2, 5, 3), (0, 6, 3), (3, 7, 2), (1, 4, 4), (5, 5, 5), (0, 5, 1)])
def test_ring_evicted_rows_are_the_announced_ones(sink, window, chunk):
    """The ring's sync-free arithmetic (the chunk's last rows evict) names exactly the slots and
    positions the eviction event announces."""
    cap = sink + window
    cache = CertifiedRingCache((1, cap, 2, 6), (1, cap, 2, 6), seq_dim=1, sink=sink, window=window, chunk=chunk)
    seen = []

    def listener(ev):
        rows, mask, pos, counts = cache._evicted_rows(ev, 0)
        assert sorted(rows.tolist()) == sorted(ev.evicted.nonzero().squeeze(1).tolist())
        assert sorted(pos[0].tolist()) == sorted(ev.cache.slot_positions[ev.evicted].tolist())
        assert counts == [rows.numel()] * 2 and bool(mask.all())
        seen.append(ev.chunk_idx)

    cache.add_eviction_listener(listener)
    for c in range(15):
        cache.begin_chunk(c)
        cache.write(torch.zeros(1, chunk, 2, 6), torch.zeros(1, chunk, 2, 6))
        cache.commit_chunk(c)
    assert seen
