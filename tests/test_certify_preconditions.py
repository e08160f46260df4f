"""The certifier's preconditions (refused with the reason, nothing changed) and its contract
with the cache's two-phase observers: it records an eviction only once it was applied, so an
aborted begin or commit, a vetoed reset or a refusing branch leaves its state as it was, and
every certificate stays above the float64 truth on the retry. Each case here was accepted (and
undercounted) before the contract changed."""

import math

import pytest
import torch

from conftest import assert_same_state, snapshot
from streamkv import CacheObserver, CacheSet, KVCache
from streamkv.attention import attend
from streamkv.certify import Certifier, HistoryCheck

S, W, C, B, H, D = 1, 8, 2, 1, 2, 4


def _cache(kind="ring", **kw):
    params = {"tau": 0.3} if kind == "mass" else {}
    return KVCache((B, S + W, H, D), (B, S + W, H, D), policy=kind, seq_dim=1, sink=S, window=W, chunk=C,
                   dtype=torch.float64, **params, **kw)


def _step(cache, c, gen, commit=True):
    cache.begin_chunk(c)
    k, v, q = (torch.randn(B, C, H, D, generator=gen, dtype=torch.float64) * 2 for _ in range(3))
    attend(q, cache.update(k, v, q))
    if commit:
        cache.commit_chunk(c)


class Veto(CacheObserver):
    def __init__(self, what, times=1):
        self.what, self.times = what, times

    def prepare(self, change):
        if change.what == self.what and (change.eviction is not None or self.what == "reset") and self.times:
            self.times -= 1
            raise RuntimeError(f"veto {self.what}")


@pytest.mark.parametrize("kind,what", [("ring", "begin"), ("mass", "commit"), ("tova", "commit")])
def test_an_aborted_eviction_is_not_recorded_and_the_retry_is_certified(kind, what):
    cache = _cache(kind, recall_slots=8)
    cert = Certifier(cache, recall_tau=0.05)
    check = HistoryCheck(cert, check_storage=True)
    veto = cache.add_observer(Veto(what, times=3))
    gen = torch.Generator().manual_seed(0)
    vetoed = 0
    for c in range(12):
        cache.begin_chunk(c) if not (what == "begin") else None
        if what == "begin":
            while True:
                before = snapshot(cert)
                try:
                    cache.begin_chunk(c)
                    break
                except RuntimeError:
                    vetoed += 1
                    assert_same_state(before, snapshot(cert))
        k, v, q = (torch.randn(B, C, H, D, generator=gen, dtype=torch.float64) * 2 for _ in range(3))
        attend(q, cache.update(k, v, q))
        while True:
            before = snapshot(cert)
            try:
                cache.commit_chunk(c)
                break
            except RuntimeError:
                vetoed += 1
                assert_same_state(before, snapshot(cert))
    assert vetoed == 3 and veto.times == 0
    r = check.result()
    assert r["violations"] == 0 and r["count_mismatch"] == 0 and r["duplicate_positions"] == 0
    assert r["storage_mismatch"] == 0 and r["nontrivial"] > 0


def test_a_refusing_branch_leaves_the_other_branchs_certifier_unchanged():
    cs = CacheSet("mass", k_shape=(B, S + W, H, D), v_shape=(B, S + W, H, D), seq_dim=1, sink=S, window=W, chunk=C,
                  tau=0.3, dtype=torch.float64, branches=("cond", "uncond"))
    certs = {b: Certifier(cs[b]) for b in cs}
    checks = {b: HistoryCheck(certs[b]) for b in cs}
    gen = torch.Generator().manual_seed(1)
    for c in range(10):
        cs.begin_chunk(c)
        for b in cs:
            k, v, q = (torch.randn(B, C, H, D, generator=gen, dtype=torch.float64) * 2 for _ in range(3))
            if b == "uncond" and c == 6:
                q_nan = q.clone()
                q_nan[0, 0, 0, 0] = math.nan  # NaN statistics: this branch refuses the commit
                attend(q_nan, cs[b].update(k, v, q_nan))
                bad = (k, v, q)
            else:
                attend(q, cs[b].update(k, v, q))
        if c == 6:
            before = snapshot(cs)
            with pytest.raises(ValueError, match="not finite"):
                cs.commit_chunk(c)
            assert_same_state(before, snapshot(cs))
            attend(bad[2], cs["uncond"].update(*bad))  # the retry rewrites the span
        cs.commit_chunk(c)
    for b in cs:
        r = checks[b].result()
        assert r["violations"] == 0 and r["count_mismatch"] == 0 and r["nontrivial"] > 0


