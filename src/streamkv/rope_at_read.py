"""RoPE at read: a cache that stores raw (un-rotated) keys, and rotates keys and queries by a
position map at every read, inside the block-wise attention.

::

    rope = RopeAtRead(Rope1D(64), "cache_relative")              # or FrameRope(model.rope), a PositionMap, a list
    cache = RingCache(k_shape, v_shape, seq_dim=1, sink=4, window=60, chunk=16, rope_at_read=rope)
    read = cache.layer(0).update(k_raw, v, q_raw)                # keys written as they come, un-rotated
    out, info = attend(q_raw, read)                              # queries and keys rotated here

What a read does (:meth:`RopeAtRead.plan`, on the device, no synchronisation):

1. the held slot positions ``[H, S]`` and the open span's positions become units
   (:meth:`~streamkv.rotary.Rotary.units`), the map gives every held key's and every query's
   rotation unit (:mod:`streamkv.positions`), and both are taken relative to the first query's
   (an exact integer shift: RoPE attention depends on differences only, and small offsets keep
   the angles exact -- :mod:`streamkv.rotary`);
2. the queries are rotated once (``Q x D``);
3. the keys are rotated a block of slots at a time as :func:`~streamkv.attention.attend` reads
   them (``KVRead.load``): transient memory is one block's keys and tables, never a rotated copy
   of the history. A read whose keys already need materialising per block (a quantised
   store's ``load``) is loaded first, then rotated.

Where it is exact: every cache kind (per-head positions included: each head's own map), every
occupancy, masks, causal and window masks (by stream position, unchanged), grouped-query
attention (a key head's rotation serves its query heads), the chronological path (the gathered
keys rotated at their positions' map values). Refused, with the reason: a read with no open
span (the queries' positions are unknown), queries of another row count than the open span,
``rope_mode="cache_relative"`` on top (two rotations), a map whose horizon is shorter than the
cache (``block_relative``) or reads as tokens given for frames (:meth:`RopeAtRead.bind`), spans
that split a unit where the horizon would then be too short, a sink that is not whole units
(Wan: frames), a RopeAtRead bound to caches of two sink sizes or devices. A position map is
handed copies of the positions (never the cache's own tensors).

Several maps (``RopeAtRead(rotary, ["absolute", "sliding_sinks"])``) are all evaluated at every
read and one is selected by a device index (:meth:`use`): switching maps, or changing a map's
dynamic parameters, is a device write -- one compiled graph, one captured CUDA graph, for all.

Why one module: the scope of rotation at read (what is rotated where, and its rounding) is stated
here, and the map state -- the maps, the selection, the caches that share them -- is one thing
that ``use``, ``set``, a fork, a state load and the shared-state guard all change or read, and the
:class:`RotationPlan` of every read takes from; split, each part would read the others' fields.
"""

from __future__ import annotations

import gc
import hashlib
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .positions import MapInputs, PositionMap, position_map
from .rotary import Rotary

__all__ = ["RopeAtRead", "RotationPlan", "units_capacity"]


