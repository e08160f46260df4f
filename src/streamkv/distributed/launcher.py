"""Start ``N`` ranks on this machine and collect what each returns.

``launch(fn, nproc, *args)`` spawns ``nproc`` processes (``torch.multiprocessing``,
start method ``spawn``), initialises a process group in each (``gloo`` for CPU,
``nccl`` for CUDA, rendezvous through a file in a fresh temporary directory, so no
port is needed), calls ``fn(cp, *args)`` with the rank's
:class:`~streamkv.distributed.ContextParallel`, and returns the values in rank order.
An exception in any rank is raised in the caller with that rank's traceback.

``fn`` must be importable by the children (a module-level function). Return values
travel through ``torch.save`` files in the temporary directory, so tensors are fine.

``init_from_env()`` is the other way in: under ``torchrun`` (which sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``) it initialises the
default group through ``env://`` and returns the rank's ``ContextParallel``, so a user who
outgrows one machine runs the same rollout with the launcher they already know.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .group import ContextParallel
from ..validate import check_int

__all__ = ["launch", "init_from_env", "rank_device"]


def init_from_env(device: str = "cpu") -> ContextParallel:
    """Join the process group described by ``torchrun``'s environment (``env://``): gloo for
    ``device="cpu"``, NCCL on ``cuda:LOCAL_RANK`` for ``"cuda"``. Returns this rank's group.

    Raises:
        RuntimeError: the environment of a launcher (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
            ``MASTER_PORT``) is missing.
    """
    import torch.distributed as dist

    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeError(f"init_from_env needs a launcher's environment (torchrun); {missing} not set")
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if kind == "cuda" else "gloo", init_method="env://")
    return ContextParallel.from_group()


def launch(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    device: str = "cpu",
    threads: int | None = None,
) -> list[Any]:
    """Run ``fn(cp, *args)`` on ``nproc`` spawned ranks; returns each rank's result.

    Args:
        fn: a module-level function ``fn(cp: ContextParallel, *args)``.
        nproc: ranks to start (``>= 1``).
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, rank ``r`` on ``cuda:r``; needs
            ``nproc`` visible GPUs). Inside ``fn``, put tensors on
            :func:`rank_device` ``(device, cp)``.
        threads: torch intra-op threads per rank (default: the CPU count split over
            the ranks, at least 1).

    Raises:
        ValueError: bad ``nproc`` / ``device``, or fewer GPUs than ranks.
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback).
    """
    nproc = check_int("nproc", nproc, 1)
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if kind == "cuda":
        have = torch.cuda.device_count()
        if have < nproc:
            raise ValueError(f"nproc ({nproc}) needs one CUDA device per rank; {have} visible")
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // nproc)
    backend = "nccl" if kind == "cuda" else "gloo"
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="streamkv-cp-") as tmp:
        init = Path(tmp) / "rendezvous"
        mp.spawn(_rank_main, args=(nproc, str(init), backend, threads, tmp, fn, args), nprocs=nproc, join=True)
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


def rank_device(device: str, cp: ContextParallel) -> torch.device:
    """The device of rank ``cp.rank``: the CPU, or ``cuda:rank``."""
    return torch.device("cuda", cp.rank) if torch.device(device).type == "cuda" else torch.device("cpu")


def _rank_main(
    rank: int, nproc: int, init: str, backend: str, threads: int, out_dir: str,
    fn: Callable[..., Any], args: tuple[Any, ...],
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=nproc)
    try:
        result = fn(ContextParallel.from_group(), *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
