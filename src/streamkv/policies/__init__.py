"""Slot policies: which slots a span takes and which tokens leave.

:data:`POLICIES` is the one list of cache kinds: the named cache classes, the CLI, the tests,
the fuzzer and the lab experiments all iterate it (each policy's ``example_params`` say how to
build an example). Adding a policy: one file in this package and one line below
(``docs/ARCHITECTURE.md``, "How to add a policy").
"""

from __future__ import annotations

from typing import Any

from .base import SlotPolicy, Step
from .h2o import H2O
from .keydiff import KeyDiff
from .knorm import KNorm
from .mass import MassBudget
from .scored import FixedBudget, ScoredPolicy, Scores
from .snapkv import SnapKV
from .tova import TOVA
from .window import Chronological, Ring

__all__ = [
    "SlotPolicy", "Step", "ScoredPolicy", "FixedBudget", "Scores", "Ring", "Chronological", "MassBudget", "H2O",
    "TOVA", "KNorm", "KeyDiff", "SnapKV", "POLICIES", "make_policy", "example_policy",
]

#: Policy classes by the name configs, the CLI and state dicts use: the one list of kinds.
POLICIES: dict[str, type[SlotPolicy]] = {
    cls.name: cls for cls in (Ring, Chronological, MassBudget, H2O, TOVA, KNorm, KeyDiff, SnapKV)
}


def make_policy(kind: str | SlotPolicy | type[SlotPolicy], **params: Any) -> SlotPolicy:
    """A fresh policy from a name, a class or a prototype instance (copied with its
    parameters); ``params`` are the constructor arguments (``tau=0.05``, ``budget=96``)."""
    if isinstance(kind, SlotPolicy):
        if params:
            raise TypeError(f"pass parameters to the policy's constructor, not with an instance: {sorted(params)}")
        return type(kind)(**kind.params())
    if isinstance(kind, str):
        if kind not in POLICIES:
            raise ValueError(f"unknown cache kind {kind!r}; choose one of {sorted(POLICIES)}")
        kind = POLICIES[kind]
    if not (isinstance(kind, type) and issubclass(kind, SlotPolicy)):
        raise TypeError(f"kind must be a policy name, class or instance, got {kind!r}")
    try:
        return kind(**params)
    except TypeError as exc:
        raise TypeError(f"{kind.__name__}: {exc}") from None


def example_policy(name: str, **overrides: Any) -> dict[str, Any]:
    """The constructor parameters of kind ``name``'s example (``example_params``), updated by
    ``overrides`` (e.g. a budget that fits a test's layout)."""
    return {**POLICIES[name].example_params, **overrides}
