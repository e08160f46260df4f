"""``Certifier``: an observer that certifies every attention step of a cache, and recalls.

Attach one to any cache (ring, chronological, mass, H2O, TOVA); it changes nothing the
cache keeps or evicts::

    caches = CacheSet("ring", spec, recall_slots=64)          # recall slots: a storage option
    cert = Certifier(caches["cond"], recall_tau=0.05)          # observes the cache
    read = caches["cond"].layer(i).update(k, v, q)             # certify (and recall) happen here
    out, _ = attend(q, read)                                   # kept + recalled tokens
    cert.last[i]                                               # the step's Certificate

- ``on_evict``: every evicted ``(token, head)`` is summarised per layer in block summaries
  (:class:`~streamkv.certify.summary.BlockSummaries`) and its K/V offloaded to the host
  (:class:`~streamkv.certify.store.OffloadStore`), before its slot changes. For window
  caches the evicted slots are host arithmetic (``event.shared_slots``): no device read.
- ``on_queries`` (between the write and attention): the step's
  :class:`~streamkv.certify.bound.Certificate`, on the device, without a host sync; with
  recall (``recall_tau`` set and the cache built with ``recall_slots``), the evicted blocks
  contributing most to the bound are copied back from the host into the storage's recall
  slots until every query's ``m_hat <= recall_tau`` (or the slots run out: a *shortfall*).
  Recall needs one host sync per step (the host chooses what to copy).

Recalled tokens hold their real positions; a recalled block stays until its slots are needed
(blocks recalled in earlier chunks are released first) or its summary set is regrouped or
merged; then it returns to the evicted set (its K/V never left the store, so nothing moves).

Scope: the ``[B, T, H, D]`` layout (``seq_dim=1``, heads at dim 2) with RoPE applied before
the write (the keys stored are the keys attention uses). The certificate bounds the eviction
error of the step in exact arithmetic over the stored K/V (:mod:`streamkv.certify.bound`); it
says nothing about the attention kernel's own rounding, nor about the drift an earlier
eviction causes in later layers' inputs. Eager execution only (observers run on the host).
Caches with recall slots refuse state dicts (the summaries and the store are not serialised).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch import Tensor

from ..caches import CacheObserver, CacheSet, EvictionEvent, KVCache
from ..budget.mass import check_tau
from ..storage import check_int
from .bound import Certificate, certify
from .quant_bound import QuantErrors
from .sketch import KeySketch
from .store import OffloadStore
from .summary import BlockSummaries

__all__ = ["Certifier", "CertificateMonitor", "attach", "fold_queries"]


class CertificateMonitor(Protocol):
    """What receives every certificate (the whole-history check implements it)."""

    def on_certificate(self, certifier: Certifier, layer: int, q: Tensor, cert: Certificate) -> None: ...


class Certifier(CacheObserver):
    """Summaries, offload, a certificate per attention step, and recall, for one cache.

    Args:
        cache: the cache to watch (``[B, T, H, D]`` layout).
        recall_tau: recall until every query's ``m_hat <= recall_tau`` (None: never recall);
            needs a cache built with ``recall_slots > 0``.
        box_dtype, events_per_block, pool_events, block_tokens, max_blocks: summary options
            (:class:`~streamkv.certify.summary.BlockSummaries`).
        sketch_bits: 8 or 4: summarise every evicted key by a per-token sketch
            (:class:`~streamkv.certify.sketch.KeySketch`, blocks of ``block_tokens`` tokens
            per head) instead of block boxes: the two-tier cache's middle tier. None: boxes.
        causal: the attention is position-causal (``attend(..., causal=True)``: an LLM's prefill
            chunks): a query sees the kept keys at positions up to its own. Without it every
            query of a span sees the whole span (video chunks).
        scale: the attention softmax scale (default ``1/sqrt(D)``, as ``attend``).
    """

    def __init__(
        self,
        cache: KVCache,
        *,
        recall_tau: float | None = None,
        box_dtype: torch.dtype | None = None,
        events_per_block: int = 1,
        pool_events: int | None = None,
        block_tokens: int = 32,
        max_blocks: int | None = None,
        sketch_bits: int | None = None,
        causal: bool = False,
        scale: float | None = None,
    ) -> None:
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache, got {type(cache).__name__}")
        if len(cache.k_shape) != 4 or cache.seq_dim != 1 or cache.head_dim != 2:
            raise ValueError(
                f"certified caches need the [B, T, H, D] layout (rank 4, seq_dim=1, head_dim=2), got k_shape="
                f"{cache.k_shape} seq_dim={cache.seq_dim} head_dim={cache.head_dim}"
            )
        st = cache.storage
        if recall_tau is not None:
            recall_tau = check_tau(recall_tau, "recall_tau")
            if st.recall_slots == 0:
                raise ValueError("recall_tau needs a cache with recall_slots > 0 (room to bring evicted tokens back)")
            if st.codes is not None:
                raise ValueError("recall_tau with quantised storage is refused: a recalled token would be quantised "
                                 "again from its stored value, and the certificate charges only the second rounding")
        B, _, H, D = cache.k_shape
        self.cache, self.storage = cache, st
        self.recall_tau = recall_tau
        self.batch, self.heads, self.D, self.Dv = B, H, D, cache.v_shape[-1]
        self.scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
        if sketch_bits is None:
            self.summaries = [
                BlockSummaries(batch=B, heads=H, head_dim=D, value_dim=self.Dv, device=cache.device,
                               key_dtype=cache.dtype, value_dtype=cache.dtype, box_dtype=box_dtype,
                               events_per_block=events_per_block, pool_events=pool_events,
                               block_tokens=block_tokens, max_blocks=max_blocks)
                for _ in range(cache.num_layers)
            ]
        else:
            self.summaries = [
                KeySketch(batch=B, heads=H, head_dim=D, value_dim=self.Dv, device=cache.device, bits=sketch_bits,
                          block_tokens=block_tokens, value_dtype=cache.dtype)
                for _ in range(cache.num_layers)
            ]
        self.sketch_bits = sketch_bits
        self.causal = bool(causal)
        self.store = OffloadStore(cache.device)
        self.quant = None if st.codes is None else QuantErrors(st, cache.num_layers)  # quant_bound
        self.monitors: list[CertificateMonitor] = []
        self.last: list[Certificate | None] = [None] * cache.num_layers
        self._recalled: list[list[dict[tuple[int, int], tuple[list[int], int]]]] = []
        self._free: list[list[list[int]]] = []
        self.stats: dict[str, int] = {}
        self._clear()
        cache.add_observer(self)

    def _clear(self) -> None:
        L, H = self.cache.num_layers, self.heads
        # per (layer, head): recalled block key -> (its recall slots, the span it was recalled for),
        # and the free recall slots (sorted)
        self._recalled = [[{} for _ in range(H)] for _ in range(L)]
        self._free = [[list(range(self.storage.recall_slots)) for _ in range(H)] for _ in range(L)]
        self.last = [None] * L
        self.stats = {"steps": 0, "recall_events": 0, "recalled_blocks": 0, "recalled_tokens": 0,
                      "recalled_bytes": 0, "shortfalls": 0, "syncs": 0, "peak_slots_used": 0}

    def add_monitor(self, monitor: CertificateMonitor) -> None:
        """Hand every certificate to ``monitor.on_certificate(...)`` as well."""
        self.monitors.append(monitor)

    # ------------------------------------------------------------ observer hooks
    def on_reset(self, cache: KVCache) -> None:
        for s in self.summaries:
            s.reset()
        if self.quant is not None:
            self.quant.reset()
        self.store.reset()
        self._clear()

    def on_evict(self, event: EvictionEvent) -> None:
        st, cap = self.storage, self.storage.capacity
        for layer in range(self.cache.num_layers):
            if event.shared_slots is not None:  # every head loses the same slots: host-known rows
                rows = torch.tensor(event.shared_slots, dtype=torch.long, device=self.cache.device)
                mask = torch.ones((self.heads, rows.numel()), dtype=torch.bool, device=rows.device)
                counts = [rows.numel()] * self.heads
            else:  # per-head evictions: which rows is data (one read; the commit synchronised anyway)
                ev = event.evicted[layer, :, :cap]  # [H, cap]
                rows = ev.any(0).nonzero().squeeze(1)
                mask = ev.index_select(1, rows)
                counts = mask.sum(-1).tolist()
            if rows.numel() == 0:
                continue
            positions = st.layer_positions(layer).index_select(1, rows)  # [H, n]
            k, v = st.gather(layer, "k", rows), st.gather(layer, "v", rows)  # [B, n, H, D], as stored
            if self.quant is not None:
                self.quant.on_evict(layer, rows, mask)
            eid = self.store.next_id(layer)
            # the store keeps exactly the evicted (token, head) pairs, head-major
            if event.shared_slots is not None:  # every head evicts every row: a reshape, no device read
                B, n, H = k.shape[:3]
                pk, pv = k.transpose(1, 2).reshape(B, H * n, -1), v.transpose(1, 2).reshape(B, H * n, -1)
                pp = positions.reshape(-1)
            else:
                hh, rr = mask.nonzero(as_tuple=True)
                pk, pv, pp = k[:, rr, hh], v[:, rr, hh], positions[hh, rr]
            self.store.put(layer, eid, pk, pv, pp, _offsets(counts))
            labels = self.summaries[layer].add(
                eid, k.transpose(1, 2), v.transpose(1, 2), mask,
                keys_of=lambda events, layer=layer: self.store.keys_of(layer, events),
                invalidate=lambda uids, layer=layer: self._invalidate(layer, uids),
            )
            if self.sketch_bits is not None:  # one token per "block": the store finds it by its label
                self.store.set_labels(layer, eid, labels, mask)

    def on_queries(self, cache: KVCache, layer: int, q: Tensor) -> None:
        if q.shape[2] % self.heads:
            raise ValueError(f"certified attention needs a multiple of the {self.heads} key heads as query heads, "
                             f"got {q.shape[2]}")
        cert = self.certificate(layer, q, keep_contrib=self.recall_tau is not None)
        self.stats["steps"] += 1
        if self.recall_tau is not None:
            cert = self._recall(layer, q, cert)
        self.last[layer] = cert
        for m in self.monitors:
            m.on_certificate(self, layer, q, cert)

    # --------------------------------------------------------------- certificate
    def certificate(self, layer: int, q: Tensor, *, keep_contrib: bool = False) -> Certificate:
        """The certificate of attention of ``q [B, n, Hq, D]`` (the open span's queries; ``Hq`` a
        multiple of the key heads) over ``layer``'s slots now (device work, no sync). Per key
        head, the rows are the query heads it serves times the span's queries
        (:func:`fold_queries`)."""
        s, st = self.summaries[layer], self.storage
        pos = st.layer_positions(layer)  # [H, S]
        hidden = pos < 0
        qh = fold_queries(q, self.heads)  # [B, H, G*n, D]
        if self.causal:  # a query at position p sees the kept keys at positions <= p
            qpos = torch.arange(*self.cache.open_span[0:1], self.cache.end, device=pos.device)
            qpos = qpos.repeat(qh.shape[2] // qpos.numel())  # the rows are (group, query) pairs
            hidden = hidden.unsqueeze(1) | (pos.unsqueeze(1) > qpos.view(1, -1, 1))  # [H, G*n, S]
        else:
            hidden = hidden.unsqueeze(1)
        bias = torch.zeros(hidden.shape, dtype=torch.float64, device=pos.device).masked_fill_(hidden, -math.inf)
        lo, hi = s.boxes()
        k, v = self.cache.keys(layer).transpose(1, 2), self.cache.values(layer).transpose(1, 2)  # as stored
        cert = certify(qh, k, v, bias, lo, hi, s.log_count(), s.vlo, s.vhi, scale=self.scale,
                       n_tokens=self.cache.end, keep_contrib=keep_contrib)
        if self.quant is not None:  # quantised storage: the bound against the original K/V
            cert = self.quant.widen(cert, layer, qh, k, v, bias, scale=self.scale, n_tokens=self.cache.end,
                                    vlo=s.vlo, vhi=s.vhi, log_count=s.log_count())
        return cert

    # -------------------------------------------------------------------- recall
    def recall_slots_in_use(self) -> int:
        """Most recall slots any (layer, head) holds now (host bookkeeping)."""
        R = self.storage.recall_slots
        return max((R - len(free) for per in self._free for free in per), default=0)

    def recall_held(self, layer: int) -> list[int]:
        """Recalled tokens each head of ``layer`` holds now (host bookkeeping)."""
        R = self.storage.recall_slots
        return [R - len(free) for free in self._free[layer]] if self._free else [0] * self.heads

    def main_slot_positions(self, layer: int) -> Tensor:
        """Positions of the slots the policy manages (recall slots excluded): ``[H, cap]``."""
        return self.storage.layer_positions(layer)[:, : self.storage.capacity]

    def _release(self, layer: int, head: int, key: tuple[int, int]) -> None:
        """Return a recalled block to the evicted set: its recall slots emptied, its summary
        active again. Moves no data to or from the host."""
        slots, _ = self._recalled[layer][head].pop(key)
        self.storage.clear_recall(layer, head, slots)
        free = self._free[layer][head]
        free.extend(slots)
        free.sort()
        slot = self.summaries[layer].slot_of(key)
        if slot is not None:
            self.summaries[layer].set_active(head, slot, True)

    def _invalidate(self, layer: int, uids: list[int]) -> None:
        """Summaries are about to regroup or merge these sets: release their recalled blocks."""
        for h in range(self.heads):
            for key in [k for k in self._recalled[layer][h] if k[0] in uids]:
                self._release(layer, h, key)

    def _recall(self, layer: int, q: Tensor, cert: Certificate, max_rounds: int = 6) -> Certificate:
        """Bring back the evicted blocks that contribute most to the bound until every query of
        the step has ``m_hat <= recall_tau`` (or the recall slots are full: a *shortfall*).

        Plan, per head (device, then one host read): rank blocks by their largest contribution
        ``n_b e^{U_b} / Z_K`` over the step's queries; recall the shortest prefix of that order
        after which, for every query, the remaining contributions sum to at most
        ``tau / (1 - tau)`` (then ``m_hat <= tau`` even before the recalled tokens raise
        ``Z_K``). The certificate is then recomputed over the new kept set (the plan is only a
        plan; the guarantee is the recomputed certificate). Recalled blocks stay until their
        slots are needed: blocks recalled for an earlier span are released first.
        """
        tau = self.recall_tau
        target = math.log(tau / (1.0 - tau))
        recalled_any = False
        epoch = self.cache.open_span[0] if self.cache.is_open else self.cache.end
        for _ in range(max_rounds):
            self.stats["syncs"] += 1
            if not bool((cert.mass > tau).any()):  # the one host sync of a recall step
                break
            s = self.summaries[layer]
            contrib = cert.block_log_contrib  # [B, H, Q, NB], -inf for inactive blocks
            B, H, Q, NB = contrib.shape
            over = (cert.mass > tau).any(dim=(0, 2))  # [H]
            order = contrib.amax(dim=(0, 2)).argsort(dim=-1, descending=True)  # [H, NB]
            srt = contrib.gather(-1, order.view(1, H, 1, NB).expand(B, H, Q, NB))
            # rem[k] = log of the contributions left after recalling the first k blocks
            rev = torch.logcumsumexp(srt.flip(-1), dim=-1).flip(-1)
            rem = torch.cat([rev, torch.full_like(rev[..., :1], -math.inf)], dim=-1)  # [B, H, Q, NB + 1]
            ok = (rem <= target).all(dim=2).all(dim=0)  # [H, NB + 1]
            k_needed = torch.where(ok, torch.arange(NB + 1, device=ok.device), NB + 1).amin(-1)  # [H]
            plan_k, order_h, over_h = k_needed.tolist(), order.tolist(), over.tolist()
            counts, active = s.count.tolist(), s.active.tolist()
            progress = False
            for h in range(H):
                if not over_h[h]:
                    continue
                todo = [b for b in order_h[h][: max(1, min(plan_k[h], NB))] if active[h][b] and counts[h][b] > 0]
                need = sum(counts[h][b] for b in todo)
                free = self._free[layer][h]
                if need > len(free):  # make room: release blocks recalled for earlier spans
                    for key in [k for k, (_, e) in self._recalled[layer][h].items() if e < epoch]:
                        self._release(layer, h, key)
                taken, room = [], len(free)
                for b in todo:
                    if counts[h][b] <= room:
                        taken.append(b)
                        room -= counts[h][b]
                if len(taken) < len(todo):
                    self.stats["shortfalls"] += 1  # this (step, head) wanted more than the slots hold
                if taken:
                    self._recall_blocks(layer, h, taken, [counts[h][b] for b in taken], epoch)
                    progress = True
            if not progress:
                break
            recalled_any = True
            cert = self.certificate(layer, q, keep_contrib=True)
        if recalled_any:
            self.stats["recall_events"] += 1
        return cert

    def _recall_blocks(self, layer: int, head: int, blocks: list[int], counts: list[int], epoch: int) -> None:
        """Copy ``blocks`` of ``head`` (``counts`` tokens each) from the host into free recall slots."""
        s = self.summaries[layer]
        ks, vs, ps = [], [], []
        for b, n in zip(blocks, counts):
            events, group = s.recall_rows(head, b)
            k, v, pos = self.store.gather(layer, events, group, head)
            if pos.numel() != n:
                raise RuntimeError(f"store holds {pos.numel()} tokens of block {b} head {head}, summary says {n}")
            ks.append(k)
            vs.append(v)
            ps.append(pos)
        free = self._free[layer][head]
        total = sum(counts)
        slots, self._free[layer][head] = free[:total], free[total:]
        to = self.store.to_device
        k, v, pos = torch.cat(ks, 1), torch.cat(vs, 1), torch.cat(ps)
        self.storage.write_recall(layer, head, slots, to(k).transpose(0, 1), to(v).transpose(0, 1), to(pos))
        at = 0
        for b, n in zip(blocks, counts):
            s.set_active(head, b, False)
            s.seal(b)
            self._recalled[layer][head][s.block_key(b)] = (slots[at : at + n], epoch)
            at += n
        used = self.storage.recall_slots - len(self._free[layer][head])
        self.stats["recalled_blocks"] += len(blocks)
        self.stats["recalled_tokens"] += total
        self.stats["recalled_bytes"] += k.nbytes + v.nbytes
        self.stats["peak_slots_used"] = max(self.stats["peak_slots_used"], used)

    # --------------------------------------------------------------------- report
    def memory(self) -> dict[str, float]:
        """Bytes: kept K/V (main slots, recall slots), summaries, offloaded K/V; and the
        summary/summarised ratio. Synchronises."""
        st = self.storage
        elt = st.keys.element_size()
        per_slot = st.nbytes / st.slots
        summ = sum(s.nbytes for s in self.summaries)
        summarised_rows = sum(int(s.summarised_tokens()) for s in self.summaries)  # (token, head) pairs
        summarised = summarised_rows * self.batch * (self.D + self.Dv) * elt
        return {
            "kept_kv_bytes": int(per_slot * st.capacity),
            "recall_kv_bytes": int(per_slot * st.recall_slots),
            "summary_bytes": summ,
            "summary_peak_bytes": sum(s.peak_bytes for s in self.summaries),
            "summarised_kv_bytes": summarised,
            "summary_bytes_ratio": summ / summarised if summarised else 0.0,
            "offloaded_kv_bytes": self.store.kv_nbytes,
            "offload_store_bytes": self.store.nbytes,
            "summary_blocks": sum(s.nb for s in self.summaries),
            "summary_merges": sum(s.merges for s in self.summaries),
        }


def fold_queries(q: Tensor, heads: int) -> Tensor:
    """``q [B, n, Hq, D]`` -> ``[B, H, (Hq / H) * n, D]``: the query heads each key head serves
    (query head ``h`` reads key head ``h // (Hq / H)``, as transformers' ``repeat_kv``) laid
    out as rows ``(group, query)``."""
    B, n, Hq, D = q.shape
    return q.transpose(1, 2).reshape(B, heads, (Hq // heads) * n, D)


def attach(caches: CacheSet | KVCache, **options: Any) -> dict[str, Certifier] | Certifier:
    """A :class:`Certifier` for a cache, or one per branch of a cache set (by branch name)."""
    if isinstance(caches, CacheSet):
        return {b: Certifier(caches[b], **options) for b in caches.branches}
    return Certifier(caches, **options)


def _offsets(counts: list[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + check_int("count", c))
    return out
