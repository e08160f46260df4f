"""Position maps: the rotation positions of the keys a cache holds and of the open span's
queries, as a function of the positions held -- evaluated on the device at every read.

A cache that stores **raw (un-rotated) keys** (:class:`~streamkv.rope_at_read.RopeAtRead`)
rotates them at read time; *where* each key and query is rotated is the cache's **position
map**. It sees, per head, the **units** held (``-1``: an empty slot; a unit is a token for an
LLM, a latent frame for Wan's 3D RoPE, whose height/width bands never move) -- the open span
included, since a read follows its write -- and the open span's first unit. It is one function
``rot = fn(inputs, units)`` applied alike to the held keys' units (``[H, S]``) and to the
queries' (``[H, Q]``): the current chunk's keys are rotated exactly where its queries are,
by construction. Every built-in map is a few integer ops (a sort, ``searchsorted``, ``cumsum``,
``where``): no host value, no synchronisation, one trace under ``torch.compile``.

:data:`POSITION_MAPS` is the registry (one entry per published rule, each with its source and a
host reference written independently in plain Python); tests, ``streamkv positions``,
``verify``, the fuzzer and the docs iterate it. ``docs/ARCHITECTURE.md`` and
``shared/reference/position-maps.md`` give the sources in full.

========================  ====================================================================
``absolute``              the stream position: RoPE at write, equal to today's default
``cache_relative``        the rank among the held units (holes closed): the chronological path's
                          cache-relative RoPE, served in physical order
``streaming_llm``         StreamingLLM's "positions within the cache" (arXiv 2309.17453 s3.2):
                          the same rule as ``cache_relative``, kept as its own name
``sliding_sinks``         Rolling Sink's Sliding Indices / LongLive's relative RoPE: sinks keep
                          ``[0, sink)``, the window follows them contiguously, holes kept
``block_relative``        infinity-RoPE's block-relativistic RoPE: ranks within a ``horizon``
                          (refused beyond it), ``anchor="end"`` puts the current chunk at
                          ``[horizon - f, horizon)``, RoPE Cut (``cut``) moves it to ``[cut, cut + f)``
``deep_sink``             Deep Forcing's re-aligned deep sink: sink units ``i`` at
                          ``i + max(0, q0 - first_evict)``, everything else absolute
``custom``                a user function ``fn(inputs, units)``, checked traceable on meta
                          tensors at construction (refused with the reason if not)
========================  ====================================================================

Parameters that change during a stream (the cut of ``block_relative``, the origin of
``cache_relative``) are device tensors (:meth:`PositionMap.set`): changing them, or switching
between the maps of one :class:`~streamkv.rope_at_read.RopeAtRead`, writes a device scalar and
recompiles nothing.

Why one module (and this long): the table of published position rules and their sources is the
registry's documentation, and a map's kind, parameters and state live with it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["MAX_UNIT", "POSITION_MAPS", "MapInputs", "MapKind", "PositionMap", "check_params", "position_map",
           "reference_rotation", "registry_table"]

_BIG = 1 << 62  # stands for "no unit" in sorts (never a real unit: positions are < 2**53)
#: every unit and every map parameter stays below this (positions are < 2**53: exact in float64)
MAX_UNIT = 1 << 53


class MapInputs:
    """What a position map sees, on the device (all int64).

    Attributes:
        held: ``[H, S]`` units held per head (``-1``: empty), the open span included.
        span_start: ``[H, 1]`` the open span's first unit (the first query's).
        sink: sink units (a host int, fixed by the cache's layout).
    Derived (computed once per read, on the device): :meth:`rank`, :meth:`count`,
    :meth:`first_window`.
    """

    def __init__(self, held: Tensor, span_start: Tensor, sink: int) -> None:
        self.held, self.span_start, self.sink = held, span_start, sink
        self._sorted: tuple[Tensor, Tensor] | None = None

    def _dense(self) -> tuple[Tensor, Tensor]:
        if self._sorted is None:
            key = torch.where(self.held >= 0, self.held, torch.full_like(self.held, _BIG))
            s, _ = torch.sort(key, dim=-1)
            new = torch.ones_like(s, dtype=torch.bool)
            new[..., 1:] = s[..., 1:] != s[..., :-1]
            new &= s != _BIG
            before = torch.cat([torch.zeros_like(s[..., :1]), new.long().cumsum(-1)], dim=-1)  # [H, S + 1]
            self._sorted = (s, before)
        return self._sorted

    def rank(self, units: Tensor) -> Tensor:
        """``[H, N]``: the number of distinct held units below each of ``units [H, N]``."""
        s, before = self._dense()
        idx = torch.searchsorted(s, units.contiguous())
        return torch.gather(before, -1, idx)

    def count(self) -> Tensor:
        """``[H, 1]``: distinct units held."""
        return self._dense()[1][..., -1:]

    def first_window(self) -> Tensor:
        """``[H, 1]``: the first held unit at or past the sinks (a huge value if none)."""
        win = torch.where(self.held >= self.sink, self.held, torch.full_like(self.held, _BIG))
        return win.amin(-1, keepdim=True)


MapFn = Callable[[MapInputs, Tensor, Mapping[str, Tensor]], Tensor]


class PositionMap:
    """One position map: ``fn(inputs, units, params) -> rotation units`` (same shape; int64 or
    float64), static parameters fixed at construction, dynamic ones (0-dim int64 device tensors,
    :meth:`set`) and a host reference (:func:`reference_rotation`). Build with
    :func:`position_map`; both it and :meth:`set` check parameters with :func:`check_params`."""

    def __init__(self, kind: MapKind, fn: MapFn, static: Mapping[str, Any], dynamic: Mapping[str, int]) -> None:
        self.kind, self.fn, self.static = kind, fn, dict(static)
        self.dynamic = {k: torch.tensor(int(v), dtype=torch.long) for k, v in dynamic.items()}
        self._host = {k: int(v) for k, v in dynamic.items()}  # the dynamic values as set (no device read)
        self._holder: weakref.ref | None = None

    @property
    def holder(self) -> Any:
        """The :class:`~streamkv.rope_at_read.RopeAtRead` that holds this map (None: none, or it is
        gone): one holds a map, since its dynamic parameters are the state of that one's streams."""
        return None if self._holder is None else self._holder()

    @holder.setter
    def holder(self, rope: Any) -> None:
        self._holder = weakref.ref(rope)

    @property
    def name(self) -> str:
        return self.kind.name

    def bind(self, device: torch.device) -> None:
        """Move the dynamic parameters to ``device`` (once; a map serves one device)."""
        for k, t in self.dynamic.items():
            if t.device != device:
                if t.device.type != "cpu" or getattr(self, "_bound", None) not in (None, device):
                    raise ValueError(f"position map {self.name!r} is bound to {t.device}, not {device}")
                self.dynamic[k] = t.to(device)
        self._bound = device

    def set(self, **values: int) -> None:
        """Change dynamic parameters in place (a device write: no recompilation, captured
        graphs read the new value on replay). ``-1`` switches an optional one off.

        Raises:
            ValueError / TypeError: as :func:`position_map` for the same parameters (the one
                check, :func:`check_params`, with the static ones and the other dynamic values
                as set); nothing changes.
        """
        self.check_set(**values)
        for k, v in values.items():
            self.dynamic[k].fill_(v)
            self._host[k] = v

    def check_set(self, **values: int) -> None:
        """Raise as :meth:`set` would for ``values``; change nothing."""
        unknown = sorted(set(values) - set(self.dynamic))
        if unknown:
            raise ValueError(f"position map {self.name!r} has no dynamic parameter {unknown[0]!r}; it has "
                             f"{sorted(self.dynamic)}")
        check_params(self.kind, {**self.static, **self._host, **values})

    @property
    def settings(self) -> dict[str, int]:
        """The dynamic parameters as last set (host values: no device read)."""
        return dict(self._host)

    def copy(self) -> PositionMap:
        """The same map with dynamic parameters of its own (equal now, on the same device): a
        :meth:`set` on one leaves the other as it was."""
        out = PositionMap(self.kind, self.fn, self.static, self._host)
        out.dynamic = {k: t.clone() for k, t in self.dynamic.items()}
        if hasattr(self, "_bound"):
            out._bound = self._bound
        return out

    def params(self) -> dict[str, Any]:
        """Static and dynamic parameters as host values (synchronises; for reports)."""
        return {**self.static, **{k: int(t) for k, t in self.dynamic.items()}}

    def check_capacity(self, capacity_units: int, tokens_per_unit: int = 1, window: bool = False) -> None:
        """Refuse a cache that can hold more units than this map defines positions for, and
        (``window``: a window cache, whose whole-unit capacity is known) a horizon so large
        against that capacity that it reads as tokens given for units (see
        :meth:`~streamkv.rope_at_read.RopeAtRead.bind`)."""
        horizon = self.static.get("horizon")
        if horizon is None:
            return
        if capacity_units > horizon:
            raise ValueError(
                f"position map {self.name!r} has horizon={horizon} units and this cache can hold {capacity_units}: "
                f"no published rule places a history longer than the horizon (infinity-RoPE rotates at most "
                f"horizon frames); use horizon >= {capacity_units} or a smaller cache")
        if window and tokens_per_unit > 1 and horizon >= tokens_per_unit * capacity_units:
            raise ValueError(
                f"position map {self.name!r} has horizon={horizon}, and horizons are in units: here latent frames of "
                f"{tokens_per_unit} tokens. This cache holds at most {capacity_units} frames "
                f"({tokens_per_unit * capacity_units} tokens), and a horizon of {tokens_per_unit} x that or more "
                f"reads as tokens given for frames (the model's frame range, e.g. {horizon // tokens_per_unit} frames "
                f"if {horizon} meant tokens): give the horizon in frames, {capacity_units} <= horizon < "
                f"{tokens_per_unit * capacity_units}")

    def __call__(self, inputs: MapInputs, units: Tensor) -> Tensor:
        return self.fn(inputs, units, {**self.static, **self.dynamic})

    def __repr__(self) -> str:
        return f"PositionMap({self.name!r}, {self.static})"


# ---------------------------------------------------------------------- the built-in rules
def _absolute(inp: MapInputs, u: Tensor, p: Mapping) -> Tensor:
    return u


def _cache_relative(inp: MapInputs, u: Tensor, p: Mapping) -> Tensor:
    return inp.rank(u) + p["origin"].clamp_min(0)


def _sliding_sinks(inp: MapInputs, u: Tensor, p: Mapping) -> Tensor:
    return torch.where(u < inp.sink, u, inp.sink + (u - inp.first_window()))


def _block_relative(inp: MapInputs, u: Tensor, p: Mapping) -> Tensor:
    r = inp.rank(u)
    if p["anchor"] == "end":
        r = r + (p["horizon"] - inp.count())
    cut = p["cut"]
    moved = cut + (r - inp.rank(inp.span_start))
    return torch.where((cut >= 0) & (u >= inp.span_start), moved, r)


def _deep_sink(inp: MapInputs, u: Tensor, p: Mapping) -> Tensor:
    shift = (inp.span_start - p["first_evict"]).clamp_min(0)
    return torch.where(u < inp.sink, u + shift, u)


# host references: plain Python over one head's held units (a set), written apart from the above
def _ref_rank(held: list[int], u: int) -> int:
    return sum(1 for h in set(held) if h < u)


def _ref_absolute(held, start, sink, p):
    return lambda u: u


def _ref_cache_relative(held, start, sink, p):
    return lambda u: _ref_rank(held, u) + max(p["origin"], 0)


def _ref_sliding_sinks(held, start, sink, p):
    window = sorted(h for h in set(held) if h >= sink)
    return lambda u: u if u < sink else sink + u - window[0]


def _ref_block_relative(held, start, sink, p):
    order = sorted(set(held))
    shift = p["horizon"] - len(order) if p["anchor"] == "end" else 0

    def rot(u):
        r = order.index(u) + shift if u in order else _ref_rank(held, u) + shift
        if p["cut"] >= 0 and u >= start:
            return p["cut"] + r - (_ref_rank(held, start) + shift)
        return r
    return rot


def _ref_deep_sink(held, start, sink, p):
    return lambda u: u + max(0, start - p["first_evict"]) if u < sink else u


def _check_block_relative(p: Mapping[str, Any]) -> None:
    if p["anchor"] not in ("start", "end"):
        raise ValueError(f"block_relative.anchor must be 'start' or 'end', got {p['anchor']!r}")
    if p["anchor"] == "end" and p["cut"] >= 0:
        raise ValueError(f"block_relative: anchor='end' and a RoPE cut (cut={p['cut']}) both place the current chunk; "
                         f"choose one (cut=-1: off)")


@dataclass(frozen=True)
class MapKind:
    """A registry entry: a rule, its source, how to build it and how to check it.

    ``bounded``: on a window cache (ring, chronological) its rotation offsets stay within the
    cache's capacity whatever the stream length (no overflow: the same output 2**40 tokens on).
    On per-head caches ``cache_relative`` / ``block_relative`` stay bounded (ranks) but
    ``sliding_sinks`` does not (a head that keeps an old token stretches its window). ``params``: static parameter -> default
    (None: required); ``dynamic``: device parameter -> default (``-1``: off). Every parameter is
    a unit count (an int in ``[0, 2**53)``, dynamic ones from ``-1``, ``horizon`` from 1) except
    ``not_units``, which ``check`` validates with the rest of the kind's own rules. ``for_geometry(sink, capacity,
    chunk)`` (units) gives the parameters an experiment uses at a cache geometry."""

    name: str
    rule: str
    source: str
    bounded: bool
    fn: MapFn | None
    reference: Callable | None
    params: Mapping[str, Any]
    dynamic: Mapping[str, int]
    for_geometry: Callable[[int, int, int], dict[str, Any]]
    same_as: str | None = None  # an equal rule (tested equal)
    panel: bool = False  # streamed beside the ring in the demo's panel (the long-video rules)
    #: the rules its parameters follow beyond being ints in range (static and dynamic together;
    #: :func:`check_params` runs it for :func:`position_map` and :meth:`PositionMap.set` alike)
    check: Callable[[Mapping[str, Any]], None] | None = None
    #: the static parameters that are not units (ints in ``[lo, 2**53)``): checked by ``check``
    not_units: tuple[str, ...] = ()


POSITION_MAPS: dict[str, MapKind] = {m.name: m for m in (
    MapKind("absolute", "the stream position (RoPE at write; equal to rotating raw keys at read)",
            "Self-Forcing / CausVid / LongLive causal_rope_apply(start_frame=current_start_frame)",
            False, _absolute, _ref_absolute, {}, {}, lambda s, c, f: {}),
    MapKind("cache_relative", "rank among the held units, holes closed; queries follow at ranks n_held..",
            "the chronological path's cache-relative RoPE (flashdreams MemRoPE, LongLive v1 "
            "causal_model_infinity.py arange(num_cache_frames))",
            True, _cache_relative, _ref_cache_relative, {}, {"origin": 0}, lambda s, c, f: {}),
    MapKind("streaming_llm", "positions within the cache, not in the text (= cache_relative)",
            "StreamingLLM, arXiv 2309.17453 s3.2; mit-han-lab/streaming-llm pos_shift/modify_llama.py",
            True, _cache_relative, _ref_cache_relative, {}, {"origin": 0}, lambda s, c, f: {},
            same_as="cache_relative"),
    MapKind("sliding_sinks", "sinks keep [0, sink); the window (and the chunk) at sink + (p - w0), holes kept",
            "Rolling Sink 'Sliding Indices', arXiv 2602.07775 (Rolling-Sink wan/modules/causal_model.py); "
            "LongLive 2.0 use_relative_rope with prepend_sink",
            True, _sliding_sinks, _ref_sliding_sinks, {}, {}, lambda s, c, f: {}, panel=True),
    MapKind("block_relative", "ranks within a horizon of F units (refused beyond it); anchor 'end': the "
            "current chunk at [F - f, F); RoPE Cut: the current chunk at [cut, cut + f)",
            "infinity-RoPE, arXiv 2511.20649 (yesiltepe-hidir/infinity-rope wan/modules/causal_model.py, "
            "rope_cut transition_from=45)",
            True, _block_relative, _ref_block_relative, {"horizon": None, "anchor": "start"}, {"cut": -1},
            lambda s, c, f: {"horizon": c}, panel=True, check=_check_block_relative, not_units=("anchor",)),
    MapKind("deep_sink", "sink unit i at i + max(0, q0 - first_evict); window and chunk absolute",
            "Deep Forcing, arXiv 2512.05081 s4.2 (authors' causal_model_DS.py, commit ea9961a)",
            False, _deep_sink, _ref_deep_sink, {"first_evict": None}, {}, lambda s, c, f: {"first_evict": c}),
    MapKind("custom", "a user function fn(inputs, units) -> rotation units, traceable (checked on meta tensors)",
            "yours", False, None, None, {"fn": None}, {}, lambda s, c, f: {"fn": _example_user_map},
            check=lambda p: _check_user_fn(p["fn"]), not_units=("fn",)),
)}


def _example_user_map(inp: MapInputs, units: Tensor) -> Tensor:
    """The registry's example of a user map: cache ranks at half speed (temporal interpolation,
    LongLive 2.0's ``t_scale`` idea), fractional positions."""
    return inp.rank(units).to(torch.float64) * 0.5


def _check_user_fn(fn: object) -> Callable[[MapInputs, Tensor], Tensor]:
    """Refuse a user map that is not a traceable tensor function: it is run once on meta
    tensors (no data), where any read of a value on the host (``.item()``, ``.tolist()``,
    ``bool(t)``, a Python branch on a tensor) raises; and one that writes into its inputs
    (``units += 3``: a map returns new tensors, its inputs are read-only)."""
    if not callable(fn):
        raise TypeError(f"a custom position map needs fn=callable(inputs, units), got {type(fn).__name__}")
    held = torch.empty(2, 7, dtype=torch.long, device="meta")
    units = torch.empty(2, 3, dtype=torch.long, device="meta")
    start = torch.empty(2, 1, dtype=torch.long, device="meta")
    versions = [t._version for t in (held, units, start)]
    try:
        out = fn(MapInputs(held, start, 1), units)
    except Exception as exc:  # noqa: BLE001 - any failure is the reason for the refusal
        raise ValueError(
            f"the custom position map is not traceable: evaluating it on meta tensors (no values) failed with "
            f"{type(exc).__name__}: {exc} -- a map must be tensor ops on its inputs, evaluated on the device, "
            f"without reading values on the host") from None
    written = [name for name, t, v in zip(("inputs.held", "units", "inputs.span_start"), (held, units, start), versions)
               if t._version != v]
    if written:
        raise ValueError(
            f"the custom position map writes into {written} in place (e.g. units += 3): a map's inputs are read-only "
            f"(they describe what the cache holds); return a new tensor (units + 3)")
    if not isinstance(out, Tensor) or tuple(out.shape) != (2, 3):
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"the custom position map must return a tensor shaped like its units [H, N] = (2, 3), got {got}")
    if out.dtype not in (torch.int64, torch.float64):  # narrower types hold positions only below 2**24 or 2**31
        raise ValueError(f"the custom position map must return int64 or float64 positions, got {out.dtype} "
                         f"(float32 tells 2**24 from 2**24 + 1 apart no more: cast with .to(torch.float64))")
    return fn


