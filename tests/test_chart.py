"""``streamkv chart``: its rows (every scored kind of the registry, the budgets, the tier), the
capacities a budget buys, the counts of a steady chunk eager and compiled, and targets computed
from the measured values. The command's end-to-end run is in ``test_cli_smoke.py``."""

from __future__ import annotations

import pytest
import torch

from streamkv_lab.bench.chart import measure_chart_shape
from streamkv_lab.bench.chart_report import CHART_TARGETS, ROW_KEYS, evaluate_chart_targets
from streamkv_lab.bench.chart_rows import Geometry, Row, chart_caches, chart_rows, parse_budget, row_capacity
from streamkv_lab.bench.shapes import get_shape
from streamkv.policies import POLICIES


def test_every_scored_kind_and_the_tier_are_rows():
    caches = chart_caches()
    assert {k for k, p in POLICIES.items() if p.per_head} <= set(caches)
    assert {"full", "ring", "tier", "tier+certificates"} <= set(caches)
    rows = chart_rows(caches, ("bf16", "int8"), ("tokens:1/4", "bytes:1/4"))
    keys = {r.key for r in rows}
    assert {"full/bf16/all", "full/int8/all", "ring/int8/bytes:1/4", "tova/bf16/tokens:1/4"} <= keys
    assert "ring/bf16/bytes:1/4" not in keys  # bf16's byte budget is its token budget: listed once
    assert {r.key for r in rows if r.tier} == {"tier/int8/bytes:1/4", "tier+certificates/int8/bytes:1/4"}
    # a byte budget alone: bf16 keeps it
    assert "ring/bf16/bytes:1/2" in {r.key for r in chart_rows(("ring",), ("bf16",), ("bytes:1/2",))}


@pytest.mark.parametrize("text", ["tokens:2", "tokens:0", "bits:1/2", "bytes:x", "tokens"])
def test_budgets_out_of_range_are_refused(text):
    with pytest.raises(ValueError, match="tokens:F or bytes:F"):
        parse_budget(text)


def test_capacities_follow_the_budget():
    geo = Geometry(full=1024, sink=4, span=16, unit=1, heads=3, head_dim=64, layers=2)
    cap = lambda key: row_capacity(Row(*key.split("/", 2)), geo)  # noqa: E731
    assert cap("ring/bf16/tokens:1/4")["capacity"] == 256
    assert cap("ring/bf16/bytes:1/4")["capacity"] == 256
    int8 = cap("ring/int8/bytes:1/4")["capacity"]
    assert 256 < int8 <= 1024 * geo.full_bytes / 4 / geo.token_bytes("int8") + 1
    assert cap("ring/int4/bytes:1/2")["capacity"] == 1024  # at most every token
    tier = cap("tier/int8/bytes:1/4")
    assert tier["tier1"] >= 4 + 32 and tier["tier2"] % 16 == 0
    spent = tier["tier1"] * geo.token_bytes("bf16") + tier["tier2"] * (geo.token_bytes("int8") + geo.heads * geo.layers)
    assert spent <= geo.full_bytes / 4
    video = Geometry(full=768, sink=32, span=32, unit=16, heads=4, head_dim=32, layers=4)
    assert row_capacity(Row("ring", "bf16", "tokens:1/4"), video)["capacity"] % 16 == 0
    with pytest.raises(ValueError, match="fewer than the 32 sinks and a span"):
        row_capacity(Row("ring", "bf16", "tokens:1/4"), Geometry(96, 32, 32, 16, 1, 8, 1))


