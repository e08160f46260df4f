"""What one read of a quantised cache costs: transient bytes and time, beside the peers.

One attention layer of SmolLM2's geometry (3 key/value heads, 9 query heads, 64 channels),
``tokens`` cached tokens, one chunk of ``queries`` queries (position-causal, as in a prefill):

``streamkv <fmt>``   a quantised ring holding the tokens, ``attend(q, read, causal=True)``: the
                     codes are decoded a block of ``block`` slots at a time (online softmax)
``streamkv fp32`` / ``streamkv bf16 dense``   a plain ring in float32 / bfloat16 (SDPA on the buffers)
``transformers <backend> int<b>``   transformers' ``QuantizedCache`` layer holding the tokens:
                     its ``update`` (dequantise the whole cache, concatenate the residual and the
                     new tokens) and SDPA over what it returns, as its models do
``sglang qvg``       sglang's ``QVGPackedCausalKVCache`` (the ``--kv-cache-quant`` path) holding
                     the tokens in packed chunks: ``update_and_get_attention_kv`` (it rebuilds the
                     dense visible window) and SDPA over the view. Its PRQ codec needs
                     quant_videogen's Triton kernels (CUDA), so a stand-in codec (int4 codes of
                     this module's format) is plugged into its ``_qvg_functions``: what is measured
                     is its reconstruction's allocation, not PRQ's quality.

Transient bytes: the peak of allocations above what was in use when the read began (the
profiler's allocator events on the CPU, :func:`~streamkv_lab.measure.memory.probe_transient`).
Time: interleaved rounds (:func:`~streamkv_lab.measure.timing.time_interleaved`), median ms.
"""

from __future__ import annotations

from typing import Any

import torch

from streamkv import KVCache
from streamkv.attention import attend
from streamkv.quant import KVQuant

__all__ = ["read_costs", "READ_FORMATS"]

#: the streamkv formats measured here (the rest of KV_FORMATS is measured by the LM run)
READ_FORMATS = ("bf16", "int8", "fp8", "int4")


