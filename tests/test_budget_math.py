"""The dropped-mass identity and its two bounds (streamkv.budget.mass), in float64.

Rounding allowance, used everywhere below and nowhere loosened: both sides of the
identity are a handful of sums of N products ``p_j v_j`` plus one division, so they
agree to ``ROUND * N * eps * max|v|`` with ``ROUND = 4``.
"""

import math

import pytest
import torch

from streamkv.budget import mass as M
from streamkv.budget import PerQueryMass

F64 = torch.float64
EPS = torch.finfo(F64).eps
ROUND = 4


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tol(n: int, v: torch.Tensor) -> float:
    return ROUND * n * EPS * float(v.abs().max())


def _independent_rhs(p: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """m * (mean_D - mean_K), one row at a time in plain Python loops (no shared code)."""
    rows = p.reshape(-1, p.shape[-1])
    keeps = keep.expand(p.shape).reshape(-1, p.shape[-1])
    out = []
    for pr, kr in zip(rows.tolist(), keeps.tolist()):
        mk = sum(x for x, k in zip(pr, kr) if k)
        md = sum(x for x, k in zip(pr, kr) if not k)
        row = []
        for c in range(v.shape[-1]):
            col = v[:, c].tolist()
            mean_k = sum(x * y for x, y, k in zip(pr, col, kr) if k) / mk
            mean_d = sum(x * y for x, y, k in zip(pr, col, kr) if not k) / md if md > 0 else 0.0
            row.append(md * (mean_d - mean_k))
        out.append(row)
    return torch.tensor(out, dtype=F64).reshape(*p.shape[:-1], v.shape[-1])


def _case(name: str, g: torch.Generator):
    """(p [Q, N], v [N, D], keep [Q, N]) for the named adversarial family."""
    n, d, q = 12, 3, 4
    v = torch.randn(n, d, generator=g, dtype=F64) * 3
    if name == "random":
        p = torch.softmax(torch.randn(q, n, generator=g, dtype=F64) * 2, -1)
        keep = torch.rand(q, n, generator=g) < 0.5
        keep[:, 0] = True
    elif name == "m_near_0":       # the dropped tokens carry ~1e-13 of the mass
        logits = torch.randn(q, n, generator=g, dtype=F64)
        logits[:, 6:] -= 30.0
        p = torch.softmax(logits, -1)
        keep = torch.arange(n) < 6
    elif name == "m_near_1":       # the kept tokens carry ~1e-13 of the mass
        logits = torch.randn(q, n, generator=g, dtype=F64)
        logits[:, :6] -= 30.0
        p = torch.softmax(logits, -1)
        keep = torch.arange(n) < 6
    elif name == "one_hot_kept":   # all mass on a kept token: m = 0 exactly
        p = torch.zeros(q, n, dtype=F64)
        p[:, 3] = 1.0
        keep = torch.zeros(n, dtype=torch.bool)
        keep[3] = True
    elif name == "one_hot_nearly_dropped":  # all but 2^-40 on a dropped token
        p = torch.zeros(q, n, dtype=F64)
        p[:, 3] = 1.0 - 2.0 ** -40
        p[:, 5] = 2.0 ** -40
        keep = torch.zeros(n, dtype=torch.bool)
        keep[5] = True
    elif name == "uniform":
        p = torch.full((q, n), 1.0 / n, dtype=F64)
        keep = torch.arange(n) % 3 == 0
    else:
        raise AssertionError(name)
    return p, v, keep


CASES = ["random", "m_near_0", "m_near_1", "one_hot_kept", "one_hot_nearly_dropped", "uniform"]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("seed", range(5))
def test_identity_to_fp64_rounding(name, seed):
    g = torch.Generator().manual_seed(seed)
    p, v, keep = _case(name, g)
    lhs = M.full_output(p, v) - M.kept_output(p, v, keep)       # o - o_K
    rhs = _independent_rhs(p, v, keep)                          # m (mean_D - mean_K)
    tol = _tol(p.shape[-1], v)
    assert (lhs - rhs).abs().max() <= tol
    assert (M.identity_rhs(p, v, keep) - rhs).abs().max() <= tol


def test_identity_extremes_are_what_they_claim():
    g = torch.Generator().manual_seed(0)
    p, v, keep = _case("m_near_0", g)
    m = M.dropped_mass(p, keep)
    assert (m > 0).all() and (m < 1e-11).all()
    p, v, keep = _case("m_near_1", g)
    assert (M.kept_mass(p, keep) < 1e-11).all()
    p, v, keep = _case("one_hot_kept", g)
    assert (M.dropped_mass(p, keep) == 0).all()
    assert torch.equal(M.identity_rhs(p, v, keep), torch.zeros(p.shape[0], v.shape[1], dtype=F64))
    assert torch.equal(M.kept_output(p, v, keep), v[3].expand(p.shape[0], -1))


def test_identity_batched_values_and_dims():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(2, 3, 7, generator=g, dtype=F64), -1)   # [B, Q, N]
    v = torch.randn(2, 1, 7, 5, generator=g, dtype=F64)                   # [B, 1, N, D]
    keep = torch.rand(2, 3, 7, generator=g) < 0.6
    keep[..., 0] = True
    lhs = M.full_output(p, v.squeeze(1).unsqueeze(1)) - M.kept_output(p, v, keep)
    assert lhs.shape == (2, 3, 5)
    for b in range(2):
        rhs = _independent_rhs(p[b], v[b, 0], keep[b])
        assert (lhs[b] - rhs).abs().max() <= _tol(7, v)


