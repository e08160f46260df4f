"""The kvbudget seed's experiments, reproduced on our synthetic video attention.

All errors are L-infinity over the value channels (``||o_K - o||_inf``) against full
attention over the same cached past; cache sizes are kept tokens, averaged over every
query of the rollout (frames 1 .. F-1). See :mod:`streamkv_lab.experiments.synthetic` for
the generator and the evaluator. The mass-budget policy here is the per-query
*oracle* (it chooses with the query's own attention); a streaming cache that must
evict before seeing later queries is a separate experiment.

1. **tau sweep** — :class:`~streamkv.budget.oracles.PerQueryMass` at each tau: mean
   cache, max error, the bound ``tau * Vmax`` (``Vmax``: the largest L-infinity value
   range, max over channels of max - min, of any query's cached values), and whether
   every query is within *its own* bound ``tau * range`` in both forms (L-infinity
   with the channel range, L2 with the diameter) with kept mass ``>= 1 - tau``.
2. **Pareto** — mean error vs mean cache for fixed windows (``sinks=0``, a plain
   window, as in the seed) and mass budgets over a range of tau. The window/mass
   ratio at matched cache interpolates the window curve at the mass curve's cache
   sizes, **linearly in cache and in log(error)**, only inside the window curve's
   cache range (no extrapolation); median and min over those points.
3. **sink sweep** — for each ``sink_boost``, a window whose mean cache is closest to
   ``matched_cache`` and the mass budget whose tau (by bisection in log tau) gives the
   largest mean cache not above the window's: mean and max error of both.
4. **tail** — the same matched pair on the default generator: max errors and ratio.
   A control pair with no sinks and no noise (``sink_control``) shows the
   mechanism: the heavy hitters are then the recent tokens and the policies converge.
5. **falsifiers** — see :func:`falsifiers`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from streamkv.budget.mass import check_tau
from streamkv.budget.oracles import FixedWindow, PerQueryMass
from streamkv_lab.env import threads
from streamkv_lab.plotting import pyplot, save
from streamkv_lab.experiments.synthetic import GeneratorConfig, RolloutResult, SyntheticStream, evaluate, synthesize

__all__ = [
    "ParetoConfig",
    "sink_mass_share",
    "tau_sweep",
    "pareto_curves",
    "matched_pair",
    "sink_sweep",
    "falsifiers",
    "run_pareto",
    "plot_pareto",
    "plot_sinks",
]


@dataclass(frozen=True)
class ParetoConfig:
    """What the experiments sweep (recorded with the result)."""

    taus: tuple[float, ...] = (0.1, 0.05, 0.02, 0.01)
    curve_taus: tuple[float, ...] = (0.3, 0.2, 0.15, 0.1, 0.07, 0.05, 0.03, 0.02, 0.01)
    windows: tuple[int, ...] = (8, 16, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256)
    sink_boosts: tuple[float, ...] = (0.0, 4.0, 8.0)
    matched_cache: float = 48.0

    def __post_init__(self) -> None:
        for t in self.taus + self.curve_taus:
            check_tau(t)
        for w in self.windows:
            if isinstance(w, bool) or not isinstance(w, int) or w < 1:
                raise ValueError(f"windows must be positive ints, got {w!r}")
        if len(self.windows) < 2:
            raise ValueError(f"windows needs at least 2 sizes for a curve, got {self.windows}")
        for b in self.sink_boosts:
            if not (isinstance(b, (int, float)) and math.isfinite(b) and b >= 0):
                raise ValueError(f"sink_boosts must be finite and >= 0, got {b!r}")
        if not (isinstance(self.matched_cache, (int, float)) and self.matched_cache >= 1):
            raise ValueError(f"matched_cache must be >= 1 token, got {self.matched_cache!r}")

    def as_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def sink_mass_share(stream: SyntheticStream) -> dict[str, float]:
    """Attention mass on sink tokens, over the queries of frames 1..F-1: mean and over
    the last frame's queries (the late-stream share, all keyframes in the past)."""
    t = stream.config.tokens_per_frame
    shares = []
    for f in range(1, stream.config.frames):
        p = stream.attention(f)
        shares.append((p * stream.sinks[: f * t]).sum(-1))
    return {"mean": float(torch.cat(shares).mean()), "last_frame": float(shares[-1].mean())}


def tau_sweep(stream: SyntheticStream, taus: tuple[float, ...]) -> tuple[list[dict[str, Any]], list[RolloutResult]]:
    """Experiment 1: one :class:`PerQueryMass` rollout per tau."""
    rows, results = [], []
    for tau in taus:
        r = evaluate(stream, PerQueryMass(tau))
        results.append(r)
        rows.append({
            "tau": tau,
            "mean_cache": r.mean_cache,
            "max_error": r.max_error,
            "bound": tau * r.vmax,
            "within_bound": r.within_bound(),
            "mean_error": r.mean_error,
            "min_kept_mass": r.min_kept_mass,
            "max_error_l2": float(r.err_l2.max()),
            "bound_l2": tau * float(r.diam.max()),
        })
    return rows, results


