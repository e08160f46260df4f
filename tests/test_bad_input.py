"""The rejection grid: every rejected call raises a clear exception and leaves the cache
exactly as it was (every tensor, host counter, buffer address; observers included), for every
cache kind — the window caches, the scored policies, and caches watched by a certifier with
recall slots."""

import pytest
import torch

from conftest import assert_same_state, snapshot
from streamkv import CacheSet, KVCache
from streamkv.attention import attend
from kinds import CERTIFIED, KINDS, QUERY_SCORED, certify, params, policy_of
from streamkv.policies import POLICIES
from streamkv.quant import KVQuant

S, W, C, H, D = 2, 7, 3, 2, 4
CAP = S + W
KINDS = KINDS + CERTIFIED


def _cache(kind, num_layers=1, **kw):
    certified = kind.startswith("certified-")
    kw = {**params(kind), **kw}
    if certified:
        kw.setdefault("recall_slots", 4)
    cache = KVCache((1, CAP, H, D), (1, CAP, H, D + 1), policy=policy_of(kind), seq_dim=1, sink=S, window=W,
                    chunk=C, num_layers=num_layers, **kw)
    certify(cache, kind)
    return cache


def _kvq(seed, n=C):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, n, H, D, generator=g), torch.randn(1, n, H, D + 1, generator=g),
            torch.randn(1, n, H, D, generator=g))


def _chunk(cache, c):
    """One whole chunk, as a model runs it: two passes of update + attend, then commit."""
    cache.begin_chunk(c)
    for step in range(2):
        for layer in range(cache.num_layers):
            k, v, q = _kvq(100 * c + 10 * step + layer)
            attend(q, cache.layer(layer).update(k, v, q))
    cache.commit_chunk(c)


def _mid_stream(kind, open_chunk=True, **kw):
    cache = _cache(kind, **kw)
    for c in range(5):  # past the first eviction and a wrap
        _chunk(cache, c)
    if open_chunk:
        cache.begin_chunk(5)
        k, v, q = _kvq(5)
        cache.update(k, v, q)
    return cache


def _rejects(cache, exc, match, fn):
    before = snapshot(cache)
    with pytest.raises(exc, match=match):
        fn()
    assert_same_state(before, snapshot(cache))


k_ok, v_ok, q_ok = _kvq(0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda c: c.write(k_ok[:, :2], v_ok[:, :2]), ValueError, r"k must have shape \(1, 3, 2, 4\).*got \(1, 2, 2, 4\)"),
        (lambda c: c.write(k_ok[0], v_ok[0]), ValueError, "k must have rank 4"),
        (lambda c: c.write(k_ok, k_ok), ValueError, r"v must have shape \(1, 3, 2, 5\).*got \(1, 3, 2, 4\)"),
        (lambda c: c.write(k_ok.double(), v_ok), TypeError, "k must have the cache dtype torch.float32, got torch.float64"),
        (lambda c: c.write(k_ok, v_ok.half()), TypeError, "v must have the cache dtype"),
        (lambda c: c.write(k_ok.to("meta"), v_ok), ValueError, "k must be on the cache device cpu, got meta"),
        (lambda c: c.write([1.0], v_ok), TypeError, "k must be a Tensor, got list"),
        (lambda c: c.write(k_ok, v_ok, layer=1), ValueError, r"layer must be in \[0, 1\), got 1"),
        (lambda c: c.write(k_ok, v_ok.to_sparse()), ValueError, "v must be a dense"),
        (lambda c: c.write(k_ok, v_ok.clone().requires_grad_(True)), ValueError, "v requires grad"),
        (lambda c: c.write(k_ok, c.values().narrow(1, 0, C)), ValueError, "v shares memory with this cache"),
        (lambda c: c.update(k_ok, v_ok, q_ok[:, :2]), ValueError, r"q must have shape \(1, 3, 2, 4\)"),
        (lambda c: c.update(k_ok, v_ok, q_ok.double()), TypeError, "q must have the cache dtype"),
        (lambda c: c.update(k_ok, v_ok, q_ok, occupancy="full"), ValueError, "occupancy must be 'all', 'prefix' or 'mask'"),
        (lambda c: c.begin_chunk(6), RuntimeError, r"chunk 5 is still open: call commit_chunk\(5\)"),
        (lambda c: c.begin_tokens(1), RuntimeError, r"chunk 5 is still open"),
        (lambda c: c.commit_chunk(4), ValueError, r"must name the open chunk \(5\), got 4"),
        (lambda c: c.commit_chunk("5"), TypeError, "chunk_idx must be an int, got str"),
        (lambda c: c.read(occupancy="prefix") if c.per_head or c.storage.recall_slots else c.read(occupancy="nope"),
         ValueError, "occupancy"),
    ],
)
def test_rejected_calls_with_an_open_chunk(kind, call, exc, match):
    cache = _mid_stream(kind, open_chunk=True)
    _rejects(cache, exc, match, lambda: call(cache))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda c: c.begin_chunk(7), ValueError, r"the next chunk \(5\) or the current one \(4\), got 7"),
        (lambda c: c.begin_chunk(3), ValueError, r"the next chunk \(5\) or the current one \(4\), got 3"),
        (lambda c: c.begin_chunk(-1), ValueError, "got -1"),
        (lambda c: c.begin_chunk(5.0), TypeError, "chunk_idx must be an int, got float"),
        (lambda c: c.begin_chunk(True), TypeError, "chunk_idx must be an int, got bool"),
        (lambda c: c.begin_tokens(C + 1), ValueError, r"a span holds 1 to chunk=3 tokens, got n=4"),
        (lambda c: c.begin_tokens(0), ValueError, "got n=0"),
        (lambda c: c.write(k_ok, v_ok), RuntimeError, r"write\(\) needs an open chunk"),
        (lambda c: c.commit_chunk(4), RuntimeError, r"commit_chunk\(4\) with nothing open"),
        (lambda c: c.commit(), RuntimeError, r"commit\(\) with nothing open"),
    ],
)
def test_rejected_calls_between_chunks(kind, call, exc, match):
    cache = _mid_stream(kind, open_chunk=False)
    _rejects(cache, exc, match, lambda: call(cache))


