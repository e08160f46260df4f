"""``attend(..., kernel=)``: the dispatch between SDPA, the block loop and the Triton read.

On the CPU the Triton read runs under Triton's interpreter (``TRITON_INTERPRET=1`` set before
``triton`` is first imported; where this process imported it before, the interpreter tests run
in a fresh process, as ``tests/test_triton_read.py`` does). Forced ``kernel="triton"`` equals
``kernel="blocks"`` through real caches (dense, int8, RoPE at read, a scored per-head cache with
holes, a forked paged branch whose pages moved); ``"auto"`` never picks Triton on the CPU; a
forced kernel that cannot serve a read raises with the reason. Tiny shapes: a few heads, 16
features, tens of rows (the interpreter runs every program in numpy)."""

import os
import subprocess
import sys

import pytest
import torch

_ENV = os.environ.get("TRITON_INTERPRET")
if "triton" not in sys.modules:  # Triton jits its own language for the mode it finds at its import
    os.environ["TRITON_INTERPRET"] = "1"
try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False
finally:
    if _ENV is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _ENV

from streamkv import KVCache  # noqa: E402
from streamkv.attention import attend  # noqa: E402
from streamkv.kernels import interpreter_reason  # noqa: E402
from streamkv.positions import POSITION_MAPS, position_map  # noqa: E402
from streamkv.quant import KVQuant  # noqa: E402
from streamkv.rope_at_read import RopeAtRead  # noqa: E402
from streamkv.rotary import Rope1D  # noqa: E402

from kinds import params  # noqa: E402


def _here() -> str | None:
    """None when this process runs the kernels on CPU tensors (interpreter set up in time)."""
    if not HAVE_TRITON:
        return "triton is not installed"
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return interpreter_reason()
    finally:
        if _ENV is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = _ENV


HERE = _here()
interpreted = pytest.mark.skipif(HERE is not None, reason=f"run by test_interpreted_in_a_fresh_process: {HERE}")

SINK, WINDOW, CHUNK, H, D = 2, 10, 3, 2, 16
f64 = torch.float64


def _cache(policy="ring", **kw):
    return KVCache((1, SINK + WINDOW, H, D), (1, SINK + WINDOW, H, D), seq_dim=1, sink=SINK, window=WINDOW,
                   chunk=CHUNK, policy=policy, dtype=f64, **{**params(policy), **kw})


def _rope():
    name = "cache_relative"
    return RopeAtRead(Rope1D(D), position_map(name, **POSITION_MAPS[name].for_geometry(SINK, SINK + WINDOW, CHUNK)))


def _chunk(g):
    return [torch.randn(1, CHUNK, H, D, generator=g, dtype=f64) for _ in range(3)]


def _same(a, b, tol=1e-10):
    assert torch.isfinite(a).all() and torch.allclose(a, b, rtol=0, atol=tol), (a - b).abs().max()


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_interpreted_in_a_fresh_process():
    """The interpreter tests of this file in a fresh process, where this one cannot run them."""
    if HERE is None or not HAVE_TRITON:
        pytest.skip("the interpreter tests ran in this process" if HERE is None else HERE)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                        "interpreter"], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-6000:] + r.stderr[-2000:]


# ------------------------------------------------------------------ under the interpreter
@interpreted
@pytest.mark.parametrize("variant", ["dense", "int8", "rope", "int8-rope"])
def test_interpreter_triton_equals_blocks_through_a_ring(variant, interpreter):
    """Forced Triton = forced block loop, while filling and after wraps; auto stays off Triton."""
    kw = {"quant": "int8" if "int8" in variant else None, "rope_at_read": _rope() if "rope" in variant else None}
    cache = _cache(**kw)
    g = torch.Generator().manual_seed(1)
    for c in range(6):
        q, k, v = _chunk(g)
        cache.begin_chunk(c)
        read = cache.layer(0).update(k, v)
        want, wi = attend(q, read, kernel="blocks", causal=c % 2 == 1)
        got, gi = attend(q, read, kernel="triton", causal=c % 2 == 1)
        auto, ai = attend(q, read, causal=c % 2 == 1)
        _same(got, want)
        assert (wi.kernel, gi.kernel, gi.kernel_reason) == ("blocks", "triton", "forced")
        assert ai.kernel != "triton", ai
        assert ai.kernel == ("sdpa" if variant == "dense" else "blocks"), ai
        cache.commit_chunk(c)


@interpreted
@pytest.mark.parametrize("policy", ["tova", "mass"])
def test_interpreter_a_scored_cache_with_holes(policy, interpreter):
    """A per-head scored cache (heads hold different positions, holes while filling and after
    evictions): the same outputs and the same statistics, hence the same evictions, two caches fed
    alike, one read by Triton and one by the block loop."""
    a, b = _cache(policy), _cache(policy)
    g = torch.Generator().manual_seed(2)
    holes = False
    for c in range(7):
        q, k, v = _chunk(g)
        outs = []
        for cache, kernel in ((a, "triton"), (b, "blocks")):
            cache.begin_chunk(c)
            out, info = attend(q, cache.layer(0).update(k, v), kernel=kernel)
            assert info.scored and info.kernel == kernel
            outs.append(out)
            cache.commit_chunk(c)
        _same(*outs)
        pa, pb = a.layer_slot_positions(0), b.layer_slot_positions(0)
        assert torch.equal(pa, pb), (c, pa, pb)
        holes |= bool(((pa < 0).any(-1) & (pa >= 0).any(-1)).any()) or not torch.equal(pa[0], pa[-1])
    assert holes  # the heads held different positions at some point


