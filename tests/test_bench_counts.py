"""Counts per steady chunk: the dispatcher counter counts what it says (and can tell), the ring
dispatches no host sync and no allocation and a constant number of ops per write, the scored
kinds' syncs do not grow with the layers, the bench section writes the issue's keys. No timing
is asserted."""

from __future__ import annotations

import json

import pytest
import torch

from streamkv.caches import ChronologicalCache, RingCache, TOVACache
from streamkv_lab.bench import BenchOptions, Preset, run_preset
from streamkv_lab.bench.counts import build_count_subject, classify_read, count_subject, write_ops_by_window
from streamkv_lab.measure import count_compiled, count_dispatch

TINY = Preset("tiny-counts", window_frames=6, chunk_frames=2, sink_frames=1, tokens_per_frame=3, heads=2, head_dim=4,
              dtype="float32", scaling_windows=())
#: no sink and a window of whole chunks: no span wraps (the presets' case)
ALIGNED = Preset("tiny-aligned", window_frames=6, chunk_frames=2, sink_frames=0, tokens_per_frame=3, heads=2,
                 head_dim=4, dtype="float32", scaling_windows=())


def test_the_counter_counts_syncs_allocations_and_views():
    x = torch.arange(12.0).view(3, 4)
    mask = x > 5

    def body():
        y = x.clone()            # 1 allocation of 48 bytes
        y.add_(1)                # in place: none
        y[0].fill_(0)            # a view (select), in place
        float(y.sum())           # sum allocates; float() reads a scalar: a sync
        y.tolist()               # a host read of device data: a sync (CPU run)
        bool(y.max() > 3)        # truth test: a sync
        y.nonzero()              # data-dependent shape: a sync
        y[mask]                  # boolean mask: a sync
        y.index_select(0, torch.tensor([0, 2]))  # torch.tensor: an allocation; index_select: one more

    c = count_dispatch(body)
    assert c.host_syncs == 5, c.syncs
    assert set(c.syncs) >= {"_local_scalar_dense", "tolist", "nonzero", "index"}
    assert c.allocs["clone"] == 48 and "add_" not in c.allocs and "fill_" not in c.allocs
    assert c.allocs["lift_fresh"] == 16 and "index_select" in c.allocs
    assert c.views >= 1 and c.by_op["select"] >= 1
    quiet = count_dispatch(lambda: x.view(-1)[:3].add_(1))
    assert (quiet.host_syncs, quiet.allocations, quiet.kernels) == (0, 0, 1)


def test_the_ring_step_syncs_and_allocates_nothing_and_the_current_path_clones():
    ring, _ = build_count_subject("ring", ALIGNED, "cpu")
    cur, _ = build_count_subject("current", ALIGNED, "cpu")
    r = count_subject(ring, "cpu", compiled=False)
    c = count_subject(cur, "cpu", compiled=False)
    assert r["step"]["host_syncs"] == 0 and r["step"]["allocations"] == 0 and r["allocator"]["allocations"] == 0
    assert r["step"]["ops"] == sum(p["ops"] for p in r["phases"].values())
    assert "index_copy_" not in r["phases"]["write"]["by_op"]  # the eager write copies slices
    assert c["step"]["allocations"] == 3 and c["step"]["allocs"]["clone"] > 0  # K, V and positions rolled
    assert r["read"]["attention"] == "one kernel over the buffer"
    assert r["written"]["cache"] == 2 * ALIGNED.chunk * ALIGNED.token_bytes


def test_ring_write_ops_do_not_depend_on_the_window():
    for preset in (TINY, ALIGNED):
        w = write_ops_by_window(preset, "cpu", multiples=(1, 2, 3, 6, 20))
        assert w["constant"] and len(set(w["begin_ops"])) == 1, w
        assert w["wrap_write_ops"] <= 3 * w["write_ops"][0], w  # a wrap: bounded, not a per-row loop
    from streamkv_lab.bench import PRESETS

    assert write_ops_by_window(PRESETS["longlive2"], "cpu", multiples=(2, 3))["constant"]  # 8-frame chunks


def test_scored_syncs_per_chunk_do_not_grow_with_layers():
    """The scored commit may read the device, but once per chunk: not once per layer."""
    def syncs(layers: int) -> int:
        shape = (1, 12, 2, 4)
        cache = TOVACache(shape, shape, seq_dim=1, sink=0, window=12, chunk=3, num_layers=layers)
        k = torch.randn(1, 3, 2, 4)
        st = torch.full((2, 12), 1.0 / 12, dtype=torch.float64)

        def step():
            c = cache.next_chunk
            cache.begin_chunk(c)
            for layer in range(layers):
                cache.write(k, k, layer=layer)
                cache.policy.receive(layer, st, st)
            cache.commit_chunk(c)

        for _ in range(6):
            step()
        return count_dispatch(step).host_syncs

    one, four = syncs(1), syncs(4)
    assert one == four, (one, four)


def test_a_read_that_gathers_is_told_apart():
    ring, _ = build_count_subject("ring", TINY, "cpu")
    ring.phases[0][1]()  # begin
    ring.phases[1][1]()  # write
    cache = ring.obj
    ring.read = lambda: torch.nn.functional.scaled_dot_product_attention(
        torch.zeros(1, 2, 1, 4), cache.chronological_keys(0).transpose(1, 2),
        cache.chronological_values(0).transpose(1, 2))
    got = classify_read(ring, torch.device("cpu"))
    assert got["attention"].startswith("a copy first") and got["gathers"].get("index_select", 0) > 0


def test_count_compiled_sees_recompiles_and_graph_ops():
    shape = (1, 7, 2, 4)
    for cls, recompiles in ((RingCache, 0), (ChronologicalCache, None)):
        torch._dynamo.reset()
        cache = cls(shape, shape, seq_dim=1, sink=1, window=6, chunk=2)
        k = torch.randn(1, 2, 2, 4)

        def call(compiled):
            c = cache.next_chunk
            cache.begin_chunk(c)
            compiled(k, k)
            cache.commit_chunk(c)

        with torch.no_grad():
            _, cc = count_compiled(lambda a, b: cache.write(a, b), [call] * 6, backend="aot_eager")
        assert cc.graph_breaks == 0 and cc.graph_syncs == 0 and cc.graph_ops > 0
        if recompiles is not None:
            assert cc.recompiles == recompiles  # the ring's slots come from the device plan
        else:
            assert cc.recompiles > 0  # the current path's host offset moves while it fills: guards
    torch._dynamo.reset()


def test_the_counts_section_writes_the_issue_keys():
    rec = run_preset(ALIGNED, BenchOptions(repeats=2, transient_steps=0, count_bytes=False, warmup=1, warmup_s=0.0,
                                        sections=("counts",), compiled_counts=False))
    for key in ("ops_per_chunk", "host_syncs_per_chunk", "allocations_per_chunk", "alloc_bytes_per_chunk",
                "ops_per_chunk_compiled", "bytes_written_per_chunk", "read_attention", "ring_write_ops_by_window"):
        assert key in rec, key
    assert rec["host_syncs_per_chunk"]["ring"] == 0 and rec["allocations_per_chunk"]["ring"] == 0
    assert rec["ops_per_chunk"]["ring"] < rec["ops_per_chunk"]["current"]
    for kind in ("mass", "h2o", "tova"):
        assert rec["host_syncs_per_chunk"][kind] >= 1
    for peer in ("flashdreams", "flashdreams_ring", "sglang", "sglang_ring"):
        assert rec["ops_per_chunk"][peer] is not None, peer
    assert rec["allocations_per_chunk"]["flashdreams_ring"] == 0 and rec["allocations_per_chunk"]["sglang_ring"] == 0
    assert rec["allocations_per_chunk"]["flashdreams"] > 0 and rec["allocations_per_chunk"]["sglang"] > 0
    assert rec["targets"]["ring_host_syncs"]["met"] and rec["targets"]["ring_write_ops_spread"]["met"]
    json.dumps(rec, allow_nan=False)
    from streamkv_lab.bench import print_report

    print_report({"presets": {ALIGNED.name: rec}})
