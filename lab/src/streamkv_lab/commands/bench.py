"""``streamkv bench``: cache maintenance, bytes moved, transient memory and scaling, plus
the end-to-end chunk latency of the tiny-DiT rollout per cache (same weights and noise)
and the share of it spent in cache maintenance (JSON key ``end_to_end``).

``streamkv bench --read`` runs the read benchmark instead (JSON key ``read``,
:mod:`streamkv_lab.bench.reads`): one read per storage format, position map, compressed tier
and paged branch against the dense bf16 read, eager and compiled, at its own shapes
(``--read-shape``); the maintenance sections' options are refused with it."""

from __future__ import annotations

import argparse

# kept here so --help needs no torch; the default run is the first four (the sglang shapes are asked for by name)
_PRESETS = ("self-forcing", "self-forcing-sink", "lingbot", "small", "krea-realtime-14b", "longlive2", "lingbot-world")
_DEFAULT_PRESETS = _PRESETS[:4]
# the read's shapes (streamkv_lab.bench.shapes.SHAPES; kept here so --help needs no torch) and its defaults
_SHAPES = ("self-forcing", "lingbot-world", "smollm2-decode", "smollm2-prefill", "tiny-video", "tiny-decode")
_READ_SHAPES = ("self-forcing", "lingbot-world", "smollm2-decode")
_MODES = ("eager", "compiled")
_BACKENDS = ("inductor", "aot_eager", "eager")
#: options of the maintenance run that --read refuses (it runs none of their sections)
_MAINTENANCE_ONLY = ("preset", "scaling_repeats", "no_scaling", "write_kernels", "no_end_to_end", "no_counts",
                     "no_compiled_counts", "scored")
_READ_ONLY = ("read_shape", "read_queries", "modes", "compile_backend")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", action="append", choices=_PRESETS, metavar="NAME",
                   help=f"preset to run, repeatable: {', '.join(_PRESETS)} (default: {', '.join(_DEFAULT_PRESETS)})")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write the plot of maintenance time vs window size (PNG)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--repeats", type=int, metavar="N", help="timed steps per cache after warm-up (default: per preset)")
    p.add_argument("--scaling-repeats", type=int, metavar="N", help="the same per window of the scaling sweep (default: a third)")
    p.add_argument("--threads", type=int, metavar="N", help="torch.set_num_threads for the run (default: torch's)")
    p.add_argument("--no-scaling", action="store_true", help="skip the window-size sweep")
    p.add_argument("--write-kernels", action="store_true",
                   help="also time the ring's write kernel variants and slot plan apart")
    p.add_argument("--no-end-to-end", action="store_true",
                   help="skip the end-to-end tiny-DiT rollout per cache (latency, maintenance share)")
    p.add_argument("--no-counts", action="store_true",
                   help="skip the counts per steady chunk (ops, host syncs, allocations, bytes, the read)")
    p.add_argument("--no-compiled-counts", action="store_true",
                   help="count eagerly only (skip compiling each cache's write with torch.compile)")
    p.add_argument("--scored", action="store_true",
                   help="also price the scored kinds' maintenance (mass, H2O, TOVA) against the ring, by phase")
    p.add_argument("--read", action="store_true",
                   help="run the read benchmark instead: the span's queries reading every storage format, position "
                        "map (RoPE at read), the compressed tier and a paged branch against the dense bf16 read, eager "
                        "and compiled (JSON key read; --plot: its plot; --repeats: its rounds, default 5, more for a "
                        "read under 0.1 s, up to 40)")
    p.add_argument("--read-shape", action="append", choices=_SHAPES, metavar="NAME",
                   help=f"with --read, repeatable: {', '.join(_SHAPES)} (default: {', '.join(_READ_SHAPES)})")
    p.add_argument("--read-queries", type=int, metavar="N",
                   help="with --read: read with the span's last N query rows (1: one query reading the whole "
                        "cache) instead of all of them (default: the span, a video chunk's 4,680 queries, where "
                        "the read targets are set)")
    p.add_argument("--modes", metavar="LIST",
                   help="with --read: comma-separated of eager, compiled (default both)")
    p.add_argument("--compile-backend", choices=_BACKENDS, metavar="NAME",
                   help="with --read: torch.compile's backend, inductor (default), aot_eager or eager (quick checks)")


def check(args: argparse.Namespace) -> None:
    """Options that would do nothing in the sections this run skips are refused before any work
    (:class:`~streamkv_lab.errors.UsageError`)."""
    from streamkv_lab.errors import UsageError

    given = getattr(args, "_given", set())
    if args.read:
        wrong = [n for n in _MAINTENANCE_ONLY if n in given]
        if wrong:
            raise UsageError(f"{', '.join('--' + n.replace('_', '-') for n in wrong)}: of the maintenance benchmark; "
                             f"--read runs the read benchmark alone (its shapes: --read-shape)")
        if args.device != "cpu":
            raise UsageError(f"--read --device {args.device}: the read benchmark runs on the CPU (its fused-kernel and "
                             f"compiled paths are the CPU's); leave --device out")
        if args.read_queries is not None and args.read_queries < 1:
            raise UsageError(f"--read-queries must be >= 1 (query rows of the span), got {args.read_queries}")
        if "compiled" not in parse_modes(args.modes) and "compile_backend" in given:
            raise UsageError("--compile-backend: no compiled mode runs (--modes eager); leave it out")
        return
    wrong = [n for n in _READ_ONLY if n in given]
    if wrong:
        raise UsageError(f"{', '.join('--' + n.replace('_', '-') for n in wrong)}: options of --read; add --read or "
                         f"leave them out")
    unused = []
    if args.no_scaling:
        unused += [f"--{n.replace('_', '-')}" for n in ("scaling_repeats", "plot") if n in given]
    if args.no_counts and "no_compiled_counts" in given:
        unused.append("--no-compiled-counts")
    if unused:
        raise UsageError(f"{', '.join(unused)}: of a section this run skips (--no-scaling: the window sweep and its "
                         f"plot; --no-counts: the counts, compiled or not); leave it out")


