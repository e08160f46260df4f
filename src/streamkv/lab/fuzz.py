"""A differential fuzzer over every cache kind: random layouts, random call sequences with
rejected calls mixed in, the full state snapshotted around every rejection, every read compared
with a whole-history float64 reference, state dicts round-tripped through ``torch.save`` /
``torch.load(weights_only=True)``.

Per layout (drawn from a seeded ``random.Random``): a kind (ring, chronological, mass, h2o,
tova, and ring / mass watched by a certifier with recall slots), a rank 3-5 shape with the token
and head dims anywhere, sink / window / chunk sizes (aligned or not), a dtype (bf16, fp16, fp32,
fp64), 1-2 layers. Inputs come in random memory layouts: contiguous, transposed, strided
(every other element of a larger tensor), offset (a slice of a larger tensor) or expanded
(stride 0 along a dim of size 1 broadcast). Then a random sequence of calls:

- legal ones: ``begin_chunk`` (advance or reopen), ``begin_tokens(n)``, ``update(k, v, q)`` and
  ``attend`` (causal or not), ``commit``, ``reset``, a state-dict round trip into a fresh cache;
- rejected ones: wrong shape / rank / dtype / device, sparse, requiring grad, overlapping the
  cache's own buffer, a bad layer, lifecycle misuse, tampered state dicts (positions from the
  future, a non-int counter, a span longer than a chunk, aliasing the live buffers).

Counted: ``calls``; ``rejected_calls`` (each must raise TypeError/ValueError/RuntimeError);
``state_changes_after_rejection`` (the full snapshot differed after a rejected call);
``bad_calls_accepted`` (a call that should have been refused went through); ``mismatches`` (a held
slot whose K/V differ from the history, a window cache not holding ``[sinks | last window]``,
an attention output off the float64 reference beyond the dtype's rounding, a round-tripped
state that differs). The target is zero of the last three.
"""

from __future__ import annotations

import io
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from streamkv.attention import attend
from streamkv.caches import KVCache
from streamkv.certify import Certifier
from streamkv.lab.snapshot import same_state, snapshot

__all__ = ["FuzzResult", "Layout", "draw_layout", "fuzz_layout", "run_fuzz"]

KINDS = ("ring", "chronological", "mass", "h2o", "tova", "certified-ring", "certified-mass")
DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: attention of the cache (kernel in its dtype) vs float64 over the same stored values: relative to the output scale
TOL = {"float64": 1e-10, "float32": 2e-5, "float16": 2e-2, "bfloat16": 5e-2}
ERRORS = (TypeError, ValueError, RuntimeError)


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


@dataclass
class FuzzResult:
    layouts: int = 0
    calls: int = 0
    rejected_calls: int = 0
    state_changes_after_rejection: int = 0
    bad_calls_accepted: int = 0
    mismatches: int = 0
    seconds: float = 0.0
    kinds: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # the first few, for a human
    positions: dict[str, Any] = field(default_factory=dict)  # the position-map hook (lab/fuzz_positions.py)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def draw_layout(rng: random.Random) -> Layout:
    kind = rng.choice(KINDS)
    certified = kind.startswith("certified-")
    scored = kind.removeprefix("certified-") in ("mass", "h2o", "tova")
    chunk = rng.randint(1, 4)
    sink = rng.randint(0, 5)
    window = (2 * chunk if scored else chunk) + rng.randint(0, 6)
    cap = sink + window
    if certified:
        rank, seq, head = 4, 1, 2
    else:
        rank = rng.randint(3, 5)
        seq = rng.randrange(rank - 1)
        others = [d for d in range(rank - 1) if d != seq]
        head = rng.choice(others + [None])
    sizes = [rng.randint(1, 3) for _ in range(rank - 1)] + [2 * rng.randint(1, 3)]
    sizes[seq] = cap
    if head is not None:
        sizes[head] = rng.randint(1, 3)
    return Layout(kind, tuple(sizes), 2 * rng.randint(1, 3), seq, head, sink, window, chunk, rng.randint(1, 2),
                  rng.choice(list(DTYPES)))


