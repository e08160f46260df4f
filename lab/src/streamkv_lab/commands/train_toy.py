"""``streamkv train-toy``: train the toy streaming video DiT on procedural clips (CPU) and write
its weights (safetensors), the record of the run (JSON: command, seed, loss curve, wall time)
and the expectation of the check rollout that the tests compare against."""

from __future__ import annotations

import argparse


#: --out names the weights file (the CLI checks it can be written as a file, not a folder)
OUTPUT_FILES = ("out",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from streamkv_lab.video.config import TrainConfig

    d = TrainConfig()
    p.add_argument("--seed", type=int, default=d.seed, help=f"weights, clips and noise seed (default {d.seed})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    p.add_argument("--batch", type=int, default=d.batch, help=f"clips per step (default {d.batch})")
    p.add_argument("--frames", type=int, default=d.frames, help=f"training window in frames (default {d.frames})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr})")
    p.add_argument("--sprite-weight", type=float, default=d.sprite_weight,
                   help=f"loss weight of sprite pixels (default {d.sprite_weight:g}; 1 = plain MSE)")
    p.add_argument("--threads", type=int, default=d.threads,
                   help=f"torch threads (default {d.threads}: fastest on a shared 2-core machine; at most 2)")
    p.add_argument("--out", default=None, help="weights path (default: the packaged streamkv_lab/video/weights/toy.safetensors)")


def check(args: argparse.Namespace):
    """Every bound before any work (:class:`~streamkv_lab.errors.UsageError`): the settings
    (:class:`TrainConfig`), the threads, the training window against the toy model's chunk and
    horizon, the output path. Returns the :class:`TrainConfig`."""
    from pathlib import Path

    from streamkv_lab.errors import UsageError, usage_errors
    from streamkv_lab.video.config import TrainConfig
    from streamkv_lab.video.toy import toy_config

    if not 1 <= args.threads <= 2:
        raise UsageError(f"--threads must be 1 or 2 (the machine is shared), got {args.threads}")
    if not 0 < args.lr < 1:  # nan too
        raise UsageError(f"--lr must be in the open interval (0, 1), got {args.lr}")
    if not args.sprite_weight >= 1:
        raise UsageError(f"--sprite-weight must be >= 1 (1: plain MSE), got {args.sprite_weight}")
    with usage_errors():  # TrainConfig names the setting it refuses
        cfg = TrainConfig(seed=args.seed, steps=args.steps, batch=args.batch, frames=args.frames, lr=args.lr,
                          sprite_weight=args.sprite_weight, threads=args.threads)
    model = toy_config()
    if cfg.frames % model.frames_per_chunk or not model.frames_per_chunk <= cfg.frames <= model.max_frames:
        raise UsageError(f"--frames must be a multiple of the toy model's {model.frames_per_chunk}-frame chunk, at "
                         f"most its {model.max_frames}-frame horizon, got {cfg.frames}")
    if args.out and Path(args.out).suffix != ".safetensors":
        raise UsageError(f"--out must end in .safetensors, got {args.out}")
    return cfg


def run(args: argparse.Namespace) -> int:
    import shlex
    import sys
    from pathlib import Path

    from safetensors.torch import save_file

    from streamkv_lab.commands._common import console as make_console
    from streamkv_lab.commands._common import write_json
    from streamkv_lab.commands._rollout_report import progress_bar
    from streamkv_lab.env import environment
    from streamkv_lab.video.toy import WEIGHTS, check_rollout, save_model
    from streamkv_lab.video.train import train

    cfg = check(args)
    weights = Path(args.out) if args.out else WEIGHTS
    console = make_console()
    with progress_bar(console) as progress:
        task = progress.add_task("training", total=cfg.steps)

        def tick(step: int, loss: float) -> None:
            progress.update(task, advance=1, description=f"training (loss {loss:.4f})")

        result = train(cfg, tick)
    import torch

    with torch.no_grad():
        before = torch.get_num_threads()
        torch.set_num_threads(cfg.threads)
        try:
            expected = check_rollout(result.model)
        finally:
            torch.set_num_threads(before)
    record = {
        "command": "streamkv train-toy " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 1
        else "streamkv train-toy",
        "seed": cfg.seed, "model_config": result.model.cfg.to_dict(), **result.record(),
        "check_rollout": {"file": weights.with_name(weights.stem + "_expected.safetensors").name,
                          "abs_mean": float(expected.abs().mean())},
        "versions": environment("cpu"),
    }
    save_model(result.model, weights, {"seed": cfg.seed, "steps": cfg.steps, "frames": cfg.frames,
                                        "wall_s": result.wall_s})
    save_file({"latents": expected.contiguous()}, str(weights.with_name(weights.stem + "_expected.safetensors")))
    write_json(weights.with_suffix(".json"), record)
    console.print(f"trained {cfg.steps} steps in {result.wall_s:.0f} s; loss {record['loss_first']:.4f} -> "
                  f"{record['loss_final_mean_last_5pct']:.4f} (mean of the last 5%)")
    console.print(f"wrote {weights}, {weights.with_suffix('.json')} and the check rollout's expectation")
    return 0
