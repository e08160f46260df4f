"""Cache maintenance per autoregressive step and layer: what each cache does to advance
to the next chunk and write it once, in the steady state (the cache is full, every
step evicts).

=================  =================================================================
subject            one timed step (``chunk_idx = c``, a new chunk every step)
=================  =================================================================
``current``        ``ChronologicalCache``: ``begin_chunk(c)`` (clone + shift the
                   retained window left), ``write(k, v)``, ``commit_chunk(c)``
``flashdreams``    flashdreams 0.1.0 ``BlockKVCache``: ``before_update(c)`` (the same
                   roll), ``update(k, v)``, ``after_update(c)``
``ring``           ``RingCache``: ``begin_chunk(c)`` (slot plan on the device),
                   ``write(k, v)`` (``index_copy_`` into the oldest slots),
                   ``commit_chunk(c)``
``floor``          ``K[:, s:s+C].copy_(k); V[:, s:s+C].copy_(v)`` into preallocated
                   buffers at the ring's rows: a cache must write the chunk once
=================  =================================================================

Peers, only at presets that name them (``Preset.peers``), each step one
``update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * C)`` and its view (the
whole buffer at these presets: a slice, no copy, for both):

=================  =================================================================
``sglang``         sglang 0.5.23 ``CausalSelfAttentionKVCache`` (loaded by file path):
                   clone + shift of the retained window, then a slice write
``sglang_ring``    :class:`~streamkv.compat.sglang.RingCausalSelfAttentionKVCache`, built
                   as sglang's stage builds the original: the ring's write (its slot plan
                   is the window long: ``max_chunk_tokens`` is not set)
=================  =================================================================

Bytes moved (analytic, per step and layer, K and V together; ``row`` = one token's K
or V bytes, ``C`` the chunk and ``W`` the window in tokens)::

    chunk_written    = 2 * C * row                    every subject
    retained_copied  = 2 * (W - C) * row              current, flashdreams, sglang (the roll)
    clone_temporary  = 2 * (W - C) * row              current, flashdreams, sglang (.clone())
    written_total    = chunk_written + retained_copied + clone_temporary
    traffic          = 2 * written_total              each written byte was read once

Write metadata (the ring's ``C`` slot indices and positions, the current path's
rolled position table) is not in the analytic count (it is 8 B per token against
``row`` = 3,072 B at ``self-forcing``); the dispatch counter
(:func:`~streamkv_lab.measure.count_written_bytes`) reports it as ``metadata``.

Why this long: the table of subjects and the byte formulas are the benchmark's definition.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from streamkv.caches import ChronologicalCache, KVCache, RingCache
from streamkv.compat.sglang import RingCausalSelfAttentionKVCache
from streamkv.layout import CacheLayout
from streamkv_lab.measure import (
    Stats,
    TimingRun,
    TransientMemory,
    WrittenBytes,
    check_device,
    count_written_bytes,
    page_faults,
    probe_transient,
    time_interleaved,
)
from streamkv_lab.bench.peers import load_block_kv_cache, load_sglang_causal_kv_cache
from streamkv_lab.bench.presets import Preset

__all__ = [
    "SUBJECTS",
    "PEER_SUBJECTS",
    "LABELS",
    "BytesMoved",
    "Subject",
    "MaintenanceResult",
    "analytic_bytes",
    "build_subjects",
    "measure_maintenance",
]

#: subjects in table order
SUBJECTS: tuple[str, ...] = ("current", "flashdreams", "ring", "floor")
LABELS: dict[str, str] = {
    "current": "ChronologicalCache (current path)",
    "flashdreams": "flashdreams 0.1.0 BlockKVCache",
    "ring": "RingCache",
    "floor": "floor: copy_ of the chunk",
    "sglang": "sglang 0.5.23 CausalSelfAttentionKVCache",
    "sglang_ring": "RingCausalSelfAttentionKVCache (streamkv.compat.sglang)",
}
#: the subjects each peer of :data:`~streamkv_lab.bench.presets.PEERS` adds (the original, the drop-in)
PEER_SUBJECTS: dict[str, tuple[str, ...]] = {"sglang": ("sglang", "sglang_ring")}
_ROLLS = {"current", "flashdreams", "sglang"}


@dataclass(frozen=True)
class BytesMoved:
    """Analytic bytes of one steady step (K and V together); see the module docstring."""

    chunk_written: int
    retained_copied: int
    clone_temporary: int

    @property
    def written_total(self) -> int:
        return self.chunk_written + self.retained_copied + self.clone_temporary

    @property
    def traffic(self) -> int:
        """Bytes read + written: each written byte was read once."""
        return 2 * self.written_total

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "written_total": self.written_total, "traffic": self.traffic}


def steady_retained_tokens(layout: CacheLayout) -> int:
    """Retained window tokens a rolling (chronological) cache moves per steady step: ``W - C``.

    Once the cache is full the window start advances by a whole chunk each step, so
    every retained window token but the ``C`` evicted ones moves (sinks stay).
    """
    return layout.window - layout.chunk


def analytic_bytes(subject: str, preset: Preset) -> BytesMoved:
    """Bytes a steady step of ``subject`` must move at ``preset`` (module docstring)."""
    known = SUBJECTS + tuple(k for keys in PEER_SUBJECTS.values() for k in keys)
    if subject not in known:
        raise ValueError(f"subject must be one of {known}, got {subject!r}")
    row = 2 * preset.token_bytes  # K and V
    chunk = preset.chunk * row
    if subject not in _ROLLS:
        return BytesMoved(chunk_written=chunk, retained_copied=0, clone_temporary=0)
    keep = steady_retained_tokens(CacheLayout(sink=preset.sink, window=preset.window, chunk=preset.chunk))
    return BytesMoved(chunk_written=chunk, retained_copied=keep * row, clone_temporary=keep * row)


@dataclass
class Subject:
    """One thing to time: ``step()`` advances by one chunk and writes it once."""

    key: str
    step: Callable[[], None]
    storages: tuple[Tensor, ...]  # the K/V buffers (to tell cache writes from temporaries)
    obj: Any = None  # the cache, kept alive


def _chunk_inputs(preset: Preset, device: torch.device, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    k = torch.randn(preset.chunk_shape, generator=g).to(device=device, dtype=preset.torch_dtype)
    v = torch.randn(preset.chunk_shape, generator=g).to(device=device, dtype=preset.torch_dtype)
    return k, v


def _streamkv_subject(key: str, cls: type[KVCache], preset: Preset, device: torch.device, k: Tensor, v: Tensor) -> Subject:
    cache = cls(
        preset.k_shape, preset.k_shape, seq_dim=preset.seq_dim, sink=preset.sink, window=preset.window,
        chunk=preset.chunk, dtype=preset.torch_dtype, device=device,
    )

    def step() -> None:
        c = cache.next_chunk
        cache.begin_chunk(c)
        cache.write(k, v, layer=0)
        cache.commit_chunk(c)

    return Subject(key, step, (cache.keys(0), cache.values(0)), cache)


def _flashdreams_subject(cls: type, preset: Preset, device: torch.device, k: Tensor, v: Tensor) -> Subject:
    cache = cls(
        k_shape=preset.k_shape, v_shape=preset.k_shape, seq_dim=preset.seq_dim, chunk_size=preset.chunk,
        window_size=preset.window, sink_size=preset.sink, device=device, dtype=preset.torch_dtype,
    )
    state = {"c": 0}

    def step() -> None:
        c = state["c"]
        cache.before_update(c)
        cache.update(k, v)
        cache.after_update(c)
        state["c"] = c + 1

    return Subject("flashdreams", step, (cache._k, cache._v), cache)


def _floor_subject(preset: Preset, device: torch.device, k: Tensor, v: Tensor) -> Subject:
    K = torch.zeros(preset.k_shape, dtype=preset.torch_dtype, device=device)
    V = torch.zeros(preset.k_shape, dtype=preset.torch_dtype, device=device)
    layout = CacheLayout(sink=preset.sink, window=preset.window, chunk=preset.chunk)
    C, d = preset.chunk, preset.seq_dim
    state = {"c": 0}

    def step() -> None:
        # the ring's first slot for this chunk, kept contiguous (host int: no metadata)
        s = min(layout.ring_slot(layout.chunk_start(state["c"])), layout.capacity - C)
        K.narrow(d, s, C).copy_(k)
        V.narrow(d, s, C).copy_(v)
        state["c"] += 1

    return Subject("floor", step, (K, V), (K, V))


def _sglang_subjects(cls: type | None, preset: Preset, device: torch.device, k: Tensor, v: Tensor) -> dict[str, Subject]:
    """sglang's class (when ``cls`` is given) and the drop-in, built as sglang's causal stage builds
    one block's cache (host-int cursors; ``cache_size = sink + window``)."""
    out = {}
    for key, factory in (("sglang", cls), ("sglang_ring", RingCausalSelfAttentionKVCache)):
        if factory is None:
            continue
        cache = factory(
            k=torch.zeros(preset.k_shape, dtype=preset.torch_dtype, device=device),
            v=torch.zeros(preset.k_shape, dtype=preset.torch_dtype, device=device),
            global_end_index=torch.zeros(1, dtype=torch.long, device=device),
            local_end_index=torch.zeros(1, dtype=torch.long, device=device), global_end_index_int=0,
            local_end_index_int=0, cache_size=preset.capacity, sink_tokens=preset.sink,
            global_sink_tokens=preset.global_sink,
        )
        state = {"c": 0}

        def step(cache: Any = cache, state: dict[str, int] = state) -> None:
            cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=state["c"] * preset.chunk)
            state["c"] += 1

        out[key] = Subject(key, step, (cache.k, cache.v), cache)
    return out


