"""The whole-history reference: what full attention would have given, checked against every
certificate.

:class:`HistoryCheck` observes a certified cache (a :class:`~streamkv.caches.CacheObserver`
of the cache, and a monitor of its :class:`~streamkv.certify.Certifier`). It keeps every K/V
the cache was ever handed (float64 copies, by position: chunk ``c`` occupies positions
``[c * chunk, (c + 1) * chunk)``, the open chunk holding its latest write), independently of
the cache's slots, summaries and store. At every certified attention step it computes, in
float64, for each query and head:

- the kept set ``K``: the positions the cache's slots (and recall slots) hold for that head;
  the evicted set ``D``: every other position of the history;
- the true dropped mass ``m = Z_D / (Z_K + Z_D)`` from log-sum-exps over ``D`` and ``K``
  (``log m = lse_D - logaddexp(lse_K, lse_D)``: no cancellation, even for ``m ~ 1e-30``);
- the true error ``|o - o_K|`` per channel via the exact identity ``m |o_D - o_K|``
  (:mod:`streamkv.budget.mass`), again with no cancellation between two nearly equal
  outputs.

and compares: a *violation* is a row whose certified mass is below the true mass, or a
channel whose certified error bound is below the true error — exact comparisons of the
computed float64 numbers, no tolerance. It also checks the bookkeeping that makes the check
meaningful: per head, the summaries' active token count must equal ``|D|`` (a summary that
missed tokens could hide a violation; one that double-counts would loosen the bound), and
optionally that the kept slots hold exactly the history's K/V at their positions.

Counts are per *row*: one (query, head) pair of one attention step (layer, denoising pass,
branch). Rows whose head has nothing evicted are counted separately as trivial.
Accumulation stays on the device; :meth:`result` synchronises.
"""

from __future__ import annotations

import time

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..caches import CacheObserver
from ..masks import position_bias, position_mask
from .bound import Certificate

__all__ = ["HistoryCheck", "StepRecord"]


@dataclass
class StepRecord:
    """Per-step (one chunk) aggregates, device tensors until :meth:`HistoryCheck.result`."""

    chunk: int
    rows: int = 0
    nontrivial: Any = 0
    violations: Any = 0
    true_err_max: Any = 0.0
    cert_err_max: Any = 0.0
    true_mass_max: Any = 0.0
    cert_mass_max: Any = 0.0
    oracle_recall: int = 0  # max over the step's attention steps and heads
    recall_in_use: int = 0
    log_ratios: list[Tensor] = field(default_factory=list)
    log_z_ratios: list[Tensor] = field(default_factory=list)
    log_masses: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (log m_hat, log m) per row


