"""The fuzzer's branch hook: random fork trees over paged caches (``streamkv fuzz --forks N``).

Each case draws a kind (:data:`~streamkv.policies.POLICIES`), a storage (dense, or a format of
:data:`~streamkv.quant.KV_FORMATS`), a key storage (RoPE at write, or raw keys rotated at read by a
map of :data:`~streamkv.positions.POSITION_MAPS`), a page size (a chunk, or smaller or larger) and
how many boundaries it keeps (``history``), then a random sequence over the live branches:

- a chunk into one branch and its reference (an unpaged cache of the same configuration that never
  forked, fed the same history): the attention outputs (float64), the slots and the stored K/V must
  be equal;
- ``fork(n)``, ``n`` up to 8, and 8 at a case's first fork (each new branch's reference: a copy of its parent's reference, by
  state dict, with the parent's kept states: a branch keeps its parent's boundaries);
  ``rewind(c)`` to a kept boundary (the reference loads the state it had there);
  ``release()`` (its later calls refused); ``export_stream`` into a fresh paged cache through
  ``import_stream`` (its state must equal the branch's, and it replaces the branch from then on);
- rejected calls: a fork with a span open, ``fork(0)``, a fork of an unpaged cache, a rewind to
  a boundary not kept, any call on a released branch, an edited stream, a stream of another
  configuration, and a write refused because the pool has too few free pages left (small pools:
  ``pool_full_refusals``): each must raise, and the state of every live branch and of the pool
  must be what it was.

At the end every branch is released: the pool must have every page back (``leaked_pages``: pages
still in use, plus reserved ones). Counted: ``cases``, ``steps``, ``forks``, ``rewinds``,
``releases``, ``exports``, ``rejected_calls``, ``state_changes_after_rejection``,
``bad_calls_accepted``, ``mismatches``, ``leaked_pages``, ``max_depth`` (generations of the deepest
branch), ``max_fanout``; kinds, formats and maps in turn (the registries' order).
"""

from __future__ import annotations

import io
import random
import time
import warnings
from typing import Any

import torch

from streamkv import KVCache
from streamkv.attention import attend
from streamkv_lab.snapshot import same_state, snapshot
from streamkv.policies import POLICIES, example_policy
from streamkv.positions import POSITION_MAPS, position_map
from streamkv.quant import KV_FORMATS
from streamkv.rope_at_read import RopeAtRead
from streamkv.rotary import Rope1D

__all__ = ["TOL", "fuzz_branches"]

TOL = 1e-10  # float64 throughout
ERRORS = (TypeError, ValueError, RuntimeError)


