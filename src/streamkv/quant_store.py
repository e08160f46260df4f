"""``QuantStore``: the quantised K/V of a :class:`~streamkv.storage.KVStorage` (``storage.codes``).

A storage built with ``quant=`` (:class:`~streamkv.quant.KVQuant`) keeps no dense K/V of its
slots. It holds, per layer (tensors in the cache's own layout, the last dim changed)::

    k_codes, v_codes   uint8 [L, *shape, slots C0..S, W]     codes of slots [c0, S)
    k_scale, v_scale   bfloat16 [L, *shape, slots, G]       a scale per group (formats with one)
    hot_k, hot_v       cache dtype [L, *shape, NH, D]       full-precision rows: sinks, open span, residual
    hot_row            int64 [L|1, H|1, S]                  the hot row a slot reads (-1: its codes)
    hot_plan           int64 [chunk]                        the hot rows of the open span's rows

``c0 = sink`` when the sinks stay in full precision (their slots have no codes), else 0.
``NH = sink (if full-precision sinks) + residual + chunk``: a non-sink position ``p`` lives in
hot row ``base + p % (residual + chunk)`` while it is hot; the open span and the ``residual``
newest committed positions never collide there.

Lifecycle (called by the cache, after the policy's plan is applied):

- ``begin``: the open span's hot rows (``hot_plan``, device arithmetic in place) and
  ``hot_row`` at its slots (a ``scatter_`` through the device plan, per head for per-head plans).
- ``write``: one ``index_copy_`` of the span's rows into ``hot_k`` / ``hot_v`` at ``hot_plan``:
  device indices only, so a captured CUDA graph writes the right rows on replay.
- ``commit``: the span's non-sink rows are quantised *once*, from their hot rows, into the
  codes of their slots (``index_copy_`` / ``index_put_`` through the plan), and the hot rows of
  the positions that leave the residual are released (``hot_row`` entries set to -1). Device
  ops only; host ints choose the row ranges.

Reads: :meth:`load` gives the attendable K/V of slots ``[a, b)`` (float32: codes decoded,
rotated back from the storage basis, then hot rows substituted where ``hot_row >= 0``): a
block at a time, never the whole history (:func:`~streamkv.attention.attend` reads it
through ``KVRead.load``). :meth:`gather` gives arbitrary slots the same way (the chronological
view, the certifier's evicted rows); :meth:`dense` the whole layer (``cache.keys()``: a copy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .quant import KVQuant, hadamard

if TYPE_CHECKING:
    from .storage import KVStorage

__all__ = ["QuantStore"]


class QuantStore:
    """Codes, scales and full-precision hot rows of one storage (see the module docstring)."""

    def __init__(self, storage: KVStorage, quant: KVQuant, sink: int, residual_rows: int | None = None) -> None:
        st = storage
        D, Dv = st.k_shape[-1], st.v_shape[-1]
        quant.check(D, Dv)
        self.st, self.quant = st, quant
        self.kf, self.vf = quant.key_format, quant.value_format
        self.gk, self.gv = quant.groups(D, Dv)
        self.D, self.Dv = D, Dv
        self.sink = sink
        self.c0 = sink if quant.sinks else 0
        self.base = self.c0  # hot rows [0, base) are the sinks
        self.ring = quant.residual + st.chunk if residual_rows is None else residual_rows
        self.rows = self.base + self.ring
        dev, L, seq = st.device, st.num_layers, st.seq_dim
        self.seq = seq + 1  # buffers carry the layer dim first
        n_codes = st.slots - self.c0

        def buf(shape: tuple[int, ...], last: int, n: int, dtype: torch.dtype) -> Tensor:
            full = (L, *shape[:seq], n, *shape[seq + 1:-1], last)
            return torch.zeros(full, dtype=dtype, device=dev)

        self.k_codes = buf(st.k_shape, self.kf.code_width(D), n_codes, torch.uint8)
        self.v_codes = buf(st.v_shape, self.vf.code_width(Dv), n_codes, torch.uint8)
        self.k_scale = buf(st.k_shape, D // self.gk, n_codes, torch.bfloat16) if self.kf.scaled else None
        self.v_scale = buf(st.v_shape, Dv // self.gv, n_codes, torch.bfloat16) if self.vf.scaled else None
        self.hot_k = buf(st.k_shape, D, self.rows, st.dtype)
        self.hot_v = buf(st.v_shape, Dv, self.rows, st.dtype)
        lp, hp = (L, st.heads) if st.per_head else (1, 1)
        self.hot_row = torch.full((lp, hp, st.slots), -1, dtype=torch.long, device=dev)
        self.hot_plan = torch.zeros(st.chunk, dtype=torch.long, device=dev)
        self._arange = torch.arange(st.chunk, dtype=torch.long, device=dev)
        self._ring = torch.tensor(self.ring, dtype=torch.long, device=dev)
        self._heads = torch.arange(st.heads, dtype=torch.long, device=dev)
        self._sinks_hot()
        kb, vb = quant.bases()
        self.rk = hadamard(D, dev) if kb == "hadamard" else None
        self.rv = hadamard(Dv, dev) if vb == "hadamard" else None
        self.acc = torch.promote_types(st.dtype, torch.float32)

    def _sinks_hot(self) -> None:
        if self.c0:
            self.hot_row[..., : self.c0] = torch.arange(self.c0, device=self.hot_row.device)

    # ------------------------------------------------------------------ sizes
    def tensors(self) -> dict[str, Tensor]:
        out = {"k_codes": self.k_codes, "v_codes": self.v_codes, "hot_k": self.hot_k, "hot_v": self.hot_v,
               "hot_row": self.hot_row, "hot_plan": self.hot_plan}
        if self.k_scale is not None:
            out["k_scale"] = self.k_scale
        if self.v_scale is not None:
            out["v_scale"] = self.v_scale
        return out

    @property
    def nbytes(self) -> int:
        """Device bytes of everything this store holds (codes, scales, hot rows, maps)."""
        return sum(t.nbytes for t in self.tensors().values())

    @property
    def code_bytes(self) -> int:
        """Bytes of codes and scales (the quantised part)."""
        return sum(t.nbytes for t in (self.k_codes, self.v_codes, self.k_scale, self.v_scale) if t is not None)

    def bytes_per_token(self) -> float:
        """Code and scale bytes per stored token (every layer and head, K and V)."""
        n = self.k_codes.shape[self.seq]
        return self.code_bytes / n if n else 0.0

    # -------------------------------------------------------------- lifecycle
    def begin(self, start: int, n: int) -> None:
        """The open span ``[start, start + n)`` takes its hot rows; its slots (the storage's
        plan, already applied) read them."""
        hp = self.hot_plan
        hp.copy_(self._arange).add_(start).remainder_(self._ring).add_(self.base)
        if self.c0 and start < self.c0:
            m = min(self.c0 - start, n)
            hp[:m].copy_(self._arange[:m]).add_(start)
        plan = self.st.plan[..., :n]  # [L|1, H|1, n], the shape of hot_row's leading dims
        self.hot_row.scatter_(-1, plan, hp[:n].expand(*plan.shape[:-1], n))

    def write(self, layer: int, k: Tensor, v: Tensor) -> None:
        """The open span's rows into their hot rows (device indices: graph-safe)."""
        n = k.shape[self.st.seq_dim]
        rows = self.hot_plan if n == self.st.chunk else self.hot_plan[:n]
        self.hot_k[layer].index_copy_(self.st.seq_dim, rows, k)
        self.hot_v[layer].index_copy_(self.st.seq_dim, rows, v)

    def commit(self, start: int, n: int) -> None:
        """Quantise the span's non-sink rows into the codes of its slots; release the hot rows
        of the positions that leave the residual."""
        first = max(0, min(self.c0 - start, n))  # rows [0, first) are full-precision sinks
        if first < n:
            rows = self.hot_plan[first:n]
            slots = self.st.plan[..., first:n]
            self._quantise_rows(rows, slots)
        # hot (non-sink) positions before this commit: [max(c0, start - residual), start + n);
        # after it: [max(c0, start + n - residual), start + n)
        r = self.quant.residual
        lo, hi = max(self.c0, start - r), max(self.c0, start + n - r)
        self._release(lo, hi)

    def _release(self, lo: int, hi: int) -> None:
        """Slots reading hot rows of positions ``[lo, hi)`` read their codes from now on."""
        if hi <= lo:
            return
        m = hi - lo
        if m >= self.ring:
            ranges = [(self.base, self.rows)]
        else:
            a = self.base + lo % self.ring
            b = a + m
            top = self.rows
            ranges = [(a, min(b, top))] + ([(self.base, self.base + b - top)] if b > top else [])
        hr = self.hot_row
        for a, b in ranges:
            hr.masked_fill_((hr >= a) & (hr < b), -1)

    def _quantise_rows(self, rows: Tensor, slots: Tensor) -> None:
        """Hot ``rows [m]`` of every layer -> codes at ``slots [L|1, H|1, m]``."""
        st, s = self.st, self.seq
        for which in ("k", "v"):
            hot = self.hot_k if which == "k" else self.hot_v
            x = hot.index_select(s, rows)  # [L, *shape(m), D]
            codes, scale = self._encode(which, x)
            cbuf, sbuf = (self.k_codes, self.k_scale) if which == "k" else (self.v_codes, self.v_scale)
            idx = slots - self.c0
            if not st.per_head:
                i = idx[0, 0]
                cbuf.index_copy_(s, i, codes)
                if sbuf is not None:
                    sbuf.index_copy_(s, i, scale)
            elif st.head_dim is None:  # one virtual head, a plan per layer
                for layer in range(st.num_layers):
                    cbuf[layer].index_copy_(st.seq_dim, idx[layer, 0], codes[layer])
                    if sbuf is not None:
                        sbuf[layer].index_copy_(st.seq_dim, idx[layer, 0], scale[layer])
            else:
                for layer in range(st.num_layers):
                    self._put_heads(cbuf[layer], idx[layer], codes[layer])
                    if sbuf is not None:
                        self._put_heads(sbuf[layer], idx[layer], scale[layer])

    def _put_heads(self, buf: Tensor, idx: Tensor, x: Tensor) -> None:
        """``buf`` (one layer) at per-head slots ``idx [H, m]`` <- ``x`` (the rows, same layout)."""
        st = self.st
        m = idx.shape[-1]
        heads = st._heads_idx[:m]
        buf.permute(st._perm).index_put_((idx.transpose(0, 1), heads), x.permute(st._perm))

    def _encode(self, which: str, x: Tensor) -> tuple[Tensor, Tensor | None]:
        fmt, g, r = (self.kf, self.gk, self.rk) if which == "k" else (self.vf, self.gv, self.rv)
        x = x.float()
        if r is not None:
            x = x @ r.T
        return fmt.encode(x, g)

    # ------------------------------------------------------------------ reads
    def _decode(self, which: str, codes: Tensor, scale: Tensor | None) -> Tensor:
        fmt, g, r, d = (self.kf, self.gk, self.rk, self.D) if which == "k" else (self.vf, self.gv, self.rv, self.Dv)
        x = fmt.decode(codes, scale, d, g)
        if r is not None:
            x = x @ r
        return x.to(self.acc)

    def load(self, layer: int, a: int, b: int) -> tuple[Tensor, Tensor]:
        """Attendable K/V of slots ``[a, b)`` of ``layer`` (``acc`` dtype, token dim at the
        storage's ``seq_dim``): a copy of those slots only."""
        return self._range(layer, "k", a, b), self._range(layer, "v", a, b)

    def _range(self, layer: int, which: str, a: int, b: int) -> Tensor:
        st, seq = self.st, self.st.seq_dim
        codes = (self.k_codes if which == "k" else self.v_codes)[layer]
        scale = (self.k_scale if which == "k" else self.v_scale)
        scale = None if scale is None else scale[layer]
        hot = (self.hot_k if which == "k" else self.hot_v)[layer]
        lo = max(a, self.c0)
        parts = []
        if a < lo:  # full-precision sink slots (all hot): zeros, overlaid below
            shape = list(hot.shape)
            shape[seq] = min(lo, b) - a
            parts.append(torch.zeros(shape, dtype=self.acc, device=hot.device))
        if lo < b:
            c = codes.narrow(seq, lo - self.c0, b - lo)
            s = None if scale is None else scale.narrow(seq, lo - self.c0, b - lo)
            parts.append(self._decode(which, c, s))
        x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=seq)
        return self._overlay(layer, hot, x, self.hot_row_of(layer)[:, a:b])

    def hot_row_of(self, layer: int) -> Tensor:
        """``[H|1, S]``: the hot row each slot of ``layer`` reads (-1: codes)."""
        return self.hot_row[layer if self.hot_row.shape[0] > 1 else 0]

    def _overlay(self, layer: int, hot: Tensor, x: Tensor, idx: Tensor) -> Tensor:
        """``x`` (decoded rows of some slots) with the hot rows ``idx [H|1, n]`` substituted."""
        st, seq = self.st, self.st.seq_dim
        use = idx >= 0
        safe = idx.clamp(min=0)
        if idx.shape[0] == 1 or st.head_dim is None:  # one map for every head
            h = hot.index_select(seq, safe[0]).to(self.acc)
            shape = [1] * x.dim()
            shape[seq] = idx.shape[-1]
            return torch.where(use[0].view(shape), h, x)
        # per head: rows (token, head, ..., feature) by advanced indexing
        n = idx.shape[-1]
        hp = hot.permute(st._perm)  # [NH, H, ..., D]
        g = hp[safe.transpose(0, 1), self._heads].to(self.acc)  # [n, H, ..., D]
        xp = x.permute(st._perm)
        m = use.transpose(0, 1).view(n, idx.shape[0], *([1] * (xp.dim() - 2)))
        out = torch.where(m, g, xp)
        inv = [0] * len(st._perm)
        for i, p in enumerate(st._perm):
            inv[p] = i
        return out.permute(inv)

    def gather(self, layer: int, which: str, slots: Tensor) -> Tensor:
        """Stored K (``"k"``) or V of ``layer`` at ``slots`` (a copy, ``acc`` dtype)."""
        st, seq = self.st, self.st.seq_dim
        codes = (self.k_codes if which == "k" else self.v_codes)[layer]
        scale = self.k_scale if which == "k" else self.v_scale
        hot = (self.hot_k if which == "k" else self.hot_v)[layer]
        ci = (slots - self.c0).clamp(min=0)
        c = codes.index_select(seq, ci)
        s = None if scale is None else scale[layer].index_select(seq, ci)
        x = self._decode(which, c, s)
        idx = self.hot_row_of(layer).index_select(-1, slots)
        if self.c0:  # sink slots: always their hot rows
            idx = torch.where(slots.view(1, -1) < self.c0, slots.view(1, -1), idx)
        return self._overlay(layer, hot, x, idx)

    def dense(self, layer: int, which: str) -> Tensor:
        """Every slot of ``layer`` as stored (a dequantised copy, ``acc`` dtype)."""
        return self._range(layer, which, 0, self.st.slots)

    def error_bounds(self, layer: int, which: str, a: int, b: int) -> Tensor:
        """Float32 bounds on ``|x - x_hat|`` per element of slots ``[a, b)`` *in the storage
        basis* of ``which`` (0 for hot rows): what the certificate charges (see
        :mod:`streamkv.certify.quant_bound`)."""
        st, seq = self.st, self.st.seq_dim
        fmt, g, d = (self.kf, self.gk, self.D) if which == "k" else (self.vf, self.gv, self.Dv)
        codes = (self.k_codes if which == "k" else self.v_codes)[layer]
        scale = self.k_scale if which == "k" else self.v_scale
        lo = max(a, self.c0)
        parts = []
        shape = list(codes.shape)
        shape[-1] = d
        if a < lo:
            shape[seq] = min(lo, b) - a
            parts.append(torch.zeros(shape, dtype=torch.float32, device=codes.device))
        if lo < b:
            c = codes.narrow(seq, lo - self.c0, b - lo)
            s = None if scale is None else scale[layer].narrow(seq, lo - self.c0, b - lo)
            parts.append(fmt.error_bound(c, s, d, g))
        e = parts[0] if len(parts) == 1 else torch.cat(parts, dim=seq)
        idx = self.hot_row_of(layer)[:, a:b]
        zero = torch.zeros((), dtype=e.dtype, device=e.device)
        if idx.shape[0] == 1 or st.head_dim is None:
            view = [1] * e.dim()
            view[seq] = idx.shape[-1]
            return torch.where((idx[0] >= 0).view(view), zero, e)
        ep = e.permute(st._perm)
        n = idx.shape[-1]
        m = (idx >= 0).transpose(0, 1).view(n, idx.shape[0], *([1] * (ep.dim() - 2)))
        inv = [0] * len(st._perm)
        for i, p in enumerate(st._perm):
            inv[p] = i
        return torch.where(m, zero, ep).permute(inv)

    def error_bounds_at(self, layer: int, which: str, slots: Tensor) -> Tensor:
        """:meth:`error_bounds` of arbitrary ``slots`` (token dim at ``seq_dim``)."""
        st, seq = self.st, self.st.seq_dim
        fmt, g, d = (self.kf, self.gk, self.D) if which == "k" else (self.vf, self.gv, self.Dv)
        codes = (self.k_codes if which == "k" else self.v_codes)[layer]
        scale = self.k_scale if which == "k" else self.v_scale
        ci = (slots - self.c0).clamp(min=0)
        e = fmt.error_bound(codes.index_select(seq, ci), None if scale is None else scale[layer].index_select(seq, ci),
                            d, g)
        idx = self.hot_row_of(layer).index_select(-1, slots)
        hot = (idx >= 0) | (slots.view(1, -1) < self.c0)  # [H|1, n]
        zero = torch.zeros((), dtype=e.dtype, device=e.device)
        if hot.shape[0] == 1 or st.head_dim is None:
            view = [1] * e.dim()
            view[seq] = hot.shape[-1]
            return torch.where(hot[0].view(view), zero, e)
        ep = e.permute(st._perm)
        n = hot.shape[-1]
        m = hot.transpose(0, 1).view(n, hot.shape[0], *([1] * (ep.dim() - 2)))
        inv = [0] * len(st._perm)
        for i, p in enumerate(st._perm):
            inv[p] = i
        return torch.where(m, zero, ep).permute(inv)

    def basis(self, which: str) -> Tensor | None:
        """The rotation ``R`` of ``which``'s storage basis (``x_stored = x @ R.T``), or None."""
        return self.rk if which == "k" else self.rv

    # ------------------------------------------------------- slot maintenance
    def shift(self, dst: int, src: int, n: int) -> None:
        """Move slots ``[src, src + n)`` to ``[dst, dst + n)`` (the chronological roll)."""
        if src < self.c0 or dst < self.c0:
            raise ValueError(f"shift of slots [{src}, {src + n}) -> [{dst}, ...) touches the full-precision sinks")
        s = self.seq
        bufs = [(t, s) for t in (self.k_codes, self.v_codes, self.k_scale, self.v_scale) if t is not None]
        moved = [t.narrow(d, src - self.c0, n).clone() for t, d in bufs]
        hr = self.hot_row.narrow(-1, src, n).clone()
        for (t, d), m in zip(bufs, moved):
            t.narrow(d, dst - self.c0, n).copy_(m)
        self.hot_row.narrow(-1, dst, n).copy_(hr)

    def write_recall(self, layer: int, head: int, idx: Tensor, k: Tensor, v: Tensor) -> None:
        """Quantise recalled rows (token dim first, one head) into the codes of slots ``idx``."""
        st = self.st
        for which, x in (("k", k), ("v", v)):
            codes, scale = self._encode(which, x)
            cbuf, sbuf = (self.k_codes, self.k_scale) if which == "k" else (self.v_codes, self.v_scale)
            ci = idx - self.c0
            cbuf[layer].permute(st._perm)[ci, head] = codes
            if sbuf is not None:
                sbuf[layer].permute(st._perm)[ci, head] = scale
        hr = self.hot_row_of(layer)
        if hr.shape[0] > 1:
            hr[head, idx] = -1

    def clear_recall(self, layer: int, head: int, idx: Tensor) -> None:
        st = self.st
        ci = idx - self.c0
        for t in (self.k_codes, self.v_codes, self.k_scale, self.v_scale):
            if t is not None:
                t[layer].permute(st._perm)[ci, head] = 0

    def zero_(self) -> None:
        for t in self.tensors().values():
            if t is not self.hot_row and t is not self.hot_plan:
                t.zero_()
        self.hot_row.fill_(-1)
        self.hot_plan.zero_()
        self._sinks_hot()

    # ------------------------------------------------------------- state dicts
    def state(self) -> dict[str, Tensor]:
        return {f"quant_{k}": t for k, t in self.tensors().items()}

    def check_state(self, state: dict[str, Any]) -> None:
        """Semantic checks beyond shapes and dtypes (those are the cache's): hot rows in range,
        full-precision sinks mapped to their rows, scales finite and >= 0."""
        hr = state["quant_hot_row"].to("cpu")
        if bool(((hr < -1) | (hr >= self.rows)).any()):
            raise ValueError(f"state dict quant_hot_row must be -1 or in [0, {self.rows}), got values from "
                             f"{int(hr.min())} to {int(hr.max())}")
        if self.c0 and not bool((hr[..., : self.c0] == torch.arange(self.c0)).all()):
            raise ValueError(f"state dict quant_hot_row must map the {self.c0} full-precision sink slots to their rows")
        if bool((hr[..., self.st.capacity:] != -1).any()):
            raise ValueError("state dict quant_hot_row: recall slots never read hot rows")
        hp = state["quant_hot_plan"].to("cpu")
        if bool(((hp < 0) | (hp >= self.rows)).any()):
            raise ValueError(f"state dict quant_hot_plan must be in [0, {self.rows})")
        for name in ("quant_k_scale", "quant_v_scale"):
            if name in state:
                s = state[name].float()
                if not bool((torch.isfinite(s) & (s >= 0)).all()):
                    raise ValueError(f"state dict {name} must be finite and >= 0")

    def __repr__(self) -> str:
        return f"QuantStore({self.quant.label()}, hot_rows={self.rows}, bytes={self.nbytes})"
