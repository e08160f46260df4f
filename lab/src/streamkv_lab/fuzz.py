"""A differential fuzzer over every cache kind and its observers: random layouts, random call
sequences with rejected calls and observer faults mixed in, the full state (cache, certifier,
whole-history check) snapshotted around every rejection, every read compared with a
whole-history float64 reference, every certificate checked against float64 truth, state dicts
round-tripped through ``torch.save`` / ``torch.load(weights_only=True)``.

Kinds come from :data:`streamkv.policies.POLICIES` when a layout is drawn (:func:`kinds`): a
policy registered there is fuzzed with no edit here. Each policy runs as

- ``<name>``: the plain cache, built from the policy's ``example_params`` (a
  :class:`~streamkv.policies.FixedBudget` kind with a random ``budget`` in its range
  ``sink + chunk <= budget <= sink + window - chunk``);
- ``certified-<name>``: watched by a :class:`~streamkv.certify.Certifier` with block boxes
  (random summary options: events per block, pooling, merging, box dtype; with or without
  recall slots and ``recall_tau``), any dtype;
- ``twotier-<name>``: recall slots + a certifier with key sketches (8 or 4 bits) and
  ``recall_tau``, float32 / float16 / bfloat16 (sketches are refused on float64 by design).

Every certified cache carries a :class:`~streamkv.certify.HistoryCheck` (float64 whole
history, ``check_storage=True``). A third of the layouts are a :class:`~streamkv.caches.CacheSet`
of two branches (``cond``, ``uncond``; whole chunks only, every lifecycle call through the
set). Per layout also: a rank 3-5 shape with the token and head dims anywhere, sink / window /
chunk sizes (aligned or not), a dtype (bf16, fp16, fp32, fp64), 1-2 layers, 1-3 query heads per
key head (grouped-query attention) where there is a head dim, and whether the fault observer
watches before or after the certifier. Inputs come in random memory layouts:
contiguous, transposed, strided, offset or expanded (stride 0). Then a random sequence of calls:

- legal ones: ``begin_chunk`` (advance or reopen), ``begin_tokens(n)``, ``update(k, v, q)``
  (or ``write`` + ``observe_queries``, or queries only through ``attend``) and ``attend``
  (causal or not), ``commit``, ``reset``, a state-dict round trip into a fresh cache;
- rejected ones: wrong shape / rank / dtype / device, sparse, requiring grad, overlapping the
  cache's own buffer, a bad layer, lifecycle misuse, tampered state dicts (positions from the
  future, a non-int counter, a span longer than a chunk, aliasing the live buffers, one
  tampered branch of a set), a load into a certified cache, and the certifier's
  preconditions (late attach after an eviction, a second recall owner, recall without recall
  slots, sketches of a float64 cache, bad options, a late whole-history check);
- observer faults on the next lifecycle call (begin, commit, reset, load): a veto in one
  branch's ``prepare`` (the call must be refused and the full state of every branch unchanged);
  a plan prepared and dropped (an aborted begin / commit / reset / load: nothing changes); NaN
  queries in one branch (a policy that needs queries: the commit of every branch is refused,
  nothing changes; the retry rewrites the span); an observer or eviction listener that raises
  *after* the change was applied (the cache must raise ``RuntimeError`` saying the change
  stands, and its full state must equal that of a ``copy.deepcopy`` twin that ran the same
  call with the fault disarmed: consistent with the applied change, not with the old state).

Counted: ``calls``; ``rejected_calls`` (each must raise TypeError/ValueError/RuntimeError);
``state_changes_after_rejection`` (the full snapshot differed after a rejected call, a veto,
a refusing branch or an aborted plan); ``bad_calls_accepted`` (a call that should have been
refused went through); ``mismatches`` (a held slot whose K/V differ from the history, a window
cache not holding ``[sinks | last window]``, an attention output off the float64 reference
beyond the dtype's rounding, a round-tripped state that differs, a state after a post-apply
fault that differs from the twin's); ``certified_layouts``; ``observer_faults`` (faults
injected that fired, by kind in ``observer_fault_kinds``); ``certificate_undercounts`` (per
certified cache, the history check's violations — a certified mass or error bound below the
float64 truth — plus its count, storage, duplicate-position and outside-history mismatches);
``certified_queries_checked`` / ``certified_nontrivial_rows`` (rows it checked, and those
with something evicted) and ``certified_layouts_evicting`` (certified layouts with such a row). The target is zero of the undercounts, the state changes, the bad
calls and the mismatches.

Why one module: the layout draw, the call sequence, the fault injection and the checks share
one per-layout state (the caches, their history, what is open and written); split, each part
would need all of it.
"""

from __future__ import annotations

