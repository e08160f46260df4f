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

    from streamkv_lab.experiments.verify import default_layouts, run_verify
    from streamkv_lab.commands._common import console as make_console
    from streamkv_lab.commands._common import write_json
    from streamkv_lab.env import environment

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
    # positions: raw keys rotated at read by every registry map, every cache kind and read path (float64)
    from streamkv_lab.env import threads
    from streamkv_lab.experiments.positions import map_section

    with threads(1), console.status("position maps") as status:
        maps = map_section(lambda name: status.update(f"position maps: {name}"))["per_map"]
    ptable = Table(title="position maps (raw keys, rotated at read) vs the float64 whole-history reference")
    for col in ("map", "layouts", "comparisons", "max |diff| (fp64)", "recompiles"):
        ptable.add_column(col, justify="left" if col == "map" else "right")
    for name, r in maps.items():
        ptable.add_row(name, str(r["layouts"]), str(r["comparisons"]), f"{r['max_abs_diff']:.1e}", str(r["recompiles"]))
    console.print(ptable)
    ok = ok and all(r["max_abs_diff"] < 1e-12 for r in maps.values())
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
        "positions": {name: {k: r[k] for k in ("layouts", "comparisons", "max_abs_diff", "recompiles", "kinds")}
                      for name, r in maps.items()},
    }
    write_json(args.json, payload)
    if args.json:
        console.print(f"wrote {args.json}")
    return 0 if ok else 1
