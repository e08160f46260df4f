"""Reliability: a rejected call changes nothing even when torch, a callback or a checkpoint is
at fault; checkpoints are checked for meaning; group operations are atomic; nothing stale
survives a reset; numbers that cannot be right are refused; the drop-in behaves like the original."""

import io

import numpy as np
import pytest
import torch

from conftest import assert_same_state, snapshot
from streamkv import CacheSet, KVCache
from streamkv.attention import attend
from streamkv.compat.flashdreams import CircularBlockKVCache
from streamkv.models import CausalVideoDiT, get_config
from streamkv.rollout import Schedule, StreamingRollout
from streamkv.rope import Rope3D

from kinds import KINDS, SCORED, WINDOW, params

S, W, C, H, D = 2, 7, 3, 2, 4


def _cache(kind="ring", **kw):
    return KVCache((1, S + W, H, D), (1, S + W, H, D), policy=kind, seq_dim=1, sink=S, window=W, chunk=C,
                   **params(kind), **kw)


def _run(cache, chunks, start=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    for c in range(start, start + chunks):
        cache.begin_chunk(c)
        k, q = (torch.randn(1, C, H, D, generator=g, dtype=cache.dtype) for _ in range(2))
        attend(q, cache.update(k, k, q))
        cache.commit_chunk(c)
    return cache


def _rejects(obj, exc, match, fn):
    before = snapshot(obj)
    with pytest.raises(exc, match=match):
        fn()
    assert_same_state(before, snapshot(obj))


# ------------------------------------------------------- 1. torch raises after a mutation
@pytest.mark.parametrize("kind", KINDS)
def test_inference_mode_buffers_outside_inference_mode_are_refused_before_anything_moves(kind):
    with torch.inference_mode():
        cache = _run(_cache(kind), 4)
    k = torch.zeros(1, C, H, D)
    _rejects(cache, RuntimeError, "built under torch.inference_mode", lambda: cache.begin_chunk(4))
    with torch.inference_mode():
        cache.begin_chunk(4)
    _rejects(cache, RuntimeError, "built under torch.inference_mode", lambda: cache.write(k, k))
    _rejects(cache, RuntimeError, "built under torch.inference_mode", cache.reset)
    with torch.inference_mode():  # the way that works
        attend(k, cache.update(k, k, k))
        cache.commit_chunk(4)


def test_a_normal_cache_works_inside_inference_mode():
    cache = _cache()
    with torch.inference_mode():
        _run(cache, 6)
    assert cache.next_chunk == 6


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad,match", [
    (lambda t: t.to("meta"), "dense tensor with data"),
    (lambda t: t.to_sparse(), "dense tensor with data"),
])
def test_load_state_dict_refuses_tensors_without_data_before_any_copy(kind, bad, match):
    cache = _run(_cache(kind), 5)
    state = cache.state_dict()
    state["values"] = bad(state["values"])
    target = _run(_cache(kind), 2, seed=1)
    _rejects(target, ValueError, match, lambda: target.load_state_dict(state))


# ------------------------------------------------- 2. checkpoints checked for meaning
@pytest.mark.parametrize("kind", WINDOW)
@pytest.mark.parametrize("tamper,match", [
    (lambda s: s["slot_positions"].fill_(-1), "contradict end=15"),
    (lambda s: s["slot_positions"].view(-1)[3].fill_(-5), "contradict end=15"),
    (lambda s: s["slot_positions"].view(-1)[3].fill_(99), "contradict end=15"),
    (lambda s: s["write_slots"].view(-1)[0].add_(1), "write_slots contradict end=15"),
])
def test_window_checkpoints_must_agree_with_the_layout(kind, tamper, match):
    cache = _run(_cache(kind), 5)
    state = cache.state_dict()
    tamper(state)
    fresh = _cache(kind)
    _rejects(fresh, ValueError, match, lambda: fresh.load_state_dict(state))


def _duplicate(row):
    """One occupied slot takes the position another occupied slot of the same head holds."""
    held = (row >= 0).nonzero().flatten()
    row[held[-1]] = row[held[-2]]


