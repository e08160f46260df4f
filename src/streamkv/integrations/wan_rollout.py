"""``WanStreamingRollout``: the Self-Forcing chunk loop over a :class:`StreamingWan`.

For each chunk ``c`` (as :class:`streamkv.rollout.StreamingRollout` does for the built-in DiT)::

    stream.begin_chunk(c)                       every branch reserves the chunk's slots
    x = noise
    for sigma_i in schedule.sigmas():           flow matching; Wan's timestep is 1000 * sigma
        flow = Wan(x, 1000 sigma_i)  [cond, uncond]     every pass rewrites the chunk's slots
        x0 = x - sigma_i * flow
        x = (1 - sigma_next) * x0 + sigma_next * fresh noise
    Wan(x0, t=0)  [cond, uncond]                the clean pass writes the chunk's final K/V
    stream.commit_chunk(c)

Guidance ``g > 1`` runs the ``uncond`` branch on its own cache with the negative prompt:
``flow = flow_u + g * (flow_c - flow_u)``. The branches share nothing but the latents.

``fork(n, seeds=, prompt_embeds=)`` continues one stream in ``n`` rollouts (same prefix,
different noise or text) over caches built with ``pages=``: the history's pages are shared
copy-on-write, each branch writes its own chunks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..rollout import Schedule
from ..storage import check_int

if TYPE_CHECKING:
    from .diffusers import StreamingWan

__all__ = ["WanStreamingRollout"]


class WanStreamingRollout:
    """Flow-matching rollout of a streamed diffusers Wan, chunk by chunk (module docstring).

    Args:
        stream: a :class:`~streamkv.integrations.diffusers.StreamingWan` (attached); with
            ``guidance > 1`` its caches need the branches ``("cond", "uncond")``.
        guidance: classifier-free guidance scale (``>= 1``; ``1`` runs ``cond`` only).
        schedule: denoising timesteps and shift (:class:`~streamkv.rollout.Schedule`).
        seed: seed of the noise generator (on the model's device).

    Attributes:
        chunk_seconds: wall time of each generated chunk (host clock; synchronised on CUDA).
        forwards: model forwards so far (all branches).

    Raises:
        TypeError: ``stream`` is not a StreamingWan.
        ValueError: a guidance below 1 or not finite; guidance without an ``uncond`` branch.
    """

    def __init__(self, stream: StreamingWan, *, guidance: float = 1.0, schedule: Schedule | None = None,
                 seed: int = 0) -> None:
        from .diffusers import StreamingWan

        if not isinstance(stream, StreamingWan):
            raise TypeError(f"stream must be a StreamingWan, got {type(stream).__name__}")
        if isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or not math.isfinite(guidance) \
                or guidance < 1.0:
            raise ValueError(f"guidance must be a finite number >= 1.0, got {guidance!r}")
        self.branches = ("cond", "uncond") if guidance > 1.0 else ("cond",)
        missing = [b for b in self.branches if b not in stream.caches.branches]
        if missing:
            raise ValueError(f"guidance {guidance} needs cache branches {list(self.branches)}; the stream has "
                             f"{list(stream.caches.branches)} (build it with branches=('cond', 'uncond'))")
        if schedule is not None and not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be a streamkv.rollout.Schedule or None, got {type(schedule).__name__}")
        self.stream = stream
        self.guidance = float(guidance)
        self.schedule = schedule or Schedule()
        param = stream.model.blocks[0].attn1.to_k.weight
        self.dtype, self.device = param.dtype, param.device
        self._gen = torch.Generator(device=self.device).manual_seed(_seed(seed))
        self._prompts: dict[str, Tensor] = {}
        self._chunk = 0
        self.chunk_seconds: list[float] = []
        self.forwards = 0

    def set_prompt(self, prompt_embeds: Tensor, negative_prompt_embeds: Tensor | None = None, *,
                   seed: int | None = None) -> None:
        """Start a new stream: reset the rollout's caches and take the text states
        (``[B, text_len, text_dim]``, floating, converted to the model's dtype and device; the
        negative ones are required when guidance > 1, refused otherwise). ``seed`` re-seeds the
        noise (otherwise its sequence continues). Every argument is checked before the reset:
        a refused call changes nothing."""
        prompts = {"cond": prompt_embeds}
        if self.guidance > 1.0:
            if negative_prompt_embeds is None:
                raise ValueError(f"guidance {self.guidance} > 1 needs negative_prompt_embeds (the uncond branch)")
            prompts["uncond"] = negative_prompt_embeds
        elif negative_prompt_embeds is not None:
            raise ValueError(f"negative_prompt_embeds given, but guidance {self.guidance} runs the cond branch only "
                             f"(they would be ignored)")
        for name, t in prompts.items():
            self.stream.check_prompt(f"{name} prompt states", t, cast=True)
        seed = None if seed is None else _seed(seed)
        self.stream.check_ready()
        # every check passed: nothing below refuses
        self.stream.reset(self.branches)
        self._prompts = {b: t.to(device=self.device, dtype=self.dtype) for b, t in prompts.items()}
        self._chunk = 0
        if seed is not None:
            self._gen.manual_seed(seed)

    def switch_prompt(self, prompt_embeds: Tensor, negative_prompt_embeds: Tensor | None = None) -> None:
        """Continue the stream under other text states: the caches (the history) are kept, the next
        chunks' cross-attention reads the new states. ``negative_prompt_embeds`` (guidance > 1)
        replaces the ``uncond`` branch's; None keeps it. Checked as :meth:`set_prompt` checks; a
        refused call changes nothing."""
        prompts = self._check_switch(prompt_embeds, negative_prompt_embeds)
        self._prompts = {**self._prompts, **prompts}

    def _check_switch(self, prompt_embeds: Tensor | None, negative_prompt_embeds: Tensor | None) -> dict[str, Tensor]:
        if not self._prompts:
            raise RuntimeError("switching prompts continues a stream: set_prompt(...) first")
        if negative_prompt_embeds is not None and self.guidance == 1.0:
            raise ValueError(f"negative_prompt_embeds given, but guidance {self.guidance} runs the cond branch only")
        prompts = {b: t for b, t in (("cond", prompt_embeds), ("uncond", negative_prompt_embeds)) if t is not None}
        for name, t in prompts.items():
            self.stream.check_prompt(f"{name} prompt states", t, cast=True)
        return {b: t.to(device=self.device, dtype=self.dtype) for b, t in prompts.items()}

    def reseed(self, seed: int) -> None:
        """Re-seed the noise generator; the stream is kept."""
        self._gen.manual_seed(_seed(seed))

    def fork(self, n: int = 1, *, seeds: Sequence[int | None] | None = None,
             prompt_embeds: Sequence[Tensor | None] | None = None,
             negative_prompt_embeds: Sequence[Tensor | None] | None = None) -> list[WanStreamingRollout]:
        """``n`` rollouts continuing this stream (its caches built with ``pages=``, e.g.
        ``StreamingWan(..., cache_kwargs={"pages": {"spare": 8}})``): each on a forked stream
        (:meth:`StreamingWan.fork`: the history's pages shared copy-on-write, the model's processors
        shared), the noise generator where this one's stands unless ``seeds[i]`` re-seeds branch
        ``i``, and the text states this one has unless ``prompt_embeds[i]`` (and
        ``negative_prompt_embeds[i]``) continue branch ``i`` under others (:meth:`switch_prompt`).
        This rollout stays usable. Everything is checked before any cache forks: a refused call
        changes nothing (``ValueError``: lists of another length than ``n``, caches without pages,
        a chunk left open by a failed attempt; ``RuntimeError``: no stream yet, a detached stream)."""
        n = check_int("n", n, 1)
        per = {}
        for name, values in (("seeds", seeds), ("prompt_embeds", prompt_embeds),
                             ("negative_prompt_embeds", negative_prompt_embeds)):
            if values is None:
                continue
            if isinstance(values, (str, bytes, Tensor)) or not isinstance(values, Sequence) or len(values) != n:
                raise ValueError(f"{name} must be a sequence of n={n} entries (None keeps this rollout's), got "
                                 f"{type(values).__name__}")
            per[name] = list(values)
        seeds_ = [None if s is None else _seed(s) for s in per.get("seeds", [None] * n)]
        switches = [self._check_switch(per.get("prompt_embeds", [None] * n)[i],
                                       per.get("negative_prompt_embeds", [None] * n)[i]) for i in range(n)]
        streams = self.stream.fork(n)  # every refusal before any fork
        out = []
        for stream, seed, prompts in zip(streams, seeds_, switches):
            branch = object.__new__(WanStreamingRollout)
            branch.__dict__.update(self.__dict__)
            branch.stream, branch._prompts = stream, {**self._prompts, **prompts}
            branch._gen = torch.Generator(device=self.device)
            if seed is None:
                branch._gen.set_state(self._gen.get_state())
            else:
                branch._gen.manual_seed(seed)
            branch.chunk_seconds, branch.forwards = [], 0
            out.append(branch)
        return out

    def release(self) -> None:
        """Give this rollout's cache pages back to the pool its branches share; it refuses to
        generate afterwards."""
        self.stream.caches.release()

    @property
    def chunk_idx(self) -> int:
        """Index of the next chunk of the current stream."""
        return self._chunk

    @torch.no_grad()
    def generate_chunk(self, noise: Tensor | None = None) -> Tensor:
        """Denoise the next chunk and commit it; returns its clean latents
        ``[B, in_channels, frames_per_chunk, height, width]`` (the model's dtype).

        A chunk whose attempt failed after ``begin_chunk`` is still open: the next call
        rewrites it."""
        if not self._prompts:
            raise RuntimeError("set_prompt(...) before generating")
        self.stream.check_ready()  # before begin_chunk moves the caches
        shape = self.stream.latent_shape
        if noise is not None:
            if not isinstance(noise, Tensor) or tuple(noise.shape) != shape:
                got = tuple(noise.shape) if isinstance(noise, Tensor) else type(noise).__name__
                raise ValueError(f"noise must have the chunk's latent shape {shape}, got {got}")
            if noise.layout != torch.strided or not noise.dtype.is_floating_point:
                raise TypeError(f"noise must be a dense floating tensor, got {noise.layout} {noise.dtype}")
            noise = noise.to(device=self.device, dtype=self.dtype)
        c = self._chunk
        t0 = time.perf_counter()
        if self.stream.caches[self.branches[0]].open_chunk != c:
            self.stream.begin_chunk(c, self.branches)
        x = noise if noise is not None else self._noise(shape)
        sigmas = self.schedule.sigmas()
        x0 = x
        for i, sigma in enumerate(sigmas):
            x0 = x - sigma * self._flow(x, 1000.0 * sigma)
            if i + 1 < len(sigmas):
                x = (1 - sigmas[i + 1]) * x0 + sigmas[i + 1] * self._noise(shape)
        self._flow(x0, 0.0)  # the clean pass writes the chunk's final K/V
        self.stream.commit_chunk(c, self.branches)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.chunk_seconds.append(time.perf_counter() - t0)
        self._chunk += 1
        return x0

    def run(self, num_chunks: int) -> Tensor:
        """Generate ``num_chunks`` chunks; returns ``[B, C, num_chunks * frames_per_chunk, H, W]``."""
        num_chunks = check_int("num_chunks", num_chunks, 1)
        last = self._chunk + num_chunks - 1
        if last >= self.stream.max_chunks:
            raise ValueError(f"chunk {last} is past the RoPE horizon of {self.stream.max_chunks} chunks; start a new "
                             f"prompt")
        return torch.cat([self.generate_chunk() for _ in range(num_chunks)], dim=2)

    def _noise(self, shape: Sequence[int]) -> Tensor:
        return torch.randn(shape, generator=self._gen, device=self.device, dtype=torch.float32).to(self.dtype)

    def _flow(self, x: Tensor, t: float) -> Tensor:
        flows = {b: self.stream.forward(b, x, t, self._prompts[b]) for b in self.branches}
        self.forwards += len(self.branches)
        if self.guidance == 1.0:
            return flows["cond"]
        return flows["uncond"] + self.guidance * (flows["cond"] - flows["uncond"])


def _seed(seed: object) -> int:
    """``seed`` as an int that ``torch.Generator.manual_seed`` takes (``[-2**63, 2**64)``)."""
    seed = check_int("seed", seed)
    if not -(2**63) <= seed < 2**64:
        raise ValueError(f"seed must be in [-2**63, 2**64) (torch.Generator.manual_seed), got {seed}")
    return seed
