"""``KVRead``: what attention reads from one layer of a cache, decided in one place.

A cache's :meth:`~streamkv.caches.KVCache.read` (or a layer handle's ``update``) returns it;
:func:`~streamkv.attention.attend` consumes it. Its :meth:`KVRead.segments` are the one read
contract (:class:`~streamkv.stores.Segment`): runs of stored rows (dense, or codes to decode;
possibly paged) with the positions each row holds per head, the cache's own and any an observer
adds to the read (a compressed tier's quantised history). ``attend`` turns them into attention,
and into the statistics the cache's policy declared, in one pass.

How empty slots are handled (``occupancy``), decided here once:

``all``     every slot holds a retained token: attend over the whole buffer, no mask;
``prefix``  the occupied slots are ``[0, visible)``: attend over that slice;
``mask``    a ``-inf`` bias on empty slots, built on the device from ``positions``
            (static shapes: what compiled steps, CUDA graphs and per-head caches use).

For a user's own kernel: ``keys`` / ``values`` are the dense buffers as they lie and
``bias()`` masks every empty slot (never None while one is empty) -- offered only where that is
exactly what to attend (one dense, unpaged segment, keys stored as attended); elsewhere they
refuse with the reason (codes, raw keys rotated at read, extra segments).

The chronological path (keys in position order, needed for masks over positions and for
cache-relative RoPE) exists only where every head holds the same positions; elsewhere
``chronological_refusal`` says why not.
"""

from __future__ import annotations

import functools

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from ..blockread import BlockPlan, Statistic
from ..masks import position_bias

if TYPE_CHECKING:
    from ..stores import Dims, Segment
    from .lifecycle import Lifecycle

__all__ = ["KVRead", "Occupancy"]

Occupancy = Literal["all", "prefix", "mask"]


