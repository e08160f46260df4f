"""The store interface: what holds a cache's K/V, and the one read contract (:class:`Segment`).

A :class:`~streamkv.storage.KVStorage` keeps the slot metadata (positions, the write plan)
and hands the K/V to a :class:`Store`. A store writes the open span's rows where the plan says,
runs its own begin/commit work (a quantised store encodes at commit), and answers reads with
**segments**: runs of stored rows, each with the positions its rows hold per head. Every reader
-- :func:`~streamkv.attention.attend`'s block loop, its Triton kernel, the certifier -- consumes
segments; none of them asks what kind of store it reads.

A :class:`Segment` is one of:

- **dense** rows in the cache's dtype (``keys``/``values`` in the attention layout, views of the
  store's buffers), possibly through a page table (``pages``: logical page -> physical page of
  ``page`` rows);
- **codes**: ``uint8`` codes and bfloat16 scales of a :class:`~streamkv.stores.codecs.Codec`,
  in the storage basis ``k_basis``/``v_basis`` (``R``: stored ``x @ R.T``), decoded a block at a
  time (:meth:`Segment.load`) or in registers (the Triton kernel).

Each row also says which cache slot it is (``slots``: an offset, a per-head map, or None for
rows outside the cache's slots), so that per-slot statistics of a read come back to the
slots the policy ranks.

Why one module: the store interface, the write plan it receives and the segment it answers with
are one contract (a store's methods are defined by what a segment must say); split, each half
would only make sense read beside the other.
"""

from __future__ import annotations

import abc
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .codecs import Codec, zero_rows
from .dims import Dims
from .pages import PageTable, PlannedPages

__all__ = ["Segment", "Store", "WritePlan"]


@dataclass
class WritePlan:
    """Where the open span's rows go, as the slot policy planned it (owned by the storage).

    ``plan``: device ``int64 [L|1, H|1, chunk]``, the slot of each row (the shared form is
    ``[1, 1, chunk]``); ``per_head``: the plan differs per (layer, head); ``start``: a host
    slot where the span is one contiguous run written at a host offset (the chronological path),
    else None; ``ranges``: the span's slots as host ``(first slot, rows)`` ranges when the
    policy knows them without reading the device (the ring: one range, or two where it wraps),
    else None. Eager writes may copy slices there; traced and captured writes follow ``plan``."""

    plan: Tensor
    per_head: bool
    start: int | None = None
    ranges: tuple[tuple[int, int], ...] | None = None


