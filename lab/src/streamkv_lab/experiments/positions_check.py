"""Every position map x cache kind x read path against a float64 reference that keeps every
token and rotates its raw keys by the map.

Per :class:`MapLayout`: a cache of ``kind`` storing raw keys (:class:`~streamkv.rope_at_read.RopeAtRead`
with the layout's map) streams random float64 chunks (or LLM spans of 1..chunk tokens) through
filling, evictions and several wraps; after every write, :func:`~streamkv.attention.attend`
reads it (the cache's occupancy, or ``"mask"``; causal or not; a sliding window; grouped-query
attention) and, where the cache has one, the chronological path too. The reference keeps the raw
K/V of every position; per head it takes the positions the cache holds, the map's **host
reference** (:func:`~streamkv.positions.reference_rotation`, plain Python written apart from the
device function), rotates queries and keys with its own rotation (complex multiplication, at the
map's rotation units, no origin shift, no limbs) and runs plain float64 softmax attention with
the same masks. The comparison is the max absolute difference (float64).

:func:`ring_vs_chronological` checks the other half of the rule: the ring under
``cache_relative`` equals the chronological path's cache-relative RoPE (``ChronologicalCache``,
``rope_mode="cache_relative"``, keys gathered and rotated by their index).
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from streamkv.attention import attend
from streamkv.caches import CACHE_KINDS, KVCache
from streamkv.positions import POSITION_MAPS, PositionMap, position_map, reference_rotation
from streamkv.rope import Rope3D
from streamkv.rope_at_read import RopeAtRead, units_capacity
from streamkv.rotary import FrameRope, Rope1D, Rotary

__all__ = ["MapLayout", "default_map_layouts", "run_map_layout", "ring_vs_chronological", "wrong_map_is_caught"]

ROTARIES = ("rope1d-half", "rope1d-interleaved", "frame")


@dataclass(frozen=True)
class MapLayout:
    """One stream: a map (name + parameters), a cache kind, a rotary, the read path."""

    map: str
    kind: str
    rotary: str = "rope1d-half"
    params: tuple[tuple[str, Any], ...] = ()
    sink: int = 2  # tokens
    window: int = 8
    chunk: int = 2
    heads: int = 2
    groups: int = 1  # query heads per key head
    occupancy: str | None = None  # None: the cache's own; "mask"
    causal: bool = False
    window_mask: int | None = None
    spans: str = "chunks"  # or "tokens": LLM spans of 1..chunk tokens
    seq_dim: int = 1
    chunks: int = 10
    cut_at: int | None = None  # block_relative: set a RoPE cut from this chunk on
    seed: int = 0

    @property
    def name(self) -> str:
        extra = "".join(f"-{k}{v}" for k, v in self.params if k != "fn")
        return (f"{self.map}{extra}/{self.kind}/{self.rotary}/S{self.sink}W{self.window}C{self.chunk}"
                f"/{self.occupancy or 'auto'}{'/causal' if self.causal else ''}"
                f"{f'/win{self.window_mask}' if self.window_mask else ''}{f'/gqa{self.groups}' if self.groups > 1 else ''}"
                f"/{self.spans}{f'/cut@{self.cut_at}' if self.cut_at is not None else ''}")


def _rotary(name: str, head_dim: int) -> tuple[Rotary, int]:
    if name == "frame":
        return FrameRope(Rope3D(head_dim, 1, 2, max_frames=1 << 20, theta=100.0)), 2
    return Rope1D(head_dim, theta=100.0, style=name.removeprefix("rope1d-")), 1


def _map(lay: MapLayout, capacity_units: int, sink_units: int, chunk_units: int) -> PositionMap:
    params = dict(POSITION_MAPS[lay.map].for_geometry(sink_units, capacity_units, chunk_units))
    params.update(dict(lay.params))
    return position_map(lay.map, **params)


def default_map_layouts() -> list[MapLayout]:
    """Every map of the registry x every cache kind, the read-path options cycled over them,
    plus the dynamic variants (RoPE cut, anchor ``end``)."""
    out = []
    i = 0
    variants = [(m, ()) for m in POSITION_MAPS]
    variants += [("block_relative", (("anchor", "end"),)), ("block_relative", ())]
    for v, (m, params) in enumerate(variants):
        for kind in CACHE_KINDS:
            rot = ROTARIES[i % 3]
            chunk = 2 if rot == "frame" else (2, 3)[i % 2]
            tokens = rot != "frame" and kind != "chronological" and i % 3 == 1
            out.append(MapLayout(
                map=m, kind=kind, rotary=rot, params=params, sink=(2, 0, 4)[i % 3] if rot != "frame" else (2, 0)[i % 2],
                window=(8, 7, 9)[i % 3] if rot != "frame" else 8, chunk=chunk,
                groups=(1, 2)[i % 2], occupancy=(None, "mask")[(i // 2) % 2], causal=tokens or i % 4 == 3,
                window_mask=5 if (tokens and i % 2) else None, spans="tokens" if tokens else "chunks",
                seq_dim=(1, 2)[i % 2], cut_at=4 if (m == "block_relative" and v == len(variants) - 1) else None,
                seed=i))
            i += 1
    return out


# ---------------------------------------------------------------------------- the reference
def _ref_rotate(x: Tensor, angles: Tensor, style: str) -> Tensor:
    """``x [N, D]`` rotated by ``angles [N, D/2]``: complex multiplication (float64)."""
    if style == "interleaved":
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles)).flatten(-2)
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(angles), angles)
    return torch.cat([z.real, z.imag], dim=-1)


def _ref_angles(rot: Rotary, r: list[float], pos: list[int]) -> Tensor:
    """Angles at rotation units ``r`` for tokens at ``pos``: naive float64 products."""
    rr = torch.tensor(r, dtype=torch.float64).unsqueeze(-1)
    if isinstance(rot, FrameRope):
        p = torch.tensor(pos, dtype=torch.long) % rot.tokens_per_unit
        row, col = (p // rot.grid_w).double().unsqueeze(-1), (p % rot.grid_w).double().unsqueeze(-1)
        return torch.cat([rr * rot.time_freqs, row * rot.hw_freqs[0], col * rot.hw_freqs[1]], dim=-1)
    return rr * rot.freqs


def reference_output(rot: Rotary, pmap: PositionMap, history: dict[int, tuple[Tensor, Tensor]], held: list[list[int]],
                     q: Tensor, q_pos: list[int], sink_units: int, *, causal: bool, window: int | None,
                     groups: int) -> Tensor:
    """Float64 attention ``[Hq, Q, Dv]`` of raw queries ``q [Hq, Q, D]`` over the raw keys of the
    positions ``held[h]`` per key head (``history[p] = (k [H, D], v [H, Dv])``)."""
    tpu = rot.tokens_per_unit
    outs = []
    for hq in range(q.shape[0]):
        h = hq // groups
        keep = sorted(held[h])
        units = [p // tpu for p in keep]
        f = reference_rotation(pmap, units, q_pos[0] // tpu, sink_units)
        k = torch.stack([history[p][0][h] for p in keep]).double()
        v = torch.stack([history[p][1][h] for p in keep]).double()
        kr = _ref_rotate(k, _ref_angles(rot, [f(u) for u in units], keep), rot.style)
        qr = _ref_rotate(q[hq].double(), _ref_angles(rot, [f(p // tpu) for p in q_pos], q_pos), rot.style)
        s = (qr @ kr.T) / math.sqrt(q.shape[-1])
        kp, qp = torch.tensor(keep).view(1, -1), torch.tensor(q_pos).view(-1, 1)
        hide = torch.zeros_like(s, dtype=torch.bool)
        if causal:
            hide |= kp > qp
        if window is not None:
            hide |= kp <= qp - window
        outs.append(s.masked_fill(hide, -math.inf).softmax(-1) @ v)
    return torch.stack(outs)


# ---------------------------------------------------------------------------- one stream
@dataclass
class MapResult:
    layout: str
    comparisons: int = 0
    max_abs_diff: float = 0.0
    ragged_reads: int = 0  # reads where the heads held different positions


def run_map_layout(lay: MapLayout, *, pmap_override: PositionMap | None = None, reference_map: PositionMap | None = None,
                   rope_kwargs: dict | None = None) -> MapResult:
    """Stream ``lay`` and compare every read (see the module docstring). ``pmap_override``
    replaces the cache's map (a deliberately wrong one is caught against ``reference_map``)."""
    g = torch.Generator().manual_seed(lay.seed)
    rng = random.Random(lay.seed)
    D, Dv, H = 12, 5, lay.heads
    rot, tpu = _rotary(lay.rotary, D)
    cap = lay.sink + lay.window
    per_head = CACHE_KINDS[lay.kind].kind not in ("ring", "chronological")
    sink_units, chunk_units = lay.sink // tpu, max(lay.chunk // tpu, 1)
    pmap = pmap_override or _map(lay, units_capacity(cap, per_head, tpu), sink_units, chunk_units)
    ref_map = reference_map or pmap
    rope = RopeAtRead(rot, pmap, **(rope_kwargs or {}))
    k_shape = (1, cap, H, D) if lay.seq_dim == 1 else (1, H, cap, D)
    v_shape = k_shape[:-1] + (Dv,)
    kw = {"budget": cap - lay.chunk} if lay.kind in ("h2o", "tova") else {"tau": 0.3} if lay.kind == "mass" else {}
    cache = CACHE_KINDS[lay.kind](k_shape, v_shape, seq_dim=lay.seq_dim, sink=lay.sink, window=lay.window,
                                  chunk=lay.chunk, dtype=torch.float64, rope_at_read=rope, **kw)
    res = MapResult(lay.name)
    history: dict[int, tuple[Tensor, Tensor]] = {}
    end = 0
    for step in range(lay.chunks * (2 if lay.spans == "tokens" else 1)):
        n = rng.randint(1, lay.chunk) if lay.spans == "tokens" else lay.chunk
        if lay.spans == "tokens":
            cache.begin_tokens(n)
        else:
            cache.begin_chunk(step)
        if lay.cut_at is not None and step == lay.cut_at:
            pmap.set(cut=45)
        shape = [1, H, D]
        shape.insert(lay.seq_dim, n)
        k = torch.randn(shape, generator=g, dtype=torch.float64)
        vs = list(shape)
        vs[-1] = Dv
        v = torch.randn(vs, generator=g, dtype=torch.float64)
        qs = list(shape)
        qs[2 if lay.seq_dim == 1 else 1] = H * lay.groups
        q = torch.randn(qs, generator=g, dtype=torch.float64)
        read = cache.layer(0).update(k, v, q, occupancy=lay.occupancy)
        for i in range(n):
            history[end + i] = (k.select(lay.seq_dim, i)[0], v.select(lay.seq_dim, i)[0])
        q_pos = list(range(end, end + n))
        held = [[p for p in row if p >= 0] for row in cache.layer_slot_positions(0).tolist()]
        res.ragged_reads += len({tuple(sorted(h)) for h in held}) > 1
        qh = q.movedim(lay.seq_dim, 2)[0]  # [Hq, n, D]
        want = reference_output(rot, ref_map, history, held, qh, q_pos, sink_units,
                                causal=lay.causal or lay.window_mask is not None, window=lay.window_mask,
                                groups=lay.groups)
        orders = ["physical"] + (["chronological"] if read.chronological is not None else [])
        for order in orders:
            out, _ = attend(q, read, order=order, causal=lay.causal or lay.window_mask is not None,
                            window=lay.window_mask)
            got = out.movedim(lay.seq_dim, 2)[0]
            res.comparisons += 1
            res.max_abs_diff = max(res.max_abs_diff, float((got - want).abs().max()))
        if lay.spans == "tokens":
            cache.commit()
        else:
            cache.commit_chunk(step)
        end += n
    return res