@pytest.mark.parametrize("kind", KINDS)
def test_fresh_cache_accepts_only_chunk_zero(kind):
    cache = _cache(kind)
    _rejects(cache, ValueError, r"must be the next chunk \(0\), got 1", lambda: cache.begin_chunk(1))
    _rejects(cache, RuntimeError, "needs an open chunk", lambda: cache.write(k_ok, v_ok))
    _rejects(cache, ValueError, "holds no token yet", lambda: attend(q_ok, cache))


@pytest.mark.parametrize("kind", KINDS)
def test_multi_layer_cache_requires_the_layer(kind):
    cache = _cache(kind, num_layers=3)
    cache.begin_chunk(0)
    _rejects(cache, ValueError, "layer is required: this cache holds 3 layers", lambda: cache.write(k_ok, v_ok))
    _rejects(cache, ValueError, r"layer must be in \[0, 3\), got -1", lambda: cache.write(k_ok, v_ok, layer=-1))


@pytest.mark.parametrize("kind", QUERY_SCORED + [k for k in CERTIFIED if policy_of(k) in QUERY_SCORED])
def test_scored_commit_without_queries_names_the_layer_and_chunk(kind):
    """The README loop without attention: nothing told the policy what the chunk attends to."""
    cache = _cache(kind, num_layers=2)
    for c in range(2):
        _chunk(cache, c)
    cache.begin_chunk(2)
    k, v, q = _kvq(9)
    cache.write(k, v, layer=0)
    attend(q, cache.layer(1).update(k, v))  # layer 1 is attended (scores delivered); layer 0 is not
    _rejects(cache, RuntimeError, r"needs the queries of chunk 2 .*layer\(s\) \[0\] have none", lambda: cache.commit_chunk(2))


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(k_shape=(1, CAP, 2, 4), v_shape=(1, CAP, 3, 4)), ValueError, "must agree except in the last dim"),
        (dict(k_shape=(1, CAP + 1, 2, 4), v_shape=(1, CAP + 1, 2, 4)), ValueError, r"k_shape\[seq_dim=1\] must equal sink \+ window = 9, got 10"),
        (dict(seq_dim=3), ValueError, "seq_dim must index a non-feature dim of a rank-4 shape.*got 3"),
        (dict(seq_dim=-1), ValueError, "got -1"),
        (dict(seq_dim=4), ValueError, "got 4"),
        (dict(head_dim=1), ValueError, r"head_dim must index a dim of k_shape .* other than the token"),
        (dict(k_shape=(CAP,), v_shape=(CAP,), seq_dim=0), ValueError, "at least 2 dims"),
        (dict(k_shape=(1, CAP, 0, 4), v_shape=(1, CAP, 0, 4)), ValueError, "positive sizes"),
        (dict(chunk=8), ValueError, r"chunk \(8\) must be <= window \(7\)"),
        (dict(sink=-2), ValueError, "sink must be >= 0, got -2"),
        (dict(sink=2.0), TypeError, "sink must be an int, got float"),
        (dict(num_layers=0), ValueError, "num_layers must be >= 1, got 0"),
        (dict(dtype=torch.int32), TypeError, "dtype must be a floating-point torch.dtype"),
        (dict(dtype=torch.float8_e4m3fn), ValueError, "dtype must be one of .* got torch.float8_e4m3fn"),
        (dict(recall_slots=2**62), MemoryError, r"cannot be allocated \(k_shape=.*recall_slots=4611686018427387904"),
        (dict(num_layers=2**40), MemoryError, r"cannot be allocated \(.*num_layers=1099511627776"),
        (dict(quant=KVQuant("int8", residual=10**12)), ValueError, r"residual=1000000000000 must be <= the cache's"),
        (dict(device="nowhere"), ValueError, "device 'nowhere' is not a torch device"),
        (dict(buffers=(torch.zeros(2, 1, CAP, 2, 4), torch.zeros(2, 1, CAP, 2, 4))), ValueError, r"buffers K must have shape \(1, 1, 9, 2, 4\), got \(2, 1, 9, 2, 4\)"),
        (dict(buffers=(torch.zeros(1, 1, 1, 2, 4).expand(1, 1, CAP, 2, 4), torch.zeros(1, 1, CAP, 2, 4))), ValueError, "share memory"),
        (dict(buffers=(torch.zeros(1, 1, CAP, 2, 4),) * 2), ValueError, "buffers K and V share memory"),
        (dict(buffers=(torch.zeros(1000).as_strided((1, 1, CAP, 2, 4), (100, 100, 10, 4, 2)),
                       torch.zeros(1, 1, CAP, 2, 4))), ValueError, r"buffers K may have elements that share memory: "
                                                                   r"its strides \(100, 100, 10, 4, 2\)"),
    ],
)
@pytest.mark.parametrize("kind", list(POLICIES))
def test_bad_construction(kind, kwargs, exc, match):
    base = dict(k_shape=(1, CAP, 2, 4), v_shape=(1, CAP, 2, 4), seq_dim=1, sink=S, window=W, chunk=C, **params(kind))
    base.update(kwargs)
    with pytest.raises(exc, match=match):
        KVCache(base.pop("k_shape"), base.pop("v_shape"), policy=kind, **base)


