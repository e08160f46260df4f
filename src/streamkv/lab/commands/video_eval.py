"""``streamkv video-eval``: cache policies judged on the trained toy's video memory: error of
each streamed frame against the full-history rollout, tracking / re-entry / revisit scores from
the ground truth, the model's attention profile and the per-query oracle (JSON and plots)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from streamkv.lab.video.config import EvalConfig

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
    """Every bound before any work (``ValueError``): the weights file (a readable safetensors file
    that records its training window), the settings (:class:`EvalConfig`), ``--tau``, the
    frames against the toy model's horizon, every (kind, capacity) geometry. Returns the
    :class:`EvalConfig`."""
    import math

    from streamkv.lab.video.config import EvalConfig
    from streamkv.lab.video.runs import cache_run_spec
    from streamkv.lab.video.toy import WEIGHTS, toy_config

    weights = args.weights or WEIGHTS
    horizon = _horizon(weights)
    cfg = EvalConfig(clips=args.clips, frames=args.frames, capacities=tuple(args.capacities), tau=args.tau,
                     horizon=horizon, position_clips=args.position_clips, position_factor=args.position_factor)
    if not (isinstance(args.tau, float) and math.isfinite(args.tau) and 0 < args.tau < 1):
        raise ValueError(f"--tau must be in the open interval (0, 1), got {args.tau}")
    top = toy_config().max_frames
    if args.frames > top:
        raise ValueError(f"--frames must be <= {top} (the toy model's RoPE horizon), got {args.frames}")
    for capacity in cfg.capacities:
        for kind in cfg.run_kinds():
            cache_run_spec(kind, capacity, tau=cfg.tau)
    return cfg


def _horizon(weights) -> int:
    """The training window recorded in the weights; a bad file is a ``ValueError`` naming it."""
    from pathlib import Path

    from streamkv.lab.video.toy import training_horizon

    path = Path(weights)
    if not path.is_file():
        raise ValueError(f"--weights {path}: no such file (streamkv train-toy writes the weights)")
    try:
        return training_horizon(path)
    except ValueError:
        raise
    except Exception as exc:  # safetensors' own error types: the file is not a safetensors file
        raise ValueError(f"--weights {path}: not a readable safetensors file ({type(exc).__name__}: {exc})") from None


def run(args: argparse.Namespace) -> int:
    from streamkv.lab.commands._common import console as make_console
    from streamkv.lab.commands._common import write_json
    from streamkv.lab.env import environment, threads
    from streamkv.lab.video.evaluate import evaluate
    from streamkv.lab.video.report import plot_eval, print_eval
    from streamkv.lab.video.toy import WEIGHTS, load_model

    weights = args.weights or WEIGHTS
    cfg = check(args)
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
