"""The lab's environment helpers, one per job: thread counts and the record of versions and
machine written with every result."""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Iterator
from typing import Any

__all__ = ["threads", "environment"]


@contextlib.contextmanager
def threads(n: int | None) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(n)`` (unchanged when None), then restore.

    The experiments are thousands of tiny ops: on a small shared CPU, intra-op threads only
    add synchronisation (measured ~100x slower on a loaded 2-core machine), so most run
    under ``threads(1)``."""
    import torch

    if n is None:
        yield
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"threads must be an int >= 1, got {n!r}")
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: Any = None) -> dict[str, Any]:
    """Versions and the machine, recorded with every result (``device``: where it ran;
    default the first CUDA device if there is one, else the CPU)."""
    import torch

    import streamkv
    from streamkv_lab.bench.peers import flashdreams_version

    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        # the vector ISA torch dispatches to: timings differ across it (bfloat16 products are native
        # with AVX512-BF16 or AMX and emulated on an AVX2 machine, several times slower than float32)
        name = f"{_cpu_name()} ({os.cpu_count()} logical CPUs, {torch.backends.cpu.get_cpu_capability()})"
    return {
        "streamkv": streamkv.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "flashdreams": flashdreams_version(),
        "device": str(device),
        "device_name": name,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "platform": platform.platform(),
    }
