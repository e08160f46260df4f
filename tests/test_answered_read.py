"""A certifying compressed tier answers the step's read from its certificate.

The certificate computes the attention over tiers 1 and 2 (``out_kept``) to bound it; ``attend``
with ``kernel="auto"`` returns that output (rounded once to the queries' dtype), its log-sum-exp
and the scored policy's statistics from the same weights instead of reading the tiers again.
Checked against a twin stream whose reads are computed (``kernel="blocks"``): every kind of the
registry as tier 1, 32- and 16-bit caches, causal or not, with recall; the answer within the
certificate's proven output margin plus one rounding of float64 attention over what the tiers hold;
the statistics within float32 rounding and the evictions identical. And every case the answer
must not serve: another tensor, one changed in place, another scale or causality, a window, a
write since, a step not certified, a float64 cache, queries that ask for a gradient.
"""

from __future__ import annotations

import math

import pytest
import torch

from streamkv import KVCache
from streamkv.attention import attend
from streamkv.certify.tier import CompressedTier
from streamkv.policies import example_policy

from kinds import QUERY_SCORED, SCORED

B, H, G, D, C = 1, 2, 2, 16, 8
SINK, WINDOW, RECALL = 2, 2 * C + 6, 16
#: unit roundoff of each dtype the answer is rounded to
UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


