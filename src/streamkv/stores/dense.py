"""``DenseStore``: the K/V of every layer as dense buffers ``[L, *k_shape]`` in the cache dtype.

Writes follow the storage's :class:`~streamkv.stores.base.WritePlan`:

- a contiguous run at a host offset (``where.start``: the chronological path): one slice copy;
- eager, with host ranges (``where.ranges``: the ring): one ``narrow(...).copy_`` per range and
  tensor (two where the span wraps and is large enough; below ``wrap_slices_min_bytes`` the
  index path is cheaper);
- otherwise through the device plan: one ``index_copy_`` along the token dim for a shared plan,
  one ``index_copy_`` of the (slot, head) rows for a per-head plan. In eager mode both move the
  rows as the widest words they split into (16 bytes as ``complex128``, else 8 as ``int64``: a
  view of the same bytes; a copy never does arithmetic on them, so every bit pattern, NaN
  payloads included, lands as written): on CPU ``index_copy_`` of 2-byte elements ran at 1.7x a
  plain ``copy_``, and 4,680 rows of 256 bytes took 165 us as int64 words, 88 us as 16-byte
  words. Either is safe under CUDA graph
  capture: a graph captured for one chunk writes the next chunk's slots on replay. Inside a
  ``torch.compile`` trace the writes go to the buffers flattened through the token dim (a view:
  inductor then writes in place instead of copying the layer buffer).

A read is one segment of every slot, a view of the layer's buffers: ``attend`` may hand it to
SDPA as it lies.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .base import Segment, Store, WritePlan
from .dims import Dims
from .pages import PageTable

__all__ = ["DenseStore"]


#: the words a row may move as, widest first (reinterpreted bytes, never converted)
_WORDS = (torch.complex128, torch.long)


def word_size(t: Tensor) -> int | None:
    """The widest word size of :data:`_WORDS` that ``t``'s rows split into: contiguous along the
    last dim, every other stride, the offset and the address whole words. None when none does,
    or when ``t``'s elements are already 8 bytes wide."""
    size = t.element_size()
    if size >= 8 or t.stride(-1) != 1:
        return None
    for dtype in _WORDS:
        w = dtype.itemsize
        if ((t.shape[-1] * size) % w == 0 and (t.storage_offset() * size) % w == 0
                and all((st * size) % w == 0 for st in t.stride()[:-1]) and t.data_ptr() % w == 0):
            return w
    return None


def _word_view(t: Tensor, w: int | None) -> Tensor | None:
    """``t`` reinterpreted as words of ``w`` bytes along its last dim (a view), or None where
    its rows do not split into them (a row that splits into wider words splits into narrower)."""
    mine = word_size(t)
    if w is None or mine is None or mine < w:
        return None
    return t.view(next(d for d in _WORDS if d.itemsize == w))


