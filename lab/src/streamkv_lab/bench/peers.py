"""Other projects' caches the benchmark compares against, loaded only if installed.

flashdreams 0.1.0's ``BlockKVCache`` lives in ``flashdreams/core/attention/kvcache.py``;
the package's ``__init__`` imports CUDA kernels, so the module is loaded by file path
(it needs only torch and typing_extensions).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

__all__ = ["load_block_kv_cache", "flashdreams_version"]


@functools.cache
def load_block_kv_cache() -> type | None:
    """flashdreams' ``BlockKVCache`` class, or None when flashdreams is not installed
    (or its layout changed and the file is not where 0.1.0 keeps it)."""
    spec = importlib.util.find_spec("flashdreams")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "core" / "attention" / "kvcache.py"
    if not path.is_file():
        return None
    mod_spec = importlib.util.spec_from_file_location("_streamkv_bench_flashdreams_kvcache", path)
    if mod_spec is None or mod_spec.loader is None:
        return None
    module = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(module)
    except ImportError:
        return None
    sys.modules[mod_spec.name] = module  # importable by name: torch.compile traces the class's methods
    return getattr(module, "BlockKVCache", None)


def flashdreams_version() -> str | None:
    """Installed flashdreams version, or None."""
    try:
        return importlib.metadata.version("flashdreams")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def load_sglang_causal_kv_cache() -> type | None:
    """sglang's ``CausalSelfAttentionKVCache`` class, or None when sglang is not installed (or
    its layout changed and the file is not where 0.5.23 keeps it). The package's ``__init__``
    pulls in the whole runtime; the module needs only torch and dataclasses, so it is loaded
    by file path."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = (Path(list(spec.submodule_search_locations)[0]) / "multimodal_gen" / "runtime" / "layers" / "kvcache"
            / "causal_attention_cache.py")
    if not path.is_file():
        return None
    mod_spec = importlib.util.spec_from_file_location("_streamkv_bench_sglang_causal_attention_cache", path)
    if mod_spec is None or mod_spec.loader is None:
        return None
    module = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(module)
    except ImportError:
        return None
    sys.modules[mod_spec.name] = module
    return getattr(module, "CausalSelfAttentionKVCache", None)


def sglang_version() -> str | None:
    """Installed sglang version, or None."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


__all__ += ["load_sglang_causal_kv_cache", "sglang_version"]
