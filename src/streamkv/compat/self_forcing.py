"""The Self-Forcing family's per-block KV cache dicts, on the ring.

Self-Forcing, CausVid and LongLive 1 keep, per transformer block, a dict ``{"k": [B, L, H, D],
"v": [B, L, H, D], "global_end_index": long[1], "local_end_index": long[1]}`` (the indices on the
device). ``CausalWanSelfAttention.forward`` reads both indices with ``.item()`` (a host sync per
layer and pass), rolls the window with a ``.clone()`` when a new chunk does not fit (only with a
local window, ``local_attn_size != -1``; the released checkpoint has none and fails on overflow),
writes the rotated keys and the values at ``[local_start, local_end)``, attends over
``k[:, max(0, local_end - max_attention_size):local_end]``, and fills both indices.

:class:`SelfForcingKVCache` is such a dict backed by the ring
(:class:`~streamkv.compat.sglang.RingCausalSelfAttentionKVCache`, whose semantics are the same
for this path), plus one method, :meth:`~SelfForcingKVCache.update`, that does the attention
module's cache work. Swapping it in takes three edits::

    # 1. the pipeline's _initialize_kv_cache: instead of the list of dicts
    self.kv_cache1 = self_forcing_kv_caches(
        self.num_transformer_blocks, batch_size, kv_cache_size, num_heads=12, head_dim=128,
        sink_tokens=sink_size * frame_seqlen, attention_tokens=max_attention_size,
        rolling=local_attn_size != -1, dtype=dtype, device=device)

    # 2. CausalWanSelfAttention.forward, the kv_cache branch, after RoPE: instead of the
    #    .item() reads, the roll, the slice writes, the index fills and the sliced read
    k_att, v_att = kv_cache.update(roped_key, v, current_start)
    x = attention(roped_query, k_att, v_att)

    # 3. nothing: the pipeline's reset, kv_cache[i]["global_end_index"] = torch.tensor([0], ...),
    #    still works (assigning 0 to an index resets the block's cache)

Exact for what that code path computes (unmasked attention over keys rotated before the
write, chunks that continue the stream or repeat the last one); the rows of ``k_att`` are in
the ring's physical order. Differences from the plain dicts:

- ``cache["k"]``/``cache["v"]`` are the ring's buffers (not in position order once it wraps).
- Assigning ``0`` to either index resets the whole block (both indices; the K/V are kept, as
  Self-Forcing keeps them); another value, or assigning ``"k"``/``"v"``, raises (the ring's
  position cannot be set from outside). Reading the assigned tensor's value is a host sync, at
  reset time only. The dict keeps its own index tensors.
- With ``rolling=False``, a chunk that does not fit raises ``RuntimeError`` naming the sizes
  (Self-Forcing fails with a zero-length slice error there).
- Chunks that skip or straddle positions, and rewrites of older chunks, are refused
  (``ValueError``; see :mod:`streamkv.compat.sglang`).
- ``pages=`` (not Self-Forcing's): the ring keeps its rows in pages, and :func:`fork_self_forcing_caches`
  continues one prefix in several branches (the pages shared copy-on-write; a fork closes the
  last chunk, so branches go on at the next one). Without it a fork is refused (the ring lives in
  ``"k"``/``"v"``).

Why this long: every difference from the original dicts is listed here, where a user of them looks.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import Tensor

from ..storage import check_int
from .sglang import RingCausalSelfAttentionKVCache

__all__ = ["SelfForcingKVCache", "fork_self_forcing_caches", "self_forcing_kv_caches"]

_KEYS = ("k", "v", "global_end_index", "local_end_index")


class SelfForcingKVCache(Mapping):
    """One block's ``{"k", "v", "global_end_index", "local_end_index"}`` on the ring.

    Args:
        batch, cache_size, num_heads, head_dim: the buffers are ``[batch, cache_size, num_heads,
            head_dim]`` (values: ``v_head_dim``, default ``head_dim``), zeros, allocated once.
        sink_tokens: tokens at the stream's start never evicted (``sink_size * frame_seqlen``).
        attention_tokens: ``max_attention_size``, the most recent tokens attended to (default
            ``cache_size``).
        rolling: evict the oldest window tokens when a chunk does not fit (Self-Forcing's
            ``local_attn_size != -1``); False: a chunk that does not fit raises.
        dtype, device: of the buffers (the index tensors are int64 on ``device``).
        pages: the ring's rows in pages of its own (``True`` or ``{"spare": N, ...}``), so that
            :meth:`fork` (and :func:`fork_self_forcing_caches`) can branch the stream: ``"k"``/``"v"``
            are then zero-stride placeholders and ``update`` returns a copy of the rows to attend to.
        quant: quantised storage of the ring (:class:`~streamkv.quant.KVQuant` or a format
            name): ``"k"``/``"v"`` are then zero-stride placeholders and ``update`` returns a
            dequantised copy of the rows to attend to (see :mod:`streamkv.compat.sglang`).
    """

    def __init__(self, batch: int, cache_size: int, num_heads: int, head_dim: int, *, sink_tokens: int = 0,
                 attention_tokens: int | None = None, rolling: bool = True, v_head_dim: int | None = None,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu", quant: object = None,
                 pages: object = None) -> None:
        shape = tuple(check_int(n, x, 1) for n, x in (("batch", batch), ("cache_size", cache_size),
                                                       ("num_heads", num_heads), ("head_dim", head_dim)))
        dv = head_dim if v_head_dim is None else check_int("v_head_dim", v_head_dim, 1)
        window = cache_size if attention_tokens is None else check_int("attention_tokens", attention_tokens, 1)
        if not isinstance(rolling, bool):
            raise TypeError(f"rolling must be a bool, got {type(rolling).__name__} {rolling!r}")
        self._rolling = rolling
        # quantised storage: the ring allocates codes; "k"/"v" are zero-stride placeholders (no memory)
        make = (lambda sh: torch.zeros(sh, dtype=dtype, device=device)) if quant is None and pages is None else (
            lambda sh: torch.zeros((), dtype=dtype, device=device).expand(sh))
        self._cache = RingCausalSelfAttentionKVCache(
            make(shape), make((*shape[:3], dv)),
            torch.zeros(1, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long, device=device), 0, 0,
            cache_size=cache_size, sink_tokens=check_int("sink_tokens", sink_tokens, 0), attention_window_size=window,
            quant=quant, pages=pages,
        )

    @property
    def ring_cache(self) -> RingCausalSelfAttentionKVCache:
        """The sglang-interface cache underneath (its ``ring`` is the :class:`~streamkv.RingCache`)."""
        return self._cache

    # ------------------------------------------------------------ the dict
    def __getitem__(self, key: str) -> Tensor:
        c = self._cache
        if key == "k":
            return c.k
        if key == "v":
            return c.v
        if key == "global_end_index":
            return c.global_end_index
        if key == "local_end_index":
            return c.local_end_index
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(_KEYS)

    def __len__(self) -> int:
        return len(_KEYS)

    def __setitem__(self, key: str, value: object) -> None:
        """``cache["global_end_index"] = torch.tensor([0])`` (or the local one) resets the block."""
        if key not in ("global_end_index", "local_end_index"):
            raise TypeError(f"cache[{key!r}] cannot be assigned: the ring owns its buffers and cursors (only an index "
                            f"set to 0, the reset, can be assigned)")
        if (not isinstance(value, Tensor) or value.numel() != 1 or value.dtype.is_floating_point
                or value.dtype.is_complex or value.dtype == torch.bool):
            raise TypeError(f"cache[{key!r}] must be assigned a 1-element integer tensor, got {value!r}")
        got = int(value.item())  # a reset: the only host read of a device value
        if got != 0:
            raise ValueError(f"cache[{key!r}] can only be reset to 0, got {got}: the ring's position cannot be set")
        self.reset()

    def reset(self) -> None:
        """Forget the stream: both indices 0 (K/V kept; nothing stale is ever read)."""
        self._cache.reset_indices()

    def fork(self, n: int = 1) -> list[SelfForcingKVCache]:
        """``n`` dicts continuing this block's stream (built with ``pages=``): the ring's pages shared
        copy-on-write (:meth:`~streamkv.compat.sglang.RingCausalSelfAttentionKVCache.fork`: the last
        chunk is closed first; each continues at the next one). Refused (``ValueError``, nothing
        changes) without pages or before the first chunk."""
        out = []
        for ring in self._cache.fork(n):
            branch = copy.copy(self)
            branch._cache = ring
            out.append(branch)
        return out

    def release(self) -> None:
        """Give the block's pages back (a paged cache); every later update is refused."""
        self._cache.release()

    # ------------------------------------------------------------ the attention module's work
    def update(self, key: Tensor, value: Tensor, current_start: int) -> tuple[Tensor, Tensor]:
        """Write the chunk's rotated keys and values (``[B, n, H, D]``, positions
        ``[current_start, current_start + n)``: the next chunk, or the last one again) and return
        the keys and values to attend to (``[B, T, H, D]``, views of the ring or a copy; the
        rows in physical order). Mutates the cache; refused calls change nothing."""
        c = self._cache
        n = key.shape[1] if isinstance(key, Tensor) and key.dim() == 4 else 0
        start = check_int("current_start", current_start, 0)
        G, E = c.global_end_index_int, c.local_end_index_int
        if not self._rolling and n and start + n > G and E + start + n - G > c.cache_size:
            raise RuntimeError(
                f"cache full: the chunk [{start}, {start + n}) needs {E + start + n - G} slots of {c.cache_size} and "
                f"this cache does not evict (rolling=False, Self-Forcing's local_attn_size=-1)"
            )
        view = c.update_and_get_attention_kv(key=key, value=value, current_chunk_start=start,
                                             debug_name="Self-Forcing KV cache")
        return view.k, view.v

    def __repr__(self) -> str:
        return f"SelfForcingKVCache(rolling={self._rolling}, {self._cache!r})"