@dataclass(frozen=True)
class KVRead:
    """One layer of a cache, ready to be attended to (see the module docstring).

    Attributes:
        dims: the cache's :class:`~streamkv.stores.Dims` (layout of a layer, slots).
        dtype, device: of the cache (queries must match).
        positions: device ``int64 [H, S]``, the position each slot holds per head (``-1``: empty).
        occupancy, visible: how empty slots are handled; ``visible`` slots are read (the
            prefix length for ``"prefix"``).
        query_positions: device ``int64 [span]``, the positions of the open span's rows (the
            queries of the chunk being written), for position-causal masks; None if nothing is open.
        empty: no token has entered the cache (attention would read nothing).
        num_retained: rows of the chronological view (host int), None where it is refused.
        chronological: returns ``(keys, values, positions)`` in position order (a gathered copy;
            ``positions`` a host list), or None where ``chronological_refusal`` says why.
        scorer, statistic: for a policy that needs queries: the per-slot statistics it declared
            (:class:`Statistic`) go to ``scorer(max, sum)`` (``[H, S]`` each, None if not asked).
        name: ``"<kind> layer <i>"``, for messages.
        source: ``source(positions)`` gives the store's segments, whose slots hold ``positions``.
        generation, lifecycle: the lifecycle generation the read was made in; a read kept
            across a begin, commit, reset, load, rewind or release is refused (:meth:`check_current`). None in a
            compiled step (traced reads are rebuilt every call).
        rope_at_read: None when keys are stored as attended; else the cache's
            :class:`~streamkv.rope_at_read.RopeAtRead`: raw keys, rotated with the queries by
            ``attend`` (a block of slots at a time).
        extras: the segments observers add to this read (the compressed tier), or None.
        answer: ``answer(q, **options)``: a :class:`~streamkv.caches.observers.ReadAnswer` an observer
            already computed for these queries and options (a certifying compressed tier), or None;
            None where no observer adds rows.
    """

    dims: Dims
    dtype: torch.dtype
    device: torch.device
    positions: Tensor
    occupancy: Occupancy
    visible: int
    query_positions: Tensor | None
    empty: bool
    num_retained: int | None
    chronological: Callable[[], tuple[Tensor, Tensor, list[int]]] | None
    chronological_refusal: str | None
    scorer: Callable[[Tensor | None, Tensor | None], None] | None
    statistic: Statistic | None
    name: str
    source: Callable[[Tensor], list[Segment]]
    generation: int | None = None
    lifecycle: Lifecycle | None = None
    rope_at_read: Any = None
    extras: Callable[[], list[Segment]] | None = None
    answer: Callable[..., Any] | None = None
    #: what this read computed and its later passes (denoising steps) reuse while the slot positions
    #: are unchanged: the store's segments, masks of their blocks (keyed by the positions' version)
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def seq_dim(self) -> int:
        return self.dims.seq

    @property
    def head_axis(self) -> int | None:
        return self.dims.head_axis

    @property
    def k_shape(self) -> tuple[int, ...]:
        """One layer's key shape with every slot at ``seq_dim``."""
        return self.dims.shape("k", self.dims.slots)

    def check_current(self) -> None:
        """Raise ``ValueError`` if the cache's lifecycle moved on since this read was made (a
        begin, commit, reset, load, rewind or release): every accessor of what the read holds
        (:meth:`segments`, :meth:`stored`, :attr:`keys`, :attr:`values`, :meth:`bias`,
        :meth:`causal_bias`) and ``attend`` call it first, so a stale read is refused, never
        answered from slots that now hold other tokens."""
        if self.lifecycle is not None and not torch.compiler.is_compiling():
            self.lifecycle.check_current(self.generation, f"this read of {self.name}")

    def segments(self) -> list[Segment]:
        """What the read attends (the store's segments at this read's :attr:`positions`, kept while
        they are unchanged; then an observer's, built anew). Refused for a stale read."""
        self.check_current()
        memo = self._kept()
        own = None if memo is None else memo.get("own")
        if own is None:
            own = self.source(self.positions)
            if memo is not None:
                memo["own"] = own
        return own + self.extras() if self.extras is not None else own

    def _kept(self) -> dict | None:
        """The memo of this read's current positions (None in a compiled step: traced each call; and
        for inference tensors, which keep no version counter to tell a change by)."""
        if self.generation is None or torch.compiler.is_compiling() or self.positions.is_inference():
            return None
        version = self.positions._version  # bumped by any in-place change (recall slots filled, a load)
        if self._memo.get("version") != version:
            self._memo.clear()
            self._memo["version"] = version
        return self._memo

    def block_plan(self, qt: Tensor, *, scale: float, causal: bool = False, window: int | None = None,
                   statistic: Statistic | None = None, block: int = 16384, lse: bool = False,
                   segments: list[Segment] | None = None) -> tuple[Tensor, BlockPlan]:
        """The block read of queries ``qt`` (attention layout, as the model computed them): the
        queries rotated by the cache's position map where it rotates at read, and the
        :class:`~streamkv.blockread.BlockPlan` over this read's segments (keys rotated a block at a
        time; a rotating cache's block size is its ``RopeAtRead``'s)."""
        rotation = None
        if self.rope_at_read is not None:
            rotation = self.rope_at_read.plan(self)
            qt = rotation.queries(qt)
            block = self.rope_at_read.block
        segments = self.segments() if segments is None else segments
        if self.occupancy == "all":  # every slot holds a position: a segment of the slots' positions hides no row
            segments = [replace(s, visible=True) if s.positions is self.positions and not s.visible else s
                        for s in segments]
        return qt, BlockPlan(segments, self.dims, scale, self.query_positions, causal, window, rotation, statistic,
                             self.dims.slots, block, lse, self._kept())

    def stored(self) -> tuple[Tensor, Tensor]:
        """The keys and values every slot holds, as stored (layer layout, every slot; raw keys of a
        cache that rotates at read stay raw): the buffers themselves for one dense segment, else a
        decoded copy (codes decoded, rotated back from their storage basis; in float32 where a 16-bit
        cache's codes decode to values its dtype may not hold, every row exact). Rows an observer adds
        (a compressed tier) are not slots and are left out. Refused for a stale read."""
        segs = self.segments()
        if len(segs) == 1 and segs[0].contiguous and segs[0].slots == 0:
            return self.dims.from_attention(segs[0].keys), self.dims.from_attention(segs[0].values)
        S, ha = self.dims.slots, self.dims.head_axis
        out = []
        for which in (0, 1):
            dest, rows = None, []
            for seg in segs:
                slots = seg.slot_index()
                if slots is None:
                    continue
                x = seg.load(0, seg.n)[which]
                basis = seg.k_basis if which == 0 else seg.v_basis
                if basis is not None:
                    x = x @ basis.to(x.dtype)
                rows.append((x, slots, seg.positions.expand_as(slots) >= 0))
            if rows:  # decoded codes (float32) beside full-precision rows (the cache's dtype): the wider holds both
                x = rows[0][0]
                wide = functools.reduce(torch.promote_types, (r[0].dtype for r in rows))
                dest = torch.zeros((*x.shape[:-2], S + 1, x.shape[-1]), dtype=wide, device=x.device)
            # Two segments may name one slot (a quantised store's codes and its full-precision row of
            # a hot slot: only the hot row holds the slot's token, the code row is stale). Rows that
            # hold a position are scattered last, so a slot reads the row that holds its token; rows of
            # no slot go to a spare row.
            for held_pass in (False, True):
                for x, slots, held in rows:
                    idx = torch.where((slots >= 0) & (held == held_pass), slots, S)  # [H, n]
                    shape = [1] * (x.dim() - 2) + [idx.shape[-1], 1]
                    if ha is not None:
                        shape[ha] = idx.shape[0]
                    dest.scatter_(-2, (idx[:1] if ha is None else idx).view(shape).expand_as(x), x.to(dest.dtype))
            out.append(self.dims.from_attention(dest[..., :S, :]))
        return out[0], out[1]

    # ------------------------------------------------------ for a user's own kernel
    def _plain(self) -> Segment:
        """The one dense segment a user's own kernel may attend as it lies; refused (stale, or no such
        segment) with the reason."""
        self.check_current()
        why = []
        if self.rope_at_read is not None:
            why.append("its keys are raw and rotated at read by a position map (attend() rotates them)")
        if self.extras is not None:
            why.append("an observer adds rows to the read (a compressed tier): attend() reads them in one softmax")
        segs = self.segments() if not why else []
        if not why and (len(segs) != 1 or not segs[0].contiguous):
            why.append("its K/V are not one dense buffer (quantised codes, or pages): attend() reads them block "
                       "by block (read.segments() gives the stored form)")
        if why:
            raise ValueError(f"{self.name} has no plain K/V buffers to attend: " + "; ".join(why))
        return segs[0]

    @property
    def keys(self) -> Tensor:
        """The layer's key buffer as it lies (layer layout, every slot; a view), where it is exactly
        what attention reads; refused otherwise (see the module docstring)."""
        return self.dims.from_attention(self._plain().keys)

    @property
    def values(self) -> Tensor:
        """The layer's value buffer as it lies (refused as :attr:`keys` is)."""
        return self.dims.from_attention(self._plain().values)

    def bias(self, dtype: torch.dtype = torch.float32) -> Tensor | None:
        """The additive bias over every slot (``-inf`` on empty ones), broadcastable against scores
        ``[..., Q, S]`` of the layer moved to ``[..., T, D]``; None only when every slot is occupied
        (``"all"``). Attend over all of :attr:`keys` with it (or over the first ``visible`` slots).
        Offered where :attr:`keys` is (a bias over rows that are not what attention reads would be
        a wrong answer), and refused as it is."""
        self._plain()
        if self.occupancy == "all":
            return None
        return self.dims.lay_out_heads(position_bias(self.positions, None, dtype))

    def causal_bias(self, query_positions: Tensor, dtype: torch.dtype = torch.float32, window: int | None = None,
                    groups: int = 1) -> Tensor:
        """The bias of position-causal attention over the slots read (``[:visible]``): a query at
        position ``p`` sees the occupied slots holding positions ``<= p`` (with ``window``, only
        those ``> p - window``). ``query_positions``: ``int64 [Q]``. Broadcastable against ``[..., Q, S]``
        (``[..., G*Q, S]`` with ``groups``: grouped queries folded into the rows, row ``g*Q + i``
        at query ``i``). Offered and refused as :meth:`bias`."""
        self._plain()
        return self.dims.lay_out_heads(position_bias(self.positions[:, : self.visible], query_positions, dtype, window,
                                                     groups))
