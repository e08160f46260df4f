"""Contention: the CPU time other processes used while a block ran, and a load to make some."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator


__all__ = ["ForeignLoad", "spin_load"]


@contextlib.contextmanager
def spin_load(processes: int) -> Iterator[list[subprocess.Popen]]:
    """A loaded machine for the block: ``processes`` Python processes, each spinning on one CPU
    (a busy loop, no memory traffic), started before the block and killed after it (also when it
    raises). ``processes=0``: nothing started."""
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 0:
        raise ValueError(f"spin_load needs a process count >= 0, got {processes!r}")
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(processes):
            procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(0.2 if procs else 0.0)  # each one past its interpreter's start, spinning
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


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
