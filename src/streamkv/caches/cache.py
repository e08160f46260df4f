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

Graph safety: ``write``/``update`` read their destination from device tensors and change no
host state, so a CUDA graph captured for one chunk writes a later chunk's slots on replay
(``graph_safe_writes``; not the chronological path, whose offset is a host int while it
fills). ``begin_chunk`` / ``commit_chunk`` / ``reset`` are host-side plans: call them outside
any captured region. Window caches never synchronise with the device; a scored policy's
commit synchronises once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..layout import CacheLayout
from ..policies import SlotPolicy, make_policy
from ..policies.base import Step
from ..storage import KVStorage, check_int
from .observers import CacheObserver, EvictionEvent, EvictionListener
from .read import KVRead, Occupancy

__all__ = ["KVCache", "LayerView", "Transition", "MAX_POSITION"]

#: Positions stay below 2**53: exact in float64 (RoPE angles) and far from int64 overflow.
MAX_POSITION = 2**53
_OCCUPANCIES = ("all", "prefix", "mask")


class Transition:
    """A change of a cache that has been checked, planned and announced to its observers,
    and that :meth:`apply` makes (it cannot fail). Groups prepare every member first, then
    apply them all: all or nothing."""

    __slots__ = ("_apply",)

    def __init__(self, apply: Callable[[], None]) -> None:
        self._apply = apply

    def apply(self) -> None:
        self._apply()


class KVCache:
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
        pol.bind(self.storage, layout)
        st = self.storage
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
            if self.policy.needs_queries:
                self.policy.take_queries(layer, q)
            for obs in self._observers:
                obs.on_queries(self, layer, q)
        return self._read(layer, read_occ)

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
    def end(self) -> int:
        """Positions that have entered the stream, the open span included."""
        return self._end

    def _open_name(self) -> str:
        c = self.open_chunk
        return f"chunk {c}" if c is not None else f"span {self.open_span}"

    def _commit_call(self) -> str:
        c = self.open_chunk
        return f"commit_chunk({c})" if c is not None else "commit()"

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
            bias_fn=st.bias, name=f"{self.name} cache layer {layer}",
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

    # ============================================================ state dicts
    def config(self) -> dict[str, Any]:
        """What must match for a state dict to load: kind, policy, layout, shapes, dtype."""
        return {
            "kind": self.name,
            "layout": (self.layout.sink, self.layout.window, self.layout.chunk),
            "policy": self.policy.params(),
            "k_shape": self.k_shape,
            "v_shape": self.v_shape,
            "seq_dim": self.seq_dim,
            "head_dim": self.head_dim,
            "num_layers": self.num_layers,
            "recall_slots": self.storage.recall_slots,
            "dtype": str(self.dtype),
        }

    def _tensors(self) -> dict[str, Tensor]:
        st = self.storage
        return {"keys": st.keys, "values": st.values, "slot_positions": st.positions, "write_slots": st.plan,
                **self.policy.state()}

    def state_dict(self) -> dict[str, Any]:
        """A snapshot of the cache's whole state: host counters and *copies* of every tensor
        (so a state taken now restores this moment even after the stream moves on).

        Raises ``RuntimeError`` for a cache with recall slots: their contents belong to the
        observer that recalled them, which does not serialise its state."""
        if self.storage.recall_slots:
            raise RuntimeError(
                "a cache with recall slots does not save state dicts: the recalled tokens belong to an observer "
                "(streamkv.certify) whose summaries and offload store are not serialised"
            )
        return {
            **self.config(),
            "end": self._end,
            "span": self._span,
            "open": self._open,
            **{name: t.detach().clone() for name, t in self._tensors().items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` into the existing buffers (copies).

        Everything is validated first (:meth:`validate_state`): the kind, policy, layout,
        shapes and dtype; every tensor's shape, dtype and layout; the lifecycle counters
        against the layout arithmetic; the slot positions against the counters. A rejected
        state changes nothing.
        """
        end, span, is_open = self.validate_state(state)
        for name, t in self._tensors().items():
            t.copy_(state[name])
        self._end, self._span, self._open = end, span, is_open
        self._chunk_positions.fill_(end - span).add_(self._arange_c)
        self._reads.clear()
        self.policy.after_load(end, span)

    def validate_state(self, state: dict[str, Any]) -> tuple[int, int, bool]:
        """Raise as ``load_state_dict(state)`` would; else return ``(end, span, open)`` as exact
        Python values. Changes nothing."""
        self._check_mutable("load_state_dict")
        if self.storage.recall_slots:
            raise RuntimeError("a cache with recall slots does not load state dicts (see state_dict)")
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        for key, want in self.config().items():
            if key not in state:
                raise ValueError(f"state dict lacks {key!r}")
            got = state[key]
            if isinstance(want, tuple):
                got = tuple(got) if isinstance(got, (tuple, list, torch.Size)) else got
            if got != want:
                raise ValueError(f"state dict {key} must be {want!r} for this cache, got {got!r}")
        for key, buf in self._tensors().items():
            t = state.get(key)
            if not isinstance(t, Tensor) or t.shape != buf.shape or t.dtype != buf.dtype:
                desc = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else repr(type(t).__name__)
                raise ValueError(f"state dict {key} must be a {tuple(buf.shape)} {buf.dtype} tensor, got {desc}")
            if t.layout != torch.strided or t.device.type == "meta":
                raise ValueError(f"state dict {key} must be a dense tensor with data, got layout {t.layout} on {t.device}")
            if self.storage.owns(t):
                raise ValueError(
                    f"state dict {key} shares memory with this cache's own buffers: loading it would read what it "
                    f"overwrites (keep a copy: state_dict() returns copies)"
                )
        for key in ("end", "span", "open"):
            if key not in state:
                raise ValueError(f"state dict lacks {key!r}")
        try:
            end = check_int("end", state["end"], 0)
            span = check_int("span", state["span"], 0)
        except TypeError as exc:
            raise ValueError(f"state dict {exc}") from None
        is_open = state["open"]
        if not isinstance(is_open, bool):
            raise ValueError(f"state dict open must be a bool, got {type(is_open).__name__} {is_open!r}")
        if end > MAX_POSITION:
            raise ValueError(f"state dict end={end} passes position 2**53")
        if span > min(end, self.layout.chunk) or (end and not span) or (is_open and not span):
            raise ValueError(
                f"state dict span={span} is impossible at end={end} (1 <= span <= min(end, chunk={self.layout.chunk}) "
                f"once anything entered the stream)"
            )
        self.policy.check_state(state, end, span, is_open)
        return end, span, is_open

    # ============================================================ validation
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
