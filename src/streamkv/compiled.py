"""The CPU's compiled kernels: when one may run, and how each is compiled.

The read's CPU path fuses its elementwise passes (the decode of codes, the zeroing of hidden rows,
the rotation tables and the rotation, the statistics' reductions) into kernels compiled with
``torch.compile``; the arithmetic is the eager ops', only the passes are fused. A kernel runs
where it pays and where it can: on the CPU, for blocks of at least a module's ``COMPILE_MIN``
elements, outside a trace (the caller's own ``torch.compile`` sees the eager ops) and outside a
Python dispatch mode (an op counter, a debug mode), where a compiled kernel cannot run.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["may_compile", "compile_kernel"]


def may_compile(x: Tensor, elements: int, minimum: int) -> bool:
    """A computation of ``elements`` elements on ``x``'s device may take its compiled kernel (see
    the module docstring)."""
    return (x.device.type == "cpu" and elements >= minimum and not torch.compiler.is_compiling()
            and _get_current_dispatch_mode() is None)


def compile_kernel(fn: Callable[..., Any], name: str) -> Callable[..., Any] | None:
    """``torch.compile(fn, dynamic=True, fullgraph=True)`` with a code object of its own, named
    ``name``: torch.compile keeps its graphs on the code object, so the closures of one ``def``
    (one per codec, dtype or variant) would share one cache of at most ``cache_size_limit``
    graphs, past which a call runs eagerly, or raises under ``fullgraph``. None where torch
    cannot compile here (the caller runs the eager ops)."""
    fn = types.FunctionType(fn.__code__.replace(co_name=name, co_qualname=name), fn.__globals__, name,
                            fn.__defaults__, fn.__closure__)
    try:
        return torch.compile(fn, dynamic=True, fullgraph=True)
    except Exception:  # noqa: BLE001 - no compiler on this machine
        return None
