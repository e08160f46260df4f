"""Eviction policies (streamkv.budget.oracles): tiny readable states, brute-force
minimality of the mass budget, deterministic ties, protection, and bad input."""

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamkv.budget import FixedWindow, Full, PerQueryMass, kept_mass

F64 = torch.float64


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _row(*xs):
    return torch.tensor([xs], dtype=F64)


# ------------------------------------------------------------------ tiny states


def test_full_keeps_everything():
    p = torch.softmax(torch.randn(3, 5, dtype=F64), -1)
    assert Full().keep(p).all() and Full().keep(p).shape == (3, 5)


def test_fixed_window_tiny_state():
    """positions 0..9, window 3, sinks 2::

        position: 0 1 2 3 4 5 6 7 8 9
        kept:     x x . . . . . x x x
    """
    p = torch.full((2, 10), 0.1, dtype=F64)
    keep = FixedWindow(3, sinks=2).keep(p)
    assert keep[0].tolist() == [1, 1, 0, 0, 0, 0, 0, 1, 1, 1]
    assert torch.equal(keep[0], keep[1])
    assert FixedWindow(3).keep(p)[0].tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert FixedWindow(20).keep(p).all()                      # window larger than the cache


def test_fixed_window_follows_positions_not_storage_order():
    """A ring buffer stores positions out of order::

        slot:     0  1  2  3  4  5
        position: 0  6  7  3  4  5      (sink 0 pinned; 6, 7 overwrote 1, 2)
        kept:     x  x  x  .  .  x      (window 3 = positions 5, 6, 7; sink 0)
    """
    pos = torch.tensor([0, 6, 7, 3, 4, 5])
    keep = FixedWindow(3, sinks=1).keep(torch.full((1, 6), 1 / 6, dtype=F64), pos)
    assert keep[0].tolist() == [1, 1, 1, 0, 0, 1]


def test_mass_budget_tiny_state():
    """mass:  0.1 0.4 0.05 0.3 0.15   tau=0.2 -> need 0.8: 0.4 + 0.3 + 0.15 = 0.85."""
    keep = PerQueryMass(0.2).keep(_row(0.1, 0.4, 0.05, 0.3, 0.15))
    assert keep[0].tolist() == [0, 1, 0, 1, 1]


def test_mass_budget_exact_target_is_reached_not_exceeded():
    """Dyadic masses are exact in float64: 0.5 + 0.25 reaches 1 - 0.25 exactly."""
    keep = PerQueryMass(0.25).keep(_row(0.125, 0.5, 0.125, 0.25))
    assert keep[0].tolist() == [0, 1, 0, 1]


def test_ties_by_position_ascending():
    """Four equal masses, need two: the two oldest positions."""
    p = _row(0.25, 0.25, 0.25, 0.25)
    assert PerQueryMass(0.5).keep(p)[0].tolist() == [1, 1, 0, 0]
    # stored as slots with positions [3, 1, 0, 2]: still positions 0 and 1 (slots 2, 1)
    pos = torch.tensor([3, 1, 0, 2])
    assert PerQueryMass(0.5).keep(p, pos)[0].tolist() == [0, 1, 1, 0]


def test_protected_tokens_are_kept_and_count_toward_the_mass():
    """mass: 0.0 0.05 0.5 0.05 0.4 (positions 0..4); protect sink 0 and the newest 1.

    Protected: positions 0 (mass 0.0) and 4 (mass 0.4) -> 0.4; tau 0.1 needs 0.9:
    add 0.5 (position 2) -> 0.9. Position 0 is kept although it has no mass.
    """
    p = _row(0.0, 0.05, 0.5, 0.05, 0.4)
    keep = PerQueryMass(0.1, protect_sinks=1, protect_recent=1).keep(p)
    assert keep[0].tolist() == [1, 0, 1, 0, 1]
    # protection alone already reaching the mass: nothing else is added
    keep = PerQueryMass(0.5, protect_recent=2).keep(_row(0.1, 0.3, 0.05, 0.15, 0.4))
    assert keep[0].tolist() == [0, 0, 0, 1, 1]


