"""Transient memory of a step: on the CPU the torch profiler's allocator events (every
allocation and free with its size and op), on CUDA ``torch.cuda.memory_stats`` deltas and the
peak; and page faults."""

from __future__ import annotations

import bisect
import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from streamkv_lab.measure.device import check_device

__all__ = ["TransientMemory", "probe_transient", "page_faults"]


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
    ops = _op_index([e for e in events if e.name() != "[memory]"])
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


def _op_index(ops: list[Any]) -> dict[int, tuple[list[int], list[tuple[int, str]]]]:
    """Per thread, the ops' start times sorted (ties in event order) beside (end, name): what
    :func:`_enclosing_op` bisects, built once per probe instead of a scan per allocation."""
    rows: dict[int, list[tuple[int, int, int, str]]] = {}
    for i, o in enumerate(ops):
        rows.setdefault(o.start_thread_id(), []).append((o.start_ns(), i, o.end_ns(), o.name()))
    index = {}
    for tid, r in rows.items():
        r.sort()
        index[tid] = ([start for start, _, _, _ in r], [(end, name) for _, _, end, name in r])
    return index


def _enclosing_op(index: dict[int, tuple[list[int], list[tuple[int, str]]]], mem_event: Any) -> str:
    """Name of the innermost profiled op (same thread) whose interval holds the event: of the
    ops with ``start <= t <= end``, the one that started last (the last in event order on a tie)."""
    t = mem_event.start_ns()
    starts, spans = index.get(mem_event.start_thread_id(), ([], []))
    for i in range(bisect.bisect_right(starts, t) - 1, -1, -1):
        end, name = spans[i]
        if end >= t:
            return name
    return "(outside any op)"
