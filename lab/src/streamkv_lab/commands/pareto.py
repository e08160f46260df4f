"""``streamkv pareto``: the mass-budget experiments (tau bound, Pareto vs the fixed window,
sink sweep, worst-case tail, falsifiers) on synthetic video attention."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    p.add_argument("--plot", metavar="PATH",
                   help="write the Pareto plot here (PNG) and the sink-sweep plot next to it as <stem>-sinks<suffix>")
    p.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")


def _f(x: float, digits: int = 4) -> str:
    return f"{x:.{digits}f}" if abs(x) >= 10 ** -digits or x == 0 else f"{x:.2e}"


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from streamkv_lab.experiments.pareto import plot_pareto, plot_sinks, run_pareto
    from streamkv_lab.experiments.synthetic import GeneratorConfig
    from streamkv_lab.commands._common import write_json
    from streamkv_lab.env import environment

    console = Console()
    if not console.is_terminal:  # logs and pipes: wide enough that the tables do not wrap
        console = Console(width=max(console.width, 132))
    with console.status("rollouts"):
        result, _ = run_pareto(GeneratorConfig(), seed=args.seed)
    exp = result["experiment"]

    t = Table(title="generator: video-structured causal attention (streamkv_lab.experiments.synthetic)")
    t.add_column("parameter")
    t.add_column("value", justify="right")
    for k, v in result["generator"].items():
        t.add_row(k, str(v))
    share = exp["sink_mass_share"]
    t.add_row("sink mass share (mean / last frame)", f"{share['mean']:.3f} / {share['last_frame']:.3f}")
    t.add_row("Vmax (L-inf value range)", f"{exp['vmax']:.4f}")
    console.print(t)
    console.print(f"error: {exp['error']}; cache: {exp['cache']}; mass budget = per-query oracle")

    t = Table(title="1. mass budget obeys the bound (error <= tau * range, every query)")
    for c in ("tau", "mean cache", "mean error", "max error", "tau*Vmax", "max L2 error", "tau*diam", "min kept mass", "within bound"):
        t.add_column(c, justify="right")
    for r in result["tau_sweep"]:
        t.add_row(f"{r['tau']:g}", f"{r['mean_cache']:.1f}", _f(r["mean_error"]), _f(r["max_error"]), _f(r["bound"]),
                  _f(r["max_error_l2"]), _f(r["bound_l2"]), f"{r['min_kept_mass']:.6f}", str(r["within_bound"]))
    console.print(t)

    p = result["pareto"]
    t = Table(title="2. Pareto: mean error vs mean cache")
    for c in ("policy", "mean cache", "mean error", "max error"):
        t.add_column(c, justify="right")
    for w, (c, e), (_, mx) in zip(p["window_sizes"], p["window"], p["window_max"]):
        t.add_row(f"window W={w}", f"{c:.1f}", _f(e), _f(mx))
    for tau, (c, e), (_, mx) in zip(p["mass_taus"], p["mass"], p["mass_max"]):
        t.add_row(f"mass tau={tau:g}", f"{c:.1f}", _f(e), _f(mx))
    console.print(t)
    t = Table(title="window/mass at matched cache (window curve interpolated, linear in cache and log error)")
    for c in ("cache", "window err (interp)", "mass err", "ratio"):
        t.add_column(c, justify="right")
    for r in p["ratios"]:
        t.add_row(f"{r['cache']:.1f}", _f(r["window_err"]), _f(r["mass_err"]), f"{r['ratio']:.1f}x")
    console.print(t)
    console.print(f"ratio median {p['ratio_median']:.2f}x, min {p['ratio_min']:.2f}x; "
                  f"mass better at every matched size: {p['mass_better_everywhere']}")

    t = Table(title=f"3. the win tracks sink strength (matched cache ~{exp['matched_cache']:g})")
    for c in ("sink_boost", "window", "cache", "mass tau", "cache", "window mean / max", "mass mean / max", "ratio mean / max"):
        t.add_column(c, justify="right", no_wrap=True)
    ctl = result["sink_control"]
    for r, label in [(r, f"{r['sink_boost']:g}") for r in result["sink_sweep"]] + [(ctl, "0 (noise 0)")]:
        t.add_row(label, r["window"], f"{r['window_cache']:.2f}", f"{r['mass_tau']:.3g}", f"{r['mass_cache']:.2f}",
                  f"{_f(r['window_mean'])} / {_f(r['window_max'])}", f"{_f(r['mass_mean'])} / {_f(r['mass_max'])}",
                  f"{r['mean_ratio']:.3g}x / {r['max_ratio']:.3g}x")
    console.print(t)

    tail = result["tail"]
    console.print(f"4. worst-case error at matched cache {tail['window_cache']:.1f} / {tail['mass_cache']:.1f}: "
                  f"window {tail['window_max']:.4f} vs mass {tail['mass_max']:.4f} ({tail['ratio']:.1f}x tail)")

    t = Table(title="5. falsifiers")
    for c in ("name", "claim", "falsified", "detail"):
        t.add_column(c)
    for f in result["falsifiers"]:
        t.add_row(f["name"], f["claim"], "[bold red]YES[/]" if f["falsified"] else "no", f["detail"])
    console.print(t)

    if args.plot:
        path = Path(args.plot)
        sinks = path.with_name(f"{path.stem}-sinks{path.suffix or '.png'}")
        plot_pareto(result, path)
        plot_sinks(result, sinks)
        result["plots"] = {"pareto": str(path), "sinks": str(sinks)}
        console.print(f"wrote {path} and {sinks}")
    result["versions"] = environment()
    write_json(args.json, result)
    if args.json:
        console.print(f"wrote {args.json}")
    return 1 if any(f["falsified"] for f in result["falsifiers"]) else 0
