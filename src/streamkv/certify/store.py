"""The offload store: evicted K/V kept in host memory, by eviction event, for recall.

Each eviction event of a layer becomes one entry holding exactly the evicted
``(token, head)`` pairs, head-major (no row is stored for a head that kept it)::

    keys      [B, P, D]     P = sum over heads of the tokens that head evicted
    values    [B, P, Dv]
    positions [P] int64     stream positions
    labels    [P] int64     block group within the event's summary set (regrouping rewrites it)
    offsets   H + 1 ints    head h owns pairs [offsets[h], offsets[h + 1])  (host list)

Device to host: on CUDA the entry is allocated in pinned (page-locked) host memory and
filled with ``copy_(..., non_blocking=True)``: the copy is queued on the current stream
after the kernels that produced the rows and before the ones that overwrite their slots,
so no synchronisation is needed; a CUDA event marks its completion and is waited on only
when the host itself reads the entry (a regroup or a recall). Host to device (recall)
stages the gathered rows in pinned memory and copies them ``non_blocking``; the staging
buffers are kept alive until their copy's event has completed. On a CPU cache the "host"
copy is a plain clone (the bytes are still reported as offloaded: it is the data a GPU run
would move).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["OffloadStore", "StoreEntry"]


@dataclass
class StoreEntry:
    keys: Tensor  # [B, P, D] host
    values: Tensor  # [B, P, Dv] host
    positions: Tensor  # [P] int64 host
    labels: Tensor  # [P] int64 host
    offsets: list[int]  # H + 1
    ready: object | None = None  # torch.cuda.Event on CUDA

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.positions.nbytes + self.labels.nbytes

    def head(self, h: int) -> slice:
        return slice(self.offsets[h], self.offsets[h + 1])


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

    def put(self, layer: int, eid: int, keys: Tensor, values: Tensor, positions: Tensor, offsets: list[int]) -> None:
        """Offload one event's evicted pairs (device tensors, head-major, see the module
        docstring) as event ``eid`` (from :meth:`next_id`)."""
        if eid != self.next_id(layer):
            raise ValueError(f"event ids of layer {layer} must be consecutive: expected {self.next_id(layer)}, got {eid}")
        P = keys.shape[1]
        if offsets[-1] != P or positions.shape != (P,):
            raise ValueError(f"offsets end at {offsets[-1]} and positions have {tuple(positions.shape)}; keys hold {P}")
        self._next_id[layer] = eid + 1
        entry = StoreEntry(
            keys=self._to_host(keys), values=self._to_host(values), positions=self._to_host(positions),
            labels=torch.zeros(P, dtype=torch.long), offsets=list(offsets),
        )
        if self.cuda:  # pragma: no cover - needs a GPU
            ev = torch.cuda.Event()
            ev.record()
            entry.ready = ev
        self.entries[(layer, eid)] = entry
        self.bytes_out += keys.nbytes + values.nbytes

    def set_labels(self, layer: int, eid: int, labels: Tensor, mask: Tensor) -> None:
        """Label event ``eid``'s pairs: ``labels [H, n]`` for the rows ``mask [H, n]`` each head
        evicted, in the store's head-major order (a summary's recall key for each pair)."""
        self.entries[(layer, eid)].labels.copy_(labels[mask].to("cpu"))

    def _wait(self, entry: StoreEntry) -> None:
        if entry.ready is not None:  # pragma: no cover - needs a GPU
            entry.ready.synchronize()

    def keys_of(self, layer: int, events: list[int]) -> list[list[tuple[Tensor, Tensor]]]:
        """Per event, per head: ``(keys [B, n_h, D], labels [n_h])`` host tensors; the labels
        are views of the entry's own tensor, so a regroup writes the new groups through them."""
        out = []
        for eid in events:
            e = self.entries[(layer, eid)]
            self._wait(e)
            out.append([(e.keys[:, e.head(h)], e.labels[e.head(h)]) for h in range(len(e.offsets) - 1)])
        return out

    def gather(self, layer: int, events: list[int], group: int, head: int) -> tuple[Tensor, Tensor, Tensor]:
        """Host tensors of one block's tokens for ``head``: keys ``[B, n, D]``, values
        ``[B, n, Dv]``, positions ``[n]`` (events in order)."""
        ks, vs, ps = [], [], []
        for eid in events:
            e = self.entries[(layer, eid)]
            self._wait(e)
            sl = e.head(head)
            rows = e.labels[sl] == group
            ks.append(e.keys[:, sl][:, rows])
            vs.append(e.values[:, sl][:, rows])
            ps.append(e.positions[sl][rows])
        return torch.cat(ks, 1), torch.cat(vs, 1), torch.cat(ps)

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