import copy
import io
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from streamkv.attention import attend
from streamkv.caches import CacheObserver, CacheSet, KVCache
from streamkv.certify import Certifier, HistoryCheck
from streamkv_lab.snapshot import same_state, snapshot
from streamkv.layout import CacheLayout
from streamkv.policies import POLICIES, FixedBudget, make_policy

__all__ = ["FuzzResult", "Layout", "draw_layout", "fuzz_layout", "kinds", "run_fuzz"]

CERTIFIED, TWO_TIER = "certified-", "twotier-"
DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SKETCH_DTYPES = ("float32", "float16", "bfloat16")  # key sketches hold float32: refused on float64 caches
#: attention of the cache (kernel in its dtype) vs float64 over the same stored values: relative to the output scale
TOL = {"float64": 1e-10, "float32": 2e-5, "float16": 2e-2, "bfloat16": 5e-2}
ERRORS = (TypeError, ValueError, RuntimeError)
BRANCHES = ("cond", "uncond")
#: what the history check reports that makes a certificate untrustworthy (each counted as an undercount)
UNDERCOUNT_KEYS = ("violations", "count_mismatch", "storage_mismatch", "duplicate_positions", "kept_outside_history")


def kinds() -> tuple[str, ...]:
    """Every kind drawn, from :data:`~streamkv.policies.POLICIES` as it is now: each policy plain,
    certified with block boxes, and as a two-tier cache (every policy evicts: the window ones
    at a begin, the scored ones at a commit)."""
    names = tuple(POLICIES)
    return names + tuple(CERTIFIED + n for n in names) + tuple(TWO_TIER + n for n in names)


@dataclass(frozen=True)
class Layout:
    kind: str
    shape: tuple[int, ...]  # one layer's K buffer (tokens at seq_dim = sink + window)
    value_dim: int
    seq_dim: int
    head_dim: int | None
    sink: int
    window: int
    chunk: int
    layers: int
    dtype: str
    params: tuple[tuple[str, Any], ...] = ()  # the policy's constructor arguments
    branches: int = 1  # 2: a CacheSet of ``BRANCHES``
    recall_slots: int = 0
    certifier: tuple[tuple[str, Any], ...] = ()  # Certifier options (certified kinds)
    fault_first: bool = False  # the fault observer and listener watch before the certifier
    query_groups: int = 1  # query heads per key head (grouped-query attention)

    @property
    def policy(self) -> str:
        return self.kind.removeprefix(CERTIFIED).removeprefix(TWO_TIER)

    @property
    def certified(self) -> bool:
        return self.kind.startswith((CERTIFIED, TWO_TIER))


@dataclass
class FuzzResult:
    layouts: int = 0
    calls: int = 0
    rejected_calls: int = 0
    state_changes_after_rejection: int = 0
    bad_calls_accepted: int = 0
    mismatches: int = 0
    certified_layouts: int = 0
    observer_faults: int = 0
    certificate_undercounts: int = 0
    certified_queries_checked: int = 0
    certified_nontrivial_rows: int = 0
    certified_layouts_evicting: int = 0
    group_layouts: int = 0
    seconds: float = 0.0
    kinds: dict[str, int] = field(default_factory=dict)
    observer_fault_kinds: dict[str, int] = field(default_factory=dict)
    #: layouts with an undercount, by kind (``+recall``: the certifier recalls into recall slots)
    certificate_undercount_layouts: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # the first few, for a human
    positions: dict[str, Any] = field(default_factory=dict)  # the position-map hook (lab/fuzz_positions.py)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def draw_layout(rng: random.Random) -> Layout:
    kind = rng.choice(kinds())
    certified, sketch = kind.startswith((CERTIFIED, TWO_TIER)), kind.startswith(TWO_TIER)
    policy = kind.removeprefix(CERTIFIED).removeprefix(TWO_TIER)
    cls = POLICIES[policy]
    chunk = rng.randint(1, 4)
    # certified caches: small rooms, so that most runs evict and most certificates bound something
    sink = rng.randint(0, 2 if certified else 5)
    window = (2 * chunk if cls.per_head else chunk) + rng.randint(0, 3 if certified else 6)
    params = dict(cls.example_params)
    for _ in range(64):  # the policy's own minimum window, whatever it is
        try:
            make_policy(policy, **params).check_layout(CacheLayout(sink=sink, window=window, chunk=chunk))
            break
        except ValueError:
            window += 1
    else:
        raise RuntimeError(f"no window up to {window} fits the {policy} policy (sink={sink}, chunk={chunk})")
    if issubclass(cls, FixedBudget):
        params["budget"] = rng.randint(sink + chunk, sink + window - chunk)
    cap = sink + window
    rank = rng.randint(3, 5)
    seq = rng.randrange(rank - 1)
    others = [d for d in range(rank - 1) if d != seq]
    head = rng.choice(others) if certified else rng.choice(others + [None])
    sizes = [rng.randint(1, 3) for _ in range(rank - 1)] + [2 * rng.randint(1, 3)]
    sizes[seq] = cap
    if head is not None:
        sizes[head] = rng.randint(1, 3)
    dtype = rng.choice(SKETCH_DTYPES if sketch else list(DTYPES))
    recall_slots, opts = 0, {}
    if certified:
        opts["causal"] = rng.random() < 0.5
        if sketch or rng.random() < 0.5:
            recall_slots = rng.randint(1, 8)
            opts["recall_tau"] = rng.choice([0.02, 0.1, 0.3, 0.6])
        if sketch:
            opts["sketch_bits"] = rng.choice([8, 8, 8, 4])
            opts["block_tokens"] = rng.choice([1, 3, 8, 32])
        else:
            opts["events_per_block"] = rng.choice([1, 1, 2, 5])
            opts["pool_events"] = rng.choice([None, None, 2, 4])
            opts["block_tokens"] = rng.choice([2, 8, 24])
            opts["max_blocks"] = rng.choice([None, None, 2, 6])
            opts["box_dtype"] = rng.choice([None, None, torch.float32, torch.bfloat16])
        if rng.random() < 0.3:
            opts["scale"] = rng.choice([0.25, 1.0, 3.0])
    return Layout(kind, tuple(sizes), 2 * rng.randint(1, 3), seq, head, sink, window, chunk, rng.randint(1, 2), dtype,
                  params=tuple(sorted(params.items())), branches=2 if rng.random() < 0.33 else 1,
                  recall_slots=recall_slots, certifier=tuple(sorted(opts.items())), fault_first=rng.random() < 0.5,
                  query_groups=1 if head is None else rng.choice([1, 1, 2, 3]))


