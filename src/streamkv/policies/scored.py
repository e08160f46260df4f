"""The base of the scored policies: per-head slots, a :class:`Scores` object at every commit,
and one place for selection and overflow accounting.

Each (layer, head) holds its own set of positions (a per-head plan); sinks are pinned at
slots ``[0, sink)`` of every head. ``begin`` gives each (layer, head) its lowest free window
slots (nothing moves, nothing leaves); writes are an ``index_put_`` of (slot, head) pairs
(graph-capturable); ``commit`` ranks the held tokens and evicts, per (layer, head).

A subclass ranks the held tokens from a :class:`Scores` (:meth:`ScoredPolicy.priority`, lower
leaves first; ties by the older position first) and says how many it wants gone
(:meth:`ScoredPolicy.wanted`; :class:`FixedBudget` keeps a number per head). ``Scores`` carries
the positions, the attention statistics of the span's queries when the policy needs them
(``needs_queries``: ``max_j = max_i p_ij`` and ``sum_j = sum_i p_ij`` over the span's queries
and the batch, from the model's own attention pass, or from the queries given to
``update(k, v, q)`` scored at the commit: maxima also of the position-causal attention, where
larger, as the cache does not know the caller's), and lazy per-head views of the keys and values. The
candidates are the held slots that are not sinks and (with ``protect_newest``) not the span
just committed. If the wish leaves fewer than ``chunk`` free window slots for the next span,
more go, in the same order: an *overflow*, counted per (layer, head).

The commit refuses (``RuntimeError``, naming the layers and the chunk) when the policy needs
queries and a layer's never arrived, and (``ValueError``) when the priorities are not
finite; either way nothing changed. It synchronises with the device once.
``dropped_mass_bound`` (per (layer, head), the last commit) is ``sum_{j evicted} max_j``: it
bounds, to the statistics' rounding (probabilities from float32 scores, or the cache dtype's
where wider: up to ~1e-6 below the exact figure; not rounded outward, unlike a certificate),
the mass any one query the statistic counts put on the evicted tokens -- every query of
the scoring span, or the newest ``rows`` where the policy's statistic counts only those
(SnapKV's observation window: an older query of the span may have lost more). NaN where a
non-finite statistic left (``check_finite=False``: nothing bounds it).

Why one module: the selection, its accounting and the Scores a policy ranks are the one
contract every scored kind inherits; split, each part would read the others' fields.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..blockread import Statistic
from ..layout import CacheLayout
from ..storage import KVStorage, check_int
from .base import SlotPolicy, Step

__all__ = ["ScoredPolicy", "FixedBudget", "KeptNorms", "Scores", "check_scores"]

_BIG = torch.iinfo(torch.long).max


@dataclass(frozen=True)
class Scores:
    """What a scored policy ranks at a commit: the held slots of every (layer, head).

    Attributes:
        positions: ``int64 [L, H, cap]``, the position each managed slot holds (``-1``: empty).
        valid: ``bool [L, H, cap]``, the slot holds a token.
        start, n: the span being committed, ``[start, start + n)``.
        key_max, key_sum: ``float64 [L, H, cap]``, the attention statistics of the span's
            queries (``max_i p_ij``, ``sum_i p_ij``); None for a policy that does not need
            queries.
    """

    positions: Tensor
    valid: Tensor
    start: int
    n: int
    key_max: Tensor | None
    key_sum: Tensor | None
    storage: KVStorage
    stored_queries: Tensor | None = None
    #: what a policy's priority derived and its on_commit keeps (a veto drops it with the Scores)
    derived: dict = field(default_factory=dict)

    @property
    def span_slots(self) -> Tensor:
        """``int64 [L, H, n]``: the slots of the span being committed (per head)."""
        return self.storage.write_slots[..., : self.n]

    def span_keys(self) -> Tensor:
        """The committed span's keys as written, per head: ``[L, H, R, n, D]`` (``O(chunk)``: the
        statistic of a new token, kept per slot by the policy, costs its span, not the history)."""
        return self.storage.span("k", self.n)

    def queries(self) -> Tensor:
        """The span's queries per layer as given to ``update(k, v, q)`` (``[L, *q rows]``, the
        layer layout); refused when a layer's queries were not stored (they came to ``attend``)."""
        if self.stored_queries is None:
            raise ValueError("the span's queries were not stored: pass them to update(k, v, q) for a policy that "
                             "reads them")
        return self.stored_queries

    def keys(self) -> Tensor:
        """The held keys per head, ``[L, H, R, cap, D]`` (``R``: the other leading dims, e.g.
        the batch), a view of the storage where the layout allows (read-only)."""
        return self.storage.head_view("k")[..., : self.storage.capacity, :]

    def values(self) -> Tensor:
        """The held values per head, ``[L, H, R, cap, Dv]`` (read-only)."""
        return self.storage.head_view("v")[..., : self.storage.capacity, :]