def test_a_vetoed_reset_keeps_the_certifier_and_a_cache_set_reset_is_all_or_nothing():
    cs = CacheSet("ring", k_shape=(B, S + W, H, D), v_shape=(B, S + W, H, D), seq_dim=1, sink=S, window=W, chunk=C,
                  dtype=torch.float64, branches=("cond", "uncond"))
    certs = {b: Certifier(cs[b]) for b in cs}
    gen = torch.Generator().manual_seed(2)
    for c in range(8):
        cs.begin_chunk(c)
        for b in cs:
            k, v, q = (torch.randn(B, C, H, D, generator=gen, dtype=torch.float64) for _ in range(3))
            attend(q, cs[b].update(k, v, q))
        cs.commit_chunk(c)
    assert certs["cond"].store.entries
    cs["uncond"].add_observer(Veto("reset"))
    before = snapshot(cs)
    with pytest.raises(RuntimeError, match="veto reset"):
        cs.reset()
    assert_same_state(before, snapshot(cs))
    assert cs["cond"].end == cs["uncond"].end == 8 * C and certs["cond"].store.entries


def test_late_attach_is_refused_before_the_first_eviction_only():
    gen = torch.Generator().manual_seed(3)
    early = _cache()
    for c in range(4):  # 8 positions in 9 slots: nothing evicted yet
        _step(early, c, gen)
    Certifier(early)  # accepted: it has seen nothing leave
    late = _cache()
    for c in range(6):
        _step(late, c, gen)
    before = snapshot(late)
    with pytest.raises(ValueError, match="already evicted"):
        Certifier(late)
    assert_same_state(before, snapshot(late))
    assert not late.observers


def test_a_certifier_is_attached_once_and_refuses_after_detach():
    cache = _cache()
    cert = Certifier(cache)
    cache.remove_observer(cert)
    with pytest.raises(ValueError, match="attached once"):
        cache.add_observer(cert)
    q = torch.randn(B, C, H, D, dtype=torch.float64)
    cache.begin_chunk(0)
    cache.update(q, q)
    with pytest.raises(RuntimeError, match="detached"):
        cert.certificate(0, q)


def test_one_recall_owner_and_no_idle_recall_slots():
    cache = _cache(recall_slots=4)
    Certifier(cache, recall_tau=0.1)
    with pytest.raises(ValueError, match="one recall owner"):
        Certifier(cache, recall_tau=0.1)
    Certifier(cache)  # a second, non-recalling certifier: the owner fills the slots (it overcounts, never under)
    idle = _cache(recall_slots=4)
    with pytest.raises(ValueError, match="nothing would fill them"):
        Certifier(idle)
    assert not idle.observers


def test_load_state_dict_into_a_certified_cache_is_refused():
    cache = _cache()
    gen = torch.Generator().manual_seed(4)
    for c in range(3):
        _step(cache, c, gen)
    state = cache.state_dict()
    Certifier(_cache())  # unrelated
    watched = _cache()
    cert = Certifier(watched)
    before = snapshot(watched)
    with pytest.raises(RuntimeError, match="does not load state dicts"):
        watched.load_state_dict(state)
    assert_same_state(before, snapshot(watched))
    assert cert.attached


def test_sketches_below_the_cache_precision_and_bad_options_are_refused():
    with pytest.raises(ValueError, match="float32"):
        Certifier(_cache(), sketch_bits=8)  # a float64 cache
    f32 = KVCache((B, S + W, H, D), (B, S + W, H, D), policy="ring", seq_dim=1, sink=S, window=W, chunk=C)
    for bad, exc in ((math.nan, ValueError), (-1.0, ValueError), (0, ValueError), (math.inf, ValueError),
                     (True, TypeError), ("1", TypeError)):
        with pytest.raises(exc, match="scale"):
            Certifier(f32, scale=bad)
    for kw in ({"block_tokens": 0}, {"events_per_block": True}, {"sketch_bits": 6}, {"causal": 1}):
        with pytest.raises((ValueError, TypeError)):
            Certifier(f32, **kw)
    assert not f32.observers
    Certifier(f32, sketch_bits=8, scale=0.5)


