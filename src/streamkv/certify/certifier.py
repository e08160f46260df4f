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
from .store import OffloadStore
from .summary import BlockSummaries

__all__ = ["Certifier", "CertificateMonitor", "attach"]


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
        B, _, H, D = cache.k_shape
        self.cache, self.storage = cache, st
        self.recall_tau = recall_tau
        self.batch, self.heads, self.D, self.Dv = B, H, D, cache.v_shape[-1]
        self.scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
        self.summaries = [
            BlockSummaries(batch=B, heads=H, head_dim=D, value_dim=self.Dv, device=cache.device, key_dtype=cache.dtype,
                           value_dtype=cache.dtype, box_dtype=box_dtype, events_per_block=events_per_block,
                           pool_events=pool_events, block_tokens=block_tokens, max_blocks=max_blocks)
            for _ in range(cache.num_layers)
        ]
        self.store = OffloadStore(cache.device)
        self.monitors: list[CertificateMonitor] = []
        self.last: list[Certificate | None] = [None] * cache.num_layers
        self._recalled: list[list[dict[tuple[int, int], tuple[int, int, int]]]] = []
        self.stats: dict[str, int] = {}
        self._clear()
        cache.add_observer(self)

    def _clear(self) -> None:
        L, H = self.cache.num_layers, self.heads
        # per (layer, head): recalled block key -> (first recall slot, tokens, chunk recalled in)
        self._recalled = [[{} for _ in range(H)] for _ in range(L)]
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
            k = st.keys[layer].index_select(1, rows)  # [B, n, H, D]
            v = st.values[layer].index_select(1, rows)
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
            self.summaries[layer].add(
                eid, k.transpose(1, 2), v.transpose(1, 2), mask,
                keys_of=lambda events, layer=layer: self.store.keys_of(layer, events),
                invalidate=lambda uids, layer=layer: self._invalidate(layer, uids),
            )

    def on_queries(self, cache: KVCache, layer: int, q: Tensor) -> None:
        if q.shape[2] != self.heads:
            raise ValueError(f"certified attention needs one query head per key head, got {q.shape[2]} and {self.heads}")
        cert = self.certificate(layer, q, keep_contrib=self.recall_tau is not None)
        self.stats["steps"] += 1
        if self.recall_tau is not None:
            cert = self._recall(layer, q, cert)
        self.last[layer] = cert
        for m in self.monitors:
            m.on_certificate(self, layer, q, cert)

    # --------------------------------------------------------------- certificate
    def certificate(self, layer: int, q: Tensor, *, keep_contrib: bool = False) -> Certificate:
        """The certificate of attention of ``q [B, chunk, H, D]`` over ``layer``'s slots now
        (device work, no sync)."""
        s, st = self.summaries[layer], self.storage
        pos = st.layer_positions(layer)
        bias = torch.zeros(pos.shape, dtype=torch.float64, device=pos.device).masked_fill_(pos < 0, -math.inf)
        return certify(q.transpose(1, 2), st.keys[layer].transpose(1, 2), st.values[layer].transpose(1, 2),
                       bias.unsqueeze(-2), s.lo, s.hi, s.log_count(), s.vlo, s.vhi, scale=self.scale,
                       n_tokens=self.cache.end, keep_contrib=keep_contrib)

    # -------------------------------------------------------------------- recall
    def recall_slots_in_use(self) -> int:
        """Most recall slots any (layer, head) holds now (host bookkeeping)."""
        return max((sum(n for _, n, _ in segs.values()) for per in self._recalled for segs in per), default=0)

    def main_slot_positions(self, layer: int) -> Tensor:
        """Positions of the slots the policy manages (recall slots excluded): ``[H, cap]``."""
        return self.storage.layer_positions(layer)[:, : self.storage.capacity]

    def _release(self, layer: int, head: int, key: tuple[int, int]) -> None:
        """Return a recalled block to the evicted set: its recall slots emptied, its summary
        active again. Moves no data to or from the host."""
        start, n, _ = self._recalled[layer][head].pop(key)
        self.storage.clear_recall(layer, head, start, n)
        slot = self.summaries[layer].slot_of(key)
        if slot is not None:
            self.summaries[layer].set_active(head, slot, True)

    def _invalidate(self, layer: int, uids: list[int]) -> None:
        """Summaries are about to regroup or merge these sets: release their recalled blocks."""
        for h in range(self.heads):
            for key in [k for k in self._recalled[layer][h] if k[0] in uids]:
                self._release(layer, h, key)

    def _alloc(self, layer: int, head: int, n: int) -> int | None:
        """First fit of ``n`` recall slots of ``(layer, head)``; None if no gap is big enough."""
        segs = sorted((st, ln) for st, ln, _ in self._recalled[layer][head].values())
        at = 0
        for st, ln in segs:
            if st - at >= n:
                return at
            at = max(at, st + ln)
        return at if self.storage.recall_slots - at >= n else None

    def _recall(self, layer: int, q: Tensor, cert: Certificate, max_rounds: int = 6) -> Certificate:
        """Bring back the evicted blocks that contribute most to the bound until every query of
        the step has ``m_hat <= recall_tau`` (or the recall slots are full: a *shortfall*).

        Plan, per head (device, then one host read): rank blocks by their largest contribution
        ``n_b e^{U_b} / Z_K`` over the step's queries; recall the shortest prefix of that order
        after which, for every query, the remaining contributions sum to at most
        ``tau / (1 - tau)`` (then ``m_hat <= tau`` even before the recalled tokens raise
        ``Z_K``). The certificate is then recomputed over the new kept set (the plan is only a
        plan; the guarantee is the recomputed certificate).
        """
        tau = self.recall_tau
        target = math.log(tau / (1.0 - tau))
        recalled_any = False
        chunk = self.cache.next_chunk
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
                for b in todo:
                    n = counts[h][b]
                    at = self._alloc(layer, h, n)
                    if at is None:  # make room: release blocks recalled in earlier chunks
                        for key in [k for k, (_, _, c) in self._recalled[layer][h].items() if c < chunk]:
                            self._release(layer, h, key)
                        at = self._alloc(layer, h, n)
                    if at is None:
                        self.stats["shortfalls"] += 1
                        continue
                    self._recall_block(layer, h, b, n, at, chunk)
                    progress = True
            if not progress:
                break
            recalled_any = True
            cert = self.certificate(layer, q, keep_contrib=True)
        if recalled_any:
            self.stats["recall_events"] += 1
        return cert

    def _recall_block(self, layer: int, head: int, block: int, n: int, at: int, chunk: int) -> None:
        s = self.summaries[layer]
        events, group = s.block_events(block)
        k, v, pos = self.store.gather(layer, events, group, head)
        if pos.numel() != n:
            raise RuntimeError(f"store holds {pos.numel()} tokens of block {block} head {head}, summary says {n}")
        to = self.store.to_device
        self.storage.write_recall(layer, head, at, to(k).transpose(0, 1), to(v).transpose(0, 1), to(pos))
        s.set_active(head, block, False)
        s.seal(block)
        self._recalled[layer][head][s.block_key(block)] = (at, n, chunk)
        used = sum(ln for _, ln, _ in self._recalled[layer][head].values())
        self.stats["recalled_blocks"] += 1
        self.stats["recalled_tokens"] += n
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
