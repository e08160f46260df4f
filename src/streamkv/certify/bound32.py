"""The compressed tier's certificate in float32: every ``O(history)`` step (logits, exponentials,
the weighted sums) in float32 with a proven outward margin for its rounding; only per-query
quantities (``O(Q x Dv)``) are finished in float64. No float64 pass over the history.

It bounds, per query and value channel, ``|o - o_hat|``: ``o`` full-history attention over the
*original* K/V (exact arithmetic), ``o_hat`` the certificate's own output (``out_kept``), an
attention over what tiers 1 and 2 hold (tier 2 as decoded). For one query ``q`` of one head:

- kept ``K`` = tier 1 (exact rows) and the live tier-2 entries (stored ``k^_j, v^_j``, original
  ``k_j = k^_j + a_j``, ``v_j = v^_j + b_j``; ``a = b = 0`` on tier 1); held logits
  ``s^_j = scale q . k^_j``, ``L^ = logsumexp_K s^``, ``p^_j = exp(s^_j - L^)``,
  ``o^ = sum_K p^_j v^_j``; ``u_j = v^_j - o^``.
- per entry the logit slack ``Delta_j = scale sum_i |q_i| dk_j,i >= |delta_j|``,
  ``delta_j = s_j - s^_j = scale q . a_j`` (``dk``: the format's per-element bound, one number per
  group of channels for the integer formats), and ``|b_j,c| <= dv_j,c``.
- evicted ``D`` = tier 3: blocks with a box ``[lo_b, hi_b]`` of their *original* keys and a count
  ``n_b``; the evicted values in ``[vlo, vhi]``.

**The bound in exact arithmetic** (each step with its reason):

1. ``lambda = L - L^`` (``L = logsumexp_K s``) equals ``log sum_K p^_j e^{delta_j}``, so
   ``lambda <= Lam := log(1 + sum_K p^_j phi(Delta_j))`` (``phi(x) = e^x - 1``, monotone) and
   ``lambda >= -Lam_lo := log sum_K p^_j e^{-Delta_j}``; ``Lam_lo <= sum p^_j Delta_j <= Lam``
   (Jensen), so ``|lambda| <= Lam``.
2. ``p_j = p^_j exp(delta_j - lambda)``; per channel ``c``, since ``sum p = sum p^ = 1`` and
   ``sum_K p^_j u_j,c = 0``::

       o_K,c - o^_c = sum_j (p_j - p^_j) u_j,c + sum_j p_j b_j,c
                    = sum_j p^_j delta_j u_j,c + sum_j p^_j R(delta_j - lambda) u_j,c + sum_j p_j b_j,c

   (``e^x - 1 = x + R(x)``; the ``-lambda sum_j p^_j u_j,c`` term is 0). With
   ``|R(x)| <= x^2 / 2 e^{|x|}``, ``(delta_j - lambda)^2 / 2 <= Delta_j^2 + Lam^2`` and
   ``p_j <= p^_j e^{Delta_j + Lam}``: ``|o_K,c - o^_c| <= E1_c`` with::

       E1_c = sum_j p^_j Delta_j |u_j,c|                                          (first order)
            + e^Lam sum_j p^_j (Delta_j^2 + Lam^2) e^{Delta_j} |u_j,c|             (remainder)
            + e^Lam sum_j p^_j e^{Delta_j} dv_j,c                                  (the value slack)

   The first-order term replaces :mod:`.quant_bound` step 3's ``g_j``, which charges each key slack
   twice (``Delta_j`` and ``|lambda|``) where the slack is small. Where it is not (the remainder
   grows like ``e^{2 Delta}``), step 3's own form holds too: ``|p_j - p^_j| <= p^_j g_j``,
   ``g_j = max(e^{Delta_j + Lam_lo} - 1, 1 - e^{-Delta_j - Lam})``, so ``|o_K,c - o^_c| <= E0_c :=
   sum_j p^_j g_j |u_j,c| + e^{Lam_lo} sum_j p^_j e^{Delta_j} dv_j,c``. And ``o_K,c`` is a mean of
   original kept values: ``|o_K,c - o^_c| <= max_j |u_j,c| + max_j dv_j,c``. ``E_c`` = the least of
   the three.
3. ``|u_j,c|`` for every ``(query, entry, channel)`` would be ``O(Q x M x Dv)``; instead, for any
   reference ``r_c``, ``|u_j,c| <= |v^_j,c - r_c| + |r_c - o^_c|``, one matrix product (``r``: the
   last step's mean output, per head and channel), except for each head's ``top`` entries of
   largest ``max_q p^_j Delta_j``, where the exact ``|v^_j,c - o^_c|`` is used (any set of entries
   is valid, per query even: it is chosen per block of queries, over that block).
4. Tier 3 (:mod:`.bound` steps 1-3, boxes of the originals, so ``Delta_D = 0``):
   ``s_j <= U_b = scale (q+ . hi_b - q- . lo_b)`` (``q+ = max(q, 0)``, ``q- = max(-q, 0)``: the
   endpoint form of ``max(q_i lo_i, q_i hi_i)``, no centre/radius rounding), ``Z_D <= Z_hat =
   sum_b n_b e^{U_b}``, ``L >= L^ - Lam_lo``, ``m <= m' = Z_hat / (e^{L^ - Lam_lo} + Z_hat)``.
5. ``o - o_K = m (o_D - o_K)``, ``o_D,c`` in ``[vlo_c, vhi_c]``, ``o_K,c`` within ``E_c`` of ``o^_c``:
   ``|o_c - o^_c| <= m' gap_c + E_c``, ``gap_c = max(vhi_c - o^_c, o^_c - vlo_c) + E_c``.

**Rounding (float32, u = 2^-24)**. Assumptions, stated: every float32 ``+ - x /`` and every
product or sum inside a matrix product obeys the standard model ``fl(x op y) = (x op y)(1 + t)``,
``|t| <= u`` (round to nearest; the *order* of a sum is free: Higham's ``|fl(sum x_i) - sum x_i|
<= gamma(n) sum |x_i|``, ``gamma(n) = n u / (1 - n u)``, holds for every order and with fused
multiply-adds); float32 ``exp``, ``expm1`` and ``log`` are within ``4u`` relative of the exact
value (libm, SLEEF and CUDA document 1-2 ulp); underflow costs at most ``2^-126`` absolute per
term. Inputs wider than float32 (a float64 tier 1) are rounded once (relative ``u``, counted).
Tiers 1 and 2 are read as one run of ``S`` rows (each sum over them may be taken in parts: the order of
a sum is free).

a. Logits ``s_hat_j = fl(q_s . k^_j)``, ``q_s = fl(scale q)``: ``|s_hat_j - s^_j| <= e_s :=
   gamma(D + 3) A_q``, ``A_q >= sum_i |q_s,i| |k_j,i|`` for every row (``min(||q_s|| max_j ||k_j||,
   sum_i |q_s,i| max_j |k_j,i|)``, rounded up), the ``+3``: the scaling and two input roundings.
b. ``t = fl(s_hat - max)``, ``E = fl(exp t)``, ``S_hat = fl(sum E)``: each ``E_j = exp(s_hat_j -
   max) e^{theta_j}``, ``|theta_j| <= zeta := 2.1 u A_q + 4.1 u``; ``S_hat`` within ``gamma(S) +
   S 2^-126`` relative (the row maximum contributes ``E = 1`` exactly, so ``S_hat >= 1``).
   Hence ``|L_hat - L^| <= e_L := e_s + zeta + 1.01 gamma(S) + S 2^-125 + 2^-40``.
c. Normalised computed weights ``p~_j`` satisfy ``|log(p~_j / p^_j)| <= eta := 2 (e_s + zeta)``.
   ``o_hat = r + fl(E @ (v - r)) / S_hat``: since ``sum p~ = sum p^ = 1``, ``o_hat_c - o^_c =
   sum_j (p~_j - p^_j)(v_j,c - r_c)`` + the products' and the division's rounding, so
   ``|o_hat_c - o^_c| <= eps_o,c := (e^eta - 1 + 2.2 gamma(S) + 2u) sum_j p^_j |v_j,c - r_c|``
   (+ ``u |v|`` for a wide tier 1), the sum bounded from the computed one as in d.
d. ``P_j = E_j / S_hat`` satisfies ``|log(P_j / p^_j)| <= eta2 := e_s + e_L + zeta + 4.1 u``.
   ``Delta_hat`` is computed as a sum of non-negative terms times ``1 + 2 gamma(D + 6)`` (covering
   ``q_s`` vs ``scale q``, the sum and the product), so ``Delta_hat >= Delta``; every slack sum is
   a float32 sum of ``<= S`` products of non-negative factors, each computed factor at least its
   exact value times ``1 - 8u``, so ``exact <= computed e^{eta2} / ((1 - 8u)(1 - gamma(S + 2)))``
   plus ``S 2^-125 (1 + Delta_max)^2 e^{Delta_max}`` per unit weight (underflow). ``e^Delta - 1``
   is summed with ``5u e^Delta`` added per term. Step 2's ``g_j`` is computed from float32 ``exp``
   as ``max(fl(e^x) - 1, 1 - fl(e^-y)) + 6u fl(e^x)`` (``x = Delta_j + Lam_lo``, ``y = Delta_j +
   Lam``): ``fl(e^x) - 1`` is exact where ``fl(e^x) <= 2`` (Sterbenz) and within ``u`` relative
   beyond, so each branch is within ``5u e^x`` of its exact value and the pad makes the sum at least
   ``(1 - u)`` times the exact ``g_j``: no accurate ``expm1`` is assumed (a compiled one may be
   ``exp - 1``). On tier 1 (``Delta = 0``: ``w3 = P``, ``g_j = g``) the sum ``sum_j E_j |v_j - r|``
   is scaled by ``1 / S_hat`` (and by ``g``) once: at most two more roundings, within the
   ``gamma(S + 2)`` of every slack sum. The top replacement of step 3 subtracts sums:
   its absolute rounding, at most ``(gamma(S) + 2 gamma(t) + 4u)`` times the relaxed sum, is
   added. ``o^`` in ``|u_j,c|`` and the gap is replaced by ``o_hat +- eps_o``.
e. Tier 3: ``U_hat`` is one float32 product of length ``2D`` (``[q_s+, q_s-] . [hi, -lo]``):
   ``|U_hat_b - U_b| <= gamma(2D + 3) A3_q``; its log-sum-exp with ``log n_b`` errs as in b, plus
   ``4u log n``. ``log m'`` is finished in float64 from ``log Z_hat + margin`` and
   ``L_hat - e_L - Lam_lo`` (``x -> x - logaddexp(y, x)`` increases in ``x``, decreases in ``y``).
f. On a CPU that multiplies bfloat16 natively (:func:`bf16_products_fast`) the slack sums of (d)
   over tier 2 (``sum_j w_j |v_j - r|`` for ``w1, w2, w3, g``, ``sum_j P_j e^Delta_j dv_j``) and
   tier 1's ``sum_j P_j |v_j - r|`` are products of bfloat16 factors (each factor rounded to
   nearest: ``>= (1 - 2^-8)`` times its float32 value), accumulated in float32 (the products of two
   bfloat16 numbers are exact there; the same ``gamma`` as (d)), the result rounded to bfloat16,
   then multiplied by ``1.0119 >= 1 / (1 - 2^-8)^3`` (with room for that product's rounding): each
   term of the inflated sum is at least the term of float32 factors, so every statement of (d)
   holds of it, and step 3's exact terms (float32 factors) are subtracted from a sum that holds
   them. Underflow: ``2^-134`` absolute per bfloat16 factor and result, ``S 2^-125 (2 max|v| + the
   weights' sum + 1)`` added. Elsewhere these sums stay float32 (CUDA: a bfloat16 product may
   reduce in bfloat16; a CPU without bfloat16 instructions emulates it slower). Every float32
   product assumes IEEE float32 arithmetic: ``torch.get_float32_matmul_precision()`` other than
   ``"highest"`` is refused.

The margin ``eps_o`` is about ``4 (D + 3) u A_q`` times the mean ``|v - r|``: ``~1e-4`` of it for
``A_q ~ 30``, ``D = 64``; beside a quantisation slack it is small, but where the truth is at the
float level (nothing evicted) it *is* the certificate. Scope: as :mod:`.quant_bound` (the step's
inputs, finite stored values; a non-finite input gives the trivial mass bound and an infinite
error bound).

Why one module: it holds the proof of the float32 certificate and its rounding margin next to the code
the proof is about (the code's comments name the step or rounding each part computes).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..compiled import compile_kernel, may_compile
from .bound import Certificate

__all__ = ["U32", "gamma32", "TierHeld", "bf16_products_fast", "certify_tier", "check_precision"]

#: unit roundoff of float32 (round to nearest)
U32 = 2.0**-24
#: the relative accuracy assumed of float32 exp and log
EXP_REL = 4.0 * U32
_TINY = 2.0**-125  # underflow allowance per term (2^-126 absolute, doubled)
_F64 = 2.0**-40  # float64 finishing (each op 2^-53 relative; a few hundred ops at most)
#: rounding f: a slack sum of bfloat16 factors, its result rounded to bfloat16, is multiplied by this
#: (>= 1 / (1 - 2^-8)^3 = 1.011812, with room for the float32 product's own rounding)
INFLATE = 1.0119
#: take the slack sums in bfloat16 products on a CPU that multiplies bfloat16 natively (rounding f;
#: 2.8x the float32 products on one with AVX512-BF16)
BF16_SLACK = True


@functools.cache
def bf16_products_fast() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (AVX512-BF16 or AMX tiles). Elsewhere
    (an AVX2 machine) the product is emulated: 7.6x *slower* than float32 at a 4,680 x 17,160 x 128
    product on one here, so the slack sums stay float32 there."""
    cpu = torch.cpu
    return any(bool(getattr(cpu, name, lambda: False)()) for name in ("_is_avx512_bf16_supported",
                                                                          "_is_amx_tile_supported"))


