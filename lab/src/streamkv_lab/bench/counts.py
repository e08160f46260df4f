"""What each cache costs, counted: per steady chunk (one layer: begin, one write, the scores a
scored policy receives, commit), for every cache and every peer, eager and compiled where it
applies. Counts do not vary with machine noise.

=====================  ==================================================================
subject                the step counted (``c`` the next chunk; the cache full, evicting)
=====================  ==================================================================
``current``            ``ChronologicalCache``: ``begin_chunk(c)``, ``write(k, v)``, ``commit_chunk(c)``
``ring``               ``RingCache``: the same calls
``floor``              two ``narrow(...).copy_`` at a host offset (no cache)
``mass`` ``h2o``       the scored kinds: the same calls, and between write and commit the
``tova``               statistics attention hands the policy (``read.scorer``; synthetic, fixed)
``flashdreams``        flashdreams 0.1.0 ``BlockKVCache``: ``before_update``, ``update``, ``after_update``
``flashdreams_ring``   :class:`~streamkv.compat.flashdreams.CircularBlockKVCache`: the same calls
``sglang``             sglang 0.5.23 ``CausalSelfAttentionKVCache``, built as its causal stage
                       builds it (device cursors, no host mirrors): one ``update_and_get_attention_kv``
``sglang_ring``        :class:`~streamkv.compat.sglang.RingCausalSelfAttentionKVCache`: the same call
=====================  ==================================================================

Per subject (:func:`count_preset`): the dispatcher counts of the step and of each phase
(:func:`~streamkv_lab.measure.count_dispatch`), bytes written
(:func:`~streamkv_lab.measure.count_written_bytes`), allocator events
(:func:`~streamkv_lab.measure.probe_transient`), the read (attention over what the cache
returns: one kernel over the buffer, an explicit softmax over it, or a gather / cat first),
and, where the write can be compiled, the same chunk with the write under ``torch.compile``
(inductor, ``fullgraph``): recompiles after warm-up, the captured graph's ops and syncs, and
the allocator events of the compiled call. The read uses ``READ_QUERIES`` query rows (the
counts of a one-kernel read do not depend on them; the attention's cost does).

Why one module: the subjects' builders and the counting of each phase share the table above.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from streamkv.attention import attend
from streamkv.caches import CACHE_KINDS, ChronologicalCache, KVCache, RingCache
from streamkv.compat.flashdreams import CircularBlockKVCache
from streamkv.compat.sglang import RingCausalSelfAttentionKVCache
from streamkv_lab.kinds import kind_params, scored_kinds
from streamkv.layout import CacheLayout
from streamkv_lab.bench.peers import load_block_kv_cache, load_sglang_causal_kv_cache
from streamkv_lab.bench.presets import Preset
from streamkv_lab.measure import (
    check_device,
    count_compiled,
    count_dispatch,
    count_written_bytes,
    probe_transient,
    sync,
)

__all__ = ["COUNT_SUBJECTS", "COUNT_LABELS", "SCORED", "CountSubject", "build_count_subject", "count_preset",
           "count_subject", "write_ops_by_window", "classify_read"]

#: every per-head (scored) kind of the registry
SCORED = scored_kinds()
#: subjects in table order
COUNT_SUBJECTS: tuple[str, ...] = ("current", "ring", "floor", *SCORED, "flashdreams", "flashdreams_ring", "sglang",
                                   "sglang_ring")
COUNT_LABELS = {
    "current": "ChronologicalCache (current path)", "ring": "RingCache", "floor": "floor: copy_ of the chunk",
    **{k: f"{CACHE_KINDS[k].__name__}{' (tau 0.05)' if 'tau' in kind_params(k) else ''}" for k in SCORED},
    "flashdreams": "flashdreams 0.1.0 BlockKVCache", "flashdreams_ring": "CircularBlockKVCache (drop-in)",
    "sglang": "sglang 0.5.23 CausalSelfAttentionKVCache", "sglang_ring": "RingCausalSelfAttentionKVCache (drop-in)",
}
#: query rows of the counted read
READ_QUERIES = 16
_KINDS: dict[str, type[KVCache]] = {"current": ChronologicalCache, "ring": RingCache,
                                    **{k: CACHE_KINDS[k] for k in SCORED}}
_PARAMS: dict[str, dict[str, Any]] = {k: kind_params(k, tau=0.05) for k in SCORED}
_MOVES = {"cat", "stack", "index_select", "gather", "index", "clone", "_to_copy", "repeat", "expand_copy",
          "narrow_copy", "slice_copy", "select_copy", "masked_select", "take", "index_copy", "_unsafe_index",
          "constant_pad_nd", "copy"}
_MATMULS = {"mm", "bmm", "addmm", "baddbmm", "matmul", "_int_mm"}


@dataclass
class CountSubject:
    """One cache at a preset, filled to the steady state. ``phases``: the step's calls in order
    (name, callable); ``read``: attention over what the cache returns for the open chunk;
    ``compile_fn``: the per-layer write to compile (None: ``compile_note`` says why)."""

    key: str
    phases: list[tuple[str, Callable[[], Any]]]
    read: Callable[[], Any]
    storages: tuple[Tensor, ...]
    compile_fn: Callable[[Tensor, Tensor], Any] | None
    compile_note: str | None
    k: Tensor
    v: Tensor
    obj: Any = None

    def step(self) -> None:
        for _, fn in self.phases:
            fn()

    def phase_steps(self, replace: dict[str, Callable[[], Any]]) -> Callable[[], None]:
        """A step with some phases replaced (e.g. the write by its compiled form)."""
        def run() -> None:
            for name, fn in self.phases:
                (replace.get(name) or fn)()
        return run


def _inputs(preset: Preset, device: torch.device, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    k = torch.randn(preset.chunk_shape, generator=g).to(device=device, dtype=preset.torch_dtype)
    v = torch.randn(preset.chunk_shape, generator=g).to(device=device, dtype=preset.torch_dtype)
    rows = min(preset.chunk, READ_QUERIES)
    q = torch.randn(preset.batch, rows, preset.heads, preset.head_dim, generator=g).to(device=device,
                                                                                      dtype=preset.torch_dtype)
    return k, v, q


def _sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


def _streamkv(key: str, preset: Preset, device: torch.device, k: Tensor, v: Tensor, q: Tensor) -> CountSubject:
    cache = _KINDS[key](preset.k_shape, preset.k_shape, seq_dim=preset.seq_dim, sink=preset.sink, window=preset.window,
                        chunk=preset.chunk, dtype=preset.torch_dtype, device=device, **_PARAMS.get(key, {}))
    state: dict[str, Any] = {}
    phases: list[tuple[str, Callable[[], Any]]] = [
        ("begin", lambda: cache.begin_chunk(cache.next_chunk)),
        ("write", lambda: cache.write(k, v, layer=0)),
    ]
    if cache.needs_queries:
        S, H = cache.storage.slots, cache.storage.heads
        g = torch.Generator(device="cpu").manual_seed(1)
        key_sum = torch.rand(H, S, generator=g, dtype=torch.float64)
        key_sum = (key_sum / key_sum.sum(-1, keepdim=True) * q.shape[1]).to(device)  # rows of p sum to 1
        key_max = (key_sum / q.shape[1]).to(device)
        state["stats"] = (key_max, key_sum)
        phases.append(("scores", lambda: cache.policy.receive(0, key_max, key_sum)))
    phases.append(("commit", lambda: cache.commit_chunk(cache.open_chunk)))

    def read() -> Any:
        return attend(q, cache.read(0))

    def write(k_: Tensor, v_: Tensor) -> None:
        cache.write(k_, v_, layer=0)

    return CountSubject(key, phases, read, (cache.keys(0), cache.values(0)), write, None, k, v, cache)


def _floor(preset: Preset, device: torch.device, k: Tensor, v: Tensor, q: Tensor) -> CountSubject:
    K = torch.zeros(preset.k_shape, dtype=preset.torch_dtype, device=device)
    V = torch.zeros(preset.k_shape, dtype=preset.torch_dtype, device=device)
    layout = CacheLayout(sink=preset.sink, window=preset.window, chunk=preset.chunk)
    C, d = preset.chunk, preset.seq_dim
    state = {"c": 0}

    def write() -> None:
        s = min(layout.ring_slot(layout.chunk_start(state["c"])), layout.capacity - C)
        K.narrow(d, s, C).copy_(k)
        V.narrow(d, s, C).copy_(v)
        state["c"] += 1

    return CountSubject("floor", [("write", write)], lambda: _sdpa(q, K, V), (K, V), None,
                        "a host offset per chunk (each offset a recompile)", k, v, (K, V))


def _flashdreams(key: str, cls: type, preset: Preset, device: torch.device, k: Tensor, v: Tensor,
                 q: Tensor) -> CountSubject:
    cache = cls(k_shape=preset.k_shape, v_shape=preset.k_shape, seq_dim=preset.seq_dim, chunk_size=preset.chunk,
                window_size=preset.window, sink_size=preset.sink, device=device, dtype=preset.torch_dtype)
    state = {"c": 0}

    def begin() -> None:
        cache.before_update(state["c"])

    def commit() -> None:
        cache.after_update(state["c"])
        state["c"] += 1

    storages = (cache.ring.keys(0), cache.ring.values(0)) if key == "flashdreams_ring" else (cache._k, cache._v)
    return CountSubject(key, [("begin", begin), ("write", lambda: cache.update(k, v)), ("commit", commit)],
                        lambda: _sdpa(q, cache.cached_k(), cache.cached_v()), storages,
                        lambda k_, v_: cache.update(k_, v_), None, k, v, cache)


def _sglang(key: str, cls: type, preset: Preset, device: torch.device, k: Tensor, v: Tensor, q: Tensor) -> CountSubject:
    cache = cls(
        k=torch.zeros(preset.k_shape, dtype=preset.torch_dtype, device=device),
        v=torch.zeros(preset.k_shape, dtype=preset.torch_dtype, device=device),
        global_end_index=torch.zeros(1, dtype=torch.long, device=device),
        local_end_index=torch.zeros(1, dtype=torch.long, device=device), global_end_index_int=None,
        local_end_index_int=None, cache_size=preset.capacity, sink_tokens=preset.sink,
        global_sink_tokens=preset.global_sink,
    )
    state: dict[str, Any] = {"c": 0, "view": None}

    def call() -> None:
        state["view"] = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=state["c"] * preset.chunk)
        state["c"] += 1

    def read() -> Any:
        view = state["view"]
        return _sdpa(q, view.k, view.v)

    return CountSubject(key, [("update_and_get_attention_kv", call)], read, (cache.k, cache.v), None,
                        "one call plans on the host and writes (not graph-safe, in sglang or the drop-in)", k, v, cache)


def build_count_subject(key: str, preset: Preset, device: torch.device | str, *, seed: int = 0
                        ) -> tuple[CountSubject | None, str | None]:
    """The subject ``key`` at ``preset``, filled so that its next step evicts; (None, why) when it
    cannot run here (a peer not installed, a layout it cannot hold)."""
    device = check_device(device)
    k, v, q = _inputs(preset, device, seed)
    if key in _KINDS:
        subject = _streamkv(key, preset, device, k, v, q)
    elif key == "floor":
        subject = _floor(preset, device, k, v, q)
    elif key in ("flashdreams", "flashdreams_ring"):
        cls = load_block_kv_cache() if key == "flashdreams" else CircularBlockKVCache
        if cls is None:
            return None, "flashdreams is not installed (pip install --no-deps flashdreams==0.1.0)"
        if key == "flashdreams" and preset.capacity % preset.chunk:
            return None, f"BlockKVCache needs (sink + window) % chunk == 0, got {preset.capacity} % {preset.chunk}"
        subject = _flashdreams(key, cls, preset, device, k, v, q)
    elif key in ("sglang", "sglang_ring"):
        cls = load_sglang_causal_kv_cache() if key == "sglang" else RingCausalSelfAttentionKVCache
        if cls is None:
            return None, "sglang is not installed (pip install --no-deps sglang==0.5.23)"
        subject = _sglang(key, cls, preset, device, k, v, q)
    else:
        raise ValueError(f"unknown subject {key!r}; choose from {COUNT_SUBJECTS}")
    layout = CacheLayout(sink=preset.sink, window=preset.window, chunk=preset.chunk)
    with torch.no_grad():
        for _ in range(layout.first_eviction_chunk()):
            subject.step()
    return subject, None


class _ReadWatch:
    """Sees which tensors the ops of a read touch (an ``observe`` hook of ``count_dispatch``)."""

    def __init__(self, storages: tuple[Tensor, ...]) -> None:
        self.ptrs = {t.untyped_storage().data_ptr() for t in storages}
        self.attention_over_buffer = 0
        self.attention_over_copy = 0
        self.matmuls_over_buffer = 0
        self.gather_bytes = 0
        self.gathers: dict[str, int] = {}

    def _reads_cache(self, x: Any) -> bool:
        if isinstance(x, Tensor):
            return x.device.type != "meta" and x.untyped_storage().data_ptr() in self.ptrs
        if isinstance(x, (list, tuple)):
            return any(self._reads_cache(y) for y in x)
        return False

    def __call__(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        if "scaled_dot_product" in name or name in ("_flash_attention_forward", "_efficient_attention_forward"):
            if len(args) > 1 and self._reads_cache(args[1]):
                self.attention_over_buffer += 1
            else:
                self.attention_over_copy += 1
        elif name in _MATMULS:
            if self._reads_cache(args):
                self.matmuls_over_buffer += 1
        elif name == "copy_":
            if len(args) > 1 and self._reads_cache(args[1]) and not self._reads_cache(args[0]):
                self._gather(name, args[0])
        elif name in _MOVES and self._reads_cache((args, list(kwargs.values()))):
            outs = out if isinstance(out, (list, tuple)) else (out,)
            for t in outs:
                if isinstance(t, Tensor) and not self._reads_cache(t):
                    self._gather(name, t)

    def _gather(self, name: str, t: Tensor) -> None:
        n = t.numel() * t.element_size()
        self.gather_bytes += n
        self.gathers[name] = self.gathers.get(name, 0) + n

    def label(self) -> str:
        if self.gather_bytes or self.attention_over_copy:
            return f"a copy first ({', '.join(sorted(self.gathers)) or 'attention over a copy'})"
        if self.attention_over_buffer == 1 and not self.matmuls_over_buffer:
            return "one kernel over the buffer"
        if self.matmuls_over_buffer:
            return "explicit softmax over the buffer"
        return "no attention kernel seen"

    def to_dict(self) -> dict[str, Any]:
        return {"attention": self.label(), "attention_kernels_over_buffer": self.attention_over_buffer,
                "attention_kernels_over_copy": self.attention_over_copy,
                "matmuls_over_buffer": self.matmuls_over_buffer, "gather_bytes": self.gather_bytes,
                "gathers": self.gathers}


def classify_read(subject: CountSubject, device: torch.device) -> dict[str, Any]:
    """Attention over what the cache returns: the read's counts and what attention read."""
    watch = _ReadWatch(subject.storages)
    with torch.no_grad():
        counts = count_dispatch(subject.read, device=device, observe=watch)
    return {**watch.to_dict(), "ops": counts.ops, "host_syncs": counts.host_syncs, "allocations": counts.allocations,
            "alloc_bytes": counts.alloc_bytes, "query_rows": min(READ_QUERIES, subject.k.shape[1])}


