"""``CircularBlockKVCache``: a drop-in for flashdreams 0.1.0's ``BlockKVCache``, on the ring.

Same constructor (``k_shape, v_shape, seq_dim, chunk_size, window_size, sink_size,
device, dtype``), methods and properties (``before_update``, ``update``,
``cached_k``, ``cached_v``, ``after_update``, ``reset``, ``is_steady_state``,
``size``, ``write_end``, ``from_tensor``). Differences, all deliberate:

- ``cached_k()`` / ``cached_v()`` return the *physical* buffer (the valid prefix
  while filling): rows are not in position order once the ring has wrapped. That is
  exact for unmasked attention with RoPE applied before the cache write (the Wan
  recipe's default); for flashdreams' cache-relative RoPE pass ``relative_rope_freqs=``
  (below); for masks over chronological key indices use the original ``BlockKVCache``.
- ``write_end`` locates the chunk in a chronological layout. It is returned while
  the two layouts coincide (before the first eviction) and raises ``RuntimeError``
  afterwards, rather than name slots the chunk does not occupy.
- Misuse raises ``ValueError`` / ``TypeError`` / ``RuntimeError`` (not
  ``AssertionError``, which ``python -O`` strips) naming the original method
  (``before_update``, ``update``, ``after_update``), and leaves the cache unchanged.
- ``(sink_size + window_size) % chunk_size`` need not be 0.
- flashdreams' KV-cache-relative RoPE (raw keys rotated by their index in ``cached_k()``):
  pass ``relative_rope_freqs=`` (its ``KVCacheRelativeRotaryPositionEmbedding3D.shift_t``
  table) and ``interleaved=``; ``cached_k()`` then returns the ring's keys pre-rotated so that
  flashdreams' own rotation places each at its chronological index, and ``write_end`` is
  ``size`` after evictions too (:mod:`.cache_relative_rope`).
- ``update`` accepts what the original's slice assignment accepts of dtypes and devices: K/V
  of another floating dtype are cast to the cache's, K/V on another device are copied over.
  It does not broadcast: K/V must have the chunk's exact shape (the original would broadcast
  a size-1 dimension silently). Sizes may be numpy integers, as in the original.
- On a CPU-only build the default ``device="cuda"`` raises ``RuntimeError`` saying so (pass
  ``device="cpu"``), where the original fails inside ``torch.empty``.

This module does not import flashdreams.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..caches import RingCache
from ..storage import check_int
from .cache_relative_rope import check_relative_freqs, rotate_full_width, slot_ranks

__all__ = ["CircularBlockKVCache"]

#: the ring's method names -> the original's, for error messages
_NAMES = {"begin_chunk": "before_update", "commit_chunk": "after_update", "write()": "update()",
          "begin_tokens": "before_update", "commit()": "after_update()"}


def _as_original(exc: Exception) -> Exception:
    """The same exception with the original class's method names in its message."""
    msg = str(exc)
    for ours, theirs in _NAMES.items():
        msg = msg.replace(ours, theirs)
    return type(exc)(msg)


