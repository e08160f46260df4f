"""The demo's quality panel: what the caches do at a quarter of the full cache's memory, on a
trained model's own attention.

SmolLM2-135M-Instruct's queries, keys and values on real text (:func:`~.twotier.smollm2_stream`)
are replayed chunk by chunk through four caches, each output compared with float64 full-history
attention over the same inputs (:func:`~.tier.run_quarter`):

- ``full``: a cache holding the whole stream (the reference's memory, 1x);
- ``ring``: sinks + the most recent tokens, a quarter of the bytes;
- ``tova``: TOVA's scored eviction, the same bytes;
- ``compressed_tier``: TOVA's full-precision tier plus an int8 tier of evicted history, certified
  (each query's error bound is checked against the truth: ``violations``), the same bytes.

Why SmolLM2 and not the Self-Forcing layer: a quarter of a 21-frame window is 5.25 frames, fewer
than the two 3-frame chunks TOVA, H2O and SnapKV must hold (the newest and the next), so those
caches refuse that budget (:func:`self_forcing_quarter_note`). The trained toy video model was
tried too: at a quarter of 48 frames one run gave mean errors 0.075 (ring), 0.068 (TOVA) and 0.077
(the tier), no difference worth a panel, so it is not in the demo (``streamkv certify --real --datasets toy`` runs it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["QUALITY_TIER_ARGS", "QUALITY_CACHES", "quality_tier", "quarter_quality", "self_forcing_quarter_note"]

#: the compressed tier of the panel: 30% of the bytes full precision (TOVA), the rest int8, certified
QUALITY_TIER_ARGS = {"fmt": "int8", "fp_fraction": 0.3, "policy": "tova", "certify": True, "tau": None}
#: the panel's caches, in the order drawn
QUALITY_CACHES = ("full", "ring", "tova", "compressed_tier")


def quality_tier() -> Any:
    """:data:`QUALITY_TIER_ARGS` as a :class:`~.tier.TierConfig`."""
    from .tier import TierConfig

    return TierConfig(**QUALITY_TIER_ARGS)


def quarter_quality(stream: Any, *, sink: int = 4, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The four caches of the module docstring on ``stream`` (a :class:`~.twotier.Stream`):
    per cache its error against full history (``error_mean``, ``error_p99``: L-inf of each
    query's output; ``rel_error_mean``: over the head's value range), ``device_bytes`` and
    ``ms_per_chunk``; ``ratios``: the ring's and TOVA's mean error over the tier's."""
    from streamkv_lab.env import threads

    from .tier import run_quarter
    from .twotier import _full_attention, _probs

    say = progress or (lambda _msg: None)
    with threads(1):
        say("float64 full-history reference")
        fulls, vranges = zip(*(_full_attention(stream, layer) for layer in range(stream.layers)))
        probs = _probs(stream)
        r = run_quarter(stream, sink=sink, fulls=list(fulls), vranges=list(vranges), probs=probs,
                        configs=(quality_tier(),), say=say)
    raw = r["caches"]
    tier_key = next(k for k in raw if k.startswith("tier_"))
    keep = ("error_mean", "error_p99", "rel_error_mean", "device_bytes", "ms_per_chunk", "violations")
    caches: dict[str, Any] = {}
    for name, key in zip(QUALITY_CACHES, ("full", "ring", "tova", tier_key)):
        c = raw[key]
        caches[name] = {"skipped": c["skipped"]} if "skipped" in c else {k: c.get(k) for k in keep}
    caches["compressed_tier"]["config"] = dict(QUALITY_TIER_ARGS)
    tier = caches["compressed_tier"]
    ratios = {}
    if "error_mean" in tier:
        for other in ("ring", "tova"):
            if "error_mean" in caches[other]:
                ratios[f"{other}_over_tier_mean"] = caches[other]["error_mean"] / max(tier["error_mean"], 1e-30)
    return {"dataset": stream.info, "tokens": stream.tokens, "layers": stream.layers, "chunk": stream.chunk,
            "budget_bytes": r["budget_bytes"], "full_bytes": r["full_bytes"], "caches": caches, "ratios": ratios}


def self_forcing_quarter_note(preset: dict[str, Any]) -> str | None:
    """One line when a quarter of ``preset``'s window cannot hold the two chunks a scored cache
    needs (so TOVA, H2O and SnapKV refuse it there); ``None`` when it can."""
    quarter = preset["window_frames"] / 4
    need = 2 * preset["chunk_frames"] + preset.get("sink_frames", 0)
    if quarter >= need:
        return None
    return (f"why not at the Self-Forcing layer: a quarter of its {preset['window_frames']}-frame window is "
            f"{quarter:g} frames, fewer than the two {preset['chunk_frames']}-frame chunks TOVA/H2O/SnapKV hold, so they refuse it")
