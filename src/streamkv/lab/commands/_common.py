"""Shared CLI helpers: JSON output, the console."""

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
