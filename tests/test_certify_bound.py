"""The certificate's math against an independent float64 computation: validity on random and
adversarial cases, tightness where it must be tight, and a control showing the check bites."""

import math

import pytest
import torch

from streamkv.certify.bound import box_logit_bound, certify
from streamkv.certify.summary import round_down, round_up


def _truth(q, K, V, kept, scale):
    """Independent float64 truth per (b, h, q): log m, and |o - o_K| via the exact identity
    m * |o_D - o_K| (no cancellation between two nearly equal outputs)."""
    s = torch.einsum("bhqd,bhnd->bhqn", q.double(), K.double()) * scale
    keptb = kept.view(1, kept.shape[0], 1, -1)
    ninf = torch.tensor(-math.inf, dtype=torch.float64)
    sk, sd = torch.where(keptb, s, ninf), torch.where(keptb, ninf, s)
    lse_k, lse_d = torch.logsumexp(sk, -1), torch.logsumexp(sd, -1)
    log_m = lse_d - torch.logaddexp(lse_k, lse_d)
    o_k = torch.softmax(sk, -1) @ V.double()
    o_d = torch.softmax(sd, -1).nan_to_num(0.0) @ V.double()
    return log_m, log_m.exp().unsqueeze(-1) * (o_d - o_k).abs()


def _certify_case(q, K, V, kept, block_of, scale, box_dtype=None, swap=False):
    """Build the certificate's inputs from a full history: kept slots (with some empty slots
    mixed in, as a cache has), evicted blocks per head (``block_of [H, N]``, -1 = kept)."""
    B, H, N, D = K.shape
    nk = int(kept.sum(-1).max())
    S = nk + 2  # two empty slots
    ks = torch.zeros(B, H, S, D, dtype=K.dtype)
    vs = torch.zeros(B, H, S, V.shape[-1], dtype=V.dtype)
    pos = torch.full((H, S), -1)
    for h in range(H):
        idx = kept[h].nonzero().squeeze(1)
        perm = torch.randperm(S)[: idx.numel()]  # physical order is arbitrary
        ks[:, h, perm] = K[:, h, idx]
        vs[:, h, perm] = V[:, h, idx]
        pos[h, perm] = idx
    bias = torch.where(pos >= 0, 0.0, -math.inf).double().unsqueeze(-2)  # [H, 1, S]
    nb = int(block_of.max()) + 1 if (block_of >= 0).any() else 0
    lo = torch.full((B, H, nb, D), math.inf, dtype=K.dtype)
    hi = torch.full((B, H, nb, D), -math.inf, dtype=K.dtype)
    cnt = torch.zeros(H, nb)
    vlo = torch.full((B, H, V.shape[-1]), math.inf, dtype=V.dtype)
    vhi = torch.full((B, H, V.shape[-1]), -math.inf, dtype=V.dtype)
    for h in range(H):
        for b in range(nb):
            sel = block_of[h] == b
            if sel.any():
                lo[:, h, b] = K[:, h, sel].amin(1)
                hi[:, h, b] = K[:, h, sel].amax(1)
                cnt[h, b] = sel.sum()
        ev = block_of[h] >= 0
        if ev.any():
            vlo[:, h] = V[:, h, ev].amin(1)
            vhi[:, h] = V[:, h, ev].amax(1)
    if box_dtype is not None:
        lo, hi = round_down(lo, box_dtype), round_up(hi, box_dtype)
    log_count = torch.where(cnt > 0, cnt.double().log(), -math.inf).unsqueeze(0)
    if swap:  # the same boxes with their ends given in the other order, in every other channel
        flip = torch.arange(D) % 2 == 0
        lo, hi = torch.where(flip, hi, lo), torch.where(flip, lo, hi)
        flip = torch.arange(V.shape[-1]) % 2 == 0
        vlo, vhi = torch.where(flip & (vlo <= vhi), vhi, vlo), torch.where(flip & (vlo <= vhi), vlo, vhi)
    return certify(q, ks, vs, bias, lo, hi, log_count, vlo, vhi, scale=scale, n_tokens=N)


def _check(cert, log_m, err):
    """Violations: certified mass below the true mass, or a channel's bound below its error."""
    viol = (cert.log_mass < log_m) | (cert.mass < log_m.exp()) | (cert.error < err).any(-1)
    return int(viol.sum())


def _random_case(gen, *, B, H, N, D, Dv, logit_scale, n_blocks, kept_frac, dtype=torch.float32):
    K = (torch.randn(B, H, N, D, generator=gen) * logit_scale).to(dtype)
    V = torch.randn(B, H, N, Dv, generator=gen).to(dtype)
    q = (torch.randn(B, H, 5, D, generator=gen) * logit_scale).to(dtype)
    kept = torch.rand(H, N, generator=gen) < kept_frac
    kept[:, -1] = True  # at least one kept token per head
    block_of = torch.randint(0, n_blocks, (H, N), generator=gen)
    block_of = torch.where(kept, -1, block_of)
    return q, K, V, kept, block_of