def build_subjects(preset: Preset, device: torch.device | str, *, seed: int = 0) -> tuple[dict[str, Subject], list[str]]:
    """Every subject at ``preset``, filled to the steady state: their next step evicts.

    Returns the subjects (in :data:`SUBJECTS` order, flashdreams left out with a note
    when it is not installed or cannot hold the layout; then the preset's peers, sglang's
    class left out with a note when sglang is not installed) and the notes.
    """
    device = check_device(device)
    notes: list[str] = []
    k, v = _chunk_inputs(preset, device, seed)
    subjects: dict[str, Subject] = {}
    subjects["current"] = _streamkv_subject("current", ChronologicalCache, preset, device, k, v)
    block_cls = load_block_kv_cache()
    if block_cls is None:
        notes.append("flashdreams is not installed: BlockKVCache skipped (pip install --no-deps flashdreams==0.1.0)")
    elif preset.capacity % preset.chunk:
        notes.append(
            f"BlockKVCache skipped: it needs (sink + window) % chunk == 0, got {preset.capacity} % {preset.chunk}"
        )
    else:
        subjects["flashdreams"] = _flashdreams_subject(block_cls, preset, device, k, v)
    subjects["ring"] = _streamkv_subject("ring", RingCache, preset, device, k, v)
    subjects["floor"] = _floor_subject(preset, device, k, v)
    if "sglang" in preset.peers:
        sglang_cls = load_sglang_causal_kv_cache()
        if sglang_cls is None:
            notes.append("sglang is not installed: its CausalSelfAttentionKVCache skipped "
                         "(pip install --no-deps sglang==0.5.23); the drop-in still runs")
        subjects.update(_sglang_subjects(sglang_cls, preset, device, k, v))
    # fill: chunks 0 .. first_eviction - 1, so that every later step evicts
    layout = CacheLayout(sink=preset.sink, window=preset.window, chunk=preset.chunk)
    for s in subjects.values():
        for _ in range(layout.first_eviction_chunk()):
            s.step()
    return subjects, notes