def position_map(kind: str | PositionMap, **params: Any) -> PositionMap:
    """The map ``kind`` of :data:`POSITION_MAPS` with ``params`` (static and dynamic).

    Raises:
        ValueError: an unknown kind or parameter, a missing required one, a bad value; a
            ``custom`` map that is not traceable (the reason is in the message).
    """
    if isinstance(kind, PositionMap):
        if params:
            raise ValueError("parameters are given when a map is built, not to an existing PositionMap")
        return kind
    if kind not in POSITION_MAPS:
        raise ValueError(f"unknown position map {kind!r}; choose one of {list(POSITION_MAPS)}")
    mk = POSITION_MAPS[kind]
    unknown = sorted(set(params) - set(mk.params) - set(mk.dynamic))
    if unknown:
        raise ValueError(f"position map {kind!r} takes {sorted({**mk.params, **mk.dynamic})}, got unknown {unknown}")
    static = {k: params.get(k, d) for k, d in mk.params.items()}
    missing = [k for k, v in static.items() if v is None]
    if missing:
        raise ValueError(f"position map {kind!r} needs {missing}")
    dynamic = {k: params.get(k, d) for k, d in mk.dynamic.items()}
    check_params(mk, {**static, **dynamic})
    if mk.fn is None:  # the user's own function (checked by the entry's check)
        user = static["fn"]
        return PositionMap(mk, lambda inp, u, p: user(inp, u), static, dynamic)
    return PositionMap(mk, mk.fn, static, dynamic)


