"""The cache kinds the lab compares, derived from :data:`streamkv.policies.POLICIES` (the one
list of kinds) when a command runs, so that ``--help`` stays torch-free and a new policy reaches
every experiment with no edit here.

``window`` is a lab baseline, not a kind: the ring without sinks. The chronological path holds
the ring's tokens (the same attention), so comparisons of what a cache keeps list the ring only.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["WINDOW", "policies", "scored_kinds", "evicting_kinds", "compared_kinds", "check_kinds", "kind_params"]

WINDOW = "window"


def policies() -> dict[str, type]:
    from streamkv.policies import POLICIES

    return POLICIES


def scored_kinds() -> tuple[str, ...]:
    """Per-head kinds (scored at commit), in registry order."""
    return tuple(k for k, p in policies().items() if p.per_head)


def evicting_kinds() -> tuple[str, ...]:
    """Every kind (each evicts once its slots are full)."""
    return tuple(policies())


def compared_kinds() -> tuple[str, ...]:
    """What an experiment of what caches keep compares at matched memory: the window baseline,
    the ring, and every scored kind."""
    return (WINDOW, "ring", *scored_kinds())


def check_kinds(kinds: tuple[str, ...] | None, allowed: tuple[str, ...], what: str = "kinds") -> tuple[str, ...]:
    """``kinds`` (None: every allowed one) checked against ``allowed``; ``ValueError`` names the bad ones."""
    if kinds is None:
        return allowed
    bad = [k for k in kinds if k not in allowed]
    if bad or not kinds:
        raise ValueError(f"{what} must be among {list(allowed)}, got {list(kinds)}")
    return tuple(kinds)


def kind_params(kind: str, **knobs: Any) -> dict[str, Any]:
    """Constructor parameters of ``kind`` from the experiment's knobs (``tau=``, ``budget=``, ...):
    the knobs the policy's constructor takes, else its ``example_params`` for what it requires."""
    cls = policies()[kind]
    sig = inspect.signature(cls.__init__).parameters
    out = {k: v for k, v in knobs.items() if k in sig and v is not None}
    for name, p in sig.items():
        if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD and name != "self":
            out.setdefault(name, cls.example_params[name])
    return out