def gamma32(n: float | Tensor):
    """Higham's ``gamma(n) = n u / (1 - n u)`` for float32."""
    return n * U32 / (1 - n * U32)


@dataclass
class TierHeld:
    """What one layer of a compressed tier holds, as the certificate reads it.

    ``k1 [B, H, S1, D]``, ``v1``: tier 1 (float32: exact, or rounded from a wider dtype: ``wide``);
    ``hide1 [H, Q|1, S1]`` (True: not attended by that query). ``k2, v2 [B, H, M, D|Dv]``: tier 2
    decoded (exact float32); ``live2 [H, M]``; ``dk2 [B, H, M, nk]`` / ``dv2 [B, H, M, nv]``: the
    per-element error bounds, constant over groups of ``D / nk`` (``Dv / nv``) channels.
    ``lo, hi [B, H, NB, D]`` (float32), ``logn [1|B, H, NB]`` (float32, ``-inf``: not in tier 3 now),
    ``vlo, vhi [B, H, Dv]``: tier 3 (bounds of the originals)."""

    k1: Tensor
    v1: Tensor
    hide1: Tensor
    k2: Tensor
    v2: Tensor
    live2: Tensor
    dk2: Tensor
    dv2: Tensor
    lo: Tensor
    hi: Tensor
    logn: Tensor
    vlo: Tensor
    vhi: Tensor
    wide: bool = False


