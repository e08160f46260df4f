"""The ``streamkv`` command: thin subcommands over the library (no logic here).

Each subcommand is a module of :mod:`streamkv.lab.commands` with ``add_arguments(parser)``
and ``run(args)``; the modules import torch and the library only inside ``run``, so
``streamkv --help`` is instant. Errors go to stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: subcommand -> (module in streamkv.lab.commands, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "the main job: a streaming rollout comparing the caches (table + plot)"),
    "verify": ("verify", "storage experiment: caches vs a whole-history reference on a layout grid"),
    "rollout": ("rollout", "streaming rollout of the causal DiT on one cache, or all of them compared"),
    "bench": ("bench", "benchmark: cache maintenance, bytes moved, transient memory, scaling vs window"),
    "pareto": ("pareto", "mass budget vs fixed window: tau bound, Pareto, sink sweep, tail, falsifiers"),
    "certify": ("certify", "certified streaming attention: per-query bound on evicted mass and error, recall"),
    "budget": ("budget", "the streaming mass-budget cache vs window, H2O and the oracle: error vs memory, holdout"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamkv",
        description="KV caches for streaming video diffusion: ring vs the current path, and mass budgets.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(f"streamkv.lab.commands.{module}").add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    module = importlib.import_module(f"streamkv.lab.commands.{args._module}")
    try:
        return int(module.run(args) or 0)
    except (ValueError, TypeError, RuntimeError, OSError) as exc:
        print(f"streamkv {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
