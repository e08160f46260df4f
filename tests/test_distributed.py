"""Ulysses context parallelism: 2 gloo ranks on the CPU against one process.

The ranks are spawned once (module fixture); everything that needs a process group
runs inside them (``_rank_checks``) and comes back as tensors and numbers, compared
here against single-process rollouts of the same weights, prompts and noise.

Stream: 6 chunks of the tiny config (chunk 32 tokens, sink 16, window 80: the first
eviction at chunk 3, the ring wraps twice), a new prompt (reset), 3 more chunks; CFG on.
Forks: a paged rollout forks after 4 chunks on every rank (each its own head shard), and the
branches equal the single-process fork's.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch._dynamo.testing

from streamkv import CacheSet
from streamkv.distributed import ContextParallel, check_split, launch
from streamkv_lab.experiments import cp_compare
from streamkv_lab.experiments.cp_compare import compare_context_parallel
from streamkv.layout import CacheLayout
from streamkv.models import CausalVideoDiT, get_config
from streamkv.models.config import DiTConfig
from streamkv.rollout import StreamingRollout

CFG = get_config("tiny")
WORLD = 2
FIRST, SECOND = 6, 3  # chunks of the two streams
GUIDANCE = 3.0
KINDS = {"ring": {}, "chronological": {}, "mass": {"tau": 0.05}}
LAYOUT = CacheLayout(sink=CFG.sink_tokens, window=CFG.window_tokens, chunk=CFG.chunk_tokens)
FORKED = ("ring", "mass")  # a window kind and a per-head kind, forked on every rank


def _streams(r: StreamingRollout, first: int = FIRST, second: int = SECOND, after_first=None) -> torch.Tensor:
    r.set_prompt("a red fox", "blurry", seed=3)
    a = r.run(first)
    if after_first is not None:
        after_first(r)
    r.set_prompt("a sailing boat", "", seed=4)
    return torch.cat([a, r.run(second)], dim=2)


def _history(r: StreamingRollout) -> dict:
    """What one rank's caches hold after the first stream (cloned)."""
    out = {}
    for b in r.branches:
        c = r.caches[b]
        out[b] = dict(
            keys=c.keys(0).clone(), values=c.values(CFG.layers - 1).clone(), k_shape=c.k_shape,
            end=c.end, next_chunk=c.next_chunk, num_valid=c.num_valid, capacity=c.layout.capacity,
            slot_positions=c.layer_slot_positions(0).clone(),
        )
    return out


def _rollout(model, kind, cp=None, **kw) -> StreamingRollout:
    return StreamingRollout(model, cache=kind, guidance=GUIDANCE, seed=5, cp=cp, cache_kwargs=KINDS.get(kind), **kw)


def _forked(model, kind, cp=None) -> dict:
    """A paged rollout: 4 chunks, then two branches (the noise as drawn, seed 9) of 2 chunks each.
    With ``cp`` each rank forks its own head shard."""
    r = StreamingRollout(model, cache=kind, guidance=GUIDANCE, seed=5, cp=cp,
                         cache_kwargs={**KINDS[kind], "pages": {"spare": 12}})
    r.set_prompt("a red fox", "blurry", seed=3)
    prefix = r.run(4)
    a, b = r.fork(2, seeds=[None, 9])
    return dict(prefix=prefix, a=a.run(2), b=b.run(2), heads=a.caches["cond"].k_shape[2],
                shares=a.caches["uncond"].storage.store.table.pool is r.caches["uncond"].storage.store.table.pool)


@dataclass(frozen=True)
class _OtherRanksText(ContextParallel):
    """A broken group: each rank keeps another rank's heads of the text K/V."""

    def head_range(self, heads: int) -> tuple[int, int]:
        start, stop = super().head_range(heads)
        per = stop - start
        other = (self.rank + 1) % self.world_size
        return other * per, (other + 1) * per