class _Fuzz:
    """One layout's run; counts go to ``res``."""

    def __init__(self, lay: Layout, rng: random.Random, res: FuzzResult) -> None:
        self.lay, self.rng, self.res = lay, rng, res
        self.dtype = DTYPES[lay.dtype]
        self.gen = torch.Generator().manual_seed(rng.randrange(2**31))
        self.cache = self._build()
        self.hist: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(lay.layers)]

    def _build(self) -> KVCache:
        lay = self.lay
        policy = lay.kind.removeprefix("certified-")
        v_shape = lay.shape[:-1] + (lay.value_dim,)
        params = {"tau": 0.25} if policy == "mass" else {}
        certified = lay.kind.startswith("certified-")
        cache = KVCache(lay.shape, v_shape, policy=policy, seq_dim=lay.seq_dim, head_dim=lay.head_dim, sink=lay.sink,
                        window=lay.window, chunk=lay.chunk, num_layers=lay.layers, dtype=self.dtype,
                        recall_slots=4 if certified else 0, **params)
        if certified:
            Certifier(cache, recall_tau=0.2)
        return cache

    # ----------------------------------------------------------------- inputs
    def _rows(self, last: int, n: int) -> torch.Tensor:
        """Random rows of the open span in a random memory layout."""
        shape = list(self.lay.shape[:-1]) + [last]
        shape[self.lay.seq_dim] = n
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
    def begin(self) -> None:
        c, C = self.cache, self.lay.chunk
        if c.end % C == 0 and (self.rng.random() < 0.6 or c.end == 0):
            if c.last_span is not None and c.last_span[1] == C and self.rng.random() < 0.2:
                c.begin_chunk(c.next_chunk - 1)
            else:
                c.begin_chunk(c.next_chunk)
        else:
            c.begin_tokens(self.rng.randint(1, C))

    def update(self) -> None:
        c = self.cache
        start, n = c.open_span
        for layer in range(self.lay.layers):
            k = self._rows(self.lay.shape[-1], n)
            v = self._rows(self.lay.value_dim, n)
            q = self._rows(self.lay.shape[-1], n)
            read = c.layer(layer).update(k, v, q)
            for i in range(n):
                self.hist[layer][start + i] = (k.select(self.lay.seq_dim, i).clone(), v.select(self.lay.seq_dim, i).clone())
            causal = self.rng.random() < 0.5
            out, _ = attend(q, read, causal=causal)
            self._check_attention(layer, q, out, causal)

    def commit(self) -> None:
        c = self.cache
        c.commit_chunk(c.open_chunk) if c.open_chunk is not None else c.commit()

    def reset(self) -> None:
        self.cache.reset()
        self.hist = [{} for _ in range(self.lay.layers)]

    def round_trip(self) -> None:
        """Save through ``torch.save``, load with ``weights_only=True`` into a fresh cache, compare
        the two state dicts, then continue the stream on the restored cache (every later check
        runs against it)."""
        if self.cache.storage.recall_slots:
            return
        buf = io.BytesIO()
        torch.save(self.cache.state_dict(), buf)
        state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        fresh = self._build()
        try:
            fresh.load_state_dict(state)
        except ERRORS as exc:
            return self._mismatch(f"a cache refused its own state dict: {exc}")
        a, b = fresh.state_dict(), self.cache.state_dict()
        for key in b:
            same = torch.equal(a[key], b[key]) if isinstance(b[key], torch.Tensor) else a[key] == b[key]
            if not same:
                return self._mismatch(f"state dict round trip: {key} differs")
        self.cache = fresh

    # ---------------------------------------------------------------- checks
    def _mismatch(self, what: str) -> None:
        self.res.mismatches += 1
        if len(self.res.failures) < 20:
            self.res.failures.append(f"{self.lay}: {what}")

    def _head_rows(self, t: torch.Tensor, head: int) -> torch.Tensor:
        st = self.cache.storage
        x = t.movedim(st.seq_dim, -2)
        return x.select(st.head_axis, head) if st.head_axis is not None else x

    def check_storage(self) -> None:
        c = self.cache
        if c.is_open and not all(p in self.hist[0] for p in range(*[c.open_span[0], c.end])):
            return  # the open span is not written yet
        for layer in range(self.lay.layers):
            pos = c.layer_slot_positions(layer)
            for h in range(pos.shape[0]):
                held = {int(p): s for s, p in enumerate(pos[h].tolist()) if p >= 0}
                kh, vh = self._head_rows(c.keys(layer), h), self._head_rows(c.values(layer), h)
                for p, s in held.items():
                    hk, hv = self.hist[layer][p]
                    want_k = self._head_rows(hk.unsqueeze(self.lay.seq_dim), h).squeeze(-2)
                    want_v = self._head_rows(hv.unsqueeze(self.lay.seq_dim), h).squeeze(-2)
                    if not (torch.equal(kh.select(-2, s), want_k) and torch.equal(vh.select(-2, s), want_v)):
                        return self._mismatch(f"layer {layer} head {h} slot {s} does not hold position {p}'s K/V")
            if c.retains_window:
                got = sorted(p for p in pos[0, : c.layout.capacity].tolist() if p >= 0)
                if got != c.layout.retained_positions(c.end):
                    return self._mismatch(f"window cache holds {got}, not [sinks | last window]")

    def _check_attention(self, layer: int, q: torch.Tensor, out: torch.Tensor, causal: bool) -> None:
        c = self.cache
        qpos = torch.arange(c.open_span[0], c.end)
        pos = c.layer_slot_positions(layer)
        worst, scale = 0.0, 0.0
        for h in range(pos.shape[0]):
            held = sorted(p for p in pos[h].tolist() if p >= 0)
            hist = [self.hist[layer][p] for p in held]
            k = torch.stack([self._head_rows(x[0].unsqueeze(self.lay.seq_dim), h).squeeze(-2) for x in hist], -2)
            v = torch.stack([self._head_rows(x[1].unsqueeze(self.lay.seq_dim), h).squeeze(-2) for x in hist], -2)
            qh = self._head_rows(q, h).double()
            s = qh @ k.double().transpose(-1, -2) / k.shape[-1] ** 0.5
            if causal:
                s = s.masked_fill(torch.tensor(held).view(1, -1) > qpos.view(-1, 1), float("-inf"))
            want = s.softmax(-1) @ v.double()
            worst = max(worst, float((self._head_rows(out, h).double() - want).abs().max()))
            scale = max(scale, float(want.abs().max()))
        if worst > TOL[self.lay.dtype] * max(scale, 1.0):
            self._mismatch(f"attention off the float64 reference by {worst:.3g} (scale {scale:.3g})")

    # ----------------------------------------------------------- rejections
    def rejected(self) -> None:
        """One call that must be refused, with the full state compared around it."""
        c, lay = self.cache, self.lay
        n = c.open_span[1] if c.is_open else lay.chunk
        k, v = self._rows(lay.shape[-1], n), self._rows(lay.value_dim, n)
        wrong = {torch.float64: torch.float32}.get(self.dtype, torch.float64)
        options = [
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
            lambda: self._tampered_load(),
        ]
        if not c.is_open:
            options.append(lambda: c.write(k, v, 0))
        call = self.rng.choice(options)
        before = snapshot(c)
        self.res.rejected_calls += 1
        try:
            call()
        except ERRORS:
            diff = same_state(before, snapshot(c))
            if diff:
                self.res.state_changes_after_rejection += 1
                if len(self.res.failures) < 20:
                    self.res.failures.append(f"{lay}: state changed after a rejected call: {diff}")
            return
        except Exception as exc:  # noqa: BLE001 - an undocumented exception type is a finding
            self._mismatch(f"rejected with {type(exc).__name__}: {exc}")
            return
        self.res.bad_calls_accepted += 1
        if len(self.res.failures) < 20:
            self.res.failures.append(f"{lay}: a call that must be refused went through")

    def _tampered_load(self) -> None:
        c = self.cache
        if c.storage.recall_slots:
            raise RuntimeError("recall slots: state dicts refused")  # the real refusal is tested elsewhere
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
        c.load_state_dict(state)


