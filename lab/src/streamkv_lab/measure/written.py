"""Bytes written: a ``TorchDispatchMode`` that adds up what every aten op writes, telling the
cache's own storage from temporaries (both devices)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from torch import Tensor

__all__ = ["WrittenBytes", "count_written_bytes"]


@dataclass(frozen=True)
class WrittenBytes:
    """Bytes written by the aten ops of one call, by destination.

    ``cache``: into the given K/V storages (through any view or dtype); ``temporary``:
    into other floating-point tensors (clones, scratch); ``metadata``: into other
    integer/bool tensors (slot tables, positions); ``by_op``: all of it per aten op.
    """

    cache: int
    temporary: int
    metadata: int
    by_op: dict[str, int]

    @property
    def total(self) -> int:
        return self.cache + self.temporary + self.metadata

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


# ops that write only part of their mutated argument: (argument holding what is written)
_PARTIAL_WRITES = {"index_copy_": 3, "index_copy": 3, "index_put_": 2, "index_put": 2, "_index_put_impl_": 2}


def count_written_bytes(fn: Callable[[], None], cache_tensors: Iterable[Tensor]) -> WrittenBytes:
    """Run ``fn`` once and count the bytes each aten op writes.

    Rules: a view op writes nothing; an op that mutates an argument writes that
    argument's bytes (``copy_`` into a slice: the slice), except the indexed writes
    (``index_copy_``, ``index_put_``) which write their source's bytes; any other op
    writes its outputs. A write lands in ``cache`` when its destination shares storage
    with one of ``cache_tensors``. Reads are not counted: every byte written here was
    read once (from the source chunk, or from the retained rows), so memory traffic is
    at least twice the total.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    storages = {t.untyped_storage().data_ptr() for t in cache_tensors}
    counts = {"cache": 0, "temporary": 0, "metadata": 0}
    by_op: dict[str, int] = {}

    def add(op: str, dest: Tensor, nbytes: int) -> None:
        if nbytes == 0:
            return
        if dest.untyped_storage().data_ptr() in storages:
            kind = "cache"  # whatever dtype the write sees it as (the ring writes through an int64 view)
        elif not (dest.is_floating_point() or dest.is_complex()):
            kind = "metadata"
        else:
            kind = "temporary"
        counts[kind] += nbytes
        by_op[op] = by_op.get(op, 0) + nbytes

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if getattr(func, "is_view", False):
                return out
            name = func.overloadpacket.__name__
            schema = func._schema
            mutated = []
            for i, a in enumerate(schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    val = kwargs.get(a.name) if a.kwarg_only or a.name in kwargs else (args[i] if i < len(args) else None)
                    if isinstance(val, Tensor):
                        mutated.append(val)
            if mutated:
                if name in _PARTIAL_WRITES and len(args) > _PARTIAL_WRITES[name]:
                    src = args[_PARTIAL_WRITES[name]]
                    add(name, mutated[0], src.numel() * src.element_size())
                else:
                    for t in mutated:
                        add(name, t, t.numel() * t.element_size())
            else:
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, Tensor):
                        add(name, t, t.numel() * t.element_size())
            return out

    with Counter():
        fn()
    return WrittenBytes(by_op=by_op, **counts)
