"""``streamkv_lab.bench``: cache maintenance, bytes moved, transient memory and scaling.

The benchmark of the circular-cache proposal's gate, as a product: frozen presets
(:mod:`.presets`), device-generic instruments (:mod:`.measure`: perf_counter and the
torch profiler on CPU, CUDA events and allocator statistics on CUDA), the subjects
and their analytic byte counts (:mod:`.maintenance`), the run and its sections
(:mod:`.suite`), tables and the plot (:mod:`.report`).

Typical use (what ``streamkv bench`` does)::

    from streamkv_lab.bench import BenchOptions, run_bench, print_report
    doc = run_bench(["self-forcing"], BenchOptions(device="cuda"))
    print_report(doc)

For another script (e.g. a GPU check), the pieces run alone::

    from streamkv_lab.bench import PRESETS, measure_maintenance
    r = measure_maintenance(PRESETS["self-forcing"], torch.device("cuda"), repeats=50)
    r.stats["ring"].median, r.transient["ring"].allocated_bytes
"""

from streamkv_lab.bench.maintenance import LABELS, SUBJECTS, BytesMoved, MaintenanceResult, analytic_bytes, build_subjects, measure_maintenance
from streamkv_lab.measure import Stats, TransientMemory, WrittenBytes, count_written_bytes, probe_transient, time_interleaved
from streamkv_lab.bench.peers import load_block_kv_cache
from streamkv_lab.bench.presets import PRESETS, Preset, get_preset
from streamkv_lab.bench.report import plot_scaling, print_report
from streamkv_lab.bench.suite import SECTIONS, BenchOptions, evaluate_targets, run_bench, run_preset

__all__ = [
    "PRESETS",
    "Preset",
    "get_preset",
    "BenchOptions",
    "run_bench",
    "run_preset",
    "SECTIONS",
    "evaluate_targets",
    "print_report",
    "plot_scaling",
    "SUBJECTS",
    "LABELS",
    "BytesMoved",
    "MaintenanceResult",
    "analytic_bytes",
    "build_subjects",
    "measure_maintenance",
    "Stats",
    "TransientMemory",
    "WrittenBytes",
    "count_written_bytes",
    "probe_transient",
    "time_interleaved",
    "load_block_kv_cache",
]