def _interp_log(x: float, xs: list[float], ys: list[float]) -> float:
    """Linear in x, linear in log(y); xs ascending, ys > 0, xs[0] <= x <= xs[-1]."""
    for i in range(len(xs) - 1):
        if xs[i] <= x <= xs[i + 1]:
            if xs[i + 1] == xs[i]:
                return ys[i]
            a = (x - xs[i]) / (xs[i + 1] - xs[i])
            return math.exp((1 - a) * math.log(ys[i]) + a * math.log(ys[i + 1]))
    raise ValueError(f"{x} outside [{xs[0]}, {xs[-1]}]")


def pareto_curves(stream: SyntheticStream, windows: tuple[int, ...], taus: tuple[float, ...]) -> tuple[dict[str, Any], list[RolloutResult]]:
    """Experiment 2: window and mass curves (mean cache, mean error) and the ratio."""
    win = [evaluate(stream, FixedWindow(w)) for w in windows]
    mass = [evaluate(stream, PerQueryMass(t)) for t in taus]
    wpts = sorted((r.mean_cache, r.mean_error) for r in win if r.mean_error > 0)
    mpts = sorted((r.mean_cache, r.mean_error) for r in mass)
    xs, ys = [c for c, _ in wpts], [e for _, e in wpts]
    ratios = []
    for c, e in mpts:
        if len(xs) >= 2 and xs[0] <= c <= xs[-1] and e > 0:
            ratios.append({"cache": c, "window_err": _interp_log(c, xs, ys), "mass_err": e})
            ratios[-1]["ratio"] = ratios[-1]["window_err"] / e
    rs = [r["ratio"] for r in ratios]
    out = {
        "window": [[r.mean_cache, r.mean_error] for r in win],
        "mass": [[r.mean_cache, r.mean_error] for r in mass],
        "ratio_median": statistics.median(rs) if rs else math.nan,
        "ratio_min": min(rs) if rs else math.nan,
        "mass_better_everywhere": bool(rs) and min(rs) > 1.0,
        "error_metric": "mean over queries of the L-infinity error",
        "interpolation": "window curve interpolated at the mass curve's cache sizes, linear in cache and in log(error); mass points outside the window curve's cache range are not compared",
        "window_sizes": list(windows),
        "mass_taus": list(taus),
        "window_max": [[r.mean_cache, r.max_error] for r in win],
        "mass_max": [[r.mean_cache, r.max_error] for r in mass],
        "ratios": ratios,
    }
    return out, win + mass


def _closest_window(stream: SyntheticStream, target: float) -> RolloutResult:
    """The fixed window whose mean cache is closest to ``target`` (ties: the smaller)."""
    t = stream.config.tokens_per_frame
    frames = torch.arange(1, stream.config.frames, dtype=torch.float64)
    best_w, best_d = 1, math.inf
    for w in range(1, stream.config.tokens):
        mean_cache = float(torch.clamp(frames * t, max=w).mean())  # the window's cache is min(W, N)
        if abs(mean_cache - target) < best_d:
            best_w, best_d = w, abs(mean_cache - target)
    return evaluate(stream, FixedWindow(best_w))


def _mass_at_most(stream: SyntheticStream, cache: float, iters: int = 48) -> RolloutResult:
    """The mass budget with the largest mean cache ``<= cache`` (bisection in log tau).

    Mean cache is non-increasing in tau (a larger mass target never needs fewer
    tokens), so bisection finds the smallest tau in ``[1e-12, 0.999]`` whose mean
    cache fits.
    """
    lo, hi = math.log(1e-12), math.log(0.999)   # cache(lo) large, cache(hi) small
    best = evaluate(stream, PerQueryMass(math.exp(hi)))
    if best.mean_cache > cache:
        return best
    low = evaluate(stream, PerQueryMass(math.exp(lo)))
    if low.mean_cache <= cache:
        return low
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        r = evaluate(stream, PerQueryMass(math.exp(mid)))
        if r.mean_cache <= cache:
            hi, best = mid, r
        else:
            lo = mid
    return best


def matched_pair(stream: SyntheticStream, target: float) -> tuple[RolloutResult, RolloutResult]:
    """(window, mass) at matched mean cache: the window closest to ``target`` and the
    mass budget with the largest mean cache not above the window's."""
    w = _closest_window(stream, target)
    return w, _mass_at_most(stream, w.mean_cache)


