"""The offload store: evicted K/V kept in host memory, by eviction event, for recall.

Each eviction event of a layer becomes one entry: the evicted rows' keys ``[B, n, H, D]``,
values ``[B, n, H, Dv]``, positions ``[H, n]``, and per head which rows it evicted
(``mask [H, n]``) and their group (``labels [H, n]``, see
:class:`~streamkv.certify.summary.BlockSummaries`). A block's tokens for head ``h`` are the
rows of its events with ``mask[h]`` set and ``labels[h]`` equal to the block's group.

Device to host: on CUDA the entry is allocated in pinned (page-locked) host memory and
filled with ``copy_(..., non_blocking=True)``: the copy is queued on the current stream
after the kernels that produced the rows and before the ones that overwrite their slots,
so no synchronisation is needed; a CUDA event marks its completion and is waited on only
when the host itself reads the entry (the recall plan). Host to device (recall) stages
the gathered rows in pinned memory and copies them ``non_blocking``; the staging buffers
are kept alive until their copy's event has completed. On a CPU cache the "host" copy is
a plain clone (the bytes are still reported as offloaded: it is the data a GPU run would
move).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["OffloadStore", "StoreEntry"]


@dataclass
class StoreEntry:
    keys: Tensor  # [B, n, H, D] host
    values: Tensor  # [B, n, H, Dv] host
    positions: Tensor  # [H, n] int64 host (a slot holds different positions per head in the mass cache)
    mask: Tensor  # [H, n] bool host
    labels: Tensor  # [H, n] int64 host
    ready: object | None = None  # torch.cuda.Event on CUDA

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.positions.nbytes + self.mask.nbytes + self.labels.nbytes


class OffloadStore:
    """Host-side K/V of evicted tokens, per layer and eviction event."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.entries: dict[tuple[int, int], StoreEntry] = {}
        self._next_id: dict[int, int] = {}
        self._staging: list[tuple[object, Tensor]] = []
        self.bytes_out = 0  # device -> host
        self.bytes_in = 0  # host -> device (recall)

    def reset(self) -> None:
        self.entries.clear()
        self._next_id.clear()
        self._staging.clear()
        self.bytes_out = 0
        self.bytes_in = 0

    def _to_host(self, t: Tensor) -> Tensor:
        if self.cuda:  # pragma: no cover - needs a GPU
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            return host
        return t.detach().clone()

    def next_id(self, layer: int) -> int:
        """The id the next :meth:`put` for ``layer`` will use."""
        return self._next_id.get(layer, 0)

    def put(self, layer: int, eid: int, keys: Tensor, values: Tensor, positions: Tensor, mask: Tensor,
            labels: Tensor) -> None:
        """Offload one event's rows (device tensors) as event ``eid`` (from :meth:`next_id`)."""
        if eid != self.next_id(layer):
            raise ValueError(f"event ids of layer {layer} must be consecutive: expected {self.next_id(layer)}, got {eid}")
        self._next_id[layer] = eid + 1
        entry = StoreEntry(
            keys=self._to_host(keys), values=self._to_host(values), positions=self._to_host(positions),
            mask=self._to_host(mask), labels=self._to_host(labels),
        )
        if self.cuda:  # pragma: no cover - needs a GPU
            ev = torch.cuda.Event()
            ev.record()
            entry.ready = ev
        self.entries[(layer, eid)] = entry
        self.bytes_out += keys.nbytes + values.nbytes

    def _wait(self, entry: StoreEntry) -> None:
        if entry.ready is not None:  # pragma: no cover - needs a GPU
            entry.ready.synchronize()

    def gather(self, layer: int, events: list[int], group: int, head: int) -> tuple[Tensor, Tensor, Tensor]:
        """Host tensors of one block's tokens for ``head``: keys ``[B, n, D]``, values
        ``[B, n, Dv]``, positions ``[n]`` (events in order)."""
        ks, vs, ps = [], [], []
        for eid in events:
            e = self.entries[(layer, eid)]
            self._wait(e)
            rows = e.mask[head] & (e.labels[head] == group)
            ks.append(e.keys[:, rows, head])
            vs.append(e.values[:, rows, head])
            ps.append(e.positions[head, rows])
        return torch.cat(ks, 1), torch.cat(vs, 1), torch.cat(ps)

    def keys_of(self, layer: int, events: list[int]) -> list[tuple[Tensor, Tensor, Tensor]]:
        """``(keys [B, n, H, D], mask [H, n], labels [H, n])`` host tensors of ``events`` (the
        labels are the entry's own tensor: a regroup writes the new groups into it)."""
        out = []
        for eid in events:
            e = self.entries[(layer, eid)]
            self._wait(e)
            out.append((e.keys, e.mask, e.labels))
        return out

    def to_device(self, t: Tensor) -> Tensor:
        """Copy a host tensor to the cache device (pinned + non_blocking on CUDA)."""
        self.bytes_in += t.nbytes
        if self.cuda:  # pragma: no cover - needs a GPU
            self._staging = [(ev, buf) for ev, buf in self._staging if not ev.query()]
            staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            staged.copy_(t)
            out = staged.to(self.device, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self._staging.append((ev, staged))
            return out
        return t.to(self.device)

    @property
    def nbytes(self) -> int:
        """Host bytes held."""
        return sum(e.nbytes for e in self.entries.values())

    @property
    def kv_nbytes(self) -> int:
        """Host bytes of offloaded K/V alone."""
        return sum(e.keys.nbytes + e.values.nbytes for e in self.entries.values())