def gather_rows(t: Tensor, idx: Tensor) -> Tensor:
    """Rows ``idx [..., M]`` (broadcast against ``t``'s leading dims) of ``t [..., n, W]``:
    ``[..., M, W]``. Where the features are contiguous, one ``index_select`` of whole rows over
    the buffer seen as rows of ``W`` (a row every ``g`` elements, ``g`` the strides' common
    divisor): 10-25x faster than ``gather``, which indexes every element."""
    lead, W = t.shape[:-1], t.shape[-1]
    strides = [t.stride(d) for d in range(t.dim() - 1)]
    g = 0
    for st in strides:
        g = math.gcd(g, st)
    if t.stride(-1) != 1 or g == 0 or not t.numel():
        shape = (*torch.broadcast_shapes(idx.shape[:-1], lead[:-1]), idx.shape[-1], W)
        return t.expand(*shape[:-2], *t.shape[-2:]).gather(-2, idx.unsqueeze(-1).expand(shape))
    base = torch.zeros((), dtype=torch.long, device=t.device)
    for d, (size, st) in enumerate(zip(lead[:-1], strides[:-1])):
        base = base + torch.arange(size, device=t.device).view([-1] + [1] * (len(lead) - 2 - d)) * (st // g)
    rows = base.unsqueeze(-1) + idx * (strides[-1] // g)  # [..., M]
    span = sum((size - 1) * st for size, st in zip(lead, strides)) // g + 1
    flat = t.as_strided((span, W), (g, 1))
    return flat.index_select(0, rows.reshape(-1)).view(*rows.shape, W)


def put_rows(rows: Tensor, slots: Tensor, heads: Tensor, x: Tensor) -> None:
    """``rows[slots, heads] = x`` for a layer's rows view ``[T, H, *rest, D]`` and ``slots, heads,
    x[:2]`` of shape ``[n, H]`` (distinct pairs): one ``index_copy_`` over the (slot, head) rows
    flattened, as the widest words the rows split into (the CPU's copy of a row is then a
    few word moves), where the view allows; else ``index_put_``."""
    T, H = rows.shape[:2]
    flat = None
    if not torch.compiler.is_compiling() and rows.stride(0) == H * rows.stride(1):
        flat = rows.view(T * H, *rows.shape[2:])  # the strides merge: a view (never a copy)
    if flat is None:
        rows.index_put_((slots, heads), x)
        return
    idx = (slots * H + heads).reshape(-1)
    src = x.reshape(-1, *x.shape[2:])
    w = word_size(flat)
    fw, sw = _word_view(flat, w), _word_view(src, w)
    if fw is not None and sw is not None:
        fw.index_copy_(0, idx, sw)
    else:
        flat.index_copy_(0, idx, src)


def take_rows(rows: Tensor, slots: Tensor, heads: Tensor, out: Tensor) -> None:
    """``out[:] = rows[slots, heads]``, the inverse of :func:`put_rows`: one ``index_select`` of
    the (slot, head) rows flattened, as the widest words the rows split into, where the views
    allow; else advanced indexing. ``out``: ``[n, H, *rest, D]``, contiguous."""
    T, H = rows.shape[:2]
    if not torch.compiler.is_compiling() and rows.stride(0) == H * rows.stride(1):
        flat = rows.view(T * H, *rows.shape[2:])
        dst = out.view(-1, *out.shape[2:])
        w = word_size(flat)
        fw, dw = _word_view(flat, w), _word_view(dst, w)
        if fw is not None and dw is not None:
            torch.index_select(fw, 0, (slots * H + heads).reshape(-1), out=dw)
            return
    out.copy_(rows[slots, heads])


class DenseStore(Store):
    """Dense K/V buffers (see the module docstring). ``buffers``: preallocated ``(K, V)`` of the
    full shapes (a :class:`~streamkv.caches.CacheSet` passes views of one allocation)."""

    #: a span that wraps is written as two slices from this many bytes per tensor on, below it
    #: through the index path: measured on CPU (``streamkv bench`` shapes, 2 threads), two slices
    #: took 2.7 ms against 12.6 ms for a wrapping Self-Forcing chunk (28.8 MB), and 47 us against
    #: 38 us for the tiny DiT's 8 kB (four more dispatched ops than one indexed write per tensor)
    wrap_slices_min_bytes: int = 1 << 16
    takes_buffers = True
    #: False: eager writes follow the device plan too (tests and benchmarks compare the paths)
    eager_slices: bool = True

    def __init__(self, dims: Dims, *, num_layers: int, dtype: torch.dtype, device: torch.device,
                 buffers: tuple[Tensor, Tensor] | None = None, table: PageTable | None = None) -> None:
        super().__init__(dims, num_layers=num_layers, dtype=dtype, device=device)
        self.table = table
        rows = dims.slots if table is None else table.pool.capacity * table.page
        full_k = (num_layers, *dims.shape("k", rows))
        full_v = (num_layers, *dims.shape("v", rows))
        if buffers is None:
            self.keys = torch.zeros(full_k, dtype=dtype, device=device)
            self.values = torch.zeros(full_v, dtype=dtype, device=device)
        else:
            self.keys, self.values = buffers
        self._k_wide, self._v_wide = (_word_view(b, word_size(b)) for b in (self.keys, self.values))
        self._layer_kv = tuple((self.keys[i], self.values[i]) for i in range(num_layers))
        self._heads_idx = torch.arange(dims.heads, device=self.keys.device).expand(dims.chunk, dims.heads)

    def tensors(self) -> dict[str, Tensor]:
        return {"keys": self.keys, "values": self.values}

    def paged(self) -> list[Tensor]:
        return [self.keys, self.values]

    def fork(self) -> DenseStore:
        if self.table is None:
            return super().fork()
        return DenseStore(self.dims, num_layers=self.num_layers, dtype=self.dtype, device=self.device,
                          buffers=(self.keys, self.values), table=self.table.fork())

    def state(self) -> dict[str, Tensor]:
        if self.table is None:
            return self.tensors()
        return {"keys": self._logical(self.keys), "values": self._logical(self.values)}

    def load_state(self, state: dict[str, Tensor]) -> None:
        if self.table is None:
            return super().load_state(state)
        seq = self.dims.seq + 1
        for name, buf in (("keys", self.keys), ("values", self.values)):
            at = 0
            for a, m in self.row_ranges(0, self.dims.slots):
                buf.narrow(seq, a, m).copy_(state[name].narrow(seq, at, m))
                at += m

    def _logical(self, buf: Tensor) -> Tensor:
        """Every layer's slots in slot order (a copy; the buffer itself unpaged)."""
        seq = self.dims.seq + 1
        runs = self.row_ranges(0, self.dims.slots)
        if len(runs) == 1:
            return buf.narrow(seq, runs[0][0], runs[0][1])
        return torch.cat([buf.narrow(seq, a, m) for a, m in runs], dim=seq)

    def _layer(self, layer: int) -> tuple[Tensor, Tensor]:
        """One layer's K and V (views): kept once for eager calls (a ``select`` per call was a third
        of the tiny DiT's write); derived inside a trace, so that every view a compiled step uses
        comes from the one buffer it mutates."""
        if torch.compiler.is_compiling():
            return self.keys[layer], self.values[layer]
        return self._layer_kv[layer]

    # ----------------------------------------------------------------- writes
    def write(self, layer: int, k: Tensor, v: Tensor, where: WritePlan) -> None:
        d = self.dims
        n = k.shape[d.seq]
        keys, values = self._layer(layer)
        ranges = ((where.start, n),) if where.start is not None else self._host_ranges(where, n, k)
        if ranges is not None:
            if self.table is not None:
                ranges = tuple(r for a, m in ranges for r in self.row_ranges(a, m))
            at = 0
            for a, m in ranges:
                src_k = k if len(ranges) == 1 else k.narrow(d.seq, at, m)
                src_v = v if len(ranges) == 1 else v.narrow(d.seq, at, m)
                keys.narrow(d.seq, a, m).copy_(src_k)
                values.narrow(d.seq, a, m).copy_(src_v)
                at += m
            return
        if not where.per_head or d.head is None:
            slots = where.plan[layer if where.per_head else 0, 0]
            if n != d.chunk:
                slots = slots[:n]
            if self.table is not None:
                slots = self.rows_of(slots)
            if torch.compiler.is_compiling() and self._write_traced(layer, k, v, slots):
                return
            # the int64 view helps the eager CPU kernel; a compiled step generates its own
            # kernel (and cannot inspect a traced tensor's storage offset)
            eager = not torch.compiler.is_compiling()
            for buf, wide, x in ((keys, self._k_wide, k), (values, self._v_wide, v)):
                x_wide = _word_view(x, wide.element_size()) if eager and wide is not None else None
                if x_wide is not None:
                    wide[layer].index_copy_(d.seq, slots, x_wide)
                else:
                    buf.index_copy_(d.seq, slots, x)
            return
        plan = where.plan[layer] if n == d.chunk else where.plan[layer, :, :n]
        if self.table is not None:
            plan = self.rows_of(plan)
        if torch.compiler.is_compiling() and self._write_traced_per_head(layer, k, v, plan):
            return
        slots, heads = plan.transpose(0, 1), self._heads_idx[:n]  # [n, H] each
        put_rows(d.rows(keys), slots, heads, d.rows(k))
        put_rows(d.rows(values), slots, heads, d.rows(v))

    def _host_ranges(self, where: WritePlan, n: int, k: Tensor) -> tuple[tuple[int, int], ...] | None:
        """``where.ranges`` when this write may use them: eager (not traced by ``torch.compile``,
        not captured into a CUDA graph), enabled, covering exactly the ``n`` rows, and one range
        or a span of at least ``wrap_slices_min_bytes``."""
        if torch.compiler.is_compiling():
            return None  # checked first: a traced step must not read (and guard on) a host offset
        ranges = where.ranges
        if ranges is None or not self.eager_slices:
            return None
        if self.keys.is_cuda and torch.cuda.is_current_stream_capturing():
            return None  # a graph replays later chunks: it must read their slots from the plan
        if len(ranges) == 1:
            return ranges if ranges[0][1] == n else None
        if k.numel() * k.element_size() < self.wrap_slices_min_bytes:
            return None
        return ranges if sum(m for _, m in ranges) == n else None

    def _flat_buffers(self) -> list[Tensor] | None:
        """K and V flattened through the token dim (views), or None where that is not a view."""
        seq = self.dims.seq + 1
        flats = []
        for buf in (self.keys, self.values):
            shape, stride = buf.shape, buf.stride()
            if any(stride[d] != stride[d + 1] * shape[d + 1] for d in range(seq)):
                return None
            flats.append(buf.flatten(0, seq))
        return flats

    def _write_traced(self, layer: int, k: Tensor, v: Tensor, slots: Tensor) -> bool:
        """The shared-plan write inside a ``torch.compile`` trace: ``index_copy_`` into each buffer
        flattened through its token dimension (a view), at ``(layer, leading index) * S + slot``.
        Inductor writes that in place; through a ``select`` of the layer it copied the whole layer
        buffer into a temporary per call (measured on CPU). False when the buffers do not flatten."""
        d = self.dims
        seq = d.seq + 1
        flats = self._flat_buffers()
        if flats is None:
            return False
        lead, S = math.prod(d.k_shape[: d.seq]), self.keys.shape[d.seq + 1]
        idx = slots if lead == 1 else (torch.arange(lead, device=slots.device)[:, None] * S + slots).reshape(-1)
        idx = idx + layer * lead * S
        for flat, x in zip(flats, (k, v)):
            flat.index_copy_(0, idx, x.flatten(0, seq - 1) if seq > 1 else x)
        return True

    def _write_traced_per_head(self, layer: int, k: Tensor, v: Tensor, plan: Tensor) -> bool:
        """The per-head write inside a ``torch.compile`` trace, in place (as :meth:`_write_traced`):
        each (row, head) at its flat index from the device plan ``[H, n]``. Layouts with the head
        dim before the token dim, or right after it; False otherwise."""
        d = self.dims
        seq, head = d.seq, d.head
        if not (head < seq or head == seq + 1):
            return False
        flats = self._flat_buffers()
        if flats is None:
            return False
        lead_shape = d.k_shape[:seq]
        lead, S, n, H = math.prod(lead_shape), self.keys.shape[d.seq + 1], plan.shape[-1], d.heads
        base = torch.arange(lead, device=plan.device) * S + layer * lead * S
        if head < seq:  # [..., H, ..., n]: one flat index per (leading coordinates, row)
            shape = [1] * (seq + 1)
            shape[head] = H
            shape[seq] = n
            idx = base.view(*lead_shape, 1) + plan.reshape(shape)
            for flat, x in zip(flats, (k, v)):
                flat.index_copy_(0, idx.reshape(-1), x.flatten(0, seq) if seq else x)
            return True
        # [..., n, H, ...]: a flat index per (leading coordinates, row, head), and the head
        idx = base.view(*lead_shape, 1, 1) + plan.transpose(0, 1)
        heads = torch.arange(H, device=plan.device)
        for flat, x in zip(flats, (k, v)):
            flat.index_put_((idx, heads), x)
        return True

    # ------------------------------------------------------------------ reads
    def segments(self, layer: int, positions: Tensor) -> list[Segment]:
        d = self.dims
        keys, values = (d.attention(t) for t in self._layer(layer))
        table = self.table
        if table is None or (table.identity and not torch.compiler.is_compiling()):
            if table is not None:  # an unforked paged cache: its rows are the first slots of the pool
                keys, values = keys.narrow(-2, 0, d.slots), values.narrow(-2, 0, d.slots)
            return [Segment(n=d.slots, positions=positions, keys=keys, values=values, features=d.features,
                            dtype=self.dtype)]
        host = None if torch.compiler.is_compiling() else tuple(table.host)
        return [Segment(n=d.slots, positions=positions, keys=keys, values=values, features=d.features,
                        dtype=self.dtype, pages=table.dev, page=table.page, host_pages=host)]

    def buffers(self) -> tuple[Tensor, Tensor]:
        return self.keys, self.values

    def stored(self, layer: int, which: str) -> Tensor:
        buf = self._layer(layer)[0 if which == "k" else 1]
        if self.table is None:
            return buf
        runs = self.row_ranges(0, self.dims.slots)
        if len(runs) == 1:
            return buf.narrow(self.dims.seq, runs[0][0], runs[0][1])
        return self.gather(layer, which, torch.arange(self.dims.slots, device=self.device))

    def gather(self, layer: int, which: str, slots: Tensor) -> Tensor:
        buf = self._layer(layer)[0 if which == "k" else 1]
        if self.table is not None:
            slots = self.rows_of(slots)
        return buf.index_select(self.dims.seq, slots)

    def head_view(self, which: str, layer: int | None = None) -> Tensor:
        d = self.dims
        if self.table is not None:
            return super().head_view(which, layer)
        buf = self.keys if which == "k" else self.values
        rest = [1 + i for i in range(d.rank - 1) if i not in (d.seq, d.head)]
        head = [1 + d.head] if d.head is not None else []
        x = buf.permute(0, *head, *rest, 1 + d.seq, d.rank)
        if d.head is None:
            x = x.unsqueeze(1)
        x = x.reshape(*x.shape[:2], -1, *x.shape[-2:])
        return x if layer is None else x[layer]

    def span(self, which: str, where: WritePlan, n: int) -> Tensor:
        d = self.dims
        if not where.per_head or d.head is None:
            return super().span(which, where, n)
        bufs = [self._layer(layer)[0 if which == "k" else 1] for layer in range(self.num_layers)]
        plans = [self.rows_of(where.plan[layer, :, :n]) if self.table is not None else where.plan[layer, :, :n]
                 for layer in range(self.num_layers)]
        heads = self._heads_idx[:n]
        rows = d.rows(bufs[0])
        out = torch.empty((self.num_layers, n, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
        for layer, (buf, slots) in enumerate(zip(bufs, plans)):  # [n, H, *rest, D] per layer, into out
            take_rows(d.rows(buf), slots.transpose(0, 1), heads, out[layer])
        # [L, n, H, *rest, D] -> [L, H, R, n, D]: a view
        return out.movedim(1, -2).reshape(self.num_layers, d.heads, -1, n, rows.shape[-1])

    # ------------------------------------------------------- slot maintenance
    def write_recall(self, layer: int, head: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        d = self.dims
        keys, values = self._layer_kv[layer]
        kd, vd = d.rows(keys), d.rows(values)
        slots = self.rows_of(slots)
        kd[slots, head] = k.reshape(len(slots), *kd.shape[2:])
        vd[slots, head] = v.reshape(len(slots), *vd.shape[2:])

    def clear_recall(self, layer: int, head: int, slots: Tensor) -> None:
        d = self.dims
        keys, values = self._layer_kv[layer]
        slots = self.rows_of(slots)
        d.rows(keys)[slots, head] = 0
        d.rows(values)[slots, head] = 0

    def shift(self, dst: int, src: int, n: int) -> None:
        seq = self.dims.seq + 1
        # every temporary first: an allocation failure (out of memory) leaves everything as it was
        moved = [torch.cat([buf.narrow(seq, a, m) for a, m in self.row_ranges(src, n)], seq)
                 for buf in (self.keys, self.values)]
        for buf, mv in zip((self.keys, self.values), moved):
            at = 0
            for a, m in self.row_ranges(dst, n):
                buf.narrow(seq, a, m).copy_(mv.narrow(seq, at, m))
                at += m

    def zero_(self) -> None:
        if self.table is None:
            self.keys.zero_()
            self.values.zero_()
            return
        seq = self.dims.seq + 1
        for buf in (self.keys, self.values):
            for a, m in self.row_ranges(0, self.dims.slots):
                buf.narrow(seq, a, m).zero_()

    def __repr__(self) -> str:
        return f"DenseStore({str(self.dtype).replace('torch.', '')}, bytes={self.nbytes})"
