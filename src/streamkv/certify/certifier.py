"""``Certifier``: an observer that certifies every attention step of a cache, and recalls.

Attach one to any cache before it evicts; it changes nothing the cache keeps or evicts::

    caches = CacheSet("ring", spec, recall_slots=64)          # recall slots: a storage option
    cert = Certifier(caches["cond"], recall_tau=0.05)          # observes the cache
    read = caches["cond"].layer(i).update(k, v, q)             # certify (and recall) happen here
    out, _ = attend(q, read)                                   # kept + recalled tokens
    cert.last[i]                                               # the step's Certificate

- Evictions: in ``prepare`` the evicted ``(token, head)`` pairs are gathered (the cache still
  holds them); once the change is applied they are summarised per layer (block boxes,
  :class:`~streamkv.certify.summary.BlockSummaries`, or key sketches,
  :class:`~streamkv.certify.sketch.KeySketch`) and offloaded to the host
  (:class:`~streamkv.certify.store.OffloadStore`). An eviction that is vetoed or refused
  leaves no trace. For window caches the evicted slots are host arithmetic: no device read.
- ``on_queries`` (between the write and attention): the step's
  :class:`~streamkv.certify.bound.Certificate` on the device, without a host sync; with recall
  (``recall_tau``, a cache built with ``recall_slots``), the evicted blocks contributing most
  to the bound are copied back into the recall slots until every query's ``m_hat <=
  recall_tau`` (or the slots run out: a *shortfall*). Recall needs one host sync per step.

Preconditions, refused with the reason: the cache has not evicted yet (a late attach would
miss tokens); one recall owner per cache's recall slots, and recall slots only where a
certifier recalls; key sketches only for caches of at most float32 (the sketch's precision);
a certifier is attached once (a detached one refuses to certify); a cache it watches refuses
``load_state_dict`` (the certifier's state is not in the state dict). If recording an
applied eviction fails (the host store out of memory), the certifier refuses to certify
until the cache is reset. Scope: RoPE applied before the write (the keys stored are the keys
attention uses); the bound is in exact arithmetic over the stored K/V
(:mod:`streamkv.certify.bound`), not the attention kernel's rounding nor an earlier
eviction's drift into later layers' inputs. Eager only (observers run on the host).

Why one module: the observer hooks, the certificate and recall share one piece of state, the
per-(layer, head) bookkeeping of recalled blocks and free recall slots.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch import Tensor

from ..budget.mass import check_tau
from ..caches import CacheObserver, CacheSet, Change, EvictionEvent, KVCache
from ..scoring import fold_groups
from ..masks import position_bias
from ..validate import check_int, check_real
from .bound import Certificate, certify
from .quant_bound import QuantErrors
from .sketch import KeySketch
from .store import OffloadStore
from .summary import BlockSummaries

__all__ = ["Certifier", "CertificateMonitor", "attach"]


class CertificateMonitor(Protocol):
    """What receives every certificate (the whole-history check implements it)."""

    def on_certificate(self, certifier: Certifier, layer: int, q: Tensor, cert: Certificate) -> None: ...


class Certifier(CacheObserver):
    """Summaries, offload, a certificate per attention step, and recall, for one cache.

    Args:
        cache: the cache to watch (any layout with a head dim; ``R`` below is the product of
            the other leading dims, e.g. the batch).
        recall_tau: recall until every query's ``m_hat <= recall_tau`` (None: never recall);
            needs a cache built with ``recall_slots > 0`` that no other certifier recalls into.
        box_dtype, events_per_block, pool_events, block_tokens, max_blocks: summary options
            (:class:`~streamkv.certify.summary.BlockSummaries`).
        sketch_bits: 8 or 4: summarise every evicted key by a per-token sketch
            (:class:`~streamkv.certify.sketch.KeySketch`, blocks of ``block_tokens`` tokens
            per head) instead of block boxes: the two-tier cache's middle tier. None: boxes.
        causal: the attention is position-causal (``attend(..., causal=True)``: an LLM's prefill
            chunks): a query sees the kept keys at positions up to its own. Without it every
            query of a span sees the whole span (video chunks).
        scale: the attention softmax scale (a finite number > 0; default ``1/sqrt(D)``, as ``attend``).
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
        st = cache.storage
        if st.head_dim is None:
            raise ValueError(f"certified caches need a head dimension, got k_shape={cache.k_shape}")
        if not st.store.exact and (len(cache.k_shape) != 4 or cache.seq_dim != 1 or cache.head_dim != 2):
            raise ValueError(f"certified quantised storage needs the [B, T, H, D] layout (rank 4, seq_dim=1, "
                             f"head_dim=2), got k_shape={cache.k_shape} seq_dim={cache.seq_dim} head_dim={cache.head_dim}")
        if recall_tau is not None:
            recall_tau = check_tau(recall_tau, "recall_tau")
            if st.recall_slots == 0:
                raise ValueError("recall_tau needs a cache with recall_slots > 0 (room to bring evicted tokens back)")
            if not st.store.exact:
                raise ValueError("recall_tau with quantised storage is refused: a recalled token would be quantised "
                                 "again from its stored value, and the certificate charges only the second rounding")
        elif st.recall_slots and not any(isinstance(o, Certifier) and o.recall_tau is not None for o in cache.observers):
            raise ValueError(
                f"the cache has {st.recall_slots} recall slots and this certifier does not recall (recall_tau=None): "
                f"nothing would fill them; pass recall_tau or build the cache without recall_slots"
            )
        if sketch_bits is not None:
            if sketch_bits not in (4, 8) or isinstance(sketch_bits, bool):
                raise ValueError(f"sketch_bits must be 8 or 4, got {sketch_bits!r}")
            if torch.finfo(cache.dtype).bits > 32:
                raise ValueError(
                    f"key sketches hold float32 scales and exact float32 keys: a {cache.dtype} cache's keys would be "
                    f"rounded and its certificates could fall below the truth; certify it with block boxes "
                    f"(sketch_bits=None) or store float32"
                )
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
        for name, value, lo in (("events_per_block", events_per_block, 1), ("block_tokens", block_tokens, 1)):
            check_int(name, value, lo)
        for name, value in (("pool_events", pool_events), ("max_blocks", max_blocks)):
            if value is not None:
                check_int(name, value, 1)
        if box_dtype is not None and (not isinstance(box_dtype, torch.dtype) or not box_dtype.is_floating_point):
            raise TypeError(f"box_dtype must be a floating-point torch.dtype or None, got {box_dtype!r}")
        H, D = st.heads, cache.k_shape[-1]
        R = st.head_view("k", 0).shape[1]
        self.cache, self.storage = cache, st
        self.recall_tau = recall_tau
        self.batch, self.heads, self.D, self.Dv = R, H, D, cache.v_shape[-1]
        self.scale = 1.0 / math.sqrt(D) if scale is None else check_real("scale", scale, positive=True)
        if sketch_bits is None:
            self.summaries = [
                BlockSummaries(batch=R, heads=H, head_dim=D, value_dim=self.Dv, device=cache.device,
                               key_dtype=cache.dtype, value_dtype=cache.dtype, box_dtype=box_dtype,
                               events_per_block=events_per_block, pool_events=pool_events,
                               block_tokens=block_tokens, max_blocks=max_blocks)
                for _ in range(cache.num_layers)
            ]
        else:
            self.summaries = [
                KeySketch(batch=R, heads=H, head_dim=D, value_dim=self.Dv, device=cache.device, bits=sketch_bits,
                          block_tokens=block_tokens, value_dtype=cache.dtype)
                for _ in range(cache.num_layers)
            ]
        self.sketch_bits = sketch_bits
        self.causal = causal
        self.store = OffloadStore(cache.device)
        self.quant = None if st.store.exact else QuantErrors(st.store, cache.num_layers)  # quant_bound
        self.monitors: list[CertificateMonitor] = []
        self.last: list[Certificate | None] = [None] * cache.num_layers
        self._recalled: list[list[dict[tuple[int, int], tuple[list[int], int]]]] = []
        self._free: list[list[list[int]]] = []
        self.stats: dict[str, int] = {}
        self.attached = False
        self.broken: str | None = None  # why certificates cannot be trusted (an applied eviction not recorded)
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
    def on_attach(self, cache: KVCache) -> None:
        if self.attached:
            raise ValueError("a certifier is attached once: build a new one (this one would have missed evictions)")
        claim_unevicted(self, cache, "a certifier attached now would miss them and undercount",
                        recalls=self.recall_tau is not None)
        self.attached = True

    def on_detach(self, cache: KVCache) -> None:
        release(self, cache)

    def prepare(self, change: Change):
        if change.what == "load":
            raise RuntimeError(
                "a certified cache does not load state dicts: the certifier's summaries and offload store are not in "
                "the state dict, so its certificates would undercount; build a new cache and certifier"
            )
        if change.what == "reset":
            return self._reset
        if self.broken is not None:
            raise RuntimeError(f"this cache's certifier cannot be trusted ({self.broken}): reset the cache")
        check_reopen(self, change)
        if change.eviction is not None:
            captured = self._capture(change.eviction)
            return lambda: self._record(captured)
        return None

    def _reset(self) -> None:
        for s in self.summaries:
            s.reset()
        if self.quant is not None:
            self.quant.reset()
        self.store.reset()
        self._clear()
        if self.attached and self.storage.recall_owner is self:
            self.broken = None

    def _capture(self, event: EvictionEvent) -> list[tuple]:
        """The evicted ``(token, head)`` pairs of every layer, gathered while the cache still
        holds them (device tensors; nothing of this certifier changes)."""
        st, cap = self.storage, self.storage.capacity
        out = []
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
            positions = event.positions[layer].index_select(1, rows)  # [H, n]
            # as stored (dequantised for quantised storage), per head: [R, H, n, D]
            k = st.to_heads(st.gather(layer, "k", rows)).transpose(0, 1)
            v = st.to_heads(st.gather(layer, "v", rows)).transpose(0, 1)
            # the store keeps exactly the evicted (token, head) pairs, head-major
            if event.shared_slots is not None:  # every head evicts every row: a reshape, no device read
                R, H, n = k.shape[:3]
                pk, pv, pp = k.reshape(R, H * n, -1), v.reshape(R, H * n, -1), positions.reshape(-1)
            else:
                hh, rr = mask.nonzero(as_tuple=True)
                pk, pv, pp = k[:, hh, rr], v[:, hh, rr], positions[hh, rr]
            qerr = self.quant.measure(layer, rows, mask) if self.quant is not None else None
            out.append((layer, k, v, mask, pk, pv, pp, counts, qerr))
        return out

    def _record(self, captured: list[tuple]) -> None:
        """Summarise and offload an applied eviction (see :meth:`_capture`)."""
        try:
            for layer, k, v, mask, pk, pv, pp, counts, qerr in captured:
                if qerr is not None:
                    self.quant.absorb(layer, qerr)
                eid = self.store.next_id(layer)
                self.store.put(layer, eid, pk, pv, pp, _offsets(counts))
                labels = self.summaries[layer].add(
                    eid, k, v, mask,
                    keys_of=lambda events, layer=layer: self.store.keys_of(layer, events),
                    invalidate=lambda uids, layer=layer: self._invalidate(layer, uids),
                )
                if self.sketch_bits is not None:  # one token per "block": the store finds it by its label
                    self.store.set_labels(layer, eid, labels, mask)
        except BaseException as exc:
            self.broken = f"recording an applied eviction failed: {type(exc).__name__}: {exc}"
            raise

    def on_queries(self, cache: KVCache, layer: int, q: Tensor) -> None:
        if self.broken is not None:
            raise RuntimeError(f"this certifier cannot certify: {self.broken}")
        cert = self.certificate(layer, q, keep_contrib=self.recall_tau is not None)
        self.stats["steps"] += 1
        if self.recall_tau is not None:
            cert = self._recall(layer, q, cert)
        self.last[layer] = cert
        for m in self.monitors:
            m.on_certificate(self, layer, q, cert)

    # --------------------------------------------------------------- certificate
    def certificate(self, layer: int, q: Tensor, *, keep_contrib: bool = False) -> Certificate:
        """The certificate of attention of ``q`` (the open span's queries in the layout of the
        cache's rows; a multiple of the key heads) over ``layer``'s slots now (device work, no
        sync). Per key head, the rows are the query heads it serves times the span's queries
        (:meth:`query_rows`)."""
        if self.broken is not None:
            raise RuntimeError(f"this certifier cannot certify: {self.broken}")
        layer = check_int("layer", layer, 0)
        if layer >= len(self.summaries):
            raise ValueError(f"layer must be in [0, {len(self.summaries)}), got {layer}")
        s, st = self.summaries[layer], self.storage
        self._check_queries(q)
        pos = st.layer_positions(layer)  # [H, S]
        qh = self.query_rows(q)  # [R, H, G*n, D]
        qpos = None
        if self.causal:  # a query at position p sees the kept keys at positions <= p
            qpos = self.cache.lifecycle.query_positions()
            qpos = qpos.repeat(qh.shape[2] // qpos.numel())  # the rows are (group, query) pairs
        bias = position_bias(pos, qpos, torch.float64)  # [H, G*n or 1, S]
        lo, hi = s.boxes()
        k, v = st.head_view("k", layer).transpose(0, 1), st.head_view("v", layer).transpose(0, 1)  # as stored
        cert = certify(qh, k, v, bias, lo, hi, s.log_count(), s.vlo, s.vhi, scale=self.scale,
                       n_tokens=self.cache.end, keep_contrib=keep_contrib)
        if self.quant is not None:  # quantised storage: the bound against the original K/V
            cert = self.quant.widen(cert, layer, qh, k, v, bias, scale=self.scale, n_tokens=self.cache.end,
                                    vlo=s.vlo, vhi=s.vhi, log_count=s.log_count())
        return cert

    def _check_queries(self, q: Tensor) -> None:
        """Refuse queries that are not the open span's in the cache's row layout, by name."""
        st, span = self.storage, self.cache.open_span
        if not isinstance(q, Tensor) or q.dim() != len(st.k_shape):
            raise ValueError(f"q must be a tensor of rank {len(st.k_shape)} (the cache's row layout), got "
                             f"{tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__}")
        if q.shape[-1] != st.k_shape[-1]:
            raise ValueError(f"q has {q.shape[-1]} features and the cache's keys {st.k_shape[-1]}")
        if span is None:
            raise ValueError("a certificate is of the open span's queries: no span is open (begin_chunk / begin_tokens)")
        if q.shape[st.seq_dim] != span[1]:
            raise ValueError(f"q has {q.shape[st.seq_dim]} rows along seq_dim {st.seq_dim}; the open span "
                             f"[{span[0]}, {span[0] + span[1]}) has {span[1]}")

    def query_rows(self, q: Tensor) -> Tensor:
        """``q`` in the cache's row layout -> ``[R, H, G * n, D]``: the query heads each key head
        serves (query head ``h`` reads key head ``h // G``) as rows ``(group, query)``."""
        if q.shape[self.storage.head_dim] % self.heads:
            raise ValueError(f"certified attention needs a multiple of the {self.heads} key heads as query heads, "
                             f"got {q.shape[self.storage.head_dim]}")
        return fold_groups(self.storage.to_heads(q), self.heads, 0).transpose(0, 1)

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
            progress = released = False
            for h in range(H):
                if not over_h[h]:
                    continue
                todo = [b for b in order_h[h][: max(1, min(plan_k[h], NB))] if active[h][b] and counts[h][b] > 0]
                need = sum(counts[h][b] for b in todo)
                free = self._free[layer][h]
                if todo and need > len(free):  # make room: release blocks recalled for earlier spans,
                    old = [k for k, (_, e) in self._recalled[layer][h].items() if e < epoch]
                    room = len(free) + sum(len(self._recalled[layer][h][k][0]) for k in old)
                    if old and min(counts[h][b] for b in todo) <= room:  # where that lets a block in
                        for key in old:
                            self._release(layer, h, key)
                        released = True
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
            if released or progress:  # the kept set changed: the certificate is of the cache as it now is
                cert = self.certificate(layer, q, keep_contrib=True)
            if not progress:
                break
            recalled_any = True
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
        slots = free[:total]
        to = self.store.to_device
        k, v, pos = torch.cat(ks, 1), torch.cat(vs, 1), torch.cat(ps)
        self.storage.write_recall(layer, head, slots, to(k).transpose(0, 1), to(v).transpose(0, 1), to(pos))
        self._free[layer][head] = free[total:]  # after the write (which may refuse: copy on write of shared pages)
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
        elt = st.dtype.itemsize
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


def claim_unevicted(observer: Any, cache: KVCache, why: str, *, recalls: bool) -> None:
    """The attach preconditions of an observer that must see every eviction (a certifier, a
    compressed tier): the cache has evicted nothing yet, and at most one observer recalls into
    its recall slots (``recalls``: this one claims them). Raises ``ValueError`` naming the value."""
    st = cache.storage
    if cache.rope_at_read is not None:
        raise ValueError(
            f"{type(observer).__name__} bounds attention over keys as the cache stores them, and this cache stores raw "
            f"keys rotated at every read by a position map (rope_at_read): the keys it attends are not the keys it "
            f"holds, evicts or recalls; certify a cache that stores keys rotated at write")
    held = (st.slot_positions[..., : st.capacity] >= 0).sum(-1)  # [L, H]: one sync, at attach
    if cache.end and int(held.min()) < cache.end:
        raise ValueError(
            f"the cache has already evicted (it holds as few as {int(held.min())} of the {cache.end} positions "
            f"that entered a head): {why}; attach it before the first eviction (or reset the cache)"
        )
    if recalls:
        if st.recall_owner is not None:
            raise ValueError("another observer recalls into this cache's recall slots: one recall owner per cache")
        st.own_recall_pages(f"attaching {type(observer).__name__} (its recall slots' pages, shared with a branch)")
        st.recall_owner = observer


def check_reopen(observer: Any, change: Change) -> None:
    """Veto reopening a span some of whose positions the last commit evicted (a policy without
    ``protect_newest``): ``observer`` holds them as evicted (recalled, or in a compressed tier),
    and the reopened span would hold them again -- one position attended twice."""
    cache = change.cache
    if change.what != "begin" or change.advance or getattr(cache.policy, "protect_newest", True):
        return
    start, n = change.span
    pos = cache.storage.slot_positions[..., : cache.storage.capacity]
    held = ((pos >= start) & (pos < start + n)).sum(-1)  # [L, H]: one sync, at a reopen
    if int(held.min()) < n:
        raise ValueError(
            f"reopening positions [{start}, {start + n}) after the commit that evicted some of them: "
            f"{type(observer).__name__} holds those as evicted, and the reopened span would hold them again (one "
            f"position attended twice); a certified or tiered cache cannot reopen such a span (build it with "
            f"protect_newest=True, or do not reopen)")


def release(observer: Any, cache: KVCache) -> None:
    """On detach: give back the recall slots, emptied (no one keeps their tokens current any more:
    the reads are the policy's own tokens again), and mark ``observer`` broken (it no longer sees
    evictions)."""
    st = cache.storage
    if st.recall_owner is observer:
        st.recall_owner = None
        every = list(range(st.recall_slots))
        for layer in range(st.num_layers):
            for head in range(st.heads):
                st.clear_recall(layer, head, every)
    observer.broken = "it was detached from its cache (it no longer sees evictions)"
