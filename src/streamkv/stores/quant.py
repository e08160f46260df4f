"""``QuantStore``: codes and scales of a :class:`~streamkv.stores.codecs.KVQuant` format instead of
dense K/V, with the rows still being written kept in full precision.

Per layer (tensors in the cache's layout, the token dim holding slots, the last dim changed)::

    k_codes, v_codes   uint8 [L, *shape, slots c0..S, W]   codes of slots [c0, S)
    k_scale, v_scale   bfloat16 [L, *shape, slots, G]      a scale per group (scaled formats)
    hot_k, hot_v       cache dtype [L, *shape, NH, D]      full-precision rows: sinks, open span, residual
    hot_row            int64 [L|1, H|1, S]                 the hot row a slot reads (-1: its codes)
    hot_plan           int64 [chunk]                       the hot rows of the open span's rows

``c0 = sink`` when the sinks stay in full precision (their slots have no codes), else 0.
``NH = c0 + residual + chunk``: a non-sink position ``p`` lives in hot row
``c0 + p % (residual + chunk)`` while it is hot; the open span and the ``residual`` newest
committed positions never collide there.

Lifecycle (after the policy's plan is applied): ``begin`` gives the open span its hot rows
(``hot_plan``, device arithmetic in place) and points its slots at them (``hot_row``, a
``scatter_`` through the device plan); ``write`` is one ``index_copy_`` into the hot rows (device
indices: graph-safe); ``commit`` quantises the span's non-sink rows *once* into the codes of their
slots and releases the hot rows of the positions that leave the residual.

A read is two segments: the codes of slots ``[c0, S)`` (a hot slot hidden there) and the hot
rows with the positions of the slots that read them. Nothing is decoded into a dense copy of the
history: the reader decodes a block at a time, or in registers.

Why one module: the codes, the hot rows and the map between them are one piece of state; every
method reads or changes all three together.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .base import Segment, Store, WritePlan
from .codecs import KVQuant, hadamard
from .dense import gather_rows, put_rows
from .dims import Dims
from .pages import PageTable

__all__ = ["QuantStore"]


def _with_basis_rounding(e: Tensor, decoded: Tensor, dim: int) -> Tensor:
    """Bounds ``e`` (float32, of the codes against ``y = fl32(fl32(x) @ R.T)``, what was encoded)
    widened to bound them against the exact ``x @ R.T`` (what attention's dot products are
    invariant for): the float32 product has error at most ``gamma_D |x| |R|`` per element (any
    summation order), and ``|x| |R| <= ||x||_1 / sqrt(D) <= ||x||_2 = ||x R^T||_2 <= ||x_hat||_2 +
    ||e||_2`` (``R`` orthogonal with entries ``+-1/sqrt(D)``); the float32 rounding of a float64 ``x``
    adds ``2^-24 ||x||_2``: ``gamma`` of ``D + 2`` terms, doubled, in float64, then rounded up."""
    u = (dim + 2) * 2.0**-24
    gamma = 2.0 * u / (1.0 - u)
    norm = decoded.double().norm(dim=-1, keepdim=True) + e.double().norm(dim=-1, keepdim=True)
    return ((e.double() + gamma * norm) * (1.0 + 2.0**-22)).float()


#: the fewest shadowed code rows worth a cut of the read (a decoded token's one row is not)
_MIN_CUT = 64


class QuantStore(Store):
    """Codes, scales and full-precision hot rows of one cache (see the module docstring)."""

    exact = False

    def __init__(self, dims: Dims, quant: KVQuant, *, num_layers: int, dtype: torch.dtype, device: torch.device,
                 sink: int, capacity: int, per_head: bool, table: PageTable | None = None) -> None:
        super().__init__(dims, num_layers=num_layers, dtype=dtype, device=device)
        self.table = table
        D, Dv = dims.features
        quant.check(D, Dv)
        self.quant = quant
        self.kf, self.vf = quant.key_format, quant.value_format
        self.gk, self.gv = quant.groups(D, Dv)
        self.sink, self.capacity = sink, capacity
        self.c0 = sink if quant.sinks else 0
        if quant.residual > capacity:  # more full-precision rows than the cache holds tokens: rows for nothing
            raise ValueError(f"KVQuant residual={quant.residual} must be <= the cache's sink + window ({capacity})")
        self.ring = quant.residual + dims.chunk
        self.rows = self.c0 + self.ring
        L, S, H = num_layers, dims.slots, dims.heads
        self.row_offset = self.c0
        n_codes = S - self.c0 if table is None else table.pool.capacity * table.page

        def buf(which: str, last: int, n: int, dt: torch.dtype) -> Tensor:
            return torch.zeros((L, *dims.shape(which, n, last)), dtype=dt, device=device)

        self.k_codes = buf("k", self.kf.code_width(D), n_codes, torch.uint8)
        self.v_codes = buf("v", self.vf.code_width(Dv), n_codes, torch.uint8)
        self.k_scale = buf("k", D // self.gk, n_codes, torch.bfloat16) if self.kf.scaled else None
        self.v_scale = buf("v", Dv // self.gv, n_codes, torch.bfloat16) if self.vf.scaled else None
        self.hot_k = buf("k", D, self.rows, dtype)
        self.hot_v = buf("v", Dv, self.rows, dtype)
        lp, hp = (L, H) if per_head else (1, 1)
        self.hot_row = torch.full((lp, hp, S), -1, dtype=torch.long, device=device)
        self.hot_plan = torch.zeros(dims.chunk, dtype=torch.long, device=device)
        self._arange = torch.arange(dims.chunk, dtype=torch.long, device=device)
        self._ring = torch.tensor(self.ring, dtype=torch.long, device=device)
        self._slot_idx = torch.arange(S, dtype=torch.long, device=device)
        self._heads_idx = torch.arange(H, dtype=torch.long, device=device)
        self._sinks_hot()
        #: the code rows the open span shadows, where the host knows them (:meth:`_shadowed`)
        self._shadow: tuple | None = None
        kb, vb = quant.bases()
        self.rk = hadamard(D, device) if kb == "hadamard" else None
        self.rv = hadamard(Dv, device) if vb == "hadamard" else None
        self.acc = torch.promote_types(dtype, torch.float32)
        # the largest |x| a commit takes per K and V: what the format stores finitely and the cache's
        # dtype reads back finitely (a basis rotation may gather a row's norm into one channel)
        top = torch.finfo(dtype).max * (1 - 2**-6)
        self.largest = tuple(min(f.largest(), top) / (math.sqrt(d) if r is not None else 1.0)
                              for f, d, r in ((self.kf, D, self.rk), (self.vf, Dv, self.rv)))

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

    def paged(self) -> list[Tensor]:
        return [t for t in (self.k_codes, self.v_codes, self.k_scale, self.v_scale) if t is not None]

    def private(self) -> dict[str, Tensor]:
        return {"hot_k": self.hot_k, "hot_v": self.hot_v, "hot_row": self.hot_row, "hot_plan": self.hot_plan}

    def fork(self) -> QuantStore:
        if self.table is None:
            return super().fork()
        out = object.__new__(QuantStore)
        out.__dict__.update(self.__dict__)
        out.table = self.table.fork()
        for name, t in self.private().items():  # the branch's own full-precision rows
            setattr(out, name, t.clone())
        return out

    def state(self) -> dict[str, Tensor]:
        out = {f"quant_{k}": t for k, t in self.tensors().items()}
        if self.table is not None:
            for t in self.paged():
                name = next(k for k, v in out.items() if v is t)
                out[name] = self._logical(t)
        return out

    def load_state(self, state: dict[str, Tensor]) -> None:
        if self.table is None:
            return super().load_state(state)
        seq = self.dims.seq + 1
        for name, t in {f"quant_{k}": v for k, v in self.tensors().items()}.items():
            if not any(t is p for p in self.paged()):
                t.copy_(state[name])
                continue
            at = 0
            for a, m in self.row_ranges(self.c0, self.dims.slots - self.c0):
                t.narrow(seq, a, m).copy_(state[name].narrow(seq, at, m))
                at += m

    def _logical(self, t: Tensor) -> Tensor:
        seq = self.dims.seq + 1
        runs = self.row_ranges(self.c0, self.dims.slots - self.c0)
        if len(runs) == 1:
            return t.narrow(seq, runs[0][0], runs[0][1])
        return torch.cat([t.narrow(seq, a, m) for a, m in runs], dim=seq)

    def config(self) -> dict[str, Any]:
        return {"quant": self.quant.config()}

    @property
    def code_bytes(self) -> int:
        """Bytes of codes and scales (the quantised part)."""
        return sum(t.nbytes for t in (self.k_codes, self.v_codes, self.k_scale, self.v_scale) if t is not None)

    def bytes_per_token(self) -> float:
        """Code and scale bytes per stored token (every layer and head, K and V)."""
        n = self.k_codes.shape[self.dims.seq + 1]
        return self.code_bytes / n if n else 0.0

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        scales = sum(t.nbytes for t in (self.k_scale, self.v_scale) if t is not None)
        out.update(format=self.quant.label(), code_bytes=self.code_bytes - scales, scale_bytes=scales,
                   full_precision_bytes=self.hot_k.nbytes + self.hot_v.nbytes, full_precision_rows=self.rows,
                   map_bytes=self.hot_row.nbytes + self.hot_plan.nbytes)
        return out

    # -------------------------------------------------------------- lifecycle
    def begin(self, start: int, n: int, where: WritePlan) -> None:
        hp = self.hot_plan
        hp.copy_(self._arange).add_(start).remainder_(self._ring).add_(self.c0)
        if self.c0 and start < self.c0:
            m = min(self.c0 - start, n)
            hp[:m].copy_(self._arange[:m]).add_(start)
        plan = where.plan[..., :n]  # [L|1, H|1, n], the shape of hot_row's leading dims
        self.hot_row.scatter_(-1, plan.expand(*self.hot_row.shape[:2], n), hp[:n].expand(*self.hot_row.shape[:2], n))
        self._shadow = self._shadowed(where, start, n)

    def reopen(self, start: int, positions: Tensor) -> None:
        """The residual positions before a reopened span read their full-precision rows again: the
        span's commit released them to their codes, and their rows are intact (row ``c0 + p %
        (residual + chunk)``: no span began since, and the span's own rows are others). A position
        its head evicted at that commit holds no slot and stays gone. The reopened span's reads then
        equal its first pass's."""
        lo = max(self.c0, start - self.quant.residual)
        if lo >= start:
            return
        hr = self.hot_row
        pos = positions if positions.shape[:2] == hr.shape[:2] else positions[:1, :1]  # a shared plan: one map
        back = (pos >= lo) & (pos < start)
        hr.copy_(torch.where(back, self.c0 + pos.remainder(self._ring), hr))

    def _shadowed(self, where: WritePlan, start: int, n: int) -> tuple | None:
        """The code rows the open span's full-precision rows shadow, where the host knows them: as
        host runs ``(row, rows)`` where every head's span is in the same slots, in host ranges (the
        ring); as a count where each head's span is in slots of its own (a per-head plan past the
        sinks: ``n`` window slots per head, each a code row); else None. Only with no residual (no
        other slot reads a hot row) and codes not in pages. Kept with the map's tensor and version:
        any later change of the map (a commit's release, a load, a reset) voids it."""
        if self.quant.residual or self.table is not None or self.hot_row.is_inference() or torch.compiler.is_compiling():
            return None
        if where.per_head:
            return (n, self.hot_row, self.hot_row._version) if start >= max(self.sink, self.c0) else None
        if where.ranges is None or any(a < self.c0 for a, _ in where.ranges):
            return None
        return tuple((a - self.c0, m) for a, m in where.ranges), self.hot_row, self.hot_row._version

    def _shadow_now(self, n: int) -> tuple | int | None:
        """The open span's shadow (:meth:`_shadowed`) if it is still the map's and worth a cut: at
        least a sixteenth of the ``n`` code rows (and :data:`_MIN_CUT`), since a cut costs more
        than a decoded token's row saves; else None. A traced read reads every row (and guards on
        nothing the host keeps)."""
        sh = self._shadow
        if torch.compiler.is_compiling() or sh is None or sh[1] is not self.hot_row or sh[1]._version != sh[2]:
            return None
        rows = sh[0] if isinstance(sh[0], int) else sum(m for _, m in sh[0])
        return sh[0] if rows >= max(_MIN_CUT, n // 16) else None

    def _head_cut(self, n: int) -> int:
        """The code rows each head's open span shadows in slots of its own (0: no cut)."""
        sh = self._shadow_now(n)
        return sh if isinstance(sh, int) else 0

    def _unshadowed(self, hot: Tensor, m: int) -> Tensor:
        """``[H, m]``: each head's code rows that no hot row shadows, in order (``hot [H, n]``; every
        head shadows ``n - m``, so each head's ``m`` rows fill its row of the map exactly)."""
        keep = ~hot
        dest = torch.where(keep, keep.cumsum(-1) - 1, m)  # the shadowed rows into a spare column
        idx = torch.empty((hot.shape[0], m + 1), dtype=torch.long, device=hot.device)
        return idx.scatter_(-1, dest, self._slot_idx[: hot.shape[1]].expand_as(dest))[:, :m]

    def _head_rows(self, x: Tensor | None, idx: Tensor) -> Tensor | None:
        """Rows ``idx [H, m]`` of each head of ``x`` (one layer, attention layout): a copy."""
        if x is None:
            return None
        view = [1] * (x.dim() - 1)
        view[self.dims.head_axis], view[-1] = idx.shape
        return gather_rows(x, idx.view(view))

    def _code_runs(self, n: int) -> list[tuple[int, int]]:
        """The runs ``(row, rows)`` of the ``n`` code rows a read attends: all of them, or those no
        hot row of the open span shadows where the span is in the same slots of every head (a
        shadowed code row is hidden from every query: it would only cost the read its scores)."""
        sh = self._shadow_now(n)
        if sh is None or isinstance(sh, int):
            return [(0, n)]
        out, at = [], 0
        for a, m in sorted(sh):
            if a > at:
                out.append((at, a - at))
            at = max(at, a + m)
        if at < n:
            out.append((at, n - at))
        return out

    def write(self, layer: int, k: Tensor, v: Tensor, where: WritePlan) -> None:
        seq = self.dims.seq
        n = k.shape[seq]
        rows = self.hot_plan if n == self.dims.chunk else self.hot_plan[:n]
        self.hot_k[layer].index_copy_(seq, rows, k)
        self.hot_v[layer].index_copy_(seq, rows, v)

    def check_commit(self, start: int, n: int) -> None:
        first = max(0, min(self.c0 - start, n))
        if first < n and self.quant.check_finite and not torch.compiler.is_compiling():
            rows = self.hot_plan[first:n]
            s = self.dims.seq + 1
            # NaN fails the compare, as inf and a finite value beyond what the format stores do
            fits = torch.stack([(h.index_select(s, rows).abs() <= lim).all()
                                for h, lim in ((self.hot_k, self.largest[0]), (self.hot_v, self.largest[1]))])
            if not bool(fits.all()):  # one device read per commit of a quantised store
                raise ValueError(
                    f"positions [{start}, {start + n}) hold NaN or inf keys or values, or values beyond what the "
                    f"format stores as a finite number (|x| <= {self.largest[0]:.4g} for keys, "
                    f"{self.largest[1]:.4g} for values, read back in {self.dtype}); write such K/V again before the "
                    f"commit; nothing was committed")

    def commit(self, start: int, n: int, where: WritePlan) -> None:
        self._shadow = None  # the span's rows become codes: none is shadowed until the next begin
        first = max(0, min(self.c0 - start, n))  # rows [0, first) are full-precision sinks
        if first < n:
            self._quantise_rows(self.hot_plan[first:n], where.plan[..., first:n], where.per_head)
        # hot (non-sink) positions before this commit: [max(c0, start - residual), start + n);
        # after it: [max(c0, start + n - residual), start + n)
        r = self.quant.residual
        self._release(max(self.c0, start - r), max(self.c0, start + n - r))

    def _release(self, lo: int, hi: int) -> None:
        """Slots reading hot rows of positions ``[lo, hi)`` read their codes from now on."""
        if hi <= lo:
            return
        m = hi - lo
        if m >= self.ring:
            ranges = [(self.c0, self.rows)]
        else:
            a = self.c0 + lo % self.ring
            b = a + m
            ranges = [(a, min(b, self.rows))] + ([(self.c0, self.c0 + b - self.rows)] if b > self.rows else [])
        hr = self.hot_row
        for a, b in ranges:
            hr.masked_fill_((hr >= a) & (hr < b), -1)

    def _quantise_rows(self, rows: Tensor, slots: Tensor, per_head: bool) -> None:
        """Hot ``rows [m]`` of every layer -> codes at ``slots [L|1, H|1, m]``."""
        d, s = self.dims, self.dims.seq + 1
        idx = self.rows_of(slots)
        for which in ("k", "v"):
            hot = self.hot_k if which == "k" else self.hot_v
            codes, scale = self._encode(which, hot.index_select(s, rows))  # [L, *shape(m), W]
            cbuf, sbuf = (self.k_codes, self.k_scale) if which == "k" else (self.v_codes, self.v_scale)
            pairs = [(cbuf, codes)] + ([(sbuf, scale)] if sbuf is not None else [])
            if not per_head:
                for buf, x in pairs:
                    buf.index_copy_(s, idx[0, 0], x)
            elif d.head is None:  # one virtual head, a plan per layer
                for layer in range(self.num_layers):
                    for buf, x in pairs:
                        buf[layer].index_copy_(d.seq, idx[layer, 0], x[layer])
            else:
                m = idx.shape[-1]
                heads = self._heads_idx.expand(m, -1)
                for layer in range(self.num_layers):
                    for buf, x in pairs:
                        put_rows(d.rows(buf[layer]), idx[layer].transpose(0, 1), heads, d.rows(x[layer]))

    def _encode(self, which: str, x: Tensor) -> tuple[Tensor, Tensor | None]:
        fmt, g, r = (self.kf, self.gk, self.rk) if which == "k" else (self.vf, self.gv, self.rv)
        x = x.float()
        if r is not None:
            x = x @ r.T
        return fmt.encode(x, g)

    # ------------------------------------------------------------------ reads
    def hot_row_of(self, layer: int) -> Tensor:
        """``[H|1, S]``: the hot row each slot of ``layer`` reads (-1: codes)."""
        return self.hot_row[layer if self.hot_row.shape[0] > 1 else 0]

    def segments(self, layer: int, positions: Tensor) -> list[Segment]:
        d, c0, NH = self.dims, self.c0, self.rows
        H = positions.shape[0]
        hr = self.hot_row_of(layer)
        if hr.shape[0] == 1 and (H == 1 or positions.stride(0) == 0):
            positions = positions[:1]  # every head the same: built once, handed out broadcast
        hr = hr.expand(positions.shape[0], -1)
        hot = hr >= 0
        # the hot rows' positions and slots: scattered from the slots that read them (a spare column
        # takes the slots that read none)
        dest = torch.where(hot, hr, NH)
        hot_pos = torch.full((positions.shape[0], NH + 1), -1, dtype=torch.long, device=self.device)
        hot_pos.scatter_(-1, dest, torch.where(hot, positions, -1))
        hot_slot = torch.full((positions.shape[0], NH + 1), -1, dtype=torch.long, device=self.device)
        hot_slot.scatter_(-1, dest, torch.where(hot, self._slot_idx.expand(positions.shape[0], -1), -1))
        if positions.shape[0] != H:
            hot_pos, hot_slot = hot_pos.expand(H, -1), hot_slot.expand(H, -1)
        code_pos = torch.where(hot[:, c0:], -1, positions[:, c0:]).expand(H, -1)
        out = [Segment(n=NH, positions=hot_pos[:, :NH], keys=d.attention(self.hot_k[layer]),
                       values=d.attention(self.hot_v[layer]), features=d.features, dtype=self.dtype,
                       slots=hot_slot[:, :NH], pinned=c0, span_from=None if self.quant.residual else c0)]
        if d.slots > c0:
            table, n = self.table, d.slots - c0
            kc, vc = d.attention(self.k_codes[layer]), d.attention(self.v_codes[layer])
            ks = None if self.k_scale is None else d.attention(self.k_scale[layer])
            vs = None if self.v_scale is None else d.attention(self.v_scale[layer])
            pages = {}
            if table is not None and table.identity and not torch.compiler.is_compiling():
                kc, vc = kc.narrow(-2, 0, n), vc.narrow(-2, 0, n)
                ks, vs = (None if x is None else x.narrow(-2, 0, n) for x in (ks, vs))
            elif table is not None:
                pages = {"pages": table.dev, "page": table.page,
                         "host_pages": None if torch.compiler.is_compiling() else tuple(table.host)}
            cut = 0 if pages else self._head_cut(n)
            if cut:  # each head's span in its own slots: its other code rows, gathered (codes are bytes)
                idx = self._unshadowed(hot[:, c0:], n - cut)
                rows = self._head_rows
                return out + [Segment(
                    n=n - cut, positions=code_pos.gather(-1, idx), keys=rows(kc, idx), values=rows(vc, idx),
                    features=d.features, dtype=self.acc, k_codec=self.kf, v_codec=self.vf, groups=(self.gk, self.gv),
                    k_scale=rows(ks, idx), v_scale=rows(vs, idx), k_basis=self.rk, v_basis=self.rv, slots=idx + c0,
                    finite=self.quant.check_finite)]
            runs = [(0, n)] if pages else self._code_runs(n)
            for a, m in runs:
                part = (lambda t, a=a, m=m: t if t is None or (a, m) == (0, n) else t.narrow(-2, a, m))
                out.append(Segment(
                    n=m, positions=code_pos[:, a:a + m], keys=part(kc), values=part(vc), features=d.features,
                    dtype=self.acc, k_codec=self.kf, v_codec=self.vf, groups=(self.gk, self.gv), k_scale=part(ks),
                    v_scale=part(vs), k_basis=self.rk, v_basis=self.rv, slots=c0 + a, finite=self.quant.check_finite,
                    **pages))
        return out

    def span(self, which: str, where: WritePlan, n: int) -> Tensor:
        hot = self.hot_k if which == "k" else self.hot_v  # the open span is in its full-precision rows
        rows = self.hot_plan[:n]
        return torch.stack([self.dims.to_heads(hot[layer].index_select(self.dims.seq, rows))
                            for layer in range(self.num_layers)])

    def _decode(self, which: str, codes: Tensor, scale: Tensor | None) -> Tensor:
        fmt, g, r, dim = (self.kf, self.gk, self.rk, self.dims.features[0]) if which == "k" else (
            self.vf, self.gv, self.rv, self.dims.features[1])
        x = fmt.decode(codes, scale, dim, g).to(self.acc)
        return x if r is None else x @ r.to(self.acc)

    def _overlay(self, hot: Tensor, x: Tensor, idx: Tensor) -> Tensor:
        """``x`` (decoded rows of some slots, layer layout) with the hot rows ``idx [H|1, n]`` substituted."""
        d, seq = self.dims, self.dims.seq
        use, safe = idx >= 0, idx.clamp(min=0)
        if idx.shape[0] == 1 or d.head is None:  # one map for every head
            h = hot.index_select(seq, safe[0]).to(self.acc)
            shape = [1] * x.dim()
            shape[seq] = idx.shape[-1]
            return torch.where(use[0].view(shape), h, x)
        n = idx.shape[-1]
        g = d.rows(hot)[safe.transpose(0, 1), self._heads_idx].to(self.acc)  # [n, H, ..., D]
        xp = d.rows(x)
        m = use.transpose(0, 1).view(n, idx.shape[0], *([1] * (xp.dim() - 2)))
        return d.unrows(torch.where(m, g, xp))

    def gather(self, layer: int, which: str, slots: Tensor) -> Tensor:
        """Stored K (``"k"``) or V of ``layer`` at ``slots`` (a copy, at least float32)."""
        seq = self.dims.seq
        codes = (self.k_codes if which == "k" else self.v_codes)[layer]
        scale = self.k_scale if which == "k" else self.v_scale
        hot = (self.hot_k if which == "k" else self.hot_v)[layer]
        ci = self.rows_of(slots.clamp(min=self.c0))  # sink slots read their hot rows (below)
        x = self._decode(which, codes.index_select(seq, ci), None if scale is None else scale[layer].index_select(seq, ci))
        idx = self.hot_row_of(layer).index_select(-1, slots)
        if self.c0:  # sink slots: always their hot rows
            idx = torch.where(slots.view(1, -1) < self.c0, slots.view(1, -1), idx)
        return self._overlay(hot, x, idx)

    def error_bounds(self, layer: int, which: str, slots: Tensor | None = None) -> Tensor:
        """Bounds on ``|x - x_hat|`` of ``slots`` (all when None) in the storage basis (0 for hot
        rows): what the certificate charges (:mod:`streamkv.certify.quant_bound`)."""
        d, seq = self.dims, self.dims.seq
        slots = self._slot_idx if slots is None else slots
        fmt, g, dim = (self.kf, self.gk, d.features[0]) if which == "k" else (self.vf, self.gv, d.features[1])
        codes = (self.k_codes if which == "k" else self.v_codes)[layer]
        scale = self.k_scale if which == "k" else self.v_scale
        ci = self.rows_of(slots.clamp(min=self.c0))
        c, sc = codes.index_select(seq, ci), None if scale is None else scale[layer].index_select(seq, ci)
        e = fmt.error_bound(c, sc, dim, g)
        r = self.rk if which == "k" else self.rv
        if r is not None:
            e = _with_basis_rounding(e, fmt.decode(c, sc, dim, g), dim)
        hot = (self.hot_row_of(layer).index_select(-1, slots) >= 0) | (slots.view(1, -1) < self.c0)  # [H|1, n]
        zero = torch.zeros((), dtype=e.dtype, device=e.device)
        if hot.shape[0] == 1 or d.head is None:
            view = [1] * e.dim()
            view[seq] = hot.shape[-1]
            return torch.where(hot[0].view(view), zero, e)
        ep = d.rows(e)
        n = hot.shape[-1]
        m = hot.transpose(0, 1).view(n, hot.shape[0], *([1] * (ep.dim() - 2)))
        return d.unrows(torch.where(m, zero, ep))

    def basis(self, which: str) -> Tensor | None:
        return self.rk if which == "k" else self.rv

    # ------------------------------------------------------- slot maintenance
    def shift(self, dst: int, src: int, n: int) -> None:
        if src < self.c0 or dst < self.c0:
            raise ValueError(f"shift of slots [{src}, {src + n}) -> [{dst}, ...) touches the full-precision sinks")
        s = self.dims.seq + 1
        bufs = self.paged()
        moved = [torch.cat([t.narrow(s, a, m) for a, m in self.row_ranges(src, n)], s) for t in bufs]
        hr = self.hot_row.narrow(-1, src, n).clone()
        for t, mv in zip(bufs, moved):
            at = 0
            for a, m in self.row_ranges(dst, n):
                t.narrow(s, a, m).copy_(mv.narrow(s, at, m))
                at += m
        self.hot_row.narrow(-1, dst, n).copy_(hr)

    def write_recall(self, layer: int, head: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        d = self.dims
        ci = self.rows_of(slots)
        for which, x in (("k", k), ("v", v)):
            codes, scale = self._encode(which, x)
            cbuf, sbuf = (self.k_codes, self.k_scale) if which == "k" else (self.v_codes, self.v_scale)
            d.rows(cbuf[layer])[ci, head] = codes
            if sbuf is not None:
                d.rows(sbuf[layer])[ci, head] = scale
        hr = self.hot_row_of(layer)
        if hr.shape[0] > 1:
            hr[head, slots] = -1

    def clear_recall(self, layer: int, head: int, slots: Tensor) -> None:
        d = self.dims
        ci = self.rows_of(slots)
        for t in (self.k_codes, self.v_codes, self.k_scale, self.v_scale):
            if t is not None:
                d.rows(t[layer])[ci, head] = 0

    def zero_(self) -> None:
        s = self.dims.seq + 1
        runs = self.row_ranges(self.c0, self.dims.slots - self.c0)
        for t in self.tensors().values():
            if t is self.hot_row or t is self.hot_plan:
                continue
            if self.table is None or not any(t is p for p in self.paged()):
                t.zero_()
            else:  # only this cache's pages
                for a, m in runs:
                    t.narrow(s, a, m).zero_()
        self.hot_row.fill_(-1)
        self.hot_plan.zero_()
        self._sinks_hot()

    # ------------------------------------------------------------- state dicts
    def check_state(self, state: dict[str, Any], positions: Tensor, end: int, span: int, is_open: bool) -> None:
        """The full-precision rows a state dict claims are exactly those this store would hold at
        ``end`` with the last span ``span`` long (open or not): the sinks read their own rows; the
        positions of the open span and of the residual read row ``c0 + p % (residual + chunk)``;
        no other slot reads a hot row; ``hot_plan`` names the last span's rows; scales are finite
        and >= 0."""
        hr = state["quant_hot_row"].to("cpu")
        pos = positions.to("cpu")
        H = max(hr.shape[1], pos.shape[1])
        hr, pos = hr.expand(-1, H, -1), pos.expand(hr.shape[0], H, -1)
        start, r = end - span, self.quant.residual
        # the positions that read hot rows: the residual and the span; an open span reopened after its
        # commit reads the residual before it again (a state saved by an earlier version: released)
        los = {max(self.c0, end - r)} if not is_open else {max(self.c0, start - r), max(self.c0, min(start, end - r))}
        check = (pos >= 0) | (torch.arange(pos.shape[-1]) < self.c0)
        mismatch = None
        for lo in sorted(los):
            hot = (pos >= lo) & (pos < end) & (pos >= self.c0)
            want = torch.where(hot, self.c0 + pos.remainder(self.ring), -1)
            if self.c0:  # full-precision sink slots read their rows even before the sinks are written
                want[..., : self.c0] = torch.arange(self.c0)
            # an empty slot may still name the row of a token its head evicted while it was hot (the
            # row is released with its position); every other slot must read exactly what this store would
            wrong = (hr != want) & check
            if not bool(wrong.any()):
                mismatch = None
                break
            bad = wrong.nonzero()[0].tolist()
            mismatch = (f"state dict quant_hot_row contradicts the stream at end={end}: slot {bad[2]} (layer {bad[0]}, "
                        f"head {bad[1]}) reads full-precision row {int(hr[tuple(bad)])}, where this store would read "
                        f"{int(want[tuple(bad)])} (-1: its codes)")
        if mismatch:
            raise ValueError(mismatch)
        if bool(((hr < -1) | (hr >= self.rows)).any()):
            raise ValueError(f"state dict quant_hot_row must be -1 or in [0, {self.rows})")
        used = torch.where(hr >= 0, hr, -1 - torch.arange(hr.shape[-1]))
        srt = used.sort(-1).values
        if bool(((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any()):
            raise ValueError("state dict quant_hot_row: two slots of one head read the same full-precision row")
        if span:
            i = torch.arange(span)
            hp_want = self.c0 + (start + i).remainder(self.ring)
            if self.c0:
                hp_want = torch.where(start + i < self.c0, start + i, hp_want)
            if not bool((state["quant_hot_plan"].to("cpu")[:span] == hp_want).all()):
                raise ValueError(f"state dict quant_hot_plan must name the rows of the last span "
                                 f"[{start}, {end}): {hp_want.tolist()}")
        for name in ("quant_k_scale", "quant_v_scale"):
            if name in state:
                s = state[name].float()
                ok = ~(s < 0) if not self.quant.check_finite else torch.isfinite(s) & (s >= 0)
                if not bool(ok.all()):  # (check_finite=False stores what it was given, inf and NaN included)
                    raise ValueError(f"state dict {name} must be {'finite and ' if self.quant.check_finite else ''}"
                                     f">= 0")
        if self.quant.check_finite:  # a code may mean a non-finite number (a float format's NaN); reads rely on none
            D, Dv = self.dims.features
            for which, fmt, g, dim in (("k", self.kf, self.gk, D), ("v", self.vf, self.gv, Dv)):
                codes, scale = state[f"quant_{which}_codes"], state.get(f"quant_{which}_scale")
                for layer in range(codes.shape[0]):
                    x = fmt.decode(codes[layer], None if scale is None else scale[layer], dim, g)
                    if not bool(torch.isfinite(x).all()):
                        raise ValueError(f"state dict quant_{which}_codes must decode to finite numbers (layer {layer} "
                                         f"holds NaN or inf): this store was built with check_finite=True")

    def __repr__(self) -> str:
        return f"QuantStore({self.quant.label()}, hot_rows={self.rows}, bytes={self.nbytes})"
