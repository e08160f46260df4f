"""Shared test helpers."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from streamkv.lab.bench.peers import load_block_kv_cache

# The suite is made of many tiny ops; one intra-op thread avoids thread-pool contention
# (on a busy 2-core machine it is several times faster and changes no result).
torch.set_num_threads(1)


def snapshot(obj: Any, _seen: set[int] | None = None) -> dict[str, Any]:
    """Every attribute of a cache or cache set, recursively through every streamkv object it
    reaches (its storage, policy, observers such as a certifier and its summaries, nested
    caches), tensors cloned with their ``data_ptr``: what "left exactly as it was" compares.
    A cache's memo of its reads (``_reads``: derived views) is left out."""
    seen = set() if _seen is None else _seen
    seen.add(id(obj))
    return {name: _snap(value, seen) for name, value in sorted(vars(obj).items()) if name != "_reads"}


def _snap(value: Any, seen: set[int]) -> Any:
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


def assert_same_state(before: Any, after: Any, path: str = "") -> None:
    """The two snapshots are equal: same tensors (data and address), same values."""
    if isinstance(before, dict):
        assert isinstance(after, dict) and before.keys() == after.keys(), f"{path}: attributes changed"
        for k in before:
            assert_same_state(before[k], after[k], f"{path}.{k}")
        return
    kind, *a = before
    kind2, *b = after
    assert kind == kind2, f"{path}: {kind} -> {kind2}"
    if kind == "tensor":
        assert a[0] == b[0], f"{path}: data_ptr changed"
        x, y = a[1], b[1]
        same = x.shape == y.shape and x.dtype == y.dtype
        if same and x.is_floating_point():
            same = torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())
        elif same:
            same = torch.equal(x, y)
        assert same, f"{path} changed"
    elif kind == "obj":
        assert_same_state(a[0], b[0], path)
    elif kind == "seq":
        assert a[0] == b[0] and len(a[1]) == len(b[1]), f"{path}: length changed"
        for i, (x, y) in enumerate(zip(a[1], b[1])):
            assert_same_state(x, y, f"{path}[{i}]")
    elif kind == "dict":
        assert_same_state(a[0], b[0], path)
    else:
        assert a == b, f"{path}: {a!r} -> {b!r}"


@pytest.fixture(scope="session")
def BlockKVCache() -> type:
    cls = load_block_kv_cache()
    if cls is None:
        pytest.fail("flashdreams 0.1.0 is a test dependency (make test installs it with --no-deps)")
    return cls
