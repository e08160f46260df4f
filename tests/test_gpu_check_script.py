"""scripts/gpu_check.py runs on a GPU only when a task has one; keep its CPU-runnable
sections from rotting: import it and run them on the CPU, and run its ``--dry-run`` (every
path the GPU run calls, at small shapes) end to end."""

import importlib.util
import json
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_sections_of_the_gpu_script_run():
    mod = _load()
    cpu = torch.device("cpu")
    mod.check_graph_replay(cpu)  # skipped on the CPU, recorded as such
    out = mod.bench_maintenance(cpu, quick=True)
    assert out["ring_transient_bytes"] == 0 and out["median_ms"]["ring"] > 0
    lat = mod.bench_rollout(cpu, quick=True, full_model=False)
    assert set(lat["rows"]) == {"chronological/eager", "ring/eager"}
    tt = mod.check_two_tier(cpu, quick=True)
    qu = mod.check_quant(cpu, quick=True)
    assert qu["graph"] is None and all(r["read_ms"] > 0 for r in qu["rows"].values())
    assert tt["caches"]["two_tier"]["violations"] == 0
    statuses = {name: status for name, status, _ in mod.RESULTS}
    assert statuses["graph replay of ring writes"] == "SKIP"
    assert "FAIL" not in statuses.values()


def test_the_dry_run_exercises_every_section_and_prints_one_json(tmp_path, capsys):
    mod = _load()
    out = tmp_path / "gpu_check.json"
    assert mod.main(["--dry-run", "--json", str(out), "--budget-s", "100000"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    report = json.loads(printed[-1])  # the last line: the whole report, one JSON object
    assert report == json.loads(out.read_text())
    assert report["dry_run"] and report["compile_backend"] == "aot_eager"
    for key in ("write_paths", "rollouts", "maintenance", "issue21", "rollout_latency", "two_tier", "checks"):
        assert key in report, key
    wp = report["write_paths"]
    assert wp["wrapping_chunks"] > 0 and not any(wp["mismatching_chunks"].values())
    assert wp["recompiles_after_warmup"] == 0 and all(v["ok"] for v in wp["syncs"].values())
    fig = report["issue21"]
    from streamkv_lab.kinds import scored_kinds
    assert set(fig["presets"]) == set(mod.ISSUE_PRESETS) and set(fig["counts"]) == set(mod.ISSUE_PRESETS)
    assert fig["counts"]["self-forcing"]["ring"]["compiled"] is not None  # the compiled counts ran
    assert {"sglang", "sglang_ring", "flashdreams", "flashdreams_ring", *scored_kinds()} <= set(
        fig["counts"]["krea-realtime-14b"])
    assert fig["presets"]["longlive2"]["sglang"]["maintenance_ms"]["sglang_ring"] > 0
    assert set(fig["scored"]["kinds"]) == set(scored_kinds())  # every scored kind of the registry
    assert fig["bandwidth"]["gb_per_s"]["ring write (graph replay)"] > 0
    statuses = {c["check"]: c["status"] for c in report["checks"]}
    assert "FAIL" not in statuses.values(), [c for c in report["checks"] if c["status"] == "FAIL"]
    assert statuses["write paths agree (bf16, fills, wraps, reset)"] == "PASS"
    assert statuses["steady ring chunk, graph replay: 0 host syncs"] == "PASS"
    tr = report["triton_read"]  # the Triton read under the interpreter (a fresh process where triton was imported)
    assert set(tr["timing"]) == set(mod.TRITON_SHAPES) and all(
        r is not None for t in tr["timing"].values() for r in t["rows"].values())
    assert tr["cases"] and tr["graph"]["wrapping_chunks"] > 0 and tr["graph"]["max_abs_diff"] == 0.0
    for check in ("Triton read: a chunk step as one CUDA graph across wraps", "Triton read: chunk step 0 host syncs"):
        assert statuses[check] == "PASS", check
    assert any(c.startswith("Triton read: ") and c.endswith("cases against float64 (tiny)") and s == "PASS"
               for c, s in statuses.items())
    dp = report["dispatch"]  # attend(kernel=) through the dispatcher (the interpreter; a fresh process where need be)
    assert set(dp["shapes"]) == set(mod.TRITON_SHAPES) and not dp["skipped_for_time"]
    for shape in dp["shapes"].values():
        rows = shape["rows"]
        assert len(rows) == 16 and shape["dense_sdpa_ms"] > 0
        assert rows["bf16 (dense)"]["auto"]["ran"] == "sdpa" and rows["bf16 (dense)"]["triton"]["ran"] == "triton"
        for label, row in rows.items():
            assert row["auto"]["ran"] == ("sdpa" if label == "bf16 (dense)" else "blocks"), (label, row["auto"])
            assert ("refused" in row["sdpa"]) == (label != "bf16 (dense)"), (label, row["sdpa"])
            assert row["triton"]["ran"] == "triton" and row["triton"]["vs_dense_sdpa"] > 0
    assert statuses["attend dispatch: auto = forced Triton (bf16 rounding)"] == "PASS"
