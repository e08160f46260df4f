"""The Triton block read (:func:`streamkv.kernels.triton_read`) on the CPU, under Triton's interpreter
(``TRITON_INTERPRET=1``): every variant against float64 attention over the values the segments store
(decoded, out of their storage basis, rotated at read in float64) and against the reference loop
(:func:`streamkv.blockread.read_blocks`), within the error bound of the queries' dtype
(:func:`_bounds`); and what :func:`~streamkv.kernels.why_not` refuses.

Shapes are tiny (the interpreter runs every program in numpy): a few heads, 16 features, tens of
rows, tiles of 16, so that reads span several key blocks, several query tiles and (forced) splits."""

import importlib
import json
import os
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

_ENV = os.environ.get("TRITON_INTERPRET")
if "triton" not in sys.modules:  # Triton jits its own language for the mode it finds at its import
    os.environ["TRITON_INTERPRET"] = "1"
try:
    pytest.importorskip("triton")
finally:  # the rest of the session keeps its environment; the fixture below sets it for these tests
    if _ENV is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _ENV

from streamkv.blockread import BlockPlan, Statistic, read_blocks  # noqa: E402
from streamkv.kernels import interpreter_reason, triton_read, why_not  # noqa: E402
from streamkv.kernels.cases import (CASES, ROTARIES, SIZES, compare, case_plan, rotation_plan, segment,  # noqa: E402
                                    signed_permutation, within)
from streamkv.positions import POSITION_MAPS  # noqa: E402
from streamkv.rotary import Rope1D, Rotary  # noqa: E402
from streamkv.stores import KV_FORMATS, Dims, IntCodec, Segment  # noqa: E402

os.environ["TRITON_INTERPRET"] = "1"
#: None when this process runs the kernels on CPU tensors; else test_in_a_fresh_process runs this file
HERE = interpreter_reason()
if _ENV is None:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = _ENV