@dataclass
class MaintenanceResult:
    """Everything measured for one preset (see :func:`measure_maintenance`)."""

    timing: TimingRun
    stats: dict[str, Stats]
    analytic: dict[str, BytesMoved]
    counted: dict[str, WrittenBytes] = field(default_factory=dict)
    transient: dict[str, TransientMemory] = field(default_factory=dict)
    #: minor page faults of one more steady step (CPU; None on CUDA): a rolling cache's
    #: clone is sometimes fresh pages from the kernel, faulted in and zeroed
    page_faults: dict[str, int | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def median(self, key: str) -> float | None:
        s = self.stats.get(key)
        return None if s is None else s.median


def measure_maintenance(
    preset: Preset,
    device: torch.device | str,
    *,
    repeats: int,
    warmup: int = 3,
    warmup_s: float = 0.25,
    transient_steps: int = 3,
    count_bytes: bool = True,
    seed: int = 0,
) -> MaintenanceResult:
    """Time the steady step of every subject at ``preset``, interleaved.

    Then (unless disabled) probe the transient memory of ``transient_steps`` further
    steady steps and count the bytes one more step writes. Every probed step is a
    new chunk that evicts, like the timed ones. Frees the caches before returning.
    """
    device = check_device(device)
    subjects, notes = build_subjects(preset, device, seed=seed)
    try:
        timing = time_interleaved(
            {k: s.step for k, s in subjects.items()}, repeats=repeats, device=device, warmup=warmup, warmup_s=warmup_s
        )
        result = MaintenanceResult(
            timing=timing,
            stats={k: Stats.of(v) for k, v in timing.samples_ms.items()},
            analytic={k: analytic_bytes(k, preset) for k in subjects},
            notes=notes,
        )
        for key, s in subjects.items():
            if transient_steps:
                result.transient[key] = probe_transient(s.step, device, steps=transient_steps)
            if count_bytes:
                result.counted[key] = count_written_bytes(s.step, s.storages)
            result.page_faults[key] = None if device.type == "cuda" else page_faults(s.step)
        return result
    finally:
        subjects.clear()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