def test_identity_sign_and_direction():
    """o - o_K points from the kept mean to the dropped mean, scaled by m."""
    p = torch.tensor([[0.75, 0.25]], dtype=F64)
    v = torch.tensor([[0.0], [4.0]], dtype=F64)
    keep = torch.tensor([True, False])
    assert M.full_output(p, v).item() == 1.0
    assert M.kept_output(p, v, keep).item() == 0.0
    assert M.identity_rhs(p, v, keep).item() == 0.25 * (4.0 - 0.0)


# ------------------------------------------------------------------------ bounds


def test_channel_range_and_diameter_against_brute_force():
    g = torch.Generator().manual_seed(2)
    v = torch.randn(9, 4, generator=g, dtype=F64)
    rng = [max(v[:, c].tolist()) - min(v[:, c].tolist()) for c in range(4)]
    assert M.channel_range(v).tolist() == rng
    diam = max(math.dist(a, b) for a in v.tolist() for b in v.tolist())
    assert abs(M.value_diameter(v).item() - diam) <= 4 * EPS * diam


@pytest.mark.parametrize("n", [25, 26, 64])
def test_the_diameter_of_values_far_from_the_origin_is_not_cancelled(n):
    """Values with a large common offset: the diameter (and so l2_bound) comes from differences,
    not from squared norms that cancel (torch.cdist's default past 25 rows gave 0 here)."""
    v = torch.full((n, 4), 1e8, dtype=F64)
    v[1] += 1.0
    assert M.value_diameter(v).item() == 2.0
    p = torch.zeros(n, dtype=F64)
    p[0], p[1] = 0.7, 0.3
    keep = torch.ones(n, dtype=torch.bool)
    keep[1] = False
    err = (M.full_output(p, v) - M.kept_output(p, v, keep)).norm().item()
    assert M.l2_bound(torch.tensor(0.3, dtype=F64), v).item() >= err > 0.5


@pytest.mark.parametrize("seed", range(20))
def test_both_bounds_hold_with_the_exact_mass(seed):
    g = torch.Generator().manual_seed(seed)
    n = 3 + seed
    p = torch.softmax(torch.randn(6, n, generator=g, dtype=F64) * 3, -1)
    v = torch.randn(n, 5, generator=g, dtype=F64)
    keep = torch.rand(6, n, generator=g) < 0.4
    keep[:, -1] = True
    keep[0] = True                     # row 0 keeps everything: m = 0
    keep[1] = False
    keep[1, -1] = True                 # row 1 keeps one token: m close to 1 (on average (n-1)/n)
    err = M.kept_output(p, v, keep) - M.full_output(p, v)
    m = M.dropped_mass(p, keep)
    assert m[0] == 0 and m[1] > 0
    # rows with m = 0 have error 0 in exact arithmetic and rounding-sized in float64
    tol = _tol(n, v)
    assert (err.abs() <= M.linf_bound(m, v) + tol).all()            # per channel
    assert (err.norm(dim=-1) <= M.l2_bound(m, v) + tol).all()       # L2 with the diameter
    assert (err[m == 0].abs() <= tol).all()


