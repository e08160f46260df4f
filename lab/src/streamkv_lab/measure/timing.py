"""Step timing: the subjects interleaved round by round (the order rotating), so that the
noise of a shared machine (another process, a vCPU descheduled for a tick) hits every subject
alike; the whole distribution is reported, not just a median. ``time.perf_counter`` on the CPU
(ops are synchronous), CUDA events on a GPU."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from streamkv_lab.measure.device import check_device, sync
from streamkv_lab.measure.load import ForeignLoad

__all__ = ["Stats", "TimingRun", "time_interleaved"]


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
    keep_contended: bool = False,
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
    first ``repeats`` rounds took, whichever comes first. ``keep_contended``: a loaded machine is
    the point (a load the caller made): every sample counts, ``repeats`` rounds run.
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
                got[name] = (ms, keep_contended or waited <= _tolerated_wait_ms(ms))
            round_ok = keep_contended or (ok and (sentinel is None or sentinel.clean()))
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