def _ring(tokens: int, chunk: int, quant: Any, dtype: torch.dtype, g: torch.Generator) -> tuple[KVCache, torch.Tensor]:
    H, D = 3, 64
    cache = KVCache((1, H, tokens, D), (1, H, tokens, D), seq_dim=2, sink=4, window=tokens - 4, chunk=chunk,
                    policy="ring", dtype=dtype, quant=quant)
    for c in range(tokens // chunk):
        cache.begin_chunk(c)
        k, v = (torch.randn(1, H, chunk, D, generator=g).to(dtype) for _ in range(2))
        cache.write(k, v)
        if c < tokens // chunk - 1:
            cache.commit_chunk(c)
    q = torch.randn(1, 9, chunk, D, generator=g).to(dtype)
    return cache, q


def _hf_layer(backend: str, nbits: int, tokens: int, chunk: int, residual: int, g: torch.Generator):
    from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

    cls = QuantoQuantizedLayer if backend == "quanto" else HQQQuantizedLayer
    layer = cls(nbits=nbits, q_group_size=64, residual_length=residual)
    for _ in range(tokens // chunk - 1):
        k, v = (torch.randn(1, 3, chunk, 64, generator=g) for _ in range(2))
        layer.update(k, v)
    new = [torch.randn(1, 3, chunk, 64, generator=g) for _ in range(2)]
    return layer, new


def _import_qvg():
    """sglang's ``qvg_packed_cache`` module, loaded by file path (as :mod:`streamkv_lab.bench.peers`
    loads its causal cache): the package's ``__init__`` pulls in sglang's server runtime (orjson,
    zmq, triton, ...), not installed here (sglang is installed ``--no-deps``). The module's three
    imports are served for the load: its config dataclass and the causal cache's view (both
    loaded from their own files) and a stand-in ``init_logger``; ``sys.modules`` is restored after."""
    import importlib.util
    import logging
    import sys
    import types
    from pathlib import Path

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed")
    root = Path(list(spec.submodule_search_locations)[0]) / "multimodal_gen"
    files = {"sglang.multimodal_gen.configs.quantization.qvg_kv": root / "configs" / "quantization" / "qvg_kv.py",
             "sglang.multimodal_gen.runtime.layers.kvcache.causal_attention_cache":
                 root / "runtime" / "layers" / "kvcache" / "causal_attention_cache.py"}
    target = root / "runtime" / "layers" / "kvcache" / "qvg_packed_cache.py"
    names = [*files, "sglang.multimodal_gen.runtime.utils.logging_utils"]
    parents = {".".join(n.split(".")[:i]) for n in names for i in range(1, len(n.split(".")))}
    saved = {k: sys.modules[k] for k in [*names, *parents] if k in sys.modules}
    try:
        for name in parents:
            if name not in sys.modules:
                pkg = types.ModuleType(name)
                pkg.__path__ = []
                sys.modules[name] = pkg
        stub = types.ModuleType(names[-1])
        def init_logger(n: str) -> logging.Logger:
            log = logging.getLogger(n)
            log.info_once = log.info  # sglang's logger extension
            return log

        stub.init_logger = init_logger
        sys.modules[names[-1]] = stub
        for name, path in files.items():
            ms = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(ms)
            sys.modules[name] = mod
            ms.loader.exec_module(mod)
        ms = importlib.util.spec_from_file_location("_streamkv_quant_sglang_qvg_packed_cache", target)
        qvg = importlib.util.module_from_spec(ms)
        sys.modules[ms.name] = qvg  # its dataclasses look their module up
        names.append(ms.name)
        ms.loader.exec_module(qvg)
        qvg.QVGKVQuantArgs = sys.modules[next(iter(files))].QVGKVQuantArgs
        return qvg
    finally:
        for name in [*names, *parents]:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def _qvg(tokens: int, chunk: int):
    """sglang's QVG cache with a stand-in codec (see the module docstring), ``tokens`` written."""
    qvg = _import_qvg()
    QVGKVQuantArgs = qvg.QVGKVQuantArgs

    from streamkv.quant import KV_FORMATS

    fmt = KV_FORMATS["int4"]

    def quantize(x, **_):  # x [B, H, S, D]
        codes, scale = fmt.encode(x, x.shape[-1])
        return {"residual_quant": codes, "scales": scale, "shape": x.shape}

    def dequantize(packed, block_size, bits, output_dtype):
        return fmt.decode(packed["residual_quant"], packed["scales"], packed["shape"][-1],
                          packed["shape"][-1]).to(output_dtype)

    original = qvg._qvg_functions
    qvg._qvg_functions = lambda: (quantize, dequantize)  # this module object only (loaded for this run)
    cache = qvg.QVGPackedCausalKVCache(
        batch_size=1, cache_size=tokens + chunk, num_heads=3, head_dim=64, dtype=torch.float32,
        device=torch.device("cpu"), global_end_index=torch.zeros(1, dtype=torch.long),
        local_end_index=torch.zeros(1, dtype=torch.long), use_int_indices=True, sink_tokens=0,
        attention_window_size=tokens + chunk, quant_args=QVGKVQuantArgs(bits=4).validate())
    g = torch.Generator().manual_seed(0)
    for c in range(tokens // chunk):
        k, v = (torch.randn(1, chunk, 3, 64, generator=g) for _ in range(2))
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * chunk)
    return cache, original


def read_costs(*, tokens: int = 4096, chunk: int = 64, block: int = 128, residual: int = 128,
               repeats: int = 5, formats: tuple[str, ...] = READ_FORMATS) -> dict[str, Any]:
    """Transient bytes and ms of one read per method (see the module docstring)."""
    from streamkv_lab.measure.memory import probe_transient
    from streamkv_lab.measure.timing import Stats, time_interleaved

    g = torch.Generator().manual_seed(0)
    steps: dict[str, Any] = {}
    meta: dict[str, dict[str, Any]] = {}
    for label, quant, dtype in [("streamkv fp32", None, torch.float32), ("streamkv bf16 dense", None, torch.bfloat16),
                                *[(f"streamkv {f}", KVQuant(f, basis="hadamard" if f == "int4" else "identity"),
                                   torch.float32) for f in formats]]:
        cache, q = _ring(tokens, chunk, quant, dtype, g)
        read = cache.read(0)

        def step(q=q, read=read):
            attend(q, read, causal=True, block=block)

        steps[label] = step
        meta[label] = {"method": "streamkv", "bits": 16 if quant is None and dtype == torch.bfloat16 else
                       (32 if quant is None else quant.key_format.bits), "device_bytes": cache.nbytes}
    for backend, nbits in (("quanto", 4), ("hqq", 4), ("hqq", 8)):
        try:
            layer, new = _hf_layer(backend, nbits, tokens, chunk, residual, g)
        except (ImportError, ValueError) as exc:  # pragma: no cover - the peer is not installed
            meta[f"transformers {backend} int{nbits}"] = {"error": str(exc)}
            continue
        qh = torch.randn(1, 9, chunk, 64, generator=g)

        def hf_step(layer=layer, new=new, qh=qh):
            # one layer's update then attention, as the model runs it; the layer is restored so
            # that every call reads the same number of tokens
            saved = (layer._quantized_keys, layer._quantized_values, layer.keys, layer.values, layer.cumulative_length)
            k, v = layer.update(*new)
            T = k.shape[-2]
            mask = torch.ones(chunk, T, dtype=torch.bool).tril(T - chunk)
            torch.nn.functional.scaled_dot_product_attention(qh, k, v, attn_mask=mask, enable_gqa=True)
            (layer._quantized_keys, layer._quantized_values, layer.keys, layer.values,
             layer.cumulative_length) = saved

        label = f"transformers {backend} int{nbits}"
        steps[label] = hf_step
        meta[label] = {"method": f"transformers QuantizedCache ({backend})", "bits": nbits}
    try:
        qcache, original = _qvg(tokens, chunk)
        qq = torch.randn(1, chunk, 9, 64, generator=g)
        kk, vv = (torch.randn(1, chunk, 3, 64, generator=g) for _ in range(2))
        last = (tokens // chunk - 1) * chunk

        def qvg_step():
            view = qcache.update_and_get_attention_kv(key=kk, value=vv, current_chunk_start=last)  # a denoising rewrite
            torch.nn.functional.scaled_dot_product_attention(qq.transpose(1, 2), view.k.transpose(1, 2),
                                                             view.v.transpose(1, 2), enable_gqa=True)

        steps["sglang qvg (stand-in codec)"] = qvg_step
        meta["sglang qvg (stand-in codec)"] = {"method": "sglang QVGPackedCausalKVCache", "bits": 4}
    except (ImportError, FileNotFoundError, AttributeError) as exc:  # pragma: no cover - sglang not installed
        meta["sglang qvg (stand-in codec)"] = {"error": str(exc)}
    out = {}
    for label, step in steps.items():
        mem = probe_transient(step, "cpu", steps=2)
        out[label] = {**meta[label], "transient_bytes": mem.peak_bytes, "allocated_bytes": mem.allocated_bytes}
    run = time_interleaved(steps, repeats=repeats, device="cpu", warmup=1, warmup_s=0.1)
    for label, samples in run.samples_ms.items():
        out[label]["ms_per_read"] = Stats.of(samples).median
    for label, m in meta.items():
        out.setdefault(label, m)
    base = out["streamkv bf16 dense"]["ms_per_read"]
    fp32 = out["streamkv fp32"]["ms_per_read"]
    for label, r in out.items():
        if "ms_per_read" in r:
            r["time_vs_bf16_dense"] = r["ms_per_read"] / base
            r["time_vs_fp32"] = r["ms_per_read"] / fp32
    ours = [r["transient_bytes"] for k, r in out.items() if k.startswith("streamkv ") and "dense" not in k
            and "fp32" not in k and "transient_bytes" in r]
    hf = [r["transient_bytes"] for k, r in out.items() if k.startswith("transformers") and "transient_bytes" in r]
    return {"tokens": tokens, "queries": chunk, "block": block, "residual": residual, "rows": out,
            "transient_ratio_transformers_over_streamkv": (min(hf) / max(ours)) if hf and ours else None,
            "scores_bytes_per_block": 9 * chunk * block * 4}


def _kb(x: float) -> str:
    return f"{x / 1024:.0f} KiB" if x < 2**20 else f"{x / 2**20:.1f} MiB"


def describe(res: dict[str, Any]) -> list[str]:
    lines = [f"one read at {res['tokens']} tokens, {res['queries']} queries (block {res['block']}):"]
    for label, r in res["rows"].items():
        if "error" in r:
            lines.append(f"  {label:34s} not run: {r['error']}")
            continue
        lines.append(f"  {label:34s} transient {_kb(r['transient_bytes']):>10}  {r['ms_per_read']:7.2f} ms "
                     f"({r['time_vs_bf16_dense']:.2f}x bf16 dense, {r['time_vs_fp32']:.2f}x fp32)")
    if res["transient_ratio_transformers_over_streamkv"]:
        lines.append(f"  transformers' smallest transient / streamkv's largest: "
                     f"{res['transient_ratio_transformers_over_streamkv']:.1f}x")
    return lines


if __name__ == "__main__":  # pragma: no cover - a quick look
    print("\n".join(describe(read_costs(tokens=1024, repeats=3))))
