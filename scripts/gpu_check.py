#!/usr/bin/env python
"""GPU check: what the CPU test suite cannot run. One prepared script, under five minutes
on one GPU; prints a short table last and writes JSON.

    python scripts/gpu_check.py --json out/gpu_check.json          # on a CUDA machine
    python scripts/gpu_check.py --device cpu --quick               # smoke run of the same code

Sections (each prints PASS/FAIL lines; the exit status is 1 if any check fails):

1. graph replay of cache writes (flashinfer-style): capture a ring write for one chunk,
   then ``begin_chunk`` the next chunk outside the graph, replay with new K/V, and compare
   with an eager ring: replays must write the new slots (a Python slot baked into the
   graph would keep writing the captured ones). Also the first eviction, wraps, a reset.
2. rollouts: the tiny DiT with CFG, two streams (filling, first eviction, two wraps,
   reset), ring and chronological, in eager, ``torch.compile`` and CUDA-graph modes:
   every mode against eager ring, eager chronological against eager ring (fp32:
   max |diff| <= 1e-5 of the output scale).
3. benchmark (CUDA events): per-step cache maintenance of the current path, the ring,
   flashdreams' BlockKVCache (if installed) and the copy floor at the ``self-forcing``
   preset; chunk latency and peak allocated memory of the ``wan2.1-1.3b``-shaped rollout
   (a few layers unless ``--full-model``) per cache and mode.
4. the two-tier cache on the device: a TOVA budget + 8-bit key sketches + certified recall
   from (pinned) host memory on the synthetic video stream, every certificate checked against
   float64 full-history attention (0 violations), and its time per chunk against the ring at
   the same device memory (CUDA events around the cache's work; the check excluded).

5. position maps / RoPE at read (:func:`check_positions`): one CUDA graph and one compiled
   graph across fills, wraps, map switches and a RoPE cut; the cost of rotation at read against
   SDPA over pre-rotated keys at the self-forcing shape.
6. quantised storage (``check_quant``): graph replay of a quantised ring's write against eager,
   then the write and the block-by-block read of every format of ``KV_FORMATS`` timed against
   the dense ring.

On the CPU (``--device cpu``) graphs are skipped (printed as SKIP) and compile uses the
``aot_eager`` backend with ``--quick``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from streamkv import RingCache  # noqa: E402
from streamkv.models import CausalVideoDiT, get_config  # noqa: E402
from streamkv.rollout import StreamingRollout  # noqa: E402

RESULTS: list[tuple[str, str, str]] = []  # (check, status, detail)


def record(name: str, ok: bool | None, detail: str) -> None:
    status = "SKIP" if ok is None else ("PASS" if ok else "FAIL")
    RESULTS.append((name, status, detail))
    print(f"[{status}] {name}: {detail}", flush=True)


# --------------------------------------------------------------------------- 1
def check_graph_replay(device: torch.device) -> None:
    if device.type != "cuda":
        record("graph replay of ring writes", None, "needs CUDA")
        return
    S, W, C, H, D = 3, 7, 3, 4, 16
    shape = (1, S + W, H, D)
    graphed = RingCache(shape, shape, seq_dim=1, sink=S, window=W, chunk=C, device=device)
    eager = RingCache(shape, shape, seq_dim=1, sink=S, window=W, chunk=C, device=device)
    static_k = torch.zeros(1, C, H, D, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    graph = None
    worst = 0.0
    for stream in range(2):
        for c in range(9):  # filling, the first eviction, wraps
            for cache in (graphed, eager):
                cache.begin_chunk(c)
            k = torch.randn(1, C, H, D, device=device, generator=gen)
            eager.write(k, k * 2)
            static_k.copy_(k)
            if graph is None:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    graphed.write(static_k, static_k * 2)
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    graphed.write(static_k, static_k * 2)
            graph.replay()
            for cache in (graphed, eager):
                cache.commit_chunk(c)
            worst = max(worst, float((graphed.keys() - eager.keys()).abs().max()))
        for cache in (graphed, eager):
            cache.reset()
    record("graph replay of ring writes", worst == 0.0, f"max |graphed - eager| over 2 streams x 9 chunks = {worst:.1e}")


# --------------------------------------------------------------------------- 2
def _streams(r: StreamingRollout, chunks: int) -> torch.Tensor:
    r.set_prompt("a red fox running through snow", "blurry", seed=1)
    a = r.run(chunks)
    r.set_prompt("a sailing boat at dusk", "low quality", seed=2)
    return torch.cat([a, r.run(max(1, chunks // 2))], dim=2)


def check_rollouts(device: torch.device, quick: bool) -> dict:
    model = CausalVideoDiT(get_config("tiny"), seed=0).to(device).eval()
    ref = _streams(StreamingRollout(model, cache="ring", guidance=3.0), 8)
    scale = float(ref.abs().max())
    out = {}
    modes = ["eager", "compile", "graph"]
    for kind in ("ring", "chronological"):
        for mode in modes:
            if mode == "graph" and device.type != "cuda":
                record(f"rollout {kind}/{mode}", None, "needs CUDA")
                continue
            backend = "aot_eager" if (quick and device.type != "cuda") else "inductor"
            torch._dynamo.reset()
            t0 = time.perf_counter()
            r = StreamingRollout(model, cache=kind, guidance=3.0, mode=mode, compile_backend=backend)
            got = _streams(r, 8)
            diff = float((got - ref).abs().max())
            out[f"{kind}/{mode}"] = {"max_abs_diff": diff, "seconds": time.perf_counter() - t0}
            record(f"rollout {kind}/{mode} vs eager ring", diff <= 1e-5 * scale,
                   f"max |diff| {diff:.2e} (scale {scale:.3f}; bound {1e-5 * scale:.1e})")
    return out


# --------------------------------------------------------------------------- 3
def bench_maintenance(device: torch.device, quick: bool) -> dict:
    """Per-step maintenance of every cache at a preset, timed with CUDA events (the bench's
    instruments), plus transient allocations of a steady ring step."""
    from streamkv.lab.bench import PRESETS, measure_maintenance

    preset = PRESETS["small" if quick else "self-forcing"]
    r = measure_maintenance(preset, device, repeats=10 if quick else 50)
    med = {k: (None if s is None else s.median) for k, s in r.stats.items()}
    ring_alloc = r.transient["ring"].allocated_bytes if "ring" in r.transient else None
    fd = med.get("flashdreams")
    detail = (
        f"{preset.name}: current {med.get('current'):.3f} ms, ring {med['ring']:.3f} ms, floor {med['floor']:.3f} ms"
        + (f", flashdreams {fd:.3f} ms" if fd else ", flashdreams not installed")
        + f"; ring transient {ring_alloc} B"
    )
    record("maintenance per step and layer", ring_alloc == 0, detail)
    return {"preset": preset.name, "median_ms": med, "ring_transient_bytes": ring_alloc, "notes": r.notes}


def bench_rollout(device: torch.device, quick: bool, full_model: bool) -> dict:
    cfg = get_config("tiny" if quick else "wan2.1-1.3b")
    if not quick and not full_model:
        cfg = replace(cfg, layers=4)  # the real per-layer shape, fewer layers, to fit the time budget
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = CausalVideoDiT(cfg, seed=0).to(device=device, dtype=dtype).eval()
    chunks = 3 if quick else cfg.window_frames // cfg.frames_per_chunk + 3  # past the first eviction
    rows = {}
    for kind in ("chronological", "ring"):
        for mode in ("eager", "graph") if device.type == "cuda" else ("eager",):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            r = StreamingRollout(model, cache=kind, guidance=1.0, mode=mode)
            r.set_prompt("a red fox", seed=1)
            r.run(chunks)
            lat = sorted(c.latency_s for c in r.stats.chunks[-3:])
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
            rows[f"{kind}/{mode}"] = {"chunk_latency_ms": 1e3 * lat[len(lat) // 2], "peak_bytes": int(peak),
                                      "cache_bytes": r.caches.nbytes}
            record(f"rollout latency {kind}/{mode}", True,
                   f"{cfg.name} x{cfg.layers} layers: median of last 3 chunks {rows[f'{kind}/{mode}']['chunk_latency_ms']:.1f} ms, "
                   f"peak {peak / 2**30:.2f} GiB")
            del r
    return {"config": cfg.to_dict(), "chunks": chunks, "rows": rows}


# --------------------------------------------------------------------------- 4
def check_two_tier(device: torch.device, quick: bool) -> dict:
    from streamkv.lab.experiments.twotier import TwoTierConfig, video_stream, run_two_tier

    stream = video_stream(frames=16 if quick else 48, layers=1 if quick else 2)
    stream.q, stream.k, stream.v = ([t.to(device) for t in ts] for ts in (stream.q, stream.k, stream.v))
    cfg = TwoTierConfig(policy="tova", sink=2, window=46, recall_slots=96, tau=0.05)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    r = run_two_tier(stream, cfg)
    tt, ring = r["caches"]["two_tier"], r["caches"]["ring"]
    record("two-tier certificates", tt["violations"] == 0 and tt["count_mismatch"] == 0,
           f"{tt['rows_checked']} rows, {tt['violations']} violations, tightness median {tt['tightness_median']:.3f}, "
           f"recalled {tt['recalled_tokens']} tokens, {tt['shortfalls']} shortfalls")
    record("two-tier time per chunk", True,
           f"{tt['ms_per_chunk']:.2f} ms vs ring {ring['ms_per_chunk']:.2f} ms at {r['matched_memory_tokens']:.0f} tokens; "
           f"error mean {tt['error_mean']:.3g} vs ring {ring['error_mean']:.3g}")
    return {"config": r["config"], "caches": r["caches"], "ratios": r["ratios"]}


# --------------------------------------------------------------------------- 5
def check_positions(device: torch.device, quick: bool) -> dict:
    """Position maps / RoPE at read on the device (self-contained; streamkv issue 19).

    (a) CUDA graph: one graph of ``update + attend`` (raw keys, several maps, a RoPE cut) captured
    once, replayed for every chunk with ``begin_chunk``, map switches and the cut changed outside
    the graph (device writes): equal to an eager cache (fp32, <= 1e-5 of the output scale).
    (b) ``torch.compile`` of the same step (inductor on CUDA, aot_eager on the CPU): compiled
    frames counted, must stay 1 across fills, wraps and map switches; equal to eager.
    (c) cost on the device: attention with rotation at read vs SDPA over pre-rotated keys at the
    self-forcing shape (all 12 heads; CUDA events). The key-blocked path is a matmul online
    softmax on CUDA (the rotation belongs inside the attention kernel there: flashinfer's
    ``pos_encoding_mode="ROPE_LLAMA"``); the ratio says what that costs today.
    """
    from streamkv.attention import attend
    from streamkv.positions import POSITION_MAPS, position_map
    from streamkv.rope_at_read import RopeAtRead
    from streamkv.rotary import Rope1D

    out: dict = {}
    S, W, C, H, D = 2, 7, 3, 4, 16
    names = list(POSITION_MAPS)

    def build():
        maps = [position_map(n, **POSITION_MAPS[n].for_geometry(S, S + W, C)) for n in names]
        rope = RopeAtRead(Rope1D(D, theta=100.0), maps)
        return RingCache((1, S + W, H, D), (1, S + W, H, D), seq_dim=1, sink=S, window=W, chunk=C, device=device,
                         rope_at_read=rope), rope

    gen = torch.Generator(device=device).manual_seed(0)
    chunks = 8 if quick else 14
    # (a) one captured graph
    if device.type == "cuda":
        (g_cache, g_rope), (e_cache, e_rope) = build(), build()
        sq, sk, sv = (torch.zeros(1, C, H, D, device=device) for _ in range(3))
        graph = static_out = None
        worst = 0.0
        for c in range(chunks):
            for cache, rope in ((g_cache, g_rope), (e_cache, e_rope)):
                cache.begin_chunk(c)
                rope.use(c % len(names))
                rope.map("block_relative").set(cut=45 if c % 4 == 3 else -1)
            q, k, v = (torch.randn(1, C, H, D, device=device, generator=gen) for _ in range(3))
            for dst, src in ((sq, q), (sk, k), (sv, v)):
                dst.copy_(src)
            if graph is None:
                st = torch.cuda.Stream()
                st.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(st):
                    attend(sq, g_cache.layer(0).update(sk, sv, occupancy="mask"), causal=True)
                torch.cuda.current_stream().wait_stream(st)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_out, _ = attend(sq, g_cache.layer(0).update(sk, sv, occupancy="mask"), causal=True)
            graph.replay()
            want, _ = attend(q, e_cache.layer(0).update(k, v, occupancy="mask"), causal=True)
            worst = max(worst, float((static_out - want).abs().max() / want.abs().max().clamp_min(1e-30)))
            for cache in (g_cache, e_cache):
                cache.commit_chunk(c)
        out["graph_rel_diff"] = worst
        record("RoPE at read: one CUDA graph across maps", worst <= 1e-5,
               f"max |replay - eager| / scale over {chunks} chunks, {len(names)} maps switched = {worst:.1e}")
    else:
        record("RoPE at read: one CUDA graph across maps", None, "needs CUDA")
    # (b) one compiled graph
    import torch._dynamo as dynamo

    frames = [0]
    if device.type == "cuda":
        from torch._inductor.compile_fx import compile_fx

        def backend(gm, example):
            frames[0] += 1
            return compile_fx(gm, example)
    else:
        def backend(gm, example):
            frames[0] += 1
            return gm.forward
    dynamo.reset()
    (c_cache, c_rope), (e_cache, e_rope) = build(), build()
    step = torch.compile(lambda q, k, v: attend(q, c_cache.layer(0).update(k, v, occupancy="mask"), causal=True)[0],
                         backend=backend, fullgraph=True)
    worst = 0.0
    for c in range(14):  # filling, the first eviction, 5 wraps
        for cache, rope in ((c_cache, c_rope), (e_cache, e_rope)):
            cache.begin_chunk(c)
            rope.use(c % len(names))
            rope.map("block_relative").set(cut=45 if c % 4 == 3 else -1)
        q, k, v = (torch.randn(1, C, H, D, device=device, generator=gen) for _ in range(3))
        got = step(q, k, v)
        want, _ = attend(q, e_cache.layer(0).update(k, v, occupancy="mask"), causal=True)
        worst = max(worst, float((got - want).abs().max() / want.abs().max().clamp_min(1e-30)))
        for cache in (c_cache, e_cache):
            cache.commit_chunk(c)
    dynamo.reset()
    out["compile"] = {"frames": frames[0], "rel_diff": worst}
    record("RoPE at read: torch.compile", frames[0] == 1 and worst <= 1e-5,
           f"compiled frames {frames[0]} over 14 chunks (5 wraps), {len(names)} maps and a RoPE cut switched; "
           f"max rel diff {worst:.1e}")
    # (c) cost at the self-forcing shape
    if device.type == "cuda" and not quick:
        import torch.nn.functional as F

        from streamkv.rope import Rope3D
        from streamkv.rotary import FrameRope

        tpf, frames_w, chunk_f, heads, hd = 1560, 21, 3, 12, 128
        cap, chunk = frames_w * tpf, chunk_f * tpf
        dt = torch.bfloat16
        rope = RopeAtRead(FrameRope(Rope3D(hd, 30, 52, max_frames=1 << 16)), "cache_relative")
        raw = RingCache((1, cap, heads, hd), (1, cap, heads, hd), seq_dim=1, sink=0, window=cap, chunk=chunk,
                        dtype=dt, device=device, rope_at_read=rope)
        for c in range(cap // chunk + 1):
            raw.begin_chunk(c)
            kk = torch.randn(1, chunk, heads, hd, device=device, dtype=dt)
            raw.write(kk, kk)
            if c < cap // chunk:
                raw.commit_chunk(c)
        q = torch.randn(1, chunk, heads, hd, device=device, dtype=dt)
        read = raw.read()
        kt, vt = read.keys.transpose(1, 2), read.values.transpose(1, 2)

        def timed(fn, n=5):
            fn()
            torch.cuda.synchronize(device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(n):
                fn()
            b.record()
            torch.cuda.synchronize(device)
            return a.elapsed_time(b) / n

        pre = timed(lambda: F.scaled_dot_product_attention(q.transpose(1, 2), kt, vt))
        rot = timed(lambda: attend(q, read, block=8192))
        out["cost_self_forcing"] = {"prerotated_sdpa_ms": pre, "rotate_at_read_ms": rot, "ratio": rot / pre}
        record("RoPE at read: cost at self-forcing", True, f"rotate at read {rot:.1f} ms vs SDPA {pre:.1f} ms "
               f"({rot / pre:.2f}x; the CUDA key-blocked path is a matmul online softmax)")
    return out


def check_quant(device: torch.device, quick: bool) -> dict:
    """Quantised storage (issue 20): graph replay of the quantised write (a write captured for one
    chunk must land in the next chunk's full-precision rows on replay, and its commit-time
    quantisation through the device plan), then the quantised write and read timed against the
    dense ring (CUDA events; wan2.1-1.3b-like head, a chunk of 3 frames on CUDA)."""
    from streamkv.attention import attend
    from streamkv.quant import KV_FORMATS, KVQuant

    out: dict = {"graph": None, "rows": {}}
    H, D = 12, 128
    tokens_per_chunk, frames = (64, 6) if quick or device.type != "cuda" else (4680, 21)
    sink, window = tokens_per_chunk, tokens_per_chunk * (frames - 1)
    shape = (1, sink + window, H, D)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    if device.type == "cuda":
        kw = dict(seq_dim=1, sink=3, window=9, chunk=3, device=device, quant=KVQuant("int8"))
        graphed, eager = (RingCache((1, 12, 2, 16), (1, 12, 2, 16), **kw) for _ in range(2))
        sk, sv = torch.zeros(1, 3, 2, 16, device=device), torch.zeros(1, 3, 2, 16, device=device)
        graph, worst = None, 0.0
        for c in range(10):
            for cache in (graphed, eager):
                cache.begin_chunk(c)
            k = torch.randn(1, 3, 2, 16, device=device, generator=gen)
            eager.write(k, k * 2)
            sk.copy_(k)
            sv.copy_(k * 2)
            if graph is None:
                graphed.write(sk, sv)  # warm-up outside capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    graphed.write(sk, sv)
            graph.replay()
            for cache in (graphed, eager):
                cache.commit_chunk(c)
            worst = max(worst, float((graphed.keys(0) - eager.keys(0)).abs().max()))
        out["graph"] = worst
        record("graph replay of quantised writes", worst == 0.0, f"max |graphed - eager| over 10 chunks = {worst:g}")
    else:
        record("graph replay of quantised writes", None, "needs CUDA")
    fmts = [None, *KV_FORMATS]
    for fmt in fmts:
        q = None if fmt is None else KVQuant(fmt, basis="hadamard" if KV_FORMATS[fmt].bits <= 4 else "identity")
        cache = RingCache(shape, shape, seq_dim=1, sink=sink, window=window, chunk=tokens_per_chunk, dtype=dtype,
                          device=device, quant=q)
        k = torch.randn(1, tokens_per_chunk, H, D, device=device, generator=gen).to(dtype)
        for c in range(frames + 1):
            cache.begin_chunk(c)
            cache.write(k, k)
            if c < frames:
                cache.commit_chunk(c)
        read = cache.read(0)

        def timed(fn, n=5 if quick else 20):
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(n):
                    fn()
                b.record()
                torch.cuda.synchronize(device)
                return a.elapsed_time(b) / n
            t = time.perf_counter()
            for _ in range(n):
                fn()
            return (time.perf_counter() - t) * 1000 / n

        label = fmt or f"dense {str(dtype).replace('torch.', '')}"
        out["rows"][label] = {"write_ms": timed(lambda: cache.write(k, k)),
                              "read_ms": timed(lambda: attend(k, read, block=1024)), "bytes": cache.nbytes}
    base = out["rows"][next(iter(out["rows"]))]
    for label, r in out["rows"].items():
        r["read_vs_dense"] = r["read_ms"] / base["read_ms"]
        record(f"quantised {label} write/read", True,
               f"write {r['write_ms']:.3f} ms, read {r['read_ms']:.3f} ms ({r['read_vs_dense']:.2f}x dense), "
               f"{r['bytes'] / 2**20:.1f} MiB")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    p.add_argument("--full-model", action="store_true", help="all 30 layers of the Wan 1.3B shape")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (use --device cpu --quick for a smoke run)")
        return 0
    t0 = time.perf_counter()
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    check_graph_replay(device)
    report = {"rollouts": check_rollouts(device, args.quick)}
    report["maintenance"] = bench_maintenance(device, args.quick)
    report["rollout_latency"] = bench_rollout(device, args.quick, args.full_model)
    report["two_tier"] = check_two_tier(device, args.quick)
    report["positions"] = check_positions(device, args.quick)
    report["quant"] = check_quant(device, args.quick)
    report["checks"] = [{"check": n, "status": s, "detail": d} for n, s, d in RESULTS]
    report["seconds"] = time.perf_counter() - t0
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print("\n| check | status | detail |\n|---|---|---|")
    for n, s, d in RESULTS:
        print(f"| {n} | {s} | {d} |")
    print(f"total {report['seconds']:.0f} s")
    return 1 if any(s == "FAIL" for _, s, _ in RESULTS) else 0


if __name__ == "__main__":
    sys.exit(main())