@pytest.mark.parametrize("tau", [0.3, 0.1, 0.01])
def test_tau_bound_for_the_mass_budget(tau):
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(50, 40, generator=g, dtype=F64) * 2, -1)
    v = torch.rand(40, 6, generator=g, dtype=F64) * 10 - 5
    keep = PerQueryMass(tau).keep(p)
    err = M.kept_output(p, v, keep) - M.full_output(p, v)
    assert (M.dropped_mass(p, keep) <= tau).all()
    assert (err.abs() <= M.linf_bound(tau, v)).all()
    assert (err.norm(dim=-1) <= M.l2_bound(tau, v)).all()
    assert M.linf_bound(tau, v).shape == (6,) and M.l2_bound(tau, v).shape == ()


def test_bounds_are_tight():
    """Two tokens at opposite corners: the error equals m * range and m * diam exactly."""
    p = torch.tensor([[0.75, 0.25]], dtype=F64)
    v = torch.tensor([[0.0, 0.0], [3.0, 4.0]], dtype=F64)
    keep = torch.tensor([True, False])
    err = M.kept_output(p, v, keep) - M.full_output(p, v)
    m = M.dropped_mass(p, keep)
    assert torch.equal(err.abs(), M.linf_bound(m, v))              # [0.75, 1.0]
    assert err.norm(dim=-1).item() == M.l2_bound(m, v).item() == 0.25 * 5.0


def test_range_must_cover_all_cached_values_not_just_kept_ones():
    """The bound needs the range of every cached value: the kept values' range alone
    (here 0) would be violated."""
    p = torch.tensor([[0.5, 0.3, 0.2]], dtype=F64)
    v = torch.tensor([[1.0], [1.0], [-1.0]], dtype=F64)
    keep = torch.tensor([True, True, False])
    err = (M.kept_output(p, v, keep) - M.full_output(p, v)).abs()
    assert (err > M.linf_bound(M.dropped_mass(p, keep), v[:2])).all()
    assert (err <= M.linf_bound(M.dropped_mass(p, keep), v)).all()


# --------------------------------------------------------------------- bad input

P_OK = torch.softmax(torch.randn(2, 4, dtype=F64), -1)
V_OK = torch.randn(4, 3, dtype=F64)
K_OK = torch.tensor([True, True, False, True])


@pytest.mark.parametrize("tau,exc,match", [
    (0.0, ValueError, r"tau must be in the open interval \(0, 1\), got 0.0"),
    (1.0, ValueError, r"open interval \(0, 1\), got 1.0"),
    (-0.1, ValueError, r"got -0.1"),
    (1.5, ValueError, r"got 1.5"),
    (float("nan"), ValueError, r"got nan"),
    (float("inf"), ValueError, r"got inf"),
    (True, TypeError, r"tau must be a real number, got bool True"),
    ("0.1", TypeError, r"got str '0.1'"),
])
def test_tau_out_of_range(tau, exc, match):
    with pytest.raises(exc, match=match):
        M.check_tau(tau)
    with pytest.raises(exc, match=match):
        M.linf_bound(tau, V_OK)
    with pytest.raises(exc, match=match):
        PerQueryMass(tau)


def _with(t, idx, value):
    t = t.clone()
    t[idx] = value
    return t


