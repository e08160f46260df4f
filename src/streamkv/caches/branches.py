"""Branches of a stream: fork, rewind, release, and a stream moved between processes.

A cache built with ``pages=`` (:mod:`streamkv.stores.pages`) keeps its rows in pages that its
branches share copy-on-write:

- :meth:`Branches.fork` makes ``n`` caches that continue the stream as it stands (at a chunk
  boundary: an open span is refused): each shares every page, and copies only its metadata (slot
  positions, write plan, the policy's statistics and its host state, a quantised store's
  full-precision rows, a copy of the position map state of RoPE at read: a branch switching maps
  or cutting moves no other stream). A branch behaves exactly as its parent would, and as a
  cache that loaded the parent's state. From then on each writes its own pages (a page at a time,
  when it first writes there). Refused, with the reason, for a cache with observers (a
  certifier's summaries, a tier's entries are not forked).
- ``history=k`` keeps the last ``k`` chunk boundaries (their page tables and metadata: the pages
  stay referenced); :meth:`Branches.rewind` returns the stream to one of them exactly. A branch
  keeps the boundaries its parent kept, the fork point among them: it can go back to where it
  forked, or before, as its parent can.
- :meth:`Branches.release` gives a branch's pages back; the branch refuses every call afterwards,
  and every read or prepared step made before (they would read or write pages another branch
  may hold by then).
- :meth:`Branches.export` / :meth:`Branches.import_` move a stream as bytes (or a file): the state
  dict of every slot in slot order, with a SHA-256 of its tensors, loaded by ``load_state_dict``
  (so a stream from another layout, kind, format or map is refused by the same checks).
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..policies import make_policy
from ..validate import check_int

if TYPE_CHECKING:
    from .cache import KVCache

__all__ = ["Branches", "STREAM_FORMAT"]

#: the format tag of an exported stream
STREAM_FORMAT = "streamkv-stream/1"


@dataclass
class _Boundary:
    """A chunk boundary a cache can rewind to: counters, metadata copies, the store's snapshot."""

    end: int
    span: int
    positions: Tensor
    plan: Tensor
    where: tuple[int | None, tuple | None]
    policy: dict[str, Tensor]
    store: dict[str, Any]
    rope: dict[str, Any] | None


