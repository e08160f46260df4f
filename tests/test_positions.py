"""Position maps and RoPE at read: every map of the registry x every cache kind x read path
against a float64 whole-history reference that rotates raw keys by the map's host reference;
the equalities the sources claim; one compiled graph across fills, wraps and map changes;
positions far past 2**40; exact angles; and the refusals."""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import pytest
import torch

from kinds import SCORED
from streamkv import RingCache
from streamkv.attention import attend
from streamkv_lab.experiments.positions_check import (
    MapLayout,
    large_positions,
    default_map_layouts,
    ring_vs_chronological,
    run_map_layout,
    wrong_map_is_caught,
)
from streamkv.positions import POSITION_MAPS, position_map
from streamkv.rope import Rope3D
from streamkv.rope_at_read import RopeAtRead
from streamkv.rotary import _PI, ANGLE_ERROR, FrameRope, Rope1D, exact_angles, limb_residues
from streamkv.scoring import blockwise_attention

FP64 = 1e-12
LAYOUTS = default_map_layouts()


def test_the_layouts_cover_the_registry_and_every_kind():
    from streamkv.caches import CACHE_KINDS

    assert {lay.map for lay in LAYOUTS} == set(POSITION_MAPS)
    assert {(lay.map, lay.kind) for lay in LAYOUTS} == {(m, k) for m in POSITION_MAPS for k in CACHE_KINDS}
    for flag in ("causal", "spans", "occupancy", "groups", "rotary", "window_mask", "cut_at", "seq_dim"):
        assert len({getattr(lay, flag) for lay in LAYOUTS}) > 1, flag


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: lay.name)
def test_every_map_kind_and_read_path_equals_the_whole_history_reference(lay):
    res = run_map_layout(lay)
    assert res.comparisons >= lay.chunks
    assert res.max_abs_diff < FP64, res


@pytest.mark.parametrize("kind", ["ring", "tova"])
def test_small_key_blocks_and_row_pieces_change_nothing(kind):
    """Keys read in blocks of 4 slots, rotated 3 rows at a time (the paths a large cache takes)."""
    for lay in (MapLayout(map="sliding_sinks", kind=kind, causal=True, groups=2, seed=11),
                MapLayout(map="block_relative", kind=kind, rotary="frame", occupancy="mask", cut_at=3, seed=12)):
        res = run_map_layout(lay, rope_kwargs={"block": 4, "rows": 3})
        assert res.max_abs_diff < FP64, res


@pytest.mark.parametrize("kind", SCORED)
def test_scored_kinds_are_read_with_ragged_heads(kind):
    """Every per-head kind, on a geometry of its own (not the registry-wide cycle of options, which
    shifts as the registry grows): reads whose heads hold different positions, each exact."""
    res = run_map_layout(MapLayout(map="cache_relative", kind=kind, sink=2, window=8, chunk=2, chunks=12, seed=5))
    assert res.ragged_reads > 0 and res.comparisons >= 12, res
    assert res.max_abs_diff < FP64, res


def test_a_deliberately_wrong_map_is_caught():
    assert wrong_map_is_caught() > 1e-2


def test_the_ring_under_cache_relative_equals_the_chronological_path():
    res = ring_vs_chronological()
    assert res["comparisons"] == 9 and res["max_abs_diff"] < FP64


@pytest.mark.parametrize("kind", ["ring", "tova"])
def test_equal_rules_are_equal_and_the_others_differ(kind):
    """streaming_llm = cache_relative everywhere; on a window (no holes) sliding_sinks and
    block_relative (either anchor) are cache_relative up to a shift; with holes (scored
    caches) sliding_sinks keeps them and differs."""
    base = dict(kind=kind, sink=2, window=8, chunk=2, chunks=10)
    cr = position_map("cache_relative")

    def vs_cache_relative(name, **params):
        lay = MapLayout(map=name, params=tuple(params.items()), **base)
        pmap = position_map(name, **({"horizon": 10} if name == "block_relative" else {}), **params)
        return run_map_layout(lay, pmap_override=pmap, reference_map=cr).max_abs_diff

    assert vs_cache_relative("streaming_llm") < FP64
    assert vs_cache_relative("block_relative") < FP64
    assert vs_cache_relative("block_relative", anchor="end") < FP64
    if kind == "ring":
        assert vs_cache_relative("sliding_sinks") < FP64
        assert vs_cache_relative("absolute") > 1e-3  # the ring past its window: absolute is not relative
    else:
        assert vs_cache_relative("sliding_sinks") > 1e-3


