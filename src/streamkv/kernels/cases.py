"""The checked cases of the Triton read, and the float64 reference they are checked against: one
registry (:data:`CASES`) that the CPU tests run under Triton's interpreter
(``tests/test_triton_read.py``) and ``scripts/gpu_check.py`` runs natively on a GPU.

A case builds queries and a :class:`~streamkv.blockread.BlockPlan` on a device at a size
(:data:`SIZES`: ``"tiny"`` for the interpreter -- 16 features, tens of rows; ``"medium"`` for a
GPU -- 128 features, thousands of rows, the kernel's own tiles). :func:`reference` is attention
by its definition in float64 over the values the segments store (through the page table,
decoded, out of the storage basis, rotated at read by float64 angles), with first-order error
bounds per output element for the queries' dtype; :func:`compare` measures a result against it
(and against :func:`~streamkv.blockread.read_blocks`).

Families (every format of :data:`~streamkv.stores.KV_FORMATS`, every map of
:data:`~streamkv.positions.POSITION_MAPS`): codes beside dense rows (bases, groups, slot maps
with holes, causal windows, statistics of the newest rows, split keys); dense rows in every
dtype at prefill and decode shapes; RoPE at read through a ring cache (Rope1D half and
interleaved, FrameRope; dense and quantised); rotation offsets far into a stream (every limb)
and fractional ones; page tables; rows outside the cache's slots (a tier) beside its slots, and a
query row that sees the tier's rows only;
other layouts; decoding split over programs; hidden rows holding NaN; a row that sees nothing;
a scored quantised cache's own plan.

Why one module: the registry, the float64 reference and the comparison are one test oracle that
two callers (the interpreter tests and the GPU script) import whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from ..blockread import BlockPlan, Statistic, newest_slots, read_blocks
from ..positions import POSITION_MAPS, position_map
from ..rope import Rope3D
from ..rope_at_read import RopeAtRead
from ..rotary import FrameRope, Rope1D, Rotary
from ..stores import KV_FORMATS, Dims, KVQuant, Segment, hadamard
from .triton_read import KernelConfig

__all__ = ["CASES", "Case", "SIZES", "Size", "compare", "reference"]


@dataclass(frozen=True)
class Size:
    """``batch``, key ``heads``, ``features``; ``rows``: key rows per tiny row; ``queries``: query
    rows per tiny query row (decoding stays one query)."""

    batch: int
    heads: int
    features: int
    rows: int
    queries: int


SIZES = {"tiny": Size(2, 2, 16, 1, 1), "medium": Size(1, 2, 128, 48, 24)}


@dataclass
class Case:
    """Queries, the plan, the kernel's tiles, and whether ``read_blocks`` serves the same plan
    alike (not where rows it multiplies by 0 hold NaN)."""

    q: Tensor
    plan: BlockPlan
    config: KernelConfig | None = None
    against_reference: bool = True


# ------------------------------------------------------------------------------------------ building reads
def signed_permutation(n: int, g: torch.Generator) -> Tensor:
    """An orthogonal float64 ``[n, n]`` basis exact in every float type."""
    r = torch.zeros(n, n, dtype=torch.float64)
    r[torch.arange(n), torch.randperm(n, generator=g)] = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    return r


def segment(k: Tensor, v: Tensor, pos: Tensor, dtype: torch.dtype, *, fmt: str | None = None, vfmt: str | None = None,
            group: int = 8, basis: tuple[Tensor, Tensor] | None = None, slots: Any = 0, page: int = 0,
            g: torch.Generator | None = None) -> Segment:
    """Rows ``k``/``v`` (float64, attention layout ``[..., n, W]``) as a segment: dense rows in
    ``dtype``, or codes of ``fmt`` (keys) / ``vfmt`` (values, default ``fmt``) in the storage basis
    ``basis = (Rk, Rv)``; with ``page`` the rows lie in shuffled physical pages (one spare page of
    NaN never referenced)."""
    n = k.shape[-2]
    kk, vv, ks, vs = k.to(dtype), v.to(dtype), None, None
    kc = vc = kb = vb = None
    if fmt is not None:
        kc, vc = KV_FORMATS[fmt], KV_FORMATS[vfmt or fmt]
        if basis is not None:
            kb, vb = (b.to(device=k.device, dtype=torch.float32) for b in basis)
        kk, ks = kc.encode(k.float() if kb is None else k.float() @ kb.T, group)
        vv, vs = vc.encode(v.float() if vb is None else v.float() @ vb.T, group)
    pages = None
    if page:
        count = -(-n // page)
        perm = torch.randperm(count + 1, generator=g)[:count]  # logical page -> physical page

        def paged(x: Tensor | None) -> Tensor | None:
            if x is None:
                return None
            fill = float("nan") if x.dtype.is_floating_point else 0
            buf = torch.full((*x.shape[:-2], (count + 1) * page, x.shape[-1]), fill, dtype=x.dtype, device=x.device)
            for lp in range(count):
                rows = x[..., lp * page:min(n, (lp + 1) * page), :]
                p0 = int(perm[lp]) * page
                buf[..., p0:p0 + rows.shape[-2], :] = rows
            return buf
        kk, vv, ks, vs = paged(kk), paged(vv), paged(ks), paged(vs)
        pages = perm.to(k.device)
    seg_dtype = dtype if fmt is None else torch.promote_types(dtype, torch.float32)
    if isinstance(slots, Tensor):
        slots = slots.to(k.device)
    return Segment(n=n, positions=pos.to(k.device), keys=kk, values=vv, features=(k.shape[-1], v.shape[-1]),
                   dtype=seg_dtype, k_codec=kc, v_codec=vc, k_scale=ks, v_scale=vs,
                   groups=(group, group) if fmt else (0, 0), k_basis=kb, v_basis=vb, slots=slots, pages=pages,
                   page=page if page else 0)


def rotation_plan(rotary: Rotary, qpos: Tensor, held: Tensor, maps: Any = "absolute", sink: int = 0) -> Any:
    """A :class:`~streamkv.rope_at_read.RotationPlan` for hand-built segments (attention layout with
    heads at dim 1): a RopeAtRead bound to ``held``'s device, planned for a read holding ``held
    [H, S]`` with queries at ``qpos [Q]``."""
    rope = RopeAtRead(rotary, maps)
    rope.bind(sink=sink, capacity=held.shape[-1], per_head=True, head_dim_size=rotary.head_dim, device=held.device)
    return rope.plan(SimpleNamespace(positions=held, query_positions=qpos, head_axis=1, name="hand-built read",
                                     lifecycle=None, num_retained=None))


# ------------------------------------------------------------------------------------------ float64 reference
def stored(seg: Segment, which: int) -> Tensor:
    """float64 rows ``[..., n, W]`` of a segment as stored: through its page table (logical row ``r``
    at ``pages[r // page] * page + r % page``), decoded, out of its storage basis."""
    x = seg.keys if which == 0 else seg.values
    sc = seg.k_scale if which == 0 else seg.v_scale
    codec = seg.k_codec if which == 0 else seg.v_codec
    basis = seg.k_basis if which == 0 else seg.v_basis
    if seg.pages is not None:
        r = torch.arange(seg.n, device=x.device)
        phys = seg.pages[r // seg.page] * seg.page + r % seg.page
        x = x[..., phys, :]
        sc = None if sc is None else sc[..., phys, :]
    else:
        x, sc = x[..., :seg.n, :], None if sc is None else sc[..., :seg.n, :]
    if codec is not None:
        x = codec.decode(x, sc, seg.features[which], seg.groups[which])
    x = x.double()
    return x if basis is None else x @ basis.double()


def _roundoff(seg: Segment, which: int, dtype: torch.dtype, rotation: Any) -> tuple[int, int]:
    """Relative error (units of ``u``, the unit roundoff of ``dtype``, and ``ua``, of the accumulation
    dtype) with which the kernel's products see a segment's keys (``which`` 0) or values (1), against
    their float64 stored values: ``(in u, in ua)``. Rows that are not numbers of ``dtype`` are rounded
    to it (codes decode exactly in float32); rotated keys are rounded to ``dtype`` after the rotation
    (whose own rounding, ``amax + 4`` ua, :func:`reference` adds); keys in a basis are scored against
    basis queries rounded to ``dtype``; values in a basis come back through ``Dv`` products (three
    TF32 products in float32: ``5 ua`` each)."""
    x = seg.keys if which == 0 else seg.values
    codec = seg.k_codec if which == 0 else seg.v_codec
    wide = dtype in (torch.float32, torch.float64)
    in_u = 0 if (wide if codec is not None else x.dtype == dtype) else 1
    in_ua = 0
    if which == 0 and rotation is not None and not wide:
        in_u = 1
    basis = seg.k_basis if which == 0 else seg.v_basis
    if basis is not None:
        in_u += 1 if which == 0 else 0
        # the output leaves the basis through Dv products: float64 ones, or three TF32 products in float32
        # (the low x low term dropped: 2^-22 = 4 ua each)
        in_ua += seg.features[which] * (1 if dtype == torch.float64 else 5)
    return in_u, in_ua


def reference(q: Tensor, plan: BlockPlan) -> dict[str, Tensor | None]:
    """Float64 attention of ``q`` over ``plan`` by its definition (one softmax over every row of every
    segment, hidden where the positions say; a hidden row weighs nothing, whatever it holds), the
    per-slot statistics, and first-order error bounds for a read with queries of ``q``'s dtype
    (unit roundoff ``u``; ``ua`` that of the float32 / float64 accumulation), per output element:

    - a score is off by at most ``e_ij = scale sum_d |q_id k_jd| (r_j + (D + amax + 6) ua) + ua |s_ij|``
      (``r_j``: the keys' roundoff, :func:`_roundoff`; ``D + 2``: the product's accumulation and the
      scale; ``amax + 4``: the rotation's angle (``amax`` the largest), cos/sin and products);
    - a probability by ``p_ij (e_ij + E_i)`` (``E_i = max_j e_ij``: the normaliser's share), so the
      output by ``sum_j p_ij |v_j| (2 E_i + u + w_j) + 2 u |o_i|`` (``u``: ``p`` rounded to ``dtype``
      before the product with the values; ``w_j``: the values' roundoff; ``2 u |o_i|``: the output's
      rounding and its normaliser);
    - the log-sum-exp by ``E_i + ua (|lse_i| + 4)``; a statistic by ``2 (E + ua)`` of itself (``E`` the
      largest ``E_i``) plus ``ua`` per probability summed.

    Each bound is doubled (second-order terms). Returns ``out`` (``q``'s layout), ``lse``,
    ``key_max``, ``key_sum`` (None where the plan declares none) and ``tol_<name>`` of each."""
    dims = plan.dims
    heads, ha = dims.heads, dims.head_axis
    dtype = q.dtype
    u = torch.finfo(dtype).eps / 2
    ua = torch.finfo(torch.promote_types(dtype, torch.float32)).eps / 2
    qm = (q.unsqueeze(-3) if ha is None else q.movedim(ha, -3)).double()  # [*rest, Hq, Q, D]
    G = qm.shape[-3] // heads
    lead = list(q.shape[:-2])
    if ha is not None:
        lead[ha] = heads
    keys, vals, pos, own, slot, rk, rv = [], [], [], [], [], [], []
    amax = 0.0
    dev = q.device
    for seg in plan.segments:
        k, v = (x.expand(*lead, *x.shape[-2:]) for x in (stored(seg, 0), stored(seg, 1)))  # broadcast leading dims
        k, v = ((x.unsqueeze(-3) if ha is None else x.movedim(ha, -3)) for x in (k, v))  # [*rest, H, n, W]
        p = seg.positions.expand(heads, seg.n)
        v = v.masked_fill((p < 0).unsqueeze(-1), 0.0)
        if plan.rotation is not None:
            rot = plan.rotation.rotary
            ang = rot.angles(plan.rotation.key_units(p).expand_as(p), p)
            amax = max(amax, float(ang.abs().max()))
            k = rot.rotate(k, ang.cos(), ang.sin())
        keys.append(k)
        vals.append(v)
        pos.append(p)
        own.append(torch.full((seg.n,), seg.slots is not None, device=dev))
        idx = seg.slot_index()
        slot.append(torch.full((heads, seg.n), -1, device=dev) if idx is None else idx.expand(heads, seg.n))
        (ku, kua), (vu, vua) = _roundoff(seg, 0, dtype, plan.rotation), _roundoff(seg, 1, dtype, plan.rotation)
        rk.append(torch.full((seg.n,), ku * u + kua * ua, dtype=torch.float64, device=dev))
        rv.append(torch.full((seg.n,), vu * u + vua * ua, dtype=torch.float64, device=dev))
    K = torch.cat(keys, -2).repeat_interleave(G, -3)
    V = torch.cat(vals, -2).repeat_interleave(G, -3)
    P = torch.cat(pos, -1).repeat_interleave(G, 0)  # [Hq, N]
    own, slot, rk, rv = torch.cat(own), torch.cat(slot, -1), torch.cat(rk), torch.cat(rv)
    D = q.shape[-1]
    s = qm @ K.transpose(-1, -2) * plan.scale  # [*rest, Hq, Q, N]
    hidden = (P < 0).unsqueeze(-2)
    if plan.causal:
        qp = plan.query_positions.view(-1, 1)
        hidden = hidden | (P.unsqueeze(-2) > qp)
        if plan.window is not None:
            hidden = hidden | (P.unsqueeze(-2) <= qp - plan.window)
    s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, -1)
    prob = torch.softmax(s, -1)
    out = prob @ V
    e = (qm.abs() @ K.abs().transpose(-1, -2) * plan.scale) * (rk + (D + amax + 6) * ua)
    e = (e + ua * s.abs()).masked_fill(hidden, 0.0)
    E = e.amax(-1, keepdim=True)
    p0 = prob.nan_to_num()
    tol_out = 2 * ((2 * E + u) * (p0 @ V.abs()) + (p0 * rv) @ V.abs() + 2 * u * out.abs().nan_to_num())
    tol_lse = 2 * (E.squeeze(-1) + ua * (lse.abs().nan_to_num(posinf=0.0, neginf=0.0) + 4))
    mv = lambda t, axis: t.squeeze(axis) if ha is None else t.movedim(axis, ha)  # noqa: E731
    res: dict[str, Tensor | None] = {"out": mv(out, -3), "lse": mv(lse, -2), "tol_out": mv(tol_out, -3),
                                     "tol_lse": mv(tol_lse, -2), "key_max": None, "key_sum": None}
    st = plan.statistic
    if st is not None:
        S, Q = plan.slots, q.shape[-2]
        r = Q if st.rows is None else min(st.rows, Q)
        so = s[..., own]
        lse_own = torch.logsumexp(so, -1, keepdim=True)
        # a row that sees no slot (only rows outside them) gives every slot p = 0
        p = torch.where(torch.isneginf(lse_own), 0.0, torch.exp(so - lse_own))[..., Q - r:, :]  # [*rest, Hq, r, N]
        p = p.reshape(-1, heads, G * r, p.shape[-1]).transpose(0, 1).reshape(heads, -1, p.shape[-1])
        dest = slot[:, own]
        dest = torch.where(dest >= 0, dest, S)
        rel = 2 * (float(E.max()) + ua)
        for name, red in (("max", "amax"), ("sum", "sum")):
            if name in st.reduce:
                acc = torch.zeros(heads, S + 1, dtype=torch.float64, device=dev)
                val = p.amax(1) if red == "amax" else p.sum(1)
                res["key_" + name] = acc.scatter_reduce_(-1, dest, val, reduce=red)[:, :S]
                res["key_" + name][:, :st.skip] = 0.0  # the slots the statistic leaves out read 0
                newest = newest_slots(plan)
                if newest is not None:
                    res["key_" + name].masked_fill_(newest[:, :S], 0.0)
                count = 1 if red == "amax" else p.shape[1]
                res["tol_key_" + name] = 2 * (rel * res["key_" + name] + count * ua)
    return res


def compare(got: Any, case: Case) -> dict[str, float]:
    """Worst ``|got - float64| / bound`` of each output (``<= 1``: within the bound; ``inf`` where a
    NaN or -inf pattern differs) and, where the reference loop serves the case alike, worst
    ``|got - read_blocks| / bound`` (``<= 2``: both within the bound)."""
    q, plan = case.q, case.plan
    ref = reference(q, plan)
    want = read_blocks(q, plan) if case.against_reference else None
    worst: dict[str, float] = {}
    for name in ("out", "lse", "key_max", "key_sum"):
        a = getattr(got, name)
        b = ref[name]
        if name == "lse" and not plan.lse:
            worst["lse"] = 0.0 if a is None else float("inf")
            continue
        if b is None:
            worst[name] = 0.0 if a is None else float("inf")
            continue
        if a is None or a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()) or not torch.equal(
                torch.isneginf(a), torch.isneginf(b)):
            worst[name] = float("inf")
            continue
        fin = torch.isfinite(b)
        tol = ref["tol_" + name][fin]
        worst[name] = float(((a.double() - b).abs()[fin] / tol).max()) if fin.any() else 0.0
        if want is not None:
            c = getattr(want, name)
            worst[name + "_vs_read_blocks"] = float(((a.double() - c.double()).abs()[fin] / tol).max()) if fin.any() \
                else 0.0
    worst["dtype_ok"] = 0.0 if got.out.dtype == q.dtype else float("inf")
    return worst


def within(worst: dict[str, float]) -> bool:
    """Every figure of :func:`compare` within its bound."""
    return all(v <= (2.0 if k.endswith("_vs_read_blocks") else 1.0) for k, v in worst.items())


# ------------------------------------------------------------------------------------------ the cases
def _randn(g: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def case_plan(sz: Size, segs: list[Segment], *, S: int, Q: int, Dv: int | None = None, qpos: Tensor | None = None,
          causal: bool = False, window: int | None = None, rotation: Any = None, statistic: Statistic | None = None,
          device: torch.device) -> BlockPlan:
    """The plan of a case: ``segs`` over ``S`` slots in the ``[B, S, H, D]`` layout of ``sz``, ``Q``
    query rows, blocks of 7 rows (several per read at every size), the log-sum-exp asked for."""
    B, H, D = sz.batch, sz.heads, sz.features
    dims = Dims((B, S, H, D), (B, S, H, Dv or D), seq=1, head=2, slots=S, chunk=Q)
    return BlockPlan(segs, dims, D ** -0.5, None if qpos is None else qpos.to(device), causal, window, rotation,
                     statistic, S, block=7, lse=True)


def _codes(fmt_index: int) -> Callable[[torch.device, Size], Case]:
    def build(dev: torch.device, sz: Size) -> Case:
        """A code segment (values in the next format, both in a Hadamard basis, groups of 8 channels)
        beside dense float32 rows named by a per-head slot map with holes; grouped queries, causal
        with a window, statistics of the newest 3 rows; keys split over 2 programs."""
        names = list(KV_FORMATS)
        fmt, vfmt = names[fmt_index], names[(fmt_index + 1) % len(names)]
        B, H, D = sz.batch, sz.heads, sz.features
        g = torch.Generator().manual_seed(fmt_index)
        nh, nc, Q = 6 * sz.rows, 27 * sz.rows, 5 * sz.queries
        S = nh + nc
        q = _randn(g, B, 2 * H, Q, D).float()
        k, v = _randn(g, B, H, S, D), _randn(g, B, H, S, D)
        pos = torch.stack([torch.randperm(S, generator=g) for _ in range(H)])
        pos[0, 2], pos[1, 9], pos[1, nh + 24 * sz.rows] = -1, -1, -1  # holes in one head, not the other
        hot_slots = torch.stack([torch.randperm(nh, generator=g) for _ in range(H)])
        hot_slots[1, 0] = -1  # a hot row that is no slot
        R = hadamard(D).double()
        k, v = k.to(dev), v.to(dev)
        segs = [segment(k[..., :nh, :], v[..., :nh, :], pos[:, :nh], torch.float32, slots=hot_slots),
                segment(k[..., nh:, :], v[..., nh:, :], pos[:, nh:], torch.float32, fmt=fmt, vfmt=vfmt, basis=(R, R),
                        slots=nh)]
        plan = case_plan(sz, segs, S=S, Q=Q, qpos=torch.arange(S - Q, S), causal=True, window=24 * sz.rows,
                     statistic=Statistic(rows=3), device=dev)
        return Case(q.to(dev), plan, KernelConfig(splits=2))
    return build


def _dense(dtype: torch.dtype, shape: str) -> Callable[[torch.device, Size], Case]:
    def build(dev: torch.device, sz: Size) -> Case:
        """One dense segment (one part: the kernel writes the output itself): a chunk of queries with
        a causal window, or one decoding query of 3 grouped heads per key head (SmolLM2's 9 on 3)."""
        B, H, D = sz.batch, sz.heads, sz.features
        g = torch.Generator().manual_seed(3)
        S = 37 * sz.rows
        Q, groups = (6 * sz.queries, 1) if shape == "prefill" else (1, 3)
        q = _randn(g, B, groups * H, Q, D).to(dtype)
        k, v = _randn(g, B, H, S, D), _randn(g, B, H, S, D)
        pos = torch.arange(S).expand(H, -1).clone()
        pos[1, 5:9] = -1
        plan = case_plan(sz, [segment(k.to(dev), v.to(dev), pos, dtype)], S=S, Q=Q, qpos=torch.arange(S - Q, S),
                     causal=True, window=20 * sz.rows if shape == "prefill" else None, device=dev)
        return Case(q.to(dev), plan)
    return build


#: the rotaries of the RoPE-at-read cases: (build for a head dim and size, dtype, storage format)
ROTARIES: dict[str, tuple[Callable[[int, Size], Rotary], torch.dtype, str | None]] = {
    "rope1d-half": (lambda d, sz: Rope1D(d, theta=100.0), torch.float64, None),
    "rope1d-interleaved": (lambda d, sz: Rope1D(d, theta=100.0, style="interleaved"), torch.float32, "int4"),
    "frame": (lambda d, sz: FrameRope(Rope3D(d, 2, 2, max_frames=1 << 16)), torch.float32, "fp8"),
}


def _ring(rotary: str, map_name: str) -> Callable[[torch.device, Size], Case]:
    def build(dev: torch.device, sz: Size) -> Case:
        """A ring cache that stores raw keys and rotates them at read by a position map: the cache's
        own plan (queries rotated by the cache), through wraps, causal, grouped queries; quantised rows
        (codes beside the full-precision sinks) for two of the rotaries; keys split over 2 programs."""
        from .. import RingCache

        make, dtype, fmt = ROTARIES[rotary]
        H, D = sz.heads, sz.features
        rot = make(D, sz)
        tpu = rot.tokens_per_unit
        sink, window, chunk = 2 * tpu * sz.queries, 6 * tpu * sz.queries, 2 * tpu * sz.queries
        units = lambda t: t // tpu  # noqa: E731
        pm = position_map(map_name, **POSITION_MAPS[map_name].for_geometry(units(sink), units(sink + window),
                                                                         units(chunk)))
        shape = (1, sink + window, H, D)
        cache = RingCache(shape, shape, seq_dim=1, sink=sink, window=window, chunk=chunk, dtype=dtype, device=dev,
                          quant=None if fmt is None else KVQuant(fmt, group=8), rope_at_read=RopeAtRead(rot, pm))
        g = torch.Generator().manual_seed(len(map_name))
        for c in range(6):  # past the first eviction: the ring wraps
            cache.begin_chunk(c)
            q, k, v = (_randn(g, 1, chunk, 2 * H, D).to(device=dev, dtype=dtype) for _ in range(3))
            read = cache.layer(0).update(k[:, :, :H], v[:, :, :H])
            if c < 5:
                cache.commit_chunk(c)
        qt, plan = read.block_plan(q.transpose(1, 2), scale=D ** -0.5, causal=True, lse=True)
        return Case(qt, plan, KernelConfig(splits=2))
    return build


def _limbs(map_kind: str) -> Callable[[torch.device, Size], Case]:
    def build(dev: torch.device, sz: Size) -> Case:
        """Keys ``2^40`` positions before their queries (every 18-bit limb of the angle in use) under
        the absolute map, or fractional rotation units (the registry's custom example map), on
        hand-built segments with per-head positions and a hole, float64."""
        B, H, D = sz.batch, sz.heads, sz.features
        g = torch.Generator().manual_seed(9)
        S, Q = 21 * sz.rows, 3 * sz.queries
        far = 1 << 40
        q = _randn(g, B, H, Q, D)
        k, v = _randn(g, B, H, S, D).to(dev), _randn(g, B, H, S, D).to(dev)
        pos = torch.stack([torch.randperm(S, generator=g) * 5 for _ in range(H)])
        pos[1, 4] = -1
        qpos = torch.arange(far, far + Q)
        held = torch.cat([pos, qpos.expand(H, -1)], -1).to(dev)
        maps = "absolute" if map_kind == "absolute" else position_map(
            "custom", **POSITION_MAPS["custom"].for_geometry(0, 0, 0))
        rotation = rotation_plan(Rope1D(D), qpos.to(dev), held, maps)
        cut = 9 * sz.rows
        segs = [segment(k[..., :cut, :], v[..., :cut, :], pos[:, :cut], torch.float64),
                segment(k[..., cut:, :], v[..., cut:, :], pos[:, cut:], torch.float64, slots=cut)]
        return Case(q.to(dev), case_plan(sz, segs, S=S, Q=Q, rotation=rotation, device=dev))
    return build


def _paged(dev: torch.device, sz: Size) -> Case:
    """Dense float64 rows and int2 codes (with their scales), each through a shuffled page table of 8
    rows (the last page partly used, a spare NaN page never referenced); statistics of every row."""
    B, H, D = sz.batch, sz.heads, sz.features
    g = torch.Generator().manual_seed(4)
    S, Q, cut = 35 * sz.rows, 4 * sz.queries, 20 * sz.rows
    q = _randn(g, B, H, Q, D)
    k, v = _randn(g, B, H, S, D).to(dev), _randn(g, B, H, S, D).to(dev)
    pos = torch.arange(S).expand(H, -1).clone()
    pos[0, 13] = -1
    segs = [segment(k[..., :cut, :], v[..., :cut, :], pos[:, :cut], torch.float64, page=8, g=g),
            segment(k[..., cut:, :], v[..., cut:, :], pos[:, cut:], torch.float64, fmt="int2", page=8, g=g, slots=cut)]
    return Case(q.to(dev), case_plan(sz, segs, S=S, Q=Q, statistic=Statistic(), device=dev))


def _tier(reduce: tuple[str, ...]) -> Callable[[torch.device, Size], Case]:
    def build(dev: torch.device, sz: Size) -> Case:
        """A tier-like segment (int8 codes of rows outside the cache's slots, keys without the batch
        dim) beside the cache's rows: one softmax over both, statistics normalised over the slots
        only; a per-head slot map listing the cache's rows backwards."""
        B, H, D = sz.batch, sz.heads, sz.features
        g = torch.Generator().manual_seed(5)
        S, T, Q = 18 * sz.rows, 13 * sz.rows, 4 * sz.queries
        q = _randn(g, B, 2 * H, Q, D)
        k, v = _randn(g, B, H, S, D).to(dev), _randn(g, B, H, S, D).to(dev)
        kt, vt = _randn(g, H, T, D).to(dev), _randn(g, H, T, D).to(dev)
        pos = torch.arange(S).expand(H, -1).clone()
        pos[1, 3] = -1
        tier_pos = torch.stack([torch.randperm(T, generator=g) + S + 12 for _ in range(H)])
        tier_pos[0, 1] = -1
        slots = torch.arange(S).flip(0).expand(H, -1).clone()
        segs = [segment(k.flip(-2), v.flip(-2), pos.flip(-1), torch.float64, slots=slots),
                segment(kt, vt, tier_pos, torch.float64, fmt="int8", slots=None)]
        return Case(q.to(dev), case_plan(sz, segs, S=S, Q=Q, statistic=Statistic(rows=2, reduce=reduce), device=dev))
    return build


def _no_slot_seen(dev: torch.device, sz: Size) -> Case:
    """A query row that sees rows outside the cache's slots only (a tier's, at earlier positions) and
    none of its slots: its output comes from the tier's rows, and it adds nothing to the slots'
    statistics (``read_blocks`` normalises it by ``lse = -inf``: NaN statistics for every slot of
    every head, so it is not compared here)."""
    B, H, D = sz.batch, sz.heads, sz.features
    g = torch.Generator().manual_seed(13)
    S, T = 6 * sz.rows, 4 * sz.rows
    q = _randn(g, B, H, 2, D)
    k, v = _randn(g, B, H, S, D).to(dev), _randn(g, B, H, S, D).to(dev)
    kt, vt = _randn(g, B, H, T, D).to(dev), _randn(g, B, H, T, D).to(dev)
    segs = [segment(k, v, torch.arange(T + 6, T + 6 + S).expand(H, -1), torch.float64, slots=0),
            segment(kt, vt, torch.arange(T).expand(H, -1), torch.float64, slots=None)]
    plan = case_plan(sz, segs, S=S, Q=2, qpos=torch.tensor([T + 1, T + 8]), causal=True, statistic=Statistic(),
                 device=dev)
    return Case(q.to(dev), plan, against_reference=False)


def _layout(kind: str) -> Callable[[torch.device, Size], Case]:
    def build(dev: torch.device, sz: Size) -> Case:
        """Heads as the first leading dim (``[H, B, S, D]``: K/V ``(H, S, B, D)``), or no head dim at
        all (``[B, S, D]``: one virtual head); a dense and an fp8 segment, causal, statistics."""
        B, H, D = sz.batch, sz.heads, sz.features
        g = torch.Generator().manual_seed(6)
        S, Q, cut = 19 * sz.rows, 3 * sz.queries, 8 * sz.rows
        if kind == "heads-first":
            dims = Dims((H, S, B, D), (H, S, B, D), seq=1, head=0, slots=S, chunk=Q)
            q, k, v = _randn(g, 2 * H, B, Q, D), _randn(g, H, B, S, D), _randn(g, H, B, S, D)
            heads = H
        else:
            dims = Dims((B, S, D), (B, S, D), seq=1, head=None, slots=S, chunk=Q)
            q, k, v = _randn(g, B, Q, D), _randn(g, B, S, D), _randn(g, B, S, D)
            heads = 1
        k, v = k.to(dev), v.to(dev)
        pos = torch.arange(S).expand(heads, -1).clone()
        pos[0, 7] = -1
        segs = [segment(k[..., :cut, :], v[..., :cut, :], pos[:, :cut], torch.float64),
                segment(k[..., cut:, :], v[..., cut:, :], pos[:, cut:], torch.float64, fmt="fp8", slots=cut)]
        plan = BlockPlan(segs, dims, D ** -0.5, torch.arange(S - Q, S, device=dev), True, None, None, Statistic(), S,
                         block=5, lse=True)
        return Case(q.to(dev), plan)
    return build


def _decode_split(dev: torch.device, sz: Size) -> Case:
    """One decoding query of 3 grouped heads, two segments (dense, int4 codes in a signed-permutation
    basis of other value features), each split over 3 programs: 6 parts merged by their log-sum-exps."""
    B, H, D = sz.batch, sz.heads, sz.features
    g = torch.Generator().manual_seed(7)
    S, Q, Dv, cut = 70 * sz.rows, 1, D // 2, 30 * sz.rows
    q = _randn(g, B, 3 * H, Q, D).float()
    k, v = _randn(g, B, H, S, D).to(dev), _randn(g, B, H, S, Dv).to(dev)
    pos = torch.arange(S).expand(H, -1).clone()
    pos[:, 60 * sz.rows:] = -1  # an unfilled tail
    basis = (signed_permutation(D, g), signed_permutation(Dv, g))
    segs = [segment(k[..., :cut, :], v[..., :cut, :], pos[:, :cut], torch.float32),
            segment(k[..., cut:, :], v[..., cut:, :], pos[:, cut:], torch.float32, fmt="int4", basis=basis, slots=cut)]
    plan = case_plan(sz, segs, S=S, Q=Q, Dv=Dv, qpos=torch.tensor([S]), causal=True, statistic=Statistic(reduce=("sum",)),
                 device=dev)
    return Case(q.to(dev), plan, KernelConfig(splits=3))


def _hidden_nan(dev: torch.device, sz: Size) -> Case:
    """Rows at position -1 holding NaN (a page never written, say) change nothing: their scores are
    masked and their values weigh nothing (``read_blocks`` multiplies them by 0: NaN, so it is not
    compared here)."""
    B, H, D = sz.batch, sz.heads, sz.features
    g = torch.Generator().manual_seed(12)
    S, Q = 20 * sz.rows, 3 * sz.queries
    q = _randn(g, B, H, Q, D).float()
    k, v = _randn(g, B, H, S, D), _randn(g, B, H, S, D)
    pos = torch.arange(S).expand(H, -1).clone()
    pos[:, 3:6] = -1
    k[..., 3:6, :] = float("nan")
    v[..., 3:6, :] = float("nan")
    return Case(q.to(dev), case_plan(sz, [segment(k.to(dev), v.to(dev), pos, torch.float32)], S=S, Q=Q, device=dev),
                against_reference=False)


def _nothing_visible(dev: torch.device, sz: Size) -> Case:
    """A query row that sees no key (its position before every key's): NaN output, -inf log-sum-exp,
    as SDPA and the reference."""
    B, H, D = sz.batch, sz.heads, sz.features
    g = torch.Generator().manual_seed(8)
    S, Q = 10 * sz.rows, 2
    q = _randn(g, B, H, Q, D)
    k, v = _randn(g, B, H, S, D).to(dev), _randn(g, B, H, S, D).to(dev)
    pos = torch.arange(5, 5 + S).expand(H, -1)
    return Case(q.to(dev), case_plan(sz, [segment(k, v, pos, torch.float64)], S=S, Q=Q, qpos=torch.tensor([4, 6]),
                                 causal=True, device=dev))


def _scored(dev: torch.device, sz: Size) -> Case:
    """A TOVA cache with int8 codes and full-precision sinks: the read's own segments and statistic,
    after the first eviction."""
    from .. import KVCache

    H, D = sz.heads, sz.features
    chunk = 4 * sz.queries
    cache = KVCache((1, 4 * chunk, H, D), (1, 4 * chunk, H, D), seq_dim=1, sink=2, window=4 * chunk - 2, chunk=chunk,
                    policy="tova", dtype=torch.float32, device=dev, quant=KVQuant("int8", group=8))
    g = torch.Generator().manual_seed(10)
    for c in range(5):
        cache.begin_chunk(c)
        q, k, v = (_randn(g, 1, chunk, H, D).float().to(dev) for _ in range(3))
        read = cache.layer(0).update(k, v)
        if c < 4:
            qt, plan = read.block_plan(q.transpose(1, 2), scale=D ** -0.5, causal=True, statistic=read.statistic)
            read.scorer(*(lambda r: (r.key_max, r.key_sum))(read_blocks(qt, plan)))
            cache.commit_chunk(c)
    qt, plan = read.block_plan(q.transpose(1, 2), scale=D ** -0.5, causal=True, statistic=read.statistic, lse=True)
    return Case(qt, plan)


#: every checked case, by name: ``build(device, size) -> Case``
CASES: dict[str, Callable[[torch.device, Size], Case]] = {
    **{f"codes-{f}": _codes(i) for i, f in enumerate(KV_FORMATS)},
    **{f"dense-{str(dt).replace('torch.', '')}-{shape}": _dense(dt, shape)
       for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64) for shape in ("prefill", "decode")},
    **{f"rope-{r}-{m}": _ring(r, m) for r in ROTARIES for m in POSITION_MAPS},
    **{f"limbs-{m}": _limbs(m) for m in ("absolute", "custom")},
    "paged": _paged,
    **{f"tier-{r[0]}": _tier(r) for r in (("max",), ("sum",))},
    "tier-only-seen": _no_slot_seen,
    **{f"layout-{k}": _layout(k) for k in ("heads-first", "no-heads")},
    "decode-split": _decode_split,
    "hidden-nan": _hidden_nan,
    "nothing-visible": _nothing_visible,
    "scored-cache": _scored,
}
