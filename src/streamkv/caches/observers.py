"""The observer protocol: two phases, so that an observer acts only on changes that happened.

One protocol serves eviction listeners, the certificate and recall (:mod:`streamkv.certify`),
the whole-history check and the recording harness of the experiments. For every change of
its lifecycle (begin, commit, reset, load) a cache, or a group of caches, runs::

    plan (policy)  ->  observer.prepare(change) for every observer   (veto: raise; may read
                                                                       what is about to leave)
                   ->  apply the change (cannot fail)
                   ->  for every observer: the action its prepare returned, then
                       on_evict(event) if tokens left, then on_begin / on_commit / on_reset / on_load

A prepare that raises aborts the call with the cache *and every observer* as they were: a
prepare must not change its observer's state (it may compute into locals and return an action
that commits them). The after-apply hooks see the change made; one that raises does not undo
it (the cache raises ``RuntimeError`` saying the change stands, after telling every other
observer). Writes and queries need no veto: ``on_write`` comes after the write, ``on_queries``
after it and before attention (certified recall fills the recall slots there); if either
raises, the span's new K/V stay written (a retry rewrites them) and nothing retained changed.
Observers run on the host, in eager mode only: a captured CUDA graph replays writes without
them, and compiled and graph modes refuse caches that have them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from torch import Tensor

if TYPE_CHECKING:
    from ..policies import Step
    from ..stores import Segment
    from .cache import KVCache

__all__ = ["CacheObserver", "Change", "EvictionEvent", "EvictionListener", "Observers", "ReadAnswer"]


@dataclass(frozen=True)
class EvictionEvent:
    """Tokens that leave a cache, built before their slots change.

    ``evicted``: device ``bool [num_layers, heads, slots]`` (the shape of
    ``cache.slot_positions``), True where the token held before the change leaves.
    ``positions``: device ``int64 [num_layers, heads, slots]``, what every slot held before the
    change (a copy: ``positions[evicted]`` are the positions that left). ``at``: ``"begin"`` (a
    window cache's reservation overwrites them) or ``"commit"`` (a scored policy evicts them).
    ``shared_slots``: the evicted slots as host ints when every layer and head loses the same
    ones and the policy knows them without a device read (window policies), else None.
    ``info``: what the policy says about it (scored policies: ``overflow`` bool ``[L, H]``, the
    budget alone left too little room; ``dropped_mass_bound`` float64 ``[L, H]``).

    A commit of a scored policy has one whenever the host cannot rule out that tokens leave: a
    fixed budget's from the first commit that takes a head past its budget (every later one
    evicts), ``mass``'s at every commit (whether anything leaves is known on the device: its
    ``evicted`` may be all False). A window cache's begin has one where it overwrites slots.

    During ``prepare`` the tokens are still in ``cache`` (read their K/V there); by
    ``on_evict`` their slots may have been reused or moved (the chronological path shifts them).
    """

    cache: KVCache
    chunk_idx: int
    at: Literal["begin", "commit"]
    evicted: Tensor
    positions: Tensor
    shared_slots: tuple[int, ...] | None = None
    info: dict[str, Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Change:
    """A change a cache is about to make, handed to :meth:`CacheObserver.prepare`.

    ``what``: ``"begin"``, ``"commit"``, ``"reset"`` or ``"load"``. ``chunk_idx`` and ``span``
    (``(start, n)``) name the span of a begin or commit; ``advance`` says whether a begin opens a
    new span (else it reopens the last); ``eviction`` the tokens that leave (None: none);
    ``state`` the (validated) state dict of a load.
    """

    cache: KVCache
    what: Literal["begin", "commit", "reset", "load"]
    chunk_idx: int | None = None
    span: tuple[int, int] | None = None
    advance: bool = False
    eviction: EvictionEvent | None = None
    state: dict[str, Any] | None = None


class CacheObserver:
    """Base of cache observers: every hook does nothing. See the module docstring."""

    def prepare(self, change: Change) -> Callable[[], None] | None:
        """Before ``change``: raise to veto it; may read the cache as it is. Must not change this
        observer's state. Returns what to do once the change is applied (or None)."""
        return None

    def on_attach(self, cache: KVCache) -> None:
        """``cache.add_observer(self)`` is about to add this observer; raise to refuse."""

    def on_detach(self, cache: KVCache) -> None:
        """``cache.remove_observer(self)`` removed this observer."""

    def on_begin(self, cache: KVCache, chunk_idx: int, advance: bool) -> None:
        """Chunk ``chunk_idx`` was reserved (``advance``) or reopened."""

    def on_evict(self, event: EvictionEvent) -> None:
        """Tokens left (see :class:`EvictionEvent`)."""

    def on_write(self, cache: KVCache, layer: int, k: Tensor, v: Tensor) -> None:
        """``k``/``v`` (checked) were written as the open span of ``layer``."""

    def on_queries(self, cache: KVCache, layer: int, q: Tensor) -> None:
        """The span's queries of ``layer``, after its write and before attention."""

    def on_commit(self, cache: KVCache, chunk_idx: int) -> None:
        """Chunk ``chunk_idx`` became history (after any ``on_evict`` of it)."""

    def on_reset(self, cache: KVCache) -> None:
        """The cache forgot its stream."""

    def on_load(self, cache: KVCache) -> None:
        """The cache loaded a state dict."""

    #: the observer adds rows to the cache's reads (:meth:`segments`): a compressed tier
    adds_segments: bool = False

    def segments(self, cache: KVCache, layer: int) -> list[Segment]:
        """Rows this observer adds to a read of ``layer`` (attended in the same softmax as the
        cache's own); only for an observer with ``adds_segments``."""
        return []

    #: the observer may answer a read itself (:meth:`answer`): a certifying compressed tier
    answers_reads: bool = False

    def answer(self, cache: KVCache, layer: int, q: Tensor, *, scale: float, causal: bool, window: int | None,
               statistic: Any, lse: bool) -> ReadAnswer | None:
        """The read of ``layer`` by ``q`` with these options, if this observer computed exactly it
        since ``q`` reached :meth:`on_queries` (None: ``attend`` computes it); only for an observer
        with ``answers_reads``."""
        return None


