"""The causal DiT and the streaming rollout: ring/chronological parity, compile without
recompiles, prompts and resets, and bad input caught before any state changes."""

import pytest
import torch
import torch._dynamo.testing

from conftest import assert_same_state, snapshot
from streamkv import CacheSet
from streamkv.layout import CacheLayout
from streamkv.models import CausalVideoDiT, get_config
from streamkv.rollout import Schedule, StreamingRollout

CFG = get_config("tiny")


@pytest.fixture(scope="module")
def model():
    return CausalVideoDiT(CFG, seed=0).eval()


def _two_streams(r, chunks=8, second=3, noise_seed=11):
    neg = "" if r.guidance > 1 else None
    r.set_prompt("a red fox", neg, seed=noise_seed)
    a = r.run(chunks)
    r.set_prompt("a sailing boat", "blurry" if neg is not None else None, seed=noise_seed + 1)
    b = r.run(second)
    return torch.cat([a, b], dim=2)


def test_tiny_config_exercises_every_phase():
    L = CacheLayout(sink=CFG.sink_tokens, window=CFG.window_tokens, chunk=CFG.chunk_tokens)
    assert 0 < L.sink % L.chunk  # the sink is part of a chunk: chunk 0 straddles it
    assert L.window % L.chunk  # the window is not a multiple of the chunk: chunks wrap mid-chunk
    assert L.first_eviction_chunk() < 8 and L.ring_wraps(8 * L.chunk) >= 2


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_ring_and_chronological_rollouts_match(model, guidance):
    outs = {}
    for kind in ("chronological", "ring"):
        r = StreamingRollout(model, cache=kind, guidance=guidance, seed=5)
        outs[kind] = _two_streams(r)
        assert r.caches.branches == (("cond", "uncond") if guidance > 1 else ("cond",))
    scale = outs["chronological"].abs().max().item()
    assert scale > 0.1
    diff = (outs["ring"] - outs["chronological"]).abs().max().item()
    assert diff <= 1e-5 * scale
    # the comparison is not vacuous: other noise gives another video
    other = _two_streams(StreamingRollout(model, cache="ring", guidance=guidance), noise_seed=21)
    assert (other - outs["ring"]).abs().max().item() > 1e-2


def test_every_denoising_step_rewrites_the_chunk(model):
    """The clean pass overwrites the noisy K/V: the committed cache equals a cache
    written once with the clean pass's K/V (the rollout with a 1-step schedule would differ)."""
    r = StreamingRollout(model, cache="ring", seed=5, instrument=True)
    r.set_prompt("a red fox")
    r.run(2)
    forwards = [c.forwards for c in r.stats.chunks]
    assert forwards == [len(r.schedule.timesteps) + 1] * 2
    assert all(m > 0 for m in r.stats.maintenance_per_step_ms())


def test_new_prompt_resets_the_stream(model):
    a = StreamingRollout(model, cache="ring", seed=5)
    a.set_prompt("first", seed=1)
    a.run(5)
    a.set_prompt("second", seed=2)
    assert a.caches["cond"].num_valid == 0 and a.chunk_idx == 0
    after_switch = a.run(3)
    b = StreamingRollout(model, cache="ring", seed=99)
    b.set_prompt("second", seed=2)
    fresh = b.run(3)
    assert torch.equal(after_switch, fresh)


def test_compile_has_no_recompiles_after_warm_up(model):
    """Warm-up: one stream through filling, the first eviction and two wraps. Then a
    reset and more streams: no new compilation."""
    for kind in ("ring", "chronological"):
        cnt = torch._dynamo.testing.CompileCounter()
        torch._dynamo.reset()
        r = StreamingRollout(model, cache=kind, guidance=3.0, seed=5, mode="compile", compile_backend=cnt)
        r.set_prompt("a red fox", "", seed=1)
        r.run(8)
        warm = cnt.frame_count
        assert warm >= 1
        r.set_prompt("a sailing boat", "blurry", seed=2)
        r.run(8)
        r.set_prompt("a red fox", "", seed=3)
        r.run(5)
        assert cnt.frame_count == warm, f"{kind}: recompiled after warm-up ({warm} -> {cnt.frame_count})"


def test_compiled_rollout_matches_eager(model):
    torch._dynamo.reset()
    c = StreamingRollout(model, cache="ring", guidance=3.0, seed=5, mode="compile", compile_backend="aot_eager")
    e = StreamingRollout(model, cache="ring", guidance=3.0, seed=5)
    out_c, out_e = _two_streams(c, chunks=6, second=2), _two_streams(e, chunks=6, second=2)
    assert (out_c - out_e).abs().max().item() <= 1e-5 * out_e.abs().max().item()


