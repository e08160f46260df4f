"""Best-of-n continuations of one prompt with ``StreamKVCache.fork`` on real transformers models
(tiny random Llama, float64): each sampled continuation equals ``generate()`` on a cache that never
forked, fed the same tokens (every kind, beyond the window), and ``generate()`` from scratch with
transformers' own cache where the window holds everything (tokens equal, logits close)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_state, snapshot
from transformers import DynamicCache

from kinds import params
from streamkv.integrations.transformers import KINDS, build_cache
from test_transformers_cache import FP64_TOL, max_diff, tiny, with_attention

GEN = {"do_sample": True, "output_logits": True, "return_dict_in_generate": True, "max_new_tokens": 16}
SINK, WINDOW, CHUNK = 2, 20, 10  # 22 slots: 10 prompt + 16 new tokens evict


@pytest.fixture(scope="module")
def models():
    base = tiny("llama", torch.float64)
    return base, with_attention(base, "streamkv")


def _prompt():
    return torch.randint(3, 96, (1, 10), generator=torch.Generator().manual_seed(1))


def _cache(model, kind, window=WINDOW, pages=None):
    p = params(kind)
    if "budget" in p:
        p["budget"] = SINK + window - CHUNK
    return build_cache(model.config, kind, sink=SINK, window=window, chunk=CHUNK, dtype=torch.float64, pages=pages,
                       **p)


def _sample(model, cache, seed):
    torch.manual_seed(seed)
    return model.generate(_prompt(), cache=cache, **GEN)


@pytest.mark.parametrize("kind", KINDS)
def test_each_continuation_equals_an_unforked_cache_fed_the_same_tokens(models, kind):
    _, ours = models
    prompt = _prompt()
    root = _cache(ours, kind, pages={"spare": 12})
    with torch.no_grad():
        ours(input_ids=prompt[:, :-1], cache=root)  # the shared prompt, once (generate() feeds the last token)
    branches = root.fork(3)
    outs = []
    for seed, branch in enumerate([*branches, root]):  # the parent is one more branch
        got = _sample(ours, branch, seed)
        ref = _cache(ours, kind)
        with torch.no_grad():
            ours(input_ids=prompt[:, :-1], cache=ref)
        want = _sample(ours, ref, seed)
        assert torch.equal(got.sequences, want.sequences), (kind, seed)
        assert max_diff(got.logits, want.logits) <= FP64_TOL, (kind, seed)
        outs.append(got.sequences)
    assert branch.kv.end > SINK + WINDOW  # the continuations evicted
    assert len({tuple(s[0].tolist()) for s in outs}) > 1  # different seeds sampled different continuations
    pool = root.kv.storage.store.table.pool
    for c in (*branches, root):
        c.kv.release()
    assert pool.used == 0


def test_a_window_that_holds_everything_equals_generate_from_scratch(models):
    base, ours = models
    prompt = _prompt()
    root = _cache(ours, "ring", window=40, pages={"spare": 8})
    with torch.no_grad():
        ours(input_ids=prompt[:, :-1], cache=root)
    for seed, branch in enumerate(root.fork(2)):
        got = _sample(ours, branch, seed)
        want = _sample(base, DynamicCache(config=base.config), seed)
        assert torch.equal(got.sequences, want.sequences)
        assert max_diff(got.logits, want.logits) <= FP64_TOL


def test_refusals_change_nothing(models):
    _, ours = models
    prompt = _prompt()
    plain = _cache(ours, "ring")
    with torch.no_grad():
        ours(input_ids=prompt, cache=plain)
    before = snapshot(plain.kv)
    with pytest.raises(ValueError, match="not paged"):
        plain.fork(2)
    assert_same_state(before, snapshot(plain.kv))  # the open span was not committed
    paged = _cache(ours, "ring", pages=True)
    with torch.no_grad():
        ours(input_ids=prompt, cache=paged)
    paged.prepare_step(1)
    before = snapshot(paged.kv)
    with pytest.raises(RuntimeError, match="prepare_step"):
        paged.fork(1)
    with pytest.raises(ValueError, match="n must be"):
        paged.fork(0)
    assert_same_state(before, snapshot(paged.kv))


@pytest.mark.parametrize("kind", KINDS)
def test_a_saved_stream_continues_in_another_cache_exactly(models, kind):
    """StreamKVCache.state_dict between forwards, load_state_dict into a fresh cache: generate()
    goes on from it as from the original (a state loaded into .kv directly was refused at the next
    forward with a message about a forward that never ran)."""
    _, ours = models
    a, b = _cache(ours, kind), _cache(ours, kind)
    with torch.no_grad():
        ours(input_ids=_prompt()[:, :-1], cache=a)
    b.load_state_dict(a.state_dict())
    got, want = _sample(ours, b, 3), _sample(ours, a, 3)
    assert torch.equal(got.sequences, want.sequences) and max_diff(got.logits, want.logits) == 0
