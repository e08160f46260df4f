"""The trained toy video model's own attention inputs: the ``toy`` dataset of ``streamkv certify
--real`` (:class:`~streamkv_lab.experiments.twotier.Stream`).

The toy DiT (:mod:`.toy`, the committed weights) streams clip ``index`` of data seed ``seed``:
the first :data:`~.toy.CONTEXT_FRAMES` ground-truth frames committed, the rest generated with
its 4-step schedule, on a ring that holds every frame of the stream (nothing is evicted, so the
model's attention is full-history attention). A :class:`~streamkv.caches.CacheObserver` records,
per layer and chunk, the queries (``on_queries``) and keys / values (``on_write``) of the pass
that is committed: the clean pass of a generated chunk, the only pass of a prefilled one. Keys
and queries carry the model's absolute 3D RoPE (applied before the write), so replaying them
through another cache is exactly what the model's attention would read. Every query of a chunk
sees the whole chunk (``causal=False``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from streamkv.caches import CacheObserver, KVCache

__all__ = ["toy_stream"]


class _Recorder(CacheObserver):
    """The committed pass's q / k / v of every layer, a chunk at a time."""

    def __init__(self, cache: KVCache) -> None:
        L = cache.num_layers
        self.q: list[list[Tensor]] = [[] for _ in range(L)]
        self.k: list[list[Tensor]] = [[] for _ in range(L)]
        self.v: list[list[Tensor]] = [[] for _ in range(L)]
        self._last: dict[int, list[Tensor | None]] = {i: [None, None, None] for i in range(L)}
        cache.add_observer(self)

    def on_write(self, cache: KVCache, layer: int, k: Tensor, v: Tensor) -> None:
        self._last[layer][1:] = [k.detach().clone(), v.detach().clone()]

    def on_queries(self, cache: KVCache, layer: int, q: Tensor) -> None:
        self._last[layer][0] = q.detach().clone()

    def on_commit(self, cache: KVCache, chunk_idx: int) -> None:
        for layer, (q, k, v) in self._last.items():
            if q is None or k is None:
                raise RuntimeError(f"chunk {chunk_idx} of layer {layer} was committed without queries and a write")
            self.q[layer].append(q)
            self.k[layer].append(k)
            self.v[layer].append(v)
        self._last = {i: [None, None, None] for i in self._last}


@torch.no_grad()
def toy_stream(frames: int = 48, seed: int = 0, index: int = 0) -> Any:
    """The toy model's q / k / v over ``frames`` frames of clip ``index`` (see the module docstring)."""
    from streamkv_lab.experiments.twotier import Stream
    from streamkv.rollout import StreamingRollout

    from .data import make_clip, to_latents
    from .toy import CONTEXT_FRAMES, PROMPT, SCHEDULE, WEIGHTS, geometry_model, load_model

    base = load_model()
    cfg = base.cfg
    fpc = cfg.frames_per_chunk
    if frames % fpc or frames <= CONTEXT_FRAMES or frames + cfg.sink_frames > cfg.max_frames:
        raise ValueError(f"frames must be a multiple of the chunk ({fpc} frames), > the {CONTEXT_FRAMES} context "
                         f"frames and fit the model's {cfg.max_frames}-frame RoPE horizon, got {frames}")
    model = geometry_model(base, sink_frames=cfg.sink_frames, window_frames=frames)  # holds every frame
    _, _, rgb = make_clip(seed, index, frames)
    context = to_latents(rgb)[None, :, :CONTEXT_FRAMES]
    roll = StreamingRollout(model, cache="ring", batch=1, schedule=SCHEDULE, seed=seed)
    roll.set_prompt(PROMPT, seed=seed)
    rec = _Recorder(roll.caches[roll.branches[0]])
    for i in range(0, CONTEXT_FRAMES, fpc):
        roll.prefill_chunk(context[:, :, i : i + fpc])
    for _ in range((frames - CONTEXT_FRAMES) // fpc):
        roll.generate_chunk()
    q, k, v = ([torch.cat(x, 1) for x in per] for per in (rec.q, rec.k, rec.v))
    C = fpc * cfg.tokens_per_frame
    return Stream("toy", q, k, v, chunk=C, causal=False, scale=cfg.head_dim ** -0.5,
                  info={"model": "toy DiT (" + WEIGHTS.name + ")", "frames": frames, "seed": seed, "index": index,
                        "context_frames": CONTEXT_FRAMES, "chunk": C, "causal": False,
                        "passes": len(SCHEDULE.timesteps) + 1, "recorded_pass": "the committed (clean) pass"})