def _weights(s1: Tensor, hide1: Tensor, s2: Tensor, dead2: Tensor, da: Tensor, db: Tensor, eta2: Tensor,
             consts: Tensor, low: bool, count: Tensor | None = None) -> tuple[Tensor | None, ...]:
    """One block of query rows' ``O(rows x S)`` float32 work (rounding b-d): the held attention's
    exponentials and the slack weights, from the logits ``s1 = q_s k1^T`` (tier 1) and ``s2``
    (tier 2), ``Delta_hat = da * db`` over tier 2 (``Delta = 0`` on tier 1). ``consts``: float64
    ``[kappa's denominator, S 2^-125, gamma(S + 2) + 8u]``. Returns ``e1, e2`` (the exponentials),
    with ``low`` ``W`` and tier 1's weights ``P`` in bfloat16 (else None, None), ``W [B, H, 4 rows, M]`` (tier 2's ``w1, w2,
    w3, wg`` stacked by rows), the column maximum of ``w1`` (each entry's largest
    ``p^_j Delta_j``) and per row: ``lse, inv`` (float64 ``1 / S_hat``), the sums of ``w1, w2,
    w3, wg``, ``Lam, Lam_lo``, the largest ``Delta``, ``kappa``, the underflow allowance, and
    ``g`` on tier 1 (``f32 [B, H, rows, 1]``); last, with ``count [rows, 1]`` (1: the row counts,
    0: not), tier 1's weights normalised over tier 1 alone, as a read's statistics (a policy ranks
    its slots as if tier 2 were not there), over the counted rows: their maximum and sum per entry
    (``[B, H, S1]``) and the rows' log-sum-exp over tier 1 (``[B, H, rows]``), else three None; and
    the rows' log-sum-exp as a read gives it (NaN or +inf where a seen score is)."""
    f32 = torch.float32
    s1 = s1.masked_fill(hide1, -math.inf)
    s2 = s2.masked_fill(dead2, -math.inf)
    mb = torch.maximum(s1.amax(-1, keepdim=True), s2.amax(-1, keepdim=True))
    seen = torch.isfinite(mb)
    m0 = torch.where(seen, mb, 0.0)
    e1, e2 = torch.exp(s1 - m0), torch.exp(s2 - m0)
    sum64 = (e1.sum(-1, keepdim=True) + e2.sum(-1, keepdim=True)).double()  # S_hat: one float32 sum of S terms
    lse = torch.where(seen, mb.double() + torch.log(sum64), -math.inf).squeeze(-1)
    inv = torch.where(seen, 1.0 / sum64, 0.0)
    invf = inv.to(f32)
    p2 = e2 * invf
    delta = da * db  # [B, H, rows, M]
    ed = torch.exp(delta)
    w1 = p2 * delta
    w3 = p2 * ed
    w2 = w1 * delta * ed
    p1 = e1 * invf
    p1sum = p1.sum(-1)
    dmax = delta.amax(-1).double().clamp(min=0.0)  # tier 1's Delta = 0 is among the rows
    w1sum, w2sum = w1.sum(-1).double(), w2.sum(-1).double()
    w3sum = (p1sum + w3.sum(-1)).double()  # e^Delta = 1 on tier 1
    lsum = (p2 * (ed - 1.0)).sum(-1).double()  # sum P phi(Delta), each term within 5u e^Delta P
    kappa = torch.exp(eta2) / consts[0]
    under = consts[1] * (1.0 + dmax) ** 2 * torch.exp(dmax)
    lam_b = torch.log1p((lsum + 5.0 * U32 * w3sum) * kappa + under) * (1.0 + _F64)
    lam_lo = (eta2 + consts[2] - torch.log((p1sum + (p2 / ed).sum(-1)).double())).clamp(min=0.0)
    lam_lo = torch.minimum(lam_lo, lam_b)  # both bound -lambda
    lo32 = (lam_lo * (1 + 8 * U32)).to(f32).unsqueeze(-1)
    lb32 = (lam_b * (1 + 8 * U32)).to(f32).unsqueeze(-1)
    # step 2's zeroth-order weights g_j = max(e^{Delta_j + Lam_lo} - 1, 1 - e^{-Delta_j - Lam}), from exp
    # with a pad (rounding d; a compiled expm1 may be exp - 1)
    g, g0 = _zeroth(delta + lo32, -delta - lb32), _zeroth(lo32, -lb32)  # g0: at Delta = 0 (tier 1)
    wg = p2 * g
    wgsum = (p1sum * g0.squeeze(-1) + wg.sum(-1)).double()
    W = torch.cat([w1, w2, w3, wg], -2)
    low_p = (W.to(torch.bfloat16), p1.to(torch.bfloat16)) if low else (None, None)
    stat = (None, None, None)
    if count is not None:
        # a read's statistics: tier 1 normalised alone, by its own maximum (a NaN or +inf score
        # spoils its row as in a read, a row that sees no tier-1 slot gives 0, tier 2 plays no part)
        m1 = s1.amax(-1, keepdim=True)
        m1 = torch.where(torch.isfinite(m1), m1, 0.0)
        f1 = torch.exp(s1 - m1)
        own = f1.sum(-1, keepdim=True)
        pc = torch.where((count > 0) & (own != 0), f1 / own, 0.0)
        stat = (pc.amax(-2), pc.sum(-2), (m1 + torch.log(own)).squeeze(-1).double())
    # the log-sum-exp as a read gives it: NaN or +inf where a seen score is (the certificate's own
    # is -inf there: it bounds nothing in such a row)
    odd = torch.isnan(mb) | (mb == math.inf)
    lse_read = torch.where(odd, mb.double(), lse.unsqueeze(-1)).squeeze(-1)  # [B, H, rows]
    return (e1, e2, W, *low_p, w1.amax(-2), lse, inv, w1sum, w2sum, w3sum, wgsum, lam_b, lam_lo, dmax, kappa, under,
            g0, *stat, lse_read)


