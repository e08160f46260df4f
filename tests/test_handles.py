"""Reads know their generation, and every ``attend`` option takes effect or is refused: a read
kept across a begin, a commit, a reset or a load is refused (it held an old prefix, or zeros
after a reset, and was attended without complaint); ``key_transform`` without cache-relative
RoPE, a mask of the wrong key count, non-bool flags and bad scales are refused naming the
option, before any torch kernel runs."""

import math

import pytest
import torch

from kinds import KINDS, params
from streamkv import KVCache
from streamkv.attention import attend

S, W, C, H, D = 1, 6, 2, 2, 4


def _cache(kind):
    return KVCache((1, S + W, H, D), (1, S + W, H, D), policy=kind, seq_dim=1, sink=S, window=W, chunk=C,
                   dtype=torch.float64, **params(kind))


def _chunk(cache, c, gen):
    cache.begin_chunk(c)
    k, q = (torch.randn(1, C, H, D, generator=gen, dtype=torch.float64) for _ in range(2))
    read = cache.update(k, k, q)
    attend(q, read)
    return read, q


def _forked_ring(gen):
    """A paged float64 ring with three chunks committed, and its one branch."""
    root = KVCache((1, S + W, H, D), (1, S + W, H, D), policy="ring", seq_dim=1, sink=S, window=W, chunk=C,
                   dtype=torch.float64, pages={"spare": 4})
    for c in range(3):
        _chunk(root, c, gen)
        root.commit_chunk(c)
    (branch,) = root.fork()
    return root, branch


_ACCESSORS = {"keys": lambda r: r.keys, "values": lambda r: r.values, "bias": lambda r: r.bias(),
              "causal_bias": lambda r: r.causal_bias(torch.arange(C)), "stored": lambda r: r.stored(),
              "segments": lambda r: r.segments()}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("change", ["commit", "begin", "reset", "load"])
def test_a_read_from_an_earlier_generation_is_refused(kind, change):
    gen = torch.Generator().manual_seed(0)
    cache = _cache(kind)
    for c in range(3):
        _chunk(cache, c, gen)
        cache.commit_chunk(c)
    state = cache.state_dict()
    read, q = _chunk(cache, 3, gen)
    {"commit": lambda: cache.commit_chunk(3),
     "begin": lambda: (cache.commit_chunk(3), cache.begin_chunk(4)),
     "reset": cache.reset,
     "load": lambda: cache.load_state_dict(state)}[change]()
    with pytest.raises(ValueError, match="was read before the cache's last begin, commit, reset, load or rewind"):
        attend(q, read)
    for name, get in _ACCESSORS.items():  # every accessor of what the read holds, not only attend
        with pytest.raises(ValueError, match="was read before"):
            get(read)
    if change == "reset":  # a fresh read of the empty cache is refused for its own reason
        with pytest.raises(ValueError, match="holds no token yet"):
            attend(q, cache.read())


def test_a_read_stays_valid_across_writes_and_queries_of_its_span():
    gen = torch.Generator().manual_seed(1)
    cache = _cache("tova")
    read, q = _chunk(cache, 0, gen)
    k = torch.randn(1, C, H, D, dtype=torch.float64)
    cache.write(k, k)  # a denoising step rewrites the span: same generation
    cache.observe_queries(q)
    out, _ = attend(q, read)
    assert torch.equal(out, attend(q, cache.read())[0])