def fuzz_layout(lay: Layout, rng: random.Random, res: FuzzResult, calls: int = 30) -> None:
    """One layout through ``calls`` random calls (see the module docstring)."""
    f = _Fuzz(lay, rng, res)
    res.layouts += 1
    res.kinds[lay.kind] = res.kinds.get(lay.kind, 0) + 1
    written = True
    for _ in range(calls):
        res.calls += 1
        r = rng.random()
        c = f.cache
        if r < 0.2:
            f.rejected()
        elif not c.is_open:
            if r < 0.25:
                f.reset()
            elif r < 0.3:
                f.round_trip()
            else:
                f.begin()
                written = False
        elif not written or r < 0.6:
            f.update()
            written = True
        elif r < 0.65:
            f.round_trip()
        else:
            f.commit()
        f.check_storage()


def run_fuzz(layouts: int, *, seed: int = 0, calls: int = 30, progress=None, positions: int = 0) -> FuzzResult:
    """``layouts`` random layouts, each through ``calls`` random calls; see the module docstring.
    ``positions``: that many random position-map layouts too (raw keys rotated at read, every
    map of the registry; :mod:`streamkv.lab.fuzz_positions`), their mismatches counted in
    ``mismatches``."""
    rng = random.Random(seed)
    res = FuzzResult()
    t0 = time.perf_counter()
    for i in range(layouts):
        fuzz_layout(draw_layout(rng), rng, res, calls)
        if progress is not None:
            progress(i + 1)
    if positions:
        from streamkv.lab.fuzz_positions import fuzz_maps

        res.positions = fuzz_maps(positions, random.Random(seed + 1))
        res.mismatches += res.positions["mismatches"]
        res.failures += res.positions["failures"]
    res.seconds = time.perf_counter() - t0
    return res