@pytest.mark.parametrize("layout", ["BHTD", "TBHD"])
def test_any_layout_is_certified_and_equals_the_token_major_certificate(layout):
    """The certifier reads the storage through its per-head views: a [B, H, T, D] or [T, B, H, D]
    cache gets the same certificates as the [B, T, H, D] one."""
    shapes = {"BHTD": ((B, H, S + W, D), 2), "TBHD": ((S + W, B, H, D), 0)}
    shape, seq = shapes[layout]
    ref = _cache()
    other = KVCache(shape, shape, policy="ring", seq_dim=seq, sink=S, window=W, chunk=C, dtype=torch.float64)
    c_ref, c_oth = Certifier(ref), Certifier(other)
    check = HistoryCheck(c_oth)
    gen = torch.Generator().manual_seed(5)
    for c in range(10):
        k, v, q = (torch.randn(B, C, H, D, generator=gen, dtype=torch.float64) * 2 for _ in range(3))
        perm = {"BHTD": (0, 2, 1, 3), "TBHD": (1, 0, 2, 3)}[layout]
        for cache, (kk, vv, qq) in ((ref, (k, v, q)), (other, (k.permute(perm), v.permute(perm), q.permute(perm)))):
            cache.begin_chunk(c)
            attend(qq, cache.update(kk, vv, qq))
            cache.commit_chunk(c)
        a, b = c_ref.last[0], c_oth.last[0]
        assert torch.equal(a.mass, b.mass) and torch.equal(a.error, b.error)
    r = check.result()
    assert r["violations"] == 0 and r["nontrivial"] > 0


def test_a_release_is_certified_over_what_the_cache_then_holds():
    """Found by ``streamkv fuzz --seed 3``: when the evicted block a query needs could not fit,
    recall released the blocks recalled for an earlier span, recalled nothing in their place
    and returned the certificate computed before the release (it undercounted). Now a release
    happens only where it lets a block in, and any change of the kept set is certified anew."""
    S_, W_, C_, R, D_ = 2, 4, 4, 3, 4
    cache = KVCache((1, S_ + W_, 1, D_), (1, S_ + W_, 1, D_), policy="ring", seq_dim=1, sink=S_, window=W_,
                    chunk=C_, dtype=torch.float64, recall_slots=R)
    cert = Certifier(cache, recall_tau=0.3)
    check = HistoryCheck(cert)
    gen = torch.Generator().manual_seed(0)
    for c in range(6):
        cache.begin_chunk(c)
        k, v, q = (torch.randn(1, C_, 1, D_, generator=gen, dtype=torch.float64) for _ in range(3))
        attend(q, cache.update(k, v, q))
        assert torch.equal(cert.last[0].mass, cert.certificate(0, q).mass)  # the cache as it now is
        if c == 2:  # a 4-token block does not fit in 3 recall slots: the earlier recall stays
            assert cache.slot_positions[0, 0, S_ + W_:].tolist() == [2, 3, -1] and cert.stats["shortfalls"] >= 1
        cache.commit_chunk(c)
    assert check.result()["violations"] == 0


def test_certificate_refuses_queries_that_are_not_the_open_spans():
    """``Certifier.certificate(layer, q)`` names what is wrong: a layer out of range (was an
    IndexError), the wrong feature size or rank, no open span (an AttributeError with causal), and
    a query count other than the span's (more rows were certified with positions repeated)."""
    cache = KVCache((1, 6, 2, 4), (1, 6, 2, 4), seq_dim=1, sink=1, window=5, chunk=2, policy="ring",
                    dtype=torch.float64)
    cert = Certifier(cache, causal=True)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="no span is open"):
        cert.certificate(0, torch.randn(1, 2, 2, 4, generator=g, dtype=torch.float64))
    cache.begin_chunk(0)
    k, v, q = (torch.randn(1, 2, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    attend(q, cache.layer(0).update(k, v, q))
    for layer, bad, match in ((5, q, r"layer must be in \[0, 1\), got 5"), (0, q[..., :3], "3 features"),
                              (0, q[0], "rank 4"), (0, torch.cat([q, q], 1), "4 rows along seq_dim 1"),
                              (0, q[:, :1], "1 rows along seq_dim 1")):
        with pytest.raises(ValueError, match=match):
            cert.certificate(layer, bad)
    assert torch.equal(cert.certificate(0, q).error, cert.last[0].error)
