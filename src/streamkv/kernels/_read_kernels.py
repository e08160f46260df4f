"""The Triton kernels of :mod:`streamkv.kernels.triton_read` (imported by it on first use, never by
``import streamkv``: this module imports ``triton``, which is not a dependency of the package).

Three kernels, all over the *folded* rows of one key head: row ``m`` of key head ``h`` is query
head ``h * G + m // Q`` at query ``m % Q`` (grouped-query attention, :func:`streamkv.scoring.fold_groups`).
Every buffer the wrapper allocates (outputs, partials, log-sum-exps) is contiguous
``[R * H, G * Q, ...]`` (``R``: the other leading dims, e.g. the batch), so rows are addressed
flat; the inputs (queries, keys, codes, scales, positions) by their strides.

- :func:`attn_kernel`: one segment's key rows ``[lo, hi)`` (a split) against a tile of
  ``BLOCK_M`` rows, online softmax over ``BLOCK_N`` keys at a time: keys and values loaded through
  the page table, codes decoded in registers (int1/2/4/8 unpacked low bits first, fp8 e4m3 from
  its bits, times the group's bfloat16 scale), keys rotated in registers (RoPE at read: the
  angle from the key's rotation offset and the rotary's limb residues, or a per-token static
  band), masks from positions; the segment's value basis applied to its normalised output once.
  Writes a normalised partial output and its log-sum-exp, or (one part in all) the final output
  in the queries' dtype.
- :func:`merge_kernel`: the parts (segments x splits) combined by their log-sum-exps (the one
  softmax), the final output, its log-sum-exp and the log-sum-exp over the parts that are
  cache slots (the statistics' normaliser).
- :func:`stat_kernel`: one program per ``BLOCK_N`` keys of a segment and head: the key block
  decoded and rotated once, then every selected query row of every batch row and group
  against it; ``max`` and ``sum`` of ``p = exp(s - lse_own)`` per key (float64 sums).

Feature halves: the score ``q . k`` is computed as ``q_A . k_A + q_B . k_B`` over the two halves
of the channels that RoPE pairs (``"half"``: ``A = [0, D/2)``, ``B = [D/2, D)``; ``"interleaved"``:
``A`` even, ``B`` odd channels), so a rotation is two elementwise products per half, no
shuffle. Without rotation the ``"half"`` split is used (``D`` odd: ``A`` the first ``ceil(D/2)``).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: the mode the kernels below were jitted in (Triton fixes it at decoration)
INTERPRETED = bool(triton.knobs.runtime.interpret)


@triton.jit
def _fp8_e4m3(b):
    """int32 bytes -> float32 values of e4m3fn (exact; NaN for 0x7f / 0xff), by bit operations
    (portable: no fp8 type needed)."""
    e = (b >> 3) & 15
    mnt = b & 7
    sign = (b & 0x80) << 24
    normal = (sign | ((e + 120) << 23) | (mnt << 20)).to(tl.float32, bitcast=True)
    sub = mnt.to(tl.float32) * 0.001953125  # 2^-9
    sub = tl.where(b >= 0x80, -sub, sub)
    y = tl.where(e == 0, sub, normal)
    return tl.where((e == 15) & (mnt == 7), float("nan"), y)


@triton.jit
def _features(X, XS, x_off, s_off, sx_w, ss_g, c, cmask, rmask, CODEC: tl.constexpr, BITS: tl.constexpr,
              GROUP: tl.constexpr, OUT: tl.constexpr):
    """Channels ``c [C]`` of rows at offsets ``x_off [N]`` (codes) / ``s_off [N]`` (scales):
    ``[N, C]`` in ``OUT``. ``CODEC``: 0 dense rows (any float dtype), 1 ``IntCodec(BITS)``,
    2 ``Fp8Codec``; masked entries are 0."""
    m = rmask[:, None] & cmask[None, :]
    if CODEC == 0:
        x = tl.load(X + x_off[:, None] + c[None, :].to(tl.int64) * sx_w, mask=m, other=0.0).to(OUT)
    else:
        PER: tl.constexpr = 8 // BITS
        byte = tl.load(X + x_off[:, None] + (c // PER)[None, :].to(tl.int64) * sx_w, mask=m, other=0).to(tl.int32)
        s = tl.load(XS + s_off[:, None] + (c // GROUP)[None, :].to(tl.int64) * ss_g, mask=m, other=0.0)
        s = s.to(tl.float32)
        if CODEC == 1:
            LEVELS: tl.constexpr = (1 << BITS) - 1
            code = (byte >> ((c % PER) * BITS)[None, :]) & LEVELS
            y = (code.to(tl.float32) - LEVELS * 0.5) * s  # a half-integer of <= 9 bits times a bf16: exact
        else:
            y = _fp8_e4m3(byte) * s
        x = y.to(OUT)
    return x


@triton.jit
def _key_block(K, KS, sk_r, sk_h, sk_n, sk_w, sks_r, sks_h, sks_n, sks_g,
               POS, spos_h, spos_n, PAGES, UNITS, su_h, su_n, RES, HWC, HWS,
               r, h, kr, kok, ca, cb, cam, cbm,
               K_CODEC: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr, PAGE: tl.constexpr,
               ROTATE: tl.constexpr, FLOAT_UNITS: tl.constexpr, F_MOVE: tl.constexpr, NPAIR: tl.constexpr,
               NSTAT: tl.constexpr, TPU: tl.constexpr, LIMB: tl.constexpr, BLOCK_DH: tl.constexpr,
               ACC: tl.constexpr, KDT: tl.constexpr, QT: tl.constexpr):
    """Key rows ``kr [N]`` (logical rows of the segment; ``kok``: in range) of head ``h``, batch
    row ``r``: the two feature halves in the queries' dtype (decoded, rotated, rounded as the
    reference rounds them), the rows' positions and the physical row offsets."""
    pos = tl.load(POS + h * spos_h + kr.to(tl.int64) * spos_n, mask=kok, other=-1)
    if PAGE > 0:
        pg = tl.load(PAGES + kr // PAGE, mask=kok, other=0)
        phys = pg * PAGE + (kr % PAGE)
    else:
        phys = kr.to(tl.int64)
    k_off = r * sk_r + h * sk_h + phys * sk_n
    s_off = r * sks_r + h * sks_h + phys * sks_n
    if ROTATE:
        ka = _features(K, KS, k_off, s_off, sk_w, sks_g, ca, cam, kok, K_CODEC, K_BITS, K_GROUP, KDT).to(ACC)
        kb = _features(K, KS, k_off, s_off, sk_w, sks_g, cb, cbm, kok, K_CODEC, K_BITS, K_GROUP, KDT).to(ACC)
        j = tl.arange(0, BLOCK_DH)
        move = j < F_MOVE
        u = tl.load(UNITS + h * su_h + kr.to(tl.int64) * su_n, mask=kok, other=0)
        if FLOAT_UNITS:
            f = tl.load(RES + j, mask=move, other=0.0)
            ang = u.to(tl.float64)[:, None] * f[None, :]
        else:
            mag = tl.where(u < 0, -u, u)
            LMASK: tl.constexpr = (1 << LIMB) - 1
            c0 = (mag & LMASK).to(tl.float64)
            c1 = ((mag >> LIMB) & LMASK).to(tl.float64)
            c2 = (mag >> (2 * LIMB)).to(tl.float64)
            r0 = tl.load(RES + j, mask=move, other=0.0)
            r1 = tl.load(RES + F_MOVE + j, mask=move, other=0.0)
            r2 = tl.load(RES + 2 * F_MOVE + j, mask=move, other=0.0)
            ang = c0[:, None] * r0[None, :] + c1[:, None] * r1[None, :] + c2[:, None] * r2[None, :]
            ang = tl.where((u < 0)[:, None], -ang, ang)
        if ACC != tl.float64:  # reduced mod 2 pi in float64 first (streamkv.rotary.narrowed)
            ang = ang - 6.283185307179586 * tl.floor(ang / 6.283185307179586)
        ang = ang.to(ACC)
        cs = tl.cos(ang)
        sn = tl.sin(ang)
        if NSTAT > 0:  # FrameRope: the height/width bands from the token's place in its frame
            t = tl.maximum(pos, 0) % TPU
            st = (j >= F_MOVE) & (j < NPAIR)
            idx = t[:, None] * NSTAT + (j - F_MOVE)[None, :]
            sm = kok[:, None] & st[None, :]
            hc = tl.load(HWC + idx, mask=sm, other=1.0).to(ACC)
            hs = tl.load(HWS + idx, mask=sm, other=0.0).to(ACC)
            cs = tl.where(st[None, :], hc, cs)
            sn = tl.where(st[None, :], hs, sn)
        ra = ka * cs - kb * sn
        rb = ka * sn + kb * cs
        ka = ra.to(KDT).to(QT)
        kb = rb.to(KDT).to(QT)
    else:
        ka = _features(K, KS, k_off, s_off, sk_w, sks_g, ca, cam, kok, K_CODEC, K_BITS, K_GROUP, KDT).to(QT)
        kb = _features(K, KS, k_off, s_off, sk_w, sks_g, cb, cbm, kok, K_CODEC, K_BITS, K_GROUP, KDT).to(QT)
    return ka, kb, pos, phys


@triton.jit
def _halves(D: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_DH: tl.constexpr):
    """The channels of the two feature halves and their masks."""
    j = tl.arange(0, BLOCK_DH)
    if INTERLEAVED:
        ca = 2 * j
        cb = 2 * j + 1
    else:
        ca = j
        cb = HALF + j
    return ca, cb, (j < HALF) & (ca < D), (j < HALF) & (cb < D)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, UP: tl.constexpr, ACC: tl.constexpr):
    """``a @ b (+ acc)`` in ``ACC``. ``IEEE``: float32 / float64 operands in IEEE precision (not TF32). ``UP``:
    bfloat16 operands widened to float32 first (exact: the products of bfloat16 numbers are float32
    numbers, accumulated in float32 as the tensor cores do) -- for the interpreter, whose product of
    bfloat16 tensors multiplies their bit patterns."""
    if UP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee", out_dtype=ACC)
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee", out_dtype=ACC)
    else:
        return tl.dot(a, b, acc, out_dtype=ACC)


