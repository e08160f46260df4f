"""``streamkv bench --read``: every format, position map, tier format and the paged branch is read
and reported with its ratio to the dense read; verdicts follow the ratios; a compiled read equals
the eager one. Timings are not asserted (benchmarks are not tests)."""

from __future__ import annotations

import json

import pytest
import torch

from streamkv_lab.bench.reads import (
    READ_TARGETS,
    TIER_FORMATS,
    _reader,
    build_variant,
    evaluate_read_targets,
    own_code,
    read_variants,
)
from streamkv_lab.bench.shapes import SHAPES, get_shape
from streamkv_lab.cli import main
from streamkv.positions import POSITION_MAPS
from streamkv.stores import KV_FORMATS


def test_bench_read_runs_every_variant_and_writes_its_json(tmp_path, capsys):
    out, png = tmp_path / "read.json", tmp_path / "read.png"
    argv = ["bench", "--read", "--read-shape", "tiny-decode", "--modes", "eager", "--repeats", "1", "--threads", "1",
            "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0, capsys.readouterr().err[-2000:]
    printed = capsys.readouterr().out
    assert "read targets" in printed and "tier:int8" in printed
    doc = json.loads(out.read_text())
    assert sorted(doc["argv"]) == sorted(["streamkv", *argv])  # every option recorded
    read = doc["read"]
    rec = read["shapes"]["tiny-decode"]
    names = set(rec["variants"])
    assert {f"format:{f}" for f in KV_FORMATS} <= names, "every storage format is read"
    assert {f"map:{m}" for m in POSITION_MAPS} <= names, "every position map is read"
    assert {f"tier:{f}" for f in TIER_FORMATS} | {"dense", "paged"} <= names
    for name, row in rec["variants"].items():
        e = row["eager"]
        assert e["ms"] > 0 and e["transient_peak_bytes"] >= 0, name
        assert e["ratio_vs_dense"] == pytest.approx(e["ms"] / rec["variants"]["dense"]["eager"]["ms"])
        assert "compiled" not in row
    assert rec["timing"]["load_average_before"] is None or len(rec["timing"]["load_average_before"]) == 3
    assert "foreign_cpu_share" in rec["timing"]
    # a decode shape: every variant but the reference and the tier with statistics has the 2x target
    assert {t["variant"] for t in rec["targets"]} == names - {"dense", *(f"tier:{f}+statistics" for f in TIER_FORMATS)}
    for t in read["targets"]:
        assert t["met"] == (t["value"] <= t["threshold"]) and t["threshold"] == READ_TARGETS["decode"][1]
    assert png.stat().st_size > 5_000


def test_read_targets_follow_the_ratios():
    shape = get_shape("tiny-video")
    rows = {"dense": {"category": "dense", "eager": {"ratio_vs_dense": 1.0}},
            "format:int8": {"category": "format:int8", "eager": {"ratio_vs_dense": 1.29}},
            "format:int4": {"category": "format:int4", "eager": {"ratio_vs_dense": 1.51}},
            "format:fp8": {"category": "format:fp8", "eager": {"ratio_vs_dense": 9.0}},
            "map:absolute": {"category": "map", "eager": {"ratio_vs_dense": None}},
            "paged": {"category": "paged", "eager": {"ratio_vs_dense": 1.05}}}
    got = {t["variant"]: t for t in evaluate_read_targets(shape, rows, ("eager",))}
    assert got["format:int8"]["met"] is True and got["format:int4"]["met"] is False
    assert got["paged"]["met"] is True and got["map:absolute"]["met"] is None
    assert "format:fp8" not in got and "dense" not in got  # no target stated for them


@pytest.mark.parametrize("name", ["format:int4", "map:cache_relative", "tier:int8", "paged"])
def test_a_compiled_read_equals_the_eager_one(name):
    """What the bench times compiled is the same read (the tier's rows included)."""
    torch._dynamo.reset()
    shape = get_shape("tiny-video")
    category = dict(read_variants(shape))[name]
    v = build_variant(name, category, shape, 0)
    fn = _reader(v, shape.causal)
    eager = fn(v.q)
    compiled = torch.compile(own_code(fn, "read_test"), backend="eager", fullgraph=True)(v.q)
    assert torch.allclose(compiled.float(), eager.float(), atol=1e-2, rtol=0), float((compiled - eager).abs().max())


@pytest.mark.parametrize("name", ["map:cache_relative", "format:int8", "tier:int4"])
def test_one_query_reads_as_the_last_row_of_the_span(name):
    """The default read (one query) is the span's last row: its rotation and masks follow it."""
    from streamkv_lab.bench.reads import _last_rows

    shape = get_shape("tiny-video")
    v = build_variant(name, dict(read_variants(shape))[name], shape, 0)
    whole = _reader(v, shape.causal)(v.q)
    v.view = _last_rows(v.view, 1)
    one = _reader(v, shape.causal)(v.q[:, -1:].contiguous())
    assert torch.allclose(one.float(), whole[:, -1:].float(), atol=2e-2, rtol=0), float((one - whole[:, -1:]).abs().max())


def test_own_code_gives_each_closure_its_own_code_object():
    fns = [lambda x, i=i: x + i for i in range(3)]
    own = [own_code(f, f"f{i}") for i, f in enumerate(fns)]
    assert len({f.__code__ for f in fns}) == 1 and len({f.__code__ for f in own}) == 3
    assert [f(1) for f in own] == [1, 2, 3]


def test_the_commands_shape_names_are_the_registry():
    from streamkv_lab.commands.bench import _READ_SHAPES, _SHAPES
    from streamkv_lab.commands.chart import _CHART_SHAPES, _VIDEO_SHAPES

    assert _SHAPES == tuple(SHAPES)
    assert set(_READ_SHAPES) <= set(SHAPES) and set(_CHART_SHAPES) <= set(SHAPES)
    assert set(_VIDEO_SHAPES) == {n for n, s in SHAPES.items() if s.family == "video"}


def test_video_shapes_keep_the_presets_geometry():
    from streamkv_lab.bench.presets import get_preset

    for name in ("self-forcing", "lingbot-world"):
        s, p = get_shape(name), get_preset(name)
        assert (s.capacity, s.sink, s.span, s.head_dim, s.model_heads) == (p.capacity, p.sink, p.chunk, p.head_dim,
                                                                          p.heads)
        assert s.grid[0] * s.grid[1] == p.tokens_per_frame


def test_read_targets_are_judged_at_the_span_only(capsys):
    """The read targets are set at a chunk of queries: a video shape read by fewer rows than its
    span records its ratios and judges none; read by the span, every target variant is judged."""
    from streamkv_lab.bench.reads import measure_shape

    shape = get_shape("tiny-video")
    one = measure_shape(shape, repeats=1, modes=("eager",), queries=1)
    assert one["queries"] == 1 and one["targets"] == []
    assert all(row["eager"]["ratio_vs_dense"] > 0 for row in one["variants"].values())
    span = measure_shape(shape, repeats=1, modes=("eager",))
    assert span["queries"] == shape.span and {t["variant"] for t in span["targets"]} >= {"format:int8", "paged"}
    assert main(["bench", "--read", "--read-queries", "0"]) == 2
    assert "--read-queries must be >= 1" in capsys.readouterr().err
