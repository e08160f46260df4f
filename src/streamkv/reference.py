"""Independent references: the definitions of correct that the caches are tested against.

``ReferenceCache`` keeps the whole history (``torch.cat`` of every chunk) and defines
the chronological view as ``[first sink positions | last window positions]`` (all of
it while the stream is shorter than ``sink + window``). It shares no code with the
caches, not even :mod:`streamkv.layout`.

``reference_attention`` is plain softmax attention, computed in float64.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ReferenceCache", "reference_attention"]


class ReferenceCache:
    """Whole-history K/V with the same chunk lifecycle as the caches (one layer)."""

    def __init__(self, *, sink: int, window: int, chunk: int, seq_dim: int) -> None:
        self.sink, self.window, self.chunk, self.seq_dim = sink, window, chunk, seq_dim
        self._k: list[Tensor | None] = []
        self._v: list[Tensor | None] = []
        self._open = False

    def begin_chunk(self, chunk_idx: int) -> None:
        if self._open:
            raise RuntimeError("chunk already open")
        if chunk_idx == len(self._k):
            self._k.append(None)
            self._v.append(None)
        elif chunk_idx != len(self._k) - 1:
            raise ValueError(f"chunk {chunk_idx} is neither next nor current")
        self._open = True

    def write(self, k: Tensor, v: Tensor) -> None:
        if not self._open:
            raise RuntimeError("no open chunk")
        self._k[-1] = k.clone()
        self._v[-1] = v.clone()

    def commit_chunk(self, chunk_idx: int) -> None:
        self._open = False

    def reset(self) -> None:
        self._k, self._v, self._open = [], [], False

    def _view(self, chunks: list[Tensor | None]) -> Tensor:
        full = torch.cat([c for c in chunks if c is not None], dim=self.seq_dim)
        n = full.shape[self.seq_dim]
        if n <= self.sink + self.window:
            return full
        sinks = full.narrow(self.seq_dim, 0, self.sink)
        window = full.narrow(self.seq_dim, n - self.window, self.window)
        return torch.cat([sinks, window], dim=self.seq_dim)

    def chronological_keys(self) -> Tensor:
        return self._view(self._k)

    def chronological_values(self) -> Tensor:
        return self._view(self._v)


def reference_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None) -> Tensor:
    """Softmax attention in float64 over ``[..., L, D]`` tensors (no mask)."""
    q64, k64, v64 = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("...qd,...kd->...qk", q64, k64) * scale
    return torch.einsum("...qk,...kd->...qd", scores.softmax(dim=-1), v64)