def _pair_row(w: RolloutResult, m: RolloutResult) -> dict[str, Any]:
    return {
        "window_mean": w.mean_error,
        "window_max": w.max_error,
        "mass_mean": m.mean_error,
        "mass_max": m.max_error,
        "window_cache": w.mean_cache,
        "mass_cache": m.mean_cache,
        "window": w.policy,
        "mass_tau": m.tau,
        "mass_within_bound": m.within_bound(),
        "mean_ratio": w.mean_error / m.mean_error if m.mean_error > 0 else math.inf,
        "max_ratio": w.max_error / m.max_error if m.max_error > 0 else math.inf,
    }


def sink_sweep(gen: GeneratorConfig, seed: int, boosts: tuple[float, ...], target: float) -> tuple[list[dict[str, Any]], list[RolloutResult]]:
    """Experiment 3: the matched pair for each sink strength (same seed, same other
    parameters, so the noise and values are identical across rows)."""
    rows, results = [], []
    for b in boosts:
        s = synthesize(gen.with_(sink_boost=float(b)), seed)
        w, m = matched_pair(s, target)
        results += [w, m]
        rows.append({"sink_boost": float(b), **_pair_row(w, m)})
    return rows, results


def falsifiers(result: dict[str, Any], mass_runs: list[RolloutResult]) -> list[dict[str, Any]]:
    """The five ways the claims could fail; each entry has ``falsified`` (bool).

    1. bound: a mass-budget query's error exceeds tau times its value range
       (L-infinity form or L2 form);
    2. mass: a mass-budget query keeps mass below 1 - tau;
    3. pareto: with sinks present, a fixed window matches or beats mass at some
       matched cache size (Pareto ratio_min <= 1 on the default generator, or a sink
       sweep row with sink_boost > 0 where the window's mean or max error is <= mass's);
    4. mechanism: the matched-cache win (window/mass mean error) does not grow
       strictly with sink strength;
    5. convergence: without sinks the win does not shrink — the sink_boost 0 ratio
       is not below half the ratio at the smallest positive sink_boost — or, with
       sinks *and* noise removed (the heavy hitters are then exactly the recent
       tokens), the two policies do not converge: the control's mean-error ratio
       lies outside [0.8, 1.25]. Needs ``result["sink_control"]`` (skipped if absent).
    """
    bad_bound = [r.policy for r in mass_runs if not (
        (r.err_inf <= r.tau * r.vrange).all() and (r.err_l2 <= r.tau * r.diam).all())]
    bad_mass = [r.policy for r in mass_runs if not (r.kept_mass >= 1.0 - r.tau).all()]
    rows = result["sink_sweep"]
    pareto = result["pareto"]
    beaten = [r["sink_boost"] for r in rows if r["sink_boost"] > 0 and (
        r["window_mean"] <= r["mass_mean"] or r["window_max"] <= r["mass_max"])]
    sinks_present = result["generator"]["sink_boost"] > 0 and result["generator"]["sink_tokens"] > 0
    pareto_beaten = sinks_present and not pareto["mass_better_everywhere"]
    ratios = [(r["sink_boost"], r["mean_ratio"]) for r in sorted(rows, key=lambda r: r["sink_boost"])]
    grows = all(b[1] > a[1] for a, b in zip(ratios, ratios[1:]))
    zero = [q for b, q in ratios if b == 0]
    positive = [q for b, q in ratios if b > 0]
    shrinks = bool(zero and positive) and zero[0] < 0.5 * positive[0]
    control = result.get("sink_control")
    converges = control is None or 0.8 <= control["mean_ratio"] <= 1.25
    conv_detail = (f"boost 0: {zero[0]:.3g}x vs boost {ratios[1][0]:g}: {positive[0]:.3g}x"
                   if zero and positive else "sweep lacks boost 0 or a positive boost")
    if control is not None:
        conv_detail += f"; no sinks and no noise: {control['mean_ratio']:.3g}x"
    return [
        {"name": "bound", "claim": "every mass-budget query: error <= tau * range (L-inf and L2 forms)",
         "falsified": bool(bad_bound), "detail": f"{len(mass_runs)} mass rollouts checked; violating: {bad_bound or 'none'}"},
        {"name": "mass", "claim": "every mass-budget query keeps mass >= 1 - tau",
         "falsified": bool(bad_mass), "detail": f"{len(mass_runs)} mass rollouts checked; violating: {bad_mass or 'none'}"},
        {"name": "pareto", "claim": "with sinks, mass beats the window at every matched cache size",
         "falsified": pareto_beaten or bool(beaten),
         "detail": f"Pareto ratio_min {pareto['ratio_min']:.3g}; sink-sweep rows (boost > 0) where the window matches or wins: {beaten or 'none'}"},
        {"name": "mechanism", "claim": "the win grows with sink strength",
         "falsified": not grows, "detail": "window/mass mean-error ratio by sink_boost: " + ", ".join(f"{b:g}: {q:.3g}x" for b, q in ratios)},
        {"name": "convergence",
         "claim": "without sinks the win shrinks (boost-0 ratio < half the next); without sinks and noise the policies converge (ratio in [0.8, 1.25])",
         "falsified": not (shrinks and converges), "detail": conv_detail},
    ]


