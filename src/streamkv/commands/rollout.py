"""``streamkv rollout``: a streaming rollout of the causal DiT on one cache, or all compared."""

from __future__ import annotations

import argparse

CACHES = ("chronological", "ring")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache", default="ring", help="cache kind when not comparing (default ring)")
    p.add_argument("--compare", action="store_true", help="run every cache kind on the same weights and noise")
    p.add_argument("--chunks", type=int, default=8, help="chunks in the first stream (default 8)")
    p.add_argument("--config", default="tiny", help="model config: tiny (default) or wan2.1-1.3b")
    p.add_argument("--guidance", type=float, default=3.0, help="CFG scale; 1.0 disables the uncond branch (default 3.0)")
    p.add_argument("--mode", choices=["eager", "compile", "graph"], default="eager", help="execution mode")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--seed", type=int, default=0, help="weights and noise seed")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot of latency and maintenance per chunk")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..experiments.rollout_compare import compare_rollouts
    from ._common import versions, write_json
    from ._rollout_report import plot_runs, print_tables, progress_bar

    console = Console()
    kinds = available_caches() if args.compare else (args.cache,)
    streams = args.chunks + max(1, args.chunks // 2)
    with progress_bar(console) as progress:
        tasks = {k: progress.add_task(f"{k:>14} chunks", total=streams) for k in kinds}
        result = compare_rollouts(
            kinds, config=args.config, chunks=args.chunks, guidance=args.guidance, mode=args.mode,
            device=args.device, seed=args.seed, progress=lambda k: progress.advance(tasks[k]),
        )
    print_tables(console, result)
    payload = {**result.to_json(), "versions": versions()}
    write_json(args.json, payload)
    if args.json:
        console.print(f"wrote {args.json}")
    if args.plot:
        plot_runs(result, args.plot)
        console.print(f"wrote {args.plot}")
    return 0


def available_caches() -> tuple[str, ...]:
    """Every registered cache kind, the current path first."""
    from ..caches import CACHE_KINDS

    rest = [k for k in CACHE_KINDS if k not in CACHES]
    return (*CACHES, *rest)