@pytest.fixture(autouse=True)
def _interpreter(request, monkeypatch):
    """Kernels on CPU tensors run in Triton's interpreter; where triton was imported in this process
    before these tests could set it up (torch.compile imports it), they run in a fresh process."""
    if HERE is not None and request.node.name != "test_in_a_fresh_process":
        pytest.skip(f"run by test_in_a_fresh_process: {HERE}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_in_a_fresh_process():
    """This file in a fresh interpreter process, where this one cannot run the kernels."""
    if HERE is None:
        pytest.skip("the kernels ran in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                        "not test_in_a_fresh_process"], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-6000:] + r.stderr[-2000:]


CPU, TINY = torch.device("cpu"), SIZES["tiny"]


@pytest.mark.parametrize("name", list(CASES))
def test_case(name):
    """Every case of the registry: the kernel within the float64 bounds, and as close to read_blocks."""
    case = CASES[name](CPU, TINY)
    got = triton_read(case.q, case.plan, case.config)
    worst = compare(got, case)
    assert within(worst), worst
    if name == "hidden-nan":
        assert torch.isfinite(got.out).all()
    if name == "nothing-visible":
        assert got.out[:, :, 0].isnan().all() and torch.isfinite(got.out[:, :, 1]).all()
        assert torch.isneginf(got.lse[:, :, 0]).all()


def _poked(seed, S, Q, poke, **plan_kw):
    """Float32 queries and one float32 segment of ``S`` rows at positions ``0..S-1`` (every head),
    keys edited by ``poke(k)``; the plan with ``plan_kw`` (statistic, positions, causality)."""
    B, H, D = TINY.batch, TINY.heads, TINY.features
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Q, D, generator=g, dtype=torch.float64).float()
    k, v = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    poke(k)
    return q, case_plan(TINY, [segment(k, v, torch.arange(S).expand(H, -1), torch.float32)], S=S, Q=Q, device=CPU,
                        **plan_kw)


def _same_statistics(got, want):
    """The kernel's statistics: NaN where the block loop's are, and as close elsewhere."""
    for name in ("key_max", "key_sum"):
        a, b = getattr(got, name), getattr(want, name)
        assert torch.equal(a.isnan(), b.isnan()), name
        fin = b.isfinite()
        torch.testing.assert_close(a[fin], b[fin], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_statistics_of_a_row_that_sees_a_nonfinite_key_match_the_block_loop(causal):
    """Without the finiteness checks a stored key may be NaN or inf; a query row that sees it has a
    NaN log-sum-exp. Its statistics are those of the block loop: 0 for every finite score, NaN for
    the key's (a NaN is its key's maximum and poisons its sum); the other rows count as ever. The
    causal rows see the key's block whole or not at all (a row that sees part of a block is poisoned
    by a NaN score the block loop masks by adding -inf: see ARCHITECTURE's "One read")."""
    H = TINY.heads

    def poke(k):
        k[0, 0, 14] = float("nan")
        k[-1, H - 1, 14] = float("inf")  # q . k is NaN: the query has features of both signs

    q, plan = _poked(3, 21, 4, poke, qpos=torch.tensor([5, 13, 14, 20]) if causal else None, causal=causal,
                     statistic=Statistic())
    assert plan.block == 7 and q[-1, H - 1, 2:].gt(0).any() and q[-1, H - 1, 2:].lt(0).any()
    want = read_blocks(q, plan)
    assert want.key_max.isnan().sum() == 2  # the two keys; every other statistic finite
    _same_statistics(triton_read(q, plan, None), want)
    lost = (want.key_sum[:, :14] > 0).all() if causal else (want.key_sum == 0).sum() == 0
    assert lost  # the rows that do not see the keys still count


def test_skipped_slots_read_zero_or_nan_as_in_the_block_loop():
    """A statistic that skips the first slots (``Statistic.skip``: the sinks of a kind that never
    ranks them) reads 0 there, or NaN in a head whose rows saw a non-finite key (here a skipped
    one: the commit must still learn of it), in the kernel as in the block loop."""
    q, plan = _poked(5, 16, 3, lambda k: k[0, 0, 1].fill_(float("nan")), statistic=Statistic(skip=3))
    want = read_blocks(q, plan)
    for b in (want.key_max, want.key_sum):
        assert b[0, :3].isnan().all() and b[1:, :3].eq(0).all() and b[1:, 3:].gt(0).all()
    _same_statistics(triton_read(q, plan, None), want)


def test_the_registry_covers_every_format_and_map():
    assert {f"codes-{f}" for f in KV_FORMATS} <= set(CASES)
    assert {f"rope-{r}-{m}" for r in ROTARIES for m in POSITION_MAPS} <= set(CASES)


# ------------------------------------------------------------------------------------------ refusals
class _OddCodec(IntCodec):
    """An IntCodec subclass: it may decode differently, so the kernel does not claim it."""


class _OtherRotary(Rotary):
    head_dim = 16


def test_why_not_refuses_with_the_reason(monkeypatch):
    B, H, D, S, Q = 2, 2, 16, 12, 2
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, H, Q, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    pos = torch.arange(S).expand(H, -1)
    R = signed_permutation(D, g)
    dims = Dims((B, S, H, D), (B, S, H, D), seq=1, head=2, slots=S, chunk=Q)
    plan = lambda segs, **kw: BlockPlan(segs, dims, 0.25, slots=S, **kw)  # noqa: E731
    base = plan([segment(k, v, pos, torch.float64)])
    assert why_not(q, base) is None
    qpos = torch.arange(S, S + Q)
    rotation = rotation_plan(Rope1D(D), qpos, torch.cat([pos, qpos.expand(H, -1)], -1))
    refused = {
        "storage basis with rotation at read": plan([segment(k, v, pos, torch.float64, fmt="int8", basis=(R, R))],
                                                    rotation=rotation),
        "decodes IntCodec": plan([replace(segment(k, v, pos, torch.float64, fmt="int4"), k_codec=_OddCodec(4))]),
        "rotates Rope1D and FrameRope": plan([segment(k, v, pos, torch.float64)],
                                             rotation=SimpleNamespace(key_units=None, rotary=_OtherRotary())),
        "at least one key block": plan([]),
        "causal masks need": plan([segment(k, v, pos, torch.float64)], causal=True),
        "bf16 codes that cannot be viewed": plan([replace(segment(k, v, pos, torch.float64, fmt="bf16"),
                                                          keys=segment(k, v, pos, torch.float64, fmt="bf16").keys[..., 1:])]),
    }
    for reason, p in refused.items():
        why = why_not(q, p)
        assert why is not None and reason in why, (reason, why)
        with pytest.raises(ValueError, match="cannot serve"):
            triton_read(q, p)
    # two leading dims besides the heads: served where they merge into one stride, refused where not
    dims5 = Dims((2, 3, S, H, D), (2, 3, S, H, D), seq=2, head=3, slots=S, chunk=Q)
    q5 = torch.randn(2, 3, H, Q, D, dtype=torch.float64)
    for kk, reason in ((torch.randn(2, 3, H, S, D, dtype=torch.float64), None),
                       (torch.randn(3, 2, H, S, D, dtype=torch.float64).transpose(0, 1), "do not merge into one")):
        why = why_not(q5, BlockPlan([Segment(n=S, positions=pos, keys=kk, values=kk, features=(D, D),
                                             dtype=torch.float64)], dims5, 0.25))
        assert (why is None) if reason is None else (reason in why), why
    wide = torch.zeros(1, 1, 1, 512, dtype=torch.float64)
    wdims = Dims((1, 1, 1, 512), (1, 1, 1, 512), seq=1, head=2, slots=1, chunk=1)
    seg = Segment(n=1, positions=torch.zeros(1, 1, dtype=torch.long), keys=wide, values=wide, features=(512, 512),
                  dtype=torch.float64)
    assert "a tile holds at most" in why_not(wide, BlockPlan([seg], wdims, 1.0))
    assert "dtype torch.int32" in why_not(q.int(), base)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "TRITON_INTERPRET=1" in why_not(q, base)


def test_the_package_imports_without_triton():
    """``import streamkv.kernels`` needs torch only: triton is imported when a kernel first runs."""
    code = ("import sys; sys.modules['triton'] = None; import streamkv.kernels as k; "
            "assert 'triton is not installed' in k.why_not(__import__('torch').zeros(1, 1), None)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_tiles_shrink_until_the_device_has_the_resources(monkeypatch):
    """A launch refused for its shared memory (a GPU smaller than the tiles assume) is retried with
    smaller tiles -- keys per step, then query rows -- and the tiles that fit are remembered."""
    from triton.runtime.errors import OutOfResources

    tr = importlib.import_module("streamkv.kernels.triton_read")  # the module (the package exports its function)
    case = CASES["dense-bfloat16-prefill"](CPU, TINY)
    tried = []

    def fake_read(qt, plan, tiles, native):
        tried.append((tiles.block_m, tiles.block_n))
        if tiles.block_m * tiles.block_n > 32 * 16:
            raise OutOfResources(2 * tiles.block_m * tiles.block_n, 1024, "shared memory")
        return tiles

    monkeypatch.setattr(tr, "_read", fake_read)
    monkeypatch.setattr(tr, "_FITTING", {})
    asked = tr.KernelConfig(block_m=128, block_n=64, stat_block_m=64, stat_block_n=64, num_warps=8, num_stages=2)
    got = tr._fitting(case.q, case.plan, asked)
    assert tried == [(128, 64), (128, 32), (128, 16), (64, 16), (32, 16)]
    assert (got.block_m, got.block_n, got.num_warps) == (32, 16, 4)
    tried.clear()
    assert tr._fitting(case.q, case.plan, asked) == got and tried == [(32, 16)]  # remembered: one launch
    monkeypatch.setattr(tr, "_FITTING", {})
    monkeypatch.setattr(tr, "_read", lambda *a, **k: (_ for _ in ()).throw(OutOfResources(1, 0, "shared memory")))
    with pytest.raises(OutOfResources):  # nothing smaller than 16 x 16 with one stage
        tr._fitting(case.q, case.plan, asked)


#: compiled for a Hopper GPU without one: a stand-in driver, launches skipped (ptxas ships with triton)
_COMPILE = r"""
import json, torch, importlib
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

class Hopper:
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_active_torch_device(self): return torch.device("cpu")
    def is_active(self): return True

driver.set_active(Hopper())
built = []
run = JITFunction.run
def compile_only(self, *args, grid, warmup, **kwargs):
    kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
    built.append((self.fn.__name__, kernel.metadata.shared, kernel.metadata.num_warps))
    return kernel
JITFunction.run = compile_only
tr = importlib.import_module("streamkv.kernels.triton_read")
from streamkv.blockread import BlockPlan, Statistic
from streamkv.kernels.cases import rotation_plan, segment
from streamkv.rope import Rope3D
from streamkv.rotary import FrameRope
from streamkv.stores import Dims

# bf16 queries over int4 keys and fp8 values in pages, FrameRope at read, statistics, keys split over
# programs: the three kernels at 128 features and the tiles of a chunk (128 x 64)
B, H, D, S, Q = 1, 2, 128, 512, 256
g = torch.Generator().manual_seed(0)
k, v = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(2))
pos = torch.arange(S).expand(H, -1)
qpos = torch.arange(S - Q, S)
rot = rotation_plan(FrameRope(Rope3D(D, 2, 2)), qpos, pos, "cache_relative")
seg = segment(k, v, pos, torch.bfloat16, fmt="int4", vfmt="fp8", group=32, page=64, g=g)
plan = BlockPlan([seg], Dims((B, S, H, D), (B, S, H, D), seq=1, head=2, slots=S, chunk=Q), D ** -0.5, qpos, True,
                 None, rot, Statistic(rows=64), S)
q = torch.randn(B, 2 * H, Q, D, generator=g).bfloat16()
tr._read(q, plan, tr._tiles(q, plan, tr.KernelConfig(), True), native=True)
print(json.dumps(built))
"""


def test_the_kernels_compile_for_a_hopper_gpu():
    """The compiled path (what the interpreter does not check: types, layouts, tiles, shared memory):
    the three kernels at 128 features built for sm_90 by Triton's own compiler, without a GPU, in a
    process without the interpreter; their shared memory within an H100/H200 block's 227 KiB. (Every
    case of the registry compiles alike; this read takes every path of the code decoding at once.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    built = json.loads(r.stdout.strip().splitlines()[-1])
    assert {name for name, _, _ in built} == {"attn_kernel", "merge_kernel", "stat_kernel"}, built
    assert all(shared <= 227 * 1024 for _, shared, _ in built), built
