"""``KVCache``: storage + a slot policy + the chunk lifecycle + observers.

A cache holds the K/V of ``num_layers`` attention layers (one allocation) and walks the
stream chunk by chunk::

    cache.begin_chunk(c)                    # host: reserve the chunk's slots (advance or reopen)
    for step in denoising_steps + [clean]:  # every pass rewrites the same slots
        for i in layers:
            read = cache.layer(i).update(k, v, q)   # write, hand q to the policy, what to attend to
            out, info = attend(q, read)
    cache.commit_chunk(c)                   # host: the chunk becomes history (scored policies evict)

``begin_chunk(c)`` accepts the next chunk (``c == next_chunk``: advance, which may evict) or the
last one again (``c == next_chunk - 1``: reuse its slots, as flashdreams' ``before_update``).
A chunk is a *span* of ``chunk`` positions; streams whose steps differ in length (an LLM's
prefill chunks, then one token per decoding step) open spans of ``1 <= n <= chunk`` tokens
with ``begin_tokens(n)`` and close them with ``commit()``: chunk ``c`` is the span
``[c * chunk, (c + 1) * chunk)``.

The kinds (``RingCache``, ``ChronologicalCache``, ``MassBudgetCache``, ``H2OCache``,
``TOVACache``) are this class with a fixed policy (:mod:`streamkv.policies`); they share
every method and every attribute's meaning: ``slot_positions`` is ``int64 [L, H, S]`` for all.

Rejected calls raise ``TypeError`` / ``ValueError`` / ``RuntimeError`` naming the constraint
and the value, and leave the cache exactly as it was: every check (shapes, dtype, device,
layout, memory overlap with the cache's own buffers, autograd and inference-mode state,
lifecycle) runs before the first byte changes, and K and V are written together or not at
all. Observers are told of a change before it happens (see :mod:`.observers`).

The class is split by concern: this module holds construction, the lifecycle and observers;
:mod:`.reads` what can be read, :mod:`.state` state dicts, :mod:`.checks` input validation.
Why one module for the rest: begin, write and commit are one state machine over the same host
counters, plans and announcements; split further, each half would read the other's internals.

Graph safety: ``write``/``update`` read their destination from device tensors and change no
host state, so a CUDA graph captured for one chunk writes a later chunk's slots on replay
(``graph_safe_writes``; not the chronological path, whose offset is a host int while it
fills). ``begin_chunk`` / ``commit_chunk`` / ``reset`` are host-side plans: call them outside
any captured region. Window caches never synchronise with the device; a scored policy's
commit synchronises once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..layout import CacheLayout
from ..policies import SlotPolicy, make_policy
from ..policies.base import Step
from ..rope_at_read import RopeAtRead
from ..storage import KVStorage, check_int
from .checks import InputChecks
from .observers import CacheObserver, EvictionEvent, EvictionListener
from .read import KVRead, Occupancy
from .reads import ReadPaths
from .state import MAX_POSITION, StateDicts

__all__ = ["KVCache", "LayerView", "Transition", "MAX_POSITION"]


class Transition:
    """A change of a cache that has been checked, planned and announced to its observers,
    and that :meth:`apply` makes (it cannot fail). Groups prepare every member first, then
    apply them all: all or nothing."""

    __slots__ = ("_apply",)

    def __init__(self, apply: Callable[[], None]) -> None:
        self._apply = apply

    def apply(self) -> None:
        self._apply()


class KVCache(ReadPaths, StateDicts, InputChecks):
    """K/V storage for ``num_layers`` layers, a slot policy and the chunk lifecycle.

    Args:
        k_shape: one layer's key buffer, e.g. ``(B, sink + window, H, D)`` or
            ``(B, H, sink + window, D)``; ``k_shape[seq_dim]`` must equal ``sink + window``.
        v_shape: one layer's value buffer; equal to ``k_shape`` except (possibly) the last dim.
        seq_dim: the token (slot) dim of ``k_shape``; may be negative; not the last (features).
        sink, window, chunk: sizes in tokens (:class:`~streamkv.layout.CacheLayout`).
        policy: a name (``"ring"``, ``"chronological"``, ``"mass"``, ``"h2o"``, ``"tova"``), a
            policy class or instance; the named kinds fix it. ``**policy_params`` go to its
            constructor (``tau=0.05``, ``budget=96``).
        num_layers: layers stored; buffers are ``[num_layers, *k_shape]``.
        head_dim: the head dim of ``k_shape`` (default: the last dim that is neither tokens nor
            features); per-head policies keep one slot set per head.
        recall_slots: extra slots per head after the ``sink + window`` the policy manages,
            for tokens recalled by an observer (:mod:`streamkv.certify`).
        dtype, device: of the K/V buffers.
        buffers: optional preallocated ``(K, V)`` of shapes ``[num_layers, *k_shape]`` (seq
            extent ``sink + window + recall_slots``) to use instead of allocating.
        rope_at_read: optional :class:`~streamkv.rope_at_read.RopeAtRead`: the keys written are
            raw (un-rotated) and every read rotates keys and queries by its position map
            (``attend`` does it, a block of slots at a time). None: keys are stored as given
            (RoPE at write, the default).

    Buffers are allocated once; their ``data_ptr()`` never changes.
    """

    #: the policy of a named kind (None: pass ``policy=``)
    kind: ClassVar[str | None] = None

    def __init__(
        self,
        k_shape: Sequence[int],
        v_shape: Sequence[int],
        *,
        seq_dim: int,
        sink: int,
        window: int,
        chunk: int,
        policy: str | SlotPolicy | type[SlotPolicy] | None = None,
        num_layers: int = 1,
        head_dim: int | None = None,
        recall_slots: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        buffers: tuple[Tensor, Tensor] | None = None,
        rope_at_read: Any = None,
        **policy_params: Any,
    ) -> None:
        if policy is None:
            if self.kind is None:
                raise TypeError("KVCache needs a policy: a name such as 'ring' or 'mass', a class or an instance")
            policy = self.kind
        elif self.kind is not None:
            raise TypeError(f"{type(self).__name__} fixes its policy ({self.kind!r}); use KVCache(..., policy=...)")
        layout = CacheLayout(sink=check_int("sink", sink), window=check_int("window", window),
                             chunk=check_int("chunk", chunk))
        pol = make_policy(policy, **policy_params)
        pol.check_layout(layout)
        self.layout = layout
        self.policy = pol
        self.storage = KVStorage(
            k_shape, v_shape, seq_dim=seq_dim, head_dim=head_dim, capacity=layout.capacity, chunk=layout.chunk,
            num_layers=num_layers, recall_slots=recall_slots, per_head=pol.per_head, dtype=dtype, device=device,
            buffers=buffers,
        )
        st = self.storage
        if rope_at_read is not None:
            if not isinstance(rope_at_read, RopeAtRead):
                raise TypeError(f"rope_at_read must be a streamkv RopeAtRead or None, got {type(rope_at_read).__name__}")
            rope_at_read.bind(sink=layout.sink, capacity=st.slots, per_head=pol.per_head or bool(st.recall_slots),
                              head_dim_size=st.k_shape[-1], device=st.device)
        self.rope_at_read = rope_at_read
        pol.bind(self.storage, layout)
        self.k_shape, self.v_shape, self.seq_dim, self.head_dim = st.k_shape, st.v_shape, st.seq_dim, st.head_dim
        self.num_layers, self.dtype, self.device = st.num_layers, st.dtype, st.device
        self._inference_buffers = st.keys.is_inference()  # torch lets them change only in inference mode
        # positions of the open (or last) chunk's rows, on the device: causal masks read them
        self._arange_c = torch.arange(layout.chunk, dtype=torch.long, device=st.device)
        self._chunk_positions = self._arange_c.clone()
        # host state: the only Python ints of the lifecycle
        self._end = 0  # positions that have entered the stream (the open span included)
        self._span = 0  # rows of the open (or last) span: it is [end - span, end)
        self._open = False  # a span is open (read by write(): a plain bool, stable under compile)
        self._observers: list[CacheObserver] = []
        # reads of the current lifecycle state, by (layer, occupancy): a read changes only
        # when begin/commit/reset/load does, so the per-pass cost is a dict lookup
        self._reads: dict[tuple[int, str], KVRead] = {}

    # ================================================================ capabilities
    @property
    def name(self) -> str:
        """The policy's name (``"ring"``, ``"mass"``, ...)."""
        return self.policy.name

    @property
    def per_head(self) -> bool:
        """Heads (and layers) may hold different positions."""
        return self.policy.per_head

    @property
    def graph_safe_writes(self) -> bool:
        """``write`` reads its destination only from device tensors: one captured CUDA graph
        stays correct for every chunk, not only in the steady state."""
        return self.policy.graph_safe_writes

    @property
    def needs_queries(self) -> bool:
        """The policy scores tokens with the chunk's queries (see :meth:`LayerView.update`)."""
        return self.policy.needs_queries

    @property
    def retains_window(self) -> bool:
        """Holds exactly ``[sinks | last window]``: attention equals the current path to rounding."""
        return self.policy.retains_window

    @property
    def valid_is_prefix(self) -> bool:
        """The occupied slots are always ``[0, num_valid)``."""
        return not self.per_head and not self.storage.recall_slots

    # ================================================================ lifecycle
    def begin_chunk(self, chunk_idx: int) -> None:
        """Reserve the slots of chunk ``chunk_idx`` (host side; call outside graph capture).

        ``chunk_idx == next_chunk`` advances the stream (a window cache evicts its oldest
        tokens here); ``chunk_idx == next_chunk - 1`` reopens the last chunk so that its slots
        are written again. Launches a few small device ops; never synchronises.

        Raises:
            TypeError: ``chunk_idx`` is not an int.
            RuntimeError: a span is already open; the cache's buffers are inference tensors
                and inference mode is off.
            ValueError: ``chunk_idx`` is neither the next nor the current chunk; the stream
                is not at a chunk boundary; it would pass :data:`MAX_POSITION`.
        """
        self.prepare_begin(chunk_idx).apply()

    def begin_tokens(self, n: int) -> None:
        """Open a span of the next ``n`` positions (``1 <= n <= chunk``), e.g. a prefill
        chunk or one decoded token; ``commit()`` closes it. Otherwise as :meth:`begin_chunk`."""
        n = check_int("n", n)
        if not 1 <= n <= self.layout.chunk:
            raise ValueError(f"a span holds 1 to chunk={self.layout.chunk} tokens, got n={n}")
        self._check_can_begin(f"begin_tokens({n})")
        self._prepare(self._end, n, True).apply()

    def prepare_begin(self, chunk_idx: int) -> Transition:
        """Check, plan and announce ``begin_chunk(chunk_idx)``; nothing changes until the
        returned transition is applied."""
        advance = self.check_begin(chunk_idx)
        return self._prepare(check_int("chunk_idx", chunk_idx) * self.layout.chunk, self.layout.chunk, advance)

    def _prepare(self, start: int, n: int, advance: bool) -> Transition:
        if advance and start + n > MAX_POSITION:
            raise ValueError(f"positions [{start}, {start + n}) would pass 2**53 ({MAX_POSITION}): start a new stream")
        step = self.policy.begin(start, n, advance)
        chunk_idx = start // self.layout.chunk
        self._announce(chunk_idx, "begin", step)
        for obs in self._observers:
            obs.on_begin(self, chunk_idx, advance)

        def apply() -> None:
            step.apply()
            self._chunk_positions.fill_(start).add_(self._arange_c)
            self._end, self._span, self._open = start + n, n, True
            self._reads.clear()

        return Transition(apply)

    def _check_can_begin(self, what: str) -> None:
        self._check_mutable(what)
        if self._open:
            raise RuntimeError(f"{self._open_name()} is still open: call {self._commit_call()} before {what}")

    def check_begin(self, chunk_idx: int) -> bool:
        """Raise as ``begin_chunk(chunk_idx)`` would; else True for an advance, False for a
        reopen. Changes nothing."""
        chunk_idx = check_int("chunk_idx", chunk_idx)
        self._check_can_begin(f"begin_chunk({chunk_idx})")
        C = self.layout.chunk
        if self._end % C:
            raise ValueError(
                f"the stream is at position {self._end}, not at a chunk boundary (chunk={C}): begin_chunk needs whole "
                f"chunks; continue with begin_tokens(n) or reset"
            )
        nxt = self._end // C
        if chunk_idx == nxt:
            if (nxt + 1) * C > MAX_POSITION:
                raise ValueError(f"chunk {nxt} would pass position 2**53 ({MAX_POSITION}): start a new stream (reset)")
            return True
        if chunk_idx == nxt - 1 and chunk_idx >= 0 and self._span == C:
            return False
        allowed = f"the next chunk ({nxt})" + (f" or the current one ({nxt - 1})" if nxt and self._span == C else "")
        raise ValueError(f"chunk_idx must be {allowed}, got {chunk_idx}")

    def write(self, k: Tensor, v: Tensor, layer: int | None = None) -> None:
        """Copy the open chunk's K/V of ``layer`` into its reserved slots, in place.

        May be called any number of times between ``begin_chunk`` and ``commit_chunk`` (the
        denoising steps, then the clean pass); each call replaces the chunk's previous K/V.

        Args:
            k: ``k_shape`` with ``chunk`` at ``seq_dim``; the cache's dtype and device.
            v: ``v_shape`` with ``chunk`` at ``seq_dim``.
            layer: which layer; may be omitted when ``num_layers == 1``.

        Safe under CUDA graph capture and ``torch.compile``: the destination is read from
        device tensors and no host state changes.
        """
        layer = self._check_layer(layer)
        self._check_write(k, v)
        self._write(layer, k, v)

    def _write(self, layer: int, k: Tensor, v: Tensor) -> None:
        for obs in self._observers:
            obs.on_write(self, layer, k, v)
        self.storage.write(layer, k, v)
        if self.policy.needs_queries:
            self.policy.on_write(layer)

    def update(self, k: Tensor, v: Tensor, q: Tensor | None = None, *, layer: int | None = None,
               occupancy: Occupancy | None = None) -> KVRead:
        """Write the chunk's K/V of ``layer``, hand its queries ``q`` (in the layout of the K
        chunk; more heads for grouped-query attention) to the policy and the observers, and
        return what to attend to (:meth:`read`). One call per attention from the model."""
        layer = self._check_layer(layer)
        self._check_write(k, v)
        if q is not None:
            self._check_queries(q)
        read_occ = self._check_occupancy(occupancy)
        self._write(layer, k, v)
        if q is not None:
            self._deliver_queries(layer, q)
        return self._read(layer, read_occ)

    def observe_queries(self, q: Tensor, *, layer: int | None = None) -> None:
        """Hand the open span's queries of ``layer`` to the policy and the observers *after* its
        write: the second half of :meth:`update`, for integrations whose queries arrive after
        the K/V (transformers calls ``cache.update(k, v)`` before its attention function sees
        the queries). Call it before attending: an observer may change what the read holds
        (certified recall fills the recall slots here)."""
        layer = self._check_layer(layer)
        if not self._open:
            raise RuntimeError("observe_queries() needs an open span: call begin_chunk / begin_tokens and write first")
        self._check_queries(q)
        self._deliver_queries(layer, q)

    def _deliver_queries(self, layer: int, q: Tensor) -> None:
        if self.policy.needs_queries:
            self.policy.take_queries(layer, q)
        for obs in self._observers:
            obs.on_queries(self, layer, q)

    def commit_chunk(self, chunk_idx: int) -> None:
        """Make the open chunk history (host side). A scored policy evicts here (and
        synchronises once); it refuses, changing nothing, if a layer's queries never arrived
        or its attention statistics are not finite.

        It does not check that the chunk was written: the write may live in a replayed CUDA
        graph that the host never sees.
        """
        self.prepare_commit(chunk_idx).apply()

    def commit(self) -> None:
        """Make the open span history (:meth:`commit_chunk` for spans of any length)."""
        self._check_open_for("commit()")
        self._prepare_commit().apply()

    def prepare_commit(self, chunk_idx: int) -> Transition:
        """Check, plan and announce ``commit_chunk(chunk_idx)``; nothing changes until the
        returned transition is applied."""
        self.check_commit(chunk_idx)
        return self._prepare_commit()

    def _prepare_commit(self) -> Transition:
        start, n = self._end - self._span, self._span
        step = self.policy.commit(start, n)
        chunk_idx = start // self.layout.chunk
        self._announce(chunk_idx, "commit", step)
        for obs in self._observers:
            obs.on_commit(self, chunk_idx)

        def apply() -> None:
            if step is not None:
                step.apply()
            self._open = False
            self._reads.clear()

        return Transition(apply)

    def _check_open_for(self, what: str) -> None:
        self._check_mutable(what)
        if not self._open:
            raise RuntimeError(f"{what} with nothing open: call begin_chunk(chunk_idx) or begin_tokens(n) first")

    def check_commit(self, chunk_idx: int) -> None:
        """Raise as ``commit_chunk(chunk_idx)`` would for lifecycle reasons. Changes nothing."""
        chunk_idx = check_int("chunk_idx", chunk_idx)
        self._check_open_for(f"commit_chunk({chunk_idx})")
        if self.open_chunk is None:
            raise ValueError(f"commit_chunk({chunk_idx}): the open span {self.open_span} is not a whole chunk; "
                             f"use commit()")
        if chunk_idx != self.open_chunk:
            raise ValueError(f"commit_chunk must name the open chunk ({self.open_chunk}), got {chunk_idx}")

    def reset(self) -> None:
        """Forget the stream: every slot empty and zeroed (no stale value can reach an output),
        next chunk 0. Buffers are kept (same ``data_ptr``)."""
        self._check_mutable("reset")
        for obs in self._observers:
            obs.on_reset(self)
        self.storage.zero_()
        self.policy.reset()
        self._end, self._span, self._open = 0, 0, False
        self._reads.clear()

    def _announce(self, chunk_idx: int, at: str, step: Step | None) -> None:
        if self._observers and step is not None and step.evicted is not None:
            event = EvictionEvent(self, chunk_idx, at, step.evicted(), step.evicted_slots, step.info or {})
            for obs in self._observers:
                obs.on_evict(event)

    # ================================================================ reading
    @property
    def next_chunk(self) -> int:
        """Index that ``begin_chunk`` will advance to (the stream's whole chunks so far)."""
        return self._end // self.layout.chunk

    @property
    def open_chunk(self) -> int | None:
        """The chunk between ``begin_chunk`` and ``commit_chunk`` (None when nothing is open,
        or the open span is not a whole chunk)."""
        if not self._open or self._span != self.layout.chunk or self._end % self.layout.chunk:
            return None
        return self._end // self.layout.chunk - 1

    @property
    def is_open(self) -> bool:
        """A chunk or span is open (between begin and commit)."""
        return self._open

    @property
    def open_span(self) -> tuple[int, int] | None:
        """``(start, n)`` of the open span (positions ``[start, start + n)``), or None."""
        return (self._end - self._span, self._span) if self._open else None

    @property
    def last_span(self) -> tuple[int, int] | None:
        """``(start, n)`` of the open or last span (a whole chunk can be reopened only if the
        last span was one), or None when nothing has entered the stream."""
        return (self._end - self._span, self._span) if self._end else None

    @property
    def end(self) -> int:
        """Positions that have entered the stream, the open span included."""
        return self._end

    def _open_name(self) -> str:
        c = self.open_chunk
        return f"chunk {c}" if c is not None else f"span {self.open_span}"

    def _commit_call(self) -> str:
        c = self.open_chunk
        return f"commit_chunk({c})" if c is not None else "commit()"

    # ================================================================ handles, report
    def layer(self, layer: int) -> LayerView:
        """A handle on one layer: what an attention module needs."""
        return LayerView(self, self._check_layer(layer))

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V buffers (all layers, recall slots included)."""
        return self.storage.nbytes

    def report(self) -> dict[str, Any]:
        """What the cache holds and has evicted (synchronises): the policy's parameters, the
        capacity, kept tokens per (layer, head) and their mean; for scored policies the
        evictions, overflows and the last commit's dropped-mass bound per (layer, head)."""
        kept = (self.storage.slot_positions[..., : self.layout.capacity] >= 0).sum(-1)
        out: dict[str, Any] = {
            "kind": self.name, **self.policy.params(), "capacity": self.layout.capacity,
            "kept_tokens": kept.tolist(), "kept_tokens_mean": float(kept.float().mean()),
        }
        stats = self.policy.state()
        if "evictions" in stats:
            out.update(
                evicted_total=int(stats["evictions"].sum()), overflows=stats["overflows"].tolist(),
                overflow_total=int(stats["overflows"].sum()),
                last_dropped_mass_bound=stats["dropped_mass_bound"].tolist(),
                last_dropped_mass_bound_max=float(stats["dropped_mass_bound"].max()),
            )
        return out

    # ================================================================ observers
    def add_observer(self, observer: CacheObserver) -> CacheObserver:
        """Tell ``observer`` of every change from now on (see :mod:`.observers`); returns it."""
        if not isinstance(observer, CacheObserver):
            raise TypeError(f"observer must be a CacheObserver, got {type(observer).__name__}")
        if any(o is observer for o in self._observers):
            raise ValueError("this observer already watches this cache")
        self._observers.append(observer)
        return observer

    def remove_observer(self, observer: CacheObserver) -> None:
        for i, o in enumerate(self._observers):
            if o is observer:
                del self._observers[i]
                return
        raise ValueError("this observer does not watch this cache")

    def add_eviction_listener(self, listener: Callable[[EvictionEvent], None]) -> CacheObserver:
        """Call ``listener(event)`` before tokens leave (an observer with ``on_evict`` only)."""
        return self.add_observer(EvictionListener(listener))

    @property
    def observers(self) -> tuple[CacheObserver, ...]:
        return tuple(self._observers)


    def __repr__(self) -> str:
        L = self.layout
        return (
            f"{type(self).__name__}(policy={self.policy!r}, sink={L.sink}, window={L.window}, chunk={L.chunk}, "
            f"k_shape={self.k_shape}, v_shape={self.v_shape}, seq_dim={self.seq_dim}, num_layers={self.num_layers}, "
            f"dtype={self.dtype}, device={self.device}, end={self._end}, open_span={self.open_span})"
        )