def _zeroth(x: Tensor, y: Tensor) -> Tensor:
    """``max(e^x - 1, 1 - e^y)`` (``x >= 0 >= y``) from float32 ``exp``, padded by ``6u fl(e^x)``:
    at least ``(1 - u)`` times the exact value (rounding d), whichever way ``expm1`` is evaluated."""
    ex = torch.exp(x)
    return torch.maximum(ex - 1.0, 1.0 - torch.exp(y)) + (6.0 * U32) * ex


#: a block of query rows holds about this many ``[rows x S]`` float32 elements per tensor (on the
#: CPU: its tensors stay in the caches; elsewhere a larger block)
BLOCK_ELEMENTS = 1 << 21
#: blocks of at least this many elements take the compiled kernel on the CPU
COMPILE_MIN = 1 << 18
_WEIGHTS: list = []


def _weights_kernel(x: Tensor, elements: int):
    """:func:`_weights`, compiled where :func:`~streamkv.compiled.may_compile` allows."""
    if may_compile(x, elements, COMPILE_MIN):
        if not _WEIGHTS:
            _WEIGHTS.append(compile_kernel(_weights, "certificate_weights"))
        if _WEIGHTS[0] is not None:
            return _WEIGHTS[0]
    return _weights


@torch.compiler.assume_constant_result
def _matmul_precision() -> str:
    """The host's float32 product setting (a traced caller reads it when it is traced)."""
    return torch.get_float32_matmul_precision()


