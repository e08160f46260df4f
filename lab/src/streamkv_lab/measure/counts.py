"""Counts of what a call dispatches, at the dispatcher: torch ops, host-device
synchronisations, allocations (a ``TorchDispatchMode``; both devices). Unlike times, these do
not vary with machine noise.

Rules (per aten op the mode sees, i.e. after autograd and composite decompositions):

``ops``
    every op, views included (``views``: those whose schema says they alias their input, e.g.
    ``select``, ``narrow``, ``expand``); ``kernels = ops - views``.
``host_syncs``
    an op whose result the host must wait for: tagged ``data_dependent_output``
    (``_local_scalar_dense``, i.e. ``.item()``, ``int(t)``, ``bool(t)`` and every tensor truth
    test; ``equal``; ``allclose``) or ``dynamic_output_shape`` (``nonzero``, ``masked_select``,
    ``unique``, ``repeat_interleave``), ``index`` / ``index_put_`` with a boolean mask (a
    ``nonzero`` inside the kernel), a copy from a non-CPU device to the CPU, and
    ``Tensor.tolist()`` / ``Tensor.numpy()`` of a tensor on the measured device (on CUDA they
    appear as the device-to-host copy instead; on a CPU run they are counted where the same
    code on a GPU would wait). ``syncs`` names them.
``allocations`` / ``alloc_bytes``
    outputs whose storage is none of the op's inputs' (a new tensor: a clone, a temporary, a
    factory op), and ``torch.tensor(...)`` (``lift_fresh``), with their storage bytes; ``allocs``
    lists bytes per op. What the dispatcher cannot see: scratch inside a kernel and the 0-dim
    tensor a Python scalar is wrapped in before dispatch; the allocator-level instrument
    (:func:`~streamkv_lab.measure.probe_transient`) sees those.
``host_to_device``
    copies from the CPU to another device (``torch.tensor(..., device=)``, ``.to(device)``).

:func:`count_dispatch` counts one call; :func:`count_compiled` runs one call of a compiled
function (a dispatch mode would turn compilation off) and reports what the compiler captured:
graphs, recompilations, graph breaks, and the ops and synchronising ops of the captured graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["DispatchCounts", "count_dispatch", "CompiledCounts", "count_compiled", "is_sync_op"]

_BOOL_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl", "_index_put_impl_"}
_COPIES = {"_to_copy", "copy_", "_copy_from", "_copy_from_and_resize"}
_FRESH_FROM_HOST = {"lift_fresh", "lift_fresh_copy"}


@dataclass(frozen=True)
class DispatchCounts:
    """What one call dispatched (module docstring)."""

    ops: int
    views: int
    host_syncs: int
    allocations: int
    alloc_bytes: int
    host_to_device: int
    by_op: dict[str, int] = field(default_factory=dict)
    syncs: dict[str, int] = field(default_factory=dict)
    allocs: dict[str, int] = field(default_factory=dict)

    @property
    def kernels(self) -> int:
        return self.ops - self.views

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kernels": self.kernels}


def _tensors(x: Any) -> Iterable[Tensor]:
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _storage_ptr(t: Tensor) -> int | None:
    if t.device.type == "meta" or t.layout != torch.strided:
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def is_sync_op(func: Any, args: tuple = (), kwargs: dict | None = None) -> bool:
    """Whether the host waits for the device on this aten op (rules in the module docstring)."""
    name = func.overloadpacket.__name__
    tags = getattr(func, "tags", ())
    if name in _BOOL_INDEXED:
        idx = args[1] if len(args) > 1 else (kwargs or {}).get("indices", ())
        return any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(idx))
    if torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags:
        return True
    if name in _COPIES:
        return _is_device_to_host(name, args, kwargs or {})
    return False


def _is_device_to_host(name: str, args: tuple, kwargs: dict) -> bool:
    if not args or not isinstance(args[0], Tensor):
        return False
    if name == "_to_copy":
        dst = kwargs.get("device")
        return args[0].device.type != "cpu" and dst is not None and torch.device(dst).type == "cpu"
    if name == "copy_" and len(args) > 1 and isinstance(args[1], Tensor):
        return args[1].device.type != "cpu" and args[0].device.type == "cpu"
    return False


def _is_host_to_device(name: str, args: tuple, kwargs: dict) -> bool:
    if not args or not isinstance(args[0], Tensor):
        return False
    if name == "_to_copy":
        dst = kwargs.get("device")
        return args[0].device.type == "cpu" and dst is not None and torch.device(dst).type != "cpu"
    if name == "copy_" and len(args) > 1 and isinstance(args[1], Tensor):
        return args[1].device.type == "cpu" and args[0].device.type != "cpu"
    return False


def count_dispatch(fn: Callable[[], Any], *, device: torch.device | str | None = None,
                   observe: Callable[[str, tuple, dict, Any], None] | None = None) -> DispatchCounts:
    """Run ``fn`` once under a counting ``TorchDispatchMode`` (module docstring). ``device``: the
    device under measurement (default: CPU): ``tolist()`` / ``numpy()`` of its tensors count as
    host syncs where no dispatched copy shows them. ``observe(name, args, kwargs, out)`` is
    called after every op (e.g. to see which tensors an attention kernel read)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    dev = torch.device(device) if device is not None else torch.device("cpu")
    by_op: dict[str, int] = {}
    syncs: dict[str, int] = {}
    allocs: dict[str, int] = {}
    n = {"ops": 0, "views": 0, "syncs": 0, "allocations": 0, "bytes": 0, "h2d": 0}

    def sync(what: str) -> None:
        n["syncs"] += 1
        syncs[what] = syncs.get(what, 0) + 1

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            n["ops"] += 1
            by_op[name] = by_op.get(name, 0) + 1
            if getattr(func, "is_view", False):
                n["views"] += 1
            if is_sync_op(func, args, kwargs):
                sync(name)
            if name in _COPIES and _is_host_to_device(name, args, kwargs):
                n["h2d"] += 1
            inputs = {p for p in (_storage_ptr(t) for t in _tensors((args, kwargs))) if p is not None}
            out = func(*args, **kwargs)
            if name in _FRESH_FROM_HOST:
                inputs = set()  # the tensor torch.tensor() built before dispatch: new memory
            seen = set()
            for t in _tensors(out):
                p = _storage_ptr(t)
                if p is None or p in inputs or p in seen:
                    continue
                seen.add(p)
                nbytes = t.untyped_storage().nbytes()
                if nbytes == 0:
                    continue
                n["allocations"] += 1
                n["bytes"] += nbytes
                allocs[name] = allocs.get(name, 0) + nbytes
            if observe is not None:
                observe(name, args, kwargs, out)
            return out

    originals = {}

    def patched(attr: str) -> Callable[..., Any]:
        base = getattr(torch.Tensor, attr)

        def method(self: Tensor, *a: Any, **kw: Any) -> Any:
            if dev.type == "cpu" and self.device.type == "cpu":  # on a GPU the copy to the host is dispatched
                sync(attr)
            return base(self, *a, **kw)

        return method

    for attr in ("tolist", "numpy"):
        originals[attr] = torch.Tensor.__dict__.get(attr)
        setattr(torch.Tensor, attr, patched(attr))
    try:
        with Counter():
            fn()
    finally:
        for attr, orig in originals.items():
            if orig is None:
                delattr(torch.Tensor, attr)
            else:
                setattr(torch.Tensor, attr, orig)
    return DispatchCounts(
        ops=n["ops"], views=n["views"], host_syncs=n["syncs"], allocations=n["allocations"], alloc_bytes=n["bytes"],
        host_to_device=n["h2d"], by_op=by_op, syncs=syncs, allocs=allocs,
    )


