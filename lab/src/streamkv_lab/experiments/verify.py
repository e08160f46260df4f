"""The proposal's storage experiment, reproduced and widened.

For every layout of a grid, drive the current path (:class:`ChronologicalCache`) and
the ring (:class:`RingCache`) through the same random stream — filling, repeated
writes of the open chunk, reopened chunks, the first eviction, several wraps and a
reset — next to the whole-history :class:`~streamkv.reference.ReferenceCache`. After
every write:

- the cache's chronological view must equal the reference's, element for element;
- dense attention over the cache's buffer *in physical order* must equal attention
  over the reference's chronological view, to rounding.

The grid covers sinks of 0, part of a chunk, whole chunks and more; windows that are
and are not multiples of the chunk; chunk sizes 2, 3, 4; and two layouts of the
token dimension (``seq_dim=1`` in ``[B, T, H, D]`` and ``seq_dim=-3`` in
``[X, B, T, H, D]``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from streamkv.caches import ChronologicalCache, KVCache, RingCache
from streamkv.reference import ReferenceCache, reference_attention

__all__ = ["GridLayout", "default_layouts", "stream_ops", "run_layout", "run_verify", "VerifyResult"]


@dataclass(frozen=True)
class GridLayout:
    """One cell of the grid: sizes in tokens and the tensor layout."""

    sink: int
    window: int
    chunk: int
    seq_dim: int  # 1 -> [B, T, H, D]; -3 -> [X, B, T, H, D]
    heads: int = 2
    k_dim: int = 4
    v_dim: int = 3

    def shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        cap = self.sink + self.window
        if self.seq_dim == 1:
            lead: tuple[int, ...] = (2, cap, self.heads)
        elif self.seq_dim == -3:
            lead = (2, 1, cap, self.heads)
        else:
            raise ValueError(f"grid seq_dim must be 1 or -3, got {self.seq_dim}")
        return lead + (self.k_dim,), lead + (self.v_dim,)

    @property
    def name(self) -> str:
        return f"S{self.sink}-W{self.window}-C{self.chunk}-d{self.seq_dim}"


def default_layouts() -> list[GridLayout]:
    """48 size combinations x 2 token-dimension layouts = 96 layouts."""
    out = []
    for seq_dim in (1, -3):
        for c in (2, 3, 4):
            for s in (0, 1, c, c + 1):  # none, part of a chunk, a whole chunk, straddling
                for w in (c, 2 * c, 2 * c + 1, 3 * c + 1):  # multiples and non-multiples
                    out.append(GridLayout(sink=s, window=w, chunk=c, seq_dim=seq_dim))
    return out


def stream_ops(g: GridLayout, rng: random.Random, wraps: int = 2) -> Iterator[tuple[str, int]]:
    """A random legal call sequence: two streams (reset between them), each filling
    the cache and wrapping the ring ``wraps`` times past the first eviction, with
    1-3 writes per chunk and reopened chunks."""
    n_chunks = -(-(g.sink + (wraps + 1) * g.window) // g.chunk) + 1
    for stream in range(2):
        length = n_chunks if stream == 0 else max(2, n_chunks - rng.randrange(3))
        for c in range(length):
            yield "begin", c
            for _ in range(rng.randint(1, 3)):
                yield "write", c
            yield "commit", c
            if rng.random() < 0.25:  # reopen the committed chunk and rewrite it
                yield "begin", c
                yield "write", c
                yield "commit", c
        yield "reset", -1


@dataclass
class LayoutResult:
    layout: str
    comparisons: int = 0
    identical: dict[str, int] = field(default_factory=dict)
    max_attention_diff: dict[str, float] = field(default_factory=dict)


def physical_attention(q: Tensor, cache: KVCache) -> Tensor:
    """SDPA over the cache's occupied slots as they lie in memory (no gather)."""
    seq = cache.seq_dim
    k = cache.keys().narrow(seq, 0, cache.num_valid).movedim(seq, -2)
    v = cache.values().narrow(seq, 0, cache.num_valid).movedim(seq, -2)
    return F.scaled_dot_product_attention(q, k, v)


