"""Streaming rollout, Self-Forcing style: the chunk loop that drives a cache end to end.

For each chunk ``c``::

    caches.begin_chunk(c)                       host: reserve the chunk's slots
    x = noise
    for sigma_i in sigmas:                      e.g. timesteps 1000/750/500/250, shifted
        flow = DiT(x, t_i)  [cond, uncond]      every step rewrites the chunk's slots
        x0 = x - sigma_i * flow                 (flow matching: flow = noise - x0)
        x = (1 - sigma_next) * x0 + sigma_next * fresh noise
    DiT(x0, t=0)        [cond, uncond]          the clean pass writes the final K/V
    caches.commit_chunk(c)                      the chunk becomes history

Classifier-free guidance runs the ``uncond`` branch on its own cache (guidance 1.0
disables it): ``flow = flow_u + g * (flow_c - flow_u)``. A new prompt resets the
self-attention caches and recomputes the cross-attention K/V.

Execution modes:

``eager``
    plain PyTorch; with ``instrument=True`` every cache call is timed.
``compile``
    ``torch.compile`` of the per-step network (all layers, cache writes included). The
    step reads no changing host int: RoPE tables and the timestep are tensor inputs,
    and the occupancy of the cache (``"mask"`` while filling, ``"all"`` when full) is
    decided outside, so after warm-up nothing recompiles across steps, the first
    eviction, wraps or a reset.
``graph``
    CUDA graphs of the per-step network, one per (branch, occupancy), cache writes
    included; ``begin_chunk`` runs outside the capture and moves the ring's write slots
    on the device, so replays write the new chunk. Caches whose write offset is a host
    int (the chronological path) run eagerly until the cache is full, then replay a
    graph captured in the steady state. CUDA only.

Context parallelism (``cp``, see :mod:`streamkv.distributed`): every rank runs this
same loop with the same seed, so noise, host bookkeeping (``begin_chunk`` /
``commit_chunk``) and the sampler are identical on every rank; only the DiT forward
is sharded (its output is gathered, so every rank holds the whole chunk). Each rank's
caches hold ``H/N`` heads. Eager and compile modes; ``graph`` with more than one rank
is refused (the all-to-alls would sit inside the captured region and no GPU run has
yet shown that replaying them is correct).

Branches (``fork``): a rollout whose caches keep their rows in pages (``pages=``) forks into
rollouts that continue the same stream, sharing every page of the history copy-on-write; each
branch has its own noise generator (by default where the parent's stands; ``seeds=`` for other
noise) and may continue under another prompt (``prompts=``: the history kept, the
cross-attention K/V of the new prompt). A branch computes exactly what a rollout that never
forked computes from the same history, noise and prompt (``tests/test_rollout_fork.py``).

Why one module: the three execution modes run the same chunk loop and differ only in how
one denoising step is invoked; keeping the loop, the schedule and the modes together keeps
their shared host bookkeeping (begin, retry of an open chunk, commit) in one place.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from .caches import CacheSet, KVCache
from .distributed.group import ContextParallel
from .models.dit import CausalVideoDiT, CrossKV
from .validate import check_int

__all__ = ["Schedule", "StreamingRollout", "ChunkStats"]

Mode = Literal["eager", "compile", "graph"]


@dataclass(frozen=True)
class Schedule:
    """Denoising timesteps (0..1000) and the flow-matching shift.

    ``sigma = shift * s / (1 + (shift - 1) * s)`` with ``s = t / 1000``; the model is
    given ``1000 * sigma`` as its timestep (Wan's convention).
    """

    timesteps: tuple[float, ...] = (1000.0, 750.0, 500.0, 250.0)
    shift: float = 5.0

    def __post_init__(self) -> None:
        ts = tuple(float(t) for t in self.timesteps)
        if not ts or any(not 0 < t <= 1000 for t in ts):
            raise ValueError(f"timesteps must be non-empty and in (0, 1000], got {self.timesteps}")
        if any(a <= b for a, b in zip(ts, ts[1:])):
            raise ValueError(f"timesteps must decrease strictly, got {self.timesteps}")
        if isinstance(self.shift, bool) or not isinstance(self.shift, (int, float)) or not (
                math.isfinite(self.shift) and self.shift > 0):
            raise ValueError(f"shift must be a finite number > 0, got {self.shift!r}")
        object.__setattr__(self, "timesteps", ts)
        bad = [(t, x) for t, x in zip(ts, self._sigmas()) if not (math.isfinite(x) and 0 < x <= 1)]
        if bad:
            raise ValueError(f"shift={self.shift!r} gives the sigma {bad[0][1]!r} at timestep {bad[0][0]}: a flow-matching "
                             f"sigma must be in (0, 1] (a shift this small cancels 1 + (shift - 1) s in float64)")

    def sigmas(self) -> list[float]:
        return self._sigmas()

    def _sigmas(self) -> list[float]:
        out = []
        for t in self.timesteps:
            s = t / 1000.0
            den = 1 + (self.shift - 1) * s
            out.append(self.shift * s / den if den else math.nan)
        return out


@dataclass
class ChunkStats:
    """Measurements of one chunk (seconds)."""

    chunk: int
    latency_s: float
    maintenance_s: float  # begin + commit + every cache write of every layer and branch
    forwards: int  # DiT forwards (steps + clean pass) x branches


@dataclass
class RolloutStats:
    chunks: list[ChunkStats] = field(default_factory=list)

    def per_chunk_latency_ms(self) -> list[float]:
        return [c.latency_s * 1e3 for c in self.chunks]

    def maintenance_per_step_ms(self) -> list[float]:
        """Cache maintenance per DiT forward (all layers), per chunk."""
        return [c.maintenance_s * 1e3 / max(c.forwards, 1) for c in self.chunks]


class StreamingRollout:
    """Generate a video chunk by chunk with a causal DiT over a streaming cache.

    Args:
        model: the DiT (its configuration fixes chunk, window and sink sizes).
        cache: a cache kind (``"ring"``, ``"chronological"``, ``"mass"``, ``"h2o"``, ``"tova"``,
            or a policy) or a prebuilt :class:`~streamkv.caches.CacheSet` (checked against
            the model's shape, dtype and device).
        batch: videos generated together.
        guidance: classifier-free guidance scale (``>= 1``; ``1`` disables ``uncond``).
        schedule: denoising timesteps and shift.
        mode: ``"eager"``, ``"compile"`` or ``"graph"`` (see the module docstring).
        seed: seed of the noise generator (same seed, same noise for every cache).
        rope_mode: ``"absolute"`` or ``"cache_relative"`` (eager only).
        order: attention path request forwarded to :func:`~streamkv.attention.attend`.
        instrument: time every cache call (eager; adds a device sync per call on CUDA).
        compile_backend: backend for ``mode="compile"`` (``"inductor"``, ``"aot_eager"``,
            or a callable such as ``torch._dynamo.testing.CompileCounter()``).
        cache_kwargs: the cache policy's parameters (e.g. ``tau=0.05``, ``budget=96``).
        cp: context-parallel group (Ulysses; one rollout per rank, same arguments on
            every rank). ``None``: one process.

    Raises:
        ValueError: bad arguments; with ``cp``, heads or chunk tokens that do not
            divide by the world size (checked before anything is allocated); a cache
            without a chronological view (per-head policies) with ``order="chronological"``
            or ``rope_mode="cache_relative"``.
        RuntimeError: ``mode="graph"`` with ``cp.world_size > 1``, or without CUDA; a
            compiled or graph mode over caches with observers (they run eagerly).
    """

    def __init__(
        self,
        model: CausalVideoDiT,
        *,
        cache: str | CacheSet = "ring",
        batch: int = 1,
        guidance: float = 1.0,
        schedule: Schedule | None = None,
        mode: Mode = "eager",
        seed: int = 0,
        rope_mode: Literal["absolute", "cache_relative"] = "absolute",
        order: Literal["auto", "physical", "chronological"] = "auto",
        instrument: bool = False,
        compile_backend: Any = "inductor",
        cache_kwargs: dict[str, Any] | None = None,
        cp: ContextParallel | None = None,
    ) -> None:
        if not isinstance(model, CausalVideoDiT):
            raise TypeError(f"model must be a CausalVideoDiT, got {type(model).__name__}")
        if cp is not None:
            if not isinstance(cp, ContextParallel):
                raise TypeError(f"cp must be a ContextParallel or None, got {type(cp).__name__}")
            model.check_context_parallel(cp.world_size)
            if mode == "graph" and cp.world_size > 1:
                raise RuntimeError(
                    f"mode='graph' with context parallelism (world_size={cp.world_size}) is not supported: the "
                    "all-to-alls would be captured in the CUDA graph, and no GPU run has shown that replaying them "
                    "is correct; use mode='eager' or 'compile'"
                )
        world_size = 1 if cp is None else cp.world_size
        batch = check_int("batch", batch, 1)
        if not isinstance(guidance, (int, float)) or not math.isfinite(guidance) or guidance < 1.0:
            raise ValueError(f"guidance must be a finite number >= 1.0, got {guidance!r}")
        if mode not in ("eager", "compile", "graph"):
            raise ValueError(f"mode must be 'eager', 'compile' or 'graph', got {mode!r}")
        p = next(model.parameters())
        if mode == "graph" and not p.is_cuda:
            raise RuntimeError("mode='graph' captures CUDA graphs: the model must be on a CUDA device")
        if rope_mode not in ("absolute", "cache_relative"):
            raise ValueError(f"rope_mode must be 'absolute' or 'cache_relative', got {rope_mode!r}")
        if rope_mode == "cache_relative" and mode != "eager":
            raise ValueError(f"rope_mode='cache_relative' runs eagerly only, got mode={mode!r}")
        if rope_mode == "cache_relative" and order == "physical":
            raise ValueError(
                "order='physical' is invalid with rope_mode='cache_relative': keys are rotated by their "
                "chronological index at read time"
            )
        if instrument and mode != "eager":
            raise ValueError(f"instrument=True times cache calls eagerly, got mode={mode!r}")
        self.model = model
        self.batch = batch
        self.guidance = float(guidance)
        self.schedule = schedule or Schedule()
        self.mode = mode
        self.rope_mode = rope_mode
        self.order = order
        self.instrument = instrument
        self.cp = cp
        self.dtype, self.device = p.dtype, p.device
        self.branches = ("cond", "uncond") if self.guidance > 1.0 else ("cond",)
        if isinstance(cache, CacheSet):
            missing = [b for b in self.branches if b not in cache.branches]
            if missing:
                raise ValueError(f"cache set lacks branches {missing} needed at guidance {self.guidance}")
            for b in self.branches:
                model.check_cache(cache[b], batch, world_size)
            self.caches = cache
        else:
            self.caches = CacheSet(
                cache, model.cache_spec(batch, world_size), branches=self.branches, **(cache_kwargs or {})
            )
        first = self.caches[self.branches[0]]
        if (order == "chronological" or rope_mode == "cache_relative") and first.chronological_refusal:
            raise ValueError(
                f"order={order!r} / rope_mode={rope_mode!r} need the chronological path, and "
                f"{first.chronological_refusal}"
            )
        if mode != "eager" and any(self.caches[b].observers for b in self.branches):
            raise RuntimeError(f"mode={mode!r}: the caches have observers, which run eagerly only; use mode='eager'")
        self.seed = seed
        self._gen = torch.Generator(device=self.device).manual_seed(_seed(seed))
        self._cross: dict[str, CrossKV] = {}
        self._chunk = 0
        self._maintenance = 0.0
        self.stats = RolloutStats()
        self._relative_rope = (
            model.relative_rope(dtype=self.dtype, device=self.device) if rope_mode == "cache_relative" else None
        )
        self._compiled: Callable | None = None
        if mode == "compile":
            self._compiled = torch.compile(self._network, backend=compile_backend, fullgraph=True, dynamic=False)
        self._graphs: dict[tuple[str, str], _GraphStep] = {}

    # ---------------------------------------------------------------- prompt
    def set_prompt(self, prompt: str, negative_prompt: str | None = None, *, seed: int | None = None) -> None:
        """Start a new stream for ``prompt``: reset the self-attention caches, compute the
        cross-attention K/V (of ``negative_prompt`` too when guidance > 1). ``seed``
        re-seeds the noise generator (otherwise its sequence continues)."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        seed = None if seed is None else _seed(seed)  # checked before anything changes
        if self.guidance > 1.0 and negative_prompt is None:
            raise ValueError(
                f"guidance {self.guidance} > 1 needs a negative prompt (the uncond branch); pass "
                f"negative_prompt='' for an empty one"
            )
        cross = {"cond": self.model.cross_kv(self.model.encode_prompt(prompt, self.batch), self.cp)}
        if self.guidance > 1.0:
            cross["uncond"] = self.model.cross_kv(self.model.encode_prompt(negative_prompt, self.batch), self.cp)
        self._cross = cross
        self.caches.reset(self.branches)
        self._chunk = 0
        if seed is not None:
            self._gen.manual_seed(seed)

    def switch_prompt(self, prompt: str, negative_prompt: str | None = None) -> None:
        """Continue the stream under ``prompt``: the cross-attention K/V are recomputed and the
        self-attention history is kept (no reset, no re-cache: the next chunks attend to what the
        caches hold, written under the earlier prompt). ``negative_prompt`` (guidance > 1) replaces
        the ``uncond`` branch's; None keeps it. Refused (nothing changes) before a stream started."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        if negative_prompt is not None and not isinstance(negative_prompt, str):
            raise TypeError(f"negative_prompt must be a str or None, got {type(negative_prompt).__name__}")
        if negative_prompt is not None and self.guidance == 1.0:
            raise ValueError(f"negative_prompt given, but guidance {self.guidance} runs the cond branch only")
        if not self._cross:
            raise RuntimeError("switch_prompt continues a stream: set_prompt(...) first")
        cross = {"cond": self.model.cross_kv(self.model.encode_prompt(prompt, self.batch), self.cp)}
        if negative_prompt is not None:
            cross["uncond"] = self.model.cross_kv(self.model.encode_prompt(negative_prompt, self.batch), self.cp)
        self._cross = {**self._cross, **cross}

    def reseed(self, seed: int) -> None:
        """Re-seed the noise generator; the stream (caches, chunk index, prompt) is kept."""
        self._gen.manual_seed(_seed(seed))

    # ---------------------------------------------------------------- branches
    def fork(self, n: int = 1, *, seeds: Sequence[int] | None = None, prompts: Sequence[str | None] | None = None,
             negative_prompts: Sequence[str | None] | None = None) -> list[StreamingRollout]:
        """``n`` rollouts that continue this stream from where it stands (its caches built with
        ``pages=``, e.g. ``cache_kwargs={"pages": {"spare": 8}}``): every cache branch forked
        (:meth:`~streamkv.caches.CacheSet.fork`: the history's pages shared copy-on-write, each
        rollout then writes its own chunks), the prompt's cross-attention K/V shared, the chunk index
        and the schedule kept. This rollout stays usable (it is one more branch).

        Noise: each branch's generator starts where this one's stands, so a branch draws the noise
        this rollout would draw next; ``seeds[i]`` re-seeds branch ``i`` (same prefix, different
        noise). ``prompts[i]`` continues branch ``i`` under another prompt (:meth:`switch_prompt`:
        the history kept; None keeps this one's), ``negative_prompts[i]`` likewise for ``uncond``.

        With context parallelism every rank forks its own head shard (same arguments on every
        rank: the same noise everywhere). Eager mode only.

        Raises (nothing changes): ``ValueError`` for ``n`` < 1, lists of another length than
        ``n``, a chunk left open by a failed attempt, caches without pages or with observers;
        ``TypeError`` for prompts that are not strings; ``RuntimeError`` before a stream started
        (``set_prompt``), in ``compile`` or ``graph`` mode, or on released caches.
        """
        n = check_int("n", n, 1)
        per = {}
        for name, values in (("seeds", seeds), ("prompts", prompts), ("negative_prompts", negative_prompts)):
            if values is None:
                continue
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) != n:
                raise ValueError(f"{name} must be a sequence of n={n} entries, got {values!r}")
            per[name] = list(values)
        seeds_ = [None if s is None else _seed(s) for s in per.get("seeds", [None] * n)]
        for name in ("prompts", "negative_prompts"):
            bad = [p for p in per.get(name, ()) if p is not None and not isinstance(p, str)]
            if bad:
                raise TypeError(f"{name} must be strings or None, got {bad[0]!r}")
        if any(p is not None for p in per.get("negative_prompts", ())) and self.guidance == 1.0:
            raise ValueError(f"negative_prompts given, but guidance {self.guidance} runs the cond branch only")
        if not self._cross:
            raise RuntimeError("fork continues a stream: set_prompt(...) first")
        if self.mode != "eager":
            raise RuntimeError(f"fork runs eagerly (mode={self.mode!r}): the compiled step and the captured CUDA graphs "
                               f"are traced over this rollout's caches, and a branch would trace its own again (the "
                               f"tiny model's compiled fork matched eager once, by hand, but took 25 s of tracing, so "
                               f"it is not offered untested); use mode='eager'")
        crosses = []
        for i in range(n):  # every prompt encoded before any cache forks
            cross = dict(self._cross)
            for name, branch in (("prompts", "cond"), ("negative_prompts", "uncond")):
                p = per.get(name, [None] * n)[i]
                if p is not None:
                    cross[branch] = self.model.cross_kv(self.model.encode_prompt(p, self.batch), self.cp)
            crosses.append(cross)
        sets = self.caches.fork(n)  # every branch's refusals before any fork
        return [self._branch(caches, seed, cross) for caches, seed, cross in zip(sets, seeds_, crosses)]

    def _branch(self, caches: CacheSet, seed: int | None, cross: dict[str, CrossKV]) -> StreamingRollout:
        out = object.__new__(StreamingRollout)
        out.__dict__.update(self.__dict__)
        out.caches, out._cross = caches, cross
        out._gen = torch.Generator(device=self.device)
        if seed is None:
            out._gen.set_state(self._gen.get_state())
        else:
            out._gen.manual_seed(seed)
            out.seed = seed
        out.stats, out._maintenance, out._graphs = RolloutStats(), 0.0, {}
        return out

    def release(self) -> None:
        """Give every cache's pages back to the pool its branches share (:meth:`fork`); this
        rollout refuses to generate afterwards."""
        self.caches.release()

    # ----------------------------------------------------------------- chunks
    @property
    def chunk_idx(self) -> int:
        """Index of the next chunk of the current stream."""
        return self._chunk

    def check_chunks(self, num_chunks: int) -> None:
        """Raise ``ValueError`` if ``num_chunks`` more chunks would pass the RoPE horizon."""
        num_chunks = check_int("num_chunks", num_chunks, 0)
        cfg = self.model.cfg
        last = self._chunk + num_chunks - 1
        if num_chunks and last >= cfg.max_chunks:
            raise ValueError(
                f"chunk {last} is beyond the RoPE horizon: {cfg.max_frames} frames hold {cfg.max_chunks} chunks of "
                f"{cfg.frames_per_chunk} frames (this stream is at chunk {self._chunk}); start a new prompt"
            )

    @torch.no_grad()
    def generate_chunk(self, noise: Tensor | None = None) -> Tensor:
        """Denoise the next chunk and commit it; returns its clean latents
        ``[B, in_channels, frames_per_chunk, latent_h, latent_w]``."""
        if not self._cross:
            raise RuntimeError("set_prompt(...) before generating")
        self.check_chunks(1)
        shape = self.model.latent_shape(self.batch)
        if noise is not None:
            if not isinstance(noise, Tensor) or tuple(noise.shape) != shape:
                got = tuple(noise.shape) if isinstance(noise, Tensor) else type(noise).__name__
                raise ValueError(f"noise must have the latent shape {shape}, got {got}")
            noise = noise.to(device=self.device, dtype=self.dtype)
        c = self._chunk
        sync = self.device.type == "cuda"
        if sync:
            torch.cuda.synchronize(self.device)
        t_start = time.perf_counter()
        self._maintenance = 0.0
        if self.caches[self.branches[0]].open_chunk != c:  # else a failed attempt left it open: rewrite it
            self._timed(lambda: self.caches.begin_chunk(c, self.branches))
        rope = self.model.rope_tables(c, dtype=self.dtype, device=self.device)
        x = noise if noise is not None else self._noise(shape)
        sigmas = self.schedule.sigmas()
        forwards = 0
        x0 = x
        for i, sigma in enumerate(sigmas):
            flow = self._flow(x, 1000.0 * sigma, rope)
            forwards += len(self.branches)
            x0 = x - sigma * flow
            if i + 1 < len(sigmas):
                nxt = sigmas[i + 1]
                x = (1 - nxt) * x0 + nxt * self._noise(shape)
        self._flow(x0, 0.0, rope)  # the clean pass writes the chunk's final K/V
        forwards += len(self.branches)
        self._timed(lambda: self.caches.commit_chunk(c, self.branches))
        if sync:
            torch.cuda.synchronize(self.device)
        self.stats.chunks.append(ChunkStats(c, time.perf_counter() - t_start, self._maintenance, forwards))
        self._chunk += 1
        return x0

    @torch.no_grad()
    def prefill_chunk(self, latents: Tensor) -> Tensor:
        """Commit a known chunk instead of generating it (video continuation, image-to-video):
        the clean pass at ``t = 0`` on ``latents`` writes its K/V on every branch, exactly as a
        generated chunk's last pass does, and the chunk becomes history. No noise is drawn (the
        noise of later chunks is what it would be without the prefill). Eager mode only.

        Args:
            latents: ``[B, in_channels, frames_per_chunk, latent_h, latent_w]``, cast to the
                model's dtype and device (not mutated).

        Returns:
            ``latents`` as committed (the model's dtype and device).

        Raises:
            RuntimeError: no prompt set; a compiled or graph mode.
            ValueError: ``latents`` not of the chunk's shape; past the RoPE horizon.
        """
        if not self._cross:
            raise RuntimeError("set_prompt(...) before prefilling")
        if self.mode != "eager":
            raise RuntimeError(f"prefill_chunk runs eagerly only, got mode={self.mode!r}")
        shape = self.model.latent_shape(self.batch)
        if not isinstance(latents, Tensor) or tuple(latents.shape) != shape:
            got = tuple(latents.shape) if isinstance(latents, Tensor) else type(latents).__name__
            raise ValueError(f"latents must have the chunk shape {shape}, got {got}")
        self.check_chunks(1)
        x0 = latents.to(device=self.device, dtype=self.dtype)
        c = self._chunk
        t_start = time.perf_counter()
        self._maintenance = 0.0
        if self.caches[self.branches[0]].open_chunk != c:
            self._timed(lambda: self.caches.begin_chunk(c, self.branches))
        self._flow(x0, 0.0, self.model.rope_tables(c, dtype=self.dtype, device=self.device))
        self._timed(lambda: self.caches.commit_chunk(c, self.branches))
        self.stats.chunks.append(ChunkStats(c, time.perf_counter() - t_start, self._maintenance, len(self.branches)))
        self._chunk += 1
        return x0

    def run(self, num_chunks: int, progress: Callable[[int], None] | None = None) -> Tensor:
        """Generate ``num_chunks`` chunks; returns ``[B, C, frames, H, W]`` latents."""
        self.check_chunks(num_chunks)
        out = []
        for _ in range(num_chunks):
            out.append(self.generate_chunk())
            if progress is not None:
                progress(self._chunk - 1)
        return torch.cat(out, dim=2)

    # -------------------------------------------------------------- internals
    def _noise(self, shape: Sequence[int]) -> Tensor:
        return torch.randn(shape, generator=self._gen, device=self.device, dtype=torch.float32).to(self.dtype)

    def _timed(self, fn: Callable[[], None]) -> None:
        if not self.instrument:
            fn()
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._maintenance += time.perf_counter() - t0

    def _add_maintenance(self, seconds: float) -> None:
        self._maintenance += seconds

    def _flow(self, x: Tensor, t: float, rope: tuple[Tensor, Tensor]) -> Tensor:
        tt = torch.full((self.batch,), t, device=self.device, dtype=torch.float32)
        flows = {b: self._forward(b, x, tt, rope) for b in self.branches}
        if self.guidance == 1.0:
            return flows["cond"]
        return flows["uncond"] + self.guidance * (flows["cond"] - flows["uncond"])

    def _network(self, x: Tensor, t: Tensor, cache: KVCache, cross: CrossKV, cos: Tensor, sin: Tensor,
                 occupancy: str) -> Tensor:
        return self.model(x, t, cache, cross, (cos, sin), order=self.order, occupancy=occupancy, cp=self.cp)

    def _forward(self, branch: str, x: Tensor, t: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        cache, cross = self.caches[branch], self._cross[branch]
        if self.mode == "eager":
            return self.model(
                x, t, cache, cross, rope, rope_mode=self.rope_mode, relative_rope=self._relative_rope,
                order=self.order, timer=self._add_maintenance if self.instrument else None, cp=self.cp,
            )
        # static-shape steps: the cache's occupancy, asked here, outside the trace
        occupancy = cache.occupancy(static=True)
        if self.mode == "compile":
            return self._compiled(x, t, cache, cross, rope[0], rope[1], occupancy)
        if not cache.graph_safe_writes and occupancy != "all":
            # the write offset is a host int that moves while filling: no graph yet
            return self._network(x, t, cache, cross, rope[0], rope[1], occupancy)
        key = (branch, occupancy)
        if key not in self._graphs:
            self._graphs[key] = _GraphStep(
                lambda x_, t_, c_, s_: self._network(x_, t_, cache, cross, c_, s_, occupancy), (x, t, *rope)
            )
        return self._graphs[key](x, t, *rope)


def _seed(seed: object) -> int:
    """``seed`` as an int that ``torch.Generator.manual_seed`` takes (``[-2**63, 2**64)``)."""
    seed = check_int("seed", seed)
    if not -(2**63) <= seed < 2**64:
        raise ValueError(f"seed must be in [-2**63, 2**64) (torch.Generator.manual_seed), got {seed}")
    return seed


class _GraphStep:
    """One CUDA graph of the per-step network: static inputs copied in, output cloned out.

    Warm-up and capture run on a side stream (they write the open chunk's K/V, which every
    replay rewrites). Replays read the cache's device metadata, so they follow
    ``begin_chunk``.
    """

    def __init__(self, fn: Callable[..., Tensor], example: tuple[Tensor, ...]) -> None:
        self.static_in = tuple(t.clone() for t in example)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn(*self.static_in)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_out = fn(*self.static_in)

    def __call__(self, *args: Tensor) -> Tensor:
        for dst, src in zip(self.static_in, args):
            dst.copy_(src)
        self.graph.replay()
        return self.static_out.clone()
