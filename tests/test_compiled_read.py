"""The CPU read's compiled kernels (the decode of a code block, the rotation of a key block, a
causal read's masks) give the same values as the eager ops they fuse: bit for bit, every codec of
the registry."""

import pytest
import torch

import streamkv.rotary as rotary
import streamkv.stores.codecs as codecs
from streamkv.rotary import Rope1D
from streamkv.stores import KV_FORMATS


@pytest.mark.parametrize("name", list(KV_FORMATS))
@pytest.mark.parametrize(("dtype", "dropping"), [(torch.bfloat16, False), (torch.bfloat16, True),
                                                 (torch.float32, True)])
def test_compiled_decode_equals_the_eager_ops(name, dtype, dropping, monkeypatch):
    """Decoded into ``dtype``, with or without rows given as zeros (a stale NaN scale among them:
    ``where``, so it weighs nothing): the compiled kernel equals the eager ops bit for bit; a
    codec whose codes are the values in ``dtype`` hands out a view of them."""
    monkeypatch.setattr(codecs, "COMPILE_MIN", 0)  # compile at any size (the default starts at 2**18 codes)
    codec = KV_FORMATS[name]
    g = torch.Generator().manual_seed(len(name))
    x = torch.randn(2, 3, 37, 16, generator=g) * 3
    codes, scale = codec.encode(x, 8)
    drop = None
    if dropping:
        drop = torch.rand(2, 3, 37, 1, generator=g) < 0.3
        if scale is not None:
            scale[drop.expand_as(scale)] = float("nan")
    got = codec.decode_as(codes, scale, 16, 8, dtype, drop)
    want = codec.decode(codes, scale, 16, 8)
    if drop is not None:
        want = torch.where(drop, 0.0, want)
    want = want.to(dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    if codec.name == "bf16" and dtype == torch.bfloat16 and drop is None:
        assert got.untyped_storage().data_ptr() == codes.untyped_storage().data_ptr()  # a view: no pass
    elif codec.name != "bf16" or dtype != torch.bfloat16:
        assert (name, 16, 8, dtype, dropping) in {k for k in codecs._COMPILED if codecs._COMPILED[k] is not None}


def test_compiled_zero_rows_equals_the_eager_where(monkeypatch):
    """Rows of a strided (attention-layout) block given as zeros, NaN rows among them: the compiled
    kernel equals ``torch.where`` bit for bit."""
    monkeypatch.setattr(codecs, "COMPILE_MIN", 0)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 41, 3, 16, generator=g).to(torch.bfloat16).transpose(1, 2)  # [1, H, S, D], strided
    drop = torch.rand(1, 3, 41, 1, generator=g) < 0.4
    x[drop.expand_as(x)] = float("nan")
    got = codecs.zero_rows(x, drop)
    assert not got.isnan().any() and torch.equal(got, torch.where(drop, 0.0, x.float()).to(x.dtype))
    assert codecs._ZERO_ROWS and codecs._ZERO_ROWS[0] is not None


