"""Pages: a store's slot-indexed buffers as a pool of fixed-size pages, shared copy-on-write by a
cache and its forks.

A paged store keeps its rows in a pool of ``pages`` physical pages of ``page`` rows each (every
layer, every head: a page is ``page`` consecutive slots of the whole cache). Each cache of a
family (a cache and the branches :meth:`~streamkv.caches.KVCache.fork` made of it) has its own
:class:`PageTable`: logical page ``p`` (slots ``[p * page, (p + 1) * page)``) lives in physical
page ``table[p]``. A fork copies the table, not the rows: every page is then referenced by several
tables (:class:`PagePool` counts them). Before a span is written, the pages it touches that
another table also references are copied to free pages (copy on write, a page at a time; a page
the span overwrites whole is taken without copying), so a branch never changes what another
holds. Tables live on the host (the plan) and on the device (``dev``: what writes and reads index,
updated in place: a captured graph reads the new pages on replay).

An unforked cache's table is the identity and its reads are the contiguous ones of an unpaged
cache.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..validate import check_int

__all__ = ["PageOptions", "PagePool", "PageTable", "PlannedPages", "as_pages"]


@dataclass(frozen=True)
class PageOptions:
    """The ``pages=`` option of a cache: ``page`` rows a page (default: the chunk), ``spare``
    physical pages beyond the cache's own (room for branches and kept boundaries to write;
    default: as many as the cache has, times ``1 + history``), ``history`` chunk boundaries kept
    for :meth:`~streamkv.caches.KVCache.rewind` (their pages stay referenced until they are
    dropped: each may pin a version of every page)."""

    page: int | None = None
    spare: int | None = None
    history: int = 0

    def __post_init__(self) -> None:
        for name in ("page", "spare"):
            v = getattr(self, name)
            if v is not None:
                check_int(f"pages {name}", v, 1 if name == "page" else 0)
        check_int("pages history", self.history, 0)


def as_pages(pages: object) -> PageOptions | None:
    """``None``/``False`` (unpaged), ``True`` (defaults), a :class:`PageOptions` or a dict of its fields."""
    if pages is None or pages is False:
        return None
    if pages is True:
        return PageOptions()
    if isinstance(pages, PageOptions):
        return pages
    if isinstance(pages, dict):
        return PageOptions(**pages)
    raise TypeError(f"pages must be None, True, a PageOptions or a dict of its fields, got {type(pages).__name__}")


class PagePool:
    """The physical pages of a cache family: which are free and how many tables reference each."""

    def __init__(self, pages: int, page: int) -> None:
        self.page, self.capacity = page, pages
        self.refs = [0] * pages
        self._free = list(range(pages - 1, -1, -1))  # taken from the end: lowest ids first
        self.reserved = 0  # pages promised to planned steps not yet applied

    @property
    def free(self) -> int:
        return len(self._free) - self.reserved

    def reserve(self, n: int, why: str) -> Reservation:
        """Promise ``n`` pages to a planned step (taken when it applies; given back if the step is
        dropped unapplied). Raises ``RuntimeError`` (naming ``why``) when fewer are free."""
        if n > self.free:
            raise RuntimeError(
                f"{why} needs {n} free page(s) and the page pool has {self.free} of {self.capacity} free: "
                f"release a branch (cache.release()), keep fewer rewind boundaries (pages={{'history': N}}: each "
                f"pins the pages it saw), or build the cache with more spare pages (pages={{'spare': N}})")
        return Reservation(self, n)

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    def take(self, n: int, why: str) -> list[int]:
        """``n`` free pages, each referenced once. Raises ``RuntimeError`` (naming ``why``) when
        fewer are free; nothing is taken then."""
        if n > len(self._free) - self.reserved:
            raise RuntimeError(
                f"{why} needs {n} free page(s) and the page pool has {len(self._free) - self.reserved} of "
                f"{self.capacity} free: release a branch (cache.release()), keep fewer rewind boundaries "
                f"(pages={{'history': N}}: each pins the pages it saw), or build the cache with more spare pages "
                f"(pages={{'spare': N}})")
        got = [self._free.pop() for _ in range(n)]
        for p in got:
            self.refs[p] = 1
        return got

    @staticmethod
    def _unreserve(pool: PagePool, n: int) -> None:
        pool.reserved -= n

    def share(self, ids: Iterable[int]) -> None:
        for p in ids:
            self.refs[p] += 1

    def drop(self, ids: Iterable[int]) -> None:
        for p in ids:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self._free.append(p)


class Reservation:
    """Pages promised by :meth:`PagePool.reserve`: :meth:`take` them when the step applies; a
    reservation dropped untaken (a vetoed or refused step) gives them back."""

    def __init__(self, pool: PagePool, n: int) -> None:
        self.pool, self.n = pool, n
        pool.reserved += n
        self._done = weakref.finalize(self, PagePool._unreserve, pool, n)

    def cancel(self) -> None:
        """Give the pages back now (the step will not run); nothing once taken or given back."""
        self._done()

    def take(self) -> list[int]:
        self._done.detach()
        self.pool.reserved -= self.n
        return self.pool.take(self.n, "a reserved write")


class PlannedPages:
    """A planned copy on write: calling it applies the plan (the reserved pages taken);
    :meth:`cancel` gives them back instead (a refused or vetoed change)."""

    def __init__(self, apply: Callable[[], Any], cancel: Callable[[], None]) -> None:
        self._apply, self.cancel = apply, cancel

    def __call__(self) -> Any:
        return self._apply()


class PageTable:
    """One cache's logical page -> physical page map (see the module docstring)."""

    def __init__(self, pool: PagePool, host: Sequence[int], device: torch.device) -> None:
        self.pool, self.host = pool, list(host)
        self.dev = torch.tensor(self.host, dtype=torch.long, device=device)
        self._arange = torch.arange(pool.page, dtype=torch.long, device=device)

    @property
    def page(self) -> int:
        return self.pool.page

    @property
    def identity(self) -> bool:
        """Logical page ``p`` is physical page ``p`` for every page (host check)."""
        return all(p == i for i, p in enumerate(self.host))

    @property
    def shares(self) -> bool:
        """Some page is referenced by another table too."""
        refs = self.pool.refs
        return any(refs[p] > 1 for p in self.host)

    def rows(self, rows: Tensor) -> Tensor:
        """Physical rows of logical ``rows`` (any shape, device): graph-safe."""
        P = self.pool.page
        return self.dev[torch.div(rows, P, rounding_mode="floor")] * P + rows.remainder(P)

    def ranges(self, a: int, n: int) -> list[tuple[int, int]]:
        """Logical rows ``[a, a + n)`` as physical ``(first row, rows)`` runs (host), consecutive
        pages merged."""
        P, out, r, end = self.pool.page, [], a, a + n
        while r < end:
            p, off = r // P, r % P  # not divmod: dynamo does not trace it (a compiled write)
            m = min(end, (p + 1) * P) - r
            first = self.host[p] * P + off
            if out and out[-1][0] + out[-1][1] == first:
                out[-1] = (out[-1][0], out[-1][1] + m)
            else:
                out.append((first, m))
            r += m
        return out

    def fork(self) -> PageTable:
        """A copy referencing the same pages."""
        self.pool.share(self.host)
        return PageTable(self.pool, self.host, self.dev.device)

    def release(self) -> None:
        """Drop every page (the table is unusable afterwards)."""
        self.pool.drop(self.host)
        self.host = []

    def plan_private(self, logical: Iterable[int], whole: Iterable[int] = (), why: str = "this write",
                     dropping: Counter[int] | None = None):
        """The copy-on-write of the logical pages a write touches: those another table references
        get a free page (``whole`` ones: overwritten whole, not copied). Returns ``apply()``, the
        table update (reserved now, taken when it runs: it cannot
        fail; returns the ``(old, new, copy)`` physical pages: the caller copies the rows, then
        drops the old ones), or None when nothing is shared; raises (nothing reserved) when the pool
        lacks free pages. ``dropping``: references to physical pages the same change drops before it
        writes (this cache's kept boundaries, which a reset or a load forgets): a page shared only
        with those is not copied."""
        refs, dropping = self.pool.refs, dropping or Counter()
        need = sorted({p for p in logical if refs[self.host[p]] - dropping[self.host[p]] > 1})
        if not need:
            return None
        held = self.pool.reserve(len(need), why)
        whole = set(whole)

        def apply() -> list[tuple[int, int, bool]]:
            new = held.take()
            moves = [(self.host[p], f, p not in whole) for p, f in zip(need, new)]
            for p, f in zip(need, new):
                self.host[p] = f
            self.dev.index_copy_(0, torch.tensor(need, device=self.dev.device),
                                 torch.tensor(new, device=self.dev.device))
            return moves  # the caller copies the rows, then drops the old pages

        return PlannedPages(apply, held.cancel)

    def __repr__(self) -> str:
        return f"PageTable(pages={len(self.host)}, page={self.pool.page}, identity={self.identity})"