def wrong_map_is_caught(seed: int = 0) -> float:
    """A deliberately wrong map (``cache_relative`` off by one unit for the current chunk),
    checked against the ``cache_relative`` reference: the max difference (must be large)."""
    def wrong(inp, units):
        return inp.rank(units) + (units >= inp.span_start).long()

    lay = MapLayout(map="cache_relative", kind="ring", seed=seed)
    res = run_map_layout(lay, pmap_override=position_map("custom", fn=wrong),
                         reference_map=position_map("cache_relative"))
    return res.max_abs_diff


def ring_vs_chronological(*, sink: int = 2, window: int = 7, chunk: int = 3, chunks: int = 9, seed: int = 0) -> dict:
    """The ring under ``cache_relative`` (raw keys, rotated at read in physical order) against
    the chronological path's cache-relative RoPE (``rope_mode="cache_relative"``): max |diff|."""
    g = torch.Generator().manual_seed(seed)
    D, H = 8, 2
    rot = Rope1D(D, theta=100.0, style="interleaved")
    cap = sink + window
    ring = CACHE_KINDS["ring"]((1, cap, H, D), (1, cap, H, D), seq_dim=1, sink=sink, window=window, chunk=chunk,
                               dtype=torch.float64, rope_at_read=RopeAtRead(rot, "cache_relative"))
    chrono = CACHE_KINDS["chronological"]((1, cap, H, D), (1, cap, H, D), seq_dim=1, sink=sink, window=window,
                                          chunk=chunk, dtype=torch.float64)
    table = rot.angles(torch.arange(cap), torch.arange(cap))
    cos, sin = table.cos(), table.sin()
    diff, comps = 0.0, 0
    for c in range(chunks):
        q, k, v = (torch.randn(1, chunk, H, D, generator=g, dtype=torch.float64) for _ in range(3))
        ring.begin_chunk(c)
        chrono.begin_chunk(c)
        a, _ = attend(q, ring.layer(0).update(k, v), order="physical")
        read = chrono.layer(0).update(k, v)
        n = read.num_retained
        qr = rot.rotate(q, cos[n - chunk : n].unsqueeze(1), sin[n - chunk : n].unsqueeze(1))
        b, _ = attend(qr, read, rope_mode="cache_relative",
                      key_transform=lambda kc, n=n: rot.rotate(kc, cos[:n], sin[:n]))
        diff, comps = max(diff, float((a - b).abs().max())), comps + 1
        ring.commit_chunk(c)
        chrono.commit_chunk(c)
    return {"comparisons": comps, "max_abs_diff": diff}



