"""``streamkv fuzz``: the differential fuzzer over every cache kind (see :mod:`streamkv_lab.fuzz`),
with the position-map hook (``--positions``, :mod:`streamkv_lab.fuzz_positions`), the
quantised-storage hook (``--quant``, :mod:`streamkv_lab.fuzz_quant`) and the fork-tree hook
(``--forks``, :mod:`streamkv_lab.fuzz_branches`)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layouts", type=int, default=1000, help="random layouts to run (default 1000)")
    p.add_argument("--calls", type=int, default=30, help="random calls per layout (default 30)")
    p.add_argument("--seed", type=int, default=0, help="seed of the layouts and calls (default 0)")
    p.add_argument("--positions", type=int, default=0,
                   help="random position-map layouts too (raw keys rotated at read, every registry map; default 0)")
    p.add_argument("--quant", type=int, default=0,
                   help="random quantised-storage streams too (every kind x format of streamkv.quant.KV_FORMATS, "
                        "residuals, spans, reopens, resets, state dicts; default 0)")
    p.add_argument("--forks", type=int, default=0,
                   help="random fork trees too (paged caches of every kind, format and map: fork, rewind, release, "
                        "export / import against unforked references; leaked pages; default 0)")
    p.add_argument("--json", metavar="PATH", help="write the counts as JSON")


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.progress import Progress

    from streamkv_lab.commands._common import console as make_console
    from streamkv_lab.commands._common import write_json
    from streamkv_lab.env import environment, threads
    from streamkv_lab.fuzz import run_fuzz
    from streamkv_lab.fuzz_branches import fuzz_branches
    from streamkv_lab.fuzz_quant import fuzz_quant

    console = make_console()
    with threads(1), torch.no_grad(), Progress(console=console, transient=True) as progress:
        task = progress.add_task("layouts", total=args.layouts)
        result = run_fuzz(args.layouts, seed=args.seed, calls=args.calls,
                          progress=lambda i: progress.update(task, completed=i), positions=args.positions)
        quant = None
        if args.quant:
            qtask = progress.add_task("quantised streams", total=args.quant)
            quant = fuzz_quant(args.quant, seed=args.seed, keep_going=True,
                               progress=lambda i: progress.update(qtask, completed=i))
        forks = None
        if args.forks:
            ftask = progress.add_task("fork trees", total=args.forks)
            forks = fuzz_branches(args.forks, seed=args.seed, progress=lambda i: progress.update(ftask, completed=i))
    data = result.to_json()
    if forks is not None:  # its own counts under "forks"; what must be zero joins the totals
        data["forks"] = forks
        for key in ("mismatches", "state_changes_after_rejection", "bad_calls_accepted"):
            data[key] += forks[key]
        data["failures"] += forks["failures"]
    if quant is not None:
        data["quant"] = quant
        data["mismatches"] += quant["mismatches"]
        data["failures"] += quant["failures"]
    for key in ("layouts", "calls", "rejected_calls", "state_changes_after_rejection", "bad_calls_accepted",
                "mismatches", "certified_layouts", "observer_faults", "certificate_undercounts"):
        console.print(f"{key:>30}: {data[key]:,}")
    if data["positions"]:
        p = data["positions"]
        console.print(f"{'position-map layouts':>30}: {p['layouts']:,} ({p['comparisons']:,} comparisons, max |diff| "
                      f"{p['max_abs_diff']:.2g}, {p['mismatches']} mismatches)")
    if quant is not None:
        console.print(f"{'quantised streams':>30}: {quant['cases']:,} ({quant['slots_checked']:,} slots checked, "
                      f"{quant['refused_writes']} refused writes, {quant['mismatches']} mismatches, "
                      f"{quant['seconds']:.1f} s; formats {quant['formats']})")
    if forks is not None:
        console.print(f"{'fork trees':>30}: {forks['cases']:,} ({forks['steps']:,} chunks, {forks['forks']} forks up to "
                      f"{forks['max_fanout']} wide and {forks['max_depth']} deep, {forks['rewinds']} rewinds, "
                      f"{forks['releases']} releases, {forks['exports']} exports, {forks['rejected_calls']} refused "
                      f"calls; {forks['mismatches']} mismatches, {forks['state_changes_after_rejection']} state "
                      f"changes, {forks['leaked_pages']} leaked pages; {forks['seconds']:.1f} s)")
    console.print(f"{'seconds':>30}: {data['seconds']:.1f}")
    console.print(f"{'layouts per kind':>30}: {data['kinds']}")
    for line in data["failures"]:
        console.print(f"[red]{line}[/]")
    write_json(args.json, {"seed": args.seed, "calls_per_layout": args.calls, **data, "versions": environment()})
    if args.json:
        console.print(f"wrote {args.json}")
    bad = (data["state_changes_after_rejection"] + data["bad_calls_accepted"] + data["mismatches"]
           + data["certificate_undercounts"] + (forks["leaked_pages"] if forks is not None else 0))
    return 1 if bad else 0
