"""Certified caches: the ring and the mass-budget cache, with evicted-token summaries, an
offload store, a certificate at every attention step and (optionally) recall.

:class:`CertifiedRingCache` and :class:`CertifiedMassCache` are the library's
:class:`~streamkv.caches.RingCache` and :class:`~streamkv.caches.MassBudgetCache` plus
:class:`CertifiedMixin`, which adds, without changing what the base cache keeps or evicts:

- an eviction listener: every evicted row is summarised per ``(layer, head)`` block
  (:class:`~streamkv.certify.summary.BlockSummaries`) and its K/V offloaded to the host
  (:class:`~streamkv.certify.store.OffloadStore`) before its slot changes;
- ``observes_queries = True``: the model hands the cache each layer's rotated queries after
  the write and before attention (:meth:`observe_queries`); the cache computes the
  :class:`~streamkv.certify.bound.Certificate` of that attention step there, on the device,
  with no host synchronisation (``last_certificate[layer]``);
- recall (``recall_tau`` set and ``recall_slots > 0``): when a step's certificate exceeds
  ``recall_tau`` for some query, the evicted blocks contributing most to its bound are
  copied back from the host into ``recall_slots`` extra slots per head, until every query of
  the step has ``m_hat <= recall_tau``; attention then reads them with the kept slots.

Recall slots (``R = recall_slots``) extend the buffer: one allocation of
``[num_layers, B, sink + window + R, H, D]``; the base cache owns the first
``sink + window`` slots as before (a view), and :meth:`keys` / :meth:`values` /
:meth:`layer_slot_positions` expose all ``sink + window + R`` so that the model's
``attend`` (masked physical path) reads the recalled tokens too. Recalled tokens hold their
real positions; a recalled block stays until its slots are needed by a later recall (blocks
recalled in earlier chunks are released first) or its summary set is regrouped or merged;
then it returns to the evicted set (its K/V never left the store, so this moves no data)
and its summary becomes active again. A set with a recalled block takes no more events.

Scope and limits:

- Layout ``[B, T, H, D]`` (``seq_dim=1``, heads at dim 2; the DiT's layout) and RoPE applied
  before the write (absolute positions: the keys stored are the keys attention uses). The
  chronological read path does not see recall slots; certified caches are for the physical
  path.
- The certificate bounds the eviction error of the step in exact arithmetic over the
  stored K/V (:mod:`streamkv.certify.bound`); it says nothing about the attention kernel's
  own float32 rounding, nor about the drift an earlier eviction causes in later layers'
  inputs (each step is certified against full-history attention *of its own queries*).
- Recall needs one host synchronisation per attention step to decide whether (and what) to
  fetch: the host must know which blocks to copy. The certificate itself never syncs. The
  ring's eviction bookkeeping is sync-free; the mass cache's syncs once per layer per commit
  (its evicted rows are data-dependent; the mass cache syncs at commit anyway).
- State dicts are refused (summaries and the store are not serialised).
- Eager execution: the certificate and recall run host-side Python inside
  :meth:`observe_queries` (between the write and attention), which a compiled
  ``fullgraph`` step or a captured CUDA graph cannot contain.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch import Tensor

from ..attention import attend, valid_bias
from ..caches.base import EvictionEvent, KVCache, LayerView
from ..caches.cacheset import CacheSet
from ..caches.mass import MassBudgetCache
from ..caches.ring import RingCache
from .bound import Certificate, certify
from .store import OffloadStore
from .summary import BlockSummaries

__all__ = ["CertifiedMixin", "CertifiedRingCache", "CertifiedMassCache", "CertifiedCacheSet", "certified_attend",
           "Monitor", "CERTIFIED_KINDS"]


class Monitor(Protocol):
    """Observer of a certified cache (the whole-history reference implements it)."""

    def on_begin(self, cache: KVCache, chunk_idx: int) -> None: ...
    def on_write(self, cache: KVCache, layer: int, k: Tensor, v: Tensor) -> None: ...
    def on_certificate(self, cache: KVCache, layer: int, q: Tensor, cert: Certificate) -> None: ...
    def on_reset(self, cache: KVCache) -> None: ...


def _ext_shape(shape: tuple[int, ...], extra: int) -> tuple[int, ...]:
    return (shape[0], shape[1] + extra, *shape[2:])


class CertifiedMixin:
    """Adds summaries, offload, certificate and recall to a cache (see the module docstring).

    Keyword args (besides the base cache's):
        recall_slots: extra slots per head for recalled tokens (0: no recall).
        recall_tau: recall until every query's ``m_hat <= recall_tau`` (None: never recall).
        box_dtype, events_per_block, pool_events, block_tokens, max_blocks: summary options
            (:class:`~streamkv.certify.summary.BlockSummaries`).
        scale: the attention softmax scale (default ``1/sqrt(D)``, as ``attend``).
        monitor: an observer (:class:`Monitor`), e.g. the whole-history check.
    """

    observes_queries = True

    def __init__(
        self,
        k_shape,
        v_shape,
        *,
        recall_slots: int = 0,
        recall_tau: float | None = None,
        box_dtype: torch.dtype | None = None,
        events_per_block: int = 1,
        pool_events: int | None = None,
        block_tokens: int = 32,
        max_blocks: int | None = None,
        scale: float | None = None,
        monitor: Monitor | None = None,
        buffers: tuple[Tensor, Tensor] | None = None,
        **kwargs: Any,
    ) -> None:
        k_shape, v_shape = tuple(k_shape), tuple(v_shape)
        if len(k_shape) != 4 or kwargs.get("seq_dim") not in (1, -3):
            raise ValueError(
                f"certified caches need the [B, T, H, D] layout (rank 4, seq_dim=1), got k_shape={k_shape} "
                f"seq_dim={kwargs.get('seq_dim')!r}"
            )
        if isinstance(recall_slots, bool) or not isinstance(recall_slots, int) or recall_slots < 0:
            raise ValueError(f"recall_slots must be an int >= 0, got {recall_slots!r}")
        if recall_tau is not None:
            from ..budget.mass import check_tau

            recall_tau = check_tau(recall_tau, "recall_tau")
            if recall_slots == 0:
                raise ValueError("recall_tau needs recall_slots > 0 (room to bring evicted tokens back)")
        if "head_dim" in kwargs and kwargs["head_dim"] not in (2, -2):
            raise ValueError(f"certified caches need heads at dim 2, got head_dim={kwargs['head_dim']}")
        L = kwargs.get("num_layers", 1)
        dtype = kwargs.get("dtype", torch.float32)
        device = torch.device(kwargs.get("device", "cpu"))
        cap = kwargs["sink"] + kwargs["window"]
        R = recall_slots
        kx_shape = (L, *_ext_shape(k_shape, R))
        vx_shape = (L, *_ext_shape(v_shape, R))
        if k_shape[1] != cap:
            raise ValueError(f"k_shape[1] must equal sink + window = {cap}, got {k_shape[1]} in {k_shape}")
        if buffers is None:
            kx = torch.zeros(kx_shape, dtype=dtype, device=device)
            vx = torch.zeros(vx_shape, dtype=dtype, device=device)
        else:
            kx, vx = buffers
            for name, t, want in (("K", kx, kx_shape), ("V", vx, vx_shape)):
                if not isinstance(t, Tensor) or tuple(t.shape) != want:
                    got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                    raise ValueError(f"buffers {name} must have shape {want} (capacity + recall_slots), got {got}")
        super().__init__(k_shape, v_shape, buffers=(kx[:, :, :cap], vx[:, :, :cap]), **kwargs)
        self._kx, self._vx = kx, vx
        self.recall_slots = R
        self.recall_tau = recall_tau
        if R:
            self.valid_is_prefix = False  # recall slots follow the ring: attention must use the mask
        B, _, H, D = k_shape
        Dv = v_shape[-1]
        self.batch, self.heads_, self.D, self.Dv = B, H, D, Dv
        self.scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
        self.summaries = [
            BlockSummaries(batch=B, heads=H, head_dim=D, value_dim=Dv, device=self.device, key_dtype=dtype,
                           value_dtype=dtype, box_dtype=box_dtype, events_per_block=events_per_block,
                           pool_events=pool_events, block_tokens=block_tokens, max_blocks=max_blocks)
            for _ in range(L)
        ]
        self.store = OffloadStore(self.device)
        self._rpos = torch.full((L, H, R), -1, dtype=torch.long, device=self.device)
        # per (layer, head): recalled block key -> (first recall slot, tokens, chunk recalled in)
        self._recalled: list[list[dict[tuple[int, int], tuple[int, int, int]]]] = [
            [{} for _ in range(H)] for _ in range(L)]
        self.monitor = monitor
        self.last_certificate: list[Certificate | None] = [None] * L
        self.recall_stats = {"steps": 0, "recall_events": 0, "recalled_blocks": 0, "recalled_tokens": 0,
                             "recalled_bytes": 0, "shortfalls": 0, "syncs": 0, "peak_slots_used": 0}
        self.add_eviction_listener(self._summarise_eviction)

    # ------------------------------------------------------------ buffers
    def keys(self, layer: int | None = None) -> Tensor:
        """The key buffer of ``layer`` including the recall slots: ``[B, cap + R, H, D]``."""
        return self._kx[self._check_layer(layer)]

    def values(self, layer: int | None = None) -> Tensor:
        return self._vx[self._check_layer(layer)]

    def layer_slot_positions(self, layer: int | None = None) -> Tensor:
        """Positions per slot, recall slots included: ``[H, cap + R]`` (``[cap]`` for a ring
        without recall slots)."""
        layer = self._check_layer(layer)
        base = super().layer_slot_positions(layer)
        if not self.recall_slots:
            return base
        if base.dim() == 1:
            base = base.expand(self.heads_, -1)
        return torch.cat([base, self._rpos[layer]], dim=-1)

    def main_slot_positions(self, layer: int | None = None) -> Tensor:
        """Positions of the base cache's own slots (recall slots excluded)."""
        return super().layer_slot_positions(self._check_layer(layer))

    def recall_slots_in_use(self) -> int:
        """Most recall slots any (layer, head) holds now (host bookkeeping)."""
        return max((sum(n for _, n, _ in segs.values()) for per_layer in self._recalled for segs in per_layer),
                   default=0)

    @property
    def all_valid(self) -> bool:
        return False if self.recall_slots else super().all_valid

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError(f"{type(self).__name__} does not serialise its summaries and offload store; "
                           "state dicts are refused so that a restored cache cannot certify wrongly")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise RuntimeError(f"{type(self).__name__} does not serialise its summaries and offload store; "
                           "state dicts are refused so that a restored cache cannot certify wrongly")

    # ---------------------------------------------------------- lifecycle
    def begin_chunk(self, chunk_idx: int) -> None:
        super().begin_chunk(chunk_idx)
        if self.monitor is not None:
            self.monitor.on_begin(self, chunk_idx)

    def _on_reset(self) -> None:
        super()._on_reset()
        for s in self.summaries:
            s.reset()
        self.store.reset()
        self._rpos.fill_(-1)
        self._recalled = [[{} for _ in range(self.heads_)] for _ in range(self.num_layers)]
        self.last_certificate = [None] * self.num_layers
        for k in self.recall_stats:
            self.recall_stats[k] = 0
        if self.monitor is not None:
            self.monitor.on_reset(self)

    def _write(self, layer: int, k: Tensor, v: Tensor) -> None:
        super()._write(layer, k, v)
        if self.monitor is not None:
            self.monitor.on_write(self, layer, k, v)

    # ------------------------------------------------------------ eviction
    def _evicted_rows(self, ev: EvictionEvent, layer: int) -> tuple[Tensor, Tensor, Tensor, list[int]]:
        """``(rows [n] slots, mask [H, n], positions [H, n], per-head counts)`` of an event for
        ``layer``: the slots holding evicted tokens, which heads evict each, and what they hold."""
        raise NotImplementedError

    def _summarise_eviction(self, ev: EvictionEvent) -> None:
        for layer in ev.layers:
            rows, mask, positions, counts = self._evicted_rows(ev, layer)
            if rows.numel() == 0:  # nothing left this layer (mass cache: the budget evicted nothing)
                continue
            k = self._k[layer].index_select(1, rows)  # [B, n, H, D]
            v = self._v[layer].index_select(1, rows)
            eid = self.store.next_id(layer)
            # the store keeps exactly the evicted (token, head) pairs, head-major
            if all(c == rows.numel() for c in counts):  # every head evicts every row (ring)
                B, n, H = k.shape[0], k.shape[1], k.shape[2]
                pk = k.transpose(1, 2).reshape(B, H * n, -1)
                pv = v.transpose(1, 2).reshape(B, H * n, -1)
                pp = positions.reshape(-1)
            else:
                hh, rr = mask.nonzero(as_tuple=True)  # head-major order
                pk, pv, pp = k[:, rr, hh], v[:, rr, hh], positions[hh, rr]
            offsets = [0]
            for c in counts:
                offsets.append(offsets[-1] + c)
            self.store.put(layer, eid, pk, pv, pp, offsets)
            self.summaries[layer].add(eid, k.transpose(1, 2), v.transpose(1, 2), mask,
                                      keys_of=lambda events, layer=layer: self.store.keys_of(layer, events),
                                      invalidate=lambda uids, layer=layer: self._invalidate(layer, uids))

    # ---------------------------------------------------------- certificate
    def observe_queries(self, q: Tensor, layer: int | None = None) -> None:
        """Certify (and, with recall, repair) the attention step of ``layer`` for the chunk's
        rotated queries ``q [B, chunk, H, D]``. Called by the model after the write and before
        attention; the result is ``last_certificate[layer]``."""
        layer = self._check_layer(layer)
        self._check_chunk_tensor("q", q, self._chunk_shape_k)
        if self.observes_base_queries:
            super().observe_queries(q, layer)
        cert = self.certificate(layer, q, keep_contrib=self.recall_tau is not None)
        self.recall_stats["steps"] += 1
        if self.recall_tau is not None:
            cert = self._recall(layer, q, cert)
        self.last_certificate[layer] = cert
        if self.monitor is not None:
            self.monitor.on_certificate(self, layer, q, cert)

    observes_base_queries = False

    def certificate(self, layer: int, q: Tensor, *, keep_contrib: bool = False) -> Certificate:
        """The certificate of attention of ``q [B, chunk, H, D]`` over ``layer``'s slots now
        (device work, no sync)."""
        s = self.summaries[layer]
        qh = q.transpose(1, 2)
        k = self.keys(layer).transpose(1, 2)
        v = self.values(layer).transpose(1, 2)
        bias = valid_bias(self.layer_slot_positions(layer), torch.float64)
        return certify(qh, k, v, bias, s.lo, s.hi, s.log_count(), s.vlo, s.vhi, scale=self.scale,
                       n_tokens=self.end, keep_contrib=keep_contrib)

    # ---------------------------------------------------------------- recall
    def _release(self, layer: int, head: int, key: tuple[int, int]) -> None:
        """Return a recalled block to the evicted set: its recall slots empty (positions -1;
        the K/V there are simply ignored), its summary active again. Moves no data."""
        start, n, _ = self._recalled[layer][head].pop(key)
        self._rpos[layer, head, start : start + n] = -1
        slot = self.summaries[layer].slot_of(key)
        if slot is not None:
            self.summaries[layer]._active[head, slot] = True

    def _invalidate(self, layer: int, uids: list[int]) -> None:
        """Summaries are about to regroup or merge these sets: release their recalled blocks."""
        for h in range(self.heads_):
            for key in [k for k in self._recalled[layer][h] if k[0] in uids]:
                self._release(layer, h, key)

    def release_recall(self) -> None:
        """Return every recalled block to the evicted set (no data moves)."""
        for layer in range(self.num_layers):
            for h in range(self.heads_):
                for key in list(self._recalled[layer][h]):
                    self._release(layer, h, key)

    def _alloc(self, layer: int, head: int, n: int) -> int | None:
        """First fit of ``n`` recall slots of ``(layer, head)``; None if no gap is big enough."""
        segs = sorted((st, ln) for st, ln, _ in self._recalled[layer][head].values())
        at = 0
        for st, ln in segs:
            if st - at >= n:
                return at
            at = max(at, st + ln)
        return at if self.recall_slots - at >= n else None

    def _recall(self, layer: int, q: Tensor, cert: Certificate, max_rounds: int = 6) -> Certificate:
        """Bring back the evicted blocks that contribute most to the bound until every query of
        the step has ``m_hat <= recall_tau`` (or the recall slots are full: a *shortfall*).

        Plan, per head (device, then one host read): rank blocks by their largest contribution
        ``n_b e^{U_b} / Z_K`` over the step's queries; recall the shortest prefix of that order
        after which, for every query, the remaining contributions sum to at most
        ``tau / (1 - tau)`` (then ``m_hat <= tau`` even before the recalled tokens raise
        ``Z_K``). The certificate is then recomputed over the new kept set (the plan is only a
        plan; the guarantee is the recomputed certificate). Recalled blocks stay until their
        slots are needed: a block recalled in an earlier chunk is released to make room first.
        """
        tau = self.recall_tau
        target = math.log(tau / (1.0 - tau))
        recalled_any = False
        chunk = self._next_chunk
        for _ in range(max_rounds):
            self.recall_stats["syncs"] += 1
            if not bool((cert.mass > tau).any()):  # the one host sync of a recall step
                break
            s = self.summaries[layer]
            contrib = cert.block_log_contrib  # [B, H, Q, NB], -inf for inactive blocks
            B, H, Q, NB = contrib.shape
            over = (cert.mass > tau).any(dim=(0, 2))  # [H]
            score = contrib.amax(dim=(0, 2))  # [H, NB]
            order = score.argsort(dim=-1, descending=True)  # [H, NB]
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
                        self.recall_stats["shortfalls"] += 1
                        continue
                    self._recall_block(layer, h, b, n, at, chunk)
                    progress = True
            if not progress:
                break
            recalled_any = True
            cert = self.certificate(layer, q, keep_contrib=True)
        if recalled_any:
            self.recall_stats["recall_events"] += 1
        return cert

    def _recall_block(self, layer: int, head: int, block: int, n: int, at: int, chunk: int) -> None:
        s = self.summaries[layer]
        events, group = s.block_events(block)
        k, v, pos = self.store.gather(layer, events, group, head)
        if pos.numel() != n:
            raise RuntimeError(f"store holds {pos.numel()} tokens of block {block} head {head}, summary says {n}")
        cap = self.layout.capacity
        self._kx[layer, :, cap + at : cap + at + n, head] = self.store.to_device(k)
        self._vx[layer, :, cap + at : cap + at + n, head] = self.store.to_device(v)
        self._rpos[layer, head, at : at + n] = self.store.to_device(pos)
        s._active[head, block] = False
        s.seal(block)
        self._recalled[layer][head][s.block_key(block)] = (at, n, chunk)
        used = sum(ln for _, ln, _ in self._recalled[layer][head].values())
        self.recall_stats["recalled_blocks"] += 1
        self.recall_stats["recalled_tokens"] += n
        self.recall_stats["recalled_bytes"] += k.nbytes + v.nbytes
        self.recall_stats["peak_slots_used"] = max(self.recall_stats["peak_slots_used"], used)

    # ---------------------------------------------------------------- report
    def memory(self) -> dict[str, float]:
        """Bytes: kept K/V (main slots, recall slots), summaries, offloaded K/V; and the
        summary/summarised ratio. Synchronises."""
        elt = self._k.element_size()
        main = self._k.nbytes + self._v.nbytes
        recall = self._kx.nbytes + self._vx.nbytes - main
        summ = sum(s.nbytes for s in self.summaries)
        peak = sum(s.peak_bytes for s in self.summaries)
        summarised_rows = sum(int(s.summarised_tokens()) for s in self.summaries)  # (token, head) pairs
        summarised = summarised_rows * self.batch * (self.D + self.Dv) * elt
        return {
            "kept_kv_bytes": main,
            "recall_kv_bytes": recall,
            "summary_bytes": summ,
            "summary_peak_bytes": peak,
            "summarised_kv_bytes": summarised,
            "summary_bytes_ratio": summ / summarised if summarised else 0.0,
            "offloaded_kv_bytes": self.store.kv_nbytes,
            "offload_store_bytes": self.store.nbytes,
            "summary_blocks": sum(s.nb for s in self.summaries),
            "summary_merges": sum(s.merges for s in self.summaries),
        }


class CertifiedRingCache(CertifiedMixin, RingCache):
    """:class:`~streamkv.caches.RingCache` + certificate, offload and recall (see the module
    docstring). Eviction bookkeeping needs no host sync: which positions leave, and from which
    slots, is layout arithmetic on the host."""

    def _evicted_rows(self, ev: EvictionEvent, layer: int) -> tuple[Tensor, Tensor, Tensor, list[int]]:
        # row i of the new chunk (position end + i) takes the slot of position end + i - window,
        # which was retained iff end + i - window >= sink: the chunk's last rows evict
        L = self.layout
        end = L.chunk_start(ev.chunk_idx)
        i0 = max(0, L.sink + L.window - end)
        rows = self._slots[i0:].clone()  # device slots, host-known count: no sync
        n = L.chunk - i0
        pos = self._slot_pos.index_select(0, rows)
        H = self.heads_
        mask = torch.ones((H, n), dtype=torch.bool, device=self.device)
        return rows, mask, pos.expand(H, -1).clone(), [n] * H


class CertifiedMassCache(CertifiedMixin, MassBudgetCache):
    """:class:`~streamkv.caches.MassBudgetCache` + certificate, offload and recall (see the
    module docstring). ``tau`` is the cache's eviction budget; ``recall_tau`` the certificate's
    recall threshold — two different knobs."""

    observes_base_queries = True

    def _evicted_rows(self, ev: EvictionEvent, layer: int) -> tuple[Tensor, Tensor, Tensor, list[int]]:
        ev_mask = ev.evicted  # [H, cap]
        rows = ev_mask.any(0).nonzero().squeeze(1)  # syncs (ragged per head); the commit syncs anyway
        mask = ev_mask.index_select(1, rows)
        pos = self._slot_pos[layer].index_select(1, rows)
        return rows, mask, pos, mask.sum(-1).tolist()


CERTIFIED_KINDS: dict[str, type[KVCache]] = {"ring": CertifiedRingCache, "mass": CertifiedMassCache}


class CertifiedCacheSet(CacheSet):
    """A :class:`~streamkv.caches.CacheSet` of certified caches: one allocation for every
    branch and layer, ``[branches, layers, B, sink + window + recall_slots, H, D]``, so the
    recall slots live next to the kept slots (the rollout accepts it like any cache set).

    Args: as :class:`~streamkv.caches.CacheSet`; ``kind`` is ``"ring"``, ``"mass"`` or a
    certified class; ``monitors`` optionally maps branch names to monitors.
    """

    def __init__(self, kind, *, k_shape, v_shape, seq_dim, sink, window, chunk, num_layers,
                 branches=("cond", "uncond"), dtype=torch.float32, device="cpu",
                 monitors: dict[str, Monitor] | None = None, **cache_kwargs: Any) -> None:
        cls = CERTIFIED_KINDS[kind] if isinstance(kind, str) and kind in CERTIFIED_KINDS else kind
        if not (isinstance(cls, type) and issubclass(cls, CertifiedMixin)):
            raise TypeError(f"kind must be 'ring', 'mass' or a certified cache class, got {kind!r}")
        branches = tuple(branches)
        if not branches or len(set(branches)) != len(branches) or any(not isinstance(b, str) or not b for b in branches):
            raise ValueError(f"branches must be distinct non-empty names, got {branches!r}")
        config = dict(seq_dim=seq_dim, sink=sink, window=window, chunk=chunk, num_layers=num_layers, dtype=dtype,
                      **cache_kwargs)
        cls(k_shape, v_shape, device="meta", **config)  # validate everything before allocating
        R = cache_kwargs.get("recall_slots", 0)
        nb = len(branches)
        self._k = torch.zeros((nb, num_layers, *_ext_shape(tuple(k_shape), R)), dtype=dtype, device=device)
        self._v = torch.zeros((nb, num_layers, *_ext_shape(tuple(v_shape), R)), dtype=dtype, device=device)
        self.kind = cls
        self.branches = branches
        self.num_layers = num_layers
        monitors = monitors or {}
        self._caches = {
            name: cls(k_shape, v_shape, device=device, buffers=(self._k[i], self._v[i]),
                      monitor=monitors.get(name), **config)
            for i, name in enumerate(branches)
        }


def certified_attend(q: Tensor, view: LayerView, **attend_kwargs: Any) -> tuple[Tensor, Any, Certificate]:
    """Attention over a certified cache's layer with its certificate: hands ``q`` to the
    cache (certify, recall if enabled), then attends over the kept and recalled slots.

    Returns ``(out, info, certificate)``; ``attend_kwargs`` go to
    :func:`~streamkv.attention.attend`.
    """
    cache = view.cache
    if not isinstance(cache, CertifiedMixin):
        raise TypeError(f"certified_attend needs a certified cache, got {type(cache).__name__}")
    cache.observe_queries(q, view.index)
    out, info = attend(q, view, **attend_kwargs)
    return out, info, cache.last_certificate[view.index]
