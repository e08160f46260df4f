"""The differential fuzzer: a bounded sample runs clean, it fuzzes every registered policy, and
it finds what it is meant to find (each control breaks the library in one way and checks the
count that must see it)."""

import dataclasses
import json
import random
from unittest import mock

import torch

from kinds import CERTIFIED
from streamkv.caches.observers import Observers
from streamkv.certify import Certifier
from streamkv_lab import fuzz
from streamkv_lab.cli import main
from streamkv_lab.fuzz import FuzzResult, draw_layout, fuzz_layout, kinds, run_fuzz
from streamkv.policies import POLICIES, FixedBudget, Ring
from streamkv.policies.scored import Scores


def _sample(keep, layouts: int, seed: int, drawn: tuple[str, ...], **replace) -> FuzzResult:
    """``layouts`` random layouts of the kinds ``drawn`` that ``keep`` accepts (with ``replace``
    applied), fuzzed. Drawing from ``drawn`` only keeps the sample the same however many kinds
    the registry holds."""
    rng, res = random.Random(seed), FuzzResult()
    with torch.no_grad(), mock.patch.object(fuzz, "kinds", lambda: drawn):
        while res.layouts < layouts:
            lay = draw_layout(rng)
            if keep(lay):
                fuzz_layout(dataclasses.replace(lay, **replace), rng, res)
    return res


SAMPLE_SEED = 2


def test_a_bounded_sample_is_clean():
    with torch.no_grad():
        r = run_fuzz(30, seed=SAMPLE_SEED)
    assert r.layouts == 30 and r.calls == 30 * 30 and r.rejected_calls > 100
    assert r.certified_layouts > 12 and r.group_layouts > 5 and r.certified_layouts_evicting > 8
    assert r.certified_nontrivial_rows > 300 and r.observer_faults > 70
    fault_kinds = {k.split("_")[0] for k in r.observer_fault_kinds}
    assert fault_kinds == {"veto", "aborted", "after", "nan"}, r.observer_fault_kinds
    assert (r.state_changes_after_rejection, r.bad_calls_accepted, r.mismatches, r.certificate_undercounts) == (
        0, 0, 0, 0), r.failures


def test_every_registered_policy_is_drawn_plain_certified_and_two_tier():
    want = set(kinds())
    assert want == {p + n for n in POLICIES for p in ("", "certified-", "twotier-")}
    rng = random.Random(0)
    lays = [draw_layout(rng) for _ in range(3000)]
    assert {lay.kind for lay in lays} == want
    for lay in lays:
        if lay.kind.startswith("twotier-"):  # sketches are refused on float64 caches
            assert lay.dtype != "float64" and lay.recall_slots > 0 and dict(lay.certifier)["sketch_bits"] in (4, 8)
        if issubclass(POLICIES[lay.policy], FixedBudget):
            assert lay.sink + lay.chunk <= dict(lay.params)["budget"] <= lay.sink + lay.window - lay.chunk


class _Newest(FixedBudget):
    """A policy the library does not have: evict the oldest held tokens first."""

    name = "fuzz-newest"
    needs_queries = False

    def priority(self, scores: Scores) -> torch.Tensor:
        return scores.positions.double()


def test_a_policy_added_to_the_registry_is_fuzzed_with_no_edit(monkeypatch):
    monkeypatch.setitem(POLICIES, _Newest.name, _Newest)
    variants = ("fuzz-newest", "certified-fuzz-newest", "twotier-fuzz-newest")
    assert set(variants) <= set(kinds())
    for i, kind in enumerate(variants):  # each variant drawn on its own: the sample does not move as the registry grows
        res = _sample(lambda lay: True, 2, seed=4 + i, drawn=(kind,))
        assert res.kinds == {kind: 2}, res.kinds
        assert res.certified_nontrivial_rows > 0 or kind == "fuzz-newest"
        assert (res.state_changes_after_rejection, res.bad_calls_accepted, res.mismatches,
                res.certificate_undercounts) == (0, 0, 0, 0), res.failures


def test_it_catches_a_ring_that_writes_the_wrong_slot(monkeypatch):
    """Control: shift the ring's slot plan by one; the fuzzer must report mismatches."""
    plan = Ring._plan

    def off_by_one(self, start):
        plan(self, start)
        self._stage.add_(1).remainder_(self.layout.capacity)

    monkeypatch.setattr(Ring, "_plan", off_by_one)
    res = _sample(lambda lay: lay.window > lay.chunk, 10, seed=3, drawn=("ring",))
    assert res.mismatches > 0


# certified layouts without recall (the recall slots' own finding is tests/test_fuzz_findings.py),
# with the fault observer after the certifier: a veto comes after the certifier's prepare; of a
# window kind and a scored kind (tests/kinds.py), not of however many kinds the registry holds
BOXES = tuple(CERTIFIED)


def _boxes(lay):
    return lay.recall_slots == 0


def test_it_catches_a_certifier_that_records_an_eviction_when_it_is_announced(monkeypatch):
    """Control: the old behaviour (record in prepare, before the change is applied). A veto or a
    refusing branch then leaves the certifier changed, and the retry records the tokens twice."""
    clean = _sample(_boxes, 4, seed=3, drawn=BOXES, fault_first=False)
    assert (clean.state_changes_after_rejection, clean.certificate_undercounts) == (0, 0), clean.failures
    prepare = Certifier.prepare

    def eager(self, change):
        if change.eviction is not None and self.broken is None:
            self._record(self._capture(change.eviction))
            return None
        return prepare(self, change)

    monkeypatch.setattr(Certifier, "prepare", eager)
    res = _sample(_boxes, 4, seed=3, drawn=BOXES, fault_first=False)
    assert res.state_changes_after_rejection > 0 and res.certificate_undercounts > 0, res.failures