def test_a_steady_chunk_counts_eager_and_compiled():
    """No host sync per steady chunk for the ring or a scored kind (check_finite=False), eager
    and compiled, one graph with no recompile; the full cache is its own reference."""
    torch._dynamo.reset()
    rows = [Row("full", "bf16", None), Row("ring", "int8", "tokens:1/2"), Row("tova", "bf16", "tokens:1/2"),
            Row("keydiff", "int8", "bytes:1/2")]
    rec = measure_chart_shape(get_shape("tiny-video"), rows, modes=("eager", "compiled"), repeats=1,
                              backend="eager")["rows"]
    assert rec["full/bf16/all"]["eager"]["ratio_to_full"] == 1.0 and rec["full/bf16/all"]["bytes_ratio_to_full"] == 1
    for key, r in rec.items():
        assert "not_run" not in r, (key, r.get("not_run"))
        for mode in ("eager", "compiled"):
            m = r[mode]
            assert m["ms_per_chunk"] > 0 and m["host_syncs_per_chunk"] == 0, (key, mode, m.get("syncs"))
            assert m["allocations_per_chunk"] > 0  # the attention's output at least: counted, not assumed
        assert r["compiled"]["recompiles"] == 0 and r["compiled"]["graph_breaks"] == 0, key
    assert rec["tova/bf16/tokens:1/2"]["cache_work_ms"] > 0
    assert rec["ring/int8/tokens:1/2"]["cache_work_ratio_to_ring"] == 1.0


def test_a_budget_the_library_refuses_is_recorded_not_run():
    rec = measure_chart_shape(get_shape("tiny-video"), [Row("tova", "bf16", "tokens:5/24"),
                                                        Row("ring", "bf16", "tokens:5/24"),
                                                        Row("full", "bf16", None)], repeats=1)["rows"]
    # 5/24 of 384 tokens is 80 slots: the ring holds them; TOVA's budget needs the 32 sinks, the newest
    # 32-token chunk and room for the next one (96)
    assert "must hold the newest chunk and the next chunk" in rec["tova/bf16/tokens:5/24"]["not_run"]
    assert "not_run" not in rec["ring/bf16/tokens:5/24"] and rec["ring/bf16/tokens:5/24"]["eager"]["ms_per_chunk"] > 0


def _row(**kw):
    return {**{k: None for k in ROW_KEYS}, **kw}


def test_chart_targets_follow_the_values():
    rows = [_row(shape="self-forcing", mode="eager", key="tova/bf16/tokens:1/4", cache="tova", format="bf16",
                 ratio_to_full=0.39, cache_work_ratio_to_ring=1.6, loaded_ratio_to_full=0.78, load_slowdown=2.0),
            _row(shape="self-forcing", mode="eager", key="h2o/bf16/tokens:1/4", cache="h2o", format="bf16",
                 ratio_to_full=0.41, cache_work_ratio_to_ring=1.2),
            _row(shape="self-forcing", mode="eager", key="tier/int8/bytes:1/4", cache="tier", format="int8",
                 ratio_to_full=None, not_run="ValueError: no room")]
    got = {(t["target"], t["row"]): t for t in evaluate_chart_targets(rows, ("h2o", "tova"))}
    assert got[("scored_quarter", "tova/bf16/tokens:1/4")]["met"] is True
    assert got[("scored_quarter", "h2o/bf16/tokens:1/4")]["met"] is False
    assert got[("cache_work", "tova/bf16/tokens:1/4")]["met"] is False
    assert got[("cache_work", "h2o/bf16/tokens:1/4")]["met"] is True
    assert got[("loaded", "tova/bf16/tokens:1/4")]["met"] is False  # under load 2x its quiet ratio
    assert "--load" in got[("loaded", "h2o/bf16/tokens:1/4")]["why_not_measured"]  # timed quietly only
    # a target of a shape the run did not include is listed, not measured
    other = evaluate_chart_targets([{**r, "shape": "smollm2-decode"} for r in rows], ("h2o", "tova"))
    work = [t for t in other if t["target"] == "cache_work"]
    assert work and all(t["met"] is None and "no self-forcing shape" in t["why_not_measured"] for t in work)
    assert got[("tier_quarter", "tier/int8/bytes:1/4")]["why_not_measured"] == "ValueError: no room"
    assert got[("int8_ring_quarter", "ring/int8/tokens:1/4")]["why_not_measured"] == "not in this run"
    assert {name for name, *_ in CHART_TARGETS} == {t for t, _ in got}