class Branches:
    """Fork, rewind, release, export and import for one cache (see the module docstring)."""

    def __init__(self, cache: KVCache, history: int) -> None:
        self.cache, self.history = cache, history
        self.boundaries: list[_Boundary] = []

    # ------------------------------------------------------------------ checks
    def check_branchable(self, what: str, *, open_span_ok: bool = False) -> None:
        """Raise (nothing changes) unless this cache can branch now: not released, mutable, paged,
        without observers, and (unless ``open_span_ok``: the caller commits the open span itself
        first, as the transformers and sglang integrations do) at a chunk boundary. ``what``
        names the call in the message."""
        c = self.cache
        c.checks.mutable(what)
        if c.storage.store.table is None:
            raise ValueError(f"{what}: this {c.name} cache is not paged; build it with pages=True (its rows then live "
                             f"in pages that branches share copy-on-write)")
        if c.observers:
            names = sorted({type(o).__name__ for o in c.observers})
            raise ValueError(f"{what}: this cache has observers ({', '.join(names)}), whose state (recorded evictions, "
                             f"certificates, a tier's entries) a branch would not have; remove them first")
        if not open_span_ok and c.is_open:
            raise ValueError(f"{what} with {c.lifecycle.open_name()} open: branches start at a chunk boundary "
                             f"(the open span's rows are not history yet); call {c.lifecycle.commit_call()} first")

    # ------------------------------------------------------------------ fork
    def check_fork(self, n: int) -> int:
        """Raise as :meth:`fork` would; else the count."""
        n = check_int("n", n, 1)
        self.check_branchable(f"fork({n})")
        return n

    def fork(self, n: int, ropes: list[dict[int, Any]] | None = None) -> list[KVCache]:
        """``n`` branches (see the module docstring). ``ropes``: one dict per branch, shared by the caches
        a group forks together (a :class:`~streamkv.caches.CacheSet`'s members), so that caches that
        shared one RopeAtRead share one copy of it in each branch, as they did before."""
        n = self.check_fork(n)
        ropes = [{} for _ in range(n)] if ropes is None else ropes
        out = [self._branch(r) for r in ropes]
        self.cache.lifecycle.forks += 1  # a step planned before would write pages the branches share
        return out

    def _branch(self, ropes: dict[int, Any]) -> KVCache:
        c = self.cache
        out = object.__new__(type(c))
        pol = make_policy(c.policy)
        rope = c.rope_at_read
        if rope is not None:  # the map in use and its parameters are stream state: a copy per branch
            if id(rope) not in ropes:
                ropes[id(rope)] = rope.fork()
            rope = ropes[id(rope)]
        out._assemble(c.layout, pol, c.storage.fork(), rope, self.history)
        for name, t in pol.state().items():
            t.copy_(c.policy.state()[name])
        lc = c.lifecycle
        out.lifecycle.restore(lc.end, lc.span, False)
        pol.after_load(lc.end, lc.span)  # the policy's host state (write ranges, offsets), as a load rebuilds it
        # the branch keeps the boundaries its parent kept, the fork point among them: each one's pages
        # referenced once more (a boundary's copies are only ever read, so the branch shares them)
        pool = out.storage.store.table.pool
        for b in self.boundaries:
            pool.share(b.store["pages"])
            out.branches.boundaries.append(replace(b, store={**b.store, "pages": list(b.store["pages"])}))
        return out

    # ------------------------------------------------------------------ history
    def after_commit(self) -> None:
        """Keep the boundary the commit reached (``history`` of them)."""
        if not self.history:
            return
        c, st = self.cache, self.cache.storage
        self.boundaries.append(_Boundary(
            c.lifecycle.end, c.lifecycle.span, st.positions.clone(), st.plan.clone(), (st.where.start, st.where.ranges),
            {k: t.clone() for k, t in c.policy.state().items()}, st.store.snapshot(),
            None if c.rope_at_read is None else c.rope_at_read.state()))
        while len(self.boundaries) > self.history:
            st.store.drop_snapshot(self.boundaries.pop(0).store)

    def chunks(self) -> list[int]:
        """The chunk indices :meth:`rewind` can return to (the boundary before each)."""
        C = self.cache.layout.chunk
        return [b.end // C for b in self.boundaries if b.end % C == 0]

    def check_rewind(self, chunk_idx: int, together: Sequence[Any] = ()) -> int:
        """Raise as :meth:`rewind` would (``together``: the other caches rewound with this one);
        else the index of the boundary."""
        c = self.cache
        chunk_idx = check_int("chunk_idx", chunk_idx, 0)
        self.check_branchable(f"rewind({chunk_idx})", open_span_ok=True)
        end = chunk_idx * c.layout.chunk
        keep = [i for i, b in enumerate(self.boundaries) if b.end == end]
        if not keep:
            raise ValueError(f"rewind({chunk_idx}): this cache keeps the boundaries before chunks {self.chunks()} "
                             f"(pages={{'history': {self.history}}} keeps the last {self.history}); the stream cannot "
                             f"return to position {end}")
        rope = self.boundaries[keep[-1]].rope
        if rope is not None:
            c.rope_at_read.check_change([c, *together], rope, f"rewind({chunk_idx})")
        return keep[-1]

    def rewind(self, chunk_idx: int, together: Sequence[Any] = ()) -> None:
        c, st = self.cache, self.cache.storage
        i = self.check_rewind(chunk_idx, together)
        b = self.boundaries[i]
        st.store.restore(b.store)
        st.positions.copy_(b.positions)
        st.plan.copy_(b.plan)
        st.where.start, st.where.ranges = b.where
        for k, t in c.policy.state().items():
            t.copy_(b.policy[k])
        c.policy.after_load(b.end, b.span)
        if b.rope is not None:
            c.rope_at_read.load_state(b.rope)
        c.lifecycle.restore(b.end, b.span, False)
        for later in self.boundaries[i + 1:]:
            st.store.drop_snapshot(later.store)
        del self.boundaries[i + 1:]

    def forget(self) -> None:
        """Drop every kept boundary (a reset or a load starts a new history)."""
        for b in self.boundaries:
            self.cache.storage.store.drop_snapshot(b.store)
        self.boundaries = []

    def kept_pages(self) -> list[int]:
        """The physical pages the kept boundaries reference (one entry per reference): what
        :meth:`forget` drops, so a reset or a load that forgets them copies no page shared only
        with them."""
        return [p for b in self.boundaries for p in b.store["pages"]]

    def check_release(self) -> None:
        """Raise as :meth:`release` would (nothing changes): released already, or not paged (its
        buffers are its own: there is no pool to give them back to)."""
        c = self.cache
        c.checks.alive("release()")
        if c.storage.store.table is None:
            raise ValueError(f"release(): this {c.name} cache is not paged (built without pages=): it holds no pages "
                             f"to give back; drop the cache itself to free its buffers")

    def release(self) -> None:
        """Give the pages back; every read and step made before, and every later call, is refused."""
        self.check_release()
        self.forget()
        self.cache.storage.store.release()
        self.cache.lifecycle.release()

    # ------------------------------------------------------------------ moving streams
    def export(self, path: str | os.PathLike | None = None) -> bytes | None:
        self.cache.checks.alive("export_stream()")
        return export_streams({"": self.cache}, path)

    def import_(self, source: bytes | str | os.PathLike) -> None:
        self.cache.checks.alive("import_stream()")
        self.cache.load_state_dict(read_streams(source, [""], self.cache.device)[""])


def export_streams(caches: dict[str, KVCache], path: str | os.PathLike | None) -> bytes | None:
    """The streams of ``caches`` (by name) as one blob, each state with its SHA-256; to ``path`` if given."""
    states = {name: c.state_dict() for name, c in caches.items()}
    blob = _pack({"format": STREAM_FORMAT, "streams": {n: {"sha256": _digest(s), "state": s} for n, s in states.items()}})
    if path is None:
        return blob
    with open(path, "wb") as f:
        f.write(blob)
    return None


def read_streams(source: bytes | str | os.PathLike, names: list[str], device: torch.device) -> dict[str, dict]:
    """The states of an exported blob (bytes or a path), every checksum checked; ``names`` must be its streams."""
    if isinstance(source, (bytes, bytearray)):
        blob = bytes(source)
    elif isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            blob = f.read()
    else:
        raise TypeError(f"import_stream takes bytes or a file path, got {type(source).__name__}")
    try:
        payload = torch.load(io.BytesIO(blob), map_location=device, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable payload is refused with the reason
        raise ValueError(f"not a streamkv stream (unreadable: {type(exc).__name__}: {exc})") from None
    if not isinstance(payload, dict) or payload.get("format") != STREAM_FORMAT:
        got = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"not a streamkv stream: format {got!r}, this reads {STREAM_FORMAT!r}")
    streams = payload.get("streams")
    if not isinstance(streams, dict) or sorted(streams) != sorted(names):
        got = sorted(streams) if isinstance(streams, dict) else type(streams).__name__
        raise ValueError(f"the stream holds branches {got}, this reads {sorted(names)}")
    out = {}
    for name in names:
        entry = streams[name]
        state = entry.get("state") if isinstance(entry, dict) else None
        if not isinstance(state, dict) or entry.get("sha256") != _digest(state):
            raise ValueError(f"the stream{f' of branch {name!r}' if name else ''}'s checksum does not match its "
                             f"contents (corrupted or edited in transit)")
        out[name] = state
    return out


def _pack(obj: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _digest(state: dict[str, Any]) -> str:
    """SHA-256 of a state dict: every entry by name, tensors by dtype, shape and their elements in
    order (on the host: what the tensor holds, whatever strides its storage is laid out with)."""
    h = hashlib.sha256()
    for name in sorted(state):
        v = state[name]
        h.update(name.encode())
        if isinstance(v, Tensor):
            t = v.detach().to("cpu").clone(memory_format=torch.contiguous_format)  # a storage of exactly its elements
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(bytes(t.untyped_storage()))
        else:
            h.update(repr(v).encode())
    return h.hexdigest()