class HistoryCheck(CacheObserver):
    """Whole-history float64 reference for a certified cache (one branch, all layers).

    Args:
        certifier: the :class:`~streamkv.certify.Certifier` whose certificates are checked
            (this check observes its cache and receives its certificates).
        check_storage: also verify at every step that each kept slot holds the history's
            K/V at its position (exact equality; costs a gather per step).
        keep_rows: keep every nontrivial row's ``(log m_hat, log m)`` pair (for plots).
        tau: also count rows whose certified error exceeds ``tau`` times their value gap
            (``error > tau * gap`` in some channel, equivalently ``m_hat > tau``): the recall
            guarantee says there are none. And measure the *oracle recall*: per step and head,
            the fewest tokens evicted from the base cache's own slots that an oracle knowing
            the true attention would have to bring back so that every query's true dropped
            mass is ``<= tau`` (tokens taken in order of their largest attention over the
            step's queries) — the floor that certified recall is compared with.
    """

    def __init__(self, certifier, *, check_storage: bool = False, keep_rows: bool = False,
                 tau: float | None = None) -> None:
        self.certifier = certifier
        self.check_storage = check_storage
        self.keep_rows = keep_rows
        self.tau = tau
        self.reset_all()
        certifier.cache.add_observer(self)
        certifier.add_monitor(self)

    def reset_all(self) -> None:
        self._k: dict[int, Tensor] = {}
        self._v: dict[int, Tensor] = {}
        self._chunk = -1
        self.steps: list[StepRecord] = []
        self._dev_acc: dict[str, Tensor] = {}
        self.rows = 0
        self.pairs: list[tuple[Tensor, Tensor]] = []
        self.seconds = 0.0  # host wall time spent checking (not the cache's cost)

    # ------------------------------------------------------------ observer API
    def on_attach(self, cache) -> None:
        if cache.end:
            raise ValueError(f"a whole-history check must see the stream from its start; the cache is at {cache.end}")

    def prepare(self, change):
        if change.what == "load":
            raise RuntimeError("a cache under a whole-history check does not load state dicts (the history would "
                               "not match)")
        return None

    def on_reset(self, cache) -> None:
        self._k.clear()
        self._v.clear()
        self._chunk = -1

    def on_begin(self, cache, chunk_idx: int, advance: bool) -> None:
        self._chunk = chunk_idx
        if not self.steps or self.steps[-1].chunk != chunk_idx:
            self.steps.append(StepRecord(chunk=chunk_idx))

    def on_write(self, cache, layer: int, k: Tensor, v: Tensor) -> None:
        t0 = time.perf_counter()
        try:
            self._record(cache, layer, k, v)
        finally:
            self.seconds += time.perf_counter() - t0

    def on_certificate(self, certifier, layer: int, q: Tensor, cert: Certificate) -> None:
        t0 = time.perf_counter()
        try:
            self._check(certifier, layer, q, cert)
        finally:
            self.seconds += time.perf_counter() - t0

    def _record(self, cache, layer: int, k: Tensor, v: Tensor) -> None:
        start, n = cache.open_span
        need = start + n
        st = cache.storage
        for store, t in ((self._k, k), (self._v, v)):
            t = st.to_heads(t).permute(1, 2, 0, 3)  # [R, n, H, D]
            buf = store.get(layer)
            if buf is None or buf.shape[1] < need:
                new = torch.zeros((t.shape[0], max(need, 2 * (0 if buf is None else buf.shape[1]), 64), *t.shape[2:]),
                                  dtype=torch.float64, device=t.device)
                if buf is not None:
                    new[:, : buf.shape[1]] = buf
                store[layer] = buf = new
            buf[:, start:need] = t.double()

    def _acc(self, name: str, value: Tensor, op: str = "sum") -> None:
        cur = self._dev_acc.get(name)
        if cur is None:
            self._dev_acc[name] = value.detach().clone()
        elif op == "sum":
            self._dev_acc[name] = cur + value
        else:
            self._dev_acc[name] = torch.maximum(cur, value)

    def _check(self, certifier, layer: int, q: Tensor, cert: Certificate) -> None:
        cache = certifier.cache
        N = cache.end
        K = self._k[layer][:, :N].transpose(1, 2)  # [B, H, N, D] float64
        V = self._v[layer][:, :N].transpose(1, 2)
        B, H, _, _ = K.shape
        qh = certifier.query_rows(q).double()  # [R, H, G*Q, D]: rows (group, query)
        Q = qh.shape[2]
        pos = cache.layer_slot_positions(layer)  # [H, S], recall slots included
        kept = torch.zeros((H, N + 1), dtype=torch.bool, device=K.device)
        kept.scatter_(1, torch.where(pos >= 0, pos, N).clamp(max=N), True)
        kept = kept[:, :N]  # [H, N]
        if self.check_storage:
            self._check_storage(cache, layer, pos, N)
        s = (qh @ K.transpose(-1, -2)) * certifier.scale  # [B, H, Q, N]
        if certifier.causal:  # full history for a query at position p: the keys at positions <= p
            qpos = cache.lifecycle.query_positions()
            s = s + position_bias(torch.arange(N, device=K.device), qpos.repeat(Q // qpos.numel()), s.dtype)
        ninf = torch.tensor(-math.inf, dtype=torch.float64, device=K.device)
        keptb = kept.view(1, H, 1, N)
        sk = torch.where(keptb, s, ninf)
        sd = torch.where(keptb, ninf, s)
        lse_k = torch.logsumexp(sk, -1)
        lse_d = torch.logsumexp(sd, -1)
        log_m = lse_d - torch.logaddexp(lse_k, lse_d)  # -inf when D is empty
        o_k = torch.softmax(sk, -1) @ V
        o_d = torch.softmax(sd, -1).nan_to_num(0.0) @ V
        err = log_m.exp().unsqueeze(-1) * (o_d - o_k).abs()  # [B, H, Q, Dv]
        if not cache.storage.store.exact:  # rounded storage: the truth is against what the cache attends to
            err = (log_m.exp().unsqueeze(-1) * (o_d - o_k) + (o_k - self._stored(certifier, layer, qh, pos))).abs()
        n_d = N - kept.sum(-1)  # [H] evicted per head
        nontrivial = (n_d > 0).view(1, H, 1).expand(B, H, Q)
        # bookkeeping: the summaries must cover exactly D
        summ = certifier.summaries[layer]
        active_count = (summ.count * summ.active).sum(-1)  # [H]
        self._acc("count_mismatch", (active_count != n_d).sum(), "sum")
        self._acc("kept_outside_history", (pos >= N).sum(), "sum")
        # a position held by two slots would be counted twice by attention
        self._acc("duplicate_positions", ((pos >= 0).sum(-1) != kept.sum(-1)).sum(), "sum")
        viol_mass = (cert.log_mass < log_m) | (cert.mass < log_m.exp())
        viol_err = (cert.error < err).any(-1)
        viol = viol_mass | viol_err
        self._acc("violations", viol.sum(), "sum")
        self._acc("violations_mass", viol_mass.sum(), "sum")
        self._acc("violations_error", viol_err.sum(), "sum")
        self._acc("nontrivial", nontrivial.sum(), "sum")
        if self.tau is not None:
            self._acc("over_tau", ((cert.error > self.tau * cert.gap).any(-1) | (cert.mass > self.tau)).sum(), "sum")
            self._oracle(certifier, layer, s, N)
        self.rows += B * H * Q
        st = self.steps[-1]
        st.rows += B * H * Q
        st.nontrivial = st.nontrivial + nontrivial.sum()
        st.violations = st.violations + viol.sum()
        zero = torch.zeros((), dtype=torch.float64, device=K.device)
        for name, x in (("true_err_max", err), ("cert_err_max", cert.error), ("true_mass_max", log_m.exp()),
                        ("cert_mass_max", cert.mass)):
            m = x.amax() if x.numel() else zero
            setattr(st, name, torch.maximum(torch.as_tensor(getattr(st, name), dtype=torch.float64,
                                                            device=K.device), m))
        live = nontrivial & torch.isfinite(log_m)
        lr = (cert.log_mass - log_m)[live]
        st.log_ratios.append(lr)
        st.log_z_ratios.append((cert.log_zhat - lse_d)[live])
        st.log_masses.append((cert.log_mass[live], log_m[live]))
        if self.keep_rows:
            self.pairs.append((cert.log_mass[live], log_m[live]))
        self._acc("cert_err_max", cert.error.amax() if cert.error.numel() else zero, "max")
        self._acc("true_err_max", err.amax() if err.numel() else zero, "max")
        self._acc("cert_mass_max", cert.mass.amax(), "max")

    def _stored(self, certifier, layer: int, qh: Tensor, pos: Tensor) -> Tensor:
        """Float64 attention of ``qh`` over what the cache stores (its dequantised slots)."""
        cache = certifier.cache
        st = cache.storage
        k = st.head_view("k", layer).transpose(0, 1).double()  # [R, H, S, D], the stored values
        v = st.head_view("v", layer).transpose(0, 1).double()
        s = (qh @ k.transpose(-1, -2)) * certifier.scale  # [R, H, Q, S]
        qpos = None
        if certifier.causal:
            qpos = cache.lifecycle.query_positions()
            qpos = qpos.repeat(qh.shape[2] // qpos.numel())
        hide = position_mask(pos, qpos)  # [H, Q or 1, S]
        return torch.softmax(s.masked_fill(hide.unsqueeze(0), -math.inf), -1) @ v

    def _oracle(self, certifier, layer: int, s: Tensor, N: int) -> None:
        """Oracle recall need of this step (see the class docstring); one host read per step."""
        H = s.shape[1]
        pos = certifier.main_slot_positions(layer)
        kept = torch.zeros((H, N + 1), dtype=torch.bool, device=s.device)
        kept.scatter_(1, torch.where(pos >= 0, pos, N).clamp(max=N), True)
        kept = kept[:, :N]
        p = torch.softmax(s, -1) * (~kept).view(1, H, 1, N)  # full-history mass on evicted tokens
        score = p.amax(dim=(0, 2))  # [H, N]
        order = score.argsort(-1, descending=True)
        ps = p.gather(-1, order.view(1, H, 1, N).expand_as(p))
        rem = ps.flip(-1).cumsum(-1).flip(-1)  # rem[k] = mass left after recalling the first k
        rem = torch.cat([rem, torch.zeros_like(rem[..., :1])], -1)
        ok = (rem <= self.tau).all(dim=2).all(dim=0)  # [H, N + 1]
        need_h = torch.where(ok, torch.arange(N + 1, device=s.device), N + 1).amin(-1)  # [H]
        self._acc("oracle_recall_total", need_h.sum(), "sum")
        self._acc("recall_held_total", torch.tensor(sum(certifier.recall_held(layer))), "sum")
        st = self.steps[-1]
        st.oracle_recall = max(st.oracle_recall, int(need_h.amax()))
        st.recall_in_use = max(st.recall_in_use, certifier.recall_slots_in_use())

    def _check_storage(self, cache, layer: int, pos: Tensor, N: int) -> None:
        kx = cache.storage.head_view("k", layer).transpose(0, 1).double()  # [R, H, S, D]
        vx = cache.storage.head_view("v", layer).transpose(0, 1).double()
        K = self._k[layer][:, :N].transpose(1, 2)
        V = self._v[layer][:, :N].transpose(1, 2)
        valid = pos >= 0  # [H, S]
        idx = torch.where(valid, pos, 0)
        Kg = K.gather(2, idx.view(1, *idx.shape, 1).expand(K.shape[0], -1, -1, K.shape[-1]))
        Vg = V.gather(2, idx.view(1, *idx.shape, 1).expand(V.shape[0], -1, -1, V.shape[-1]))
        bad = ((Kg != kx).any(-1) | (Vg != vx).any(-1)) & valid.unsqueeze(0)
        self._acc("storage_mismatch", bad.sum(), "sum")

    # ----------------------------------------------------------------- result
    def result(self) -> dict[str, Any]:
        """Totals (synchronises): rows checked, nontrivial rows, violations (mass / error),
        bookkeeping mismatches, tightness quantiles."""
        acc = {k: (v.item() if v.dtype.is_floating_point else int(v)) for k, v in self._dev_acc.items()}
        ratios = self.log_ratios()
        out = {
            "queries_checked": self.rows,
            "nontrivial": acc.get("nontrivial", 0),
            "violations": acc.get("violations", 0),
            "violations_mass": acc.get("violations_mass", 0),
            "violations_error": acc.get("violations_error", 0),
            "count_mismatch": acc.get("count_mismatch", 0),
            "storage_mismatch": acc.get("storage_mismatch", 0),
            "duplicate_positions": acc.get("duplicate_positions", 0),
            "kept_outside_history": acc.get("kept_outside_history", 0),
            "cert_err_max": acc.get("cert_err_max", 0.0),
            "true_err_max": acc.get("true_err_max", 0.0),
            "cert_mass_max": acc.get("cert_mass_max", 0.0),
        }
        if self.tau is not None:
            out["tau"] = self.tau
            out["over_tau"] = acc.get("over_tau", 0)
            out["oracle_recall_peak"] = max((st.oracle_recall for st in self.steps), default=0)
            out["oracle_recall_total"] = acc.get("oracle_recall_total", 0)  # tokens, summed over steps and heads
            out["recall_held_total"] = acc.get("recall_held_total", 0)  # recalled tokens held at attention, same sum
            out["recall_in_use_peak"] = max((st.recall_in_use for st in self.steps), default=0)
        out.update(tightness_stats(ratios))
        out["tightness_by_true_mass"] = self.tightness_by_true_mass()
        zr = self.log_z_ratios()
        z = tightness_stats(zr)
        out["partition_ratio_median"] = z["tightness_median"]
        out["partition_ratio_p95"] = z["tightness_p95"]
        return out

    def tightness_by_true_mass(self, edges: tuple[float, ...] = (0.0, 1e-3, 1e-2, 0.1, 0.5, 1.0)) -> list[dict[str, Any]]:
        """``m_hat / m`` and ``m_hat`` (median, p95) per bucket of the true dropped mass ``m``:
        the looseness is relative, so it matters where ``m`` is small."""
        pairs = [p for st in self.steps for p in st.log_masses]
        if not pairs:
            return []
        lmh = torch.cat([a.detach().cpu() for a, _ in pairs])
        lm = torch.cat([b.detach().cpu() for _, b in pairs])
        m = lm.exp()
        out = []
        for lo, hi in zip(edges, edges[1:]):
            sel = (m >= lo) & ((m < hi) if hi < 1.0 else (m <= hi))
            if not sel.any():
                continue
            r, mh = (lmh - lm)[sel], lmh[sel]
            out.append({"true_mass": [lo, hi], "rows": int(sel.sum()),
                        "ratio_median": float(r.quantile(0.5).exp()), "ratio_p95": float(r.quantile(0.95).exp()),
                        "cert_mass_median": float(mh.quantile(0.5).exp()), "cert_mass_p95": float(mh.quantile(0.95).exp())})
        return out

    def log_z_ratios(self) -> Tensor:
        """Per nontrivial row: ``log(Z_hat / Z_D)`` (the looseness of the evicted partition bound
        alone, before the mass saturates toward 1)."""
        parts = [lr for st in self.steps for lr in st.log_z_ratios]
        if not parts:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat([p.detach().cpu() for p in parts])

    def log_ratios(self) -> Tensor:
        parts = [lr for st in self.steps for lr in st.log_ratios]
        if not parts:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat([p.detach().cpu() for p in parts])

    def step_rows(self) -> list[dict[str, Any]]:
        """Per-step aggregates (synchronises)."""
        out = []
        for st in self.steps:
            lr = torch.cat([p.detach().cpu() for p in st.log_ratios]) if st.log_ratios else torch.zeros(0, dtype=torch.float64)
            t = tightness_stats(lr)
            if st.log_masses:
                lmh = torch.cat([a.detach().cpu() for a, _ in st.log_masses])
                lm = torch.cat([b.detach().cpu() for _, b in st.log_masses])
            med = (lambda x: float(x.quantile(0.5).exp()) if x.numel() else math.nan) if st.log_masses else (
                lambda x: math.nan)
            out.append({
                "chunk": st.chunk, "rows": st.rows, "nontrivial": int(st.nontrivial), "violations": int(st.violations),
                "true_err_max": float(st.true_err_max), "cert_err_max": float(st.cert_err_max),
                "true_mass_max": float(st.true_mass_max), "cert_mass_max": float(st.cert_mass_max),
                "tightness_median": t["tightness_median"], "tightness_p95": t["tightness_p95"],
                "oracle_recall": st.oracle_recall, "recall_in_use": st.recall_in_use,
                "true_mass_median": med(lm) if st.log_masses else math.nan,
                "cert_mass_median": med(lmh) if st.log_masses else math.nan,
            })
        return out


def tightness_stats(log_ratios: Tensor) -> dict[str, float]:
    """Median and p95 of ``m_hat / m`` (from log ratios; NaN when there are none)."""
    if log_ratios.numel() == 0:
        return {"tightness_median": math.nan, "tightness_p95": math.nan, "tightness_max": math.nan, "tightness_rows": 0}
    lr = log_ratios.double()
    return {
        "tightness_median": float(lr.quantile(0.5).exp()) if lr.numel() <= 16_000_000 else math.nan,
        "tightness_p95": float(lr.quantile(0.95).exp()),
        "tightness_max": float(lr.max().exp()),
        "tightness_rows": int(lr.numel()),
    }