def test_compiled_rope_tables_match_the_eager_ones_to_a_float32_ulp(monkeypatch):
    """Rope1D's cos/sin tables from its compiled kernel: the same float64 limb arithmetic and the
    same rounding to float32, up to the vector math library's cos/sin and a fused multiply-add in
    the limbs; every entry is within one float32 ulp of 1 (2**-23) of the eager table, offsets
    past one limb (2**18) included."""
    monkeypatch.setattr(rotary, "COMPILE_MIN", 0)
    rot = Rope1D(64)
    g = torch.Generator().manual_seed(6)
    delta = torch.cat([torch.randint(-5000, 5000, (1, 300), generator=g),
                       torch.randint(-(1 << 40), 1 << 40, (1, 300), generator=g)], dim=1)
    cos, sin = rot.cos_sin(delta, delta, torch.float32)
    assert torch.float32 in rotary._COS_SIN and rotary._COS_SIN[torch.float32] is not None
    ang = rotary.narrowed(rotary.exact_angles(delta, rot.freqs, rot.residues), torch.float32)
    assert (cos - ang.cos()).abs().max() <= 2.0**-23 and (sin - ang.sin()).abs().max() <= 2.0**-23


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_compiled_rotation_equals_the_eager_ops(style, monkeypatch):
    monkeypatch.setattr(rotary, "COMPILE_MIN", 0)
    rot = Rope1D(16, style=style)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 3, 29, 16, generator=g).to(torch.bfloat16)
    delta = torch.randint(-50, 50, (1, 29), generator=g)
    cos, sin = rot.cos_sin(delta, delta, torch.float32)
    got = rot.rotate_as(x, cos.unsqueeze(0), sin.unsqueeze(0))
    want = rot.rotate(x.float(), cos.unsqueeze(0), sin.unsqueeze(0)).to(torch.bfloat16)
    assert torch.equal(got, want)
    assert rotary._ROTATE.get(style) is not None


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("keys", ["per head", "shared by the heads", "past 2**40"])
def test_compiled_position_masks_equal_their_definition(window, dtype, keys, monkeypatch):
    """A causal read's masks from one compiled pass over the positions' float32 ranks (rows repeated
    per query group, ``g*Q + i``): the bias is ``position_mask``'s ``-inf``, ``seen`` a row with a
    visible key, ``drop`` a key hidden from every row; equal to those definitions, bit for bit; with
    every head's positions one broadcast row (built once), and at positions no float32 holds."""
    import streamkv.masks as masks

    monkeypatch.setattr(masks, "MASK_COMPILE_MIN", 0)
    g = torch.Generator().manual_seed(2)
    kpos = torch.randint(-1, 40, (3, 29), generator=g)  # empty slots among them
    qpos = torch.tensor([30, 2, 17, 0])
    if keys == "shared by the heads":
        kpos = kpos[:1].expand(3, -1)
    elif keys == "past 2**40":  # neighbouring positions round to one float32 here
        kpos, qpos = torch.where(kpos >= 0, kpos + 2**40, kpos), qpos + 2**40
    groups = 2
    bias, seen, drop = masks.position_masks(kpos, qpos, window, groups, dtype)
    (alone,) = masks.position_masks(kpos, qpos, window, groups, dtype, bias_only=True)
    hidden = masks.position_mask(kpos, qpos.repeat(groups), window)  # [3, G*Q, S]
    want = torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, float("-inf"))
    assert bias.dtype == dtype and torch.equal(bias, want) and torch.equal(alone, want)
    assert torch.equal(seen, (~hidden).any(-1, keepdim=True)) and torch.equal(drop, hidden.all(-2, keepdim=True))
    assert seen.any() and not seen.all() and drop.any() and not drop.all()  # both kinds of row and key occur
    assert torch.equal(masks.position_bias(kpos, qpos, dtype, window, groups), want)
    assert {k for k, f in masks._MASKS.items() if f is not None} >= {(window is None, dtype, False),
                                                                       (window is None, dtype, True)}


def test_under_a_dispatch_mode_the_eager_ops_run(monkeypatch):
    """A compiled kernel cannot run under a Python dispatch mode (an op counter such as the bench's,
    a debug mode): a large decode or rotation raised there; the eager ops run instead, same values."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(codecs, "COMPILE_MIN", 0)
    monkeypatch.setattr(rotary, "COMPILE_MIN", 0)
    codec = KV_FORMATS["int8"]
    codes, scale = codec.encode(torch.randn(2, 37, 16), 16)
    rot = Rope1D(16)
    x = torch.randn(1, 3, 29, 16).to(torch.bfloat16)
    delta = torch.arange(29).view(1, -1)
    cos, sin = (t.unsqueeze(0) for t in rot.cos_sin(delta, delta, torch.float32))
    want = (codec.decode_as(codes, scale, 16, 16, torch.bfloat16), rot.rotate_as(x, cos, sin))
    with Count():
        got = (codec.decode_as(codes, scale, 16, 16, torch.bfloat16), rot.rotate_as(x, cos, sin))
    assert Count.ops > 0 and all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.slow  # two compiles (about 10 s on 2 cores)
def test_a_paged_chronological_cache_writes_under_fullgraph_compile():
    """A chronological cache writes at host offsets through its page table (``PageTable.ranges``):
    traceable with ``fullgraph=True`` when the offset recompiles as a dynamic int (``divmod`` of
    SymInts was refused), equal to an unpaged cache."""
    from streamkv import KVCache
    from streamkv.attention import attend

    def build(pages):
        return KVCache((1, 10, 2, 8), (1, 10, 2, 8), seq_dim=1, sink=2, window=8, chunk=2, policy="chronological",
                       pages=pages)

    a, ref = build({"spare": 4}), build(None)
    step = torch.compile(lambda q, k: attend(q, a.layer(0).update(k, k, q, occupancy="mask"))[0], backend="eager",
                         fullgraph=True)
    g = torch.Generator().manual_seed(0)
    for c in range(2):  # chunk 1's offset recompiles as a dynamic int
        q, k = (torch.randn(1, 2, 2, 8, generator=g) for _ in range(2))
        a.begin_chunk(c), ref.begin_chunk(c)
        out = step(q, k)
        assert torch.allclose(out, attend(q, ref.layer(0).update(k, k, q, occupancy="mask"))[0], rtol=1e-6, atol=1e-6)
        assert torch.equal(a.keys(0), ref.keys(0))
        a.commit_chunk(c), ref.commit_chunk(c)