def _rank_checks(cp: ContextParallel) -> dict:
    """Runs in every rank (spawned by ``launch``)."""
    res: dict = {"rank": cp.rank, "world_size": cp.world_size}
    # the exchanges on a tensor whose every element is distinct: [B, L, H, D]
    full = torch.arange(2 * 8 * 4 * 3, dtype=torch.float32).reshape(2, 8, 4, 3)
    shard = cp.shard_tokens(full)
    as_heads, doubled = cp.tokens_to_heads(shard, 2 * shard[..., :2])  # two D sizes, one exchange
    res["exchange"] = dict(
        shard=shard.clone(), as_heads=as_heads, doubled=doubled, back=cp.heads_to_tokens(as_heads),
        gathered=cp.gather_tokens(shard), head_range=cp.head_range(4),
    )
    model = CausalVideoDiT(CFG, seed=0).eval()
    for kind in KINDS:
        r = _rollout(model, kind, cp)
        hist = {}
        out = _streams(r, after_first=lambda r_: hist.update(_history(r_)))
        cross = sum(t.nbytes for kv in r._cross.values() for t in (*kv.keys, *kv.values))
        res[kind] = dict(output=out, history=hist, cache_bytes=r.caches.nbytes, cross_bytes=cross)
    r = _rollout(model, "ring", cp, rope_mode="cache_relative")
    res["cache_relative"] = _streams(r, first=4, second=1)
    # compile: the collectives are traced (fullgraph); warm-up is fill + the first eviction
    counter = torch._dynamo.testing.CompileCounter()
    r = _rollout(model, "ring", cp, mode="compile", compile_backend=counter)
    warm = {}
    res["compile"] = _streams(r, first=4, second=2, after_first=lambda r_: warm.update(frames=counter.frame_count))
    res["compile_frames"] = (warm["frames"], counter.frame_count)
    res["forked"] = {kind: _forked(model, kind, cp) for kind in FORKED}
    broken = _OtherRanksText(cp.world_size, cp.rank, cp.group)
    res["broken"] = _streams(_rollout(model, "ring", broken), first=2, second=1)
    return res


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return launch(_rank_checks, WORLD, threads=1)


