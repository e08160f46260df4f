"""The named cache kinds, derived from :data:`streamkv.policies.POLICIES` (the one list of
kinds): for every policy ``P`` a class ``PCache`` that is :class:`~streamkv.caches.cache.KVCache`
with ``policy=P`` fixed. They add no behaviour: ``TOVACache(...)`` and
``KVCache(..., policy="tova")`` are the same cache (``.budget`` reads the same on both)."""

from __future__ import annotations

import inspect

from ..policies import CACHE_KEYWORDS, POLICIES
from .cache import KVCache

__all__ = ["CACHE_KINDS", "RingCache", "ChronologicalCache", "MassBudgetCache", "H2OCache", "TOVACache"]


def _named(name: str) -> type[KVCache]:
    policy = POLICIES[name]
    doc = (policy.__doc__ or "").strip().split("\n")[0]
    return type(f"{policy.__name__}Cache", (KVCache,), {
        "kind": name, "__module__": __name__,
        "__doc__": f"{doc} :class:`~streamkv.caches.KVCache` with ``policy={name!r}`` "
                   f"(:class:`~streamkv.policies.{policy.__name__}`).",
    })


# the keywords KVCache takes itself, for the policy layer's messages (every other keyword goes to the policy)
CACHE_KEYWORDS[:] = [p.name for p in inspect.signature(KVCache).parameters.values()
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

#: Cache classes by kind name, one per entry of :data:`~streamkv.policies.POLICIES`.
CACHE_KINDS: dict[str, type[KVCache]] = {name: _named(name) for name in POLICIES}

# the names the README and user code import (every other kind: CACHE_KINDS[name])
RingCache = CACHE_KINDS["ring"]
ChronologicalCache = CACHE_KINDS["chronological"]
MassBudgetCache = CACHE_KINDS["mass"]
H2OCache = CACHE_KINDS["h2o"]
TOVACache = CACHE_KINDS["tova"]
