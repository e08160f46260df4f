"""Slot policies: which slots a span takes and which tokens leave.

:data:`POLICIES` is the one list of cache kinds: the named cache classes, the CLI, the tests,
the fuzzer and the lab experiments all iterate it (each policy's ``example_params`` say how to
build an example). Adding a policy: one file in this package and one line below
(``docs/ARCHITECTURE.md``, "How to add a policy").
"""

from __future__ import annotations

import inspect
import re
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
    "TOVA", "KNorm", "KeyDiff", "SnapKV", "POLICIES", "CACHE_KEYWORDS", "make_policy", "example_policy",
]

#: Policy classes by the name configs, the CLI and state dicts use: the one list of kinds.
POLICIES: dict[str, type[SlotPolicy]] = {
    cls.name: cls for cls in (Ring, Chronological, MassBudget, H2O, TOVA, KNorm, KeyDiff, SnapKV)
}


#: The keywords a cache constructor takes itself (:class:`~streamkv.caches.KVCache`'s, filled in by
#: :mod:`streamkv.caches` from its signature): a cache hands every other keyword to its policy, so
#: :func:`make_policy` names both lists when the policy refuses one.
CACHE_KEYWORDS: list[str] = []


def make_policy(kind: str | SlotPolicy | type[SlotPolicy], **params: Any) -> SlotPolicy:
    """A fresh policy from a name, a class or a prototype instance (copied with its
    parameters); ``params`` are the constructor arguments (``tau=0.05``, ``budget=96``).

    Raises:
        ValueError: an unknown kind name.
        TypeError: not a policy; a parameter the policy does not take (the message names what it
            takes and what the cache takes) or a required one missing (named with its meaning,
            from the policy's docstring, and its example value, ``example_params``); a
            parameter of the wrong type (the policy's own message).
    """
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
        inspect.signature(kind).bind(**params)
    except TypeError:
        raise TypeError(_parameter_error(kind, params)) from None
    try:
        return kind(**params)
    except TypeError as exc:
        raise TypeError(f"{kind.__name__}: {exc}") from None


def _parameter_error(cls: type[SlotPolicy], params: dict[str, Any]) -> str:
    """What is wrong with ``params`` for ``cls``'s constructor, and what it takes."""
    sig = inspect.signature(cls).parameters.values()
    takes = [p.name for p in sig if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    who = f"policy {getattr(cls, 'name', cls.__name__)!r} ({cls.__name__})"
    unknown = sorted(set(params) - set(takes))
    if unknown:
        cache = f"; a cache takes {CACHE_KEYWORDS}" if CACHE_KEYWORDS else ""
        return (f"{who} takes {takes if takes else 'no parameters'}, got {unknown}: a cache hands every keyword "
                f"it does not take itself to its policy{cache}")
    missing = [p.name for p in sig if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               and p.name not in params]
    needs = []
    for name in missing:
        doc = re.search(rf"^\s+{name}(?:, \w+)*: (.+?)\.?$", cls.__doc__ or "", re.M)
        example = cls.example_params.get(name)
        needs.append(name + (f" ({doc.group(1)})" if doc else "") + ("" if example is None else
                                                                       f", e.g. {name}={example!r}"))
    return f"{who} needs {'; '.join(needs)}: pass it to the cache (or CacheSet / build_cache) as a keyword"


def example_policy(name: str, **overrides: Any) -> dict[str, Any]:
    """The constructor parameters of kind ``name``'s example (``example_params``), updated by
    ``overrides`` (e.g. a budget that fits a test's layout)."""
    return {**POLICIES[name].example_params, **overrides}