class CircularBlockKVCache:
    """flashdreams ``BlockKVCache`` interface over a :class:`~streamkv.RingCache`."""

    def __init__(
        self,
        k_shape: tuple[int, ...],
        v_shape: tuple[int, ...],
        seq_dim: int,
        chunk_size: int,
        window_size: int,
        sink_size: int = 0,
        device: torch.device | str = torch.device("cuda"),
        dtype: torch.dtype = torch.float16,
        *,
        relative_rope_freqs: Tensor | None = None,
        interleaved: bool = True,
    ) -> None:
        chunk_size, window_size, sink_size = (check_int(n, x, low) for n, x, low in (
            ("chunk_size", chunk_size, 1), ("window_size", window_size, 1), ("sink_size", sink_size, 0)))
        try:
            self._ring = RingCache(
                tuple(k_shape), tuple(v_shape), seq_dim=seq_dim, sink=sink_size,
                window=window_size, chunk=chunk_size, dtype=dtype, device=device,
            )
        except RuntimeError as exc:
            raise RuntimeError(f"{exc} (pass device='cpu' on a CPU-only machine)") from None
        except ValueError as exc:  # the ring's names: say which of this constructor's they are
            raise ValueError(f"{exc} (the ring's chunk, window and sink are chunk_size={chunk_size}, "
                             f"window_size={window_size} and sink_size={sink_size} here)") from None
        self.k_shape = tuple(self._ring.k_shape)
        self.v_shape = tuple(self._ring.v_shape)
        self.seq_dim = self._ring.seq_dim
        self.chunk_size = chunk_size
        self.window_size = window_size
        self.sink_size = sink_size
        self.device = self._ring.device
        self.dtype = dtype
        self._reopened = False  # the open chunk is a repeat of the committed one
        # flashdreams' KV-cache-relative RoPE (:mod:`.cache_relative_rope`): raw keys, rotated by index on read
        self.relative_rope_freqs = None if relative_rope_freqs is None else check_relative_freqs(
            relative_rope_freqs, sink_size + window_size, self.k_shape[-1]).to(self.device)
        self.interleaved = bool(interleaved)

    @classmethod
    def from_tensor(cls, k: Tensor, v: Tensor, seq_dim: int) -> CircularBlockKVCache:
        """A single-chunk cache holding ``k`` / ``v``, left open on chunk 0 (as flashdreams does)."""
        n = k.shape[seq_dim]
        cache = cls(k.shape, v.shape, seq_dim, chunk_size=n, window_size=n, device=k.device, dtype=k.dtype)
        cache.before_update(0)
        cache.update(k, v)
        cache.after_update(0)
        cache.before_update(0)
        return cache

    @property
    def ring(self) -> RingCache:
        """The underlying ring cache."""
        return self._ring

    # --------------------------------------------------------- lifecycle
    def before_update(self, chunk_idx: int) -> None:
        """Reserve the chunk's slots: ``chunk_idx`` is the next chunk or the last one again."""
        try:
            advance = self._ring.check_begin(chunk_idx)
            self._ring.begin_chunk(chunk_idx)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise _as_original(exc) from None
        self._reopened = not advance

    def update(self, k: Tensor, v: Tensor) -> None:
        """Write the chunk's K/V into its slots (any number of times per chunk); K/V of another
        floating dtype or device are converted, as the original's slice assignment does."""
        k, v = (self._convert(x) for x in (k, v))
        try:
            self._ring.write(k, v)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise _as_original(exc) from None

    def _convert(self, x: Tensor) -> Tensor:
        if isinstance(x, Tensor) and x.is_floating_point() and x.layout == torch.strided and x.device.type != "meta" and (
                x.dtype != self.dtype or x.device != self.device):
            return x.to(device=self.device, dtype=self.dtype)
        return x

    def after_update(self, chunk_idx: int) -> None:
        """Commit the chunk."""
        try:
            self._ring.commit_chunk(chunk_idx)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise _as_original(exc) from None

    def reset(self) -> None:
        self._ring.reset()

    # ----------------------------------------------------------- reading
    def cached_k(self) -> Tensor:
        """Keys of the occupied slots in physical order (valid prefix while filling). With
        ``relative_rope_freqs``: a copy, slot ``s`` pre-rotated by ``freqs[rank(s)] - freqs[s]``
        (:mod:`.cache_relative_rope`), so that flashdreams' rotation by index yields its rank's."""
        n = self._ring.num_valid
        keys = self._ring.keys().narrow(self.seq_dim, 0, n)
        if self.relative_rope_freqs is None:
            return keys
        f = self.relative_rope_freqs
        ranks = slot_ranks(self._ring.slot_positions[0, 0, :n])
        delta = f.index_select(0, ranks) - f[:n]  # [n, 1, 1, D]
        kt = keys.movedim(self.seq_dim, -3)  # [..., n, H, D]
        return rotate_full_width(kt, delta, self.interleaved).movedim(-3, self.seq_dim)

    def cached_v(self) -> Tensor:
        """Values of the occupied slots in physical order (valid prefix while filling)."""
        return self._ring.values().narrow(self.seq_dim, 0, self._ring.num_valid)

    @property
    def size(self) -> int:
        """Occupied slots visible to attention."""
        return self._ring.num_valid

    @property
    def write_end(self) -> int:
        """Right edge of the open chunk in the chronological layout (see module notes)."""
        chunk = self._require_open("write_end")
        if self.relative_rope_freqs is not None:  # the current chunk's ranks end at size (cache-relative RoPE)
            return self.size
        if self._ring.end > self._ring.layout.capacity:
            slots = self._ring.write_slots[0, 0].tolist()
            raise RuntimeError(
                f"write_end is undefined on the ring after the first eviction: chunk {chunk} "
                f"occupies slots {slots}, not [size - chunk_size, size). For flashdreams' "
                f"KV-cache-relative RoPE (apply_rope_before_kvcache=False) build the drop-in with "
                f"relative_rope_freqs=rope.shift_t(0), interleaved=True: write_end is then size and "
                f"cached_k() is rotated to match"
            )
        return self.size

    def is_steady_state(self) -> bool:
        """True when the open chunk is written into a full cache (it evicts or evicted)."""
        chunk = self._require_open("is_steady_state()")
        L = self._ring.layout
        committed_end = self._ring.end if self._reopened else L.chunk_start(chunk)
        is_full = L.num_valid(committed_end) == L.capacity
        overlaps_sink = L.sink > 0 and L.chunk_start(chunk) < L.sink
        return is_full and not overlaps_sink

    def _require_open(self, what: str) -> int:
        chunk = self._ring.open_chunk
        if chunk is None:
            raise RuntimeError(f"{what} needs an open chunk: call before_update(chunk_idx) first")
        return chunk

    def __repr__(self) -> str:
        return f"CircularBlockKVCache({self._ring!r})"