@pytest.mark.parametrize("kind", SCORED)
@pytest.mark.parametrize("tamper,match", [
    (lambda s: s["slot_positions"][0, 0, 4].fill_(99), r"must be -1 or in \[0, 15\)"),
    (lambda s: _duplicate(s["slot_positions"][0, 0]), "same position in two slots"),
    (lambda s: s["slot_positions"][0, 1, 0].fill_(-1), "sink slots must hold positions"),
    (lambda s: s["write_slots"][0, 0, 0].fill_(S + W), r"write_slots must be in \[0, 9\)"),
    (lambda s: s["write_slots"][0, 0, :].copy_(torch.arange(3)), "write_slots must hold the positions of the last span"),
    (lambda s: s["overflows"].fill_(-1), "overflows must be >= 0"),
    # statistics no softmax can produce: a mass cache would evict beyond tau, H2O wedge
    (lambda s: s["key_max"][0, 0, 3].fill_(1.5), r"key_max must be \[0, 1\]"),
    (lambda s: s["key_max"][0, 1, 2].fill_(-0.1), r"key_max must be \[0, 1\]"),
    (lambda s: s["key_sum"][0, 0, 0].fill_(float("nan")), "key_sum must be finite"),
    (lambda s: s["key_sum"][0, 0, 5].fill_(-2.0), "key_sum must be >= 0"),
    (lambda s: s["dropped_mass_bound"].fill_(float("inf")), "dropped_mass_bound must be finite"),
])
def test_scored_checkpoints_must_be_consistent(kind, tamper, match):
    cache = _run(_cache(kind), 5)
    state = cache.state_dict()
    tamper(state)
    fresh = _cache(kind)
    _rejects(fresh, ValueError, match, lambda: fresh.load_state_dict(state))


@pytest.mark.parametrize("field,value,exc,match", [
    ("end", 2**62, ValueError, "passes position 2"),
    ("end", 15.0, ValueError, "end must be an int, got float 15.0"),
    ("span", "3", ValueError, "span must be an int, got str"),
    ("open", 1, ValueError, "open must be a bool, got int 1"),
])
def test_host_fields_are_exact_ints_and_bounded(field, value, exc, match):
    cache = _run(_cache(), 5)
    state = dict(cache.state_dict(), **{field: value})
    fresh = _cache()
    _rejects(fresh, exc, match, lambda: fresh.load_state_dict(state))


def test_numpy_integer_counters_convert_exactly():
    cache = _run(_cache(), 5)
    state = dict(cache.state_dict(), end=np.int64(15), span=np.int32(3))
    fresh = _cache()
    fresh.load_state_dict(state)
    assert fresh.end == 15 and type(fresh.end) is int and fresh.next_chunk == 5


def test_state_dicts_are_snapshots_and_aliases_are_refused():
    """An un-cloned state that aliased the live buffers and was 'rolled back' later used to load
    the present instead of the past: now state_dict() copies, and an alias is refused."""
    cache = _run(_cache(), 4)
    saved = cache.state_dict()
    keys_then = cache.keys().clone()
    _run(cache, 3, start=4, seed=9)
    cache.load_state_dict(saved)
    assert torch.equal(cache.keys(), keys_then) and cache.next_chunk == 4
    alias = dict(cache.state_dict(), keys=cache.storage.keys)
    _rejects(cache, ValueError, "shares memory with this cache's own buffers", lambda: cache.load_state_dict(alias))


def test_a_branch_saves_only_itself_and_survives_torch_save():
    cs = CacheSet("ring", k_shape=(1, S + W, H, D), v_shape=(1, S + W, H, D), seq_dim=1, sink=S, window=W, chunk=C,
                  num_layers=2, branches=("cond", "uncond"))
    state = cs["cond"].state_dict()
    assert state["keys"].shape == (2, 1, S + W, H, D)  # one branch, not the set's allocation
    buf = io.BytesIO()
    torch.save(state, buf)
    back = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    cs["uncond"].load_state_dict(back)


