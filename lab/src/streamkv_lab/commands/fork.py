"""``streamkv fork``: one stream, several branches over pages shared copy-on-write. The trained toy
video model continues one shared prefix in several branches (other noise; ``--prompt`` adds
branches under another prompt) side by side (``fork.gif``, ``fork.png``), each checked against a
rollout that never forked, with the bytes each branch adds beside full copies and the fork's time
beside one chunk's attention; ``--memory`` measures the same at a benchmark preset (default
self-forcing): 8 branches one chunk after the fork against 8 full copies and the arithmetic floor,
the fork against one chunk's attention, a forked (paged) read and write against the contiguous
ring's in one interleaved run. Everything goes to ``fork.json`` in ``--out``."""

from __future__ import annotations

import argparse

# kept here so --help needs no torch (streamkv_lab.bench.presets.PRESETS; tested equal)
PRESETS = ("self-forcing", "self-forcing-sink", "lingbot", "small", "krea-realtime-14b", "longlive2", "lingbot-world")
#: the options of each part: given without the part, they are refused
VIDEO_OPTIONS = ("branches", "prompt", "frames", "prefix_frames", "weights", "seed")
MEMORY_OPTIONS = ("preset", "memory_branches", "read_repeats", "attention_repeats")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="out", help="output folder: fork.json, fork.gif, fork.png (default out/)")
    p.add_argument("--branches", type=int, default=4,
                   help="noise branches of the toy video (default 4: the noise as drawn, then 3 other seeds)")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a branch continuing under this prompt with branch 0's noise (repeatable; the toy was "
                        "trained on one prompt: this shows the mechanism, not what prompts mean)")
    p.add_argument("--frames", type=int, default=24, help="frames of each branch's video, prefix included (default 24)")
    p.add_argument("--prefix-frames", type=int, default=None,
                   help="frames of the shared prefix (default: the toy's cache, sinks + window: 8)")
    p.add_argument("--seed", type=int, default=0, help="noise seed of the prefix; branch i re-seeds to seed + i")
    p.add_argument("--weights", default=None, help="the toy's weights (default: the packaged toy weights)")
    p.add_argument("--repeats", type=int, default=20, help="timed forks (and the toy's attention calls; default 20)")
    p.add_argument("--memory", action="store_true",
                   help="also measure at a benchmark preset: memory, fork time, paged read and write")
    p.add_argument("--no-video", action="store_true", help="skip the toy video (with --memory only)")
    p.add_argument("--preset", choices=PRESETS, default="self-forcing", metavar="NAME",
                   help=f"the --memory preset: {', '.join(PRESETS)} (default self-forcing)")
    p.add_argument("--memory-branches", type=int, default=8, help="branches of the --memory fork (default 8)")
    p.add_argument("--read-repeats", type=int, default=20,
                   help="timed rounds of the --memory reads and writes, interleaved (default 20)")
    p.add_argument("--attention-repeats", type=int, default=1,
                   help="timed calls of one chunk's attention at the --memory preset (default 1: 14-22 s each on a "
                        "2-core CPU at self-forcing)")


