"""``CompressedTier``: what a full-precision cache evicts, kept on the device quantised and
*attended*, certified against float64 full history, with exact recall from the host of the
blocks the certificate blames.

    cache = KVCache(..., policy="tova", recall_slots=R)       # tier 1: full precision
    tier = CompressedTier(cache, fmt="int4", capacity=M, recall_tau=0.01, causal=True)
    read = cache.layer(i).update(k, v, q)                      # on_queries: certificate (+ recall)
    out = attend(q, read)                                      # tiers 1 + 2 and the recall slots, one softmax
                                                               # (a certified step's: the certificate's output)
    tier.last[i]                                               # the step's Certificate (None: not certified)

Per (layer, head):

1. **full precision** (the cache): sinks, the open span, what its policy keeps, its recall slots.
2. **compressed** (device): the last ``capacity`` tokens the policy evicted, in eviction order,
   K and V as codes and scales of a :data:`~streamkv.quant.KV_FORMATS` format in a ring of
   ``capacity`` entries; attended (a segment of the cache's own read) unless recalled.
3. **beyond the horizon**: tokens pushed out of tier 2, a block (``block`` consecutive entries)
   at a time: the box of the block's original keys (from the codes being overwritten,
   ``[k^ - dk, k^ + dk]`` rounded outward: no host read) and its count; bounded, not attended.
4. **host** (with ``recall_tau`` only: what recall copies back): every evicted token's original
   K/V; entry ``e`` of a head is its ``e``-th evicted token (block ``b`` = entries
   ``[b * block, (b + 1) * block)``), in one growing buffer per layer.

Everything per eviction is a few tensor operations per layer over all heads, on the device with
fixed shapes and no read of it: per (layer, head) the first ``K`` evicted slots by position
(``K`` a host bound on what one eviction takes per head: the window's slots, the policy's
``most_evicted()``, else the capacity; the rows past a head's count are padding), entries counted
on the device, ``K + block - 1`` candidate entries for the blocks pushed to tier 3, ``min(K,
capacity)`` for the ring. Tier 3's boxes are allocated by a host bound on the entries (the
positions that entered less those tier 1 holds: the policy's ``kept(end)`` after a commit of a
fixed budget, else its sinks), so a tier without recall traces whole in a captured begin and
commit. Recall copies every eviction to the host (one copy of counts and positions, one of the
K/V) and keeps its counts there: it is outside a captured commit.

**The certificate** (per query, against full-history attention over the original K/V) is
:mod:`.bound32`'s: float32 over tiers 1 and 2 with a proven outward margin, the first-order
key slack (no double charge of ``lambda``), the exact ``|v^ - o^|`` for each query's heaviest
entries; tier 3 bounds the originals. **Optional per call**: ``certify=True`` (every step),
``False`` (none), or ``k`` (the steps of every ``k``-th span); the attribute may be changed
between calls. A step that is not certified leaves ``last[layer] = None``: a certificate bounds
the step it was computed for, nothing else.

**The read of a certified step is the certificate's.** The certificate computes the attention over
tiers 1 and 2 to bound it (``out_kept``); ``attend(q, read)`` on the same query tensor returns it
(:meth:`CompressedTier.answer`: rounded once to the queries' dtype, with its log-sum-exp and a
scored tier 1's statistics from the same weights) instead of reading the tiers again, so the output
served is the output certified. A float64 read, another tensor or other options are computed.

**Recall**, planned at the first certified step of a span (later steps of the span keep it):
per head, tier 2 and 3 blocks ranked on the device by an estimate of their part of the bound;
the shortest prefix after which every query's L-inf error bound would be ``<= recall_tau x`` the
head's value range, by that estimate, is chosen on the device. One host read per plan (per layer
and span: the chosen blocks, which the copy from host memory needs as host indices); the blocks
are copied into the recall slots, their tier-2 entries masked, and the certificate recomputed
(the guarantee is that certificate, not the plan). The estimate is not a bound and the plan is
not redone within the span: ``stats["over_target"]`` counts the plans whose recomputed
certificate still has a query above target (one more host read per plan), ``shortfalls`` those
whose blocks did not fit the free slots. Blocks recalled for an earlier span are released
when their slots are needed. ``stats["h2d_bytes"]`` counts what was copied.

Refused with the reason: a cache that is not ``[B, T, H, D]`` (rank 4, seq_dim 1, head_dim 2),
quantised storage (tier 1 is the full-precision tier), a cache that has already evicted,
recall slots without ``recall_tau`` or ``recall_tau`` without recall slots (fewer than a block),
recall without certificates, a second recall owner, a state-dict load, a state dict or an exported
stream of its cache (the cache refuses them while the tier's rows are part of its reads), a capacity that is not a
positive multiple of ``block``; a span begun while a certifying tier would compute its
certificate with float32 products below ``"highest"`` precision (refused at ``begin``, before any write). Scope: eager, RoPE at write, the identity basis.

Why one module: the observer hooks, the certificate's inputs and recall share one piece of
state, the per-(layer, head) entry, block and recall-slot bookkeeping.
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..budget.mass import check_tau
from ..caches import CacheObserver, Change, KVCache, ReadAnswer
from ..quant import KVQuant
from ..scoring import fold_groups, unfold_groups
from ..masks import position_mask
from ..stores import Segment
from ..stores.codecs import IntCodec
from ..validate import check_int, check_real
from .bound import Certificate
from .bound32 import TierHeld, certify_tier, check_precision
from .certifier import check_reopen, claim_unevicted, release

__all__ = ["CompressedTier"]

_BOX_STEP = 8  # tier-3 blocks allocated at a time per (layer, head)
_NONE = torch.iinfo(torch.long).max  # a slot that nothing left
#: query dtypes whose reads the certificate answers (its output is float32-accurate: a float64 read is computed)
_ANSWERED = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class _Answer:
    """A certified step's read, kept for ``attend`` (:meth:`CompressedTier.answer`): the queries it is
    for (a weak reference, their version counter where they keep one), the lifecycle generation,
    the certificate, the rows' log-sum-exp as a read gives it, the policy's statistic and its
    finished values (None: not asked)."""

    q: weakref.ref
    version: int | None
    generation: int
    cert: Certificate
    lse: Tensor
    statistic: Any
    key_max: Tensor | None
    key_sum: Tensor | None


def _version(t: Tensor) -> int | None:
    """``t``'s version counter (None: an inference tensor keeps none)."""
    return None if t.is_inference() else t._version


