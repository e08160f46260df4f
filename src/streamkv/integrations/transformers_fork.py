"""Best-of-n continuations of one prompt: :meth:`StreamKVCache.fork
<streamkv.integrations.transformers_cache.StreamKVCache.fork>`.

Prefill the shared prompt once, fork, and let ``generate()`` continue each branch::

    cache = build_cache(model.config, "ring", sink=4, window=1020, chunk=256, pages={"spare": 64})
    model(input_ids=prompt[:, :-1], cache=cache)            # every prompt token but the last
    for branch, seed in zip(cache.fork(4), range(4)):
        torch.manual_seed(seed)
        out = model.generate(prompt, cache=branch, do_sample=True, max_new_tokens=64)

``generate()`` feeds each branch the prompt tokens its cache does not hold yet (the last one), as
it does for any cache given to it. Each branch's K/V pages are the prompt's, shared copy-on-write
(the cache's ``pages=``): a branch takes a page when it first writes into it. Each continuation
is what an unforked cache fed the same tokens computes (and, with a window that holds
everything, what ``generate()`` from scratch computes): ``tests/test_transformers_fork.py``.

The forward that wrote the prompt leaves its span open (the next forward commits it: a scored
policy evicts with this forward's attention); ``fork`` commits it first, as that forward would,
then forks at the chunk boundary. Refused, with nothing changed: an incomplete forward, a span
opened by ``prepare_step`` and not written, a stream that must be reset, a cache without pages or
with observers (a two-tier cache: the certifier's and the tier's state is not forked).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..storage import check_int

if TYPE_CHECKING:
    from .transformers_cache import StreamKVCache

__all__ = ["fork_cache"]


def fork_cache(cache: StreamKVCache, n: int) -> list[StreamKVCache]:
    """``n`` caches continuing ``cache``'s stream (see the module docstring)."""
    from .transformers_cache import StreamKVCache

    n = check_int("n", n, 1)
    kv, L = cache.kv, cache.num_layers
    if cache._stale is not None:
        raise RuntimeError(f"{cache._stale}: call reset() and start the stream again")
    if cache._prepared:
        raise RuntimeError(f"fork({n}): prepare_step opened positions no forward wrote yet; fork after the forward")
    if kv.is_open and cache._written != L:
        raise RuntimeError(f"fork({n}): the last forward wrote {cache._written} of {L} layers (an incomplete span); "
                           f"call reset() and start the stream again")
    if kv.is_open:
        cache._check_attended()
    kv.branches.check_branchable(f"fork({n})", open_span_ok=True)  # pages, observers, released: before the commit below
    if kv.is_open:
        kv.commit()  # what the next forward would do first; then the stream is at a boundary
    return [StreamKVCache(b, config=cache.config, on_attention=cache.on_attention) for b in kv.fork(n)]
