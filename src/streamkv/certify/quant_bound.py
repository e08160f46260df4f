"""The certificate of quantised storage: the eviction certificate (:mod:`.bound`), widened so
that it bounds the error against full-history attention over the *original* K/V, not over
what the cache stores.

Notation, for one query ``q`` of one head (everything batches over ``[B, H, Q]``):

- kept slots ``K``: original keys and values ``k_j, v_j``; stored (dequantised) ``k^_j, v^_j``
  with, per element, ``|k_j - k^_j| <= dk_j`` and ``|v_j - v^_j| <= dv_j`` in the storage
  basis (:meth:`~streamkv.quant.KVFormat.error_bound`; 0 for full-precision rows). When the
  codes live in a rotated basis (``x' = x R^T``, ``R`` orthogonal) the bounds are of ``x'``.
- the logits the cache attends with: ``s^_j = scale q . k^_j``; the original ones ``s_j``.
- ``o^ = sum_K softmax(s^)_j v^_j``: what the cache returns; ``o``: full-history attention
  over the original K/V (the truth); ``o_K``: attention over the kept original K/V.

The bound (each step with its reason):

1. **Logit slack.** ``|s_j - s^_j| <= Delta_j := scale sum_i |q'_i| dk_j,i`` with ``q' = q R^T``
   (``q`` without a rotation): ``q . (k - k^) = q' . (k' - k^')`` since ``R`` is orthogonal, and
   each term is at most ``|q'_i| dk_j,i``. With a rotation the read computes ``k^ = fl(k^' R)`` in
   float32; its rounding adds at most ``2 gamma_32(D) ||k^_j||_2 ||q||_1`` (Higham's dot product
   bound, ``||k^'||_1 <= sqrt(D) ||k^'||_2``, each entry of ``R`` is ``+-1/sqrt(D)``), added to
   ``Delta_j``. Values alike: ``|v_j,c - v^_j,c| <= eps_j,c := dv_j,c`` (no rotation) or
   ``||dv_j||_1 / sqrt(Dv) + 2 gamma_32(Dv) ||v^_j||_2`` (rotated).
2. **Kept partition.** With ``L^ = logsumexp_K s^``: ``lambda_hi = logsumexp_K(s^ + Delta) - L^``
   and ``lambda_lo = logsumexp_K(s^ - Delta) - L^`` bound ``L - L^`` from above and below
   (``L = logsumexp_K s``; ``exp`` is monotone). So ``Z_K >= exp(L^ + lambda_lo)``.
3. **Kept output.** ``p_j / p^_j = exp((s_j - s^_j) - (L - L^))`` lies in
   ``[exp(-Delta_j - lambda_hi), exp(Delta_j - lambda_lo)]``, so ``|p_j - p^_j| <= p^_j g_j`` with
   ``g_j = max(exp(Delta_j - lambda_lo) - 1, 1 - exp(-Delta_j - lambda_hi))``. Then, per channel,
   ``o_K - o^ = sum_j (p_j - p^_j)(v^_j - o^) + sum_j p_j (v_j - v^_j)`` (the weights of both sum
   to 1), hence ``|o_K,c - o^_c| <= E_c := sum_j p^_j [g_j |v^_j,c - o^_c| + exp(Delta_j - lambda_lo)
   eps_j,c]``.
4. **Evicted part.** The eviction certificate bounds the stored evicted keys (their sketches
   were taken of what the cache stored): ``Z^_D <= Z_hat``. The evicted keys' own quantisation
   slack is at most ``Delta_D := scale sum_i |q'_i| dmax_i`` (``dmax``: the largest key error
   bound of any token ever evicted from this (layer, head), per channel, plus the rotation's
   rounding term with the largest ``||k^||_2``), so ``Z_D <= Z_hat exp(Delta_D)``; their values
   lie in the stored value box widened by ``eps_D`` (the largest value error bound of an
   evicted token, per channel). With step 2:
   ``m = Z_D / (Z_K + Z_D) <= m' := Z' / (exp(L^ + lambda_lo) + Z')``, ``Z' = Z_hat exp(Delta_D)``.
5. **Output.** ``o - o_K = m (o_D - o_K)`` (the dropped-mass identity), ``o_D,c`` in
   ``[vlo_c - eps_D,c, vhi_c + eps_D,c]`` and ``o_K,c`` in ``[o^_c - E_c, o^_c + E_c]``, so
   ``|o_c - o^_c| <= m' gap'_c + E_c`` with ``gap'_c = max(vhi_c + eps_D,c - o^_c,
   o^_c - vlo_c + eps_D,c) + E_c``.

Floating point: computed in float64; ``log m'`` gets :func:`~.bound.rounding_allowance` with
``A_q`` widened by the largest ``Delta`` (every logit involved, and its slack, is below it);
``E`` gets ``8 gamma_64(S + D + 16) vmax`` (the rounding of two float64 attention outputs over
the same slots, each at most ``gamma(n) vmax`` from exact), ``gap'`` the ``4 eps vmax`` of
:mod:`.bound`. Scope: as :mod:`.bound` (the step's eviction and quantisation, given its inputs,
the ``[B, T, H, D]`` layout), for the formats of :data:`~streamkv.quant.KV_FORMATS` with finite
stored values (non-finite ones give the trivial mass bound and an infinite error bound).

Why this long: it holds the proof of the widened certificate.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .bound import U64, Certificate, gamma, rounding_allowance

__all__ = ["U32", "logit_slack", "value_slack", "kept_quant_error", "widen", "QuantErrors"]

#: unit roundoff of float32
U32 = 2.0**-24


def logit_slack(q: Tensor, dk: Tensor, k_hat: Tensor, rk: Tensor | None, *, scale: float) -> Tensor:
    """``Delta [B, H, Q, S]`` (step 1): ``q [B, H, Q, D]``, ``dk [B, H, S, D]`` (storage basis),
    ``k_hat [B, H, S, D]`` (what attention reads), ``rk`` the key rotation or None."""
    q64 = q.double()
    qb = q64 @ rk.double().T if rk is not None else q64
    delta = (qb.abs() @ dk.double().transpose(-1, -2)) * scale
    if rk is not None:
        n2 = k_hat.double().norm(dim=-1)  # [B, H, S]
        delta = delta + 2.0 * gamma(k_hat.shape[-1], U32) * scale * q64.abs().sum(-1, keepdim=True) * n2.unsqueeze(-2)
    return delta


def value_slack(dv: Tensor, v_hat: Tensor, rv: Tensor | None) -> Tensor:
    """``eps [B, H, S, Dv]`` (step 1): the bound on ``|v - v^|`` per original channel."""
    if rv is None:
        return dv.double()
    d = dv.shape[-1]
    per = dv.double().sum(-1, keepdim=True) / math.sqrt(d) + 2.0 * gamma(d, U32) * v_hat.double().norm(dim=-1,
                                                                                                        keepdim=True)
    return per.expand(*dv.shape)


def kept_quant_error(q: Tensor, k_hat: Tensor, v_hat: Tensor, bias: Tensor | None, delta: Tensor, eps: Tensor, *,
                     scale: float, block: int = 64) -> dict[str, Tensor]:
    """Steps 2 and 3 over the kept slots: ``lse_hat``, ``lam_lo``, ``lam_hi`` ``[B, H, Q]``,
    ``out_hat`` and ``err`` (``E``) ``[B, H, Q, Dv]``, float64. ``bias``: ``0`` / ``-inf``
    validity over the slots, broadcastable to ``[B, H, Q, S]``."""
    s = (q.double() @ k_hat.double().transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.double()
    lse = torch.logsumexp(s, -1)
    lam_hi = torch.logsumexp(s + delta, -1) - lse
    lam_lo = torch.logsumexp(s - delta, -1) - lse
    # in log space: p_j e^{delta_j - lam_lo} would be 0 * inf when p underflows and the slack
    # overflows (extreme logits); a row that sees no slot (lse = -inf) contributes nothing
    seen = torch.isfinite(lse).unsqueeze(-1)
    rel = torch.where(seen, s - lse.unsqueeze(-1), -math.inf)  # log p, [B, H, Q, S]
    p = torch.exp(rel)
    v64 = v_hat.double()
    out = p @ v64
    p_up = torch.exp(rel + delta - lam_lo.unsqueeze(-1))
    p_dn = torch.exp(rel - delta - lam_hi.unsqueeze(-1))
    pg = torch.maximum(p_up - p, p - p_dn).clamp(min=0.0)  # p_j g_j
    err = p_up @ eps.double()
    # sum_j p_j g_j |v_j,c - o_c|, a block of slots at a time (memory O(Q x block x Dv))
    for a in range(0, v64.shape[-2], block):
        dev = (v64[..., a : a + block, :].unsqueeze(-3) - out.unsqueeze(-2)).abs()  # [B, H, Q, b, Dv]
        err = err + (pg[..., a : a + block].unsqueeze(-1) * dev).sum(-2)
    n = k_hat.shape[-2] + k_hat.shape[-1] + 16
    vmax = v64.abs().amax(dim=(-2, -1), keepdim=True)  # [B, H, 1, 1]
    err = err + 8.0 * gamma(n, U64) * vmax
    return {"lse_hat": lse, "lam_lo": lam_lo, "lam_hi": lam_hi, "out_hat": out, "err": err,
            "delta_max": delta.amax(-1)}


def widen(cert: Certificate, kept: dict[str, Tensor], delta_d: Tensor, eps_d: Tensor, *, a_q: Tensor,
          n_terms: int, n_tokens: int, vlo: Tensor, vhi: Tensor, evicted_any: Tensor) -> Certificate:
    """Steps 4 and 5: the eviction certificate ``cert`` (over the stored K/V) widened into a
    bound against the original K/V. ``delta_d [B, H, Q]`` (the evicted keys' slack per query),
    ``eps_d [B|1, H, Dv]``, ``a_q [B, H, Q]`` (the logit magnitude of :func:`~.bound.certify`),
    ``evicted_any [B, H, Q]``."""
    dmax = torch.maximum(kept["delta_max"], delta_d)
    eps = rounding_allowance(a_q + dmax, n_terms, n_tokens) + 4.0 * U64
    log_z = cert.log_zhat + delta_d
    lse_lo = kept["lse_hat"] + kept["lam_lo"]
    log_m = log_z - torch.logaddexp(lse_lo, log_z) + eps
    log_m = torch.where(torch.isnan(log_m), 0.0, log_m).clamp(max=0.0)
    log_m = torch.where(evicted_any, log_m, -math.inf)
    mass = log_m.exp()
    o, e = kept["out_hat"], kept["err"]
    ed = eps_d.double().unsqueeze(-2)  # [B, H, 1, Dv]
    vmax = kept["out_hat"].abs().amax(-1, keepdim=True)
    gap = torch.maximum(vhi.double().unsqueeze(-2) + ed - o, o - vlo.double().unsqueeze(-2) + ed) + e
    gap = gap + 4.0 * eps.unsqueeze(-1) * torch.maximum(vmax, vhi.double().abs().amax(-1, keepdim=True).unsqueeze(-2))
    gap = torch.where(evicted_any.unsqueeze(-1), gap, 0.0)
    gap = torch.where(torch.isnan(gap), math.inf, gap)
    error = torch.where(evicted_any.unsqueeze(-1), mass.unsqueeze(-1) * gap, 0.0) + e
    error = torch.where(torch.isnan(error), math.inf, error)
    return Certificate(log_mass=log_m, mass=mass, error=error, gap=gap, lse_kept=kept["lse_hat"],
                       out_kept=o, log_zhat=log_z, block_log_contrib=cert.block_log_contrib)


class QuantErrors:
    """What a :class:`~streamkv.certify.Certifier` keeps for a quantised cache: per layer and
    head, the largest key error bound (per channel, storage basis) and value error (per original
    channel) of any token evicted so far, and the largest ``||k^||_2`` of them. Monotone; cleared
    on reset."""

    def __init__(self, store, num_layers: int) -> None:
        self.store = store
        self.L = num_layers
        self.reset()

    def reset(self) -> None:
        self.dk: list[Tensor | None] = [None] * self.L  # [B, H, D]
        self.ev: list[Tensor | None] = [None] * self.L  # [B, H, Dv]
        self.kn: list[Tensor | None] = [None] * self.L  # [B, H]

    def on_evict(self, layer: int, rows: Tensor, mask: Tensor) -> None:
        """Rows ``[n]`` (slots) of ``layer`` leave, ``mask [H, n]`` says for which heads; call
        before their slots change (:meth:`measure`, then :meth:`absorb`)."""
        self.absorb(layer, self.measure(layer, rows, mask))

    def measure(self, layer: int, rows: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The error bounds of the leaving rows (read while the cache holds them; changes nothing)."""
        codes = self.store
        dk = codes.error_bounds(layer, "k", rows).double().transpose(1, 2)  # [B, H, n, D]
        dv = codes.error_bounds(layer, "v", rows).double().transpose(1, 2)
        v_hat = codes.gather(layer, "v", rows).transpose(1, 2)
        k_hat = codes.gather(layer, "k", rows).transpose(1, 2)
        ev = value_slack(dv, v_hat, codes.basis("v"))
        m = mask.view(1, *mask.shape, 1)
        dk = torch.where(m, dk, 0.0).amax(-2)
        ev = torch.where(m, ev, 0.0).amax(-2)
        kn = torch.where(mask.unsqueeze(0), k_hat.double().norm(dim=-1), 0.0).amax(-1)
        return dk, ev, kn

    def absorb(self, layer: int, measured: tuple[Tensor, Tensor, Tensor]) -> None:
        """Take an applied eviction's bounds (from :meth:`measure`) into the running maxima."""
        for name, new in zip(("dk", "ev", "kn"), measured):
            cur = getattr(self, name)[layer]
            getattr(self, name)[layer] = new if cur is None else torch.maximum(cur, new)

    def widen(self, cert: Certificate, layer: int, qh: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, *,
              scale: float, n_tokens: int, vlo: Tensor, vhi: Tensor, log_count: Tensor) -> Certificate:
        """The certificate of a quantised cache's step (see the module docstring): ``qh [B, H, Q, D]``,
        ``k``/``v`` the stored slots ``[B, H, S, D]``."""
        codes = self.store
        S = k.shape[-2]
        dk = codes.error_bounds(layer, "k").transpose(1, 2)
        dv = codes.error_bounds(layer, "v").transpose(1, 2)
        rk = codes.basis("k")
        delta = logit_slack(qh, dk, k, rk, scale=scale)
        eps = value_slack(dv, v, codes.basis("v"))
        kept = kept_quant_error(qh, k, v, bias, delta, eps, scale=scale)
        B, H, Q, D = qh.shape
        q64 = qh.double()
        if self.dk[layer] is None:
            delta_d = torch.zeros((B, H, Q), dtype=torch.float64, device=qh.device)
            eps_d = torch.zeros((B, H, v.shape[-1]), dtype=torch.float64, device=qh.device)
        else:
            qb = q64 @ rk.double().T if rk is not None else q64
            delta_d = (qb.abs() @ self.dk[layer].unsqueeze(-1)).squeeze(-1) * scale
            if rk is not None:
                delta_d = delta_d + 2.0 * gamma(D, U32) * scale * q64.abs().sum(-1) * self.kn[layer].unsqueeze(-1)
            eps_d = self.ev[layer]
        kmax = k.double().abs().amax(dim=-2)
        lz = cert.log_zhat
        a_q = scale * (q64.abs() @ kmax.unsqueeze(-1)).squeeze(-1) + torch.where(torch.isfinite(lz), lz.abs(), 0.0)
        evicted_any = torch.isfinite(log_count).any(-1, keepdim=True).expand_as(cert.log_zhat)
        n_terms = D + S + log_count.shape[-1] + 8 * (S // 1024 + 2) + 16
        return widen(cert, kept, delta_d, eps_d, a_q=a_q, n_terms=n_terms, n_tokens=n_tokens, vlo=vlo,
                     vhi=vhi, evicted_any=evicted_any)
