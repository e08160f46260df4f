"""``StreamingRollout.fork``: every branch of a forked rollout equals a rollout that never forked,
fed the same prefix, then the branch's noise and prompt (float64, every kind of the registry, CFG
on); the parent stays one more branch; the refusals change nothing."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

from conftest import assert_same_state, snapshot
from kinds import KINDS, params
from streamkv.models import CausalVideoDiT, get_config
from streamkv.rollout import StreamingRollout

CFG = get_config("tiny")
PREFIX, AFTER = 4, 3  # chunks before the fork (past the first eviction: chunk 3) and after it
PAGES = {"spare": 16}
TOL = 1e-12


@pytest.fixture(scope="module")
def model():
    return CausalVideoDiT(CFG, seed=0).double().eval()


def _kwargs(kind):
    p = params(kind)
    if "budget" in p:
        p["budget"] = CFG.sink_tokens + CFG.window_tokens - CFG.chunk_tokens
    return p


def _rollout(model, kind, pages=None):
    kw = _kwargs(kind) | ({"pages": pages} if pages else {})
    r = StreamingRollout(model, cache=kind, guidance=3.0, seed=5, cache_kwargs=kw)
    r.set_prompt("a red fox", "blurry", seed=11)
    return r


@pytest.mark.parametrize("kind", KINDS)
def test_each_branch_equals_a_rollout_that_never_forked(model, kind):
    root = _rollout(model, kind, PAGES)
    prefix = root.run(PREFIX)
    same, noise, prompt = root.fork(3, seeds=[None, 7, None], prompts=[None, None, "a sailing boat"])
    # the references: fed the same prefix, then the branch's noise or prompt, no pages, never forked
    refs = [_rollout(model, kind) for _ in range(3)]
    for r in refs:
        assert torch.equal(r.run(PREFIX), prefix)
    refs[1].reseed(7)
    refs[2].switch_prompt("a sailing boat")
    outs = {}
    for name, branch, ref in (("same", same, refs[0]), ("noise", noise, refs[1]), ("prompt", prompt, refs[2])):
        got, want = branch.run(AFTER), ref.run(AFTER)
        assert (got - want).abs().max() <= TOL * max(1.0, float(want.abs().max())), (name, (got - want).abs().max())
        outs[name] = got
    parent = root.run(AFTER)  # the parent is one more branch: the noise it would have drawn
    assert (parent - outs["same"]).abs().max() <= TOL
    # not vacuous: other noise, another prompt give other chunks
    assert (outs["noise"] - outs["same"]).abs().max() > 1e-2
    assert (outs["prompt"] - outs["same"]).abs().max() > 1e-2
    pool = root.caches["cond"].storage.store.table.pool
    for r in (root, same, noise, prompt):
        r.release()
    assert pool.used == 0


def test_the_branches_share_the_history_and_write_their_own_chunks(model):
    root = _rollout(model, "ring", PAGES)
    root.run(PREFIX)
    pool = root.caches["cond"].storage.store.table.pool
    own = pool.used
    branches = root.fork(4, seeds=range(4))
    assert pool.used == own  # a fork copies no K/V
    for b in branches:
        b.generate_chunk()
    # each branch took only the pages its chunk's slots lie in (a chunk of the tiny ring straddles two)
    touched = {int(s) // pool.page for s in branches[0].caches["cond"].write_slots[0, 0]}
    assert len(touched) == 2
    assert pool.used == own + 4 * len(touched)


def test_refusals_change_nothing(model):
    plain = _rollout(model, "ring")
    plain.run(1)
    before = snapshot(plain.caches)
    with pytest.raises(ValueError, match="not paged"):
        plain.fork(2)
    assert_same_state(before, snapshot(plain.caches))
    r = _rollout(model, "ring", PAGES)
    r.run(2)
    before, gen = snapshot(r.caches), r._gen.get_state()
    for call, err, match in (
        (lambda: r.fork(0), ValueError, "n must be"),
        (lambda: r.fork(2, seeds=[1]), ValueError, "seeds must be a sequence of n=2"),
        (lambda: r.fork(2, prompts=["a", 3]), TypeError, "prompts must be strings"),
        (lambda: r.fork(1, seeds=[2**64]), ValueError, "seed must be in"),
        (lambda: StreamingRollout(model, cache="ring", cache_kwargs={"pages": PAGES}).fork(1), RuntimeError,
         "set_prompt"),
        (lambda: _compiled(model).fork(1), RuntimeError, "fork runs eagerly"),
    ):
        with pytest.raises(err, match=match):
            call()
    assert_same_state(before, snapshot(r.caches))
    assert torch.equal(r._gen.get_state(), gen)
    r.caches.begin_chunk(r.chunk_idx)  # a failed attempt leaves the chunk open
    before = snapshot(r.caches)
    with pytest.raises(ValueError, match="open"):
        r.fork(2)
    assert_same_state(before, snapshot(r.caches))
    r.generate_chunk()  # the open chunk is rewritten, then the fork goes through
    assert len(r.fork(2)) == 2


def _compiled(model):
    r = StreamingRollout(model, cache="ring", mode="compile", compile_backend=torch._dynamo.testing.CompileCounter(),
                         cache_kwargs={"pages": PAGES})
    r.set_prompt("a red fox")  # compiles nothing: the step is traced at its first call
    return r


def test_a_released_branch_refuses_to_generate(model):
    r = _rollout(model, "ring", PAGES)
    r.run(1)
    (b,) = r.fork(1)
    b.release()
    with pytest.raises(RuntimeError, match="released"):
        b.generate_chunk()
    r.generate_chunk()  # the parent goes on
