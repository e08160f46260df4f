"""CacheSet (layers x independent branches) and the flashdreams drop-in."""

import pytest
import torch

from streamkv import CacheSet, RingCache
from streamkv.compat.flashdreams import CircularBlockKVCache

S, W, C, H, D = 3, 6, 3, 2, 4


def _set(kind="ring", branches=("cond", "uncond"), layers=3):
    return CacheSet(kind, k_shape=(1, S + W, H, D), v_shape=(1, S + W, H, D + 2), seq_dim=1,
                    sink=S, window=W, chunk=C, num_layers=layers, branches=branches)


@pytest.mark.parametrize("kind", ["ring", "chronological"])
def test_one_allocation_for_all_layers_and_branches(kind):
    cs = _set(kind)
    k_storage = {cs[b].keys(layer).untyped_storage().data_ptr() for b in cs for layer in range(3)}
    v_storage = {cs[b].values(layer).untyped_storage().data_ptr() for b in cs for layer in range(3)}
    assert len(k_storage) == 1 and len(v_storage) == 1
    assert cs.nbytes == 2 * 3 * (S + W) * H * (D + D + 2) * 4


@pytest.mark.parametrize("kind", ["ring", "chronological"])
def test_branches_are_independent(kind):
    cs = _set(kind)
    for c in range(4):
        cs.begin_chunk(c)
        for layer in range(3):
            cs["cond"].write(torch.full((1, C, H, D), 1.0 + c), torch.full((1, C, H, D + 2), 1.0), layer=layer)
            cs["uncond"].write(torch.full((1, C, H, D), -1.0 - c), torch.full((1, C, H, D + 2), -1.0), layer=layer)
        cs.commit_chunk(c)
    cond_before = cs["cond"].chronological_keys(1).clone()
    assert (cond_before > 0).all() and (cs["uncond"].chronological_keys(1) < 0).all()
    cs.reset(branches=["uncond"])
    assert cs["uncond"].num_valid == 0 and cs["cond"].num_valid == S + W
    cs["uncond"].begin_chunk(0)
    cs["uncond"].write(torch.zeros(1, C, H, D), torch.zeros(1, C, H, D + 2), layer=1)
    assert torch.equal(cs["cond"].chronological_keys(1), cond_before)
    # one begin for all layers: the layers of a branch share the slot plan
    assert cs["cond"].next_chunk == 4 and cs["uncond"].next_chunk == 1


def test_layers_of_a_branch_hold_their_own_kv():
    cs = _set("ring", branches=("cond",))
    cs.begin_chunk(0)
    for layer in range(3):
        cs["cond"].layer(layer).write(torch.full((1, C, H, D), float(layer)), torch.zeros(1, C, H, D + 2))
    for layer in range(3):
        assert (cs.layer("cond", layer).chronological_keys() == layer).all()


def test_cacheset_state_dict_roundtrip_and_rejection():
    a, b = _set(), _set()
    a.begin_chunk(0)
    for layer in range(3):
        for br in a:
            a[br].write(torch.randn(1, C, H, D), torch.randn(1, C, H, D + 2), layer=layer)
    a.commit_chunk(0)
    b.load_state_dict(a.state_dict())
    assert torch.equal(b["uncond"].keys(2), a["uncond"].keys(2)) and b["cond"].next_chunk == 1
    with pytest.raises(ValueError, match=r"state dict must have branches \['cond', 'uncond'\], got \['cond'\]"):
        b.load_state_dict({"cond": a.state_dict()["cond"]})


def test_cacheset_rejects_bad_config_before_allocating():
    with pytest.raises(ValueError, match="unknown cache kind 'rung'"):
        _set("rung")
    with pytest.raises(ValueError, match="branches must be distinct"):
        _set(branches=("cond", "cond"))
    with pytest.raises(ValueError, match=r"k_shape\[seq_dim=1\] must equal sink \+ window = 9, got 8"):
        CacheSet("ring", k_shape=(1, 8, H, D), v_shape=(1, 8, H, D), seq_dim=1, sink=S, window=W, chunk=C, num_layers=2)


# ----------------------------------------------------------- flashdreams drop-in
def _compat():
    return CircularBlockKVCache((1, S + W, H, D), (1, S + W, H, D), -3, C, W, S, device="cpu", dtype=torch.float32)


def test_compat_cached_k_is_the_physical_buffer():
    fd = _compat()
    for c in range(5):
        fd.before_update(c)
        fd.update(torch.full((1, C, H, D), float(c)), torch.zeros(1, C, H, D))
        fd.after_update(c)
    # chunk 0 in the sinks; chunk 3 overwrote chunk 1's slots, chunk 4 chunk 2's
    assert fd.cached_k()[0, :, 0, 0].tolist() == [0, 0, 0, 3, 3, 3, 4, 4, 4]
    assert fd.cached_k().data_ptr() == fd.ring.keys().data_ptr()
    assert fd.size == S + W


def test_compat_write_end_refuses_after_the_first_eviction():
    fd = _compat()
    for c in range(3):
        fd.before_update(c)
        assert fd.write_end == (c + 1) * C  # layouts coincide while filling
        fd.update(torch.zeros(1, C, H, D), torch.zeros(1, C, H, D))
        fd.after_update(c)
    fd.before_update(3)
    with pytest.raises(RuntimeError, match=r"write_end is undefined on the ring after the first eviction: chunk 3 occupies slots \[3, 4, 5\]") as err:
        fd.write_end
    # the fix it names is the drop-in's own (the README's), not the original class
    assert "relative_rope_freqs=rope.shift_t(0), interleaved=True" in str(err.value)
    assert "BlockKVCache" not in str(err.value)


def test_compat_errors_are_exceptions_not_asserts():
    fd = _compat()
    with pytest.raises(RuntimeError, match="needs an open chunk"):
        fd.is_steady_state()
    with pytest.raises(ValueError, match=r"the next chunk \(0\), got 2"):
        fd.before_update(2)
    with pytest.raises(ValueError, match=r"chunk \(3\) must be <= window \(2\).*chunk_size=3, window_size=2"):
        CircularBlockKVCache((1, 5, H, D), (1, 5, H, D), -3, 3, 2, 3, device="cpu", dtype=torch.float32)
    for args, name in (((0, 2, 3), "chunk_size"), ((1, 0, 3), "window_size"), ((1, 2, -1), "sink_size")):
        with pytest.raises(ValueError, match=f"{name} must be >="):  # was the ring's own name
            CircularBlockKVCache((1, 5, H, D), (1, 5, H, D), -3, *args, device="cpu", dtype=torch.float32)


def test_compat_does_not_import_flashdreams():
    import ast
    import inspect

    import streamkv.compat.flashdreams as mod

    tree = ast.parse(inspect.getsource(mod))
    imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(name.startswith("flashdreams") for name in imported)


def test_ring_alone_accepts_unaligned_sizes_the_peer_rejects():
    ring = RingCache((1, 7, 1, 1), (1, 7, 1, 1), seq_dim=1, sink=1, window=6, chunk=4)
    for c in range(6):
        ring.begin_chunk(c)
        ring.write(torch.zeros(1, 4, 1, 1), torch.zeros(1, 4, 1, 1))
        ring.commit_chunk(c)
    assert sorted(ring.slot_positions[0, 0].tolist()) == ring.layout.retained_positions(24)
