"""``streamkv bench --read``: what one read costs, per storage format, per position map, for the
compressed tier and for pages, against the dense bf16 read of the same tokens.

At each shape (:mod:`.shapes`: the self-forcing and lingbot-world layers at one head, SmolLM2's
layer decoding one token), a ring full of the shape's tokens (steady state: it has wrapped) with
the open span written, and every query of that span reading it (``attend``: a video chunk's
denoising pass, a prefill chunk, a decoded token; ``queries=n``: the span's last ``n`` rows, e.g.
one query reading the whole cache), eager and compiled
(``torch.compile(fullgraph=True)`` of ``attend(q, cache.read(0))``). Variants (registries
iterated, never listed):

``dense``              the bf16 ring, keys rotated at write: one SDPA call (the reference)
``format:<f>``         every format of :data:`~streamkv.stores.KV_FORMATS` (``KVQuant(f)``, its
                       defaults: non-finite rows refused at the commit, so the read hides a row
                       by its mask alone): codes decoded a block at a time
``map:<m>``            every position map of :data:`~streamkv.positions.POSITION_MAPS` (RoPE at
                       read on the ring, parameters from the map's ``for_geometry``): raw keys
                       rotated a block at a time (Wan's frame band on the video shapes, 1D RoPE on
                       SmolLM2's)
``tier:<f>``           the compressed tier (:class:`~streamkv.certify.tier.CompressedTier`, no
                       certificate) on a TOVA cache: tier 1 a quarter of the tokens in bf16,
                       tier 2 the other three quarters in ``f``; the read of tiers 1 + 2 without
                       the policy's statistics, and ``tier:<f>+statistics`` with them (TOVA's
                       scores computed in the same read: a second pass over the blocks)
``paged``              the ring with ``pages=True``, forked, one chunk written on the branch (its
                       page table is no longer the identity): pages walked through the table

The targets are set at a chunk of queries (a video chunk, or SmolLM2's decoded token): a run that
reads a video shape with fewer rows than its span records its ratios and judges no target there.

Ratios: each median over ``dense``'s in the same mode, timed in interleaved rounds
(:func:`~streamkv_lab.measure.time_interleaved`), the machine's load recorded. Transient bytes:
the peak allocation above the read's start (allocator events). Compiled variants record graphs,
recompiles, breaks (a failure, with its reason) and their difference from eager. Targets:
:data:`READ_TARGETS` (verdicts computed from the measured ratios).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from streamkv import KVCache
from streamkv.attention import attend
from streamkv_lab.bench.shapes import Shape, get_shape
from streamkv_lab.measure import Stats, count_compiled, probe_transient, time_interleaved

__all__ = ["READ_TARGETS", "TIER_FORMATS", "MODES", "read_variants", "measure_reads", "evaluate_read_targets",
           "own_code", "load_average"]

#: the compressed tier's tier-2 formats measured
TIER_FORMATS = ("int8", "int4")
MODES = ("eager", "compiled")
#: a read shorter than this (seconds) gets more rounds than ``repeats`` (at most MAX_ROUNDS): a
#: millisecond-scale decode read needs dozens of samples for a stable median on a shared machine
MIN_SAMPLED_S = 0.1
MAX_ROUNDS = 40
#: (what, threshold): the variant categories' targets at a video shape; at a decode shape, "decode"
READ_TARGETS: dict[str, tuple[str, float]] = {
    "format:int8": ("int8 codes <= 1.3x the dense bf16 read", 1.3),
    "format:int4": ("int4 codes <= 1.5x the dense bf16 read", 1.5),
    "map": ("RoPE at read (each map) <= 1.2x the dense read of keys rotated at write", 1.2),
    "tier": ("the compressed tier (tiers 1 + 2, no statistics) <= 1.3x a dense read of as many tokens", 1.3),
    "paged": ("a forked branch's paged read <= 1.1x the contiguous ring's", 1.1),
    "decode": ("at a decode shape (one query), every read <= 2x the dense bf16 read", 2.0),
}


def load_average() -> list[float] | None:
    """The machine's 1-, 5- and 15-minute load averages (None off Unix)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def own_code(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` with a code object of its own. torch.compile keeps its compiled graphs on the code
    object: the closures of one ``lambda`` (one per cache) would share one cache of at most
    ``cache_size_limit`` graphs (past it, calls silently run eagerly) and every call would check
    the guards of every closure's graph."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


# ---------------------------------------------------------------------------- the caches
def _rand(g: torch.Generator, shape: Shape, rows: int, heads: int) -> torch.Tensor:
    return torch.randn(1, rows, heads, shape.head_dim, generator=g).to(shape.torch_dtype)


