"""``RingCausalSelfAttentionKVCache``: a drop-in for sglang 0.5.23's ``CausalSelfAttentionKVCache``
(``sglang/multimodal_gen/runtime/layers/kvcache/causal_attention_cache.py``), on the ring.

sglang's causal Wan, LongLive 2 and LingBot-World models hold one such object per transformer
block and call ``update_and_get_attention_kv(key=, value=, current_chunk_start=, ...)``, then
attend over the returned view without a mask (keys are rotated before the call). This class
has the same constructor, fields, methods and view type (:class:`CausalAttentionKVView`), but
keeps the tokens in a :class:`~streamkv.RingCache` over the same ``k``/``v`` memory: a new
chunk overwrites the oldest window slots in place, nothing retained is cloned or shifted
(except at a re-layout, below), and the per-layer path reads no device value (the cursors are host ints, the device index
tensors are only filled). To use it in sglang, replace the class where the stage builds it::

    import sglang.multimodal_gen.runtime.pipelines_core.stages.causal_denoising as stage
    from streamkv.compat.sglang import CausalSelfAttentionKVCache
    stage.CausalSelfAttentionKVCache = CausalSelfAttentionKVCache   # before the first request

Exactness. For every call, :mod:`.sglang_slots` computes (host ints) which position each slot of
sglang's buffer would hold and which slots sglang's view would concatenate; this class returns
the ring rows holding the same positions (with the same multiplicity). Attention over the view
therefore equals attention over sglang's view to rounding **for unmasked attention with RoPE
applied before the call** (what sglang's models do). Every mode sglang has is covered this way:
sinks, ``attention_window_size`` below the buffer, global sinks, the pinned multi-shot sink,
``allow_growth``, ``recent_window_tokens``, head slices (``cache_head_start``).

sglang's buffer is always ``[frozen slots | a first-in-first-out window]``; a ring holds the
same when its sinks are the frozen slots. The frozen slots change when a pinned scene-cut chunk
slides down next to the global sinks (LongLive 2's multi-shot sink: sglang then keeps it), when
a new pin or ``reset_pinned_sink()`` releases it, when ``sink_tokens`` / ``global_sink_tokens``
are set, when a chunk longer than ``cache_size`` minus the frozen slots overwrites some of them,
and at growth. At the first
chunk after such a change the ring is **re-laid out**: a new ring over the same memory whose
slot ``i`` holds what sglang's slot ``i`` holds (positions are renumbered in that order,
:class:`~.sglang_slots.VirtualMap`); the rows not already there are gathered and copied once
(transient: those rows, K and V), the ring's metadata is advanced by empty spans, and from then
on nothing moves again. Before the first eviction (and for the first call) nothing is copied.
LongLive 2 with scene cuts re-lays out about twice per cut; sglang copies its window every chunk.

Differences, all deliberate:

- The view's rows are in the ring's physical order, not sglang's (a permutation of the same K/V
  rows, applied to K and V alike). ``view.k``/``view.v`` are one zero-copy slice of the buffer
  when the selected rows are contiguous in it (always when the view is the whole buffer, e.g.
  ``attention_window_size == cache_size``), else a ``torch.cat`` of a few slices (a copy, as
  sglang's own view is with sinks). The view's four index fields are the ones sglang would
  return (they describe sglang's layout, not these buffers).
- ``k``/``v`` are the physical buffers ``[B, cache_size, H, D]``: rows are not in position
  order once the ring has wrapped. They, ``cache_size``, ``pinned_start``/``pinned_len`` (set by
  ``pin_current_chunk`` / ``reset_pinned_sink``) and the index fields are read-only.
- Head slices (``cache_head_start`` with fewer heads than the cache) and ``cache_size <
  k.shape[1]`` with ``B > 1``: the slice of ``k``/``v`` is not contiguous, and the core's
  storage takes only buffers it can prove non-overlapping, so the ring keeps contiguous buffers
  of its own ``[B, cache_size, h, D]`` (``h / H`` more memory) and ``k``/``v`` are not written.
  One cache serves one head slice until ``reset_indices()`` (see refusals).
- ``global_end_index_int`` / ``local_end_index_int`` are always host ints (never None): if the
  constructor gets None, the two device tensors are read once there (the only host sync).
- Inputs of another floating dtype are cast to the cache dtype (as sglang's slice assignment
  does); inputs that require grad under grad mode are refused (sglang writes them and detaches
  its buffer on the next call).
- Errors are raised before anything changes (sglang rolls and writes before some of its own
  checks, e.g. ``recent_window_tokens < 0``); every input sglang refuses is refused.
- ``reset_indices()`` keeps stale K/V like sglang; the ring is rebuilt by the next call.
- ``max_chunk_tokens`` (keyword only, not sglang's) bounds the chunk length (default: the
  ring's window); the ring's per-chunk slot plan is that long.
- ``quant`` (keyword only, not sglang's): the ring stores codes (:class:`~streamkv.quant.KVQuant`,
  e.g. ``"int8"``; sinks and the open chunk in full precision, every chunk quantised once when
  the next one advances). ``k``/``v`` are then not written (they only give the shape: pass
  zero-stride tensors, ``torch.zeros(()).expand(B, L, H, D)``, to allocate nothing) and the view
  is a dequantised copy of its rows in the cache dtype (sglang's models attend over a dense
  view; :func:`streamkv.attention.attend` on ``ring.read(0)`` reads the codes block by block
  instead). A re-layout of a quantised ring that holds tokens (pinned multi-shot sink, sink
  changes, growth) is refused. sglang's own ``--kv-cache-quant`` (``QVGPackedCausalKVCache``)
  packs chunks with PRQ k-means codes (int4 / int2) in a Python list of segments, keeps the
  newest completed chunk bf16 and the first sink chunk bf16 on request, and also rebuilds a
  dense window per call; it refuses pinned sinks and runs LingBot only. This ring keeps
  fixed addresses and device write plans (graph-safe writes), int8 / fp8 / int4 / int2 with
  per-token scales (no k-means), and serves every mode above but re-layouts.

Branches (``pages=``, keyword only, not sglang's): the ring keeps its rows in pages of its own
(``k``/``v`` then only give the shape, as with ``quant``, and every view is a gathered copy of its
rows) and :meth:`~RingCausalSelfAttentionKVCache.fork` makes caches that continue the stream
sharing those pages copy-on-write (same prefix, several continuations). Without ``pages=`` a fork
is refused: the ring lives in the buffers sglang allocated and reads, which branches cannot share.
A paged ring holding tokens is not re-laid out (as a quantised one).

Refusals (``ValueError`` naming the constraint and the values; the cache is left unchanged),
where sglang would go on:

1. A cache that does not start empty (``global_end_index`` / ``local_end_index`` not 0).
2. A chunk that starts past ``global_end_index`` (sglang would attend over slots it never
   wrote) or straddles it (``start < global_end < start + n``).
3. A rewrite (``start + n <= global_end``) of anything but the last chunk, whole (the ring
   rewrites only its open span).
4. A view that would read slots sglang never wrote (global sinks not yet filled while
   ``attention_window_size`` is below the buffer): sglang returns stale or zero rows there.
5. Different head slices between two resets (sglang would roll only the slice it is given,
   leaving the other heads' slots stale): one cache serves one slice.
6. A chunk longer than ``max_chunk_tokens`` when it is given.

A ``RuntimeError`` from the re-layout planner ("the ring cannot hold the same tokens") would
mean sglang's buffer is not ``[frozen | window]``; no sequence of calls the tests drive reaches it.

Graph safety: the write is an ``index_copy_`` through the ring's device plan; a call's host
work (planning, begin/commit of the span, the view slices) is per call, so a CUDA graph must
not capture this call (sglang's cache is not graph-safe either). A re-layout allocates the
ring's small metadata anew, and growth allocates new buffers (as sglang does).

This module does not import sglang.

Why one module: the class mirrors one sglang dataclass field for field and method for method,
and its docstring carries the list of differences and refusals a user of the original needs in
one place; the host arithmetic and the tensor re-layout already live in ``sglang_slots`` and
``sglang_ring``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..caches import RingCache
from ..layout import CacheLayout
from ..storage import check_int
from .sglang_ring import relayout, ring_slices
from .sglang_slots import (
    SGLangState, Update, VirtualMap, plan_update, position_intervals, ring_holds, ring_rows, slot_positions,
)

__all__ = ["CausalAttentionKVView", "RingCausalSelfAttentionKVCache", "CausalSelfAttentionKVCache"]


@dataclass(slots=True)
class CausalAttentionKVView:
    """What a call returns: ``k`` ``[B, T, h, Dk]`` and ``v`` ``[B, T, h, Dv]`` (the cache
    dtype; ``h`` the heads written), views of the cache or a concatenated copy; the indices
    are sglang's (its chunk slots, its occupied slots, its global end)."""

    k: Tensor
    v: Tensor
    local_start_index: int
    local_end_index: int
    visible_local_end: int
    visible_global_end: int