def test_batched_rows_are_independent():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, 3, 9, generator=g, dtype=F64) * 2, -1)
    pol = PerQueryMass(0.15, protect_sinks=1)
    keep = pol.keep(p)
    assert keep.shape == (2, 3, 9)
    for i in range(2):
        for j in range(3):
            assert torch.equal(keep[i, j], pol.keep(p[i, j:j + 1])[0])


def test_empty_cache():
    p = torch.zeros(3, 0, dtype=F64)
    assert PerQueryMass(0.1).keep(p).shape == (3, 0)


def test_policies_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PerQueryMass(0.1).tau = 0.2
    with pytest.raises(dataclasses.FrozenInstanceError):
        FixedWindow(4).window = 5


def test_inputs_not_mutated():
    p = torch.softmax(torch.randn(4, 7, dtype=F64), -1)
    pos = torch.tensor([6, 5, 4, 3, 2, 1, 0])
    p0, pos0 = p.clone(), pos.clone()
    PerQueryMass(0.2, protect_sinks=1, protect_recent=2).keep(p, pos)
    FixedWindow(2, sinks=1).keep(p, pos)
    assert torch.equal(p, p0) and torch.equal(pos, pos0)


# ------------------------------------------------------- brute-force minimality


def _brute_force_min_size(p: torch.Tensor, protected: torch.Tensor, tau: float) -> int:
    """Smallest size of a superset of ``protected`` whose kept_mass reaches 1 - tau."""
    n = p.shape[-1]
    for size in range(n + 1):
        for subset in itertools.combinations(range(n), size):
            keep = torch.zeros(n, dtype=torch.bool)
            keep[list(subset)] = True
            if (protected & ~keep).any():
                continue
            if kept_mass(p, keep).item() >= 1 - tau:
                return size
    return n


@st.composite
def _instances(draw):
    """Dyadic masses (multiples of 1/64 summing to exactly 1) and dyadic tau: every
    partial sum is exact in float64, so minimality is checked with no rounding at
    all, and equal parts make exact ties common."""
    n = draw(st.integers(1, 7))
    if draw(st.booleans()):   # a random composition of 64
        cuts = sorted(draw(st.lists(st.integers(0, 64), min_size=n - 1, max_size=n - 1)))
        parts = [b - a for a, b in zip([0] + cuts, cuts + [64])]
    else:                     # few distinct values: ties at the cut-off are the rule
        head = draw(st.lists(st.sampled_from([4, 8, 16]), min_size=n - 1, max_size=n - 1).filter(lambda xs: sum(xs) <= 64))
        parts = head + [64 - sum(head)]
    tau = draw(st.sampled_from([1 / 64, 1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4, 63 / 64]))
    sinks = draw(st.integers(0, 2))
    recent = draw(st.integers(0, 2))
    perm = draw(st.permutations(list(range(n))))
    return torch.tensor(parts, dtype=F64) / 64, tau, sinks, recent, torch.tensor(perm)


@settings(max_examples=300, deadline=None)
@given(_instances())
def test_mass_budget_is_minimal_and_reaches_the_mass(inst):
    p, tau, sinks, recent, pos = inst
    pol = PerQueryMass(tau, protect_sinks=sinks, protect_recent=recent)
    keep = pol.keep(p.unsqueeze(0), pos)[0]
    protected = pol.protected(pos)
    assert (keep | ~protected).all()                                   # protected always kept
    assert kept_mass(p, keep).item() >= 1 - tau                         # reaches the mass
    assert int(keep.sum()) == _brute_force_min_size(p, protected, tau)  # and no smaller set does


@settings(max_examples=200, deadline=None)
@given(_instances())
def test_mass_budget_ties_are_deterministic_under_storage_order(inst):
    """Storing the same tokens in another slot order (p and positions permuted
    together) permutes the kept mask the same way: the choice depends on mass and
    position only. Among equal masses the older position wins."""
    p, tau, sinks, recent, pos = inst
    pol = PerQueryMass(tau, protect_sinks=sinks, protect_recent=recent)
    keep = pol.keep(p.unsqueeze(0), pos)[0]
    shuffle = torch.arange(p.numel()).flip(0)
    keep2 = pol.keep(p[shuffle].unsqueeze(0), pos[shuffle])[0]
    assert torch.equal(keep2, keep[shuffle])
    prot = pol.protected(pos)
    for i in range(p.numel()):
        for j in range(p.numel()):
            if keep[i] and not keep[j] and not prot[i]:
                # an unprotected kept token outranks every dropped one
                assert p[i] > p[j] or (p[i] == p[j] and pos[i] < pos[j])


