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
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .codecs import Codec
from .dims import Dims

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

    def load(self, a: int, b: int, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """Attendable K/V of rows ``[a, b)`` in the attention layout: dense rows as stored (a
        view where it can be), codes decoded into ``dtype`` (default :attr:`dtype`: float32, or
        the cache dtype if wider; the float32 values rounded once), in the segment's basis (the
        reader applies ``k_basis`` to the queries and ``v_basis`` to the output)."""
        k = self._rows(self.keys, a, b)
        v = self._rows(self.values, a, b)
        D, Dv = self.features
        gk, gv = self.groups
        dtype = self.dtype if dtype is None else dtype
        if self.k_codec is not None:
            ks = self._rows(self.k_scale, a, b) if self.k_scale is not None else None
            k = self.k_codec.decode_as(k, ks, D, gk, dtype)
        if self.v_codec is not None:
            vs = self._rows(self.v_scale, a, b) if self.v_scale is not None else None
            v = self.v_codec.decode_as(v, vs, Dv, gv, dtype)
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

    def __init__(self, dims: Dims, *, num_layers: int, dtype: torch.dtype, device: torch.device) -> None:
        self.dims, self.num_layers, self.dtype, self.device = dims, num_layers, dtype, device

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
        """The tensors a state dict saves (by name)."""
        return self.tensors()

    def check_state(self, state: dict[str, Any], positions: Tensor, end: int, span: int, is_open: bool) -> None:
        """Raise ``ValueError`` unless ``state`` (a whole cache state dict, shapes and dtypes already
        checked) means something this store can hold, given the state's slot ``positions`` and
        lifecycle counters."""

    # ------------------------------------------------------------------ lifecycle
    def begin(self, start: int, n: int, where: WritePlan) -> None:
        """The span ``[start, start + n)`` is open and the plan applied."""

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

    def describe(self) -> dict[str, Any]:
        """What the store holds, for reports: format, bytes of codes, scales and full-precision rows."""
        return {"format": str(self.dtype).replace("torch.", ""), "bytes": self.nbytes}