def test_random_cases_have_no_violations():
    gen = torch.Generator().manual_seed(0)
    rows = violations = 0
    for trial in range(150):
        D = [4, 8, 16, 32][trial % 4]
        q, K, V, kept, block_of = _random_case(
            gen, B=2, H=3, N=40, D=D, Dv=5, logit_scale=[0.3, 1.0, 2.0, 4.0][trial % 4],
            n_blocks=[1, 3, 8, 40][(trial // 4) % 4], kept_frac=[0.1, 0.5, 0.9][trial % 3])
        scale = D**-0.5
        cert = _certify_case(q, K, V, kept, block_of, scale, box_dtype=torch.float16 if trial % 5 == 0 else None)
        log_m, err = _truth(q, K, V, kept, scale)
        violations += _check(cert, log_m, err)
        rows += log_m.numel()
        assert torch.isfinite(cert.gap).all() and not torch.isnan(cert.error).any()
    assert rows == 150 * 2 * 3 * 5
    assert violations == 0


def test_one_hot_keys_and_queries():
    B, H, N, D = 1, 2, 12, 6
    K = torch.zeros(B, H, N, D)
    for j in range(N):
        K[:, :, j, j % D] = 5.0
    q = torch.zeros(B, H, 4, D)
    for i in range(4):
        q[:, :, i, i % D] = 3.0
    V = torch.arange(N, dtype=torch.float32).view(1, 1, N, 1).expand(B, H, N, 2).clone()
    kept = torch.zeros(H, N, dtype=torch.bool)
    kept[:, -3:] = True
    for block_of in (torch.where(kept, -1, 0), torch.where(kept, -1, torch.arange(N).expand(H, N))):
        cert = _certify_case(q, K, V, kept, block_of, 1.0)
        log_m, err = _truth(q, K, V, kept, 1.0)
        assert _check(cert, log_m, err) == 0
    # one block per token: the box is the token, so the bound is exact up to the allowance
    ratio = (cert.log_mass - log_m).exp()
    assert (ratio >= 1).all() and (ratio <= 1 + 1e-9).all()


@pytest.mark.parametrize("mag", [1e2, 1e3, 3e4])
def test_huge_logits(mag):
    gen = torch.Generator().manual_seed(1)
    q, K, V, kept, block_of = _random_case(gen, B=1, H=2, N=30, D=8, Dv=3, logit_scale=math.sqrt(mag),
                                           n_blocks=4, kept_frac=0.5)
    cert = _certify_case(q, K, V, kept, block_of, 8**-0.5)
    log_m, err = _truth(q, K, V, kept, 8**-0.5)
    assert _check(cert, log_m, err) == 0
    assert not torch.isnan(cert.log_mass).any() and not torch.isnan(cert.error).any()
    assert (cert.mass <= 1).all()


def test_empty_evicted_set_certifies_zero():
    gen = torch.Generator().manual_seed(2)
    q, K, V, kept, _ = _random_case(gen, B=2, H=2, N=10, D=4, Dv=3, logit_scale=1.0, n_blocks=1, kept_frac=1.0)
    kept[:] = True
    cert = _certify_case(q, K, V, kept, torch.full((2, 10), -1), 0.5)
    assert (cert.mass == 0).all() and (cert.error == 0).all() and (cert.gap == 0).all()
    assert torch.isneginf(cert.log_mass).all()


def test_single_evicted_token_at_the_box_corner_is_tight():
    """One evicted token: its box is the token itself (the maximising corner), so U = its logit
    and Z_hat = Z_D; with its value the whole value box, the error bound is exact too."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        q, K, V, kept, _ = _random_case(gen, B=1, H=2, N=9, D=8, Dv=4, logit_scale=1.5, n_blocks=1, kept_frac=1.0)
        kept[:] = True
        kept[:, 4] = False
        block_of = torch.where(kept, -1, 0)
        cert = _certify_case(q, K, V, kept, block_of, 8**-0.5)
        log_m, err = _truth(q, K, V, kept, 8**-0.5)
        assert _check(cert, log_m, err) == 0
        ratio = (cert.log_mass - log_m).exp()
        assert (ratio >= 1).all() and (ratio <= 1 + 1e-9).all(), ratio
        # the error bound carries an absolute rounding allowance (~1e-11 x the value scale, see
        # streamkv.certify.bound), so it is tight to ~1e-6 relative where the error is >= 1e-4
        pos = err > 1e-4
        er = cert.error[pos] / err[pos]
        assert pos.any() and (er >= 1).all() and (er <= 1 + 1e-6).all()


def test_corner_token_attains_the_box_bound():
    """In a block of several keys, the bound equals the logit of a key sitting at the corner
    the query selects (lo_i where q_i < 0, hi_i where q_i > 0)."""
    gen = torch.Generator().manual_seed(4)
    keys = torch.randn(6, 8, generator=gen)
    q = torch.randn(8, generator=gen)
    lo, hi = keys.amin(0), keys.amax(0)
    corner = torch.where(q > 0, hi, lo)
    keys = torch.cat([keys, corner.unsqueeze(0)])
    U = box_logit_bound(q.view(1, 1, 1, 8), keys.amin(0).view(1, 1, 1, 8), keys.amax(0).view(1, 1, 1, 8), scale=1.0)
    s = (keys.double() @ q.double())
    assert torch.isclose(U.view(()), s.max(), rtol=0, atol=1e-12)
    assert (s <= U.view(()) + 1e-12).all()


def test_zero_query_is_exact_counting():
    """q = 0: every logit is 0, so m = |D| / N exactly and the bound must reproduce it."""
    B, H, N, D = 1, 1, 20, 4
    K = torch.randn(B, H, N, D)
    V = torch.randn(B, H, N, 2)
    q = torch.zeros(B, H, 3, D)
    kept = torch.zeros(H, N, dtype=torch.bool)
    kept[:, 15:] = True
    cert = _certify_case(q, K, V, kept, torch.where(kept, -1, torch.arange(N) % 3), 0.5)
    m = cert.mass
    assert (m >= 15 / 20).all() and (m <= 15 / 20 * (1 + 1e-12)).all()


def test_nan_keys_give_the_trivial_bound_not_nan():
    gen = torch.Generator().manual_seed(5)
    q, K, V, kept, block_of = _random_case(gen, B=1, H=1, N=10, D=4, Dv=2, logit_scale=1.0, n_blocks=2,
                                           kept_frac=0.5)
    K[0, 0, (~kept[0]).nonzero()[0, 0], 1] = math.nan
    cert = _certify_case(q, K, V, kept, block_of, 0.5)
    assert not torch.isnan(cert.mass).any() and (cert.mass == 1).all()


def test_the_check_catches_an_invalid_bound():
    """Control: shrink one box by a hair on the side a query uses; the independent check must
    then report violations (so 'zero violations' above is a statement that can fail)."""
    gen = torch.Generator().manual_seed(6)
    q, K, V, kept, _ = _random_case(gen, B=1, H=1, N=12, D=8, Dv=2, logit_scale=1.5, n_blocks=1, kept_frac=1.0)
    kept[:] = True
    kept[:, 3] = False  # one evicted token: the bound is tight, so any shrink breaks it
    block_of = torch.where(kept, -1, 0)
    good = _certify_case(q, K, V, kept, block_of, 8**-0.5)
    log_m, err = _truth(q, K, V, kept, 8**-0.5)
    assert _check(good, log_m, err) == 0
    Kbad = K.clone()
    Kbad[:, :, 3] -= 1e-3 * torch.sign(q[0, 0, 0])  # the box the certificate sees is shifted away
    bad = _certify_case(q, Kbad, V, kept, block_of, 8**-0.5)
    assert _check(bad, log_m, err) > 0


def test_outward_rounding_contains_the_value():
    gen = torch.Generator().manual_seed(7)
    x = torch.cat([torch.randn(5000, generator=gen) * 10 ** torch.randint(-6, 6, (5000,), generator=gen).float(),
                   torch.tensor([70000.0, -70000.0, 1e-9, -1e-9, 0.0])])
    for dt in (torch.float16, torch.bfloat16):
        lo, hi = round_down(x, dt), round_up(x, dt)
        assert (lo.float() <= x).all() and (hi.float() >= x).all()
        assert lo.dtype == dt and hi.dtype == dt


def test_a_box_given_with_its_ends_swapped_is_the_box_between_them():
    """``certify`` takes a box's ends in either order (checking ``lo <= hi`` would read the device):
    the certificate of swapped ends is the ordered one's, so never below the truth."""
    gen = torch.Generator().manual_seed(11)
    q, K, V, kept, block_of = _random_case(gen, B=1, H=2, N=40, D=8, Dv=6, logit_scale=1.0, n_blocks=3,
                                           kept_frac=0.4, dtype=torch.float64)
    log_m, err = _truth(q, K, V, kept, 0.35)
    torch.manual_seed(0)
    ordered = _certify_case(q, K, V, kept, block_of, 0.35)
    torch.manual_seed(0)
    swapped = _certify_case(q, K, V, kept, block_of, 0.35, swap=True)
    assert _check(swapped, log_m, err) == 0
    assert torch.allclose(swapped.error, ordered.error, rtol=1e-12, atol=0)
    assert torch.allclose(swapped.mass, ordered.mass, rtol=1e-12, atol=0)
