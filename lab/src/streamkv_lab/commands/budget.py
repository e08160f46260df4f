"""``streamkv budget``: the streaming mass-budget cache measured against its whole history,
and compared as error vs memory with a fixed window, H2O and the per-query oracle, on
synthetic heads and on the tiny DiT."""

from __future__ import annotations

import argparse

EPILOG = """\
What is measured (streamkv_lab.experiments.streaming_budget): every cache runs as a recording
subclass that shadows every committed K/V and each chunk's queries; after each commit,
per (layer, head), exactly in float64:
  memory      tokens resident while the chunk attends (mean over steps/layers/heads, peak)
  error       ||o_resident - o_full||_inf of the chunk's queries vs full-history attention
  missing     full-history mass outside the resident set (the error's exact bound is
              missing * value range)
  dropped     mass the scoring chunk's queries put on what this commit evicted, under
              their softmax over the pre-eviction cache (kept mass = 1 - dropped); the
              tau guarantee: dropped <= tau and ||o_post - o_pre||_inf <= tau * range,
              checked on every query where no overflow was counted
  holdout     mass the NEXT chunk's queries (full-history softmax) put on the tokens
              evicted before it: how well the choice transfers (not covered by tau)
  oracle      the seed's per-query PerQueryMass on the full history at the same tau
              (sinks and the newest chunk protected); memory = per-query kept count
Baselines: ring (sinks + window W) and H2O (accumulated attention, fixed budget, sinks and
the newest chunk protected), chosen analytically to match the mass cache's mean resident
tokens (window, h2o) and its peak (window@peak, h2o@peak: the same allocation).

JSON keys (--json):
  config                  the run's parameters (taus, sizes, chunks, seed, query scale)
  scope                   the scope statement printed at the top
  synthetic               {generator, sink, chunk, chunks, mass_capacity, mass, groups}
  dit                     {model, sections: [{label, window_frames, capacity,
                           query_scale, sink, chunk, chunks, mass, groups}]}
    mass                  list, one summary per tau (see below)
    groups                list per tau: {tau, window, h2o_budget, window_at_peak,
                          h2o_budget_at_peak, rows, ring, h2o (mean-matched summaries)};
                          rows: [{policy (mass|window|h2o|window@peak|h2o@peak|oracle),
                          param, memory_mean,
                          memory_peak, err_mean, err_p95, err_max, missing_mean,
                          missing_max, holdout_mean, holdout_max, overflow_steps, ...}]
  a summary               {tau, steps, memory {mean, peak, kept_mean, kept_peak},
                           error {max, mean, p95, bound_max, missing {max, mean, p95}},
                           post {err, missing}, scoring {dropped {max, mean, p95},
                           kept_mass_min, err_evict_max, tau_bound_max, checked,
                           kept_mass_min_checked, violations, within_bound},
                           overflow_steps,
                           holdout {max, mean, p95, tokens_mean, over_tau},
                           per_head [{layer, head, resident_mean, resident_peak,
                           kept_mean, kept_peak, dropped, kept_mass_min, err_evict_max,
                           tau_bound_max, err_attend, missing_max, err_post_max,
                           overflows, holdout}], oracle {"<tau>": {count_mean, count_max,
                           union_mean, kept_mass_min, err_mean, err_p95, err_max,
                           bound_max, within_bound}}}
  versions                streamkv, torch, python, device
Exit status 1 if the tau guarantee is violated on any checked query (a falsifier).
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON (keys below)")
    p.add_argument("--plot", metavar="PATH", help="write the error-vs-memory plot here (PNG)")
    p.add_argument("--seed", type=int, default=0, help="generator, weights and noise seed (default 0)")
    p.add_argument("--dit-chunks", type=int, default=16, help="DiT chunks per rollout (default 16, at most 32)")
    p.add_argument("--dit-window-frames", type=int, default=16,
                   help="window of the DiT capacity variant, in frames (default 16; the tiny config has 5)")
    p.add_argument("--syn-taus", type=_taus, default=(0.2, 0.1, 0.05, 0.02),
                   help="taus of the synthetic runs, comma-separated (default 0.2,0.1,0.05,0.02)")
    p.add_argument("--dit-taus", type=_taus, default=(0.2, 0.1, 0.05),
                   help="taus of the DiT runs, comma-separated (default 0.2,0.1,0.05)")
    p.add_argument("--query-scale", type=float, default=4.0,
                   help="the sharper-attention VARIANT: every DiT query scaled by this (default 4; 0 skips it)")


def _taus(text: str) -> tuple[float, ...]:
    try:
        taus = tuple(float(t) for t in text.split(","))  # an empty item is refused, not dropped
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not taus or not all(0 < t < 1 for t in taus):
        raise argparse.ArgumentTypeError(f"taus must be in the open interval (0, 1), got {text!r}")
    if len(set(taus)) != len(taus):
        raise argparse.ArgumentTypeError(f"taus must differ, got {text!r}")
    return taus


def _f(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}" if abs(x) >= 10 ** -digits or x == 0 else f"{x:.2e}"


def _comparison(console, title: str, sec: dict) -> None:
    from rich.table import Table

    t = Table(title=f"{title}: error vs memory (matched mean resident tokens per head)")
    for c in ("tau", "policy", "param", "mem mean", "mem peak", "err mean", "err p95", "err max",
              "missing mean / max", "holdout mean / max", "overflows"):
        t.add_column(c, justify="right", no_wrap=True)
    for g in sec["groups"]:
        for i, r in enumerate(g["rows"]):
            miss = f"{_f(r['missing_mean'])} / {_f(r['missing_max'])}" if r["missing_mean"] is not None else (
                f"- / {_f(r['missing_max'])}")
            hold = f"{_f(r['holdout_mean'])} / {_f(r['holdout_max'])}" if r["holdout_mean"] is not None else "-"
            t.add_row(f"{g['tau']:g}" if i == 0 else "", r["policy"], r["param"], f"{r['memory_mean']:.1f}",
                      f"{r['memory_peak']:.0f}", _f(r["err_mean"]), _f(r["err_p95"]), _f(r["err_max"]), miss, hold,
                      str(r["overflow_steps"]), end_section=i == len(g["rows"]) - 1)
    console.print(t)
    parts = []
    for g in sec["groups"]:
        by = {r["policy"]: r for r in g["rows"]}
        m = by["mass"]["err_mean"]
        if m > 0:
            parts.append(f"tau={g['tau']:g}: " + ", ".join(
                f"{k}/mass {by[k]['err_mean'] / m:.2f}x" for k in ("window", "h2o", "window@peak", "h2o@peak", "oracle")))
    console.print("mean-error ratios (> 1: mass better): " + "; ".join(parts))


def _scoring(console, title: str, sec: dict) -> None:
    from rich.table import Table

    t = Table(title=f"{title}: the streaming mass cache; scoring chunk (vs the pre-eviction cache) and holdout")
    for c in ("tau", "dropped max/mean/p95", "kept mass min (checked / all)", "evict err max", "tau*range max",
              "within (checked q)", "overflows", "holdout max/mean/p95", "holdout>tau", "post err max",
              "oracle mem / err max"):
        t.add_column(c, justify="right", overflow="fold")
    for s in sec["mass"]:
        sc, h, o = s["scoring"], s["holdout"], s["oracle"][s["tau"]]
        d = sc["dropped"]
        kmc = sc["kept_mass_min_checked"]
        t.add_row(f"{s['tau']:g}", f"{_f(d['max'])} / {_f(d['mean'])} / {_f(d['p95'])}",
                  f"{'-' if kmc is None else f'{kmc:.6f}'} / {sc['kept_mass_min']:.6f}",
                  _f(sc["err_evict_max"]), _f(sc["tau_bound_max"]), f"{sc['within_bound']} ({sc['checked']})",
                  str(s["overflow_steps"]), f"{_f(h['max'])} / {_f(h['mean'])} / {_f(h['p95'])}",
                  f"{h['over_tau']:.2f}", _f(s["post"]["err"]["max"]),
                  f"{o['count_mean']:.1f} / {_f(o['err_max'])}")
    console.print(t)


def _per_head(console, title: str, sec: dict) -> None:
    from rich.table import Table

    t = Table(title=f"{title}: per (layer, head), heads joined by '/'")
    for c in ("tau", "layer", "kept mean", "kept peak", "dropped max", "evict err max", "tau*range",
              "err vs full max", "holdout max", "overflows"):
        t.add_column(c, justify="right", overflow="fold")
    for s in sec["mass"]:
        layers = sorted({r["layer"] for r in s["per_head"]})
        for i, layer in enumerate(layers):
            rows = [r for r in s["per_head"] if r["layer"] == layer]

            def j(fn, rows=rows):
                return "/".join(fn(r) for r in rows)

            t.add_row(f"{s['tau']:g}" if i == 0 else "", str(layer), j(lambda r: f"{r['kept_mean']:.0f}"),
                      j(lambda r: f"{r['kept_peak']:.0f}"), j(lambda r: f"{r['dropped']['max']:.3f}"),
                      j(lambda r: f"{r['err_evict_max']:.3f}"), j(lambda r: f"{r['tau_bound_max']:.3f}"),
                      j(lambda r: f"{r['err_attend']['max']:.3f}"),
                      j(lambda r: f"{r['holdout']['max']:.3f}" if r["holdout"] else "-"),
                      j(lambda r: str(r["overflows"])), end_section=i == len(layers) - 1)
    console.print(t)


def check(args: argparse.Namespace) -> None:
    """Every bound before any work (:class:`~streamkv_lab.errors.UsageError`)."""
    import math

    from streamkv_lab.errors import UsageError

    if not 2 <= args.dit_chunks <= 32:
        raise UsageError(f"--dit-chunks must be in [2, 32] (the tiny model's RoPE horizon), got {args.dit_chunks}")
    if args.dit_window_frames < 4:
        raise UsageError(f"--dit-window-frames must be >= 4 (the mass cache holds two 2-frame chunks), got "
                         f"{args.dit_window_frames}")
    if not (math.isfinite(args.query_scale) and 0 <= args.query_scale <= 1e4):
        raise UsageError(f"--query-scale must be a number in [0, 1e4] (0 skips the variant; larger overflows the "
                         f"logits), got {args.query_scale}")


def run(args: argparse.Namespace) -> int:

    from rich.console import Console
    from rich.table import Table

    from streamkv_lab.budget import StreamingBudgetConfig, plot_streaming, run_streaming_budget
    from streamkv_lab.commands._common import write_json
    from streamkv_lab.env import environment

    check(args)
    cfg = StreamingBudgetConfig(syn_taus=args.syn_taus, dit_taus=args.dit_taus, dit_chunks=args.dit_chunks,
                                dit_window_frames=args.dit_window_frames,
                                dit_query_scale=args.query_scale or None, seed=args.seed)
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 200))
    with console.status("rollouts") as status:
        result = run_streaming_budget(cfg, progress=lambda m: status.update(f"running {m}"))

    console.print(f"[bold]scope[/]: {result['scope']}")
    syn = result["synthetic"]
    g = syn["generator"]
    t = Table(title="synthetic heads: the seed's generator, one stream per head (streamkv_lab.experiments.synthetic)")
    t.add_column("head")
    t.add_column("changes from the base generator")
    for h, changes in enumerate(g["heads"]):
        t.add_row(str(h), ", ".join(f"{k}={v:g}" for k, v in changes.items()) or "(base)")
    console.print(t)
    base = ", ".join(f"{k}={v}" for k, v in g["base"].items())
    console.print(f"base: {base}; seed {g['seed']} (+head); {g['embedding']}; cache sink {syn['sink']} tokens, "
                  f"chunk {syn['chunk']} (one frame), {syn['chunks']} chunks, mass capacity {syn['mass_capacity']}")
    _comparison(console, "synthetic", syn)
    _scoring(console, "synthetic", syn)
    _per_head(console, "synthetic", syn)
    m = result["dit"]["model"]
    console.print(f"[bold]tiny DiT[/] (random weights, seed {args.seed}; {m['layers']} layers x {m['heads']} heads, "
                  f"{m['frames_per_chunk'] * 16} tokens per chunk, sink {m['sink_frames']} frame; guidance 1): the "
                  f"history is the rollout's own (each cache changes the trajectory), errors are per layer given "
                  f"the same inputs")
    for sec in result["dit"]["sections"]:
        console.rule(f"{sec['label']}: capacity {sec['capacity']} tokens, {sec['chunks']} chunks")
        _comparison(console, sec["label"], sec)
        _scoring(console, sec["label"], sec)
        _per_head(console, sec["label"], sec)
    if args.plot:
        plot_streaming(result, args.plot)
        result["plot"] = str(args.plot)
        console.print(f"wrote {args.plot}")
    result["versions"] = environment()
    write_json(args.json, result)
    if args.json:
        console.print(f"wrote {args.json}")
    sections = [syn, *result["dit"]["sections"]]
    violated = [f"{sec.get('label', 'synthetic')} tau={s['tau']}" for sec in sections for s in sec["mass"]
                if not s["scoring"]["within_bound"]]
    if violated:
        import sys

        print(f"the mass cache's guarantee failed in {', '.join(violated)} (violations in the tables and the JSON)",
              file=sys.stderr)
    return 1 if violated else 0