@triton.jit
def _scale(scale_hi, scale_mid, scale_lo, ACC: tl.constexpr):
    """The softmax scale in ``ACC``: a float64 passed as three float32 parts (exact in float64)."""
    return (tl.cast(scale_hi, ACC) + tl.cast(scale_mid, ACC)) + tl.cast(scale_lo, ACC)


@triton.jit
def attn_kernel(
    Q, sq_r, sq_h, sq_q, sq_d,
    K, sk_r, sk_h, sk_n, sk_w, KS, sks_r, sks_h, sks_n, sks_g,
    V, sv_r, sv_h, sv_n, sv_w, VS, svs_r, svs_h, svs_n, svs_g,
    POS, spos_h, spos_n, PAGES, QPOS, UNITS, su_h, su_n, RES, HWC, HWS, VB,
    O, L, part,
    n, Qn, G, H, window, keys_per_split,
    scale_hi, scale_mid, scale_lo,
    D: tl.constexpr, DV: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DH: tl.constexpr, BLOCK_DV: tl.constexpr,
    K_CODEC: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr,
    V_CODEC: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr, PAGE: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    ROTATE: tl.constexpr, FLOAT_UNITS: tl.constexpr, F_MOVE: tl.constexpr, NPAIR: tl.constexpr,
    NSTAT: tl.constexpr, TPU: tl.constexpr, LIMB: tl.constexpr, V_BASIS: tl.constexpr,
    ACC: tl.constexpr, KDT: tl.constexpr, VDT: tl.constexpr, QT: tl.constexpr, IEEE: tl.constexpr, UP: tl.constexpr,
):
    """Grid ``(cdiv(G * Q, BLOCK_M), R * H, splits)``: one tile of folded rows against the key
    rows ``[split * keys_per_split, ...)`` of one segment. Writes part ``part + split``: the
    normalised output (basis applied) at ``O`` and the log-sum-exp at ``L`` (flat rows)."""
    pid_m = tl.program_id(0)
    pid_rh = tl.program_id(1).to(tl.int64)
    pid_s = tl.program_id(2)
    r = pid_rh // H
    h = pid_rh % H
    GQ = G * Qn
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GQ
    qi = rows % Qn
    hq = h * G + rows // Qn
    ca, cb, cam, cbm = _halves(D, HALF, INTERLEAVED, BLOCK_DH)
    q_off = r * sq_r + hq.to(tl.int64) * sq_h + qi.to(tl.int64) * sq_q
    qm = row_ok[:, None]
    qa = tl.load(Q + q_off[:, None] + ca[None, :] * sq_d, mask=qm & cam[None, :], other=0.0).to(QT)
    qb = tl.load(Q + q_off[:, None] + cb[None, :] * sq_d, mask=qm & cbm[None, :], other=0.0).to(QT)
    if CAUSAL:
        qp = tl.load(QPOS + qi, mask=row_ok, other=0)
    scale = _scale(scale_hi, scale_mid, scale_lo, ACC)
    dv = tl.arange(0, BLOCK_DV)
    dvm = dv < DV
    m_i = tl.full([BLOCK_M], float("-inf"), ACC)
    l_i = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], ACC)
    lo = pid_s * keys_per_split
    hi = tl.minimum(n, lo + keys_per_split)
    for start in range(lo, hi, BLOCK_N):
        kr = start + tl.arange(0, BLOCK_N)
        kok = kr < hi
        ka, kb, pos, phys = _key_block(
            K, KS, sk_r, sk_h, sk_n, sk_w, sks_r, sks_h, sks_n, sks_g, POS, spos_h, spos_n, PAGES, UNITS, su_h,
            su_n, RES, HWC, HWS, r, h, kr, kok, ca, cb, cam, cbm, K_CODEC, K_BITS, K_GROUP, PAGE, ROTATE,
            FLOAT_UNITS, F_MOVE, NPAIR, NSTAT, TPU, LIMB, BLOCK_DH, ACC, KDT, QT)
        s = _dot(qb, tl.trans(kb), _dot(qa, tl.trans(ka), None, IEEE, UP, ACC), IEEE, UP, ACC)
        s = s * scale
        dead = (pos < 0) | (kr >= hi)
        hidden = dead[None, :]
        if CAUSAL:
            hidden = hidden | (pos[None, :] > qp[:, None])
            if WINDOW:
                hidden = hidden | (pos[None, :] <= qp[:, None] - window)
        s = tl.where(hidden, float("-inf"), s)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - safe)
        p = tl.exp(s - safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = r * sv_r + h * sv_h + phys * sv_n
        vs_off = r * svs_r + h * svs_h + phys * svs_n
        v = _features(V, VS, v_off, vs_off, sv_w, svs_g, dv, dvm, kok, V_CODEC, V_BITS, V_GROUP, VDT)
        v = tl.where(dead[:, None], 0.0, v.to(QT))  # a hidden row weighs 0, whatever it holds
        acc = _dot(p.to(QT), v, acc * alpha[:, None], IEEE, UP, ACC)
        m_i = m_new
    safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = safe + tl.log(l_i)
    o = acc / l_i[:, None]  # 0/0 = NaN where the part sees nothing (its lse is -inf: weight 0)
    if V_BASIS:  # the segment's output leaves its storage basis once: o @ R
        rb = tl.load(VB + dv[:, None] * DV + dv[None, :], mask=dvm[:, None] & dvm[None, :], other=0.0).to(ACC)
        if ACC == tl.float64:
            o = tl.dot(o, rb, input_precision="ieee", out_dtype=ACC)
        else:  # three TF32 products: float32's accuracy on the tensor cores
            o = tl.dot(o, rb, input_precision="tf32x3", out_dtype=ACC)
    flat = (part + pid_s).to(tl.int64) * tl.num_programs(1) * GQ + pid_rh * GQ + rows
    tl.store(O + flat[:, None] * DV + dv[None, :], o.to(O.dtype.element_ty), mask=qm & dvm[None, :])
    tl.store(L + flat, lse.to(L.dtype.element_ty), mask=row_ok)


@triton.jit
def merge_kernel(OP, LP, P, P_OWN, O, LOUT, LOWN, RHGQ,
                 DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, OWN: tl.constexpr,
                 ACC: tl.constexpr):
    """Grid ``(cdiv(R * H * G * Q, BLOCK_M),)``: the ``P`` parts of every row (normalised outputs
    ``OP [P, RHGQ, DV]``, log-sum-exps ``LP [P, RHGQ]``; the first ``P_OWN`` are cache slots)
    combined by their log-sum-exps into ``O`` (the queries' dtype), ``LOUT`` and, with ``OWN``,
    ``LOWN`` (the log-sum-exp of the first ``P_OWN`` parts)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = rows < RHGQ
    dv = tl.arange(0, BLOCK_DV)
    om = ok[:, None] & (dv < DV)[None, :]
    mx = tl.full([BLOCK_M], float("-inf"), ACC)
    sm = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], ACC)
    for p in range(0, P):
        lp = tl.load(LP + p * RHGQ + rows, mask=ok, other=float("-inf")).to(ACC)
        op = tl.load(OP + (p * RHGQ + rows)[:, None] * DV + dv[None, :], mask=om, other=0.0).to(ACC)
        mn = tl.maximum(mx, lp)
        safe = tl.where(mn == float("-inf"), 0.0, mn)
        a = tl.exp(mx - safe)
        b = tl.exp(lp - safe)
        acc = acc * a[:, None] + tl.where((lp > float("-inf"))[:, None], op * b[:, None], 0.0)
        sm = sm * a + b
        mx = mn
        if OWN:
            if p == P_OWN - 1:
                tl.store(LOWN + rows, (tl.where(mx == float("-inf"), 0.0, mx) + tl.log(sm)).to(LOWN.dtype.element_ty),
                         mask=ok)
    safe = tl.where(mx == float("-inf"), 0.0, mx)
    tl.store(O + rows[:, None] * DV + dv[None, :], (acc / sm[:, None]).to(O.dtype.element_ty), mask=om)
    tl.store(LOUT + rows, (safe + tl.log(sm)).to(LOUT.dtype.element_ty), mask=ok)


@triton.jit
def stat_kernel(
    Q, sq_r, sq_h, sq_q, sq_d,
    K, sk_r, sk_h, sk_n, sk_w, KS, sks_r, sks_h, sks_n, sks_g,
    POS, spos_h, spos_n, PAGES, QPOS, UNITS, su_h, su_n, RES, HWC, HWS,
    LSE, KMAX, KSUM,
    n, Qn, G, H, R, rows_sel, window,
    scale_hi, scale_mid, scale_lo,
    D: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DH: tl.constexpr,
    K_CODEC: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr, PAGE: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    ROTATE: tl.constexpr, FLOAT_UNITS: tl.constexpr, F_MOVE: tl.constexpr, NPAIR: tl.constexpr,
    NSTAT: tl.constexpr, TPU: tl.constexpr, LIMB: tl.constexpr,
    ACC: tl.constexpr, KDT: tl.constexpr, QT: tl.constexpr, IEEE: tl.constexpr, UP: tl.constexpr,
    DO_MAX: tl.constexpr, DO_SUM: tl.constexpr,
):
    """Grid ``(cdiv(n, BLOCK_N), H)``: per key row of the segment and head, ``max`` / ``sum`` of
    ``p = exp(s - LSE)`` over the newest ``rows_sel`` query rows of every group and batch row
    (``LSE``: the log-sum-exp over the cache's slots, flat ``[R * H, G * Q]``); ``KMAX`` /
    ``KSUM``: float64 ``[H, n]``."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    kr = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kok = kr < n
    ca, cb, cam, cbm = _halves(D, HALF, INTERLEAVED, BLOCK_DH)
    scale = _scale(scale_hi, scale_mid, scale_lo, ACC)
    kmax = tl.zeros([BLOCK_N], ACC)
    ksum = tl.zeros([BLOCK_N], tl.float64)
    T = G * rows_sel
    GQ = G * Qn
    for r in range(0, R):
        r64 = tl.cast(r, tl.int64)
        ka, kb, pos, phys = _key_block(
            K, KS, sk_r, sk_h, sk_n, sk_w, sks_r, sks_h, sks_n, sks_g, POS, spos_h, spos_n, PAGES, UNITS, su_h,
            su_n, RES, HWC, HWS, r64, h, kr, kok, ca, cb, cam, cbm, K_CODEC, K_BITS, K_GROUP, PAGE, ROTATE,
            FLOAT_UNITS, F_MOVE, NPAIR, NSTAT, TPU, LIMB, BLOCK_DH, ACC, KDT, QT)
        dead = (pos < 0) | (kr >= n)
        for t0 in range(0, T, BLOCK_M):
            t = t0 + tl.arange(0, BLOCK_M)
            tok = t < T
            g = t // rows_sel
            qi = Qn - rows_sel + t % rows_sel
            hq = h * G + g
            q_off = r64 * sq_r + hq.to(tl.int64) * sq_h + qi.to(tl.int64) * sq_q
            qa = tl.load(Q + q_off[:, None] + ca[None, :] * sq_d, mask=tok[:, None] & cam[None, :], other=0.0).to(QT)
            qb = tl.load(Q + q_off[:, None] + cb[None, :] * sq_d, mask=tok[:, None] & cbm[None, :], other=0.0).to(QT)
            s = _dot(qb, tl.trans(kb), _dot(qa, tl.trans(ka), None, IEEE, UP, ACC), IEEE, UP, ACC)
            s = s * scale
            hidden = dead[None, :] | (~tok)[:, None]
            if CAUSAL:
                qp = tl.load(QPOS + qi, mask=tok, other=0)
                hidden = hidden | (pos[None, :] > qp[:, None])
                if WINDOW:
                    hidden = hidden | (pos[None, :] <= qp[:, None] - window)
            lse = tl.load(LSE + (r64 * H + h) * GQ + g * Qn + qi, mask=tok, other=0.0).to(ACC)
            # a row whose lse is not finite gives its finite scores 0 and a NaN one NaN, as the block
            # loop: such a row only arises without the finiteness checks (a NaN or inf key it sees)
            lse = tl.where((lse == lse) & (tl.abs(lse) < float("inf")), lse, float("inf"))
            p = tl.minimum(tl.exp(s - lse[:, None]), 1.0, propagate_nan=tl.PropagateNan.ALL)
            p = tl.where(hidden, 0.0, p)
            if DO_MAX:  # a NaN probability is the key's maximum, as torch's amax
                nan_seen = tl.max((p != p).to(tl.int32), 0) > 0
                kmax = tl.maximum(kmax, tl.where(nan_seen, float("nan"), tl.max(p, 0)),
                                  propagate_nan=tl.PropagateNan.ALL)
            if DO_SUM:
                ksum += tl.sum(p.to(tl.float64), 0)
    if DO_MAX:
        tl.store(KMAX + h * n + kr, kmax.to(tl.float64), mask=kok)
    if DO_SUM:
        tl.store(KSUM + h * n + kr, ksum, mask=kok)