def self_forcing_kv_caches(num_blocks: int, batch: int, cache_size: int, num_heads: int, head_dim: int, *,
                           sink_tokens: int = 0, attention_tokens: int | None = None, rolling: bool = True,
                           v_head_dim: int | None = None, dtype: torch.dtype = torch.bfloat16,
                           device: torch.device | str = "cpu", quant: object = None,
                           pages: object = None) -> list[SelfForcingKVCache]:
    """One :class:`SelfForcingKVCache` per transformer block (the list Self-Forcing's pipeline keeps
    as ``kv_cache1``); the arguments are each block's (see the class)."""
    blocks = check_int("num_blocks", num_blocks, 1)
    return [SelfForcingKVCache(batch, cache_size, num_heads, head_dim, sink_tokens=sink_tokens,
                               attention_tokens=attention_tokens, rolling=rolling, v_head_dim=v_head_dim,
                               dtype=dtype, device=device, quant=quant, pages=pages) for _ in range(blocks)]


def fork_self_forcing_caches(caches: Sequence[SelfForcingKVCache], n: int = 1) -> list[list[SelfForcingKVCache]]:
    """``n`` copies of the pipeline's ``kv_cache1`` list that continue its stream (every block
    forked, :meth:`SelfForcingKVCache.fork`): same prefix, ``n`` continuations. Every block is
    checked before any forks: a refused call changes nothing."""
    blocks = list(caches)
    if not blocks or not all(isinstance(c, SelfForcingKVCache) for c in blocks):
        raise TypeError("caches must be a non-empty list of SelfForcingKVCache (self_forcing_kv_caches(...))")
    for c in blocks:
        c.ring_cache.check_fork(n)
    forked = [c.fork(n) for c in blocks]
    return [[f[i] for f in forked] for i in range(n)]
