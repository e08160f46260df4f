"""``CompressedTier``: what a full-precision cache evicts, kept on the device quantised and
*attended*, certified against float64 full history, with exact recall from the host of the
blocks the certificate blames.

    cache = KVCache(..., policy="tova", recall_slots=R)       # tier 1: full precision
    tier = CompressedTier(cache, fmt="int4", capacity=M, recall_tau=0.01, causal=True)
    read = cache.layer(i).update(k, v, q)                      # on_queries: certificate (+ recall)
    out = tier.attend(i, q, read)                              # tiers 1 + 2 and the recall slots, one softmax
    tier.last[i]                                               # the step's Certificate

Per (layer, head):

1. **full precision** (the cache): sinks, the open span, what its policy keeps (TOVA keeps the
   tokens it ranks highest), and its recall slots.
2. **compressed** (device): the last ``capacity`` tokens the policy evicted, in eviction order,
   K and V as codes and scales of a :data:`~streamkv.quant.KV_FORMATS` format (its own
   ``encode`` / ``decode`` / ``error_bound``) in a ring of ``capacity`` entries; attended
   (decoded) unless recalled.
3. **beyond the horizon**: tokens pushed out of tier 2, a block (``block`` consecutive entries)
   at a time: a count and the box of the block's original keys (exact float32 min / max, from
   the host copy); bounded, not attended.
4. **host**: every evicted token's original K/V; entry ``e`` of a head is its ``e``-th evicted
   token, so block ``b`` is entries ``[b * block, (b + 1) * block)``: a slice.

**The certificate** (per query, against full-history attention over the original K/V) is
:mod:`.quant_bound`'s: the kept set is tiers 1 (slack 0) and 2 (the format's per-element
bound), the evicted set tier 3's boxes; tier 3 bounds the *original* keys and values, so the
evicted part needs no widening (``Delta_D = eps_D = 0``). Proofs: :mod:`.bound`, :mod:`.quant_bound`.

**Recall**, planned once per span (a video chunk's first denoising pass; the later passes of
the same span keep it): per head, tier 2 and 3 blocks ranked by an estimate of their part of
the bound; the shortest prefix after which every query's L-inf error bound would be
``<= recall_tau x`` the head's value range (max - min of every value written so far) is copied
from the host into the recall slots, its tier-2 entries masked; the certificate is then
recomputed (the guarantee is that certificate, not the plan). Blocks recalled for an earlier
span are released when their slots are needed. ``stats["h2d_bytes"]`` counts what was copied.

Refused with the reason: a cache that is not ``[B, T, H, D]`` (rank 4, seq_dim 1, head_dim 2),
quantised storage (tier 1 is the full-precision tier), a cache that has already evicted,
recall slots without ``recall_tau`` or ``recall_tau`` without recall slots (fewer than a block),
a second recall owner, a state-dict load,
a capacity that is not a positive multiple of ``block``. Scope: eager, RoPE at write, the
identity basis.

Why one module: the observer hooks, the certificate and recall share one piece of state, the
per-(layer, head) entry, block and recall-slot bookkeeping. Why this long: the tiers and the
recall plan are this class's definition.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import Tensor

from ..budget.mass import check_tau
from ..caches import CacheObserver, Change, KVCache
from ..quant import KVQuant
from ..scoring import fold_groups
from ..storage import position_bias
from ..stores import Segment
from ..validate import check_int, check_real
from .bound import Certificate, certify
from .certifier import check_reopen, claim_unevicted, release
from .quant_bound import kept_quant_error, logit_slack, value_slack, widen

__all__ = ["CompressedTier"]


class CompressedTier(CacheObserver):
    """Tiers 2 and 3 and the host copy for one full-precision cache (see the module docstring).

    Args:
        cache: tier 1, a full-precision ``[B, T, H, D]`` cache of any evicting kind.
        fmt: the tier-2 format (a name of :data:`~streamkv.quant.KV_FORMATS`); ``group``: channels
            per scale (default: the whole head).
        capacity: tier-2 entries per (layer, head), a multiple of ``block``.
        block: entries per block (the unit of recall and of tier 3).
        recall_tau: recall until every query's certified L-inf error is ``<= recall_tau x`` the
            head's value range (None: no recall; the cache must then have no recall slots).
        causal: position-causal queries (an LLM's prefill chunks), as :func:`~streamkv.attention.attend`.
        scale: the softmax scale (default ``1/sqrt(D)``).
        certify: compute every step's certificate (``last``); ``False`` (only without recall,
            which plans from it): the tiers attend, nothing is certified (``last`` stays None).
    """

    def __init__(self, cache: KVCache, *, fmt: str = "int8", group: int | None = None, capacity: int,
                 block: int = 16, recall_tau: float | None = None, causal: bool = False,
                 scale: float | None = None, certify: bool = True) -> None:
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache, got {type(cache).__name__}")
        st = cache.storage
        if len(cache.k_shape) != 4 or cache.seq_dim != 1 or cache.head_dim != 2:
            raise ValueError(f"the compressed tier needs the [B, T, H, D] layout (rank 4, seq_dim=1, head_dim=2), got "
                             f"k_shape={cache.k_shape} seq_dim={cache.seq_dim} head_dim={cache.head_dim}")
        if not st.store.exact:
            raise ValueError("the compressed tier's tier 1 is full precision: build the cache without quant= (tier 2 "
                             "holds the quantised history)")
        block = check_int("block", block, 1)
        capacity = check_int("capacity", capacity, 1)
        if capacity % block:
            raise ValueError(f"capacity must be a multiple of block ({block}), got {capacity}")
        for name, flag in (("causal", causal), ("certify", certify)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")
        if recall_tau is not None and not certify:
            raise ValueError("recall plans from the certificate: recall_tau needs certify=True")
        if recall_tau is not None:
            recall_tau = check_tau(recall_tau, "recall_tau")
            if st.recall_slots < block:
                raise ValueError(f"recall_tau needs a cache with recall_slots >= block ({block}), got {st.recall_slots}")
        elif st.recall_slots:
            raise ValueError(f"the cache has {st.recall_slots} recall slots and recall_tau is None: nothing would fill "
                             f"them; pass recall_tau or build the cache without recall_slots")
        self.quant = KVQuant(fmt, group=group)  # the format registry checks the name and the group
        D, Dv = cache.k_shape[-1], cache.v_shape[-1]
        self.quant.check(D, Dv)
        self.kf, self.vf = self.quant.key_format, self.quant.value_format
        self.gk, self.gv = self.quant.groups(D, Dv)
        self.cache, self.storage = cache, st
        self.L, self.B, self.H, self.D, self.Dv = cache.num_layers, cache.k_shape[0], st.heads, D, Dv
        self.M, self.block, self.recall_tau, self.causal, self.certifies = capacity, block, recall_tau, causal, certify
        self.scale = 1.0 / math.sqrt(D) if scale is None else check_real("scale", scale, positive=True)
        dev, L, B, H, M = cache.device, self.L, self.B, self.H, capacity
        self.k_codes = torch.zeros((L, B, H, M, self.kf.code_width(D)), dtype=torch.uint8, device=dev)
        self.v_codes = torch.zeros((L, B, H, M, self.vf.code_width(Dv)), dtype=torch.uint8, device=dev)
        self.k_scale = (torch.zeros((L, B, H, M, D // self.gk), dtype=torch.bfloat16, device=dev)
                        if self.kf.scaled else None)
        self.v_scale = (torch.zeros((L, B, H, M, Dv // self.gv), dtype=torch.bfloat16, device=dev)
                        if self.vf.scaled else None)
        self.live = torch.zeros((L, H, M), dtype=torch.bool, device=dev)
        self.entry_pos = torch.full((L, H, M), -1, dtype=torch.long, device=dev)  # the position each entry holds
        self._slot = torch.arange(M, device=dev)
        self.attached = False
        self.broken: str | None = None
        self._clear()
        cache.add_observer(self)

    def _clear(self) -> None:
        L, H, B, D, Dv, dev = self.L, self.H, self.B, self.D, self.Dv, self.cache.device
        self.k_codes.zero_()
        self.v_codes.zero_()
        for s in (self.k_scale, self.v_scale):
            if s is not None:
                s.zero_()
        self.live.zero_()
        self.entry_pos.fill_(-1)
        self.lo = [torch.zeros((B, H, 0, D), dtype=self.cache.dtype, device=dev) for _ in range(L)]
        self.hi = [torch.zeros((B, H, 0, D), dtype=self.cache.dtype, device=dev) for _ in range(L)]
        self.log_count = [torch.zeros((1, H, 0), dtype=torch.float64, device=dev) for _ in range(L)]
        self.vlo = torch.full((L, B, H, Dv), math.inf, dtype=torch.float64, device=dev)
        self.vhi = torch.full((L, B, H, Dv), -math.inf, dtype=torch.float64, device=dev)
        self.vmin = torch.full((L, H), math.inf, dtype=torch.float64, device=dev)
        self.vmax = torch.full((L, H), -math.inf, dtype=torch.float64, device=dev)
        self.host: list[list[list[tuple[Tensor, Tensor, Tensor]]]] = [[[] for _ in range(H)] for _ in range(L)]
        self._host_cat: dict[tuple[int, int], tuple[int, Tensor, Tensor, Tensor]] = {}
        self.count = [[0] * H for _ in range(L)]  # entries appended per (layer, head)
        self.frontier = [[0] * H for _ in range(L)]  # blocks < frontier are in tier 3
        self._recalled: list[list[dict[int, tuple[list[int], int]]]] = [[{} for _ in range(H)] for _ in range(L)]
        self._free = [[list(range(self.storage.recall_slots)) for _ in range(H)] for _ in range(L)]
        self._planned: list[int | None] = [None] * L
        self.last: list[Certificate | None] = [None] * L
        self.stats: dict[str, Any] = {"steps": 0, "plans": 0, "recalled_blocks": 0, "recalled_tokens": 0,
                                      "h2d_bytes": 0, "shortfalls": 0, "dropped_blocks": 0, "box_bytes_peak": 0,
                                      "certify_seconds": 0.0, "h2d_bytes_per_span": []}

    # ------------------------------------------------------------------ sizes
    @property
    def nbytes(self) -> int:
        """Device bytes of tiers 2 and 3: codes, scales, the live mask, boxes, counts, value boxes."""
        t2 = sum(t.nbytes for t in (self.k_codes, self.v_codes, self.k_scale, self.v_scale, self.live) if t is not None)
        t3 = sum(a.nbytes + b.nbytes + c.nbytes for a, b, c in zip(self.lo, self.hi, self.log_count))
        return t2 + t3 + self.vlo.nbytes + self.vhi.nbytes + self.vmin.nbytes + self.vmax.nbytes

    @property
    def host_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes + p.nbytes for per in self.host for rows in per for k, v, p in rows)

    def bytes_per_entry(self) -> int:
        """Device bytes of one tier-2 entry (one token of one head, all of B): codes, scales, live flag."""
        return self.B * self.quant.bytes_per_token(self.D, self.Dv) + 1

    # ------------------------------------------------------------ observer hooks
    def on_attach(self, cache: KVCache) -> None:
        if self.attached:
            raise ValueError("a compressed tier is attached once: build a new one")
        claim_unevicted(self, cache, "the compressed tier would miss them", recalls=self.recall_tau is not None)
        self.attached = True

    def on_detach(self, cache: KVCache) -> None:
        release(self, cache)

    def prepare(self, change: Change):
        if change.what == "load":
            raise RuntimeError("a cache with a compressed tier does not load state dicts: tiers 2 and 3 and the host "
                               "copy are not in the state dict; build a new cache and tier")
        if change.what == "reset":
            return self._reset
        if self.broken is not None:
            raise RuntimeError(f"this cache's compressed tier cannot be trusted ({self.broken}): reset the cache")
        check_reopen(self, change)
        if change.eviction is not None:
            captured = self._capture(change.eviction)
            return lambda: self._record(captured)
        return None

    def _reset(self) -> None:  # the cache's reset zeroed its slots, recall slots included
        self._clear()
        if self.attached:
            self.broken = None

    def on_write(self, cache: KVCache, layer: int, k: Tensor, v: Tensor) -> None:
        """The value range per head (the scale of ``recall_tau``): every value written."""
        v64 = v.detach().double()
        self.vmin[layer] = torch.minimum(self.vmin[layer], v64.amin(dim=(0, 1, 3)))
        self.vmax[layer] = torch.maximum(self.vmax[layer], v64.amax(dim=(0, 1, 3)))

    def _capture(self, event) -> list[tuple[int, list[tuple[Tensor, Tensor, Tensor]]]]:
        """Per layer, per head: the evicted tokens' K/V ``[B, n, D]`` and positions ``[n]`` by
        position, gathered while the cache still holds them (nothing of this tier changes)."""
        st, cap = self.storage, self.storage.capacity
        out = []
        for layer in range(self.L):
            ev = event.evicted[layer, :, :cap]  # [H, cap]
            hh, ss = ev.nonzero(as_tuple=True)  # one device read (the commit synchronised anyway)
            if hh.numel() == 0:
                continue
            pos = event.positions[layer].expand(self.H, -1)[hh, ss]
            order = torch.argsort(hh * (int(pos.max()) + 1) + pos)
            hh, ss, pos = hh[order], ss[order], pos[order]
            k = st.head_view("k", layer)[hh, :, ss]  # [n, B, D]
            v = st.head_view("v", layer)[hh, :, ss]
            counts = torch.bincount(hh, minlength=self.H).tolist()
            per, at = [], 0
            for h in range(self.H):
                n = counts[h]
                per.append((k[at:at + n].transpose(0, 1).clone(), v[at:at + n].transpose(0, 1).clone(), pos[at:at + n].clone()))
                at += n
            out.append((layer, per))
        return out

    def _record(self, captured: list) -> None:
        try:
            for layer, per in captured:
                for h, (k, v, pos) in enumerate(per):
                    if pos.numel():
                        self._append(layer, h, k, v, pos)
        except BaseException as exc:
            self.broken = f"recording an applied eviction failed: {type(exc).__name__}: {exc}"
            raise

    # -------------------------------------------------------------- tier 2 / 3
    def _host_rows(self, layer: int, h: int, a: int, b: int) -> tuple[Tensor, Tensor, Tensor]:
        """Host K ``[B, n, D]``, V, positions of entries ``[a, b)`` of ``(layer, h)``."""
        key = (layer, h)
        n = len(self.host[layer][h])
        if key not in self._host_cat or self._host_cat[key][0] != n:
            rows = self.host[layer][h]
            self._host_cat[key] = (n, torch.cat([r[0] for r in rows], 1), torch.cat([r[1] for r in rows], 1),
                                   torch.cat([r[2] for r in rows]))
        _, k, v, p = self._host_cat[key]
        return k[:, a:b], v[:, a:b], p[a:b]

    def _append(self, layer: int, h: int, k: Tensor, v: Tensor, pos: Tensor) -> None:
        """Entries ``[c, c + n)`` of ``(layer, h)``: host copy, tier-2 codes, and the blocks they push out."""
        n, c, M, blk = pos.numel(), self.count[layer][h], self.M, self.block
        if c % blk and c // blk in self._recalled[layer][h]:  # a recalled block that grows: release it first
            self._release(layer, h, c // blk)
        self.host[layer][h].append((k.to("cpu"), v.to("cpu"), pos.to("cpu")))
        end = c + n
        self.count[layer][h] = end
        slots = torch.arange(c, end, device=k.device) % M
        kc, ks = self.kf.encode(k, self.gk)
        vc, vs = self.vf.encode(v, self.gv)
        keep = slice(max(0, n - M), n)  # of a batch larger than the ring, only the last M land in it
        sl = slots[keep]
        self.k_codes[layer, :, h, sl] = kc[:, keep]
        self.v_codes[layer, :, h, sl] = vc[:, keep]
        if ks is not None:
            self.k_scale[layer, :, h, sl] = ks[:, keep]
        if vs is not None:
            self.v_scale[layer, :, h, sl] = vs[:, keep]
        self.live[layer, h, sl] = True
        self.entry_pos[layer, h, sl] = pos[keep].to(self.entry_pos.device)
        old = self.frontier[layer][h]
        new = max(old, -(-(end - M) // blk)) if end > M else old  # blocks whose entries were overwritten
        self.frontier[layer][h] = new
        self.stats["dropped_blocks"] += new - old
        # tier 3 boxes: the blocks that left, and dropped blocks that received new entries
        touched = sorted(set(range(old, new)) | set(range(c // blk, min(new, -(-end // blk)))))
        for b in touched:
            self._box(layer, h, b, end)
        self._block_state(layer, h, touched)

    def _block_slots(self, layer: int, h: int, b: int) -> list[int]:
        a, e = b * self.block, min((b + 1) * self.block, self.count[layer][h])
        return [x % self.M for x in range(a, e)]

    def _box(self, layer: int, h: int, b: int, end: int) -> None:
        """Tier 3's box and count of block ``b`` (entries up to ``end``) from the host originals."""
        k, v, _ = self._host_rows(layer, h, b * self.block, min((b + 1) * self.block, end))
        nb = self.lo[layer].shape[2]
        if b >= nb:  # grow the box tensors (block ids are dense per head)
            grow = b + 1 - nb
            z = torch.zeros((self.B, self.H, grow, self.D), dtype=self.lo[layer].dtype, device=self.lo[layer].device)
            self.lo[layer] = torch.cat([self.lo[layer], z], 2)
            self.hi[layer] = torch.cat([self.hi[layer], z.clone()], 2)
            self.log_count[layer] = torch.cat([self.log_count[layer], torch.full(
                (1, self.H, grow), -math.inf, dtype=torch.float64, device=self.log_count[layer].device)], 2)
        dev = self.lo[layer].device
        self.lo[layer][:, h, b] = k.amin(1).to(dev, self.lo[layer].dtype)
        self.hi[layer][:, h, b] = k.amax(1).to(dev, self.hi[layer].dtype)
        v64 = v.double().to(dev)
        self.vlo[layer, :, h] = torch.minimum(self.vlo[layer, :, h], v64.amin(1))
        self.vhi[layer, :, h] = torch.maximum(self.vhi[layer, :, h], v64.amax(1))
        self.stats["box_bytes_peak"] = max(self.stats["box_bytes_peak"], sum(
            a.nbytes + z.nbytes + c.nbytes for a, z, c in zip(self.lo, self.hi, self.log_count)))

    def _block_state(self, layer: int, h: int, blocks: list[int]) -> None:
        """Make the device state of ``blocks`` say where each is: recalled (neither tier attends or
        bounds it), tier 3 (counted), or tier 2 (its entries live)."""
        for b in blocks:
            n = min((b + 1) * self.block, self.count[layer][h]) - b * self.block
            recalled = b in self._recalled[layer][h]
            if b < self.frontier[layer][h]:
                self.log_count[layer][0, h, b] = -math.inf if recalled else math.log(n)
                slots = [s for s in self._block_slots(layer, h, b)
                         if self._entry_at(layer, h, s) // self.block == b]
                if slots:
                    self.live[layer, h, slots] = False
            else:
                self.live[layer, h, self._block_slots(layer, h, b)] = not recalled

    def _entry_at(self, layer: int, h: int, slot: int) -> int:
        """The newest entry that ring slot ``slot`` of ``(layer, h)`` holds (-1: none yet)."""
        c = self.count[layer][h]
        return -1 if slot >= c else slot + self.M * ((c - 1 - slot) // self.M)

    def decoded(self, layer: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Tier 2 of ``layer`` as stored: K ``[B, H, M, D]``, V, their error bounds (float32)."""
        kc, vc = self.k_codes[layer], self.v_codes[layer]
        ks = self.k_scale[layer] if self.k_scale is not None else None
        vs = self.v_scale[layer] if self.v_scale is not None else None
        k = self.kf.decode(kc, ks, self.D, self.gk)
        v = self.vf.decode(vc, vs, self.Dv, self.gv)
        return (k, v, self.kf.error_bound(kc, ks, self.D, self.gk, decoded=k),
                self.vf.error_bound(vc, vs, self.Dv, self.gv, decoded=v))

    def held(self, layer: int) -> Tensor:
        """``bool [H, end]`` (host): the positions ``layer`` attends now, per head: tier 1 (recall
        slots included) and the live tier-2 entries. Reads the device state (a check's tool)."""
        end = self.cache.end
        out = torch.zeros((self.H, end), dtype=torch.bool)
        pos = self.storage.layer_positions(layer).cpu()
        live = self.live[layer].cpu()
        for h in range(self.H):
            p = pos[h]
            out[h, p[p >= 0]] = True
            c = self.count[layer][h]
            slots = live[h].nonzero().squeeze(1)
            if slots.numel():
                ent = slots + self.M * torch.div(c - 1 - slots, self.M, rounding_mode="floor")
                out[h, self._host_rows(layer, h, 0, c)[2][ent]] = True
        return out

    # ------------------------------------------------------------------ reads
    def query_rows(self, q: Tensor) -> Tensor:
        """``q [B, T, Hq, D]`` -> ``[B, H, G * T, D]`` (rows ``(group, query)``, as the certifier)."""
        if q.dim() != 4 or q.shape[2] % self.H:
            raise ValueError(f"queries must be [B, T, Hq, D] with Hq a multiple of the {self.H} key heads, got "
                             f"{tuple(q.shape)}")
        return fold_groups(self.storage.to_heads(q), self.H, 0).transpose(0, 1)

    adds_segments = True

    def segments(self, cache: KVCache, layer: int) -> list[Segment]:
        """Tier 2 of ``layer`` as rows of the cache's reads: the codes of the live entries (the others
        hidden), at their positions, attended in the same softmax as tier 1 (tier 3 is not attended)."""
        if self.broken is not None:
            raise RuntimeError(f"this compressed tier cannot attend: {self.broken}")
        return [Segment(
            n=self.M, positions=torch.where(self.live[layer], self.entry_pos[layer], -1), keys=self.k_codes[layer],
            values=self.v_codes[layer], features=(self.D, self.Dv), dtype=torch.promote_types(cache.dtype, torch.float32),
            k_codec=self.kf, v_codec=self.vf, groups=(self.gk, self.gv),
            k_scale=None if self.k_scale is None else self.k_scale[layer],
            v_scale=None if self.v_scale is None else self.v_scale[layer], slots=None, stable=False)]

    # ------------------------------------------------------------- certificate
    def on_queries(self, cache: KVCache, layer: int, q: Tensor) -> None:
        if self.broken is not None:
            raise RuntimeError(f"this compressed tier cannot certify: {self.broken}")
        if not self.certifies:
            return
        t0 = time.perf_counter()
        span = cache.open_span[0]
        plan = self.recall_tau is not None and self._planned[layer] != span
        cert, parts = self.certificate(layer, q, parts=plan)
        self.stats["steps"] += 1
        if plan:
            self._planned[layer] = span
            if layer == 0:
                self.stats["h2d_bytes_per_span"].append(0)
            if self._plan(layer, cert, parts):
                cert, _ = self.certificate(layer, q)
        self.last[layer] = cert
        self.stats["certify_seconds"] += time.perf_counter() - t0

    def certificate(self, layer: int, q: Tensor, parts: bool = False) -> tuple[Certificate, dict | None]:
        """The certificate of ``q`` (the open span's queries) over ``layer`` now: kept = tier 1
        and the live tier-2 entries, evicted = tier 3 (see the module docstring). With ``parts``
        also what the recall plan ranks by."""
        st = self.storage
        qh = self.query_rows(q)  # [B, H, Q, D]
        B, H, Q, D = qh.shape
        qpos = None
        if self.causal:
            qpos = self.cache.lifecycle.query_positions()
            qpos = qpos.repeat(Q // qpos.numel())
        b1 = position_bias(st.layer_positions(layer), qpos, torch.float64)  # [H, Q|1, S]
        k1, v1 = st.head_view("k", layer).transpose(0, 1), st.head_view("v", layer).transpose(0, 1)
        k2, v2, dk2, dv2 = self.decoded(layer)
        b2 = torch.zeros((H, 1, self.M), dtype=torch.float64, device=qh.device).masked_fill_(
            ~self.live[layer].unsqueeze(1), -math.inf)
        Qb = max(b1.shape[1], 1)
        bias = torch.cat([b1.expand(H, Qb, -1), b2.expand(H, Qb, -1)], -1)
        dt = torch.promote_types(k1.dtype, k2.dtype)  # a float64 tier 1 stays float64
        k = torch.cat([k1.to(dt), k2.to(dt)], -2)
        v = torch.cat([v1.to(dt), v2.to(dt)], -2)
        dk = torch.cat([torch.zeros_like(k1, dtype=dk2.dtype), dk2], -2)
        dv = torch.cat([torch.zeros_like(v1, dtype=dv2.dtype), dv2], -2)
        lo, hi, lc = self.lo[layer], self.hi[layer], self.log_count[layer]
        vlo, vhi = self.vlo[layer], self.vhi[layer]
        n_tok = self.cache.end
        cert0 = certify(qh, k, v, bias, lo, hi, lc, vlo, vhi, scale=self.scale, n_tokens=n_tok, keep_contrib=parts)
        delta = logit_slack(qh, dk, k, None, scale=self.scale)
        eps = value_slack(dv, v, None)
        kept = kept_quant_error(qh, k, v, bias, delta, eps, scale=self.scale)
        q64 = qh.double()
        valid = torch.isfinite(bias).any(-2).unsqueeze(-1)  # [H, S+M, 1]
        kmax = torch.where(valid, k.double().abs(), 0.0).amax(-2)
        if lo.shape[2]:
            live = torch.isfinite(lc).unsqueeze(-1)
            bmax = torch.where(live, torch.maximum(lo.double().abs(), hi.double().abs()), 0.0).amax(-2)
            kmax = torch.maximum(kmax, bmax)
        lz = cert0.log_zhat
        a_q = self.scale * (q64.abs() @ kmax.unsqueeze(-1)).squeeze(-1) + torch.where(torch.isfinite(lz), lz.abs(), 0.0)
        evicted_any = torch.isfinite(lc).any(-1, keepdim=True).expand_as(lz)
        S = k.shape[-2]
        n_terms = D + S + lc.shape[-1] + 8 * (S // 1024 + lc.shape[-1] // 256 + 2) + 16
        zero_q = torch.zeros((B, H, Q), dtype=torch.float64, device=qh.device)
        zero_v = torch.zeros((B, H, self.Dv), dtype=torch.float64, device=qh.device)
        cert = widen(cert0, kept, zero_q, zero_v, a_q=a_q, n_terms=n_terms, n_tokens=n_tok, vlo=vlo, vhi=vhi,
                     evicted_any=evicted_any)
        if not parts:
            return cert, None
        S1 = k1.shape[-2]
        # per tier-2 entry and query, its part of E (quant_bound step 3), |v^ - o^| bounded by max|v^| + max|o^|
        s2 = (q64 @ k2.double().transpose(-1, -2)) * self.scale + b2.unsqueeze(0)
        p2 = torch.exp(s2 - kept["lse_hat"].unsqueeze(-1)).nan_to_num(0.0)
        d2 = delta[..., S1:]
        up = torch.exp(d2 - kept["lam_lo"].unsqueeze(-1))
        g = torch.maximum(up - 1.0, 1.0 - torch.exp(-d2 - kept["lam_hi"].unsqueeze(-1))).clamp(min=0.0)
        vabs = v2.double().abs().amax(-1).unsqueeze(-2)  # [B, H, 1, M]
        oabs = kept["out_hat"].abs().amax(-1, keepdim=True)  # [B, H, Q, 1]
        c2 = p2 * (g * (vabs + oabs) + up * eps[..., S1:, :].amax(-1).unsqueeze(-2))
        c3 = None
        if cert0.block_log_contrib is not None and cert0.block_log_contrib.shape[-1]:
            c3 = cert0.block_log_contrib.exp() * cert.gap.amax(-1, keepdim=True)
        return cert, {"entry": c2.nan_to_num(0.0), "block3": c3}

    # ------------------------------------------------------------------ recall
    def _plan(self, layer: int, cert: Certificate, parts: dict) -> bool:
        """Recall, for every head with a query over target, the shortest prefix of its blocks by
        estimated contribution that brings every query under target (as far as the free recall
        slots allow; a *shortfall* otherwise). True if the kept set changed."""
        self.stats["plans"] += 1
        H, blk = self.H, self.block
        err = cert.error.amax(-1)  # [B, H, Q]
        target = (self.recall_tau * (self.vmax[layer] - self.vmin[layer]).clamp(min=0.0)).view(1, H, 1)
        over = (err > target).any(dim=(0, 2))
        if not bool(over.any()):  # the one host sync of a recall step
            return False
        counts = self.count[layer]
        NB = max(-(-c // blk) for c in counts)
        B, _, Q = err.shape
        score = torch.zeros((B, H, Q, NB), dtype=torch.float64, device=err.device)
        cnt = torch.tensor(counts, device=err.device).view(H, 1)
        ent = self._slot.view(1, -1) + self.M * torch.div(cnt - 1 - self._slot.view(1, -1), self.M, rounding_mode="floor")
        bid = torch.where(self.live[layer], ent // blk, 0).clamp(0, NB - 1)  # [H, M]
        score.scatter_add_(-1, bid.view(1, H, 1, self.M).expand(B, H, Q, self.M),
                           parts["entry"] * self.live[layer].view(1, H, 1, self.M))
        if parts["block3"] is not None:
            n3 = min(parts["block3"].shape[-1], NB)
            score[..., :n3] += parts["block3"][..., :n3].nan_to_num(0.0)
        order = score.amax(dim=(0, 2)).argsort(-1, descending=True)  # [H, NB]
        srt = score.gather(-1, order.view(1, H, 1, NB).expand(B, H, Q, NB))
        rem = err.unsqueeze(-1) - torch.cat([torch.zeros_like(srt[..., :1]), srt.cumsum(-1)], -1)
        ok = (rem <= target.unsqueeze(-1)).all(dim=2).all(dim=0)  # [H, NB + 1]
        k_needed = torch.where(ok, torch.arange(NB + 1, device=ok.device), NB).amin(-1)
        plan_k, order_h, over_h = k_needed.tolist(), order.tolist(), over.tolist()
        epoch = self.cache.open_span[0]
        changed = False
        for h in range(H):
            if not over_h[h]:
                continue
            c = counts[h]
            todo = [b for b in order_h[h][: max(1, plan_k[h])] if b * blk < c and b not in self._recalled[layer][h]]
            sizes = {b: min((b + 1) * blk, c) - b * blk for b in todo}
            free = self._free[layer][h]
            need = sum(sizes.values())
            if need > len(free):  # release blocks recalled for earlier spans
                for b in [b for b, (_, e) in self._recalled[layer][h].items() if e < epoch]:
                    self._release(layer, h, b)
                    changed = True
            taken, room = [], len(self._free[layer][h])
            for b in todo:
                if sizes[b] <= room:
                    taken.append(b)
                    room -= sizes[b]
            if len(taken) < len(todo):
                self.stats["shortfalls"] += 1
            for b in taken:
                self._recall(layer, h, b, epoch)
                changed = True
        return changed

    def _recall(self, layer: int, h: int, b: int, epoch: int) -> None:
        c = self.count[layer][h]
        k, v, pos = self._host_rows(layer, h, b * self.block, min((b + 1) * self.block, c))
        n = pos.numel()
        free = self._free[layer][h]
        slots, self._free[layer][h] = free[:n], free[n:]
        dev = self.cache.device
        kd, vd = k.to(dev), v.to(dev)
        self.storage.write_recall(layer, h, slots, kd.transpose(0, 1), vd.transpose(0, 1), pos.to(dev))
        self._recalled[layer][h][b] = (slots, epoch)
        self._block_state(layer, h, [b])
        nbytes = kd.nbytes + vd.nbytes
        self.stats["recalled_blocks"] += 1
        self.stats["recalled_tokens"] += n
        self.stats["h2d_bytes"] += nbytes
        if self.stats["h2d_bytes_per_span"]:
            self.stats["h2d_bytes_per_span"][-1] += nbytes

    def _release(self, layer: int, h: int, b: int) -> None:
        slots, _ = self._recalled[layer][h].pop(b)
        self.storage.clear_recall(layer, h, slots)
        free = self._free[layer][h]
        free.extend(slots)
        free.sort()
        self._block_state(layer, h, [b])