class _Case:
    """One random family: its configuration, its live branches and their references."""

    def __init__(self, rng: random.Random, res: dict[str, Any], index: int) -> None:
        self.rng, self.res = rng, res
        self.kind = list(POLICIES)[index % len(POLICIES)]  # every kind in turn
        per_head = POLICIES[self.kind].per_head
        self.chunk = C = rng.randint(1, 3)
        self.sink = rng.randint(0, 2)
        self.window = (2 * C if per_head else C) + rng.randint(0, 5)
        self.H, self.D = rng.randint(1, 2), rng.choice([4, 8])  # whole bytes of codes in every format
        # dense, a stored format or a position map in turn, each registry in turn (a registry growing
        # shifts no other draw)
        axis = ("plain", "format", "map")[index % 3]
        self.quant = list(KV_FORMATS)[index // 3 % len(KV_FORMATS)] if axis == "format" else None
        self.map = list(POSITION_MAPS)[index // 3 % len(POSITION_MAPS)] if axis == "map" else None
        self.history = rng.choice([0, 0, 1, 3])
        page = rng.choice([C, C, 1, C + 1, 2 * C])
        self.pages = {"page": page, "history": self.history, "spare": rng.choice([4, 64])}
        params = example_policy(self.kind)
        if "budget" in params:
            params["budget"] = self.sink + self.window - C
        self.params = params
        self.g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        root = self.build(pages=self.pages)
        self.pool = root.storage.store.table.pool
        self.own = len(root.storage.store.table.host)  # pages of one cache
        self.forks_here = 0  # forks made in this case
        # live branches: (branch, its reference, reference states at its kept boundaries, depth)
        self.live: list[list[Any]] = [[root, self.build(), {}, 0]]
        res["kinds"][self.kind] = res["kinds"].get(self.kind, 0) + 1
        fmt = self.quant or "dense"
        res["formats"][fmt] = res["formats"].get(fmt, 0) + 1
        key = self.map or "rope at write"
        res["maps"][key] = res["maps"].get(key, 0) + 1

    def build(self, pages: Any = None, kind: str | None = None) -> KVCache:
        shape = (1, self.sink + self.window, self.H, self.D)
        rope = None
        if self.map is not None:
            geo = POSITION_MAPS[self.map].for_geometry(self.sink, self.sink + self.window, self.chunk)
            rope = RopeAtRead(Rope1D(self.D), position_map(self.map, **geo))
        kind = kind or self.kind
        params = self.params if kind == self.kind else example_policy(kind)
        return KVCache(shape, shape, seq_dim=1, sink=self.sink, window=self.window, chunk=self.chunk, policy=kind,
                       dtype=torch.float64, quant=self.quant, rope_at_read=rope, pages=pages, **params)

    # ----------------------------------------------------------------- checks
    def fail(self, what: str) -> None:
        self.res["mismatches"] += 1
        if len(self.res["failures"]) < 10:
            self.res["failures"].append(f"{self.kind}/{self.quant or 'dense'}/{self.map or 'write'}/page "
                                        f"{self.pages['page']}: {what}")

    def same(self, branch: KVCache, ref: KVCache, what: str) -> None:
        if not torch.equal(branch.slot_positions, ref.slot_positions):
            return self.fail(f"{what}: slot positions differ")
        held = ref.slot_positions[0] >= 0
        for got, want in ((branch.keys(0), ref.keys(0)), (branch.values(0), ref.values(0))):
            if not torch.equal(got.transpose(1, 2)[0][held], want.transpose(1, 2)[0][held]):
                return self.fail(f"{what}: stored K/V differ")

    def family(self) -> dict[str, Any]:
        """Every live branch's full state (each reaches the pool: its references and free list)."""
        return {f"branch {i}": ("obj", snapshot(e[0])) for i, e in enumerate(self.live)}

    def rejected(self, call, what: str) -> None:
        before = self.family()
        self.res["rejected_calls"] += 1
        try:
            call()
        except ERRORS:
            diff = same_state(before, self.family())
            if diff:
                self.res["state_changes_after_rejection"] += 1
                self.fail(f"state changed after a rejected {what}: {diff}")
            return
        except Exception as exc:  # noqa: BLE001 - an undocumented exception type is a finding
            return self.fail(f"a rejected {what} raised {type(exc).__name__}: {exc}")
        self.res["bad_calls_accepted"] += 1
        self.fail(f"a {what} that must be refused went through")

    # ------------------------------------------------------------------ calls
    def data(self) -> tuple[torch.Tensor, ...]:
        return tuple(torch.randn(1, self.chunk, self.H, self.D, generator=self.g, dtype=torch.float64)
                     for _ in range(3))

    def step(self, entry: list[Any]) -> None:
        branch, ref, kept, _ = entry
        q, k, v = self.data()
        n = branch.next_chunk
        if self.pool.free < self.own:  # the write may need more pages than are free: refused, changing nothing
            before = self.family()
            try:
                branch.begin_chunk(n)
            except RuntimeError as exc:
                if "free page" not in str(exc):
                    raise
                self.res["rejected_calls"] += 1
                self.res["pool_full_refusals"] += 1
                diff = same_state(before, self.family())
                if diff:
                    self.res["state_changes_after_rejection"] += 1
                    self.fail(f"state changed after a begin refused for want of pages: {diff}")
                return
        else:
            branch.begin_chunk(n)
        ref.begin_chunk(n)
        outs = []
        for c in (branch, ref):
            outs.append(attend(q, c.layer(0).update(k, v, q))[0])
            c.commit_chunk(n)
        diff = float((outs[0] - outs[1]).abs().max())
        if not diff <= TOL:
            return self.fail(f"attention off the unforked reference by {diff:.3g}")
        self.same(branch, ref, "after a chunk")
        kept[branch.end] = ref.state_dict()
        self.res["steps"] += 1

    def fork(self, i: int) -> None:
        branch, ref, kept, depth = self.live[i]
        n = self.rng.randint(1, 8) if self.forks_here else 8  # the widest fan-out once per case
        self.forks_here += 1
        state = ref.state_dict()
        for b in branch.fork(n):
            if b.rewind_chunks != branch.rewind_chunks:
                return self.fail(f"a branch keeps the boundaries {b.rewind_chunks}, its parent {branch.rewind_chunks}")
            r = self.build()
            r.load_state_dict(state)
            self.live.append([b, r, dict(kept), depth + 1])  # the parent's boundaries, the fork point among them
        self.res["forks"] += 1
        self.res["max_fanout"] = max(self.res["max_fanout"], n)
        self.res["max_depth"] = max(self.res["max_depth"], depth + 1)

    def rewind(self, entry: list[Any]) -> None:
        branch, ref, kept, _ = entry
        c = self.rng.choice(branch.rewind_chunks)
        branch.rewind(c)
        ref.load_state_dict(kept[c * self.chunk])
        for end in [e for e in kept if e > c * self.chunk]:
            del kept[end]
        self.same(branch, ref, f"after rewind({c})")
        self.res["rewinds"] += 1

    def release(self, i: int) -> None:
        branch = self.live.pop(i)[0]
        branch.release()
        self.res["releases"] += 1
        self.rejected(lambda: branch.begin_chunk(branch.next_chunk), "call on a released branch")

    def move(self, entry: list[Any]) -> None:
        """export_stream -> import_stream into a fresh paged cache of its own pool, which replaces the branch."""
        branch, ref = entry[0], entry[1]
        blob = branch.export_stream()
        other = self.build(pages={**self.pages, "history": self.history})
        other.import_stream(blob)
        self.same(other, ref, "after export/import")
        a, b = other.state_dict(), branch.state_dict()
        if any(not (torch.equal(a[x], b[x]) if isinstance(b[x], torch.Tensor) else a[x] == b[x]) for x in b):
            self.fail("an imported stream's state differs from the exported one")
        # the branch stays (its pool is the family's); the import's own pool is released here
        other.release()
        self.res["exports"] += 1

    def reject_one(self, entry: list[Any]) -> None:
        branch = entry[0]
        blob = branch.export_stream()
        edited = self.edit(blob)
        other_kind = self.rng.choice([k for k in POLICIES if k != self.kind] or [self.kind])
        options = [
            (lambda: branch.fork(0), "fork(0)"),
            (lambda: branch.rewind(branch.next_chunk + 3), "rewind to a boundary not kept"),
            (lambda: branch.import_stream(bytes(edited)), "import of an edited stream"),
            (lambda: self.build(pages=True, kind=other_kind).import_stream(blob)
             if other_kind != self.kind else branch.fork(-1), "import of another configuration"),
            (lambda: self.build(pages=None).fork(1), "fork of an unpaged cache"),
        ]
        call, what = self.rng.choice(options)
        with warnings.catch_warnings():  # torch.load on an edited pickle warns about its protocol byte
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            self._reject(entry, call, what)

    def _reject(self, entry: list[Any], call, what: str) -> None:
        branch = entry[0]
        if self.rng.random() < 0.3 and self.pool.free >= self.own:  # a fork with a span open
            branch.begin_chunk(branch.next_chunk)  # legal: the rejection is of what follows
            self.rejected(lambda: branch.fork(1), "fork with a span open")
            return self.close(entry)
        self.rejected(call, what)

    def edit(self, blob: bytes) -> bytearray:
        """``blob`` with one byte flipped where it changes what loads (a byte of zip padding may not:
        such positions are skipped, up to 64 tries, else the format tag is broken)."""
        for _ in range(64):
            edited = bytearray(blob)
            edited[self.rng.randrange(len(edited))] ^= 0xFF
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
                    a = torch.load(io.BytesIO(bytes(edited)), weights_only=True)
            except Exception:  # noqa: BLE001 - unreadable: an edit the import must refuse
                return edited
            b = torch.load(io.BytesIO(blob), weights_only=True)
            if not _same_payload(a, b):
                return edited
        return bytearray(blob.replace(b"streamkv-stream", b"streamkv-STREAM", 1))

    def close(self, entry: list[Any]) -> None:
        """The span a refused fork left open (begun on purpose): written and committed in both."""
        branch, ref, kept, _ = entry
        q, k, v = self.data()
        n = branch.open_chunk
        ref.begin_chunk(n)
        a = attend(q, branch.layer(0).update(k, v, q))[0]
        b = attend(q, ref.layer(0).update(k, v, q))[0]
        branch.commit_chunk(n)
        ref.commit_chunk(n)
        if not float((a - b).abs().max()) <= TOL:
            self.fail("after a refused fork, the open chunk's attention differs")
        kept[branch.end] = ref.state_dict()

    def finish(self) -> None:
        for entry in self.live:
            entry[0].release()
        self.live = []
        leaked = self.pool.used + self.pool.reserved
        if leaked:
            self.res["leaked_pages"] += leaked
            self.fail(f"{leaked} pages still in use after every branch was released")


def fuzz_branches(cases: int = 20, steps: int = 40, seed: int = 0, *, progress=None) -> dict[str, Any]:
    """``cases`` random families of ``steps`` calls each (module docstring); counts, JSON-ready."""
    t0 = time.perf_counter()
    rng = random.Random(seed)
    res: dict[str, Any] = {"cases": 0, "steps": 0, "forks": 0, "rewinds": 0, "releases": 0, "exports": 0,
                           "rejected_calls": 0, "pool_full_refusals": 0, "state_changes_after_rejection": 0, "bad_calls_accepted": 0,
                           "mismatches": 0, "leaked_pages": 0, "max_depth": 0, "max_fanout": 0, "kinds": {},
                           "formats": {}, "maps": {}, "failures": []}
    for i in range(cases):
        case = _Case(rng, res, i)
        res["cases"] += 1
        try:
            for _ in range(steps):
                _call(case, rng)
            case.finish()
        except Exception as exc:  # noqa: BLE001 - a legal call that raises is a finding; the case ends there
            case.fail(f"a legal call raised {type(exc).__name__}: {exc}")
        if progress is not None:
            progress(i + 1)
    res["seconds"] = time.perf_counter() - t0
    return res


def _same_payload(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_payload(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.nan_to_num(), b.nan_to_num()) and \
            torch.equal(a.isnan(), b.isnan())
    return type(a) is type(b) and a == b


def _call(case: _Case, rng: random.Random) -> None:
    i = rng.randrange(len(case.live))
    entry = case.live[i]
    branch = entry[0]
    r = rng.random()
    if r < 0.45 or branch.end < 2 * case.chunk:
        if case.pool.free < case.own and len(case.live) > 1 and rng.random() < 0.5:
            return case.release(i)  # room for the next writes (else the write may be refused: also checked)
        return case.step(entry)
    if r < 0.62 and len(case.live) < 24:
        return case.fork(i)
    if r < 0.72 and branch.rewind_chunks:
        return case.rewind(entry)
    if r < 0.8 and len(case.live) > 1:
        return case.release(i)
    if r < 0.86:
        return case.move(entry)
    return case.reject_one(entry)
