"""Quantised caches on SmolLM2-135M (every layer on the cache, as ``lm-eval`` streams it),
beside transformers' ``QuantizedCache`` and at matched device bytes.

One segment of ``tokens`` tokens of Moby-Dick, streamed in spans of ``chunk`` tokens (the
cache's chunk; positions from 0). Per cache: the perplexity over every prediction, the
attention error of every layer against exact full-history attention of the same queries
(:class:`.lm_stream.AttentionErrors`, every ``error_stride``-th position), device bytes (what the
cache allocates), bytes per token (codes + scales), the transient bytes of one read of its last
layer (:func:`~streamkv_lab.measure.memory.probe_transient`) and ms per chunk (the model's
whole forward of a span).

Rows (``cache`` names what holds the K/V):

- ``streamkv ring`` at the full segment, each format of :data:`~streamkv.quant.KV_FORMATS`
  (``fp32``: the model's own precision, no quantisation);
- ``transformers quanto`` / ``hqq`` / ``fp8`` (``QuantizedCache``; int4/int2, int8/int4/int2,
  per-tensor fp8) at ``residual`` tokens of full precision (our rows keep ``residual - chunk``
  committed tokens besides the open span: at most ``residual`` in all, as transformers');
- matched device bytes: a quarter of the bfloat16 full cache: the bfloat16 ring, mass, H2O and
  TOVA there, and the int8 / int4 ring and TOVA sized to the same bytes (2x / ~4x the tokens);
- certificates: the ring at the quarter bytes in bf16 / int8 / int4 with a
  :class:`~streamkv.certify.Certifier` (8-bit key sketches) checked by
  :class:`~streamkv.certify.HistoryCheck` (float64 full history of the original K/V):
  violations and tightness (``m_hat / m``) over every (query, head) row.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from streamkv.quant import KV_FORMATS, KVQuant

from .lm_stream import AttentionErrors, stream_losses

__all__ = ["run_lm", "quant_of", "FORMAT_OPTIONS"]

#: per format, the options the runs use (4 bits and fewer: the rotated basis, see streamkv.quant)
FORMAT_OPTIONS = {name: {"basis": "hadamard" if f.bits <= 4 else "identity"} for name, f in KV_FORMATS.items()}


def quant_of(fmt: str | None, residual: int = 0) -> KVQuant | None:
    return None if fmt in (None, "fp32") else KVQuant(fmt, residual=residual, **FORMAT_OPTIONS[fmt])


def _bytes_of_hf(cache: Any) -> tuple[int, int, int]:
    """(device bytes, quantised bytes, quantised tokens) held by a transformers QuantizedCache."""
    total = quant = qtok = 0

    def nb(x: Any) -> int:
        inner = getattr(x, "__tensor_flatten__", None)  # a quanto QTensor: its inner tensors, not its dense size
        if inner is not None and type(x) is not torch.Tensor:
            names, _ = inner()
            return sum(nb(getattr(x, n)) for n in names)
        if isinstance(x, torch.Tensor):
            return x.nbytes
        if isinstance(x, (tuple, list)):
            return sum(nb(y) for y in x)
        if isinstance(x, dict):
            return sum(nb(y) for y in x.values())
        return 0

    for i, layer in enumerate(cache.layers):
        q = nb(layer._quantized_keys) + nb(layer._quantized_values)
        r = nb(layer.keys) + nb(layer.values)
        total += q + r
        quant += q
        if i == 0:  # tokens held quantised (every layer holds the same)
            qtok = layer.cumulative_length - (layer.keys.shape[-2] if layer.keys.dim() == 4 else 0)
    return total, quant, max(qtok, 1)


def run_lm(model: Any, ids: torch.Tensor, *, chunk: int = 64, sink: int = 4, residual: int = 128,
           error_stride: int = 16, cert_tokens: int = 1024, formats: tuple[str, ...] | None = None,
           peers: bool = True, matched: bool = True, certificates: bool = True,
           progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The SmolLM2 rows (see the module docstring); ``ids [1, tokens]``."""
    import streamkv.integrations.transformers as skv
    from streamkv_lab.measure.memory import probe_transient

    mcfg = model.config
    T = ids.shape[1]
    L, Hkv, D = mcfg.num_hidden_layers, mcfg.num_key_value_heads, mcfg.head_dim
    formats = tuple(KV_FORMATS) if formats is None else formats
    say = progress or (lambda s: None)
    rows: list[dict[str, Any]] = []
    before = mcfg._attn_implementation

    def ppl(losses: torch.Tensor) -> float:
        return math.exp(float(losses.mean()))

    def ours(label: str, kind: str, memory: int, fmt: str | None, params: dict[str, Any], res: int) -> dict[str, Any]:
        say(f"{label} m={memory}")
        errors = AttentionErrors(L, Hkv, D, T, error_stride)
        quant = quant_of(fmt, res)
        cache = skv.build_cache(mcfg, kind, memory_tokens=memory, sink=sink, chunk=chunk, dtype=model.dtype,
                                on_attention=errors, quant=quant, **params)
        losses = torch.full((T - 1,), math.nan, dtype=torch.float64)
        t0 = time.perf_counter()
        stream_losses(model, ids, losses, span=chunk, forward_kwargs={"cache": cache})
        wall = time.perf_counter() - t0
        kv = cache.kv
        q = torch.randn(1, mcfg.num_attention_heads, kv.open_span[1], D, dtype=model.dtype)
        read = kv.read(L - 1)
        from streamkv.attention import attend

        trans = probe_transient(lambda: attend(q, read, causal=True), "cpu", steps=1).peak_bytes
        st = kv.storage
        bpt = st.store.bytes_per_token()
        summ = errors.summary("default")
        return {"dataset": "smollm2", "cache": label, "kind": kind, "bits": 32 if fmt in (None, "fp32") else
                KV_FORMATS[fmt].bits, "format": fmt or "fp32", "memory_tokens": memory, "residual": res,
                "bytes_per_token": bpt, "device_bytes": kv.nbytes, "transient_bytes": trans,
                "error_mean": summ["attn_error_mean"], "error_p99": summ["attn_error_p99"],
                "error_layers": summ["attn_error_layers"], "perplexity": ppl(losses),
                "certificate_violations": None, "tightness_median": None,
                "ms_per_chunk": 1000.0 * wall / math.ceil(T / chunk), **params}

    def peer(backend: str, nbits: int | None) -> dict[str, Any]:
        from transformers import QuantizedCache

        label = f"transformers {backend}" + (f" int{nbits}" if nbits else "")
        say(label)
        kw = {} if backend == "fp8" else {"nbits": nbits, "residual_length": residual, "q_group_size": D}
        cache = QuantizedCache(backend=backend, config=mcfg, **kw)
        losses = torch.full((T - 1,), math.nan, dtype=torch.float64)
        t0 = time.perf_counter()
        stream_losses(model, ids, losses, span=chunk, forward_kwargs={"past_key_values": cache, "use_cache": True})
        wall = time.perf_counter() - t0
        dev, qbytes, qtok = _bytes_of_hf(cache)
        layer = cache.layers[-1]
        new = [torch.randn(1, Hkv, chunk, D) for _ in range(2)]
        qh = torch.randn(1, mcfg.num_attention_heads, chunk, D)
        def step():
            k, v = layer.update(*new)
            torch.nn.functional.scaled_dot_product_attention(qh, k, v, enable_gqa=True)

        trans = probe_transient(step, "cpu", steps=1).peak_bytes
        return {"dataset": "smollm2", "cache": label, "kind": "full", "bits": 8 if backend == "fp8" else nbits,
                "format": f"{backend}-int{nbits}" if nbits else "fp8-per-tensor", "memory_tokens": T,
                "residual": 0 if backend == "fp8" else residual, "bytes_per_token": qbytes / qtok,
                "device_bytes": dev, "transient_bytes": trans, "error_mean": None, "error_p99": None,
                "perplexity": ppl(losses), "certificate_violations": None, "tightness_median": None,
                "ms_per_chunk": 1000.0 * wall / math.ceil(T / chunk)}

    def cert_row(fmt: str, memory: int) -> dict[str, Any]:
        from streamkv.certify import HistoryCheck

        say(f"certificate {fmt} m={memory}")
        n = min(cert_tokens, T)
        cache = skv.build_cache(mcfg, "ring", memory_tokens=memory, sink=sink, chunk=chunk, dtype=model.dtype,
                                quant=quant_of(fmt, 0), certify={"sketch_bits": 8})
        check = HistoryCheck(cache.certifier)
        losses = torch.full((n - 1,), math.nan, dtype=torch.float64)
        stream_losses(model, ids[:, :n], losses, span=chunk, forward_kwargs={"cache": cache})
        r = check.result()
        return {"dataset": "smollm2-certified", "cache": "streamkv ring + Certifier", "kind": "ring",
                "bits": 32 if fmt == "fp32" else KV_FORMATS[fmt].bits, "format": fmt, "memory_tokens": memory,
                "residual": 0, "bytes_per_token": None, "device_bytes": cache.kv.nbytes,
                "transient_bytes": None, "error_mean": None, "error_p99": None, "perplexity": ppl(losses),
                "certificate_violations": r["violations"], "certificate_rows": r["queries_checked"],
                "certificate_nontrivial": r["nontrivial"], "tightness_median": r["tightness_median"],
                "tightness_p95": r["tightness_p95"], "count_mismatch": r["count_mismatch"],
                "ms_per_chunk": None, "tokens": n}

    try:
        model.set_attn_implementation(skv.ATTN_IMPLEMENTATION)
        res = residual - chunk  # committed tokens kept besides the open span
        for fmt in ("fp32", *formats):
            rows.append(ours(f"streamkv ring {fmt}", "ring", T, fmt, {}, 0 if fmt == "fp32" else res))
        quarter = None
        if matched:
            full_bf16 = next(r for r in rows if r["format"] == "bf16")["device_bytes"]
            quarter = full_bf16 // 4
            for fmt, kinds in (("bf16", ("ring", "mass", "h2o", "tova")), ("int8", ("ring", "tova")),
                               ("int4", ("ring", "tova"))):
                for kind in kinds:  # residual 0: the full-precision rows are the sinks and the open span
                    m = _memory_for_bytes(mcfg, kind, quarter, sink, chunk, quant_of(fmt, 0), T)
                    params = {"tau": 0.01} if kind == "mass" else {}
                    rows.append(ours(f"streamkv {kind} {fmt}", kind, m, fmt, params, 0))
        if certificates:  # the ring at a quarter of the bytes (or of the tokens), so that it evicts
            for fmt in ("bf16", "int8", "fp8", "int4"):
                mm = _memory_for_bytes(mcfg, "ring", quarter, sink, chunk, quant_of(fmt, 0), T) if quarter else T // 4
                rows.append(cert_row(fmt, min(mm, cert_tokens // 2)))
        model.set_attn_implementation("sdpa")
        if peers:
            for backend, nbits in (("quanto", 4), ("quanto", 2), ("hqq", 8), ("hqq", 4), ("hqq", 2), ("fp8", None)):
                try:
                    rows.append(peer(backend, nbits))
                except (ImportError, ValueError, RuntimeError) as exc:
                    rows.append({"dataset": "smollm2", "cache": f"transformers {backend}", "bits": nbits,
                                 "error": f"{type(exc).__name__}: {exc}"})
    finally:
        model.set_attn_implementation(before)
    return {"tokens": T, "chunk": chunk, "sink": sink, "residual": residual, "quarter_bytes": quarter,
            "rows": rows}


def _memory_for_bytes(mcfg: Any, kind: str, target: int, sink: int, chunk: int, quant: KVQuant | None,
                      most: int) -> int:
    """The largest ``memory_tokens`` whose cache allocates at most ``target`` bytes (sized on the
    meta device; at most ``most``)."""
    import streamkv.integrations.transformers as skv

    def nbytes(m: int) -> int:
        params = {"tau": 0.01} if kind == "mass" else {}
        return skv.build_cache(mcfg, kind, memory_tokens=m, sink=sink, chunk=chunk, device="meta", quant=quant,
                               **params).kv.nbytes

    lo, hi = sink + 2 * chunk, most
    if nbytes(lo) > target:
        return lo
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if nbytes(mid) <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo
