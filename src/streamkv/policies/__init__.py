"""Slot policies: which slots a chunk takes and which tokens leave.

=================  =========================================================  ==========
name               what it keeps                                              plan
=================  =========================================================  ==========
``ring``           sinks + the last ``window`` tokens, overwritten in place  shared
``chronological``  the same tokens in position order (the current path)      shared
``mass``           per head, mass >= 1 - tau for the scoring chunk's queries  per head
``h2o``            per head, a budget of accumulated-attention heavy hitters  per head
``tova``           per head, a budget of the newest chunk's favourites       per head
=================  =========================================================  ==========

Adding a policy: subclass :class:`~streamkv.policies.scored.ScoredPolicy` (or
:class:`~streamkv.policies.scored.FixedBudget`), define ``priority`` and ``wanted``, and
register it in :data:`POLICIES` (see ``docs/ARCHITECTURE.md``).
"""

from __future__ import annotations

from typing import Any

from .base import SlotPolicy, Step
from .h2o import H2O
from .mass import MassBudget
from .scored import FixedBudget, ScoredPolicy
from .tova import TOVA
from .window import Chronological, Ring

__all__ = [
    "SlotPolicy", "Step", "ScoredPolicy", "FixedBudget", "Ring", "Chronological", "MassBudget", "H2O", "TOVA",
    "POLICIES", "make_policy",
]

#: Policy classes by the name configs, the CLI and state dicts use.
POLICIES: dict[str, type[SlotPolicy]] = {
    cls.name: cls for cls in (Ring, Chronological, MassBudget, H2O, TOVA)
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
