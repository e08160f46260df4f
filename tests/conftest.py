"""Shared test helpers."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from streamkv.bench.peers import load_block_kv_cache
from streamkv.caches import KVCache

# The suite is made of many tiny ops; one intra-op thread avoids thread-pool contention
# (on a busy 2-core machine it is several times faster and changes no result).
torch.set_num_threads(1)


def snapshot(obj: Any) -> dict[str, Any]:
    """Every attribute of a cache (tensors cloned, with their data_ptr), recursively
    through nested caches: what "left exactly as it was" compares."""
    out: dict[str, Any] = {}
    for name, value in sorted(vars(obj).items()):
        if isinstance(value, torch.Tensor):
            out[name] = ("tensor", value.data_ptr(), value.detach().clone())
        elif isinstance(value, KVCache):
            out[name] = ("cache", snapshot(value))
        elif isinstance(value, dict) and value and all(isinstance(v, KVCache) for v in value.values()):
            out[name] = ("caches", {k: snapshot(v) for k, v in value.items()})
        else:
            out[name] = ("value", copy.deepcopy(value))
    return out


def assert_same_state(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before.keys() == after.keys()
    for name in before:
        kind, *a = before[name]
        kind2, *b = after[name]
        assert kind == kind2, name
        if kind == "tensor":
            assert a[0] == b[0], f"{name}: data_ptr changed"
            assert torch.equal(a[1], b[1]) or (a[1].isnan().any() and torch.equal(a[1].nan_to_num(), b[1].nan_to_num())), f"{name} changed"
        elif kind == "cache":
            assert_same_state(a[0], b[0])
        elif kind == "caches":
            assert a[0].keys() == b[0].keys()
            for k in a[0]:
                assert_same_state(a[0][k], b[0][k])
        else:
            assert a[0] == b[0], f"{name}: {a[0]!r} -> {b[0]!r}"


@pytest.fixture(scope="session")
def BlockKVCache() -> type:
    cls = load_block_kv_cache()
    if cls is None:
        pytest.fail("flashdreams 0.1.0 is a test dependency (make test installs it with --no-deps)")
    return cls
