"""The Triton block read (:func:`streamkv.kernels.triton_read`) on the CPU, under Triton's interpreter
(``TRITON_INTERPRET=1``): every variant against float64 attention over the values the segments store
(decoded, out of their storage basis, rotated at read in float64) and against the reference loop
(:func:`streamkv.blockread.read_blocks`), within the error bound of the queries' dtype
(:func:`_bounds`); and what :func:`~streamkv.kernels.why_not` refuses.

Shapes are tiny (the interpreter runs every program in numpy): a few heads, 16 features, tens of
rows, tiles of 16, so that reads span several key blocks, several query tiles and (forced) splits."""

import math
import os
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

_ENV = os.environ.get("TRITON_INTERPRET")
if "triton" not in sys.modules:  # Triton jits its own language for the mode it finds at its import
    os.environ["TRITON_INTERPRET"] = "1"
try:
    pytest.importorskip("triton")
finally:  # the rest of the session keeps its environment; the fixture below sets it for these tests
    if _ENV is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _ENV

from streamkv import KVCache, RingCache  # noqa: E402
from streamkv.blockread import BlockPlan, Statistic, read_blocks  # noqa: E402
from streamkv.kernels import KernelConfig, interpreter_reason, triton_read, why_not  # noqa: E402
from streamkv.positions import POSITION_MAPS, position_map  # noqa: E402
from streamkv.rope import Rope3D  # noqa: E402
from streamkv.rope_at_read import RopeAtRead  # noqa: E402
from streamkv.rotary import FrameRope, Rope1D, Rotary  # noqa: E402
from streamkv.stores import KV_FORMATS, Dims, IntCodec, KVQuant, Segment, hadamard  # noqa: E402

os.environ["TRITON_INTERPRET"] = "1"
#: None when this process runs the kernels on CPU tensors; else test_in_a_fresh_process runs this file
HERE = interpreter_reason()
if _ENV is None:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = _ENV


