"""Model configurations: the embedded ``tiny`` default and the Wan 2.1 1.3B shape."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..validate import check_int


@dataclass(frozen=True)
class DiTConfig:
    """Shape of a causal Wan-style DiT and of its streaming cache.

    Token geometry: a latent frame of ``latent_h x latent_w`` (``in_channels``
    channels) is patchified by ``patch x patch`` into ``grid_h x grid_w`` tokens.
    Chunks, windows and sinks are counted in frames here and in tokens on the cache.
    """

    name: str
    dim: int
    heads: int
    ffn: int
    layers: int
    text_dim: int
    text_len: int
    latent_h: int
    latent_w: int
    frames_per_chunk: int
    window_frames: int
    sink_frames: int
    in_channels: int = 16
    patch: int = 2
    max_frames: int = 1024
    freq_dim: int = 256
    eps: float = 1e-6
    rope_theta: float = 10000.0  # RoPE base (Wan's); small grids discriminate positions better with less

    def __post_init__(self) -> None:
        for name in ("dim", "heads", "ffn", "layers", "text_dim", "text_len", "latent_h", "latent_w",
                     "frames_per_chunk", "window_frames", "in_channels", "patch", "max_frames", "freq_dim"):
            check_int(name, getattr(self, name), 1)
        check_int("sink_frames", self.sink_frames, 0)
        if self.freq_dim % 2:
            raise ValueError(f"freq_dim must be even (a cos and a sin half), got {self.freq_dim}")
        for name in ("eps", "rope_theta"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not (math.isfinite(x) and x > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {x!r}")
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by heads ({self.heads})")
        if self.latent_h % self.patch or self.latent_w % self.patch:
            raise ValueError(f"latent size {self.latent_h}x{self.latent_w} must be divisible by patch {self.patch}")
        if self.frames_per_chunk > self.window_frames:
            raise ValueError(
                f"frames_per_chunk ({self.frames_per_chunk}) must be <= window_frames ({self.window_frames})"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def grid_h(self) -> int:
        return self.latent_h // self.patch

    @property
    def grid_w(self) -> int:
        return self.latent_w // self.patch

    @property
    def tokens_per_frame(self) -> int:
        return self.grid_h * self.grid_w

    @property
    def chunk_tokens(self) -> int:
        return self.frames_per_chunk * self.tokens_per_frame

    @property
    def window_tokens(self) -> int:
        return self.window_frames * self.tokens_per_frame

    @property
    def sink_tokens(self) -> int:
        return self.sink_frames * self.tokens_per_frame

    @property
    def max_chunks(self) -> int:
        """Chunks a stream can hold before the RoPE horizon."""
        return self.max_frames // self.frames_per_chunk

    def to_dict(self) -> dict:
        return asdict(self)


CONFIGS: dict[str, DiTConfig] = {
    # runs a whole demo on 2 CPU cores in seconds: 16 tokens per frame, 2-frame chunks,
    # a 1-frame sink (half a chunk: chunk 0 straddles the sink boundary) and a 5-frame
    # window (not a multiple of the chunk: chunks wrap across the end of the ring)
    "tiny": DiTConfig(
        name="tiny", dim=64, heads=4, ffn=128, layers=2, text_dim=32, text_len=8,
        latent_h=8, latent_w=8, frames_per_chunk=2, window_frames=5, sink_frames=1, max_frames=64,
    ),
    # the Self-Forcing window geometry (3-frame chunks, 21-frame window) at a CPU-sized
    # width: where cache maintenance is a visible share of a chunk on a CPU
    "small": DiTConfig(
        name="small", dim=256, heads=4, ffn=512, layers=2, text_dim=64, text_len=16,
        latent_h=24, latent_w=40, frames_per_chunk=3, window_frames=21, sink_frames=0, max_frames=1024,
    ),
    # the trained toy (streamkv_lab.video): 16x16 RGB pixels as the latent (3 channels), 4x4
    # patches -> a 4x4 grid of tokens per frame, 2-frame chunks; the default cache holds the
    # first chunk as a sink and a 6-frame window; trained on 16-frame clips (max_frames: long
    # demos); RoPE base 100: on a 4x4 grid Wan's 10000 leaves one usable spatial frequency
    "toy": DiTConfig(
        name="toy", dim=128, heads=4, ffn=512, layers=4, text_dim=16, text_len=4,
        latent_h=16, latent_w=16, frames_per_chunk=2, window_frames=6, sink_frames=2, in_channels=3, patch=4,
        max_frames=256, rope_theta=100.0,
    ),
    # Wan 2.1 T2V 1.3B as run by Self-Forcing: 480x832 -> 60x104 latent -> 30x52 = 1,560
    # tokens per frame, 3-frame chunks, 21-frame window
    "wan2.1-1.3b": DiTConfig(
        name="wan2.1-1.3b", dim=1536, heads=12, ffn=8960, layers=30, text_dim=4096, text_len=512,
        latent_h=60, latent_w=104, frames_per_chunk=3, window_frames=21, sink_frames=0, max_frames=1024,
    ),
}


def get_config(name: str) -> DiTConfig:
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown model config {name!r}; choose one of {sorted(CONFIGS)}") from None
