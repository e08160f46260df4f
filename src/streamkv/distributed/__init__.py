"""Context parallelism on ``torch.distributed``: Ulysses (head-sharded) attention over
per-rank caches.

- :class:`ContextParallel` — the group (rank, world size, process group) and the
  all-to-all exchanges between token shards and head shards;
- :func:`check_split` — heads and chunk tokens must divide by the world size;
- :func:`launch` — run a function on ``N`` spawned ranks (gloo on CPU, NCCL on CUDA)
  and collect what each returns; :func:`init_from_env` — join a group started by
  ``torchrun`` (``env://``).

The comparison of context-parallel rollouts against one process is an experiment
(:mod:`streamkv_lab.experiments.cp_compare`).

Branches: a rank's caches hold its ``H/N`` heads, so ``StreamingRollout.fork`` on every rank
(same arguments, the same noise everywhere) forks each rank's own head shard: each rank's pool
holds its shard's pages, no collective is needed, and the branches equal the single-process
fork's (``tests/test_distributed.py``).
"""

from __future__ import annotations

from typing import Any

from .group import ContextParallel, check_split

__all__ = ["ContextParallel", "check_split", "launch", "init_from_env", "rank_device"]

_LAZY = {"launch": ".launcher", "init_from_env": ".launcher", "rank_device": ".launcher"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
