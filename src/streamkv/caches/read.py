"""``KVRead``: what attention reads from one layer of a cache, decided in one place.

A cache's :meth:`~streamkv.caches.KVCache.read` (or a layer handle's ``update``) returns it;
:func:`~streamkv.attention.attend` consumes it, and so can any other attention kernel:
``keys``/``values`` are the buffers as they lie, ``bias()`` the additive mask over their slots
(or None), ``positions`` what each slot holds per head. The cache decides here, once, how
empty slots are handled (``occupancy``) and which paths are exact:

``all``     every slot holds a retained token: attend over the whole buffer, no mask;
``prefix``  the occupied slots are ``[0, visible)``: attend over that slice;
``mask``    an additive ``-inf`` bias on empty slots, built on the device from ``positions``
            (static shapes: what compiled steps, CUDA graphs and per-head caches use).

The chronological path (keys in position order, needed for masks over positions and for
cache-relative RoPE) exists only where every head holds the same positions; elsewhere
``chronological_refusal`` says why not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .lifecycle import Lifecycle

__all__ = ["KVRead", "Occupancy"]

Occupancy = Literal["all", "prefix", "mask"]


@dataclass(frozen=True)
class KVRead:
    """One layer of a cache, ready to be attended to (see the module docstring).

    Attributes:
        keys, values: the physical buffers of the layer (tokens at ``seq_dim``; recall slots
            included), views of the cache's storage.
        seq_dim: the token dim of ``keys``; ``head_axis``: the head's index among the leading
            dims once tokens are moved next to the features (None: no head dim).
        positions: device ``int64 [H, S]``, the position each slot holds per head (``-1``: empty).
        occupancy, visible: how empty slots are handled; ``visible`` slots are read (the
            prefix length for ``"prefix"``).
        query_positions: device ``int64 [chunk]``, the positions of the open chunk's rows (the
            queries of the chunk being written), for position-causal masks; None if no chunk is open.
        empty: no token has entered the cache (attention would read nothing).
        num_retained: rows of the chronological view (host int), None where it is refused.
        chronological: returns ``(keys, values, positions)`` in position order (a gathered copy;
            ``positions`` a host list), or None where ``chronological_refusal`` says why.
        scorer: for caches whose policy needs queries: receives the per-key statistics
            ``(max, sum) [H, S]`` of the attention that reads this (``attend`` delivers them).
        name: ``"<kind> layer <i>"``, for messages.
        load: None when ``keys``/``values`` are the keys and values attention uses, as they
            lie; else ``load(a, b) -> (k, v)`` gives the attendable K/V of slots ``[a, b)``
            (token dim at ``seq_dim``), materialised for that range only (stored codes
            dequantised, raw keys rotated): ``attend`` then reads the cache a block of slots
            at a time (:func:`~streamkv.scoring.key_blockwise_attention`) and never builds a
            dense copy of the whole history.
        generation, lifecycle: the cache lifecycle generation the read was made in; a read kept
            across a begin, commit, reset or load is refused (:meth:`check_current`). None in a
            compiled step (traced reads are rebuilt every call).
        rope_at_read: None when the keys are stored rotated (RoPE at write) or need no
            rotation; else the cache's :class:`~streamkv.rope_at_read.RopeAtRead`: the keys are
            raw, and ``attend`` rotates them (a block at a time, after ``load``) and the
            queries by its position map.
    """

    keys: Tensor
    values: Tensor
    seq_dim: int
    head_axis: int | None
    positions: Tensor
    occupancy: Occupancy
    visible: int
    query_positions: Tensor | None
    empty: bool
    num_retained: int | None
    chronological: Callable[[], tuple[Tensor, Tensor, list[int]]] | None
    chronological_refusal: str | None
    scorer: Callable[[Tensor, Tensor], None] | None
    bias_fn: Callable[..., Tensor]
    name: str
    load: Callable[[int, int], tuple[Tensor, Tensor]] | None = None
    generation: int | None = None
    lifecycle: Lifecycle | None = None
    rope_at_read: Any = None

    def check_current(self) -> None:
        """Raise ``ValueError`` if the cache's lifecycle moved on since this read was made."""
        if self.lifecycle is not None and not torch.compiler.is_compiling():
            self.lifecycle.check_current(self.generation, f"this read of {self.name}")

    def bias(self, dtype: torch.dtype = torch.float32) -> Tensor | None:
        """The additive bias over the slots read (``-inf`` on empty ones), broadcastable
        against scores ``[..., Q, S]`` of the layer moved to ``[..., T, D]``; None for
        ``"all"`` and ``"prefix"`` (nothing to hide)."""
        if self.occupancy != "mask":
            return None
        return self.bias_fn(self.positions, dtype)

    def causal_bias(self, query_positions: Tensor, dtype: torch.dtype = torch.float32, window: int | None = None
                    ) -> Tensor:
        """The bias of position-causal attention over the slots read: a query at position
        ``p`` sees the occupied slots holding positions ``<= p`` (exact in physical order:
        the mask is a function of positions, not of where they lie); with ``window``, only
        those ``> p - window`` (a sliding window of ``window`` positions, the query's own
        included). ``query_positions``: ``int64 [Q]``. Shape: broadcastable against ``[..., Q, S]``."""
        return self.bias_fn(self.positions[:, : self.visible], dtype, query_positions, window)