# ---------------------------------------------------------------------- large positions
def _stream_read(pmap_name: str, seed: int = 0):
    torch.manual_seed(seed)
    rot = Rope1D(8, theta=100.0)
    params = POSITION_MAPS[pmap_name].for_geometry(2, 10, 3)
    rope = RopeAtRead(rot, position_map(pmap_name, **params))
    c = RingCache((1, 10, 2, 8), (1, 10, 2, 8), seq_dim=1, sink=2, window=8, chunk=3, dtype=torch.float64,
                  rope_at_read=rope)
    for i in range(5):
        c.begin_chunk(i)
        q, k, v = (torch.randn(1, 3, 2, 8, dtype=torch.float64) for _ in range(3))
        read = c.layer(0).update(k, v)
        if i < 4:
            c.commit_chunk(i)
    return c, read, q, rot


SHIFT = 1 << 40


def _far(read, shift=SHIFT):
    """The same read with every non-sink position ``shift`` later (a stream 2**40 tokens on)."""
    pos = torch.where(read.positions >= 2, read.positions + shift, read.positions)
    return dataclasses.replace(read, positions=pos, query_positions=read.query_positions + shift)


def _frame_rope():
    return FrameRope(Rope3D(24, 2, 3, max_frames=64))


# shifts whose low limbs are not 0 (2**40 itself is one limb: small angles)
@pytest.mark.parametrize("make_rotary, shift", [(lambda: Rope1D(8, theta=100.0), 1_000_003),
                                                (lambda: Rope1D(8, theta=100.0), SHIFT + (1 << 18) - 1),
                                                (_frame_rope, 6 * ((1 << 38) + 43_690))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_narrow_reads_far_into_the_stream_keep_their_dtypes_rounding(make_rotary, shift, dtype):
    """``absolute`` rotates far keys by angles of up to ~1e6 rad (the limb sums): taken in float32
    unreduced they were off by up to 0.03 rad, a read 1e-3 to 2e-2 from the truth where float32
    rounding is 2e-7. A float32 (bf16) cache's read, far into the stream, against the float64
    cache's read of the same values: within the read's own rounding near the stream's start."""
    rot = make_rotary()
    D, unit = rot.head_dim, rot.tokens_per_unit
    sink, chunk = 2 * unit, unit
    g = torch.Generator().manual_seed(7)
    reads = {}
    for dt in (dtype, torch.float64):
        c = RingCache((1, sink + 4 * chunk, 2, D), (1, sink + 4 * chunk, 2, D), seq_dim=1, sink=sink,
                      window=4 * chunk, chunk=chunk, dtype=dt, rope_at_read=RopeAtRead(rot, position_map("absolute")))
        g.manual_seed(7)
        for i in range(7):
            q, k, v = (torch.randn(1, chunk, 2, D, generator=g).to(dtype).to(dt) for _ in range(3))
            c.begin_chunk(i)
            read = c.layer(0).update(k, v)
            if i < 6:
                c.commit_chunk(i)
        reads[dt] = (q, read)
    errs = []
    for s in (0, shift):
        (q32, r32), (q64, r64) = reads[dtype], reads[torch.float64]
        far = lambda r: dataclasses.replace(r, positions=torch.where(r.positions >= sink, r.positions + s, r.positions),
                                            query_positions=r.query_positions + s)
        errs.append((attend(q32, far(r32))[0].double() - attend(q64, far(r64))[0]).abs().max().item())
    near, far_err = errs
    assert far_err <= 4 * near + 8 * torch.finfo(dtype).eps, (near, far_err)


@pytest.mark.parametrize("name", [m for m, k in POSITION_MAPS.items() if k.bounded])
def test_bounded_maps_are_exact_2_pow_40_tokens_on(name):
    _, read, q, _ = _stream_read(name)
    near, _ = attend(q, read)
    far, _ = attend(q, _far(read))
    assert torch.equal(near, far)


def test_absolute_at_2_pow_40_is_within_the_stated_angle_error():
    """Under ``absolute`` the sinks sit 2**40 positions before the queries; their angles are
    exact to ANGLE_ERROR (limbs), where the naive float64 product is off by ~1e-4 rad."""
    freqs = Rope1D(8, theta=100.0).freqs
    res = limb_residues(freqs)
    deltas = [-(SHIFT + 5), -SHIFT, SHIFT + 12345, (1 << 52) + 7, -(1 << 36) - 1, 1 << 18, 17, -3]
    got = exact_angles(torch.tensor(deltas), freqs, res)
    two_pi = 2 * _PI
    worst_naive = 0.0
    for i, d in enumerate(deltas):
        for j, f in enumerate(freqs.tolist()):
            exact = Fraction(d) * Fraction(f)
            exact -= two_pi * math.floor(exact / two_pi)
            err = abs(math.remainder(got[i, j].item() - float(exact), 2 * math.pi))
            assert err <= ANGLE_ERROR, (d, f, err)
            naive = abs(math.remainder(d * f - float(exact), 2 * math.pi))
            worst_naive = max(worst_naive, naive)
    assert worst_naive > 1e-6  # what the limbs avoid
    small = torch.arange(-300, 300)
    assert torch.equal(exact_angles(small, freqs, res), small.double().unsqueeze(-1) * freqs)  # = the naive product

    res = large_positions()
    assert res["absolute_vs_exact_angles"] < 1e-8, res  # measured 1.6e-15
    assert res["float64_rope_at_write_vs_exact"] > 1e-7, res  # measured 1.1e-5: what the limbs avoid
    assert res["bounded"] == {m: 0.0 for m, k in POSITION_MAPS.items() if k.bounded}


# ---------------------------------------------------------------------- Wan's 3D RoPE
def test_frame_rope_reindexes_the_frame_band_only():
    rope3d = Rope3D(24, 2, 3, max_frames=64)
    fr = FrameRope(rope3d)
    pos = torch.arange(0, 30)
    a = fr.angles(torch.zeros(30, dtype=torch.long), pos)
    b = fr.angles(torch.full((30,), 7, dtype=torch.long), pos)
    t = rope3d.bands[0] // 2
    assert torch.equal(a[:, t:], b[:, t:]) and not torch.equal(a[:, :t], b[:, :t])
    frames = pos // fr.tokens_per_unit  # absolute: the same angles as Rope3D at write
    assert torch.allclose(fr.angles(frames, pos), rope3d.angles(pos), rtol=0, atol=1e-12)


def test_frame_rope_says_how_to_build_wans_rope_from_diffusers_and_the_recipe_is_exact():
    """``FrameRope(WanRotaryPosEmbed)`` is refused with a recipe (the grid is the transformer
    input's, which the module does not keep); the recipe, evaluated as written, gives diffusers'
    own tables (float32: within one float32 ulp at 1) at every frame, row and column."""
    import re

    wan = pytest.importorskip("diffusers.models.transformers.transformer_wan")
    from streamkv.rope import Rope3D

    for head_dim, patch, theta in ((12, (1, 2, 2), 10000.0), (20, (1, 1, 2), 500.0)):
        module = wan.WanRotaryPosEmbed(head_dim, patch, 16, theta=theta)
        with pytest.raises(TypeError, match="Rope3D") as err:
            FrameRope(module)
        recipe = re.search(r"`(FrameRope\(Rope3D\(.*?\)\))`", str(err.value)).group(1)
        if theta != 10000.0:
            assert "<the theta it was built with>" in recipe
            recipe = recipe.replace("<the theta it was built with>", repr(theta))
        frames, height, width = 5, 6, 4  # latent sizes: the transformer input's
        fr = eval(recipe, {"FrameRope": FrameRope, "Rope3D": Rope3D, "latent_height": height, "latent_width": width})
        cos, sin = module(torch.zeros(1, 1, frames, height, width))  # [1, tokens, 1, D], pairs repeated
        pos = torch.arange(cos.shape[1])
        ang = fr.angles(pos // fr.tokens_per_unit, pos)  # absolute frames
        assert fr.tokens_per_unit == (height // patch[1]) * (width // patch[2])
        for table, mine in ((cos, ang.cos()), (sin, ang.sin())):
            assert (table[0, :, 0, ::2].double() - mine).abs().max() <= 2.0**-24


# ---------------------------------------------------------------------- refusals
def test_a_map_that_reads_values_on_the_host_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="not traceable.*meta"):
        position_map("custom", fn=lambda inp, u: u + int(inp.held.max()))
    with pytest.raises(ValueError, match="not traceable"):
        position_map("custom", fn=lambda inp, u: u if bool((u > 3).any()) else u + 1)
    with pytest.raises(ValueError, match="shaped like its units"):
        position_map("custom", fn=lambda inp, u: u.sum())
    with pytest.raises(TypeError, match="callable"):
        position_map("custom", fn=3)
    for narrow in (torch.float32, torch.int32):  # float32 made 2**24 and 2**24 + 1 one position
        with pytest.raises(ValueError, match=f"int64 or float64 positions, got {narrow}"):
            position_map("custom", fn=lambda inp, u, t=narrow: inp.rank(u).to(t))
    ok = position_map("custom", fn=lambda inp, u: inp.rank(u) * 2)
    assert ok.name == "custom"


def test_bad_maps_and_parameters_are_refused():
    with pytest.raises(ValueError, match="unknown position map"):
        position_map("nope")
    with pytest.raises(ValueError, match="needs \\['horizon'\\]"):
        position_map("block_relative")
    with pytest.raises(ValueError, match="takes"):
        position_map("absolute", horizon=3)
    with pytest.raises(TypeError, match="must be an int"):
        position_map("block_relative", horizon=4.0)
    with pytest.raises(ValueError, match="choose one"):
        position_map("block_relative", horizon=4, anchor="end", cut=45)


def test_a_horizon_shorter_than_the_cache_is_refused():
    rope = RopeAtRead(Rope1D(8), position_map("block_relative", horizon=9))
    with pytest.raises(ValueError, match="horizon=9 units and this cache can hold 10"):
        RingCache((1, 10, 2, 8), (1, 10, 2, 8), seq_dim=1, sink=2, window=8, chunk=2, rope_at_read=rope)


def test_frame_maps_refuse_a_sink_that_splits_a_frame_and_a_wrong_head_size():
    fr = FrameRope(Rope3D(12, 1, 2))
    with pytest.raises(ValueError, match="not a whole number"):
        RingCache((1, 9, 2, 12), (1, 9, 2, 12), seq_dim=1, sink=1, window=8, chunk=2, rope_at_read=RopeAtRead(fr))
    with pytest.raises(ValueError, match="features"):
        RingCache((1, 10, 2, 8), (1, 10, 2, 8), seq_dim=1, sink=2, window=8, chunk=2, rope_at_read=RopeAtRead(fr))
    with pytest.raises(TypeError, match="RopeAtRead"):
        RingCache((1, 10, 2, 8), (1, 10, 2, 8), seq_dim=1, sink=2, window=8, chunk=2, rope_at_read="cache_relative")


def test_one_rope_at_read_serves_one_geometry():
    rope = RopeAtRead(Rope1D(8))
    RingCache((1, 10, 2, 8), (1, 10, 2, 8), seq_dim=1, sink=2, window=8, chunk=2, rope_at_read=rope)
    RingCache((1, 10, 2, 8), (1, 10, 2, 8), seq_dim=1, sink=2, window=8, chunk=2, rope_at_read=rope)  # same: fine
    with pytest.raises(ValueError, match="needs its own"):
        RingCache((1, 10, 2, 8), (1, 10, 2, 8), seq_dim=1, sink=4, window=6, chunk=2, rope_at_read=rope)


def test_a_map_sees_copies_of_the_positions_and_in_place_maps_are_refused():
    """A map that writes into its input must not move what the cache holds: ``units += 3`` is
    refused at construction (run on meta tensors), and a map that writes only later (past that
    check) gets copies, so the cache's slot positions and the span's query positions stay."""
    def add_in_place(inp, u):
        u += 3
        return u

    with pytest.raises(ValueError, match=r"writes into \['units'\] in place.*read-only"):
        position_map("custom", fn=add_in_place)
    with pytest.raises(ValueError, match=r"writes into \['inputs.held'\]"):
        position_map("custom", fn=lambda inp, u: inp.held.clamp_(min=0)[:, :3] * 0 + u)
    calls = []

    def later(inp, u):  # writes into its input from its second call on: the meta check cannot see it
        calls.append(1)
        if len(calls) > 1:
            u += 3
        return inp.rank(u) + 0

    for sink in (2, 0):
        calls.clear()
        c = RingCache((1, 10, 1, 8), (1, 10, 1, 8), seq_dim=1, sink=sink, window=10 - sink, chunk=2,
                      dtype=torch.float64, rope_at_read=RopeAtRead(Rope1D(8), position_map("custom", fn=later)))
        for i in range(3):
            c.begin_chunk(i)
            q, k, v = (torch.randn(1, 2, 1, 8, dtype=torch.float64) for _ in range(3))
            before = (c.slot_positions.clone(), c.layer(0).update(k, v).query_positions.clone())
            attend(q, c.layer(0).read())
            assert len(calls) > 1
            assert torch.equal(c.slot_positions, before[0]) and torch.equal(c.layer(0).read().query_positions, before[1])
            c.commit_chunk(i)
        assert c.slot_positions[0, 0].tolist() == list(range(6)) + [-1] * 4


def test_set_runs_the_constructions_checks_and_changes_nothing_when_refused():
    end = position_map("block_relative", horizon=10, anchor="end")
    with pytest.raises(ValueError, match="anchor='end' and a RoPE cut"):
        position_map("block_relative", horizon=10, anchor="end", cut=3)
    with pytest.raises(ValueError, match="anchor='end' and a RoPE cut"):
        end.set(cut=3)  # the same rule as at construction
    start = position_map("block_relative", horizon=10)
    with pytest.raises(ValueError, match=r"cut must be an int >= -1 \(-1: off\) and < 2\*\*53"):
        start.set(cut=2**63)  # not a raw int64 overflow inside torch
    with pytest.raises(ValueError, match=r"< 2\*\*53"):
        position_map("block_relative", horizon=10, cut=2**53)
    with pytest.raises(TypeError, match="cut must be an int, got float"):
        start.set(cut=3.0)
    assert end.params()["cut"] == -1 and start.params()["cut"] == -1
    start.set(cut=45)
    assert start.params()["cut"] == 45
    start.set(cut=-1)
    end.set(cut=-1)  # off: allowed with anchor='end'


def test_block_relative_refuses_spans_that_split_a_frame_where_its_horizon_is_too_short():
    """Frames of 2 tokens, a ring of 10 slots (5 frames): with 3-token chunks the window can hold 6
    frames, one more than horizon=5 places (a sink was rotated outside it). Refused at the first
    read of a span that ends inside a frame, at the cache's construction for a chunk that does;
    horizon=6 is exact."""
    fr = FrameRope(Rope3D(12, 1, 2))
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="chunk=3 tokens is not a whole number.*holds up to 6 units.*horizon=5"):
        RopeAtRead(fr, position_map("block_relative", horizon=5)).bind(
            sink=2, capacity=10, per_head=False, head_dim_size=12, device=cpu, chunk=3)
    RopeAtRead(fr, position_map("block_relative", horizon=5)).bind(
        sink=2, capacity=10, per_head=False, head_dim_size=12, device=cpu, chunk=4)  # whole frames: fine
    RopeAtRead(fr, position_map("block_relative", horizon=6)).bind(
        sink=2, capacity=10, per_head=False, head_dim_size=12, device=cpu, chunk=3)  # room for the split frame
    with pytest.raises(ValueError, match="chunk=3 tokens is not a whole number.*horizon=5"):  # the cache binds
        RingCache((1, 10, 2, 12), (1, 10, 2, 12), seq_dim=1, sink=2, window=8, chunk=3, dtype=torch.float64,
                  rope_at_read=RopeAtRead(fr, position_map("block_relative", horizon=5)))
    c = RingCache((1, 10, 2, 12), (1, 10, 2, 12), seq_dim=1, sink=2, window=8, chunk=4, dtype=torch.float64,
                  rope_at_read=RopeAtRead(fr, position_map("block_relative", horizon=5)))
    c.begin_tokens(3)  # begin_tokens of part of a frame: refused at the read
    q, k = (torch.randn(1, 3, 2, 12, dtype=torch.float64) for _ in range(2))
    with pytest.raises(ValueError, match=r"open span ends at position 3, inside a unit.*horizon=5"):
        attend(q, c.layer(0).update(k, k))
    lay = MapLayout(map="block_relative", kind="ring", rotary="frame", chunk=3, chunks=8, params=(("horizon", 6),))
    res = run_map_layout(lay)
    assert res.comparisons >= 8 and res.max_abs_diff < FP64, res


def test_a_horizon_given_in_tokens_to_a_frame_map_is_refused():
    """Horizons are in units (frames for FrameRope). 16 tokens per frame, a window cache of 80
    tokens = 5 frames: horizon=160 (tokens) is refused saying so; a frame horizon is not."""
    fr = FrameRope(Rope3D(12, 4, 4))
    shape = (1, 80, 2, 12)

    def ring(horizon, **kw):
        return RingCache(shape, shape, seq_dim=1, sink=16, window=64, chunk=16,
                         rope_at_read=RopeAtRead(fr, position_map("block_relative", horizon=horizon, **kw)))

    for tokens in (160, 80):
        with pytest.raises(ValueError, match=f"horizon={tokens}, and horizons are in units: here latent frames of 16"):
            ring(tokens)
    ring(21, anchor="end")  # a model's frame range (infinity-RoPE's F)
    ring(5)
    with pytest.raises(ValueError, match="horizon=4 units and this cache can hold 5"):
        ring(4)


def test_queries_of_another_row_count_than_the_open_span_are_refused():
    c = RingCache((1, 10, 2, 8), (1, 10, 2, 8), seq_dim=1, sink=2, window=8, chunk=4, dtype=torch.float64,
                  rope_at_read=RopeAtRead(Rope1D(8)))
    c.begin_chunk(0)
    q, k = (torch.randn(1, 4, 2, 8, dtype=torch.float64) for _ in range(2))
    read = c.layer(0).update(k, k)
    for rows in (1, 5):
        qq = torch.randn(1, rows, 2, 8, dtype=torch.float64)
        for order in ("physical", "chronological"):
            with pytest.raises(ValueError, match=f"q has {rows} rows and the open span 4"):
                attend(qq, read, order=order)
    assert attend(q, read)[0].shape == (1, 4, 2, 8)


def _streamed(rope, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = RingCache((1, 10, 2, 8), (1, 10, 2, 8), seq_dim=1, sink=2, window=8, chunk=2, dtype=torch.float64,
                  rope_at_read=rope)
    for i in range(6):
        c.begin_chunk(i)
        k = torch.randn(1, 2, 2, 8, generator=g, dtype=torch.float64)
        c.layer(0).update(k, k)
        c.commit_chunk(i)
    return c


def test_a_state_dict_records_whether_its_keys_are_raw_and_what_rotates_them(tmp_path):
    """Raw keys (rope_at_read) and keys as written mean different things: a state of one does not
    load into the other (both directions), nor under another rotary or map; the same loads,
    through torch.save / torch.load(weights_only=True) too."""
    raw = _streamed(RopeAtRead(Rope1D(8), "cache_relative"))
    written = _streamed(None)
    with pytest.raises(ValueError, match=r"state dict key_rotation must be 'as written.*got 'raw"):
        written.load_state_dict(raw.state_dict())
    with pytest.raises(ValueError, match=r"state dict key_rotation must be 'raw.*got 'as written"):
        raw.load_state_dict(written.state_dict())
    for other in (RopeAtRead(Rope1D(8, theta=100.0), "cache_relative"),  # another frequency table
                  RopeAtRead(Rope1D(8, style="interleaved"), "cache_relative"),
                  RopeAtRead(Rope1D(8), "sliding_sinks"),
                  RopeAtRead(Rope1D(8), position_map("block_relative", horizon=12))):
        with pytest.raises(ValueError, match="state dict rope must be"):
            _streamed(other).load_state_dict(raw.state_dict())
    a = _streamed(RopeAtRead(Rope1D(8), position_map("block_relative", horizon=12)), seed=1)
    b = _streamed(RopeAtRead(Rope1D(8), position_map("block_relative", horizon=12)), seed=2)
    torch.save(a.state_dict(), tmp_path / "s.pt")
    b.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert torch.equal(a.keys(0), b.keys(0)) and a.config() == b.config()
    assert a.config()["rope"]["maps"] == (("block_relative", (("anchor", "start"), ("horizon", 12))),)
    fr = RingCache((1, 8, 2, 12), (1, 8, 2, 12), seq_dim=1, sink=2, window=6, chunk=2,
                   rope_at_read=RopeAtRead(FrameRope(Rope3D(12, 1, 2))))
    assert fr.config()["rope"]["rotary"]["class"] == "FrameRope" and fr.config()["rope"]["rotary"]["bands"] == (4, 4, 4)


def test_a_cache_tells_its_state_dicts_how_its_keys_are_stored():
    c = RingCache((1, 10, 2, 8), (1, 10, 2, 8), seq_dim=1, sink=2, window=8, chunk=2, rope_at_read=RopeAtRead(Rope1D(8)))
    assert c.states.rope_at_read is c.rope_at_read


def test_reads_without_an_open_span_and_double_rotation_are_refused():
    c, read, q, rot = _stream_read("cache_relative")
    with pytest.raises(ValueError, match="rotate them twice"):
        attend(q, read, rope_mode="cache_relative", key_transform=lambda k: k)
    c.commit_chunk(4)
    closed = c.layer(0).read()
    with pytest.raises(ValueError, match="no span is open"):
        attend(q, closed)
    with pytest.raises(ValueError, match="was read before the cache's last"):
        attend(q, read)  # the read of the open span is stale once it is committed


def test_rejected_map_changes_change_nothing():
    pm = position_map("block_relative", horizon=10)
    rope = RopeAtRead(Rope1D(8), [pm, "absolute"])
    with pytest.raises(ValueError, match="no dynamic parameter"):
        pm.set(cut=3, origin=2)
    with pytest.raises(ValueError, match="int >= -1"):
        pm.set(cut=-5)
    with pytest.raises(ValueError, match="no dynamic parameter 'cutt'"):
        pm.set(cutt=3)
    assert pm.params()["cut"] == -1
    rope.use("absolute")
    with pytest.raises(ValueError, match="holds the maps"):
        rope.use("sliding_sinks")
    assert rope.current.name == "absolute" and int(rope._selected) == 1
    with pytest.raises(ValueError, match="must differ"):
        RopeAtRead(Rope1D(8), ["absolute", "absolute"])


def test_one_compiled_graph_across_fills_wraps_and_map_changes():
    """scripts/gpu_check.py's positions section, on the CPU: one dynamo frame (aot_eager) for a
    read step through filling, 5 wraps, every registry map switched in and a RoPE cut on and
    off (its CUDA-graph part is skipped here); the same as ``streamkv positions``' ``compile``."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check_positions", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.check_positions(torch.device("cpu"), quick=True)
    assert out["compile"]["frames"] == 1 and out["compile"]["rel_diff"] <= 1e-5
    assert {n: s for n, s, _ in mod.RESULTS}["RoPE at read: one CUDA graph across maps"] == "SKIP"


def test_the_docs_tables_are_the_registry():
    from pathlib import Path

    from streamkv.positions import registry_table

    root = Path(__file__).resolve().parents[1]
    for doc in ("docs/reference/registries.md",):  # generated by scripts/gen_docs.py; tests/test_docs.py checks it
        text = (root / doc).read_text()
        a = text.index("<!-- position-maps -->") + len("<!-- position-maps -->")
        b = text.index("<!-- /position-maps -->")
        assert text[a:b].strip() == registry_table(), doc


def test_the_fuzzers_position_hook_draws_the_registry():
    import random

    from streamkv_lab.fuzz_positions import draw_map_layout, fuzz_maps

    rng = random.Random(0)
    assert {draw_map_layout(rng).map for _ in range(200)} == set(POSITION_MAPS)
    out = fuzz_maps(12, random.Random(3))
    assert out["layouts"] == 12 and out["mismatches"] == 0 and out["max_abs_diff"] < 1e-12, out


def test_the_guide_example_runs():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "position-maps.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "docs/guides/position-maps.md", "exec"), scope)
    cache, rope, out = scope["cache"], scope["rope"], scope["out"]
    assert out.shape == (1, 16, 4, 32) and torch.isfinite(out).all()
    assert rope.current.name == "block_relative" and rope.map("block_relative").params()["cut"] == 45
    assert cache.next_chunk == 12 and (cache.slot_positions[..., :16] == torch.arange(16)).all()


def test_a_position_map_is_held_by_one_rope_at_read():
    """A map's dynamic parameters are the state of one RopeAtRead's streams: a second RopeAtRead
    given the same map object is refused (a set through one rotated the other's keys); a copy is
    taken, and a fork holds copies of its own."""
    pm = position_map("block_relative", **POSITION_MAPS["block_relative"].for_geometry(2, 10, 3))
    rope = RopeAtRead(Rope1D(8), pm)
    assert pm.holder is rope and rope.map("block_relative") is pm
    with pytest.raises(ValueError, match="already held by another RopeAtRead"):
        RopeAtRead(Rope1D(8), pm)
    other = RopeAtRead(Rope1D(8), pm.copy())
    other.map("block_relative").set(cut=3)
    assert pm.settings != other.map("block_relative").settings
    fork = rope.fork()
    assert fork.map("block_relative") is not pm and fork.map("block_relative").holder is fork