@pytest.mark.parametrize(
    "kind,kwargs,match",
    [
        ("mass", dict(tau=1.5), r"tau must be in the open interval \(0, 1\), got 1.5"),
        ("mass", dict(), r"policy 'mass' \(MassBudget\) needs tau \(the dropped-mass budget per eviction, in \(0, 1\)\), "
                         r"e.g. tau=0.2"),
        ("ring", dict(storage="ring"), r"policy 'ring' \(Ring\) takes no parameters, got \['storage'\]: a cache hands "
                                       r"every keyword it does not take itself to its policy; a cache takes \['k_shape', "
                                       r"'v_shape', 'seq_dim', 'sink', 'window', 'chunk', 'policy'"),
        ("tova", dict(tau=0.1), r"policy 'tova' \(TOVA\) takes \['budget', 'score_block', 'check_finite'\], got \['tau'\].*rope_at_read"),
        ("tova", dict(budget=2.0), "TOVA: budget must be an int, got float 2.0"),  # the policy's own type check
        ("mass", dict(tau=0.1, window=5), r"window \(5\) must hold the newest chunk and the next chunk: >= 6"),
        ("h2o", dict(budget=S + C - 1), r"budget must hold .* 5 <= budget <= 6, got 4"),
        ("tova", dict(budget=99), "got 99"),
        ("nope", dict(), "unknown cache kind 'nope'"),
    ],
)
def test_bad_policy_parameters(kind, kwargs, match):
    base = dict(seq_dim=1, sink=S, window=W, chunk=C)
    base.update(kwargs)
    cap = base["sink"] + base["window"]
    with pytest.raises((ValueError, TypeError), match=match):
        KVCache((1, cap, 2, 4), (1, cap, 2, 4), policy=kind, **base)