def _nonneg(name: str, value: object) -> int:
    return check_int(name, value, 0)


class RingCausalSelfAttentionKVCache:
    """One transformer block's causal self-attention cache: sglang's interface over a ring.

    Args (as sglang's dataclass):
        k, v: ``[B, L, H, Dk]`` / ``[B, L, H, Dv]``, one floating dtype and device: the memory
            the ring uses (kept, not copied; detached if they require grad). ``L >= cache_size``.
        global_end_index, local_end_index: 1-element integer device tensors, filled (never read)
            after each call; they must hold 0.
        global_end_index_int, local_end_index_int: host mirrors (0); None: read the tensors once.
        cache_size: slots used (0: ``L``); sink_tokens, global_sink_tokens, attention_window_size
            (0: ``cache_size``), allow_growth, pinned_start, pinned_len: sglang's meanings.
        max_chunk_tokens: (keyword, not sglang's) the longest chunk a call may write; default the
            ring's window. A smaller value makes each advance's slot plan that much shorter.
    """

    def __init__(self, k: Tensor, v: Tensor, global_end_index: Tensor, local_end_index: Tensor,
                 global_end_index_int: int | None = None, local_end_index_int: int | None = None,
                 cache_size: int = 0, sink_tokens: int = 0, attention_window_size: int = 0,
                 allow_growth: bool = False, global_sink_tokens: int = 0, pinned_start: int = -1,
                 pinned_len: int = 0, *, max_chunk_tokens: int | None = None, quant: object = None,
                 pages: object = None) -> None:
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, Tensor) or t.dim() != 4 or t.layout != torch.strided:
                raise TypeError(f"{name} must be a dense 4-D tensor [B, L, H, D], got {_desc(t)}")
        if k.shape[:3] != v.shape[:3] or k.dtype != v.dtype or k.device != v.device or not k.dtype.is_floating_point:
            raise ValueError(f"k and v must share [B, L, H], a floating dtype and a device, got {_desc(k)} and {_desc(v)}")
        for name, t in (("global_end_index", global_end_index), ("local_end_index", local_end_index)):
            if not isinstance(t, Tensor) or t.numel() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
                raise TypeError(f"{name} must be a 1-element integer tensor, got {_desc(t)}")
        size = _nonneg("cache_size", cache_size) or k.shape[1]
        if size > k.shape[1]:
            raise ValueError(f"cache_size ({size}) must be <= k.shape[1] ({k.shape[1]})")
        if global_end_index_int is None or local_end_index_int is None:  # construction only: one sync
            global_end_index_int, local_end_index_int = int(global_end_index.item()), int(local_end_index.item())
        if check_int("global_end_index_int", global_end_index_int) or check_int("local_end_index_int", local_end_index_int):
            raise ValueError(
                f"this cache starts empty: global_end_index={global_end_index_int}, local_end_index="
                f"{local_end_index_int} (call reset_indices() on sglang's cache, or build this one with zeros)"
            )
        self._k, self._v = k.detach(), v.detach()
        self._gidx, self._lidx = global_end_index, local_end_index
        window = _nonneg("attention_window_size", attention_window_size) or size
        self._state = SGLangState(0, 0, size, window, check_int("pinned_start", pinned_start),
                                  _nonneg("pinned_len", pinned_len))
        self.sink_tokens, self.global_sink_tokens, self.allow_growth = sink_tokens, global_sink_tokens, allow_growth
        self._max_chunk = None if max_chunk_tokens is None else check_int("max_chunk_tokens", max_chunk_tokens, 1)
        from ..quant import as_quant

        self._quant = as_quant(quant)  # quantised storage of the ring (streamkv.quant); None: dense
        from ..stores import as_pages

        self._pages = as_pages(pages)  # the ring's rows in pages of its own (fork); None: in k/v
        self._ring: RingCache | None = None  # built by the first call (it fixes the head slice)
        self._vmap = VirtualMap()  # the ring's numbering of sglang's positions
        self._heads: tuple[int, int] | None = None
        self._own: tuple[Tensor, Tensor] | None = None  # the ring's buffers when k/v cannot be used in place
        self._memo: tuple | None = None  # (call, ring, plan, rows) of the last rewrite

    # ------------------------------------------------------------ sglang's fields
    k = property(lambda self: self._k, doc="Physical key buffer ``[B, L, H, Dk]`` (ring order once wrapped).")
    v = property(lambda self: self._v, doc="Physical value buffer ``[B, L, H, Dv]``.")
    global_end_index = property(lambda self: self._gidx, doc="Device tensor: positions written (filled, never read).")
    local_end_index = property(lambda self: self._lidx, doc="Device tensor: sglang's occupied slots (filled).")
    global_end_index_int = property(lambda self: self._state.global_end, doc="Positions written (host int).")
    local_end_index_int = property(lambda self: self._state.local_end, doc="sglang's occupied slots (host int).")
    cache_size = property(lambda self: self._state.cache_size, doc="Slots (grows with allow_growth).")
    pinned_start = property(lambda self: self._state.pinned_start, doc="sglang slot of the pinned region, -1: none.")
    pinned_len = property(lambda self: self._state.pinned_len, doc="Tokens of the pinned region.")
    ring = property(lambda self: self._ring, doc="The :class:`~streamkv.RingCache` (None until the first call).")

    @property
    def num_cache_heads(self) -> int:
        return self._k.shape[2]

    @property
    def attention_window_size(self) -> int:
        return self._state.window

    @attention_window_size.setter
    def attention_window_size(self, value: int) -> None:
        self._state = replace(self._state, window=_nonneg("attention_window_size", value))

    @property
    def sink_tokens(self) -> int:
        return self._sink_tokens

    @sink_tokens.setter
    def sink_tokens(self, value: int) -> None:
        self._sink_tokens = _nonneg("sink_tokens", value)

    @property
    def global_sink_tokens(self) -> int:
        return self._global_sink_tokens

    @global_sink_tokens.setter
    def global_sink_tokens(self, value: int) -> None:
        self._global_sink_tokens = _nonneg("global_sink_tokens", value)

    @property
    def allow_growth(self) -> bool:
        return self._allow_growth

    @allow_growth.setter
    def allow_growth(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"allow_growth must be a bool, got {type(value).__name__} {value!r}")
        self._allow_growth = value

    # ------------------------------------------------------------ sglang's methods
    def reset_indices(self) -> None:
        """Forget the stream (host; fills the index tensors with 0). K/V are kept, as in sglang;
        the ring is rebuilt by the next call."""
        s = self._state
        self._state = SGLangState(0, 0, s.cache_size, s.window)
        self._gidx.zero_()
        self._lidx.zero_()
        self._ring, self._heads, self._vmap, self._memo = None, None, VirtualMap(), None

    def reset_pinned_sink(self) -> None:
        self._state = replace(self._state, pinned_start=-1, pinned_len=0)

    def pin_current_chunk(self, current_num_tokens: int) -> None:
        """Pin the last ``current_num_tokens`` written slots (the multi-shot sink; host only)."""
        m = check_int("current_num_tokens", current_num_tokens)
        if self._sink_tokens <= 0 or m <= 0:
            return self.reset_pinned_sink()
        s = self._state
        self._state = replace(s, pinned_start=s.local_end - m, pinned_len=min(self._sink_tokens, m))

    def can_direct_current_attention(self, num_new_tokens: int) -> bool:
        s = self._state
        return self._sink_tokens == 0 and s.cache_size == num_new_tokens and s.window == num_new_tokens

    def update_and_get_attention_kv(self, *, key: Tensor, value: Tensor, current_chunk_start: int,
                                    cache_head_start: int | None = None, recent_window_tokens: int | None = None,
                                    debug_name: str = "causal KV cache") -> CausalAttentionKVView:
        """Write the chunk's rotated keys and values (``[B, n, h, D]``, positions
        ``[current_chunk_start, + n)``; ``h`` the cache heads, or a slice of them starting at
        ``cache_head_start``) and return the rows sglang's view would return (see the module
        notes). Mutates the ring and the cursors; all checks come first."""
        n, h0, h = self._check_inputs(key, value, cache_head_start, debug_name)
        start = _nonneg("current_chunk_start", current_chunk_start)
        recent = None if recent_window_tokens is None else check_int("recent_window_tokens", recent_window_tokens)
        G = self._state.global_end
        if start > G or start < G < start + n:
            what = "starts past" if start > G else "straddles"
            raise ValueError(f"{debug_name}: the chunk [{start}, {start + n}) {what} global_end_index={G}: chunks must "
                             f"continue the stream at {G} or rewrite the last chunk")
        call = (self._state, start, n, self._sink_tokens, self._global_sink_tokens, self._allow_growth, recent)
        memo = self._memo
        if memo is not None and memo[0] == call and memo[1] is self._ring:  # the same rewrite again (a denoising step)
            upd, rows = memo[2], memo[3]
            self._ring.write(key.to(self._k.dtype), value.to(self._v.dtype), layer=0)
            k, v = self._slices(rows)
            return CausalAttentionKVView(k, v, upd.local_start, upd.local_start + n, upd.state.local_end,
                                         upd.state.global_end)
        upd = plan_update(self._state, start=start, n=n, sink_tokens=self._sink_tokens,
                          global_sink_tokens=self._global_sink_tokens, allow_growth=self._allow_growth,
                          recent=recent, name=debug_name)
        relayout = self._plan_ring(upd, n, debug_name) if upd.advance else None
        own = "a quantised ring (quant=)" if self._quant is not None else "a paged ring (pages=)"
        if relayout is not None and (self._quant is not None or self._pages is not None) and self._ring is not None and self._ring.end:
            raise ValueError(
                f"{debug_name}: this chunk needs the ring re-laid out (a pinned multi-shot sink, a change of the "
                f"sinks, growth, or a chunk over the frozen slots), and {own} is not re-laid out "
                f"once it holds tokens (its codes, pages and full-precision rows would have to be renumbered); use a "
                f"dense ring in k/v for these modes"
            )
        if not upd.advance:
            self._check_rewrite(upd, start, n, debug_name)
        self._check_view(upd, debug_name)
        # --- nothing has changed so far; from here on nothing can fail
        if upd.grown:
            self._grow(upd.state.cache_size)
        if relayout is not None:
            self._relayout(*relayout, (h0, h), upd.state.cache_size)
        ring = self._ring
        if upd.advance:
            if ring.is_open:
                ring.commit()
            ring.begin_tokens(n)
        ring.write(key.to(self._k.dtype), value.to(self._v.dtype), layer=0)
        old, self._state = self._state, upd.state
        if upd.state.global_end != old.global_end:
            self._gidx.fill_(upd.state.global_end)
        if upd.state.local_end != old.local_end:
            self._lidx.fill_(upd.state.local_end)
        rows = self._rows(upd.view)
        # a rewrite changes nothing but K/V: the next identical call may reuse this plan
        self._memo = None if upd.advance else (call, ring, upd, rows)
        k, v = self._slices(rows)
        return CausalAttentionKVView(k, v, upd.local_start, upd.local_start + n, upd.state.local_end, upd.state.global_end)

    # ------------------------------------------------------------ branches (not sglang's)
    def check_fork(self, n: int) -> int:
        """Raise as :meth:`fork` would (nothing changes); else ``n``."""
        n = check_int("n", n, 1)
        if self._pages is None:
            raise ValueError(
                f"fork({n}): this cache's ring lives in the k/v buffers its caller allocated and reads (sglang's "
                f"pipeline keeps them as the cache); branches sharing them copy-on-write need the ring's rows in "
                f"pages of its own: build it with pages=True (or {{'spare': N}}): k/v then only give the shape, "
                f"as with quant=, and each view is a copy of its rows")
        if self._ring is None or not self._ring.end:
            raise ValueError(f"fork({n}): this cache holds no tokens yet (nothing to share): build {n} caches")
        self._ring.branches.check_branchable(f"fork({n})", open_span_ok=True)  # fork() closes the open chunk first
        return n

    def fork(self, n: int = 1) -> list[RingCausalSelfAttentionKVCache]:
        """``n`` caches continuing this one's stream (built with ``pages=``): the ring's pages shared
        copy-on-write, the cursors and the index tensors copied. The last chunk is closed first (as
        the next chunk's call would close it): neither this cache nor a branch may rewrite it
        afterwards; each continues at ``global_end_index``. Refused (``ValueError``, nothing
        changes) without pages, before the first call, or when the ring's pool refuses."""
        n = self.check_fork(n)
        if self._ring.is_open:
            self._ring.commit()
        self._memo = None  # a memoised rewrite of the (now closed) last chunk
        out = []
        for ring in self._ring.fork(n):
            branch = copy.copy(self)
            branch._ring, branch._memo = ring, None
            branch._gidx, branch._lidx = self._gidx.clone(), self._lidx.clone()
            out.append(branch)
        return out

    def release(self) -> None:
        """Give the ring's pages back (a paged cache); every later call is refused."""
        if self._pages is None or self._ring is None:
            raise ValueError("release(): only a paged cache (pages=) that holds a ring gives pages back")
        self._ring.release()

    # ------------------------------------------------------------ checks and plans
    def _check_inputs(self, key: Tensor, value: Tensor, head_start: int | None, name: str) -> tuple[int, int, int]:
        B, _, H, Dk = self._k.shape
        for what, t, D in (("key", key, Dk), ("value", value, self._v.shape[3])):
            if not isinstance(t, Tensor) or t.dim() != 4 or t.layout != torch.strided:
                raise TypeError(f"{name}: {what} must be a dense 4-D tensor [B, n, h, D], got {_desc(t)}")
            if t.shape[0] != B or t.shape[3] != D or not t.dtype.is_floating_point:
                raise ValueError(f"{name}: {what} must be [{B}, n, h, {D}] floating, got {_desc(t)}")
            if t.device != self._k.device:
                raise ValueError(f"{name}: {what} must be on the cache device {self._k.device}, got {t.device}")
            if t.requires_grad and torch.is_grad_enabled():
                raise ValueError(f"{name}: {what} requires grad: pass {what}.detach() or run under torch.no_grad()")
            if self._shares_memory(t):
                raise ValueError(f"{name}: {what} shares memory with the cache buffers: pass a tensor of its own")
        n, h = key.shape[1], key.shape[2]
        if value.shape[1:3] != key.shape[1:3] or n < 1:
            raise ValueError(f"{name}: key and value must have the same n >= 1 tokens and heads, got {_desc(key)} and {_desc(value)}")
        if any(b.is_inference() for b in (self._k, self._v, *(self._own or ()))) and not torch.is_inference_mode_enabled():
            raise RuntimeError(f"{name}: the cache buffers are inference tensors (made under torch.inference_mode()): "
                               f"call under torch.inference_mode()")
        h0 = 0
        if h != H:
            if head_start is None:
                raise ValueError(f"{name} requires cache_head_start when cache heads ({H}) differ from input heads ({h}).")
            h0 = _nonneg("cache_head_start", head_start)
            if h0 + h > H:
                raise ValueError(f"{name}: heads [{h0}, {h0 + h}) pass the cache's {H} heads")
        if self._heads is not None and self._heads != (h0, h):
            raise ValueError(f"{name}: this cache serves heads [{self._heads[0]}, {sum(self._heads)}) until "
                             f"reset_indices(); got [{h0}, {h0 + h}) (one cache per head slice)")
        return n, h0, h

    def _shares_memory(self, t: Tensor) -> bool:
        """``t`` lies in the memory of ``k``/``v`` or of the ring's own buffers (head slices), which
        the ring's write would refuse only after the ring advanced."""
        if t.device.type == "meta":
            return False
        bufs = (self._k, self._v, *(self._own or ()))
        return t.untyped_storage().data_ptr() in {b.untyped_storage().data_ptr() for b in bufs}

    def _plan_ring(self, upd: Update, n: int, name: str) -> tuple[int, VirtualMap] | None:
        """None when the ring's plain advance ends holding exactly sglang's tokens; else the
        ``(sink, numbering)`` of the re-layout that makes it so (see :meth:`_relayout`)."""
        st, pre, ring = upd.state, self._state, self._ring
        if self._max_chunk is not None and n > self._max_chunk:
            raise ValueError(f"{name}: the chunk has {n} tokens, more than max_chunk_tokens={self._max_chunk}")
        if (ring is not None and not upd.grown and n <= ring.layout.chunk
                and ring_holds(ring.layout, ring.end + n, self._vmap, st)):
            return None
        vmap, size = VirtualMap.of_buffer(pre.runs, pre.global_end, pre.local_end), st.cache_size
        sink = upd.roll_sink  # sglang's frozen slots; fewer serve while nothing is evicted
        for s in dict.fromkeys((sink, max(0, min(sink, size - n)), 0)):
            if n <= size - s and ring_holds(CacheLayout(s, size - s, n), pre.local_end + n, vmap, st):
                return s, vmap
        pieces = [(p, m) for _, p, m in st.runs]
        held = position_intervals(pieces) or f"{pieces} (unwritten or repeated positions)"
        raise RuntimeError(
            f"{name}: after this chunk ({n} tokens) sglang's buffer would hold positions {held} in its "
            f"{st.cache_size} slots, {sink} of them frozen: that is not [frozen slots | a window of consecutive "
            f"positions] (the chunk must fit in cache_size - frozen = {st.cache_size - sink} and leave the frozen "
            f"slots alone), so the ring cannot hold the same tokens"
        )

    def _check_rewrite(self, upd: Update, start: int, n: int, name: str) -> None:
        ring = self._ring
        held = slot_positions(upd.state.runs, upd.local_start, upd.local_start + n)
        virtual = self._vmap.virtual(start, n) if ring is not None else []
        if ring is None or held != [(start, n)] or len(virtual) != 1 or ring.open_span != virtual[0]:
            raise ValueError(f"{name}: a rewrite must be the last chunk, whole: got [{start}, {start + n}), the last "
                             f"chunk ended at global_end_index={upd.state.global_end}")

    def _check_view(self, upd: Update, name: str) -> None:
        E = upd.state.local_end
        past = [(lo, hi) for lo, hi in upd.view if lo < hi and hi > E]
        unwritten = [p for lo, hi in upd.view for p, _ in slot_positions(upd.state.runs, lo, hi) if p < 0]
        if past or unwritten:
            raise ValueError(f"{name}: sglang's view would read slots {upd.view} of which some were never written "
                             f"(its buffer holds {E} tokens; e.g. global sinks ({self._global_sink_tokens}) not yet "
                             f"filled): the ring cannot return the same rows")

    # ------------------------------------------------------------ ring upkeep
    def _grow(self, size: int) -> None:
        """sglang's growth: new zeroed buffers of ``size`` slots holding the old ones (the slots keep
        their indices; the re-layout that follows orders them)."""
        old = self._state.cache_size
        for name in ("_k", "_v"):
            buf = getattr(self, name)
            new = buf.new_zeros((buf.shape[0], size, *buf.shape[2:]))
            new[:, :old].copy_(buf[:, :old])
            setattr(self, name, new)

    def _relayout(self, sink: int, vmap: VirtualMap, heads: tuple[int, int], size: int) -> None:
        """Re-lay out the ring (:func:`.sglang_ring.relayout`) over the cache's memory."""
        kb, vb = self._ring_buffers(size, heads)
        self._ring = relayout(self._ring, self._vmap, vmap, kb, vb, sink=sink, end=self._state.local_end,
                              max_chunk=self._max_chunk, quant=self._quant, pages=self._pages)
        self._vmap, self._heads = vmap, heads

    def _ring_buffers(self, size: int, heads: tuple[int, int]) -> tuple[Tensor, Tensor]:
        """The ring's ``[B, size, h, D]`` K/V: the slice of ``k``/``v`` itself when it is contiguous
        (all heads, and ``size == L`` or ``B == 1``), else buffers of its own (KVStorage takes only
        buffers whose rows provably do not overlap), kept across resets and grown with the cache."""
        h0, h = heads
        kb, vb = (b.narrow(1, 0, size).narrow(2, h0, h) for b in (self._k, self._v))
        if self._quant is not None or self._pages is not None:  # the ring's own storage: k/v describe the shape
            return kb, vb
        if kb.is_contiguous() and vb.is_contiguous():
            return kb, vb
        own = self._own
        if own is None or own[0].shape != kb.shape or own[1].shape != vb.shape:
            new = (torch.zeros_like(kb, memory_format=torch.contiguous_format),
                   torch.zeros_like(vb, memory_format=torch.contiguous_format))
            if own is not None and own[0].shape[2:] == kb.shape[2:]:  # growth: keep what the slots hold
                keep = min(own[0].shape[1], size)
                new[0][:, :keep].copy_(own[0][:, :keep])
                new[1][:, :keep].copy_(own[1][:, :keep])
            self._own = own = new
        return own

    def _rows(self, ranges: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
        """The ring slot ranges holding the positions of sglang's slot ``ranges`` (the same
        multiset of tokens), sorted and merged where they touch."""
        ring = self._ring
        L, end = ring.layout, ring.end
        rows: list[tuple[int, int]] = []
        for lo, hi in ranges:
            for pos, m in slot_positions(self._state.runs, lo, hi):
                for v, k in self._vmap.virtual(pos, m):
                    rows.extend(ring_rows(L, end, v, k))
        rows.sort()
        merged: list[tuple[int, int]] = []
        for a, b in rows:
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        return merged

    def _slices(self, rows: list[tuple[int, int]]) -> tuple[Tensor, Tensor]:
        return ring_slices(self._ring, rows)

    def __repr__(self) -> str:
        s = self._state
        return (f"RingCausalSelfAttentionKVCache(k={tuple(self._k.shape)}, cache_size={s.cache_size}, "
                f"sink_tokens={self._sink_tokens}, global_sink_tokens={self._global_sink_tokens}, "
                f"attention_window_size={s.window}, global_end={s.global_end}, local_end={s.local_end}, "
                f"pinned=({s.pinned_start}, {s.pinned_len}), ring={self._ring!r})")


#: the sglang name, for ``stage.CausalSelfAttentionKVCache = CausalSelfAttentionKVCache``
CausalSelfAttentionKVCache = RingCausalSelfAttentionKVCache


def _desc(t: object) -> str:
    if isinstance(t, Tensor):
        return f"{tuple(t.shape)} {t.dtype} on {t.device}"
    return f"{type(t).__name__} {t!r}"