class LayerView:
    """One layer of a cache: what an attention module holds. No state of its own; the
    lifecycle (begin/commit/reset) stays on the cache."""

    __slots__ = ("cache", "index")

    def __init__(self, cache: KVCache, index: int) -> None:
        self.cache = cache
        self.index = index

    def update(self, k: Tensor, v: Tensor, q: Tensor | None = None, *, occupancy: Occupancy | None = None) -> KVRead:
        """Write ``k``/``v``, hand ``q`` to the policy and observers, return what to attend to
        (:meth:`KVCache.update`)."""
        return self.cache.update(k, v, q, layer=self.index, occupancy=occupancy)

    def write(self, k: Tensor, v: Tensor) -> None:
        self.cache.write(k, v, layer=self.index)

    def observe_queries(self, q: Tensor) -> None:
        """Queries after the write (:meth:`KVCache.observe_queries`)."""
        self.cache.observe_queries(q, layer=self.index)

    def read(self, occupancy: Occupancy | None = None) -> KVRead:
        return self.cache.read(self.index, occupancy)

    def keys(self) -> Tensor:
        return self.cache.keys(self.index)

    def values(self) -> Tensor:
        return self.cache.values(self.index)

    @property
    def slot_positions(self) -> Tensor:
        """``int64 [heads, slots]``."""
        return self.cache.layer_slot_positions(self.index)

    def chronological_keys(self) -> Tensor:
        return self.cache.chronological_keys(self.index)

    def chronological_values(self) -> Tensor:
        return self.cache.chronological_values(self.index)

    def __repr__(self) -> str:
        return f"LayerView({self.cache.name}, layer={self.index})"
