"""``streamkv verify``: the storage experiment of the circular-cache proposal."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64",
                   help="K/V dtype (default float64, as in the proposal)")
    p.add_argument("--seed", type=int, default=0, help="random stream seed (default 0)")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON")


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.progress import Progress
    from rich.table import Table

    from streamkv.lab.experiments.verify import default_layouts, run_verify
    from streamkv.lab.commands._common import console as make_console
    from streamkv.lab.commands._common import write_json
    from streamkv.lab.env import environment

    console = make_console()
    dtype = getattr(torch, args.dtype)
    layouts = default_layouts()
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("layouts", total=len(layouts))
        result = run_verify(layouts, dtype=dtype, seed=args.seed, progress=lambda g: progress.advance(task))

    table = Table(title=f"storage experiment ({result.dtype}): caches vs whole-history reference")
    table.add_column("cache")
    table.add_column("layouts", justify="right")
    table.add_column("comparisons", justify="right")
    table.add_column("identical K/V in logical order", justify="right")
    table.add_column(f"physical-order attention diff ({result.attention_diff_kind})", justify="right")
    for name in ("chronological", "ring"):
        table.add_row(
            "ChronologicalCache (current)" if name == "chronological" else "RingCache",
            str(result.layouts), str(result.comparisons), str(result.identical[name]),
            f"{result.max_attention_diff[name]:.3e}",
        )
    console.print(table)
    ok = all(result.identical[n] == result.comparisons for n in result.identical)
    console.print("every comparison identical" if ok else "[bold red]MISMATCH[/]: some views differ")
    payload = {
        "layouts": result.layouts,
        "comparisons": result.comparisons,
        "identical": result.identical,
        "max_attention_diff": result.max_attention_diff,
        "attention_diff_kind": result.attention_diff_kind,
        "dtype": result.dtype,
        "seed": args.seed,
        "versions": environment(),
        "per_layout": result.per_layout,
    }
    write_json(args.json, payload)
    if args.json:
        console.print(f"wrote {args.json}")
    return 0 if ok else 1