def count_subject(subject: CountSubject, device: torch.device | str, *, compiled: bool = True,
                  compile_backend: str = "inductor", compile_chunks: int = 3) -> dict[str, Any]:
    """Every count of one subject over consecutive steady chunks (module docstring). JSON-ready."""
    device = check_device(device)
    out: dict[str, Any] = {"phases": {}}
    with torch.no_grad():
        total = None
        for name, fn in subject.phases:  # one chunk, phase by phase: the step is their sum
            c = count_dispatch(fn, device=device)
            out["phases"][name] = c.to_dict()
            total = c if total is None else _add(total, c)
        out["step"] = total.to_dict()
        out["written"] = count_written_bytes(subject.step, subject.storages).to_dict()
        out["allocator"] = probe_transient(subject.step, device, steps=1).to_dict()
        # the read, on an open chunk (between the write and the scores / commit)
        before = [fn for n, fn in subject.phases if n in ("begin", "write", "update_and_get_attention_kv")]
        after = [fn for n, fn in subject.phases if n not in ("begin", "write", "update_and_get_attention_kv")]
        for fn in before:
            fn()
        out["read"] = classify_read(subject, device)
        for fn in after:
            fn()
    out["write_phase"] = "write" if any(n == "write" for n, _ in subject.phases) else None
    out["compiled"] = _count_compiled(subject, device, compile_backend, compile_chunks) if (
        compiled and subject.compile_fn is not None) else None
    out["compile_note"] = subject.compile_note if subject.compile_fn is None else None
    return out