def test_cache_relative_rope_runs_on_the_chronological_path(model):
    r = StreamingRollout(model, cache="ring", rope_mode="cache_relative", seed=5)
    r.set_prompt("a red fox")
    rel = r.run(6)
    a = StreamingRollout(model, cache="ring", seed=5)
    a.set_prompt("a red fox")
    assert (rel - a.run(6)).abs().max().item() > 1e-3  # a different model, as expected
    chron = StreamingRollout(model, cache="chronological", rope_mode="cache_relative", seed=5)
    chron.set_prompt("a red fox")
    assert (chron.run(6) - rel).abs().max().item() <= 1e-5 * rel.abs().max().item()
    with pytest.raises(ValueError, match="order='physical' is invalid with rope_mode='cache_relative'"):
        StreamingRollout(model, cache="ring", rope_mode="cache_relative", order="physical")


# --------------------------------------------------------------------- bad input
def test_guidance_needs_a_negative_prompt(model):
    r = StreamingRollout(model, cache="ring", guidance=4.0)
    with pytest.raises(ValueError, match="guidance 4.0 > 1 needs a negative prompt"):
        r.set_prompt("a red fox")
    with pytest.raises(ValueError, match="guidance must be a finite number >= 1.0, got 0.5"):
        StreamingRollout(model, guidance=0.5)


def test_chunks_beyond_the_rope_horizon_fail_before_any_state_change(model):
    r = StreamingRollout(model, cache="ring", seed=5)
    r.set_prompt("a red fox")
    r.run(3)
    before = snapshot(r.caches)
    with pytest.raises(ValueError, match=r"chunk 32 is beyond the RoPE horizon: 64 frames hold 32 chunks"):
        r.run(CFG.max_chunks - 3 + 1)
    assert_same_state(before, snapshot(r.caches))
    assert r.chunk_idx == 3


def test_mismatched_latents_and_foreign_caches_are_rejected(model):
    r = StreamingRollout(model, cache="ring", seed=5)
    r.set_prompt("a red fox")
    before = snapshot(r.caches)
    with pytest.raises(ValueError, match=r"noise must have the latent shape \(1, 16, 2, 8, 8\), got \(1, 16, 2, 8, 6\)"):
        r.generate_chunk(torch.zeros(1, 16, 2, 8, 6))
    assert_same_state(before, snapshot(r.caches))
    wrong = CacheSet("ring", k_shape=(1, 96, 4, 16), v_shape=(1, 96, 4, 16), seq_dim=1, sink=16, window=80, chunk=16, num_layers=2)
    with pytest.raises(ValueError, match=r"cache was built for another model shape: chunk=16 \(model needs 32\)"):
        StreamingRollout(model, cache=wrong)
    with pytest.raises(RuntimeError, match="mode='graph' captures CUDA graphs"):
        StreamingRollout(model, mode="graph")
    with pytest.raises(ValueError, match="timesteps must decrease strictly"):
        Schedule(timesteps=(500, 750))


def test_cli_rollout_compare_writes_the_parity_json(tmp_path):
    import json

    from streamkv_lab.cli import main

    path = tmp_path / "r.json"
    assert main(["rollout", "--compare", "--chunks", "8", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["chunks"] == 8 and data["config"]["name"] == "tiny"
    for kind in ("chronological", "ring"):
        assert {"chunk_latency_ms", "maintenance_ms", "peak_bytes"} <= set(data[kind])
        assert data[kind]["peak_bytes"] > data[kind]["cache_bytes"] > 0
    assert data["max_abs_diff"]["ring"] <= 1e-5 * data["output_scale"]
    assert data["config"]["ring_wraps_first_stream"] >= 2


def test_demo_writes_its_table_json_and_plot(tmp_path):
    import json

    from streamkv_lab.cli import main

    assert main(["demo", "--out", str(tmp_path), "--chunks", "6", "--video-frames", "16"]) == 0
    data = json.loads((tmp_path / "demo.json").read_text())
    assert {"chronological", "ring", "mass"} <= set(data)
    assert data["ring"]["retains_window"] and not data["mass"]["retains_window"]
    assert data["max_abs_diff"]["ring"] <= 1e-5 * data["output_scale"]
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    assert (tmp_path / "demo.gif").stat().st_size > 0 and (tmp_path / "demo_panel.gif").stat().st_size > 0
    fork = json.loads((tmp_path / "fork.json").read_text())["video"]  # the fork section: exact branches
    assert fork["max_abs_diff_vs_unforked"] == 0 and len(fork["branches"]) == 4
    assert (tmp_path / "fork.gif").stat().st_size > 0