def test_mass_budget_minimal_on_random_softmax_rows():
    g = torch.Generator().manual_seed(5)
    for _ in range(20):
        n = int(torch.randint(2, 9, (1,), generator=g))
        p = torch.softmax(torch.randn(n, generator=g, dtype=F64) * 2, -1)
        tau = float(torch.rand(1, generator=g)) * 0.9 + 0.05
        keep = PerQueryMass(tau).keep(p.unsqueeze(0))[0]
        assert int(keep.sum()) == _brute_force_min_size(p, torch.zeros(n, dtype=torch.bool), tau)


def test_kept_mass_never_below_target_at_scale():
    g = torch.Generator().manual_seed(6)
    p = torch.softmax(torch.randn(500, 300, generator=g, dtype=F64) * 3, -1)
    for tau in (0.3, 0.1, 0.01, 1e-6):
        keep = PerQueryMass(tau).keep(p)
        km = kept_mass(p, keep)
        assert (km >= 1 - tau).all()
        # dropping the lightest kept token must fall below the target (minimality, fast form)
        lightest = torch.where(keep, p, torch.inf).amin(-1)
        assert ((km - lightest) < 1 - tau).all()


def test_float32_attention():
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(50, 40, generator=g), -1)
    keep = PerQueryMass(0.05).keep(p)
    assert (kept_mass(p, keep) >= 1 - 0.05).all()


# -------------------------------------------------------------------- bad input


@pytest.mark.parametrize("make,exc,match", [
    (lambda: PerQueryMass(0.0), ValueError, r"tau must be in the open interval \(0, 1\), got 0.0"),
    (lambda: PerQueryMass(1.0), ValueError, r"got 1.0"),
    (lambda: PerQueryMass(float("nan")), ValueError, r"got nan"),
    (lambda: PerQueryMass(None), TypeError, r"tau must be a real number, got NoneType"),
    (lambda: PerQueryMass(0.1, protect_sinks=-1), ValueError, r"protect_sinks must be >= 0, got -1"),
    (lambda: PerQueryMass(0.1, protect_recent=1.5), TypeError, r"protect_recent must be an int, got float 1.5"),
    (lambda: FixedWindow(0), ValueError, r"window \+ sinks must be >= 1 .*got 0 \+ 0"),
    (lambda: FixedWindow(-2), ValueError, r"window must be >= 0, got -2"),
    (lambda: FixedWindow(4, sinks=True), TypeError, r"sinks must be an int, got bool True"),
])
def test_bad_config(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


P = torch.softmax(torch.randn(2, 5, dtype=F64), -1)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: PerQueryMass(0.1).keep(torch.tensor([[0.5, 0.5], [0.25, 0.25]], dtype=F64)), ValueError,
     r"attention rows must sum to 1 \(within atol=.*\): row \(1,\) sums to 0.5"),
    (lambda: PerQueryMass(0.1).keep(torch.tensor([[0.5, float("nan")]], dtype=F64)), ValueError, r"attention must be finite: found nan at index \(0, 1\)"),
    (lambda: PerQueryMass(0.1).keep(torch.tensor([[1.5, -0.5]], dtype=F64)), ValueError, r"non-negative: found -0.5"),
    (lambda: PerQueryMass(0.1).keep(P, torch.arange(4)), ValueError, r"positions must have shape \(5,\) .*got \(4,\)"),
    (lambda: PerQueryMass(0.1).keep(P, torch.arange(5).int()), TypeError, r"positions must have dtype torch.int64, got torch.int32"),
    (lambda: PerQueryMass(0.1).keep(P, torch.tensor([0, 1, 1, 2, 3])), ValueError, r"positions must be distinct"),
    (lambda: FixedWindow(2).keep(P, torch.tensor([0, -1, 2, 3, 4])), ValueError, r"positions must be >= 0, got min -1"),
    (lambda: FixedWindow(2).keep(P.tolist()), TypeError, r"attention must be a Tensor, got list"),
    (lambda: Full().keep(P, [0, 1, 2, 3, 4]), TypeError, r"positions must be an int64 Tensor, got list"),
])
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
