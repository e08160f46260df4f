"""The checks of scalar arguments, written once: exact integers, finite reals, devices."""

from __future__ import annotations

import math
import operator
from typing import Any

__all__ = ["check_device", "check_int", "check_real"]


def check_int(name: str, value: object, minimum: int | None = None) -> int:
    """``value`` as an exact Python int (numpy and torch integer scalars convert; ``bool``,
    floats and strings are refused with ``TypeError``), at least ``minimum``."""
    if isinstance(value, (bool, float)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if minimum is not None and out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def check_real(name: str, value: object, *, positive: bool = False, minimum: float | None = None,
               maximum: float | None = None) -> float:
    """``value`` as a finite Python float (ints and numpy/torch real scalars convert; ``bool``,
    strings and NaN or infinite values are refused), ``> 0`` with ``positive``, within
    ``[minimum, maximum]`` where given."""
    if isinstance(value, bool) or not hasattr(value, "__float__") or isinstance(value, (str, bytes, complex)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}") from None
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {out}")
    if positive and out <= 0:
        raise ValueError(f"{name} must be > 0, got {out}")
    if minimum is not None and out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    if maximum is not None and out > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {out}")
    return out


def check_device(device: Any) -> Any:
    """``device`` as a ``torch.device``; ``ValueError`` for what is not one, ``RuntimeError`` for
    a CUDA device on a torch build or machine without one (before anything is allocated there:
    torch's own error is an ``AssertionError`` from deep inside an allocation)."""
    import torch

    try:
        out = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a torch device: {exc}") from None
    if out.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {out} was asked for, but this torch build or machine has no CUDA device")
    return out