class _Fault(CacheObserver):
    """Dormant until armed. ``veto`` (a change: ``"begin"``, ``"commit"``, ``"reset"``,
    ``"load"``) raises in ``prepare``; ``after = (change, where)`` raises once that change was
    applied, from the action its prepare returns (``"action"``), from the hook (``"hook"``), or
    from the eviction listener (``"evict"``, :meth:`listener`). Raising changes nothing of it."""

    def __init__(self) -> None:
        self.veto: str | None = None
        self.after: tuple[str, str] | None = None

    def disarm(self) -> None:
        self.veto = self.after = None

    def prepare(self, change):
        if self.veto == change.what:
            raise RuntimeError(f"fuzz fault: veto of the {change.what}")
        if self.after == (change.what, "action"):
            return self._fail
        return None

    def _fail(self) -> None:
        raise RuntimeError(f"fuzz fault after the {self.after[0]}")

    def _hook(self, what: str) -> None:
        if self.after == (what, "hook"):
            self._fail()

    def on_begin(self, cache, chunk_idx, advance) -> None:
        self._hook("begin")

    def on_commit(self, cache, chunk_idx) -> None:
        self._hook("commit")

    def on_reset(self, cache) -> None:
        self._hook("reset")

    def on_load(self, cache) -> None:
        self._hook("load")

    def listener(self, event) -> None:
        if self.after is not None and self.after[1] == "evict":
            self._fail()


#: a lifecycle call is ``(method, args)`` on the root (a cache or a cache set); an aborted one runs
#: each branch's ``prepare_*`` of it and drops the step
_PREPARE = {"begin_chunk": "prepare_begin", "begin_tokens": "prepare_begin_tokens", "commit_chunk": "prepare_commit",
            "reset": "prepare_reset", "load_state_dict": "prepare_load"}
_CHANGE = {"begin_chunk": "begin", "begin_tokens": "begin", "commit_chunk": "commit", "commit": "commit",
           "reset": "reset", "load_state_dict": "load"}


