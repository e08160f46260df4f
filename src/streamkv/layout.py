"""Pure arithmetic of a streaming KV cache: sinks, window, chunks, positions and slots.

Nothing here touches a tensor. Every cache and the reference share these formulas,
so each one is written once and tested on its own.

Vocabulary
----------
position
    A token's logical index in the whole stream (``0, 1, 2, ...``; never wraps).
slot
    A physical row of the cache buffer (``0 .. capacity - 1``). Never call a slot a
    position.
sink
    The first ``sink`` positions of the stream, pinned forever.
window
    The last ``window`` positions of history kept besides the sinks. The chunk
    being written counts as history: while chunk ``c`` is open the window ends at
    its last position.
chunk
    The ``chunk`` tokens written together; chunk ``c`` holds positions
    ``[c * chunk, (c + 1) * chunk)``. A chunk may straddle the sink boundary.

The retained set after ``end`` positions have entered the stream is::

    [0, min(sink, end))  U  [max(sink, end - window), end)

Two physical layouts place it in ``capacity = sink + window`` slots:

chronological (the current path)
    sinks at slots ``[0, sink)``, then the window in position order. Advancing moves
    ("rolls") the retained window left.
ring (circular)
    sinks at slots ``[0, sink)``; window position ``p`` at slot
    ``sink + (p - sink) % window``. A new chunk overwrites the oldest window
    positions in place and nothing retained ever moves.

Example (``sink=2, window=4, chunk=3``; slot contents are positions)::

    end=9   chronological [0 1 | 5 6 7 8]      ring [0 1 | 6 7 8 5]
    end=12  chronological [0 1 | 8 9 10 11]    ring [0 1 | 10 11 8 9]
    end=15  chronological [0 1 | 11 12 13 14]  ring [0 1 | 14 11 12 13]

(chunk 1 = positions 3, 4, 5 straddles nothing here; chunk 0 = 0, 1, 2 straddles the
sink boundary; chunk 3 = 9, 10, 11 wraps across the end of the ring.)

Why this long: the worked example is the layout's check a reader can do by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

from .validate import check_int

__all__ = ["CacheLayout"]


@dataclass(frozen=True)
class CacheLayout:
    """Sizes of a sink + window cache, in tokens.

    Args:
        sink: pinned positions at the start of the stream (``>= 0``); need not be a
            multiple of ``chunk``.
        window: positions of history kept besides the sinks (``>= chunk``); need not
            be a multiple of ``chunk``.
        chunk: tokens written per chunk (``>= 1``).

    Raises:
        TypeError: a size that is not an int.
        ValueError: a negative size, or ``chunk > window`` (the chunk being written
            must fit in the window).
    """

    sink: int
    window: int
    chunk: int

    def __post_init__(self) -> None:
        for name, minimum in (("sink", 0), ("chunk", 1), ("window", 1)):
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum))
        if self.chunk > self.window:
            raise ValueError(
                f"chunk ({self.chunk}) must be <= window ({self.window}): the chunk being "
                f"written is part of the window"
            )

    # ----------------------------------------------------------------- sizes
    @property
    def capacity(self) -> int:
        """Slots in the buffer: ``sink + window``."""
        return self.sink + self.window

    # -------------------------------------------------------------- positions
    def chunk_start(self, chunk_idx: int) -> int:
        """First position of chunk ``chunk_idx``."""
        return chunk_idx * self.chunk

    def chunk_positions(self, chunk_idx: int) -> range:
        """Positions written by chunk ``chunk_idx``."""
        start = chunk_idx * self.chunk
        return range(start, start + self.chunk)

    def window_start(self, end: int) -> int:
        """First retained non-sink position once ``end`` positions are in the stream."""
        return max(self.sink, end - self.window)

    def num_valid(self, end: int) -> int:
        """Retained positions (= occupied slots) once ``end`` positions are in the stream."""
        return min(end, self.capacity)

    def retained_positions(self, end: int) -> list[int]:
        """Retained positions in chronological order: ``[sinks | window]``."""
        sinks = range(min(self.sink, end))
        window = range(self.window_start(end), end)
        return [*sinks, *window]

    def first_eviction_chunk(self) -> int:
        """Index of the first chunk whose reservation evicts a position."""
        # chunk c evicts when (c + 1) * chunk > capacity
        return self.capacity // self.chunk

    # ------------------------------------------------------------------ slots
    def ring_slot(self, position: int) -> int:
        """Slot of ``position`` in the ring layout."""
        if position < self.sink:
            return position
        return self.sink + (position - self.sink) % self.window

    def chronological_slot(self, position: int, end: int) -> int:
        """Slot of a retained ``position`` in the chronological layout at ``end``."""
        if position < self.sink:
            return position
        return self.sink + position - self.window_start(end)

    def ring_chronological_slots(self, end: int) -> list[int]:
        """Ring slots listed in chronological order of the positions they hold."""
        return [self.ring_slot(p) for p in self.retained_positions(end)]

    def ring_wraps(self, end: int) -> int:
        """How many times the ring's write cursor has passed the end of the buffer."""
        if end <= self.sink:
            return 0
        return (end - self.sink - 1) // self.window