def check_params(mk: MapKind, params: Mapping[str, Any]) -> None:
    """Raise ``TypeError`` / ``ValueError`` unless ``params`` (every static and dynamic
    parameter of ``mk``) are valid: units are ints in ``[lo, 2**53)`` (positions stay below
    2**53; ``lo`` is -1 for dynamic ones, where -1 is off, 1 for ``horizon``, else 0), then the
    kind's own rules (``mk.check``). The one check of :func:`position_map` and
    :meth:`PositionMap.set`."""
    for k, v in params.items():
        if k in mk.not_units:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{mk.name}.{k} must be an int, got {type(v).__name__} {v!r}")
        lo = -1 if k in mk.dynamic else 1 if k == "horizon" else 0
        if not lo <= v < MAX_UNIT:
            off = " (-1: off)" if lo == -1 else ""
            raise ValueError(f"{mk.name}.{k} must be an int >= {lo}{off} and < 2**53 (positions stay below 2**53), "
                             f"got {v}")
    if mk.check is not None:
        mk.check(params)


def reference_rotation(pmap: PositionMap, held: list[int], span_start: int, sink: int) -> Callable[[int], float]:
    """The host reference of ``pmap`` for one head: ``unit -> rotation unit`` given the units
    ``held`` (the open span included) and the span's first unit. Plain Python, written apart
    from the device functions; a ``custom`` map has no independent reference (its own
    function, evaluated in float64 on the CPU, stands in)."""
    p = pmap.params()
    if pmap.kind.reference is None:
        h = torch.tensor([held], dtype=torch.long)
        inp = MapInputs(h, torch.tensor([[span_start]]), sink)
        return lambda u: float(pmap(inp, torch.tensor([[u]], dtype=torch.long))[0, 0])
    return pmap.kind.reference(list(held), span_start, sink, p)


def registry_table() -> str:
    """The registry as a markdown table (the docs embed it between ``<!-- position-maps -->``
    markers; ``tests/test_positions.py`` checks that they match)."""
    rows = ["| map | rule | bounded on a window cache | source |", "|---|---|---|---|"]
    for name, mk in POSITION_MAPS.items():
        same = f" (= `{mk.same_as}`)" if mk.same_as else ""
        rows.append(f"| `{name}`{same} | {mk.rule} | {'yes' if mk.bounded else 'no'} | {mk.source} |")
    return "\n".join(rows)