def parse_modes(text: str | None) -> tuple[str, ...]:
    """``--modes``: a comma-separated subset of eager, compiled (None: both); UsageError otherwise."""
    from streamkv_lab.errors import UsageError

    if text is None:
        return _MODES
    modes = tuple(m.strip() for m in text.split(","))
    bad = [m for m in modes if m not in _MODES]
    if bad or not modes or len(set(modes)) != len(modes):
        raise UsageError(f"--modes must be a comma-separated subset of {', '.join(_MODES)} without repeats, "
                         f"got {text!r}")
    return tuple(m for m in _MODES if m in modes)


def run(args: argparse.Namespace) -> int:
    if args.read:
        return _run_read(args)
    from streamkv_lab.bench import BenchOptions, plot_scaling, print_report, run_bench
    from streamkv_lab.commands._common import console as make_console
    from streamkv_lab.commands._common import write_json

    console = make_console()
    sections = ["maintenance"]
    if not args.no_scaling:
        sections.append("scaling")
    if not args.no_counts:
        sections.append("counts")
    if args.scored:
        sections.append("scored")
    if args.write_kernels:
        sections.append("write_kernels")
    options = BenchOptions(
        device=args.device, repeats=args.repeats, scaling_repeats=args.scaling_repeats, threads=args.threads,
        sections=tuple(sections), compiled_counts=not args.no_compiled_counts,
    )
    presets = args.preset or list(_DEFAULT_PRESETS)
    with console.status("benchmark") as status:
        doc = run_bench(presets, options, progress=lambda msg: status.update(f"benchmark: {msg}"))
    doc["argv"] = ["streamkv", "bench", *_argv(args)]
    print_report(doc, console)
    if not args.no_end_to_end:
        doc["end_to_end"] = _end_to_end(args, console)
    if args.json:
        write_json(args.json, doc)
        console.print(f"wrote {args.json}")
    if args.plot:
        path = plot_scaling(doc, args.plot)
        console.print(f"wrote {path}" if path else "no scaling data: no plot written")
    return 0


def _run_read(args: argparse.Namespace) -> int:
    from streamkv_lab.bench.read_report import plot_reads, print_reads
    from streamkv_lab.bench.reads import measure_reads
    from streamkv_lab.bench.suite import SCHEMA
    from streamkv_lab.commands._common import console as make_console
    from streamkv_lab.commands._common import write_json
    from streamkv_lab.env import environment, threads
    from streamkv_lab.measure import check_device

    console = make_console()
    shapes = args.read_shape or list(_READ_SHAPES)
    with threads(args.threads), console.status("read benchmark") as status:
        env = environment(check_device("cpu"))
        read = measure_reads(shapes, repeats=args.repeats or 5, modes=parse_modes(args.modes),
                             backend=args.compile_backend or "inductor", queries=args.read_queries,
                             progress=lambda msg: status.update(f"read benchmark: {msg}"))
    doc = {"schema": SCHEMA, "versions": env, "argv": ["streamkv", "bench", *_argv(args)], "read": read}
    print_reads(read, console)
    if args.json:
        write_json(args.json, doc)
        console.print(f"wrote {args.json}")
    if args.plot:
        console.print(f"wrote {plot_reads(read, args.plot)}")
    return 0


def _argv(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    if args.read:
        out.append("--read")
        for s in args.read_shape or []:
            out += ["--read-shape", s]
        for flag in ("read_queries", "modes", "compile_backend", "json", "plot", "repeats", "threads"):
            v = getattr(args, flag)
            if v is not None:
                out += [f"--{flag.replace('_', '-')}", str(v)]
        return out
    for p in args.preset or []:
        out += ["--preset", p]
    for flag in ("json", "plot", "device", "repeats", "scaling_repeats", "threads"):
        v = getattr(args, flag)
        if v is not None and not (flag == "device" and v == "cpu"):
            out += [f"--{flag.replace('_', '-')}", str(v)]
    out += ["--no-scaling"] if args.no_scaling else []
    out += ["--write-kernels"] if args.write_kernels else []
    out += ["--no-end-to-end"] if args.no_end_to_end else []
    out += ["--no-counts"] if args.no_counts else []
    out += ["--no-compiled-counts"] if args.no_compiled_counts else []
    out += ["--scored"] if args.scored else []
    return out


def _end_to_end(args: argparse.Namespace, console) -> dict:
    """The tiny-DiT rollout through the current path and the ring: per-chunk latency and
    the share spent in cache maintenance (eager, instrumented)."""
    from streamkv_lab.env import threads
    from streamkv_lab.experiments.rollout_compare import compare_rollouts
    from streamkv_lab.commands._rollout_report import print_tables

    n = args.threads or 1  # the tiny model's ops are small: one thread is fastest
    with console.status("end to end: tiny DiT rollout per cache"), threads(n):
        result = compare_rollouts(("chronological", "ring"), config="tiny", device=args.device, guidance=3.0)
    console.print(f"[bold]end to end[/] (the tiny DiT, {n} thread(s); cache maintenance is a small share at this size)")
    print_tables(console, result)
    out = result.to_json()
    forwards = (len(out["config"]["timesteps"]) + 1) * 2
    for kind in ("chronological", "ring"):
        rec = out[kind]
        rec["maintenance_share"] = rec["maintenance_ms"] * forwards / rec["chunk_latency_ms"]
    return out
