"""The chunk lifecycle and the storage every cache shares.

A cache holds the K/V of ``num_layers`` attention layers (one allocation for all of
them) and walks the stream chunk by chunk::

    cache.begin_chunk(c)            # host: reserve the chunk's slots (advance or repeat)
    for step in denoising_steps:    # device: every step rewrites the same slots
        cache.write(k, v, layer=i)  #   (one call per layer; graph-capturable)
        attend(q, cache.layer(i))
    cache.write(k_clean, v_clean)   # the clean pass at t=0 writes the final K/V
    cache.commit_chunk(c)           # host: the chunk becomes history

``begin_chunk(c)`` accepts the next chunk (``c == next_chunk``: advance, which may
evict) or the last one again (``c == next_chunk - 1``: reuse its slots, as
flashdreams' ``before_update`` does). Nothing else.

Rejected calls raise ``TypeError`` / ``ValueError`` / ``RuntimeError`` naming the
constraint and the value, and leave the cache exactly as it was: every check runs
before the first mutation.

Graph safety: ``write`` reads its destination slots from device tensors that
``begin_chunk`` prepares, never from Python ints, and mutates no host state, so a
captured CUDA graph or a compiled step replayed for a later chunk writes that
chunk's slots. ``begin_chunk`` / ``commit_chunk`` / ``reset`` are host-side plans:
call them outside any captured region. None of them synchronises with the device.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..layout import CacheLayout

__all__ = ["KVCache", "LayerView", "EvictionEvent"]


@dataclass(frozen=True)
class EvictionEvent:
    """Tokens about to leave a cache, announced before their slots change.

    ``evicted`` is a device ``bool`` mask over slots: ``[capacity]`` when every head of
    ``layers`` loses the same slots (ring, chronological), ``[heads, capacity]`` when heads
    differ (per-head budgets). At the time of the call, ``cache.keys(layer)``,
    ``cache.values(layer)`` and ``cache.layer_slot_positions(layer)`` still hold the evicted
    tokens. Listeners must not mutate the cache; they may copy from it (device ops, no
    sync needed).
    """

    cache: "KVCache"
    chunk_idx: int  # the chunk whose reservation (or commit) evicts
    layers: tuple[int, ...]
    evicted: Tensor


def _shape_tuple(name: str, shape: object) -> tuple[int, ...]:
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(s, int) and not isinstance(s, bool) for s in shape
    ):
        raise TypeError(f"{name} must be a tuple of ints, got {shape!r}")
    if len(shape) < 2:
        raise ValueError(f"{name} must have at least 2 dims (sequence and feature), got {tuple(shape)}")
    if any(s < 1 for s in shape):
        raise ValueError(f"{name} must have positive sizes, got {tuple(shape)}")
    return tuple(shape)


def _index(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


class KVCache(abc.ABC):
    """Base class: K/V storage for ``num_layers`` layers plus the chunk lifecycle.

    Args:
        k_shape: shape of one layer's key buffer, e.g. ``(B, capacity, H, Dk)`` or
            ``(B, H, capacity, Dk)``; ``k_shape[seq_dim]`` must equal
            ``sink + window``.
        v_shape: shape of one layer's value buffer; equal to ``k_shape`` except
            (possibly) the last dimension.
        seq_dim: the token (slot) dimension of ``k_shape``; may be negative; must not
            be the last (feature) dimension.
        sink, window, chunk: sizes in tokens, see :class:`~streamkv.layout.CacheLayout`.
        num_layers: layers stored in this cache; buffers are
            ``[num_layers, *k_shape]``.
        dtype, device: of the K/V buffers.
        buffers: optional preallocated ``(K, V)`` of shape ``[num_layers, *k_shape]``
            and ``[num_layers, *v_shape]`` to use instead of allocating (``CacheSet``
            passes views of one allocation).

    Buffers are allocated once; their ``data_ptr()`` never changes (``reset`` and
    ``load_state_dict`` copy in place).
    """

    #: Attention may read the buffer in physical order (no gather), provided the
    #: keys carry their own absolute RoPE and the attention is unmasked.
    physical_order_valid: ClassVar[bool] = False
    #: The occupied slots are always ``[0, num_valid)``.
    valid_is_prefix: ClassVar[bool] = True
    #: ``write`` reads its destination only from device tensors, so one captured CUDA
    #: graph stays correct for every chunk (not only in the steady state).
    graph_safe_writes: ClassVar[bool] = False
    #: The model hands this cache the chunk's (rotated) queries after every write, via
    #: :meth:`observe_queries`; the last ones seen before ``commit_chunk`` (the clean
    #: pass) are the chunk's queries.
    observes_queries: ClassVar[bool] = False
    #: Retains exactly ``[sinks | last window]`` (the same tokens as the chronological
    #: path), so attention over it must equal the current path to rounding. Budgeted
    #: caches keep other tokens: their outputs differ by design.
    retains_window: ClassVar[bool] = True

    def __init__(
        self,
        k_shape: Sequence[int],
        v_shape: Sequence[int],
        *,
        seq_dim: int,
        sink: int,
        window: int,
        chunk: int,
        num_layers: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        buffers: tuple[Tensor, Tensor] | None = None,
    ) -> None:
        layout = CacheLayout(sink=sink, window=window, chunk=chunk)
        k_shape = _shape_tuple("k_shape", k_shape)
        v_shape = _shape_tuple("v_shape", v_shape)
        if k_shape[:-1] != v_shape[:-1]:
            raise ValueError(
                f"k_shape and v_shape must agree except in the last dim, got {k_shape} and {v_shape}"
            )
        rank = len(k_shape)
        seq_dim = _index("seq_dim", seq_dim)
        if not -rank <= seq_dim < rank or seq_dim % rank == rank - 1:
            raise ValueError(
                f"seq_dim must index a non-feature dim of a rank-{rank} shape "
                f"(in [{-rank}, {rank - 2}] or [{-rank}, -2]), got {seq_dim}"
            )
        seq = seq_dim % rank
        if k_shape[seq] != layout.capacity:
            raise ValueError(
                f"k_shape[seq_dim={seq_dim}] must equal sink + window = {layout.capacity}, "
                f"got {k_shape[seq]} in {k_shape}"
            )
        num_layers = _index("num_layers", num_layers)
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")

        self.layout = layout
        self.k_shape = k_shape
        self.v_shape = v_shape
        self.seq_dim = seq
        self.num_layers = num_layers
        self.dtype = dtype

        if buffers is None:
            self._k = torch.zeros((num_layers, *k_shape), dtype=dtype, device=device)
            self._v = torch.zeros((num_layers, *v_shape), dtype=dtype, device=device)
        else:
            self._k, self._v = self._check_buffers(buffers, torch.device(device))
        self.device = self._k.device
        self._slot_pos = torch.full((layout.capacity,), -1, dtype=torch.long, device=self.device)
        self._chunk_shape_k = k_shape[:seq] + (layout.chunk,) + k_shape[seq + 1 :]
        self._chunk_shape_v = v_shape[:seq] + (layout.chunk,) + v_shape[seq + 1 :]
        # host state: the only Python ints of the lifecycle
        self._next_chunk = 0  # chunks reserved so far; begin_chunk(_next_chunk) advances
        self._open: int | None = None  # chunk between begin_chunk and commit_chunk
        self._is_open = False  # the same as a bool, read by write() (stable under compile)
        self._eviction_listeners: list[Callable[[EvictionEvent], None]] = []

    def _check_buffers(self, buffers: tuple[Tensor, Tensor], device: torch.device) -> tuple[Tensor, Tensor]:
        if not (isinstance(buffers, (tuple, list)) and len(buffers) == 2):
            raise TypeError(f"buffers must be a (K, V) pair of tensors, got {type(buffers).__name__}")
        k, v = buffers
        for name, t, shape in (("K", k, self.k_shape), ("V", v, self.v_shape)):
            if not isinstance(t, Tensor):
                raise TypeError(f"buffers {name} must be a Tensor, got {type(t).__name__}")
            want = (self.num_layers, *shape)
            if tuple(t.shape) != want:
                raise ValueError(f"buffers {name} must have shape {want}, got {tuple(t.shape)}")
            if t.dtype != self.dtype:
                raise TypeError(f"buffers {name} must have dtype {self.dtype}, got {t.dtype}")
        if k.device != v.device:
            raise ValueError(f"buffers K and V must share a device, got {k.device} and {v.device}")
        return k, v

    # ================================================================ lifecycle
    def begin_chunk(self, chunk_idx: int) -> None:
        """Reserve the slots of chunk ``chunk_idx`` (host side; call outside graph capture).

        ``chunk_idx == next_chunk`` advances the stream (and may evict the oldest
        window positions); ``chunk_idx == next_chunk - 1`` reopens the last chunk so
        that its slots are written again. Launches a few small device ops that
        prepare the write metadata; never synchronises.

        Raises:
            TypeError: ``chunk_idx`` is not an int.
            RuntimeError: a chunk is already open.
            ValueError: ``chunk_idx`` is neither the next nor the current chunk.
        """
        advance = self.check_begin(chunk_idx)
        if advance:
            self._reserve(chunk_idx)
            self._next_chunk += 1
        else:
            self._reopen(chunk_idx)
        self._open = chunk_idx
        self._is_open = True

    def check_begin(self, chunk_idx: int) -> bool:
        """Raise as ``begin_chunk(chunk_idx)`` would; else return True for an advance,
        False for a reopen. Changes nothing."""
        chunk_idx = _index("chunk_idx", chunk_idx)
        if self._open is not None:
            raise RuntimeError(
                f"chunk {self._open} is still open: call commit_chunk({self._open}) "
                f"before begin_chunk({chunk_idx})"
            )
        nxt = self._next_chunk
        if chunk_idx == nxt:
            return True
        if chunk_idx == nxt - 1 and chunk_idx >= 0:
            return False
        allowed = f"the next chunk ({nxt})" + (f" or the current one ({nxt - 1})" if nxt else "")
        raise ValueError(f"chunk_idx must be {allowed}, got {chunk_idx}")

    def write(self, k: Tensor, v: Tensor, layer: int | None = None) -> None:
        """Copy the open chunk's K/V into its reserved slots, in place.

        May be called any number of times between ``begin_chunk`` and
        ``commit_chunk`` (denoising steps, then the clean pass); each call replaces
        the chunk's previous K/V.

        Args:
            k: ``k_shape`` with ``chunk`` at ``seq_dim``; same dtype and device as the cache.
            v: ``v_shape`` with ``chunk`` at ``seq_dim``.
            layer: which layer; may be omitted when ``num_layers == 1``.

        Safe under CUDA graph capture and ``torch.compile``: the destination slots are
        read from device tensors and no host state changes.
        """
        layer = self._check_layer(layer)
        if not self._is_open:
            raise RuntimeError("write() needs an open chunk: call begin_chunk(chunk_idx) first")
        self._check_chunk_tensor("k", k, self._chunk_shape_k)
        self._check_chunk_tensor("v", v, self._chunk_shape_v)
        self._write(layer, k, v)

    def commit_chunk(self, chunk_idx: int) -> None:
        """Make the open chunk history (host side).

        It does not check that the chunk was written: the write may live in a replayed
        CUDA graph that the host never sees.
        """
        self.check_commit(chunk_idx)
        self._on_commit(chunk_idx)
        self._open = None
        self._is_open = False

    def check_commit(self, chunk_idx: int) -> None:
        """Raise as ``commit_chunk(chunk_idx)`` would. Changes nothing."""
        chunk_idx = _index("chunk_idx", chunk_idx)
        if self._open is None:
            raise RuntimeError(f"commit_chunk({chunk_idx}) with no open chunk: call begin_chunk first")
        if chunk_idx != self._open:
            raise ValueError(f"commit_chunk must name the open chunk ({self._open}), got {chunk_idx}")

    def reset(self) -> None:
        """Forget the stream: empty cache, next chunk 0. Buffers are kept (same ``data_ptr``)."""
        self._next_chunk = 0
        self._open = None
        self._is_open = False
        self._slot_pos.fill_(-1)
        self._on_reset()

    # ============================================================ subclass hooks
    @abc.abstractmethod
    def _reserve(self, chunk_idx: int) -> None:
        """Advance to ``chunk_idx``: free/evict, prepare write metadata. Must not fail."""

    def _reopen(self, chunk_idx: int) -> None:
        """Reopen the last chunk; its write metadata is already in place."""

    @abc.abstractmethod
    def _write(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Copy one layer's chunk K/V into the reserved slots."""

    def _on_commit(self, chunk_idx: int) -> None:
        """Bookkeeping when a chunk becomes history."""

    def _on_reset(self) -> None:
        """Extra state to clear on reset."""

    @abc.abstractmethod
    def chronological_slots(self) -> list[int]:
        """Occupied slots, ordered by the positions they hold (host arithmetic)."""

    # ================================================================ reading
    @property
    def next_chunk(self) -> int:
        """Index that ``begin_chunk`` will advance to."""
        return self._next_chunk

    @property
    def open_chunk(self) -> int | None:
        """The chunk between ``begin_chunk`` and ``commit_chunk``, or None."""
        return self._open

    @property
    def end(self) -> int:
        """Positions that have entered the stream, the open chunk included."""
        return self._next_chunk * self.layout.chunk

    @property
    def num_valid(self) -> int:
        """Occupied slots (host int)."""
        return self.layout.num_valid(self.end)

    @property
    def all_valid(self) -> bool:
        """Every slot holds a retained position."""
        return self.num_valid == self.layout.capacity

    @property
    def slot_positions(self) -> Tensor:
        """Device ``int64 [capacity]``: the position held by each slot, ``-1`` when empty.

        The cache's own tensor (updated in place); do not mutate it.
        """
        return self._slot_pos

    def valid_mask(self) -> Tensor:
        """Device ``bool [capacity]``: slots holding a retained position."""
        return self._slot_pos >= 0

    def add_eviction_listener(self, listener: Callable[[EvictionEvent], None]) -> None:
        """Call ``listener(event)`` whenever retained tokens are about to be evicted (see
        :class:`EvictionEvent`). Listeners run on the host inside ``begin_chunk`` (ring,
        chronological) or ``commit_chunk`` (budgeted caches), outside any captured region."""
        if not callable(listener):
            raise TypeError(f"listener must be callable, got {type(listener).__name__}")
        self._eviction_listeners.append(listener)

    def _notify_evict(self, chunk_idx: int, layers: Sequence[int], evicted: Tensor) -> None:
        if self._eviction_listeners:
            event = EvictionEvent(self, chunk_idx, tuple(layers), evicted)
            for listener in self._eviction_listeners:
                listener(event)

    def observe_queries(self, q: Tensor, layer: int | None = None) -> None:
        """Receive the open chunk's queries (layout of the K chunk). No-op unless the cache
        ``observes_queries``."""

    def layer_slot_positions(self, layer: int | None = None) -> Tensor:
        """Slot positions as seen by ``layer``: ``int64 [capacity]``, or ``[heads, capacity]``
        for caches whose heads hold different positions."""
        self._check_layer(layer)
        return self._slot_pos

    def keys(self, layer: int | None = None) -> Tensor:
        """The physical key buffer of ``layer`` (``k_shape``), a view of the storage."""
        return self._k[self._check_layer(layer)]

    def values(self, layer: int | None = None) -> Tensor:
        """The physical value buffer of ``layer`` (``v_shape``), a view of the storage."""
        return self._v[self._check_layer(layer)]

    def valid_keys(self, layer: int | None = None) -> Tensor:
        """Keys of the occupied slots ``[0, num_valid)`` (the valid prefix), physical order."""
        return self.keys(layer).narrow(self.seq_dim, 0, self.num_valid)

    def valid_values(self, layer: int | None = None) -> Tensor:
        """Values of the occupied slots ``[0, num_valid)``, physical order."""
        return self.values(layer).narrow(self.seq_dim, 0, self.num_valid)

    def chronological_keys(self, layer: int | None = None) -> Tensor:
        """Retained keys ordered by position, ``[sinks | window]`` (a gathered copy)."""
        return self._gather(self.keys(layer))

    def chronological_values(self, layer: int | None = None) -> Tensor:
        """Retained values ordered by position (a gathered copy)."""
        return self._gather(self.values(layer))

    def chronological_positions(self) -> list[int]:
        """Positions of ``chronological_keys()`` rows (host arithmetic)."""
        return self.layout.retained_positions(self.end)

    def _gather(self, buf: Tensor) -> Tensor:
        idx = torch.tensor(self.chronological_slots(), dtype=torch.long, device=buf.device)
        return buf.index_select(self.seq_dim, idx)

    def layer(self, layer: int) -> LayerView:
        """A handle on one layer: what an attention module needs."""
        return LayerView(self, self._check_layer(layer))

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V buffers (all layers)."""
        return self._k.nbytes + self._v.nbytes

    # ============================================================ state dicts
    def config(self) -> dict[str, Any]:
        """What must match for a state dict to load: kind, layout, shapes, dtype."""
        return {
            "kind": type(self).__name__,
            "layout": (self.layout.sink, self.layout.window, self.layout.chunk),
            "k_shape": self.k_shape,
            "v_shape": self.v_shape,
            "seq_dim": self.seq_dim,
            "num_layers": self.num_layers,
            "dtype": str(self.dtype),
            **self._extra_config(),
        }

    def state_dict(self) -> dict[str, Any]:
        """The cache's full state. Tensors alias the live buffers (as in ``torch``):
        clone or save them before the stream moves on."""
        return {
            **self.config(),
            "next_chunk": self._next_chunk,
            "open_chunk": self._open,
            "keys": self._k,
            "values": self._v,
            "slot_positions": self._slot_pos,
            **self._extra_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` into the existing buffers.

        Raises ``ValueError`` (nothing changed) if it comes from another kind of cache,
        layout, shape, layer count or dtype, or is internally inconsistent.
        """
        self.validate_state(state)
        self._k.copy_(state["keys"])
        self._v.copy_(state["values"])
        self._slot_pos.copy_(state["slot_positions"])
        self._next_chunk = state["next_chunk"]
        self._open = state["open_chunk"]
        self._is_open = self._open is not None
        self._load_extra_state(state)

    def validate_state(self, state: dict[str, Any]) -> None:
        """Raise as ``load_state_dict(state)`` would. Changes nothing."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        for key, want in self.config().items():
            if key not in state:
                raise ValueError(f"state dict lacks {key!r}")
            got = state[key]
            if isinstance(want, tuple):
                got = tuple(got) if isinstance(got, (tuple, list, torch.Size)) else got
            if got != want:
                raise ValueError(f"state dict {key} must be {want!r} for this cache, got {got!r}")
        for key, buf in (("keys", self._k), ("values", self._v), ("slot_positions", self._slot_pos)):
            t = state.get(key)
            if not isinstance(t, Tensor) or t.shape != buf.shape or t.dtype != buf.dtype:
                desc = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else repr(type(t).__name__)
                raise ValueError(f"state dict {key} must be a {tuple(buf.shape)} {buf.dtype} tensor, got {desc}")
        nxt = state.get("next_chunk")
        if isinstance(nxt, bool) or not isinstance(nxt, int) or nxt < 0:
            raise ValueError(f"state dict next_chunk must be an int >= 0, got {nxt!r}")
        open_chunk = state.get("open_chunk")
        if open_chunk is not None and (nxt == 0 or open_chunk != nxt - 1):
            raise ValueError(
                f"state dict open_chunk must be None or next_chunk - 1 = {nxt - 1}, got {open_chunk!r}"
            )
        self._check_extra_state(state)

    def _extra_config(self) -> dict[str, Any]:
        return {}

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _check_extra_state(self, state: dict[str, Any]) -> None:
        """Validate subclass entries of a state dict; raise before anything changes."""

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore subclass state (e.g. write metadata) after the common part."""

    # ============================================================ validation
    def _check_layer(self, layer: int | None) -> int:
        if layer is None:
            if self.num_layers != 1:
                raise ValueError(f"layer is required: this cache holds {self.num_layers} layers")
            return 0
        layer = _index("layer", layer)
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        return layer

    def _check_chunk_tensor(self, name: str, t: Tensor, shape: tuple[int, ...]) -> None:
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.dim() != len(shape):
            raise ValueError(f"{name} must have rank {len(shape)} (shape {shape}), got rank {t.dim()} {tuple(t.shape)}")
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{name} must have shape {shape} (chunk={self.layout.chunk} at seq_dim={self.seq_dim}), "
                f"got {tuple(t.shape)}"
            )
        if t.dtype != self.dtype:
            raise TypeError(f"{name} must have the cache dtype {self.dtype}, got {t.dtype}")
        if t.device != self.device:
            raise ValueError(f"{name} must be on the cache device {self.device}, got {t.device}")

    def __repr__(self) -> str:
        L = self.layout
        return (
            f"{type(self).__name__}(sink={L.sink}, window={L.window}, chunk={L.chunk}, "
            f"k_shape={self.k_shape}, v_shape={self.v_shape}, seq_dim={self.seq_dim}, "
            f"num_layers={self.num_layers}, dtype={self.dtype}, device={self.device}, "
            f"next_chunk={self._next_chunk}, open_chunk={self._open})"
        )


class LayerView:
    """One layer of a cache: what an attention module reads and writes.

    Holds no state of its own; the lifecycle (begin/commit/reset) stays on the cache.
    """

    __slots__ = ("cache", "index")

    def __init__(self, cache: KVCache, index: int) -> None:
        self.cache = cache
        self.index = index

    def write(self, k: Tensor, v: Tensor) -> None:
        self.cache.write(k, v, layer=self.index)

    def keys(self) -> Tensor:
        return self.cache.keys(self.index)

    def observe_queries(self, q: Tensor) -> None:
        self.cache.observe_queries(q, layer=self.index)

    @property
    def slot_positions(self) -> Tensor:
        return self.cache.layer_slot_positions(self.index)

    def values(self) -> Tensor:
        return self.cache.values(self.index)

    def chronological_keys(self) -> Tensor:
        return self.cache.chronological_keys(self.index)

    def chronological_values(self) -> Tensor:
        return self.cache.chronological_values(self.index)

    def __repr__(self) -> str:
        return f"LayerView({type(self.cache).__name__}, layer={self.index})"
