"""``streamkv positions``: position maps and RoPE at read -- exactness of every map x cache kind x
read path against a float64 whole-history reference, one compiled graph across map changes,
positions 2**40 on, sliding-window layers and StreamingLLM in transformers, the flashdreams
drop-in, re-cache in place, the cost of rotation at read, and the toy video model 8x past its
training window (:mod:`streamkv.lab.experiments.positions`)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default="out/positions.json", help="result JSON (default out/positions.json)")
    p.add_argument("--plot", default="out/positions.png", help="plot PNG (default out/positions.png)")
    p.add_argument("--quick", action="store_true",
                   help="a quick run: the small cost preset, a tiny Llama for StreamingLLM, a 2x long stream")
    p.add_argument("--no-smollm2", action="store_true", help="StreamingLLM on a tiny Llama instead of SmolLM2")
    p.add_argument("--long-clips", type=int, default=3, help="held-out clips of the long stream (default 3)")
    p.add_argument("--long-factor", type=int, default=8, help="long stream length in training windows (default 8)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared CPU a 2-thread pool stalls small ops)")


def run(args: argparse.Namespace) -> int:
    from streamkv.lab.commands._common import console as make_console
    from streamkv.lab.commands._common import write_json
    from streamkv.lab.env import environment, threads
    from streamkv.lab.experiments.positions import run_positions
    from streamkv.lab.experiments.positions_report import plot_positions, print_positions

    if args.long_factor < 1:
        raise ValueError(f"--long-factor must be >= 1, got {args.long_factor}")
    console = make_console()
    with threads(args.threads), console.status("") as status:
        result = run_positions(quick=args.quick, smollm2=not args.no_smollm2, long_clips=args.long_clips,
                               long_factor=args.long_factor, progress=lambda w: status.update(w))
    result["threads"] = args.threads
    result["versions"] = environment("cpu")
    print_positions(console, result)
    write_json(args.json, result)
    plot_positions(result, args.plot)
    console.print(f"wrote {args.json} and {args.plot}")
    ok = all(r["max_abs_diff"] < 1e-12 for r in result["maps"].values()) and result["wrong_map"]["caught"]
    return 0 if ok else 1