# ----------------------------------------------------------------- compiled
@dataclass(frozen=True)
class CompiledCounts:
    """What ``torch.compile`` captured for a function called over several steady chunks.

    ``graphs``: graphs compiled (warm-up included); ``recompiles``: graphs compiled after the
    warm-up call (0: no host value became a guard); ``graph_breaks``; ``graph_ops``: aten ops
    of the last captured graph (after functionalisation, before the backend's fusion: an upper
    bound on what it launches) and ``graph_syncs``: those of them that synchronise
    (:func:`is_sync_op` rules, by target); ``by_op``: the graph's ops by name.
    """

    graphs: int
    recompiles: int
    graph_breaks: int
    graph_ops: int
    graph_syncs: int
    by_op: dict[str, int] = field(default_factory=dict)
    backend: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Recorder:
    """A ``torch.compile`` backend that keeps the aten graph it is handed, then compiles it
    with the wrapped backend (inductor by default)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.graphs: list[Any] = []

    def __call__(self, gm: Any, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd

        if self.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx, compile_fx_inner

            def inner(graph: Any, inputs: list[Any], **kw: Any) -> Any:
                self.graphs.append(graph)
                return compile_fx_inner(graph, inputs, **kw)

            return compile_fx(gm, example_inputs, inner_compile=inner)

        def keep(graph: Any, inputs: list[Any]) -> Callable[..., Any]:
            self.graphs.append(graph)
            return graph.forward

        return aot_autograd(fw_compiler=keep)(gm, example_inputs)


def count_compiled(fn: Callable[..., Any], calls: Iterable[Callable[[Callable[..., Any]], Any]], *,
                   backend: str = "inductor") -> tuple[Callable[..., Any], CompiledCounts]:
    """Compile ``fn`` (``fullgraph=True``: a graph break raises) and drive it through ``calls``:
    each is handed the compiled function and calls it (e.g. begin a chunk eagerly, call it,
    commit). The first call is the warm-up. Returns the compiled function and its counts.
    ``backend``: ``"inductor"`` or ``"aot_eager"`` (the same graph, run op by op)."""
    import contextlib

    import torch._dynamo

    rec = _Recorder(backend)
    compiled = torch.compile(fn, backend=rec, fullgraph=True)
    calls = list(calls)
    if not calls:
        raise ValueError("count_compiled needs at least one call")
    counters = torch._dynamo.utils.counters
    breaks0 = sum(counters["graph_break"].values())
    with contextlib.ExitStack() as stack:  # compile afresh: a cache hit would hand the recorder no graph
        try:
            import torch._functorch.config as functorch_config
            import torch._inductor.config as inductor_config

            stack.enter_context(inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False))
            stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
        except (ImportError, AttributeError, RuntimeError):  # a torch without these switches: counts may be empty
            pass
        unique0 = counters["stats"]["unique_graphs"]
        calls[0](compiled)
        warm = counters["stats"]["unique_graphs"] - unique0
        for call in calls[1:]:
            call(compiled)
        frames = counters["stats"]["unique_graphs"] - unique0
    graph = rec.graphs[-1] if rec.graphs else None
    by_op: dict[str, int] = {}
    syncs = 0
    if graph is not None:
        for node in graph.graph.nodes:
            if node.op != "call_function" or not hasattr(node.target, "overloadpacket"):
                continue
            name = node.target.overloadpacket.__name__
            by_op[name] = by_op.get(name, 0) + 1
            tags = getattr(node.target, "tags", ())
            if torch.Tag.data_dependent_output in tags or (
                    torch.Tag.dynamic_output_shape in tags and name not in _BOOL_INDEXED):
                syncs += 1
    return compiled, CompiledCounts(
        graphs=frames, recompiles=frames - warm,
        graph_breaks=sum(torch._dynamo.utils.counters["graph_break"].values()) - breaks0,
        graph_ops=sum(by_op.values()), graph_syncs=syncs, by_op=by_op, backend=backend,
    )