# ----------------------------------------------------------- 3. group operations are atomic
def test_a_rollout_chunk_that_fails_can_be_retried():
    """NaN noise with a budgeted cache: the commit refuses, the chunk stays open, and the next
    generate_chunk rewrites it: the stream then equals one that never failed (one denoising
    step, so the noise passed in is all the noise a chunk draws)."""
    model = CausalVideoDiT(get_config("tiny"), seed=0)
    one_step = Schedule(timesteps=(1000.0,))
    a = StreamingRollout(model, cache="mass", cache_kwargs={"tau": 0.1}, seed=3, schedule=one_step)
    b = StreamingRollout(model, cache="mass", cache_kwargs={"tau": 0.1}, seed=3, schedule=one_step)
    for r in (a, b):
        r.set_prompt("a red fox")
    shape = model.latent_shape(1)
    good = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    for i in range(3):
        a.generate_chunk(good[i])
        b.generate_chunk(good[i])
    with pytest.raises(ValueError, match="not finite"):
        a.generate_chunk(torch.full(shape, float("nan")))
    assert a.chunk_idx == 3 and a.caches["cond"].open_chunk == 3
    outs_a = [a.generate_chunk(good[i]) for i in (3, 4)]
    outs_b = [b.generate_chunk(good[i]) for i in (3, 4)]
    assert all(torch.equal(x, y) for x, y in zip(outs_a, outs_b))


# ------------------------------------------------------------ 4. nothing stale after a reset
@pytest.mark.parametrize("kind", ["mass", "ring"])
def test_reset_after_a_refused_nan_chunk_leaves_nothing_that_reaches_an_output(kind):
    cache = _run(_cache(kind), 3)
    cache.begin_chunk(3)
    nan = torch.full((1, C, H, D), float("nan"))
    cache.write(nan, nan)
    if kind == "mass":
        attend(torch.zeros(1, C, H, D), cache.read())
        with pytest.raises(ValueError, match="not finite"):
            cache.commit_chunk(3)
    cache.reset()
    assert not cache.keys().isnan().any() and not cache.values().isnan().any()
    cache.begin_chunk(0)
    k = torch.randn(1, C, H, D)
    out, info = attend(k, cache.update(k, k, k, occupancy="mask"))
    assert info.occupancy == "mask" and torch.isfinite(out).all()