@pytest.fixture(scope="module")
def single() -> dict:
    """The single-process runs (one thread, as each rank has)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = CausalVideoDiT(CFG, seed=0).eval()
        res = {}
        for kind in KINDS:
            r = _rollout(model, kind)
            hist = {}
            out = _streams(r, after_first=lambda r_: hist.update(_history(r_)))
            cross = sum(t.nbytes for kv in r._cross.values() for t in (*kv.keys, *kv.values))
            res[kind] = dict(output=out, history=hist, cache_bytes=r.caches.nbytes, cross_bytes=cross)
        res["cache_relative"] = _streams(_rollout(model, "ring", rope_mode="cache_relative"), first=4, second=1)
        res["compile"] = _streams(_rollout(model, "ring"), first=4, second=2)  # eager reference
        res["broken"] = _streams(_rollout(model, "ring"), first=2, second=1)
        res["forked"] = {kind: _forked(model, kind) for kind in FORKED}
        return res
    finally:
        torch.set_num_threads(threads)


def test_the_stream_evicts_and_wraps_twice():
    assert LAYOUT.first_eviction_chunk() < FIRST
    assert LAYOUT.ring_wraps(FIRST * LAYOUT.chunk) == 2
    check_split(heads=CFG.heads, chunk_tokens=CFG.chunk_tokens, world_size=WORLD)


def test_exchanges_trade_token_shards_for_head_shards(ranks):
    full = torch.arange(2 * 8 * 4 * 3, dtype=torch.float32).reshape(2, 8, 4, 3)
    for res in ranks:
        r, ex = res["rank"], res["exchange"]
        assert res["world_size"] == WORLD
        assert ex["head_range"] == (2 * r, 2 * r + 2)
        assert torch.equal(ex["shard"], full[:, 4 * r : 4 * r + 4])
        assert torch.equal(ex["as_heads"], full[:, :, 2 * r : 2 * r + 2])  # whole chunk, my heads, tokens in order
        assert torch.equal(ex["doubled"], 2 * full[:, :, 2 * r : 2 * r + 2, :2])
        assert torch.equal(ex["back"], ex["shard"])
        assert torch.equal(ex["gathered"], full)


@pytest.mark.parametrize("kind", list(KINDS))
def test_two_ranks_equal_one_process(ranks, single, kind):
    ref = single[kind]["output"]
    scale = ref.abs().max().item()
    assert scale > 0.1
    assert ref.shape[2] == (FIRST + SECOND) * CFG.frames_per_chunk
    for res in ranks:
        diff = (res[kind]["output"] - ref).abs().max().item()
        assert diff <= 1e-5 * scale, f"{kind} rank {res['rank']}: max |diff| {diff:.3e} vs scale {scale:.3f}"
    # the output is gathered: every rank holds the same bytes
    assert torch.equal(ranks[0][kind]["output"], ranks[1][kind]["output"])


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_rank_caches_its_heads_for_the_whole_window(ranks, single, kind):
    one = single[kind]
    assert one["cache_bytes"] == 2 * CFG.layers * 2 * (CFG.sink_tokens + CFG.window_tokens) * CFG.dim * 4
    for res in ranks:
        got = res[kind]
        assert got["cache_bytes"] * WORLD == one["cache_bytes"]
        assert got["cross_bytes"] * WORLD == one["cross_bytes"]
        h0, h1 = 2 * res["rank"], 2 * res["rank"] + 2
        for branch in ("cond", "uncond"):
            mine, full = got["history"][branch], one["history"][branch]
            assert mine["k_shape"] == (1, LAYOUT.capacity, CFG.heads // WORLD, CFG.head_dim)
            # host bookkeeping is the same on every rank and in the single process; the window is full
            for key in ("end", "next_chunk", "num_valid"):
                assert mine[key] == full[key], key
            assert mine["end"] == FIRST * CFG.chunk_tokens
            if kind != "mass":  # the mass budget keeps fewer tokens than its capacity
                assert mine["num_valid"] == mine["capacity"]
            sp = full["slot_positions"]
            assert torch.equal(mine["slot_positions"], sp if sp.dim() == 1 else sp[h0:h1])
            for t in ("keys", "values"):
                want = full[t][:, :, h0:h1]
                tol = 1e-5 * want.abs().max().item()
                assert (mine[t] - want).abs().max().item() <= tol, f"{kind} {branch} {t} rank {res['rank']}"


@pytest.mark.parametrize("kind", FORKED)
def test_each_rank_forks_its_head_shard_and_the_branches_equal_the_single_process_fork(ranks, single, kind):
    one = single["forked"][kind]
    assert one["heads"] == CFG.heads and one["shares"]
    assert (one["b"] - one["a"]).abs().max().item() > 1e-2  # other noise: another branch (the check can fail)
    for res in ranks:
        got = res["forked"][kind]
        assert got["heads"] == CFG.heads // WORLD and got["shares"]  # this rank's heads, pages shared with its parent
        for part in ("prefix", "a", "b"):
            ref = one[part]
            diff = (got[part] - ref).abs().max().item()
            assert diff <= 1e-5 * ref.abs().max().item(), f"{kind} {part} rank {res['rank']}: {diff:.3e}"
    assert all(torch.equal(ranks[0]["forked"][kind][p], ranks[1]["forked"][kind][p]) for p in ("a", "b"))


def test_cache_relative_rope_runs_head_sharded(ranks, single):
    ref = single["cache_relative"]
    for res in ranks:
        assert (res["cache_relative"] - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_compiled_ranks_equal_eager_one_process_without_recompiles(ranks, single):
    ref = single["compile"]
    for res in ranks:
        assert (res["compile"] - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
        warm, end = res["compile_frames"]
        assert warm >= 1 and end == warm, f"rank {res['rank']}: recompiled after warm-up ({warm} -> {end})"


def test_the_comparison_catches_a_wrong_head_assignment(ranks, single):
    """Each rank attending to another rank's text heads gives another video: the parity
    checks above can fail."""
    ref = single["broken"]
    for res in ranks:
        assert (res["broken"] - ref).abs().max().item() > 1e-2


# --------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def model():
    return CausalVideoDiT(CFG, seed=0).eval()


def test_heads_not_divisible_by_the_world_size(model):
    cp = ContextParallel(world_size=3, rank=0)
    with pytest.raises(ValueError, match=r"heads \(4\) must be divisible by the world size \(3\)"):
        StreamingRollout(model, cache="ring", cp=cp)
    with pytest.raises(ValueError, match=r"heads \(4\) must be divisible by the world size \(3\)"):
        model.cache_spec(1, world_size=3)


def test_chunk_tokens_not_divisible_by_the_world_size():
    # 6x6 latents, patch 2: 9 tokens per frame, 1-frame chunks
    cfg = DiTConfig(
        name="odd", dim=64, heads=4, ffn=64, layers=1, text_dim=8, text_len=4, latent_h=6, latent_w=6,
        frames_per_chunk=1, window_frames=2, sink_frames=0, max_frames=8,
    )
    odd = CausalVideoDiT(cfg)
    with pytest.raises(ValueError, match=r"chunk tokens \(9\) must be divisible by the world size \(2\) \(config 'odd': 1 frames x 9 tokens"):
        StreamingRollout(odd, cache="ring", cp=ContextParallel(world_size=2, rank=1))


def test_graph_mode_with_more_than_one_rank_is_refused(model):
    with pytest.raises(RuntimeError, match=r"mode='graph' with context parallelism \(world_size=2\) is not supported"):
        StreamingRollout(model, cache="ring", mode="graph", cp=ContextParallel(world_size=2, rank=0))


def test_a_cache_with_every_head_is_rejected_under_context_parallelism(model):
    full = CacheSet("ring", model.cache_spec(1))
    with pytest.raises(ValueError, match=r"k_shape=\(1, 96, 4, 16\) \(model needs \(1, 96, 2, 16\)\)"):
        StreamingRollout(model, cache=full, cp=ContextParallel(world_size=2, rank=0))


def test_group_arguments_are_checked():
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        ContextParallel(world_size=2, rank=2)
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        ContextParallel(world_size=0, rank=0)
    with pytest.raises(TypeError, match="rank must be an int, got float 1.0"):
        ContextParallel(world_size=2, rank=1.0)
    with pytest.raises(TypeError, match="cp must be a ContextParallel or None, got int"):
        StreamingRollout(CausalVideoDiT(CFG), cp=2)
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="needs an initialised torch.distributed process group"):
            ContextParallel.from_group()
    with pytest.raises(ValueError, match="nproc must be >= 1, got 0"):
        launch(_rank_checks, 0)


def test_compare_fails_before_anything_runs(monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("ran before validating")

    monkeypatch.setattr(cp_compare, "launch", must_not_run)
    monkeypatch.setattr(cp_compare, "_run", must_not_run)
    with pytest.raises(ValueError, match=r"heads \(4\) must be divisible by the world size \(3\) \(config 'tiny'"):
        compare_context_parallel(("ring",), nproc=3)
    with pytest.raises(RuntimeError, match=r"mode='graph' is not supported with context parallelism \(nproc=2\)"):
        compare_context_parallel(("ring",), nproc=2, mode="graph")


def test_torchrun_launches_the_same_comparison(tmp_path):
    """The context-parallel rollout under the launcher users already know: ``torchrun`` with
    ``env://`` initialisation (gloo), two ranks, against a single process on rank 0."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "cp.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "streamkv_lab.cli", "rollout", "--cache", "ring", "--chunks", "4", "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["world_size"] == 2 and data["config"]["launcher"] == "torchrun"
    assert data["max_abs_diff"]["ring"] <= 1e-5 * data["output_scale"]["ring"]
    assert data["ranks_agree"]["ring"] is True
    assert data["cache_bytes_per_rank"]["ring"] * 2 == data["cache_bytes_single"]["ring"]
    assert proc.stdout.count("wrote ") == 1  # rank 0 alone reports
