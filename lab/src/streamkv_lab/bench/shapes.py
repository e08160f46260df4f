"""The shapes of ``streamkv bench --read`` and ``streamkv chart``: one attention layer of a
streaming model, as the read and the cache see it, scaled to what a CPU can time.

A shape is one layer's cache (``[batch 1, tokens, kv heads, head_dim]``, seq_dim 1) and the
span that reads it:

==================  =======  =======  ======  ========  ======  =========================
shape               tokens   sink     span    heads     D       from
==================  =======  =======  ======  ========  ======  =========================
``self-forcing``     32,760        0   4,680   1 (12)    128     the ``self-forcing`` preset
``lingbot-world``    70,200    4,680   4,680   1 (40)    128     the ``lingbot-world`` preset
``smollm2-decode``    8,192        4       1   3 / 9q     64     SmolLM2-135M at its context
``smollm2-prefill``   8,192        4     256   3 / 9q     64     the same, a prefill chunk
``tiny-video``          384       32      32   1         32     tests (the toy model's frames)
``tiny-decode``         128        4       1   1 / 3q     16     tests
==================  =======  =======  ======  ========  ======  =========================

``tokens`` is what the full cache holds (``sink + window``: the video presets' whole cache;
SmolLM2's 8,192-token context); ``span`` is the rows written and read per forward: a video
chunk (every query of the chunk reads the cache), a prefill chunk (position-causal), or one
decoded token. The video shapes keep the presets' geometry (tokens per frame, chunk, sink,
head_dim, bf16) and measure **one** of the layer's heads (in parentheses: the model's): every
cost of a read and of the cache's work is linear in the heads (one head is its own attention,
its own slots), so ratios between caches are the layer's; the per-call overhead of a step is
not, and weighs more at one head than at 12 (the ratios are then conservative for a cache whose
work is a fixed number of calls). SmolLM2's layer is small enough to measure whole (3 key/value
heads, 9 query heads: grouped-query attention). ``fill`` is the span the cache is filled with
before the measured ones (a decode cache is filled by prefill chunks, then decodes a token).

``family`` names the stream whose errors a chart row reports: ``video`` (the trained toy
model's own Q/K/V) or ``lm`` (SmolLM2's on Moby-Dick).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from streamkv_lab.bench.presets import get_preset

__all__ = ["Shape", "SHAPES", "READ_SHAPES", "CHART_SHAPES", "TEST_SHAPES", "get_shape"]

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class Shape:
    """One layer's cache and the span that reads it (module docstring). Token counts in tokens."""

    name: str
    family: str  # "video" (the toy model's stream gives the errors) or "lm" (SmolLM2's)
    sink: int
    capacity: int  # the full cache's tokens (sink + window)
    span: int  # rows written and read per forward (the queries)
    fill: int  # the cache's chunk: the span it is filled with (>= span)
    heads: int  # key/value heads measured
    q_heads: int  # query heads measured (a multiple of heads)
    head_dim: int
    model_heads: int  # key/value heads of the model's layer (heads / model_heads of it is measured)
    tokens_per_frame: int = 1  # > 1: a video shape (frames are the units of its position maps)
    grid: tuple[int, int] = (1, 1)  # latent frame grid (height, width) of a video shape
    dtype: str = "bfloat16"
    description: str = ""

    def __post_init__(self) -> None:
        if self.family not in ("video", "lm"):
            raise ValueError(f"shape {self.name!r}: family must be 'video' or 'lm', got {self.family!r}")
        if not 1 <= self.span <= self.fill or self.sink + 2 * self.fill > self.capacity:
            raise ValueError(f"shape {self.name!r}: need 1 <= span <= fill and sink + 2 fills <= capacity, got "
                             f"span {self.span}, fill {self.fill}, sink {self.sink}, capacity {self.capacity}")
        if self.q_heads % self.heads:
            raise ValueError(f"shape {self.name!r}: q_heads ({self.q_heads}) must be a multiple of heads ({self.heads})")
        if self.tokens_per_frame > 1 and self.grid[0] * self.grid[1] != self.tokens_per_frame:
            raise ValueError(f"shape {self.name!r}: grid {self.grid} must hold tokens_per_frame ({self.tokens_per_frame})")
        if self.dtype not in _DTYPES:
            raise ValueError(f"shape {self.name!r}: dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def window(self) -> int:
        return self.capacity - self.sink

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def video(self) -> bool:
        return self.tokens_per_frame > 1

    @property
    def causal(self) -> bool:
        """Position-causal queries: an LLM's prefill chunk (a decoded token sees everything)."""
        return self.family == "lm" and self.span > 1

    @property
    def k_shape(self) -> tuple[int, int, int, int]:
        return (1, self.capacity, self.heads, self.head_dim)

    def with_capacity(self, capacity: int) -> tuple[int, int]:
        """``(sink, window)`` of a cache of ``capacity`` tokens at this shape's sink."""
        return self.sink, capacity - self.sink

    def token_bytes(self) -> int:
        """Bytes of one token's K and V in the measured heads, dense in the shape's dtype."""
        return 2 * self.heads * self.head_dim * self.torch_dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["grid"] = list(self.grid)
        d.update(window=self.window, causal=self.causal, heads_measured=self.heads,
                 full_bytes=self.capacity * self.token_bytes())
        return d


def _from_preset(name: str, description: str) -> Shape:
    p = get_preset(name)
    grid = (p.tokens_per_frame // 52, 52) if p.tokens_per_frame % 52 == 0 else (1, p.tokens_per_frame)
    return Shape(name, "video", sink=p.sink, capacity=p.capacity, span=p.chunk, fill=p.chunk, heads=1, q_heads=1,
                 head_dim=p.head_dim, model_heads=p.heads, tokens_per_frame=p.tokens_per_frame, grid=grid,
                 dtype=p.dtype, description=description)


SHAPES: dict[str, Shape] = {s.name: s for s in (
    _from_preset("self-forcing", "Self-Forcing (Wan2.1-1.3B) layer: 21 frames x 1,560 tokens, 3-frame chunks, no "
                 "sink, 128 channels; one of its 12 heads"),
    _from_preset("lingbot-world", "LingBot-World (Wan2.2-A14B expert) layer: 45 frames x 1,560 tokens (3 sink "
                 "frames), 3-frame chunks, 128 channels; one of its 40 heads"),
    Shape("smollm2-decode", "lm", sink=4, capacity=8192, span=1, fill=256, heads=3, q_heads=9, head_dim=64,
          model_heads=3, description="SmolLM2-135M layer at its 8,192-token context, one decoded token (9 query "
          "heads over 3 key/value heads x 64)"),
    Shape("smollm2-prefill", "lm", sink=4, capacity=8192, span=256, fill=256, heads=3, q_heads=9, head_dim=64,
          model_heads=3, description="SmolLM2-135M layer at its 8,192-token context, a 256-token prefill chunk "
          "(position-causal)"),
    Shape("tiny-video", "video", sink=32, capacity=384, span=32, fill=32, heads=1, q_heads=1, head_dim=32,
          model_heads=4, tokens_per_frame=16, grid=(4, 4), description="the toy model's frames (16 tokens, "
          "2-frame chunks, 32 channels): tests and quick looks"),
    Shape("tiny-decode", "lm", sink=4, capacity=128, span=1, fill=16, heads=1, q_heads=3, head_dim=16,
          model_heads=1, description="a small decode: tests and quick looks"),
)}

#: the defaults of each command (the rest run when named)
READ_SHAPES = ("self-forcing", "lingbot-world", "smollm2-decode")
CHART_SHAPES = ("self-forcing", "lingbot-world", "smollm2-decode", "smollm2-prefill")
TEST_SHAPES = ("tiny-video", "tiny-decode")


def get_shape(name: str) -> Shape:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}") from None
