"""``KVCache``: storage + a slot policy + the chunk lifecycle + observers.

The chunk loop, the vocabulary (position, slot, span, chunk) and the plan/apply phases are
told once, in ``docs/ARCHITECTURE.md``. This class composes the parts, each in its own
module and talking through methods: :class:`~streamkv.storage.KVStorage` (buffers, positions,
plan), a :class:`~streamkv.policies.SlotPolicy`, :class:`~.lifecycle.Lifecycle` (the host
counters and the read generation), :class:`~.checks.InputChecks`, :class:`~.reads.Reads`,
:class:`~.state.StateDicts`, and the observers (:mod:`.observers`).

Rejected calls raise ``TypeError`` / ``ValueError`` / ``RuntimeError`` naming the constraint and
the value, and leave the cache and its observers exactly as they were. Graph safety:
``write``/``update`` read their destination from device tensors and change no host state;
``begin_*`` / ``commit*`` / ``reset`` / ``load_state_dict`` are host-side plans (call them
outside any captured region). Window caches never synchronise; a scored commit does once.

Why one module: it is the cache's public surface (lifecycle, writes, reads, state dicts,
observers), and most of it is the documentation of that surface; each method hands the call
to the part that owns the work in a line or two.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..blockread import read_blocks
from ..layout import CacheLayout
from ..policies import SlotPolicy, Step, make_policy
from ..rope_at_read import RopeAtRead
from ..storage import KVStorage
from ..stores import as_pages
from ..stores.pages import PlannedPages
from ..validate import check_int
from .branches import Branches
from .checks import InputChecks
from .lifecycle import Lifecycle
from .layer import LayerView
from .observers import CacheObserver, Change, EvictionEvent, EvictionListener, Observers
from .read import KVRead, Occupancy
from .reads import Reads
from .state import MAX_POSITION, StateDicts

__all__ = ["KVCache", "LayerView", "MAX_POSITION"]


def _mib(n: int) -> str:
    return f"{n / 2**20:.3g} MiB" if n >= 2**20 else f"{n / 2**10:.3g} KiB" if n >= 2**10 else f"{n} B"


class KVCache:
    """K/V storage for ``num_layers`` layers, a slot policy and the chunk lifecycle.

    Args:
        k_shape: one layer's key buffer, e.g. ``(B, sink + window, H, D)`` or
            ``(B, H, sink + window, D)``; ``k_shape[seq_dim]`` must equal ``sink + window``.
        v_shape: one layer's value buffer; equal to ``k_shape`` except (possibly) the last dim.
        seq_dim: the token (slot) dim of ``k_shape``; may be negative; not the last (features).
        sink, window, chunk: sizes in tokens (:class:`~streamkv.layout.CacheLayout`).
        policy: a name in :data:`~streamkv.policies.POLICIES`, a policy class or instance; the
            named kinds fix it. ``**policy_params`` go to its constructor (``tau=0.05``).
        num_layers: layers stored; buffers are ``[num_layers, *k_shape]``.
        head_dim: the head dim of ``k_shape`` (default: the last dim that is neither tokens nor
            features); per-head policies keep one slot set per head.
        recall_slots: extra slots per head after the ``sink + window`` the policy manages,
            for tokens recalled by an observer (:mod:`streamkv.certify`).
        dtype, device: of the K/V buffers.
        buffers: optional preallocated ``(K, V)`` of shapes ``[num_layers, *k_shape]`` (seq
            extent ``sink + window + recall_slots``) to use instead of allocating.
        quant: quantised storage (:class:`~streamkv.quant.KVQuant`, or a format name of
            :data:`~streamkv.quant.KV_FORMATS` such as ``"int4"``): codes and scales instead of
            dense K/V, the sinks, the open span and a residual in full precision, every token
            quantised once at its commit (:mod:`streamkv.stores.quant`). Reads go block by block
            (``KVRead.load``); ``keys()``/``values()`` return dequantised copies.
        rope_at_read: optional :class:`~streamkv.rope_at_read.RopeAtRead`: the keys written are
            raw (un-rotated) and every read rotates keys and queries by its position map
            (``attend`` does it, a block of slots at a time). None: keys are stored as given
            (RoPE at write, the default).

    Buffers are allocated once; their ``data_ptr()`` never changes. The policy's
    ``cache_properties`` (``budget``, ``tau``, ``wraps``, ...) read through the cache.
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
        quant: Any = None,
        rope_at_read: Any = None,
        pages: Any = None,
        **policy_params: Any,
    ) -> None:
        if policy is None:
            if self.kind is None:
                raise TypeError("KVCache needs a policy: a name such as 'ring' or 'mass', a class or an instance")
            policy = self.kind
        elif self.kind is not None:
            raise TypeError(f"{type(self).__name__} fixes its policy ({self.kind!r}); use KVCache(..., policy=...)")
        layout = CacheLayout(sink=sink, window=window, chunk=chunk)
        pol = make_policy(policy, **policy_params)
        pol.check_layout(layout)
        opts = as_pages(pages)
        what = (f"k_shape={tuple(k_shape)}, v_shape={tuple(v_shape)}, sink={sink}, window={window}, "
                f"num_layers={num_layers}, recall_slots={recall_slots}, quant={quant!r}, dtype={dtype}")
        with _allocating(what):
            st = KVStorage(
                k_shape, v_shape, seq_dim=seq_dim, head_dim=head_dim, capacity=layout.capacity, chunk=layout.chunk,
                num_layers=num_layers, recall_slots=recall_slots, per_head=pol.per_head, dtype=dtype, device=device,
                buffers=buffers, quant=quant, sink=layout.sink, pages=opts,
            )
        if rope_at_read is not None:
            if not isinstance(rope_at_read, RopeAtRead):
                raise TypeError(f"rope_at_read must be a streamkv RopeAtRead or None, got {type(rope_at_read).__name__}")
            rope_at_read.bind(sink=layout.sink, capacity=st.slots, per_head=pol.per_head or bool(st.recall_slots),
                              head_dim_size=st.k_shape[-1], device=st.device, chunk=layout.chunk)
        with _allocating(what):
            self._assemble(layout, pol, st, rope_at_read, opts.history if opts is not None else 0)

    def _assemble(self, layout: CacheLayout, pol: SlotPolicy, st: KVStorage, rope_at_read: Any, history: int) -> None:
        """The parts around a built storage (a new cache, or a branch of one)."""
        self.layout, self.policy, self.storage = layout, pol, st
        self.rope_at_read = rope_at_read
        self.lifecycle = Lifecycle(layout, st.device)
        pol.bind(st, layout, self.lifecycle)
        if pol.needs_queries:
            pol.reader = self._score_stored
        self.k_shape, self.v_shape, self.seq_dim, self.head_dim = st.k_shape, st.v_shape, st.seq_dim, st.head_dim
        self.num_layers, self.dtype, self.device = st.num_layers, st.dtype, st.device
        self.checks = InputChecks(st, layout, self.lifecycle, pol)
        self._observers = Observers(self)
        self.reads = Reads(st, layout, self.lifecycle, pol, self.checks, rope_at_read, extra=self._observers.segments,
                           adds=lambda: self._observers.add_segments, answer=self._observers.answer)
        self.states = StateDicts(st, layout, self.lifecycle, pol, self.checks, rope_at_read)
        self.branches = Branches(self, history)
        if rope_at_read is not None:  # built: a reader of its map state from now on
            rope_at_read.hold(self)

    def __getattr__(self, name: str) -> Any:
        # only reached when normal lookup fails: the policy's declared read-only properties
        policy = self.__dict__.get("policy")
        if policy is not None and name in type(policy).cache_properties:
            return getattr(policy, name)
        raise AttributeError(f"{type(self).__name__!r} ({self.name if policy else '?'} cache) has no attribute {name!r}")

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
        """The policy scores tokens with the span's queries (see :meth:`LayerView.update`)."""
        return self.policy.needs_queries

    @property
    def retains_window(self) -> bool:
        """Holds exactly ``[sinks | last window]``: attention equals the current path to rounding."""
        return self.policy.retains_window

    @property
    def valid_is_prefix(self) -> bool:
        """The occupied slots are always ``[0, num_valid)``."""
        return self.checks.valid_is_prefix

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
        self.prepare_begin(chunk_idx).run()

    def begin_tokens(self, n: int) -> None:
        """Open a span of the next ``n`` positions (``1 <= n <= chunk``), e.g. a prefill
        chunk or one decoded token; ``commit()`` closes it. Otherwise as :meth:`begin_chunk`."""
        self.prepare_begin_tokens(n).run()

    def prepare_begin(self, chunk_idx: int) -> Step:
        """Check, plan and let the observers veto ``begin_chunk(chunk_idx)``; nothing changes
        until the returned step runs (:meth:`~streamkv.policies.Step.run`)."""
        advance = self.check_begin(chunk_idx)
        return self._prepare_begin(check_int("chunk_idx", chunk_idx) * self.layout.chunk, self.layout.chunk, advance)

    def prepare_begin_tokens(self, n: int) -> Step:
        """As :meth:`prepare_begin`, for ``begin_tokens(n)``."""
        n = check_int("n", n)
        if not 1 <= n <= self.layout.chunk:
            raise ValueError(f"a span holds 1 to chunk={self.layout.chunk} tokens, got n={n}")
        self.checks.can_begin(f"begin_tokens({n})")
        start = self.lifecycle.end
        if start + n > MAX_POSITION:
            raise ValueError(f"positions [{start}, {start + n}) would pass 2**53 ({MAX_POSITION}): start a new stream")
        return self._prepare_begin(start, n, True)

    def _prepare_begin(self, start: int, n: int, advance: bool) -> Step:
        plan = self.policy.begin(start, n, advance)
        chunk_idx = start // self.layout.chunk
        own = self.storage.store.prepare_writes(plan.writes, f"begin of positions [{start}, {start + n})")
        with _cancelled_if_refused(own):
            change = Change(self, "begin", chunk_idx, (start, n), advance,
                            self._observers.eviction(chunk_idx, "begin", plan))
            actions = self._observers.prepare(change)

        def apply() -> None:
            if own is not None:  # a forked cache: the span's pages become its own first (copy on write)
                own()
            plan.apply()
            self.storage.begin(start, n, advance)  # the store's own begin work (a quantised store's full-precision rows)
            self.lifecycle.begin(start, n)

        return self._step(apply, change, actions, f"the begin of positions [{start}, {start + n})", own)

    def _step(self, apply: Callable[[], None], change: Change, actions: Any, what: str,
              own: PlannedPages | None = None, still: Callable[[], None] | None = None) -> Step:
        """The cache's step of a planned change: it runs once, and only while the cache is where it
        was planned (a step planned before another begin, commit, reset, load, rewind or release
        would apply slots, positions and pages that no longer hold) and ``still()`` passes (a
        condition outside the cache, checked again when the step runs): refused otherwise, nothing
        changed. Then the observers are told."""
        planned, ran = self.lifecycle.plan_epoch, []

        def check() -> None:
            if ran:
                raise RuntimeError(f"{what}: this prepared step already ran; a step runs once (prepare it again)")
            self.lifecycle.check_plan(planned, what)
            if still is not None:
                still()

        def run_once() -> None:
            check()
            ran.append(True)
            apply()

        return Step(run_once, then=(lambda: self._observers.tell(change, actions),), check=check,
                    cancel=None if own is None else own.cancel)

    def check_begin(self, chunk_idx: int) -> bool:
        """Raise as ``begin_chunk(chunk_idx)`` would; else True for an advance, False for a
        reopen. Changes nothing."""
        chunk_idx = check_int("chunk_idx", chunk_idx)
        self.checks.can_begin(f"begin_chunk({chunk_idx})")
        C, lc = self.layout.chunk, self.lifecycle
        if lc.end % C:
            raise ValueError(
                f"the stream is at position {lc.end}, not at a chunk boundary (chunk={C}): begin_chunk needs whole "
                f"chunks; continue with begin_tokens(n) or reset"
            )
        nxt = lc.end // C
        if chunk_idx == nxt:
            if (nxt + 1) * C > MAX_POSITION:
                raise ValueError(f"chunk {nxt} would pass position 2**53 ({MAX_POSITION}): start a new stream (reset)")
            return True
        if chunk_idx == nxt - 1 and chunk_idx >= 0 and lc.span == C:
            return False
        allowed = f"the next chunk ({nxt})" + (f" or the current one ({nxt - 1})" if nxt and lc.span == C else "")
        raise ValueError(f"chunk_idx must be {allowed}, got {chunk_idx}")

    def write(self, k: Tensor, v: Tensor, layer: int | None = None) -> None:
        """Copy the open span's K/V of ``layer`` into its reserved slots, in place.

        May be called any number of times between begin and commit (the denoising steps, then
        the clean pass); each call replaces the span's previous K/V. ``k``: ``k_shape`` with the
        span's rows at ``seq_dim``, the cache's dtype and device; ``v`` likewise; ``layer`` may
        be omitted when ``num_layers == 1``. Safe under CUDA graph capture and
        ``torch.compile``: the destination is read from device tensors, no host state changes.
        """
        layer = self.checks.layer(layer)
        self.checks.write(k, v)
        self._write(layer, k, v)

    def _write(self, layer: int, k: Tensor, v: Tensor) -> None:
        self.storage.write(layer, k, v)
        if self.policy.needs_queries:
            self.policy.on_write(layer)
        for obs in self._observers.members:
            obs.on_write(self, layer, k, v)

    def update(self, k: Tensor, v: Tensor, q: Tensor | None = None, *, layer: int | None = None,
               occupancy: Occupancy | None = None) -> KVRead:
        """Write the span's K/V of ``layer``, hand its queries ``q`` (in the layout of the K
        rows; more heads for grouped-query attention) to the policy and the observers, and
        return what to attend to (:meth:`read`). One call per attention from the model."""
        layer = self.checks.layer(layer)
        self.checks.write(k, v)
        if q is not None:
            self.checks.queries(q)
        read_occ = self.checks.occupancy(occupancy, self.reads.occupancy)
        self._write(layer, k, v)
        if q is not None:
            self._deliver_queries(layer, q)
        return self.reads.read(layer, read_occ)

    def observe_queries(self, q: Tensor, *, layer: int | None = None) -> None:
        """Hand the open span's queries of ``layer`` to the policy and the observers *after* its
        write: the second half of :meth:`update`, for integrations whose queries arrive after
        the K/V (transformers calls ``cache.update(k, v)`` before its attention function sees
        the queries). Call it before attending: an observer may change what the read holds
        (certified recall fills the recall slots here)."""
        layer = self.checks.layer(layer)
        if not self.lifecycle.is_open:
            raise RuntimeError("observe_queries() needs an open span: call begin_chunk / begin_tokens and write first")
        self.checks.queries(q)
        self._deliver_queries(layer, q)

    def _deliver_queries(self, layer: int, q: Tensor) -> None:
        if self.policy.needs_queries:
            self.policy.take_queries(layer, q)
        for obs in self._observers.members:
            obs.on_queries(self, layer, q)

    def commit_chunk(self, chunk_idx: int) -> None:
        """Make the open chunk history (host side). A scored policy evicts here (and
        synchronises once); it refuses, changing nothing, if a layer's queries never arrived
        or its statistics are not finite. It does not check that the chunk was written: the
        write may live in a replayed CUDA graph that the host never sees."""
        self.prepare_commit(chunk_idx).run()

    def commit(self) -> None:
        """Make the open span history (:meth:`commit_chunk` for spans of any length)."""
        self.checks.is_open_for("commit()")
        self._prepare_commit().run()

    def prepare_commit(self, chunk_idx: int) -> Step:
        """Check, plan and let the observers veto ``commit_chunk(chunk_idx)``; nothing changes
        until the returned step runs."""
        self.check_commit(chunk_idx)
        return self._prepare_commit()

    def _prepare_commit(self) -> Step:
        start, n = self.lifecycle.start, self.lifecycle.span
        self.storage.store.check_commit(start, n)
        plan = self.policy.commit(start, n) or Step()
        chunk_idx = start // self.layout.chunk
        change = Change(self, "commit", chunk_idx, (start, n), eviction=self._observers.eviction(chunk_idx, "commit", plan))
        actions = self._observers.prepare(change)

        def apply() -> None:
            self.storage.commit(start, n)  # the store's own commit work (a quantised store encodes once, here)
            plan.apply()
            self.lifecycle.close()
            self.branches.after_commit()

        return self._step(apply, change, actions, f"the commit of positions [{start}, {start + n})")

    def check_commit(self, chunk_idx: int) -> None:
        """Raise as ``commit_chunk(chunk_idx)`` would for lifecycle reasons. Changes nothing."""
        chunk_idx = check_int("chunk_idx", chunk_idx)
        self.checks.is_open_for(f"commit_chunk({chunk_idx})")
        if self.open_chunk is None:
            raise ValueError(f"commit_chunk({chunk_idx}): the open span {self.open_span} is not a whole chunk; "
                             f"use commit()")
        if chunk_idx != self.open_chunk:
            raise ValueError(f"commit_chunk must name the open chunk ({self.open_chunk}), got {chunk_idx}")

    def reset(self) -> None:
        """Forget the stream: every slot empty and zeroed (no stale value can reach an output),
        next chunk 0; with RoPE at read, the map in use and its dynamic parameters as the cache was
        built (a cut of the old stream does not carry over). Buffers are kept (same ``data_ptr``)."""
        self.prepare_reset().run()

    def prepare_reset(self, together: Sequence[KVCache] = ()) -> Step:
        """Check and let the observers veto :meth:`reset`; nothing changes until the step runs.
        ``together``: the other caches reset in the same step (a CacheSet's)."""
        self.checks.mutable("reset")
        rope = self.rope_at_read
        still = None if rope is None else (lambda: rope.check_change([self, *together], None, "a reset of this cache"))
        if still is not None:  # and again when the step runs: the shared map may move in between
            still()
        own = self.storage.store.prepare_writes("all", "a reset", self.branches.kept_pages())  # forgets them first
        change = Change(self, "reset")
        with _cancelled_if_refused(own):
            actions = self._observers.prepare(change)

        def apply() -> None:
            if own is not None:
                own()
            self.branches.forget()
            self.storage.zero_()
            self.policy.reset()
            self.lifecycle.reset()
            if self.rope_at_read is not None:  # the map state is the stream's: the new one starts as built
                self.rope_at_read.reset()

        return self._step(apply, change, actions, "a reset", own, still)

    # ================================================================ where the stream is
    @property
    def end(self) -> int:
        """Positions that have entered the stream, the open span included."""
        return self.lifecycle.end

    @property
    def next_chunk(self) -> int:
        """Index that ``begin_chunk`` will advance to (the stream's whole chunks so far)."""
        return self.lifecycle.next_chunk

    @property
    def open_chunk(self) -> int | None:
        """The chunk between ``begin_chunk`` and ``commit_chunk`` (None when nothing is open,
        or the open span is not a whole chunk)."""
        return self.lifecycle.open_chunk

    @property
    def is_open(self) -> bool:
        """A chunk or span is open (between begin and commit)."""
        return self.lifecycle.is_open

    @property
    def open_span(self) -> tuple[int, int] | None:
        """``(start, n)`` of the open span (positions ``[start, start + n)``), or None."""
        return self.lifecycle.open_span

    @property
    def last_span(self) -> tuple[int, int] | None:
        """``(start, n)`` of the open or last span, or None when nothing has entered the stream."""
        return self.lifecycle.last_span

    # ================================================================ reading
    @property
    def num_valid(self) -> int:
        """Occupied slots of the ``sink + window`` the policy manages: the count for window
        caches (host arithmetic), the most of any (layer, head) for per-head ones (synchronises).
        Refused on a released cache."""
        self.checks.alive("num_valid")
        return self.reads.num_valid

    def occupancy(self, static: bool = False) -> Occupancy:
        """How a read treats empty slots now (host decision): ``"all"`` when a window cache is
        full, ``"prefix"`` while it fills, ``"mask"`` for per-head caches and recall slots.
        ``static=True`` (compiled steps, CUDA graphs: shapes must not change): ``"mask"``
        instead of ``"prefix"``."""
        self._live("occupancy()")
        return self.reads.occupancy(static)

    def check_occupancy(self, occupancy: Occupancy) -> None:
        """Raise ``ValueError`` unless a read with ``occupancy`` is exact now (host counters)."""
        self._live("check_occupancy()")
        self.checks.check_occupancy(occupancy)

    @property
    def all_valid(self) -> bool:
        """Every slot holds a retained token (``occupancy() == "all"``)."""
        return self.occupancy() == "all"

    @property
    def slot_positions(self) -> Tensor:
        """Device ``int64 [num_layers, heads, slots]``: the position each slot holds per layer
        and head (``-1`` empty); broadcast from one plan for window caches. Read-only view."""
        self._live("slot_positions")
        return self.storage.slot_positions

    @property
    def write_slots(self) -> Tensor:
        """Device ``int64 [num_layers, heads, chunk]``: the slots of the open (or last) span's rows."""
        self._live("write_slots")
        return self.storage.write_slots

    def layer_slot_positions(self, layer: int | None = None) -> Tensor:
        """``int64 [heads, slots]``: ``slot_positions`` of one layer."""
        return self.storage.layer_positions(self.checks.layer(layer))

    def keys(self, layer: int | None = None) -> Tensor:
        """The physical key buffer of ``layer`` (a view of the storage); for quantised storage a
        dequantised copy of every slot, physical order: the stored values exactly (float32
        decodes for a 16-bit cache, whose read rounds them to its dtype before attending)."""
        return self._stored(layer, "k")

    def values(self, layer: int | None = None) -> Tensor:
        """The physical value buffer of ``layer`` (a view of the storage; for quantised storage a
        dequantised copy, as :meth:`keys`)."""
        return self._stored(layer, "v")

    def _stored(self, layer: int | None, which: str) -> Tensor:
        return self.storage.store.stored(self.checks.layer(layer), which)

    def _score_stored(self, layer: int, q: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """The policy's statistics of stored queries ``q`` over ``layer``'s read (the one block read:
        rotated at read, every store and observer's rows alike). The cache does not know the
        attention the caller ran: the sums are the non-causal attention's, and the maxima the
        larger of the non-causal and the position-causal attention's (a query that sees fewer keys
        puts more on each), so that ``dropped_mass_bound`` and the mass budget's guarantee hold
        for a query of either."""
        read = self.reads.read(layer, "mask")
        qt = self.storage.dims.attention(q)
        scale = 1.0 / math.sqrt(qt.shape[-1])
        stat, block = self.policy.statistic, self.policy.score_block
        qr, plan = read.block_plan(qt, scale=scale, statistic=stat, block=block)
        res = read_blocks(qr, plan)
        if res.key_max is None or read.query_positions is None:
            return res.key_max, res.key_sum
        qr, plan = read.block_plan(qt, scale=scale, causal=True, statistic=replace(stat, reduce=("max",)), block=block)
        return torch.maximum(res.key_max, read_blocks(qr, plan).key_max), res.key_sum

    def read(self, layer: int | None = None, occupancy: Occupancy | None = None) -> KVRead:
        """What attention reads from ``layer`` now (:class:`~streamkv.caches.read.KVRead`).
        ``occupancy`` (default :meth:`occupancy`) may be forced to ``"mask"`` for static shapes;
        ``"all"``/``"prefix"`` where they would read an empty slot are refused (``ValueError``).
        The read is valid until the next begin, commit, reset, load, rewind or release."""
        layer = self.checks.layer(layer)
        return self.reads.read(layer, self.checks.occupancy(occupancy, self.reads.occupancy))

    @property
    def chronological_refusal(self) -> str | None:
        """Why this cache has no chronological view (masks over it, cache-relative RoPE), or
        None when it has one."""
        return self.reads.chronological_refusal

    def chronological_keys(self, layer: int | None = None) -> Tensor:
        """Retained keys in position order, ``[sinks | window]`` (a gathered copy). Refused
        (``ValueError``) where heads hold different positions."""
        return self.reads.chronological_view(self.checks.layer(layer))[0]

    def chronological_values(self, layer: int | None = None) -> Tensor:
        """Retained values in position order (a gathered copy); refused as the keys are."""
        return self.reads.chronological_view(self.checks.layer(layer))[1]

    def chronological_positions(self) -> list[int]:
        """Positions of the ``chronological_keys()`` rows (host arithmetic); refused as they are."""
        self._live("chronological_positions()")
        refusal = self.reads.chronological_refusal
        if refusal:
            raise ValueError(f"no chronological view: {refusal}")
        return self.layout.retained_positions(self.end)

    # ================================================================ state dicts
    def config(self) -> dict[str, Any]:
        """What must match for a state dict to load: kind, policy, layout, shapes, dtype."""
        return self.states.config()

    def state_dict(self) -> dict[str, Any]:
        """A snapshot of the cache's whole state: host counters and *copies* of every tensor
        (so a state taken now restores this moment even after the stream moves on). Refused
        (``RuntimeError``) for a cache with recall slots: their contents belong to an observer;
        and while an observer adds rows to its reads (a compressed tier): a state without them
        would continue another stream. :meth:`export_stream` is refused alike."""
        adders = sorted({type(o).__name__ for o in self.observers if o.adds_segments})
        if adders:
            raise RuntimeError(
                f"state_dict() / export_stream(): this cache's reads include the rows of an observer "
                f"({', '.join(adders)}), which its state does not carry; a cache loading it would attend fewer "
                f"tokens and continue another stream. Remove the observer first (remove_observer: the stream then "
                f"goes on without its rows), or keep the stream in this process")
        return self.states.state_dict()

    def validate_state(self, state: dict[str, Any]) -> tuple[int, int, bool]:
        """Raise as ``load_state_dict(state)`` would for the cache's own reasons; else return
        ``(end, span, open)``. Changes nothing (observers are asked in :meth:`prepare_load`)."""
        return self.states.validate(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` into the existing buffers (copies).
        Everything is validated first (kind, policy, layout, shapes, dtype, every tensor, the
        counters against the layout arithmetic, the slot positions against the counters, the
        policy's statistics) and the observers may veto; a rejected state changes nothing."""
        self.prepare_load(state).run()

    def prepare_load(self, state: dict[str, Any], together: Sequence[KVCache] = ()) -> Step:
        """Validate ``state`` and let the observers veto the load; nothing changes until the step runs.
        ``together``: the other caches loaded in the same step (a CacheSet's)."""
        counters = self.states.validate(state)
        rope = self.rope_at_read
        still = None if rope is None else (
            lambda: rope.check_change([self, *together], state["rope_state"], "a load of this cache's state"))
        if still is not None:  # and again when the step runs: the shared map may move in between
            still()
        own = self.storage.store.prepare_writes("all", "a state-dict load", self.branches.kept_pages())
        change = Change(self, "load", state=state)
        with _cancelled_if_refused(own):
            actions = self._observers.prepare(change)

        def apply() -> None:
            if own is not None:
                own()
            self.branches.forget()
            self.states.load(state, counters)

        return self._step(apply, change, actions, "a state-dict load", own, still)

    # ================================================================ branches
    def fork(self, n: int = 1) -> list[KVCache]:
        """``n`` branches that continue the stream as it stands: each shares every page of this cache
        (built with ``pages=``) and writes its own from its first write there (copy on write, a page
        at a time); this cache stays usable. Costs metadata copies, not K/V bytes. Refused (nothing
        changes) with a span open, with observers, or without pages; see :mod:`.branches`."""
        return self.branches.fork(n)

    def rewind(self, chunk_idx: int) -> None:
        """Return the stream to the boundary before chunk ``chunk_idx`` (one of :attr:`rewind_chunks`,
        kept by ``pages={'history': k}``), exactly as it was then; an open span is dropped."""
        self.branches.rewind(chunk_idx)

    @property
    def rewind_chunks(self) -> list[int]:
        """The chunks :meth:`rewind` can return to."""
        self.checks.alive("rewind_chunks")
        return self.branches.chunks()

    def _live(self, what: str) -> None:
        if not torch.compiler.is_compiling():  # a host flag: a trace of a live cache needs no guard on it
            self.checks.alive(what)

    def release(self) -> None:
        """Give this cache's pages (and kept boundaries) back to the pool its branches share; every
        later call that reads or changes its stream is refused (what it was built as and where its
        stream stood -- shapes, kind, layout, counters -- still answer), and so is every read or
        prepared step made before. Refused (ValueError, nothing changes) for a cache built without
        ``pages=``: it has no pages to give."""
        self.branches.release()

    def export_stream(self, path: str | None = None) -> bytes | None:
        """The stream as bytes (or written to ``path``): every slot's K/V in slot order and the
        metadata, with a SHA-256 of its contents; :meth:`import_stream` continues it exactly in
        another cache (another process), of the same configuration."""
        return self.branches.export(path)

    def import_stream(self, source: bytes | str) -> None:
        """Continue a stream :meth:`export_stream` wrote (bytes or a path): the checksum and every
        check of :meth:`load_state_dict` first (kind, layout, shapes, format, keys raw or rotated)."""
        self.branches.import_(source)

    # ================================================================ handles, report
    def layer(self, layer: int) -> LayerView:
        """A handle on one layer: what an attention module needs."""
        return LayerView(self, self.checks.layer(layer))

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V buffers (all layers, recall slots included)."""
        return self.storage.nbytes

    def report(self) -> dict[str, Any]:
        """What the cache holds and has evicted (synchronises): the policy's parameters, the
        capacity, kept tokens per (layer, head) and their mean; the device, dtype, whether keys are
        stored raw (rotated at read by which map); the storage (format; bytes of codes, scales and
        full-precision rows; pages; what a plain bfloat16 cache of the same slots holds); for
        scored policies the evictions, overflows and the last commit's dropped-mass bound per
        (layer, head). Refused on a released cache."""
        self.checks.alive("report()")
        kept = (self.storage.slot_positions[..., : self.layout.capacity] >= 0).sum(-1)
        out: dict[str, Any] = {
            "kind": self.name, **self.policy.params(), "capacity": self.layout.capacity,
            "kept_tokens": kept.tolist(), "kept_tokens_mean": float(kept.float().mean()),
            "device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
            "keys": "raw, rotated at read" if self.rope_at_read is not None else "as written",
            "position_map": self.rope_at_read.current.name if self.rope_at_read is not None else None,
            "storage": self.storage.store.describe(),
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
        """Tell ``observer`` of every change from now on (see :mod:`.observers`); returns it.
        The observer may refuse (``on_attach``), e.g. a certifier on a cache that evicted."""
        return self._observers.add(observer)

    def remove_observer(self, observer: CacheObserver) -> None:
        self._observers.remove(observer)

    def add_eviction_listener(self, listener: Callable[[EvictionEvent], None]) -> CacheObserver:
        """Call ``listener(event)`` once tokens have left (an observer with ``on_evict`` only)."""
        return self._observers.add(EvictionListener(listener))

    @property
    def observers(self) -> tuple[CacheObserver, ...]:
        return tuple(self._observers.members)

    def __repr__(self) -> str:
        L = self.layout
        if self.lifecycle.released:
            return (f"{type(self).__name__}(policy={self.policy!r}, sink={L.sink}, window={L.window}, chunk={L.chunk}, "
                    f"released: its pages went back to the pool)")
        st = self.storage.store.describe()
        held = f"{_mib(st['bytes'])} held ({st['format']}"
        if st["code_bytes"]:
            held += f": codes {_mib(st['code_bytes'])}, scales {_mib(st['scale_bytes'])}, full precision " \
                    f"{_mib(st['full_precision_bytes'])}"
        held += f"; a plain bf16 cache: {_mib(st['bf16_bytes'])})"
        extra = ""
        if self.rope_at_read is not None:
            extra += f", keys raw (rotated at read: {self.rope_at_read.current.name})"
        if "pages" in st:
            pg = st["pages"]
            extra += f", pages {pg['own']} of {pg['page']} slots ({pg['shared']} shared; pool {pg['pool_used']}/" \
                     f"{pg['pool_capacity']})"
        return (
            f"{type(self).__name__}(policy={self.policy!r}, sink={L.sink}, window={L.window}, chunk={L.chunk}, "
            f"k_shape={self.k_shape}, v_shape={self.v_shape}, seq_dim={self.seq_dim}, num_layers={self.num_layers}, "
            f"dtype={self.dtype}, device={self.device}, end={self.end}, open_span={self.open_span}, {held}{extra})"
        )


@contextmanager
def _cancelled_if_refused(own: PlannedPages | None):
    """The pages a planned copy on write reserved go back at once when the change is refused or
    vetoed (not when the exception, which holds the plan, is collected)."""
    try:
        yield
    except BaseException:
        if own is not None:
            own.cancel()
        raise


#: what torch's allocators say when a size cannot be had
_NO_MEMORY = ("can't allocate memory", "Storage size calculation overflowed", "out of memory", "not enough memory")


@contextmanager
def _allocating(what: str):
    """A cache's buffers that cannot be allocated: ``MemoryError`` naming the configuration (the
    allocator's own ``RuntimeError`` names sizes, not the arguments that asked for them)."""
    try:
        yield
    except RuntimeError as exc:
        if not any(m in str(exc) for m in _NO_MEMORY):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MemoryError(f"this cache's buffers cannot be allocated ({what}): {first[:200]}") from None
