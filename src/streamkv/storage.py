"""Storage: the K/V buffers of every layer, the position each slot holds, and the write plan.

One class holds the device state of every cache kind, with one meaning for every
attribute (``L`` layers, ``H`` heads, ``S = capacity + recall_slots`` slots, ``C`` chunk rows)::

    keys, values     [L, *k_shape] / [L, *v_shape]   k_shape[seq_dim] = S
    slot_positions   int64 [L, H, S]   the position held by slot s of head h in layer l (-1: empty)
    write_slots      int64 [L, H, C]   the slot that row i of the open span goes to (its n rows)

A *shared* plan (ring, chronological: every layer and head holds the same positions) keeps
``[1, 1, S]`` and ``[1, 1, C]`` tensors and exposes them broadcast (``expand``), so its
per-chunk metadata work is ``C`` entries, not ``L x H x C``. A *per-head* plan (budgeted
policies) keeps the full tensors. The slots ``[capacity, S)`` are recall slots (a storage
option): per (layer, head), filled by whoever recalls evicted tokens (:mod:`streamkv.certify`),
never by the policy.

Writes go through the device plan: one ``index_copy_`` along the token dimension for a
shared plan (through an int64 view of the same bytes in eager mode, where the rows split
into whole 8-byte words: on CPU ``index_copy_`` of 2-byte elements ran at 1.7x the time of
a plain ``copy_``), one ``index_put_`` of (slot, head) pairs for a per-head plan. Either is
safe under CUDA graph capture: a graph captured for one chunk writes the next chunk's slots
on replay. The chronological path instead writes a contiguous slice at a host-int offset
(``write_start``), as the current path does.

Nothing here decides which slots a chunk gets: that is a policy's job
(:mod:`streamkv.policies`). Nothing here is allocated after construction.

Why one module: every tensor a cache writes, and every way it is written or read per head,
has one owner here, so that the overlap checks (``owns``) and the fixed addresses hold for all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .validate import check_int

__all__ = ["KVStorage", "check_int", "normalise_dims", "position_bias", "position_mask"]


def position_bias(key_positions: Tensor, query_positions: Tensor | None = None,
                  dtype: torch.dtype = torch.float32, window: int | None = None) -> Tensor:
    """The additive mask of attention over slots holding ``key_positions [..., S]`` (``-1``:
    empty): ``-inf`` on empty slots and, given ``query_positions [Q]`` (causal attention), on
    keys at later positions than the query, and with ``window`` on keys at positions ``<= p -
    window`` (a sliding window of ``window`` positions, the query's own included). Shape
    ``[..., Q, S]`` (``Q = 1`` without queries).
    A function of positions, so it is exact in any physical order: the one mask builder of the
    project (reads, the chronological path, the certifier, the whole-history check)."""
    hidden = position_mask(key_positions, query_positions, window)
    return torch.zeros(hidden.shape, dtype=dtype, device=key_positions.device).masked_fill_(hidden, float("-inf"))


def position_mask(key_positions: Tensor, query_positions: Tensor | None = None, window: int | None = None) -> Tensor:
    """:func:`position_bias` as a bool mask (True hides): ``[..., Q, S]``."""
    k = key_positions.unsqueeze(-2)
    hidden = k < 0
    if query_positions is not None:
        qp = query_positions.reshape(-1, 1)
        hidden = hidden | (k > qp)
        if window is not None:
            hidden = hidden | (k <= qp - window)
    return hidden


def _shape(name: str, shape: object) -> tuple[int, ...]:
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"{name} must be a tuple of ints, got {type(shape).__name__} {shape!r}")
    out = tuple(check_int(f"{name}[{i}]", s) for i, s in enumerate(shape))
    if len(out) < 2:
        raise ValueError(f"{name} must have at least 2 dims (tokens and features), got {out}")
    if any(s < 1 for s in out):
        raise ValueError(f"{name} must have positive sizes, got {out}")
    return out


def normalise_dims(k_shape: tuple[int, ...], seq_dim: object, head_dim: object) -> tuple[int, int | None]:
    """``(seq, head)`` as non-negative indices of ``k_shape``; ``head`` None when the shape has
    no dimension besides tokens and features. The head dimension defaults to the last one
    that is neither the token nor the feature dimension."""
    rank = len(k_shape)
    seq_dim = check_int("seq_dim", seq_dim)
    if not -rank <= seq_dim < rank or seq_dim % rank == rank - 1:
        raise ValueError(
            f"seq_dim must index a non-feature dim of a rank-{rank} shape (in [{-rank}, {rank - 2}] and not "
            f"{rank - 1} or -1), got {seq_dim}"
        )
    seq = seq_dim % rank
    others = [d for d in range(rank - 1) if d != seq]
    if head_dim is None:
        return seq, (others[-1] if others else None)
    head_dim = check_int("head_dim", head_dim)
    if not -rank <= head_dim < rank or head_dim % rank not in others:
        raise ValueError(
            f"head_dim must index a dim of k_shape {k_shape} other than the token (seq_dim={seq}) and feature "
            f"({rank - 1}) dims, i.e. one of {others}, got {head_dim}"
        )
    return seq, head_dim % rank


def _int64_view(t: Tensor) -> Tensor | None:
    """``t`` reinterpreted as int64 along its last dim, or None when its elements are already
    8 bytes wide or the rows do not split into contiguous, 8-byte aligned whole words."""
    size = t.element_size()
    if size >= 8 or t.stride(-1) != 1 or (t.shape[-1] * size) % 8 or (t.storage_offset() * size) % 8:
        return None
    if any((st * size) % 8 for st in t.stride()[:-1]):
        return None
    return t.view(torch.long)


class KVStorage:
    """The device state of one cache (see the module docstring).

    Args:
        k_shape, v_shape: one layer's buffers; equal except (possibly) the last dim;
            ``k_shape[seq_dim] == capacity``. ``recall_slots`` more slots are added.
        seq_dim: the token (slot) dimension; not the last (feature) one.
        head_dim: the head dimension (default: the last dim that is neither tokens nor
            features; ``None`` when there is none: one virtual head).
        capacity: slots a policy manages (``sink + window``).
        chunk: rows written per chunk.
        num_layers: layers stored (buffers are ``[num_layers, *shape]``).
        recall_slots: extra slots per head at the end, for recalled tokens.
        per_head: heads may hold different positions (a per-head plan).
        dtype, device: of the K/V buffers.
        buffers: optional preallocated ``(K, V)`` of the full shapes to use instead of
            allocating (``CacheSet`` passes views of one allocation).
        quant: quantised storage (:class:`~streamkv.quant.KVQuant`, a format name or None):
            then ``codes`` (:class:`~streamkv.quant_store.QuantStore`) holds the K/V and
            ``keys``/``values`` are zero-stride placeholders of the full shapes (no memory:
            they carry shape, dtype and device; every read goes through ``codes``).
        sink: the layout's sinks (where ``quant`` keeps full-precision rows).
    """

    def __init__(
        self,
        k_shape: Sequence[int],
        v_shape: Sequence[int],
        *,
        seq_dim: int,
        head_dim: int | None,
        capacity: int,
        chunk: int,
        num_layers: int,
        recall_slots: int,
        per_head: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        buffers: tuple[Tensor, Tensor] | None = None,
        quant: object = None,
        sink: int = 0,
    ) -> None:
        from .quant import as_quant

        quant = as_quant(quant)
        if quant is not None and buffers is not None:
            raise ValueError("quantised storage allocates its own codes: buffers= cannot be given with quant=")
        k_shape, v_shape = _shape("k_shape", k_shape), _shape("v_shape", v_shape)
        if len(k_shape) != len(v_shape) or k_shape[:-1] != v_shape[:-1]:
            raise ValueError(f"k_shape and v_shape must agree except in the last dim, got {k_shape} and {v_shape}")
        seq, head = normalise_dims(k_shape, seq_dim, head_dim)
        if k_shape[seq] != capacity:
            raise ValueError(
                f"k_shape[seq_dim={seq}] must equal sink + window = {capacity}, got {k_shape[seq]} in {k_shape}"
            )
        num_layers = check_int("num_layers", num_layers, 1)
        recall_slots = check_int("recall_slots", recall_slots, 0)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device {device!r} is not a torch device: {exc}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {device} was asked for, but this torch build or machine has no CUDA device")

        self.k_shape, self.v_shape = k_shape, v_shape
        self.seq_dim, self.head_dim = seq, head
        self.heads = k_shape[head] if head is not None else 1
        self.capacity, self.recall_slots, self.slots = capacity, recall_slots, capacity + recall_slots
        self.chunk, self.num_layers, self.dtype = chunk, num_layers, dtype
        self.per_head = bool(per_head)
        full_k = (num_layers, *k_shape[:seq], self.slots, *k_shape[seq + 1 :])
        full_v = (num_layers, *v_shape[:seq], self.slots, *v_shape[seq + 1 :])
        if quant is not None:  # zero-stride placeholders: shape, dtype and device, no memory
            self.keys = torch.zeros((), dtype=dtype, device=device).expand(full_k)
            self.values = torch.zeros((), dtype=dtype, device=device).expand(full_v)
        elif buffers is None:
            self.keys = torch.zeros(full_k, dtype=dtype, device=device)
            self.values = torch.zeros(full_v, dtype=dtype, device=device)
        else:
            self.keys, self.values = self._check_buffers(buffers, full_k, full_v)
        self.device = self.keys.device
        L, H = num_layers, self.heads
        # positions per (layer, head, slot): one plan for all when shared (and no per-head recall)
        lp, hp = (L, H) if (self.per_head or recall_slots) else (1, 1)
        self.positions = torch.full((lp, hp, self.slots), -1, dtype=torch.long, device=self.device)
        wl, wh = (L, H) if self.per_head else (1, 1)
        self.plan = torch.arange(chunk, dtype=torch.long, device=self.device).repeat(wl, wh, 1)
        # host offset of a contiguous write (the chronological path; ``plan`` then holds the
        # same slots, for reading); None: writes follow ``plan``
        self.write_start: int | None = None
        self._chunk_k = k_shape[:seq] + (chunk,) + k_shape[seq + 1 :]
        self._chunk_v = v_shape[:seq] + (chunk,) + v_shape[seq + 1 :]
        # per-head writes see a layer as (token, head, other dims..., feature)
        rank = len(k_shape)
        rest = [d for d in range(rank - 1) if d not in (seq, head)]
        self._perm = [seq, *([head] if head is not None else []), *rest, rank - 1]
        self._heads_idx = torch.arange(H, device=self.device).expand(chunk, H)
        self._k_wide, self._v_wide = _int64_view(self.keys), _int64_view(self.values)
        # who fills the recall slots (one certifier at most; it claims them when attached)
        self.recall_owner: object | None = None
        self.codes = None
        dense = (self.keys, self.values)
        if quant is not None:
            from .quant_store import QuantStore

            self.codes = QuantStore(self, quant, check_int("sink", sink, 0))
            dense = tuple(self.codes.tensors().values())
        # the storages behind every tensor the cache writes: what ``owns`` compares against
        self._own = [t for t in (*dense, self.positions, self.plan) if t.device.type != "meta"]
        self._own_ptrs = {t.untyped_storage().data_ptr() for t in self._own}

    def _check_buffers(self, buffers: object, full_k: tuple[int, ...], full_v: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        if not (isinstance(buffers, (tuple, list)) and len(buffers) == 2):
            raise TypeError(f"buffers must be a (K, V) pair of tensors, got {type(buffers).__name__}")
        k, v = buffers
        for name, t, want in (("K", k, full_k), ("V", v, full_v)):
            if not isinstance(t, Tensor):
                raise TypeError(f"buffers {name} must be a Tensor, got {type(t).__name__}")
            if tuple(t.shape) != want:
                raise ValueError(f"buffers {name} must have shape {want}, got {tuple(t.shape)}")
            if t.dtype != self.dtype:
                raise TypeError(f"buffers {name} must have dtype {self.dtype}, got {t.dtype}")
            if t.layout != torch.strided:
                raise ValueError(f"buffers {name} must be a dense (strided) tensor, got layout {t.layout}")
            if t.requires_grad:
                raise ValueError(f"buffers {name} must not require grad (the cache writes into it in place)")
            if torch._debug_has_internal_overlap(t) != 0:
                raise ValueError(
                    f"buffers {name} has elements that share memory (an expanded or stride-0 view): every slot "
                    f"needs memory of its own"
                )
        if k.device != v.device:
            raise ValueError(f"buffers K and V must share a device, got {k.device} and {v.device}")
        if _overlap(k, v):
            raise ValueError("buffers K and V share memory: the cache needs two separate buffers")
        return k, v

    # ------------------------------------------------------------------ views
    @property
    def slot_positions(self) -> Tensor:
        """Device ``int64 [L, H, S]`` (``-1`` empty), broadcast from the shared plan where
        there is one. The storage's own tensor: do not mutate it."""
        return self.positions.expand(self.num_layers, self.heads, self.slots)

    @property
    def write_slots(self) -> Tensor:
        """Device ``int64 [L, H, chunk]``: the slot of each row of the open (or last) chunk."""
        return self.plan.expand(self.num_layers, self.heads, self.chunk)

    @property
    def head_axis(self) -> int | None:
        """Index of the head dim among the leading dims of a layer moved to ``[..., T, D]``
        (the token dim moved next to the features); None without a head dim."""
        if self.head_dim is None:
            return None
        return [d for d in range(len(self.k_shape) - 1) if d != self.seq_dim].index(self.head_dim)

    def bias(self, positions: Tensor, dtype: torch.dtype, query_positions: Tensor | None = None,
             window: int | None = None) -> Tensor:
        """Additive attention bias from per-head slot ``positions [H, S]`` (``-inf`` where ``< 0``
        and, given ``query_positions [Q]``, where a key is at a later position than the query:
        :func:`position_bias`), shaped to broadcast against scores ``[..., Q, S]`` of a layer
        moved to ``[..., T, D]`` (:meth:`lay_out_bias`).
        """
        return self.lay_out_bias(position_bias(positions, query_positions, dtype, window))

    def lay_out_bias(self, bias: Tensor) -> Tensor:
        """A per-head bias ``[H, Q, S]`` shaped to broadcast against scores ``[..., Q, S]`` of a
        layer moved to ``[..., T, D]``: ``H`` at :attr:`head_axis`, ones elsewhere."""
        shape = [1] * (len(self.k_shape) - 2) + list(bias.shape[-2:])
        if self.head_axis is None:
            return bias[:1].view(shape)
        shape[self.head_axis] = bias.shape[0]
        return bias.view(shape)

    def layer_positions(self, layer: int) -> Tensor:
        """``int64 [H, S]``: the positions of ``layer``'s slots per head (a view)."""
        return self.positions[layer if self.positions.shape[0] > 1 else 0].expand(self.heads, self.slots)

    def chunk_shape(self, which: str) -> tuple[int, ...]:
        """Shape of one chunk's ``"k"`` or ``"v"`` (``chunk`` at ``seq_dim``)."""
        return self._chunk_k if which == "k" else self._chunk_v

    def head_view(self, which: str, layer: int | None = None) -> Tensor:
        """The ``"k"`` or ``"v"`` buffer per head: ``[L, H, R, S, D]`` (``[H, R, S, D]`` for one
        ``layer``), ``R`` the product of the other leading dims (e.g. the batch), ``H = 1``
        without a head dim. A view where the layout allows (a copy otherwise): read it, never
        write through it. Every per-head consumer (key-scored policies, the certifier) goes
        through here, so none of them knows the layout."""
        if self.codes is not None:  # quantised storage: the stored values, dequantised (a copy)
            layers = range(self.num_layers) if layer is None else [layer]
            x = torch.stack([self.to_heads(self.codes.dense(i, which)) for i in layers])
            return x if layer is None else x[0]
        buf = self.keys if which == "k" else self.values
        rank = len(self.k_shape)
        rest = [1 + d for d in range(rank - 1) if d not in (self.seq_dim, self.head_dim)]
        head = [1 + self.head_dim] if self.head_dim is not None else []
        x = buf.permute(0, *head, *rest, 1 + self.seq_dim, rank)
        if self.head_dim is None:
            x = x.unsqueeze(1)
        x = x.reshape(*x.shape[:2], -1, *x.shape[-2:])
        return x if layer is None else x[layer]

    def to_heads(self, x: Tensor) -> Tensor:
        """A tensor in the layout of one layer's rows (``k_shape`` with any token count and,
        for queries, a multiple of the heads) as ``[H, R, T, D]``, as :meth:`head_view` lays
        out the buffers (a view where the layout allows)."""
        rank = len(self.k_shape)
        rest = [d for d in range(rank - 1) if d not in (self.seq_dim, self.head_dim)]
        head = [self.head_dim] if self.head_dim is not None else []
        x = x.permute(*head, *rest, self.seq_dim, rank - 1)
        if self.head_dim is None:
            x = x.unsqueeze(0)
        return x.reshape(x.shape[0], -1, *x.shape[-2:])

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V buffers (every layer, recall slots included); quantised storage:
        its codes, scales and full-precision rows."""
        if self.codes is not None:
            return self.codes.nbytes
        return self.keys.nbytes + self.values.nbytes

    def owns(self, t: Tensor) -> bool:
        """``t`` shares memory with the K/V buffers or the slot metadata."""
        if t.layout != torch.strided or t.device.type == "meta" or t.untyped_storage().data_ptr() not in self._own_ptrs:
            return False
        return any(_overlap(t, b) for b in self._own)

    # ----------------------------------------------------------------- writes
    #: the open span's slots as host ``(first slot, rows)`` ranges in row order, when the policy
    #: knows them without reading the device (the ring sets them at each begin: one range, or
    #: two where the span wraps); they are the slots ``plan`` holds. Eager writes then copy
    #: slices there (the floor's ``narrow(...).copy_``); a traced (``torch.compile``) or captured
    #: (CUDA graph) write never reads them and follows ``plan``, so that it writes the slots of
    #: whichever chunk is open when it runs. None: every write follows ``plan``.
    eager_ranges: tuple[tuple[int, int], ...] | None = None
    #: False: eager writes follow ``plan`` as well (the index path; tests and benchmarks compare)
    eager_slices: bool = True
    #: a span that wraps is written as two slices from this many bytes per tensor on, below it
    #: through the index path: measured on CPU (``streamkv bench`` shapes, 2 threads), two slices
    #: took 2.7 ms against 12.6 ms for a wrapping Self-Forcing chunk (28.8 MB), and 47 us against
    #: 38 us for the tiny DiT's 8 kB (four more dispatched ops than one indexed write per tensor)
    wrap_slices_min_bytes: int = 1 << 16

    def write(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Copy one layer's rows of the open span (``n <= chunk`` rows at ``seq_dim``) into the
        first ``n`` planned slots (inputs already checked)."""
        n = k.shape[self.seq_dim]
        if self.codes is not None:
            self.codes.write(layer, k, v)
        elif self.write_start is not None:
            start = self.write_start
            self.keys[layer].narrow(self.seq_dim, start, n).copy_(k)
            self.values[layer].narrow(self.seq_dim, start, n).copy_(v)
        elif self._host_ranges(n, k) is not None:
            self._write_ranges(layer, k, v, self.eager_ranges)
        elif not self.per_head or self.head_dim is None:
            slots = self.plan[layer if self.per_head else 0, 0]
            if n != self.chunk:
                slots = slots[:n]
            if torch.compiler.is_compiling() and self._write_traced(layer, k, v, slots):
                return
            # the int64 view helps the eager CPU kernel; a compiled step generates its own
            # kernel (and cannot inspect a traced tensor's storage offset)
            eager = not torch.compiler.is_compiling()
            for buf, wide, x in ((self.keys, self._k_wide, k), (self.values, self._v_wide, v)):
                x_wide = _int64_view(x) if eager and wide is not None else None
                if x_wide is not None:
                    wide[layer].index_copy_(self.seq_dim, slots, x_wide)
                else:
                    buf[layer].index_copy_(self.seq_dim, slots, x)
        else:
            plan = self.plan[layer] if n == self.chunk else self.plan[layer, :, :n]
            if torch.compiler.is_compiling() and self._write_traced_per_head(layer, k, v, plan):
                return
            idx = (plan.transpose(0, 1), self._heads_idx[:n])  # [n, H] each
            self.keys[layer].permute(self._perm).index_put_(idx, k.permute(self._perm))
            self.values[layer].permute(self._perm).index_put_(idx, v.permute(self._perm))

    def enable_eager_ranges(self) -> None:
        """For a policy that sets ``eager_ranges`` (the ring, at bind): none yet, and each layer's
        K and V views kept once, so that an eager write is one ``narrow`` and one ``copy_`` per
        range and tensor (a ``select`` per call was a third of the tiny DiT's write)."""
        self.eager_ranges = None
        self._layer_kv = tuple((self.keys[i], self.values[i]) for i in range(self.num_layers))

    def _host_ranges(self, n: int, k: Tensor) -> tuple[tuple[int, int], ...] | None:
        """``eager_ranges`` when this write may use them: eager (not traced by ``torch.compile``,
        not captured into a CUDA graph), enabled, covering exactly the ``n`` rows, and one range
        or a span of at least ``wrap_slices_min_bytes``."""
        if torch.compiler.is_compiling():
            return None  # checked first: a traced step must not read (and guard on) a host offset
        ranges = self.eager_ranges
        if ranges is None or not self.eager_slices:
            return None
        if self.keys.is_cuda and torch.cuda.is_current_stream_capturing():
            return None  # a graph replays later chunks: it must read their slots from ``plan``
        if len(ranges) == 1:
            return ranges if ranges[0][1] == n else None
        if k.numel() * k.element_size() < self.wrap_slices_min_bytes:
            return None
        return ranges if sum(m for _, m in ranges) == n else None

    def _write_ranges(self, layer: int, k: Tensor, v: Tensor, ranges: tuple[tuple[int, int], ...]) -> None:
        """The eager write at host offsets: one ``narrow(...).copy_`` per range and tensor."""
        seq = self.seq_dim
        views = self.__dict__.get("_layer_kv")
        keys, values = views[layer] if views is not None else (self.keys[layer], self.values[layer])
        if len(ranges) == 1:
            a, n = ranges[0]
            keys.narrow(seq, a, n).copy_(k)
            values.narrow(seq, a, n).copy_(v)
            return
        at = 0
        for a, m in ranges:
            keys.narrow(seq, a, m).copy_(k.narrow(seq, at, m))
            values.narrow(seq, a, m).copy_(v.narrow(seq, at, m))
            at += m

    def _write_traced(self, layer: int, k: Tensor, v: Tensor, slots: Tensor) -> bool:
        """The shared-plan write inside a ``torch.compile`` trace: ``index_copy_`` into each buffer
        flattened through its token dimension (a view), at ``(layer, leading index) * S + slot``
        from the device plan. Inductor writes that in place; through a ``select`` of the layer it
        copied the whole layer buffer into a temporary per call (measured on CPU). False (the
        caller writes through the layer's view) when a buffer's leading dims do not flatten
        into a view."""
        seq = self.seq_dim + 1  # the token dim of the [L, *shape] buffers
        flats = self._flat_buffers()
        if flats is None:
            return False
        lead, S = math.prod(self.k_shape[: self.seq_dim]), self.slots
        idx = slots if lead == 1 else (torch.arange(lead, device=slots.device)[:, None] * S + slots).reshape(-1)
        idx = idx + layer * lead * S
        for flat, x in zip(flats, (k, v)):
            flat.index_copy_(0, idx, x.flatten(0, seq - 1) if seq > 1 else x)
        return True

    def _flat_buffers(self) -> list[Tensor] | None:
        """K and V flattened through the token dim (views), or None where that is not a view."""
        seq = self.seq_dim + 1
        flats = []
        for buf in (self.keys, self.values):
            shape, stride = buf.shape, buf.stride()
            if any(stride[d] != stride[d + 1] * shape[d + 1] for d in range(seq)):
                return None
            flats.append(buf.flatten(0, seq))
        return flats

    def _write_traced_per_head(self, layer: int, k: Tensor, v: Tensor, plan: Tensor) -> bool:
        """The per-head write inside a ``torch.compile`` trace, in place (as :meth:`_write_traced`):
        into the buffers flattened through the token dim, each (row, head) at its flat index from
        the device plan ``[H, n]``. Layouts with the head dim before the token dim, or right after
        it; False (the caller writes through the layer's view) otherwise."""
        seq, head = self.seq_dim, self.head_dim
        if not (head < seq or head == seq + 1):
            return False
        flats = self._flat_buffers()
        if flats is None:
            return False
        lead_shape = self.k_shape[:seq]
        lead, S, n, H = math.prod(lead_shape), self.slots, plan.shape[-1], self.heads
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

    def shift(self, dst: int, src: int, n: int) -> None:
        """Move slots ``[src, src + n)`` to ``[dst, dst + n)`` in every layer, positions too
        (the current path's roll: clone, then copy back shifted)."""
        seq = self.seq_dim + 1  # buffers carry the layer dim first
        bufs = (self.keys, self.values, self.positions)
        dims = (seq, seq, self.positions.dim() - 1)
        if self.codes is not None:
            self.codes.shift(dst, src, n)
            bufs, dims = bufs[2:], dims[2:]
        # every temporary first: an allocation failure (out of memory) leaves everything as it was
        moved = [buf.narrow(d, src, n).clone() for buf, d in zip(bufs, dims)]
        for buf, d, m in zip(bufs, dims, moved):
            buf.narrow(d, dst, n).copy_(m)

    def gather(self, layer: int, which: str, slots: Tensor) -> Tensor:
        """``layer``'s ``"k"`` / ``"v"`` rows at ``slots`` (a copy, token dim at ``seq_dim``)."""
        if self.codes is not None:
            return self.codes.gather(layer, which, slots)
        buf = self.keys[layer] if which == "k" else self.values[layer]
        return buf.index_select(self.seq_dim, slots)

    # ----------------------------------------------------------- recall slots
    def write_recall(self, layer: int, head: int, slots: list[int], k: Tensor, v: Tensor, positions: Tensor) -> None:
        """Put ``n`` recalled tokens of one head in recall slots ``slots`` (``n`` indices counted
        from the first recall slot): ``k``/``v`` ``[n, R, D]`` (``R`` as in :meth:`head_view`),
        ``positions [n]``. Only the recall owner (``recall_owner``, one certifier) calls it."""
        if self.head_dim is None or len(slots) != positions.numel() or any(
                not 0 <= s < self.recall_slots for s in slots):
            raise ValueError(f"recall slots {slots} outside [0, {self.recall_slots}), or no head dim")
        idx = torch.tensor(slots, dtype=torch.long, device=self.device) + self.capacity
        if self.codes is not None:
            self.codes.write_recall(layer, head, idx, k, v)
        else:
            kd, vd = self.keys[layer].permute(self._perm), self.values[layer].permute(self._perm)
            kd[idx, head] = k.reshape(len(slots), *kd.shape[2:])
            vd[idx, head] = v.reshape(len(slots), *vd.shape[2:])
        self.positions[layer, head, idx] = positions

    def clear_recall(self, layer: int, head: int, slots: list[int]) -> None:
        """Empty recall ``slots`` of one head (positions -1, K/V zeroed)."""
        idx = torch.tensor(slots, dtype=torch.long, device=self.device) + self.capacity
        if self.codes is not None:
            self.codes.clear_recall(layer, head, idx)
        else:
            self.keys[layer].permute(self._perm)[idx, head] = 0
            self.values[layer].permute(self._perm)[idx, head] = 0
        self.positions[layer, head, idx] = -1

    def zero_(self) -> None:
        """Forget everything: K/V zeroed (no stale value can reach an output), slots empty."""
        if self.codes is not None:
            self.codes.zero_()
        else:
            self.keys.zero_()
            self.values.zero_()
        self.positions.fill_(-1)

    def __repr__(self) -> str:
        return (
            f"KVStorage(k_shape={self.k_shape}, v_shape={self.v_shape}, seq_dim={self.seq_dim}, "
            f"head_dim={self.head_dim}, capacity={self.capacity}, recall_slots={self.recall_slots}, "
            f"num_layers={self.num_layers}, per_head={self.per_head}, dtype={self.dtype}, device={self.device}"
            + (f", codes={self.codes!r})" if self.codes is not None else ")")
        )


def _overlap(a: Tensor, b: Tensor) -> bool:
    """``a`` and ``b`` touch a common byte of memory (conservative: by storage extent)."""
    if a.device != b.device or a.layout != torch.strided or b.layout != torch.strided:
        return False
    if a.device.type == "meta" or a.numel() == 0 or b.numel() == 0:
        return False
    sa, sb = a.untyped_storage(), b.untyped_storage()
    if sa.data_ptr() != sb.data_ptr():
        return False
    return _extent(a)[0] < _extent(b)[1] and _extent(b)[0] < _extent(a)[1]


def _extent(t: Tensor) -> tuple[int, int]:
    """The byte range ``[lo, hi)`` of ``t`` inside its storage."""
    size = t.element_size()
    lo = t.storage_offset() * size
    span = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return lo, lo + (span + 1) * size