def test_every_policy_parameter_error_names_what_the_policy_and_the_cache_take():
    """Registry-wide: a keyword nobody takes is refused naming the policy's parameters (from its
    constructor) and the cache's; each required parameter missing is named with its example."""
    import inspect

    for kind, cls in POLICIES.items():
        with pytest.raises(TypeError, match=rf"policy '{kind}' .* got \['storage'\]: .*a cache takes .*'rope_at_read'"):
            KVCache((1, CAP, 2, 4), (1, CAP, 2, 4), seq_dim=1, sink=S, window=W, chunk=C, policy=kind, storage=1,
                    **params(kind))
        required = [p.name for p in inspect.signature(cls).parameters.values() if p.default is p.empty]
        for name in required:
            rest = {k: v for k, v in params(kind).items() if k != name}
            with pytest.raises(TypeError, match=rf"policy '{kind}' .* needs {name}.*e.g. {name}="):
                KVCache((1, CAP, 2, 4), (1, CAP, 2, 4), seq_dim=1, sink=S, window=W, chunk=C, policy=kind, **rest)


def test_cacheset_on_a_machine_without_cuda_says_so_like_a_cache(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    shape = dict(k_shape=(1, CAP, 2, 4), v_shape=(1, CAP, 2, 4), seq_dim=1, sink=S, window=W, chunk=C)
    want = "device cuda was asked for, but this torch build or machine has no CUDA device"
    with pytest.raises(RuntimeError, match=want):
        KVCache(shape.pop("k_shape"), shape.pop("v_shape"), policy="ring", device="cuda", **shape)
    for quant in (None, "int8"):
        with pytest.raises(RuntimeError, match=want):
            CacheSet("ring", k_shape=(1, CAP, 2, 4), v_shape=(1, CAP, 2, 4), seq_dim=1, sink=S, window=W, chunk=C,
                     device="cuda", quant=quant, branches=("cond", "uncond"))
    with pytest.raises(ValueError, match="device 'nowhere' is not a torch device"):
        CacheSet("ring", k_shape=(1, CAP, 2, 4), v_shape=(1, CAP, 2, 4), seq_dim=1, sink=S, window=W, chunk=C,
                 device="nowhere")


@pytest.mark.parametrize("kind", list(POLICIES))
def test_load_state_dict_of_another_layout_is_rejected(kind):
    cache = _mid_stream(kind, open_chunk=False)
    other_kind = _mid_stream("ring" if kind == "chronological" else "chronological", open_chunk=False)
    other_layout = KVCache((1, CAP + 1, H, D), (1, CAP + 1, H, D + 1), policy=kind, seq_dim=1, sink=S, window=W + 1,
                           chunk=C, **params(kind))
    other_dtype = _cache(kind, dtype=torch.float64)
    other_layers = _cache(kind, num_layers=2)
    for other, match in (
        (other_kind, "state dict kind must be"),
        (other_layout, r"state dict layout must be \(2, 7, 3\) for this cache, got \(2, 8, 3\)"),
        (other_dtype, "state dict dtype must be 'torch.float32'"),
        (other_layers, "state dict num_layers must be 1"),
    ):
        _rejects(cache, ValueError, match, lambda: cache.load_state_dict(other.state_dict()))
    bad = dict(cache.state_dict(), span=5)
    _rejects(cache, ValueError, r"span=5 is impossible at end=15", lambda: cache.load_state_dict(bad))
    bad = dict(cache.state_dict(), keys=torch.zeros(3))
    _rejects(cache, ValueError, r"state dict keys must be a \(1, 1, 9, 2, 4\) torch.float32 tensor, got \(3,\)", lambda: cache.load_state_dict(bad))
    bad = {k: v for k, v in cache.state_dict().items() if k != "seq_dim"}
    _rejects(cache, ValueError, "state dict lacks 'seq_dim'", lambda: cache.load_state_dict(bad))


@pytest.mark.parametrize("kind", CERTIFIED)
def test_caches_with_recall_slots_refuse_state_dicts(kind):
    cache = _mid_stream(kind, open_chunk=False)
    _rejects(cache, RuntimeError, "recall slots does not save state dicts", cache.state_dict)
    plain = _mid_stream(kind.removeprefix("certified-"), open_chunk=False)
    _rejects(cache, RuntimeError, "recall slots does not load state dicts", lambda: cache.load_state_dict(plain.state_dict()))


def test_cacheset_begin_is_all_or_nothing():
    cs = CacheSet("ring", k_shape=(1, CAP, H, D), v_shape=(1, CAP, H, D), seq_dim=1, sink=S, window=W, chunk=C,
                  num_layers=2, branches=("cond", "uncond"))
    k = torch.zeros(1, C, H, D)
    for c in range(2):
        cs.begin_chunk(c)
        for layer in range(2):
            for b in cs:
                cs[b].write(k, k, layer=layer)
        cs.commit_chunk(c)
    cs.reset(branches=["uncond"])  # the branches now disagree on the next chunk
    before = snapshot(cs)
    with pytest.raises(ValueError, match=r"the next chunk \(0\), got 2"):
        cs.begin_chunk(2)
    assert_same_state(before, snapshot(cs))
    with pytest.raises(KeyError, match="no branch 'neg'"):
        cs.begin_chunk(2, branches=["neg"])
    assert_same_state(before, snapshot(cs))


def test_cacheset_commit_is_all_or_nothing():
    """A scored set whose uncond branch holds NaN: the commit refuses for both branches, and
    after the NaN chunk is rewritten both commit."""
    cs = CacheSet("mass", k_shape=(1, CAP, H, D), v_shape=(1, CAP, H, D + 1), seq_dim=1, sink=S, window=W, chunk=C,
                  tau=0.2, branches=("cond", "uncond"))
    for c in range(3):
        cs.begin_chunk(c)
        for b in cs:
            k, v, q = _kvq(c)
            attend(q, cs[b].update(k, v, q))
        cs.commit_chunk(c)
    cs.begin_chunk(3)
    k, v, q = _kvq(3)
    attend(q, cs["cond"].update(k, v, q))
    attend(q, cs["uncond"].update(k.clone().fill_(float("nan")), v, q))
    before = snapshot(cs)
    with pytest.raises(ValueError, match="not finite in layer"):
        cs.commit_chunk(3)
    assert_same_state(before, snapshot(cs))
    attend(q, cs["uncond"].update(k, v, q))  # the retry rewrites the chunk
    cs.commit_chunk(3)
    assert cs["cond"].next_chunk == cs["uncond"].next_chunk == 4 and not cs["cond"].is_open


@pytest.mark.parametrize("kwargs, match", [
    ({"rows": 0}, "rows must be None"), ({"rows": -3}, "rows must be None"), ({"rows": True}, "rows must be None"),
    ({"rows": 2.5}, "rows must be None"), ({"reduce": ()}, "reduce must be a tuple"),
    ({"reduce": ("mean",)}, "reduce must be a tuple"), ({"reduce": "max"}, "reduce must be a tuple"),
    ({"skip": -1}, "skip must be an int"), ({"skip": 1.0}, "skip must be an int"),
])
def test_a_statistic_names_its_bad_field(kwargs, match):
    """A policy's declared statistic is checked at construction (a reduce of ("mean",) ran: a mass
    cache then evicted tokens carrying all of a query's mass and reported a bound of 0)."""
    from streamkv.blockread import Statistic

    with pytest.raises(ValueError, match=match):
        Statistic(**kwargs)


@pytest.mark.parametrize("kind", list(POLICIES))
def test_sliced_buffers_are_taken_and_read_as_dense_ones(kind):
    """Buffers whose elements do not overlap though torch cannot tell (a strided slice) are taken,
    and the cache over them reads what one over its own buffers reads."""
    sliced = tuple(torch.zeros(1, 1, CAP, H, 2 * n)[..., ::2] for n in (D, D + 1))
    caches = [_cache(kind), _cache(kind, buffers=sliced)]
    for c in range(4):
        k, v, q = _kvq(c)
        outs = []
        for cache in caches:
            cache.begin_chunk(c)
            outs.append(attend(q, cache.layer(0).update(k, v, q))[0])
            cache.commit_chunk(c)
        assert torch.equal(*outs), c
    assert caches[1].keys(0).data_ptr() == sliced[0].data_ptr()