@pytest.fixture(autouse=True)
def _interpreter(request, monkeypatch):
    """Kernels on CPU tensors run in Triton's interpreter; where triton was imported in this process
    before these tests could set it up (torch.compile imports it), they run in a fresh process."""
    if HERE is not None and request.node.name != "test_in_a_fresh_process":
        pytest.skip(f"run by test_in_a_fresh_process: {HERE}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_in_a_fresh_process():
    """This file in a fresh interpreter process, where this one cannot run the kernels."""
    if HERE is None:
        pytest.skip("the kernels ran in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0 and " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-6000:] + r.stderr[-2000:]


B, H, D = 2, 2, 16
FORMATS = list(KV_FORMATS)


# ------------------------------------------------------------------------------------------ building reads
def _signed_permutation(n, g):
    """An orthogonal basis exact in every float type."""
    r = torch.zeros(n, n, dtype=torch.float64)
    r[torch.arange(n), torch.randperm(n, generator=g)] = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    return r


def _segment(k, v, pos, dtype, *, fmt=None, vfmt=None, group=8, basis=None, slots=0, page=0, g=None):
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
            kb, vb = (b.to(torch.float32) for b in basis)
        kk, ks = kc.encode(k.float() if kb is None else k.float() @ kb.T, group)
        vv, vs = vc.encode(v.float() if vb is None else v.float() @ vb.T, group)
    pages = None
    if page:
        count = -(-n // page)
        perm = torch.randperm(count + 1, generator=g)[:count]  # logical page -> physical page

        def paged(x):
            if x is None:
                return None
            fill = float("nan") if x.dtype.is_floating_point else 0
            buf = torch.full((*x.shape[:-2], (count + 1) * page, x.shape[-1]), fill, dtype=x.dtype)
            for lp in range(count):
                rows = x[..., lp * page:min(n, (lp + 1) * page), :]
                p0 = int(perm[lp]) * page
                buf[..., p0:p0 + rows.shape[-2], :] = rows
            return buf
        kk, vv, ks, vs = paged(kk), paged(vv), paged(ks), paged(vs)
        pages = perm.clone()
    seg_dtype = dtype if fmt is None else torch.promote_types(dtype, torch.float32)
    return Segment(n=n, positions=pos, keys=kk, values=vv, features=(k.shape[-1], v.shape[-1]), dtype=seg_dtype,
                   k_codec=kc, v_codec=vc, k_scale=ks, v_scale=vs, groups=(group, group) if fmt else (0, 0),
                   k_basis=kb, v_basis=vb, slots=slots, pages=pages, page=page if page else 0)


def _randn(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _rotation(rotary, qpos, held, maps="absolute", sink=0):
    """A :class:`~streamkv.rope_at_read.RotationPlan` for hand-built segments: a RopeAtRead bound to
    the CPU, planned for a read holding ``held [H, S]`` with queries at ``qpos [Q]``."""
    rope = RopeAtRead(rotary, maps)
    rope.bind(sink=sink, capacity=held.shape[-1], per_head=True, head_dim_size=rotary.head_dim,
              device=torch.device("cpu"))
    return rope.plan(SimpleNamespace(positions=held, query_positions=qpos, head_axis=1, name="hand-built read"))


# ------------------------------------------------------------------------------------------ float64 reference
def _stored(seg, which):
    """float64 rows ``[..., n, W]`` of a segment as stored: through its page table (logical row ``r``
    at ``pages[r // page] * page + r % page``), decoded, out of its storage basis."""
    x = seg.keys if which == 0 else seg.values
    sc = seg.k_scale if which == 0 else seg.v_scale
    codec = seg.k_codec if which == 0 else seg.v_codec
    basis = seg.k_basis if which == 0 else seg.v_basis
    if seg.pages is not None:
        r = torch.arange(seg.n)
        phys = seg.pages[r // seg.page] * seg.page + r % seg.page
        x = x[..., phys, :]
        sc = None if sc is None else sc[..., phys, :]
    else:
        x, sc = x[..., :seg.n, :], None if sc is None else sc[..., :seg.n, :]
    if codec is not None:
        x = codec.decode(x, sc, seg.features[which], seg.groups[which])
    x = x.double()
    return x if basis is None else x @ basis.double()


def _reference(q, plan):
    """Float64 attention of ``q`` over ``plan`` by its definition (one softmax over all rows of all
    segments, hidden where the positions say), with the per-slot statistics: the dict of
    ``out`` (``q``'s layout), ``lse``, ``key_max``, ``key_sum``, and ``smax`` (a bound on ``|score|``)
    and ``amax`` (the largest rotation angle) for :func:`_bounds`."""
    dims = plan.dims
    heads, ha = dims.heads, dims.head_axis
    qm = (q.unsqueeze(-3) if ha is None else q.movedim(ha, -3)).double()  # [*rest, Hq, Q, D]
    G = qm.shape[-3] // heads
    rest = qm.shape[:-3]
    lead = list(q.shape[:-2])
    if ha is not None:
        lead[ha] = heads
    keys, vals, pos, own, slot = [], [], [], [], []
    amax = 0.0
    for seg in plan.segments:
        k, v = (x.expand(*lead, *x.shape[-2:]) for x in (_stored(seg, 0), _stored(seg, 1)))  # broadcast leading dims
        k, v = ((x.unsqueeze(-3) if ha is None else x.movedim(ha, -3)) for x in (k, v))  # [*rest, H, n, W]
        p = seg.positions.expand(heads, seg.n)
        if plan.rotation is not None:
            rot = plan.rotation.rotary
            units = plan.rotation.key_units(p)
            ang = rot.angles(units, p)
            amax = max(amax, float(ang.abs().max()))
            k = rot.rotate(k, ang.cos(), ang.sin())
        keys.append(k)
        vals.append(v)
        pos.append(p)
        own.append(torch.full((seg.n,), seg.slots is not None))
        idx = seg.slot_index()
        slot.append(torch.full((heads, seg.n), -1) if idx is None else idx.expand(heads, seg.n))
    K = torch.cat(keys, -2).repeat_interleave(G, -3)
    V = torch.cat(vals, -2).repeat_interleave(G, -3)
    P = torch.cat(pos, -1).repeat_interleave(G, 0)  # [Hq, N]
    own, slot = torch.cat(own), torch.cat(slot, -1)
    s = qm @ K.transpose(-1, -2) * plan.scale  # [*rest, Hq, Q, N]
    smax = float((qm.norm(dim=-1).amax() * K.norm(dim=-1).amax()).item() * plan.scale)
    hidden = (P < 0).unsqueeze(-2)
    if plan.causal:
        qp = plan.query_positions.view(-1, 1)
        hidden = hidden | (P.unsqueeze(-2) > qp)
        if plan.window is not None:
            hidden = hidden | (P.unsqueeze(-2) <= qp - plan.window)
    s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ V
    res = {"out": out.squeeze(-3) if ha is None else out.movedim(-3, ha),
           "lse": lse.squeeze(-2) if ha is None else lse.movedim(-2, ha), "smax": smax, "amax": amax,
           "key_max": None, "key_sum": None}
    st = plan.statistic
    if st is not None:
        S, Q = plan.slots, q.shape[-2]
        r = Q if st.rows is None else min(st.rows, Q)
        so = s[..., own]
        p = torch.exp(so - torch.logsumexp(so, -1, keepdim=True))[..., Q - r:, :]  # [*rest, Hq, r, N_own]
        p = p.reshape(-1, heads, G * r, p.shape[-1]).transpose(0, 1).reshape(heads, -1, p.shape[-1])
        dest = slot[:, own]
        dest = torch.where(dest >= 0, dest, S)
        for name, red in (("max", "amax"), ("sum", "sum")):
            if name in st.reduce:
                acc = torch.zeros(heads, S + 1, dtype=torch.float64)
                val = p.amax(1) if red == "amax" else p.sum(1)
                res["key_" + name] = acc.scatter_reduce_(-1, dest, val, reduce=red)[:, :S]
    return res


def _bounds(dtype, ref, D, v_scale, count):
    """Error bounds of a read computed with queries in ``dtype`` (unit roundoff ``u``; scores and the
    softmax in ``acc``, float32 or float64, unit roundoff ``ua``): a score is off by at most
    ``smax (2 u + (D + amax + 4) ua)`` (keys and basis queries rounded to ``dtype``, the product
    accumulated in ``acc``, the angle taken in ``acc``); a probability by a factor ``exp(2 e_s) - 1``
    of itself, the output by ``4 u`` (``p``, ``v``, the output rounded) plus ``4 e_s`` times the
    values' scale; a sum of ``count`` probabilities by ``4 e_s`` of its value and ``count ua``."""
    u = torch.finfo(dtype).eps / 2
    ua = torch.finfo(torch.promote_types(dtype, torch.float32)).eps / 2
    e_s = ref["smax"] * (2 * u + (D + ref["amax"] + 4) * ua)
    return {"out": v_scale * (4 * u + 4 * e_s), "lse": 2 * e_s + 4 * ua * (1 + float(ref["lse"].abs().nan_to_num(
        posinf=0, neginf=0).max())), "key_max": 4 * e_s + 4 * ua, "key_sum": count * (4 * e_s + 4 * ua)}


def _check(q, plan, config=None, *, against_reference=True):
    """The kernel against float64 and against ``read_blocks``, each within the dtype's bound."""
    got = triton_read(q, plan, config)
    ref = _reference(q, plan)
    want = read_blocks(q, plan)
    vals = torch.cat([_stored(s, 1).reshape(-1) for s in plan.segments])
    Q = q.shape[-2]
    rows = Q if plan.statistic is None or plan.statistic.rows is None else min(plan.statistic.rows, Q)
    count = q.numel() // q.shape[-1] // plan.dims.heads * rows // Q
    tol = _bounds(q.dtype, ref, q.shape[-1], float(vals.abs().max()), count)
    assert got.out.dtype == q.dtype and got.out.shape == ref["out"].shape
    for name in ("out", "lse", "key_max", "key_sum"):
        a = getattr(got, name)
        if name == "lse" and not plan.lse:
            assert a is None
            continue
        b, c = ref[name], getattr(want, name)
        if b is None:
            assert a is None and c is None, name
            continue
        assert torch.equal(a.isnan(), b.isnan()), name  # rows that see nothing: NaN in both
        fin = ~b.isnan() & torch.isfinite(b)
        err = (a.double() - b)[fin].abs().max().item() if fin.any() else 0.0
        assert err <= tol[name], (name, err, tol[name])
        if against_reference:
            err_ref = (a.double() - c.double())[fin].abs().max().item() if fin.any() else 0.0
            assert err_ref <= 2 * tol[name], (name, "vs read_blocks", err_ref, tol[name])
        if name == "lse":
            assert torch.equal(torch.isneginf(a), torch.isneginf(b))
    return got


def _plan(segs, *, S, Q, Dv=D, scale=None, qpos=None, causal=False, window=None, rotation=None, statistic=None,
          heads=H, lse=True):
    dims = Dims((B, S, heads, D), (B, S, heads, Dv), seq=1, head=2, slots=S, chunk=Q)
    return BlockPlan(segs, dims, scale or 1 / math.sqrt(D), qpos, causal, window, rotation, statistic, S, block=7,
                     lse=lse)


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("i", range(len(FORMATS)), ids=FORMATS)
def test_codes_beside_dense_rows(i):
    """A code segment of each format (values in the next format, both in a Hadamard basis, groups of
    8 channels) beside dense float32 rows named by a per-head slot map with holes; grouped queries,
    causal with a window, per-slot statistics over the newest 3 rows; keys split over 2 programs."""
    fmt, vfmt = FORMATS[i], FORMATS[(i + 1) % len(FORMATS)]
    g = torch.Generator().manual_seed(i)
    nh, nc, Q = 6, 27, 5
    S = nh + nc
    q = _randn(g, B, 2 * H, Q, D).float()
    k, v = _randn(g, B, H, S, D), _randn(g, B, H, S, D)
    pos = torch.stack([torch.randperm(S, generator=g) for _ in range(H)])
    pos[0, 2], pos[1, 9], pos[1, 30] = -1, -1, -1  # holes in one head, not the other
    hot_slots = torch.stack([torch.randperm(nh, generator=g) for _ in range(H)])
    hot_slots[1, 0] = -1  # a hot row that is no slot
    R = hadamard(D).double()
    segs = [_segment(k[..., :nh, :], v[..., :nh, :], pos[:, :nh], torch.float32, slots=hot_slots),
            _segment(k[..., nh:, :], v[..., nh:, :], pos[:, nh:], torch.float32, fmt=fmt, vfmt=vfmt, basis=(R, R),
                     slots=nh)]
    plan = _plan(segs, S=S, Q=Q, qpos=torch.arange(S - Q, S), causal=True, window=24, statistic=Statistic(rows=3))
    _check(q, plan, KernelConfig(splits=2))


@pytest.mark.parametrize("shape", ["prefill", "decode"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dense_rows_in_every_dtype(dtype, shape):
    """One dense segment (one part: the kernel writes the output itself): a chunk of 6 queries with a
    causal window, or one decoding query of 3 grouped heads per key head (SmolLM2's 9 on 3)."""
    g = torch.Generator().manual_seed(3)
    S = 37
    Q, groups = (6, 1) if shape == "prefill" else (1, 3)
    q = _randn(g, B, groups * H, Q, D).to(dtype)
    k, v = _randn(g, B, H, S, D), _randn(g, B, H, S, D)
    pos = torch.arange(S).expand(H, -1).clone()
    pos[1, 5:9] = -1
    plan = _plan([_segment(k, v, pos, dtype)], S=S, Q=Q, qpos=torch.arange(S - Q, S), causal=True,
                 window=20 if shape == "prefill" else None)
    _check(q, plan)


ROTARIES = {
    "rope1d-half": (lambda: Rope1D(D, theta=100.0), torch.float64, None),
    "rope1d-interleaved": (lambda: Rope1D(D, theta=100.0, style="interleaved"), torch.float32, "int4"),
    "frame": (lambda: FrameRope(Rope3D(D, 2, 2, max_frames=1 << 12)), torch.float32, "fp8"),
}


@pytest.mark.parametrize("map_name", list(POSITION_MAPS))
@pytest.mark.parametrize("rotary", list(ROTARIES))
def test_rope_at_read_through_a_ring(rotary, map_name):
    """A ring cache that stores raw keys and rotates them at read by each position map of the
    registry: the cache's own plan (queries rotated by the cache, keys in the kernel's registers),
    through wraps, causal; quantised rows (codes beside the full-precision sinks) for two rotaries."""
    make, dtype, fmt = ROTARIES[rotary]
    rot = make()
    tpu = rot.tokens_per_unit
    sink, window, chunk = 2 * tpu, 6 * tpu, 2 * tpu
    units = lambda t: t // tpu  # noqa: E731
    pm = position_map(map_name, **POSITION_MAPS[map_name].for_geometry(units(sink), units(sink + window),
                                                                     units(chunk)))
    rope = RopeAtRead(rot, pm)
    shape = (1, sink + window, H, D)
    cache = RingCache(shape, shape, seq_dim=1, sink=sink, window=window, chunk=chunk, dtype=dtype,
                      quant=None if fmt is None else KVQuant(fmt, group=8), rope_at_read=rope)
    g = torch.Generator().manual_seed(len(map_name))
    for c in range(6):  # past the first eviction: the ring wraps
        cache.begin_chunk(c)
        q, k, v = (_randn(g, 1, chunk, 2 * H, D).to(dtype) for _ in range(3))
        read = cache.layer(0).update(k[:, :, :H], v[:, :, :H])
        if c < 5:
            cache.commit_chunk(c)
    qt, plan = read.block_plan(q.transpose(1, 2), scale=D ** -0.5, causal=True, lse=True)
    assert plan.rotation is not None and len(plan.segments) == (1 if fmt is None else 2)
    _check(qt, plan, KernelConfig(splits=2))


def test_limbs_far_into_a_stream_and_float_maps():
    """Keys ``2^40`` positions before their queries (the angle's 18-bit limbs all in use) under the
    absolute map, and fractional rotation units from a custom map, on hand-built segments with
    per-head positions and holes, float64."""
    g = torch.Generator().manual_seed(9)
    S, Q = 21, 3
    far = 1 << 40
    q = _randn(g, B, H, Q, D)
    k, v = _randn(g, B, H, S, D), _randn(g, B, H, S, D)
    pos = torch.stack([torch.randperm(S, generator=g) * 5 for _ in range(H)])
    pos[1, 4] = -1
    qpos = torch.arange(far, far + Q)
    held = torch.cat([pos, qpos.expand(H, -1)], -1)
    for maps in ("absolute", position_map("custom", fn=POSITION_MAPS["custom"].for_geometry(0, 0, 0)["fn"])):
        rotation = _rotation(Rope1D(D), qpos, held, maps)
        assert rotation.key_units(pos).dtype == (torch.int64 if maps == "absolute" else torch.float64)
        segs = [_segment(k[..., :9, :], v[..., :9, :], pos[:, :9], torch.float64),
                _segment(k[..., 9:, :], v[..., 9:, :], pos[:, 9:], torch.float64, slots=9)]
        ref = _check(q, _plan(segs, S=S, Q=Q, rotation=rotation))
        assert torch.isfinite(ref.out).all()


def test_paged_rows_dense_and_codes():
    """Dense float64 rows and int2 codes (with their scales), each through a shuffled page table of 8
    rows (the last page partly used, a spare NaN page never referenced); statistics of every row."""
    g = torch.Generator().manual_seed(4)
    S, Q = 35, 4
    q = _randn(g, B, H, Q, D)
    k, v = _randn(g, B, H, S, D), _randn(g, B, H, S, D)
    pos = torch.arange(S).expand(H, -1).clone()
    pos[0, 13] = -1
    segs = [_segment(k[..., :20, :], v[..., :20, :], pos[:, :20], torch.float64, page=8, g=g),
            _segment(k[..., 20:, :], v[..., 20:, :], pos[:, 20:], torch.float64, fmt="int2", page=8, g=g, slots=20)]
    _check(q, _plan(segs, S=S, Q=Q, statistic=Statistic()))


@pytest.mark.parametrize("reduce", [("max",), ("sum",)])
def test_rows_that_are_no_slots_share_the_softmax_not_the_statistics(reduce):
    """A tier-like segment (int8 codes of rows outside the cache's slots, keys without the batch dim)
    beside the cache's rows: one softmax over both, statistics normalised over the slots only; a
    per-head slot map listing its rows backwards."""
    g = torch.Generator().manual_seed(5)
    S, T, Q = 18, 13, 4
    q = _randn(g, B, 2 * H, Q, D)
    k, v = _randn(g, B, H, S, D), _randn(g, B, H, S, D)
    kt, vt = _randn(g, H, T, D), _randn(g, H, T, D)
    pos = torch.arange(S).expand(H, -1).clone()
    pos[1, 3] = -1
    tier_pos = torch.stack([torch.randperm(T, generator=g) + 30 for _ in range(H)])
    tier_pos[0, 1] = -1
    slots = torch.arange(S).flip(0).expand(H, -1).clone()
    segs = [_segment(k.flip(-2), v.flip(-2), pos.flip(-1), torch.float64, slots=slots),
            _segment(kt, vt, tier_pos, torch.float64, fmt="int8", slots=None)]
    _check(q, _plan(segs, S=S, Q=Q, statistic=Statistic(rows=2, reduce=reduce)))


@pytest.mark.parametrize("layout", ["heads-first", "no-heads"])
def test_other_layouts(layout):
    """Heads as the first leading dim (``[H, B, S, D]``: K/V ``(H, S, B, D)``), and no head dim at all
    (``[B, S, D]``: one virtual head)."""
    g = torch.Generator().manual_seed(6)
    S, Q = 19, 3
    if layout == "heads-first":
        dims = Dims((H, S, B, D), (H, S, B, D), seq=1, head=0, slots=S, chunk=Q)
        q, k, v = _randn(g, 2 * H, B, Q, D), _randn(g, H, B, S, D), _randn(g, H, B, S, D)
        heads = H
    else:
        dims = Dims((B, S, D), (B, S, D), seq=1, head=None, slots=S, chunk=Q)
        q, k, v = _randn(g, B, Q, D), _randn(g, B, S, D), _randn(g, B, S, D)
        heads = 1
    pos = torch.arange(S).expand(heads, -1).clone()
    pos[0, 7] = -1
    segs = [_segment(k[..., :8, :], v[..., :8, :], pos[:, :8], torch.float64),
            _segment(k[..., 8:, :], v[..., 8:, :], pos[:, 8:], torch.float64, fmt="fp8", slots=8)]
    plan = BlockPlan(segs, dims, 0.25, torch.arange(S - Q, S), True, None, None, Statistic(), S, block=5, lse=True)
    _check(q, plan)


def test_decode_split_over_programs():
    """One decoding query of 3 grouped heads, two segments (dense, int4 codes in a signed-permutation
    basis of other value features), each split over 3 programs: 6 parts merged by their log-sum-exps."""
    g = torch.Generator().manual_seed(7)
    S, Q, Dv = 70, 1, 8
    q = _randn(g, B, 3 * H, Q, D).float()
    k, v = _randn(g, B, H, S, D), _randn(g, B, H, S, Dv)
    pos = torch.arange(S).expand(H, -1).clone()
    pos[:, 60:] = -1  # an unfilled tail
    basis = (_signed_permutation(D, g), _signed_permutation(Dv, g))
    segs = [_segment(k[..., :30, :], v[..., :30, :], pos[:, :30], torch.float32),
            _segment(k[..., 30:, :], v[..., 30:, :], pos[:, 30:], torch.float32, fmt="int4", basis=basis, slots=30)]
    plan = _plan(segs, S=S, Q=Q, Dv=Dv, qpos=torch.tensor([S]), causal=True, statistic=Statistic(reduce=("sum",)))
    _check(q, plan, KernelConfig(splits=3))


def test_a_query_that_sees_nothing_is_nan():
    """As SDPA and the reference: a row with no visible key has a NaN output and a -inf log-sum-exp."""
    g = torch.Generator().manual_seed(8)
    S, Q = 10, 2
    q = _randn(g, 1, H, Q, D)
    k, v = _randn(g, 1, H, S, D), _randn(g, 1, H, S, D)
    pos = torch.arange(5, 5 + S).expand(H, -1)
    dims = Dims((1, S, H, D), (1, S, H, D), seq=1, head=2, slots=S, chunk=Q)
    plan = BlockPlan([_segment(k, v, pos, torch.float64)], dims, 0.25, torch.tensor([4, 6]), True, None, None, None, S,
                     lse=True)
    got = _check(q, plan)
    assert got.out[:, :, 0].isnan().all() and torch.isfinite(got.out[:, :, 1]).all()
    assert torch.isneginf(got.lse[:, :, 0]).all()


def test_scored_quantised_cache_through_its_own_plan():
    """A TOVA cache with int8 codes and full-precision sinks: the read's own segments and statistic."""
    cache = KVCache((1, 16, H, D), (1, 16, H, D), seq_dim=1, sink=2, window=14, chunk=4, policy="tova",
                    dtype=torch.float32, quant=KVQuant("int8", group=8))
    g = torch.Generator().manual_seed(10)
    for c in range(5):
        cache.begin_chunk(c)
        q, k, v = (_randn(g, 1, 4, H, D).float() for _ in range(3))
        read = cache.layer(0).update(k, v)
        qt, plan = read.block_plan(q.transpose(1, 2), scale=0.25, causal=True, statistic=read.statistic, lse=True)
        assert plan.statistic is not None and len(plan.segments) == 2
        got = _check(qt, plan)
        read.scorer(got.key_max, got.key_sum)  # the policy ranks from the kernel's statistics
        cache.commit_chunk(c)


# ------------------------------------------------------------------------------------------ refusals
class _OddCodec(IntCodec):
    """An IntCodec subclass: it may decode differently, so the kernel does not claim it."""


class _OtherRotary(Rotary):
    head_dim = D


def test_why_not_refuses_with_the_reason(monkeypatch):
    g = torch.Generator().manual_seed(11)
    S, Q = 12, 2
    q = _randn(g, B, H, Q, D)
    k, v = _randn(g, B, H, S, D), _randn(g, B, H, S, D)
    pos = torch.arange(S).expand(H, -1)
    R = _signed_permutation(D, g)
    base = _plan([_segment(k, v, pos, torch.float64)], S=S, Q=Q)
    assert why_not(q, base) is None
    rotation = _rotation(Rope1D(D), torch.arange(S, S + Q), torch.cat([pos, torch.arange(S, S + Q).expand(H, -1)], -1))
    cases = {
        "storage basis with rotation at read": _plan([_segment(k, v, pos, torch.float64, fmt="int8", basis=(R, R))],
                                                     S=S, Q=Q, rotation=rotation),
        "decodes IntCodec": _plan([replace(_segment(k, v, pos, torch.float64, fmt="int4"), k_codec=_OddCodec(4))],
                                  S=S, Q=Q),
        "rotates Rope1D and FrameRope": _plan([_segment(k, v, pos, torch.float64)], S=S, Q=Q,
                                              rotation=SimpleNamespace(key_units=None, rotary=_OtherRotary())),
        "at least one key block": _plan([], S=S, Q=Q),
        "causal masks need": _plan([_segment(k, v, pos, torch.float64)], S=S, Q=Q, causal=True),
    }
    for reason, plan in cases.items():
        why = why_not(q, plan)
        assert why is not None and reason in why, (reason, why)
        with pytest.raises(ValueError, match="cannot serve"):
            triton_read(q, plan)
    wide = torch.zeros(1, 1, 1, 512, dtype=torch.float64)
    dims = Dims((1, 1, 1, 512), (1, 1, 1, 512), seq=1, head=2, slots=1, chunk=1)
    seg = Segment(n=1, positions=torch.zeros(1, 1, dtype=torch.long), keys=wide, values=wide, features=(512, 512),
                  dtype=torch.float64)
    assert "a tile holds at most" in why_not(wide, BlockPlan([seg], dims, 1.0))
    assert "dtype torch.int32" in why_not(q.int(), base)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "TRITON_INTERPRET=1" in why_not(q, base)


def test_the_package_imports_without_triton():
    """``import streamkv.kernels`` needs torch only: triton is imported when a kernel first runs."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = None; import streamkv.kernels as k; "
            "assert 'triton' in k.why_not(__import__('torch').zeros(1, 1), None)")
    env = {"PYTHONPATH": str(__import__("pathlib").Path(__file__).resolve().parents[1] / "src")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