# ------------------------------------------------------------- 7. numbers that cannot be right
@pytest.mark.parametrize("kwargs,match", [
    (dict(theta=0.0), "theta must be a finite number > 1"),
    (dict(theta=float("nan")), "theta must be a finite number > 1"),
    (dict(theta=-3.0), "theta must be a finite number > 1"),
    (dict(max_frames=2**53), "above 2\\*\\*53 positions"),
])
def test_rope_refuses_tables_that_cannot_be_right(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Rope3D(12, 2, 2, **kwargs)


def test_small_refusals_a_hostile_battery_found():
    """Each was accepted: float positions (truncated to another token), a KVQuant basis of None,
    an empty or repeated tau in a list (dropped silently, or run twice)."""
    import argparse

    from streamkv.quant import KVQuant
    from streamkv_lab.commands.budget import _taus

    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        Rope3D(12, 2, 2).angles(torch.tensor([1.5]))
    with pytest.raises(ValueError, match="KVQuant basis must be 'identity' or 'hadamard', got None"):
        KVQuant("int8", basis=None)
    for text in ("0.1,,0.2", "0.1,0.1"):
        with pytest.raises(argparse.ArgumentTypeError):
            _taus(text)
    assert _taus("0.2,0.1") == (0.2, 0.1)


@pytest.mark.parametrize("shift", [float("inf"), float("nan"), 0.0, -1.0])
def test_schedule_refuses_a_shift_that_gives_nan(shift):
    with pytest.raises(ValueError, match="shift must be a finite number > 0"):
        Schedule(shift=shift)


def test_schedule_refuses_a_shift_whose_sigma_cancels():
    """A positive shift so small that 1 + (shift - 1) s cancels at s = 1 (it was accepted, then
    sigmas() divided by zero inside generate_chunk, the chunk left open)."""
    with pytest.raises(ValueError, match="shift=1e-17 gives the sigma nan at timestep 1000.0"):
        Schedule(shift=1e-17)
    assert abs(Schedule(shift=1e-3).sigmas()[0] - 1.0) < 1e-12


@pytest.mark.parametrize("change,match", [
    (dict(heads=0), "heads must be >= 1, got 0"),
    (dict(patch=0), "patch must be >= 1, got 0"),
    (dict(freq_dim=7), "freq_dim must be even"),
    (dict(eps=float("nan")), "eps must be a finite number > 0"),
    (dict(sink_frames=-1), "sink_frames must be >= 0"),
])
def test_a_model_config_that_cannot_run_is_refused_at_construction(change, match):
    """ZeroDivisionError, a matmul error at the first forward and an all-NaN video came later."""
    import dataclasses

    from streamkv.models import get_config

    with pytest.raises(ValueError, match=match):
        dataclasses.replace(get_config("tiny"), **change)


def test_a_bad_seed_is_refused_before_set_prompt_resets_the_stream():
    model = CausalVideoDiT(get_config("tiny"), seed=0)
    r = StreamingRollout(model, cache="ring", schedule=Schedule(timesteps=(1000.0,)))
    r.set_prompt("a red fox")
    r.run(2)
    for bad, exc in ((2**70, ValueError), (1.5, TypeError)):
        with pytest.raises(exc, match="seed must be"):
            r.set_prompt("another", seed=bad)
        assert r.chunk_idx == 2 and r.caches["cond"].end > 0
        with pytest.raises(exc, match="seed must be"):
            StreamingRollout(model, cache="ring", seed=bad)


def test_attention_refuses_what_it_cannot_answer():
    cache = _run(_cache(), 3)
    cache.begin_chunk(3)
    q = torch.randn(1, C, H, D)
    read = cache.update(q, q, q)
    with pytest.raises(ValueError, match="block must be >= 1, got 0"):
        attend(q, read, block=0)
    for window in (0, 2**70, True):  # 2**70 raised OverflowError from a position compare
        with pytest.raises(ValueError, match=r"window must be an int in \[1, 2\*\*53\]"):
            attend(q, read, causal=True, window=window)
    with pytest.raises(ValueError, match=r"q must match the cache's keys in dim 0: q \(2, 3, 2, 4\)"):
        attend(torch.randn(2, C, H, D), read)
    with pytest.raises(ValueError, match=r"heads \(or a multiple\)"):
        attend(torch.randn(1, C, 3, D), read)
    with pytest.raises(ValueError, match="holds no token yet"):
        attend(q, _cache().read())


# ----------------------------------------------------------- 6. the drop-in like the original
def test_the_drop_in_accepts_what_flashdreams_accepts():
    fd = CircularBlockKVCache((1, 9, 2, 4), (1, 9, 2, 4), seq_dim=1, chunk_size=np.int64(3), window_size=np.int32(7),
                              sink_size=np.int64(2), device="cpu", dtype=torch.float32)
    assert type(fd.chunk_size) is int and fd.window_size == 7
    fd.before_update(0)
    k = torch.randn(1, 3, 2, 4, dtype=torch.float64)
    fd.update(k, k.half())  # cast to the cache's dtype, like the original's slice assignment
    assert torch.equal(fd.cached_k(), k.float()[:, :3]) and fd.cached_v().dtype == torch.float32
    fd.after_update(0)
    with pytest.raises(RuntimeError, match=r"chunk 1 is still open: call after_update\(1\) before before_update\(2\)"):
        fd.before_update(1)
        fd.before_update(2)
    fd.after_update(1)
    with pytest.raises(ValueError, match=r"chunk_idx must be the next chunk \(2\)"):
        fd.before_update(7)


def test_the_drop_in_default_device_on_a_cpu_only_build_says_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the default device works")
    with pytest.raises(RuntimeError, match="no CUDA device.*pass device='cpu'"):
        CircularBlockKVCache((1, 7, 2, 4), (1, 7, 2, 4), seq_dim=1, chunk_size=3, window_size=7)


@pytest.mark.parametrize("value,match", [(float("nan"), "accumulated must be finite"), (-1.0, "accumulated must be >= 0")])
def test_h2o_checkpoints_with_impossible_scores_are_refused(value, match):
    cache = _run(_cache("h2o"), 5)
    state = cache.state_dict()
    state["accumulated"][0, 0, 4] = value
    fresh = _cache("h2o")
    _rejects(fresh, ValueError, match, lambda: fresh.load_state_dict(state))
