"""The ``streamkv`` command: thin subcommands over the library (no logic here).

Each subcommand is a module of :mod:`streamkv.lab.commands` with ``add_arguments(parser)``
and ``run(args)``; the modules import torch and the library only inside ``run``, so
``streamkv --help`` is instant. Errors go to stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

#: subcommand -> (module in streamkv.lab.commands, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "the main job: a streaming rollout comparing the caches (table + plot)"),
    "verify": ("verify", "storage experiment: caches vs a whole-history reference on a layout grid"),
    "rollout": ("rollout", "streaming rollout of the causal DiT on one cache, or all of them compared"),
    "bench": ("bench", "benchmark: cache maintenance, bytes moved, transient memory, scaling vs window"),
    "pareto": ("pareto", "mass budget vs fixed window: tau bound, Pareto, sink sweep, tail, falsifiers"),
    "certify": ("certify", "certified streaming attention: per-query bound on evicted mass and error, recall"),
    "budget": ("budget", "the streaming mass-budget cache vs window, H2O and the oracle: error vs memory, holdout"),
    "fuzz": ("fuzz", "differential fuzzer: random layouts and calls, rejected calls change nothing, reads exact"),
    "train-toy": ("train_toy", "train the toy streaming video DiT on procedural clips (CPU); write its weights"),
    "video-eval": ("video_eval", "cache policies judged on the trained toy's video memory: frames, tracking, "
                   "re-entry, revisit, attention, oracle"),
    "quant": ("quant", "quantised KV storage (int8 / fp8 / int4 / int2) on SmolLM2 and the toy video model, beside "
              "transformers' QuantizedCache and sglang's QVG cache, at matched device bytes"),
    "lm-eval": ("lm_eval", "caches on a real trained LM (SmolLM2-135M, Moby-Dick): perplexity and attention error at "
                "matched KV memory vs the full cache and the per-query oracle"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamkv",
        description="KV caches for streaming generators (video diffusion, LLMs): the ring, scored policies, certified recall, and the lab that measures them.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(f"streamkv.lab.commands.{module}").add_arguments(p)
    return parser


#: options that count something, and their smallest sensible value (checked before any work)
COUNTS = {"chunks": 1, "dit_chunks": 1, "synthetic_frames": 1, "threads": 1, "nproc": 1, "repeats": 1,
          "scaling_repeats": 1, "every": 1, "block_tokens": 1, "pool_events": 1, "recall_slots": 1,
          "max_blocks": 1, "dit_window_frames": 1, "layouts": 1, "steps": 1}
#: options naming an output file, and options naming an output folder
OUTPUT_FILES, OUTPUT_DIRS = ("json", "plot"), ("out",)


def check_args(args: argparse.Namespace) -> None:
    """Fail before any work: counts below their minimum, output paths that cannot be written,
    a CUDA device on a machine without one. Raises ``ValueError`` / ``RuntimeError`` (exit 2)."""
    for name, minimum in COUNTS.items():
        value = getattr(args, name, None)
        if value is not None and value < minimum:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")
    for name in OUTPUT_FILES + OUTPUT_DIRS:
        value = getattr(args, name, None)
        if value is not None:
            _check_writable(f"--{name}", Path(value), folder=name in OUTPUT_DIRS)
    device = getattr(args, "device", None)
    if isinstance(device, str) and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {device}: this torch build or machine has no CUDA device; use --device cpu")


def _check_writable(flag: str, path: Path, folder: bool) -> None:
    if path.exists() and (path.is_dir() != folder):
        raise ValueError(f"{flag} {path}: is {'a file' if folder else 'a folder'}, expected {'a folder' if folder else 'a file'}")
    ancestor = path if folder else path.parent
    while not ancestor.exists():
        if ancestor.parent == ancestor:
            break
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise OSError(f"{flag} {path}: cannot write there ({ancestor} is not a writable folder)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
        module = importlib.import_module(f"streamkv.lab.commands.{args._module}")
        return int(module.run(args) or 0)
    except (ValueError, TypeError, RuntimeError, OSError) as exc:
        print(f"streamkv {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
