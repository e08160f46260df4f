"""Contention: the CPU time other processes used while a block ran."""

from __future__ import annotations

import os
import time


__all__ = ["ForeignLoad"]


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
