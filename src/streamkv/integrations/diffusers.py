"""diffusers' ``WanTransformer3DModel`` as a chunk-streaming causal generator (Self-Forcing style).

The model is used as diffusers ships it; nothing of diffusers is copied or edited.
:class:`StreamingWan` *attaches* to a model instance:

- each block's self-attention (``blocks.{i}.attn1``) gets a
  :class:`~streamkv.integrations.wan_attention.CachedWanSelfAttention` processor bound to
  layer ``i`` (``model.set_attn_processor``); the processors share one
  :class:`~streamkv.integrations.wan_attention.StreamState`, through which each forward
  hands them the branch's cache;
- a forward hook on ``model.rope`` replaces its tables (frames from 0) by the same tables
  at the open chunk's absolute frames, so the chunk's queries and keys are rotated at their
  stream positions before the keys are written;
- cross-attention keeps diffusers' processor: the text K/V are recomputed per forward, as
  Wan does (streamkv caches self-attention only).

Per chunk ``c`` (``frames_per_chunk`` latent frames = ``chunk_tokens`` tokens)::

    stream.begin_chunk(c)                          reserve the chunk's slots (every branch)
    flow = stream.forward("cond", x_t, t, text)    every pass rewrites the chunk's slots
    ...                                            (denoising steps, then the clean pass at t=0)
    stream.commit_chunk(c)                         the chunk becomes history

:class:`WanStreamingRollout` is that loop with flow matching and classifier-free guidance
(independent ``cond`` / ``uncond`` caches). :meth:`StreamingWan.detach` restores the
model's processors and removes the hook.

Exactness (tested in ``tests/test_diffusers_wan.py``): each streamed forward equals one
forward of the same model over the clean context and the chunk with a block-causal mask
that hides what the cache does not retain, to float32 rounding
(:mod:`streamkv.integrations.wan_reference`).

Refused (with the reason): image-conditioned Wan (``added_kv_proj_dim`` / ``image_dim``),
a model with diffusers' own caching enabled, attention masks, a second attachment, chunks
past the RoPE horizon (``rope_max_seq_len`` frames), ``torch.compile`` / CUDA graphs (not
offered: eager only).

Why this long: every difference from diffusers' own model and every refusal is listed here.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..attention import Order
from ..caches import CacheSet, CacheSpec
from ..storage import check_int
from .wan_attention import CachedWanSelfAttention, StreamState, check_pair_repeated, wan_rope_tables
from .wan_rollout import WanStreamingRollout

try:
    from diffusers import WanTransformer3DModel
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("streamkv.integrations.diffusers needs diffusers 0.42: pip install 'streamkv[diffusers]'") from exc

__all__ = ["StreamingWan", "WanStreamingRollout", "StreamState", "CachedWanSelfAttention", "wan_rope_tables"]


class StreamingWan:
    """Streamkv caches attached to a diffusers ``WanTransformer3DModel`` (see the module docstring).

    Args:
        model: a text-to-video ``WanTransformer3DModel`` (no image projections). Its
            ``attn1`` processors are replaced and ``model.rope`` gets a forward hook until
            :meth:`detach`.
        frames_per_chunk: latent frames per chunk (a multiple of ``patch_size[0]``).
        sink_frames: pinned first frames (``>= 0``, a multiple of ``patch_size[0]``).
        window_frames: frames of history kept besides the sinks, the open chunk included
            (``>= frames_per_chunk``, a multiple of ``patch_size[0]``).
        height, width: latent height and width (multiples of the patch).
        batch: videos per forward.
        cache: a cache kind (``"ring"``, ``"chronological"``, ``"mass"``, ``"h2o"``,
            ``"tova"``) or policy, or a prebuilt :class:`~streamkv.caches.CacheSet` whose
            spec equals :attr:`spec`.
        branches: the cache branches (``("cond", "uncond")`` for guidance).
        order: the attention path asked of :func:`~streamkv.attention.attend`.
        cache_kwargs: the policy's parameters (``tau=0.05``, ``budget=...``).

    Attributes:
        caches: the :class:`~streamkv.caches.CacheSet` (buffers ``[branches, layers, B,
            sink + window tokens, heads, head_dim]``, the dtype and device of ``to_k``).
        spec: its :class:`~streamkv.caches.CacheSpec` (sizes in tokens).
        state: the :class:`StreamState` shared with the processors.
        tokens_per_frame, chunk_tokens, max_chunks: token geometry and the RoPE horizon.

    Raises:
        TypeError: ``model`` is not a ``WanTransformer3DModel``; a size is not an int.
        ValueError: an image-conditioned model; diffusers caching enabled on it; sizes that
            do not divide by the patch or break the cache layout; a prebuilt cache set of
            another spec (or with ``cache_kwargs``); an unknown ``order``, or
            ``"chronological"`` over a per-head cache.
        RuntimeError: a StreamingWan is already attached to this model.
    """

    def __init__(
        self,
        model: WanTransformer3DModel,
        *,
        frames_per_chunk: int,
        sink_frames: int,
        window_frames: int,
        height: int,
        width: int,
        batch: int = 1,
        cache: Any = "ring",
        branches: Sequence[str] = ("cond",),
        order: Order = "auto",
        cache_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(model, WanTransformer3DModel):
            raise TypeError(f"model must be a diffusers WanTransformer3DModel, got {type(model).__name__}")
        cfg = model.config
        if cfg.added_kv_proj_dim is not None or cfg.image_dim is not None:
            raise ValueError(f"image-conditioned Wan (added_kv_proj_dim={cfg.added_kv_proj_dim}, "
                             f"image_dim={cfg.image_dim}) is not supported: text-to-video models only")
        if model.is_cache_enabled:
            raise ValueError("diffusers caching is enabled on this model (enable_cache): it reuses activations across "
                             "steps, which a streamed rollout cannot make exact; disable_cache() first")
        if any(isinstance(p, CachedWanSelfAttention) for p in model.attn_processors.values()):
            raise RuntimeError("a StreamingWan is already attached to this model: detach() it first")
        check_pair_repeated(model.rope)
        p_t, p_h, p_w = cfg.patch_size
        sizes = {n: check_int(n, v, lo) for n, v, lo in (
            ("frames_per_chunk", frames_per_chunk, 1), ("sink_frames", sink_frames, 0),
            ("window_frames", window_frames, 1), ("height", height, 1), ("width", width, 1), ("batch", batch, 1))}
        for name in ("frames_per_chunk", "sink_frames", "window_frames"):
            if sizes[name] % p_t:
                raise ValueError(f"{name} must be a multiple of the temporal patch {p_t}, got {sizes[name]}")
        frames_per_chunk, sink_frames, window_frames, height, width, batch = sizes.values()
        if height % p_h or width % p_w:
            raise ValueError(f"latent size {height} x {width} must divide by the patch {p_h} x {p_w}")
        if order not in ("auto", "physical", "chronological"):
            raise ValueError(f"order must be 'auto', 'physical' or 'chronological', got {order!r}")
        if isinstance(cache, CacheSet) and cache_kwargs:
            raise ValueError(f"cache_kwargs {sorted(cache_kwargs)} cannot apply to a prebuilt CacheSet")
        self.model = model
        self.frames_per_chunk, self.height, self.width, self.batch = frames_per_chunk, height, width, batch
        self.grid = (height // p_h, width // p_w)
        self.tokens_per_frame = self.grid[0] * self.grid[1]  # per patched frame
        self.chunk_frames = frames_per_chunk // p_t  # patched frames per chunk
        self.chunk_tokens = self.chunk_frames * self.tokens_per_frame
        self.max_chunks = model.rope.max_seq_len // self.chunk_frames
        block = model.blocks[0].attn1
        heads, head_dim = block.heads, block.inner_dim // block.heads
        slots = (sink_frames + window_frames) // p_t * self.tokens_per_frame
        self.spec = CacheSpec(
            k_shape=(batch, slots, heads, head_dim), v_shape=(batch, slots, heads, head_dim), seq_dim=1,
            sink=sink_frames // p_t * self.tokens_per_frame, window=window_frames // p_t * self.tokens_per_frame,
            chunk=self.chunk_tokens, num_layers=len(model.blocks), dtype=block.to_k.weight.dtype,
            device=block.to_k.weight.device,
        )
        if isinstance(cache, CacheSet):
            if cache.spec != self.spec:
                raise ValueError(f"the cache set's spec {cache.spec} differs from this model's {self.spec}")
            missing = [b for b in branches if b not in cache.branches]
            if missing:
                raise ValueError(f"the cache set lacks branches {missing}")
            self.caches = cache
        else:
            self.caches = CacheSet(cache, self.spec, branches=branches, **(cache_kwargs or {}))
        refusal = self.caches[self.caches.branches[0]].chronological_refusal
        if order == "chronological" and refusal:
            raise ValueError(f"order='chronological' needs the chronological path, and {refusal}")
        self.state = StreamState(order=order)
        self._saved = dict(model.attn_processors)
        self._processors = [CachedWanSelfAttention(self.state, i) for i in range(len(model.blocks))]
        processors = dict(self._saved)
        for i, proc in enumerate(self._processors):
            processors[f"blocks.{i}.attn1.processor"] = proc
        model.set_attn_processor(processors)
        self._hook = model.rope.register_forward_hook(self._absolute_rope, with_kwargs=True)
        self._family: list[StreamingWan] = [self]  # the streams sharing this attachment (fork)

    # ------------------------------------------------------------- attachment
    @property
    def attached(self) -> bool:
        return self._hook is not None

    def detach(self) -> None:
        """Restore the model's processors (the very objects) and remove the RoPE hook.
        The caches are kept. A second call does nothing."""
        if self._hook is None:
            return
        self._hook.remove()
        for stream in self._family:  # this stream and its forks: one attachment
            stream._hook = None
        self.model.set_attn_processor(dict(self._saved))

    def __enter__(self) -> StreamingWan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # -------------------------------------------------------------- branches
    def fork(self, n: int = 1) -> list[StreamingWan]:
        """``n`` streams over forks of :attr:`caches` (:meth:`~streamkv.caches.CacheSet.fork`: built
        with ``pages=``, every page of the history shared copy-on-write), attached to the same model
        (they share its processors and RoPE hook; forwards run one at a time, each with its own
        caches). :meth:`detach` of any of them detaches them all. Refused (nothing changes) when
        detached, and as the cache set's fork refuses (no pages, a chunk open, observers)."""
        self.check_ready()
        out = []
        for caches in self.caches.fork(n):
            view = copy.copy(self)
            view.caches = caches
            self._family.append(view)
            out.append(view)
        return out

    # -------------------------------------------------------------- lifecycle
    def begin_chunk(self, chunk_idx: int, branches: Iterable[str] | None = None) -> None:
        """``begin_chunk`` on every (or the named) branch, all or nothing; refuses a chunk
        past the RoPE horizon (``ValueError``)."""
        chunk_idx = check_int("chunk_idx", chunk_idx, 0)
        if chunk_idx >= self.max_chunks:
            raise ValueError(f"chunk {chunk_idx} is past the RoPE horizon: {self.model.rope.max_seq_len} frames hold "
                             f"{self.max_chunks} chunks of {self.chunk_frames} (patched) frames; start a new stream")
        self.caches.begin_chunk(chunk_idx, branches)

    def commit_chunk(self, chunk_idx: int, branches: Iterable[str] | None = None) -> None:
        self.caches.commit_chunk(chunk_idx, branches)

    def reset(self, branches: Iterable[str] | None = None) -> None:
        self.caches.reset(branches)

    # ---------------------------------------------------------------- forward
    @property
    def latent_shape(self) -> tuple[int, int, int, int, int]:
        """``(B, in_channels, frames_per_chunk, height, width)``."""
        return (self.batch, self.model.config.in_channels, self.frames_per_chunk, self.height, self.width)

    @torch.no_grad()
    def forward(self, branch: str, latents: Tensor, timestep: Tensor | float, prompt_embeds: Tensor) -> Tensor:
        """One forward of the model on the open chunk of ``branch``'s cache.

        Args:
            branch: the cache branch (``"cond"``, ``"uncond"``).
            latents: ``[B, in_channels, frames_per_chunk, height, width]``, the model's dtype.
            timestep: Wan's timestep (``0..1000``; ``0`` for the clean pass), a number or ``[B]``.
            prompt_embeds: the text encoder's states ``[B, text_len, text_dim]``.

        Returns:
            The model's output ``[B, out_channels, frames_per_chunk, height, width]`` (the flow).

        Mutation: writes the open chunk's slots of every layer of ``branch``'s cache. Runs
        under ``torch.no_grad``.

        Raises (all before anything changes):
            RuntimeError: detached; processors replaced since attaching; ``branch`` has no
                open chunk.
            KeyError: an unknown branch.
            ValueError: ``latents``, ``timestep`` or ``prompt_embeds`` of the wrong shape
                (``text_dim`` not the config's, an empty text) or device, a timestep outside
                ``[0, 1000]`` or not finite.
            TypeError: ``latents`` / ``prompt_embeds`` not dense or not of the model's dtype,
                a timestep that is not a number (``"5"``, ``True``).
        """
        self.check_ready()
        cache = self.caches[branch]
        chunk = cache.open_chunk
        if chunk is None:
            raise RuntimeError(f"branch {branch!r} has no open chunk: call begin_chunk(chunk_idx) first")
        dtype, device = self.spec.dtype, self.spec.device
        if not isinstance(latents, Tensor) or tuple(latents.shape) != self.latent_shape:
            got = tuple(latents.shape) if isinstance(latents, Tensor) else type(latents).__name__
            raise ValueError(f"latents must have the chunk's shape {self.latent_shape}, got {got}")
        if latents.layout != torch.strided or latents.dtype != dtype:
            raise TypeError(f"latents must be a dense {dtype} tensor (the model's dtype), got {latents.layout} "
                            f"{latents.dtype}")
        if latents.device != device:
            raise ValueError(f"latents must be on the model's device {device}, got {latents.device}")
        self.check_prompt("prompt_embeds", prompt_embeds, cast=False)
        timestep = self._timestep(timestep)
        self.state.cache, self.state.frame_start = cache, chunk * self.chunk_frames
        try:
            out = self.model(hidden_states=latents, timestep=timestep, encoder_hidden_states=prompt_embeds,
                             return_dict=False)[0]
        finally:
            self.state.cache = self.state.frame_start = None
        return out

    def check_ready(self) -> None:
        """Raise ``RuntimeError`` unless the stream can run a forward: attached, and the
        model's ``attn1`` processors still the ones it installed."""
        if self._hook is None:
            raise RuntimeError("this StreamingWan is detached: build a new one to stream again")
        replaced = [i for i, p in enumerate(self._processors) if self.model.blocks[i].attn1.processor is not p]
        if replaced:
            raise RuntimeError(f"the attn1 processors of blocks {replaced} were replaced after attaching: those layers "
                               f"would not use the cache; detach() and attach a new StreamingWan")

    def check_prompt(self, name: str, t: object, *, cast: bool) -> None:
        """Raise ``ValueError`` / ``TypeError`` unless ``t`` is text states the model takes:
        ``[B, text_len >= 1, text_dim]`` (the config's ``text_dim``), floating, dense; of the
        model's dtype and device unless ``cast`` (the rollout converts them)."""
        text_dim = self.model.config.text_dim
        if not isinstance(t, Tensor) or t.dim() != 3 or t.shape[0] != self.batch or t.shape[2] != text_dim \
                or t.shape[1] < 1:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be [B={self.batch}, text_len >= 1, text_dim={text_dim}] (the model's "
                             f"config.text_dim), got {got}")
        if t.layout != torch.strided or not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a dense floating tensor, got {t.layout} {t.dtype}")
        if not cast and t.dtype != self.spec.dtype:
            raise TypeError(f"{name} must be {self.spec.dtype} (the model's dtype), got {t.dtype}")
        if not cast and t.device != self.spec.device:
            raise ValueError(f"{name} must be on the model's device {self.spec.device}, got {t.device}")

    def _timestep(self, timestep: object) -> Tensor:
        """Wan's timestep as ``[B]`` on the model's device: a real number or a ``[B]`` tensor in
        ``[0, 1000]`` (a tensor's values are read: one host sync per forward)."""
        if isinstance(timestep, Tensor):
            if tuple(timestep.shape) != (self.batch,) or timestep.dtype == torch.bool or timestep.dtype.is_complex:
                raise ValueError(f"timestep must be a number or a real [B] = [{self.batch}] tensor, got "
                                 f"{tuple(timestep.shape)} {timestep.dtype}")
            if timestep.device != self.spec.device:
                raise ValueError(f"timestep must be on the model's device {self.spec.device}, got {timestep.device}")
            lo, hi = (float(x) for x in torch.aminmax(timestep.double()))
            if not (0.0 <= lo and hi <= 1000.0):  # NaN fails both
                raise ValueError(f"timestep values must be in [0, 1000] (Wan's timesteps), got {timestep.tolist()}")
            return timestep
        if isinstance(timestep, bool) or not isinstance(timestep, (int, float)):
            raise TypeError(f"timestep must be a number or a [B] tensor, got {type(timestep).__name__} {timestep!r}")
        if not 0.0 <= timestep <= 1000.0:
            raise ValueError(f"timestep must be in [0, 1000] (Wan's timesteps), got {timestep!r}")
        return torch.full((self.batch,), float(timestep), device=self.spec.device)

    def _absolute_rope(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: tuple[Tensor, Tensor]
                       ) -> tuple[Tensor, Tensor]:
        """Forward hook of ``model.rope``: its tables at the open chunk's absolute frames."""
        _, frame_start = self.state.active("WanRotaryPosEmbed")
        hidden = args[0] if args else kwargs["hidden_states"]
        p_t, p_h, p_w = module.patch_size
        frames, gh, gw = hidden.shape[2] // p_t, hidden.shape[3] // p_h, hidden.shape[4] // p_w
        if (frames, gh, gw) != (self.chunk_frames, *self.grid):
            raise ValueError(f"the model's input is {frames} x {gh} x {gw} patched frames x rows x columns; this stream "
                             f"runs chunks of {self.chunk_frames} x {self.grid[0]} x {self.grid[1]}")
        cos, sin = wan_rope_tables(module, frame_start, frames, gh, gw)
        if cos.shape != output[0].shape or cos.dtype != output[0].dtype:
            raise RuntimeError(f"WanRotaryPosEmbed returned {tuple(output[0].shape)} {output[0].dtype}, the absolute "
                               f"tables are {tuple(cos.shape)} {cos.dtype}: this diffusers version lays RoPE out "
                               f"differently (diffusers 0.42 is supported)")
        return cos, sin

    def __repr__(self) -> str:
        return (f"StreamingWan(chunk={self.frames_per_chunk} frames / {self.chunk_tokens} tokens, sink={self.spec.sink}, "
                f"window={self.spec.window} tokens, caches={self.caches!r}, attached={self.attached})")
