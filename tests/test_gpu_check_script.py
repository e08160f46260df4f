"""scripts/gpu_check.py runs on a GPU only when a task has one; keep its CPU-runnable
sections from rotting: import it and run them on the CPU."""

import importlib.util
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
