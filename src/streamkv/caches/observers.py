"""The observer protocol: what a cache tells the code that watches it.

One protocol serves eviction listeners, the certificate and recall (:mod:`streamkv.certify`),
the whole-history check and the recording harness of the experiments. An observer
subclasses :class:`CacheObserver` and overrides what it needs; the cache calls, in order::

    begin_chunk(c)   on_evict(event)            (if the reservation evicts: ring, chronological)
                     on_begin(cache, c, advance)
    write / update   on_write(cache, layer, k, v)
                     -- the write --
    update(.., q)    on_queries(cache, layer, q)  (between the write and attention: certify,
                                                   recall into the storage's recall slots)
    commit_chunk(c)  on_evict(event)            (scored policies)
                     on_commit(cache, c)
    reset()          on_reset(cache)

Every call but ``on_queries`` comes **before** the change it announces, so an observer may
still read what is about to leave (``event.cache`` holds the evicted tokens at the time of the
call). An observer that raises aborts the call: the cache stays exactly as it was (observers
told before it were told of a change that did not happen; a retry tells them again).
``on_queries`` runs after the write (it needs the written keys): if it raises, the chunk's new
K/V stay written (a retry rewrites them). Observers run on the host, in eager mode only: a
captured CUDA graph replays writes without them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from torch import Tensor

if TYPE_CHECKING:
    from .cache import KVCache

__all__ = ["CacheObserver", "EvictionEvent"]


@dataclass(frozen=True)
class EvictionEvent:
    """Tokens about to leave a cache, announced before their slots change.

    ``evicted``: device ``bool [num_layers, heads, slots]`` (the shape of
    ``cache.slot_positions``), True where the token held now leaves. ``at``: ``"begin"`` (a
    window cache's reservation overwrites it) or ``"commit"`` (a scored policy evicts it).
    ``shared_slots``: the evicted slots as host ints when every layer and head loses the
    same ones and the policy knows them without a device read (window policies), else None.
    ``info``: what the policy says about it (scored policies: ``overflow`` bool ``[L, H]``,
    the budget alone left too little room; ``dropped_mass_bound`` float64 ``[L, H]``).
    """

    cache: KVCache
    chunk_idx: int
    at: Literal["begin", "commit"]
    evicted: Tensor
    shared_slots: tuple[int, ...] | None = None
    info: dict[str, Tensor] = field(default_factory=dict)


class CacheObserver:
    """Base of cache observers: every hook does nothing. See the module docstring."""

    def on_begin(self, cache: KVCache, chunk_idx: int, advance: bool) -> None:
        """Chunk ``chunk_idx`` is about to be reserved (``advance``) or reopened."""

    def on_evict(self, event: EvictionEvent) -> None:
        """Tokens are about to leave (see :class:`EvictionEvent`)."""

    def on_write(self, cache: KVCache, layer: int, k: Tensor, v: Tensor) -> None:
        """``k``/``v`` (checked) are about to be written as the open chunk of ``layer``."""

    def on_queries(self, cache: KVCache, layer: int, q: Tensor) -> None:
        """The chunk's queries of ``layer``, after its write and before attention."""

    def on_commit(self, cache: KVCache, chunk_idx: int) -> None:
        """Chunk ``chunk_idx`` is about to become history (after any ``on_evict`` of it)."""

    def on_reset(self, cache: KVCache) -> None:
        """The cache is about to forget its stream."""


class EvictionListener(CacheObserver):
    """An observer from a function called with every :class:`EvictionEvent`."""

    def __init__(self, fn) -> None:
        if not callable(fn):
            raise TypeError(f"listener must be callable, got {type(fn).__name__}")
        self.fn = fn

    def on_evict(self, event: EvictionEvent) -> None:
        self.fn(event)
