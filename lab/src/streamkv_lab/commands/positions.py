"""``streamkv positions``: position maps and RoPE at read -- exactness of every map x cache kind x
read path against a float64 whole-history reference, one compiled graph across map changes,
positions 2**40 on, sliding-window layers and StreamingLLM in transformers, the flashdreams
drop-in, re-cache in place, the cost of rotation at read, and the toy video model 8x past its
training window (:mod:`streamkv_lab.experiments.positions`)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default="out/positions.json", help="result JSON (default out/positions.json)")
    p.add_argument("--plot", default="out/positions.png", help="plot PNG (default out/positions.png)")
    p.add_argument("--quick", action="store_true",
                   help="a quick run: the small cost preset, a tiny Llama for StreamingLLM, a 2x long stream "
                        "(an explicit --long-factor wins)")
    p.add_argument("--no-smollm2", action="store_true", help="StreamingLLM on a tiny Llama instead of SmolLM2")
    p.add_argument("--long-clips", type=int, default=3, help="held-out clips of the long stream (default 3)")
    p.add_argument("--long-factor", type=int, default=None,
                   help="long stream length in training windows (default 8; 2 with --quick)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared CPU a 2-thread pool stalls small ops)")


def long_factor(args: argparse.Namespace) -> int:
    """The long stream's length in training windows: ``--long-factor`` if given, else 2 with
    ``--quick``, else 8."""
    if args.long_factor is not None:
        return args.long_factor
    return 2 if args.quick else 8


def check(args: argparse.Namespace) -> None:
    """Every bound before any work (:class:`~streamkv_lab.errors.UsageError`): an option that
    ``--quick`` already implies, the toy weights, the long stream against the toy model's RoPE
    horizon."""
    from streamkv_lab.commands._common import toy_weights_horizon
    from streamkv_lab.errors import UsageError
    from streamkv.models.config import get_config

    if args.quick and args.no_smollm2:
        raise UsageError("--no-smollm2: --quick already runs StreamingLLM on a tiny Llama (leave one out)")
    horizon = toy_weights_horizon(None, flag="the long stream's weights")
    top = get_config("toy").max_frames
    factor = long_factor(args)
    if factor < 2:
        raise UsageError(f"--long-factor must be >= 2 (the long stream runs past the training window), got {factor}")
    if factor * horizon > top:
        raise UsageError(f"--long-factor {factor} x the {horizon}-frame training window = {factor * horizon} frames "
                         f"passes the toy model's {top}-frame RoPE horizon: at most {top // horizon}")


def run(args: argparse.Namespace) -> int:
    from streamkv_lab.commands._common import console as make_console
    from streamkv_lab.commands._common import write_json
    from streamkv_lab.env import environment, threads
    from streamkv_lab.experiments.positions import run_positions
    from streamkv_lab.experiments.positions_report import plot_positions, print_positions

    check(args)
    console = make_console()
    with threads(args.threads), console.status("") as status:
        result = run_positions(quick=args.quick, smollm2=not args.no_smollm2, long_clips=args.long_clips,
                               long_factor=long_factor(args), progress=lambda w: status.update(w))
    result["threads"] = args.threads
    result["versions"] = environment("cpu")
    print_positions(console, result)
    write_json(args.json, result)
    plot_positions(result, args.plot)
    console.print(f"wrote {args.json} and {args.plot}")
    ok = all(r["max_abs_diff"] < 1e-12 for r in result["maps"].values()) and result["wrong_map"]["caught"]
    return 0 if ok else 1
