"""Summaries of evicted tokens: per block of tokens and per head, a count and a key box.

One :class:`BlockSummaries` holds one layer. Its lanes are ``(batch, head)`` pairs: every
lane has its own boxes (a query of batch element ``b`` and head ``h`` only ever attends to
that lane's keys). Block *membership* is shared by the batch (the caches evict the same
slots for every batch element), so counts and recall flags are per ``(head, block)``.

Layout (device tensors; ``NB`` blocks in use)::

    lo, hi   [B, H, NB, D]   key box of each block (box_dtype; outward-rounded when narrower
                             than the keys, so the box always contains the stored keys)
    count    [H, NB] int32   tokens of the block (0: empty for that head)
    active   [H, NB] bool    False while the block is recalled into the cache
    vlo, vhi [B, H, Dv]      the box of every value ever evicted in this layer (the union;
                             still a valid box of the evicted values after recalls)

Blocks come in *sets*: the blocks made from the same eviction events. Two ways to form them:

consecutive (``pool_events=None``)
    every eviction event hands over its evicted rows (device work, no host sync); a set of
    one block absorbs ``events_per_block`` consecutive events (its box grows by elementwise
    min/max), then a new set opens.
pooled by key similarity (``pool_events=P``)
    every event first becomes a provisional set of its own (one block, as above, so the
    certificate covers its tokens at once); when ``P`` provisional sets have accumulated,
    they are re-summarised together: per head, the pool's keys are read back from the
    offload store (where they already are; host memory) and clustered with k-means into
    ``ceil(n_h / block_tokens)`` groups (deterministic farthest-point initialisation, a few
    Lloyd iterations, on the joint key vector over the batch), and each group becomes a
    block. Keys of one group share their RoPE angles and content, so its box is much
    smaller than that of a run of consecutive tokens (measured on the synthetic ring
    stream at the same memory, 32-token blocks: median ``Z_hat / Z_D`` 24 instead of 396). The host computes the boxes and
    copies them to the device (a few hundred bytes); on CUDA it waits only for the pool's
    own device-to-host copies, which finished chunks earlier.

Merging (``max_blocks``): when more than ``max_blocks`` blocks are in use, the two adjacent
closed sets covering the fewest events (the oldest such pair on ties) are merged block by
block (block ``j`` of one with block ``j`` of the other; a set with fewer blocks keeps its
extra ones): boxes unite (elementwise min / max), counts add. The union box contains both
blocks' keys and the merged count is the sum, so every inequality of the certificate still
holds (``n1 e^U1 + n2 e^U2 <= (n1 + n2) e^max(U1, U2)`` and the united box's ``U`` is at
least ``max(U1, U2)``): the bound loosens, stays valid, and summary memory stays bounded
on an unbounded stream. Older history ends up in coarser blocks (log-structured).

Why one module: what a block bounds, and when it regroups or merges, is what the certificate
relies on; the boxes, counts and value box change together in ``add``, ``_regroup`` and
``_merge_once`` over one private layout of sets and blocks, and split, each part would read it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from ..validate import check_int

__all__ = ["BlockSummaries", "round_down", "round_up", "kmeans_labels"]


def round_down(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` in ``dtype``, rounded toward ``-inf`` (never above ``x``)."""
    y = x.to(dtype)
    if dtype == x.dtype:
        return y
    over = y.to(x.dtype) > x
    return torch.where(over, torch.nextafter(y, torch.full_like(y, -math.inf)), y)