def compiled_recompiles(*, chunks: int = 14, seed: int = 0) -> dict:
    """One ``torch.compile``'d read step (write + map evaluation + rotation + attention) of a
    ring holding raw keys, through filling, wraps, every switch between the registry's maps
    and a RoPE cut switched on and off: ``{"frames": compiled frames, "recompiles": frames - 1,
    "max_abs_diff": compiled vs eager}``. The dynamo trace is counted with a
    ``CompileCounter`` backend (what ``tests/test_rollout.py`` counts)."""
    import torch._dynamo.testing

    g = torch.Generator().manual_seed(seed)
    D, H, sink, window, chunk = 8, 2, 2, 7, 3
    names = list(POSITION_MAPS)

    def build() -> tuple[KVCache, RopeAtRead]:
        rope = RopeAtRead(Rope1D(D, theta=100.0), [_map(MapLayout(map=m, kind="ring"), sink + window, sink, chunk)
                                                  for m in names])
        return CACHE_KINDS["ring"]((1, sink + window, H, D), (1, sink + window, H, D), seq_dim=1, sink=sink,
                                   window=window, chunk=chunk, dtype=torch.float64, rope_at_read=rope), rope

    (cache, rope), (eager, eager_rope) = build(), build()
    counter = torch._dynamo.testing.CompileCounter()
    torch._dynamo.reset()

    def step(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attend(q, cache.layer(0).update(k, v, occupancy="mask"), causal=True)[0]

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    diff, frames = 0.0, []
    for c in range(chunks):
        sel = c % len(names)
        for r in (rope, eager_rope):
            r.use(sel)
            r.map("block_relative").set(cut=45 if c % 4 == 3 else -1)
        cache.begin_chunk(c)
        eager.begin_chunk(c)
        q, k, v = (torch.randn(1, chunk, H, D, generator=g, dtype=torch.float64) for _ in range(3))
        got = compiled(q, k, v)
        want, _ = attend(q, eager.layer(0).update(k, v, occupancy="mask"), causal=True)
        diff = max(diff, float((got - want).abs().max()))
        frames.append(counter.frame_count)
        cache.commit_chunk(c)
        eager.commit_chunk(c)
    torch._dynamo.reset()
    return {"frames": frames[-1], "recompiles": frames[-1] - frames[0], "frames_per_step": frames,
            "maps_switched": names, "max_abs_diff": diff, "wraps": (chunks * chunk - sink) // window}


def large_positions(shift: int = 1 << 40, seed: int = 0) -> dict:
    """Reads 2**40 tokens into a stream: every non-sink position of a ring read moved ``shift``
    on. Bounded maps: the output must be bit-identical to the read at small positions.
    ``absolute``: the output against float64 attention with angles from exact rational
    arithmetic (``p f mod 2 pi``), and what float64 RoPE at write (``p * f`` rounded) gives."""
    from fractions import Fraction

    from streamkv.rotary import _PI

    def stream(name: str):
        torch.manual_seed(seed)
        rot = Rope1D(8, theta=100.0)
        rope = RopeAtRead(rot, position_map(name, **POSITION_MAPS[name].for_geometry(2, 10, 3)))
        c = CACHE_KINDS["ring"]((1, 10, 2, 8), (1, 10, 2, 8), seq_dim=1, sink=2, window=8, chunk=3,
                                dtype=torch.float64, rope_at_read=rope)
        for i in range(5):
            c.begin_chunk(i)
            q, k, v = (torch.randn(1, 3, 2, 8, dtype=torch.float64) for _ in range(3))
            read = c.layer(0).update(k, v)
            if i < 4:
                c.commit_chunk(i)
        far = dataclasses.replace(read, positions=torch.where(read.positions >= 2, read.positions + shift,
                                                              read.positions),
                                  query_positions=read.query_positions + shift)
        return read, far, q, rot

    out: dict[str, Any] = {"shift": shift, "bounded": {}}
    for name, mk in POSITION_MAPS.items():
        if mk.bounded:
            read, far, q, _ = stream(name)
            out["bounded"][name] = float((attend(q, read)[0] - attend(q, far)[0]).abs().max())
    read, far, q, rot = stream("absolute")
    got, _ = attend(q, far)
    two_pi = 2 * _PI
    freqs = rot.freqs

    def exact(x: Tensor, positions: list[int]) -> Tensor:
        ang = torch.tensor([[float((Fraction(p) * Fraction(f)) % two_pi) for f in freqs.tolist()] for p in positions],
                           dtype=torch.float64)
        return rot.rotate(x, ang.cos(), ang.sin())

    def naive(x: Tensor, positions: list[int]) -> Tensor:
        ang = torch.tensor(positions, dtype=torch.float64).unsqueeze(-1) * freqs
        return rot.rotate(x, ang.cos(), ang.sin())

    pos, qpos = far.positions[0].tolist(), far.query_positions.tolist()
    for label, rotate in (("absolute_vs_exact_angles", exact), ("float64_rope_at_write_vs_exact", None)):
        worst = 0.0
        for h in range(2):
            k, v = read.stored()[0][0, :, h], read.stored()[1][0, :, h]
            want = ((exact(q[0, :, h], qpos) @ exact(k, pos).T) / math.sqrt(8)).softmax(-1) @ v
            if rotate is None:  # keys and queries rotated at write with naive float64 angles
                mine = ((naive(q[0, :, h], qpos) @ naive(k, pos).T) / math.sqrt(8)).softmax(-1) @ v
            else:
                mine = got[0, :, h]
            worst = max(worst, float((mine - want).abs().max()))
        out[label] = worst
    return out