class _Fuzz:
    """One layout's run; counts go to ``res``."""

    def __init__(self, lay: Layout, rng: random.Random, res: FuzzResult) -> None:
        self.lay, self.rng, self.res = lay, rng, res
        self.dtype = DTYPES[lay.dtype]
        self.needs_queries = POLICIES[lay.policy].needs_queries
        self.gen = torch.Generator().manual_seed(rng.randrange(2**31))
        self.root, self.caches, self.faults, self.checks = self._build()
        self.hist: list[list[dict[int, tuple[torch.Tensor, torch.Tensor]]]] = [
            [{} for _ in range(lay.layers)] for _ in self.caches]
        self.written = True  # the open span is written in every branch and layer (vacuous when closed)

    @property
    def group(self) -> bool:
        return self.lay.branches > 1

    def _build(self) -> tuple[Any, list[KVCache], list[_Fault], list[HistoryCheck]]:
        lay = self.lay
        v_shape = lay.shape[:-1] + (lay.value_dim,)
        kw = dict(seq_dim=lay.seq_dim, head_dim=lay.head_dim, sink=lay.sink, window=lay.window, chunk=lay.chunk,
                  num_layers=lay.layers, dtype=self.dtype, recall_slots=lay.recall_slots, **dict(lay.params))
        if self.group:
            root = CacheSet(lay.policy, k_shape=lay.shape, v_shape=v_shape, branches=BRANCHES, **kw)
            caches = [root[b] for b in root.branches]
        else:
            root = KVCache(lay.shape, v_shape, policy=lay.policy, **kw)
            caches = [root]
        faults, checks = [], []
        for c in caches:
            fault = _Fault()
            if lay.fault_first or not lay.certified:
                c.add_observer(fault)
                c.add_eviction_listener(fault.listener)
            if lay.certified:
                checks.append(HistoryCheck(Certifier(c, **dict(lay.certifier)), check_storage=True))
                if not lay.fault_first:
                    c.add_observer(fault)
                    c.add_eviction_listener(fault.listener)
            faults.append(fault)
        return root, caches, faults, checks

    # ----------------------------------------------------------------- inputs
    def _rows(self, last: int, n: int, groups: int = 1) -> torch.Tensor:
        """Random rows of the open span in a random memory layout (``groups`` times the heads: queries)."""
        shape = list(self.lay.shape[:-1]) + [last]
        shape[self.lay.seq_dim] = n
        if groups > 1:
            shape[self.lay.head_dim] *= groups
        base = torch.randn(shape, generator=self.gen, dtype=torch.float64).to(self.dtype)
        how = self.rng.choice(["contiguous", "transposed", "strided", "offset", "expanded"])
        if how == "transposed" and len(shape) >= 2:
            perm = list(range(len(shape)))
            self.rng.shuffle(perm)
            inv = [perm.index(d) for d in range(len(shape))]
            return base.permute(perm).contiguous().permute(inv)
        if how == "strided":
            big = torch.zeros([2 * s for s in shape], dtype=self.dtype)
            view = big[tuple(slice(None, None, 2) for _ in shape)]
            view.copy_(base)
            return view
        if how == "offset":
            big = torch.zeros([s + 1 for s in shape], dtype=self.dtype)
            view = big[tuple(slice(1, None) for _ in shape)]
            view.copy_(base)
            return view
        if how == "expanded":
            ones = [d for d, s in enumerate(shape) if s == 1]
            if ones:
                return base.expand(*shape)  # a size-1 dim with stride 0 would need a broadcast source
            d = self.rng.randrange(len(shape) - 1)
            if d != self.lay.seq_dim:
                small = base.narrow(d, 0, 1)
                return small.expand(*shape)
        return base

    # ------------------------------------------------------------ legal calls
    def begin_call(self) -> tuple[str, tuple]:
        c, C = self.caches[0], self.lay.chunk
        if self.group or (c.end % C == 0 and (self.rng.random() < 0.6 or c.end == 0)):
            if c.last_span is not None and c.last_span[1] == C and self.rng.random() < 0.2:
                return "begin_chunk", (c.next_chunk - 1,)
            return "begin_chunk", (c.next_chunk,)
        return "begin_tokens", (self.rng.randint(1, C),)

    def commit_call(self) -> tuple[str, tuple]:
        c = self.caches[0]
        return ("commit_chunk", (c.open_chunk,)) if c.open_chunk is not None else ("commit", ())

    def load_call(self) -> tuple[str, tuple]:
        return "load_state_dict", (self.root.state_dict(),)

    def run(self, call: tuple[str, tuple]) -> None:
        """A legal lifecycle call on the root, and what it does to the fuzzer's own record."""
        name, args = call
        getattr(self.root, name)(*args)
        self._applied(name)

    def _applied(self, name: str) -> None:
        if _CHANGE[name] == "begin":
            self.written = False
        elif name == "reset":
            self.hist = [[{} for _ in range(self.lay.layers)] for _ in self.caches]
            self.written = True

    def update(self) -> None:
        for b in range(len(self.caches)):
            for layer in range(self.lay.layers):
                self._update_one(b, layer)
        self.written = True

    def _update_one(self, b: int, layer: int, nan: bool = False) -> None:
        c, lay = self.caches[b], self.lay
        start, n = c.open_span
        k, v = self._rows(lay.shape[-1], n), self._rows(lay.value_dim, n)
        q = self._rows(lay.shape[-1], n, lay.query_groups)
        if nan:
            q = q.clone(memory_format=torch.contiguous_format)
            q.view(-1)[self.rng.randrange(q.numel())] = math.nan
        how = self.rng.random()
        if how < 0.15:  # the transformers path: the write, then the queries
            c.write(k, v, layer)
            c.layer(layer).observe_queries(q)
            read = c.read(layer)
        elif how < 0.25 and not nan:  # queries only through attend (no certificate this step)
            read = c.layer(layer).update(k, v)
        else:
            read = c.layer(layer).update(k, v, q)
        for i in range(n):
            self.hist[b][layer][start + i] = (k.select(lay.seq_dim, i).clone(), v.select(lay.seq_dim, i).clone())
        if nan:
            return
        causal = self.rng.random() < 0.5
        out, _ = attend(q, read, causal=causal)
        self._check_attention(b, layer, q, out, causal)

    def round_trip(self) -> None:
        """Save through ``torch.save``, load with ``weights_only=True`` into a fresh cache (set),
        compare the two state dicts, then continue the stream on the restored one (every later
        check runs against it). Certified caches refuse state dicts (a rejected call instead)."""
        if self.lay.certified:
            return
        buf = io.BytesIO()
        torch.save(self.root.state_dict(), buf)
        state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        fresh = self._build()
        try:
            fresh[0].load_state_dict(state)
        except ERRORS as exc:
            return self._mismatch(f"a cache refused its own state dict: {exc}")
        a, b = fresh[0].state_dict(), self.root.state_dict()
        pairs = [(a[n], b[n]) for n in BRANCHES] if self.group else [(a, b)]
        for x, y in pairs:
            for key in y:
                same = torch.equal(x[key], y[key]) if isinstance(y[key], torch.Tensor) else x[key] == y[key]
                if not same:
                    return self._mismatch(f"state dict round trip: {key} differs")
        self.root, self.caches, self.faults, self.checks = fresh

    # ---------------------------------------------------------------- checks
    def _fail(self, what: str) -> None:
        if len(self.res.failures) < 20:
            self.res.failures.append(f"{self.lay}: {what}")

    def _mismatch(self, what: str) -> None:
        self.res.mismatches += 1
        self._fail(what)

    def _head_rows(self, t: torch.Tensor, head: int, c: KVCache) -> torch.Tensor:
        st = c.storage
        x = t.movedim(st.seq_dim, -2)
        return x.select(st.head_axis, head) if st.head_axis is not None else x

    def check_storage(self) -> None:
        """Every held slot (recall slots included) holds its position's K/V of the history, per
        head; a window cache holds exactly ``[sinks | last window]``."""
        sd = self.lay.seq_dim
        for b, c in enumerate(self.caches):
            if c.is_open and not all(p in self.hist[b][0] for p in range(c.open_span[0], c.end)):
                continue  # the open span is not written yet
            for layer in range(self.lay.layers):
                pos = c.layer_slot_positions(layer)
                hist = self.hist[b][layer]
                for h, row in enumerate(pos.tolist()):
                    slots = [s for s, p in enumerate(row) if p >= 0]
                    if not slots:
                        continue
                    idx = torch.tensor(slots)
                    for which, buf in ((0, c.keys(layer)), (1, c.values(layer))):
                        want = torch.stack([hist[row[s]][which] for s in slots], sd)
                        if not torch.equal(self._head_rows(buf.index_select(sd, idx), h, c), self._head_rows(want, h, c)):
                            return self._mismatch(f"branch {b} layer {layer} head {h}: a slot of {slots} does not "
                                                  f"hold its position's {'KV'[which]} ({[row[s] for s in slots]})")
                if c.retains_window:
                    got = sorted(p for p in pos[0, : c.layout.capacity].tolist() if p >= 0)
                    if got != c.layout.retained_positions(c.end):
                        return self._mismatch(f"window cache holds {got}, not [sinks | last window]")

    def _check_attention(self, b: int, layer: int, q: torch.Tensor, out: torch.Tensor, causal: bool) -> None:
        c = self.caches[b]
        qpos = torch.arange(c.open_span[0], c.end)
        pos = c.layer_slot_positions(layer)
        worst, scale, G = 0.0, 0.0, self.lay.query_groups
        for h in range(pos.shape[0]):
            held = sorted(p for p in pos[h].tolist() if p >= 0)
            hist = [self.hist[b][layer][p] for p in held]
            k = torch.stack([self._head_rows(x[0].unsqueeze(self.lay.seq_dim), h, c).squeeze(-2) for x in hist], -2)
            v = torch.stack([self._head_rows(x[1].unsqueeze(self.lay.seq_dim), h, c).squeeze(-2) for x in hist], -2)
            for hq in range(h * G, (h + 1) * G):  # query head hq reads key head hq // G
                qh = self._head_rows(q, hq, c).double()
                s = qh @ k.double().transpose(-1, -2) / k.shape[-1] ** 0.5
                if causal:
                    s = s.masked_fill(torch.tensor(held).view(1, -1) > qpos.view(-1, 1), float("-inf"))
                want = s.softmax(-1) @ v.double()
                worst = max(worst, float((self._head_rows(out, hq, c).double() - want).abs().max()))
                scale = max(scale, float(want.abs().max()))
        if not worst <= TOL[self.lay.dtype] * max(scale, 1.0):  # NaN fails too
            self._mismatch(f"attention off the float64 reference by {worst:.3g} (scale {scale:.3g})")

    def finish(self) -> None:
        """Every certified cache's whole-history verdict on every certificate it saw."""
        nontrivial = undercounts = 0
        for b, check in enumerate(self.checks):
            r = check.result()
            self.res.certified_queries_checked += r["queries_checked"]
            nontrivial += r["nontrivial"]
            bad = {k: r[k] for k in UNDERCOUNT_KEYS if r[k]}
            if bad:
                undercounts += sum(bad.values())
                self._fail(f"branch {b}: the history check found {bad}")
        self.res.certified_nontrivial_rows += nontrivial
        self.res.certified_layouts_evicting += nontrivial > 0
        if undercounts:
            self.res.certificate_undercounts += undercounts
            key = self.lay.kind + (" +recall" if self.lay.recall_slots else "")
            self.res.certificate_undercount_layouts[key] = self.res.certificate_undercount_layouts.get(key, 0) + 1

    # ----------------------------------------------------------- rejections
    def _unchanged(self, before: dict, what: str) -> None:
        diff = same_state(before, snapshot(self.root))
        if diff:
            self.res.state_changes_after_rejection += 1
            self._fail(f"state changed after {what}: {diff}")

    def rejected(self) -> None:
        """One call that must be refused, with the full state compared around it."""
        lay = self.lay
        b = self.rng.randrange(len(self.caches))
        c = self.caches[b]
        n = c.open_span[1] if c.is_open else lay.chunk
        k, v = self._rows(lay.shape[-1], n), self._rows(lay.value_dim, n)
        wrong = {torch.float64: torch.float32}.get(self.dtype, torch.float64)
        options: list[Callable[[], Any]] = [
            lambda: c.write(k.narrow(lay.seq_dim, 0, max(1, n - 1)) if n > 1 else torch.cat([k, k], lay.seq_dim), v, 0),
            lambda: c.write(k.to(wrong), v, 0),
            lambda: c.write(k, v.to("meta"), 0),
            lambda: c.write(k, v.to_sparse(), 0),
            lambda: c.write(k, v.clone().requires_grad_(True), 0) if torch.is_grad_enabled() else c.write(k, v, -1),
            lambda: c.write(k, c.values(0).narrow(lay.seq_dim, 0, n), 0),
            lambda: c.write(k, v, lay.layers),
            lambda: c.update(k, v, k.to(wrong), layer=0),
            lambda: c.begin_chunk(c.next_chunk + 2),
            lambda: c.begin_tokens(lay.chunk + 1),
            lambda: c.commit_chunk(c.next_chunk + 5),
            lambda: c.read(0, occupancy="everything"),
            lambda: self._tampered_load(c) if not lay.certified else self._certified_load(c),
            lambda: Certifier(c, scale=self.rng.choice([math.nan, -1.0, 0.0, math.inf, True])),
            lambda: Certifier(c, sketch_bits=self.rng.choice([3, 16, True])),
            lambda: Certifier(c, recall_tau=0.1),  # no recall slots, or a second recall owner
        ]
        if not c.is_open:
            options.append(lambda: c.write(k, v, 0))
        if self.dtype == torch.float64:
            options.append(lambda: Certifier(c, sketch_bits=8))  # sketches below the cache's precision
        if self._has_evicted(c):
            options.append(lambda: Certifier(c))  # late attach: it would miss what left
        if lay.certified and c.end:
            options.append(lambda: HistoryCheck(self.checks[b].certifier))  # it would miss the stream's start
        if self.group:
            root = self.root
            options += [
                lambda: root.begin_chunk(c.next_chunk + 2),
                lambda: root.commit_chunk(c.next_chunk + 5),
                lambda: root.reset(branches="cond"),
                lambda: root.reset(branches=["cond", "cond"]),
                lambda: root.load_state_dict({"cond": None}),
            ]
            if not lay.certified:
                options.append(lambda: self._tampered_load(c, group=True))
        call = self.rng.choice(options)
        before = snapshot(self.root)
        self.res.rejected_calls += 1
        try:
            got = call()
        except ERRORS:
            return self._unchanged(before, "a rejected call")
        except Exception as exc:  # noqa: BLE001 - an undocumented exception type is a finding
            return self._mismatch(f"rejected with {type(exc).__name__}: {exc}")
        self.res.bad_calls_accepted += 1
        self._fail("a call that must be refused went through")
        if isinstance(got, CacheObserver) and got in c.observers:
            c.remove_observer(got)  # keep the run going with the layout's own observers

    def _has_evicted(self, c: KVCache) -> bool:
        """Some head holds fewer positions than entered the stream (what the certifier checks at attach)."""
        held = (c.storage.slot_positions[..., : c.storage.capacity] >= 0).sum(-1)
        return bool(c.end) and int(held.min()) < c.end

    def _certified_load(self, c: KVCache) -> None:
        """A certified cache refuses state dicts: a cache with recall slots refuses to save one,
        and the certifier vetoes loading even the cache's own (its summaries are not in it)."""
        c.load_state_dict(c.state_dict())

    def _tampered_load(self, c: KVCache, group: bool = False) -> None:
        state = c.state_dict()
        how = self.rng.choice(["future", "float_end", "span", "alias", "duplicate"])
        rows = state["slot_positions"].reshape(-1, state["slot_positions"].shape[-1])  # one row per (layer, head)
        row = int((rows >= 0).sum(-1).argmax())
        held = (rows[row] >= 0).nonzero().flatten().tolist()
        if how == "duplicate" and len(held) < 2:
            how = "future"
        if how == "future":
            state["slot_positions"] = state["slot_positions"].clone()
            state["slot_positions"].view(-1)[0] = state["end"] + 7
        elif how == "float_end":
            state["end"] = float(state["end"])
        elif how == "span":
            state["span"] = c.layout.chunk + 1
        elif how == "alias":
            state["keys"] = c.storage.keys
        else:  # one slot of a head holds a position another slot of the same head holds too
            p = state["slot_positions"].clone()
            r = p.view(-1, p.shape[-1])[row]
            r[held[1]] = r[held[0]]
            state["slot_positions"] = p
        if group:  # every other branch's state is good: the set must load none of them
            full = self.root.state_dict()
            full[next(n for n in BRANCHES if self.root[n] is c)] = state
            self.root.load_state_dict(full)
        else:
            c.load_state_dict(state)

    # ------------------------------------------------------- observer faults
    def _count_fault(self, kind: str) -> None:
        self.res.observer_faults += 1
        self.res.observer_fault_kinds[kind] = self.res.observer_fault_kinds.get(kind, 0) + 1

    def fault(self) -> None:
        """An observer fault on the next lifecycle call (see the module docstring)."""
        c = self.caches[0]
        loads = [] if self.lay.certified else ["load"]  # certified caches refuse loads: a rejection
        if not c.is_open:
            what = self.rng.choice(["begin"] * 4 + ["reset"] + loads)
        elif self.written:
            what = self.rng.choice(["commit"] * 4 + ["reset"] + loads)
        else:
            what = self.rng.choice(["reset"] + loads)
        call = {"begin": self.begin_call, "commit": self.commit_call, "reset": lambda: ("reset", ()),
                "load": self.load_call}[what]()
        modes = ["veto", "veto", "after", "after", "aborted"]
        if what == "commit" and self.needs_queries:
            modes += ["nan", "nan"]
        mode = self.rng.choice(modes)
        if mode == "aborted" and call[0] == "commit":
            mode = "veto"  # commit() of a partial span has no public prepare
        b = self.rng.randrange(len(self.caches))
        if mode == "veto":
            self._vetoed(call, b)
        elif mode == "aborted":
            self._aborted(call)
        elif mode == "nan":
            self._nan_branch(call, b)
        else:
            self._after_apply(call, b, what)

    def _expect_refusal(self, call: tuple[str, tuple], before: dict, what: str, kind: str,
                        errors: tuple[type[Exception], ...] = ERRORS) -> bool:
        name, args = call
        try:
            getattr(self.root, name)(*args)
        except errors:
            self._count_fault(kind)
            self._unchanged(before, what)
            return True
        except Exception as exc:  # noqa: BLE001
            self._mismatch(f"{what}: {type(exc).__name__}: {exc}")
            return False
        self.res.bad_calls_accepted += 1
        self._fail(f"{what}: the {name} went through")
        self._applied(name)
        return False

    def _vetoed(self, call: tuple[str, tuple], b: int) -> None:
        """One branch's observer vetoes the change in its prepare: every branch stays as it was."""
        self.faults[b].veto = _CHANGE[call[0]]
        before = snapshot(self.root)
        try:
            self._expect_refusal(call, before, f"a veto of {call[0]} in branch {b}", f"veto_{_CHANGE[call[0]]}")
        finally:
            self.faults[b].disarm()

    def _aborted(self, call: tuple[str, tuple]) -> None:
        """Every branch prepares the change (checks, plan, observers' prepare), and none runs it."""
        name, args = call
        before = snapshot(self.root)
        for i, c in enumerate(self.caches):
            a = (args[0][BRANCHES[i]],) if name == "load_state_dict" and self.group else args
            getattr(c, _PREPARE[name])(*a)  # the step is dropped
        self._count_fault(f"aborted_{_CHANGE[name]}")
        self._unchanged(before, f"an aborted {name}")

    def _nan_branch(self, call: tuple[str, tuple], b: int) -> None:
        """NaN queries in one branch's layer: the policy's statistics are not finite, and the
        commit of every branch is refused; then the retry rewrites the span everywhere."""
        self._update_one(b, self.rng.randrange(self.lay.layers), nan=True)
        before = snapshot(self.root)
        self._expect_refusal(call, before, f"a commit with NaN statistics in branch {b}", "nan_statistics",
                             (ValueError,))
        if self.caches[0].is_open:
            self.update()

    def _after_apply(self, call: tuple[str, tuple], b: int, what: str) -> None:
        """One branch's observer raises after the change was applied: the change stands (the cache
        says so), every observer was told, and the full state equals a twin's that ran the same
        call with no fault."""
        where = self.rng.choice(["action", "hook"] + (["evict"] if what in ("begin", "commit") else []))
        twin = copy.deepcopy(self.root)
        for o in [o for c in _branches_of(twin) for o in c.observers]:
            if isinstance(o, _Fault):
                o.disarm()
        name, args = call
        try:
            getattr(twin, name)(*args)
        except Exception as exc:  # noqa: BLE001
            return self._mismatch(f"the fault-free twin refused the legal {name}{args}: {type(exc).__name__}: {exc}")
        self.faults[b].after = (what, where)
        try:
            getattr(self.root, name)(*args)
            fired = False
        except RuntimeError as exc:
            fired = True
            if "the change stands" not in str(exc) or "fuzz fault" not in str(exc):
                self._mismatch(f"a fault after the {what} ({where}) raised {exc!r}, not 'the change stands'")
        except Exception as exc:  # noqa: BLE001
            fired = True
            self._mismatch(f"a fault after the {what} ({where}) raised {type(exc).__name__}: {exc}")
        finally:
            self.faults[b].disarm()
        self._applied(name)
        if fired:
            self._count_fault(f"after_{what}_{where}")
        elif where != "evict":  # an eviction listener fires only when tokens leave
            self._mismatch(f"a fault armed after the {what} ({where}) never fired")
        diff = same_state(snapshot(twin), snapshot(self.root), addresses=False)
        if diff:
            self._mismatch(f"after a fault after the {what} ({where}) in branch {b}, the state is not the applied "
                           f"change's (the twin's): {diff}")