@pytest.mark.parametrize("call,exc,match", [
    (lambda: M.full_output(_with(P_OK, (1, 2), float("nan")), V_OK), ValueError, r"attention must be finite: found nan at index \(1, 2\)"),
    (lambda: M.full_output(P_OK, _with(V_OK, (3, 0), float("inf"))), ValueError, r"values must be finite: found inf at index \(3, 0\)"),
    (lambda: M.kept_output(P_OK, _with(V_OK, (0, 1), float("-inf")), K_OK), ValueError, r"values must be finite: found -inf"),
    (lambda: M.softmax_attention(torch.tensor([[0.0, float("inf")]])), ValueError, r"scores must be finite: found inf at index \(0, 1\)"),
    (lambda: M.softmax_attention(torch.tensor([[0.0, float("nan")]])), ValueError, r"scores must be finite: found nan"),
    (lambda: M.full_output(torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.5, 0.25, 0.125, 0.0]], dtype=F64), V_OK), ValueError,
     r"attention rows must sum to 1 \(within atol=4.44e-15\): row \(1,\) sums to 0.875"),
    (lambda: M.kept_mass(torch.tensor([[0.5, 0.6]], dtype=F64), K_OK[:2]), ValueError, r"row \(0,\) sums to 1.1"),
    (lambda: M.check_attention(torch.tensor([[1.5, -0.5]], dtype=F64)), ValueError, r"attention must be non-negative: found -0.5 at index \(0, 1\)"),
    (lambda: M.full_output(P_OK.long(), V_OK), TypeError, r"attention must have a floating dtype, got torch.int64"),
    (lambda: M.full_output(P_OK.tolist(), V_OK), TypeError, r"attention must be a Tensor, got list"),
    (lambda: M.full_output(P_OK, V_OK[:3]), ValueError, r"attention has N=4, values have shape \(3, 3\)"),
    (lambda: M.kept_output(P_OK, V_OK, K_OK.int()), TypeError, r"keep must have dtype torch.bool, got torch.int32"),
    (lambda: M.kept_output(P_OK, V_OK, K_OK[:3]), ValueError, r"keep must broadcast to the attention shape \(2, 4\), got \(3,\)"),
    (lambda: M.kept_output(P_OK, V_OK, torch.zeros(4, dtype=torch.bool)), ValueError, r"kept set must carry positive attention mass: row \(0,\) has mass 0.0"),
    (lambda: M.linf_bound(torch.tensor([1.5], dtype=F64), V_OK), ValueError, r"mass must be in \[0, 1\]"),
    (lambda: M.channel_range(torch.zeros(0, 3, dtype=F64)), ValueError, r"at least one cached value, got N=0"),
])
def test_bad_input_names_constraint_and_value(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_row_sum_tolerance_edges():
    n = 4
    atol = M.row_sum_atol(F64, n)
    assert atol == (n + 16) * EPS
    ok = torch.tensor([[0.25, 0.25, 0.25, 0.25 + atol / 2]], dtype=F64)
    M.check_attention(ok)
    bad = torch.tensor([[0.25, 0.25, 0.25, 0.25 + 2 * atol]], dtype=F64)
    with pytest.raises(ValueError, match="rows must sum to 1"):
        M.check_attention(bad)
    M.check_attention(bad, atol=3 * atol)   # an explicit tolerance is honoured


def test_inputs_are_not_mutated():
    p, v, k = P_OK.clone(), V_OK.clone(), K_OK.clone()
    M.identity_rhs(p, v, k)
    M.linf_bound(M.dropped_mass(p, k), v)
    M.l2_bound(0.1, v)
    assert torch.equal(p, P_OK) and torch.equal(v, V_OK) and torch.equal(k, K_OK)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_ranges_and_diameters_of_narrow_values_are_bounds(dtype):
    """A range or a diameter is a bound: computed in float64 and rounded up to the values' dtype
    (the float16 range of [-0.25, 1025] rounded to 1025, below the true 1025.25; cdist had no
    16-bit kernels); a bad ``atol`` or mixed dtypes are refused by name."""
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        v = (torch.randn(9, 3, generator=g, dtype=torch.float64) * 300).to(dtype)
        w = v.double()
        assert (M.channel_range(v).double() >= w.amax(0) - w.amin(0)).all()
        assert M.value_diameter(v).double() >= torch.cdist(w, w).max()
    v = torch.tensor([[-0.25], [1025.0]], dtype=torch.float16)
    assert float(M.linf_bound(0.5, v)[0]) >= 0.5 * 1025.25
    p = torch.softmax(torch.randn(2, 3, generator=g, dtype=torch.float64), -1)
    for atol in (float("nan"), -1.0):
        with pytest.raises(ValueError, match="atol"):
            M.check_attention(p, atol=atol)
    with pytest.raises(ValueError, match="share a dtype"):
        M.full_output(p.float(), torch.randn(3, 2, dtype=torch.float64))
