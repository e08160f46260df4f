"""``Lifecycle``: where a cache's stream stands (the only Python ints of its state).

``end`` positions have entered the stream; the last span is ``[end - span, end)``; it is open
between begin and commit. Every change bumps ``generation``: a read (and a prepared step)
remembers the generation it was made in, so a read kept across a begin, a commit, a reset, a
load, a rewind or a release is refused instead of attended (:meth:`check_current`), and a step
planned before one of them is refused instead of applied (:meth:`check_plan`). ``released``: the
cache gave its pages back (a branch's release); every later call on it is refused. The open span's query positions live on the device (causal
masks read them; a captured graph reads them on replay).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..layout import CacheLayout

__all__ = ["Lifecycle"]


class Lifecycle:
    """The host counters of one cache and the device positions of its open span."""

    def __init__(self, layout: CacheLayout, device: torch.device) -> None:
        self.chunk = layout.chunk
        self.end = 0
        self.span = 0
        self.is_open = False
        self.generation = 0
        self.released = False
        #: forks made of this cache: a fork shares its pages, so a step planned before (its copy on
        #: write found nothing shared) would write pages a branch now holds
        self.forks = 0
        self._arange = torch.arange(layout.chunk, dtype=torch.long, device=device)
        self._positions = self._arange.clone()  # device [chunk]: positions of the span's rows

    # ------------------------------------------------------------------ changes
    def begin(self, start: int, n: int) -> None:
        self._positions.fill_(start).add_(self._arange)
        self.end, self.span, self.is_open = start + n, n, True
        self.generation += 1

    def close(self) -> None:
        self.is_open = False
        self.generation += 1

    def reset(self) -> None:
        self.end, self.span, self.is_open = 0, 0, False
        self.generation += 1

    def release(self) -> None:
        """The cache gave its pages back: every read and step made before is stale, every later call refused."""
        self.released = True
        self.generation += 1

    def restore(self, end: int, span: int, is_open: bool) -> None:
        self._positions.fill_(end - span).add_(self._arange)
        self.end, self.span, self.is_open = end, span, is_open
        self.generation += 1

    # ----------------------------------------------------------------- queries
    @property
    def start(self) -> int:
        """First position of the open (or last) span."""
        return self.end - self.span

    @property
    def open_span(self) -> tuple[int, int] | None:
        return (self.end - self.span, self.span) if self.is_open else None

    @property
    def last_span(self) -> tuple[int, int] | None:
        return (self.end - self.span, self.span) if self.end else None

    @property
    def next_chunk(self) -> int:
        return self.end // self.chunk

    @property
    def open_chunk(self) -> int | None:
        """The open span's chunk index when it is a whole chunk, else None."""
        if not self.is_open or self.span != self.chunk or self.end % self.chunk:
            return None
        return self.end // self.chunk - 1

    def query_positions(self) -> Tensor | None:
        """Device ``int64 [span]``: positions of the open span's rows (None when nothing is open)."""
        return self._positions[: self.span] if self.is_open else None

    def check_current(self, generation: int, what: str) -> None:
        """Raise ``ValueError`` unless ``generation`` is the current one (``what`` names the holder)."""
        if self.released:
            raise ValueError(f"{what} was made before the cache was released: its pages went back to the pool "
                             f"(another branch may hold them now); read another branch")
        if generation != self.generation:
            raise ValueError(
                f"{what} was read before the cache's last begin, commit, reset, load or rewind: its slots, positions "
                f"and occupancy may no longer be what the cache holds; read again (cache.read(layer) or the "
                f"read update() returns)"
            )

    @property
    def plan_epoch(self) -> tuple[int, int]:
        """What a step remembers when it is planned (:meth:`check_plan`)."""
        return self.generation, self.forks

    def check_plan(self, epoch: tuple[int, int], what: str) -> None:
        """Raise ``RuntimeError`` unless the cache is where it was when a step was planned at ``epoch``
        (:attr:`plan_epoch`; ``what`` names the step): a step planned before another change would
        apply a plan of slots, positions and pages that no longer hold, and one planned before a fork
        would write pages the branches now share (its copy on write was planned without them)."""
        generation, forks = epoch
        if self.released:
            raise RuntimeError(f"{what}: the cache was released after the step was planned; nothing changed")
        if forks != self.forks:
            raise RuntimeError(f"{what} was planned before this cache was forked: its pages are shared now and the "
                               f"step's copy on write did not plan for it; prepare it again (nothing changed)")
        if generation != self.generation:
            raise RuntimeError(f"{what} was planned before the cache's last begin, commit, reset, load or rewind: "
                               f"its plan no longer matches the cache; prepare it again (nothing changed)")

    def open_name(self) -> str:
        c = self.open_chunk
        return f"chunk {c}" if c is not None else f"span {self.open_span}"

    def commit_call(self) -> str:
        c = self.open_chunk
        return f"commit_chunk({c})" if c is not None else "commit()"
