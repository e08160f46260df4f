"""Shared CLI helpers: JSON output, the console, the toy weights' check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | Path | None, payload: dict[str, Any]) -> None:
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")


def console():
    """A rich console; 120 columns when output is not a terminal (logs, CI), so tables fit."""
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=120)


def toy_weights_horizon(weights: str | Path | None = None, flag: str = "--weights") -> int:
    """The training window recorded in the toy video model's weights (``None``: the packaged
    weights); a missing or unreadable file is a :class:`~streamkv_lab.errors.UsageError` naming
    it, raised before any work."""
    from safetensors import SafetensorError

    from streamkv_lab.errors import UsageError
    from streamkv_lab.video.toy import WEIGHTS, training_horizon

    path = Path(weights) if weights is not None else WEIGHTS
    if not path.is_file():
        if weights is None:
            raise UsageError(f"no toy weights at {path}: they live in the source repository "
                             f"(lab/src/streamkv_lab/video/weights/, not in the wheel); run from a clone, pass {flag}, "
                             f"or run streamkv train-toy to produce them")
        raise UsageError(f"{flag} {path}: no such file (streamkv train-toy writes the weights)")
    try:
        return training_horizon(path)
    except ValueError as exc:  # the file does not record its training window (the message names it)
        raise UsageError(f"{flag}: {exc}") from None
    except (SafetensorError, OSError) as exc:  # not a safetensors file, or not readable
        raise UsageError(f"{flag} {path}: not a readable safetensors file ({type(exc).__name__}: {exc})") from None