def _stream(T: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, 1, H, D, generator=g)  # a shared direction: peaked, learned-looking attention
    q = torch.randn(B, T, H * G, D, generator=g) + 2 * base.repeat_interleave(G, 2)
    k = torch.randn(B, T, H, D, generator=g) + base * torch.rand(B, T, 1, 1, generator=g) * 3
    v = torch.randn(B, T, H, D, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _build(kind: str, dtype: torch.dtype, causal: bool, recall: bool = True, **tier):
    cache = KVCache((B, SINK + WINDOW, H, D), (B, SINK + WINDOW, H, D), policy=kind, seq_dim=1, sink=SINK,
                    window=WINDOW, chunk=C, num_layers=1, recall_slots=RECALL if recall else 0, dtype=dtype,
                    **example_policy(kind))
    return cache, CompressedTier(cache, fmt="int4", capacity=32, block=8, recall_tau=0.02 if recall else None,
                                 causal=causal, **tier)


def _held_attention(cache, tier, q, a, b):
    """Float64 attention of the span's query rows ``[B, H, G*n, D]`` over what the tiers hold."""
    st = cache.storage
    k2, v2, _, _ = tier.decoded(0)
    kk = torch.cat([st.head_view("k", 0).transpose(0, 1).double(), k2.double()], -2)
    vv = torch.cat([st.head_view("v", 0).transpose(0, 1).double(), v2.double()], -2)
    pos = st.layer_positions(0)  # [H, S]
    hide1 = (pos < 0).unsqueeze(1)
    if tier.causal:
        hide1 = hide1 | (pos.unsqueeze(1) > torch.arange(a, b).repeat(G).view(1, -1, 1))
    hide = torch.cat([hide1.expand(H, G * (b - a), -1), (~tier.live[0]).unsqueeze(1).expand(H, G * (b - a), -1)], -1)
    s = (tier.query_rows(q).double() @ kk.transpose(-1, -2) * tier.scale).masked_fill(hide, -math.inf)
    p1 = s[..., :pos.shape[-1]].softmax(-1)  # tier 1 alone: what a policy's statistics are normalised by
    return s.softmax(-1) @ vv, torch.logsumexp(s, -1), p1


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", SCORED)
def test_the_answer_is_the_certified_attention_and_evicts_as_a_computed_read(kind, dtype, causal):
    q, k, v = _stream(12 * C, dtype)
    answered, computed = _build(kind, dtype, causal), _build(kind, dtype, causal)
    scored = answered[0].policy.needs_queries
    for c in range(q.shape[1] // C):
        a, b = c * C, (c + 1) * C
        outs = []
        for (cache, tier), kernel in ((answered, "auto"), (computed, "blocks")):
            cache.begin_tokens(C)
            qc = q[:, a:b]
            read = cache.layer(0).update(k[:, a:b], v[:, a:b], qc)
            out, info = attend(qc, read, causal=causal, kernel=kernel, return_lse=True)
            outs.append((out, info))
        (out, info), (_, twin_info) = outs
        cache, tier = answered
        assert info.kernel == "answered" and twin_info.kernel == "blocks", (info.kernel, twin_info.kernel)
        assert info.scored == scored and info.keys_read == cache.storage.slots + tier.M
        ref, lse, p1 = _held_attention(cache, tier, q[:, a:b], a, b)
        got = out.double().permute(0, 2, 1, 3).reshape(B, H, G * C, D)
        cert = tier.last[0]
        # out_kept is within its proven margin of the float64 attention; the answer is it rounded once
        assert ((got - ref).abs() <= cert.out_error + UNIT[dtype] * got.abs()).all(), c
        assert ((info.lse.double().reshape(B, H, G * C) - lse).abs()
                <= cert.lse_error + 2.0**-23 * lse.abs()).all(), c
        if scored:  # the statistics of the slots the policy ranks, against float64 over the counted rows
            stat = cache.policy.statistic
            r = C if stat.rows is None else min(stat.rows, C)
            counted = p1.reshape(B, H, G, C, -1)[:, :, :, C - r:].reshape(B, H, G * r, -1)
            for name in stat.reduce:
                want = counted.amax((0, 2)) if name == "max" else counted.sum((0, 2))
                got = cache.policy.state()[f"key_{name}"][0]
                S = got.shape[-1]  # the policy's slots (the recall slots are not its)
                pos = cache.slot_positions[0, :, :S]
                cand = (pos >= SINK) & (pos < a)
                assert torch.allclose(torch.where(cand, got, 0), torch.where(cand, want[:, :S], 0), rtol=1e-5,
                                      atol=1e-7), (c, name)
        for cache, _ in (answered, computed):
            cache.commit()
        assert torch.equal(answered[0].slot_positions, computed[0].slot_positions), c
        assert torch.equal(answered[1].live, computed[1].live), c
    assert answered[1].stats["plans"] > 0 and answered[1].stats["dropped_blocks"] > 0  # recall planned, tier 3 held


def _one_step(dtype=torch.float32, causal=True, chunks=5, **tier):
    """A tova tier past its first evictions, its next span begun: ``(cache, tier, q, k, v)``."""
    q, k, v = _stream((chunks + 1) * C, dtype, seed=3)
    cache, t = _build("tova", dtype, causal, recall=False, **tier)
    for c in range(chunks):
        cache.begin_tokens(C)
        qc = q[:, c * C:(c + 1) * C]
        attend(qc, cache.layer(0).update(k[:, c * C:(c + 1) * C], v[:, c * C:(c + 1) * C], qc), causal=causal)
        cache.commit()
    cache.begin_tokens(C)
    s = slice(chunks * C, (chunks + 1) * C)
    return cache, t, q[:, s].clone(), k[:, s], v[:, s]


def test_only_the_certified_tensor_with_the_same_options_is_answered():
    cache, tier, q, k, v = _one_step()
    read = cache.layer(0).update(k, v, q)
    kernel = lambda x, **kw: attend(x, read, **{"causal": True, **kw})[1].kernel  # noqa: E731
    assert kernel(q) == "answered"
    assert kernel(q.clone()) == "blocks"  # equal values, another tensor
    assert kernel(q, scale=0.5) == "blocks"
    assert kernel(q, causal=False) == "blocks"
    assert kernel(q, window=3) == "blocks"
    want = attend(q, read, causal=True, kernel="blocks")[0]
    q.mul_(2.0)  # changed in place: the answer was for the old values
    assert kernel(q) == "blocks"
    assert not torch.allclose(attend(q, read, causal=True)[0], want)
    cache.layer(0).update(k, v)  # a write without queries: nothing is certified for it
    assert kernel(q) == "blocks"


def test_queries_that_ask_for_a_gradient_are_computed():
    cache, tier, q, k, v = _one_step()
    read = cache.layer(0).update(k, v, q)  # the cache takes no queries that ask for a gradient
    q.requires_grad_(True)  # the same tensor asks for one now
    out, info = attend(q, read, causal=True)
    assert info.kernel == "blocks" and out.requires_grad
    with torch.no_grad():
        assert attend(q, read, causal=True)[1].kernel == "answered"


def test_inference_tensors_are_answered():
    cache, tier, q, k, v = _one_step()
    with torch.inference_mode():
        q, k, v = q.clone(), k.clone(), v.clone()
        out, info = attend(q, cache.layer(0).update(k, v, q), causal=True)
    assert info.kernel == "answered"


@pytest.mark.parametrize("why", ["float64", "not certified", "schedule"])
def test_reads_the_certificate_does_not_cover_are_computed(why):
    dtype = torch.float64 if why == "float64" else torch.float32
    certify = {"not certified": False, "schedule": 2}.get(why, True)
    cache, tier, q, k, v = _one_step(dtype, certify=certify)
    out, info = attend(q, cache.layer(0).update(k, v, q), causal=True)
    assert info.kernel == "blocks", why
    if why == "float64":
        assert tier.last[0] is not None  # certified, and still computed: the certificate's output is float32


def _twins(kind: str, q, k, v, *, causal: bool = False, chunks: int = 8):
    """The same stream through an answered and a computed tier cache: per chunk and kernel, the
    output's NaN rows, the log-sum-exp and whether the commit was taken (False: refused, and the
    stream stops there); the two end holding the same positions."""
    seen, caches = {}, []
    for kernel in ("auto", "blocks"):
        cache, _ = _build(kind, torch.float32, causal, recall=False)
        caches.append(cache)
        rows = seen[kernel] = []
        with torch.no_grad():
            for c in range(chunks):
                s = slice(c * C, (c + 1) * C)
                cache.begin_tokens(C)
                qc = q[:, s]  # one tensor: a slice taken twice is two
                out, info = attend(qc, cache.layer(0).update(k[:, s], v[:, s], qc), causal=causal, kernel=kernel,
                                   return_lse=True)
                assert info.kernel == ("answered" if kernel == "auto" else "blocks"), (c, info.kernel)
                try:
                    cache.commit()
                    taken = True
                except ValueError:
                    taken = False
                rows.append((out.isnan().any(-1), info.lse, taken))
                if not taken:
                    break
    assert torch.equal(caches[0].slot_positions, caches[1].slot_positions)  # the same evictions throughout
    return seen["auto"], seen["blocks"]


def test_a_nan_query_row_reads_nan_in_its_row_only():
    """A NaN query row reads NaN in that row, as a computed read does, and nothing later (the
    certificate's reference output stays finite)."""
    q, k, v = _stream(8 * C, torch.float32, seed=5)
    q[0, 5 * C + 2, 1, 3] = math.nan
    answered, computed = _twins("ring", q, k, v, causal=True)
    for c, ((nan_a, _, _), (nan_c, _, _)) in enumerate(zip(answered, computed)):
        assert torch.equal(nan_a, nan_c), c
    assert int(answered[5][0].sum()) == 1 and not answered[6][0].any()


def test_an_infinite_key_reads_and_refuses_as_a_computed_read():
    """A key with a +inf component every query of its head sees: the log-sum-exp is +inf (a computed
    read's is NaN or +inf; the certificate's own is -inf: it bounds nothing there), and TOVA
    refuses the commit on the NaN statistics, as with a computed read."""
    q, k, v = _stream(8 * C, torch.float32, seed=6)
    k[0, 6 * C + 3, 1, 2] = math.inf
    q[0, 6 * C:, :, 2] = q[0, 6 * C:, :, 2].abs() + 0.1
    answered, computed = _twins("tova", q, k, v)
    assert len(answered) == len(computed) == 7 and not answered[-1][2] and not computed[-1][2]
    odd = lambda lse: lse.isnan() | lse.isposinf()  # noqa: E731 - NaN or +inf, as the kernel's arithmetic falls
    assert odd(answered[-1][1][:, 2:4]).all() and odd(computed[-1][1][:, 2:4]).all()


def test_a_nan_query_row_a_statistic_does_not_count_leaves_it_finite():
    """SnapKV counts its newest rows only: a NaN in an older row of the span leaves its statistics
    finite and the commit taken, as with a computed read."""
    q, k, v = _stream(8 * C, torch.float32, seed=7)
    q[0, 6 * C, 0, 0] = math.nan  # the span's first row: outside SnapKV's observation rows
    answered, computed = _twins("snapkv", q, k, v)
    assert [r[2] for r in answered] == [r[2] for r in computed] == [True] * 8


def test_two_observers_adding_rows_are_not_answered_by_one():
    """A second compressed tier adds rows the first one's certificate does not cover: the read is
    computed (over tier 1 and both tiers' rows)."""
    cache, tier = _build("tova", torch.float32, False, recall=False)
    CompressedTier(cache, fmt="int8", capacity=32, block=8)
    q, k, v = _stream(C, torch.float32)
    cache.begin_tokens(C)
    out, info = attend(q, cache.layer(0).update(k, v, q))
    assert info.kernel == "blocks" and info.keys_read == cache.storage.slots + 2 * 32


def test_a_tier_built_not_to_answer_computes_every_read():
    cache, tier, q, k, v = _one_step(answer=False)
    assert attend(q, cache.layer(0).update(k, v, q), causal=True)[1].kernel == "blocks"
    assert tier.last[0] is not None
    with pytest.raises(TypeError, match="answer must be a bool"):
        _build("tova", torch.float32, True, answer=1)


@pytest.mark.parametrize("case", ["nan query row", "nan key", "inf key in tier 2"])
@pytest.mark.parametrize("kind", QUERY_SCORED)
def test_non_finite_scores_reach_the_statistics_as_in_a_computed_read(kind, case):
    """Statistics are a read's: tier 1 normalised by its own maximum. A NaN score a counted row sees
    makes the head's statistics NaN and the commit refused, as a computed read's; a key that turns
    NaN only in tier 2 (a +inf component every query scores -inf, quantised) leaves tier 1's
    statistics finite, as a computed read's. The same chunks commit, the same positions stay."""
    q, k, v = _stream(10 * C, torch.float32, seed=2)
    if case == "nan query row":
        q[0, 6 * C - 1, 1, 0] = math.nan  # chunk 5's last row: counted by every statistic
    elif case == "nan key":
        k[0, 5 * C + 2, 1, 4] = math.nan
    else:
        k[0, 6 * C + 3, 1, 2] = math.inf
        q[:, 6 * C:, :, 2] = -(q[:, 6 * C:, :, 2].abs() + 0.1)
    answered, computed = _twins(kind, q, k, v, chunks=10)
    assert [r[2] for r in answered] == [r[2] for r in computed]
    assert (len(answered) == 10) == (case == "inf key in tier 2")


def test_a_row_that_sees_only_minus_infinity_reads_zero():
    """A causal first row whose one visible key scores -inf: the answer is 0, as a computed read's
    (not the certificate's reference vector), and its log-sum-exp -inf (float64's)."""
    q, k, v = _stream(C, torch.float32, seed=8)
    k[0, 0, :, 1] = math.inf  # the stream's first key, the first row's only one ...
    q[0, 0, :, 1] = -1.0  # ... scored -inf by it
    cache, tier = _build("tova", torch.float32, True, recall=False)
    cache.begin_tokens(C)
    out, info = attend(q, cache.layer(0).update(k, v, q), causal=True, return_lse=True)
    assert info.kernel == "answered"
    assert not out[0, 0].any() and info.lse[0, :, 0].isneginf().all()
    assert out[0, 1:].isfinite().any()  # the later rows see a key they can weigh


def test_a_margin_is_a_bound_or_infinite_never_nan():
    """A NaN key spoils its head's magnitudes: the certificate's output and log-sum-exp margins read
    +inf there (a NaN is no bound), and the other head keeps finite ones."""
    cache, tier, q, k, v = _one_step()
    k[0, 2, 1, 3] = math.nan  # key head 1
    attend(q, cache.layer(0).update(k, v, q), causal=True)
    cert = tier.last[0]
    for margin in (cert.out_error, cert.lse_error):
        assert not margin.isnan().any() and margin[:, 1].isposinf().all() and margin[:, 0].isfinite().all()