class ScoredPolicy(SlotPolicy):
    """Per-head slots chosen from the chunk's attention. Subclasses define :meth:`priority`
    and :meth:`wanted` (and, if they keep state, :meth:`on_commit` / :meth:`on_new`).

    Args:
        protect_newest: never evict the chunk just committed.
        score_block: query rows per block when stored queries are scored at the commit (only
            for a policy that needs queries).
        check_finite: refuse a commit whose scores are not finite (NaN or inf keys or queries),
            changing nothing: one read of the device per commit. ``False``: no read-back (a commit
            captured in a CUDA graph); such tokens then leave first, counted in ``nonfinite``.
    """

    per_head = True
    retains_window = False
    needs_queries = True
    #: the per-key statistics the read computes for this policy (rows, reductions); ``max`` is
    #: also what ``dropped_mass_bound`` reports
    statistic: ClassVar[Statistic] = Statistic()
    #: whether :meth:`priority` reads the statistics of slots no policy evicts: the sinks, and the
    #: newest chunk under ``protect_newest`` (one that pools over neighbours, or keeps a public
    #: score of every slot, reads them): False lets the read skip them (``Statistic.skip``,
    #: ``Statistic.newest``)
    reads_protected_statistics: ClassVar[bool] = True
    #: set by the cache: ``reader(layer, q) -> (max, sum)`` scores stored queries ``q`` (layer
    #: layout) over the layer's read, through the cache's one read (used when attention ran in
    #: another kernel)
    reader: Callable[[int, Tensor], tuple[Tensor | None, Tensor | None]] | None = None

    def __init__(self, *, protect_newest: bool = True, score_block: int | None = None,
                 check_finite: bool = True) -> None:
        for name, flag in (("protect_newest", protect_newest), ("check_finite", check_finite)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")
        if score_block is not None and not self.needs_queries:
            raise TypeError(f"the {self.name} policy scores keys, not queries: score_block does not apply")
        self.protect_newest, self.check_finite = protect_newest, check_finite
        self.score_block = check_int("score_block", 256 if score_block is None else score_block, 1)

    def params(self) -> dict[str, Any]:
        return {"protect_newest": self.protect_newest, **({} if self.check_finite else {"check_finite": False})}

    def check_layout(self, layout: CacheLayout) -> None:
        need = layout.chunk * (2 if self.protect_newest else 1)
        if layout.window < need:
            raise ValueError(
                f"window ({layout.window}) must hold {'the newest chunk and ' if self.protect_newest else ''}the next "
                f"chunk: >= {need} slots besides the {layout.sink} sink(s), got {layout.window}"
            )

    # ------------------------------------------------------------- subclass hooks
    def priority(self, scores: Scores) -> Tensor:
        """``[L, H, cap]`` eviction order: lower leaves first (only candidates are read)."""
        raise NotImplementedError

    def wanted(self, sorted_priority: Tensor | None, candidates: Tensor, protected: Tensor) -> Tensor:
        """``[L, H]``: how many of the candidates (in order) to evict. ``sorted_priority``: every
        candidate's priority in eviction order (``inf`` past the candidates) when the policy bounds
        no eviction count (:meth:`most_evicted` None); None when it does: the selection then orders
        nothing, and the count must follow from ``candidates``/``protected`` (counts ``[L, H]``)."""
        raise NotImplementedError

    def on_commit(self, evict: Tensor, priority: Tensor, valid: Tensor, scores: Scores) -> None:
        """After the eviction is applied (state updates; ``scores.derived`` holds what
        :meth:`priority` computed for it: planning must not change the policy)."""

    def on_new(self, slots: Tensor) -> None:
        """Slots ``[L, H, C]`` that a (re)opened chunk takes."""

    def on_reopen(self) -> None:
        """The last committed span is reopened (before :meth:`on_new` of its slots): state its
        commit added is taken back, so that its second commit replaces the first."""

    # ------------------------------------------------------------------ binding
    def bind(self, storage: KVStorage, layout: CacheLayout, lifecycle) -> None:
        super().bind(storage, layout, lifecycle)
        if self.needs_queries and not self.reads_protected_statistics:
            self.statistic = replace(self.statistic, skip=layout.sink, newest=self.protect_newest)
        L, H, cap, C, dev = storage.num_layers, storage.heads, storage.capacity, layout.chunk, storage.device
        self._arange_c = torch.arange(C, device=dev)
        self._window_idx = torch.arange(layout.sink, cap, device=dev)
        self._window_count = torch.arange(1, cap - layout.sink + 1, device=dev)  # window slots up to each
        self._key_max = torch.zeros((L, H, cap), dtype=torch.float64, device=dev)
        self._key_sum = torch.zeros((L, H, cap), dtype=torch.float64, device=dev)
        # per layer: 1 once attention delivered the statistics since the layer's last write;
        # 1 once update(k, v, q) stored queries since then (device flags: graph-safe)
        self._fresh = torch.zeros(L, dtype=torch.int8, device=dev)
        self._has_queries = torch.zeros(L, dtype=torch.int8, device=dev)
        # the same flags as the host saw the calls (eager and compiled steps: no read-back at the
        # commit); a captured graph's replay updates only the device flags, read when these lack any
        self._seen = [[False, False] for _ in range(L)]
        # [L, *q rows shape]; reallocated only if queries of another shape arrive (grouped heads, spans)
        self._queries = torch.zeros((L, *storage.chunk_shape("k")), dtype=storage.dtype, device=dev)
        self.overflows = torch.zeros((L, H), dtype=torch.long, device=dev)
        #: tokens evicted with a non-finite score (``check_finite=False``), per (layer, head)
        self.nonfinite = torch.zeros((L, H), dtype=torch.long, device=dev)
        self.evictions = torch.zeros((L, H), dtype=torch.long, device=dev)
        self.dropped_mass_bound = torch.zeros((L, H), dtype=torch.float64, device=dev)

    # --------------------------------------------------------- queries, scores
    def on_write(self, layer: int) -> None:
        """A write replaced the chunk's K/V: earlier statistics and queries no longer apply."""
        self._fresh[layer].zero_()
        self._has_queries[layer].zero_()
        self._seen[layer] = [False, False]

    def take_queries(self, layer: int, q: Tensor) -> None:
        """Keep the queries for a commit-time scoring pass (used only if attention does not
        deliver the statistics)."""
        if self._queries.shape[1:] != q.shape or self._queries.dtype != q.dtype:
            self._queries = torch.zeros((self.storage.num_layers, *q.shape), dtype=q.dtype, device=q.device)
        self._queries[layer].copy_(q)
        self._has_queries[layer].fill_(1)
        self._seen[layer] = [self._seen[layer][0], True]

    def receive(self, layer: int, key_max: Tensor | None, key_sum: Tensor | None) -> None:
        """Statistics ``[H, S]`` of the attention that just read ``layer`` (from ``attend``; None:
        not declared by :attr:`statistic`)."""
        cap = self.storage.capacity
        for mine, got in ((self._key_max, key_max), (self._key_sum, key_sum)):
            if got is not None:
                mine[layer].copy_(got[:, :cap])
        if key_max is not None:  # any kernel's rounding above 1 (a probability): the range state dicts check
            self._key_max[layer].clamp_(max=1.0)
        self._fresh[layer].fill_(1)
        self._seen[layer] = [True, self._seen[layer][1]]

    def _score_stored(self, layer: int) -> tuple[Tensor, Tensor]:
        """Statistics of the stored queries against ``layer``'s slots now (a second read)."""
        kmax, ksum = self.reader(layer, self._queries[layer])
        cap = self.storage.capacity
        return (self._key_max[layer] if kmax is None else kmax[:, :cap],
                self._key_sum[layer] if ksum is None else ksum[:, :cap])

    # -------------------------------------------------------------------- begin
    def begin(self, start: int, n: int, advance: bool) -> Step:
        st, S = self.storage, self.layout.sink
        n_sink = max(0, min(S - start, n))
        n_win = n - n_sink
        pos = self._arange_c[:n] + start  # [n]
        plan = st.plan[..., :n]
        if advance:  # the lowest free window slots of every (layer, head); sink rows pinned (planned
            # into a new tensor: a begin that is refused touches no tensor of the cache)
            plan = plan.clone()
            if n_sink:
                plan[..., :n_sink] = pos[:n_sink]
            if n_win:  # each window slot's rank: the free ones by index, then the held ones by index
                free = st.positions[..., S : st.capacity] < 0  # [L, H, W]
                ahead = free.cumsum(-1)  # free slots up to each (a held one: held ones up to it, index + 1 - that)
                rank = torch.where(free, ahead, ahead[..., -1:] + self._window_count - ahead) - 1
                dest = torch.where(rank < n_win, rank, n_win)  # the first n_win ranks; the rest into a spare column
                got = torch.empty((*free.shape[:-1], n_win + 1), dtype=torch.long, device=free.device)
                plan[..., n_sink:] = got.scatter_(-1, dest, self._window_idx.expand_as(dest))[..., :n_win]

        def apply() -> None:
            if advance:
                st.plan[..., :n].copy_(plan)
            # a reopened span keeps its slots (re-marked in case it was evicted: protect_newest=False)
            target = st.plan[..., :n]
            st.positions.scatter_(-1, target, pos.expand_as(target))
            if not advance:
                self.on_reopen()
            self.on_new(target)

        return Step(apply, writes=plan)

    # ------------------------------------------------------------------- commit
    def commit(self, start: int, n: int) -> Step:
        st, L = self.storage, self.storage.num_layers

        def what() -> str:  # built only for a message: a traced commit must not specialise on the position
            return f"chunk {start // self.layout.chunk} (positions [{start}, {start + n}))"

        key_max = key_sum = None
        has_q = []
        if self.needs_queries:
            fresh, has_q = (list(x) for x in zip(*self._seen))  # the host's record: no read-back
            if not all(f or q for f, q in zip(fresh, has_q)):  # a captured replay tells the device flags only
                fresh, has_q = torch.stack([self._fresh, self._has_queries]).bool().tolist()
            missing = [layer for layer in range(L) if not fresh[layer] and not has_q[layer]]
            if missing:
                raise RuntimeError(
                    f"the {self.name} policy needs the queries of {what()}, and "
                    f"layer(s) {missing} have none since their last write: attend through streamkv.attention.attend, "
                    f"or pass them to update(k, v, q); nothing was committed"
                )
            key_max, key_sum = self._key_max, self._key_sum
            stale = [layer for layer in range(L) if not fresh[layer]]
            if stale:  # score the stored queries (local tensors: a refused commit changes nothing)
                key_max, key_sum = key_max.clone(), key_sum.clone()
                for layer in stale:
                    key_max[layer], key_sum[layer] = self._score_stored(layer)
        pos = st.positions[..., : st.capacity]
        valid = pos >= 0
        stored = self._queries if self.needs_queries and all(has_q) else None
        scores = Scores(pos, valid, start, n, key_max, key_sum, st, stored)
        prio = self.priority(scores)
        if self.check_finite:
            finite = torch.isfinite(torch.where(valid, prio, 0.0)).all(dim=(-1, -2))
            if not bool(finite.all()):  # one read-back per commit (check_finite=False: none)
                bad = (~finite).nonzero().flatten().tolist()
                raise ValueError(
                    f"{'attention statistics' if self.needs_queries else f'{self.name} key scores'} of "
                    f"{what()} are not finite in layer(s) {bad}: NaN or inf in the cached "
                    f"keys or the queries, or scores that overflow from huge ones; the chunk stays open and "
                    f"nothing was evicted (check_finite=False evicts such tokens first instead, and counts them)"
                )
        bad = valid & ~torch.isfinite(prio)
        prio = torch.where(bad, -math.inf, prio)  # (check_finite=False) non-finite scores leave first
        # the span's first position from the device (a captured commit reads the chunk it replays)
        evict, overflow, n_evict, dropped = self._select(self.lifecycle.query_positions()[:1], pos, valid, prio, key_max)

        def apply() -> None:
            st.positions[..., : st.capacity].masked_fill_(evict, -1)
            self.overflows += overflow
            self.evictions += n_evict
            self.nonfinite += (bad & evict).sum(-1)
            self.dropped_mass_bound.copy_(dropped)
            self.on_commit(evict, prio, valid, scores)

        def evicted() -> Tensor:
            return torch.nn.functional.pad(evict, (0, st.recall_slots))

        # where the host knows that every position so far stays, there is no eviction to tell of
        kept = self.kept(start + n)
        stays = kept is not None and kept >= start + n
        return Step(apply, None if stays else evicted, info={"overflow": overflow.bool(), "dropped_mass_bound": dropped})

    def _select(self, start: Tensor, pos: Tensor, valid: Tensor, prio: Tensor, key_max: Tensor | None):
        """Evict, per (layer, head), the first ``n_evict`` candidates in (priority, position) order:
        a full sort when the policy bounds no eviction count; else no sort at all: the ``n``-th
        lowest priority found by a selection (:func:`_nth_lowest`), the candidates below it and the
        oldest of its ties (as many as are still wanted) -- the same set."""
        L = self.layout
        protected = valid & (pos < L.sink)
        if self.protect_newest:
            protected |= valid & (pos >= start)
        cand = valid & ~protected
        cap = pos.shape[-1]
        key = torch.where(cand, prio, math.inf)
        n_cand = cand.sum(-1)
        free = (~valid[..., L.sink :]).sum(-1)
        k = self.most_evicted()
        if k is None or k >= cap:
            # candidates by (priority, position) ascending; the others last
            by_pos = torch.where(cand, pos, _BIG).argsort(dim=-1, stable=True)
            sorted_prio, order = key.gather(-1, by_pos).sort(dim=-1, stable=True)
            order = by_pos.gather(-1, order)
            n_evict, need = self._count(sorted_prio, n_cand, protected, free)
            evict = torch.zeros_like(cand).scatter(-1, order, torch.arange(cap, device=pos.device) < n_evict.unsqueeze(-1))
        else:
            n_evict, need = self._count(None, n_cand, protected, free)
            n_evict = torch.minimum(n_evict, torch.full_like(n_cand, k)).unsqueeze(-1)
            last = _nth_lowest(key, n_evict, k)  # the n-th lowest priority
            below = cand & (key < last)
            ties = cand & (key == last)  # of these, the oldest positions leave (as many as are still wanted)
            rest = n_evict - below.sum(-1, keepdim=True)  # >= 1 where n_evict >= 1
            cut = _nth_lowest(torch.where(ties, pos, _BIG), rest, k)
            evict = (below | (ties & (pos <= cut))) & (n_evict > 0)
            n_evict = n_evict.squeeze(-1)
        # without statistics the only bound on the mass that left is the trivial one
        dropped = torch.where(evict, key_max, 0.0).sum(-1) if key_max is not None else evict.any(-1).double()
        return evict, (need > 0).long(), n_evict, dropped

    def _count(self, sorted_prio: Tensor, n_cand: Tensor, protected: Tensor, free: Tensor) -> tuple[Tensor, Tensor]:
        """``[L, H]`` each: how many leave (the policy's wish, and more where the next span would lack
        room), and how many more than the wish (an overflow where > 0)."""
        want = torch.minimum(self.wanted(sorted_prio, n_cand, protected.sum(-1)).clamp(min=0), n_cand)
        need = (self.layout.chunk - free - want).clamp(min=0)  # room the next span (up to a chunk) still lacks
        return torch.minimum(want + need, n_cand), need

    # ---------------------------------------------------------------- lifecycle
    def reset(self) -> None:
        for t in (self._fresh, self._has_queries, self.overflows, self.evictions, self.nonfinite):
            t.zero_()
        self._seen = [[False, False] for _ in self._seen]
        for t in (self._key_max, self._key_sum, self.dropped_mass_bound):
            t.zero_()
        self._queries.zero_()

    def state(self) -> dict[str, Tensor]:
        # the open chunk's statistics from attention too: a state taken mid-chunk commits the same
        # way. Queries stored by update(k, v, q) are not saved (their shape follows the caller):
        # a restored cache asks for them again rather than score stale ones.
        return {"overflows": self.overflows, "evictions": self.evictions, "nonfinite": self.nonfinite,
                "dropped_mass_bound": self.dropped_mass_bound,
                "key_max": self._key_max, "key_sum": self._key_sum, "scored": self._fresh}

    def after_load(self, end: int, span: int) -> None:
        self._has_queries.zero_()
        self._seen = [[bool(f), False] for f in self._fresh.tolist()]

    def check_state(self, state: dict[str, Any], end: int, span: int, is_open: bool) -> None:
        st, lay = self.storage, self.layout
        pos = state["slot_positions"][..., : st.capacity].to("cpu").expand(st.num_layers, st.heads, -1)
        plan = state["write_slots"].to("cpu").expand(st.num_layers, st.heads, -1)[..., :span]
        where = f"state dict of a {self.name} cache at end={end}"
        if bool(((pos < -1) | (pos >= end)).any()):
            raise ValueError(f"{where}: slot_positions must be -1 or in [0, {end}), got values from "
                             f"{int(pos.min())} to {int(pos.max())}")
        srt = pos.sort(dim=-1).values
        if bool(((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any()):
            raise ValueError(f"{where}: a head holds the same position in two slots")
        sinks = torch.arange(lay.sink)
        want = torch.where(sinks < end, sinks, -1)
        if not bool((pos[..., : lay.sink] == want).all()):
            raise ValueError(f"{where}: the sink slots must hold positions {want.tolist()} (pinned)")
        rest = pos[..., lay.sink :]
        if bool(((rest >= 0) & (rest < lay.sink)).any()):
            raise ValueError(f"{where}: a sink position sits outside the sink slots")
        if span and bool(((plan < 0) | (plan >= st.capacity)).any()):
            raise ValueError(f"{where}: write_slots must be in [0, {st.capacity}), got {int(plan.min())}..{int(plan.max())}")
        if span and (is_open or self.protect_newest):
            last = torch.arange(end - span, end)
            if not bool((pos.gather(-1, plan) == last).all()):
                raise ValueError(f"{where}: write_slots must hold the positions of the last span {last.tolist()}")
        if end and not is_open and bool(((rest < 0).sum(-1) < lay.chunk).any()):
            raise ValueError(f"{where}: every head needs {lay.chunk} free window slots for the next chunk")
        for name in ("overflows", "evictions", "nonfinite"):
            if bool((state[name] < 0).any()):
                raise ValueError(f"{where}: {name} must be >= 0")
        if bool(((state["scored"] != 0) & (state["scored"] != 1)).any()):
            raise ValueError(f"{where}: scored flags must be 0 or 1")
        # statistics that cannot come from a softmax: a mass cache would evict beyond tau
        for name, top in (("key_max", 1.0), ("key_sum", math.inf), ("dropped_mass_bound", math.inf)):
            check_scores(where, name, state[name], top, finite=self.check_finite)


def check_scores(where: str, name: str, t: Tensor, top: float = math.inf, *, finite: bool = True) -> None:
    """Raise ``ValueError`` unless every entry of a state dict's statistic ``t`` is finite and in
    ``[0, top]`` (an attention probability, a sum of them, an accumulated score). ``finite=False``
    (a cache built with ``check_finite=False``, which keeps and counts non-finite scores): NaN and
    ``+inf`` entries are what such a cache may hold (a key norm of an inf or NaN key) and pass;
    the range is checked on the others."""
    ok = torch.isfinite(t)
    if finite and not bool(ok.all()):
        raise ValueError(f"{where}: {name} must be finite, got NaN or inf")
    if not finite:
        if bool((t == -math.inf).any()):
            raise ValueError(f"{where}: {name} must be >= 0 or non-finite (NaN, +inf), got -inf")
        t = t[ok]
    lo, hi = float(t.min()) if t.numel() else 0.0, float(t.max()) if t.numel() else 0.0
    if lo < 0 or hi > top:
        rng = "[0, 1] (a softmax probability)" if top == 1.0 else ">= 0"
        raise ValueError(f"{where}: {name} must be {rng}, got values from {lo} to {hi}")


class FixedBudget(ScoredPolicy):
    """A scored policy that keeps a fixed number of tokens per head after each commit.

    Args:
        budget: tokens each (layer, head) keeps after a commit, sinks and the newest chunk
            included; ``sink + chunk <= budget <= sink + window - chunk`` (so the next chunk
            always fits: no overflow). Default: the largest.
    """

    cache_properties = ("budget",)

    def __init__(self, budget: int | None = None, *, score_block: int | None = None, check_finite: bool = True) -> None:
        super().__init__(protect_newest=True, score_block=score_block, check_finite=check_finite)
        self.budget = None if budget is None else check_int("budget", budget)

    def params(self) -> dict[str, Any]:
        return {"budget": self.budget, **({} if self.check_finite else {"check_finite": False})}

    def check_layout(self, layout: CacheLayout) -> None:
        super().check_layout(layout)
        lo, hi = layout.sink + layout.chunk, layout.sink + layout.window - layout.chunk
        if self.budget is None:
            self.budget = hi
        if not lo <= self.budget <= hi:
            raise ValueError(
                f"budget must hold the {layout.sink} sink(s) and the newest chunk ({layout.chunk}) and leave room for "
                f"the next chunk in sink + window = {layout.capacity} slots: {lo} <= budget <= {hi}, got {self.budget}"
            )

    def wanted(self, sorted_priority: Tensor, candidates: Tensor, protected: Tensor) -> Tensor:
        return candidates - (self.budget - protected).clamp(min=0)

    def most_evicted(self) -> int:
        """A commit leaves ``budget`` tokens of at most ``sink + window`` held: ``capacity - budget``."""
        return self.layout.capacity - self.budget

    def kept(self, end: int) -> int:
        """Nothing leaves until a head holds more than ``budget``; then a commit leaves exactly
        ``budget`` (no overflow: the next chunk always fits)."""
        return min(end, self.budget)


class KeptNorms(FixedBudget):
    """A fixed budget ranked from the held keys alone, with each key's L2 norm computed once, at
    its commit, and kept per slot (:attr:`norms`): a commit costs its span, not the history. No
    queries are needed, so attention may run in any kernel. Subclasses rank (:meth:`priority`;
    the span's new norms go in with ``norms.scatter``, out of place, so that a refused commit
    changes nothing) and keep the kept tokens' norms in :meth:`on_commit`."""

    needs_queries = False
    #: the norms are kept per batch row (``[L, H, rows, capacity]``), else averaged over the batch
    #: (``[L, H, capacity]``)
    norms_per_row: ClassVar[bool] = False

    def bind(self, storage: KVStorage, layout: CacheLayout, lifecycle) -> None:
        super().bind(storage, layout, lifecycle)
        rows = (storage.dims.rows_per_slot,) if self.norms_per_row else ()
        #: each held key's L2 norm (0 for an empty slot), set at its commit
        self.norms = torch.zeros((storage.num_layers, storage.heads, *rows, storage.capacity),
                                 dtype=torch.promote_types(storage.dtype, torch.float32), device=storage.device)

    def reset(self) -> None:
        super().reset()
        self.norms.zero_()

    def state(self) -> dict[str, Tensor]:
        return {**super().state(), "norms": self.norms}

    def check_state(self, state: dict[str, Any], end: int, span: int, is_open: bool) -> None:
        super().check_state(state, end, span, is_open)
        check_scores(f"state dict of a {self.name} cache at end={end}", "norms", state["norms"],
                     finite=self.check_finite)


def _nth_lowest(x: Tensor, n: Tensor, k: int) -> Tensor:
    """``[..., 1]``: the ``n``-th lowest of each row of ``x [..., m]`` (``n [..., 1]`` in ``[1, k]``,
    ``k <= m``; ``n < 1``: a value below every entry), without a sort: the ``k``-th lowest of the row
    joined with ``k - n`` entries below every value (``topk`` unsorted is a selection; its largest
    value is that order statistic, which ``k - n`` smaller entries shift to the ``n``-th of ``x``)."""
    low, high = ((-math.inf, math.inf) if x.is_floating_point()
                 else (torch.iinfo(x.dtype).min, torch.iinfo(x.dtype).max))
    rank = torch.arange(k, device=x.device)
    pad = torch.where(rank < k - n, low, high).to(x.dtype)
    return torch.cat([x, pad], dim=-1).topk(k, dim=-1, largest=False, sorted=False).values.amax(-1, keepdim=True)