def round_up(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` in ``dtype``, rounded toward ``+inf`` (never below ``x``)."""
    y = x.to(dtype)
    if dtype == x.dtype:
        return y
    under = y.to(x.dtype) < x
    return torch.where(under, torch.nextafter(y, torch.full_like(y, math.inf)), y)


def kmeans_labels(x: Tensor, k: int, iters: int = 8) -> Tensor:
    """Deterministic k-means labels of the rows of ``x [n, F]`` (``k <= n``): farthest-point
    initialisation from row 0, then ``iters`` Lloyd steps. Returns int64 ``[n]``."""
    n = x.shape[0]
    if k <= 1 or n <= 1:
        return torch.zeros(n, dtype=torch.long, device=x.device)
    k = min(k, n)
    cent = [x[0]]
    dist = (x - x[0]).norm(dim=-1)
    for _ in range(k - 1):
        i = int(dist.argmax())
        cent.append(x[i])
        dist = torch.minimum(dist, (x - x[i]).norm(dim=-1))
    c = torch.stack(cent)
    lab = torch.cdist(x, c).argmin(-1)
    for _ in range(iters):
        onehot = torch.nn.functional.one_hot(lab, k).to(x.dtype)  # [n, k]
        cnt = onehot.sum(0)
        c = torch.where(cnt.unsqueeze(-1) > 0, (onehot.T @ x) / cnt.clamp(min=1).unsqueeze(-1), c)
        new = torch.cdist(x, c).argmin(-1)
        if torch.equal(new, lab):
            break
        lab = new
    return lab


@dataclass
class _Set:
    first: int  # first block slot
    g: int  # blocks in the set
    uid: int = 0  # stable identity (slots shift when sets merge or regroup)
    events: list[int] = field(default_factory=list)
    provisional: bool = False  # an event waiting to be pooled
    sealed: bool = False  # takes no more events (a block of it was recalled)


#: ``keys_of(event_ids) -> per event, per head: (keys [B, n_h, D], labels [n_h])`` host
#: tensors from the offload store (``labels`` are views: writing them relabels the store).
KeysOf = Callable[[list[int]], list[tuple[Tensor, Tensor, Tensor]]]


class BlockSummaries:
    """Evicted-token summaries of one layer (see the module docstring).

    Args:
        batch, heads, head_dim, value_dim: lane and feature sizes.
        device: where the summaries live (the cache's device).
        key_dtype, value_dtype: dtypes of the cache's K and V (what is summarised).
        box_dtype: storage dtype of the key boxes (default: ``key_dtype``, exact).
            ``float16`` / ``bfloat16`` halve the memory; boxes are rounded outward.
        events_per_block: consecutive mode: events absorbed by one block.
        pool_events: pooled mode: events re-summarised together by key similarity (None:
            consecutive mode).
        block_tokens: pooled mode: target tokens per block (per head).
        max_blocks: merge the oldest sets beyond this many blocks (None: unbounded).
    """

    def __init__(
        self,
        *,
        batch: int,
        heads: int,
        head_dim: int,
        value_dim: int,
        device: torch.device | str,
        key_dtype: torch.dtype = torch.float32,
        value_dtype: torch.dtype = torch.float32,
        box_dtype: torch.dtype | None = None,
        events_per_block: int = 1,
        pool_events: int | None = None,
        block_tokens: int = 32,
        max_blocks: int | None = None,
    ) -> None:
        for name, val in (("events_per_block", events_per_block), ("block_tokens", block_tokens)):
            check_int(name, val, 1)
        if pool_events is not None:
            check_int("pool_events", pool_events, 1)
        if max_blocks is not None:
            check_int("max_blocks", max_blocks, 1)
        box_dtype = key_dtype if box_dtype is None else box_dtype
        if not isinstance(box_dtype, torch.dtype) or not box_dtype.is_floating_point:
            raise TypeError(f"box_dtype must be a floating torch.dtype, got {box_dtype!r}")
        self.B, self.H, self.D, self.Dv = batch, heads, head_dim, value_dim
        self.device = torch.device(device)
        self.key_dtype, self.value_dtype, self.box_dtype = key_dtype, value_dtype, box_dtype
        self.events_per_block, self.pool_events, self.block_tokens = events_per_block, pool_events, block_tokens
        self.max_blocks = max_blocks
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        B, H, D, Dv, dev = self.B, self.H, self.D, self.Dv, self.device
        self._cap = 0
        self.nb = 0
        self._lo = torch.empty((B, H, 0, D), dtype=self.box_dtype, device=dev)
        self._hi = torch.empty((B, H, 0, D), dtype=self.box_dtype, device=dev)
        self._count = torch.zeros((H, 0), dtype=torch.int32, device=dev)
        self._active = torch.ones((H, 0), dtype=torch.bool, device=dev)
        self._views()
        self.vlo = torch.full((B, H, Dv), math.inf, dtype=self.value_dtype, device=dev)
        self.vhi = torch.full((B, H, Dv), -math.inf, dtype=self.value_dtype, device=dev)
        self.sets: list[_Set] = []
        self._uid = 0
        self.merges = 0
        self.regroups = 0
        self.peak_bytes = 0

    def _grow(self, need: int) -> None:
        if need <= self._cap:
            return
        cap = max(need, 2 * self._cap, 8)
        B, H, D, dev = self.B, self.H, self.D, self.device
        lo = torch.full((B, H, cap, D), math.inf, dtype=self.box_dtype, device=dev)
        hi = torch.full((B, H, cap, D), -math.inf, dtype=self.box_dtype, device=dev)
        count = torch.zeros((H, cap), dtype=torch.int32, device=dev)
        active = torch.ones((H, cap), dtype=torch.bool, device=dev)
        lo[:, :, : self.nb] = self._lo[:, :, : self.nb]
        hi[:, :, : self.nb] = self._hi[:, :, : self.nb]
        count[:, : self.nb] = self._count[:, : self.nb]
        active[:, : self.nb] = self._active[:, : self.nb]
        self._lo, self._hi, self._count, self._active, self._cap = lo, hi, count, active, cap

    def _views(self) -> None:
        self.lo = self._lo[:, :, : self.nb]
        self.hi = self._hi[:, :, : self.nb]
        self.count = self._count[:, : self.nb]
        self.active = self._active[:, : self.nb]

    def _new_set(self, g: int, provisional: bool) -> _Set:
        first = self.nb
        self._grow(self.nb + g)
        self._lo[:, :, first : first + g] = math.inf
        self._hi[:, :, first : first + g] = -math.inf
        self._count[:, first : first + g] = 0
        self._active[:, first : first + g] = True
        self.nb += g
        self._views()
        self._uid += 1
        s = _Set(first=first, g=g, uid=self._uid, provisional=provisional)
        self.sets.append(s)
        return s

    # --------------------------------------------------------------- adding
    def add(self, event_id: int, keys: Tensor, values: Tensor, mask: Tensor,
            keys_of: KeysOf | None = None, invalidate: Callable[[list[int]], None] | None = None) -> Tensor:
        """Absorb one eviction event (device work; pooled mode may regroup, see the module
        docstring).

        Args:
            event_id: the store's id of the event (recorded per set, for recall).
            keys: ``[B, H, n, D]`` the event's rows (RoPE-rotated, as stored);
            values: ``[B, H, n, Dv]``;
            mask: ``[H, n]`` bool, which rows each head evicts.
            keys_of: pooled mode: reads events back from the offload store.
            invalidate: called with the uids of sets about to be regrouped or merged, before
                they change (the cache releases their recalled blocks).

        Returns:
            ``[H, n]`` int64: each row's block within its set (all 0 until a regroup
            rewrites the store's labels).
        """
        pooled = self.pool_events is not None
        last = self.sets[-1] if self.sets else None
        if pooled or last is None or last.sealed or len(last.events) >= self.events_per_block:
            s = self._new_set(1, provisional=pooled)
        else:
            s = self.sets[-1]
        b = s.first
        m4 = mask.unsqueeze(0).unsqueeze(-1)
        pos = torch.tensor(math.inf, dtype=keys.dtype, device=keys.device)
        lo_new = torch.where(m4, keys, pos).amin(dim=-2)  # [B, H, D]
        hi_new = torch.where(m4, keys, -pos).amax(dim=-2)
        self._lo[:, :, b] = torch.minimum(self._lo[:, :, b], round_down(lo_new, self.box_dtype))
        self._hi[:, :, b] = torch.maximum(self._hi[:, :, b], round_up(hi_new, self.box_dtype))
        self._count[:, b] += mask.sum(-1, dtype=torch.int32)
        vpos = torch.tensor(math.inf, dtype=values.dtype, device=values.device)
        # outward: a quantised store's rows are float32 decodes, finer than a 16-bit value_dtype
        self.vlo = torch.minimum(self.vlo, round_down(torch.where(m4, values, vpos).amin(dim=-2), self.value_dtype))
        self.vhi = torch.maximum(self.vhi, round_up(torch.where(m4, values, -vpos).amax(dim=-2), self.value_dtype))
        s.events.append(event_id)
        if pooled:
            trailing = 0
            for t in reversed(self.sets):
                if not t.provisional:
                    break
                trailing += 1
            if trailing >= self.pool_events:
                if keys_of is None:
                    raise ValueError("pooled summaries need keys_of (the offload store) to regroup")
                pool = self.sets[-trailing:]
                if invalidate is not None:
                    invalidate([t.uid for t in pool])
                self._regroup(pool, keys_of)
        if self.max_blocks is not None:
            while self.nb > self.max_blocks and self._merge_once(invalidate):
                pass
        self.peak_bytes = max(self.peak_bytes, self.nbytes)
        return torch.zeros(mask.shape, dtype=torch.long, device=mask.device)

    def _regroup(self, pool: list[_Set], keys_of: KeysOf) -> None:
        """Replace the provisional sets ``pool`` (the trailing ones) by one set of blocks
        clustered by key similarity (host work on the store's copies)."""
        events = [e for s in pool for e in s.events]
        entries = keys_of(events)  # per event, per head: (keys [B, n_h, D], labels view [n_h]), host
        B, H, D = self.B, self.H, self.D
        feats = []  # per head: joint features over the batch [n_h, B*D]
        for h in range(H):
            fh = [k.to(torch.float64).permute(1, 0, 2).reshape(k.shape[1], B * D) for k, _ in (e[h] for e in entries)]
            feats.append(torch.cat(fh) if fh else torch.zeros((0, B * D), dtype=torch.float64))
        counts = [f.shape[0] for f in feats]
        g = max(1, max(-(-n // self.block_tokens) for n in counts))
        # float64 boxes of the stored keys, rounded outward to box_dtype below (a quantised store's
        # keys are float32 decodes: key_dtype may not hold them)
        lo = torch.full((B, H, g, D), math.inf, dtype=torch.float64)
        hi = torch.full((B, H, g, D), -math.inf, dtype=torch.float64)
        cnt = torch.zeros((H, g), dtype=torch.int32)
        for h in range(H):
            n = counts[h]
            if not n:
                continue
            lab = kmeans_labels(feats[h], -(-n // self.block_tokens))
            start = 0
            for e in entries:
                labels = e[h][1]
                labels.copy_(lab[start : start + labels.numel()])
                start += labels.numel()
            x = feats[h].view(n, B, D)  # the stored keys, float64: exact
            for j in range(int(lab.max()) + 1):
                sel = lab == j
                if sel.any():
                    lo[:, h, j] = x[sel].amin(0)
                    hi[:, h, j] = x[sel].amax(0)
                    cnt[h, j] = int(sel.sum())
        # drop the provisional blocks (they are the last ones) and add the pooled set
        first = pool[0].first
        del self.sets[-len(pool):]
        self.nb = first
        self._views()
        s = self._new_set(g, provisional=False)
        s.events = events
        dev = self.device
        self._lo[:, :, first : first + g] = round_down(lo, self.box_dtype).to(dev)
        self._hi[:, :, first : first + g] = round_up(hi, self.box_dtype).to(dev)
        self._count[:, first : first + g] = cnt.to(dev)
        self.regroups += 1

    # -------------------------------------------------------------- merging
    def _merge_once(self, invalidate: Callable[[list[int]], None] | None = None) -> bool:
        """Merge the adjacent closed pair covering the fewest events; False if none."""
        closed = [i for i, s in enumerate(self.sets) if not s.provisional]
        if self.pool_events is None and closed and closed[-1] == len(self.sets) - 1:
            closed = closed[:-1]  # consecutive mode: the last set is still absorbing events
        pairs = [(i, i + 1) for i in closed if i + 1 in closed]
        if not pairs:
            return False
        i, _ = min(pairs, key=lambda p: (len(self.sets[p[0]].events) + len(self.sets[p[1]].events), p[0]))
        a, b = self.sets[i], self.sets[i + 1]
        if invalidate is not None:
            invalidate([a.uid, b.uid])
        if not bool(self._active[:, a.first : b.first + b.g].all()):
            raise RuntimeError("cannot merge summaries while their blocks are recalled; release them first")
        for j in range(min(a.g, b.g)):
            x, y = a.first + j, b.first + j
            self._lo[:, :, x] = torch.minimum(self._lo[:, :, x], self._lo[:, :, y])
            self._hi[:, :, x] = torch.maximum(self._hi[:, :, x], self._hi[:, :, y])
            self._count[:, x] += self._count[:, y]
        keep_b = b.g - min(a.g, b.g)  # b's extra blocks join a's set
        a.events.extend(b.events)
        drop_start, drop = b.first, min(a.g, b.g)
        if keep_b:
            # move b's extra blocks (b.first + a.g ..) right after a's blocks
            for t in (self._lo, self._hi):
                t[:, :, drop_start : drop_start + keep_b] = t[:, :, b.first + a.g : b.first + b.g].clone()
            for t in (self._count, self._active):
                t[:, drop_start : drop_start + keep_b] = t[:, b.first + a.g : b.first + b.g].clone()
            a.g += keep_b
            drop_start += keep_b
        end = b.first + b.g
        n_after = self.nb - end
        if n_after:
            for t in (self._lo, self._hi):
                t[:, :, drop_start : drop_start + n_after] = t[:, :, end : self.nb].clone()
            for t in (self._count, self._active):
                t[:, drop_start : drop_start + n_after] = t[:, end : self.nb].clone()
        del self.sets[i + 1]
        for s in self.sets[i + 1 :]:
            s.first -= drop
        self.nb -= drop
        self._views()
        self.merges += 1
        return True

    # -------------------------------------------------------------- reading
    def log_count(self) -> Tensor:
        """``[1, H, NB]`` float64: ``log n_b`` for active, non-empty blocks, else ``-inf``."""
        c = self.count.to(torch.float64)
        live = (self.count > 0) & self.active
        return torch.where(live, c.log(), -math.inf).unsqueeze(0)

    def block_key(self, block: int) -> tuple[int, int]:
        """Stable identity ``(set uid, index in set)`` of block slot ``block``."""
        for s in self.sets:
            if s.first <= block < s.first + s.g:
                return s.uid, block - s.first
        raise IndexError(f"no block {block} (have {self.nb})")

    def slot_of(self, key: tuple[int, int]) -> int | None:
        """Current slot of the block with identity ``key``; None if it no longer exists."""
        uid, j = key
        for s in self.sets:
            if s.uid == uid:
                return s.first + j if j < s.g else None
        return None

    def set_active(self, head: int, block: int, active: bool) -> None:
        """Count a block's tokens of ``head`` as evicted (True) or as held elsewhere (False,
        e.g. recalled into the cache)."""
        self._active[head, block] = active

    def seal(self, block: int) -> None:
        """The set of ``block`` takes no more events (its block is being recalled)."""
        for s in self.sets:
            if s.first <= block < s.first + s.g:
                s.sealed = True
                return

    def boxes(self) -> tuple[Tensor, Tensor]:
        """``(lo, hi)``: the key boxes of the blocks in use."""
        return self.lo, self.hi

    def recall_rows(self, head: int, block: int) -> tuple[list[int], int]:
        """``(event ids, group)``: where the store keeps ``block``'s tokens (every head alike)."""
        return self.block_events(block)

    def block_events(self, block: int) -> tuple[list[int], int]:
        """``(event ids, group)`` of block slot ``block``: its tokens for head ``h`` are the
        rows of those events that ``h`` evicted and that carry label ``group``."""
        for s in self.sets:
            if s.first <= block < s.first + s.g:
                return list(s.events), block - s.first
        raise IndexError(f"no block {block} (have {self.nb})")

    @property
    def nbytes(self) -> int:
        """Device bytes of the summaries in use: boxes, counts, flags, the value box."""
        per_block = 2 * self.B * self.D * self._elt(self.box_dtype) + 4 + 1  # per (head, block)
        return self.H * self.nb * per_block + 2 * self.B * self.H * self.Dv * self._elt(self.value_dtype)

    @staticmethod
    def _elt(dtype: torch.dtype) -> int:
        return torch.empty((), dtype=dtype).element_size()

    def summarised_tokens(self) -> Tensor:
        """0-dim int64 (device): (token, head) entries ever summarised (recalled or not)."""
        return self.count.sum(dtype=torch.int64)
