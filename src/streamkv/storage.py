"""Storage: the slot metadata of a cache (the position each slot holds, the write plan) and the
:class:`~streamkv.stores.Store` that holds its K/V.

One class holds the metadata of every cache kind, with one meaning for every attribute
(``L`` layers, ``H`` heads, ``S = capacity + recall_slots`` slots, ``C`` chunk rows)::

    slot_positions   int64 [L, H, S]   the position held by slot s of head h in layer l (-1: empty)
    write_slots      int64 [L, H, C]   the slot that row i of the open span goes to (its n rows)

A *shared* plan (ring, chronological: every layer and head holds the same positions) keeps
``[1, 1, S]`` and ``[1, 1, C]`` tensors and exposes them broadcast (``expand``), so its
per-chunk metadata work is ``C`` entries, not ``L x H x C``. A *per-head* plan (budgeted
policies) keeps the full tensors. The slots ``[capacity, S)`` are recall slots (a storage
option): per (layer, head), filled by whoever recalls evicted tokens (:mod:`streamkv.certify`),
never by the policy.

The K/V live in the store (:mod:`streamkv.stores`: dense buffers, or quantised codes); the
storage hands it the plan (:class:`~streamkv.stores.WritePlan`) and the positions, and asks it
for segments to read. Nothing here decides which slots a chunk gets: that is a policy's job
(:mod:`streamkv.policies`). Nothing here is allocated after construction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .masks import position_bias, position_mask, position_masks
from .stores import Dims, Segment, Store, WritePlan, make_store
from .stores.dims import check_shape, normalise_dims
from .validate import check_device, check_int

__all__ = ["KVStorage", "check_int", "normalise_dims", "position_bias", "position_mask", "position_masks"]


#: the dtypes a cache holds and attends in
_ATTENDED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

class KVStorage:
    """The slot metadata and the K/V store of one cache (see the module docstring).

    Args:
        k_shape, v_shape: one layer's buffers; equal except (possibly) the last dim;
            ``k_shape[seq_dim] == capacity``. ``recall_slots`` more slots are added.
        seq_dim: the token (slot) dimension; not the last (feature) one.
        head_dim: the head dimension (default: the last dim that is neither tokens nor
            features; ``None`` when there is none: one virtual head).
        capacity: slots a policy manages (``sink + window``).
        chunk: rows written per chunk.
        num_layers: layers stored.
        recall_slots: extra slots per head at the end, for recalled tokens.
        per_head: heads may hold different positions (a per-head plan).
        dtype, device: of the K/V.
        buffers: optional preallocated dense ``(K, V)`` of the full shapes ``[num_layers, *shape]``
            (``CacheSet`` passes views of one allocation).
        quant: quantised storage (:class:`~streamkv.quant.KVQuant`, a format name or None).
        sink: the layout's sinks (where ``quant`` keeps full-precision rows).
        pages: the rows in pages shared copy-on-write with forks (:class:`~streamkv.stores.PageOptions`,
            ``True`` or None).
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
        pages: object = None,
    ) -> None:
        k_shape, v_shape = check_shape("k_shape", k_shape), check_shape("v_shape", v_shape)
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
        if dtype not in _ATTENDED:  # float8: no attention kernel computes in it
            raise ValueError(f"dtype must be one of {', '.join(map(str, _ATTENDED))} (what attention computes in), got "
                             f"{dtype}; store narrower K/V with quant=, e.g. quant='fp8'")
        device = check_device(device)

        slots = capacity + recall_slots
        self.dims = dims = Dims(k_shape, v_shape, seq, head, slots, chunk)
        self.k_shape, self.v_shape = k_shape, v_shape
        self.seq_dim, self.head_dim = seq, head
        self.heads = dims.heads
        self.capacity, self.recall_slots, self.slots = capacity, recall_slots, slots
        self.chunk, self.num_layers, self.dtype = chunk, num_layers, dtype
        self.per_head = bool(per_head)
        if buffers is not None:
            full = ((num_layers, *dims.shape("k", slots)), (num_layers, *dims.shape("v", slots)))
            buffers = self._check_buffers(buffers, *full)
            device = buffers[0].device
        self.device = device
        self.store: Store = make_store(dims, quant=quant, num_layers=num_layers, dtype=dtype, device=device,
                                       sink=check_int("sink", sink, 0), capacity=capacity, per_head=self.per_head,
                                       buffers=buffers, pages=pages)
        L, H = num_layers, self.heads
        # positions per (layer, head, slot): one plan for all when shared (and no per-head recall)
        lp, hp = (L, H) if (self.per_head or recall_slots) else (1, 1)
        self.positions = torch.full((lp, hp, slots), -1, dtype=torch.long, device=device)
        wl, wh = (L, H) if self.per_head else (1, 1)
        self.plan = torch.arange(chunk, dtype=torch.long, device=device).repeat(wl, wh, 1)
        #: where the open span's rows go (the policy sets ``start`` / ``ranges``; see WritePlan)
        self.where = WritePlan(self.plan, self.per_head)
        # who fills the recall slots (one certifier at most; it claims them when attached)
        self.recall_owner: object | None = None
        # the storages behind every tensor the cache writes: what ``owns`` compares against
        self._own = [t for t in (*self.store.tensors().values(), self.positions, self.plan) if t.device.type != "meta"]
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
            overlap = _self_overlap(t)
            if overlap:
                raise ValueError(f"buffers {name} {overlap}: every slot needs memory of its own")
        if k.device != v.device:
            raise ValueError(f"buffers K and V must share a device, got {k.device} and {v.device}")
        if _overlap(k, v):
            raise ValueError("buffers K and V share memory: the cache needs two separate buffers")
        return k, v

    # ------------------------------------------------------------------ views
    @property
    def keys(self) -> Tensor:
        """The dense key buffers ``[L, *k_shape]`` (a store that holds codes has none: refused)."""
        return self._dense("keys")

    @property
    def values(self) -> Tensor:
        """The dense value buffers ``[L, *v_shape]`` (refused for a store that holds codes)."""
        return self._dense("values")

    def _dense(self, name: str) -> Tensor:
        bufs = self.store.buffers()
        if bufs is None:
            raise AttributeError(f"this cache stores its K/V as {self.store!r}: there are no dense {name} buffers; "
                                 f"read through attend() / read.segments(), or cache.keys() for a dequantised copy")
        return bufs[0 if name == "keys" else 1]

    def full_shape(self, which: str) -> tuple[int, ...]:
        """``[L, *shape]`` of every layer's ``"k"`` / ``"v"`` with the slots at the token dim."""
        return (self.num_layers, *self.dims.shape(which, self.slots))

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
    def write_start(self) -> int | None:
        """Host slot of a contiguous write (the chronological path), or None: writes follow the plan."""
        return self.where.start

    @write_start.setter
    def write_start(self, value: int | None) -> None:
        self.where.start = value

    @property
    def eager_ranges(self) -> tuple[tuple[int, int], ...] | None:
        """The open span's slots as host ``(first slot, rows)`` ranges, when the policy knows them
        without reading the device (the ring); eager writes may copy slices there."""
        return self.where.ranges

    @eager_ranges.setter
    def eager_ranges(self, value: tuple[tuple[int, int], ...] | None) -> None:
        self.where.ranges = value

    @property
    def head_axis(self) -> int | None:
        """Index of the head dim among the leading dims of a layer moved to ``[..., T, D]``."""
        return self.dims.head_axis

    def bias(self, positions: Tensor, dtype: torch.dtype, query_positions: Tensor | None = None,
             window: int | None = None) -> Tensor:
        """Additive attention bias from per-head slot ``positions [H, S]`` (:func:`position_bias`),
        shaped to broadcast against scores ``[..., Q, S]`` of a layer in the attention layout."""
        return self.dims.lay_out_heads(position_bias(positions, query_positions, dtype, window))

    def layer_positions(self, layer: int) -> Tensor:
        """``int64 [H, S]``: the positions of ``layer``'s slots per head (a view)."""
        return self.positions[layer if self.positions.shape[0] > 1 else 0].expand(self.heads, self.slots)

    def chunk_shape(self, which: str) -> tuple[int, ...]:
        """Shape of one chunk's ``"k"`` or ``"v"`` (``chunk`` at ``seq_dim``)."""
        return self.dims.shape(which, self.chunk)

    def head_view(self, which: str, layer: int | None = None) -> Tensor:
        """The stored ``"k"`` or ``"v"`` per head: ``[L, H, R, S, D]`` (``[H, R, S, D]`` for one
        ``layer``), ``R`` the product of the other leading dims (e.g. the batch), ``H = 1``
        without a head dim; the values attention uses (codes decoded: a copy). Read it, never
        write through it. Every per-head consumer (key-scored policies, the certifier) goes
        through here, so none of them knows the layout or the store."""
        return self.store.head_view(which, layer)

    def span(self, which: str, n: int) -> Tensor:
        """The open span's first ``n`` ``"k"``/``"v"`` rows as written, per head: ``[L, H, R, n, D]``."""
        return self.store.span(which, self.where, n)

    def to_heads(self, x: Tensor) -> Tensor:
        """A tensor in the layout of one layer's rows (any token count; queries may have a
        multiple of the heads) as ``[H, R, T, D]``."""
        return self.dims.to_heads(x)

    def segments(self, layer: int) -> list[Segment]:
        """What a read of ``layer`` attends (:class:`~streamkv.stores.Segment` s)."""
        return self.store.segments(layer, self.layer_positions(layer))

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V (every layer, recall slots included; a quantised store: its codes,
        scales and full-precision rows)."""
        return self.store.nbytes

    def owns(self, t: Tensor) -> bool:
        """``t`` shares memory with the K/V or the slot metadata."""
        if t.layout != torch.strided or t.device.type == "meta" or t.untyped_storage().data_ptr() not in self._own_ptrs:
            return False
        return any(_overlap(t, b) for b in self._own)

    def fork(self) -> KVStorage:
        """A branch's storage: the store's pages shared (copy on write), the slot metadata copied."""
        out = object.__new__(KVStorage)
        out.__dict__.update(self.__dict__)
        out.store = self.store.fork()
        out.positions, out.plan = self.positions.clone(), self.plan.clone()
        out.where = WritePlan(out.plan, self.per_head, self.where.start, self.where.ranges)
        out.recall_owner = None
        out._own = [t for t in (*out.store.tensors().values(), out.positions, out.plan) if t.device.type != "meta"]
        out._own_ptrs = {t.untyped_storage().data_ptr() for t in out._own}
        return out

    # ----------------------------------------------------------------- writes
    def write(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Copy one layer's rows of the open span (``n <= chunk`` rows at ``seq_dim``) into the
        first ``n`` planned slots (inputs already checked)."""
        self.store.write(layer, k, v, self.where)

    def begin(self, start: int, n: int, advance: bool = True) -> None:
        """The span is open and the policy's plan applied: the store's own begin work (``advance``
        False: the last span, reopened after its commit)."""
        self.store.begin(start, n, self.where)
        if not advance:
            self.store.reopen(start, self.positions)

    def commit(self, start: int, n: int) -> None:
        """The span becomes history: the store's own commit work (before the eviction applies)."""
        self.store.commit(start, n, self.where)

    def shift(self, dst: int, src: int, n: int) -> None:
        """Move slots ``[src, src + n)`` to ``[dst, dst + n)`` in every layer, positions too
        (the current path's roll: clone, then copy back shifted)."""
        d = self.positions.dim() - 1
        moved = self.positions.narrow(d, src, n).clone()  # every temporary first (an allocation may fail)
        self.store.shift(dst, src, n)
        self.positions.narrow(d, dst, n).copy_(moved)

    def gather(self, layer: int, which: str, slots: Tensor) -> Tensor:
        """``layer``'s ``"k"`` / ``"v"`` rows at ``slots`` as stored (a copy, token dim at ``seq_dim``)."""
        return self.store.gather(layer, which, slots)

    # ----------------------------------------------------------- recall slots
    def write_recall(self, layer: int, head: int, slots: list[int], k: Tensor, v: Tensor, positions: Tensor) -> None:
        """Put ``n`` recalled tokens of one head in recall slots ``slots`` (``n`` indices counted
        from the first recall slot): ``k``/``v`` ``[n, R, D]`` (``R`` as in :meth:`head_view`),
        ``positions [n]``. Only the recall owner (``recall_owner``, one certifier) calls it."""
        if self.head_dim is None or len(slots) != positions.numel() or any(
                not 0 <= s < self.recall_slots for s in slots):
            raise ValueError(f"recall slots {slots} outside [0, {self.recall_slots}), or no head dim")
        idx = torch.tensor(slots, dtype=torch.long, device=self.device) + self.capacity
        self.own_recall_pages("a recall write")
        self.store.write_recall(layer, head, idx, k, v)
        self.positions[layer, head, idx] = positions

    def own_recall_pages(self, why: str) -> None:
        """Copy on write for the recall slots: the pages holding them that another cache of a paged
        family (a branch, a kept boundary) also references become this store's own, before anything
        is written there (a recall must never change what another branch holds). The recall owner
        claims them at attach (:func:`~streamkv.certify.certifier.claim_unevicted`), so later writes find
        them private unless a boundary was kept since. Raises ``RuntimeError`` (nothing changes) when
        the page pool lacks free pages; a no-op unpaged or when nothing is shared."""
        if self.recall_slots:
            own = self.store.prepare_writes([(self.capacity, self.recall_slots)], why)
            if own is not None:
                own()

    def clear_recall(self, layer: int, head: int, slots: list[int]) -> None:
        """Empty recall ``slots`` of one head (positions -1, K/V zeroed)."""
        idx = torch.tensor(slots, dtype=torch.long, device=self.device) + self.capacity
        self.own_recall_pages("a recall clear")
        self.store.clear_recall(layer, head, idx)
        self.positions[layer, head, idx] = -1

    def zero_(self) -> None:
        """Forget everything: K/V zeroed (no stale value can reach an output), slots empty."""
        self.store.zero_()
        self.positions.fill_(-1)

    def __repr__(self) -> str:
        return (
            f"KVStorage(k_shape={self.k_shape}, v_shape={self.v_shape}, seq_dim={self.seq_dim}, "
            f"head_dim={self.head_dim}, capacity={self.capacity}, recall_slots={self.recall_slots}, "
            f"num_layers={self.num_layers}, per_head={self.per_head}, dtype={self.dtype}, device={self.device}, "
            f"store={self.store!r})"
        )


def _self_overlap(t: Tensor) -> str | None:
    """Why two elements of ``t`` may share memory, or None. torch answers where it can tell; where
    it cannot (a strided slice, a padded view), the dims by increasing stride each stepping past
    everything the smaller ones span is proof enough that they do not."""
    told = torch._debug_has_internal_overlap(t)
    if told == 1:
        return "has elements that share memory (an expanded or stride-0 view)"
    if told == 0:
        return None
    reach = 0  # the largest offset the dims so far span
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride <= reach:
            return (f"may have elements that share memory: its strides {tuple(t.stride())} over shape "
                    f"{tuple(t.shape)} do not each step past the smaller ones (a dense or sliced buffer does)")
        reach += (size - 1) * stride
    return None


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
