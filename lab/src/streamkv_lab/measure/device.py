"""Which device a measurement runs on, and waiting for it."""

from __future__ import annotations


import torch

__all__ = ["check_device", "sync"]


def check_device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device``; ``ValueError`` if it is neither CPU nor an available CUDA device."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} requested but CUDA is not available in this torch build/machine")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device must be cpu or cuda, got {str(device)!r}")
    return dev


def sync(device: torch.device) -> None:
    """Wait for queued work on ``device`` (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
