"""Key sketches: every evicted key kept on the device as a few bits per channel, with a per-token
bound on how far the sketch is from the key, so that each query's logit to each evicted token is
bounded tightly (the two-tier cache's middle tier).

Per layer and head, the evicted keys are quantized in *blocks* of ``block_tokens`` tokens (the
tokens one head evicts, in eviction order): per block and channel ``c`` a float32 zero ``z_c``, a
step ``s_c = (max_c - min_c) / (2^bits - 1)`` and the largest reconstruction error ``e_c`` (float32,
rounded up), and per token a ``bits``-bit code ``n_c`` (8 bits: one byte; 4 bits: two codes a byte).
The key a code stands for is ``k_hat_c = z_c + n_c s_c`` (computed in float64, exactly as at
quantization time), and ``|k_c - k_hat_c| <= e_c`` for every token of the block and channel, by
construction (``e_c`` is measured, not assumed). Tokens of a block not yet full (at most
``block_tokens - 1`` per head) stay exact (``k_hat = k``, ``e = 0``) until it fills.

So the sketch gives every evicted token a box ``[k_hat - e, k_hat + e]``: the certificate
(:func:`~streamkv.certify.bound.certify`) takes one box per token, and its logit bound
``scale * (q . k_hat + |q| . e)`` is at most ``2 scale |q| . e`` above the true logit. With
8-bit codes over blocks of 32 tokens that slack is a small fraction of a nat on real keys,
where a box over a block of 24 keys is several.

Memory (device, counted as allocated): ``bits/8 x D`` bytes per token for the codes, ``12 x D``
bytes per block of ``block_tokens`` tokens for zero / step / error (per batch element), one byte
per token for the live flag, one block of exact float32 keys being filled (``4 x D x
block_tokens`` per head), and the evicted value box; the allocation grows a block at a time. A
token's block is its index divided by ``block_tokens`` (blocks fill in eviction order), so no
per-token block index is stored. The full-precision evicted K/V live on the host (recall reads
them from there).

The interface is that of :class:`~streamkv.certify.summary.BlockSummaries` where the
:class:`~streamkv.certify.Certifier` uses it; a "block" of this class is one token of one head.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from ..validate import check_int
from .summary import round_down, round_up

__all__ = ["KeySketch"]


class KeySketch:
    """Per-token key sketches of one layer (see the module docstring).

    Args:
        batch, heads, head_dim, value_dim: lane and feature sizes.
        device: where the sketch lives (the cache's device).
        bits: code width, 8 or 4.
        block_tokens: tokens per quantization block (per head).
        value_dtype: dtype of the values (the value box).
    """

    def __init__(self, *, batch: int, heads: int, head_dim: int, value_dim: int, device: torch.device | str,
                 bits: int = 8, block_tokens: int = 32, value_dtype: torch.dtype = torch.float32) -> None:
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits!r}")
        check_int("block_tokens", block_tokens, 1)
        if bits == 4 and head_dim % 2:
            raise ValueError(f"4-bit codes pack two channels a byte: head_dim must be even, got {head_dim}")
        self.B, self.H, self.D, self.Dv = batch, heads, head_dim, value_dim
        self.device = torch.device(device)
        self.bits, self.block_tokens, self.value_dtype = bits, block_tokens, value_dtype
        self.merges = 0  # the interface of BlockSummaries (a sketch never merges)
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        B, H, D, dev = self.B, self.H, self.D, self.device
        self.nb = 0  # token slots per head (the longest head's count)
        self.n = [0] * H  # tokens per head
        self.quantized = [0] * H  # of which quantized (the rest, fewer than block_tokens, are pending)
        self._codes = torch.zeros((B, H, 0, self._code_width()), dtype=torch.uint8, device=dev)
        self._live = torch.zeros((H, 0), dtype=torch.bool, device=dev)
        # per block and channel: zero, step, error; block b of a head is its tokens [b * bt, (b + 1) * bt)
        self._zero = torch.zeros((B, H, 0, D), dtype=torch.float32, device=dev)
        self._step = torch.zeros((B, H, 0, D), dtype=torch.float32, device=dev)
        self._err = torch.zeros((B, H, 0, D), dtype=torch.float32, device=dev)
        self._pending = torch.zeros((B, H, self.block_tokens, D), dtype=torch.float32, device=dev)  # exact, unfilled block
        self.vlo = torch.full((B, H, self.Dv), math.inf, dtype=self.value_dtype, device=dev)
        self.vhi = torch.full((B, H, self.Dv), -math.inf, dtype=self.value_dtype, device=dev)
        self.peak_bytes = self.nbytes
        # host bookkeeping for recall: per (head, token) the store's (event id, label)
        self._origin: list[list[tuple[int, int]]] = [[] for _ in range(H)]

    def _code_width(self) -> int:
        return self.D if self.bits == 8 else self.D // 2

    def _grow(self, need: int) -> None:
        """Room for ``need`` tokens per head, in steps of one block (the allocation is what
        :attr:`nbytes` counts, so it grows no further than the stream needs)."""
        cap = self._codes.shape[2]
        if need <= cap:
            return
        bt = self.block_tokens
        cap = -(-need // bt) * bt
        blocks = cap // bt

        def grown(t: Tensor, dim: int, size: int, fill) -> Tensor:
            shape = list(t.shape)
            shape[dim] = size
            out = torch.full(shape, fill, dtype=t.dtype, device=t.device)
            out.narrow(dim, 0, t.shape[dim]).copy_(t)
            return out

        self._codes = grown(self._codes, 2, cap, 0)
        self._live = grown(self._live, 1, cap, False)
        for name in ("_zero", "_step", "_err"):
            setattr(self, name, grown(getattr(self, name), 2, blocks, 0.0))

    # ------------------------------------------------------------- adding
    def add(self, event_id: int, keys: Tensor, values: Tensor, mask: Tensor, **_: object) -> Tensor:
        """Absorb one eviction event: ``keys [B, H, n, D]``, ``values [B, H, n, Dv]``, ``mask [H, n]``
        (which rows each head evicts). Returns ``[H, n]`` int64 labels: row ``i`` of head ``h`` is that
        head's ``label``-th evicted row of the event (the store's recall key). One host read of the
        mask (the per-head counts)."""
        H, bt = self.H, self.block_tokens
        counts = mask.sum(-1).tolist()
        labels = (mask.long().cumsum(-1) - 1).clamp(min=0)
        self._grow(max(self.n[h] + counts[h] for h in range(H)))
        for h in range(H):
            m = counts[h]
            if not m:
                continue
            rows = mask[h].nonzero().flatten()
            kh = keys[:, h].index_select(1, rows).float()  # [B, m, D]
            self._live[h, self.n[h] : self.n[h] + m] = True
            self._origin[h] += [(event_id, j) for j in range(m)]
            at = 0
            while at < m:  # fill the pending block; quantize it when full
                p = self.n[h] - self.quantized[h]
                take = min(bt - p, m - at)
                self._pending[:, h, p : p + take] = kh[:, at : at + take]
                self.n[h] += take
                at += take
                if self.n[h] - self.quantized[h] == bt:
                    self._quantize(h)
        vpos = torch.tensor(math.inf, dtype=values.dtype, device=values.device)
        m4 = mask.unsqueeze(0).unsqueeze(-1)
        # outward: a quantised store's rows are float32 decodes, finer than a 16-bit value_dtype
        self.vlo = torch.minimum(self.vlo, round_down(torch.where(m4, values, vpos).amin(dim=-2), self.value_dtype))
        self.vhi = torch.maximum(self.vhi, round_up(torch.where(m4, values, -vpos).amax(dim=-2), self.value_dtype))
        self.nb = max(self.n)
        self.peak_bytes = max(self.peak_bytes, self.nbytes)
        return labels

    def _quantize(self, h: int) -> None:
        """Quantize head ``h``'s full pending block."""
        s0, m = self.quantized[h], self.block_tokens
        k = self._pending[:, h].double()  # [B, m, D]
        lo, hi = k.amin(1), k.amax(1)  # [B, D]
        levels = 2**self.bits - 1
        zero = lo.float()
        step = ((hi - lo) / levels).float()
        z64, s64 = zero.double().unsqueeze(1), step.double().unsqueeze(1)
        codes = torch.where(s64 > 0, ((k - z64) / torch.where(s64 > 0, s64, 1.0)).round(), 0.0).clamp(0, levels)
        k_hat = z64 + codes * s64  # what the certificate will compute, in the same float64 ops
        err = (k - k_hat).abs().amax(1)  # [B, D]
        err32 = torch.nextafter(err.float(), torch.tensor(math.inf))  # rounded up: never below the truth
        b = s0 // m
        self._zero[:, h, b], self._step[:, h, b], self._err[:, h, b] = zero, step, err32
        c8 = codes.to(torch.uint8)
        if self.bits == 4:
            c8 = c8[..., 0::2] | (c8[..., 1::2] << 4)
        self._codes[:, h, s0 : s0 + m] = c8
        self._pending[:, h].zero_()
        self.quantized[h] += m

    # ------------------------------------------------------------ reading
    def _boxes(self) -> tuple[Tensor, Tensor]:
        """``(k_hat, e)`` float64 ``[B, H, nb, D]`` for every token slot (pending tokens exact)."""
        nb, bt, dev = self.nb, self.block_tokens, self.device
        codes = self._codes[:, :, :nb]
        if self.bits == 4:
            codes = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2)
        i = torch.arange(nb, device=dev)
        blk = (i // bt).clamp(max=max(self._zero.shape[2] - 1, 0))
        idx = blk.view(1, 1, nb, 1).expand(self.B, self.H, nb, self.D)
        k_hat = self._zero.gather(2, idx).double() + codes.double() * self._step.gather(2, idx).double()
        e = self._err.gather(2, idx).double()
        q0 = torch.tensor(self.quantized, device=dev).view(-1, 1)  # [H, 1]
        pending = (i.view(1, -1) >= q0).unsqueeze(0).unsqueeze(-1)  # [1, H, nb, 1]
        pidx = (i.view(1, -1) - q0).clamp(0, bt - 1)  # [H, nb]
        exact = self._pending.gather(2, pidx.view(1, self.H, nb, 1).expand(self.B, -1, -1, self.D)).double()
        return torch.where(pending, exact, k_hat), torch.where(pending, 0.0, e)

    @property
    def lo(self) -> Tensor:
        k_hat, e = self._boxes()
        return k_hat - e

    @property
    def hi(self) -> Tensor:
        k_hat, e = self._boxes()
        return k_hat + e

    def boxes(self) -> tuple[Tensor, Tensor]:
        """``(lo, hi)`` float64 ``[B, H, nb, D]``: one box per token slot (dead slots: anything)."""
        k_hat, e = self._boxes()
        return k_hat - e, k_hat + e

    @property
    def count(self) -> Tensor:
        """``[H, nb]`` int32: 1 where a token slot exists (the recall planner's block sizes)."""
        nb = self.nb
        ar = torch.arange(nb, device=self.device)
        return (ar.unsqueeze(0) < torch.tensor(self.n, device=self.device).unsqueeze(1)).to(torch.int32)

    @property
    def active(self) -> Tensor:
        """``[H, nb]`` bool: the token is evicted now (not recalled)."""
        return self._live[:, : self.nb]

    def log_count(self) -> Tensor:
        """``[1, H, nb]`` float64: 0 for live tokens, ``-inf`` otherwise."""
        return torch.where(self.active, 0.0, -math.inf).to(torch.float64).unsqueeze(0)

    def evicted_count(self) -> Tensor:
        """``[H]``: tokens the sketch counts as evicted now."""
        return self.active.sum(-1)

    def summarised_tokens(self) -> Tensor:
        return torch.tensor(sum(self.n), dtype=torch.int64)

    # ------------------------------------------------------------- recall
    def block_key(self, block: int) -> tuple[int, int]:
        return 0, block

    def slot_of(self, key: tuple[int, int]) -> int | None:
        return key[1]

    def set_active(self, head: int, block: int, active: bool) -> None:
        self._live[head, block] = active

    def seal(self, block: int) -> None:
        """Nothing to seal: a token's sketch never changes."""

    def recall_rows(self, head: int, block: int) -> tuple[list[int], int]:
        """``([event id], label)``: where the store keeps this head's token ``block``."""
        eid, label = self._origin[head][block]
        return [eid], label

    @property
    def nbytes(self) -> int:
        """Device bytes allocated: codes, live flags, per-block zero/step/error, the pending
        block's exact keys, the value box (the allocation grows a block at a time)."""
        return sum(t.nbytes for t in (self._codes, self._live, self._zero, self._step, self._err, self._pending,
                                      self.vlo, self.vhi))
