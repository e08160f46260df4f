"""``streamkv demo``: the main job — a streaming rollout on the embedded tiny model comparing
every cache (current path, ring, mass budget, H2O), with a progress bar, a table and a plot."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="out", help="output folder for JSON and the plot (default out/)")
    p.add_argument("--chunks", type=int, default=8, help="chunks in the first stream (default 8)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from streamkv.lab.commands import rollout

    out = Path(args.out)
    parser = argparse.ArgumentParser(prog="streamkv rollout")
    rollout.add_arguments(parser)
    ns = parser.parse_args([
        "--compare", "--chunks", str(args.chunks), "--config", "tiny", "--threads", "1",
        "--json", str(out / "demo.json"), "--plot", str(out / "demo.png"),
    ])
    return rollout.run(ns)
