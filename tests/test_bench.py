"""``streamkv bench``: the command runs and writes well-formed JSON; the instruments and
the analytic byte counts are right. Benchmarks are not tests: no timing is asserted."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from streamkv_lab.bench import (
    PRESETS,
    SECTIONS,
    BenchOptions,
    Preset,
    Stats,
    analytic_bytes,
    build_subjects,
    count_written_bytes,
    evaluate_targets,
    get_preset,
    load_block_kv_cache,
    probe_transient,
    run_preset,
    time_interleaved,
)
from streamkv_lab.measure import check_device
from streamkv_lab.cli import main

CPU = torch.device("cpu")
HAVE_FLASHDREAMS = load_block_kv_cache() is not None
#: a sink, and a window that is not a whole number of chunks (sink + window is: flashdreams needs that)
TINY_SINK = Preset("tiny-sink", window_frames=5, chunk_frames=2, sink_frames=1, tokens_per_frame=3, heads=2,
                   head_dim=4, dtype="float32", scaling_windows=())


def _strict_json(text: str) -> dict:
    def no_constant(name: str) -> None:
        raise ValueError(f"JSON contains {name}")

    return json.loads(text, parse_constant=no_constant)


# ======================================================================= command
def test_bench_small_runs_and_writes_well_formed_json(tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", "--preset", "small", "--repeats", "3", "--scaling-repeats", "2",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "current/ring" in printed and "ring/floor" in printed and "flashdreams/ring" in printed
    doc = _strict_json(out.read_text())
    assert doc["schema"] == "streamkv_lab.bench/1"
    assert list(doc["presets"]) == ["small"]
    rec = doc["presets"]["small"]
    caches = ["current", "flashdreams", "ring"]
    for key in ("maintenance_ms", "floor_ms", "ratio_current_over_ring", "ratio_flashdreams_over_ring",
                "ratio_ring_over_floor", "bytes_moved", "transient_bytes", "versions", "preset", "scaling", "targets"):
        assert key in rec, key
    assert set(rec["maintenance_ms"]) == set(caches)
    for k in ("current", "ring"):
        assert rec["maintenance_ms"][k] > 0
    assert rec["floor_ms"] > 0
    assert rec["ratio_current_over_ring"] == pytest.approx(rec["maintenance_ms"]["current"] / rec["maintenance_ms"]["ring"])
    assert rec["ratio_ring_over_floor"] == pytest.approx(rec["maintenance_ms"]["ring"] / rec["floor_ms"])
    if HAVE_FLASHDREAMS:
        assert rec["maintenance_ms"]["flashdreams"] > 0
        assert rec["ratio_flashdreams_over_ring"] > 0
    else:
        assert rec["maintenance_ms"]["flashdreams"] is None and rec["ratio_flashdreams_over_ring"] is None
    present = [k for k in caches + ["floor"] if k != "flashdreams" or HAVE_FLASHDREAMS]
    for k in present:
        b = rec["bytes_moved"][k]
        assert b["written_total"] == b["chunk_written"] + b["retained_copied"] + b["clone_temporary"]
        assert b["traffic"] == 2 * b["written_total"]
        t = rec["transient_bytes"][k]
        assert t["allocated_bytes"] >= 0 and t["peak_bytes"] >= 0 and isinstance(t["by_op"], dict)
    for key in ("torch", "python", "device_name"):
        assert rec["versions"][key]
    assert rec["preset"]["name"] == "small" and rec["preset"]["k_shape"] == list(PRESETS["small"].k_shape)
    sc = rec["scaling"]
    assert sc["windows_frames"] == [6, 12, 21, 42, 63] and sc["chunk_frames"] == 3
    for k in ("current", "ring", "floor"):
        assert len(sc["maintenance_ms"][k]) == 5 and all(x > 0 for x in sc["maintenance_ms"][k])
    assert set(sc["growth_63_over_21"]) >= {"current", "ring"}
    assert {t["met"] for t in rec["targets"].values()} <= {True, False, None}
    assert png.stat().st_size > 10_000
    e2e = doc["end_to_end"]
    for k in ("chronological", "ring"):
        assert e2e[k]["chunk_latency_ms"] > 0 and 0 < e2e[k]["maintenance_share"] < 1
    assert e2e["max_abs_diff"]["ring"] <= 1e-5 * e2e["output_scale"]


def test_cli_rejects_cuda_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rc = main(["bench", "--preset", "small", "--device", "cuda"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--device cuda" in err and "no CUDA device" in err and "Traceback" not in err


def test_cli_choices_are_the_presets():
    from streamkv_lab.commands.bench import _PRESETS

    assert tuple(PRESETS) == _PRESETS


# ======================================================================= presets
def test_self_forcing_preset_is_the_issue_shape():
    p = get_preset("self-forcing")
    assert p.k_shape == (1, 32760, 12, 128) and p.torch_dtype == torch.bfloat16
    assert (p.window, p.chunk, p.sink) == (21 * 1560, 3 * 1560, 0)
    assert p.buffer_bytes == 32760 * 12 * 128 * 2  # ~100.6 MB per K buffer
    assert get_preset("self-forcing-sink").sink == 3 * 1560
    assert get_preset("lingbot").window_frames == 63


def test_bad_preset_and_options_are_rejected():
    with pytest.raises(ValueError, match="unknown preset 'nope'.*self-forcing"):
        get_preset("nope")
    with pytest.raises(ValueError, match="repeats must be"):
        BenchOptions(repeats=0)
    with pytest.raises(ValueError, match="chunk_frames"):
        Preset("bad", window_frames=2, chunk_frames=3, sink_frames=0, tokens_per_frame=1, heads=1, head_dim=1)
    with pytest.raises(ValueError, match="device must be cpu or cuda"):
        check_device("meta")


# ================================================================ analytic bytes
def test_ring_and_floor_move_exactly_the_chunk():
    p = get_preset("self-forcing")
    chunk_kv = 2 * 4680 * 12 * 128 * 2  # K and V, bf16: 28.75 MB
    for subject in ("ring", "floor"):
        b = analytic_bytes(subject, p)
        assert (b.chunk_written, b.retained_copied, b.clone_temporary) == (chunk_kv, 0, 0)
        assert b.traffic == 2 * chunk_kv


@pytest.mark.parametrize("name", ["self-forcing", "self-forcing-sink", "lingbot"])
def test_rolling_caches_also_move_the_retained_window(name):
    p = get_preset(name)
    row = 2 * p.token_bytes
    for subject in ("current", "flashdreams"):
        b = analytic_bytes(subject, p)
        assert b.chunk_written == p.chunk * row
        assert b.retained_copied == (p.window - p.chunk) * row  # sinks stay; the window shifts
        assert b.clone_temporary == b.retained_copied
    if name == "self-forcing":
        assert analytic_bytes("current", p).retained_copied == 2 * 18 * 1560 * 12 * 128 * 2


@pytest.mark.parametrize("preset", [PRESETS["small"], TINY_SINK], ids=lambda p: p.name)
def test_analytic_bytes_equal_the_bytes_each_aten_op_writes(preset):
    subjects, notes = build_subjects(preset, CPU)
    assert ("flashdreams" in subjects) == HAVE_FLASHDREAMS
    for key, s in subjects.items():
        for _ in range(3):  # several steady steps: the count is the same for every one
            counted = count_written_bytes(s.step, s.storages)
            b = analytic_bytes(key, preset)
            assert counted.cache == b.chunk_written + b.retained_copied, key
            assert counted.temporary == b.clone_temporary, key


def test_counter_rules():
    buf = torch.zeros(10, 4)
    src = torch.ones(3, 4)
    idx = torch.tensor([1, 5, 7])
    pos = torch.zeros(3, dtype=torch.long)

    def step():
        buf.narrow(0, 2, 3).copy_(src)  # 48 B into the cache
        buf.index_copy_(0, idx, src)  # 48 B into the cache (the source's rows, not the buffer)
        buf.narrow(0, 0, 5).clone()  # 80 B temporary
        pos.add_(1)  # 24 B metadata

    c = count_written_bytes(step, [buf])
    assert (c.cache, c.temporary, c.metadata) == (96, 80, 24)


# ============================================================== transient memory
def test_transient_probe_sees_an_allocation_and_no_false_one():
    x = torch.zeros(1000)
    seen = probe_transient(lambda: torch.empty(1000, dtype=torch.float32).fill_(1), CPU, steps=2)
    assert seen.allocated_bytes >= 4000 and seen.allocations >= 1 and seen.freed_bytes >= 4000
    assert seen.peak_bytes >= 4000
    one = torch.ones(1000)
    none = probe_transient(lambda: x.add_(one), CPU, steps=2)
    assert (none.allocated_bytes, none.allocations, none.peak_bytes) == (0, 0, 0)
    # a Python scalar operand is wrapped in a 0-dim tensor: a real (tiny) allocation
    scalar = probe_transient(lambda: x.add_(1), CPU, steps=1)
    assert scalar.allocated_bytes > 0


def test_transient_probe_sees_the_roll_clones():
    p = PRESETS["small"]
    subjects, _ = build_subjects(p, CPU)
    t = probe_transient(subjects["current"].step, CPU, steps=1)
    b = analytic_bytes("current", p)
    assert t.allocated_bytes >= b.clone_temporary  # K and V clones (+ the position table's)
    assert t.peak_bytes >= b.clone_temporary // 2  # one clone alive at a time
    floor = probe_transient(subjects["floor"].step, CPU, steps=1)
    assert floor.allocated_bytes == 0


# ================================================================ timing, stats
def test_stats_quantiles_match_numpy():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0, 7.0]
    s = Stats.of(xs)
    for q, got in ((10, s.p10), (25, s.p25), (50, s.median), (75, s.p75), (90, s.p90)):
        assert got == pytest.approx(np.percentile(xs, q))
    assert (s.min, s.max, s.n) == (1.0, 10.0, 7) and s.iqr == pytest.approx(s.p75 - s.p25)
    with pytest.raises(ValueError):
        Stats.of([])


def test_time_interleaved_times_every_step_repeats_times(monkeypatch):
    """Every step once per round, ``repeats`` samples each (the contention detector off: on a machine
    another process loads, such as the suite's other worker, it would replace samples)."""
    from streamkv_lab.measure import timing

    monkeypatch.setattr(timing._RunDelay, "create", staticmethod(lambda: None))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # no stall sentinel
    calls = {"a": 0, "b": 0}

    def mk(name):
        def step():
            calls[name] += 1
        return step

    run = time_interleaved({"a": mk("a"), "b": mk("b")}, repeats=7, device=CPU, warmup=2, warmup_s=0.0)
    assert all(len(v) == 7 and all(ms >= 0 for ms in v) for v in run.samples_ms.values())
    assert calls["a"] == calls["b"] == 2 + 7  # warm-up + timed
    assert run.rounds == 7 and run.detector == "none"


def test_a_loaded_timing_keeps_every_sample_and_the_load_stops_after(monkeypatch):
    """``keep_contended``: under a load the caller made, every sample counts (no extra rounds), where
    the detector calls every sample contended (as it would under the load: forced here, so that the
    verdict does not depend on the scheduler); ``spin_load``'s processes run during the block and are
    gone after."""
    from streamkv_lab.measure import spin_load, timing

    monkeypatch.setattr(timing, "_tolerated_wait_ms", lambda ms: -1.0)  # every sample waited too long
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # no stall sentinel
    step = {"a": lambda: sum(range(20_000))}
    with spin_load(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)  # spinning
        run = time_interleaved(step, repeats=4, device=CPU, warmup=1, warmup_s=0.0, keep_contended=True)
        quiet = time_interleaved(step, repeats=4, device=CPU, warmup=1, warmup_s=0.0)
    assert len(run.samples_ms["a"]) == 4 and run.rounds == 4 and run.clean["a"] == 4
    assert quiet.clean["a"] == 0 and quiet.rounds > 4 and quiet.included["a"]  # the default replaces them
    assert all(p.poll() is not None for p in procs)  # killed and reaped
    with pytest.raises(ValueError, match="process count >= 0, got -1"):
        with spin_load(-1):
            pass


# ======================================================================= targets
def test_targets_verdicts():
    rec = {
        "ratio_flashdreams_over_ring": 45.0, "ratio_ring_over_floor": 1.5, "ratio_current_over_ring": 0.5,
        "scaling": {"growth_63_over_21": {"ring": 1.1}},
        "transient_bytes": {"ring": {"allocated_bytes": 8}},
    }
    t = evaluate_targets(rec)
    assert t["flashdreams_over_ring"]["met"] is True
    assert t["ring_over_floor"]["met"] is False
    assert t["ring_over_current"]["met"] is False and t["ring_over_current"]["value"] == 2.0
    assert evaluate_targets({**rec, "ratio_flashdreams_over_ring": 39.0})["flashdreams_over_ring"]["met"] is False
    assert evaluate_targets({**rec, "ratio_ring_over_floor": 1.04})["ring_over_floor"]["met"] is True
    assert t["ring_growth_63_over_21"]["met"] is True
    assert t["ring_transient_bytes"]["met"] is False and t["ring_transient_bytes"]["value"] == 8
    assert not any(v["contended"] for v in t.values())
    assert all(v["met"] is None for v in evaluate_targets({}).values())
    rec["timing"] = {"contended_included": {"ring": True, "floor": False, "flashdreams": False}}
    t = evaluate_targets(rec)
    assert t["ring_over_floor"]["contended"] and t["flashdreams_over_ring"]["contended"]
    assert not t["ring_transient_bytes"]["contended"] and not t["ring_growth_63_over_21"]["contended"]
    counted = {"ops_per_chunk": {"ring": 14}, "host_syncs_per_chunk": {"ring": 0},
               "host_syncs_per_chunk_compiled": {"ring": 1}, "allocations_per_chunk": {"ring": 0},
               "allocations_per_chunk_compiled": {"ring": 0}, "allocator_events_per_chunk": {"ring": 0},
               "ring_write_ops_by_window": {"write_ops": [6, 6, 7]}, "sglang": {"ratio_sglang_over_sglang_ring": 12.0}}
    t = evaluate_targets(counted)
    assert t["ring_host_syncs"]["met"] is False and t["ring_host_syncs"]["value"] == 1  # the compiled one counts
    assert t["ring_allocations"]["met"] is True
    assert t["ring_write_ops_spread"]["met"] is False and t["ring_write_ops_spread"]["value"] == 1
    assert t["sglang_over_drop_in"]["met"] is True
    rec["scaling"].update(windows_frames=[21, 42, 63], contended_included={"ring": [False, False, True]})
    assert evaluate_targets(rec)["ring_growth_63_over_21"]["contended"]


def test_a_registered_section_lands_under_its_key(monkeypatch):
    seen = []

    def end_to_end(preset, options, device):
        seen.append((preset.name, device.type))
        return {"end_to_end": {"chunk_ms": 1.0}, "notes": ["e2e note"]}

    monkeypatch.setitem(SECTIONS, "end_to_end", end_to_end)
    opts = BenchOptions(repeats=2, transient_steps=1, count_bytes=False, warmup=1, warmup_s=0.0,
                        sections=("maintenance", "end_to_end"))
    rec = run_preset("small", opts)
    assert seen == [("small", "cpu")]
    assert rec["end_to_end"] == {"chunk_ms": 1.0} and "e2e note" in rec["notes"]
    assert "scaling" not in rec and rec["targets"]["ring_growth_63_over_21"]["met"] is None
    assert math.isfinite(rec["floor_ms"])
    with pytest.raises(ValueError, match="unknown section"):
        run_preset("small", BenchOptions(sections=("nope",)))


def test_without_flashdreams_the_peer_is_skipped_with_a_note(monkeypatch, capsys):
    import streamkv_lab.bench.maintenance as maintenance
    from streamkv_lab.bench import print_report

    monkeypatch.setattr(maintenance, "load_block_kv_cache", lambda: None)
    opts = BenchOptions(repeats=2, transient_steps=1, count_bytes=False, warmup=1, warmup_s=0.0,
                        sections=("maintenance",))
    rec = run_preset("small", opts)
    assert rec["maintenance_ms"]["flashdreams"] is None and rec["ratio_flashdreams_over_ring"] is None
    assert rec["bytes_moved"]["flashdreams"] is None and rec["transient_bytes"]["flashdreams"] is None
    assert rec["targets"]["flashdreams_over_ring"]["met"] is None
    assert any("flashdreams is not installed" in n for n in rec["notes"])
    _strict_json(json.dumps(rec))
    print_report({"presets": {"small": rec}})
    assert "flashdreams is not installed" in capsys.readouterr().out