def _add(a: Any, b: Any) -> Any:
    from streamkv_lab.measure import DispatchCounts

    merge = lambda x, y: {k: x.get(k, 0) + y.get(k, 0) for k in {**x, **y}}  # noqa: E731
    return DispatchCounts(ops=a.ops + b.ops, views=a.views + b.views, host_syncs=a.host_syncs + b.host_syncs,
                          allocations=a.allocations + b.allocations, alloc_bytes=a.alloc_bytes + b.alloc_bytes,
                          host_to_device=a.host_to_device + b.host_to_device, by_op=merge(a.by_op, b.by_op),
                          syncs=merge(a.syncs, b.syncs), allocs=merge(a.allocs, b.allocs))


def _count_compiled(subject: CountSubject, device: torch.device, backend: str, chunks: int) -> dict[str, Any]:
    """The steady chunk with its write compiled: the eager phases counted at the dispatcher, the
    compiled write by what the compiler captured and by the allocator during its call."""
    import torch._dynamo

    k, v = subject.k, subject.v

    def call(compiled: Callable[..., Any]) -> None:
        subject.phase_steps({"write": lambda: compiled(k, v)})()

    torch._dynamo.reset()
    with torch.no_grad():
        compiled, cc = count_compiled(subject.compile_fn, [call] * (1 + chunks), backend=backend)
        eager = {"ops": 0, "host_syncs": 0, "allocations": 0, "alloc_bytes": 0}
        alloc = None
        for name, fn in subject.phases:
            if name == "write":
                sync(device)
                alloc = probe_transient(lambda: compiled(k, v), device, steps=1)
                continue
            c = count_dispatch(fn, device=device)
            for key in eager:
                eager[key] += getattr(c, key)
        unique = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        call(compiled)  # one more chunk: the probe and this chunk must not have recompiled
        probe_recompiles = torch._dynamo.utils.counters["stats"]["unique_graphs"] - unique
    torch._dynamo.reset()
    return {
        **cc.to_dict(),
        "eager_phases": eager,
        "write_allocator": alloc.to_dict() if alloc is not None else None,
        "ops_per_chunk": eager["ops"] + cc.graph_ops,
        "host_syncs_per_chunk": eager["host_syncs"] + cc.graph_syncs,
        "allocations_per_chunk": eager["allocations"] + (alloc.allocations if alloc is not None else 0),
        "alloc_bytes_per_chunk": eager["alloc_bytes"] + (alloc.allocated_bytes if alloc is not None else 0),
        "recompiles_after_probe": probe_recompiles,
    }