def check_precision() -> None:
    """Refuse float32 matrix products that are not IEEE float32 (rounding f's assumption)."""
    precision = _matmul_precision()
    if precision != "highest":
        raise ValueError(f"the float32 certificate assumes IEEE float32 matrix products, and "
                         f"torch.get_float32_matmul_precision() is {precision!r} "
                         f"(TF32 or bfloat16 inside them): set it to 'highest' for the certified steps")


def certify_tier(q: Tensor, held: TierHeld, *, scale: float, top: int = 16, ref: Tensor | None = None,
                 parts: bool = False, count: Tensor | None = None) -> tuple[Certificate, dict]:
    """The certificate of queries ``q [B, H, Q, D]`` over ``held`` (see the module docstring).
    ``top``: entries per head whose ``|u_j,c|`` is taken exactly (step 3: the entries of largest
    ``max_q p^_j Delta_j`` over each block of queries); ``ref [B, H, 1, Dv]``: step 3's reference
    (any value is valid; default the mean of the rows' values: a caller passes the last step's
    mean output). With ``parts`` also what recall ranks by: ``entry [B, H, Q, M]`` (each tier-2
    entry's part of ``E``, rounded) and ``block3 [B, H, Q, NB]`` (each tier-3 block's part of the
    mass bound times the largest gap). Device work only, no host synchronisation; every
    ``O(history)`` tensor float32, and no ``[Q x history]`` one: the query rows are taken in blocks
    (:data:`BLOCK_ELEMENTS`), each block's ``O(rows x history)`` work one fused pass
    (:func:`_weights`, compiled on the CPU) and its matrix products. With ``count [Q]`` (bool: the
    rows a scored policy's statistic counts) also ``key_max`` and ``key_sum`` ``[H, S1]``: the
    maximum and sum of tier 1's computed weights normalised over tier 1 (float32) over the counted
    rows and the batch, the statistics a read of the same rows delivers, and ``lse_own [B, H, Q]``,
    the rows' log-sum-exp over tier 1 (what a read tells a poisoned head by). The returned dict
    holds them, and always ``lse_read [B, H, Q]``: the log-sum-exp as a read gives it (NaN or +inf
    in a row that sees such a score, where the certificate's is -inf)."""
    B, H, Q, D = q.shape
    f32, f64 = torch.float32, torch.float64
    S1, M = held.k1.shape[-2], held.k2.shape[-2]
    check_precision()
    if not S1 or not M:
        raise ValueError(f"the certificate needs rows in both tiers, got {S1} tier-1 rows and {M} tier-2 entries")
    qs = q.to(f32) * scale  # q_s = fl(scale q)
    Dv = held.v2.shape[-1]
    nk, nv = held.dk2.shape[-1], held.dv2.shape[-1]
    k = torch.cat([held.k1.to(f32), held.k2], -2)  # [B, H, S, D]: tiers 1 and 2 as one run of rows
    v = torch.cat([held.v1.to(f32), held.v2], -2)
    S = S1 + M
    roundup = 1.0 + 4.0 * gamma32(D + 4)  # a float32 norm (a sum of <= D + 2 non-negative terms), rounded up
    # ---- magnitudes (rounding a): every row, held or not, bounds the held ones
    knorm = (k * k).sum(-1).amax(-1).sqrt()  # [B, H]
    qabs = qs.abs()
    a_q = torch.minimum(qs.norm(dim=-1) * knorm.unsqueeze(-1),  # [B, H, Q] >= sum_i |q_s,i| |k_j,i| (Cauchy-Schwarz)
                        (qabs @ k.abs().amax(-2).unsqueeze(-1)).squeeze(-1)).double() * roundup ** 3
    e_s = gamma32(D + 3) * a_q
    zeta = 2.1 * U32 * a_q + 4.1 * U32
    vlo_k, vhi_k = v.amin(-2).double(), v.amax(-2).double()  # [B, H, Dv]: over every row (a superset of the kept)
    ref = v.mean(-2, keepdim=True) if ref is None else ref.to(f32)  # the reference r_c [B, H, 1, Dv] (any is valid)
    ref = torch.where(torch.isfinite(ref), ref, 0.0)  # a finite one: a NaN would spoil every output row
    vc = v - ref  # the rows centred on r (o_hat is computed as r + sum P (v - r): its rounding scales with |v - r|)
    vdev = vc.abs()  # |v_j,c - r_c| [B, H, S, Dv]
    gn = gamma32(S)
    e_l = e_s + zeta + 1.01 * gn + S * _TINY + _F64
    eta = 2.0 * (e_s + zeta)
    vmax = torch.maximum(vlo_k.abs(), vhi_k.abs())
    eta2 = e_s + e_l + zeta + 4.1 * U32  # |log(P_j / p^_j)|, P_j = E_j / S_hat
    up_d = 1.0 + 2.0 * gamma32(D + 6)
    # ---- the held attention and the slack weights (rounding b-d), a block of query rows at a time
    consts = torch.tensor([(1.0 - 8.0 * U32) * (1.0 - gamma32(S + 2)), S * _TINY, gamma32(S + 2) + 8.0 * U32],
                          dtype=f64, device=q.device)
    k1t, k2t = k[..., :S1, :].transpose(-1, -2), k[..., S1:, :].transpose(-1, -2)
    vc1, vc2, vd1, vd2 = vc[..., :S1, :], vc[..., S1:, :], vdev[..., :S1, :], vdev[..., S1:, :]
    # the slack sums in bfloat16 products (rounding f) where the CPU has them natively
    low = BF16_SLACK and q.device.type == "cpu" and bf16_products_fast()
    bf = torch.bfloat16
    vd1b, vd2b, dv2b = (vd1.to(bf), vd2.to(bf), held.dv2.to(bf)) if low else (vd1, vd2, held.dv2)
    dead2 = (~held.live2).unsqueeze(1)  # [H, 1, M]
    if nk == 1:  # Delta_j = scale ||q||_1 dk_j
        da, db = qabs.sum(-1, keepdim=True) * up_d, held.dk2.transpose(-1, -2)
    else:  # per group (or per element): a product over the groups
        qg, dkt, one = qabs.reshape(B, H, Q, nk, D // nk).sum(-1), held.dk2.transpose(-1, -2), qs.new_ones(())
    t = min(top, M)
    ref64 = ref.double()
    out, rel, rel2, rel3, relg, vsl, fix1, fixg = (q.new_zeros((B, H, Q, Dv), dtype=f64) for _ in range(8))
    rows = [q.new_empty((B, H, Q), dtype=f64) for _ in range(10)]
    inv_all = q.new_empty((B, H, Q, 1), dtype=f64)
    entry = q.new_empty((B, H, Q, M), dtype=f32) if parts else None
    per_row = B * H * S
    n_rows = max(1, (BLOCK_ELEMENTS if q.device.type == "cpu" else 64 * BLOCK_ELEMENTS) // per_row)
    weights = _weights_kernel(qs, min(n_rows, Q) * per_row)
    key_max = key_sum = None
    lse_read = q.new_empty((B, H, Q), dtype=f64)
    lse_own = None if count is None else q.new_empty((B, H, Q), dtype=f64)
    for a in range(0, Q, n_rows):
        b = min(Q, a + n_rows)
        n = b - a
        qb = qs[..., a:b, :]
        if nk == 1:
            da_b, db_b = da[..., a:b, :], db
        else:
            da_b, db_b = (qg[..., a:b, :] @ dkt) * up_d, one
        hide1 = held.hide1 if held.hide1.shape[1] == 1 else held.hide1[:, a:b]
        cb = None if count is None else count[a:b].to(f32).unsqueeze(-1)
        e1, e2, W, Wb, p1b, colmax, *got, g0, smax, ssum, lse1, lse_b = weights(
            qb @ k1t, hide1, qb @ k2t, dead2, da_b, db_b, eta2[..., a:b], consts, low, cb)
        lse_read[..., a:b] = lse_b
        if cb is not None:  # maximum and sum both carry a NaN on
            key_max = smax if key_max is None else torch.maximum(key_max, smax)
            key_sum = ssum if key_sum is None else key_sum + ssum
            lse_own[..., a:b] = lse1
        inv = got[1]
        inv_all[..., a:b, :] = inv
        for dst, x in zip(rows, got[:1] + got[2:]):
            dst[..., a:b] = x
        o = ref64 + (e1 @ vc1 + e2 @ vc2).double() * inv  # o_hat = r + sum_j P_j (v_j - r) [B, H, n, Dv]
        out[..., a:b, :] = o
        if low:  # rounding f: bfloat16 factors and result, inflated
            r1 = (p1b @ vd1b).float() * INFLATE  # tier 1's sum_j P_j |v_j - r| (w3 = P there, wg = g P)
            R = (Wb @ vd2b).float() * INFLATE  # sum_j w_j |v_j - r| over tier 2 [B, H, 4n, Dv]
            vs = (Wb[..., 2 * n:3 * n, :] @ dv2b).float() * INFLATE
        else:
            r1 = (e1 * inv.to(f32)) @ vd1
            R = W @ vd2
            vs = W[..., 2 * n:3 * n, :] @ held.dv2
        rel[..., a:b, :] = R[..., :n, :]
        rel2[..., a:b, :] = R[..., n:2 * n, :]
        rel3[..., a:b, :] = R[..., 2 * n:3 * n, :] + r1
        relg[..., a:b, :] = R[..., 3 * n:, :] + g0 * r1
        vsl[..., a:b, :] = vs.repeat_interleave(Dv // nv, dim=-1)  # sum_j P_j e^Delta_j dv_j
        if t:  # step 3: this block's heaviest entries per head, their exact deviation (exact minus relaxed)
            idx = colmax.topk(t, dim=-1).indices  # [B, H, t]
            gidx = idx.unsqueeze(-1).expand(B, H, t, Dv)
            vt = torch.gather(held.v2, 2, gidx).unsqueeze(2).double()  # [B, H, 1, t, Dv]
            dt = torch.gather(vd2, 2, gidx).unsqueeze(2).double()
            dev_t = (vt - o.unsqueeze(-2)).abs() - dt - (ref64 - o).abs().unsqueeze(-2)  # [B, H, n, t, Dv]
            qidx = idx.unsqueeze(2).expand(B, H, n, t)
            fix1[..., a:b, :] = (torch.gather(W[..., :n, :], 3, qidx).double().unsqueeze(-1) * dev_t).sum(-2)
            fixg[..., a:b, :] = (torch.gather(W[..., 3 * n:, :], 3, qidx).double().unsqueeze(-1) * dev_t).sum(-2)
        if parts:
            entry[..., a:b, :] = W[..., :n, :] * vd2.amax(-1).unsqueeze(-2) \
                + e2 * inv.to(f32) * held.dv2.amax(-1).unsqueeze(-2)
    lse, w1sum, w2sum, w3sum, wgsum, lam_b, lam_lo, dmax, kappa, under = rows
    if low:  # rounding f's underflow: bfloat16 subnormals, 2^-134 absolute per factor and result
        floor = _TINY * (S * 2.0 * vmax.unsqueeze(-2) + 1.0)
        for x, wsum in ((rel, w1sum), (rel2, w2sum), (rel3, w3sum), (relg, wgsum)):
            x += floor + _TINY * S * wsum.unsqueeze(-1)
        vsl += _TINY * (S * held.dv2.amax(dim=(-2, -1)).double().view(B, H, 1, 1) + S * w3sum.unsqueeze(-1) + 1.0)
    odev = (ref64 - out).abs()  # |r_c - o_hat_c| [B, H, Q, Dv]
    kap = kappa.unsqueeze(-1)
    g1 = 1.0 + gamma32(S + 2) + 4.0 * U32  # a float32 product of non-negative terms, rounded up
    # rounding c, centred: |o_hat - o^| <= (e^eta - 1 + 2.2 gamma(S) + 2u) sum_j p^_j |v_j - r| (+ u |v| wide)
    mad = kap * rel3 * g1 + S * _TINY * 2.0 * vmax.unsqueeze(-2)  # >= sum_j p^_j |v_j - r| (e^Delta >= 1)
    eps_o = mad * (torch.expm1(eta) + 2.2 * gn + 2.0 * U32).unsqueeze(-1) \
        + (U32 * vmax.unsqueeze(-2) if held.wide else 0.0) + _F64 * (out.abs() + vmax.unsqueeze(-2))
    # step 3: the relaxed sums, each block's top entries replaced by their exact deviation
    fix_w = (gamma32(S + 2) + 2.0 * gamma32(t + 2) + 4.0 * U32)
    relax1 = rel + odev * w1sum.unsqueeze(-1)
    relaxg = relg + odev * wgsum.unsqueeze(-1)
    top1, topg = fix_w * relax1 + fix1, fix_w * relaxg + fixg
    umax = torch.maximum(vhi_k.unsqueeze(-2) - out, out - vlo_k.unsqueeze(-2)).clamp(min=0.0) + eps_o  # >= |u_j,c|
    dvmax = held.dv2.amax(dim=(-2, -1)).double().view(B, H, 1, 1)
    tiny = under.unsqueeze(-1) * umax
    el = torch.exp(lam_b).unsqueeze(-1)
    first = kap * (relax1 + top1).clamp(min=0.0) + eps_o * (w1sum * kappa + under).unsqueeze(-1) + tiny
    # e^Lam sum_j p^_j (Delta_j^2 + Lam^2) e^{Delta_j} |u_j,c|, |u_j,c| <= |v_j,c - r_c| + |r_c - o^_c|
    a2 = kap * (rel2 + odev * w2sum.unsqueeze(-1)) * g1 + eps_o * (w2sum * kappa).unsqueeze(-1)
    a3 = kap * (rel3 + odev * w3sum.unsqueeze(-1)) * g1 + eps_o * (w3sum * kappa).unsqueeze(-1)
    second = el * (a2 + lam_b.square().unsqueeze(-1) * a3 + tiny)
    value = el * (vsl * kap * g1 + under.unsqueeze(-1) * dvmax)  # e^Lam sum_j p^_j e^{Delta_j} dv_j,c
    zero = kap * (relaxg + topg).clamp(min=0.0) + eps_o * (wgsum * kappa + under).unsqueeze(-1) + tiny \
        + torch.exp(lam_lo).unsqueeze(-1) * (vsl * kap * g1 + under.unsqueeze(-1) * dvmax)
    # o_K,c is a mean of original kept values, within [vlo - dv, vhi + dv]: the trivial bound
    dvc = held.dv2.amax(-2).double().repeat_interleave(Dv // nv, dim=-1).unsqueeze(-2)  # [B, H, 1, Dv]
    err_k = torch.minimum(torch.minimum(first + second + value, zero), umax + dvc) * (1.0 + _F64)
    # ---- tier 3 (step 4, rounding e)
    evicted_any = torch.zeros((B, H, Q), dtype=torch.bool, device=q.device)
    log_z = torch.full((B, H, Q), -math.inf, dtype=f64, device=q.device)
    block3 = None
    NB = held.lo.shape[-2]
    if NB:
        live3 = torch.isfinite(held.logn)  # [1|B, H, NB]
        on = live3.unsqueeze(-1)
        lo = torch.where(on, held.lo.to(f32), 0.0)
        hi = torch.where(on, held.hi.to(f32), 0.0)
        q2 = torch.cat([qs.clamp(min=0.0), (-qs).clamp(min=0.0)], -1)  # [q_s+, q_s-]
        u3 = q2 @ torch.cat([hi, -lo], -1).transpose(-1, -2)  # U_hat [B, H, Q, NB]
        t3 = u3 + held.logn.to(f32).unsqueeze(-2)  # -inf where not in tier 3
        x3 = t3.amax(-1, keepdim=True)
        ok3 = torch.isfinite(x3)
        x3s = torch.where(ok3, x3, 0.0)
        lz = (x3s + torch.log(torch.exp(t3 - x3s).sum(-1, keepdim=True))).double().squeeze(-1)
        bnorm = torch.maximum(lo.abs(), hi.abs()).square().sum(-1).amax(-1).sqrt()  # [B, H]
        a3 = (qs.norm(dim=-1) * bnorm.unsqueeze(-1)).double() * roundup ** 3
        lnmax = torch.where(live3, held.logn.to(f32), 0.0).amax(-1, keepdim=True).double()  # [1|B, H, 1]
        e_z = gamma32(2 * D + 3) * a3 + 4.0 * U32 * (a3 + lnmax + 3.0) + 1.01 * gamma32(NB) + NB * _TINY \
            + 10.0 * U32 * (math.log(NB) + 2.0) + 4.0 * U32 * lnmax
        evicted_any = live3.any(-1, keepdim=True).expand(B, H, Q)  # from the counts, never from a computed bound
        log_z = torch.where(evicted_any, lz + e_z, -math.inf)
        if parts:
            block3 = t3.double() - (lse - lam_lo).unsqueeze(-1)
    # ---- step 5, finished in float64 (per query)
    lse_lo = lse - e_l - lam_lo  # L >= L^ - Lam_lo
    log_m = log_z - torch.logaddexp(lse_lo, log_z)
    fin = lambda x: torch.where(torch.isfinite(x), x, 0.0).abs()
    log_m = log_m + _F64 * (fin(log_z) + fin(lse_lo) + 1.0)
    log_m = torch.where(torch.isnan(log_m), 0.0, log_m).clamp(max=0.0)
    log_m = torch.where(evicted_any, log_m, -math.inf)
    mass = (log_m.exp() * (1.0 + _F64)).clamp(max=1.0)
    gap = torch.maximum(held.vhi.double().unsqueeze(-2) - out, out - held.vlo.double().unsqueeze(-2)) + eps_o + err_k
    gap = torch.where(evicted_any.unsqueeze(-1), gap, 0.0)
    gap = torch.where(torch.isnan(gap), math.inf, gap)
    error = (mass.unsqueeze(-1) * gap + err_k + eps_o) * (1.0 + _F64)
    error = torch.where(torch.isnan(error), math.inf, error)
    # a margin is a bound or +inf, never NaN (a non-finite input spoils a head's magnitudes)
    eps_o, e_l = (torch.where(torch.isnan(x), math.inf, x) for x in (eps_o, e_l))
    cert = Certificate(log_mass=log_m, mass=mass, error=error, gap=gap, lse_kept=lse, out_kept=out, log_zhat=log_z,
                       block_log_contrib=block3, out_error=eps_o, lse_error=e_l)
    got = {"lse_read": lse_read}
    if count is not None:
        got.update(key_max=key_max.amax(0), key_sum=key_sum.sum(0), lse_own=lse_own)
    if parts:
        got.update(entry=entry, block3=None if block3 is None else block3.exp() * gap.amax(-1, keepdim=True))
    return cert, got
