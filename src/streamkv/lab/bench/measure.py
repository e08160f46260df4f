"""Device-generic measurement: step timing, transient memory, bytes written, versions.

Every function takes the device the work runs on and picks the instrument:

==================  =======================================  ==================================
figure              CPU                                      CUDA
==================  =======================================  ==================================
time of a step      ``time.perf_counter`` around the call    CUDA events around the call, then
                    (CPU ops are synchronous)                ``event.synchronize()``
transient memory    ``torch.profiler`` memory events         ``torch.cuda.memory_stats`` deltas
                    (``profile_memory=True``): every         (``allocated_bytes.all.allocated``
                    allocation/free with its size and op     / ``freed``) and
                                                             ``max_memory_allocated`` - before
bytes written       a ``TorchDispatchMode`` that adds up what every aten op writes (both devices)
==================  =======================================  ==================================

Timing interleaves the subjects (one step of each per round, the order rotating), so
that the noise of a shared machine (another process, a vCPU descheduled for a tick)
hits every subject alike; it reports the whole distribution, not just a median.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "ForeignLoad",
    "Stats",
    "TimingRun",
    "TransientMemory",
    "WrittenBytes",
    "check_device",
    "count_written_bytes",
    "page_faults",
    "probe_transient",
    "sync",
    "time_interleaved",
]


def check_device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device``; ``ValueError`` if it is neither CPU nor an available CUDA device."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} requested but CUDA is not available in this torch build/machine")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device must be cpu or cuda, got {str(device)!r}")
    return dev


def sync(device: torch.device) -> None:
    """Wait for queued work on ``device`` (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ====================================================================== timing
@dataclass(frozen=True)
class Stats:
    """Distribution of repeated timings, in milliseconds."""

    median: float
    p10: float
    p25: float
    p75: float
    p90: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples_ms: Iterable[float]) -> Stats:
        xs = sorted(samples_ms)
        if not xs:
            raise ValueError("Stats.of needs at least one sample")
        return cls(
            median=_quantile(xs, 0.5), p10=_quantile(xs, 0.1), p25=_quantile(xs, 0.25),
            p75=_quantile(xs, 0.75), p90=_quantile(xs, 0.9), min=xs[0], max=xs[-1], n=len(xs),
        )

    @property
    def iqr(self) -> float:
        return self.p75 - self.p25

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "iqr": self.iqr}