def units_capacity(capacity: int, per_head: bool, tokens_per_unit: int, split_spans: bool = False) -> int:
    """The most distinct units a cache of ``capacity`` slots can hold: any token on a unit of
    its own for per-head caches; for window caches (whole-unit sinks) whole units, plus one
    split at the window's start when ``capacity`` is not whole units or when a span may end
    inside a unit (``split_spans``: a chunk, or a ``begin_tokens`` span, of part of a frame)."""
    if per_head or tokens_per_unit == 1:
        return capacity
    split = capacity % tokens_per_unit or split_spans
    return -(-capacity // tokens_per_unit) + (1 if split else 0)


class RopeAtRead:
    """Raw keys in the cache, rotation by a position map at read (see the module docstring).

    Args:
        rotary: :class:`~streamkv.rotary.Rope1D` or :class:`~streamkv.rotary.FrameRope`.
        maps: a map name of :data:`~streamkv.positions.POSITION_MAPS`, a
            :class:`~streamkv.positions.PositionMap` (:func:`~streamkv.positions.position_map`
            with parameters), or a sequence of them (the first is in use; :meth:`use` switches).
    """

    def __init__(self, rotary: Rotary, maps: str | PositionMap | Sequence[str | PositionMap] = "cache_relative", *,
                 block: int = 16384, rows: int = 2048) -> None:
        for name, val in (("block", block), ("rows", rows)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be an int >= 1, got {val!r}")
        #: slots per key block of the attention (at least; attend's ``block`` if larger), and slots
        #: rotated at a time inside a block (the transient float32 work stays ``rows`` wide)
        self.block, self.rows = block, rows
        if not isinstance(rotary, Rotary):
            raise TypeError(f"rotary must be a streamkv Rotary (Rope1D, FrameRope), got {type(rotary).__name__}")
        seq = [maps] if isinstance(maps, (str, PositionMap)) else list(maps)
        if not seq:
            raise ValueError("RopeAtRead needs at least one position map")
        self.maps = [position_map(m) for m in seq]
        names = [m.name if m.name != "custom" else f"custom{i}" for i, m in enumerate(self.maps)]
        if len(set(names)) != len(names):
            raise ValueError(f"the maps of one RopeAtRead must differ, got {names}")
        for m in self.maps:  # a map's dynamic parameters are stream state: one RopeAtRead holds them
            other = m.holder
            if other is not None:
                raise ValueError(f"position map {m.name!r} is already held by another RopeAtRead, whose streams would "
                                 f"share its parameters (a set on one would rotate the other's keys): pass map.copy() "
                                 f"or build a new map")
        self.names = names
        self.rotary = rotary
        self._device_rotary: Rotary | None = None
        self.device: torch.device | None = None
        self.sink_units: int | None = None
        self._selected = torch.zeros((), dtype=torch.long)
        self._host_selected = 0
        self._initial: dict[str, Any] | None = None
        #: the caches built on this RopeAtRead (a CacheSet's branches share one): their map state is one
        self._holders: weakref.WeakSet = weakref.WeakSet()
        for m in self.maps:
            m.holder = self

    # ------------------------------------------------------------------ binding
    def bind(self, *, sink: int, capacity: int, per_head: bool, head_dim_size: int, device: torch.device,
             chunk: int | None = None) -> None:
        """Check a cache and bind to its device (caches call this at construction).

        ``capacity``: the cache's slots; ``per_head``: its heads may hold different positions
        (or it has recall slots); ``chunk``: its chunk in tokens (None: not checked here; the
        open span's alignment is then checked at every read, see :meth:`plan`).

        Horizons (``block_relative``) are in units, as every map parameter is: tokens for
        :class:`~streamkv.rotary.Rope1D`, latent frames for :class:`~streamkv.rotary.FrameRope`.
        A frame count cannot be told from a token count in general; what is refused is a
        horizon of ``tokens_per_unit`` times the frames a window cache can hold, or more: that is
        what a horizon given in tokens for this cache looks like, and a frame horizon that large
        (the cache holding less than ``1 / tokens_per_unit`` of the model's frame range) is not a
        configuration any published rule uses.

        Raises:
            ValueError: the cache's feature size is not the rotary's ``head_dim``; a sink that is
                not whole units; a map with a horizon (``block_relative``) on a chunk that is not
                whole units (a window could then hold one unit more than the horizon counts); a
                map whose horizon is shorter than the cache, or reads as tokens (above); another
                device or sink than a cache this RopeAtRead already serves.
        """
        tpu = self.rotary.tokens_per_unit
        if head_dim_size != self.rotary.head_dim:
            raise ValueError(f"the cache's keys have {head_dim_size} features and the rotary rotates "
                             f"{self.rotary.head_dim}: build the rotary for this head size")
        if sink % tpu:
            raise ValueError(f"sink={sink} tokens is not a whole number of position-map units ({tpu} tokens each, "
                             f"e.g. latent frames): the sinks' units would be split")
        for m in self.maps:
            m.check_capacity(units_capacity(capacity, per_head, tpu), tpu, window=not per_head)
        if chunk is not None and chunk % tpu:
            self._check_split_spans(f"chunk={chunk} tokens is not a whole number of position-map units", capacity,
                                    per_head)
        probe = device.type == "meta"  # a probe (CacheSet validates on meta first): checks only, any device
        if self.device is not None and ((self.device != device and not probe) or self.sink_units != sink // tpu):
            raise ValueError(f"this RopeAtRead serves caches on {self.device} with sink {self.sink_units} units; a "
                             f"cache on {device if not probe else self.device} with sink {sink // tpu} units needs its "
                             f"own")
        if probe:
            return
        if self.device is None:
            for m in self.maps:
                m.bind(device)
            self._selected = self._selected.to(device)
            self._device_rotary = self.rotary.to(device)
            self.device, self.sink_units = device, sink // tpu
            self._initial = self.state()  # what a reset returns to

    def hold(self, cache: Any) -> None:
        """Record ``cache`` as one that reads with this RopeAtRead (see :meth:`check_change`)."""
        self._holders.add(cache)

    def check_change(self, changing: Sequence[Any], state: dict[str, Any] | None, what: str) -> None:
        """Raise ``ValueError`` where ``what`` on the caches ``changing`` would set this RopeAtRead's
        state to ``state`` (None: as built), another than it holds, while a cache outside them
        reads with it too (a branch of the same CacheSet, say): its rotation would change under
        it. Changes nothing."""
        if (self._initial if state is None else state) == self.state():
            return
        if self._others(changing):  # a cache dropped by its user may wait for the cycle collector: not a
            gc.collect()  # reader (no reference to it is held here while collecting)
        others = len(self._others(changing))
        if others:
            raise ValueError(
                f"{what} would set the position map state of a RopeAtRead that {others} other cache(s) read "
                f"with (the branches of one CacheSet share one): their rotation would change too; act on every "
                f"cache that shares it (the whole set), or give each stream its own RopeAtRead (rope.fork())")

    def _others(self, changing: Sequence[Any]) -> list[Any]:
        return [c for c in self._holders if not any(c is x for x in changing) and not c.lifecycle.released
                and c.device.type != "meta"]

    def use(self, map_name: str | int) -> None:
        """Select the map in use by name or index (a device write: recompiles nothing, captured
        graphs read it on replay). Raises ``ValueError`` for a map this RopeAtRead does not hold."""
        if isinstance(map_name, int) and not isinstance(map_name, bool):
            idx = map_name
        elif map_name in self.names:
            idx = self.names.index(map_name)
        else:
            raise ValueError(f"this RopeAtRead holds the maps {self.names}, not {map_name!r}")
        if not 0 <= idx < len(self.maps):
            raise ValueError(f"map index must be in [0, {len(self.maps)}), got {idx}")
        self._selected.fill_(idx)
        self._host_selected = idx

    def fork(self) -> RopeAtRead:
        """A copy for a branch of a stream (:meth:`~streamkv.caches.KVCache.fork`): the same rotary
        and maps, the map in use and the dynamic parameters as they stand, held in tensors of its
        own (a :meth:`use` or a ``set`` on one leaves the other as it was: the map state is per
        stream), bound to the same device and sink."""
        out = object.__new__(RopeAtRead)
        out.__dict__.update(self.__dict__)
        out.maps = [m.copy() for m in self.maps]
        for m in out.maps:
            m.holder = out
        out._selected = self._selected.clone()
        out._holders = weakref.WeakSet()
        return out

    def state(self) -> dict[str, Any]:
        """The stream's rotation state, for state dicts: the map in use and every map's dynamic
        parameters as set (host values; :meth:`config` is what identifies the rotation)."""
        return {"map": self.names[self._host_selected],
                "params": {name: m.settings for name, m in zip(self.names, self.maps)}}

    def check_state(self, state: Any) -> None:
        """Raise ``ValueError`` unless ``state`` (from :meth:`state`) is one this RopeAtRead can take:
        a map it holds, and for each map exactly its dynamic parameters, each accepted by the map's
        own check (:meth:`~streamkv.positions.PositionMap.set`). Changes nothing."""
        if not isinstance(state, dict) or set(state) != {"map", "params"}:
            raise ValueError(f"state dict rope_state must be a dict of 'map' and 'params', got {state!r}")
        if state["map"] not in self.names:
            raise ValueError(f"state dict rope_state uses map {state['map']!r}; this cache's RopeAtRead holds "
                             f"{self.names}")
        params = state["params"]
        if not isinstance(params, dict) or set(params) != set(self.names):
            got = sorted(params) if isinstance(params, dict) else type(params).__name__
            raise ValueError(f"state dict rope_state params must name the maps {self.names}, got {got}")
        for name, m in zip(self.names, self.maps):
            values = params[name]
            if not isinstance(values, dict) or set(values) != set(m.dynamic):
                raise ValueError(f"state dict rope_state params of map {name!r} must set {sorted(m.dynamic)}, "
                                 f"got {values!r}")
            try:
                m.check_set(**values)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"state dict rope_state params of map {name!r}: {exc}") from None

    def reset(self) -> None:
        """Back to the map in use and the dynamic parameters at the first cache's construction
        (a cache's :meth:`~streamkv.caches.KVCache.reset` starts a new stream: a cut or a map
        switch of the old one does not carry over; caches that share this RopeAtRead reset together,
        as a CacheSet's do)."""
        if self._initial is not None:
            self.load_state(self._initial)

    def load_state(self, state: dict[str, Any]) -> None:
        """Take a state :meth:`check_state` accepted: every map's dynamic parameters, then the map in use."""
        for name, m in zip(self.names, self.maps):
            m.set(**state["params"][name])
        self.use(state["map"])

    @property
    def current(self) -> PositionMap:
        """The map in use (from the host's record of :meth:`use`)."""
        return self.maps[self._host_selected]

    def map(self, name: str) -> PositionMap:
        """The held map ``name`` (to :meth:`~streamkv.positions.PositionMap.set` its parameters)."""
        if name not in self.names:
            raise ValueError(f"this RopeAtRead holds the maps {self.names}, not {name!r}")
        return self.maps[self.names.index(name)]

    def config(self) -> dict[str, Any]:
        """What identifies the rotation of raw keys, for state dicts: the rotary
        (:meth:`~streamkv.rotary.Rotary.config`) and the maps (names and static parameters; the
        dynamic ones and the map in use are stream state, not part of it). Host values only."""
        maps = []
        for m in self.maps:
            static = tuple(sorted((k, v if k != "fn" else _user_map_identity(v)) for k, v in m.static.items()))
            maps.append((m.name, static))
        return {"rotary": self.rotary.config(), "maps": tuple(maps)}

    def _horizon_maps(self) -> list[PositionMap]:
        """The held maps that count units within a horizon (their rotations are bounded by it)."""
        return [m for m in self.maps if m.static.get("horizon") is not None]

    # ------------------------------------------------------------------ evaluation
    def _inputs(self, positions: Tensor, query_positions: Tensor) -> tuple[MapInputs, Tensor]:
        """The map inputs of a read (held units ``[H, S]``, the span's first unit) and the queries' units."""
        rot = self._device_rotary
        if rot is None:
            raise RuntimeError("RopeAtRead is not bound to a cache (pass it as rope_at_read= to a cache)")
        # the maps see copies: never the cache's own slot positions or the lifecycle's query
        # positions (a map that wrote into its input would otherwise move what the cache holds)
        units = rot.units(_one_row(positions)).clone()
        q_units = rot.units(query_positions).view(1, -1).expand(units.shape[0], -1).clone()
        return MapInputs(units, q_units[:, :1], self.sink_units), q_units

    def _evaluate(self, inp: MapInputs, units: Tensor) -> Tensor:
        """The map in use at ``units [H, N]`` (every map evaluated, one selected by the device index)."""
        vals = [m(inp, units) for m in self.maps]
        if len(vals) == 1:
            return vals[0]
        dt = torch.float64 if any(v.dtype.is_floating_point for v in vals) else torch.long
        return torch.stack([v.to(dt) for v in vals]).index_select(0, self._selected.view(1))[0]

    def rotation_units(self, positions: Tensor, query_positions: Tensor, extra: Tensor | None = None
                       ) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(keys [H, S], queries [H, Q], extra)`` rotation offsets (relative to the first
        query) for held slot ``positions [H, S]`` and the span's ``query_positions [Q]``;
        ``extra`` (positions ``[H, N]``, e.g. the chronological order) mapped alike."""
        inp, q_units = self._inputs(positions, query_positions)
        q_rot = self._evaluate(inp, q_units)
        origin = q_rot[:, :1]
        keys = self._evaluate(inp, inp.held) - origin
        ext = None if extra is None else self._evaluate(inp, self._device_rotary.units(extra)) - origin
        return keys, q_rot - origin, ext

    def plan(self, read: Any) -> RotationPlan:
        """The rotation of one read (a :class:`~streamkv.caches.KVRead`): the map's inputs from
        the slots the read holds, evaluated at any block's positions as it is read."""
        if read.query_positions is None:
            raise ValueError(f"{read.name}: rotation at read needs the queries' positions, and no span is open "
                             f"(begin_chunk / begin_tokens, then update, then attend)")
        self._check_whole_units(read)
        inp, q_units = self._inputs(read.positions, read.query_positions)
        q_rot = self._evaluate(inp, q_units)
        origin = q_rot[:, :1]
        return RotationPlan(self, read, inp, origin, q_rot - origin)


    def _check_split_spans(self, what: str, capacity: int, per_head: bool) -> None:
        """Refuse spans that end inside a unit where a map's horizon counts only the whole-unit
        capacity: a window cache then holds one unit more (the split one at its start)."""
        most = units_capacity(capacity, per_head, self.rotary.tokens_per_unit, split_spans=True)
        for m in self._horizon_maps():
            if m.static["horizon"] < most:
                raise ValueError(
                    f"{what} ({self.rotary.tokens_per_unit} tokens each, e.g. latent frames): a window cache of "
                    f"{capacity} slots whose spans split units holds up to {most} units, and position map {m.name!r} "
                    f"places at most horizon={m.static['horizon']} (a sink would be rotated outside it); write whole "
                    f"units (chunks and spans of a multiple of {self.rotary.tokens_per_unit} tokens) or use "
                    f"horizon >= {most}")

    def _check_whole_units(self, read: Any) -> None:
        """At a read of a window cache whose open span ends inside a unit (``begin_tokens`` of part
        of a frame, or a chunk of part of one): :meth:`_check_split_spans`. Host ints of an eager
        read; a compiled step's reads carry no lifecycle (its spans are the eager steps' before it)."""
        lc = read.lifecycle
        if lc is None or read.num_retained is None or not lc.end % self.rotary.tokens_per_unit:
            return
        self._check_split_spans(f"{read.name}: the open span ends at position {lc.end}, inside a unit",
                                read.positions.shape[-1], per_head=False)


def _user_map_identity(fn: Any) -> str:
    """What identifies a custom map's function in a state dict: its qualified name and its values on
    a fixed probe (two functions of one name, e.g. closures of one factory, that rotate differently
    are told apart: a stream is not continued under another map)."""
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    held = torch.tensor([[0, 1, 5, 6, 9, 12, -1], [0, 2, 3, 8, 10, 11, 13]])
    units, start = torch.tensor([[5, 9, 12], [2, 10, 13]]), torch.tensor([[12], [13]])
    try:
        out = fn(MapInputs(held, start, 1), units).to(torch.float64)
    except Exception as exc:  # noqa: BLE001 - a map that runs only on another device: its name alone
        return f"{name} (not probed on the CPU: {type(exc).__name__})"
    return f"{name} {hashlib.sha256(out.numpy().tobytes()).hexdigest()[:16]}"


def _one_row(positions: Tensor) -> Tensor:
    """``positions [H, N]`` as one row ``[1, N]`` when every head holds the same (a broadcast view:
    window caches), so that maps and tables are evaluated once for all heads."""
    if positions.shape[0] > 1 and positions.stride(0) == 0:
        return positions[:1]
    return positions


class RotationPlan:
    """One read's rotation: queries rotated once, keys a block at a time (the map evaluated at
    each block's positions against the read's held units)."""

    def __init__(self, rope: RopeAtRead, read: Any, inputs: MapInputs, origin: Tensor, query_units: Tensor) -> None:
        self.rope, self.read = rope, read
        self.inputs, self.origin, self.query_units = inputs, origin, query_units

    @property
    def rotary(self) -> Rotary:
        """The rotary on the read's device (its frequency tables there): what a kernel that rotates
        keys in registers reads besides :meth:`key_units`."""
        return self.rope._device_rotary

    def key_units(self, positions: Tensor) -> Tensor:
        """Rotation offsets ``[H, N]`` of keys at ``positions [H, N]`` (``-1``: empty, any value);
        ``[1, N]`` when the read's heads all hold the same positions. The map sees a copy."""
        inputs = self.inputs
        if inputs.held.shape[0] == 1:
            positions = _one_row(positions)
            if positions.shape[0] > 1:  # the heads hold the same, in a tensor of its own per head
                inputs = self._per_head(positions.shape[0])
        return self.rope._evaluate(inputs, self.rope._device_rotary.units(positions).clone()) - self.origin

    def _per_head(self, H: int) -> MapInputs:
        got = getattr(self, "_inputs_h", None)
        if got is None or got.held.shape[0] != H:
            i = self.inputs
            got = self._inputs_h = MapInputs(i.held.expand(H, -1), i.span_start.expand(H, -1), i.sink)
        return got

    def _tables(self, delta: Tensor, positions: Tensor, dtype: torch.dtype, heads_axis: int | None, lead: int,
                groups: int = 1) -> tuple[Tensor, Tensor]:
        """cos/sin ``[H, N, D/2]`` arranged to broadcast against ``[*lead, N, D]`` with heads at
        ``heads_axis`` (repeated ``groups`` times for grouped queries)."""
        cos, sin = self.rope._device_rotary.cos_sin(delta, positions, dtype)
        if groups > 1 and cos.shape[0] > 1:
            cos, sin = cos.repeat_interleave(groups, 0), sin.repeat_interleave(groups, 0)
        shape = [1] * lead + list(cos.shape[-2:])
        if heads_axis is None:
            return cos[0].view(shape), sin[0].view(shape)
        shape[heads_axis] = cos.shape[0]
        return cos.view(shape), sin.view(shape)

    def queries(self, qt: Tensor) -> Tensor:
        """``qt [..., Q, D]`` (attention layout, before grouped-query folding) rotated, in its dtype."""
        read = self.read
        if qt.shape[-2] != self.query_units.shape[-1]:
            raise ValueError(
                f"{read.name}: rotation at read places the queries at the open span's positions: q has "
                f"{qt.shape[-2]} rows and the open span {self.query_units.shape[-1]} (one query per position written)")
        lead = qt.dim() - 2
        hk = self.query_units.shape[0]
        groups = 1 if read.head_axis is None or hk == 1 else qt.shape[read.head_axis] // hk
        qpos = read.query_positions.view(1, -1).expand(hk, -1)
        acc = torch.promote_types(qt.dtype, torch.float32)
        cos, sin = self._tables(self.query_units, qpos, acc, read.head_axis, lead, groups)
        return self.rope.rotary.rotate(qt.to(acc), cos, sin).to(qt.dtype)

    def keys_at(self, kt: Tensor, positions: Tensor) -> Tensor:
        """Keys ``[..., N, D]`` (attention layout) held at ``positions [H, N]``, rotated (same
        dtype). The tables are built once for all heads where they hold the same positions."""
        read = self.read
        acc = torch.promote_types(kt.dtype, torch.float32)
        delta = self.key_units(positions)
        pos = positions[: delta.shape[0]]
        cos, sin = self._tables(delta, pos, acc, read.head_axis, kt.dim() - 2)
        return self.rope.rotary.rotate_as(kt, cos, sin)

    def chronological_keys(self, kt: Tensor, positions: list[int]) -> Tensor:
        """Gathered keys ``[..., L, D]`` (attention layout) at host ``positions`` (chronological
        order, shared by every head), rotated by the same map values as in physical order."""
        read = self.read
        pos = torch.tensor(positions, dtype=torch.long, device=kt.device).view(1, -1)
        pos = pos.expand(read.positions.shape[0], -1)
        acc = torch.promote_types(kt.dtype, torch.float32)
        delta = self.key_units(pos)
        cos, sin = self._tables(delta, pos[: delta.shape[0]], acc, read.head_axis, kt.dim() - 2)
        return self.rope.rotary.rotate_as(kt, cos, sin)
