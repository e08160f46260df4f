"""Input checks of a cache: every argument a call will touch is validated before the first
byte changes (tensors, layers, occupancies, lifecycle, and whether torch lets the buffers
change at all)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..layout import CacheLayout
from ..policies import SlotPolicy
from ..storage import KVStorage, check_int
from .lifecycle import Lifecycle
from .read import Occupancy

__all__ = ["InputChecks", "OCCUPANCIES"]

OCCUPANCIES = ("all", "prefix", "mask")


class InputChecks:
    """Validation of one cache's inputs (type, layout, rank, shape, dtype, device, autograd,
    memory overlap with the cache's own buffers, inference-mode state)."""

    def __init__(self, storage: KVStorage, layout: CacheLayout, lifecycle: Lifecycle, policy: SlotPolicy) -> None:
        self.storage, self.layout, self.lifecycle, self.policy = storage, layout, lifecycle, policy
        # torch lets inference tensors change only in inference mode
        self.inference_buffers = any(t.is_inference() for t in (*storage.store.tensors().values(), storage.positions))

    @property
    def valid_is_prefix(self) -> bool:
        """The occupied slots are always ``[0, num_valid)``."""
        return not self.policy.per_head and not self.storage.recall_slots

    def mutable(self, what: str) -> None:
        if torch.compiler.is_compiling():
            return  # a compiled step was traced after the same checks ran eagerly
        self.alive(what)
        if self.inference_buffers and not torch.is_inference_mode_enabled():
            raise RuntimeError(
                f"{what}: this cache was built under torch.inference_mode(), so its buffers are inference tensors "
                f"that torch only lets change inside inference mode; call it under torch.inference_mode() (or build "
                f"the cache outside it)"
            )

    def can_begin(self, what: str) -> None:
        self.mutable(what)
        lc = self.lifecycle
        if lc.is_open:
            raise RuntimeError(f"{lc.open_name()} is still open: call {lc.commit_call()} before {what}")

    def is_open_for(self, what: str) -> None:
        self.mutable(what)
        if not self.lifecycle.is_open:
            raise RuntimeError(f"{what} with nothing open: call begin_chunk(chunk_idx) or begin_tokens(n) first")

    def alive(self, what: str) -> None:
        """Raise ``RuntimeError`` if the cache was released (its pages went back to the pool)."""
        if self.lifecycle.released:
            raise RuntimeError(f"{what}: this cache was released (its pages went back to the pool); use another branch")

    def layer(self, layer: int | None) -> int:
        if not torch.compiler.is_compiling():
            self.alive("a layer call")
        L = self.storage.num_layers
        if layer is None:
            if L != 1:
                raise ValueError(f"layer is required: this cache holds {L} layers")
            return 0
        layer = check_int("layer", layer)
        if not 0 <= layer < L:
            raise ValueError(f"layer must be in [0, {L}), got {layer}")
        return layer

    def write(self, k: Tensor, v: Tensor) -> None:
        if not self.lifecycle.is_open:
            raise RuntimeError("write() needs an open chunk: call begin_chunk(chunk_idx) first")
        self.mutable("write")
        self.tensor("k", k, self.rows_shape("k"))
        self.tensor("v", v, self.rows_shape("v"))

    def rows_shape(self, which: str) -> tuple[int, ...]:
        """The shape of the open span's ``"k"`` or ``"v"`` rows."""
        shape = self.storage.chunk_shape(which)
        seq = self.storage.seq_dim
        return shape[:seq] + (self.lifecycle.span,) + shape[seq + 1 :]

    def queries(self, q: Tensor) -> None:
        want = self.rows_shape("k")
        h = self.storage.head_dim
        if isinstance(q, Tensor) and q.dim() == len(want) and h is not None:
            if q.shape[h] != want[h] and q.shape[h] % want[h] == 0:
                want = want[:h] + (q.shape[h],) + want[h + 1:]  # grouped-query attention
        self.tensor("q", q, want, heads_note=" (or a multiple of the key heads)")

    def tensor(self, name: str, t: Tensor, shape: tuple[int, ...], heads_note: str = "") -> None:
        st = self.storage
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
        if t.dim() != len(shape):
            raise ValueError(f"{name} must have rank {len(shape)} (shape {shape}), got rank {t.dim()} {tuple(t.shape)}")
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{name} must have shape {shape}{heads_note} ({self.lifecycle.span} rows of the open span at "
                f"seq_dim={st.seq_dim}), got {tuple(t.shape)}"
            )
        if t.dtype != st.dtype:
            raise TypeError(f"{name} must have the cache dtype {st.dtype}, got {t.dtype}")
        if t.device != st.device:
            raise ValueError(f"{name} must be on the cache device {st.device}, got {t.device}")
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{name} requires grad: the cache stores values, not an autograd graph (every cache refuses them "
                f"alike); pass {name}.detach() or run under torch.no_grad()"
            )
        if not torch.compiler.is_compiling() and st.owns(t):
            raise ValueError(f"{name} shares memory with this cache's own buffers: pass a tensor of its own (clone it)")

    def occupancy(self, occupancy: Occupancy | None, default: Callable[[], Occupancy]) -> Occupancy:
        if occupancy is None:
            return default()
        if occupancy not in OCCUPANCIES:
            raise ValueError(f"occupancy must be 'all', 'prefix' or 'mask', got {occupancy!r}")
        if occupancy == "mask" or torch.compiler.is_compiling():
            return occupancy  # a compiled step's occupancy was checked outside (check_occupancy)
        self.check_occupancy(occupancy)
        return occupancy

    def check_occupancy(self, occupancy: Occupancy) -> None:
        """Raise ``ValueError`` unless a read with ``occupancy`` is exact now (host counters)."""
        if occupancy not in OCCUPANCIES:
            raise ValueError(f"occupancy must be 'all', 'prefix' or 'mask', got {occupancy!r}")
        if occupancy == "mask":
            return
        if not self.valid_is_prefix:
            why = "heads hold different slots" if self.policy.per_head else "recall slots follow the window"
            raise ValueError(f"occupancy {occupancy!r} is invalid for this {self.policy.name} cache ({why}): use 'mask'")
        held = self.layout.num_valid(self.lifecycle.end)
        if occupancy == "all" and held != self.layout.capacity:
            raise ValueError(
                f"occupancy 'all' would read empty slots: {held} of {self.layout.capacity} slots are occupied "
                f"(use 'prefix' or 'mask')"
            )