def _quantile(xs: list[float], q: float) -> float:
    """Linear-interpolation quantile of sorted ``xs`` (numpy's default)."""
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    """A function that runs ``fn`` once and returns its time in ms on ``device``."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)

        def cuda_time(fn: Callable[[], None]) -> float:
            stream = torch.cuda.current_stream(device)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            return float(start.elapsed_time(end))

        return cuda_time

    def cpu_time(fn: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return cpu_time


@dataclass
class TimingRun:
    """Samples of :func:`time_interleaved` and how they were taken.

    ``samples_ms``: per step, the samples its statistics use: the *clean* ones (no
    preemption of this process's threads during the call, no machine stall around
    the round) when there are at least ``min_clean`` of them, else all of them;
    ``clean``: clean samples per step; ``contended``: samples left out (or, where
    ``included``, kept for want of clean ones); ``rounds``: timed rounds run;
    ``stalled_rounds``: rounds the sentinel flagged; ``foreign_load``: share of the
    machine's CPUs other processes used meanwhile; ``detector``: what was available.
    """

    samples_ms: dict[str, list[float]]
    clean: dict[str, int]
    contended: dict[str, int]
    included: dict[str, bool]
    rounds: int
    stalled_rounds: int
    detector: str
    foreign_load: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds, "clean_samples": self.clean, "contended_samples": self.contended,
            "contended_included": self.included, "stalled_rounds": self.stalled_rounds,
            "detector": self.detector, "foreign_cpu_share": self.foreign_load,
        }

class _RunDelay:
    """Nanoseconds this process's threads have spent runnable but not running.

    Linux ``/proc/self/task/<tid>/schedstat`` (second field: run-queue wait). A step
    during which it grows was preempted by another process: with OpenMP, a worker
    preempted for one scheduler tick holds every thread at the region's barrier, so
    the step takes milliseconds longer for reasons that have nothing to do with it.
    """

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    @classmethod
    def create(cls) -> _RunDelay | None:
        try:
            tids = os.listdir("/proc/self/task")
        except OSError:
            return None
        paths = [f"/proc/self/task/{t}/schedstat" for t in tids]
        probe = cls(paths)
        return probe if probe.read() is not None else None

    def read(self) -> int | None:
        total = 0
        try:
            for p in self.paths:
                with open(p, "rb") as f:
                    total += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            return None
        return total


class _Sentinel:
    """A fixed multi-threaded copy timed around each round, on CPU with > 1 thread.

    On a shared or virtualised machine an OpenMP worker whose vCPU is descheduled
    makes every parallel region wait a scheduler tick (milliseconds instead of
    microseconds), for stretches of a second or more, and not always visibly to
    this guest's scheduler. The sentinel detects such a stretch so that the round
    can be run again.
    """

    def __init__(self) -> None:
        self.a = torch.zeros(1 << 20, dtype=torch.bfloat16)  # 2 MB: above torch's parallel grain
        self.b = torch.ones(1 << 20, dtype=torch.bfloat16)
        for _ in range(5):
            self.a.copy_(self.b)
        times = sorted(self.time() for _ in range(31))
        self.base_ms = times[len(times) // 4]  # a low quantile: calibration may itself be disturbed
        self.threshold_ms = max(1.0, 20 * self.base_ms)

    def time(self) -> float:
        t0 = time.perf_counter()
        self.a.copy_(self.b)
        return (time.perf_counter() - t0) * 1e3

    def clean(self) -> bool:
        """Not stalled: a copy right after a waking one is fast (a worker that merely
        slept between parallel regions is not a stall; a descheduled vCPU is)."""
        self.a.copy_(self.b)
        return self.time() <= self.threshold_ms


@contextlib.contextmanager
def _reenable_gc(enabled: bool) -> Iterator[None]:
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _tolerated_wait_ms(step_ms: float) -> float:
    """Run-queue wait a sample may contain and still count as clean."""
    return max(0.05, 0.05 * step_ms)


def time_interleaved(
    steps: Mapping[str, Callable[[], None]],
    *,
    repeats: int,
    device: torch.device | str,
    warmup: int = 3,
    warmup_s: float = 0.25,
    max_rounds_factor: int = 3,
    max_time_factor: float = 2.0,
) -> TimingRun:
    """Time calls of each step, one of each per round, in ms, until every step has
    ``repeats`` clean samples (or ``max_rounds_factor * repeats`` rounds have run).

    Warm-up: at least ``warmup`` rounds *and* ``warmup_s`` seconds (a time floor,
    because an idle vCPU or a sleeping OpenMP pool takes a few milliseconds to
    wake, whatever the step). The order of the steps rotates each round. Each call
    must do the whole work it is charged for (e.g. advance a cache by one chunk).

    Contention (a shared machine): a sample is *contended* when this process's
    threads waited on the run queue during it for more than
    :func:`_tolerated_wait_ms` (Linux schedstat, :class:`_RunDelay`), or when, on CPU
    with more than one thread, the sentinel (:class:`_Sentinel`) shows the machine
    stalled around its round. Contended samples are left out, unless a step has fewer
    than half of ``repeats`` clean ones: then all its samples are kept and
    ``TimingRun.included`` says so. Extra rounds (to replace contended samples) stop at
    ``max_rounds_factor * repeats`` rounds or ``max_time_factor`` times the time the
    first ``repeats`` rounds took, whichever comes first.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = check_device(device)
    names = list(steps)
    timer = _timer(device)
    sentinel = _Sentinel() if device.type == "cpu" and torch.get_num_threads() > 1 else None
    sync(device)
    t0 = time.perf_counter()
    rounds = 0
    while rounds < warmup or time.perf_counter() - t0 < warmup_s:
        for name in names:
            timer(steps[name])
        rounds += 1
    delay = _RunDelay.create()  # after warm-up: the thread pool exists
    detector = ", ".join(
        d for d, on in (("schedstat run-queue wait", delay is not None), ("stall sentinel", sentinel is not None)) if on
    ) or "none"
    clean: dict[str, list[float]] = {n: [] for n in names}
    contended: dict[str, list[float]] = {n: [] for n in names}
    r = stalled = 0
    gc_was_enabled = gc.isenabled()
    gc.disable()  # as timeit does: no collector pass inside a timed call
    t_start = time.perf_counter()
    t_repeats: float | None = None  # time the first `repeats` rounds took
    with _reenable_gc(gc_was_enabled), ForeignLoad() as load:
        while min(len(v) for v in clean.values()) < repeats and r < max_rounds_factor * repeats:
            if r == repeats:
                t_repeats = time.perf_counter() - t_start
            if t_repeats is not None and time.perf_counter() - t_start > max_time_factor * t_repeats:
                break  # replacing contended samples costs too long: keep what there is
            k = r % len(names)
            ok = sentinel is None or sentinel.clean()
            got = {}
            for name in names[k:] + names[:k]:
                w0 = delay.read() if delay is not None else None
                ms = timer(steps[name])
                w1 = delay.read() if delay is not None else None
                waited = (w1 - w0) / 1e6 if w0 is not None and w1 is not None else 0.0
                got[name] = (ms, waited <= _tolerated_wait_ms(ms))
            round_ok = ok and (sentinel is None or sentinel.clean())
            stalled += not round_ok
            for name, (ms, quiet) in got.items():
                (clean if quiet and round_ok else contended)[name].append(ms)
            r += 1
    need = max(1, (repeats + 1) // 2)
    included = {n: len(clean[n]) < need for n in names}
    samples = {n: clean[n] + contended[n] if included[n] else clean[n] for n in names}
    return TimingRun(
        samples_ms=samples, clean={n: len(clean[n]) for n in names}, contended={n: len(contended[n]) for n in names},
        included=included, rounds=r, stalled_rounds=stalled, detector=detector, foreign_load=load.share,
    )


# ============================================================= transient memory
@dataclass(frozen=True)
class TransientMemory:
    """What one steady step allocates on the device, worst step of those probed.

    ``allocated_bytes``: bytes of all allocations made inside the step (freed or not);
    ``freed_bytes``: bytes freed inside it; ``peak_bytes``: the high-water mark above
    the memory in use when the step began; ``allocations``: how many allocations;
    ``by_op``: allocated bytes per innermost aten op (CPU profiler only);
    ``page_faults``: minor page faults of the process during the step (CPU only: a
    large fresh allocation is mapped and zeroed page by page); ``method``: the instrument.
    """

    allocated_bytes: int
    freed_bytes: int
    peak_bytes: int
    allocations: int
    steps: int
    method: str
    by_op: dict[str, int] = field(default_factory=dict)
    page_faults: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def probe_transient(step: Callable[[], None], device: torch.device | str, *, steps: int = 3) -> TransientMemory:
    """Run ``step`` ``steps`` times and report the allocations of the worst one.

    CPU: ``torch.profiler`` with ``profile_memory=True`` records every allocation and
    free of the CPU allocator (host memory: on CPU, that is all the K/V memory).
    CUDA: device allocations only, from the caching allocator's cumulative counters
    (a 0-dim host scalar wrapped for a kernel argument is not seen there).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    device = check_device(device)
    probe = _probe_cuda if device.type == "cuda" else _probe_cpu
    results = [probe(step, device) for _ in range(steps)]
    worst = max(results, key=lambda r: (r.allocated_bytes, r.peak_bytes, r.allocations))
    return TransientMemory(
        allocated_bytes=worst.allocated_bytes, freed_bytes=worst.freed_bytes, peak_bytes=worst.peak_bytes,
        allocations=worst.allocations, steps=steps, method=worst.method, by_op=worst.by_op,
        page_faults=None if device.type == "cuda" else page_faults(step),
    )


def page_faults(step: Callable[[], None]) -> int | None:
    """Minor page faults of this process during one call (None where unavailable)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return None
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _probe_cuda(step: Callable[[], None], device: torch.device) -> TransientMemory:
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_stats(device)
    in_use = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    after = torch.cuda.memory_stats(device)

    def delta(key: str) -> int:
        return int(after.get(key, 0) - before.get(key, 0))

    return TransientMemory(
        allocated_bytes=delta("allocated_bytes.all.allocated"),
        freed_bytes=delta("allocated_bytes.all.freed"),
        peak_bytes=max(0, torch.cuda.max_memory_allocated(device) - in_use),
        allocations=delta("allocation.all.allocated"),
        steps=1,
        method="torch.cuda.memory_stats deltas + max_memory_allocated",
    )


def _probe_cpu(step: Callable[[], None], device: torch.device) -> TransientMemory:
    from torch.profiler import ProfilerActivity, profile

    with _native_stderr_muted(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    try:
        events = list(prof.profiler.kineto_results.events())
    except AttributeError as exc:  # pragma: no cover - a torch without kineto results
        raise RuntimeError(f"this torch ({torch.__version__}) exposes no profiler memory events: {exc}") from exc
    mem = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    ops = [e for e in events if e.name() != "[memory]"]
    allocated = freed = allocations = 0
    running = peak = 0
    by_op: dict[str, int] = {}
    for e in mem:
        n = int(e.nbytes())
        running += n
        peak = max(peak, running)
        if n > 0:
            allocated += n
            allocations += 1
            op = _enclosing_op(ops, e)
            by_op[op] = by_op.get(op, 0) + n
        else:
            freed -= n
    return TransientMemory(
        allocated_bytes=allocated, freed_bytes=freed, peak_bytes=peak, allocations=allocations, steps=1,
        method="torch.profiler(profile_memory=True) CPU allocator events", by_op=by_op,
    )


@contextlib.contextmanager
def _native_stderr_muted() -> Iterator[None]:
    """Silence file descriptor 2 while the profiler starts and stops: its C++ backend
    prints a ``USDT ... profiler_start``/``profiler_stop`` line on every use. Python-level
    errors are unaffected (they are printed after the descriptor is restored)."""
    import os

    try:
        saved = os.dup(2)
    except OSError:  # no stderr descriptor: nothing to mute
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _enclosing_op(ops: list[Any], mem_event: Any) -> str:
    """Name of the innermost profiled op (same thread) whose interval holds the event."""
    t, tid = mem_event.start_ns(), mem_event.start_thread_id()
    best = None
    for o in ops:
        if o.start_thread_id() == tid and o.start_ns() <= t <= o.end_ns():
            if best is None or o.start_ns() >= best.start_ns():
                best = o
    return best.name() if best is not None else "(outside any op)"


# ================================================================ bytes written
@dataclass(frozen=True)
class WrittenBytes:
    """Bytes written by the aten ops of one call, by destination.

    ``cache``: into the given K/V storages (through any view or dtype); ``temporary``:
    into other floating-point tensors (clones, scratch); ``metadata``: into other
    integer/bool tensors (slot tables, positions); ``by_op``: all of it per aten op.
    """

    cache: int
    temporary: int
    metadata: int
    by_op: dict[str, int]

    @property
    def total(self) -> int:
        return self.cache + self.temporary + self.metadata

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


# ops that write only part of their mutated argument: (argument holding what is written)
_PARTIAL_WRITES = {"index_copy_": 3, "index_copy": 3, "index_put_": 2, "index_put": 2, "_index_put_impl_": 2}


def count_written_bytes(fn: Callable[[], None], cache_tensors: Iterable[Tensor]) -> WrittenBytes:
    """Run ``fn`` once and count the bytes each aten op writes.

    Rules: a view op writes nothing; an op that mutates an argument writes that
    argument's bytes (``copy_`` into a slice: the slice), except the indexed writes
    (``index_copy_``, ``index_put_``) which write their source's bytes; any other op
    writes its outputs. A write lands in ``cache`` when its destination shares storage
    with one of ``cache_tensors``. Reads are not counted: every byte written here was
    read once (from the source chunk, or from the retained rows), so memory traffic is
    at least twice the total.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    storages = {t.untyped_storage().data_ptr() for t in cache_tensors}
    counts = {"cache": 0, "temporary": 0, "metadata": 0}
    by_op: dict[str, int] = {}

    def add(op: str, dest: Tensor, nbytes: int) -> None:
        if nbytes == 0:
            return
        if dest.untyped_storage().data_ptr() in storages:
            kind = "cache"  # whatever dtype the write sees it as (the ring writes through an int64 view)
        elif not (dest.is_floating_point() or dest.is_complex()):
            kind = "metadata"
        else:
            kind = "temporary"
        counts[kind] += nbytes
        by_op[op] = by_op.get(op, 0) + nbytes

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if getattr(func, "is_view", False):
                return out
            name = func.overloadpacket.__name__
            schema = func._schema
            mutated = []
            for i, a in enumerate(schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    val = kwargs.get(a.name) if a.kwarg_only or a.name in kwargs else (args[i] if i < len(args) else None)
                    if isinstance(val, Tensor):
                        mutated.append(val)
            if mutated:
                if name in _PARTIAL_WRITES and len(args) > _PARTIAL_WRITES[name]:
                    src = args[_PARTIAL_WRITES[name]]
                    add(name, mutated[0], src.numel() * src.element_size())
                else:
                    for t in mutated:
                        add(name, t, t.numel() * t.element_size())
            else:
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, Tensor):
                        add(name, t, t.numel() * t.element_size())
            return out

    with Counter():
        fn()
    return WrittenBytes(by_op=by_op, **counts)


# ================================================================ contention
class ForeignLoad:
    """CPU time other processes used while the block ran, as a share of the machine.

    Reads ``/proc/stat`` (busy = user + nice + system + irq + softirq + steal) and
    subtracts this process's own CPU time; processes of other containers on the same
    cores are invisible to ``ps`` but not to this. ``share`` is None off Linux.
    Usage: ``with ForeignLoad() as load: ...; load.share``.
    """

    def __init__(self) -> None:
        self.share: float | None = None
        self.steal_share: float | None = None

    @staticmethod
    def _busy() -> tuple[float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        return (user + nice + system + irq + softirq + steal) / hz, steal / hz

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def __enter__(self) -> ForeignLoad:
        self._t0, self._b0, self._own0 = time.perf_counter(), self._busy(), self._own()
        return self

    def __exit__(self, *exc: object) -> None:
        b1 = self._busy()
        wall = time.perf_counter() - self._t0
        if self._b0 is None or b1 is None or wall <= 0:
            return
        cpus = os.cpu_count() or 1
        foreign = (b1[0] - self._b0[0]) - (self._own() - self._own0)
        self.share = max(0.0, foreign / (wall * cpus))
        self.steal_share = max(0.0, (b1[1] - self._b0[1]) / (wall * cpus))


# ================================================================== versions
