"""The certificate: a run-time upper bound on the attention mass a query would have put on
evicted tokens, and on the output error their eviction causes.

Notation, for one query ``q`` of one head (every function here batches over ``[B, H, Q]``):

- ``K``: the kept slots (what the cache attends over), logits ``s_j = scale * q . k_j``,
  kept partition ``Z_K = sum_{j in K} exp(s_j)``, log-sum-exp ``lse_K = log Z_K``, kept
  output ``o_K = sum_{j in K} exp(s_j - lse_K) v_j``.
- ``D``: the evicted tokens (every token of the stream's history that is not kept),
  partitioned into *blocks* ``b`` of ``n_b`` tokens. A block is summarised by its count
  ``n_b`` and the elementwise box ``[lo_b, hi_b]`` of its (RoPE-rotated) keys:
  ``lo_b,i <= k_j,i <= hi_b,i`` for every ``j`` in ``b`` and channel ``i``. The evicted values
  lie in a box ``[vlo, vhi]`` (per channel; the union over all evicted tokens).
- Full-history attention (keep everything) has partition ``Z = Z_K + Z_D`` with
  ``Z_D = sum_{j in D} exp(s_j)``; the dropped mass is ``m = Z_D / Z`` and, by the
  dropped-mass identity (:mod:`streamkv.budget.mass`), ``o - o_K = m (o_D - o_K)`` where
  ``o_D`` is the softmax-weighted mean of the evicted values.

The bound, step by step (each inequality with the reason it holds):

1. **Logit bound per block** (Quest's page bound, arXiv 2406.10774 — prior art; used there
   to rank pages, here to certify mass). For ``j`` in ``b``::

       s_j = scale * sum_i q_i k_j,i  <=  scale * sum_i max(q_i lo_b,i, q_i hi_b,i) =: U_b

   because ``x -> q_i x`` is linear, so on the interval ``[lo_b,i, hi_b,i]`` it is largest at
   an endpoint (and ``scale > 0``). Computed as ``U_b = scale * (q . c_b + |q| . r_b)`` with
   centre ``c = (lo + hi) / 2`` and radius ``r = |hi - lo| / 2``: the identity
   ``max(a lo, a hi) = a c + |a| r`` holds for every real ``a`` and either order of the ends (the
   order is not checked: that would read the device), and turns the bound into two matrix
   products.
2. **Evicted partition bound.** ``Z_D = sum_b sum_{j in b} exp(s_j) <= sum_b n_b exp(U_b)
   =: Z_hat`` by 1 and monotonicity of ``exp``. Computed as ``log Z_hat = logsumexp_b(U_b +
   log n_b)`` (empty blocks, ``n_b = 0``, contribute ``-inf``).
3. **Mass bound.** ``m = Z_D / (Z_K + Z_D) <= Z_hat / (Z_K + Z_hat) =: m_hat`` because
   ``x -> x / (Z_K + x)`` is increasing for ``Z_K > 0``. In log space:
   ``log m_hat = log Z_hat - logaddexp(lse_K, log Z_hat)``; ``m_hat <= 1`` always.
4. **Output error bound, per channel c.** ``o_D`` is a convex combination of evicted values,
   so ``vlo_c <= o_D,c <= vhi_c`` and ``|o_D,c - o_K,c| <= max(vhi_c - o_K,c, o_K,c - vlo_c)
   =: gap_c`` (if ``o_D,c >= o_K,c`` the left side is at most ``vhi_c - o_K,c``, else at most
   ``o_K,c - vlo_c``; ``gap_c >= 0`` since the two terms sum to ``vhi_c - vlo_c >= 0``). With
   3: ``|o_c - o_K,c| = m |o_D,c - o_K,c| <= m_hat * gap_c``. Computed as ``max(|vhi_c - o_K,c|,
   |o_K,c - vlo_c|)``: the same for ``vlo <= vhi`` (the smaller term is at most the larger's
   absolute value), and the gap of the box between the ends given in the other order.

Where it is loose (measured by the experiments, see :mod:`streamkv.certify.experiment`):
step 1 is exact for a block of one token (``lo = hi = k``), and for any block whose
maximising corner ``(lo_i if q_i < 0 else hi_i)_i`` is (nearly) one of its keys; it loses
``scale * |q| . r_b`` at worst, i.e. grows with the box radius, so blocks of keys that
differ a lot (tokens from many frames under RoPE, heads mixed, sinks mixed with ordinary
tokens) give loose bounds. Step 2 then charges *every* token of the block the largest
logit of the box, so the slack is ``exp`` of step 1's slack, times the count. Step 3 is
exact given ``Z_hat``; the mass ratio ``m_hat / m`` is roughly ``Z_hat / Z_D`` while
``m`` is small and tends to 1 as both approach 1. Step 4 uses the union value box: it is
tight when ``o_D`` sits at a corner of it, loose when evicted values spread.

**Floating point.** The inequalities hold for exact arithmetic over the stored numbers
(the cache's K/V as stored, e.g. float32, and the query as handed to attention). The
computation runs in float64 and every rounding step is covered by an explicit,
documented allowance added to the result (:func:`rounding_allowance`), so the *computed*
certificate is an upper bound on the *exact* one:

- dot products of length ``D`` in float64 err by at most ``gamma(D) * sum |x_i y_i|``
  (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.5), with
  ``gamma(n) = n u / (1 - n u)``, ``u = 2^-53``; centre/radius rounding adds ``u`` relative
  per entry. Every logit, kept or bound, therefore errs by at most
  ``gamma(D + 3) * A_q`` with ``A_q = scale * sum_i |q_i| kmax_i`` and ``kmax_i`` the largest
  ``|k_i|`` over kept keys and box corners; ``|s_j| <= A_q`` too.
- ``logsumexp`` over ``n`` terms (max-shifted): ``exp`` and ``log`` are assumed accurate to
  2 ulp (glibc and the CUDA math library document at most 1-2 ulp for double ``exp`` and
  ``log``; IEEE 754 does not require correct rounding for them), the ``n``-term sum errs by
  ``gamma(n)`` relative, and each shifted argument ``s - max`` (``|s - max| <= 2 A_q``) by
  ``u`` relative; hence an absolute error of at most
  ``gamma(n + 8) + 8 u (A_q + log n + 1)`` in the result. The online merge of key blocks and
  the final ``logaddexp`` / subtraction add a few ``u (A_q + log N)`` more.

The allowance adds ``16 * gamma(n_terms) * (A_q + log N + 1) + 4 u`` to ``log m_hat`` (``n_terms``:
``D`` + kept slots + blocks + 8 per merged block + 16; ``N``: tokens in the stream; the
factor 16 covers the sum of the at most 8 error terms above with a margin of 2; ``4 u``
covers ``exp`` and the one rounding of the product ``m_hat * gap``), and the
matching allowance ``4 * eps * vmax`` to ``gap_c`` for the rounding of ``o_K`` (its weights
err by ``exp(2 eps) - 1 <= 4 eps`` relative for ``eps <= 0.1``). In float64 this is about
``1e-12`` relative for ``A_q <= 100`` — far below the bound's own looseness, and it never
makes the certificate a non-bound. The reference it is checked against is float64 too
(see :mod:`streamkv.certify.shadow`); checks compare the computed numbers exactly, with no
tolerance. NaN or infinite keys make the bound meaningless; then ``m_hat = 1`` (the trivial
bound, still valid) and ``gap`` is infinite.

Why this long: it holds the proof of the certificate and its floating-point allowance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Certificate", "gamma", "rounding_allowance", "kept_attention", "box_logit_bound",
           "log_partition_bound", "certify", "U64"]

#: unit roundoff of float64 (round to nearest)
U64 = 2.0**-53


def gamma(n: int | Tensor, u: float = U64):
    """Higham's ``gamma(n) = n u / (1 - n u)``: the relative error bound of an ``n``-term
    floating-point sum or dot product."""
    return n * u / (1 - n * u)


def rounding_allowance(a_q: Tensor, n_terms: int, n_tokens: int) -> Tensor:
    """Absolute allowance (log space) covering the float64 rounding of ``log m_hat``:
    ``16 * gamma(n_terms) * (A_q + log N + 1)``. See the module docstring for the derivation."""
    return 16.0 * gamma(n_terms) * (a_q + math.log(max(n_tokens, 1)) + 1.0)


@dataclass
class Certificate:
    """The certificate of one attention step (one layer): per query and head.

    Shapes: ``[B, H, Q]`` per query (``Q`` queries of the chunk), ``[B, H, Q, Dv]`` per
    channel; all float64, on the queries' device. No host synchronisation was needed to
    produce it.

    Attributes:
        log_mass: ``log m_hat`` (``-inf`` when nothing is evicted), allowance included.
        mass: ``m_hat = exp(log_mass)`` (the number every check compares).
        error: ``mass * gap``: the per-channel bound on ``|o - o_K|``.
        gap: ``max(vhi - o_K, o_K - vlo)`` plus its rounding allowance (0 when nothing is
            evicted).
        lse_kept: ``lse_K`` (as computed, before the allowance).
        out_kept: ``o_K`` (float64).
        log_zhat: ``log Z_hat`` (as computed).
        block_log_contrib: ``[B, H, Q, NB]``: ``U_b + log n_b - lse_K`` per block (what recall
            ranks by); ``None`` unless requested.
        out_error: ``[B, H, Q, Dv]`` or None: a bound on ``|out_kept - o_K|`` per channel, ``o_K``
            the exact attention over the held K/V (:mod:`.bound32`'s float32 certificate; None where
            ``out_kept`` is float64 and its rounding is part of the allowance).
        lse_error: ``[B, H, Q]`` or None: a bound on ``|lse_kept - lse_K|`` (likewise).
    """

    log_mass: Tensor
    mass: Tensor
    error: Tensor
    gap: Tensor
    lse_kept: Tensor
    out_kept: Tensor
    log_zhat: Tensor
    block_log_contrib: Tensor | None = None
    out_error: Tensor | None = None
    lse_error: Tensor | None = None



def kept_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, *, scale: float,
                   block: int = 1024) -> tuple[Tensor, Tensor]:
    """Float64 attention over the kept slots, ``block`` slots at a time (online softmax).

    Args:
        q: ``[B, H, Q, D]``; k: ``[B, H, S, D]``; v: ``[B, H, S, Dv]`` (any float dtype).
        bias: ``0`` / ``-inf`` validity bias broadcastable to ``[B, H, Q, S]`` or None.

    Returns:
        ``(lse [B, H, Q], out [B, H, Q, Dv])`` in float64. Memory ``O(Q * block)`` per head.
    """
    q64 = q.double()
    lse: Tensor | None = None
    out: Tensor | None = None
    n = k.shape[-2]
    for start in range(0, n, block):
        stop = min(n, start + block)
        s = (q64 @ k[..., start:stop, :].double().transpose(-1, -2)) * scale
        if bias is not None:
            s = s + bias[..., start:stop].double()
        lse_b = torch.logsumexp(s, dim=-1)
        w = torch.exp(s - lse_b.unsqueeze(-1)).nan_to_num(0.0)  # rows with no valid slot: 0
        out_b = w @ v[..., start:stop, :].double()
        if lse is None:
            lse, out = lse_b, out_b
            continue
        new = torch.logaddexp(lse, lse_b)
        a = torch.exp(lse - new).nan_to_num(0.0).unsqueeze(-1)
        b = torch.exp(lse_b - new).nan_to_num(0.0).unsqueeze(-1)
        out = out * a + out_b * b
        lse = new
    if lse is None:
        raise ValueError("kept_attention needs at least one slot, got 0")
    return lse, out


def box_logit_bound(q: Tensor, lo: Tensor, hi: Tensor, *, scale: float) -> Tensor:
    """``U_b = scale * sum_i max(q_i lo_b,i, q_i hi_b,i)`` for every query and block, in float64.

    Args:
        q: ``[B, H, Q, D]``; lo, hi: ``[B, H, NB, D]`` (any float dtype; a channel whose ends
            come in the other order bounds the box between them; blocks with infinite or NaN
            entries must be masked by the caller).

    Returns:
        ``[B, H, Q, NB]`` float64, *before* the rounding allowance. Two matmuls
        (``q . c + |q| . r``, see the module docstring).
    """
    q64 = q.double()
    lo64, hi64 = lo.double(), hi.double()
    c = (lo64 + hi64) * 0.5
    r = (hi64 - lo64).abs() * 0.5  # the ends in either order (ordering them would read the device)
    return (q64 @ c.transpose(-1, -2) + q64.abs() @ r.transpose(-1, -2)) * scale


def log_partition_bound(q: Tensor, lo: Tensor, hi: Tensor, log_count: Tensor, *, scale: float,
                        block: int = 256, keep_contrib: bool = False) -> tuple[Tensor, Tensor | None]:
    """``log Z_hat = logsumexp_b(U_b + log n_b)``, ``block`` summary blocks at a time.

    ``log_count``: ``[B or 1, H, NB]`` float64, ``-inf`` for empty or inactive blocks (their
    boxes are ignored: NaN/inf entries there are masked). Returns ``(log_zhat [B, H, Q],
    contrib [B, H, Q, NB] or None)``; ``log_zhat = -inf`` when no block is active.
    """
    B, H, Q, _ = q.shape
    nb = lo.shape[-2]
    if nb == 0:
        return torch.full((B, H, Q), -math.inf, dtype=torch.float64, device=q.device), (
            torch.zeros((B, H, Q, 0), dtype=torch.float64, device=q.device) if keep_contrib else None)
    out: Tensor | None = None
    parts = []
    for start in range(0, nb, block):
        stop = min(nb, start + block)
        lc = log_count[..., start:stop]  # [B|1, H, nb']
        live = torch.isfinite(lc).unsqueeze(-1)
        lo_b = torch.where(live, lo[..., start:stop, :].double(), 0.0)
        hi_b = torch.where(live, hi[..., start:stop, :].double(), 0.0)
        t = box_logit_bound(q, lo_b, hi_b, scale=scale) + lc.unsqueeze(-2)  # [B, H, Q, nb']
        if keep_contrib:
            parts.append(t)
        part = torch.logsumexp(t, dim=-1)
        out = part if out is None else torch.logaddexp(out, part)
    return out, (torch.cat(parts, dim=-1) if keep_contrib else None)


def certify(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    lo: Tensor,
    hi: Tensor,
    log_count: Tensor,
    vlo: Tensor,
    vhi: Tensor,
    *,
    scale: float,
    n_tokens: int,
    key_block: int = 1024,
    summary_block: int = 256,
    keep_contrib: bool = False,
) -> Certificate:
    """The certificate of one attention step (see the module docstring for the proof).

    Args:
        q: queries ``[B, H, Q, D]`` exactly as attention uses them (RoPE applied).
        k, v: the kept slots ``[B, H, S, D]`` / ``[B, H, S, Dv]`` (physical order).
        bias: validity bias over slots (``0`` kept, ``-inf`` empty), broadcastable to
            ``[B, H, Q, S]``, or None when every slot is kept.
        lo, hi: evicted block key boxes ``[B, H, NB, D]``.
        log_count: ``[B|1, H, NB]`` float64 ``log n_b`` (``-inf``: empty or not evicted now).
        vlo, vhi: the evicted value box ``[B, H, Dv]`` (``+inf`` / ``-inf`` when empty). The
            boxes' ends may come in either order per channel (nothing is read back to check them):
            the certificate covers the box between them.
        scale: the softmax scale attention uses.
        n_tokens: tokens in the stream so far (for the rounding allowance).

    Device work only; no host synchronisation.
    """
    lse_k, o_k = kept_attention(q, k, v, bias, scale=scale, block=key_block)
    log_zhat, contrib = log_partition_bound(q, lo, hi, log_count, scale=scale, block=summary_block,
                                            keep_contrib=keep_contrib)
    # magnitude of any logit involved: kept keys (valid slots) and live box corners
    q64abs = q.double().abs()
    if bias is not None:
        valid = torch.isfinite(bias.double()).any(dim=-2).unsqueeze(-1)  # [.., S, 1]: seen by some query
        kmax = torch.where(valid, k.double().abs(), 0.0).amax(dim=-2)  # [B, H, D]
    else:
        kmax = k.double().abs().amax(dim=-2)
    live = torch.isfinite(log_count).unsqueeze(-1)
    if lo.shape[-2]:
        bmax = torch.where(live, torch.maximum(lo.double().abs(), hi.double().abs()), 0.0).amax(dim=-2)
        kmax = torch.maximum(kmax, bmax.expand_as(kmax) if bmax.shape != kmax.shape else bmax)
    a_q = scale * (q64abs @ kmax.unsqueeze(-1)).squeeze(-1)  # [B, H, Q]
    n_key_blocks = -(-k.shape[-2] // key_block)
    n_sum_blocks = -(-max(lo.shape[-2], 1) // summary_block)
    n_terms = q.shape[-1] + k.shape[-2] + lo.shape[-2] + 8 * (n_key_blocks + n_sum_blocks) + 16
    eps = rounding_allowance(a_q, n_terms, n_tokens) + 4.0 * U64  # + the rounding of mass * gap
    log_m = log_zhat - torch.logaddexp(lse_k, log_zhat) + eps
    # NaN (non-finite keys or queries) -> the trivial bound m_hat = 1; never above 1
    log_m = torch.where(torch.isnan(log_m), 0.0, log_m).clamp(max=0.0)
    # whether anything is evicted comes from the counts, never from the computed bound (a NaN
    # there must give the trivial bound m_hat = 1, not "nothing evicted")
    evicted_any = torch.isfinite(log_count).any(-1, keepdim=True).expand_as(log_zhat)  # [B, H, Q]
    vlo64, vhi64 = vlo.double().unsqueeze(-2), vhi.double().unsqueeze(-2)  # [B, H, 1, Dv]
    vmax = torch.maximum(k.new_zeros(()).double(), v.double().abs().amax(dim=(-2, -1)))  # [B, H]
    # max(vhi - o, o - vlo) for an ordered box; as written, the ends may come in either order
    gap = torch.maximum((vhi64 - o_k).abs(), (o_k - vlo64).abs())
    gap = gap + (4.0 * eps * vmax.unsqueeze(-1)).unsqueeze(-1)
    gap = torch.where(evicted_any.unsqueeze(-1), gap, 0.0)
    gap = torch.where(torch.isnan(gap), math.inf, gap)
    log_m = torch.where(evicted_any, log_m, -math.inf)
    mass = log_m.exp()
    error = torch.where(evicted_any.unsqueeze(-1), mass.unsqueeze(-1) * gap, 0.0)
    if contrib is not None:
        contrib = contrib - lse_k.unsqueeze(-1)
    return Certificate(log_mass=log_m, mass=mass, error=error, gap=gap,
                       lse_kept=lse_k, out_kept=o_k, log_zhat=log_zhat, block_log_contrib=contrib)