@dataclass(frozen=True)
class Segment:
    """``n`` stored rows of one layer, attended as one run of key blocks (see the module docstring).

    Attributes:
        n: rows.
        positions: ``int64 [H, n]``, the position each row holds per head (``-1``: hidden); may
            be a broadcast view.
        keys, values: the attention layout ``[..., n, W]`` (token dim next to the features):
            dense rows in the cache dtype, or ``uint8`` codes.
        k_codec, v_codec: None for dense rows, else the codec of the codes.
        k_scale, v_scale: bfloat16 ``[..., n, G]`` scales of scaled codecs.
        groups: channels per scale ``(keys, values)``; features: ``(D, Dv)``.
        k_basis, v_basis: the storage basis ``R`` (stored ``x @ R.T``), or None.
        slots: the cache slot of row ``r``: ``slots + r`` (an int), a per-head map ``[H, n]``
            (a tensor, ``-1``: no slot), or None (rows outside the cache's slots).
        pages, page: a page table (``int64 [n / page]``: logical page -> physical page) over
            physical buffers of whole pages; None: row ``r`` is buffer row ``r``.
        dtype: the dtype a decoded block is computed in (the cache's, at least float32 for codes).
    """

    n: int
    positions: Tensor
    keys: Tensor
    values: Tensor
    features: tuple[int, int]
    dtype: torch.dtype
    k_codec: Codec | None = None
    v_codec: Codec | None = None
    k_scale: Tensor | None = None
    v_scale: Tensor | None = None
    groups: tuple[int, int] = (0, 0)
    k_basis: Tensor | None = None
    v_basis: Tensor | None = None
    slots: int | Tensor | None = 0
    pages: Tensor | None = None
    page: int = 0
    host_pages: tuple[int, ...] | None = field(default=None, compare=False)
    #: the rows' positions change only when the cache's slot positions do (a store's own segments;
    #: not a compressed tier's, whose entries change at every recall): a read may keep what it
    #: derives from them across its passes
    stable: bool = True
    #: a host promise that every row holds a position in every head (none is -1): the read that
    #: builds its plan knows it from host counters (a full window cache's slots, an occupied
    #: prefix), and the block loop then builds no mask where no causal mask is asked
    visible: bool = False
    #: a host promise that every row holds finite numbers, held or not (a store that refuses
    #: non-finite rows before they become its rows: quantised codes under ``check_finite``): the
    #: block loop then hides a row by the mask alone, without zeroing it first
    finite: bool = False
    #: a host promise that rows ``[0, pinned)`` hold slots ``[0, pinned)`` whatever ``slots`` maps
    #: (a quantised store's full-precision sinks, the first of its hot rows)
    pinned: int = 0
    #: a host promise that rows ``[span_from, n)`` hold no position but the open span's (a
    #: quantised store's hot rows past the sinks, without a residual); None: no such promise
    span_from: int | None = None

    @property
    def dense(self) -> bool:
        """Rows stored as they are attended (no codes, no basis)."""
        return self.k_codec is None and self.v_codec is None and self.k_basis is None and self.v_basis is None

    @property
    def contiguous(self) -> bool:
        """Dense rows that lie as one run of the buffers (no page table): SDPA may read them as they lie."""
        return self.dense and self.pages is None

    def _rows(self, t: Tensor, a: int, b: int) -> Tensor:
        """Rows ``[a, b)`` of a buffer in the attention layout (token dim -2), through the page table."""
        if self.pages is None:
            return t.narrow(-2, a, b - a)
        P = self.page
        if self.host_pages is not None:  # eager: page-aligned runs of consecutive physical pages are views
            parts, r = [], a
            while r < b:
                p, off = divmod(r, P)
                phys = self.host_pages[p]
                end = min(b, (p + 1) * P)
                # extend over following logical pages that are physically consecutive
                while end < b and end % P == 0 and self.host_pages[end // P] == phys + (end - p * P) // P:
                    end = min(b, end + P)
                parts.append(t.narrow(-2, phys * P + off, end - r))
                r = end
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)
        idx = torch.arange(a, b, device=t.device)
        phys = self.pages.index_select(0, idx // P) * P + idx % P
        return t.index_select(-2, phys)

    def cuts(self, block: int) -> list[tuple[int, int]]:
        """Row ranges ``[a, b)`` of at most ``block`` rows covering ``[0, n)`` in order. A segment of at
        most ``block`` rows is one range (one kernel call: the rounding of a contiguous read of the
        same rows; through a page table a copy where it crosses runs, small beside a call). A longer
        one, eager over a page table (host pages known), never crosses the end of a run of physically
        consecutive pages: :meth:`load` reads each range as a view of the buffers, no copy."""
        if self.pages is None or self.host_pages is None or self.n <= block:
            return [(a, min(a + block, self.n)) for a in range(0, self.n, block)]
        P, hp, out = self.page, self.host_pages, []
        start = 0
        while start < self.n:
            p = start // P
            q = p + 1
            while q * P < self.n and hp[q] == hp[q - 1] + 1:
                q += 1
            end = min(q * P, self.n)
            out += [(a, min(a + block, end)) for a in range(start, end, block)]
            start = end
        return out

    def load(self, a: int, b: int, dtype: torch.dtype | None = None, drop: Tensor | None = None
             ) -> tuple[Tensor, Tensor]:
        """Attendable K/V of rows ``[a, b)`` in the attention layout: dense rows as stored (a
        view where it can be), codes decoded into ``dtype`` (default :attr:`dtype`: float32, or
        the cache dtype if wider; the float32 values rounded once), in the segment's basis (the
        reader applies ``k_basis`` to the queries and ``v_basis`` to the output). ``drop`` (bool
        ``[..., b - a, 1]``): rows returned as zeros (``where``: a stale non-finite row weighs
        nothing), fused into the decode of codes."""
        k = self._rows(self.keys, a, b)
        v = self._rows(self.values, a, b)
        D, Dv = self.features
        gk, gv = self.groups
        dtype = self.dtype if dtype is None else dtype
        if self.k_codec is not None:
            ks = self._rows(self.k_scale, a, b) if self.k_scale is not None else None
            k = self.k_codec.decode_as(k, ks, D, gk, dtype, drop)
        elif drop is not None:
            k = zero_rows(k, drop)
        if self.v_codec is not None:
            vs = self._rows(self.v_scale, a, b) if self.v_scale is not None else None
            v = self.v_codec.decode_as(v, vs, Dv, gv, dtype, drop)
        elif drop is not None:
            v = zero_rows(v, drop)
        return k, v

    def slot_index(self) -> Tensor | None:
        """``int64 [H, n]``: the cache slot of every row (-1: none), or None when no row is a slot."""
        if self.slots is None:
            return None
        if isinstance(self.slots, Tensor):
            return self.slots
        idx = torch.arange(self.slots, self.slots + self.n, device=self.positions.device)
        return idx.expand(self.positions.shape[0], -1)


class Store(abc.ABC):
    """Holds one cache's K/V for every layer (see the module docstring).

    Implementations: :class:`~streamkv.stores.dense.DenseStore` (the buffers as given) and
    :class:`~streamkv.stores.quant.QuantStore` (codes and scales, full-precision hot rows).
    Calls come from :class:`~streamkv.storage.KVStorage`, after its checks; none may fail for a
    reason a check could have caught."""

    #: rows read back exactly as written (no rounding): certificates need no slack for them
    exact: bool = True
    #: the store can live in preallocated dense ``(K, V)`` buffers (a cache set's one allocation)
    takes_buffers: bool = False

    #: the page table when the store's rows live in pages (:mod:`~streamkv.stores.pages`), else None
    table: PageTable | None = None
    #: the first slot the paged rows hold (a quantised store's codes start after its full-precision sinks)
    row_offset: int = 0

    def __init__(self, dims: Dims, *, num_layers: int, dtype: torch.dtype, device: torch.device) -> None:
        self.dims, self.num_layers, self.dtype, self.device = dims, num_layers, dtype, device

    # ------------------------------------------------------------------ pages
    def paged(self) -> list[Tensor]:
        """The tensors whose token dim (``dims.seq + 1``) holds the paged rows."""
        return []

    def rows_of(self, slots: Tensor) -> Tensor:
        """Buffer rows of ``slots`` (device; through the page table when paged)."""
        rows = slots - self.row_offset if self.row_offset else slots
        return rows if self.table is None else self.table.rows(rows)

    def row_ranges(self, a: int, n: int) -> list[tuple[int, int]]:
        """Buffer rows of slots ``[a, a + n)`` (all paged rows) as ``(first row, rows)`` runs (host)."""
        a -= self.row_offset
        return [(a, n)] if self.table is None else self.table.ranges(a, n)

    def prepare_writes(self, writes: object, why: str, dropping: Iterable[int] = ()) -> PlannedPages | None:
        """Copy on write: before slots are written (``writes``: host ``(first slot, rows)`` ranges -- a
        third element False when the rows are read before they are overwritten, as a roll does --, a
        device tensor of slots, or ``"all"``), the pages holding them that another cache of the family
        also references must become this store's own. Plans that (reserving free pages; raises when
        there are too few) and returns the step that makes it so (its ``cancel()`` gives the pages
        back where the change will not be made), or None when nothing is shared.
        A device tensor of slots is read back once (only while pages are shared). ``dropping``: the
        physical pages (one entry per reference) the change drops before it writes (the kept
        boundaries a reset or a load forgets): a page shared only with them needs no copy."""
        table = self.table
        if table is None or not table.shares:
            return None
        dropping = Counter(dropping)
        P, off, n_rows = table.page, self.row_offset, len(table.host) * table.page
        if isinstance(writes, str):
            pages = whole = range(len(table.host))
        elif isinstance(writes, Tensor):
            rows = writes.reshape(-1) - off
            pages, whole = torch.unique(torch.div(rows[rows >= 0], P, rounding_mode="floor")).tolist(), ()
        else:  # (first slot, rows[, overwritten without being read first: default True])
            pages, whole, read = set(), set(), set()
            for a, m, *blind in writes:
                lo, hi = max(a - off, 0), min(a - off + m, n_rows)
                for p in range(lo // P, -(-hi // P)) if hi > lo else ():
                    pages.add(p)
                    if blind and not blind[0]:
                        read.add(p)
                    elif lo <= p * P and (p + 1) * P <= hi:
                        whole.add(p)
            whole -= read
        cow = table.plan_private(pages, whole, why, dropping)
        if cow is None:
            return None
        seq = self.dims.seq + 1

        def apply() -> None:
            moves = cow()
            for t in self.paged():
                for old, new, copy in moves:
                    if copy:
                        t.narrow(seq, new * P, P).copy_(t.narrow(seq, old * P, P))
            table.pool.drop(old for old, _, _ in moves)

        return PlannedPages(apply, cow.cancel)

    def fork(self) -> Store:
        """A store of a branch: the same pages (its own table), its own copy of what is not paged."""
        raise ValueError(f"{self!r} is not paged: a cache forks only with pages (build it with pages=True)")

    def release(self) -> None:
        """Give the pages back (the store is unusable afterwards)."""
        if self.table is not None:
            self.table.release()

    def private(self) -> dict[str, Tensor]:
        """What the store holds besides its pages (a branch's own: a quantised store's full-precision rows)."""
        return {}

    def snapshot(self) -> dict[str, Any]:
        """This moment's pages (referenced until :meth:`drop_snapshot`) and a copy of :meth:`private`."""
        self.table.pool.share(self.table.host)
        return {"pages": list(self.table.host), "private": {k: t.clone() for k, t in self.private().items()}}

    def restore(self, snap: dict[str, Any]) -> None:
        """Back to a :meth:`snapshot` (which stays valid)."""
        t = self.table
        t.pool.share(snap["pages"])
        t.pool.drop(t.host)
        t.host = list(snap["pages"])
        t.dev.copy_(torch.tensor(t.host, dtype=torch.long))
        for k, x in self.private().items():
            x.copy_(snap["private"][k])

    def drop_snapshot(self, snap: dict[str, Any]) -> None:
        self.table.pool.drop(snap["pages"])

    # ------------------------------------------------------------------ what it holds
    @abc.abstractmethod
    def tensors(self) -> dict[str, Tensor]:
        """Every tensor the store holds, by name (its state, its memory, what ``owns`` checks)."""

    @property
    def nbytes(self) -> int:
        """Device bytes of everything the store holds."""
        return sum(t.nbytes for t in self.tensors().values())

    def config(self) -> dict[str, Any]:
        """What a state dict records about the store and must match to load (the format)."""
        return {}

    def state(self) -> dict[str, Tensor]:
        """The tensors a state dict saves (by name): every slot in slot order, whether paged or not
        (a state loads into a paged or an unpaged store alike)."""
        return self.tensors()

    def load_state(self, state: dict[str, Tensor]) -> None:
        """Copy a validated state's tensors (the names and shapes of :meth:`state`) in."""
        for name, t in self.state().items():
            t.copy_(state[name])

    def check_state(self, state: dict[str, Any], positions: Tensor, end: int, span: int, is_open: bool) -> None:
        """Raise ``ValueError`` unless ``state`` (a whole cache state dict, shapes and dtypes already
        checked) means something this store can hold, given the state's slot ``positions`` and
        lifecycle counters."""

    # ------------------------------------------------------------------ lifecycle
    def begin(self, start: int, n: int, where: WritePlan) -> None:
        """The span ``[start, start + n)`` is open and the plan applied."""

    def reopen(self, start: int, positions: Tensor) -> None:
        """The span from ``start`` was reopened after its commit (called after :meth:`begin`);
        ``positions``: the storage's slot positions ``[L|1, H|1, S]``."""

    def check_commit(self, start: int, n: int) -> None:
        """Raise ``ValueError`` if the span cannot be committed (checked before anything changes)."""

    def commit(self, start: int, n: int, where: WritePlan) -> None:
        """The span becomes history (before the policy's eviction is applied)."""

    @abc.abstractmethod
    def write(self, layer: int, k: Tensor, v: Tensor, where: WritePlan) -> None:
        """One layer's rows of the open span (``n <= chunk`` at ``seq``) into the planned slots."""

    @abc.abstractmethod
    def segments(self, layer: int, positions: Tensor) -> list[Segment]:
        """What a read of ``layer`` attends, given the slots' ``positions [H, S]``."""

    @abc.abstractmethod
    def gather(self, layer: int, which: str, slots: Tensor) -> Tensor:
        """``layer``'s ``"k"``/``"v"`` rows at ``slots [n]`` as stored (a copy, layer layout,
        ``n`` at ``seq``)."""

    def buffers(self) -> tuple[Tensor, Tensor] | None:
        """The dense ``(K, V)`` buffers ``[L, *shape]`` where the store holds rows as they are
        attended (a user's own kernel, an integration's view), else None."""
        return None

    def stored(self, layer: int, which: str) -> Tensor:
        """Every slot of ``layer``'s ``"k"``/``"v"`` as stored (layer layout): a view of the buffer
        where the store holds dense rows, else a decoded copy."""
        return self.gather(layer, which, torch.arange(self.dims.slots, device=self.device))

    def span(self, which: str, where: WritePlan, n: int) -> Tensor:
        """The open span's ``"k"``/``"v"`` rows as written, per head: ``[L, H, R, n, D]`` (before the
        commit: a quantised store's are still full precision)."""
        d = self.dims
        out = []
        for layer in range(self.num_layers):
            slots = where.plan[layer if where.plan.shape[0] > 1 else 0, :, :n]  # [H|1, n]
            if slots.shape[0] == 1:
                out.append(d.to_heads(self.gather(layer, which, slots[0])))
            else:
                x = torch.stack([d.to_heads(self.gather(layer, which, slots[h]))[h] for h in range(slots.shape[0])])
                out.append(x)
        return torch.stack(out)

    def head_view(self, which: str, layer: int | None = None) -> Tensor:
        """The stored ``"k"``/``"v"`` per head: ``[L, H, R, S, D]`` (``[H, R, S, D]`` for one layer);
        read it, never write through it."""
        layers = range(self.num_layers) if layer is None else [layer]
        idx = torch.arange(self.dims.slots, device=self.device)
        x = torch.stack([self.dims.to_heads(self.gather(i, which, idx)) for i in layers])
        return x if layer is None else x[0]

    @abc.abstractmethod
    def write_recall(self, layer: int, head: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Recalled rows of one head (``k``/``v`` ``[n, R, D]``) into ``slots [n]``."""

    @abc.abstractmethod
    def clear_recall(self, layer: int, head: int, slots: Tensor) -> None:
        """Zero ``slots`` of one head."""

    @abc.abstractmethod
    def shift(self, dst: int, src: int, n: int) -> None:
        """Move slots ``[src, src + n)`` to ``[dst, dst + n)`` in every layer (the chronological roll)."""

    @abc.abstractmethod
    def zero_(self) -> None:
        """Forget everything (no stale value can reach an output)."""

    def error_bounds(self, layer: int, which: str, slots: Tensor | None = None) -> Tensor | None:
        """Float32 bounds on ``|x - x_hat|`` per element of ``slots`` (all when None) in the storage
        basis, layer layout; None for an exact store."""
        return None

    def basis(self, which: str) -> Tensor | None:
        """The storage basis ``R`` of ``which`` (stored ``x @ R.T``), or None."""
        return None

    def bytes_per_token(self) -> float:
        """Bytes of one stored token (every layer and head, K and V) where it is held as rows of the
        cache dtype; a quantised store counts its codes and scales."""
        D, Dv = self.dims.features
        return self.num_layers * self.dims.heads * self.dims.rows_per_slot * (D + Dv) * self.dtype.itemsize

    def describe(self) -> dict[str, Any]:
        """What the store holds, for reports: its format; bytes of codes, scales and full-precision
        rows (all of them for a dense store); pages in use when paged; and what a plain bfloat16 cache
        of the same slots would hold (``bf16_bytes``)."""
        D, Dv = self.dims.features
        plain = self.num_layers * self.dims.heads * self.dims.rows_per_slot * self.dims.slots * (D + Dv) * 2
        out = {"format": str(self.dtype).replace("torch.", ""), "bytes": self.nbytes, "code_bytes": 0,
               "scale_bytes": 0, "full_precision_bytes": self.nbytes, "bf16_bytes": plain}
        if self.table is not None:
            pool, page_bytes = self.table.pool, self.nbytes // max(self.table.pool.capacity, 1)
            out["pages"] = {"page": pool.page, "own": len(self.table.host), "shared": sum(
                pool.refs[p] > 1 for p in self.table.host), "pool_used": pool.used, "pool_capacity": pool.capacity,
                "page_bytes": page_bytes}
        return out