def _branches_of(root: Any) -> list[KVCache]:
    return [root[n] for n in root.branches] if isinstance(root, CacheSet) else [root]


def _one_call(f: _Fuzz, r: float) -> None:
    c = f.caches[0]
    if r < 0.18:
        return f.rejected()  # the full state was compared: the storage is what it was
    elif r < 0.3:
        f.fault()
    elif not c.is_open:
        if r < 0.32:
            f.run(("reset", ()))
        elif r < 0.36:
            f.round_trip()
        else:
            f.run(f.begin_call())
    elif not f.written or r < 0.55:
        f.update()
    elif r < 0.6:
        f.round_trip()
    else:
        f.run(f.commit_call())
    f.check_storage()


def fuzz_layout(lay: Layout, rng: random.Random, res: FuzzResult, calls: int = 30) -> None:
    """One layout through ``calls`` random calls (see the module docstring)."""
    f = _Fuzz(lay, rng, res)
    res.layouts += 1
    res.kinds[lay.kind] = res.kinds.get(lay.kind, 0) + 1
    res.certified_layouts += lay.certified
    res.group_layouts += f.group
    for _ in range(calls):
        res.calls += 1
        try:
            _one_call(f, rng.random())
        except Exception as exc:  # noqa: BLE001 - a legal call that raises is a finding; the layout ends there
            f._mismatch(f"a legal call raised {type(exc).__name__}: {exc}")
            break
    try:
        f.finish()
    except Exception as exc:  # noqa: BLE001
        f._mismatch(f"the history check raised {type(exc).__name__}: {exc}")


def run_fuzz(layouts: int, *, seed: int = 0, calls: int = 30, progress=None, positions: int = 0) -> FuzzResult:
    """``layouts`` random layouts, each through ``calls`` random calls; see the module docstring.
    ``positions``: that many random position-map layouts too (raw keys rotated at read, every
    map of the registry; :mod:`streamkv_lab.fuzz_positions`), their mismatches counted in
    ``mismatches``."""
    rng = random.Random(seed)
    res = FuzzResult()
    t0 = time.perf_counter()
    for i in range(layouts):
        fuzz_layout(draw_layout(rng), rng, res, calls)
        if progress is not None:
            progress(i + 1)
    if positions:
        from streamkv_lab.fuzz_positions import fuzz_maps

        res.positions = fuzz_maps(positions, random.Random(seed + 1))
        res.mismatches += res.positions["mismatches"]
        res.failures += res.positions["failures"]
    res.seconds = time.perf_counter() - t0
    return res
