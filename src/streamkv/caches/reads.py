"""What a cache offers to read: its occupancy, host counters of what it holds, physical
buffers, the :class:`~streamkv.caches.read.KVRead` of a layer (decided here, once), and the
chronological view where every head holds the same positions (mixed into
:class:`~streamkv.caches.KVCache`)."""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from .read import KVRead, Occupancy

__all__ = ["ReadPaths"]


class ReadPaths:
    """Occupancy, counts, buffers, reads and chronological views of a cache."""

    @property
    def num_valid(self) -> int:
        """Occupied slots of the ``sink + window`` the policy manages: the count for window
        caches (host arithmetic), the most of any (layer, head) for per-head ones (synchronises)."""
        if not self.per_head:
            return self.layout.num_valid(self.end)
        return int((self.storage.positions[..., : self.layout.capacity] >= 0).sum(-1).max())

    def occupancy(self, static: bool = False) -> Occupancy:
        """How a read treats empty slots now (host decision): ``"all"`` when a window cache is
        full, ``"prefix"`` while it fills, ``"mask"`` for per-head caches and recall slots.
        ``static=True`` (compiled steps, CUDA graphs: shapes must not change): ``"mask"``
        instead of ``"prefix"``."""
        if not self.valid_is_prefix:
            return "mask"
        if self.layout.num_valid(self._end) == self.layout.capacity:
            return "all"
        return "mask" if static else "prefix"

    @property
    def all_valid(self) -> bool:
        """Every slot holds a retained token (``occupancy() == "all"``)."""
        return self.occupancy() == "all"

    @property
    def slot_positions(self) -> Tensor:
        """Device ``int64 [num_layers, heads, slots]``: the position each slot holds per layer
        and head (``-1`` empty); broadcast from one plan for window caches. Read-only view."""
        return self.storage.slot_positions

    @property
    def write_slots(self) -> Tensor:
        """Device ``int64 [num_layers, heads, chunk]``: the slots of the open (or last) chunk's rows."""
        return self.storage.write_slots

    def layer_slot_positions(self, layer: int | None = None) -> Tensor:
        """``int64 [heads, slots]``: ``slot_positions`` of one layer."""
        return self.storage.layer_positions(self._check_layer(layer))

    def keys(self, layer: int | None = None) -> Tensor:
        """The physical key buffer of ``layer`` (a view of the storage)."""
        return self.storage.keys[self._check_layer(layer)]

    def values(self, layer: int | None = None) -> Tensor:
        """The physical value buffer of ``layer`` (a view of the storage)."""
        return self.storage.values[self._check_layer(layer)]

    def read(self, layer: int | None = None, occupancy: Occupancy | None = None) -> KVRead:
        """What attention reads from ``layer`` now (:class:`~streamkv.caches.read.KVRead`).

        ``occupancy`` (default :meth:`occupancy`) may be forced to ``"mask"`` for static shapes
        (compiled steps, CUDA graphs); ``"all"``/``"prefix"`` where they would read an empty
        slot are refused (``ValueError``).
        """
        return self._read(self._check_layer(layer), self._check_occupancy(occupancy))

    @property
    def chronological_refusal(self) -> str | None:
        """Why this cache has no chronological view (masks over it, cache-relative RoPE), or
        None when it has one."""
        if self.per_head:
            return (f"the heads of this {self.name} cache hold different positions: there is no common chronological "
                    f"order (use the physical path, occupancy 'mask')")
        if self.storage.recall_slots:
            return "recall slots hold tokens outside the window: the chronological view does not include them"
        return None

    def _read(self, layer: int, occupancy: Occupancy) -> KVRead:
        if torch.compiler.is_compiling():
            # a traced step must not read the host counters (each value would be a guard, and
            # a recompilation per chunk): only what stays the same from chunk to chunk
            return self._make_read(layer, occupancy, traced=True)
        read = self._reads.get((layer, occupancy))
        if read is None:
            read = self._reads[(layer, occupancy)] = self._make_read(layer, occupancy)
        return read

    def _make_read(self, layer: int, occupancy: Occupancy, traced: bool = False) -> KVRead:
        st = self.storage
        if occupancy == "prefix" and traced:
            raise ValueError("occupancy 'prefix' has a data-dependent shape: compiled steps read with 'all' or 'mask'")
        visible = self.layout.num_valid(self._end) if occupancy == "prefix" else st.slots
        refusal = self.chronological_refusal
        chrono = None if refusal or traced else partial(self._chronological, layer)
        return KVRead(
            keys=st.keys[layer], values=st.values[layer], seq_dim=st.seq_dim, head_axis=st.head_axis,
            positions=st.layer_positions(layer), occupancy=occupancy, visible=visible,
            query_positions=self._chunk_positions[: self._span] if self._open else None,
            empty=False if traced else self._end == 0,
            num_retained=None if chrono is None else self.layout.num_valid(self._end), chronological=chrono,
            chronological_refusal=refusal if not traced else (refusal or "not inside a compiled step"),
            scorer=partial(self.policy.receive, layer) if self.policy.needs_queries else None,
            bias_fn=st.bias, name=f"{self.name} cache layer {layer}", rope_at_read=self.rope_at_read,
        )

    def _chronological(self, layer: int) -> tuple[Tensor, Tensor, list[int]]:
        slots = self.policy.chronological_slots(self.end)
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        st = self.storage
        return (st.keys[layer].index_select(st.seq_dim, idx), st.values[layer].index_select(st.seq_dim, idx),
                self.layout.retained_positions(self.end))

    def chronological_keys(self, layer: int | None = None) -> Tensor:
        """Retained keys in position order, ``[sinks | window]`` (a gathered copy). Refused
        (``ValueError``) where heads hold different positions."""
        return self._chronological_view(layer)[0]

    def chronological_values(self, layer: int | None = None) -> Tensor:
        """Retained values in position order (a gathered copy); refused as the keys are."""
        return self._chronological_view(layer)[1]

    def chronological_positions(self) -> list[int]:
        """Positions of the ``chronological_keys()`` rows (host arithmetic); refused as they are."""
        self._chronological_view(0)
        return self.layout.retained_positions(self.end)

    def _chronological_view(self, layer: int | None) -> tuple[Tensor, Tensor, list[int]]:
        read = self._read(self._check_layer(layer), "mask")
        if read.chronological is None:
            raise ValueError(f"no chronological view: {read.chronological_refusal}")
        return read.chronological()

