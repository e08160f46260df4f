"""The fuzzer hook of quantised storage: random layouts, kinds, formats (every entry of
:data:`~streamkv.quant.KV_FORMATS`), residuals and call sequences (advances, reopens, spans of
any length, resets, state-dict round trips, refused writes), checked after every step against a
model of the stream kept here:

- every occupied slot holds its position's last write exactly where it is full precision
  (sinks with ``sinks=True``, the open span, the ``residual`` newest committed positions) and
  the format's round trip of its committed write elsewhere;
- ``attend`` (block by block, causal or not) equals float64 attention over the stored values;
- a refused write changes nothing.

``streamkv fuzz --quant N`` runs ``N`` such streams beside the fuzzer's layouts (mismatches
counted, not raised).
"""

from __future__ import annotations

import math
import random
import time
from typing import Any

import torch

from streamkv import KVCache
from streamkv.attention import attend
from streamkv.caches import CACHE_KINDS
from streamkv.quant import KV_FORMATS, KVQuant, hadamard
from streamkv_lab.kinds import kind_params

__all__ = ["fuzz_quant", "round_trip"]


def round_trip(quant: KVQuant, which: str, x: torch.Tensor) -> torch.Tensor:
    """The stored value of ``x [..., D]`` (float32) under ``quant``, from the format alone."""
    fmt = quant.key_format if which == "k" else quant.value_format
    basis = quant.bases()[0 if which == "k" else 1]
    d = x.shape[-1]
    g = quant.group or d
    r = hadamard(d) if basis == "hadamard" else None
    y = x.float() @ r.T if r is not None else x.float()
    codes, scale = fmt.encode(y, g)
    out = fmt.decode(codes, scale, d, g)
    return out @ r if r is not None else out


def _one_rounding_apart(quant: KVQuant, which: str, x: torch.Tensor, got: torch.Tensor) -> bool:
    """In a Hadamard basis the stored value is the format's rounding of ``x @ R.T`` as the store's
    float32 matmul summed it, which may differ from :func:`round_trip`'s in the last bit and land
    on the other side of a rounding boundary: then ``got`` (rotated into the basis) must still be
    within the format's bound of the exactly rotated ``x`` (float64), plus that float32 slack (and
    one bfloat16 step of a scale, which the store's absmax may have crossed)."""
    basis = quant.bases()[0 if which == "k" else 1]
    if basis != "hadamard":
        return False
    fmt = quant.key_format if which == "k" else quant.value_format
    d = x.shape[-1]
    g = quant.group or d
    r = hadamard(d)
    y = x.double() @ r.double().T  # the rotation, exactly enough
    codes, scale = fmt.encode(y.float(), g)
    bound = fmt.error_bound(codes, scale, d, g).double()
    slack = d * 2.0**-23 * (x.double().abs() @ r.double().abs().T)  # float32 summation of the rotation
    return bool(((got.double() @ r.double().T - y).abs() <= bound * (1 + 2.0**-7) + slack).all())


def _reference(q, read, k, v, causal):
    pos = read.positions
    H = pos.shape[0]
    qt, kt, vt = (t.double().transpose(1, 2) for t in (q, k, v))
    s = qt @ kt.transpose(-1, -2) / math.sqrt(q.shape[-1])
    hide = (pos < 0).view(1, H, 1, -1)
    if causal:
        hide = hide | (pos.view(1, H, 1, -1) > read.query_positions.view(1, 1, -1, 1))
    return (s.masked_fill(hide, -math.inf).softmax(-1) @ vt).transpose(1, 2)


def fuzz_quant(cases: int = 20, steps: int = 14, seed: int = 0, *, keep_going: bool = False,
               progress=None) -> dict[str, Any]:
    """Run ``cases`` random streams (see the module docstring). A mismatch raises
    ``AssertionError`` at once, or with ``keep_going`` ends that case only and is counted
    (``mismatches``; the first few in ``failures``: what the CLI reports). Returns counts."""
    t0 = time.perf_counter()
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    checked = refused = mismatches = 0
    failures: list[str] = []
    formats: dict[str, int] = {}
    kinds: dict[str, int] = {}
    for i in range(cases):
        try:
            c, r, kind, fmt = _case(rng, g, steps)
        except AssertionError as exc:
            if not keep_going:
                raise
            mismatches += 1
            if len(failures) < 5:
                failures.append(f"quant case {i}: {exc}")
        else:
            checked, refused = checked + c, refused + r
            formats[fmt] = formats.get(fmt, 0) + 1
            kinds[kind] = kinds.get(kind, 0) + 1
        if progress is not None:
            progress(i + 1)
    return {"cases": cases, "slots_checked": checked, "refused_writes": refused, "mismatches": mismatches,
            "kinds": kinds, "formats": formats, "failures": failures, "seconds": time.perf_counter() - t0}


