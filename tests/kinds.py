"""The kinds every test enumerates, derived from the registry (kvpress's ``default_presses``):
a policy added to :data:`streamkv.policies.POLICIES` is picked up by the state machine, the
rejection grid, the read matrix and the reliability tests with no edit here."""

from __future__ import annotations

from typing import Any

from streamkv.certify import Certifier
from streamkv.policies import POLICIES, example_policy

#: every cache kind
KINDS = list(POLICIES)
#: the per-head kinds (scored at commit) and the window kinds
SCORED = [k for k, p in POLICIES.items() if p.per_head]
WINDOW = [k for k, p in POLICIES.items() if not p.per_head]
#: the scored kinds whose scores come from the span's queries
QUERY_SCORED = [k for k in SCORED if POLICIES[k].needs_queries]
#: a kind watched by a certifier with recall slots: one window kind and one scored kind
CERTIFIED = ["certified-ring", "certified-mass"]


def policy_of(kind: str) -> str:
    return kind.removeprefix("certified-")


def params(kind: str, **overrides: Any) -> dict[str, Any]:
    """The example parameters of ``kind`` (a certified variant: of its policy)."""
    return example_policy(policy_of(kind), **overrides)


def certify(cache, kind: str, **options: Any):
    """Watch ``cache`` by a recalling certifier when ``kind`` is a certified variant."""
    if kind.startswith("certified-"):
        return Certifier(cache, **{"recall_tau": 0.2, **options})
    return None