def test_options_that_would_be_ignored_or_fail_inside_torch_are_refused():
    gen = torch.Generator().manual_seed(2)
    cache = _cache("ring")
    for c in range(5):
        _chunk(cache, c, gen)
        cache.commit_chunk(c)
    read, q = _chunk(cache, 5, gen)
    n = cache.num_valid
    with pytest.raises(ValueError, match="key_transform is applied only with rope_mode='cache_relative'"):
        attend(q, read, key_transform=lambda k: k)
    with pytest.raises(ValueError, match=r"attn_mask \(2, 3\) must broadcast to the scores over the chronological keys"):
        attend(q, read, attn_mask=torch.ones(C, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask must be bool or floating point"):
        attend(q, read, attn_mask=torch.ones(C, n, dtype=torch.long))
    with pytest.raises(TypeError, match="attn_mask must be a Tensor"):
        attend(q, read, attn_mask=[[True] * n] * C)
    with pytest.raises(TypeError, match="causal and return_lse must be bools"):
        attend(q, read, causal=1)
    for bad, exc in ((math.nan, ValueError), (0.0, ValueError), (-1, ValueError), (True, TypeError)):
        with pytest.raises(exc, match="scale"):
            attend(q, read, scale=bad)
    out, info = attend(q, read, attn_mask=torch.ones(C, n, dtype=torch.bool))  # the right count works
    assert info.path == "chronological" and torch.isfinite(out).all()


def test_a_read_or_step_made_before_a_release_is_refused():
    """A released branch's pages go back to the pool (another branch may write them): a read made
    before is refused by every accessor and by attend, a step prepared before refuses to run, and
    every later call is refused; a CacheSet's release is all or nothing."""
    from streamkv import CacheSet

    gen = torch.Generator().manual_seed(3)
    root, branch = _forked_ring(gen)
    read = branch.read(0)
    step = branch.prepare_begin(branch.next_chunk)
    pool = root.storage.store.table.pool
    branch.release()
    q = torch.randn(1, C, H, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="released"):
        attend(q, read)
    for name, get in _ACCESSORS.items():
        with pytest.raises(ValueError, match="released"):
            get(read)
    used = pool.used
    with pytest.raises(RuntimeError, match="released"):
        step.run()
    assert pool.used == used and not branch.is_open
    for call in (lambda: branch.read(0), lambda: branch.num_valid, lambda: branch.report(), branch.state_dict,
                 lambda: branch.rewind_chunks, lambda: branch.fork(), branch.release, branch.occupancy,
                 lambda: branch.check_occupancy("all"), lambda: branch.slot_positions, lambda: branch.write_slots,
                 branch.chronological_positions):
        with pytest.raises(RuntimeError, match="released"):
            call()
    assert "released" in repr(branch)
    del step  # the untaken reservation goes back when the step is dropped
    assert pool.reserved == 0
    cs = CacheSet("ring", k_shape=(1, S + W, H, D), v_shape=(1, S + W, H, D), seq_dim=1, sink=S, window=W, chunk=C,
                  branches=("cond", "uncond"), dtype=torch.float64, pages=True)
    cs["uncond"].release()
    with pytest.raises(RuntimeError, match="branch 'uncond'"):
        cs.release()
    assert not cs["cond"].lifecycle.released  # nothing released by the refused call


def test_a_prepared_step_runs_once_and_only_where_it_was_planned():
    """``prepare_begin`` returns a step: a second run, or a run after another change moved the
    cache, or after a fork shared its pages (its copy on write planned nothing), is refused (nothing
    changes: no page taken twice, no reservation below zero, no write into a branch's pages)."""
    gen = torch.Generator().manual_seed(4)
    root, branch = _forked_ring(gen)
    pool = root.storage.store.table.pool
    step = root.prepare_begin(root.next_chunk)
    step.run()
    used, end = pool.used, root.end
    with pytest.raises(RuntimeError, match="already ran"):
        step.run()
    assert (pool.used, pool.reserved, root.end) == (used, 0, end)
    root.commit_chunk(root.next_chunk - 1)
    planned = root.prepare_begin(root.next_chunk)  # nothing shared now: its copy on write plans nothing
    (other,) = root.fork()  # now every page is shared
    held = other.keys(0).clone()
    with pytest.raises(RuntimeError, match="planned before this cache was forked"):
        planned.run()
    assert not root.is_open
    root.begin_chunk(root.next_chunk)  # planned again: copies on write
    root.write(torch.full((1, C, H, D), 9.0, dtype=torch.float64), torch.full((1, C, H, D), 9.0, dtype=torch.float64))
    assert torch.equal(other.keys(0), held)
    cache = _cache("tova")
    for c in range(4):
        _chunk(cache, c, gen)
        cache.commit_chunk(c)
    stale = cache.prepare_begin(cache.next_chunk)
    _chunk(cache, cache.next_chunk, gen)
    cache.commit_chunk(cache.next_chunk - 1)
    before = cache.state_dict()
    with pytest.raises(RuntimeError, match="planned before"):
        stale.run()
    after = cache.state_dict()
    assert all(torch.equal(before[k], after[k]) if isinstance(after[k], torch.Tensor) else before[k] == after[k]
               for k in after)