def count_preset(preset: Preset, device: torch.device | str, *, subjects: tuple[str, ...] = COUNT_SUBJECTS,
                 compiled: bool = True, compile_backend: str = "inductor", seed: int = 0,
                 compiled_subjects: tuple[str, ...] | None = None,
                 progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Counts of every subject at ``preset`` (one at a time: each is freed before the next);
    ``compiled_subjects``: those whose write is compiled too (default: every one that can be)."""
    device = check_device(device)
    per: dict[str, Any] = {}
    notes: list[str] = []
    for key in subjects:
        if progress is not None:
            progress(f"counts: {key}")
        subject, why = build_count_subject(key, preset, device, seed=seed)
        if subject is None:
            per[key] = None
            notes.append(f"counts: {key} skipped: {why}")
            continue
        try:
            per[key] = count_subject(subject, device, compile_backend=compile_backend,
                                     compiled=compiled and (compiled_subjects is None or key in compiled_subjects))
        finally:
            del subject
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"subjects": per, "notes": notes}


def write_ops_by_window(preset: Preset, device: torch.device | str, multiples: tuple[int, ...] = (2, 4, 7, 14, 21, 42),
                        key: str = "ring") -> dict[str, Any]:
    """Dispatched ops of one layer write (and of begin) at windows of ``multiples`` chunks (for
    3-frame chunks: 6 to 126 frames), the preset's chunk and sink, at 8 tokens per frame and one
    8-wide head (op counts depend on the layout, not on tensor sizes): the most over one whole
    ring cycle of chunks per window. Whole-chunk windows never wrap a chunk (the presets' case);
    ``wrap_write_ops``: the same at a window one frame longer than the largest, where chunks
    wrap (a wrapping span is two slices, or below ``wrap_slices_min_bytes`` the indexed write)."""
    device = check_device(device)
    small = Preset(f"{preset.name}-small", window_frames=preset.window_frames, chunk_frames=preset.chunk_frames,
                   sink_frames=0, tokens_per_frame=8, heads=1, head_dim=8, dtype=preset.dtype, scaling_windows=())
    small = dataclasses.replace(small, sink_frames=preset.sink_frames if preset.sink_frames % preset.chunk_frames == 0
                                else 0)

    def worst(p: Preset) -> tuple[int, int]:
        subject, _ = build_count_subject(key, p, device)
        cycle = max(1, p.window // p.chunk) + 1
        worst_w = worst_b = 0
        with torch.no_grad():
            for _ in range(cycle):
                ph = dict(subject.phases)
                worst_b = max(worst_b, count_dispatch(ph["begin"], device=device).ops)
                worst_w = max(worst_w, count_dispatch(ph["write"], device=device).ops)
                ph["commit"]()
        return worst_w, worst_b

    windows = [m * preset.chunk_frames for m in multiples]
    got = [worst(small.with_window(w)) for w in windows]
    wrap_w, wrap_b = worst(small.with_window(windows[-1] + 1))
    ops = [w for w, _ in got]
    return {"subject": key, "windows_frames": windows, "write_ops": ops, "begin_ops": [b for _, b in got],
            "constant": len(set(ops)) == 1 and len({b for _, b in got}) == 1,
            "wrap_window_frames": windows[-1] + 1, "wrap_write_ops": wrap_w, "wrap_begin_ops": wrap_b}
