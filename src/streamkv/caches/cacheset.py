"""All layers of a model, with independent branches (``cond`` / ``uncond`` for guidance).

One allocation holds every branch and layer::

    K: [branches, layers, *k_shape]      V: [branches, layers, *v_shape]

Each branch is a full cache (its own host counters, device metadata and policy state) over its
slice of that allocation; branches share no state, so resetting, reopening or advancing one
never touches another. One branch is allocated unless more are asked for (guidance doubles
the memory, so it is never implied).

``begin_chunk`` / ``commit_chunk`` / ``reset`` act on every branch (or the named ones) and are
all or nothing: every member is checked, planned and announced first, then all change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any

import torch

from ..policies import Step
from ..validate import check_device
from .cache import KVCache, LayerView
from .spec import CacheSpec

__all__ = ["CacheSet"]


class CacheSet:
    """Caches for ``num_layers`` layers x ``branches``.

    Args:
        kind: a cache kind (``"ring"``, ``"chronological"``, ``"mass"``, ``"h2o"``, ``"tova"``),
            a policy class or instance, or a cache class.
        spec: a :class:`~streamkv.caches.spec.CacheSpec` (per branch); or give its fields as
            keywords (``k_shape=..., seq_dim=..., sink=...``).
        branches: branch names; default ``("cond",)``; ``("cond", "uncond")`` for CFG.
        **kwargs: spec fields (without ``spec``), then the policy's parameters (``tau=0.05``).
    """

    def __init__(
        self,
        kind: Any,
        spec: CacheSpec | None = None,
        *,
        branches: Sequence[str] = ("cond",),
        **kwargs: Any,
    ) -> None:
        fields = CacheSpec.field_names()
        spec_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
        if spec is None:
            missing = sorted(f for f in ("k_shape", "v_shape", "seq_dim", "sink", "window", "chunk") if f not in spec_kw)
            if missing:
                raise TypeError(f"CacheSet needs a spec or the keywords {missing}")
            spec = CacheSpec(**spec_kw)
        elif not isinstance(spec, CacheSpec):
            raise TypeError(f"spec must be a CacheSpec, got {type(spec).__name__}")
        elif spec_kw:
            spec = spec.replace(**spec_kw)
        if isinstance(branches, str) or not isinstance(branches, Sequence):
            raise TypeError(f"branches must be a sequence of names, got {branches!r}")
        branches = tuple(branches)
        if not branches or any(not isinstance(b, str) or not b for b in branches):
            raise ValueError(f"branches must be non-empty names, got {branches!r}")
        if len(set(branches)) != len(branches):
            raise ValueError(f"branches must be distinct, got {branches!r}")
        # validate every argument on the meta device (no memory) before allocating; the device
        # itself as a cache would (the same check and message as KVStorage's)
        device = check_device(spec.device)
        probe = spec.replace(device="meta").build(kind, **kwargs)
        nb = len(branches)
        self.spec = spec
        self.branches = branches
        self.num_layers = probe.num_layers
        if not probe.storage.store.takes_buffers:  # e.g. quantised codes: each branch allocates its own
            self._k = self._v = None
            self._caches: dict[str, KVCache] = {name: spec.build(kind, **kwargs) for name in branches}
        else:
            self._k = torch.zeros((nb, *probe.storage.full_shape("k")), dtype=spec.dtype, device=device)
            self._v = torch.zeros((nb, *probe.storage.full_shape("v")), dtype=spec.dtype, device=device)
            self._caches = {
                name: spec.build(kind, buffers=(self._k[i], self._v[i]), **kwargs) for i, name in enumerate(branches)
            }
        self.kind = self._caches[branches[0]].name

    # --------------------------------------------------------------- access
    def __getitem__(self, branch: str) -> KVCache:
        try:
            return self._caches[branch]
        except (KeyError, TypeError):
            raise KeyError(f"no branch {branch!r}; this set has {list(self.branches)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.branches)

    def __len__(self) -> int:
        return len(self.branches)

    def layer(self, branch: str, layer: int) -> LayerView:
        return self[branch].layer(layer)

    @property
    def nbytes(self) -> int:
        """Bytes of all K/V buffers (every branch and layer; quantised storage: codes, scales and
        full-precision rows)."""
        if self._k is None:
            return sum(c.nbytes for c in self._caches.values())
        return self._k.nbytes + self._v.nbytes

    # ------------------------------------------------------------ lifecycle
    def _select(self, branches: Iterable[str] | None) -> list[KVCache]:
        if branches is None:
            return [self._caches[b] for b in self.branches]
        if isinstance(branches, str):
            raise TypeError(f"branches must be a sequence of names, got the string {branches!r}")
        names = tuple(branches)
        if len(set(names)) != len(names):
            raise ValueError(f"branches must be distinct, got {names!r}")
        return [self[b] for b in names]

    def begin_chunk(self, chunk_idx: int, branches: Iterable[str] | None = None) -> None:
        """``begin_chunk`` on every (or the named) branch; all or nothing."""
        _run_all([partial(cache.prepare_begin, chunk_idx) for cache in self._select(branches)])

    def commit_chunk(self, chunk_idx: int, branches: Iterable[str] | None = None) -> None:
        """``commit_chunk`` on every (or the named) branch; all or nothing (a branch that
        refuses, e.g. non-finite statistics, leaves every branch open and unchanged)."""
        _run_all([partial(cache.prepare_commit, chunk_idx) for cache in self._select(branches)])

    def reset(self, branches: Iterable[str] | None = None) -> None:
        """``reset`` on every (or the named) branch; all or nothing (an observer of one branch
        that vetoes leaves every branch as it was)."""
        caches = self._select(branches)
        _run_all([partial(cache.prepare_reset, caches) for cache in caches])

    # ----------------------------------------------------------- state dict
    def state_dict(self) -> dict[str, Any]:
        """Every branch's :meth:`~streamkv.caches.KVCache.state_dict` (copies), by name."""
        return {name: cache.state_dict() for name, cache in self._caches.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load every branch; all validated (and vetted by the observers) before any is loaded."""
        if not isinstance(state, dict) or set(state) != set(self.branches):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"state dict must have branches {sorted(self.branches)}, got {got}")
        caches = self._select(None)
        _one_rope_state([(name, self[name], state[name].get("rope_state") if isinstance(state[name], dict) else None)
                         for name in self.branches], "their states")
        _run_all([partial(self[name].prepare_load, state[name], caches) for name in self.branches])

    # ------------------------------------------------------------ branches
    def fork(self, n: int = 1) -> list[CacheSet]:
        """``n`` sets continuing the stream as it stands, each branch (``cond``, ``uncond``, ...)
        forked (:meth:`~streamkv.caches.KVCache.fork`): pages shared copy-on-write. All or nothing:
        every branch is checked before any forks."""
        caches = [self._caches[b] for b in self.branches]
        for cache in caches:  # every refusal before any fork
            cache.branches.check_fork(n)
        ropes = [{} for _ in range(n)]  # members that shared a RopeAtRead share one copy in each new set
        forked = [cache.branches.fork(n, ropes) for cache in caches]
        return [self._with({b: forked[j][i] for j, b in enumerate(self.branches)}) for i in range(n)]

    def _with(self, caches: dict[str, KVCache]) -> CacheSet:
        out = object.__new__(CacheSet)
        out.spec, out.branches, out.num_layers, out.kind = self.spec, self.branches, self.num_layers, self.kind
        out._k = out._v = None
        out._caches = caches
        return out

    def rewind(self, chunk_idx: int) -> None:
        """``rewind`` every branch; all or nothing (every branch checked first; a refusal names the
        branch)."""
        caches = self._select(None)
        kept = []
        for name, cache in self._caches.items():
            try:
                i = cache.branches.check_rewind(chunk_idx, caches)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise type(exc)(f"branch {name!r}: {exc}") from None
            kept.append((name, cache, cache.branches.boundaries[i].rope))
        _one_rope_state(kept, f"their boundaries before chunk {chunk_idx}")
        for cache in caches:
            cache.branches.rewind(chunk_idx, caches)

    def release(self) -> None:
        """Give every branch's pages back; all or nothing (a branch released already is refused,
        naming it, before any is released; so is an unpaged one)."""
        for name, cache in self._caches.items():
            try:
                cache.branches.check_release()
            except (RuntimeError, ValueError) as exc:
                raise type(exc)(f"branch {name!r}: {exc}") from None
        for cache in self._caches.values():
            cache.release()

    def export_stream(self, path: str | None = None) -> bytes | None:
        """Every branch's stream in one blob (or file); see :meth:`~streamkv.caches.KVCache.export_stream`."""
        from .branches import export_streams

        return export_streams({b: c for b, c in self._caches.items()}, path)

    def import_stream(self, source: bytes | str) -> None:
        """Continue an exported set: every branch checked (checksums, configurations) before any loads."""
        from .branches import read_streams

        states = read_streams(source, list(self.branches), self[self.branches[0]].device)
        self.load_state_dict(states)

    def __repr__(self) -> str:
        st = self[self.branches[0]].storage.store.describe()
        plain = st["bf16_bytes"] * len(self.branches)
        return (f"CacheSet({self.kind!r}, branches={self.branches}, num_layers={self.num_layers}, "
                f"{st['format']}, {self.nbytes / 2**20:.3g} MiB held (a plain bf16 set: {plain / 2**20:.3g} MiB))")


