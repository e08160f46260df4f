"""A streamed diffusers Wan (``streamkv.integrations.diffusers``) against the real diffusers class.

Parity: every forward of a streamed rollout (each denoising step and the clean pass, both CFG
branches) equals one forward of the same ``WanTransformer3DModel`` over the clean context and
the chunk, through diffusers' own ``WanAttnProcessor`` and RoPE, with a block-causal mask
that hides what the cache did not hold (``wan_reference``). Tolerance: ``max |diff| <=
TOL * max(1, max |output|)`` with ``TOL = 4e-6`` (about 34 float32 epsilons). Measured on
this file's configs (CPU, torch 2.13, diffusers 0.42.1): streamed vs reference max |diff|
4.8e-7 .. 7.2e-7 at output scales 2.3 (ring, chronological, mass, h2o, tova; every step,
both branches); ring vs chronological 1.4e-6 on clean latents of scale 3.7 (guidance 3
amplifies), 8.9e-7 on the per-step outputs. The controls (a RoPE offset of 0 for every
chunk, a reference without the sink, the cond prompt on the uncond forwards, the window's
masks on a scored cache) miss by 0.067 .. 0.18: the checks fail when they should.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_state, snapshot
from diffusers import WanTransformer3DModel

import streamkv.integrations.diffusers as sw
from streamkv.integrations.diffusers import StreamingWan, WanStreamingRollout
from streamkv.integrations.wan_attention import CachedWanSelfAttention, wan_rope_tables
from streamkv.integrations.wan_reference import (StreamRecorder, recorded_masks, reference_chunk, reference_forward,
                                                 window_visibility)
from streamkv.rollout import Schedule

TOL = 4e-6
TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=64)
SCHEDULE = Schedule(timesteps=(1000.0, 500.0))  # 2 steps + the clean pass per chunk: 3 forwards per branch


def tiny_model(**changes) -> WanTransformer3DModel:
    torch.manual_seed(0)
    return WanTransformer3DModel(**{**TINY, **changes}).eval()


@pytest.fixture(scope="module")
def model() -> WanTransformer3DModel:
    return tiny_model()


def prompts(batch: int = 1):
    g = torch.Generator().manual_seed(7)
    return torch.randn(batch, 5, 16, generator=g), torch.randn(batch, 5, 16, generator=g)


def stream_of(model, kind="ring", *, sink=1, window=5, batch=1, guidance=3.0, chunks=6, **kw):
    """Run a recorded stream; returns (stream, records, clean chunks). The stream is detached."""
    stream = StreamingWan(model, frames_per_chunk=2, sink_frames=sink, window_frames=window, height=4, width=4,
                          batch=batch, cache=kind, branches=("cond", "uncond") if guidance > 1 else ("cond",), **kw)
    rollout = WanStreamingRollout(stream, guidance=guidance, schedule=SCHEDULE, seed=3)
    cond, uncond = prompts(batch)
    with stream, StreamRecorder(stream) as rec:
        rollout.set_prompt(cond, uncond if guidance > 1 else None, seed=11)
        clean = [rollout.generate_chunk() for _ in range(chunks)]
    assert not stream.attached
    return stream, rec.records, clean


def layout_masks(stream, record, *, sink=None):
    tokens = (record.chunk + 1) * stream.chunk_tokens
    return window_visibility(tokens, chunk=stream.spec.chunk, sink=stream.spec.sink if sink is None else sink,
                             window=stream.spec.window)


def worst(model, records, clean, masks_of, *, prompt_of=None):
    """(max |streamed - reference|, max |streamed|) over the records."""
    diff = scale = 0.0
    for r in records:
        if prompt_of is not None:
            r = type(r)(**{**vars(r), "prompt_embeds": prompt_of(r)})
        ref = reference_chunk(model, r, clean, masks_of(r))
        diff = max(diff, float((ref - r.output).abs().max()))
        scale = max(scale, float(r.output.abs().max()))
    return diff, scale


def assert_parity(diff, scale, what):
    assert diff <= TOL * max(1.0, scale), f"{what}: max |diff| {diff:.3e} at output scale {scale:.3f}"


# ------------------------------------------------------------------------- building blocks
def test_rope_tables_at_an_offset_are_diffusers_tables_of_the_longer_sequence(model):
    rope = model.rope
    chunk = torch.zeros(1, 4, 2, 6, 8)  # 2 frames of a 3 x 4 token grid
    assert all(torch.equal(a, b) for a, b in zip(wan_rope_tables(rope, 0, 2, 3, 4), rope(chunk)))
    for start in (1, 5, 62):
        whole = rope(torch.zeros(1, 4, start + 2, 6, 8))
        ours = wan_rope_tables(rope, start, 2, 3, 4)
        assert all(torch.equal(a, b[:, -24:]) for a, b in zip(ours, whole)), start
    with pytest.raises(ValueError, match="RoPE horizon of 64"):
        wan_rope_tables(rope, 63, 2, 3, 4)


def test_window_visibility_by_hand():
    # sink 1, window 3, chunk 2: chunk 0 = {0, 1}, chunk 1 = {2, 3} (sees 0 and 1..3), chunk 2 = {4, 5} (0, 3..5)
    want = torch.tensor([
        [1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0],
        [1, 0, 0, 1, 1, 1], [1, 0, 0, 1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(window_visibility(6, chunk=2, sink=1, window=3), want)


# ------------------------------------------------------------------------- parity
@pytest.mark.parametrize("kind", ["ring", "chronological"])
@pytest.mark.parametrize("sink,window", [(1, 5), (2, 4), (0, 4)])
def test_streamed_forwards_equal_the_block_causal_reference(model, kind, sink, window):
    stream, records, clean = stream_of(model, kind, sink=sink, window=window)
    assert len(records) == 6 * 3 * 2 and {r.branch for r in records} == {"cond", "uncond"}
    if kind == "ring":
        assert stream.caches["cond"].wraps >= 2  # 48 positions through 16 to 20 window slots
    diff, scale = worst(model, records, clean, lambda r: layout_masks(stream, r))
    assert_parity(diff, scale, f"{kind} sink={sink} window={window}")


def test_ring_equals_chronological_over_wraps_with_batch_two(model):
    ring, rec_r, clean_r = stream_of(model, "ring", sink=1, window=5, batch=2, chunks=7)
    chrono, rec_c, clean_c = stream_of(model, "chronological", sink=1, window=5, batch=2, chunks=7)
    assert ring.caches["cond"].wraps >= 2
    a, b = torch.cat(clean_r, 2), torch.cat(clean_c, 2)
    diff = float((a - b).abs().max())
    assert diff <= TOL * max(1.0, float(a.abs().max())), diff
    steps = max(float((x.output - y.output).abs().max()) for x, y in zip(rec_r, rec_c))
    assert steps <= TOL * max(1.0, max(float(x.output.abs().max()) for x in rec_r)), steps
    assert_parity(*worst(model, rec_r, clean_r, lambda r: layout_masks(ring, r)), "ring batch 2")


@pytest.mark.parametrize("kind,kwargs", [("mass", {"tau": 0.2}), ("h2o", {}), ("tova", {})])
def test_scored_kinds_equal_the_reference_over_what_they_held(model, kind, kwargs):
    stream, records, clean = stream_of(model, kind, sink=1, window=6, cache_kwargs=kwargs)
    diff, scale = worst(model, records, clean, lambda r: recorded_masks(records, r, stream.chunk_tokens))
    assert_parity(diff, scale, kind)
    assert stream.caches["cond"].report()["evicted_total"] > 0
    # control: what the policy held is not the window (the per-head masks are needed)
    control, _ = worst(model, records, clean, lambda r: layout_masks(stream, r))
    assert control > 1e3 * TOL * max(1.0, scale), f"{kind}: the window's masks also fit ({control:.2e})"


def test_cfg_branches_are_independent(model):
    stream, records, clean = stream_of(model, "ring", sink=1, window=5)
    cond, uncond = prompts()
    unc = [r for r in records if r.branch == "uncond"]
    assert all(torch.equal(r.prompt_embeds, uncond) for r in unc)
    assert_parity(*worst(model, unc, clean, lambda r: layout_masks(stream, r)), "uncond")
    # control: the uncond forwards are not what the cond prompt would give over the same context
    swapped, scale = worst(model, unc, clean, lambda r: layout_masks(stream, r), prompt_of=lambda r: cond)
    assert swapped > 1e3 * TOL * max(1.0, scale), swapped


# ------------------------------------------------------------------------- controls
def test_control_a_wrong_rope_offset_breaks_parity(model, monkeypatch):
    real = sw.wan_rope_tables
    monkeypatch.setattr(sw, "wan_rope_tables", lambda rope, start, *a: real(rope, 0, *a))  # every chunk at frame 0
    stream, records, clean = stream_of(model, "ring", sink=1, window=5, chunks=3)
    first = [r for r in records if r.chunk == 0]
    later = [r for r in records if r.chunk > 0]
    assert_parity(*worst(model, first, clean, lambda r: layout_masks(stream, r)), "chunk 0 (offset 0 is right)")
    diff, scale = worst(model, later, clean, lambda r: layout_masks(stream, r))
    assert diff > 1e3 * TOL * max(1.0, scale), diff


def test_control_a_missing_sink_breaks_parity(model):
    stream, records, clean = stream_of(model, "ring", sink=2, window=4)
    late = [r for r in records if (r.chunk + 1) * 2 > 2 + 4]  # the sink is outside the window from here on
    diff, scale = worst(model, late, clean, lambda r: layout_masks(stream, r, sink=0))
    assert diff > 1e3 * TOL * max(1.0, scale), diff


# ------------------------------------------------------------------------- lifecycle and refusals
def test_detach_restores_the_model(model):
    x, t, (e, _) = torch.randn(1, 4, 2, 4, 4), torch.tensor([500.0]), prompts()
    with torch.no_grad():
        before = model(hidden_states=x, timestep=t, encoder_hidden_states=e, return_dict=False)[0]
    procs = dict(model.attn_processors)
    stream = StreamingWan(model, frames_per_chunk=2, sink_frames=0, window_frames=4, height=4, width=4)
    try:
        attached_checks(model, stream, x, t, e)
    finally:
        stream.detach()
    stream.detach()
    assert all(model.attn_processors[k] is v for k, v in procs.items())
    with torch.no_grad():
        after = model(hidden_states=x, timestep=t, encoder_hidden_states=e, return_dict=False)[0]
    assert torch.equal(before, after)
    with pytest.raises(RuntimeError, match="detached"):
        stream.forward("cond", x, 0.0, e)


def attached_checks(model, stream, x, t, e):
    assert isinstance(model.blocks[1].attn1.processor, CachedWanSelfAttention)
    with pytest.raises(RuntimeError, match="already attached"):
        StreamingWan(model, frames_per_chunk=2, sink_frames=0, window_frames=4, height=4, width=4)
    with pytest.raises(RuntimeError, match="outside a streaming forward"), torch.no_grad():
        model(hidden_states=x, timestep=t, encoder_hidden_states=e)
    with pytest.raises(RuntimeError, match="detach"):
        reference_forward(model, x, torch.zeros(1, 8), e, torch.ones(8, 8, dtype=torch.bool))


def test_bad_input_is_refused_and_leaves_the_cache_unchanged(model):
    e, _ = prompts()
    with StreamingWan(model, frames_per_chunk=2, sink_frames=1, window_frames=5, height=4, width=4) as stream:
        with pytest.raises(RuntimeError, match="no open chunk"):
            stream.forward("cond", torch.randn(1, 4, 2, 4, 4), 0.0, e)
        stream.begin_chunk(0)
        before = snapshot(stream.caches["cond"])
        with pytest.raises(ValueError, match=r"latents must have the chunk's shape \(1, 4, 2, 4, 4\)"):
            stream.forward("cond", torch.randn(1, 4, 3, 4, 4), 0.0, e)
        with pytest.raises(ValueError, match="prompt_embeds must be"):
            stream.forward("cond", torch.randn(1, 4, 2, 4, 4), 0.0, e[0])
        with pytest.raises(ValueError, match="attention_mask of shape"):
            model.blocks[0].attn1(torch.randn(1, 8, 24), None, torch.ones(8, 8, dtype=torch.bool), (None, None))
        assert_same_state(before, snapshot(stream.caches["cond"]))
        mine = model.blocks[1].attn1.processor
        model.blocks[1].attn1.set_processor(model.blocks[0].attn2.processor)
        try:
            with pytest.raises(RuntimeError, match=r"blocks \[1\] were replaced"):
                stream.forward("cond", torch.randn(1, 4, 2, 4, 4), 0.0, e)
        finally:
            model.blocks[1].attn1.set_processor(mine)
        with pytest.raises(KeyError, match="uncond"):
            stream.forward("uncond", torch.randn(1, 4, 2, 4, 4), 0.0, e)
        with pytest.raises(ValueError, match="guidance 3.0 needs cache branches"):
            WanStreamingRollout(stream, guidance=3.0)


def test_sizes_and_models_that_cannot_stream_are_refused():
    with pytest.raises(TypeError, match="WanTransformer3DModel"):
        StreamingWan(torch.nn.Linear(2, 2), frames_per_chunk=2, sink_frames=0, window_frames=4, height=4, width=4)
    i2v = tiny_model(added_kv_proj_dim=16, image_dim=16)
    with pytest.raises(ValueError, match="image-conditioned"):
        StreamingWan(i2v, frames_per_chunk=2, sink_frames=0, window_frames=4, height=4, width=4)
    m = tiny_model(patch_size=(2, 2, 2))
    with pytest.raises(ValueError, match="frames_per_chunk must be a multiple of the temporal patch 2, got 3"):
        StreamingWan(m, frames_per_chunk=3, sink_frames=0, window_frames=6, height=4, width=4)
    short = tiny_model(rope_max_seq_len=8)
    with StreamingWan(short, frames_per_chunk=2, sink_frames=0, window_frames=4, height=4, width=4) as stream:
        assert stream.max_chunks == 4
        with pytest.raises(ValueError, match="chunk 4 is past the RoPE horizon"):
            stream.begin_chunk(4)


def test_cli_rollout_model_diffusers_wan_writes_json(tmp_path):
    import json

    from streamkv_lab.cli import main

    path = tmp_path / "wan.json"
    assert main(["rollout", "--model", "diffusers-wan", "--cache", "ring", "--chunks", "5", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["model"] == "diffusers-wan" and data["config"]["ring_wraps"] >= 1
    assert data["ring"]["reference_masks"] == "layout"
    assert data["ring"]["reference_max_abs_diff"] <= TOL * max(1.0, data["output_scale"])
    assert main(["rollout", "--model", "diffusers-wan", "--mode", "compile"]) == 2