def run_layout(g: GridLayout, *, dtype: torch.dtype, seed: int) -> LayoutResult:
    """Drive both caches and the reference through one random stream; compare after every write."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    k_shape, v_shape = g.shapes()
    kw = dict(seq_dim=g.seq_dim, sink=g.sink, window=g.window, chunk=g.chunk, dtype=dtype)
    caches: dict[str, KVCache] = {
        "chronological": ChronologicalCache(k_shape, v_shape, **kw),
        "ring": RingCache(k_shape, v_shape, **kw),
    }
    ref = ReferenceCache(sink=g.sink, window=g.window, chunk=g.chunk, seq_dim=g.seq_dim)
    seq = caches["ring"].seq_dim
    chunk_k = k_shape[:seq] + (g.chunk,) + k_shape[seq + 1 :]
    chunk_v = v_shape[:seq] + (g.chunk,) + v_shape[seq + 1 :]
    res = LayoutResult(g.name, identical={n: 0 for n in caches}, max_attention_diff={n: 0.0 for n in caches})

    for op, c in stream_ops(g, rng):
        if op == "reset":
            for cache in caches.values():
                cache.reset()
            ref.reset()
            continue
        if op in ("begin", "commit"):
            for cache in caches.values():
                getattr(cache, f"{op}_chunk")(c)
            getattr(ref, f"{op}_chunk")(c)
            continue
        k = torch.randn(chunk_k, generator=gen, dtype=torch.float64).to(dtype)
        v = torch.randn(chunk_v, generator=gen, dtype=torch.float64).to(dtype)
        for cache in caches.values():
            cache.write(k, v)
        ref.write(k, v)
        ref_k, ref_v = ref.chronological_keys(), ref.chronological_values()
        q = torch.randn(k.movedim(seq, -2).shape, generator=gen, dtype=torch.float64).to(dtype)
        expected = reference_attention(q, ref_k.movedim(seq, -2), ref_v.movedim(seq, -2))
        scale = expected.abs().max().item()
        res.comparisons += 1
        for name, cache in caches.items():
            same = torch.equal(cache.chronological_keys(), ref_k) and torch.equal(
                cache.chronological_values(), ref_v
            )
            res.identical[name] += int(same)
            diff = (physical_attention(q, cache).double() - expected).abs().max().item()
            rel = diff if dtype == torch.float64 else diff / max(scale, 1e-30)
            res.max_attention_diff[name] = max(res.max_attention_diff[name], rel)
    return res


@dataclass
class VerifyResult:
    dtype: str
    layouts: int
    comparisons: int
    identical: dict[str, int]
    max_attention_diff: dict[str, float]
    attention_diff_kind: str
    per_layout: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def run_verify(
    layouts: list[GridLayout] | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    progress: Callable[[GridLayout], None] | None = None,
) -> VerifyResult:
    """Run the grid; ``identical[name] == comparisons`` means every view matched exactly."""
    layouts = default_layouts() if layouts is None else layouts
    total = 0
    identical: dict[str, int] = {"chronological": 0, "ring": 0}
    max_diff: dict[str, float] = {"chronological": 0.0, "ring": 0.0}
    per_layout = []
    for i, g in enumerate(layouts):
        r = run_layout(g, dtype=dtype, seed=seed * 1_000_003 + i)
        total += r.comparisons
        for n in identical:
            identical[n] += r.identical[n]
            max_diff[n] = max(max_diff[n], r.max_attention_diff[n])
        per_layout.append(asdict(r))
        if progress is not None:
            progress(g)
    kind = "max abs" if dtype == torch.float64 else "max abs / max |output|"
    return VerifyResult(str(dtype).removeprefix("torch."), len(layouts), total, identical, max_diff, kind, per_layout)