def check(args: argparse.Namespace) -> None:
    """Every bound and combination before any work (:class:`~streamkv_lab.errors.UsageError`)."""
    from streamkv_lab.commands._common import toy_weights_horizon
    from streamkv_lab.errors import UsageError
    from streamkv_lab.video.config import CONTEXT_FRAMES
    from streamkv_lab.video.toy import toy_config

    given = getattr(args, "_given", set())
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    if not args.memory and (stray := [flag(n) for n in MEMORY_OPTIONS if n in given]):
        raise UsageError(f"{', '.join(stray)}: of the --memory measurement, which this run skips; add --memory")
    if args.no_video:
        if not args.memory:
            raise UsageError("--no-video without --memory runs nothing")
        if stray := [flag(n) for n in VIDEO_OPTIONS if n in given]:
            raise UsageError(f"{', '.join(stray)}: of the toy video, which --no-video skips")
    for name, lo in (("branches", 1), ("memory_branches", 1), ("read_repeats", 1), ("attention_repeats", 1)):
        if getattr(args, name) < lo:
            raise UsageError(f"{flag(name)} must be >= {lo}, got {getattr(args, name)}")
    for name, hi in (("branches", 16), ("memory_branches", 64)):  # a grid of videos; full copies to compare with
        if getattr(args, name) > hi:
            raise UsageError(f"{flag(name)} must be <= {hi}, got {getattr(args, name)}")
    if any(not p.strip() for p in args.prompt):
        raise UsageError("--prompt must be a non-empty text")
    if args.no_video:
        return
    cfg = toy_config()
    fpc, capacity = cfg.frames_per_chunk, cfg.sink_frames + cfg.window_frames
    prefix = capacity if args.prefix_frames is None else args.prefix_frames
    if prefix % fpc or prefix < CONTEXT_FRAMES:
        raise UsageError(f"--prefix-frames must be a multiple of the toy's {fpc}-frame chunk and >= its "
                         f"{CONTEXT_FRAMES} ground-truth context frames, got {prefix}")
    if args.frames % fpc or args.frames <= prefix or args.frames > cfg.max_frames:
        raise UsageError(f"--frames must be a multiple of the {fpc}-frame chunk, past the {prefix}-frame prefix and "
                         f"<= {cfg.max_frames} (the toy's RoPE horizon), got {args.frames}")
    toy_weights_horizon(args.weights)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from streamkv_lab.commands._common import console as make_console
    from streamkv_lab.commands._common import write_json
    from streamkv_lab.env import environment, threads

    check(args)
    out = Path(args.out)
    console = make_console()
    doc: dict = {"argv": ["streamkv", "fork"]}
    if not args.no_video:
        doc["video"] = fork_video_section(args, out, console)
    if args.memory:
        from streamkv_lab.experiments.fork_memory import fork_memory

        with console.status("") as status:
            doc["memory"] = fork_memory(args.preset, branches=args.memory_branches, repeats=args.repeats,
                                        attention_repeats=args.attention_repeats, read_repeats=args.read_repeats,
                                        seed=args.seed, progress=lambda m: status.update(f"{args.preset}: {m}"))
        print_memory(console, doc["memory"])
    doc["versions"] = environment("cpu")
    with threads(None):
        write_json(out / "fork.json", doc)
    console.print(f"wrote {out / 'fork.json'}")
    return 0


def fork_video_section(args: argparse.Namespace, out, console) -> dict:
    """The toy video branches (also run by ``streamkv demo``): printed, and returned for the JSON."""
    from streamkv_lab.env import threads
    from streamkv_lab.video.fork import fork_video
    from streamkv_lab.video.toy import WEIGHTS

    with threads(1), console.status("") as status:
        result = fork_video(out, branches=args.branches, prompts=args.prompt, prefix_frames=args.prefix_frames,
                            frames=args.frames, seed=args.seed, weights=args.weights or WEIGHTS,
                            repeats=args.repeats, progress=lambda m: status.update(f"toy fork: {m}"))
    print_video(console, result)
    return result


def _mb(x: float) -> str:
    return f"{x / 2**20:.2f} MiB" if x >= 2**20 else f"{x / 2**10:.0f} KiB"


