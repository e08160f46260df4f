"""The differential fuzzer: a bounded sample runs clean, and it finds what it is meant to find."""

import json
import random

import torch

from streamkv.lab.cli import main
from streamkv.lab.fuzz import KINDS, FuzzResult, draw_layout, fuzz_layout, run_fuzz
from streamkv.policies import Ring


def test_a_bounded_sample_is_clean():
    with torch.no_grad():
        r = run_fuzz(120, seed=7)
    assert r.layouts == 120 and set(r.kinds) == set(KINDS)
    assert r.rejected_calls > 300 and r.calls == 120 * 30
    assert (r.state_changes_after_rejection, r.bad_calls_accepted, r.mismatches) == (0, 0, 0), r.failures


def test_it_catches_a_ring_that_writes_the_wrong_slot(monkeypatch):
    """Control: shift the ring's slot plan by one; the fuzzer must report mismatches."""
    plan = Ring._plan

    def off_by_one(self, start):
        plan(self, start)
        self._stage.add_(1).remainder_(self.layout.capacity)

    monkeypatch.setattr(Ring, "_plan", off_by_one)
    rng = random.Random(3)
    res = FuzzResult()
    with torch.no_grad():
        while res.layouts < 40:
            lay = draw_layout(rng)
            if lay.kind == "ring" and lay.window > lay.chunk:
                fuzz_layout(lay, rng, res)
    assert res.mismatches > 0


def test_cli_writes_the_counts(tmp_path):
    out = tmp_path / "f.json"
    assert main(["fuzz", "--layouts", "20", "--seed", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["layouts"] == 20 and data["calls"] == 600
    assert data["state_changes_after_rejection"] == 0 and data["mismatches"] == 0 and data["rejected_calls"] > 0
    assert {"seconds", "bad_calls_accepted", "kinds", "versions"} <= set(data)
