"""The sglang peer of ``streamkv bench``: at a preset that names it, sglang's class and the
drop-in are measured next to the other subjects, their bytes counted per aten op equal the
analytic counts, the drop-in allocates nothing per step; without sglang the original is
skipped with a note; presets without peers keep their keys. No timing is asserted."""

from __future__ import annotations

import json

import pytest

from streamkv_lab.bench import BenchOptions, Preset, run_preset
from streamkv_lab.bench.maintenance import analytic_bytes
from streamkv_lab.bench.peers import load_sglang_causal_kv_cache

#: LongLive 2's structure at a toy size: sink = chunk, global (multi-shot) sinks on
TINY = Preset("tiny-sglang", window_frames=6, chunk_frames=2, sink_frames=2, tokens_per_frame=3, heads=2,
              head_dim=8, dtype="float32", scaling_windows=(), global_sink_frames=2, peers=("sglang",))
OPTS = BenchOptions(repeats=2, transient_steps=1, warmup=1, warmup_s=0.0, sections=("maintenance",))


def test_sglang_and_the_drop_in_are_measured():
    if load_sglang_causal_kv_cache() is None:
        pytest.fail("sglang 0.5.23 is a test dependency: pip install --no-deps sglang==0.5.23 (make test does)")
    rec = run_preset(TINY, OPTS)
    peer = rec["sglang"]
    assert peer["maintenance_ms"]["sglang"] > 0 and peer["maintenance_ms"]["sglang_ring"] > 0
    assert peer["ratio_sglang_over_sglang_ring"] == pytest.approx(
        peer["maintenance_ms"]["sglang"] / peer["maintenance_ms"]["sglang_ring"])
    row = 2 * TINY.token_bytes
    assert rec["bytes_moved"]["sglang"]["retained_copied"] == (TINY.window - TINY.chunk) * row
    for key in ("sglang", "sglang_ring"):
        b = rec["bytes_moved"][key]
        assert b == {**analytic_bytes(key, TINY).to_dict(), "counted": b["counted"]}
        assert b["counted"]["cache"] == b["chunk_written"] + b["retained_copied"], key
        assert b["counted"]["temporary"] == b["clone_temporary"], key
    assert rec["transient_bytes"]["sglang_ring"]["allocated_bytes"] == 0
    assert rec["transient_bytes"]["sglang"]["allocated_bytes"] >= rec["bytes_moved"]["sglang"]["clone_temporary"] // 2
    assert rec["preset"]["peers"] == ["sglang"] and rec["preset"]["global_sink_frames"] == 2
    json.dumps(rec, allow_nan=False)


def test_without_sglang_the_original_is_skipped_with_a_note(monkeypatch, capsys):
    import streamkv_lab.bench.maintenance as maintenance
    from streamkv_lab.bench import print_report

    monkeypatch.setattr(maintenance, "load_sglang_causal_kv_cache", lambda: None)
    rec = run_preset(TINY, BenchOptions(repeats=2, transient_steps=0, count_bytes=False, warmup=1, warmup_s=0.0,
                                        sections=("maintenance",)))
    assert rec["sglang"]["maintenance_ms"]["sglang"] is None and rec["sglang"]["maintenance_ms"]["sglang_ring"] > 0
    assert rec["sglang"]["ratio_sglang_over_sglang_ring"] is None
    assert rec["bytes_moved"]["sglang"] is None and rec["transient_bytes"]["sglang"] is None
    assert any("sglang is not installed" in n for n in rec["notes"])
    print_report({"presets": {TINY.name: rec}})
    assert "sglang is not installed" in capsys.readouterr().out


def test_presets_without_peers_have_no_peer_keys():
    rec = run_preset("small", BenchOptions(repeats=2, transient_steps=0, count_bytes=False, warmup=1, warmup_s=0.0,
                                           sections=("maintenance",)))
    assert "sglang" not in rec and "sglang" not in rec["bytes_moved"] and rec["preset"]["peers"] == []
    with pytest.raises(ValueError, match="unknown peers"):
        Preset("x", window_frames=6, chunk_frames=2, sink_frames=0, tokens_per_frame=1, heads=1, head_dim=2,
               peers=("vllm",))