def print_video(console, r: dict) -> None:
    c, m, t = r["clip"], r["memory"], r["time"]
    console.print(f"[bold]fork[/]: the toy continues a {c['prefix_frames']}-frame prefix in {len(r['branches'])} "
                  f"branches to {c['frames']} frames; each vs a rollout that never forked: max |diff| "
                  f"{r['max_abs_diff_vs_unforked']:.3g}")
    for i, b in enumerate(r["branches"]):
        console.print(f"  {i}: {b['label'][:26]:<26} adds {_mb(b['bytes_added_one_chunk_after']):>9} one chunk after "
                      f"the fork, {_mb(b['bytes_added_end']):>9} at the end; |vs branch 0| "
                      f"{b['mean_abs_diff_vs_branch0_after_fork']:.3f}")
    one, n1 = m["one_cache_bytes"], len(r["branches"]) + 1
    for when in ("one_chunk_after", "end"):
        x = m[when]
        console.print(f"  pool {when.replace('_', ' ')}: {_mb(x['pool_bytes_in_use'])} = "
                      f"{x['ratio_vs_one_cache']:.2f}x one cache ({_mb(one)}); {n1} full copies: {n1}x")
    console.print(f"  fork of {t['branches_forked']}: {t['fork_s'] * 1e3:.3f} ms; one chunk's attention "
                  f"{t['chunk_attention_s'] * 1e3:.3f} ms ({t['fork_over_attention']:.2f}x: at this size the fork's "
                  f"bookkeeping is not small; --memory measures at a real shape)")
    console.print(f"  wrote {', '.join(r['files'])} ({r['wall_s']:.1f} s)")


def print_memory(console, r: dict) -> None:
    p, m, f, rd, w = r["preset"], r["memory"], r["fork"], r["read"], r["write"]
    B = r["branches"]
    console.print(f"[bold]fork at {p['name']}[/] ({p['k_shape']} {p['dtype']}, chunk {p['chunk_frames']} of "
                  f"{p['sink_frames'] + p['window_frames']} frames, a page = a chunk = {_mb(m['page_bytes'])} K+V)")
    console.print(f"  {B} branches one chunk after the fork: pool {_mb(m['bytes_in_use'])} = "
                  f"{m['ratio_vs_one_cache']:.3f}x one cache ({_mb(m['one_cache_bytes'])}); {B} full copies: "
                  f"{m['full_copies_ratio']:.0f}x; the floor 1 + {B} x chunk/cache = {m['floor_ratio']:.3f}x "
                  f"({'above' if m['floor_above_target'] else 'below'} the {m['target_ratio']}x target: "
                  f"{'met' if m['target_met'] else 'not met'}; each branch stores its own chunk)")
    console.print(f"  fork({B}): {f['median_s'] * 1e3:.3f} ms, {f['bytes_copied_by_fork']} K/V bytes copied; one "
                  f"chunk's attention {f['chunk_attention_s']:.2f} s: {f['fork_over_attention'] * 100:.4f}% "
                  f"(target <= {f['target_share'] * 100:.0f}%: {'met' if f['target_met'] else 'not met'})")
    ms = rd["median_ms"]
    console.print(f"  read ({rd['query_rows']} query rows, interleaved): ring {ms['ring']:.1f} ms, paged unforked "
                  f"{ms['paged_identity']:.1f} ms ({rd['paged_identity_over_ring']:.2f}x), forked branch (table "
                  f"{rd['forked_table']}) {ms['paged_forked']:.1f} ms ({rd['paged_forked_over_ring']:.2f}x; target <= "
                  f"{rd['target_ratio']}x: {'met' if rd['target_met'] else 'not met'}); max |diff| vs the ring "
                  f"{rd['max_abs_diff_vs_ring']:.2g} ({p['dtype']} rounding of another summation order)")
    wm = w["median_ms"]
    console.print(f"  chunk write: ring {wm['ring']:.2f} ms, paged unforked {wm['paged_identity']:.2f} ms, forked "
                  f"branch {wm['paged_forked']:.2f} ms")
    for what, t in (("reads", rd["timing"]), ("writes", w["timing"])):
        share = t["foreign_cpu_share"]
        console.print(f"  {what}: {t['rounds']} rounds, clean samples {t['clean_samples']}, other processes used "
                      f"{'-' if share is None else f'{share:.0%}'} of the CPUs meanwhile"
                      f"{' (contended samples included: read the ratios as noisy)' if any(t['contended_included'].values()) else ''}")
