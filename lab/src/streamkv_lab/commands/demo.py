"""``streamkv demo``: the main job. First what the ring is for, where history is real: one
Self-Forcing-sized attention layer (a 100 MB K buffer) per autoregressive step through the
current path, flashdreams' ``BlockKVCache``, the ring and the copy floor (time, bytes written,
memory allocated), beside the embedded tiny model's streaming rollout through every cache
(current path, ring, mass budget, H2O, TOVA), with a progress bar, tables and plots; then the
trained toy video model streams a held-out clip several times longer than its training window
through the ring and every other cache at the same memory (animated GIFs); last, one prefix of
the toy continued in four branches over pages shared copy-on-write (``streamkv fork``'s video:
``fork.gif``, the bytes each branch adds)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="out", help="output folder for JSON and the plot (default out/)")
    p.add_argument("--chunks", type=int, default=8, help="chunks in the first stream (default 8)")
    p.add_argument("--video-frames", type=int, default=64,
                   help="frames the trained toy streams (default 64: 4x its 16-frame training window)")
    p.add_argument("--headline-repeats", type=int, default=8,
                   help="timed steps per cache of the Self-Forcing layer (default 8)")
    p.add_argument("--weights", default=None,
                   help="the toy video model's weights (default: the packaged toy weights; streamkv train-toy "
                        "writes them)")


def check(args: argparse.Namespace) -> None:
    """Every bound before any work (:class:`~streamkv_lab.errors.UsageError`): the tiny DiT's
    RoPE horizon (``--chunks``), the toy video stream's length, the toy weights file."""
    from streamkv_lab.commands._common import toy_weights_horizon
    from streamkv_lab.errors import UsageError
    from streamkv.models.config import get_config

    horizon = get_config("tiny").max_chunks
    if args.chunks > horizon:
        raise UsageError(f"--chunks must be <= {horizon} (the tiny model's RoPE horizon in chunks), got {args.chunks}")
    top = get_config("toy").max_frames
    if args.video_frames < 8 or args.video_frames % 2 or args.video_frames > top:
        raise UsageError(f"--video-frames must be an even number in [8, {top}] (the toy model's RoPE horizon), got "
                         f"{args.video_frames}")
    toy_weights_horizon(args.weights)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from streamkv_lab.bench.headline import measure_headline, plot_headline, print_headline
    from streamkv_lab.commands._common import console as make_console
    from streamkv_lab.commands._common import write_json
    from streamkv_lab.commands._rollout_report import plot_runs, print_tables, progress_bar
    from streamkv_lab.commands.rollout import _cache_kwargs, available_caches
    from streamkv_lab.env import environment, threads
    from streamkv_lab.experiments.rollout_compare import compare_rollouts

    check(args)
    out = Path(args.out)
    console = make_console()
    threads_default = torch.get_num_threads()
    # the tiny DiT: one thread (its ops are tiny; intra-op threads only add synchronisation)
    kinds = available_caches()
    streams = args.chunks + max(1, args.chunks // 2)
    ns = argparse.Namespace(tau=0.05)
    with threads(1), progress_bar(console) as progress:
        tasks = {k: progress.add_task(f"tiny DiT {k:>13}", total=streams) for k in kinds}
        result = compare_rollouts(kinds, config="tiny", chunks=args.chunks, guidance=3.0, mode="eager", device="cpu",
                                  progress=lambda k: progress.advance(tasks[k]), cache_kwargs=_cache_kwargs(ns))
    rollout = result.to_json()
    with threads(threads_default), console.status("Self-Forcing layer: filling the caches, timing the steps"):
        headline = measure_headline(repeats=args.headline_repeats)
    print_headline(console, headline, rollout)
    plot_headline(headline, rollout, out / "demo.png")
    console.print()
    print_tables(console, result)
    plot_runs(result, str(out / "demo_rollout.png"))
    write_json(out / "demo.json", {**rollout, "headline": headline, "versions": environment()})
    console.print(f"wrote {out / 'demo.png'} (the headline), {out / 'demo_rollout.png'}, {out / 'demo.json'}")
    status = _video(out, args.video_frames, args.weights)
    return status or _fork(out, args.weights)


def _video(out, frames: int, weights: str | None = None) -> int:
    from streamkv_lab.commands._common import console as make_console
    from streamkv_lab.commands._common import write_json
    from streamkv_lab.env import threads
    from streamkv_lab.video.demo import video_demo
    from streamkv_lab.video.toy import WEIGHTS

    console = make_console()
    with threads(1), console.status("") as status:
        result = video_demo(out, frames=frames, weights=weights or WEIGHTS,
                            progress=lambda what: status.update(f"toy video: streaming {what}"))
    write_json(out / "demo_video.json", result)
    c = result["clip"]
    console.print(
        f"[bold]toy video[/]: {c['frames']} frames ({c['frames'] // c['training_window']}x the {c['training_window']}-frame "
        f"training window), first {c['context_frames']} from the ground truth, every cache at {c['capacity_frames']} "
        f"frames of memory; ring vs chronological max |diff| {result['ring_vs_chronological_max_abs_diff']:.3g}"
    )
    for label, s in result["streams"].items():
        th, tb = s["tracking_horizon"], s["tracking_beyond"]
        console.print(
            f"  {label:>26}: error vs full history {_f(s['err_vs_full_horizon'])} (< window) / "
            f"{_f(s['err_vs_full_beyond'])} (beyond); vs ground truth {_f(s['err_vs_gt_horizon'])} / "
            f"{_f(s['err_vs_gt_beyond'])}; sprites tracked {th['tracked']}/{th['n']} / {tb['tracked']}/{tb['n']}"
        )
    console.print(f"wrote {out / 'demo.gif'}, {out / 'demo_panel.gif'}, {out / 'demo_panel.png'}, "
                  f"{out / 'demo_video.json'} ({result['wall_s']:.1f} s)")
    return 0


def _fork(out, weights: str | None) -> int:
    """``streamkv fork``'s toy video at its defaults: one prefix, four branches (a few seconds)."""
    from streamkv_lab.commands._common import console as make_console
    from streamkv_lab.commands._common import write_json
    from streamkv_lab.commands.fork import fork_video_section
    from streamkv_lab.env import environment

    ns = argparse.Namespace(branches=4, prompt=[], prefix_frames=None, frames=24, seed=0, weights=weights, repeats=20)
    result = fork_video_section(ns, out, make_console())
    write_json(out / "fork.json", {"argv": ["streamkv", "demo"], "video": result, "versions": environment("cpu")})
    return 0


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