def _one_rope_state(members: list[tuple[str, KVCache, Any]], what: str) -> None:
    """Raise ``ValueError`` where branches that read with one RopeAtRead would take different
    position map states (``members``: name, cache, the state it would take): one would win."""
    first: dict[int, tuple[str, Any]] = {}
    for name, cache, rope_state in members:
        if cache.rope_at_read is None:
            continue
        seen = first.setdefault(id(cache.rope_at_read), (name, rope_state))
        if seen[1] != rope_state:
            raise ValueError(f"branches {seen[0]!r} and {name!r} share one RopeAtRead, and {what} hold different "
                             f"position map states ({seen[1]!r} and {rope_state!r}): one would overwrite the other")


def _run_all(prepare: list[Callable[[], Step]]) -> None:
    """Prepare every member's step and check that each may still run (all or nothing: where one
    refuses, the steps prepared are cancelled, their reserved pages back at once), apply every
    one, then tell every member's observers (a failure there is raised once all were told; every
    change stands)."""
    steps: list[Step] = []
    try:
        for make in prepare:
            steps.append(make())
        for step in steps:
            if step.check is not None:
                step.check()
    except BaseException:
        for step in steps:
            if step.cancel is not None:
                step.cancel()
        raise
    for step in steps:
        step.apply()
    failures = []
    for step in steps:
        for fn in step.then:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001  (re-raised below)
                failures.append(exc)
    if failures:
        raise failures[0]