def _case(rng: random.Random, g: torch.Generator, steps: int) -> tuple[int, int, str, str]:
    """One random stream; ``(slots checked, refused writes, kind, format)``; ``AssertionError`` on
    a mismatch."""
    checked = refused = 0
    kind = rng.choice(list(CACHE_KINDS))
    fmt = rng.choice(list(KV_FORMATS))
    C = rng.randint(1, 4)
    sink = rng.randint(0, 3)
    window = rng.randint(2 * C, 3 * C + 4)
    H, D = rng.choice([1, 2, 3]), rng.choice([4, 8])
    quant = KVQuant(fmt, residual=rng.choice([0, 1, C, 2 * C + 1]), sinks=rng.random() < 0.7,
                    basis=rng.choice(["identity", "hadamard"]), group=rng.choice([None, D // 2]))
    params = kind_params(kind, tau=0.05)
    cache = KVCache((1, sink + window, H, D), (1, sink + window, H, D), seq_dim=1, sink=sink, window=window,
                    chunk=C, policy=kind, quant=quant, **params)
    hist: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hot: set[int] = set()
    for _ in range(steps):
        op = rng.random()
        if op < 0.06:
            cache.reset()
            hist.clear()
            hot.clear()
            continue
        if op < 0.12 and not cache.is_open and cache.end:
            state = cache.state_dict()
            other = KVCache((1, sink + window, H, D), (1, sink + window, H, D), seq_dim=1, sink=sink,
                            window=window, chunk=C, policy=kind, quant=quant, **params)
            other.load_state_dict(state)
            cache = other
        chunked = cache.end % C == 0 and rng.random() < 0.7
        if chunked:
            c = cache.next_chunk - (1 if cache.end and cache.last_span[1] == C and rng.random() < 0.3 else 0)
            reopen = c < cache.next_chunk
            cache.begin_chunk(c)
        else:
            reopen = False
            cache.begin_tokens(rng.randint(1, C))
        start, n = cache.open_span
        hot |= set(range(start - quant.residual if reopen else start, start + n))  # a reopen: its residual again
        for _ in range(rng.randint(1, 2)):
            k, v, q = (torch.randn(1, n, H, D, generator=g) * 2 for _ in range(3))
            if rng.random() < 0.15:  # a refused write changes nothing
                before = cache.state_dict()
                try:
                    cache.write(torch.randn(1, n + 1, H, D), torch.randn(1, n + 1, H, D))
                except ValueError:
                    refused += 1
                after = cache.state_dict()
                assert all(torch.equal(before[x], after[x]) for x in before if isinstance(before[x], torch.Tensor)), (
                    kind, fmt, "a refused write changed the state")
            read = cache.layer(0).update(k, v, q)
            for i in range(n):
                hist[start + i] = (k[:, i], v[:, i])
            causal = rng.random() < 0.5
            out, _ = attend(q, read, causal=causal, block=rng.randint(1, 6))
            ref = _reference(q, read, cache.keys(0), cache.values(0), causal)
            assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5), (kind, fmt, (out.double() - ref).abs().max())
        pos, kx, vx = cache.layer_slot_positions(0), cache.keys(0), cache.values(0)
        for h in range(H):
            for s in range(pos.shape[1]):
                p = int(pos[h, s])
                if p < 0:
                    continue
                for which, got, orig in (("k", kx[:, s, h], hist[p][0][:, h]), ("v", vx[:, s, h], hist[p][1][:, h])):
                    full = p in hot or (quant.sinks and p < sink)
                    want = orig.float() if full else round_trip(quant, which, orig)
                    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6) or (
                        not full and _one_rounding_apart(quant, which, orig, got)), (kind, fmt, quant, p, reopen)
                    checked += 1
        cache.commit()
        end = cache.end
        hot = {p for p in hot if p >= end - quant.residual}
    return checked, refused, kind, fmt
