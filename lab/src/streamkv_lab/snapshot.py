"""The full state of a cache, for "a rejected call changes nothing" checks (tests and the fuzzer).

:func:`snapshot` walks every attribute of a cache or cache set, recursively through every
streamkv object it reaches (its storage, its policy, its observers such as a certifier and its
summaries, nested caches), cloning every tensor and recording its ``data_ptr``;
:func:`same_state` compares two snapshots (tensor data, addresses and dtypes; host values;
foreign objects by identity). A cache's memo of its reads (``Reads._memo``: derived views) is left out.
``same_state(a, b, addresses=False)`` compares the state of two different objects (a cache and
its ``copy.deepcopy`` twin that ran the same calls): data, shapes, dtypes and host values, not
buffer addresses nor the identity of functions and foreign objects.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["snapshot", "same_state", "assert_same_state"]


def snapshot(obj: Any, _seen: set[int] | None = None) -> dict[str, Any]:
    """Every attribute of ``obj``, recursively (see the module docstring)."""
    seen = set() if _seen is None else _seen
    seen.add(id(obj))
    return {name: _snap(value, seen) for name, value in sorted(vars(obj).items()) if name != "_memo"}


_ATOMS = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def _snap(value: Any, seen: set[int]) -> Any:
    if isinstance(value, _ATOMS):
        return ("value", value)  # immutable: no copy needed
    if isinstance(value, torch.Tensor):
        return ("tensor", value.data_ptr(), value.detach().clone())
    if type(value).__module__.startswith("streamkv") and hasattr(value, "__dict__"):
        return ("ref", type(value).__name__) if id(value) in seen else ("obj", snapshot(value, seen))
    if isinstance(value, (list, tuple)):
        return ("seq", type(value).__name__, [_snap(v, seen) for v in value])
    if isinstance(value, dict):
        return ("dict", {k: _snap(v, seen) for k, v in value.items()})
    if callable(value) or hasattr(value, "__dict__"):
        return ("identity", id(value))  # functions and foreign objects: the same one
    return ("value", copy.deepcopy(value))


def same_state(before: Any, after: Any, path: str = "", *, addresses: bool = True) -> str | None:
    """None when the snapshots are equal; else the path of the first difference and what changed.
    ``addresses=False``: ignore ``data_ptr`` and object identity (see the module docstring)."""
    if isinstance(before, dict):
        if not isinstance(after, dict) or before.keys() != after.keys():
            return f"{path}: attributes changed"
        for k in before:
            diff = same_state(before[k], after[k], f"{path}.{k}", addresses=addresses)
            if diff:
                return diff
        return None
    kind, *a = before
    kind2, *b = after
    if kind != kind2:
        return f"{path}: {kind} -> {kind2}"
    if kind == "tensor":
        if addresses and a[0] != b[0]:
            return f"{path}: data_ptr changed"
        x, y = a[1], b[1]
        same = x.shape == y.shape and x.dtype == y.dtype
        if same and x.is_floating_point():
            same = torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())
        elif same:
            same = torch.equal(x, y)
        return None if same else f"{path} changed"
    if kind == "obj":
        return same_state(a[0], b[0], path, addresses=addresses)
    if kind == "seq":
        if a[0] != b[0] or len(a[1]) != len(b[1]):
            return f"{path}: length changed"
        for i, (x, y) in enumerate(zip(a[1], b[1])):
            diff = same_state(x, y, f"{path}[{i}]", addresses=addresses)
            if diff:
                return diff
        return None
    if kind == "dict":
        return same_state(a[0], b[0], path, addresses=addresses)
    if kind == "identity" and not addresses:
        return None
    return None if a == b else f"{path}: {a!r} -> {b!r}"


def assert_same_state(before: Any, after: Any) -> None:
    """Raise ``AssertionError`` naming the first difference between two snapshots."""
    diff = same_state(before, after)
    assert diff is None, diff
