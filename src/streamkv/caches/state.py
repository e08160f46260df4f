"""State dicts of a cache: a snapshot of everything (copies), and a load that validates every
field against the layout arithmetic before anything is copied."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..layout import CacheLayout
from ..policies import SlotPolicy
from ..storage import KVStorage
from ..validate import check_int
from .checks import InputChecks
from .lifecycle import Lifecycle

__all__ = ["StateDicts", "MAX_POSITION"]

#: Positions stay below 2**53: exact in float64 (RoPE angles) and far from int64 overflow.
MAX_POSITION = 2**53
#: what a state's keys are (``config()["key_rotation"]``): as written by the model (rotated at their stream
#: positions, RoPE at write, or never rotated), or raw and rotated at every read by a position map
KEYS_AS_WRITTEN = "as written (RoPE at write, or none: attended as stored)"
KEYS_RAW = "raw (un-rotated: rotated at every read by rope_at_read)"


class StateDicts:
    """``state_dict`` / ``validate`` / ``load`` of one cache."""

    def __init__(self, storage: KVStorage, layout: CacheLayout, lifecycle: Lifecycle, policy: SlotPolicy,
                 checks: InputChecks, rope_at_read: Any = None) -> None:
        self.storage, self.layout, self.lifecycle, self.policy, self.checks = storage, layout, lifecycle, policy, checks
        #: the cache's :class:`~streamkv.rope_at_read.RopeAtRead` (None: keys stored as written)
        self.rope_at_read = rope_at_read

    def config(self) -> dict[str, Any]:
        """What must match for a state dict to load: kind, policy, layout, shapes, dtype, and what
        the stored keys mean: raw (rotated at read: the rotary and the maps that rotate them) or
        as written (RoPE at write, or none). A raw-key state read by a cache that attends its keys
        as stored, or the reverse, or under another rotary or map, would attend wrong keys."""
        st = self.storage
        rope = self.rope_at_read
        return {
            "kind": self.policy.name,
            "layout": (self.layout.sink, self.layout.window, self.layout.chunk),
            "policy": self.policy.params(),
            "k_shape": st.k_shape,
            "v_shape": st.v_shape,
            "seq_dim": st.seq_dim,
            "head_dim": st.head_dim,
            "num_layers": st.num_layers,
            "recall_slots": st.recall_slots,
            "dtype": str(st.dtype),
            "key_rotation": KEYS_AS_WRITTEN if rope is None else KEYS_RAW,
            "rope": None if rope is None else rope.config(),
            **st.store.config(),
        }

    def _tensors(self) -> dict[str, Tensor]:
        st = self.storage
        return {**st.store.state(), "slot_positions": st.positions, "write_slots": st.plan, **self.policy.state()}

    def state_dict(self) -> dict[str, Any]:
        """A snapshot of the cache's whole state: host counters and *copies* of every tensor
        (so a state taken now restores this moment even after the stream moves on).

        Raises ``RuntimeError`` for a cache with recall slots: their contents belong to the
        observer that recalled them, which does not serialise its state; and for a released cache."""
        self.checks.alive("state_dict()")
        if self.storage.recall_slots:
            raise RuntimeError(
                "a cache with recall slots does not save state dicts: they hold tokens an observer recalls "
                "(streamkv.certify), whose summaries and offload store are not serialised"
            )
        lc = self.lifecycle
        return {
            **self.config(),
            "end": lc.end,
            "span": lc.span,
            "open": lc.is_open,
            # the map in use and the maps' dynamic parameters (a cut, an origin): stream state, restored
            # with the stream (config()["rope"] is what identifies the rotation and must match)
            "rope_state": None if self.rope_at_read is None else self.rope_at_read.state(),
            **{name: t.detach().clone() for name, t in self._tensors().items()},
        }

    def load(self, state: dict[str, Any], counters: tuple[int, int, bool]) -> None:
        """Copy a validated ``state`` in (``counters`` from :meth:`validate`); cannot fail."""
        end, span, is_open = counters
        st = self.storage
        st.store.load_state(state)
        meta = {"slot_positions": st.positions, "write_slots": st.plan, **self.policy.state()}
        for name, t in meta.items():
            t.copy_(state[name])
        self.lifecycle.restore(end, span, is_open)
        self.policy.after_load(end, span)
        if self.rope_at_read is not None:
            self.rope_at_read.load_state(state["rope_state"])

    def validate(self, state: dict[str, Any]) -> tuple[int, int, bool]:
        """Raise as ``load_state_dict(state)`` would; else return ``(end, span, open)`` as exact
        Python values. Changes nothing."""
        self.checks.mutable("load_state_dict")
        if self.storage.recall_slots:
            raise RuntimeError("a cache with recall slots does not load state dicts (see state_dict)")
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        _refuse_grad(state, "state dict")
        config = self.config()
        want, got = config.pop("quant", None), state.get("quant")  # absent: full precision
        if got != want:
            raise ValueError(f"state dict stores K/V {_format(got)}, this cache {_format(want)}: a stream loads only "
                             f"into a cache of its storage format")
        for key, want in config.items():
            if key not in state:
                raise ValueError(f"state dict lacks {key!r}")
            got = state[key]
            if isinstance(want, tuple):
                got = tuple(got) if isinstance(got, (tuple, list, torch.Size)) else got
            if got != want:
                raise ValueError(f"state dict {key} must be {want!r} for this cache, got {got!r}")
        for key, buf in self._tensors().items():
            t = state.get(key)
            if not isinstance(t, Tensor) or t.shape != buf.shape or t.dtype != buf.dtype:
                desc = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else repr(type(t).__name__)
                raise ValueError(f"state dict {key} must be a {tuple(buf.shape)} {buf.dtype} tensor, got {desc}")
            if t.layout != torch.strided or t.device.type == "meta":
                raise ValueError(f"state dict {key} must be a dense tensor with data, got layout {t.layout} on {t.device}")
            if self.storage.owns(t):
                raise ValueError(
                    f"state dict {key} shares memory with this cache's own buffers: loading it would read what it "
                    f"overwrites (keep a copy: state_dict() returns copies)"
                )
        for key in ("end", "span", "open"):
            if key not in state:
                raise ValueError(f"state dict lacks {key!r}")
        try:
            end = check_int("end", state["end"], 0)
            span = check_int("span", state["span"], 0)
        except TypeError as exc:
            raise ValueError(f"state dict {exc}") from None
        is_open = state["open"]
        if not isinstance(is_open, bool):
            raise ValueError(f"state dict open must be a bool, got {type(is_open).__name__} {is_open!r}")
        if end > MAX_POSITION:
            raise ValueError(f"state dict end={end} passes position 2**53")
        if span > min(end, self.layout.chunk) or (end and not span) or (is_open and not span):
            raise ValueError(
                f"state dict span={span} is impossible at end={end} (1 <= span <= min(end, chunk={self.layout.chunk}) "
                f"once anything entered the stream)"
            )
        rope = self.rope_at_read
        if rope is None:
            if state.get("rope_state") is not None:
                raise ValueError(f"state dict rope_state must be None for a cache without rope_at_read, got "
                                 f"{state['rope_state']!r}")
        elif "rope_state" not in state:
            raise ValueError("state dict lacks 'rope_state' (the position map in use and its dynamic parameters)")
        else:
            rope.check_state(state["rope_state"])
        self.policy.check_state(state, end, span, is_open)
        self.storage.store.check_state(state, state["slot_positions"], end, span, is_open)
        return end, span, is_open



def _format(quant: dict[str, Any] | None) -> str:
    """A storage format as a state dict records it, in words."""
    if quant is None:
        return "in full precision"
    return "quantised (" + ", ".join(f"{k}={v!r}" for k, v in quant.items()) + ")"


def _refuse_grad(value: Any, where: str) -> None:
    """Refuse a tensor that requires grad anywhere in a state dict (loaded, it would attach the
    cache's buffers to an autograd graph that grows with every write)."""
    if isinstance(value, Tensor):
        if value.requires_grad:
            raise ValueError(f"{where} requires grad: the cache stores values, not an autograd graph (load a "
                             f"detached copy)")
    elif isinstance(value, dict):
        for k, v in value.items():
            _refuse_grad(v, f"{where} {k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _refuse_grad(v, f"{where}[{i}]")
