"""``streamkv video-eval``: cache policies judged on the trained toy's video memory: error of
each streamed frame against the full-history rollout, tracking / re-entry / revisit scores from
the ground truth, the model's attention profile and the per-query oracle (JSON and plots)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from streamkv_lab.video.config import EvalConfig

    d = EvalConfig()
    p.add_argument("--clips", type=int, default=d.clips, help=f"held-out clips (default {d.clips})")
    p.add_argument("--frames", type=int, default=d.frames, help=f"frames per stream (default {d.frames})")
    p.add_argument("--capacities", type=int, nargs="+", default=list(d.capacities),
                   help=f"cache memory in frames, sink included (default {' '.join(map(str, d.capacities))})")
    p.add_argument("--tau", type=float, default=d.tau, help=f"mass budget of the 'mass' cache (default {d.tau})")
    p.add_argument("--position-clips", type=int, default=1,
                   help="clips streamed --position-factor x the training window under every position map (0: skip; "
                        "default 1)")
    p.add_argument("--position-factor", type=int, default=d.position_factor,
                   help=f"length of those streams in training windows (default {d.position_factor})")
    p.add_argument("--weights", default=None, help="weights (default: the packaged toy weights)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--json", default="out/video_eval.json", help="result JSON (default out/video_eval.json)")
    p.add_argument("--plot", default="out/video_eval.png", help="plot PNG (default out/video_eval.png)")


def check(args: argparse.Namespace):
    """Every bound before any work (:class:`~streamkv_lab.errors.UsageError`): the weights file (a
    readable safetensors file that records its training window), the settings
    (:class:`EvalConfig`), ``--tau``, the frames against the toy model's horizon, every (kind,
    capacity) geometry, the position streams' length. Returns the :class:`EvalConfig`."""
    import math

    from streamkv_lab.commands._common import toy_weights_horizon
    from streamkv_lab.errors import UsageError, usage_errors
    from streamkv_lab.video.config import CONTEXT_FRAMES, EvalConfig
    from streamkv_lab.video.runs import cache_run_spec
    from streamkv_lab.video.toy import toy_config

    horizon = toy_weights_horizon(args.weights)
    if horizon <= CONTEXT_FRAMES:
        raise UsageError(f"--weights {args.weights or 'the packaged weights'}: trained on {horizon}-frame windows, within "
                         f"the {CONTEXT_FRAMES} context frames: no generated frame falls within the training horizon, "
                         f"where the evaluation compares the caches (train-toy --frames > {CONTEXT_FRAMES})")
    if not (isinstance(args.tau, float) and math.isfinite(args.tau) and 0 < args.tau < 1):
        raise UsageError(f"--tau must be in the open interval (0, 1), got {args.tau}")
    top = toy_config().max_frames
    if args.frames > top:
        raise UsageError(f"--frames must be <= {top} (the toy model's RoPE horizon), got {args.frames}")
    if args.frames % 2 or args.frames <= CONTEXT_FRAMES:
        raise UsageError(f"--frames must be even (2-frame chunks) and > {CONTEXT_FRAMES} (the context frames), got "
                         f"{args.frames}")
    if not args.capacities or any(c < 4 or c % 2 for c in args.capacities):
        raise UsageError(f"--capacities must be even frame counts >= 4 (sinks, the chunk and the next), got "
                         f"{' '.join(map(str, args.capacities))}")
    with usage_errors():  # EvalConfig names the setting it refuses
        cfg = EvalConfig(clips=args.clips, frames=args.frames, capacities=tuple(args.capacities), tau=args.tau,
                         horizon=horizon, position_clips=args.position_clips, position_factor=args.position_factor)
    if "position_factor" in getattr(args, "_given", ()) and not args.position_clips:
        raise UsageError("--position-factor sets the length of the position-map streams: --position-clips 0 runs "
                         "none (leave it out or give clips)")
    if args.position_clips and args.position_factor < 2:
        raise UsageError(f"--position-factor must be >= 2 (the position-map streams run past the training window), "
                         f"got {args.position_factor}")
    if args.position_clips and args.position_factor * horizon > top:
        raise UsageError(f"--position-factor {args.position_factor} x the {horizon}-frame training window passes the "
                         f"toy model's {top}-frame RoPE horizon")
    for capacity in cfg.capacities:
        for kind in cfg.run_kinds():
            with usage_errors(what=f"--capacities {capacity}"):
                cache_run_spec(kind, capacity, tau=cfg.tau)
    return cfg


def run(args: argparse.Namespace) -> int:
    from streamkv_lab.commands._common import console as make_console
    from streamkv_lab.commands._common import write_json
    from streamkv_lab.env import environment, threads
    from streamkv_lab.video.evaluate import evaluate
    from streamkv_lab.video.report import plot_eval, print_eval
    from streamkv_lab.video.toy import WEIGHTS, load_model

    cfg = check(args)
    weights = args.weights or WEIGHTS
    console = make_console()
    model = load_model(weights)
    with threads(args.threads), console.status("") as status:
        result = evaluate(model, cfg, progress=lambda what: status.update(f"streaming {what}"))
    result["weights"] = str(weights)
    result["versions"] = environment("cpu")
    print_eval(console, result)
    write_json(args.json, result)
    plot_eval(result, args.plot)
    console.print(f"wrote {args.json} and {args.plot}")
    return 0
