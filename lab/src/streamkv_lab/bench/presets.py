"""Benchmark configurations: frozen, named, recorded with every result.

A preset is the per-layer K/V shape of one attention layer of a streaming video
model, in frames (the unit the models' configs use) and tokens per frame::

    K, V: [batch, sink + window, heads, head_dim]     (seq_dim = 1, as in Self-Forcing)

=====================  ======  =====  ====  ==============  ==========  =========
preset                 window  chunk  sink  tokens / frame  heads x D   K buffer
=====================  ======  =====  ====  ==============  ==========  =========
``self-forcing``           21      3     0           1,560    12 x 128   100.6 MB
``self-forcing-sink``      21      3     3           1,560    12 x 128   115.0 MB
``lingbot``                63      3     0           1,508    10 x 128   243.2 MB
``small``                  21      3     0              32     2 x 32     86.0 kB
``krea-realtime-14b``      21      3     0           1,560    40 x 128   335.5 MB
``longlive2``              24      8     8             880    24 x 128   173.0 MB
``lingbot-world``          42      3     3           1,560    40 x 128   718.8 MB
=====================  ======  =====  ====  ==============  ==========  =========

``lingbot`` is flashdreams' ``lingbot-world-fast`` cache (window 63 latent frames,
chunks of 3, no sink) at 464x832 (29 x 52 = 1,508 tokens per frame) for one rank of
a 4-way Ulysses head shard of the 14B model's 40 heads (10 heads per rank), the
split its published allocation suggests (``reference/video-anchors.md`` 1.6).

The last three are the models sglang 0.5.23's diffusion runtime serves through one cache class,
``CausalSelfAttentionKVCache``, at the shapes its configs give (``peers=("sglang",)`` adds
that class and its ring drop-in, :mod:`streamkv.compat.sglang`, as subjects; sglang's
``cache_size`` is ``sink + window``). They are not in the default ``streamkv bench`` run.
One attention layer of the whole model on one GPU: a ``u``-way Ulysses shard holds ``1/u`` of
the heads and every byte count scales by ``1/u``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Preset", "PRESETS", "PEERS", "get_preset", "DEFAULT_SCALING_WINDOWS"]

#: window sizes (frames) of the scaling sweep, at each preset's chunk and sink
DEFAULT_SCALING_WINDOWS: tuple[int, ...] = (6, 12, 21, 42, 63)

#: other projects' caches a preset may add as subjects (``Preset.peers``)
PEERS: tuple[str, ...] = ("sglang",)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class Preset:
    """One attention layer's cache geometry.

    Args:
        name: the key in :data:`PRESETS`.
        window_frames, chunk_frames, sink_frames: cache layout, in latent frames.
        tokens_per_frame: tokens of one latent frame.
        heads, head_dim: K and V are ``[batch, tokens, heads, head_dim]``.
        dtype: name of a torch floating dtype (kept a string so the preset is JSON).
        batch: batch size of the buffers (1: one CFG branch).
        repeats: default timed steps per cache (after warm-up).
        scaling_windows: windows (frames) of the scaling sweep; empty to skip it.
        description: where the numbers come from.
        global_sink_frames: sglang's global (multi-shot) sinks, in frames (its subject only).
        peers: other projects' caches to measure too, by name in :data:`PEERS` (their subjects
            run only at presets that name them).
    """

    name: str
    window_frames: int
    chunk_frames: int
    sink_frames: int
    tokens_per_frame: int
    heads: int
    head_dim: int
    dtype: str = "bfloat16"
    batch: int = 1
    repeats: int = 30
    scaling_windows: tuple[int, ...] = DEFAULT_SCALING_WINDOWS
    description: str = ""
    global_sink_frames: int = 0
    peers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for field in ("window_frames", "chunk_frames", "tokens_per_frame", "heads", "head_dim", "batch", "repeats"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"preset {self.name!r}: {field} must be an int >= 1, got {value!r}")
        if isinstance(self.sink_frames, bool) or not isinstance(self.sink_frames, int) or self.sink_frames < 0:
            raise ValueError(f"preset {self.name!r}: sink_frames must be an int >= 0, got {self.sink_frames!r}")
        if isinstance(self.global_sink_frames, bool) or not isinstance(self.global_sink_frames, int) \
                or self.global_sink_frames < 0:
            raise ValueError(f"preset {self.name!r}: global_sink_frames must be an int >= 0, got {self.global_sink_frames!r}")
        unknown = [p for p in self.peers if p not in PEERS]
        if unknown:
            raise ValueError(f"preset {self.name!r}: unknown peers {unknown}; known: {', '.join(PEERS)}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"preset {self.name!r}: dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.chunk_frames > self.window_frames:
            raise ValueError(
                f"preset {self.name!r}: chunk_frames ({self.chunk_frames}) must be <= window_frames ({self.window_frames})"
            )
        bad = [w for w in self.scaling_windows if not isinstance(w, int) or w < self.chunk_frames]
        if bad:
            raise ValueError(f"preset {self.name!r}: scaling windows must be ints >= chunk_frames, got {bad}")

    # ----------------------------------------------------------------- tokens
    @property
    def window(self) -> int:
        """Window size in tokens."""
        return self.window_frames * self.tokens_per_frame

    @property
    def chunk(self) -> int:
        """Chunk size in tokens."""
        return self.chunk_frames * self.tokens_per_frame

    @property
    def sink(self) -> int:
        """Sink size in tokens."""
        return self.sink_frames * self.tokens_per_frame

    @property
    def global_sink(self) -> int:
        """sglang's global sinks in tokens."""
        return self.global_sink_frames * self.tokens_per_frame

    @property
    def capacity(self) -> int:
        """Slots of the buffer: ``sink + window`` tokens."""
        return self.sink + self.window

    # ----------------------------------------------------------------- shapes
    seq_dim = 1

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def k_shape(self) -> tuple[int, int, int, int]:
        """One layer's key buffer, ``[batch, capacity, heads, head_dim]`` (values alike)."""
        return (self.batch, self.capacity, self.heads, self.head_dim)

    @property
    def chunk_shape(self) -> tuple[int, int, int, int]:
        """One chunk's keys (or values), ``[batch, chunk, heads, head_dim]``."""
        return (self.batch, self.chunk, self.heads, self.head_dim)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K *or* V row (all heads, all batch entries)."""
        return self.batch * self.heads * self.head_dim * self.torch_dtype.itemsize

    @property
    def buffer_bytes(self) -> int:
        """Bytes of one layer's K buffer (V is the same size)."""
        return self.capacity * self.token_bytes

    def with_window(self, window_frames: int) -> Preset:
        """The same geometry with another window (the scaling sweep)."""
        return dataclasses.replace(self, window_frames=window_frames)

    def to_dict(self) -> dict[str, Any]:
        """The preset as recorded in the JSON, with the derived token counts and shapes."""
        d = dataclasses.asdict(self)
        d["scaling_windows"] = list(self.scaling_windows)
        d["peers"] = list(self.peers)
        d.update(
            window_tokens=self.window, chunk_tokens=self.chunk, sink_tokens=self.sink,
            capacity_tokens=self.capacity, k_shape=list(self.k_shape), v_shape=list(self.k_shape),
            seq_dim=self.seq_dim, buffer_bytes=self.buffer_bytes,
        )
        return d


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "self-forcing", window_frames=21, chunk_frames=3, sink_frames=0, tokens_per_frame=1560,
            heads=12, head_dim=128,
            description="Self-Forcing / Wan2.1-T2V-1.3B, one layer, one CFG branch: 21-frame window, "
            "3-frame chunks, 1,560 tokens per frame (480x832), 12 heads x 128, bf16, no sink",
        ),
        Preset(
            "self-forcing-sink", window_frames=21, chunk_frames=3, sink_frames=3, tokens_per_frame=1560,
            heads=12, head_dim=128,
            description="self-forcing with a 3-frame pinned sink (the first chunk)",
        ),
        Preset(
            "lingbot", window_frames=63, chunk_frames=3, sink_frames=0, tokens_per_frame=1508,
            heads=10, head_dim=128, repeats=20,
            description="flashdreams lingbot-world-fast: 63-frame window, 3-frame chunks, no sink, "
            "1,508 tokens per frame (464x832); 14B model's 40 heads on a 4-way Ulysses shard = 10 x 128 per rank",
        ),
        Preset(
            "small", window_frames=21, chunk_frames=3, sink_frames=0, tokens_per_frame=32,
            heads=2, head_dim=32, repeats=30,
            description="self-forcing's frame structure at a toy size, for quick runs and tests",
        ),
        Preset(
            "krea-realtime-14b", window_frames=21, chunk_frames=3, sink_frames=0, tokens_per_frame=1560,
            heads=40, head_dim=128, repeats=10, scaling_windows=(), peers=("sglang",),
            description="Krea Realtime 14B (Self-Forcing distilled from Wan2.1-14B, one B200: reference/video-anchors.md "
            "2.6) as sglang 0.5.23 serves it with its causal Wan defaults (WanVideoArchConfig: 40 layers, 40 heads x 128, "
            "sink_size 0, num_frames_per_block 3, sliding_window_num_frames 21: a 21-frame cache); 480x832 -> 30x52 = "
            "1,560 tokens per latent frame (video-anchors 1.1); Krea's own window is not in the reference notes",
        ),
        Preset(
            "longlive2", window_frames=24, chunk_frames=8, sink_frames=8, tokens_per_frame=880,
            heads=24, head_dim=128, repeats=10, scaling_windows=(), global_sink_frames=8, peers=("sglang",),
            description="LongLive 2 (Wan2.2-TI2V-5B) in sglang 0.5.23: LongLive2ArchConfig local_attn_size 32 frames "
            "(the cache, sinks included), sink_size 8, num_frames_per_block 8, 30 layers, 24 heads x 128; multi-shot "
            "sinks on (global_sink_tokens = the 8 sink frames); 704x1280 with the TI2V VAE's 16x stride and 2x2 "
            "patches -> 22x40 = 880 tokens per frame (video-anchors 2.3 v2.0)",
        ),
        Preset(
            "lingbot-world", window_frames=42, chunk_frames=3, sink_frames=3, tokens_per_frame=1560,
            heads=40, head_dim=128, repeats=5, scaling_windows=(), peers=("sglang",),
            description="LingBot-World (one Wan2.2-A14B expert) in sglang 0.5.23: LingBotWorldArchConfig "
            "sliding_window_num_frames 45 (the cache, sinks included), sink_size 3, num_frames_per_block 3, 40 layers, "
            "40 heads x 128; 832x480 realtime default -> 1,560 tokens per frame (video-anchors 2.10); the whole "
            "model on one GPU (sglang's Ulysses shard divides the heads)",
        ),
    )
}


def get_preset(name: str) -> Preset:
    """The preset called ``name``; ``ValueError`` naming the choices otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}") from None
