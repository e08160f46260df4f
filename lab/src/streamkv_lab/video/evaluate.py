"""``streamkv video-eval``: cache policies judged on the trained toy's video memory.

For each held-out clip (stream ``data_seed`` of :mod:`.data`, disjoint from training) the
ground truth's first :data:`~.toy.CONTEXT_FRAMES` frames are committed and the rest is
generated through (see :mod:`.runs`):

- the **full-history** cache (nothing evicted): the reference, with the model's attention
  profile (:class:`~.attention_stats.AttentionProfile`) and the per-query oracle
  (:class:`~streamkv.budget.PerQueryMass` on the whole history, through the lab's
  :class:`~streamkv_lab.budget.recorder.Recorder`);
- every streaming kind at every capacity (matched memory), each with a ``Recorder`` (the
  full-history attention mass its resident set held, on its own stream);
- the chronological path at the first capacity (its frames must equal the ring's);
- with ``position_clips``: the ring at the toy's own memory, raw keys rotated at read by every
  position map, ``position_factor`` times the training window long (:mod:`.positions`): error
  per frame against the ground truth and the full-history stream (``position_maps``).

Per (kind, capacity): the error of each streamed frame against the full-history stream and
against the ground truth (mean absolute RGB error in ``[0, 1]``), and the task metrics of
:mod:`.metrics` split at the training horizon (tracking; re-entry colour / shape / position;
revisit background error and consistency, also split by whether the gap exceeds the
cache's capacity). Everything is reported as measured; no clip is selected by its result.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict

import numpy as np
import torch

from streamkv_lab.budget.recorder import Recorder
from streamkv.models import CausalVideoDiT

from . import data, metrics
from .attention_stats import AttentionProfile, profile_json
from .config import CONTEXT_FRAMES, EvalConfig
from .runs import cache_run_spec, run_stream

__all__ = ["EvalConfig", "evaluate"]


def _rate(rows: list[dict], key: str) -> float | None:
    return float(np.mean([r[key] for r in rows])) if rows else None


def _track_sum(parts: list[dict]) -> dict:
    n = sum(p["n"] for p in parts)
    tracked = sum(p["tracked"] for p in parts)
    found = sum(p["found"] for p in parts)
    return {"n": n, "found": found, "tracked": tracked, "tracked_rate": tracked / n if n else None}


class _Acc:
    """Raw per-clip measurements of one stream label, aggregated at the end."""

    def __init__(self) -> None:
        self.err_full: list[np.ndarray] = []
        self.err_gt: list[np.ndarray] = []
        self.track_in: list[dict] = []
        self.track_out: list[dict] = []
        self.reentry: list[dict] = []
        self.revisit: list[dict] = []
        self.resident: list[float] = []
        self.overflow = 0

    def add(self, gen: np.ndarray, rgb: np.ndarray, full: np.ndarray, truth: data.Truth, cfg: EvalConfig) -> None:
        self.err_full.append(np.abs(gen - full).mean((1, 2, 3)))
        self.err_gt.append(np.abs(gen - rgb).mean((1, 2, 3)))
        self.track_in.append(metrics.tracking(gen, truth, range(CONTEXT_FRAMES, min(cfg.horizon, cfg.frames))))
        self.track_out.append(metrics.tracking(gen, truth, range(cfg.horizon, cfg.frames)))
        ev = metrics.reentry_events(truth, min_gap=cfg.min_reentry_gap, start=CONTEXT_FRAMES)
        self.reentry += metrics.reentry_scores(gen, truth, ev)
        rv = metrics.revisit_events(truth, min_gap=cfg.min_revisit_gap, start=CONTEXT_FRAMES)
        self.revisit += metrics.revisit_scores(gen, truth, rv)

    def add_records(self, rec: Recorder, first_chunk: int) -> None:
        rows = [r for r in rec.records if r.chunk >= first_chunk]
        self.resident.append(float(torch.stack([r.mass_resident.mean() for r in rows]).mean()))
        self.overflow += int(sum(int(r.overflow.sum()) for r in rows))

    def summary(self, cfg: EvalConfig, capacity: int | None) -> dict:
        ef, eg = np.mean(self.err_full, 0), np.mean(self.err_gt, 0)
        gen_in = slice(CONTEXT_FRAMES, min(cfg.horizon, cfg.frames))
        gen_out = slice(cfg.horizon, cfg.frames)
        re_in = [r for r in self.reentry if r["t_back"] < cfg.horizon]
        out = {
            "err_vs_full_per_frame": ef.tolist(), "err_vs_gt_per_frame": eg.tolist(),
            "err_vs_full_horizon": float(ef[gen_in].mean()), "err_vs_full_beyond": float(ef[gen_out].mean()),
            "err_vs_gt_horizon": float(eg[gen_in].mean()), "err_vs_gt_beyond": float(eg[gen_out].mean()),
            "tracking_horizon": _track_sum(self.track_in), "tracking_beyond": _track_sum(self.track_out),
            "reentry": {"n": len(self.reentry), **{k: _rate(self.reentry, k)
                                                    for k in ("colour_ok", "shape_ok", "position_ok")}},
            "reentry_horizon": {"n": len(re_in), **{k: _rate(re_in, k) for k in ("colour_ok", "shape_ok", "position_ok")}},
            "revisit": {"n": len(self.revisit), "ok": _rate(self.revisit, "ok"), "bg_err": _rate(self.revisit, "bg_err"),
                        "consistency": _rate(self.revisit, "consistency")},
        }
        if capacity is not None:
            far = [r for r in self.revisit if r["gap"] > capacity]
            out["revisit_gap_over_capacity"] = {"n": len(far), "ok": _rate(far, "ok"), "bg_err": _rate(far, "bg_err"),
                                                "consistency": _rate(far, "consistency")}
        if self.resident:
            out["full_history_mass_resident"] = float(np.mean(self.resident))
            out["overflow_head_commits"] = self.overflow
        return out


def _oracle_summary(rec: Recorder, first_chunk: int, capacities: tuple[int, ...], tokens_per_frame: int) -> dict:
    rows = [r for r in rec.records if r.chunk >= first_chunk]
    out = {}
    for tau in rec.oracle_taus:
        counts = torch.cat([r.oracle[tau]["count"].flatten() for r in rows]).double()
        err = torch.cat([r.oracle[tau]["err"].flatten() for r in rows])
        out[str(tau)] = {
            "tokens_mean": float(counts.mean()), "tokens_p95": float(counts.quantile(0.95)),
            "tokens_max": float(counts.max()), "err_mean": float(err.mean()),
            "fits_capacity": {str(c): float((counts <= c * tokens_per_frame).double().mean()) for c in capacities},
        }
    return out


def evaluate(model: CausalVideoDiT, cfg: EvalConfig, progress: Callable[[str], None] | None = None) -> dict:
    """Run the evaluation (see the module docstring); returns the JSON-ready result."""
    t0 = time.perf_counter()
    tpf, fpc = model.cfg.tokens_per_frame, model.cfg.frames_per_chunk
    first = CONTEXT_FRAMES // fpc
    specs = [cache_run_spec(k, c, tau=cfg.tau) for c in cfg.capacities for k in cfg.run_kinds()]
    chrono = cache_run_spec("chronological", cfg.capacities[0])
    full_spec = cache_run_spec("full", 0, total_frames=cfg.frames)
    accs = {s.label: _Acc() for s in [full_spec, *specs]}
    profile: dict | None = None
    oracle_rows: list[dict] = []
    chrono_diff = 0.0
    sink_tokens = full_spec.sink_frames * tpf
    for i in range(cfg.clips):
        _, truth, rgb = data.make_clip(cfg.data_seed, i, cfg.frames)
        ctx = data.to_latents(rgb)[None][:, :, :CONTEXT_FRAMES]
        kw = dict(seed=cfg.noise_seed + i)
        prof_kw = dict(sink_tokens=sink_tokens, recent_tokens=model.cfg.window_tokens, chunks=range(first, 10**9))
        full_lat, _, (rec, prof) = run_stream(model, full_spec, ctx, cfg.frames, observers=(Recorder, AttentionProfile),
                                              observer_kwargs=({"oracle_taus": cfg.oracle_taus}, prof_kw), **kw)
        full = data.to_rgb(full_lat[0])
        accs["full"].add(full, rgb, full, truth, cfg)
        accs["full"].add_records(rec, first)
        oracle_rows.append(_oracle_summary(rec, first, cfg.capacities, tpf))
        profile = _merge_profile(profile, prof)
        for spec in specs:
            if progress is not None:
                progress(f"clip {i + 1}/{cfg.clips} {spec.label}")
            lat, _, (rec,) = run_stream(model, spec, ctx, cfg.frames, observers=(Recorder,), observer_kwargs=({},), **kw)
            accs[spec.label].add(data.to_rgb(lat[0]), rgb, full, truth, cfg)
            accs[spec.label].add_records(rec, first)
            if spec.kind == "ring" and spec.capacity_frames == chrono.capacity_frames:
                c_lat, _, _ = run_stream(model, chrono, ctx, cfg.frames, **kw)
                chrono_diff = max(chrono_diff, float((c_lat - lat).abs().max()))
    positions = None
    if cfg.position_clips:  # every position map, position_factor x the training window (lab/video/positions.py)
        from .positions import long_stream

        positions = long_stream(model, horizon=cfg.horizon, factor=cfg.position_factor, clips=cfg.position_clips,
                                data_seed=cfg.data_seed, noise_seed=cfg.noise_seed,
                                progress=None if progress is None else (lambda w: progress(f"position maps {w}")))
    caches: dict[str, dict] = {}
    for s in specs:
        caches.setdefault(s.kind, {})[str(s.capacity_frames)] = accs[s.label].summary(cfg, s.capacity_frames)
    return {
        "config": {**asdict(cfg), "context_frames": CONTEXT_FRAMES, "tokens_per_frame": tpf,
                   "frames_per_chunk": fpc, "sink_frames": full_spec.sink_frames},
        "tolerances": {"track_px": metrics.TRACK_TOL, "present_mse": metrics.PRESENT_MSE,
                       "reentry_search_px": metrics.REENTRY_SEARCH, "revisit_bg_err": metrics.REVISIT_TOL},
        "reference_full_history": accs["full"].summary(cfg, None),
        "ground_truth_context_only": "frames [0, context_frames) are the ground truth in every stream",
        "caches": caches,
        "chronological_vs_ring_max_abs_diff": {"capacity_frames": chrono.capacity_frames, "value": chrono_diff},
        "attention_full_history": _profile_json(profile),
        "oracle_per_query_mass": _merge_oracle(oracle_rows),
        **({"position_maps": positions} if positions is not None else {}),
        "wall_s": time.perf_counter() - t0,
    }


def _merge_profile(acc: dict | None, prof: AttentionProfile) -> dict:
    acc = acc if acc is not None else {"sums": {}, "counts": {}}
    for k, v in prof.sums.items():
        acc["sums"][k] = acc["sums"].get(k, 0) + v
        acc["counts"][k] = acc["counts"].get(k, 0) + prof.counts[k]
    return acc


def _profile_json(acc: dict | None) -> dict:
    return {} if acc is None else profile_json(acc["sums"], acc["counts"])


def _merge_oracle(rows: list[dict]) -> dict:
    out = {}
    for tau in rows[0]:
        keys = ("tokens_mean", "tokens_p95", "tokens_max", "err_mean")
        out[tau] = {k: float(np.mean([r[tau][k] for r in rows])) for k in keys}
        out[tau]["fits_capacity"] = {c: float(np.mean([r[tau]["fits_capacity"][c] for r in rows]))
                                     for c in rows[0][tau]["fits_capacity"]}
    return out