class CompressedTier(CacheObserver):
    """Tiers 2 and 3 and the host copy for one full-precision cache (see the module docstring).

    Args:
        cache: tier 1, a full-precision ``[B, T, H, D]`` cache of any evicting kind.
        fmt: the tier-2 format (a name of :data:`~streamkv.quant.KV_FORMATS`); ``group``: channels
            per scale (default: the whole head).
        capacity: tier-2 entries per (layer, head), a multiple of ``block``.
        block: entries per block (the unit of recall and of tier 3).
        recall_tau: recall, once per span, the blocks estimated to bring every query's certified
            L-inf error to ``<= recall_tau x`` the head's value range (None: no recall; the cache
            must then have no recall slots); ``stats["over_target"]`` counts the spans it did not.
        causal: position-causal queries (an LLM's prefill chunks), as :func:`~streamkv.attention.attend`.
        scale: the softmax scale (default ``1/sqrt(D)``).
        certify: ``True`` every step, ``False`` none, or an int ``k >= 1``: the steps of every
            ``k``-th span (see the module docstring); recall needs certificates.
        top: entries per query whose output deviation the certificate takes exactly.
        answer: answer a certified step's read from its certificate (:meth:`answer`); False: every
            read is computed (for queries changed in place after the update by a path their
            version counter does not see).
    """

    def __init__(self, cache: KVCache, *, fmt: str = "int8", group: int | None = None, capacity: int,
                 block: int = 16, recall_tau: float | None = None, causal: bool = False,
                 scale: float | None = None, certify: bool | int = True, top: int = 16, answer: bool = True) -> None:
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
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
        self.certify = certify  # checked by the setter
        self.top = check_int("top", top, 0)
        if not isinstance(answer, bool):
            raise TypeError(f"answer must be a bool, got {type(answer).__name__} {answer!r}")
        self.answers_reads = answer
        if recall_tau is not None and certify is False:
            raise ValueError("recall plans from the certificate: recall_tau needs certify=True (or an int)")
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
        self.M, self.block, self.recall_tau, self.causal = capacity, block, recall_tau, causal
        self.scale = 1.0 / math.sqrt(D) if scale is None else check_real("scale", scale, positive=True)
        dev, L, B, H, M = cache.device, self.L, self.B, self.H, capacity
        self.k_codes = torch.zeros((L, B, H, M, self.kf.code_width(D)), dtype=torch.uint8, device=dev)
        self.v_codes = torch.zeros((L, B, H, M, self.vf.code_width(Dv)), dtype=torch.uint8, device=dev)
        self.k_scale = (torch.zeros((L, B, H, M, D // self.gk), dtype=torch.bfloat16, device=dev)
                        if self.kf.scaled else None)
        self.v_scale = (torch.zeros((L, B, H, M, Dv // self.gv), dtype=torch.bfloat16, device=dev)
                        if self.vf.scaled else None)
        self.live = torch.zeros((L, H, M), dtype=torch.bool, device=dev)
        self.entry_pos = torch.full((L, H, M), -1, dtype=torch.int32, device=dev)  # the position each entry holds
        R = st.recall_slots
        self.rec_block = torch.full((L, H, max(R, 1)), -1, dtype=torch.long, device=dev)  # block held per recall slot
        self._slot = torch.arange(M, device=dev)
        self._heads = torch.arange(H, device=dev).view(H, 1)
        self.box_dtype = torch.float32
        self.attached = False
        self.broken: str | None = None
        self._clear()
        cache.add_observer(self)

    # ------------------------------------------------------------- options
    @property
    def certify(self) -> bool | int:
        """``True`` (every step), ``False`` (none) or ``k`` (every ``k``-th span); settable between calls."""
        return self._certify

    @certify.setter
    def certify(self, value: bool | int) -> None:
        if not isinstance(value, bool):
            value = check_int("certify", value, 1)
        if value is False and getattr(self, "recall_tau", None) is not None:
            raise ValueError("recall plans from the certificate: a tier with recall_tau keeps certifying")
        self._certify = value

    @property
    def certifies(self) -> bool:
        return self._certify is not False

    def _clear(self) -> None:
        L, H, B, D, Dv, dev = self.L, self.H, self.B, self.D, self.Dv, self.cache.device
        self.k_codes.zero_()
        self.v_codes.zero_()
        for s in (self.k_scale, self.v_scale):
            if s is not None:
                s.zero_()
        self.live.zero_()
        self.entry_pos.fill_(-1)
        self.rec_block.fill_(-1)
        self.lo = [torch.zeros((B, H, 0, D), dtype=self.box_dtype, device=dev) for _ in range(L)]
        self.hi = [torch.zeros((B, H, 0, D), dtype=self.box_dtype, device=dev) for _ in range(L)]
        self.log_count = [torch.zeros((1, H, 0), dtype=torch.float32, device=dev) for _ in range(L)]
        self.vlo = torch.full((L, B, H, Dv), math.inf, dtype=torch.float32, device=dev)
        self.vhi = torch.full((L, B, H, Dv), -math.inf, dtype=torch.float32, device=dev)
        self.vmin = torch.full((L, H), math.inf, dtype=torch.float32, device=dev)
        self.vmax = torch.full((L, H), -math.inf, dtype=torch.float32, device=dev)
        pin = self.cache.device.type == "cuda"
        self._pin = pin
        dt = self.cache.dtype
        self._hk = [torch.zeros((H, 0, B, D), dtype=dt, pin_memory=pin) for _ in range(L)]
        self._hv = [torch.zeros((H, 0, B, Dv), dtype=dt, pin_memory=pin) for _ in range(L)]
        self._hp = [torch.zeros((H, 0), dtype=torch.long, pin_memory=pin) for _ in range(L)]
        self._count = torch.zeros((L, H), dtype=torch.long, device=dev)  # entries appended per (layer, head)
        self._front = torch.zeros((L, H), dtype=torch.long, device=dev)  # blocks < frontier are in tier 3
        self._dropped = torch.zeros((L, H), dtype=torch.long, device=dev)  # blocks pushed into tier 3
        # recall's host mirror of the counts (it copies every evicted token to the host anyway)
        self._count_h = torch.zeros((L, H), dtype=torch.long) if self.recall_tau is not None else None
        self._nb = [0] * L  # tier-3 blocks allocated per layer (host)
        self._bound = [0] * L  # a host bound on every head's entries (what tier 3's boxes are sized by)
        self._recalled: list[list[dict[int, tuple[list[int], int]]]] = [[{} for _ in range(H)] for _ in range(L)]
        self._free = [[list(range(self.storage.recall_slots)) for _ in range(H)] for _ in range(L)]
        self._planned: list[int | None] = [None] * L
        self._span: list[tuple[int | None, int]] = [(None, -1)] * L  # (start, ordinal) of the span each layer saw
        self.last: list[Certificate | None] = [None] * L
        self._answers: list[_Answer | None] = [None] * L
        self._ref: list[Tensor | None] = [None] * L  # the last certificate's mean output (bound32's reference)
        self._stats: dict[str, Any] = {"steps": 0, "plans": 0, "recalled_blocks": 0, "recalled_tokens": 0,
                                      "h2d_bytes": 0, "shortfalls": 0, "over_target": 0, "dropped_blocks": 0,
                                      "box_bytes_peak": 0, "certify_seconds": 0.0, "h2d_bytes_per_span": [],
                                      "uncertified_steps": 0}

    # ------------------------------------------------------------------ sizes
    @property
    def stats(self) -> dict[str, Any]:
        """Counters of steps, plans, recall, certificate time and tier 3 (``dropped_blocks``: read
        from the device when asked)."""
        self._stats["dropped_blocks"] = int(self._dropped.sum())
        return self._stats

    @property
    def count(self) -> list[list[int]]:
        """Entries appended per (layer, head) (host ints: a read of the device)."""
        return self._count.tolist()

    @property
    def frontier(self) -> list[list[int]]:
        """Blocks per (layer, head) in tier 3 (host ints: a read of the device)."""
        return self._front.tolist()

    @property
    def nbytes(self) -> int:
        """Device bytes of tiers 2 and 3: codes, scales, live flags, entry positions, boxes and counts,
        value boxes and ranges, the recall-slot table."""
        t2 = sum(t.nbytes for t in (self.k_codes, self.v_codes, self.k_scale, self.v_scale, self.live, self.entry_pos)
                 if t is not None)
        t3 = sum(a.nbytes + b.nbytes + c.nbytes for a, b, c in zip(self.lo, self.hi, self.log_count))
        rest = sum(t.nbytes for t in (self.vlo, self.vhi, self.vmin, self.vmax))
        return t2 + t3 + rest + (self.rec_block.nbytes if self.storage.recall_slots else 0)

    @property
    def host_bytes(self) -> int:
        """Host bytes of the evicted originals held for recall (K, V and an int64 position per entry;
        0 without ``recall_tau``: nothing would read them)."""
        if self.recall_tau is None:
            return 0
        n = int(self._count_h.sum())
        return n * (self.B * (self.D + self.Dv) * self._hk[0].element_size() + 8)

    def tier3_bytes(self, blocks: int) -> int:
        """Device bytes of tier 3 holding ``blocks`` blocks per (layer, head), as allocated (float32
        boxes and counts, a step of blocks at a time): what a byte budget must reserve for it."""
        alloc = -(-blocks // _BOX_STEP) * _BOX_STEP
        return self.L * self.H * alloc * (2 * self.B * self.D * 4 + 4)

    def bytes_per_entry(self) -> int:
        """Device bytes of one tier-2 entry (one token of one head, all of B): codes, scales, live
        flag, position."""
        return self.B * self.quant.bytes_per_token(self.D, self.Dv) + 1 + self.entry_pos.element_size()

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
        if change.what == "begin" and self.certifies:
            check_precision()  # before the span's writes: a refused step changes nothing
        if change.eviction is not None:
            captured = self._capture(change.eviction)
            if captured is None:
                return None
            bound = self._entry_bound(change, captured[0])
            return lambda: self._record(captured, bound)
        return None

    def _reset(self) -> None:  # the cache's reset zeroed its slots, recall slots included
        self._clear()
        if self.attached:
            self.broken = None

    def on_write(self, cache: KVCache, layer: int, k: Tensor, v: Tensor) -> None:
        """The value range per head (the scale of ``recall_tau``): every value written."""
        self._answers[layer] = None
        vd = v.detach().float()
        self.vmin[layer] = torch.minimum(self.vmin[layer], vd.amin(dim=(0, 1, 3)))
        self.vmax[layer] = torch.maximum(self.vmax[layer], vd.amax(dim=(0, 1, 3)))

    def _most(self, event) -> int:
        """A host bound on the tokens ``event`` evicts per (layer, head)."""
        cap = self.storage.capacity
        if event.shared_slots is not None:
            return min(len(event.shared_slots), cap)
        most = self.cache.policy.most_evicted()
        return cap if most is None else min(most, cap)

    def _capture(self, event) -> tuple | None:
        """What leaves, gathered while the cache still holds it (nothing of this tier changes), as
        ``(K, positions, counts, k, v, host)``: per (layer, head) the first ``K`` evicted slots by
        position (``K``: :meth:`_most`; rows past a head's count are padding), their positions
        ``[L, H, K]``, the counts ``[L, H]`` and K/V ``[L, H, K, B, D]``. Fixed shapes on the
        device, no read of it; with recall also their host copy (one copy of the counts and
        positions, one of the K/V)."""
        st, cap, H, L = self.storage, self.storage.capacity, self.H, self.L
        K = self._most(event)
        if K == 0:
            return None
        pos = event.positions.expand(L, H, -1)[..., :cap]
        key = torch.where(event.evicted[..., :cap], pos, _NONE)
        pos, slots = key.topk(K, dim=-1, largest=False, sorted=True)  # the evicted first, by position
        n = (pos < _NONE).sum(-1)
        layers = torch.arange(L, device=slots.device).view(L, 1, 1)
        k = st.head_view("k")[layers, self._heads, :, slots]  # [L, H, K, B, D]
        v = st.head_view("v")[layers, self._heads, :, slots]
        host = None
        if self.recall_tau is not None:  # the host copy recall reads
            meta = torch.cat([n.unsqueeze(-1), pos], -1).cpu()
            kv = torch.cat([k.flatten(3), v.flatten(3)], -1).cpu()
            host = (meta[..., 0], meta[..., 1:], kv)
        return K, pos, n, k, v, host

    def _entry_bound(self, change: Change, K: int) -> list[int]:
        """Per layer, a host bound on every head's entries once ``change`` is applied: what the event
        may add (``K`` per head), and at most the positions that entered less those tier 1 still
        holds (known on the host after a commit of a fixed budget; else at least the sinks)."""
        cache = change.cache
        end = cache.end
        kept = cache.policy.kept(end) if change.what == "commit" else None
        floor = min(end, cache.layout.sink) if kept is None else kept
        return [min(b + K, end - floor) for b in self._bound]

    def _record(self, captured: tuple, bound: list[int]) -> None:
        try:
            K, pos, n, k, v, host = captured
            for layer in range(self.L):
                self._append(layer, K, pos[layer], n[layer], k[layer], v[layer], bound[layer],
                             None if host is None else tuple(t[layer] for t in host))
        except BaseException as exc:
            self.broken = f"recording an applied eviction failed: {type(exc).__name__}: {exc}"
            raise

    # -------------------------------------------------------------- tier 2 / 3
    def _host_rows(self, layer: int, h: int, a: int, b: int) -> tuple[Tensor, Tensor, Tensor]:
        """Host K ``[B, n, D]``, V, positions of entries ``[a, b)`` of ``(layer, h)``."""
        return (self._hk[layer][h, a:b].transpose(0, 1), self._hv[layer][h, a:b].transpose(0, 1),
                self._hp[layer][h, a:b])

    def _grow_host(self, layer: int, need: int) -> None:
        have = self._hk[layer].shape[1]
        if need <= have:
            return
        new = max(need, 2 * have, 64)
        for name in ("_hk", "_hv", "_hp"):
            old = getattr(self, name)[layer]
            t = torch.zeros((old.shape[0], new, *old.shape[2:]), dtype=old.dtype, pin_memory=self._pin)
            t[:, :have] = old
            getattr(self, name)[layer] = t

    def _grow_boxes(self, layer: int, need: int) -> None:
        nb = self._nb[layer]
        if need <= nb:
            return
        grow = -(-need // _BOX_STEP) * _BOX_STEP - nb  # allocated a step of blocks at a time
        self._nb[layer] = nb + grow
        dev = self.lo[layer].device
        self.lo[layer] = torch.cat([self.lo[layer], torch.full((self.B, self.H, grow, self.D), math.inf,
                                                               dtype=self.box_dtype, device=dev)], 2)
        self.hi[layer] = torch.cat([self.hi[layer], torch.full((self.B, self.H, grow, self.D), -math.inf,
                                                               dtype=self.box_dtype, device=dev)], 2)
        self.log_count[layer] = torch.cat([self.log_count[layer], torch.full(
            (1, self.H, grow), -math.inf, dtype=torch.float32, device=dev)], 2)
        per_block = self.H * (2 * self.B * self.D * self.lo[layer].element_size() + 4)  # lo, hi and a count
        self._stats["box_bytes_peak"] = max(self._stats["box_bytes_peak"], sum(self._nb) * per_block)

    def _ring_entries(self, counts: Tensor) -> Tensor:
        """``[H, M]`` the entry each ring slot holds for per-head ``counts`` (device; -1: none yet)."""
        c = counts.to(self._slot.device).view(-1, 1)
        slot = self._slot.view(1, -1)
        ent = slot + self.M * torch.div(c - 1 - slot, self.M, rounding_mode="floor")
        return torch.where(slot < c, ent, -1)

    def _append(self, layer: int, K: int, pos: Tensor, n: Tensor, k: Tensor, v: Tensor, bound: int,
                host: tuple[Tensor, Tensor, Tensor] | None) -> None:
        """Append the evicted tokens of ``layer`` (per head ``n [H]`` of the ``K`` rows, by position)
        to every head at once, on the device with fixed shapes: the tier-3 boxes of the blocks pushed
        out of the ring, tier-2 codes, masks; with recall (``host``: the counts, positions and K/V
        copied by :meth:`_capture`) the host copy. ``bound``: the host bound on the entries after it."""
        M, blk = self.M, self.block
        c_old, f_old = self._count[layer].clone(), self._front[layer].clone()
        c_new = c_old + n
        f_new = torch.maximum(f_old, torch.div(c_new - M + blk - 1, blk, rounding_mode="floor").clamp(min=0))
        if host is not None:
            self._append_host(layer, *host)
        self._bound[layer] = bound
        if bound > M:  # blocks may leave the ring: tier 3's boxes (sized by the bound), then the push
            self._grow_boxes(layer, -(-(bound - M) // blk))
            self._push(layer, K, c_old, f_old, f_new, k, v)
        self._land(layer, K, c_old, n, pos, k, v)
        self._count[layer] = c_new
        self._front[layer] = f_new
        self._dropped[layer] += f_new - f_old
        self._refresh(layer)

    def _append_host(self, layer: int, n: Tensor, pos: Tensor, kv: Tensor) -> None:
        """Recall's host copy of the evicted tokens (host tensors): a recalled block that grows is
        released; entry ``e`` of a head is its ``e``-th evicted token."""
        H, B, D, Dv, blk = self.H, self.B, self.D, self.Dv, self.block
        c_old = self._count_h[layer].clone()
        for h in range(H):
            b = int(c_old[h]) // blk
            if n[h] and int(c_old[h]) % blk and b in self._recalled[layer][h]:
                self._release(layer, h, b)
        hh, j = (torch.arange(pos.shape[1]) < n.view(H, 1)).nonzero(as_tuple=True)
        e = c_old[hh] + j
        self._grow_host(layer, int((c_old + n).max()))
        kc, vc = kv[hh, j].split([B * D, B * Dv], -1)
        self._hk[layer][hh, e] = kc.view(-1, B, D).to(self._hk[layer].dtype)
        self._hv[layer][hh, e] = vc.view(-1, B, Dv).to(self._hv[layer].dtype)
        self._hp[layer][hh, e] = pos[hh, j]
        self._count_h[layer] = c_old + n

    def _land(self, layer: int, K: int, c_old: Tensor, n: Tensor, pos: Tensor, k: Tensor, v: Tensor) -> None:
        """Tier-2 codes of the entries that land in the ring: a head's last ``R = min(K, M)`` rows,
        entry ``e`` in slot ``e mod M`` (``R`` consecutive entries: distinct slots); the rows before
        a head's first (fewer evicted than ``R``) write back what their slots hold."""
        H, M = self.H, self.M
        R = min(K, M)
        j = n.view(H, 1) - R + torch.arange(R, device=n.device)  # [H, R]: the row of each; < 0: none
        ok = j >= 0
        slot = (c_old.view(H, 1) + j) % M
        src = j.clamp(min=0)
        hs = self._heads
        kc, ks = self.kf.encode(k[hs, src], self.gk)  # [H, R, B, W]
        vc, vs = self.vf.encode(v[hs, src], self.gv)
        keep = ok.view(1, H, R, 1)
        for buf, new in ((self.k_codes, kc), (self.v_codes, vc), (self.k_scale, ks), (self.v_scale, vs)):
            if buf is not None:
                dst = buf[layer]
                dst[:, hs, slot] = torch.where(keep, new.permute(2, 0, 1, 3), dst[:, hs, slot])
        ep = self.entry_pos[layer]
        ep[hs, slot] = torch.where(ok, pos.gather(1, src).to(ep.dtype), ep[hs, slot])

    def _push(self, layer: int, K: int, c_old: Tensor, f_old: Tensor, f_new: Tensor, k: Tensor, v: Tensor) -> None:
        """Tier-3 boxes of the blocks ``[f_old, f_new)`` of each head, over the entries ``f_old *
        block + i``, ``i < K + block - 1`` (the most one event pushes; the others masked): an entry
        still in the ring from its codes (``x^ -+ dx``, rounded outward), one of this event from its
        original (``k``, ``v``: the event's rows); the value boxes of the same entries."""
        B, H, D, Dv, blk, dev = self.B, self.H, self.D, self.Dv, self.block, self.k_codes.device
        nb = self._nb[layer]
        hs = self._heads
        e = f_old.view(H, 1) * blk + torch.arange(K + blk - 1, device=dev)  # [H, P]
        pushed = e < (f_new * blk).view(H, 1)
        in_ring = (e < c_old.view(H, 1)).unsqueeze(-1)
        ms = e % self.M
        ks = None if self.k_scale is None else self.k_scale[layer][:, hs, ms]
        vs = None if self.v_scale is None else self.v_scale[layer][:, hs, ms]
        kc, vc = self.k_codes[layer][:, hs, ms], self.v_codes[layer][:, hs, ms]  # [B, H, P, W]
        kd = self.kf.decode(kc, ks, D, self.gk)
        vd = self.vf.decode(vc, vs, Dv, self.gv)
        dk = self.kf.error_bound(kc, ks, D, self.gk, decoded=kd)
        dv = self.vf.error_bound(vc, vs, Dv, self.gv, decoded=vd)
        src = (e - c_old.view(H, 1)).clamp(0, K - 1)
        k32 = self._outward(k[hs, src].permute(2, 0, 1, 3))  # [B, H, P, D]
        v32 = self._outward(v[hs, src].permute(2, 0, 1, 3))
        down, up = torch.tensor(-math.inf, device=dev), torch.tensor(math.inf, device=dev)
        keep = pushed.unsqueeze(-1)
        klo = torch.where(keep, torch.where(in_ring, torch.nextafter(kd - dk, down), k32[0]), up)
        khi = torch.where(keep, torch.where(in_ring, torch.nextafter(kd + dk, up), k32[1]), down)
        vlo = torch.where(keep, torch.where(in_ring, torch.nextafter(vd - dv, down), v32[0]), up)
        vhi = torch.where(keep, torch.where(in_ring, torch.nextafter(vd + dv, up), v32[1]), down)
        # a pushed block past the boxes (a bound that failed) indexes out of range: an error, not a lost box
        idx = (hs * nb + torch.where(pushed, torch.div(e, blk, rounding_mode="floor"), 0)).view(1, -1, 1)
        for box, x, how in ((self.lo[layer], klo, "amin"), (self.hi[layer], khi, "amax")):
            box.view(B, H * nb, D).scatter_reduce_(1, idx.expand(B, -1, D), x.reshape(B, -1, D).to(box.dtype),
                                                   reduce=how)
        self.vlo[layer] = torch.minimum(self.vlo[layer], vlo.amin(2))
        self.vhi[layer] = torch.maximum(self.vhi[layer], vhi.amax(2))

    @staticmethod
    def _outward(x: Tensor) -> tuple[Tensor, Tensor]:
        """Float32 ``(lo, hi)`` with ``lo <= x <= hi`` (equal to ``x`` where float32 holds it exactly)."""
        y = x.float()
        if x.dtype.itemsize <= 4:
            return y, y
        xd = x.double()
        inf = torch.tensor(math.inf, dtype=torch.float32, device=x.device)
        lo = torch.where(y.double() > xd, torch.nextafter(y, -inf), y)
        hi = torch.where(y.double() < xd, torch.nextafter(y, inf), y)
        return lo, hi

    def _refresh(self, layer: int) -> None:
        """The device masks of ``layer`` from the counts, the frontier and the recall table: a ring
        slot is live when it holds an entry of a block in tier 2 that is not recalled; a block below
        the frontier counts in tier 3 unless recalled."""
        dev, blk = self.k_codes.device, self.block
        ent = self._ring_entries(self._count[layer])
        eb = torch.div(ent, blk, rounding_mode="floor")
        front = self._front[layer].to(dev).view(-1, 1)
        rec = self.rec_block[layer]  # [H, R]
        live = (ent >= 0) & (eb >= front)
        if self.storage.recall_slots:
            live &= ~(eb.unsqueeze(-1) == rec.unsqueeze(-2)).any(-1)
        self.live[layer] = live
        nb = self._nb[layer]
        if nb:
            b = torch.arange(nb, device=dev).view(1, -1)
            in3 = b < front
            if self.storage.recall_slots:
                in3 &= ~(b.unsqueeze(-1) == rec.unsqueeze(-2)).any(-1)
            self.log_count[layer][0] = torch.where(in3, math.log(blk), -math.inf)

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
        out = torch.zeros((self.H, self.cache.end), dtype=torch.bool)
        pos = self.storage.layer_positions(layer).cpu()
        ent = torch.where(self.live[layer], self.entry_pos[layer].long(), -1).cpu()
        for p in (pos, ent):
            hh, jj = (p >= 0).nonzero(as_tuple=True)
            out[hh, p[hh, jj]] = True
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
            n=self.M, positions=torch.where(self.live[layer], self.entry_pos[layer].long(), -1), keys=self.k_codes[layer],
            values=self.v_codes[layer], features=(self.D, self.Dv), dtype=torch.promote_types(cache.dtype, torch.float32),
            k_codec=self.kf, v_codec=self.vf, groups=(self.gk, self.gv),
            k_scale=None if self.k_scale is None else self.k_scale[layer],
            v_scale=None if self.v_scale is None else self.v_scale[layer], slots=None, stable=False)]

    # ------------------------------------------------------------- certificate
    def _due(self, layer: int) -> bool:
        """Whether this step of ``layer`` is certified (the ``certify`` schedule)."""
        start = self.cache.open_span[0]
        seen, ordinal = self._span[layer]
        if seen != start:
            ordinal += 1
            self._span[layer] = (start, ordinal)
        c = self._certify
        return c if isinstance(c, bool) else ordinal % c == 0

    def on_queries(self, cache: KVCache, layer: int, q: Tensor) -> None:
        if self.broken is not None:
            raise RuntimeError(f"this compressed tier cannot certify: {self.broken}")
        self._answers[layer] = None
        if not self._due(layer):
            self.last[layer] = None
            self._stats["uncertified_steps"] += 1
            return
        t0 = time.perf_counter()
        span = cache.open_span[0]
        plan = self.recall_tau is not None and self._planned[layer] != span
        answers = q.dtype in _ANSWERED
        stat = cache.policy.statistic if answers and cache.policy.needs_queries else None
        count = None if stat is None else self._counted(q, stat)
        cert, got = self.certificate(layer, q, parts=plan, count=count)
        self._stats["steps"] += 1
        if plan:
            self._planned[layer] = span
            if layer == 0:
                self._stats["h2d_bytes_per_span"].append(0)
            if self._plan(layer, cert, got):
                cert, got = self.certificate(layer, q, count=count)
            # the plan ranks blocks by an estimate: count a span whose certificate stays over target
            self._stats["over_target"] += int(bool((cert.error.amax(-1) > self._target(layer)).any()))
        self.last[layer] = cert
        if answers:
            kmax, ksum = (None, None) if stat is None else self._finish(layer, stat, cert, count, got)
            self._answers[layer] = _Answer(weakref.ref(q), _version(q), cache.lifecycle.generation, cert,
                                           got["lse_read"], stat, kmax, ksum)
        self._stats["certify_seconds"] += time.perf_counter() - t0

    def _counted(self, q: Tensor, stat) -> Tensor:
        """``bool [G * T]``: the query rows (``(group, query)``, as :meth:`query_rows`) ``stat`` counts."""
        T, G = q.shape[1], q.shape[2] // self.H
        t = torch.arange(T, device=q.device)
        rows = t >= T - stat.rows if stat.rows is not None else torch.ones(T, dtype=torch.bool, device=q.device)
        return rows.repeat(G)

    def _finish(self, layer: int, stat, cert: Certificate, count: Tensor, got: dict) -> tuple[Tensor | None, ...]:
        """The policy's statistics ``[H, S1]`` from the certificate's tier-1 weights, as a read's
        (:meth:`~streamkv.blockread.Statistic.finish`: skipped slots 0, NaN in a poisoned head)."""
        H, slots = self.H, got["key_max"].shape[-1]
        newest = None
        qpos = self.cache.lifecycle.query_positions()
        if stat.newest and qpos is not None and qpos.numel():
            newest = torch.zeros((H, slots + 1), dtype=torch.bool, device=qpos.device)
            newest[:, :slots] = self.storage.layer_positions(layer) >= qpos[:1]
        poisoned = stat.poisoned(torch.where(count, got["lse_own"], 0.0), H, 1)  # the counted rows' (no host read)
        out = []
        for name in ("max", "sum"):
            x = got[f"key_{name}"]
            out.append(stat.finish(torch.cat([x, x.new_zeros((H, 1))], -1), slots, poisoned, newest)
                       if name in stat.reduce else None)
        return tuple(out)

    def answer(self, cache: KVCache, layer: int, q: Tensor, *, scale: float, causal: bool, window: int | None,
               statistic: Any, lse: bool) -> ReadAnswer | None:
        """The certified step's read, from its certificate: ``out_kept`` (the attention over tiers 1
        and 2 the certificate bounds, float32 products with float64 finishing) rounded once to the
        queries' dtype, its log-sum-exp, and the policy's statistics from the same weights. Only
        for the very tensor the step certified (identity, and its version counter where it keeps
        one: an inference tensor keeps none, so change it by making a new one), in the same
        lifecycle generation with no write since, the tier's ``scale`` and ``causal``, no window,
        the statistic the policy declared, queries of 16 or 32 bits (a float64 read is computed: the
        certificate's output is float32-accurate) and no gradient asked of them. A tensor changed in
        place after the update by a path its version counter does not see (``.data``, a NumPy view,
        an inference tensor or its base) is not told: its read is answered for the values the step
        certified (build the tier with ``answer=False`` to compute every read). A row whose scores
        hold NaN or +inf reads as a computed read's does (output NaN; log-sum-exp NaN or +inf; its
        head's statistics NaN, refused at the commit)."""
        a = self._answers[layer]
        if a is None or a.q() is not q or a.version != _version(q) or a.generation != cache.lifecycle.generation:
            return None
        if scale != self.scale or causal != self.causal or window is not None or statistic != a.statistic:
            return None
        if q.requires_grad and torch.is_grad_enabled():  # the certificate's output carries no gradient to q
            return None
        G = q.shape[2] // self.H
        # a row that sees no key (or only scores of -inf) reads 0, as a computed read's
        out = torch.where((a.lse == -math.inf).unsqueeze(-1), 0.0, a.cert.out_kept)
        out = unfold_groups(out.to(q.dtype), G, 1)
        lse_out = unfold_groups(a.lse.float().unsqueeze(-1), G, 1).squeeze(-1) if lse else None
        return ReadAnswer(out=out, lse=lse_out, key_max=a.key_max, key_sum=a.key_sum,
                          keys=self.storage.slots + self.M,
                          why="the compressed tier's certificate computed this read (tiers 1 and 2, float32 products; "
                              "its output rounded once to the queries' dtype)")

    def held_state(self, layer: int, q: Tensor) -> tuple[Tensor, TierHeld]:
        """The certificate's inputs for queries ``q [B, T, Hq, D]``: the query rows ``[B, H, Q, D]``
        and what ``layer`` holds (:class:`~.bound32.TierHeld`)."""
        st = self.storage
        qh = self.query_rows(q)
        qpos = None
        if self.causal:
            qpos = self.cache.lifecycle.query_positions()
            qpos = qpos.repeat(qh.shape[2] // qpos.numel())
        hide1 = position_mask(st.layer_positions(layer), qpos)  # [H, Q|1, S1]
        k1, v1 = st.head_view("k", layer).transpose(0, 1), st.head_view("v", layer).transpose(0, 1)
        k2, v2, dk2, dv2 = self.decoded(layer)
        return qh, TierHeld(k1=k1, v1=v1, hide1=hide1, k2=k2, v2=v2, live2=self.live[layer],
                            dk2=self._per_group(self.kf, dk2, self.gk), dv2=self._per_group(self.vf, dv2, self.gv),
                            lo=self.lo[layer], hi=self.hi[layer], logn=self.log_count[layer], vlo=self.vlo[layer],
                            vhi=self.vhi[layer], wide=k1.dtype.itemsize > 4)

    @staticmethod
    def _per_group(codec, bound: Tensor, group: int) -> Tensor:
        """An integer format's bound is one number per group of channels: keep one per group."""
        if isinstance(codec, IntCodec) and group > 1:
            return bound.reshape(*bound.shape[:-1], -1, group)[..., 0].contiguous()
        return bound

    def certificate(self, layer: int, q: Tensor, parts: bool = False, count: Tensor | None = None
                    ) -> tuple[Certificate, dict]:
        """The certificate of ``q`` (the open span's queries) over ``layer`` now: kept = tier 1
        and the live tier-2 entries, evicted = tier 3 (:func:`~.bound32.certify_tier`). With
        ``parts`` also what the recall plan ranks by; with ``count`` tier 1's statistics."""
        qh, held = self.held_state(layer, q)
        cert, got = certify_tier(qh, held, scale=self.scale, top=self.top, ref=self._ref[layer], parts=parts,
                                 count=count)
        ref = cert.out_kept.mean(-2, keepdim=True).float()
        self._ref[layer] = torch.where(torch.isfinite(ref), ref, 0.0)  # a NaN row must not spoil the next step
        return cert, got

    # ------------------------------------------------------------------ recall
    def _target(self, layer: int) -> Tensor:
        """``[1, H, 1]``: recall's target for a query's L-inf error, ``recall_tau`` x the head's value range."""
        span = (self.vmax[layer] - self.vmin[layer]).clamp(min=0.0)
        return (self.recall_tau * span).double().view(1, self.H, 1)

    def _plan(self, layer: int, cert: Certificate, parts: dict) -> bool:
        """Recall, for every head with a query over target, the shortest prefix of its blocks by
        estimated contribution that brings every query under target (as far as the free recall
        slots allow; a *shortfall* otherwise). Ranked and chosen on the device; one host read.
        True if the kept set changed."""
        self._stats["plans"] += 1
        H, blk, M = self.H, self.block, self.M
        dev = self.k_codes.device
        err = cert.error.amax(-1)  # [B, H, Q]
        target = self._target(layer)
        over = (err > target).any(dim=(0, 2))  # [H]
        counts = self._count_h[layer]  # recall keeps the counts on the host
        NB = max(1, -(-int(counts.max()) // blk))
        B, _, Q = err.shape
        score = torch.zeros((B, H, Q, NB), dtype=torch.float64, device=dev)
        ent = self._ring_entries(counts)
        bid = torch.where(self.live[layer], torch.div(ent, blk, rounding_mode="floor"), 0).clamp(0, NB - 1)  # [H, M]
        score.scatter_add_(-1, bid.view(1, H, 1, M).expand(B, H, Q, M),
                           parts["entry"].double() * self.live[layer].view(1, H, 1, M))
        if parts["block3"] is not None:
            n3 = min(parts["block3"].shape[-1], NB)
            score[..., :n3] += parts["block3"][..., :n3].nan_to_num(0.0)
        order = score.amax(dim=(0, 2)).argsort(-1, descending=True)  # [H, NB]
        srt = score.gather(-1, order.view(1, H, 1, NB).expand(B, H, Q, NB))
        rem = err.unsqueeze(-1) - torch.cat([torch.zeros_like(srt[..., :1]), srt.cumsum(-1)], -1)
        ok = (rem <= target.unsqueeze(-1)).all(dim=2).all(dim=0)  # [H, NB + 1]
        k_needed = torch.where(ok, torch.arange(NB + 1, device=dev), NB).amin(-1)
        k_needed = torch.where(over, k_needed.clamp(min=1), 0)
        plan = torch.cat([k_needed.view(H, 1), order], 1).cpu()  # the one host read of the plan
        epoch = self.cache.open_span[0]
        changed = False
        for h in range(H):
            kh = int(plan[h, 0])
            if not kh:
                continue
            c = int(counts[h])
            todo = [b for b in plan[h, 1:kh + 1].tolist() if b * blk < c and b not in self._recalled[layer][h]]
            sizes = {b: min((b + 1) * blk, c) - b * blk for b in todo}
            if sum(sizes.values()) > len(self._free[layer][h]):  # release blocks recalled for earlier spans
                for b in [b for b, (_, e) in self._recalled[layer][h].items() if e < epoch]:
                    self._release(layer, h, b, refresh=False)
                    changed = True
            taken, room = [], len(self._free[layer][h])
            for b in todo:
                if sizes[b] <= room:
                    taken.append(b)
                    room -= sizes[b]
            if len(taken) < len(todo):
                self._stats["shortfalls"] += 1
            for b in taken:
                self._recall(layer, h, b, epoch)
                changed = True
        if changed:
            self._refresh(layer)
        return changed

    def _recall(self, layer: int, h: int, b: int, epoch: int) -> None:
        c = int(self._count_h[layer, h])
        k, v, pos = self._host_rows(layer, h, b * self.block, min((b + 1) * self.block, c))
        n = pos.numel()
        free = self._free[layer][h]
        slots = free[:n]
        dev = self.cache.device
        kd, vd = k.to(dev), v.to(dev)
        self.storage.write_recall(layer, h, slots, kd.transpose(0, 1), vd.transpose(0, 1), pos.to(dev))
        self._free[layer][h] = free[n:]  # after the write (which may refuse: copy on write of shared pages)
        self.rec_block[layer, h, slots] = b
        self._recalled[layer][h][b] = (slots, epoch)
        nbytes = kd.nbytes + vd.nbytes
        self._stats["recalled_blocks"] += 1
        self._stats["recalled_tokens"] += n
        self._stats["h2d_bytes"] += nbytes
        if self._stats["h2d_bytes_per_span"]:
            self._stats["h2d_bytes_per_span"][-1] += nbytes

    def _release(self, layer: int, h: int, b: int, refresh: bool = True) -> None:
        slots, _ = self._recalled[layer][h].pop(b)
        self.storage.clear_recall(layer, h, slots)
        self.rec_block[layer, h, slots] = -1
        free = self._free[layer][h]
        free.extend(slots)
        free.sort()
        if refresh:
            self._refresh(layer)