def _span(cache: KVCache, shape: Shape, g: torch.Generator, n: int, *, commit: bool, scored: bool) -> None:
    """Begin a span of ``n`` tokens, write it (where the policy scores by attention, hand it
    statistics of the shape attention gives: random, normalised, without attending), commit it if asked."""
    cache.begin_tokens(n)
    k, v = _rand(g, shape, n, shape.heads), _rand(g, shape, n, shape.heads)
    cache.write(k, v, layer=0)
    if scored:
        st = cache.storage
        ksum = torch.rand(st.heads, st.slots, generator=g, dtype=torch.float64)
        ksum = ksum / ksum.sum(-1, keepdim=True) * n
        cache.policy.receive(0, ksum / n, ksum)
    if commit:
        cache.commit()


def fill(cache: KVCache, shape: Shape, g: torch.Generator, *, tokens: int | None = None, scored: bool = False) -> None:
    """Past the first wrap: ``tokens`` (default: the cache's slots) plus two spans of ``shape.fill``
    committed; the cache is left at a span boundary."""
    tokens = cache.layout.capacity if tokens is None else tokens
    for _ in range(-(-tokens // shape.fill) + 2):
        _span(cache, shape, g, shape.fill, commit=True, scored=scored)


def _ring(shape: Shape, **kw: Any) -> KVCache:
    return KVCache(shape.k_shape, shape.k_shape, seq_dim=1, sink=shape.sink, window=shape.window, chunk=shape.fill,
                   policy="ring", dtype=shape.torch_dtype, **kw)


def rotary_of(shape: Shape) -> Any:
    """The shape's RoPE: Wan's 3D RoPE (its frame band moves, as a position map rotates) on a video
    shape, 1D RoPE on an LLM's."""
    from streamkv.rope import Rope3D
    from streamkv.rotary import FrameRope, Rope1D

    if shape.video:
        return FrameRope(Rope3D(shape.head_dim, shape.grid[0], shape.grid[1], max_frames=1 << 16))
    return Rope1D(shape.head_dim)


def map_of(name: str, shape: Shape, capacity: int) -> Any:
    """Position map ``name`` with the parameters its registry entry gives at this geometry (units)."""
    from streamkv.positions import POSITION_MAPS, position_map

    u = shape.tokens_per_frame
    return position_map(name, **POSITION_MAPS[name].for_geometry(shape.sink // u, capacity // u, shape.fill // u))


def tier_split(shape: Shape, block: int = 16) -> tuple[int, int]:
    """``(tier-1 slots, tier-2 entries)``: a quarter of the shape's tokens in tier 1 (at least the sinks
    and two spans of ``fill``), the rest in tier 2 (a multiple of ``block``), together the shape's tokens."""
    t1 = max(shape.capacity // 4, shape.sink + 2 * shape.fill)
    m = (shape.capacity - t1) // block * block
    return shape.capacity - m, m


@dataclasses.dataclass
class Variant:
    """One read: its cache (alive while it is timed), the queries, and what it reads."""

    name: str
    category: str
    cache: KVCache | None
    q: torch.Tensor | None
    view: Callable[[Any], Any]
    tokens: int
    bytes: int
    note: str = ""
    keep: tuple[Any, ...] = ()


def _plain(read: Any) -> Any:
    return read


def _no_statistics(read: Any) -> Any:
    return dataclasses.replace(read, scorer=None, statistic=None)


def _open(cache: KVCache, shape: Shape, g: torch.Generator, *, scored: bool = False) -> torch.Tensor:
    """Open the measured span, write it; the queries that read it."""
    cache.begin_tokens(shape.span)
    k, v, q = _rand(g, shape, shape.span, shape.heads), _rand(g, shape, shape.span, shape.heads), \
        _rand(g, shape, shape.span, shape.q_heads)
    if scored:
        cache.layer(0).update(k, v, q)
    else:
        cache.write(k, v, layer=0)
    return q


def read_variants(shape: Shape) -> list[tuple[str, str]]:
    """``(variant, category)`` of every read measured at ``shape`` (the registries iterated)."""
    from streamkv.positions import POSITION_MAPS
    from streamkv.stores import KV_FORMATS

    out = [("dense", "dense")]
    out += [(f"format:{f}", f"format:{f}") for f in KV_FORMATS]
    out += [(f"map:{m}", "map") for m in POSITION_MAPS]
    for f in TIER_FORMATS:
        out += [(f"tier:{f}", "tier"), (f"tier:{f}+statistics", "tier+statistics")]
    out.append(("paged", "paged"))
    return out


def build_variant(name: str, category: str, shape: Shape, seed: int) -> Variant:
    """The cache of variant ``name`` at ``shape``, filled, its span open and written."""
    from streamkv.certify.tier import CompressedTier
    from streamkv.rope_at_read import RopeAtRead
    from streamkv.stores import KVQuant

    g = torch.Generator().manual_seed(seed)
    keep: tuple[Any, ...] = ()
    if name == "dense":
        cache = _ring(shape)
    elif name.startswith("format:"):
        cache = _ring(shape, quant=KVQuant(name.split(":", 1)[1]))
    elif name.startswith("map:"):
        rope = RopeAtRead(rotary_of(shape), map_of(name.split(":", 1)[1], shape, shape.capacity))
        cache = _ring(shape, rope_at_read=rope)
    elif name.startswith("tier:"):
        fmt = name.split(":", 1)[1].removesuffix("+statistics")
        t1, m = tier_split(shape)
        cache = KVCache((1, t1, shape.heads, shape.head_dim), (1, t1, shape.heads, shape.head_dim), seq_dim=1,
                        sink=shape.sink, window=t1 - shape.sink, chunk=shape.fill, policy="tova",
                        dtype=shape.torch_dtype, check_finite=False)
        tier = CompressedTier(cache, fmt=fmt, capacity=m, certify=False, causal=shape.causal)
        fill(cache, shape, g, tokens=shape.capacity, scored=True)
        q = _open(cache, shape, g, scored=True)
        view = _plain if name.endswith("+statistics") else _no_statistics
        nbytes = cache.nbytes + tier.nbytes
        return Variant(name, category, cache, q, view, t1 + m, nbytes, keep=(tier,))
    elif name == "paged":
        base = _ring(shape, pages=True)
        fill(base, shape, g)
        cache = base.fork(1)[0]
        _span(cache, shape, g, shape.fill, commit=True, scored=False)  # copy on write: the table moves
        q = _open(cache, shape, g)
        return Variant(name, category, cache, q, _plain, shape.capacity, cache.nbytes, keep=(base,),
                       note="a forked branch, one chunk written since the fork")
    else:
        raise ValueError(f"unknown read variant {name!r}")
    fill(cache, shape, g)
    q = _open(cache, shape, g)
    return Variant(name, category, cache, q, _plain, shape.capacity, cache.nbytes, keep=keep)


# ---------------------------------------------------------------------------- measuring
def _reader(v: Variant, causal: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    cache, view = v.cache, v.view

    def read(q: torch.Tensor) -> torch.Tensor:
        return attend(q, view(cache.read(0)), causal=causal)[0]

    return read


def _last_rows(view: Callable[[Any], Any], n: int) -> Callable[[Any], Any]:
    """``view`` read by the span's last ``n`` query rows (their positions: masks and rotations follow)."""
    def sliced(read: Any) -> Any:
        r = view(read)
        return dataclasses.replace(r, query_positions=r.query_positions[-n:])

    return sliced


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def measure_shape(shape: Shape, *, repeats: int, modes: Sequence[str] = MODES, backend: str = "inductor",
                  seed: int = 0, queries: int | None = None,
                  progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every variant of :func:`read_variants` at ``shape``, in ``modes``, read by the span's last
    ``queries`` rows (None: every row of the span); the shape's JSON record."""
    import torch._dynamo

    nq = shape.span if queries is None else min(queries, shape.span)

    say = progress or (lambda msg: None)
    variants: dict[str, Variant] = {}
    rows: dict[str, dict[str, Any]] = {}
    steps: dict[str, Callable[[], Any]] = {}
    causal = shape.causal
    torch._dynamo.reset()
    for i, (name, category) in enumerate(read_variants(shape)):
        say(f"read {shape.name}: building {name}")
        v = build_variant(name, category, shape, seed + i)
        if nq < shape.span:
            v.q, v.view = v.q[:, -nq:].contiguous(), _last_rows(v.view, nq)
        variants[name] = v
        row: dict[str, Any] = {"category": category, "tokens": v.tokens, "bytes": v.bytes, "note": v.note or None}
        eager_fn = _reader(v, causal)
        with torch.no_grad():
            ref = eager_fn(v.q)
            if name == "dense":  # one more call, timed: how many rounds give each read enough samples
                t0 = time.perf_counter()
                eager_fn(v.q)
                dense_s = time.perf_counter() - t0
        for mode in modes:
            rec: dict[str, Any] = {}
            if mode == "eager":
                fn = eager_fn
            else:
                say(f"read {shape.name}: compiling {name}")
                t0 = time.perf_counter()
                try:
                    with torch.no_grad():
                        fn, cc = count_compiled(own_code(eager_fn, f"read_{i}"), [lambda f, v=v: f(v.q)] * 3,
                                                backend=backend)
                        got = fn(v.q)
                except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a finding, recorded
                    rec.update(compiled=False, error=_first_line(exc))
                    row[mode] = rec
                    continue
                rec.update(compiled=True, compile_s=time.perf_counter() - t0, graphs=cc.graphs,
                           recompiles=cc.recompiles, graph_breaks=cc.graph_breaks,
                           max_abs_diff_vs_eager=float((got.float() - ref.float()).abs().max()))
            with torch.no_grad():
                mem = probe_transient(lambda fn=fn, q=v.q: fn(q), "cpu", steps=1)
            rec.update(transient_peak_bytes=mem.peak_bytes, transient_allocated_bytes=mem.allocated_bytes,
                       allocations=mem.allocations)
            row[mode] = rec
            steps[f"{name}/{mode}"] = (lambda fn=fn, q=v.q: fn(q))
        rows[name] = row
    say(f"read {shape.name}: timing {len(steps)} reads, interleaved")
    load_before = load_average()
    with torch.no_grad():
        rounds = max(repeats, min(MAX_ROUNDS, math.ceil(MIN_SAMPLED_S / max(dense_s, 1e-6))))
        run = time_interleaved(steps, repeats=rounds, device="cpu", warmup=1, warmup_s=0.0)
    load_after = load_average()
    for key, samples in run.samples_ms.items():
        name, mode = key.rsplit("/", 1)
        s = Stats.of(samples)
        rows[name][mode].update(ms=s.median, p10_ms=s.p10, p90_ms=s.p90, contended=run.included[key])
    for mode in modes:
        base = rows["dense"].get(mode, {}).get("ms")
        for name, row in rows.items():
            rec = row.get(mode)
            if rec is not None and rec.get("ms") is not None:
                rec["ratio_vs_dense"] = rec["ms"] / base if base else None
    for row in rows.values():
        e, c = row.get("eager", {}).get("ms"), row.get("compiled", {}).get("ms")
        row["compiled_over_eager"] = c / e if e and c else None
    variants.clear()
    gc.collect()
    torch._dynamo.reset()
    out = {"shape": shape.to_dict(), "queries": nq, "variants": rows,
           "timing": {**run.to_dict(), "repeats": rounds, "load_average_before": load_before,
                      "load_average_after": load_after, "threads": torch.get_num_threads()}}
    out["targets"] = evaluate_read_targets(shape, rows, modes) if nq == shape.span else []
    return out


def _target_of(shape: Shape, name: str, category: str) -> str | None:
    """The target of a variant at ``shape`` (None: none; the reference and the tier read with its
    policy's statistics, a second pass the issue's read targets do not cover, have none)."""
    if category in ("dense", "tier+statistics"):
        return None
    if shape.span == 1 and shape.family == "lm":
        return "decode"
    if category in READ_TARGETS:
        return category
    return None


def evaluate_read_targets(shape: Shape, rows: dict[str, dict[str, Any]], modes: Sequence[str]) -> list[dict[str, Any]]:
    """One entry per (variant with a target, mode): the measured ratio, the threshold, met (None:
    not measured)."""
    out = []
    for name, row in rows.items():
        key = _target_of(shape, name, row["category"])
        if key is None:
            continue
        text, threshold = READ_TARGETS[key]
        for mode in modes:
            ratio = row.get(mode, {}).get("ratio_vs_dense")
            out.append({"variant": name, "mode": mode, "target": text, "threshold": threshold, "value": ratio,
                        "met": None if ratio is None else ratio <= threshold,
                        "contended": row.get(mode, {}).get("contended")})
    return out


def measure_reads(shapes: Sequence[str | Shape], *, repeats: int = 5, modes: Sequence[str] = MODES,
                  backend: str = "inductor", seed: int = 0, queries: int | None = None,
                  progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The JSON key ``read``: every shape's record (:func:`measure_shape`), the targets and the load."""
    resolved = [get_shape(s) if isinstance(s, str) else s for s in shapes]
    per = {s.name: measure_shape(s, repeats=repeats, modes=modes, backend=backend, seed=seed, queries=queries,
                                 progress=progress) for s in resolved}
    return {"shapes": per, "modes": list(modes), "repeats": repeats, "compile_backend": backend,
            "queries": "span" if queries is None else queries,
            "targets": [{"shape": n, **t} for n, rec in per.items() for t in rec["targets"]],
            "target_table": {k: {"target": t, "threshold": th} for k, (t, th) in READ_TARGETS.items()}}
