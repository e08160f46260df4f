"""``streamkv chart``, its error half: each row's attention error against float64 full history,
on a trained model's own attention inputs (as ``streamkv certify --real`` replays them).

Streams (:class:`~streamkv_lab.experiments.twotier.Stream`), one per family of the timed shapes:

``video``       the trained toy video model's own Q/K/V (:func:`~streamkv_lab.video.qkv.toy_stream`:
                its committed pass of every chunk, 3D RoPE applied, every query seeing its chunk),
                a chunk (2 frames of 16 tokens) per span; sinks: the model's 2 frames
``lm-prefill``  SmolLM2-135M's on the first ``tokens`` tokens of Moby-Dick (``layers`` of its 30),
                prefill spans of ``lm_chunk`` tokens, position-causal; 4 sink tokens
``lm-decode``   the same inputs a token per span (decoding)

Each row (:mod:`streamkv_lab.bench.chart_rows`) is built at the stream's geometry (its full
cache holds every token of the stream: nothing evicted) at the same budget as where it is timed
(the same fraction of the tokens, or of the bytes), in bfloat16 (the queries, keys and values
rounded to it, as the timed caches are), and the stream replayed through it span by span
(``update(k, v, q)``, ``attend``); every layer's output is compared with float64 attention over
the whole history of the same inputs (the per-layer error given the layer's true inputs, as
``certify --real`` measures it). ``tier+certificates`` holds what ``tier`` holds (no recall), but
its reads are answered from the certificate (the float32 attention it bounds, rounded once) and
its policy's statistics come from the certificate's weights, so it is replayed and measured itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from streamkv.attention import attend
from streamkv_lab.bench.chart_rows import Geometry, Row, build_row_cache, held_bytes

__all__ = ["STREAMS", "stream_key", "load_stream", "stream_errors"]

STREAMS = {
    "video": "the trained toy video model's own Q/K/V, a 2-frame chunk per span",
    "lm-prefill": "SmolLM2-135M's Q/K/V on Moby-Dick, prefill spans",
    "lm-decode": "SmolLM2-135M's Q/K/V on Moby-Dick, one token per span",
}
#: sinks of the streams: the toy model's (frames, in tokens at load) and an LLM's 4 attention sinks
LM_SINK = 4


def stream_key(shape: Any) -> str:
    """The stream whose errors the rows of ``shape`` report."""
    if shape.family == "video":
        return "video"
    return "lm-decode" if shape.span == 1 else "lm-prefill"


def load_stream(key: str, *, frames: int = 48, lm_tokens: int = 512, lm_layers: Sequence[int] = (2, 10, 20, 28),
                lm_chunk: int = 16) -> tuple[Any, int, int]:
    """``(stream, sink, tokens_per_frame)`` of stream ``key``."""
    if key == "video":
        from streamkv_lab.video.qkv import toy_stream
        from streamkv.models import get_config

        cfg = get_config("toy")
        return toy_stream(frames=frames), cfg.sink_frames * cfg.tokens_per_frame, cfg.tokens_per_frame
    from streamkv_lab.experiments.twotier import smollm2_stream

    stream = smollm2_stream(tokens=lm_tokens, chunk=lm_chunk, layers=list(lm_layers))
    if key == "lm-decode":
        stream = dataclasses.replace(stream, chunk=1, info={**stream.info, "chunk": 1})
    return stream, LM_SINK, 1


def _replay(stream: Any, cache: Any) -> list[torch.Tensor]:
    """Every layer's attention output (float64, ``[B, T, Hq, Dv]``) through ``cache``, span by span."""
    C, T, dt = stream.chunk, stream.tokens, cache.dtype
    outs = [torch.empty(*q.shape[:-1], stream.v[0].shape[-1], dtype=torch.float64) for q in stream.q]
    for c in range(T // C):
        sl = slice(c * C, (c + 1) * C)
        cache.begin_tokens(C)
        for layer in range(stream.layers):
            q, k, v = (x[layer][:, sl].to(dt) for x in (stream.q, stream.k, stream.v))
            out, _ = attend(q, cache.layer(layer).update(k, v, q), causal=stream.causal, scale=stream.scale)
            outs[layer][:, sl] = out.double()
        cache.commit()
    return outs


@torch.no_grad()
def stream_errors(stream: Any, rows: Sequence[Row], *, sink: int, unit: int,
                  progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Each row's error on ``stream`` (module docstring): ``{"rows": {key: record}, ...}``; a record
    holds :func:`~streamkv_lab.experiments.twotier._summary`'s errors, the tokens and bytes held and
    their ratio to the full cache's, or ``not_run`` (the library's refusal at this geometry)."""
    from streamkv_lab.experiments.twotier import _errors, _full_attention, _summary

    say = progress or (lambda msg: None)
    say("chart errors: float64 full history")
    fulls, vranges = zip(*(_full_attention(stream, layer) for layer in range(stream.layers)))
    B, T, H, D = stream.k[0].shape
    geo = Geometry(full=T // unit * unit, sink=sink, span=stream.chunk, unit=unit, heads=H, head_dim=D,
                   layers=stream.layers)
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        rec: dict[str, Any] = {**row.to_dict()}
        out[row.key] = rec
        say(f"chart errors: {row.key}")
        try:
            cache, tier, caps = build_row_cache(row, geo, causal=stream.causal, scale=stream.scale)
        except (ValueError, TypeError) as exc:
            rec["not_run"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            continue
        outs = _replay(stream, cache)
        errs, rels = zip(*(_errors(outs[i], fulls[i], vranges[i]) for i in range(stream.layers)))
        got = {**_summary(list(errs), list(rels)), **held_bytes(cache, tier), "capacities": caps,
               "tokens": caps["capacity"] + caps.get("tier2", 0), "full_bytes": geo.full_bytes}
        got["bytes_ratio_to_full"] = got["bytes"] / geo.full_bytes
        rec.update(got)
    return {"stream": stream.info, "tokens": T, "span": stream.chunk, "sink": sink, "layers": stream.layers,
            "causal": stream.causal, "rows": out}