@interpreted
def test_interpreter_far_into_the_stream_in_float32(interpreter):
    """``absolute`` RoPE at read a million tokens on (a key's limb angles of ~1e5 rad): the kernel
    reduces its float64 angles before taking them in float32, as the block loop's tables do; taken
    unreduced they were off by up to 0.03 rad (1e-3 on the output)."""
    import dataclasses

    rope = RopeAtRead(Rope1D(D, theta=100.0), position_map("absolute"))
    cache = KVCache((1, SINK + WINDOW, H, D), (1, SINK + WINDOW, H, D), seq_dim=1, sink=SINK, window=WINDOW,
                    chunk=CHUNK, policy="ring", dtype=torch.float32, rope_at_read=rope)
    g = torch.Generator().manual_seed(8)
    for c in range(5):
        q, k, v = (x.float() for x in _chunk(g))
        cache.begin_chunk(c)
        read = cache.layer(0).update(k, v)
        if c < 4:
            cache.commit_chunk(c)
    shift = 1_000_003
    far = dataclasses.replace(read, positions=torch.where(read.positions >= SINK, read.positions + shift, read.positions),
                              query_positions=read.query_positions + shift)
    want, _ = attend(q, far, kernel="blocks")
    got, info = attend(q, far, kernel="triton")
    assert info.kernel == "triton"
    _same(got, want, tol=2e-6)


@interpreted
def test_interpreter_a_forked_paged_branch(interpreter):
    """A branch whose pages moved (written after the fork) reads through its page table."""
    root = _cache(pages={"spare": 16})
    g = torch.Generator().manual_seed(3)
    for c in range(5):
        q, k, v = _chunk(g)
        root.begin_chunk(c)
        attend(q, root.layer(0).update(k, v))
        root.commit_chunk(c)
    branch, _ = root.fork(2)
    for c in range(5, 8):
        q, k, v = _chunk(g)
        branch.begin_chunk(c)
        read = branch.layer(0).update(k, v)
        assert read.segments()[0].pages is not None
        want, _ = attend(q, read, kernel="blocks")
        got, info = attend(q, read, kernel="triton")
        _same(got, want)
        assert attend(q, read)[1].kernel == "blocks"
        branch.commit_chunk(c)


@interpreted
def test_interpreter_forced_triton_refuses_what_it_cannot_serve(interpreter):
    """Keys in a storage basis rotated at read: the Triton read refuses, naming why."""
    cache = _cache(quant=KVQuant("int8", basis="hadamard"), rope_at_read=_rope())
    g = torch.Generator().manual_seed(4)
    q, k, v = _chunk(g)
    cache.begin_chunk(0)
    read = cache.layer(0).update(k, v)
    with pytest.raises(ValueError, match="kernel='triton' cannot serve this read: .*storage basis"):
        attend(q, read, kernel="triton")
    out, info = attend(q, read)
    assert info.kernel == "blocks" and torch.isfinite(out).all()


# ------------------------------------------------------------------ without the interpreter
def test_forced_triton_off_the_interpreter_names_why(monkeypatch):
    """Without ``TRITON_INTERPRET=1`` CPU tensors are refused with the reason (never a fallback)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cache = _cache(quant="int8")
    q, k, v = _chunk(torch.Generator().manual_seed(5))
    cache.begin_chunk(0)
    read = cache.layer(0).update(k, v)
    with pytest.raises(ValueError, match="kernel='triton' cannot serve this read: .*(TRITON_INTERPRET|not installed)"):
        attend(q, read, kernel="triton")


@pytest.mark.parametrize("quant", ["int8", "fp8", "int4"])
def test_sdpa_refuses_a_quantised_read(quant):
    cache = _cache(quant=quant)
    q, k, v = _chunk(torch.Generator().manual_seed(6))
    cache.begin_chunk(0)
    read = cache.layer(0).update(k, v)
    with pytest.raises(ValueError, match="kernel='sdpa' cannot serve .*quantised codes"):
        attend(q, read, kernel="sdpa")
    out, info = attend(q, read)
    assert (info.kernel, info.path) == ("blocks", "physical") and "cpu tensors" in info.kernel_reason


def test_sdpa_refuses_statistics_rope_at_read_and_lse():
    g = torch.Generator().manual_seed(7)
    for cache, reason in ((_cache("tova"), "statistics"), (_cache(rope_at_read=_rope()), "rotated at read")):
        q, k, v = _chunk(g)
        cache.begin_chunk(0)
        with pytest.raises(ValueError, match=reason):
            attend(q, cache.layer(0).update(k, v), kernel="sdpa")
    cache = _cache()
    cache.begin_chunk(0)
    q, k, v = _chunk(g)
    read = cache.layer(0).update(k, v)
    with pytest.raises(ValueError, match="return_lse"):
        attend(q, read, kernel="sdpa", return_lse=True)
    out, info = attend(q, read, kernel="sdpa")
    want, winfo = attend(q, read, kernel="blocks")
    assert info.kernel == "sdpa" and info.kernel_reason == "forced" and winfo.kernel == "blocks"
    _same(out, want, 1e-12)
    out, info = attend(q, read)
    assert info.kernel == "sdpa" and "plain dense" in info.kernel_reason


def test_a_bad_kernel_and_a_kernel_on_the_chronological_path_are_refused():
    cache = _cache()
    cache.begin_chunk(0)
    q, k, v = _chunk(torch.Generator().manual_seed(8))
    read = cache.layer(0).update(k, v)
    for bad in ("flash", "", None, 1):
        with pytest.raises(ValueError, match="kernel must be one of 'auto', 'sdpa', 'blocks', 'triton'"):
            attend(q, read, kernel=bad)
    with pytest.raises(ValueError, match="chronological path"):
        attend(q, read, order="chronological", kernel="blocks")
    assert attend(q, read, order="chronological")[1].kernel == "gathered"
