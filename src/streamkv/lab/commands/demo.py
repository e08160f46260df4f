"""``streamkv demo``: the main job — a streaming rollout on the embedded tiny model comparing
every cache (current path, ring, mass budget, H2O), with a progress bar, a table and a plot;
then the trained toy video model streams a held-out clip several times longer than its
training window through the ring and every other cache at the same memory (animated GIFs)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="out", help="output folder for JSON and the plot (default out/)")
    p.add_argument("--chunks", type=int, default=8, help="chunks in the first stream (default 8)")
    p.add_argument("--video-frames", type=int, default=64,
                   help="frames the trained toy streams (default 64: 4x its 16-frame training window)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from streamkv.lab.commands import rollout

    out = Path(args.out)
    if args.video_frames < 8 or args.video_frames % 2:
        raise ValueError(f"--video-frames must be an even number >= 8, got {args.video_frames}")
    parser = argparse.ArgumentParser(prog="streamkv rollout")
    rollout.add_arguments(parser)
    ns = parser.parse_args([
        "--compare", "--chunks", str(args.chunks), "--config", "tiny", "--threads", "1",
        "--json", str(out / "demo.json"), "--plot", str(out / "demo.png"),
    ])
    status = rollout.run(ns)
    if status:
        return status
    return _video(out, args.video_frames)


def _video(out, frames: int) -> int:
    from streamkv.lab.commands._common import console as make_console
    from streamkv.lab.commands._common import write_json
    from streamkv.lab.env import threads
    from streamkv.lab.video.demo import video_demo

    console = make_console()
    with threads(1), console.status("") as status:
        result = video_demo(out, frames=frames, progress=lambda what: status.update(f"toy video: streaming {what}"))
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


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