def test_it_catches_a_certifier_that_misses_an_eviction(monkeypatch):
    """Control: every other applied eviction is not recorded: the summaries no longer cover what
    left, and the history check must count it."""
    record, seen = Certifier._record, []

    def lossy(self, captured):
        seen.append(1)
        if len(seen) % 2:
            record(self, captured)

    monkeypatch.setattr(Certifier, "_record", lossy)
    res = _sample(_boxes, 4, seed=6, drawn=BOXES)
    assert res.certificate_undercounts > 0 and res.certified_nontrivial_rows > 0


def test_it_catches_an_observer_failure_that_stops_the_others_being_told(monkeypatch):
    """Control: after a change was applied, an observer raises and the observers after it are
    not told (the message still says the change stands). The certifier after the fault then
    misses the change: the state differs from the fault-free twin's."""

    tell_all = Observers.tell

    def tell(self, change, actions):  # one observer at a time: the first failure ends the telling
        members = self.members
        try:
            for obs, action in zip(list(members), actions):
                self.members = [obs]
                tell_all(self, change, [action])
        finally:
            self.members = members

    monkeypatch.setattr(Observers, "tell", tell)
    res = _sample(_boxes, 6, seed=8, drawn=BOXES, fault_first=True)
    assert res.mismatches > 0 and any("the twin's" in f for f in res.failures), res.failures


def test_cli_writes_the_counts(tmp_path):
    out = tmp_path / "f.json"
    assert main(["fuzz", "--layouts", "8", "--seed", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["layouts"] == 8 and data["calls"] == 240
    assert data["state_changes_after_rejection"] == 0 and data["mismatches"] == 0 and data["rejected_calls"] > 0
    assert data["certificate_undercounts"] == 0 and data["certified_layouts"] > 0 and data["observer_faults"] > 0
    assert {"seconds", "bad_calls_accepted", "kinds", "versions", "observer_fault_kinds"} <= set(data)


# ------------------------------------------------------------------ fork trees (--forks)
def _forks(cases: int, seed: int = 0):
    from streamkv_lab.fuzz_branches import fuzz_branches

    with torch.no_grad():
        return fuzz_branches(cases, steps=30, seed=seed)


def test_fork_trees_run_clean_over_kinds_formats_and_maps():
    r = _forks(8)
    assert (r["mismatches"], r["state_changes_after_rejection"], r["bad_calls_accepted"], r["leaked_pages"]) == (
        0, 0, 0, 0), r["failures"]
    assert r["forks"] > 10 and r["releases"] > 10 and r["exports"] > 5 and r["rejected_calls"] > 30
    assert r["max_depth"] >= 3 and r["max_fanout"] == 8 and r["rewinds"] > 0 and r["pool_full_refusals"] > 0
    assert len(r["kinds"]) > 3 and len(r["formats"]) > 2 and len(r["maps"]) > 1


def test_fork_trees_catch_a_branch_that_writes_into_shared_pages(monkeypatch):
    """Control: no copy on write (every write goes to the page every branch reads)."""
    from streamkv.stores.pages import PageTable

    monkeypatch.setattr(PageTable, "plan_private", lambda self, *a, **k: None)
    r = _forks(4)
    assert r["mismatches"] > 0


def test_fork_trees_catch_a_release_that_keeps_its_pages(monkeypatch):
    """Control: released pages are never freed."""
    from streamkv.stores.pages import PagePool

    monkeypatch.setattr(PagePool, "drop", lambda self, ids: None)
    r = _forks(4)
    assert r["leaked_pages"] > 0


def test_fork_trees_catch_a_refused_fork_that_changed_something(monkeypatch):
    """Control: a fork that takes a page before it refuses (a span open, n < 1)."""
    from streamkv.caches.branches import Branches

    check = Branches.check_fork

    def leaky(self, n):
        table = self.cache.storage.store.table
        if table is not None and table.pool.free:
            table.host[0] = table.pool.take(1, "leak")[0]
        return check(self, n)

    monkeypatch.setattr(Branches, "check_fork", leaky)
    r = _forks(4)
    assert r["state_changes_after_rejection"] > 0


def test_cli_fuzzes_fork_trees(tmp_path):
    out = tmp_path / "f.json"
    assert main(["fuzz", "--layouts", "1", "--calls", "2", "--forks", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["forks"]["cases"] == 2 and data["forks"]["leaked_pages"] == 0 and data["mismatches"] == 0


def test_the_quant_fuzz_accepts_one_rounding_in_a_basis_and_no_other_token():
    """The quantised fuzz's fallback for a Hadamard basis (the store's float32 rotation may round the
    other way at a format's boundary): a stored value of the token passes, another token's fails,
    and outside a basis there is no fallback."""
    import torch

    from streamkv.quant import KV_FORMATS, KVQuant
    from streamkv_lab.fuzz_quant import _one_rounding_apart, round_trip

    g = torch.Generator().manual_seed(3)
    for fmt in KV_FORMATS:
        quant = KVQuant(fmt, basis="hadamard")
        x, other = torch.randn(2, 8, generator=g) * 2, torch.randn(2, 8, generator=g) * 2
        assert _one_rounding_apart(quant, "k", x, round_trip(quant, "k", x)), fmt
        assert not _one_rounding_apart(quant, "k", x, round_trip(quant, "k", other)), fmt
        assert not _one_rounding_apart(KVQuant(fmt), "k", x, round_trip(KVQuant(fmt), "k", x)), fmt
