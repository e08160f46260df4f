"""``streamkv certify``: a short run end to end, its JSON, and bad input."""

import json

import pytest

from streamkv_lab.cli import main

KEYS = ("queries_checked", "violations", "tightness_median", "tightness_p95", "summary_bytes_ratio", "recall_events",
        "recalled_tokens")


@pytest.mark.parametrize("cache", ["ring", "mass"])
def test_certify_json_with_recall(tmp_path, cache, capsys):
    out = tmp_path / "c.json"
    plot = tmp_path / "c.png"
    rc = main(["certify", "--cache", cache, "--recall", "--tau", "0.1", "--synthetic-frames", "20", "--dit-chunks", "5",
               "--pool-events", "4", "--every", "4", "--json", str(out), "--plot", str(plot)])
    assert rc == 0
    r = json.loads(out.read_text())
    for k in KEYS:
        assert k in r, k
    assert r["violations"] == 0 and r["count_mismatch"] == 0
    assert r["queries_checked"] == sum(x["queries_checked"] for x in r["runs"].values()) > 10_000
    assert r["over_tau"] == 0 and r["recall_events"] > 0 and r["recalled_tokens"] > 0
    assert set(r["tightness"]) == {"synthetic", "dit"}
    assert plot.stat().st_size > 10_000
    assert "queries_checked" in capsys.readouterr().out


def test_certify_bad_input(capsys):
    assert main(["certify", "--tau", "1.5"]) == 2
    assert "tau" in capsys.readouterr().err
    assert main(["certify", "--recall-slots", "0"]) == 2


@pytest.mark.parametrize("cache", ["ring", "mass"])
def test_default_run_meets_the_done_criteria(cache):
    """The default ``streamkv certify`` settings: >= 1e5 checked rows, zero violations, summaries
    <= 3% of the K/V they summarise."""
    from streamkv_lab.experiments.certify import run_certify

    r = run_certify(cache)
    assert r["queries_checked"] >= 100_000 and r["nontrivial"] >= 100_000
    assert r["violations"] == 0 and r["count_mismatch"] == 0
    assert r["summary_bytes_ratio"] <= 0.03
    assert r["tightness"]["synthetic"]["median"] >= 1 and r["tightness"]["dit"]["median"] >= 1
