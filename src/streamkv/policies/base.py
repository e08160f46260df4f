"""What every slot policy answers: which slots a span takes, and which tokens leave.

A policy owns no K/V. It is bound to one :class:`~streamkv.storage.KVStorage` and writes only
its slot metadata (``positions``, ``plan``, ``write_start``) and its own state. Every change
is planned first and applied later (:class:`Step`), so a cache, or a group of caches, can
refuse or let its observers veto before anything changes (``docs/ARCHITECTURE.md``, "One
storage, small policies").
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..layout import CacheLayout
from ..storage import KVStorage

__all__ = ["Step", "SlotPolicy"]


def _nothing() -> None:
    pass


@dataclass(frozen=True)
class Step:
    """A planned change: checked and announced, not yet made. The one plan/apply type of the
    project (a policy's plan, a cache's begin/commit/reset/load, a group's member).

    ``apply()`` makes the change and cannot fail; ``then`` run after it (a cache tells its
    observers there: they act only on changes that were applied). A group applies every
    member, then runs every member's ``then``. A policy's step also says what leaves:
    ``evicted()`` the device ``bool [L, H, S]`` mask (None: nothing leaves), ``evicted_slots``
    those slots as host ints where every layer and head loses the same ones and the policy
    knows them without a device read (window policies), ``info`` what the policy says about
    the eviction (scored policies: ``overflow`` bool ``[L, H]``, ``dropped_mass_bound``
    float64 ``[L, H]``); ``writes`` the slots the span's K/V will be written to (or moved to);
    ``check`` raises, changing nothing, when the step can no longer run (a cache's step runs once,
    and only while the cache is where it was planned: :meth:`run` and a group ask it first);
    ``cancel`` gives back what the planned step holds (the free pages a forked cache reserved for
    its copy on write) when it will not run: a group cancels its prepared members when one refuses
    (a step dropped unrun gives them back too, once it is collected)."""

    apply: Callable[[], None] = _nothing
    evicted: Callable[[], Tensor] | None = None
    evicted_slots: tuple[int, ...] | None = None
    info: dict[str, Tensor] | None = None
    then: tuple[Callable[[], None], ...] = ()
    #: the slots the step's writes touch, for a paged store's copy on write: host ``(first slot,
    #: rows)`` ranges, or a device tensor of slots (a begin: the span's, and a roll's), or None
    writes: object = None
    #: raises (nothing changed) when the step may not run now; None: it always may
    check: Callable[[], None] | None = None
    #: gives back what the step holds when it will not run; None: it holds nothing
    cancel: Callable[[], None] | None = None

    def run(self) -> None:
        """``check()``, ``apply()``, then every ``then`` (an exception there comes after the change stood)."""
        if self.check is not None:
            self.check()
        self.apply()
        for fn in self.then:
            fn()


class SlotPolicy(abc.ABC):
    """Base of the slot policies (see :mod:`streamkv.policies` for the registry).

    Capabilities are class attributes: what a cache built on the policy can promise.
    """

    #: name in :data:`streamkv.policies.POLICIES` (``"ring"``, ``"mass"``, ...)
    name: ClassVar[str]
    #: heads (and layers) may hold different positions: a per-head plan
    per_head: ClassVar[bool] = False
    #: retains exactly ``[sinks | last window]``, the current path's tokens: attention over
    #: it equals the current path to rounding
    retains_window: ClassVar[bool] = True
    #: the policy needs the queries of each span: they come from
    #: :func:`~streamkv.attention.attend` or from ``update(k, v, q)``
    needs_queries: ClassVar[bool] = False
    #: constructor arguments that tests, the fuzzer and the lab use to build an example
    #: (the one place a policy's example parameters are written)
    example_params: ClassVar[dict[str, Any]] = {}
    #: read-only attributes a cache forwards from its policy (``cache.budget``): the same
    #: through ``KVCache(policy=...)`` and the named class
    cache_properties: ClassVar[tuple[str, ...]] = ()

    storage: KVStorage
    layout: CacheLayout

    def params(self) -> dict[str, Any]:
        """The constructor arguments (recorded in configs and state dicts)."""
        return {}

    def check_layout(self, layout: CacheLayout) -> None:
        """Raise ``ValueError`` if the policy cannot run on these sizes (before allocation)."""

    def bind(self, storage: KVStorage, layout: CacheLayout, lifecycle: Any) -> None:
        """Attach to the storage and the cache's lifecycle (read-only); allocate device state (once)."""
        self.storage, self.layout, self.lifecycle = storage, layout, lifecycle

    @property
    def graph_safe_writes(self) -> bool:
        """Writes read their destination only from device tensors."""
        return True

    @abc.abstractmethod
    def begin(self, start: int, n: int, advance: bool) -> Step:
        """Plan the slots of the span ``[start, start + n)`` (``advance``: it is new; else it is
        the last span, reopened)."""

    def commit(self, start: int, n: int) -> Step | None:
        """Plan what the span's commit changes (None: nothing). May refuse (raise)."""
        return None

    def most_evicted(self) -> int | None:
        """A bound on the tokens one commit evicts per (layer, head), known on the host (None: any
        number). With one, a scored policy's selection is a partial sort of that many candidates,
        not a full sort; an observer of evictions sizes what it gathers by it."""
        return None

    def kept(self, end: int) -> int | None:
        """The tokens every (layer, head) holds after a commit once ``end`` positions have entered,
        where the host knows it without reading the device (None: the data decide it)."""
        return None

    def reset(self) -> None:
        """Forget the stream (the storage is cleared by the cache)."""

    def after_load(self, end: int, span: int) -> None:
        """Rebuild derived device state after a state dict was loaded (``end`` positions in the
        stream, the last span ``span`` long)."""

    # ----------------------------------------------------------- state dicts
    def state(self) -> dict[str, Tensor]:
        """Device state besides the storage's (saved in state dicts)."""
        return {}

    def check_state(self, state: dict[str, Any], end: int, span: int, is_open: bool) -> None:
        """Raise ``ValueError`` unless ``state`` (a whole cache state dict) is consistent with
        the layout and the lifecycle counters. Changes nothing."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"


def empty_eviction(storage: KVStorage) -> Tensor:
    """A ``bool [L, H, S]`` mask with nothing evicted."""
    return torch.zeros((storage.num_layers, storage.heads, storage.slots), dtype=torch.bool, device=storage.device)