def run_pareto(gen: GeneratorConfig | None = None, config: ParetoConfig | None = None, seed: int = 0) -> tuple[dict[str, Any], list[RolloutResult]]:
    """All five experiments. Returns the JSON-ready result and the mass rollouts the
    falsifiers checked (for callers that want the per-query records)."""
    gen = GeneratorConfig() if gen is None else gen
    config = ParetoConfig() if config is None else config
    with threads(1):
        stream = synthesize(gen, seed)
        sweep, sweep_runs = tau_sweep(stream, config.taus)
        pareto, curve_runs = pareto_curves(stream, config.windows, config.curve_taus)
        sinks, sink_runs = sink_sweep(gen, seed, config.sink_boosts, config.matched_cache)
        control_gen = gen.with_(sink_boost=0.0, noise=0.0)
        cw, cm = matched_pair(synthesize(control_gen, seed), config.matched_cache)
        w, m = matched_pair(stream, config.matched_cache)
        tail = {"window_max": w.max_error, "mass_max": m.max_error,
                "ratio": w.max_error / m.max_error if m.max_error > 0 else math.inf,
                "window_cache": w.mean_cache, "mass_cache": m.mean_cache, "window": w.policy, "mass_tau": m.tau}
        share = sink_mass_share(stream)
    result: dict[str, Any] = {
        "tau_sweep": sweep,
        "pareto": pareto,
        "sink_sweep": sinks,
        "tail": tail,
        "sink_control": {"sink_boost": 0.0, "noise": 0.0, **_pair_row(cw, cm)},
        "generator": {**gen.as_dict(), "seed": seed},
        "experiment": {**config.as_dict(), "error": "L-infinity over value channels, vs full attention over the same cached past",
                       "cache": "kept tokens, mean over all queries of frames 1..F-1",
                       "sink_mass_share": share,
                       "vmax": max(r.vmax for r in sweep_runs)},
    }
    mass_runs = [r for r in sweep_runs + curve_runs + sink_runs + [cm, m] if r.tau is not None]
    result["falsifiers"] = falsifiers(result, mass_runs)
    return result, mass_runs


def plot_pareto(result: dict[str, Any], path: str | Path) -> None:
    """Error vs mean cache, both policies, log error axis (mean solid, max dashed)."""
    plt = pyplot()
    p = result["pareto"]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for key, label, color in (("window", "fixed window", "tab:red"), ("mass", "mass budget (oracle)", "tab:blue")):
        pts = [(c, e) for c, e in p[key] if e > 0]
        mx = [(c, e) for c, e in p[f"{key}_max"] if e > 0]
        ax.plot([c for c, _ in pts], [e for _, e in pts], "o-", color=color, label=f"{label}: mean error")
        ax.plot([c for c, _ in mx], [e for _, e in mx], "x--", color=color, alpha=0.6, label=f"{label}: max error")
    ax.set_yscale("log")
    ax.set_xlabel("mean cache size (tokens kept)")
    ax.set_ylabel("L-inf output error vs full attention")
    g = result["generator"]
    ax.set_title(f"error vs memory (sink_boost={g['sink_boost']:g}, recency={g['recency_decay']:g}, seed={g['seed']})\n"
                 f"median window/mass {p['ratio_median']:.1f}x, min {p['ratio_min']:.1f}x", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, path, dpi=120)


def plot_sinks(result: dict[str, Any], path: str | Path) -> None:
    """Matched-cache mean and max error of both policies vs sink strength (log scale)."""
    plt = pyplot()
    rows = result["sink_sweep"]
    b = [r["sink_boost"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.plot(b, [r["window_mean"] for r in rows], "o-", color="tab:red", label="fixed window: mean")
    ax.plot(b, [r["window_max"] for r in rows], "x--", color="tab:red", alpha=0.6, label="fixed window: max")
    ax.plot(b, [r["mass_mean"] for r in rows], "o-", color="tab:blue", label="mass budget: mean")
    ax.plot(b, [r["mass_max"] for r in rows], "x--", color="tab:blue", alpha=0.6, label="mass budget: max")
    ax.set_yscale("log")
    ax.set_xlabel("sink_boost")
    ax.set_ylabel("L-inf output error vs full attention")
    ax.set_title(f"the win tracks sink strength (matched cache ~{result['experiment']['matched_cache']:g} tokens)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, path, dpi=120)