@dataclass(frozen=True)
class ReadAnswer:
    """A read an observer already computed for the span's queries (:meth:`CacheObserver.answer`):
    ``out`` in the attention layout (``[..., Lq, Dv]``, the queries' dtype), ``lse`` (``[..., Lq]``,
    when asked), the policy's statistics ``key_max`` / ``key_sum`` (``[H, slots]``, when asked),
    ``keys`` (rows attended) and ``why`` (``AttentionInfo.kernel_reason``)."""

    out: Tensor
    lse: Tensor | None
    key_max: Tensor | None
    key_sum: Tensor | None
    keys: int
    why: str


class EvictionListener(CacheObserver):
    """An observer from a function called with every :class:`EvictionEvent`, once the tokens
    have left (``cache.add_eviction_listener(fn)``)."""

    def __init__(self, fn: Callable[[EvictionEvent], None]) -> None:
        if not callable(fn):
            raise TypeError(f"listener must be callable, got {type(fn).__name__}")
        self.fn = fn

    def on_evict(self, event: EvictionEvent) -> None:
        self.fn(event)


class Observers:
    """The observers of one cache, and the two phases run over them (the module docstring)."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.members: list[CacheObserver] = []

    def add(self, observer: CacheObserver) -> CacheObserver:
        if not isinstance(observer, CacheObserver):
            raise TypeError(f"observer must be a CacheObserver, got {type(observer).__name__}")
        if any(o is observer for o in self.members):
            raise ValueError("this observer already watches this cache")
        observer.on_attach(self.cache)
        self.members.append(observer)
        return observer

    def remove(self, observer: CacheObserver) -> None:
        for i, o in enumerate(self.members):
            if o is observer:
                del self.members[i]
                observer.on_detach(self.cache)
                return
        raise ValueError("this observer does not watch this cache")

    def segments(self, layer: int) -> list[Segment]:
        """The rows every observer adds to a read of ``layer``."""
        return [seg for obs in self.members if obs.adds_segments for seg in obs.segments(self.cache, layer)]

    @property
    def add_segments(self) -> bool:
        return any(obs.adds_segments for obs in self.members)

    def answer(self, layer: int, q: Tensor, **options: Any) -> ReadAnswer | None:
        """The first answer an observer has for this read (:meth:`CacheObserver.answer`), or None;
        None while two or more observers add rows (an answer covers its own rows only)."""
        if sum(obs.adds_segments for obs in self.members) > 1:
            return None
        for obs in self.members:
            if obs.answers_reads:
                got = obs.answer(self.cache, layer, q, **options)
                if got is not None:
                    return got
        return None

    def eviction(self, chunk_idx: int, at: Literal["begin", "commit"], plan: Step) -> EvictionEvent | None:
        """The event of a planned eviction (built only when someone watches)."""
        if not self.members or plan.evicted is None:
            return None
        st = self.cache.storage
        return EvictionEvent(self.cache, chunk_idx, at, plan.evicted(), st.slot_positions.clone(),
                             plan.evicted_slots, plan.info or {})

    def prepare(self, change: Change) -> list[Callable[[], None] | None]:
        """Every observer's prepare (a raise vetoes: nothing has changed)."""
        return [obs.prepare(change) for obs in self.members]

    def tell(self, change: Change, actions: list[Callable[[], None] | None]) -> None:
        """After a change was applied: each observer's action, then its hooks. Every observer is
        told even if one raises; then the first failure is raised (the change stands)."""
        cache, failures = self.cache, []
        for obs, action in zip(list(self.members), actions):
            try:
                if action is not None:
                    action()
                if change.eviction is not None:
                    obs.on_evict(change.eviction)
                if change.what == "begin":
                    obs.on_begin(cache, change.chunk_idx, change.advance)
                elif change.what == "commit":
                    obs.on_commit(cache, change.chunk_idx)
                elif change.what == "reset":
                    obs.on_reset(cache)
                else:
                    obs.on_load(cache)
            except Exception as exc:  # noqa: BLE001  (re-raised below, after every observer was told)
                failures.append((obs, exc))
        if failures:
            obs, exc = failures[0]
            raise RuntimeError(
                f"{type(obs).__name__} failed after the {change.what} was applied (the change stands; "
                f"{len(failures)} observer(s) failed): {type(exc).__name__}: {exc}"
            ) from exc
