"""The watchable part of ``streamkv fork``: the trained toy continues one shared prefix in several
branches (other noise; another prompt if asked), side by side, with what each branch costs.
Branch 0 draws the noise the prefix's generator draws next, the other noise branches re-seed it,
and a prompt branch draws branch 0's noise under another prompt.

The prefix: a held-out clip's first :data:`~streamkv_lab.video.config.CONTEXT_FRAMES` frames
committed from the ground truth, then generated up to ``prefix_frames`` (by default a full cache:
sinks + window). The rollout's ring keeps its rows in pages (``pages=``); it forks, and every
branch generates the rest with its own noise seed (or, for a prompt branch, the parent's noise
under another prompt: the toy was trained on one prompt, so this exercises the mechanism, not
what prompts mean). Each branch is checked against a rollout that never forked, fed the same
prefix, noise and prompt (``max_abs_diff_vs_unforked``: 0 when exact).

Outputs (in the output folder): ``fork.gif`` (ground truth | every branch, the shared prefix then
its continuation), ``fork.png`` (the same as a contact sheet, every 2nd frame).

Costs, from the pool the branches share: the pages each branch took (its own chunks) x bytes per
page, one chunk after the fork and at the end, beside one cache and ``n`` full copies; the fork's
time beside one chunk's attention (every layer's ``attend`` of a chunk of queries over the full
cache). At this size (128 slots, 4 layers) attention costs microseconds and the fork's Python
bookkeeping is not small beside it; ``streamkv fork --memory`` measures at a real shape.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from streamkv.attention import attend
from streamkv_lab.experiments.fork_memory import page_report
from streamkv.rollout import StreamingRollout

from . import data
from .demo import DEMO_SEED
from .render import contact_sheet, tile_frames, write_gif
from .toy import CONTEXT_FRAMES, PROMPT, SCHEDULE, WEIGHTS, load_model, training_horizon

__all__ = ["fork_video"]


def _rollout(model, seed: int, pages: dict | None) -> StreamingRollout:
    r = StreamingRollout(model, cache="ring", schedule=SCHEDULE, seed=seed,
                         cache_kwargs={"pages": pages} if pages else None)
    r.set_prompt(PROMPT, seed=seed)
    return r


def _prefix(r: StreamingRollout, ctx: torch.Tensor, prefix_frames: int) -> list[torch.Tensor]:
    fpc = r.model.cfg.frames_per_chunk
    out = [r.prefill_chunk(ctx[:, :, i:i + fpc]) for i in range(0, ctx.shape[2], fpc)]
    return out + [r.generate_chunk() for _ in range((prefix_frames - ctx.shape[2]) // fpc)]


def _median_s(fn: Callable[[], Any], repeats: int, after: Callable[[Any], None] | None = None) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        got = fn()
        times.append(time.perf_counter() - t0)
        if after is not None:
            after(got)
    return statistics.median(times)


@torch.no_grad()
def fork_video(out: str | Path, *, branches: int = 4, prompts: Sequence[str] = (), prefix_frames: int | None = None,
               frames: int = 24, seed: int = 0, clip: int = 0, weights: str | Path = WEIGHTS, repeats: int = 20,
               progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """See the module docstring; writes the GIF and the contact sheet, returns the JSON."""
    t_start = time.perf_counter()
    say = progress or (lambda _msg: None)
    out = Path(out)
    model = load_model(weights)
    cfg = model.cfg
    fpc, capacity = cfg.frames_per_chunk, cfg.sink_frames + cfg.window_frames
    prefix_frames = capacity if prefix_frames is None else prefix_frames
    # branch 0 draws the noise the prefix's generator would draw next; the others re-seed; prompt
    # branches draw branch 0's noise under another prompt (the prompt is their only difference)
    labels = ["noise as drawn"] + [f"noise seed {seed + i}" for i in range(1, branches)] + \
        [f"prompt {p!r}" for p in prompts]
    seeds = [None] + [seed + i for i in range(1, branches)] + [None] * len(prompts)
    switch = [None] * branches + list(prompts)
    n = len(labels)
    _, _, rgb = data.make_clip(DEMO_SEED, clip, frames)
    ctx = data.to_latents(rgb)[None][:, :, :CONTEXT_FRAMES]

    say("the shared prefix")
    own_pages = -(-(cfg.sink_tokens + cfg.window_tokens) // cfg.chunk_tokens)
    root = _rollout(model, seed, {"spare": n * own_pages})  # each branch may come to own every page
    prefix = _prefix(root, ctx, prefix_frames)
    cache = root.caches["cond"]

    say("timing the fork and one chunk's attention")
    fork_s = _median_s(lambda: root.caches.fork(n), repeats, lambda sets: [s.release() for s in sets])
    g = torch.Generator().manual_seed(seed)
    qs = torch.randn((1, cfg.chunk_tokens, cfg.heads, cfg.head_dim), generator=g)
    reads = [cache.read(layer) for layer in range(cfg.layers)]
    attn_s = _median_s(lambda: [attend(qs, r) for r in reads], repeats)

    say(f"{n} branches")
    forks = root.fork(n, seeds=seeds, prompts=switch)
    rest = (frames - prefix_frames) // fpc
    chunks: list[list[torch.Tensor]] = [[b.generate_chunk()] for b in forks]
    one_chunk = page_report([cache, *[b.caches["cond"] for b in forks]])
    for b, got in zip(forks, chunks):
        got += [b.generate_chunk() for _ in range(rest - 1)]
    end = page_report([cache, *[b.caches["cond"] for b in forks]])

    say("the unforked references")
    diffs = []
    for s, p, got in zip(seeds, switch, chunks):
        ref = _rollout(model, seed, None)
        _prefix(ref, ctx, prefix_frames)
        if s is not None:
            ref.reseed(s)
        if p is not None:
            ref.switch_prompt(p)
        want = torch.cat([ref.generate_chunk() for _ in range(rest)], dim=2)
        diffs.append(float((torch.cat(got, dim=2) - want).abs().max()))

    videos = {label: data.to_rgb(torch.cat([*prefix, *got], dim=2)[0]) for label, got in zip(labels, chunks)}
    streams = {"ground truth": rgb, **{f"{i}: {label}": v for i, (label, v) in enumerate(videos.items())}}
    write_gif(tile_frames(streams, scale=8, horizon=training_horizon(weights), context=CONTEXT_FRAMES),
              out / "fork.gif")
    contact_sheet(streams, out / "fork.png", every=2)
    first = next(iter(videos.values()))
    page_bytes, one = end["page_bytes"], end["one_cache_bytes"]
    per_branch = [{
        "label": label, "seed": s, "prompt": p, "max_abs_diff_vs_unforked": d,
        "bytes_added_one_chunk_after": one_chunk["bytes_added"][1 + i], "bytes_added_end": end["bytes_added"][1 + i],
        "pages_added_end": end["private_pages"][1 + i],
        "mean_abs_diff_vs_branch0_after_fork": float(np.abs(v[prefix_frames:] - first[prefix_frames:]).mean()),
    } for i, (label, s, p, d, v) in enumerate(zip(labels, seeds, switch, diffs, videos.values()))]
    return {
        "clip": {"seed": DEMO_SEED, "index": clip, "frames": frames, "context_frames": CONTEXT_FRAMES,
                 "prefix_frames": prefix_frames, "capacity_frames": capacity, "chunk_frames": fpc},
        "branches": per_branch,
        "memory": {
            "page_bytes": page_bytes, "one_cache_bytes": one,
            "one_chunk_after": {"pool_bytes_in_use": one_chunk["bytes_in_use"],
                                "ratio_vs_one_cache": one_chunk["bytes_in_use"] / one,
                                "full_copies_bytes": (n + 1) * one},
            "end": {"pool_bytes_in_use": end["bytes_in_use"], "ratio_vs_one_cache": end["bytes_in_use"] / one,
                    "full_copies_bytes": (n + 1) * one},
            "note": "full copies: the parent and every branch as a whole cache of its own",
        },
        "time": {"fork_s": fork_s, "chunk_attention_s": attn_s, "fork_over_attention": fork_s / attn_s,
                 "branches_forked": n, "repeats": repeats},
        "max_abs_diff_vs_unforked": max(diffs),
        "files": ["fork.gif", "fork.png"],
        "wall_s": time.perf_counter() - t_start,
    }
