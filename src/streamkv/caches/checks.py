"""Input checks of a cache: every argument a call will touch is validated before the first
byte changes (mixed into :class:`~streamkv.caches.KVCache`; uses its storage, layout and host
counters)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..storage import check_int
from .read import Occupancy

__all__ = ["InputChecks"]

_OCCUPANCIES = ("all", "prefix", "mask")


class InputChecks:
    """Validation of a cache's inputs: tensors (type, layout, rank, shape, dtype, device,
    autograd, memory overlap with the cache's own buffers), layers, occupancies, and whether
    torch lets the buffers change at all (inference tensors)."""

    def _check_mutable(self, what: str) -> None:
        if torch.compiler.is_compiling():
            return  # a compiled step was traced after the same checks ran eagerly
        if self._inference_buffers and not torch.is_inference_mode_enabled():
            raise RuntimeError(
                f"{what}: this cache was built under torch.inference_mode(), so its buffers are inference tensors "
                f"that torch only lets change inside inference mode; call it under torch.inference_mode() (or build "
                f"the cache outside it)"
            )

    def _check_layer(self, layer: int | None) -> int:
        if layer is None:
            if self.num_layers != 1:
                raise ValueError(f"layer is required: this cache holds {self.num_layers} layers")
            return 0
        layer = check_int("layer", layer)
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        return layer

    def _check_write(self, k: Tensor, v: Tensor) -> None:
        if not self._open:
            raise RuntimeError("write() needs an open chunk: call begin_chunk(chunk_idx) first")
        self._check_mutable("write")
        self._check_tensor("k", k, self._rows_shape("k"))
        self._check_tensor("v", v, self._rows_shape("v"))

    def _rows_shape(self, which: str) -> tuple[int, ...]:
        """The shape of the open span's ``"k"`` or ``"v"`` rows."""
        shape = self.storage.chunk_shape(which)
        seq = self.seq_dim
        return shape[:seq] + (self._span,) + shape[seq + 1 :]

    def _check_queries(self, q: Tensor) -> None:
        want = self._rows_shape("k")
        if isinstance(q, Tensor) and q.dim() == len(want) and self.head_dim is not None:
            h = self.head_dim
            if q.shape[h] != want[h] and q.shape[h] % want[h] == 0:
                want = want[:h] + (q.shape[h],) + want[h + 1:]  # grouped-query attention
        self._check_tensor("q", q, want, heads_note=" (or a multiple of the key heads)")

    def _check_tensor(self, name: str, t: Tensor, shape: tuple[int, ...], heads_note: str = "") -> None:
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
        if t.dim() != len(shape):
            raise ValueError(f"{name} must have rank {len(shape)} (shape {shape}), got rank {t.dim()} {tuple(t.shape)}")
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{name} must have shape {shape}{heads_note} ({self._span} rows of the open span at "
                f"seq_dim={self.seq_dim}), got {tuple(t.shape)}"
            )
        if t.dtype != self.dtype:
            raise TypeError(f"{name} must have the cache dtype {self.dtype}, got {t.dtype}")
        if t.device != self.device:
            raise ValueError(f"{name} must be on the cache device {self.device}, got {t.device}")
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{name} requires grad: the cache stores values, not an autograd graph (every cache refuses them "
                f"alike); pass {name}.detach() or run under torch.no_grad()"
            )
        if not torch.compiler.is_compiling() and self.storage.owns(t):
            raise ValueError(f"{name} shares memory with this cache's own buffers: pass a tensor of its own (clone it)")

    def _check_occupancy(self, occupancy: Occupancy | None) -> Occupancy:
        if occupancy is None:
            return self.occupancy()
        if occupancy not in _OCCUPANCIES:
            raise ValueError(f"occupancy must be 'all', 'prefix' or 'mask', got {occupancy!r}")
        if occupancy == "mask" or torch.compiler.is_compiling():
            return occupancy  # a compiled step's occupancy was checked outside (check_occupancy)
        self.check_occupancy(occupancy)
        return occupancy

    def check_occupancy(self, occupancy: Occupancy) -> None:
        """Raise ``ValueError`` unless a read with ``occupancy`` is exact now (host counters)."""
        if occupancy not in _OCCUPANCIES:
            raise ValueError(f"occupancy must be 'all', 'prefix' or 'mask', got {occupancy!r}")
        if occupancy == "mask":
            return
        if not self.valid_is_prefix:
            why = "heads hold different slots" if self.per_head else "recall slots follow the window"
            raise ValueError(f"occupancy {occupancy!r} is invalid for this {self.name} cache ({why}): use 'mask'")
        if occupancy == "all" and self.layout.num_valid(self.end) != self.layout.capacity:
            raise ValueError(
                f"occupancy 'all' would read empty slots: {self.layout.num_valid(self.end)} of "
                f"{self.layout.capacity} slots are occupied (use 'prefix' or 'mask')"
            )

