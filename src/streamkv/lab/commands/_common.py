"""Shared CLI helpers: JSON output, version records."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any


def versions() -> dict[str, str]:
    import torch

    import streamkv

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or platform.machine()
    return {
        "streamkv": streamkv.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device,
    }


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
