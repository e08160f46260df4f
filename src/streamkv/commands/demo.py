"""``streamkv demo``: the main job (until the rollout lands: the storage experiment)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="out", help="output folder for JSON and plots (default out/)")


def run(args: argparse.Namespace) -> int:
    from . import verify

    ns = argparse.Namespace(dtype="float64", seed=0, json=f"{args.out}/verify.json")
    return verify.run(ns)
