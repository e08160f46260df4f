"""Shared test helpers."""

from __future__ import annotations


import pytest
import torch

from streamkv_lab.bench.peers import load_block_kv_cache
from streamkv_lab.snapshot import assert_same_state, snapshot  # noqa: F401  (the tests' helpers)

# The suite is made of many tiny ops; one intra-op thread avoids thread-pool contention
# (on a busy 2-core machine it is several times faster and changes no result).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def BlockKVCache() -> type:
    cls = load_block_kv_cache()
    if cls is None:
        pytest.fail("flashdreams 0.1.0 is a test dependency (make test installs it with --no-deps)")
    return cls
