"""Context parallelism on ``torch.distributed``: Ulysses (head-sharded) attention over
per-rank caches.

- :class:`ContextParallel` — the group (rank, world size, process group) and the
  all-to-all exchanges between token shards and head shards;
- :func:`check_split` — heads and chunk tokens must divide by the world size;
- :func:`launch` — run a function on ``N`` spawned ranks (gloo on CPU, NCCL on CUDA)
  and collect what each returns;
- :func:`compare_context_parallel` — the same rollouts on one process and on ``N``
  ranks: parity and per-rank cache bytes (``streamkv rollout --nproc N``).

``group`` depends on torch only (the model imports it); ``launcher`` and ``compare`` sit
above the rollout and are imported on first use.
"""

from __future__ import annotations

from typing import Any

from .group import ContextParallel, check_split

__all__ = ["ContextParallel", "check_split", "launch", "compare_context_parallel", "CPCompareResult"]

_LAZY = {
    "launch": ".launcher",
    "compare_context_parallel": ".compare",
    "CPCompareResult": ".compare",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
